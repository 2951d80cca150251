"""`--suite cuda-catalogue`: greedy decoding of the catalogue's newest architectures against transformers' own model of
the same weights, each on the static cache (transformers then compiles its decoding step; archlab runs its compiled
loop): a GPT-OSS-shaped model (attention sinks, alternating 128-token local layers, YaRN, experts with biases and the
clamped SwiGLU), a DeepSeek-V3-shaped one (multi-head latent attention, sigmoid-routed experts with a shared expert,
a dense first layer) and a Llama-4-shaped one (chunked attention, NoPE layers with temperature tuning, a QK-norm
without a gain, top-1 experts weighing their input, a shared expert). Each pair is built through the converter
(`archlab.conversion`), so archlab's model is the stock model's weights as a user's conversion gives them. The shapes
are the published models' widths with fewer layers and experts (an H100 holds both models of every row; their
compilations fit one device call); --quick runs tiny ones (CPU: the code path, no meaningful timing).

    python scripts/benchmark.py --suite cuda-catalogue --device cuda
"""

from __future__ import annotations

import argparse
import sys

import torch

from archlab.scripts.benchmark_cuda import Setup, build_on, guarded, setup_from, with_goals
from archlab.scripts.benchmark_cuda_decode import (
    bf16_pair,
    closing_notes,
    decode_shape,
    generate_row,
    greedy_call,
    new_report,
    not_compiled_note,
)
from archlab.training.benchmarking import Report
from archlab.training.roofline import decode_roofline_seconds

_QUICK_COMMON = dict(vocab_size=1024, hidden_size=128, num_hidden_layers=2, num_attention_heads=4)
# family -> (what the row calls the model, stock config fields at full size, at --quick size)
SHAPES: dict[str, tuple[str, dict, dict]] = {
    "gpt_oss": (
        "GPT-OSS shape (gpt-oss-20b's widths, 8 layers, 32 experts top-4)",
        dict(
            vocab_size=201088,
            hidden_size=2880,
            intermediate_size=2880,
            num_hidden_layers=8,
            num_attention_heads=64,
            num_key_value_heads=8,
            head_dim=64,
            num_local_experts=32,
            num_experts_per_tok=4,
            sliding_window=128,
            max_position_embeddings=131072,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 32.0,
                "original_max_position_embeddings": 4096,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
            },
        ),
        dict(
            _QUICK_COMMON,
            intermediate_size=128,
            num_key_value_heads=2,
            head_dim=32,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=8,
        ),
    ),
    "deepseek_v3": (
        "DeepSeek-V3 shape (DeepSeek-V2-Lite's widths, 8 layers, 64 experts top-6)",
        dict(
            vocab_size=102400,
            hidden_size=2048,
            intermediate_size=10944,
            moe_intermediate_size=1408,
            num_hidden_layers=8,
            num_attention_heads=16,
            num_key_value_heads=16,
            kv_lora_rank=512,
            q_lora_rank=None,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
            n_routed_experts=64,
            num_experts_per_tok=6,
            n_shared_experts=2,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
            max_position_embeddings=163840,
        ),
        dict(
            _QUICK_COMMON,
            intermediate_size=256,
            moe_intermediate_size=64,
            num_key_value_heads=4,
            kv_lora_rank=32,
            q_lora_rank=None,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
        ),
    ),
    "llama4_text": (
        "Llama 4 shape (Scout's layer kinds at hidden 2048, 8 layers, 16 experts top-1, chunks of 128)",
        dict(
            vocab_size=202048,
            hidden_size=2048,
            intermediate_size=4096,
            intermediate_size_mlp=8192,
            num_hidden_layers=8,
            num_attention_heads=16,
            num_key_value_heads=4,
            head_dim=128,
            num_local_experts=16,
            num_experts_per_tok=1,
            attention_chunk_size=128,
            max_position_embeddings=131072,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 16.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 1.0,
                "original_max_position_embeddings": 8192,
            },
        ),
        dict(
            _QUICK_COMMON,
            num_hidden_layers=4,
            intermediate_size=128,
            intermediate_size_mlp=256,
            num_key_value_heads=2,
            head_dim=32,
            num_local_experts=4,
            num_experts_per_tok=1,
            attention_chunk_size=8,
            no_rope_layer_interval=2,
            floor_scale=8,
        ),
    ),
}


def converted_pair(family_name: str, stock_kwargs: dict, device: torch.device):
    """(archlab DecoderForCausalLM, the stock model) with the stock model's random weights, converted as
    `convert_checkpoint` converts a folder of that family."""
    from archlab import DecoderForCausalLM
    from archlab.conversion.families import FAMILIES

    family = FAMILIES[family_name]
    stock = build_on(device, lambda: family.model_class(family.stock_config(stock_kwargs)))
    config = family.archlab_config(stock.config)
    ours = build_on(device, lambda: DecoderForCausalLM(config))
    ours.load_state_dict(family.layout.to_archlab(stock.state_dict(), config), strict=True)
    return ours, stock


def catalogue_rows(setup: Setup, report: Report, family_name: str) -> None:
    label, full, quick = SHAPES[family_name]
    sizes = decode_shape(setup)
    ours, stock = bf16_pair(converted_pair(family_name, quick if setup.quick else full, setup.device))
    for batch in sizes["static_batches"][:2]:

        def measure(batch=batch) -> None:
            kwargs = greedy_call(
                ours.config.vocab_size,
                batch,
                sizes["prompt"],
                sizes["new_tokens"],
                setup.device,
                cache_implementation="static",
            )
            roofline = decode_roofline_seconds(ours.config, setup.peaks, batch, sizes["prompt"], sizes["new_tokens"])
            metric = (
                f"{label} greedy decode, batch {batch}, {sizes['prompt']} + {sizes['new_tokens']} tokens, "
                f"StaticCache: archlab vs {type(stock).__name__}"
            )
            tokens = batch * sizes["new_tokens"]
            generate_row(setup, report, metric, (ours, stock), kwargs, tokens, roofline, cold=True)

        guarded(report, setup, f"{family_name} decode batch {batch}", measure)


CATALOGUE_GOALS = [(r".* greedy decode, batch \d+, .*StaticCache: archlab vs ", "≥ 1.0× (not an issue goal yet)")]


def run(args: argparse.Namespace) -> Report:
    setup = setup_from(args)
    report = new_report(setup, "the catalogue's newest architectures (static cache, each vs its stock model)")
    for family_name in SHAPES:
        guarded(report, setup, family_name, lambda family_name=family_name: catalogue_rows(setup, report, family_name))
    report.notes.append(
        "Each pair built through archlab.conversion from the stock model's random weights; the roofline counts the "
        "weights a step uses (k of the experts per token), the KV cache (latent attention: its latents), a local "
        "layer's window or block of keys at most."
    )
    not_compiled_note(setup, report)
    closing_notes(setup, report)
    return with_goals(report, CATALOGUE_GOALS)


def main(argv: list[str] | None = None) -> int:
    from archlab.scripts import benchmark

    return benchmark.main(["--suite", "cuda-catalogue", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
