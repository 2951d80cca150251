"""Pretrain an archlab model from scratch -- by default a small LLaMA-recipe decoder on the embedded corpus (the
Python standard library's source), with a freshly trained byte-level BPE tokenizer:

    python scripts/pretrain.py

The whole pretraining workflow as one command, shaped like transformers'
`examples/pytorch/language-modeling/run_clm.py`: load data -> train (or load) a tokenizer -> tokenize and pack
into blocks (documents never attend to each other) -> `Trainer` -> validation loss and perplexity before and after
-> save model, tokenizer, loss curve and model card -> print a generated sample. Every flag of `TrainingArguments`
works (`--max_steps`, `--learning_rate`, `--save_steps`, `--resume_from_checkpoint true`, ...).

Objectives per `--model_kind`:
- `decoder`: next-token prediction on packed blocks (position ids restart per document);
- `seq2seq`: continuation -- the encoder reads the first half of a block, the decoder predicts the second half
  (the prefix-LM objective in encoder-decoder form, as T5's prefix LM);
- `masked_lm`: BERT's 15 % masking on packed blocks (`--mlm_probability`, as run_mlm.py's; the fill-mask workflow).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from transformers import TrainerCallback, set_seed

from archlab.scripts.arguments import (
    EXAMPLE_MODEL_FLAGS,
    ArchlabTrainingArguments,
    DataArguments,
    ModelArguments,
    check_data_flags,
    check_flag_positive,
    check_metric_for_best_model,
    check_model_flags,
    check_pretrained_model_kind,
    check_training_flags,
    parse_arguments,
    run_cli,
)
from archlab.tokenization.data import check_not_empty, limit
from archlab.training.checkpoints import (
    check_resumed_run_facts,
    check_training_state,
    clear_output_dir,
    finished_run,
    resolve_resume,
    run_facts,
)
from archlab.training.configs import build_config, build_model, check_resumed_config
from archlab.training.dtypes import check_training_dtype, confirm_loaded_dtype, trained_dtype
from archlab.training.evaluation import train_and_evaluate
from archlab.training.kinds import model_kind
from archlab.training.metrics import with_perplexity
from archlab.training.pretraining import prepare_data, pretraining_tokenizer
from archlab.training.reporting import log, training_setup
from archlab.training.sampling import check_fits_the_positions, print_sample, sample_unless_sharded
from archlab.training.saving import dataset_label, save_final
from archlab.training.sources import first_process_writes_the_cache, load_documents
from archlab.training.tokenizers import adopt_context_length, check_resumed_tokenizer
from archlab.training.trainer import AtomicCheckpointTrainer


@dataclass
class PretrainTrainingArguments(ArchlabTrainingArguments):
    """`TrainingArguments` with defaults for the README's few-minute CPU run."""

    output_dir: str | None = field(default="runs/pretrain", metadata={"help": "Where checkpoints and the model go."})
    max_steps: int = field(
        default=600, metadata={"help": "Optimizer steps (>= 1), or -1 to train --num_train_epochs epochs."}
    )
    per_device_train_batch_size: int = field(default=8, metadata={"help": "Blocks per step."})
    per_device_eval_batch_size: int = field(default=16, metadata={"help": "Blocks per evaluation step."})
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
    mlm_probability: float | None = field(
        default=None,
        metadata={"help": "--model_kind masked_lm: the share of tokens masked, as run_mlm.py's flag; unset: 0.15."},
    )


@dataclass
class PretrainArguments:
    sample_prompt: str = field(default="def ", metadata={"help": "Prompt of the sample printed at the end."})
    sample_max_new_tokens: int = field(
        default=80, metadata={"help": "Length of that sample, in tokens (0: no sample); decoders only."}
    )
    eval_max_blocks: int | None = field(default=64, metadata={"help": "Evaluate on at most this many blocks."})


# run_clm.py's and run_mlm.py's data flags that this script does without, and what to pass instead (beside the model
# and data flags of every example script, `EXAMPLE_MODEL_FLAGS`)
PRETRAIN_EXAMPLE_FLAGS = {
    **EXAMPLE_MODEL_FLAGS,
    "max_seq_length": "--block_size, the tokens of each packed block",
    "pad_to_max_length": "leave it out: documents are packed into full --block_size blocks",
    "line_by_line": "--sample_by line: each line of a .txt file is a document (packed into --block_size blocks "
    "with the others)",
}


def check_mlm_probability(probability: float | None, kind: str) -> None:
    """--mlm_probability masks a masked LM's tokens (run_mlm.py's flag, which was unknown here: the share was 0.15
    whatever the command said): in (0, 1), and for --model_kind masked_lm alone (the other objectives mask nothing)."""
    if probability is None:
        return
    if kind != "masked_lm":
        raise ValueError(f"--mlm_probability masks a masked LM's tokens: it is for --model_kind masked_lm, not {kind}.")
    if not 0 < probability < 1:
        raise ValueError(f"--mlm_probability must be in (0, 1) (unset: 0.15), got {probability:g}.")


def report_before(metrics: dict[str, float]) -> None:
    log(f"Before training: validation loss {metrics['eval_loss']:.4f}, perplexity {metrics['eval_perplexity']:.1f}")


def report_after(after: dict[str, float], before: dict[str, float]) -> None:
    log(
        f"After training:  validation loss {after['eval_loss']:.4f}, perplexity {after['eval_perplexity']:.1f} "
        f"(before: {before['eval_loss']:.4f} / {before['eval_perplexity']:.1f})"
    )


