"""Tencent's Hunyuan (`hunyuan_v1_dense`) and Hunyuan-MoE (`hunyuan_v1_moe`) as `Family` rows.

Both are Llama's block with a QK-norm per head applied after RoPE (`query_layernorm` / `key_layernorm`, archlab's
`q_norm` / `k_norm` with `qk_norm_after_rope=True`), and RoPE type "ntk_alpha" (their `dynamic` type with an `alpha`,
which stretches the base once: θ · α^(d / (d − 2))): archlab's default RoPE with that base computes the same
frequencies, so it imports as such (and exports as the default type with the stretched base). Hunyuan-MoE has a
mixture of experts in every layer: a softmax router (`mlp.gate.wg`, in fp32) whose top-k weights are renormalised,
Mixtral's experts `intermediate_size` wide (one module each in a checkpoint), and an ungated shared expert
(`mlp.shared_mlp`) as wide; per-layer lists of expert counts or top-k values are refused unless they hold one value.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from transformers import (
    HunYuanDenseV1Config,
    HunYuanDenseV1ForCausalLM,
    HunYuanMoEV1Config,
    HunYuanMoEV1ForCausalLM,
    PreTrainedConfig,
)

from ..modeling import DecoderForCausalLM
from .checks import refuse_export, refuse_import, setting
from .experts import QWEN2_MOE_LAYOUT
from .family import Family, Layout, StateDict, renamed, same
from .field_lists import LLAMA_FIELDS

HUNYUAN_FIELDS = tuple(name for name in LLAMA_FIELDS if name not in ("mlp_bias", "rope_parameters"))
QK_NORM_AFTER_ROPE = {"use_qk_norm": True, "qk_norm_after_rope": True}
# Hunyuan's names -> archlab's (the experts' per-module checkpoint names as Qwen2-MoE's, fused after these)
NAMES = (
    (".self_attn.query_layernorm.", ".self_attn.q_norm."),
    (".self_attn.key_layernorm.", ".self_attn.k_norm."),
    (".mlp.gate.wg.weight", ".mlp.gate.weight"),
    (".mlp.shared_mlp.", ".mlp.shared_expert."),
)


def _rope_to_archlab(stock: PreTrainedConfig) -> dict[str, Any]:
    """ntk_alpha's stretched base as the default RoPE's."""
    rope = dict(stock.rope_parameters)
    alpha = rope.get("alpha")
    if rope.get("rope_type", "default") == "dynamic" and alpha:
        head_dim = stock.head_dim
        rope = {"rope_type": "default", "rope_theta": rope["rope_theta"] * alpha ** (head_dim / (head_dim - 2))}
    return {"rope_parameters": rope}


def _dense_to_archlab(stock: PreTrainedConfig, values: Mapping[str, Any]) -> dict[str, Any]:
    return _rope_to_archlab(stock)


def _from_archlab(config: PreTrainedConfig) -> dict[str, Any]:
    return {"rope_parameters": dict(config.rope_parameters)}


def _one_value(stock: PreTrainedConfig, name: str, wrong: dict[str, str]) -> int:
    value = getattr(stock, name)
    if isinstance(value, list):
        if len(set(value)) != 1:
            wrong[setting(stock, name)] = "archlab's sparse layers share one expert count and top-k"
        return value[0]
    return value


def _moe_to_archlab(stock: PreTrainedConfig, values: Mapping[str, Any]) -> dict[str, Any]:
    wrong: dict[str, str] = {}
    experts, top_k = _one_value(stock, "num_experts", wrong), _one_value(stock, "moe_topk", wrong)
    refuse_import("hunyuan_v1_moe", wrong)
    return {
        **_rope_to_archlab(stock),
        "num_local_experts": experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": stock.intermediate_size,
        "shared_expert_intermediate_size": stock.intermediate_size,
        "mlp_layer_types": ["sparse"] * stock.num_hidden_layers,
    }


def _moe_from_archlab(config: PreTrainedConfig) -> dict[str, Any]:
    wrong = {}
    if any(kind != "sparse" for kind in config.mlp_layer_types):
        wrong[setting(config, "mlp_layer_types")] = "every Hunyuan-MoE layer is sparse"
    width = config.intermediate_size
    for name in ("moe_intermediate_size", "shared_expert_intermediate_size"):
        if getattr(config, name) != width:
            wrong[setting(config, name)] = f"Hunyuan-MoE's experts are intermediate_size={width} wide"
    refuse_export("HunYuanMoEV1ForCausalLM", wrong)
    return {**_from_archlab(config), "num_experts": config.num_local_experts, "moe_topk": config.num_experts_per_tok}


def _moe_weights_to_archlab(state_dict: StateDict, config: PreTrainedConfig) -> StateDict:
    return QWEN2_MOE_LAYOUT.to_archlab(renamed(state_dict, NAMES), config)


HUNYUAN_DENSE = Family(
    HunYuanDenseV1Config,
    HunYuanDenseV1ForCausalLM,
    DecoderForCausalLM,
    fields=same(*HUNYUAN_FIELDS),
    implied=QK_NORM_AFTER_ROPE,
    to_archlab=_dense_to_archlab,
    from_archlab=_from_archlab,
    expressible=frozenset({"rope_parameters"}),
    layout=Layout(
        to_archlab=lambda state_dict, config: renamed(state_dict, NAMES[:2]),
        from_archlab=lambda state_dict, config: renamed(state_dict, NAMES[:2], back=True),
    ),
)
HUNYUAN_MOE = Family(
    HunYuanMoEV1Config,
    HunYuanMoEV1ForCausalLM,
    DecoderForCausalLM,
    fields=same(*HUNYUAN_FIELDS, "output_router_logits"),
    implied={**QK_NORM_AFTER_ROPE, "norm_topk_prob": True, "shared_expert_gate": False},
    to_archlab=_moe_to_archlab,
    from_archlab=_moe_from_archlab,
    # the router z-loss only changes training; it is dropped on export
    expressible=frozenset(
        {
            "rope_parameters",
            "num_local_experts",
            "num_experts_per_tok",
            "moe_intermediate_size",
            "shared_expert_intermediate_size",
            "mlp_layer_types",
            "router_aux_loss_coef",
            "router_z_loss_coef",
        }
    ),
    layout=Layout(
        to_archlab=_moe_weights_to_archlab,
        from_archlab=lambda state_dict, config: renamed(state_dict, NAMES, back=True),
    ),
)
HUNYUAN_FAMILIES = (HUNYUAN_DENSE, HUNYUAN_MOE)

__all__ = ["HUNYUAN_DENSE", "HUNYUAN_FAMILIES", "HUNYUAN_MOE"]
