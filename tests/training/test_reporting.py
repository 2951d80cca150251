"""training/reporting.py: the line that says how a run trains, as the scripts resolved its flags."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from archlab.scripts.pretrain import PretrainTrainingArguments
from archlab.training import reporting


def test_a_cpu_run_says_float32_and_eager(tmp_path):
    args = PretrainTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    assert reporting.training_setup(args) == "Training on the CPU: float32, eager (no compilation)"


def test_weights_that_are_not_float32_are_named_with_the_autocast(tmp_path):
    """--dtype bfloat16 trains bfloat16 weights: "float32" would say otherwise."""
    args = PretrainTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    assert (
        reporting.training_setup(args, torch.bfloat16)
        == "Training on the CPU: bfloat16 weights, eager (no compilation)"
    )
    args.bf16 = True
    assert reporting.training_setup(args, torch.bfloat16).startswith(
        "Training on the CPU: bfloat16 weights, bf16 autocast"
    )
    assert reporting.training_setup(args, torch.float32).startswith("Training on the CPU: bf16 autocast, eager")


def test_a_gpu_run_names_the_gpu_precision_processes_and_compilation(monkeypatch):
    """What the scripts resolve on a bf16 GPU by default (the GPU's name stood in for here)."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA H100 80GB HBM3")
    args = SimpleNamespace(
        device=torch.device("cuda", 0),
        world_size=2,
        bf16=True,
        fp16=False,
        torch_compile=True,
        regional_compilation=True,
    )
    line = reporting.training_setup(args)
    assert line.startswith(
        "Training on cuda:0 (NVIDIA H100 80GB HBM3), 2 processes: bf16 autocast, compiled regionally"
    )
    assert "wait for the compiler" in line
    args.torch_compile, args.regional_compilation, args.bf16, args.fp16 = True, False, False, True
    assert reporting.training_setup(args).endswith("fp16 autocast, compiled; the first steps wait for the compiler")


def test_log_lines_are_printed_by_the_first_process_only(monkeypatch, capsys):
    """Under torchrun every process printed every `[archlab]` line (the tests/integration/test_distributed_scripts.py
    runs count them across processes)."""
    for rank, printed in (("0", "[archlab] hello\n"), ("1", "")):
        monkeypatch.setenv("RANK", rank)
        reporting.log("hello")
        assert capsys.readouterr().out == printed
    monkeypatch.delenv("RANK")
    reporting.log("alone")
    assert capsys.readouterr().out == "[archlab] alone\n"
