"""A decoding step's q/k/v product with RoPE and the cache writes in one kernel (modeling/triton_qkv.py): the unfused
GEMV, rotary formula and `index_copy_` to the last bit of fp32 for 1-4 rows (batch rows, tokens of one row), with
and without RMSNorm before it and a bias, launched plain and dependent, whole heads or their first channels rotated
(partial rotary); where it applies; inside the fused layer step
of archlab's compiled loop (the traced step calls it once a layer, and inductor calls its PDL twin on the cache's own
buffers, copying nothing).

The kernels run where Triton does: on a GPU, or on a CPU through Triton's interpreter (tests/triton_interpreter.py),
which `test_kernels_through_the_triton_interpreter` starts in a fresh process."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn
from transformers.cache_utils import StaticLayer

from archlab import DecoderForCausalLM
from archlab.modeling import cache_spans, triton_gemv, triton_launch, triton_qkv
from archlab.modeling.rotary import rotary_formula
from archlab.modeling.triton_qkv import qkv_rotary_cache_applies

from helpers import tiny_decoder_config
from triton_interpreter import (
    DEVICE,
    interpreted_run_of,
    interpreter_gaps_filled,
    runs_kernels,
    with_dependent_launch_code,
)

_interpreter_gaps = interpreter_gaps_filled("archlab.modeling.triton_")


@pytest.fixture(autouse=True)
def _on_this_device(monkeypatch):
    """The kernel's device list names the tests' device (NVIDIA GPUs by default)."""
    monkeypatch.setattr(triton_qkv, "QKV_ROTARY_CACHE_DEVICES", (DEVICE,))


HEADS, KV_HEADS = 4, 2


def _attention(head_dim: int, bias: bool):
    """What the kernel's caller reads of an attention: its heads and the q/k/v product as one weight."""
    g = torch.Generator().manual_seed(0)
    outputs, inputs = (HEADS + 2 * KV_HEADS) * head_dim, 48
    weight = (torch.randn(outputs, inputs, generator=g) / inputs**0.5).to(DEVICE)
    bias = torch.randn(outputs, generator=g).to(DEVICE) if bias else None
    return SimpleNamespace(num_heads=HEADS, head_dim=head_dim, fused_weights=lambda: (weight, bias))


