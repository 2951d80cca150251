"""What the pretrain / finetune / generate scripts share: argument dataclasses (Hugging Face flag names, as in
transformers' `examples/pytorch/*/run_*.py`), model kinds, config building, the checks that run before anything is
written, a Trainer whose checkpoints are complete or absent, and the final save (model, tokenizer, loss curve, card).
"""

from __future__ import annotations

import argparse
import difflib
import json
import math
import os
import shutil
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    AutoModelForSeq2SeqLM,
    AutoModelForSequenceClassification,
    HfArgumentParser,
    Trainer,
    TrainerCallback,
    TrainerState,
    TrainingArguments,
)
from transformers.trainer_utils import TrainOutput, get_last_checkpoint, rotate_checkpoints
from transformers.training_args import ParallelMode

import archlab
from archlab.tokenization.data import SAMPLE_BY
from archlab.tokenization.training import ALGORITHMS as TOKENIZER_ALGORITHMS
from archlab.tokenization.training import MODEL_KINDS as TOKENIZER_KINDS
from archlab.tokenization.training import has_tokenizer, load_tokenizer, save_tokenizer

LOSS_CURVE = "loss_curve.png"
STAGING = ".staging"  # never matches `checkpoint-N`, so a half-written save is never resumed from


# ---------------------------------------------------------------------------------------------------------------
# Model kinds
# ---------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelKind:
    config_class: str  # attribute of `archlab`
    auto_class: Any  # the Auto class that builds the pretraining head
    model_class: str  # attribute of `archlab`
    max_positions_field: str = "max_position_embeddings"


MODEL_KINDS: dict[str, ModelKind] = {
    "decoder": ModelKind("DecoderConfig", AutoModelForCausalLM, "DecoderForCausalLM"),
    "seq2seq": ModelKind("Seq2SeqConfig", AutoModelForSeq2SeqLM, "Seq2SeqForConditionalGeneration"),
    "masked_lm": ModelKind("Seq2SeqConfig", AutoModelForMaskedLM, "EncoderForMaskedLM"),
}
CLASSIFICATION_AUTO_CLASS = AutoModelForSequenceClassification

# The model the README's one command trains when no preset or config is given: ~2.4M parameters (with a 4096-token
# vocabulary) of LLaMA recipe -- pre-RMSNorm, RoPE, GQA, SwiGLU -- that learns visible Python in a few CPU minutes
# (about 30 GFLOP per step of 8 x 256 tokens).
DEFAULT_ARCHITECTURES: dict[str, dict[str, Any]] = {
    "decoder": dict(
        hidden_size=192,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    ),
    "seq2seq": dict(d_model=256, encoder_layers=3, decoder_layers=3, encoder_attention_heads=4,
                    decoder_attention_heads=4, encoder_ffn_dim=1024, decoder_ffn_dim=1024,
                    max_position_embeddings=512),
    "masked_lm": dict(d_model=256, encoder_layers=4, decoder_layers=1, encoder_attention_heads=4,
                      decoder_attention_heads=4, encoder_ffn_dim=1024, decoder_ffn_dim=1024,
                      max_position_embeddings=512),
}


def model_kind(name: str) -> ModelKind:
    if name not in MODEL_KINDS:
        raise ValueError(f"`--model_kind`={name!r} is not supported; allowed values: {', '.join(MODEL_KINDS)}.")
    kind = MODEL_KINDS[name]
    if not hasattr(archlab, kind.model_class):
        raise ValueError(f"`--model_kind {name}` needs `archlab.{kind.model_class}`, which this install lacks.")
    return kind


# ---------------------------------------------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class ModelArguments:
    model_kind: str = field(default="decoder", metadata={"help": "decoder | seq2seq | masked_lm"})
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "A saved model to start from; otherwise a new one is built from the config."}
    )
    preset: str | None = field(default=None, metadata={
        "help": "A named decoder shape: tiny, small, llama-2-7b, mistral-7b, ... (see `archlab.configuration."
                "list_presets()`; a wrong name lists them all)."
    })
    config_name: str | None = field(default=None, metadata={"help": "A config JSON file (or folder) to build from."})
    config_overrides: str | None = field(
        default=None, metadata={"help": 'Config fields to override: "hidden_size=128,num_hidden_layers=2"; values are '
                                        "read as JSON when they parse, so lists and objects work: "
                                        """'layer_types=["sliding_attention","full_attention"]'."""}
    )
    tokenizer_name: str | None = field(
        default=None, metadata={"help": "A saved tokenizer to use; without it one is trained on the training split."}
    )
    tokenizer_algorithm: str | None = field(
        default=None, metadata={"help": "bpe | wordpiece | unigram; unset: bpe, or wordpiece for masked_lm."}
    )
    tokenizer_vocab_size: int | None = field(default=None, metadata={"help": "Vocabulary size to train; unset: 4096."})
    tokenizer_train_samples: int | None = field(
        default=None, metadata={"help": "Train the tokenizer on at most this many training documents."}
    )
    cache_dir: str | None = field(default=None, metadata={"help": "Where `datasets` caches downloads and maps."})
    attn_implementation: str | None = field(default=None, metadata={"help": "eager | sdpa | ..."})


