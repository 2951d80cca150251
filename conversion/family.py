"""What a stock Hugging Face family is to the converter: one `Family` row holding the stock classes themselves.

A row says how the family's config maps to an archlab config and back, and how its weights map (`Layout`):

- `fields`: stock config field -> the archlab field(s) with the same meaning. A tuple maps one stock field to several
  archlab fields (T5's `num_heads` is archlab's encoder and decoder head counts); exporting needs them equal.
- `implied`: archlab values the family always has (set on import, required on export).
- `to_archlab` / `from_archlab`: the rest, computed from the stock config (the object, and the config.json values as
  given, for what the stock class overrides) / from the archlab config. `from_archlab` raises `ConversionError` for
  what the family cannot express; the archlab fields it handles are `expressible`.

Exporting is refused, with the fields named, when the archlab config differs from the one the family can express:
the config rebuilt from the mapped, implied and expressible fields alone (so every other field at its default,
computed at this config's values of the fields it derives from). Training-only fields never block an export.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PreTrainedConfig, PreTrainedModel

StateDict = dict[str, torch.Tensor]

# archlab fields that change training only, never the function a checkpoint computes: any value exports.
TRAINING_ONLY_FIELDS = frozenset(
    {"lm_loss_chunk_size", "classifier_lm_loss_weight", "classifier_dropout", "classifier_dropout_before_pooler"}
)
# archlab fields only one task head reads (`EncoderForSequenceClassification`'s pooler): any value exports a model
# without that head; the head's own row (heads.py) refuses what its stock class cannot compute
HEAD_ONLY_FIELDS = frozenset({"classifier_pooler"})

# PreTrainedConfig bookkeeping that is never architecture.
BOOKKEEPING = frozenset(
    {
        "architectures",
        "auto_map",
        "transformers_version",
        "dtype",
        "torch_dtype",
        "model_type",
        "_name_or_path",
        "id2label",
        "label2id",
        "problem_type",
        "output_hidden_states",
        "return_dict",
        "chunk_size_feed_forward",
        "is_encoder_decoder",
        "tie_word_embeddings",
        "use_cache",
    }
)


class ConversionError(ValueError):
    """The source cannot be converted as asked; the message says why and what would work."""


def same(*names: str) -> dict[str, str]:
    """`fields` entries for config fields with the same name on both sides."""
    return {name: name for name in names}


def _identity(state_dict: StateDict, config: PreTrainedConfig) -> StateDict:
    return state_dict


def _stored_as_read(state_dict: StateDict, values: Mapping[str, Any]) -> StateDict:
    return state_dict


@dataclass(frozen=True)
class Layout:
    """How a family's checkpoint tensors become archlab's and back: each function takes a state dict and the archlab
    config and returns the other side's state dict (names, and tensors split, joined or completed)."""

    to_archlab: Callable[[StateDict, PreTrainedConfig], StateDict] = _identity
    from_archlab: Callable[[StateDict, PreTrainedConfig], StateDict] = _identity


IDENTITY = Layout()


