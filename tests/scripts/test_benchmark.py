"""The benchmark tool (scripts/benchmark.py): every suite it names exists, bad arguments fail at parsing, the step
profile adds up without Kineto's marker lines on stderr, and the dense suite runs end to end at `--quick` size. No
timing is asserted anywhere."""

from __future__ import annotations

import os
import subprocess

import pytest
import torch

from archlab import DecoderForCausalLM
from archlab.scripts import benchmark
from archlab.training.benchmarking import make_optimizer, time_breakdown, training_step

from helpers import run_pythons_at_once, tiny_decoder_config


@pytest.mark.parametrize("name", sorted({*benchmark.SUITES, *benchmark.EXTERNAL_SUITES}))
def test_every_named_suite_exists(name):
    assert callable(benchmark.resolve_suite(name))


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--rounds", "0"], "--rounds must be >= 1"),
        (["--batch-size", "0"], "--batch-size must be >= 1"),
        (["--rounds", "-1", "--quick"], "--rounds must be >= 1"),
        (["--threads", "0"], "--threads must be >= 1, got 0"),
        (["--suite", "nope"], "invalid choice: 'nope'"),
        (["--optim", "sgd"], "invalid choice: 'sgd'"),
        # written after the first suite had run: a bad path failed only then
        (["--output", "."], "--output '.' is a folder; give the markdown file to write"),
        (["--output", "no/such/folder/t.md"], "--output 'no/such/folder/t.md': the folder 'no/such/folder' does not"),
        # nan and inf passed the `<= 0` check, and MFU came out nan or 0
        (["--suite", "cuda-train", "--peak-tflops", "nan"], "--peak-tflops must be a finite number > 0, got nan"),
        (["--suite", "cuda-train", "--peak-bandwidth", "inf"], "--peak-bandwidth must be a finite number > 0, got inf"),
        (["--suite", "cuda-train", "--peak-tflops", "0"], "--peak-tflops must be a finite number > 0, got 0.0"),
        # ran past the suites' 4096 positions: a learned table (the variants suite) failed mid-run
        (["--seq-len", "5000"], "--seq-len 5000 exceeds the dense suite's max_position_embeddings (4096)"),
        (["--suite", "variants", "--seq-len", "4097"], "--seq-len 4097 exceeds the variants suite's"),
        (["--new-tokens", "4090"], "--new-tokens 4090 after the dense suite's 32-token prompt exceeds its"),
    ],
)
def test_bad_arguments_fail_at_parsing(argv, message, capsys, monkeypatch):
    # a flag let through runs the suite at full size: fail at once instead
    monkeypatch.setattr(benchmark, "resolve_suite", lambda name: pytest.fail(f"the {name} suite ran"))
    with pytest.raises(SystemExit) as error:
        benchmark.main(argv)
    assert error.value.code == 2
    assert message in capsys.readouterr().err


def test_default_optimizer_is_the_one_trainer_builds(tmp_path):
    """The benchmarks time the optimiser a Trainer user gets by default, configured as Trainer configures it."""
    from transformers import Trainer, TrainingArguments

    model = DecoderForCausalLM(tiny_decoder_config())
    default_optim = benchmark.build_parser().parse_args([]).optim
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    assert default_optim == args.optim.value
    cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)
    ours = make_optimizer(model, default_optim)
    assert type(ours) is cls
    for key in ("fused", "foreach"):
        assert ours.defaults[key] == kwargs.get(key, ours.defaults[key]), key
    with pytest.raises(ValueError, match="allowed: \\['adamw_torch', 'adamw_torch_fused'\\]"):
        make_optimizer(model, "adafactor")


def test_time_breakdown_adds_up_and_sees_the_gemms():
    model = DecoderForCausalLM(tiny_decoder_config())
    ids = torch.randint(3, 97, (2, 16))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    shares = time_breakdown(training_step(model, {"input_ids": ids, "labels": ids}, optimizer))
    assert set(shares) == {"gemm", "attention", "other"}
    assert shares["gemm"] > 0 and shares["attention"] > 0 and shares["other"] > 0
    assert sum(shares.values()) == pytest.approx(1.0)


PROFILE_A_MATMUL = """
import torch
from archlab.training.benchmarking import time_breakdown
a = torch.randn(64, 64)
print(time_breakdown(lambda: a @ a)["gemm"] > 0)
"""


def _profile_in_fresh_processes(*envs: dict[str, str]) -> list[subprocess.CompletedProcess]:
    """The profile in one fresh interpreter per `envs` entry, run at once: Kineto reads its log level once per
    process, so each setting needs its own interpreter."""
    base = {k: v for k, v in os.environ.items() if k != "KINETO_LOG_LEVEL"}
    return run_pythons_at_once([(PROFILE_A_MATMUL, {**base, **env}) for env in envs])


