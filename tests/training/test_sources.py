"""training/sources.py: the raw splits of a run, and which process tokenizes them first."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from types import SimpleNamespace

from datasets import Dataset, DatasetDict, load_dataset

from archlab.training.sources import first_process_writes_the_cache


def recording_args(entered: list[str]) -> SimpleNamespace:
    @contextlib.contextmanager
    def main_process_first(desc: str = "work"):
        entered.append(desc)
        yield

    return SimpleNamespace(main_process_first=main_process_first)


def test_splits_read_from_cache_files_are_tokenized_by_the_first_process_first(tmp_path: Path) -> None:
    """Every process of a data-parallel run tokenized every split at once, writing the same cache files; as in
    transformers' example scripts, the first process now writes them and the others load them."""
    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"text": f"row {i}"}) + "\n" for i in range(8)))
    from_files = load_dataset("json", data_files={"train": str(tmp_path / "train.jsonl")}, cache_dir=str(tmp_path))
    from_files["validation"] = from_files["train"].select(range(2))
    entered: list[str] = []
    with first_process_writes_the_cache(recording_args(entered), from_files):
        pass
    assert entered == ["tokenizing"]


def test_splits_in_memory_have_no_cache_to_share_and_no_process_waits() -> None:
    """The embedded corpus is built in memory: the others would wait only to tokenize it all again."""
    in_memory = DatasetDict(
        {"train": Dataset.from_dict({"text": ["a"]}), "validation": Dataset.from_dict({"text": ["b"]})}
    )
    entered: list[str] = []
    with first_process_writes_the_cache(recording_args(entered), in_memory):
        pass
    assert entered == []
