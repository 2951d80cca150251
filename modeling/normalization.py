"""Normalization layers and the registry `norm_type` resolves through.

- `RMSNorm` (Zhang & Sennrich 2019; seed 000 §5.2 "normalization"): numerically identical to `LlamaRMSNorm`
  (statistics in fp32, weight applied in the input dtype).
- `LayerNorm` (Ba et al. 2016): `torch.nn.LayerNorm`, as in the original Transformer and Marian.
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


class LayerNorm(nn.LayerNorm):
    """y = (x - mean) / sqrt(var + eps) · g + b, the norm of the original Transformer."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, bias: bool = True) -> None:
        super().__init__(hidden_size, eps=eps, bias=bias)


NORMS: dict[str, type[nn.Module]] = {"rms_norm": RMSNorm, "layer_norm": LayerNorm}
