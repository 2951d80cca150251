"""Mixture-of-experts speed: archlab's sparse decoder against transformers' Mixtral, side by side in one process.

Models (same config, same weights, same inputs):
  archlab-moe          `DecoderForCausalLM` with K experts, top-k
  mixtral-<impl>       `MixtralForCausalLM` with each `experts_implementation` (eager, batched_mm, grouped_mm);
                       one model whose implementation is switched between timings. batched_mm is timed for
                       decoding only: it gathers a copy of the expert weights per (token, slot), 1.4 GB per layer
                       at batch 2 x 128, so a training step at the default batch does not fit in memory.
  archlab-dense        the dense decoder with the same active FLOPs (intermediate = k · moe_intermediate_size)
  llama-dense          `LlamaForCausalLM` of that dense shape

Training: one full step (forward with labels and the load-balancing loss, backward, optimizer step), with Trainer's
default optimiser (fused AdamW) unless `--optim` says otherwise.
Decode: greedy `generate` of `--new-tokens` tokens after a `--prompt`-token prompt, batch `--decode-batch`.

Method (the harness of `archlab.training.benchmarking`): fixed `torch.set_num_threads`, a warm-up of every model,
then `--rounds` rounds in which every model runs once, the order rotating and reversing from round to round; a
model's score is the median over rounds of its time relative to archlab-moe in the same round (so machine-load drift
cancels). Absolute tokens/s are medians too.

    python -m archlab.scripts.benchmark_moe --rounds 8            # the README's config (vocab 8192, d 512, 8 layers)
    python -m archlab.scripts.benchmark_moe --batch 2 --seq 128 --rounds 3 --decode-rounds 3   # quick look

Reportable run: the defaults (batch 8 x 256 training, batch-1 decoding of 32 tokens after 32, 8 + 8 rounds, 2
threads) on an otherwise idle machine, with `--json results.json` to keep the numbers. Estimated at about 5 minutes
on a quiet 2-core machine: a warm-up and one round of every model took 4 minutes at a load average of 3-4, where
the dense decoder trains ~3x and decodes ~5x slower than on the quiet machine. On a shared machine only the
ratios mean anything, and only with >= 8 rounds.

Mixtral's default `experts_implementation` in transformers 5.x is grouped_mm wherever the kernel exists (CPU with
torch >= 2.9 included), eager in older releases; both are timed. archlab's decode step with one token on CPU takes
the one-token expert path (k matrix-vector products), larger batches the grouped path.
"""

from __future__ import annotations

import argparse
import json
import statistics
from functools import partial

import torch
from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

from archlab import DecoderConfig, DecoderForCausalLM
from archlab.modeling.moe import count_parameters
from archlab.training.benchmarking import (
    OPTIMIZERS,
    Report,
    Row,
    interleaved_rounds,
    make_optimizer,
    median_ratios,
    time_breakdown,
    torch_threads,
)

HF_EXPERTS = ("eager", "batched_mm", "grouped_mm")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--hidden-size", type=int, default=512)
    p.add_argument("--dense-intermediate-size", type=int, default=1376)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--rounds", type=int, default=8, help="training rounds (>= 8 for a reportable number)")
    p.add_argument("--decode-rounds", type=int, default=8)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--decode-batch", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-5, help="small, so routing stays comparable across models")
    p.add_argument(
        "--optim",
        choices=sorted(OPTIMIZERS),
        default="adamw_torch_fused",
        help="the optimiser of every training step, by Trainer's name (default: Trainer's default)",
    )
    p.add_argument("--skip", nargs="*", default=[], help="model names to leave out, e.g. mixtral-eager")
    p.add_argument("--no-train", action="store_true")
    p.add_argument("--no-decode", action="store_true")
    p.add_argument("--json", type=str, default=None, help="also write the results here")
    args = p.parse_args(argv)
    if args.dense_intermediate_size % args.top_k != 0:
        p.error(
            f"--dense-intermediate-size ({args.dense_intermediate_size}) must be divisible by --top-k ({args.top_k})"
        )
    if not 1 <= args.top_k <= args.experts:
        p.error(f"--top-k must be in [1, --experts={args.experts}], got {args.top_k}")
    return args


def build_models(args: argparse.Namespace) -> dict[str, torch.nn.Module]:
    shape = dict(
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=max(args.seq, args.prompt + args.new_tokens),
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        pad_token_id=None,
        eos_token_id=None,
        bos_token_id=None,
    )
    moe = dict(
        shape,
        intermediate_size=args.dense_intermediate_size // args.top_k,  # same active FLOPs as the dense model
        num_local_experts=args.experts,
        num_experts_per_tok=args.top_k,
        output_router_logits=True,
        router_aux_loss_coef=0.01,
    )
    torch.manual_seed(0)
    mixtral = MixtralForCausalLM(MixtralConfig(**moe, attn_implementation="sdpa"))
    ours = DecoderForCausalLM(DecoderConfig(**moe, attn_implementation="sdpa"))
    ours.load_state_dict(mixtral.state_dict(), strict=True)
    llama = LlamaForCausalLM(
        LlamaConfig(**shape, intermediate_size=args.dense_intermediate_size, attn_implementation="sdpa")
    )
    dense = DecoderForCausalLM(
        DecoderConfig(**shape, intermediate_size=args.dense_intermediate_size, attn_implementation="sdpa")
    )
    dense.load_state_dict(llama.state_dict(), strict=True)
    models = {"archlab-moe": ours, "mixtral": mixtral, "archlab-dense": dense, "llama-dense": llama}
    return models


