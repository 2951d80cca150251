"""Every family the converter knows, both ways, on tiny stock models with every parameter perturbed.

One parametrised test over the families (and the block variants a flag selects): stock folder -> archlab folder ->
logits within 1e-4 (fp32) of the stock model on a plain and a left-padded batch -> the same greedy generation (and
beam search for the encoder-decoders; BERT: fill-mask logits only) -> archlab -> stock folder holding the very same
tensors, whose model gives bit-identical logits. A config each family cannot express is refused with the fields
named, both ways.
"""

from __future__ import annotations

import inspect
import json
import re
import shutil
import zlib
from pathlib import Path

import pytest
import torch
import transformers
from transformers import (
    AfmoeConfig,
    ApertusConfig,
    ArceeConfig,
    BartConfig,
    BertConfig,
    BitNetConfig,
    BloomConfig,
    Cohere2Config,
    CohereConfig,
    CwmConfig,
    DeepseekV2Config,
    DeepseekV3Config,
    Dots1Config,
    Ernie4_5_MoeConfig,
    Ernie4_5Config,
    Exaone4Config,
    ExaoneConfig,
    ExaoneMoeConfig,
    FalconConfig,
    FlexOlmoConfig,
    Gemma2Config,
    Gemma3TextConfig,
    GemmaConfig,
    Glm4Config,
    Glm4MoeConfig,
    Glm4MoeLiteConfig,
    GlmConfig,
    GPT2Config,
    GPTJConfig,
    GPTNeoXConfig,
    GptOssConfig,
    GraniteConfig,
    GraniteMoeConfig,
    GraniteMoeSharedConfig,
    GraniteSWAConfig,
    HeliumConfig,
    HunYuanDenseV1Config,
    HunYuanMoEV1Config,
    InternLM3Config,
    IQuestCoderConfig,
    Jais2Config,
    Llama4TextConfig,
    LlamaConfig,
    MarianConfig,
    MBartConfig,
    MellumConfig,
    MiniMaxM2Config,
    Ministral3Config,
    MinistralConfig,
    MistralConfig,
    MixtralConfig,
    MptConfig,
    MT5Config,
    NemotronConfig,
    Olmo2Config,
    Olmo3Config,
    OlmoConfig,
    OlmoeConfig,
    OpenAIGPTConfig,
    OPTConfig,
    Phi3Config,
    PhiConfig,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
    RobertaConfig,
    SarvamMLAConfig,
    SeedOssConfig,
    SmolLM3Config,
    SolarOpenConfig,
    StableLmConfig,
    Starcoder2Config,
    T5Config,
    UMT5Config,
    VaultGemmaConfig,
    YoutuConfig,
)
from transformers.models.mbart.modeling_mbart import shift_tokens_right as mbart_shift_tokens_right

from archlab import (
    DecoderForCausalLM,
    DecoderForSequenceClassification,
    EncoderForMaskedLM,
    EncoderForSequenceClassification,
    Seq2SeqForConditionalGeneration,
)
from archlab.conversion import FAMILIES, ConversionError, convert_checkpoint
from archlab.conversion.heads import (
    ENCODER_QUESTION_ANSWERING,
    ENCODER_SEQUENCE_CLASSIFICATION,
    ENCODER_TOKEN_CLASSIFICATION,
    QUESTION_ANSWERING,
    ROBERTA_SEQUENCE_CLASSIFICATION,
    SEQUENCE_CLASSIFICATION,
    TOKEN_CLASSIFICATION,
)

import helpers

ATOL = 1e-4
VOCAB = 101
IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
LLAMA_LIKE = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=64,
    **IDS,
)
GPT_SHAPE = dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, **IDS)
NEOX_SHAPE = {k: v for k, v in LLAMA_LIKE.items() if k not in ("num_key_value_heads", "head_dim")}  # MHA only
QWEN2_SHAPE = {k: v for k, v in LLAMA_LIKE.items() if k != "head_dim"}  # head_dim is hidden / heads
FALCON_SHAPE = dict(
    vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64, **IDS
)
OPT_SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    ffn_dim=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=64,
    pad_token_id=1,
    bos_token_id=2,
    eos_token_id=2,
)
PHI3_LONGROPE = {
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    "short_factor": [1.0, 1.1, 1.2, 1.3],
    "long_factor": [2.0, 3.0, 4.0, 5.0],
}
ROPE_25 = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8,
}
# Gemma3's RoPE per layer type: global layers scaled linearly (Gemma3-4B's recipe), local ones with their own base
GEMMA3_ROPE = {
    "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 2.0},
    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
}
# OLMo 3's long-context recipe: YaRN on the global layers only, the local ones as trained
OLMO3_ROPE = {
    "full_attention": {
        "rope_type": "yarn",
        "rope_theta": 5e5,
        "factor": 8.0,
        "original_max_position_embeddings": 8,
        "attention_factor": 1.2,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
    },
    "sliding_attention": {"rope_type": "default", "rope_theta": 5e5},
}
# Mellum's RoPE per layer type: the global layers with their own base, linearly scaled
MELLUM_ROPE = {
    "full_attention": {"rope_type": "linear", "rope_theta": 5e5, "factor": 2.0},
    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
}
# GPT-OSS's long-context recipe (YaRN, its interpolation ramp not truncated), at this file's lengths
GPT_OSS_YARN = {
    "rope_type": "yarn",
    "rope_theta": 1.5e5,
    "factor": 4.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 16,
}
# multi-head latent attention's sizes (DeepSeek-V2/V3, GLM-4.7-Flash) and DeepSeek's experts, at this file's shape
LATENT_ATTENTION = dict(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6)
DEEPSEEK_EXPERTS = dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
# DeepSeek-V3's YaRN, with the attention scale of its `mscale_all_dim`
DEEPSEEK_YARN = {
    "rope_type": "yarn",
    "rope_theta": 1e4,
    "factor": 4.0,
    "original_max_position_embeddings": 16,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}
# Hunyuan's NTK-alpha RoPE: the base stretched once by alpha^(d / (d - 2))
HUNYUAN_NTK_ALPHA = {"rope_type": "dynamic", "rope_theta": 1e4, "alpha": 50.0, "factor": 1.0}
# Granite 3's μP constants (granite-3.0-2b: logits divided by 8)
GRANITE_MULTIPLIERS = dict(
    embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.015625, logits_scaling=8.0
)
SEQ2SEQ_SHAPE = dict(
    vocab_size=VOCAB,
    d_model=32,
    encoder_layers=2,
    decoder_layers=2,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=48,
    decoder_ffn_dim=48,
    max_position_embeddings=64,
    dropout=0.0,
)
# the T5 reference shape of tests/helpers.py (d_kv * num_heads != d_model), at this file's vocabulary
T5_SHAPE = dict(helpers.T5_SHAPE, vocab_size=VOCAB)

