"""Which keys each query sees, per layer type: full, sliding-window or chunked causal attention (Mistral; Gemma2's
interleaved local/global layers via `layer_types`; Llama 4's blocks of `attention_chunk_size`), prefix-LM (seed 003:
bidirectional over a prefix, causal after it), and the additive position biases (ALiBi, T5) sized to the same keys.

Masks come from transformers' `masking_utils` (`create_causal_mask`, `create_sliding_window_causal_mask`,
`create_chunked_causal_mask`), so each attention backend gets the mask format it wants and the Cache's sliding layers
(which keep only the last window of keys; chunked layers use them too) line up with the mask. Everything is built
once per forward and shared by all layers of a type."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from transformers.cache_utils import Cache
from transformers.masking_utils import (
    create_causal_mask,
    create_chunked_causal_mask,
    create_sliding_window_causal_mask,
)

from .cache_names import with_cache
from .input_checks import cached_length, can_read_values

MASK_BUILDERS: dict[str, Callable] = {
    "full_attention": create_causal_mask,
    "sliding_attention": create_sliding_window_causal_mask,
    "chunked_attention": create_chunked_causal_mask,
}


def prefix_lm_overlay(prefix_lengths: torch.Tensor) -> Callable:
    """Mask overlay OR-ed with the causal mask: every query sees every key of its row's prefix (kv < prefix_length)."""

    def inner_mask(batch_idx, head_idx, q_idx, kv_idx):
        return kv_idx < prefix_lengths[batch_idx]

    return inner_mask


def check_prefix_lengths(prefix_lengths: torch.Tensor, batch_size: int, past_key_values: Cache | None) -> None:
    """The prefix must arrive in one forward: keys cached earlier cannot be recomputed to see later prefix tokens."""
    if prefix_lengths.shape != (batch_size,):
        raise ValueError(
            f"`prefix_lengths` must have shape (batch,) = ({batch_size},), got {tuple(prefix_lengths.shape)}."
        )
    if not can_read_values(prefix_lengths):
        return  # never a device synchronisation or a graph break for a check
    past = cached_length(past_key_values)
    if past and bool((prefix_lengths > past).any()):
        raise ValueError(
            f"prefix-LM: the cache already holds {past} tokens but `prefix_lengths` reaches "
            f"{int(prefix_lengths.max())}; pass the whole prefix in the first forward (no chunked prefill of a "
            "prefix). Cached tokens before the first forward (the virtual tokens of PEFT's prefix tuning) cannot see "
            "the prefix either: a prefix-LM takes no such cache."
        )


def build_masks(
    config,
    layer_types: tuple[str, ...],
    inputs_embeds: torch.Tensor,
    attention_mask: torch.Tensor | None,
    past_key_values: Cache | None,
    position_ids: torch.Tensor | None,
    prefix_lengths: torch.Tensor | None = None,
) -> dict[str, torch.Tensor | None]:
    """{layer type: mask in the backend's format} for the layer types the model has."""
    if isinstance(attention_mask, dict):  # already built by `generate` for a compileable (static) cache
        if prefix_lengths is not None:
            raise ValueError(
                "prefix-LM cannot use precomputed masks (a dict of masks has no prefix in it); pass the 2D "
                "`attention_mask` with `prefix_lengths` and the model builds the masks (`generate` does this)."
            )
        return attention_mask
    kwargs = dict(
        config=config,
        inputs_embeds=inputs_embeds,
        attention_mask=attention_mask,
        position_ids=position_ids,
        **with_cache(past_key_values),
    )
    if prefix_lengths is not None:
        check_prefix_lengths(prefix_lengths, inputs_embeds.shape[0], past_key_values)
        kwargs["or_mask_function"] = prefix_lm_overlay(prefix_lengths.to(inputs_embeds.device))
    return {layer_type: MASK_BUILDERS[layer_type](**kwargs) for layer_type in layer_types}


def build_position_biases(
    bias_module: nn.Module,
    first_layer_of_type: dict[str, int],
    inputs_embeds: torch.Tensor,
    attention_mask: torch.Tensor | None,
    past_key_values: Cache | None,
) -> dict[str, torch.Tensor]:
    """{layer type: (1, H, Tq, Tk) bias} over exactly the keys that layer type's cache returns.

    Query i and key j get their absolute token indices (q_offset + i, kv_offset + j), read from the cache the same
    way `masking_utils` sizes the masks, so the bias stays right when a sliding cache has dropped old keys; a layer
    whose slots are not in position order (a ring, sliding_layers.py) gives each slot's position itself.
    """
    q_length = inputs_embeds.shape[1]
    device = inputs_embeds.device
    biases = {}
    for layer_type, layer_idx in first_layer_of_type.items():
        if past_key_values is not None:
            q_offset = past_key_values.get_query_offset(layer_idx)
            kv_length, kv_offset = past_key_values.get_mask_sizes(q_length, layer_idx)
        else:
            q_offset, kv_offset = 0, 0
            is_2d = isinstance(attention_mask, torch.Tensor) and attention_mask.ndim == 2
            kv_length = attention_mask.shape[-1] if is_2d else q_length
        query_positions = torch.arange(q_length, device=device) + q_offset
        key_positions = torch.arange(kv_length, device=device) + kv_offset
        layer = getattr(past_key_values, "layers", [None] * (layer_idx + 1))[layer_idx]
        if hasattr(layer, "slot_positions"):  # a ring: slot j holds the position it gives
            key_positions = layer.slot_positions().to(device)
        biases[layer_type] = bias_module(query_positions, key_positions).to(inputs_embeds.dtype)
    return biases


__all__ = ["MASK_BUILDERS", "build_masks", "build_position_biases", "check_prefix_lengths", "prefix_lm_overlay"]
