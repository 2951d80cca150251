"""training/trainer.py: `AtomicCheckpointTrainer` with the Trainer's features that read or rotate its checkpoints."""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import types

import torch
import transformers.trainer
from datasets import Dataset
from huggingface_hub.utils import filter_repo_objects
from safetensors.torch import load_file
from transformers import DataCollatorForLanguageModeling, TrainingArguments

from archlab import (
    DecoderForCausalLM,
    DecoderForSequenceClassification,
    DecoderForTokenClassification,
    EncoderForMaskedLM,
)
from archlab.training.trainer import AtomicCheckpointTrainer

from helpers import digit_tokenizer, tiny_decoder_config, tiny_seq2seq_config


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


def _masked_lm_rows() -> Dataset:
    """8 rows of digits, 3 to 12 tokens long: the collator pads each batch to its longest row."""
    g = torch.Generator().manual_seed(0)
    lengths = [3, 12, 6, 9, 12, 4, 7, 10]
    return Dataset.from_dict({"input_ids": [torch.randint(3, 13, (n,), generator=g).tolist() for n in lengths]})


def _masked_lm_trainer(tmp_path, batch: int, accumulation: int, **kwargs) -> AtomicCheckpointTrainer:
    tokenizer = digit_tokenizer()
    tokenizer.add_special_tokens({"mask_token": "<mask>"})
    collator = DataCollatorForLanguageModeling(tokenizer, mlm=True, mlm_probability=0.5)
    args = TrainingArguments(
        output_dir=str(tmp_path / f"{batch}x{accumulation}"),
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=accumulation,
        train_sampling_strategy="sequential",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        **kwargs,
    )
    torch.manual_seed(0)
    model = EncoderForMaskedLM(tiny_seq2seq_config())
    return AtomicCheckpointTrainer(model=model, args=args, train_dataset=_masked_lm_rows(), data_collator=collator)


def _masked_rows(trainer: AtomicCheckpointTrainer, step: int, batches: list[dict]) -> list[tuple[list, list]]:
    """(masked ids, labels) of each row of `batches`, masked as the micro-batches of optimizer step `step`,
    without their padding."""
    trainer.state.global_step = step
    masked, _ = trainer.get_batch_samples(iter(batches), len(batches), torch.device("cpu"))
    rows = []
    for batch in masked:
        for ids, labels, keep in zip(batch["input_ids"], batch["labels"], batch["attention_mask"]):
            rows.append((ids[keep.bool()].tolist(), labels[keep.bool()].tolist()))
    return rows


def test_masked_lm_masks_follow_the_example_not_how_the_global_batch_is_split(tmp_path, monkeypatch):
    """Masks were drawn per (seed, process, step, micro-batch): 1 process x 4 rows, 2 accumulated micro-batches of 2
    and 2 processes x 2 rows masked the same global batch differently (and trained different models; a resume with
    another split of the same examples per step went on with other masks than the uninterrupted run)."""
    unmasked = _masked_lm_trainer(tmp_path, 4, 1)
    collate = unmasked.get_train_dataloader().collate_fn
    rows = [_masked_lm_rows()[i] for i in range(8)]
    one = _masked_rows(unmasked, 1, [collate(rows[4:])])
    assert one != _masked_rows(unmasked, 2, [collate(rows[4:])])  # another step, other masks
    assert any(ids != row["input_ids"] for (ids, _), row in zip(one, rows[4:]))  # (it masked)
    accumulated = _masked_lm_trainer(tmp_path, 2, 2)
    assert _masked_rows(accumulated, 1, [collate(rows[4:6]), collate(rows[6:])]) == one
    # 2 processes x 2 rows: process p takes the p-th 2 rows of each 4 (accelerate's BatchSamplerShard)
    monkeypatch.setattr(TrainingArguments, "world_size", property(lambda args: 2))
    per_process = []
    for process, part in enumerate((rows[4:6], rows[6:])):
        monkeypatch.setattr(TrainingArguments, "process_index", property(lambda args, p=process: p))
        per_process += _masked_rows(_masked_lm_trainer(tmp_path, 2, 1), 1, [collate(part)])
    assert per_process == one


