"""Pretrain an archlab model from scratch -- by default a small LLaMA-recipe decoder on the embedded corpus (the
Python standard library's source), with a freshly trained byte-level BPE tokenizer:

    python scripts/pretrain.py

Seed 001's workflow as one command, shaped like transformers' `examples/pytorch/language-modeling/run_clm.py`:
load data -> train (or load) a tokenizer -> tokenize and pack into blocks (documents never attend to each other)
-> `Trainer` -> validation loss and perplexity before and after -> save model, tokenizer, loss curve and model card
-> print a generated sample. Every flag of `TrainingArguments` works (`--max_steps`, `--learning_rate`,
`--save_steps`, `--resume_from_checkpoint true`, ...).

Objectives per `--model_kind`:
- `decoder`: next-token prediction on packed blocks (position ids restart per document);
- `seq2seq`: continuation -- the encoder reads the first half of a block, the decoder predicts the second half
  (the prefix-LM objective of seed 003 in encoder-decoder form);
- `masked_lm`: BERT's 15 % masking on packed blocks (seed 001's fill-mask workflow).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DataCollatorForLanguageModeling, TrainerCallback, default_data_collator, set_seed

from archlab.scripts.common import (
    ArchlabTrainingArguments,
    AtomicCheckpointTrainer,
    DataArguments,
    ModelArguments,
    build_config,
    check_data_flags,
    check_model_flags,
    check_positive,
    check_training_flags,
    checkpoint_tokenizer,
    clear_output_dir,
    dataset_label,
    finished_run,
    log,
    model_kind,
    parse_arguments,
    resolve_resume,
    run_cli,
    save_final,
    train_evaluating_at_start,
    with_perplexity,
)
from archlab.tokenization.data import (
    IGNORE_INDEX,
    check_columns,
    check_not_empty,
    limit,
    load_raw_datasets,
    pack_causal_lm,
    tokenize_documents,
)
from archlab.tokenization.training import load_tokenizer, train_tokenizer


@dataclass
class PretrainTrainingArguments(ArchlabTrainingArguments):
    """`TrainingArguments` with defaults for the README's few-minute CPU run."""

    output_dir: str | None = field(default="runs/pretrain", metadata={"help": "Where checkpoints and the model go."})
    max_steps: int = field(default=600, metadata={
        "help": "Optimizer steps (>= 1), or -1 to train --num_train_epochs epochs."})
    per_device_train_batch_size: int = field(default=8, metadata={"help": "Blocks per step."})
    per_device_eval_batch_size: int = field(default=16, metadata={"help": "Blocks per evaluation step."})
    dataloader_pin_memory: bool = field(default=False, metadata={"help": "Pin memory (only useful on a GPU)."})
    learning_rate: float = field(default=2e-3, metadata={"help": "Peak AdamW learning rate."})
    lr_scheduler_type: str = field(default="cosine", metadata={"help": "Learning-rate schedule."})
    warmup_steps: float = field(default=30, metadata={"help": "Linear warm-up steps (or a fraction < 1)."})
    weight_decay: float = field(default=0.1, metadata={"help": "AdamW weight decay."})
    logging_steps: float = field(default=25, metadata={"help": "Log the training loss every N steps."})
    eval_strategy: str = field(default="steps", metadata={"help": "no | steps | epoch"})
    eval_steps: float | None = field(default=200, metadata={"help": "Evaluate every N steps."})
    save_steps: float = field(default=200, metadata={"help": "Checkpoint every N steps."})
    save_total_limit: int | None = field(default=2, metadata={"help": "Keep at most N checkpoints."})
    seed: int = field(default=42, metadata={"help": "Random seed."})


@dataclass
class PretrainDataArguments(DataArguments):
    """`DataArguments` with defaults for the README's run: a shuffled 300-file slice of the corpus (~1.5M tokens,
    more than 240 steps of 8 x 256 tokens consume), tokenized by two processes."""

    max_train_samples: int | None = field(default=300, metadata={"help": "Use at most this many training documents."})
    preprocessing_num_workers: int | None = field(default=2, metadata={"help": "Processes for `datasets.map`."})


