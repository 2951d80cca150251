"""The fine-tuning tasks (`--task`), one table row each: the model kind and head it trains, its default data, how
its examples are checked, tokenized and collated, its metrics and Trainer, and what it reports.

- `instruct`: a decoder tuned on conversations with its chat template, loss on the assistant's turns only;
- `classification`: sequence classification from text and label columns, accuracy and macro-F1 (float labels:
  regression, mean squared error and Pearson's r; a list of labels per row: multi-label, subset accuracy and
  micro-F1);
- `seq2seq`: an encoder-decoder evaluated by generation with BLEU, chrF and exact match;
- `token-classification`: a label per word (named entities), as run_ner.py trains it, seqeval's entity-level
  precision, recall and F1 and token accuracy (`token_classification.py`).
- `question-answering`: extractive QA on SQuAD's layout, windows of long contexts, SQuAD's exact match and F1
  (`question_answering.py`).

The classification and seq2seq tasks also predict a test split (`predictions`): one line per example in
`predict_results.txt` (run_glue.py's format), `generated_predictions.txt` (run_translation.py's) or
`predictions.txt` (run_ner.py's).
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
from transformers import (
    AutoModelForQuestionAnswering,
    AutoModelForTokenClassification,
    DataCollatorForSeq2Seq,
    DataCollatorForTokenClassification,
    DataCollatorWithPadding,
    PreTrainedModel,
)

from archlab.modeling.catalogue import POSITION_SCHEMES
from archlab.tokenization.corpus import code_docstring_pairs, instruction_examples
from archlab.tokenization.data import IGNORE_INDEX, check_not_empty
from archlab.tokenization.training import train_tokenizer

from . import question_answering as qa
from . import task_data, token_classification
from .configs import ModelChoices, build_config, build_model
from .kinds import CLASSIFICATION_AUTO_CLASS, model_kind
from .metrics import classification_metrics, seq2seq_metrics, token_classification_metrics, with_perplexity
from .reporting import log
from .sampling import show_chat_example, show_seq2seq_example
from .sources import SPLITS
from .task_data import TaskOptions
from .tokenizers import TokenizerChoices, adopt_context_length, get_tokenizer
from .trainer import AtomicCheckpointTrainer, AtomicSeq2SeqTrainer


class PairCollator(DataCollatorForSeq2Seq):
    """`DataCollatorForSeq2Seq` whose batches of sources alone (a test split without targets) have no `labels` key:
    the stock collator puts `labels: None` in them, so Seq2SeqTrainer's prediction step took the batch as labelled
    and called the model for a loss without decoder inputs ("Pass exactly one of `decoder_input_ids` ...")."""

    def __call__(self, features: list[dict[str, Any]], return_tensors: str | None = None) -> Any:
        batch = super().__call__(features, return_tensors)
        if "labels" in batch and batch["labels"] is None:
            del batch["labels"]
        return batch


@dataclass(frozen=True)
class Task:
    """One fine-tuning task: what it trains and, as functions, each step that differs between tasks."""

    model_kind: str  # the `--model_kind` it trains
    default_data: Callable[[int | None, int | None], Any]  # (max train, max eval) -> DatasetDict, without user data
    prepare: Callable[..., Any]  # (split dataset, split name, options, text column) -> the dataset it tokenizes
    tokenizer_texts: Callable[..., Iterable[str]]  # (train split, options, text column) -> a new tokenizer's texts
    tokenize: Callable[..., Any]  # (dataset, tokenizer, options, max length, processes, text column, label2id,
    # segments: keep `token_type_ids`, the model has segment embeddings)
    collator: Callable[[Any, PreTrainedModel, int], Any]  # (tokenizer, model, the longest example) -> data collator
    trainer_class: type = AtomicCheckpointTrainer
    auto_class: Any = None  # None: the model kind's own head
    compute_metrics: Callable[..., Callable | None] = lambda tokenizer, config, options=None: None  # (tokenizer,
    # model config, the task's options) -> `compute_metrics`
    view: Callable[[dict[str, float]], dict[str, float]] = dict  # adds derived metrics to an evaluation's
    summary_keys: tuple[str, ...] = ("eval_loss",)  # the metrics of its before/after lines
    # what its `compute_metrics` reports, beside the loss (without `view`'s additions, which the Trainer never sees):
    # the metrics --metric_for_best_model can name
    metrics: tuple[str, ...] = ()
    labels: bool = False  # a classification head: label ids from the training split
    token_labels: bool = False  # ... a label per word (token classification), not one per row
    generates: bool = False  # evaluated by generation; its model card's task is translation or summarization
    # (model, tokenizer, example, options, max new tokens, the example's split's features)
    show_example: Callable[..., None] | None = None
    chat: bool = False  # a chat model: its saved generation config stops at the end of a turn too
    predictions: tuple[str, Callable[..., list[str]]] | None = None  # (file name, (outputs, config, tokenizer) ->
    # its lines; with `token_labels`, (outputs, label ids, config)) of the test split's predictions; None: the task
    # has none (--do_predict is refused)
    label_names: tuple[str, ...] = ("labels",)  # the batch's label keys (the Trainer's `label_names`)
    # (options, --block_size) -> the longest tokenized example, before the cap at the model's positions
    max_length: Callable[[Any, int], int] = lambda options, block_size: block_size


TASKS: dict[str, Task] = {
    "instruct": Task(
        model_kind="decoder",
        default_data=task_data.embedded_examples(instruction_examples),
        prepare=task_data.prepare_instruct,
        tokenizer_texts=task_data.instruct_texts,
        tokenize=task_data.tokenize_instruct,
        collator=lambda tokenizer, model, max_length: DataCollatorForSeq2Seq(
            tokenizer, label_pad_token_id=IGNORE_INDEX
        ),
        view=with_perplexity,
        summary_keys=("eval_loss", "eval_perplexity"),
        show_example=show_chat_example,
        chat=True,
    ),
    "classification": Task(
        model_kind="decoder",
        default_data=task_data.needs_train_file,
        prepare=task_data.check_classification_columns,
        tokenizer_texts=task_data.classification_texts,
        tokenize=task_data.tokenize_classification,
        collator=lambda tokenizer, model, max_length: DataCollatorWithPadding(tokenizer),
        auto_class=CLASSIFICATION_AUTO_CLASS,
        compute_metrics=lambda tokenizer, config, options=None: classification_metrics,
        summary_keys=("eval_loss", "eval_accuracy", "eval_f1", "eval_mse", "eval_pearson"),
        metrics=("accuracy", "f1", "mse", "pearson"),
        labels=True,
        predictions=("predict_results.txt", lambda outputs, config, tokenizer: classification_lines(outputs, config)),
    ),
    "seq2seq": Task(
        model_kind="seq2seq",
        default_data=task_data.embedded_examples(code_docstring_pairs),
        prepare=task_data.check_pair_columns,
        tokenizer_texts=task_data.pair_texts,
        tokenize=task_data.tokenize_seq2seq,
        collator=lambda tokenizer, model, max_length: PairCollator(
            tokenizer, model=model, label_pad_token_id=IGNORE_INDEX
        ),
        trainer_class=AtomicSeq2SeqTrainer,
        compute_metrics=lambda tokenizer, config, options=None: seq2seq_metrics(tokenizer),
        summary_keys=("eval_loss", "eval_bleu", "eval_chrf", "eval_exact_match"),
        metrics=("bleu", "chrf", "exact_match"),
        generates=True,
        show_example=show_seq2seq_example,
        predictions=(
            "generated_predictions.txt",
            lambda outputs, config, tokenizer: generated_lines(outputs, tokenizer),
        ),
    ),
    "token-classification": Task(
        model_kind="decoder",
        default_data=token_classification.needs_train_file,
        prepare=token_classification.check_token_classification_columns,
        tokenizer_texts=token_classification.token_classification_texts,
        tokenize=token_classification.tokenize_token_classification,
        collator=lambda tokenizer, model, max_length: DataCollatorForTokenClassification(tokenizer),
        auto_class=AutoModelForTokenClassification,
        compute_metrics=lambda tokenizer, config, options=None: token_classification_metrics(
            config.id2label, getattr(options, "return_entity_level_metrics", False)
        ),
        summary_keys=("eval_loss", "eval_precision", "eval_recall", "eval_f1", "eval_accuracy"),
        metrics=("precision", "recall", "f1", "accuracy"),
        labels=True,
        token_labels=True,
        predictions=("predictions.txt", token_classification.prediction_lines),
    ),
    "question-answering": Task(
        model_kind="decoder",
        default_data=task_data.embedded_examples(qa.function_questions),
        prepare=qa.check_question_answering_columns,
        tokenizer_texts=qa.question_answering_texts,
        tokenize=qa.tokenize_question_answering,
        collator=lambda tokenizer, model, max_length: qa.QuestionAnsweringCollator(tokenizer, max_length),
        trainer_class=qa.QuestionAnsweringTrainer,
        auto_class=AutoModelForQuestionAnswering,
        summary_keys=("eval_loss", "eval_exact_match", "eval_f1"),
        metrics=("exact_match", "f1", *qa.SQUAD_V2_BREAKDOWN),
        predictions=(qa.PREDICTIONS_FILE, qa.prediction_lines),
        label_names=("start_positions", "end_positions"),
        max_length=lambda options, block_size: options.max_seq_length,
    ),
}


def classification_lines(outputs: np.ndarray, config: Any) -> list[str]:
    """`index<TAB>prediction` lines under an `index<TAB>prediction` header, as run_glue.py and run_classification.py
    write them: the class name; a regression head's value (3 decimals); a multi-label head's list of the classes
    whose logit is above 0 (sigmoid 0.5)."""
    logits = outputs[0] if isinstance(outputs, tuple) else outputs
    lines = ["index\tprediction"]
    for index, row in enumerate(logits):
        if config.problem_type == "regression":
            item = f"{row[0]:3.3f}"
        elif config.problem_type == "multi_label_classification":
            item = str([config.id2label[i] for i in np.flatnonzero(row > 0)])
        else:
            item = config.id2label[int(np.argmax(row))]
        lines.append(f"{index}\t{item}")
    return lines


def generated_lines(outputs: np.ndarray, tokenizer: Any) -> list[str]:
    """One generated text per example, without special tokens, stripped, as run_translation.py writes them; a line
    break inside a text is written as a space, so that line i stays example i."""
    ids = outputs[0] if isinstance(outputs, tuple) else outputs
    ids = np.where(ids < 0, tokenizer.pad_token_id, ids)
    return [" ".join(text.split("\n")).strip() for text in tokenizer.batch_decode(ids, skip_special_tokens=True)]


def predict_test_split(task: Task, trainer: Any, test: Any, tokenizer: Any, output_dir: str) -> dict[str, float]:
    """The trained model's predictions of the test split written to `output_dir` (the task's file, one line per
    example), and the metrics `predict_*` where the split has labels (saved as `predict_results.json` and into
    `all_results.json`, as the Trainer saves them). Returns the metrics."""
    name, lines_of = task.predictions
    output = trainer.predict(test, metric_key_prefix="predict")
    metrics = dict(output.metrics)
    trainer.log_metrics("predict", metrics)
    trainer.save_metrics("predict", metrics)
    if trainer.is_world_process_zero():
        if task.token_labels:  # (the scored tokens, the words' first sub-tokens, are those with a label)
            lines = lines_of(output.predictions, output.label_ids, trainer.model.config)
        else:
            lines = lines_of(output.predictions, trainer.model.config, tokenizer)
        with open(os.path.join(output_dir, name), "w", encoding="utf-8") as f:
            f.write("".join(line + "\n" for line in lines))
    return metrics


def check_installed(task: Task) -> None:
    """The optional packages a task's metrics need, checked before training rather than after it."""
    if task.generates and importlib.util.find_spec("sacrebleu") is None:
        raise ImportError("--task seq2seq reports BLEU/chrF with sacrebleu: pip install 'archlab[scripts]'.")


