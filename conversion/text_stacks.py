"""Multimodal checkpoints whose language model is a family archlab converts: their text stack alone, imported.

Meta publishes Llama 4 (Scout, Maverick) as `Llama4ForConditionalGeneration` folders (`model_type` "llama4"): a vision
encoder and projector beside a `Llama4ForCausalLM` whose config is the folder's `text_config` and whose tensors are
saved under `language_model.`. Importing such a folder converts that language model, as the `llama4_text` family
would convert a folder of its own, and leaves the vision tower out (read from the safetensors lazily: only the text
stack's tensors are loaded). The result is a text-only `DecoderForCausalLM`; the tokenizer travels along. Exporting
goes to the text family (`--to llama4_text`), not back to the multimodal class.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open

from .family import ConversionError, StateDict
from .folders import load_state_dict, weight_files


@dataclass(frozen=True)
class TextStack:
    """Where a multimodal family keeps its language model: the text family, its config's key, its tensors' prefix."""

    family: str  # the `model_type` of the text family (a key of FAMILIES)
    config_key: str
    prefix: str

    def text_values(self, values: Mapping[str, Any], src: Path) -> dict[str, Any]:
        """The text model's config.json values: the nested config, with the text family's `model_type`."""
        nested = values.get(self.config_key)
        if not isinstance(nested, Mapping):
            raise ConversionError(f"{src}/config.json has no `{self.config_key}` to read the language model from.")
        return {**nested, "model_type": self.family}

    def load(self, folder: Path) -> StateDict:
        """The language model's tensors, their prefix dropped; the rest of the folder is not read."""
        files = weight_files(folder)
        if not files or not all(file.is_file() for file in files):
            load_state_dict(folder)  # raises the converter's error: no safetensors, or a shard the index names missing
        state_dict: StateDict = {}
        for file in files:
            try:
                with safe_open(str(file), framework="pt") as weights:
                    for key in weights.keys():
                        if key.startswith(self.prefix):
                            state_dict[key[len(self.prefix) :]] = weights.get_tensor(key)
            except SafetensorError as error:  # a truncated or empty file
                raise ConversionError(f"{file} is damaged or not a safetensors file ({error}).") from None
        if not state_dict:
            raise ConversionError(f"{folder} holds no tensors under `{self.prefix}` (its language model).")
        return state_dict


TEXT_STACKS = {"llama4": TextStack("llama4_text", "text_config", "language_model.")}

__all__ = ["TEXT_STACKS", "TextStack"]
