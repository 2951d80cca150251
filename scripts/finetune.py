"""Fine-tune an archlab model for one of three tasks (`--task`), shaped like transformers' `run_clm` / `run_glue` /
`run_summarization` examples:

- `instruct`: instruction tuning of a decoder with its chat template; the loss covers the assistant's turns only
  (the template's `{% generation %}` blocks). Data: a `messages` column, or `--prompt_column`/`--response_column`;
  default: the embedded corpus's "write function `name`: <docstring>" -> code pairs.
      python scripts/finetune.py --task instruct --model_name_or_path runs/pretrain --output_dir runs/chat
- `classification`: sequence classification (GPT fine-tuning, seed 001) from a CSV/JSON with text and label
  columns; reports accuracy and macro-F1.
      python scripts/finetune.py --task classification --model_name_or_path runs/pretrain --train_file reviews.csv
- `seq2seq`: encoder-decoder fine-tuning, by default on the embedded code -> docstring-first-sentence task,
  evaluated by generation with sacrebleu's BLEU and chrF and exact match.
      python scripts/finetune.py --task seq2seq --output_dir runs/docstrings

Without `--model_name_or_path` a new model is built (default architecture, `--preset`, or `--config_name`) with a
tokenizer trained on the task's training texts.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from datasets import Dataset, DatasetDict
from transformers import (
    DataCollatorForSeq2Seq,
    DataCollatorWithPadding,
    Seq2SeqTrainer,
    Seq2SeqTrainingArguments,
    TrainerCallback,
    set_seed,
)

from archlab.model_cards.facts import SEQ2SEQ_PIPELINE_TAGS
from archlab.scripts.common import (
    CLASSIFICATION_AUTO_CLASS,
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
from archlab.tokenization.corpus import code_docstring_pairs, instruction_examples
from archlab.tokenization.data import IGNORE_INDEX, check_columns, check_not_empty, limit, load_raw_datasets
from archlab.tokenization.training import load_tokenizer, train_tokenizer

TASKS = ("instruct", "classification", "seq2seq")
TASK_MODEL_KIND = {"instruct": "decoder", "classification": "decoder", "seq2seq": "seq2seq"}


@dataclass
class FinetuneArguments:
    task: str = field(default="instruct", metadata={"help": "instruct | classification | seq2seq"})
    prompt_column: str | None = field(default=None, metadata={"help": "instruct: the user turn's column."})
    response_column: str | None = field(default=None, metadata={"help": "instruct: the assistant turn's column."})
    messages_column: str = field(default="messages", metadata={"help": "instruct: a list of {role, content}."})
    label_column_name: str = field(default="label", metadata={"help": "classification: the label column."})
    source_column: str = field(default="code", metadata={"help": "seq2seq: the input column."})
    target_column: str = field(default="docstring", metadata={"help": "seq2seq: the output column."})
    max_source_length: int = field(default=256, metadata={"help": "seq2seq: truncate inputs to this many tokens."})
    max_target_length: int = field(default=48, metadata={"help": "seq2seq: truncate targets to this many tokens."})
    pipeline_tag: str | None = field(default=None, metadata={
        "help": "seq2seq: the model card's Hub task, translation | summarization (default: summarization for the "
                "embedded code -> docstring task, translation for your own data)."})


@dataclass
class FinetuneTrainingArguments(Seq2SeqTrainingArguments):
    """`Seq2SeqTrainingArguments` (a superset of `TrainingArguments`) with defaults for short CPU runs."""

    output_dir: str | None = field(default="runs/finetune", metadata={"help": "Where checkpoints and the model go."})
    overwrite_output_dir: bool = field(default=False, metadata={
        "help": "Start over in an --output_dir that holds checkpoints (they are deleted) or a finished model (it is "
                "replaced)."})
    max_steps: int = field(default=300, metadata={
        "help": "Optimizer steps (>= 1), or -1 to train --num_train_epochs epochs."})
    per_device_train_batch_size: int = field(default=16, metadata={"help": "Examples per step."})
    per_device_eval_batch_size: int = field(default=16, metadata={"help": "Examples per evaluation step."})
    dataloader_pin_memory: bool = field(default=False, metadata={"help": "Pin memory (only useful on a GPU)."})
    learning_rate: float = field(default=5e-4, metadata={"help": "Peak AdamW learning rate."})
    lr_scheduler_type: str = field(default="cosine", metadata={"help": "Learning-rate schedule."})
    warmup_steps: float = field(default=20, metadata={"help": "Linear warm-up steps (or a fraction < 1)."})
    logging_steps: float = field(default=25, metadata={"help": "Log the training loss every N steps."})
    save_steps: float = field(default=100, metadata={"help": "Checkpoint every N steps."})
    save_total_limit: int | None = field(default=2, metadata={"help": "Keep at most N checkpoints."})
    predict_with_generate: bool = field(default=True, metadata={"help": "seq2seq: evaluate generated text."})
    generation_max_length: int | None = field(default=48, metadata={"help": "seq2seq: generated length."})


# ---------------------------------------------------------------------------------------------------------------
# Data per task
# ---------------------------------------------------------------------------------------------------------------
def default_task_data(task: str, max_train: int | None, max_eval: int | None) -> DatasetDict:
    """The embedded-corpus dataset of a task (classification has none: it needs --train_file)."""
    source = {"instruct": instruction_examples, "seq2seq": code_docstring_pairs}.get(task)
    if source is None:
        raise ValueError("--task classification needs --train_file (CSV/JSON with text and label columns).")
    sizes = {"train": max_train, "validation": max_eval}
    return DatasetDict({split: Dataset.from_list(list(itertools.islice(source(split), n))) for split, n in sizes.items()})


def as_messages(dataset: Any, args: FinetuneArguments) -> Any:
    """Prompt/response columns -> the `messages` column the chat template reads."""
    if args.prompt_column is None and args.response_column is None:
        check_columns(dataset, args.messages_column)
        return dataset
    if args.prompt_column is None or args.response_column is None:
        raise ValueError("--prompt_column and --response_column go together.")
    check_columns(dataset, args.prompt_column, args.response_column)
    return dataset.map(
        lambda row: {args.messages_column: [{"role": "user", "content": row[args.prompt_column]},
                                            {"role": "assistant", "content": row[args.response_column]}]},
        remove_columns=dataset.column_names,
    )


def tokenize_instruct(dataset: Any, tokenizer: Any, args: FinetuneArguments, max_length: int, num_proc) -> Any:
    """`input_ids` of the whole conversation; `labels` only on the assistant's tokens (the rest -100)."""
    if tokenizer.chat_template is None or "{% generation %}" not in tokenizer.chat_template:
        raise ValueError("--task instruct needs a tokenizer whose chat template marks assistant turns with "
                         "{% generation %} (archlab's decoder tokenizers do).")

    def encode(batch: dict[str, list]) -> dict[str, list]:
        out = tokenizer.apply_chat_template(batch[args.messages_column], tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True, truncation=True, max_length=max_length)
        labels = [[t if m else IGNORE_INDEX for t, m in zip(ids, mask)]
                  for ids, mask in zip(out["input_ids"], out["assistant_masks"])]
        return {"input_ids": out["input_ids"], "attention_mask": out["attention_mask"], "labels": labels}

    encoded = dataset.map(encode, batched=True, num_proc=num_proc, remove_columns=dataset.column_names,
                          desc="Applying the chat template")
    # A conversation truncated before the answer teaches nothing.
    return encoded.filter(lambda row: any(t != IGNORE_INDEX for t in row["labels"]))


