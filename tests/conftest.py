"""Fixtures and pytest hooks: deterministic seeds, no network. What tests share otherwise is in helpers.py."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch

# ARCHLAB_TEST_CUDA_PATHS_ON_CPU=1 (CI's second pass): the fast paths that run on CUDA only — the compiled element-wise
# kernels (RoPE, gated activations), the LM loss's compiled gradient, q/k/v and gate/up read as one product in
# generate — run on the CPU too, so every test of the suite checks them against its reference, all at once, as a GPU
# runs them. (Not the decoding loops' CUDA default, which would compile every test's generate, nor the RMSNorm fused
# backward, which has no CPU kernel; their own tests force them.)
CUDA_PATHS_ON_CPU = os.environ.get("ARCHLAB_TEST_CUDA_PATHS_ON_CPU") == "1"


# ARCHLAB_TEST_FAILURES_AT_ONCE=1 (the GPU session's `tests` step): each failure's traceback is written as the test
# ends, not in the summary at the end of the run, so a run stopped at its time limit still says why tests failed.
FAILURES_AT_ONCE = os.environ.get("ARCHLAB_TEST_FAILURES_AT_ONCE") == "1"
_config: pytest.Config | None = None


def _open_the_cuda_paths_to_the_cpu() -> None:
    from archlab.modeling import compiled_kernels, fused_projections, losses

    compiled_kernels.FUSED_KERNEL_DEVICES = ("cuda", "cpu")
    losses.FUSED_GRADIENT_DEVICES = ("cuda", "cpu")
    fused_projections.FUSED_PROJECTION_DEVICES = ("cuda", "cpu")


def pytest_configure(config: pytest.Config) -> None:
    global _config
    _config = config
    if CUDA_PATHS_ON_CPU:
        _open_the_cuda_paths_to_the_cpu()
    # marks that transformers' common model tests (test_transformers_common.py) put on some of their tests
    for mark in ("accelerate_tests", "flash_attn_test", "flash_attn_3_test", "flash_attn_4_test", "torch_compile_test"):
        config.addinivalue_line("markers", f"{mark}: set by transformers' common model tests")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if FAILURES_AT_ONCE and report.failed and _config is not None:
        reporter = _config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(f"\n--- {report.nodeid} failed ({report.when}):\n{report.longreprtext[-4000:]}")


@pytest.hookimpl(tryfirst=True)  # before `-m` selects: the marks added here count
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test parametrized with a CUDA `device` is a `gpu` test too; `gpu` tests skip where torch sees no CUDA device
    (CI, the development machines)."""
    for item in items:
        device = getattr(item, "callspec", None) and item.callspec.params.get("device")
        if isinstance(device, (str, torch.device)) and torch.device(device).type == "cuda":
            item.add_marker(pytest.mark.gpu)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _kernels_in_eager_cuda_code(monkeypatch):
    """archlab's decoding kernels run in eager CUDA code too (by default only in compiled steps: triton_launch.py's
    `kernels_fit`), so that on a GPU the kernel tests check them eagerly against PyTorch's path, as they do on CPU
    through Triton's interpreter."""
    from archlab.modeling import triton_launch

    monkeypatch.setattr(triton_launch, "EAGER_ON_CUDA", True)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _short_cache_spans(monkeypatch):
    """The compiled decoding loops' cache spans (cache_spans.py) in steps of 2 positions, not 64: the tests' caches
    of a few dozen positions then change span several times per generation, so every decoding test checks them
    (test_cache_spans.py checks the rule's own numbers)."""
    from archlab.modeling import cache_spans

    monkeypatch.setattr(cache_spans, "MIN_SPAN_STEP", 2)


@pytest.fixture(autouse=True)
def _short_source_steps(monkeypatch):
    """Encoder-decoder sources on the fast path padded to multiples of 4 positions, not 64 (source_padding.py): the
    tests' sources of 5 to 9 tokens are then padded by a few, and every compiled seq2seq decoding test compares padded
    sources with transformers' unpadded ones."""
    from archlab.modeling import source_padding

    monkeypatch.setattr(source_padding, "SOURCE_STEP", 4)
