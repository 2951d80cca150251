"""Sliding-window layers of generate's static cache that the compiled decoding loops can take: kept whole, or rings.

transformers' `StaticSlidingWindowLayer` holds one window of keys but, once full, counts its length in a Python int
that a compiled forward takes as a symbolic input: a new value, and a new CUDA graph, per token. Two ways round it:

- A `WholeCacheSlidingLayer` keeps every position of the cache — a `StaticLayer` (its length a device tensor, which
  compiled loops replay) still flagged sliding, so transformers' mask functions give its queries only the keys of
  their window (absolute key positions) — and gives the outputs of transformers' sliding layers, which drop the keys
  that leave the window. What it costs is memory, and the keys past the window that a step reads (the filled span,
  `cache_spans.py`) and masks. Every loop takes it (greedy, sampling, beam search).
- A `RingSlidingLayer` holds `window + RING_SPARE_SLOTS` slots, position p in slot p mod slots, written at a
  device-tensor position (one compiled graph and one CUDA graph for every step), with its mask built per slot from
  the position each slot holds (`ring_mask`; ALiBi's and T5's biases take the same positions,
  `attention_patterns.build_position_biases`). The cache keeps transformers' window-long layers, which the prefill
  fills as usual; the greedy, sampling and beam-search loops (`decoding_loop.decode`, `beam_loop.beam_search`) move
  each into its ring after the prefill and unroll it back after the loop (`SlidingRings`), so the cache generate
  returns is transformers'. A window's memory and reads at any length. Not for attention backends other than SDPA
  and eager, or beam sampling, which runs transformers' loop (`ring_blocker`, `decodes_as_rings`).

Chunked layers (Llama 4's `attention_chunk_size`) are window-long sliding layers of one chunk in transformers' static
cache: whole, transformers' chunked masks give each query its chunk at any length; as rings of `chunk +
RING_SPARE_SLOTS` slots, `ring_mask` does (the current chunk always lies within the last `chunk` positions).

`kept_whole` decides, the same way for generate's cache choice (`fast_decoding.sliding_window_blocker`) and for the
cache it builds (`keep_sliding_layers_whole`):
- always for a model with chunked and sliding layers side by side (transformers sizes every local mask from the first
  local layer, so their window-long layers of two lengths would not line up with their masks), and for a chunked
  model in a call that does not decode as rings;
- always up to `WHOLE_CACHE_WINDOWS` windows (chunks): memory and reads within that factor of the window's;
- past that, greedy decoding, sampling and beam search decode window-long layers as rings (`decodes_as_rings`);
- the others (beam sampling, transformers' loop), on CUDA, keep the layers whole while the keys kept past the window
  (every sliding layer, every row) take no more bytes than the model's weights — a step, which reads the weights once,
  then reads at most about twice what a windowed step would — and fit in `FREE_MEMORY_SHARE` of the free device memory
  (a beam sampling of a Gemma-3-shaped model, windows of 1,024, generates thousands of tokens compiled); past that they
  decode with the dynamic cache, and the CUDA default says why in one line.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, StaticLayer, StaticSlidingWindowLayer
from transformers.generation.configuration_utils import GenerationMode

from .beam_reorder import FREE_MEMORY_SHARE, free_device_memory  # the same share as beam search's spare buffers
from .cache_spans import SpannedLayer, self_attention_layers

# Up to this many windows a static cache always keeps its sliding layers whole.
WHOLE_CACHE_WINDOWS = 4


class WholeCacheSlidingLayer(SpannedLayer):
    """A sliding-window layer of a static cache that keeps every position of the cache (module docstring); a chunked
    layer's too (Llama 4's `attention_chunk_size`: transformers gives those its window-long sliding layers, one block
    of keys), masked block by block by transformers' chunked masks over the absolute positions."""

    is_sliding = True


def local_window(config) -> int | None:
    """The length of transformers' window-long static cache layers for `config`: its sliding window, or its chunk size
    where the local layers are all chunked (Llama 4); None without local layers, or with both kinds (their masks are
    sized from one cache layer, so such a cache stays whole)."""
    kinds = set(getattr(config, "layer_types", None) or ())
    if "chunked_attention" in kinds:
        return None if "sliding_attention" in kinds else config.attention_chunk_size
    return getattr(config, "sliding_window", None)


def bytes_past_the_window(config, length: int, batch_size: int, dtype: torch.dtype) -> int:
    """Bytes of keys and values a `length`-position static cache of `batch_size` rows holds past the sliding window
    when its sliding layers are kept whole."""
    layers = sum(kind == "sliding_attention" for kind in config.layer_types)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_position = 2 * config.num_key_value_heads * head_dim * dtype.itemsize  # keys and values
    return layers * batch_size * max(length - config.sliding_window, 0) * per_position


