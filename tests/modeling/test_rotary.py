"""rotary.py's RoPE given one parameter set per layer type (`rope_parameters={"full_attention": {...},
"sliding_attention": {...}}`, Gemma3's global and local bases): each layer rotates with its type's set."""

from __future__ import annotations

import logging

import torch

from archlab import DecoderForCausalLM
from archlab.modeling.rotary import LayerTypeRotaryEmbeddings, RotaryEmbedding

from helpers import tiny_decoder_config

GLOBAL = {"rope_type": "linear", "rope_theta": 1e6, "factor": 2.0}
LOCAL = {"rope_type": "default", "rope_theta": 1e4}
MIXED = dict(sliding_window=4, layer_types=["sliding_attention", "full_attention"])


def _logits(config, state=None, tmp_path=None):
    torch.manual_seed(0)
    model = DecoderForCausalLM(config).eval()
    if state is not None:
        model.load_state_dict(state)
    if tmp_path is not None:  # through a saved folder: the sets survive save and load
        model.save_pretrained(tmp_path)
        model = DecoderForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(3, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return model(ids).logits, model.state_dict()


def test_each_layer_rotates_with_the_set_of_its_type(tmp_path):
    """Every layer local: a set per layer type computes what the local set alone (flat) computes, bit for bit; the
    global set, never used there, changes nothing; the sets swapped change the logits."""
    local = dict(sliding_window=4, layer_types=["sliding_attention"] * 2)
    flat, state = _logits(tiny_decoder_config(**local, rope_parameters=LOCAL))
    per_type = {"sliding_attention": LOCAL, "full_attention": GLOBAL}
    config = tiny_decoder_config(**local, rope_parameters=per_type)
    assert torch.equal(_logits(config, state, tmp_path)[0], flat)
    swapped = tiny_decoder_config(**local, rope_parameters={"sliding_attention": GLOBAL, "full_attention": LOCAL})
    assert (_logits(swapped, state)[0] - flat).abs().max() > 1e-4  # a tiny init: small logits


def test_mixed_layers_build_one_rotary_per_type_and_equal_sets_equal_one_flat_set():
    config = tiny_decoder_config(**MIXED, rope_parameters={"sliding_attention": LOCAL, "full_attention": GLOBAL})
    rotary = DecoderForCausalLM(config).model.rotary_emb
    assert isinstance(rotary, LayerTypeRotaryEmbeddings) and set(rotary.per_type) == set(MIXED["layer_types"])
    local, global_ = rotary.per_type["sliding_attention"], rotary.per_type["full_attention"]
    torch.testing.assert_close(local.inv_freq, RotaryEmbedding(tiny_decoder_config(rope_parameters=LOCAL)).inv_freq)
    torch.testing.assert_close(global_.inv_freq, RotaryEmbedding(tiny_decoder_config(rope_parameters=GLOBAL)).inv_freq)

    flat, state = _logits(tiny_decoder_config(**MIXED, rope_parameters=LOCAL))
    same = tiny_decoder_config(**MIXED, rope_parameters={"sliding_attention": LOCAL, "full_attention": LOCAL})
    assert torch.equal(_logits(same, state)[0], flat)


def test_positions_past_the_length_warn_once_for_all_layer_types(caplog):
    config = tiny_decoder_config(
        **MIXED, max_position_embeddings=8, rope_parameters={"sliding_attention": LOCAL, "full_attention": GLOBAL}
    )
    model = DecoderForCausalLM(config).eval()
    with caplog.at_level(logging.WARNING, logger="archlab.modeling.rotary"), torch.no_grad():
        model(torch.randint(3, 97, (1, 12)))
        model(torch.randint(3, 97, (1, 12)))
    warnings = [record.getMessage() for record in caplog.records if record.name.startswith("archlab")]
    assert len(warnings) == 1 and "Position 11 is past" in warnings[0], warnings
