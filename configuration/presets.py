"""Named decoder configurations: the shapes of seed 000's Table 5.1 that the catalogue can express, OLMo-2-1B (the
reference model of the output-norm placement and the projection-wide QK-norm), plus tiny and small sizes that train
on a laptop CPU.

A preset is a starting point: `preset_config("mistral-7b", num_hidden_layers=2)` overrides any field. Shapes
(layers, heads, widths, vocabulary, context, norm, positions, activation, block) follow the models' published
configurations; where a model has a detail archlab does not model, `PRESET_NOTES` says what differs (e.g. Qwen
biases only q/k/v, archlab's `attention_bias` also biases the output projection).

    >>> from archlab.configuration import list_presets, preset_config
    >>> config = preset_config("tiny", vocab_size=4096, position_embedding_type="alibi")
"""

from __future__ import annotations

from typing import Any

from ..modeling import DecoderConfig
from ..modeling.configuration_decoder import override_rope


def _rope(theta: float = 10000.0, **extra: Any) -> dict[str, Any]:
    return {"rope_type": "default", "rope_theta": theta, **extra}


# LLaMA-style decoders: pre-RMSNorm, RoPE, SwiGLU, no biases (the DecoderConfig defaults)
_LLAMA = dict(norm_type="rms_norm", norm_position="pre", mlp_type="gated", hidden_act="silu")
# GPT-style decoders: pre-LayerNorm, plain GELU MLP of width 4d, biases everywhere
_GPT = dict(
    norm_type="layer_norm", norm_position="pre", mlp_type="plain", hidden_act="gelu", attention_bias=True, mlp_bias=True
)

