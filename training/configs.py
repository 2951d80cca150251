"""A model's config (and the model) from the user's choices: a pretrained folder, a named preset, a config JSON or
the default architecture, plus `key=value` overrides; the vocabulary and special-token ids come from the tokenizer.
Every check here fails before a tokenizer is trained or data is read."""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import Callable
from typing import Any, Protocol

import torch
from transformers import AutoConfig, GenerationConfig, PreTrainedModel

import archlab
from archlab.modeling.configuration_decoder import LEGACY_ROPE_FIELDS, UNDECLARED_HEAD_FIELDS, override_rope

from .dtypes import load_dtype
from .kinds import DEFAULT_ARCHITECTURES, ModelKind, model_kind


class ModelChoices(Protocol):
    """What a config is built from: the scripts' `ModelArguments`, or any object with these attributes."""

    model_kind: str
    model_name_or_path: str | None
    preset: str | None
    config_name: str | None
    config_overrides: str | None
    dtype: str | None  # the dtype a pretrained folder loads in (`dtypes.DTYPES`; unset: float32)


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
    generation_settings = set(GenerationConfig().to_dict())
    generation = [key for key in overrides if key in generation_settings]
    unknown = unknown_fields(config_class, {k: v for k, v in overrides.items() if k not in generation_settings})
    named = field_namer(config_class)
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


def config_file_values(choices: ModelChoices) -> dict[str, Any]:
    """The fields of --config_name (a JSON file or a folder's config.json), refused with the flag named when the file
    is not a JSON object, holds another model type than --model_kind builds, or has fields the config class does not
    know (a config stores unknown keys silently, so a seq2seq config.json given to a decoder run would otherwise build
    the default decoder: LLaMA-7B's shape)."""
    path = choices.config_name
    path = os.path.join(path, "config.json") if os.path.isdir(path) else path
    try:
        with open(path, encoding="utf-8") as f:
            values = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"--config_name {choices.config_name!r}: {path} is not a JSON config ({error}).") from None
    if not isinstance(values, dict):
        raise ValueError(f"--config_name {choices.config_name!r}: {path} holds {type(values).__name__}, not a config.")
    config_class = getattr(archlab, model_kind(choices.model_kind).config_class)
    found = values.get("model_type")
    if found is not None and found != config_class.model_type:
        raise ValueError(
            f"--config_name {choices.config_name!r} is a `{found}` config, but --model_kind {choices.model_kind} "
            f"builds `{config_class.model_type}`: pass a matching --model_kind or config."
        )
    for key in ("model_type", "architectures", "transformers_version", "auto_map"):
        values.pop(key, None)
    drop_derived_layer_lists(values)
    unknown = unknown_fields(config_class, values)
    if unknown:
        raise ValueError(
            f"--config_name {choices.config_name!r}: {config_class.__name__} has no field "
            f"{', '.join(map(field_namer(config_class), unknown))}; docs/catalogue.md lists the fields."
        )
    return values


def drop_derived_layer_lists(values: dict[str, Any]) -> None:
    """A saved decoder config spells out `layer_types` and `mlp_layer_types`, which the config derives from
    `sliding_window` and `num_local_experts` when unset. Kept, they would pin the file's layer count and kinds: an
    override `num_hidden_layers=4` failed on them, and `num_local_experts=4` built a dense model without a word.
    Lists equal to the derived ones are dropped so the config derives them again; hand-made lists stay."""
    attention = "full_attention" if values.get("sliding_window") is None else "sliding_attention"
    mlp = "sparse" if (values.get("num_local_experts") or 0) > 0 else "dense"
    for key, kind in (("layer_types", attention), ("mlp_layer_types", mlp)):
        layers = values.get(key)
        if isinstance(layers, list) and layers and all(layer == kind for layer in layers):
            values.pop(key)


# Fields a head reads from the config where given, which the config class does not declare:
# `DecoderForTokenClassification` reads its dropout as Llama's token classifier does (`classifier_dropout`, else
# `hidden_dropout`, else 0.1) and its bias from `token_classification_bias`. Refused as unknown, the token
# classifier's dropout could not be set from the scripts (to 0 for runs that must not depend on how a batch is split).
READ_BY_HEADS = {"DecoderConfig": UNDECLARED_HEAD_FIELDS}


def unknown_fields(config_class: Any, values: dict[str, Any]) -> list[str]:
    """The keys of `values` that `config_class` neither has nor consumes (nor one of its heads reads,
    `READ_BY_HEADS`): a config stores any unknown keyword as an attribute without a word."""
    default, unknown = config_class(), []
    for key, value in values.items():
        if hasattr(default, key) or key in READ_BY_HEADS.get(config_class.__name__, ()):
            continue
        try:  # keys the config consumes and rewrites (`rope_theta` -> `rope_parameters`) are not stored as given
            if key not in config_class(**{key: value}).to_dict():
                continue
        except Exception:  # a value the config rejects: the full build reports it with context
            continue
        unknown.append(key)
    return unknown


def field_namer(config_class: Any) -> Callable[[str], str]:
    """`key` quoted, with the field of `config_class` it likely means ("(did you mean 'hidden_size'?)")."""
    fields = sorted(set(config_class().to_dict()) | set(config_class.attribute_map))
    return lambda key: f"{key!r}" + (f" (did you mean {meant!r}?)" if (meant := likely_field(key, fields)) else "")


