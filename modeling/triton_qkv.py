"""A decoding step's q/k/v product with the rotary embedding and the key/value cache writes in its epilogue: one
Triton kernel where the fused layer step ran two — the q/k/v GEMV (triton_gemv.py), then inductor's kernel for RoPE
of q and k and the writes of k and v into the static cache (RoPE, Su et al. 2021, in Llama's rotate-half layout; the
fused epilogue is what vLLM's and FlashInfer's decoders do in their attention's preamble).

Why: the batch-1 step of the 1.1B model on an H200 ran each layer as ~6 kernels (docs/gpu.md: q/k/v, RoPE + cache
writes, attention, output + residual, gate/up + SwiGLU, down + residual), each launch a gap of idle GPU even when
launched dependent on the kernel before (the ops' PDL twins, triton_launch.py), and the RoPE kernel moves a few kB. Here
the program that computes a query or key channel rotates it: the weight's rows are streamed in pairs, channel j and
channel j + D/2 of one head side by side (as the gate/up GEMV streams gate and up rows, `GATED`), so that the
epilogue has both halves rotate_half mixes; with partial rotary (GPT-NeoX, Phi: the first R channels of a head
rotated) the pairs are (j, j + R/2) over those and the channels past them pass through in pairs of their own
(`_pair_channels`). The keys and values go straight to the cache at the step's position, the queries to the
output. The rounding is the compiled unfused step's: the product rounded to the weights' dtype (as
the GEMV's output), rotated in fp32 and rounded once (inductor computes the rotation's chain in fp32).

`qkv_rotary_cache` is a `torch.library.triton_op` that writes the two cache tensors it is given (`mutates_args`:
inductor calls it on the static cache's own buffers, copying nothing: test_decode_block.py's PDL-twin test), with a
PDL twin (triton_launch.py). Where it applies (`qkv_rotary_cache_applies`), the fused layer step (decode_block.py)
calls it in place of the q/k/v GEMV and the attention's RoPE and cache update: a device in
`QKV_ROTARY_CACHE_DEVICES` (NVIDIA GPUs, as the fused step's), at most `triton_gemv.STREAMED_ROWS` tokens (the
streaming kernel's rows), RoPE in the rotate-half layout over whole heads or their first channels, no QK-norm, and a
self-attention layer that is a `SpannedLayer` inside the compiled decoding loops (a span set: the step's length
advances after its forward, cache_spans.py) with keys and values of the input's dtype. Everything else takes the
attention's own `position_and_cache`. On CPU the tests run the kernel through Triton's interpreter against the
unfused GEMV, RoPE and `index_copy_`. Not yet measured on a GPU (docs/gpu.md).
"""

from __future__ import annotations

import functools

import torch

from .cache_spans import SpannedLayer
from .rotary import apply_rotary
from .triton_gemv import PLAIN, RMS_NORM, STREAMED_ROWS
from .triton_launch import (
    NVIDIA_GPUS,
    archlab_op,
    launchable,
    pdl_launch,
    register_pdl_twin,
    registered,
    rows_contiguous,
)

try:
    import triton
    import triton.language as tl

    from .triton_gemv import (
        ROW_CONFIGS,
        STREAMED_CONFIGS,
        _normed_sums,
        _stream_rows,
        autotuned_streaming,
        streaming_pdl,
    )
except ImportError:  # the CPU wheels of torch come without Triton: nothing here applies
    triton = None


# Devices on which the fused layer step writes q/k/v, RoPE and the cache through `qkv_rotary_cache` (`qkv_rotary_cache_
# applies`); `--suite cuda-tuning` measures the step without it (emptied)
QKV_ROTARY_CACHE_DEVICES: tuple[str, ...] = NVIDIA_GPUS


