"""The lines the training scripts print: progress messages and one-line metric summaries."""

from __future__ import annotations

from collections.abc import Sequence


def log(message: str) -> None:
    print(f"[archlab] {message}", flush=True)


def summary(metrics: dict[str, float], keys: Sequence[str]) -> str:
    """'loss 1.234, accuracy 0.9' for the `eval_*` keys present in `metrics`, in the order of `keys`."""
    return ", ".join(f"{k[5:]} {metrics[k]:.4g}" for k in keys if k in metrics)
