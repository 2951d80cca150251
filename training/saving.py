"""The final save of a run: model, tokenizer, trainer state, results, loss curve and model card, written so that a
folder with a `config.json` has everything."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from typing import Any

from transformers import Trainer
from transformers.trainer import TRAINING_ARGS_NAME

from archlab.tokenization.training import save_tokenizer

from .checkpoints import RUN_FACTS, STAGING
from .plots import plot_loss_curve

LOSS_CURVE = "loss_curve.png"
CARD_METRICS = (
    "loss",
    "perplexity",
    "accuracy",
    "precision",
    "recall",
    "f1",
    "mse",
    "pearson",
    "bleu",
    "chrf",
    "exact_match",
)
EMBEDDED_CORPUS = "python-stdlib-source"  # the model card's data set name for the embedded corpus


def save_final(
    trainer: Trainer,
    tokenizer: Any,
    output_dir: str,
    metrics: dict[str, float] | None = None,
    datasets: list[str] | None = None,
    base_model: str | None = None,
    pipeline_tag: str | None = None,
    example_pair: str | None = None,
) -> None:
    """Model, tokenizer, trainer state, run facts (`run_facts.json`), loss curve and model card (`example_pair`: a
    sentence-pair classifier's card shows a pair) -- written to a staging folder, then moved into `output_dir` file by
    file with `config.json` last, so a folder that has a config has everything.
    Under torchrun / accelerate launch only the main process writes; the others wait for it. The weights go through
    `Trainer.save_model`, which every process calls: under FSDP or DeepSpeed ZeRO-3 each holds a shard, and the whole
    weights are gathered from all of them (the main process's own parameters alone would be its shard)."""
    staging = os.path.join(output_dir, STAGING + "-final")
    if trainer.args.should_save:
        shutil.rmtree(staging, ignore_errors=True)
    trainer.accelerator.wait_for_everyone()
    trainer.model.config.use_cache = True  # the Trainer turns the cache off for training; generation wants it
    trainer.save_model(staging, _internal_call=True)  # (_internal_call: no push of its own)
    if not trainer.args.should_save:
        trainer.accelerator.wait_for_everyone()
        return
    with contextlib.suppress(FileNotFoundError):  # the pickled TrainingArguments; training_args.json has them
        os.remove(os.path.join(staging, TRAINING_ARGS_NAME))
    save_tokenizer(tokenizer, staging)
    trainer.state.save_to_json(os.path.join(staging, "trainer_state.json"))
    with open(os.path.join(staging, "training_args.json"), "w", encoding="utf-8") as f:
        f.write(trainer.args.to_json_string())
    if metrics:
        with open(os.path.join(staging, "all_results.json"), "w", encoding="utf-8") as f:
            json.dump(metrics, f, indent=2, sort_keys=True)
    facts = getattr(trainer, "run_facts", None)
    if facts is not None:  # (the card states the weights' dtype from it)
        with open(os.path.join(staging, RUN_FACTS), "w", encoding="utf-8") as f:
            json.dump(facts, f, indent=2, sort_keys=True)
    has_curve = plot_loss_curve(trainer.state.log_history, os.path.join(staging, LOSS_CURVE))
    write_card(
        staging,
        metrics,
        datasets,
        base_model,
        os.path.join(staging, LOSS_CURVE) if has_curve else None,
        pipeline_tag,
        example_pair,
    )
    entries = sorted(os.listdir(staging), key=lambda name: name == "config.json")
    for entry in entries:
        target = os.path.join(output_dir, entry)
        if os.path.isdir(target):
            shutil.rmtree(target)
        os.replace(os.path.join(staging, entry), target)
    os.rmdir(staging)
    if trainer.args.push_to_hub:
        push_final(trainer, output_dir)
    trainer.accelerator.wait_for_everyone()


def push_final(trainer: Trainer, output_dir: str) -> None:
    """--push_to_hub: the finished folder goes to the Hub as scripts/push_to_hub.py pushes it (safetensors, the model's
    code, tokenizer, logs and card, in one commit), to the repository the Trainer pushed the checkpoints to. The
    scripts save the final model themselves, not through `Trainer.push_to_hub`, so the run pushed its checkpoints and
    never the finished model (transformers' run_clm.py pushes it at the end)."""
    from .hub import push

    args = trainer.args
    repo_id = trainer.hub_model_id or args.hub_model_id
    push(
        output_dir,
        repo_id,
        private=bool(args.hub_private_repo),
        revision=args.hub_revision,
        token=args.hub_token,
        commit_message="End of training",
    )


def write_card(
    folder: str,
    metrics: dict[str, float] | None,
    datasets: list[str] | None,
    base_model: str | None,
    loss_curve: str | None,
    pipeline_tag: str | None = None,
    example_pair: str | None = None,
) -> None:
    """The model card (README.md), rendered by archlab.model_cards (`pipeline_tag`: None for the class's default)."""
    from archlab.model_cards import write_model_card

    eval_results = {k[len("eval_") :]: v for k, v in (metrics or {}).items() if k.startswith("eval_")}
    write_model_card(
        folder,
        datasets=datasets,
        base_model=base_model,
        eval_results={k: v for k, v in eval_results.items() if k in CARD_METRICS} or None,
        loss_curve=loss_curve,
        pipeline_tag=pipeline_tag,
        example_pair=example_pair,
    )


def dataset_label(dataset_name: str | None, train_file: str | None) -> str:
    """The model card's name for the training data: the Hub data set, the training file's name, or the embedded
    corpus."""
    if dataset_name:
        return dataset_name
    if train_file:
        return os.path.basename(train_file)
    return EMBEDDED_CORPUS
