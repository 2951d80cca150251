"""`--suite cuda-headline`: the rows of the GPU issues' headline goals in one run, for a GPU session that can make
one measuring call (105 s on an H100 before the time-to-first-token row; docs/gpu.md): the first look at where both
issues stand, before the full suites (cuda-train, cuda-static, ...) measure every workload.

- decoding, dense 1.1B in bf16, batch 1, 128-token prompt + 256 new tokens, `cache_implementation="static"` on both
  sides (archlab: its default on CUDA, the whole step compiled; Llama: transformers compiles its forward), with each
  side's first call (compilation included) — cuda-static's batch-1 row;
- the prefill of a 2048-token prompt with MFU, the forward eager and through `generate` (time to first token,
  archlab's prefill compiled) — cuda-decode's prefill rows;
- training, dense 1.1B (Llama shape, 4 × 2048, what `Trainer(bf16=True)` runs): archlab eager vs LlamaForCausalLM;
  archlab compiled by accelerate's `compile_regions` (the scripts' default on a GPU) vs Llama compiled the same way,
  and vs Llama eager — the same rows as cuda-train's (without its liger child process and other workloads).

Each row carries its goal from the issues (benchmark_cuda's goal tables, as in the full suites); the other goals
(Liger, vocabulary 128256, MoE, seq2seq, batch 16/64) are in the full suites.

    python scripts/benchmark.py --suite cuda-headline --device cuda --output cuda-headline.md
"""

from __future__ import annotations

import argparse
import sys

from archlab.scripts.benchmark_cuda import DECODE_GOALS, TRAIN_GOALS, describe, guarded, setup_from, with_goals
from archlab.scripts.benchmark_cuda_decode import (
    decode_shape,
    dense_generate_rows,
    not_compiled_note,
    prefill_row,
    time_to_first_token_row,
)
from archlab.scripts.benchmark_cuda_train import batch_shape, dense_rows
from archlab.training.benchmarking import Report


def run(args: argparse.Namespace) -> Report:
    setup = setup_from(args)
    b, s = batch_shape(setup)
    sizes = decode_shape(setup)
    report = Report(
        title=f"CUDA suite, the headline goals — {setup.peaks.name} — training: bf16 autocast over fp32 weights, "
        f"{setup.optim}, {b} × {s}; decoding: bf16 weights, greedy, {sizes['prompt']}-token prompt, "
        f"{sizes['new_tokens']} new tokens" + (" — --quick shapes" if setup.quick else ""),
        peer_name="peer",
    )
    # Decoding first: its compiled loops have never run on a GPU, the training rows have (an earlier table in the
    # issue); a run stopped at its limit keeps what it measured in the log.
    guarded(report, setup, "dense decode batch 1 (static)", lambda: dense_generate_rows(setup, report, "static", (1,)))
    guarded(report, setup, "prefill", lambda: prefill_row(setup, report))
    guarded(report, setup, "time to first token", lambda: time_to_first_token_row(setup, report))
    guarded(report, setup, "dense 1.1B training", lambda: dense_rows(setup, report, "dense", "dense 1.1B", True))
    not_compiled_note(setup, report)
    report.notes.append(
        "Training MFU: model FLOPs (6 per weight per token + attention) / time / peak; decoding: % of the bandwidth "
        "roofline (weights read once per step + the KV cache); prefill MFU: forward FLOPs / time / peak. "
        f"{setup.rounds} rounds per training and prefill row, {setup.decode_rounds} per decode row; median of "
        "per-round ratios."
    )
    report.notes.append(describe(setup))
    return with_goals(report, DECODE_GOALS + TRAIN_GOALS)  # decoding's first: training's last pattern takes any row


def main(argv: list[str] | None = None) -> int:
    from archlab.scripts import benchmark

    return benchmark.main(["--suite", "cuda-headline", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
