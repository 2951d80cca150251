"""Data-parallel runs of the training scripts train ONE model: `scripts/pretrain.py` and every task of
`scripts/finetune.py`, each under `torchrun` or `accelerate launch` (the shipped config or the plain flags; every
launcher at least once), end with the same weights on every process, equal to one process trained on the same global
batch (2 processes x 2 rows vs 1 x 4 rows).

The scripts report the validation loss before training. Done as `trainer.evaluate()` before `trainer.train()`, that
left the model unwrapped by DistributedDataParallel in transformers 5.23 / accelerate 1.15, and each process trained
its own replica without a word (`AtomicCheckpointTrainer.train` in training/trainer.py); so the weights themselves are
compared here, not just whether the run finished. Each launch costs ~20 s of imports on 2 cores, so each launcher is
launched once and runs its scripts one after the other in the same processes; hence `slow`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from safetensors.torch import load_file

import archlab
from archlab.tokenization.training import save_tokenizer, train_tokenizer

from distributed_launch import free_port, launch_batch, torchrun
from distributed_worker import run_script, run_trainer
from helpers import REPO, TINY_DECODER_OVERRIDES, TINY_SEQ2SEQ_OVERRIDES, tiny_decoder_config

# one test worker (pytest-xdist) runs the module: its tests share one launch per launcher (`launched`)
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("distributed_scripts")]

COMMON = [
    "--max_steps",
    "3",
    "--learning_rate",
    "3e-3",
    "--warmup_steps",
    "0",
    "--logging_steps",
    "1",
    "--eval_strategy",
    "no",
    "--save_strategy",
    "no",
    "--disable_tqdm",
    "true",
    "--use_cpu",
    "true",
    "--dataloader_pin_memory",
    "false",
    "--train_sampling_strategy",
    "sequential",
    "--seed",
    "0",
    "--per_device_eval_batch_size",
    "4",
    "--report_to",
    "none",
]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tokenizers (decoder with chat template, seq2seq) and one small data file per script and task."""
    folder = tmp_path_factory.mktemp("dp_data")
    code = [f"def function_{i}(value):\n    total = value * {i}\n    return total + {i % 7}\n" for i in range(40)]
    pairs = [{"code": c, "docstring": f"Return the value times {i} plus {i % 7}."} for i, c in enumerate(code)]
    reviews = [
        {"text": f"{'great good fine' if i % 2 else 'bad awful poor'} item {i}", "label": "pos" if i % 2 else "neg"}
        for i in range(24)
    ]
    chats = [{"prompt": f"Return {i} squared.", "response": f"def f():\n    return {i} ** 2"} for i in range(24)]
    people, places = (["Ann", "Lee"], ["Bob"], ["Mary"]), (["Paris"], ["New", "York"], ["Rome"])
    entities = [
        (people[i % 3], ["went", "to"] if i % 2 else ["likes"], places[i // 3 % 3], i % 5 * ["today"])
        for i in range(24)
    ]
    ner = [
        {
            "tokens": [*person, *verb, *place, *tail],
            "ner_tags": ["B-PER", *["I-PER"] * (len(person) - 1), *["O"] * len(verb), "B-LOC"]
            + ["I-LOC"] * (len(place) - 1)
            + ["O"] * len(tail),
        }
        for person, verb, place, tail in entities
    ]
    qa = []  # contexts of 4 to 26 words: the longer ones cut into 2 or 3 windows of 24 tokens
    for i in range(24):
        words = [["the", "cat", "sat", "on", "a", "mat"][(i + j) % 6] for j in range(3 + i)]
        colour = ["red", "blue", "green"][i % 3]
        at = i * 7 % len(words)
        context = " ".join([*words[:at], colour, *words[at:]])
        start = len(" ".join(words[:at])) + (1 if at else 0)
        qa.append(
            {
                "id": f"q{i}",
                "question": "which colour?",
                "context": context,
                "answers": {"text": [colour], "answer_start": [start]},
            }
        )
    texts = [
        *code,
        *(p["docstring"] for p in pairs),
        *(r["text"] for r in reviews),
        *(c["prompt"] + c["response"] for c in chats),
        *(" ".join(r["tokens"]) for r in ner),
        *(f"{r['question']} {r['context']}" for r in qa),
    ]
    save_tokenizer(train_tokenizer(texts, "decoder", vocab_size=300, min_frequency=1), folder / "decoder_tokenizer")
    save_tokenizer(train_tokenizer(texts, "seq2seq", vocab_size=300, min_frequency=1), folder / "seq2seq_tokenizer")
    save_tokenizer(train_tokenizer(texts, "masked_lm", vocab_size=300, min_frequency=1), folder / "masked_lm_tokenizer")
    (folder / "code.jsonl").write_text("".join(json.dumps({"text": c * 3}) + "\n" for c in code))
    Dataset.from_list(pairs).to_json(folder / "pairs.jsonl")
    Dataset.from_list(reviews).to_csv(folder / "reviews.csv")
    Dataset.from_list(chats).to_json(folder / "chats.jsonl")
    Dataset.from_list(ner).to_json(folder / "ner.jsonl")
    Dataset.from_list(qa).to_json(folder / "qa.jsonl")
    return folder


MASKED_LM, CLASSIFIER_LM_LOSS = "pretrain-masked_lm", "finetune-classification-lm_loss"


def with_flags(argv: list[str], **values: str) -> list[str]:
    """`argv` with the values of the flags named in `values` replaced."""
    argv = list(argv)
    for flag, value in values.items():
        argv[argv.index(f"--{flag}") + 1] = value
    return argv


def script_args(name: str, data: Path) -> list[str]:
    """`pretrain` or `finetune-TASK`: the script's flags for a tiny run on `data` (without the batch size)."""
    decoder = ["--tokenizer_name", str(data / "decoder_tokenizer"), "--config_overrides", TINY_DECODER_OVERRIDES]
    if name == MASKED_LM:  # without dropout, whose draws depend on how the batch is split
        pretrain = with_flags(
            script_args("pretrain", data),
            tokenizer_name=str(data / "masked_lm_tokenizer"),
            config_overrides=f"{TINY_SEQ2SEQ_OVERRIDES},dropout=0.0",
        )
        return [*pretrain, "--model_kind", "masked_lm"]
    if name == CLASSIFIER_LM_LOSS:
        overrides = f"{TINY_DECODER_OVERRIDES},classifier_lm_loss_weight=0.5"
        return with_flags(script_args("finetune-classification", data), config_overrides=overrides)
    if name == "pretrain":
        return [
            *decoder,
            "--train_file",
            str(data / "code.jsonl"),
            "--block_size",
            "32",
            "--eval_max_blocks",
            "4",
            "--sample_max_new_tokens",
            "0",
            "--preprocessing_num_workers",
            "1",
        ]
    task = name.split("-", 1)[1]
    files = {
        "instruct": "chats.jsonl",
        "classification": "reviews.csv",
        "seq2seq": "pairs.jsonl",
        "token-classification": "ner.jsonl",
        "question-answering": "qa.jsonl",
    }[task]
    files = ["--train_file", str(data / files), "--validation_file", str(data / files), "--max_eval_samples", "4"]
    if task == "token-classification":  # (11 rows: batches of 4 that the 2 processes share unevenly)
        # without the head's dropout (0.1 by default), whose draws depend on how the batch is split
        overrides = f"{TINY_DECODER_OVERRIDES},classifier_dropout=0.0"
        decoder = with_flags(decoder, config_overrides=overrides)
        return ["--task", task, *decoder, *with_flags(files, max_eval_samples="11")]
    if task == "question-answering":  # (11 rows, 23 windows of at most 24 tokens)
        windows = ["--max_seq_length", "24", "--doc_stride", "8"]
        return ["--task", task, *decoder, *with_flags(files, max_eval_samples="11"), *windows]
    if task == "instruct":
        return ["--task", task, *decoder, *files, "--prompt_column", "prompt", "--response_column", "response"]
    if task == "classification":
        return ["--task", task, *decoder, *files]
    seq2seq = f"{TINY_SEQ2SEQ_OVERRIDES},dropout=0.0"
    return [
        "--task",
        task,
        "--tokenizer_name",
        str(data / "seq2seq_tokenizer"),
        "--config_overrides",
        seq2seq,
        *files,
        "--generation_max_length",
        "8",
        "--max_source_length",
        "48",
        "--max_target_length",
        "16",
    ]


def script_of(name: str) -> str:
    return name.split("-", 1)[0]


def run_argv(name: str, data: Path, folder: Path, batch: int) -> list[str]:
    """The script's whole command line for a run writing to `folder/run` with `batch` rows per process."""
    return [
        *script_args(name, data),
        *COMMON,
        "--output_dir",
        str(folder / "run"),
        "--per_device_train_batch_size",
        str(batch),
    ]


def run_single_process(name: str, data: Path, out: Path) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    result = run_script(script_of(name), str(out / "weights"), run_argv(name, data, out, batch=4))
    return load_file(out / "weights" / "rank-0.safetensors"), result["metrics"]


LAUNCHERS = {
    "torchrun": torchrun,
    "accelerate-config": lambda: [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(REPO / "configs" / "accelerate" / "multi_cpu.yaml"),
        "--main_process_port",
        str(free_port()),
    ],
    # the plain flags docs/scaling.md gives for N CPU processes (`--cpu --num_processes 2` starts ONE process)
    "accelerate-flags": lambda: [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        str(free_port()),
    ],
}
# Every script and task once, every launcher at least once. What could go wrong per script (its model not wrapped for
# data parallelism) does not depend on the launcher, and what could go wrong per launcher (a config starting one
# process, ranks not set) does not depend on the script.
RUNS = [
    ("pretrain", "torchrun"),
    ("pretrain", "accelerate-config"),  # the README's multi-process pretraining command
    ("finetune-instruct", "accelerate-flags"),
    ("finetune-classification", "torchrun"),
    ("finetune-seq2seq", "accelerate-config"),
    # The two losses whose terms once depended on the split of the global batch: the masked LM's masks (drawn per
    # process and micro-batch) and the classifier's auxiliary LM loss (a mean per micro-batch). Both are now
    # weighted or drawn by the row's place in the global batch.
    ("pretrain-masked_lm", "torchrun"),
    ("finetune-classification-lm_loss", "torchrun"),
    ("finetune-token-classification", "accelerate-flags"),
    ("finetune-question-answering", "torchrun"),
]
# The scripts' Trainer with `evaluate()` before `train()` (the case that broke), beside the torchrun runs.
EVALUATE_FIRST = "archlab-trainer-evaluate-first"
# Beside them too: pretraining that saves a checkpoint at every step, and one that trains its own WordPiece tokenizer.
CHECKPOINTED = "pretrain-checkpoints"
TOKENIZER_TRAINED = "pretrain-trains-its-tokenizer"
EXTRA_TORCHRUN_SCRIPTS = (CHECKPOINTED, TOKENIZER_TRAINED)


def extra_torchrun_jobs(data: Path, folder: Path) -> dict[str, list[str]]:
    """`CHECKPOINTED` and `TOKENIZER_TRAINED`: the pretraining run of `script_job`, with those changes."""
    checkpointed = script_job("pretrain", data, folder / CHECKPOINTED)
    checkpointed += ["--save_strategy", "steps", "--save_steps", "1", "--save_total_limit", "5"]
    trained = script_job("pretrain", data, folder / TOKENIZER_TRAINED)
    at = trained.index("--tokenizer_name")
    del trained[at : at + 2]
    trained += ["--tokenizer_algorithm", "wordpiece", "--tokenizer_vocab_size", "200"]
    return {CHECKPOINTED: checkpointed, TOKENIZER_TRAINED: trained}


def script_job(name: str, data: Path, folder: Path) -> list[str]:
    """The worker's job running script `name` on 2 rows per process, writing to `folder`."""
    return ["script", script_of(name), "--weights_dir", str(folder / "weights"), "--", *run_argv(name, data, folder, 2)]


@pytest.fixture(scope="module")
def launched(data: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """ONE launch per launcher (each costs ~20 s of imports on 2 cores) running its scripts one after the other in
    the same 2 processes: `{(name, launcher): (the job's folder, its result, what the launch printed)}`."""
    results = {}
    for launcher in LAUNCHERS:
        folder = tmp_path_factory.mktemp(launcher)
        names = [name for name, used in RUNS if used == launcher]
        jobs = {name: script_job(name, data, folder / name) for name in names}
        if launcher == "torchrun":
            torch.manual_seed(0)
            model_dir = folder / "model"
            archlab.DecoderForCausalLM(tiny_decoder_config(max_position_embeddings=64)).save_pretrained(model_dir)
            trainer_folder = folder / EVALUATE_FIRST
            jobs[EVALUATE_FIRST] = [
                *("trainer", str(model_dir), "--output_dir", str(trainer_folder / "run")),
                *("--weights_dir", str(trainer_folder / "weights"), "--archlab_trainer", "--evaluate_first"),
            ]
            names.append(EVALUATE_FIRST)
            jobs.update(extra_torchrun_jobs(data, folder))
            names += EXTRA_TORCHRUN_SCRIPTS
        out, printed = launch_batch(folder, LAUNCHERS[launcher](), jobs)
        for name in names:
            results[name, launcher] = (folder / name, out[name], printed)
    return results


@pytest.fixture(scope="module")
def single_process(data: Path, tmp_path_factory: pytest.TempPathFactory):
    """`name` -> (the weights of its 1-process run, the run's metrics)."""
    cache: dict[str, tuple[dict[str, torch.Tensor], dict[str, float]]] = {}

    def run(name: str) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        if name not in cache:
            cache[name] = run_single_process(name, data, tmp_path_factory.mktemp(f"one-{name}"))
        return cache[name]

    return run


# The evaluation's scores, computed on the predictions gathered from both processes: equal to one process's. The
# question-answering windows come back in order, the duplicates of uneven sharding dropped, before they are put
# back together into each row's answer; the token classifier's label rows are padded across processes.
SCORES = {
    "finetune-token-classification": ("eval_precision", "eval_recall", "eval_f1", "eval_accuracy"),
    "finetune-question-answering": ("eval_exact_match", "eval_f1"),
}
# The QA head's bias moves every position's start (or end) logit alike, which the softmax over positions ignores: its
# gradient is rounding noise, which AdamW's first steps scale to steps of ~lr whatever its sign.
UNTRAINED = ("qa_outputs.bias",)


def assert_one_model(weights_dir: Path, reference: dict[str, torch.Tensor]) -> None:
    ranks = [load_file(weights_dir / f"rank-{r}.safetensors") for r in range(2)]
    assert ranks[0].keys() == ranks[1].keys() == reference.keys()
    for name in reference:
        torch.testing.assert_close(ranks[1][name], ranks[0][name], rtol=0, atol=0, msg=f"ranks differ in {name}")
        if name in UNTRAINED:
            continue
        # One process sums the same per-token gradients in another order: float32 rounding after 3 AdamW steps,
        # far below the ~lr = 3e-3 each step moves a weight by.
        torch.testing.assert_close(
            ranks[0][name], reference[name], rtol=1e-4, atol=2e-5, msg=f"{name} differs from the 1-process run"
        )
    assert any(not torch.equal(reference[n], ranks[0][n]) for n in reference)  # (it trained: compared to itself)


@pytest.mark.parametrize(("name", "launcher"), RUNS, ids=[f"{name}-{launcher}" for name, launcher in RUNS])
def test_script_trains_one_model(name: str, launcher: str, launched, single_process) -> None:
    folder, result, printed = launched[name, launcher]
    assert result["world_size"] == 2
    scripts = sum(used == launcher for _, used in RUNS) + (len(EXTRA_TORCHRUN_SCRIPTS) if launcher == "torchrun" else 0)
    assert printed.count("Before ") == scripts  # the loss before training is still reported, by the first process
    assert "before_eval_loss" in result["metrics"]
    assert (folder / "run" / "config.json").is_file()  # one complete folder, written by rank 0
    weights, metrics = single_process(name)
    assert_one_model(folder / "weights", weights)
    for key in SCORES.get(name, ()):
        assert result["metrics"][key] == pytest.approx(metrics[key]), key
        assert result["metrics"][f"before_{key}"] == pytest.approx(metrics[f"before_{key}"]), key


def test_archlab_trainer_trains_one_model_after_an_evaluation(tmp_path: Path, launched) -> None:
    """The scripts' Trainer under torchrun with `evaluate()` before `train()`, where the stock Trainer of transformers
    5.23 leaves each process training its own replica. (Training alone is the scripts' runs above and
    test_distributed.py's stock Trainer.)"""
    folder, two, _ = launched[EVALUATE_FIRST, "torchrun"]
    assert two["world_size"] == 2
    run_trainer(
        argparse.Namespace(
            models=[str(folder.parent / "model")],
            output_dir=str(tmp_path / "one"),
            global_batch=4,
            steps=4,
            weights_dir=str(tmp_path / "one-weights"),
            archlab_trainer=True,
            evaluate_first=True,
        )
    )
    assert_one_model(folder / "weights", load_file(tmp_path / "one-weights" / "rank-0.safetensors"))


def test_checkpoints_of_two_processes_are_complete(launched) -> None:
    """Every process writes into the checkpoint's staging folder (its own RNG state), and only the saving process
    renames it into place, after the others are done: each process clearing or renaming the folder on its own crashed
    the run or left a `checkpoint-N` without its files (rank 1's RNG state, or the model)."""
    folder, result, _ = launched[CHECKPOINTED, "torchrun"]
    assert result["world_size"] == 2
    run = folder / "run"
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]
    for checkpoint in run.glob("checkpoint-*"):
        files = {p.name for p in checkpoint.iterdir()}
        expected = {"model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json"}
        assert expected | {"rng_state_0.pth", "rng_state_1.pth"} <= files, checkpoint.name
    assert not [p.name for p in run.iterdir() if p.name.startswith(".staging")]
    assert (run / "config.json").is_file()


def test_a_tokenizer_trained_under_two_processes_is_one_tokenizer(launched) -> None:
    """WordPiece training orders ties by each process's hash seed: every process training its own gave each its own
    token ids. The first process trains, the others get its tokenizer, the one saved with the model."""
    folder, result, _ = launched[TOKENIZER_TRAINED, "torchrun"]
    assert result["world_size"] == 2
    ranks = [json.loads((folder / "weights" / f"rank-{r}.tokenizer.json").read_text()) for r in range(2)]
    assert ranks[0]["model"]["vocab"] == ranks[1]["model"]["vocab"]
    saved = json.loads((folder / "run" / "tokenizer.json").read_text())
    assert saved["model"]["vocab"] == ranks[0]["model"]["vocab"]
