"""IBM Granite (3.x dense), GraniteMoE and GraniteMoE-Shared as `Family` rows.

Granite is Llama's block with μP's four constants (Tensor Programs V, Yang et al. 2022), each an archlab field:

    Granite                  archlab                  what it scales
    embedding_multiplier     embedding_multiplier     the token embeddings
    residual_multiplier      residual_multiplier      each sub-layer's output before the residual add
    attention_multiplier     attention_multiplier     the attention scores (in place of head_dim^-½)
    logits_scaling           logit_scale = 1 / it     the logits (Granite divides by it, archlab multiplies)

Granite's attention always scales by `attention_multiplier` (1.0 by default, not head_dim^-½): an archlab config
without one exports head_dim^-½ there. Its config has no `head_dim` field, but its attention and RoPE read one from
config.json (`head_dim_given`).

GraniteMoE replaces the MLP by a mixture of experts in every layer whose top-k weights are the softmax of the top-k
router logits (archlab's renormalised top-k, `norm_topk_prob=True`), each expert `intermediate_size` wide;
GraniteMoE-Shared adds an ungated shared expert (`shared_intermediate_size`; archlab's `shared_expert_gate=False`).
Their checkpoints hold the experts fused (`block_sparse_moe.input_linear` = [gate; up] per expert, `output_linear`,
the router `router.layer`; the shared expert's `shared_mlp.input_linear` = [gate; up]), which `GRANITE_MOE_LAYOUT`
renames (and splits the shared expert's [gate; up]) both ways; in memory transformers names them
`block_sparse_moe.experts.gate_up_proj` / `down_proj` and `router.weight`, the names an export hands the stock class.

Granite SWA (`granite_swa`, granite-swash) is Granite with local and global layers (`sliding_window`, `layer_types`:
every fourth layer global by default), a learned sink logit per head (`self_attn.sinks`, archlab's
`attention_sinks`: its eager path scales the output by sigmoid(logsumexp(scores) - sink), the same function as GPT-OSS's
extra softmax logit) and a RoPE base per layer (`layer_rope_theta`, 0 for a NoPE layer): archlab's `nope_layers` and one
RoPE set, or one per layer type where the local and global layers' bases differ.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch
from transformers import (
    GraniteConfig,
    GraniteForCausalLM,
    GraniteMoeConfig,
    GraniteMoeForCausalLM,
    GraniteMoeSharedConfig,
    GraniteMoeSharedForCausalLM,
    GraniteSWAConfig,
    GraniteSWAForCausalLM,
    PreTrainedConfig,
)

from ..modeling import DecoderForCausalLM
from .checks import head_dim_given, head_dim_to_write, refuse_export, refuse_import, setting
from .family import Family, Layout, StateDict, same
from .field_lists import LLAMA_FIELDS

# GraniteConfig: Llama's fields (no `head_dim` field) and the embedding and residual multipliers under archlab's names
GRANITE_FIELDS = (
    *(name for name in LLAMA_FIELDS if name != "head_dim"),
    "embedding_multiplier",
    "residual_multiplier",
)
# GraniteMoeConfig: Granite's without `mlp_bias`, `intermediate_size` the width of each expert, Mixtral's router fields
GRANITE_MOE_FIELDS = {
    **same(
        *(name for name in GRANITE_FIELDS if name not in ("mlp_bias", "intermediate_size")),
        "num_local_experts",
        "num_experts_per_tok",
        "output_router_logits",
        "router_aux_loss_coef",
    ),
    "intermediate_size": ("intermediate_size", "moe_intermediate_size"),
}
GRANITE_MOE_SHARED_FIELDS = {**GRANITE_MOE_FIELDS, "shared_intermediate_size": "shared_expert_intermediate_size"}
# what a μP Granite config maps by callables (`_to_archlab`, `_from_archlab`) rather than by name
SCALES = frozenset({"attention_multiplier", "logit_scale", "head_dim"})


def _to_archlab(stock: PreTrainedConfig, values: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "attention_multiplier": stock.attention_multiplier,
        "logit_scale": 1.0 / stock.logits_scaling,
        **head_dim_given(stock, values),
    }


def _from_archlab(config: PreTrainedConfig) -> dict[str, Any]:
    attention = config.attention_multiplier
    return {
        "attention_multiplier": attention if attention is not None else config.head_dim**-0.5,
        "logits_scaling": 1.0 / config.logit_scale,
        **head_dim_to_write(config),
    }


def _moe_from_archlab(config: PreTrainedConfig, architecture: str) -> dict[str, Any]:
    """A GraniteMoE(-Shared) has experts in every layer, renormalised top-k weights and an ungated shared expert."""
    wrong = {}
    if any(kind != "sparse" for kind in config.mlp_layer_types):
        wrong[setting(config, "mlp_layer_types")] = f"every {architecture} layer is a mixture of experts"
    if not config.norm_topk_prob:
        wrong[setting(config, "norm_topk_prob")] = "its top-k weights are a softmax over the chosen experts' logits"
    if config.shared_expert_intermediate_size and config.shared_expert_gate:
        wrong[setting(config, "shared_expert_gate")] = "its shared expert has no gate"
    refuse_export(architecture, wrong)
    return _from_archlab(config)


# --- the experts' checkpoint layout ---------------------------------------------------------------------------------

LAYER = r"^(?P<layer>model\.layers\.\d+)\."
# checkpoint (and in-memory) names of a sparse block -> archlab's
STOCK_EXPERTS = {
    "block_sparse_moe.input_linear.weight": "mlp.experts.gate_up_proj",
    "block_sparse_moe.experts.gate_up_proj": "mlp.experts.gate_up_proj",
    "block_sparse_moe.output_linear.weight": "mlp.experts.down_proj",
    "block_sparse_moe.experts.down_proj": "mlp.experts.down_proj",
    "block_sparse_moe.router.layer.weight": "mlp.gate.weight",
    "block_sparse_moe.router.weight": "mlp.gate.weight",
    "shared_mlp.output_linear.weight": "mlp.shared_expert.down_proj.weight",
}
# archlab's -> the in-memory names an export hands the stock class
ARCHLAB_EXPERTS = {
    "mlp.experts.gate_up_proj": "block_sparse_moe.experts.gate_up_proj",
    "mlp.experts.down_proj": "block_sparse_moe.experts.down_proj",
    "mlp.gate.weight": "block_sparse_moe.router.weight",
    "mlp.shared_expert.down_proj.weight": "shared_mlp.output_linear.weight",
}
SHARED_GATE_UP = "shared_mlp.input_linear.weight"
ARCHLAB_SHARED = ("mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight")


def _renamed(state_dict: StateDict, names: Mapping[str, str]) -> tuple[StateDict, dict[tuple[str, str], torch.Tensor]]:
    """`state_dict` with each layer's `names` renamed; the tensors no name covers kept as they are, in `rest`."""
    out: StateDict = {}
    rest: dict[tuple[str, str], torch.Tensor] = {}
    for key, tensor in state_dict.items():
        match = re.match(LAYER + r"(?P<name>.+)$", key)
        name = match.group("name") if match else None
        if name in names:
            out[f"{match.group('layer')}.{names[name]}"] = tensor
        elif name in (SHARED_GATE_UP, *ARCHLAB_SHARED):
            rest[(match.group("layer"), name)] = tensor
        else:
            out[key] = tensor
    return out, rest


