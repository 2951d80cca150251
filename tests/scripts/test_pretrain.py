"""scripts/pretrain.py end to end on tiny settings: outputs, bad inputs (clear errors, nothing written), and resuming
after SIGKILL ends exactly where an uninterrupted run ends."""

from __future__ import annotations

import concurrent.futures
import importlib.util
import json
import logging
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import transformers.trainer
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from archlab.scripts import pretrain
from archlab.tokenization.training import save_tokenizer, train_tokenizer
from archlab.training import hub, pretraining, sources

from helpers import TINY_DECODER_OVERRIDES, TINY_SEQ2SEQ_OVERRIDES, forbid


def code_texts(n: int) -> list[str]:
    return [f"def function_{i}(value):\n    total = value * {i}\n    return total + {i % 7}\n" * 3 for i in range(n)]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("data")
    texts = code_texts(60)
    (folder / "train.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    (folder / "content.jsonl").write_text("".join(json.dumps({"content": t}) + "\n" for t in texts))
    (folder / "empty.csv").write_text("text\n")
    (folder / "blank.txt").write_text("\n \n")
    (folder / "latin1.txt").write_bytes("café au lait\n".encode("latin-1") * 40)
    (folder / "latin1.csv").write_bytes("text\ncafé\n".encode("latin-1") * 40)
    tokenizer = train_tokenizer(texts, "decoder", vocab_size=300, min_frequency=1)
    save_tokenizer(tokenizer, folder / "tokenizer")
    return folder


def tiny_args(out: Path, data_dir: Path, *extra: str, train_file: str | None = "train.jsonl") -> list[str]:
    args = [
        "--output_dir",
        str(out),
        "--cache_dir",
        str(data_dir / "cache"),
        "--max_steps",
        "6",
        "--per_device_train_batch_size",
        "4",
        "--per_device_eval_batch_size",
        "4",
        "--block_size",
        "32",
        "--config_overrides",
        TINY_DECODER_OVERRIDES,
        "--eval_steps",
        "3",
        "--save_steps",
        "3",
        "--logging_steps",
        "1",
        "--warmup_steps",
        "0",
        "--eval_max_blocks",
        "8",
        "--sample_max_new_tokens",
        "8",
        "--disable_tqdm",
        "true",
        "--dataloader_pin_memory",
        "false",
        "--preprocessing_num_workers",
        "1",
    ]
    if train_file:
        args += ["--train_file", str(data_dir / train_file)]
    return args + list(extra)


def test_pretrain_decoder_end_to_end(tmp_path: Path, data_dir: Path) -> None:
    out = tmp_path / "run"
    metrics = pretrain.main(tiny_args(out, data_dir, "--tokenizer_vocab_size", "300", "--learning_rate", "3e-3"))
    assert metrics["eval_loss"] < metrics["before_eval_loss"]
    assert metrics["eval_perplexity"] == pytest.approx(torch.tensor(metrics["eval_loss"]).exp().item(), rel=1e-4)
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "README.md",
        "loss_curve.png",
        "trainer_state.json",
        "all_results.json",
        "checkpoint-6",
    ):
        assert (out / name).exists(), name
    assert not any(entry.startswith(".staging") for entry in os.listdir(out))
    assert json.loads((out / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"
    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert model.config.vocab_size == len(tokenizer) and model.config.use_cache
    # the tokenizer trained here carries the model's context, not the training block size (32)
    assert tokenizer.model_max_length == model.config.max_position_embeddings == 512
    assert "loss_curve.png" in (out / "README.md").read_text()


def test_a_masked_lm_with_a_tokenizer_without_a_mask_token_is_refused_before_data_is_read(
    tmp_path: Path, data_dir: Path, monkeypatch
) -> None:
    """The collator failed on it only after the data was tokenized and packed."""
    args = tiny_args(
        tmp_path / "run", data_dir, "--model_kind", "masked_lm", "--tokenizer_name", str(data_dir / "tokenizer")
    )
    args[args.index(TINY_DECODER_OVERRIDES)] = TINY_SEQ2SEQ_OVERRIDES
    forbid(monkeypatch, pretrain, "prepare_data", "the data was prepared before the tokenizer was checked")
    with pytest.raises(
        ValueError,
        match=r"masked_lm needs a tokenizer with a mask token \(BERT's \[MASK\]\), and the one of --tokenizer_name",
    ):
        pretrain.main(args)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["seq2seq", "masked_lm"])
def test_pretrain_other_kinds(tmp_path: Path, data_dir: Path, kind: str) -> None:
    out = tmp_path / kind
    args = tiny_args(out, data_dir, "--model_kind", kind, "--tokenizer_vocab_size", "300")
    args[args.index(TINY_DECODER_OVERRIDES)] = TINY_SEQ2SEQ_OVERRIDES
    metrics = pretrain.main(args)
    assert metrics["eval_loss"] == metrics["eval_loss"]  # finite, not NaN
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "archlab_seq2seq" and (out / "tokenizer.json").exists()


BAD_INPUTS = [
    (["--train_file", "missing.jsonl"], FileNotFoundError, "missing.jsonl' does not exist"),
    (["--train_file", "empty.csv"], ValueError, "train split is empty"),
    (["--train_file", "content.jsonl"], ValueError, "Column 'text' not found in the train split"),
    (
        ["--tokenizer_name", "tokenizer", "--config_overrides", "vocab_size=100"],
        ValueError,
        "tokenizer has \\d+ tokens but the model's `vocab_size` is 100",
    ),
    (
        ["--block_size", "512", "--config_overrides", "max_position_embeddings=256"],
        ValueError,
        "--block_size 512 exceeds the model's `max_position_embeddings` \\(256\\)",
    ),
    (["--dataset_name", "wikitext"], ValueError, "Conflicting flags: --dataset_name and --train_file"),
    (["--tokenizer_name", "tokenizer", "--tokenizer_vocab_size", "500"], ValueError, "Conflicting flags"),
    (["--preset", "tiny", "--config_name", "config.json"], ValueError, "Conflicting flags: --preset and --config_name"),
    (["--streaming", "true", "--max_steps", "-1"], ValueError, "--streaming needs --max_steps"),
    (["--model_kind", "encoder"], ValueError, "allowed values: decoder, seq2seq, masked_lm"),
    (
        ["--tokenizer_algorithm", "sentencepiece"],
        ValueError,
        "--tokenizer_algorithm 'sentencepiece' is not supported; allowed values: bpe, wordpiece, unigram",
    ),
    (["--tokenizer_train_samples", "0"], ValueError, "--tokenizer_train_samples must be >= 1, got 0"),
    (["--sample_by", "sentence"], ValueError, "--sample_by 'sentence' is not supported; allowed values: document"),
    (["--max_train_samples", "-3"], ValueError, "--max_train_samples must be >= 1"),
    (["--eval_max_blocks", "0"], ValueError, "--eval_max_blocks must be >= 1"),
    # skipped the sample printed after training without a word
    (["--sample_max_new_tokens", "-1"], ValueError, "--sample_max_new_tokens must be >= 0 \\(0: no sample\\), got -1"),
    (
        ["--config_overrides", "num_hidden_layer=1"],
        ValueError,
        "DecoderConfig has no field 'num_hidden_layer' \\(did you mean 'num_hidden_layers'\\?\\)",
    ),
    (  # another codebase's name for a field: the field it means, not the closest spelling ('lm_head_bias')
        ["--config_overrides", "num_heads=2,n_layer=1"],
        ValueError,
        "'num_heads' \\(did you mean 'num_attention_heads'\\?\\), 'n_layer' \\(did you mean 'num_hidden_layers'",
    ),
    (  # a generation setting, which the config would drop without a word
        ["--config_overrides", "top_k=2"],
        ValueError,
        "'top_k' \\(did you mean 'num_experts_per_tok'\\?\\): generation settings \\(transformers' GenerationConfig\\)",
    ),
    (["--resume_from_checkpoint", "true"], FileNotFoundError, "no checkpoint-N folder"),
    (  # the perplexity is derived after each evaluation: the Trainer's KeyError came at the first comparison
        ["--metric_for_best_model", "perplexity"],
        ValueError,
        "--metric_for_best_model perplexity: Pretraining's evaluations report loss, runtime, samples_per_second, "
        "steps_per_second",
    ),
    (
        ["--tokenizer_vocab_size", "5"],
        ValueError,
        "--tokenizer_vocab_size must be at least 262 for a bpe decoder tokenizer \\(its 6 special tokens and 256 "
        "bytes\\), got 5",
    ),
    (["--train_file", "blank.txt"], ValueError, "The train split is empty: '.*blank.txt' holds no text"),
    (["--train_file", "latin1.txt"], ValueError, "Data file '.*latin1.txt' is not UTF-8 text: byte 0xe9 at offset 3"),
    (["--train_file", "latin1.csv"], ValueError, "Data file '.*latin1.csv' is not UTF-8 text: byte 0xe9 at offset 8"),
    (["--config_overrides", 'hidden_size="32"'], ValueError, "`hidden_size` must be an int, got '32' \\(a str\\)"),
    (
        ["--config_overrides", 'rope_parameters={"rope_type":"spiral","rope_theta":1e4}'],
        ValueError,
        "`rope_parameters\\['rope_type'\\]`='spiral' is not supported; allowed values: 'default', 'linear'",
    ),
    # a NaN model trained, saved and reported as a success; a shape error in the first forward
    (["--config_overrides", "rope_theta=-5"], ValueError, "`rope_theta` .* must be a positive number"),
    (["--config_overrides", "partial_rotary_factor=1.5"], ValueError, "`partial_rotary_factor` .* in \\(0, 1\\]"),
    (
        ["--attn_implementation", "flash_attention_9"],
        ValueError,
        "--attn_implementation 'flash_attention_9' is not supported; allowed values: eager, ",
    ),
    # accepted and ignored (transformers' example scripts predict a --test_file under it)
    (["--do_predict", "true"], ValueError, "--do_predict: this script has no test split to predict"),
]


@pytest.mark.parametrize("extra, error, message", BAD_INPUTS, ids=[m[:30] for _, _, m in BAD_INPUTS])
def test_bad_input_fails_before_anything_is_written(
    tmp_path: Path, data_dir: Path, extra: list[str], error: type, message: str
) -> None:
    out = tmp_path / "run"
    args = tiny_args(out, data_dir)
    for flag, value in zip(extra[::2], extra[1::2]):
        if flag in ("--train_file", "--tokenizer_name"):
            value = str(data_dir / value)
        if flag == "--config_overrides":
            value = f"{TINY_DECODER_OVERRIDES},{value}"
        if flag in args:
            args[args.index(flag) + 1] = value
        else:
            args += [flag, value]
    with pytest.raises(error, match=message):
        pretrain.main(args)
    assert not out.exists()


@pytest.mark.parametrize(
    "extra, message",
    [
        (
            ["--block_size", "512", "--config_overrides", f"{TINY_DECODER_OVERRIDES},max_position_embeddings=256"],
            "--block_size 512 exceeds the model's `max_position_embeddings` \\(256\\)",
        ),
        (["--attn_implementation", "flash_attention_9"], "--attn_implementation 'flash_attention_9'"),
        (["--dtype", "bfloat16"], "--dtype bfloat16: it sets the dtype a saved --model_name_or_path loads in"),
    ],
)
def test_model_flags_fail_before_data_is_read(
    tmp_path: Path, data_dir: Path, monkeypatch: pytest.MonkeyPatch, extra: list[str], message: str
) -> None:
    """The first two failed only after the tokenizer was trained and the data prepared; --dtype with no saved model to
    load is named as early."""

    forbid(monkeypatch, sources, "load_raw_datasets", "data was loaded before the model flags were checked")
    args = tiny_args(tmp_path / "run", data_dir)
    for flag, value in zip(extra[::2], extra[1::2]):
        if flag in args:
            args[args.index(flag) + 1] = value
        else:
            args += [flag, value]
    with pytest.raises(ValueError, match=message):
        pretrain.main(args)


def test_resuming_with_another_architecture_is_refused_before_data_is_read(
    tmp_path: Path, data_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another hidden size failed as a size mismatch inside the Trainer's checkpoint load, after data preparation."""
    import archlab

    from helpers import tiny_decoder_config

    checkpoint = tmp_path / "run" / "checkpoint-3"
    archlab.DecoderConfig(**{**tiny_decoder_config().to_dict(), "hidden_size": 64}).save_pretrained(checkpoint)
    (checkpoint / "trainer_state.json").write_text(json.dumps({"global_step": 3}))
    forbid(monkeypatch, sources, "load_raw_datasets", "data was loaded before the checkpoint's config was compared")
    args = tiny_args(tmp_path / "run", data_dir, "--resume_from_checkpoint", "true")
    with pytest.raises(
        ValueError, match="checkpoint-3 holds a model with hidden_size=64.* these flags build hidden_size=32"
    ):
        pretrain.main(args)


def test_resuming_with_another_tokenizer_is_refused_before_data_is_read(
    tmp_path: Path, data_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A --tokenizer_name of the checkpoint's size but other token ids trained its embeddings on other tokens without
    a word."""
    checkpoint = tmp_path / "run" / "checkpoint-3"
    save_tokenizer(train_tokenizer(code_texts(60), "decoder", vocab_size=300, min_frequency=1), checkpoint)
    (checkpoint / "trainer_state.json").write_text(json.dumps({"global_step": 3}))
    other = tmp_path / "other"
    texts = [text.replace("value", "x") + " zebra quokka" for text in code_texts(60)]
    save_tokenizer(train_tokenizer(texts, "decoder", vocab_size=300, min_frequency=1), other)
    forbid(monkeypatch, sources, "load_raw_datasets", "data was loaded before the checkpoint's tokenizer was compared")
    args = tiny_args(tmp_path / "run", data_dir, "--resume_from_checkpoint", "true", "--tokenizer_name", str(other))
    with pytest.raises(ValueError, match="checkpoint-3 was trained with another tokenizer: \\d+ of the 300 tokens"):
        pretrain.main(args)


def test_resuming_in_another_dtype_is_refused_before_data_is_read(
    tmp_path: Path, data_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkpoint of bfloat16 weights resumed with the default --dtype (float32, a new model's) trained on in
    float32 without a word: the weights' dtype is a run fact now."""
    checkpoint = tmp_path / "run" / "checkpoint-3"
    checkpoint.mkdir(parents=True)
    (checkpoint / "trainer_state.json").write_text(json.dumps({"global_step": 3}))
    (checkpoint / "run_facts.json").write_text(json.dumps({"weights_dtype": "bfloat16"}))
    forbid(monkeypatch, sources, "load_raw_datasets", "data was loaded before the checkpoint's dtype was compared")
    args = tiny_args(tmp_path / "run", data_dir, "--resume_from_checkpoint", "true")
    with pytest.raises(
        ValueError, match=r"--dtype \(the weights' dtype\) = 'bfloat16', but these flags give 'float32'"
    ):
        pretrain.main(args)


def test_a_config_value_out_of_range_fails_before_the_tokenizer_is_trained(
    tmp_path: Path, data_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    forbid(monkeypatch, pretraining, "train_tokenizer", "a tokenizer was trained before the config was checked")
    args = tiny_args(tmp_path / "run", data_dir)
    args[args.index("--config_overrides") + 1] = f"{TINY_DECODER_OVERRIDES},num_key_value_heads=3"
    with pytest.raises(ValueError, match="`num_key_value_heads` \\(3\\) must divide `num_attention_heads`"):
        pretrain.main(args)
    assert not (tmp_path / "run").exists()


def test_a_pretrained_folder_of_another_model_kind_is_refused_first(tmp_path: Path, data_dir: Path) -> None:
    """--model_kind seq2seq over a decoder folder names the folder's model type, before anything is read."""
    import archlab

    from helpers import tiny_decoder_config

    folder = tmp_path / "decoder"
    archlab.DecoderForCausalLM(tiny_decoder_config()).save_pretrained(folder)
    args = tiny_args(tmp_path / "run", data_dir, "--model_kind", "seq2seq", "--model_name_or_path", str(folder))
    position = args.index("--config_overrides")
    del args[position : position + 2]
    with pytest.raises(ValueError, match=r"of type `archlab_decoder` .* --model_kind seq2seq cannot train"):
        pretrain.main(args)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "holds, message",
    [
        ("adapter", r"holds a PEFT adapter \(adapter_config.json\), not a whole model: merge it into its base model"),
        ("tokenizer", r"holds no saved model \(config.json\)"),
        ("file", "'.*cache' is a file, not a folder"),
    ],
)
def test_a_model_folder_that_holds_no_model_is_named_before_data_is_read(
    tmp_path: Path, data_dir: Path, monkeypatch: pytest.MonkeyPatch, holds: str, message: str
) -> None:
    """A LoRA adapter folder or a tokenizer folder as --model_name_or_path failed inside transformers' AutoConfig
    ("Unrecognized model"), and a --cache_dir that is a file with FileExistsError, both as tracebacks."""
    forbid(monkeypatch, sources, "load_raw_datasets", "data was loaded before the model folder was checked")
    folder = tmp_path / "folder"
    save_tokenizer(train_tokenizer(code_texts(20), "decoder", vocab_size=300, min_frequency=1), folder)
    if holds == "adapter":
        (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2}))
    args = tiny_args(tmp_path / "run", data_dir)
    position = args.index("--config_overrides")
    del args[position : position + 2]
    if holds == "file":
        args[args.index("--cache_dir") + 1] = str(tmp_path / "cache")
        (tmp_path / "cache").write_text("")
    else:
        args += ["--model_name_or_path", str(folder)]
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        pretrain.main(args)
    assert not (tmp_path / "run").exists()


def test_a_masked_lm_folder_is_refused_as_a_seq2seq_start(tmp_path: Path, data_dir: Path) -> None:
    """archlab's masked LM shares Seq2SeqConfig with the encoder-decoder: --model_kind seq2seq loaded its encoder and
    trained a decoder from random weights without a word."""
    import archlab

    from helpers import tiny_seq2seq_config

    folder = tmp_path / "mlm"
    archlab.EncoderForMaskedLM(tiny_seq2seq_config()).save_pretrained(folder)
    args = tiny_args(tmp_path / "run", data_dir, "--model_kind", "seq2seq", "--model_name_or_path", str(folder))
    position = args.index("--config_overrides")
    del args[position : position + 2]
    with pytest.raises(ValueError, match="holds an encoder-only `EncoderForMaskedLM`, and --model_kind seq2seq"):
        pretrain.main(args)
    assert not (tmp_path / "run").exists()


TRAINING_FLAGS = [
    (["--learning_rate", "-1"], "--learning_rate must be > 0, got -1.0"),
    (["--per_device_train_batch_size", "0"], "--per_device_train_batch_size must be >= 1, got 0"),
    (["--gradient_accumulation_steps", "0"], "--gradient_accumulation_steps must be >= 1, got 0"),
    (["--max_steps", "0"], "--max_steps must be >= 1, or -1 (unset: train --num_train_epochs epochs), got 0"),
    (["--max_steps", "-5"], "--max_steps must be >= 1, or -1 (unset: train --num_train_epochs epochs), got -5"),
    (["--max_steps", "-1", "--num_train_epochs", "0"], "--num_train_epochs must be > 0 when --max_steps is -1"),
    (["--save_steps", "0"], "--save_steps must be > 0 with --save_strategy steps"),
    (["--eval_steps", "-2"], "--eval_steps must be > 0 with --eval_strategy steps"),
    (["--logging_steps", "0"], "requires non-zero --logging_steps"),  # TrainingArguments' own check
    # accelerate has no fp16 autocast on the CPU: the run trained in float32 while its log said fp16
    (["--fp16", "true", "--use_cpu", "true"], "--fp16 runs only on a GPU"),
    # accelerate has no FSDP on the CPU: the run trained plain data parallel while the flags said FSDP
    (["--fsdp", "full_shard", "--use_cpu", "true"], "FSDP (--fsdp or an accelerate FSDP config) shards the model"),
    # a schedule without its own arguments failed with a TypeError from transformers when training started
    (["--lr_scheduler_type", "warmup_stable_decay"], "missing 1 required positional argument: 'num_decay_steps'"),
    (["--lr_scheduler_kwargs", '{"num_cycle": 2}'], "--lr_scheduler_type cosine with --lr_scheduler_kwargs"),
    # numpy's traceback from set_seed
    (["--seed", "-1"], "--seed must be in [0, 2**32 - 1] (numpy's seeds), got -1"),
    (["--data_seed", "4294967296"], "--data_seed must be in [0, 2**32 - 1] (numpy's seeds), got 4294967296"),
    # torch's DataLoader and transformers' integrations refused them with a traceback, after the data was prepared
    (["--dataloader_num_workers", "-1"], "--dataloader_num_workers must be >= 0"),
    (["--report_to", "wandbb"], "--report_to 'wandbb' is not supported; allowed values: all, none, azure_ml"),
    # trained without a word: a factor > 1 weighs the labels' own log-likelihood negatively
    (["--label_smoothing_factor", "1.5"], "--label_smoothing_factor must be in [0, 1) (0: no smoothing), got 1.5"),
    # datasets' traceback, once the data was read
    (["--preprocessing_num_workers", "-2"], "--preprocessing_num_workers must be >= 0"),
    # an empty path: os.makedirs('') failed with a traceback; the others fell back to their default without a word
    (["--output_dir", ""], "--output_dir is an empty string: give a value, or leave the flag out"),
    (["--train_file", ""], "--train_file is an empty string"),  # trained on the embedded corpus
    (["--tokenizer_name", ""], "--tokenizer_name is an empty string"),  # trained a new tokenizer
    (["--preset", ""], "--preset is an empty string"),  # built the default architecture
    (["--resume_from_checkpoint", ""], "--resume_from_checkpoint is an empty string"),  # started over
]


@pytest.mark.parametrize("extra, message", TRAINING_FLAGS, ids=[" ".join(extra) for extra, _ in TRAINING_FLAGS])
def test_training_flags_are_checked_before_data_is_read(
    tmp_path: Path, data_dir: Path, monkeypatch: pytest.MonkeyPatch, extra: list[str], message: str
) -> None:
    forbid(monkeypatch, sources, "load_raw_datasets", "data was loaded before the training flags were checked")
    out = tmp_path / "run"
    with pytest.raises(ValueError, match=re.escape(message)):
        pretrain.main(tiny_args(out, data_dir, *extra))
    assert not out.exists()


def test_use_liger_kernel_without_liger_or_a_gpu_is_refused_before_data_is_read(
    tmp_path: Path, data_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    forbid(monkeypatch, sources, "load_raw_datasets", "data was loaded before --use_liger_kernel was checked")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if importlib.util.find_spec("liger_kernel") is None:
        message = "--use_liger_kernel needs liger-kernel: `pip install liger-kernel`"
    else:
        message = "--use_liger_kernel runs Liger's Triton kernels, which need a GPU, and this run is on the CPU"
    out = tmp_path / "run"
    with pytest.raises(ValueError, match=re.escape(message)):
        pretrain.main(tiny_args(out, data_dir, "--use_liger_kernel", "true", "--use_cpu", "true"))
    assert not out.exists()


def test_a_flag_that_training_arguments_rejects_is_one_error_line(tmp_path: Path, data_dir: Path, capsys) -> None:
    from archlab.scripts.arguments import run_cli

    with pytest.raises(SystemExit) as exit_:
        run_cli(lambda: pretrain.main(tiny_args(tmp_path / "run", data_dir, "--warmup_steps", "-3")))
    assert exit_.value.code == 2
    assert capsys.readouterr().err.startswith("error: Got warmup_steps = -3")


def test_a_finished_model_is_not_replaced(tmp_path: Path, data_dir: Path) -> None:
    """A folder holding a final model but no checkpoint (a run with --save_strategy no) is refused like one with
    checkpoints."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.json").write_text("{}")
    (out / "model.safetensors").write_bytes(b"weights")
    with pytest.raises(ValueError, match="already holds a finished model: pass --overwrite_output_dir true"):
        pretrain.main(tiny_args(out, data_dir, "--save_strategy", "no"))
    with pytest.raises(FileNotFoundError, match="holds a finished model but has no checkpoint-N folder"):
        pretrain.main(tiny_args(out, data_dir, "--resume_from_checkpoint", "true"))
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    assert (out / "model.safetensors").read_bytes() == b"weights"


def test_existing_checkpoints_need_resume_or_overwrite(tmp_path: Path, data_dir: Path) -> None:
    out = tmp_path / "run"
    (out / "checkpoint-3").mkdir(parents=True)
    with pytest.raises(ValueError, match="already holds checkpoint-3"):
        pretrain.main(tiny_args(out, data_dir))
    with pytest.raises(ValueError, match="Conflicting flags: --resume_from_checkpoint and --overwrite_output_dir"):
        pretrain.main(tiny_args(out, data_dir, "--resume_from_checkpoint", "true", "--overwrite_output_dir", "true"))
    assert os.listdir(out) == ["checkpoint-3"]


KILLER = """
import os, signal, sys
from transformers import TrainerCallback
from archlab.scripts import pretrain

class KillAfterStep(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == int(os.environ["KILL_AT_STEP"]):
            os.kill(os.getpid(), signal.SIGKILL)

pretrain.main(sys.argv[1:], callbacks=[KillAfterStep()])
"""


@pytest.mark.slow
def test_resume_after_sigkill_ends_where_an_uninterrupted_run_ends(tmp_path: Path, data_dir: Path) -> None:
    common = (
        "--max_steps",
        "8",
        "--save_steps",
        "2",
        "--eval_strategy",
        "no",
        "--tokenizer_name",
        str(data_dir / "tokenizer"),
        "--save_total_limit",
        "3",
    )
    reference = tmp_path / "reference"
    pretrain.main(tiny_args(reference, data_dir, *common))

    out = tmp_path / "killed"
    env = {**os.environ, "KILL_AT_STEP": "5"}
    run = subprocess.run(
        [sys.executable, "-c", KILLER, *tiny_args(out, data_dir, *common)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == -9, run.stderr[-2000:]
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    assert not (out / "config.json").exists()  # no final model from a killed run
    (out / ".staging" / "checkpoint-6").mkdir(parents=True)  # as if killed in the middle of the next save

    metrics = pretrain.main(tiny_args(out, data_dir, *common, "--resume_from_checkpoint", "true"))
    assert not (out / ".staging").exists()
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["global_step"] == 8
    resumed, uninterrupted = load_file(out / "model.safetensors"), load_file(reference / "model.safetensors")
    assert resumed.keys() == uninterrupted.keys()
    for name in resumed:
        torch.testing.assert_close(resumed[name], uninterrupted[name], atol=1e-6, rtol=1e-5)
    reference_metrics = json.loads((reference / "all_results.json").read_text())
    assert metrics["eval_loss"] == pytest.approx(reference_metrics["eval_loss"], abs=1e-6)


# A constant learning rate: a run of 4 steps resumed to 6 trains what one run of 6 steps trains. Logging every 3 steps
# and saving every 2 leaves checkpoint steps that only the log at each save covers.
RESUMABLE = (
    "--eval_strategy",
    "no",
    "--lr_scheduler_type",
    "constant",
    "--save_steps",
    "2",
    "--logging_steps",
    "3",
    "--tokenizer_vocab_size",
    "300",
)


@pytest.mark.slow
def test_resume_reuses_the_saved_tokenizer_and_reports_the_whole_runs_loss(
    tmp_path: Path, data_dir: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture
) -> None:
    uninterrupted = pretrain.main(tiny_args(tmp_path / "reference", data_dir, *RESUMABLE, "--max_steps", "6"))
    out = tmp_path / "run"
    pretrain.main(tiny_args(out, data_dir, *RESUMABLE, "--max_steps", "4"))
    forbid(monkeypatch, pretraining, "train_tokenizer", "the resumed run trained a new tokenizer, not the checkpoint's")
    warnings = []  # transformers' loggers do not propagate to pytest's capture
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("transformers.trainer").addHandler(handler)
    capfd.readouterr()
    try:
        metrics = pretrain.main(
            tiny_args(out, data_dir, *RESUMABLE, "--max_steps", "6", "--resume_from_checkpoint", "true")
        )
    finally:
        logging.getLogger("transformers.trainer").removeHandler(handler)
    assert "Using the tokenizer saved in" in capfd.readouterr().out
    assert not [w for w in warnings if "missing keys" in w], warnings  # the tied head loads with the embedding
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == 6
    # train_loss is the mean over all 6 steps (the Trainer's own averages the 2 resumed steps only)
    assert metrics["train_loss"] == pytest.approx(uninterrupted["train_loss"], rel=1e-5)
    assert json.loads((out / "all_results.json").read_text())["train_loss"] == metrics["train_loss"]


@pytest.mark.slow
def test_a_resumed_masked_lm_run_masks_and_ends_as_an_uninterrupted_one(tmp_path: Path, data_dir: Path) -> None:
    """The collator drew its masks from the global RNG one batch ahead of training, and a resume skips the trained
    batches without collating them: the resumed steps trained on other masks (and other dropout), and the final
    weights differed from an uninterrupted run's by up to 6e-3."""
    tokenizer = tmp_path / "tokenizer"
    save_tokenizer(train_tokenizer(code_texts(60), "masked_lm", vocab_size=300, min_frequency=1), tokenizer)
    common = (*RESUMABLE[:-2], "--model_kind", "masked_lm", "--tokenizer_name", str(tokenizer), "--logging_steps", "1")

    def args(out: Path, *extra: str) -> list[str]:
        values = tiny_args(out, data_dir, *common, *extra)
        values[values.index(TINY_DECODER_OVERRIDES)] = TINY_SEQ2SEQ_OVERRIDES  # dropout 0.1 as well
        return values

    pretrain.main(args(tmp_path / "reference", "--max_steps", "6"))
    out = tmp_path / "run"
    pretrain.main(args(out, "--max_steps", "4"))
    pretrain.main(args(out, "--max_steps", "6", "--resume_from_checkpoint", "true"))

    def losses(folder: Path) -> dict[int, float]:
        history = json.loads((folder / "trainer_state.json").read_text())["log_history"]
        return {entry["step"]: entry["loss"] for entry in history if "loss" in entry}

    assert losses(out) == pytest.approx(losses(tmp_path / "reference"), rel=1e-6)
    resumed = load_file(out / "model.safetensors")
    uninterrupted = load_file(tmp_path / "reference" / "model.safetensors")
    for name in uninterrupted:
        torch.testing.assert_close(resumed[name], uninterrupted[name], atol=1e-6, rtol=1e-5)


@pytest.mark.slow
def test_a_masked_lm_run_resumed_with_another_split_of_its_batch_ends_as_an_uninterrupted_one(
    tmp_path: Path, data_dir: Path
) -> None:
    """A resume may split the same examples per step otherwise (2 rows x 2 accumulated instead of 4 x 1); the masks
    were drawn per process and micro-batch, so the resumed steps trained on other masks than the uninterrupted run
    (dropout off here: it draws by micro-batch)."""
    tokenizer = tmp_path / "tokenizer"
    save_tokenizer(train_tokenizer(code_texts(60), "masked_lm", vocab_size=300, min_frequency=1), tokenizer)
    common = (*RESUMABLE[:-2], "--model_kind", "masked_lm", "--tokenizer_name", str(tokenizer), "--logging_steps", "1")

    def args(out: Path, *extra: str) -> list[str]:
        values = tiny_args(out, data_dir, *common, *extra)
        values[values.index(TINY_DECODER_OVERRIDES)] = f"{TINY_SEQ2SEQ_OVERRIDES},dropout=0.0"
        return values

    pretrain.main(args(tmp_path / "reference", "--max_steps", "4"))
    out = tmp_path / "run"
    pretrain.main(args(out, "--max_steps", "2"))
    split = ("--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2")
    pretrain.main(args(out, "--max_steps", "4", "--resume_from_checkpoint", "true", *split))
    resumed = load_file(out / "model.safetensors")
    uninterrupted = load_file(tmp_path / "reference" / "model.safetensors")
    for name in uninterrupted:
        torch.testing.assert_close(resumed[name], uninterrupted[name], atol=1e-6, rtol=1e-5)


@pytest.mark.slow
def test_resuming_with_another_batch_block_size_or_column_is_refused_before_data_is_read(
    tmp_path: Path, data_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Trainer skips as many batches of the resumed run's own size as the checkpoint trained: another
    --block_size or --gradient_accumulation_steps resumed without a word (another batch size with a warning only),
    skipping data never trained; another --text_column_name trained the rest of the run on other texts."""
    out = tmp_path / "run"
    common = (*RESUMABLE[:-2], "--tokenizer_name", str(data_dir / "tokenizer"))
    pretrain.main(tiny_args(out, data_dir, *common, "--max_steps", "2"))
    resume = (*common, "--max_steps", "4", "--resume_from_checkpoint", "true")
    with monkeypatch.context() as patched:
        forbid(patched, sources, "load_raw_datasets", "data was loaded before the checkpoint's run was compared")
        for extra, message in [
            (("--block_size", "64"), "trained with --block_size = 32, but these flags give 64"),
            (("--gradient_accumulation_steps", "2"), "--gradient_accumulation_steps x processes = 4, but .* give 8"),
            (("--per_device_train_batch_size", "8"), "x processes = 4, but these flags give 8"),
            (("--text_column_name", "body"), "the data columns = --text_column_name 'text', but .* 'body'"),
        ]:
            with pytest.raises(ValueError, match=message):
                pretrain.main(tiny_args(out, data_dir, *resume, *extra))
    # the same examples per step in other micro-batches go on where the checkpoint stopped
    pretrain.main(
        tiny_args(out, data_dir, *resume, "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2")
    )
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == 4


@pytest.mark.slow
def test_a_resumed_stream_shorter_than_the_run_goes_on_where_it_stopped(tmp_path: Path, data_dir: Path) -> None:
    """5 documents stream 3 batches a pass. The Trainer took a pass to be --max_steps long: resumed at step 4 (one
    batch into the second pass) it skipped 4 batches of the first pass, ran past its end and began the second pass
    from its first batch, training other batches than an uninterrupted run."""
    common = (*RESUMABLE[:-2], "--streaming", "true", "--max_train_samples", "5", "--logging_steps", "1")
    common += ("--tokenizer_name", str(data_dir / "tokenizer"))
    reference = tmp_path / "reference"
    pretrain.main(tiny_args(reference, data_dir, *common, "--max_steps", "6"))
    out = tmp_path / "run"
    pretrain.main(tiny_args(out, data_dir, *common, "--max_steps", "4"))
    pretrain.main(tiny_args(out, data_dir, *common, "--max_steps", "6", "--resume_from_checkpoint", "true"))

    def logged(folder: Path) -> list[float]:
        """step, loss and epoch of each logged step"""
        history = json.loads((folder / "trainer_state.json").read_text())["log_history"]
        entries = [entry for entry in history if "loss" in entry]
        return [value for entry in entries for value in (entry["step"], entry["loss"], entry["epoch"])]

    assert logged(reference)[2:12:3] == pytest.approx([1 / 6, 2 / 6, 0.5, 1 + 1 / 6])
    assert logged(out)[12:] == pytest.approx(logged(reference)[12:], rel=1e-6)
    resumed, uninterrupted = load_file(out / "model.safetensors"), load_file(reference / "model.safetensors")
    for name in uninterrupted:
        torch.testing.assert_close(resumed[name], uninterrupted[name], atol=1e-6, rtol=1e-5)


@pytest.mark.slow
def test_resuming_a_finished_run_changes_nothing(tmp_path: Path, data_dir: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "run"
    tokenizer = str(data_dir / "tokenizer")
    args = tiny_args(out, data_dir, *RESUMABLE[:-2], "--max_steps", "4", "--tokenizer_name", tokenizer)
    metrics = pretrain.main(args)
    written = {path: path.stat().st_mtime_ns for path in out.rglob("*")}
    capsys.readouterr()
    again = pretrain.main(args + ["--resume_from_checkpoint", "true"])
    assert "checkpoint-4 is at step 4 of --max_steps 4: the run is finished" in capsys.readouterr().out
    assert {path: path.stat().st_mtime_ns for path in out.rglob("*")} == written
    assert again == pytest.approx(metrics)

    # killed after its last checkpoint, before the final save: the resume saves the final model without training
    for path in out.iterdir():
        if not path.name.startswith("checkpoint-"):
            path.unlink()
    pretrain.main(args + ["--resume_from_checkpoint", "true"])
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == 4
    assert sorted(path.name for path in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    final, checkpoint = load_file(out / "model.safetensors"), load_file(out / "checkpoint-4" / "model.safetensors")
    assert final.keys() == checkpoint.keys() and all(torch.equal(final[k], checkpoint[k]) for k in final)


def test_config_from_preset_json_and_overrides(tmp_path: Path, data_dir: Path) -> None:
    from archlab.scripts.arguments import ModelArguments
    from archlab.tokenization.training import load_tokenizer
    from archlab.training.configs import build_config

    tokenizer = load_tokenizer(data_dir / "tokenizer")
    config = build_config(ModelArguments(preset="tiny", config_overrides="num_hidden_layers=2"), tokenizer, 64)
    assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (128, 2, len(tokenizer))
    assert (config.pad_token_id, config.bos_token_id, config.eos_token_id) == (0, 1, 2)
    path = tmp_path / "config.json"
    config.to_json_file(path)
    again = build_config(ModelArguments(config_name=str(path)), tokenizer, 64)
    assert again.to_dict() == config.to_dict()
    with pytest.raises(ValueError, match="Unknown preset 'huge'"):
        build_config(ModelArguments(preset="huge"), tokenizer, 64)
    with pytest.raises(ValueError, match="not of the form key=value"):
        build_config(ModelArguments(config_overrides="hidden_size"), tokenizer, 64)


def _config_choices(config_name: str, overrides: str = "", kind: str = "decoder"):
    from archlab.scripts.arguments import ModelArguments

    return ModelArguments(model_kind=kind, config_name=config_name, config_overrides=overrides)


def test_a_rope_theta_override_sets_the_base_of_a_preset_or_config_file(tmp_path: Path) -> None:
    """`--preset llama-2-7b --config_overrides rope_theta=500000` (run_clm.py's flag, RoPE's legacy name): the
    preset's `rope_parameters` takes the new base (it was dropped without a word, then refused as a disagreement)."""
    import archlab
    from archlab.scripts.arguments import ModelArguments
    from archlab.training.configs import new_config_values

    values, _, user_set = new_config_values(ModelArguments(preset="llama-2-7b", config_overrides="rope_theta=5e5"))
    assert values["rope_parameters"] == {"rope_type": "default", "rope_theta": 5e5} and "rope_theta" not in values
    assert "rope_parameters" in user_set
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}}))
    values, _, _ = new_config_values(_config_choices(str(path), 'rope_scaling={"rope_type":"linear","factor":2}'))
    assert values["rope_parameters"] == {"rope_type": "linear", "rope_theta": 1e6, "factor": 2}
    shape = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 4}
    config = archlab.DecoderConfig(**{**values, **shape, "vocab_size": 64})
    assert config.rope_parameters["rope_theta"] == 1e6


