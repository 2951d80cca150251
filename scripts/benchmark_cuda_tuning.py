"""`--suite cuda-tuning`: settings of the decoding step (batch 1, then 16), each measured against
archlab's default path (the static cache, the whole step compiled with `CompileConfig()`: mode "reduce-overhead",
CUDA graphs, on CUDA inductor's combo kernels, modeling/step_compile.py, and archlab's decoding kernels) on the same
weights in one run — what the next default of the decoding step should be.

The first run on an H100 (docs/gpu.md) made combo kernels the default (616 against 591 tok/s at batch 1) and ruled
out coordinate-descent tuning (0.94× at batch 1, 0.97× at 16), FlexAttention at batch 1 (0.85×) and their mixes
(0.97×, 1.01×). The second, on an H200, made archlab's decoding kernels the default on CUDA: each pre-norm layer's
step of one row as four Triton GEMVs with the norms, SwiGLU and residual adds inside (modeling/decode_block.py,
modeling/triton_gemv.py), the self-attention through archlab's Triton kernel (modeling/triton_decoding.py), the
MoE's routed experts through its two Triton kernels (modeling/triton_moe.py), every kernel launched dependent on the
one before (programmatic dependent launch: the ops' PDL twins, modeling/triton_launch.py, and inductor's
`triton.enable_pdl` on Hopper): 886 against 709 tok/s at batch 1 (1.25×). The third (H200), after the kernels'
rework: the default at 991 tok/s against 762 without them (1.30×), 11,713 against 11,179 at batch 16 (1.05×), and
the q/k/v kernel with RoPE and the cache writes worth nothing in the step (0.98×). The fourth (H200): the default at
973 tok/s against 703 without the kernels (1.38×); the streaming GEMVs asking the L2 cache for their weight rows
before the dependent wait at 0.91× (removed since), the fused layer steps at 16 rows at 0.77×, the MoE's kernels at
1.16×, the bucketed prefill's time to first token at 1.62×. The rows now, each setting on its own copy of the model (a
compiled step is kept per model), those not yet measured on an H200 first:
- at batch 1, each fused layer step's output projection, gate/up product and down projection as one persistent
  kernel whose phases meet at barriers across the grid (modeling/triton_layer_tail.py), instead of three GEMVs: the
  candidate for the batch-1 goal;
- without archlab's decoding kernels (the default before), at batch 16 (the seventh GPU session: 1.05×);
- without archlab's kernels, the attention on SDPA's memory-efficient kernel (`torch.nn.attention.sdpa_kernel`), not
  cuDNN's with its memset;
- at batch 16, without archlab's kernels, the step without the combo kernels (the plain mode, the default before
  those), and the self-attention through FlexAttention's split-KV decoding kernel (modeling/flex_decoding.py)
  instead of archlab's;
- the mixture of experts (Mixtral shape) at batch 1 without archlab's kernels (grouped GEMMs, SDPA) against the
  default (its layers' whole steps fused, the MoE half with the norm and the residual inside the expert kernels);
- the time to first token of a 2,048-token prompt with `compile_prefill=True`, the prompt padded to a bucket and
  the compiled forward replayed as a CUDA graph (modeling/prefill_buckets.py, the default there) against the same
  compiled forward without buckets or graphs;
- measured already: without archlab's decoding kernels at batch 1; the fused step's q/k/v GEMV followed by inductor's
  RoPE and cache-write kernel instead of one kernel with the rotation and the cache writes in its epilogue
  (modeling/triton_qkv.py); at batch 16 the fused layer steps at every row count (the default fuses steps of one row);
- the 2,048-token prefill compiled as compile_prefill compiles it, its decoder blocks nested compile regions
  (`torch.compiler.nested_compile_region`: the layers after the first compiled once; compiled_prefill.py) against
  unrolled as before: its compile's seconds (68 s unrolled) and the warm prefill;
- last `compile_config=CompileConfig(mode="max-autotune")`, what a user can pass: every GEMM autotuned (Triton
  templates against cuBLAS, with the element-wise work around them fused in) at a longer compile.
The rows run in this order; a call's budget ends the suite where it is, keeping the rows it finished. Dynamo's
recompile limit is raised while the suite runs: every setting compiles the same step function once more (the first
run hit the limit of 8 at its seventh row, whose step then ran eagerly).
Each row gives both sides' first and second calls (compilation included) beside tokens/s and % of the roofline; a
setting whose step fails to compile (and would decode eagerly) ends its row with a note naming the compiler's error.
On CPU nothing compiles (generate compiles on accelerators only) and the rows run their code path eagerly.

    python scripts/benchmark.py --suite cuda-tuning --device cuda --output cuda-tuning.md
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import sys
from collections.abc import Callable
from unittest import mock

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import CompileConfig, StaticCache

from archlab.modeling import (
    compile_fallback,
    decode_block,
    flex_decoding,
    prefill_buckets,
    step_compile,
    triton_decoding,
    triton_gemv,
    triton_layer_tail,
    triton_qkv,
)
from archlab.modeling.cache_names import with_cache
from archlab.modeling.cache_spans import make_spanned
from archlab.modeling.compiled_prefill import nested_block_regions
from archlab.modeling.fused_projections import inference_projections
from archlab.scripts.benchmark_cuda import (
    decoder_pair,
    guarded,
    llama_pair,
    random_ids,
    setup_from,
    shape,
)
from archlab.scripts.benchmark_cuda_decode import (
    bf16_pair,
    closing_notes,
    decode_shape,
    dense_generation,
    first_call_seconds,
    generate_row,
    greedy_call,
    new_report,
    not_compiled_note,
    prefill_rate_row,
    without_decode_kernels,
)
from archlab.training.benchmarking import Report
from archlab.training.roofline import decode_roofline_seconds

# The settings measured: a name, generate kwargs added, and the contexts entered around each call.
MAX_AUTOTUNE = {"compile_config": CompileConfig(mode="max-autotune")}
# MATH beside it: on CPU (no memory-efficient kernel) SDPA falls back to it; on CUDA the efficient kernel applies.
EFFICIENT_ATTENTION = (SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)


def efficient_attention():
    return sdpa_kernel(list(EFFICIENT_ATTENTION))


def flex_attention():
    return mock.patch.object(flex_decoding, "FLEX_DECODING_DEVICES", ("cuda",))


# archlab's decoding kernels off, and inductor's dependent launches: the default before (combo kernels on cuBLAS, cuDNN)
kernels_off = without_decode_kernels


def triton_attention_off():
    return mock.patch.object(triton_decoding, "TRITON_DECODING_DEVICES", ())


def fused_every_row_count():
    """The fused layer steps at every row count the GEMVs take (the default fuses one row)."""
    return mock.patch.object(decode_block, "FUSED_BLOCK_ROWS", triton_gemv.MAX_ROWS)


def qkv_kernel_off():
    """The fused step's q/k/v GEMV, then the compiled RoPE and cache writes (triton_qkv.py's kernel off)."""
    return mock.patch.object(triton_qkv, "QKV_ROTARY_CACHE_DEVICES", ())


def layer_tail_on():
    """Each fused layer step's output projection and dense MLP as one persistent kernel (triton_layer_tail.py)."""
    return mock.patch.object(triton_layer_tail, "TAIL_DEVICES", ("cuda",))


