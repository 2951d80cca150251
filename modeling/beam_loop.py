"""Beam search with the whole step compiled and no host round trip per token (decoder and encoder-decoder).

transformers' beam search (`GenerationMixin._beam_search`) keeps its state in fixed-shape tensors, but runs every
step in eager Python around the forward: the input preparation and masks, log-softmax and processors, the top-k over
beams × vocabulary, the running/finished bookkeeping (`_get_top_k_continuations`, `_get_running_beams_for_next_
iteration`, `_update_finished_beams`, `_check_early_stop_heuristic`), the cache reorder, and a read of whether the
search is over that waits for the GPU — dozens of small kernels and a synchronisation per token. Here one compiled
function is the whole step: it calls those same transformers methods with the sequence length as a device tensor
(they divide by it and compare with it; the first, which writes at it, is `top_k_continuations` here), and updates
fixed buffers (`BeamBuffers`) in place, so under the default `CompileConfig` a step is one CUDA graph replay. The
self-attention cache is reordered from a spare buffer into the other (`beam_reorder.py`: two passes where a reorder
in place takes four), or in place where the spare does not fit; the cross-attention cache is not reordered at all
(each beam of a sentence holds the same encoder states, so the reorder, which moves beams within a sentence, would
copy identical rows).

The host reads whether the search is over once every `CHECK_EVERY` steps. Once it is, each further step leaves the
finished hypotheses as they are (`torch.where` on a `done` flag) and the cache's rows in their order (`reorder_cache`),
so the output — sequences, `sequences_scores`, `beam_indices`, the per-step `scores`/`logits` truncated to the steps
transformers ran, and the returned cache, rewound — is transformers'.
`beam_loop_blocker` says when transformers' loop runs instead: beam sampling (`torch.multinomial` reads the device),
processors other than bans (minimum lengths, suppressed tokens, one-token bad words), the repetition penalty,
`no_repeat_ngram_size` and forced BOS/EOS tokens, stopping criteria other than length and end-of-sequence (and a
length criterion other than the config's `max_length`), attention or hidden-state outputs, extra model inputs, caches
other than generate's own static cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers.generation.stopping_criteria import EosTokenCriteria
from transformers.generation.utils import GenerateBeamDecoderOnlyOutput, GenerateBeamEncoderDecoderOutput

from .beam_reorder import Spares, reorder
from .cache_names import cache_in, with_cache
from .cache_spans import Spans, self_attention_cache
from .compiled_prefill import prefill
from .decoding_loop import (
    CHECK_EVERY,
    cache_positions,
    cached_prompt_length,
    encoder_inputs,
    fill_prompt_inputs,
    kept_compiled,
    one_token_logits,
    rewind,
    shared_blocker,
    static_zeros,
)
from .loop_processors import (
    FORCED_PROCESSORS,
    check_ids,
    fill_bans,
    fill_forced,
    force_tokens,
    penalise_seen,
    repeated_ngram_bans,
    split_processors,
)
from .sliding_layers import SlidingRings
from .step_masks import source_length, step_mask_shape


def beam_loop_blocker(model, logits_processor, stopping_criteria, generation_config, synced_gpus, model_kwargs):
    """Why this beam search runs transformers' loop rather than `beam_search`, or None when it runs here."""
    if generation_config.do_sample:
        return "beam sampling"
    if generation_config.low_memory:
        return "low_memory=True (transformers' loop raises its error)"
    processors = split_processors(logits_processor)
    if processors is None or processors.warpers:
        return "logits processors other than bans, the repetition penalty, the n-gram ban and forced BOS/EOS tokens"
    if stopping_criteria.max_length not in (None, generation_config.max_length):
        # a custom MaxLengthCriteria: transformers' beams end at its length, its heuristic reads the config's
        return "a MaxLengthCriteria other than the generation config's max_length"
    return shared_blocker(model, stopping_criteria, generation_config, synced_gpus, model_kwargs)


