"""Fixtures and pytest hooks: deterministic seeds, no network. What tests share otherwise is in helpers.py."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch

# ARCHLAB_TEST_CUDA_PATHS_ON_CPU=1 (CI's pass after the suite): the fast paths that run on CUDA only opened to the CPU,
# for the tests that go through one (cuda_paths.py). (Not the decoding loops' CUDA default, which would compile every
# test's generate, nor the RMSNorm fused backward, which has no CPU kernel; their own tests force them.)
pytest_plugins = ["cuda_paths", "pytester"]  # pytester: test_cuda_paths.py runs pytest on a probe


# ARCHLAB_TEST_FAILURES_AT_ONCE=1 (the GPU session's `tests` step): each failure's traceback is written as the test
# ends, not in the summary at the end of the run, so a run stopped at its time limit still says why tests failed.
FAILURES_AT_ONCE = os.environ.get("ARCHLAB_TEST_FAILURES_AT_ONCE") == "1"
_config: pytest.Config | None = None


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _share_the_cores_between_workers() -> None:
    """In a pytest-xdist worker: torch's threads, and those of the processes its tests start (OMP_NUM_THREADS), are
    the worker's share of the cores, so two workers on 2 cores do not run two threads each. An OMP_NUM_THREADS the
    caller set is kept."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        threads = max(1, _cores() // workers)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own, which turns `-n` into worker processes
def pytest_cmdline_main(config: pytest.Config) -> None:
    """The suite in one pytest-xdist worker process per core (`-n auto --dist loadgroup`), unless `-n` is given (`-n 0`:
    one process), pytest-xdist is missing or turned off (`-p no:xdist`), the run debugs (`--pdb`) or only collects, or
    this is a worker. A test module whose module fixture starts processes that all its tests share keeps its tests on
    one worker with `pytestmark = pytest.mark.xdist_group(...)`."""
    if not config.pluginmanager.hasplugin("xdist"):
        return
    option = config.option
    if hasattr(config, "workerinput"):  # a worker reads `--dist` from the command line, where the default is not
        option.loadgroup = option.loadgroup or config.workerinput.get("dist") == "loadgroup"
        return
    if option.numprocesses is not None or option.usepdb or option.collectonly:
        return
    workers = config.hook.pytest_xdist_auto_num_workers(config=config)
    if workers > 1:
        option.numprocesses = workers
        if option.dist == "no":
            option.dist = "loadgroup"


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: unknown without it
def pytest_configure_node(node) -> None:
    """Each worker is told the run's `--dist`: with `loadgroup` it names its `xdist_group` tests after their group,
    which is what keeps a group on one worker."""
    node.workerinput["dist"] = node.config.option.dist


def pytest_configure(config: pytest.Config) -> None:
    global _config
    _config = config
    _share_the_cores_between_workers()
    # pytest-xdist's, registered here too: the modules that carry it also run where pytest-xdist is not installed
    config.addinivalue_line("markers", "xdist_group(name): tests that run in the same pytest-xdist worker")
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
def _compile_errors_fail_tests(monkeypatch):
    """generate's compiled steps and prefill raise where the compiler fails or a call would pass dynamo's recompile
    limit, where generate runs them eagerly (compile_fallback.py): a test's compiled path that did not compile, or its
    recompile limit (`recompile_limit=1`: one graph for every span), fails it rather than falling back to eager
    decoding's same tokens unseen. The tests of the fallback itself turn it back on. (The compiled element-wise
    kernels still fall back to their formulas: test_compiled_kernels.py.)"""
    from archlab.modeling import compile_fallback

    monkeypatch.setattr(compile_fallback, "FALL_BACK_TO_EAGER", False)


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