# case id -> (stock config, the archlab values the conversion must turn on)
CASES = {
    "llama": (
        LlamaConfig(**LLAMA_LIKE, attention_bias=True, mlp_bias=True),
        {"attention_bias": True, "mlp_bias": True, "norm_position": "pre"},
    ),
    "mistral": (
        MistralConfig(**LLAMA_LIKE, sliding_window=4),
        {"sliding_window": 4, "layer_types": ["sliding_attention"] * 2},
    ),
    "mixtral": (
        MixtralConfig(**LLAMA_LIKE, num_local_experts=4, num_experts_per_tok=2),
        {"num_local_experts": 4, "mlp_layer_types": ["sparse"] * 2, "norm_topk_prob": True},
    ),
    "qwen2": (
        Qwen2Config(**QWEN2_SHAPE, use_sliding_window=True, sliding_window=4, max_window_layers=1),
        {"qkv_bias": True, "attention_bias": False, "layer_types": ["full_attention", "sliding_attention"]},
    ),
    "qwen2_moe": (
        Qwen2MoeConfig(
            **{**QWEN2_SHAPE, "num_hidden_layers": 3},
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=24,
            mlp_only_layers=[1],
        ),
        {
            "mlp_layer_types": ["sparse", "dense", "sparse"],
            "num_local_experts": 4,
            "qkv_bias": True,
            "norm_topk_prob": False,
            "moe_intermediate_size": 16,
            "shared_expert_intermediate_size": 24,
        },
    ),
    # a head size config.json gives (Qwen2Config has no such field; its attention and RoPE read it), 16 != 32 / 4
    "qwen2-head-size": (Qwen2Config(**QWEN2_SHAPE, head_dim=16), {"head_dim": 16, "hidden_size": 32}),
    "qwen2_moe-head-size": (
        Qwen2MoeConfig(
            **QWEN2_SHAPE,
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=24,
        ),
        {"head_dim": 16, "mlp_layer_types": ["sparse"] * 2},
    ),
    "qwen3": (
        Qwen3Config(
            **{**LLAMA_LIKE, "head_dim": 16},
            attention_bias=True,
            use_sliding_window=True,
            sliding_window=4,
            max_window_layers=1,
        ),
        {"use_qk_norm": True, "layer_types": ["full_attention", "sliding_attention"]},
    ),
    # a head size config.json gives (Qwen3MoeConfig has no such field; its attention reads it), a dense layer
    # between sparse ones, a window on every layer, biases on q/k/v/o
    "qwen3_moe": (
        Qwen3MoeConfig(
            **{**QWEN2_SHAPE, "num_hidden_layers": 3},
            head_dim=16,
            attention_bias=True,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            norm_topk_prob=True,
            mlp_only_layers=[1],
            use_sliding_window=True,
            sliding_window=4,
        ),
        {
            "head_dim": 16,
            "use_qk_norm": True,
            "attention_bias": True,
            "mlp_layer_types": ["sparse", "dense", "sparse"],
            "num_local_experts": 4,
            "shared_expert_intermediate_size": 0,
            "norm_topk_prob": True,
            "layer_types": ["sliding_attention"] * 3,
        },
    ),
    # each sub-layer's output normed, QK-norm over the whole projections; a head size config.json gives (Olmo2Config
    # has no such field; its attention and RoPE read it), biases on q/k/v/o
    "olmo2": (
        Olmo2Config(**{**LLAMA_LIKE, "head_dim": 16}, attention_bias=True),
        {
            "norm_position": "output",
            "use_qk_norm": True,
            "qk_norm_scope": "projection",
            "head_dim": 16,
            "attention_bias": True,
        },
    ),
    # SmolLM3: the second of two layers NoPE (`no_rope_layer_interval=2`), a head size config.json gives
    "smollm3": (
        SmolLM3Config(**{**QWEN2_SHAPE, "head_dim": 16}, no_rope_layer_interval=2),
        {"nope_layers": [1], "head_dim": 16, "sliding_window": None},
    ),
    # with Qwen2's window on its NoPE layers (SmolLM3's `layer_types` when `use_sliding_window` is set)
    "smollm3-sliding": (
        SmolLM3Config(**QWEN2_SHAPE, no_rope_layer_interval=2, use_sliding_window=True, sliding_window=4),
        {"nope_layers": [1], "sliding_window": 4, "layer_types": ["full_attention", "sliding_attention"]},
    ),
    # Ministral: a local layer then a global one
    "ministral": (
        MinistralConfig(**LLAMA_LIKE, sliding_window=4, layer_types=["sliding_attention", "full_attention"]),
        {"sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"]},
    ),
    # Ministral 3: YaRN, the queries scaled after RoPE by 1 + β · log(1 + floor(p / 4)) (steps inside the batches)
    "ministral3": (
        Ministral3Config(
            **LLAMA_LIKE,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 1e6,
                "factor": 16.0,
                "original_max_position_embeddings": 4,
                "max_position_embeddings": 64,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
                "llama_4_scaling_beta": 0.5,
            },
        ),
        {"query_scaling_beta": 0.5, "query_scaling_length": 4},
    ),
    # Arcee: a plain ReLU² MLP
    "arcee": (ArceeConfig(**LLAMA_LIKE, mlp_bias=True), {"mlp_type": "plain", "hidden_act": "relu2", "mlp_bias": True}),
    # BitNet's architecture in floating point: Sub-LN before o_proj and down_proj, a ReLU² gated MLP
    "bitnet": (
        BitNetConfig(**{k: v for k, v in LLAMA_LIKE.items() if k != "head_dim"}, attention_bias=True),
        {"sub_layer_norm": True, "hidden_act": "relu2", "attention_bias": True, "mlp_type": "gated"},
    ),
    # Seed-OSS: biases on q/k/v, none on the output projection
    "seed_oss": (
        SeedOssConfig(**LLAMA_LIKE, attention_bias=True, attention_out_bias=False),
        {"qkv_bias": True, "attention_bias": False},
    ),
    # GLM: interleaved RoPE over half of each head, fused gate/up, biases on q/k/v; GLM-4 adds the sandwich norms
    "glm": (GlmConfig(**LLAMA_LIKE), {"qkv_bias": True, "attention_bias": False}),
    "glm4": (
        Glm4Config(**{**LLAMA_LIKE, "head_dim": 16}, attention_bias=False),
        {"norm_position": "sandwich", "qkv_bias": False, "head_dim": 16},
    ),
    # Helium: interleaved RoPE, biases on q/k/v only
    "helium": (HeliumConfig(**LLAMA_LIKE, attention_bias=True), {"qkv_bias": True, "attention_bias": False}),
    # EXAONE 4: output norms, QK-norm per head; with a window its global layer is NoPE, without one every layer rotates
    "exaone4": (
        Exaone4Config(**{**QWEN2_SHAPE, "head_dim": 16}, sliding_window=4, sliding_window_pattern=2),
        {
            "norm_position": "output",
            "use_qk_norm": True,
            "qk_norm_scope": "head",
            "layer_types": ["sliding_attention", "full_attention"],
            "nope_layers": [1],
            "head_dim": 16,
        },
    ),
    "exaone4-global": (
        # (its layer types given: Exaone4Config derives them by `i % 0` without a window)
        Exaone4Config(**QWEN2_SHAPE, sliding_window=None, layer_types=["full_attention"] * 2),
        {"nope_layers": None, "sliding_window": None, "layer_types": ["full_attention"] * 2},
    ),
    # OLMo 3: OLMo 2's block, local layers with a window of 4, the global layers' RoPE scaled (sets per layer type)
    "olmo3": (
        Olmo3Config(
            **{**LLAMA_LIKE, "head_dim": 16},
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters=OLMO3_ROPE,
        ),
        {
            "norm_position": "output",
            "qk_norm_scope": "projection",
            "sliding_window": 4,
            "layer_types": ["sliding_attention", "full_attention"],
            "rope_parameters": OLMO3_ROPE,
        },
    ),
    # GLM-4.5: a dense layer then sparse ones, DeepSeek-V3's sigmoid router with its correction bias and a routed
    # scale, an ungated shared expert twice an expert's width, QK-norm per head, rotate-half RoPE over half of each head
    "glm4_moe": (
        Glm4MoeConfig(
            **{**QWEN2_SHAPE, "num_hidden_layers": 3, "head_dim": 16},
            attention_bias=True,
            use_qk_norm=True,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            n_shared_experts=2,
            routed_scaling_factor=2.5,
            first_k_dense_replace=1,
        ),
        {
            "router_score_function": "sigmoid",
            "router_correction_bias": True,
            "routed_scaling_factor": 2.5,
            "mlp_layer_types": ["dense", "sparse", "sparse"],
            "shared_expert_intermediate_size": 32,
            "shared_expert_gate": False,
            "qkv_bias": True,
            "attention_bias": False,
            "head_dim": 16,
        },
    ),
    # dots.llm1: Qwen3's attention (biases on q/k/v/o), a dense layer then sparse ones with DeepSeek-V3's router, the
    # top-k weights not renormalised, a local layer (`max_window_layers`)
    "dots1": (
        Dots1Config(
            **{**QWEN2_SHAPE, "num_hidden_layers": 3},
            attention_bias=True,
            n_routed_experts=4,
            n_shared_experts=1,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            first_k_dense_replace=1,
            routed_scaling_factor=1.5,
            sliding_window=4,
            max_window_layers=2,
        ),
        {
            "use_qk_norm": True,
            "mlp_layer_types": ["dense", "sparse", "sparse"],
            "norm_topk_prob": False,
            "layer_types": ["full_attention", "full_attention", "sliding_attention"],
            "shared_expert_intermediate_size": 16,
        },
    ),
    # dots.llm1 with DeepSeek-V3's group-limited routing: 8 experts in 4 groups, a token's 2 from its best 2 groups
    "dots1-groups": (
        Dots1Config(
            **{**QWEN2_SHAPE, "num_hidden_layers": 2},
            n_routed_experts=8,
            n_shared_experts=1,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            first_k_dense_replace=0,
            n_group=4,
            topk_group=2,
        ),
        {"router_groups": 4, "router_top_groups": 2, "mlp_layer_types": ["sparse", "sparse"]},
    ),
    # Solar Open: Llama's attention (q/k/v biases), every layer sparse with DeepSeek-V3's router, a head size of 16
    "solar_open": (
        SolarOpenConfig(
            **{**QWEN2_SHAPE, "head_dim": 16},
            attention_bias=True,
            n_routed_experts=4,
            n_shared_experts=2,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
        ),
        {"mlp_layer_types": ["sparse"] * 2, "qkv_bias": True, "head_dim": 16, "router_correction_bias": True},
    ),
    # MiniMax-M2: QK-norm over the projections, RoPE over half of each head, every layer Mixtral's experts with
    # DeepSeek-V3's router (renormalised, no shared expert)
    "minimax_m2": (
        MiniMaxM2Config(
            **{**LLAMA_LIKE, "head_dim": 16},
            num_local_experts=4,
            num_experts_per_tok=2,
            rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
        ),
        {
            "qk_norm_scope": "projection",
            "router_score_function": "sigmoid",
            "router_correction_bias": True,
            "mlp_layer_types": ["sparse"] * 2,
            "moe_intermediate_size": 64,
        },
    ),
    # EXAONE-MoE: EXAONE 4's attention (a local layer, a NoPE global one) and DeepSeek-V3's experts after a dense layer
    "exaone_moe": (
        ExaoneMoeConfig(
            **{**QWEN2_SHAPE, "num_hidden_layers": 3, "head_dim": 16},
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            num_shared_experts=1,
            first_k_dense_replace=1,
        ),
        {
            "nope_layers": [1],
            "mlp_layer_types": ["dense", "sparse", "sparse"],
            "routed_scaling_factor": 2.5,
            "shared_expert_intermediate_size": 16,
            "use_qk_norm": True,
        },
    ),
    # AFMoE: sandwich norms, gated attention, QK-norm per head, a local layer (the only ones that rotate) and a global
    # one, a dense layer then sparse ones with DeepSeek-V3's router, embeddings scaled by √d (`mup_enabled`)
    "afmoe": (
        AfmoeConfig(
            **{**LLAMA_LIKE, "num_hidden_layers": 3, "head_dim": 16},
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            num_shared_experts=1,
            num_dense_layers=1,
            route_scale=2.0,
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            mup_enabled=True,
            attention_bias=True,
        ),
        {
            "norm_position": "sandwich",
            "attention_output_gate": "elementwise",
            "nope_layers": [1],
            "mlp_layer_types": ["dense", "sparse", "sparse"],
            "routed_scaling_factor": 2.0,
            "scale_embedding": True,
        },
    ),
    # Hunyuan: QK-norm per head after RoPE, RoPE's base stretched by an NTK alpha (its "dynamic" type with an alpha)
    "hunyuan_v1_dense": (
        HunYuanDenseV1Config(**LLAMA_LIKE, attention_bias=True, rope_parameters=HUNYUAN_NTK_ALPHA),
        {"use_qk_norm": True, "qk_norm_after_rope": True, "attention_bias": True},
    ),
    # Hunyuan-MoE: every layer sparse (softmax, renormalised top-k), an ungated shared expert as wide as an expert
    "hunyuan_v1_moe": (
        HunYuanMoEV1Config(**LLAMA_LIKE, num_experts=4, moe_topk=2),
        {
            "qk_norm_after_rope": True,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "shared_expert_intermediate_size": 64,
            "shared_expert_gate": False,
        },
    ),
    # GPT-OSS: attention sinks and biases, a local then a global layer, YaRN; a router with a bias, experts with
    # biases and the clamped SwiGLU with up + 1 (a limit of 1: the clamps bite at these weights)
    "gpt_oss": (
        GptOssConfig(
            **LLAMA_LIKE,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=4,
            swiglu_limit=1.0,
            rope_parameters=GPT_OSS_YARN,
        ),
        {
            "attention_sinks": True,
            "router_bias": True,
            "expert_bias": True,
            "hidden_act": "quick_gelu",
            "swiglu_limit": 1.0,
            "swiglu_up_offset": 1.0,
            "layer_types": ["sliding_attention", "full_attention"],
            "moe_intermediate_size": 64,
            "rope_parameters": GPT_OSS_YARN,
        },
    ),
    # Llama 4's text stack: chunked attention on the rotating layers (interleaved RoPE, llama3 scaling, a QK-norm
    # without a gain after it), every other layer NoPE with the temperature tuning (a floor scale of 4: it bites within
    # the 12-token batches), experts on every other layer (sigmoid of the top-1 logit times the expert's input, a
    # shared expert); the dense layers of their own width
    "llama4_text": (
        Llama4TextConfig(
            **{**LLAMA_LIKE, "num_hidden_layers": 4},
            intermediate_size_mlp=48,
            num_local_experts=4,
            num_experts_per_tok=1,
            interleave_moe_layer_step=2,
            no_rope_layer_interval=2,
            attention_chunk_size=4,
            floor_scale=4,
            attn_scale=0.5,
            rope_parameters=LLAMA3_ROPE,
        ),
        {
            "layer_types": ["chunked_attention", "full_attention"] * 2,
            "attention_chunk_size": 4,
            "nope_layers": [1, 3],
            "mlp_layer_types": ["dense", "sparse"] * 2,
            "intermediate_size": 48,
            "moe_intermediate_size": 64,
            "shared_expert_intermediate_size": 64,
            "qk_norm_weight": False,
            "qk_norm_nope_layers": False,
            "attn_temperature_tuning": True,
            "routing_weights_on_input": True,
        },
    ),
    # DeepSeek-V3: multi-head latent attention (queries through their own latent, interleaved RoPE, YaRN with its
    # attention mscale, biases on the latents and the output), a dense layer then DeepSeek-V3's experts with
    # group-limited routing and a shared expert; its multi-token-prediction layer is not in a stock save
    "deepseek_v3": (
        DeepseekV3Config(
            **{
                **{k: v for k, v in LLAMA_LIKE.items() if k != "head_dim"},
                "num_hidden_layers": 3,
                "num_key_value_heads": 4,
            },
            **LATENT_ATTENTION,
            q_lora_rank=12,
            **DEEPSEEK_EXPERTS,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=2,
            topk_group=1,
            attention_bias=True,
            rope_parameters=DEEPSEEK_YARN,
        ),
        {
            "kv_lora_rank": 16,
            "q_lora_rank": 12,
            "head_dim": 4,
            "v_head_dim": 6,
            "mlp_layer_types": ["dense", "sparse", "sparse"],
            "router_score_function": "sigmoid",
            "router_groups": 2,
            "router_top_groups": 1,
            "shared_expert_intermediate_size": 16,
            "rope_parameters": DEEPSEEK_YARN,
        },
    ),
    # Sarvam-105B: DeepSeek-V3 under its own config class
    "sarvam_mla": (
        SarvamMLAConfig(
            **{
                **{k: v for k, v in LLAMA_LIKE.items() if k != "head_dim"},
                "num_hidden_layers": 3,
                "num_key_value_heads": 4,
            },
            **LATENT_ATTENTION,
            **DEEPSEEK_EXPERTS,
            n_shared_experts=1,
            first_k_dense_replace=1,
            rope_parameters=DEEPSEEK_YARN,
        ),
        {"kv_lora_rank": 16, "mlp_layer_types": ["dense", "sparse", "sparse"], "router_score_function": "sigmoid"},
    ),
    # Youtu-LLM: DeepSeek-V3's attention (interleaved RoPE, a query latent) in Llama's block, dense MLPs; no pad id,
    # as Youtu's (transformers' Youtu zeroes a pad id's embedding row whenever it loads one)
    "youtu": (
        YoutuConfig(
            **{
                **{k: v for k, v in LLAMA_LIKE.items() if k != "head_dim"},
                "num_key_value_heads": 4,
                "pad_token_id": None,
            },
            **LATENT_ATTENTION,
            q_lora_rank=12,
            rope_parameters=DEEPSEEK_YARN,
        ),
        {"kv_lora_rank": 16, "q_lora_rank": 12, "mlp_layer_types": ["dense", "dense"]},
    ),
    # DeepSeek-V2 (V2-Lite's form): latent attention with one query projection, interleaved RoPE; a dense layer then
    # DeepSeek-V2's experts (softmax, greedy, not renormalised, scaled) with two shared experts
    "deepseek_v2": (
        DeepseekV2Config(
            **{**QWEN2_SHAPE, "num_hidden_layers": 3, "num_key_value_heads": 4},
            **LATENT_ATTENTION,
            q_lora_rank=None,
            **DEEPSEEK_EXPERTS,
            n_shared_experts=2,
            first_k_dense_replace=1,
            routed_scaling_factor=1.5,
        ),
        {
            "kv_lora_rank": 16,
            "q_lora_rank": None,
            "mlp_layer_types": ["dense", "sparse", "sparse"],
            "router_score_function": "softmax",
            "norm_topk_prob": False,
            "routed_scaling_factor": 1.5,
            "shared_expert_intermediate_size": 32,
        },
    ),
    # DeepSeek-V2 itself: group-limited greedy routing, a group scored by its best expert (8 experts in 4 groups, the
    # best 2 groups kept)
    "deepseek_v2-group-limited": (
        DeepseekV2Config(
            **{**QWEN2_SHAPE, "num_hidden_layers": 2, "num_key_value_heads": 4},
            **LATENT_ATTENTION,
            q_lora_rank=None,
            **{**DEEPSEEK_EXPERTS, "n_routed_experts": 8},
            n_shared_experts=1,
            first_k_dense_replace=0,
            n_group=4,
            topk_group=2,
            topk_method="group_limited_greedy",
        ),
        {"router_groups": 4, "router_top_groups": 2, "router_group_score": "max", "num_local_experts": 8},
    ),
    # GLM-4.7-Flash: DeepSeek-V3's latent attention with GLM-4.5's experts, a sparse layer between dense ones
    "glm4_moe_lite": (
        Glm4MoeLiteConfig(
            **{**QWEN2_SHAPE, "num_hidden_layers": 3, "num_key_value_heads": 4},
            **LATENT_ATTENTION,
            q_lora_rank=12,
            **DEEPSEEK_EXPERTS,
            n_shared_experts=1,
            mlp_layer_types=["dense", "sparse", "dense"],
        ),
        {
            "kv_lora_rank": 16,
            "head_dim": 4,
            "mlp_layer_types": ["dense", "sparse", "dense"],
            "router_score_function": "sigmoid",
        },
    ),
    # Apertus: a plain MLP with xIELU (its α learned per layer), QK-norm per head, llama3 RoPE scaling
    "apertus": (
        ApertusConfig(**QWEN2_SHAPE),
        {"mlp_type": "plain", "hidden_act": "xielu", "use_qk_norm": True},
    ),
    # Mellum: a local layer and a dense MLP, then a global layer with experts; RoPE per layer type
    "mellum": (
        MellumConfig(
            **{**LLAMA_LIKE, "head_dim": 16},
            attention_bias=True,
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention"],
            mlp_layer_types=["dense", "sparse"],
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            rope_parameters=MELLUM_ROPE,
        ),
        {
            "use_qk_norm": True,
            "mlp_layer_types": ["dense", "sparse"],
            "layer_types": ["sliding_attention", "full_attention"],
            "rope_parameters": MELLUM_ROPE,
            "attention_bias": True,
        },
    ),
    # Granite: μP's four constants (Granite 3's values), a head size config.json gives (GraniteConfig has no field)
    "granite": (
        GraniteConfig(**{**QWEN2_SHAPE, "head_dim": 16}, mlp_bias=True, **GRANITE_MULTIPLIERS),
        {
            "embedding_multiplier": 12.0,
            "residual_multiplier": 0.22,
            "attention_multiplier": 0.015625,
            "logit_scale": 0.125,
            "head_dim": 16,
        },
    ),
    # Granite SWA: a NoPE global layer and a rotating local one, a sink per head
    "granite_swa": (
        GraniteSWAConfig(
            **QWEN2_SHAPE,
            **GRANITE_MULTIPLIERS,
            sliding_window=4,
            layer_types=["full_attention", "sliding_attention"],
            layer_rope_theta=[0, 1e4],
        ),
        {"attention_sinks": True, "nope_layers": [0], "sliding_window": 4, "logit_scale": 0.125},
    ),
    # and a base per layer type (both layers rotating)
    "granite_swa-bases": (
        GraniteSWAConfig(
            **QWEN2_SHAPE,
            sliding_window=4,
            layer_types=["full_attention", "sliding_attention"],
            layer_rope_theta=[1e6, 1e4],
        ),
        {
            "nope_layers": None,
            "rope_parameters": {
                "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
        },
    ),
    "granitemoe": (
        GraniteMoeConfig(**QWEN2_SHAPE, num_local_experts=4, num_experts_per_tok=2, **GRANITE_MULTIPLIERS),
        {"mlp_layer_types": ["sparse"] * 2, "moe_intermediate_size": 64, "norm_topk_prob": True, "logit_scale": 0.125},
    ),
    "granitemoeshared": (
        GraniteMoeSharedConfig(
            **QWEN2_SHAPE,
            num_local_experts=4,
            num_experts_per_tok=2,
            shared_intermediate_size=24,
            **GRANITE_MULTIPLIERS,
        ),
        {"shared_expert_intermediate_size": 24, "shared_expert_gate": False, "residual_multiplier": 0.22},
    ),
    # Cohere: one LayerNorm (no bias) for a parallel attention and MLP, interleaved RoPE, a logit scale, q/k/v/o biases
    "cohere": (
        CohereConfig(**QWEN2_SHAPE, attention_bias=True, logit_scale=0.25, tie_word_embeddings=False),
        {
            "norm_position": "parallel_shared_norm",
            "norm_type": "layer_norm",
            "norm_bias": False,
            "logit_scale": 0.25,
            "attention_bias": True,
        },
    ),
    # Command R+'s QK-norm: a LayerNorm per head with a gain per head and channel, its channels reordered with q/k's
    "cohere-qk-norm": (
        CohereConfig(**{**QWEN2_SHAPE, "head_dim": 16}, use_qk_norm=True),
        {"use_qk_norm": True, "qk_norm_scope": "per_head", "head_dim": 16},
    ),
    # Cohere2: a local layer (the only one that rotates) and a global one, tied embeddings
    "cohere2": (
        Cohere2Config(**QWEN2_SHAPE, sliding_window=4, layer_types=["sliding_attention", "full_attention"]),
        {"nope_layers": [1], "layer_types": ["sliding_attention", "full_attention"], "logit_scale": 0.0625},
    ),
    # OLMoE: QK-norm over the projections, every layer a mixture of experts with unrenormalised top-k weights
    "olmoe": (
        OlmoeConfig(**QWEN2_SHAPE, num_experts=4, num_experts_per_tok=2),
        {
            "qk_norm_scope": "projection",
            "mlp_layer_types": ["sparse"] * 2,
            "num_local_experts": 4,
            "norm_topk_prob": False,
            "moe_intermediate_size": 64,
        },
    ),
    # FlexOlmo: OLMoE's with OLMo 2's output norms, renormalised top-k weights, a head size config.json gives
    "flex_olmo": (
        FlexOlmoConfig(**{**QWEN2_SHAPE, "head_dim": 16}, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True),
        {"norm_position": "output", "use_qk_norm": True, "norm_topk_prob": True, "head_dim": 16},
    ),
    # CWM: a local layer and a global one, llama3 RoPE scaling
    "cwm": (
        CwmConfig(**LLAMA_LIKE, sliding_window=4, layer_types=["sliding_attention", "full_attention"]),
        {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 4},
    ),
    # ERNIE 4.5: interleaved RoPE, a bias on every projection (`use_bias`)
    "ernie4_5": (
        Ernie4_5Config(**LLAMA_LIKE, use_bias=True),
        {"attention_bias": True, "mlp_bias": True, "tie_word_embeddings": True},
    ),
    # ERNIE 4.5 MoE: biases everywhere (the LM head too), sparse layers 1 and 3 of 4 (every second from the second), a
    # softmax router choosing with a correction bias, a shared expert
    "ernie4_5_moe": (
        Ernie4_5_MoeConfig(
            **{**QWEN2_SHAPE, "num_hidden_layers": 4},
            use_bias=True,
            moe_num_experts=4,
            moe_k=2,
            moe_intermediate_size=16,
            moe_num_shared_experts=1,
            moe_layer_start_index=1,
            moe_layer_interval=2,
        ),
        {
            "mlp_layer_types": ["dense", "sparse", "dense", "sparse"],
            "router_correction_bias": True,
            "router_score_function": "softmax",
            "lm_head_bias": True,
            "shared_expert_intermediate_size": 16,
        },
    ),
    # Jais 2: LayerNorm with biases, a plain ReLU² MLP with biases, biases on q/k/v/o
    "jais2": (
        Jais2Config(**LLAMA_LIKE),
        {"norm_type": "layer_norm", "norm_bias": True, "mlp_type": "plain", "hidden_act": "relu2", "mlp_bias": True},
    ),
    # OLMo: LayerNorms without gain or bias (archlab's gains of ones), q/k/v/o biases
    "olmo": (
        OlmoConfig(**QWEN2_SHAPE, attention_bias=True),
        {"norm_type": "layer_norm", "norm_bias": False, "rms_norm_eps": 1e-5, "attention_bias": True},
    ),
    # Nemotron: LayerNorm1P ((1 + w) gain, bias), ReLU² MLP, RoPE over half of each head, q/k/v/o and MLP biases
    "nemotron": (
        NemotronConfig(
            **LLAMA_LIKE,
            attention_bias=True,
            mlp_bias=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
        ),
        {"norm_type": "offset_layer_norm", "norm_bias": True, "mlp_type": "plain", "hidden_act": "relu2"},
    ),
    # InternLM3: Llama under its own model_type, its attention and MLP biases one setting
    "internlm3": (
        InternLM3Config(**LLAMA_LIKE, attention_bias=True, mlp_bias=True),
        {"attention_bias": True, "mlp_bias": True, "norm_position": "pre"},
    ),
    # IQuest-Coder: Llama under its own model_type
    "iquestcoder": (IQuestCoderConfig(**LLAMA_LIKE), {"attention_bias": False, "norm_position": "pre"}),
    # EXAONE 3.0 / 3.5: Llama under GPT-2's tensor names (transformers saves them so)
    "exaone": (ExaoneConfig(**LLAMA_LIKE, attention_bias=True), {"attention_bias": True, "norm_position": "pre"}),
    # VaultGemma: Gemma2 as a pre-norm block (no norms after the sub-layers), soft-capping, a local and a global layer
    "vaultgemma": (
        VaultGemmaConfig(
            **{**LLAMA_LIKE, "head_dim": 16},
            query_pre_attn_scalar=16,
            sliding_window=4,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=3.0,
        ),
        {"norm_position": "pre", "layer_types": ["sliding_attention", "full_attention"]},
    ),
    "gemma": (
        GemmaConfig(**LLAMA_LIKE, attention_bias=True),
        {"norm_type": "offset_rms_norm", "scale_embedding": True},
    ),
    "gemma2": (
        Gemma2Config(
            **LLAMA_LIKE,
            query_pre_attn_scalar=16,
            sliding_window=4,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=3.0,
        ),
        {"norm_position": "sandwich", "layer_types": ["sliding_attention", "full_attention"]},
    ),
    # a window of 4 on the local layer (the batches are 12 tokens long), a head size other than hidden / heads
    "gemma3_text": (
        Gemma3TextConfig(
            **{**LLAMA_LIKE, "head_dim": 16},
            query_pre_attn_scalar=16,
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters=GEMMA3_ROPE,
            final_logit_softcapping=3.0,
        ),
        {
            "norm_position": "sandwich",
            "norm_type": "offset_rms_norm",
            "use_qk_norm": True,
            "scale_embedding": True,
            "head_dim": 16,
            "layer_types": ["sliding_attention", "full_attention"],
            "rope_parameters": GEMMA3_ROPE,
        },
    ),
    "gpt_neox": (
        GPTNeoXConfig(**NEOX_SHAPE, rope_parameters=ROPE_25),
        {"norm_position": "parallel", "norm_type": "layer_norm", "mlp_type": "plain"},
    ),
    "gpt_neox-sequential": (
        GPTNeoXConfig(**NEOX_SHAPE, rope_parameters=ROPE_25, use_parallel_residual=False),
        {"norm_position": "pre"},
    ),
    "falcon": (
        FalconConfig(**FALCON_SHAPE, num_kv_heads=2, new_decoder_architecture=True, bias=True, ffn_hidden_size=48),
        {"norm_position": "parallel", "num_key_value_heads": 2, "attention_bias": True},
    ),
    "falcon-one-norm": (
        FalconConfig(**FALCON_SHAPE, num_kv_heads=2, new_decoder_architecture=True, num_ln_in_parallel_attn=1),
        {"norm_position": "parallel_shared_norm", "num_key_value_heads": 2},
    ),
    "falcon-7b": (
        FalconConfig(**FALCON_SHAPE, multi_query=True, parallel_attn=True),  # the old architecture
        {"norm_position": "parallel_shared_norm", "num_key_value_heads": 1},
    ),
    "falcon-sequential-mqa": (
        FalconConfig(**FALCON_SHAPE, multi_query=True, parallel_attn=False),
        {"norm_position": "pre", "num_key_value_heads": 1, "attention_bias": False},
    ),
    "bloom": (
        BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4, **IDS),
        {"position_embedding_type": "alibi", "embedding_layernorm": True, "intermediate_size": 128},
    ),
    "mpt": (
        MptConfig(
            vocab_size=VOCAB,
            d_model=48,
            n_heads=6,
            n_layers=2,
            max_seq_len=64,
            attn_config={"softmax_scale": 0.3},
            **IDS,
        ),
        {"position_embedding_type": "alibi", "norm_bias": False, "attention_bias": False, "num_attention_heads": 6},
    ),
    "opt": (
        OPTConfig(**OPT_SHAPE),
        {
            "norm_position": "pre",
            "position_embedding_offset": 2,
            "position_ids_from_attention_mask": True,
            "hidden_act": "relu",
            "tie_word_embeddings": True,
        },
    ),
    "opt-post-norm": (
        OPTConfig(**OPT_SHAPE, do_layer_norm_before=False, enable_bias=False, tie_word_embeddings=False),
        {"norm_position": "post", "attention_bias": False, "mlp_bias": False},
    ),
    "gpt2": (
        GPT2Config(**GPT_SHAPE, n_inner=48),
        {"position_embedding_type": "learned", "intermediate_size": 48, "hidden_act": "gelu_new"},
    ),
    "gpt2-unscaled": (
        GPT2Config(**GPT_SHAPE, scale_attn_weights=False, activation_function="relu"),
        {"query_pre_attn_scalar": 1.0, "hidden_act": "relu"},
    ),
    "openai-gpt": (
        OpenAIGPTConfig(**GPT_SHAPE),
        {"norm_position": "post", "position_embedding_type": "learned", "hidden_act": "gelu_new"},
    ),
    "phi": (
        PhiConfig(**QWEN2_SHAPE, qk_layernorm=True),
        {
            "norm_position": "parallel_shared_norm",
            "lm_head_bias": True,
            "use_qk_norm": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        },
    ),
    # fused qkv_proj and gate_up_proj; a window on every layer and a partial rotary factor (Phi-4-mini's 0.75)
    "phi-head-size": (PhiConfig(**QWEN2_SHAPE, head_dim=16), {"head_dim": 16, "use_qk_norm": False}),
    "phi3": (
        Phi3Config(
            **QWEN2_SHAPE,
            sliding_window=4,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75},
        ),
        {
            "sliding_window": 4,
            "layer_types": ["sliding_attention"] * 2,
            "mlp_type": "gated",
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75},
        },
    ),
    # a head size config.json gives (Phi3Config has no such field; its attention and RoPE read it), 16 != 32 / 4, with
    # a partial rotary factor: both sides rotate 12 channels of each head (6 of hidden / heads would differ)
    "phi3-head-size": (
        Phi3Config(
            **QWEN2_SHAPE,
            head_dim=16,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75},
        ),
        {"head_dim": 16, "hidden_size": 32},
    ),
    # Phi-3-*-128k's longrope: the 12-token batches are past `original_max_position_embeddings`, so the long factors
    # apply (the short ones: `test_phi3_longrope_short_sequences_use_the_short_factors`)
    "phi3-longrope": (
        Phi3Config(**QWEN2_SHAPE, original_max_position_embeddings=8, rope_parameters=PHI3_LONGROPE),
        {"rope_parameters": {**PHI3_LONGROPE, "partial_rotary_factor": 1.0, "original_max_position_embeddings": 8}},
    ),
    "stablelm": (
        StableLmConfig(**QWEN2_SHAPE, use_qkv_bias=True),
        {"norm_position": "pre", "norm_type": "layer_norm", "qkv_bias": True},
    ),
    "stablelm-parallel": (
        StableLmConfig(**QWEN2_SHAPE, use_parallel_residual=True),
        {"norm_position": "parallel_shared_norm", "qkv_bias": False},
    ),
    # StableLM 2 12B: parallel, a LayerNorm of its own per head for the queries and the keys (`qk_layernorm`)
    "stablelm-qk-layernorm": (
        StableLmConfig(**QWEN2_SHAPE, use_parallel_residual=True, qk_layernorm=True),
        {"use_qk_norm": True, "qk_norm_scope": "per_head"},
    ),
    # StarCoder2: LayerNorm, biases, a plain tanh-GELU MLP, a window on every layer, a head size config.json gives
    "starcoder2": (
        Starcoder2Config(**{**LLAMA_LIKE, "head_dim": 16}, sliding_window=4),
        {"norm_type": "layer_norm", "mlp_type": "plain", "mlp_bias": True, "sliding_window": 4, "head_dim": 16},
    ),
    "starcoder2-no-bias": (
        Starcoder2Config(**QWEN2_SHAPE, use_bias=False, hidden_act="gelu"),
        {"attention_bias": False, "mlp_bias": False, "hidden_act": "gelu", "sliding_window": None},
    ),
    # GPT-J: the parallel block with one LayerNorm, interleaved RoPE over the first 4 of each head's 8 channels
    "gptj": (
        GPTJConfig(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, rotary_dim=4, **IDS),
        {"norm_position": "parallel_shared_norm", "lm_head_bias": True, "intermediate_size": 128},
    ),
    # encoder-decoders (Marian's token conventions: pad is the decoder start, eos is 0)
    "marian": (
        MarianConfig(
            **SEQ2SEQ_SHAPE,
            scale_embedding=True,
            pad_token_id=60,
            eos_token_id=0,
            decoder_start_token_id=60,
            forced_eos_token_id=0,
        ),
        {"sinusoidal_layout": "split", "scale_embedding": True},
    ),
    "bart": (
        BartConfig(**SEQ2SEQ_SHAPE),
        {"position_embedding_type": "learned", "position_embedding_offset": 2, "embedding_layernorm": True},
    ),
    # mBART: Bart made pre-norm (mBART-50's token ids: pad 1, eos 2, the decoder starting from a language code)
    "mbart": (
        MBartConfig(**SEQ2SEQ_SHAPE, scale_embedding=True, decoder_start_token_id=VOCAB - 1),
        {"norm_position": "pre", "embedding_layernorm": True, "label_shift": "wrap_last_token"},
    ),
    # an untied head: the export wrote one storage for the three embedding names, and the stock model loaded two of
    # them as missing (random)
    "bart-untied": (BartConfig(**SEQ2SEQ_SHAPE, tie_word_embeddings=False), {"tie_word_embeddings": False}),
    "t5-v1.0": (
        T5Config(**T5_SHAPE, feed_forward_proj="relu", tie_word_embeddings=True),
        {"position_embedding_type": "relative_bias", "scale_decoder_outputs": True, "mlp_type": "plain"},
    ),
    "t5-v1.1": (
        T5Config(**T5_SHAPE, feed_forward_proj="gated-gelu", tie_word_embeddings=False),
        {"scale_decoder_outputs": False, "mlp_type": "gated", "tie_word_embeddings": False},
    ),
    # transformers 5.24 saves this with `tie_word_embeddings: true` (its T5 always ties at construction),
    # `scale_decoder_outputs: false` and no lm_head: a tied head fed the output unscaled
    "t5-v1.1-tied": (
        T5Config(**T5_SHAPE, feed_forward_proj="gated-gelu", tie_word_embeddings=False),
        {
            "scale_decoder_outputs": False,
            "tie_word_embeddings": T5Config(tie_word_embeddings=False).tie_word_embeddings,
        },
    ),
    "mt5": (
        MT5Config(**T5_SHAPE, feed_forward_proj="gated-gelu"),
        {"scale_decoder_outputs": False, "tie_word_embeddings": False},
    ),
    "umt5": (
        UMT5Config(**T5_SHAPE, feed_forward_proj="gated-gelu"),
        {"relative_attention_bias_per_layer": True, "scale_decoder_outputs": True},
    ),
    # Google's UMT5 checkpoints say `tie_word_embeddings: false`: from transformers 5.24 on, unscaled (up to 5.23 UMT5
    # always scales); saved by 5.24 the folder says `scale_decoder_outputs: false` beside a forced `true` tie flag
    "umt5-unscaled": (
        UMT5Config(**T5_SHAPE, feed_forward_proj="gated-gelu", tie_word_embeddings=False),
        {"scale_decoder_outputs": getattr(UMT5Config(tie_word_embeddings=False), "scale_decoder_outputs", True)},
    ),
    # the masked LM
    "bert": (
        BertConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=48,
            max_position_embeddings=64,
            type_vocab_size=2,
        ),
        {
            "type_vocab_size": 2,
            "embedding_layernorm": True,
            "position_embedding_type": "learned",
            "norm_position": "post",
            "decoder_layers": 1,
        },
    ),
    # RoBERTa: positions numbered past the pad token's id (a table of 64 + pad_token_id + 1 rows), one segment type
    "roberta": (
        RobertaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=48,
            max_position_embeddings=66,
            type_vocab_size=1,
            pad_token_id=1,
            bos_token_id=0,
            eos_token_id=2,
        ),
        {
            "max_position_embeddings": 64,
            "position_embedding_offset": 2,
            "position_ids_from_attention_mask": True,
            "position_ids_are_table_rows": True,
            "classifier_dropout_before_pooler": True,
            "type_vocab_size": 1,
            "norm_position": "post",
        },
    ),
}
# T5 v1.1, mT5 and UMT5 checkpoints carry a head of their own (transformers 5 ties one at construction)
OWN_HEAD = {"t5-v1.1", "mt5", "umt5", "umt5-unscaled", "bart-untied"}


