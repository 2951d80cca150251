"""The families the converter knows: one `Family` row each, by `model_type`.

The Llama-like decoders (Llama, Mistral, Ministral, Mixtral, Gemma, Gemma2, Gemma3, Qwen2, Qwen2-MoE, Qwen3, Qwen3-MoE,
OLMo 2, OLMo 3, SmolLM3, EXAONE 4, Helium, Arcee, Seed-OSS) differ from Llama only in which config fields they have and
what they fix; their weights have archlab's names already (archlab uses Llama's, Gemma2's and OLMo 2's), except the
per-expert modules of Mixtral's, Qwen2-MoE's and Qwen3-MoE's saved checkpoints (`experts.py`) and Helium's q/k rows (its
interleaved RoPE, `interleaved_rope.py`). GLM and GLM-4 (fused gate/up, interleaved RoPE) live in `glm.py`, Granite,
GraniteMoE and GraniteMoE-Shared (μP's multipliers, fused experts) in `granite.py`, Cohere and Cohere2 (parallel blocks,
interleaved RoPE, a logit scale) in `cohere.py`, OLMoE and FlexOlmo in `olmoe.py`, CWM, ERNIE 4.5 and Jais 2 in
`llama_like.py` (VaultGemma, Gemma2 as a pre-norm block, is here); the decoders with their own names, fused q/k/v and
Conv1D weights (GPT-2, OpenAI-GPT, GPT-NeoX, Falcon, BLOOM, MPT) in `fused_decoders.py`; StableLM, Phi, OPT, StarCoder2
and GPT-J in `layernorm_decoders.py`; Phi-3 (fused q/k/v and gate/up) in `phi3.py`; the encoder-decoders in `marian.py`,
`bart.py`, `mbart.py` and `t5.py`; BERT and RoBERTa (as `EncoderForMaskedLM`) in `bert.py` and `roberta.py`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from transformers import (
    ArceeConfig,
    ArceeForCausalLM,
    Exaone4Config,
    Exaone4ForCausalLM,
    ExaoneMoeConfig,
    ExaoneMoeForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GemmaConfig,
    GemmaForCausalLM,
    HeliumConfig,
    HeliumForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MellumConfig,
    MellumForCausalLM,
    MinistralConfig,
    MinistralForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Olmo2Config,
    Olmo2ForCausalLM,
    Olmo3Config,
    Olmo3ForCausalLM,
    PreTrainedConfig,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    SeedOssConfig,
    SeedOssForCausalLM,
    SmolLM3Config,
    SmolLM3ForCausalLM,
    VaultGemmaConfig,
    VaultGemmaForCausalLM,
)

from ..modeling import DecoderForCausalLM
from .bart import BART
from .bert import BERT
from .bitnet import BITNET
from .checks import (
    head_dim_given,
    head_dim_to_write,
    one_window_for_every_layer,
    qkv_bias_of,
    refuse_export,
    refuse_import,
    setting,
)
from .cohere import COHERE_FAMILIES
from .deepseek_mla import DEEPSEEK_MLA_FAMILIES
from .deepseek_moe import (
    DEEPSEEK_MOE_FAMILIES,
    DEEPSEEK_ROUTER,
    ROUTER_GROUPS,
    shared_expert_from_archlab,
    shared_expert_to_archlab,
)
from .experts import MIXTRAL_LAYOUT, QWEN2_MOE_LAYOUT
from .family import IDENTITY, ConversionError, Family, Layout, StateDict, renamed, same
from .field_lists import LLAMA_FIELDS
from .fused_decoders import FUSED_DECODERS
from .glm import GLM_FAMILIES
from .gpt_oss import GPT_OSS
from .granite import GRANITE_FAMILIES
from .hunyuan import HUNYUAN_FAMILIES
from .interleaved_rope import interleaved_rope
from .layernorm_decoders import LAYERNORM_DECODERS
from .llama4 import LLAMA4_TEXT
from .llama_like import LLAMA_LIKE_FAMILIES
from .marian import MARIAN
from .mbart import MBART
from .ministral3 import MINISTRAL3
from .olmo import OLMO
from .olmoe import OLMOE_FAMILIES
from .phi3 import PHI3
from .roberta import ROBERTA
from .t5 import T5_VARIANTS, t5_family

# MistralConfig: Llama's fields without the bias flags, plus `sliding_window`, which makes every layer local.
MISTRAL_FIELDS = tuple(name for name in LLAMA_FIELDS if name not in ("attention_bias", "mlp_bias")) + (
    "sliding_window",
)
# MixtralConfig: Mistral's fields plus the mixture of experts. Every layer is sparse, each expert is
# `intermediate_size` wide, the top-k weights are always renormalised (archlab: `norm_topk_prob=True`).
MIXTRAL_FIELDS = MISTRAL_FIELDS + (
    "num_local_experts",
    "num_experts_per_tok",
    "output_router_logits",
    "router_aux_loss_coef",
    "router_jitter_noise",
)

# Gemma: Llama's fields without mlp_bias, and a (1 + w) RMSNorm and sqrt(hidden) embedding scale always.
GEMMA_FIELDS = tuple(name for name in LLAMA_FIELDS if name != "mlp_bias")
GEMMA_IMPLIED = {"norm_type": "offset_rms_norm", "scale_embedding": True}
# Gemma2: Gemma's, its activation named `hidden_activation`, plus the sandwich norm, soft-capping and local layers.
GEMMA2_FIELDS = {
    **same(
        *(name for name in GEMMA_FIELDS if name != "hidden_act"),
        "query_pre_attn_scalar",
        "sliding_window",
        "layer_types",
        "attn_logit_softcapping",
        "final_logit_softcapping",
    ),
    "hidden_activation": "hidden_act",
}
# Gemma3 (text): Gemma2's, plus QK-norm always (a (1 + w) RMSNorm over each head's queries and keys, archlab's
# `use_qk_norm` under `offset_rms_norm`), and RoPE as one parameter set per layer type (`_gemma3_to_archlab`: its local
# layers have their own base, 10k where the global ones have 1M). Gemma3TextConfig has `attn_logit_softcapping`, but
# Gemma3's attention (transformers 5.24) never passes it on: a value is refused (archlab's would cap the scores).
GEMMA3_FIELDS = {
    name: ours for name, ours in GEMMA2_FIELDS.items() if name not in ("rope_parameters", "attn_logit_softcapping")
}
GEMMA3_LAYER_TYPES = ("full_attention", "sliding_attention")
# Qwen3: Gemma's field list (no mlp_bias) with Mistral's window, and QK-norm always.
QWEN3_FIELDS = GEMMA_FIELDS + ("sliding_window", "layer_types")
# Qwen2: Llama's without the bias flags and head_dim, with Qwen3's window; q/k/v always have a bias, the output
# projection never (archlab: `qkv_bias=True`). Its config has no `head_dim` field but its attention and RoPE read one
# from config.json (`head_dim_given`), else hidden / heads.
QWEN2_FIELDS = tuple(name for name in MISTRAL_FIELDS if name != "head_dim") + ("layer_types",)
# Qwen2-MoE: Qwen2's, its own `qkv_bias` flag, and the experts (`num_experts` is archlab's `num_local_experts`; every
# sparse layer also has a gated shared expert). Which layers are sparse is computed (`_qwen2_moe_to_archlab`).
# the routed experts' fields of Qwen2-MoE's config, which Qwen3-MoE and Mellum copy (`num_experts` archlab's
# `num_local_experts`)
QWEN_MOE_EXPERT_FIELDS = (
    "moe_intermediate_size",
    "num_experts_per_tok",
    "norm_topk_prob",
    "output_router_logits",
    "router_aux_loss_coef",
)
QWEN2_MOE_FIELDS = {
    **same(*QWEN2_FIELDS, "qkv_bias", "shared_expert_intermediate_size", *QWEN_MOE_EXPERT_FIELDS),
    "num_experts": "num_local_experts",
}
# Qwen3-MoE: Qwen3's attention (QK-norm always; `attention_bias` on q/k/v/o; no `layer_types`, its window on every
# layer) with Qwen2-MoE's sparse layers without the shared expert. Its config has no `head_dim` field but its
# attention reads one from config.json (Qwen3-30B-A3B: 128, not hidden / heads = 64): `_qwen3_moe_to_archlab`.
QWEN3_MOE_FIELDS = {
    **same(*(name for name in MISTRAL_FIELDS if name != "head_dim"), "attention_bias", *QWEN_MOE_EXPERT_FIELDS),
    "num_experts": "num_local_experts",
}

# OLMo 2: Llama's fields without mlp_bias (its MLP never has one) and head_dim (no such field, but its attention and
# RoPE read one from config.json: `_olmo2_to_archlab`); each sub-layer's output normed before the residual add
# (`post_attention_layernorm`, `post_feedforward_layernorm`, archlab's "output" placement) and QK-norm over the whole
# q and k projections (`q_norm` of num_heads · head_dim, `k_norm` of num_kv_heads · head_dim), always.
OLMO2_FIELDS = tuple(name for name in LLAMA_FIELDS if name not in ("mlp_bias", "head_dim"))
OLMO2_IMPLIED = {"norm_position": "output", "use_qk_norm": True, "qk_norm_scope": "projection"}
# SmolLM3: Llama's block without a `head_dim` field (its attention and RoPE read one from config.json, as Qwen2's),
# with every fourth layer NoPE (`no_rope_layers`: per layer 1 rotates, 0 does not; archlab's `nope_layers` lists the
# 0s) and Qwen2's optional window (`use_sliding_window`; its masks slide wherever `layer_types` says so).
SMOLLM3_FIELDS = tuple(name for name in LLAMA_FIELDS if name != "head_dim") + ("layer_types",)
# EXAONE 4: OLMo 2's output norms with QK-norm per head (Qwen3's), no `head_dim` field (its attention reads one from
# config.json), and with a window, its local layers (three in four) rotating and its global ones NoPE
# (`_exaone4_to_archlab`: archlab's `nope_layers` are the global layers then; without a window every layer rotates).
EXAONE4_FIELDS = tuple(name for name in LLAMA_FIELDS if name not in ("head_dim", "attention_bias", "mlp_bias")) + (
    "layer_types",
)
# Helium: Llama's block with RoPE over interleaved channel pairs (`interleaved_rope.py`: its q/k rows reordered),
# `attention_bias` on q/k/v only (its output projection has none: archlab's `qkv_bias`), and an output projection of
# hidden_size columns (so heads × head_dim = hidden_size).
HELIUM_FIELDS = {**same(*(name for name in LLAMA_FIELDS if name != "attention_bias")), "attention_bias": "qkv_bias"}
# Ministral: Mistral's fields with `layer_types` (its local and global layers interleaved, Qwen3's form).
MINISTRAL_FIELDS = MISTRAL_FIELDS + ("layer_types",)
# Arcee (AFM): Llama's block with a plain MLP (up, activation, down: ReLU² by default), no gate.
# Seed-OSS: Llama's block with one bias flag for q/k/v (`attention_bias`, archlab's `qkv_bias`) and one for the output
# projection (`attention_out_bias`, archlab's `attention_bias`); its residual dropout (training only) is dropped.
SEED_OSS_FIELDS = {
    **same(*(name for name in LLAMA_FIELDS if name != "attention_bias")),
    "attention_bias": "qkv_bias",
    "attention_out_bias": "attention_bias",
}
# OLMo 3: OLMo 2's block with sliding-window layers (`layer_types`: three local layers to one global by default), and
# RoPE as one parameter set per layer type, as Gemma3's (`_sets_per_layer_type_to_archlab`: a long-context checkpoint
# scales its global layers' RoPE only).
OLMO3_FIELDS = tuple(name for name in OLMO2_FIELDS if name != "rope_parameters") + ("sliding_window", "layer_types")


def experts_in_every_layer(config: PreTrainedConfig, architecture: str) -> None:
    if config.num_local_experts < 1 or "dense" in config.mlp_layer_types:
        raise ConversionError(
            f"{architecture} has a mixture of experts in every layer; this config has num_local_experts="
            f"{config.num_local_experts} and mlp_layer_types={config.mlp_layer_types}."
        )


def _mistral_from_archlab(config: PreTrainedConfig) -> dict[str, Any]:
    return one_window_for_every_layer(config, "MistralForCausalLM")


def _mixtral_from_archlab(config: PreTrainedConfig) -> dict[str, Any]:
    experts_in_every_layer(config, "MixtralForCausalLM")
    return one_window_for_every_layer(config, "MixtralForCausalLM")


def _causal_only(family: str) -> Callable[[PreTrainedConfig, Mapping[str, Any]], dict[str, Any]]:
    """Gemma/Gemma2's `use_bidirectional_attention` (an encoder use) has no archlab field."""

    def to_archlab(stock: PreTrainedConfig, values: Mapping[str, Any]) -> dict[str, Any]:
        if stock.use_bidirectional_attention:
            refuse_import(family, {setting(stock, "use_bidirectional_attention"): "archlab's decoder is causal"})
        return {}

    return to_archlab


