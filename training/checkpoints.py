"""Where a run starts: the checkpoint to resume from (refusing to train over earlier checkpoints or a finished
model unless told to), a finished run that needs nothing more, and clearing an output folder to start over."""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
from typing import Any

from transformers import TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

from archlab.model_cards.facts import RUN_FACTS

from .reporting import log

STAGING = ".staging"  # never matches `checkpoint-N`, so a half-written save is never resumed from
# RUN_FACTS (run_facts.json): what a resume must keep, saved in each checkpoint (`AtomicCheckpointTrainer`) and beside
# the final model (`saving.save_final`), where the model card reads the weights' dtype from it


def resolve_resume(training_args: TrainingArguments, overwrite_output_dir: bool) -> str | None:
    """The checkpoint to resume from (`--resume_from_checkpoint PATH`, or `true`/`last` for the newest one), after
    refusing to train over an output folder that already holds checkpoints unless told to."""
    output_dir = training_args.output_dir
    requested = training_args.resume_from_checkpoint
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise ValueError(f"--output_dir {output_dir!r} is a file, not a folder: pass another --output_dir.")
    last = get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None
    finished_model = os.path.isfile(os.path.join(output_dir, "config.json"))  # the final save writes it last
    if requested is None or str(requested).lower() in ("false", "no", "none", ""):
        if last is not None and not overwrite_output_dir:
            raise ValueError(
                f"--output_dir {output_dir!r} already holds {os.path.basename(last)}: pass --resume_from_checkpoint "
                "true to continue it, --overwrite_output_dir to start over, or another --output_dir."
            )
        if finished_model and not overwrite_output_dir:
            raise ValueError(
                f"--output_dir {output_dir!r} already holds a finished model: pass --overwrite_output_dir "
                "true to train it again from scratch, or another --output_dir."
            )
        return None
    if overwrite_output_dir:
        raise ValueError("Conflicting flags: --resume_from_checkpoint and --overwrite_output_dir.")
    if str(requested).lower() in ("true", "yes", "last"):
        if last is None:
            holds = " holds a finished model but" if finished_model else ""
            raise FileNotFoundError(
                f"--resume_from_checkpoint: {output_dir!r}{holds} has no checkpoint-N folder to resume from."
            )
        return last
    if not os.path.isfile(os.path.join(requested, "trainer_state.json")):
        raise FileNotFoundError(f"--resume_from_checkpoint {requested!r} is not a complete checkpoint folder.")
    return requested


def run_facts(
    training_args: TrainingArguments,
    block_size: int | None = None,
    source_prefix: str | None = None,
    columns: dict[str, str | None] | None = None,
    weights_dtype: str | None = None,
) -> dict[str, Any]:
    """What a resumed run must keep for its data to go on where the checkpoint stopped: the Trainer skips
    `global_step` x --gradient_accumulation_steps batches of the resumed run's own size, so another number of examples
    per optimizer step skips examples never trained (or trains some twice), and another --block_size (pretraining)
    packs other blocks, of which it skips as many as it trained of the old ones. A seq2seq fine-tuning run's
    --source_prefix (`source_prefix`, "" for none) is kept too: another one trains the rest of the run on other
    inputs than its first steps (and the saved config records one prefix). `columns` are the data columns the run
    reads, by the flag that names each (`{"--source_column": "code", ...}`): others train the rest of the run on
    other texts or labels. `weights_dtype` is the dtype of the weights the Trainer updates (`--dtype`, resolved:
    `dtypes.trained_dtype`): a resume in another one loaded the checkpoint's weights and optimizer state cast to it and
    trained the rest of the run in other precision than its first steps, without a word."""
    facts: dict[str, Any] = {
        "examples_per_step": training_args.per_device_train_batch_size
        * training_args.gradient_accumulation_steps
        * max(1, training_args.world_size)
    }
    if block_size is not None:
        facts["block_size"] = block_size
    if source_prefix is not None:
        facts["source_prefix"] = source_prefix
    if columns is not None:
        facts["columns"] = dict(columns)
    if weights_dtype is not None:
        facts["weights_dtype"] = weights_dtype
    return facts


FACT_FLAGS = {
    "examples_per_step": "--per_device_train_batch_size x --gradient_accumulation_steps x processes",
    "block_size": "--block_size",
    "source_prefix": "--source_prefix",
    "columns": "the data columns",
    "weights_dtype": "--dtype (the weights' dtype)",
}
# what a resume with another value would do, where it is not "skip other data than the checkpoint trained on"
FACT_CONSEQUENCES = {
    "source_prefix": "train the rest of the run on other inputs than the checkpoint was trained on",
    "columns": "train the rest of the run on other columns than the checkpoint was trained on",
    "weights_dtype": "train the rest of the run in another precision than the checkpoint's weights were trained in",
}