@dataclass
class DataArguments:
    dataset_name: str | None = field(default=None, metadata={"help": "A Hub dataset (needs network)."})
    dataset_config_name: str | None = field(default=None, metadata={"help": "The Hub dataset's configuration."})
    train_file: str | None = field(default=None, metadata={"help": "Local txt/json/jsonl/csv/parquet training file."})
    validation_file: str | None = field(default=None, metadata={"help": "Local validation file (same format)."})
    text_column_name: str = field(default="text", metadata={"help": "The column holding the text."})
    validation_split_percentage: int = field(
        default=5, metadata={"help": "Percentage of train held out when the source has no validation split."}
    )
    sample_by: str = field(default="document", metadata={"help": "For .txt files: document | paragraph | line."})
    max_train_samples: int | None = field(default=None, metadata={"help": "Use at most this many training documents."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Use at most this many validation documents."})
    block_size: int = field(default=256, metadata={"help": "Tokens per packed training block."})
    preprocessing_num_workers: int | None = field(default=None, metadata={"help": "Processes for `datasets.map`."})
    overwrite_cache: bool = field(default=False, metadata={"help": "Recompute the cached tokenized datasets."})
    streaming: bool = field(default=False, metadata={"help": "Stream the data (needs --max_steps)."})


@dataclass
class ArchlabTrainingArguments(TrainingArguments):
    """`TrainingArguments` plus `--overwrite_output_dir` (the transformers 4 flag): start over in a folder that
    already holds checkpoints. The scripts subclass this to set their own defaults."""

    overwrite_output_dir: bool = field(
        default=False, metadata={"help": "Start over in an --output_dir that holds checkpoints (they are deleted) or "
                                         "a finished model (it is replaced)."}
    )


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Each flag's default, and the script's docstring as written (its example commands keep their lines)."""


def parse_arguments(classes: Sequence[type], argv: Sequence[str] | None, description: str | None = None) -> tuple:
    """`HfArgumentParser`: flags, or a single .json file holding them (as in transformers' examples); `description`
    (the script's docstring) heads `--help`."""
    parser = HfArgumentParser(tuple(classes), description=description, formatter_class=HelpFormatter)
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if len(argv) == 1 and argv[0].endswith(".json"):
            return parser.parse_json_file(json_file=os.path.abspath(argv[0]))
        return parser.parse_args_into_dataclasses(args=argv)
    except ValueError as error:  # TrainingArguments' own checks of flag values, made while the flags are parsed
        raise ValueError(str(error)) from error


def run_cli(main: Callable[[], object]) -> None:
    """Command-line entry of the training and generation scripts. An error that archlab itself raises about the
    input (a bad flag, a missing file, a config field out of range: ValueError / FileNotFoundError whose message
    names what to change) prints one `error: ...` line and exits with 2, as argparse does for a bad flag; errors
    raised inside other libraries keep their traceback, which is what a bug report needs."""
    try:
        main()
    except (ValueError, FileNotFoundError) as error:
        frame = error.__traceback__
        while frame is not None and frame.tb_next is not None:
            frame = frame.tb_next
        origin = frame.tb_frame.f_globals.get("__name__", "") if frame is not None else ""
        if not (origin == "__main__" or origin.startswith("archlab")):
            raise
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None


# ---------------------------------------------------------------------------------------------------------------
# Checks that run before anything is written
# ---------------------------------------------------------------------------------------------------------------
def check_data_flags(data_args: DataArguments, training_args: TrainingArguments) -> None:
    if data_args.dataset_name and (data_args.train_file or data_args.validation_file):
        raise ValueError("Conflicting flags: --dataset_name and --train_file/--validation_file; pass one source.")
    if data_args.validation_file and not data_args.train_file:
        raise ValueError("--validation_file needs --train_file.")
    for path in (data_args.train_file, data_args.validation_file):
        if path and not os.path.isfile(path):
            raise FileNotFoundError(f"Data file {path!r} does not exist.")
    if data_args.streaming and training_args.max_steps <= 0:
        raise ValueError("--streaming needs --max_steps: a streamed dataset has no length to count epochs by.")
    if data_args.block_size < 2:
        raise ValueError(f"--block_size must be at least 2, got {data_args.block_size}.")
    check_choice(data_args, "sample_by", SAMPLE_BY)
    check_positive(data_args, ("max_train_samples", "max_eval_samples"), " (or unset: all)")


def check_training_flags(args: TrainingArguments) -> None:
    """`TrainingArguments` values the Trainer would misuse without a word (--max_steps 0 trains one step and -5 a
    whole epoch; --save_steps 0 never saves) or reject only once training starts, after the data is prepared."""
    if args.max_steps == 0 or args.max_steps < -1:
        raise ValueError(f"--max_steps must be >= 1, or -1 (unset: train --num_train_epochs epochs), got "
                         f"{args.max_steps}.")
    if args.max_steps == -1 and not args.num_train_epochs > 0:
        raise ValueError(f"--num_train_epochs must be > 0 when --max_steps is -1, got {args.num_train_epochs}.")
    if not args.learning_rate > 0:
        raise ValueError(f"--learning_rate must be > 0, got {args.learning_rate}.")
    check_positive(args, ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps"))
    for kind in ("logging", "eval", "save"):
        steps = getattr(args, f"{kind}_steps")
        if getattr(args, f"{kind}_strategy") == "steps" and steps is not None and not steps > 0:
            raise ValueError(f"--{kind}_steps must be > 0 with --{kind}_strategy steps (a number of steps, or a "
                             f"fraction < 1 of the run's steps), got {steps}.")


def check_choice(args: Any, name: str, allowed: Sequence[str]) -> None:
    """`--name` is unset or one of `allowed`, else a ValueError naming the flag and the allowed values."""
    value = getattr(args, name)
    if value is not None and value not in allowed:
        raise ValueError(f"--{name} {value!r} is not supported; allowed values: {', '.join(allowed)}.")


def check_positive(args: Any, names: Sequence[str], unset: str = "") -> None:
    """Each `--name` is unset or >= 1, else a ValueError naming the flag (`unset` says what leaving it out means)."""
    for name in names:
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name} must be >= 1{unset}, got {value}.")


def check_model_flags(model_args: ModelArguments) -> None:
    sources = [f"--{name}" for name in ("model_name_or_path", "preset", "config_name") if getattr(model_args, name)]
    if len(sources) > 1:
        raise ValueError(f"Conflicting flags: {' and '.join(sources)}; pass at most one model source.")
    if model_args.model_name_or_path and model_args.config_overrides:
        raise ValueError("Conflicting flags: --config_overrides cannot change a pretrained --model_name_or_path.")
    check_override_names(model_args)
    check_choice(model_args, "tokenizer_algorithm", TOKENIZER_ALGORITHMS)
    check_positive(model_args, ("tokenizer_vocab_size", "tokenizer_train_samples"))
    specials = len(TOKENIZER_KINDS[model_args.model_kind].special_tokens)
    if model_args.tokenizer_vocab_size is not None and model_args.tokenizer_vocab_size <= specials:
        raise ValueError(f"--tokenizer_vocab_size must exceed the {specials} special tokens of a "
                         f"{model_args.model_kind} tokenizer, got {model_args.tokenizer_vocab_size}.")
    trained = [name for name in ("tokenizer_algorithm", "tokenizer_vocab_size", "tokenizer_train_samples")
               if getattr(model_args, name) is not None]
    if trained and (model_args.tokenizer_name or model_args.model_name_or_path):
        raise ValueError(
            f"Conflicting flags: --{', --'.join(trained)} configure tokenizer training, but a tokenizer is loaded "
            "(--tokenizer_name / --model_name_or_path)."
        )
    for name in ("model_name_or_path", "tokenizer_name", "config_name"):
        path = getattr(model_args, name)
        if path and (path.startswith((".", "/", "~")) or os.path.splitext(path)[1] == ".json"):
            if not os.path.exists(os.path.expanduser(path)):
                raise FileNotFoundError(f"--{name} {path!r} does not exist.")
    if model_args.model_name_or_path and os.path.isdir(model_args.model_name_or_path):
        check_weights(model_args.model_name_or_path, "--model_name_or_path")
    check_new_config(model_args)


def check_weights(folder: str, flag: str) -> None:
    """Each `*.safetensors` file of a model folder opens (its header is whole and its data as long as the header
    says), else a ValueError naming the file: loading a truncated or empty file fails deep inside transformers."""
    for path in sorted(Path(folder).glob("*.safetensors")):
        try:
            with safe_open(path, framework="pt"):
                pass
        except (SafetensorError, OSError) as error:
            raise ValueError(f"{flag} {folder!r}: {path} is damaged or not a safetensors file ({error}); save or "
                             "download it again.") from None


def check_override_names(model_args: ModelArguments) -> None:
    """Refuse --config_overrides keys the config class does not know: a config stores any unknown keyword as an
    attribute, so a typo ("num_hidden_layer=2") would otherwise train the default shape without a word."""
    overrides = parse_overrides(model_args.config_overrides)
    if not overrides:
        return
    config_class = getattr(archlab, model_kind(model_args.model_kind).config_class)
    default = config_class()
    unknown = []
    for key, value in overrides.items():
        if hasattr(default, key):
            continue
        try:  # keys the config consumes and rewrites (`rope_theta` -> `rope_parameters`) are not stored as given
            if key not in config_class(**{key: value}).to_dict():
                continue
        except Exception:  # noqa: BLE001  (a value the config rejects: the full build reports it with context)
            continue
        unknown.append(key)
    if unknown:
        fields = sorted(set(default.to_dict()) | set(config_class.attribute_map))
        named = [f"{key!r}" + "".join(f" (did you mean {m!r}?)" for m in difflib.get_close_matches(key, fields, n=1))
                 for key in unknown]
        raise ValueError(f"--config_overrides: {config_class.__name__} has no field {', '.join(named)}; "
                         "docs/catalogue.md lists the fields.")


def resolve_resume(training_args: TrainingArguments, overwrite_output_dir: bool) -> str | None:
    """The checkpoint to resume from (`--resume_from_checkpoint PATH`, or `true`/`last` for the newest one), after
    refusing to train over an output folder that already holds checkpoints unless told to."""
    output_dir = training_args.output_dir
    requested = training_args.resume_from_checkpoint
    last = get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None
    finished_model = os.path.isfile(os.path.join(output_dir, "config.json"))  # the final save writes it last
    if requested is None or str(requested).lower() in ("false", "no", "none", ""):
        if last is not None and not overwrite_output_dir:
            raise ValueError(
                f"--output_dir {output_dir!r} already holds {os.path.basename(last)}: pass --resume_from_checkpoint "
                "true to continue it, --overwrite_output_dir to start over, or another --output_dir."
            )
        if finished_model and not overwrite_output_dir:
            raise ValueError(f"--output_dir {output_dir!r} already holds a finished model: pass --overwrite_output_dir "
                             "true to train it again from scratch, or another --output_dir.")
        return None
    if overwrite_output_dir:
        raise ValueError("Conflicting flags: --resume_from_checkpoint and --overwrite_output_dir.")
    if str(requested).lower() in ("true", "yes", "last"):
        if last is None:
            holds = " holds a finished model but" if finished_model else ""
            raise FileNotFoundError(f"--resume_from_checkpoint: {output_dir!r}{holds} has no checkpoint-N folder to "
                                    "resume from.")
        return last
    if not os.path.isfile(os.path.join(requested, "trainer_state.json")):
        raise FileNotFoundError(f"--resume_from_checkpoint {requested!r} is not a complete checkpoint folder.")
    return requested


def finished_run(resume: str | None, training_args: TrainingArguments) -> dict[str, float] | None:
    """When `resume` is a checkpoint at the end of the run these flags ask for (--max_steps, or the same
    --num_train_epochs) and --output_dir holds that step's final model: say so and return its saved results, so a
    resume changes nothing. None otherwise (a finished checkpoint without its final model is loaded and saved as the
    final model by `AtomicCheckpointTrainer.train`, which knows the exact length of an epoch-based run)."""
    if resume is None:
        return None
    with open(os.path.join(resume, "trainer_state.json"), encoding="utf-8") as f:
        state = json.load(f)
    step = state.get("global_step", 0)
    if training_args.max_steps > 0:
        end, of = training_args.max_steps, f"--max_steps {training_args.max_steps}"
    elif state.get("num_train_epochs") == training_args.num_train_epochs:
        end, of = state.get("max_steps", 0), f"--num_train_epochs {training_args.num_train_epochs:g}"
    else:
        return None
    if not 0 < end <= step:
        return None
    output_dir, name = training_args.output_dir, os.path.basename(os.path.normpath(resume))
    final_state = os.path.join(output_dir, "trainer_state.json")
    saved = os.path.isfile(os.path.join(output_dir, "config.json")) and os.path.isfile(final_state)
    if saved:
        with open(final_state, encoding="utf-8") as f:
            saved = json.load(f).get("global_step") == step
    if not saved:
        log(f"{name} is at step {step} of {of}: the run is finished but its final model is not saved in "
            f"{output_dir}; saving it without training.")
        return None
    log(f"{name} is at step {step} of {of}: the run is finished and its model is saved in {output_dir}; nothing to "
        "do (a larger --max_steps trains on).")
    results = os.path.join(output_dir, "all_results.json")
    if not os.path.isfile(results):
        return {}
    with open(results, encoding="utf-8") as f:
        return json.load(f)


def checkpoint_tokenizer(model_args: ModelArguments, resume: str | None) -> Any | None:
    """When resuming a run that trained its own tokenizer: the one saved in the checkpoint (training another would
    repeat that work and need not give the vocabulary the weights were trained with); else None."""
    if resume is None or model_args.tokenizer_name or model_args.model_name_or_path or not has_tokenizer(resume):
        return None
    log(f"Using the tokenizer saved in {resume}")
    return load_tokenizer(resume)


def clear_output_dir(output_dir: str) -> None:
    """For --overwrite_output_dir: remove earlier checkpoints and staging folders (never other files)."""
    if not os.path.isdir(output_dir):
        return
    for entry in os.listdir(output_dir):
        if entry.startswith(("checkpoint-", STAGING)):
            shutil.rmtree(os.path.join(output_dir, entry), ignore_errors=True)


# ---------------------------------------------------------------------------------------------------------------
# Configs
# ---------------------------------------------------------------------------------------------------------------
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


def preset_values(name: str, kind: str) -> dict[str, Any]:
    """The config fields of a named decoder preset (`archlab.configuration.presets`)."""
    from archlab.configuration.presets import preset_kwargs

    if kind != "decoder":
        raise ValueError(f"Conflicting flags: --preset names decoder shapes; --model_kind {kind} takes --config_name.")
    return preset_kwargs(name)


def new_config_values(model_args: ModelArguments) -> tuple[dict[str, Any], dict[str, Any], set[str]]:
    """The fields of a new model's config before the tokenizer fills in its vocabulary and special ids: the preset,
    JSON or default architecture with the overrides; also the overrides and every field the user set."""
    if model_args.preset:
        values = preset_values(model_args.preset, model_args.model_kind)
        values.pop("vocab_size", None)  # a preset is a shape: the vocabulary is the tokenizer's
    elif model_args.config_name:
        path = model_args.config_name
        path = os.path.join(path, "config.json") if os.path.isdir(path) else path
        with open(path, encoding="utf-8") as f:
            values = json.load(f)
        for key in ("model_type", "architectures", "transformers_version", "auto_map"):
            values.pop(key, None)
    else:
        values = dict(DEFAULT_ARCHITECTURES[model_args.model_kind])
    overrides = parse_overrides(model_args.config_overrides)
    user_set = set(overrides) | (set(values) if model_args.config_name else set())
    values.update(overrides)
    return values, overrides, user_set


def check_new_config(model_args: ModelArguments) -> None:
    """Build a new model's config once with a stand-in vocabulary, so a field out of range fails now, before a
    tokenizer is trained or data is read (the real config gets the tokenizer's vocabulary and ids later)."""
    if model_args.model_name_or_path:
        return
    values, _, user_set = new_config_values(model_args)
    if "vocab_size" not in user_set:
        values["vocab_size"] = 1 << 16
    getattr(archlab, model_kind(model_args.model_kind).config_class)(**values)


def build_config(model_args: ModelArguments, tokenizer: Any, block_size: int | None, num_labels: int | None = None):
    """The model config: pretrained, preset, JSON or the default architecture, plus overrides; the vocabulary and
    special-token ids come from the tokenizer unless the user set them. Fails on a tokenizer that does not fit."""
    kind = model_kind(model_args.model_kind)
    if model_args.model_name_or_path:
        try:
            config = AutoConfig.from_pretrained(model_args.model_name_or_path)
        except OSError as error:
            raise OSError(f"--model_name_or_path {model_args.model_name_or_path!r} is neither a local folder nor "
                          f"loadable from the Hub ({error})") from error
    else:
        values, overrides, user_set = new_config_values(model_args)
        if "vocab_size" not in user_set:
            values["vocab_size"] = len(tokenizer)
        for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
            token_id = getattr(tokenizer, name, None)
            if name not in overrides and token_id is not None:
                values[name] = token_id
        if model_args.model_kind == "seq2seq" and "decoder_start_token_id" not in overrides:
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


# ---------------------------------------------------------------------------------------------------------------
# Trainer and saving
# ---------------------------------------------------------------------------------------------------------------
class LogAtSave(TrainerCallback):
    """Log the training loss at every save, so that a checkpoint's log history covers each step up to it and a resumed
    run can report the mean loss of the whole run."""

    def on_step_end(self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any) -> Any:
        if control.should_save and args.logging_strategy != "no":
            control.should_log = True
        return control

    on_epoch_end = on_step_end


def whole_run_train_loss(
    log_history: list[dict[str, Any]], resumed_at: int, end: int, mean_since: float
) -> float | None:
    """The mean training loss over steps 1..`end` of a run resumed at step `resumed_at`: each loss logged up to the
    resume (the mean over the steps since the log before it) weighted by its steps, plus `mean_since` for the
    resumed steps. None when the logged losses stop short of `resumed_at` (steps whose loss was never logged)."""
    total, logged = 0.0, 0
    for entry in log_history:
        step = entry.get("step", 0)
        if "loss" in entry and logged < step <= resumed_at:
            total += entry["loss"] * (step - logged)
            logged = step
    if logged != resumed_at or end <= 0:
        return None
    return (total + mean_since * (end - resumed_at)) / end


class AtomicCheckpointTrainer(Trainer):
    """A `Trainer` whose `checkpoint-N` folders are complete or absent: each is written under `.staging/` and
    renamed into place, so a run killed mid-save resumes from the previous complete checkpoint. Resuming from a
    checkpoint at the run's last step trains nothing more, a resumed run's `train_loss` is the whole run's, and
    `train()` trains one model under data parallelism even after an `evaluate()` (see `_forget_evaluation_only_preparation`)."""

    _staging_dir: str | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.add_callback(LogAtSave)

    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs: Any) -> TrainOutput:
        self._forget_evaluation_only_preparation()
        if not isinstance(resume_from_checkpoint, str):
            return super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)
        start = TrainerState.load_from_json(os.path.join(resume_from_checkpoint, "trainer_state.json"))
        max_steps = self.args.max_steps
        if max_steps <= 0:
            max_steps = self.set_initial_training_values(self.args, self.get_train_dataloader())[-1]
        if start.global_step >= max_steps:
            # The Trainer checks for the end of the run only after a step, so it would train one step past it.
            self._load_from_checkpoint(resume_from_checkpoint)
            self.state = start
            mean = whole_run_train_loss(start.log_history, start.global_step, start.global_step, 0.0)
            metrics = {"epoch": start.epoch, "total_flos": start.total_flos}
            return TrainOutput(start.global_step, mean, metrics if mean is None else {**metrics, "train_loss": mean})
        output = super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)
        # The Trainer's train_loss averages the steps this call ran; report the whole run's where the log allows.
        mean = whole_run_train_loss(self.state.log_history, start.global_step, output.global_step, output.training_loss)
        summary = next((entry for entry in reversed(self.state.log_history) if "train_loss" in entry), {})
        for metrics in (output.metrics, summary):
            if mean is None:
                metrics["train_loss_since_resume"] = metrics.pop("train_loss", output.training_loss)
            else:
                metrics["train_loss"] = mean
        if mean is None:
            log(f"train_loss_since_resume: the mean loss of the steps after {resume_from_checkpoint} only; the "
                "checkpoint's log does not cover every step before it.")
        return TrainOutput(output.global_step, output.training_loss if mean is None else mean, output.metrics)

    def _forget_evaluation_only_preparation(self) -> None:
        """Undo an evaluation-only preparation of the model, so `train()` wraps it for data parallelism.

        In transformers 5.23 with accelerate 1.15, `evaluate()` before the first `train()` prepares the model with
        `accelerator.prepare_model(model, evaluation_mode=True)`: no DistributedDataParallel wrapper, but the model
        is marked `_is_accelerate_prepared`, so the `accelerator.prepare` of the training that follows returns it
        unwrapped. Every process then trains its own replica on its own shard of the data, with no error. Undoing
        that mark (and the evaluation's mixed-precision forward wrapper) lets `train()` wrap the model as usual.
        Sharded engines (FSDP, DeepSpeed) fully prepare the model for evaluation and are left alone.
        """
        model = self.model
        if (
            self.args.parallel_mode != ParallelMode.DISTRIBUTED
            or self.is_fsdp_enabled
            or self.is_deepspeed_enabled
            or isinstance(self.model_wrapped, torch.nn.parallel.DistributedDataParallel)
        ):
            return
        candidates = (model,) if self.model_wrapped is model else (model, self.model_wrapped)
        prepared = [m for m in candidates if getattr(m, "_is_accelerate_prepared", False)]
        if not prepared:
            return
        for module in prepared:
            del module._is_accelerate_prepared
        self.accelerator._models[:] = [m for m in self.accelerator._models if all(m is not p for p in prepared)]
        original = model.__dict__.pop("_original_forward", None)  # set with the evaluation's autocast wrapper
        if original is not None:  # training adds its own wrapper
            if getattr(original, "__func__", None) is type(model).forward:
                model.__dict__.pop("forward", None)
            else:
                model.forward = original
        self.model_wrapped = model

    def _get_output_dir(self, trial: Any) -> str:
        return self._staging_dir or super()._get_output_dir(trial)

    def _save_checkpoint(self, model: torch.nn.Module, trial: Any) -> None:
        run_dir = super()._get_output_dir(trial)
        staging = os.path.join(run_dir, STAGING)
        shutil.rmtree(staging, ignore_errors=True)
        self._staging_dir = staging
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self._staging_dir = None
        name = f"checkpoint-{self.state.global_step}"
        final = os.path.join(run_dir, name)
        if os.path.isdir(final):
            shutil.rmtree(final)
        os.replace(os.path.join(staging, name), final)
        shutil.rmtree(staging, ignore_errors=True)
        if self.state.best_model_checkpoint and STAGING in self.state.best_model_checkpoint:
            self.state.best_model_checkpoint = self.state.best_model_checkpoint.replace(
                os.path.join(STAGING, ""), ""
            )
        if self.args.should_save:
            rotate_checkpoints(run_dir, self.args.save_total_limit, self.state.best_model_checkpoint, use_mtime=True)

    def _issue_warnings_after_load(self, load_result: Any) -> None:
        """A checkpoint stores a tied head once, under the embedding's name; the head then loads with the embedding
        and is not missing (the Trainer would report `lm_head.weight` as missing from every such checkpoint)."""
        state = self.model.state_dict(keep_vars=True)
        loaded = {state[key].data_ptr() for key in state if key not in load_result.missing_keys}
        missing = [key for key in load_result.missing_keys if key not in state or state[key].data_ptr() not in loaded]
        super()._issue_warnings_after_load(load_result._replace(missing_keys=missing))


class _FirstEvaluation(TrainerCallback):
    """Keeps the metrics of the first evaluation it sees and hands them to `report` at once."""

    def __init__(self, report: Callable[[dict[str, float]], None]) -> None:
        self.report = report
        self.metrics: dict[str, float] | None = None

    def on_evaluate(self, args: Any, state: Any, control: Any, metrics: dict[str, float] | None = None, **kwargs):
        if self.metrics is None:
            self.metrics = dict(metrics or {})
            self.report(self.metrics)


def train_evaluating_at_start(
    trainer: Trainer, resume: str | None, report: Callable[[dict[str, float]], None]
) -> tuple[dict[str, float], Any]:
    """`trainer.train(resume_from_checkpoint=resume)` with an evaluation at its start (`eval_on_start`); `report`
    gets that evaluation's metrics as soon as they exist. Returns (metrics at the start, the `TrainOutput`).

    Evaluating inside `train()` rather than calling `trainer.evaluate()` first means the model is evaluated after it
    is prepared for training (wrapped in DistributedDataParallel under torchrun / accelerate launch; see
    `AtomicCheckpointTrainer.train` for what the other order does), and a resumed run reports the checkpoint it
    starts from, not the model as built before loading it."""
    trainer.args.eval_on_start = True
    first = _FirstEvaluation(report)
    trainer.add_callback(first)
    try:
        result = trainer.train(resume_from_checkpoint=resume)
    finally:
        trainer.remove_callback(first)
    if first.metrics is None:  # train() took no step (a finished checkpoint being finalised): nothing to wrap
        first.metrics = trainer.evaluate()
        first.report(first.metrics)
    return first.metrics, result


def with_perplexity(metrics: dict[str, float], prefix: str = "eval") -> dict[str, float]:
    loss = metrics.get(f"{prefix}_loss")
    if loss is not None:
        metrics[f"{prefix}_perplexity"] = math.exp(min(loss, 50.0))
    return metrics


def plot_loss_curve(log_history: list[dict[str, Any]], path: str | Path) -> bool:
    """Training (and evaluation) loss against the step, as a PNG; False when there is nothing to draw."""
    train = [(e["step"], e["loss"]) for e in log_history if "loss" in e and "step" in e]
    evals = [(e["step"], e["eval_loss"]) for e in log_history if "eval_loss" in e and "step" in e]
    if not train and not evals:
        return False
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed (pip install 'archlab[scripts]'): no loss-curve PNG.")
        return False

    figure, axis = plt.subplots(figsize=(6, 3.5))
    if train:
        axis.plot(*zip(*train), label="training loss")
    if evals:
        axis.plot(*zip(*evals), "o-", label="validation loss")
    axis.set_xlabel("step")
    axis.set_ylabel("cross-entropy (nats/token)")
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100, metadata={"Software": None})
    plt.close(figure)
    return True


