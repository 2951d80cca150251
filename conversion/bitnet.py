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
- the offline mode (`bitnet-b1.58-2B-4T`: weights packed four to a byte with a scale each) is refused: archlab reads
  floating-point weights, and requantizing the unpacked ternary values online would not give the same model;
- `use_rms_norm=True` (an RMSNorm inside every BitLinear) and other `modules_to_not_convert` than the LM head are
  refused by name.
Without a `quantization_config` a BitNet-shaped model converts as a floating-point one (`bitlinear=False`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from transformers import BitNetConfig, BitNetForCausalLM, PreTrainedConfig

from ..modeling import DecoderForCausalLM
from .checks import refuse_export, refuse_import, setting
from .family import Family, same
from .field_lists import LLAMA_FIELDS

BITNET_FIELDS = tuple(name for name in LLAMA_FIELDS if name not in ("head_dim", "mlp_bias"))


# what a folder of full-precision weights made ternary in every forward says (archlab's `bitlinear=True`)
ONLINE_BITLINEAR = {"quant_method": "bitnet", "linear_class": "autobitlinear", "quantization_mode": "online"}
# transformers' `BitNetQuantConfig` defaults where config.json leaves them out
QUANTIZER_DEFAULTS = {"linear_class": "bitlinear", "quantization_mode": "offline"}


def _to_archlab(stock: PreTrainedConfig, values: Mapping[str, Any]) -> dict[str, Any]:
    quantization = values.get("quantization_config")
    if not isinstance(quantization, Mapping) or quantization.get("quant_method") != "bitnet":
        return {"bitlinear": False}
    wrong = {}
    for name, value in ONLINE_BITLINEAR.items():
        given = quantization.get(name, QUANTIZER_DEFAULTS.get(name))
        if given != value:
            wrong[f"quantization_config.{name}={given!r}"] = (
                f"archlab computes BitLinear from floating-point weights ({name}={value!r}); the offline mode's "
                "packed ternary weights and scales are not read"
            )
    if quantization.get("use_rms_norm"):
        wrong["quantization_config.use_rms_norm=True"] = "archlab's BitLinear has no RMSNorm of its own"
    skipped = quantization.get("modules_to_not_convert")
    if skipped and set(skipped) - {"lm_head"}:
        wrong[f"quantization_config.modules_to_not_convert={skipped!r}"] = (
            "archlab makes every projection of the layers BitLinear, the LM head never"
        )
    refuse_import("bitnet", wrong)
    return {"bitlinear": True}


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
)

__all__ = ["BITNET"]
