"""Attention sinks (GPT-OSS): the eager function against transformers' GPT-OSS attention, SDPA's extra key against
the eager function (values and gradients, every mask SDPA gets), and the config's refusals and plans."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward as gpt_oss_eager

from archlab import DecoderConfig, DecoderForCausalLM
from archlab.modeling.attention import eager_attention_forward
from archlab.modeling.attention_sinks import sink_sdpa

from helpers import tiny_decoder_config

HEADS, KV_HEADS = 4, 2


def _module(sinks: torch.Tensor, causal: bool = True):
    return SimpleNamespace(num_key_value_groups=HEADS // KV_HEADS, sinks=sinks, is_causal=causal, training=False)


def _inputs(queries: int, keys: int, head_dim: int = 12, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(2, HEADS, queries, head_dim, generator=generator, requires_grad=True)
    k = torch.randn(2, KV_HEADS, keys, head_dim, generator=generator, requires_grad=True)
    v = torch.randn(2, KV_HEADS, keys, head_dim, generator=generator, requires_grad=True)
    sinks = (2.0 * torch.randn(HEADS, generator=generator)).requires_grad_()
    return q, k, v, sinks


def _causal_float_mask(queries: int, keys: int) -> torch.Tensor:
    """(2, 1, T, S) additive: query i sees keys up to S - T + i; row 0 left-padded by 2 (its pads see themselves)."""
    visible = torch.arange(keys)[None, :] <= torch.arange(keys - queries, keys)[:, None]
    mask = torch.where(visible, 0.0, float("-inf")).expand(2, 1, queries, keys).clone()
    mask[0, :, :, :2] = float("-inf")
    mask[0, :, : max(0, 2 - (keys - queries)), :] = 0.0
    return mask


def test_eager_sinks_equal_transformers_gpt_oss_attention():
    q, k, v, sinks = _inputs(5, 5)
    mask = _causal_float_mask(5, 5)
    expected, expected_weights = gpt_oss_eager(_module(sinks), q, k, v, mask, scaling=0.3)
    output, weights = eager_attention_forward(_module(sinks), q, k, v, mask, scaling=0.3, sinks=sinks)
    torch.testing.assert_close(output, expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(weights, expected_weights, atol=1e-6, rtol=0)
    assert (weights.sum(-1) < 1).all()  # the sink keeps a share of every row
    plain, _ = eager_attention_forward(_module(None), q, k, v, mask, scaling=0.3)
    assert (plain - output).abs().max() > 0.1


@pytest.mark.parametrize(
    "case", ["bool_mask", "float_mask", "no_mask_causal_prefill", "one_query", "one_query_mask", "position_bias", "odd"]
)
def test_sdpa_with_a_sink_key_equals_the_eager_sinks(case):
    """Values and the gradients of q, k, v and the sinks. `no_mask_causal_prefill`: a static cache's prefill, the
    prompt's 5 queries over 8 slots with no mask (SDPA's top-left `is_causal`); `odd`: head_dim 8 (a whole block of
    padding channels) and no grouping."""
    queries, keys, head_dim = {"no_mask_causal_prefill": (5, 8), "odd": (6, 6)}.get(case, (6, 6)) + (12,)
    if case.startswith("one_query"):
        queries, keys = 1, 7
    if case == "odd":
        head_dim = 8
    q, k, v, sinks = _inputs(queries, keys, head_dim)
    float_mask = _causal_float_mask(queries, keys)
    bias = None
    if case == "no_mask_causal_prefill":
        float_mask = torch.where(torch.arange(keys)[None, :] <= torch.arange(queries)[:, None], 0.0, float("-inf"))
        float_mask = float_mask.expand(2, 1, queries, keys)
    if case == "position_bias":
        bias = torch.randn(1, HEADS, queries, keys, generator=torch.Generator().manual_seed(3))
    given = {
        "bool_mask": float_mask == 0,
        "float_mask": float_mask,
        "no_mask_causal_prefill": None,
        "one_query": None,
        "one_query_mask": float_mask == 0,
        "position_bias": float_mask == 0,
        "odd": float_mask == 0,
    }[case]
    if case == "one_query":
        float_mask = None
    eager_mask = float_mask if bias is None else float_mask + bias
    expected, _ = eager_attention_forward(_module(sinks), q, k, v, eager_mask, scaling=0.3, sinks=sinks)
    output, _ = sink_sdpa(_module(sinks), q, k, v, given, scaling=0.3, sinks=sinks, position_bias=bias)
    torch.testing.assert_close(output, expected, atol=1e-5, rtol=0)
    grad = torch.randn_like(expected)
    torch.testing.assert_close(
        torch.autograd.grad(output, (q, k, v, sinks), grad),
        torch.autograd.grad(expected, (q, k, v, sinks), grad),
        atol=1e-5,
        rtol=0,
    )


def test_sinks_are_a_parameter_per_head_in_the_tensor_parallel_plan_and_refuse_flash_attention_2():
    config = tiny_decoder_config(attention_sinks=True)
    model = DecoderForCausalLM(config)
    sinks = model.model.layers[0].self_attn.sinks
    assert sinks.shape == (config.num_attention_heads,) and not sinks.any()
    assert config.base_model_tp_plan["layers.*.self_attn.sinks"] == "local_rowwise"
    assert "layers.*.self_attn.sinks" not in tiny_decoder_config().base_model_tp_plan
    with pytest.raises(ValueError, match="`attention_sinks=True` needs a kernel that takes the sinks"):
        DecoderConfig(attention_sinks=True, attn_implementation="flash_attention_2")
    with pytest.raises(ValueError, match="`attention_sinks` must be a bool"):
        DecoderConfig(attention_sinks=1.0)
