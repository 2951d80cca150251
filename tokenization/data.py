"""The data pipeline of the scripts: raw text -> tokenized documents -> fixed-size packed blocks (seed 001's
`load_dataset` / `tokenize` / `group_texts` workflow, with document boundaries kept).

Sources (`load_raw_datasets`): a Hub dataset by name (when the network allows), local text/JSON/JSONL/CSV/Parquet
files, or -- when neither is given -- the embedded standard-library corpus (`corpus.py`). A train/validation split
is made when the source has none; `streaming=True` gives `IterableDataset`s for corpora that do not fit in memory.

Packing (`pack_causal_lm`): documents (each `<s> ... </s>`) are concatenated and cut into blocks of `block_size`
tokens. `position_ids` restart at 0 wherever a document (or a piece of one) starts, and the first token of every
piece gets label -100, as Hugging Face's `DataCollatorWithFlattening` does. Without an `attention_mask`, transformers'
`masking_utils` reads the restarts as packed sequences and builds a block-diagonal causal mask, so attention never
crosses documents; positions never exceed `block_size`. The tail of each `map` batch that does not fill a block is
padded with a pad-token segment (its own "document", label -100), so no token is dropped.

The masked LM packs the same way without labels (`causal_labels=False`; its collator masks tokens and makes them):
`EncoderForMaskedLM` reads the restarting `position_ids` as documents and builds a block-diagonal *bidirectional*
mask, so a packed block gives each document's outputs as if it ran alone. `restart_positions=False` keeps no
boundaries (an `attention_mask` that is 0 on the padding only), for objectives that read across documents on
purpose, such as the seq2seq continuation split of `scripts/pretrain.py`.
"""

from __future__ import annotations

import codecs
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from datasets import Dataset, DatasetDict, IterableDataset, IterableDatasetDict, load_dataset, load_from_disk
from datasets.exceptions import DatasetGenerationError

from ..modeling.losses import IGNORE_INDEX  # the label the losses skip
from .corpus import corpus_fingerprint, stdlib_documents

# File extension -> `datasets` builder.
FILE_BUILDERS = {"txt": "text", "text": "text", "json": "json", "jsonl": "json", "csv": "csv", "parquet": "parquet"}
SAMPLE_BY = ("document", "paragraph", "line")

AnyDataset = Dataset | IterableDataset
AnyDatasetDict = DatasetDict | IterableDatasetDict


def _builder_for(path: str) -> str:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"Data file {path!r} does not exist.")
    extension = path.rsplit(".", 1)[-1].lower() if "." in os.path.basename(path) else ""
    if extension not in FILE_BUILDERS:
        raise ValueError(
            f"Data file {path!r}: extension {extension!r} is not supported; allowed: {', '.join(FILE_BUILDERS)}."
        )
    return FILE_BUILDERS[extension]


def embedded_corpus(streaming: bool = False, cache_dir: str | None = None, validation_fraction: float = 0.05):
    """The standard-library corpus as a `DatasetDict` (or `IterableDatasetDict`) with `train`/`validation`."""
    make = IterableDataset.from_generator if streaming else Dataset.from_generator
    splits = {}
    for split in ("train", "validation"):
        kwargs = {"gen_kwargs": {"split": split, "validation_fraction": validation_fraction}}
        if not streaming:
            kwargs["cache_dir"] = cache_dir
            # datasets keys its cache on the generator's name, not on what it yields: key it on the file list
            # instead, so a changed corpus filter or Python version never reuses a stale cached corpus.
            kwargs["fingerprint"] = corpus_fingerprint(split, validation_fraction)
        splits[split] = make(stdlib_documents, **kwargs)
    return (IterableDatasetDict if streaming else DatasetDict)(splits)


