"""The ablation study's report: its markdown table, and paired speed checks for its two speed claims (RMSNorm vs
LayerNorm, MHA vs GQA vs MQA decoding), timed side by side by the benchmark harness."""

from __future__ import annotations

from typing import Any

import torch

from archlab import DecoderConfig, DecoderForCausalLM

from .ablation_variants import VOCAB, AblationSettings, base_config
from .benchmarking import compare_speed


def markdown_table(results: list[dict[str, Any]], args: AblationSettings) -> str:
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
            f"{r['tokens_per_second']:,.0f} ({speed:.2f}×) | {_megabytes(r['peak_memory_mb'])} | "
            f"{r['kv_bytes_per_token']:,.0f} | {r['decode_tokens_per_second']:,.0f} ({decode:.2f}×) |"
        )
    return "\n".join(lines)


def _megabytes(mb: float) -> str:
    """Whole megabytes, or two significant digits below 10 (a tiny model's step holds well under one)."""
    return f"{mb:,.0f}" if mb >= 10 else f"{mb:.2g}"


# ----------------------------------------------------------------------------------------------------------------
# Paired speed checks: the sequential tokens/s above drift with machine load; these alternate A and B each round
# (benchmarking.compare_speed: median of per-round ratios) for the two speed claims.
# ----------------------------------------------------------------------------------------------------------------
def paired_speed(args: AblationSettings, rounds: int = 10) -> list[str]:
    from archlab.modeling.normalization import LayerNorm, RMSNorm

    lines = ["| comparison | A | B | speed of A ÷ speed of B (median of per-round ratios) |", "|---|---|---|---:|"]
    x = torch.randn(8, 256, 512, requires_grad=True)

    def norm_step(norm):
        def run():
            for _ in range(5):
                norm(x).sum().backward()

        return run

    _, _, ratio = compare_speed(norm_step(RMSNorm(512)), norm_step(LayerNorm(512)), rounds)
    lines.append(f"| norm module fwd+bwd, (8, 256, 512) fp32 | RMSNorm | LayerNorm | {ratio:.2f}× |")

    shape = dict(
        base_config(args), hidden_size=256, num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=2048
    )
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
    lines.append(
        f"| training step, hidden 256, batch 8×{2 * args.seq_len} | RMSNorm model | LayerNorm model | {ratio:.2f}× |"
    )

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
        lines.append(
            f"| greedy decoding, batch 4, 512-token prompt, 32 new tokens | {label} | MHA, 8 heads | {ratio:.2f}× |"
        )
    return lines
