"""BitNet b1.58's architecture (`bitnet`, `BitNetForCausalLM`) as a `Family` row, its weights in floating point.

BitNet is Llama's pre-RMSNorm block with Sub-LN (Wang et al. 2022, "Foundation Transformers"): an RMSNorm over the
heads' output before `o_proj` (`self_attn.attn_sub_norm`) and over the gated MLP's hidden activation before
`down_proj` (`mlp.ffn_sub_norm`), archlab's `sub_layer_norm=True` under the same names; its MLP's activation is ReLU²
(`hidden_act="relu2"`), and it has no MLP bias and no `head_dim` field (the sub-norm is `hidden_size` wide: heads ×
head size = hidden size).

What makes BitNet b1.58 ternary is not in the architecture but in transformers' quantizer: Microsoft's published
folders carry `quantization_config` with `quant_method="bitnet"`, whether their weights are packed ternary values
(`bitnet-b1.58-2B-4T`) or the bf16 master weights that `AutoBitLinear` makes ternary in every forward
(`-bf16`: weights scaled by their mean absolute value and rounded to {-1, 0, 1}, activations to 8 bits a token).
archlab has no BitLinear: converting those weights as plain linear layers would give another model without a word,
so such a folder is refused by its method. A BitNet-shaped model trained in floating point converts both ways.
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


def _to_archlab(stock: PreTrainedConfig, values: Mapping[str, Any]) -> dict[str, Any]:
    quantization = values.get("quantization_config")
    method = quantization.get("quant_method") if isinstance(quantization, Mapping) else None
    if method == "bitnet":
        refuse_import(
            "bitnet",
            {
                f"quantization_config.quant_method={method!r}": "transformers makes these weights ternary when it "
                "loads them (BitLinear: weights scaled by their mean absolute value and rounded to -1/0/1, "
                "activations to 8 bits), which archlab does not compute; as plain linear layers they would be "
                "another model. A BitNet-shaped model trained in floating point (no quantization_config) converts"
            },
        )
    return {}


def _from_archlab(config: PreTrainedConfig) -> dict[str, Any]:
    wrong = {}
    if config.head_dim * config.num_attention_heads != config.hidden_size:
        wrong[setting(config, "head_dim")] = (
            f"BitNet's heads span the model width: head_dim × num_attention_heads = hidden_size ({config.hidden_size})"
        )
    refuse_export("BitNetForCausalLM", wrong)
    return {}


BITNET = Family(
    BitNetConfig,
    BitNetForCausalLM,
    DecoderForCausalLM,
    fields=same(*BITNET_FIELDS),
    implied={"sub_layer_norm": True},
    to_archlab=_to_archlab,
    from_archlab=_from_archlab,
)

__all__ = ["BITNET"]