def label_maps(dataset: Any, column: str) -> tuple[dict[Any, int], dict[int, str]]:
    values = sorted(set(dataset[column]), key=str)
    if len(values) < 2:
        raise ValueError(f"Column {column!r} has {len(values)} distinct label(s); classification needs at least 2.")
    return {v: i for i, v in enumerate(values)}, {i: str(v) for i, v in enumerate(values)}


def tokenize_classification(dataset: Any, tokenizer: Any, text: str, label: str, label2id: dict, max_length: int,
                            num_proc) -> Any:
    def encode(batch: dict[str, list]) -> dict[str, list]:
        out = tokenizer(batch[text], truncation=True, max_length=max_length)
        unknown = {v for v in batch[label] if v not in label2id}
        if unknown:
            raise ValueError(f"Labels {sorted(map(str, unknown))} of the validation split are not in the training "
                             f"split's {sorted(map(str, label2id))}.")
        return {"input_ids": out["input_ids"], "attention_mask": out["attention_mask"],
                "labels": [label2id[v] for v in batch[label]]}

    return dataset.map(encode, batched=True, num_proc=num_proc, remove_columns=dataset.column_names,
                       desc="Tokenizing")


def tokenize_seq2seq(dataset: Any, tokenizer: Any, args: FinetuneArguments, num_proc) -> Any:
    def encode(batch: dict[str, list]) -> dict[str, list]:
        out = tokenizer(batch[args.source_column], text_target=batch[args.target_column], truncation=True,
                        max_length=args.max_source_length)
        labels = [ids[: args.max_target_length - 1] + ids[-1:] if len(ids) > args.max_target_length else ids
                  for ids in out["labels"]]
        return {"input_ids": out["input_ids"], "attention_mask": out["attention_mask"], "labels": labels}

    return dataset.map(encode, batched=True, num_proc=num_proc, remove_columns=dataset.column_names,
                       desc="Tokenizing pairs")


