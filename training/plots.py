"""PNG plots: a run's training and validation loss against the step (drawn into the final folder and its model
card), and the ablation study's training curves. matplotlib is optional (`archlab[scripts]`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

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


def plot_ablation_curves(results: list[dict[str, Any]], path: str | Path) -> None:
    """Each ablation variant's training loss (a running mean of 10 steps) against the step, as a PNG."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(10, 6))
    for r in results:
        curve = torch.tensor(r["loss_curve"])
        k = min(10, len(curve))
        smooth = torch.nn.functional.avg_pool1d(curve[None, None], k, stride=1)[0, 0]  # running mean
        ax.plot(range(k - 1, len(curve)), smooth.tolist(), label=r["name"], linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats/byte, running mean of 10)")
    ax.set_ylim(top=min(4.0, ax.get_ylim()[1]))
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
