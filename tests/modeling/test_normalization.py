"""Norms against their Hugging Face twins (LlamaRMSNorm, Gemma2RMSNorm, nn.LayerNorm) and the registry."""

import pytest
import torch
from torch import nn
from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from archlab.modeling.normalization import NORMS, LayerNorm, OffsetRMSNorm, PerHeadNorm, RMSNorm, make_norm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("ours", "theirs"), [(RMSNorm, LlamaRMSNorm), (OffsetRMSNorm, Gemma2RMSNorm)])
def test_rms_norms_match_hugging_face(ours, theirs, dtype):
    a, b = ours(24, eps=1e-6), theirs(24, eps=1e-6)
    with torch.no_grad():
        a.weight.normal_(0.5, 0.3)
        b.weight.copy_(a.weight)
    a, b = a.to(dtype), b.to(dtype)
    x = torch.randn(3, 5, 24, dtype=dtype) * 4
    assert torch.equal(a(x), b(x))
    assert a(x).dtype == dtype


def test_rms_norm_formula():
    norm = RMSNorm(8, eps=1e-5)
    x = torch.randn(4, 8)
    expected = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
    torch.testing.assert_close(norm(x), expected)
    offset = OffsetRMSNorm(8, eps=1e-5)
    torch.testing.assert_close(offset(x), expected)  # w = 0 means gain 1


def test_layer_norm_is_torch_layer_norm():
    ours, ref = LayerNorm(16, eps=1e-5), nn.LayerNorm(16, eps=1e-5)
    with torch.no_grad():
        ours.weight.normal_(), ours.bias.normal_()
        ref.load_state_dict(ours.state_dict())
    x = torch.randn(2, 3, 16)
    assert torch.equal(ours(x), ref(x))
    assert LayerNorm(16, bias=False).bias is None


def test_make_norm_and_registry():
    assert set(NORMS) == {"rms_norm", "offset_rms_norm", "layer_norm", "offset_layer_norm"}
    assert make_norm("layer_norm", 8, 1e-5).bias is not None  # LayerNorm keeps its bias by default
    assert make_norm("layer_norm", 8, 1e-5, bias=False).bias is None
    assert isinstance(make_norm("offset_rms_norm", 8, 1e-6), OffsetRMSNorm)
    with pytest.raises(ValueError, match="norm_bias"):
        make_norm("rms_norm", 8, 1e-6, bias=True)


def test_offset_layer_norm_is_nemotrons_layernorm1p():
    """`offset_layer_norm`: LayerNorm with a bias and the gain stored as w of (1 + w), initialised to the identity
    (w = 0, b = 0) — Nemotron's `NemotronLayerNorm1P`, forward and gradients, for the same w and b."""
    from transformers.models.nemotron.modeling_nemotron import NemotronLayerNorm1P

    from archlab.modeling.normalization import OffsetLayerNorm

    fresh = make_norm("offset_layer_norm", 16, 1e-5)
    assert isinstance(fresh, OffsetLayerNorm) and not fresh.weight.any() and not fresh.bias.any()
    torch.manual_seed(0)
    ours, ref = OffsetLayerNorm(16, eps=1e-5), NemotronLayerNorm1P(16, eps=1e-5)
    with torch.no_grad():
        ours.weight.normal_(0.0, 0.2)
        ours.bias.normal_(0.0, 0.2)
        ref.load_state_dict(ours.state_dict())
    x = torch.randn(2, 5, 16, requires_grad=True)
    y_ours, y_ref = ours(x), ref(x)
    torch.testing.assert_close(y_ours, y_ref, atol=0, rtol=0)
    grads = [torch.autograd.grad(y.square().sum(), (x, m.weight, m.bias)) for y, m in ((y_ours, ours), (y_ref, ref))]
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