def prepare_splits(task: Task, raw: Any, options: TaskOptions, text_column: str) -> Any:
    """Each split checked to be non-empty and put in the form the task tokenizes (a test split may lack labels)."""
    for split in [*SPLITS, *(["test"] if "test" in raw else [])]:
        check_not_empty(raw[split], split)
        raw[split] = task.prepare(raw[split], split, options, text_column)
    return raw


def task_tokenizer(
    task: Task, choices: TokenizerChoices, train: Any, options: TaskOptions, text_column: str, resume: str | None
) -> Any:
    """`get_tokenizer` for fine-tuning: a new tokenizer is trained on the task's training texts."""

    def train_new() -> Any:
        log(f"Training a tokenizer for the {task.model_kind} on the task's texts ...")
        return train_tokenizer(
            task.tokenizer_texts(train, options, text_column),
            task.model_kind,
            choices.tokenizer_algorithm,
            choices.tokenizer_vocab_size or 4096,
        )

    tokenizer = get_tokenizer(choices, resume, train_new)
    pad_with_eos(tokenizer)
    return tokenizer


def pad_with_eos(tokenizer: Any) -> None:
    """A tokenizer without a pad token (a converted Llama's, say) pads the batches with its end-of-sequence token, as
    TRL's trainers do: the collators failed with "Asking to pad but the tokenizer does not have a padding token" at
    the first evaluation, after the data and model were prepared. The padding is masked out (`attention_mask` 0,
    labels -100), and the classifier pools the last token the mask keeps, so what pads does not matter. (The Trainer
    then aligns the model's `pad_token_id` with the tokenizer's, as it does for every run.)"""
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        log(
            f"The tokenizer has no pad token: batches are padded with its end-of-sequence token {tokenizer.eos_token!r}"
        )
        tokenizer.pad_token = tokenizer.eos_token