@pytest.mark.parametrize(
    ("trained", "resumed"),
    [
        ("rope_theta=1000000", "rope_theta=500000"),
        ('rope_scaling={"rope_type":"linear","factor":2.0}', 'rope_scaling={"rope_type":"linear","factor":4.0}'),
        ("partial_rotary_factor=0.5", "partial_rotary_factor=0.25"),
    ],
    ids=["rope_theta", "rope_scaling", "partial_rotary_factor"],
)
def test_resuming_with_another_legacy_rope_override_is_refused(tmp_path: Path, trained: str, resumed: str) -> None:
    """With no preset or config file there is no `rope_parameters` for a legacy override to change: it stays under
    its own name, which the checkpoint's config.json does not hold (it saves `rope_parameters`), and a resume with
    another base, scaling or partial factor went on, the weights read at other positions, without a word."""
    import archlab
    from archlab.scripts.arguments import ModelArguments
    from archlab.training.configs import check_resumed_config, new_config_values

    values, _, _ = new_config_values(ModelArguments(config_overrides=trained))
    archlab.DecoderConfig(**values, vocab_size=64).save_pretrained(tmp_path)
    check_resumed_config(ModelArguments(config_overrides=trained), str(tmp_path))
    with pytest.raises(ValueError, match="holds a model with rope_parameters=.* these flags build rope_parameters="):
        check_resumed_config(ModelArguments(config_overrides=resumed), str(tmp_path))