def _experts_to_archlab(state_dict: StateDict, config: PreTrainedConfig) -> StateDict:
    out, shared = _renamed(state_dict, STOCK_EXPERTS)
    for (layer, _), tensor in shared.items():  # the shared expert's [gate; up]
        for name, part in zip(ARCHLAB_SHARED, tensor.chunk(2)):
            out[f"{layer}.{name}"] = part.contiguous()
    return out


def _experts_from_archlab(state_dict: StateDict, config: PreTrainedConfig) -> StateDict:
    out, shared = _renamed(state_dict, ARCHLAB_EXPERTS)
    for layer in sorted({layer for layer, _ in shared}):
        out[f"{layer}.{SHARED_GATE_UP}"] = torch.cat([shared[(layer, name)] for name in ARCHLAB_SHARED])
    return out


GRANITE_MOE_LAYOUT = Layout(to_archlab=_experts_to_archlab, from_archlab=_experts_from_archlab)

GRANITE = Family(
    GraniteConfig,
    GraniteForCausalLM,
    DecoderForCausalLM,
    fields=same(*GRANITE_FIELDS),
    to_archlab=_to_archlab,
    from_archlab=_from_archlab,
    expressible=SCALES,
)
GRANITE_MOE = Family(
    GraniteMoeConfig,
    GraniteMoeForCausalLM,
    DecoderForCausalLM,
    fields=GRANITE_MOE_FIELDS,
    implied={"norm_topk_prob": True},
    to_archlab=_to_archlab,
    from_archlab=lambda config: _moe_from_archlab(config, "GraniteMoeForCausalLM"),
    # the router z-loss only changes training; it is dropped on export
    expressible=SCALES | {"mlp_layer_types", "router_z_loss_coef"},
    layout=GRANITE_MOE_LAYOUT,
)
GRANITE_MOE_SHARED = Family(
    GraniteMoeSharedConfig,
    GraniteMoeSharedForCausalLM,
    DecoderForCausalLM,
    fields=GRANITE_MOE_SHARED_FIELDS,
    implied={"norm_topk_prob": True, "shared_expert_gate": False},
    to_archlab=_to_archlab,
    from_archlab=lambda config: _moe_from_archlab(config, "GraniteMoeSharedForCausalLM"),
    expressible=SCALES | {"mlp_layer_types", "router_z_loss_coef"},
    layout=GRANITE_MOE_LAYOUT,
)