@dataclass
class PretrainArguments:
    sample_prompt: str = field(default="def ", metadata={"help": "Prompt of the sample printed at the end."})
    sample_max_new_tokens: int = field(default=80, metadata={"help": "Length of that sample."})
    eval_max_blocks: int | None = field(default=64, metadata={"help": "Evaluate on at most this many blocks."})


def get_tokenizer(model_args: ModelArguments, train_split: Any, text_column: str, block_size: int,
                  resume: str | None = None):
    saved = checkpoint_tokenizer(model_args, resume)
    if saved is not None:
        return saved
    if model_args.tokenizer_name or model_args.model_name_or_path:
        return load_tokenizer(model_args.tokenizer_name or model_args.model_name_or_path)
    source = limit(train_split, model_args.tokenizer_train_samples)
    log(f"Training a {model_args.tokenizer_algorithm or 'default'} tokenizer for the {model_args.model_kind} ...")
    return train_tokenizer(
        source,
        model_kind=model_args.model_kind,
        algorithm=model_args.tokenizer_algorithm,
        vocab_size=model_args.tokenizer_vocab_size or 4096,
        text_column=text_column,
        model_max_length=block_size,
    )


def split_for_seq2seq(blocks: Any, num_proc: int | None) -> Any:
    """Encoder input = first half of each block, labels = second half (continuation objective)."""

    def split(batch: dict[str, list]) -> dict[str, list]:
        half = len(batch["input_ids"][0]) // 2
        masks = batch["attention_mask"]  # 0 on the padding of a batch's last block
        return {
            "input_ids": [ids[:half] for ids in batch["input_ids"]],
            "attention_mask": [mask[:half] for mask in masks],
            "labels": [[t if m else IGNORE_INDEX for t, m in zip(ids[half:], mask[half:])]
                       for ids, mask in zip(batch["input_ids"], masks)],
        }

    kwargs = {} if not hasattr(blocks, "__len__") else {"num_proc": num_proc, "desc": "Splitting blocks"}
    halves = blocks.map(split, batched=True, remove_columns=blocks.column_names, **kwargs)
    # A tail block that is mostly padding can leave nothing to predict (or an all-padding encoder input).
    return halves.filter(lambda row: any(row["attention_mask"]) and any(t != IGNORE_INDEX for t in row["labels"]))


def prepare_data(kind: str, raw: Any, tokenizer: Any, data_args: DataArguments) -> dict[str, Any]:
    """Tokenized, packed train/validation sets and the collator for `kind`."""
    block_size = data_args.block_size * (2 if kind == "seq2seq" else 1)
    packed = {}
    for split in ("train", "validation"):
        documents = tokenize_documents(
            raw[split], tokenizer, data_args.text_column_name,
            data_args.preprocessing_num_workers, data_args.overwrite_cache,
        )
        packed[split] = pack_causal_lm(
            documents, block_size, tokenizer.pad_token_id, data_args.preprocessing_num_workers,
            data_args.overwrite_cache, restart_positions=kind != "seq2seq", causal_labels=kind == "decoder",
        )
        if kind == "seq2seq":
            packed[split] = split_for_seq2seq(packed[split], data_args.preprocessing_num_workers)
    if kind == "masked_lm":
        collator = DataCollatorForLanguageModeling(tokenizer, mlm=True, mlm_probability=0.15)
    else:
        collator = default_data_collator
    return {"train": packed["train"], "validation": packed["validation"], "collator": collator}


def print_sample(model: Any, tokenizer: Any, prompt: str, max_new_tokens: int, seed: int) -> str:
    model.eval()
    inputs = tokenizer(prompt, return_tensors="pt")
    set_seed(seed)
    with torch.no_grad():
        output = model.generate(
            **inputs, max_new_tokens=max_new_tokens, do_sample=True, temperature=0.8, top_k=40,
            pad_token_id=tokenizer.pad_token_id,
        )
    text = tokenizer.decode(output[0], skip_special_tokens=True)
    log(f"Sample (prompt {prompt!r}, temperature 0.8, top-k 40):\n{text}\n")
    return text


