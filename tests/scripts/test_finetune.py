"""scripts/finetune.py: instruction tuning (loss on responses only), classification (accuracy/F1), seq2seq on the
embedded code -> docstring task (BLEU/chrF/exact match), and its bad inputs."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from datasets import ClassLabel, Dataset, Features
from huggingface_hub import ModelCard
from transformers import AutoModelForSequenceClassification, AutoTokenizer, EvalPrediction

import archlab
from archlab.scripts import finetune
from archlab.tokenization.data import IGNORE_INDEX
from archlab.tokenization.training import load_tokenizer, save_tokenizer, train_tokenizer
from archlab.training import sources
from archlab.training.metrics import classification_metrics, text_metrics
from archlab.training.task_data import (
    as_messages,
    check_pair_columns,
    instruct_texts,
    label_maps,
    tokenize_instruct,
    tokenize_seq2seq,
)

from helpers import TINY_SEQ2SEQ, TINY_SEQ2SEQ_OVERRIDES, assert_close_to_scale, forbid, tiny_decoder_config


def sentiment_rows(n: int, seed: int) -> list[dict[str, str]]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        positive = rng.random() < 0.5
        words = ["great", "lovely", "fine", "good"] if positive else ["bad", "awful", "poor", "sad"]
        rows.append({"text": " ".join(rng.choices(words, k=6)) + f" {i}", "label": "pos" if positive else "neg"})
    return rows


def instruction_rows(n: int) -> list[dict[str, str]]:
    return [{"prompt": f"Return {i} squared.", "response": f"def f():\n    return {i} ** 2"} for i in range(n)]


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny saved decoder with its tokenizer, plus data files."""
    folder = tmp_path_factory.mktemp("finetune")
    texts = [r["text"] for r in sentiment_rows(50, 0)] + [r["prompt"] + r["response"] for r in instruction_rows(50)]
    tokenizer = train_tokenizer(texts, "decoder", vocab_size=300, min_frequency=1)
    model = archlab.DecoderForCausalLM(tiny_decoder_config(vocab_size=len(tokenizer)))
    model.save_pretrained(folder / "base")
    save_tokenizer(tokenizer, folder / "base")
    Dataset.from_list(sentiment_rows(80, 1)).to_csv(folder / "train.csv")
    Dataset.from_list(sentiment_rows(40, 2)).to_csv(folder / "validation.csv")
    (folder / "instruct.jsonl").write_text("".join(json.dumps(r) + "\n" for r in instruction_rows(24)))
    return folder


def classification_args(out: Path, base: Path, train: Path, validation: Path, *extra: str) -> list[str]:
    """`run_args` of `--task classification` from the model at `base` on the two CSV files, blocks of 32 tokens."""
    files = ["--train_file", str(train), "--validation_file", str(validation)]
    return run_args(
        out, "--task", "classification", "--model_name_or_path", str(base), *files, "--block_size", "32", *extra
    )


def run_args(out: Path, *extra: str) -> list[str]:
    return [
        "--output_dir",
        str(out),
        "--max_steps",
        "10",
        "--per_device_train_batch_size",
        "8",
        "--per_device_eval_batch_size",
        "8",
        "--learning_rate",
        "3e-3",
        "--warmup_steps",
        "0",
        "--logging_steps",
        "2",
        "--eval_strategy",
        "no",
        "--save_steps",
        "5",
        "--disable_tqdm",
        "true",
        "--dataloader_pin_memory",
        "false",
        *extra,
    ]


def test_instruct_labels_cover_only_the_responses(work: Path) -> None:
    tokenizer = archlab.tokenization.training.load_tokenizer(work / "base")
    args = finetune.FinetuneArguments(prompt_column="prompt", response_column="response")
    dataset = as_messages(Dataset.from_list(instruction_rows(5)), args)
    encoded = tokenize_instruct(dataset, tokenizer, args, max_length=128, num_proc=None)
    for row, source in zip(encoded, instruction_rows(5)):
        trained = [t for t in row["labels"] if t != IGNORE_INDEX]
        assert tokenizer.decode(trained) == source["response"] + "<|im_end|>"
        assert len(row["labels"]) == len(row["input_ids"])


