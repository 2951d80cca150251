"""A mixture of experts' routed experts for a few tokens (a decoding step) as two Triton kernels that read the chosen
experts' weights where they lie: matrix-vector products indexed by the router's choice, SiLU and the router weights
inside (the small-batch path of fused-MoE kernels such as vLLM's, after Mixtral, Jiang et al. 2024).

Why: `moe.Experts` runs any number of tokens as grouped GEMMs over (token, slot) rows sorted by expert: a sort, a
search for the groups' ends, a gather of the rows, two grouped GEMMs (CUTLASS tiles of 64-128 rows for one or two
rows a group), the activation, a gather of the router weights, a zeroed output and a scatter-add: ~10 launches a
layer. At one token the step reads only the k chosen experts' weights (the GPU.md MoE shape: 2 of 8 experts, ~35 MB a
layer, ~10 µs of bandwidth) and those launches, each ~2-3 µs with its gap in a CUDA graph, take longer than the
reading. Here: `_expert_gate_up_kernel`, one program per (token, slot) and block of outputs, streams the chosen
expert's gate and up rows of those outputs side by side against the token and writes act(gate) ⊙ up (rounded as the
unfused path rounds the product and the activation: triton_gemv.py's GATED epilogue); `_expert_down_kernel`, one
program per token and block of outputs, streams each chosen expert's down rows against it and adds them with the
router weights, in fp32. Two launches, no sort, no scatter. (The down kernel computed act(gate) ⊙ up itself before,
every program for every input: the sixth GPU session's 3.9× and 2.3× the grouped path are of that version.) In the
fused layer step (decode_block.py) the first also computes the layer's RMSNorm of the token (one pass, as
triton_gemv.py's RMS_NORM prologue) and the second adds the residual. Block sizes are autotuned per shape on the
first call.

`moe_decode` is a `torch.library.triton_op` (inductor calls its kernels from the step's generated code, CUDA graphs
record them). Where it applies (`moe_decode_applies`): at most `MAX_TOKENS` tokens, gated experts with SiLU, Triton
importable, a device in `MOE_DECODE_DEVICES`, fp32/fp16/bf16, inference (no gradient: no backward). Everything else
runs the grouped path. The default on CUDA (through the op's PDL twin, triton_launch.py): `--suite cuda-kernels` timed
the experts of one token at 3.9x archlab's grouped path and of four at 2.3x (Mixtral shape, H200). On CPU the tests
run the kernels through Triton's interpreter (tests/triton_interpreter.py) against the grouped path.
"""

from __future__ import annotations

import functools

import torch