def _family(case: str):
    return FAMILIES[CASES[case][0].model_type]


@torch.no_grad()
def _perturb(model: torch.nn.Module) -> None:
    """Every trained parameter random (norm gains around 1, Gemma's (1 + w) around w = 0, the rest around 0), and
    Marian's and Bart's output bias and DeepSeek-V3-style routers' correction bias (large enough to change their
    choice); fixed tables (Marian's sinusoids) stay."""
    for module in model.modules():
        is_norm = "norm" in type(module).__name__.lower()
        offset = "gemma" in type(module).__name__.lower()
        for name, param in module.named_parameters(recurse=False):
            if param.requires_grad:
                mean = 1.0 if is_norm and name == "weight" and not offset else 0.0
                param.normal_(mean, 0.2 if is_norm else 0.3)
    for name, buffer in model.named_buffers():
        if name == "final_logits_bias":
            buffer.normal_()
        if name.endswith("e_score_correction_bias"):
            buffer.normal_(0.0, 0.5)
    for name, param in model.named_parameters():  # (ERNIE's and AFMoE's correction biases are frozen parameters)
        if name.endswith(("e_score_correction_bias", "expert_bias")):
            param.normal_(0.0, 0.5)


def _stock(case: str):
    model = _family(case).model_class(CASES[case][0]).eval()
    if case in OWN_HEAD:
        model.lm_head.weight = torch.nn.Parameter(torch.empty_like(model.lm_head.weight))
    _perturb(model)
    return model


def _batches(pad: int):
    """(3, 12) ids, the same left-padded (4 and 1 pads) with its mask, and (3, 6) target prefixes."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (3, 12), generator=generator)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    mask[1, :1] = 0
    target = torch.randint(3, VOCAB, (3, 6), generator=generator)
    segments = torch.randint(0, 2, ids.shape, generator=generator)
    return ids, ids.masked_fill(mask == 0, pad), mask, target, segments


def _max_diff(model, reference, real: torch.Tensor | None = None, **inputs) -> float:
    """Max |Δlogit| over the real (unmasked) tokens, or every position of the target."""
    ours, theirs = model(**inputs).logits, reference(**inputs).logits
    real = torch.ones(ours.shape[:2], dtype=torch.bool) if real is None else real.bool()
    return (ours - theirs)[real].abs().max().item()


class _BuiltOnFirstUse(dict):
    """key -> `build(key)`, built the first time a test asks for it (a test process builds only what its tests use:
    pytest-xdist spreads a module's tests over its workers), each from a seed of its own, so a key's weights do not
    depend on what was built before it, and the asking test's own random numbers do not depend on whether it built."""

    def __init__(self, build):
        super().__init__()
        self.build = build

    def __missing__(self, key):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(zlib.crc32(key.encode()))
            self[key] = self.build(key)
        return self[key]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """case -> (stock model, the folder holding stock/, archlab/ and back/, the one exported back)."""

    def build(case):
        root = tmp_path_factory.mktemp(case)
        reference = _stock(case)
        reference.save_pretrained(root / "stock")
        convert_checkpoint(root / "stock", root / "archlab")
        convert_checkpoint(root / "archlab", root / "back", to=reference.config.model_type)
        return reference, root

    return _BuiltOnFirstUse(build)


def _check_decoder(model, reference, batches, pad: int) -> list[float]:
    ids, padded, mask, _, _ = batches
    diffs = [
        _max_diff(model, reference, input_ids=ids),
        _max_diff(model, reference, mask, input_ids=padded, attention_mask=mask),
    ]
    if "position_ids" in inspect.signature(reference.forward).parameters:
        # what `generate` passes: positions counted from the first real token (archlab's default is arange)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        diffs.append(_max_diff(model, reference, mask, input_ids=padded, attention_mask=mask, position_ids=positions))
    greedy = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=pad)
    assert torch.equal(model.generate(padded, **greedy), reference.generate(padded, **greedy))
    return diffs


def _check_seq2seq(model, reference, batches, pad: int) -> list[float]:
    ids, padded, mask, target, _ = batches
    target[:, 0] = reference.config.decoder_start_token_id
    diffs = [
        _max_diff(model, reference, input_ids=ids, decoder_input_ids=target),
        _max_diff(model, reference, input_ids=padded, attention_mask=mask, decoder_input_ids=target),
    ]
    for beams in (1, 3):
        search = dict(attention_mask=mask, max_new_tokens=6, num_beams=beams, do_sample=False)
        assert torch.equal(model.generate(padded, **search), reference.generate(padded, **search)), beams
    return diffs