def test_instruct_reads_text_parts_as_their_text(work: Path) -> None:
    """A messages column of text parts ({"type": "text", "text": ...}) gives the labels of the same text as strings,
    and a new tokenizer is trained on that text (the lists of parts went to the tokenizer trainer)."""
    tokenizer = archlab.tokenization.training.load_tokenizer(work / "base")
    args = finetune.FinetuneArguments(prompt_column="prompt", response_column="response")
    strings = as_messages(Dataset.from_list(instruction_rows(3)), args)
    parts = Dataset.from_list(
        [
            {"messages": [{**m, "content": [{"type": "text", "text": m["content"]}]} for m in row]}
            for row in strings["messages"]
        ]
    )
    args = finetune.FinetuneArguments()
    assert as_messages(parts, args) is parts
    encoded = [tokenize_instruct(d, tokenizer, args, max_length=128, num_proc=None) for d in (strings, parts)]
    assert encoded[0]["labels"] == encoded[1]["labels"] and encoded[0]["input_ids"] == encoded[1]["input_ids"]
    assert list(instruct_texts(parts, args, "text")) == list(instruct_texts(strings, args, "text"))


def test_instruct_takes_generation_blocks_written_with_whitespace_control(work: Path) -> None:
    """`{%- generation -%}` marks the assistant's tokens for transformers and TRL as `{% generation %}` does: such a
    template was refused as having no markers."""
    tokenizer = archlab.tokenization.training.load_tokenizer(work / "base")
    args = finetune.FinetuneArguments(prompt_column="prompt", response_column="response")
    dataset = as_messages(Dataset.from_list(instruction_rows(3)), args)
    plain = tokenize_instruct(dataset, tokenizer, args, max_length=128, num_proc=None)
    tokenizer.chat_template = tokenizer.chat_template.replace("{% generation %}", "{%- generation -%}")
    assert tokenize_instruct(dataset, tokenizer, args, max_length=128, num_proc=None)["labels"] == plain["labels"]


def test_instruct_conversations_that_all_lose_their_answer_are_named(work: Path) -> None:
    """Cut before every answer, the split was "empty" with no reason given."""
    tokenizer = archlab.tokenization.training.load_tokenizer(work / "base")
    args = finetune.FinetuneArguments(prompt_column="prompt", response_column="response")
    dataset = as_messages(Dataset.from_list(instruction_rows(3)), args)
    with pytest.raises(ValueError, match="Every one of the 3 conversations loses its answer when cut to 4 tokens"):
        tokenize_instruct(dataset, tokenizer, args, max_length=4, num_proc=None)


