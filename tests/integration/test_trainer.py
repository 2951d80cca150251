"""Trainer integration: the loss falls on a learnable toy task; gradient accumulation equals one big batch (for the
causal LM and the classifier, with its auxiliary LM loss too); the Trainer's label smoothing shifts the causal LM's
labels."""

import torch
from datasets import Dataset
from transformers import Trainer, TrainingArguments

from archlab import DecoderForCausalLM, DecoderForSequenceClassification
from archlab.training.trainer import AtomicCheckpointTrainer

from helpers import TINY, tiny_decoder_config


def _dataset(n=32, seed=0):
    """Rows of counting sequences with ragged lengths (padding labels = -100 makes num_items_in_batch matter)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        length = int(torch.randint(4, 16, (1,), generator=g))
        start = int(torch.randint(3, 60, (1,), generator=g))
        ids = list(range(start, start + length)) + [0] * (16 - length)
        labels = ids[:length] + [-100] * (16 - length)
        mask = [1] * length + [0] * (16 - length)
        rows.append({"input_ids": ids, "labels": labels, "attention_mask": mask})
    return Dataset.from_list(rows)


def _args(tmp_path, **kw):
    base = dict(
        output_dir=str(tmp_path),
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        seed=0,
        data_seed=0,
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    return TrainingArguments(**{**base, **kw})


def test_loss_falls(tmp_path):
    torch.manual_seed(0)
    model = DecoderForCausalLM(tiny_decoder_config())
    trainer = Trainer(
        model=model,
        args=_args(tmp_path, max_steps=40, per_device_train_batch_size=8, learning_rate=3e-3),
        train_dataset=_dataset(64),
    )
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5


def test_gradient_accumulation_equals_big_batch(tmp_path):
    data = _dataset(8)
    config = tiny_decoder_config()
    big, *accumulated = (
        _one_step_update(DecoderForCausalLM, config, data, tmp_path, batch, accumulation)
        for batch, accumulation in [(4, 1), (2, 2), (1, 4)]
    )
    assert big.abs().max() > 0  # the step did something
    for update in accumulated:
        torch.testing.assert_close(update, big, atol=1e-6, rtol=1e-5)


def _one_step_update(model_class, config, data, tmp_path, batch, accumulation, trainer_class=Trainer):
    """The parameter change of one SGD step at `batch` x `accumulation`."""
    torch.manual_seed(0)
    model = model_class(config)
    before = torch.cat([p.detach().flatten() for p in model.parameters()])
    args = _args(
        tmp_path / f"{batch}x{accumulation}",
        max_steps=1,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=accumulation,
        learning_rate=0.5,
        optim="sgd",
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
    )
    trainer_class(model=model, args=args, train_dataset=data).train()
    return torch.cat([p.detach().flatten() for p in model.parameters()]) - before


def test_classifier_gradient_accumulation_equals_big_batch(tmp_path):
    """The classifier's loss is a mean per batch: Trainer must divide it by the accumulation steps (it did not, as
    `forward` takes `**kwargs`, and each update was 4x too large)."""
    rows = [{"input_ids": list(range(s, s + 8)), "labels": s % 3} for s in (5, 20, 40, 60)]
    config = tiny_decoder_config(num_labels=3, pad_token_id=0)
    big = _one_step_update(DecoderForSequenceClassification, config, Dataset.from_list(rows), tmp_path, 4, 1)
    accumulated = _one_step_update(DecoderForSequenceClassification, config, Dataset.from_list(rows), tmp_path, 1, 4)
    assert big.abs().max() > 0
    torch.testing.assert_close(accumulated, big, atol=1e-6, rtol=1e-5)


def test_classifier_auxiliary_lm_loss_under_gradient_accumulation_weighs_tokens_as_one_big_batch(tmp_path):
    """The auxiliary LM term (`classifier_lm_loss_weight`) is a mean over the batch's tokens: taken per micro-batch,
    rows of 3 and 16 tokens accumulated one at a time weighed alike, and the update differed from one big batch's by
    24 % (5 % at 2 x 2). archlab's trainer counts the LM targets of the accumulated batch for it. The classification
    term stays a mean over the examples, now weighted by `num_items_in_batch`: without the LM loss the plain Trainer
    gets the same update too."""
    rows = [
        {"input_ids": list(range(s, s + n)) + [0] * (16 - n), "attention_mask": [1] * n + [0] * (16 - n), "labels": i}
        for i, (s, n) in enumerate([(5, 3), (20, 12), (40, 6), (60, 16)])
    ]
    data = Dataset.from_list(rows)
    for weight, trainer_class in [(0.5, AtomicCheckpointTrainer), (0.0, Trainer)]:
        config = tiny_decoder_config(num_labels=4, classifier_lm_loss_weight=weight)
        big, *accumulated = (
            _one_step_update(DecoderForSequenceClassification, config, data, tmp_path, *split, trainer_class)
            for split in [(4, 1), (2, 2), (1, 4)]
        )
        assert big.abs().max() > 0
        for update in accumulated:
            torch.testing.assert_close(update, big, atol=1e-6, rtol=1e-5)


def test_label_smoothing_shifts_the_causal_lm_labels(tmp_path):
    """Trainer's label smoother shifts labels only for the causal LMs transformers' table names: without archlab's
    entry it scored each token against itself. With a vanishing factor its loss is the model's own."""
    torch.manual_seed(0)
    model = DecoderForCausalLM(tiny_decoder_config()).eval()
    data = _dataset(8)
    batch = {key: torch.tensor(data[key]) for key in ("input_ids", "labels", "attention_mask")}
    with torch.no_grad():
        own = model(**batch).loss.item()
    args = _args(tmp_path, label_smoothing_factor=1e-6, per_device_eval_batch_size=8)
    smoothed = Trainer(model=model, args=args, eval_dataset=data).evaluate()["eval_loss"]
    assert abs(smoothed - own) < 1e-4 * max(1.0, own)