def load_raw_datasets(
    dataset_name: str | None = None,
    dataset_config_name: str | None = None,
    train_file: str | None = None,
    validation_file: str | None = None,
    validation_split_percentage: int = 5,
    streaming: bool = False,
    cache_dir: str | None = None,
    sample_by: str = "document",
    seed: int = 42,
) -> AnyDatasetDict:
    """`train` and `validation` splits from the Hub, local files, or (neither given) the embedded corpus, and the
    source's other splits (a `test` split, say) where it has them."""
    if dataset_name and (train_file or validation_file):
        raise ValueError("Pass either `dataset_name` or `train_file`/`validation_file`, not both.")
    if validation_file and not train_file:
        raise ValueError("`validation_file` needs a `train_file`.")
    if not 0 < validation_split_percentage < 100:
        raise ValueError(f"`validation_split_percentage` must be in (0, 100), got {validation_split_percentage}.")
    if sample_by not in SAMPLE_BY:
        raise ValueError(f"`sample_by`={sample_by!r} is not supported; allowed values: {SAMPLE_BY}.")

    if dataset_name and _saved_to_disk(dataset_name):
        if dataset_config_name:
            raise ValueError(
                f"--dataset_config_name {dataset_config_name!r}: {dataset_name!r} is a folder saved by "
                "`save_to_disk`, which has no configurations."
            )
        raw = _load_saved(dataset_name, streaming)
    elif dataset_name:
        try:
            raw = load_dataset(dataset_name, dataset_config_name, cache_dir=cache_dir, streaming=streaming)
        except Exception as error:  # offline, unknown name, ...: say what to do instead
            where = "the local folder" if os.path.isdir(dataset_name) else "the Hub"
            raise ValueError(
                f"Could not load dataset {dataset_name!r} from {where} ({type(error).__name__}: {error}). Without "
                "network access, pass local files with --train_file, or omit both to use the embedded corpus."
            ) from error
    elif train_file:
        files = {"train": train_file}
        if validation_file:
            files["validation"] = validation_file
        builders = {_builder_for(path) for path in files.values()}
        if len(builders) > 1:
            raise ValueError(f"`train_file` and `validation_file` must have the same format, got {sorted(builders)}.")
        builder = builders.pop()
        if builder != "parquet":
            for split, path in files.items():
                if not _has_text(path):
                    raise ValueError(f"The {split} split is empty: {path!r} holds no text.")
        extra = {"sample_by": sample_by} if builder == "text" else {}
        try:
            raw = load_dataset(builder, data_files=files, cache_dir=cache_dir, streaming=streaming, **extra)
        except ValueError as error:
            if not _no_rows(error):
                raise
            alone = _load_each_alone(builder, files, cache_dir, extra)
            split = next((split for split, loaded in alone.items() if loaded is None), "train")
            raise ValueError(f"The {split} split is empty: {files[split]!r} holds no rows.") from error
        except DatasetGenerationError as error:
            if builder != "parquet":
                _check_utf8(files.values())
            alone = _load_each_alone(builder, files, cache_dir, extra)
            for split, loaded in alone.items():
                if loaded is None:  # an empty train CSV beside a validation file fails on its columns' null type
                    raise ValueError(f"The {split} split is empty: {files[split]!r} holds no rows.") from None
            if len(alone) == 2 and all(isinstance(loaded, Dataset) for loaded in alone.values()):
                # each file reads alone: the validation file's values do not fit the columns read from the train file
                raise ValueError(
                    f"The validation file {files['validation']!r} does not fit the columns of the train file "
                    f"{files['train']!r} ({error.__cause__}): train has {dict(alone['train'].features)}, validation "
                    f"{dict(alone['validation'].features)}; give both files the same columns and value types."
                ) from error
            raise
    else:
        return embedded_corpus(streaming=streaming, cache_dir=cache_dir)

    if "train" not in raw:
        raise ValueError(f"The dataset has no 'train' split; it has {list(raw)}.")
    check_not_empty(raw["train"], "train")
    if "validation" not in raw:
        test = {split: raw[split] for split in raw if split == "test"}  # kept for fine-tuning's predictions
        raw = _split_off_validation(raw["train"], validation_split_percentage, streaming, seed)
        raw.update(test)
    return raw


