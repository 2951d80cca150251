"""`--suite cuda-decode`, `cuda-static` and `cuda-loops`: generation on a GPU, archlab against its Hugging Face peers
with the same weights, in bf16 (weights cast, no autocast), `generate` of 256 new tokens after a 128-token prompt.

cuda-decode (DynamicCache on both sides, named explicitly: on CUDA archlab's own default is the static cache):
- dense 1.1B (Llama shape) against `LlamaForCausalLM` at batch 1, 16 and 64, with the share of the bandwidth
  roofline each side reaches (a step reads every weight once and each sequence's KV cache; archlab.training.roofline);
- the prefill of a 2048-token prompt (batch 1, the logits of the last position: the forward eager on both sides, on
  CUDA with q/k/v and gate/up laid out side by side, modeling/fused_projections.py), with MFU; and the same prefill
  through `generate(max_new_tokens=1)`, archlab with `compile_prefill=True` (modeling/compiled_prefill.py), the
  time to first token;
- mixture of experts (Mixtral shape) against `MixtralForCausalLM` at batch 1 and 16;
- encoder-decoder (Marian shape) against `MarianMTModel`: beam search, 4 beams, batch 8, 256 source tokens, 128 new.

cuda-static: the dense rows with `cache_implementation="static"` on both sides. On a GPU transformers then compiles
Llama's decoding step (torch.compile, mode "reduce-overhead": CUDA graphs) at the first call of each new shape, and
archlab compiles its whole step (decoding_loop.py); those first-call seconds, compilation included, are columns of
their own, and tokens/s are of the warm calls after.

cuda-loops (every row compiles, so a suite of its own): at batch 1, sampling against Llama, archlab's loop
against archlab in transformers' loop (what the whole-step compile gains over a compiled forward), and q/k/v and
gate/up as one product each against separate products (what fused_projections.py gains); at batch 64 over 1,024
positions, steps reading the filled cache against the whole cache (what cache_spans.py gains); then the MoE and
beam-search rows with no cache setting: each model decodes as it does for a user (archlab on CUDA: the static cache
and its compiled loops, beam search included; Mixtral and Marian: the dynamic cache, eager); last, at batch 32 over
eight windows of a sliding-window model, its sliding layers decoded as rings against kept whole (what
sliding_layers.py's rings gain). On CPU nothing compiles, and the static cache runs eagerly.

Per row: tokens/s (batch × new tokens / seconds) both sides, the median per-round ratio, % of the roofline and peak
memory (weights, cache, temporaries) both sides. `--decode-rounds` rounds (default 3: a GPU's timings vary little,
and a row's generate takes seconds).

    python scripts/benchmark.py --suite cuda-decode --device cuda --output cuda-decode.md
    python scripts/benchmark.py --suite cuda-static --device cuda --output cuda-static.md
    python scripts/benchmark.py --suite cuda-loops --device cuda --output cuda-loops.md
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time

import torch

from archlab.modeling.fused_projections import inference_projections
from archlab.scripts.benchmark_cuda import (
    DECODE_GOALS,
    DECODER_COMMON,
    Setup,
    build_on,
    decoder_pair,
    describe,
    guarded,
    llama_pair,
    marian_pair,
    peak_memory_pair,
    random_ids,
    row,
    setup_from,
    shape,
    time_pair,
    utilisation,
    with_goals,
)
from archlab.training.benchmarking import Report, synchronize
from archlab.training.roofline import beam_search_roofline_seconds, decode_roofline_seconds, decoder_forward_flops


def decode_kernel_switches() -> tuple:
    """(module, name) of each device list that makes archlab's Triton kernels the decoding step's default on NVIDIA
    GPUs: each pre-norm layer's step of one row as four fused GEMVs (decode_block.py), the self-attention
    (triton_decoding.py), an MoE's routed experts (triton_moe.py), all launched through the ops' PDL twins
    (triton_launch.py)."""
    from archlab.modeling import decode_block, triton_decoding, triton_launch, triton_moe

    return (
        (decode_block, "FUSED_BLOCK_DEVICES"),
        (triton_decoding, "TRITON_DECODING_DEVICES"),
        (triton_moe, "MOE_DECODE_DEVICES"),
        (triton_launch, "PDL_DEVICES"),
    )


def without_decode_kernels() -> contextlib.ExitStack:
    """While it is entered, every switch of `decode_kernel_switches` off and inductor's dependent launches too
    (step_compile.py): the decoding step before archlab's kernels, which the suites and the profile measure the
    default against."""
    from unittest import mock

    from archlab.modeling import step_compile

    stack = contextlib.ExitStack()
    for module, name in decode_kernel_switches():
        stack.enter_context(mock.patch.object(module, name, ()))
    stack.enter_context(mock.patch.object(step_compile, "DEPENDENT_LAUNCH_OPTIONS", {}))
    return stack


def decode_shape(setup: Setup) -> dict:
    if setup.quick:  # one static batch size: each new one costs a compilation on a GPU
        return dict(prompt=16, new_tokens=8, batches=(1, 4), static_batches=(1,), moe_batches=(1, 4), prefill=64)
    return dict(
        prompt=128, new_tokens=256, batches=(1, 16, 64), static_batches=(1, 16, 64), moe_batches=(1, 16), prefill=2048
    )


def bf16_pair(pair):
    return tuple(model.to(torch.bfloat16).eval() for model in pair)


def first_call_seconds(setup: Setup, run) -> float:
    synchronize(setup.device)
    start = time.perf_counter()
    run()
    synchronize(setup.device)
    return time.perf_counter() - start


def generate_row(
    setup: Setup,
    report: Report,
    metric: str,
    models,
    kwargs: dict,
    tokens: int,
    roofline_s,
    cold=False,
    peer_kwargs: dict | None = None,
    runs: tuple | None = None,
):
    """Time `generate(**kwargs)` on both models (archlab first; the peer with `peer_kwargs` if given, or the two
    `runs` given); with `cold`, time each one's first and second calls apart (archlab's second call compiles its
    prefill, compiled_prefill.py: the first fills a new cache eagerly)."""
    runs = runs or (lambda: models[0].generate(**kwargs), lambda: models[1].generate(**(peer_kwargs or kwargs)))
    extra = {}
    if cold:
        first = [first_call_seconds(setup, run) for run in runs]
        second = [first_call_seconds(setup, run) for run in runs]
        extra = {"first call archlab": f"{first[0]:.1f} s", "first call peer": f"{first[1]:.1f} s"}
        extra |= {"second call archlab": f"{second[0]:.1f} s", "second call peer": f"{second[1]:.1f} s"}
    # Reduce-overhead compilation records its CUDA graphs over the first calls of a shape: warm up twice.
    timed = time_pair(setup, *runs, setup.decode_rounds, warmup=2 if cold else 1)
    peak = peak_memory_pair(setup, runs, models)
    roofline = tuple(None if roofline_s is None else roofline_s / t for t in (timed.archlab, timed.peer))
    extra["roofline tok/s"] = "n/a" if roofline_s is None else f"{tokens / roofline_s:,.0f}"
    report.rows.append(row(metric, timed, tokens, "tok/s", roofline=roofline, peak=peak, extra=extra))


def dense_generate_rows(setup: Setup, report: Report, cache: str, batches: tuple[int, ...] | None = None) -> None:
    """The dense model against Llama with the cache named on both sides, at each of `batches` (default: the
    suite's batch sizes for that cache)."""
    sizes = decode_shape(setup)
    ours, llama = bf16_pair(llama_pair(shape("dense", setup.quick), setup.device))
    for batch in batches or sizes["static_batches" if cache == "static" else "batches"]:

        def measure(batch=batch) -> None:
            kwargs, tokens, roofline = dense_generation(setup, llama.config, batch, cache)
            metric = (
                f"dense 1.1B greedy decode, batch {batch}, {sizes['prompt']} + {sizes['new_tokens']} tokens, "
                f"{'StaticCache' if cache == 'static' else 'DynamicCache'}: archlab vs LlamaForCausalLM"
            )
            generate_row(setup, report, metric, (ours, llama), kwargs, tokens, roofline, cold=cache == "static")

        guarded(report, setup, f"dense decode batch {batch} ({cache})", measure)


def greedy_call(vocab: int, batch: int, prompt: int, new_tokens: int, device, **setting) -> dict:
    """generate kwargs of the decode rows: `batch` random unpadded prompts of `prompt` tokens (seeded by the batch),
    greedy, exactly `new_tokens` new tokens (no early end), pad 0, plus `setting`."""
    ids = random_ids(vocab, batch, prompt, device=device, seed=batch)
    return dict(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=0,
        **setting,
    )


def dense_generation(setup: Setup, config, batch: int, cache: str) -> tuple[dict, int, float | None]:
    """generate kwargs for the dense rows (random prompts; the cache named on both sides: on CUDA archlab's default
    is the static cache, Llama's the dynamic one), the tokens they generate, and the roofline seconds."""
    sizes = decode_shape(setup)
    kwargs = greedy_call(
        config.vocab_size, batch, sizes["prompt"], sizes["new_tokens"], setup.device, cache_implementation=cache
    )
    roofline = decode_roofline_seconds(config, setup.peaks, batch, sizes["prompt"], sizes["new_tokens"])
    return kwargs, batch * sizes["new_tokens"], roofline


def loop_rows(setup: Setup, report: Report) -> None:
    """Batch 1 on the static cache, three rows: sampling (temperature 0.8, top-k 40, top-p 0.95, what
    scripts/generate.py does) against Llama; archlab's decoding loop (decoding_loop.py: the whole step compiled)
    against archlab in transformers' loop (its compiled forward alone), same model: what the loop itself gains; and
    the loop with q/k/v and gate/up read as one product each (the default on CUDA) against separate products."""
    from unittest import mock

    import archlab.modeling.fast_decoding as fast_decoding
    import archlab.modeling.fused_projections as fused_projections

    models = bf16_pair(llama_pair(shape("dense", setup.quick), setup.device))
    kwargs, tokens, roofline = dense_generation(setup, models[1].config, 1, "static")
    sampling = dict(kwargs, do_sample=True, temperature=0.8, top_k=40, top_p=0.95)
    metric = "dense 1.1B sampling (T 0.8, top-k 40, top-p 0.95), batch 1, StaticCache: archlab vs LlamaForCausalLM"
    generate_row(setup, report, metric, models, sampling, tokens, roofline, cold=True)

    metric = (
        "dense 1.1B greedy decode, batch 1, StaticCache: archlab's decoding loop vs archlab in transformers' loop "
        "(compiled forward only)"
    )
    transformers_loop = mock.patch.object(fast_decoding, "loop_blocker", lambda *args: "benchmark: transformers' loop")
    against_itself(setup, report, metric, models[0], kwargs, tokens, roofline, transformers_loop)
    metric = (
        "dense 1.1B greedy decode, batch 1, StaticCache, archlab's loop: q/k/v and gate/up one product each vs "
        "separate (fused_projections.py; on CPU both separate)"
    )
    separate = mock.patch.object(fused_projections, "FUSED_PROJECTION_DEVICES", ())
    against_itself(setup, report, metric, models[0], kwargs, tokens, roofline, separate)
    guarded(report, setup, "cache spans", lambda: span_row(setup, report, models))


def span_row(setup: Setup, report: Report, models) -> None:
    """A long generation at a large batch, archlab's loop reading the filled part of the static cache rounded up to
    a span (cache_spans.py, the default) against the same loop reading the whole cache every step: the KV bytes the
    spans save (at batch 64 and 1,024 positions the whole cache is 1.5 GB a step beside 2.1 GB of weights)."""
    from unittest import mock

    import archlab.modeling.cache_spans as cache_spans

    batch, prompt, new_tokens = (4, 16, 48) if setup.quick else (64, 128, 896)
    kwargs, tokens, roofline = long_static_call(setup, models[1].config, batch, prompt, new_tokens)
    metric = (
        f"dense 1.1B greedy decode, batch {batch}, {prompt} + {new_tokens} tokens, StaticCache, archlab's loop: "
        "steps read the filled cache (spans) vs the whole cache (cache_spans.py)"
    )
    whole = mock.patch.object(cache_spans, "READ_SPANS", False)
    against_itself(setup, report, metric, models[0], kwargs, tokens, roofline, whole)


def long_static_call(setup: Setup, config, batch: int, prompt: int, new_tokens: int) -> tuple[dict, int, float]:
    """(generate kwargs on the static cache, tokens generated, roofline seconds) of a long generation."""
    kwargs = greedy_call(config.vocab_size, batch, prompt, new_tokens, setup.device, cache_implementation="static")
    return kwargs, batch * new_tokens, decode_roofline_seconds(config, setup.peaks, batch, prompt, new_tokens)


def sliding_row(setup: Setup, report: Report) -> None:
    """A generation eight windows long (every layer sliding, window 128: 128 + 896 positions at batch 32), archlab's
    loop decoding the window-long sliding layers as rings (sliding_layers.py, the default past 4 windows) against the
    same weights with the sliding layers kept whole (what the memory rule gives without rings): the cache bytes a
    step reads and the memory the cache holds (a whole layer: every position; a ring: window + 16 slots)."""
    from unittest import mock

    import archlab.modeling.sliding_layers as sliding_layers
    from archlab import DecoderConfig, DecoderForCausalLM

    batch, prompt, new_tokens, window = (4, 16, 48, 8) if setup.quick else (32, 128, 896, 128)
    config = DecoderConfig(**DECODER_COMMON, **shape("dense", setup.quick), sliding_window=window)
    rings, whole = (build_on(setup.device, lambda: DecoderForCausalLM(config)) for _ in range(2))
    whole.load_state_dict(rings.state_dict())
    rings, whole = bf16_pair((rings, whole))
    kwargs, tokens, roofline = long_static_call(setup, config, batch, prompt, new_tokens)
    metric = (
        f"dense 1.1B, every layer sliding (window {window}), greedy decode, batch {batch}, {prompt} + {new_tokens} "
        "tokens, StaticCache, archlab's loop: sliding layers as rings vs kept whole (sliding_layers.py)"
    )
    kept_whole = mock.patch.object(sliding_layers, "RINGS", False)
    against_itself(setup, report, metric, rings, kwargs, tokens, roofline, kept_whole, patched_model=whole)


def against_itself(
    setup: Setup, report: Report, metric: str, model, kwargs, tokens, roofline, patch, patched_model=None
) -> None:
    """A row timing `model.generate(**kwargs)` against the same call under `patch` (a `mock.patch`, entered anew
    for each call): what the patched-out part gains. `patched_model` (a copy with the same weights) runs the
    patched calls where the patch changes what generate keeps on the model between calls (its static cache)."""
    patched_model = patched_model or model

    def patched():
        with patch:
            return patched_model.generate(**kwargs)

    runs = (lambda: model.generate(**kwargs), patched)
    generate_row(setup, report, metric, (model, patched_model), kwargs, tokens, roofline, cold=True, runs=runs)


def prefill_row(setup: Setup, report: Report) -> None:
    length = decode_shape(setup)["prefill"]
    ours, llama = bf16_pair(llama_pair(shape("dense", setup.quick), setup.device))
    ids = random_ids(llama.config.vocab_size, 1, length, device=setup.device)
    runs = tuple(lambda m=m: m(input_ids=ids, use_cache=False, logits_to_keep=1) for m in (ours, llama))
    metric = f"dense 1.1B prefill, 1 × {length} tokens (logits of the last): archlab vs LlamaForCausalLM"
    with torch.no_grad(), inference_projections(ours):  # as generate's prefill runs on CUDA: q/k/v, gate/up fused
        peak = peak_memory_pair(setup, runs, (ours, llama))
        prefill_rate_row(setup, report, metric, runs, llama.config, length, peak=peak)


def prefill_rate_row(setup: Setup, report: Report, metric: str, runs, config, length: int, warmup=1, **columns):
    """Time the two prefill `runs` (batch 1, `length` tokens, the logits of the last) and add their row with MFU;
    `columns`: `peak`, `extra` as `row` takes them."""
    timed = time_pair(setup, *runs, setup.rounds, warmup=warmup)
    flops = decoder_forward_flops(config, 1, length, logits_positions=1)
    mfu = tuple(utilisation(flops, t, setup.peaks.flops) for t in (timed.archlab, timed.peer))
    report.rows.append(row(metric, timed, length, "tok/s", mfu=mfu, **columns))


def time_to_first_token_row(setup: Setup, report: Report) -> None:
    """The prefill as `generate` runs it: `generate(max_new_tokens=1)` on a 2048-token prompt (batch 1), archlab
    with `compile_prefill=True` (on CUDA the static cache, its prefill compiled whole from the second call on:
    compiled_prefill.py), Llama on its default path (transformers' eager prefill). Two calls before the timed ones
    (the first allocates archlab's cache, the second compiles its prefill), their seconds a column of their own."""
    length = decode_shape(setup)["prefill"]
    ours, llama = bf16_pair(llama_pair(shape("dense", setup.quick), setup.device))
    ids = random_ids(llama.config.vocab_size, 1, length, device=setup.device)
    kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False)
    runs = (
        lambda: ours.generate(**kwargs, pad_token_id=0, compile_prefill=True),
        lambda: llama.generate(**kwargs, pad_token_id=0),
    )
    first = [first_call_seconds(setup, run) for run in runs]
    compiling = first_call_seconds(setup, runs[0])  # archlab's second call: the prefill's compile
    extra = {"first call archlab": f"{first[0] + compiling:.1f} s (2 calls)", "first call peer": f"{first[1]:.1f} s"}
    metric = (
        f"dense 1.1B prefill through generate (time to first token), 1 × {length} tokens: archlab "
        "compile_prefill=True vs LlamaForCausalLM"
    )
    prefill_rate_row(setup, report, metric, runs, llama.config, length, extra=extra)


