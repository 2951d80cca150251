"""How archlab's Triton kernels are launched (modeling/triton_launch.py), the parts that need no GPU: an autotuned
kernel launched directly meets a new autotuning key with all its configurations compiled at once (Triton's
AsyncCompileMode, stood in for here: the compile itself needs a GPU driver), once per key, and never where the
autotuner has chosen already; a failure is left to the autotuner. Triton's own autotuner keys its choice as
`autotuning_key` does: tests/modeling/test_triton_compile.py (it needs Triton)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from archlab.modeling import triton_launch


class _Config:
    def __init__(self, **kwargs):
        self.kwargs = kwargs

    def all_kwargs(self):
        return {**self.kwargs, "num_warps": 4}


class _Autotuned:  # what compile_configs_at_once reads of Triton's Autotuner
    def __init__(self, warmup, configs=3):
        self.configs = [_Config(BLOCK=1), _Config(BLOCK=2), _Config(BLOCK=4)][:configs]
        self.arg_names = ["x", "n", "PROLOGUE"]
        self.keys = ["n", "PROLOGUE"]
        self.cache = {}
        self.fn = SimpleNamespace(warmup=warmup, __name__="kernel")


def _kernel(warmup):
    return _Autotuned(warmup)


def _async_mode(monkeypatch, active: list):
    class Mode:  # Triton's AsyncCompileMode: compiles started inside it finish when it exits
        def __init__(self, pool, ignore_errors=False):
            assert ignore_errors  # a failed configuration is left to the autotuner
            self.pool = pool

        def __enter__(self):
            active.append(self)
            return self

        def __exit__(self, *exc):
            active.remove(self)

    monkeypatch.setattr(triton_launch, "AsyncCompileMode", Mode)
    monkeypatch.setattr(triton_launch, "_CONFIGS_COMPILED", set())


def test_configurations_compile_at_once_the_first_time_a_key_is_met(monkeypatch):
    active, calls = [], []
    _async_mode(monkeypatch, active)

    def warmup(*args, grid, **kwargs):
        calls.append((args, kwargs, len(active), threading.current_thread().name))

    kernel = _kernel(warmup)
    x = torch.zeros(3, dtype=torch.bfloat16)
    launch = {"PROLOGUE": 1, "launch_pdl": True}
    triton_launch.compile_configs_at_once(kernel, (x, 5), launch)
    assert [(args[1], kwargs["BLOCK"], kwargs["num_warps"], kwargs["launch_pdl"]) for args, kwargs, _, _ in calls] == [
        (5, 1, 4, True), (5, 2, 4, True), (5, 4, 4, True),
    ]  # fmt: skip
    assert all(inside == 1 for _, _, inside, _ in calls)  # each under the async mode, which waits for them at its exit
    triton_launch.compile_configs_at_once(kernel, (x, 5), launch)  # the same key: nothing
    assert len(calls) == 3
    triton_launch.compile_configs_at_once(kernel, (x.float(), 5), launch)  # another dtype: another key
    triton_launch.compile_configs_at_once(kernel, (x, 6), launch)
    assert len(calls) == 9
    kernel.cache[triton_launch.autotuning_key(kernel, (x, 7), launch)] = kernel.configs[0]
    triton_launch.compile_configs_at_once(kernel, (x, 7), launch)  # the autotuner has chosen: nothing to compile
    assert len(calls) == 9
    one = _Autotuned(warmup, configs=1)
    triton_launch.compile_configs_at_once(one, (x, 8), launch)  # a single configuration is not benchmarked
    assert len(calls) == 9
    assert triton_launch.autotuning_key(kernel, (x, 5), launch) == (5, 1, "torch.bfloat16")


def test_a_failure_is_left_to_the_autotuner(monkeypatch):
    active, warnings, calls = [], [], []
    _async_mode(monkeypatch, active)
    monkeypatch.setattr(triton_launch.logger, "warning_once", warnings.append)

    def failing(*args, grid, **kwargs):
        calls.append(kwargs["BLOCK"])
        raise RuntimeError("no GPU driver")

    kernel = _kernel(failing)
    for _ in range(2):
        triton_launch.compile_configs_at_once(kernel, (torch.zeros(3), 5), {"PROLOGUE": 0})
    assert calls == [1] and len(warnings) == 1 and "no GPU driver" in warnings[0] and not active


def test_a_direct_launch_compiles_the_configurations_first(monkeypatch):
    """`launchable`'s launcher for a kernel run (not traced): the configurations first, with `launch_pdl` where the
    launch has it, then the launch as it was."""
    seen = []
    monkeypatch.setattr(triton_launch, "compile_configs_at_once", lambda kernel, args, kwargs: seen.append(kwargs))
    launched = []
    launcher = {"grid": lambda *args, **kwargs: launched.append((args, kwargs))}
    x = torch.zeros(2)
    triton_launch._ConfigsCompiledFirst(None, launcher, pdl=True)["grid"](x, 3, ROWS=1)
    triton_launch._ConfigsCompiledFirst(None, launcher, pdl=False)["grid"](x, 3, ROWS=2)
    assert seen == [{"ROWS": 1, "launch_pdl": True}, {"ROWS": 2}]
    assert launched == [((x, 3), {"ROWS": 1}), ((x, 3), {"ROWS": 2})]
    assert not triton_launch._traced(x)
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        assert triton_launch._traced(mode.from_tensor(x))


@pytest.mark.parametrize(
    "capability, fits", [((7, 0), False), ((7, 5), False), ((8, 0), True), ((8, 9), True), ((9, 0), True)]
)
def test_the_kernels_run_on_ampere_and_later(capability, fits, monkeypatch):
    """The decoding kernels' CUDA default leaves a T4 (7.5) or a V100 (7.0) on PyTorch's path: CI compiles the kernels
    for sm80 and sm90 only. Every other device a caller lists (the CPU tests' interpreter) is left to the caller."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)  # (eager CUDA code: the next test)
    assert triton_launch.kernels_fit(SimpleNamespace(device=torch.device("cuda", 0))) is fits
    assert triton_launch.kernels_fit(torch.zeros(1))


def test_a_traced_step_takes_the_capability_as_a_constant(monkeypatch):
    """In a compiled decoding step the capability check is a constant of the trace: no graph break, no guard."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    torch._dynamo.reset()

    def step(x):
        return x + 1 if triton_launch._capability_fits(0) else x - 1

    compiled = torch.compile(step, fullgraph=True, backend="eager")
    assert torch.equal(compiled(torch.zeros(2)), torch.ones(2))


def test_on_cuda_the_kernels_run_in_compiled_steps_only(monkeypatch):
    """Eager CUDA code waits on the host, where a Triton launch from Python costs more than the ATen ops it replaces:
    there the kernels stay off; a step torch.compile traces takes them."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    on_cuda = SimpleNamespace(device=torch.device("cuda", 0))
    monkeypatch.setattr(triton_launch, "EAGER_ON_CUDA", False)  # the default (the tests' conftest sets it)
    assert not triton_launch.kernels_fit(on_cuda)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert triton_launch.kernels_fit(on_cuda)