def load_file_split(path: str, split: str, train_file: str | None = None, cache_dir: str | None = None) -> Dataset:
    """One more split from its own file (fine-tuning's --test_file), in the training file's format (as run_glue.py
    asks); loaded alone, so it may lack columns the training file has (a test file without labels)."""
    builder = _builder_for(path)
    if train_file and _builder_for(train_file) != builder:
        raise ValueError(
            f"The {split} file {path!r} is {builder}, the train file {train_file!r} {_builder_for(train_file)}: give "
            "both in the same format."
        )
    if builder != "parquet" and not _has_text(path):
        raise ValueError(f"The {split} split is empty: {path!r} holds no text.")
    try:
        return load_dataset(builder, data_files={split: path}, cache_dir=cache_dir)[split]
    except ValueError as error:
        if _no_rows(error):
            raise ValueError(f"The {split} split is empty: {path!r} holds no rows.") from error
        raise
    except DatasetGenerationError:
        if builder != "parquet":
            _check_utf8([path])
        raise


def _saved_to_disk(path: str) -> bool:
    """Whether `path` is a folder written by `Dataset.save_to_disk` or `DatasetDict.save_to_disk`, which
    `load_dataset` refuses ("use `load_from_disk` instead")."""
    return any(os.path.isfile(os.path.join(path, name)) for name in ("dataset_dict.json", "state.json"))


def _load_saved(path: str, streaming: bool) -> AnyDatasetDict:
    """A `save_to_disk` folder as splits: a saved `DatasetDict` as it is, a saved `Dataset` as the train split;
    streamed, each split is iterated from its Arrow files."""
    saved = load_from_disk(path)
    raw = saved if isinstance(saved, DatasetDict) else DatasetDict({"train": saved})
    if streaming:
        return IterableDatasetDict({split: dataset.to_iterable_dataset() for split, dataset in raw.items()})
    return raw


def _no_rows(error: Exception) -> bool:
    return "corresponds to no data" in str(error)  # `datasets`' words for a split without rows


def _load_each_alone(builder: str, files: dict[str, str], cache_dir: str | None, extra: dict) -> dict[str, Any]:
    """Each file loaded alone, to say which one fails when they fail together: its `Dataset`, None for a file without
    rows (a CSV with only its header, say), or the error. Loaded together, an empty validation file was reported as
    an empty train split, and an empty train file, or a validation file whose values do not fit the train file's
    column types, failed as a bare `DatasetGenerationError`."""
    alone: dict[str, Any] = {}
    for split, path in files.items():
        try:
            alone[split] = load_dataset(builder, data_files={split: path}, cache_dir=cache_dir, **extra)[split]
        except ValueError as error:
            alone[split] = None if _no_rows(error) else error
        except DatasetGenerationError as error:
            alone[split] = error
    return alone


def _has_text(path: str) -> bool:
    """Whether a text file holds anything but whitespace (an empty .txt file would be one empty document)."""
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            if chunk.strip():
                return True
    return False


def _check_utf8(paths: Iterable[str]) -> None:
    """A ValueError naming the first file that is not UTF-8 and the offending byte (`datasets` reports only that
    generating the dataset failed)."""
    for path in paths:
        decoder, offset = codecs.getincrementaldecoder("utf-8")(), 0
        with open(path, "rb") as f:
            while True:
                chunk = f.read(1 << 20)
                pending = len(decoder.getstate()[0])  # bytes of a character cut by the previous chunk
                try:
                    decoder.decode(chunk, final=not chunk)
                except UnicodeDecodeError as error:
                    position = offset - pending + error.start
                    raise ValueError(
                        f"Data file {path!r} is not UTF-8 text: byte {error.object[error.start]:#04x} at offset "
                        f"{position}; convert it to UTF-8 (e.g. `iconv -f latin1 -t utf-8`)."
                    ) from None
                if not chunk:
                    break
                offset += len(chunk)


def _split_off_validation(train: AnyDataset, percentage: int, streaming: bool, seed: int) -> AnyDatasetDict:
    if streaming:
        # An IterableDataset has no length: hold out every (100 // percentage)-th example.
        every = max(2, round(100 / percentage))
        validation = train.filter(lambda _, i: i % every == 0, with_indices=True)
        return IterableDatasetDict(
            {"train": train.filter(lambda _, i: i % every != 0, with_indices=True), "validation": validation}
        )
    if len(train) < 2:
        raise ValueError(
            f"The dataset has {len(train)} example(s): too few to split off a validation set; give a "
            "validation file, or read a .txt file by `sample_by` 'paragraph' or 'line' (by 'document' "
            "it is one example)."
        )
    parts = train.train_test_split(test_size=percentage / 100, seed=seed)
    return DatasetDict({"train": parts["train"], "validation": parts["test"]})


