"""Matrix-vector products of a decoding step (a few rows) as Triton kernels with the work around them inside: an
RMSNorm of the input before the product, SiLU(gate) ⊙ up before or after it, a residual added after (RMSNorm, Zhang
& Sennrich 2019; SwiGLU, Shazeer 2020; the fused-GEMV idea of gpt-fast and of "megakernel" decoders).

Why: a batch-1 decoding step of the 1.1B model on an H100 (docs/gpu.md, the decode-1 profile) is ~12 kernels a
layer, and each launch leaves the GPU idle ~1.6 µs in the CUDA graph: ~25 µs of a layer's ~80. The products around
which the small kernels sit run at 45-68 % of the bandwidth (cuBLAS's q/k/v and o GEMVs ~1.5 TB/s, its down GEMV split
in two plus a reduction kernel). Here one kernel streams a weight and does the element-wise work beside it:

    PLAIN       y = W x (+ b) (+ r)                       the output and down projections, the residual after them
    RMS_NORM    y = W (g ⊙ x / rms(x)) (+ b) (+ r)        q/k/v, with the layer's norm before it
    SILU_GATED  y = W (silu(gate) ⊙ up) (+ b) (+ r)        a down projection with SwiGLU before it (`gated_down`)
    GATED       h = silu(gate) ⊙ up, [gate, up] = W x'    the gate/up product ([gate; up] as one weight, x' as
                                                           PLAIN or RMS_NORM computes it) with SwiGLU after it

so that a pre-norm layer's step is four of them beside RoPE and attention (decode_block.py: RMS_NORM q/k/v, PLAIN
output + residual, RMS_NORM gate/up GATED, PLAIN down + residual). Each program streams `BLOCK_N` rows of the weight
(its BLOCK_N outputs; GATED, its BLOCK_N / 2 outputs' gate and up rows side by side, so that SwiGLU pairs them in
the program's epilogue) in blocks of `BLOCK_K` inputs and computes the matching block of the input itself (x, g, gate
and up are a few kB, read from L2 by every program), accumulating in fp32 element-wise (summed across threads once,
after the loop), the loop unrolled so that several blocks' loads are in flight at once. RMSNorm takes one pass: the
squares of x accumulate beside the products and 1/rms scales the sums after the loop (the unfused path rounds x /
rms to the weights' dtype first; in half precision this is within that rounding). SwiGLU, before or after, rounds as
the unfused path: the gate/up product to the output's dtype, silu(gate) ⊙ up to it again; the product is rounded to
the output's dtype before the residual is added, as the unfused path adds it.

Two kernels, three forms by rows: the streaming kernel, which multiplies a (BLOCK_N × BLOCK_K) tile of the weight by
each row's block of the input in the registers both were loaded into (one accumulator a row), autotuned over blocks
for one row (`_gemv_row_kernel`: a batch-1 step) and for 2 to `STREAMED_ROWS` rows (`_gemv_kernel`); 5-16 rows (a
batch of decoding rows, beams, speculative tokens; `_dot_kernel`) a 16-row block of the input by a block of the
weight on the tensor cores (`tl.dot`, the input rounded to the weights' dtype first), the weight blocks pipelined by
Triton — split-K where its tiles of 16-64 outputs would leave a GPU's processors idle (`split_count`: the 1.1B
model's q/k/v, output and down products are 64-80 tiles of 32 on an H200's 132 processors, each tile one program
streaming its whole input; they measured 0.7-1.4 TB/s at 16 rows): each program takes a share of the input blocks and
stores its float32 sums, and a second kernel (`_split_sum_kernel`) adds the shares up in split order (the same bits
every call) and runs the epilogue. Block sizes, warps, stages and the unrolling are autotuned per (rows,
outputs, inputs, prologue, gated) the first time a shape runs (`triton.autotune`). The sixth GPU session (H200,
docs/gpu.md) timed the one-row GEMVs at 1.5× cuBLAS but only 44-61 % of the bandwidth, when one row ran through the
three-dimensional (rows × BLOCK_N × BLOCK_K) tile: its compiled loop passed every weight block and the input through
shared memory, a barrier for each (at 1-4 rows the loops now hold neither: test_triton_compile.py); and the
tensor-core kernel's SwiGLU prologue at 16 rows at 0.14× (77 µs against 11): computed in the dot operand's layout,
each of a program's warps recomputed it for every block (~1,200 instructions a loop against ~80 without), which
SwiGLU after the gate/up product (GATED) does once per output.

`gemv`, `gated_gemv` and `gated_down` are `torch.library.triton_op`s: inductor calls them from the decoding step's
generated code, CUDA graphs record them. Their PDL twins (triton_launch.py) launch the kernels dependent on the kernel
before; the streaming kernels then read their first weight block before they wait for that kernel (no kernel of a
decoding step writes a weight), the input after. A gated MLP outside the fused step uses `gated_down` alone where
`gated_down_applies`: at most `MAX_ROWS` rows (a decoding step of a small batch), Triton importable, a device in
`GATED_DOWN_DEVICES`, SiLU, fp32/fp16/bf16, inference (no gradient: the kernels have no backward).
`GATED_DOWN_DEVICES` is empty (the fifth GPU session measured a first version at 0.88× the default step); on CPU the
tests run the kernels through Triton's interpreter (tests/triton_interpreter.py) against the unfused formulas.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from .triton_launch import (
    archlab_op,
    dependent_launch,
    launchable,
    pdl_launch,
    register_pdl_twin,
    registered,
    rows_contiguous,
)

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU wheels of torch come without Triton: nothing here applies
    triton = None

# Devices on which a gated MLP's down projection of a few rows runs through `gated_down` (`gated_down_applies`).
GATED_DOWN_DEVICES: tuple[str, ...] = ()
# The most rows (tokens) the kernels take: up to `STREAMED_ROWS` the streaming kernel (one fp32 accumulator row per
# token, element-wise), above that the tensor-core kernel (`_dot_kernel`: rows padded to 16, a `tl.dot` per block)
STREAMED_ROWS = 4
MAX_ROWS = 16
ACTIVATIONS = ("silu", "swish")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# What the kernel computes its input from (`PROLOGUE`, module docstring)
PLAIN, RMS_NORM, SILU_GATED = 0, 1, 2
# Split-K of the tensor-core kernel (`split_count`): programs wanted per multiprocessor, the most shares, the fewest
# inputs a share; the weight rows a program of the kernel that adds the shares up takes; the multiprocessors counted
# on a device that is not CUDA's (Triton's interpreter on a CPU: none, so no split, unless a test sets some)
SPLIT_PROGRAMS_PER_PROCESSOR = 2
MAX_SPLITS = 8
MIN_SPLIT_INPUTS = 512
SUM_LANES = 64
PROCESSORS_ELSEWHERE = 0


def gated_down_applies(module, gate: torch.Tensor) -> bool:
    """Whether `module`'s (a GatedMLP) down projection of act(`gate`) ⊙ up runs through `gated_down`."""
    return (
        triton is not None
        and gate.device.type in GATED_DOWN_DEVICES  # first: no guard on a traced length where it is not listed
        and type(module.down_proj) is nn.Linear  # (not BitNet's BitLinear, LoRA's, a quantized layer)
        and gemv_applies(gate, module.down_proj.weight)
        and module.hidden_act in ACTIVATIONS
        and not module.clamped  # (GPT-OSS's clamps and offset: the kernel computes act(gate) ⊙ up)
        and module.ffn_sub_norm is None  # (Sub-LN: a norm between act(gate) ⊙ up and the down projection)
    )


