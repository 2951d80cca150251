"""archlab's model code: one flat folder of sibling modules that import only torch and transformers.

This is the folder Hugging Face's remote-code export copies next to a saved model (`custom_object_save` follows
single-dot sibling imports only), so nothing here may import `archlab` or use `..`/nested imports.
"""

from .configuration_decoder import DecoderConfig
from .configuration_seq2seq import Seq2SeqConfig
from .modeling_decoder import (
    DecoderForCausalLM,
    DecoderForQuestionAnswering,
    DecoderForSequenceClassification,
    DecoderForTokenClassification,
    DecoderModel,
    DecoderPreTrainedModel,
)
from .modeling_masked_lm import (
    EncoderForMaskedLM,
    EncoderForQuestionAnswering,
    EncoderForSequenceClassification,
    EncoderForTokenClassification,
    EncoderModel,
)
from .modeling_seq2seq import Seq2SeqForConditionalGeneration, Seq2SeqModel, Seq2SeqPreTrainedModel

__all__ = [
    "DecoderConfig",
    "DecoderPreTrainedModel",
    "DecoderModel",
    "DecoderForCausalLM",
    "DecoderForSequenceClassification",
    "DecoderForTokenClassification",
    "DecoderForQuestionAnswering",
    "Seq2SeqConfig",
    "Seq2SeqPreTrainedModel",
    "Seq2SeqModel",
    "Seq2SeqForConditionalGeneration",
    "EncoderModel",
    "EncoderForMaskedLM",
    "EncoderForSequenceClassification",
    "EncoderForTokenClassification",
    "EncoderForQuestionAnswering",
]
