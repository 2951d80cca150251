"""The encoder as a masked LM: WordPiece tokenizer, DataCollatorForLanguageModeling, Trainer, pipeline("fill-mask")."""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
from transformers import (
    AutoModel,
    AutoModelForMaskedLM,
    DataCollatorForLanguageModeling,
    PreTrainedTokenizerFast,
    Trainer,
    TrainingArguments,
    pipeline,
)

from archlab import EncoderForMaskedLM, EncoderModel, Seq2SeqConfig, Seq2SeqModel

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def corpus() -> list[str]:
    """Every window of 6 consecutive words of a cyclic sequence: each word is predictable from its neighbours."""
    cyclic = WORDS + WORDS
    return [" ".join(cyclic[i : i + 6]) for i in range(len(WORDS))]


def wordpiece_tokenizer() -> PreTrainedTokenizerFast:
    """A BERT-style WordPiece tokenizer trained on the corpus with the `tokenizers` library (seed 001's recipe)."""
    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.train_from_iterator(corpus() * 4, trainers.WordPieceTrainer(vocab_size=120, special_tokens=SPECIALS))
    cls, sep = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]", special_tokens=[("[CLS]", cls), ("[SEP]", sep)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token="[PAD]",
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
    )


def tiny_mlm(tokenizer: PreTrainedTokenizerFast, **overrides) -> EncoderForMaskedLM:
    fields = dict(
        vocab_size=len(tokenizer),
        d_model=32,
        encoder_layers=2,
        decoder_layers=1,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=32,
        activation_function="gelu",
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.cls_token_id,
        eos_token_id=tokenizer.sep_token_id,
        decoder_start_token_id=tokenizer.cls_token_id,
    )
    config = Seq2SeqConfig(**{**fields, **overrides})
    return EncoderForMaskedLM(config)


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return wordpiece_tokenizer()


def test_wordpiece_tokenizer_knows_the_words(tokenizer):
    ids = tokenizer("alpha beta [MASK] delta")["input_ids"]
    assert tokenizer.convert_ids_to_tokens(ids) == ["[CLS]", "alpha", "beta", "[MASK]", "delta", "[SEP]"]


def test_collator_batch_trains_and_sparse_loss_equals_full(tokenizer):
    model = tiny_mlm(tokenizer, dropout=0.0)
    collator = DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.3, seed=0)
    batch = collator([tokenizer(text) for text in corpus()[:6]])
    assert (batch["labels"] != -100).any() and batch["input_ids"].eq(tokenizer.mask_token_id).any()
    model.eval()
    full = model(**batch)
    assert full.logits.shape == (*batch["input_ids"].shape, len(tokenizer))
    model.train()
    sparse = model(**batch)  # the head runs on the labelled positions only
    assert sparse.logits is None
    torch.testing.assert_close(sparse.loss, full.loss)
    sparse.loss.backward()
    assert model.encoder.embed_tokens.weight.grad.abs().sum() > 0
    assert model.lm_head.decoder.weight is model.encoder.embed_tokens.weight  # tied output projection


def test_bidirectional_every_position_sees_the_future(tokenizer):
    model = tiny_mlm(tokenizer, dropout=0.0, init_std=0.2).eval()
    ids = tokenizer(["alpha beta gamma delta"], return_tensors="pt")["input_ids"]
    changed = ids.clone()
    changed[0, -2] = tokenizer.convert_tokens_to_ids("mu")
    with torch.no_grad():
        assert not torch.allclose(model(input_ids=ids).logits[0, 1], model(input_ids=changed).logits[0, 1])


def test_fill_mask_pipeline_and_save_load(tokenizer, tmp_path):
    model = tiny_mlm(tokenizer).eval()
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    loaded = AutoModelForMaskedLM.from_pretrained(tmp_path)
    assert type(loaded) is EncoderForMaskedLM
    fill = pipeline("fill-mask", model=str(tmp_path), tokenizer=str(tmp_path), top_k=3)
    predictions = fill("alpha beta [MASK] delta")
    assert len(predictions) == 3 and all(p["token_str"] for p in predictions)
    with torch.no_grad():
        ids = tokenizer("alpha beta [MASK] delta", return_tensors="pt")
        top = model(**ids).logits[0, 3].topk(3).indices.tolist()
    assert [p["token"] for p in predictions] == top