def cache_setting(cache: str) -> tuple[dict, str]:
    """generate kwargs and the row's label: "dynamic" names the dynamic cache on both sides; "default" passes no
    cache setting, so each model decodes the way it does for a user (archlab on CUDA: static cache, compiled)."""
    if cache == "default":
        return {}, "each model's default cache (archlab on CUDA: static, compiled)"
    return {"cache_implementation": cache}, "DynamicCache" if cache == "dynamic" else "StaticCache"


def moe_rows(setup: Setup, report: Report, cache: str = "dynamic") -> None:
    from transformers import MixtralConfig, MixtralForCausalLM

    sizes = decode_shape(setup)
    ours, mixtral = bf16_pair(decoder_pair(MixtralForCausalLM, MixtralConfig, shape("moe", setup.quick), setup.device))
    implementation = mixtral.config._experts_implementation
    setting, label = cache_setting(cache)
    for batch in sizes["moe_batches"]:

        def measure(batch=batch) -> None:
            vocab = mixtral.config.vocab_size
            kwargs = greedy_call(vocab, batch, sizes["prompt"], sizes["new_tokens"], setup.device, **setting)
            roofline = decode_roofline_seconds(mixtral.config, setup.peaks, batch, sizes["prompt"], sizes["new_tokens"])
            metric = (
                f"MoE (Mixtral shape) greedy decode, batch {batch}, {label}: archlab vs MixtralForCausalLM "
                f"(experts: {implementation})"
            )
            tokens = batch * sizes["new_tokens"]
            generate_row(setup, report, metric, (ours, mixtral), kwargs, tokens, roofline, cold=cache == "default")

        guarded(report, setup, f"MoE decode batch {batch}", measure)