def _check_masked_lm(model, reference, batches, pad: int) -> list[float]:
    """Plain, left- and right-padded batches (RoBERTa numbers positions past the padding), with segment ids where the
    model has several segment types; and the left-padded one with explicit `position_ids`, the stock table's rows
    (RoBERTa's start past its pad_token_id + 1 leading rows) counted from each row's first real token."""
    ids, padded, mask, _, segments = batches
    types = dict(token_type_ids=segments) if reference.config.type_vocab_size > 1 else {}
    right_mask = mask.flip(-1)
    right = ids.masked_fill(right_mask == 0, pad)
    first_row = pad + 1 if reference.config.model_type == "roberta" else 0
    rows = (mask.cumsum(-1) - 1).clamp(min=0) + first_row
    return [
        _max_diff(model, reference, input_ids=ids, **types),
        _max_diff(model, reference, mask, input_ids=padded, attention_mask=mask, **types),
        _max_diff(model, reference, right_mask, input_ids=right, attention_mask=right_mask, **types),
        _max_diff(model, reference, mask, input_ids=padded, attention_mask=mask, position_ids=rows, **types),
    ]


CHECKS = {
    "DecoderForCausalLM": _check_decoder,
    "Seq2SeqForConditionalGeneration": _check_seq2seq,
    "EncoderForMaskedLM": _check_masked_lm,
}


def _inputs(case: str, batches) -> dict[str, torch.Tensor]:
    """The left-padded batch as the family's forward takes it."""
    _, padded, mask, target, segments = batches
    inputs = dict(input_ids=padded, attention_mask=mask)
    if case.startswith(("marian", "bart", "mbart", "t5", "mt5", "umt5")):
        inputs["decoder_input_ids"] = target
    if case == "bert":
        inputs["token_type_ids"] = segments
    return inputs


@pytest.mark.parametrize("case", CASES)
def test_stock_to_archlab_to_stock(case, folders):
    reference, root = folders[case]
    family = _family(case)
    model = family.archlab_class.from_pretrained(root / "archlab").eval()
    assert type(model) is family.archlab_class
    for name, value in CASES[case][1].items():
        assert getattr(model.config, name) == value, name

    pad = reference.config.pad_token_id or 0
    batches = _batches(pad)
    with torch.no_grad():
        diffs = CHECKS[family.archlab_class.__name__](model, reference, batches, pad)
    assert max(diffs) <= ATOL, diffs

    back = family.model_class.from_pretrained(root / "back").eval()
    assert json.loads((root / "back" / "config.json").read_text())["architectures"] == [family.architecture]
    theirs, ours = reference.state_dict(), back.state_dict()
    assert ours.keys() == theirs.keys()
    assert [k for k in theirs if not torch.equal(ours[k], theirs[k])] == []
    inputs = _inputs(case, batches)
    with torch.no_grad():
        assert torch.equal(back(**inputs).logits, reference(**inputs).logits)


def test_every_family_is_checked():
    assert {config.model_type for config, _ in CASES.values()} == set(FAMILIES)
    assert {CASES[case][0].model_type for case in CLASSIFIER_CASES} == {
        name for name, family in FAMILIES.items() if SEQUENCE_CLASSIFICATION.stock_class(family) is not None
    }


# --- sequence classifiers (reward models): every decoder case's `<Family>ForSequenceClassification` ---------------

CLASSIFIER_CASES = [case for case in CASES if SEQUENCE_CLASSIFICATION.stock_class(_family(case)) is not None]
LABELS = {0: "worse", 1: "same", 2: "better"}


@pytest.fixture(scope="module")
def classifier_folders(tmp_path_factory):
    """case -> (stock classifier with 3 labels, the folder holding stock/, archlab/ and back/)."""

    def build(case):
        root = tmp_path_factory.mktemp(f"{case}-classifier")
        config = CASES[case][0]
        labels = dict(id2label=LABELS, label2id={v: k for k, v in LABELS.items()})
        config = type(config)(**{**config.to_dict(), **labels, "problem_type": "single_label_classification"})
        reference = SEQUENCE_CLASSIFICATION.stock_class(_family(case))(config).eval()
        _perturb(reference)  # the score too
        reference.save_pretrained(root / "stock")
        convert_checkpoint(root / "stock", root / "archlab")
        convert_checkpoint(root / "archlab", root / "back", to=config.model_type)
        return reference, root

    return _BuiltOnFirstUse(build)


@pytest.mark.parametrize("case", CLASSIFIER_CASES)
def test_a_sequence_classifier_converts_both_ways(case, classifier_folders):
    """The stock classifier (pooled at the last token that is not `pad_token_id`) and archlab's (the last token the
    mask keeps) give the same logits on a plain, a left-padded and a right-padded batch; the labels, problem type and
    pad token travel both ways, and the exported folder holds the very same tensors."""
    reference, root = classifier_folders[case]
    model = DecoderForSequenceClassification.from_pretrained(root / "archlab").eval()
    assert type(model) is DecoderForSequenceClassification
    assert model.score.bias is None and model.score.weight.shape == (3, model.config.hidden_size)
    for name in ("num_labels", "id2label", "label2id", "problem_type", "pad_token_id"):
        assert getattr(model.config, name) == getattr(reference.config, name), name
    for name, value in CASES[case][1].items():
        assert getattr(model.config, name) == value, name

    pad = reference.config.pad_token_id
    ids, left, mask, _, _ = _batches(pad)
    right_mask = mask.flip(-1)
    right = ids.masked_fill(right_mask == 0, pad)
    batches = [dict(input_ids=ids), dict(input_ids=left, attention_mask=mask)]
    batches.append(dict(input_ids=right, attention_mask=right_mask))
    with torch.no_grad():
        diffs = [(model(**inputs).logits - reference(**inputs).logits).abs().max().item() for inputs in batches]
    assert max(diffs) <= ATOL, diffs

    stock_class = type(reference)
    back = stock_class.from_pretrained(root / "back").eval()
    assert json.loads((root / "back" / "config.json").read_text())["architectures"] == [stock_class.__name__]
    for name in ("id2label", "label2id", "problem_type", "pad_token_id"):
        assert getattr(back.config, name) == getattr(reference.config, name), name
    theirs, ours = reference.state_dict(), back.state_dict()
    assert ours.keys() == theirs.keys()
    assert [k for k in theirs if not torch.equal(ours[k], theirs[k])] == []
    with torch.no_grad():
        assert torch.equal(back(**batches[1]).logits, reference(**batches[1]).logits)


# family -> (archlab config changes it cannot express, the fields its refusal must name)
NOT_EXPRESSIBLE = {
    "llama": ({"norm_type": "layer_norm"}, ["norm_type"]),
    "mistral": ({"layer_types": ["sliding_attention", "full_attention"]}, ["layer_types"]),
    "mixtral": ({"mlp_layer_types": ["dense", "sparse"]}, ["mlp_layer_types"]),
    "qwen2": ({"qkv_bias": False}, ["qkv_bias"]),
    "qwen2_moe": ({"shared_expert_gate": False}, ["shared_expert_gate"]),
    "qwen3": ({"use_qk_norm": False}, ["use_qk_norm"]),
    "qwen3_moe": ({"shared_expert_intermediate_size": 24}, ["shared_expert_intermediate_size"]),
    "gemma": ({"norm_type": "rms_norm"}, ["norm_type"]),
    "gemma2": ({"norm_position": "pre"}, ["norm_position"]),
    "gemma3_text": ({"use_qk_norm": False, "norm_position": "pre"}, ["use_qk_norm", "norm_position"]),
    "olmo2": (
        {"norm_position": "sandwich", "use_qk_norm": False, "qk_norm_scope": "head"},
        ["norm_position", "use_qk_norm", "qk_norm_scope"],
    ),
    "olmo3": ({"qk_norm_scope": "head"}, ["qk_norm_scope"]),
    "exaone4": ({"nope_layers": None}, ["nope_layers"]),
    "helium": ({"head_dim": 16}, ["head_dim"]),
    "glm": ({"norm_position": "sandwich"}, ["norm_position"]),
    "glm4": ({"norm_position": "pre"}, ["norm_position"]),
    "ministral": ({"attention_bias": True}, ["attention_bias"]),
    "ministral3": ({"query_scaling_length": 8}, ["query_scaling_length"]),
    "arcee": ({"mlp_type": "gated"}, ["mlp_type"]),
    "bitnet": ({"sub_layer_norm": False}, ["sub_layer_norm"]),
    "seed_oss": ({"use_qk_norm": True}, ["use_qk_norm"]),
    "granite": ({"query_pre_attn_scalar": 16, "attention_multiplier": None}, ["query_pre_attn_scalar"]),
    "granite_swa": ({"attention_sinks": False}, ["attention_sinks"]),
    "glm4_moe": ({"router_score_function": "softmax", "mlp_layer_types": ["sparse"] * 3}, ["router_score_function"]),
    "dots1": ({"mlp_layer_types": ["sparse", "dense", "sparse"]}, ["mlp_layer_types"]),
    "minimax_m2": ({"router_correction_bias": False}, ["router_correction_bias"]),
    "afmoe": ({"attention_output_gate": "headwise"}, ["attention_output_gate"]),
    "mellum": ({"use_qk_norm": False}, ["use_qk_norm"]),
    "ernie4_5_moe": ({"mlp_layer_types": ["sparse", "sparse", "dense", "sparse"]}, ["mlp_layer_types"]),
    "hunyuan_v1_dense": ({"qk_norm_after_rope": False}, ["qk_norm_after_rope"]),
    "gpt_oss": ({"attention_sinks": False}, ["attention_sinks"]),
    "llama4_text": ({"routing_weights_on_input": False}, ["routing_weights_on_input"]),
    "deepseek_v3": ({"mlp_layer_types": ["sparse", "dense", "sparse"]}, ["mlp_layer_types"]),
    "deepseek_v2": ({"router_correction_bias": True}, ["router_correction_bias"]),
    "sarvam_mla": ({"mlp_layer_types": ["sparse", "dense", "sparse"]}, ["mlp_layer_types"]),
    "youtu": ({"norm_position": "sandwich"}, ["norm_position"]),
    "apertus": ({"mlp_type": "gated"}, ["mlp_type"]),
    "glm4_moe_lite": ({"router_score_function": "softmax"}, ["router_score_function"]),
    "hunyuan_v1_moe": ({"shared_expert_intermediate_size": 32}, ["shared_expert_intermediate_size"]),
    "exaone_moe": ({"shared_expert_intermediate_size": 24}, ["shared_expert_intermediate_size"]),
    "solar_open": ({"mlp_layer_types": ["dense", "sparse"]}, ["mlp_layer_types"]),
    "cohere": ({"norm_bias": True, "scale_embedding": True}, ["norm_bias", "scale_embedding"]),
    "cohere2": ({"nope_layers": None}, ["nope_layers"]),
    "olmoe": ({"qk_norm_scope": "head"}, ["qk_norm_scope"]),
    "flex_olmo": ({"mlp_layer_types": ["dense", "sparse"]}, ["mlp_layer_types"]),
    "cwm": ({"attention_bias": True}, ["attention_bias"]),
    "ernie4_5": ({"attention_bias": False}, ["attention_bias/mlp_bias"]),
    "jais2": ({"norm_type": "rms_norm", "norm_bias": False}, ["norm_type"]),
    "internlm3": ({"attention_bias": False}, ["attention_bias/mlp_bias"]),
    "olmo": ({"norm_bias": True}, ["norm_bias"]),
    "nemotron": ({"norm_type": "layer_norm"}, ["norm_type"]),
    "iquestcoder": ({"use_qk_norm": True}, ["use_qk_norm"]),
    "exaone": ({"norm_type": "layer_norm"}, ["norm_type"]),
    "vaultgemma": ({"norm_position": "sandwich"}, ["norm_position"]),
    "granitemoe": ({"mlp_layer_types": ["dense", "sparse"]}, ["mlp_layer_types"]),
    "granitemoeshared": ({"shared_expert_gate": True}, ["shared_expert_gate"]),
    "gptj": ({"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}, ["rope_parameters"]),
    "smollm3": ({"norm_position": "sandwich"}, ["norm_position"]),
    "gpt_neox": ({"num_key_value_heads": 2}, ["num_key_value_heads"]),
    "falcon": ({"norm_position": "pre", "num_key_value_heads": 2}, ["norm_position", "num_key_value_heads"]),
    "bloom": ({"intermediate_size": 96}, ["intermediate_size"]),
    "mpt": ({"norm_bias": True}, ["norm_bias"]),
    "opt": ({"norm_position": "parallel", "position_ids_from_attention_mask": False}, ["norm_position"]),
    "gpt2": ({"norm_position": "post"}, ["norm_position"]),
    "openai-gpt": ({"hidden_act": "gelu"}, ["hidden_act"]),
    "phi": ({"lm_head_bias": False, "mlp_type": "gated"}, ["lm_head_bias", "mlp_type"]),
    "phi3": ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}}, ["rope_type"]),
    "stablelm": ({"norm_position": "parallel"}, ["norm_position"]),
    "starcoder2": ({"layer_types": ["sliding_attention", "full_attention"]}, ["layer_types"]),
    "bart": ({"embedding_layernorm": False}, ["embedding_layernorm"]),
    "mbart": ({"norm_position": "sandwich", "label_shift": "decoder_start_token"}, ["norm_position", "label_shift"]),
    "bert": ({"norm_position": "pre", "use_qk_norm": True}, ["norm_position", "use_qk_norm"]),
    "roberta": ({"position_ids_from_attention_mask": False}, ["position_ids_from_attention_mask"]),
}
# family -> the case whose converted folder the refusal starts from
START = {"falcon": "falcon", "gpt_neox": "gpt_neox", "opt": "opt", "stablelm": "stablelm"}


def _changed_archlab_folder(folders, case: str, changes: dict, folder):
    """The archlab model converted from `case`, with `changes` to its config (fresh weights), saved in `folder`."""
    archlab_class = _family(case).archlab_class
    config = archlab_class.config_class.from_pretrained(folders[case][1] / "archlab")
    model = archlab_class(archlab_class.config_class(**{**config.to_dict(), **changes})).eval()
    model.save_pretrained(folder)
    return model


