"""A kept static cache reset for the next `generate` call with one multi-tensor kernel instead of one per tensor.

generate keeps its static cache between calls of the same shape (fast_decoding.py) and resets it before each:
transformers' `reset` zeroes every layer's keys, values and position counter one tensor at a time — three kernel
launches a layer, 66 for the 1.1B model's 22 layers, each a few µs of the host's time before the prefill (the
GPU machine's eager forward spent ~45-75 µs of host time per kernel: docs/gpu.md), on the time to the first token.
`reset_at_once` runs the same `reset` with its `zero_` calls collected and issued as `torch._foreach_zero_` per
dtype and device (on CUDA a fused multi-tensor kernel: a couple of launches for a batch-1 cache). A `reset` only
writes what it zeroes and reads none of it, so deferring the zeroing to its end leaves the same state; whatever else
a layer's `reset` does (counters on the host, `is_updated` of an encoder-decoder cache) runs as it is.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode
from transformers.cache_utils import Cache


class _DeferredZeroing(TorchFunctionMode):
    """Collects the tensors `Tensor.zero_` is called on (leaving them as they are); every other call runs."""

    def __init__(self) -> None:
        super().__init__()
        self.tensors: list[torch.Tensor] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.zero_ and len(args) == 1 and not kwargs:
            self.tensors.append(args[0])
            return args[0]
        return func(*args, **(kwargs or {}))


def reset_at_once(cache: Cache) -> None:
    """`cache.reset()`, its tensors zeroed together: one `torch._foreach_zero_` per (device, dtype)."""
    with _DeferredZeroing() as deferred:
        cache.reset()
    groups: dict[tuple, list[torch.Tensor]] = {}
    for tensor in deferred.tensors:
        groups.setdefault((tensor.device, tensor.dtype), []).append(tensor)
    for tensors in groups.values():
        torch._foreach_zero_(tensors)


__all__ = ["reset_at_once"]