def test_instruct_end_to_end(tmp_path: Path, work: Path, capsys) -> None:
    data = str(work / "instruct.jsonl")
    metrics = finetune.main(
        run_args(
            tmp_path / "chat",
            "--task",
            "instruct",
            "--model_name_or_path",
            str(work / "base"),
            "--train_file",
            data,
            "--validation_file",
            data,
            "--prompt_column",
            "prompt",
            "--response_column",
            "response",
        )
    )
    assert metrics["eval_loss"] < metrics["before_eval_loss"]
    assert (tmp_path / "chat" / "model.safetensors").exists() and (tmp_path / "chat" / "loss_curve.png").exists()
    assert "[archlab] Example -- user:" in capsys.readouterr().out  # the answer to a validation prompt, after the save
    # generate and the text-generation pipeline stop at the end of the assistant's turn, as Hub chat models do
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "chat")
    for folder in ("", "checkpoint-5"):  # a checkpoint as well: it stopped at eos only
        saved = json.loads((tmp_path / "chat" / folder / "generation_config.json").read_text())["eos_token_id"]
        assert saved == [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")]


def test_classification_end_to_end(tmp_path: Path, work: Path) -> None:
    out = tmp_path / "cls"
    metrics = finetune.main(classification_args(out, work / "base", work / "train.csv", work / "validation.csv"))
    assert metrics["eval_accuracy"] >= 0.9 and metrics["eval_f1"] >= 0.9
    assert metrics["before_eval_accuracy"] < 0.9
    model = AutoModelForSequenceClassification.from_pretrained(out)
    assert model.config.id2label == {0: "neg", 1: "pos"}


@pytest.mark.slow
def test_seq2seq_on_the_embedded_docstring_task(tmp_path: Path) -> None:
    metrics = finetune.main(
        run_args(
            tmp_path / "docstrings",
            "--task",
            "seq2seq",
            "--max_train_samples",
            "64",
            "--max_eval_samples",
            "8",
            "--tokenizer_vocab_size",
            "400",
            "--config_overrides",
            TINY_SEQ2SEQ_OVERRIDES,
            "--generation_max_length",
            "8",
            "--max_steps",
            "4",
        )
    )
    for key in ("eval_bleu", "eval_chrf", "eval_exact_match", "before_eval_chrf"):
        assert 0.0 <= metrics[key] <= 100.0
    assert json.loads((tmp_path / "docstrings" / "config.json").read_text())["model_type"] == "archlab_seq2seq"
    # evaluation by generation leaves the saved generation config as the model had it: no stray max_length=20
    saved = json.loads((tmp_path / "docstrings" / "generation_config.json").read_text())
    assert "max_length" not in saved and "num_beams" not in saved, saved
    # code -> first docstring sentence is a summarisation task, and the card says so
    assert ModelCard.load(tmp_path / "docstrings" / "README.md").data.pipeline_tag == "summarization"


def test_metrics() -> None:
    logits = np.array([[2.0, 0.0], [0.0, 1.0], [3.0, 1.0], [0.0, 5.0]])
    result = classification_metrics(EvalPrediction(predictions=logits, label_ids=np.array([0, 1, 1, 1])))
    # class 0: P=1/2, R=1 -> F1 2/3; class 1: P=1, R=2/3 -> F1 4/5
    assert result["accuracy"] == 0.75 and result["f1"] == pytest.approx((2 / 3 + 4 / 5) / 2)
    same = text_metrics(["Return the sum of a and b."], ["Return the  sum of a and b."])
    assert same == {"bleu": pytest.approx(100.0), "chrf": pytest.approx(100.0), "exact_match": 100.0}
    assert text_metrics(["zzz"], ["Return the sum."])["exact_match"] == 0.0
    # a regression head (one output): mean squared error and Pearson's r
    scores = classification_metrics(
        EvalPrediction(predictions=np.array([[1.0], [2.0], [4.0]]), label_ids=np.array([1.0, 3.0, 5.0]))
    )
    assert scores == {"mse": pytest.approx(2 / 3), "pearson": pytest.approx(np.corrcoef([1, 2, 4], [1, 3, 5])[0, 1])}


def test_bad_inputs(tmp_path: Path, work: Path) -> None:
    out = tmp_path / "bad"
    base = ["--model_name_or_path", str(work / "base")]
    with pytest.raises(ValueError, match="classification needs --train_file"):
        finetune.main(run_args(out, "--task", "classification", *base))
    with pytest.raises(ValueError, match="allowed values: instruct, classification, seq2seq"):
        finetune.main(run_args(out, "--task", "translation", *base))
    with pytest.raises(ValueError, match="Column 'category' not found.*: name the column with --label_column_name"):
        finetune.main(
            run_args(
                out,
                "--task",
                "classification",
                *base,
                "--train_file",
                str(work / "train.csv"),
                "--label_column_name",
                "category",
            )
        )
    with pytest.raises(ValueError, match="Conflicting flags: --task seq2seq trains a seq2seq, not --model_kind"):
        finetune.main(run_args(out, "--task", "seq2seq", "--model_kind", "masked_lm"))
    with pytest.raises(ValueError, match="only --task seq2seq chooses its card's task, one of translation, summar"):
        finetune.main(run_args(out, "--task", "instruct", *base, "--pipeline_tag", "summarization"))
    with pytest.raises(ValueError, match="`--pipeline_tag`='text-generation'"):
        finetune.main(run_args(out, "--task", "seq2seq", "--pipeline_tag", "text-generation"))
    with pytest.raises(ValueError, match="--prompt_column and --response_column go together"):
        finetune.main(
            run_args(
                out,
                "--task",
                "instruct",
                *base,
                "--train_file",
                str(work / "instruct.jsonl"),
                "--prompt_column",
                "prompt",
            )
        )
    with pytest.raises(ValueError, match="--max_source_length must be >= 1"):
        finetune.main(run_args(out, "--task", "seq2seq", "--max_source_length", "-3"))
    with pytest.raises(ValueError, match="--max_target_length must be >= 1"):
        finetune.main(run_args(out, "--task", "seq2seq", "--max_target_length", "0"))
    with pytest.raises(ValueError, match="--learning_rate must be > 0, got -1.0"):
        finetune.main(run_args(out, "--task", "instruct", *base, "--learning_rate", "-1"))
    with pytest.raises(ValueError, match="--per_device_train_batch_size must be >= 1, got 0"):
        finetune.main(run_args(out, "--task", "instruct", *base, "--per_device_train_batch_size", "0"))
    with pytest.raises(ValueError, match="--do_predict: these scripts have no test split to predict"):  # was ignored
        finetune.main(run_args(out, "--task", "classification", *base, "--do_predict", "true"))
    assert not out.exists()


def test_a_resume_that_would_skip_other_data_or_read_other_token_ids_is_refused_first(
    tmp_path: Path, work: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both resumed without a word: another batch size skipped examples never trained (a warning in the log only),
    another base model's tokenizer trained the checkpoint on other token ids."""
    checkpoint = tmp_path / "out" / "checkpoint-5"
    checkpoint.mkdir(parents=True)
    (checkpoint / "trainer_state.json").write_text(json.dumps({"global_step": 5}))
    (checkpoint / "run_facts.json").write_text(json.dumps({"examples_per_step": 8}))
    save_tokenizer(AutoTokenizer.from_pretrained(work / "base"), checkpoint)
    forbid(monkeypatch, sources, "load_raw_datasets", "data was loaded before the checkpoint was compared")
    args = run_args(tmp_path / "out", "--task", "classification", "--model_name_or_path", str(work / "base"))
    args += ["--train_file", str(work / "train.csv"), "--resume_from_checkpoint", "true"]
    with pytest.raises(ValueError, match="x processes = 8, but these flags give 4: the resumed run would skip"):
        finetune.main(args + ["--per_device_train_batch_size", "4"])
    other = tmp_path / "other"
    texts = [row["text"].upper() for row in sentiment_rows(50, 0)]
    save_tokenizer(train_tokenizer(texts, "decoder", vocab_size=300, min_frequency=1), other)
    (checkpoint / "tokenizer.json").unlink()
    save_tokenizer(load_tokenizer(other), checkpoint)
    with pytest.raises(
        ValueError, match="checkpoint-5 was trained with another tokenizer: \\d+ of the \\d+ tokens of --m"
    ):
        finetune.main(args)


def test_a_damaged_base_model_is_named_before_anything_is_read(tmp_path: Path, work: Path) -> None:
    import shutil

    base = tmp_path / "base"
    shutil.copytree(work / "base", base)
    (base / "model.safetensors").write_bytes(b"")
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=f"--model_name_or_path '{base}': {base / 'model.safetensors'} is damaged"):
        finetune.main(run_args(out, "--task", "instruct", "--model_name_or_path", str(base)))
    assert not out.exists()


def test_a_base_model_of_the_wrong_kind_is_named_before_anything_is_read(tmp_path: Path, work: Path) -> None:
    """A decoder folder given to --task seq2seq (and an encoder-decoder to the decoder tasks) is one error naming the
    folder's model type and the flag, not transformers' list of every config class after the data is tokenized."""
    seq2seq = tmp_path / "seq2seq"
    archlab.Seq2SeqForConditionalGeneration(archlab.Seq2SeqConfig(**TINY_SEQ2SEQ)).save_pretrained(seq2seq)
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=r"holds a `archlab_decoder` model \(DecoderConfig\), which --task seq2seq"):
        finetune.main(run_args(out, "--task", "seq2seq", "--model_name_or_path", str(work / "base")))
    for task, auto in (("instruct", "AutoModelForCausalLM"), ("classification", "AutoModelForSequenceClassification")):
        with pytest.raises(ValueError, match=f"`archlab_seq2seq` model .*--task {task} cannot train: .*{auto}"):
            finetune.main(run_args(out, "--task", task, "--model_name_or_path", str(seq2seq)))
    assert not out.exists()


