"""`--suite cuda-tuning`: settings of the decoding step (batch 1, then 16), each measured against
archlab's default path (the static cache, the whole step compiled with `CompileConfig()`: mode "reduce-overhead",
CUDA graphs) on the same weights in one run — what the next default of the decoding step should be.

The profile of a batch-1 step on an H100 (docs/gpu.md) put its GEMVs at 42-77 % of the memory bandwidth (cuBLAS;
the down projection split-K with a reduction kernel of its own) and its attention at 7.6 µs a layer (cuDNN, plus a
memset and a kernel rebuilding the mask, on 4 KV heads × 8 query rows). The rows, each setting on its own copy of
the model (a compiled step is kept per model, and dynamo keeps one graph per compile setting):
- inductor's coordinate-descent tuning (modeling/step_compile.py, `TUNED_STEP_DEVICES`): a product of one row
  becomes a Triton reduction whose block sizes are tuned while compiling (`torch._inductor.decomposition.mm`,
  gpt-fast's setting), which can take in the element-wise work beside it (the norm's scale, SwiGLU);
- the self-attention through FlexAttention's split-KV decoding kernel, the step's mask read inside it
  (modeling/flex_decoding.py, `FLEX_DECODING_DEVICES`);
- both of those;
- inductor's combo kernels (step_compile.py's `TUNED_STEP_OPTIONS`): independent element-wise kernels launched as
  one (a layer's query RoPE, key RoPE and cache writes; a batch-1 step ran ~15 launches a layer, a few µs each),
  then all three together;
- at batch 16, the two first candidates again (the products have 16 rows there and stay GEMMs);
- the 2,048-token prefill compiled as compile_prefill compiles it, its decoder blocks nested compile regions
  (`torch.compiler.nested_compile_region`: the layers after the first compiled once; compiled_prefill.py) against
  unrolled as before: its compile's seconds (68 s unrolled) and the warm prefill;
- then settings no default would take: the attention on SDPA's memory-efficient kernel
  (`torch.nn.attention.sdpa_kernel`), not cuDNN's; last `compile_config=CompileConfig(mode="max-autotune")`, what a
  user can pass: the same tuning, and every GEMM autotuned (Triton templates against cuBLAS) at a longer compile.
The rows run in this order; a call's budget ends the suite where it is, keeping the rows it finished.
The candidates are off by default until these rows say otherwise.
Each row gives both sides' first and second calls (compilation included) beside tokens/s and % of the roofline.
On CPU nothing compiles (generate compiles on accelerators only) and the rows run their code path eagerly.

    python scripts/benchmark.py --suite cuda-tuning --device cuda --output cuda-tuning.md
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import sys
from unittest import mock

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import CompileConfig, StaticCache

from archlab.modeling import flex_decoding, step_compile
from archlab.modeling.cache_names import with_cache
from archlab.modeling.cache_spans import make_spanned
from archlab.modeling.compiled_prefill import nested_block_regions
from archlab.modeling.fused_projections import inference_projections
from archlab.scripts.benchmark_cuda import (
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
    new_report,
    not_compiled_note,
    prefill_rate_row,
)
from archlab.training.benchmarking import Report

# The settings measured: a name, generate kwargs added, and the contexts entered around each call.
MAX_AUTOTUNE = {"compile_config": CompileConfig(mode="max-autotune")}
# MATH beside it: on CPU (no memory-efficient kernel) SDPA falls back to it; on CUDA the efficient kernel applies.
EFFICIENT_ATTENTION = (SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)


def efficient_attention():
    return sdpa_kernel(list(EFFICIENT_ATTENTION))


def flex_attention():
    return mock.patch.object(flex_decoding, "FLEX_DECODING_DEVICES", ("cuda",))


def tuned_step():
    return mock.patch.object(step_compile, "TUNED_STEP_DEVICES", ("cuda",))


def combo_kernels():
    """The step compiled with inductor's combo kernels (on the tuned devices: `tuned_step` enters too)."""
    return mock.patch.object(step_compile, "TUNED_STEP_OPTIONS", {"combo_kernels": True})


def combo_kernels_tuned():
    """Combo kernels and coordinate-descent tuning together."""
    options = {"coordinate_descent_tuning": True, "combo_kernels": True}
    return mock.patch.object(step_compile, "TUNED_STEP_OPTIONS", options)


TUNED = "coordinate-descent-tuned Triton GEMVs (step_compile.py's default candidate)"
FLEX = "self-attention through FlexAttention's decoding kernel (flex_decoding.py)"
BOTH = "both of those"
COMBO = "independent element-wise kernels launched as one (inductor's combo_kernels, step_compile.py's other candidate)"
ALL = "combo kernels, coordinate-descent tuning and FlexAttention together"
EFFICIENT = "attention on SDPA's memory-efficient kernel (sdpa_kernel)"
AUTOTUNED = 'compile_config=CompileConfig(mode="max-autotune") (the tuning, and every GEMM autotuned)'
SETTINGS = {
    TUNED: ({}, (tuned_step,)),
    FLEX: ({}, (flex_attention,)),
    BOTH: ({}, (tuned_step, flex_attention)),
    COMBO: ({}, (tuned_step, combo_kernels)),
    ALL: ({}, (tuned_step, combo_kernels_tuned, flex_attention)),
    EFFICIENT: ({}, (efficient_attention,)),
    AUTOTUNED: (MAX_AUTOTUNE, ()),
}
# (batch, setting) in the order measured: the candidate defaults first (at batch 1, then at a larger batch); then
# the prefill's two compiles (`prefill_compile_row`); then the settings no default would take, max-autotune last
# (its GEMM autotuning compiles longest): a call's budget ends the suite where it is, keeping the rows finished
ROWS = [(1, TUNED), (1, FLEX), (1, BOTH), (1, COMBO), (1, ALL), ("larger", TUNED), ("larger", FLEX)]
LATE_ROWS = [(1, EFFICIENT), (1, AUTOTUNED)]


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
    runs = (with_setting, lambda: default.generate(**kwargs))
    generate_row(setup, report, metric, models, kwargs, tokens, roofline, cold=True, runs=runs)


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

    setting_rows(ROWS)
    # the two compiles of a 2,048-token prefill (68 s unrolled on an H100)
    guarded(report, setup, "prefill compile, nested regions", lambda: prefill_compile_row(setup, report, pristine))
    setting_rows(LATE_ROWS)
    not_compiled_note(setup, report)
    closing_notes(setup, report)
    return report


def main(argv: list[str] | None = None) -> int:
    from archlab.scripts import benchmark

    return benchmark.main(["--suite", "cuda-tuning", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