def check_lengths_fit_the_position_table(config: Any, options: TaskOptions) -> None:
    """An encoder-decoder with a position table (sinusoidal, learned) has positions for `max_position_embeddings`
    tokens per side: longer sources or targets are refused here, naming the flag, not in the first forward."""
    if not POSITION_SCHEMES[config.position_embedding_type].table:
        return
    limit = config.max_position_embeddings
    for flag in ("max_source_length", "max_target_length"):
        if getattr(options, flag) > limit:
            raise ValueError(
                f"--{flag} {getattr(options, flag)} is more than the model's {limit} positions "
                f"(max_position_embeddings of its {config.position_embedding_type} table): pass --{flag} {limit} "
                "or less, or a model with more positions."
            )


def build_task_model(
    task: Task,
    choices: ModelChoices,
    raw: Any,
    tokenizer: Any,
    options: TaskOptions,
    text_column: str,
    block_size: int,
    num_proc: int | None,
    attn_implementation: str | None = None,
    tokenizing: contextlib.AbstractContextManager | None = None,
) -> dict[str, Any]:
    """The task's config and model (its head), its tokenized splits and its collator, as `model`, `train`,
    `validation` (and `test` where `raw` has one) and `collator`. Examples are truncated rather than packed, to at
    most what the model positions. `tokenizing` is entered around the tokenization alone (the scripts'
    `first_process_writes_the_cache`); building the model can be collective (DeepSpeed ZeRO-3), so no process may
    wait for the others there."""
    label2id: dict[Any, int] | None = {}
    per_row = task.labels and not task.token_labels  # one label per row (not one per word)
    regression = per_row and task_data.is_regression(raw["train"], options.label_column_name)
    multi_label = per_row and task_data.is_multi_label(raw["train"], options.label_column_name)
    if task.labels and not regression:
        label_maps = token_classification.label_maps if task.token_labels else task_data.label_maps
        label2id, id2label = label_maps(raw["train"], options.label_column_name)
        for split in raw:
            if split != "train":  # before the model is built: the error names the split
                task_data.check_known_labels(raw[split], options.label_column_name, label2id, split)
    config = build_config(choices, tokenizer, None, num_labels=1 if regression else len(label2id) or None)
    if task.model_kind == "seq2seq":
        check_lengths_fit_the_position_table(config, options)
    max_length = min(task.max_length(options, block_size), config.max_position_embeddings)
    auto_class = task.auto_class or model_kind(task.model_kind).auto_class
    # a classifier's own labels, to fine-tune on
    head = classifier_head_labels(config, auto_class) if task.labels else None
    if head is not None and label2id:
        label2id, id2label = keep_the_heads_label_ids(head, label2id, id2label)
    new_head = head is not None and len(head) != (1 if regression else len(label2id))
    if new_head:
        labels = ", ".join(sorted(head, key=head.get))
        log(f"{choices.model_name_or_path}'s classifier has {len(head)} outputs ({labels}); a new head is trained")
    other = other_classifier_head(config, auto_class) if task.labels else None
    if other is not None:
        kind = auto_class.__name__.removeprefix("AutoModelFor")
        log(f"{choices.model_name_or_path} holds a {other}, another task's head: a new {kind} head is trained")
        new_head = True
    if regression:  # one output trained by mean squared error; the tokenized labels are floats (label2id None)
        config.num_labels, config.problem_type, label2id = 1, "regression", None
    elif label2id:
        config.num_labels, config.id2label, config.label2id = (
            len(id2label),
            id2label,
            {v: k for k, v in id2label.items()},
        )
        # a list of labels per row: one sigmoid output per class, trained by binary cross-entropy
        if not task.token_labels:  # (a token classifier's loss is always cross-entropy: no problem type, as run_ner)
            config.problem_type = "multi_label_classification" if multi_label else "single_label_classification"
    # a BERT's segment embeddings read token_type_ids; one segment type (a RoBERTa's, or a masked LM exported to BERT
    # and back) is segment 0 everywhere, what the model reads without them: a pair's segment ids 1 would index past it
    segments = (getattr(config, "type_vocab_size", None) or 0) > 1
    if segments:
        returns_segment_ids(tokenizer)
    with tokenizing or contextlib.nullcontext():
        data = {
            s: task.tokenize(raw[s], tokenizer, options, max_length, num_proc, text_column, label2id, segments)
            for s in raw
        }
    check_not_empty(data["train"], "tokenized train")
    kind = model_kind(task.model_kind)
    adopt_context_length(tokenizer, config, kind)

    model = build_model(auto_class, config, choices.model_name_or_path, attn_implementation, new_head, choices.dtype)
    log(
        f"{type(model).__name__}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters; "
        f"{len(data['train'])} training and {len(data['validation'])} validation examples"
    )
    if not task.chat:
        # a classifier's, a tagger's or an extractive QA model's folder serves plain forwards (its pipelines, the
        # Trainer's evaluation), where positions count from a row's first column: padded on the left, a model with a
        # position table read its text at other positions (pipeline("text-classification") scores 0.7 apart from
        # the text alone); saved so, as GPT-2's and BERT's tokenizers pad
        tokenizer.padding_side = "right"
    return {**data, "model": model, "collator": task.collator(right_padding(tokenizer), model, max_length)}