def test_each_task_has_its_own_default_output_dir() -> None:
    """Fine-tuning a second task without --output_dir does not meet the first task's checkpoints (refused)."""
    tasks = ("instruct", "classification", "seq2seq")
    folders = {task: finetune.parse(["--task", task])[2].output_dir for task in tasks}
    assert folders == {task: f"runs/finetune-{task}" for task in folders}
    assert finetune.parse(["--task", "seq2seq", "--output_dir", "mine"])[2].output_dir == "mine"


def test_the_task_table_has_one_row_per_task_choice() -> None:
    """`--task` takes exactly the rows of the task table, and each row names a model kind the scripts build and
    reports every metric it computes in its before/after lines."""
    import dataclasses

    from archlab.training.kinds import MODEL_KINDS
    from archlab.training.tasks import TASKS

    task_flag = next(f for f in dataclasses.fields(finetune.FinetuneArguments) if f.name == "task")
    assert task_flag.metadata["help"].split(" | ") == list(TASKS) == ["instruct", "classification", "seq2seq"]
    assert task_flag.default in TASKS
    assert {name: task.model_kind for name, task in TASKS.items()} == {
        "instruct": "decoder",
        "classification": "decoder",
        "seq2seq": "seq2seq",
    }
    assert all(task.model_kind in MODEL_KINDS for task in TASKS.values())

    logits = np.array([[2.0, 0.0], [0.0, 1.0]])
    computed = {
        "instruct": TASKS["instruct"].view({"eval_loss": 1.0}),
        "classification": {
            "eval_loss": 1.0,
            **{
                f"eval_{k}": v
                for predictions, labels in ((logits, np.array([0, 1])), (logits[:, :1], np.array([0.5, 1.5])))
                for k, v in TASKS["classification"]
                .compute_metrics(None)(EvalPrediction(predictions=predictions, label_ids=labels))
                .items()
            },
        },
        "seq2seq": {"eval_loss": 1.0, **{f"eval_{k}": v for k, v in text_metrics(["a b"], ["a b"]).items()}},
    }
    for name, metrics in computed.items():
        assert set(TASKS[name].summary_keys) == set(metrics), name


