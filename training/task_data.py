"""The data of each fine-tuning task: its embedded-corpus examples, the columns it reads, the texts a new tokenizer
is trained on, and its tokenization (instruction tuning: chat template, loss on the assistant's turns only;
classification: text and label ids; seq2seq: source and target)."""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

from datasets import ClassLabel, Dataset, DatasetDict, Value

from archlab.tokenization.data import IGNORE_INDEX, check_columns, check_no_empty_cells, check_text_columns


class TaskOptions(Protocol):
    """The finetune script's task flags (`FinetuneArguments`), or any object with these attributes."""

    prompt_column: str | None
    response_column: str | None
    messages_column: str
    label_column_name: str
    source_column: str
    target_column: str
    max_source_length: int
    max_target_length: int


# ---------------------------------------------------------------------------------------------------------------
# Examples when the user gives no data
# ---------------------------------------------------------------------------------------------------------------
def embedded_examples(source: Callable[[str], Iterable[dict[str, Any]]]) -> Callable[[int | None, int | None], Any]:
    """A task's default data: the first `max_train` / `max_eval` rows that `source(split)` yields, per split."""

    def load(max_train: int | None, max_eval: int | None) -> DatasetDict:
        sizes = {"train": max_train, "validation": max_eval}
        return DatasetDict(
            {split: Dataset.from_list(list(itertools.islice(source(split), n))) for split, n in sizes.items()}
        )

    return load


def needs_train_file(max_train: int | None, max_eval: int | None) -> DatasetDict:
    raise ValueError("--task classification needs --train_file (CSV/JSON with text and label columns).")


# ---------------------------------------------------------------------------------------------------------------
# Instruction tuning
# ---------------------------------------------------------------------------------------------------------------
def as_messages(dataset: Any, args: TaskOptions, split: str = "train") -> Any:
    """Prompt/response columns -> the `messages` column the chat template reads (a missing column is named with
    its split)."""
    if args.prompt_column is None and args.response_column is None:
        check_columns(dataset, args.messages_column, split=split, flags=["--messages_column"])
        check_conversations(dataset, args.messages_column, split)
        return dataset
    if args.prompt_column is None or args.response_column is None:
        raise ValueError("--prompt_column and --response_column go together.")
    check_columns(
        dataset, args.prompt_column, args.response_column, split=split, flags=["--prompt_column", "--response_column"]
    )
    check_text_columns(dataset, args.prompt_column, args.response_column, split=split)
    return dataset.map(
        lambda row: {
            args.messages_column: [
                {"role": "user", "content": row[args.prompt_column]},
                {"role": "assistant", "content": row[args.response_column]},
            ]
        },
        remove_columns=dataset.column_names,
    )


def check_conversations(dataset: Any, column: str, split: str) -> None:
    """Each row of `column` a list of {"role", "content"} messages, and some conversation with an assistant turn:
    a column of strings failed inside the chat template's `datasets.map` ("Chat messages should be dicts"), messages
    without a role as a jinja `UndefinedError`, and conversations without an answer as every conversation "losing
    its answer when cut" to the model's length. A message's content is text or a list of text parts (other content,
    an image part or None, is named here rather than by the chat template inside `datasets.map`)."""
    answered = 0
    for row, conversation in enumerate(dataset[column]):
        if not isinstance(conversation, list):
            raise ValueError(
                f"Column {column!r} of the {split} split holds {type(conversation).__name__} in row {row}, not a "
                'conversation (a list of {"role": ..., "content": ...} messages); for prompt and response columns '
                "pass --prompt_column and --response_column."
            )
        for message in conversation:
            if not isinstance(message, dict) or not {"role", "content"} <= message.keys():
                raise ValueError(
                    f"Column {column!r} of the {split} split: row {row} has a message {message!r} without a "
                    '"role" and a "content"; each message is {"role": "user" | "assistant" | "system", "content": ...}.'
                )
            if message_text(message["content"]) is None:
                raise ValueError(
                    f"Column {column!r} of the {split} split: row {row} has a message whose content is "
                    f"{message['content']!r}; a message's content is text, or a list of text parts "
                    '({"type": "text", "text": ...}): images and other parts are not read.'
                )
        answered += any(message["role"] == "assistant" for message in conversation)
    if split == "train" and not answered:
        raise ValueError(
            f"Column {column!r} of the {split} split has no assistant message in any of its {len(dataset)} "
            "conversations: instruction tuning learns the assistant's turns, so there is nothing to learn."
        )


