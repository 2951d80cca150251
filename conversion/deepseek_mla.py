"""The DeepSeek models with multi-head latent attention as `Family` rows: DeepSeek-V3 (also DeepSeek-R1 and Kimi K2,
which share its architecture) and DeepSeek-V2 (V2-Lite, Coder-V2).

DeepSeek-V3 is Llama's pre-norm block with multi-head latent attention (archlab's `kv_lora_rank`, `q_lora_rank`,
`qk_nope_head_dim`, `qk_rope_head_dim`, `v_head_dim`; latent_attention.py: the same module names) and DeepSeek-V3's
mixture of experts after `first_k_dense_replace` dense layers (sigmoid scores, a correction bias that chooses, the
top-k weights renormalised and scaled, group-limited routing, an ungated shared expert: deepseek_moe.py's helpers, as
GLM-4.5 converts). Its checkpoints hold one module per expert and a multi-token-prediction layer past
`num_hidden_layers`, dropped as transformers drops it.

RoPE: DeepSeek-V3 rotates interleaved channel pairs (`rope_interleave=True`, how it was trained and how every
published config sets it); archlab rotates halves, so importing reorders the rotary rows of the queries' projection
(`q_proj` or `q_b_proj`, each head's last `qk_rope_head_dim` rows) and of `kv_a_proj_with_mqa` (its last
`qk_rope_head_dim` rows, the rotary key) from interleaved to rotate-half order (interleaved_rope.py's argument: a score
does not change when a query and its keys have their channels permuted alike), and exporting reorders them back.
A config with `rope_interleave=False` is refused (no such checkpoint is published; the layout cannot tell the two
apart).

DeepSeek-V2 has the same attention (its RoPE a complex product over interleaved pairs: the same rotation, reordered
alike) and DeepSeek-V2's experts: a softmax router whose top-k weights are not renormalised (its config's
`norm_topk_prob` is read by nothing), times `routed_scaling_factor`, and `n_shared_experts` shared experts; its
group-limited routing (`topk_method="group_limited_greedy"`, DeepSeek-V2 and Coder-V2 themselves: `n_group=8`,
`topk_group=3`) scores a group by its best expert: archlab's `router_group_score="max"` (DeepSeek-V2-Lite and
Coder-V2-Lite route greedily).

Sarvam's MLA model (`sarvam_mla`, Sarvam-105B) is DeepSeek-V3 under its own config class (transformers runs it on
`DeepseekV3ForCausalLM`; the class reads its remote code's legacy config fields). Youtu-LLM (`youtu`, Tencent) is
DeepSeek-V3's attention in Llama's block with a dense SwiGLU MLP in every layer.

GLM-4.7-Flash (`glm4_moe_lite`) is DeepSeek-V3's attention with GLM-4.5's experts (DeepSeek-V3's router) and its
dense and sparse layers listed per layer (`mlp_layer_types`, as archlab's); its config's `head_dim` is another name of
`qk_rope_head_dim`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

import torch
from transformers import (
    DeepseekV2Config,
    DeepseekV2ForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    Glm4MoeLiteConfig,
    Glm4MoeLiteForCausalLM,
    PreTrainedConfig,
    SarvamMLAConfig,
    YoutuConfig,
    YoutuForCausalLM,
)

from ..modeling import DecoderForCausalLM
from .checks import refuse_export, refuse_import, setting
from .deepseek_moe import (
    DEEPSEEK_MOE_LAYOUT,
    DEEPSEEK_ROUTER,
    EXPERT_FIELDS,
    ROUTER_GROUPS,
    shared_expert_from_archlab,
    shared_expert_to_archlab,
)
from .family import Family, Layout, StateDict, same
from .field_lists import LLAMA_FIELDS
from .interleaved_rope import rotate_half_order

LATENT_ATTENTION_FIELDS = ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
DEEPSEEK_V3_FIELDS = {
    **same(*(name for name in LLAMA_FIELDS if name not in ("head_dim", "mlp_bias")), *LATENT_ATTENTION_FIELDS),
    **EXPERT_FIELDS,
}
# the projections whose last `qk_rope_head_dim` rows (of each head, for the queries) RoPE rotates
QUERY_ROWS = re.compile(r"^model\.layers\.\d+\.self_attn\.(q_proj|q_b_proj)\.weight$")
ROTARY_KEY_ROWS = re.compile(r"^model\.layers\.\d+\.self_attn\.kv_a_proj_with_mqa\.(weight|bias)$")


def _to_archlab(stock: PreTrainedConfig, values: Mapping[str, Any]) -> dict[str, Any]:
    if not stock.rope_interleave:
        refuse_import(
            "deepseek_v3",
            {setting(stock, "rope_interleave"): "archlab converts DeepSeek-V3's interleaved RoPE, as published"},
        )
    dense = min(stock.first_k_dense_replace, stock.num_hidden_layers)
    return {
        **shared_expert_to_archlab(stock),
        "mlp_layer_types": ["dense"] * dense + ["sparse"] * (stock.num_hidden_layers - dense),
    }


def _deepseek_layers_from_archlab(config: PreTrainedConfig, architecture: str) -> dict[str, Any]:
    """What DeepSeek-V2 and V3 write alike: the shared experts, the group-limited routing and the first dense layers;
    refuses what neither computes (dense layers after sparse ones, an attention without latents)."""
    types = config.mlp_layer_types
    dense = types.index("sparse") if "sparse" in types else len(types)
    wrong = {}
    if any(kind != "sparse" for kind in types[dense:]):
        wrong[setting(config, "mlp_layer_types")] = "DeepSeek's dense layers come first, every later layer sparse"
    if config.kv_lora_rank is None:
        wrong[setting(config, "kv_lora_rank")] = "DeepSeek's attention is multi-head latent attention"
    refuse_export(architecture, wrong)
    shared = shared_expert_from_archlab(config, architecture, "n_shared_experts")
    return {**shared, "first_k_dense_replace": dense}


def _from_archlab(config: PreTrainedConfig) -> dict[str, Any]:
    return {**_deepseek_layers_from_archlab(config, "DeepseekV3ForCausalLM"), "rope_interleave": True}


def _reordered(rows: torch.Tensor, block: int, rotary: int, inverse: bool) -> torch.Tensor:
    """`rows` (…, n · block rows first) with the last `rotary` rows of each `block` reordered from interleaved to
    rotate-half order (`inverse`: back)."""
    order = rotate_half_order(rotary, rotary)
    if inverse:
        order = torch.argsort(order)
    within = torch.cat([torch.arange(block - rotary), block - rotary + order])
    blocks = rows.shape[0] // block
    return rows.reshape(blocks, block, *rows.shape[1:])[:, within].reshape(rows.shape)


def _permuted(state_dict: StateDict, config: PreTrainedConfig, inverse: bool) -> StateDict:
    rotary, head = config.qk_rope_head_dim, config.qk_nope_head_dim + config.qk_rope_head_dim
    out = {}
    for key, tensor in state_dict.items():
        if QUERY_ROWS.match(key):  # each head's rows: [no positions; rotary]
            tensor = _reordered(tensor, head, rotary, inverse)
        elif ROTARY_KEY_ROWS.match(key):  # [latent; the rotary key]
            tensor = _reordered(tensor, tensor.shape[0], rotary, inverse)
        out[key] = tensor
    return out


DEEPSEEK_V3_LAYOUT = Layout(
    to_archlab=lambda state_dict, config: _permuted(DEEPSEEK_MOE_LAYOUT.to_archlab(state_dict, config), config, False),
    from_archlab=lambda state_dict, config: DEEPSEEK_MOE_LAYOUT.from_archlab(
        _permuted(state_dict, config, True), config
    ),
)

DEEPSEEK_V3 = Family(
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    DecoderForCausalLM,
    fields=DEEPSEEK_V3_FIELDS,
    implied=DEEPSEEK_ROUTER,
    to_archlab=_to_archlab,
    from_archlab=_from_archlab,
    # the router z-loss only changes training; it is dropped on export
    expressible=frozenset({"mlp_layer_types", "shared_expert_intermediate_size", "router_z_loss_coef", *ROUTER_GROUPS}),
    layout=DEEPSEEK_V3_LAYOUT,
)

# --- DeepSeek-V2: the same attention, DeepSeek-V2's experts ----------------------------------------------------------

DEEPSEEK_V2_FIELDS = {
    **same(*(name for name in LLAMA_FIELDS if name != "head_dim"), *LATENT_ATTENTION_FIELDS),
    **{name: ours for name, ours in EXPERT_FIELDS.items() if name != "norm_topk_prob"},
}


def _v2_to_archlab(stock: PreTrainedConfig, values: Mapping[str, Any]) -> dict[str, Any]:
    """Greedy routing, or group-limited greedy (DeepSeek-V2 itself: n_group=8, topk_group=3): groups scored by their
    best expert (`router_group_score="max"`)."""
    groups, top = stock.n_group or 1, stock.topk_group
    limited = stock.topk_method == "group_limited_greedy" and groups > 1 and top is not None and top < groups
    routing = {"router_groups": groups, "router_top_groups": top, "router_group_score": "max"} if limited else {}
    dense = min(stock.first_k_dense_replace, stock.num_hidden_layers)
    shared = shared_expert_to_archlab(stock)
    return {
        "shared_expert_intermediate_size": shared["shared_expert_intermediate_size"],
        "mlp_layer_types": ["dense"] * dense + ["sparse"] * (stock.num_hidden_layers - dense),
        **routing,
    }


def _v2_from_archlab(config: PreTrainedConfig) -> dict[str, Any]:
    limited = config.router_groups > 1 and (config.router_top_groups or config.router_groups) < config.router_groups
    if limited and config.router_group_score != "max":
        refuse_export(
            "DeepseekV2ForCausalLM",
            {
                setting(config, "router_group_score"): (
                    "DeepSeek-V2's group-limited routing scores a group by its best expert: 'max'"
                )
            },
        )
    layers = _deepseek_layers_from_archlab(config, "DeepseekV2ForCausalLM")
    if limited:
        return {**layers, "topk_method": "group_limited_greedy", "norm_topk_prob": False}
    del layers["n_group"], layers["topk_group"]  # greedy routing: DeepSeek-V2's configs leave them unset
    return {**layers, "topk_method": "greedy", "norm_topk_prob": False}


DEEPSEEK_V2 = Family(
    DeepseekV2Config,
    DeepseekV2ForCausalLM,
    DecoderForCausalLM,
    fields=DEEPSEEK_V2_FIELDS,
    implied={"shared_expert_gate": False, "norm_topk_prob": False},
    to_archlab=_v2_to_archlab,
    from_archlab=_v2_from_archlab,
    expressible=frozenset(
        {
            "mlp_layer_types",
            "shared_expert_intermediate_size",
            "router_z_loss_coef",
            "router_group_score",
            *ROUTER_GROUPS,
        }
    ),
    layout=DEEPSEEK_V3_LAYOUT,
)
# --- GLM-4.7-Flash: DeepSeek-V3's attention, GLM-4.5's experts, dense and sparse layers listed ------------------------

GLM4_MOE_LITE_FIELDS = {**DEEPSEEK_V3_FIELDS, **same("mlp_layer_types")}


def _glm4_moe_lite_to_archlab(stock: PreTrainedConfig, values: Mapping[str, Any]) -> dict[str, Any]:
    if not stock.rope_interleave:
        refuse_import(
            "glm4_moe_lite",
            {setting(stock, "rope_interleave"): "archlab converts GLM-4.7-Flash's interleaved RoPE, as published"},
        )
    return shared_expert_to_archlab(stock)


def _glm4_moe_lite_from_archlab(config: PreTrainedConfig) -> dict[str, Any]:
    if config.kv_lora_rank is None:
        refuse_export(
            "Glm4MoeLiteForCausalLM",
            {setting(config, "kv_lora_rank"): "GLM-4.7-Flash's attention is multi-head latent attention"},
        )
    shared = shared_expert_from_archlab(config, "Glm4MoeLiteForCausalLM", "n_shared_experts")
    return {**shared, "rope_interleave": True}


GLM4_MOE_LITE = Family(
    Glm4MoeLiteConfig,
    Glm4MoeLiteForCausalLM,
    DecoderForCausalLM,
    fields=GLM4_MOE_LITE_FIELDS,
    implied=DEEPSEEK_ROUTER,
    to_archlab=_glm4_moe_lite_to_archlab,
    from_archlab=_glm4_moe_lite_from_archlab,
    expressible=frozenset({"shared_expert_intermediate_size", "router_z_loss_coef", *ROUTER_GROUPS}),
    layout=DEEPSEEK_V3_LAYOUT,
)

# --- Sarvam-105B: DeepSeek-V3 under its own config class ------------------------------------------------------------

SARVAM_MLA = dataclasses.replace(DEEPSEEK_V3, config_class=SarvamMLAConfig)

# --- Youtu-LLM: DeepSeek-V3's attention, a dense MLP in every layer ---------------------------------------------------


def _youtu_to_archlab(stock: PreTrainedConfig, values: Mapping[str, Any]) -> dict[str, Any]:
    if not stock.rope_interleave:
        refuse_import(
            "youtu", {setting(stock, "rope_interleave"): "archlab converts Youtu's interleaved RoPE, as published"}
        )
    return {}


def _youtu_from_archlab(config: PreTrainedConfig) -> dict[str, Any]:
    wrong = {}
    if config.kv_lora_rank is None:
        wrong[setting(config, "kv_lora_rank")] = "Youtu's attention is multi-head latent attention"
    if "sparse" in config.mlp_layer_types:
        wrong[setting(config, "mlp_layer_types")] = "every Youtu layer has a dense MLP"
    refuse_export("YoutuForCausalLM", wrong)
    return {"rope_interleave": True}


YOUTU = Family(
    YoutuConfig,
    YoutuForCausalLM,
    DecoderForCausalLM,
    fields=same(*(name for name in LLAMA_FIELDS if name not in ("head_dim", "mlp_bias")), *LATENT_ATTENTION_FIELDS),
    to_archlab=_youtu_to_archlab,
    from_archlab=_youtu_from_archlab,
    layout=Layout(
        to_archlab=lambda state_dict, config: _permuted(state_dict, config, False),
        from_archlab=lambda state_dict, config: _permuted(state_dict, config, True),
    ),
)

DEEPSEEK_MLA_FAMILIES = (DEEPSEEK_V3, DEEPSEEK_V2, GLM4_MOE_LITE, SARVAM_MLA, YOUTU)

__all__ = ["DEEPSEEK_MLA_FAMILIES", "DEEPSEEK_V2", "DEEPSEEK_V3", "GLM4_MOE_LITE", "SARVAM_MLA", "YOUTU"]
