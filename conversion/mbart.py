"""mBART (Liu et al. 2020, "Multilingual Denoising Pre-training for Neural Machine Translation"): Bart made pre-norm.

Its parameter names are Bart's, so archlab's (Marian's); the stacks differ from Bart's in where their norms sit: before
each sub-layer, with a final norm per stack (`model.encoder.layer_norm`, `model.decoder.layer_norm`: archlab's
`norm_position="pre"` names them so), after the embeddings' own norm and learned positions (offset by 2) as Bart's.
Teacher forcing differs too: mBART's decoder input is the labels shifted right behind each row's last label token (the
target-language code its tokenizer appends), archlab's `label_shift="wrap_last_token"`. mBART-50 checkpoints are this
family (`model_type="mbart"`); their target language is chosen at generation by `forced_bos_token_id`.
"""

from __future__ import annotations

from transformers import MBartConfig, MBartForConditionalGeneration

from ..modeling import Seq2SeqForConditionalGeneration
from .bart import BART_FIELDS
from .family import Family, Layout, same
from .marian import complete_shared_embeddings

MBART = Family(
    MBartConfig,
    MBartForConditionalGeneration,
    Seq2SeqForConditionalGeneration,
    fields=same(*BART_FIELDS),
    implied={
        "position_embedding_type": "learned",
        "position_embedding_offset": 2,
        "embedding_layernorm": True,
        "norm_position": "pre",
        "label_shift": "wrap_last_token",
    },
    layout=Layout(complete_shared_embeddings, complete_shared_embeddings),
)

__all__ = ["MBART"]
