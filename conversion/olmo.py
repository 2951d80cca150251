"""OLMo (Groeneveld et al. 2024, AI2's first OLMo): Llama's names and block with a LayerNorm that has no gain and no
bias (`OlmoLayerNorm`, eps 1e-5) before each sub-layer and at the end, as a `Family` row.

archlab's `norm_type="layer_norm"` without a bias computes it with a gain of ones: the import writes ones for the
three norms' gains OLMo's folders do not hold, the export drops them and refuses a model whose gains moved from 1
(trained after the import: a stock OLMo cannot compute them), naming the tensors. OLMo's optional `clip_qkv` (q, k and
v clamped to ±c, as OLMo-7B-0424 sets it) has no archlab field: such a folder is refused. Its attention and RoPE read
`head_dim` from config.json where it is there (as Qwen2's), else hidden / heads.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from transformers import OlmoConfig, OlmoForCausalLM, PreTrainedConfig

from ..modeling import DecoderForCausalLM
from .checks import head_dim_given, head_dim_to_write, refuse_import, setting
from .family import ConversionError, Family, Layout, StateDict, same
from .field_lists import LLAMA_FIELDS

OLMO_EPS = 1e-5  # OlmoLayerNorm's, fixed
OLMO_FIELDS = same(*(name for name in LLAMA_FIELDS if name not in ("head_dim", "rms_norm_eps", "mlp_bias")))
GAINS = ("input_layernorm.weight", "post_attention_layernorm.weight")


def _gain_names(config: PreTrainedConfig) -> list[str]:
    """archlab's norm gains, which OLMo's LayerNorms do not have."""
    layers = [f"model.layers.{i}.{gain}" for i in range(config.num_hidden_layers) for gain in GAINS]
    return [*layers, "model.norm.weight"]


def _olmo_to_archlab(stock: PreTrainedConfig, values: Mapping[str, Any]) -> dict[str, Any]:
    if stock.clip_qkv is not None:
        refuse_import("olmo", {setting(stock, "clip_qkv"): "archlab does not clamp q, k and v (None)"})
    return head_dim_given(stock, values)


def _olmo_from_archlab(config: PreTrainedConfig) -> dict[str, Any]:
    return {"clip_qkv": None, **head_dim_to_write(config)}


def _olmo_weights_to_archlab(state_dict: StateDict, config: PreTrainedConfig) -> StateDict:
    """The folder's tensors with a gain of ones for each norm."""
    like = state_dict["model.embed_tokens.weight"]
    ones = {name: torch.ones(config.hidden_size, dtype=like.dtype) for name in _gain_names(config)}
    return {**state_dict, **ones}


def _olmo_weights_from_archlab(state_dict: StateDict, config: PreTrainedConfig) -> StateDict:
    """archlab's tensors without the norms' gains, refused where a gain is not 1."""
    names = _gain_names(config)
    moved = [name for name in names if not torch.all(state_dict[name] == 1)]
    if moved:
        shown = ", ".join(moved[:4]) + (f" and {len(moved) - 4} more" if len(moved) > 4 else "")
        raise ConversionError(
            f"OLMo's LayerNorms have no gain, and this model's norm gains are not all 1 ({shown}): a stock "
            "OlmoForCausalLM cannot compute it."
        )
    return {name: tensor for name, tensor in state_dict.items() if name not in names}


OLMO = Family(
    OlmoConfig,
    OlmoForCausalLM,
    DecoderForCausalLM,
    fields=OLMO_FIELDS,
    implied={"norm_type": "layer_norm", "norm_bias": False, "rms_norm_eps": OLMO_EPS, "mlp_bias": False},
    to_archlab=_olmo_to_archlab,
    from_archlab=_olmo_from_archlab,
    expressible=frozenset({"head_dim"}),
    layout=Layout(to_archlab=_olmo_weights_to_archlab, from_archlab=_olmo_weights_from_archlab),
)

__all__ = ["OLMO"]