def kept_whole(model, length: int, batch_size: int | None, rings: bool = False) -> bool:
    """Whether generate's static cache of `length` positions and `batch_size` rows holds `model`'s sliding layers
    whole (module docstring). Without a batch size only the `WHOLE_CACHE_WINDOWS` rule applies, and so it does for
    a call that decodes window-long layers as rings (`rings`, `decodes_as_rings`): past 4 windows a ring holds and
    reads less than a whole layer."""
    window = local_window(model.config)
    if "chunked_attention" in (getattr(model.config, "layer_types", None) or ()) and (window is None or not rings):
        return True  # chunked layers beside sliding ones, or a call without rings: always whole
    if window is None:
        return False
    if length <= WHOLE_CACHE_WINDOWS * window:
        return True
    if rings:
        return False
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


# False: past 4 windows every loop keeps sliding layers whole where the memory rule allows, as beam sampling does, and
# falls back past it (what the benchmark compares the rings with).
RINGS = True

# The decoding loops that decode window-long sliding layers as rings: greedy and sampling (`decoding_loop.decode`),
# beam search (`beam_loop.beam_search`). Beam sampling runs transformers' loop.
RING_MODES = (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE, GenerationMode.BEAM_SEARCH)

# A ring holds this many slots past its window: the decoding loops run up to CHECK_EVERY - 1 steps past the end of
# every row (every search) before they read that it ended, and rewind them; the window of the last kept position is
# still there.
RING_SPARE_SLOTS = 16

# Attention backends whose masks a ring builds itself: SDPA takes a boolean mask, eager an additive one.
RING_BACKENDS = ("sdpa", "eager")


def ring_blocker(model) -> str | None:
    """Why `model`'s window-long sliding layers cannot decode as rings, or None when they can."""
    config = model.config
    if not RINGS:
        return "rings are switched off (sliding_layers.RINGS)"
    if config.is_encoder_decoder:
        return "an encoder-decoder"
    if {"chunked_attention", "sliding_attention"} <= set(getattr(config, "layer_types", None) or ()):
        # transformers sizes every local layer type's mask from the first layer flagged sliding
        return "chunked and sliding attention layers side by side (their masks are sized from the same cache layer)"
    if config._attn_implementation not in RING_BACKENDS:
        return f"the attention backend {config._attn_implementation!r} (a ring builds SDPA's and eager's masks)"
    return None


def decodes_as_rings(model, generation_mode: GenerationMode | None) -> bool:
    """Whether a `generation_mode` call of `model` decodes window-long sliding layers as rings."""
    return generation_mode in RING_MODES and ring_blocker(model) is None


class RingSlidingLayer(StaticLayer):
    """A sliding-window layer of `window + RING_SPARE_SLOTS` slots for the decoding loops' one-token steps: position p
    lives in slot p mod slots, the position written next is `cumulative_length` (a device tensor: one compiled graph
    and one CUDA graph for every step), and `ring_mask` gives each query the slots of its window — or, for a chunked
    layer (`chunked`, Llama 4: `window` is then the chunk size), of its chunk, which lies within the last `window`
    positions too."""

    is_sliding = True
    # its steps' `cumulative_length` is advanced by the step, with every layer's (cache_spans.advance_lengths)
    defers_length = True

    def __init__(self, window: int, chunked: bool = False):
        super().__init__(max_cache_len=window + RING_SPARE_SLOTS)
        self.window = window
        self.chunked = chunked

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if key_states.shape[-2] != 1:  # a static shape: checked at tracing, never on the device
            raise ValueError(
                f"a ring sliding layer takes one token per step, got {key_states.shape[-2]}; it exists only inside "
                "the decoding loop (the prefill runs on transformers' window-long layer)"
            )
        slot = (self.cumulative_length % self.max_cache_len).view(1)
        self.keys.index_copy_(2, slot, key_states)
        self.values.index_copy_(2, slot, value_states)
        return self.keys, self.values  # the length: advanced after the step's forward (`defers_length`)

    def get_mask_sizes(self, *args, **kwargs) -> tuple[int, int]:
        return self.max_cache_len, 0  # transformers' mask of this size is replaced by `ring_mask`

    def slot_positions(self) -> torch.Tensor:
        """(slots,) the position each slot holds when the next token, at position `cumulative_length`, is written:
        the latest position ≤ it in the slot's residue class (negative: never written)."""
        slots = torch.arange(self.max_cache_len, device=self.cumulative_length.device)
        return self.cumulative_length - (self.cumulative_length - slots) % self.max_cache_len

    def fill_from(self, layer: StaticSlidingWindowLayer) -> None:
        """Take the keys of a prefilled window-long layer (its slots hold positions n - held ... n - 1 in order)."""
        if not self.is_initialized:
            self.lazy_initialization(layer.keys[:, :, :1], layer.values[:, :, :1])
        length = layer.cumulative_length_int
        held = min(length, layer.max_cache_len)
        slots = torch.arange(length - held, length, device=self.keys.device) % self.max_cache_len
        self.keys.index_copy_(2, slots, layer.keys[:, :, :held])
        self.values.index_copy_(2, slots, layer.values[:, :, :held])
        self.cumulative_length.fill_(length)

    def unroll_into(self, layer: StaticSlidingWindowLayer) -> None:
        """Give the window-long layer this ring's last keys in position order and its length (one device read)."""
        length = int(self.cumulative_length)
        held = min(length, layer.max_cache_len)
        slots = torch.arange(length - held, length, device=self.keys.device) % self.max_cache_len
        layer.keys[:, :, :held].copy_(self.keys.index_select(2, slots))
        layer.values[:, :, :held].copy_(self.values.index_select(2, slots))
        layer.cumulative_length_int = length
        layer.cumulative_length.fill_(held)  # the tensor length transformers' layer keeps until it is full


