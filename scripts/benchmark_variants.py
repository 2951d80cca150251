"""Benchmark suite `variants` (`python scripts/benchmark.py --suite variants`): the catalogue's speed budget.

Two kinds of rows, each measured side by side with the benchmark harness (same weights, same inputs, alternating
order, median of per-round ratios):
- a variant against the Hugging Face model that has it, same weights: Mistral (sliding window), Gemma2 (sandwich
  norm, soft-capping, interleaved layers; eager on both sides), Qwen3 (QK-norm), OLMo 2 (output norms, QK-norm over
  the projections), GPT-NeoX (parallel block, partial rotary) and BLOOM (ALiBi: archlab on sdpa, BLOOM on its
  eager-only path);
- a variant against archlab's own default (the LLaMA recipe), to show what the variant costs: those without a peer,
  and OLMo 2's two fields one at a time (its peer row has both).
A ratio > 1 means the archlab variant is faster than what it is compared with.
"""

from __future__ import annotations

import argparse

import torch

from archlab import DecoderConfig, DecoderForCausalLM
from archlab.scripts.benchmark import SUITE_POSITIONS
from archlab.training.benchmarking import Report, Row, compare_speed, make_optimizer, training_step

# --seq-len is checked against this table size in benchmark.py before a suite runs.
POSITIONS = SUITE_POSITIONS["variants"]


def suite_shape(quick: bool) -> dict:
    if quick:
        return dict(vocab_size=1024, hidden_size=128, num_hidden_layers=2, num_attention_heads=4)
    return dict(vocab_size=8192, hidden_size=512, num_hidden_layers=8, num_attention_heads=8)


