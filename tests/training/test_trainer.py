"""training/trainer.py: `AtomicCheckpointTrainer` with the Trainer's features that read or rotate its checkpoints."""

from __future__ import annotations

import concurrent.futures
import json
import os
import types

import torch
import transformers.trainer
from datasets import Dataset
from huggingface_hub.utils import filter_repo_objects
from safetensors.torch import load_file
from transformers import TrainingArguments

from archlab import DecoderForCausalLM
from archlab.training.trainer import AtomicCheckpointTrainer

from helpers import tiny_decoder_config


def _rows(n: int) -> Dataset:
    ids = torch.randint(3, 90, (n, 8), generator=torch.Generator().manual_seed(0))
    return Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})


def _train_with_scores(output_dir, scores: dict[int, float], max_steps: int, resume: str | None = None, **kwargs):
    """A run that evaluates and saves every 2 steps, its metric `score` at step N being `scores[N]`."""
    torch.manual_seed(0)
    trainer = None

    def metrics(_):
        return {"score": scores[trainer.state.global_step]}

    args = TrainingArguments(
        output_dir=str(output_dir),
        max_steps=max_steps,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        eval_strategy="steps",
        eval_steps=2,
        save_steps=2,
        metric_for_best_model="score",
        greater_is_better=True,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        **kwargs,
    )
    model = DecoderForCausalLM(tiny_decoder_config())
    trainer = AtomicCheckpointTrainer(
        model=model, args=args, train_dataset=_rows(16), eval_dataset=_rows(2), compute_metrics=metrics
    )
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def test_the_best_checkpoint_is_named_by_its_folder_and_survives_a_resume_and_the_rotation(tmp_path):
    """A checkpoint that is the best one recorded itself under `.staging/` in its trainer_state.json: resumed from,
    the Trainer found no such folder and forgot it, the rotation deleted it and `load_best_model_at_end` loaded
    nothing (the run ended on the step-6 weights)."""
    scores = {2: 1.0, 4: 5.0, 6: 2.0}
    limits = dict(save_total_limit=1, load_best_model_at_end=True)
    _train_with_scores(tmp_path, scores, 4, **limits)
    best = tmp_path / "checkpoint-4"
    state = json.loads((best / "trainer_state.json").read_text())
    assert state["best_model_checkpoint"] == str(best)
    weights = load_file(best / "model.safetensors")
    resumed = _train_with_scores(tmp_path, scores, 6, resume=str(best), **limits)
    assert resumed.state.best_model_checkpoint == str(best) and best.is_dir()
    for name, param in resumed.model.state_dict().items():
        if name in weights:
            torch.testing.assert_close(param, weights[name], atol=0, rtol=0, msg=name)


class _RecordedHub:
    """`hf_api()` without a network: each upload records its folder and the files it would send at that moment."""

    def __init__(self) -> None:
        self.uploads: list[tuple[str, list[str]]] = []

    def create_repo(self, name, **kwargs):
        return types.SimpleNamespace(repo_id=name)

    def upload_folder(self, folder_path, ignore_patterns=None, **kwargs):
        files = [
            os.path.relpath(os.path.join(root, name), folder_path)
            for root, _, names in os.walk(folder_path)
            for name in names
        ]
        self.uploads.append((folder_path, list(filter_repo_objects(files, ignore_patterns=ignore_patterns))))
        done = concurrent.futures.Future()
        done.set_result(None)
        return done


def test_push_to_hub_uploads_each_checkpoint_from_its_final_folder(tmp_path, monkeypatch):
    """The Trainer pushed from inside the staged save: its background upload read `.staging/checkpoint-N`, which the
    rename then took away, and its upload of the output folder sent the staging checkpoint along (optimizer too)."""
    hub = _RecordedHub()
    monkeypatch.setattr(transformers.trainer, "hf_api", lambda: hub)
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=2,
        per_device_train_batch_size=2,
        save_steps=2,
        push_to_hub=True,
        hub_model_id="someone/tiny",
        hub_strategy="checkpoint",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    model = DecoderForCausalLM(tiny_decoder_config())
    AtomicCheckpointTrainer(model=model, args=args, train_dataset=_rows(4)).train()
    folders = [folder for folder, _ in hub.uploads]
    assert folders == [str(tmp_path), str(tmp_path / "checkpoint-2")]
    assert all(os.path.isdir(folder) for folder in folders)
    assert not [name for _, files in hub.uploads for name in files if ".staging" in name]
