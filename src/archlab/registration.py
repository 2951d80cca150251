"""Registers archlab's configs and models with transformers' Auto classes (idempotent).

Two registrations per class: with the Auto mappings (so `import archlab` makes `AutoModel*.from_pretrained` work
without `trust_remote_code`), and `register_for_auto_class` (so `save_pretrained` copies the modeling code and
writes `auto_map`, and the folder also loads with `trust_remote_code=True` where archlab is not installed).
"""

from __future__ import annotations

from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    AutoModelForQuestionAnswering,
    AutoModelForSeq2SeqLM,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)

from .modeling import (
    DecoderConfig,
    DecoderForCausalLM,
    DecoderForQuestionAnswering,
    DecoderForSequenceClassification,
    DecoderForTokenClassification,
    DecoderModel,
    EncoderForMaskedLM,
    EncoderForQuestionAnswering,
    EncoderForSequenceClassification,
    EncoderForTokenClassification,
    EncoderModel,
    Seq2SeqConfig,
    Seq2SeqForConditionalGeneration,
    Seq2SeqModel,
)

# (Auto class, config class, model class)
MODEL_REGISTRY = [
    (AutoModel, DecoderConfig, DecoderModel),
    (AutoModelForCausalLM, DecoderConfig, DecoderForCausalLM),
    (AutoModelForSequenceClassification, DecoderConfig, DecoderForSequenceClassification),
    (AutoModelForTokenClassification, DecoderConfig, DecoderForTokenClassification),
    (AutoModelForQuestionAnswering, DecoderConfig, DecoderForQuestionAnswering),
    (AutoModel, Seq2SeqConfig, Seq2SeqModel),
    (AutoModelForSeq2SeqLM, Seq2SeqConfig, Seq2SeqForConditionalGeneration),
    (AutoModelForMaskedLM, Seq2SeqConfig, EncoderForMaskedLM),
    # the masked LM's fine-tuning heads (BERT's); `AutoModelForSequenceClassification` of an encoder-decoder's folder
    # gives its encoder with this head too
    (AutoModelForSequenceClassification, Seq2SeqConfig, EncoderForSequenceClassification),
    (AutoModelForTokenClassification, Seq2SeqConfig, EncoderForTokenClassification),
    (AutoModelForQuestionAnswering, Seq2SeqConfig, EncoderForQuestionAnswering),
]
# Named in a saved folder's `auto_map` only: `AutoModel` of the seq2seq config is `Seq2SeqModel`, which hands a
# masked LM's folder to `EncoderModel` itself (`Seq2SeqModel.from_pretrained`); where archlab is not installed,
# a masked LM's folder names `EncoderModel` as its `AutoModel`.
AUTO_MAP_ONLY = [(AutoModel, EncoderModel)]

_done = False


def register_all() -> None:
    global _done
    if _done:
        return
    for config_class in {entry[1] for entry in MODEL_REGISTRY}:
        AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
        config_class.register_for_auto_class("AutoConfig")
    for auto_class, config_class, model_class in MODEL_REGISTRY:
        auto_class.register(config_class, model_class, exist_ok=True)
        model_class.register_for_auto_class(auto_class.__name__)
    for auto_class, model_class in AUTO_MAP_ONLY:
        model_class.register_for_auto_class(auto_class.__name__)
    _done = True
