"""Greedy decoding and sampling with no host round trip per token: the whole step compiled, the loop ahead of the GPU.

transformers' greedy and sampling loop (`GenerationMixin._sample`) compiles only the model's forward. Around it,
every token, it runs in eager Python: `prepare_inputs_for_generation`, the 4D masks for the static cache, the logits
processors, the stopping criteria, and a read of `unfinished_sequences.max()` that waits for the GPU (on CUDA it is
not deferred). At batch 1 a 1B-parameter model reads its weights in under a millisecond, so that per-token host
work, not the GPU, sets the speed (the ~20 % of the bandwidth roofline measured with transformers' static path).

Here one compiled function is the whole step: the masks, the forward, the token choice — the `min_length` /
`min_new_tokens` end-of-sequence ban, the repetition penalty (on a (batch, vocabulary) mask of the tokens seen so
far), the `no_repeat_ngram_size` ban (`repeated_ngram_bans`), the score warpers (temperature, top-k, top-p, min-p,
typical, epsilon, eta), argmax or a sample drawn without a host read, padding of finished rows, the end-of-sequence
bookkeeping — and the in-place updates of the next step's inputs. Its inputs are fixed buffers (`DecodingBuffers`,
kept on the model and reused at the same batch size and cache length) and the static cache, so with
`mode="reduce-overhead"` (the default `CompileConfig`) every step replays one CUDA graph. The host only replays: it
reads whether every row has finished once every `CHECK_EVERY` steps (and hands a streamer the tokens so far), and
steps taken past the end are dropped from the output and rewound in the cache.

Decoders and encoder-decoders alike: an encoder-decoder's steps also take the encoder states and the source mask
(`encoder_inputs`), and its decoder positions follow from the cache length.

The same step runs on CPU (plain PyTorch, or compiled when `compile_config._compile_all_devices`), where the tests
check it against transformers' own loop token for token. Stop strings are matched inside the step (transformers' own
`StopStringCriteria` on the last ids of each row, `stop_string_hits`); `max_time` is read by the host at its
check every `CHECK_EVERY` tokens, so a call may run up to CHECK_EVERY - 1 tokens past it. `loop_blocker` says when
this loop does not apply and transformers' loop runs instead (its compiled forward still used): other logits
processors (bad words of several tokens, sequence bias, ...), other stopping criteria, attention or hidden-state
outputs, model inputs other than the prompt's ids, mask and positions, and caches other than a plain `StaticCache`
(its window-long sliding layers, which the loop decodes as rings, are the exception: sliding_layers.py). Samples
follow transformers' distribution but not its random stream: `torch.multinomial` reads the device, so the step
draws by the exponential race (`sample`). The processors' device code (`split_processors`, the bans, `sample`,
`stop_string_hits`) is in loop_processors.py, shared with beam_loop.py.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
from transformers.cache_utils import StaticCache, StaticLayer
from transformers.generation.logits_process import LogitsProcessorList
from transformers.generation.stopping_criteria import (
    EosTokenCriteria,
    MaxLengthCriteria,
    MaxTimeCriteria,
    StoppingCriteriaList,
    StopStringCriteria,
)
from transformers.generation.utils import GenerateDecoderOnlyOutput, GenerateEncoderDecoderOutput
from transformers.masking_utils import create_masks_for_generate
from transformers.utils import logging

from .cache_names import CACHE_NAMES, cache_in, with_cache
from .cache_spans import (
    SpannedLayer,
    Spans,
    advance_lengths,
    attended_length,
    rewind_lengths,
    self_attention_cache,
    self_attention_layers,
)
from .compile_fallback import eager_on_compiler_failure
from .compiled_prefill import prefill
from .input_checks import embedding_rows, resolved_pad_token_id
from .loop_processors import (
    FORCED_PROCESSORS,
    SCORE_WARPERS,
    Processors,
    check_ids,
    fill_bans,
    fill_forced,
    first_argmax,
    force_tokens,
    penalise_seen,
    repeated_ngram_bans,
    sample,
    split_processors,
    stop_string_hits,
)
from .sliding_layers import (
    RingSlidingLayer,
    SlidingRings,
    WholeCacheSlidingLayer,
    ring_blocker,
    ring_mask,
    window_long_layers,
)
from .step_masks import realized_masks, realized_source_mask, source_length, step_mask_shape

logger = logging.get_logger(__name__)

# How often the host reads whether every row has finished (one wait for the GPU per CHECK_EVERY tokens). Steps run
# past the last row's end are dropped from the output and rewound in the cache.
CHECK_EVERY = 16

# Model inputs the decoding steps take over (ids, positions, mask) or that only the prefill reads.
LOOP_MODEL_INPUTS = frozenset(
    {"attention_mask", "position_ids", *CACHE_NAMES, "use_cache", "logits_to_keep", "inputs_embeds"}
    | {"prefix_lengths"}  # prefix-LM: the prefix lies in the prompt; decoding steps are causal (see the model)
    | {"tokenizer"}  # generate's, for stop strings: it stays in the model kwargs, and no forward reads it
)
# What an encoder-decoder's steps take besides the cache: the source's mask and encoder states; segment ids are the
# encoder's alone (read before the loop, when the source is encoded).
SEQ2SEQ_MODEL_INPUTS = frozenset(
    {"attention_mask", "encoder_outputs", *CACHE_NAMES, "use_cache", "logits_to_keep", "tokenizer", "token_type_ids"}
)


def encoder_inputs(model, model_kwargs: dict) -> dict:
    """What every decoding step of an encoder-decoder passes besides the token: the encoder states and the source
    mask. Nothing for a decoder."""
    if not model.config.is_encoder_decoder:
        return {}
    return {"encoder_outputs": model_kwargs["encoder_outputs"], "attention_mask": model_kwargs.get("attention_mask")}


# The stopping criteria every compiled loop follows; `decode` follows `DECODE_CRITERIA`.
LOOP_CRITERIA = (MaxLengthCriteria, EosTokenCriteria)
DECODE_CRITERIA = (*LOOP_CRITERIA, StopStringCriteria, MaxTimeCriteria)


def shared_blocker(
    model, stopping_criteria, generation_config, synced_gpus, model_kwargs, criteria: tuple = LOOP_CRITERIA
) -> str | None:
    """What keeps any call (`decode` or `beam_loop.beam_search`) in transformers' loop, or None. `criteria`: the
    stopping criteria the loop follows. Both loops decode window-long sliding layers as rings (sliding_layers.py)."""
    config = generation_config
    if synced_gpus or config.is_assistant:
        return "synced GPUs or an assistant model"
    if config.output_attentions or config.output_hidden_states:
        return "attentions or hidden states asked for"
    pad, _ = resolved_pad_token_id(config)
    vocab_size = embedding_rows(model.get_output_embeddings())
    if pad is not None and not 0 <= pad < vocab_size:  # the loops feed it to finished rows, and index by it
        return f"pad_token_id {pad} outside the vocabulary [0, {vocab_size})"
    others = sorted({type(criterion).__name__ for criterion in stopping_criteria if type(criterion) not in criteria})
    if others:
        return f"stopping criteria {others}"
    if stopping_criteria.max_length is None:
        return "no maximum length"
    allowed = SEQ2SEQ_MODEL_INPUTS if model.config.is_encoder_decoder else LOOP_MODEL_INPUTS
    extra = sorted(key for key, value in model_kwargs.items() if value is not None and key not in allowed)
    if extra:
        return f"model inputs {extra}"
    cache = cache_in(model_kwargs)
    self_cache = self_attention_cache(cache)
    if type(self_cache) is not StaticCache:  # (one the user passes in, a returned one continuing a conversation, is)
        return "a cache other than a StaticCache"
    windows = window_long_layers(self_cache)
    if windows and (why := ring_blocker(model)):
        return (
            f"window-long sliding-window cache layers, too long to keep whole ({why}; their length is a Python int "
            "per token: sliding_layers.py)"
        )
    kinds = (StaticLayer, SpannedLayer, WholeCacheSlidingLayer)
    layers = (layer for i, layer in enumerate(self_cache.layers) if i not in windows)
    others = sorted({type(layer).__name__ for layer in layers if type(layer) not in kinds})
    return f"cache layers {others}" if others else None


def loop_blocker(
    model, logits_processor, stopping_criteria, generation_config, synced_gpus, streamer, model_kwargs
) -> str | None:
    """Why this call runs transformers' loop rather than `decode`, or None when it runs here. Called by
    `FastDecodingMixin._sample` only where transformers would compile the decoding step. (Streamers are served.)"""
    if split_processors(logits_processor) is None:
        names = sorted({type(p).__name__ for p in logits_processor} - {c.__name__ for c in SCORE_WARPERS})
        return f"logits processors {names}"
    return shared_blocker(model, stopping_criteria, generation_config, synced_gpus, model_kwargs, DECODE_CRITERIA)


def cached_prompt_length(model, input_ids: torch.Tensor, model_kwargs: dict) -> int:
    """The positions the prefill writes into the cache: a decoder prompt given as `inputs_embeds` is as long as the
    embeddings (transformers' `input_ids` is then empty, or as long); otherwise `input_ids`' length."""
    embeds = model_kwargs.get("inputs_embeds")
    if embeds is not None and not model.config.is_encoder_decoder:
        return max(embeds.shape[1], input_ids.shape[1])
    return input_ids.shape[1]


def static_zeros(*shape: int, dtype: torch.dtype = torch.long, device=None) -> torch.Tensor:
    """A zero buffer marked as having a fixed address: compiled graphs and CUDA graphs read it in place."""
    tensor = torch.zeros(shape, dtype=dtype, device=device)
    torch._dynamo.mark_static_address(tensor)
    return tensor


@dataclass
class DecodingBuffers:
    """The decoding step's inputs and outputs, at fixed addresses (what a replayed CUDA graph reads and writes)."""

    input_ids: torch.Tensor  # (B, 1): the token fed to the next step
    position_ids: torch.Tensor  # (B, 1): its position
    attention_mask: torch.Tensor  # (B, max_cache_len): the prompt's padding, ones after it
    unfinished: torch.Tensor  # (B,) long: 1 while the row has not produced an end-of-sequence token
    length: torch.Tensor  # (): the sequence length before the token being chosen (prompt included)
    step: torch.Tensor  # (): the index of the token being chosen among the new tokens
    counted: torch.Tensor  # (): new tokens transformers' loop would have produced (it stops when every row ended)
    sequence: torch.Tensor  # (B, max_cache_len + 1): the prompt's ids, then the new tokens
    banned_below: torch.Tensor  # (V,): token v may not be chosen while `length` < banned_below[v] (min_length)
    seen: torch.Tensor  # (B, V + 1) bool: tokens in the sequence so far (the repetition penalty's; V: ids past V)
    penalty_skip: torch.Tensor  # (B,): positions of the sequence below which the penalty does not count a token
    repetition_penalty: torch.Tensor  # () float32: 1.0 without a penalty (a tensor: values share one graph)
    forced_at: torch.Tensor  # (2,): the lengths at which the forced tokens apply (-1: none; `fill_forced`)
    forced_tokens: torch.Tensor  # (2, V) bool: the tokens forced at those lengths
    step_masks: torch.Tensor  # (slots, B, 1, 1, > cache and source) model dtype: the step's masks (step_masks.py)

    @classmethod
    def for_shape(
        cls, model, batch_size: int, max_cache_len: int, vocab_size: int, device: torch.device, source: int = 0
    ) -> DecodingBuffers:
        """The buffers kept on `model` for this shape (new ones, marked static for compiled graphs, otherwise);
        `source`: an encoder-decoder's source positions (its mask's width)."""
        key = (batch_size, max_cache_len, vocab_size, device, model.dtype, source)
        kept = getattr(model, "_decoding_buffers", None)
        if kept is not None and kept[0] == key:
            return kept[1]

        def new(*shape, dtype=torch.long):
            return static_zeros(*shape, dtype=dtype, device=device)

        buffers = cls(
            input_ids=new(batch_size, 1),
            position_ids=new(batch_size, 1),
            attention_mask=new(batch_size, max_cache_len),
            unfinished=new(batch_size),
            length=new(),
            step=new(),
            counted=new(),
            sequence=new(batch_size, max_cache_len + 1),
            banned_below=new(vocab_size),
            seen=new(batch_size, vocab_size + 1, dtype=torch.bool),
            penalty_skip=new(batch_size),
            repetition_penalty=new(dtype=torch.float32),
            forced_at=new(len(FORCED_PROCESSORS)),
            forced_tokens=new(len(FORCED_PROCESSORS), vocab_size, dtype=torch.bool),
            step_masks=new(*step_mask_shape(batch_size, max(max_cache_len, source)), dtype=model.dtype),
        )
        model._decoding_buffers = (key, buffers)
        return buffers


def choose_tokens(
    logits: torch.Tensor,
    buffers: DecodingBuffers,
    warpers: list,
    do_sample: bool,
    eos_token_id: torch.Tensor | None,
    pad_token_id: torch.Tensor | None,
    ngram: int = 0,
    stop_strings: tuple[StopStringCriteria, ...] = (),
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' token choice for one step, on device state only: the bans, the repetition penalty, the n-gram
    ban, the forced BOS/EOS tokens, the score warpers (temperature, top-k, top-p, ...), argmax or a sample, pad for
    finished rows, end-of-sequence and stop-string bookkeeping; records the tokens (and marks them seen) and advances
    `length`, `step` and `counted`. `ngram`: `no_repeat_ngram_size` (0: none); `stop_strings`: the call's
    `StopStringCriteria`. Returns (next tokens (B,), processed scores (B, V))."""
    scores = torch.where(buffers.length < buffers.banned_below, -math.inf, logits)
    scores = penalise_seen(scores, buffers.seen[:, : scores.shape[-1]], buffers.repetition_penalty)
    if ngram:
        banned = repeated_ngram_bans(buffers.sequence, buffers.length, ngram, scores.shape[-1])
        scores = scores.masked_fill(banned, -math.inf)
    scores = force_tokens(scores, buffers.length, buffers.forced_at, buffers.forced_tokens)
    for warper in warpers:
        scores = warper(None, scores)  # score warpers do not read the sequence (SCORE_WARPERS)
    next_tokens = sample(scores) if do_sample else first_argmax(scores)
    alive = buffers.unfinished.amax()  # transformers' loop runs this step only while a row is unfinished
    if eos_token_id is not None:
        next_tokens = next_tokens * buffers.unfinished + pad_token_id * (1 - buffers.unfinished)
        buffers.unfinished.mul_((~torch.isin(next_tokens, eos_token_id)).long())
    # transformers' penalty skips the first `prompt_ignore_length` positions of the ids, which are new tokens when
    # the prompt came as inputs_embeds (its ids then empty): those are not counted either
    counted = torch.where(buffers.length >= buffers.penalty_skip, next_tokens, buffers.seen.shape[1] - 1)
    buffers.seen.scatter_(1, counted[:, None], True)
    buffers.sequence.index_copy_(1, buffers.length.view(1), next_tokens[:, None])
    buffers.counted.add_(alive)
    buffers.length.add_(1)
    buffers.step.add_(1)
    for criterion in stop_strings:
        buffers.unfinished.mul_((~stop_string_hits(criterion, buffers.sequence, buffers.length)).long())
    return next_tokens, scores


def one_token_logits(
    model, tokens, cache, position_ids, padding_mask, encoder: dict, mask_buffer: torch.Tensor | None = None
) -> torch.Tensor:
    """The float32 logits of a forward of one token per row (B, 1) on a static `cache`, with the masks transformers'
    loop builds for it (`create_masks_for_generate`; a decoder's from its `padding_mask` over the cache, or None, and
    its `position_ids`; an encoder-decoder's decoder positions follow the cache length, and `encoder` holds its
    encoder states and source mask). Where the cache's layers read a span (`cache_spans`), the padding mask is cut to
    it (gathered, not sliced: a slice is contiguous exactly when the span is the whole cache, which the compiled
    graph would then guard on). Sliding and chunked layers decoded as rings get their own masks
    (`sliding_layers.ring_mask`). The masks are written into `mask_buffer` and read from it by every layer
    (`step_masks.realized_masks`). Traceable in one graph: no host read."""
    rings = {}  # a ring of each kind: sliding and chunked layers take masks of their own
    for layer in self_attention_layers(cache):
        if isinstance(layer, RingSlidingLayer):
            rings.setdefault("chunked_attention" if layer.chunked else "sliding_attention", layer)
    local = {kind: ring_mask(model, ring, padding_mask, tokens.shape[0]) for kind, ring in rings.items()}
    span = attended_length(cache)
    if padding_mask is not None and span is not None:
        padding_mask = padding_mask.index_select(1, torch.arange(span, device=padding_mask.device))
    mask_function = getattr(model, "create_masks_for_generate", create_masks_for_generate)
    empty = torch.empty((tokens.shape[0], 1, 0), dtype=model.dtype, device=tokens.device)
    if model.config.is_encoder_decoder:
        masks = mask_function(config=model.config, inputs_embeds=empty, attention_mask=None, **with_cache(cache))
        masks = realized_masks(masks, mask_buffer)
        encoder = dict(encoder, attention_mask=realized_source_mask(encoder.get("attention_mask"), mask_buffer))
        inputs = dict(decoder_input_ids=tokens, decoder_attention_mask=masks, **encoder)
    else:
        masks = mask_function(
            config=model.config,
            inputs_embeds=empty,
            attention_mask=padding_mask,
            position_ids=position_ids,
            **with_cache(cache),
            is_first_iteration=False,
        )
        if local:  # replaces transformers' masks over the rings' slots, which assume them in order
            masks = dict(masks, **local) if isinstance(masks, dict) else next(iter(local.values()))
        masks = realized_masks(masks, mask_buffer)
        inputs = dict(input_ids=tokens, position_ids=position_ids, attention_mask=masks)
    outputs = model(**inputs, **with_cache(cache), use_cache=True, logits_to_keep=1, return_dict=True)
    advance_lengths(cache)  # the layers that left their length to the step (cache_spans.py), all at once
    return outputs.logits[:, -1].to(dtype=torch.float32)


def decoding_step(
    model,
    past_key_values,
    buffers,
    warpers,
    do_sample,
    eos_token_id,
    pad_token_id,
    has_padding,
    encoder,
    ngram=0,
    stop_strings=(),
):
    """One decoding step, compiled whole: the masks transformers' loop would build, the forward of the last chosen
    token (with the `encoder` inputs for an encoder-decoder), the choice of the next one; the next step's inputs are
    updated in place. Returns (logits, scores)."""
    padding = buffers.attention_mask if has_padding else None
    logits = one_token_logits(
        model, buffers.input_ids, past_key_values, buffers.position_ids, padding, encoder, buffers.step_masks
    )
    next_tokens, scores = choose_tokens(
        logits, buffers, warpers, do_sample, eos_token_id, pad_token_id, ngram, stop_strings
    )
    buffers.input_ids.copy_(next_tokens[:, None])
    buffers.position_ids.add_(1)
    return logits, scores


def kept_compiled(model, attribute: str, function, compile_config, what: str):
    """`function` compiled with `compile_config` (transformers' `CompileConfig`), kept on `model` under `attribute`
    and reused while the config is the same (a new `torch.compile` would compile again); eager where the compiler
    fails (`eager_on_compiler_failure`, whose notice names `what`)."""
    kept = getattr(model, attribute, None)
    if kept is not None and kept[0] == compile_config:
        return kept[1]
    compiled = torch.compile(function, **compile_config.to_dict())
    step = eager_on_compiler_failure(model, compiled, function, what)
    setattr(model, attribute, (compile_config, step))
    return step


def compiled_decoding_step(model, compile_config):
    """`decoding_step` compiled, kept on the model (`kept_compiled`)."""
    return kept_compiled(model, "_compiled_decoding_step", decoding_step, compile_config, "the decoding step")


def rewind(cache, steps: int) -> None:
    """Forget the keys of the last `steps` forwards (steps run past the end of every row or search)."""
    rewind_lengths(cache, steps)


def fill_prompt_inputs(model, buffers, model_kwargs: dict) -> None:
    """A decoder's padding mask over the cache (the prompt's, then ones) and the next position per row, from the
    prefill's `model_kwargs`, into `buffers.attention_mask` and `buffers.position_ids`. An encoder-decoder needs
    neither (its mask is the source's, its decoder positions follow the cache length)."""
    buffers.attention_mask.fill_(1)
    if model.config.is_encoder_decoder:
        return
    mask = model_kwargs.get("attention_mask")
    if mask is not None:
        # the prefill's update appended the next token's column: past a cache of max_length - 1 positions when only
        # one token is generated (max_new_tokens=1), and no step reads it then
        width = min(mask.shape[1], buffers.attention_mask.shape[1])
        buffers.attention_mask[:, :width].copy_(mask[:, :width])
    buffers.position_ids.copy_(model_kwargs["position_ids"][:, -1:])


def cache_positions(model, cache) -> int:
    """The positions a static cache holds: its longest layer's, or, where every layer is window-long (sliding
    layers decoded as rings), the length generate built it with."""
    return max(cache.get_max_length(), getattr(model, "_previous_max_cache_length", -1))


def _prepare_buffers(model, input_ids, logits, model_kwargs, processors: Processors) -> DecodingBuffers:
    """The loop's buffers for this call, filled from the prompt (after the prefill)."""
    cache = self_attention_cache(cache_in(model_kwargs))
    batch_size, prompt_length = input_ids.shape
    vocab_size = logits.shape[-1]
    source = source_length(encoder_inputs(model, model_kwargs))
    buffers = DecodingBuffers.for_shape(
        model, batch_size, cache_positions(model, cache), vocab_size, input_ids.device, source
    )
    fill_bans(buffers.banned_below, processors.bans)
    fill_forced(buffers.forced_at, buffers.forced_tokens, processors.forced)
    buffers.repetition_penalty.fill_(processors.repetition_penalty)
    buffers.seen.zero_()
    # the prompt's ids the penalty counts, as transformers selects them: past `prompt_ignore_length`, ids beyond the
    # logits clamped to the extra column V
    ignored = processors.prompt_ignore_length
    if isinstance(ignored, torch.Tensor):
        ignored = ignored.to(input_ids.device)[:, None]
    skipped = torch.arange(prompt_length, device=input_ids.device)[None, :] < ignored
    buffers.penalty_skip.copy_(torch.as_tensor(ignored).view(-1).expand(batch_size))
    buffers.seen.scatter_(1, input_ids.masked_fill(skipped, vocab_size).clamp(max=vocab_size), True)
    buffers.unfinished.fill_(1)
    buffers.length.fill_(prompt_length)
    buffers.step.zero_()
    buffers.counted.zero_()
    buffers.sequence.zero_()
    buffers.sequence[:, :prompt_length] = input_ids
    fill_prompt_inputs(model, buffers, model_kwargs)
    return buffers


def decode(
    model,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config,
    step_function,
    streamer=None,
    **model_kwargs,
):
    """transformers' `_sample` (greedy or sampling), with every decoding step one call of `step_function`
    (`decoding_step`, compiled or not) and no wait for the device between steps. Same outputs: sequences, and with
    `return_dict_in_generate` the scores / logits asked for and the cache. A streamer gets the first new token at
    once, then the new tokens in chunks of up to CHECK_EVERY, as (batch, tokens) tensors (as in assisted decoding)."""
    config = generation_config
    eos_token_id = next((c.eos_token_id for c in stopping_criteria if isinstance(c, EosTokenCriteria)), None)
    pad_token_id = config._pad_token_tensor
    if eos_token_id is not None:
        eos_token_id = eos_token_id.to(input_ids.device)
        pad_token_id = pad_token_id.to(input_ids.device)
    processors = split_processors(logits_processor)
    warpers = processors.warpers
    stop_strings = tuple(c for c in stopping_criteria if isinstance(c, StopStringCriteria))
    for criterion in stop_strings:  # on the device before the step is traced, as its own call would move them
        criterion.embedding_vec = criterion.embedding_vec.to(input_ids.device)
        criterion.target_lens = criterion.target_lens.to(input_ids.device)
    deadlines = [c.initial_timestamp + c.max_time for c in stopping_criteria if isinstance(c, MaxTimeCriteria)]
    deadline = min(deadlines, default=None)
    keep_scores = config.return_dict_in_generate and config.output_scores
    keep_logits = config.return_dict_in_generate and config.output_logits
    scores, raw_logits = [], []

    prompt_length = input_ids.shape[1]
    cached_length = cached_prompt_length(model, input_ids, model_kwargs)
    outputs = prefill(model, input_ids, config, model_kwargs)
    is_encoder_decoder = model.config.is_encoder_decoder
    model_kwargs = model._update_model_kwargs_for_generation(outputs, model_kwargs, is_encoder_decoder)
    cache = cache_in(model_kwargs)
    logits = outputs.logits[:, -1].to(copy=True, dtype=torch.float32)
    del outputs
    check_ids(processors, logits)
    buffers = _prepare_buffers(model, input_ids, logits, model_kwargs, processors)
    ngram = processors.no_repeat_ngram_size
    next_tokens, step_scores = choose_tokens(
        logits, buffers, warpers, config.do_sample, eos_token_id, pad_token_id, ngram, stop_strings
    )
    buffers.input_ids.copy_(next_tokens[:, None])
    if keep_scores:
        scores.append(step_scores)
    if keep_logits:
        raw_logits.append(logits)
    streamed = 0
    if streamer is not None:
        streamer.put(next_tokens[:, None].cpu())
        streamed = 1

    has_padding = not is_encoder_decoder and model_kwargs.get("attention_mask") is not None
    arguments = (
        warpers,
        config.do_sample,
        eos_token_id,
        pad_token_id,
        has_padding,
        encoder_inputs(model, model_kwargs),
        ngram,
        stop_strings,
    )
    checks = eos_token_id is not None or bool(stop_strings) or streamer is not None or deadline is not None
    spans = Spans(cache)
    # window-long sliding (and chunked) layers as rings, until the cache is rewound
    with SlidingRings(cache, getattr(model.config, "layer_types", None)):
        with model._optimize_model_for_decode(), spans:
            for step in range(1, stopping_criteria.max_length - prompt_length):
                torch.compiler.cudagraph_mark_step_begin()  # the last outputs are dead: replay, do not record anew
                spans.cover(cached_length + step)  # the step writes position cached_length + step - 1
                logits, step_scores = step_function(model, cache, buffers, *arguments)
                if keep_scores:
                    scores.append(step_scores.clone())
                if keep_logits:
                    raw_logits.append(logits.clone())
                del logits, step_scores  # a CUDA graph's outputs are overwritten by its next replay
                if (step + 1) % CHECK_EVERY == 0 and checks:
                    counted = int(buffers.counted)  # waits for the device: once every CHECK_EVERY steps
                    if streamer is not None and counted > streamed:
                        streamer.put(buffers.sequence[:, prompt_length + streamed : prompt_length + counted].cpu())
                        streamed = counted
                    if counted < step + 1:  # every row has ended
                        break
                    if deadline is not None and time.time() > deadline:  # max_time: read here, not every token
                        break

        steps_run = int(buffers.step)  # new tokens chosen, the one after the prefill included
        counted = int(buffers.counted)
        rewind(cache, steps_run - counted)  # each step past the end fed one token into the cache
    if streamer is not None:
        if counted > streamed:
            streamer.put(buffers.sequence[:, prompt_length + streamed : prompt_length + counted].cpu())
        streamer.end()
    sequences = buffers.sequence[:, : prompt_length + counted].clone()
    if not config.return_dict_in_generate:
        return sequences
    output_class = GenerateEncoderDecoderOutput if is_encoder_decoder else GenerateDecoderOnlyOutput
    return output_class(
        sequences=sequences,
        scores=tuple(scores[:counted]) if keep_scores else None,
        logits=tuple(raw_logits[:counted]) if keep_logits else None,
        **with_cache(cache),
    )


__all__ = [
    "CHECK_EVERY",
    "cached_prompt_length",
    "choose_tokens",
    "compiled_decoding_step",
    "decode",
    "decoding_step",
    "DecodingBuffers",
    "fill_prompt_inputs",
    "kept_compiled",
    "loop_blocker",
    "one_token_logits",
    "rewind",
    "shared_blocker",
    "static_zeros",
]
