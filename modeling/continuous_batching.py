"""transformers' continuous batching (`generate_batch`, `init_continuous_batching`, `transformers serve`, TRL's
`use_transformers_continuous_batching=True`) on archlab's decoder: which variants it runs, and how to tell its cache.

The continuous-batching manager runs the model on one packed row (batch 1, every request's new tokens one after the
other) with a `PagedAttentionCache`, which is not a `transformers.cache_utils.Cache`: it has no length of its own.
Each forward gets the packed rows' `position_ids`, an additive 4D mask per layer type already built (a dict by layer
type, or one tensor; None for flash kernels, which take `cu_seq_lens_*` instead), and the indices the cache reads and
writes; the attention hands those keyword arguments to `cache.update(..., kwargs)`, which selects the layer type's
own, and passes them on to the attention function (`paged|eager`, `sdpa` or a flash kernel), as Llama does.

A variant whose attention needs more than a mask over the packed keys, or a position for each cached key, cannot
be expressed there: ALiBi's and T5's biases are built from the query and key positions of a padded batch (the
packed keys' positions are known only to the cache's read indices), and prefix-LM needs its `prefix_lengths`, which
the manager does not pass. RoPE of the `dynamic` and `longrope` types picks its frequencies from the largest
position of the forward, which in a packed row belongs to whichever request is longest, so one request's tokens would
change with the others sharing its steps (Llama's continuous batching has the same dependence). Those are refused by
name before the manager starts (`continuous_batching_refusal`).

The normal paths are untouched: any other cache is updated as before, and archlab's own decoding kernels (Triton,
FlexAttention, grouped SDPA) are left out only under the paged cache.
"""

from __future__ import annotations

try:
    from transformers.generation.continuous_batching.cache import PagedAttentionCache
except ImportError:  # a transformers release that keeps it elsewhere, or has none: no cache is taken for it
    PagedAttentionCache = ()

from .catalogue import POSITION_SCHEMES
from .rotary import rope_types

# rope types whose frequencies follow max(position_ids) + 1 of the whole forward (transformers' `dynamic_rope_update`)
LENGTH_DEPENDENT_ROPE_TYPES = ("dynamic", "longrope")


def is_paged_cache(cache) -> bool:
    """The cache is continuous batching's `PagedAttentionCache` (packed rows, masks built by the manager)."""
    return isinstance(cache, PagedAttentionCache)


def continuous_batching_refusal(config) -> str | None:
    """Why a decoder with `config` cannot run under continuous batching (one line), or None where it can."""
    position_type = getattr(config, "position_embedding_type", "rope")
    if POSITION_SCHEMES[position_type].bias:
        return (
            f"`position_embedding_type`={position_type!r} adds a bias from each query's and key's position, which the "
            "paged attention's packed keys do not carry"
        )
    length_dependent = sorted(set(rope_types(config)) & set(LENGTH_DEPENDENT_ROPE_TYPES))
    if length_dependent:
        return (
            f"RoPE of rope_type {length_dependent[0]!r} picks its frequencies from the largest position of each "
            "forward, which in a packed row of requests is another request's, so a request's tokens would depend on "
            "its batch"
        )
    if getattr(config, "kv_lora_rank", None) is not None:
        return "multi-head latent attention (`kv_lora_rank`) caches latents, which the paged cache's blocks cannot hold"
    if getattr(config, "prefix_lm", False):
        return "`prefix_lm=True` needs `prefix_lengths`, which transformers' continuous batching does not pass"
    if "chunked_attention" in (getattr(config, "layer_types", None) or ()):
        return (
            "chunked attention layers (`attention_chunk_size`) need chunked masks, which the paged cache's do not have"
        )
    if getattr(config, "attn_temperature_tuning", False):
        return (
            "attention temperature tuning (`attn_temperature_tuning`) scales a query by its index in its own "
            "sequence, which a packed row of requests does not give"
        )
    return None


__all__ = ["continuous_batching_refusal", "is_paged_cache"]
