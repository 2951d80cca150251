"""Token classification (named-entity recognition) for the finetune script, as transformers' run_ner.py does it: a list
of words and a list of labels per row (`tokens` / `ner_tags` by default; labels as names or as a Hub data set's
`Sequence(ClassLabel)`), the words tokenized with `is_split_into_words=True`, each word's label on its first
sub-token and -100 on the rest and on special tokens (`--label_all_tokens`: on every sub-token, a `B-` label as its
`I-` on the later ones), and the predictions of a test split written one line of labels per example
(`predictions.txt`). The metrics (seqeval's entity-level precision, recall and F1, and token accuracy) are
`metrics.token_classification_metrics` (with --return_entity_level_metrics, each entity type's too)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
from datasets import ClassLabel, Value

from archlab.tokenization.data import IGNORE_INDEX, check_columns

from .task_data import LIST_FEATURES, shortened

# run_ner.py's columns: `tokens` and `ner_tags` (CoNLL-2003, WNUT-17 and most Hub NER sets), read where the flags
# keep the script's defaults (`--text_column_name text`, `--label_column_name label`)
TOKEN_COLUMNS = ("tokens", "ner_tags")
FLAG_DEFAULTS = ("text", "label")
FLAGS = ("--text_column_name", "--label_column_name")


def token_columns(text_column: str, label_column: str) -> tuple[str, str]:
    """The words' and labels' columns: each flag's value, or run_ner.py's `tokens` / `ner_tags` where the flag keeps
    the script's default (a column named `text` holds a sentence, not a list of words)."""
    return tuple(  # type: ignore[return-value]
        ours if given == default else given
        for given, default, ours in zip((text_column, label_column), FLAG_DEFAULTS, TOKEN_COLUMNS)
    )


def needs_train_file(max_train: int | None, max_eval: int | None) -> Any:
    raise ValueError(
        "--task token-classification needs --train_file (JSON lines with a list of words and a list of labels per "
        'row: {"tokens": ["John", "lives", "in", "Paris"], "ner_tags": ["B-PER", "O", "O", "B-LOC"]}) or a '
        "--dataset_name with such columns."
    )


def is_list_column(dataset: Any, column: str) -> bool:
    return isinstance((getattr(dataset, "features", None) or {}).get(column), LIST_FEATURES)


def as_word_lists(dataset: Any, columns: list[str]) -> Any:
    """Text columns (a CSV's cells) read as whitespace-separated words / labels, one per word."""
    texts = [c for c in columns if not is_list_column(dataset, c)]
    if not texts:
        return dataset
    return dataset.map(lambda row: {c: str(row[c]).split() for c in texts})


def check_token_classification_columns(dataset: Any, split: str, args: Any, text_column: str) -> Any:
    """The words' column and the labels' column: a list of words and a list of as many labels per row (JSON), or, in a
    CSV, the words and their labels as whitespace-separated text. A test split may come without labels: it is then
    refused here, as run_ner.py needs them to know which predictions to write (its predictions are scored)."""
    label = args.label_column_name
    if split == "test" and label not in dataset.column_names:
        raise ValueError(
            f"The test split has no label column {label!r} (its columns are {dataset.column_names}): --task "
            "token-classification predicts and scores a labelled test split, as run_ner.py does (give each word a "
            "label, \"O\" where unknown); to tag new text use `pipeline('token-classification', ...)` on the saved "
            "folder."
        )
    check_columns(dataset, text_column, label, split=split, flags=list(FLAGS))
    features = getattr(dataset, "features", None) or {}
    for column, what in ((text_column, "words"), (label, "labels")):
        feature = features.get(column)
        inner = getattr(feature, "feature", None) if isinstance(feature, LIST_FEATURES) else feature
        text = isinstance(inner, Value) and inner.dtype in ("string", "large_string")
        ids = what == "labels" and (
            isinstance(inner, ClassLabel) or (isinstance(inner, Value) and inner.dtype.startswith("int"))
        )
        if feature is not None and not (text or ids):
            raise ValueError(
                f"Column {column!r} of the {split} split holds {feature}, not {what}: --task token-classification "
                "reads a list of words and a list of their labels (names, or a Hub data set's ClassLabel ids) per "
                f"row (name the columns with {' and '.join(FLAGS)})."
            )
        if what == "labels" and isinstance(feature, Value) and ids:
            raise ValueError(
                f"Column {column!r} of the {split} split holds one integer per row: --task token-classification "
                "needs a label per word (a list, or whitespace-separated labels in a CSV); one label per row is "
                "--task classification."
            )
    dataset = as_word_lists(dataset, [text_column, label])
    for row, (words, labels) in enumerate(zip(dataset[text_column], dataset[label])):
        if words is None or labels is None or None in words or None in labels:
            raise ValueError(f"Row {row} of the {split} split has a missing word or label: {words!r}, {labels!r}.")
        if len(words) != len(labels):
            raise ValueError(
                f"Row {row} of the {split} split has {len(words)} words and {len(labels)} labels "
                f"({shortened([str(w) for w in words], 6)} / {shortened([str(v) for v in labels], 6)}): each word "
                "takes one label."
            )
        if any(not isinstance(word, str) or not word.strip() for word in words):
            raise ValueError(f"Row {row} of the {split} split holds an empty word or one that is not text: {words!r}.")
    return dataset


def token_classification_texts(train: Any, args: Any, text_column: str) -> Iterator[str]:
    """A new tokenizer learns each row's words joined by spaces, the text the pipeline will read."""
    return (" ".join(words) for words in train[text_column])


