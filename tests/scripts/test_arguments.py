"""scripts/arguments.py: what the training scripts share in flag parsing — here, the precision a run picks when
`--bf16` is not given (bf16 on a CUDA GPU that has it, float32 elsewhere) and bare boolean flags whose default is
decided later."""

from __future__ import annotations

import json

import pytest
import torch

from archlab.scripts.arguments import (
    bf16_by_default,
    check_training_flags,
    compile_by_default,
    given_flags,
    on_a_cuda_gpu,
    parse_arguments,
)
from archlab.scripts.finetune import FinetuneTrainingArguments
from archlab.scripts.pretrain import PretrainTrainingArguments


@pytest.fixture
def bf16_gpu(monkeypatch):
    """Pretend to be on an Ampere-or-newer CUDA machine (the decision reads only these two)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True)


def test_bf16_and_pinned_memory_are_the_defaults_on_a_gpu_only(bf16_gpu, monkeypatch):
    assert on_a_cuda_gpu(use_cpu=False) and not on_a_cuda_gpu(use_cpu=True)
    assert bf16_by_default(use_cpu=False, fp16=False)
    assert not bf16_by_default(use_cpu=True, fp16=False)  # --use_cpu: float32
    assert not bf16_by_default(use_cpu=False, fp16=True)  # --fp16 wins
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: False)
    assert not bf16_by_default(use_cpu=False, fp16=False)  # pre-Ampere GPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not bf16_by_default(use_cpu=False, fp16=False)  # CPU-only machine


@pytest.mark.parametrize("arguments", [PretrainTrainingArguments, FinetuneTrainingArguments])
def test_scripts_train_in_float32_on_the_cpu_unless_asked(arguments):
    assert parse_arguments([arguments], [])[0].bf16 is False
    assert parse_arguments([arguments], [])[0].dataloader_pin_memory is False
    assert parse_arguments([arguments], ["--dataloader_pin_memory"])[0].dataloader_pin_memory is True
    assert parse_arguments([arguments], ["--use_cpu", "--bf16"])[0].bf16 is True  # a bare flag is true
    assert parse_arguments([arguments], ["--bf16", "false"])[0].bf16 is False


@pytest.mark.parametrize("arguments", [PretrainTrainingArguments, FinetuneTrainingArguments])
def test_the_default_is_asked_only_when_bf16_is_not_given(arguments, monkeypatch):
    """The scripts' arguments consult `bf16_by_default` (faked here: a GPU cannot be faked far enough for
    TrainingArguments to set up its device) when --bf16 is absent, and an explicit value wins over it."""
    import archlab.scripts.arguments as module

    monkeypatch.setattr(module, "bf16_by_default", lambda use_cpu, fp16: True)
    assert parse_arguments([arguments], ["--use_cpu"])[0].bf16 is True
    assert parse_arguments([arguments], ["--use_cpu", "--bf16", "false"])[0].bf16 is False


@pytest.mark.parametrize("arguments", [PretrainTrainingArguments, FinetuneTrainingArguments])
def test_bf16_without_a_bf16_gpu_points_to_use_cpu(arguments, monkeypatch):
    import archlab.scripts.arguments as module

    monkeypatch.setattr(module, "is_torch_bf16_gpu_available", lambda: False)
    with pytest.raises(ValueError, match=r"--bf16 true needs a GPU with bf16 support.*add --use_cpu true"):
        parse_arguments([arguments], ["--bf16", "true"])
    assert parse_arguments([arguments], ["--bf16", "true", "--use_cpu", "true"])[0].bf16 is True


@pytest.mark.parametrize(
    "flags, warned",
    [
        (["--max_steps", "10"], True),  # the default 30 warm-up steps
        (["--max_steps", "30", "--warmup_steps", "30"], True),
        (["--max_steps", "31"], False),
        (["--max_steps", "10", "--warmup_steps", "0.1"], False),  # a fraction of the run
        (["--max_steps", "-1"], False),  # epochs: the length is known only once the data is
    ],
)
def test_a_warmup_as_long_as_the_run_is_named_once(flags, warned, capsys):
    check_training_flags(parse_arguments([PretrainTrainingArguments], ["--use_cpu", *flags])[0])
    out = capsys.readouterr().out
    assert ("never reaches --learning_rate" in out) is warned
    assert out.count("\n") == int(warned)


def test_compilation_is_the_default_on_a_gpu_triton_supports(monkeypatch):
    import torch.utils._triton as triton_support

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(triton_support, "has_triton", lambda: True)
    assert compile_by_default(use_cpu=False, deepspeed=None, fsdp="")
    assert not compile_by_default(use_cpu=True, deepspeed=None, fsdp="")  # --use_cpu
    assert not compile_by_default(use_cpu=False, deepspeed="configs/deepspeed/zero2.json", fsdp="")
    assert not compile_by_default(use_cpu=False, deepspeed=None, fsdp="full_shard")
    monkeypatch.setattr(triton_support, "has_triton", lambda: False)  # e.g. a GPU older than Volta
    assert not compile_by_default(use_cpu=False, deepspeed=None, fsdp="")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not compile_by_default(use_cpu=False, deepspeed=None, fsdp="")


@pytest.mark.parametrize("arguments", [PretrainTrainingArguments, FinetuneTrainingArguments])
def test_compilation_default_is_asked_only_when_the_flag_is_not_given(arguments, monkeypatch):
    import archlab.scripts.arguments as module

    assert parse_arguments([arguments], [])[0].torch_compile is False  # this CPU machine
    monkeypatch.setattr(module, "compile_by_default", lambda use_cpu, deepspeed, fsdp: True)
    assert parse_arguments([arguments], ["--use_cpu"])[0].torch_compile is True
    assert parse_arguments([arguments], ["--use_cpu", "--torch_compile", "false"])[0].torch_compile is False
    monkeypatch.setattr(module, "compile_by_default", lambda use_cpu, deepspeed, fsdp: False)
    assert parse_arguments([arguments], ["--use_cpu", "--torch_compile"])[0].torch_compile is True  # a bare flag
    assert parse_arguments([arguments], ["--use_cpu", "--torch_compile_mode", "max-autotune"])[0].torch_compile


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--max_stepz", "5"], "Unknown flags: --max_stepz (did you mean --max_steps?)"),
        (["--max-stepz=5"], "Unknown flags: --max-stepz (did you mean --max_steps?)"),
        (["--zzz", "1"], "Unknown flags: --zzz. `--help` lists every flag."),
        (["stray"], "Unexpected arguments ['stray']: every value follows its --flag."),
        (
            ["--group_by_length", "true"],
            "Unknown flags: --group_by_length (a transformers 4 flag; in transformers 5: --train_sampling_strategy "
            "group_by_length)",
        ),
    ],
)
def test_an_unknown_flag_is_named_with_the_closest_known_ones(argv, message):
    """transformers' own wording ("Some specified arguments are not used by the HfArgumentParser") named no flag
    the user meant."""
    with pytest.raises(ValueError) as raised:
        parse_arguments([PretrainTrainingArguments], argv)
    assert str(raised.value).startswith(message)


def parse_pretrain(argv):
    from archlab.scripts import pretrain

    return pretrain.parse(argv)


def parse_finetune(argv):
    from archlab.scripts import finetune

    return finetune.parse(argv)


def parse_generate(argv):
    from archlab.scripts import generate

    return generate.main(["--model_name_or_path", "missing", *argv])


@pytest.mark.parametrize(
    ("parse", "argv", "message"),
    [
        (
            parse_pretrain,
            ["--token", "hf_x"],
            "--token (a flag of transformers' example scripts; here: leave it out: log",
        ),
        (parse_finetune, ["--token=hf_x"], "--token (a flag of transformers' example scripts; here: leave it out: log"),
        (
            parse_pretrain,
            ["--model_type", "gpt2"],
            "--model_type (a flag of transformers' example scripts; here: a new",
        ),
        (
            parse_pretrain,
            ["--max_seq_length", "128"],
            "--max_seq_length (a flag of transformers' example scripts; here: --block_size",
        ),
        (
            parse_pretrain,
            ["--line_by_line"],
            "--line_by_line (a flag of transformers' example scripts; here: --sample_by line",
        ),
        (
            parse_finetune,
            ["--task_name", "mrpc"],
            "--task_name (a flag of transformers' example scripts; here: --task "
            "classification with --dataset_name nyu-mll/glue",
        ),
        (
            parse_finetune,
            ["--mlm_probability", "0.2"],
            "--mlm_probability (a flag of transformers' example scripts; here: scripts/pretrain.py",
        ),
        (parse_generate, ["--p", "0.9"], "--p (a flag of transformers' example scripts; here: --top_p)"),
        (
            parse_generate,
            ["--length", "20"],
            "--length (a flag of transformers' example scripts; here: --max_new_tokens)",
        ),
        (parse_generate, ["--no_cuda"], "--no_cuda (a flag of transformers' example scripts; here: --device cpu)"),
    ],
)
def test_a_flag_of_transformers_example_scripts_is_named_with_what_to_pass_instead(parse, argv, message):
    """run_clm.py's --token and run_generation.py's --p exited with argparse's usage and "ambiguous option" (prefixes
    of the --tokenizer_* and --prompt* flags), the others failed on "Unknown flags" naming no alternative, and
    generate.py's --no_cuda was pointed to --use_cpu, which generate.py does not have."""
    with pytest.raises(ValueError) as raised:
        parse(argv)
    assert str(raised.value).startswith(f"Unknown flags: {message}")