# ---------------------------------------------------------------------------------------------------------------
# Metrics
# ---------------------------------------------------------------------------------------------------------------
def classification_metrics(prediction: Any) -> dict[str, float]:
    """Accuracy and macro-F1 over the classes that occur in labels or predictions."""
    logits = prediction.predictions[0] if isinstance(prediction.predictions, tuple) else prediction.predictions
    predicted, labels = np.argmax(logits, axis=-1), prediction.label_ids
    f1s = []
    for c in np.union1d(predicted, labels):
        tp = np.sum((predicted == c) & (labels == c))
        precision = tp / max(np.sum(predicted == c), 1)
        recall = tp / max(np.sum(labels == c), 1)
        f1s.append(0.0 if tp == 0 else 2 * precision * recall / (precision + recall))
    return {"accuracy": float(np.mean(predicted == labels)), "f1": float(np.mean(f1s))}


def text_metrics(predictions: list[str], references: list[str]) -> dict[str, float]:
    """sacrebleu's corpus BLEU and chrF, and exact match (after whitespace normalisation)."""
    import sacrebleu

    predictions = [" ".join(p.split()) for p in predictions]
    references = [" ".join(r.split()) for r in references]
    return {
        "bleu": sacrebleu.corpus_bleu(predictions, [references]).score,
        "chrf": sacrebleu.corpus_chrf(predictions, [references]).score,
        "exact_match": 100.0 * float(np.mean([p == r for p, r in zip(predictions, references)])),
    }


def seq2seq_metrics(tokenizer: Any):
    def compute(prediction: Any) -> dict[str, float]:
        generated = np.where(prediction.predictions < 0, tokenizer.pad_token_id, prediction.predictions)
        labels = np.where(prediction.label_ids == IGNORE_INDEX, tokenizer.pad_token_id, prediction.label_ids)
        return text_metrics(tokenizer.batch_decode(generated, skip_special_tokens=True),
                            tokenizer.batch_decode(labels, skip_special_tokens=True))

    return compute


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


# ---------------------------------------------------------------------------------------------------------------
def task_texts(raw: Any, task: str, args: FinetuneArguments, text_column: str) -> Any:
    """The texts a new tokenizer is trained on."""
    train = raw["train"]
    if task == "instruct":
        return (m["content"] for row in train for m in row[args.messages_column])
    if task == "seq2seq":
        return (text for row in train for text in (row[args.source_column], row[args.target_column]))
    return (row[text_column] for row in train)


