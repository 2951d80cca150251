"""The encoder-decoder: Marian parity, masks, cache, generation, loss, save/load, catalogue configs, a toy task."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForSeq2SeqLM, MarianConfig, MarianMTModel, Seq2SeqTrainer, Seq2SeqTrainingArguments

from archlab import EncoderForMaskedLM, Seq2SeqConfig, Seq2SeqForConditionalGeneration, Seq2SeqModel, translate
from archlab.modeling.modeling_seq2seq import shift_tokens_right

from helpers import TINY_SEQ2SEQ, assert_close_to_scale, digit_tokenizer

PAD, EOS, START = 0, 2, 1
SMALL = dict(TINY_SEQ2SEQ, init_std=0.2)  # large enough that random models prefer different tokens at different steps
# Marian's token conventions: pad is also the decoder start token, eos is 0.
MARIAN = dict(
    SMALL,
    activation_function="swish",
    scale_embedding=True,
    pad_token_id=60,
    eos_token_id=0,
    decoder_start_token_id=60,
    bos_token_id=None,
    forced_eos_token_id=0,
)
CATALOGUE = {
    "classic": dict(),
    "pre_rms_gated_gqa": dict(
        norm_position="pre",
        norm_type="rms_norm",
        mlp_type="gated",
        activation_function="silu",
        encoder_key_value_heads=2,
        decoder_key_value_heads=1,
        position_embedding_type="learned",
    ),
    "sandwich_untied": dict(
        norm_position="sandwich",
        norm_type="offset_rms_norm",
        share_encoder_decoder_embeddings=False,
        tie_word_embeddings=False,
        decoder_vocab_size=45,
        position_embedding_type="none",
        attention_bias=False,
        mlp_bias=False,
    ),
    "t5_style": dict(
        norm_position="pre",
        norm_type="rms_norm",
        mlp_type="gated",
        activation_function="gelu_new",
        position_embedding_type="relative_bias",
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
        scale_embedding=False,
        attention_bias=False,
        mlp_bias=False,
        decoder_key_value_heads=2,
        d_kv=12,
        scale_attn_weights=False,
        scale_decoder_outputs=True,
        layer_norm_eps=1e-6,
    ),
    "pre_qk_norm_softcap": dict(
        norm_position="pre",
        norm_type="layer_norm",
        use_qk_norm=True,
        attn_logit_softcapping=3.0,
        final_logit_softcapping=5.0,
        encoder_key_value_heads=1,
    ),
}


def tiny(**overrides) -> Seq2SeqForConditionalGeneration:
    return Seq2SeqForConditionalGeneration(Seq2SeqConfig(**{**SMALL, **overrides})).eval()


def batch(vocab: int = 45, source_len: int = 9, target_len: int = 7):
    """Two sources, the second right-padded, and two target prefixes."""
    generator = torch.Generator().manual_seed(1)
    source = torch.randint(3, vocab, (2, source_len), generator=generator)
    mask = torch.ones_like(source)
    mask[1, 5:] = 0
    source[1, 5:] = PAD
    target = torch.randint(3, vocab, (2, target_len), generator=generator)
    return source, mask, target


def marian_pair() -> tuple[MarianMTModel, Seq2SeqForConditionalGeneration]:
    reference = MarianMTModel(MarianConfig(**MARIAN)).eval()
    ours = Seq2SeqForConditionalGeneration(Seq2SeqConfig(**MARIAN, sinusoidal_layout="split")).eval()
    state = reference.state_dict()
    state["final_logits_bias"].normal_()  # opus-mt checkpoints carry a real output bias
    reference.load_state_dict(state)
    ours.load_state_dict(state, strict=True)
    return reference, ours


# ---- config ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(norm_position="middle"), "`norm_position`='middle' is not supported; allowed values: 'post', 'pre'"),
        (dict(mlp_type="moe"), "`mlp_type`"),
        (dict(sinusoidal_layout="halves"), "'interleaved', 'split'"),
        (dict(label_shift="mbart"), "`label_shift`='mbart' is not supported; allowed values: 'decoder_start_token', "),
        (dict(d_model=30), "`d_model` \\(30\\) must be divisible by `encoder_attention_heads`"),
        (dict(decoder_key_value_heads=3), "`decoder_key_value_heads` \\(3\\) must divide"),
        (dict(activation_dropout=1.0), "`activation_dropout` must be a probability"),
        (dict(decoder_vocab_size=50), "`decoder_vocab_size` \\(50\\) must equal `vocab_size`"),
        (dict(activation_function="relu7"), "`activation_function`"),
        (dict(position_embedding_type="rotary"), "'sinusoidal', 'learned', 'relative_bias', 'none'"),
        (dict(position_embedding_type="relative_bias", relative_attention_max_distance=4), "must exceed"),
        (dict(d_model="32"), "`d_model` must be an int, got '32' \\(a str\\)"),
        (dict(dropout="0.1"), "`dropout` must be an int or a float, got '0.1'"),
        (dict(layer_norm_eps="1e-5"), "`layer_norm_eps` must be a float, got '1e-5'"),
    ],
)
def test_bad_config_values_fail_at_construction(overrides, message):
    with pytest.raises(ValueError, match=message):
        Seq2SeqConfig(**{**SMALL, **overrides})


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(decoder_key_value_heads=3), "`decoder_key_value_heads` \\(3\\) must divide"),
        (dict(dropout=1.5), "`dropout` must be a probability"),
        (dict(norm_position="deepnorm"), "`norm_position`='deepnorm' is not supported"),
        (dict(d_model="32"), "`d_model` must be an int, got '32'"),
    ],
)
def test_from_pretrained_overrides_fail_as_at_construction(tmp_path, overrides, message):
    """transformers sets `from_pretrained(folder, field=value)` overrides on the built config, past its checks: each
    of these loaded a model that failed later (a shape error in the first forward for the key/value heads)."""
    Seq2SeqConfig(**SMALL).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=message):
        AutoModelForSeq2SeqLM.from_pretrained(tmp_path, **overrides)


def test_defaults_are_the_papers_base_model():
    config = Seq2SeqConfig()
    assert (config.d_model, config.encoder_layers, config.decoder_layers, config.encoder_attention_heads) == (
        512,
        6,
        6,
        8,
    )
    assert (config.encoder_ffn_dim, config.activation_function, config.dropout) == (2048, "relu", 0.1)
    assert config.norm_position == "post" and config.scale_embedding and config.sinusoidal_layout == "interleaved"
    assert config.hidden_size == 512 and config.num_hidden_layers == 6  # Marian's attribute map


# ---- Marian parity ---------------------------------------------------------------------------------------------


def test_marian_state_dict_loads_strictly_and_logits_match():
    reference, ours = marian_pair()
    source, mask, target = batch()
    with torch.no_grad():
        expected = reference(input_ids=source, attention_mask=mask, decoder_input_ids=target).logits
        got = ours(input_ids=source, attention_mask=mask, decoder_input_ids=target).logits
    assert (got - expected).abs().max() <= 1e-4
    assert set(ours.state_dict()) == set(reference.state_dict())


def test_marian_loss_matches():
    reference, ours = marian_pair()
    source, mask, labels = batch()
    with torch.no_grad():
        expected = reference(input_ids=source, attention_mask=mask, labels=labels).loss
        got = ours(input_ids=source, attention_mask=mask, labels=labels).loss
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "generate_kwargs",
    [
        dict(num_beams=4, max_new_tokens=12),
        dict(num_beams=3, max_new_tokens=10, length_penalty=0.6, early_stopping=True, num_return_sequences=2),
        dict(num_beams=1, max_new_tokens=10),
        dict(num_beams=1, max_new_tokens=10, do_sample=True, top_k=20),
    ],
    ids=["beam", "beam_lp_early_stop", "greedy", "sampling"],
)
def test_generation_matches_marian(generate_kwargs):
    reference, ours = marian_pair()
    source, mask, _ = batch()
    torch.manual_seed(3)
    expected = reference.generate(input_ids=source, attention_mask=mask, **generate_kwargs)
    torch.manual_seed(3)
    got = ours.generate(input_ids=source, attention_mask=mask, **generate_kwargs)
    assert torch.equal(got, expected)
    assert len(set(map(tuple, got.tolist()))) > 1 or generate_kwargs.get("num_return_sequences") is None


def test_forced_bos_and_eos():
    model = tiny(vocab_size=45, forced_eos_token_id=EOS)
    source, mask, _ = batch()
    out = model.generate(input_ids=source, attention_mask=mask, num_beams=2, max_new_tokens=6, forced_bos_token_id=7)
    assert out[:, 0].eq(START).all() and out[:, 1].eq(7).all()
    assert out[:, -1].eq(EOS).all() or out.eq(EOS).any(-1).all()


# ---- masks -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CATALOGUE))
def test_source_padding_is_invisible(name):
    """The padded row's encoder output and decoder logits equal those of the same row without padding."""
    model = tiny(**CATALOGUE[name])
    source, mask, target = batch()
    with torch.no_grad():
        padded = model(input_ids=source, attention_mask=mask, decoder_input_ids=target)
        alone = model(input_ids=source[1:, :5], decoder_input_ids=target[1:])
        garbage = source.clone()
        garbage[1, 5:] = 17  # other content under the mask changes nothing (cross-attention padding)
        masked_garbage = model(input_ids=garbage, attention_mask=mask, decoder_input_ids=target)
    assert_close_to_scale(padded.encoder_last_hidden_state[1, :5], alone.encoder_last_hidden_state[0], rtol=1e-5)
    assert_close_to_scale(padded.logits[1], alone.logits[0], rtol=1e-5)
    torch.testing.assert_close(masked_garbage.logits, padded.logits)


