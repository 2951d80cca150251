"""Encoder-decoder speed and memory: archlab's `Seq2SeqForConditionalGeneration` against `MarianMTModel`.

Both models have the same Marian config (opus-mt shape by default: d_model 512, 6 + 6 layers, 8 heads, FFN 2048,
Swish, dropout 0.1) and the same weights (archlab loads Marian's state dict with strict=True), and see the same
inputs, side by side in one process (the method of `scripts/benchmark.py`: warm-up, alternating order, median of
per-round ratios). The goals:

- training tokens/s (full optimiser step, Trainer's default fused AdamW unless `--optim`; source + target tokens),
  goal ≥ 1.2×;
- beam-search generation tokens/s (4 beams, EncoderDecoderCache, fixed output length), goal ≥ 1.0×;
- peak memory of a training step, goal ≤ 1.0× (reported as Marian ÷ archlab, so ≥ 1 meets it).

    python scripts/benchmark.py --suite seq2seq --threads 2            # with the shared flags
    python -m archlab.scripts.benchmark_seq2seq --threads 2 --rounds 8  # the same, standalone
    python -m archlab.scripts.benchmark_seq2seq --quick                 # tiny shapes: checks that it runs
"""

from __future__ import annotations

import argparse
import sys

import torch
from transformers import MarianConfig, MarianMTModel

from archlab import Seq2SeqConfig, Seq2SeqForConditionalGeneration
from archlab.training.benchmarking import (
    Report,
    Row,
    breakdown_notes,
    compare_speed,
    make_optimizer,
    peak_training_memory,
    training_step,
)


def marian_shape(quick: bool) -> dict:
    if quick:
        return dict(
            vocab_size=1024,
            d_model=64,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=256,
            decoder_ffn_dim=256,
        )
    return dict(
        vocab_size=8192,
        d_model=512,
        encoder_layers=6,
        decoder_layers=6,
        encoder_attention_heads=8,
        decoder_attention_heads=8,
        encoder_ffn_dim=2048,
        decoder_ffn_dim=2048,
    )


def build_pair(quick: bool, max_positions: int) -> tuple[Seq2SeqForConditionalGeneration, MarianMTModel]:
    shape = marian_shape(quick)
    marian = dict(
        shape,
        max_position_embeddings=max_positions,
        activation_function="swish",
        scale_embedding=True,
        dropout=0.1,
        pad_token_id=shape["vocab_size"] - 1,
        decoder_start_token_id=shape["vocab_size"] - 1,
        eos_token_id=0,
        forced_eos_token_id=0,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    peer = MarianMTModel(MarianConfig(**marian, attn_implementation="sdpa"))
    config = Seq2SeqConfig(**marian, sinusoidal_layout="split", attn_implementation="sdpa")
    ours = Seq2SeqForConditionalGeneration(config)
    ours.load_state_dict(peer.state_dict(), strict=True)
    return ours, peer


def run(args: argparse.Namespace) -> Report:
    batch_size, seq_len = (2, 32) if args.quick else (args.batch_size, min(args.seq_len, 128))
    new_tokens = 8 if args.quick else min(args.new_tokens, 32)
    ours, peer = build_pair(args.quick, max_positions=max(seq_len, new_tokens) + 2)
    vocab = ours.config.vocab_size
    generator = torch.Generator().manual_seed(1)
    source = torch.randint(1, vocab - 1, (batch_size, seq_len), generator=generator)
    labels = torch.randint(1, vocab - 1, (batch_size, seq_len), generator=generator)
    batch = {"input_ids": source, "attention_mask": torch.ones_like(source), "labels": labels}
    tokens = 2 * batch_size * seq_len
    shape = marian_shape(args.quick)
    report = Report(
        title=f"Encoder-decoder vs MarianMTModel — d_model {shape['d_model']}, {shape['encoder_layers']}+"
        f"{shape['decoder_layers']} layers, {shape['encoder_attention_heads']} heads, FFN {shape['encoder_ffn_dim']}, "
        f"vocab {vocab}",
        peer_name="MarianMTModel",
    )

    ours.train(), peer.train()
    opt_a, opt_p = make_optimizer(ours, args.optim), make_optimizer(peer, args.optim)
    t_a, t_p, ratio = compare_speed(training_step(ours, batch, opt_a), training_step(peer, batch, opt_p), args.rounds)
    report.rows.append(
        Row(
            f"training tokens/s, fp32 (batch {batch_size}, {seq_len} source + {seq_len} target, {args.optim})",
            tokens / t_a,
            tokens / t_p,
            ratio,
            "tok/s",
            "≥ 1.2×",
        )
    )
    mem_a = peak_training_memory(ours, training_step(ours, batch, opt_a), opt_a)
    # MemTracker hooks every parameter's gradient; Marian's sinusoid tables are frozen parameters (no gradient ever
    # reaches them: they are computed under no_grad), so flag them for the measurement only.
    frozen = [p for p in peer.parameters() if not p.requires_grad]
    for parameter in frozen:
        parameter.requires_grad_(True)
    mem_p = peak_training_memory(peer, training_step(peer, batch, opt_p), opt_p)
    for parameter in frozen:
        parameter.requires_grad_(False)
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
    report.notes += breakdown_notes([("MarianMTModel", peer, opt_p), ("archlab", ours, opt_a)], batch)
    del opt_a, opt_p

    # The training steps above drew different dropout masks for the two models: give them the same weights again.
    ours.load_state_dict(peer.state_dict(), strict=True)
    ours.eval(), peer.eval()
    beams = dict(
        input_ids=source,
        attention_mask=batch["attention_mask"],
        num_beams=4,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        early_stopping=False,
    )
    with torch.inference_mode():
        same = torch.equal(ours.generate(**beams), peer.generate(**beams))
        t_a, t_p, ratio = compare_speed(lambda: ours.generate(**beams), lambda: peer.generate(**beams), args.rounds)
    n = batch_size * new_tokens
    report.rows.append(
        Row(
            f"beam-search tokens/s (batch {batch_size}, 4 beams, {new_tokens} new tokens)",
            n / t_a,
            n / t_p,
            ratio,
            "tok/s",
            "≥ 1.0×",
        )
    )
    report.notes.append(f"beam-search outputs identical to Marian's: {same}.")
    report.notes.append(f"{args.rounds} rounds, torch {torch.__version__}, {torch.get_num_threads()} threads.")
    return report


def main(argv: list[str] | None = None) -> int:
    from archlab.scripts import benchmark

    return benchmark.main(["--suite", "seq2seq", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
