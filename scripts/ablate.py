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
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from archlab import DecoderConfig, DecoderForCausalLM
from archlab.scripts.benchmark import peak_training_memory

VOCAB = 256  # bytes


@dataclass
class Variant:
    config: dict[str, Any] = field(default_factory=dict)  # DecoderConfig overrides of the baseline
    warmup: bool = True  # linear warm-up over `--warmup_steps`, else full learning rate from step 0
    claim: str = ""


VARIANTS: dict[str, Variant] = {
    "baseline": Variant(claim="LLaMA recipe: pre-RMSNorm, RoPE, SwiGLU (8/3·d), MHA"),
    "layer_norm": Variant(dict(norm_type="layer_norm"), claim="RMSNorm is faster than LayerNorm at equal quality"),
    "baseline_no_warmup": Variant(warmup=False, claim="pre-norm trains without warm-up"),
    "post_norm": Variant(dict(norm_position="post"), claim="post-norm needs warm-up"),
    "post_norm_no_warmup": Variant(dict(norm_position="post"), warmup=False, claim="post-norm without warm-up"),
    "deepnorm_no_warmup": Variant(dict(norm_position="deepnorm"), warmup=False, claim="DeepNorm stabilises post-norm"),
    "sandwich_norm": Variant(dict(norm_position="sandwich"), claim="sandwich norm (Gemma2)"),
    "parallel_block": Variant(dict(norm_position="parallel"), claim="parallel block: faster, little quality loss"),
    "gelu_mlp": Variant(dict(mlp_type="plain", hidden_act="gelu", intermediate_size=None, mlp_width_rule="4d"),
                        claim="gated FFNs beat plain ones at equal parameters"),
    "relu_mlp": Variant(dict(mlp_type="plain", hidden_act="relu", intermediate_size=None, mlp_width_rule="4d"),
                        claim="gated FFNs beat plain ones at equal parameters"),
    "geglu": Variant(dict(hidden_act="gelu_pytorch_tanh"), claim="GeGLU ≈ SwiGLU"),
    "alibi": Variant(dict(position_embedding_type="alibi"), claim="ALiBi extrapolates past L"),
    "learned_positions": Variant(dict(position_embedding_type="learned"), claim="learned positions cannot extrapolate"),
    "sinusoidal": Variant(dict(position_embedding_type="sinusoidal"), claim="sinusoidal extrapolates poorly"),
    "t5_relative_bias": Variant(dict(position_embedding_type="relative_bias"), claim="relative bias extrapolates"),
    "no_positions": Variant(dict(position_embedding_type="none"), claim="NoPE: causal mask alone"),
    "gqa_2kv": Variant(dict(num_key_value_heads=2), claim="GQA shrinks the KV cache, little quality loss"),
    "mqa": Variant(dict(num_key_value_heads=1), claim="MQA shrinks the KV cache most"),
    "qk_norm_z_loss": Variant(dict(use_qk_norm=True, lm_z_loss_coef=1e-4), claim="stability tricks cost nothing"),
}


# ----------------------------------------------------------------------------------------------------------------
# Data: a byte stream, fixed random windows
# ----------------------------------------------------------------------------------------------------------------
def load_texts(args: argparse.Namespace, split: str) -> list[str]:
    if args.dataset_name is None:
        from archlab.tokenization.corpus import stdlib_documents

        return [doc["text"] for doc in stdlib_documents(split=split)]
    import datasets

    dataset = datasets.load_dataset(args.dataset_name)
    names = list(dataset)
    if split == "validation" and "validation" not in dataset:
        return [row[args.text_column] for row in dataset[names[0]].select(range(min(200, len(dataset[names[0]]))))]
    return [row[args.text_column] for row in dataset["train" if split == "train" else split]]


def byte_stream(texts: list[str], limit: int) -> torch.Tensor:
    data = bytearray()
    for text in texts:
        data += text.encode("utf-8") + b"\n"
        if len(data) >= limit:
            break
    if len(data) < 4096:
        raise ValueError(f"The corpus has only {len(data)} bytes; `--dataset_name` needs more text.")
    return torch.tensor(list(data[:limit]), dtype=torch.long)


