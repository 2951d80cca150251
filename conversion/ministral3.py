"""Ministral 3 (`ministral3`, `Ministral3ForCausalLM`; Mistral AI, December 2025: Ministral 3 3B/8B/14B, the text
stack of their `mistral3` multimodal folders) as a `Family` row.

Mistral's block (no biases, a window on every layer where `sliding_window` is set) with YaRN RoPE, whose queries are
scaled after RoPE by 1 + β · log(1 + floor(p / original_max_position_embeddings)) at each row's position p — what
transformers calls `llama_4_scaling_beta` (β), a key of `rope_parameters`. In archlab that is `query_scaling_beta`
and `query_scaling_length` (the YaRN's `original_max_position_embeddings`, which transformers' Ministral 3 divides
by); the key leaves `rope_parameters`, as does the `max_position_embeddings` copy Ministral 3 keeps there (nothing
reads it). Exporting writes both back; a model without query scaling exports β = 0 (a scale of exactly 1).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from transformers import Ministral3Config, Ministral3ForCausalLM, PreTrainedConfig

from ..modeling import DecoderForCausalLM
from .checks import one_window_for_every_layer, refuse_export, refuse_import, setting
from .family import Family, same
from .field_lists import LLAMA_FIELDS

MINISTRAL3_FIELDS = (*(name for name in LLAMA_FIELDS if name not in ("attention_bias", "mlp_bias")), "sliding_window")
# the keys of Ministral 3's `rope_parameters` that are not RoPE's
SCALING_KEY = "llama_4_scaling_beta"
UNREAD_KEYS = ("max_position_embeddings",)


def _to_archlab(stock: PreTrainedConfig, values: Mapping[str, Any]) -> dict[str, Any]:
    rope = dict(stock.rope_parameters)
    beta = rope.pop(SCALING_KEY, None)
    for key in UNREAD_KEYS:
        rope.pop(key, None)
    length = rope.get("original_max_position_embeddings")
    wrong = {}
    if beta is None:
        wrong[f"rope_parameters.{SCALING_KEY}=None"] = "transformers' Ministral 3 multiplies the query scale by it"
    if length is None:
        wrong["rope_parameters.original_max_position_embeddings=None"] = (
            "transformers' Ministral 3 divides each position by it for the query scale"
        )
    refuse_import("ministral3", wrong)
    return {"rope_parameters": rope, "query_scaling_beta": float(beta), "query_scaling_length": int(length)}


def _from_archlab(config: PreTrainedConfig) -> dict[str, Any]:
    rope = dict(config.rope_parameters)
    length = rope.get("original_max_position_embeddings")
    if config.query_scaling_beta:
        if length is not None and length != config.query_scaling_length:
            refuse_export(
                "Ministral3ForCausalLM",
                {
                    setting(config, "query_scaling_length"): (
                        f"Ministral 3 steps its query scale at its RoPE's original_max_position_embeddings ({length})"
                    )
                },
            )
        length = config.query_scaling_length
    rope[SCALING_KEY] = float(config.query_scaling_beta)
    rope["original_max_position_embeddings"] = length if length is not None else config.max_position_embeddings
    return {"rope_parameters": rope, **one_window_for_every_layer(config, "Ministral3ForCausalLM")}


MINISTRAL3 = Family(
    Ministral3Config,
    Ministral3ForCausalLM,
    DecoderForCausalLM,
    fields=same(*MINISTRAL3_FIELDS),
    to_archlab=_to_archlab,
    from_archlab=_from_archlab,
    expressible=frozenset({"layer_types", "query_scaling_beta", "query_scaling_length"}),
)

__all__ = ["MINISTRAL3"]