PRESETS: dict[str, dict[str, Any]] = {
    # --- laptop sizes (LLaMA recipe) ---
    "tiny": dict(
        _LLAMA,
        vocab_size=8192,
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=352,
        max_position_embeddings=512,
        rope_parameters=_rope(),
    ),
    "small": dict(
        _LLAMA,
        vocab_size=8192,
        hidden_size=512,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        intermediate_size=1376,
        max_position_embeddings=1024,
        rope_parameters=_rope(),
    ),
    # --- Table 5.1, LLaMA family ---
    "llama-2-7b": dict(
        _LLAMA,
        vocab_size=32000,
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        intermediate_size=11008,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        rope_parameters=_rope(),
    ),
    "llama-2-13b": dict(
        _LLAMA,
        vocab_size=32000,
        hidden_size=5120,
        num_hidden_layers=40,
        num_attention_heads=40,
        intermediate_size=13824,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        rope_parameters=_rope(),
    ),
    "llama-2-70b": dict(
        _LLAMA,
        vocab_size=32000,
        hidden_size=8192,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        intermediate_size=28672,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        rope_parameters=_rope(),
    ),
    "mistral-7b": dict(
        _LLAMA,
        vocab_size=32000,
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=14336,
        max_position_embeddings=32768,
        sliding_window=4096,
        rms_norm_eps=1e-5,
        rope_parameters=_rope(),
    ),
    "qwen1.5-7b": dict(
        _LLAMA,
        vocab_size=151936,
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        intermediate_size=11008,
        max_position_embeddings=32768,
        qkv_bias=True,
        rope_parameters=_rope(1e6),
    ),
    "qwen1.5-72b": dict(
        _LLAMA,
        vocab_size=152064,
        hidden_size=8192,
        num_hidden_layers=80,
        num_attention_heads=64,
        intermediate_size=24576,
        max_position_embeddings=32768,
        qkv_bias=True,
        rope_parameters=_rope(1e6),
    ),
    "internlm2-20b": dict(
        _LLAMA,
        vocab_size=92544,
        hidden_size=6144,
        num_hidden_layers=48,
        num_attention_heads=48,
        num_key_value_heads=8,
        intermediate_size=16384,
        max_position_embeddings=32768,
        rms_norm_eps=1e-5,
        rope_parameters=_rope(1e6),
    ),
    "deepseek-7b": dict(
        _LLAMA,
        vocab_size=102400,
        hidden_size=4096,
        num_hidden_layers=30,
        num_attention_heads=32,
        intermediate_size=11008,
        max_position_embeddings=4096,
        rope_parameters=_rope(),
    ),
    "deepseek-67b": dict(
        _LLAMA,
        vocab_size=102400,
        hidden_size=8192,
        num_hidden_layers=95,
        num_attention_heads=64,
        num_key_value_heads=8,
        intermediate_size=22016,
        max_position_embeddings=4096,
        rope_parameters=_rope(),
    ),
    "yi-6b": dict(
        _LLAMA,
        vocab_size=64000,
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=4,
        intermediate_size=11008,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        rope_parameters=_rope(5e6),
    ),
    "yi-34b": dict(
        _LLAMA,
        vocab_size=64000,
        hidden_size=7168,
        num_hidden_layers=60,
        num_attention_heads=56,
        num_key_value_heads=8,
        intermediate_size=20480,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        rope_parameters=_rope(5e6),
    ),
    "yulan-12b": dict(
        _LLAMA,
        vocab_size=51200,
        hidden_size=4864,
        num_hidden_layers=40,
        num_attention_heads=38,
        intermediate_size=13056,
        max_position_embeddings=4096,
        rope_parameters=_rope(),
    ),
    "baichuan2-7b": dict(
        _LLAMA,
        vocab_size=125696,
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        intermediate_size=11008,
        max_position_embeddings=4096,
        rope_parameters=_rope(),
    ),
    "baichuan2-13b": dict(
        _LLAMA,
        vocab_size=125696,
        hidden_size=5120,
        num_hidden_layers=40,
        num_attention_heads=40,
        intermediate_size=13696,
        max_position_embeddings=4096,
        position_embedding_type="alibi",
    ),
    # --- Gemma: GeGLU, (1 + w) RMSNorm, sqrt(d)-scaled tied embeddings ---
    "gemma-7b": dict(
        _LLAMA,
        vocab_size=256000,
        hidden_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        head_dim=256,
        intermediate_size=24576,
        max_position_embeddings=8192,
        hidden_act="gelu_pytorch_tanh",
        norm_type="offset_rms_norm",
        scale_embedding=True,
        tie_word_embeddings=True,
        rope_parameters=_rope(),
    ),
    "gemma-2-9b": dict(
        _LLAMA,
        vocab_size=256000,
        hidden_size=3584,
        num_hidden_layers=42,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=256,
        intermediate_size=14336,
        max_position_embeddings=8192,
        hidden_act="gelu_pytorch_tanh",
        norm_type="offset_rms_norm",
        norm_position="sandwich",
        scale_embedding=True,
        tie_word_embeddings=True,
        query_pre_attn_scalar=256,
        sliding_window=4096,
        layer_types=["sliding_attention", "full_attention"] * 21,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
        rope_parameters=_rope(),
    ),
    # --- OLMo 2: each sub-layer's output normed before the residual add, QK-norm over the whole projections ---
    "olmo-2-1b": dict(
        _LLAMA,
        vocab_size=100352,
        hidden_size=2048,
        num_hidden_layers=16,
        num_attention_heads=16,
        intermediate_size=8192,
        max_position_embeddings=4096,
        norm_position="output",
        use_qk_norm=True,
        qk_norm_scope="projection",
        rope_parameters=_rope(500000.0),
    ),
    # --- DeepSeek-V3 (and R1, Kimi K2's shape with more experts): latent attention, DeepSeek-V3's experts ---
    "deepseek-v3": dict(
        _LLAMA,
        vocab_size=129280,
        hidden_size=7168,
        intermediate_size=18432,
        num_hidden_layers=61,
        num_attention_heads=128,
        max_position_embeddings=163840,
        kv_lora_rank=512,
        q_lora_rank=1536,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 40.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096,
        },
        num_local_experts=256,
        num_experts_per_tok=8,
        moe_intermediate_size=2048,
        mlp_layer_types=["dense"] * 3 + ["sparse"] * 58,
        shared_expert_intermediate_size=2048,
        shared_expert_gate=False,
        router_score_function="sigmoid",
        router_correction_bias=True,
        routed_scaling_factor=2.5,
        router_groups=8,
        router_top_groups=4,
    ),
    # --- GPT-OSS: attention sinks, local and global layers, YaRN; experts with biases and a clamped SwiGLU ---
    "gpt-oss-20b": dict(
        _LLAMA,
        vocab_size=201088,
        hidden_size=2880,
        num_hidden_layers=24,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=64,
        intermediate_size=2880,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        attention_bias=True,
        attention_sinks=True,
        sliding_window=128,
        layer_types=["sliding_attention", "full_attention"] * 12,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
        num_local_experts=32,
        num_experts_per_tok=4,
        router_bias=True,
        expert_bias=True,
        hidden_act="quick_gelu",
        swiglu_limit=7.0,
        swiglu_up_offset=1.0,
    ),
    # --- Llama 4 Scout's text stack: chunked attention with NoPE global layers every fourth, 16 experts top-1 ---
    "llama-4-scout": dict(
        _LLAMA,
        vocab_size=202048,
        hidden_size=5120,
        intermediate_size=16384,
        num_hidden_layers=48,
        num_attention_heads=40,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=10485760,
        rms_norm_eps=1e-5,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 16.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
        },
        attention_chunk_size=8192,
        layer_types=["chunked_attention"] * 3 + ["full_attention"],  # tiled to the depth (`preset_config`)
        nope_layers=[3],  # likewise: every fourth layer, the global ones
        use_qk_norm=True,
        qk_norm_after_rope=True,
        qk_norm_weight=False,
        qk_norm_nope_layers=False,
        attn_temperature_tuning=True,
        floor_scale=8192,
        attn_scale=0.1,
        num_local_experts=16,
        num_experts_per_tok=1,
        moe_intermediate_size=8192,
        shared_expert_intermediate_size=8192,
        shared_expert_gate=False,
        router_score_function="sigmoid",
        norm_topk_prob=False,
        routing_weights_on_input=True,
        router_aux_loss_coef=0.001,
        mlp_layer_types=["sparse"],  # every layer
    ),
    # --- parallel attention + MLP blocks ---
    "pythia-1.4b": dict(
        _GPT,
        vocab_size=50304,
        hidden_size=2048,
        num_hidden_layers=24,
        num_attention_heads=16,
        intermediate_size=8192,
        max_position_embeddings=2048,
        norm_position="parallel",
        rms_norm_eps=1e-5,
        rope_parameters=_rope(partial_rotary_factor=0.25),
    ),
    "pythia-12b": dict(
        _GPT,
        vocab_size=50688,
        hidden_size=5120,
        num_hidden_layers=36,
        num_attention_heads=40,
        intermediate_size=20480,
        max_position_embeddings=2048,
        norm_position="parallel",
        rms_norm_eps=1e-5,
        rope_parameters=_rope(partial_rotary_factor=0.25),
    ),
    "falcon-7b": dict(
        _GPT,
        vocab_size=65024,
        hidden_size=4544,
        num_hidden_layers=32,
        num_attention_heads=71,
        num_key_value_heads=1,
        intermediate_size=18176,
        max_position_embeddings=2048,
        norm_position="parallel_shared_norm",
        attention_bias=False,
        mlp_bias=False,
        rms_norm_eps=1e-5,
        rope_parameters=_rope(),
    ),
    "falcon-180b": dict(
        _GPT,
        vocab_size=65024,
        hidden_size=14848,
        num_hidden_layers=80,
        num_attention_heads=232,
        num_key_value_heads=8,
        intermediate_size=59392,
        max_position_embeddings=2048,
        norm_position="parallel",
        attention_bias=False,
        mlp_bias=False,
        rms_norm_eps=1e-5,
        rope_parameters=_rope(),
    ),
    "palm-540b": dict(
        vocab_size=256000,
        hidden_size=18432,
        num_hidden_layers=118,
        num_attention_heads=48,
        num_key_value_heads=1,
        head_dim=256,
        intermediate_size=73728,
        max_position_embeddings=2048,
        norm_type="layer_norm",
        norm_bias=False,
        norm_position="parallel_shared_norm",
        mlp_type="gated",
        hidden_act="silu",
        tie_word_embeddings=True,
        rope_parameters=_rope(),
    ),
    # --- ALiBi ---
    "bloom-176b": dict(
        _GPT,
        vocab_size=250880,
        hidden_size=14336,
        num_hidden_layers=70,
        num_attention_heads=112,
        intermediate_size=57344,
        max_position_embeddings=2048,
        hidden_act="gelu_pytorch_tanh",
        position_embedding_type="alibi",
        embedding_layernorm=True,
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
    ),
    "mpt-30b": dict(
        _GPT,
        vocab_size=50432,
        hidden_size=7168,
        num_hidden_layers=48,
        num_attention_heads=64,
        intermediate_size=28672,
        max_position_embeddings=8192,
        attention_bias=False,
        mlp_bias=False,
        norm_bias=False,
        position_embedding_type="alibi",
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
    ),
    # --- learned absolute positions ---
    "gpt-3-175b": dict(
        _GPT,
        vocab_size=50257,
        hidden_size=12288,
        num_hidden_layers=96,
        num_attention_heads=96,
        intermediate_size=49152,
        max_position_embeddings=2048,
        position_embedding_type="learned",
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
    ),
    "opt-175b": dict(
        _GPT,
        vocab_size=50272,
        hidden_size=12288,
        num_hidden_layers=96,
        num_attention_heads=96,
        intermediate_size=49152,
        max_position_embeddings=2048,
        position_embedding_type="learned",
        hidden_act="relu",
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
    ),
    "galactica-120b": dict(
        _GPT,
        vocab_size=50000,
        hidden_size=10240,
        num_hidden_layers=96,
        num_attention_heads=80,
        intermediate_size=40960,
        max_position_embeddings=2048,
        position_embedding_type="learned",
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
    ),
    # --- relative position bias ---
    "chinchilla-70b": dict(
        _LLAMA,
        vocab_size=32000,
        hidden_size=8192,
        num_hidden_layers=80,
        num_attention_heads=64,
        intermediate_size=32768,
        max_position_embeddings=2048,
        mlp_type="plain",
        hidden_act="gelu",
        position_embedding_type="relative_bias",
    ),
    # --- DeepNorm + prefix LM ---
    "glm-130b": dict(
        vocab_size=150528,
        hidden_size=12288,
        num_hidden_layers=70,
        num_attention_heads=96,
        intermediate_size=32768,
        max_position_embeddings=2048,
        norm_type="layer_norm",
        norm_position="deepnorm",
        mlp_type="gated",
        hidden_act="gelu",
        attention_bias=True,
        mlp_bias=True,
        prefix_lm=True,
        rms_norm_eps=1e-5,
        rope_parameters=_rope(),
    ),
}