from .triton_launch import (
    NVIDIA_GPUS,
    archlab_op,
    dependent_launch,
    kernels_fit,
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

# Devices on which a few tokens' routed experts run through `moe_decode` (`moe_decode_applies`).
MOE_DECODE_DEVICES: tuple[str, ...] = NVIDIA_GPUS
MAX_TOKENS = 4
ACTIVATIONS = ("silu", "swish")


def moe_decode_applies(experts, hidden_states: torch.Tensor) -> bool:
    """Whether `experts` (a moe.Experts) run the (tokens, d) `hidden_states` through `moe_decode`."""
    return (
        triton is not None
        and hidden_states.device.type in MOE_DECODE_DEVICES  # first: no guard on a traced length where not listed
        and kernels_fit(hidden_states)
        and hidden_states.shape[0] <= MAX_TOKENS
        and experts.gated
        and experts.hidden_act in ACTIVATIONS
        and experts.plain  # (no biases, clamps or offset: GPT-OSS's experts run the grouped path)
        and hidden_states.dtype in (torch.float32, torch.float16, torch.bfloat16)
        and experts.gate_up_proj.dtype == hidden_states.dtype
        and experts.gate_up_proj.stride(-1) == 1
        and experts.down_proj.stride(-1) == 1
        and not (torch.is_grad_enabled() and (hidden_states.requires_grad or experts.down_proj.requires_grad))
    )


if triton is not None:
    # (the loops as in triton_gemv.py: products accumulated element-wise and summed after the loop, the loop unrolled
    # UNROLL times so that its blocks' loads are in flight together; blocks of inputs that span the program's threads,
    # 8 bf16 a thread × 32 × the warps, as triton_gemv.py's one-row kernel: the narrower blocks before passed the
    # input through shared memory, a barrier for each, in every configuration)
    _CONFIGS = [
        triton.Config({"BLOCK_N": n, "BLOCK_K": k, "UNROLL": unroll}, num_warps=warps, num_stages=1)
        for n, k, unroll, warps in [(4, 1024, 2, 4), (8, 1024, 1, 4), (4, 512, 4, 2), (8, 512, 2, 2), (4, 2048, 1, 8)]
    ]

    @triton.autotune(configs=_CONFIGS, key=["outputs", "inputs", "NORM"])
    @triton.jit
    def _expert_gate_up_kernel(
        x_ptr, index_ptr, w_ptr, gain_ptr, y_ptr,
        slots, outputs, inputs, eps,
        x_m, w_e, w_n, y_m,
        NORM: tl.constexpr, PDL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UNROLL: tl.constexpr,
    ):  # fmt: skip
        """One program: (token, slot) `pid 0`, outputs [pid 1 · BLOCK_N / 2, + BLOCK_N / 2) of act(gate) ⊙ up of its
        expert's [gate; up] product — their gate and up rows streamed side by side, as triton_gemv.py's GATED
        epilogue pairs them, the product rounded to the output's dtype, act(gate) ⊙ up rounded again, as the
        unfused path rounds them; with NORM, of RMSNorm(x) (one pass: x² accumulated beside the products, 1/rms
        applied to the sums after the loop, as triton_gemv.py's RMS_NORM prologue)."""
        dependent_launch(PDL)
        slot = tl.program_id(0)
        lanes = tl.arange(0, BLOCK_N)
        pairs = tl.program_id(1) * (BLOCK_N // 2) + lanes // 2
        ws, w_ok = pairs + (lanes % 2) * outputs, pairs < outputs  # the weight's rows: gate, up, gate, up ...
        expert = tl.load(index_ptr + slot).to(tl.int64)
        row = slot // slots
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        squares = tl.zeros([BLOCK_K], tl.float32)
        for first in tl.range(0, tl.cdiv(inputs, BLOCK_K), loop_unroll_factor=UNROLL):
            ks = first * BLOCK_K + tl.arange(0, BLOCK_K)
            k_ok = ks < inputs
            x = tl.load(x_ptr + row * x_m + ks, mask=k_ok, other=0.0).to(tl.float32)
            if NORM:
                squares += x * x
                x = x * tl.load(gain_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
            w_at = w_ptr + expert * w_e + ws[:, None] * w_n + ks[None, :]
            w = tl.load(w_at, mask=w_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            acc += w * x[None, :]
        total = tl.sum(acc, axis=1)
        if NORM:  # eps: an fp64 scalar from inductor, fp32 from Triton's launcher, a constant in torch's analysis
            total = total / tl.sqrt(tl.sum(squares, axis=0) / inputs + tl.cast(eps, tl.float32))
        products = total.to(y_ptr.dtype.element_ty).to(tl.float32)
        gate, up = tl.split(tl.reshape(products, [BLOCK_N // 2, 2]))
        ns = tl.program_id(1) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        out = (gate * tl.sigmoid(gate) * up).to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + slot * y_m + ns, out, mask=ns < outputs)

    @triton.autotune(configs=_CONFIGS, key=["outputs", "inputs"])
    @triton.jit
    def _expert_down_kernel(
        h_ptr, index_ptr, weight_ptr, w_ptr, residual_ptr, y_ptr,
        outputs, inputs,
        h_m, w_e, w_n, residual_m, y_m,
        SLOTS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, PDL: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UNROLL: tl.constexpr,
    ):  # fmt: skip
        """One program: token `pid 0`, outputs [pid 1 · BLOCK_N, + BLOCK_N) of Σ_slots weight · down(h), h = act(gate)
        ⊙ up as the gate/up kernel wrote it, rounded to the output's dtype, plus the residual (as the unfused step adds
        the block's output to it)."""
        dependent_launch(PDL)
        row = tl.program_id(0)
        ns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = ns < outputs
        acc = tl.zeros([BLOCK_N], tl.float32)
        for j in tl.static_range(SLOTS):
            slot = row * SLOTS + j
            expert = tl.load(index_ptr + slot).to(tl.int64)
            part = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
            for first in tl.range(0, tl.cdiv(inputs, BLOCK_K), loop_unroll_factor=UNROLL):
                ks = first * BLOCK_K + tl.arange(0, BLOCK_K)
                k_ok = ks < inputs
                hidden = tl.load(h_ptr + slot * h_m + ks, mask=k_ok, other=0.0).to(tl.float32)
                w_at = w_ptr + expert * w_e + ns[:, None] * w_n + ks[None, :]
                w = tl.load(w_at, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
                part += w.to(tl.float32) * hidden[None, :]
            acc += tl.load(weight_ptr + slot).to(tl.float32) * tl.sum(part, axis=1)
        out = acc.to(y_ptr.dtype.element_ty)
        if HAS_RESIDUAL:
            residual = tl.load(residual_ptr + row * residual_m + ns, mask=n_ok, other=0.0)
            out = (out.to(tl.float32) + residual.to(tl.float32)).to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + row * y_m + ns, out, mask=n_ok)


def _moe_decode_body(
    hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, gain=None, eps=0.0, residual=None, pdl=False
):
    """The op's body; `pdl`: launched by its PDL twin (triton_launch.py)."""
    tokens, hidden = hidden_states.shape
    slots = top_k_index.shape[1]
    intermediate = down_proj.shape[2]
    index = top_k_index.contiguous()
    weights = top_k_weights.contiguous()
    activated = hidden_states.new_empty(tokens * slots, intermediate)  # act(gate) ⊙ up of each (token, slot)
    output = hidden_states.new_empty(tokens, hidden)
    residual2 = residual if residual is not None else hidden_states  # not read (not `output`: unaliased)

    def gate_up_grid(meta):  # a program streams BLOCK_N rows of [gate; up]: BLOCK_N / 2 outputs
        return (tokens * slots, triton.cdiv(intermediate, meta["BLOCK_N"] // 2))

    def down_grid(meta):
        return (tokens, triton.cdiv(hidden, meta["BLOCK_N"]))

    dependent = pdl and pdl_launch(hidden_states)
    launchable(_expert_gate_up_kernel, hidden_states, "moe_decode", pdl=dependent)[gate_up_grid](
        hidden_states, index, gate_up_proj, gate_up_proj if gain is None else gain, activated,
        slots, intermediate, hidden, eps,
        hidden_states.stride(0), gate_up_proj.stride(0), gate_up_proj.stride(1), activated.stride(0),
        NORM=gain is not None, PDL=dependent,
    )  # fmt: skip
    launchable(_expert_down_kernel, hidden_states, "moe_decode", pdl=dependent)[down_grid](
        activated, index, weights, down_proj, residual2, output,
        hidden, intermediate,
        activated.stride(0), down_proj.stride(0), down_proj.stride(1), residual2.stride(0), output.stride(0),
        SLOTS=slots, HAS_RESIDUAL=residual is not None, PDL=dependent,
    )  # fmt: skip
    return output


if triton is not None and not registered("moe_decode"):

    @torch.library.triton_op("archlab::moe_decode", mutates_args=())
    def _moe_decode_op(
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
        gate_up_proj: torch.Tensor,
        down_proj: torch.Tensor,
        gain: torch.Tensor | None = None,
        eps: float = 0.0,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return _moe_decode_body(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, gain, eps, residual)


if triton is not None:
    register_pdl_twin("moe_decode", functools.partial(_moe_decode_body, pdl=True))


def moe_decode(
    experts,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    *,
    norm: torch.nn.Module | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """`experts(hidden_states, top_k_index, top_k_weights)` for a few tokens (module docstring): (tokens, d); with
    `norm` (an `RMSNorm`) of `norm(hidden_states)`, computed inside the gate/up kernel, and `residual` (tokens, d)
    added by the down kernel (the fused layer step's MLP half, decode_block.py)."""
    hidden_states, residual = rows_contiguous(hidden_states, residual)
    gain, eps = (norm.weight, float(norm.variance_epsilon)) if norm is not None else (None, 0.0)
    op = archlab_op("moe_decode", hidden_states)
    return op(hidden_states, top_k_index, top_k_weights, experts.gate_up_proj, experts.down_proj, gain, eps, residual)


__all__ = ["MAX_TOKENS", "MOE_DECODE_DEVICES", "moe_decode", "moe_decode_applies"]
