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

The experts' own choices go into the same two kernels: GPT-OSS's biases on both products (added to the rounded
product, as the grouped path adds them), its clamped SwiGLU with up + 1 and its quick GELU (act(x) = x · σ(α x), α
1.702 where SiLU's is 1), and Llama 4's routing weight on the expert's input (a scalar through the gate/up product;
the down kernel then sums the slots unweighted); the fused layer step's router GEMV adds GPT-OSS's router bias.

`moe_decode` is a `torch.library.triton_op` (inductor calls its kernels from the step's generated code, CUDA graphs
record them). Where it applies (`moe_decode_applies`): at most `MAX_TOKENS` tokens, gated experts with SiLU or quick
GELU, Triton importable, a device in `MOE_DECODE_DEVICES`, fp32/fp16/bf16, inference (no gradient: no backward).
Everything else runs the grouped path. The default on CUDA (through the op's PDL twin, triton_launch.py):
`--suite cuda-kernels` timed the experts of one token at 3.9x archlab's grouped path and of four at 2.3x (Mixtral
shape, H200). On CPU the tests run the kernels through Triton's interpreter (tests/triton_interpreter.py) against the
grouped path.
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
# act(x) = x · σ(α x) of each activation the gate/up kernel computes: SiLU, and GPT-OSS's quick GELU
ACTIVATION_ALPHAS = {"silu": 1.0, "swish": 1.0, "quick_gelu": 1.702}


