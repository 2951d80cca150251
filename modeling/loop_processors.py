"""The logits processors the compiled decoding loops apply on the device (decoding_loop.py, beam_loop.py).

transformers' processors read the sequence so far and the scores on the host side of its loop; a compiled step whose
inputs are fixed buffers needs their effect as tensor code over those buffers. `split_processors` sorts a call's
processors into what the step applies — bans with a minimum length (`min_length`, `min_new_tokens`,
`suppress_tokens`, one-token `bad_words_ids`: `fill_bans`), the repetition penalty (`penalise_seen`), the
`no_repeat_ngram_size` ban (`repeated_ngram_bans`), forced BOS/EOS tokens (`fill_forced`, `force_tokens`) and the
score warpers, which read the scores alone — or says None when one is of another kind (the call then keeps
transformers' loop). `sample` draws without a host read, `stop_string_hits` runs transformers' `StopStringCriteria`
on a fixed window of ids. Each is checked against transformers' own processor in tests/modeling/test_decoding_loop.py
and tests/modeling/test_beam_loop.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from transformers.generation.logits_process import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    ForcedBOSTokenLogitsProcessor,
    ForcedEOSTokenLogitsProcessor,
    LogitsProcessorList,
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    NoBadWordsLogitsProcessor,
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)
from transformers.generation.stopping_criteria import StopStringCriteria

# Logits processors that read the scores alone (not the sequence so far): called inside the compiled step.
SCORE_WARPERS = (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    MinPLogitsWarper,
    TypicalLogitsWarper,
    EpsilonLogitsWarper,
    EtaLogitsWarper,
)


@dataclass
class Processors:
    """The logits processors of a call, as the compiled step applies them (in this order, as transformers orders
    them): `bans` — (banned ids, minimum length): not chosen while the sequence, prompt included, is shorter; the
    end-of-sequence ids under `min_length` / `min_new_tokens`, and with `ALWAYS` `suppress_tokens` and one-token
    `bad_words_ids` —, a `repetition_penalty` on every token seen so far (none: 1.0), the `no_repeat_ngram_size` ban
    (0: none), the `forced` tokens — (length, ids): at that sequence length every other token is -inf, the forced
    ones 0 (`forced_bos_token_id` at length 1, `forced_eos_token_id` at max_length - 1) —, then the score
    `warpers`."""

    bans: list[tuple[torch.Tensor, int]]
    repetition_penalty: float
    prompt_ignore_length: int | torch.Tensor  # prompt positions the penalty skips (per row: the left padding)
    no_repeat_ngram_size: int  # 0: none
    warpers: list
    forced: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    checked: list = field(default_factory=list)  # processors whose argument checks need the logits (`check_ids`)


# A ban's minimum length for tokens never allowed (`suppress_tokens`, one-token `bad_words_ids`).
ALWAYS = torch.iinfo(torch.int64).max

# The forced-token processors, in transformers' order (the EOS one overrides the BOS one where both apply).
FORCED_PROCESSORS = (ForcedBOSTokenLogitsProcessor, ForcedEOSTokenLogitsProcessor)


def split_processors(logits_processor: LogitsProcessorList) -> Processors | None:
    """`logits_processor` as `Processors`, or None when one is none of these kinds, or comes after a warper (the
    step applies the warpers last), or is a second repetition penalty, or changes scores after a forced token
    (transformers never orders them so; the step forces last before the warpers)."""
    found = Processors(bans=[], repetition_penalty=1.0, prompt_ignore_length=0, no_repeat_ngram_size=0, warpers=[])
    penalties = 0
    for processor in logits_processor:
        kind = type(processor)
        if kind in SCORE_WARPERS:
            found.warpers.append(processor)
        elif found.warpers:
            return None
        elif kind is ForcedBOSTokenLogitsProcessor:
            found.forced.append((1, torch.tensor([processor.bos_token_id])))
        elif kind is ForcedEOSTokenLogitsProcessor:
            found.forced.append((processor.max_length - 1, processor.eos_token_id.view(-1)))
        elif kind is SuppressTokensLogitsProcessor:  # after the forced ones in transformers' list: see the end
            found.bans.append((processor.suppress_tokens, ALWAYS))
        elif found.forced:
            return None
        elif kind is MinLengthLogitsProcessor:
            found.bans.append((processor.eos_token_id, processor.min_length))
        elif kind is NoBadWordsLogitsProcessor and all(len(words) == 1 for words in processor.sequence_bias):
            found.bans.append((torch.tensor([words[0] for words in processor.sequence_bias], dtype=torch.long), ALWAYS))
            found.checked.append(processor)
        elif kind is MinNewTokensLengthLogitsProcessor:
            found.bans.append((processor.eos_token_id, processor.prompt_length_to_skip + processor.min_new_tokens))
        elif kind is NoRepeatNGramLogitsProcessor and not found.no_repeat_ngram_size:
            found.no_repeat_ngram_size = processor.ngram_size
        elif kind is RepetitionPenaltyLogitsProcessor:
            penalties += 1
            found.repetition_penalty = processor.penalty
            if processor.prompt_ignore_length is not None:
                found.prompt_ignore_length = processor.prompt_ignore_length
        else:
            return None
    forced_kinds = [type(p) for p in logits_processor if type(p) in FORCED_PROCESSORS]
    if any(forced_kinds.count(kind) > 1 for kind in FORCED_PROCESSORS) or forced_kinds[::-1] == [*FORCED_PROCESSORS]:
        return None  # two of a kind, or EOS before BOS: not transformers' list (the step has a slot for each)
    never = {int(i) for banned, length in found.bans if length == ALWAYS for i in banned.view(-1).tolist()}
    if any(int(i) in never for _, ids in found.forced for i in ids.tolist()):
        return None  # a forced token also banned: its outcome depends on which comes first (the step forces last)
    return found if penalties <= 1 else None


def check_ids(processors: Processors, logits: torch.Tensor) -> None:
    """The argument checks transformers' processors make on their first call, which the loops do not make: bad words
    past the vocabulary raise transformers' ValueError (`fill_bans` would drop them)."""
    for processor in processors.checked:
        processor._prepare_bias_variables(logits)