def parse(argv: Sequence[str] | None = None) -> tuple:
    """The four argument groups (run_clm.py's and run_mlm.py's flags that this script does without are named with
    what to pass instead: `PRETRAIN_EXAMPLE_FLAGS`)."""
    return parse_arguments(
        (ModelArguments, PretrainDataArguments, PretrainTrainingArguments, PretrainArguments),
        argv,
        __doc__,
        PRETRAIN_EXAMPLE_FLAGS,
    )


def main(argv: Sequence[str] | None = None, callbacks: list[TrainerCallback] | None = None) -> dict[str, float]:
    model_args, data_args, training_args, extra = parse(argv)
    # --- every check that can fail runs before anything is written ---------------------------------------------
    kind = model_kind(model_args.model_kind)
    check_model_flags(model_args, data_args.block_size)
    check_pretrained_model_kind(model_args, kind.auto_class, f"--model_kind {model_args.model_kind}")
    check_training_flags(training_args)
    check_training_dtype(model_args.dtype, model_args.model_name_or_path, training_args.fp16)
    # (its perplexity is derived from the loss after each evaluation: the Trainer never sees it)
    check_metric_for_best_model(training_args, (), "Pretraining's")
    check_data_flags(data_args, training_args)
    check_mlm_probability(data_args.mlm_probability, model_args.model_kind)
    check_flag_positive(extra, ("eval_max_blocks",), " (or unset: all)")
    if extra.sample_max_new_tokens < 0:  # skipped the sample without a word
        raise ValueError(f"--sample_max_new_tokens must be >= 0 (0: no sample), got {extra.sample_max_new_tokens}.")
    resume = resolve_resume(training_args, training_args.overwrite_output_dir)
    check_resumed_config(model_args, resume)
    check_resumed_tokenizer(model_args, resume)
    facts = run_facts(
        training_args,
        data_args.block_size,
        columns={"--text_column_name": data_args.text_column_name},
        weights_dtype=trained_dtype(model_args.dtype, model_args.model_name_or_path),
    )
    check_resumed_run_facts(resume, facts)
    check_training_state(resume, training_args)
    finished = finished_run(resume, training_args)
    if finished is not None:
        return finished
    set_seed(training_args.seed)
    if training_args.label_names is None:  # else the Trainer also waits for `shift_labels` and reports no eval loss
        training_args.label_names = ["labels"]

    raw = load_documents(data_args, model_args.cache_dir, training_args.seed)
    tokenizer = pretraining_tokenizer(model_args, raw["train"], data_args.text_column_name, resume)
    config = build_config(model_args, tokenizer, data_args.block_size)
    with first_process_writes_the_cache(training_args, raw):
        data = prepare_data(
            model_args.model_kind,
            raw,
            tokenizer,
            data_args.block_size,
            data_args.text_column_name,
            data_args.preprocessing_num_workers,
            data_args.overwrite_cache,
            data_args.mlm_probability or 0.15,
        )
    check_not_empty(data["train"], "packed train")
    adopt_context_length(tokenizer, config, kind)  # after packing, which tokenizes whole documents
    if model_args.model_kind == "decoder" and extra.sample_max_new_tokens > 0:  # failed after training, once saved
        prompt_tokens = len(tokenizer(extra.sample_prompt)["input_ids"])
        check_fits_the_positions(
            config, prompt_tokens, extra.sample_max_new_tokens, False, "--sample_max_new_tokens", "--sample_prompt"
        )
    model = build_model(
        kind.auto_class,
        config,
        model_args.model_name_or_path,
        model_args.attn_implementation,
        dtype=model_args.dtype,
    )
    confirm_loaded_dtype(model, model_args, training_args, facts, resume)
    n_params = sum(p.numel() for p in model.parameters())
    log(
        f"{type(model).__name__}: {n_params / 1e6:.2f}M parameters, vocabulary {len(tokenizer)}, "
        f"blocks of {data_args.block_size} tokens"
    )
    log(training_setup(training_args, model.dtype))

    # --- training --------------------------------------------------------------------------------------------
    if training_args.overwrite_output_dir:
        clear_output_dir(training_args.output_dir)
    trainer = AtomicCheckpointTrainer(
        model=model,
        args=training_args,
        train_dataset=data["train"],
        eval_dataset=limit(data["validation"], extra.eval_max_blocks),
        data_collator=data["collator"],
        processing_class=tokenizer,
        callbacks=callbacks,
    )
    trainer.run_facts = facts
    metrics = train_and_evaluate(trainer, resume, with_perplexity, report_before, report_after)
    save_final(
        trainer,
        tokenizer,
        training_args.output_dir,
        metrics,
        [dataset_label(data_args.dataset_name, data_args.train_file)],
        model_args.model_name_or_path,
    )
    log(f"Saved model, tokenizer, loss curve and model card to {training_args.output_dir}")
    if model_args.model_kind == "decoder" and extra.sample_max_new_tokens > 0:
        prompt, max_new_tokens = extra.sample_prompt, extra.sample_max_new_tokens
        sample_unless_sharded(
            trainer,
            training_args.output_dir,
            lambda: print_sample(model, tokenizer, prompt, max_new_tokens, training_args.seed),
        )
    return metrics


def cli() -> None:
    """`archlab-pretrain`: `main` with one-line errors for bad input (see `run_cli`)."""
    run_cli(main)


if __name__ == "__main__":
    cli()