PRESET_NOTES: dict[str, str] = {
    "palm-540b": "PaLM fuses the attention and MLP input projections into one matrix; here they are separate.",
    "chinchilla-70b": "Gopher/Chinchilla use Transformer-XL relative positions; the T5 bucketed bias stands in.",
    "glm-130b": "GLM-130B uses 2D RoPE and blank-infilling; here a 1D-RoPE prefix LM with DeepNorm.",
    "baichuan2-13b": "Baichuan2 normalises its LM head weights (NormHead); archlab uses a plain head.",
    "gemma-7b": "Gemma-7B is multi-head (16 KV heads) with head_dim 256 > hidden_size / heads.",
    "mpt-30b": "MPT clips QKV and uses no biases at all; the clipping is not modelled.",
    "llama-4-scout": "Llama 4 Scout's text stack (107.8 B parameters, 17.2 B active): its vision tower is left out.",
}


def list_presets() -> list[str]:
    """Names accepted by `preset_config`."""
    return list(PRESETS)


def preset_kwargs(name: str) -> dict[str, Any]:
    """A copy of the preset's DecoderConfig keyword arguments."""
    if name not in PRESETS:
        raise ValueError(f"Unknown preset {name!r}; allowed values: {', '.join(map(repr, PRESETS))}.")
    return {
        key: (dict(value) if isinstance(value, dict) else list(value) if isinstance(value, list) else value)
        for key, value in PRESETS[name].items()
    }


