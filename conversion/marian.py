"""Marian (the opus-mt family): archlab's classic encoder-decoder with Marian's split sinusoid layout.

Marian's state dict names the shared embedding three times and holds the sinusoid tables and a `final_logits_bias`;
checkpoints saved by transformers drop the tied copies and the tables. Both directions fill in what the target names.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import MarianConfig, MarianMTModel, PreTrainedConfig

from ..modeling import Seq2SeqForConditionalGeneration
from ..modeling.sinusoidal import split_table
from .family import ConversionError, Family, Layout, StateDict, same

# MarianConfig fields archlab's Seq2SeqConfig shares with identical meaning.
MARIAN_FIELDS = (
    "vocab_size",
    "decoder_vocab_size",
    "max_position_embeddings",
    "encoder_layers",
    "encoder_ffn_dim",
    "encoder_attention_heads",
    "decoder_layers",
    "decoder_ffn_dim",
    "decoder_attention_heads",
    "encoder_layerdrop",
    "decoder_layerdrop",
    "use_cache",
    "activation_function",
    "d_model",
    "dropout",
    "attention_dropout",
    "activation_dropout",
    "init_std",
    "decoder_start_token_id",
    "scale_embedding",
    "pad_token_id",
    "eos_token_id",
    "bos_token_id",
    "forced_eos_token_id",
    "share_encoder_decoder_embeddings",
    "tie_word_embeddings",
)


def _from_archlab(config: PreTrainedConfig) -> dict[str, Any]:
    if config.sinusoidal_layout != "split":
        raise ConversionError(
            f"Marian's sinusoid table uses the split layout; this config has sinusoidal_layout="
            f"{config.sinusoidal_layout!r}. Set it to 'split' (and retrain or fine-tune) to export."
        )
    return {}


def complete_shared_embeddings(state_dict: StateDict, config: PreTrainedConfig) -> StateDict:
    """The tied copies of the shared embedding and a zero `final_logits_bias`, where the state dict lacks them (Marian,
    Bart and archlab name the same tensors)."""
    state_dict = dict(state_dict)
    if config.share_encoder_decoder_embeddings:
        shared = state_dict.get("model.shared.weight", state_dict.get("model.encoder.embed_tokens.weight"))
        for key in ("model.shared.weight", "model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight"):
            # one tensor per name: a stock model whose config unties them (tie_word_embeddings=False) would save one
            # storage under one name only, and load the others as MISSING (random)
            state_dict.setdefault(key, shared if key == "model.shared.weight" else shared.clone())
    dtype = next(iter(state_dict.values())).dtype
    state_dict.setdefault("final_logits_bias", torch.zeros(1, config.decoder_vocab_size, dtype=dtype))
    return state_dict


def complete_state_dict(state_dict: StateDict, config: PreTrainedConfig) -> StateDict:
    state_dict = complete_shared_embeddings(state_dict, config)
    dtype = state_dict["final_logits_bias"].dtype
    table = split_table(config.max_position_embeddings, config.d_model).to(dtype)
    for side in ("encoder", "decoder"):
        state_dict.setdefault(f"model.{side}.embed_positions.weight", table.clone())  # one tensor per name
    return state_dict


MARIAN = Family(
    MarianConfig,
    MarianMTModel,
    Seq2SeqForConditionalGeneration,
    fields=same(*MARIAN_FIELDS),
    implied={"sinusoidal_layout": "split"},
    from_archlab=_from_archlab,
    expressible=frozenset({"sinusoidal_layout"}),
    layout=Layout(complete_state_dict, complete_state_dict),
)

__all__ = ["MARIAN", "MARIAN_FIELDS", "complete_shared_embeddings"]
