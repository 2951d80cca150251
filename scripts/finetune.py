"""Fine-tune an archlab model for one of five tasks (`--task`), shaped like transformers' `run_clm` / `run_glue` /
`run_summarization` / `run_ner` / `run_qa` examples:

- `instruct`: instruction tuning of a decoder with its chat template; the loss covers the assistant's turns only
  (the template's `{% generation %}` blocks). Data: a `messages` column, or `--prompt_column`/`--response_column`;
  default: the embedded corpus's "write function `name`: <docstring>" -> code pairs. Each conversation is cut at
  --block_size tokens (or the model's positions); one cut before its first answer is left out, as TRL's SFTTrainer
  does, and their number is logged.
      python scripts/finetune.py --task instruct --model_name_or_path runs/pretrain --output_dir runs/chat
- `classification`: sequence classification from a decoder's last token (as GPT fine-tuning does), or, from a masked
  LM's folder, from its first token with BERT's head (`EncoderForSequenceClassification`), from a CSV/JSON with text
  and label columns; reports accuracy and macro-F1. Float labels are regression targets (one output,
  mean squared error), as run_glue.py reads them; reports MSE and Pearson's r. A list of labels per row (JSON) is
  multi-label classification, as run_classification.py reads it (one sigmoid output per class, binary
  cross-entropy); reports subset accuracy and micro-F1. Two text columns (`--text_column_names sentence1,sentence2`,
  or GLUE's columns read without flags) are classified as pairs, encoded as the tokenizer's pair, as run_glue.py does;
  three or more are joined into one text (`--text_column_delimiter`), as run_classification.py joins them.
      python scripts/finetune.py --task classification --model_name_or_path runs/pretrain --train_file reviews.csv
- `seq2seq`: encoder-decoder fine-tuning, by default on the embedded code -> docstring-first-sentence task,
  evaluated by generation with sacrebleu's BLEU and chrF and exact match; `--source_prefix` puts a T5-style task
  prefix before every source (saved in the config's `task_specific_params`, as T5 keeps its prefixes).
      python scripts/finetune.py --task seq2seq --output_dir runs/docstrings
- `token-classification`: a label per word (named entities), as run_ner.py trains it, from JSON lines with a list of
  words and a list of labels per row (`tokens` / `ner_tags`, or --text_column_name / --label_column_name), the
  labels as names or a `Sequence(ClassLabel)`; each word's label on its first sub-token (--label_all_tokens: on every
  one). A causal LM's folder trains `DecoderForTokenClassification`, a masked LM's `EncoderForTokenClassification`.
  Reports seqeval's entity-level precision, recall and F1 (IOB2) and token accuracy; --return_entity_level_metrics
  adds each entity type's (`eval_PER_f1`, ...), as run_ner.py's flag.
      python scripts/finetune.py --task token-classification --model_name_or_path runs/pretrain --train_file ner.jsonl
- `question-answering`: extractive QA as run_qa.py does it, from a decoder's folder (`DecoderForQuestionAnswering`)
  or a masked LM's (BERT's `EncoderForQuestionAnswering`); an encoder-decoder's is refused. Data in SQuAD's layout
  (`question`, `context`, `answers` = {"text": [...], "answer_start": [...]}); default: questions about the embedded
  corpus's functions (their name, their first parameter). Each question and context are the tokenizer's pair, cut to
  `--max_seq_length` tokens, a long context into windows overlapping by `--doc_stride` tokens; a window without the
  whole answer is labelled at index 0 (BERT's [CLS], a decoder's first token). The evaluation maps the
  `--n_best_size` best starts and ends (spans of at most `--max_answer_length` tokens) back to the context's text and
  reports SQuAD's exact match and F1. SQuAD v2's rows without an answer: `--version_2_with_negative` predicts "no
  answer" ("") where a row's null score (index 0's start + end logits, the smallest over its windows) beats its best
  span by more than `--null_score_diff_threshold` (0), as run_qa.py does, and adds the `HasAns_*` / `NoAns_*` scores.
  Each evaluation and prediction writes utils_qa.py's `{eval,predict}_predictions.json`,
  `{eval,predict}_nbest_predictions.json` and (v2) `{eval,predict}_null_odds.json` to --output_dir.
      python scripts/finetune.py --task question-answering --model_name_or_path runs/mlm --train_file train.json \\
          --validation_file dev.json

`--test_file` (or `--do_predict` with a data set that has a test split) predicts the test split after training, as
run_glue.py, run_translation.py, run_ner.py and run_qa.py do: `predict_results.txt` (classification),
`generated_predictions.txt` (seq2seq), `predictions.txt` (token-classification) or `predict_predictions.json`
({id: answer}, question-answering) in --output_dir, and the `predict_*` metrics where the test split has labels.
      python scripts/finetune.py --task classification --model_name_or_path runs/pretrain --train_file train.csv \\
          --validation_file dev.csv --test_file test.csv

Without `--model_name_or_path` a new model is built (default architecture, `--preset`, or `--config_name`) with a
tokenizer trained on the task's training texts.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from transformers import Seq2SeqTrainingArguments, TrainerCallback, TrainingArguments, set_seed

from archlab.model_cards.facts import SEQ2SEQ_PIPELINE_TAGS
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
    given_flags,
    parse_arguments,
    run_cli,
)
from archlab.training.checkpoints import (
    check_resumed_run_facts,
    check_training_state,
    clear_output_dir,
    finished_run,
    resolve_resume,
    run_facts,
)
from archlab.training.dtypes import check_training_dtype, confirm_loaded_dtype, trained_dtype
from archlab.training.evaluation import train_and_evaluate
from archlab.training.kinds import model_kind
from archlab.training.metrics import entity_types
from archlab.training.question_answering import check_windows
from archlab.training.reporting import log, summary, training_setup
from archlab.training.sampling import sample_unless_sharded, stop_at_the_end_of_a_turn
from archlab.training.saving import EMBEDDED_CORPUS, dataset_label, save_final
from archlab.training.sources import first_process_writes_the_cache, load_examples
from archlab.training.task_data import (
    forced_bos_token_id,
    glue_text_columns,
    set_generation_languages,
    set_tokenizer_languages,
    text_pair_column,
    translation_key,
)
from archlab.training.tasks import (
    TASKS,
    Task,
    build_task_model,
    card_pipeline_tag,
    check_installed,
    predict_test_split,
    prepare_splits,
    task_tokenizer,
)
from archlab.training.token_classification import token_columns
from archlab.training.tokenizers import check_resumed_tokenizer

TASK_OUTPUT_DIR = "runs/finetune-{task}"
PAIR_EXAMPLE = "Return the n-th Fibonacci number."  # a sentence-pair classifier's card: the second text of its example


@dataclass
class FinetuneArguments:
    task: str = field(
        default="instruct",
        metadata={"help": "instruct | classification | seq2seq | token-classification | question-answering"},
    )
    prompt_column: str | None = field(default=None, metadata={"help": "instruct: the user turn's column."})
    response_column: str | None = field(default=None, metadata={"help": "instruct: the assistant turn's column."})
    messages_column: str = field(default="messages", metadata={"help": "instruct: a list of {role, content}."})
    label_column_name: str = field(
        default="label",
        metadata={
            "help": "classification: the label column; token-classification: the column of a list of labels per "
            "row (unset: `ner_tags`, its words' column `tokens` unless --text_column_name says, as run_ner.py)."
        },
    )
    return_entity_level_metrics: bool = field(
        default=False,
        metadata={
            "help": "token-classification: also report each entity type's precision, recall, F1 and count "
            "(`eval_PER_f1`, `eval_PER_number`, ...), as run_ner.py's flag (which renames the overall scores "
            "`overall_*`; here they keep their names); every type of the label set is listed in every evaluation, "
            "so one can be --metric_for_best_model (`PER_f1`)."
        },
    )
    label_all_tokens: bool = field(
        default=False,
        metadata={
            "help": "token-classification: train and score every sub-token of a word on the word's label (a B- "
            "label as its I- after the first), not the first sub-token alone, as run_ner.py's flag."
        },
    )
    text_column_names: str | None = field(
        default=None,
        metadata={
            "help": "classification: the text column, or two comma-separated (`sentence1,sentence2`) for "
            "sentence pairs, encoded as the tokenizer's pair (`tokenizer(first, second)`, as run_glue.py does), or "
            "three or more (`title,body,category`) joined into one text by --text_column_delimiter, as "
            "run_classification.py joins them. Unset: --text_column_name, or, when the data has no such column, "
            "GLUE's text columns (sentence1,sentence2 / question1,question2 / question,sentence / premise,"
            "hypothesis / sentence)."
        },
    )
    text_column_delimiter: str | None = field(
        default=None,
        metadata={
            "help": "classification: what joins the texts of --text_column_names into one (`\\n`, `\\t`: a line "
            "break, a tab), as run_classification.py's flag; given with two columns, they are joined, not a pair. "
            "Unset: a space for three or more columns."
        },
    )
    source_column: str = field(default="code", metadata={"help": "seq2seq: the input column."})
    target_column: str = field(default="docstring", metadata={"help": "seq2seq: the output column."})
    source_lang: str | None = field(
        default=None,
        metadata={
            "help": "seq2seq: read run_translation.py's form, a `translation` column of {language: text} (wmt16, "
            "opus_books): the source language's key (with --target_lang; instead of --source_column). With an "
            "mBART tokenizer, its language code (`en_XX`: the key `en`, and the code marks the sources)."
        },
    )
    target_lang: str | None = field(
        default=None, metadata={"help": "seq2seq: the target language's key of the `translation` column."}
    )
    forced_bos_token: str | None = field(
        default=None,
        metadata={
            "help": "seq2seq: the token every generated target starts with, after the decoder's start (an mBART-50 "
            "tokenizer's target-language code, `ro_RO`), as run_translation.py's flag: saved as the model's "
            "`forced_bos_token_id`."
        },
    )
    max_source_length: int = field(default=256, metadata={"help": "seq2seq: truncate inputs to this many tokens."})
    max_target_length: int = field(default=48, metadata={"help": "seq2seq: truncate targets to this many tokens."})
    source_prefix: str | None = field(
        default=None,
        metadata={
            "help": 'seq2seq: text put before every source, as T5 is prompted ("translate English to German: ", '
            '"summarize: "); trained, evaluated and predicted with it, and saved in the config\'s '
            '`task_specific_params[task]["prefix"]` (as T5 keeps it); a resume must keep it.'
        },
    )
    test_file: str | None = field(
        default=None,
        metadata={
            "help": "classification, seq2seq, token-classification, question-answering: a test file (the training "
            "file's format) predicted after training (turns on --do_predict); its label / target / answer column may "
            "be missing (predictions only; token-classification needs it)."
        },
    )
    max_predict_samples: int | None = field(
        default=None, metadata={"help": "Predict at most this many test examples (unset: all)."}
    )
    question_column: str = field(default="question", metadata={"help": "question-answering: the question column."})
    context_column: str = field(default="context", metadata={"help": "question-answering: the context column."})
    answer_column: str = field(
        default="answers",
        metadata={"help": 'question-answering: SQuAD\'s answers, {"text": [...], "answer_start": [...]} per row.'},
    )
    max_seq_length: int = field(
        default=384,
        metadata={
            "help": "question-answering: tokens per window of question + context (capped at the model's positions; "
            "--block_size does not apply)."
        },
    )
    doc_stride: int = field(
        default=128, metadata={"help": "question-answering: tokens shared by consecutive windows of a long context."}
    )
    n_best_size: int = field(
        default=20,
        metadata={
            "help": "question-answering: the best starts and ends searched per window, and the spans listed per row "
            "in {eval,predict}_nbest_predictions.json."
        },
    )
    max_answer_length: int = field(
        default=30, metadata={"help": "question-answering: the longest answer predicted, in tokens."}
    )
    version_2_with_negative: bool = field(
        default=False,
        metadata={
            "help": 'question-answering: SQuAD v2, some rows have no answer: predict "" where the null score wins, '
            "report the HasAns_* / NoAns_* scores and write {eval,predict}_null_odds.json (null score minus the best "
            "span's score, per row)."
        },
    )
    null_score_diff_threshold: float = field(
        default=0.0,
        metadata={
            "help": 'question-answering, with --version_2_with_negative: predict "" where the null score minus the '
            "best span's score is above this."
        },
    )
    pipeline_tag: str | None = field(
        default=None,
        metadata={
            "help": "seq2seq: the model card's Hub task, translation | summarization (default: summarization for the "
            "embedded code -> docstring task, translation for your own data)."
        },
    )


@dataclass
class FinetuneTrainingArguments(ArchlabTrainingArguments, Seq2SeqTrainingArguments):
    """`Seq2SeqTrainingArguments` (a superset of `TrainingArguments`) with archlab's flags and defaults for short
    CPU runs."""

    output_dir: str | None = field(
        default=TASK_OUTPUT_DIR,
        metadata={"help": "Where checkpoints and the model go ({task}: the --task, so each task has its own)."},
    )
    max_steps: int = field(
        default=300, metadata={"help": "Optimizer steps (>= 1), or -1 to train --num_train_epochs epochs."}
    )
    per_device_train_batch_size: int = field(default=16, metadata={"help": "Examples per step."})
    per_device_eval_batch_size: int = field(default=16, metadata={"help": "Examples per evaluation step."})
    learning_rate: float = field(default=5e-4, metadata={"help": "Peak AdamW learning rate."})
    lr_scheduler_type: str = field(default="cosine", metadata={"help": "Learning-rate schedule."})
    warmup_steps: float = field(default=20, metadata={"help": "Linear warm-up steps (or a fraction < 1)."})
    logging_steps: float = field(default=25, metadata={"help": "Log the training loss every N steps."})
    save_steps: float = field(default=100, metadata={"help": "Checkpoint every N steps."})
    save_total_limit: int | None = field(default=2, metadata={"help": "Keep at most N checkpoints."})
    do_predict: bool = field(
        default=False,
        metadata={
            "help": "classification, seq2seq, token-classification, question-answering: predict the test split after "
            "training (--test_file, else the --dataset_name's test split): predict_results.txt / "
            "generated_predictions.txt / predictions.txt / predict_predictions.json in --output_dir, and the predict_* "
            "metrics where the test split has labels."
        },
    )
    predict_with_generate: bool = field(default=True, metadata={"help": "seq2seq: evaluate generated text."})
    generation_max_length: int | None = field(
        default=None,
        metadata={
            "help": "seq2seq: the evaluation's generated length (unset: --max_target_length, as run_translation); "
            "seq2seq and instruct: the length of the example generated after training (instruct unset: 64 tokens)."
        },
    )


# run_translation.py's, run_summarization.py's, run_glue.py's, run_classification.py's, run_ner.py's and run_qa.py's
# flags that this script names otherwise or does without, and what to pass instead (beside the model and data flags
# of every example script, `EXAMPLE_MODEL_FLAGS`): a command written for those scripts failed on "Unknown flags" that
# named no alternative, and on --text_column with argparse's usage and "ambiguous option" (a prefix of
# classification's --text_column_name(s))
SEQ2SEQ_EXAMPLE_FLAGS = {
    "text_column": "--source_column; classification and token-classification read --text_column_name",
    "summary_column": "--target_column",
    "num_beams": "--generation_num_beams, the beams of the evaluation and of the test predictions",
    "val_max_target_length": "--generation_max_length, the evaluation's generated length (unset: --max_target_length); "
    "the validation and test targets are cut at --max_target_length, as the training targets",
    "pad_to_max_length": "leave it out: each batch is padded to its longest example, which changes no loss and no "
    "generated text (question-answering pads every window to --max_seq_length, as run_qa.py's default)",
    "ignore_pad_token_for_loss": "leave it out: padded label positions are always -100, outside the loss",
}
CLASSIFICATION_EXAMPLE_FLAGS = {
    "task_name": "--task classification with --dataset_name nyu-mll/glue --dataset_config_name NAME for a GLUE task "
    "(its text columns are read without flags); run_ner.py's pos / chunk: --task token-classification "
    "--label_column_name pos_tags / chunk_tags",
    "metric_name": "leave it out: each --task reports its own metrics (--metric_for_best_model picks one of them)",
    "shuffle_train_dataset": "leave it out: the Trainer draws the training examples in random order",
    "train_split_name": "leave it out: the splits named train, validation and test are read",
    "validation_split_name": "leave it out: the splits named train, validation and test are read",
    "test_split_name": "leave it out: the splits named train, validation and test are read",
    "remove_splits": "leave it out: splits other than train, validation and test are not read",
    "remove_columns": "leave it out: columns the --task does not read are dropped",
    "ignore_mismatched_sizes": "leave it out: a classifier's head for other labels is replaced by a new one",
    "mlm_probability": "scripts/pretrain.py --model_kind masked_lm trains a masked LM",
    "line_by_line": "scripts/pretrain.py --model_kind masked_lm --sample_by line trains a masked LM on the lines "
    "of a .txt file",
}
FINETUNE_EXAMPLE_FLAGS = {**EXAMPLE_MODEL_FLAGS, **SEQ2SEQ_EXAMPLE_FLAGS, **CLASSIFICATION_EXAMPLE_FLAGS}


def parse(argv: Sequence[str] | None = None) -> tuple:
    """The four argument groups; the default `--output_dir` names the task (a second task does not meet the first's
    checkpoints), and a seq2seq evaluation generates up to --max_target_length tokens unless --generation_max_length
    says (instruct's example answer after training: up to --generation_max_length tokens when given, else 64)."""
    model_args, data_args, training_args, args = parse_arguments(
        (ModelArguments, DataArguments, FinetuneTrainingArguments, FinetuneArguments),
        argv,
        __doc__,
        FINETUNE_EXAMPLE_FLAGS,
    )
    if training_args.output_dir == TASK_OUTPUT_DIR:
        training_args.output_dir = TASK_OUTPUT_DIR.format(task=args.task)
    if training_args.generation_max_length is None and args.task == "seq2seq":
        # as run_translation.py: a fixed default cut every generated target at 48 tokens under a larger
        # --max_target_length, and BLEU/chrF/exact match fell without a word
        training_args.generation_max_length = args.max_target_length
    return model_args, data_args, training_args, args


def main(argv: Sequence[str] | None = None, callbacks: list[TrainerCallback] | None = None) -> dict[str, float]:
    model_args, data_args, training_args, args = parse(argv)
    # --- checks, then data, tokenizer and config: nothing is written before the Trainer starts ------------------
    if args.task not in TASKS:
        raise ValueError(f"`--task`={args.task!r} is not supported; allowed values: {', '.join(TASKS)}.")
    task = TASKS[args.task]
    if model_args.model_kind != "decoder" and model_args.model_kind != task.model_kind:
        raise ValueError(
            f"Conflicting flags: --task {args.task} trains a {task.model_kind}, not --model_kind "
            f"{model_args.model_kind}."
        )
    model_args.model_kind = task.model_kind
    kind = model_kind(task.model_kind)
    check_model_flags(model_args)
    check_pretrained_model_kind(model_args, task.auto_class or kind.auto_class, f"--task {args.task}")
    training_args.do_predict = training_args.do_predict or args.test_file is not None
    check_training_flags(training_args, predicts=True)
    check_training_dtype(model_args.dtype, model_args.model_name_or_path, training_args.fp16)
    entity_type = entity_type_of_metric(args, training_args)
    if entity_type is None:
        check_metric_for_best_model(training_args, task.metrics, f"--task {args.task}'s")
    check_data_flags(data_args, training_args)
    check_predict_flags(task, args, data_args, training_args)
    if data_args.streaming:
        raise ValueError("--streaming is for pretraining; fine-tuning sets are loaded in memory.")
    if args.pipeline_tag is not None and task.generates and args.pipeline_tag not in SEQ2SEQ_PIPELINE_TAGS:
        raise ValueError(
            f"`--pipeline_tag`={args.pipeline_tag!r} is not supported; allowed values: "
            f"{', '.join(SEQ2SEQ_PIPELINE_TAGS)}."
        )
    if args.pipeline_tag is not None and not task.generates:
        raise ValueError(
            f"`--pipeline_tag`={args.pipeline_tag!r}: only --task seq2seq chooses its card's task, one of "
            f"{', '.join(SEQ2SEQ_PIPELINE_TAGS)} (the other tasks' tag follows from the model class)."
        )
    check_flag_positive(args, ("max_source_length", "max_target_length"), " (tokens)")
    passed = given_flags(argv)
    check_question_answering_flags(args, passed)
    if args.source_prefix is not None and args.task != "seq2seq":
        raise ValueError(f"--source_prefix is for --task seq2seq (the encoder's inputs), not --task {args.task}.")
    if args.forced_bos_token is not None and args.task != "seq2seq":
        raise ValueError(f"--forced_bos_token is for --task seq2seq (its generations), not --task {args.task}.")
    check_language_flags(args, passed)
    check_column_flags(args, data_args.text_column_name, passed)
    text_column = check_text_column_flags(args, data_args.text_column_name)
    if args.label_all_tokens and not task.token_labels:
        raise ValueError(f"--label_all_tokens is for --task token-classification, not --task {args.task}.")
    if args.return_entity_level_metrics and not task.token_labels:
        raise ValueError(f"--return_entity_level_metrics is for --task token-classification, not --task {args.task}.")
    if task.token_labels:
        text_column, args.label_column_name = token_columns(text_column, args.label_column_name)
    check_installed(task)
    resume = resolve_resume(training_args, training_args.overwrite_output_dir)
    check_resumed_tokenizer(model_args, resume)
    facts = run_facts(
        training_args,
        source_prefix=(args.source_prefix or "") if args.task == "seq2seq" else None,
        columns=data_columns(args, text_column),
        weights_dtype=trained_dtype(model_args.dtype, model_args.model_name_or_path),
    )
    check_resumed_run_facts(resume, facts)
    check_training_state(resume, training_args)
    finished = finished_run(resume, training_args)
    if finished is not None and training_args.do_predict:
        # (the finished run's results came back, and the test split was not predicted)
        raise ValueError(
            f"--do_predict / --test_file: the run in {training_args.output_dir} is finished and saved, and the test "
            "split is predicted after training: predict with the saved folder (`pipeline(...)`, "
            "`archlab.translate`), or pass --overwrite_output_dir true to train again and predict."
        )
    if finished is not None:
        return finished
    set_seed(training_args.seed)
    if training_args.label_names is None:
        training_args.label_names = list(task.label_names)
    training_args.predict_with_generate = training_args.predict_with_generate and task.generates

    test = args if training_args.do_predict else None
    raw = load_examples(data_args, model_args.cache_dir, training_args.seed, task.default_data, test)
    if task.labels and not task.token_labels:
        text_column = read_glue_text_columns(args, text_column, raw["train"].column_names)
    raw = prepare_splits(task, raw, args, text_column)
    tokenizer = task_tokenizer(task, model_args, raw["train"], args, text_column, resume)
    if task.generates:
        set_tokenizer_languages(tokenizer, args)
        if args.forced_bos_token is not None:
            forced_bos_token_id(tokenizer, args.forced_bos_token)  # checked before the data is tokenized
    built = build_task_model(
        task,
        model_args,
        raw,
        tokenizer,
        args,
        text_column,
        data_args.block_size,
        data_args.preprocessing_num_workers,
        model_args.attn_implementation,
        first_process_writes_the_cache(training_args, raw),
    )

    confirm_loaded_dtype(built["model"], model_args, training_args, facts, resume)
    if entity_type is not None:
        check_entity_type_metric(entity_type, built["model"].config.id2label.values(), training_args)
    own_data = bool(data_args.train_file or data_args.dataset_name)
    pipeline_tag = card_pipeline_tag(task, args.pipeline_tag, own_data)
    if task.generates:  # before training, so that the checkpoints' configs record it as well
        record_source_prefix(built["model"].config, args, pipeline_tag)
        set_generation_languages(built["model"], tokenizer, args)
    if training_args.label_smoothing_factor and built["model"].config.problem_type == "regression":
        # Trainer's label smoother gathers class log-probabilities at the labels: the first step failed on float
        # labels ("gather(): Expected dtype int32/int64 for index"), after the data and model were prepared
        raise ValueError(
            f"--label_smoothing_factor {training_args.label_smoothing_factor:g} smooths class targets, and the float "
            f"labels of {args.label_column_name!r} train a regression head: leave the flag out (or give class labels)."
        )
    log(training_setup(training_args, built["model"].dtype))

    # --- training --------------------------------------------------------------------------------------------
    if task.chat:  # before training, so the checkpoints' generation configs stop at the end of a turn as well
        stop_at_the_end_of_a_turn(built["model"], tokenizer)
    if training_args.overwrite_output_dir:
        clear_output_dir(training_args.output_dir)
    trainer = task.trainer_class(
        model=built["model"],
        args=training_args,
        train_dataset=built["train"],
        eval_dataset=built["validation"],
        data_collator=built["collator"],
        processing_class=tokenizer,
        compute_metrics=task.compute_metrics(tokenizer, built["model"].config, args),
        callbacks=callbacks,
    )
    trainer.run_facts = facts
    trainer.task_options = args
    metrics = train_and_evaluate(
        trainer,
        resume,
        task.view,
        lambda before: log(f"Before fine-tuning: {summary(before, task.summary_keys)}"),
        lambda after, before: log(f"After fine-tuning:  {summary(after, task.summary_keys)}"),
    )
    save_final(
        trainer,
        tokenizer,
        training_args.output_dir,
        metrics,
        [dataset_label(data_args.dataset_name, data_args.train_file) if own_data else EMBEDDED_CORPUS],
        model_args.model_name_or_path,
        pipeline_tag=pipeline_tag,
        example_pair=PAIR_EXAMPLE if task.labels and text_pair_column(args) else None,
    )
    log(f"Saved to {training_args.output_dir}")
    if training_args.do_predict:
        predicted = predict_test_split(task, trainer, built["test"], tokenizer, training_args.output_dir)
        metrics.update(predicted)
        log(f"Predictions of {len(raw['test'])} test examples: {training_args.output_dir}/{task.predictions[0]}")
    if task.show_example is not None:
        validation, max_new_tokens = raw["validation"], training_args.generation_max_length
        sample_unless_sharded(
            trainer,
            training_args.output_dir,
            lambda: task.show_example(
                built["model"], tokenizer, validation[0], args, max_new_tokens, validation.features
            ),
        )
    return metrics


def data_columns(args: FinetuneArguments, text_column: str) -> dict[str, str | None]:
    """The columns the run reads, by the flag that names each (a run fact: a resume that reads others is refused).
    Classification's text columns are the pair (`--text_column_names`) or the one column, either flag's; GLUE's
    columns, read where no flag names one, follow from the same flags and data."""
    if args.task == "seq2seq":  # (with --source_lang / --target_lang, the `translation` column's keys)
        return {"--source_column": args.source_column, "--target_column": args.target_column}
    if args.task == "question-answering":  # (and the windows: others cut other features to skip)
        return {
            "--question_column": args.question_column,
            "--context_column": args.context_column,
            "--answer_column": args.answer_column,
            "--max_seq_length": str(args.max_seq_length),
            "--doc_stride": str(args.doc_stride),
        }
    if args.task == "classification":
        text = args.text_column_names or text_column
        columns = {"--text_column_name(s)": text, "--label_column_name": args.label_column_name}
        if args.text_column_delimiter is not None:  # (joined texts: another delimiter reads other data)
            columns["--text_column_delimiter"] = args.text_column_delimiter
        return columns
    if args.task == "token-classification":  # (--label_all_tokens trains other targets too)
        columns = {"--text_column_name": text_column, "--label_column_name": args.label_column_name}
        return {**columns, "--label_all_tokens": str(args.label_all_tokens).lower()}
    return {
        "--messages_column": args.messages_column,
        "--prompt_column": args.prompt_column,
        "--response_column": args.response_column,
    }


def prefix_key(args: FinetuneArguments, pipeline_tag: str) -> str:
    """The `task_specific_params` key of the run's task, as T5's config names them: "summarization", or
    "translation_{source}_to_{target}" with --source_lang / --target_lang (else "translation")."""
    if pipeline_tag == "translation" and args.source_lang and args.target_lang:
        return f"translation_{args.source_lang}_to_{args.target_lang}"
    return pipeline_tag


def record_source_prefix(config: Any, args: FinetuneArguments, pipeline_tag: str) -> None:
    """--source_prefix saved with the model where T5 keeps its task prefixes, `config.task_specific_params[task]
    ["prefix"]` (the model card's snippet puts it before its source; transformers 4's summarization and translation
    pipelines read it there): the saved folder did not record it, and prompts without it were out of distribution.
    Without --source_prefix a prefix the base model's config holds for this task is dropped (it was not trained with
    it), with a warning: T5 checkpoints expect theirs."""
    key = prefix_key(args, pipeline_tag)
    params = {name: dict(value) for name, value in (getattr(config, "task_specific_params", None) or {}).items()}
    if args.source_prefix:
        params[key] = {**params.get(key, {}), "prefix": args.source_prefix}
    elif params.get(key, {}).get("prefix"):
        log(
            f"Warning: the base model's config gives {key} inputs the prefix {params[key]['prefix']!r}, and no "
            "--source_prefix is given: the model is trained without one (pass --source_prefix to keep it)."
        )
        del params[key]["prefix"]
    config.task_specific_params = params or None


QUESTION_ANSWERING_FLAGS = (
    "question_column",
    "context_column",
    "answer_column",
    "max_seq_length",
    "doc_stride",
    "n_best_size",
    "max_answer_length",
    "version_2_with_negative",
    "null_score_diff_threshold",
)
# where the other tasks cut their examples
EXAMPLE_LENGTH_FLAGS = {"seq2seq": "--max_source_length / --max_target_length"}


def check_question_answering_flags(args: FinetuneArguments, passed: set[str]) -> None:
    """--task question-answering's flags: its windows checked (`check_windows`); given to another task, refused
    with the flag named, whatever its value (`passed`: the flags the command line gives; a value other than the
    default counts too). --max_seq_length is run_ner.py's and run_glue.py's flag for the examples' length: passed to
    --task token-classification or classification, it was ignored without a word and the examples were cut at
    --block_size (256) instead; `--max_seq_length 384`, run_qa.py's default, slipped through as the default."""
    if args.task == "question-answering":
        check_windows(args)
        return
    defaults = {f.name: f.default for f in fields(FinetuneArguments)}
    given = [
        f"--{name}" for name in QUESTION_ANSWERING_FLAGS if name in passed or getattr(args, name) != defaults[name]
    ]
    if not given:
        return
    hint = ""
    if "--max_seq_length" in given:
        length = EXAMPLE_LENGTH_FLAGS.get(args.task, "--block_size")
        hint = f" (the windows of a question and its context); --task {args.task} cuts its examples at {length}"
    raise ValueError(f"{', '.join(given)}: for --task question-answering, not --task {args.task}{hint}.")


ENTITY_TYPE_METRIC = re.compile(r"(.+)_(precision|recall|f1|number)")


def entity_type_of_metric(args: FinetuneArguments, training_args: TrainingArguments) -> str | None:
    """With --return_entity_level_metrics, the entity type of a `{type}_{score}` --metric_for_best_model
    (`PER_f1`), checked once the labels are read (`check_entity_type_metric`); else None."""
    metric = (training_args.metric_for_best_model or "").removeprefix("eval_")
    match = ENTITY_TYPE_METRIC.fullmatch(metric) if args.return_entity_level_metrics else None
    return match.group(1) if match else None


def check_entity_type_metric(entity_type: str, labels: Iterable[str], training_args: TrainingArguments) -> None:
    """An entity type's --metric_for_best_model names a type of the label set (each evaluation reports all of them);
    the others were refused at the start as a metric the evaluations do not report."""
    types = sorted(entity_types(labels))
    if entity_type not in types:
        raise ValueError(
            f"--metric_for_best_model {training_args.metric_for_best_model}: the labels tag the entity types "
            f"{', '.join(types) or '(none)'}; --return_entity_level_metrics reports {{type}}_precision, _recall, _f1 "
            "and _number for each."
        )


# the column flags of each task but question answering (whose flags `check_question_answering_flags` checks)
COLUMN_FLAGS = {
    "text_column_name": ("classification", "token-classification"),
    "label_column_name": ("classification", "token-classification"),
    "source_column": ("seq2seq",),
    "target_column": ("seq2seq",),
    "messages_column": ("instruct",),
    "prompt_column": ("instruct",),
    "response_column": ("instruct",),
}


def check_column_flags(args: FinetuneArguments, text_column_name: str, passed: Iterable[str] = ()) -> None:
    """A column flag of another task is refused with the task's own: `--text_column_name document` given to --task
    seq2seq was ignored without a word, and the run read the default `code` column (or failed naming it). A flag
    counts when the command line gives it (`passed`, as `given_flags` reads it), whatever its value, or when its
    value is not the default."""
    defaults = {f.name: f.default for f in fields(FinetuneArguments)}
    given = {name: getattr(args, name) for name in COLUMN_FLAGS if name != "text_column_name"}
    given["text_column_name"] = text_column_name
    foreign = [f"--{name}" for name, value in given.items() if name in passed or value != defaults.get(name, "text")]
    foreign = [flag for flag in foreign if args.task not in COLUMN_FLAGS[flag[2:]]]
    if foreign:
        own = [f"--{name}" for name, tasks in COLUMN_FLAGS.items() if args.task in tasks]
        if args.task == "question-answering":
            own = ["--question_column", "--context_column", "--answer_column"]
        raise ValueError(
            f"{', '.join(foreign)}: not a column --task {args.task} reads; its columns are named by {', '.join(own)}."
        )


def check_language_flags(args: FinetuneArguments, passed: Iterable[str] = ()) -> None:
    """--source_lang / --target_lang (run_translation.py's `translation` column): both, for --task seq2seq, instead of
    the column flags (given on the command line, `passed`, or set to other than their defaults); the pairs are then
    read into columns named by the languages."""
    if args.source_lang is None and args.target_lang is None:
        return
    if args.task != "seq2seq":
        raise ValueError(f"--source_lang / --target_lang are for --task seq2seq, not --task {args.task}.")
    if args.source_lang is None or args.target_lang is None or args.source_lang == args.target_lang:
        raise ValueError(
            "--source_lang and --target_lang go together and differ: the two keys of the `translation` column "
            f"(got {args.source_lang!r} and {args.target_lang!r})."
        )
    defaults = {f.name: f.default for f in fields(FinetuneArguments)}
    given = [
        f"--{name}"
        for name in ("source_column", "target_column")
        if name in passed or getattr(args, name) != defaults[name]
    ]
    if given:
        raise ValueError(
            f"Conflicting flags: {' and '.join(given)} with --source_lang / --target_lang, which read the "
            "`translation` column; pass one form."
        )
    args.source_column, args.target_column = translation_key(args.source_lang), translation_key(args.target_lang)
    if args.source_column == args.target_column:
        raise ValueError(
            f"--source_lang {args.source_lang} and --target_lang {args.target_lang} read the same key "
            f"{args.source_column!r} of the `translation` column (a language code's part before '_')."
        )


def check_text_column_flags(args: FinetuneArguments, text_column_name: str) -> str:
    """--text_column_names (run_classification.py's form): for --task classification, one column, two (a sentence
    pair) or more (joined by --text_column_delimiter), instead of --text_column_name. Returns the (first) text
    column; the others stay in the flag."""
    if args.text_column_delimiter is not None and args.task != "classification":
        raise ValueError(f"--text_column_delimiter is for --task classification, not --task {args.task}.")
    if args.text_column_names is None:
        if args.text_column_delimiter is not None:
            raise ValueError(
                "--text_column_delimiter joins the columns of --text_column_names (`title,body`): pass them too, or "
                "leave it out."
            )
        return text_column_name
    if args.task != "classification":
        raise ValueError(f"--text_column_names is for --task classification, not --task {args.task}.")
    names = [name.strip() for name in args.text_column_names.split(",")]
    if not all(names) or len(set(names)) < len(names):
        raise ValueError(
            f"--text_column_names {args.text_column_names!r}: different column names separated by commas: one text "
            "column, two (`sentence1,sentence2`, encoded as a pair) or more (joined by --text_column_delimiter)."
        )
    if len(names) == 1 and args.text_column_delimiter is not None:
        raise ValueError(
            f"--text_column_delimiter joins two or more columns; --text_column_names names one ({names[0]!r}): "
            "leave the delimiter out, or name the columns to join."
        )
    if text_column_name != "text":
        raise ValueError(
            "Conflicting flags: --text_column_name and --text_column_names; pass --text_column_names alone."
        )
    args.text_column_names = ",".join(names)
    return names[0]


def read_glue_text_columns(args: FinetuneArguments, text_column: str, column_names: list[str]) -> str:
    """The text column of a classification run; where no flag names one and the data has no `text` column, GLUE's
    (`sentence1`/`sentence2`, `question`/`sentence`, `premise`/`hypothesis`, ... as run_glue.py reads a GLUE task),
    a pair kept in `args.text_column_names`."""
    if args.text_column_names is not None or text_column != "text" or "text" in column_names:
        return text_column
    found = glue_text_columns(column_names)
    if found is None:
        return text_column  # (the missing column is named when the splits are checked)
    log(f"No 'text' column: reading GLUE's text column(s) {', '.join(found)}" + (" as pairs" if len(found) > 1 else ""))
    args.text_column_names = ",".join(found)
    return found[0]


def check_predict_flags(task: Task, args: FinetuneArguments, data_args: Any, training_args: Any) -> None:
    """--do_predict / --test_file, before anything is read: a task that predicts, a test source, a test file that
    exists, a seq2seq evaluation by generation."""
    check_flag_positive(args, ("max_predict_samples",), " (or unset: all)")
    if not training_args.do_predict:
        if args.max_predict_samples is not None:
            raise ValueError("--max_predict_samples limits the test split: pass it with --test_file or --do_predict.")
        return
    if task.predictions is None:
        raise ValueError(
            f"--do_predict / --test_file: --task {args.task} has no test predictions (an answer to a conversation is "
            "generated, not scored against one label): generate from the saved folder with scripts/generate.py "
            "--chat true, or evaluate a test set as the --validation_file."
        )
    if args.test_file is None and not data_args.dataset_name:
        raise ValueError("--do_predict predicts a test split: pass --test_file (the training file's format).")
    if args.test_file is not None and not os.path.isfile(args.test_file):
        raise FileNotFoundError(f"Data file {args.test_file!r} does not exist.")
    if task.generates and not training_args.predict_with_generate:
        raise ValueError("--do_predict with --task seq2seq writes generated texts: leave --predict_with_generate true.")


def cli() -> None:
    """`archlab-finetune`: `main` with one-line errors for bad input (see `run_cli`)."""
    run_cli(main)


if __name__ == "__main__":
    cli()