@pytest.mark.parametrize(
    ("trained", "resumed"),
    [
        (f"{TINY_DECODER_OVERRIDES},sliding_window=8", TINY_DECODER_OVERRIDES),
        (TINY_DECODER_OVERRIDES, f"{TINY_DECODER_OVERRIDES},sliding_window=8"),
        (f"{TINY_DECODER_OVERRIDES},norm_position=sandwich", TINY_DECODER_OVERRIDES),
    ],
    ids=["override-left-out", "override-added", "placement-left-out"],
)
def test_resuming_without_an_override_the_run_had_is_refused(tmp_path: Path, trained: str, resumed: str) -> None:
    """Only the fields the resumed run's flags set were compared: trained with `sliding_window=8` and resumed
    without it (or the other way round: a config.json leaves out the fields at their defaults), the run went on with
    another model on the same weights, without a word."""
    import archlab
    from archlab.scripts.arguments import ModelArguments
    from archlab.training.configs import check_resumed_config, new_config_values

    values, _, _ = new_config_values(ModelArguments(config_overrides=trained))
    archlab.DecoderConfig(**values, vocab_size=64, pad_token_id=0).save_pretrained(tmp_path)
    check_resumed_config(ModelArguments(config_overrides=trained), str(tmp_path))
    with pytest.raises(ValueError, match="holds a model with .*(sliding_window=|norm_position=)"):
        check_resumed_config(ModelArguments(config_overrides=resumed), str(tmp_path))