def qkv_rotary_cache_applies(attention, layer, hidden_states: torch.Tensor, position_embeddings) -> bool:
    """Whether `attention`'s q/k/v product, RoPE and cache write for `hidden_states` (B, T, d) run as one kernel into
    the cache layer `layer` (module docstring). The fused layer step has checked the rest (the device, the product's
    weights and the norm)."""
    if hidden_states.device.type not in QKV_ROTARY_CACHE_DEVICES:  # first: elsewhere a trace guards on nothing new
        return False
    if triton is None or position_embeddings is None or type(layer) is not SpannedLayer or layer.span is None:
        return False
    if len(position_embeddings) != 2:  # query scales beside the tables (Mistral 3): the attention applies them
        return False
    cos = position_embeddings[0]
    keys = layer.keys
    batch, length, _ = hidden_states.shape
    return (
        batch * length <= STREAMED_ROWS
        and not (attention.qk_norm_per_head or attention.qk_norm_over_projection)
        and type(attention).rotate is apply_rotary
        and attention.head_dim % 2 == 0
        and cos.shape[-1] % 2 == 0
        and cos.shape[-1] <= attention.head_dim  # the first cos.shape[-1] channels rotated (all: whole heads)
        and cos.shape[:2] == (batch, length)
        and keys.dtype == hidden_states.dtype
        and keys.shape[0] == batch
        and keys.stride() == layer.values.stride()
        and keys.stride(-1) == 1
    )


