"""Multimodal checkpoints whose language model is a family archlab converts: their text stack alone, imported.

Meta publishes Llama 4 (Scout, Maverick) as `Llama4ForConditionalGeneration` folders (`model_type` "llama4"): a vision
encoder and projector beside a `Llama4ForCausalLM` whose config is the folder's `text_config` and whose tensors are
saved under `language_model.`. Importing such a folder converts that language model, as the `llama4_text` family
would convert a folder of its own, and leaves the vision tower out (read from the safetensors lazily: only the text
stack's tensors are loaded). The result is a text-only `DecoderForCausalLM`; the tokenizer travels along. Exporting
goes to the text family (`--to llama4_text`), not back to the multimodal class.

Gemma 3 (4B, 12B, 27B: `Gemma3ForConditionalGeneration`, text `gemma3_text`), Mistral Small 3.1 / 3.2
(`Mistral3ForConditionalGeneration`, text `mistral` or the family its `text_config` names) and LLaVA
(`LlavaForConditionalGeneration`, text `llama` or the family its `text_config` names) are read the same way, from
either layout of their tensors (`LLAVA_PREFIXES`). For text alone their language model computes what the multimodal
model computes (no image tokens: causal attention, Gemma 3's local and global layers); images are not archlab's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open
from transformers import AutoConfig

from .family import ConversionError, StateDict
from .folders import load_state_dict, weight_files

# where the LLaVA-style classes (Gemma 3, Mistral 3, LLaVA) keep their language model, in both layouts: published
# folders of transformers 4 (`language_model.model.*`, `language_model.lm_head.*`) and folders transformers 5 saves
# (`model.language_model.*`, `lm_head.*`); the vision tower and projector match neither
LLAVA_PREFIXES = (
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.language_model.", "model."),
    ("lm_head.", "lm_head."),
)


@dataclass(frozen=True)
class TextStack:
    """Where a multimodal family keeps its language model: its config's key (the text family is that config's
    `model_type`, the class's default where config.json names none), its tensors' prefixes (stored prefix -> the text
    model's)."""

    config_key: str
    prefixes: tuple[tuple[str, str], ...]
    # text config values the multimodal class computes with in place of the nested config's
    overrides: tuple[tuple[str, Any], ...] = ()

    def text_values(self, values: Mapping[str, Any], src: Path) -> dict[str, Any]:
        """The text model's config.json values: the nested config, with its family's `model_type`, the outer config's
        `tie_word_embeddings` (transformers ties the head by the outer one; a head stored apart stays apart, as
        `write_model` keeps it) and the stack's `overrides`."""
        nested = values.get(self.config_key)
        if not isinstance(nested, Mapping):
            raise ConversionError(f"{src}/config.json has no `{self.config_key}` to read the language model from.")
        outer = AutoConfig.for_model(**values)  # its class's defaults and rules (LLaVA's: the outer or the nested)
        text = {**nested, "model_type": getattr(outer, self.config_key).model_type}
        text["tie_word_embeddings"] = outer.tie_word_embeddings
        return {**text, **dict(self.overrides)}

    def rename(self, key: str) -> str | None:
        """The text model's name of a stored tensor; None where it is not the language model's."""
        for stored, text in self.prefixes:
            if key.startswith(stored):
                return text + key[len(stored) :]
        return None

    def load(self, folder: Path) -> StateDict:
        """The language model's tensors under the text model's names; the rest of the folder is not read."""
        files = weight_files(folder)
        if not files or not all(file.is_file() for file in files):
            load_state_dict(folder)  # raises the converter's error: no safetensors, or a shard the index names missing
        state_dict: StateDict = {}
        for file in files:
            try:
                with safe_open(str(file), framework="pt") as weights:
                    for key in weights.keys():
                        name = self.rename(key)
                        if name is not None:
                            state_dict[name] = weights.get_tensor(key)
            except SafetensorError as error:  # a truncated or empty file
                raise ConversionError(f"{file} is damaged or not a safetensors file ({error}).") from None
        if not state_dict:
            prefixes = " or ".join(f"`{stored}`" for stored, _ in self.prefixes)
            raise ConversionError(f"{folder} holds no tensors under {prefixes} (its language model).")
        return state_dict


TEXT_STACKS = {
    "llama4": TextStack("text_config", (("language_model.", ""),)),
    # Gemma3ForConditionalGeneration never softcaps its logits (its own config has no such field; published Gemma 3
    # text configs say None)
    "gemma3": TextStack("text_config", LLAVA_PREFIXES, (("final_logit_softcapping", None),)),
    # AyaVisionForConditionalGeneration never scales its logits by its Cohere 2 text config's `logit_scale`
    "aya_vision": TextStack("text_config", LLAVA_PREFIXES, (("logit_scale", 1.0),)),
    **{
        model_type: TextStack("text_config", LLAVA_PREFIXES)
        for model_type in ("mistral3", "llava", "llava_next", "llava_onevision", "vipllava", "internvl")
    },
}

__all__ = ["TEXT_STACKS", "TextStack"]