def moe_decode_applies(experts, hidden_states: torch.Tensor) -> bool:
    """Whether `experts` (a moe.Experts) run the (tokens, d) `hidden_states` through `moe_decode`."""
    return (
        triton is not None
        and hidden_states.device.type in MOE_DECODE_DEVICES  # first: no guard on a traced length where not listed
        and kernels_fit(hidden_states)
        and hidden_states.shape[0] <= MAX_TOKENS
        and experts.gated
        and experts.hidden_act in ACTIVATION_ALPHAS
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

    @triton.autotune(configs=_CONFIGS, key=["outputs", "inputs", "NORM", "WEIGHTED_INPUT", "BIAS", "CLAMP"])
    @triton.jit
    def _expert_gate_up_kernel(
        x_ptr, index_ptr, weight_ptr, w_ptr, bias_ptr, gain_ptr, y_ptr,
        slots, outputs, inputs, eps, limit, up_offset,
        x_m, w_e, w_n, b_e, y_m,
        NORM: tl.constexpr, WEIGHTED_INPUT: tl.constexpr, BIAS: tl.constexpr, CLAMP: tl.constexpr,
        ALPHA: tl.constexpr, PDL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UNROLL: tl.constexpr,
    ):  # fmt: skip
        """One program: (token, slot) `pid 0`, outputs [pid 1 · BLOCK_N / 2, + BLOCK_N / 2) of act(gate) ⊙ up of its
        expert's [gate; up] product — their gate and up rows streamed side by side, as triton_gemv.py's GATED
        epilogue pairs them, the product rounded to the output's dtype, act(gate) ⊙ up rounded again, as the
        unfused path rounds them; with NORM, of RMSNorm(x) (one pass: x² accumulated beside the products, 1/rms
        applied to the sums after the loop, as triton_gemv.py's RMS_NORM prologue). act(x) = x · σ(ALPHA x).
        GPT-OSS's experts: BIAS adds the expert's bias to the rounded product, CLAMP computes
        act(min(gate, limit)) ⊙ (clamp(up, -limit, limit) + up_offset). Llama 4's (WEIGHTED_INPUT): the expert
        reads the token times the slot's routing weight, a scalar through the product."""
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
        if WEIGHTED_INPUT:
            total = total * tl.load(weight_ptr + slot).to(tl.float32)
        products = total.to(y_ptr.dtype.element_ty).to(tl.float32)
        if BIAS:
            bias = tl.load(bias_ptr + expert * b_e + ws, mask=w_ok, other=0.0).to(tl.float32)
            products = (products + bias).to(y_ptr.dtype.element_ty).to(tl.float32)
        gate, up = tl.split(tl.reshape(products, [BLOCK_N // 2, 2]))
        if CLAMP:
            bound = tl.cast(limit, tl.float32)
            gate = tl.minimum(gate, bound)
            up = tl.minimum(tl.maximum(up, -bound), bound)
        up = up + tl.cast(up_offset, tl.float32)
        ns = tl.program_id(1) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        out = (gate * tl.sigmoid(ALPHA * gate) * up).to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + slot * y_m + ns, out, mask=ns < outputs)

    @triton.autotune(configs=_CONFIGS, key=["outputs", "inputs", "BIAS", "WEIGHTED_INPUT"])
    @triton.jit
    def _expert_down_kernel(
        h_ptr, index_ptr, weight_ptr, w_ptr, bias_ptr, residual_ptr, y_ptr,
        outputs, inputs,
        h_m, w_e, w_n, b_e, residual_m, y_m,
        SLOTS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, BIAS: tl.constexpr, WEIGHTED_INPUT: tl.constexpr,
        PDL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UNROLL: tl.constexpr,
    ):  # fmt: skip
        """One program: token `pid 0`, outputs [pid 1 · BLOCK_N, + BLOCK_N) of Σ_slots weight · down(h), h = act(gate)
        ⊙ up as the gate/up kernel wrote it, rounded to the output's dtype, plus the residual (as the unfused step adds
        the block's output to it). BIAS: each expert's down bias added (GPT-OSS); WEIGHTED_INPUT: the slots summed
        unweighted (Llama 4: the weight went into the gate/up kernel's input)."""
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
            product = tl.sum(part, axis=1)
            if BIAS:
                product += tl.load(bias_ptr + expert * b_e + ns, mask=n_ok, other=0.0).to(tl.float32)
            if WEIGHTED_INPUT:
                acc += product
            else:
                acc += tl.load(weight_ptr + slot).to(tl.float32) * product
        out = acc.to(y_ptr.dtype.element_ty)
        if HAS_RESIDUAL:
            residual = tl.load(residual_ptr + row * residual_m + ns, mask=n_ok, other=0.0)
            out = (out.to(tl.float32) + residual.to(tl.float32)).to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + row * y_m + ns, out, mask=n_ok)


def _moe_decode_body(
    hidden_states,
    top_k_index,
    top_k_weights,
    gate_up_proj,
    down_proj,
    gain=None,
    eps=0.0,
    residual=None,
    gate_up_bias=None,
    down_bias=None,
    limit=None,
    up_offset=0.0,
    alpha=1.0,
    weights_on_input=False,
    pdl=False,
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
    in_bias = gate_up_bias if gate_up_bias is not None else gate_up_proj  # (not read without a bias)
    out_bias = down_bias if down_bias is not None else down_proj
    launchable(_expert_gate_up_kernel, hidden_states, "moe_decode", pdl=dependent)[gate_up_grid](
        hidden_states, index, weights, gate_up_proj, in_bias, gate_up_proj if gain is None else gain, activated,
        slots, intermediate, hidden, eps, 0.0 if limit is None else limit, up_offset,
        hidden_states.stride(0), gate_up_proj.stride(0), gate_up_proj.stride(1), in_bias.stride(0),
        activated.stride(0),
        NORM=gain is not None, WEIGHTED_INPUT=weights_on_input, BIAS=gate_up_bias is not None,
        CLAMP=limit is not None, ALPHA=alpha, PDL=dependent,
    )  # fmt: skip
    launchable(_expert_down_kernel, hidden_states, "moe_decode", pdl=dependent)[down_grid](
        activated, index, weights, down_proj, out_bias, residual2, output,
        hidden, intermediate,
        activated.stride(0), down_proj.stride(0), down_proj.stride(1), out_bias.stride(0), residual2.stride(0),
        output.stride(0),
        SLOTS=slots, HAS_RESIDUAL=residual is not None, BIAS=down_bias is not None, WEIGHTED_INPUT=weights_on_input,
        PDL=dependent,
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
        gate_up_bias: torch.Tensor | None = None,
        down_bias: torch.Tensor | None = None,
        limit: float | None = None,
        up_offset: float = 0.0,
        alpha: float = 1.0,
        weights_on_input: bool = False,
    ) -> torch.Tensor:
        return _moe_decode_body(
            hidden_states,
            top_k_index,
            top_k_weights,
            gate_up_proj,
            down_proj,
            gain,
            eps,
            residual,
            gate_up_bias,
            down_bias,
            limit,
            up_offset,
            alpha,
            weights_on_input,
        )


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
    added by the down kernel (the fused layer step's MLP half, decode_block.py). The experts' own choices go along:
    GPT-OSS's biases, clamps, up offset and quick GELU, Llama 4's weights on the input."""
    hidden_states, residual = rows_contiguous(hidden_states, residual)
    gain, eps = (norm.weight, float(norm.variance_epsilon)) if norm is not None else (None, 0.0)
    op = archlab_op("moe_decode", hidden_states)
    return op(
        hidden_states,
        top_k_index,
        top_k_weights,
        experts.gate_up_proj,
        experts.down_proj,
        gain,
        eps,
        residual,
        experts.gate_up_proj_bias,
        experts.down_proj_bias,
        None if experts.limit is None else float(experts.limit),
        experts.up_offset,
        ACTIVATION_ALPHAS[experts.hidden_act],
        experts.weights_on_input,
    )


__all__ = ["MAX_TOKENS", "MOE_DECODE_DEVICES", "moe_decode", "moe_decode_applies"]