@dataclass
class BeamBuffers:
    """Beam search's state at fixed addresses: transformers' tensors, with the generated-token axes sized to the
    whole cache (`beam_indices` too, so the prompt length does not change a shape) and the step counters on device."""

    running_sequences: torch.Tensor  # (B, beams, L) long
    sequences: torch.Tensor  # (B, beams, L) long: the finished hypotheses
    running_beam_scores: torch.Tensor  # (B, beams) float
    beam_scores: torch.Tensor  # (B, beams) float
    running_beam_indices: torch.Tensor  # (B, beams, L) int32
    beam_indices: torch.Tensor  # (B, beams, L) int32
    is_sent_finished: torch.Tensor  # (B, beams) bool
    early_stop_unsatisfied: torch.Tensor  # (B, 1) bool
    done: torch.Tensor  # () bool: transformers' loop would have stopped
    cur_len: torch.Tensor  # () long: the sequence length before the token being chosen
    prompt_len: torch.Tensor  # () long
    max_length: torch.Tensor  # () long: generation_config.max_length (a tensor: calls of other lengths share a graph)
    steps_after_done: torch.Tensor  # () long: forwards run after `done` (rewound in the cache at the end)
    banned_below: torch.Tensor  # (V,) long: min_length bans, as in decoding_loop
    forced_at: torch.Tensor  # (2,) long: forced BOS/EOS lengths, as in decoding_loop
    forced_tokens: torch.Tensor  # (2, V) bool
    repetition_penalty: torch.Tensor  # () float32 (a tensor: every penalty shares one graph)
    penalty_skip: torch.Tensor  # (B·beams,) long: leading positions the penalty does not count (left padding)
    position_ids: torch.Tensor  # (B·beams, 1) long: decoder-only models
    attention_mask: torch.Tensor  # (B·beams, cache length) long: decoder-only models, the prompt's padding, ones
    step_masks: torch.Tensor  # (slots, B·beams, 1, 1, > cache and source) model dtype: the step's masks (step_masks.py)

    @classmethod
    def for_shape(cls, model, batch_size, num_beams, length, cache_length, vocab_size, device, source=0) -> BeamBuffers:
        """The buffers kept on `model` for this shape (new ones, marked static for compiled graphs, otherwise):
        sequences of `length` tokens, a decoder-only model's padding mask over the `cache_length` cached keys, the
        step's masks over those keys and an encoder-decoder's `source` positions."""
        key = (batch_size, num_beams, length, cache_length, vocab_size, device, model.dtype, source)
        kept = getattr(model, "_beam_buffers", None)
        if kept is not None and kept[0] == key:
            return kept[1]

        def new(*shape, dtype=torch.long):
            return static_zeros(*shape, dtype=dtype, device=device)

        rows = batch_size * num_beams
        buffers = cls(
            running_sequences=new(batch_size, num_beams, length),
            sequences=new(batch_size, num_beams, length),
            running_beam_scores=new(batch_size, num_beams, dtype=torch.float32),
            beam_scores=new(batch_size, num_beams, dtype=torch.float32),
            running_beam_indices=new(batch_size, num_beams, length, dtype=torch.int32),
            beam_indices=new(batch_size, num_beams, length, dtype=torch.int32),
            is_sent_finished=new(batch_size, num_beams, dtype=torch.bool),
            early_stop_unsatisfied=new(batch_size, 1, dtype=torch.bool),
            done=new(dtype=torch.bool),
            cur_len=new(),
            prompt_len=new(),
            max_length=new(),
            steps_after_done=new(),
            banned_below=new(vocab_size),
            forced_at=new(len(FORCED_PROCESSORS)),
            forced_tokens=new(len(FORCED_PROCESSORS), vocab_size, dtype=torch.bool),
            repetition_penalty=new(dtype=torch.float32),
            penalty_skip=new(rows),
            position_ids=new(rows, 1),
            attention_mask=new(rows, cache_length),
            step_masks=new(*step_mask_shape(rows, max(cache_length, source)), dtype=model.dtype),
        )
        model._beam_buffers = (key, buffers)
        return buffers


@dataclass(frozen=True)
class BeamSettings:
    """The per-call constants of a beam search (Python values: the compiled step specialises on them)."""

    num_beams: int
    beams_to_keep: int
    length_penalty: float
    early_stopping: bool | str
    no_repeat_ngram_size: int = 0
    penalised: bool = False  # a repetition penalty (its value is a buffer)


