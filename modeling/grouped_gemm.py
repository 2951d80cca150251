"""Grouped GEMMs for the mixture of experts: one matrix product per expert over its rows of an expert-sorted
batch, in one kernel call (`torch.nn.functional.grouped_mm`), with the backward pass written out as two more
grouped GEMMs. `offsets[e]` is the end row of expert e's group.

Under torch.compile the kernels are opaque custom ops with their own shape functions (the meta function of
`aten._grouped_mm` accepts only bf16), so compiled graphs call the same code eager does. Builds without
grouped_mm (torch < 2.9) or with feature sizes the kernel cannot stride over (it needs rows of a multiple of 16
bytes) fall back to one GEMM per expert, which reads the offsets on the host. While a CUDA graph is being recorded,
dtypes the kernel does not take (it runs bf16; ATen's fallback for the others reads the offsets on the host too) run
every expert over every row and keep each row's own (`_grouped_mm_masked`): E times the FLOPs of the few rows of a
decoding step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)

# --------------------------------------------------------------------------------------------------------------
# Grouped GEMM: rows sorted by expert, `offsets[e]` = end row of expert e's group.


# The dtypes grouped_mm takes (float64 raised "Expected mat_a to be Float32, BFloat16 or Float16 matrix").
_GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _rows_aligned(*tensors: torch.Tensor) -> bool:
    """grouped_mm needs a dtype it takes and every non-unit stride a multiple of 16 bytes (a static, shape-only
    check); the per-expert fallback computes the rest."""
    return all(t.dtype in _GROUPED_MM_DTYPES for t in tensors) and all(
        (stride * t.element_size()) % 16 == 0 for t in tensors for stride in t.stride() if stride != 1
    )


def _must_not_read_offsets_on_host(a: torch.Tensor) -> bool:
    """Whether a grouped GEMM over `a` must avoid every path that reads the offsets on the host: while a CUDA graph
    is being recorded (decoding's compiled step), for dtypes grouped_mm's CUDA kernel does not take (it runs bf16;
    others go to an ATen fallback that copies the offsets to the CPU, which a recording refuses)."""
    return a.is_cuda and a.dtype != torch.bfloat16 and torch.cuda.is_current_stream_capturing()


def _row_groups(a: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The group of each row of a (len(offsets) for rows past the last group), on the device."""
    rows = torch.arange(a.shape[0], device=a.device, dtype=offsets.dtype)
    return torch.searchsorted(offsets, rows, right=True)


def _grouped_mm_masked(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """`_grouped_mm_eager` with no host read: each expert's product over every row, kept on its own rows. E times
    the FLOPs; used only where nothing else can be recorded (fp32 or fp16 decoding steps, a few rows each)."""
    groups = _row_groups(a, offsets).unsqueeze(1)
    out = a.new_zeros(a.shape[0], b.shape[-1])
    for expert in range(b.shape[0]):
        out = torch.where(groups == expert, a @ b[expert], out)
    return out


def _grouped_mm_tn_masked(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """`_grouped_mm_tn_eager` with no host read (see `_grouped_mm_masked`)."""
    groups = _row_groups(a, offsets).unsqueeze(1)
    return torch.stack([torch.where(groups == expert, a, 0).t() @ b for expert in range(offsets.shape[0])])


def _grouped_mm_eager(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Rows of group e of a (S, K) times b[e] (K, N) -> (S, N); one GEMM per expert without the kernel."""
    if _must_not_read_offsets_on_host(a):
        return _grouped_mm_masked(a, b, offsets)
    if _GROUPED_MM is not None and _rows_aligned(a, b):
        return _GROUPED_MM(a, b, offs=offsets)
    out = a.new_empty(a.shape[0], b.shape[-1])
    start = 0
    for expert, end in enumerate(offsets.tolist()):  # fallback only: reads the offsets on the host
        out[start:end] = a[start:end] @ b[expert]
        start = end
    return out


def _grouped_mm_tn_eager(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Per group e: a[rows of e]ᵀ @ b[rows of e] -> (E, M, N), zeros for empty groups (the weight gradient)."""
    if _must_not_read_offsets_on_host(a):
        return _grouped_mm_tn_masked(a, b, offsets)
    a_t = a.t()
    if _GROUPED_MM is not None and _rows_aligned(a_t, b):
        return _GROUPED_MM(a_t, b, offs=offsets)
    out = a.new_zeros(offsets.shape[0], a.shape[1], b.shape[1])
    start = 0
    for expert, end in enumerate(offsets.tolist()):
        out[expert] = a[start:end].t() @ b[start:end]
        start = end
    return out


# Under compilation the kernels are opaque custom ops (eager calls them directly and skips the dispatcher cost).
@torch.library.custom_op("archlab::grouped_mm", mutates_args=())
def _grouped_mm_op(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return _grouped_mm_eager(a, b, offsets)


@_grouped_mm_op.register_fake
def _(a, b, offsets):
    return a.new_empty(a.shape[0], b.shape[-1])


@torch.library.custom_op("archlab::grouped_mm_tn", mutates_args=())
def _grouped_mm_tn_op(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return _grouped_mm_tn_eager(a, b, offsets)


@_grouped_mm_tn_op.register_fake
def _(a, b, offsets):
    return a.new_empty(offsets.shape[0], a.shape[1], b.shape[1])


def _grouped_mm(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return _grouped_mm_op(a, b, offsets) if torch.compiler.is_compiling() else _grouped_mm_eager(a, b, offsets)


def _grouped_mm_tn(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return _grouped_mm_tn_op(a, b, offsets) if torch.compiler.is_compiling() else _grouped_mm_tn_eager(a, b, offsets)


class GroupedLinear(torch.autograd.Function):
    """y[rows of e] = x[rows of e] @ weight[e]ᵀ for weight (E, out, in) stored like nn.Linear, rows sorted by e."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, weight, offsets)
        return _grouped_mm(x, weight.transpose(1, 2), offsets)  # (S, out)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):  # type: ignore[override]
        x, weight, offsets = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        grad_x = _grouped_mm(grad_out, weight, offsets) if ctx.needs_input_grad[0] else None  # (S, in)
        grad_weight = _grouped_mm_tn(grad_out, x, offsets) if ctx.needs_input_grad[1] else None  # (E, out, in)
        return grad_x, grad_weight, None


def grouped_compute_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype `grouped_linear` multiplies in: autocast's where it is on (as `nn.Linear`), else the weight's."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return weight.dtype


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Grouped `F.linear` over expert-sorted rows; follows autocast like `nn.Linear` does."""
    dtype = grouped_compute_dtype(x, weight)
    return GroupedLinear.apply(x.to(dtype), weight.to(dtype), offsets)


__all__ = ["GroupedLinear", "grouped_compute_dtype", "grouped_linear"]
