"""The compiled prefill's prompts right-padded to a few lengths (buckets), so that on a GPU it replays CUDA graphs.

`generate(..., compile_prefill=True)` compiles a decoder's forward whole with dynamic shapes (compiled_prefill.py):
one graph for every prompt length. On an H100 the 1.1B model's 2,048-token prefill then took 18.3 ms from the call
to the first token, of which ~8.5 ms were kernels: the rest is the host, Python launching ~300 kernels one by one
(docs/gpu.md). CUDA graphs launch a whole recorded forward at once, but record one graph per distinct input shape:
a graph per prompt length would record nearly every call. So on the devices of `PADDED_PREFILL_DEVICES` the
prompt is padded on the right to a bucket (`bucket_length`: a multiple of a quarter of the largest power of two not
above it, at least `MIN_BUCKET`: at most 4 buckets per doubling of the length, at most a quarter of the prompt
padded — none at 2,048) and the forward compiled in mode "reduce-overhead" replays the bucket's graph.

Why the pads change no token: in the static cache every query of the prompt is masked from the cache slots after
its own position (they hold stale keys from an earlier call anyway), so the pads' keys, written after the prompt,
are never seen by it; each decoding step writes its token over the next pad's slot, and its mask excludes the slots
after it. The logits are taken at the prompt's last position (`logits_to_keep` as an index tensor), and the
layers' lengths rewound by the pads afterwards (one `torch._foreach_sub_`). The pad rows of the masks repeat the
prompt's last row; the pad tokens repeat its last token (any token would do).

Not padded (the compiled prefill then runs as before, one graph for every length, no CUDA graphs): RoPE whose
frequencies follow the sequence's length (`dynamic`, `longrope`: the pads would change them for the prompt too);
caches whose self-attention layers are not all `SpannedLayer`s (window-long sliding layers, which would evict the
prompt's keys for pads); inputs other than ids, positions and masks of tensors (embeddings, FlexAttention's block
masks, per-token extras this module does not know how to pad); calls asking for hidden states or attentions.
"""

from __future__ import annotations

import torch

from .cache_spans import SpannedLayer, self_attention_layers
from .rotary import rope_types

# The devices where the compiled prefill pads its prompts to buckets (and replays CUDA graphs where it can).
PADDED_PREFILL_DEVICES: tuple[str, ...] = ("cuda",)
# The shortest bucket: the prompt's forward of a 1B model at batch 1 takes as long for 64 tokens as for 1.
MIN_BUCKET = 64
# RoPE types whose frequencies depend on the sequence's length
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")
# The forward's keyword arguments a padded call may carry beside those it pads
PASSED_AS_THEY_ARE = ("cache", "past_key_values", "use_cache", "return_dict", "logits_to_keep")


def bucket_length(length: int, limit: int, avoid: int | None = None) -> int:
    """The padded length of a `length`-token prompt: rounded up to a quarter of the largest power of two not above
    it (at least `MIN_BUCKET`), at most `limit` (the cache's length) and never below `length`; the next bucket where
    it would equal `avoid` (the batch size: equal sizes share one symbol in the dynamic graph, and a later length
    would fail its guard and compile again) and the next one fits."""
    granularity = max(MIN_BUCKET, (1 << (max(length, 1).bit_length() - 1)) // 4)
    padded = -(-length // granularity) * granularity
    if padded == avoid and padded + granularity <= limit:
        padded += granularity
    return max(length, min(limit, padded))


def pad_blocker(model, cache) -> str | None:
    """Why this model's prefill over `cache` is not padded, or None when it can be."""
    if model.device.type not in PADDED_PREFILL_DEVICES:
        return f"not on {' or '.join(PADDED_PREFILL_DEVICES) or 'any device'}"
    if any(rope in LENGTH_DEPENDENT_ROPE for rope in rope_types(model.config)):
        return "RoPE frequencies that follow the sequence's length"
    layers = self_attention_layers(cache) if cache is not None else []
    if not layers or not all(isinstance(layer, SpannedLayer) and layer.is_initialized for layer in layers):
        return "a cache whose layers are not all spanned static layers"
    return None


def _padded_rows(mask, pads: int):
    """A prompt's mask with `pads` rows more: (batch, length) padding masks get ones, (..., queries, keys) masks
    repeat their last row; None where the mask is not a tensor."""
    if mask is None:
        return None
    if not torch.is_tensor(mask):
        raise TypeError
    if mask.dim() == 2:
        return torch.cat([mask, mask.new_ones(mask.shape[0], pads)], dim=1)
    last = mask[..., -1:, :]
    return torch.cat([mask, last.expand(*last.shape[:-2], pads, last.shape[-1])], dim=-2)


def padded_prefill_inputs(model, cache, kwargs: dict) -> tuple[dict, int] | None:
    """The forward's keyword arguments of a prefill with the prompt padded to its bucket, and the number of pads;
    None where this prefill is not padded (module docstring)."""
    ids = kwargs.get("input_ids")
    if pad_blocker(model, cache) is not None or not torch.is_tensor(ids) or ids.dim() != 2:
        return None
    known = {"input_ids", "attention_mask", "position_ids", *PASSED_AS_THEY_ARE}
    if any(value is not None and name not in known for name, value in kwargs.items()):
        return None  # inputs_embeds, output_hidden_states, token types, ...: not padded
    if kwargs.get("logits_to_keep") != 1:
        return None  # (generate asks for the last position's logits only)
    length = ids.shape[1]
    # below the cache's length: a prompt padded to it would share the masks' key size's symbol (compiled_prefill.py)
    limit = self_attention_layers(cache)[0].max_cache_len - 1
    positions = getattr(model.config, "max_position_embeddings", None)
    if isinstance(positions, int) and positions > 0:
        limit = min(limit, positions)
    padded_length = bucket_length(length, limit, avoid=ids.shape[0])
    pads = padded_length - length
    inputs = dict(kwargs)
    try:
        masks = kwargs.get("attention_mask")
        if isinstance(masks, dict):
            inputs["attention_mask"] = {name: _padded_rows(mask, pads) for name, mask in masks.items()}
        else:
            inputs["attention_mask"] = _padded_rows(masks, pads)
    except TypeError:
        return None
    inputs["input_ids"] = torch.cat([ids, ids[:, -1:].expand(-1, pads)], dim=1)
    position_ids = kwargs.get("position_ids")
    if position_ids is not None:
        after = torch.arange(1, pads + 1, device=position_ids.device, dtype=position_ids.dtype)
        inputs["position_ids"] = torch.cat([position_ids, position_ids[..., -1:] + after], dim=-1)
    # the prompt's last position (a tensor: its value changes no graph)
    inputs["logits_to_keep"] = torch.tensor([length - 1], device=ids.device)
    return inputs, pads


__all__ = [
    "MIN_BUCKET",
    "PADDED_PREFILL_DEVICES",
    "bucket_length",
    "pad_blocker",
    "padded_prefill_inputs",
]