@pytest.mark.parametrize("parse", [parse_pretrain, parse_finetune])
def test_dtype_and_its_alias_torch_dtype_are_parsed_and_checked_while_parsing(parse):
    """run_clm.py's --torch_dtype / --dtype: refused as a flag these scripts did without; now the dtype a saved
    --model_name_or_path loads in, a value outside run_clm.py's choices named with them while the flags are read."""
    for flag in ("--dtype", "--torch_dtype"):
        assert parse([flag, "bfloat16"])[0].dtype == "bfloat16"
        with pytest.raises(
            ValueError, match="--dtype 'half' is not supported; allowed values: auto, bfloat16, float16"
        ):
            parse([flag, "half"])
    assert parse([])[0].dtype is None


def parse_generate_flags(argv):
    from archlab.scripts.generate import GenerateArguments

    return parse_arguments((GenerateArguments,), argv)


@pytest.mark.parametrize("parse", [parse_pretrain, parse_finetune, parse_generate_flags])
def test_torch_dtype_names_the_dtype_flag_in_a_json_file_of_flags_too(parse, tmp_path):
    """`--torch_dtype` worked on the command line, but a .json file of flags (HfArgumentParser's other form) with a
    `torch_dtype` key was refused as "Some keys are not used by the HfArgumentParser". Both names with other values
    are refused naming both (the command line's twin below)."""
    flags = tmp_path / "flags.json"
    for given in ({"torch_dtype": "bfloat16"}, {"torch_dtype": "bfloat16", "dtype": "bfloat16"}):
        flags.write_text(json.dumps({"model_name_or_path": "m", **given}))
        assert parse([str(flags)])[0].dtype == "bfloat16"
    flags.write_text(json.dumps({"model_name_or_path": "m", "torch_dtype": "half"}))
    with pytest.raises(ValueError, match="--dtype 'half' is not supported; allowed values: auto, bfloat16"):
        parse([str(flags)])
    flags.write_text(json.dumps({"model_name_or_path": "m", "dtype": "float32", "torch_dtype": "bfloat16"}))
    with pytest.raises(ValueError, match=r"Conflicting flags in .*flags.json: 'dtype' 'float32' and 'torch_dtype' "):
        parse([str(flags)])


