"""Extractive question answering (`--task question-answering`), as transformers' run_qa.py does it on SQuAD's
layout: a `question`, a `context` and `answers` = {"text": [...], "answer_start": [...]} per row.

- Tokenization (`tokenize_question_answering`): each question and context as the tokenizer's pair, the question
  first, `truncation="only_second"` to `--max_seq_length` tokens; a context that does not fit is cut into windows
  that overlap by `--doc_stride` tokens (`return_overflowing_tokens`), each window a training feature. A window's
  labels are the first and last token of the row's first answer, or index 0 for both where the window does not hold
  the whole answer (or the row has none). Index 0 is BERT's [CLS]; for a decoder it is the first token (its
  tokenizer's `<s>`), which under causal attention sees only itself: its score is a learned "no answer here" bias.
- Collation (`QuestionAnsweringCollator`): every window is padded on the right to the window length
  (`--max_seq_length`, capped at the model's positions), as run_qa.py pads by default (`--pad_to_max_length`).
  On the right whatever the tokenizer's `padding_side`, so the labels and the offsets, computed on the unpadded
  features, keep pointing at the same tokens (left padding, a decoder tokenizer's usual side for generation, shifted
  every position of a short row). To one length, since the start and end cross-entropies are softmaxes over every
  position, padding included: padded to the longest window of its batch, a window's loss depended on the batch it
  fell in, and 2 processes x 2 windows, or 2 accumulated batches of 2, did not train the model 4 windows at once
  train.
- Evaluation (`QuestionAnsweringTrainer`, `best_spans`): each feature's `--n_best_size` best starts and ends
  over the context's tokens, spans of at most `--max_answer_length` tokens that end at or after their start, the best
  sum of start and end logits over all windows of a row mapped back to the context's characters by the offsets;
  scored by SQuAD's exact match and F1 (`squad_metrics`, the official v1.1 script's normalisation). Each evaluation
  and prediction writes utils_qa.py's files to --output_dir (`write_span_predictions`):
  `{eval,predict}_predictions.json` ({id: answer}), `{eval,predict}_nbest_predictions.json` (each row's n-best
  spans with their logits and probabilities) and, with --version_2_with_negative, `{eval,predict}_null_odds.json`.
- SQuAD v2 (`--version_2_with_negative`, run_qa.py's flag): rows without an answer are trained towards index 0 (as
  without the flag), and a row is predicted "" (no answer) where its null score, the smallest over its windows of
  the start and end logits at index 0, exceeds its best span's score by more than `--null_score_diff_threshold`
  (utils_qa.py's `postprocess_qa_predictions`); scored by `squad_v2_metrics`: exact match and F1 over every row, and
  the `HasAns_*` / `NoAns_*` breakdowns of the squad_v2 metric. Without the flag every row gets its best span, and an
  evaluated split's rows without an answer are announced (they score 0).
"""

from __future__ import annotations

import collections
import json
import os
import re
import string
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
from datasets import Dataset
from transformers.trainer_utils import EvalLoopOutput

from archlab.tokenization.corpus import code_docstring_pairs
from archlab.tokenization.data import check_columns, check_text_columns

from .reporting import log
from .trainer import AtomicCheckpointTrainer

CLS_INDEX = 0  # the label of a window without the answer (see the module's docstring)
PREDICTIONS_FILE = "predict_predictions.json"  # run_qa.py's name for the test split's predictions
# utils_qa.py's files, written to --output_dir by each evaluation ("eval") and prediction ("predict")
OUTPUT_FILES = {"answers": "predictions.json", "nbest": "nbest_predictions.json", "null_odds": "null_odds.json"}
MODEL_INPUTS = ("input_ids", "attention_mask", "token_type_ids", "start_positions", "end_positions")


class QuestionAnsweringOptions(Protocol):
    """The finetune script's question-answering flags (`FinetuneArguments`)."""

    question_column: str
    context_column: str
    answer_column: str
    max_seq_length: int
    doc_stride: int
    n_best_size: int
    max_answer_length: int
    version_2_with_negative: bool
    null_score_diff_threshold: float