def main(argv: Sequence[str] | None = None, callbacks: list[TrainerCallback] | None = None) -> dict[str, float]:
    model_args, data_args, training_args, extra = parse_arguments(
        (ModelArguments, PretrainDataArguments, PretrainTrainingArguments, PretrainArguments), argv, __doc__
    )
    # --- every check that can fail runs before anything is written ---------------------------------------------
    kind = model_kind(model_args.model_kind)
    check_model_flags(model_args)
    check_training_flags(training_args)
    check_data_flags(data_args, training_args)
    check_positive(extra, ("eval_max_blocks",), " (or unset: all)")
    resume = resolve_resume(training_args, training_args.overwrite_output_dir)
    finished = finished_run(resume, training_args)
    if finished is not None:
        return finished
    set_seed(training_args.seed)
    if training_args.label_names is None:  # else the Trainer also waits for `shift_labels` and reports no eval loss
        training_args.label_names = ["labels"]

    raw = load_raw_datasets(
        data_args.dataset_name, data_args.dataset_config_name, data_args.train_file, data_args.validation_file,
        data_args.validation_split_percentage, data_args.streaming, model_args.cache_dir, data_args.sample_by,
        training_args.seed,
    )
    if data_args.max_train_samples is not None and not data_args.streaming:
        raw["train"] = raw["train"].shuffle(seed=training_args.seed)  # a slice of all of it, not of a-m
    raw["train"] = limit(raw["train"], data_args.max_train_samples)
    raw["validation"] = limit(raw["validation"], data_args.max_eval_samples)
    for split in ("train", "validation"):
        check_not_empty(raw[split], split)
        check_columns(raw[split], data_args.text_column_name, split=split)

    tokenizer = get_tokenizer(model_args, raw["train"], data_args.text_column_name, data_args.block_size, resume)
    config = build_config(model_args, tokenizer, data_args.block_size)
    data = prepare_data(model_args.model_kind, raw, tokenizer, data_args)
    check_not_empty(data["train"], "packed train")
    evaluation = data["validation"]
    if extra.eval_max_blocks is not None:
        evaluation = limit(evaluation, extra.eval_max_blocks)

    if model_args.model_name_or_path:
        model = kind.auto_class.from_pretrained(model_args.model_name_or_path, config=config)
    else:
        model = kind.auto_class.from_config(config)
    if model_args.attn_implementation:
        model.set_attn_implementation(model_args.attn_implementation)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"{type(model).__name__}: {n_params / 1e6:.2f}M parameters, vocabulary {len(tokenizer)}, "
        f"blocks of {data_args.block_size} tokens")

    # --- training --------------------------------------------------------------------------------------------
    if training_args.overwrite_output_dir:
        clear_output_dir(training_args.output_dir)
    trainer = AtomicCheckpointTrainer(
        model=model,
        args=training_args,
        train_dataset=data["train"],
        eval_dataset=evaluation,
        data_collator=data["collator"],
        processing_class=tokenizer,
        callbacks=callbacks,
    )
    before, result = train_evaluating_at_start(trainer, resume, lambda metrics: log(
        f"Before training: validation loss {metrics['eval_loss']:.4f}, "
        f"perplexity {with_perplexity(dict(metrics))['eval_perplexity']:.1f}"))
    before = with_perplexity(before)
    after = with_perplexity(trainer.evaluate())
    log(f"After training:  validation loss {after['eval_loss']:.4f}, perplexity {after['eval_perplexity']:.1f} "
        f"(before: {before['eval_loss']:.4f} / {before['eval_perplexity']:.1f})")

    metrics = {**result.metrics, **after, **{f"before_{k}": v for k, v in before.items()}}
    save_final(trainer, tokenizer, training_args.output_dir, metrics, [dataset_label(data_args)],
               model_args.model_name_or_path)
    log(f"Saved model, tokenizer, loss curve and model card to {training_args.output_dir}")
    if model_args.model_kind == "decoder" and extra.sample_max_new_tokens > 0:
        print_sample(model, tokenizer, extra.sample_prompt, extra.sample_max_new_tokens, training_args.seed)
    return metrics


def cli() -> None:
    """`archlab-pretrain`: `main` with one-line errors for bad input (see `run_cli`)."""
    run_cli(main)


if __name__ == "__main__":
    cli()