def test_a_config_file_of_another_kind_or_with_unknown_fields_is_refused(tmp_path: Path) -> None:
    """A config stores unknown keys without a word: a seq2seq config.json given to a decoder run built the default
    decoder (LLaMA-7B's shape) and was killed for memory; a typo trained the default shape."""
    from archlab.training.configs import new_config_values

    seq2seq = tmp_path / "seq2seq.json"
    seq2seq.write_text(json.dumps({"model_type": "archlab_seq2seq", "d_model": 32}))
    with pytest.raises(ValueError, match="is a `archlab_seq2seq` config, but --model_kind decoder"):
        new_config_values(_config_choices(str(seq2seq)))
    typo = tmp_path / "typo.json"
    typo.write_text(json.dumps({"hidden_sz": 32}))
    with pytest.raises(ValueError, match="no field 'hidden_sz' \\(did you mean 'hidden_size'\\?\\)"):
        new_config_values(_config_choices(str(typo)))
    broken = tmp_path / "broken.json"
    broken.write_text("{broken")
    with pytest.raises(ValueError, match="is not a JSON config"):
        new_config_values(_config_choices(str(broken)))


def test_overrides_of_a_saved_config_rederive_its_per_layer_lists(tmp_path: Path) -> None:
    """A saved config spells out `layer_types` and `mlp_layer_types`: kept, `num_local_experts=4` built a dense model
    and `num_hidden_layers=3` failed on a list the user never wrote."""
    import archlab
    from archlab.training.configs import new_config_values

    archlab.DecoderConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1
    ).save_pretrained(tmp_path)
    values, _, _ = new_config_values(_config_choices(str(tmp_path), "num_local_experts=4,num_experts_per_tok=2"))
    assert archlab.DecoderConfig(**values).mlp_layer_types == ["sparse", "sparse"]
    values, _, _ = new_config_values(_config_choices(str(tmp_path), "num_hidden_layers=3"))
    assert archlab.DecoderConfig(**values).layer_types == ["full_attention"] * 3
    hand_made = ["sliding_attention", "full_attention"]
    archlab.DecoderConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, sliding_window=4, layer_types=hand_made
    ).save_pretrained(tmp_path)
    values, _, _ = new_config_values(_config_choices(str(tmp_path)))
    assert values["layer_types"] == hand_made


