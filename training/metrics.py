"""Evaluation metrics of the training scripts: perplexity, classification accuracy and macro-F1 (a multi-label head's
subset accuracy and micro-F1, a regression head's mean squared error and Pearson's r), and the text metrics of
generated sequences (sacrebleu's BLEU and chrF, exact match)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from archlab.tokenization.data import IGNORE_INDEX


def with_perplexity(metrics: dict[str, float], prefix: str = "eval") -> dict[str, float]:
    loss = metrics.get(f"{prefix}_loss")
    if loss is not None:
        metrics[f"{prefix}_perplexity"] = math.exp(min(loss, 50.0))
    return metrics


def classification_metrics(prediction: Any) -> dict[str, float]:
    """Accuracy and macro-F1 over the classes that occur in labels or predictions; for a regression head (one
    output) the mean squared error and Pearson's correlation instead, as run_glue.py reports a float label column;
    for multi-hot labels (multi-label) `multi_label_metrics`."""
    logits = prediction.predictions[0] if isinstance(prediction.predictions, tuple) else prediction.predictions
    if np.ndim(prediction.label_ids) == 2:
        return multi_label_metrics(logits, prediction.label_ids)
    if logits.shape[-1] == 1:
        return regression_metrics(logits[..., 0], prediction.label_ids)
    predicted, labels = np.argmax(logits, axis=-1), prediction.label_ids
    f1s = []
    for c in np.union1d(predicted, labels):
        tp = np.sum((predicted == c) & (labels == c))
        precision = tp / max(np.sum(predicted == c), 1)
        recall = tp / max(np.sum(labels == c), 1)
        f1s.append(0.0 if tp == 0 else 2 * precision * recall / (precision + recall))
    return {"accuracy": float(np.mean(predicted == labels)), "f1": float(np.mean(f1s))}


def multi_label_metrics(logits: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    """A multi-label head's scores, as run_classification.py computes them: each class predicted where its logit is
    above 0 (sigmoid 0.5); `f1` is the micro-F1 (true positives, false positives and false negatives counted over
    every class of every row), `accuracy` the share of rows whose whole set of labels is right (subset accuracy,
    what scikit-learn's `accuracy_score` gives for multi-hot rows)."""
    predicted, labels = logits > 0, labels > 0.5
    tp = np.sum(predicted & labels)
    wrong = np.sum(predicted != labels)  # false positives + false negatives
    return {
        "accuracy": float(np.mean(np.all(predicted == labels, axis=-1))),
        "f1": float(2 * tp / (2 * tp + wrong)) if tp else 0.0,
    }


def regression_metrics(predicted: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    """Mean squared error and Pearson's r (0 where either side is constant, where r is undefined)."""
    predicted, labels = predicted.astype(np.float64).ravel(), labels.astype(np.float64).ravel()
    constant = np.std(predicted) == 0 or np.std(labels) == 0
    pearson = 0.0 if constant else float(np.corrcoef(predicted, labels)[0, 1])
    return {"mse": float(np.mean((predicted - labels) ** 2)), "pearson": pearson}


def text_metrics(predictions: list[str], references: list[str]) -> dict[str, float]:
    """sacrebleu's corpus BLEU and chrF, and exact match (after whitespace normalisation)."""
    import sacrebleu

    predictions = [" ".join(p.split()) for p in predictions]
    references = [" ".join(r.split()) for r in references]
    return {
        "bleu": sacrebleu.corpus_bleu(predictions, [references]).score,
        "chrf": sacrebleu.corpus_chrf(predictions, [references]).score,
        "exact_match": 100.0 * float(np.mean([p == r for p, r in zip(predictions, references)])),
    }


def seq2seq_metrics(tokenizer: Any) -> Callable[[Any], dict[str, float]]:
    """`compute_metrics` for generated token ids: decodes predictions and labels, then `text_metrics`."""

    def compute(prediction: Any) -> dict[str, float]:
        generated = np.where(prediction.predictions < 0, tokenizer.pad_token_id, prediction.predictions)
        labels = np.where(prediction.label_ids == IGNORE_INDEX, tokenizer.pad_token_id, prediction.label_ids)
        return text_metrics(
            tokenizer.batch_decode(generated, skip_special_tokens=True),
            tokenizer.batch_decode(labels, skip_special_tokens=True),
        )

    return compute


def entity_spans(tags: list[str]) -> set[tuple[str, int, int]]:
    """The entities of a sequence of IOB tags as (type, first, last) token spans, by seqeval's default (conlleval's
    lenient) rules: an entity starts at a `B-`, at an `I-` after `O` or after another type's tag, and ends before
    a `B-`, an `O` or another type's tag; `E-`/`S-` (IOBES) end one. So `B-PER I-LOC` is a one-token PER and a
    one-token LOC, and a lone `I-LOC` is a LOC."""
    spans, previous_tag, previous_type, begin = set(), "O", "", 0
    for i, chunk in enumerate([*tags, "O"]):
        tag, kind = chunk[0], chunk[1:].split("-", maxsplit=1)[-1] or "_"
        ends = (
            previous_tag in "ES"
            or (previous_tag in "BI" and tag in "BSO")
            or (previous_tag not in "O." and previous_type != kind)
        )
        starts = tag in "BS" or (previous_tag in "ESO" and tag in "EI") or (tag not in "O." and previous_type != kind)
        if ends:
            spans.add((previous_type, begin, i - 1))
        if starts:
            begin = i
        previous_tag, previous_type = tag, kind
    return spans


def entity_scores(references: list[list[str]], predictions: list[list[str]]) -> dict[str, float]:
    """seqeval's overall scores, as run_ner.py reports them: entity-level micro precision, recall and F1 (an entity
    counts when its type and both ends match; 0 where nothing is predicted or nothing is there), and the accuracy of
    the tags, token by token."""
    true = {(row, *span) for row, tags in enumerate(references) for span in entity_spans(tags)}
    found = {(row, *span) for row, tags in enumerate(predictions) for span in entity_spans(tags)}
    correct = len(true & found)
    precision = correct / len(found) if found else 0.0
    recall = correct / len(true) if true else 0.0
    pairs = [(t, p) for ref, pred in zip(references, predictions) for t, p in zip(ref, pred)]
    return {
        "precision": precision,
        "recall": recall,
        "f1": 2 * precision * recall / (precision + recall) if correct else 0.0,
        "accuracy": sum(t == p for t, p in pairs) / len(pairs) if pairs else 0.0,
    }


def entity_types(labels: Iterable[str]) -> set[str]:
    """The entity types a label set tags (`B-PER`, `I-PER` -> PER), read as `entity_spans` reads a tag."""
    return {span[0] for label in labels for span in entity_spans([label])}


def entity_type_scores(
    references: list[list[str]], predictions: list[list[str]], types: Iterable[str] = ()
) -> dict[str, float]:
    """seqeval's scores per entity type, as run_ner.py's --return_entity_level_metrics reports them: for each type
    found in the references or the predictions (sorted), `{type}_precision`, `{type}_recall` and `{type}_f1` over its
    entities (0 where none is predicted or none is there, seqeval's `zero_division` default) and `{type}_number`,
    its entities in the references (seqeval's support). `types` are listed whether found or not (with 0s): every
    evaluation then reports the same keys, and one of them can be `--metric_for_best_model` (seqeval lists only
    the types found, and the Trainer's KeyError came at the first evaluation without one)."""
    true = {(row, *span) for row, tags in enumerate(references) for span in entity_spans(tags)}
    found = {(row, *span) for row, tags in enumerate(predictions) for span in entity_spans(tags)}
    scores: dict[str, float] = {}
    for kind in sorted({entity[1] for entity in true | found} | set(types)):
        there = {entity for entity in true if entity[1] == kind}
        named = {entity for entity in found if entity[1] == kind}
        correct = len(there & named)
        precision = correct / len(named) if named else 0.0
        recall = correct / len(there) if there else 0.0
        f1 = 2 * precision * recall / (precision + recall) if correct else 0.0
        scores.update(
            {f"{kind}_precision": precision, f"{kind}_recall": recall, f"{kind}_f1": f1, f"{kind}_number": len(there)}
        )
    return scores


def token_classification_metrics(
    id2label: dict[int, str], entity_level: bool = False
) -> Callable[[Any], dict[str, float]]:
    """`compute_metrics` of a token classifier: the argmax label at each scored token (label not -100: the words'
    first sub-tokens) against its label, by `entity_scores`; `entity_level` (--return_entity_level_metrics) adds
    each entity type's scores (`entity_type_scores`), for every type of the label set whether found or not."""

    def compute(prediction: Any) -> dict[str, float]:
        logits = prediction.predictions[0] if isinstance(prediction.predictions, tuple) else prediction.predictions
        predicted, labels = np.argmax(logits, axis=-1), prediction.label_ids
        keep = [row != IGNORE_INDEX for row in labels]
        references = [[id2label[int(i)] for i in row[k]] for row, k in zip(labels, keep)]
        found = [[id2label[int(i)] for i in row[k]] for row, k in zip(predicted, keep)]
        scores = entity_scores(references, found)
        if entity_level:
            scores.update(entity_type_scores(references, found, entity_types(id2label.values())))
        return scores

    return compute
