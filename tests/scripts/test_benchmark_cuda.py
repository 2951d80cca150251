"""The CUDA suites of scripts/benchmark.py (cuda-train, cuda-decode, cuda-static): their flags fail early when they
do not apply, and every suite's whole code path runs on CPU at `--quick` size and writes every row of its table
(liger's through a stand-in package, in the child process that keeps its patch away from this one). On a GPU the
same suites run on it. No timing is asserted."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from archlab.scripts import benchmark

from helpers import trace_only_compile_regions, trace_only_torch_compile


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--device", "cpu"], "--device applies to the suites"),
        (["--suite", "moe", "--peak-tflops", "989"], "--peak-tflops applies to the suites"),
        (["--suite", "cuda-train", "--batch-size", "2"], "--batch-size applies to the CPU suites"),
        (["--suite", "cuda-decode", "--new-tokens", "2"], "--new-tokens applies to the CPU suites"),
        (["--suite", "cuda-train", "--peak-tflops", "0"], "--peak-tflops must be a finite number > 0, got 0.0"),
        (["--suite", "cuda-train", "--peak_bandwidth", "-1"], "--peak-bandwidth must be a finite number > 0, got -1.0"),
        (["--suite", "cuda-train", "--device", "tpu"], "--device 'tpu'"),
        (["--suite", "cuda-train", "--device", "mps"], "allowed: cpu, cuda, cuda:N"),
        (["--suite", "cuda-decode", "--decode-rounds", "0"], "--decode-rounds must be >= 1"),
    ],
)
def test_flags_that_do_not_apply_fail_at_parsing(argv, message, capsys):
    with pytest.raises(SystemExit) as error:
        benchmark.main(argv)
    assert error.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_asking_for_cuda_without_one_says_so(capsys):
    with pytest.raises(SystemExit):
        benchmark.main(["--suite", "cuda-train", "--device", "cuda"])
    assert "no CUDA device is visible" in capsys.readouterr().err


# A stand-in for liger-kernel: its patch marks transformers' Llama, and says in a file that it ran.
FAKE_LIGER = """
import os
from pathlib import Path


def apply_liger_kernel_to_llama(**kwargs):
    from transformers.models.llama import modeling_llama

    modeling_llama.LlamaForCausalLM.patched_by_fake_liger = True
    Path(os.environ["FAKE_LIGER_MARKER"]).write_text("applied")
    if os.environ.get("FAKE_LIGER_TRACE_ONLY"):  # the child's compiled row traced by dynamo's eager backend, as here
        import accelerate.utils

        compile_regions = accelerate.utils.compile_regions
        accelerate.utils.compile_regions = lambda module, **kw: compile_regions(module, **kw, backend="eager")