@pytest.mark.parametrize("name", list(CATALOGUE))
def test_target_is_causal(name):
    model = tiny(**CATALOGUE[name])
    source, mask, target = batch()
    changed = target.clone()
    changed[:, 4:] = 5
    with torch.no_grad():
        a = model(input_ids=source, attention_mask=mask, decoder_input_ids=target).logits
        b = model(input_ids=source, attention_mask=mask, decoder_input_ids=changed).logits
    torch.testing.assert_close(a[:, :4], b[:, :4])
    assert not torch.allclose(a[:, 4:], b[:, 4:])


@pytest.mark.parametrize("kind, order_matters", [("none", False), ("relative_bias", True), ("learned", True)])
def test_position_information_reaches_the_encoder(kind, order_matters):
    """Without positions the encoder is permutation-equivariant; T5's bias (or a table) breaks the symmetry."""
    model = tiny(**{**CATALOGUE["t5_style"], "position_embedding_type": kind})
    source = torch.randint(3, 45, (1, 8))
    with torch.no_grad():
        forward = model.get_encoder()(input_ids=source).last_hidden_state
        backward = model.get_encoder()(input_ids=source.flip(1)).last_hidden_state.flip(1)
    assert torch.allclose(forward, backward, atol=1e-5) != order_matters


# ---- cache, kernels --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CATALOGUE))
def test_incremental_decoding_equals_full_forward(name):
    model = tiny(**CATALOGUE[name])
    source, mask, target = batch()
    with torch.no_grad():
        full = model(input_ids=source, attention_mask=mask, decoder_input_ids=target).logits
        encoded = model.get_encoder()(input_ids=source, attention_mask=mask)
        step = model(encoder_outputs=encoded, attention_mask=mask, decoder_input_ids=target[:, :3], use_cache=True)
        logits, cache = [step.logits], step.past_key_values
        for t in range(3, target.shape[1]):
            step = model(
                encoder_outputs=encoded,
                attention_mask=mask,
                decoder_input_ids=target[:, t : t + 1],
                past_key_values=cache,
                use_cache=True,
            )
            logits.append(step.logits)
            cache = step.past_key_values
    assert_close_to_scale(torch.cat(logits, 1), full, rtol=1e-5)


