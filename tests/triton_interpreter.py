"""Runs Triton kernels on a CPU through Triton's interpreter, so GPU kernels such as Liger's can be checked against
archlab's PyTorch modules on a machine without a GPU.

The interpreter executes a kernel's Python body with NumPy, one program at a time. Whether a `@triton.jit` function
is interpreted is decided when it is defined, Triton's own `tl.sum`, `tl.max`, ... included, and torch imports
Triton: so the process must start with `TRITON_INTERPRET=1` in its environment (`run_pytest_interpreted`). Gaps in
the interpreter (Triton 3.6-3.9) stop Liger's kernels and archlab's own; `fill_interpreter_gaps` fills them for the
duration of a test:

- a Python float argument stays a Python float, while compiled Triton passes it as an fp32 scalar, so a kernel's
  `eps.to(tl.float32)` fails: floats are handed to the kernel as fp32 scalars, as compiled Triton does;
- `triton.language.extra.libdevice` functions (CUDA's libdevice: `rsqrt`, `tanh`) are declarations the interpreter
  does not implement (they return None): each such name a kernel module imported is computed with NumPy;
- a scalar (a kernel's int argument, or a value computed from one) is a one-element NumPy array, which NumPy 2
  no longer converts to a Python int: a loop over `range(0, n)` of such an `n` fails; `__index__` takes its element.

The interpreter computes in fp32 here: NumPy has no bfloat16, and bf16 kernels return NaN or garbage.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None  # CPU wheels of torch come without it
INTERPRETING = HAS_TRITON and os.environ.get("TRITON_INTERPRET") == "1"  # this process started with TRITON_INTERPRET=1
# Where a test of a Triton kernel runs it: on a GPU, or on a CPU under the interpreter
KERNELS_RUN_HERE = HAS_TRITON and (torch.cuda.is_available() or INTERPRETING)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
runs_kernels = pytest.mark.skipif(
    not KERNELS_RUN_HERE, reason="runs Triton kernels: on CPU, test_kernels_through_the_triton_interpreter runs them"
)

# libdevice functions the interpreter lacks, by name, as NumPy on the interpreter's arrays
NUMPY_LIBDEVICE = {"rsqrt": lambda x: 1 / np.sqrt(x), "tanh": np.tanh}


def is_interpreted(kernel) -> bool:
    from triton.runtime import interpreter

    return isinstance(kernel, interpreter.InterpretedFunction)


def _numpy_unary(function):
    import triton.language as tl
    from triton.runtime import interpreter

    def apply(x: tl.tensor) -> tl.tensor:
        return tl.tensor(interpreter.TensorHandle(function(x.handle.data), x.handle.dtype.scalar), x.type)

    return apply


def _float_as_fp32(convert):
    import triton.language as tl
    from triton.runtime import interpreter

    def implicit_cvt(arg):
        if isinstance(arg, float):
            return tl.tensor(interpreter.TensorHandle(np.array([arg], dtype=np.float32), tl.float32), tl.float32)
        return convert(arg)

    return implicit_cvt


def _scalar_index(patch_lang_tensor):
    def patch(tensor, scope) -> None:
        patch_lang_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    return patch


def fill_interpreter_gaps(monkeypatch, module_prefix: str) -> None:
    """Fill the gaps for the kernels of the loaded modules named `module_prefix...` (undone by `monkeypatch`)."""
    from triton.runtime import interpreter

    monkeypatch.setattr(interpreter, "_implicit_cvt", _float_as_fp32(interpreter._implicit_cvt))
    monkeypatch.setattr(interpreter, "_patch_lang_tensor", _scalar_index(interpreter._patch_lang_tensor))
    for name, module in list(sys.modules.items()):
        if not name.startswith(module_prefix) or module is None:
            continue
        for function_name, numpy_function in NUMPY_LIBDEVICE.items():
            function = getattr(module, function_name, None)
            if getattr(function, "__module__", "").startswith("triton.language.extra"):
                monkeypatch.setattr(module, function_name, _numpy_unary(numpy_function))


def with_dependent_launch_code(monkeypatch, *modules) -> None:
    """The kernels of `modules` (triton_gemv, ...) launched by their ops' PDL twins run their dependent-launch code
    (triton_launch.py): on a GPU as the twins decide (Hopper: with the launch attribute); under the interpreter, which
    has neither the attribute nor the `griddepcontrol` instructions, with the instructions left out."""
    if not INTERPRETING:
        return
    replacements = {
        "pdl_launch": lambda like: True,
        "dependent_launch": lambda PDL: None,
    }
    for module in modules:
        for name, replacement in replacements.items():
            if hasattr(module, name):  # (a module launching kernels whose dependent-launch code another holds)
                monkeypatch.setattr(module, name, replacement)


def run_pytest_interpreted(*pytest_args: str, timeout: float = 840) -> subprocess.CompletedProcess:
    """`python -m pytest *pytest_args` in a fresh process with TRITON_INTERPRET=1 (output captured)."""
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *pytest_args],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def assert_kernel_tests_pass_interpreted(test_file: str) -> None:
    """Run `test_file`'s tests but the GPU ones in a fresh process under the interpreter: all pass, and only one is
    skipped, the one calling this (the kernels run in that process)."""
    result = run_pytest_interpreted(test_file, "-m", "not gpu", "-rs")
    summary = result.stdout[-4000:]
    assert result.returncode == 0, summary + result.stderr[-2000:]
    assert " 1 skipped" in summary.splitlines()[-1], summary


def interpreter_gaps_filled(module_prefix: str):
    """The autouse fixture of a kernel test file: under the interpreter, the gaps of the kernels in the modules named
    `module_prefix...` filled for each test (`fill_interpreter_gaps`)."""

    @pytest.fixture(autouse=True)
    def _interpreter_gaps(monkeypatch):
        if INTERPRETING:
            fill_interpreter_gaps(monkeypatch, module_prefix)

    return _interpreter_gaps


def interpreted_run_of(test_file: str):
    """The test a kernel test file ends with: where Triton is installed but the kernels do not run in this process (a
    CPU without TRITON_INTERPRET=1), the file's other tests in a fresh process under the interpreter."""

    @pytest.mark.skipif(not HAS_TRITON or KERNELS_RUN_HERE, reason="Triton missing, or the kernels run in this process")
    def test_kernels_through_the_triton_interpreter() -> None:
        assert_kernel_tests_pass_interpreted(test_file)

    return test_kernels_through_the_triton_interpreter


def greedy_tokens(model, batch: dict, graphs: list | None = None) -> torch.Tensor:
    """10 greedy tokens; with `graphs`, through archlab's loop on the static cache, its step traced by dynamo (on CPU
    through generate's testing hook), each traced graph's code kept in `graphs` and the graph run as traced (the ops
    a kernel test checks for are in it)."""
    from transformers import CompileConfig

    kwargs = dict(max_new_tokens=10, do_sample=False, pad_token_id=0)
    if graphs is not None:

        def backend(graph_module, example_inputs):
            graphs.append(graph_module.code)
            return graph_module.forward

        config = CompileConfig(fullgraph=True, backend=backend, mode=None)
        config._compile_all_devices = True
        kwargs.update(cache_implementation="static", compile_config=config)
    return model.generate(**batch, **kwargs)


def left_padded_batch(vocab_size: int) -> dict:
    """Two 9-token prompts on `DEVICE`, the first left-padded by 3."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, vocab_size, (2, 9), generator=g).to(DEVICE)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    return {"input_ids": ids, "attention_mask": mask}