def _gemma_from_archlab(config: PreTrainedConfig) -> dict[str, Any]:
    if config.hidden_act == "gelu":
        refuse_export(
            "GemmaForCausalLM",
            {setting(config, "hidden_act"): "GemmaConfig reads 'gelu' as the tanh approximation 'gelu_pytorch_tanh'"},
        )
    return {}


def _gemma2_from_archlab(config: PreTrainedConfig, architecture: str = "Gemma2ForCausalLM") -> dict[str, Any]:
    scalar = config.query_pre_attn_scalar
    scalar = config.head_dim if scalar is None else scalar  # archlab's None: head_dim^-1/2
    if not float(scalar).is_integer():
        refuse_export(
            architecture,
            {setting(config, "query_pre_attn_scalar"): f"{architecture}'s query_pre_attn_scalar is an integer"},
        )
    # Gemma2Config types the soft-capping values as floats (an int 1 is refused by its strict dataclass)
    capping = {
        name: None if getattr(config, name) is None else float(getattr(config, name))
        for name in ("attn_logit_softcapping", "final_logit_softcapping")
    }
    # Gemma2ForCausalLM always builds its sliding-window mask: with every layer global the window is never used
    window = config.max_position_embeddings if config.sliding_window is None else config.sliding_window
    return {"query_pre_attn_scalar": int(scalar), **capping, "sliding_window": window}