# ---------------------------------------------------------------------------------------------------------------
# Examples when the user gives no data
# ---------------------------------------------------------------------------------------------------------------
def function_questions(split: str) -> Iterator[dict[str, Any]]:
    """SQuAD-layout questions about the embedded corpus's functions: the context is a function's code, the questions
    ask its name and its first parameter (where it has one), answered by spans of the code. Each row has its own
    id: a file's second function of a name (two classes' `__init__`) is `path:name#2`, since the evaluation refuses
    ids that repeat."""
    seen: dict[tuple[str, str], int] = {}
    for pair in code_docstring_pairs(split, max_code_chars=600):
        code, name = pair["code"], pair["name"]
        found = re.search(rf"def {re.escape(name)}\(\s*(\w+)", code)
        at = code.find(f"def {name}(")
        if at < 0:
            continue
        count = seen[pair["path"], name] = seen.get((pair["path"], name), 0) + 1
        function = f"{pair['path']}:{name}" + (f"#{count}" if count > 1 else "")
        yield _row(f"{function}:name", "What is the name of the function?", code, name, at + 4)
        if found is not None:
            yield _row(
                f"{function}:parameter",
                f"What is the first parameter of {name}?",
                code,
                found.group(1),
                found.start(1),
            )


def _row(row_id: str, question: str, context: str, answer: str, start: int) -> dict[str, Any]:
    return {
        "id": row_id,
        "question": question,
        "context": context,
        "answers": {"text": [answer], "answer_start": [start]},
    }


# ---------------------------------------------------------------------------------------------------------------
# Columns
# ---------------------------------------------------------------------------------------------------------------
def check_question_answering_columns(dataset: Any, split: str, args: QuestionAnsweringOptions, text_column: str) -> Any:
    """The question, context and answer columns, checked; each answer is SQuAD's {"text": [...], "answer_start":
    [...]} whose texts are at their starts in the context (an answer at another offset trained the wrong tokens
    without a word). A test split may come without answers (it is then predicted only)."""
    question, context, answers = args.question_column, args.context_column, args.answer_column
    flags = ["--question_column", "--context_column", "--answer_column"]
    if split == "test" and answers not in dataset.column_names:
        check_columns(dataset, question, context, split=split, flags=flags[:2])
        check_text_columns(dataset, question, context, split=split)
        check_unique_ids(dataset, split)
        return dataset
    check_columns(dataset, question, context, answers, split=split, flags=flags)
    check_text_columns(dataset, question, context, split=split)
    for row, (answer, text) in enumerate(zip(dataset[answers], dataset[context])):
        check_answer(answer, text, f"Column {answers!r} of the {split} split: row {row}")
    check_unique_ids(dataset, split)
    unanswerable = sum(not answer["text"] for answer in dataset[answers])
    if unanswerable and split != "train" and not getattr(args, "version_2_with_negative", False):
        log(
            f"Warning: {unanswerable} of the {len(dataset)} rows of the {split} split have no answer (SQuAD v2's): "
            "without --version_2_with_negative every row is given its best span, so these rows score 0 "
            f"(exact match and F1 at most {100 * (1 - unanswerable / len(dataset)):.1f}); pass it to predict "
            '"no answer" (""), as run_qa.py does.'
        )
    return dataset


def check_unique_ids(dataset: Any, split: str) -> None:
    """The `id` column of a split that is evaluated or predicted names one row each: answers are kept, scored and
    written (`predict_predictions.json`) by id, so rows sharing an id (an article's id given to each of its
    questions, say) were reduced to the last of them, and exact match and F1 were the scores of fewer rows, without
    a word. (The training split's ids are not read.)"""
    if split == "train" or "id" not in dataset.column_names:
        return
    first: dict[str, int] = {}
    for row, row_id in enumerate(dataset["id"]):
        if str(row_id) in first:
            raise ValueError(
                f"Column 'id' of the {split} split: rows {first[str(row_id)]} and {row} share the id {row_id!r}; "
                "each question's answer is scored and written under its id: give every row its own id, or drop "
                "the column (the rows are then numbered)."
            )
        first[str(row_id)] = row


