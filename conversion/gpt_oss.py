"""GPT-OSS (OpenAI's open-weight mixture-of-experts models, gpt-oss-20b and gpt-oss-120b) as a `Family` row.

GPT-OSS is Llama's pre-norm block with:

- attention with biases on q, k, v and o, a learned sink logit per head (`self_attn.sinks`: archlab's
  `attention_sinks`), local (`sliding_window`) and global layers alternating (`layer_types`), and YaRN RoPE;
- a mixture of experts in every layer, whose router has a bias (`router_bias`) and takes a softmax over the top k
  logits, which is archlab's softmax over every expert renormalised over the top k (`norm_topk_prob=True`); experts
  with a bias on both products (`expert_bias`); and a clamped SwiGLU, act(min(gate, L)) ⊙ (clamp(up, -L, L) + 1)
  with act(x) = x · σ(α x): archlab's `swiglu_limit` = L, `swiglu_up_offset=1`, and `hidden_act="quick_gelu"` for
  GPT-OSS's α = `swiglu_alpha` = 1.702 (`"silu"` for α = 1; other values are refused). The stock config's own
  `hidden_act` ("silu") is read by nothing.

Weights, as transformers holds and saves them: the router `mlp.router` (archlab's `mlp.gate`); the experts'
`gate_up_proj` (K, d, 2f) with each gate column followed by its up column, its bias (K, 2f) interleaved alike, and
`down_proj` (K, f, d) — archlab's are (K, 2f, d) with [gate; up] stacked and (K, d, f). The published checkpoints store
the experts' weights in MXFP4 (`*_blocks` and `*_scales` tensors), which transformers dequantises when it loads them:
convert a folder saved by transformers in bf16 (`from_pretrained` then `save_pretrained`); the quantised tensors are
refused by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from transformers import GptOssConfig, GptOssForCausalLM, PreTrainedConfig

from ..modeling import DecoderForCausalLM
from .checks import refuse_export, refuse_import, setting
from .family import ConversionError, Family, Layout, StateDict, same
from .field_lists import LLAMA_FIELDS

GPT_OSS_FIELDS = {
    **same(
        *(name for name in LLAMA_FIELDS if name not in ("hidden_act", "mlp_bias", "intermediate_size")),
        "sliding_window",
        "layer_types",
        "num_local_experts",
        "num_experts_per_tok",
        "output_router_logits",
        "router_aux_loss_coef",
        "swiglu_limit",
    ),
    "intermediate_size": ("intermediate_size", "moe_intermediate_size"),
}
GPT_OSS_IMPLIED = {
    "attention_sinks": True,
    "router_bias": True,
    "expert_bias": True,
    "swiglu_up_offset": 1.0,
    "norm_topk_prob": True,
}
# GPT-OSS's α of act(x) = x · σ(α x), and the archlab activation that computes it
ACTIVATION_OF_ALPHA = {1.702: "quick_gelu", 1.0: "silu"}


def _to_archlab(stock: PreTrainedConfig, values: Mapping[str, Any]) -> dict[str, Any]:
    alpha = float(stock.swiglu_alpha)
    if alpha not in ACTIVATION_OF_ALPHA:
        allowed = ", ".join(map(str, ACTIVATION_OF_ALPHA))
        refuse_import("gpt_oss", {setting(stock, "swiglu_alpha"): f"archlab computes x · σ(α x) for α in {allowed}"})
    return {"hidden_act": ACTIVATION_OF_ALPHA[alpha]}


def _from_archlab(config: PreTrainedConfig) -> dict[str, Any]:
    wrong = {}
    if config.num_local_experts < 1 or "dense" in config.mlp_layer_types:
        wrong[setting(config, "mlp_layer_types")] = "every GPT-OSS layer is a mixture of experts"
    alphas = {activation: alpha for alpha, activation in ACTIVATION_OF_ALPHA.items()}
    if config.hidden_act not in alphas:
        wrong[setting(config, "hidden_act")] = f"GPT-OSS's experts compute x · σ(α x): one of {sorted(alphas)}"
    if config.swiglu_limit is None:
        wrong[setting(config, "swiglu_limit")] = "GPT-OSS always clamps its experts' gate and up"
    refuse_export("GptOssForCausalLM", wrong)
    return {"swiglu_alpha": alphas[config.hidden_act], "hidden_act": "silu"}


def _interleaved_to_halves(tensor: torch.Tensor) -> torch.Tensor:
    """(…, 2f) with gate and up columns alternating -> (…, 2f) as [gate (f); up (f)]."""
    return torch.cat([tensor[..., 0::2], tensor[..., 1::2]], dim=-1)


def _halves_to_interleaved(tensor: torch.Tensor) -> torch.Tensor:
    """[gate (f); up (f)] on the last dim -> gate and up columns alternating."""
    gate, up = tensor.chunk(2, dim=-1)
    return torch.stack([gate, up], dim=-1).flatten(-2)


QUANTISED = ("_blocks", "_scales")


def _to_archlab_weights(state_dict: StateDict, config: PreTrainedConfig) -> StateDict:
    quantised = sorted(key for key in state_dict if key.endswith(QUANTISED))
    if quantised:
        raise ConversionError(
            f"This GPT-OSS checkpoint holds MXFP4-quantised experts ({quantised[0]}, ...): load it with "
            "`GptOssForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)` (transformers dequantises them), save "
            "it with `save_pretrained`, and convert that folder."
        )
    out: StateDict = {}
    for key, tensor in state_dict.items():
        if ".mlp.router." in key:
            out[key.replace(".mlp.router.", ".mlp.gate.")] = tensor
        elif key.endswith(".mlp.experts.gate_up_proj"):  # (K, d, 2f) interleaved -> (K, 2f, d) [gate; up]
            out[key] = _interleaved_to_halves(tensor).transpose(1, 2).contiguous()
        elif key.endswith(".mlp.experts.gate_up_proj_bias"):
            out[key] = _interleaved_to_halves(tensor).contiguous()
        elif key.endswith(".mlp.experts.down_proj"):  # (K, f, d) -> (K, d, f)
            out[key] = tensor.transpose(1, 2).contiguous()
        else:
            out[key] = tensor
    return out


def _from_archlab_weights(state_dict: StateDict, config: PreTrainedConfig) -> StateDict:
    out: StateDict = {}
    for key, tensor in state_dict.items():
        if ".mlp.gate." in key:
            out[key.replace(".mlp.gate.", ".mlp.router.")] = tensor
        elif key.endswith(".mlp.experts.gate_up_proj"):
            out[key] = _halves_to_interleaved(tensor.transpose(1, 2)).contiguous()
        elif key.endswith(".mlp.experts.gate_up_proj_bias"):
            out[key] = _halves_to_interleaved(tensor).contiguous()
        elif key.endswith(".mlp.experts.down_proj"):
            out[key] = tensor.transpose(1, 2).contiguous()
        else:
            out[key] = tensor
    return out


GPT_OSS = Family(
    GptOssConfig,
    GptOssForCausalLM,
    DecoderForCausalLM,
    fields=GPT_OSS_FIELDS,
    implied=GPT_OSS_IMPLIED,
    to_archlab=_to_archlab,
    from_archlab=_from_archlab,
    # the router z-loss only changes training; it is dropped on export
    expressible=frozenset({"hidden_act", "mlp_layer_types", "router_z_loss_coef"}),
    layout=Layout(_to_archlab_weights, _from_archlab_weights),
)

__all__ = ["GPT_OSS"]