# --- Granite SWA: local and global layers, a sink per head, a RoPE base per layer ------------------------------------


def _swa_to_archlab(stock: PreTrainedConfig, values: Mapping[str, Any]) -> dict[str, Any]:
    """Granite's, with `layer_rope_theta` (a base per layer, 0 for NoPE) as `nope_layers` and one RoPE set for every
    layer, or one per layer type where the two types' bases differ; other patterns are refused."""
    thetas, kinds = list(stock.layer_rope_theta), list(stock.layer_types)
    nope = [i for i, theta in enumerate(thetas) if not theta]
    bases = {kind: {theta for theta, k in zip(thetas, kinds) if theta and k == kind} for kind in set(kinds)}
    if any(len(found) > 1 for found in bases.values()):
        refuse_import(
            "granite_swa",
            {
                f"layer_rope_theta={thetas!r}": (
                    "archlab rotates the layers of one type (`layer_types`) with one RoPE base"
                )
            },
        )
    rope = {key: value for key, value in stock.rope_parameters.items()}
    bases = {kind: found.pop() for kind, found in bases.items() if found}
    if len(set(bases.values())) > 1:
        rope = {kind: {**rope, "rope_theta": theta} for kind, theta in bases.items()}
    elif bases:
        rope = {**rope, "rope_theta": next(iter(bases.values()))}
    return {**_to_archlab(stock, values), "rope_parameters": rope, "nope_layers": nope or None}


def _swa_from_archlab(config: PreTrainedConfig) -> dict[str, Any]:
    if not config.attention_sinks:
        refuse_export(
            "GraniteSWAForCausalLM", {setting(config, "attention_sinks"): "every Granite SWA layer has a sink per head"}
        )
    nope = set(config.nope_layers or ())
    per_type = {k: v for k, v in config.rope_parameters.items() if isinstance(v, dict)}
    flat = dict(next(iter(per_type.values()))) if per_type else dict(config.rope_parameters)
    thetas = [
        0 if i in nope else (per_type[kind] if per_type else flat)["rope_theta"]
        for i, kind in enumerate(config.layer_types)
    ]
    if per_type and any({**v, "rope_theta": 0} != {**flat, "rope_theta": 0} for v in per_type.values()):
        refuse_export(
            "GraniteSWAForCausalLM",
            {setting(config, "rope_parameters"): "Granite SWA's layers differ in their RoPE base alone"},
        )
    return {**_from_archlab(config), "rope_parameters": flat, "layer_rope_theta": thetas}


GRANITE_SWA = Family(
    GraniteSWAConfig,
    GraniteSWAForCausalLM,
    DecoderForCausalLM,
    fields=same(*GRANITE_FIELDS, "sliding_window", "layer_types"),
    implied={"attention_sinks": True},
    to_archlab=_swa_to_archlab,
    from_archlab=_swa_from_archlab,
    expressible=SCALES | {"nope_layers"},
)

GRANITE_FAMILIES = (GRANITE, GRANITE_MOE, GRANITE_MOE_SHARED, GRANITE_SWA)

__all__ = ["GRANITE", "GRANITE_FAMILIES", "GRANITE_MOE", "GRANITE_MOE_SHARED", "GRANITE_MOE_LAYOUT", "GRANITE_SWA"]