# VaultGemma: Gemma2 without the norms after each sub-layer (a pre-norm block); its MLP's input norm keeps Gemma2's
# name, `pre_feedforward_layernorm`, where archlab's pre-norm block has Llama's `post_attention_layernorm`
VAULTGEMMA_NORMS = ((".pre_feedforward_layernorm.", ".post_attention_layernorm."),)


VAULTGEMMA_LAYOUT = Layout(
    to_archlab=lambda state_dict, config: renamed(state_dict, VAULTGEMMA_NORMS),
    from_archlab=lambda state_dict, config: renamed(state_dict, VAULTGEMMA_NORMS, back=True),
)


def _partial_rotary_sets(rope_parameters: Mapping[str, Any], architecture: str) -> dict[str, str]:
    """Gemma3's and OLMo 3's RoPE rotates every channel of each head (their default RoPE ignores
    `partial_rotary_factor`, the scaled types would rotate fewer channels than the head has): the refusal of a set
    with another factor."""
    return {
        f"rope_parameters[{kind!r}]['partial_rotary_factor']={factor!r}": f"{architecture} rotates every channel of "
        "each head"
        for kind, parameters in rope_parameters.items()
        if isinstance(parameters, Mapping) and (factor := parameters.get("partial_rotary_factor")) not in (None, 1)
    }


def _sets_per_layer_type_to_archlab(stock: PreTrainedConfig, architecture: str) -> tuple[dict[str, Any], dict]:
    """A stock config's RoPE as one set per layer type (Gemma3, OLMo 3): archlab's one flat set where the layers
    present share it (one layer type, or equal sets), else the sets of the layer types present; and the refusals of
    sets with a partial rotary factor."""
    sets = {kind: dict(stock.rope_parameters[kind]) for kind in dict.fromkeys(stock.layer_types)}
    first = next(iter(sets.values()))
    flat = first if all(other == first for other in sets.values()) else sets
    return {"rope_parameters": flat}, _partial_rotary_sets(sets, architecture)