def beam_search_row(setup: Setup, report: Report, cache: str = "dynamic") -> None:
    batch, beams, source_len, new_tokens = (2, 4, 16, 8) if setup.quick else (8, 4, 256, 128)
    ours, marian = bf16_pair(marian_pair(shape("marian", setup.quick), max(source_len, new_tokens) + 2, setup.device))
    source = random_ids(marian.config.vocab_size, batch, source_len, device=setup.device, low=1, seed=1)
    setting, label = cache_setting(cache)
    kwargs = dict(
        input_ids=source,
        attention_mask=torch.ones_like(source),
        num_beams=beams,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        early_stopping=False,
        **setting,
    )
    roofline = beam_search_roofline_seconds(marian.config, setup.peaks, batch, beams, source_len, new_tokens)
    metric = (
        f"encoder-decoder (Marian shape) beam search, batch {batch}, {beams} beams, {source_len} source + "
        f"{new_tokens} new tokens, {label}: archlab vs MarianMTModel"
    )
    generate_row(setup, report, metric, (ours, marian), kwargs, batch * new_tokens, roofline, cold=cache == "default")
    if cache == "default":  # the loop's reorder from a spare buffer (beam_reorder.py) against the in-place reorder
        from unittest import mock

        import archlab.modeling.beam_reorder as beam_reorder

        metric = (
            f"encoder-decoder (Marian shape) beam-search cache reorder, batch {batch}, {beams} beams, archlab's "
            "loop: from a spare buffer vs in place (beam_reorder.py)"
        )
        in_place = mock.patch.object(beam_reorder, "DOUBLE_BUFFER", False)
        against_itself(setup, report, metric, ours, kwargs, batch * new_tokens, roofline, in_place)
        guarded(report, setup, "varied sources", lambda: varied_sources_row(setup, report, ours, kwargs, roofline))


