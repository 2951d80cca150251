"""A model's config (and the model) from the user's choices: a pretrained folder, a named preset, a config JSON or
the default architecture, plus `key=value` overrides; the vocabulary and special-token ids come from the tokenizer.
Every check here fails before a tokenizer is trained or data is read."""

from __future__ import annotations

import difflib
import json
import os
from typing import Any, Protocol

from transformers import AutoConfig, GenerationConfig, PreTrainedModel

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


# Other codebases' names for archlab's fields (GPT-2, T5, BERT, Megatron, LLaMA's original code, nanoGPT ...): an
# override under one of them is answered with the field it means, where string similarity would guess another.
NAMES_ELSEWHERE = {
    **dict.fromkeys(("num_heads", "n_head", "n_heads", "heads"), ("num_attention_heads",)),
    **dict.fromkeys(("num_layers", "n_layer", "n_layers", "layers", "depth"), ("num_hidden_layers",)),
    **dict.fromkeys(("n_embd", "n_embed", "dim", "embed_dim", "d_model", "model_dim"), ("hidden_size", "d_model")),
    **dict.fromkeys(
        ("n_positions", "n_ctx", "max_seq_len", "max_seq_length", "context_length", "seq_len", "block_size"),
        ("max_position_embeddings",),
    ),
    **dict.fromkeys(
        ("n_inner", "d_ff", "ffn_dim", "ffn_hidden_size", "mlp_dim"), ("intermediate_size", "encoder_ffn_dim")
    ),
    **dict.fromkeys(("num_kv_heads", "n_kv_heads", "kv_heads"), ("num_key_value_heads",)),
    **dict.fromkeys(("n_experts", "moe_num_experts", "experts"), ("num_local_experts",)),
    **dict.fromkeys(("top_k", "moe_top_k", "num_experts_per_token", "experts_per_token"), ("num_experts_per_tok",)),
    **dict.fromkeys(("norm_eps", "layer_norm_epsilon", "eps"), ("rms_norm_eps", "layer_norm_eps")),
    **dict.fromkeys(("window", "window_size", "sliding_window_size"), ("sliding_window",)),
    **dict.fromkeys(("rope_base", "rotary_base", "rotary_emb_base", "base"), ("rope_parameters",)),
    **dict.fromkeys(("activation", "act_fn", "hidden_activation"), ("hidden_act", "activation_function")),
    **dict.fromkeys(("attn_pdrop", "attention_probs_dropout_prob"), ("attention_dropout",)),
    **dict.fromkeys(("n_vocab", "vocab"), ("vocab_size",)),
    **dict.fromkeys(("tie_embeddings", "tie_weights", "tied_embeddings"), ("tie_word_embeddings",)),
}


def likely_field(key: str, fields: list[str]) -> str | None:
    """The field an unknown override `key` most likely means: its name in another codebase (`NAMES_ELSEWHERE`),
    else the closest spelling, else None."""
    meant = [field for field in NAMES_ELSEWHERE.get(key.lower(), ()) if field in fields]
    return (meant or difflib.get_close_matches(key, fields, n=1) or [None])[0]


def check_override_names(choices: ModelChoices) -> None:
    """Refuse --config_overrides keys the config class does not know: a config stores any unknown keyword as an
    attribute, so a typo ("num_hidden_layer=2") would otherwise train the default shape without a word; and a
    generation setting ("top_k=2"), which a config drops without a word."""
    overrides = parse_overrides(choices.config_overrides)
    if not overrides:
        return
    config_class = getattr(archlab, model_kind(choices.model_kind).config_class)
    default = config_class()
    generation_settings = set(GenerationConfig().to_dict())
    unknown, generation = [], []
    for key, value in overrides.items():
        if hasattr(default, key):
            continue
        if key in generation_settings:
            generation.append(key)
            continue
        try:  # keys the config consumes and rewrites (`rope_theta` -> `rope_parameters`) are not stored as given
            if key not in config_class(**{key: value}).to_dict():
                continue
        except Exception:  # a value the config rejects: the full build reports it with context
            continue
        unknown.append(key)
    fields = sorted(set(default.to_dict()) | set(config_class.attribute_map))

    def named(key: str) -> str:
        return f"{key!r}" + (f" (did you mean {meant!r}?)" if (meant := likely_field(key, fields)) else "")

    problems = []
    if unknown:
        problems.append(
            f"{config_class.__name__} has no field {', '.join(map(named, unknown))}; docs/catalogue.md lists the fields"
        )
    if generation:
        problems.append(
            f"{', '.join(map(named, generation))}: generation settings (transformers' GenerationConfig), which a model "
            "config drops; give them when generating (scripts/generate.py's flags, or `generate(...)`)"
        )
    if problems:
        raise ValueError(f"--config_overrides: {'; '.join(problems)}.")


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