def test_cross_attention_keys_values_are_computed_once_per_sequence():
    model = tiny(vocab_size=45)
    source, mask, _ = batch()
    calls = {"k": 0, "self_k": 0}
    layer = model.model.decoder.layers[0]
    layer.encoder_attn.k_proj.register_forward_hook(lambda *_: calls.__setitem__("k", calls["k"] + 1))
    layer.self_attn.k_proj.register_forward_hook(lambda *_: calls.__setitem__("self_k", calls["self_k"] + 1))
    out = model.generate(input_ids=source, attention_mask=mask, num_beams=3, max_new_tokens=8, min_new_tokens=8)
    assert out.shape[1] == 9 and calls["self_k"] == 8
    assert calls["k"] == 1


@pytest.mark.parametrize("name", [name for name in CATALOGUE if "softcap" not in name])  # soft-capping runs eager only
def test_eager_equals_sdpa(name):
    model = tiny(**CATALOGUE[name])
    source, mask, target = batch()
    with torch.no_grad():
        sdpa = model(input_ids=source, attention_mask=mask, decoder_input_ids=target).logits
        model.set_attn_implementation("eager")
        eager = model(input_ids=source, attention_mask=mask, decoder_input_ids=target).logits
    assert_close_to_scale(eager, sdpa, rtol=1e-5)