def main(argv: Sequence[str] | None = None, callbacks: list[TrainerCallback] | None = None) -> dict[str, float]:
    model_args, data_args, training_args, args = parse_arguments(
        (ModelArguments, DataArguments, FinetuneTrainingArguments, FinetuneArguments), argv, __doc__
    )
    # --- checks, then data, tokenizer and config: nothing is written before the Trainer starts ------------------
    if args.task not in TASKS:
        raise ValueError(f"`--task`={args.task!r} is not supported; allowed values: {', '.join(TASKS)}.")
    expected_kind = TASK_MODEL_KIND[args.task]
    if model_args.model_kind != "decoder" and model_args.model_kind != expected_kind:
        raise ValueError(f"Conflicting flags: --task {args.task} trains a {expected_kind}, not --model_kind "
                         f"{model_args.model_kind}.")
    model_args.model_kind = expected_kind
    model_kind(expected_kind)
    check_model_flags(model_args)
    check_training_flags(training_args)
    check_data_flags(data_args, training_args)
    if data_args.streaming:
        raise ValueError("--streaming is for pretraining; fine-tuning sets are loaded in memory.")
    if args.pipeline_tag is not None and (args.task != "seq2seq" or args.pipeline_tag not in SEQ2SEQ_PIPELINE_TAGS):
        raise ValueError(f"`--pipeline_tag`={args.pipeline_tag!r}: only --task seq2seq chooses its card's task, one of "
                         f"{', '.join(SEQ2SEQ_PIPELINE_TAGS)} (the other tasks' tag follows from the model class).")
    check_positive(args, ("max_source_length", "max_target_length"), " (tokens)")
    if args.task == "seq2seq":
        try:
            import sacrebleu  # noqa: F401  (needed by the metrics; fail now rather than after training)
        except ImportError:
            raise ImportError("--task seq2seq reports BLEU/chrF with sacrebleu: pip install 'archlab[scripts]'.") from None
    resume = resolve_resume(training_args, training_args.overwrite_output_dir)
    finished = finished_run(resume, training_args)
    if finished is not None:
        return finished
    set_seed(training_args.seed)
    if training_args.label_names is None:
        training_args.label_names = ["labels"]
    training_args.predict_with_generate = training_args.predict_with_generate and args.task == "seq2seq"

    if data_args.dataset_name or data_args.train_file:
        raw = load_raw_datasets(data_args.dataset_name, data_args.dataset_config_name, data_args.train_file,
                                data_args.validation_file, data_args.validation_split_percentage,
                                cache_dir=model_args.cache_dir, seed=training_args.seed)
    else:
        raw = default_task_data(args.task, data_args.max_train_samples, data_args.max_eval_samples)
    raw["train"] = limit(raw["train"], data_args.max_train_samples)
    raw["validation"] = limit(raw["validation"], data_args.max_eval_samples)
    for split in ("train", "validation"):
        check_not_empty(raw[split], split)
        if args.task == "instruct":
            raw[split] = as_messages(raw[split], args)
        elif args.task == "classification":
            check_columns(raw[split], data_args.text_column_name, args.label_column_name, split=split)
        else:
            check_columns(raw[split], args.source_column, args.target_column, split=split)

    tokenizer = checkpoint_tokenizer(model_args, resume)
    if tokenizer is None and (model_args.tokenizer_name or model_args.model_name_or_path):
        tokenizer = load_tokenizer(model_args.tokenizer_name or model_args.model_name_or_path)
    elif tokenizer is None:
        log(f"Training a tokenizer for the {expected_kind} on the task's texts ...")
        tokenizer = train_tokenizer(task_texts(raw, args.task, args, data_args.text_column_name), expected_kind,
                                    model_args.tokenizer_algorithm, model_args.tokenizer_vocab_size or 4096)
    num_proc = data_args.preprocessing_num_workers
    label2id: dict[Any, int] = {}
    if args.task == "classification":
        label2id, id2label = label_maps(raw["train"], args.label_column_name)
    config = build_config(model_args, tokenizer, None, num_labels=len(label2id) or None)
    # Fine-tuning truncates rather than packs: cap the length at what the model can position.
    block_size = min(args.max_source_length if args.task == "seq2seq" else data_args.block_size,
                     config.max_position_embeddings)
    if label2id:
        config.num_labels, config.id2label, config.label2id = len(id2label), id2label, {v: k for k, v in id2label.items()}
    if args.task == "instruct":
        data = {s: tokenize_instruct(raw[s], tokenizer, args, block_size, num_proc) for s in raw}
        collator = DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=IGNORE_INDEX)
    elif args.task == "classification":
        data = {s: tokenize_classification(raw[s], tokenizer, data_args.text_column_name, args.label_column_name,
                                           label2id, block_size, num_proc) for s in raw}
        collator = DataCollatorWithPadding(tokenizer)
    else:
        data = {s: tokenize_seq2seq(raw[s], tokenizer, args, num_proc) for s in raw}
        collator = None  # built with the model below
    check_not_empty(data["train"], "tokenized train")

    kind = model_kind(expected_kind)
    auto_class = CLASSIFICATION_AUTO_CLASS if args.task == "classification" else kind.auto_class
    if model_args.model_name_or_path:
        model = auto_class.from_pretrained(model_args.model_name_or_path, config=config)
    else:
        model = auto_class.from_config(config)
    if model_args.attn_implementation:
        model.set_attn_implementation(model_args.attn_implementation)
    if collator is None:
        collator = DataCollatorForSeq2Seq(tokenizer, model=model, label_pad_token_id=IGNORE_INDEX)
    log(f"{type(model).__name__}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters; "
        f"{len(data['train'])} training and {len(data['validation'])} validation examples")

    # --- training --------------------------------------------------------------------------------------------
    if training_args.overwrite_output_dir:
        clear_output_dir(training_args.output_dir)
    trainer_class = AtomicSeq2SeqTrainer if args.task == "seq2seq" else AtomicCheckpointTrainer
    compute_metrics = {"classification": classification_metrics, "seq2seq": seq2seq_metrics(tokenizer)}.get(args.task)
    trainer = trainer_class(
        model=model, args=training_args, train_dataset=data["train"], eval_dataset=data["validation"],
        data_collator=collator, processing_class=tokenizer, compute_metrics=compute_metrics, callbacks=callbacks,
    )
    task_metrics = with_perplexity if args.task == "instruct" else dict
    before, result = train_evaluating_at_start(
        trainer, resume, lambda metrics: log(f"Before fine-tuning: {_summary(task_metrics(dict(metrics)))}"))
    before = task_metrics(before)
    after = task_metrics(trainer.evaluate())
    log(f"After fine-tuning:  {_summary(after)}")
    metrics = {**result.metrics, **after, **{f"before_{k}": v for k, v in before.items()}}
    own_data = bool(data_args.train_file or data_args.dataset_name)
    pipeline_tag = None
    if args.task == "seq2seq":
        pipeline_tag = args.pipeline_tag or ("translation" if own_data else "summarization")
    save_final(trainer, tokenizer, training_args.output_dir, metrics,
               [dataset_label(data_args) if own_data else "python-stdlib-source"], model_args.model_name_or_path,
               pipeline_tag=pipeline_tag)
    log(f"Saved to {training_args.output_dir}")
    if args.task != "classification":
        show_example(model, tokenizer, raw["validation"][0], args, training_args.generation_max_length)
    return metrics