def _assert_export_refused(folders, tmp_path, family: str, case: str, changes: dict, named: list[str]) -> None:
    _changed_archlab_folder(folders, case, changes, tmp_path / "archlab")
    with pytest.raises(ConversionError) as err:
        convert_checkpoint(tmp_path / "archlab", tmp_path / "out", to=family)
    assert all(name in str(err.value) for name in named), str(err.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("family", NOT_EXPRESSIBLE)
def test_export_refuses_what_the_family_cannot_compute(family, folders, tmp_path):
    changes, named = NOT_EXPRESSIBLE[family]
    _assert_export_refused(folders, tmp_path, family, START.get(family, family), changes, named)


# more refusals: id -> (family, the case to start from, changes, the fields named)
ALSO_NOT_EXPRESSIBLE = {
    # DeepSeek-V3's attention is latent attention
    "deepseek_v3-no-latents": (
        "deepseek_v3",
        "deepseek_v3",
        {"kv_lora_rank": None, "q_lora_rank": None},
        ["kv_lora_rank=None", "multi-head latent attention"],
    ),
    # DeepSeek-V3's groups are scored by their two best experts, DeepSeek-V2's by their best
    "deepseek_v3-group-max": ("deepseek_v3", "deepseek_v3", {"router_group_score": "max"}, ["router_group_score"]),
    "deepseek_v2-group-sum": (
        "deepseek_v2",
        "deepseek_v2-group-limited",
        {"router_group_score": "top2_sum"},
        ["router_group_score", "'max'"],
    ),
    # Llama 4's QK-norm has no gain, and its layers are full or chunked
    "llama4_text-qk-gain": ("llama4_text", "llama4_text", {"qk_norm_weight": True}, ["qk_norm_weight=True"]),
    "llama4_text-sliding": (
        "llama4_text",
        "llama4_text",
        {"layer_types": ["sliding_attention", "full_attention"] * 2, "sliding_window": 4, "attention_chunk_size": None},
        ["layer_types", "chunked_attention"],
    ),
    # GPT-OSS always clamps its experts' SwiGLU
    "gpt_oss-no-clamp": ("gpt_oss", "gpt_oss", {"swiglu_limit": None}, ["swiglu_limit"]),
    "gpt_oss-gelu": ("gpt_oss", "gpt_oss", {"hidden_act": "gelu"}, ["hidden_act='gelu'", "quick_gelu"]),
    # GLM-4.5's and Solar Open's output projections have no bias
    "glm4_moe-output-bias": ("glm4_moe", "glm4_moe", {"attention_bias": True}, ["attention_bias"]),
    "solar_open-output-bias": ("solar_open", "solar_open", {"attention_bias": True}, ["attention_bias"]),
    # a stock Cohere2 builds a sliding-window mask for every forward
    "cohere2-no-window": (
        "cohere2",
        "cohere2",
        {"sliding_window": None, "layer_types": ["full_attention"] * 2, "nope_layers": [0, 1]},
        ["sliding_window"],
    ),
    # the stock default RoPE of the Llama-like families rotates every channel whatever the factor says
    "llama-partial-rotary": ("llama", "llama", {"rope_parameters": ROPE_25}, ["partial_rotary_factor"]),
    "gemma-partial-rotary": ("gemma", "gemma", {"rope_parameters": ROPE_25}, ["partial_rotary_factor"]),
    # T5Config reads "gated-gelu" as the tanh approximation
    "t5-gated-exact-gelu": ("t5", "t5-v1.1", {"activation_function": "gelu"}, ["gelu"]),
    "qwen3_moe-mixed-windows": (
        "qwen3_moe",
        "qwen3_moe",
        {"layer_types": ["sliding_attention", "full_attention", "sliding_attention"]},
        ["layer_types"],
    ),
    "qwen3_moe-qkv-bias-only": ("qwen3_moe", "qwen3_moe", {"attention_bias": False, "qkv_bias": True}, ["qkv_bias"]),
    # RoBERTa's table has pad_token_id + 1 leading rows; its LM head is GELU whatever the encoder's activation
    "roberta-offset": ("roberta", "roberta", {"position_embedding_offset": 3}, ["position_embedding_offset"]),
    "roberta-head-activation": ("roberta", "roberta", {"activation_function": "gelu_new"}, ["activation_function"]),
    "phi-qk-norm-head-size": ("phi", "phi-head-size", {"use_qk_norm": True}, ["head_dim=16", "use_qk_norm"]),
    "phi3-biases": ("phi3", "phi3", {"attention_bias": True, "mlp_bias": True}, ["attention_bias", "mlp_bias"]),
    "phi3-mixed-windows": ("phi3", "phi3", {"layer_types": ["sliding_attention", "full_attention"]}, ["layer_types"]),
    # one longrope factor per frequency of head_dim 16, which Phi3Config checks against hidden / heads (8)
    "phi3-longrope-head-size": (
        "phi3",
        "phi3-head-size",
        {
            "rope_parameters": {
                **PHI3_LONGROPE,
                "short_factor": [1.0] * 8,
                "long_factor": [2.0] * 8,
                "original_max_position_embeddings": 8,
            }
        },
        ["head_dim=16 with rope_type 'longrope'", "hidden_size / num_attention_heads = 8"],
    ),
    "gemma3_text-partial-rotary": (
        "gemma3_text",
        "gemma3_text",
        {"rope_parameters": {**GEMMA3_ROPE, "sliding_attention": ROPE_25}},
        ["partial_rotary_factor"],
    ),
    # Gemma3's attention never caps its scores (transformers 5.24 does not pass the field on)
    "gemma3_text-attention-capping": (
        "gemma3_text",
        "gemma3_text",
        {"attn_logit_softcapping": 5.0},
        ["attn_logit_softcapping"],
    ),
    "gemma3_text-fractional-scalar": (
        "gemma3_text",
        "gemma3_text",
        {"query_pre_attn_scalar": 12.5},
        ["query_pre_attn_scalar", "Gemma3ForCausalLM"],
    ),
    # OLMo 2 norms the whole q and k projections, and its MLP has no bias
    "olmo2-per-head-qk-norm": ("olmo2", "olmo2", {"qk_norm_scope": "head"}, ["qk_norm_scope"]),
    "olmo2-mlp-bias": ("olmo2", "olmo2", {"mlp_bias": True}, ["mlp_bias"]),
    "bitnet-narrow-heads": ("bitnet", "bitnet", {"head_dim": 4}, ["head_dim", "hidden_size (32)"]),
    "olmo2-partial-rotary": ("olmo2", "olmo2", {"rope_parameters": ROPE_25}, ["partial_rotary_factor"]),
    "gemma2-fractional-scalar": ("gemma2", "gemma2", {"query_pre_attn_scalar": 12.5}, ["query_pre_attn_scalar"]),
    # what Bart keeps (no d_kv) is no valid config on its own: a ConversionError naming the field, not a ValueError
    "bart-head-size": (
        "bart",
        "bart",
        dict(
            d_kv=8,
            **{
                f"{side}_{kind}": 3
                for side in ("encoder", "decoder")
                for kind in ("attention_heads", "key_value_heads")
            },
        ),
        ["d_kv"],
    ),
}


@pytest.mark.parametrize("case", ALSO_NOT_EXPRESSIBLE)
def test_export_refuses_with_the_archlab_field_named(case, folders, tmp_path):
    _assert_export_refused(folders, tmp_path, *ALSO_NOT_EXPRESSIBLE[case])


def test_a_roberta_folder_reading_position_ids_as_positions_exports(folders, tmp_path):
    """`position_ids_are_table_rows` says how explicit position ids are read, not what the weights compute: a folder
    without it (converted before it existed, or an archlab model's own) exports, and comes back with it set."""
    model = _changed_archlab_folder(folders, "roberta", {"position_ids_are_table_rows": False}, tmp_path / "archlab")
    convert_checkpoint(tmp_path / "archlab", tmp_path / "stock", to="roberta")
    convert_checkpoint(tmp_path / "stock", tmp_path / "again")
    assert EncoderForMaskedLM.config_class.from_pretrained(tmp_path / "again").position_ids_are_table_rows
    stock = FAMILIES["roberta"].model_class.from_pretrained(tmp_path / "stock").eval()
    _, padded, mask, _, _ = _batches(stock.config.pad_token_id)
    with torch.no_grad():
        assert _max_diff(model, stock, mask, input_ids=padded, attention_mask=mask) <= ATOL


@pytest.mark.parametrize("family", ["bart", "marian"])
def test_an_archlab_model_with_its_own_head_exports_every_embedding(family, folders, tmp_path):
    """The three shared embedding names were given one tensor: saved once, and the stock model (untied by
    `tie_word_embeddings=False`) loaded its encoder's and decoder's embeddings as missing, random."""
    model = _changed_archlab_folder(folders, family, {"tie_word_embeddings": False}, tmp_path / "archlab")
    convert_checkpoint(tmp_path / "archlab", tmp_path / family, to=family)
    exported = FAMILIES[family].model_class.from_pretrained(tmp_path / family).eval()
    ids, target = torch.randint(3, 50, (2, 8)), torch.randint(3, 50, (2, 5))
    with torch.no_grad():
        diff = (
            exported(input_ids=ids, decoder_input_ids=target).logits
            - model(input_ids=ids, decoder_input_ids=target).logits
        )
    assert diff.abs().max() <= ATOL


def test_mbart_trains_from_labels_alone_as_mbart(folders):
    """mBART's decoder input is the labels shifted right behind each row's last real token (its target-language code):
    from right-padded `labels` alone (-100 past each row's end) archlab builds MBartForConditionalGeneration's decoder
    input and computes its loss, in evaluation and through the chunked training loss."""
    reference, root = folders["mbart"]
    model = Seq2SeqForConditionalGeneration.from_pretrained(root / "archlab").eval()
    pad = reference.config.pad_token_id
    _, padded, mask, labels, _ = _batches(pad)
    labels[0, 3:] = -100
    labels[1, 5:] = -100
    stock_input = mbart_shift_tokens_right(labels, pad)
    assert torch.equal(model.prepare_decoder_input_ids_from_labels(labels), stock_input)
    assert stock_input[:, 0].tolist() == [labels[0, 2], labels[1, 4], labels[2, 5]]
    inputs = dict(input_ids=padded, attention_mask=mask, labels=labels)
    with torch.no_grad():
        expected = reference(**inputs).loss
        assert abs(model(**inputs).loss - expected) <= ATOL
        model.train()  # dropout 0: the chunked training loss, the same function
        assert abs(model(**inputs).loss - expected) <= ATOL


def test_gemma3_with_one_rope_set_imports_it_flat_and_exports_it_for_both_layer_types(folders, tmp_path):
    """Gemma3's sets per layer type, equal (or all layers of one type), are archlab's one flat set; a flat archlab set
    (and a window with every layer global) exports as the same set for both of Gemma3's layer types, the same
    logits."""
    rope = {"rope_type": "default", "rope_theta": 1e4}
    for layer_types in (["sliding_attention", "full_attention"], ["full_attention"] * 2):
        sets = {"full_attention": rope, "sliding_attention": {**rope, "rope_theta": 5e5}}
        if "sliding_attention" in layer_types:
            sets["sliding_attention"] = rope
        stock = Gemma3TextConfig(
            **{**CASES["gemma3_text"][0].to_dict(), "rope_parameters": sets, "layer_types": layer_types}
        )
        assert FAMILIES["gemma3_text"].archlab_config(stock.to_dict()).rope_parameters == rope, layer_types
    changes = dict(rope_parameters=rope, layer_types=["full_attention"] * 2)
    model = _changed_archlab_folder(folders, "gemma3_text", changes, tmp_path / "archlab")
    convert_checkpoint(tmp_path / "archlab", tmp_path / "gemma3", to="gemma3_text")
    exported = FAMILIES["gemma3_text"].model_class.from_pretrained(tmp_path / "gemma3").eval()
    assert exported.config.rope_parameters == {"full_attention": rope, "sliding_attention": rope}
    ids = torch.randint(3, VOCAB, (2, 9))
    with torch.no_grad():
        assert (exported(ids).logits - model(ids).logits).abs().max() <= ATOL


def test_gemma2_exports_without_a_window_and_with_integer_caps(folders, tmp_path):
    """Gemma2's stock model always builds a sliding-window mask (it failed on a config without a window), and its
    config types the soft-caps as floats (an int failed its strict validation, as a traceback)."""
    changes = dict(sliding_window=None, layer_types=None, attn_logit_softcapping=5, final_logit_softcapping=3)
    model = _changed_archlab_folder(folders, "gemma2", changes, tmp_path / "archlab")
    convert_checkpoint(tmp_path / "archlab", tmp_path / "gemma2", to="gemma2")
    exported = FAMILIES["gemma2"].model_class.from_pretrained(tmp_path / "gemma2").eval()
    ids = torch.randint(3, VOCAB, (2, 9))
    with torch.no_grad():
        assert (exported(ids).logits - model(ids).logits).abs().max() <= ATOL


@pytest.mark.parametrize(
    "family, changes",
    [
        # a window on a model whose layers are all global is never applied; Mistral would apply it to every layer
        ("mistral", dict(sliding_window=4, layer_types=["full_attention", "full_attention"])),
        ("mixtral", dict(sliding_window=4, layer_types=["full_attention", "full_attention"])),
        # no sparse layer: stock Qwen2-MoE's load-balancing loss failed on an empty tuple of router logits
        ("qwen2_moe", dict(mlp_layer_types=["dense"] * 3, output_router_logits=True)),
        # archlab's default scores scale (head_dim^-½), which Granite's attention takes as its `attention_multiplier`
        ("granite", dict(attention_multiplier=None)),
    ],
)
def test_exports_of_settings_that_change_nothing(family, changes, folders, tmp_path):
    model = _changed_archlab_folder(folders, family, changes, tmp_path / "archlab")
    convert_checkpoint(tmp_path / "archlab", tmp_path / family, to=family)
    exported = FAMILIES[family].model_class.from_pretrained(tmp_path / family).eval()
    ids = torch.randint(3, VOCAB, (2, 9))
    with torch.no_grad():
        theirs, ours = exported(ids, labels=ids), model(ids, labels=ids)
    assert (theirs.logits - ours.logits).abs().max() <= ATOL
    torch.testing.assert_close(theirs.loss, ours.loss, atol=ATOL, rtol=0)


def test_export_refuses_a_folder_of_another_archlab_class(folders, tmp_path):
    """An encoder-decoder folder is not a masked LM, though both are `archlab_seq2seq`."""
    with pytest.raises(ConversionError, match="Seq2SeqForConditionalGeneration; bert exports EncoderForMaskedLM"):
        convert_checkpoint(folders["bart"][1] / "archlab", tmp_path / "out", to="bert")


# stock configs archlab cannot compute yet (or that transformers' stock class silently ignores)
NOT_IMPORTABLE = {
    # no DeepSeek-V3 checkpoint rotates halves; the layout reorders interleaved pairs
    "deepseek_v3-rotate-half": (
        DeepseekV3Config(**QWEN2_SHAPE, kv_lora_rank=16, qk_rope_head_dim=4, rope_interleave=False),
        ["rope_interleave"],
    ),
    # archlab's activations compute x · σ(α x) for α = 1.702 (quick_gelu) and 1 (silu) only
    "gpt_oss-other-alpha": (GptOssConfig(**LLAMA_LIKE, num_local_experts=4, swiglu_alpha=1.5), ["swiglu_alpha"]),
    "cohere2-no-window": (Cohere2Config(**QWEN2_SHAPE, sliding_window=None), ["sliding_window"]),
    # Mellum's RoPE table takes a partial factor, its attention rotates every channel
    "mellum-partial-rotary": (
        MellumConfig(
            **LLAMA_LIKE,
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 5e5, "partial_rotary_factor": 0.5},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
        ),
        ["partial_rotary_factor"],
    ),
    "falcon-new-sequential": (
        FalconConfig(
            hidden_size=32,
            num_attention_heads=4,
            num_hidden_layers=1,
            new_decoder_architecture=True,
            parallel_attn=False,
        ),
        ["parallel_attn"],
    ),
    "falcon-old-two-norms": (
        FalconConfig(hidden_size=32, num_attention_heads=4, num_hidden_layers=1, num_ln_in_parallel_attn=2),
        ["num_ln_in_parallel_attn"],
    ),
    "falcon-alibi": (
        FalconConfig(hidden_size=32, num_attention_heads=4, num_hidden_layers=1, alibi=True, parallel_attn=False),
        ["alibi"],
    ),
    "bloom-post-ln-residual": (
        BloomConfig(hidden_size=32, n_head=4, apply_residual_connection_post_layernorm=True),
        ["apply_residual_connection_post_layernorm"],
    ),
    "mpt-clip-qkv": (
        MptConfig(d_model=32, n_heads=4, attn_config={"clip_qkv": 8.0, "alibi_bias_max": 16}),
        ["clip_qkv", "alibi_bias_max"],
    ),
    "mpt-biases": (MptConfig(d_model=32, n_heads=4, no_bias=False), ["no_bias"]),
    "gpt2-layer-scaled": (
        GPT2Config(n_embd=32, n_head=4, scale_attn_by_inverse_layer_idx=True, reorder_and_upcast_attn=True),
        ["scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"],
    ),
    "gemma-bidirectional": (
        GemmaConfig(hidden_size=32, num_attention_heads=4, head_dim=8, use_bidirectional_attention=True),
        ["use_bidirectional_attention"],
    ),
    "gemma3_text-bidirectional": (
        Gemma3TextConfig(hidden_size=32, num_attention_heads=4, head_dim=8, use_bidirectional_attention=True),
        ["use_bidirectional_attention"],
    ),
    "gemma3_text-attention-capping": (
        Gemma3TextConfig(hidden_size=32, num_attention_heads=4, head_dim=8, attn_logit_softcapping=50.0),
        ["attn_logit_softcapping"],
    ),
    "gemma3_text-partial-rotary": (
        Gemma3TextConfig(
            hidden_size=32,
            num_attention_heads=4,
            head_dim=8,
            rope_parameters={**GEMMA3_ROPE, "full_attention": {**ROPE_25, "rope_type": "linear", "factor": 2.0}},
        ),
        ["partial_rotary_factor", "full_attention"],
    ),
    "qwen2_moe-no-shared-expert": (
        Qwen2MoeConfig(**QWEN2_SHAPE, shared_expert_intermediate_size=0),
        ["shared_expert_intermediate_size"],
    ),
    "qwen3_moe-partial-rotary": (Qwen3MoeConfig(**QWEN2_SHAPE, rope_parameters=ROPE_25), ["partial_rotary_factor"]),
    "olmo2-partial-rotary": (Olmo2Config(**QWEN2_SHAPE, rope_parameters=ROPE_25), ["partial_rotary_factor"]),
    "opt-350m": (OPTConfig(**OPT_SHAPE, word_embed_proj_dim=16, do_layer_norm_before=False), ["word_embed_proj_dim"]),
    "opt-no-final-norm": (
        OPTConfig(**OPT_SHAPE, _remove_final_layer_norm=True, layer_norm_elementwise_affine=False),
        ["_remove_final_layer_norm", "layer_norm_elementwise_affine"],
    ),
    "bert-relative-positions": (
        BertConfig(hidden_size=32, num_attention_heads=4, is_decoder=True, position_embedding_type="relative_key"),
        ["position_embedding_type", "is_decoder"],
    ),
    "bert-untied": (
        BertConfig(hidden_size=32, num_attention_heads=4, tie_word_embeddings=False),
        ["tie_word_embeddings"],
    ),
    # the stock slow path sums sliced output projections without their biases
    "bloom-slow-but-exact": (
        BloomConfig(hidden_size=32, n_head=4, slow_but_exact=True, pretraining_tp=2),
        ["slow_but_exact", "pretraining_tp"],
    ),
    "roberta-head-activation": (
        RobertaConfig(hidden_size=32, num_attention_heads=4, hidden_act="relu"),
        ["hidden_act"],
    ),
    "roberta-no-pad": (RobertaConfig(hidden_size=32, num_attention_heads=4, pad_token_id=None), ["pad_token_id"]),
    # Phi3Config checks longrope's factors against hidden / heads (4 here), its RoPE reads head_dim (8 frequencies)
    "phi3-longrope-head-size": (
        Phi3Config(**QWEN2_SHAPE, head_dim=16, original_max_position_embeddings=8, rope_parameters=PHI3_LONGROPE),
        ["head_dim=16 with rope_type 'longrope'", "Phi3Config checks longrope's factors"],
    ),
    # the stock default RoPE rotates every channel: the factor is ignored there
    "llama-partial-rotary": (LlamaConfig(**LLAMA_LIKE, rope_parameters=ROPE_25), ["partial_rotary_factor"]),
    # no `head_dim` field in their configs: their RoPE reads one from config.json, their attention takes hidden / heads
    "stablelm-undeclared-head-dim": (StableLmConfig(**QWEN2_SHAPE, head_dim=16), ["head_dim"]),
    "gpt_neox-undeclared-head-dim": (GPTNeoXConfig(**NEOX_SHAPE, head_dim=16), ["head_dim"]),
    # OLMo-7B-0424's q/k/v clamp
    "olmo-clip-qkv": (OlmoConfig(**QWEN2_SHAPE, clip_qkv=8.0), ["clip_qkv"]),
    # Phi's QK LayerNorms are hidden / heads wide whatever head size its attention reads
    "phi-qk-layernorm-head-size": (
        PhiConfig(**QWEN2_SHAPE, head_dim=16, qk_layernorm=True),
        ["head_dim", "qk_layernorm"],
    ),
}


