"""Normalization layers and the registry `norm_type` resolves through (seed 000 §5.2 "normalization"; seed 004).

- `RMSNorm` (Zhang & Sennrich 2019): numerically identical to `LlamaRMSNorm` (statistics in fp32, weight applied
  in the input dtype).
- `OffsetRMSNorm`: RMSNorm whose gain is stored as (1 + w), w initialised to 0 — Gemma/Gemma2's `Gemma2RMSNorm`,
  numerically identical to it (the whole computation in fp32). Weight decay then pulls the gain towards 1, not 0.
- `LayerNorm` (Ba et al. 2016): `torch.nn.LayerNorm`, as in the original Transformer, GPT, BLOOM and GPT-NeoX.

DeepNorm (Wang et al. 2022) is not a different normalizer but a post-norm block with an up-weighted residual and
down-scaled initialisation; it lives in `blocks.py` and uses any norm of this registry.
"""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x²) + eps) · g — no mean subtraction, no bias."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, bias: bool = False) -> None:
        super().__init__()
        if bias:
            raise ValueError("RMSNorm has no bias: set `norm_bias=False` or use `norm_type='layer_norm'`.")
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


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


NORMS: dict[str, type[nn.Module]] = {"rms_norm": RMSNorm, "offset_rms_norm": OffsetRMSNorm, "layer_norm": LayerNorm}


def make_norm(norm_type: str, hidden_size: int, eps: float, bias: bool | None = None) -> nn.Module:
    """`NORMS[norm_type](hidden_size, eps, bias)`; `bias=None` keeps the norm's own default (LayerNorm has one)."""
    norm_class = NORMS[norm_type]
    return norm_class(hidden_size, eps=eps) if bias is None else norm_class(hidden_size, eps=eps, bias=bias)


__all__ = ["NORMS", "RMSNorm", "OffsetRMSNorm", "LayerNorm", "make_norm"]