def plain_step():
    """The step compiled in the plain mode, without step_compile.py's options (the default before combo kernels)."""
    return mock.patch.object(step_compile, "TUNED_STEP_DEVICES", ())


BEFORE = (
    "without archlab's decoding kernels (fused layer steps, Triton attention, MoE kernels, dependent launches): the "
    "default before"
)
QKV_SEPARATE = (
    "the fused step's q/k/v GEMV, then inductor's RoPE and cache-write kernel, instead of the one kernel with both "
    "in its epilogue (triton_qkv.py)"
)
LAYER_TAIL = (
    "each layer's output projection + residual, RMSNorm + gate/up + SwiGLU and down + residual as one persistent "
    "kernel, barriers between them (triton_layer_tail.py), instead of three GEMV kernels"
)
FUSED_ROWS = "the fused layer steps at every row count (FUSED_BLOCK_ROWS = 16; the default fuses one row)"
EFFICIENT = "without archlab's kernels, attention on SDPA's memory-efficient kernel (sdpa_kernel)"
PLAIN = "without archlab's kernels, the plain mode, no combo kernels (the default before those)"
FLEX = "self-attention through FlexAttention's decoding kernel (flex_decoding.py) instead of archlab's"
MOE_BEFORE = "without archlab's decoding kernels (grouped experts, cuDNN attention): the default before"
AUTOTUNED = 'compile_config=CompileConfig(mode="max-autotune") (every GEMM autotuned)'
SETTINGS = {
    BEFORE: ({}, (kernels_off,)),
    QKV_SEPARATE: ({}, (qkv_kernel_off,)),
    LAYER_TAIL: ({}, (layer_tail_on,)),
    FUSED_ROWS: ({}, (fused_every_row_count,)),
    EFFICIENT: ({}, (kernels_off, efficient_attention)),
    PLAIN: ({}, (kernels_off, plain_step)),
    FLEX: ({}, (triton_attention_off, flex_attention)),
    AUTOTUNED: (MAX_AUTOTUNE, ()),
}
# (batch, setting) in the order measured: batch 1, then a larger batch; then the prefill's two compiles
# (`prefill_compile_row`); max-autotune last (its GEMM autotuning compiles longest): a call's budget ends the suite
# where it is, keeping the rows finished
ROWS = [
    (1, LAYER_TAIL),  # first: the candidate for the batch-1 goal (50 % of the roofline), never yet timed
    ("larger", BEFORE),  # first: not yet measured on an H200 (the eighth session's budget ended in this row)
    (1, EFFICIENT),
    ("larger", PLAIN),
    ("larger", FLEX),
    (1, BEFORE),  # the eighth GPU session (H200): 0.73×; the seventh 0.77×
    (1, QKV_SEPARATE),  # 1.02×, 0.98×: noise
    ("larger", FUSED_ROWS),  # 0.77×
]
FIRST_ROWS = 4  # those before the MoE row
LATE_ROWS = [(1, AUTOTUNED)]
# Each setting compiles the step function once more: dynamo's limit (8) would leave the later rows' steps eager.
RECOMPILE_LIMIT = 64