def fill_forced(forced_at: torch.Tensor, forced_tokens: torch.Tensor, forced: list[tuple[int, torch.Tensor]]) -> None:
    """Slot i of (`forced_at`, `forced_tokens`) = the i-th forced-token processor's (length, ids); -1: none."""
    forced_at.fill_(-1)
    forced_tokens.zero_()
    for slot, (length, ids) in enumerate(forced):
        forced_at[slot] = length
        forced_tokens[slot, ids.to(forced_tokens.device)] = True


def force_tokens(scores: torch.Tensor, length: torch.Tensor, forced_at: torch.Tensor, forced_tokens: torch.Tensor):
    """transformers' forced-token processors on device: where `length` is slot i's length, every score becomes -inf
    and slot i's tokens 0 (the slots in their processors' order, so a later one overrides)."""
    for slot in range(forced_at.shape[0]):
        forced = torch.where(forced_tokens[slot], 0.0, -math.inf)
        scores = torch.where(length == forced_at[slot], forced, scores)
    return scores


def fill_bans(banned_below: torch.Tensor, bans: list[tuple[torch.Tensor, int]]) -> None:
    """`banned_below[v]`: the length below which token v may not be chosen (0: never banned; `ALWAYS`: never
    allowed). Ids past the vocabulary ban nothing."""
    banned_below.zero_()
    for banned, min_length in bans:
        ids = banned.to(banned_below.device).view(-1)
        ids = ids[(ids >= 0) & (ids < banned_below.shape[0])]
        banned_below[ids] = banned_below[ids].clamp(min=min_length)


# `first_argmax`: the entries of a row one program of the first stage reduces, and the fewest a row needs to be split
ARGMAX_CHUNK = 512
SPLIT_ARGMAX_FROM = 2 * ARGMAX_CHUNK


