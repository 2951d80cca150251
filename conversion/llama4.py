"""Llama 4's language model (`llama4_text`: Llama-4-Scout and -Maverick's text stack, `Llama4ForCausalLM`) as a
`Family` row.

Llama 4 is Llama's pre-norm block with:

- "iRoPE": every `no_rope_layer_interval`-th layer sees no positions (`no_rope_layers`: 1 rotates, 0 does not;
  archlab's `nope_layers` lists the 0s), the others rotate over interleaved channel pairs (`interleaved_rope.py`:
  the q/k rows reordered) and attend within blocks of `attention_chunk_size` positions (`layer_types`
  "chunked_attention", the same name and mask in archlab);
- on the rotating layers a QK-norm after RoPE without a gain (`L2Norm`, x / sqrt(mean(x²) + eps)): archlab's
  `use_qk_norm` with `qk_norm_after_rope`, `qk_norm_weight=False` and `qk_norm_nope_layers=False`;
- on the NoPE layers the queries scaled by 1 + attn_scale · log(1 + floor((p + 1) / floor_scale))
  (`attn_temperature_tuning`, `floor_scale`, `attn_scale`: the same names);
- a mixture of experts every `interleave_moe_layer_step`-th layer (`moe_layers`: archlab's `mlp_layer_types`) whose
  router takes the sigmoid of each chosen expert's logit (archlab's sigmoid scores, not renormalised), an expert
  reading the token times that weight (`routing_weights_on_input`) and an ungated shared expert as wide as an expert
  (`intermediate_size`); the dense layers are `intermediate_size_mlp` wide (archlab's `intermediate_size`).

Weights: the sparse block `feed_forward` (archlab's `mlp`) with `router` (archlab's `gate`), the experts'
`gate_up_proj` (K, d, 2f) = [gate | up] on its last dim and `down_proj` (K, f, d) (archlab's are (K, 2f, d) and
(K, d, f)). The stock model computes no load-balancing loss (its `output_router_logits` returns the logits only):
archlab's copy leaves it off. The published multimodal folders (`llama4`, `Llama4ForConditionalGeneration`) hold this
stack under `language_model.`: the converter imports it from them directly (`text_stacks.py`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from transformers import Llama4ForCausalLM, Llama4TextConfig, PreTrainedConfig

from ..modeling import DecoderForCausalLM
from .checks import refuse_export, setting
from .family import Family, Layout, StateDict, same
from .field_lists import LLAMA_FIELDS
from .interleaved_rope import interleaved_rope

LLAMA4_FIELDS = {
    **same(
        *(name for name in LLAMA_FIELDS if name not in ("mlp_bias", "intermediate_size")),
        "num_local_experts",
        "num_experts_per_tok",
        "router_aux_loss_coef",
        "attn_scale",
        "floor_scale",
    ),
    "intermediate_size": ("moe_intermediate_size", "shared_expert_intermediate_size"),
    "intermediate_size_mlp": "intermediate_size",
}
LLAMA4_IMPLIED = {
    "router_score_function": "sigmoid",
    "norm_topk_prob": False,
    "routing_weights_on_input": True,
    "shared_expert_gate": False,
    "output_router_logits": False,
}


def _to_archlab(stock: PreTrainedConfig, values: Mapping[str, Any]) -> dict[str, Any]:
    nope = [index for index, rotates in enumerate(stock.no_rope_layers) if not rotates]
    moe = set(stock.moe_layers)
    chunked = "chunked_attention" in stock.layer_types
    return {
        "nope_layers": nope or None,
        "layer_types": list(stock.layer_types),
        "attention_chunk_size": stock.attention_chunk_size if chunked else None,
        "mlp_layer_types": ["sparse" if index in moe else "dense" for index in range(stock.num_hidden_layers)],
        # the QK-norm (on the rotating layers) and the temperature (on the NoPE ones) where there are such layers
        "use_qk_norm": bool(stock.use_qk_norm) and len(nope) < stock.num_hidden_layers,
        "qk_norm_after_rope": bool(stock.use_qk_norm) and len(nope) < stock.num_hidden_layers,
        "qk_norm_weight": not (stock.use_qk_norm and len(nope) < stock.num_hidden_layers),
        "qk_norm_nope_layers": not (stock.use_qk_norm and nope and len(nope) < stock.num_hidden_layers),
        "attn_temperature_tuning": bool(stock.attn_temperature_tuning) and bool(nope),
    }


def _from_archlab(config: PreTrainedConfig) -> dict[str, Any]:
    nope = set(config.nope_layers or ())
    wrong = {}
    if config.use_qk_norm:
        llama4 = dict(qk_norm_after_rope=True, qk_norm_weight=False, qk_norm_nope_layers=not nope, qk_norm_scope="head")
        for name, value in llama4.items():
            if getattr(config, name) != value:
                wrong[setting(config, name)] = f"Llama 4's QK-norm: {name}={value!r} with use_qk_norm=True"
    if "sliding_attention" in config.layer_types:
        wrong[setting(config, "layer_types")] = "Llama 4's layers are 'full_attention' or 'chunked_attention'"
    if config.num_local_experts and config.shared_expert_intermediate_size != config.moe_intermediate_size:
        wrong[setting(config, "shared_expert_intermediate_size")] = (
            f"Llama 4's shared expert is as wide as an expert (moe_intermediate_size={config.moe_intermediate_size})"
        )
    refuse_export("Llama4ForCausalLM", wrong)
    moe = [index for index, kind in enumerate(config.mlp_layer_types) if kind == "sparse"]
    return {
        "intermediate_size": config.moe_intermediate_size,
        "no_rope_layers": [int(index not in nope) for index in range(config.num_hidden_layers)],
        "layer_types": list(config.layer_types),
        "attention_chunk_size": config.attention_chunk_size,
        "moe_layers": moe,
        "num_local_experts": config.num_local_experts or 1,
        "use_qk_norm": config.use_qk_norm,
        "attn_temperature_tuning": config.attn_temperature_tuning,
    }


def _to_archlab_weights(state_dict: StateDict, config: PreTrainedConfig) -> StateDict:
    out: StateDict = {}
    for key, tensor in state_dict.items():
        key = key.replace(".feed_forward.", ".mlp.").replace(".mlp.router.", ".mlp.gate.")
        if key.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):  # (K, d, 2f) / (K, f, d)
            tensor = tensor.transpose(1, 2).contiguous()
        out[key] = tensor
    return out


def _from_archlab_weights(state_dict: StateDict, config: PreTrainedConfig) -> StateDict:
    out: StateDict = {}
    for key, tensor in state_dict.items():
        if key.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):
            tensor = tensor.transpose(1, 2).contiguous()
        out[key.replace(".mlp.gate.", ".mlp.router.").replace(".mlp.", ".feed_forward.")] = tensor
    return out


LLAMA4_TEXT = Family(
    Llama4TextConfig,
    Llama4ForCausalLM,
    DecoderForCausalLM,
    fields=LLAMA4_FIELDS,
    implied=LLAMA4_IMPLIED,
    to_archlab=_to_archlab,
    from_archlab=_from_archlab,
    # the router z-loss only changes training; it is dropped on export
    expressible=frozenset(
        {
            "nope_layers",
            "layer_types",
            "attention_chunk_size",
            "mlp_layer_types",
            "use_qk_norm",
            "qk_norm_after_rope",
            "qk_norm_weight",
            "qk_norm_nope_layers",
            "attn_temperature_tuning",
            "router_z_loss_coef",
        }
    ),
    layout=interleaved_rope(Layout(_to_archlab_weights, _from_archlab_weights)),
)

__all__ = ["LLAMA4_TEXT"]