def _summary(metrics: dict[str, float]) -> str:
    keys = ("eval_loss", "eval_perplexity", "eval_accuracy", "eval_f1", "eval_bleu", "eval_chrf", "eval_exact_match")
    return ", ".join(f"{k[5:]} {metrics[k]:.4g}" for k in keys if k in metrics)


def show_example(
    model: Any, tokenizer: Any, example: dict[str, Any], args: FinetuneArguments, max_new_tokens: int | None = None
) -> None:
    model.eval()
    with torch.no_grad():
        if args.task == "instruct":
            prompt = example[args.messages_column][:1]
            inputs = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, return_tensors="pt",
                                                   return_dict=True)
            end = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")]
            output = model.generate(**inputs, max_new_tokens=64, do_sample=False, eos_token_id=end,
                                    pad_token_id=tokenizer.pad_token_id)
            answer = tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
            log(f"Example -- user: {prompt[0]['content']}\nassistant:\n{answer}")
        else:
            inputs = tokenizer(example[args.source_column], return_tensors="pt", truncation=True,
                               max_length=args.max_source_length)
            inputs.pop("token_type_ids", None)
            output = model.generate(**inputs, max_new_tokens=max_new_tokens or 48, num_beams=1, do_sample=False)
            log(f"Example -- code:\n{example[args.source_column]}\n"
                f"generated: {tokenizer.decode(output[0], skip_special_tokens=True)}\n"
                f"reference: {example[args.target_column]}")


def cli() -> None:
    """`archlab-finetune`: `main` with one-line errors for bad input (see `run_cli`)."""
    run_cli(main)


if __name__ == "__main__":
    cli()