def _peers(shape: dict, seq_len: int) -> list[tuple[str, torch.nn.Module, DecoderConfig, callable]]:
    """(label, HF model, equivalent archlab config, state-dict mapping) for each variant with a peer."""
    from transformers import (
        BloomConfig,
        BloomForCausalLM,
        Gemma2Config,
        Gemma2ForCausalLM,
        GPTNeoXConfig,
        GPTNeoXForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Olmo2Config,
        Olmo2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    d, heads = shape["hidden_size"], shape["num_attention_heads"]
    window = max(8, seq_len // 4)
    inter = 8 * d // 3 // 8 * 8
    llama_like = dict(
        **shape, intermediate_size=inter, num_key_value_heads=heads // 4, max_position_embeddings=POSITIONS
    )
    out = []
    mistral = MistralForCausalLM(MistralConfig(**llama_like, sliding_window=window))
    out.append((f"Mistral, sliding window {window}", mistral, DecoderConfig(**llama_like, sliding_window=window), None))
    qwen = Qwen3ForCausalLM(Qwen3Config(**llama_like, head_dim=d // heads))
    out.append(
        (
            "Qwen3, QK-norm",
            qwen,
            DecoderConfig(
                **llama_like, use_qk_norm=True, rms_norm_eps=1e-6, rope_parameters=qwen.config.rope_parameters
            ),
            None,
        )
    )
    olmo2 = Olmo2ForCausalLM(Olmo2Config(**llama_like, eos_token_id=None))  # (its default is past --quick's vocab)
    out.append(
        (
            "OLMo 2, output norms + QK-norm over the projections",
            olmo2,
            DecoderConfig(
                **llama_like,
                norm_position="output",
                use_qk_norm=True,
                qk_norm_scope="projection",
                rms_norm_eps=olmo2.config.rms_norm_eps,
                rope_parameters=olmo2.config.rope_parameters,
            ),
            None,
        )
    )
    gemma = Gemma2ForCausalLM(
        Gemma2Config(**llama_like, head_dim=d // heads, sliding_window=window, attn_implementation="eager")
    )
    out.append(
        (
            "Gemma2, sandwich + soft-cap + local/global (eager both)",
            gemma,
            DecoderConfig(
                **llama_like,
                head_dim=d // heads,
                hidden_act="gelu_pytorch_tanh",
                sliding_window=window,
                layer_types=gemma.config.layer_types,
                query_pre_attn_scalar=gemma.config.query_pre_attn_scalar,
                attn_logit_softcapping=gemma.config.attn_logit_softcapping,
                final_logit_softcapping=gemma.config.final_logit_softcapping,
                norm_type="offset_rms_norm",
                norm_position="sandwich",
                scale_embedding=True,
                tie_word_embeddings=True,
                rope_parameters=gemma.config.rope_parameters,
            ),
            None,
        )
    )
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}
    neox = GPTNeoXForCausalLM(GPTNeoXConfig(**shape, intermediate_size=4 * d, rope_parameters=rope))
    out.append(
        (
            "GPT-NeoX, parallel block + partial rotary",
            neox,
            DecoderConfig(
                **shape,
                intermediate_size=4 * d,
                rope_parameters=rope,
                norm_type="layer_norm",
                norm_position="parallel",
                mlp_type="plain",
                hidden_act="gelu",
                attention_bias=True,
                mlp_bias=True,
                rms_norm_eps=1e-5,
                max_position_embeddings=POSITIONS,
            ),
            _neox_keys,
        )
    )
    bloom = BloomForCausalLM(
        BloomConfig(
            vocab_size=shape["vocab_size"],
            hidden_size=d,
            n_layer=shape["num_hidden_layers"],
            n_head=heads,
            attn_implementation="eager",
        )
    )
    out.append(
        (
            "BLOOM, ALiBi (archlab sdpa vs BLOOM eager)",
            bloom,
            DecoderConfig(
                **shape,
                intermediate_size=4 * d,
                hidden_act="gelu_pytorch_tanh",
                position_embedding_type="alibi",
                norm_type="layer_norm",
                rms_norm_eps=1e-5,
                embedding_layernorm=True,
                mlp_type="plain",
                attention_bias=True,
                mlp_bias=True,
                tie_word_embeddings=True,
                max_position_embeddings=POSITIONS,
            ),
            _bloom_keys,
        )
    )
    return out


SPECIAL_TOKEN_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def peer_pairs(shape: dict, seq_len: int) -> list[tuple[str, DecoderForCausalLM, torch.nn.Module]]:
    """(label, archlab model holding the peer's weights, HF model) for each variant with a peer."""
    pairs = []
    for label, peer, config, mapping in _peers(shape, seq_len):
        # the peer's special tokens: an end-of-sequence id on one side only adds generate's stopping check and
        # `min_new_tokens` processor to that side's every step (Qwen3 and OLMo 2 have none; archlab's default, 2)
        for field in SPECIAL_TOKEN_FIELDS:
            setattr(config, field, getattr(peer.config, field, None))
        torch.manual_seed(0)
        ours = DecoderForCausalLM(config)
        state = peer.state_dict()
        ours.load_state_dict(mapping(state, config) if mapping else state, strict=True)
        pairs.append((label, ours, peer))
    return pairs


def _split_qkv(state: dict, fused_key: str, heads: int, prefix: str) -> None:
    for kind in ("weight", "bias"):
        fused = state.pop(f"{fused_key}.{kind}")
        parts = fused.view(heads, 3, -1, *fused.shape[1:])
        for i, name in enumerate(("q_proj", "k_proj", "v_proj")):
            state[f"{prefix}.{name}.{kind}"] = parts[:, i].reshape(-1, *fused.shape[1:])


def _rename(state: dict, renames: dict[str, str]) -> dict:
    out = {}
    for key, value in state.items():
        for old, new in renames.items():
            key = key.replace(old, new)
        out[key] = value
    return out


def _neox_keys(state: dict, config: DecoderConfig) -> dict:
    state = {k: v for k, v in state.items() if "inv_freq" not in k}
    for i in range(config.num_hidden_layers):
        _split_qkv(
            state,
            f"gpt_neox.layers.{i}.attention.query_key_value",
            config.num_attention_heads,
            f"gpt_neox.layers.{i}.attention",
        )
    return _rename(
        state,
        {
            "gpt_neox.embed_in": "model.embed_tokens",
            "gpt_neox.final_layer_norm": "model.norm",
            "gpt_neox.layers": "model.layers",
            ".attention.dense": ".self_attn.o_proj",
            ".attention.": ".self_attn.",
            "dense_h_to_4h": "up_proj",
            "dense_4h_to_h": "down_proj",
        },
    )


def _bloom_keys(state: dict, config: DecoderConfig) -> dict:
    state = dict(state)
    for i in range(config.num_hidden_layers):
        _split_qkv(
            state,
            f"transformer.h.{i}.self_attention.query_key_value",
            config.num_attention_heads,
            f"transformer.h.{i}.self_attention",
        )
    return _rename(
        state,
        {
            "transformer.word_embeddings_layernorm": "model.embedding_layernorm",
            "transformer.word_embeddings": "model.embed_tokens",
            "transformer.ln_f": "model.norm",
            "transformer.h": "model.layers",
            ".self_attention.dense": ".self_attn.o_proj",
            ".self_attention.": ".self_attn.",
            "dense_h_to_4h": "up_proj",
            "dense_4h_to_h": "down_proj",
        },
    )


AGAINST_DEFAULT = {
    "LayerNorm instead of RMSNorm": dict(norm_type="layer_norm"),
    "post-norm": dict(norm_position="post"),
    "DeepNorm": dict(norm_position="deepnorm"),
    "learned absolute positions": dict(position_embedding_type="learned"),
    "T5 relative bias (sdpa)": dict(position_embedding_type="relative_bias"),
    "prefix-LM mask (no prefix given)": dict(prefix_lm=True),
    "LM z-loss 1e-4": dict(lm_z_loss_coef=1e-4),
    "output norms (OLMo 2)": dict(norm_position="output"),
    "QK-norm over the projections (OLMo 2)": dict(use_qk_norm=True, qk_norm_scope="projection"),
}


def _compare(report: Report, label: str, ours, peer, batch: dict, prompt: torch.Tensor, args, peer_name: str) -> None:
    tokens = batch["input_ids"].numel()
    ours.train(), peer.train()
    opt_a, opt_p = make_optimizer(ours, args.optim), make_optimizer(peer, args.optim)
    t_a, t_p, ratio = compare_speed(training_step(ours, batch, opt_a), training_step(peer, batch, opt_p), args.rounds)
    report.rows.append(Row(f"{label}: training tok/s vs {peer_name}", tokens / t_a, tokens / t_p, ratio, "tok/s"))
    ours.eval(), peer.eval()
    new = 16 if args.quick else min(args.new_tokens, 64)
    kwargs = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    t_a, t_p, ratio = compare_speed(
        lambda: ours.generate(prompt, **kwargs), lambda: peer.generate(prompt, **kwargs), args.rounds
    )
    n = prompt.shape[0] * new
    report.rows.append(Row(f"{label}: generation tok/s vs {peer_name}", n / t_a, n / t_p, ratio, "tok/s"))


def run(args: argparse.Namespace) -> Report:
    shape = suite_shape(args.quick)
    batch_size, seq_len = (2, 64) if args.quick else (args.batch_size, args.seq_len)
    ids = torch.randint(3, shape["vocab_size"], (batch_size, seq_len))
    batch = {"input_ids": ids, "labels": ids}
    prompt = torch.randint(3, shape["vocab_size"], (1, 32))
    report = Report(
        title=f"Catalogue variants — hidden {shape['hidden_size']}, {shape['num_hidden_layers']} layers, "
        f"batch {batch_size}×{seq_len}",
        peer_name="peer",
    )
    for label, ours, peer in peer_pairs(shape, seq_len):
        _compare(report, label, ours, peer, batch, prompt, args, type(peer).__name__)
    base_config = dict(
        **shape,
        intermediate_size=8 * shape["hidden_size"] // 3 // 8 * 8,
        num_key_value_heads=shape["num_attention_heads"] // 4,
        max_position_embeddings=POSITIONS,
    )
    default = DecoderForCausalLM(DecoderConfig(**base_config))
    for label, overrides in AGAINST_DEFAULT.items():
        variant = DecoderForCausalLM(DecoderConfig(**base_config, **overrides))
        _compare(report, label, variant, default, batch, prompt, args, "archlab default")
    report.notes.append(
        f"{args.rounds} rounds, {torch.get_num_threads()} threads; same weights on both sides of every "
        "peer row; the rows against the archlab default compare fresh weights."
    )
    return report


def main(argv: list[str] | None = None) -> int:
    from archlab.scripts.benchmark import main as benchmark_main

    return benchmark_main(["--suite", "variants", *(argv or [])])


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