def top_k_continuations(model, log_probs: torch.Tensor, buffers: BeamBuffers, beams_to_keep: int):
    """transformers' `_get_top_k_continuations` (no sampling) with the length as a device tensor: its
    `sequences[:, :, cur_len] = ids` would read the length on the host, `index_copy` does not."""
    batch_size, num_beams = buffers.running_beam_scores.shape
    topk_log_probs, topk_indices = torch.topk(log_probs, k=beams_to_keep)
    vocab_size = log_probs.shape[-1] // num_beams
    topk_current_beam_indices = topk_indices // vocab_size
    topk_running_beam_indices = model._gather_beams(buffers.running_beam_indices, topk_current_beam_indices)
    topk_running_sequences = model._gather_beams(buffers.running_sequences, topk_current_beam_indices)
    topk_ids = topk_indices % vocab_size
    topk_running_sequences = topk_running_sequences.index_copy(2, buffers.cur_len.view(1), topk_ids[:, :, None])
    batch_offset = torch.arange(batch_size, device=topk_ids.device).view(-1, 1) * num_beams
    chosen = (topk_current_beam_indices + batch_offset).to(topk_running_beam_indices.dtype)
    column = (buffers.cur_len - buffers.prompt_len).view(1)
    topk_running_beam_indices = topk_running_beam_indices.index_copy(2, column, chosen[:, :, None])
    return topk_log_probs, topk_running_sequences, topk_running_beam_indices


def choose_beams(model, log_probs_input, buffers: BeamBuffers, settings: BeamSettings, eos_token_id, top_mask):
    """transformers' beam step after the forward (its steps b to g), on device state only. `log_probs_input`: the
    float32 logits of the last position, (B·beams, V). Returns the processed log-probabilities (`scores`)."""
    batch_size, num_beams = buffers.running_beam_scores.shape
    log_probs = nn.functional.log_softmax(log_probs_input, dim=-1)
    if settings.penalised:
        log_probs = penalise_repeats(log_probs, buffers)
    log_probs = torch.where(buffers.cur_len < buffers.banned_below, -torch.inf, log_probs)
    if settings.no_repeat_ngram_size:
        sequences = buffers.running_sequences.view(batch_size * num_beams, -1)
        banned = repeated_ngram_bans(sequences, buffers.cur_len, settings.no_repeat_ngram_size, log_probs.shape[-1])
        log_probs = log_probs.masked_fill(banned, -torch.inf)
    log_probs = force_tokens(log_probs, buffers.cur_len, buffers.forced_at, buffers.forced_tokens)
    scores = log_probs
    log_probs = log_probs.view(batch_size, num_beams, -1) + buffers.running_beam_scores[:, :, None]
    log_probs = log_probs.reshape(batch_size, -1)

    topk_log_probs, topk_sequences, topk_beam_indices = top_k_continuations(
        model, log_probs, buffers, settings.beams_to_keep
    )
    # the stopping criteria on the new token: end-of-sequence, or the maximum length reached
    new_tokens = topk_sequences.gather(2, buffers.cur_len.expand(batch_size, settings.beams_to_keep, 1)).squeeze(2)
    hits = (buffers.cur_len + 1 >= buffers.max_length).expand(batch_size, settings.beams_to_keep)
    if eos_token_id is not None:
        hits = hits | torch.isin(new_tokens, eos_token_id)
    running_sequences, running_scores, running_indices = model._get_running_beams_for_next_iteration(
        topk_log_probs=topk_log_probs,
        topk_running_sequences=topk_sequences,
        topk_running_beam_indices=topk_beam_indices,
        next_token_hits_stopping_criteria=hits,
        num_beams=num_beams,
    )
    sequences, beam_scores, beam_indices, is_sent_finished = model._update_finished_beams(
        sequences=buffers.sequences,
        topk_running_sequences=topk_sequences,
        beam_scores=buffers.beam_scores,
        topk_log_probs=topk_log_probs,
        beam_indices=buffers.beam_indices,
        topk_running_beam_indices=topk_beam_indices,
        is_early_stop_heuristic_unsatisfied=buffers.early_stop_unsatisfied,
        is_sent_finished=buffers.is_sent_finished,
        next_token_hits_stopping_criteria=hits,
        top_num_beam_mask=top_mask,
        num_beams=num_beams,
        cur_len=buffers.cur_len,
        decoder_prompt_len=buffers.prompt_len,
        length_penalty=settings.length_penalty,
        early_stopping=settings.early_stopping,
    )
    done = buffers.done
    for buffer, value in (
        (buffers.sequences, sequences),
        (buffers.beam_scores, beam_scores),
        (buffers.beam_indices, beam_indices),
        (buffers.is_sent_finished, is_sent_finished),
    ):  # once the search is over (transformers stopped), the finished hypotheses stay as they are
        buffer.copy_(torch.where(done, buffer, value))
    buffers.running_sequences.copy_(running_sequences)
    buffers.running_beam_scores.copy_(running_scores)
    buffers.running_beam_indices.copy_(running_indices)
    buffers.cur_len.add_(1)
    unsatisfied = model._check_early_stop_heuristic(
        is_early_stop_heuristic_unsatisfied=buffers.early_stop_unsatisfied,
        running_beam_scores=buffers.running_beam_scores,
        beam_scores=buffers.beam_scores,
        is_sent_finished=buffers.is_sent_finished,
        cur_len=buffers.cur_len,
        max_length=buffers.max_length,
        decoder_prompt_len=buffers.prompt_len,
        early_stopping=settings.early_stopping,
        length_penalty=settings.length_penalty,
    )
    buffers.early_stop_unsatisfied.copy_(unsatisfied)
    going_on = model._beam_search_has_unfinished_sequences(
        unsatisfied, buffers.is_sent_finished, hits, settings.early_stopping
    )
    buffers.done.logical_or_(~going_on)
    return scores


