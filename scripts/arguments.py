"""What the pretrain / finetune / generate scripts share as argument parsing: the argument dataclasses (Hugging
Face flag names, as in transformers' `examples/pytorch/*/run_*.py`), parsing, the one-line command-line errors, and
the checks of flag values that run before anything is written."""

from __future__ import annotations

import argparse
import difflib
import importlib.util
import json
import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from transformers import HfArgumentParser, TrainingArguments
from transformers.hf_argparser import string_to_bool
from transformers.utils import is_torch_bf16_gpu_available

from archlab.tokenization.data import SAMPLE_BY
from archlab.tokenization.training import ALGORITHMS as TOKENIZER_ALGORITHMS
from archlab.tokenization.training import MODEL_KINDS as TOKENIZER_KINDS
from archlab.tokenization.training import check_vocab_size
from archlab.training.configs import check_new_config, check_override_names
from archlab.training.dtypes import check_dtype
from archlab.training.reporting import log


# ---------------------------------------------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class ModelArguments:
    model_kind: str = field(default="decoder", metadata={"help": "decoder | seq2seq | masked_lm"})
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "A saved model to start from; otherwise a new one is built from the config."}
    )
    preset: str | None = field(
        default=None,
        metadata={
            "help": "A named decoder shape: tiny, small, llama-2-7b, mistral-7b, ... (see `archlab.configuration."
            "list_presets()`; a wrong name lists them all)."
        },
    )
    config_name: str | None = field(default=None, metadata={"help": "A config JSON file (or folder) to build from."})
    config_overrides: str | None = field(
        default=None,
        metadata={
            "help": 'Config fields to override: "hidden_size=128,num_hidden_layers=2"; values are '
            "read as JSON when they parse, so lists and objects work: "
            """'layer_types=["sliding_attention","full_attention"]'."""
        },
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
    dtype: str | None = field(
        default=None,
        metadata={
            "aliases": ["--torch_dtype"],
            "help": "auto | bfloat16 | float16 | float32: the dtype a saved --model_name_or_path loads in, as "
            "run_clm.py's flag (from_pretrained(dtype=...)); the Trainer updates the weights in it. Default: float32 "
            "(mixed precision is --bf16 / --fp16, autocast over float32 weights). bfloat16: pure bfloat16 training, "
            "no float32 copy (half the memory; an update smaller than ~1/256 of a weight is lost). auto: the folder's "
            "saved dtype (config.json's `dtype`). float16 weights are refused (--fp16's loss scaling needs float32 "
            "weights), and so are bfloat16 weights with --fp16.",
        },
    )

    def __post_init__(self) -> None:
        check_dtype(self.dtype)


@dataclass
class DataArguments:
    dataset_name: str | None = field(
        default=None, metadata={"help": "A Hub dataset (needs network), or a local folder saved by `save_to_disk`."}
    )
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


def on_a_cuda_gpu(use_cpu: bool) -> bool:
    import torch

    return not use_cpu and torch.cuda.is_available()


def bf16_by_default(use_cpu: bool, fp16: bool) -> bool:
    """What the scripts train in when `--bf16` is not given: bf16 mixed precision (autocast over float32 weights,
    what a GPU user would pick) on a CUDA GPU that has bf16 (Ampere or newer), float32 on the CPU or with --fp16."""
    import torch

    return on_a_cuda_gpu(use_cpu) and not fp16 and torch.cuda.is_bf16_supported()


def compile_by_default(use_cpu: bool, deepspeed, fsdp) -> bool:
    """Whether the scripts compile the model (regionally) when `--torch_compile` is not given: on a CUDA GPU that
    Triton supports (what inductor generates its kernels with), where one compiled decoder block measured 1.46x the
    eager step (dense 1.1B on an H100, docs/gpu.md); not under DeepSpeed or FSDP, whose wrapping is left as the user
    set it up; never on the CPU, where the gain measured (1.09x, README) does not pay for the compile in the short
    runs a CPU trains."""
    if not on_a_cuda_gpu(use_cpu) or deepspeed or fsdp:
        return False
    from torch.utils._triton import has_triton

    return has_triton()


@dataclass
class ArchlabTrainingArguments(TrainingArguments):
    """`TrainingArguments` plus `--overwrite_output_dir` (the transformers 4 flag): start over in a folder that
    already holds checkpoints; `--bf16`, `--dataloader_pin_memory` and `--torch_compile` on by default where a CUDA
    GPU supports them; `--torch_compile` compiles regionally (`--regional_compilation`). The scripts subclass this
    to set their own defaults."""

    overwrite_output_dir: bool = field(
        default=False,
        metadata={
            "help": "Start over in an --output_dir that holds checkpoints (they are deleted) or "
            "a finished model (it is replaced)."
        },
    )
    do_train: bool | None = field(
        default=None,
        metadata={
            "help": "The scripts always train (transformers' example scripts train only with --do_train): unset or "
            "true; false is refused."
        },
    )
    do_eval: bool | None = field(
        default=None,
        metadata={
            "help": "The scripts evaluate the validation split before and after training, and every --eval_steps "
            "under --eval_strategy steps; --do_eval without --do_train (the example scripts' evaluation alone) is "
            "refused."
        },
    )
    do_predict: bool = field(
        default=False,
        metadata={
            "help": "Refused: this script has no test split to predict; it evaluates the validation split before "
            "and after training (predict with the saved folder: `pipeline(...)` or scripts/generate.py)."
        },
    )
    resume_from_checkpoint: str | None = field(
        default=None,
        metadata={
            "help": "true: go on from the newest checkpoint in --output_dir; or a checkpoint folder. Refused, before "
            "any data is read, with another --block_size, number of examples per optimizer step, tokenizer or "
            "architecture than the checkpoint's, and from a checkpoint saved with --save_only_model."
        },
    )
    bf16: bool | None = field(
        default=None,
        metadata={
            "help": "bf16 mixed precision (autocast over float32 weights). Default: on when training on a CUDA GPU "
            "with bf16 support (Ampere or newer), off on the CPU or with --fp16; --bf16 false turns it off."
        },
    )

    dataloader_pin_memory: bool | None = field(
        default=None,
        metadata={
            "help": "Pin the batches' host memory (faster copies to a GPU). Default: on when training on a CUDA "
            "GPU, off on the CPU, where it only costs memory."
        },
    )
    torch_compile: bool | None = field(
        default=None,
        metadata={
            "help": "Compile the model with torch.compile (regionally: see --regional_compilation). Default: on when "
            "training on a CUDA GPU that Triton supports, without DeepSpeed or FSDP; off on the CPU; "
            "--torch_compile false turns it off."
        },
    )
    regional_compilation: bool = field(
        default=True,
        metadata={
            "help": "With --torch_compile: compile the repeated decoder block once and reuse it for every layer "
            "(accelerate's regional compilation: a cold start of one block, not the whole model); false compiles "
            "the whole model as one graph."
        },
    )

    def __post_init__(self) -> None:
        # transformers' example scripts train only under --do_train: with --do_eval alone they evaluate the model as it
        # is, and --do_train false skips training; these scripts trained either way, without a word
        if self.do_train is False:
            raise ValueError(
                "--do_train false: this script always trains (and evaluates before and after); leave the flag out."
            )
        if self.do_eval and self.do_train is None:
            raise ValueError(
                "--do_eval without --do_train: transformers' example scripts would evaluate the model alone, and this "
                "script always trains (evaluating the validation split before and after): add --do_train to train."
            )
        self.do_train = True
        self.do_eval = bool(self.do_eval)  # (TrainingArguments turns it on under an --eval_strategy other than no)
        if self.bf16 is None:
            self.bf16 = bf16_by_default(self.use_cpu, self.fp16)
        elif self.bf16 and not self.use_cpu and not is_torch_bf16_gpu_available():
            # (TrainingArguments' own message names neither flag as the command line spells it)
            raise ValueError(
                "--bf16 true needs a GPU with bf16 support, and this machine has none: add --use_cpu true for bf16 "
                "autocast on the CPU, or leave --bf16 out."
            )
        if self.dataloader_pin_memory is None:
            self.dataloader_pin_memory = on_a_cuda_gpu(self.use_cpu)
        if self.torch_compile is None:
            explicit = self.torch_compile_backend is not None or self.torch_compile_mode is not None
            self.torch_compile = explicit or compile_by_default(self.use_cpu, self.deepspeed, self.fsdp)
        super().__post_init__()
        if self.torch_compile:  # Trainer's TorchDynamoPlugin reads this when it is built, as it reads the backend
            os.environ["ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION"] = str(self.regional_compilation).lower()


# "(default: ...)", "Default: on when ...", "unset: 4096": a help text that says what the flag does when it is left out
STATES_ITS_DEFAULT = re.compile(r"\b(default|unset):", re.IGNORECASE)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Each flag's default, and the script's docstring as written (its example commands keep their lines). A help
    text that says its own default (a default decided later, such as `(default: true; false with --num_beams)`)
    keeps its words, not a second `(default: None)`."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.help and STATES_ITS_DEFAULT.search(action.help):
            return action.help
        return super()._get_help_string(action)


# transformers 4 flags that transformers 5's TrainingArguments no longer has, and what takes their place (run_clm.py
# commands written for transformers 4 pass them; difflib finds no close name for most).
TRANSFORMERS_4_FLAGS = {
    "group_by_length": "--train_sampling_strategy group_by_length",
    "evaluation_strategy": "--eval_strategy",
    "no_cuda": "--use_cpu",
    "save_safetensors": "nothing: checkpoints are always safetensors",
}

# The `ModelArguments` / `DataTrainingArguments` flags of transformers' example scripts (run_clm.py, run_mlm.py,
# run_glue.py, run_classification.py, run_ner.py, run_qa.py, run_translation.py) that neither training script has,
# and what to pass instead: a command written for those scripts failed on "Unknown flags" that named no alternative,
# or (--token, a prefix of --tokenizer_name and three more) exited with argparse's usage and "ambiguous option".
EXAMPLE_MODEL_FLAGS = {
    "model_type": "a new model is archlab's own architecture: --model_kind decoder | seq2seq | masked_lm with "
    "--preset, --config_name or --config_overrides; a stock family's saved folder loads with --model_name_or_path",
    "token": "leave it out: log in once (`hf auth login`) or set HF_TOKEN, which the Hub downloads use",
    "use_auth_token": "leave it out: log in once (`hf auth login`) or set HF_TOKEN, which the Hub downloads use",
    "model_revision": "download that revision first (`hf download NAME --revision REV --local-dir DIR`) and pass "
    "--model_name_or_path DIR",
    "trust_remote_code": "leave it out: archlab's models and transformers' own families load without it; a model "
    "that needs its own code (auto_map) cannot be trained by this script",
    "low_cpu_mem_usage": "leave it out: transformers 5 always loads the weights without a first random copy",
    "use_fast_tokenizer": "leave it out: transformers 5 loads the fast (tokenizers) tokenizer, the only kind archlab "
    "saves",
    "keep_linebreaks": "leave it out: a .txt file is read as whole documents, line breaks kept (--sample_by "
    "paragraph | line splits it)",
}


def check_unknown_flags(
    parser: argparse.ArgumentParser, unknown: Sequence[str], example_flags: Mapping[str, str] | None = None
) -> None:
    """A flag no argument group knows is a ValueError naming it and the closest known flags, or what replaced it
    (`TRANSFORMERS_4_FLAGS`), or, for a flag of transformers' example scripts, what to pass instead (`example_flags`:
    the script's own table)."""
    if not unknown:
        return
    named = [word.split("=", 1)[0] for word in unknown if word.startswith("-")]
    if not named:
        raise ValueError(f"Unexpected arguments {list(unknown)}: every value follows its --flag.")
    names = sorted({option[2:].replace("-", "_") for action in parser._actions for option in action.option_strings})
    hints = []
    for flag in named:
        name = flag.lstrip("-").replace("-", "_")
        example = (example_flags or {}).get(name)
        if example is not None:
            hints.append(f"{flag} (a flag of transformers' example scripts; here: {example})")
            continue
        replaced = TRANSFORMERS_4_FLAGS.get(name)
        if replaced is not None:
            hints.append(f"{flag} (a transformers 4 flag; in transformers 5: {replaced})")
            continue
        close = difflib.get_close_matches(name, names, n=2, cutoff=0.75)
        hints.append(f"{flag} (did you mean {' or '.join('--' + name for name in close)}?)" if close else flag)
    raise ValueError(f"Unknown flags: {'; '.join(hints)}. `--help` lists every flag.")


def parse_arguments(
    classes: Sequence[type],
    argv: Sequence[str] | None,
    description: str | None = None,
    example_flags: Mapping[str, str] | None = None,
) -> tuple:
    """`HfArgumentParser`: flags, or a single .json file holding them (as in transformers' examples); `description`
    (the script's docstring) heads `--help`; `example_flags`: the flags of transformers' example scripts the script
    does without, each with what to pass instead (`check_unknown_flags`). A flag is never read as a prefix of a longer
    one (argparse's abbreviations): run_clm.py's --token was "ambiguous" among the --tokenizer_* flags, and a flag of
    another script that is the prefix of exactly one would have set that one without a word."""
    parser = HfArgumentParser(
        tuple(classes), description=description, formatter_class=HelpFormatter, allow_abbrev=False
    )
    for action in parser._actions:
        # a boolean flag whose default is None ("decided later": --bf16, --tf32) takes a bare `--flag` as true, as
        # every other boolean flag does; HfArgumentParser would demand a value
        if action.type is string_to_bool and action.nargs is None and action.option_strings:
            action.nargs, action.const = "?", True
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if len(argv) == 1 and argv[0].endswith(".json"):
            return parser.parse_dict(json_flags(parser, argv[0]))
        check_aliases_agree(parser, argv)
        *parsed, unknown = parser.parse_args_into_dataclasses(args=argv, return_remaining_strings=True)
        check_unknown_flags(parser, unknown, example_flags)
        return tuple(parsed)
    except ValueError as error:  # TrainingArguments' own checks of flag values, made while the flags are parsed
        raise ValueError(str(error)) from error


def alias_names(parser: HfArgumentParser) -> dict[str, str]:
    """The other names of flags (a field's `aliases`: run_clm.py's `torch_dtype` for `dtype`), each with the name of
    the field it sets."""
    names = {}
    for arguments in parser.dataclass_types:
        for item in fields(arguments):
            aliases = item.metadata.get("aliases") or []
            for alias in [aliases] if isinstance(aliases, str) else aliases:
                if alias.startswith("--"):
                    names[alias[2:]] = item.name
    return names


def check_aliases_agree(parser: HfArgumentParser, argv: Sequence[str]) -> None:
    """A flag given under two of its names (`--dtype bfloat16 --torch_dtype float32`) with other values is refused
    naming both: argparse let the last one win without a word. (transformers' `from_pretrained(dtype=...,
    torch_dtype=...)` keeps `dtype` silently; the same value twice is accepted.)"""
    aliased = set(alias_names(parser).values())
    names = {  # every spelling of a flag that has another name, with the field it sets
        option[2:]: action.dest
        for action in parser._actions
        if action.dest in aliased
        for option in action.option_strings
        if option.startswith("--")
    }
    given: dict[str, dict[str, str]] = {}  # field -> {flag as given: its value}
    for k, word in enumerate(argv):
        flag, has_value, value = word.partition("=")
        dest = names.get(flag[2:]) if flag.startswith("--") else None
        if dest is None:
            continue
        if not has_value:
            value = argv[k + 1] if k + 1 < len(argv) else ""
        given.setdefault(dest, {})[flag] = value
    for dest, values in given.items():
        if len(values) > 1 and len(set(values.values())) > 1:
            flags = " and ".join(f"{flag} {value}" for flag, value in values.items())
            raise ValueError(f"Conflicting flags: {flags} (names of one flag, --{dest}): give one.")


def json_flags(parser: HfArgumentParser, path: str) -> dict[str, Any]:
    """A .json file of flags as `HfArgumentParser.parse_dict` takes it: a key that is another name of a flag
    (`"torch_dtype"`, as `--torch_dtype` on the command line) is read as the flag's field; it was refused as a key
    the parser does not use. The field and its other name with other values are refused naming both."""
    with open(path, encoding="utf-8") as f:
        flags = json.load(f)
    if not isinstance(flags, dict):
        return flags
    for alias, dest in alias_names(parser).items():
        if alias not in flags:
            continue
        value = flags.pop(alias)
        if dest in flags and flags[dest] != value:
            raise ValueError(
                f"Conflicting flags in {path}: {dest!r} {flags[dest]!r} and {alias!r} {value!r} (names of one flag, "
                f"--{dest}): give one."
            )
        flags[dest] = value
    return flags


def given_flags(argv: Sequence[str] | None) -> set[str]:
    """The flags a command line gives, as field names (`--max_seq_length 384`, `--max-seq-length=384`:
    `max_seq_length`), or the keys of its one .json file of flags: a flag given with its default value is given all
    the same, where comparing the parsed value with the default cannot tell."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) == 1 and argv[0].endswith(".json"):
        with open(argv[0], encoding="utf-8") as f:
            return set(json.load(f))
    return {word[2:].split("=", 1)[0].replace("-", "_") for word in argv if word.startswith("--")}


def run_cli(main: Callable[[], object]) -> None:
    """Command-line entry of the training and generation scripts. An error that archlab itself raises about the
    input (a bad flag, a missing file, a config field out of range: ValueError / FileNotFoundError whose message
    names what to change) prints one `error: ...` line and exits with 2, as argparse does for a bad flag; errors
    raised inside other libraries keep their traceback, which is what a bug report needs."""
    try:
        main()
    except (ValueError, OSError) as error:  # OSError: a model or tokenizer neither local nor on a reachable Hub
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
    check_not_empty(data_args, ("dataset_name", "dataset_config_name", "train_file", "validation_file"))
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
    check_flag_choice(data_args, "sample_by", SAMPLE_BY)
    check_flag_positive(data_args, ("max_train_samples", "max_eval_samples"), " (or unset: all)")
    workers = data_args.preprocessing_num_workers
    if workers is not None and workers < 0:
        # (datasets refused it with a traceback once the data was read)
        raise ValueError(
            f"--preprocessing_num_workers must be >= 0 (0 or unset: the main process alone), got {workers}."
        )


def check_training_flags(args: TrainingArguments, predicts: bool = False) -> None:
    """`TrainingArguments` values the Trainer would misuse without a word (--max_steps 0 trains one step and -5 a
    whole epoch; --save_steps 0 never saves) or reject only once training starts, after the data is prepared.
    `predicts`: the script predicts a test split under --do_predict (the others refuse the flag)."""
    check_not_empty(args, ("output_dir", "resume_from_checkpoint"))
    if args.max_steps == 0 or args.max_steps < -1:
        raise ValueError(
            f"--max_steps must be >= 1, or -1 (unset: train --num_train_epochs epochs), got {args.max_steps}."
        )
    if args.max_steps == -1 and not args.num_train_epochs > 0:
        raise ValueError(f"--num_train_epochs must be > 0 when --max_steps is -1, got {args.num_train_epochs}.")
    if not args.learning_rate > 0:
        raise ValueError(f"--learning_rate must be > 0, got {args.learning_rate}.")
    check_flag_positive(
        args, ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps")
    )
    for kind in ("logging", "eval", "save"):
        steps = getattr(args, f"{kind}_steps")
        if getattr(args, f"{kind}_strategy") == "steps" and steps is not None and not steps > 0:
            raise ValueError(
                f"--{kind}_steps must be > 0 with --{kind}_strategy steps (a number of steps, or a "
                f"fraction < 1 of the run's steps), got {steps}."
            )
    check_seed(args.seed, "--seed")
    if args.data_seed is not None:
        check_seed(args.data_seed, "--data_seed")
    if args.dataloader_num_workers < 0:  # torch's DataLoader refused it when training started, after data and model
        raise ValueError(
            f"--dataloader_num_workers must be >= 0 (0: batches are loaded in the main process), got "
            f"{args.dataloader_num_workers}."
        )
    if not 0 <= args.label_smoothing_factor < 1:  # a factor > 1 weighs the labels' own log-likelihood negatively
        raise ValueError(
            f"--label_smoothing_factor must be in [0, 1) (0: no smoothing), got {args.label_smoothing_factor:g}."
        )
    check_report_to(args.report_to)
    if args.fp16 and args.device.type == "cpu":
        # accelerate turns fp16 autocast on for GPUs only: on the CPU the run would train in float32 while the
        # scripts' "Training on the CPU: fp16 autocast" line and the saved training_args say fp16
        raise ValueError(
            "--fp16 runs only on a GPU (accelerate has no fp16 autocast on the CPU, so the run would silently train in "
            "float32): leave it out, or use --bf16 true --use_cpu true for bf16 autocast on the CPU."
        )
    if args.do_predict and not predicts:
        # transformers' example scripts predict a --test_file under --do_predict; here it was accepted and ignored
        raise ValueError(
            "--do_predict: this script has no test split to predict; it evaluates the validation split before and "
            "after training (scripts/finetune.py predicts a --test_file). Predict with the saved folder: "
            "`pipeline(...)` or scripts/generate.py."
        )
    if args.use_liger_kernel:
        check_liger_can_run(args)
    fsdp = bool(args.fsdp) or os.environ.get("ACCELERATE_USE_FSDP", "false").lower() in ("1", "true")
    if fsdp and args.device.type == "cpu":
        # accelerate builds its FSDP plugin on accelerator devices only: the run would be plain data parallelism,
        # every process holding the whole model, while the flags and the saved training_args say FSDP
        raise ValueError(
            "FSDP (--fsdp or an accelerate FSDP config) shards the model across GPUs; on the CPU accelerate runs "
            "plain data parallelism instead. Leave it out on the CPU (torchrun / accelerate launch alone train data "
            "parallel), or run on GPUs."
        )
    check_lr_scheduler(args)
    warn_about_a_warmup_longer_than_the_run(args)


# what every evaluation reports besides a task's own metrics (the Trainer's speed counters)
TRAINER_EVAL_METRICS = ("loss", "runtime", "samples_per_second", "steps_per_second")


def check_metric_for_best_model(args: TrainingArguments, metrics: Sequence[str], evaluated: str) -> None:
    """--metric_for_best_model names a metric the evaluations report (`metrics`: the task's own, beside the loss;
    `evaluated` names whose evaluations), with or without the `eval_` prefix, as the Trainer reads it; else a
    ValueError naming the ones they report. The Trainer raised a KeyError at the first evaluation that compared
    checkpoints, after the data was prepared and the first steps trained."""
    metric = args.metric_for_best_model
    if metric is None:
        return
    reported = [*TRAINER_EVAL_METRICS, *metrics]
    if metric.removeprefix("eval_") not in reported:
        raise ValueError(
            f"--metric_for_best_model {metric}: {evaluated} evaluations report {', '.join(reported)} (with or "
            "without the eval_ prefix)."
        )


def check_seed(seed: int, flag: str) -> None:
    """A seed numpy takes (`set_seed` seeds numpy too): a negative one failed with numpy's traceback."""
    if not 0 <= seed < 2**32:
        raise ValueError(f"{flag} must be in [0, 2**32 - 1] (numpy's seeds), got {seed}.")


def check_report_to(report_to: Sequence[str] | None) -> None:
    """--report_to names integrations transformers knows ("all" and "none" are resolved by now): an unknown one failed
    inside the Trainer's constructor, after the tokenizer was trained and the data prepared."""
    from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK

    unknown = [name for name in report_to or () if name not in INTEGRATION_TO_CALLBACK]
    if unknown:
        raise ValueError(
            f"--report_to {', '.join(map(repr, unknown))} is not supported; allowed values: all, none, "
            f"{', '.join(INTEGRATION_TO_CALLBACK)}."
        )


def check_lr_scheduler(args: TrainingArguments) -> None:
    """--lr_scheduler_type with its --lr_scheduler_kwargs builds a schedule, else a ValueError naming both flags: a
    schedule that needs arguments of its own (warmup_stable_decay's `num_decay_steps`, cosine_with_min_lr's `min_lr`
    or `min_lr_rate`) or a misspelled one failed with a TypeError from inside transformers when training started,
    after the tokenizer was trained and the data prepared. The schedule is built as the Trainer builds it, over a
    stand-in optimizer (an epoch-based run's length is not known yet: 100 steps stand in for it)."""
    from transformers.optimization import get_scheduler

    steps = args.max_steps if args.max_steps > 0 else 100
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=args.learning_rate)
    try:
        get_scheduler(
            args.lr_scheduler_type,
            optimizer=optimizer,
            num_warmup_steps=args.get_warmup_steps(steps),
            num_training_steps=steps,
            scheduler_specific_kwargs=args.lr_scheduler_kwargs,
        )
    except (TypeError, ValueError) as error:
        kind = getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)
        raise ValueError(
            f"--lr_scheduler_type {kind} with --lr_scheduler_kwargs {json.dumps(args.lr_scheduler_kwargs or {})}: "
            f"{error}. Pass the schedule's own arguments as JSON, e.g. --lr_scheduler_kwargs "
            """'{"num_decay_steps": 100}' for warmup_stable_decay or '{"min_lr_rate": 0.1}' for cosine_with_min_lr."""
        ) from None


