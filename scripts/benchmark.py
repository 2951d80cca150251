"""Side-by-side benchmark of archlab against its Hugging Face peer: same config, same weights, same inputs, one run.

    python scripts/benchmark.py                     # dense decoder vs LlamaForCausalLM (the design-brief shape)
    python scripts/benchmark.py --suite moe         # MoE decoder vs MixtralForCausalLM (scripts/benchmark_moe.py)
    python scripts/benchmark.py --suite seq2seq     # encoder-decoder vs MarianMTModel (scripts/benchmark_seq2seq.py)
    python scripts/benchmark.py --quick             # a small shape and 2 rounds, to check that everything runs

Method (absolute numbers drift on shared machines, ratios measured side by side do not): both models live in one
process with identical weights and inputs; each is warmed up; every round times both, alternating which goes first;
the reported ratio is the median of the per-round ratios (archlab time ÷ peer time inverted, so > 1 means archlab is
faster). An identical model timed against itself this way reads 0.9–1.07×: differences under ~10 % are noise.
Peak memory is counted exactly (every live tensor, by torch's MemTracker), not sampled from the process RSS.
The harness is `archlab.training.benchmarking`; each suite besides `dense` lives in its own `benchmark_*.py`.
"""

from __future__ import annotations

import argparse
import importlib
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
    common = dict(**shape, max_position_embeddings=4096, pad_token_id=0, bos_token_id=1, eos_token_id=2)
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
        prompt = torch.randint(3, shape["vocab_size"], (gen_batch, 32))
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
EXTERNAL_SUITES = {
    "moe": "benchmark_moe",
    "seq2seq": "benchmark_seq2seq",
    "compile": "benchmark_compile",
    "variants": "benchmark_variants",
}


def resolve_suite(name: str) -> Callable[[argparse.Namespace], Report]:
    if name in SUITES:
        return SUITES[name]
    return importlib.import_module(f"archlab.scripts.{EXTERNAL_SUITES[name]}").run


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
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per batch (default: 8)")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per sequence (default: 256)")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens generated per decode (default: 128)")
    parser.add_argument(
        "--optim",
        choices=sorted(OPTIMIZERS),
        default="adamw_torch_fused",
        help="the optimiser of every training step, by Trainer's name (default: Trainer's default)",
    )
    parser.add_argument("--quick", action="store_true", help="tiny shapes and 2 rounds: checks that it runs")
    parser.add_argument("--output", type=Path, default=None, help="also write the markdown tables here")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    suites = args.suites or ["dense"]
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    if args.quick:
        args.rounds = min(args.rounds, 2)
    for name in ("batch_size", "seq_len", "new_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")
    if args.threads:
        torch.set_num_threads(args.threads)
    tables = []
    for name in dict.fromkeys(suites):
        report = resolve_suite(name)(args)
        print(report.markdown(), flush=True)
        tables.append(report.markdown())
    if args.output:
        args.output.write_text("\n\n".join(tables) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