def test_overwrite_removes_the_markers_of_an_earlier_finished_model(tmp_path: Path) -> None:
    """Left in place, an earlier run's `config.json` and `trainer_state.json` made a new run that crashed before its
    final save look finished, and a resume handed back the earlier run's model."""
    from archlab.training.checkpoints import clear_output_dir

    for name in ("config.json", "trainer_state.json", "model.safetensors", "notes.txt"):
        (tmp_path / name).write_text("{}")
    (tmp_path / "checkpoint-3").mkdir()
    clear_output_dir(str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors", "notes.txt"]


def test_overwrite_tolerates_another_process_clearing_the_same_folder(tmp_path: Path, monkeypatch) -> None:
    """Under torchrun every process runs `clear_output_dir` at once: a marker file another process removed between
    the check and the removal was a FileNotFoundError (a traceback) in this one."""
    from archlab.training import checkpoints

    for name in ("config.json", "trainer_state.json"):
        (tmp_path / name).write_text("{}")
    (tmp_path / "checkpoint-3").mkdir()
    isfile = os.path.isfile

    def removed_by_the_other_process(path):
        exists = isfile(path)
        if exists and os.path.basename(path) in checkpoints.FINISHED_MARKERS:
            os.remove(path)
        return exists

    monkeypatch.setattr(checkpoints.os.path, "isfile", removed_by_the_other_process)
    checkpoints.clear_output_dir(str(tmp_path))
    assert list(tmp_path.iterdir()) == []


def test_config_overrides_take_json_lists_and_objects() -> None:
    from archlab.training.configs import parse_overrides

    text = (
        'num_hidden_layers=2,layer_types=["sliding_attention","full_attention"],rope_parameters={"rope_type":'
        '"linear","factor":2.0},sliding_window=8,note="a,b"'
    )
    assert parse_overrides(text) == {
        "num_hidden_layers": 2,
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {"rope_type": "linear", "factor": 2.0},
        "sliding_window": 8,
        "note": "a,b",
    }


def test_pretrain_streaming(tmp_path: Path, data_dir: Path) -> None:
    out = tmp_path / "streamed"
    metrics = pretrain.main(
        tiny_args(
            out,
            data_dir,
            "--streaming",
            "true",
            "--tokenizer_name",
            str(data_dir / "tokenizer"),
            "--max_steps",
            "3",
            "--eval_steps",
            "3",
        )
    )
    assert metrics["eval_loss"] == metrics["eval_loss"] and (out / "model.safetensors").exists()
    args = tiny_args(tmp_path / "x", data_dir, "--model_name_or_path", "runs/missing-model")
    position = args.index("--config_overrides")
    del args[position : position + 2]
    with pytest.raises(OSError, match="'runs/missing-model' is neither a local folder nor loadable from the Hub"):
        pretrain.main(args)
    assert not (tmp_path / "x").exists()


@pytest.mark.slow
def test_torch_compile_compiles_regionally_and_trains_as_eager(tmp_path: Path, data_dir: Path, monkeypatch) -> None:
    """`--torch_compile` goes through accelerate's regional compilation (one compile of the repeated block, reused
    by every layer) and the compiled run's per-step losses are the eager run's."""
    import accelerate.accelerator

    compiled_regions = []
    original = accelerate.accelerator.compile_regions

    def recording(model, **kwargs):
        compiled_regions.append(type(model).__name__)
        return original(model, **kwargs)

    monkeypatch.setattr(accelerate.accelerator, "compile_regions", recording)
    # the flag sets accelerate's environment variable; monkeypatch removes it again after the test
    monkeypatch.delenv("ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION", raising=False)
    losses = {}
    for name, extra in (("eager", ()), ("compiled", ("--torch_compile", "true"))):
        out = tmp_path / name
        pretrain.main(tiny_args(out, data_dir, "--max_steps", "3", "--eval_steps", "3", *extra))
        history = json.loads((out / "trainer_state.json").read_text())["log_history"]
        losses[name] = [entry["loss"] for entry in history if "loss" in entry]
    assert compiled_regions == ["DecoderForCausalLM"]
    assert len(losses["compiled"]) == 3
    assert losses["compiled"] == pytest.approx(losses["eager"], rel=1e-4)


def test_push_to_hub_pushes_the_finished_model(tmp_path: Path, data_dir: Path, monkeypatch) -> None:
    """The script saves its final model itself, not through `Trainer.push_to_hub`: with --push_to_hub the run pushed
    its checkpoints and never the finished folder (run_clm.py pushes it at the end)."""

    class NoHub:  # the checkpoints' pushes, without a network
        def create_repo(self, name, **kwargs):
            return types.SimpleNamespace(repo_id=name)

        def upload_folder(self, **kwargs):
            done = concurrent.futures.Future()
            done.set_result(None)
            return done

    pushed = []
    monkeypatch.setattr(transformers.trainer, "hf_api", NoHub)
    monkeypatch.setattr(hub, "push", lambda folder, repo_id, **kwargs: pushed.append((folder, repo_id, kwargs)))
    out = tmp_path / "run"
    extra = ("--tokenizer_name", str(data_dir / "tokenizer"), "--max_steps", "2", "--eval_strategy", "no")
    pretrain.main(tiny_args(out, data_dir, *extra, "--push_to_hub", "true", "--hub_model_id", "someone/tiny"))
    assert [(folder, repo_id) for folder, repo_id, _ in pushed] == [(str(out), "someone/tiny")]
    assert (out / "config.json").is_file()  # pushed once the folder is complete


def test_a_sample_past_a_position_table_is_refused_before_training(tmp_path: Path, data_dir: Path) -> None:
    """A learned table of 32 positions and --sample_max_new_tokens 40: the run trained and saved, then the sample
    failed at the position past the table and the script exited with an error; the flag is named before training."""
    out = tmp_path / "run"
    args = tiny_args(out, data_dir, "--tokenizer_name", str(data_dir / "tokenizer"))
    args[args.index("--config_overrides") + 1] += ",position_embedding_type=learned,max_position_embeddings=32"
    args[args.index("--sample_max_new_tokens") + 1] = "40"
    with pytest.raises(
        ValueError,
        match="--sample_max_new_tokens 40 is past the model's learned position table .* "
        "give --sample_max_new_tokens 3[01] or fewer",
    ):
        pretrain.main(args)
    assert not out.exists()


def test_mlm_probability_is_the_masked_share_of_a_masked_lm_run(tmp_path: Path, data_dir: Path, monkeypatch) -> None:
    """run_mlm.py's --mlm_probability was an unknown flag, and the collator masked 15 % whatever a run wanted."""
    args = tiny_args(tmp_path / "run", data_dir, "--model_kind", "masked_lm", "--tokenizer_vocab_size", "300")
    args[args.index(TINY_DECODER_OVERRIDES)] = TINY_SEQ2SEQ_OVERRIDES
    prepared = {}

    def prepare_then_stop(*args, **kwargs):
        prepared.update(pretraining.prepare_data(*args, **kwargs))
        raise KeyboardInterrupt

    monkeypatch.setattr(pretrain, "prepare_data", prepare_then_stop)
    with pytest.raises(KeyboardInterrupt):
        pretrain.main([*args, "--mlm_probability", "0.4"])
    assert prepared["collator"].mlm_probability == 0.4


@pytest.mark.parametrize(
    "extra, message",
    [
        (
            ["--mlm_probability", "0.3"],
            "--mlm_probability masks a masked LM's tokens: it is for --model_kind masked_lm",
        ),
        (["--model_kind", "masked_lm", "--mlm_probability", "1.5"], r"--mlm_probability must be in \(0, 1\)"),
    ],
)
def test_an_mlm_probability_that_masks_nothing_is_refused_before_data_is_read(
    tmp_path: Path, data_dir: Path, monkeypatch, extra: list[str], message: str
) -> None:
    forbid(monkeypatch, sources, "load_raw_datasets", "data was loaded before --mlm_probability was checked")
    args = tiny_args(tmp_path / "run", data_dir, *extra)
    if "masked_lm" in extra:
        args[args.index(TINY_DECODER_OVERRIDES)] = TINY_SEQ2SEQ_OVERRIDES
    with pytest.raises(ValueError, match=message):
        pretrain.main(args)