def test_moe_losses_under_gradient_accumulation_weigh_as_in_one_big_batch(tmp_path):
    """The load-balancing and router z-losses are per-batch means added to a loss the Trainer no longer divides by
    the accumulation steps (`num_items_in_batch`): each micro-batch added them whole, 4x one big batch's weight (as
    Mixtral does). On identical rows every micro-batch's losses equal the big batch's, so the updates must too."""
    row = _dataset(1)[0]
    data = Dataset.from_list([row] * 4)
    config = tiny_decoder_config(
        num_local_experts=4,
        num_experts_per_tok=2,
        output_router_logits=True,
        router_aux_loss_coef=0.5,
        router_z_loss_coef=0.1,
    )
    big = _one_step_update(DecoderForCausalLM, config, data, tmp_path, 4, 1)
    accumulated = _one_step_update(DecoderForCausalLM, config, data, tmp_path, 1, 4)
    assert big.abs().max() > 0
    torch.testing.assert_close(accumulated, big, atol=1e-6, rtol=1e-5)


def test_neftune_noise_on_a_gemma_conversion_gives_gemma_losses(tmp_path):
    """NEFTune adds its noise to the output of `get_input_embeddings()`: Gemma scales by √d inside that module,
    archlab scaled after it, so the noise on a converted Gemma was √d times Gemma's (here the first loss was 4.5724
    against Gemma's 4.5932)."""
    from transformers import AutoModelForCausalLM, GemmaConfig, GemmaForCausalLM

    from archlab.conversion import convert_checkpoint

    torch.manual_seed(0)
    GemmaForCausalLM(GemmaConfig(**TINY, head_dim=8)).save_pretrained(tmp_path / "gemma")
    convert_checkpoint(tmp_path / "gemma", tmp_path / "archlab")
    losses = []
    for folder in ("archlab", "gemma"):
        model = AutoModelForCausalLM.from_pretrained(tmp_path / folder, attn_implementation="eager")
        args = _args(tmp_path / f"run-{folder}", max_steps=3, per_device_train_batch_size=2, neftune_noise_alpha=5.0)
        trainer = Trainer(model=model, args=args, train_dataset=_dataset(8))
        trainer.train()
        losses.append([entry["loss"] for entry in trainer.state.log_history if "loss" in entry])
    assert len(losses[0]) == 3
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=0)