def test_the_evaluation_generates_up_to_max_target_length() -> None:
    """--max_target_length 96 trained 96-token targets while the evaluation generated 48 (a fixed default), scoring
    every longer target as cut; unset, --generation_max_length follows --max_target_length, as in run_translation."""
    parsed = finetune.parse(["--task", "seq2seq", "--max_target_length", "96"])[2]
    assert parsed.generation_max_length == 96
    assert finetune.parse(["--task", "seq2seq"])[2].generation_max_length == 48
    given = ["--task", "seq2seq", "--max_target_length", "96", "--generation_max_length", "20"]
    assert finetune.parse(given)[2].generation_max_length == 20


def test_seq2seq_lengths_past_the_position_table_fail_before_training(tmp_path: Path) -> None:
    """A sinusoidal encoder-decoder of 64 positions and --max_source_length 256 (the default): one error naming the
    flag and the limit, before any training step (it would fail inside the first forward otherwise)."""
    args = run_args(tmp_path / "run", "--task", "seq2seq", "--max_train_samples", "16", "--max_eval_samples", "4")
    args += ["--config_overrides", TINY_SEQ2SEQ_OVERRIDES + ",max_position_embeddings=64", "--tokenizer_vocab_size"]
    with pytest.raises(ValueError, match=r"--max_source_length 256 is more than the model's 64 positions"):
        finetune.main([*args, "400"])
    assert not (tmp_path / "run" / "checkpoint-5").exists()


def test_a_missing_chat_column_is_named_with_its_split() -> None:
    args = finetune.FinetuneArguments(prompt_column="prompt", response_column="answer")
    with pytest.raises(ValueError, match=r"Column 'answer' not found in the validation split.*--response_column\."):
        as_messages(Dataset.from_list(instruction_rows(2)), args, "validation")


def test_a_missing_default_column_names_the_flag_that_names_it() -> None:
    """The code -> docstring task's default columns ('code', 'docstring') on the user's own pairs: the error named a
    column the user never gave, and not the flag to change it."""
    pairs = Dataset.from_list([{"en": "one", "fr": "un"}])
    with pytest.raises(
        ValueError, match=r"Column 'code' not found .*\['en', 'fr'\]: name the column with --source_col"
    ):
        check_pair_columns(pairs, "train", finetune.FinetuneArguments(), "text")


@pytest.mark.parametrize(
    "conversation, message",
    [
        ("hello", r"Column 'messages' of the train split holds str in row 0, not a conversation"),
        ([{"user": "hi"}, {"assistant": "yo"}], r"row 0 has a message \{'user': 'hi'.*\} without a \"role\""),
        ([{"role": "user", "content": "hi"}], r"no assistant message in any of its 3 conversations"),
        ([{"role": "assistant", "content": None}], r"row 0 has a message whose content is None; .* list of text"),
        (
            [
                {"role": "user", "content": [{"type": "image", "text": None}]},
                {"role": "assistant", "content": [{"type": "text", "text": "yo"}]},
            ],
            r"row 0 has a message whose content is \[\{'type': 'image'.*images and other parts are not read",
        ),
    ],
)
def test_a_messages_column_that_is_not_conversations_is_named(conversation, message) -> None:
    """Strings failed inside the chat template's `datasets.map` ("Chat messages should be dicts"), messages without
    a role as jinja's UndefinedError, and conversations without an answer as each "losing its answer when cut"."""
    with pytest.raises(ValueError, match=message):
        as_messages(Dataset.from_list([{"messages": conversation}] * 3), finetune.FinetuneArguments())