def first_argmax(scores: torch.Tensor) -> torch.Tensor:
    """`torch.argmax(scores, dim=-1)` of (B, V) scores in two stages: the maximum and its first index in each chunk
    of `ARGMAX_CHUNK` entries, then the first chunk holding the largest. The same index (the first of tied maxima, the
    first NaN, 0 for a row all -inf). Why: inductor never splits an argmax, so a compiled batch-1 step reduced the
    whole vocabulary in one program, with the token choice's other work fused behind it — the decode-1 profile's
    18 µs kernel a token on an H200 for 32,000 logits (docs/gpu.md); split, the chunks reduce in parallel."""
    vocab = scores.shape[-1]
    if vocab < SPLIT_ARGMAX_FROM:
        return torch.argmax(scores, dim=-1)
    chunks = -(-vocab // ARGMAX_CHUNK)
    padded = torch.nn.functional.pad(scores, (0, chunks * ARGMAX_CHUNK - vocab), value=-math.inf)
    values, within = padded.view(*scores.shape[:-1], chunks, ARGMAX_CHUNK).max(dim=-1)  # (B, chunks)
    best = torch.argmax(values, dim=-1, keepdim=True)  # (B, 1)
    return (best * ARGMAX_CHUNK + within.gather(-1, best)).squeeze(-1)


def sample(scores: torch.Tensor) -> torch.Tensor:
    """One token per row from softmax(scores), as `torch.multinomial(probs, 1)` draws it in distribution, by the
    exponential race: argmax of p_i / E_i with E_i ~ Exp(1). No host synchronisation, so it can be in a CUDA graph."""
    probs = torch.softmax(scores, dim=-1)
    race = torch.empty_like(probs).exponential_().clamp_(min=torch.finfo(probs.dtype).tiny)
    return first_argmax(probs / race)


def repeated_ngram_bans(sequence: torch.Tensor, length: torch.Tensor, n: int, vocab_size: int) -> torch.Tensor:
    """transformers' `no_repeat_ngram_size` ban on device, (rows, V) bool: the tokens that would complete an n-gram
    already in each row's first `length` tokens of `sequence` (rows, L), i.e. that follow an earlier occurrence of
    the row's last n - 1 tokens. Nothing before the sequence holds n - 1 tokens. Fixed shapes, no host read."""
    rows, width = sequence.shape
    if n > width:  # no n-gram fits in the sequence buffer (max_length < n): transformers bans nothing either
        return torch.zeros(rows, vocab_size, dtype=torch.bool, device=sequence.device)
    windows = sequence.unfold(1, n, 1)  # (rows, width - n + 1, n): every n consecutive positions
    starts = torch.arange(windows.shape[1], device=sequence.device)
    match = (starts <= length - n).expand(rows, -1)  # the window's last token is already in the sequence
    if n > 1:
        last = sequence.index_select(1, (length - n + 1 + torch.arange(n - 1, device=sequence.device)).clamp(min=0))
        match = match & (windows[:, :, :-1] == last[:, None, :]).all(-1)
    match = match & (length + 1 >= n)
    completing = windows[:, :, -1].masked_fill(~match, vocab_size).clamp(max=vocab_size)
    banned = torch.zeros(rows, vocab_size + 1, dtype=torch.bool, device=sequence.device)
    return banned.scatter_(1, completing, True)[:, :vocab_size]


def penalise_seen(scores: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """transformers' repetition penalty where `seen`: negative scores multiplied by `penalty`, others divided."""
    return torch.where(seen, torch.where(scores < 0, scores * penalty, scores / penalty), scores)


def stop_string_hits(criterion: StopStringCriteria, sequence: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
    """transformers' `StopStringCriteria` on each row's first `length` tokens of `sequence` (rows, L): (rows,) bool,
    True where the row's text ends with one of its stop strings. It reads the last `maximum_token_len` ids; places
    before the sequence's start get the id past its table (its "no match" entry), which ends a match as the
    sequence's start does. Fixed shapes, no host read."""
    span = criterion.maximum_token_len
    positions = length - span + torch.arange(span, device=sequence.device)
    ids = sequence.index_select(1, positions.clamp(min=0))
    ids = ids.masked_fill(positions < 0, criterion.embedding_vec.shape[0] - 1)
    return criterion(ids, None)


__all__ = [
    "ALWAYS",
    "FORCED_PROCESSORS",
    "SCORE_WARPERS",
    "Processors",
    "check_ids",
    "fill_bans",
    "fill_forced",
    "force_tokens",
    "penalise_seen",
    "repeated_ngram_bans",
    "sample",
    "split_processors",
    "stop_string_hits",
]