"""


def cells(table: str, metric_start: str) -> list[str]:
    """The cells of the one row whose metric starts with `metric_start`."""
    rows = [line for line in table.splitlines() if line.startswith(f"| {metric_start}")]
    assert len(rows) == 1, (metric_start, table)
    return [cell.strip() for cell in rows[0].strip("|").split("|")]


def run_suites(tmp_path: Path, *argv: str, device: str = "cpu") -> str:
    out = tmp_path / "table.md"
    rounds = ["--rounds", "1", "--decode-rounds", "1"] if device == "cpu" else []  # on CPU: that it runs, not timings
    assert benchmark.main([*argv, "--device", device, "--quick", *rounds, "--output", str(out)]) == 0
    table = out.read_text()
    assert "failed" not in table, table
    return table


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_training_suite_runs_every_comparison(tmp_path, monkeypatch, device):
    from transformers import LlamaForCausalLM

    fake = tmp_path / "fake"
    (fake / "liger_kernel" / "transformers").mkdir(parents=True)
    (fake / "liger_kernel" / "__init__.py").write_text("")
    (fake / "liger_kernel" / "transformers" / "__init__.py").write_text(FAKE_LIGER)
    marker = tmp_path / "liger-applied"
    monkeypatch.syspath_prepend(str(fake))
    monkeypatch.setenv("PYTHONPATH", f"{fake}:{':'.join(sys.path)}")
    monkeypatch.setenv("FAKE_LIGER_MARKER", str(marker))

    # On CPU the compiled rows trace only: inductor's compile of both models' forward and backward costs ~15 s on 2
    # cores, and tests/integration/test_compile.py compiles regions with it.
    if device == "cpu":
        trace_only_compile_regions(monkeypatch)
        monkeypatch.setenv("FAKE_LIGER_TRACE_ONLY", "1")
    table = run_suites(tmp_path, "--suite", "cuda-train", "--threads", "2", device=device)
    for metric in (
        "dense 1.1B: archlab vs LlamaForCausalLM (eager)",
        "dense 1.1B: archlab compiled vs Llama compiled",
        "dense 1.1B: archlab compiled vs Llama eager",
        "dense 1.1B: archlab vs LlamaForCausalLM + liger-kernel",
        "dense 1.1B: archlab compiled (the scripts' default) vs LlamaForCausalLM + liger-kernel",
        "vocab 128256: archlab compiled (the scripts' default) vs LlamaForCausalLM + liger-kernel",
        "vocab 128256: archlab vs LlamaForCausalLM (eager)",
        "vocab 128256: archlab vs LlamaForCausalLM + liger-kernel",
        "MoE (Mixtral shape): archlab vs MixtralForCausalLM (experts: grouped_mm)",
        "MoE (Mixtral shape): archlab vs MixtralForCausalLM (experts: eager)",
        "MoE (Mixtral shape): archlab MoE vs dense LlamaForCausalLM",
        "encoder-decoder (Marian shape",
    ):
        row = cells(table, metric)
        assert row[1].endswith("tok/s") and row[2].endswith("tok/s") and row[3].endswith("×"), row
    header = cells(table, "metric")
    assert header[4:9] == ["MFU archlab", "MFU peer", "peak mem archlab", "peak mem peer", "mem peer ÷ archlab"]
    eager = cells(table, "dense 1.1B: archlab vs LlamaForCausalLM (eager)")
    assert re.fullmatch(r"[\d.,]+ (MiB|GiB)", eager[6]) and re.fullmatch(r"[\d.,]+ (MiB|GiB)", eager[7]), eager
    assert "cold compile + first step" in table
    goal = header_index(table, "goal")  # the issues' goals beside the rows they judge
    assert cells(table, "MoE (Mixtral shape): archlab MoE vs dense")[goal].startswith("≥ 0.9×")
    assert cells(table, "vocab 128256: archlab vs LlamaForCausalLM (eager)")[goal] == "≥ 1.2×, mem ≥ 1.3×"
    for metric in ("dense 1.1B: archlab vs LlamaForCausalLM + liger", "dense 1.1B: archlab compiled (the scripts'"):
        assert cells(table, metric)[goal].startswith("≥ 1.15× for the default")
    assert marker.read_text() == "applied"  # the child process ran liger's patch ...
    assert not hasattr(LlamaForCausalLM, "patched_by_fake_liger")  # ... and this process's Llama is untouched


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_compiled_training_suite_runs_every_comparison(tmp_path, monkeypatch, device):
    """cuda-train-compiled: vocabulary 128256, MoE and seq2seq compiled regionally against their peers compiled and
    eager, the MoE and seq2seq compiled whole (with and without CUDA graphs) against compiled regionally and their
    peer eager, and the dense model's loss chunk sizes.
    On CPU dynamo's eager backend stands in for inductor (tracing, no code generation: inductor's compile of eleven
    models would cost minutes)."""
    if device == "cpu":
        trace_only_compile_regions(monkeypatch)
        trace_only_torch_compile(monkeypatch)
    table = run_suites(tmp_path, "--suite", "cuda-train-compiled", "--threads", "2", device=device)
    for label, peer in (
        ("vocab 128256", "Llama"),
        ("MoE (Mixtral shape)", "Mixtral"),
        ("encoder-decoder (Marian shape, 2 × (32 + 32))", "Marian"),
    ):
        for other in (f"{peer} compiled (same tool on both)", f"{peer} eager (the Hugging Face default)"):
            row = cells(table, f"{label}: archlab compiled vs {other}")
            assert row[1].endswith("tok/s") and row[2].endswith("tok/s") and row[3].endswith("×"), row
        assert f"{label}, accelerate `compile_regions(dynamic=False)`: cold compile" in table
    dense = cells(table, "MoE (Mixtral shape): archlab MoE compiled vs dense LlamaForCausalLM compiled")
    assert dense[header_index(table, "goal")].startswith("≥ 0.9×"), dense
    for label, peer in (
        ("MoE (Mixtral shape)", "Mixtral"),
        ("encoder-decoder (Marian shape, 2 × (32 + 32))", "Marian"),
    ):
        for metric in (
            "archlab compiled whole vs archlab compiled regionally",
            f"archlab compiled whole vs {peer} eager",
            f"archlab compiled whole with CUDA graphs (mode reduce-overhead) vs {peer} eager",
        ):
            row = cells(table, f"{label}: {metric}")
            assert row[1].endswith("tok/s") and row[3].endswith("×"), row
        assert f"{label}, archlab `torch.compile` whole: cold compile + first step" in table
        assert f"{label}, archlab compiled whole with CUDA graphs: cold compile + first step" in table
    for what in ("chunks of 4096 tokens", "unchunked (lm_loss_chunk_size=0)"):
        row = cells(table, f"dense 1.1B compiled: archlab's LM-head loss {what} vs the default chunks (1024 tokens)")
        assert row[1].endswith("tok/s") and row[3].endswith("×"), row


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_catalogue_suite_decodes_each_new_architecture_against_its_stock_model(tmp_path, device):
    """GPT-OSS, DeepSeek-V3 and Llama 4 shapes, each pair built through the converter; the roofline from the given
    rates (latent attention's cache, chunked layers' blocks)."""
    rates = ["--peak-tflops", "1", "--peak-bandwidth", "0.05"] if device == "cpu" else []
    table = run_suites(tmp_path, "--suite", "cuda-catalogue", *rates, device=device)
    for name, stock in (
        ("GPT-OSS shape", "GptOssForCausalLM"),
        ("DeepSeek-V3 shape", "DeepseekV3ForCausalLM"),
        ("Llama 4 shape", "Llama4ForCausalLM"),
    ):
        row = cells(table, name)
        assert row[0].endswith(f"StaticCache: archlab vs {stock}") and row[3].endswith("×"), row
        assert row[4].endswith("%") and row[5].endswith("%"), row


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_decode_suites_run_every_comparison(tmp_path, device):
    rates = ["--peak-tflops", "1", "--peak-bandwidth", "0.05"] if device == "cpu" else []
    suites = ("--suite", "cuda-decode", "--suite", "cuda-static", "--suite", "cuda-loops")
    table = run_suites(tmp_path, *suites, *rates, device=device)
    decode, static = table.split("### CUDA suite, decoding (cache_implementation")
    static, loops = static.split("### CUDA suite, the compiled decoding loops")
    for batch in (1, 4):
        row = cells(decode, f"dense 1.1B greedy decode, batch {batch}, 16 + 8 tokens, DynamicCache")
        assert row[4].endswith("%") and row[5].endswith("%"), row  # roofline from the given rates
    row = cells(static, "dense 1.1B greedy decode, batch 1, 16 + 8 tokens, StaticCache")
    assert re.fullmatch(r"[\d.]+ s", row[header_index(static, "first call archlab")]), row
    cells(loops, "dense 1.1B sampling (T 0.8, top-k 40, top-p 0.95), batch 1, StaticCache")
    cells(loops, "dense 1.1B greedy decode, batch 1, StaticCache: archlab's decoding loop vs archlab in")
    cells(loops, "dense 1.1B greedy decode, batch 4, 16 + 48 tokens, StaticCache, archlab's loop: steps read the")
    rings = cells(loops, "dense 1.1B, every layer sliding (window 8), greedy decode, batch 4, 16 + 48 tokens")
    assert rings[4].endswith("%") and rings[5].endswith("%"), rings  # the roofline counts a window per sliding layer
    for batch in (1, 4):
        cells(decode, f"MoE (Mixtral shape) greedy decode, batch {batch}")
    prefill = cells(decode, "dense 1.1B prefill, 1 × 64 tokens")
    assert prefill[header_index(decode, "MFU archlab")].endswith("%"), prefill
    first_token = cells(decode, "dense 1.1B prefill through generate (time to first token), 1 × 64 tokens")
    assert first_token[header_index(decode, "MFU archlab")].endswith("%"), first_token
    assert first_token[header_index(decode, "first call archlab")].endswith("s (2 calls)"), first_token
    cells(decode, "encoder-decoder (Marian shape) beam search")
    # each model's own default path: archlab's fast path against the peers' (first calls in columns of their own)
    default = "each model's default cache"
    for batch in (1, 4):
        row = cells(loops, f"MoE (Mixtral shape) greedy decode, batch {batch}, {default}")
        assert re.fullmatch(r"[\d.]+ s", row[header_index(loops, "first call archlab")]), row
    beams = cells(loops, "encoder-decoder (Marian shape) beam search, batch 2, 4 beams, 16 source + 8 new tokens")
    assert beams[header_index(loops, "goal")] == "≥ 2×", beams
    assert row[header_index(loops, "goal")] == "≥ 2×", row  # MoE at batch 4 on each model's default path
    assert cells(static, "dense 1.1B greedy decode, batch 1")[header_index(static, "goal")].startswith("≥ 2.5×")
    cells(loops, "encoder-decoder (Marian shape) beam-search cache reorder, batch 2, 4 beams, archlab's loop")
    cells(loops, "encoder-decoder (Marian shape) beam search, batch 2, 4 beams, a source of another length every call")


def header_index(table: str, header: str) -> int:
    return cells(table, "metric").index(header)


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_headline_suite_runs_the_goal_rows(tmp_path, monkeypatch, device):
    """cuda-headline (a GPU session's first look): the dense training rows eager and compiled, batch-1 static
    decoding and the prefill, each with its goal from the issues."""
    if device == "cpu":
        trace_only_compile_regions(monkeypatch)
    rates = ["--peak-tflops", "1", "--peak-bandwidth", "0.05"] if device == "cpu" else []
    table = run_suites(tmp_path, "--suite", "cuda-headline", "--threads", "2", *rates, device=device)
    goal = header_index(table, "goal")
    for metric, wanted in (
        ("dense 1.1B: archlab vs LlamaForCausalLM (eager)", "peer ÷ archlab mem ≥ 1.0×"),
        ("dense 1.1B: archlab compiled vs Llama compiled", "≥ 1.0×, MFU ≥ 45 %"),
        ("dense 1.1B: archlab compiled vs Llama eager", "≥ 1.5× (the scripts' default)"),
        ("dense 1.1B greedy decode, batch 1, 16 + 8 tokens, StaticCache", "≥ 2.5×, ≥ 50 % roofline"),
        ("dense 1.1B prefill, 1 × 64 tokens", "MFU ≥ 50 %"),
        ("dense 1.1B prefill through generate (time to first token), 1 × 64 tokens", "MFU ≥ 50 %"),
    ):
        row = cells(table, metric)
        assert row[goal].startswith(wanted) and row[1].endswith("tok/s") and row[3].endswith("×"), row
    decode = cells(table, "dense 1.1B greedy decode, batch 1")
    assert re.fullmatch(r"[\d.]+ s", decode[header_index(table, "first call archlab")]), decode
    assert decode[header_index(table, "% roofline archlab")].endswith("%"), decode
    assert cells(table, "dense 1.1B: archlab compiled vs Llama eager")[header_index(table, "MFU archlab")]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_tuning_suite_measures_each_setting_against_the_default(tmp_path, device):
    """cuda-tuning: each setting of the decoding step (the persistent layer tail at batch 1, without archlab's decoding
    kernels at batch 1 and a larger batch, the q/k/v GEMV apart from RoPE and the cache writes, the fused layer
    steps at every row count, the memory-efficient attention, the plain mode and FlexAttention, max-autotune), each
    on its own copy of the weights against archlab's default path, with both sides' first calls; the MoE without
    archlab's kernels against its default; the time to first token with the prompt padded to a bucket and replayed
    as a CUDA graph against without; and the prefill compiled with each decoder block a nested compile region
    against without."""
    from archlab.scripts import benchmark_cuda_tuning as tuning

    rates = ["--peak-tflops", "1", "--peak-bandwidth", "0.05"] if device == "cpu" else []
    table = run_suites(tmp_path, "--suite", "cuda-tuning", *rates, device=device)
    assert len(tuning.SETTINGS) == 8
    rows = tuning.ROWS + tuning.LATE_ROWS
    assert {name for _, name in rows} == set(tuning.SETTINGS)
    for batch, name in rows:
        batch = 4 if batch == "larger" else batch
        row = cells(table, f"dense 1.1B greedy decode, batch {batch}, 16 + 8 tokens, StaticCache, archlab: {name} vs")
        assert row[1].endswith("tok/s") and row[3].endswith("×"), row
        assert re.fullmatch(r"[\d.]+ s", row[header_index(table, "first call archlab")]), row
        assert row[header_index(table, "% roofline archlab")].endswith("%"), row
    moe = cells(table, f"MoE (Mixtral shape) greedy decode, batch 1, 16 + 8 tokens, archlab: {tuning.MOE_BEFORE}")
    assert moe[1].endswith("tok/s") and moe[3].endswith("×"), moe
    buckets = cells(table, "dense 1.1B prefill through generate (time to first token), 1 × 64 tokens, compile_prefill")
    assert buckets[header_index(table, "MFU archlab")].endswith("%"), buckets
    prefill = cells(table, "dense 1.1B prefill compiled whole (compile_prefill's way), 1 × 64 tokens: each decoder")
    assert prefill[header_index(table, "MFU archlab")].endswith("%"), prefill
    assert re.fullmatch(r"[\d.]+ s", prefill[header_index(table, "first call archlab")]), prefill


def test_a_setting_whose_compile_fails_raises_instead_of_timing_eager_decoding(monkeypatch):
    """cuda-tuning times a setting through `failing_on_fallback`: where compile_fallback.py turns a compiler failure
    into eager decoding (its one logged line), the call raises with that line, and the row becomes a note; the
    "compiling ..." notice and calls that compile are not failures."""
    from types import SimpleNamespace

    from archlab.modeling import compile_fallback
    from archlab.modeling.compile_fallback import eager_on_compiler_failure
    from archlab.scripts import benchmark_cuda_tuning as tuning

    model = SimpleNamespace(device=torch.device("cpu"))
    monkeypatch.setattr(compile_fallback, "FALL_BACK_TO_EAGER", True)  # (the tests' default raises: conftest.py)

    def broken(*args):
        raise ValueError("Loop-carried variable best has initial type fp32 but is re-assigned to fp64")

    step = eager_on_compiler_failure(model, broken, lambda *args: "eager tokens", "the decoding step", (ValueError,))
    with pytest.raises(tuning.FellBackToEager, match="Compiling the decoding step failed .*fp64"):
        tuning.failing_on_fallback(step)()
    working = eager_on_compiler_failure(model, lambda: "tokens", lambda: "eager tokens", "the decoding step")
    assert tuning.failing_on_fallback(working)() == "tokens"