def right_padding(tokenizer: Any) -> Any:
    """`tokenizer` as the collators pad with it: on the right, whatever side it pads for generation (archlab's
    decoder tokenizer, Llama's, pad on the left), so a batch's positions, labels and pooled tokens are those of
    the unpadded examples for every position scheme, as they were before decoder tokenizers padded on the left.
    A copy, so the tokenizer saved with the model keeps its side."""
    if tokenizer.padding_side == "right":
        return tokenizer
    padded = copy.copy(tokenizer)
    padded.padding_side = "right"
    return padded


def returns_segment_ids(tokenizer: Any) -> None:
    """The tokenizer of a model with segment embeddings returns `token_type_ids` by default, as BERT's does (RoBERTa's,
    one segment type, does not), and is saved so (`save_tokenizer` keeps `model_input_names`): archlab's masked-LM
    tokenizer leaves them out, so `pipeline("text-classification")` fed a classifier trained on sentence pairs
    segment 0 for the second text as well, and its scores were not those of the model fine-tuned on the pairs."""
    if "token_type_ids" not in tokenizer.model_input_names:
        tokenizer.model_input_names = [*tokenizer.model_input_names, "token_type_ids"]


def classifier_head_labels(config: Any, auto_class: Any = CLASSIFICATION_AUTO_CLASS) -> dict[str, int] | None:
    """The label -> id map of a pretrained classifier's head of `auto_class`'s kind (its `architectures` say it has
    one: `...ForSequenceClassification`, `...ForTokenClassification`), else None: a language model's config holds a
    placeholder `label2id` (LABEL_0, LABEL_1) and no head."""
    suffix = auto_class.__name__.removeprefix("AutoModel")
    if not any(name.endswith(suffix) for name in getattr(config, "architectures", None) or ()):
        return None
    return {str(name): int(i) for i, name in config.id2label.items()}  # (a config may hold no label2id)


