"""BitNet b1.58's BitLinear (Ma et al. 2024, "The Era of 1-bit LLMs"; Wang et al. 2023, "BitNet"): a linear layer
that computes with ternary weights and 8-bit activations, quantized in every forward from full-precision weights.

- weights: per tensor, scaled by the inverse of their mean absolute value, rounded to {-1, 0, 1}, and scaled back
  (`ternary_weights`);
- activations: per token (the last dimension), scaled so that the largest magnitude is 127, rounded to the integers
  of [-128, 127], and scaled back (`int8_activations`);
- in training both pass the gradient straight through (the straight-through estimator), so the full-precision
  weights learn: quantization-aware training, as BitNet is trained.

Inside `ternary_weights_once(model)` — `generate` enters it — the layers' forwards without gradients read ternary
weights computed once on entry instead of quantizing every weight again each step (by byte count a decoding step's
GEMV reads its weight once instead of about four times: the mean, the rounding, the copy and the product); the same
values, so the same tokens.

The arithmetic is transformers' `AutoBitLinear` in its online mode (`integrations/bitnet.py`, the layer of
Microsoft's bf16 BitNet b1.58 folders), operation for operation, so the same weights give the same logits. archlab
computes it in floating point, as that layer does: the memory and speed of ternary kernels (bitnet.cpp, packed
2-bit weights) are not this module's. `DecoderConfig(bitlinear=True)` makes every projection of the layers one
(q/k/v/o and the dense MLP's; not the embeddings or the LM head).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.nn import functional as F

from .fused_projections import _hooked

MIN_MEAN_MAGNITUDE = 1e-5  # the mean magnitude of a weight's quantization, clamped below (as transformers')


def ternary_weights(weight: torch.Tensor) -> torch.Tensor:
    """`weight` rounded to {-1, 0, 1} times its mean absolute value (computed in float32, returned in its dtype)."""
    values = weight.float()
    scale = 1.0 / values.abs().mean().clamp(min=MIN_MEAN_MAGNITUDE)
    return ((values * scale).round().clamp(-1, 1) / scale).to(weight.dtype)


def int8_activations(activation: torch.Tensor) -> torch.Tensor:
    """`activation` rounded per token (last dimension) to 8-bit integers scaled by its largest magnitude / 127."""
    values = activation.float()
    scale = 127 / values.abs().amax(dim=-1, keepdim=True).clamp(min=1e-5)
    return ((values * scale).round().clamp(-128, 127) / scale).to(activation.dtype)


class _StraightThrough(torch.autograd.Function):
    """`quantize(x)` forward, the identity backward."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, ternary: bool) -> torch.Tensor:
        return ternary_weights(tensor) if ternary else int8_activations(tensor)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad_output, None


class BitLinear(nn.Linear):
    """`nn.Linear` computing with `ternary_weights(weight)` on `int8_activations(input)` (module docstring); its
    parameters, names and state dict are a plain linear layer's."""

    _ternary: torch.Tensor | None = None  # the quantized weight, inside `ternary_weights_once` only

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        weight = self._ternary
        if weight is None or torch.is_grad_enabled():
            weight = _StraightThrough.apply(self.weight, True)
        return F.linear(_StraightThrough.apply(input, False), weight, self.bias)


@contextmanager
def ternary_weights_once(model: nn.Module) -> Iterator[int]:
    """Inside, forwards of `model`'s `BitLinear` layers that record no gradient read ternary weights computed on
    entry (the weights must not change inside: `generate` enters it). Yields how many layers; a model without
    `bitlinear` is not walked. Layers whose weights are not whole here are left to quantize in their forward: hooked
    ones (DeepSpeed ZeRO-3 gathers in a hook, accelerate's offloading), sharded ones (FSDP2's and tensor
    parallelism's DTensors: a tensor subclass), weights on the meta device."""
    if not getattr(getattr(model, "config", None), "bitlinear", False):
        yield 0
        return
    layers = [
        module
        for module in model.modules()
        if isinstance(module, BitLinear)
        and not _hooked(module)
        and type(module.weight.data) is torch.Tensor
        and module.weight.device.type != "meta"
    ]
    with torch.no_grad():
        for layer in layers:
            ternary = ternary_weights(layer.weight)
            torch._dynamo.mark_static_address(ternary)  # CUDA graphs read it in place, as they read parameters
            layer.__dict__["_ternary"] = ternary
    try:
        yield len(layers)
    finally:
        for layer in layers:
            layer.__dict__.pop("_ternary", None)


def weight_of_ternary(ternary: torch.Tensor, magnitude: float, dtype: torch.dtype) -> torch.Tensor:
    """A full-precision weight of `dtype` whose `ternary_weights` are `ternary * magnitude` (`ternary` in {-1, 0, 1};
    its mean magnitude within half a step of `dtype` over the nonzero count): how a checkpoint of ternary weights and
    a scale (BitNet's offline folders) becomes the weights `BitLinear` quantizes, computing the same.

    Zeros stay zero; each nonzero entry takes its sign and one of the two values of `dtype` around
    `magnitude / share of nonzeros`, the larger one in as many entries (the first, in storage order) as bring the mean
    magnitude to `magnitude`: every nonzero entry is then at least about the mean, so it rounds back to ±1. Entries
    all equal to the nearest value of `dtype` would miss the mean by that value's rounding (up to 0.4 % in bfloat16,
    a scale on the layer's output)."""
    if not math.isfinite(magnitude) or magnitude < MIN_MEAN_MAGNITUDE:
        raise ValueError(
            f"a ternary weight's scale must be finite and at least {MIN_MEAN_MAGNITUDE} (the mean magnitude "
            f"`ternary_weights` clamps to), got {magnitude}"
        )
    signs = ternary.to(torch.int8).flatten()
    if not bool(((signs >= -1) & (signs <= 1)).all()):
        raise ValueError("`ternary` holds values other than -1, 0 and 1")
    weight = torch.zeros(signs.numel(), dtype=dtype)
    where = signs.nonzero().squeeze(1)
    if where.numel() == 0:
        return weight.view(ternary.shape)
    total = magnitude * signs.numel()  # the sum of magnitudes whose mean is `magnitude`
    ideal = total / where.numel()
    nearest = torch.tensor(ideal, dtype=torch.float64).to(dtype)
    toward = torch.tensor(math.inf if nearest.item() <= ideal else -math.inf, dtype=dtype)
    low, high = sorted((nearest, torch.nextafter(nearest, toward)), key=lambda value: value.item())
    larger = round((total - where.numel() * low.item()) / (high.item() - low.item()))
    values = low.expand(where.numel()).clone()
    values[: min(max(larger, 0), where.numel())] = high
    weight[where] = values * signs[where].to(dtype)
    return weight.view(ternary.shape)


def linear_class(config) -> type[nn.Linear]:
    """The class of a decoder layer's projections: `BitLinear` where `config.bitlinear`, else `nn.Linear`."""
    return BitLinear if getattr(config, "bitlinear", False) else nn.Linear


__all__ = [
    "BitLinear",
    "int8_activations",
    "linear_class",
    "ternary_weights",
    "ternary_weights_once",
    "weight_of_ternary",
]
