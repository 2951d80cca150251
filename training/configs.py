"""A model's config (and the model) from the user's choices: a pretrained folder, a named preset, a config JSON or
the default architecture, plus `key=value` overrides; the vocabulary and special-token ids come from the tokenizer.
Every check here fails before a tokenizer is trained or data is read."""

from __future__ import annotations

import difflib
import json
import os
from typing import Any, Protocol

from transformers import AutoConfig, PreTrainedModel

import archlab

from .kinds import DEFAULT_ARCHITECTURES, ModelKind, model_kind


class ModelChoices(Protocol):
    """What a config is built from: the scripts' `ModelArguments`, or any object with these attributes."""

    model_kind: str
    model_name_or_path: str | None
    preset: str | None
    config_name: str | None
    config_overrides: str | None


def _split_top_level(text: str) -> list[str]:
    """Split on the commas outside JSON brackets and quotes: 'a=1,b=[1,2],c={"x":1,"y":2}' -> 3 items."""
    items, depth, quoted, start = [], 0, False, 0
    for i, char in enumerate(text):
        if char == '"' and (i == 0 or text[i - 1] != "\\"):
            quoted = not quoted
        elif not quoted and char in "[{":
            depth += 1
        elif not quoted and char in "]}":
            depth -= 1
        elif not quoted and depth == 0 and char == ",":
            items.append(text[start:i])
            start = i + 1
    return items + [text[start:]]


def parse_overrides(text: str | None) -> dict[str, Any]:
    """ "a=1,b=true,c=rms_norm" -> {"a": 1, "b": True, "c": "rms_norm"} (values parsed as JSON when they are, so
    lists and objects work too: 'layer_types=["sliding_attention","full_attention"]')."""
    values: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in _split_top_level(text or ""))):
        if "=" not in item:
            raise ValueError(f"--config_overrides: {item!r} is not of the form key=value.")
        key, raw = (s.strip() for s in item.split("=", 1))
        try:
            values[key] = json.loads(raw)
        except json.JSONDecodeError:
            values[key] = raw
    return values


def check_override_names(choices: ModelChoices) -> None:
    """Refuse --config_overrides keys the config class does not know: a config stores any unknown keyword as an
    attribute, so a typo ("num_hidden_layer=2") would otherwise train the default shape without a word."""
    overrides = parse_overrides(choices.config_overrides)
    if not overrides:
        return
    config_class = getattr(archlab, model_kind(choices.model_kind).config_class)
    default = config_class()
    unknown = []
    for key, value in overrides.items():
        if hasattr(default, key):
            continue
        try:  # keys the config consumes and rewrites (`rope_theta` -> `rope_parameters`) are not stored as given
            if key not in config_class(**{key: value}).to_dict():
                continue
        except Exception:  # a value the config rejects: the full build reports it with context
            continue
        unknown.append(key)
    if unknown:
        fields = sorted(set(default.to_dict()) | set(config_class.attribute_map))
        named = [
            f"{key!r}" + "".join(f" (did you mean {m!r}?)" for m in difflib.get_close_matches(key, fields, n=1))
            for key in unknown
        ]
        raise ValueError(
            f"--config_overrides: {config_class.__name__} has no field {', '.join(named)}; "
            "docs/catalogue.md lists the fields."
        )


def preset_values(name: str, kind: str) -> dict[str, Any]:
    """The config fields of a named decoder preset (`archlab.configuration.presets`)."""
    from archlab.configuration.presets import preset_kwargs

    if kind != "decoder":
        raise ValueError(f"Conflicting flags: --preset names decoder shapes; --model_kind {kind} takes --config_name.")
    return preset_kwargs(name)


def new_config_values(choices: ModelChoices) -> tuple[dict[str, Any], dict[str, Any], set[str]]:
    """The fields of a new model's config before the tokenizer fills in its vocabulary and special ids: the preset,
    JSON or default architecture with the overrides; also the overrides and every field the user set."""
    if choices.preset:
        values = preset_values(choices.preset, choices.model_kind)
        values.pop("vocab_size", None)  # a preset is a shape: the vocabulary is the tokenizer's
    elif choices.config_name:
        path = choices.config_name
        path = os.path.join(path, "config.json") if os.path.isdir(path) else path
        with open(path, encoding="utf-8") as f:
            values = json.load(f)
        for key in ("model_type", "architectures", "transformers_version", "auto_map"):
            values.pop(key, None)
    else:
        values = dict(DEFAULT_ARCHITECTURES[choices.model_kind])
    overrides = parse_overrides(choices.config_overrides)
    user_set = set(overrides) | (set(values) if choices.config_name else set())
    values.update(overrides)
    return values, overrides, user_set


def check_new_config(choices: ModelChoices) -> None:
    """Build a new model's config once with a stand-in vocabulary, so a field out of range fails now, before a
    tokenizer is trained or data is read (the real config gets the tokenizer's vocabulary and ids later)."""
    if choices.model_name_or_path:
        return
    values, _, user_set = new_config_values(choices)
    if "vocab_size" not in user_set:
        values["vocab_size"] = 1 << 16
    getattr(archlab, model_kind(choices.model_kind).config_class)(**values)


def build_config(choices: ModelChoices, tokenizer: Any, block_size: int | None, num_labels: int | None = None):
    """The model config: pretrained, preset, JSON or the default architecture, plus overrides; the vocabulary and
    special-token ids come from the tokenizer unless the user set them. Fails on a tokenizer that does not fit."""
    kind = model_kind(choices.model_kind)
    if choices.model_name_or_path:
        try:
            config = AutoConfig.from_pretrained(choices.model_name_or_path)
        except OSError as error:
            raise OSError(
                f"--model_name_or_path {choices.model_name_or_path!r} is neither a local folder nor "
                f"loadable from the Hub ({error})"
            ) from error
    else:
        values, overrides, user_set = new_config_values(choices)
        if "vocab_size" not in user_set:
            values["vocab_size"] = len(tokenizer)
        for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
            token_id = getattr(tokenizer, name, None)
            if name not in overrides and token_id is not None:
                values[name] = token_id
        if choices.model_kind == "seq2seq" and "decoder_start_token_id" not in overrides:
            values["decoder_start_token_id"] = tokenizer.bos_token_id  # the seq2seq tokenizer never emits <s>
        if num_labels is not None:
            values["num_labels"] = num_labels
        config = getattr(archlab, kind.config_class)(**values)
    check_fits(config, tokenizer, block_size, kind)
    return config


def check_fits(config: Any, tokenizer: Any, block_size: int | None, kind: ModelKind) -> None:
    if len(tokenizer) > config.vocab_size:
        raise ValueError(
            f"The tokenizer has {len(tokenizer)} tokens but the model's `vocab_size` is {config.vocab_size}: "
            "token ids would index past the embedding. Use a matching tokenizer or a larger vocab_size."
        )
    max_positions = getattr(config, kind.max_positions_field, None)
    if block_size is not None and max_positions is not None and block_size > max_positions:
        raise ValueError(
            f"--block_size {block_size} exceeds the model's `{kind.max_positions_field}` ({max_positions})."
        )


def build_model(
    auto_class: Any, config: Any, model_name_or_path: str | None, attn_implementation: str | None = None
) -> PreTrainedModel:
    """The pretrained model at `model_name_or_path` with `config`, or a new one from `config`."""
    if model_name_or_path:
        model = auto_class.from_pretrained(model_name_or_path, config=config)
    else:
        model = auto_class.from_config(config)
    if attn_implementation:
        model.set_attn_implementation(attn_implementation)
    return model
