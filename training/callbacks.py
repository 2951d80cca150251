"""Trainer callbacks for a mixture of experts: per-layer expert load and router entropy (watching it train), and
DeepSeek-V3's auxiliary-loss-free balancing step after each optimizer step (`RouterBiasCallback`).

Routing collapse (a few experts take every token, the rest stop learning) is invisible in the loss curve until it
is too late; these metrics show it as it happens. Kept outside `modeling/` on purpose: a saved model never needs
it, and `modeling/` is the folder Hugging Face's remote code copies next to a checkpoint.

Metrics, per sparse layer L, over the training forwards since the last log:
    moe/layer_L/router_entropy   mean per-token entropy of the router softmax, in nats (log K = undecided,
                                 0 = always certain; falling to 0 together with a rising imbalance = collapse)
    moe/layer_L/load_imbalance   max over experts of (share of routed slots) · K: 1 = perfectly balanced,
                                 K / k = every token sent to the same k experts
    moe/layer_L/idle_experts     experts that received no token at all
The full per-expert load vectors are kept in `RouterStatsCallback.history`.
"""

from __future__ import annotations

import logging
import math
import re

import torch
from transformers import Trainer, TrainerCallback

from archlab.modeling.moe import TopKRouter, update_router_biases

logger = logging.getLogger(__name__)


class RouterStatsCallback(TrainerCallback):
    """Collects routing statistics with forward hooks on every router (no model change, no host sync per step)
    and adds them to the Trainer's logs at each logging step. Attach with `attach_router_stats(trainer)` so the
    metrics reach the printed logs and every reporter (a callback appended last runs after them)."""

    def __init__(self, warn_idle_fraction: float = 0.5) -> None:
        self.warn_idle_fraction = warn_idle_fraction
        self.history: list[dict] = []
        self._handles: list = []
        self._stats: dict[str, dict[str, torch.Tensor]] = {}

    # -- hooks --------------------------------------------------------------------------------------------------
    def _hook(self, name: str):
        def record(module: TopKRouter, inputs, outputs) -> None:
            if not module.training:
                return
            logits, _, index = outputs
            with torch.no_grad():
                stats = self._stats.setdefault(
                    name,
                    {
                        "load": torch.zeros(module.num_experts, device=logits.device),
                        "entropy": torch.zeros((), device=logits.device),
                        "tokens": torch.zeros((), device=logits.device),
                    },
                )
                stats["load"].scatter_add_(0, index.reshape(-1), torch.ones(index.numel(), device=logits.device))
                log_p = torch.log_softmax(logits.float(), dim=-1)
                stats["entropy"] += -(log_p.exp() * log_p).sum()
                stats["tokens"] += logits.shape[0]

        return record

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._remove_hooks()
        for name, module in model.named_modules():
            if isinstance(module, TopKRouter):
                match = re.search(r"layers\.(\d+)\.", name)
                key = f"layer_{match.group(1)}" if match else name
                self._handles.append(module.register_forward_hook(self._hook(key)))

    def on_train_end(self, args, state, control, **kwargs):
        self._remove_hooks()

    def _remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # -- logging ------------------------------------------------------------------------------------------------
    def summarize(self) -> dict[str, float]:
        """Metrics since the last call (and resets the counters)."""
        metrics: dict[str, float] = {}
        record: dict = {}
        for key, stats in self._stats.items():
            load = stats["load"].double()
            num_experts = load.numel()
            share = (load / load.sum().clamp(min=1)).tolist()
            tokens = max(stats["tokens"].item(), 1.0)
            metrics[f"moe/{key}/router_entropy"] = stats["entropy"].item() / tokens
            metrics[f"moe/{key}/load_imbalance"] = max(share) * num_experts
            metrics[f"moe/{key}/idle_experts"] = float(sum(1 for s in share if s == 0))
            record[key] = share
            if metrics[f"moe/{key}/idle_experts"] >= self.warn_idle_fraction * num_experts:
                logger.warning(
                    "Router collapse in %s: %d of %d experts received no token since the last log "
                    "(router entropy %.3f of at most %.3f nats). Consider a larger `router_aux_loss_coef`.",
                    key,
                    int(metrics[f"moe/{key}/idle_experts"]),
                    num_experts,
                    metrics[f"moe/{key}/router_entropy"],
                    math.log(num_experts),
                )
        self._stats = {}
        if record:
            self.history.append({"metrics": metrics, "load": record})
        return metrics

    def on_log(self, args, state, control, logs=None, **kwargs):
        metrics = self.summarize()
        if not metrics or logs is None:
            return
        logs.update(metrics)  # printers and reporters that run after this callback see the metrics
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(metrics)
        self.history[-1]["step"] = state.global_step


class RouterBiasCallback(TrainerCallback):
    """After each optimizer step, every router's correction bias moves towards balance (`router_bias_update_rate`,
    `modeling.moe.update_router_biases`: DeepSeek-V3's auxiliary-loss-free balancing). archlab's Trainer (the scripts')
    adds it where the model asks for it; add it to another Trainer (TRL's) with `trainer.add_callback`. Every process
    runs it (the loads are summed across data-parallel processes), so the replicas' biases stay equal."""

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if model is not None:
            update_router_biases(model)


def wants_router_bias_updates(model) -> bool:
    """Whether `model`'s config asks for DeepSeek-V3's balancing updates (`router_bias_update_rate` > 0)."""
    config = getattr(model, "config", None)
    return (getattr(config, "router_bias_update_rate", 0) or 0) > 0


def attach_router_stats(trainer: Trainer, **kwargs) -> RouterStatsCallback:
    """Adds a `RouterStatsCallback` in front of the Trainer's callbacks so printers and reporters log its metrics."""
    callback = RouterStatsCallback(**kwargs)
    trainer.callback_handler.callbacks.insert(0, callback)
    return callback


__all__ = ["RouterBiasCallback", "RouterStatsCallback", "attach_router_stats", "wants_router_bias_updates"]