def _sets_per_layer_type_from_archlab(config: PreTrainedConfig, architecture: str) -> dict[str, Any]:
    """A RoPE set for each of the stock layer types: archlab's flat set for both, or its set per layer type (a type no
    layer has takes another's; it is never used); a set with a partial rotary factor is refused."""
    rope = config.rope_parameters
    sets = {kind: value for kind, value in rope.items() if isinstance(value, dict)} or dict.fromkeys(
        GEMMA3_LAYER_TYPES, rope
    )
    refuse_export(architecture, _partial_rotary_sets(sets, architecture))
    present = next(iter(sets.values()))
    return {"rope_parameters": {kind: dict(sets.get(kind, present)) for kind in GEMMA3_LAYER_TYPES}}


def _gemma3_to_archlab(stock: PreTrainedConfig, values: Mapping[str, Any]) -> dict[str, Any]:
    """Gemma3TextConfig holds RoPE as one set per layer type (`_sets_per_layer_type_to_archlab`)."""
    _causal_only("gemma3_text")(stock, values)
    rope, wrong = _sets_per_layer_type_to_archlab(stock, "Gemma3")
    if stock.attn_logit_softcapping is not None:
        wrong[setting(stock, "attn_logit_softcapping")] = (
            "Gemma3ForCausalLM never applies it (its attention does not pass it on), so its logits are not what such "
            "a checkpoint was trained for"
        )
    refuse_import("gemma3_text", wrong)
    return rope


def _gemma3_from_archlab(config: PreTrainedConfig) -> dict[str, Any]:
    """Gemma2's fields, and a RoPE set for each of Gemma3's layer types."""
    if config.attn_logit_softcapping is not None:
        refuse_export(
            "Gemma3ForCausalLM",
            {setting(config, "attn_logit_softcapping"): "Gemma3ForCausalLM never caps the attention scores"},
        )
    rope = _sets_per_layer_type_from_archlab(config, "Gemma3")
    gemma2 = _gemma2_from_archlab(config, "Gemma3ForCausalLM")
    return {**gemma2, "attn_logit_softcapping": None, **rope}


def _qwen3_from_archlab(config: PreTrainedConfig) -> dict[str, Any]:
    return {"use_sliding_window": config.sliding_window is not None}


def _qwen2_from_archlab(config: PreTrainedConfig) -> dict[str, Any]:
    return {**_qwen3_from_archlab(config), **head_dim_to_write(config)}


def _qwen2_moe_to_archlab(stock: PreTrainedConfig, values: Mapping[str, Any]) -> dict[str, Any]:
    """Which layers are sparse: `_sparse_layers`; Qwen2MoeConfig writes `sliding_window=0` when `use_sliding_window`
    is off; the head size config.json gives, as Qwen2's."""
    if stock.shared_expert_intermediate_size < 1 and stock.num_experts > 0:
        refuse_import(
            "qwen2_moe",
            {
                setting(
                    stock, "shared_expert_intermediate_size"
                ): "a zero-width shared expert has no archlab form (0 there means none, without "
                "the stock gate's weights)"
            },
        )
    sliding = "sliding_attention" in stock.layer_types
    return {
        **head_dim_given(stock, values),
        "mlp_layer_types": _sparse_layers(stock),
        "sliding_window": stock.sliding_window if sliding or stock.use_sliding_window else None,
    }


def _sparse_layers(stock: PreTrainedConfig) -> list[str]:
    """Layer i is sparse when the model has experts, i + 1 is a multiple of `decoder_sparse_step` and i is not in
    `mlp_only_layers` (Qwen2-MoE's and Qwen3-MoE's rule)."""
    return [
        "sparse"
        if stock.num_experts > 0 and (i + 1) % stock.decoder_sparse_step == 0 and i not in stock.mlp_only_layers
        else "dense"
        for i in range(stock.num_hidden_layers)
    ]


def _qwen3_moe_to_archlab(stock: PreTrainedConfig, values: Mapping[str, Any]) -> dict[str, Any]:
    """The head size config.json gives (the stock attention and rotary read it), else hidden / heads; Qwen3MoeConfig
    sets `sliding_window=None` when `use_sliding_window` is off, and applies a window to every layer."""
    head_dim = values.get("head_dim") or stock.hidden_size // stock.num_attention_heads
    return {"head_dim": head_dim, "mlp_layer_types": _sparse_layers(stock), "sliding_window": stock.sliding_window}