class FellBackToEager(RuntimeError):
    """A setting whose decoding step did not compile: compile_fallback.py decoded eagerly instead."""


def failing_on_fallback(run: Callable):
    """`run`, raising `FellBackToEager` (with compile_fallback.py's line) where the compiler failed during it: the
    row then ends as a note instead of timing eager decoding (the first H200 session timed a setting whose kernel did
    not compile: 33 tok/s and two minutes of the call)."""

    def checked():
        failures = []
        warning = compile_fallback.logger.warning

        def record(message, *args, **kwargs):
            if str(message).startswith("Compiling") and " failed (" in str(message):
                failures.append(str(message))
            return warning(message, *args, **kwargs)

        with mock.patch.object(compile_fallback.logger, "warning", record):
            result = run()
        if failures:
            raise FellBackToEager(failures[0])
        return result

    return checked


def setting_row(setup, report: Report, batch: int, name: str, models, setting: dict, contexts) -> None:
    """`models[0]` (a copy of `models[1]`'s weights) generating with `setting` and inside `contexts`, against
    `models[1]` on archlab's default path."""
    tuned, default = models
    sizes = decode_shape(setup)
    kwargs, tokens, roofline = dense_generation(setup, default.config, batch, "static")

    def with_setting():
        with contextlib.ExitStack() as stack:
            for context in contexts:
                stack.enter_context(context())
            return tuned.generate(**kwargs, **setting)

    metric = (
        f"dense 1.1B greedy decode, batch {batch}, {sizes['prompt']} + {sizes['new_tokens']} tokens, StaticCache, "
        f"archlab: {name} vs archlab's default"
    )
    runs = (failing_on_fallback(with_setting), lambda: default.generate(**kwargs))
    generate_row(setup, report, metric, models, kwargs, tokens, roofline, cold=True, runs=runs)


def moe_kernels_row(setup, report: Report) -> None:
    """The mixture of experts (GPU.md's Mixtral shape), batch 1: without archlab's decoding kernels (grouped GEMMs,
    SDPA) against archlab's default (each layer's whole step fused, decode_block.py: the attention half, and the MoE
    half with the norm and the residual inside triton_moe.py's expert kernels, archlab's attention kernel, every
    Triton kernel launched dependent on the one before), two copies of one model."""
    from transformers import MixtralConfig, MixtralForCausalLM

    default = bf16_pair(decoder_pair(MixtralForCausalLM, MixtralConfig, shape("moe", setup.quick), setup.device))[0]
    models = (copy.deepcopy(default), default)
    sizes = decode_shape(setup)
    kwargs = greedy_call(default.config.vocab_size, 1, sizes["prompt"], sizes["new_tokens"], setup.device)
    roofline = decode_roofline_seconds(default.config, setup.peaks, 1, sizes["prompt"], sizes["new_tokens"])

    def without_kernels():
        with kernels_off():
            return models[0].generate(**kwargs)

    metric = (
        f"MoE (Mixtral shape) greedy decode, batch 1, {sizes['prompt']} + {sizes['new_tokens']} tokens, archlab: "
        f"{MOE_BEFORE} vs archlab's default"
    )
    runs = (failing_on_fallback(without_kernels), lambda: default.generate(**kwargs))
    generate_row(setup, report, metric, models, kwargs, sizes["new_tokens"], roofline, cold=True, runs=runs)


