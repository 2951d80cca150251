"""Continuing a generation from a static cache it returned: the cache grows to the new call's length.

A cache passed back to `generate` (`past_key_values=out.past_key_values`, the multi-turn pattern of transformers'
cache guide) holds the earlier turns, and the new call writes its prompt and new tokens after them. transformers'
dynamic cache grows as it goes; a static cache holds the positions it was built with, and the first write past them
fails deep in the forward (stock Llama: `IndexError: index_copy_(): index 9 is out of bounds`). archlab decodes with a
static cache by default on CUDA (fast_decoding.py), so the pattern that works with transformers' default would fail
with archlab's. `grow_static_cache` makes each full-attention static layer long enough for the call, in place (the
same object the user holds, as a dynamic cache is), copying what it holds; one logged line says so, since each
growth copies the cache and the compiled step's CUDA graphs are recorded again for the new addresses.

Window-long sliding layers (transformers' `StaticSlidingWindowLayer`, archlab's rings) wrap around and never need to
grow. An offloaded cache (layers moved between devices per forward) is refused by name rather than grown.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, StaticLayer, StaticSlidingWindowLayer
from transformers.utils import logging

from .cache_spans import mark_head_sizes_static, self_attention_cache
from .sliding_layers import RingSlidingLayer

logger = logging.get_logger(__name__)


def _grows(layer) -> bool:
    """A static layer that holds a fixed number of positions from the first (not a window that wraps around)."""
    return isinstance(layer, StaticLayer) and not isinstance(layer, (StaticSlidingWindowLayer, RingSlidingLayer))


def _grow_layer(layer: StaticLayer, positions: int) -> None:
    """`layer` holding `positions` positions, its keys and values copied into the longer tensors. A layer keeps the
    spare positions it had past `max_cache_len` (cache_spans.SpannedLayer holds one)."""
    if getattr(layer, "is_initialized", False):
        spare = layer.keys.shape[-2] - layer.max_cache_len
        grown = []
        for old in (layer.keys, layer.values):
            new = old.new_zeros((*old.shape[:2], positions + spare, old.shape[-1]))
            new[:, :, : old.shape[-2]].copy_(old)
            torch._dynamo.mark_static_address(new)  # as StaticLayer.lazy_initialization marks its tensors
            mark_head_sizes_static(new)
            grown.append(new)
        layer.keys, layer.values = grown
    layer.max_cache_len = positions


def grow_static_cache(model, cache: Cache | None, positions: int) -> None:
    """Grow `cache`'s full-attention static layers (the self-attention part of an encoder-decoder's) to hold
    `positions` positions where they hold fewer (module docstring). Any other cache is left as it is."""
    if not isinstance(cache, Cache):
        return
    self_cache = self_attention_cache(cache)
    short = [layer for layer in self_cache.layers if _grows(layer) and layer.max_cache_len < positions]
    if not short:
        return
    held = max(layer.max_cache_len for layer in short)
    if getattr(self_cache, "offloading", False):
        raise ValueError(
            f"past_key_values: this offloaded static cache holds {held} positions and this call needs {positions} "
            "(the cached tokens, the new prompt and max_new_tokens). Build it with max_cache_len of at least "
            f"{positions}, or continue from a DynamicCache."
        )
    logger.warning_once(  # (no lengths in it: said once per process, not once per turn)
        f"{type(model).__name__}: a static cache passed to generate holds fewer positions than the call needs; it is "
        "grown in place (a copy per growth). A StaticCache built with a max_cache_len that fits every turn, or "
        "cache_implementation='dynamic', avoids the copies."
    )
    logger.info(f"{type(model).__name__}: the static cache grows from {held} to {positions} positions.")
    for layer in short:
        _grow_layer(layer, positions)
    kept = model.__dict__.get("_kept_static_cache")
    if kept is not None and kept.cache is cache:
        del model._kept_static_cache  # now the user's alone: its length no longer matches the key it was kept by


__all__ = ["grow_static_cache"]