def test_backends_that_would_drop_the_relative_bias_are_refused():
    model = tiny(**CATALOGUE["t5_style"])
    with pytest.raises(ValueError, match="'relative_bias' adds a bias"):
        model.set_attn_implementation("flex_attention")
    with pytest.raises(ValueError, match="'relative_bias' adds a bias"):
        Seq2SeqForConditionalGeneration(
            Seq2SeqConfig(**{**SMALL, **CATALOGUE["t5_style"]}, attn_implementation="flex_attention")
        )


# ---- training loss ---------------------------------------------------------------------------------------------


def test_labels_are_shifted_once():
    labels = torch.tensor([[5, 6, 7, EOS], [8, EOS, -100, -100]])
    assert shift_tokens_right(labels, PAD, START).tolist() == [[START, 5, 6, 7], [START, 8, EOS, PAD]]
    model = tiny(vocab_size=45)
    source, mask, _ = batch()
    with torch.no_grad():
        out = model(input_ids=source, attention_mask=mask, labels=labels)
        manual = model(input_ids=source, attention_mask=mask, decoder_input_ids=shift_tokens_right(labels, PAD, START))
    expected = F.cross_entropy(manual.logits.reshape(-1, 45), labels.reshape(-1), ignore_index=-100)
    torch.testing.assert_close(out.loss, expected)


@pytest.mark.parametrize("field", ["pad_token_id", "decoder_start_token_id"])
def test_labels_without_the_tokens_to_shift_them_name_the_field(field):
    labels = torch.tensor([[5, 6, EOS]])
    tokens = {"pad_token_id": PAD, "decoder_start_token_id": START, field: None}
    with pytest.raises(ValueError, match=f"`{field}` must be set in the config to build `decoder_input_ids`"):
        shift_tokens_right(labels, tokens["pad_token_id"], tokens["decoder_start_token_id"])
    model = tiny(vocab_size=45, decoder_start_token_id=None)
    with pytest.raises(ValueError, match="`decoder_start_token_id` must be set"):
        model(input_ids=labels, labels=labels)  # was a TypeError from `new_full`


def test_num_items_in_batch_and_chunked_training_loss():
    model = tiny(vocab_size=45, lm_loss_chunk_size=3)
    model.final_logits_bias.normal_()
    source, mask, labels = batch()
    labels[1, 4:] = -100
    inputs = dict(input_ids=source, attention_mask=mask, labels=labels)
    reference = model(**inputs, num_items_in_batch=20)  # eval: full logits
    n_tokens = (labels != -100).sum()
    torch.testing.assert_close(reference.loss * 20 / n_tokens, model(**inputs).loss)
    reference.loss.backward()
    expected_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    model.train()
    chunked = model(**inputs, num_items_in_batch=20)
    assert chunked.logits is None
    torch.testing.assert_close(chunked.loss, reference.loss)
    chunked.loss.backward()
    for name, grad in expected_grads.items():
        torch.testing.assert_close(dict(model.named_parameters())[name].grad, grad, atol=1e-5, rtol=1e-4)


