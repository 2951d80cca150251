"""Side-by-side benchmark of archlab against its Hugging Face peer: same config, same weights, same inputs, one run.

    python scripts/benchmark.py                     # dense decoder vs LlamaForCausalLM (hidden 512, 8 layers)
    python scripts/benchmark.py --suite moe         # MoE decoder vs MixtralForCausalLM (scripts/benchmark_moe.py)
    python scripts/benchmark.py --suite seq2seq     # encoder-decoder vs MarianMTModel (scripts/benchmark_seq2seq.py)
    python scripts/benchmark.py --quick             # a small shape and 2 rounds, to check that everything runs
    python scripts/benchmark.py --suite cuda-train --device cuda    # the GPU workloads (scripts/benchmark_cuda*.py):
    python scripts/benchmark.py --suite cuda-decode --device cuda   #   training, decoding with DynamicCache, and
    python scripts/benchmark.py --suite cuda-static --device cuda   #   decoding with a compiled static cache,
    python scripts/benchmark.py --suite cuda-loops --device cuda    #   sampling, MoE and beam search compiled
    python scripts/benchmark.py --suite cuda-train-compiled --device cuda  # the other training workloads compiled
    python scripts/benchmark.py --suite cuda-headline --device cuda # the headline goals' rows, ~2-4 min (first look)
    python scripts/benchmark.py --suite cuda-tuning --device cuda   # generate settings vs archlab's default decoding
    python scripts/benchmark.py --suite cuda-kernels --device cuda  # archlab's Triton kernels vs the PyTorch paths
    python scripts/benchmark.py --suite cuda-catalogue --device cuda  # GPT-OSS, DeepSeek-V3, Llama 4 shapes decoding

Method (absolute numbers drift on shared machines, ratios measured side by side do not): both models live in one
process with identical weights and inputs; each is warmed up; every round times both, alternating which goes first;
the reported ratio is the median of the per-round ratios (archlab time ÷ peer time inverted, so > 1 means archlab is
faster). An identical model timed against itself this way reads 0.9–1.07×: differences under ~10 % are noise.
Peak memory is counted exactly (every live tensor, by torch's MemTracker), not sampled from the process RSS.
The harness is `archlab.training.benchmarking`; each suite besides `dense` lives in its own `benchmark_*.py`.
The cuda-* suites run the reference GPU shapes (or tiny ones with --quick, which also runs them on CPU with
`--device cpu`), with MFU, share of the bandwidth roofline and peak memory per row.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import math
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from archlab.training.benchmarking import (
    OPTIMIZERS,
    Report,
    Row,
    breakdown_notes,
    compare_speed,
    make_optimizer,
    native_bf16,
    peak_training_memory,
    torch_threads,
    training_step,
)


# ----------------------------------------------------------------------------------------------------------------
# Dense suite: DecoderForCausalLM vs LlamaForCausalLM
# ----------------------------------------------------------------------------------------------------------------
def dense_shape(quick: bool) -> dict:
    if quick:
        return dict(
            vocab_size=1024,
            hidden_size=128,
            intermediate_size=344,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    return dict(
        vocab_size=8192,
        hidden_size=512,
        intermediate_size=1376,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
    )


def run_dense(args: argparse.Namespace) -> Report:
    from transformers import LlamaConfig, LlamaForCausalLM

    from archlab import DecoderConfig, DecoderForCausalLM

    shape = dense_shape(args.quick)
    positions = SUITE_POSITIONS["dense"]
    common = dict(**shape, max_position_embeddings=positions, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    peer = LlamaForCausalLM(LlamaConfig(**common))
    ours = DecoderForCausalLM(DecoderConfig(**common))
    ours.load_state_dict(peer.state_dict(), strict=True)
    batch_size, seq_len = (2, 64) if args.quick else (args.batch_size, args.seq_len)
    ids = torch.randint(3, shape["vocab_size"], (batch_size, seq_len))
    batch = {"input_ids": ids, "labels": ids}
    tokens = batch_size * seq_len
    report = Report(
        title=f"Dense decoder vs LlamaForCausalLM — hidden {shape['hidden_size']}, "
        f"{shape['num_hidden_layers']} layers, {shape['num_attention_heads']} heads / "
        f"{shape['num_key_value_heads']} KV heads, vocab {shape['vocab_size']}",
        peer_name="LlamaForCausalLM",
    )

    for label, dtype, goal in [("fp32", None, "≥ 1.3×"), ("bf16 autocast", torch.bfloat16, "≥ 1.3×")]:
        ours.train(), peer.train()
        opt_a, opt_p = make_optimizer(ours, args.optim), make_optimizer(peer, args.optim)
        t_a, t_p, ratio = compare_speed(
            training_step(ours, batch, opt_a, dtype), training_step(peer, batch, opt_p, dtype), args.rounds
        )
        report.rows.append(
            Row(
                f"training tokens/s, {label} (batch {batch_size}×{seq_len}, {args.optim})",
                tokens / t_a,
                tokens / t_p,
                ratio,
                "tok/s",
                goal,
            )
        )
        del opt_a, opt_p

    opt_a, opt_p = make_optimizer(ours, args.optim), make_optimizer(peer, args.optim)
    mem_a = peak_training_memory(ours, training_step(ours, batch, opt_a), opt_a)
    mem_p = peak_training_memory(peer, training_step(peer, batch, opt_p), opt_p)
    report.rows.append(
        Row(
            "peak memory of a training step, fp32",
            mem_a / 2**20,
            mem_p / 2**20,
            mem_p / mem_a,
            "MiB",
            "≤ 1.0× (ratio ≥ 1)",
        )
    )
    report.notes += breakdown_notes([("LlamaForCausalLM", peer, opt_p), ("archlab", ours, opt_a)], batch)
    del opt_a, opt_p

    ours.eval(), peer.eval()
    new_tokens = 16 if args.quick else args.new_tokens
    for gen_batch in (1, 8):
        prompt = torch.randint(3, shape["vocab_size"], (gen_batch, DENSE_PROMPT))
        kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        t_a, t_p, ratio = compare_speed(
            partial(ours.generate, prompt, **kwargs), partial(peer.generate, prompt, **kwargs), args.rounds
        )
        n = gen_batch * new_tokens
        report.rows.append(
            Row(
                f"generation tokens/s, batch {gen_batch}, {new_tokens} new tokens (greedy, DynamicCache)",
                n / t_a,
                n / t_p,
                ratio,
                "tok/s",
                "≥ 1.0×",
            )
        )
    report.notes.append(
        f"{args.rounds} rounds, torch {torch.__version__}, {torch.get_num_threads()} threads; "
        f"native bf16 on this CPU: {native_bf16()}."
    )
    return report


SUITES: dict[str, Callable[[argparse.Namespace], Report]] = {"dense": run_dense}
# Suites that live in their own module expose `run(args) -> Report`; they are imported only when asked for.
# ("module" or "module:function", default function `run`.)
EXTERNAL_SUITES = {
    "moe": "benchmark_moe",
    "seq2seq": "benchmark_seq2seq",
    "compile": "benchmark_compile",
    "variants": "benchmark_variants",
    "cuda-train": "benchmark_cuda_train",
    "cuda-train-compiled": "benchmark_cuda_train:run_compiled",
    "cuda-decode": "benchmark_cuda_decode",
    "cuda-static": "benchmark_cuda_decode:run_static",
    "cuda-loops": "benchmark_cuda_decode:run_loops",
    "cuda-headline": "benchmark_cuda_headline",
    "cuda-tuning": "benchmark_cuda_tuning",
    "cuda-kernels": "benchmark_cuda_kernels",
    "cuda-catalogue": "benchmark_cuda_catalogue",
}
# The suites that take --device and run the reference GPU shapes; the others run on CPU at their own sizes.
DEVICE_SUITES = (
    "cuda-train",
    "cuda-train-compiled",
    "cuda-decode",
    "cuda-static",
    "cuda-loops",
    "cuda-headline",
    "cuda-tuning",
    "cuda-kernels",
    "cuda-catalogue",
)
# Defaults of the shape flags for the CPU suites (the cuda-* suites have fixed reference shapes instead).
CPU_SHAPE_DEFAULTS = {"batch_size": 8, "seq_len": 256, "new_tokens": 128}
# The `max_position_embeddings` of the CPU suites whose models have a fixed number of positions (the moe and seq2seq
# suites size theirs to the run), which --seq-len must stay within: past it a learned table (a variants row) fails
# mid-run and RoPE models run where they were not built to. The dense suite's generation rows also decode
# --new-tokens after a prompt of DENSE_PROMPT tokens.
SUITE_POSITIONS = {"dense": 4096, "compile": 4096, "variants": 4096}
DENSE_PROMPT = 32


def resolve_suite(name: str) -> Callable[[argparse.Namespace], Report]:
    if name in SUITES:
        return SUITES[name]
    module, _, function = EXTERNAL_SUITES[name].partition(":")
    return getattr(importlib.import_module(f"archlab.scripts.{module}"), function or "run")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--suite",
        choices=sorted({*SUITES, *EXTERNAL_SUITES}),
        default=None,
        action="append",
        dest="suites",
        help="what to compare (repeatable; default: dense)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=8,
        help="timed rounds per metric, >= 1 (default: 8; the median of ratios needs about 8)",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads, >= 1 (default: all cores)")
    parser.add_argument("--batch-size", type=int, default=None, help="sequences per batch, CPU suites (default: 8)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per sequence, CPU suites (default: 256)")
    parser.add_argument(
        "--new-tokens", type=int, default=None, help="tokens generated per decode, CPU suites (default: 128)"
    )
    parser.add_argument(
        "--device",
        default=None,
        help="cuda-* suites: where to run, e.g. cuda, cuda:1, cpu (default: cuda when one is visible, else cpu)",
    )
    parser.add_argument(
        "--peak-tflops",
        "--peak_tflops",
        type=float,
        default=None,
        help="cuda-* suites: the device's peak dense bf16 TFLOP/s for MFU (default: from a table of known GPUs)",
    )
    parser.add_argument(
        "--peak-bandwidth",
        "--peak_bandwidth",
        type=float,
        default=None,
        help="cuda-* suites: the device's peak memory bandwidth in TB/s for the roofline (default: known GPUs)",
    )
    parser.add_argument(
        "--decode-rounds", type=int, default=3, help="cuda-* suites: timed rounds per decode row, >= 1 (default: 3)"
    )
    parser.add_argument(
        "--optim",
        choices=sorted(OPTIMIZERS),
        default="adamw_torch_fused",
        help="the optimiser of every training step, by Trainer's name (default: Trainer's default)",
    )
    parser.add_argument("--quick", action="store_true", help="tiny shapes and 2 rounds: checks that it runs")
    parser.add_argument("--output", type=Path, default=None, help="also write the markdown tables here")
    return parser


def check_device_flags(parser: argparse.ArgumentParser, args: argparse.Namespace, suites: list[str]) -> None:
    """--device and the peak rates belong to the cuda-* suites, the shape flags to the others: fail early, naming
    which, rather than ignore a flag."""
    device_suites = [s for s in suites if s in DEVICE_SUITES]
    cpu_suites = [s for s in suites if s not in DEVICE_SUITES]
    device_flags = {"--device": args.device, "--peak-tflops": args.peak_tflops, "--peak-bandwidth": args.peak_bandwidth}
    for flag, value in device_flags.items():
        if value is not None and cpu_suites:
            parser.error(f"{flag} applies to the suites {list(DEVICE_SUITES)}; {cpu_suites} run on CPU")
    for name in CPU_SHAPE_DEFAULTS:
        if getattr(args, name) is not None and device_suites:
            flag = f"--{name.replace('_', '-')}"
            parser.error(f"{flag} applies to the CPU suites; {device_suites} run fixed reference shapes (or --quick)")
    for flag, value in (("--peak-tflops", args.peak_tflops), ("--peak-bandwidth", args.peak_bandwidth)):
        if value is not None and not (math.isfinite(value) and value > 0):  # nan and inf passed `value <= 0`
            parser.error(f"{flag} must be a finite number > 0, got {value}")
    if args.device is not None:
        try:
            device = torch.device(args.device)
        except RuntimeError:
            parser.error(f"--device {args.device!r} is not a device; allowed: cpu, cuda, cuda:N")
        if device.type not in ("cpu", "cuda"):
            parser.error(f"--device {args.device!r}: allowed: cpu, cuda, cuda:N")
        if device.type == "cuda" and not torch.cuda.is_available():
            parser.error(f"--device {args.device}: no CUDA device is visible (torch.cuda.is_available() is False)")


def check_positions(parser: argparse.ArgumentParser, args: argparse.Namespace, suites: list[str]) -> None:
    """--seq-len (and the dense suite's prompt and --new-tokens) within the positions of the suites that run
    (`SUITE_POSITIONS`); --quick runs its own small shapes."""
    if args.quick:
        return
    for suite in dict.fromkeys(suites):
        positions = SUITE_POSITIONS.get(suite)
        if positions is None:
            continue
        if args.seq_len is not None and args.seq_len > positions:
            parser.error(f"--seq-len {args.seq_len} exceeds the {suite} suite's max_position_embeddings ({positions})")
        if suite == "dense" and args.new_tokens is not None and DENSE_PROMPT + args.new_tokens > positions:
            parser.error(
                f"--new-tokens {args.new_tokens} after the dense suite's {DENSE_PROMPT}-token prompt exceeds its "
                f"max_position_embeddings ({positions}); give at most {positions - DENSE_PROMPT}"
            )


def resolve_defaults(args: argparse.Namespace) -> None:
    """Clamp rounds for --quick and fill the CPU suites' shape defaults."""
    if args.quick:
        args.rounds = min(args.rounds, 2)
        args.decode_rounds = min(args.decode_rounds, 2)
    for name, default in CPU_SHAPE_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, default)


@contextlib.contextmanager
def long_lived_objects_frozen():
    """The objects alive before the suites run (modules, and a calling process's own: a test session's) left out of
    the garbage collections the suites run between comparisons, which then scan only what the suites made."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    suites = args.suites or ["dense"]
    for name in ("rounds", "decode_rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    for name in CPU_SHAPE_DEFAULTS:
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")
    if args.output is not None:  # written after the first suite: a bad path failed only once it had run
        if args.output.is_dir():
            parser.error(f"--output {str(args.output)!r} is a folder; give the markdown file to write")
        if not args.output.parent.is_dir():
            parser.error(f"--output {str(args.output)!r}: the folder {str(args.output.parent)!r} does not exist")
    check_device_flags(parser, args, suites)
    check_positions(parser, args, suites)
    resolve_defaults(args)
    tables = []
    with torch_threads(args.threads), long_lived_objects_frozen():
        for name in dict.fromkeys(suites):
            report = resolve_suite(name)(args)
            print(report.markdown(), flush=True)
            tables.append(report.markdown())
            if args.output:  # after every suite, so a later one that fails leaves the earlier tables written
                args.output.write_text("\n\n".join(tables) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
