"""Tied weights declared the transformers-5 way (`_tied_weights_keys`, target -> source) and loading checkpoints
that lack some of them: every combination of a shared vocabulary (`share_encoder_decoder_embeddings`) and a tied
head (`tie_word_embeddings`), and the masked LM. Nothing may be left on the meta device, the weights a checkpoint
has must load exactly, and the ties must hold afterwards."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from archlab import (
    DecoderForCausalLM,
    EncoderForMaskedLM,
    Seq2SeqConfig,
    Seq2SeqForConditionalGeneration,
    Seq2SeqModel,
)

from helpers import tiny_decoder_config, tiny_seq2seq_config

COMBOS = [(True, True), (True, False), (False, True), (False, False)]  # (shared vocabulary, tied head)


def seq2seq_config(share: bool, tie: bool) -> Seq2SeqConfig:
    extra = {} if share else {"decoder_vocab_size": 53}
    return tiny_seq2seq_config(share_encoder_decoder_embeddings=share, tie_word_embeddings=tie, **extra)


@pytest.mark.parametrize("share, tie", COMBOS)
def test_seq2seq_declares_its_ties_as_transformers_5_mappings(share, tie):
    model = Seq2SeqForConditionalGeneration(seq2seq_config(share, tie))
    expected = {}
    if share:  # the shared vocabulary is one parameter whatever the head does
        expected.update(
            {
                "model.encoder.embed_tokens.weight": "model.shared.weight",
                "model.decoder.embed_tokens.weight": "model.shared.weight",
            }
        )
    if tie:
        expected["lm_head.weight"] = "model.shared.weight" if share else "model.decoder.embed_tokens.weight"
    assert model.all_tied_weights_keys == expected
    for target, source in expected.items():
        assert model.get_parameter(target) is model.get_parameter(source)
    encoder, decoder = model.model.encoder.embed_tokens, model.model.decoder.embed_tokens
    assert (encoder.weight is decoder.weight) == share
    assert encoder is not decoder  # parameter tying, not one module under several names


def save_without(model, folder, dropped: set[str], renamed: dict[str, str] | None = None) -> dict:
    """Save `model`, then rewrite its checkpoint without the `dropped` keys (and with keys renamed)."""
    model.save_pretrained(folder)
    state = load_file(folder / "model.safetensors")
    state = {(renamed or {}).get(key, key): value for key, value in state.items() if key not in dropped}
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    return state


def assert_loaded(loaded, stored: dict) -> None:
    on_meta = [name for name, t in [*loaded.named_parameters(), *loaded.named_buffers()] if t.device.type == "meta"]
    assert not on_meta, on_meta
    for key, value in stored.items():
        torch.testing.assert_close(loaded.get_parameter_or_buffer(key), value, atol=0, rtol=0)
    for target, source in loaded.all_tied_weights_keys.items():
        assert loaded.get_parameter(target) is loaded.get_parameter(source), target


@pytest.mark.parametrize("share, tie", COMBOS)
def test_seq2seq_loads_checkpoints_missing_tied_weights(tmp_path, share, tie):
    model_class = Seq2SeqForConditionalGeneration
    model = model_class(seq2seq_config(share, tie))
    source = "model.shared.weight" if share else "model.decoder.embed_tokens.weight"
    # the embedding every tie reads is missing (and, untied, the head too): initialised, not left on meta
    stored = save_without(model, tmp_path / "no_source", {source, "lm_head.weight"})
    loaded = model_class.from_pretrained(tmp_path / "no_source")
    assert_loaded(loaded, stored)
    # nothing at all in the checkpoint
    save_file({"unrelated": torch.zeros(1)}, tmp_path / "no_source" / "model.safetensors", metadata={"format": "pt"})
    assert_loaded(model_class.from_pretrained(tmp_path / "no_source"), {})
    if share:  # a checkpoint that stores the encoder's name for the shared weight: it is found and tied
        stored = save_without(model, tmp_path / "alias", set(), {source: "model.encoder.embed_tokens.weight"})
        loaded = model_class.from_pretrained(tmp_path / "alias")
        assert_loaded(loaded, stored)
        torch.testing.assert_close(loaded.model.shared.weight, model.model.shared.weight, atol=0, rtol=0)


@pytest.mark.parametrize(
    "model_class, config, source",
    [
        (Seq2SeqModel, seq2seq_config(True, True), "shared.weight"),
        (EncoderForMaskedLM, tiny_seq2seq_config(), "encoder.embed_tokens.weight"),
        (DecoderForCausalLM, tiny_decoder_config(tie_word_embeddings=True), "model.embed_tokens.weight"),
    ],
)
def test_other_heads_load_checkpoints_missing_tied_weights(tmp_path, model_class, config, source):
    stored = save_without(model_class(config), tmp_path, {source})
    loaded = model_class.from_pretrained(tmp_path)
    assert loaded.all_tied_weights_keys
    assert_loaded(loaded, stored)