@pytest.mark.parametrize("case", NOT_IMPORTABLE)
def test_import_refuses_what_archlab_cannot_compute(case):
    stock_config, named = NOT_IMPORTABLE[case]
    with pytest.raises(ConversionError) as err:
        FAMILIES[stock_config.model_type].archlab_config(stock_config.to_dict())
    assert all(name in str(err.value) for name in named), str(err.value)


def test_olmo_export_refuses_norm_gains_other_than_one(folders, tmp_path):
    """OLMo's LayerNorms have no gain: an archlab model converted from OLMo exports while its gains are 1, and one
    whose gains moved (trained after the import) is refused with the tensors named, nothing written."""
    from safetensors.torch import load_file, save_file

    archlab_folder = folders["olmo"][1] / "archlab"
    convert_checkpoint(archlab_folder, tmp_path / "back", to="olmo")
    trained = tmp_path / "trained"
    trained.mkdir()
    for item in archlab_folder.iterdir():
        if item.is_file():
            (trained / item.name).write_bytes(item.read_bytes())
    weights = load_file(trained / "model.safetensors")
    weights["model.layers.1.post_attention_layernorm.weight"] = weights["model.norm.weight"] * 1.5
    save_file(weights, trained / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConversionError, match=r"no gain.*model\.layers\.1\.post_attention_layernorm\.weight"):
        convert_checkpoint(trained, tmp_path / "refused", to="olmo")
    assert not (tmp_path / "refused").exists()


def test_checkpoints_saved_from_the_base_model_and_legacy_names_convert(folders, tmp_path):
    """Hub checkpoints of GPT-2/BLOOM lack the `transformer.` prefix and carry causal-mask buffers; Pythia's head
    is `embed_out`; BERT's carry `gamma`/`beta` norms, the head's tied copies, the pooler and the next-sentence head;
    RoBERTa's saved from the base model lack `roberta.` and carry a pooler and the head's tied copies. They convert to
    the same archlab weights."""
    from safetensors.torch import load_file, save_file

    def bert(key: str) -> str:
        return key.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta")

    for case, rename in (
        ("gpt2", lambda k: k.removeprefix("transformer.")),
        ("gpt_neox", lambda k: k.replace("lm_head.", "embed_out.")),
        ("bert", bert),
        ("roberta", lambda k: k.removeprefix("roberta.")),
    ):
        reference, root = folders[case]
        src = tmp_path / case
        src.mkdir()
        (src / "config.json").write_text((root / "stock" / "config.json").read_text())
        state = {rename(k): v.clone() for k, v in reference.state_dict().items()}
        if case == "gpt2":
            state["h.0.attn.bias"] = torch.ones(1, 1, 4, 4)
        if case == "bert":
            assert "cls.predictions.decoder.bias" in state
            state |= {
                "bert.pooler.dense.weight": torch.ones(32, 32),
                "cls.seq_relationship.bias": torch.ones(2),
                "bert.embeddings.position_ids": torch.arange(64)[None],
            }
        if case == "roberta":
            assert "lm_head.decoder.weight" in state
            state |= {"pooler.dense.weight": torch.ones(32, 32), "embeddings.position_ids": torch.arange(66)[None]}
        save_file(state, str(src / "model.safetensors"))
        convert_checkpoint(src, tmp_path / f"{case}-archlab")
        ours = load_file(str(tmp_path / f"{case}-archlab" / "model.safetensors"))
        expected = load_file(str(root / "archlab" / "model.safetensors"))
        assert ours.keys() == expected.keys() and all(torch.equal(ours[k], expected[k]) for k in ours)


def test_a_bert_head_that_differs_from_what_it_copies_is_refused(folders, tmp_path):
    from safetensors.torch import save_file

    reference, root = folders["bert"]
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "config.json").write_text((root / "stock" / "config.json").read_text())
    state = {k: v.clone() for k, v in reference.state_dict().items()}
    state["cls.predictions.decoder.bias"] += 1.0
    save_file(state, str(tmp_path / "src" / "model.safetensors"))
    with pytest.raises(ConversionError, match="cls.predictions.decoder.bias"):
        convert_checkpoint(tmp_path / "src", tmp_path / "out")


def test_a_per_head_qk_norm_with_a_bias_is_refused_by_stablelm(folders, tmp_path):
    """archlab's per-head QK LayerNorms have a bias, StableLM's none: zero on import, and a trained one refused."""
    _, root = folders["stablelm-qk-layernorm"]
    model = DecoderForCausalLM.from_pretrained(root / "archlab")
    assert not model.model.layers[0].self_attn.q_norm.bias.any()
    with torch.no_grad():
        model.model.layers[0].self_attn.k_norm.bias.add_(0.1)
    model.save_pretrained(tmp_path / "archlab")
    with pytest.raises(ConversionError, match=r"model\.layers\.0\.self_attn\.k_norm\.bias` is not zero"):
        convert_checkpoint(tmp_path / "archlab", tmp_path / "out", to="stablelm")
    assert not (tmp_path / "out").exists()


def test_a_masked_lm_without_segment_types_exports_with_one_zero_segment(folders, tmp_path):
    reference, root = folders["bert"]
    config = EncoderForMaskedLM.config_class.from_pretrained(root / "archlab")
    model = EncoderForMaskedLM(EncoderForMaskedLM.config_class(**{**config.to_dict(), "type_vocab_size": 0})).eval()
    model.save_pretrained(tmp_path / "archlab")
    convert_checkpoint(tmp_path / "archlab", tmp_path / "bert", to="bert")
    exported = FAMILIES["bert"].model_class.from_pretrained(tmp_path / "bert").eval()
    assert exported.config.type_vocab_size == 1
    ids = torch.randint(3, VOCAB, (2, 9))
    with torch.no_grad():
        assert (exported(ids).logits - model(ids).logits).abs().max() <= ATOL


# --- token classifiers and extractive QA: the families whose classes are transformers' generic heads --------------

TOKEN_CASES = [case for case in CASES if TOKEN_CLASSIFICATION.stock_class(_family(case)) is not None]
QA_CASES = [case for case in CASES if QUESTION_ANSWERING.stock_class(_family(case)) is not None]
TAGS = {0: "O", 1: "B-NUM", 2: "I-NUM", 3: "B-WORD", 4: "I-WORD"}


def test_every_generic_token_and_qa_head_is_checked():
    """Llama, Mistral, Ministral, Ministral 3, Mixtral, Qwen2, Qwen2-MoE, Qwen3, Qwen3-MoE, SmolLM3, EXAONE 4, Arcee,
    Seed-OSS and Nemotron (both heads), GPT-J (question answering), Gemma, Gemma2, GLM, GLM-4, Helium, Phi, Phi-3,
    StableLM and StarCoder2 (tokens)."""
    qa, tokens = {_family(case).name for case in QA_CASES}, {_family(case).name for case in TOKEN_CASES}
    both = {"llama", "mistral", "ministral", "ministral3", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe"}
    both |= {"smollm3"}
    both |= {"exaone4", "arcee", "seed_oss", "nemotron"}
    assert qa == both | {"gptj"} and both <= tokens
    assert {"gemma", "gemma2", "glm", "glm4", "helium", "phi", "phi3", "stablelm", "starcoder2"} <= tokens


def _token_and_qa_folders(root, case: str, head) -> torch.nn.Module:
    config = CASES[case][0]
    labels = dict(id2label=TAGS, label2id={v: k for k, v in TAGS.items()}) if head is TOKEN_CLASSIFICATION else {}
    reference = head.stock_class(_family(case))(type(config)(**{**config.to_dict(), **labels})).eval()
    _perturb(reference)  # the head too
    reference.save_pretrained(root / "stock")
    convert_checkpoint(root / "stock", root / "archlab")
    convert_checkpoint(root / "archlab", root / "back", to=config.model_type)
    return reference


def _outputs(output) -> torch.Tensor:
    return output.logits if hasattr(output, "logits") else torch.stack([output.start_logits, output.end_logits], -1)


@pytest.mark.parametrize(
    "case, head",
    [(case, TOKEN_CLASSIFICATION) for case in TOKEN_CASES] + [(case, QUESTION_ANSWERING) for case in QA_CASES],
    ids=[f"{case}-tokens" for case in TOKEN_CASES] + [f"{case}-qa" for case in QA_CASES],
)
def test_a_token_classifier_and_a_qa_model_convert_both_ways(case, head, tmp_path):
    """A `<Family>ForTokenClassification` / `<Family>ForQuestionAnswering` folder failed as "a head the converter
    does not convert"; it is archlab's class (Llama's, Qwen2's and Qwen3's QA body under `transformer.` renamed),
    with the same logits on a plain and a left-padded batch and the same loss, the labels kept, and exports back to
    the very same tensors."""
    reference = _token_and_qa_folders(tmp_path, case, head)
    model = head.archlab_class.from_pretrained(tmp_path / "archlab").eval()
    assert type(model) is head.archlab_class
    if head is TOKEN_CLASSIFICATION:
        assert model.config.id2label == reference.config.id2label and model.score.bias is not None
        assert model.dropout.p == reference.dropout.p
    ids, left, mask, _, _ = _batches(reference.config.pad_token_id)
    if head is TOKEN_CLASSIFICATION:
        targets = dict(labels=torch.randint(0, 5, ids.shape).masked_fill(mask == 0, -100))
    else:
        targets = dict(start_positions=torch.tensor([5, 0, 30]), end_positions=torch.tensor([7, 11, 2]))
    batches = [dict(input_ids=ids), dict(input_ids=left, attention_mask=mask, **targets)]
    with torch.no_grad():
        ours, theirs = [model(**inputs) for inputs in batches], [reference(**inputs) for inputs in batches]
    real = [torch.ones_like(mask).bool(), mask.bool()]
    diffs = [(_outputs(a) - _outputs(b))[r].abs().max().item() for a, b, r in zip(ours, theirs, real)]
    assert max(diffs) <= ATOL, diffs
    torch.testing.assert_close(ours[1].loss, theirs[1].loss, rtol=1e-5, atol=1e-6)

    back = type(reference).from_pretrained(tmp_path / "back").eval()
    assert json.loads((tmp_path / "back" / "config.json").read_text())["architectures"] == [type(reference).__name__]
    assert back.config.id2label == reference.config.id2label
    theirs, ours = reference.state_dict(), back.state_dict()
    assert ours.keys() == theirs.keys()
    assert [k for k in theirs if not torch.equal(ours[k], theirs[k])] == []


@pytest.mark.parametrize("head", [TOKEN_CLASSIFICATION, QUESTION_ANSWERING], ids=["tokens", "qa"])
def test_a_family_whose_token_or_qa_head_is_its_own_is_refused_by_name(head, tmp_path):
    """GPT-2's token classifier (`classifier`, not `score`) and QA class are not archlab's heads: refused naming what
    converts, both ways."""
    family = _family("gpt2")
    assert head.stock_class(family) is None
    stock_class = getattr(transformers, head.stock_names[family.name])
    stock_class(CASES["gpt2"][0]).save_pretrained(tmp_path / "stock")
    with pytest.raises(ConversionError, match=f"holds {stock_class.__name__}, a head the converter does not"):
        convert_checkpoint(tmp_path / "stock", tmp_path / "out")
    head.archlab_class(helpers.tiny_decoder_config()).save_pretrained(tmp_path / "archlab")
    with pytest.raises(ConversionError, match=f"holds {head.archlab_class.__name__}; gpt2 has no {head.suffix}"):
        convert_checkpoint(tmp_path / "archlab", tmp_path / "out", to="gpt2")


def test_a_classifier_exports_whatever_its_lm_head_settings(classifier_folders, tmp_path):
    """Phi's causal LM needs `lm_head_bias=True`; a classifier has no LM head, and its export was refused for it."""
    config = DecoderForSequenceClassification.config_class.from_pretrained(classifier_folders["phi"][1] / "archlab")
    model = DecoderForSequenceClassification(type(config)(**{**config.to_dict(), "lm_head_bias": False})).eval()
    model.save_pretrained(tmp_path / "archlab")
    convert_checkpoint(tmp_path / "archlab", tmp_path / "phi", to="phi")
    exported = type(classifier_folders["phi"][0]).from_pretrained(tmp_path / "phi").eval()
    ids = torch.randint(3, VOCAB, (2, 9))
    with torch.no_grad():
        assert (exported(ids).logits - model(ids).logits).abs().max() <= ATOL


@pytest.mark.parametrize(
    "to, changes, named",
    [
        (
            "llama",
            {"norm_type": "layer_norm"},
            "norm_type='layer_norm' (it needs 'rms_norm'). A stock LlamaForSequenceClassification cannot compute",
        ),
        ("bert", {}, "holds model_type 'archlab_decoder'; --to bert exports EncoderForMaskedLM folders"),
    ],
)
def test_a_classifier_export_is_refused_with_what_is_missing_named(to, changes, named, classifier_folders, tmp_path):
    config = DecoderForSequenceClassification.config_class.from_pretrained(classifier_folders["llama"][1] / "archlab")
    DecoderForSequenceClassification(type(config)(**{**config.to_dict(), **changes})).save_pretrained(tmp_path / "a")
    with pytest.raises(ConversionError) as err:
        convert_checkpoint(tmp_path / "a", tmp_path / "out", to=to)
    assert named in str(err.value), str(err.value)
    assert not (tmp_path / "out").exists()


# --- BERT's fine-tuning heads: `BertForSequenceClassification` / `BertForTokenClassification` --------------------

BERT_HEADS = {"sequence": ENCODER_SEQUENCE_CLASSIFICATION, "token": ENCODER_TOKEN_CLASSIFICATION}


@pytest.fixture(scope="module")
def bert_head_folders(tmp_path_factory):
    """head -> (stock BERT classifier with 3 labels, every parameter perturbed, the folder holding stock/, archlab/
    and back/)."""

    def build(name):
        head = BERT_HEADS[name]
        root = tmp_path_factory.mktemp(f"bert-{name}")
        labels = dict(id2label=LABELS, label2id={v: k for k, v in LABELS.items()}, classifier_dropout=0.3)
        if name == "sequence":
            labels["problem_type"] = "multi_label_classification"
        config = BertConfig(**{**CASES["bert"][0].to_dict(), **labels})
        reference = head.stock_class(FAMILIES["bert"])(config).eval()
        _perturb(reference)
        reference.save_pretrained(root / "stock")
        convert_checkpoint(root / "stock", root / "archlab")
        convert_checkpoint(root / "archlab", root / "back", to="bert")
        return reference, root

    return _BuiltOnFirstUse(build)


@pytest.mark.parametrize("name", BERT_HEADS)
def test_a_bert_classifier_converts_both_ways(name, bert_head_folders):
    """`BertForSequenceClassification` (its pooler included) is `EncoderForSequenceClassification` and
    `BertForTokenClassification` is `EncoderForTokenClassification`: the same logits on padded sentence pairs, the
    labels, problem type and classifier dropout carried both ways, and the exported folder holds the very same
    tensors."""
    reference, root = bert_head_folders[name]
    head = BERT_HEADS[name]
    model = head.archlab_class.from_pretrained(root / "archlab").eval()
    assert json.loads((root / "archlab" / "config.json").read_text())["architectures"] == [head.archlab_class.__name__]
    for field in ("num_labels", "id2label", "label2id", "problem_type", "classifier_dropout"):
        assert getattr(model.config, field) == getattr(reference.config, field), field
    ids, left, mask, _, _ = _batches(0)
    right_mask = mask.flip(-1)
    segments = (torch.arange(ids.shape[1]) >= 4).long().expand_as(ids) * right_mask
    inputs = dict(input_ids=ids.masked_fill(right_mask == 0, 0), attention_mask=right_mask, token_type_ids=segments)
    with torch.no_grad():
        diff = (model(**inputs).logits - reference(**inputs).logits).abs().max().item()
    assert diff <= ATOL

    back = type(reference).from_pretrained(root / "back").eval()
    assert json.loads((root / "back" / "config.json").read_text())["architectures"] == [type(reference).__name__]
    for field in ("id2label", "label2id", "problem_type", "classifier_dropout"):
        assert getattr(back.config, field) == getattr(reference.config, field), field
    theirs, ours = reference.state_dict(), back.state_dict()
    assert ours.keys() == theirs.keys()
    assert [k for k in theirs if not torch.equal(ours[k], theirs[k])] == []


def test_a_sequence_classifier_without_berts_pooler_is_refused_by_bert(bert_head_folders, tmp_path):
    """BertForSequenceClassification always pools; a classifier without the pooler (`classifier_pooler=False`) is
    refused with the field named, while a masked LM's export ignores the field (it has no such head)."""
    config = EncoderForSequenceClassification.config_class.from_pretrained(bert_head_folders["sequence"][1] / "archlab")
    changed = type(config)(**{**config.to_dict(), "classifier_pooler": False})
    EncoderForSequenceClassification(changed).save_pretrained(tmp_path / "classifier")
    with pytest.raises(ConversionError, match="classifier_pooler=False"):
        convert_checkpoint(tmp_path / "classifier", tmp_path / "out", to="bert")
    EncoderForMaskedLM(changed).save_pretrained(tmp_path / "mlm")
    convert_checkpoint(tmp_path / "mlm", tmp_path / "bert", to="bert")


def test_a_bert_question_answering_model_converts_both_ways(tmp_path):
    """`BertForQuestionAnswering` (no pooler; `qa_outputs` on every token) is `EncoderForQuestionAnswering`: the same
    start and end logits on padded sentence pairs, and the exported folder holds the very same tensors."""
    torch.manual_seed(0)
    head = ENCODER_QUESTION_ANSWERING
    reference = head.stock_class(FAMILIES["bert"])(CASES["bert"][0]).eval()
    _perturb(reference)
    reference.save_pretrained(tmp_path / "stock")
    convert_checkpoint(tmp_path / "stock", tmp_path / "archlab")
    convert_checkpoint(tmp_path / "archlab", tmp_path / "back", to="bert")
    model = head.archlab_class.from_pretrained(tmp_path / "archlab").eval()
    assert json.loads((tmp_path / "archlab" / "config.json").read_text())["architectures"] == [
        "EncoderForQuestionAnswering"
    ]
    ids, _, mask, _, _ = _batches(0)
    right_mask = mask.flip(-1)
    segments = (torch.arange(ids.shape[1]) >= 4).long().expand_as(ids) * right_mask
    inputs = dict(input_ids=ids.masked_fill(right_mask == 0, 0), attention_mask=right_mask, token_type_ids=segments)
    with torch.no_grad():
        ours, theirs = model(**inputs), reference(**inputs)
    for side in ("start_logits", "end_logits"):
        assert (getattr(ours, side) - getattr(theirs, side)).abs().max().item() <= ATOL, side

    back = type(reference).from_pretrained(tmp_path / "back").eval()
    assert json.loads((tmp_path / "back" / "config.json").read_text())["architectures"] == ["BertForQuestionAnswering"]
    theirs, ours = reference.state_dict(), back.state_dict()
    assert ours.keys() == theirs.keys()
    assert [k for k in theirs if not torch.equal(ours[k], theirs[k])] == []


def test_an_encoder_classifier_is_refused_by_a_family_without_one(bert_head_folders, tmp_path):
    with pytest.raises(ConversionError, match="EncoderForTokenClassification; marian has no"):
        convert_checkpoint(bert_head_folders["token"][1] / "archlab", tmp_path / "out", to="marian")


# --- RoBERTa's fine-tuning heads: BERT's token and QA heads, its own sequence classification head ----------------

ROBERTA_HEADS = {
    "sequence": ROBERTA_SEQUENCE_CLASSIFICATION,
    "token": ENCODER_TOKEN_CLASSIFICATION,
    "qa": ENCODER_QUESTION_ANSWERING,
}


@pytest.mark.parametrize("name", ROBERTA_HEADS)
def test_a_roberta_classifier_converts_both_ways(name, tmp_path):
    """`RobertaForSequenceClassification` (its head's dense + tanh as archlab's pooler, `out_proj` as the classifier),
    `RobertaForTokenClassification` and `RobertaForQuestionAnswering` are archlab's encoder heads: the same logits on
    a left-padded batch, the labels carried, and the exported folder holds the very same tensors."""
    torch.manual_seed(0)
    head = ROBERTA_HEADS[name]
    labels = dict(id2label=LABELS, label2id={v: k for k, v in LABELS.items()}) if name != "qa" else {}
    config = RobertaConfig(**{**CASES["roberta"][0].to_dict(), **labels})
    reference = head.stock_class(FAMILIES["roberta"])(config).eval()
    _perturb(reference)
    reference.save_pretrained(tmp_path / "stock")
    convert_checkpoint(tmp_path / "stock", tmp_path / "archlab")
    convert_checkpoint(tmp_path / "archlab", tmp_path / "back", to="roberta")
    model = head.archlab_class.from_pretrained(tmp_path / "archlab").eval()
    assert type(model) is head.archlab_class
    if labels:
        assert model.config.id2label == reference.config.id2label
    _, left, mask, _, _ = _batches(reference.config.pad_token_id)
    inputs = dict(input_ids=left, attention_mask=mask)
    with torch.no_grad():
        ours, theirs = _outputs(model(**inputs)), _outputs(reference(**inputs))
    real = mask.bool() if name != "sequence" else torch.ones(ours.shape[0], dtype=torch.bool)
    assert (ours - theirs)[real].abs().max().item() <= ATOL

    back = type(reference).from_pretrained(tmp_path / "back").eval()
    assert json.loads((tmp_path / "back" / "config.json").read_text())["architectures"] == [type(reference).__name__]
    theirs, ours = reference.state_dict(), back.state_dict()
    assert ours.keys() == theirs.keys()
    assert [k for k in theirs if not torch.equal(ours[k], theirs[k])] == []


def test_a_roberta_sequence_classifier_is_not_read_as_berts(tmp_path):
    """BERT's sequence classifier head (`bert.pooler`) is not RoBERTa's; a classifier without the pooler is refused
    by `--to roberta` with the field named."""
    assert ENCODER_SEQUENCE_CLASSIFICATION.stock_class(FAMILIES["roberta"]) is None
    config = EncoderForSequenceClassification.config_class(
        **{**FAMILIES["roberta"].archlab_config(CASES["roberta"][0]).to_dict(), "classifier_pooler": False}
    )
    EncoderForSequenceClassification(config).save_pretrained(tmp_path / "classifier")
    with pytest.raises(ConversionError, match="classifier_pooler=False"):
        convert_checkpoint(tmp_path / "classifier", tmp_path / "out", to="roberta")


@pytest.mark.parametrize("family", ["bert", "roberta"])
def test_a_sequence_classifier_drops_out_as_the_stock_head_in_training(family, tmp_path):
    """RoBERTa's head applies its dropout twice (before its dense + tanh, and before `out_proj`), BERT's once (after
    the pooler): a converted classifier in training, seeded as the stock one, draws the same masks in the same order
    and gives the same logits and loss (the encoder's dropouts off, the classifier's 0.3)."""
    torch.manual_seed(0)
    head = {"bert": ENCODER_SEQUENCE_CLASSIFICATION, "roberta": ROBERTA_SEQUENCE_CLASSIFICATION}[family]
    dropouts = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, classifier_dropout=0.3)
    config = type(CASES[family][0])(**{**CASES[family][0].to_dict(), **dropouts, "id2label": LABELS})
    reference = head.stock_class(FAMILIES[family])(config)
    _perturb(reference)
    reference.save_pretrained(tmp_path / "stock")
    convert_checkpoint(tmp_path / "stock", tmp_path / "archlab")
    model = EncoderForSequenceClassification.from_pretrained(tmp_path / "archlab")
    assert model.config.classifier_dropout_before_pooler == (family == "roberta")
    _, left, mask, _, _ = _batches(config.pad_token_id)
    inputs = dict(input_ids=left, attention_mask=mask, labels=torch.tensor([0, 2, 1]))
    outputs = []
    for classifier in (model.train(), reference.train()):
        torch.manual_seed(1)
        outputs.append(classifier(**inputs))
    ours, theirs = outputs
    assert (ours.logits - theirs.logits).abs().max().item() <= ATOL
    assert abs(ours.loss.item() - theirs.loss.item()) <= ATOL
    with torch.no_grad():  # the dropout is at work
        assert (model.eval()(**inputs).logits - ours.logits).abs().max().item() > 1e-2