def test_skip_logits_returns_the_loss_alone():
    model = tiny(vocab_size=45)
    source, mask, labels = batch()
    with torch.no_grad():
        full = model(input_ids=source, attention_mask=mask, labels=labels)
        skipped = model(input_ids=source, attention_mask=mask, labels=labels, skip_logits=True)
    assert skipped.logits is None and full.logits is not None
    torch.testing.assert_close(skipped.loss, full.loss)


def test_gradient_checkpointing_gives_the_same_gradients():
    model = tiny(**CATALOGUE["t5_style"]).train()
    source, mask, labels = batch()

    def grads():
        model.zero_grad()
        model(input_ids=source, attention_mask=mask, labels=labels).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain = grads()
    model.gradient_checkpointing_enable()
    checkpointed = grads()
    assert plain.keys() == checkpointed.keys()
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name])


def test_label_smoothing_through_trainer(tmp_path):
    model = tiny(vocab_size=45)
    source, mask, labels = batch()
    args = Seq2SeqTrainingArguments(str(tmp_path), label_smoothing_factor=0.1, report_to=[], use_cpu=True)
    trainer = Seq2SeqTrainer(model=model, args=args)
    inputs = dict(
        input_ids=source,
        attention_mask=mask,
        labels=labels,
        decoder_input_ids=model.prepare_decoder_input_ids_from_labels(labels),  # as DataCollatorForSeq2Seq does
    )
    model.train()
    loss = trainer.compute_loss(model, dict(inputs))
    with torch.no_grad():
        logits = model(**{k: v for k, v in inputs.items() if k != "labels"}).logits
    log_probs = logits.log_softmax(-1)
    nll = -log_probs.gather(-1, labels[..., None]).squeeze(-1)
    smooth = -log_probs.mean(-1)
    expected = (0.9 * nll + 0.1 * smooth).mean()
    torch.testing.assert_close(loss.detach(), expected, atol=1e-5, rtol=1e-5)


# ---- save / load -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CATALOGUE))
def test_save_and_load_roundtrip(name, tmp_path):
    model = tiny(**CATALOGUE[name])
    model.final_logits_bias.normal_()
    source, mask, target = batch()
    model.save_pretrained(tmp_path)
    loaded = AutoModelForSeq2SeqLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is Seq2SeqForConditionalGeneration
    with torch.no_grad():
        a = model(input_ids=source, attention_mask=mask, decoder_input_ids=target).logits
        b = loaded(input_ids=source, attention_mask=mask, decoder_input_ids=target).logits
    torch.testing.assert_close(a, b, atol=0, rtol=0)
    shared = loaded.model.encoder.embed_tokens.weight is loaded.model.decoder.embed_tokens.weight
    assert shared == loaded.config.share_encoder_decoder_embeddings
    assert (loaded.lm_head.weight is loaded.model.decoder.embed_tokens.weight) == loaded.config.tie_word_embeddings


def test_resize_token_embeddings_keeps_source_target_and_bias_in_step(tmp_path):
    model = tiny(vocab_size=45)
    model.final_logits_bias.normal_()
    old_bias = model.final_logits_bias.clone()
    model.resize_token_embeddings(50)
    assert model.config.vocab_size == model.config.decoder_vocab_size == 50
    assert model.final_logits_bias.shape == (1, 50) and torch.equal(model.final_logits_bias[:, :45], old_bias)
    assert model.lm_head.weight is model.model.shared.weight is model.model.decoder.embed_tokens.weight
    source, mask, target = batch(vocab=50)
    assert model(input_ids=source, attention_mask=mask, decoder_input_ids=target).logits.shape[-1] == 50
    model.save_pretrained(tmp_path)
    assert AutoModelForSeq2SeqLM.from_pretrained(tmp_path).config.decoder_vocab_size == 50