@pytest.mark.parametrize("parse", [parse_pretrain, parse_finetune, parse_generate_flags])
def test_dtype_and_torch_dtype_together_are_refused_unless_they_agree(parse):
    """`--dtype bfloat16 --torch_dtype float32` loaded float32 weights without a word (argparse's last value wins;
    transformers' `from_pretrained` keeps `dtype` silently): refused naming both; the same value twice is one."""
    model = ["--model_name_or_path", "m"]
    for argv in (["--dtype", "bfloat16", "--torch_dtype", "float32"], ["--torch_dtype=float32", "--dtype=bfloat16"]):
        with pytest.raises(
            ValueError, match=r"Conflicting flags: --\w+ \w+ and --\w+ \w+ \(names of one flag, --dtype"
        ):
            parse([*model, *argv])
    assert parse([*model, "--dtype", "bfloat16", "--torch_dtype", "bfloat16"])[0].dtype == "bfloat16"


@pytest.mark.parametrize("arguments", [PretrainTrainingArguments, FinetuneTrainingArguments])
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--do_eval"], "--do_eval without --do_train: transformers' example scripts would evaluate the model alone"),
        (["--do_eval", "true", "--do_train", "false"], "--do_train false: this script always trains"),
    ],
)
def test_evaluating_without_training_is_refused_not_trained_anyway(arguments, argv, message):
    """run_clm.py / run_glue.py with --do_eval alone evaluate the model as it is; the scripts ignored both flags and
    trained (and wrote --output_dir) without a word."""
    with pytest.raises(ValueError, match=message):
        parse_arguments([arguments], argv)


