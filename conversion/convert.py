"""`convert_checkpoint`: a stock family's folder to an archlab folder, and an archlab folder back to a stock family.

The source's family is read from its `config.json` (`model_type`), its head (causal LM or sequence classifier) from
`architectures` (`heads.py`); the destination is complete or absent.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

from transformers import AutoConfig, PreTrainedConfig

from ..modeling import DecoderConfig, Seq2SeqConfig
from ..modeling.rotary import rotary_per_layer_type
from .families import FAMILIES
from .family import ConversionError
from .folders import load_state_dict, read_config, write_model
from .heads import archlab_row, stock_row
from .quantized import refuse_quantized_weights
from .text_stacks import TEXT_STACKS

ARCHLAB_MODEL_TYPES = {config.model_type: config for config in (DecoderConfig, Seq2SeqConfig)}
# config.json model_types that are a family's under another name: Kimi K2's folders (the config of its remote code is
# DeepSeek-V3's, read so by transformers itself in its Kimi K2.5 config's text model)
MODEL_TYPE_ALIASES = {"kimi_k2": "deepseek_v3"}


def convert_checkpoint(src: str | os.PathLike, dst: str | os.PathLike, to: str | None = None) -> Path:
    """Convert the model folder `src` into `dst` and return `dst`.

    - `src` of a stock family in `FAMILIES` (or one of `MODEL_TYPE_ALIASES`: Kimi K2 is DeepSeek-V3) -> an archlab
      folder (`to` must be None or "archlab");
    - `src` an archlab folder and `to` a family name -> a stock folder of that family;
    - `src` a multimodal folder whose language model is a family (`TEXT_STACKS`: Llama 4's, Gemma 3's, Mistral 3's,
      LLaVA's) -> an archlab folder of that language model.

    A decoder family's `<Family>ForSequenceClassification` is archlab's `DecoderForSequenceClassification`, both ways;
    BERT's sequence and token classifiers are `EncoderForSequenceClassification` / `EncoderForTokenClassification`.
    """
    src, dst = Path(src), Path(dst)
    if dst.exists() and not dst.is_dir():  # (iterdir() failed with NotADirectoryError's traceback)
        raise ConversionError(f"Destination {dst} is a file, not a folder; choose a new folder.")
    if dst.exists() and any(dst.iterdir()):
        raise ConversionError(f"Destination {dst} exists and is not empty; choose a new folder.")
    values = read_config(src)
    model_type = values.get("model_type")
    if model_type in MODEL_TYPE_ALIASES:
        model_type = MODEL_TYPE_ALIASES[model_type]
        values = {**values, "model_type": model_type}

    if model_type in ARCHLAB_MODEL_TYPES:
        if to is None or to == "archlab":
            raise ConversionError(
                f"{src} is already an archlab checkpoint; pass a target family to export it: to one of "
                f"{sorted(FAMILIES)}."
            )
        if to not in FAMILIES:
            raise ConversionError(f"Unknown target family {to!r}; allowed: {sorted(FAMILIES)}.")
        family = FAMILIES[to]
        config = AutoConfig.from_pretrained(src)
        if not isinstance(config, family.archlab_class.config_class):
            raise ConversionError(
                f"{src} holds model_type {model_type!r}; --to {to} exports {family.archlab_class.__name__} folders "
                f"(model_type {family.archlab_class.config_class.model_type!r})."
            )
        family = archlab_row(family, values.get("architectures"), src, to)
        config = with_one_rope(config, to)
        stock_config = family.export_config(config)
        state_dict = load_state_dict(src)
        refuse_quantized_weights(src, values, state_dict)
        state_dict = family.layout.from_archlab(state_dict, config)
        return write_model(family.model_class, stock_config, state_dict, src, dst)

    if model_type in FAMILIES:
        if to not in (None, "archlab"):
            raise ConversionError(f"{src} is a {model_type} checkpoint; it converts to archlab only (no `to`).")
        family = stock_row(FAMILIES[model_type], values.get("architectures"), src)
        config = family.archlab_config(values)
        state_dict = family.dequantize(load_state_dict(src), values)
        refuse_quantized_weights(src, values, state_dict)
        state_dict = family.layout.to_archlab(state_dict, config)
        return write_model(family.archlab_class, config, state_dict, src, dst)

    if model_type in TEXT_STACKS:  # a multimodal folder: its language model (text_stacks.py)
        stack = TEXT_STACKS[model_type]
        if to not in (None, "archlab"):
            raise ConversionError(
                f"{src} is a {model_type} checkpoint; its language model converts to archlab only (no `to`)."
            )
        text = stack.text_values(values, src)
        if text["model_type"] not in FAMILIES:
            raise ConversionError(
                f"{src} is a {model_type} checkpoint whose language model is {text['model_type']!r}, which the "
                f"converter does not know; it knows: {sorted(FAMILIES)}."
            )
        family = FAMILIES[text["model_type"]]
        config = family.archlab_config(text)
        state_dict = stack.load(src)
        refuse_quantized_weights(src, values, state_dict)
        state_dict = family.layout.to_archlab(state_dict, config)
        return write_model(family.archlab_class, config, state_dict, src, dst)

    known = sorted(FAMILIES) + sorted(MODEL_TYPE_ALIASES) + sorted(TEXT_STACKS) + sorted(ARCHLAB_MODEL_TYPES)
    raise ConversionError(f"{src} has model_type={model_type!r}; the converter knows: {known}.")


# the families whose config holds RoPE per layer type (transformers 5's form; Granite SWA's a base per layer,
# `layer_rope_theta`); the others build one for every layer
ROPE_PER_LAYER_TYPE_FAMILIES = ("gemma3_text", "olmo3", "mellum", "granite_swa")


def with_one_rope(config: PreTrainedConfig, to: str) -> PreTrainedConfig:
    """An archlab config with RoPE per layer type, exported to a family with one RoPE for every layer: its sets as
    the one where they are equal (a copy), refused by name where they differ. The stock config took the nested dict
    as unknown keys beside its default RoPE and built that one (theta 10,000) without a word."""
    if to in ROPE_PER_LAYER_TYPE_FAMILIES or not rotary_per_layer_type(config):
        return config
    sets = {kind: value for kind, value in config.rope_parameters.items() if isinstance(value, dict)}
    if any(value != next(iter(sets.values())) for value in sets.values()):
        raise ConversionError(
            f"This archlab config's `rope_parameters` holds a different set per layer type ({', '.join(sets)}); "
            f"{to} builds one RoPE for every layer (of these families only {', '.join(ROPE_PER_LAYER_TYPE_FAMILIES)} "
            "has one per layer type)."
        )
    config = copy.deepcopy(config)
    config.rope_parameters = dict(next(iter(sets.values())))
    return config


__all__ = ["convert_checkpoint"]