def check_columns(
    dataset: AnyDataset, *columns: str, split: str = "train", flags: Sequence[str | None] | None = None
) -> None:
    """A ValueError naming the missing column, the ones that exist and the flag that names it (`flags`, one per
    column: "--text_column_name", ...; the default column of a flag not given is otherwise a name from nowhere)."""
    names = dataset.column_names
    if names is None and isinstance(dataset, IterableDataset):
        names = list(next(iter(dataset)).keys())
    for column, flag in zip(columns, flags or [None] * len(columns)):
        if column not in names:
            hint = f": name the column with {flag}" if flag else ""
            raise ValueError(f"Column {column!r} not found in the {split} split; its columns are {names}{hint}.")


def check_text_columns(dataset: AnyDataset, *columns: str, split: str = "train") -> None:
    """A ValueError naming a text column that holds something else than strings (numbers, lists) or has empty cells
    (a CSV's empty field, a JSON null): the tokenizer would fail on them deep inside its training or `datasets.map`.
    A streamed dataset whose types are unknown is let through."""
    features = getattr(dataset, "features", None)
    for column in columns:
        feature = features.get(column) if features else None
        if feature is None:
            continue
        if getattr(feature, "dtype", None) not in ("string", "large_string"):
            raise ValueError(
                f"Column {column!r} of the {split} split holds {feature}, not text: name a text column "
                "(--text_column_name and the task's column flags)."
            )
        check_no_empty_cells(dataset, column, split, "null / missing values")


def check_no_empty_cells(dataset: AnyDataset, column: str, split: str, what: str) -> None:
    """A ValueError naming `column` when some rows of this split hold no value there (`what` they are); a streamed
    dataset is let through."""
    # the rows of this split only (a split or a limit is an index over the whole table)
    nulls = 0 if isinstance(dataset, IterableDataset) else dataset.with_format("arrow")[column].null_count
    if nulls:
        raise ValueError(
            f"Column {column!r} of the {split} split has {nulls} empty cell(s) ({what}): fill or drop those rows."
        )


def check_not_empty(dataset: AnyDataset, split: str = "train") -> None:
    if isinstance(dataset, IterableDataset):
        empty = next(iter(dataset), None) is None
    else:
        empty = len(dataset) == 0
    if empty:
        raise ValueError(f"The {split} split is empty.")


def limit(dataset: AnyDataset, max_samples: int | None) -> AnyDataset:
    """The first `max_samples` examples (all when None)."""
    if max_samples is None:
        return dataset
    if isinstance(dataset, IterableDataset):
        return dataset.take(max_samples)
    return dataset.select(range(min(max_samples, len(dataset))))


def _column_names(dataset: AnyDataset) -> list[str]:
    """The dataset's columns; a streamed one whose features are unknown (a text file, a data set without metadata)
    says None, so its first example is read for them (`map` would otherwise keep the input columns beside its
    output, and a batch whose output has another number of rows fails inside `datasets`)."""
    names = dataset.column_names
    if names is None and isinstance(dataset, IterableDataset):
        first = next(iter(dataset), None)
        names = list(first) if first is not None else []
    return names


def _map(dataset: AnyDataset, function: Callable, num_proc: int | None, overwrite_cache: bool, desc: str, **kw):
    """`dataset.map(batched=True)`, multi-process and cached for map-style datasets, lazy for streaming ones."""
    if isinstance(dataset, IterableDataset):
        return dataset.map(function, batched=True, **kw)
    return dataset.map(
        function, batched=True, num_proc=num_proc, load_from_cache_file=not overwrite_cache, desc=desc, **kw
    )


