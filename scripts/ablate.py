"""Ablation study: train tiny decoder variants with the same budget and compare what the seeds claim.

    python scripts/ablate.py --output_dir ablation                       # every variant, embedded stdlib corpus
    python scripts/ablate.py --variants baseline,layer_norm --steps 50   # a subset, shorter
    python scripts/ablate.py --dataset_name path/to/local/dataset --text_column text

Each variant is the LLaMA-recipe baseline with one or two config fields changed (see `VARIANTS`); all of them see
the same batches in the same order (one seeded sampler over a byte-level token stream), the same optimiser and the
same schedule, unless the variant is about the schedule (the "no warm-up" rows). Written to `--output_dir`:
`results.json`, `ablations.md` (the table) and `loss_curves.png`.

Measured per variant (seeds 000/002/004 make claims about each):
- final validation loss at the training length L, and on positions L..2L of sequences twice as long (extrapolation);
- training tokens/s (median step time after warm-up; other processes on the machine make this noisy);
- peak training memory: every live tensor of one step (torch's MemTracker), not the process RSS;
- KV-cache bytes per token, read from a real cache after a forward;
- cached greedy decoding tokens/s.

Tokens are UTF-8 bytes (vocabulary 256): no tokenizer training, and the same text gives the same tokens everywhere.
"""

from __future__ import annotations

import argparse
import math
import os
from typing import Any

from archlab.scripts.arguments import run_cli
from archlab.training.ablation import run_ablation
from archlab.training.ablation_variants import VARIANTS
from archlab.training.benchmarking import torch_threads


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", default="ablation", help="where the results go (default: ablation)")
    parser.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help=f"comma-separated subset of (default: all): {', '.join(VARIANTS)}",
    )
    parser.add_argument(
        "--dataset_name", default=None, help="a `datasets.load_dataset` path; default: the stdlib corpus"
    )
    parser.add_argument("--text_column", default="text", help="with --dataset_name: the text column (default: text)")
    parser.add_argument("--steps", type=int, default=300, help="training steps per variant (default: 300)")
    parser.add_argument("--warmup_steps", type=int, default=30, help="linear warm-up steps, < --steps (default: 30)")
    parser.add_argument("--batch_size", type=int, default=16, help="sequences per step (default: 16)")
    parser.add_argument("--seq_len", type=int, default=128, help="training length L in bytes (default: 128)")
    parser.add_argument("--hidden_size", type=int, default=128, help="model width, a multiple of 4 (default: 128)")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers (default: 4)")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate, > 0 (default: 3e-3)")
    parser.add_argument("--decode_tokens", type=int, default=64, help="tokens per timed greedy decode (default: 64)")
    parser.add_argument(
        "--corpus_bytes",
        type=int,
        default=8_000_000,
        help="bytes of training text, a tenth as many for validation (default: 8000000)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default: 1, which avoids spin contention on shared cores)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the batch order (default: 0)")
    parser.add_argument(
        "--paired_speed",
        action="store_true",
        help="also time RMSNorm vs LayerNorm and MHA/GQA/MQA decoding side by side (paired.md)",
    )
    return parser


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.variants.split(",") if n.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown or not names:
        parser.error(f"--variants: unknown {unknown or 'empty list'}; allowed values: {', '.join(VARIANTS)}")
    args.variant_names = names
    for flag in ("steps", "batch_size", "seq_len", "hidden_size", "layers", "decode_tokens", "threads", "corpus_bytes"):
        if getattr(args, flag) <= 0:
            parser.error(f"--{flag} must be a positive integer, got {getattr(args, flag)}")
    if not 0 < args.lr < math.inf:
        parser.error(f"--lr must be > 0 and finite, got {args.lr}")
    for flag in ("output_dir", "dataset_name", "text_column"):
        if getattr(args, flag) == "":  # ("" wrote the results into the current folder; load_dataset("") failed)
            parser.error(f"--{flag} is an empty string: give a value, or leave the flag out")
    if not 0 <= args.warmup_steps < args.steps:
        parser.error(f"--warmup_steps must be in [0, --steps={args.steps}), got {args.warmup_steps}")
    if args.hidden_size % 8:  # 4 heads, each of an even size: RoPE rotates pairs of channels
        parser.error(
            f"--hidden_size must be a multiple of 8 (4 attention heads of an even size), got {args.hidden_size}"
        )
    if args.corpus_bytes // 10 < 2 * args.seq_len + 3:  # validation windows of 2L + 1 bytes from a tenth of the corpus
        parser.error(
            f"--corpus_bytes must be at least {10 * (2 * args.seq_len + 3)} (a tenth of it holds validation sequences "
            f"of 2 x --seq_len + 1 bytes), got {args.corpus_bytes}"
        )
    prompt = min(32, args.seq_len + 1)  # the timed decode's prompt: the first 32 bytes of a validation window
    if prompt + args.decode_tokens > 4 * args.seq_len:  # the models' max_position_embeddings (ablation_variants.py)
        # (a learned table failed at its first decode, after the variant had trained; RoPE warned and ran past it)
        parser.error(
            f"--decode_tokens {args.decode_tokens} after a {prompt}-byte prompt runs past the models' "
            f"{4 * args.seq_len} positions (4 x --seq_len): use --decode_tokens <= {4 * args.seq_len - prompt} or a "
            "longer --seq_len"
        )
    if os.path.exists(args.output_dir) and not os.path.isdir(args.output_dir):
        parser.error(f"--output_dir {args.output_dir!r} is a file, not a folder")
    return args


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    with torch_threads(args.threads):
        return run_ablation(args, args.output_dir)


def cli() -> None:
    """`python scripts/ablate.py`: `main` with one-line errors for archlab's own input errors (see `run_cli`)."""
    run_cli(main)


if __name__ == "__main__":
    cli()