def ring_mask(model, ring: RingSlidingLayer, padding_mask: torch.Tensor | None, batch_size: int) -> torch.Tensor:
    """The sliding layers' mask of a one-token step over `ring`'s slots, (batch, 1, 1, slots): a slot is seen when
    it holds a position of the query's window (written, fewer than `window` positions back) that is not padding
    (`padding_mask` (batch, ≥ positions) over absolute positions, or None). A chunked ring's slot is seen when its
    position is in the query's chunk; as in transformers' chunked masks (`chunked_overlay`) a row's chunks start at its
    first token, after its left padding. Boolean for SDPA, additive for eager."""
    position = ring.cumulative_length
    held = ring.slot_positions()  # (slots,)
    if ring.chunked:
        if padding_mask is None:
            left = torch.zeros((batch_size, 1), dtype=held.dtype, device=held.device)
        else:  # each row's left padding: the zeros before its first one
            left = (padding_mask.cumsum(dim=-1) == 0).sum(dim=-1, keepdim=True).to(held.dtype)
        chunk = ring.window
        same_chunk = (held - left).div(chunk, rounding_mode="floor") == (position - left).div(
            chunk, rounding_mode="floor"
        )
        seen = (held >= 0) & same_chunk
    else:
        seen = ((held >= 0) & (position - held < ring.window)).expand(batch_size, -1)
    if padding_mask is not None:
        seen = seen & padding_mask.gather(1, held.clamp(min=0).expand(batch_size, -1)).bool()
    seen = seen[:, None, None, :]
    if model.config._attn_implementation == "sdpa":
        return seen
    return torch.zeros(seen.shape, dtype=model.dtype, device=seen.device).masked_fill(
        ~seen, torch.finfo(model.dtype).min
    )


def window_long_layers(cache: Cache | None) -> list[int]:
    """Indices of `cache`'s window-long sliding layers (transformers' `StaticSlidingWindowLayer`)."""
    if cache is None:
        return []
    layers = self_attention_layers(cache)
    return [i for i, layer in enumerate(layers) if type(layer) is StaticSlidingWindowLayer]


class SlidingRings:
    """Inside, each window-long sliding layer of a prefilled cache is a `RingSlidingLayer` holding its keys (chunked
    where `layer_types`, the model's, says the layer is); on exit the rings (rewound where steps were dropped) are
    unrolled back, so the cache generate returns or keeps is transformers' again. A window-long layer keeps its ring
    for the next call: the same addresses, so the compiled step's CUDA graphs replay."""

    def __init__(self, cache: Cache, layer_types=None):
        self.layers = self_attention_layers(cache)
        self.indices = window_long_layers(cache)
        self.windows = [self.layers[i] for i in self.indices]
        self.chunked = [bool(layer_types) and layer_types[i] == "chunked_attention" for i in self.indices]

    def __enter__(self) -> SlidingRings:
        for index, window, chunked in zip(self.indices, self.windows, self.chunked):
            ring = getattr(window, "ring", None)
            if ring is None:  # a window-long layer's length (a chunked layer's: its chunk size)
                ring = window.ring = RingSlidingLayer(window.max_cache_len, chunked)
            ring.fill_from(window)
            self.layers[index] = ring
        return self

    def __exit__(self, *exc) -> None:
        for index, window in zip(self.indices, self.windows):
            self.layers[index].unroll_into(window)
            self.layers[index] = window


__all__ = [
    "RINGS",
    "RING_BACKENDS",
    "RING_MODES",
    "RING_SPARE_SLOTS",
    "RingSlidingLayer",
    "SlidingRings",
    "WHOLE_CACHE_WINDOWS",
    "WholeCacheSlidingLayer",
    "bytes_past_the_window",
    "decodes_as_rings",
    "keep_sliding_layers_whole",
    "kept_whole",
    "local_window",
    "ring_blocker",
    "ring_mask",
    "window_long_layers",
]
