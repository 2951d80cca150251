"""Normalization layers and the registry `norm_type` resolves through (seed 000 §5.2 "normalization"; seed 004).

- `RMSNorm` (Zhang & Sennrich 2019): numerically identical to `LlamaRMSNorm` (statistics in fp32, weight applied
  in the input dtype); the normalisation is torch's fused RMSNorm kernel where torch has one (`rms_normalized`).
- `OffsetRMSNorm`: RMSNorm whose gain is stored as (1 + w), w initialised to 0 — Gemma/Gemma2's `Gemma2RMSNorm`,
  numerically identical to it (the whole computation in fp32). Weight decay then pulls the gain towards 1, not 0.
- `LayerNorm` (Ba et al. 2016): `torch.nn.LayerNorm`, as in the original Transformer, GPT, BLOOM and GPT-NeoX.
- `OffsetLayerNorm`: LayerNorm whose gain is stored as (1 + w), w initialised to 0 — Nemotron's `LayerNorm1P`
  (zero-centred gamma: weight decay pulls the gain towards 1), numerically identical to it.
- `PerHeadNorm`: any of the three over each attention head's channels, with a gain per head (QK-norm's `"per_head"`
  scope: Command R+, StableLM 2 12B).

DeepNorm (Wang et al. 2022) is not a different normalizer but a post-norm block with an up-weighted residual and
down-scaled initialisation; it lives in `blocks.py` and uses any norm of this registry.
"""

from __future__ import annotations

import torch
from torch import nn

from .catalogue import LAYER_NORM_TYPES, OFFSET_NORM_TYPES

# torch's fused RMSNorm ops (torch >= 2.8; None in older torch, which then runs the op-by-op forms). The forward runs
# on every device (on CPU as its decomposition); the backward has a CUDA kernel only (`FUSED_BACKWARD_DEVICES`).
_FUSED_RMS_NORM = getattr(torch.ops.aten, "_fused_rms_norm", None)
_FUSED_RMS_NORM_BACKWARD = getattr(torch.ops.aten, "_fused_rms_norm_backward", None)
FUSED_BACKWARD_DEVICES = ("cuda",)


def rms_normalized(hidden_states: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x·r rounded to x's dtype, r in fp32 with a trailing dimension of 1), r = (mean(x²) + eps)^-½ in fp32.

    torch's `_fused_rms_norm` (torch ≥ 2.8): one kernel on CUDA where the op-by-op form runs six (cast, square,
    mean, add + rsqrt, multiply, cast back) and moves ~4× the bytes — a third of a prefill's memory-bound work per
    layer; elsewhere the same op-by-op arithmetic (its decomposition, equal bit for bit to Llama's), and under
    `torch.compile` inductor fuses it either way."""
    if _FUSED_RMS_NORM is not None:
        return _FUSED_RMS_NORM(hidden_states, [hidden_states.shape[-1]], None, eps)
    x = hidden_states.to(torch.float32)
    rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return (x * rstd).to(hidden_states.dtype), rstd


class _RMSNormFunction(torch.autograd.Function):
    """Llama's RMSNorm forward (`rms_normalized`, then the gain in the input dtype), with a hand-written backward
    that keeps only x and 1/rms.

    Autograd over the op-by-op forward saves four full-size intermediates per norm and runs ~10 kernels backward;
    this keeps the input and one scalar per row, and its backward is torch's fused kernel on CUDA
    (`_uses_fused_backward`), elsewhere this formula:
        n = x·r, r = (mean(x²) + eps)^-½;   dx = r·(gₙ − n·mean(gₙ·n)), gₙ = g·w;   dw = Σ_rows g·n.
    """

    @staticmethod
    def forward(ctx, hidden_states: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # type: ignore[override]
        normed, rstd = rms_normalized(hidden_states, eps)
        ctx.save_for_backward(hidden_states, weight, rstd)
        return weight * normed

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):  # type: ignore[override]
        hidden_states, weight, rstd = ctx.saved_tensors
        needs_input, needs_weight = ctx.needs_input_grad[:2]
        if _uses_fused_backward(hidden_states, weight):
            grad_input, grad_weight = _FUSED_RMS_NORM_BACKWARD(
                grad_output, hidden_states, [weight.shape[-1]], rstd, weight, [needs_input, needs_weight]
            )
            return grad_input, grad_weight, None
        normed = hidden_states.to(torch.float32) * rstd
        grad = grad_output.to(torch.float32)
        grad_weight = None
        if needs_weight:
            grad_weight = (grad * normed.to(hidden_states.dtype)).reshape(-1, weight.shape[-1]).sum(0).to(weight.dtype)
        grad_input = None
        if needs_input:
            grad_normed = grad * weight.to(torch.float32)
            dot = (grad_normed * normed).mean(-1, keepdim=True)
            grad_input = (rstd * (grad_normed - normed * dot)).to(hidden_states.dtype)
        return grad_input, grad_weight, None


def _uses_fused_backward(hidden_states: torch.Tensor, weight: torch.Tensor) -> bool:
    """torch's fused backward (one or two kernels where the formula above runs about twelve) where it has a kernel
    (CUDA), for fp32 input and gain — the autocast training case (fp32 residual stream, fp32 gains) — where it is the
    formula exactly. With half-precision inputs it would differ in rounding (its gain gradient comes back in the
    input's dtype, from n before rounding), so those keep the formula."""
    return (
        _FUSED_RMS_NORM_BACKWARD is not None
        and hidden_states.device.type in FUSED_BACKWARD_DEVICES
        and hidden_states.dtype == weight.dtype == torch.float32
    )


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x²) + eps) · g — no mean subtraction, no bias."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, bias: bool = False) -> None:
        super().__init__()
        if bias:
            raise ValueError("RMSNorm has no bias: set `norm_bias=False` or use `norm_type='layer_norm'`.")
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and (hidden_states.requires_grad or self.weight.requires_grad):
            return _RMSNormFunction.apply(hidden_states, self.weight, self.variance_epsilon)
        # Inference: the same arithmetic without the autograd.Function's per-call overhead (it shows in decoding).
        return self.weight * rms_normalized(hidden_states, self.variance_epsilon)[0]

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