def penalise_repeats(log_probs: torch.Tensor, buffers: BeamBuffers) -> torch.Tensor:
    """transformers' repetition penalty on each beam's log-probabilities (B·beams, V): the tokens of the beam's
    sequence so far, past its `penalty_skip` leading positions, multiplied by the penalty where negative (divided
    where positive). The seen tokens are gathered from the running sequences each step (no state to reorder)."""
    rows, vocab = log_probs.shape
    sequences = buffers.running_sequences.view(rows, -1)
    positions = torch.arange(sequences.shape[1], device=sequences.device)
    counted = (positions < buffers.cur_len) & (positions >= buffers.penalty_skip[:, None])
    ids = sequences.masked_fill(~counted, vocab).clamp(max=vocab)
    seen = torch.zeros(rows, vocab + 1, dtype=torch.bool, device=log_probs.device).scatter_(1, ids, True)
    return penalise_seen(log_probs, seen[:, :vocab], buffers.repetition_penalty)


def ending_ids(stopping_criteria, device) -> torch.Tensor | None:
    """The token ids that end a beam: those of the `EosTokenCriteria` in `stopping_criteria` (None: none)."""
    ids = [criterion.eos_token_id.view(-1) for criterion in stopping_criteria if type(criterion) is EosTokenCriteria]
    return torch.cat(ids).to(device) if ids else None


def beam_step(model, cache, buffers: BeamBuffers, settings, eos_token_id, top_mask, encoder, has_padding):
    """One beam-search step, compiled whole: the cache reorder to the beams the last step chose, the masks and
    forward of each beam's last token, `choose_beams`. Returns (logits, scores) of this step.

    The reorder comes first, not after the choice as in transformers: inductor (torch 2.13) miscompiles a gather
    of the cache into itself that follows the forward's write into it in the same graph (the rows come out wrong),
    and compiles the other order correctly."""
    reorder_cache(cache, buffers)
    batch_size, num_beams = buffers.running_beam_scores.shape
    rows = batch_size * num_beams
    previous = (buffers.cur_len - 1).view(1)
    tokens = buffers.running_sequences.view(rows, -1).index_select(1, previous)
    padding = buffers.attention_mask if has_padding else None
    logits = one_token_logits(model, tokens, cache, buffers.position_ids, padding, encoder, buffers.step_masks)
    buffers.steps_after_done.add_(buffers.done.long())
    scores = choose_beams(model, logits, buffers, settings, eos_token_id, top_mask)
    buffers.position_ids.add_(1)
    return logits, scores