@dataclass(frozen=True)
class Family:
    """One stock family: its classes, its config mapping and its weight layout."""

    config_class: type[PreTrainedConfig]  # e.g. LlamaConfig; its `model_type` names the family
    model_class: type[PreTrainedModel]  # e.g. LlamaForCausalLM, written into `architectures`
    archlab_class: type[PreTrainedModel]  # DecoderForCausalLM, Seq2SeqForConditionalGeneration, ...
    fields: Mapping[str, str | tuple[str, ...]]
    implied: Mapping[str, Any] = field(default_factory=dict)
    # (stock config object, the config.json values as given) -> more archlab values
    to_archlab: Callable[[PreTrainedConfig, Mapping[str, Any]], dict[str, Any]] = lambda stock, values: {}
    from_archlab: Callable[[PreTrainedConfig], dict[str, Any]] = lambda config: {}
    expressible: frozenset[str] = frozenset()
    layout: Layout = IDENTITY
    # (a folder's state dict, its config.json values) -> floating-point weights, for a quantized form the family's
    # own archlab config computes (BitNet's packed ternary weights); run before quantized folders are refused
    dequantize: Callable[[StateDict, Mapping[str, Any]], StateDict] = _stored_as_read

    @property
    def name(self) -> str:
        return self.config_class.model_type

    @property
    def architecture(self) -> str:
        return self.model_class.__name__

    # --- configs ------------------------------------------------------------------------------------------------
    def stock_config(self, values: Mapping[str, Any]) -> PreTrainedConfig:
        """The stock config of a config.json: fields it omits take the stock defaults (which differ from archlab's),
        legacy fields (`rope_theta`, `rope_scaling`) are standardised by the stock class."""
        return self.config_class(**{k: v for k, v in values.items() if k not in ("model_type", "architectures")})

    def archlab_config(self, values: Mapping[str, Any] | PreTrainedConfig) -> PreTrainedConfig:
        """The archlab config of a stock config (object or config.json values)."""
        if isinstance(values, PreTrainedConfig):
            stock, values = values, values.to_dict()
        else:
            stock = self.stock_config(values)
        kwargs: dict[str, Any] = {}
        for stock_name, ours in self.fields.items():
            for name in (ours,) if isinstance(ours, str) else ours:
                kwargs[name] = getattr(stock, stock_name)
        kwargs.update(self.implied)
        kwargs.update(self.to_archlab(stock, values))
        return self.archlab_class.config_class(**without_ids_outside_the_vocabulary(kwargs))

    def refused_fields(self, config: PreTrainedConfig) -> dict[str, Any]:
        """archlab fields whose value this family cannot express: {field: "field=value (what the family needs)"}."""
        kept = {name for ours in self.fields.values() for name in ((ours,) if isinstance(ours, str) else ours)}
        kept |= set(self.expressible)
        try:
            expressible = type(config)(**{**self.implied, **{name: getattr(config, name) for name in kept}}).to_dict()
        except ValueError as error:  # the fields the family keeps are not a config on their own (e.g. no head size)
            defaults = type(config)().to_dict()
            dropped = sorted(
                f"{k}={v!r}"
                for k, v in config.to_dict().items()
                if k in defaults
                and k not in kept | BOOKKEEPING | TRAINING_ONLY_FIELDS | HEAD_ONLY_FIELDS
                and v != defaults[k]
            )
            raise ConversionError(
                f"A stock {self.architecture} cannot compute this archlab config: without the fields it has no "
                f"place for ({', '.join(dropped)}) it is not valid: {error}"
            ) from None
        current = config.to_dict()
        ignored = TRAINING_ONLY_FIELDS | HEAD_ONLY_FIELDS | BOOKKEEPING | kept
        refused = {
            k: f"{k}={v!r} (it needs {expressible[k]!r})"
            for k, v in current.items()
            if k not in ignored and not k.startswith("_") and k in expressible and v != expressible[k]
        }
        for stock_name, ours in self.fields.items():
            if not isinstance(ours, str) and len({repr(getattr(config, name)) for name in ours}) > 1:
                values = tuple(getattr(config, n) for n in ours)
                refused["/".join(ours)] = f"{'/'.join(ours)}={values!r} (it needs one value, its `{stock_name}`)"
        return refused

    def export_config(self, config: PreTrainedConfig) -> PreTrainedConfig:
        """The stock config of an archlab config, or a ConversionError naming what the family cannot express."""
        extra = self.from_archlab(config)  # the family's own checks first: they say what it needs
        refused = self.refused_fields(config)
        if refused:
            details = ", ".join(refused[k] for k in sorted(refused))
            raise ConversionError(
                f"This archlab config is not {self.name}-equivalent: {details}. A stock {self.architecture} cannot "
                "compute these variants; set them as given to export."
            )
        kwargs = {
            stock_name: getattr(config, ours if isinstance(ours, str) else ours[0])
            for stock_name, ours in self.fields.items()
        }
        kwargs.update(extra)
        try:
            return self.config_class(**kwargs, architectures=[self.architecture])
        except Exception as error:  # the stock config class's own validation (strict dataclass types, ranges)
            raise ConversionError(
                f"A stock {self.config_class.__name__} refuses the values this archlab config maps to: {error}"
            ) from None


def renamed(state_dict: StateDict, pairs: tuple[tuple[str, str], ...], back: bool = False) -> StateDict:
    """`state_dict` with, for each (stock, archlab) pair of name parts in turn, the stock part replaced by archlab's
    in every key (`back`: archlab's by the stock one): the layouts whose tensors differ from archlab's by name only."""
    for stock, ours in pairs:
        old, new = (ours, stock) if back else (stock, ours)
        state_dict = {key.replace(old, new): tensor for key, tensor in state_dict.items()}
    return state_dict


def without_ids_outside_the_vocabulary(kwargs: dict[str, Any]) -> dict[str, Any]:
    """A stock config's pad/bos id outside `[0, vocab_size)` (older Llama folders carry `pad_token_id=-1`, "no pad")
    becomes None, with a warning: stock configs only warn about it, archlab's refuse it, and the folder would not
    convert at all."""
    vocab_size = kwargs.get("vocab_size")
    for name in ("pad_token_id", "bos_token_id"):
        value = kwargs.get(name)
        if isinstance(value, int) and isinstance(vocab_size, int) and not 0 <= value < vocab_size:
            warnings.warn(
                f"The stock config's `{name}` ({value}) is outside the vocabulary [0, {vocab_size}): no such token "
                f"exists, so the archlab config gets `{name}=None`.",
                stacklevel=3,
            )
            kwargs = {**kwargs, name: None}
    return kwargs


__all__ = [
    "BOOKKEEPING",
    "ConversionError",
    "Family",
    "HEAD_ONLY_FIELDS",
    "IDENTITY",
    "Layout",
    "StateDict",
    "TRAINING_ONLY_FIELDS",
    "renamed",
    "same",
]
