"""The decoders with DeepSeek-V3's mixture of experts and a standard attention: GLM-4.5 (`glm4_moe`), dots.llm1
(`dots1`) and Solar Open (`solar_open`), as `Family` rows, and MiniMax-M2 (DeepSeek-V3's router on Mixtral's experts,
no shared expert) and AFMoE (sandwich norms, gated attention, NoPE global layers). EXAONE-MoE (EXAONE 4's attention)
is in `families.py`.

Their sparse layers share DeepSeek-V3's router and experts: sigmoid scores, a per-expert correction bias
(`mlp.gate.e_score_correction_bias`) that chooses the top k without weighing them, the top-k weights renormalised under
`norm_topk_prob` and times `routed_scaling_factor` (archlab's `router_score_function="sigmoid"`,
`router_correction_bias=True`), `n_routed_experts` experts of `moe_intermediate_size` and an ungated shared expert
`n_shared_experts` times as wide (`mlp.shared_experts`, archlab's `mlp.shared_expert`); the first
`first_k_dense_replace` layers are dense (Solar Open has none); group-limited routing (`n_group`, `topk_group`) is
archlab's `router_groups`, `router_top_groups` (AFMoE and MiniMax-M2 have none). Their checkpoints hold one module per
expert (Qwen2-MoE's layout, `experts.py`) and, for GLM-4.5, multi-token-prediction layers past `num_hidden_layers`,
which transformers drops on load too. Attention: GLM-4.5's is Llama's with biases on q/k/v only, an optional QK-norm per
head and rotate-half RoPE over `partial_rotary_factor` (0.5) of each head; dots.llm1's is Qwen3's (QK-norm per head,
`attention_bias` on q/k/v/o, windows from `max_window_layers`); Solar Open's is Llama's with biases on q/k/v only.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

from transformers import (
    AfmoeConfig,
    AfmoeForCausalLM,
    Dots1Config,
    Dots1ForCausalLM,
    Glm4MoeConfig,
    Glm4MoeForCausalLM,
    MiniMaxM2Config,
    MiniMaxM2ForCausalLM,
    PreTrainedConfig,
    SolarOpenConfig,
    SolarOpenForCausalLM,
)

from ..modeling import DecoderForCausalLM
from .checks import head_dim_given, head_dim_to_write, qkv_bias_of, refuse_export, refuse_import, setting
from .experts import MIXTRAL_LAYOUT, QWEN2_MOE_LAYOUT
from .family import Family, Layout, StateDict, renamed, same
from .field_lists import LLAMA_FIELDS

# the experts' fields every one of these configs has under these names
EXPERT_FIELDS = {
    **same("moe_intermediate_size", "num_experts_per_tok", "output_router_logits", "routed_scaling_factor"),
    **same("norm_topk_prob"),
    "n_routed_experts": "num_local_experts",
}
DEEPSEEK_ROUTER = {"router_score_function": "sigmoid", "router_correction_bias": True, "shared_expert_gate": False}
# Llama's attention fields without `attention_bias` (q/k/v only: archlab's `qkv_bias`), `head_dim` and `mlp_bias`
ATTENTION_FIELDS = {
    **same(*(name for name in LLAMA_FIELDS if name not in ("attention_bias", "head_dim", "mlp_bias"))),
    "attention_bias": "qkv_bias",
}
# the shared expert's stock name and archlab's
SHARED_EXPERTS = ((".mlp.shared_experts.", ".mlp.shared_expert."),)
# the multi-token-prediction layers a GLM-4.5 checkpoint holds past `num_hidden_layers`
LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")
# what each family's config.json calls its first dense layers (Solar Open has none)
FIRST_DENSE = {"glm4_moe": "first_k_dense_replace", "dots1": "first_k_dense_replace"}


def shared_expert_to_archlab(stock: PreTrainedConfig, shared_field: str = "n_shared_experts") -> dict[str, Any]:
    """The ungated shared expert's width (`shared_field` experts of `moe_intermediate_size`), refusing none; and the
    group-limited routing (`n_group`, `topk_group`: archlab's `router_groups`, `router_top_groups`) where the family
    has it."""
    shared = getattr(stock, shared_field)
    if not shared:
        refuse_import(stock.model_type, {setting(stock, shared_field): "archlab has no zero-width shared expert"})
    groups, top = getattr(stock, "n_group", None) or 1, getattr(stock, "topk_group", None)  # (AFMoE has no groups)
    limited = {} if groups == 1 else {"router_groups": groups, "router_top_groups": top if top < groups else None}
    return {"shared_expert_intermediate_size": stock.moe_intermediate_size * shared, **limited}


def shared_expert_from_archlab(config: PreTrainedConfig, architecture: str, shared_field: str) -> dict[str, Any]:
    """The stock count of shared experts and the group-limited routing; refuses a width that is not a multiple."""
    shared, width = config.shared_expert_intermediate_size, config.moe_intermediate_size
    if shared < 1 or shared % width:
        refuse_export(
            architecture,
            {
                setting(config, "shared_expert_intermediate_size"): (
                    f"its shared expert is a positive multiple of moe_intermediate_size={width} wide"
                )
            },
        )
    groups = config.router_groups
    return {shared_field: shared // width, "n_group": groups, "topk_group": config.router_top_groups or groups}


def _experts_to_archlab(stock: PreTrainedConfig, values: Mapping[str, Any]) -> dict[str, Any]:
    """The shared expert's width and which layers are sparse."""
    family = stock.model_type
    dense = min(getattr(stock, FIRST_DENSE[family]), stock.num_hidden_layers) if family in FIRST_DENSE else 0
    return {
        **shared_expert_to_archlab(stock),
        "mlp_layer_types": ["dense"] * dense + ["sparse"] * (stock.num_hidden_layers - dense),
    }


def _experts_from_archlab(architecture: str, family: str) -> Callable[[PreTrainedConfig], dict[str, Any]]:
    def from_archlab(config: PreTrainedConfig) -> dict[str, Any]:
        types = config.mlp_layer_types
        dense = types.index("sparse") if "sparse" in types else len(types)
        if any(kind != "sparse" for kind in types[dense:]) or (dense and family not in FIRST_DENSE):
            where = (
                "dense layers come first, every later layer sparse" if family in FIRST_DENSE else "layers are sparse"
            )
            refuse_export(architecture, {setting(config, "mlp_layer_types"): f"{architecture}'s {where}"})
        first_dense = {FIRST_DENSE[family]: dense} if family in FIRST_DENSE else {}
        return {**shared_expert_from_archlab(config, architecture, "n_shared_experts"), **first_dense}

    return from_archlab


def _weights_to_archlab(state_dict: StateDict, config: PreTrainedConfig) -> StateDict:
    kept = {
        key: tensor
        for key, tensor in state_dict.items()
        if not ((match := LAYER_INDEX.match(key)) and int(match.group(1)) >= config.num_hidden_layers)
    }
    return renamed(QWEN2_MOE_LAYOUT.to_archlab(kept, config), SHARED_EXPERTS)


DEEPSEEK_MOE_LAYOUT = Layout(
    to_archlab=_weights_to_archlab,
    from_archlab=lambda state_dict, config: renamed(state_dict, SHARED_EXPERTS, back=True),
)
# the router z-loss only changes training; it is dropped on export
# (group-limited routing: `n_group` / `topk_group`, from and to the config in `shared_expert_*_archlab`)
ROUTER_GROUPS = frozenset({"router_groups", "router_top_groups"})
EXPRESSIBLE = frozenset(
    {"head_dim", "mlp_layer_types", "shared_expert_intermediate_size", "router_z_loss_coef", *ROUTER_GROUPS}
)
SOLAR_OPEN_EXPRESSIBLE = EXPRESSIBLE - {"head_dim"}


def _glm4_moe_to_archlab(stock: PreTrainedConfig, values: Mapping[str, Any]) -> dict[str, Any]:
    return {**_experts_to_archlab(stock, values), **head_dim_given(stock, values)}


def _dots1_to_archlab(stock: PreTrainedConfig, values: Mapping[str, Any]) -> dict[str, Any]:
    """Also: a window only where a layer slides (dots.llm1's 4,096 is set whatever `max_window_layers` leaves local,
    and is longer than a short context, which archlab refuses for a window that never applies)."""
    window = {} if "sliding_attention" in stock.layer_types else {"sliding_window": None}
    return {**_glm4_moe_to_archlab(stock, values), **window}


# (their output projection has no bias: `attention_bias=False` is implied, so an archlab one is refused by name)
def _glm4_moe_from_archlab(config: PreTrainedConfig) -> dict[str, Any]:
    experts = _experts_from_archlab("Glm4MoeForCausalLM", "glm4_moe")(config)
    return {**experts, "attention_bias": qkv_bias_of(config), **head_dim_to_write(config)}


def _solar_open_from_archlab(config: PreTrainedConfig) -> dict[str, Any]:
    experts = _experts_from_archlab("SolarOpenForCausalLM", "solar_open")(config)
    return {**experts, "attention_bias": qkv_bias_of(config)}


def _dots1_from_archlab(config: PreTrainedConfig) -> dict[str, Any]:
    experts = _experts_from_archlab("Dots1ForCausalLM", "dots1")(config)
    return {**experts, **head_dim_to_write(config)}


GLM4_MOE = Family(
    Glm4MoeConfig,
    Glm4MoeForCausalLM,
    DecoderForCausalLM,
    fields={**ATTENTION_FIELDS, **EXPERT_FIELDS, **same("use_qk_norm")},
    implied={**DEEPSEEK_ROUTER, "attention_bias": False},
    to_archlab=_glm4_moe_to_archlab,
    from_archlab=_glm4_moe_from_archlab,
    expressible=EXPRESSIBLE,
    layout=DEEPSEEK_MOE_LAYOUT,
)
SOLAR_OPEN = Family(
    SolarOpenConfig,
    SolarOpenForCausalLM,
    DecoderForCausalLM,
    fields={**ATTENTION_FIELDS, **EXPERT_FIELDS, **same("head_dim")},  # (its config declares one: 128)
    implied={**DEEPSEEK_ROUTER, "attention_bias": False},
    to_archlab=_experts_to_archlab,
    from_archlab=_solar_open_from_archlab,
    expressible=SOLAR_OPEN_EXPRESSIBLE,
    layout=DEEPSEEK_MOE_LAYOUT,
)
# dots.llm1: Qwen3's attention (QK-norm per head always, `attention_bias` on q/k/v/o, its windows in `layer_types`)
DOTS1 = Family(
    Dots1Config,
    Dots1ForCausalLM,
    DecoderForCausalLM,
    fields={
        **same(*(name for name in LLAMA_FIELDS if name not in ("head_dim", "mlp_bias")), "sliding_window"),
        **same("layer_types"),
        **EXPERT_FIELDS,
    },
    implied={**DEEPSEEK_ROUTER, "use_qk_norm": True},
    to_archlab=_dots1_to_archlab,
    from_archlab=_dots1_from_archlab,
    expressible=EXPRESSIBLE | {"sliding_window"},
    layout=DEEPSEEK_MOE_LAYOUT,
)

# --- MiniMax-M2: Mixtral's names and experts with DeepSeek-V3's router (no shared expert, always renormalised) -------

# MiniMaxM2Config: Llama's fields without the bias flags (it has none) and Mixtral's experts, each `intermediate_size`
# wide; QK-norm over the whole q and k projections (OLMo 2's) always; RoPE over `partial_rotary_factor` of each head
# (released checkpoints' `rotary_dim`, which its config reads as the factor)
MINIMAX_M2_FIELDS = {
    **same(
        *(name for name in LLAMA_FIELDS if name not in ("attention_bias", "mlp_bias", "intermediate_size")),
        "num_local_experts",
        "num_experts_per_tok",
        "output_router_logits",
        "router_aux_loss_coef",
        "router_jitter_noise",
    ),
    "intermediate_size": ("intermediate_size", "moe_intermediate_size"),
}
# its router's correction bias sits on the sparse block (`block_sparse_moe.e_score_correction_bias` in a checkpoint,
# `mlp.e_score_correction_bias` in memory), archlab's on the router
MINIMAX_BIAS = re.compile(r"^(model\.layers\.\d+)\.(?:block_sparse_moe|mlp)\.e_score_correction_bias$")


def _minimax_m2_to_archlab_weights(state_dict: StateDict, config: PreTrainedConfig) -> StateDict:
    out = {}
    for key, tensor in MIXTRAL_LAYOUT.to_archlab(state_dict, config).items():
        match = MINIMAX_BIAS.match(key)
        out[f"{match.group(1)}.mlp.gate.e_score_correction_bias" if match else key] = tensor
    return out


def _minimax_m2_from_archlab(config: PreTrainedConfig) -> dict[str, Any]:
    if any(kind != "sparse" for kind in config.mlp_layer_types):
        refuse_export("MiniMaxM2ForCausalLM", {setting(config, "mlp_layer_types"): "every MiniMax-M2 layer is sparse"})
    return {}


MINIMAX_M2 = Family(
    MiniMaxM2Config,
    MiniMaxM2ForCausalLM,
    DecoderForCausalLM,
    fields=MINIMAX_M2_FIELDS,
    implied={
        "router_score_function": "sigmoid",
        "router_correction_bias": True,
        "norm_topk_prob": True,
        "use_qk_norm": True,
        "qk_norm_scope": "projection",
    },
    from_archlab=_minimax_m2_from_archlab,
    expressible=frozenset({"mlp_layer_types", "router_z_loss_coef"}),
    layout=Layout(
        to_archlab=_minimax_m2_to_archlab_weights,
        from_archlab=lambda state_dict, config: renamed(
            state_dict, ((".mlp.e_score_correction_bias", ".mlp.gate.e_score_correction_bias"),), back=True
        ),
    ),
)

# --- AFMoE (Arcee's Trinity): sandwich norms, gated attention, NoPE global layers, DeepSeek-V3's router ---------------

# AfmoeConfig: Llama's fields without `mlp_bias` and the experts (`num_experts` of `moe_intermediate_size`, an ungated
# shared expert `num_shared_experts` experts wide, the first `num_dense_layers` layers dense, top-k weights always
# renormalised, times `route_scale`); its local layers rotate, its global ones do not (archlab's `nope_layers`);
# `mup_enabled` scales the embeddings by √d (archlab's `scale_embedding`)
AFMOE_FIELDS = {
    **same(
        *(name for name in LLAMA_FIELDS if name != "mlp_bias"),
        "moe_intermediate_size",
        "num_experts_per_tok",
        "output_router_logits",
        "sliding_window",
        "layer_types",
    ),
    "num_experts": "num_local_experts",
    "route_scale": "routed_scaling_factor",
    "mup_enabled": "scale_embedding",
}
AFMOE_IMPLIED = {
    **DEEPSEEK_ROUTER,
    "norm_topk_prob": True,
    "norm_position": "sandwich",
    "use_qk_norm": True,
    "attention_output_gate": "elementwise",
}
# AFMoE's names -> archlab's (its checkpoint's experts one module each, as Qwen2-MoE's)
AFMOE_NAMES = (
    (".pre_mlp_layernorm.", ".pre_feedforward_layernorm."),
    (".post_mlp_layernorm.", ".post_feedforward_layernorm."),
    (".mlp.router.gate.weight", ".mlp.gate.weight"),
    (".mlp.expert_bias", ".mlp.gate.e_score_correction_bias"),
    (".mlp.shared_experts.", ".mlp.shared_expert."),
)


def _afmoe_to_archlab(stock: PreTrainedConfig, values: Mapping[str, Any]) -> dict[str, Any]:
    dense = min(stock.num_dense_layers, stock.num_hidden_layers)
    local = "sliding_attention" in stock.layer_types
    return {
        **shared_expert_to_archlab(stock, "num_shared_experts"),
        "mlp_layer_types": ["dense"] * dense + ["sparse"] * (stock.num_hidden_layers - dense),
        "nope_layers": [i for i, kind in enumerate(stock.layer_types) if kind == "full_attention"] or None,
        # (a window set on layers that are all global is never used; archlab refuses one longer than the context)
        "sliding_window": stock.sliding_window if local else None,
    }


def _afmoe_from_archlab(config: PreTrainedConfig) -> dict[str, Any]:
    types = config.mlp_layer_types
    dense = types.index("sparse") if "sparse" in types else len(types)
    expected = [i for i, kind in enumerate(config.layer_types) if kind == "full_attention"] or None
    wrong = {}
    if any(kind != "sparse" for kind in types[dense:]):
        wrong[setting(config, "mlp_layer_types")] = "AFMoE's dense layers come first, every later layer sparse"
    if config.nope_layers != expected:
        wrong[setting(config, "nope_layers")] = f"AFMoE rotates exactly its local layers: nope_layers={expected!r}"
    refuse_export("AfmoeForCausalLM", wrong)
    shared = shared_expert_from_archlab(config, "AfmoeForCausalLM", "num_shared_experts")
    return {"num_shared_experts": shared["num_shared_experts"], "num_dense_layers": dense}


def _afmoe_weights_to_archlab(state_dict: StateDict, config: PreTrainedConfig) -> StateDict:
    # the router's name first: the per-expert fusion reads `mlp.gate.weight`
    state_dict = QWEN2_MOE_LAYOUT.to_archlab(renamed(state_dict, AFMOE_NAMES[:3]), config)
    return renamed(state_dict, AFMOE_NAMES[3:])


def _afmoe_weights_from_archlab(state_dict: StateDict, config: PreTrainedConfig) -> StateDict:
    return renamed(state_dict, AFMOE_NAMES, back=True)


AFMOE = Family(
    AfmoeConfig,
    AfmoeForCausalLM,
    DecoderForCausalLM,
    fields=AFMOE_FIELDS,
    implied=AFMOE_IMPLIED,
    to_archlab=_afmoe_to_archlab,
    from_archlab=_afmoe_from_archlab,
    expressible=frozenset({"mlp_layer_types", "nope_layers", "shared_expert_intermediate_size", "router_z_loss_coef"}),
    layout=Layout(to_archlab=_afmoe_weights_to_archlab, from_archlab=_afmoe_weights_from_archlab),
)
DEEPSEEK_MOE_FAMILIES = (GLM4_MOE, DOTS1, SOLAR_OPEN, MINIMAX_M2, AFMOE)

__all__ = [
    "AFMOE",
    "DEEPSEEK_MOE_FAMILIES",
    "DEEPSEEK_MOE_LAYOUT",
    "DOTS1",
    "GLM4_MOE",
    "MINIMAX_M2",
    "SOLAR_OPEN",
    "ROUTER_GROUPS",
    "shared_expert_from_archlab",
    "shared_expert_to_archlab",
]