def check_answer(answer: Any, context: str, where: str) -> None:
    """One row's answers: SQuAD's dict of equally long `text` and `answer_start` lists, each text at its start."""
    if not isinstance(answer, dict) or not {"text", "answer_start"} <= answer.keys():
        raise ValueError(
            f'{where} holds {answer!r}, not SQuAD\'s answers {{"text": [...], "answer_start": [...]}} (the texts and '
            "their character offsets in the context); name the column with --answer_column."
        )
    texts, starts = answer["text"], answer["answer_start"]
    if not isinstance(texts, list) or not isinstance(starts, list) or len(texts) != len(starts):
        raise ValueError(f"{where}: `text` and `answer_start` are lists of one entry per answer, got {answer!r}.")
    for text, start in zip(texts, starts):
        if not isinstance(text, str) or not text or not isinstance(start, int) or start < 0:
            raise ValueError(
                f"{where}: an answer is a non-empty text and its offset (an integer >= 0), got {answer!r}."
            )
        if context[start : start + len(text)] != text:
            raise ValueError(
                f"{where}: the answer {text!r} is not at character {start} of the context (which reads "
                f"{context[start : start + len(text)]!r} there); `answer_start` is the offset of the answer's first "
                "character in the context."
            )


def question_answering_texts(train: Any, args: QuestionAnsweringOptions, text_column: str) -> Iterator[str]:
    """The texts a new tokenizer learns: each row's question and context."""
    return (row[column] for row in train for column in (args.question_column, args.context_column))


def check_windows(args: QuestionAnsweringOptions) -> None:
    """--doc_stride below --max_seq_length, --n_best_size and --max_answer_length at least 1: checked before
    anything is read (the tokenizer failed on a stride past the window inside `datasets.map`); a
    --null_score_diff_threshold only with --version_2_with_negative (run_qa.py ignored it without a word)."""
    threshold = getattr(args, "null_score_diff_threshold", 0.0)
    if threshold != 0.0 and not getattr(args, "version_2_with_negative", False):
        raise ValueError(
            f'--null_score_diff_threshold {threshold:g} decides when SQuAD v2\'s "no answer" is predicted: it '
            "applies with --version_2_with_negative only (without it every row is predicted a span)."
        )
    if not np.isfinite(threshold):
        raise ValueError(f"--null_score_diff_threshold must be a finite number, got {threshold}.")
    for flag in ("max_seq_length", "doc_stride", "n_best_size", "max_answer_length"):
        value = getattr(args, flag)
        if value < (0 if flag == "doc_stride" else 1):
            raise ValueError(f"--{flag} must be {'>= 0' if flag == 'doc_stride' else '>= 1'}, got {value}.")
    if args.doc_stride >= args.max_seq_length:
        raise ValueError(
            f"--doc_stride {args.doc_stride} must be less than --max_seq_length {args.max_seq_length}: it is the "
            "overlap of consecutive windows of a long context (run_qa.py's default: 128 of 384)."
        )


# ---------------------------------------------------------------------------------------------------------------
# Tokenization: windows and their labels
# ---------------------------------------------------------------------------------------------------------------
def tokenize_question_answering(
    dataset: Any,
    tokenizer: Any,
    args: QuestionAnsweringOptions,
    max_length: int,
    num_proc: int | None,
    text_column: str = "text",
    label2id: dict[Any, int] | None = None,
    segments: bool = False,
) -> Any:
    """Features of at most `max_length` tokens (the task's `--max_seq_length`, capped at the model's positions):
    `input_ids`, `attention_mask` (`token_type_ids` with segments), the labels `start_positions` /
    `end_positions` where the split has answers, and for evaluation `example_id` (the row), `offset_mapping` (the
    context's tokens' character spans, None elsewhere), the row's `id`, context and answers."""
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(
            "--task question-answering maps answers to tokens through the offsets of a fast tokenizer "
            f"(`return_offsets_mapping`); {type(tokenizer).__name__} is not one."
        )
    stride = args.doc_stride
    has_answers = args.answer_column in dataset.column_names
    ids = dataset["id"] if "id" in dataset.column_names else [str(i) for i in range(len(dataset))]
    dataset = dataset.add_column("__row__", list(range(len(dataset))))
    dataset = dataset.add_column("__id__", [str(i) for i in ids])

    def encode(batch: dict[str, list]) -> dict[str, list]:
        questions = [q.lstrip() for q in batch[args.question_column]]  # (run_qa.py: leading blanks waste the window)
        contexts = batch[args.context_column]
        check_room_for_the_context(tokenizer, questions, batch["__row__"], max_length, stride)
        out = tokenizer(
            questions,
            contexts,
            truncation="only_second",
            max_length=max_length,
            stride=stride,
            return_overflowing_tokens=True,
            return_offsets_mapping=True,
            return_token_type_ids=segments,
        )
        rows = out.pop("overflow_to_sample_mapping")
        encoded: dict[str, list] = {"input_ids": out["input_ids"], "attention_mask": out["attention_mask"]}
        if segments and "token_type_ids" in out:
            encoded["token_type_ids"] = out["token_type_ids"]
        starts, ends, offsets = [], [], []
        for i, row in enumerate(rows):
            sequence_ids = out.sequence_ids(i)
            if has_answers:
                start, end = answer_tokens(batch[args.answer_column][row], out["offset_mapping"][i], sequence_ids)
                starts.append(start)
                ends.append(end)
            offsets.append([o if s == 1 else None for o, s in zip(out["offset_mapping"][i], sequence_ids)])
        if has_answers:
            encoded["start_positions"], encoded["end_positions"] = starts, ends
            encoded["answers"] = [batch[args.answer_column][row] for row in rows]
        encoded["offset_mapping"] = offsets
        encoded["example_id"] = [batch["__row__"][row] for row in rows]
        encoded["id"] = [batch["__id__"][row] for row in rows]
        encoded["context"] = [contexts[row] for row in rows]
        return encoded

    return dataset.map(
        encode, batched=True, num_proc=num_proc, remove_columns=dataset.column_names, desc="Tokenizing windows"
    )


