"""A compiled decoding step's attention masks, written once per step into a fixed buffer that every layer reads.

The loops' step (decoding_loop.py, beam_loop.py) builds its masks as transformers' loop does
(`create_masks_for_generate`: a boolean (batch, 1, 1, keys) tensor per layer type, from the padding mask and the
cache position). Inductor leaves such a cheap tensor unmaterialised and recomputes it where it is read, and every
layer's SDPA call then costs a kernel of its own: SDPA's decomposition turns the boolean mask into an additive one
per call, and inductor's layout constraint for SDPA's kernels copies an input that is not a realised buffer with
aligned strides (`sdpa_constraint`; torch 2.13's `cache_sdpa_constraint`, off by default, does not help: each call's
conversion is a node of its own — checked on CPU — and the GPU image's 2.11 lacks it). The batch-1 decode profile
on an H100 showed that kernel beside each layer's attention (docs/gpu.md); inductor's CPU code of a 3-layer step
held three copies of the mask.

`realized_masks` writes each such mask, additive already (0 where seen, the dtype's minimum elsewhere, as
transformers' eager masks), into a slot of a static buffer whose rows are `ALIGNMENT`-aligned, and hands the layers
a view of it: SDPA then reads a graph input — no conversion, no copy, one mask kernel per step however many layers.
FlexAttention's decoding path (flex_decoding.py) reads the same view. An encoder-decoder's source mask, which each
decoder layer's cross-attention had likewise rebuilt, goes into a slot of its own (`realized_source_mask`). Masks of
another form (a BlockMask, a mask per head or per query) pass through unchanged.
"""

from __future__ import annotations

import torch

ALIGNMENT = 8  # elements: the alignment SDPA's kernels need of an attention bias's rows (aten's preprocess_mask)
MASK_SLOTS = 3  # masks per step: one per layer type of the catalogue (full attention, sliding window), the source's
SOURCE_SLOT = 2  # an encoder-decoder's source mask, which its cross-attention reads


def step_mask_shape(rows: int, keys: int) -> tuple[int, ...]:
    """The buffer's shape for steps of `rows` rows over at most `keys` keys: (slots, rows, 1, 1, keys + 1 rounded up
    to `ALIGNMENT`). The spare column keeps a mask's view from ever spanning a whole row: the view of a span that
    did would be contiguous, and a compiled step would guard on that (a graph for the whole cache's span, another
    for the rest, as `cache_spans.py` spans vary)."""
    return (MASK_SLOTS, rows, 1, 1, -(-(keys + 1) // ALIGNMENT) * ALIGNMENT)


def source_length(encoder: dict) -> int:
    """The source positions an encoder-decoder's steps attend to: its source mask's width (`encoder`, the steps'
    encoder inputs); 0 without a mask, or for a decoder."""
    mask = encoder.get("attention_mask")
    return mask.shape[-1] if isinstance(mask, torch.Tensor) else 0


def additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (True: attend) as an additive one of `dtype`: 0 where True, the dtype's minimum elsewhere."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)


def _realized(mask, slot: torch.Tensor):
    """`mask` written into `slot` (rows, 1, 1, keys) and read back as a view, where it is one query row per batch
    row shared by the heads and fits; as it is otherwise."""
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[2] != 1:
        return mask
    if mask.shape[0] > slot.shape[0] or mask.shape[-1] > slot.shape[-1]:
        return mask
    if mask.dtype == torch.bool:
        mask = additive(mask, slot.dtype)
    elif mask.dtype != slot.dtype:
        return mask
    view = slot[: mask.shape[0], :, :, : mask.shape[-1]]
    view.copy_(mask)
    return view


def realized_masks(masks, buffer: torch.Tensor | None):
    """The step's `masks` (a tensor, a dict of them by layer type, or anything the model takes) with each
    one-query mask moved into a slot of `buffer` (`step_mask_shape`), additive, and read from there; unchanged
    without a buffer or with more masks than slots."""
    if buffer is None:
        return masks
    if isinstance(masks, dict):
        if len(masks) > SOURCE_SLOT:
            return masks
        return {name: _realized(masks[name], buffer[slot]) for slot, name in enumerate(sorted(masks))}
    return _realized(masks, buffer[0])


def realized_source_mask(mask, buffer: torch.Tensor | None):
    """An encoder-decoder's source padding mask (rows, source) as the additive (rows, 1, 1, source) mask every
    decoder layer's cross-attention reads, written into the buffer's source slot (a 4-D mask passes the model's
    mask building as it is); unchanged without a buffer, or if it is not a 2-D mask that fits."""
    if buffer is None or not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        return mask
    return _realized(mask[:, None, None, :].bool(), buffer[SOURCE_SLOT])


__all__ = [
    "ALIGNMENT",
    "MASK_SLOTS",
    "SOURCE_SLOT",
    "additive",
    "realized_masks",
    "realized_source_mask",
    "source_length",
    "step_mask_shape",
]