@pytest.mark.slow
def test_profile_prints_no_kineto_markers_unless_the_caller_asks_for_them():
    # the second sets the level itself: the caller's level wins (and the check can fail)
    quiet, verbose = _profile_in_fresh_processes({}, {"KINETO_LOG_LEVEL": "5"})
    assert quiet.returncode == 0 and quiet.stdout.strip() == "True", quiet.stderr
    assert "USDT" not in quiet.stderr and "profiler_start" not in quiet.stderr, quiet.stderr
    if "profiler_start" not in verbose.stderr:  # e.g. torch 2.11's CUDA build on a CPU: nothing to silence there
        pytest.skip("this torch's Kineto prints no start marker even when asked: the quiet check proves nothing")


@pytest.mark.slow
def test_dense_suite_runs_at_quick_size(tmp_path, capsys):
    out = tmp_path / "dense.md"
    assert benchmark.main(["--quick", "--threads", "2", "--output", str(out)]) == 0
    table = out.read_text()
    for row in (
        "training tokens/s, fp32",
        "training tokens/s, bf16 autocast",
        "peak memory of a training step",
        "generation tokens/s, batch 1",
        "generation tokens/s, batch 8",
        "Where LlamaForCausalLM's training step",
    ):
        assert row in table, row


def test_variants_suite_times_each_peer_on_its_own_weights_and_logits():
    """The variants suite's peer rows (benchmark_variants.py) time archlab against the Hugging Face model that has the
    variant: on the peer's weights (loaded strictly) archlab computes the peer's logits, and with the peer's special
    tokens generate does the same work per step (an end-of-sequence id adds its stopping check), so a row times one
    function."""
    from archlab.scripts.benchmark_variants import peer_pairs, suite_shape

    shape = suite_shape(quick=True)
    ids = torch.randint(3, shape["vocab_size"], (2, 24))
    pairs = peer_pairs(shape, seq_len=64)
    assert "OLMo 2, output norms + QK-norm over the projections" in [label for label, _, _ in pairs]
    for label, ours, peer in pairs:
        for field in ("bos_token_id", "eos_token_id", "pad_token_id"):  # generate's per-step work is the same
            assert getattr(ours.config, field) == getattr(peer.config, field, None), (label, field)
        with torch.no_grad():
            expected = peer.eval()(ids).logits
            torch.testing.assert_close(ours.eval()(ids).logits, expected, atol=1e-4, rtol=0, msg=label)


@pytest.mark.slow
def test_variants_suite_runs_at_quick_size(tmp_path):
    out = tmp_path / "variants.md"
    assert benchmark.main(["--suite", "variants", "--quick", "--threads", "1", "--output", str(out)]) == 0
    table = out.read_text()
    for row in (
        "OLMo 2, output norms + QK-norm over the projections: training tok/s vs Olmo2ForCausalLM",
        "output norms (OLMo 2): generation tok/s vs archlab default",
        "QK-norm over the projections (OLMo 2): training tok/s vs archlab default",
    ):
        assert row in table, row


def test_interleaved_rounds_warm_up_then_balance_the_order():
    """Every suite's timing loop: one untimed warm-up call each, then rounds whose order rotates (two runs alternate
    which goes first; with more, every other round is also reversed, so no run always follows the same one)."""
    from archlab.training.benchmarking import compare_speed, interleaved_rounds

    calls = []
    runs = {name: (lambda name=name: calls.append(name)) for name in "ab"}
    times = interleaved_rounds(runs, rounds=4)
    assert "".join(calls) == "ab" + "ab" + "ba" + "ab" + "ba"
    assert {name: len(seconds) for name, seconds in times.items()} == {"a": 4, "b": 4}

    calls.clear()
    interleaved_rounds({name: (lambda name=name: calls.append(name)) for name in "abc"}, rounds=4, warmup=0)
    assert "".join(calls) == "abc" + "acb" + "cab" + "cba"

    calls.clear()
    median_a, median_p, ratio = compare_speed(runs["a"], runs["b"], rounds=3)
    assert "".join(calls) == "ab" + "ab" + "ba" + "ab"
    assert median_a > 0 and median_p > 0 and ratio > 0


def test_every_script_does_something_when_run():
    """`python scripts/X.py --help` printed nothing and exited 0 for the two benchmark modules without a `__main__`
    block (benchmark_variants.py, benchmark_cuda.py): each script now runs, or says what to run instead."""
    import sys
    from pathlib import Path

    scripts = Path(benchmark.__file__).parent
    modules = [p for p in sorted(scripts.glob("*.py")) if p.name != "__init__.py"]
    assert [p.name for p in modules if "__main__" not in p.read_text()] == []
    result = subprocess.run(
        [sys.executable, str(scripts / "benchmark_cuda.py")], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 1 and "python scripts/benchmark.py --suite cuda-train" in result.stderr
