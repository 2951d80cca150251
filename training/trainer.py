"""Trainers whose `checkpoint-N` folders are complete or absent, that resume to the end of a run and report the
whole run's training loss, and that train one model under data parallelism even after an `evaluate()`."""

from __future__ import annotations

import copy
import json
import logging
import os
import shutil
from typing import Any

import numpy as np
import torch
from transformers import (
    DataCollatorForLanguageModeling,
    Seq2SeqTrainer,
    Trainer,
    TrainerCallback,
    TrainerState,
    TrainingArguments,
)
from transformers.tokenization_utils_base import PreTrainedTokenizerBase
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_utils import TrainOutput, has_length, rotate_checkpoints, unwrap_peft_model
from transformers.training_args import ParallelMode

from archlab.tokenization.data import IGNORE_INDEX
from archlab.tokenization.training import save_tokenizer

from .callbacks import RouterBiasCallback, wants_router_bias_updates
from .checkpoints import RUN_FACTS, STAGING
from .reporting import log

logger = logging.getLogger(__name__)


class LogAtSave(TrainerCallback):
    """Log the training loss at every save, so that a checkpoint's log history covers each step up to it and a resumed
    run can report the mean loss of the whole run."""

    def on_step_end(self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any) -> Any:
        if control.should_save and args.logging_strategy != "no":
            control.should_log = True
        return control

    on_epoch_end = on_step_end


def whole_run_train_loss(
    log_history: list[dict[str, Any]], resumed_at: int, end: int, mean_since: float
) -> float | None:
    """The mean training loss over steps 1..`end` of a run resumed at step `resumed_at`: each loss logged up to the
    resume (the mean over the steps since the log before it) weighted by its steps, plus `mean_since` for the
    resumed steps. None when the logged losses stop short of `resumed_at` (steps whose loss was never logged)."""
    total, logged = 0.0, 0
    for entry in log_history:
        step = entry.get("step", 0)
        if "loss" in entry and logged < step <= resumed_at:
            total += entry["loss"] * (step - logged)
            logged = step
    if logged != resumed_at or end <= 0:
        return None
    return (total + mean_since * (end - resumed_at)) / end


def terms_outside_a_replaced_loss(model: Any) -> list[tuple[str, str, float]]:
    """The terms of `model`'s own loss that are not trained when the Trainer computes the loss itself from the logits
    and the labels (`label_smoothing_factor`, `compute_loss_func`: the model gets no `labels` and returns no loss), as
    (what, its config setting, the setting's value): a mixture of experts' load-balancing loss (added with
    `output_router_logits`) and router z-loss (every decoder head's), the LM z-loss, a classifier's auxiliary LM
    loss."""
    config = getattr(model, "config", None)

    def value(name: str) -> float:
        return getattr(config, name, 0) or 0

    if hasattr(model, "auxiliary_lm_targets"):  # DecoderForSequenceClassification
        candidates = [("the auxiliary LM loss", "classifier_lm_loss_weight")]
    elif type(model).__name__.endswith(("ForTokenClassification", "ForQuestionAnswering")):
        candidates = []  # no LM head, no LM z-loss
    else:
        candidates = [("the LM z-loss", "lm_z_loss_coef")]
    if value("num_local_experts") > 0:
        candidates.append(("the router z-loss", "router_z_loss_coef"))
        if value("output_router_logits"):
            candidates.append(("the load-balancing loss", "router_aux_loss_coef"))
    return [(what, name, value(name)) for what, name in candidates if value(name) > 0]


