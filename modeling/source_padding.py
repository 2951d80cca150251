"""Encoder-decoder sources padded to a few lengths on the fast decoding path, so that its static caches and recorded
decoding steps serve later calls with other source lengths.

An encoder-decoder's decoding step reads the encoder states and the cross-attention cache, both as long as the
source. On the fast path (generate's static cache, the step compiled, CUDA graphs through `mode="reduce-overhead"`)
a new source length means a new static cache — new addresses, so the compiled step's CUDA graphs are recorded again
— and a new shape to record. A translation job whose batches are each padded to their own longest sentence meets a
new length nearly every call: it records again every call, and past torch's re-record limit
(`cudagraph_unexpected_rerecord_limit`) stops replaying the step at all.

Here, on that path, each call's source is right-padded (masked positions) to a multiple of `SOURCE_STEP` positions,
and to at least the longest padded source of an earlier call on this model — as transformers sizes the decoder's
static cache to the longest generation so far (`_previous_max_cache_length`). Source lengths then only grow, by
steps, so the kept cache (`fast_decoding.KeptCache`, keyed by the source length) and its recorded steps serve every
later call of the same batch shape. The padded positions are masked keys of the encoder's self-attention and of the
decoder's cross-attention: the real positions' encoder states, and so the generated tokens, are those of the source
unpadded (up to float rounding of the longer sums; the tests compare them for every encoder-decoder variant). The
price is the encoder's work and the cross-attention's reads over the padding: at most `SOURCE_STEP` - 1 positions
past the longest source so far. The same bucketing of lengths is what serving engines do for their CUDA graphs
(vLLM's captured batch sizes); here it is the source length that varies.
"""

from __future__ import annotations

import torch
from transformers.generation.configuration_utils import ALL_STATIC_CACHE_IMPLEMENTATIONS, GenerationConfig

# Sources are padded to multiples of this many positions on the fast path (None: not padded).
SOURCE_STEP: int | None = 64
# the encoder's inputs besides the ids and the mask that hold one value per source position
PER_POSITION_SOURCE_INPUTS = ("token_type_ids", "position_ids")


def padded_source_length(length: int, previous: int, limit: int | None) -> int:
    """The length a source of `length` positions is padded to: a multiple of `SOURCE_STEP`, at least `previous` (the
    longest padded source so far), at most `limit` (the encoder's position table) unless the source is longer."""
    if SOURCE_STEP is None:
        return length
    target = -(-max(length, previous) // SOURCE_STEP) * SOURCE_STEP
    if limit is not None:
        target = min(target, max(limit, length))
    return target


def pads_sources(
    model, generation_config: GenerationConfig, model_kwargs: dict, model_input_name: str | None, cache: str | None
) -> bool:
    """Whether this `generate` call's source is padded: an encoder-decoder encoding token ids (not embeddings, nor
    encoder outputs the caller gives), decoding on the static cache (`cache`: the call's cache implementation, as
    `fast_decoding.choose_cache_implementation` chooses it) with its step compiled, and returning no encoder states
    or attentions, whose length would show the padding."""
    config = generation_config
    if SOURCE_STEP is None or not model.config.is_encoder_decoder or model_input_name != "input_ids":
        return False
    if model_kwargs.get("encoder_outputs") is not None or config.output_attentions or config.output_hidden_states:
        return False
    if cache not in ALL_STATIC_CACHE_IMPLEMENTATIONS or config.disable_compile:
        return False
    compiles_everywhere = config.compile_config is not None and config.compile_config._compile_all_devices
    return model.device.type in ("cuda", "xpu", "neuron", "tpu") or bool(compiles_everywhere)


def pad_source(
    input_ids: torch.Tensor, model_kwargs: dict, length: int, pad_token_id: int | None
) -> tuple[torch.Tensor, dict]:
    """`input_ids` and the source mask in `model_kwargs` (all ones where absent) right-padded to `length` positions:
    pad tokens (0 without one), masked. The encoder's other per-position inputs follow: segment ids
    (`token_type_ids`) and `position_ids` are padded with 0, in range of any table, at masked positions."""
    batch, current = input_ids.shape
    mask = model_kwargs.get("attention_mask")
    if mask is None:
        mask = torch.ones_like(input_ids)
    if length <= current:
        return input_ids, {**model_kwargs, "attention_mask": mask}
    extra = length - current
    pad = 0 if pad_token_id is None else int(pad_token_id)
    ids = torch.cat([input_ids, input_ids.new_full((batch, extra), pad)], dim=1)
    padded = {**model_kwargs, "attention_mask": torch.cat([mask, mask.new_zeros((batch, extra))], dim=1)}
    for name in PER_POSITION_SOURCE_INPUTS:
        value = model_kwargs.get(name)
        if value is not None:
            padded[name] = torch.cat([value, value.new_zeros((batch, extra))], dim=1)
    return ids, padded


__all__ = ["PER_POSITION_SOURCE_INPUTS", "SOURCE_STEP", "pad_source", "padded_source_length", "pads_sources"]
