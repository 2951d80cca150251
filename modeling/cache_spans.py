"""Decoding steps that read only the filled part of a static KV cache, rounded up to a span.

A static cache (`StaticLayer`) holds `max_cache_len` positions from the start, and transformers' decoding steps attend
to all of them, the empty ones masked: every step reads the whole cache. At batch 1 that is nothing beside the
weights; at batch 64 of a 1B Llama-shaped model a 2,176-position cache is 3.1 GB against 2.1 GB of weights, and half
of it, on average over a 2,048-token generation, is still empty. Beam search also reorders the cache every step, in
place, over its whole length.

`SpannedLayer` is a `StaticLayer` with an optional `span`: a tensor whose length (its only use) is how many leading
positions the decoding step sees — `update` returns the keys and values of those positions, `get_mask_sizes` sizes
the masks to them, and beam search reorders only them. The compiled decoding loops (`decoding_loop.decode`,
`beam_loop.beam_search`) set the span from the host before each step: the cache length after the step rounded up to
a multiple of `span_step` (at least `MIN_SPAN_STEP` positions, at most `MAX_SPANS` spans per cache), so the spans
change a few times per generation and never need a device read. The span's length is a dynamic dimension
(`torch._dynamo.maybe_mark_dynamic`): one compiled graph serves every span, and with CUDA graphs one graph is
recorded per span. Without a span (prefill, transformers' loops, anything outside the compiled loops) the layer is a
plain `StaticLayer`.

Inside those steps a layer also leaves its length (`cumulative_length`, a 0-d device tensor per layer) to the step:
transformers' `StaticLayer.update` adds the token to it in place, one tiny kernel per layer after its attention
(the H100 profile of a batch-1 step: ~21 of its 272 kernels, each a launch gap of ~1.6 µs beside ~1 µs of work);
`advance_lengths`, called once after the step's forward, adds it to every layer's length at once
(`torch._foreach_add_`: one kernel). A layer defers only while its span is set, i.e. inside the loops' step.

The same idea, done inside an attention kernel from per-row lengths, is vLLM's paged attention and FlashAttention's
`flash_attn_with_kvcache(cache_seqlens=...)`; here it stays with PyTorch's SDPA and the static cache's fixed
addresses, at the price of a few recorded graphs.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
from transformers.cache_utils import Cache, EncoderDecoderCache, StaticLayer

# False: the compiled loops' steps read the whole cache, as transformers' steps do (what the benchmark compares with).
READ_SPANS = True
# Spans are multiples of at least this many positions (attention kernels tile keys by 64 or 128).
MIN_SPAN_STEP = 64
# At most this many distinct spans per cache length: each is one recorded CUDA graph of the decoding step.
MAX_SPANS = 8


def mark_head_sizes_static(tensor: torch.Tensor) -> None:
    """A (batch, heads, positions, head size) cache tensor's heads and head size marked static for dynamo (once).
    Under the compiled prefill's `dynamic=True` they would be symbols (compiled_prefill.py); and every tensor a
    compiled step may read in a layer's place must carry the same marks — a spare for beam search's reorder, a grown
    cache — or the step's guard on the marking fails and it compiles again (the first prefill into a new cache is
    eager: were the marks set only by the compiled prefill, the step compiled after it would compile again at the
    next call)."""
    if tensor.dim() == 4 and not hasattr(tensor, "_dynamo_static_indices"):
        for dim in (1, 3):
            torch._dynamo.mark_static(tensor, dim)


class SpannedLayer(StaticLayer):
    """A `StaticLayer` whose decoding steps can read only its first `span.shape[0]` positions (module docstring).
    `span` is None outside the compiled decoding loops: then it reads like a `StaticLayer`.

    Its `keys` and `values` hold one position more than `max_cache_len`, never written nor read: what a step reads is
    then a slice of them whatever the span, the whole cache's span included. (Were the last span the whole tensor,
    the compiled step would see a contiguous tensor there and a strided one before, and compile a second graph.)"""

    span: torch.Tensor | None = None
    # one eager forward's write positions, made by its first layer and read by the others (`shared_positions`)
    shared: SharedPositions | None = None

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # attributes of the instance from the start, as `as_spanned` sets them (a sliding or chunked layer kept whole,
        # sliding_layers.py, is built so): a compiled forward guards on their being in the instance's dict, and the
        # compiled prefill recompiled once the decoding loop had set them
        self.span = self.shared = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.max_cache_len += 1  # StaticLayer allocates (and marks static) tensors of max_cache_len positions
        try:
            super().lazy_initialization(key_states, value_states)
        finally:
            self.max_cache_len -= 1
        # their heads and head size marked static from the start (`mark_head_sizes_static`)
        if not torch.compiler.is_compiling():
            for tensor in (self.keys, self.values):
                mark_head_sizes_static(tensor)

    def _read_length(self) -> int:
        if self.span is not None:
            return self.span.shape[0]
        # from the keys' size where they exist, not from `max_cache_len`: under dynamic shapes (the compiled prefill)
        # an int attribute becomes a symbol of its own per layer, where equal tensor sizes share one, and the
        # layers' traces (nested compile regions) would differ by it
        return self.max_cache_len if self.keys is None else self.keys.shape[-2] - 1

    @property
    def defers_length(self) -> bool:
        """Whether `update` leaves `cumulative_length` to `advance_lengths`: inside the loops' steps (a span set),
        and in an eager prefill's forward (`shared_positions`)."""
        return self.span is not None or self.shared is not None

    def _positions(self, tokens: int) -> torch.Tensor:
        shared = self.shared
        if shared is None:
            return torch.arange(tokens, device=self.keys.device) + self.cumulative_length
        if shared.positions is None:
            shared.positions = torch.arange(tokens, device=self.keys.device) + self.cumulative_length
        shared.written.append(self)
        return shared.positions  # (every layer of one forward writes as many tokens, at the same length)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self.defers_length:  # (initialised: the loops set spans after the prefill; shared positions likewise)
            positions = self.write_positions(key_states.shape[-2])
            self.keys.index_copy_(2, positions, key_states)
            self.values.index_copy_(2, positions, value_states)
        else:
            super().update(key_states, value_states, *args, **kwargs)
        return self.read_span()

    def write_positions(self, tokens: int) -> torch.Tensor:
        """Where a forward that defers the length (`defers_length`) writes its `tokens` keys and values: the positions
        after the cache's length (a kernel that writes the cache itself writes there: triton_qkv.py)."""
        return self._positions(tokens)

    def read_span(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values a step reads after its update: the span's leading positions, or the whole cache."""
        length = self._read_length()
        return self.keys[:, :, :length], self.values[:, :, :length]

    def get_mask_sizes(self, *args, **kwargs) -> tuple[int, int]:
        return self._read_length(), 0


def as_spanned(layer: StaticLayer) -> SpannedLayer:
    """`layer` (a plain `StaticLayer` not yet initialised) as a `SpannedLayer` with the same state."""
    spanned = SpannedLayer.__new__(SpannedLayer)
    spanned.__dict__.update(layer.__dict__)
    # an attribute of the instance from the start, as after a loop's `Spans.clear`: a compiled forward's guards on
    # the layer (the compiled prefill's) then see the same state on a new cache and a kept one, and do not recompile
    spanned.span = spanned.shared = None
    return spanned


def self_attention_cache(cache: Cache) -> Cache:
    """The cache the decoder's self-attention writes (an encoder-decoder's holds a cross-attention one beside it,
    whose length is the source's)."""
    return cache.self_attention_cache if isinstance(cache, EncoderDecoderCache) else cache


def self_attention_layers(cache: Cache) -> list:
    return self_attention_cache(cache).layers


def make_spanned(cache: Cache) -> None:
    """Turn the plain `StaticLayer`s of `cache`'s self-attention part into `SpannedLayer`s (in place). An offloaded
    cache (its layers moved between devices per forward) is left as it is."""
    self_cache = self_attention_cache(cache)
    if getattr(self_cache, "offloading", False):
        return
    layers = self_cache.layers
    for index, layer in enumerate(layers):
        if type(layer) is StaticLayer and not layer.is_initialized:  # (chunked prefill initialises it early)
            layers[index] = as_spanned(layer)


def span_step(max_cache_len: int) -> int:
    """The spans' granularity for a cache of `max_cache_len` positions: a multiple of `MIN_SPAN_STEP`, large enough
    for at most `MAX_SPANS` spans."""
    return MIN_SPAN_STEP * max(1, math.ceil(max_cache_len / (MAX_SPANS * MIN_SPAN_STEP)))


def span_length(needed: int, max_cache_len: int) -> int:
    """The span of a step after which the cache holds `needed` positions: `needed` rounded up to the granularity,
    at most the cache's length."""
    step = span_step(max_cache_len)
    return min(max_cache_len, step * math.ceil(needed / step))


class Spans:
    """Sets the span of every `SpannedLayer` of a cache before each decoding step, from the host; `clear` returns
    them to whole-cache layers. The span tensors are made once per length and kept (one per recorded graph)."""

    def __init__(self, cache: Cache):
        layers = self_attention_layers(cache)
        ready = READ_SPANS and all(getattr(layer, "is_initialized", False) for layer in layers)  # (after a prefill)
        self.layers = [layer for layer in layers if isinstance(layer, SpannedLayer)] if ready else []
        self.max_cache_len = self.layers[0].max_cache_len if self.layers else 0
        self.current: int | None = None
        self.markers: dict[int, torch.Tensor] = {}

    def cover(self, needed: int) -> None:
        """Before a step after which the cache holds `needed` positions: the layers read the span that covers them."""
        if not self.layers:
            return
        length = span_length(needed, self.max_cache_len)
        if length == self.current:
            return
        marker = self.markers.get(length)
        if marker is None:
            # on the cache's device: a CPU input would keep the step out of CUDA graphs
            marker = torch.empty(length, dtype=torch.uint8, device=self.layers[0].keys.device)
            torch._dynamo.maybe_mark_dynamic(marker, 0)
            self.markers[length] = marker
        for layer in self.layers:
            layer.span = marker
        self.current = length

    def clear(self) -> None:
        for layer in self.layers:
            layer.span = None
        self.current = None

    def __enter__(self) -> Spans:
        return self

    def __exit__(self, *exc) -> None:
        self.clear()  # the cache generate returns, or keeps for the next call, reads whole again


def attended_length(cache: Cache) -> int | None:
    """The number of positions the next step of `cache`'s self-attention reads, where a span is set; else None."""
    for layer in self_attention_layers(cache):
        if isinstance(layer, SpannedLayer) and layer.span is not None:
            return layer.span.shape[0]
    return None


def advance_lengths(cache: Cache, tokens: int = 1) -> None:
    """After a decoding step's forward: `tokens` added to the length of every self-attention layer of `cache` that
    left it to the step (`defers_length`: a `SpannedLayer` reading a span, a ring of sliding_layers.py), all in one
    `torch._foreach_add_` (module docstring). Nothing where no layer defers."""
    lengths = [
        layer.cumulative_length for layer in self_attention_layers(cache) if getattr(layer, "defers_length", False)
    ]
    if lengths:
        torch._foreach_add_(lengths, tokens)


class SharedPositions:
    """The positions one eager forward writes at in every layer (`shared_positions`): None until its first layer's
    update makes them; and the layers that wrote there, whose lengths advance after the forward."""

    __slots__ = ("positions", "written")

    def __init__(self) -> None:
        self.positions: torch.Tensor | None = None
        self.written: list[SpannedLayer] = []


@contextlib.contextmanager
def shared_positions(cache: Cache | None) -> Iterator[None]:
    """Around one eager forward (the loops' prefill, not chunked): the allocated `SpannedLayer`s of `cache` without a
    span write its tokens at one positions tensor, made by the first layer's update, and the lengths of those that
    wrote advance together after the forward (`advance_lengths`' single kernel). `StaticLayer.update` makes the
    positions and adds to the length in every layer: 3 kernels a layer, 66 for 22 layers, where this makes 3 in all.
    The layers' lengths are equal — every forward adds its tokens to each — so the first layer's places them all.
    Nothing changes while compiling, or on a new cache (its layers are allocated in this forward)."""
    layers = [] if cache is None else self_attention_layers(cache)
    layers = [layer for layer in layers if type(layer) is SpannedLayer and layer.span is None and layer.is_initialized]
    if not layers or torch.compiler.is_compiling():
        yield
        return
    shared = SharedPositions()
    for layer in layers:
        layer.shared = shared
    try:
        yield
    finally:
        for layer in layers:
            layer.shared = None
    if shared.written:  # (a forward that raised adds nothing: the cache is reset by the next call)
        torch._foreach_add_([layer.cumulative_length for layer in shared.written], shared.positions.shape[0])


def rewind_lengths(cache: Cache, positions: int) -> None:
    """Every allocated self-attention layer of `cache` forgets its last `positions` positions (its length shortened
    in one `torch._foreach_sub_`; the keys stay, to be overwritten): the steps run past the end of every row, a
    prefill's pads."""
    lengths = [layer.cumulative_length for layer in self_attention_layers(cache) if layer.is_initialized]
    if positions and lengths:
        torch._foreach_sub_(lengths, positions)


def cache_tensors(layer) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values of a static layer a step reads: its span where one is set, else the whole cache."""
    if isinstance(layer, SpannedLayer):
        length = layer._read_length()
        return layer.keys[:, :, :length], layer.values[:, :, :length]
    return layer.keys, layer.values


__all__ = [
    "MAX_SPANS",
    "MIN_SPAN_STEP",
    "Spans",
    "SharedPositions",
    "SpannedLayer",
    "advance_lengths",
    "as_spanned",
    "attended_length",
    "cache_tensors",
    "make_spanned",
    "mark_head_sizes_static",
    "rewind_lengths",
    "self_attention_cache",
    "self_attention_layers",
    "shared_positions",
    "span_length",
    "span_step",
]