def message_text(content: Any) -> str | None:
    """A message's text: its content when a string, the text of a list of text parts joined (as the chat template
    reads them), None for anything else."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str) for part in content
    ):
        return "".join(part["text"] for part in content)
    return None


def prepare_instruct(dataset: Any, split: str, args: TaskOptions, text_column: str) -> Any:
    return as_messages(dataset, args, split)


def instruct_texts(train: Any, args: TaskOptions, text_column: str) -> Iterator[str]:
    return (message_text(m["content"]) for row in train for m in row[args.messages_column])


GENERATION_BLOCK = re.compile(r"\{%-?\s*generation\s*-?%\}")


def marks_generation(chat_template: str | dict[str, str] | None) -> bool:
    """Whether a chat template (or the default of named templates) opens `{% generation %}` blocks, written with
    whitespace control or without (`{%- generation -%}`, as transformers and TRL read them: only the plain spelling
    was accepted, and such a tokenizer was refused as having no markers)."""
    if isinstance(chat_template, dict):
        chat_template = chat_template.get("default")
    return isinstance(chat_template, str) and GENERATION_BLOCK.search(chat_template) is not None


def tokenize_instruct(
    dataset: Any,
    tokenizer: Any,
    args: TaskOptions,
    max_length: int,
    num_proc: int | None,
    text_column: str = "text",
    label2id: dict[Any, int] | None = None,
) -> Any:
    """`input_ids` of the whole conversation; `labels` only on the assistant's tokens (the rest -100)."""
    if not marks_generation(tokenizer.chat_template):
        raise ValueError(
            "--task instruct needs a tokenizer whose chat template marks assistant turns with "
            "{% generation %} (archlab's decoder tokenizers do)."
        )

    def encode(batch: dict[str, list]) -> dict[str, list]:
        out = tokenizer.apply_chat_template(
            batch[args.messages_column],
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
            truncation=True,
            max_length=max_length,
        )
        labels = [
            [t if m else IGNORE_INDEX for t, m in zip(ids, mask)]
            for ids, mask in zip(out["input_ids"], out["assistant_masks"])
        ]
        return {"input_ids": out["input_ids"], "attention_mask": out["attention_mask"], "labels": labels}

    encoded = dataset.map(
        encode, batched=True, num_proc=num_proc, remove_columns=dataset.column_names, desc="Applying the chat template"
    )
    # A conversation truncated before the answer teaches nothing.
    kept = encoded.filter(lambda row: any(t != IGNORE_INDEX for t in row["labels"]))
    if isinstance(kept, Dataset) and len(encoded) and not len(kept):  # (a streamed split cannot say)
        raise ValueError(
            f"Every one of the {len(encoded)} conversations loses its answer when cut to {max_length} tokens (the "
            "model's positions, or --block_size): give a larger --block_size or a model with more positions."
        )
    return kept


# ---------------------------------------------------------------------------------------------------------------
# Classification
# ---------------------------------------------------------------------------------------------------------------
def check_classification_columns(dataset: Any, split: str, args: TaskOptions, text_column: str) -> Any:
    check_columns(
        dataset, text_column, args.label_column_name, split=split, flags=["--text_column_name", "--label_column_name"]
    )
    check_text_columns(dataset, text_column, split=split)
    check_label_column(dataset, args.label_column_name, split)
    return dataset


def check_label_column(dataset: Any, column: str, split: str) -> None:
    """One label per row, none missing: a row without a label (a CSV's empty field, a JSON null) became a class of its
    own, "None", trained and scored as one; a list of labels (multi-label rows) failed as an unhashable type."""
    feature = (getattr(dataset, "features", None) or {}).get(column)
    if feature is not None and not isinstance(feature, (Value, ClassLabel)):
        raise ValueError(
            f"Column {column!r} of the {split} split holds {feature}, not one label per row: --task classification "
            "takes a class (a name or an integer) or a number to regress (floats) in each row; multi-label rows "
            "(lists of labels) are not supported. Name the label column with --label_column_name."
        )
    check_no_empty_cells(dataset, column, split, "rows without a label")


def is_regression(dataset: Any, column: str) -> bool:
    """Float labels are regression targets (one output, mean squared error), as run_glue.py reads a float label
    column; integer and text labels are classes."""
    feature = (getattr(dataset, "features", None) or {}).get(column)
    return isinstance(feature, Value) and feature.dtype in ("float16", "float32", "float64")