def test_masked_lm_updates_equal_one_big_batch_under_gradient_accumulation(tmp_path):
    """With the same masks for the same global batch however it is split, an SGD step at 4 x 1, 2 x 2 and 1 x 4 is
    the same update (the masked-LM loss follows `num_items_in_batch`); the masks per micro-batch made them differ."""

    def update(batch: int, accumulation: int) -> torch.Tensor:
        trainer = _masked_lm_trainer(
            tmp_path, batch, accumulation, max_steps=1, learning_rate=0.5, optim="sgd", max_grad_norm=0.0
        )
        before = torch.cat([p.detach().flatten() for p in trainer.model.parameters()])
        trainer.train()
        return torch.cat([p.detach().flatten() for p in trainer.model.parameters()]) - before

    big = update(4, 1)
    assert big.abs().max() > 0
    for split in [(2, 2), (1, 4)]:
        torch.testing.assert_close(update(*split), big, atol=1e-6, rtol=1e-5, msg=f"{split}")


def test_label_smoothing_names_the_loss_terms_it_leaves_untrained(tmp_path, caplog):
    """The Trainer's label smoother pops `labels`: the model computes no loss, and its load-balancing, router z- and
    LM z-losses (a classifier's auxiliary LM loss) were not trained, without a word (15 % of a step's update at a
    load-balancing coefficient of 0.5 and a router z-loss of 0.1)."""
    moe = dict(num_local_experts=4, num_experts_per_tok=2, output_router_logits=True, router_z_loss_coef=0.1)
    cases = [
        (
            DecoderForCausalLM,
            dict(moe, router_aux_loss_coef=0.5, lm_z_loss_coef=1e-4),
            0.1,
            ["router_aux_loss_coef=0.5", "router_z_loss_coef=0.1", "lm_z_loss_coef=0.0001"],
        ),
        (
            DecoderForSequenceClassification,
            dict(num_labels=2, classifier_lm_loss_weight=0.5),
            0.1,
            ["classifier_lm_loss_weight=0.5"],
        ),
        # the classifiers' router losses (as the causal LM's since they have them), no LM z-loss
        (
            DecoderForSequenceClassification,
            dict(moe, num_labels=2, router_aux_loss_coef=0.5, lm_z_loss_coef=1e-4),
            0.1,
            ["router_aux_loss_coef=0.5", "router_z_loss_coef=0.1"],
        ),
        (DecoderForTokenClassification, dict(moe, num_labels=2, router_aux_loss_coef=0.5), 0.1, ["router_z_loss_coef"]),
        (DecoderForCausalLM, dict(moe, router_aux_loss_coef=0.5), 0.0, []),  # no smoothing: the model's loss runs
        (DecoderForCausalLM, {}, 0.1, []),  # nothing beside the cross-entropy
    ]
    for model_class, config, smoothing, named in cases:
        caplog.clear()
        args = TrainingArguments(str(tmp_path), label_smoothing_factor=smoothing, report_to=[], use_cpu=True)
        with caplog.at_level(logging.WARNING, logger="archlab.training.trainer"):
            AtomicCheckpointTrainer(model=model_class(tiny_decoder_config(**config)), args=args)
        if named:
            assert "label_smoothing_factor" in caplog.text and all(term in caplog.text for term in named), caplog.text
            assert model_class is DecoderForCausalLM or "lm_z_loss_coef" not in caplog.text, caplog.text
        else:
            assert not caplog.text, caplog.text


def test_a_checkpoint_holds_the_tokenizer_as_the_final_folder_does(tmp_path):
    """The Trainer's own save wrote a checkpoint's tokenizer with `tokenizer_class` "TokenizersBackend" (transformers 4
    cannot load it), its chat template in `chat_template.jinja` and the padding side of its construction."""
    from archlab.tokenization.training import save_tokenizer, train_tokenizer

    tokenizer = train_tokenizer(["def f(x):\n    return x + 1\n"] * 8, vocab_size=300, min_frequency=1)
    tokenizer.padding_side = "left"
    final = tmp_path / "final"
    save_tokenizer(tokenizer, final)
    args = TrainingArguments(
        output_dir=str(tmp_path / "run"),
        max_steps=1,
        per_device_train_batch_size=2,
        save_steps=1,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    model = DecoderForCausalLM(tiny_decoder_config())
    AtomicCheckpointTrainer(model=model, args=args, train_dataset=_rows(2), processing_class=tokenizer).train()
    checkpoint = tmp_path / "run" / "checkpoint-1"
    for name in sorted(os.listdir(final)):
        assert (checkpoint / name).read_bytes() == (final / name).read_bytes(), name
    assert not (checkpoint / "chat_template.jinja").exists()