def warn_about_a_warmup_longer_than_the_run(args: TrainingArguments) -> None:
    """A warm-up of as many steps as --max_steps or more never reaches the peak learning rate (the scripts' default
    warm-up under a short --max_steps, most often): one line says so; the run goes on."""
    warmup = args.warmup_steps
    if args.max_steps > 0 and warmup >= 1 and warmup >= args.max_steps:
        log(
            f"Warning: --warmup_steps {warmup:g} >= --max_steps {args.max_steps}: the learning rate never reaches "
            f"--learning_rate {args.learning_rate:g}. Lower --warmup_steps (or give a fraction < 1 of the run)."
        )


def check_liger_can_run(args: TrainingArguments) -> None:
    """--use_liger_kernel needs liger-kernel and a GPU for its Triton kernels; the Trainer would find out only when
    training starts (TRITON_INTERPRET=1, Triton's CPU interpreter, is let through: the tests run the kernels so)."""
    if importlib.util.find_spec("liger_kernel") is None:
        raise ValueError(
            "--use_liger_kernel needs liger-kernel: `pip install liger-kernel` (or archlab's `liger` extra) on a "
            "machine with a GPU."
        )
    if (args.use_cpu or not torch.accelerator.is_available()) and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            "--use_liger_kernel runs Liger's Triton kernels, which need a GPU, and this run is on the CPU: leave the "
            "flag out (archlab's chunked LM loss already keeps the logits out of memory on the CPU)."
        )


