"""Task heads on a decoder family's body: a stock `<Family>ForSequenceClassification` folder (a reward model, a
classifier) is archlab's `DecoderForSequenceClassification`, and back; so are `<Family>ForTokenClassification` and
`<Family>ForQuestionAnswering` folders archlab's `DecoderForTokenClassification` and `DecoderForQuestionAnswering`, for
the families whose classes are transformers' generic ones (`GenericForTokenClassification`, ...: Llama, Mistral,
Mixtral, Qwen2, Qwen2-MoE, Qwen3, Qwen3-MoE, and for token classification Gemma, Gemma2, Phi, Phi-3, StableLM), whose
heads are archlab's: `score` (hidden -> num_labels, with a bias) and `qa_outputs` (hidden -> 2, with a bias).

Every decoder family's stock classifier is its base model, under the causal LM's prefix (`model.`, `transformer.`,
`gpt_neox.`), and a bias-free `score` Linear (hidden -> num_labels) read at the last token that is not
`pad_token_id`; archlab's has the same `score`. So a head is a small addition to a family's row (`Head.on`): the
stock class (transformers' own auto mapping names it per `model_type`), the head's modules, whose tensors keep their
names both ways while the body converts as the family's causal LM does, and the config fields the head reads
(`id2label`/`label2id`, hence `num_labels`, and `problem_type`), carried as given; `pad_token_id` is mapped by every
decoder family already.

Llama's, Qwen2's and Qwen3's question-answering classes keep their body under `transformer.` where their causal LM
has `model.` (archlab's heads all have `model.`): the body's prefix is renamed both ways.

BERT's fine-tuning heads sit on the masked LM's body the same way: `BertForSequenceClassification` is archlab's
`EncoderForSequenceClassification` (its `bert.pooler` is archlab's `pooler`, its `classifier` the same), and
`BertForTokenClassification` is `EncoderForTokenClassification` (`classifier`), and `BertForQuestionAnswering` is
`EncoderForQuestionAnswering` (`qa_outputs`); the body converts as `BertForMaskedLM`'s encoder does. RoBERTa's are
the same on `RobertaForMaskedLM`'s body, except its sequence classifier, whose head (`classifier.dense` + tanh,
`classifier.out_proj`) is archlab's pooler and classifier (`ROBERTA_SEQUENCE_CLASSIFICATION`), its dropout before
the dense too (`classifier_dropout_before_pooler`, which every RoBERTa folder gets).

Which head a folder holds is read from its `architectures`: a stock folder's class name ends in the head's suffix
(`ForSequenceClassification`, ...), an archlab folder names the archlab class. Other task heads (`ForMultipleChoice`,
a family's own token classifier or QA class, ...) are refused, naming what converts.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import transformers
from transformers import PreTrainedConfig, PreTrainedModel
from transformers.modeling_layers import GenericForQuestionAnswering, GenericForTokenClassification
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES,
    MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
    MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES,
)

from ..modeling import (
    DecoderForCausalLM,
    DecoderForQuestionAnswering,
    DecoderForSequenceClassification,
    DecoderForTokenClassification,
    EncoderForMaskedLM,
    EncoderForQuestionAnswering,
    EncoderForSequenceClassification,
    EncoderForTokenClassification,
)
from .checks import refuse_export, setting
from .family import ConversionError, Family, Layout, StateDict

# archlab fields only DecoderForCausalLM's head reads (Phi's implied `lm_head_bias=True` is no classifier's concern)
LM_HEAD_ONLY_FIELDS = frozenset({"lm_head_bias"})
# stock task heads the converter does not convert: refused by name before any weight is read
UNCONVERTED_SUFFIXES = (
    "ForMultipleChoice",
    "ForNextSentencePrediction",
)


@dataclass(frozen=True)
class Head:
    """A task head on a family's body: archlab's class, the stock class names by `model_type`, the head's modules
    (the same names on both sides unless `renamed`: stock prefix -> archlab prefix), the config fields it reads, and
    the archlab class of the bodies it sits on (a decoder family's causal LM, or the masked LM)."""

    archlab_class: type[PreTrainedModel]
    stock_names: Mapping[str, str]
    modules: tuple[str, ...]
    config_fields: tuple[str, ...]
    # config fields carried where the config has them (the token classifier's dropout and bias switch)
    optional_fields: tuple[str, ...] = ()
    # the stock classes converted must subclass this one (their head is then archlab's); None: every class named
    generic: type | None = None
    # with pad_token_id read by the head (the sequence classifier): warn where it is also an end-of-sequence token
    pools_at_last_token: bool = False
    body: type[PreTrainedModel] = DecoderForCausalLM
    renamed: Mapping[str, str] = dataclasses.field(default_factory=dict)
    # (archlab config) -> {setting: why} the stock class cannot compute, refused on export
    refuse: Callable[[PreTrainedConfig], dict[str, str]] = lambda config: {}
    # the families (`model_type`) whose stock class has this head; None: every family of `stock_names` on `body`
    families: frozenset[str] | None = None

    @property
    def suffix(self) -> str:
        return self.archlab_class.__name__.removeprefix("Decoder").removeprefix("Encoder")

    def stock_class(self, family: Family) -> type[PreTrainedModel] | None:
        """The family's stock class with this head, or None where the converter has none (another body)."""
        if family.archlab_class is not self.body or family.name not in self.stock_names:
            return None
        if self.families is not None and family.name not in self.families:
            return None
        stock_class = getattr(transformers, self.stock_names[family.name], None)
        if stock_class is None or (self.generic is not None and not issubclass(stock_class, self.generic)):
            return None
        return stock_class

    def _split(self, state_dict: StateDict, to_archlab: bool) -> tuple[StateDict, StateDict]:
        """(body, head): the head's tensors under the other side's names."""
        names = self.renamed if to_archlab else {ours: theirs for theirs, ours in self.renamed.items()}
        head = {}
        for key, tensor in state_dict.items():
            prefix = next((p for p in names if key.startswith(p + ".")), None)
            if prefix is not None:
                head[names[prefix] + key.removeprefix(prefix)] = tensor
            elif key.split(".")[0] in self.modules:
                head[key] = tensor
        body = {
            k: v
            for k, v in state_dict.items()
            if k.split(".")[0] not in self.modules and not any(k.startswith(p + ".") for p in names)
        }
        return body, head

    def on(self, family: Family) -> Family:
        """The family's row with this head in place of the LM head."""
        stock_class = self.stock_class(family)
        if stock_class is None:
            raise ValueError(f"{family.name} has no {self.suffix} form")
        layout = family.layout
        # the body's prefix in the stock head's checkpoints and in the family's causal LM's, which the layout reads
        stock_prefix, lm_prefix = stock_class.base_model_prefix, family.model_class.base_model_prefix

        def to_archlab_weights(state_dict: StateDict, config: PreTrainedConfig) -> StateDict:
            body, head = self._split(state_dict, to_archlab=True)
            return {**layout.to_archlab(_renamed(body, stock_prefix, lm_prefix), config), **head}

        def from_archlab_weights(state_dict: StateDict, config: PreTrainedConfig) -> StateDict:
            body, head = self._split(state_dict, to_archlab=False)
            return {**_renamed(layout.from_archlab(body, config), lm_prefix, stock_prefix), **head}

        def head_fields(config: PreTrainedConfig) -> dict[str, Any]:
            if self.pools_at_last_token:
                _warn_if_pad_is_eos(config, stock_class.__name__)
            fields = {name: getattr(config, name) for name in self.config_fields}
            return fields | {name: getattr(config, name) for name in self.optional_fields if hasattr(config, name)}

        def stock_head_fields(stock: PreTrainedConfig) -> dict[str, Any]:
            fields = head_fields(stock)
            if self.archlab_class is DecoderForTokenClassification and "classifier_dropout" not in fields:
                # the stock head's dropout falls back on `hidden_dropout` (StableLM's 0.0), which archlab lacks
                if getattr(stock, "hidden_dropout", None) is not None:
                    fields["classifier_dropout"] = stock.hidden_dropout
            return fields

        def export_fields(config: PreTrainedConfig) -> dict[str, Any]:
            wrong = self.refuse(config)
            if wrong:
                refuse_export(stock_class.__name__, wrong)
            return {**family.from_archlab(config), **head_fields(config)}

        return dataclasses.replace(
            family,
            model_class=stock_class,
            archlab_class=self.archlab_class,
            to_archlab=lambda stock, values: {**family.to_archlab(stock, values), **stock_head_fields(stock)},
            from_archlab=export_fields,
            layout=Layout(to_archlab=to_archlab_weights, from_archlab=from_archlab_weights),
            # the LM head's settings are not the classifier's: any value exports
            expressible=family.expressible | (LM_HEAD_ONLY_FIELDS if self.body is DecoderForCausalLM else frozenset()),
        )


def _renamed(state_dict: StateDict, prefix: str, new_prefix: str) -> StateDict:
    """`state_dict` with the leading `prefix.` of its names replaced by `new_prefix.`."""
    if prefix == new_prefix:
        return state_dict
    old = f"{prefix}."
    return {f"{new_prefix}.{k.removeprefix(old)}" if k.startswith(old) else k: v for k, v in state_dict.items()}


def _warn_if_pad_is_eos(config: PreTrainedConfig, stock_class: str) -> None:
    """The two classifiers pool alike on padded batches, except at a real token that is the pad token: the stock one
    skips it (it reads the ids), archlab's keeps it when the mask does. A text ending with the end-of-sequence token
    that doubles as the pad token (a common reward-model set-up) is scored at different tokens."""
    eos = config.eos_token_id
    if config.pad_token_id is not None and config.pad_token_id in (eos if isinstance(eos, list) else [eos]):
        warnings.warn(
            f"pad_token_id={config.pad_token_id} is also an end-of-sequence token: for a text that ends with it, "
            f"{stock_class} scores the token before it, DecoderForSequenceClassification (given an attention mask "
            "that keeps it) that token itself. Drop the trailing end-of-sequence token, or give the model a pad token "
            "of its own, to get the same scores from both.",
            stacklevel=2,
        )


SEQUENCE_CLASSIFICATION = Head(
    DecoderForSequenceClassification,
    MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
    modules=("score",),
    config_fields=("id2label", "label2id", "problem_type"),
    pools_at_last_token=True,
)
TOKEN_CLASSIFICATION = Head(
    DecoderForTokenClassification,
    MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES,
    modules=("score",),
    config_fields=("id2label", "label2id"),
    optional_fields=("classifier_dropout", "token_classification_bias"),
    generic=GenericForTokenClassification,
)
QUESTION_ANSWERING = Head(
    DecoderForQuestionAnswering,
    MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES,
    modules=("qa_outputs",),
    config_fields=(),
    generic=GenericForQuestionAnswering,
)


def _pooler_needed(stock_class: str, pooler: str) -> Callable[[PreTrainedConfig], dict[str, str]]:
    def refuse(config: PreTrainedConfig) -> dict[str, str]:
        if config.classifier_pooler:
            return {}
        return {setting(config, "classifier_pooler"): f"{stock_class} classifies the first token through {pooler}"}

    return refuse


ENCODER_SEQUENCE_CLASSIFICATION = Head(
    EncoderForSequenceClassification,
    MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
    modules=("classifier",),
    config_fields=("id2label", "label2id", "problem_type"),
    body=EncoderForMaskedLM,
    renamed={"bert.pooler": "pooler"},
    refuse=_pooler_needed("BertForSequenceClassification", "BERT's pooler (dense + tanh)"),
    families=frozenset({"bert"}),
)
# RoBERTa's classification head is dropout -> dense -> tanh -> dropout -> out_proj on the first token: archlab's
# pooler (dense + tanh) -> dropout -> classifier, with the same dropout before the pooler too (the family's
# `classifier_dropout_before_pooler`)
ROBERTA_SEQUENCE_CLASSIFICATION = dataclasses.replace(
    ENCODER_SEQUENCE_CLASSIFICATION,
    renamed={"classifier.dense": "pooler.dense", "classifier.out_proj": "classifier"},
    refuse=_pooler_needed("RobertaForSequenceClassification", "its head's dense + tanh"),
    families=frozenset({"roberta"}),
)
ENCODER_TOKEN_CLASSIFICATION = Head(
    EncoderForTokenClassification,
    MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES,
    modules=("classifier",),
    config_fields=("id2label", "label2id"),
    body=EncoderForMaskedLM,
)
ENCODER_QUESTION_ANSWERING = Head(
    EncoderForQuestionAnswering,
    MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES,
    modules=("qa_outputs",),
    config_fields=(),
    body=EncoderForMaskedLM,
)
HEADS = (
    SEQUENCE_CLASSIFICATION,
    TOKEN_CLASSIFICATION,
    QUESTION_ANSWERING,
    ENCODER_SEQUENCE_CLASSIFICATION,
    ROBERTA_SEQUENCE_CLASSIFICATION,
    ENCODER_TOKEN_CLASSIFICATION,
    ENCODER_QUESTION_ANSWERING,
)


def supported_classes(family: Family) -> list[str]:
    """The stock classes the converter reads and writes for a family: its own, then one per head."""
    return [family.architecture] + [cls.__name__ for head in HEADS if (cls := head.stock_class(family)) is not None]


def stock_row(family: Family, architectures: Sequence[str] | None, src: Path) -> Family:
    """The row converting a stock folder of `family` whose config names `architectures` (absent: the family's own
    class); a head the converter does not convert is refused with what it does."""
    for name in architectures or ():
        refused = name.endswith(UNCONVERTED_SUFFIXES)
        for head in HEADS:
            if name.endswith(head.suffix):
                if head.stock_class(family) is not None:
                    return head.on(family)
                refused = True
        if refused:
            raise ConversionError(
                f"{src} holds {name}, a head the converter does not convert; for {family.name} it converts "
                f"{' and '.join(supported_classes(family))}."
            )
    return family


def archlab_row(family: Family, architectures: Sequence[str] | None, src: Path, to: str) -> Family:
    """The row exporting an archlab folder that names `architectures` (absent: the family's archlab class) to the
    stock `family`."""
    names = list(architectures or [family.archlab_class.__name__])
    for head in HEADS:
        if head.archlab_class.__name__ in names and head.stock_class(family) is not None:
            return head.on(family)
    for head in HEADS:
        if head.archlab_class.__name__ in names:
            raise ConversionError(
                f"{src} holds {head.archlab_class.__name__}; {to} has no {head.suffix} class the converter writes "
                f"(it exports {family.archlab_class.__name__} as {family.architecture})."
            )
    if family.archlab_class.__name__ not in names:
        raise ConversionError(f"{src} holds {', '.join(names)}; {to} exports {family.archlab_class.__name__}.")
    return family


__all__ = [
    "ENCODER_QUESTION_ANSWERING",
    "ENCODER_SEQUENCE_CLASSIFICATION",
    "ENCODER_TOKEN_CLASSIFICATION",
    "HEADS",
    "Head",
    "QUESTION_ANSWERING",
    "ROBERTA_SEQUENCE_CLASSIFICATION",
    "SEQUENCE_CLASSIFICATION",
    "TOKEN_CLASSIFICATION",
    "archlab_row",
    "stock_row",
    "supported_classes",
]