def reorder_cache(cache, buffers: BeamBuffers) -> None:
    """Reorder the cache to the beams the last step chose (transformers' step g). Once a step has run past the end
    of the search, the rows stay in the order of transformers' last choice (the first step past the end applied it):
    the returned cache is transformers' when the search ends early too."""
    batch_size, num_beams = buffers.running_beam_scores.shape
    rows = batch_size * num_beams
    column = (buffers.cur_len - 1 - buffers.prompt_len).view(1)
    beam_idx = buffers.running_beam_indices.index_select(2, column).view(rows).long()
    unchanged = torch.arange(rows, device=beam_idx.device)
    reorder(cache, torch.where(buffers.steps_after_done > 0, unchanged, beam_idx))


def compiled_beam_step(model, compile_config):
    """`beam_step` compiled, kept on the model (`decoding_loop.kept_compiled`)."""
    return kept_compiled(model, "_compiled_beam_step", beam_step, compile_config, "the beam-search step")


def _initialise(model, buffers: BeamBuffers, input_ids, num_beams, max_length, pad_fill, processors, model_kwargs):
    """transformers' initial beam state, in the buffers."""
    prompt_len = input_ids.shape[1]
    batch_size = input_ids.shape[0] // num_beams
    buffers.running_sequences.fill_(pad_fill)
    buffers.running_sequences[:, :, :prompt_len] = input_ids.view(batch_size, num_beams, prompt_len)
    buffers.sequences.copy_(buffers.running_sequences)
    buffers.running_beam_scores.zero_()
    buffers.running_beam_scores[:, 1:] = -1e9
    buffers.beam_scores.fill_(-1e9)
    buffers.running_beam_indices.fill_(-1)
    buffers.beam_indices.fill_(-1)
    buffers.is_sent_finished.zero_()
    buffers.early_stop_unsatisfied.fill_(True)
    buffers.done.fill_(False)
    buffers.cur_len.fill_(prompt_len)
    buffers.prompt_len.fill_(prompt_len)
    buffers.max_length.fill_(max_length)
    buffers.steps_after_done.zero_()
    fill_bans(buffers.banned_below, processors.bans)
    fill_forced(buffers.forced_at, buffers.forced_tokens, processors.forced)
    buffers.repetition_penalty.fill_(processors.repetition_penalty)
    skip = processors.prompt_ignore_length
    buffers.penalty_skip.copy_(skip.to(buffers.penalty_skip) if isinstance(skip, torch.Tensor) else torch.tensor(skip))
    fill_prompt_inputs(model, buffers, model_kwargs)


