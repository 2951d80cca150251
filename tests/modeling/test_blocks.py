"""Norm placements against slow references written from the weights, DeepNorm's constants and initialisation."""

import math

import pytest
import torch
from torch import nn

from archlab import DecoderForCausalLM
from archlab.modeling.blocks import (
    BLOCKS,
    DeepNormBlock,
    OutputNormBlock,
    ParallelBlock,
    PostNormBlock,
    PreNormBlock,
    SandwichNormBlock,
    SharedNormParallelBlock,
    deepnorm_constants,
)
from archlab.modeling.feed_forward import MLP, GatedMLP

from helpers import assert_close_to_scale, tiny_decoder_config


def _attn(layer, x):
    """Causal multi-head attention from the q/k/v/o weights, no positions (NoPE keeps the reference short)."""
    a = layer.self_attn
    B, T, _ = x.shape
    q = a.q_proj(x).view(B, T, a.num_heads, -1).transpose(1, 2)
    k = a.k_proj(x).view(B, T, a.num_key_value_heads, -1).transpose(1, 2).repeat_interleave(a.num_key_value_groups, 1)
    v = a.v_proj(x).view(B, T, a.num_key_value_heads, -1).transpose(1, 2).repeat_interleave(a.num_key_value_groups, 1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(a.head_dim)
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    return a.o_proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, -1))


def _mlp(layer, x):
    m = layer.mlp
    return m.down_proj(nn.functional.silu(m.gate_proj(x)) * m.up_proj(x))


# each placement's layer from its weights; m is `residual_multiplier`, scaling what each sub-layer adds to the stream
REFERENCES = {
    "pre": lambda L, x, m: (h := x + m * _attn(L, L.input_layernorm(x))) + m * _mlp(L, L.post_attention_layernorm(h)),
    "post": lambda L, x, m: L.post_feedforward_layernorm(
        (h := L.post_attention_layernorm(x + m * _attn(L, x))) + m * _mlp(L, h)
    ),
    "sandwich": lambda L, x, m: (
        (h := x + m * L.post_attention_layernorm(_attn(L, L.input_layernorm(x))))
        + m * L.post_feedforward_layernorm(_mlp(L, L.pre_feedforward_layernorm(h)))
    ),
    "parallel": lambda L, x, m: x + m * _attn(L, L.input_layernorm(x)) + m * _mlp(L, L.post_attention_layernorm(x)),
    "parallel_shared_norm": lambda L, x, m: x + m * _attn(L, L.input_layernorm(x)) + m * _mlp(L, L.input_layernorm(x)),
    "output": lambda L, x, m: (
        (h := x + m * L.post_attention_layernorm(_attn(L, x))) + m * L.post_feedforward_layernorm(_mlp(L, h))
    ),
}


def _deepnorm_reference(layer, x, m):
    alpha = (2 * 2) ** 0.25  # two layers
    h = layer.post_attention_layernorm(alpha * x + m * _attn(layer, x))
    return layer.post_feedforward_layernorm(alpha * h + m * _mlp(layer, h))


@pytest.mark.parametrize("placement", [*REFERENCES, "deepnorm"])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("residual_multiplier", [1.0, 0.25], ids=["plain", "residual_multiplier"])
def test_block_matches_reference(placement, attn, residual_multiplier):
    config = tiny_decoder_config(
        norm_position=placement,
        norm_type="layer_norm",
        position_embedding_type="none",
        attn_implementation=attn,
        residual_multiplier=residual_multiplier,
    )
    model = DecoderForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    x = torch.randn(2, 7, 32)
    reference = _deepnorm_reference if placement == "deepnorm" else REFERENCES[placement]
    with torch.no_grad():
        ours = model.model(inputs_embeds=x).last_hidden_state
        expected = x
        for layer in model.model.layers:
            expected = reference(layer, expected, residual_multiplier)
        expected = model.model.norm(expected)
    assert_close_to_scale(ours, expected, rtol=1e-5)


def test_final_norm_only_where_the_stack_ends_unnormalised():
    for placement, block in BLOCKS.items():
        model = DecoderForCausalLM(tiny_decoder_config(norm_position=placement))
        assert isinstance(model.model.layers[0], block)
        assert isinstance(model.model.norm, nn.Identity) == (placement in ("post", "deepnorm"))
    assert {
        PreNormBlock,
        PostNormBlock,
        SandwichNormBlock,
        ParallelBlock,
        SharedNormParallelBlock,
        DeepNormBlock,
        OutputNormBlock,
    } == set(BLOCKS.values())
    expected_norms = {
        "pre": 2,
        "post": 2,
        "sandwich": 4,
        "parallel": 2,
        "parallel_shared_norm": 1,
        "deepnorm": 2,
        "output": 2,
    }
    for placement, count in expected_norms.items():
        layer = BLOCKS[placement](tiny_decoder_config(), 0)
        assert sum("layernorm" in name for name, _ in layer.named_children()) == count


def test_deepnorm_constants_and_init():
    config = tiny_decoder_config(
        norm_position="deepnorm",
        num_hidden_layers=6,
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=512,
    )
    alpha, beta = deepnorm_constants(config)
    assert alpha == pytest.approx(12**0.25) and beta == pytest.approx(48**-0.25)  # DeepNet, decoder-only
    custom = tiny_decoder_config(norm_position="deepnorm", deepnorm_alpha=3.0, deepnorm_beta=0.5)
    assert deepnorm_constants(custom) == (3.0, 0.5)
    model = DecoderForCausalLM(config)
    layer = model.model.layers[0]
    assert layer.residual_scale == pytest.approx(alpha)
    xavier = lambda w: math.sqrt(2.0 / (w.shape[0] + w.shape[1]))  # noqa: E731
    for proj, gain in [
        (layer.self_attn.q_proj, 1.0),
        (layer.self_attn.v_proj, beta),
        (layer.self_attn.o_proj, beta),
        (layer.mlp.down_proj, beta),
    ]:
        assert proj.weight.std().item() == pytest.approx(gain * xavier(proj.weight), rel=0.1)
    # a pre-norm model keeps the plain normal(initializer_range) init
    plain = DecoderForCausalLM(tiny_decoder_config(hidden_size=256, num_attention_heads=4, num_key_value_heads=4))
    assert plain.model.layers[0].self_attn.v_proj.weight.std().item() == pytest.approx(0.02, rel=0.1)


def test_mlp_type_picks_the_feed_forward():
    assert isinstance(DecoderForCausalLM(tiny_decoder_config()).model.layers[0].mlp, GatedMLP)
    plain = DecoderForCausalLM(tiny_decoder_config(mlp_type="plain", hidden_act="relu")).model.layers[0].mlp
    assert isinstance(plain, MLP) and not hasattr(plain, "gate_proj")