def varied_sources_row(setup: Setup, report: Report, model, kwargs: dict, roofline) -> None:
    """Beam search over a translation job's batches, each padded to its own longest sentence: every call a source of
    another length (the longest, then 7 positions shorter each call, down to half). Sources padded to multiples of
    64 positions and to the longest so far (source_padding.py, the default: one cache, its steps recorded once)
    against sources as they come (a new cache and new recordings every call). The roofline is the longest source's."""
    import itertools
    from unittest import mock

    import archlab.modeling.source_padding as source_padding

    ids, mask = kwargs["input_ids"], kwargs["attention_mask"]
    lengths = itertools.cycle(range(ids.shape[1], ids.shape[1] // 2, -7))

    def next_source():
        length = next(lengths)
        return model.generate(**dict(kwargs, input_ids=ids[:, :length], attention_mask=mask[:, :length]))

    def unpadded():
        with mock.patch.object(source_padding, "SOURCE_STEP", None):
            return next_source()

    batch, beams, new_tokens = ids.shape[0], kwargs["num_beams"], kwargs["max_new_tokens"]
    metric = (
        f"encoder-decoder (Marian shape) beam search, batch {batch}, {beams} beams, a source of another length every "
        "call, archlab's loop: sources padded to a few lengths vs as they come (source_padding.py)"
    )
    runs = (next_source, unpadded)
    generate_row(setup, report, metric, (model, model), kwargs, batch * new_tokens, roofline, cold=True, runs=runs)


def new_report(setup: Setup, what: str) -> Report:
    sizes = decode_shape(setup)
    return Report(
        title=f"CUDA suite, {what} — {setup.peaks.name} — bf16 weights, greedy, {sizes['prompt']}-token prompt, "
        f"{sizes['new_tokens']} new tokens" + (" — --quick shapes" if setup.quick else ""),
        peer_name="peer",
    )


def closing_notes(setup: Setup, report: Report) -> None:
    report.notes.append(
        "% roofline: the least time a generation can take (each step reads the weights it uses once and each "
        "sequence's KV cache, or does its FLOPs at the peak rate, whichever is slower) over the time measured; "
        f"MFU: forward FLOPs incl. attention / time / peak. {setup.decode_rounds} rounds per decode row "
        f"({setup.rounds} for the prefill), median of per-round ratios."
    )
    report.notes.append(describe(setup))


def run(args: argparse.Namespace) -> Report:
    setup = setup_from(args)
    report = new_report(setup, "decoding (DynamicCache)")
    guarded(report, setup, "dense decode", lambda: dense_generate_rows(setup, report, "dynamic"))
    guarded(report, setup, "prefill", lambda: prefill_row(setup, report))
    guarded(report, setup, "time to first token", lambda: time_to_first_token_row(setup, report))
    guarded(report, setup, "MoE decode", lambda: moe_rows(setup, report))
    guarded(report, setup, "beam search", lambda: beam_search_row(setup, report))
    closing_notes(setup, report)
    return with_goals(report, DECODE_GOALS)


def run_static(args: argparse.Namespace) -> Report:
    setup = setup_from(args)
    report = new_report(setup, 'decoding (cache_implementation="static")')
    guarded(report, setup, "dense decode, static cache", lambda: dense_generate_rows(setup, report, "static"))
    not_compiled_note(setup, report)
    closing_notes(setup, report)
    return with_goals(report, DECODE_GOALS)


def run_loops(args: argparse.Namespace) -> Report:
    """cuda-loops: archlab's compiled decoding loops beyond greedy dense decoding — sampling and the loop's own gain
    at batch 1, then MoE and beam search on each model's default path (a suite of its own: every row compiles)."""
    setup = setup_from(args)
    report = new_report(setup, "the compiled decoding loops (sampling, MoE, beam search)")
    guarded(report, setup, "batch-1 loop rows", lambda: loop_rows(setup, report))
    guarded(report, setup, "MoE decode, default cache", lambda: moe_rows(setup, report, "default"))
    guarded(report, setup, "beam search, default cache", lambda: beam_search_row(setup, report, "default"))
    # last: no goal of the issues rides on it, and a session's budget may end the suite first
    guarded(report, setup, "sliding layers as rings", lambda: sliding_row(setup, report))
    not_compiled_note(setup, report)
    closing_notes(setup, report)
    return with_goals(report, DECODE_GOALS)


def not_compiled_note(setup: Setup, report: Report) -> None:
    if not setup.cuda:
        report.notes.append("Not compiled: generate compiles the static-cache step on GPUs only.")


def main(argv: list[str] | None = None) -> int:
    from archlab.scripts import benchmark

    return benchmark.main(["--suite", "cuda-decode", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
