"""`--suite cuda-tuning`: settings of the decoding step (batch 1, then 16), each measured against
archlab's default path (the static cache, the whole step compiled with `CompileConfig()`: mode "reduce-overhead",
CUDA graphs) on the same weights in one run — what the next default of the decoding step should be.

The profile of a batch-1 step on an H100 (docs/gpu.md) put its GEMVs at 42-77 % of the memory bandwidth (cuBLAS;
the down projection split-K with a reduction kernel of its own) and its attention at 7.6 µs a layer (cuDNN, plus a
memset, on 4 KV heads × 8 query rows). The rows, each setting on its own copy of the model (a compiled step is kept
per model, and dynamo keeps one graph per compile setting):
- `compile_config=CompileConfig(mode="max-autotune")`: with inductor's coordinate-descent tuning a product with one
  row becomes a tuned Triton reduction (`torch._inductor.decomposition.mm`, the setting gpt-fast decodes with),
  which can also take in the element-wise work around it (the norm's scale, SwiGLU before the down projection);
- the decoding step's attention on SDPA's memory-efficient kernel (`torch.nn.attention.sdpa_kernel`), not cuDNN's;
- its self-attention through FlexAttention's split-KV decoding kernel, the step's mask read inside it
  (modeling/flex_decoding.py, `FLEX_DECODING_DEVICES`: off by default until this row says otherwise);
- max-autotune and FlexAttention together;
- at batch 16, max-autotune (the products have 16 rows and stay GEMMs: it tunes them, Triton templates against
  cuBLAS, at a longer compile) and FlexAttention (16 rows of keys to read).
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

from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import CompileConfig

from archlab.modeling import flex_decoding
from archlab.scripts.benchmark_cuda import guarded, llama_pair, setup_from, shape
from archlab.scripts.benchmark_cuda_decode import (
    bf16_pair,
    closing_notes,
    decode_shape,
    dense_generation,
    generate_row,
    new_report,
    not_compiled_note,
)
from archlab.training.benchmarking import Report

# The settings measured: a name, generate kwargs added, and a context entered around each call (or None).
TUNED = {"compile_config": CompileConfig(mode="max-autotune")}
# MATH beside it: on CPU (no memory-efficient kernel) SDPA falls back to it; on CUDA the efficient kernel applies.
EFFICIENT_ATTENTION = (SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)


def efficient_attention():
    return sdpa_kernel(list(EFFICIENT_ATTENTION))


def flex_attention():
    return mock.patch.object(flex_decoding, "FLEX_DECODING_DEVICES", ("cuda",))


MAX_AUTOTUNE = 'compile_config=CompileConfig(mode="max-autotune") (coordinate-descent-tuned Triton GEMVs)'
FLEX = "self-attention through FlexAttention's decoding kernel (flex_decoding.py)"
SETTINGS = {
    MAX_AUTOTUNE: (TUNED, None),
    "attention on SDPA's memory-efficient kernel (sdpa_kernel)": ({}, efficient_attention),
    FLEX: ({}, flex_attention),
    "max-autotune and FlexAttention": (TUNED, flex_attention),
}
# (batch, setting) in the order measured: every setting at batch 1, then the two of them that batch changes most
ROWS = [(1, name) for name in SETTINGS] + [("larger", MAX_AUTOTUNE), ("larger", FLEX)]


def setting_row(setup, report: Report, batch: int, name: str, models, setting: dict, context) -> None:
    """`models[0]` (a copy of `models[1]`'s weights) generating with `setting` and inside `context`, against
    `models[1]` on archlab's default path."""
    tuned, default = models
    sizes = decode_shape(setup)
    kwargs, tokens, roofline = dense_generation(setup, default.config, batch, "static")

    def with_setting():
        with context() if context is not None else contextlib.nullcontext():
            return tuned.generate(**kwargs, **setting)

    metric = (
        f"dense 1.1B greedy decode, batch {batch}, {sizes['prompt']} + {sizes['new_tokens']} tokens, StaticCache, "
        f"archlab: {name} vs archlab's default"
    )
    runs = (with_setting, lambda: default.generate(**kwargs))
    generate_row(setup, report, metric, models, kwargs, tokens, roofline, cold=True, runs=runs)


def run(args: argparse.Namespace) -> Report:
    setup = setup_from(args)
    report = new_report(setup, "settings of the decoding step against archlab's default")
    default = bf16_pair(llama_pair(shape("dense", setup.quick), setup.device))[0]
    larger = 4 if setup.quick else 16
    # copies before any generate: a model keeps its compiled step and static cache between calls
    copies = [copy.deepcopy(default) for _ in ROWS]
    for index, (batch, name) in enumerate(ROWS):
        batch = larger if batch == "larger" else batch
        setting, context = SETTINGS[name]
        measure = functools.partial(setting_row, setup, report, batch, name, (copies[index], default), setting, context)
        guarded(report, setup, f"{name}, batch {batch}", measure)
        copies[index] = None  # its memory back before the next row
    not_compiled_note(setup, report)
    closing_notes(setup, report)
    return report


def main(argv: list[str] | None = None) -> int:
    from archlab.scripts import benchmark

    return benchmark.main(["--suite", "cuda-tuning", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