def check_flag_choice(args: Any, name: str, allowed: Sequence[str]) -> None:
    """`--name` is unset or one of `allowed`, else a ValueError naming the flag and the allowed values."""
    value = getattr(args, name)
    if value is not None and value not in allowed:
        raise ValueError(f"--{name} {value!r} is not supported; allowed values: {', '.join(allowed)}.")


def check_not_empty(args: Any, names: Sequence[str]) -> None:
    """Each `--name` is unset or a non-empty string: `--train_file "$FILE"` with FILE unset trained on the embedded
    corpus, and `--tokenizer_name ""` trained a new tokenizer, without a word."""
    for name in names:
        if getattr(args, name) == "":
            raise ValueError(f"--{name} is an empty string: give a value, or leave the flag out.")


def check_flag_positive(args: Any, names: Sequence[str], unset: str = "") -> None:
    """Each `--name` is unset or >= 1, else a ValueError naming the flag (`unset` says what leaving it out means)."""
    for name in names:
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name} must be >= 1{unset}, got {value}.")


def check_model_flags(model_args: ModelArguments, block_size: int | None = None) -> None:
    """Every model flag, before anything is read; `block_size` (pretraining's) is checked against a new model's
    positions."""
    check_not_empty(model_args, ("model_name_or_path", "preset", "config_name", "tokenizer_name", "cache_dir"))
    sources = [f"--{name}" for name in ("model_name_or_path", "preset", "config_name") if getattr(model_args, name)]
    if len(sources) > 1:
        raise ValueError(f"Conflicting flags: {' and '.join(sources)}; pass at most one model source.")
    if model_args.model_name_or_path and model_args.config_overrides:
        raise ValueError("Conflicting flags: --config_overrides cannot change a pretrained --model_name_or_path.")
    check_override_names(model_args)
    check_flag_choice(model_args, "tokenizer_algorithm", TOKENIZER_ALGORITHMS)
    check_flag_positive(model_args, ("tokenizer_vocab_size", "tokenizer_train_samples"))
    if model_args.tokenizer_vocab_size is not None:
        kind = model_args.model_kind
        algorithm = model_args.tokenizer_algorithm or TOKENIZER_KINDS[kind].default_algorithm
        check_vocab_size(model_args.tokenizer_vocab_size, kind, algorithm, "--tokenizer_vocab_size")
    trained = [
        name
        for name in ("tokenizer_algorithm", "tokenizer_vocab_size", "tokenizer_train_samples")
        if getattr(model_args, name) is not None
    ]
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
        check_model_folder(model_args.model_name_or_path, "--model_name_or_path")
        check_weights(model_args.model_name_or_path, "--model_name_or_path")
    if model_args.cache_dir and os.path.isfile(model_args.cache_dir):
        raise ValueError(f"--cache_dir {model_args.cache_dir!r} is a file, not a folder: pass another --cache_dir.")
    check_attention_implementation(model_args.attn_implementation)
    check_new_config(model_args, block_size)


