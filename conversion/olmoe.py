"""OLMoE and FlexOlmo (AI2's mixture-of-experts OLMo models) as `Family` rows.

OLMoE is Llama's pre-norm block with OLMo 2's QK-norm over the whole q and k projections (`q_norm` of heads · head_dim,
`k_norm` of KV heads · head_dim; archlab's `qk_norm_scope="projection"`) and a mixture of experts in every layer: a
softmax router whose top-k weights are not renormalised by default (`norm_topk_prob=False`), no shared expert, each
expert `intermediate_size` wide. FlexOlmo has OLMo 2's output norms instead of input norms (each sub-layer's output
normed before the residual add: archlab's `norm_position="output"`). Their checkpoints hold one module per expert,
`mlp.experts.E.gate_proj/up_proj/down_proj` with the router `mlp.gate` (Qwen2-MoE's layout, `experts.py`). OLMoE's
`clip_qkv` (q, k and v clamped) has no archlab field: refused by name. Neither config has a `head_dim` field; their
attention and RoPE read one from config.json (`head_dim_given`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from transformers import FlexOlmoConfig, FlexOlmoForCausalLM, OlmoeConfig, OlmoeForCausalLM, PreTrainedConfig

from ..modeling import DecoderForCausalLM
from .checks import head_dim_given, head_dim_to_write, refuse_export, refuse_import, setting
from .experts import QWEN2_MOE_LAYOUT
from .family import Family, same
from .field_lists import LLAMA_FIELDS

OLMOE_FIELDS = {
    **same(
        *(name for name in LLAMA_FIELDS if name not in ("head_dim", "mlp_bias", "intermediate_size")),
        "num_experts_per_tok",
        "output_router_logits",
        "router_aux_loss_coef",
        "norm_topk_prob",
    ),
    "intermediate_size": ("intermediate_size", "moe_intermediate_size"),
    "num_experts": "num_local_experts",
}
QK_NORM_OVER_PROJECTION = {"use_qk_norm": True, "qk_norm_scope": "projection"}


def _to_archlab(stock: PreTrainedConfig, values: Mapping[str, Any]) -> dict[str, Any]:
    if getattr(stock, "clip_qkv", None) is not None:
        refuse_import(stock.model_type, {setting(stock, "clip_qkv"): "archlab has no clamp of q, k and v"})
    return head_dim_given(stock, values)


def _from_archlab(architecture: str):
    def from_archlab(config: PreTrainedConfig) -> dict[str, Any]:
        if any(kind != "sparse" for kind in config.mlp_layer_types):
            every_layer = f"every {architecture} layer is a mixture of experts"
            refuse_export(architecture, {setting(config, "mlp_layer_types"): every_layer})
        return head_dim_to_write(config)

    return from_archlab


OLMOE = Family(
    OlmoeConfig,
    OlmoeForCausalLM,
    DecoderForCausalLM,
    fields=OLMOE_FIELDS,
    implied=QK_NORM_OVER_PROJECTION,
    to_archlab=_to_archlab,
    from_archlab=_from_archlab("OlmoeForCausalLM"),
    # the router z-loss only changes training; it is dropped on export
    expressible=frozenset({"head_dim", "mlp_layer_types", "router_z_loss_coef"}),
    layout=QWEN2_MOE_LAYOUT,
)
FLEX_OLMO = Family(
    FlexOlmoConfig,
    FlexOlmoForCausalLM,
    DecoderForCausalLM,
    fields=OLMOE_FIELDS,
    implied={**QK_NORM_OVER_PROJECTION, "norm_position": "output"},
    to_archlab=_to_archlab,
    from_archlab=_from_archlab("FlexOlmoForCausalLM"),
    expressible=frozenset({"head_dim", "mlp_layer_types", "router_z_loss_coef"}),
    layout=QWEN2_MOE_LAYOUT,
)
OLMOE_FAMILIES = (OLMOE, FLEX_OLMO)

__all__ = ["FLEX_OLMO", "OLMOE", "OLMOE_FAMILIES"]
