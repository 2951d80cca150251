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
Qwen2-VL, Qwen2.5-VL and Qwen3-VL (dense) hold Qwen2's / Qwen3's language model with RoPE in sections (t, h, w) that
text alone gives one position, the plain RoPE (`QWEN_VL_PREFIXES` for their layouts).
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


# where Qwen2-VL, Qwen2.5-VL and Qwen3-VL keep their language model: published Qwen2-VL / 2.5-VL folders put it at the
# top (`model.layers.*`, the vision tower under `visual.*`), Qwen3-VL's and the modules' names nest it
# (`model.language_model.*`, the tower under `model.visual.*`); the head is `lm_head.*` in both
QWEN_VL_PREFIXES = (
    ("model.language_model.", "model."),
    ("model.visual.", None),
    ("visual.", None),
    ("model.", "model."),
    ("lm_head.", "lm_head."),
)
# Qwen-VL's RoPE sections (t, h, w): text alone has the same position in each, the plain RoPE
MROPE_KEYS = ("mrope_section", "mrope_interleaved", "type")


@dataclass(frozen=True)
class TextStack:
    """Where a multimodal family keeps its language model: its config's key (the text family is that config's
    `model_type`, the class's default where config.json names none; `family` where that type is the multimodal
    family's own), its tensors' prefixes (stored prefix -> the text model's; None: not the language model's)."""

    config_key: str
    prefixes: tuple[tuple[str, str | None], ...]
    # text config values the multimodal class computes with in place of the nested config's
    overrides: tuple[tuple[str, Any], ...] = ()
    # the text family where the text config's `model_type` is the multimodal family's (`qwen2_5_vl_text`: Qwen2's)
    family: str | None = None
    # the text config's fields may stand at the top of config.json (published Qwen2-VL / Qwen2.5-VL folders)
    flat_text_fields: bool = False
    # the text config's RoPE is in sections (Qwen-VL's t, h, w: one RoPE for text alone)
    sectioned_rope: bool = False

    def text_values(self, values: Mapping[str, Any], src: Path) -> dict[str, Any]:
        """The text model's config.json values: the nested config (the one the outer class builds, for Qwen2-VL's top
        level fields), with its family's `model_type`, the outer config's `tie_word_embeddings` (transformers ties
        the head by the outer one; a head stored apart stays apart, as `write_model` keeps it) and the stack's
        `overrides`; Qwen-VL's RoPE without its sections (`MROPE_KEYS`)."""
        nested = values.get(self.config_key)
        if not isinstance(nested, Mapping) and not self.flat_text_fields:
            raise ConversionError(f"{src}/config.json has no `{self.config_key}` to read the language model from.")
        outer = AutoConfig.for_model(**values)  # its class's defaults and rules (LLaVA's: the outer or the nested)
        built = getattr(outer, self.config_key)
        text = built.to_dict() if self.flat_text_fields else dict(nested)
        text["model_type"] = self.family or built.model_type
        text["tie_word_embeddings"] = outer.tie_word_embeddings
        if self.sectioned_rope and isinstance(text.get("rope_parameters"), Mapping):
            text["rope_parameters"] = {k: v for k, v in text["rope_parameters"].items() if k not in MROPE_KEYS}
        return {**text, **dict(self.overrides)}

    def rename(self, key: str) -> str | None:
        """The text model's name of a stored tensor; None where it is not the language model's."""
        for stored, text in self.prefixes:
            if key.startswith(stored):
                return None if text is None else text + key[len(stored) :]
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
            prefixes = " or ".join(f"`{stored}`" for stored, text in self.prefixes if text is not None)
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
        model_type: TextStack(
            "text_config", QWEN_VL_PREFIXES, family="qwen2", flat_text_fields=True, sectioned_rope=True
        )
        for model_type in ("qwen2_vl", "qwen2_5_vl")
    },
    # Qwen3-VL's attention has no window, whatever its text config says
    "qwen3_vl": TextStack(
        "text_config",
        QWEN_VL_PREFIXES,
        (("use_sliding_window", False), ("sliding_window", None), ("layer_types", None)),
        family="qwen3",
        sectioned_rope=True,
    ),
    **{
        model_type: TextStack("text_config", LLAVA_PREFIXES)
        for model_type in ("mistral3", "llava", "llava_next", "llava_onevision", "vipllava", "internvl")
    },
}

__all__ = ["TEXT_STACKS", "TextStack"]