def test_seq2seq_targets_are_cut_at_max_target_length_not_at_max_source_length() -> None:
    """Sources and targets were tokenized in one call (`text_target`) with the sources' max_length: with
    --max_source_length below --max_target_length every target was cut at the source length."""
    pairs = [{"code": "x", "docstring": " ".join(f"w{i}" for i in range(40))}, {"code": "y " * 40, "docstring": "z"}]
    tokenizer = train_tokenizer([p["code"] + p["docstring"] for p in pairs], "seq2seq", vocab_size=300, min_frequency=1)
    for source_length, target_length in ((8, 24), (24, 8)):
        args = finetune.FinetuneArguments(max_source_length=source_length, max_target_length=target_length)
        encoded = tokenize_seq2seq(Dataset.from_list(pairs), tokenizer, args, max_length=None, num_proc=None)
        assert [len(row["input_ids"]) for row in encoded][1] == source_length
        assert [len(row["labels"]) for row in encoded][0] == target_length
        for row in encoded:  # each side keeps its closing token
            assert row["input_ids"][-1] == row["labels"][-1] == tokenizer.eos_token_id


def test_integer_labels_keep_their_values_as_ids() -> None:
    """Labels 0..11 were sorted as text ("10" before "2"): label 10 got id 2, so `logits.argmax(-1)` of the saved
    classifier did not give the label (run_glue.py sorts them as numbers)."""
    label2id, id2label = label_maps(Dataset.from_list([{"label": i % 12} for i in range(36)]), "label")
    assert label2id == {i: i for i in range(12)}
    assert id2label == {i: str(i) for i in range(12)}
    label2id, _ = label_maps(Dataset.from_list([{"label": v} for v in ("pos", "neg", "neutral")]), "label")
    assert label2id == {"neg": 0, "neutral": 1, "pos": 2}
    # a Hub data set's ClassLabel column keeps its own ids and names (they were the ids as text: "0", "1")
    features = Features({"label": ClassLabel(names=["negative", "positive"])})
    label2id, id2label = label_maps(Dataset.from_dict({"label": [1, 1]}, features=features), "label")
    assert label2id == {0: 0, 1: 1} and id2label == {0: "negative", 1: "positive"}


def test_float_labels_train_a_regression_head(tmp_path: Path, work: Path) -> None:
    """A float label column is a regression target, as run_glue.py reads it: one output trained by mean squared
    error. Each distinct float was a class of its own (80 classes for 80 rows), and a validation split of other
    values failed on labels "not in the training split"."""
    for name, n, seed in (("train", 80, 1), ("validation", 40, 2)):
        rows = [
            {**row, "score": (0.9 if row["label"] == "pos" else 0.1) + 0.01 * (i % 5)}
            for i, row in enumerate(sentiment_rows(n, seed))
        ]
        Dataset.from_list(rows).to_csv(tmp_path / f"{name}.csv")
    out = tmp_path / "reg"
    train, validation = tmp_path / "train.csv", tmp_path / "validation.csv"
    metrics = finetune.main(
        classification_args(out, work / "base", train, validation, "--label_column_name", "score", "--max_steps", "20")
    )
    assert metrics["eval_mse"] == pytest.approx(metrics["eval_loss"], rel=1e-4)
    assert metrics["eval_mse"] < 0.02 < metrics["before_eval_mse"] and metrics["eval_pearson"] > 0.9
    model = AutoModelForSequenceClassification.from_pretrained(out)
    assert model.config.num_labels == 1 and model.config.problem_type == "regression"


