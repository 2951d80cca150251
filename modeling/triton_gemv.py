"""A gated MLP's down projection for a few rows (a decoding step) as one Triton kernel with the activation inside:
down(act(gate) ⊙ up) read as a matrix-vector product whose vector is computed while the matrix streams in
(SwiGLU, Shazeer 2020; the fused-GEMV idea of gpt-fast and of "megakernel" decoders).

Why: in a batch-1 decoding step of the 1.1B model on an H100 (docs/gpu.md, the decode-1 profile) the MLP's tail is
three kernels a layer: inductor's SwiGLU (1.1 µs), cuBLAS's down GEMV split in two along its 5,632 inputs (11.6 µs,
~2 TB/s: 60 % of the bandwidth for 23 MB) and the split's reduction kernel (1.5 µs), each launch also leaving the GPU
idle ~1.6 µs in the CUDA graph: ~17 µs a layer where streaming 23 MB takes ~7 µs. Here one kernel does it: each
program owns `BLOCK_N` outputs, streams their rows of the weight in blocks of `BLOCK_K` inputs, and computes the
matching act(gate) ⊙ up block itself (gate and up are a few kB, read from L2 by every program), rounded to the
weights' dtype as the unfused path rounds it, accumulating in fp32 element-wise (summed across threads once, after the
loop), the loop unrolled so that several blocks' loads are in flight at once. Block sizes, warps and the unrolling
are autotuned per (rows, outputs, inputs) the first time a shape runs (`triton.autotune`). The first H200 run
measured the first version (a sum across threads in every block, no unrolling: its compiled code waited on each
block's load in turn) at 0.88× the default step; the second is for the next GPU session.

`gated_down` is a `torch.library.triton_op`: inductor calls it from the decoding step's generated code, CUDA graphs
record it. Where it applies (`gated_down_applies`): at most `MAX_ROWS` rows (a decoding step of a small batch),
Triton importable, a device in `GATED_DOWN_DEVICES`, SiLU as the activation, fp32/fp16/bf16, inference (no gradient:
the kernel has no backward). Everything else runs as before. `GATED_DOWN_DEVICES` is empty until `--suite
cuda-tuning`'s row measures it on a GPU; on CPU the tests run the kernel through Triton's interpreter
(tests/triton_interpreter.py) against the unfused formula.
"""

from __future__ import annotations

import torch

from .triton_launch import launchable, registered

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU wheels of torch come without Triton: nothing here applies
    triton = None

# Devices on which a gated MLP's down projection of a few rows runs through `gated_down` (`gated_down_applies`).
GATED_DOWN_DEVICES: tuple[str, ...] = ()
# The most rows (tokens) the kernel takes: each program keeps one fp32 accumulator row per token
MAX_ROWS = 4
ACTIVATIONS = ("silu", "swish")


def gated_down_applies(module, gate: torch.Tensor) -> bool:
    """Whether `module`'s (a GatedMLP) down projection of act(`gate`) ⊙ up runs through `gated_down`."""
    return (
        triton is not None
        and gate.device.type in GATED_DOWN_DEVICES  # first: no guard on a traced length where it is not listed
        and gate.numel() // gate.shape[-1] <= MAX_ROWS
        and module.hidden_act in ACTIVATIONS
        and gate.dtype in (torch.float32, torch.float16, torch.bfloat16)
        and module.down_proj.weight.dtype == gate.dtype
        and module.down_proj.weight.stride(-1) == 1
        and not (torch.is_grad_enabled() and (gate.requires_grad or module.down_proj.weight.requires_grad))
    )