class AtomicCheckpointTrainer(Trainer):
    """A `Trainer` whose `checkpoint-N` folders are complete or absent: each is written under `.staging/` and
    renamed into place, so a run killed mid-save resumes from the previous complete checkpoint. Resuming from a
    checkpoint at the run's last step trains nothing more, a resumed run's `train_loss` is the whole run's, and
    `train()` trains one model under data parallelism even after an `evaluate()`
    (see `_forget_evaluation_only_preparation`)."""

    _staging_dir: str | None = None
    run_facts: dict[str, Any] | None = None  # saved in each checkpoint (see `checkpoints.run_facts`)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.add_callback(LogAtSave)
        if wants_router_bias_updates(self.model):  # DeepSeek-V3's balancing step after each optimizer step
            self.add_callback(RouterBiasCallback)
        self._warn_of_terms_a_replaced_loss_drops()
        collator = self.data_collator
        self._masking = None
        # whole-word masking needs the collator's offset mappings: left to the collator
        if isinstance(collator, DataCollatorForLanguageModeling) and collator.mlm and not collator.whole_word_mask:
            self._masking = copy.copy(collator)

    def _warn_of_terms_a_replaced_loss_drops(self) -> None:
        """With `label_smoothing_factor` (or a `compute_loss_func`) the Trainer takes `labels` out of the model's
        inputs and computes the loss itself: the model returns none, and the terms of its own loss beside the
        cross-entropy (`terms_outside_a_replaced_loss`) were left untrained without a word (a load-balancing loss at
        0.5 and router z-loss at 0.1 were 15 % of a step's update; stock Mixtral drops its load-balancing loss the
        same way). Adding them back here would compute the model's loss terms a second time outside the model;
        the warning names them instead."""
        if self.model is None or (self.label_smoother is None and self.compute_loss_func is None):
            return
        terms = terms_outside_a_replaced_loss(unwrap_peft_model(self.model))
        if not terms:
            return
        how = "label_smoothing_factor" if self.label_smoother is not None else "compute_loss_func"
        named = " and ".join(f"{what} ({name}={value:g})" for what, name, value in terms)
        logger.warning(
            "%s: the Trainer computes the loss from the logits and the labels itself, so the model's own loss does "
            "not run and %s %s not trained. Leave %s out to train %s, or set %s to 0.",
            how,
            named,
            "is" if len(terms) == 1 else "are",
            how,
            "it" if len(terms) == 1 else "them",
            ", ".join(name for _, name, _ in terms),
        )

    def get_train_dataloader(self) -> Any:
        """With a masked-LM collator, the training batches leave the loader unmasked; `get_batch_samples` masks them
        (see `_mask_by_step`)."""
        if self._masking is None:
            return super().get_train_dataloader()
        unmasked = copy.copy(self._masking)
        unmasked.mlm = False
        self.data_collator = unmasked
        try:
            return super().get_train_dataloader()
        finally:
            self.data_collator = self._masking

    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: torch.device) -> tuple[list, Any]:
        batches, count = super().get_batch_samples(epoch_iterator, num_batches, device)
        if self._masking is not None:
            for index, batch in enumerate(batches):
                self._mask_by_step(batch, index)
            count = self._get_num_items_in_batch(batches, device)
        self._count_auxiliary_lm_targets(batches, device)
        return batches, count

    def _count_auxiliary_lm_targets(self, batches: list, device: torch.device) -> None:
        """For a model with an auxiliary LM loss beside its own (`DecoderForSequenceClassification` with
        `classifier_lm_loss_weight`; it names the targets with `auxiliary_lm_targets`), give each micro-batch the
        count of those targets over the whole accumulated batch as `num_lm_items_in_batch`, counted as the Trainer
        counts `num_items_in_batch` (across processes under `average_tokens_across_devices`). The model divides the
        LM loss's sum by it, so the LM term weighs every token as one big batch does: the Trainer's own count is of
        the classification labels, and a per-micro-batch token mean weighed short and long micro-batches alike."""
        model = unwrap_peft_model(self.accelerator.unwrap_model(self.model))
        targets_of = getattr(model, "auxiliary_lm_targets", None)
        if targets_of is None or not batches or not self.model_accepts_loss_kwargs:
            return
        targets = [targets_of(batch) for batch in batches]
        if any(t is None for t in targets):
            return
        count = self._get_num_items_in_batch([{"labels": t, "shift_labels": t} for t in targets], device)
        if count is not None:
            for batch in batches:
                batch["num_lm_items_in_batch"] = count

    def _mask_by_step(self, batch: dict[str, Any], index: int) -> None:
        """Mask micro-batch `index` of the coming optimizer step row by row, each row with a generator seeded by
        (seed, step, the row's place in the step's global batch), not by the global RNG the collator draws from.

        The loader collates one batch ahead and a resumed run skips the batches already trained without collating
        them, so collator masking drew other masks after a resume (and shifted the dropout RNG the checkpoint
        restores): a resumed masked-LM run trained on other masks than an uninterrupted one. Seeded by the row's
        place in the global batch (micro-batch, then process, then row, as accelerate deals the batches out) rather
        than by process and micro-batch, the masks do not depend on how the global batch is split: 1 process x 4
        rows, 2 accumulated micro-batches of 2 and 2 processes x 2 mask alike and train the same model, and a resume
        with another split of the same examples per step goes on as the uninterrupted run. Each row is masked
        without the padding after it, which depends on the rows it is batched with."""
        ids = batch["input_ids"]
        rows = ids.cpu()
        # (the masking collator takes it out of the batch; the unmasked one left it for the model's forward)
        special = batch.pop("special_tokens_mask", None)
        special = special.cpu() if special is not None else None
        masked, labels = rows.clone(), torch.full_like(rows, IGNORE_INDEX)
        processes = max(1, self.args.world_size)
        per_process = max(1, self._train_batch_size // (processes if self.accelerator.split_batches else 1))
        first = (index * processes + self.args.process_index) * per_process
        kept = self._masking.generator
        try:
            for row in range(rows.shape[0]):
                span = self._unpadded_span(rows[row])
                seed = np.random.SeedSequence([self.args.seed, self.state.global_step, first + row])
                self._masking.generator = torch.Generator().manual_seed(int(seed.generate_state(1, np.uint64)[0] >> 1))
                row_masked, row_labels = self._masking.torch_mask_tokens(
                    rows[row : row + 1, span].clone(), None if special is None else special[row : row + 1, span]
                )
                masked[row, span], labels[row, span] = row_masked[0], row_labels[0]
        finally:
            self._masking.generator = kept
        batch["input_ids"], batch["labels"] = masked.to(ids.device), labels.to(ids.device)

    def _unpadded_span(self, row: torch.Tensor) -> slice:
        """The positions of `row` without the padding the collator added on the tokenizer's padding side."""
        pad = self._masking.tokenizer.pad_token_id
        real = (row != pad).nonzero() if pad is not None else None
        if real is None or len(real) == 0:
            return slice(None)
        if self._masking.tokenizer.padding_side == "left":
            return slice(int(real[0]), None)
        return slice(None, int(real[-1]) + 1)

    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs: Any) -> TrainOutput:
        self._forget_evaluation_only_preparation()
        if not isinstance(resume_from_checkpoint, str):
            return super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)
        start = TrainerState.load_from_json(os.path.join(resume_from_checkpoint, "trainer_state.json"))
        max_steps = self.args.max_steps
        if max_steps <= 0:
            max_steps = self.set_initial_training_values(self.args, self.get_train_dataloader())[-1]
        if start.global_step >= max_steps:
            # The Trainer checks for the end of the run only after a step, so it would train one step past it.
            self._load_from_checkpoint(resume_from_checkpoint)
            self.state = start
            mean = whole_run_train_loss(start.log_history, start.global_step, start.global_step, 0.0)
            metrics = {"epoch": start.epoch, "total_flos": start.total_flos}
            return TrainOutput(start.global_step, mean, metrics if mean is None else {**metrics, "train_loss": mean})
        output = super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)
        # The Trainer's train_loss averages the steps this call ran; report the whole run's where the log allows.
        mean = whole_run_train_loss(self.state.log_history, start.global_step, output.global_step, output.training_loss)
        summary = next((entry for entry in reversed(self.state.log_history) if "train_loss" in entry), {})
        for metrics in (output.metrics, summary):
            if mean is None:
                metrics["train_loss_since_resume"] = metrics.pop("train_loss", output.training_loss)
            else:
                metrics["train_loss"] = mean
        if mean is None:
            log(
                f"train_loss_since_resume: the mean loss of the steps after {resume_from_checkpoint} only; the "
                "checkpoint's log does not cover every step before it."
            )
        return TrainOutput(output.global_step, output.training_loss if mean is None else mean, output.metrics)

    def _init_training_state(
        self, max_steps: int, num_update_steps_per_epoch: int, num_train_epochs: int, checkpoint: str | None, trial: Any
    ) -> tuple[int, int]:
        """Where a resumed run goes on in a streamed (length-less) training set that it passes through more than once.

        The Trainer takes an epoch of such a set to be --max_steps long, so it resumed in the first pass, skipping
        global_step batches of it: past the end of a shorter stream, it started the next pass at its first batch,
        and trained other batches than an uninterrupted run. The checkpoint's `epoch` (passes done, plus the
        fraction of its own max_steps x gradient_accumulation_steps batches into the current one) says where it
        stopped."""
        epochs, steps = super()._init_training_state(
            max_steps, num_update_steps_per_epoch, num_train_epochs, checkpoint, trial
        )
        if checkpoint is None or has_length(self.train_dataset) or self.args.ignore_data_skip:
            return epochs, steps
        saved = TrainerState.load_from_json(os.path.join(checkpoint, "trainer_state.json"))
        if not saved.epoch or not saved.max_steps:
            return epochs, steps
        passes = int(saved.epoch)
        batches = round((saved.epoch - passes) * saved.max_steps * self.args.gradient_accumulation_steps)
        return passes, batches

    def _forget_evaluation_only_preparation(self) -> None:
        """Undo an evaluation-only preparation of the model, so `train()` wraps it for data parallelism.

        In transformers 5.23 with accelerate 1.15, `evaluate()` before the first `train()` prepares the model with
        `accelerator.prepare_model(model, evaluation_mode=True)`: no DistributedDataParallel wrapper, but the model
        is marked `_is_accelerate_prepared`, so the `accelerator.prepare` of the training that follows returns it
        unwrapped. Every process then trains its own replica on its own shard of the data, with no error. Undoing
        that mark (and the evaluation's mixed-precision forward wrapper) lets `train()` wrap the model as usual.
        Sharded engines (FSDP, DeepSpeed) fully prepare the model for evaluation and are left alone.
        """
        model = self.model
        if (
            self.args.parallel_mode != ParallelMode.DISTRIBUTED
            or self.is_fsdp_enabled
            or self.is_deepspeed_enabled
            or isinstance(self.model_wrapped, torch.nn.parallel.DistributedDataParallel)
        ):
            return
        candidates = (model,) if self.model_wrapped is model else (model, self.model_wrapped)
        prepared = [m for m in candidates if getattr(m, "_is_accelerate_prepared", False)]
        if not prepared:
            return
        for module in prepared:
            del module._is_accelerate_prepared
        self.accelerator._models[:] = [m for m in self.accelerator._models if all(m is not p for p in prepared)]
        original = model.__dict__.pop("_original_forward", None)  # set with the evaluation's autocast wrapper
        if original is not None:  # training adds its own wrapper
            if getattr(original, "__func__", None) is type(model).forward:
                model.__dict__.pop("forward", None)
            else:
                model.forward = original
        self.model_wrapped = model

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """The Trainer's save, with the tokenizer written as the run's final folder holds it (`save_tokenizer`): a
        `checkpoint-N` held a `tokenizer_class` of "TokenizersBackend" (which transformers 4 cannot load), the chat
        template in a `chat_template.jinja` beside it and the padding side of the tokenizer's construction."""
        super()._save(output_dir, state_dict)
        if self.args.should_save and isinstance(self.processing_class, PreTrainedTokenizerBase):
            save_tokenizer(self.processing_class, output_dir if output_dir is not None else self.args.output_dir)

    def _get_output_dir(self, trial: Any) -> str:
        return self._staging_dir or super()._get_output_dir(trial)

    def _save_checkpoint(self, model: torch.nn.Module, trial: Any) -> None:
        # Under torchrun / accelerate launch every process writes into the staging folder (its own
        # `rng_state_R.pth`; rank 0 the rest), but only the saving process clears it and renames it into place, each
        # after every process is done with it: a process that renamed or cleared the folder while another still
        # wrote to it crashed the run or left a `checkpoint-N` without its files.
        run_dir = super()._get_output_dir(trial)
        staging = os.path.join(run_dir, STAGING)
        if self.args.should_save:
            shutil.rmtree(staging, ignore_errors=True)
        self.accelerator.wait_for_everyone()
        self._staging_dir = staging
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self._staging_dir = None
        name = f"checkpoint-{self.state.global_step}"
        final = os.path.join(run_dir, name)
        if self.state.best_model_checkpoint and STAGING in self.state.best_model_checkpoint:
            # The Trainer names the best checkpoint where it saved it, in the staging folder, and writes that name
            # into the checkpoint's trainer_state.json: a run resumed from it found no such folder, forgot its best
            # checkpoint, let the rotation delete it and ended on another model than the best.
            self.state.best_model_checkpoint = self.state.best_model_checkpoint.replace(os.path.join(STAGING, ""), "")
            if self.args.should_save:
                self.state.save_to_json(os.path.join(staging, name, TRAINER_STATE_NAME))
        self.accelerator.wait_for_everyone()
        if self.args.should_save:
            if self.run_facts is not None:
                with open(os.path.join(staging, name, RUN_FACTS), "w", encoding="utf-8") as f:
                    json.dump(self.run_facts, f)
            if os.path.isdir(final):
                shutil.rmtree(final)
            os.replace(os.path.join(staging, name), final)
            shutil.rmtree(staging, ignore_errors=True)
        if self.args.push_to_hub:
            super()._push_from_checkpoint(final)  # the main process pushes, the others return at once
        if self.args.should_save:
            rotate_checkpoints(run_dir, self.args.save_total_limit, self.state.best_model_checkpoint, use_mtime=True)
        self.accelerator.wait_for_everyone()

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        """`--push_to_hub` pushes a checkpoint once it is in place (`_save_checkpoint`), not from inside the staged
        save: the Trainer's background upload then read `.staging/checkpoint-N`, renamed away while it ran, and its
        upload of --output_dir took in the staging folder's files (optimizer state included) under `.staging/`."""
        if self._staging_dir is None:
            super()._push_from_checkpoint(checkpoint_folder)

    def _issue_warnings_after_load(self, load_result: Any) -> None:
        """A checkpoint stores a tied head once, under the embedding's name; the head then loads with the embedding
        and is not missing (the Trainer would report `lm_head.weight` as missing from every such checkpoint)."""
        state = self.model.state_dict(keep_vars=True)
        loaded = {state[key].data_ptr() for key in state if key not in load_result.missing_keys}
        missing = [key for key in load_result.missing_keys if key not in state or state[key].data_ptr() not in loaded]
        super()._issue_warnings_after_load(load_result._replace(missing_keys=missing))


class AtomicSeq2SeqTrainer(AtomicCheckpointTrainer, Seq2SeqTrainer):
    """`Seq2SeqTrainer` (generation in evaluation) with complete-or-absent checkpoints.

    Seq2SeqTrainer's evaluation writes every generation default (`max_length=20`, `num_beams=1`, ...) into the model's
    own `generation_config`, so saved folders would carry them and every later `generate(max_new_tokens=...)` warns
    about a conflicting `max_length`; each prediction step here leaves the model's generation config as it found it.
    """

    def prediction_step(self, *args, **kwargs):
        kept = copy.deepcopy(self.model.generation_config)
        kept._from_model_config = False  # what the parent sets, so generate does not re-derive it every step
        try:
            return super().prediction_step(*args, **kwargs)
        finally:
            self.model.generation_config = kept
