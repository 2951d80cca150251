"""The families the converter knows: one `Family` row each, by `model_type`.

The Llama-like decoders differ from Llama only in which config fields they have and what they fix; their weights
have archlab's names already (archlab uses Llama's), except Mixtral's per-expert modules (`mixtral.py`). The
encoder-decoders with their own layouts live in `marian.py` and `t5.py`.
"""

from __future__ import annotations

from typing import Any

from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    PreTrainedConfig,
)

from ..modeling import DecoderForCausalLM
from .family import ConversionError, Family, same
from .marian import MARIAN
from .mixtral import MIXTRAL_LAYOUT
from .t5 import T5_VARIANTS, t5_family

# LlamaConfig fields archlab's DecoderConfig shares with identical meaning.
LLAMA_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "initializer_range", "rms_norm_eps",
    "use_cache", "pad_token_id", "bos_token_id", "eos_token_id", "tie_word_embeddings", "rope_parameters",
    "attention_bias", "attention_dropout", "mlp_bias",
)
# MistralConfig: Llama's fields without the bias flags, plus `sliding_window`, which makes every layer local.
MISTRAL_FIELDS = tuple(name for name in LLAMA_FIELDS if name not in ("attention_bias", "mlp_bias")) + ("sliding_window",)
# MixtralConfig: Mistral's fields plus the mixture of experts. Every layer is sparse, each expert is
# `intermediate_size` wide, the top-k weights are always renormalised (archlab: `norm_topk_prob=True`).
MIXTRAL_FIELDS = MISTRAL_FIELDS + (
    "num_local_experts", "num_experts_per_tok", "output_router_logits", "router_aux_loss_coef", "router_jitter_noise",
)


def one_window_for_every_layer(config: PreTrainedConfig, architecture: str) -> None:
    expected = "full_attention" if config.sliding_window is None else "sliding_attention"
    if any(kind != expected for kind in config.layer_types):
        raise ConversionError(
            f"{architecture} applies `sliding_window` to every layer; this config's `layer_types` "
            f"({config.layer_types}) mixes local and global layers, which {architecture.removesuffix('ForCausalLM')} "
            f"cannot express."
        )


def experts_in_every_layer(config: PreTrainedConfig, architecture: str) -> None:
    if config.num_local_experts < 1 or "dense" in config.mlp_layer_types:
        raise ConversionError(
            f"{architecture} has a mixture of experts in every layer; this config has num_local_experts="
            f"{config.num_local_experts} and mlp_layer_types={config.mlp_layer_types}."
        )


def _mistral_from_archlab(config: PreTrainedConfig) -> dict[str, Any]:
    one_window_for_every_layer(config, "MistralForCausalLM")
    return {}


def _mixtral_from_archlab(config: PreTrainedConfig) -> dict[str, Any]:
    experts_in_every_layer(config, "MixtralForCausalLM")
    one_window_for_every_layer(config, "MixtralForCausalLM")
    return {}


FAMILIES: dict[str, Family] = {
    family.name: family
    for family in (
        Family(LlamaConfig, LlamaForCausalLM, DecoderForCausalLM, fields=same(*LLAMA_FIELDS)),
        Family(MistralConfig, MistralForCausalLM, DecoderForCausalLM, fields=same(*MISTRAL_FIELDS),
               from_archlab=_mistral_from_archlab, expressible=frozenset({"layer_types"})),
        Family(MixtralConfig, MixtralForCausalLM, DecoderForCausalLM, fields=same(*MIXTRAL_FIELDS),
               implied={"norm_topk_prob": True}, from_archlab=_mixtral_from_archlab,
               # the router z-loss only changes training; it is dropped on export
               expressible=frozenset({"layer_types", "router_z_loss_coef"}), layout=MIXTRAL_LAYOUT),
        MARIAN,
        *(t5_family(variant) for variant in T5_VARIANTS.values()),
    )
}

__all__ = ["FAMILIES", "LLAMA_FIELDS", "MISTRAL_FIELDS", "MIXTRAL_FIELDS"]
