"""Fast decoding: a static KV cache and a compiled one-token decoding step, the default on CUDA.

transformers' `generate` has the fast path already: with `cache_implementation="static"` the cache has fixed shapes,
the masks are built outside the model, and on accelerators the decoding step is compiled (`torch.compile`, CUDA
graphs through `mode="reduce-overhead"`), so a batch-1 step is bound by reading the weights, not by launching many
small kernels. It takes that path only when asked. `FastDecodingMixin` makes it archlab's default on CUDA and fills
in what transformers leaves out:

- the cache choice (`choose_cache_implementation`): on CUDA (`decodes_compiled_by_default`, the one device decision)
  and with no cache setting from the user, the static cache; `cache_implementation="dynamic"` or
  `disable_compile=True` opt out, assistant models and decoding loops without static caches are left alone, and
  nothing changes on CPU;
- variants whose decoding step cannot be compiled (`static_cache_blocker`: dynamic RoPE recomputes its frequencies
  from a tensor in every forward) decode with the dynamic cache instead, with one logged line saying why; by
  default so do FlashAttention backends, sharded models, and beam sampling too long to keep every key in the
  sliding layers (`sliding_window_blocker`, sliding_layers.py; shorter generations keep them, the window masked,
  and longer greedy decoding, sampling and beam search decode window-long layers as rings);
- greedy decoding and sampling on that path run `decoding_loop.decode`: the whole step (masks, forward, token
  choice, end-of-sequence bookkeeping) compiled as one graph and the loop never waiting for the device, where
  transformers compiles the forward alone and reads the device every token; the calls it does not take run
  transformers' loop with its compiled forward (`decoding_loop.loop_blocker` says when);
- beam search: on that path it runs `beam_loop.beam_search` — the whole step (forward, top-k over beams ×
  vocabulary, the running/finished bookkeeping, the cache reorder at fixed addresses) compiled as one graph, no
  device read per token. The beam searches it does not take (`beam_loop.beam_loop_blocker`: beam sampling, other
  processors) run transformers' loop, where transformers would reorder a static cache by replacing its tensors (so
  compiled graphs and CUDA graphs recompile or re-record every step) and run the steps eagerly; here the reorder
  copies in place (`reorder_cache_in_place`) and the one-token steps run compiled. An encoder-decoder's beam search
  (either loop) keeps each source's cross-attention keys and values once for all its beams (`SHARED_SOURCE_KEYS`,
  `attention.rows_per_source`): the beams of a sentence attend to them together, and the cross-attention cache, the
  largest read of a Marian-shaped step after the weights, shrinks by the number of beams;
- an encoder-decoder's source, on that path, is padded to a few lengths (`source_padding.py`), so calls with other
  source lengths reuse the kept static cache and its recorded steps;
- with `generate(..., compile_prefill=True)`, a decoder's prefill on that path (both loops) runs compiled whole with
  dynamic shapes once the kept cache exists (`compiled_prefill.py`), on CUDA with the prompt padded to a bucket and
  replayed as a CUDA graph (`prefill_buckets.py`): eagerly, a long prompt's forward waits on the host launching its
  kernels; compiling it costs about a minute once per process on an H100, so it is asked for.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, EncoderDecoderCache, StaticLayer
from transformers.generation.configuration_utils import (
    ALL_STATIC_CACHE_IMPLEMENTATIONS,
    CompileConfig,
    GenerationConfig,
    GenerationMode,
)
from transformers.utils import logging
from transformers.utils.generic import is_flash_attention_requested

from .beam_loop import beam_loop_blocker, beam_search, compiled_beam_step
from .bitlinear import ternary_weights_once
from .cache_growth import grow_static_cache
from .cache_names import cache_in
from .cache_reset import reset_at_once
from .cache_spans import make_spanned
from .catalogue import POSITION_SCHEMES
from .compile_fallback import eager_on_compiler_failure
from .compiled_prefill import check_compile_prefill
from .decoding_loop import compiled_decoding_step, decode, loop_blocker
from .fused_projections import inference_projections
from .input_checks import check_special_token_ids, embedding_rows
from .rotary import rope_types
from .sinusoidal import check_generation_fits_the_table
from .sliding_layers import (
    RING_MODES,
    decodes_as_rings,
    keep_sliding_layers_whole,
    kept_whole,
    ring_blocker,
    window_long_layers,
)
from .source_padding import pad_source, padded_source_length, pads_sources
from .step_compile import step_compile_config

logger = logging.get_logger(__name__)

# Beam search on generate's static cache keeps each source's cross-attention keys and values once for all its beams
# (attention.rows_per_source): 1 / num_beams of the cross-attention cache's memory, and of its bytes read per step.
# False: once per beam, as transformers' caches hold them.
SHARED_SOURCE_KEYS = True

# The decoding loops that run their steps through the static cache: greedy and sampling (transformers' `_sample`),
# beam search and beam sampling (`_beam_search`). Assisted decoding refuses static caches.
STATIC_CACHE_MODES = (
    GenerationMode.GREEDY_SEARCH,
    GenerationMode.SAMPLE,
    GenerationMode.BEAM_SEARCH,
    GenerationMode.BEAM_SAMPLE,
)


def decodes_compiled_by_default(device: torch.device) -> bool:
    """Whether `generate` on `device` takes the static cache (and with it the compiled decoding step) when the user
    chose no cache: on CUDA. Elsewhere a compiled step is slower than eager until it has paid for its compilation."""
    return device.type == "cuda"


def static_cache_blocker(config) -> str | None:
    """Why `config` cannot decode on the static, compiled path, or None when it can."""
    if "dynamic" in rope_types(config):
        return (
            "dynamic RoPE (rope_type 'dynamic') recomputes its frequencies from the sequence length inside every "
            "forward, which a compiled decoding step cannot follow"
        )
    return None


def static_cache_length(model, generation_config: GenerationConfig) -> int:
    """The length of the static cache generate builds for this call: it keeps the longest of any call so far."""
    return max(
        generation_config.max_length - 1,
        generation_config.max_cache_len or 0,
        getattr(model, "_previous_max_cache_length", -1),
    )


def sliding_window_blocker(
    model,
    generation_config: GenerationConfig,
    batch_size: int | None = None,
    generation_mode: GenerationMode = GenerationMode.GREEDY_SEARCH,
) -> str | None:
    """Why the CUDA default keeps the dynamic cache for this generation, or None. A static cache too long to keep its
    sliding layers whole (`sliding_layers.kept_whole`: over 4 windows, and past the window more bytes than the weights
    or than a quarter of the free memory) has transformers' window-long `StaticSlidingWindowLayer`s, which once full
    count their length in a Python int that a compiled forward takes as an input: CUDA graphs would record a new graph
    every token. Greedy decoding, sampling and beam search decode them as rings (`sliding_layers.SlidingRings`); beam
    sampling (transformers' loop), and backends a ring cannot serve (`ring_blocker`), keep the dynamic cache.
    `batch_size`: the rows of the call's cache (beams and returned sequences included)."""
    config = model.config
    window = getattr(config, "sliding_window", None)
    if window is None or "sliding_attention" not in (getattr(config, "layer_types", None) or []):
        return None
    length = static_cache_length(model, generation_config)
    if decodes_as_rings(model, generation_mode) or kept_whole(model, length, batch_size):
        return None
    if generation_mode not in RING_MODES:
        why = "beam sampling runs transformers' loop, which has no rings"
    else:
        why = ring_blocker(model)
    return (
        f"this generation's cache ({length} positions) is too long to keep whole in its sliding layers (window "
        f"{window}; sliding_layers.py), {why}, and a static cache's window-long sliding layers advance a Python "
        "counter per token, which CUDA graphs would record anew each step"
    )


def _is_sharded(model) -> bool:
    """Parameters split across processes (FSDP2, tensor parallelism): `DTensor`s, which only a process with a
    process group has (their device mesh needs one). Elsewhere no parameter is looked at: the walk over a 22-layer
    model's modules costs ~0.25 ms of host time, every `generate` call."""
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return False
    from torch.distributed.tensor import DTensor

    return any(isinstance(parameter, DTensor) for parameter in model.parameters())


def _default_blocker(model) -> str | None:
    """Why the CUDA default does not take the static path for `model`, or None when it does: a variant that cannot,
    a FlashAttention backend (it breaks the compiled graph, and `generate` drops an all-ones padding mask before the
    cache is chosen, which a static cache with FlashAttention needs), or sharded parameters (generation inside a
    sharded training run is not where a compile should start unasked)."""
    if is_flash_attention_requested(model.config):
        return f"the attention backend {model.config._attn_implementation!r} is not compiled into the decoding step"
    if _is_sharded(model):
        return "its parameters are sharded (FSDP2 or tensor parallelism); ask for cache_implementation='static'"
    return static_cache_blocker(model.config)


def choose_cache_implementation(
    model,
    generation_config: GenerationConfig,
    model_kwargs: dict,
    generation_mode: GenerationMode,
    cache_rows: int | None = None,
) -> str | None:
    """The `cache_implementation` this `generate` call decodes with (None: transformers' dynamic cache).

    A cache the user passed, or any cache setting they chose, is kept; with none, the static cache where
    `decodes_compiled_by_default` says so, unless `use_cache=False`, `disable_compile=True`, an assistant model, a
    decoding loop other than greedy / sampling / beam search, or a model that cannot (`_default_blocker`; one logged
    line says why). A static cache asked for by a variant that cannot decode with it falls back to the dynamic
    cache, with one logged line too. `cache_rows`: the rows of the static cache the call would build (whether a
    sliding-window model's sliding layers can be kept whole depends on them).
    """
    requested = generation_config.cache_implementation
    if cache_in(model_kwargs) is not None:
        return requested  # transformers refuses a cache together with a setting; nothing to choose
    if requested is None:
        if (
            not decodes_compiled_by_default(model.device)
            or generation_config.use_cache is False
            or generation_config.disable_compile
            or generation_config.is_assistant  # an assistant's cache is cropped after rejected tokens: dynamic only
            or generation_mode not in STATIC_CACHE_MODES
        ):
            return None
        reason = _default_blocker(model) or sliding_window_blocker(
            model, generation_config, cache_rows, generation_mode
        )
        if reason is not None:
            logger.warning_once(
                f"{type(model).__name__} decodes with the dynamic cache, not the compiled path: {reason}."
            )
            return None
        return "static"
    if requested in ALL_STATIC_CACHE_IMPLEMENTATIONS:
        reason = static_cache_blocker(model.config)
        if reason is None and generation_mode == GenerationMode.ASSISTED_GENERATION and model.config.is_encoder_decoder:
            reason = (
                "assisted decoding crops the cache after rejected draft tokens, and transformers crops an "
                "encoder-decoder's cache only when it is dynamic"
            )
        if reason is not None:
            fallback = "offloaded" if "offloaded" in requested else None
            logger.warning_once(
                f"cache_implementation={requested!r} is not available to this {type(model).__name__}: {reason}; "
                f"it decodes with the {fallback or 'dynamic'} cache instead."
            )
            return fallback
    return requested


def cap_candidates(generator, max_length: int):
    """`generator` with its candidate sequences cut to `max_length - 1` tokens (and its candidate logits to match):
    the target checks them in one forward that also yields the token after them, so a longer draft runs past the
    generation. transformers' assistant model caps its drafts so, but prompt lookup (`PromptLookupCandidateGenerator`)
    caps them at `max_length`: its last check then writes position `max_length - 1`, past a static cache
    (`max_length - 1` positions: an IndexError) and, at the end of a position table, past the table."""
    get_candidates = generator.get_candidates

    def capped(input_ids, *args, **kwargs):
        candidates, logits = get_candidates(input_ids, *args, **kwargs)
        extra = candidates.shape[1] - max(max_length - 1, input_ids.shape[1])
        if extra > 0:
            candidates = candidates[:, :-extra]
            logits = logits[:, :-extra] if logits is not None else None
        return candidates, logits

    generator.get_candidates = capped
    return generator


def reorder_cache_in_place(cache: Cache, beam_idx: torch.LongTensor) -> None:
    """Beam search's reorder of a self-attention cache. Static layers are copied in place: their tensors' addresses
    are baked into compiled graphs and CUDA graphs (transformers' own reorder replaces them, and reads the cache
    length from the device). Other layers reorder as transformers does."""
    for layer in cache.layers:
        if isinstance(layer, StaticLayer):
            if layer.is_initialized:
                index = beam_idx.to(layer.keys.device)
                layer.keys.copy_(layer.keys.index_select(0, index))
                layer.values.copy_(layer.values.index_select(0, index))
        else:
            layer.reorder_cache(beam_idx)


def is_decoding_step(cache: Cache | None) -> bool:
    """A forward with `cache` is a decoding step, not the prefill: a compileable cache whose self-attention layers
    already hold keys (and, for an encoder-decoder, whose cross-attention keys are cached). Python state only."""
    if cache is None or not cache.is_compileable:
        return False
    if isinstance(cache, EncoderDecoderCache):
        if not all(cache.is_updated.values()):
            return False
        cache = cache.self_attention_cache
    return all(getattr(layer, "is_initialized", False) for layer in cache.layers)


@contextmanager
def compiled_decoding_steps(model, compile_config: CompileConfig | None) -> Iterator[None]:
    """Inside, `model`'s decoding steps (`is_decoding_step`) run through a compiled `forward` and the prefill eagerly,
    as transformers' greedy and sampling loops do. The compiled forward is kept on the model for the next call."""
    compile_config = compile_config or model._default_compile_config()
    own_forward = model.__dict__.get("forward")  # an instance-level forward (accelerate's hooks) is kept
    eager = model.forward
    if getattr(model, "_compiled_decoding_key", None) != (compile_config, eager):
        compiled = torch.compile(eager, **compile_config.to_dict())
        model._compiled_decoding_forward = eager_on_compiler_failure(model, compiled, eager, "the decoding step")
        model._compiled_decoding_key = (compile_config, eager)
    compiled = model._compiled_decoding_forward

    def forward(*args, **kwargs):
        return (compiled if is_decoding_step(cache_in(kwargs)) else eager)(*args, **kwargs)

    model.forward = forward
    try:
        yield
    finally:
        if own_forward is None:
            del model.forward
        else:
            model.forward = own_forward


# torch.compile modes that run compiled code as CUDA graphs (one recorded per distinct symbolic size).
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


def records_a_graph_per_token(model, generation_config: GenerationConfig, model_kwargs: dict) -> bool:
    """Whether transformers' loop, compiling its steps, would record a CUDA graph for every token: the cache has
    window-long sliding layers (their length a symbolic int once full) and the compile mode uses CUDA graphs."""
    compile_config = generation_config.compile_config or model._default_compile_config()
    return compile_config.mode in CUDA_GRAPH_MODES and bool(window_long_layers(cache_in(model_kwargs)))


def eager_steps_for_window_long_layers(model, generation_config: GenerationConfig, model_kwargs: dict):
    """The generation config transformers' own loop runs with: compiling off (a copy saying `disable_compile`) where
    its compiled steps would record a CUDA graph each (`records_a_graph_per_token`); else as it is."""
    if not records_a_graph_per_token(model, generation_config, model_kwargs):
        return generation_config
    logger.info_once(f"{type(model).__name__}: window-long sliding layers in transformers' loop: steps run eagerly.")
    eager = copy.copy(generation_config)
    eager.disable_compile = True
    return eager


@dataclass
class KeptCache:
    """The last static cache `generate` built, and whether the next call may reset and reuse it."""

    key: tuple
    cache: Cache
    reusable: bool = False


# What `generate` keeps on a model for its next call: the memory `release_decoding_memory` frees, and compiled
# callables (transformers' `_compiled_call` and archlab's; several are bound to this model's `forward`, so a copy
# running them would read this model's weights). A copy or a pickle of the model leaves them out, as torch leaves
# out a module's `_compiled_call_impl`; the copy compiles and allocates its own when it generates.
KEPT_MEMORY = ("_kept_static_cache", "_decoding_buffers", "_beam_buffers", "_previous_max_source_length")
KEPT_COMPILED = (
    "_compiled_call",
    "_guarded_compiled_call",
    "_compiled_decoding_forward",
    "_compiled_decoding_key",
    "_compiled_decoding_step",
    "_compiled_beam_step",
    "_compiled_prefill",
)


def table_of(config) -> str | None:
    """The absolute position table a config's model looks positions up in ("learned", "sinusoidal"), else None."""
    kind = getattr(config, "position_embedding_type", None)
    return kind if kind in POSITION_SCHEMES and POSITION_SCHEMES[kind].table else None


class FastDecodingMixin:
    """`GenerationMixin` hooks for the fast path; first in a model's bases (its `get_compiled_call` overrides
    `PreTrainedModel`'s)."""

    def __getstate__(self) -> dict:
        """The module's state without what generate keeps for its next call (`KEPT_MEMORY`, `KEPT_COMPILED`): a
        `copy.deepcopy` (TRL's reference model, an EMA copy) decodes with its own weights, and `torch.save(model)`
        pickles after a compiled `generate`."""
        state = super().__getstate__()
        for name in KEPT_MEMORY + KEPT_COMPILED:
            state.pop(name, None)
        return state

    def _prepare_cache_for_generation(
        self, generation_config: GenerationConfig, model_kwargs: dict, generation_mode: GenerationMode, *args, **kwargs
    ):
        # a static cache passed back to continue from (multi-turn) grows to this call's length (cache_growth.py)
        grow_static_cache(self, cache_in(model_kwargs), generation_config.max_length - 1)
        batch_size = args[0] if args else kwargs.get("batch_size")
        per_prompt = max(generation_config.num_beams, generation_config.num_return_sequences)
        rows = None if batch_size is None else batch_size * per_prompt  # a static cache's, as transformers sizes it
        generation_config.cache_implementation = choose_cache_implementation(
            self, generation_config, model_kwargs, generation_mode, rows
        )
        beams = generation_mode in (GenerationMode.BEAM_SEARCH, GenerationMode.BEAM_SAMPLE)
        self._rows_per_source = generation_config.num_beams if beams and SHARED_SOURCE_KEYS else 1
        self._decodes_rings = decodes_as_rings(self, generation_mode)  # for `_prepare_static_cache`
        self._assisted = generation_mode == GenerationMode.ASSISTED_GENERATION  # for `_prepare_static_cache`
        try:
            result = super()._prepare_cache_for_generation(
                generation_config, model_kwargs, generation_mode, *args, **kwargs
            )
        finally:
            del self._rows_per_source, self._decodes_rings, self._assisted
        kept = self.__dict__.get("_kept_static_cache")
        if kept is not None and cache_in(model_kwargs) is kept.cache:
            kept.reusable = not generation_config.return_dict_in_generate  # a returned cache is the user's
        return result

    def _validate_generated_length(self, generation_config: GenerationConfig, input_ids_length, has_default):
        """transformers' checks, and on an accelerator a `max_length` past an absolute position table refused up front
        (`check_generation_fits_the_table`): the last token generated is fed to no forward."""
        super()._validate_generated_length(generation_config, input_ids_length, has_default)
        check_generation_fits_the_table(
            self.config,
            self.device,
            generation_config.max_length - 1,
            table_of(self.config),
            f"`max_length` {generation_config.max_length} ({input_ids_length} input tokens and the new ones)",
            f"ask for at most {getattr(self.config, 'max_position_embeddings', 0) + 1 - input_ids_length} new tokens",
        )

    def _maybe_prepare_encoder_kwargs_for_generation(
        self, inputs_tensor, model_kwargs: dict, model_input_name, generation_config: GenerationConfig
    ):
        """An encoder-decoder's source, on the fast path, right-padded to a multiple of `SOURCE_STEP` positions and to
        the longest so far (source_padding.py) before it is encoded: later calls with other source lengths reuse the
        static cache and the recorded steps. On an accelerator, a source longer than an absolute position table is
        refused first (`check_generation_fits_the_table`)."""
        if self.config.is_encoder_decoder:
            check_generation_fits_the_table(
                self.config,
                inputs_tensor.device,
                inputs_tensor.shape[1],
                table_of(self.config),
                f"A source of {inputs_tensor.shape[1]} tokens",
                "truncate the sources (the tokenizer's `truncation=True, max_length=...`)",
            )
            mode = generation_config.get_generation_mode()
            cache = choose_cache_implementation(self, generation_config, model_kwargs, mode)
            if pads_sources(self, generation_config, model_kwargs, model_input_name, cache):
                previous = self.__dict__.get("_previous_max_source_length", 0)
                limit = getattr(self.config, "max_position_embeddings", None)
                length = padded_source_length(inputs_tensor.shape[1], previous, limit)
                pad = generation_config._pad_token_tensor
                inputs_tensor, model_kwargs = pad_source(inputs_tensor, model_kwargs, length, pad)
                self._previous_max_source_length = max(previous, length)
        return super()._maybe_prepare_encoder_kwargs_for_generation(
            inputs_tensor, model_kwargs, model_input_name, generation_config
        )

    def _prepare_static_cache(self, cache_implementation, batch_size, max_cache_len, *args, **kwargs):
        """transformers' static cache, reused by the next call of the same shape (batch size, length and, for an
        encoder-decoder, source length; reset, not reallocated) unless the call that used it returned it.
        transformers builds a new one per call: new addresses, so the compiled step's CUDA graphs are recorded again
        every call, and past torch's re-record limit (`cudagraph_unexpected_rerecord_limit`, 128 recordings of a
        step: a few dozen calls) no longer replayed."""
        effective = max(max_cache_len, getattr(self, "_previous_max_cache_length", -1))
        # sliding layers kept whole, or window-long (rings in greedy decoding, sampling, beam search: sliding_layers.py)
        # - assisted decoding crops the cache after rejected drafts, which a window-long layer past its window cannot
        # undo (transformers refuses it, `is_croppable`): whole there
        whole = not self.config.is_encoder_decoder and (
            kept_whole(self, effective, batch_size, getattr(self, "_decodes_rings", False))
            or getattr(self, "_assisted", False)
        )
        key = (cache_implementation, batch_size, effective, self.dtype, self.device, whole)
        rows_per_source = 1
        if self.config.is_encoder_decoder:  # its cross-attention cache is as long as the source
            model_kwargs = kwargs["model_kwargs"] if "model_kwargs" in kwargs else args[-1]
            rows_per_source = getattr(self, "_rows_per_source", 1)
            key += (model_kwargs["encoder_outputs"][0].shape[1], rows_per_source)
        kept = self.__dict__.get("_kept_static_cache")
        if kept is not None and kept.key == key and kept.reusable:
            reset_at_once(kept.cache)  # one foreach kernel, not three launches a layer
            kept.reusable = False
            return kept.cache
        cache = super()._prepare_static_cache(cache_implementation, batch_size, max_cache_len, *args, **kwargs)
        make_spanned(cache)  # the compiled loops' steps read the filled part of the cache only (cache_spans.py)
        if whole:
            keep_sliding_layers_whole(cache, effective)
        elif (
            self.config.is_encoder_decoder and rows_per_source > 1
        ):  # beam search: each source's cross-attention keys once, not once per beam
            cache.rows_per_source = rows_per_source
        self._kept_static_cache = KeptCache(key, cache)
        return cache

    def release_decoding_memory(self) -> None:
        """Free what `generate` keeps on the model between calls on the fast path: the static KV cache it reuses (with
        beam search's spare buffers, `beam_reorder.py`) and the compiled loops' buffers (for a batch of 64 at 2,048
        positions of a 1B model, gigabytes), and the longest padded source (source_padding.py). The next call allocates
        them again (and records its CUDA graphs again)."""
        for name in KEPT_MEMORY:
            self.__dict__.pop(name, None)

    def _get_candidate_generator(self, generation_config: GenerationConfig, *args, **kwargs):
        """transformers' candidate generator (assisted decoding, prompt lookup), its candidates capped at
        `max_length - 1` tokens (`cap_candidates`)."""
        generator = super()._get_candidate_generator(generation_config, *args, **kwargs)
        return cap_candidates(generator, generation_config.max_length)

    def _prepare_special_tokens(self, generation_config: GenerationConfig, *args, **kwargs):
        """transformers' preparation, after the special token ids are checked against the output vocabulary
        (`input_checks.check_special_token_ids`): an id outside it fails early, naming its field, not as an IndexError
        at the step that forces it or a device-side assert where a finished row is fed its pad."""
        batch_size = kwargs.get("batch_size", args[2] if len(args) > 2 else None)
        output = self.get_output_embeddings()
        vocab_size = embedding_rows(output) if output is not None else self.config.get_text_config().vocab_size
        check_special_token_ids(generation_config, vocab_size, self.config.is_encoder_decoder, batch_size)
        return super()._prepare_special_tokens(generation_config, *args, **kwargs)

    def _prepare_generation_config(self, generation_config, *args, **kwargs):
        """transformers' preparation, plus `compile_prefill` (compiled_prefill.py: off unless asked for, as a keyword
        of `generate` or an attribute of the generation config) checked to be a bool."""
        compile_prefill = kwargs.pop("compile_prefill", None)
        generation_config, model_kwargs = super()._prepare_generation_config(generation_config, *args, **kwargs)
        if compile_prefill is not None:
            generation_config.compile_prefill = compile_prefill
        check_compile_prefill(generation_config)
        return generation_config, model_kwargs

    def _sample(
        self,
        input_ids,
        logits_processor,
        stopping_criteria,
        generation_config,
        synced_gpus=False,
        streamer=None,
        **model_kwargs,
    ):
        """Greedy decoding and sampling through `decoding_loop.decode` where transformers would compile the decoding
        step and `loop_blocker` finds nothing against it; otherwise transformers' loop. Either way q/k/v and gate/up
        are read as one product each on CUDA (`fused_projections.inference_projections`), and BitLinear layers' ternary
        weights computed once (`bitlinear.ternary_weights_once`)."""
        with inference_projections(self), ternary_weights_once(self):
            return self._sample_with_projections_ready(
                input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus, streamer, **model_kwargs
            )

    def _sample_with_projections_ready(
        self, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus, streamer, **model_kwargs
    ):
        args = (input_ids, logits_processor, stopping_criteria, generation_config)
        if self._valid_auto_compile_criteria(model_kwargs, generation_config):
            reason = loop_blocker(
                self, logits_processor, stopping_criteria, generation_config, synced_gpus, streamer, model_kwargs
            )
            if reason is None:
                step = compiled_decoding_step(self, step_compile_config(self, generation_config))
                return decode(self, *args, step_function=step, streamer=streamer, **model_kwargs)
            logger.info_once(f"{type(self).__name__}: transformers' decoding loop runs this call ({reason}).")
            args = (*args[:3], eager_steps_for_window_long_layers(self, generation_config, model_kwargs))
        return super()._sample(*args, synced_gpus=synced_gpus, streamer=streamer, **model_kwargs)

    def get_compiled_call(self, compile_config):
        """transformers' compiled forward (its greedy and sampling loop's decoding steps), eager where the compiler
        fails (one logged line) rather than an error in the middle of `generate`."""
        compiled = super().get_compiled_call(compile_config)
        if getattr(self, "_guarded_compiled_call", (None,))[0] is not compiled:
            guarded = eager_on_compiler_failure(self, compiled, self.__call__, "the decoding step")
            self._guarded_compiled_call = (compiled, guarded)
        return self._guarded_compiled_call[1]

    def _reorder_cache(self, past_key_values: Cache, beam_idx: torch.LongTensor) -> Cache:
        reorder_cache_in_place(past_key_values, beam_idx)
        return past_key_values

    def _beam_search(self, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False, **kw):
        """Beam search through `beam_loop.beam_search` where transformers would compile the decoding step and
        `beam_loop_blocker` finds nothing against it; there otherwise transformers' loop with its one-token steps
        compiled (`compiled_decoding_steps`); elsewhere transformers' loop as it is. q/k/v and gate/up are read as
        one product each on CUDA (`fused_projections.inference_projections`), and BitLinear layers' ternary weights
        computed once (`bitlinear.ternary_weights_once`)."""
        with inference_projections(self), ternary_weights_once(self):
            return self._beam_search_with_projections_ready(
                input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus, **kw
            )

    def _beam_search_with_projections_ready(
        self, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus, **kw
    ):
        args = (input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus)
        if not self._valid_auto_compile_criteria(kw, generation_config):
            return super()._beam_search(*args, **kw)
        reason = beam_loop_blocker(self, logits_processor, stopping_criteria, generation_config, synced_gpus, kw)
        if reason is None:
            step = compiled_beam_step(self, step_compile_config(self, generation_config))
            return beam_search(self, *args[:4], step_function=step, **kw)
        logger.info_once(f"{type(self).__name__}: transformers' beam-search loop runs this call ({reason}).")
        if records_a_graph_per_token(self, generation_config, kw):
            return super()._beam_search(*args, **kw)
        with compiled_decoding_steps(self, generation_config.compile_config):
            return super()._beam_search(*args, **kw)


__all__ = [
    "FastDecodingMixin",
    "STATIC_CACHE_MODES",
    "choose_cache_implementation",
    "compiled_decoding_steps",
    "decodes_compiled_by_default",
    "is_decoding_step",
    "reorder_cache_in_place",
    "sliding_window_blocker",
    "static_cache_blocker",
]