def _spanned_layer(batch: int, head_dim: int, length: int, capacity: int = 16):
    """A `SpannedLayer` of `capacity` positions, `length` filled with random keys and values, its span set."""
    layer = cache_spans.as_spanned(_static_layer(capacity))
    g = torch.Generator().manual_seed(1)
    filled = torch.randn(2, batch, KV_HEADS, length, head_dim, generator=g).to(DEVICE)
    layer.lazy_initialization(filled[0], filled[1])
    layer.keys[:, :, :length], layer.values[:, :, :length] = filled[0], filled[1]
    layer.cumulative_length.fill_(length)
    layer.span = torch.empty(min(capacity, 8 * (1 + length // 8)))
    return layer


def _static_layer(capacity: int) -> StaticLayer:
    return StaticLayer(max_cache_len=capacity)


def _norm(inputs: int):
    from archlab.modeling.normalization import RMSNorm

    norm = RMSNorm(inputs, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(1 + torch.randn(inputs, generator=torch.Generator().manual_seed(2)) / 4)
    return norm.to(DEVICE)


def _rotary(batch: int, tokens: int, head_dim: int, first: int):
    """Llama's cos/sin (B, T, D) at positions first, first + 1, ... (each row shifted by one: left padding)."""
    positions = torch.arange(tokens)[None, :] + first - torch.arange(batch)[:, None]
    frequencies = 1.0 / 10000 ** (torch.arange(0, head_dim, 2) / head_dim)
    angles = positions[..., None].float() * frequencies
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(DEVICE), angles.sin().to(DEVICE)


def _unfused(attention, layer, x, position_embeddings, norm):
    """The fused layer step without the kernel: the GEMV's product split into heads, rotated, written by the
    layer's `update` (whose keys and values it returns)."""
    batch, tokens, _ = x.shape
    weight, bias = attention.fused_weights()
    projected = nn.functional.linear(norm(x) if norm is not None else x, weight, bias)
    q, k, v = projected.split([HEADS * attention.head_dim, *2 * [KV_HEADS * attention.head_dim]], dim=-1)
    q, k, v = (t.view(batch, tokens, -1, attention.head_dim).transpose(1, 2) for t in (q, k, v))
    q, k = rotary_formula(q, k, *position_embeddings)
    return (q, *layer.update(k, v))


@runs_kernels
@pytest.mark.parametrize("batch, tokens", [(1, 1), (2, 1), (3, 1), (1, 2), (2, 2)])
@pytest.mark.parametrize("normed, bias", [(False, False), (True, True)], ids=["plain", "rms_norm-bias"])
@pytest.mark.parametrize("launch", ["plain", "dependent"])
def test_the_kernel_equals_the_gemv_the_rotation_and_the_cache_write(batch, tokens, normed, bias, launch, monkeypatch):
    """Queries, and the whole cache after the write (the filled positions kept, the step's written at the layer's
    length, nothing else touched), as the unfused step leaves them: 1-4 rows, fp32 to 1e-5 of the scale. Heads of 6
    (3 channel pairs), where the interpreter's configuration streams 2 pairs a program: programs whose pairs straddle
    two heads, and the queries' and keys' last heads."""
    if launch == "dependent":
        monkeypatch.setattr(triton_launch, "PDL_DEVICES", (DEVICE,))
        with_dependent_launch_code(monkeypatch, triton_gemv, triton_qkv)  # (the loop is triton_gemv's)
    head_dim = 6
    attention = _attention(head_dim, bias)
    norm = _norm(48) if normed else None
    x = 3 * torch.randn(batch, tokens, 48, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    rotary = _rotary(batch, tokens, head_dim, first=5)
    ours, theirs = _spanned_layer(batch, head_dim, 5), _spanned_layer(batch, head_dim, 5)
    assert qkv_rotary_cache_applies(_real_attention(head_dim), ours, x, rotary)
    query, keys, values = triton_qkv.qkv_rotary_cache(attention, ours, x, rotary, norm)
    expected_query, expected_keys, expected_values = _unfused(attention, theirs, x, rotary, norm)
    assert query.shape == (batch, HEADS, tokens, head_dim)
    torch.testing.assert_close(query, expected_query, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(keys, expected_keys, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(values, expected_values, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours.keys, theirs.keys, rtol=1e-5, atol=1e-5)  # the whole cache: no stray write
    torch.testing.assert_close(ours.values, theirs.values, rtol=1e-5, atol=1e-5)


@runs_kernels
@pytest.mark.parametrize("batch, tokens", [(1, 1), (2, 2)])
@pytest.mark.parametrize("normed, bias", [(False, False), (True, True)], ids=["plain", "rms_norm-bias"])
def test_with_partial_rotary_the_channels_past_it_pass_through(batch, tokens, normed, bias):
    """GPT-NeoX's layout: the first channels of a head rotated (rotate_half over them), the rest as the product
    wrote them. Heads of 10, 4 rotated: 2 rotated pairs and 3 passing a head, so that programs of 2 pairs mix both
    kinds and straddle heads."""
    head_dim, rotated = 10, 4
    attention = _attention(head_dim, bias)
    norm = _norm(48) if normed else None
    x = 3 * torch.randn(batch, tokens, 48, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    rotary = _rotary(batch, tokens, rotated, first=5)  # cos/sin (B, T, 4)
    ours, theirs = _spanned_layer(batch, head_dim, 5), _spanned_layer(batch, head_dim, 5)
    query, keys, values = triton_qkv.qkv_rotary_cache(attention, ours, x, rotary, norm)
    expected_query, expected_keys, expected_values = _unfused(attention, theirs, x, rotary, norm)
    torch.testing.assert_close(query, expected_query, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours.keys, theirs.keys, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours.values, theirs.values, rtol=1e-5, atol=1e-5)


@runs_kernels
@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, marks=pytest.mark.gpu), torch.float16])
def test_in_half_precision_the_kernel_is_as_close_as_the_unfused_step(dtype):
    """Queries and the written keys and values against fp32: the kernel's error within twice the unfused step's own
    in `dtype` (which rounds each op of the rotation; the kernel rounds the product, then the rotation once). Heads of
    64, two rows (bf16 on a GPU only: the interpreter computes with NumPy, which has no bfloat16)."""
    head_dim, batch = 64, 2
    attention = _attention(head_dim, bias=True)
    weight, bias = attention.fused_weights()
    low = SimpleNamespace(num_heads=HEADS, head_dim=head_dim, fused_weights=lambda: (weight.to(dtype), bias.to(dtype)))
    norm = _norm(48)
    x = 3 * torch.randn(batch, 1, 48, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    rotary = _rotary(batch, 1, head_dim, first=5)
    exact = _unfused(attention, _spanned_layer(batch, head_dim, 5), x, rotary, norm)
    low_rotary = tuple(t.to(dtype) for t in rotary)
    layers = [_spanned_layer(batch, head_dim, 5) for _ in range(2)]
    for layer in layers:
        layer.keys, layer.values = layer.keys.to(dtype), layer.values.to(dtype)
    low_norm = _norm(48).to(dtype)
    unfused = _unfused(low, layers[1], x.to(dtype), low_rotary, low_norm)
    ours = triton_qkv.qkv_rotary_cache(low, layers[0], x.to(dtype), low_rotary, low_norm)
    for mine, theirs, truth in zip(ours, unfused, exact):
        assert mine.dtype == dtype
        error, reference = (mine.float() - truth).abs().max(), (theirs.float() - truth).abs().max()
        assert error <= 2 * reference + 1e-3, (error, reference)


def _real_attention(head_dim: int = 16, **overrides):
    config = tiny_decoder_config(
        head_dim=head_dim, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, **overrides
    )
    return DecoderForCausalLM(config).model.layers[0].self_attn


def test_the_kernel_applies_to_a_spanned_layer_rotated_without_qk_norm(monkeypatch):
    monkeypatch.setattr(triton_qkv, "triton", object())  # as where Triton is installed
    attention = _real_attention()
    layer = _spanned_layer(2, 16, 5)
    x, rotary = torch.zeros(2, 1, 48, device=DEVICE), _rotary(2, 1, 16, first=5)
    assert qkv_rotary_cache_applies(attention, layer, x, rotary)
    assert not qkv_rotary_cache_applies(attention, layer, torch.zeros(5, 1, 48, device=DEVICE), _rotary(5, 1, 16, 5))
    assert not qkv_rotary_cache_applies(attention, layer, x, None)  # no RoPE (ALiBi, T5's bias, NoPE)
    scales = torch.ones(2, 1, 1, 1, device=DEVICE)
    assert not qkv_rotary_cache_applies(attention, layer, x, (*rotary, scales))  # Mistral 3's query scales
    assert qkv_rotary_cache_applies(attention, layer, x, tuple(t[..., :8] for t in rotary))  # partial rotary
    assert not qkv_rotary_cache_applies(attention, layer, x, tuple(t[..., :7] for t in rotary))  # (odd: no pairs)
    assert not qkv_rotary_cache_applies(_real_attention(use_qk_norm=True), layer, x, rotary)
    assert not qkv_rotary_cache_applies(attention, layer, x.double(), rotary)  # the cache's dtype differs
    layer.span = None  # outside the compiled loops: the layer's length is advanced by its own update
    assert not qkv_rotary_cache_applies(attention, layer, x, rotary)
    assert not qkv_rotary_cache_applies(attention, _static_layer(16), x, rotary)
    monkeypatch.setattr(triton_qkv, "QKV_ROTARY_CACHE_DEVICES", ())
    assert not qkv_rotary_cache_applies(attention, _spanned_layer(2, 16, 5), x, rotary)
    monkeypatch.setattr(triton_qkv, "QKV_ROTARY_CACHE_DEVICES", (DEVICE,))
    monkeypatch.setattr(triton_qkv, "triton", None)  # CPU wheels of torch: no Triton
    assert not qkv_rotary_cache_applies(attention, _spanned_layer(2, 16, 5), x, rotary)


def test_by_default_the_kernel_is_on_for_nvidia_gpus(monkeypatch):
    monkeypatch.undo()
    assert triton_qkv.QKV_ROTARY_CACHE_DEVICES == triton_launch.NVIDIA_GPUS


def test_the_model_s_attention_is_what_the_test_attention_stands_for():
    """The kernel's caller reads `num_heads`, `head_dim` and `fused_weights` (the stand-in above has them)."""
    attention = _real_attention()
    assert (attention.num_heads, attention.num_key_value_heads, attention.head_dim) == (HEADS, KV_HEADS, 16)
    assert callable(attention.fused_weights)


# ---- on a CPU: the kernel tests above, through Triton's interpreter ------------------------------------------------


test_kernels_through_the_triton_interpreter = interpreted_run_of(__file__)
