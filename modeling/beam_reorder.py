"""Beam search's reorder of the self-attention cache, double-buffered.

Every beam-search step first moves each cache row to the beam the last step chose it for: rows = rows[beam_idx]. A
gather cannot write over its own input, so done in place (`tensor.copy_(tensor.index_select(0, beam_idx))`) it
writes a temporary and copies it back — compiled, two writes and two reads of each tensor's filled span
(`cache_spans`) per layer and step, before attention reads it once more. For a Marian-shaped beam search (batch 8 × 4
beams, 128 new tokens, bf16) that is ~300 of a step's ~820 MB.

With a second buffer per layer (`Spares`) the gather reads the buffer that holds the cache and writes the other,
which the step then writes its token into and attends to: one read and one write (`index_copy_` over the span's
positions: inductor fuses the gather into that store, where a `copy_` into a slice would still go through a
temporary; tests/integration/test_compile.py counts the stores). The host swaps the two before every reorder, so a
compiled step sees the same two tensors in alternate roles; with CUDA graphs each span's step is recorded twice (the
addresses differ), each recording replayed every other step. The spares stay with the cache, which generate keeps for
the next call of the same shape, so later calls record nothing.

The price is a second self-attention cache. On CUDA it is taken only where it needs at most `FREE_MEMORY_SHARE` of the
free memory (else the reorder stays in place); `DOUBLE_BUFFER = False` turns it off.
"""

from __future__ import annotations

import torch

from .cache_spans import SpannedLayer, cache_tensors, mark_head_sizes_static, self_attention_layers

# False: every reorder copies in place (what the benchmark compares with).
DOUBLE_BUFFER = True
# On CUDA, the spares of a cache may take at most this share of the free device memory (and so may the keys that
# sliding_layers.py keeps past the window).
FREE_MEMORY_SHARE = 0.25


def _static_zeros_like(tensor: torch.Tensor) -> torch.Tensor:
    """Zeros, as a static layer's own tensors: a reorder copies positions past the filled ones too, which attention
    masks (a masked NaN would still reach the output through 0 · NaN)."""
    spare = torch.zeros_like(tensor)
    torch._dynamo.mark_static_address(spare)  # as the cache's own tensors: compiled graphs read it in place
    mark_head_sizes_static(spare)  # and with the same marks (else the step compiles again for its spares)
    return spare


def _affordable(layers: list[SpannedLayer]) -> bool:
    """Whether spares for `layers` fit: always off CUDA; on CUDA within `FREE_MEMORY_SHARE` of the free memory."""
    missing = [layer for layer in layers if getattr(layer, "_spares", None) is None]
    needed = sum(2 * layer.keys.numel() * layer.keys.element_size() for layer in missing)
    return fits(needed, layers[0].keys.device)


def free_device_memory(device: torch.device) -> int | None:
    """Free bytes on a CUDA device; None elsewhere (no bound is known). Also the bound of sliding_layers.py."""
    if device.type != "cuda":
        return None
    return torch.cuda.mem_get_info(device)[0]


def fits(needed: int, device: torch.device) -> bool:
    """Whether `needed` more bytes on `device` stay within `FREE_MEMORY_SHARE` of its free memory (CUDA only)."""
    free = free_device_memory(device)
    return not needed or free is None or needed <= FREE_MEMORY_SHARE * free


class Spares:
    """The spare buffers of a cache's spanned self-attention layers, for one beam search (a context manager).

    Inside, each layer's `spare` is its second pair of (keys, values) tensors: what `reorder` gathers from after
    `swap`. Outside, `spare` is None (every reorder in place) and the tensors stay on the layer (`_spares`) for the
    next search. Without spares (switched off, unaffordable, layers not spanned or not filled) it does nothing."""

    def __init__(self, cache):
        layers = self_attention_layers(cache)
        usable = all(isinstance(layer, SpannedLayer) and layer.is_initialized for layer in layers)
        self.layers: list[SpannedLayer] = layers if DOUBLE_BUFFER and layers and usable else []
        if self.layers and not _affordable(self.layers):
            self.layers = []

    def __enter__(self) -> Spares:
        for layer in self.layers:
            if getattr(layer, "_spares", None) is None:
                layer._spares = (_static_zeros_like(layer.keys), _static_zeros_like(layer.values))
            layer.spare = layer._spares
        return self

    def swap(self) -> None:
        """Before a reorder: the tensors holding the cache become the spares the reorder reads; the other pair
        becomes the cache it writes (host side: the compiled step reads both as inputs)."""
        for layer in self.layers:
            spare_keys, spare_values = layer.spare
            layer.spare = (layer.keys, layer.values)
            layer._spares = layer.spare
            layer.keys, layer.values = spare_keys, spare_values

    def __exit__(self, *exc) -> None:
        for layer in self.layers:
            layer.spare = None


def reorder(cache, beam_idx: torch.Tensor) -> None:
    """The self-attention cache follows the beams: rows = rows[beam_idx] over each layer's span (`cache_spans`; the
    rest holds nothing yet). From the spares into the cache where `Spares` set them up (and swapped them just before),
    else in place (the cache's addresses are in the compiled graph)."""
    for layer in self_attention_layers(cache):
        if not layer.is_initialized:
            continue
        spare = getattr(layer, "spare", None)
        targets = cache_tensors(layer)
        if spare is None:
            for tensor in targets:
                tensor.copy_(tensor.index_select(0, beam_idx))
        else:
            length = targets[0].shape[2]
            positions = torch.arange(length, device=beam_idx.device)
            for tensor, source in zip((layer.keys, layer.values), spare):
                # compiled, one kernel that gathers and stores (`tensor[:, :, :length].copy_(...)` would gather into a
                # temporary and copy it: inductor does not fuse a store into a slice of an input)
                tensor.index_copy_(2, positions, source[:, :, :length].index_select(0, beam_idx))


__all__ = ["DOUBLE_BUFFER", "FREE_MEMORY_SHARE", "Spares", "fits", "free_device_memory", "reorder"]