if triton is not None:

    @triton.autotune(
        configs=[
            triton.Config({"BLOCK_N": n, "BLOCK_K": k, "UNROLL": unroll}, num_warps=warps, num_stages=1)
            for n, k, unroll, warps in [
                (4, 512, 4, 4),
                (8, 256, 4, 4),
                (8, 512, 2, 4),
                (8, 512, 4, 8),
                (16, 256, 2, 4),
                (16, 512, 2, 8),
                (4, 1024, 2, 4),
                (8, 1024, 2, 8),
            ]
        ],
        key=["rows", "outputs", "inputs"],
    )
    @triton.jit
    def _gated_down_kernel(
        gate_ptr, up_ptr, w_ptr, bias_ptr, y_ptr,
        rows, outputs, inputs,
        gate_m, up_m, w_n, y_m,
        ROWS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        UNROLL: tl.constexpr,
    ):  # fmt: skip
        """One program: outputs [pid · BLOCK_N, + BLOCK_N) of every row (ROWS: `rows` rounded up to a power of two).
        The products accumulate element-wise and are summed once after the loop, and the loop is unrolled UNROLL
        times: the unrolled blocks' loads are issued together (Triton does not pipeline loads that feed no `tl.dot`,
        and a sum across threads in every block would wait on each block's load in turn)."""
        pid = tl.program_id(0)
        ns = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = ns < outputs
        ms = tl.arange(0, ROWS)
        m_ok = ms < rows
        acc = tl.zeros([ROWS, BLOCK_N, BLOCK_K], tl.float32)
        for first in tl.range(0, tl.cdiv(inputs, BLOCK_K), loop_unroll_factor=UNROLL):
            ks = first * BLOCK_K + tl.arange(0, BLOCK_K)
            k_ok = ks < inputs
            w = tl.load(w_ptr + ns[:, None] * w_n + ks[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            both = m_ok[:, None] & k_ok[None, :]
            gate = tl.load(gate_ptr + ms[:, None] * gate_m + ks[None, :], mask=both, other=0.0).to(tl.float32)
            up = tl.load(up_ptr + ms[:, None] * up_m + ks[None, :], mask=both, other=0.0).to(tl.float32)
            # act(gate) ⊙ up in fp32, rounded to the weights' dtype as the unfused step hands it to the product
            hidden = (gate * tl.sigmoid(gate) * up).to(w.dtype).to(tl.float32)
            acc += hidden[:, None, :] * w.to(tl.float32)[None, :, :]
        total = tl.sum(acc, axis=2)
        if HAS_BIAS:
            total += tl.load(bias_ptr + ns, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        out_ok = m_ok[:, None] & n_ok[None, :]
        tl.store(y_ptr + ms[:, None] * y_m + ns[None, :], total.to(y_ptr.dtype.element_ty), mask=out_ok)


if triton is not None and not registered("gated_down"):

    @torch.library.triton_op("archlab::gated_down", mutates_args=())
    def _gated_down_op(
        gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        inputs = gate.shape[-1]
        outputs = weight.shape[0]
        gate2, up2 = gate.reshape(-1, inputs), up.reshape(-1, inputs)
        rows = gate2.shape[0]
        output = gate.new_empty(rows, outputs)

        def grid(meta):
            return (triton.cdiv(outputs, meta["BLOCK_N"]),)

        launchable(_gated_down_kernel, gate, "gated_down")[grid](
            gate2, up2, weight, weight if bias is None else bias, output,
            rows, outputs, inputs,
            gate2.stride(0), up2.stride(0), weight.stride(0), output.stride(0),
            ROWS=triton.next_power_of_2(rows), HAS_BIAS=bias is not None,
        )  # fmt: skip
        return output.reshape(*gate.shape[:-1], outputs)


def gated_down(module, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`module.down_proj(act(gate) ⊙ up)` for a GatedMLP with SiLU, as one kernel (module docstring)."""
    if gate.stride(-1) != 1 or up.stride(-1) != 1:
        gate, up = gate.contiguous(), up.contiguous()
    return torch.ops.archlab.gated_down(gate, up, module.down_proj.weight, module.down_proj.bias)


__all__ = ["GATED_DOWN_DEVICES", "MAX_ROWS", "gated_down", "gated_down_applies"]
