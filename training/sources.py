"""The raw train and validation splits of a run: from the Hub, local files or the embedded corpus, limited to the
sizes asked for and checked for text before anything is tokenized."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Protocol

from datasets import DatasetDict

from archlab.tokenization.data import (
    check_columns,
    check_not_empty,
    check_text_columns,
    limit,
    load_file_split,
    load_raw_datasets,
)

SPLITS = ("train", "validation")


class DataChoices(Protocol):
    """The scripts' `DataArguments`, or any object with these attributes."""

    dataset_name: str | None
    dataset_config_name: str | None
    train_file: str | None
    validation_file: str | None
    validation_split_percentage: int
    sample_by: str
    streaming: bool
    text_column_name: str
    max_train_samples: int | None
    max_eval_samples: int | None


class TestChoices(Protocol):
    """The finetune script's test-split flags (`FinetuneArguments`), or any object with these attributes."""

    test_file: str | None
    max_predict_samples: int | None


def _limit(raw: Any, data: DataChoices) -> Any:
    raw["train"] = limit(raw["train"], data.max_train_samples)
    raw["validation"] = limit(raw["validation"], data.max_eval_samples)
    return raw


def load_documents(data: DataChoices, cache_dir: str | None, seed: int) -> Any:
    """Pretraining documents: each split limited (a shuffled slice of the training set, not its first files),
    non-empty and holding the text column."""
    raw = load_raw_datasets(
        data.dataset_name,
        data.dataset_config_name,
        data.train_file,
        data.validation_file,
        data.validation_split_percentage,
        data.streaming,
        cache_dir,
        data.sample_by,
        seed,
    )
    if data.max_train_samples is not None and not data.streaming:
        raw["train"] = raw["train"].shuffle(seed=seed)  # a slice of all of it, not of a-m
    raw = _limit(raw, data)
    for split in SPLITS:
        check_not_empty(raw[split], split)
        check_columns(raw[split], data.text_column_name, split=split, flags=["--text_column_name"])
        check_text_columns(raw[split], data.text_column_name, split=split)
    return raw


def load_examples(
    data: DataChoices,
    cache_dir: str | None,
    seed: int,
    default: Callable[[int | None, int | None], Any],
    test: TestChoices | None = None,
) -> Any:
    """Fine-tuning examples, in memory: the user's data set or files, else `default(max_train, max_eval)` (a task's
    embedded-corpus examples); each split limited to the sizes asked for. With `test` (the run predicts) a `test`
    split too: `test.test_file`, else the data set's own; other splits are dropped (a Hub data set's test split was
    tokenized with the others, and GLUE's unlabeled one, labels -1, failed as unknown labels)."""
    if data.dataset_name or data.train_file:
        raw = load_raw_datasets(
            data.dataset_name,
            data.dataset_config_name,
            data.train_file,
            data.validation_file,
            data.validation_split_percentage,
            cache_dir=cache_dir,
            seed=seed,
        )
    else:
        raw = default(data.max_train_samples, data.max_eval_samples)
    kept = DatasetDict({split: raw[split] for split in SPLITS})
    if test is not None:
        if test.test_file:
            kept["test"] = load_file_split(test.test_file, "test", data.train_file, cache_dir)
        elif "test" in raw:
            kept["test"] = raw["test"]
        else:
            where = f"--dataset_name {data.dataset_name!r} has the splits {list(raw)}" if data.dataset_name else ""
            raise ValueError(
                "--do_predict predicts a test split: pass --test_file (same format as the training file)"
                + (f"; {where}, none named 'test'." if where else ".")
            )
        kept["test"] = limit(kept["test"], test.max_predict_samples)
    return _limit(kept, data)


def first_process_writes_the_cache(training_args: Any, raw: Any) -> contextlib.AbstractContextManager:
    """Where the splits are read from `datasets` cache files, `training_args.main_process_first()`: the first process
    tokenizes and writes the cached results, the others then load them (as transformers' example scripts do), instead
    of every process tokenizing every split at once. In-memory and streamed splits have no cache to share, and each
    process goes on at once."""
    if all(getattr(raw[split], "cache_files", None) for split in raw):
        return training_args.main_process_first(desc="tokenizing")
    return contextlib.nullcontext()
