"""Config field lists several family modules share (so that none imports another family's module for them)."""

from __future__ import annotations

# LlamaConfig fields archlab's DecoderConfig shares with identical meaning.
LLAMA_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "max_position_embeddings",
    "initializer_range",
    "rms_norm_eps",
    "use_cache",
    "pad_token_id",
    "bos_token_id",
    "eos_token_id",
    "tie_word_embeddings",
    "rope_parameters",
    "attention_bias",
    "attention_dropout",
    "mlp_bias",
)

__all__ = ["LLAMA_FIELDS"]
