"""Short element-wise chains compiled into one kernel each on CUDA, for the paths that run eagerly.

An eager forward runs every tensor operation as its own kernel, each reading and writing its operands in full: the
rotary embedding of one layer's queries and keys is ~8 kernels (multiply by cos, split, negate, concatenate,
multiply by sin, add), SwiGLU two, and autograd keeps SwiGLU's act(gate) for the backward pass. Liger's
Triton kernels do each chain in one pass; here `torch.compile` (inductor's Triton on CUDA) writes the same fused
kernels from the plain PyTorch formulas, forward and backward, so there is no second implementation to keep equal
to the first. Plain `Trainer`, DeepSpeed and FSDP training run eagerly and take them (inference, below);
compiled code (regional compilation, the compiled decoding steps) does not call them — inductor fuses the formula
there anyway.

`CompiledKernel(function, what, devices)` returns `function`'s result computed by the compiled kernel where it may
run — a device in `devices()`, not already compiling or tracing, dynamo not disabled (`TORCHDYNAMO_DISABLE=1`) — and
None otherwise, for the caller to run the formula. Shapes are automatically dynamic (a second length compiles one
graph with symbolic sizes, which later lengths reuse). If the compiler fails (no working Triton for the GPU), one
logged line says so and the formula runs from then on. A call that would compile past dynamo's recompile limit (a
process that runs many dtypes, ranks and sizes: a test session, a sweep over models), or inside a caller's
`error_on_recompile`, runs the formula instead, once logged; the graphs already compiled keep serving their shapes.
The first call of each kernel compiles (seconds on a GPU).

`FUSED_KERNEL_DEVICES` lists where the element-wise kernels compile: CUDA. On CPU the formulas' kernels are already
memory-bound C++ loops and a compile does not pay; `()` turns them off everywhere.

A compiled call costs the host more than the formula's few operators: dynamo's guards and the compiled function's
wrappers (the eager forward of a tiny 22-layer model on a 2-core CPU: 20.6 ms with the kernels, 14.2 ms with the
formulas, ~150 µs more per call). Training pays it back (one pass each way over activations of thousands of
tokens, and less kept for the backward pass); inference without gradients gains only the formula's extra passes,
and an eager inference forward of few tokens is bound by the host — generate's prefill of one prompt (on an H100
archlab's eager 2048-token prefill ran at 0.89× Llama's, the GPU busy a third of the time) and every eager decoding
step (the dynamic cache on CUDA). So where no gradient is recorded, the element-wise kernels compile only tensors of
at least `INFERENCE_MIN_ELEMENTS` elements (2²⁴: a prefill of 8,192 tokens × 2,048 query channels), where the
formula's extra passes outweigh the host's cost; below, the formula runs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers.utils import logging

logger = logging.get_logger(__name__)

# Where the element-wise chains (rotary embedding, gated activations) run as compiled kernels.
FUSED_KERNEL_DEVICES: tuple[str, ...] = ("cuda",)
# Without gradients, the element-wise kernels compile only tensors this large (module docstring); 0: every tensor.
INFERENCE_MIN_ELEMENTS = 1 << 24


def _dynamo_disabled() -> bool:
    return bool(getattr(torch._dynamo.config, "disable", False))


def _records_gradient(args) -> bool:
    """Whether autograd records a call on `args`: gradients on, and a tensor among them that wants one."""
    return torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)


class CompiledKernel:
    """`function` compiled (fullgraph, automatic dynamic shapes), per device type, called where it may run."""

    def __init__(
        self,
        function: Callable,
        what: str,
        devices: Callable[[], tuple[str, ...]],
        inference_min_elements: Callable[[], int] = lambda: 0,
    ) -> None:
        self.function = function
        self.what = what
        self.devices = devices
        self.inference_min_elements = inference_min_elements  # calls recording no gradient, smaller: the formula
        self.compiled: dict[str, Callable | None] = {}  # by device type; None once the compiler failed there
        self.told_no_recompile = False

    def applies(self, args: tuple, devices: tuple[str, ...]) -> bool:
        """Whether a call on `args` would run the compiled kernel were it to serve `devices`: the first tensor
        argument's device is one of them, nothing traces or compiles the call already, and it records a gradient or
        is large enough. (The tests' run with the CUDA paths opened to the CPU is chosen by it: tests/cuda_paths.py.)"""
        if args[0].device.type not in devices or torch.compiler.is_compiling() or torch.jit.is_tracing():
            return False
        if _dynamo_disabled():
            return False
        return args[0].numel() >= self.inference_min_elements() or _records_gradient(args)

    def serves(self, *args) -> bool:
        """Whether a call on `args` runs the compiled kernel: where it does not, the caller runs `function` without
        preparing the kernel's arguments (a decoding step pays for nothing it does not use)."""
        return self.applies(args, self.devices())

    def __call__(self, *args):
        """`function(*args)` from the compiled kernel (the first tensor argument's device decides), or None where
        the caller should run `function` itself."""
        if not self.serves(*args):
            return None
        device_type = args[0].device.type
        if device_type not in self.compiled:
            self.compiled[device_type] = torch.compile(self.function, fullgraph=True)
        compiled = self.compiled[device_type]
        if compiled is None:
            return None
        try:
            return compiled(*args)
        except torch._dynamo.exc.BackendCompilerFailed as error:
            self.compiled[device_type] = None
            logger.warning(f"Compiling {self.what} failed ({error.inner_exception!r}); it runs eagerly.")
            return None
        except (torch._dynamo.exc.FailOnRecompileLimitHit, torch._dynamo.exc.RecompileError) as error:
            # a new shape or dtype that may not compile: this call runs the formula (no compile happened, nothing
            # ran), the shapes compiled so far keep their kernels
            if not self.told_no_recompile:
                self.told_no_recompile = True
                logger.warning(
                    f"{self.what}: a new shape past dynamo's recompile limit runs eagerly ({type(error).__name__})."
                )
            return None


def elementwise_kernel(function: Callable, what: str) -> CompiledKernel:
    """A `CompiledKernel` on `FUSED_KERNEL_DEVICES`, calls without gradients from `INFERENCE_MIN_ELEMENTS` elements
    (both read at each call)."""
    return CompiledKernel(function, what, lambda: FUSED_KERNEL_DEVICES, lambda: INFERENCE_MIN_ELEMENTS)


__all__ = ["FUSED_KERNEL_DEVICES", "INFERENCE_MIN_ELEMENTS", "CompiledKernel", "elementwise_kernel"]
