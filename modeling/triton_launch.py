"""How archlab's Triton kernels (triton_decoding.py, triton_gemv.py) are launched from their `torch.library.triton_op`s:
through `torch.library.wrap_triton`, so `torch.compile` sees the kernel (inductor calls it from its generated code, CUDA
graphs record it), or, under Triton's interpreter (TRITON_INTERPRET=1, which the CPU tests run the kernels on, and
whose kernels `wrap_triton` refuses), as they are: an autotuned kernel with its first configuration (the interpreter
does not benchmark), and not at all while dynamo propagates fake tensors through the op (the op's output is allocated
before its launch). Under the interpreter only dynamo's eager backend runs the op (AOT tracing would record the
launch-free body: an error says so)."""

from __future__ import annotations

import torch


def launchable(kernel, like: torch.Tensor, op: str):
    """`kernel[grid](...)`, as the running Triton allows (module docstring); `like`: one of the op's tensors."""
    if not _interpreted(kernel):
        return torch.library.wrap_triton(kernel)
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


class _FirstConfig:
    def __init__(self, autotuned):
        self.autotuned = autotuned

    def __getitem__(self, grid):
        config = self.autotuned.configs[0]

        def launch(*args, **kwargs):
            size = grid(config.kwargs) if callable(grid) else grid
            return self.autotuned.fn[size](*args, **kwargs, **config.kwargs)

        return launch


__all__ = ["launchable", "registered"]