def gemv_applies(x: torch.Tensor, *weights: torch.Tensor | None) -> bool:
    """Whether the kernel takes input `x` against `weights` (the matrix; a norm's gain, a bias ...; None skipped): at
    most `MAX_ROWS` rows, one dtype of fp32/fp16/bf16, the matrix's rows contiguous, no gradient wanted. The device
    is the caller's to check (it decides whether a traced step guards on anything else)."""
    present = [weight for weight in weights if weight is not None]
    return (
        triton is not None
        and x.numel() // x.shape[-1] <= MAX_ROWS
        and x.dtype in DTYPES
        and all(weight.dtype == x.dtype for weight in present)
        and present[0].stride(-1) == 1
        and not (torch.is_grad_enabled() and (x.requires_grad or any(w.requires_grad for w in present)))
    )


if triton is not None:

    @triton.jit
    def _weight_block(w_ptr, ws, w_ok, first, inputs, w_n, BLOCK_K: tl.constexpr):
        """Block `first` of inputs of the weight's rows `ws`."""
        ks = first * BLOCK_K + tl.arange(0, BLOCK_K)
        return tl.load(w_ptr + ws[:, None] * w_n + ks[None, :], mask=w_ok[:, None] & (ks < inputs)[None, :], other=0.0)

    @triton.jit
    def _input_block(
        x_ptr, up_ptr, gain_ptr, w_ptr, ms, m_ok, first, inputs, x_m, up_m, squares,
        PROLOGUE: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """Block `first` of the product's input (fp32) as PROLOGUE computes it; `squares` += x² for RMS_NORM."""
        ks = first * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = ks < inputs
        both = m_ok[:, None] & k_ok[None, :]
        x = tl.load(x_ptr + ms[:, None] * x_m + ks[None, :], mask=both, other=0.0).to(tl.float32)
        if PROLOGUE == 2:  # SILU_GATED: x is the gate; act(gate) ⊙ up rounded as the unfused step rounds it
            up = tl.load(up_ptr + ms[:, None] * up_m + ks[None, :], mask=both, other=0.0).to(tl.float32)
            x = (x * tl.sigmoid(x) * up).to(w_ptr.dtype.element_ty).to(tl.float32)
        elif PROLOGUE == 1:  # RMS_NORM: the gain now, 1/rms after the loop
            squares += x * x
            x = x * tl.load(gain_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        return x, squares

    @triton.jit
    def _block_of_weight_and_input(
        x_ptr, up_ptr, gain_ptr, w_ptr, ws, w_ok, ms, m_ok, first, inputs, x_m, up_m, w_n, squares,
        PROLOGUE: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """Block `first` of inputs: the weight's rows `ws` there, and the product's input (fp32) as PROLOGUE computes
        it; `squares` += x² for RMS_NORM."""
        w = _weight_block(w_ptr, ws, w_ok, first, inputs, w_n, BLOCK_K)
        x, squares = _input_block(
            x_ptr, up_ptr, gain_ptr, w_ptr, ms, m_ok, first, inputs, x_m, up_m, squares, PROLOGUE, BLOCK_K
        )
        return w, x, squares

    @triton.jit
    def _weight_rows(pid, outputs, GATED: tl.constexpr, BLOCK_N: tl.constexpr):
        """A program's `BLOCK_N` rows of the weight — its BLOCK_N outputs', or GATED its BLOCK_N / 2 outputs' gate
        and up rows side by side (`outputs` rows apart in the weight) — and whether each exists."""
        lanes = tl.arange(0, BLOCK_N)
        if GATED:
            ns = pid * (BLOCK_N // 2) + lanes // 2
            return ns + (lanes % 2) * outputs, ns < outputs
        else:
            ns = pid * BLOCK_N + lanes
            return ns, ns < outputs

    @triton.jit
    def _normed_sums(
        total, squares, inputs, eps, bias_ptr, ws, w_ok, PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr
    ):  # fmt: skip
        """The sums `total` (rows × the weight rows `ws`, fp32) scaled by 1/rms (RMS_NORM), plus the bias."""
        if PROLOGUE == 1:
            # eps: an fp64 scalar from inductor, fp32 from Triton's launcher, a constant in torch's mutation analysis
            # of a traced launch (torch 2.11): tl.cast takes all three
            mean = tl.sum(squares, axis=1) / inputs + tl.cast(eps, tl.float32)
            total = total * (1.0 / tl.sqrt(mean))[:, None]
        if HAS_BIAS:
            total += tl.load(bias_ptr + ws, mask=w_ok, other=0.0).to(tl.float32)[None, :]
        return total

    @triton.jit
    def _store_output(
        total, squares, inputs, eps, bias_ptr, residual_ptr, y_ptr, pid, outputs, ws, w_ok, ms, m_ok, residual_m,
        y_m, PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, GATED: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        """The sums `total` (rows × the weight rows `ws`, fp32) scaled by 1/rms (RMS_NORM), plus the bias, rounded to
        the output's dtype; GATED: act(gate) ⊙ up of each output's pair, rounded again; plus the residual; stored."""
        total = _normed_sums(total, squares, inputs, eps, bias_ptr, ws, w_ok, PROLOGUE, HAS_BIAS)
        out = total.to(y_ptr.dtype.element_ty)
        if GATED:  # the gate/up product rounded as the unfused step's, act(gate) ⊙ up rounded as its product
            gate, up = tl.split(tl.reshape(out.to(tl.float32), [total.shape[0], BLOCK_N // 2, 2]))
            out = (gate * tl.sigmoid(gate) * up).to(y_ptr.dtype.element_ty)
            ns = pid * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        else:
            ns = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        out_ok = m_ok[:, None] & (ns < outputs)[None, :]
        if HAS_RESIDUAL:  # added to the product rounded to the output's dtype, as the unfused step adds it
            residual = tl.load(residual_ptr + ms[:, None] * residual_m + ns[None, :], mask=out_ok, other=0.0)
            out = (out.to(tl.float32) + residual.to(tl.float32)).to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + ms[:, None] * y_m + ns[None, :], out, mask=out_ok)

    # One row: (BLOCK_N, BLOCK_K, UNROLL, warps), blocks of inputs that span the program's threads (8 bf16 or fp16 a
    # thread, one 128-bit load, × 32 × the warps: 512 at 2 warps, 1,024 at 4, 2,048 at 8), so that each thread's
    # share of the input is the share of each weight row it multiplies: no exchange through shared memory and no
    # barrier in the loop (test_triton_compile.py). Narrower blocks (512 inputs at 4 warps) made Triton pass the
    # input, and the weight blocks with it, through shared memory, a barrier for each
    ROW_CONFIGS = [  # (the first: the one Triton's interpreter runs, where fewer programs take less time)
        (4, 1024, 2, 4),
        (2, 1024, 2, 4),
        (8, 1024, 1, 4),
        (2, 2048, 1, 8),
        (4, 2048, 1, 8),
        (2, 512, 2, 2),
        (4, 512, 4, 2),
        (8, 512, 1, 2),
    ]

    # 2 to STREAMED_ROWS rows: the same blocks of inputs, one accumulator a row (`_block_products`), at most 4 weight
    # rows a program (4 rows' accumulators of 8 × BLOCK_N fp32 a thread: at 8 weight rows some spill) — no shared
    # memory and no barrier in the loop at 2 and 4 rows either (a (rows × BLOCK_N × BLOCK_K) tile had 16-24 a loop)
    STREAMED_CONFIGS = [
        (4, 1024, 2, 4),
        (2, 1024, 2, 4),
        (4, 1024, 1, 4),
        (2, 1024, 4, 4),
        (2, 2048, 1, 8),
        (4, 2048, 1, 8),
        (2, 512, 2, 2),
        (4, 512, 2, 2),
    ]

    @triton.jit
    def _row_products(
        acc, squares, w, x_ptr, up_ptr, gain_ptr, w_ptr, row, rows, first, inputs, x_m, up_m,
        PROLOGUE: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """acc + the products of input row `row`'s block `first` (1 × BLOCK_K, as PROLOGUE computes it) and the weight
        block w (BLOCK_N × BLOCK_K), element-wise, in the layout w was loaded in; `squares` += x² for RMS_NORM."""
        ms = row + tl.arange(0, 1)
        x, squares = _input_block(
            x_ptr, up_ptr, gain_ptr, w_ptr, ms, ms < rows, first, inputs, x_m, up_m, squares, PROLOGUE, BLOCK_K
        )
        return acc + x * w.to(tl.float32), squares

    @triton.jit
    def _block_products(
        acc0, acc1, acc2, acc3, sq0, sq1, sq2, sq3, w, x_ptr, up_ptr, gain_ptr, w_ptr, rows, first, inputs, x_m, up_m,
        ROWS: tl.constexpr, PROLOGUE: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """Each of the ROWS input rows' block `first` by the weight block w, into the row's own accumulator (acc0-3:
        BLOCK_N × BLOCK_K, fp32; sq0-3 its squares for RMS_NORM). One accumulator a row, each multiplied in the weight
        block's own layout: a single (ROWS × BLOCK_N × BLOCK_K) tile passed every weight block and input block through
        shared memory, a barrier for each (module docstring)."""
        args = (x_ptr, up_ptr, gain_ptr, w_ptr)
        acc0, sq0 = _row_products(acc0, sq0, w, *args, 0, rows, first, inputs, x_m, up_m, PROLOGUE, BLOCK_K)
        if ROWS > 1:
            acc1, sq1 = _row_products(acc1, sq1, w, *args, 1, rows, first, inputs, x_m, up_m, PROLOGUE, BLOCK_K)
        if ROWS > 2:
            acc2, sq2 = _row_products(acc2, sq2, w, *args, 2, rows, first, inputs, x_m, up_m, PROLOGUE, BLOCK_K)
            acc3, sq3 = _row_products(acc3, sq3, w, *args, 3, rows, first, inputs, x_m, up_m, PROLOGUE, BLOCK_K)
        return acc0, acc1, acc2, acc3, sq0, sq1, sq2, sq3

    @triton.jit
    def _store_row(
        acc, squares, row, rows, inputs, eps, bias_ptr, residual_ptr, y_ptr, pid, outputs, ws, w_ok, residual_m, y_m,
        PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, GATED: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        """Row `row`'s outputs from its accumulator, summed across the block's inputs once (`_store_output`)."""
        ms = row + tl.arange(0, 1)
        _store_output(
            tl.sum(acc, axis=1)[None, :], squares, inputs, eps, bias_ptr, residual_ptr, y_ptr, pid, outputs, ws, w_ok,
            ms, ms < rows, residual_m, y_m, PROLOGUE, HAS_BIAS, HAS_RESIDUAL, GATED, BLOCK_N,
        )  # fmt: skip

    @triton.jit
    def _stream_rows(
        x_ptr, up_ptr, gain_ptr, w_ptr, ws, w_ok, rows, inputs, x_m, up_m, w_n,
        ROWS: tl.constexpr, PROLOGUE: tl.constexpr, PDL: tl.constexpr, BLOCK_K: tl.constexpr, UNROLL: tl.constexpr,
    ):  # fmt: skip
        """The streaming kernels' loop: the weight's rows `ws` against every row of the input (up to 4), one
        accumulator a row (`_block_products`): (acc0-3, their squares sq0-3), each to be summed once after the loop.
        The loop is unrolled UNROLL times: the unrolled blocks' loads are issued together (Triton does not pipeline
        loads that feed no `tl.dot`, and a sum across threads in every block would wait on each block's load)."""
        tl.static_assert(ROWS <= 4, "the streaming kernel takes up to 4 rows (STREAMED_ROWS)")
        acc0 = tl.zeros([ws.shape[0], BLOCK_K], tl.float32)
        acc1, acc2, acc3 = acc0, acc0, acc0  # rows ROWS and above: never touched (no registers)
        sq0 = tl.zeros([1, BLOCK_K], tl.float32)  # RMS_NORM: x², element-wise like the products
        sq1, sq2, sq3 = sq0, sq0, sq0
        args = (x_ptr, up_ptr, gain_ptr, w_ptr)
        start = 0
        if PDL:  # the first block of the weight read while the kernel before ends (nothing on the GPU writes it)
            w = _weight_block(w_ptr, ws, w_ok, 0, inputs, w_n, BLOCK_K)
            dependent_launch(PDL)  # then the input, which the kernel before writes
            acc0, acc1, acc2, acc3, sq0, sq1, sq2, sq3 = _block_products(
                acc0, acc1, acc2, acc3, sq0, sq1, sq2, sq3, w, *args, rows, 0, inputs, x_m, up_m,
                ROWS, PROLOGUE, BLOCK_K,
            )  # fmt: skip
            start = 1
        for first in tl.range(start, tl.cdiv(inputs, BLOCK_K), loop_unroll_factor=UNROLL):
            w = _weight_block(w_ptr, ws, w_ok, first, inputs, w_n, BLOCK_K)
            acc0, acc1, acc2, acc3, sq0, sq1, sq2, sq3 = _block_products(
                acc0, acc1, acc2, acc3, sq0, sq1, sq2, sq3, w, *args, rows, first, inputs, x_m, up_m,
                ROWS, PROLOGUE, BLOCK_K,
            )  # fmt: skip
        return acc0, acc1, acc2, acc3, sq0, sq1, sq2, sq3

    @triton.jit
    def _streaming_gemv(
        x_ptr, up_ptr, gain_ptr, w_ptr, bias_ptr, residual_ptr, y_ptr,
        rows, outputs, inputs, eps,
        x_m, up_m, w_n, residual_m, y_m,
        ROWS: tl.constexpr, PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
        GATED: tl.constexpr, PDL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UNROLL: tl.constexpr,
    ):  # fmt: skip
        """Up to STREAMED_ROWS rows (ROWS: `rows` rounded up to a power of two). One program streams BLOCK_N rows of
        the weight (`_weight_rows`) against every row of the input (`_stream_rows`), and stores each row's outputs
        (`_store_row`)."""
        pid = tl.program_id(0)
        ws, w_ok = _weight_rows(pid, outputs, GATED, BLOCK_N)
        acc0, acc1, acc2, acc3, sq0, sq1, sq2, sq3 = _stream_rows(
            x_ptr, up_ptr, gain_ptr, w_ptr, ws, w_ok, rows, inputs, x_m, up_m, w_n, ROWS, PROLOGUE, PDL, BLOCK_K, UNROLL
        )
        out = (bias_ptr, residual_ptr, y_ptr, pid, outputs, ws, w_ok, residual_m, y_m)  # (constants stay arguments)
        _store_row(acc0, sq0, 0, rows, inputs, eps, *out, PROLOGUE, HAS_BIAS, HAS_RESIDUAL, GATED, BLOCK_N)
        if ROWS > 1:
            _store_row(acc1, sq1, 1, rows, inputs, eps, *out, PROLOGUE, HAS_BIAS, HAS_RESIDUAL, GATED, BLOCK_N)
        if ROWS > 2:
            _store_row(acc2, sq2, 2, rows, inputs, eps, *out, PROLOGUE, HAS_BIAS, HAS_RESIDUAL, GATED, BLOCK_N)
            _store_row(acc3, sq3, 3, rows, inputs, eps, *out, PROLOGUE, HAS_BIAS, HAS_RESIDUAL, GATED, BLOCK_N)

    def autotuned_streaming(kernel, configs, key: list[str]):
        """A streaming kernel (its loop `_stream_rows`) autotuned over `configs` ((BLOCK_N, BLOCK_K, UNROLL, warps))
        per value of the arguments named in `key`."""
        return triton.autotune(
            configs=[
                triton.Config({"BLOCK_N": n, "BLOCK_K": k, "UNROLL": unroll}, num_warps=warps, num_stages=1)
                for n, k, unroll, warps in configs
            ],
            key=key,
        )(kernel)

    # the streaming kernel autotuned over each set of blocks: one row, and 2 to STREAMED_ROWS rows
    _KEY = ["rows", "outputs", "inputs", "PROLOGUE", "GATED"]
    _gemv_row_kernel = autotuned_streaming(_streaming_gemv, ROW_CONFIGS, _KEY)
    _gemv_kernel = autotuned_streaming(_streaming_gemv, STREAMED_CONFIGS, _KEY)

    @triton.autotune(
        configs=[
            triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=warps, num_stages=stages)
            for n, k, warps, stages in [  # each within 99 kB of shared memory in fp32 too (test_triton_compile.py)
                (16, 128, 4, 4),
                (32, 128, 4, 3),
                (64, 64, 4, 4),
                (32, 64, 4, 5),
                (16, 256, 4, 2),
                (32, 256, 4, 2),
            ]
        ],
        key=["rows", "outputs", "inputs", "PROLOGUE", "GATED", "SPLIT"],
    )
    @triton.jit
    def _dot_kernel(
        x_ptr, up_ptr, gain_ptr, w_ptr, bias_ptr, residual_ptr, y_ptr, part_ptr, part_sq_ptr,
        rows, outputs, inputs, eps,
        x_m, up_m, w_n, residual_m, y_m,
        ROWS: tl.constexpr, PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
        GATED: tl.constexpr, PDL: tl.constexpr, IEEE: tl.constexpr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """More than STREAMED_ROWS rows (ROWS: `rows` rounded up to 16, the smallest tensor-core tile). One program:
        outputs [pid · BLOCK_N, + BLOCK_N) of every row, a `tl.dot` of the input block (computed by the prologue,
        rounded to the weights' dtype; fp32 weights: IEEE products) and the weight block per step, which Triton
        pipelines (asynchronous copies, `num_stages` blocks in flight). SPLIT: the program takes the share
        `program_id(1)` of the input blocks (split-K) and stores its sums and squares for `_split_sum_kernel`."""
        dependent_launch(PDL)
        pid = tl.program_id(0)
        ws, w_ok = _weight_rows(pid, outputs, GATED, BLOCK_N)
        ms = tl.arange(0, ROWS)
        m_ok = ms < rows
        acc = tl.zeros([ROWS, BLOCK_N], tl.float32)
        squares = tl.zeros([ROWS, BLOCK_K], tl.float32)
        start, stop = 0, tl.cdiv(inputs, BLOCK_K)
        if SPLIT:  # an even share of the blocks (the last splits' empty where there are fewer blocks than splits)
            share = tl.cdiv(stop, tl.num_programs(1))
            start = tl.program_id(1) * share
            stop = tl.minimum(start + share, stop)
        for first in tl.range(start, stop):
            w, x, squares = _block_of_weight_and_input(
                x_ptr, up_ptr, gain_ptr, w_ptr, ws, w_ok, ms, m_ok, first, inputs, x_m, up_m, w_n, squares,
                PROLOGUE, BLOCK_K,
            )  # fmt: skip
            if IEEE:
                acc += tl.dot(x, tl.trans(w), input_precision="ieee")
            else:
                acc += tl.dot(x.to(w.dtype), tl.trans(w))
        if SPLIT:
            _store_partial(acc, squares, part_ptr, part_sq_ptr, pid, rows, outputs, ms, m_ok, GATED, BLOCK_N)
        else:
            _store_output(
                acc, squares, inputs, eps, bias_ptr, residual_ptr, y_ptr, pid, outputs, ws, w_ok, ms, m_ok,
                residual_m, y_m, PROLOGUE, HAS_BIAS, HAS_RESIDUAL, GATED, BLOCK_N,
            )  # fmt: skip

    @triton.jit
    def _partial_lanes(pid, split, rows, outputs, ms, m_ok, GATED: tl.constexpr, BLOCK_N: tl.constexpr):
        """Where program `pid`'s BLOCK_N lanes of split `split` lie in the shares' buffer (part[split, row, lane], a
        lane a weight row of `_weight_rows`' numbering), and which exist."""
        lanes = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        width = 2 * outputs if GATED else outputs
        return (split * rows + ms[:, None]) * width + lanes[None, :], m_ok[:, None] & (lanes < width)[None, :]

    @triton.jit
    def _store_partial(
        acc, squares, part_ptr, part_sq_ptr, pid, rows, outputs, ms, m_ok, GATED: tl.constexpr, BLOCK_N: tl.constexpr
    ):  # fmt: skip
        """A split's sums (rows × its program's BLOCK_N lanes) at part[split, row, lane], a lane being a weight row
        of `_weight_rows`' numbering (GATED: gate and up rows alternating), so that the layout does not depend on
        the block size; and, from the first program (every program's are the same), its squares at
        part_sq[split, row]."""
        split = tl.program_id(1)
        at, ok = _partial_lanes(pid, split, rows, outputs, ms, m_ok, GATED, BLOCK_N)
        tl.store(part_ptr + at, acc, mask=ok)
        tl.store(part_sq_ptr + split * rows + ms, tl.sum(squares, axis=1), mask=m_ok & (pid == 0))

    @triton.jit
    def _split_sum_kernel(
        part_ptr, part_sq_ptr, bias_ptr, residual_ptr, y_ptr,
        rows, outputs, inputs, eps, splits, residual_m, y_m,
        ROWS: tl.constexpr, PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
        GATED: tl.constexpr, PDL: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        """The split-K tensor-core GEMV's second kernel: each lane's sums over the splits, in split order (the same
        bits every call), and the squares likewise, then the epilogue the unsplit kernel runs (`_store_output`)."""
        dependent_launch(PDL)
        pid = tl.program_id(0)
        ws, w_ok = _weight_rows(pid, outputs, GATED, BLOCK_N)
        ms = tl.arange(0, ROWS)
        m_ok = ms < rows
        total = tl.zeros([ROWS, BLOCK_N], tl.float32)
        squares = tl.zeros([ROWS, 1], tl.float32)
        for split in range(0, splits):
            at, ok = _partial_lanes(pid, split, rows, outputs, ms, m_ok, GATED, BLOCK_N)
            total += tl.load(part_ptr + at, mask=ok, other=0.0)
            if PROLOGUE == 1:
                squares += tl.load(part_sq_ptr + split * rows + ms, mask=m_ok, other=0.0)[:, None]
        _store_output(
            total, squares, inputs, eps, bias_ptr, residual_ptr, y_ptr, pid, outputs, ws, w_ok, ms, m_ok, residual_m,
            y_m, PROLOGUE, HAS_BIAS, HAS_RESIDUAL, GATED, BLOCK_N,
        )  # fmt: skip


def split_count(width: int, inputs: int, device: torch.device) -> int:
    """Into how many shares of its input blocks the tensor-core GEMV splits a product of `width` weight rows
    (split-K, `_split_sum_kernel` adding them up): enough programs of 32 weight rows for `SPLIT_PROGRAMS_PER_PROCESSOR`
    on each of the device's multiprocessors, each share at least `MIN_SPLIT_INPUTS` inputs, at most `MAX_SPLITS`.
    The 1.1B model's shapes on an H200 (132 processors): q/k/v, output and down projections 4, 4 and 5 shares, the
    gate/up product (352 programs already) one."""
    processors = _processors(device)
    wanted = -(-SPLIT_PROGRAMS_PER_PROCESSOR * processors // -(-width // 32))
    return max(1, min(wanted, MAX_SPLITS, inputs // MIN_SPLIT_INPUTS))


def _processors(device: torch.device) -> int:
    if device.type != "cuda":
        return PROCESSORS_ELSEWHERE
    return _cuda_processors(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache
def _cuda_processors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _tiles(outputs: int, gated: bool):
    """A GEMV kernel's grid: a program streams BLOCK_N rows of the weight (gated: half as many outputs')."""
    return lambda meta: (triton.cdiv(outputs, meta["BLOCK_N"] // 2 if gated else meta["BLOCK_N"]),)


def streaming_pdl(dependent: bool) -> int:
    """The streaming kernels' `PDL`: 0 launched plainly, 1 dependent on the kernel before (`dependent`: the op's PDL
    twin where the device has it). (Asking the L2 cache for the rest of the weight rows before the wait, `PDL` 2, lost:
    0.83x a layer's step and 0.91x the batch-1 decoding step on an H200, docs/gpu.md's eighth session.)"""
    return int(dependent)


def kernel_for(rows: int):
    """The kernel that takes `rows` rows: the one-row kernel, the streaming one up to `STREAMED_ROWS`, else the
    tensor-core one."""
    if rows == 1:
        return _gemv_row_kernel
    return _gemv_kernel if rows <= STREAMED_ROWS else _dot_kernel


def _launch(
    prologue: int,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    up: torch.Tensor | None = None,
    gain: torch.Tensor | None = None,
    eps: float = 0.0,
    gated: bool = False,
    pdl: bool = False,
) -> torch.Tensor:
    """The kernel over x (..., inputs) against weight (outputs, inputs): (..., outputs) in x's dtype; `gated`: the
    weight is [gate; up] (2 × outputs rows) and the output act(gate) ⊙ up; `pdl`: launched by the op's PDL twin
    (triton_launch.py)."""
    inputs, outputs = x.shape[-1], weight.shape[0] // 2 if gated else weight.shape[0]
    x2 = x.reshape(-1, inputs)
    up2 = up.reshape(-1, inputs) if up is not None else x2
    residual2 = residual.reshape(-1, outputs) if residual is not None else x2
    rows = x2.shape[0]
    output = x.new_empty(rows, outputs)
    kernel = kernel_for(rows)
    dependent = pdl and pdl_launch(x)
    arguments = (
        x2, up2, weight if gain is None else gain, weight, weight if bias is None else bias, residual2, output,
    )  # fmt: skip
    sizes, strides = (rows, outputs, inputs, eps), (x2.stride(0), up2.stride(0), weight.stride(0))
    out_strides = (residual2.stride(0), output.stride(0))
    flags = dict(PROLOGUE=prologue, HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None, GATED=gated)
    tiles = _tiles(outputs, gated)
    if kernel is not _dot_kernel:
        launchable(kernel, x, "gemv", pdl=dependent)[tiles](
            *arguments, *sizes, *strides, *out_strides, ROWS=triton.next_power_of_2(rows),
            PDL=streaming_pdl(dependent), **flags,
        )  # fmt: skip
        return output.reshape(*x.shape[:-1], outputs)
    # the tensor-core kernel: rows padded to 16; split-K where the products' tiles would leave processors idle
    width, padded = weight.shape[0], max(16, triton.next_power_of_2(rows))
    splits = split_count(width, inputs, x.device)
    if splits > 1:
        parts = x.new_empty(splits, rows, width, dtype=torch.float32)
        part_squares = x.new_empty(splits, rows, dtype=torch.float32)
    else:  # not read or written unsplit; not `output` either: a traced launch must not alias what it writes
        parts = part_squares = x.new_empty(0, dtype=torch.float32)
    launchable(_dot_kernel, x, "gemv", pdl=dependent)[lambda meta: (*tiles(meta), splits)](
        *arguments, parts, part_squares, *sizes, *strides, *out_strides,
        ROWS=padded, PDL=dependent, IEEE=x.dtype == torch.float32, SPLIT=splits > 1, **flags,
    )  # fmt: skip
    if splits > 1:
        launchable(_split_sum_kernel, x, "gemv", pdl=dependent)[(triton.cdiv(width, SUM_LANES),)](
            parts, part_squares, *arguments[4:], *sizes, splits, *out_strides,
            ROWS=padded, PDL=dependent, BLOCK_N=SUM_LANES, **flags,
        )  # fmt: skip
    return output.reshape(*x.shape[:-1], outputs)


def _gated_down_body(gate, up, weight, bias, residual=None, pdl: bool = False) -> torch.Tensor:
    return _launch(SILU_GATED, gate, weight, bias, residual, up=up, pdl=pdl)


def _gemv_body(x, weight, bias, gain, eps, residual, pdl: bool = False) -> torch.Tensor:
    return _launch(PLAIN if gain is None else RMS_NORM, x, weight, bias, residual, gain=gain, eps=eps, pdl=pdl)


def _gated_gemv_body(x, weight, bias, gain, eps, pdl: bool = False) -> torch.Tensor:
    prologue = PLAIN if gain is None else RMS_NORM
    return _launch(prologue, x, weight, bias, None, gain=gain, eps=eps, gated=True, pdl=pdl)


if triton is not None and not registered("gated_down"):

    @torch.library.triton_op("archlab::gated_down", mutates_args=())
    def _gated_down_op(
        gate: torch.Tensor,
        up: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return _gated_down_body(gate, up, weight, bias, residual)


if triton is not None and not registered("gemv"):

    @torch.library.triton_op("archlab::gemv", mutates_args=())
    def _gemv_op(
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        gain: torch.Tensor | None,
        eps: float,
        residual: torch.Tensor | None,
    ) -> torch.Tensor:
        return _gemv_body(x, weight, bias, gain, eps, residual)


if triton is not None and not registered("gated_gemv"):

    @torch.library.triton_op("archlab::gated_gemv", mutates_args=())
    def _gated_gemv_op(
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        gain: torch.Tensor | None,
        eps: float,
    ) -> torch.Tensor:
        return _gated_gemv_body(x, weight, bias, gain, eps)


if triton is not None:
    register_pdl_twin("gated_down", functools.partial(_gated_down_body, pdl=True))
    register_pdl_twin("gemv", functools.partial(_gemv_body, pdl=True))
    register_pdl_twin("gated_gemv", functools.partial(_gated_gemv_body, pdl=True))


def gated_down(module, gate: torch.Tensor, up: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
    """`module.down_proj(act(gate) ⊙ up)` (+ `residual`) for a GatedMLP with SiLU, as one kernel (module docstring)."""
    gate, up, residual = rows_contiguous(gate, up, residual)
    return archlab_op("gated_down", gate)(gate, up, module.down_proj.weight, module.down_proj.bias, residual)


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    norm: torch.nn.Module | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """`linear(norm(x), weight, bias)` (+ `residual`) as one kernel, `norm` an `RMSNorm` or None (module docstring)."""
    x, residual = rows_contiguous(x, residual)
    gain, eps = (norm.weight, float(norm.variance_epsilon)) if norm is not None else (None, 0.0)
    return archlab_op("gemv", x)(x, weight, bias, gain, eps, residual)


def gated_gemv(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, norm: torch.nn.Module | None = None
) -> torch.Tensor:
    """SiLU(gate) ⊙ up of `linear(norm(x), weight, bias)` = [gate, up], the weight [gate; up] (2 × outputs rows) — a
    gated MLP's gate/up product with SwiGLU in its epilogue — as one kernel, `norm` an `RMSNorm` or None (module
    docstring)."""
    (x,) = rows_contiguous(x)
    gain, eps = (norm.weight, float(norm.variance_epsilon)) if norm is not None else (None, 0.0)
    return archlab_op("gated_gemv", x)(x, weight, bias, gain, eps)


__all__ = [
    "GATED_DOWN_DEVICES",
    "MAX_ROWS",
    "PLAIN",
    "STREAMED_ROWS",
    "RMS_NORM",
    "SILU_GATED",
    "gated_down",
    "gated_down_applies",
    "gated_gemv",
    "gemv",
    "gemv_applies",
]