def _olmo2_to_archlab(stock: PreTrainedConfig, values: Mapping[str, Any]) -> dict[str, Any]:
    """The head size config.json gives (Olmo2Config has no such field; its attention and RoPE read it), else
    hidden / heads."""
    return {"head_dim": values.get("head_dim") or stock.hidden_size // stock.num_attention_heads}


def _olmo2_from_archlab(config: PreTrainedConfig) -> dict[str, Any]:
    return {"head_dim": config.head_dim}


def _smollm3_to_archlab(stock: PreTrainedConfig, values: Mapping[str, Any]) -> dict[str, Any]:
    """The head size config.json gives, the NoPE layers, and the window where `layer_types` has local layers."""
    nope = [index for index, rotates in enumerate(stock.no_rope_layers) if not rotates]
    local = "sliding_attention" in stock.layer_types
    return {
        **head_dim_given(stock, values),
        "nope_layers": nope or None,
        "sliding_window": stock.sliding_window if local else None,
    }


def _smollm3_from_archlab(config: PreTrainedConfig) -> dict[str, Any]:
    nope = set(config.nope_layers or ())
    local = config.sliding_window is not None and "sliding_attention" in config.layer_types
    return {
        **head_dim_to_write(config),
        "no_rope_layers": [int(index not in nope) for index in range(config.num_hidden_layers)],
        "use_sliding_window": local,
        "sliding_window": config.sliding_window if local else None,
    }


def _seed_oss_from_archlab(config: PreTrainedConfig) -> dict[str, Any]:
    return {
        "attention_bias": qkv_bias_of(config),
        "residual_dropout": 0.0,
    }


def _helium_to_archlab(stock: PreTrainedConfig, values: Mapping[str, Any]) -> dict[str, Any]:
    if stock.head_dim * stock.num_attention_heads != stock.hidden_size:
        refuse_import("helium", {setting(stock, "head_dim"): HELIUM_OUTPUT_WIDTH})
    return {}


def _helium_from_archlab(config: PreTrainedConfig) -> dict[str, Any]:
    if config.head_dim * config.num_attention_heads != config.hidden_size:
        refuse_export("HeliumForCausalLM", {setting(config, "head_dim"): HELIUM_OUTPUT_WIDTH})
    return {"attention_bias": qkv_bias_of(config)}


HELIUM_OUTPUT_WIDTH = "Helium's output projection reads hidden_size channels: heads x head_dim must equal hidden_size"


def _exaone4_to_archlab(stock: PreTrainedConfig, values: Mapping[str, Any]) -> dict[str, Any]:
    """The head size config.json gives; with a window, the local layers slide and rotate, the global ones are NoPE."""
    local = "sliding_attention" in stock.layer_types
    if local and stock.sliding_window is None:
        refuse_import(
            "exaone4",
            {f"{setting(stock, 'layer_types')}, sliding_window=None": "its local layers need a window to slide over"},
        )
    nope = [i for i, kind in enumerate(stock.layer_types) if kind == "full_attention"]
    return {
        **head_dim_given(stock, values),
        "sliding_window": stock.sliding_window if local else None,
        "nope_layers": (nope or None) if stock.sliding_window is not None else None,
    }


def _exaone4_from_archlab(config: PreTrainedConfig) -> dict[str, Any]:
    local = "sliding_attention" in config.layer_types
    global_layers = [i for i, kind in enumerate(config.layer_types) if kind == "full_attention"] if local else []
    if sorted(config.nope_layers or ()) != global_layers:
        refuse_export(
            "Exaone4ForCausalLM",
            {
                f"{setting(config, 'nope_layers')} with layer_types={config.layer_types!r}": (
                    "EXAONE 4 rotates exactly its sliding layers when it has some (its global layers NoPE), and "
                    "every layer when it has none"
                )
            },
        )
    return {**head_dim_to_write(config), "sliding_window": config.sliding_window if local else None}


# EXAONE-MoE: EXAONE 4's attention (QK-norm per head; with a window its global layers NoPE) in a pre-norm block, and
# DeepSeek-V3's experts (`mlp_layer_types`, an ungated shared expert `num_shared_experts` experts wide)
EXAONE_MOE_FIELDS = {
    **same(
        *EXAONE4_FIELDS,
        "mlp_layer_types",
        "moe_intermediate_size",
        "num_experts_per_tok",
        "output_router_logits",
        "routed_scaling_factor",
        "norm_topk_prob",
    ),
    "num_experts": "num_local_experts",
}


def _exaone_moe_to_archlab(stock: PreTrainedConfig, values: Mapping[str, Any]) -> dict[str, Any]:
    return {**_exaone4_to_archlab(stock, values), **shared_expert_to_archlab(stock, "num_shared_experts")}


def _exaone_moe_from_archlab(config: PreTrainedConfig) -> dict[str, Any]:
    shared = shared_expert_from_archlab(config, "ExaoneMoeForCausalLM", "num_shared_experts")
    types = config.mlp_layer_types
    first_dense = types.index("sparse") if "sparse" in types else len(types)
    return {**_exaone4_from_archlab(config), **shared, "first_k_dense_replace": first_dense}


def _exaone_moe_weights(state_dict: StateDict, config: PreTrainedConfig) -> StateDict:
    """Per-expert checkpoint modules fused; the router's correction bias and the shared expert under archlab's names."""
    fused = QWEN2_MOE_LAYOUT.to_archlab(state_dict, config)
    renamed = {
        key.replace(".mlp.e_score_correction_bias", ".mlp.gate.e_score_correction_bias"): t for key, t in fused.items()
    }
    return {key.replace(".mlp.shared_experts.", ".mlp.shared_expert."): t for key, t in renamed.items()}


EXAONE_MOE_LAYOUT = Layout(
    to_archlab=_exaone_moe_weights,
    from_archlab=lambda state_dict, config: {
        key.replace(".mlp.shared_expert.", ".mlp.shared_experts."): tensor for key, tensor in state_dict.items()
    },
)


def _olmo3_to_archlab(stock: PreTrainedConfig, values: Mapping[str, Any]) -> dict[str, Any]:
    """OLMo 2's head size, and RoPE as one set per layer type."""
    rope, wrong = _sets_per_layer_type_to_archlab(stock, "OLMo 3")
    refuse_import("olmo3", wrong)
    return {**_olmo2_to_archlab(stock, values), **rope}


def _olmo3_from_archlab(config: PreTrainedConfig) -> dict[str, Any]:
    return {**_olmo2_from_archlab(config), **_sets_per_layer_type_from_archlab(config, "OLMo 3")}


# Mellum (JetBrains): Qwen3-MoE's attention (QK-norm per head, `attention_bias` on q/k/v/o) with local layers
# (`layer_types`), dense layers (`mlp_layer_types`, `intermediate_size` wide) and RoPE as one set per layer type (its
# attention rotates every channel: a partial factor is refused); its multi-token-prediction tensors (`mtp.*`) dropped
MELLUM_FIELDS = {
    **same(
        *(name for name in LLAMA_FIELDS if name not in ("mlp_bias", "rope_parameters")),
        "sliding_window",
        "layer_types",
        "mlp_layer_types",
        *QWEN_MOE_EXPERT_FIELDS,
    ),
    "num_experts": "num_local_experts",
}


def _mellum_to_archlab(stock: PreTrainedConfig, values: Mapping[str, Any]) -> dict[str, Any]:
    rope, wrong = _sets_per_layer_type_to_archlab(stock, "Mellum")
    refuse_import("mellum", wrong)
    window = {} if "sliding_attention" in stock.layer_types else {"sliding_window": None}  # (a window never used)
    return {**rope, **window}


MELLUM_LAYOUT = Layout(
    to_archlab=lambda state_dict, config: QWEN2_MOE_LAYOUT.to_archlab(
        {key: tensor for key, tensor in state_dict.items() if not key.startswith("mtp.")}, config
    )
)


def _qwen3_moe_from_archlab(config: PreTrainedConfig) -> dict[str, Any]:
    wrong = {}
    if config.num_local_experts > 0 and config.shared_expert_intermediate_size > 0:
        wrong[setting(config, "shared_expert_intermediate_size")] = "Qwen3-MoE's sparse layers have no shared expert"
    if config.qkv_bias is not None and config.qkv_bias != config.attention_bias:
        wrong[f"{setting(config, 'qkv_bias')}, {setting(config, 'attention_bias')}"] = (
            "Qwen3-MoE has one bias flag for q/k/v and the output projection"
        )
    refuse_export("Qwen3MoeForCausalLM", wrong)
    dense = [i for i, kind in enumerate(config.mlp_layer_types) if kind == "dense"]
    return {
        **one_window_for_every_layer(config, "Qwen3MoeForCausalLM"),
        "use_sliding_window": config.sliding_window is not None and "sliding_attention" in config.layer_types,
        "head_dim": config.head_dim,
        "decoder_sparse_step": 1,
        "mlp_only_layers": dense,
        # no sparse layer, no router logits: the stock load-balancing loss fails on an empty tuple (as Qwen2-MoE's)
        **({"output_router_logits": False} if len(dense) == len(config.mlp_layer_types) else {}),
    }


def _qwen2_moe_from_archlab(config: PreTrainedConfig) -> dict[str, Any]:
    wrong = {}
    if config.num_local_experts > 0 and (config.shared_expert_intermediate_size < 1 or not config.shared_expert_gate):
        wrong[f"{setting(config, 'shared_expert_intermediate_size')}, {setting(config, 'shared_expert_gate')}"] = (
            "every Qwen2-MoE sparse layer has a shared expert with a sigmoid gate"
        )
    refuse_export("Qwen2MoeForCausalLM", wrong)
    dense = [i for i, kind in enumerate(config.mlp_layer_types) if kind == "dense"]
    return {
        "qkv_bias": qkv_bias_of(config),
        "decoder_sparse_step": 1,
        "mlp_only_layers": dense,
        **_qwen3_from_archlab(config),
        **head_dim_to_write(config),
        # no sparse layer, no router logits: Qwen2-MoE's load-balancing loss fails on an empty tuple (IndexError)
        **({"output_router_logits": False} if len(dense) == len(config.mlp_layer_types) else {}),
    }


FAMILIES: dict[str, Family] = {
    family.name: family
    for family in (
        Family(LlamaConfig, LlamaForCausalLM, DecoderForCausalLM, fields=same(*LLAMA_FIELDS)),
        Family(
            MistralConfig,
            MistralForCausalLM,
            DecoderForCausalLM,
            fields=same(*MISTRAL_FIELDS),
            from_archlab=_mistral_from_archlab,
            expressible=frozenset({"layer_types"}),
        ),
        Family(
            MixtralConfig,
            MixtralForCausalLM,
            DecoderForCausalLM,
            fields=same(*MIXTRAL_FIELDS),
            implied={"norm_topk_prob": True},
            from_archlab=_mixtral_from_archlab,
            # the router z-loss only changes training; it is dropped on export
            expressible=frozenset({"layer_types", "router_z_loss_coef"}),
            layout=MIXTRAL_LAYOUT,
        ),
        Family(
            GemmaConfig,
            GemmaForCausalLM,
            DecoderForCausalLM,
            fields=same(*GEMMA_FIELDS),
            implied=GEMMA_IMPLIED,
            to_archlab=_causal_only("gemma"),
            from_archlab=_gemma_from_archlab,
        ),
        Family(
            Gemma2Config,
            Gemma2ForCausalLM,
            DecoderForCausalLM,
            fields=GEMMA2_FIELDS,
            implied={**GEMMA_IMPLIED, "norm_position": "sandwich"},
            to_archlab=_causal_only("gemma2"),
            from_archlab=_gemma2_from_archlab,
        ),
        Family(
            VaultGemmaConfig,
            VaultGemmaForCausalLM,
            DecoderForCausalLM,
            fields=GEMMA2_FIELDS,
            implied={**GEMMA_IMPLIED, "norm_position": "pre"},
            from_archlab=lambda config: _gemma2_from_archlab(config, "VaultGemmaForCausalLM"),
            layout=VAULTGEMMA_LAYOUT,
        ),
        Family(
            Gemma3TextConfig,
            Gemma3ForCausalLM,
            DecoderForCausalLM,
            fields=GEMMA3_FIELDS,
            implied={**GEMMA_IMPLIED, "norm_position": "sandwich", "use_qk_norm": True},
            to_archlab=_gemma3_to_archlab,
            from_archlab=_gemma3_from_archlab,
            expressible=frozenset({"rope_parameters"}),
        ),
        Family(
            Qwen3Config,
            Qwen3ForCausalLM,
            DecoderForCausalLM,
            fields=same(*QWEN3_FIELDS),
            implied={"use_qk_norm": True},
            from_archlab=_qwen3_from_archlab,
        ),
        Family(
            Qwen2Config,
            Qwen2ForCausalLM,
            DecoderForCausalLM,
            fields=same(*QWEN2_FIELDS),
            implied={"qkv_bias": True},
            to_archlab=lambda stock, values: head_dim_given(stock, values),
            from_archlab=_qwen2_from_archlab,
            expressible=frozenset({"head_dim"}),
        ),
        Family(
            Qwen2MoeConfig,
            Qwen2MoeForCausalLM,
            DecoderForCausalLM,
            fields=QWEN2_MOE_FIELDS,
            to_archlab=_qwen2_moe_to_archlab,
            from_archlab=_qwen2_moe_from_archlab,
            # the router z-loss only changes training; it is dropped on export
            expressible=frozenset({"head_dim", "mlp_layer_types", "router_z_loss_coef"}),
            layout=QWEN2_MOE_LAYOUT,
        ),
        Family(
            Qwen3MoeConfig,
            Qwen3MoeForCausalLM,
            DecoderForCausalLM,
            fields=QWEN3_MOE_FIELDS,
            implied={"use_qk_norm": True},
            to_archlab=_qwen3_moe_to_archlab,
            from_archlab=_qwen3_moe_from_archlab,
            # the router z-loss only changes training; it is dropped on export
            expressible=frozenset({"head_dim", "mlp_layer_types", "layer_types", "qkv_bias", "router_z_loss_coef"}),
            layout=QWEN2_MOE_LAYOUT,
        ),
        Family(
            Olmo2Config,
            Olmo2ForCausalLM,
            DecoderForCausalLM,
            fields=same(*OLMO2_FIELDS),
            implied=OLMO2_IMPLIED,
            to_archlab=_olmo2_to_archlab,
            from_archlab=_olmo2_from_archlab,
            expressible=frozenset({"head_dim"}),
        ),
        Family(
            SmolLM3Config,
            SmolLM3ForCausalLM,
            DecoderForCausalLM,
            fields=same(*SMOLLM3_FIELDS),
            to_archlab=_smollm3_to_archlab,
            from_archlab=_smollm3_from_archlab,
            expressible=frozenset({"head_dim", "nope_layers", "sliding_window"}),
        ),
        Family(MinistralConfig, MinistralForCausalLM, DecoderForCausalLM, fields=same(*MINISTRAL_FIELDS)),
        MINISTRAL3,
        Family(
            ArceeConfig, ArceeForCausalLM, DecoderForCausalLM, fields=same(*LLAMA_FIELDS), implied={"mlp_type": "plain"}
        ),
        Family(
            SeedOssConfig,
            SeedOssForCausalLM,
            DecoderForCausalLM,
            fields=SEED_OSS_FIELDS,
            from_archlab=_seed_oss_from_archlab,
        ),
        Family(
            HeliumConfig,
            HeliumForCausalLM,
            DecoderForCausalLM,
            fields=HELIUM_FIELDS,
            implied={"attention_bias": False},
            to_archlab=_helium_to_archlab,
            from_archlab=_helium_from_archlab,
            layout=interleaved_rope(IDENTITY),
        ),
        Family(
            Exaone4Config,
            Exaone4ForCausalLM,
            DecoderForCausalLM,
            fields=same(*EXAONE4_FIELDS),
            implied={"norm_position": "output", "use_qk_norm": True},
            to_archlab=_exaone4_to_archlab,
            from_archlab=_exaone4_from_archlab,
            expressible=frozenset({"head_dim", "nope_layers", "sliding_window"}),
        ),
        Family(
            ExaoneMoeConfig,
            ExaoneMoeForCausalLM,
            DecoderForCausalLM,
            fields=EXAONE_MOE_FIELDS,
            implied={**DEEPSEEK_ROUTER, "use_qk_norm": True},
            to_archlab=_exaone_moe_to_archlab,
            from_archlab=_exaone_moe_from_archlab,
            # the router z-loss only changes training; it is dropped on export
            expressible=frozenset(
                {"head_dim", "nope_layers", "sliding_window", "shared_expert_intermediate_size", "router_z_loss_coef"}
            )
            | ROUTER_GROUPS,
            layout=EXAONE_MOE_LAYOUT,
        ),
        Family(
            MellumConfig,
            MellumForCausalLM,
            DecoderForCausalLM,
            fields=MELLUM_FIELDS,
            implied={"use_qk_norm": True},
            to_archlab=_mellum_to_archlab,
            from_archlab=lambda config: _sets_per_layer_type_from_archlab(config, "Mellum"),
            # the router z-loss only changes training; it is dropped on export
            expressible=frozenset({"rope_parameters", "sliding_window", "router_z_loss_coef"}),
            layout=MELLUM_LAYOUT,
        ),
        Family(
            Olmo3Config,
            Olmo3ForCausalLM,
            DecoderForCausalLM,
            fields=same(*OLMO3_FIELDS),
            implied=OLMO2_IMPLIED,
            to_archlab=_olmo3_to_archlab,
            from_archlab=_olmo3_from_archlab,
            expressible=frozenset({"head_dim", "rope_parameters"}),
        ),
        *GLM_FAMILIES,
        *DEEPSEEK_MOE_FAMILIES,
        *GRANITE_FAMILIES,
        *COHERE_FAMILIES,
        *HUNYUAN_FAMILIES,
        OLMO,
        *OLMOE_FAMILIES,
        GPT_OSS,
        LLAMA4_TEXT,
        BITNET,
        *DEEPSEEK_MLA_FAMILIES,
        *LLAMA_LIKE_FAMILIES,
        *FUSED_DECODERS,
        *LAYERNORM_DECODERS,
        PHI3,
        MARIAN,
        BART,
        MBART,
        BERT,
        ROBERTA,
        *(t5_family(variant) for variant in T5_VARIANTS.values()),
    )
}

# Stock classes whose default RoPE ignores `rope_parameters["partial_rotary_factor"]` (every channel rotates; other
# rope types then fail in the first forward), and stock classes without a `head_dim` field whose RoPE reads
# `getattr(config, "head_dim")` (config.json may carry it) while their attention takes hidden / heads (StableLM,
# GPT-NeoX): a head size other than hidden / heads is refused. Qwen2, Qwen2-MoE, Phi and Phi-3 read it in their
# attention too and map it (`head_dim_given`).
IGNORES_PARTIAL_ROTARY = (
    "llama",
    "olmo",
    "internlm3",
    "iquestcoder",
    "exaone",
    "mistral",
    "mixtral",
    "qwen2",
    "qwen2_moe",
    "qwen3",
    "qwen3_moe",
    "gemma",
    "gemma2",
    "olmo2",
    "olmo3",
    "smollm3",
    "starcoder2",
    "exaone4",
    "helium",
    "ministral",
    "ministral3",
    "arcee",
    "seed_oss",
    "falcon",
    "granite",
    "granitemoe",
    "granitemoeshared",
    "granite_swa",
    "cohere",
    "cohere2",
    "vaultgemma",
    "olmoe",
    "flex_olmo",
    "cwm",
    "ernie4_5",
    "jais2",
    "exaone_moe",
    "afmoe",
    "hunyuan_v1_dense",
    "hunyuan_v1_moe",
    "ernie4_5_moe",
    "gpt_oss",
    "llama4_text",
    "deepseek_v3",
    "deepseek_v2",
    "glm4_moe_lite",
    "sarvam_mla",
    "youtu",
)
READS_UNDECLARED_HEAD_DIM = ("stablelm", "gpt_neox")


def _guarded(family: Family) -> Family:
    def to_archlab(stock: PreTrainedConfig, values: Mapping[str, Any]) -> dict[str, Any]:
        wrong = {}
        rope = getattr(stock, "rope_parameters", None) or {}
        factor = rope.get("partial_rotary_factor") if isinstance(rope, dict) else None
        if family.name in IGNORES_PARTIAL_ROTARY and factor not in (None, 1, 1.0):
            wrong[f"rope_parameters['partial_rotary_factor']={factor!r}"] = (
                f"{family.architecture} rotates every channel of each head (its default RoPE ignores the factor)"
            )
        head_dim = values.get("head_dim")
        if family.name in READS_UNDECLARED_HEAD_DIM and head_dim is not None:
            if head_dim != stock.hidden_size // stock.num_attention_heads:
                wrong[f"head_dim={head_dim!r}"] = (
                    f"{family.config_class.__name__} has no head_dim field (archlab takes hidden_size / "
                    f"num_attention_heads = {stock.hidden_size // stock.num_attention_heads}), but "
                    f"{family.architecture} reads it"
                )
        refuse_import(family.name, wrong)
        return family.to_archlab(stock, values)

    def from_archlab(config: PreTrainedConfig) -> dict[str, Any]:
        factor = (getattr(config, "rope_parameters", None) or {}).get("partial_rotary_factor")
        if family.name in IGNORES_PARTIAL_ROTARY and factor not in (None, 1, 1.0):
            refuse_export(
                family.architecture,
                {f"rope_parameters['partial_rotary_factor']={factor!r}": "it rotates every channel of each head"},
            )
        return family.from_archlab(config)

    return dataclasses.replace(family, to_archlab=to_archlab, from_archlab=from_archlab)


FAMILIES = {name: _guarded(family) for name, family in FAMILIES.items()}

__all__ = [
    "FAMILIES",
    "EXAONE4_FIELDS",
    "GEMMA2_FIELDS",
    "HELIUM_FIELDS",
    "GEMMA3_FIELDS",
    "GEMMA_FIELDS",
    "LLAMA_FIELDS",
    "MISTRAL_FIELDS",
    "MINISTRAL_FIELDS",
    "MIXTRAL_FIELDS",
    "OLMO2_FIELDS",
    "OLMO3_FIELDS",
    "QWEN3_FIELDS",
    "QWEN3_MOE_FIELDS",
    "SEED_OSS_FIELDS",
    "SMOLLM3_FIELDS",
]