def preset_config(name: str, **overrides: Any) -> DecoderConfig:
    """`DecoderConfig` of the named preset with `overrides` applied (validated like any config); a legacy
    `rope_theta` / `rope_scaling` / `partial_rotary_factor` changes the preset's `rope_parameters` (`override_rope`).

    A preset's `layer_types` and `nope_layers` are a pattern repeated to its depth (Gemma-2's local/global pairs,
    Llama 4's three chunked layers and a global NoPE one), and so to an overridden `num_hidden_layers`; one whose
    first layers are dense (`mlp_layer_types`, DeepSeek-V3's three) keeps them dense while a sparse layer remains."""
    kwargs = preset_kwargs(name)
    layers = overrides.get("num_hidden_layers", kwargs["num_hidden_layers"])
    if "nope_layers" in kwargs and "nope_layers" not in overrides:  # listed for the preset's `layer_types`
        period = [index in kwargs["nope_layers"] for index in range(len(kwargs["layer_types"]))]
        kwargs["nope_layers"] = [index for index, nope in enumerate(_repeated(period, layers)) if nope] or None
    if "layer_types" in kwargs and "layer_types" not in overrides:
        kwargs["layer_types"] = _repeated(kwargs["layer_types"], layers)
    if "mlp_layer_types" in kwargs and "mlp_layer_types" not in overrides:
        dense = min(kwargs["mlp_layer_types"].index("sparse"), layers - 1)
        kwargs["mlp_layer_types"] = ["dense"] * dense + ["sparse"] * (layers - dense)
    return DecoderConfig(**override_rope(kwargs, overrides))


def _repeated(pattern: list, layers: int) -> list:
    """`pattern`'s shortest period repeated to `layers` entries."""
    period = next(p for p in range(1, len(pattern) + 1) if all(v == pattern[i % p] for i, v in enumerate(pattern)))
    return [pattern[i % period] for i in range(layers)]


__all__ = ["PRESETS", "PRESET_NOTES", "list_presets", "preset_config", "preset_kwargs"]