def beam_search(model, input_ids, logits_processor, stopping_criteria, generation_config, step_function, **kwargs):
    """transformers' `_beam_search` (no sampling), every step after the prefill one call of `step_function`
    (`beam_step`, compiled or not), the device read once every CHECK_EVERY steps. Same outputs."""
    config = generation_config
    num_beams = config.num_beams
    batch_size = input_ids.shape[0] // num_beams
    prompt_len = input_ids.shape[1]
    cached_length = cached_prompt_length(model, input_ids, kwargs)
    eos_token_id = config._eos_token_tensor
    pad_token_id = config._pad_token_tensor
    n_eos = eos_token_id.shape[0] if eos_token_id is not None else 0
    processors = split_processors(logits_processor)
    settings = BeamSettings(
        num_beams=num_beams,
        beams_to_keep=max(2, 1 + n_eos) * num_beams,
        # a float: the step raises it to a power of the length as a tensor, where an int's negative powers raise
        length_penalty=float(config.length_penalty),
        early_stopping=config.early_stopping,
        no_repeat_ngram_size=processors.no_repeat_ngram_size,
        penalised=processors.repetition_penalty != 1.0,
    )
    top_mask = torch.arange(settings.beams_to_keep, device=input_ids.device) < num_beams
    pad_fill = pad_token_id or eos_token_id[0] if eos_token_id is not None else -1
    # a beam ends on the ids of the call's `EosTokenCriteria`, as transformers' stopping criteria say: a custom one
    # takes precedence over the config's ids, or stands alone without them (which still size the top-k and the fill)
    eos_token_id = ending_ids(stopping_criteria, input_ids.device)
    keep_scores = config.return_dict_in_generate and config.output_scores
    keep_logits = config.return_dict_in_generate and config.output_logits
    all_scores, raw_logits = [], []

    outputs = prefill(model, input_ids, config, kwargs)
    kwargs = model._update_model_kwargs_for_generation(outputs, kwargs, model.config.is_encoder_decoder)
    cache = cache_in(kwargs)
    logits = outputs.logits[:, -1].to(copy=True, dtype=torch.float32)
    del outputs
    # sized by the cache, which keeps the longest length of any call so far: a shorter call reuses the buffers
    cache_length = cache_positions(model, self_attention_cache(cache))
    length = max(config.max_length, cache_length + 1)
    encoder = encoder_inputs(model, kwargs)
    buffers = BeamBuffers.for_shape(
        model, batch_size, num_beams, length, cache_length, logits.shape[-1], input_ids.device, source_length(encoder)
    )
    check_ids(processors, logits)
    _initialise(model, buffers, input_ids, num_beams, config.max_length, pad_fill, processors, kwargs)
    scores = choose_beams(model, logits, buffers, settings, eos_token_id, top_mask)
    if keep_scores:
        all_scores.append(scores)
    if keep_logits:
        raw_logits.append(logits)

    has_padding = not model.config.is_encoder_decoder and kwargs.get("attention_mask") is not None
    arguments = (settings, eos_token_id, top_mask, encoder, has_padding)
    # window-long sliding (and chunked) layers as rings, until the cache is rewound
    with SlidingRings(cache, getattr(model.config, "layer_types", None)):
        with Spans(cache) as spans, Spares(cache) as spares:
            for step in range(1, config.max_length - prompt_len):
                torch.compiler.cudagraph_mark_step_begin()
                spans.cover(cached_length + step)  # the step writes position cached_length + step - 1
                spares.swap()  # the step's reorder reads the cache from one buffer and writes it to the other
                logits, scores = step_function(model, cache, buffers, *arguments)
                if keep_scores:
                    all_scores.append(scores.clone())
                if keep_logits:
                    raw_logits.append(logits.clone())
                del logits, scores
                if (step + 1) % CHECK_EVERY == 0 and bool(buffers.done):
                    break

            if config.return_dict_in_generate:
                spares.swap()
                reorder_cache(cache, buffers)  # the returned cache follows the last choice, as transformers' does
        steps_run = int(buffers.cur_len) - prompt_len
        extra = int(buffers.steps_after_done)
        rewind(cache, extra)  # forwards past the end: forgotten
    ran = steps_run - extra  # the steps transformers' loop ran
    nrs = config.num_return_sequences
    sequences = buffers.sequences[:, :nrs].reshape(batch_size * nrs, -1)
    beam_scores = buffers.beam_scores[:, :nrs].reshape(batch_size * nrs)
    beam_indices = buffers.beam_indices[:, :nrs].reshape(batch_size * nrs, -1)
    generated = int(((beam_indices + 1).bool()).sum(dim=1).max())
    sequences = sequences[:, : prompt_len + generated].clone()
    if not config.return_dict_in_generate:
        return sequences
    output_class = (
        GenerateBeamEncoderDecoderOutput if model.config.is_encoder_decoder else GenerateBeamDecoderOnlyOutput
    )
    fields = dict(
        sequences=sequences,
        sequences_scores=beam_scores.clone() if config.output_scores else None,
        scores=tuple(all_scores[:ran]) if keep_scores else None,
        logits=tuple(raw_logits[:ran]) if keep_logits else None,
        beam_indices=beam_indices[:, :generated].clone(),
        **with_cache(cache),
    )
    return output_class(**fields)


__all__ = [
    "BeamBuffers",
    "beam_loop_blocker",
    "beam_search",
    "beam_step",
    "choose_beams",
    "compiled_beam_step",
    "reorder_cache",
    "top_k_continuations",
]