def label_maps(dataset: Any, column: str) -> tuple[dict[Any, int], dict[int, str]]:
    """label -> id and id -> name, as run_ner.py builds them: a `Sequence(ClassLabel)`'s ids and names, else the
    labels of the training split sorted (`get_label_list`)."""
    feature = (getattr(dataset, "features", None) or {}).get(column)
    inner = getattr(feature, "feature", None)
    if isinstance(inner, ClassLabel):
        return {i: i for i in range(inner.num_classes)}, dict(enumerate(inner.names))
    values = sorted({value for labels in dataset[column] for value in labels}, key=lambda v: (str(type(v)), v))
    if len(values) < 2:
        raise ValueError(
            f"Column {column!r} has {len(values)} distinct label(s); token classification needs 2 or more."
        )
    return {v: i for i, v in enumerate(values)}, {i: str(v) for i, v in enumerate(values)}


def b_to_i_ids(id2label: dict[int, str]) -> dict[int, int]:
    """Each label id -> the id of its `I-` label where it is a `B-` label that has one (else itself), as run_ner.py
    maps the later sub-tokens' labels under --label_all_tokens."""
    ids = {name: i for i, name in id2label.items()}
    return {
        i: ids.get("I-" + name[2:], i) if name.startswith("B-") else i for i, name in id2label.items()
    }  # (a `B-X` without an `I-X` keeps its label, as run_ner.py's `b_to_i_label`)


def words_need_a_space(tokenizer: Any) -> bool:
    """Whether the words after the first are tokenized as the text's words only with a space before them: a byte-level
    BPE without `add_prefix_space` (archlab's, GPT-2's, Llama 3's) tokenizes each word of `is_split_into_words` as the
    start of a text ("lives" -> `liv es`), not as the middle of one ("Ġlives"), so fine-tuning taught the model other
    tokens than the pipeline then feeds it (it tokenizes the sentence). WordPiece and Metaspace tokenizers drop or
    share the space, and need none."""
    words = ["hello", "world"]
    text = tokenizer(" ".join(words), add_special_tokens=False)["input_ids"]
    split = tokenizer(words, is_split_into_words=True, add_special_tokens=False)["input_ids"]
    if split == text:
        return False
    spaced = tokenizer([words[0], " " + words[1]], is_split_into_words=True, add_special_tokens=False)["input_ids"]
    return spaced == text


def aligned_labels(word_ids: list[int | None], labels: list[int], label_all_tokens: bool, b_to_i: dict[int, int]):
    """A label per token, as run_ner.py's `tokenize_and_align_labels`: the word's label on its first sub-token, -100 on
    special tokens and (without `label_all_tokens`) on the word's later sub-tokens, which with it take the word's
    label, a `B-` as its `I-`."""
    aligned, previous = [], None
    for word in word_ids:
        if word is None:
            aligned.append(IGNORE_INDEX)
        elif word != previous:
            aligned.append(labels[word])
        else:
            aligned.append(b_to_i[labels[word]] if label_all_tokens else IGNORE_INDEX)
        previous = word
    return aligned


def tokenize_token_classification(
    dataset: Any,
    tokenizer: Any,
    args: Any,
    max_length: int,
    num_proc: int | None,
    text_column: str = "tokens",
    label2id: dict[Any, int] | None = None,
    segments: bool = False,
) -> Any:
    """`input_ids` of the words (`is_split_into_words=True`, cut to `max_length`: the words past it go untrained and
    unscored, as in run_ner.py) and `labels` aligned to them (`aligned_labels`). A byte-level BPE gets a space before
    each word after the first (`words_need_a_space`), so each word is the tokens of the sentence the pipeline reads."""
    label = args.label_column_name
    classes = getattr((getattr(dataset, "features", None) or {}).get(label), "feature", None)
    name = classes.int2str if isinstance(classes, ClassLabel) else str  # (a ClassLabel's ids -> its names)
    b_to_i = b_to_i_ids({i: name(value) for value, i in label2id.items()})
    space = words_need_a_space(tokenizer)

    def encode(batch: dict[str, list]) -> dict[str, list]:
        words = [[w if i == 0 or not space else " " + w for i, w in enumerate(row)] for row in batch[text_column]]
        out = tokenizer(
            words, is_split_into_words=True, truncation=True, max_length=max_length, return_token_type_ids=segments
        )
        encoded = {"input_ids": out["input_ids"], "attention_mask": out["attention_mask"]}
        if segments and "token_type_ids" in out:
            encoded["token_type_ids"] = out["token_type_ids"]
        values = {v for row in batch[label] for v in row}
        unknown = sorted(map(str, values - label2id.keys()))
        if unknown:
            raise ValueError(
                f"Labels {shortened(unknown)} are not in the training split's {shortened(sorted(map(str, label2id)))}."
            )
        encoded["labels"] = [
            aligned_labels(out.word_ids(i), [label2id[v] for v in row], args.label_all_tokens, b_to_i)
            for i, row in enumerate(batch[label])
        ]
        return encoded

    return dataset.map(encode, batched=True, num_proc=num_proc, remove_columns=dataset.column_names, desc="Tokenizing")


def prediction_lines(outputs: Any, label_ids: np.ndarray, config: Any) -> list[str]:
    """One line per example of the labels predicted at its scored tokens (the words' first sub-tokens), joined by
    spaces, as run_ner.py writes predictions.txt."""
    logits = outputs[0] if isinstance(outputs, tuple) else outputs
    predicted = np.argmax(logits, axis=-1)
    return [
        " ".join(config.id2label[int(p)] for p, gold in zip(row, labels) if gold != IGNORE_INDEX)
        for row, labels in zip(predicted, label_ids)
    ]