def classification_texts(train: Any, args: TaskOptions, text_column: str) -> Iterator[str]:
    return (row[text_column] for row in train)


def label_maps(dataset: Any, column: str) -> tuple[dict[Any, int], dict[int, str]]:
    """label -> id and id -> label name, the labels in sorted order as run_glue.py sorts them: integer labels
    0..n-1 keep their values as ids (sorted as text, label 10 was id 2 among 0..11, and `logits.argmax(-1)` no
    longer gave the label); labels of mixed types sort by their text."""
    feature = (getattr(dataset, "features", None) or {}).get(column)
    if isinstance(feature, ClassLabel):  # a Hub data set's classes: their ids and names as it defines them
        return {i: i for i in range(feature.num_classes)}, dict(enumerate(feature.names))
    values = list(set(dataset[column]))
    try:
        values.sort()
    except TypeError:
        values.sort(key=str)
    if len(values) < 2:
        raise ValueError(f"Column {column!r} has {len(values)} distinct label(s); classification needs at least 2.")
    return {v: i for i, v in enumerate(values)}, {i: str(v) for i, v in enumerate(values)}


def shortened(values: list[str], most: int = 10) -> str:
    """A list of labels for a message: the first `most`, then how many more."""
    shown = ", ".join(repr(v) for v in values[:most])
    return f"[{shown}, ... {len(values) - most} more]" if len(values) > most else f"[{shown}]"


def tokenize_classification(
    dataset: Any,
    tokenizer: Any,
    args: TaskOptions,
    max_length: int,
    num_proc: int | None,
    text_column: str = "text",
    label2id: dict[Any, int] | None = None,
) -> Any:
    """`input_ids` and the label ids of `label2id`; with `label2id` None (regression), the labels as floats."""
    label = args.label_column_name

    def encode(batch: dict[str, list]) -> dict[str, list]:
        out = tokenizer(batch[text_column], truncation=True, max_length=max_length)
        if label2id is None:
            labels = [float(v) for v in batch[label]]
        else:
            unknown = sorted(map(str, {v for v in batch[label] if v not in label2id}))
            if unknown:
                raise ValueError(
                    f"Labels {shortened(unknown)} of the validation split are not in the training split's "
                    f"{shortened(sorted(map(str, label2id)))}."
                )
            labels = [label2id[v] for v in batch[label]]
        return {"input_ids": out["input_ids"], "attention_mask": out["attention_mask"], "labels": labels}

    return dataset.map(encode, batched=True, num_proc=num_proc, remove_columns=dataset.column_names, desc="Tokenizing")


# ---------------------------------------------------------------------------------------------------------------
# Sequence to sequence
# ---------------------------------------------------------------------------------------------------------------
def check_pair_columns(dataset: Any, split: str, args: TaskOptions, text_column: str) -> Any:
    check_columns(
        dataset, args.source_column, args.target_column, split=split, flags=["--source_column", "--target_column"]
    )
    check_text_columns(dataset, args.source_column, args.target_column, split=split)
    return dataset


def pair_texts(train: Any, args: TaskOptions, text_column: str) -> Iterator[str]:
    return (text for row in train for text in (row[args.source_column], row[args.target_column]))


def tokenize_seq2seq(
    dataset: Any,
    tokenizer: Any,
    args: TaskOptions,
    max_length: int | None,
    num_proc: int | None,
    text_column: str = "text",
    label2id: dict[Any, int] | None = None,
) -> Any:
    """Sources truncated to --max_source_length and targets to --max_target_length (keeping the closing token);
    `max_length`, the other tasks' truncation, does not apply. Each side is tokenized with its own length, as
    run_translation.py does: one call with `text_target` cut the targets at --max_source_length as well."""

    def encode(batch: dict[str, list]) -> dict[str, list]:
        out = tokenizer(batch[args.source_column], truncation=True, max_length=args.max_source_length)
        targets = tokenizer(text_target=batch[args.target_column], truncation=True, max_length=args.max_target_length)
        labels = [
            ids[: args.max_target_length - 1] + ids[-1:] if len(ids) > args.max_target_length else ids
            for ids in targets["input_ids"]
        ]
        return {"input_ids": out["input_ids"], "attention_mask": out["attention_mask"], "labels": labels}

    return dataset.map(
        encode, batched=True, num_proc=num_proc, remove_columns=dataset.column_names, desc="Tokenizing pairs"
    )