def windows(stream: torch.Tensor, count: int, length: int, generator: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, stream.numel() - length - 1, (count,), generator=generator)
    return torch.stack([stream[s : s + length] for s in starts.tolist()])


# ----------------------------------------------------------------------------------------------------------------
# One variant
# ----------------------------------------------------------------------------------------------------------------
def base_config(args: argparse.Namespace) -> dict[str, Any]:
    return dict(
        vocab_size=VOCAB, hidden_size=args.hidden_size, num_hidden_layers=args.layers, num_attention_heads=4,
        num_key_value_heads=4, intermediate_size=None, mlp_width_rule="8/3d", mlp_width_multiple_of=8,
        max_position_embeddings=4 * args.seq_len, pad_token_id=None, bos_token_id=None, eos_token_id=None,
        tie_word_embeddings=True, lm_loss_chunk_size=0,
    )


def learning_rate(step: int, args: argparse.Namespace, warmup: bool) -> float:
    warm = args.warmup_steps if warmup else 0
    if step < warm:
        return args.lr * (step + 1) / warm
    progress = (step - warm) / max(1, args.steps - warm)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))  # cosine to 10 %


@torch.no_grad()
def evaluate(model: DecoderForCausalLM, batches: torch.Tensor, from_position: int = 0) -> float:
    """Mean next-token loss over target positions >= from_position."""
    model.eval()
    logits = model(batches[:, :-1]).logits[:, from_position:]
    targets = batches[:, 1 + from_position :]
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB).float(), targets.reshape(-1))
    model.train()
    return loss.item()


@torch.no_grad()
def kv_cache_bytes_per_token(model: DecoderForCausalLM, prompt: torch.Tensor) -> float:
    model.eval()
    cache = model(prompt, use_cache=True).past_key_values
    total = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    return total / prompt.numel()


@torch.no_grad()
def decode_tokens_per_second(model: DecoderForCausalLM, prompt: torch.Tensor, new_tokens: int) -> float:
    model.eval()
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    model.generate(prompt, **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4})  # warm-up
    start = time.perf_counter()
    model.generate(prompt, **kwargs)
    return prompt.shape[0] * new_tokens / (time.perf_counter() - start)