def prefill_compile_row(setup, report: Report, model) -> None:
    """The prefill as compile_prefill compiles it (the forward whole, dynamic shapes, over an allocated static cache
    of generate's kind), its decoder blocks nested compile regions (compiled_prefill.py's `nested_block_regions`)
    against unrolled as before: the compile's seconds (68 s unrolled on an H100; on CPU, 22 tiny layers, a fresh
    inductor cache each: 60.9 s against 22.7 s, the same logits) and the warm prefill. `model` has not generated (it
    is copied here)."""
    length = decode_shape(setup)["prefill"]
    nested_model = copy.deepcopy(model)
    ids = random_ids(model.config.vocab_size, 1, length, device=setup.device)

    def prefill_of(m, context):
        cache = StaticCache(config=m.config, max_cache_len=length)
        make_spanned(cache)  # generate's kind of static cache
        # on CPU the suite compiles nothing (generate does not there): the path runs eagerly
        compiled = torch.compile(m, dynamic=True, fullgraph=True) if setup.cuda else m

        def forward(target=m):
            cache.reset()  # (both sides: a prompt's prefill starts from an empty cache)
            with torch.no_grad(), inference_projections(m), context():
                return target(input_ids=ids, **with_cache(cache), use_cache=True, logits_to_keep=1)

        forward()  # the cache allocates its tensors eagerly, as generate's first call does
        return lambda: forward(compiled)

    regions = functools.partial(nested_block_regions, nested_model)
    runs = (prefill_of(nested_model, regions), prefill_of(model, contextlib.nullcontext))
    first = [first_call_seconds(setup, run) for run in runs]
    extra = {"first call archlab": f"{first[0]:.1f} s", "first call peer": f"{first[1]:.1f} s"}
    metric = (
        f"dense 1.1B prefill compiled whole (compile_prefill's way), 1 × {length} tokens: each decoder block a nested "
        "compile region vs without"
    )
    prefill_rate_row(setup, report, metric, runs, model.config, length, extra=extra)


def prefill_graphs_row(setup, report: Report, model) -> None:
    """generate(max_new_tokens=1, compile_prefill=True) on a 2,048-token prompt, two copies of `model` (which has
    not generated): the prompt padded to its bucket and replayed as a CUDA graph against the compiled forward
    without buckets (`PADDED_PREFILL_DEVICES` emptied around its calls). Two calls each before the timed ones (the
    cache's allocation, the compile), the second side's warm-up also recording its graph."""
    length = decode_shape(setup)["prefill"]
    graphed, unpadded = copy.deepcopy(model), copy.deepcopy(model)
    ids = random_ids(model.config.vocab_size, 1, length, device=setup.device)
    kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False)
    kwargs.update(pad_token_id=0, compile_prefill=True)

    def without_buckets():
        with mock.patch.object(prefill_buckets, "PADDED_PREFILL_DEVICES", ()):
            return unpadded.generate(**kwargs)

    runs = (lambda: graphed.generate(**kwargs), without_buckets)
    first = [first_call_seconds(setup, run) + first_call_seconds(setup, run) for run in runs]
    extra = {"first call archlab": f"{first[0]:.1f} s (2 calls)", "first call peer": f"{first[1]:.1f} s (2 calls)"}
    metric = (
        f"dense 1.1B prefill through generate (time to first token), 1 × {length} tokens, compile_prefill=True: "
        "the prompt padded to a bucket, replayed as a CUDA graph vs without"
    )
    prefill_rate_row(setup, report, metric, runs, model.config, length, warmup=2, extra=extra)


def run(args: argparse.Namespace) -> Report:
    setup = setup_from(args)
    report = new_report(setup, "settings of the decoding step against archlab's default")
    default = bf16_pair(llama_pair(shape("dense", setup.quick), setup.device))[0]
    # each row's model is copied from one taken before any generate: a model keeps its compiled step and static
    # cache between calls, which a copy must not carry
    pristine = copy.deepcopy(default)
    larger = 4 if setup.quick else 16

    def setting_rows(rows):
        for batch, name in rows:
            batch = larger if batch == "larger" else batch
            setting, contexts = SETTINGS[name]
            models = (copy.deepcopy(pristine), default)
            measure = functools.partial(setting_row, setup, report, batch, name, models, setting, contexts)
            guarded(report, setup, f"{name}, batch {batch}", measure)
            measure = models = None  # the copy's memory back before the next row

    with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
        setting_rows(ROWS[:FIRST_ROWS])
        guarded(report, setup, "MoE kernels", functools.partial(moe_kernels_row, setup, report))
        guarded(report, setup, "prefill buckets", functools.partial(prefill_graphs_row, setup, report, pristine))
        setting_rows(ROWS[FIRST_ROWS:])
        # the two compiles of a 2,048-token prefill (68 s unrolled on an H100)
        measure = functools.partial(prefill_compile_row, setup, report, pristine)
        guarded(report, setup, "prefill compile, nested regions", measure)
        setting_rows(LATE_ROWS)
    not_compiled_note(setup, report)
    closing_notes(setup, report)
    return report


def main(argv: list[str] | None = None) -> int:
    from archlab.scripts import benchmark

    return benchmark.main(["--suite", "cuda-tuning", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
