"""Bart: archlab's classic encoder-decoder with a learned position table (offset by 2) and a norm after the embeddings.

Bart's parameter names are archlab's (Marian's) names, `layernorm_embedding` included, so its weights need no rule:
only the tied copies of the shared embedding that saved checkpoints drop are filled in (as for Marian). mBART, Bart
made pre-norm, is its own family (`mbart.py`).
"""

from __future__ import annotations

from transformers import BartConfig, BartForConditionalGeneration

from ..modeling import Seq2SeqForConditionalGeneration
from .family import Family, Layout, same
from .marian import MARIAN_FIELDS, complete_shared_embeddings

# Marian's fields without the two Bart does not have (one vocabulary, always shared)
BART_FIELDS = tuple(
    name for name in MARIAN_FIELDS if name not in ("decoder_vocab_size", "share_encoder_decoder_embeddings")
)

BART = Family(
    BartConfig,
    BartForConditionalGeneration,
    Seq2SeqForConditionalGeneration,
    fields=same(*BART_FIELDS),
    implied={"position_embedding_type": "learned", "position_embedding_offset": 2, "embedding_layernorm": True},
    layout=Layout(complete_shared_embeddings, complete_shared_embeddings),
)

__all__ = ["BART", "BART_FIELDS"]