def run_variant(name: str, variant: Variant, args: argparse.Namespace, train: torch.Tensor, val: torch.Tensor,
                val_long: torch.Tensor) -> dict[str, Any]:
    torch.manual_seed(args.seed)  # same initial weights wherever shapes agree
    config = DecoderConfig(**{**base_config(args), **variant.config}, attn_implementation="sdpa")
    model = DecoderForCausalLM(config).train()
    params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    generator = torch.Generator().manual_seed(args.seed)  # same batches, same order, for every variant
    curve, step_times = [], []
    diverged = False
    for step in range(args.steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, args, variant.warmup)
        batch = windows(train, args.batch_size, args.seq_len + 1, generator)
        start = time.perf_counter()
        loss = model(batch[:, :-1], labels=batch[:, :-1]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step_times.append(time.perf_counter() - start)
        curve.append(loss.item())
        if not math.isfinite(curve[-1]):
            diverged = True
            break
    # labels are the inputs: the model shifts them itself, so batch[:, :-1] predicts its own next bytes
    step_time = statistics.median(step_times[min(5, len(step_times) - 1) :])
    batch = windows(train, args.batch_size, args.seq_len + 1, torch.Generator().manual_seed(1))
    peak = peak_training_memory(model, lambda: _train_step(model, batch, optimizer), optimizer)
    prompt = val[:4, :32]
    return dict(
        name=name, claim=variant.claim, config=variant.config, warmup=variant.warmup, parameters=params,
        diverged=diverged, loss_curve=curve,
        val_loss=evaluate(model, val) if not diverged else float("nan"),
        val_loss_2x_tail=evaluate(model, val_long, from_position=args.seq_len) if not diverged else float("nan"),
        tokens_per_second=args.batch_size * args.seq_len / step_time,
        peak_memory_mb=peak / 2**20,
        kv_bytes_per_token=kv_cache_bytes_per_token(model, prompt),
        decode_tokens_per_second=decode_tokens_per_second(model, prompt, args.decode_tokens),
    )


def _train_step(model: DecoderForCausalLM, batch: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
    model(batch[:, :-1], labels=batch[:, :-1]).loss.backward()
    optimizer.zero_grad(set_to_none=True)  # measure the step's tensors without changing the trained weights


# ----------------------------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------------------------
def markdown_table(results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    base = next((r for r in results if r["name"] == "baseline"), results[0])
    lines = [
        f"| variant | params | val loss @L={args.seq_len} | loss on {args.seq_len}..{2 * args.seq_len} | "
        "train tok/s (× baseline) | peak train MB | KV bytes/token | decode tok/s (× baseline) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        speed = r["tokens_per_second"] / base["tokens_per_second"]
        decode = r["decode_tokens_per_second"] / base["decode_tokens_per_second"]
        flag = " (diverged)" if r["diverged"] else ""
        lines.append(
            f"| {r['name']}{flag} | {r['parameters'] / 1e6:.2f}M | {r['val_loss']:.3f} | {r['val_loss_2x_tail']:.3f} | "
            f"{r['tokens_per_second']:,.0f} ({speed:.2f}×) | {r['peak_memory_mb']:.0f} | {r['kv_bytes_per_token']:,.0f} "
            f"| {r['decode_tokens_per_second']:,.0f} ({decode:.2f}×) |"
        )
    return "\n".join(lines)


def plot_curves(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 6))
    for r in results:
        curve = torch.tensor(r["loss_curve"])
        k = min(10, len(curve))
        smooth = torch.nn.functional.avg_pool1d(curve[None, None], k, stride=1)[0, 0]  # running mean
        ax.plot(range(k - 1, len(curve)), smooth.tolist(), label=r["name"], linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats/byte, running mean of 10)")
    ax.set_ylim(top=min(4.0, ax.get_ylim()[1]))
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------------------------
# Paired speed checks: the sequential tokens/s above drift with machine load; these alternate A and B each round
# (benchmark.compare_speed: median of per-round ratios) for the two speed claims.
# ----------------------------------------------------------------------------------------------------------------
def paired_speed(args: argparse.Namespace, rounds: int = 10) -> list[str]:
    from archlab.modeling.normalization import LayerNorm, RMSNorm
    from archlab.scripts.benchmark import compare_speed

    lines = ["| comparison | A | B | speed of A ÷ speed of B (median of per-round ratios) |", "|---|---|---|---:|"]
    x = torch.randn(8, 256, 512, requires_grad=True)

    def norm_step(norm):
        def run():
            for _ in range(5):
                norm(x).sum().backward()
        return run

    _, _, ratio = compare_speed(norm_step(RMSNorm(512)), norm_step(LayerNorm(512)), rounds)
    lines.append(f"| norm module fwd+bwd, (8, 256, 512) fp32 | RMSNorm | LayerNorm | {ratio:.2f}× |")

    shape = dict(base_config(args), hidden_size=256, num_attention_heads=8, num_key_value_heads=8,
                 max_position_embeddings=2048)
    batch = torch.randint(0, VOCAB, (8, 2 * args.seq_len))
    models = {}
    for name, overrides in {"rms": {}, "ln": dict(norm_type="layer_norm")}.items():
        torch.manual_seed(0)
        models[name] = DecoderForCausalLM(DecoderConfig(**shape, **overrides)).train()

    def train_step(model):
        def run():
            model(batch, labels=batch).loss.backward()
            model.zero_grad(set_to_none=True)
        return run

    _, _, ratio = compare_speed(train_step(models["rms"]), train_step(models["ln"]), rounds)
    lines.append(f"| training step, hidden 256, batch 8×{2 * args.seq_len} | RMSNorm model | LayerNorm model | {ratio:.2f}× |")

    prompt = torch.randint(0, VOCAB, (4, 512))
    decoders = {}
    for kv in (8, 2, 1):
        torch.manual_seed(0)
        decoders[kv] = DecoderForCausalLM(DecoderConfig(**{**shape, "num_key_value_heads": kv})).eval()

    def decode(model):
        return lambda: model.generate(prompt, max_new_tokens=32, min_new_tokens=32, do_sample=False)

    for kv, label in ((2, "GQA, 2 KV heads"), (1, "MQA, 1 KV head")):
        with torch.no_grad():
            _, _, ratio = compare_speed(decode(decoders[kv]), decode(decoders[8]), rounds)
        lines.append(f"| greedy decoding, batch 4, 512-token prompt, 32 new tokens | {label} | MHA, 8 heads | {ratio:.2f}× |")
    return lines


# ----------------------------------------------------------------------------------------------------------------
# Entry point
# ----------------------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", default="ablation", help="where the results go (default: ablation)")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"comma-separated subset of (default: all): {', '.join(VARIANTS)}")
    parser.add_argument("--dataset_name", default=None, help="a `datasets.load_dataset` path; default: the stdlib corpus")
    parser.add_argument("--text_column", default="text", help="with --dataset_name: the text column (default: text)")
    parser.add_argument("--steps", type=int, default=300, help="training steps per variant (default: 300)")
    parser.add_argument("--warmup_steps", type=int, default=30, help="linear warm-up steps, < --steps (default: 30)")
    parser.add_argument("--batch_size", type=int, default=16, help="sequences per step (default: 16)")
    parser.add_argument("--seq_len", type=int, default=128, help="training length L in bytes (default: 128)")
    parser.add_argument("--hidden_size", type=int, default=128, help="model width, a multiple of 4 (default: 128)")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers (default: 4)")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate, > 0 (default: 3e-3)")
    parser.add_argument("--decode_tokens", type=int, default=64, help="tokens per timed greedy decode (default: 64)")
    parser.add_argument("--corpus_bytes", type=int, default=8_000_000,
                        help="bytes of training text, a tenth as many for validation (default: 8000000)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default: 1, which avoids spin contention on shared cores)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the batch order (default: 0)")
    parser.add_argument("--paired_speed", action="store_true",
                        help="also time RMSNorm vs LayerNorm and MHA/GQA/MQA decoding side by side (paired.md)")
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
    if not args.lr > 0:
        parser.error(f"--lr must be > 0, got {args.lr}")
    if not 0 <= args.warmup_steps < args.steps:
        parser.error(f"--warmup_steps must be in [0, --steps={args.steps}), got {args.warmup_steps}")
    if args.hidden_size % 4:
        parser.error(f"--hidden_size must be divisible by the 4 attention heads, got {args.hidden_size}")
    return args


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    train = byte_stream(load_texts(args, "train"), args.corpus_bytes)
    val_stream = byte_stream(load_texts(args, "validation"), args.corpus_bytes // 10)
    val = windows(val_stream, 32, args.seq_len + 1, torch.Generator().manual_seed(123))
    val_long = windows(val_stream, 16, 2 * args.seq_len + 1, torch.Generator().manual_seed(456))
    results = []
    for name in args.variant_names:
        start = time.perf_counter()
        results.append(run_variant(name, VARIANTS[name], args, train, val, val_long))
        r = results[-1]
        print(f"{name:22s} val {r['val_loss']:.3f}  2x-tail {r['val_loss_2x_tail']:.3f}  "
              f"{r['tokens_per_second']:,.0f} tok/s  ({time.perf_counter() - start:.0f}s)", flush=True)
        (out / "results.json").write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    table = markdown_table(results, args)
    (out / "ablations.md").write_text(table + "\n")
    plot_curves(results, out / "loss_curves.png")
    print(table)
    if args.paired_speed:
        paired = "\n".join(paired_speed(args))
        (out / "paired.md").write_text(paired + "\n")
        print(paired)
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