def check_attention_implementation(name: str | None) -> None:
    """transformers' registered attention functions ("eager", "sdpa", "flex_attention", "flash_attention_2", ...) or
    a kernel on the Hub ("org/repo"); an unknown name failed inside `set_attn_implementation`, after the tokenizer was
    trained and the data prepared."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    allowed = ["eager", *sorted(key for key in ALL_ATTENTION_FUNCTIONS.valid_keys() if "|" not in key)]
    if name is not None and name not in allowed and "/" not in name:
        raise ValueError(
            f"--attn_implementation {name!r} is not supported; allowed values: {', '.join(allowed)}, or a Hub "
            "kernel as 'org/repo'."
        )


# archlab's model classes that have no decoder stack, though their config is the encoder-decoder's
ENCODER_ONLY_CLASSES = {
    "EncoderForMaskedLM",
    "EncoderModel",
    "EncoderForSequenceClassification",
    "EncoderForTokenClassification",
    "EncoderForQuestionAnswering",
}


def check_pretrained_model_kind(model_args: ModelArguments, auto_class: Any, trains: str) -> None:
    """A local `--model_name_or_path` folder holds a model `auto_class` can build (`trains` names the flag that chose
    it), else a ValueError naming both: a decoder folder given to `--task seq2seq` failed inside transformers with
    a list of every stock config class."""
    folder = model_args.model_name_or_path
    if not folder or not os.path.isfile(os.path.join(folder, "config.json")):
        return
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(folder)
    except Exception:  # an unreadable config is reported where the model is loaded, with its own message
        return
    encoder_only = sorted(set(config.architectures or ()) & ENCODER_ONLY_CLASSES)
    heads = ("Classification", "QuestionAnswering")  # the encoder's fine-tuning heads
    if type(config) in auto_class._model_mapping:
        if encoder_only and auto_class.__name__ == "AutoModelForSeq2SeqLM":
            # (archlab's masked LM shares Seq2SeqConfig with the encoder-decoder, so the config type lets it through)
            raise ValueError(
                f"--model_name_or_path {folder!r} holds an encoder-only `{encoder_only[0]}`, and {trains} trains an "
                "encoder-decoder: its whole decoder would start from random weights. Pass a seq2seq folder, or "
                "leave out --model_name_or_path to train a new model."
            )
        if encoder_only or config.model_type != "archlab_seq2seq" or not auto_class.__name__.endswith(heads):
            return
        # an encoder-decoder's folder given to a classifier: the encoder heads take masked LMs' (BERT's) encoders;
        # fine-tuning an encoder-decoder's encoder alone would drop its decoder without a word
    saved = f", saved as {config.architectures[0]}" if config.architectures else ""
    encoder_heads = config.model_type == "archlab_seq2seq" and auto_class.__name__.endswith(heads)
    raise ValueError(
        f"--model_name_or_path {folder!r} holds a model of type `{config.model_type}` "
        f"({type(config).__name__}{saved}), which {trains} cannot train: it needs a model {auto_class.__name__} builds"
        + (" (for an archlab_seq2seq config: a masked LM's encoder)" if encoder_heads else "")
        + ". Pass such a folder, or leave out --model_name_or_path to train a new model."
    )


def check_model_folder(folder: str, flag: str) -> None:
    """A local model folder holds a config.json, else an error that says what it holds instead: a PEFT adapter
    (adapter_config.json) or a tokenizer alone failed inside transformers' AutoConfig ("Unrecognized model"), after
    the data was read."""
    if os.path.isfile(os.path.join(folder, "config.json")):
        return
    if os.path.isfile(os.path.join(folder, "adapter_config.json")):
        raise ValueError(
            f"{flag} {folder!r} holds a PEFT adapter (adapter_config.json), not a whole model: merge it into its base "
            "model first (`PeftModel.from_pretrained(base, folder).merge_and_unload().save_pretrained(...)`) and pass "
            "that folder."
        )
    raise FileNotFoundError(f"{flag} {folder!r} holds no saved model (config.json).")


def check_weights(folder: str, flag: str) -> None:
    """Each `*.safetensors` file of a model folder opens (its header is whole and its data as long as the header
    says), else a ValueError naming the file: loading a truncated or empty file fails deep inside transformers."""
    for path in sorted(Path(folder).glob("*.safetensors")):
        try:
            with safe_open(path, framework="pt"):
                pass
        except (SafetensorError, OSError) as error:
            raise ValueError(
                f"{flag} {folder!r}: {path} is damaged or not a safetensors file ({error}); save or download it again."
            ) from None