def check_room_for_the_context(
    tokenizer: Any, questions: list[str], rows: list[int], max_length: int, stride: int
) -> None:
    """Each window keeps more context tokens than the stride after its question and special tokens: where it did not,
    the `tokenizers` library panicked (a `PanicException`, "`stride` must be strictly less than `max_len`", which
    escapes `except Exception`) or failed with "Second sequence not long enough to be truncated", naming neither the
    row nor the flags."""
    specials = tokenizer.num_special_tokens_to_add(pair=True)
    lengths = [len(ids) for ids in tokenizer(questions, add_special_tokens=False)["input_ids"]]
    for row, length in zip(rows, lengths):
        room = max_length - specials - length
        if room <= stride:
            raise ValueError(
                f"Row {row}'s question is {length} tokens long: with {specials} special tokens, a window of "
                f"{max_length} tokens (--max_seq_length, capped at the model's positions) keeps {max(room, 0)} for "
                f"the context, which must be more than --doc_stride ({stride}), the overlap of its windows. Give a "
                "larger --max_seq_length or a smaller --doc_stride, or shorten the question."
            )


def answer_tokens(answers: dict[str, list], offsets: list, sequence_ids: list) -> tuple[int, int]:
    """The first and last token of the first answer in one window (`offsets`: every token's character span in its
    own text; `sequence_ids`: 0 question, 1 context, None special), or (`CLS_INDEX`, `CLS_INDEX`) where the window
    does not hold all of it, or the row has no answer: run_qa.py's `prepare_train_features`."""
    if not answers["answer_start"]:
        return CLS_INDEX, CLS_INDEX
    start_char = answers["answer_start"][0]
    end_char = start_char + len(answers["text"][0])
    context = [i for i, s in enumerate(sequence_ids) if s == 1]
    if not context:
        return CLS_INDEX, CLS_INDEX
    first, last = context[0], context[-1]
    if not (offsets[first][0] <= start_char and offsets[last][1] >= end_char):
        return CLS_INDEX, CLS_INDEX
    start = first
    while start <= last and offsets[start][0] <= start_char:
        start += 1
    end = last
    while end >= first and offsets[end][1] >= end_char:
        end -= 1
    return start - 1, end + 1


class QuestionAnsweringCollator:
    """Pads the model's inputs and labels of a batch of features on the right to `max_length` tokens (the window
    length), whatever the tokenizer's `padding_side` (see the module's docstring); the evaluation's columns (offsets,
    ids, contexts) stay behind."""

    def __init__(self, tokenizer: Any, max_length: int) -> None:
        self.tokenizer = tokenizer
        self.max_length = max_length

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        kept = [{k: v for k, v in feature.items() if k in MODEL_INPUTS} for feature in features]
        return self.tokenizer.pad(
            kept, padding="max_length", max_length=self.max_length, return_tensors="pt", padding_side="right"
        )


