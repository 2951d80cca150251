"""archlab: a Hugging Face transformers plugin with the modern decoder LM and the classic encoder-decoder.

`import archlab` registers every config and model class with the Auto classes, so
`AutoModelForCausalLM.from_pretrained(folder)` loads an archlab checkpoint without `trust_remote_code`, and makes
`TrainingArguments(use_liger_kernel=True)` apply Liger's kernels to archlab models (archlab.liger) and PEFT's adapters
find their default target modules (archlab.modeling.peft_defaults); Liger and PEFT are imported only when something
asks.
"""

from .liger import apply_liger_kernel_to_archlab, register_with_liger_when_loaded
from .modeling import (
    DecoderConfig,
    DecoderForCausalLM,
    DecoderForQuestionAnswering,
    DecoderForSequenceClassification,
    DecoderForTokenClassification,
    DecoderModel,
    DecoderPreTrainedModel,
    EncoderForMaskedLM,
    EncoderForQuestionAnswering,
    EncoderForSequenceClassification,
    EncoderForTokenClassification,
    EncoderModel,
    Seq2SeqConfig,
    Seq2SeqForConditionalGeneration,
    Seq2SeqModel,
    Seq2SeqPreTrainedModel,
)
from .modeling.moe import count_parameters
from .quiet import quiet_deepspeed_probe
from .registration import register_all
from .text2text import translate

register_all()
register_with_liger_when_loaded()
quiet_deepspeed_probe()

__version__ = "0.1.0"

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
    "translate",
    "count_parameters",
    "apply_liger_kernel_to_archlab",
]