def test_phi3_longrope_short_sequences_use_the_short_factors(folders):
    """Within `original_max_position_embeddings` longrope rotates by the short factors (the case's 12-token batches
    use the long ones), and a long forward after a short one switches back, in both models."""
    reference, root = folders["phi3-longrope"]
    model = DecoderForCausalLM.from_pretrained(root / "archlab").eval()
    ids = torch.randint(3, VOCAB, (2, 20), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        for length in (6, 20, 6):
            assert (model(ids[:, :length]).logits - reference(ids[:, :length]).logits).abs().max() <= ATOL, length


@pytest.mark.parametrize("case", CASES)
def test_a_converted_folder_loads_without_missing_or_unexpected_weights(case, folders):
    """The archlab folder holds exactly the model's weights (no tensor left random, none ignored), and so does the
    folder exported back for the stock class."""
    _, root = folders[case]
    family = _family(case)
    for model_class, folder in ((family.archlab_class, "archlab"), (family.model_class, "back")):
        _, info = model_class.from_pretrained(root / folder, output_loading_info=True)
        assert {k: v for k, v in info.items() if v} == {}, (folder, info)


def test_a_qwen3_moe_folder_trains_with_the_stock_load_balancing_loss(tmp_path):
    """With `output_router_logits`, the converted model's load-balancing loss and total loss are the stock ones, on a
    plain and a left-padded batch (the mask weighs the router statistics in both)."""
    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        **{**CASES["qwen3_moe"][0].to_dict(), "output_router_logits": True, "router_aux_loss_coef": 0.5}
    )
    reference = FAMILIES["qwen3_moe"].model_class(config).eval()
    _perturb(reference)
    reference.save_pretrained(tmp_path / "stock")
    convert_checkpoint(tmp_path / "stock", tmp_path / "archlab")
    model = DecoderForCausalLM.from_pretrained(tmp_path / "archlab").eval()
    ids, padded, mask, _, _ = _batches(0)
    with torch.no_grad():
        for inputs in (dict(input_ids=ids), dict(input_ids=padded, attention_mask=mask)):
            ours, theirs = model(**inputs, labels=inputs["input_ids"]), reference(**inputs, labels=inputs["input_ids"])
            torch.testing.assert_close(ours.aux_loss, theirs.aux_loss, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(ours.loss, theirs.loss, rtol=1e-5, atol=1e-6)


def test_a_gpt_oss_checkpoint_with_mxfp4_experts_is_refused_with_the_way_to_convert_it(folders, tmp_path):
    """The published GPT-OSS checkpoints hold their experts as MXFP4 blocks and scales: refused by name, saying how
    to get a bf16 folder, before anything is written."""
    from safetensors.torch import load_file, save_file

    stock = folders["gpt_oss"][1] / "stock"
    quantised = tmp_path / "quantised"
    quantised.mkdir()
    (quantised / "config.json").write_text((stock / "config.json").read_text())
    weights = load_file(stock / "model.safetensors")
    for key in [key for key in weights if key.endswith("experts.gate_up_proj")]:
        blocks = weights.pop(key).to(torch.uint8)
        weights[f"{key}_blocks"], weights[f"{key}_scales"] = blocks, blocks[..., :1].clone()
    save_file(weights, quantised / "model.safetensors")
    with pytest.raises(
        ConversionError, match=r"MXFP4-quantised experts \(model\.layers\.0\.mlp\.experts\.gate_up_proj_"
    ):
        convert_checkpoint(quantised, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "method, stored",
    [
        ("fp8", "block-scaled"),  # DeepSeek-V3, Kimi K2: float8 weights, a scale per 128 x 128 block
        ("gptq", "packed"),  # packed integers beside the scales, no float8
        (None, "block-scaled"),  # no quantization_config: float8 tensors are enough to tell
    ],
)
def test_a_checkpoint_with_quantized_weights_is_refused_by_its_method(folders, tmp_path, method, stored):
    """A folder whose linear weights are stored quantized (FP8 with block scales, GPTQ's packed integers) is refused
    before anything is converted or written, naming the method and a tensor and saying how to get a floating-point
    copy (it used to fail on the model's unexpected keys, naming a scale tensor)."""
    from safetensors.torch import load_file, save_file

    stock = folders["llama"][1] / "stock"
    quantized = tmp_path / "quantized"
    quantized.mkdir()
    values = json.loads((stock / "config.json").read_text())
    if method:
        values["quantization_config"] = {"quant_method": method}
    (quantized / "config.json").write_text(json.dumps(values))
    weights = load_file(stock / "model.safetensors")
    for key in [key for key in weights if key.endswith("proj.weight")]:
        if stored == "block-scaled":
            weights[key] = weights[key].to(torch.float8_e4m3fn)
            weights[f"{key}_scale_inv"] = torch.ones(1, 1)
        else:
            weight = weights.pop(key)
            base = key[: -len(".weight")]
            weights[f"{base}.qweight"] = torch.zeros(weight.shape[1] // 8, weight.shape[0], dtype=torch.int32)
            weights[f"{base}.scales"] = torch.ones(1, weight.shape[0], dtype=torch.float16)
    save_file(weights, quantized / "model.safetensors")
    named = rf"{method}-quantized weights" if method else "quantized weights"
    with pytest.raises(ConversionError, match=rf"holds {named} \(model\.layers\.0\..*dequantize=True"):
        convert_checkpoint(quantized, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def _bitnet_folder(folders, tmp_path, **quantization) -> Path:
    """The bitnet case's stock folder with `quantization_config` {quant_method: bitnet, **quantization}."""
    folder = tmp_path / "quantized"
    shutil.copytree(folders["bitnet"][1] / "stock", folder)
    values = json.loads((folder / "config.json").read_text())
    values["quantization_config"] = {"quant_method": "bitnet", **quantization}
    (folder / "config.json").write_text(json.dumps(values))
    return folder


def test_an_online_bitnet_folder_converts_to_bitlinear_both_ways(folders, tmp_path):
    """Microsoft's bf16 BitNet b1.58 folder form (`autobitlinear`, online: full-precision weights made ternary in each
    forward, with 8-bit activations): archlab's `bitlinear=True`, the logits of transformers' quantized model, and
    back to a folder that transformers loads quantized again, with the same logits."""
    online = ONLINE
    stock = _bitnet_folder(folders, tmp_path, **online)
    convert_checkpoint(stock, tmp_path / "archlab")
    ours = DecoderForCausalLM.from_pretrained(tmp_path / "archlab").eval()
    assert ours.config.bitlinear and ours.config.sub_layer_norm
    convert_checkpoint(tmp_path / "archlab", tmp_path / "back", to="bitnet")
    exported = json.loads((tmp_path / "back" / "config.json").read_text())["quantization_config"]
    assert {key: exported[key] for key in ("quant_method", *online)} == {"quant_method": "bitnet", **online}
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    plain = folders["bitnet"][0](ids).logits  # the same weights unquantized
    with torch.no_grad(), torch._dynamo.config.patch(disable=True):  # (transformers compiles its quantizers)
        logits = ours(ids).logits
        for folder in (stock, tmp_path / "back"):
            reference = transformers.BitNetForCausalLM.from_pretrained(folder).eval()
            assert type(reference.model.layers[0].mlp.down_proj).__name__ == "AutoBitLinear"
            assert (logits - reference(ids).logits).abs().max().item() <= ATOL
    assert (logits - plain).abs().max().item() > 0.01  # quantized: another model than the plain weights


def _offline_bitnet_folder(folders, tmp_path, linear_class: str, packed: bool) -> Path:
    """The bitnet case's stock weights as an offline BitNet folder (transformers' layout: each projection's ternary
    weight, packed four to a byte by transformers' `pack_weights` or as floats, and its `weight_scale`: the inverse
    of the weight's mean magnitude for `BitLinear`, the mean magnitude for `AutoBitLinear`, which scales its bias
    too), computing what the online folder of the same weights computes."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.bitnet import pack_weights

    folder = _bitnet_folder(folders, tmp_path, linear_class=linear_class, quantization_mode="offline")
    weights = load_file(folder / "model.safetensors")
    for key in [key for key in weights if key.endswith("proj.weight")]:
        mean = weights[key].abs().mean()
        ternary = (weights[key] / mean).round().clamp(-1, 1)
        weights[key] = pack_weights(ternary.to(torch.int8)) if packed else ternary
        weights[f"{key}_scale"] = (1 / mean if linear_class == "bitlinear" else mean).reshape(1)
        bias = key.removesuffix("weight") + "bias"
        if linear_class == "autobitlinear" and bias in weights:  # its layer scales the bias with the product
            weights[bias] = weights[bias] / mean
    save_file(weights, folder / "model.safetensors")
    return folder


@pytest.mark.parametrize(
    "linear_class, packed", [("bitlinear", True), ("autobitlinear", True), ("autobitlinear", False)]
)
def test_an_offline_bitnet_folder_converts_to_the_weights_bitlinear_makes_the_same_ternary_weights_of(
    folders, tmp_path, linear_class, packed
):
    """The offline forms (`bitnet-b1.58-2B-4T`'s packed ternary weights with a scale each, transformers' `BitLinear`
    dividing by it, `AutoBitLinear` multiplying; or unpacked ternary floats): archlab's `bitlinear=True` with the
    logits of transformers' offline model, exported as an online folder with them too."""
    offline = _offline_bitnet_folder(folders, tmp_path, linear_class, packed)
    convert_checkpoint(offline, tmp_path / "archlab")
    ours = DecoderForCausalLM.from_pretrained(tmp_path / "archlab").eval()
    assert ours.config.bitlinear and ours.model.layers[0].mlp.down_proj.weight.dtype == torch.float32
    convert_checkpoint(tmp_path / "archlab", tmp_path / "back", to="bitnet")
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), torch._dynamo.config.patch(disable=True):  # (transformers compiles its quantizers)
        logits = ours(ids).logits
        for folder, layer in (
            (offline, "BitLinear" if linear_class == "bitlinear" else "AutoBitLinear"),
            (tmp_path / "back", "AutoBitLinear"),
        ):
            reference = transformers.BitNetForCausalLM.from_pretrained(folder).eval()
            assert type(reference.model.layers[0].mlp.down_proj).__name__ == layer
            assert (logits - reference(ids).logits).abs().max().item() <= ATOL
    # the same ternary weights and scales as the online folder of the weights they were made from
    convert_checkpoint(_bitnet_folder(folders, tmp_path / "online", **ONLINE), tmp_path / "from-online")
    with torch.no_grad():
        online = DecoderForCausalLM.from_pretrained(tmp_path / "from-online").eval()(ids).logits
    assert (logits - online).abs().max().item() <= ATOL


ONLINE = dict(linear_class="autobitlinear", quantization_mode="online")


def test_an_offline_bitnet_folder_whose_weights_are_not_ternary_is_refused(folders, tmp_path):
    """An offline `AutoBitLinear` folder with floats other than -1, 0 and 1 computes with them as they are: not a
    BitLinear model; refused by the tensor's name, nothing written."""
    from safetensors.torch import load_file, save_file

    folder = _offline_bitnet_folder(folders, tmp_path, "autobitlinear", packed=False)
    weights = load_file(folder / "model.safetensors")
    weights["model.layers.1.mlp.up_proj.weight"][0, 0] = 0.5
    save_file(weights, folder / "model.safetensors")
    with pytest.raises(ConversionError, match=r"model\.layers\.1\.mlp\.up_proj\.weight holds values other than"):
        convert_checkpoint(folder, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "quantization, named",
    [
        ({"linear_class": "ternarylinear"}, "linear_class='ternarylinear'"),
        ({**ONLINE, "use_rms_norm": True}, "use_rms_norm=True"),
        ({**ONLINE, "modules_to_not_convert": ["lm_head", "model.layers.0.self_attn.q_proj"]}, "modules_to_not"),
    ],
)
def test_bitnet_folders_archlab_does_not_compute_are_refused(folders, tmp_path, quantization, named):
    """A linear class transformers does not know, a BitLinear with its own RMSNorm and a projection left in full
    precision are refused by name, nothing written."""
    with pytest.raises(ConversionError, match=rf"bitnet checkpoint.*{re.escape(named)}"):
        convert_checkpoint(_bitnet_folder(folders, tmp_path, **quantization), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_granite_swa_folder_rotating_layers_of_one_type_with_two_bases_is_refused(tmp_path):
    """Granite SWA's `layer_rope_theta` gives each layer a base; archlab gives each layer type one: two global layers
    with different bases are refused by name, nothing written."""
    from transformers import GraniteSWAForCausalLM

    config = GraniteSWAConfig(
        **{**QWEN2_SHAPE, "num_hidden_layers": 3},
        sliding_window=4,
        layer_types=["full_attention", "sliding_attention", "full_attention"],
        layer_rope_theta=[1e6, 1e4, 5e5],
    )
    GraniteSWAForCausalLM(config).save_pretrained(tmp_path / "stock")
    with pytest.raises(
        ConversionError, match=r"granite_swa checkpoint.*layer_rope_theta=\[1000000\.0, 10000\.0, 500000"
    ):
        convert_checkpoint(tmp_path / "stock", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_kimi_k2_folder_converts_as_deepseek_v3(folders, tmp_path):
    """Kimi K2's folders say `model_type` "kimi_k2" (the config class of their remote code), with DeepSeek-V3's
    fields and `DeepseekV3ForCausalLM` as architecture: the converter reads them as DeepSeek-V3's (as transformers
    reads Kimi K2.5's text model), giving the same archlab folder."""
    from safetensors.torch import load_file

    reference, root = folders["deepseek_v3"]
    kimi = tmp_path / "kimi"
    shutil.copytree(root / "stock", kimi)
    values = json.loads((kimi / "config.json").read_text())
    (kimi / "config.json").write_text(json.dumps({**values, "model_type": "kimi_k2"}))
    convert_checkpoint(kimi, tmp_path / "archlab")
    ours, theirs = (load_file(folder / "model.safetensors") for folder in (tmp_path / "archlab", root / "archlab"))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[key], theirs[key]) for key in ours)
    model = DecoderForCausalLM.from_pretrained(tmp_path / "archlab").eval()
    ids = torch.randint(3, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (model(ids).logits - reference(ids).logits).abs().max() <= ATOL


# a tiny vision tower beside the text stack of a Llama 4 multimodal folder (the converter leaves it out)
LLAMA4_VISION = dict(
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    image_size=28,
    patch_size=14,
    vision_output_dim=32,
    projector_input_dim=32,
    projector_output_dim=32,
)


def test_a_llama4_multimodal_folder_imports_its_language_model(tmp_path):
    """Llama 4 is published as `Llama4ForConditionalGeneration` folders: the converter reads the language model (its
    `text_config`, its tensors under `language_model.`) and leaves the vision tower out; the archlab model gives the
    stock language model's logits and greedy tokens. Exporting goes to `llama4_text` (the multimodal class is not a
    target), and a `--to` on such a folder is refused."""
    from transformers import Llama4Config, Llama4ForConditionalGeneration

    torch.manual_seed(0)
    text = CASES["llama4_text"][0].to_dict()
    stock = Llama4ForConditionalGeneration(Llama4Config(text_config=text, vision_config=LLAMA4_VISION)).eval()
    _perturb(stock)
    stock.save_pretrained(tmp_path / "stock")
    convert_checkpoint(tmp_path / "stock", tmp_path / "archlab")
    with pytest.raises(ConversionError, match="its language model converts to archlab only"):
        convert_checkpoint(tmp_path / "stock", tmp_path / "elsewhere", to="llama4_text")
    model = DecoderForCausalLM.from_pretrained(tmp_path / "archlab").eval()
    assert model.config.attn_temperature_tuning and model.config.routing_weights_on_input
    reference = stock.language_model
    pad = reference.config.pad_token_id or 0
    with torch.no_grad():
        assert max(_check_decoder(model, reference, _batches(pad), pad)) <= ATOL
    convert_checkpoint(tmp_path / "archlab", tmp_path / "text", to="llama4_text")
    back = FAMILIES["llama4_text"].model_class.from_pretrained(tmp_path / "text")
    theirs = reference.state_dict()
    assert back.state_dict().keys() == theirs.keys()
    assert all(torch.equal(tensor, theirs[key]) for key, tensor in back.state_dict().items())


# multimodal model type -> the case whose stock config is its language model (the class's default text family)
LLAVA_STYLE = {
    "gemma3": "gemma3_text",
    "mistral3": "mistral",
    "llava": "llama",
    "llava_next": "llama",
    "llava_onevision": "qwen2",
    "vipllava": "llama",
    "aya_vision": "cohere2",
    "internvl": "qwen2",
}


def _llava_style(model_type: str, case: str | None = None) -> torch.nn.Module:
    """A tiny multimodal model of a LLaVA-style class whose language model is the `case`'s stock config (its default
    text family's case) beside a one-layer vision tower of its default kind; its parameters random."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    vision_class = type(AutoConfig.for_model(model_type).vision_config)
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    if vision_class.model_type == "internvl_vision":
        vision.update(image_size=[28, 28], patch_size=[14, 14])
    else:
        vision.update(image_size=28, patch_size=14, **({"head_dim": 8} if vision_class.model_type == "pixtral" else {}))
    extra = {"vision_feature_layers": [-1]} if model_type == "vipllava" else {}
    config = AutoConfig.for_model(
        model_type,
        text_config=CASES[case or LLAVA_STYLE[model_type]][0].to_dict(),
        vision_config=vision_class(**vision).to_dict(),
        **extra,
    )
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config).eval()
    _perturb(model)
    return model


@pytest.mark.parametrize(
    "model_type, case",
    [*sorted(LLAVA_STYLE.items()), ("mistral3", "ministral3")],  # (Ministral 3's folders: its text config names it)
)
def test_a_llava_style_multimodal_folder_imports_its_language_model(tmp_path, model_type, case):
    """Gemma 3 (4B-27B), Mistral Small 3.1, LLaVA (1.5, NeXT, OneVision, ViP), Aya Vision and InternVL are published
    as multimodal folders: the converter reads the language model (the `text_config`, its tensors as published and
    saved, `language_model.model.*`, or under the modules' names, `model.language_model.*`), and the archlab model
    gives the multimodal model's logits and greedy tokens on text (left padding included; Gemma 3's multimodal
    class never softcaps its logits; the head tied as the outer config says)."""
    from safetensors.torch import load_file, save_file

    stock = _llava_style(model_type, case)
    stock.save_pretrained(tmp_path / "stock")
    convert_checkpoint(tmp_path / "stock", tmp_path / "archlab")
    model = DecoderForCausalLM.from_pretrained(tmp_path / "archlab").eval()
    assert model.config.tie_word_embeddings == stock.config.tie_word_embeddings
    pad = stock.config.get_text_config().pad_token_id or 0
    with torch.no_grad():
        assert max(_check_decoder(model, stock, _batches(pad), pad)) <= ATOL
    # transformers saves the published layout (the language model under `language_model.`, the tower and projector
    # at the top); its modules' own names (`model.language_model.*`, `lm_head.*`, `model.vision_tower.*`) read too
    assert all(not key.startswith("model.") for key in load_file(tmp_path / "stock" / "model.safetensors"))
    modules = tmp_path / "modules"
    shutil.copytree(tmp_path / "stock", modules)
    names = {"language_model.model.": "model.language_model.", "language_model.lm_head.": "lm_head.", "": "model."}
    tensors = {}
    for key, tensor in load_file(modules / "model.safetensors").items():
        stored, renamed = next((old, new) for old, new in names.items() if key.startswith(old))
        tensors[renamed + key[len(stored) :]] = tensor
    assert any(key.startswith("model.vision_tower.") for key in tensors)
    save_file(tensors, modules / "model.safetensors")
    convert_checkpoint(modules, tmp_path / "from-modules")
    ours = load_file(tmp_path / "archlab" / "model.safetensors")
    again = load_file(tmp_path / "from-modules" / "model.safetensors")
    assert ours.keys() == again.keys() and all(torch.equal(ours[key], again[key]) for key in ours)


# multimodal model type -> (the case whose stock config is its language model, its vision tower's config)
QWEN_VL = {
    "qwen2_vl": ("qwen2", dict(depth=1, embed_dim=16, num_heads=2, hidden_size=32)),
    "qwen2_5_vl": ("qwen2", dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32)),
    "qwen3_vl": (
        "qwen3",
        dict(
            depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, deepstack_visual_indexes=[0]
        ),
    ),
}


@pytest.mark.parametrize("model_type", sorted(QWEN_VL))
def test_a_qwen_vl_folder_imports_its_language_model(tmp_path, model_type):
    """Qwen2-VL, Qwen2.5-VL and Qwen3-VL: their language model is Qwen2's / Qwen3's, its RoPE in sections (t, h, w)
    that text alone gives the same position, the plain RoPE (Qwen3-VL's attention has no window: the qwen3 case's
    is left out, and the import drops one its text config would name). The archlab model gives the multimodal
    model's logits and greedy tokens on text; the published Qwen2-VL layout (the text fields at the top of
    Qwen2-VL's and Qwen2.5-VL's config.json, the layers at `model.layers.*`, the tower at `visual.*`) and the
    modules' one (`model.language_model.*`, `model.visual.*`) give the same folder."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, AutoModelForImageTextToText

    case, vision = QWEN_VL[model_type]
    text = CASES[case][0].to_dict()
    if model_type == "qwen3_vl":  # its attention has no window (its cache would still keep the window's keys only)
        text.update(use_sliding_window=False, sliding_window=None, layer_types=["full_attention"] * 2)
    half = (text.get("head_dim") or 8) // 2  # the frequencies, in sections for t, h and w
    text["rope_parameters"] = {
        **text["rope_parameters"],
        "mrope_section": [half - 2 * (half // 4), half // 4, half // 4],
    }
    torch.manual_seed(0)
    stock = AutoModelForImageTextToText.from_config(
        AutoConfig.for_model(model_type, text_config=text, vision_config=vision)
    ).eval()
    _perturb(stock)
    stock.save_pretrained(tmp_path / "stock")
    convert_checkpoint(tmp_path / "stock", tmp_path / "archlab")
    model = DecoderForCausalLM.from_pretrained(tmp_path / "archlab").eval()
    assert model.config.model_type == "archlab_decoder" and "mrope_section" not in str(model.config.rope_parameters)
    with torch.no_grad():
        assert max(_check_decoder(model, stock, _batches(0), 0)) <= ATOL
    tensors = load_file(tmp_path / "stock" / "model.safetensors")
    nested = any(key.startswith("model.language_model.") for key in tensors)
    other = tmp_path / "other-layout"
    shutil.copytree(tmp_path / "stock", other)
    if nested:  # (Qwen3-VL saves the modules' names) -> the layers at the top, the tower at `visual.*`
        names = {"model.language_model.": "model.", "model.visual.": "visual."}
    else:  # (Qwen2-VL saves the published layout) -> the modules' names
        names = {"model.": "model.language_model.", "visual.": "model.visual."}
    names["lm_head."] = "lm_head."
    renamed = {}
    for key, tensor in tensors.items():
        stored, new = next((old, new) for old, new in names.items() if key.startswith(old))
        renamed[new + key[len(stored) :]] = tensor
    save_file(renamed, other / "model.safetensors")
    values = json.loads((other / "config.json").read_text())
    if model_type != "qwen3_vl":  # the published Qwen2-VL / Qwen2.5-VL config.json: the text fields at the top
        values.update({key: value for key, value in values.pop("text_config").items() if key != "model_type"})
    (other / "config.json").write_text(json.dumps(values))
    convert_checkpoint(other, tmp_path / "from-other")
    ours = load_file(tmp_path / "archlab" / "model.safetensors")
    again = load_file(tmp_path / "from-other" / "model.safetensors")
    assert ours.keys() == again.keys() and all(torch.equal(ours[key], again[key]) for key in ours)


def test_a_multimodal_folder_whose_language_model_is_no_family_is_refused(tmp_path):
    """A LLaVA folder whose `text_config` names a model type the converter does not know: refused by name."""
    stock = _llava_style("llava")
    stock.save_pretrained(tmp_path / "stock")
    values = json.loads((tmp_path / "stock" / "config.json").read_text())
    values["text_config"]["model_type"] = "jamba"
    (tmp_path / "stock" / "config.json").write_text(json.dumps(values))
    with pytest.raises(ConversionError, match="llava checkpoint whose language model is 'jamba'"):
        convert_checkpoint(tmp_path / "stock", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_sharded_llama4_multimodal_folder_reads_only_its_language_model(tmp_path):
    """A sharded multimodal folder (an index naming the shards): the language model's tensors are gathered from every
    shard; a folder whose tensors hold no language model is refused by name, nothing written."""
    from safetensors.torch import load_file, save_file
    from transformers import Llama4Config, Llama4ForConditionalGeneration

    torch.manual_seed(0)
    stock = Llama4ForConditionalGeneration(
        Llama4Config(text_config=CASES["llama4_text"][0].to_dict(), vision_config=LLAMA4_VISION)
    ).eval()
    stock.save_pretrained(tmp_path / "stock", max_shard_size="200KB")
    assert (tmp_path / "stock" / "model.safetensors.index.json").is_file()
    convert_checkpoint(tmp_path / "stock", tmp_path / "archlab")
    model = DecoderForCausalLM.from_pretrained(tmp_path / "archlab").eval()
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (model(ids).logits - stock.language_model(ids).logits).abs().max() <= ATOL
    vision_only = tmp_path / "vision-only"
    vision_only.mkdir()
    (vision_only / "config.json").write_text((tmp_path / "stock" / "config.json").read_text())
    tensors = {}
    for shard in sorted((tmp_path / "stock").glob("*.safetensors")):
        tensors.update({k: v for k, v in load_file(str(shard)).items() if not k.startswith("language_model.")})
    save_file(tensors, str(vision_only / "model.safetensors"))
    with pytest.raises(ConversionError, match="no tensors under `language_model.` \\(its language model\\)"):
        convert_checkpoint(vision_only, tmp_path / "out")
    assert not (tmp_path / "out").exists()