# ---------------------------------------------------------------------------------------------------------------
# From logits to answers, and SQuAD's metric
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class SpanPredictions:
    """What `best_spans` finds for the rows of an evaluated or predicted split, keyed by row id (see there)."""

    answers: dict[str, str]
    nbest: dict[str, list[dict[str, Any]]]
    null_odds: dict[str, float] | None  # with --version_2_with_negative only


def best_spans(
    features: Any,
    start_logits: np.ndarray,
    end_logits: np.ndarray,
    n_best_size: int,
    max_answer_length: int,
    version_2_with_negative: bool = False,
    null_score_diff_threshold: float = 0.0,
) -> SpanPredictions:
    """Each row's answer, its n-best list and (SQuAD v2) its null odds, as utils_qa.py's
    `postprocess_qa_predictions` computes them. Over every window of a row, the `n_best_size` best starts and ends
    among the context's tokens, spans of at most `max_answer_length` tokens that end at or after their start, scored
    by the sum of their two logits and read from the context by the offsets. Logits past a feature's tokens (the
    evaluation pads batches with -100) are never read.

    - `answers`: {row id: the best span's text}; "" for a row without any such span (utils_qa.py predicts the text
      "empty" there).
    - `nbest`: {row id: the `n_best_size` best spans over the row's windows, best first, each {"start_logit",
      "end_logit", "text", "probability"}}, the probability a softmax over the listed spans' scores; with
      `version_2_with_negative` the null answer ("" at index 0, the row's null score) is one of them, appended where
      it is not among the best. A row without a span lists the null answer alone, or nothing (utils_qa.py lists a
      placeholder "empty" of logits 0 there).
    - `null_odds` (`version_2_with_negative`): {row id: null score minus the best span's score}, utils_qa.py's
      `null_odds.json`. A row's null score is the smallest over its windows of the start and end logits at index 0
      (`CLS_INDEX`); the row is predicted "" where its null odds are above `null_score_diff_threshold`. A row
      without a span is scored against utils_qa.py's placeholder of logits 0 (and predicted "")."""
    candidates: dict[int, list[dict[str, Any]]] = collections.defaultdict(list)
    null: dict[int, dict[str, Any]] = {}
    ids: dict[int, str] = {}
    for i, (row, row_id, offsets, context) in enumerate(
        zip(features["example_id"], features["id"], features["offset_mapping"], features["context"])
    ):
        ids[row] = row_id
        n = len(offsets)
        starts, ends = start_logits[i][:n], end_logits[i][:n]
        window_null = float(starts[CLS_INDEX] + ends[CLS_INDEX])
        if row not in null or window_null < null[row]["score"]:
            null[row] = _span(window_null, starts[CLS_INDEX], ends[CLS_INDEX], "")
        for s in np.argsort(starts)[::-1][:n_best_size]:
            if offsets[s] is None:
                continue
            for e in np.argsort(ends)[::-1][:n_best_size]:
                if offsets[e] is None or e < s or e - s + 1 > max_answer_length:
                    continue
                text = context[offsets[s][0] : offsets[e][1]].strip()
                candidates[row].append(_span(float(starts[s] + ends[e]), starts[s], ends[e], text))
    result = SpanPredictions({}, {}, {} if version_2_with_negative else None)
    for row in sorted(ids):
        spans = sorted(candidates[row], key=lambda span: span["score"], reverse=True)  # (stable: ties keep order)
        best = spans[0] if spans else None
        listed = spans[:n_best_size]
        if version_2_with_negative:
            listed = sorted([*spans, null[row]], key=lambda span: span["score"], reverse=True)[:n_best_size]
            if not any(span is null[row] for span in listed):
                listed.append(null[row])
            odds = null[row]["score"] - (best["score"] if best is not None else 0.0)
            result.null_odds[ids[row]] = odds
            predicted = "" if best is None or odds > null_score_diff_threshold else best["text"]
        else:
            predicted = best["text"] if best is not None else ""
        result.answers[ids[row]] = predicted
        result.nbest[ids[row]] = _with_probabilities(listed)
    return result


def _span(score: float, start_logit: Any, end_logit: Any, text: str) -> dict[str, Any]:
    return {"score": score, "start_logit": float(start_logit), "end_logit": float(end_logit), "text": text}


