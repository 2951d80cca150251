"""How archlab's Triton kernels (triton_decoding.py, triton_gemv.py, triton_moe.py) are launched from their
`torch.library.triton_op`s: through `torch.library.wrap_triton`, so `torch.compile` sees the kernel (inductor calls it
from its generated code, CUDA graphs record it), or, under Triton's interpreter (TRITON_INTERPRET=1, which the CPU
tests run the kernels on, and whose kernels `wrap_triton` refuses), as they are: an autotuned kernel with its first
configuration (the interpreter does not benchmark), and not at all while dynamo propagates fake tensors through the op
(the op's output is allocated before its launch). Under the interpreter only dynamo's eager backend runs the op (AOT
tracing would record the launch-free body: an error says so).

Each op also has a twin, `archlab::<op>_pdl` (`register_pdl_twin`): the same body and schema as a custom op, opaque to
torch.compile (inductor calls it from its generated code like any extern op, CUDA graphs record what it launches),
launching the kernels with programmatic dependent launch on a GPU that has it (Hopper and later: compute capability 9).
A kernel so launched may start while the kernel before it is still running; it waits for that kernel's writes
(`griddepcontrol.wait`, the kernels' `PDL` branch) before it reads or writes anything but a weight (the streaming GEMV's
first block, triton_gemv.py), then lets the next kernel launch (`griddepcontrol.launch_dependents`), so that the launch
latency inside a CUDA graph (~1.6 µs a kernel on an H100: a quarter of a batch-1 decoding step, docs/gpu.md) overlaps
the kernel before. Inductor launches a `triton_op`'s kernels without that attribute in torch 2.11 (its
`triton.enable_pdl` covers inductor's own kernels only), hence the twins. `pdl_applies` says where the callers take
them: a device in `PDL_DEVICES`, empty until `--suite cuda-kernels` and `cuda-tuning` measure them; on CPU (Triton's
interpreter) the twins run without the attribute, which is how the tests check their routing and their schema under
torch.compile."""

from __future__ import annotations

from collections.abc import Callable

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU wheels of torch come without Triton
    triton = None

# Devices on which archlab's kernels are launched through the ops' PDL twins (`pdl_applies`).
PDL_DEVICES: tuple[str, ...] = ()


def pdl_applies(like: torch.Tensor) -> bool:
    """Whether the kernels over `like`'s device go through the ops' `_pdl` twins (module docstring)."""
    return like.device.type in PDL_DEVICES


def archlab_op(name: str, like: torch.Tensor):
    """`torch.ops.archlab.<name>`, or its PDL twin where `pdl_applies` to `like` (one of the call's tensors)."""
    return getattr(torch.ops.archlab, f"{name}_pdl" if pdl_applies(like) else name)


def rows_contiguous(*tensors: torch.Tensor | None) -> list[torch.Tensor | None]:
    """The tensors with unit stride in their last dimension (as the kernels read their rows), copied only where not."""
    return [t.contiguous() if t is not None and t.stride(-1) != 1 else t for t in tensors]


def pdl_launch(like: torch.Tensor) -> bool:
    """Whether a twin launches its kernels dependent on the kernel before (the kernels' `PDL` and Triton's
    `launch_pdl`): on a CUDA device of compute capability 9 or more."""
    return like.is_cuda and torch.cuda.get_device_capability(like.device)[0] >= 9


def register_pdl_twin(op: str, launch: Callable[..., torch.Tensor]) -> None:
    """`archlab::<op>_pdl`: `archlab::<op>`'s schema as a custom op whose body is `launch` (the op's, launching with
    `pdl_launch`), its shapes (fake implementation) the op's own (module docstring)."""
    name = f"{op}_pdl"
    if registered(name):
        return
    original = getattr(torch.ops.archlab, op)
    schema = str(original.default._schema)
    twin = torch.library.custom_op(f"archlab::{name}", launch, mutates_args=(), schema=schema[schema.index("(") :])
    twin.register_fake(lambda *args, **kwargs: original(*args, **kwargs))


if triton is not None:

    @triton.jit
    def dependent_launch(PDL: tl.constexpr):
        """The first thing a kernel does (with `PDL`, launched dependent on the kernel before it): wait for that
        kernel's writes, then let the next kernel launch."""
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()

else:
    dependent_launch = None


def launchable(kernel, like: torch.Tensor, op: str, pdl: bool = False):
    """`kernel[grid](...)`, as the running Triton allows (module docstring); `like`: one of the op's tensors. `pdl`:
    launched with programmatic dependent launch (a twin's body on a GPU that has it; the kernel's `PDL` set too; the
    interpreter has no such launch and runs the kernel as it is)."""
    if not _interpreted(kernel):
        return _Dependent(kernel) if pdl else torch.library.wrap_triton(kernel)
    if torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.PROXY) is not None:
        raise RuntimeError(f"under Triton's interpreter, {op} compiles with backend='eager' only")
    if torch._subclasses.fake_tensor.is_fake(like):
        return _NotLaunched()
    if hasattr(kernel, "configs"):  # triton.autotune's Autotuner
        return _FirstConfig(kernel)
    return kernel


def _interpreted(kernel) -> bool:
    """Whether `kernel` (or the kernel an autotuner wraps) was defined under the interpreter (TRITON_INTERPRET=1)."""
    return any(type(k).__name__ == "InterpretedFunction" for k in (kernel, getattr(kernel, "fn", None)))


def registered(op: str) -> bool:
    """Whether `archlab::<op>` exists: a remote-code copy of a kernel file (transformers_modules.*) imported beside
    archlab, or a second exported model's, finds the first one's (a name is registered once a process)."""
    return hasattr(torch.ops.archlab, op)


class _NotLaunched:
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


class _Dependent:
    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.kernel[grid](*args, **kwargs, launch_pdl=True)


class _FirstConfig:
    def __init__(self, autotuned):
        self.autotuned = autotuned

    def __getitem__(self, grid):
        config = self.autotuned.configs[0]

        def launch(*args, **kwargs):
            size = grid(config.kwargs) if callable(grid) else grid
            return self.autotuned.fn[size](*args, **kwargs, **config.kwargs)

        return launch


__all__ = [
    "PDL_DEVICES",
    "archlab_op",
    "launchable",
    "pdl_applies",
    "pdl_launch",
    "register_pdl_twin",
    "registered",
    "rows_contiguous",
]