def new_config_values(choices: ModelChoices) -> tuple[dict[str, Any], dict[str, Any], set[str]]:
    """The fields of a new model's config before the tokenizer fills in its vocabulary and special ids: the preset,
    JSON or default architecture with the overrides; also the overrides and every field the user set."""
    if choices.preset:
        values = preset_values(choices.preset, choices.model_kind)
        values.pop("vocab_size", None)  # a preset is a shape: the vocabulary is the tokenizer's
    elif choices.config_name:
        values = config_file_values(choices)
    else:
        values = dict(DEFAULT_ARCHITECTURES[choices.model_kind])
    overrides = parse_overrides(choices.config_overrides)
    user_set = set(overrides) | (set(values) if choices.config_name else set())
    if "rope_parameters" in values and any(name in overrides for name in ("rope_parameters", *LEGACY_ROPE_FIELDS)):
        user_set.add("rope_parameters")
    return override_rope(values, overrides), overrides, user_set


def check_new_config(choices: ModelChoices, block_size: int | None = None) -> None:
    """Build a new model's config once with a stand-in vocabulary, so a field out of range, or a `block_size` past
    its positions, fails now, before a tokenizer is trained or data is read (the real config gets the tokenizer's
    vocabulary and ids later)."""
    if choices.model_name_or_path:
        return
    values, _, user_set = new_config_values(choices)
    if "vocab_size" not in user_set:
        values["vocab_size"] = 1 << 16
    kind = model_kind(choices.model_kind)
    config = getattr(archlab, kind.config_class)(**values)
    check_block_fits(config, block_size, kind)


# What a resumed run's config may hold otherwise than its checkpoint's: what transformers records of the save
# (`architectures`, `auto_map`, `dtype`: `--dtype` is a run fact of its own), what the Trainer sets for training
# (`use_cache`), the task's labels (a run fact), and outputs' switches. The tokenizer's ids and vocabulary are checked
# with the tokenizer (`check_resumed_tokenizer`), unless the flags set them.
RESUME_IGNORED_FIELDS = frozenset(
    {
        "_name_or_path",
        "architectures",
        "auto_map",
        "dtype",
        "torch_dtype",
        "transformers_version",
        "use_cache",
        "id2label",
        "label2id",
        "num_labels",
        "problem_type",
        "task_specific_params",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "chunk_size_feed_forward",
    }
)
TOKENIZER_FIELDS = frozenset(
    {"pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "sep_token_id", "cls_token_id"}
)


def check_resumed_config(choices: ModelChoices, checkpoint: str | None) -> None:
    """A resumed run must build the model its checkpoint holds: the config these flags build (preset, config file,
    overrides) is compared field by field, every field but `RESUME_IGNORED_FIELDS`, with the checkpoint's config.json,
    before any data is read. Another `hidden_size` failed as a size mismatch inside the Trainer's checkpoint load,
    after data preparation; a `sliding_window` left out was not seen at all."""
    path = os.path.join(checkpoint, "config.json") if checkpoint else None
    if path is None or choices.model_name_or_path or not os.path.isfile(path):
        return
    with open(path, encoding="utf-8") as f:
        saved = json.load(f)
    values, _, _ = new_config_values(choices)
    config_class = getattr(archlab, model_kind(choices.model_kind).config_class)
    rebuilt = config_class(**{"vocab_size": saved.get("vocab_size"), **values}).to_dict()
    # every field, not only those the flags set: a config.json leaves out the fields at their defaults, and a run
    # trained with `--config_overrides sliding_window=8` resumed without it (or the other way round) built another
    # model on the same weights without a word. Read back through the class, the saved config has them all.
    saved = config_class.from_dict(saved).to_dict()
    ignored = RESUME_IGNORED_FIELDS | (TOKENIZER_FIELDS - set(values))
    differ = [
        key for key in sorted(set(rebuilt) | set(saved)) if key not in ignored and rebuilt.get(key) != saved.get(key)
    ]
    if differ:
        raise ValueError(
            f"--resume_from_checkpoint: {checkpoint} holds a model with "
            f"{', '.join(f'{key}={saved.get(key)!r}' for key in differ)}, but these flags build "
            f"{', '.join(f'{key}={rebuilt.get(key)!r}' for key in differ)}: resume with the run's own --preset / "
            "--config_name / --config_overrides, or start a new run in another --output_dir."
        )


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
    check_block_fits(config, block_size, kind)


def check_block_fits(config: Any, block_size: int | None, kind: ModelKind) -> None:
    max_positions = getattr(config, kind.max_positions_field, None)
    if block_size is not None and max_positions is not None and block_size > max_positions:
        raise ValueError(
            f"--block_size {block_size} exceeds the model's `{kind.max_positions_field}` ({max_positions})."
        )


def build_model(
    auto_class: Any,
    config: Any,
    model_name_or_path: str | None,
    attn_implementation: str | None = None,
    ignore_mismatched_sizes: bool = False,
    dtype: str | None = None,
) -> PreTrainedModel:
    """The pretrained model at `model_name_or_path` with `config`, its weights in `dtype` (`--dtype`; unset:
    float32, what the Trainer's mixed precision expects: transformers 5 would load the folder's saved dtype, and a
    folder saved in bfloat16 trained pure bfloat16 weights without a word), or a new one from `config` in float32
    (`ignore_mismatched_sizes`: weights of another shape than `config` gives them, a classifier's head for another
    number of labels, are initialized anew)."""
    if model_name_or_path:
        model = auto_class.from_pretrained(
            model_name_or_path,
            config=config,
            ignore_mismatched_sizes=ignore_mismatched_sizes,
            dtype=load_dtype(dtype, torch.float32),
        )
    else:
        model = auto_class.from_config(config)
    if attn_implementation:
        model.set_attn_implementation(attn_implementation)
    return model
