"""Sliding-window layers of generate's static cache kept whole, so the compiled decoding loops take them.

transformers' `StaticSlidingWindowLayer` holds one window of keys but, once full, counts its length in a Python int
that a compiled forward takes as a symbolic input: a new value, and a new CUDA graph, per token. A
`WholeCacheSlidingLayer` instead keeps every position of the cache — a `StaticLayer` (its length a device tensor,
which compiled loops replay) still flagged sliding, so transformers' mask functions give its queries only the keys of
their window (absolute key positions) — and gives the outputs of transformers' sliding layers, which drop the keys
that leave the window. What it costs is memory, and the keys past the window that a step reads (the filled span,
`cache_spans.py`) and masks.

`kept_whole` decides, the same way for generate's cache choice (`fast_decoding.sliding_window_blocker`) and for the
cache it builds (`keep_sliding_layers_whole`):
- always up to `WHOLE_CACHE_WINDOWS` windows: memory and reads within that factor of the window's;
- longer on CUDA while the keys kept past the window (every sliding layer, every row) take no more bytes than the
  model's weights — a step, which reads the weights once, then reads at most about twice what a windowed step would —
  and fit in `FREE_MEMORY_SHARE` of the free device memory. So a Gemma-3-shaped model (windows of 1,024, five
  sliding layers in six) generates thousands of tokens at batch 1 on the compiled path, and a batch of 64 with long
  contexts, whose keys past the window would outweigh the weights, keeps the dynamic cache (eager, window-long reads).
Past that, transformers' window-long layers: the CUDA default decodes with the dynamic cache and says why in one line.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, StaticSlidingWindowLayer

from .beam_reorder import FREE_MEMORY_SHARE, free_device_memory  # the same share as beam search's spare buffers
from .cache_spans import SpannedLayer

# Up to this many windows a static cache always keeps its sliding layers whole.
WHOLE_CACHE_WINDOWS = 4


class WholeCacheSlidingLayer(SpannedLayer):
    """A sliding-window layer of a static cache that keeps every position of the cache (module docstring)."""

    is_sliding = True


def bytes_past_the_window(config, length: int, batch_size: int, dtype: torch.dtype) -> int:
    """Bytes of keys and values a `length`-position static cache of `batch_size` rows holds past the sliding window
    when its sliding layers are kept whole."""
    layers = sum(kind == "sliding_attention" for kind in config.layer_types)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_position = 2 * config.num_key_value_heads * head_dim * dtype.itemsize  # keys and values
    return layers * batch_size * max(length - config.sliding_window, 0) * per_position


def kept_whole(model, length: int, batch_size: int | None) -> bool:
    """Whether generate's static cache of `length` positions and `batch_size` rows holds `model`'s sliding layers
    whole (module docstring). Without a batch size only the `WHOLE_CACHE_WINDOWS` rule applies."""
    window = getattr(model.config, "sliding_window", None)
    if window is None:
        return False
    if length <= WHOLE_CACHE_WINDOWS * window:
        return True
    free = free_device_memory(model.device)  # None off CUDA: only the window rule
    if free is None or batch_size is None:
        return False
    extra = bytes_past_the_window(model.config, length, batch_size, model.dtype)
    weights = sum(parameter.numel() * parameter.element_size() for parameter in model.parameters())
    return extra <= weights and extra <= FREE_MEMORY_SHARE * free


def keep_sliding_layers_whole(cache: Cache, length: int) -> None:
    """Swap each sliding-window layer of a fresh static `cache` of `length` positions for a `WholeCacheSlidingLayer`
    (the caller decided with `kept_whole`): the same outputs, and the compiled decoding loops can take it."""
    for index, layer in enumerate(cache.layers):
        if type(layer) is StaticSlidingWindowLayer and not layer.is_initialized:
            cache.layers[index] = WholeCacheSlidingLayer(max_cache_len=length)


__all__ = [
    "WHOLE_CACHE_WINDOWS",
    "WholeCacheSlidingLayer",
    "bytes_past_the_window",
    "keep_sliding_layers_whole",
    "kept_whole",
]