def test_auto_model_of_a_masked_lm_folder_is_its_encoder(tokenizer, tmp_path):
    """As `BertModel` for a BERT folder: `AutoModel` and `pipeline("feature-extraction")` give the encoder's hidden
    states (they built an encoder-decoder with a random decoder, which then asked for `decoder_input_ids`), and the
    encoder's folder opens as a masked LM again (a new head, the encoder kept)."""
    torch.manual_seed(0)
    model = tiny_mlm(tokenizer).eval()
    model.save_pretrained(tmp_path / "mlm")
    tokenizer.save_pretrained(tmp_path / "mlm")
    ids = tokenizer("alpha beta gamma delta", return_tensors="pt")
    with torch.no_grad():
        expected = model.encoder(input_ids=ids["input_ids"]).last_hidden_state
    for loaded in (AutoModel.from_pretrained(tmp_path / "mlm"), Seq2SeqModel.from_pretrained(tmp_path / "mlm")):
        assert type(loaded) is EncoderModel
        with torch.no_grad():
            torch.testing.assert_close(loaded(**ids).last_hidden_state, expected, rtol=0, atol=1e-6)
    features = pipeline("feature-extraction", model=str(tmp_path / "mlm"))("alpha beta gamma delta")
    torch.testing.assert_close(torch.tensor(features), expected, rtol=0, atol=1e-5)

    AutoModel.from_pretrained(tmp_path / "mlm").save_pretrained(tmp_path / "encoder")
    assert type(AutoModel.from_pretrained(tmp_path / "encoder")) is EncoderModel
    again = AutoModelForMaskedLM.from_pretrained(tmp_path / "encoder")
    torch.testing.assert_close(again.encoder.embed_tokens.weight, model.encoder.embed_tokens.weight)


def test_auto_model_of_an_encoder_decoder_folder_stays_the_encoder_decoder(tmp_path):
    config = tiny_mlm(wordpiece_tokenizer()).config
    Seq2SeqModel(config).save_pretrained(tmp_path)
    assert type(AutoModel.from_pretrained(tmp_path)) is Seq2SeqModel


@pytest.mark.parametrize("model_class", [EncoderModel, EncoderForMaskedLM])
def test_an_encoder_decoders_folder_gives_its_encoder_to_an_encoder_only_model(model_class, tmp_path):
    """As `T5EncoderModel` from a T5 folder: the encoder's token embeddings, saved as the shared `model.shared`, were
    left random (one line in the loading report); they are read, the decoder is left out without a word, and the
    model saves under its own names."""
    from archlab import Seq2SeqForConditionalGeneration

    torch.manual_seed(0)
    seq2seq = Seq2SeqForConditionalGeneration(tiny_mlm(wordpiece_tokenizer()).config)
    seq2seq.save_pretrained(tmp_path / "seq2seq")
    model, info = model_class.from_pretrained(tmp_path / "seq2seq", output_loading_info=True)
    assert {key.split(".")[0] for key in info["missing_keys"]} <= {"lm_head"} and info["unexpected_keys"] == set()
    kept = seq2seq.model.encoder.state_dict()
    assert [k for k, v in model.encoder.state_dict().items() if not torch.equal(v, kept[k])] == []
    model.save_pretrained(tmp_path / "encoder")
    again = model_class.from_pretrained(tmp_path / "encoder")
    assert all(torch.equal(v, again.state_dict()[k]) for k, v in model.state_dict().items())


@pytest.mark.slow
def test_trainer_teaches_fill_mask(tokenizer, tmp_path):
    """Seed 001's workflow end to end: WordPiece + DataCollatorForLanguageModeling + Trainer + fill-mask."""
    torch.manual_seed(0)
    model = tiny_mlm(tokenizer, dropout=0.0, norm_position="pre", d_model=64, encoder_ffn_dim=128)
    dataset = [tokenizer(text) for text in corpus()] * 36
    args = TrainingArguments(
        str(tmp_path),
        per_device_train_batch_size=36,
        max_steps=300,
        learning_rate=2e-3,
        lr_scheduler_type="constant",
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        logging_steps=100,
        seed=0,
    )
    collator = DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.25, seed=0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model only loses to threading overhead
    try:
        Trainer(model=model, args=args, train_dataset=dataset, data_collator=collator).train()
    finally:
        torch.set_num_threads(threads)
    fill = pipeline("fill-mask", model=model.eval(), tokenizer=tokenizer, top_k=1)
    correct = 0
    for i in range(len(WORDS)):
        words = (WORDS + WORDS)[i : i + 5]
        answer, words[2] = words[2], "[MASK]"
        correct += fill(" ".join(words))[0]["token_str"] == answer
    assert correct >= len(WORDS) - 1, correct


@pytest.mark.parametrize("trained", [False, True])
def test_the_pad_row_is_trained_as_the_config_says(trained):
    """`train_pad_embedding` was honoured by the encoder-decoder and not by its encoder alone as a masked LM: the pad
    row is Marian/Bart's `padding_idx` (zero, no gradient from the lookup) unless the config trains it."""
    config = Seq2SeqConfig(
        vocab_size=40,
        d_model=16,
        encoder_layers=1,
        encoder_attention_heads=2,
        encoder_ffn_dim=32,
        train_pad_embedding=trained,
    )
    embeddings = EncoderForMaskedLM(config).get_input_embeddings()
    assert embeddings.padding_idx == (None if trained else config.pad_token_id)
    assert bool(embeddings.weight[config.pad_token_id].abs().sum() > 0) == trained