@pytest.mark.parametrize("tied", [True, False])
def test_separate_vocabularies_resize_each_side_on_its_own(tmp_path, tied):
    """`resize_token_embeddings` is the source side of separate vocabularies (Marian's); an untied head was resized
    with it, to the source size, and the next forward failed on its shape (70 logits against a target bias of 53).
    `resize_decoder_token_embeddings` (Marian's too) resizes the target side: embeddings, head, bias."""
    config = Seq2SeqConfig(
        **TINY_SEQ2SEQ, share_encoder_decoder_embeddings=False, decoder_vocab_size=53, tie_word_embeddings=tied
    )
    model = Seq2SeqForConditionalGeneration(config).eval()
    model.resize_token_embeddings(70)
    assert (model.config.vocab_size, model.config.decoder_vocab_size, model.lm_head.weight.shape[0]) == (70, 53, 53)
    model.resize_decoder_token_embeddings(57)
    assert model.config.decoder_vocab_size == model.lm_head.weight.shape[0] == model.final_logits_bias.shape[1] == 57
    assert (model.lm_head.weight is model.model.decoder.embed_tokens.weight) == tied
    generator = torch.Generator().manual_seed(0)
    source, target = (
        torch.randint(3, 70, (2, 6), generator=generator),
        torch.randint(3, 57, (2, 5), generator=generator),
    )
    with torch.no_grad():
        logits = model(input_ids=source, decoder_input_ids=target).logits
    assert logits.shape[-1] == 57
    model.save_pretrained(tmp_path)
    with torch.no_grad():
        loaded = AutoModelForSeq2SeqLM.from_pretrained(tmp_path).eval()(input_ids=source, decoder_input_ids=target)
    torch.testing.assert_close(loaded.logits, logits, atol=0, rtol=0)
    with pytest.raises(ValueError, match="use `resize_token_embeddings`"):
        tiny().resize_decoder_token_embeddings(70)


def test_resize_decoder_token_embeddings_to_none_changes_nothing():
    """As Marian's (and `resize_token_embeddings(None)`): None returns the target embeddings as they are; it raised a
    TypeError building the new `final_logits_bias`."""
    config = Seq2SeqConfig(**TINY_SEQ2SEQ, share_encoder_decoder_embeddings=False, decoder_vocab_size=53)
    model = Seq2SeqForConditionalGeneration(config).eval()
    embeddings = model.resize_decoder_token_embeddings(None)
    assert embeddings is model.model.decoder.embed_tokens and embeddings.weight.shape[0] == 53
    assert model.config.decoder_vocab_size == model.final_logits_bias.shape[1] == model.lm_head.weight.shape[0] == 53


def test_resize_below_a_special_token_id_warns_at_the_resize(caplog):
    """Either side's resize that drops `pad_token_id` / `decoder_start_token_id` says so at once: `save_pretrained`
    refuses that config, and was the first to say it."""
    separate = dict(share_encoder_decoder_embeddings=False, decoder_vocab_size=53, decoder_start_token_id=50)
    model = Seq2SeqForConditionalGeneration(Seq2SeqConfig(**TINY_SEQ2SEQ, **separate))
    with caplog.at_level(logging.WARNING, logger="archlab.modeling.pretrained"):
        model.resize_token_embeddings(55)  # the source side keeps every id
        assert not caplog.records
        model.resize_decoder_token_embeddings(40)
        model.resize_token_embeddings(45)
    first, second = [record.getMessage() for record in caplog.records]
    assert "resize_decoder_token_embeddings to 40" in first and "`decoder_start_token_id` (50)" in first
    assert "resize_token_embeddings to 45" in second


