"""The data of each fine-tuning task: its embedded-corpus examples, the columns it reads, the texts a new tokenizer
is trained on, and its tokenization (instruction tuning: chat template, loss on the assistant's turns only;
classification: text and label ids; seq2seq: source and target)."""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

from datasets import ClassLabel, Dataset, DatasetDict, Json, LargeList, List, Sequence, Value

from archlab.tokenization.data import IGNORE_INDEX, check_columns, check_no_empty_cells, check_text_columns

from .reporting import log


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
    source_prefix: str | None
    source_lang: str | None
    target_lang: str | None
    forced_bos_token: str | None
    text_column_names: str | None
    text_column_delimiter: str | None


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
    an image part or None, is named here rather than by the chat template inside `datasets.map`); an assistant turn
    that calls tools (`tool_calls`) may have none (OpenAI's `"content": null`), and each call needs a name and its
    arguments as an object or a JSON string."""
    answered = 0
    for row, conversation in enumerate(dataset[column]):
        if not isinstance(conversation, list):
            raise ValueError(
                f"Column {column!r} of the {split} split holds {type(conversation).__name__} in row {row}, not a "
                'conversation (a list of {"role": ..., "content": ...} messages); for prompt and response columns '
                "pass --prompt_column and --response_column."
            )
        for message in conversation:
            check_chat_message(message, f"Column {column!r} of the {split} split: row {row}")
        answered += any(message["role"] == "assistant" for message in conversation)
    if split == "train" and not answered:
        raise ValueError(
            f"Column {column!r} of the {split} split has no assistant message in any of its {len(dataset)} "
            "conversations: instruction tuning learns the assistant's turns, so there is nothing to learn."
        )


def check_chat_message(message: Any, where: str) -> None:
    """One message of a conversation, as instruction tuning reads it: a dict with a "role" and a "content" that is
    text or a list of text parts, or an assistant turn calling tools (`tool_calls`, each checked by
    `check_tool_calls`) with no content (OpenAI's `"content": null`). A bad one is a ValueError starting with `where`
    (a row of a column, a line of a prompts file and the message's number)."""
    calls = message.get("tool_calls") if isinstance(message, dict) else None
    if not isinstance(message, dict) or "role" not in message or ("content" not in message and not calls):
        raise ValueError(
            f'{where} has a message {message!r} without a "role" and a "content"; each message is '
            '{"role": "user" | "assistant" | "system", "content": ...}.'
        )
    if calls:
        check_tool_calls(calls, where)
    if not (calls and message.get("content") is None) and message_text(message["content"]) is None:
        raise ValueError(
            f"{where} has a message whose content is {message['content']!r}; a message's content is text, or a list "
            'of text parts ({"type": "text", "text": ...}): images and other parts are not read (None only beside '
            "`tool_calls`)."
        )


def check_tool_calls(calls: Any, where: str) -> None:
    """An assistant's `tool_calls`: a list of calls, each with a name and arguments (an object, or a JSON string as
    OpenAI gives them), in OpenAI's layout ({"type": "function", "function": {...}}) or bare. A string that is not
    JSON would be trained as it stands, a tool call no parser reads back."""
    if not isinstance(calls, list):
        raise ValueError(f"{where} has `tool_calls` {calls!r}: a list of calls is expected.")
    for call in calls:
        function = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ValueError(
                f'{where} has a tool call {call!r} without a name: each is {{"type": "function", "function": '
                '{"name": ..., "arguments": {...}}}.'
            )
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                json.loads(arguments)
            except ValueError:
                raise ValueError(
                    f"{where} has a tool call of {function['name']!r} whose arguments {arguments!r} are not JSON."
                ) from None
        elif not isinstance(arguments, dict):
            raise ValueError(
                f"{where} has a tool call of {function['name']!r} whose arguments are {arguments!r}: an object or a "
                "JSON string is expected."
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
    """The texts a new tokenizer learns: each message's text, and the tool calls and the tools' schemas as the chat
    template writes them (JSON)."""
    features = getattr(train, "features", None) or {}
    for row in train:
        tools = row_tools(row.get(TOOLS_COLUMN), features.get(TOOLS_COLUMN))
        if tools:
            yield "\n".join(json.dumps(tool) for tool in tools)
        for message in template_messages(row[args.messages_column], features.get(args.messages_column)):
            if message.get("content") is not None:
                yield message_text(message["content"])
            for call in message.get("tool_calls") or ():
                yield json.dumps(call.get("function", call))


# TRL's column of each conversation's tools (a list of JSON schemas, or that list as a JSON string), given to the
# chat template as `apply_chat_template(..., tools=...)`
TOOLS_COLUMN = "tools"


def without_nulls(value: Any) -> Any:
    """`value` with the dict entries that are None left out, at every depth. Arrow stores a column of dicts as one
    struct of every key any row has, so a row's tool-call arguments and tool schemas came back with the other rows'
    keys as None (`{"city": null, "a": 1, "b": 2}`), and the model was trained to write them."""
    if isinstance(value, dict):
        return {key: without_nulls(item) for key, item in value.items() if item is not None}
    if isinstance(value, list):
        return [without_nulls(item) for item in value]
    return value


def without_arrow_nulls(value: Any, feature: Any = None) -> Any:
    """`value` without the None entries Arrow puts in a struct (`feature` a dict of features), at every depth a
    struct reaches; below a `Json` feature (what `datasets` reads from JSON whose rows differ in layout, such as
    arguments an object in some rows and a string in others) the values are the file's own, None included, and are
    kept: `{"unit": null}` was dropped from an object of arguments and kept in a string of them, and the model learned
    other calls than the rows hold. `feature` None (not known): every None entry is left out (`without_nulls`)."""
    if feature is None:
        return without_nulls(value)
    if isinstance(feature, Json):
        return value
    if isinstance(feature, dict) and isinstance(value, dict):
        return {key: without_arrow_nulls(item, feature.get(key)) for key, item in value.items() if item is not None}
    if isinstance(feature, LIST_FEATURES) and isinstance(value, list):
        return [without_arrow_nulls(item, feature.feature) for item in value]
    return value


def list_item_feature(feature: Any) -> Any:
    """The feature of a list feature's items (a `Json` feature for itself); None when not known."""
    if isinstance(feature, Json):
        return feature
    return feature.feature if isinstance(feature, LIST_FEATURES) else None


def row_tools(tools: Any, feature: Any = None) -> list[Any] | None:
    """A row's `tools` as the chat template takes them: the list (read from JSON when a string, as TRL reads it),
    without Arrow's None entries (`feature`: the column's, see `without_arrow_nulls`); None where the row has none."""
    if isinstance(tools, str):
        tools, feature = (json.loads(tools) if tools.strip() else None), Json()
    return without_arrow_nulls(tools, feature) or None


def template_messages(conversation: list[dict[str, Any]], feature: Any = None) -> list[dict[str, Any]]:
    """A conversation as the chat template reads it: each tool call without Arrow's None entries (`feature`: the
    messages column's, see `without_arrow_nulls`; a string of arguments is kept as it stands)."""
    message_feature = list_item_feature(feature)
    calls_feature = message_feature.get("tool_calls") if isinstance(message_feature, dict) else message_feature
    return [
        {**message, "tool_calls": without_arrow_nulls(message["tool_calls"], calls_feature)}
        if message.get("tool_calls")
        else message
        for message in conversation
    ]


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
    segments: bool = False,
) -> Any:
    """`input_ids` of the whole conversation, cut at `max_length` tokens; `labels` only on the assistant's tokens (the
    rest -100); a conversation cut before its first answer is left out, and their number said. A `tools`
    column (TRL's) gives each conversation its tools, rendered by the chat template; tool answers and the tools'
    schemas are not trained on, the assistant's tool calls are."""
    if not marks_generation(tokenizer.chat_template):
        raise ValueError(
            "--task instruct needs a tokenizer whose chat template marks assistant turns with "
            "{% generation %} (archlab's decoder tokenizers do)."
        )

    features = getattr(dataset, "features", None) or {}
    messages_feature, tools_feature = features.get(args.messages_column), features.get(TOOLS_COLUMN)

    def apply(conversations: list[Any], tools: list[Any] | None) -> dict[str, list]:
        return tokenizer.apply_chat_template(
            [template_messages(conversation, messages_feature) for conversation in conversations],
            tools=tools,
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
            truncation=True,
            max_length=max_length,
        )

    def encode(batch: dict[str, list]) -> dict[str, list]:
        conversations = batch[args.messages_column]
        if TOOLS_COLUMN in batch:  # each conversation with its own tools, as TRL's SFTTrainer renders them
            outs = [apply([c], row_tools(t, tools_feature)) for c, t in zip(conversations, batch[TOOLS_COLUMN])]
            keys = ("input_ids", "attention_mask", "assistant_masks")
            out = {key: [row for o in outs for row in o[key]] for key in keys}
        else:
            out = apply(conversations, None)
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
    if isinstance(kept, Dataset) and len(kept) < len(encoded):
        # (as TRL's SFTTrainer drops them; they were left out without a word, from the validation split as well)
        log(
            f"{len(encoded) - len(kept)} of {len(encoded)} conversations lose their answer when cut to {max_length} "
            "tokens (the model's positions, or --block_size) and are left out; a larger --block_size keeps them."
        )
    return kept


# ---------------------------------------------------------------------------------------------------------------
# Classification
# ---------------------------------------------------------------------------------------------------------------
# run_glue.py's text columns of the GLUE tasks (`task_to_keys`), pairs first: read without flags when the data has no
# `text` column (a pair's second text is encoded after the first, as `tokenizer(first, second)` does)
GLUE_TEXT_COLUMNS = (
    ("sentence1", "sentence2"),  # mrpc, rte, stsb, wnli
    ("question1", "question2"),  # qqp
    ("question", "sentence"),  # qnli
    ("premise", "hypothesis"),  # mnli
    ("sentence",),  # cola, sst2
)


def glue_text_columns(column_names: Iterable[str]) -> tuple[str, ...] | None:
    """The first of GLUE's text columns (one text or a pair) that a split has, else None."""
    names = set(column_names)
    return next((columns for columns in GLUE_TEXT_COLUMNS if names.issuperset(columns)), None)


def text_pair_column(args: TaskOptions) -> str | None:
    """The second text column of a sentence-pair task (`--text_column_names first,second` without
    --text_column_delimiter), else None."""
    names = (getattr(args, "text_column_names", None) or "").split(",")
    return names[1].strip() if len(names) == 2 and text_delimiter(args) is None else None


def text_delimiter(args: TaskOptions) -> str | None:
    """--text_column_delimiter with `\\n` and `\\t` read as a line break and a tab (what a shell passes for
    run_classification.py's `--text_column_delimiter "\\n"`), or None when not given."""
    delimiter = getattr(args, "text_column_delimiter", None)
    return None if delimiter is None else delimiter.replace("\\n", "\n").replace("\\t", "\t")


def joined_text_columns(args: TaskOptions) -> list[str] | None:
    """The text columns read as one text, joined by --text_column_delimiter (a space unless given), as
    run_classification.py joins its `--text_column_names`: three or more of them, or two with the delimiter given
    (two without it are a sentence pair); else None."""
    names = [name.strip() for name in (getattr(args, "text_column_names", None) or "").split(",")]
    return names if len(names) > 2 or (len(names) == 2 and text_delimiter(args) is not None) else None


def join_text_columns(dataset: Any, split: str, args: TaskOptions, text_column: str) -> Any:
    """`joined_text_columns`, checked, joined into the first one's place (`text_column`), the rest dropped."""
    names = joined_text_columns(args)
    check_columns(dataset, *names, split=split, flags=["--text_column_names"] * len(names))
    check_text_columns(dataset, *names, split=split)
    delimiter = " " if text_delimiter(args) is None else text_delimiter(args)
    return dataset.map(
        lambda row: {text_column: delimiter.join(row[name] for name in names)},
        remove_columns=[name for name in names if name != text_column],
    )


def check_classification_columns(dataset: Any, split: str, args: TaskOptions, text_column: str) -> Any:
    """The text column (or the two of a pair) and the label column, checked; a test split may come without labels
    (the column missing, or every row None or -1, as GLUE's test splits hold them): it is then predicted only, its
    label column dropped. Three or more text columns (or two with --text_column_delimiter) are joined into one first
    (`join_text_columns`)."""
    if joined_text_columns(args):
        dataset = join_text_columns(dataset, split, args, text_column)
    pair = text_pair_column(args)
    texts = [text_column, *([pair] if pair else [])]
    text_flags = ["--text_column_names"] * 2 if pair else ["--text_column_name"]
    if split == "test":
        check_columns(dataset, *texts, split=split, flags=text_flags)
        check_text_columns(dataset, *texts, split=split)
        if is_unlabeled(dataset, args.label_column_name):
            return dataset.remove_columns([c for c in dataset.column_names if c == args.label_column_name])
    check_columns(dataset, *texts, args.label_column_name, split=split, flags=[*text_flags, "--label_column_name"])
    check_text_columns(dataset, *texts, split=split)
    check_label_column(dataset, args.label_column_name, split)
    return dataset


def is_unlabeled(dataset: Any, column: str) -> bool:
    """Whether a split has no labels to score: no such column, or every row None or -1 (GLUE's test splits)."""
    if column not in dataset.column_names:
        return True
    return all(value is None or (isinstance(value, int) and value == -1) for value in dataset[column])


LIST_FEATURES = (List, LargeList, Sequence)


def check_label_column(dataset: Any, column: str, split: str) -> None:
    """One label per row, or a list of labels per row (multi-label), none missing: a row without a label (a CSV's
    empty field, a JSON null) became a class of its own, "None", trained and scored as one. A list holds label names
    or ids (a Hub data set's `Sequence(ClassLabel)`), not a multi-hot vector: floats, or a label twice in one row,
    are refused (`[0, 1, 1]` read as the labels {0, 1} would train the wrong targets without a word)."""
    feature = (getattr(dataset, "features", None) or {}).get(column)
    inner = getattr(feature, "feature", None) if isinstance(feature, LIST_FEATURES) else None
    if feature is not None and not isinstance(feature, (Value, ClassLabel)) and inner is None:
        raise ValueError(
            f"Column {column!r} of the {split} split holds {feature}, not labels: --task classification takes a "
            "class (a name or an integer) or a number to regress (floats) in each row, or a list of classes "
            "(multi-label). Name the label column with --label_column_name."
        )
    if inner is not None:
        floats = isinstance(inner, Value) and inner.dtype.startswith("float")
        if floats or not isinstance(inner, (Value, ClassLabel)):
            raise ValueError(
                f"Column {column!r} of the {split} split holds {feature}: a multi-label row is a list of its "
                'classes (names or integer ids: ["sports", "politics"], [0, 3]), not a multi-hot vector or scores.'
            )
    check_no_empty_cells(dataset, column, split, "rows without a label")
    if inner is not None:
        for row, labels in enumerate(dataset[column]):
            if None in labels:
                raise ValueError(f"Column {column!r} of the {split} split: row {row} holds a missing label {labels}.")
            if len(set(labels)) < len(labels):
                raise ValueError(
                    f"Column {column!r} of the {split} split: row {row} names a label twice, {labels}: a multi-label "
                    "row is a list of its classes, each once (a multi-hot vector such as [0, 1, 1] would be read as "
                    "the classes 0 and 1); give the names or ids of the classes the row has."
                )


def is_regression(dataset: Any, column: str) -> bool:
    """Float labels are regression targets (one output, mean squared error), as run_glue.py reads a float label
    column; integer and text labels are classes."""
    feature = (getattr(dataset, "features", None) or {}).get(column)
    return isinstance(feature, Value) and feature.dtype in ("float16", "float32", "float64")


def is_multi_label(dataset: Any, column: str) -> bool:
    """A list of labels per row is multi-label classification (as run_classification.py reads a list column): one
    output per class, each trained by binary cross-entropy on a multi-hot target."""
    feature = (getattr(dataset, "features", None) or {}).get(column)
    return isinstance(feature, LIST_FEATURES)


def classification_texts(train: Any, args: TaskOptions, text_column: str) -> Iterator[str]:
    """The texts a new tokenizer learns: each row's text, or both texts of a pair."""
    columns = [text_column, *([text_pair_column(args)] if text_pair_column(args) else [])]
    return (row[column] for row in train for column in columns)


def label_maps(dataset: Any, column: str) -> tuple[dict[Any, int], dict[int, str]]:
    """label -> id and id -> label name, the labels in sorted order as run_glue.py sorts them: integer labels
    0..n-1 keep their values as ids (sorted as text, label 10 was id 2 among 0..11, and `logits.argmax(-1)` no
    longer gave the label); labels of mixed types sort by their text. A multi-label column's labels are those of
    all its rows."""
    feature = (getattr(dataset, "features", None) or {}).get(column)
    if isinstance(feature, LIST_FEATURES):
        feature = feature.feature
        values = list({label for labels in dataset[column] for label in labels})
    else:
        values = list(set(dataset[column]))
    if isinstance(feature, ClassLabel):  # a Hub data set's classes: their ids and names as it defines them
        return {i: i for i in range(feature.num_classes)}, dict(enumerate(feature.names))
    try:
        values.sort()
    except TypeError:
        values.sort(key=str)
    if len(values) < 2:
        raise ValueError(f"Column {column!r} has {len(values)} distinct label(s); classification needs at least 2.")
    return {v: i for i, v in enumerate(values)}, {i: str(v) for i, v in enumerate(values)}


def check_known_labels(dataset: Any, column: str, label2id: dict[Any, int], split: str) -> None:
    """Every label of a validation or test split is one of the training split's (a split without labels passes)."""
    if column not in dataset.column_names:
        return
    values = {label for labels in dataset[column] for label in (labels if isinstance(labels, list) else [labels])}
    unknown = sorted(map(str, values - label2id.keys()))
    if unknown:
        raise ValueError(
            f"Labels {shortened(unknown)} of the {split} split are not in the training split's "
            f"{shortened(sorted(map(str, label2id)))}."
        )


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
    segments: bool = False,
) -> Any:
    """`input_ids` and the label ids of `label2id`; a list of labels per row becomes a multi-hot float vector (the
    target of binary cross-entropy, as in run_classification.py); with `label2id` None (regression), the labels as
    floats. A split without the label column (an unlabeled test split) gets no labels.

    A pair of text columns (`--text_column_names first,second`) is encoded as the tokenizer encodes a pair,
    `tokenizer(first, second, truncation=True)` as run_glue.py does: its pair template (archlab's decoder
    tokenizer: `<s> first <s> second`; BERT's: `[CLS] first [SEP] second [SEP]`), the longer text cut first
    (`longest_first`) down to `max_length`. `token_type_ids` are kept where the model has segment embeddings
    (`segments`: its config's `type_vocab_size` > 1, a BERT's) and dropped otherwise: a model without them takes
    none (archlab's decoder ignores them)."""
    label = args.label_column_name
    pair = text_pair_column(args)
    if label == "labels" and "labels" in dataset.column_names:
        # (`map` gives an output column its input column's type: a `labels` list of ClassLabel turned the multi-hot
        # floats into integers, and binary cross-entropy failed on Long targets)
        label = "labels (input)"
        dataset = dataset.rename_column("labels", label)

    def encode(batch: dict[str, list]) -> dict[str, list]:
        texts = (batch[text_column], *([batch[pair]] if pair else []))
        out = tokenizer(*texts, truncation=True, max_length=max_length, return_token_type_ids=segments)
        encoded = {"input_ids": out["input_ids"], "attention_mask": out["attention_mask"]}
        if segments and "token_type_ids" in out:
            encoded["token_type_ids"] = out["token_type_ids"]
        if label not in batch:
            return encoded
        if label2id is None:
            encoded["labels"] = [float(v) for v in batch[label]]
            return encoded
        values = {v for row in batch[label] for v in (row if isinstance(row, list) else [row])}
        unknown = sorted(map(str, values - label2id.keys()))
        if unknown:
            raise ValueError(
                f"Labels {shortened(unknown)} are not in the training split's {shortened(sorted(map(str, label2id)))}."
            )
        encoded["labels"] = [
            multi_hot(row, label2id) if isinstance(row, list) else label2id[row] for row in batch[label]
        ]
        return encoded

    return dataset.map(encode, batched=True, num_proc=num_proc, remove_columns=dataset.column_names, desc="Tokenizing")


def multi_hot(labels: list[Any], label2id: dict[Any, int]) -> list[float]:
    """A row's labels as the multi-hot float vector binary cross-entropy takes."""
    target = [0.0] * len(set(label2id.values()))
    for value in labels:
        target[label2id[value]] = 1.0
    return target


# ---------------------------------------------------------------------------------------------------------------
# Sequence to sequence
# ---------------------------------------------------------------------------------------------------------------
def check_pair_columns(dataset: Any, split: str, args: TaskOptions, text_column: str) -> Any:
    """The source and target columns, checked; a test split may come without targets (it is then predicted only).
    With --source_lang / --target_lang the pairs are read from a `translation` column first."""
    if getattr(args, "source_lang", None):
        dataset = from_translation_column(dataset, split, args)
    if split == "test" and args.target_column not in dataset.column_names:
        check_columns(dataset, args.source_column, split=split, flags=["--source_column"])
        check_text_columns(dataset, args.source_column, split=split)
        return dataset
    check_columns(
        dataset, args.source_column, args.target_column, split=split, flags=["--source_column", "--target_column"]
    )
    check_text_columns(dataset, args.source_column, args.target_column, split=split)
    return dataset


TRANSLATION_COLUMN = "translation"


def translation_key(language: str) -> str:
    """The `translation` column's key of a --source_lang / --target_lang: a language-code tokenizer's code (mBART's
    `en_XX`, `ro_RO`) reads the key before its underscore (`en`, `ro`), as run_translation.py does; a plain key
    (`en`) is itself."""
    return language.split("_")[0]


def from_translation_column(dataset: Any, split: str, args: TaskOptions) -> Any:
    """run_translation.py's form: each row's `translation` {language: text} read into a source and a target column
    named by the languages' keys (`args.source_column` / `args.target_column`, which the script sets to them)."""
    check_columns(dataset, TRANSLATION_COLUMN, split=split, flags=["--source_lang"])
    languages = (args.source_column, args.target_column)
    for row, pair in enumerate(dataset[TRANSLATION_COLUMN]):
        if not isinstance(pair, dict) or not set(languages) <= pair.keys():
            keys = sorted(pair) if isinstance(pair, dict) else type(pair).__name__
            raise ValueError(
                f"Column 'translation' of the {split} split: row {row} holds {keys}, not the languages "
                f"{list(languages)} of --source_lang / --target_lang."
            )
    return dataset.map(
        lambda row: {
            args.source_column: row[TRANSLATION_COLUMN][args.source_column],
            args.target_column: row[TRANSLATION_COLUMN][args.target_column],
        },
        remove_columns=dataset.column_names,
    )


def language_codes(tokenizer: Any) -> list[str] | None:
    """The language codes of a tokenizer that marks each text's language with one (mBART's, mBART-50's, M2M100's,
    NLLB's: a `src_lang` it puts around the source and a `tgt_lang` around the target), or None for any other."""
    if not hasattr(tokenizer, "src_lang") or not hasattr(tokenizer, "tgt_lang"):
        return None
    codes = getattr(tokenizer, "lang_code_to_id", None) or getattr(tokenizer, "lang_code_to_token", None)
    return list(codes) if codes else None


def set_tokenizer_languages(tokenizer: Any, args: TaskOptions) -> None:
    """--source_lang / --target_lang given as a language-code tokenizer's codes (`en_XX`, `ro_RO`): the tokenizer
    marks the sources and targets with them (`src_lang`, `tgt_lang`), as run_translation.py sets them; a code it does
    not have is refused with the ones it has. Other tokenizers: nothing to set (the languages name the column's
    keys only)."""
    codes = language_codes(tokenizer)
    if codes is None or not getattr(args, "source_lang", None):
        return
    for flag, language in (("--source_lang", args.source_lang), ("--target_lang", args.target_lang)):
        if language not in codes:
            raise ValueError(
                f"`{flag}`={language!r} is not a language code of the tokenizer ({type(tokenizer).__name__}); "
                f"allowed values: {', '.join(codes)}."
            )
    tokenizer.src_lang, tokenizer.tgt_lang = args.source_lang, args.target_lang


def forced_bos_token_id(tokenizer: Any, token: str) -> int:
    """The id of --forced_bos_token, a token of the tokenizer (mBART-50's target-language code), or a ValueError."""
    token_id = tokenizer.convert_tokens_to_ids(token)
    if token_id is None or (token_id == tokenizer.unk_token_id and token != tokenizer.unk_token):
        codes = language_codes(tokenizer)
        allowed = f"; its language codes: {', '.join(codes)}" if codes else ""
        raise ValueError(f"`--forced_bos_token`={token!r} is not a token of the tokenizer{allowed}.")
    return token_id


def set_generation_languages(model: Any, tokenizer: Any, args: TaskOptions) -> None:
    """What generation starts from, as run_translation.py sets it: --forced_bos_token's id as the generation config's
    `forced_bos_token_id` (mBART-50 starts every target with its language code; transformers 5 reads it there only,
    and refuses it on the model's config); and a model trained behind each target's language code (mBART's
    `label_shift="wrap_last_token"`) without a `decoder_start_token_id` starts from --target_lang's code (config and
    generation config). Evaluation, prediction and the saved folder read them."""
    token = getattr(args, "forced_bos_token", None)
    if token is not None:
        model.generation_config.forced_bos_token_id = forced_bos_token_id(tokenizer, token)
    wraps = getattr(model.config, "label_shift", None) == "wrap_last_token"
    if wraps and model.config.decoder_start_token_id is None and language_codes(tokenizer) and args.target_lang:
        code = tokenizer.convert_tokens_to_ids(args.target_lang)
        model.config.decoder_start_token_id = model.generation_config.decoder_start_token_id = code


def with_prefix(sources: Iterable[str], args: TaskOptions) -> list[str]:
    """The sources with --source_prefix before each (a T5-style task prefix, "translate English to German: "), as
    run_translation.py and run_summarization.py put it."""
    prefix = getattr(args, "source_prefix", None) or ""
    return [prefix + source for source in sources]


def pair_texts(train: Any, args: TaskOptions, text_column: str) -> Iterator[str]:
    return (text for row in train for text in (*with_prefix([row[args.source_column]], args), row[args.target_column]))


def tokenize_seq2seq(
    dataset: Any,
    tokenizer: Any,
    args: TaskOptions,
    max_length: int | None,
    num_proc: int | None,
    text_column: str = "text",
    label2id: dict[Any, int] | None = None,
    segments: bool = False,
) -> Any:
    """Sources (after --source_prefix) truncated to --max_source_length and targets to --max_target_length (keeping
    the closing token); `max_length`, the other tasks' truncation, does not apply. Each side is tokenized with its
    own length, as run_translation.py does: one call with `text_target` cut the targets at --max_source_length as
    well. A split without the target column (an unlabeled test split) gets no labels."""

    def encode(batch: dict[str, list]) -> dict[str, list]:
        out = tokenizer(
            with_prefix(batch[args.source_column], args), truncation=True, max_length=args.max_source_length
        )
        encoded = {"input_ids": out["input_ids"], "attention_mask": out["attention_mask"]}
        if args.target_column not in batch:
            return encoded
        targets = tokenizer(text_target=batch[args.target_column], truncation=True, max_length=args.max_target_length)
        encoded["labels"] = [
            ids[: args.max_target_length - 1] + ids[-1:] if len(ids) > args.max_target_length else ids
            for ids in targets["input_ids"]
        ]
        return encoded

    return dataset.map(
        encode, batched=True, num_proc=num_proc, remove_columns=dataset.column_names, desc="Tokenizing pairs"
    )
