"""The benchmark tool (scripts/benchmark.py): every suite it names exists, bad arguments fail at parsing, the step
profile adds up, and the dense suite runs end to end at `--quick` size. No timing is asserted anywhere."""

from __future__ import annotations

import importlib

import pytest
import torch

from archlab.scripts import benchmark
from archlab import DecoderForCausalLM
from conftest import tiny_decoder_config


@pytest.mark.parametrize("name", sorted({*benchmark.SUITES, *benchmark.EXTERNAL_SUITES}))
def test_every_named_suite_exists(name):
    if name in benchmark.EXTERNAL_SUITES:
        module = importlib.import_module(f"archlab.scripts.{benchmark.EXTERNAL_SUITES[name]}")
        assert callable(module.run)
    else:
        assert callable(benchmark.SUITES[name])


@pytest.mark.parametrize("argv, message", [
    (["--rounds", "0"], "--rounds must be >= 1"),
    (["--batch-size", "0"], "--batch-size must be >= 1"),
    (["--suite", "nope"], "invalid choice: 'nope'"),
])
def test_bad_arguments_fail_at_parsing(argv, message, capsys):
    with pytest.raises(SystemExit) as error:
        benchmark.main(argv)
    assert error.value.code == 2
    assert message in capsys.readouterr().err


def test_time_breakdown_adds_up_and_sees_the_gemms():
    model = DecoderForCausalLM(tiny_decoder_config())
    ids = torch.randint(3, 97, (2, 16))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    shares = benchmark.time_breakdown(benchmark.training_step(model, {"input_ids": ids, "labels": ids}, optimizer))
    assert set(shares) == {"gemm", "attention", "other"}
    assert shares["gemm"] > 0 and shares["attention"] > 0 and shares["other"] > 0
    assert sum(shares.values()) == pytest.approx(1.0)


@pytest.mark.slow
def test_dense_suite_runs_at_quick_size(tmp_path, capsys):
    out = tmp_path / "dense.md"
    assert benchmark.main(["--quick", "--threads", "2", "--output", str(out)]) == 0
    table = out.read_text()
    for row in ("training tokens/s, fp32", "training tokens/s, bf16 autocast", "peak memory of a training step",
                "generation tokens/s, batch 1", "generation tokens/s, batch 8", "Where LlamaForCausalLM's training step"):
        assert row in table, row
