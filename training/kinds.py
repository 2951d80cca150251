"""The model kinds the training scripts build (`--model_kind`): each one's config class, the Auto class of its
pretraining head, and the small default architecture of the README's few-minute run."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from transformers import (
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    AutoModelForSeq2SeqLM,
    AutoModelForSequenceClassification,
)

import archlab


@dataclass(frozen=True)
class ModelKind:
    config_class: str  # attribute of `archlab`
    auto_class: Any  # the Auto class that builds the pretraining head
    model_class: str  # attribute of `archlab`
    max_positions_field: str = "max_position_embeddings"


MODEL_KINDS: dict[str, ModelKind] = {
    "decoder": ModelKind("DecoderConfig", AutoModelForCausalLM, "DecoderForCausalLM"),
    "seq2seq": ModelKind("Seq2SeqConfig", AutoModelForSeq2SeqLM, "Seq2SeqForConditionalGeneration"),
    "masked_lm": ModelKind("Seq2SeqConfig", AutoModelForMaskedLM, "EncoderForMaskedLM"),
}
CLASSIFICATION_AUTO_CLASS = AutoModelForSequenceClassification

# The model the README's one command trains when no preset or config is given: ~2.4M parameters (with a 4096-token
# vocabulary) of LLaMA recipe -- pre-RMSNorm, RoPE, GQA, SwiGLU -- that learns visible Python in a few CPU minutes
# (about 30 GFLOP per step of 8 x 256 tokens).
DEFAULT_ARCHITECTURES: dict[str, dict[str, Any]] = {
    "decoder": dict(
        hidden_size=192,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    ),
    "seq2seq": dict(
        d_model=256,
        encoder_layers=3,
        decoder_layers=3,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=1024,
        decoder_ffn_dim=1024,
        max_position_embeddings=512,
    ),
    "masked_lm": dict(
        d_model=256,
        encoder_layers=4,
        decoder_layers=1,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=1024,
        decoder_ffn_dim=1024,
        max_position_embeddings=512,
    ),
}


def model_kind(name: str) -> ModelKind:
    if name not in MODEL_KINDS:
        raise ValueError(f"`--model_kind`={name!r} is not supported; allowed values: {', '.join(MODEL_KINDS)}.")
    kind = MODEL_KINDS[name]
    if not hasattr(archlab, kind.model_class):
        raise ValueError(f"`--model_kind {name}` needs `archlab.{kind.model_class}`, which this install lacks.")
    return kind
