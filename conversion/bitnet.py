"""BitNet b1.58 (`bitnet`, `BitNetForCausalLM`) as a `Family` row.

BitNet is Llama's pre-RMSNorm block with Sub-LN (Wang et al. 2022, "Foundation Transformers"): an RMSNorm over the
heads' output before `o_proj` (`self_attn.attn_sub_norm`) and over the gated MLP's hidden activation before
`down_proj` (`mlp.ffn_sub_norm`), archlab's `sub_layer_norm=True` under the same names; its MLP's activation is ReLU²
(`hidden_act="relu2"`), and it has no MLP bias and no `head_dim` field (the sub-norm is `hidden_size` wide: heads ×
head size = hidden size).

What makes BitNet b1.58 ternary is transformers' quantizer, named in config.json's `quantization_config`
(`quant_method="bitnet"`):
- `linear_class="autobitlinear"`, `quantization_mode="online"` (Microsoft's `bitnet-b1.58-2B-4T-bf16`): the folder
  holds full-precision weights that every forward makes ternary, with 8-bit activations: archlab's `bitlinear=True`
  (`modeling/bitlinear.py`, the same arithmetic), and it exports so again;
- the offline modes (`bitnet-b1.58-2B-4T`, for deployment) hold each projection's ternary weights, packed four to a
  byte (`uint8`, rows `i`, `i + R`, `i + 2R`, `i + 3R` of an `[4R, in]` weight in the bit pairs of byte row `i`) or
  as floats, with a scale each (`weight_scale`); the layer computes `ternary / weight_scale` (`linear_class=
  "bitlinear"`) or `ternary * weight_scale` (`"autobitlinear"`, offline: its bias scaled too, as transformers'
  layer adds the bias before the scale). `dequantize_offline` makes each one the
  full-precision weight whose online quantization is that product (`weight_of_ternary`): archlab's `bitlinear=True`
  then computes what transformers' offline layer computes, and the folder exports as an online one. Its weights
  train as BitNet's latent weights from there (the bf16 master weights Microsoft trained are another folder);
- `use_rms_norm=True` (an RMSNorm inside every BitLinear) and other `modules_to_not_convert` than the LM head are
  refused by name.
Without a `quantization_config` a BitNet-shaped model converts as a floating-point one (`bitlinear=False`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from transformers import BitNetConfig, BitNetForCausalLM, PreTrainedConfig

from ..modeling import DecoderForCausalLM
from ..modeling.bitlinear import weight_of_ternary
from .checks import refuse_export, refuse_import, setting
from .family import ConversionError, Family, StateDict, same
from .field_lists import LLAMA_FIELDS

BITNET_FIELDS = tuple(name for name in LLAMA_FIELDS if name not in ("head_dim", "mlp_bias"))


# what a folder of full-precision weights made ternary in every forward says (archlab's `bitlinear=True`)
ONLINE_BITLINEAR = {"quant_method": "bitnet", "linear_class": "autobitlinear", "quantization_mode": "online"}
# transformers' `BitNetQuantConfig` defaults where config.json leaves them out
QUANTIZER_DEFAULTS = {"linear_class": "bitlinear", "quantization_mode": "offline"}
LINEAR_CLASSES = ("bitlinear", "autobitlinear")
QUANTIZATION_MODES = ("online", "offline")
VALUES_PER_BYTE = 4  # ternary values packed in a uint8 of an offline folder, two bits each


def _quantizer(values: Mapping[str, Any]) -> dict[str, Any] | None:
    """A BitNet folder's `quantization_config` with transformers' defaults filled in; None without one."""
    quantization = values.get("quantization_config")
    if not isinstance(quantization, Mapping) or quantization.get("quant_method") != "bitnet":
        return None
    return {**QUANTIZER_DEFAULTS, **quantization}


def _offline(quantizer: Mapping[str, Any]) -> bool:
    """Whether transformers builds the folder's projections from stored ternary weights and scales: its packed
    `BitLinear` (any mode) or an offline `AutoBitLinear`."""
    return quantizer["linear_class"] == "bitlinear" or quantizer["quantization_mode"] == "offline"


def _to_archlab(stock: PreTrainedConfig, values: Mapping[str, Any]) -> dict[str, Any]:
    quantizer = _quantizer(values)
    if quantizer is None:
        return {"bitlinear": False}
    wrong = {}
    for name, allowed in (("linear_class", LINEAR_CLASSES), ("quantization_mode", QUANTIZATION_MODES)):
        if quantizer[name] not in allowed:
            wrong[f"quantization_config.{name}={quantizer[name]!r}"] = f"transformers knows {', '.join(allowed)}"
    if quantizer.get("use_rms_norm"):
        wrong["quantization_config.use_rms_norm=True"] = "archlab's BitLinear has no RMSNorm of its own"
    skipped = quantizer.get("modules_to_not_convert")
    if skipped and set(skipped) - {"lm_head"}:
        wrong[f"quantization_config.modules_to_not_convert={skipped!r}"] = (
            "archlab makes every projection of the layers BitLinear, the LM head never"
        )
    refuse_import("bitnet", wrong)
    return {"bitlinear": True}


def unpack_ternary(packed: torch.Tensor) -> torch.Tensor:
    """The int8 ternary weight [4R, ...] of an offline folder's packed uint8 one [R, ...] (two bits a value, stored
    as value + 1; byte row i holds rows i, i + R, i + 2R, i + 3R from its low bits up)."""
    shifts = range(0, 2 * VALUES_PER_BYTE, 2)
    return torch.cat([(packed >> shift) & 3 for shift in shifts]).to(torch.int8) - 1


def dequantize_offline(state_dict: StateDict, values: Mapping[str, Any]) -> StateDict:
    """An offline BitNet folder's projections (ternary weights, packed or not, and a `weight_scale` each) as the
    full-precision weights `BitLinear` makes the same ternary weights of (module docstring), in the dtype of the
    folder's embeddings; other folders' state dicts as they are."""
    quantizer = _quantizer(values)
    if quantizer is None or not _offline(quantizer):
        return state_dict
    divides = quantizer["linear_class"] == "bitlinear"  # transformers' BitLinear divides by the scale
    dtype = next(tensor.dtype for key, tensor in state_dict.items() if tensor.is_floating_point() and "embed" in key)
    state_dict = dict(state_dict)
    for key in [key for key in state_dict if key.endswith(".weight_scale")]:
        name = key.removesuffix("_scale")
        scale = state_dict.pop(key).double()
        stored = state_dict.get(name)
        if stored is None or scale.numel() != 1:
            raise ConversionError(
                f"{key} is not a BitNet weight's scale: one value beside a `{name}` (the folder has "
                f"{'no such weight' if stored is None else f'{scale.numel()} values'})."
            )
        ternary = unpack_ternary(stored) if stored.dtype == torch.uint8 else stored
        if not bool(((ternary == -1) | (ternary == 0) | (ternary == 1)).all()):
            raise ConversionError(
                f"{name} holds values other than -1, 0 and 1: not the ternary weights of an offline BitNet folder "
                f"(quantization_config.linear_class={quantizer['linear_class']!r})."
            )
        magnitude = (1 / scale if divides else scale).item()
        bias = name.removesuffix("weight") + "bias"
        if not divides and bias in state_dict:  # an offline AutoBitLinear scales its output after adding the bias
            state_dict[bias] = (state_dict[bias].double() * scale).to(state_dict[bias].dtype)
        try:
            state_dict[name] = weight_of_ternary(ternary, magnitude, dtype)
        except ValueError as error:
            raise ConversionError(f"{key}: {error}.") from None
    return state_dict


def _from_archlab(config: PreTrainedConfig) -> dict[str, Any]:
    wrong = {}
    if config.head_dim * config.num_attention_heads != config.hidden_size:
        wrong[setting(config, "head_dim")] = (
            f"BitNet's heads span the model width: head_dim × num_attention_heads = hidden_size ({config.hidden_size})"
        )
    refuse_export("BitNetForCausalLM", wrong)
    return {"quantization_config": dict(ONLINE_BITLINEAR)} if config.bitlinear else {}


BITNET = Family(
    BitNetConfig,
    BitNetForCausalLM,
    DecoderForCausalLM,
    fields=same(*BITNET_FIELDS),
    implied={"sub_layer_norm": True},
    to_archlab=_to_archlab,
    from_archlab=_from_archlab,
    expressible=frozenset({"bitlinear"}),
    dequantize=dequantize_offline,
)

__all__ = ["BITNET", "dequantize_offline", "unpack_ternary"]