if triton is not None:

    @triton.jit
    def _pair_channels(js, HALF: tl.constexpr, ROTARY_HALF: tl.constexpr):
        """The two channels of a head's pair j (< HALF, half the head size): j < ROTARY_HALF, a rotated pair (j,
        j + ROTARY_HALF), the channels rotate_half mixes over the first 2 · ROTARY_HALF; past it, the channels that
        pass through, paired likewise (j + ROTARY_HALF, j + HALF). Whole heads rotated (ROTARY_HALF = HALF): (j,
        j + HALF)."""
        rotated = js < ROTARY_HALF
        return tl.where(rotated, js, js + ROTARY_HALF), tl.where(rotated, js + ROTARY_HALF, js + HALF)

    @triton.jit
    def _pair_rows(pid, pairs, HALF: tl.constexpr, ROTARY_HALF: tl.constexpr, BLOCK_N: tl.constexpr):
        """A program's BLOCK_N rows of the q/k/v weight: BLOCK_N / 2 channel pairs of a head (`_pair_channels`), side
        by side; each row and whether it exists."""
        lanes = tl.arange(0, BLOCK_N)
        ps = pid * (BLOCK_N // 2) + lanes // 2
        first, second = _pair_channels(ps % HALF, HALF, ROTARY_HALF)
        return (ps // HALF) * (2 * HALF) + tl.where(lanes % 2 == 0, first, second), ps < pairs

    @triton.jit
    def _store_rotated_row(
        acc, squares, row, rows, tokens, inputs, eps, bias_ptr, q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, pos_ptr,
        pid, pairs, heads, kv_heads, ws, w_ok, q_m, cos_m, c_b, c_h, c_s,
        PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr, HALF: tl.constexpr, ROTARY_HALF: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        """Row `row` (token t of batch row b) from its accumulator: the product (1/rms, the bias, rounded to the
        output's dtype as `_store_output` rounds it), each rotated query and key pair rotated by the row's cos/sin,
        the queries stored to the output, the keys and values to the cache at the token's position."""
        total = _normed_sums(tl.sum(acc, axis=1)[None, :], squares, inputs, eps, bias_ptr, ws, w_ok, PROLOGUE, HAS_BIAS)
        out = total.to(q_ptr.dtype.element_ty).to(tl.float32)
        first, second = tl.split(tl.reshape(out, [BLOCK_N // 2, 2]))  # the two channels of each pair
        ps = pid * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        head, js = ps // HALF, ps % HALF
        c1, c2 = _pair_channels(js, HALF, ROTARY_HALF)
        ok = (ps < pairs) & (row < rows)
        # queries' and keys' pairs j < ROTARY_HALF; the values and the channels past the rotary's pass as they are
        rotated = ok & (head < heads + kv_heads) & (js < ROTARY_HALF)
        # rotate_half: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), cos/sin at the pair's channels c1, c2
        cos1 = tl.load(cos_ptr + row * cos_m + c1, mask=rotated, other=1.0).to(tl.float32)
        cos2 = tl.load(cos_ptr + row * cos_m + c2, mask=rotated, other=1.0).to(tl.float32)
        sin1 = tl.load(sin_ptr + row * cos_m + c1, mask=rotated, other=0.0).to(tl.float32)
        sin2 = tl.load(sin_ptr + row * cos_m + c2, mask=rotated, other=0.0).to(tl.float32)
        new_first = tl.where(rotated, first * cos1 - second * sin1, first).to(q_ptr.dtype.element_ty)
        new_second = tl.where(rotated, second * cos2 + first * sin2, second).to(q_ptr.dtype.element_ty)
        is_query = head < heads
        query = q_ptr + row * q_m + head * (2 * HALF)
        tl.store(query + c1, new_first, mask=ok & is_query)
        tl.store(query + c2, new_second, mask=ok & is_query)
        is_key = (head >= heads) & (head < heads + kv_heads)
        kv_head = tl.where(is_key, head - heads, head - heads - kv_heads)
        position = tl.load(pos_ptr + row % tokens, mask=row < rows, other=0)
        at = (row // tokens) * c_b + kv_head * c_h + position * c_s
        tl.store(k_ptr + at + c1, new_first, mask=ok & is_key)
        tl.store(k_ptr + at + c2, new_second, mask=ok & is_key)
        tl.store(v_ptr + at + c1, new_first, mask=ok & (head >= heads + kv_heads))
        tl.store(v_ptr + at + c2, new_second, mask=ok & (head >= heads + kv_heads))

    @triton.jit
    def _qkv_rotary_cache(
        x_ptr, gain_ptr, w_ptr, bias_ptr, cos_ptr, sin_ptr, pos_ptr, q_ptr, k_ptr, v_ptr,
        rows, tokens, pairs, inputs, heads, kv_heads, eps,
        x_m, w_n, cos_m, q_m, c_b, c_h, c_s,
        ROWS: tl.constexpr, PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr, HALF: tl.constexpr,
        ROTARY_HALF: tl.constexpr, PDL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        UNROLL: tl.constexpr,
    ):  # fmt: skip
        """The streaming GEMV's loop (`_stream_rows`) over a program's channel pairs (`_pair_rows`), each row's
        outputs rotated and stored where they go (`_store_rotated_row`)."""
        pid = tl.program_id(0)
        ws, w_ok = _pair_rows(pid, pairs, HALF, ROTARY_HALF, BLOCK_N)
        acc0, acc1, acc2, acc3, sq0, sq1, sq2, sq3 = _stream_rows(
            x_ptr, x_ptr, gain_ptr, w_ptr, ws, w_ok, rows, inputs, x_m, x_m, w_n, ROWS, PROLOGUE, PDL, BLOCK_K, UNROLL
        )
        out = (bias_ptr, q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, pos_ptr, pid, pairs, heads, kv_heads, ws, w_ok, q_m)
        layout = (cos_m, c_b, c_h, c_s)
        _store_rotated_row(
            acc0, sq0, 0, rows, tokens, inputs, eps, *out, *layout, PROLOGUE, HAS_BIAS, HALF, ROTARY_HALF, BLOCK_N
        )
        if ROWS > 1:
            _store_rotated_row(
                acc1, sq1, 1, rows, tokens, inputs, eps, *out, *layout, PROLOGUE, HAS_BIAS, HALF, ROTARY_HALF, BLOCK_N
            )
        if ROWS > 2:
            _store_rotated_row(
                acc2, sq2, 2, rows, tokens, inputs, eps, *out, *layout, PROLOGUE, HAS_BIAS, HALF, ROTARY_HALF, BLOCK_N
            )
            _store_rotated_row(
                acc3, sq3, 3, rows, tokens, inputs, eps, *out, *layout, PROLOGUE, HAS_BIAS, HALF, ROTARY_HALF, BLOCK_N
            )

    # one row (a batch-1 step) and 2-4 rows: the GEMV's blocks (triton_gemv.py); every BLOCK_N even (pairs). The
    # kernel rewrites the same cache entries each time the autotuner runs it
    _KEY = ["rows", "pairs", "inputs", "PROLOGUE", "HALF", "ROTARY_HALF"]
    _row_kernel = autotuned_streaming(_qkv_rotary_cache, ROW_CONFIGS, _KEY)
    _rows_kernel = autotuned_streaming(_qkv_rotary_cache, STREAMED_CONFIGS, _KEY)


def kernel_for(rows: int):
    """The kernel that takes `rows` rows (at most `STREAMED_ROWS`): autotuned for one row, or for 2 to 4."""
    return _row_kernel if rows == 1 else _rows_kernel


def _qkv_rotary_cache_body(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    gain: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    positions: torch.Tensor,
    heads: int,
    pdl: bool = False,
) -> torch.Tensor:
    batch, tokens, inputs = x.shape
    kv_heads, head_dim = key_cache.shape[1], key_cache.shape[-1]
    x2, cos2, sin2 = x.reshape(-1, inputs), cos.reshape(-1, cos.shape[-1]), sin.reshape(-1, sin.shape[-1])
    rows = x2.shape[0]
    query = x.new_empty(rows, heads * head_dim)
    pairs = weight.shape[0] // 2

    def grid(meta):  # a program streams BLOCK_N rows of the weight: BLOCK_N / 2 pairs
        return (triton.cdiv(pairs, meta["BLOCK_N"] // 2),)

    kernel = kernel_for(rows)
    dependent = pdl and pdl_launch(x)
    launchable(kernel, x, "qkv_rotary_cache", pdl=dependent)[grid](
        x2, weight if gain is None else gain, weight, weight if bias is None else bias, cos2, sin2, positions,
        query, key_cache, value_cache,
        rows, tokens, pairs, inputs, heads, kv_heads, eps,
        x2.stride(0), weight.stride(0), cos2.stride(0), query.stride(0),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        ROWS=triton.next_power_of_2(rows), PROLOGUE=PLAIN if gain is None else RMS_NORM, HAS_BIAS=bias is not None,
        HALF=head_dim // 2, ROTARY_HALF=cos.shape[-1] // 2, PDL=streaming_pdl(dependent),
    )  # fmt: skip
    return query.reshape(batch, tokens, heads * head_dim)


if triton is not None and not registered("qkv_rotary_cache"):

    @torch.library.triton_op("archlab::qkv_rotary_cache", mutates_args=("key_cache", "value_cache"))
    def _qkv_rotary_cache_op(
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        gain: torch.Tensor | None,
        eps: float,
        cos: torch.Tensor,
        sin: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        positions: torch.Tensor,
        heads: int,
    ) -> torch.Tensor:
        return _qkv_rotary_cache_body(x, weight, bias, gain, eps, cos, sin, key_cache, value_cache, positions, heads)


if triton is not None:
    register_pdl_twin("qkv_rotary_cache", functools.partial(_qkv_rotary_cache_body, pdl=True))


def qkv_rotary_cache(
    attention, layer: SpannedLayer, hidden_states: torch.Tensor, position_embeddings, norm: torch.nn.Module | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`attention.position_and_cache` of `attention.split_heads` of the q/k/v product of `norm(hidden_states)`, as
    one kernel where `qkv_rotary_cache_applies`: the queries (B, H, T, D) rotated, and the keys and values the step
    reads from `layer` (this step's written at its position)."""
    batch, tokens, _ = hidden_states.shape
    weight, bias = attention.fused_weights()
    hidden_states, cos, sin = rows_contiguous(hidden_states, *position_embeddings)
    gain, eps = (norm.weight, float(norm.variance_epsilon)) if norm is not None else (None, 0.0)
    heads = attention.num_heads
    positions = layer.write_positions(tokens)
    query = archlab_op("qkv_rotary_cache", hidden_states)(
        hidden_states, weight, bias, gain, eps, cos, sin, layer.keys, layer.values, positions, heads
    )
    keys, values = layer.read_span()
    return query.view(batch, tokens, heads, -1).transpose(1, 2), keys, values


__all__ = ["QKV_ROTARY_CACHE_DEVICES", "qkv_rotary_cache", "qkv_rotary_cache_applies"]