def check_resumed_run_facts(resume: str | None, facts: dict[str, Any]) -> None:
    """Refuse, before any data is read, a resume whose flags change one of the checkpoint's `run_facts`: the
    Trainer resumed such a run without a word (another batch size with a warning only), at another place in the
    data than the checkpoint stopped. Checkpoints saved without the facts are not checked."""
    path = os.path.join(resume, RUN_FACTS) if resume else None
    if path is None or not os.path.isfile(path):
        return
    with open(path, encoding="utf-8") as f:
        saved = json.load(f)
    differ = [key for key in facts if key in saved and saved[key] != facts[key]]
    if differ:
        consequences = dict.fromkeys(
            FACT_CONSEQUENCES.get(key, "skip other data than the checkpoint trained on") for key in differ
        )
        raise ValueError(
            f"--resume_from_checkpoint: {resume} was trained with "
            + ", ".join(f"{FACT_FLAGS.get(key, key)} = {fact_text(key, saved[key])}" for key in differ)
            + ", but these flags give "
            + ", ".join(fact_text(key, facts[key]) for key in differ)
            + f": the resumed run would {' and '.join(consequences)}. Resume with the run's own "
            + "values"
            + (
                " (another per-device batch size is fine when --gradient_accumulation_steps keeps the product)"
                if "examples_per_step" in differ
                else ""
            )
            + ", or start a new run in another --output_dir."
        )


def fact_text(key: str, value: Any) -> str:
    """A run fact as a message shows it: a text quoted (a --source_prefix of "" is none), a number as it is."""
    if key == "source_prefix" and not value:
        return "none"
    if isinstance(value, dict):  # the columns, by flag
        return ", ".join(f"{flag} {column!r}" for flag, column in value.items())
    return repr(value) if isinstance(value, str) else str(value)


def run_end(state: dict, training_args: TrainingArguments) -> tuple[int | None, str]:
    """The last step of the run these flags ask for, resumed from a checkpoint whose trainer state is `state`, and the
    flag that says so: --max_steps, or the checkpoint's own length under the same --num_train_epochs. (None, "") when
    the flags give another number of epochs (its length in steps is known once the data is)."""
    if training_args.max_steps > 0:
        return training_args.max_steps, f"--max_steps {training_args.max_steps}"
    if state.get("num_train_epochs") == training_args.num_train_epochs:
        return state.get("max_steps", 0), f"--num_train_epochs {training_args.num_train_epochs:g}"
    return None, ""


def check_training_state(resume: str | None, training_args: TrainingArguments) -> None:
    """Refuse, before any data is read, to train on from a checkpoint saved with --save_only_model: it holds no
    optimizer, learning-rate scheduler or RNG state, and the Trainer resumed from it without a word, with fresh AdamW
    moments and the schedule started over at the checkpoint's step (at the peak learning rate after warm-up, where an
    uninterrupted cosine run had decayed). A checkpoint at the end of the run is let through: nothing trains."""
    if resume is None or glob.glob(os.path.join(resume, "rng_state*.pth")):
        return
    if any(os.path.exists(os.path.join(resume, name)) for name in ("optimizer.pt", "optimizer.bin", "scheduler.pt")):
        return
    with open(os.path.join(resume, "trainer_state.json"), encoding="utf-8") as f:
        state = json.load(f)
    step = state.get("global_step", 0)
    end, _ = run_end(state, training_args)
    if end is not None and 0 < end <= step:
        return
    raise ValueError(
        f"--resume_from_checkpoint: {resume} was saved with --save_only_model and holds the weights alone, without "
        "the optimizer, learning-rate scheduler and RNG state a resumed run goes on from. Start a new run from its "
        f"weights instead (--model_name_or_path {resume}, in another --output_dir), or resume from a checkpoint saved "
        "without --save_only_model."
    )


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
    end, of = run_end(state, training_args)
    if end is None or not 0 < end <= step:
        return None
    output_dir, name = training_args.output_dir, os.path.basename(os.path.normpath(resume))
    final_state = os.path.join(output_dir, "trainer_state.json")
    saved = os.path.isfile(os.path.join(output_dir, "config.json")) and os.path.isfile(final_state)
    if saved:
        with open(final_state, encoding="utf-8") as f:
            saved = json.load(f).get("global_step") == step
    if not saved:
        log(
            f"{name} is at step {step} of {of}: the run is finished but its final model is not saved in "
            f"{output_dir}; saving it without training."
        )
        return None
    log(
        f"{name} is at step {step} of {of}: the run is finished and its model is saved in {output_dir}; nothing to "
        "do (a larger --max_steps trains on)."
    )
    results = os.path.join(output_dir, "all_results.json")
    if not os.path.isfile(results):
        return {}
    with open(results, encoding="utf-8") as f:
        return json.load(f)


# What marks a folder as holding a finished model (`save_final` moves `config.json` in last): an earlier run's must go
# when a run starts over, or a crash of the new run before its own final save leaves the old model looking finished
# (and `finished_run` would then take it for the new run's).
FINISHED_MARKERS = ("config.json", "trainer_state.json")


def clear_output_dir(output_dir: str) -> None:
    """For --overwrite_output_dir: remove earlier checkpoints and staging folders, and the markers of an earlier
    finished model (`FINISHED_MARKERS`; its other files are left, and replaced by the final save)."""
    if not os.path.isdir(output_dir):
        return
    for name in FINISHED_MARKERS:  # config.json first: a folder without it is never taken for a finished model
        path = os.path.join(output_dir, name)
        if os.path.isfile(path):
            # under torchrun / accelerate launch every process clears the folder at the same moment: another one
            # may remove the file between the check and the removal
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
    for entry in os.listdir(output_dir):
        if entry.startswith(("checkpoint-", STAGING)):
            shutil.rmtree(os.path.join(output_dir, entry), ignore_errors=True)
