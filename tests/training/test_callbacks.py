"""archlab.training.callbacks: routing metrics during Trainer runs; a collapsed router is visible and the aux loss
pulls it back to balance."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from transformers import Trainer, TrainingArguments

import archlab
from archlab.modeling.moe import load_balancing_loss
from archlab.training.callbacks import RouterStatsCallback, attach_router_stats

from helpers import tiny_decoder_config


def collapsed_moe(**overrides) -> archlab.DecoderForCausalLM:
    """A tiny MoE whose routers all prefer experts 0 and 1 (a shared direction in every token's input)."""
    config = tiny_decoder_config(num_local_experts=4, num_experts_per_tok=2, **overrides)
    model = archlab.DecoderForCausalLM(config)
    direction = torch.nn.functional.normalize(torch.randn(config.hidden_size), dim=0)
    with torch.no_grad():
        model.model.embed_tokens.weight += 0.1 * direction
        for layer in model.model.layers:
            layer.mlp.gate.weight[:2] += 0.8 * direction
    return model


def aux_loss(model, ids) -> float:
    model.eval()
    with torch.no_grad():
        logits = model(ids, output_router_logits=True).router_logits
    model.train()
    return load_balancing_loss(logits, 4, 2).item()


@pytest.mark.slow
def test_router_stats_show_collapse_and_aux_loss_falls(tmp_path, caplog):
    model = collapsed_moe(router_aux_loss_coef=1.0, output_router_logits=True)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(3, 97, (32, 16))]
    probe = torch.stack([row["input_ids"] for row in data[:8]])
    before = aux_loss(model, probe)

    # the collapsed start is what the metrics flag
    watcher = RouterStatsCallback()
    watcher.on_train_begin(None, None, None, model=model)
    with caplog.at_level(logging.WARNING, logger="archlab.training.callbacks"):
        model(probe)
        initial = watcher.summarize()
    watcher.on_train_end(None, None, None)
    assert initial["moe/layer_0/load_imbalance"] == 2.0  # = K/k: experts 0 and 1 take every slot
    assert initial["moe/layer_0/idle_experts"] == 2
    assert "Router collapse in layer_0" in caplog.text

    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=24,
        per_device_train_batch_size=8,
        learning_rate=1e-2,
        logging_steps=4,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    trainer = Trainer(model=model, args=args, train_dataset=data)
    callback = attach_router_stats(trainer)
    assert trainer.callback_handler.callbacks[0] is callback
    trainer.train()
    after = aux_loss(model, probe)
    assert after < before - 0.1, (before, after)

    last = callback.history[-1]
    assert set(last["load"]) == {"layer_0", "layer_1"} and last["step"] == 24
    assert abs(sum(last["load"]["layer_0"]) - 1.0) < 1e-6
    assert last["metrics"]["moe/layer_0/idle_experts"] == 0  # the aux loss brought the idle experts back
    logged = [entry for entry in trainer.state.log_history if "moe/layer_1/router_entropy" in entry]
    assert len(logged) == 24 // 4 and all("loss" in entry for entry in logged)


def test_hooks_ignore_eval_and_are_removed():
    model = collapsed_moe()
    callback = RouterStatsCallback()
    callback.on_train_begin(None, None, None, model=model)
    ids = torch.randint(3, 97, (2, 5))
    model.eval()
    model(ids)
    assert callback.summarize() == {}
    model.train()
    model(ids)
    metrics = callback.summarize()
    assert metrics["moe/layer_1/load_imbalance"] == 2.0
    assert 0 < metrics["moe/layer_1/router_entropy"] < math.log(4)
    callback.on_train_end(None, None, None)
    model(ids)
    assert callback.summarize() == {}


def _top_experts_of_layer_0(model, ids) -> torch.Tensor:
    """How often each expert of layer 0's router is chosen over `ids` (eval mode, counts of K)."""
    chosen = []
    handle = model.model.layers[0].mlp.gate.register_forward_hook(lambda m, i, out: chosen.append(out[2]))
    model.eval()
    with torch.no_grad():
        model(ids)
    model.train()
    handle.remove()
    return torch.bincount(chosen[0].reshape(-1), minlength=4)


def test_aux_loss_free_balancing_brings_a_collapsed_router_back(tmp_path):
    """DeepSeek-V3's balancing alone (learning rate 0: only the correction biases move): archlab's Trainer adds the
    callback, and the experts a collapsed router never chose take slots again; a plain Trainer moves nothing until
    the callback is added."""
    from archlab.training.callbacks import RouterBiasCallback
    from archlab.training.trainer import AtomicCheckpointTrainer

    overrides = dict(router_score_function="sigmoid", router_correction_bias=True, router_bias_update_rate=0.05)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(3, 97, (32, 16))]
    probe = torch.stack([row["input_ids"] for row in data[:8]])
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=16,
        per_device_train_batch_size=8,
        learning_rate=0.0,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    torch.manual_seed(0)
    model = collapsed_moe(**overrides)
    before = _top_experts_of_layer_0(model, probe)
    assert before[2:].sum() == 0  # experts 2 and 3 never chosen
    Trainer(model=model, args=args, train_dataset=data).train()
    assert not model.model.layers[0].mlp.gate.e_score_correction_bias.any()  # no callback: nothing moved

    trainer = AtomicCheckpointTrainer(model=model, args=args, train_dataset=data)
    assert any(isinstance(callback, RouterBiasCallback) for callback in trainer.callback_handler.callbacks)
    trainer.train()
    bias = model.model.layers[0].mlp.gate.e_score_correction_bias
    after = _top_experts_of_layer_0(model, probe)
    assert bias[:2].max() < 0 < bias[2:].min(), bias  # the overloaded experts pushed down, the idle ones up
    assert after[2:].sum() > 0 and after.max() < before.max(), (before, after)