def _with_probabilities(spans: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """utils_qa.py's n-best entries: the scores turned into probabilities by a softmax over the list."""
    if not spans:
        return []
    scores = np.array([span["score"] for span in spans], dtype=np.float64)
    weights = np.exp(scores - scores.max())
    probabilities = weights / weights.sum()
    return [
        {"start_logit": s["start_logit"], "end_logit": s["end_logit"], "text": s["text"], "probability": float(p)}
        for s, p in zip(spans, probabilities)
    ]


def answers_from_logits(
    features: Any,
    start_logits: np.ndarray,
    end_logits: np.ndarray,
    n_best_size: int,
    max_answer_length: int,
    version_2_with_negative: bool = False,
    null_score_diff_threshold: float = 0.0,
) -> dict[str, str]:
    """{row id: answer text}: `best_spans`' answers."""
    return best_spans(
        features,
        start_logits,
        end_logits,
        n_best_size,
        max_answer_length,
        version_2_with_negative,
        null_score_diff_threshold,
    ).answers


def normalize_answer(text: str) -> str:
    """SQuAD's normalisation (the official evaluation script): lower case, punctuation, the articles a/an/the and
    extra whitespace removed."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def answer_f1(prediction: str, truth: str) -> float:
    """SQuAD's token F1 of one prediction against one true answer, after `normalize_answer`."""
    predicted, true = normalize_answer(prediction).split(), normalize_answer(truth).split()
    common = sum((collections.Counter(predicted) & collections.Counter(true)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(predicted), common / len(true)
    return 2 * precision * recall / (precision + recall)


def squad_metrics(predictions: dict[str, str], references: dict[str, list[str]]) -> dict[str, float]:
    """SQuAD v1.1's exact match and F1 (in %): each row's best over its true answers, averaged over the rows. A row
    without a true answer (SQuAD v2's) counts as right only where the prediction is empty too, as v2's script
    scores it."""
    exact, f1 = [], []
    for row_id, truths in references.items():
        prediction = predictions.get(row_id, "")
        truths = truths or [""]
        exact.append(max(float(normalize_answer(prediction) == normalize_answer(t)) for t in truths))
        f1.append(max(answer_f1(prediction, t) if t else float(normalize_answer(prediction) == "") for t in truths))
    return {"exact_match": 100.0 * float(np.mean(exact)), "f1": 100.0 * float(np.mean(f1))}


# the breakdowns `squad_v2_metrics` adds to exact match and F1 (where it has rows of that kind)
SQUAD_V2_BREAKDOWN = tuple(f"{kind}_{score}" for kind in ("HasAns", "NoAns") for score in ("exact", "f1", "total"))


def squad_v2_metrics(predictions: dict[str, str], references: dict[str, list[str]]) -> dict[str, float]:
    """SQuAD v2's scores (in %), as the official v2.0 script and the squad_v2 metric compute them: `exact_match`
    and `f1` over every row (the metric's `exact` and `f1`), then `HasAns_exact` / `HasAns_f1` over the rows with a
    true answer and `NoAns_exact` / `NoAns_f1` over those without one (right only where the prediction is empty),
    each with its row count (`HasAns_total`, `NoAns_total`), a breakdown present only where it has rows. A true
    answer that normalises to nothing is not one (v2's script drops it)."""
    answered = {row_id: [t for t in truths if normalize_answer(t)] for row_id, truths in references.items()}
    scores = squad_metrics(predictions, answered)
    for name, has_answer in (("HasAns", True), ("NoAns", False)):
        rows = {row_id: truths for row_id, truths in answered.items() if bool(truths) == has_answer}
        if rows:
            part = squad_metrics(predictions, rows)
            scores.update(
                {f"{name}_exact": part["exact_match"], f"{name}_f1": part["f1"], f"{name}_total": float(len(rows))}
            )
    return scores


def references_of(features: Any) -> dict[str, list[str]]:
    """{row id: its true answers' texts} of tokenized features that carry answers."""
    return {row_id: list(answer["text"]) for row_id, answer in zip(features["id"], features["answers"])}


class QuestionAnsweringTrainer(AtomicCheckpointTrainer):
    """Evaluates and predicts as run_qa.py's `QuestionAnsweringTrainer`: the loop's start and end logits over the
    features are turned into each row's answer (`best_spans`, with `task_options`' --n_best_size,
    --max_answer_length, --version_2_with_negative and --null_score_diff_threshold), scored by `squad_metrics` as
    `<prefix>_exact_match` / `<prefix>_f1` where the rows have answers (with --version_2_with_negative by
    `squad_v2_metrics`, adding `<prefix>_HasAns_*` / `<prefix>_NoAns_*`); `predict` returns {row id: answer} as its
    predictions ("" for "no answer"). Each evaluation and prediction writes utils_qa.py's `<prefix>_predictions.json`,
    `<prefix>_nbest_predictions.json` and (v2) `<prefix>_null_odds.json` to --output_dir, from the main process,
    as run_qa.py's post-processing does. The features' evaluation columns are read from
    the data set given (the loop's own copy has lost them to `remove_unused_columns`)."""

    task_options: Any = None  # FinetuneArguments: set by the script after construction

    def evaluate(self, eval_dataset: Any = None, *args: Any, **kwargs: Any) -> dict[str, float]:
        self._qa_features = eval_dataset if eval_dataset is not None else self.eval_dataset
        return super().evaluate(eval_dataset, *args, **kwargs)

    def predict(self, test_dataset: Any, *args: Any, **kwargs: Any) -> Any:
        self._qa_features = test_dataset
        return super().predict(test_dataset, *args, **kwargs)

    def evaluation_loop(
        self, dataloader: Any, description: str, prediction_loss_only: bool | None = None, *args: Any, **kwargs: Any
    ) -> EvalLoopOutput:
        compute_metrics, self.compute_metrics = self.compute_metrics, None
        try:  # the logits are needed even where only a loss was asked for
            output = super().evaluation_loop(dataloader, description, False, *args, **kwargs)
        finally:
            self.compute_metrics = compute_metrics
        features = getattr(self, "_qa_features", None)
        if not isinstance(features, Dataset) or "offset_mapping" not in features.column_names:
            return output
        prefix = kwargs.get("metric_key_prefix", args[1] if len(args) > 1 else "eval")
        start_logits, end_logits = output.predictions[:2]
        options = self.task_options
        version_2 = bool(getattr(options, "version_2_with_negative", False))
        found = best_spans(
            features,
            start_logits,
            end_logits,
            getattr(options, "n_best_size", 20),
            getattr(options, "max_answer_length", 30),
            version_2,
            getattr(options, "null_score_diff_threshold", 0.0),
        )
        predictions = found.answers
        if self.is_world_process_zero():
            write_span_predictions(found, self.args.output_dir, prefix)
        metrics = dict(output.metrics)
        if "answers" in features.column_names:
            score = squad_v2_metrics if version_2 else squad_metrics
            scores = score(predictions, references_of(features))
            metrics.update({f"{prefix}_{name}": value for name, value in scores.items()})
        return EvalLoopOutput(
            predictions=predictions, label_ids=output.label_ids, metrics=metrics, num_samples=output.num_samples
        )


def write_span_predictions(found: SpanPredictions, output_dir: str, prefix: str) -> None:
    """utils_qa.py's files in `output_dir`: `{prefix}_predictions.json` ({id: answer}),
    `{prefix}_nbest_predictions.json` ({id: the n-best list}) and, with --version_2_with_negative,
    `{prefix}_null_odds.json` ({id: null odds}), each JSON indented by 4 as utils_qa.py writes them."""
    os.makedirs(output_dir, exist_ok=True)
    for part, name in OUTPUT_FILES.items():
        content = getattr(found, part)
        if content is None:
            continue
        with open(os.path.join(output_dir, f"{prefix}_{name}"), "w", encoding="utf-8") as f:
            f.write(json.dumps(content, indent=4, ensure_ascii=False) + "\n")


def prediction_lines(predictions: dict[str, str], config: Any, tokenizer: Any) -> list[str]:
    """The test split's predictions as run_qa.py writes them: one JSON object {id: answer}."""
    return [json.dumps(predictions, indent=4, ensure_ascii=False)]


__all__ = [
    "CLS_INDEX",
    "PREDICTIONS_FILE",
    "QuestionAnsweringCollator",
    "QuestionAnsweringTrainer",
    "SpanPredictions",
    "answer_f1",
    "answer_tokens",
    "answers_from_logits",
    "best_spans",
    "check_answer",
    "check_question_answering_columns",
    "check_unique_ids",
    "check_windows",
    "function_questions",
    "normalize_answer",
    "prediction_lines",
    "write_span_predictions",
    "question_answering_texts",
    "squad_metrics",
    "squad_v2_metrics",
    "tokenize_question_answering",
]
