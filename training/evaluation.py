"""Training with an evaluation at its start: the metrics before training, taken from the model as it is prepared
for training (and, on a resume, from the checkpoint the run starts from)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from transformers import Trainer, TrainerCallback


class _FirstEvaluation(TrainerCallback):
    """Keeps the metrics of the first evaluation it sees and hands them to `report` at once."""

    def __init__(self, report: Callable[[dict[str, float]], None]) -> None:
        self.report = report
        self.metrics: dict[str, float] | None = None

    def on_evaluate(self, args: Any, state: Any, control: Any, metrics: dict[str, float] | None = None, **kwargs):
        if self.metrics is None:
            self.metrics = dict(metrics or {})
            self.report(self.metrics)


def train_evaluating_at_start(
    trainer: Trainer, resume: str | None, report: Callable[[dict[str, float]], None]
) -> tuple[dict[str, float], Any]:
    """`trainer.train(resume_from_checkpoint=resume)` with an evaluation at its start (`eval_on_start`); `report`
    gets that evaluation's metrics as soon as they exist. Returns (metrics at the start, the `TrainOutput`).

    Evaluating inside `train()` rather than calling `trainer.evaluate()` first means the model is evaluated after it
    is prepared for training (wrapped in DistributedDataParallel under torchrun / accelerate launch; see
    `AtomicCheckpointTrainer.train` for what the other order does), and a resumed run reports the checkpoint it
    starts from, not the model as built before loading it."""
    trainer.args.eval_on_start = True
    first = _FirstEvaluation(report)
    trainer.add_callback(first)
    try:
        result = trainer.train(resume_from_checkpoint=resume)
    finally:
        trainer.remove_callback(first)
    if first.metrics is None:  # train() took no step (a finished checkpoint being finalised): nothing to wrap
        first.metrics = trainer.evaluate()
        first.report(first.metrics)
    return first.metrics, result


def train_and_evaluate(
    trainer: Trainer,
    resume: str | None,
    view: Callable[[dict[str, float]], dict[str, float]],
    report_before: Callable[[dict[str, float]], None],
    report_after: Callable[[dict[str, float], dict[str, float]], None],
) -> dict[str, float]:
    """`train_evaluating_at_start`, then an evaluation of the trained model. `view` adds derived metrics to an
    evaluation's (perplexity, say); `report_before(before)` runs as soon as the first evaluation exists and
    `report_after(after, before)` at the end. Returns the training metrics, the evaluation after training, and the
    one before it with `before_` prefixed to its keys."""
    before, result = train_evaluating_at_start(trainer, resume, lambda metrics: report_before(view(dict(metrics))))
    before = view(before)
    after = view(trainer.evaluate())
    report_after(after, before)
    return {**result.metrics, **after, **{f"before_{k}": v for k, v in before.items()}}