def test_rows_without_one_label_are_named_before_training(tmp_path: Path, work: Path) -> None:
    """A row without a label (a CSV's empty field) trained as a class "None"; a list of labels per row failed as
    an unhashable type inside the label mapping."""
    rows = sentiment_rows(20, 0)
    Dataset.from_list([{**row, "label": None if i == 3 else row["label"]} for i, row in enumerate(rows)]).to_csv(
        tmp_path / "missing.csv"
    )
    Dataset.from_list([{**row, "label": [row["label"], "other"]} for row in rows]).to_json(tmp_path / "lists.jsonl")
    out = tmp_path / "out"
    base = ["--task", "classification", "--model_name_or_path", str(work / "base"), "--train_file"]
    with pytest.raises(ValueError, match=r"Column 'label' of the train split has 1 empty cell\(s\)"):
        finetune.main(run_args(out, *base, str(tmp_path / "missing.csv")))
    with pytest.raises(ValueError, match=r"Column 'label' of the train split holds List\(Value\('string'\)\), not one"):
        finetune.main(run_args(out, *base, str(tmp_path / "lists.jsonl")))
    assert not out.exists()


@pytest.mark.parametrize("task", ["classification", "instruct"])
def test_a_tokenizer_without_a_pad_token_pads_with_its_eos_token(tmp_path: Path, work: Path, task: str) -> None:
    """A base model whose tokenizer has no pad token (a converted Llama's): the collator failed with "Asking to pad
    but the tokenizer does not have a padding token" at the first evaluation. Batches are padded with the
    end-of-sequence token, masked out, and the saved classifier gives the same logits padded or not."""
    base = tmp_path / "base"
    tokenizer = AutoTokenizer.from_pretrained(work / "base")
    tokenizer.pad_token = None
    tokenizer.save_pretrained(base)
    archlab.DecoderForCausalLM(tiny_decoder_config(vocab_size=len(tokenizer), pad_token_id=None)).save_pretrained(base)
    data = {
        "classification": ["--train_file", str(work / "train.csv"), "--block_size", "32"],
        "instruct": [
            "--train_file",
            str(work / "instruct.jsonl"),
            "--prompt_column",
            "prompt",
            "--response_column",
            "response",
        ],
    }[task]
    out = tmp_path / "out"
    metrics = finetune.main(run_args(out, "--task", task, "--model_name_or_path", str(base), *data))
    assert metrics["eval_loss"] < metrics["before_eval_loss"]
    saved = AutoTokenizer.from_pretrained(out)
    assert saved.pad_token == saved.eos_token
    if task == "classification":
        model = AutoModelForSequenceClassification.from_pretrained(out).eval()
        texts = ["great good lovely", "bad sad awful poor awful sad bad"]
        batch = saved(texts, return_tensors="pt", padding=True)
        alone = torch.cat([model(**saved(text, return_tensors="pt")).logits for text in texts])
        assert_close_to_scale(model(**batch).logits, alone)


def test_a_classifier_is_fine_tuned_under_its_own_label_ids(tmp_path: Path, work: Path) -> None:
    """A classifier whose head has the data's labels in another order (pos=0, neg=1) keeps its ids, as run_glue.py
    keeps them: the data's sorted order relabelled its outputs, and every prediction read as the other class. One
    with another number of labels gets a new head (it failed in `from_pretrained` on the head's size)."""
    tokenizer = AutoTokenizer.from_pretrained(work / "base")
    for name, labels in (("swapped", ["pos", "neg"]), ("three", ["a", "b", "c"])):
        id2label = dict(enumerate(labels))
        config = tiny_decoder_config(vocab_size=len(tokenizer), id2label=id2label)
        archlab.DecoderForSequenceClassification(config).save_pretrained(tmp_path / name)
        tokenizer.save_pretrained(tmp_path / name)
    files = ["--train_file", str(work / "train.csv"), "--validation_file", str(work / "validation.csv")]
    before = {}
    for name in ("swapped", "three"):
        args = ["--task", "classification", "--model_name_or_path", str(tmp_path / name), *files, "--block_size", "32"]
        before[name] = finetune.main(run_args(tmp_path / f"out-{name}", *args, "--max_steps", "1"))
    swapped = AutoModelForSequenceClassification.from_pretrained(tmp_path / "out-swapped")
    assert swapped.config.id2label == {0: "pos", 1: "neg"} and swapped.config.label2id == {"pos": 0, "neg": 1}
    three = AutoModelForSequenceClassification.from_pretrained(tmp_path / "out-three")
    assert three.config.id2label == {0: "neg", 1: "pos"} and three.score.weight.shape[0] == 2