class ScaleFreeRMSNorm(nn.Module):
    """y = x / sqrt(mean(x²) + eps), no gain (Llama 4's QK `L2Norm`): `qk_norm_weight=False`."""

    def __init__(self, eps: float = 1e-6) -> None:
        super().__init__()
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return rms_normalized(hidden_states, self.variance_epsilon)[0]

    def extra_repr(self) -> str:
        return f"eps={self.variance_epsilon}"


class OffsetRMSNorm(nn.Module):
    """y = x / sqrt(mean(x²) + eps) · (1 + w), computed in fp32 and cast back (Gemma's RMSNorm)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, bias: bool = False) -> None:
        super().__init__()
        if bias:
            raise ValueError("RMSNorm has no bias: set `norm_bias=False` or use `norm_type='layer_norm'`.")
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        x = hidden_states.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x * (1.0 + self.weight.float())).type_as(hidden_states)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


class LayerNorm(nn.LayerNorm):
    """y = (x - mean) / sqrt(var + eps) · g + b, the norm of the original Transformer."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, bias: bool = True) -> None:
        super().__init__(hidden_size, eps=eps, bias=bias)


class OffsetLayerNorm(nn.LayerNorm):
    """y = (x - mean) / sqrt(var + eps) · (1 + w) + b, w initialised to 0 (Nemotron's LayerNorm1P). Not a subclass
    of `LayerNorm`: what patches or fuses that one (Liger's kernel) would read w as the gain."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, bias: bool = True) -> None:
        super().__init__(hidden_size, eps=eps, bias=bias)
        with torch.no_grad():
            self.weight.zero_()

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return nn.functional.layer_norm(hidden_states, self.normalized_shape, self.weight + 1.0, self.bias, self.eps)


NORMS: dict[str, type[nn.Module]] = {
    "rms_norm": RMSNorm,
    "offset_rms_norm": OffsetRMSNorm,
    "layer_norm": LayerNorm,
    "offset_layer_norm": OffsetLayerNorm,
}


class PerHeadNorm(nn.Module):
    """`norm_type`'s normalisation of each head's channels with a gain (and a LayerNorm's bias) per head and channel,
    (heads, head_dim): QK-norm with `qk_norm_scope="per_head"` (Command R+'s `CohereLayerNorm((heads, head_dim))`,
    StableLM 2 12B's LayerNorm per head). Reads heads as (B, heads, T, head_dim); computed in fp32 and cast back, as
    Cohere's. The statistics are those of the norm type; an offset norm's gain is 1 + w, w initialised to 0."""

    def __init__(self, norm_type: str, heads: int, head_dim: int, eps: float, bias: bool | None = None) -> None:
        super().__init__()
        if norm_type not in NORMS:
            raise ValueError(
                f"`norm_type`={norm_type!r} is not supported; allowed values: {', '.join(map(repr, NORMS))}."
            )
        bias = norm_type in LAYER_NORM_TYPES if bias is None else bias
        if bias and norm_type not in LAYER_NORM_TYPES:
            raise ValueError("RMSNorm has no bias: set `norm_bias=False` or use `norm_type='layer_norm'`.")
        self.norm_type = norm_type
        self.eps = eps
        self.offset = norm_type in OFFSET_NORM_TYPES
        self.weight = nn.Parameter((torch.zeros if self.offset else torch.ones)(heads, head_dim))
        self.bias = nn.Parameter(torch.zeros(heads, head_dim)) if bias else None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        x = hidden_states.float()
        if self.norm_type in LAYER_NORM_TYPES:
            x = x - x.mean(-1, keepdim=True)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        gain = self.weight.float()[:, None, :]  # (heads, 1, head_dim) against (B, heads, T, head_dim)
        x = x * (1.0 + gain if self.offset else gain)
        if self.bias is not None:
            x = x + self.bias.float()[:, None, :]
        return x.to(hidden_states.dtype)

    def extra_repr(self) -> str:
        return f"{self.norm_type}, {tuple(self.weight.shape)}, eps={self.eps}"


def make_norm(norm_type: str, hidden_size: int, eps: float, bias: bool | None = None) -> nn.Module:
    """`NORMS[norm_type](hidden_size, eps, bias)`; `bias=None` keeps the norm's own default (LayerNorm has one)."""
    norm_class = NORMS[norm_type]
    return norm_class(hidden_size, eps=eps) if bias is None else norm_class(hidden_size, eps=eps, bias=bias)


__all__ = [
    "NORMS",
    "LayerNorm",
    "OffsetLayerNorm",
    "OffsetRMSNorm",
    "PerHeadNorm",
    "RMSNorm",
    "ScaleFreeRMSNorm",
    "make_norm",
    "rms_normalized",
]