def save_final(
    trainer: Trainer,
    tokenizer: Any,
    output_dir: str,
    metrics: dict[str, float] | None = None,
    datasets: list[str] | None = None,
    base_model: str | None = None,
    pipeline_tag: str | None = None,
) -> None:
    """Model, tokenizer, trainer state, loss curve and model card -- written to a staging folder, then moved into
    `output_dir` file by file with `config.json` last, so a folder that has a config has everything.
    Under torchrun / accelerate launch only the main process writes; the others wait for it."""
    if not trainer.args.should_save:
        trainer.accelerator.wait_for_everyone()
        return
    staging = os.path.join(output_dir, STAGING + "-final")
    shutil.rmtree(staging, ignore_errors=True)
    model = trainer.model
    model.config.use_cache = True  # the Trainer turns the cache off for training; generation wants it
    model.save_pretrained(staging)
    save_tokenizer(tokenizer, staging)
    trainer.state.save_to_json(os.path.join(staging, "trainer_state.json"))
    with open(os.path.join(staging, "training_args.json"), "w", encoding="utf-8") as f:
        f.write(trainer.args.to_json_string())
    if metrics:
        with open(os.path.join(staging, "all_results.json"), "w", encoding="utf-8") as f:
            json.dump(metrics, f, indent=2, sort_keys=True)
    has_curve = plot_loss_curve(trainer.state.log_history, os.path.join(staging, LOSS_CURVE))
    write_card(staging, metrics, datasets, base_model, os.path.join(staging, LOSS_CURVE) if has_curve else None,
               pipeline_tag)
    entries = sorted(os.listdir(staging), key=lambda name: name == "config.json")
    for entry in entries:
        target = os.path.join(output_dir, entry)
        if os.path.isdir(target):
            shutil.rmtree(target)
        os.replace(os.path.join(staging, entry), target)
    os.rmdir(staging)
    trainer.accelerator.wait_for_everyone()


def write_card(
    folder: str, metrics: dict[str, float] | None, datasets: list[str] | None, base_model: str | None,
    loss_curve: str | None,
    pipeline_tag: str | None = None,
) -> None:
    """The model card (README.md), rendered by archlab.model_cards (`pipeline_tag`: None for the class's default)."""
    from archlab.model_cards import write_model_card

    eval_results = {k[len("eval_"):]: v for k, v in (metrics or {}).items() if k.startswith("eval_")}
    write_model_card(
        folder,
        datasets=datasets,
        base_model=base_model,
        eval_results={k: v for k, v in eval_results.items() if k in ("loss", "perplexity", "accuracy", "f1",
                                                                     "bleu", "chrf", "exact_match")} or None,
        loss_curve=loss_curve,
        pipeline_tag=pipeline_tag,
    )


def dataset_label(data_args: DataArguments) -> str:
    if data_args.dataset_name:
        return data_args.dataset_name
    if data_args.train_file:
        return os.path.basename(data_args.train_file)
    return "python-stdlib-source"


def log(message: str) -> None:
    print(f"[archlab] {message}", flush=True)
