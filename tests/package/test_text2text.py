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