@pytest.mark.parametrize("arguments", [PretrainTrainingArguments, FinetuneTrainingArguments])
@pytest.mark.parametrize("argv", [[], ["--do_train"], ["--do_train", "--do_eval"]])
def test_the_scripts_train_with_or_without_do_train(arguments, argv):
    args = parse_arguments([arguments], argv)[0]
    assert args.do_train is True
    assert args.do_eval is ("--do_eval" in argv or args.eval_strategy != "no")


@pytest.mark.parametrize(
    ("parse", "argv"),
    [
        (parse_pretrain, ["--eval_max", "3"]),  # --eval_max_blocks
        (parse_finetune, ["--version_2", "true"]),  # --version_2_with_negative
        (parse_generate, ["--prompts", "a"]),  # --prompts_file
    ],
)
def test_a_prefix_of_a_flag_is_not_read_as_that_flag(parse, argv):
    """argparse's abbreviations set the one flag a prefix matched, without a word (--prompts a read a as a file)."""
    with pytest.raises(ValueError, match=f"^Unknown flags: {argv[0]}"):
        parse(argv)


def test_help_that_states_its_own_default_gets_no_second_one(capsys):
    from archlab.scripts.generate import GenerateArguments

    with pytest.raises(SystemExit):
        parse_arguments([GenerateArguments], ["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: true; false with --num_beams)." in text
    assert "--num_beams). (default: None)" not in text
    assert "past its trained length it warns). (default: 100)" in text  # the others keep argparse's default


def test_help_that_states_its_default_in_other_words_gets_no_second_one(capsys):
    """ "unset: 4096" and "Default: on when ..." were followed by "(default: None)", which is not what happens."""
    from archlab.scripts.arguments import ArchlabTrainingArguments, ModelArguments

    with pytest.raises(SystemExit):
        parse_arguments([ModelArguments, ArchlabTrainingArguments], ["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "Vocabulary size to train; unset: 4096. --" in text
    assert "--fp16; --bf16 false turns it off. --" in text
    assert "off on the CPU, where it only costs memory. --" in text
    assert "(default: None)" in text  # flags whose help says nothing of their default keep argparse's


@pytest.mark.parametrize("arguments", [PretrainTrainingArguments, FinetuneTrainingArguments])
def test_help_says_what_the_scripts_do_with_predict_and_resume_flags(arguments, capsys):
    """`--help` gave TrainingArguments' words: `--do_predict` "run predictions on the test set" (pretraining refuses
    it, fine-tuning predicts its --test_file) and `--resume_from_checkpoint` "Path to a folder" (`true` resumes the
    newest; other data flags are refused)."""
    with pytest.raises(SystemExit):
        parse_arguments([arguments], ["--help"])
    text = " ".join(capsys.readouterr().out.split())
    expected = {
        PretrainTrainingArguments: "--do-predict [DO_PREDICT] Refused: this script has no test split to predict",
        FinetuneTrainingArguments: "--do-predict [DO_PREDICT] classification, seq2seq, token-classification, "
        "question-answering:",
    }
    assert expected[arguments] in text
    assert "--resume-from-checkpoint RESUME_FROM_CHECKPOINT true: go on from the newest checkpoint" in text


def test_given_flags_are_the_flags_named_whatever_their_values(tmp_path) -> None:
    """A flag given with its default value is given: the scripts refuse some flags for the wrong task by it."""
    argv = ["--max_seq_length", "384", "--doc-stride=128", "--bf16", "--source_prefix=--x", "value"]
    assert given_flags(argv) == {"max_seq_length", "doc_stride", "bf16", "source_prefix"}
    flags = tmp_path / "flags.json"
    flags.write_text(json.dumps({"task": "classification", "max_seq_length": 384}))
    assert given_flags([str(flags)]) == {"task", "max_seq_length"}
