"""Llama 4's attention choices, each one config field: chunked attention (`attention_chunk_size`, layer type
"chunked_attention"), a QK-norm without a gain (`qk_norm_weight=False`) left out of the NoPE layers
(`qk_norm_nope_layers=False`), and the NoPE layers' temperature tuning (`attn_temperature_tuning`). Each against its
formula here; the whole stack against transformers' Llama4ForCausalLM in tests/conversion/test_families.py."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import DynamicCache

from archlab import DecoderForCausalLM
from archlab.modeling.normalization import ScaleFreeRMSNorm
from archlab.modeling.sliding_layers import WholeCacheSlidingLayer

from helpers import LLAMA4_ATTENTION, cpu_compile_config, randomised, tiny_decoder_config

CHUNK = 4


def _model(attn: str = "sdpa", **fields) -> DecoderForCausalLM:
    return randomised(DecoderForCausalLM(tiny_decoder_config(**fields, attn_implementation=attn)))


def _left_padded(batch: int = 2, length: int = 14, pads: int = 3):
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 97, (batch, length), generator=generator)
    mask = torch.ones_like(ids)
    mask[0, :pads] = 0
    return ids.masked_fill(mask == 0, 0), mask


def test_a_chunked_query_sees_the_keys_of_its_own_block_up_to_itself():
    """Eager attention weights of every layer: query q (counted from its row's first real token) attends to key k
    exactly when k <= q and both fall in the same block of `attention_chunk_size` positions."""
    model = _model("eager", attention_chunk_size=CHUNK)
    ids, mask = _left_padded()
    with torch.no_grad():
        weights = model(ids, attention_mask=mask, output_attentions=True).attentions
    for row, start in enumerate((3, 0)):
        q = torch.arange(ids.shape[1]).view(-1, 1) - start
        k = torch.arange(ids.shape[1]).view(1, -1) - start
        expected = (k <= q) & (k >= 0) & (k.div(CHUNK, rounding_mode="floor") == q.div(CHUNK, rounding_mode="floor"))
        for layer in weights:
            seen = layer[row, :, start:] > 0  # (heads, real queries, keys)
            assert torch.equal(seen, expected[start:].expand_as(seen)), row


@pytest.mark.parametrize("fields", [dict(attention_chunk_size=CHUNK), LLAMA4_ATTENTION], ids=["chunked", "llama4"])
def test_decoding_with_the_cache_equals_the_full_forward_past_several_blocks(fields):
    """The dynamic cache's chunked layers keep a block's worth of keys (transformers' sliding-window layers); token
    by token over 14 positions (3 blocks and more, a row left-padded) the logits are the full forward's."""
    model = _model(**fields)
    ids, mask = _left_padded()
    with torch.no_grad():
        full = model(ids, attention_mask=mask).logits
        cache = DynamicCache(config=model.config)
        steps = [model(ids[:, :5], attention_mask=mask[:, :5], past_key_values=cache, use_cache=True).logits]
        for t in range(5, ids.shape[1]):
            steps.append(model(ids[:, t : t + 1], attention_mask=mask[:, : t + 1], past_key_values=cache).logits)
    real = mask.bool()
    torch.testing.assert_close(torch.cat(steps, dim=1)[real], full[real], atol=1e-5, rtol=1e-5)


def test_eager_and_sdpa_agree_values_and_gradients():
    ids, _ = _left_padded()
    mask = torch.ones_like(ids)  # (a padded query row, all masked, is each backend's own: here none)
    losses = []
    for attn in ("eager", "sdpa"):
        torch.manual_seed(0)
        model = _model(attn, **LLAMA4_ATTENTION).train()
        loss = model(ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss
        loss.backward()
        losses.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    torch.testing.assert_close(losses[0][0], losses[1][0], atol=1e-5, rtol=1e-5)
    for name, grad in losses[0][1].items():
        torch.testing.assert_close(grad, losses[1][1][name], atol=1e-4, rtol=1e-4, msg=name)


def test_the_qk_norm_without_a_gain_normalises_the_rotated_heads_of_the_rotating_layers_only():
    """No parameters; each rotated query and key head comes out with a mean square of 1 (less the epsilon); the NoPE
    layer (`qk_norm_nope_layers=False`) has none."""
    model = _model(**LLAMA4_ATTENTION)
    rotating, nope = (layer.self_attn for layer in model.model.layers)
    assert isinstance(rotating.q_norm, ScaleFreeRMSNorm) and isinstance(rotating.k_norm, ScaleFreeRMSNorm)
    assert nope.q_norm is None and nope.k_norm is None
    assert not [name for name, _ in model.named_parameters() if "_norm" in name and "self_attn" in name]
    query, key, value = (torch.randn(2, heads, 5, 8) * 3 for heads in (4, 2, 2))
    position = torch.arange(5).expand(2, 5)
    rotary = model.model.rotary_emb(query, position)
    query, key, _ = rotating.position_and_cache(query, key, value, rotary, None)
    for states in (query, key):
        torch.testing.assert_close(states.pow(2).mean(-1), torch.ones(states.shape[:-1]), atol=1e-4, rtol=0)


def test_temperature_tuning_scales_the_nope_layers_queries_by_the_token_index():
    """Query t of a NoPE layer times 1 + attn_scale · log(1 + floor((p + 1) / floor_scale)), p = t + the tokens the
    cache held (the same for every row); the rotating layer's queries are not scaled."""
    model = _model(**LLAMA4_ATTENTION)
    rotating, nope = (layer.self_attn for layer in model.model.layers)
    assert rotating.temperature is None and nope.temperature == (4.0, 0.5)
    query = torch.randn(2, 4, 3, 8)
    cache = DynamicCache(config=model.config)
    cache.update(torch.zeros(2, 2, 9, 8), torch.zeros(2, 2, 9, 8), 1)  # 9 tokens seen before
    scales = [1 + 0.5 * math.log1p(math.floor((p + 1) / 4)) for p in (9, 10, 11)]
    expected = query * torch.tensor(scales).view(1, 1, 3, 1)
    torch.testing.assert_close(nope.tuned_temperature(query, cache), expected)
    torch.testing.assert_close(nope.tuned_temperature(query, None), query)  # p = 0, 1, 2: floor((p + 1) / 4) = 0


def test_static_cache_keeps_chunked_layers_whole_and_decodes_as_the_dynamic_cache_in_archlabs_loop():
    """generate's static cache holds the chunked layers whole (their blocks masked: one compiled graph a step), beside
    sliding layers past 4 windows, which then stay whole too (no rings beside chunked layers); archlab's greedy loop
    gives the dynamic cache's tokens over 7 blocks."""
    model = _model(
        attention_chunk_size=CHUNK,
        sliding_window=CHUNK,
        layer_types=["chunked_attention", "sliding_attention"],
        nope_layers=[1],
        attn_temperature_tuning=True,
        floor_scale=4,
    )
    ids, mask = _left_padded(length=8)
    kwargs = dict(attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=0, eos_token_id=None)
    dynamic = model.generate(ids, cache_implementation="dynamic", **kwargs)
    static = model.generate(
        ids, cache_implementation="static", compile_config=cpu_compile_config(), return_dict_in_generate=True, **kwargs
    )
    assert torch.equal(static.sequences, dynamic)
    assert [type(layer) for layer in static.past_key_values.layers] == [WholeCacheSlidingLayer] * 2