CLASSIFIER_HEADS = ("ForSequenceClassification", "ForTokenClassification")


def other_classifier_head(config: Any, auto_class: Any) -> str | None:
    """The architecture of a classifier of another kind than `auto_class`'s (a sequence classifier's folder given to a
    token classifier, or the other way round), else None: both heads are `score` (`classifier` for the encoder's), so
    the other head's weights loaded as this one's, and of another number of labels failed at the load ("You set
    `ignore_mismatched_sizes` to `False`"), after the data was tokenized."""
    suffix = auto_class.__name__.removeprefix("AutoModel")
    names = getattr(config, "architectures", None) or ()
    return next((name for name in names if name.endswith(CLASSIFIER_HEADS) and not name.endswith(suffix)), None)


def keep_the_heads_label_ids(
    head: dict[str, int], label2id: dict[Any, int], id2label: dict[int, str]
) -> tuple[dict[Any, int], dict[int, str]]:
    """The data's labels under the ids of the classifier being fine-tuned when it has the same labels, as run_glue.py
    does: the sorted order of the data gave a head trained on `pos`=0, `neg`=1 the ids the other way round, and
    every prediction of the pretrained head was read as the other class (accuracy 1.0 -> 0.0 before training)."""
    if set(head) != set(id2label.values()):
        return label2id, id2label
    relabel = {i: head[name] for i, name in id2label.items()}
    return {value: relabel[i] for value, i in label2id.items()}, {relabel[i]: name for i, name in id2label.items()}


def card_pipeline_tag(task: Task, chosen: str | None, own_data: bool) -> str | None:
    """The model card's Hub task: the class's default (None), or for a generating task the one chosen, else
    summarization for the embedded code -> docstring task and translation for the user's own data."""
    if not task.generates:
        return None
    return chosen or ("translation" if own_data else "summarization")
