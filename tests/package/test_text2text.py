"""src/archlab/text2text.py: `translate` batches in input order, gives what `generate` gives text by text, and
refuses a decoder-only model."""

from __future__ import annotations

import pytest

from archlab import DecoderForCausalLM, Seq2SeqForConditionalGeneration, translate

from helpers import digit_tokenizer, tiny_decoder_config, tiny_seq2seq_config


def test_translate_batches_in_order_and_matches_generate():
    # large weights: outputs depend on the input even untrained
    model = Seq2SeqForConditionalGeneration(tiny_seq2seq_config(vocab_size=16, init_std=1.0)).eval()
    tokenizer = digit_tokenizer()
    texts = ["1 2 3", "4 5 6 7 8 9", "0", "9 9 1 2"]
    out = translate(texts, model, tokenizer, batch_size=3, num_beams=2, max_new_tokens=5)
    expected = []
    for text in texts:  # one at a time, no padding
        ids = tokenizer(text, return_tensors="pt")["input_ids"]
        generated = model.generate(input_ids=ids, num_beams=2, max_new_tokens=5)
        expected.append(tokenizer.decode(generated[0], skip_special_tokens=True))
    assert out == expected and len(set(out)) > 1
    assert translate("1 2 3", model, tokenizer, num_beams=2, max_new_tokens=5) == out[:1]


def test_translate_refuses_a_decoder_only_model():
    with pytest.raises(ValueError, match="needs an encoder-decoder .* DecoderForCausalLM is decoder-only"):
        translate(["1 2 3"], DecoderForCausalLM(tiny_decoder_config(vocab_size=16)), digit_tokenizer())


def test_translate_puts_the_stored_task_prefix_before_every_text():
    """A folder fine-tuned with --source_prefix keeps it in `task_specific_params[task]["prefix"]`; translate left it
    out, and the model was prompted out of distribution. One stored prefix is used (as transformers 4's pipelines
    did), `prefix=None`/`""` leaves the texts as they are, and with several the caller chooses."""
    model = Seq2SeqForConditionalGeneration(tiny_seq2seq_config(vocab_size=16)).eval()
    tokenizer = digit_tokenizer()
    sources = []
    generate = model.generate
    model.generate = lambda input_ids, **kwargs: sources.append(input_ids.tolist()) or generate(input_ids, **kwargs)

    def encoded(texts: list[str], **kwargs) -> list[list[int]]:
        sources.clear()
        translate(texts, model, tokenizer, max_new_tokens=2, **kwargs)
        return sources[0]

    texts = ["1 2 3", "4 5 6"]
    with_prefix, plain = encoded(["9 9 " + text for text in texts]), encoded(texts)
    assert with_prefix != plain
    model.config.task_specific_params = {"summarization": {"prefix": "9 9 ", "num_beams": 1}}
    assert encoded(texts) == with_prefix
    assert encoded(texts, prefix=None) == plain and encoded(texts, prefix="") == plain
    model.config.task_specific_params["translation_en_to_de"] = {"prefix": "8 "}
    with pytest.raises(ValueError, match=r"several tasks \('summarization': '9 9 ', .*pass `task=` \(or `prefix=`"):
        encoded(texts)
    assert encoded(texts, task="summarization") == with_prefix
    with pytest.raises(ValueError, match="holds no task prefix for 'translation_en_to_fr'"):
        encoded(texts, task="translation_en_to_fr")