@pytest.mark.parametrize("model_class", [Seq2SeqModel, EncoderForMaskedLM])
@pytest.mark.parametrize("size", [40, 70])
def test_resized_base_model_and_masked_lm_save_and_load(tmp_path, model_class, size):
    """The base model and the masked LM resize the shared vocabulary too: `decoder_vocab_size` follows, so the
    config stays valid and the model saves (it failed at save time, leaving only the code files) and loads back."""
    model = model_class(Seq2SeqConfig(**TINY_SEQ2SEQ)).eval()
    model.resize_token_embeddings(size)
    assert model.config.vocab_size == model.config.decoder_vocab_size == size
    model.save_pretrained(tmp_path)
    loaded = model_class.from_pretrained(tmp_path).eval()
    assert loaded.config.decoder_vocab_size == size
    ids = torch.tensor([[1, 5, size - 1, 2]])
    extra = {"decoder_input_ids": ids} if model_class is Seq2SeqModel else {}
    with torch.no_grad():
        expected, actual = model(input_ids=ids, **extra), loaded(input_ids=ids, **extra)
    torch.testing.assert_close(actual[0], expected[0], atol=0, rtol=0)


# ---- learning ----------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_learns_to_reverse_sequences():
    """A 2+2-layer model learns to reverse digit strings from scratch; greedy decoding then gets them right."""
    torch.manual_seed(0)
    config = Seq2SeqConfig(
        vocab_size=16,
        d_model=64,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        max_position_embeddings=32,
        dropout=0.0,
        init_std=0.02,
    )
    model = Seq2SeqForConditionalGeneration(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.98), eps=1e-9)

    def sample(n: int):
        digits = torch.randint(3, 13, (n, 8))
        reverse = torch.cat([digits.flip(1), torch.full((n, 1), EOS)], 1)
        return digits, reverse

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a model this small only loses to threading overhead, badly so on a busy machine
    try:
        model.train()
        for _ in range(300):
            source, labels = sample(32)
            loss = model(input_ids=source, labels=labels).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        model.eval()
        source, labels = sample(64)
        out = model.generate(input_ids=source, max_new_tokens=9, num_beams=1, do_sample=False)
    finally:
        torch.set_num_threads(threads)
    accuracy = (out[:, 1:10] == labels).all(1).float().mean().item()
    assert accuracy >= 0.9, (loss.item(), accuracy)
    assert translate(["0 1 2 3 4 5 6 7", "9 9 8 1 5 5 3 2"], model, digit_tokenizer(), max_new_tokens=9) == [
        "7 6 5 4 3 2 1 0",
        "2 3 5 5 1 8 9 9",
    ]


# ---- checkpoint conversion ---------------------------------------------------------------------------------------


def test_converter_imports_and_exports_marian_folders(tmp_path):
    from archlab.conversion import ConversionError, convert_checkpoint

    reference, _ = marian_pair()
    reference.save_pretrained(tmp_path / "marian")  # transformers drops the tied copies and the sinusoid tables
    convert_checkpoint(tmp_path / "marian", tmp_path / "archlab")
    ours = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "archlab").eval()
    assert type(ours) is Seq2SeqForConditionalGeneration and ours.config.sinusoidal_layout == "split"
    source, mask, target = batch()
    with torch.no_grad():
        expected = reference(input_ids=source, attention_mask=mask, decoder_input_ids=target).logits
        got = ours(input_ids=source, attention_mask=mask, decoder_input_ids=target).logits
    assert (got - expected).abs().max() <= 1e-4
    beams = dict(input_ids=source, attention_mask=mask, num_beams=4, max_new_tokens=10)
    assert torch.equal(ours.generate(**beams), reference.generate(**beams))

    convert_checkpoint(tmp_path / "archlab", tmp_path / "back", to="marian")
    back = MarianMTModel.from_pretrained(tmp_path / "back").eval()
    with torch.no_grad():
        exported = back(input_ids=source, attention_mask=mask, decoder_input_ids=target).logits
    torch.testing.assert_close(exported, expected)

    ours.config.norm_position = "pre"
    ours.save_pretrained(tmp_path / "pre_norm")
    with pytest.raises(ConversionError, match="norm_position='pre'"):
        convert_checkpoint(tmp_path / "pre_norm", tmp_path / "refused", to="marian")
    tiny(sinusoidal_layout="interleaved").save_pretrained(tmp_path / "interleaved")
    with pytest.raises(ConversionError, match="split layout"):
        convert_checkpoint(tmp_path / "interleaved", tmp_path / "refused2", to="marian")
