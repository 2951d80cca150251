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
them: a device in `PDL_DEVICES` (CUDA by default: on an H200 the fused layer step launched so took 46 µs against 83
without, and the batch-1 decoding step with the twins ran at 1.25x the default before; below compute capability 9
the twins launch without the attribute). Through the twins, too, torch.compile never traces the kernels: the
wrapped launches (`torch.library.wrap_triton`) depend on torch's analysis of a kernel's writes, which torch 2.11
failed on (test_triton_compile.py), and then copied every argument, weights too, around each launch. On CPU
(Triton's interpreter) the twins run without the attribute, which is how the tests check their routing and their
schema under torch.compile.

Launched directly (a twin's body, or an op called outside torch.compile), an autotuned kernel meets a new autotuning
key (a new shape) with every configuration compiled at once, in threads (`compile_configs_at_once`: Triton's
`AsyncCompileMode`; its compiler releases the GIL), before the autotuner benchmarks them: it would otherwise compile
each in turn inside its benchmark — a decoding step's first call meets some 30-50 configurations (~0.4 s each on the
development CPU). Inductor compiles the configurations of the kernels it launches itself in its own worker pool."""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch
from transformers.utils import logging

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU wheels of torch come without Triton
    triton = None
try:
    from triton.runtime._async_compile import AsyncCompileMode
except ImportError:  # no Triton, or one before 3.4
    AsyncCompileMode = None

logger = logging.get_logger(__name__)

# The device type of NVIDIA GPUs under torch's CUDA build; none under its ROCm build, which calls AMD GPUs "cuda" too:
# archlab's decoding kernels are measured and tested on NVIDIA GPUs only, their default there (this tuple)
NVIDIA_GPUS: tuple[str, ...] = ("cuda",) if torch.version.hip is None else ()
# Devices on which archlab's kernels are launched through the ops' PDL twins (`pdl_applies`).
PDL_DEVICES: tuple[str, ...] = NVIDIA_GPUS


# The oldest NVIDIA GPUs the kernels run on: Ampere (compute capability 8.0), the oldest architecture CI compiles them
# for (test_triton_compile.py: sm80 and sm90); a Turing or Volta GPU (a T4, a V100) keeps PyTorch's path
MIN_CAPABILITY = (8, 0)
# Whether eager CUDA code takes the kernels too (`kernels_fit`: compiled steps only by default); the GPU tests set it
# to check the kernels eagerly against PyTorch's path
EAGER_ON_CUDA = False


def kernels_fit(like: torch.Tensor) -> bool:
    """Whether archlab's decoding kernels may run on `like`'s device: a CUDA GPU of `MIN_CAPABILITY` or later, in a
    step torch.compile traces (a compiled decoding step, replayed as a CUDA graph), or any other device a caller lists
    (the CPU tests run them through Triton's interpreter). Eager CUDA code (transformers' loop on a dynamic cache,
    a prefill) keeps PyTorch's ops: it waits on the host, and each kernel's launch from Python (a custom op, Triton's
    launcher, an autotuner's lookup) costs more host time than the few ATen ops it replaces."""
    if like.device.type != "cuda":
        return True
    return (EAGER_ON_CUDA or torch.compiler.is_compiling()) and _capability_fits(like.device.index)


@torch.compiler.assume_constant_result  # a fact of the machine: a traced step neither guards on it nor breaks
def _capability_fits(index: int | None) -> bool:
    return torch.cuda.get_device_capability(index) >= MIN_CAPABILITY


def pdl_applies(like: torch.Tensor) -> bool:
    """Whether the kernels over `like`'s device go through the ops' `_pdl` twins (module docstring)."""
    return like.device.type in PDL_DEVICES


def archlab_op(name: str, like: torch.Tensor):
    """`torch.ops.archlab.<name>`, or its PDL twin where `pdl_applies` to `like` (one of the call's tensors)."""
    return getattr(torch.ops.archlab, f"{name}_pdl" if pdl_applies(like) else name)


def rows_contiguous(*tensors: torch.Tensor | None) -> list[torch.Tensor | None]:
    """The tensors with unit stride in their last dimension (as the kernels read their rows), copied only where not."""
    return [t.contiguous() if t is not None and t.stride(-1) != 1 else t for t in tensors]


def has_dependent_launch(device: torch.device) -> bool:
    """Whether `device` has programmatic dependent launch: an NVIDIA GPU of compute capability 9 or more (torch's
    ROCm build calls AMD GPUs "cuda" too, and an MI300 reports 9.4)."""
    return device.type == "cuda" and torch.version.hip is None and torch.cuda.get_device_capability(device)[0] >= 9


def pdl_launch(like: torch.Tensor) -> bool:
    """Whether a twin launches its kernels dependent on the kernel before (the kernels' `PDL` and Triton's
    `launch_pdl`): where the device has it (`has_dependent_launch`)."""
    return has_dependent_launch(like.device)


def register_pdl_twin(op: str, launch: Callable[..., torch.Tensor]) -> None:
    """`archlab::<op>_pdl`: `archlab::<op>`'s schema as a custom op whose body is `launch` (the op's, launching with
    `pdl_launch`), writing the arguments the op writes, its shapes (fake implementation) the op's own (module
    docstring)."""
    name = f"{op}_pdl"
    if registered(name):
        return
    original = getattr(torch.ops.archlab, op)
    schema = str(original.default._schema)
    written = [arg.name for arg in original.default._schema.arguments if arg.alias_info and arg.alias_info.is_write]
    twin = torch.library.custom_op(f"archlab::{name}", launch, mutates_args=written, schema=schema[schema.index("(") :])
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
        launcher = _Dependent(kernel) if pdl else torch.library.wrap_triton(kernel)
        autotuned = hasattr(kernel, "configs")  # triton.autotune's Autotuner
        return _ConfigsCompiledFirst(kernel, launcher, pdl) if autotuned and not _traced(like) else launcher
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


def _traced(like: torch.Tensor) -> bool:
    """Whether the op is traced (fake tensors, a proxy mode, dynamo), not run: its launch then goes into a graph."""
    proxy = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.PROXY) is not None
    return proxy or torch.compiler.is_compiling() or torch._subclasses.fake_tensor.is_fake(like)


class _ConfigsCompiledFirst:
    """`launcher[grid](...)` after `compile_configs_at_once` (with `pdl`, for a launch with Triton's `launch_pdl`)."""

    def __init__(self, kernel, launcher, pdl: bool):
        self.kernel, self.launcher, self.pdl = kernel, launcher, pdl

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            compile_configs_at_once(self.kernel, args, {**kwargs, "launch_pdl": True} if self.pdl else kwargs)
            return self.launcher[grid](*args, **kwargs)

        return launch


# (kernel, autotuning key) pairs whose configurations were compiled at once, or tried
_CONFIGS_COMPILED: set[tuple] = set()


def autotuning_key(kernel, args: tuple, kwargs: dict) -> tuple:
    """The key under which Triton's autotuner keeps `kernel`'s choice for this launch: the values of its `key`
    arguments, then the dtypes of its tensor arguments (as `Autotuner.run` computes it)."""
    named = {**dict(zip(kernel.arg_names, args)), **kwargs}
    named = {name: value for name, value in named.items() if name in kernel.arg_names}
    key = [named[name] for name in kernel.keys if name in named]
    return tuple(key + [str(value.dtype) for value in named.values() if hasattr(value, "dtype")])


def compile_configs_at_once(kernel, args: tuple, kwargs: dict) -> None:
    """Every configuration of the autotuned `kernel` compiled for this launch, in parallel, the first time its
    autotuning key is met (module docstring); the autotuner then finds them compiled. Not for a kernel without
    configurations, a key met before or one the autotuner already chose for; anything that fails here (one logged
    line) is left to the autotuner, which compiles the configurations itself as it would have."""
    configs = getattr(kernel, "configs", None)
    if AsyncCompileMode is None or configs is None or len(configs) < 2:
        return
    key = autotuning_key(kernel, args, kwargs)
    if (kernel, key) in _CONFIGS_COMPILED or key in getattr(kernel, "cache", {}):
        return
    _CONFIGS_COMPILED.add((kernel, key))
    try:
        with (
            ThreadPoolExecutor(max_workers=min(len(configs), os.cpu_count() or 1)) as pool,
            AsyncCompileMode(pool, ignore_errors=True),
        ):
            for config in configs:
                kernel.fn.warmup(*args, grid=(1,), **kwargs, **config.all_kwargs())
    except Exception as error:  # whatever it is, the autotuner compiles as before
        logger.warning_once(f"Compiling {kernel.fn.__name__}'s configurations at once failed ({error!r}).")


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
    "EAGER_ON_CUDA",
    "MIN_CAPABILITY",
    "NVIDIA_GPUS",
    "PDL_DEVICES",
    "archlab_op",
    "compile_configs_at_once",
    "has_dependent_launch",
    "kernels_fit",
    "launchable",
    "pdl_applies",
    "pdl_launch",
    "register_pdl_twin",
    "registered",
    "rows_contiguous",
]
