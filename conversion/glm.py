"""GLM and GLM-4 (THUDM / Zhipu's GLM-4-9B and GLM-4-0414 families) as `Family` rows.

Both are Llama's decoder with three changes archlab expresses: RoPE over interleaved channel pairs of the first half of
each head (`partial_rotary_factor` 0.5; the q/k rows reordered, `interleaved_rope.py`), the MLP's gate and up
projections held as one `gate_up_proj` ([gate; up], split on import and joined on export), and biases on q/k/v only
(`attention_bias`, archlab's `qkv_bias`). GLM-4 adds a norm after each sub-layer's output, inside the residual: the
sandwich block (archlab's `norm_position="sandwich"`, Gemma2's names), whose norms GLM-4 names by what precedes them:

    GLM-4                          archlab (Gemma2)
    input_layernorm                input_layernorm              before attention
    post_self_attn_layernorm       post_attention_layernorm     after attention, before the residual add
    post_attention_layernorm       pre_feedforward_layernorm    before the MLP
    post_mlp_layernorm             post_feedforward_layernorm   after the MLP, before the residual add
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from transformers import (
    Glm4Config,
    Glm4ForCausalLM,
    Glm4MoeConfig,
    Glm4MoeForCausalLM,
    GlmConfig,
    GlmForCausalLM,
    PreTrainedConfig,
)

from ..modeling import DecoderForCausalLM
from .checks import head_dim_given, head_dim_to_write, qkv_bias_of, refuse_export, refuse_import, setting
from .experts import QWEN2_MOE_LAYOUT
from .family import Family, Layout, StateDict, same
from .field_lists import LLAMA_FIELDS
from .fused_decoders import ATTN, LAYER, MLP
from .interleaved_rope import interleaved_rope
from .layouts import FusedGateUp, Rename, WeightRules

# GlmConfig / Glm4Config fields archlab has with the same meaning (`attention_bias` is archlab's `qkv_bias`)
GLM_FIELDS = {
    **same(*(name for name in LLAMA_FIELDS if name not in ("attention_bias", "mlp_bias"))),
    "attention_bias": "qkv_bias",
}
STOCK = "model.layers.{n}"


def _from_archlab(config: PreTrainedConfig) -> dict[str, Any]:
    return {"attention_bias": qkv_bias_of(config)}


def _layout(norms: tuple[Rename, ...]):
    return interleaved_rope(
        WeightRules(
            (
                Rename("model.embed_tokens", "model.embed_tokens"),
                *norms,
                *(Rename(f"{STOCK}.self_attn.{proj}", f"{ATTN}.{proj}") for proj in ("q_proj", "k_proj", "v_proj")),
                Rename(f"{STOCK}.self_attn.o_proj", f"{ATTN}.o_proj"),
                FusedGateUp(f"{STOCK}.mlp.gate_up_proj", MLP),
                Rename(f"{STOCK}.mlp.down_proj", f"{MLP}.down_proj"),
                Rename("model.norm", "model.norm"),
                Rename("lm_head", "lm_head"),
            ),
            base_prefix="model",
            ignore=(r"inv_freq$",),
        ).layout()
    )


GLM = Family(
    GlmConfig,
    GlmForCausalLM,
    DecoderForCausalLM,
    fields=GLM_FIELDS,
    implied={"attention_bias": False},
    from_archlab=_from_archlab,
    layout=_layout(
        (
            Rename(f"{STOCK}.input_layernorm", f"{LAYER}.input_layernorm"),
            Rename(f"{STOCK}.post_attention_layernorm", f"{LAYER}.post_attention_layernorm"),
        )
    ),
)

GLM4 = Family(
    Glm4Config,
    Glm4ForCausalLM,
    DecoderForCausalLM,
    fields=GLM_FIELDS,
    implied={"attention_bias": False, "norm_position": "sandwich"},
    from_archlab=_from_archlab,
    layout=_layout(
        (
            Rename(f"{STOCK}.input_layernorm", f"{LAYER}.input_layernorm"),
            Rename(f"{STOCK}.post_self_attn_layernorm", f"{LAYER}.post_attention_layernorm"),
            Rename(f"{STOCK}.post_attention_layernorm", f"{LAYER}.pre_feedforward_layernorm"),
            Rename(f"{STOCK}.post_mlp_layernorm", f"{LAYER}.post_feedforward_layernorm"),
        )
    ),
)

# --- GLM-4.5 (`glm4_moe`): Llama's names, rotate-half RoPE over half of each head, DeepSeek-V3's sigmoid router -------

# Glm4MoeConfig: GLM's fields (its RoPE rotate-half, `partial_rotary_factor` 0.5 by default) with QK-norm per head, and
# the experts: `n_routed_experts` of `moe_intermediate_size`, an ungated shared expert `n_shared_experts` times as
# wide, the first `first_k_dense_replace` layers dense (`_glm4_moe_to_archlab`)
GLM4_MOE_FIELDS = {
    **{name: ours for name, ours in GLM_FIELDS.items() if name != "head_dim"},
    **same(
        "use_qk_norm",
        "moe_intermediate_size",
        "num_experts_per_tok",
        "output_router_logits",
        "routed_scaling_factor",
        "norm_topk_prob",
    ),
    "n_routed_experts": "num_local_experts",
}
GLM4_MOE_IMPLIED = {
    "attention_bias": False,
    "router_score_function": "sigmoid",
    "router_correction_bias": True,
    "shared_expert_gate": False,
}
# the multi-token-prediction layers a GLM-4.5 checkpoint holds past `num_hidden_layers` (transformers drops them too)
LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")


def _glm4_moe_to_archlab(stock: PreTrainedConfig, values: Mapping[str, Any]) -> dict[str, Any]:
    wrong = {}
    if stock.n_shared_experts < 1:
        wrong[setting(stock, "n_shared_experts")] = "archlab has no zero-width shared expert (its tensors exist)"
    if stock.topk_group < stock.n_group:
        wrong[f"n_group={stock.n_group!r}, topk_group={stock.topk_group!r}"] = "archlab has no group-limited routing"
    refuse_import("glm4_moe", wrong)
    dense = min(stock.first_k_dense_replace, stock.num_hidden_layers)
    return {
        **head_dim_given(stock, values),
        "shared_expert_intermediate_size": stock.moe_intermediate_size * stock.n_shared_experts,
        "mlp_layer_types": ["dense"] * dense + ["sparse"] * (stock.num_hidden_layers - dense),
    }


def _glm4_moe_from_archlab(config: PreTrainedConfig) -> dict[str, Any]:
    types = config.mlp_layer_types
    dense = types.index("sparse") if "sparse" in types else len(types)
    shared, width = config.shared_expert_intermediate_size, config.moe_intermediate_size
    wrong = {}
    if any(kind != "sparse" for kind in types[dense:]):
        wrong[setting(config, "mlp_layer_types")] = "GLM-4.5's dense layers come first, every later layer sparse"
    if shared < 1 or shared % width:
        wrong[setting(config, "shared_expert_intermediate_size")] = (
            f"GLM-4.5's shared expert is a positive multiple of moe_intermediate_size={width} wide"
        )
    if config.attention_bias:
        wrong[setting(config, "attention_bias")] = "its output projection has no bias"
    refuse_export("Glm4MoeForCausalLM", wrong)
    return {
        "attention_bias": qkv_bias_of(config),
        "n_shared_experts": max(shared // width, 1),
        "first_k_dense_replace": dense,
        "n_group": 1,
        "topk_group": 1,
        **head_dim_to_write(config),
    }


def _renamed(state_dict: StateDict, old: str, new: str) -> StateDict:
    return {key.replace(old, new): tensor for key, tensor in state_dict.items()}


def _glm4_moe_to_archlab_weights(state_dict: StateDict, config: PreTrainedConfig) -> StateDict:
    kept = {
        key: tensor
        for key, tensor in state_dict.items()
        if not ((match := LAYER_INDEX.match(key)) and int(match.group(1)) >= config.num_hidden_layers)
    }
    return _renamed(QWEN2_MOE_LAYOUT.to_archlab(kept, config), ".mlp.shared_experts.", ".mlp.shared_expert.")


GLM4_MOE = Family(
    Glm4MoeConfig,
    Glm4MoeForCausalLM,
    DecoderForCausalLM,
    fields=GLM4_MOE_FIELDS,
    implied=GLM4_MOE_IMPLIED,
    to_archlab=_glm4_moe_to_archlab,
    from_archlab=_glm4_moe_from_archlab,
    # the router z-loss only changes training; it is dropped on export
    expressible=frozenset({"head_dim", "mlp_layer_types", "shared_expert_intermediate_size", "router_z_loss_coef"}),
    layout=Layout(
        to_archlab=_glm4_moe_to_archlab_weights,
        from_archlab=lambda state_dict, config: _renamed(state_dict, ".mlp.shared_expert.", ".mlp.shared_experts."),
    ),
)

GLM_FAMILIES = (GLM, GLM4, GLM4_MOE)

__all__ = ["GLM", "GLM4", "GLM4_MOE", "GLM_FAMILIES", "GLM_FIELDS"]