def tokenize_documents(
    dataset: AnyDataset,
    tokenizer: Any,
    text_column: str = "text",
    num_proc: int | None = None,
    overwrite_cache: bool = False,
) -> AnyDataset:
    """`input_ids` per document, with the tokenizer's specials (e.g. `<s>`) and a final eos token. Empty and
    whitespace-only texts (the blank lines of a text file read by `line`) are dropped, as run_mlm.py's line-by-line
    mode drops them: with the specials each was a document of its own, `<s> </s>`, teaching the model to end a text
    as soon as it starts."""
    eos = tokenizer.eos_token_id
    columns = _column_names(dataset)

    def tokenize(batch: dict[str, list]) -> dict[str, list]:
        texts = [text for text in batch[text_column] if text and not text.isspace()]
        encoded = tokenizer(texts, add_special_tokens=True, verbose=False)["input_ids"] if texts else []
        if eos is not None:
            encoded = [ids if ids and ids[-1] == eos else ids + [eos] for ids in encoded]
        return {"input_ids": encoded}

    return _map(dataset, tokenize, num_proc, overwrite_cache, "Tokenizing", remove_columns=columns)


def pack_documents(
    documents: list[list[int]],
    block_size: int,
    pad_token_id: int,
    restart_positions: bool = True,
    causal_labels: bool = True,
) -> dict[str, list[list[int]]]:
    """Cut concatenated documents into blocks; see the module docstring. A pure function: the unit `map` runs.

    With `restart_positions`: `input_ids`, `position_ids` and, with `causal_labels` (causal LM), `labels`; without
    them for the masked LM, whose collator makes the labels. Without `restart_positions` (no document boundaries):
    `input_ids` and an `attention_mask` that is 0 on the padding only.
    """
    side = "position_ids" if restart_positions else "attention_mask"
    blocks: dict[str, list[list[int]]] = {"input_ids": [], side: []}
    if restart_positions and causal_labels:
        blocks["labels"] = []
    current: dict[str, list[int]] = {key: [] for key in blocks}

    def add_piece(piece: list[int], is_padding: bool = False) -> None:
        current["input_ids"].extend(piece)
        if restart_positions:
            current["position_ids"].extend(range(len(piece)))  # a restart marks a new document for the mask
        if "labels" in current:
            current["labels"].extend([IGNORE_INDEX] * len(piece) if is_padding else [IGNORE_INDEX] + piece[1:])
        if not restart_positions:
            current["attention_mask"].extend([0 if is_padding else 1] * len(piece))

    def flush() -> None:
        for key, values in current.items():
            blocks[key].append(values.copy())
            values.clear()

    for document in documents:
        offset = 0
        while offset < len(document):
            piece = document[offset : offset + block_size - len(current["input_ids"])]
            add_piece(piece)
            offset += len(piece)
            if len(current["input_ids"]) == block_size:
                flush()
    if current["input_ids"]:
        add_piece([pad_token_id] * (block_size - len(current["input_ids"])), is_padding=True)
        flush()
    return blocks


def pack_causal_lm(
    tokenized: AnyDataset,
    block_size: int,
    pad_token_id: int,
    num_proc: int | None = None,
    overwrite_cache: bool = False,
    restart_positions: bool = True,
    batch_size: int = 1000,
    causal_labels: bool = True,
) -> AnyDataset:
    """Packed blocks (see `pack_documents`): causal LM by default; `causal_labels=False` for the masked LM
    (documents kept apart by restarting positions, labels made by its collator); `restart_positions=False` for
    blocks without document boundaries."""
    if block_size < 2:
        raise ValueError(f"`block_size` must be at least 2, got {block_size}.")

    def pack(batch: dict[str, list]) -> dict[str, list]:
        return pack_documents(batch["input_ids"], block_size, pad_token_id, restart_positions, causal_labels)

    columns = _column_names(tokenized)
    return _map(
        tokenized,
        pack,
        num_proc,
        overwrite_cache,
        f"Packing into blocks of {block_size}",
        remove_columns=columns,
        batch_size=batch_size,
    )


__all__ = [
    "FILE_BUILDERS",
    "IGNORE_INDEX",
    "SAMPLE_BY",
    "check_columns",
    "check_not_empty",
    "embedded_corpus",
    "limit",
    "load_raw_datasets",
    "pack_causal_lm",
    "pack_documents",
    "tokenize_documents",
]