def test_rms_norm_matches_llama_forward_bitwise_and_backward():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from archlab.modeling.normalization import RMSNorm

    ours, ref = RMSNorm(16), LlamaRMSNorm(16)
    with torch.no_grad():
        ours.weight.normal_()
        ref.weight.copy_(ours.weight)
    x = torch.randn(3, 5, 16, requires_grad=True)
    y_ours, y_ref = ours(x), ref(x)
    assert torch.equal(y_ours, y_ref)
    g = torch.randn_like(y_ours)
    for a, b in zip(torch.autograd.grad(y_ours, (x, ours.weight), g), torch.autograd.grad(y_ref, (x, ref.weight), g)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_rms_norm_fused_backward_takes_the_formulas_arguments(monkeypatch):
    """On CUDA the backward is torch's fused kernel (`aten._fused_rms_norm_backward`, no CPU kernel). Its
    decomposition — the same arithmetic, on CPU — stands in for it here: called with the arguments the norm passes,
    it gives the formula's gradients, for input and gain together and each alone."""
    from torch._decomp.decompositions import _fused_rms_norm_backward

    from archlab.modeling import normalization

    norm = RMSNorm(16, eps=1e-5)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(3, 5, 16)
    g = torch.randn(3, 5, 16)

    def gradients(wrt):
        inputs = x.clone().requires_grad_("x" in wrt)
        norm.weight.requires_grad_("w" in wrt)
        targets = [t for t, name in ((inputs, "x"), (norm.weight, "w")) if name in wrt]
        return torch.autograd.grad(norm(inputs), targets, g)

    for wrt in ("xw", "x", "w"):
        expected = gradients(wrt)
        calls = []

        def fused(*args, calls=calls):
            calls.append(args[-1])
            return _fused_rms_norm_backward(*args)

        with monkeypatch.context() as patch:
            patch.setattr(normalization, "FUSED_BACKWARD_DEVICES", ("cpu",))
            patch.setattr(normalization, "_FUSED_RMS_NORM_BACKWARD", fused)
            actual = gradients(wrt)
        assert calls == [["x" in wrt, "w" in wrt]]
        for a, b in zip(actual, expected):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    norm.weight.requires_grad_(True)


def test_rms_norm_half_precision_keeps_the_formula(monkeypatch):
    """bf16 inputs (or gains) never take the fused backward: its rounding would differ from Llama's."""
    from archlab.modeling import normalization

    def refuse(*args):
        raise AssertionError("the fused backward ran for bf16")

    monkeypatch.setattr(normalization, "FUSED_BACKWARD_DEVICES", ("cpu",))
    monkeypatch.setattr(normalization, "_FUSED_RMS_NORM_BACKWARD", refuse)
    norm = RMSNorm(16).to(torch.bfloat16)
    x = torch.randn(2, 16, dtype=torch.bfloat16, requires_grad=True)
    norm(x).float().sum().backward()
    assert x.grad is not None and norm.weight.grad is not None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch's fused RMSNorm kernels are CUDA kernels")
def test_rms_norm_fused_kernels_match_llama_on_cuda():
    """fp32 forward and backward through the fused CUDA kernels (training's case) against LlamaRMSNorm's autograd,
    and the bf16 inference forward within one bf16 rounding."""
    ours, ref = RMSNorm(1024).cuda(), LlamaRMSNorm(1024).cuda()
    with torch.no_grad():
        ours.weight.normal_()
        ref.weight.copy_(ours.weight)
    x = torch.randn(4, 256, 1024, device="cuda", requires_grad=True)
    g = torch.randn(4, 256, 1024, device="cuda")
    y_ours, y_ref = ours(x), ref(x)
    torch.testing.assert_close(y_ours, y_ref, atol=1e-5, rtol=1e-5)
    for a, b in zip(torch.autograd.grad(y_ours, (x, ours.weight), g), torch.autograd.grad(y_ref, (x, ref.weight), g)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    with torch.no_grad():
        half = x.detach().bfloat16()
        torch.testing.assert_close(ours.bfloat16()(half), ref.bfloat16()(half), atol=0, rtol=2**-7)


@pytest.mark.parametrize("norm_type", list(NORMS))
def test_a_per_head_norm_is_each_head_s_own_norm(norm_type):
    """`qk_norm_scope="per_head"`: head h of (B, H, T, D) normed as the norm type's own module with head h's gain (and
    bias), as StableLM 2 12B runs one LayerNorm per head and Command R+ one `CohereLayerNorm((H, D))`."""
    torch.manual_seed(0)
    norm = PerHeadNorm(norm_type, 3, 8, eps=1e-5)
    with torch.no_grad():
        norm.weight.normal_(0.5, 0.3)
        if norm.bias is not None:
            norm.bias.normal_(0.0, 0.3)
    heads = torch.randn(2, 3, 5, 8)
    out = norm(heads)
    for h in range(3):
        single = make_norm(norm_type, 8, 1e-5)
        with torch.no_grad():
            single.weight.copy_(norm.weight[h])
            if norm.bias is not None:
                single.bias.copy_(norm.bias[h])
        torch.testing.assert_close(out[:, h], single(heads[:, h]), atol=1e-6, rtol=1e-5)
    assert (norm.bias is not None) == (norm_type in ("layer_norm", "offset_layer_norm"))
    with pytest.raises(ValueError, match="RMSNorm has no bias"):
        PerHeadNorm("rms_norm", 3, 8, eps=1e-5, bias=True)