def runners(models: dict[str, torch.nn.Module], skip: list[str]) -> list[tuple[str, torch.nn.Module, str | None]]:
    """(name, model, Mixtral experts implementation or None) for every timed entry."""
    entries = [("archlab-moe", models["archlab-moe"], None)]
    entries += [(f"mixtral-{impl}", models["mixtral"], impl) for impl in HF_EXPERTS]
    entries += [("archlab-dense", models["archlab-dense"], None), ("llama-dense", models["llama-dense"], None)]
    return [e for e in entries if e[0] not in skip]


def rounds(entries, run_one, n_rounds: int, tokens: int) -> dict[str, dict[str, float]]:
    """The harness's interleaved rounds over every entry; per model the median tokens/s and the median per-round
    ratio of its time to archlab-moe's."""
    times = interleaved_rounds({name: partial(run_one, model, impl) for name, model, impl in entries}, n_rounds)
    speedups = median_ratios(times, "archlab-moe")  # >1: archlab-moe faster
    return {
        name: {"tokens_per_s": statistics.median(tokens / t for t in ts), "archlab_moe_speedup": speedups[name]}
        for name, ts in times.items()
    }


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    with torch_threads(args.threads):
        return run_suite(args)


def run_suite(args: argparse.Namespace) -> dict:
    models = build_models(args)
    entries = runners(models, args.skip)
    results: dict = {"config": vars(args), "threads": torch.get_num_threads()}
    results["parameters"] = {
        "archlab-moe": count_parameters(models["archlab-moe"]),
        "archlab-dense": count_parameters(models["archlab-dense"]),
    }
    print(json.dumps(results["parameters"]))

    if not args.no_train:
        optimizers = {id(m): make_optimizer(m, args.optim, args.lr) for m in models.values()}
        gen = torch.Generator().manual_seed(1)
        ids = torch.randint(0, args.vocab_size, (args.batch, args.seq), generator=gen)

        def train_step(model, impl):
            if impl is not None:
                model.set_experts_implementation(impl)
            model.train()
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizers[id(model)].step()
            optimizers[id(model)].zero_grad(set_to_none=True)

        train_entries = [e for e in entries if e[0] != "mixtral-batched_mm"]
        results["train"] = rounds(train_entries, train_step, args.rounds, args.batch * args.seq)
        report(f"training step (full {args.optim} step)", results["train"])
        # Where each step goes: with the same GEMMs, 1 / (GEMM + attention share) bounds any speed-up.
        results["train_breakdown"] = {}
        for name, model, impl in train_entries:
            shares = time_breakdown(partial(train_step, model, impl))
            results["train_breakdown"][name] = shares
            print(
                f"  {name:<20} GEMMs {shares['gemm']:.0%}, attention kernels {shares['attention']:.0%}, "
                f"everything else {shares['other']:.0%} (ceiling with these GEMMs: {1 / (1 - shares['other']):.2f}x)"
            )

    if not args.no_decode:
        gen = torch.Generator().manual_seed(2)
        prompt = torch.randint(0, args.vocab_size, (args.decode_batch, args.prompt), generator=gen)
        outputs: dict[str, torch.Tensor] = {}

        @torch.inference_mode()
        def decode(model, impl):
            if impl is not None:
                model.set_experts_implementation(impl)
            model.eval()
            out = model.generate(
                prompt, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False
            )
            outputs[impl or str(id(model))] = out

        results["decode"] = rounds(entries, decode, args.decode_rounds, args.decode_batch * args.new_tokens)
        report(f"greedy decode (batch {args.decode_batch}, {args.new_tokens} new tokens)", results["decode"])

    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return results


GOALS = {
    ("train", "mixtral-grouped_mm"): "≥ 1.2× (HF's best)",
    ("train", "mixtral-eager"): "≥ 2.5× (the old default)",
    ("train", "archlab-dense"): "≥ 0.9× (same active FLOPs)",
    ("decode", "mixtral-grouped_mm"): "≥ 1.0×",
}


def run(args: argparse.Namespace) -> Report:
    """`python scripts/benchmark.py --suite moe`: this benchmark with the shared flags (their rounds, threads and
    --quick), as a table of archlab-moe against every other model."""
    argv = [
        "--rounds",
        str(args.rounds),
        "--decode-rounds",
        str(args.rounds),
        "--threads",
        str(torch.get_num_threads()),
        "--optim",
        args.optim,
    ]
    if args.quick:
        argv += [
            "--vocab-size",
            "1024",
            "--hidden-size",
            "128",
            "--dense-intermediate-size",
            "344",
            "--layers",
            "2",
            "--heads",
            "4",
            "--kv-heads",
            "2",
            "--batch",
            "2",
            "--seq",
            "64",
            "--prompt",
            "8",
            "--new-tokens",
            "8",
        ]
    results = main(argv)
    report = Report(
        title="Mixture of experts vs MixtralForCausalLM (8 experts top-2 unless --quick) and the dense "
        "models of the same active FLOPs",
        peer_name="peer",
    )
    for phase, label in (("train", "training step tokens/s"), ("decode", "greedy decode tokens/s")):
        table = results[phase]
        ours = table["archlab-moe"]["tokens_per_s"]
        for name, row in table.items():
            if name != "archlab-moe":
                report.rows.append(
                    Row(
                        f"{label}: archlab-moe vs {name}",
                        ours,
                        row["tokens_per_s"],
                        row["archlab_moe_speedup"],
                        "tok/s",
                        GOALS.get((phase, name), ""),
                    )
                )
    return report


def report(title: str, table: dict[str, dict[str, float]]) -> None:
    print(f"\n{title}")
    print(f"{'model':<20}{'tokens/s':>12}{'archlab-moe speed-up':>24}")
    for name, row in table.items():
        print(f"{name:<20}{row['tokens_per_s']:>12.1f}{row['archlab_moe_speedup']:>23.2f}x")


if __name__ == "__main__":
    main()
