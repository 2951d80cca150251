"""PNG plots: a run's training and validation loss against the step (drawn into the final folder and its model
card), and the ablation study's training curves. matplotlib is optional (`archlab[scripts]`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .reporting import log


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_loss_curve(log_history: list[dict[str, Any]], path: str | Path) -> bool:
    """Training (and evaluation) loss against the step, as a PNG; False when there is nothing to draw."""
    train = [(e["step"], e["loss"]) for e in log_history if "loss" in e and "step" in e]
    evals = [(e["step"], e["eval_loss"]) for e in log_history if "eval_loss" in e and "step" in e]
    if not train and not evals:
        return False
    try:
        plt = _pyplot()
    except ImportError:
        log("matplotlib is not installed (pip install 'archlab[scripts]'): no loss-curve PNG.")
        return False

    figure, axis = plt.subplots(figsize=(6, 3.5))
    if train:
        axis.plot(*zip(*train), label="training loss")
    if evals:
        axis.plot(*zip(*evals), "o-", label="validation loss")
    axis.set_xlabel("step")
    axis.set_ylabel("cross-entropy (nats/token)")
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100, metadata={"Software": None})
    plt.close(figure)
    return True

