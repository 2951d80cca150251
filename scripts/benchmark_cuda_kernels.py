"""`--suite cuda-kernels`: archlab's Triton kernels for the decoding step, each against the PyTorch path it would
replace, at the reference shapes (the dense 1.1B model and the Mixtral-shaped MoE of benchmark_cuda.py), bf16.

A `--suite cuda-tuning` row times whole generations with a setting on and off: a minute of GPU time each, and the
answer is the step's. This suite times the kernels alone, the way a compiled decoding step runs them — `CALLS`
calls captured in one CUDA graph and replayed (no host launch cost; the gaps between kernels inside a graph kept) —
in seconds for all of them, with the share of the bandwidth roofline (the bytes a call must read once: keys and
values, or the weights) beside each — the calls cycling through copies of what they read that span twice the GPU's
L2 cache (`cold_copies`: one weight replayed 50 times stays in an H200's 50 MB L2, and its GEMV row read 23 MB at
"92 %" of the memory's bandwidth) — and the choices the kernels made (the attention's split count, the GEMV's and
the MoE's autotuned blocks). It says which kernel is worth a tuning row, and how to tune it:
- the decoding attention (triton_decoding.py) against SDPA over the grouped heads (attention.one_token_grouped_sdpa,
  what the step runs now: cuDNN's kernel and a memset on an H100), batch 1 and 16, 384 and 2,048 cached keys, with
  the split count `split_count` picks and, at batch 1, others; and at batch 1 through the PDL twin, the splits
  combined by the program finishing each KV head last (`COMBINE_IN_SPLITS_DEVICES`) against the second kernel;
- the GEMVs of a pre-norm layer's fused step (triton_gemv.py, decode_block.py) against what the compiled step runs
  (compiled the same way: inductor's norm, SwiGLU and add kernels, cuBLAS's GEMVs), 1, 4 and 16 rows (the last on
  the tensor-core kernel): RMSNorm inside the q/k/v product, the residual after the output projection, SwiGLU inside
  the down projection with the residual (at 16 rows with the shares of split-K the kernel chose, and the q/k/v
  product split against whole); and at 1 and 4 rows the q/k/v product with RoPE and the cache writes in its
  epilogue (triton_qkv.py) against the GEMV followed by the compiled rotation and cache writes;
- a pre-norm layer's decoding step (no cache: the attention is the same on both sides) fused against the default's
  step, both compiled with the step's options, 1, 4 (the streaming kernel's most: whether `FUSED_BLOCK_ROWS` can
  rise to it) and 16 rows; and at 1 row the fused step with its kernels launched
  dependent on the kernel before (the ops' PDL twins, triton_launch.py) against the fused step;
- the rest of a layer's step after its attention at 1 row (output projection, gate/up + SwiGLU, down projection)
  as one persistent kernel whose phases meet at barriers across the grid (triton_layer_tail.py) against the three
  GEMVs through their PDL twins and against its own phases as three dependent launches (what a barrier costs against
  a kernel boundary, the code the same), and the persistent kernel with 2 and 8 programs a processor, wider
  blocks, and tiles never halved against its defaults;
- an MoE's routed experts (triton_moe.py) against archlab's default experts (moe.Experts: grouped GEMMs), 1 and 4
  tokens, each token routed to 2 of 8 experts.
The kernels run on CUDA, or on a CPU through Triton's interpreter (TRITON_INTERPRET=1, in fp32: NumPy has no
bfloat16), which times nothing useful but runs every row's code (its test does); elsewhere the suite says so in a
note and measures nothing.

    python scripts/benchmark.py --suite cuda-kernels --device cuda --output cuda-kernels.md
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import math
import os
import sys
from collections.abc import Callable
from unittest import mock

import torch
import torch.nn.functional as F

from archlab.modeling import triton_decoding, triton_gemv, triton_moe
from archlab.scripts.benchmark_cuda import guarded, release, row, setup_from, shape, time_pair
from archlab.training.benchmarking import Report

# Calls captured in one CUDA graph: one replay is timed as a round
CALLS = 50
# Cached keys of the attention rows: the generate rows' 128 + 256 tokens, and a long cache
KEY_COUNTS = (384, 2048)


def calls_per_round(setup) -> int:
    return CALLS if setup.cuda else 1  # (one call under the interpreter: it takes a fraction of a second)


def cold_copies(setup, bytes_read: int) -> int:
    """How many copies of what a call reads (`bytes_read`) the calls of a graph cycle through so that together they
    span twice the GPU's L2 cache (at most `CALLS`): each call then reads from memory, as a decoding step reads a
    layer's weights once; one on CPU."""
    if not setup.cuda:
        return 1
    l2 = torch.cuda.get_device_properties(setup.device).L2_cache_size
    return max(1, min(CALLS, math.ceil(2 * l2 / max(1, bytes_read))))


def graphed(setup, call: Callable[..., object], operands: list[tuple] | None = None) -> Callable[[], None]:
    """`CALLS` calls of `call`, captured once in a CUDA graph (after a warm-up that autotunes and compiles): its
    replay; on CPU (the interpreter), one call as it is. Call i takes `operands[i % len(operands)]` as its arguments
    (`cold_copies`), or none."""
    operands = operands or [()]
    if not setup.cuda:

        def once() -> None:
            call(*operands[0])

        return once
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for index in range(3):
            call(*operands[index % len(operands)])
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for index in range(CALLS):
            call(*operands[index % len(operands)])
    return graph.replay


def kernel_row(
    setup, report: Report, metric: str, kernel: Callable, peer: Callable, bytes_read: int, extra=None, operands=None
):
    """One row: `kernel` against `peer` as calls per second, µs per call and % of the bandwidth roofline, each call
    of both with the arguments `graphed` gives it from `operands`."""
    pair = graphed(setup, kernel, operands), graphed(setup, peer, operands)
    graphed_row(setup, report, metric, *pair, bytes_read, extra)
    report.rows[-1].extra["copies"] = str(len(operands or [()]))


def graphed_row(setup, report: Report, metric: str, kernel: Callable, peer: Callable, bytes_read: int, extra=None):
    """`kernel_row` for calls already `graphed`."""
    timed = time_pair(setup, kernel, peer, setup.rounds)
    calls = calls_per_round(setup)
    per_call = (timed.archlab / calls, timed.peer / calls)
    bandwidth = setup.peaks.bandwidth
    roofline = tuple(None if not bandwidth else bytes_read / bandwidth / seconds for seconds in per_call)
    columns = {"µs archlab": f"{per_call[0] * 1e6:.2f}", "µs peer": f"{per_call[1] * 1e6:.2f}"}
    columns |= {"MB read": f"{bytes_read / 1e6:.2f}", **(extra or {})}
    report.rows.append(row(metric, timed, calls, "calls/s", roofline=roofline, extra=columns))


def _attention_inputs(setup, batch: int, keys: int):
    """A decoding step's attention at the dense model's heads: (query, the calls' (key, value) copies
    (`cold_copies`), the mask — the static cache's last eighth empty —, the bytes a call reads). `keys` a sixteenth
    at the quick size."""
    dense = shape("dense", setup.quick)
    heads, kv_heads = dense["num_attention_heads"], dense["num_key_value_heads"]
    head_dim = dense["hidden_size"] // heads
    keys = keys if not setup.quick else keys // 16
    generator = torch.Generator(device=setup.device).manual_seed(0)

    def normal(*size):
        return torch.randn(*size, generator=generator, device=setup.device, dtype=_dtype(setup))

    query = normal(batch, heads, 1, head_dim)
    key, value = normal(batch, kv_heads, keys, head_dim), normal(batch, kv_heads, keys, head_dim)
    mask = torch.ones(batch, 1, 1, keys, dtype=torch.bool, device=setup.device)
    mask[..., keys - keys // 8 :] = False  # the static cache's empty positions
    bytes_read = 2 * key.numel() * key.element_size()
    operands = [(key, value)] + [(key.clone(), value.clone()) for _ in range(cold_copies(setup, bytes_read) - 1)]
    return query, operands, mask, bytes_read


def attention_rows(setup, report: Report, batch: int, keys: int) -> None:
    query, operands, mask, bytes_read = _attention_inputs(setup, batch, keys)
    (_, heads, _, head_dim), (kv_heads, keys) = query.shape, operands[0][0].shape[1:3]
    scale = head_dim**-0.5
    grouped = query.reshape(batch, kv_heads, heads // kv_heads, head_dim)

    def peer(key, value):  # attention.one_token_grouped_sdpa's call
        return F.scaled_dot_product_attention(grouped, key, value, attn_mask=mask, scale=scale)

    default = triton_decoding.split_count(batch, kv_heads, keys)
    others = (1, 2, 4, 8) if batch == 1 else ()
    for splits in dict.fromkeys((default, *others)):

        def kernel(key, value, splits=splits):
            return torch.ops.archlab.decode_attention(query, key, value, mask, scale, splits)

        label = "split_count's choice" if splits == default else "forced"
        metric = (
            f"decoding attention, batch {batch}, {heads} heads / {kv_heads} KV heads of {head_dim}, {keys} keys, "
            f"{splits} split{'s' if splits > 1 else ''} ({label}): archlab's Triton kernel vs SDPA"
        )
        kernel_row(setup, report, metric, kernel, peer, bytes_read, operands=operands)


def combine_row(setup, report: Report, keys: int) -> None:
    """The split attention at batch 1 through the op's PDL twin (what the fused step launches), its splits combined
    by the program finishing each KV head last (`COMBINE_IN_SPLITS_DEVICES`) against the second, combining kernel."""
    query, operands, mask, bytes_read = _attention_inputs(setup, 1, keys)
    head_dim, (kv_heads, keys) = query.shape[-1], operands[0][0].shape[1:3]
    splits = triton_decoding.split_count(1, kv_heads, keys)

    def attention(key, value):
        return torch.ops.archlab.decode_attention_pdl(query, key, value, mask, head_dim**-0.5, splits)

    def combined(key, value):  # (patched at each call: on CUDA while the graph records it)
        with mock.patch.object(triton_decoding, "COMBINE_IN_SPLITS_DEVICES", (setup.device.type,)):
            return attention(key, value)

    metric = (
        f"decoding attention, batch 1, {keys} keys, {splits} split{'s' if splits > 1 else ''}, through the PDL twin: "
        "the splits combined by the last program of each KV head vs by a second kernel"
    )
    key, value = operands[0]
    for _ in range(2):  # the same output as the second kernel's, twice: the counts are back at zero after a call
        torch.testing.assert_close(combined(key, value), attention(key, value), rtol=1e-2, atol=1e-2)
    kernel_row(setup, report, metric, combined, attention, bytes_read, operands=operands)


def gemv_rows(setup, report: Report, rows: int) -> None:
    """The GEMVs of a pre-norm layer's fused step (decode_block.py) against what the default compiled step runs
    (inductor's code, compiled here as the step compiles it: its RMSNorm kernel, cuBLAS's GEMV, the add)."""
    from archlab.modeling.normalization import RMSNorm

    dense = shape("dense", setup.quick)
    hidden, inner = dense["hidden_size"], dense["intermediate_size"]
    heads, kv_heads = dense["num_attention_heads"], dense["num_key_value_heads"]
    qkv = hidden + 2 * kv_heads * (hidden // heads)
    generator = torch.Generator(device=setup.device).manual_seed(0)

    def normal(*size, scale=1.0):
        return torch.randn(*size, generator=generator, device=setup.device, dtype=_dtype(setup)) * scale

    x, residual = normal(rows, hidden), normal(rows, hidden)
    gate, up = normal(rows, inner), normal(rows, inner)
    norm = RMSNorm(hidden).to(setup.device, _dtype(setup))
    qkv_weight, o_weight = normal(qkv, hidden, scale=hidden**-0.5), normal(hidden, hidden, scale=hidden**-0.5)
    gate_up_weight = normal(2 * inner, hidden, scale=hidden**-0.5)
    down_weight = normal(hidden, inner, scale=inner**-0.5)

    def swiglu_of_gate_up(weight):
        gate, up = F.linear(norm(x), weight).chunk(2, dim=-1)
        return F.silu(gate) * up

    s = "s" if rows > 1 else ""
    cases = [
        (
            f"RMSNorm + q/k/v projection, {rows} row{s}, {hidden} → {qkv}: archlab's GEMV vs linear(norm(x))",
            lambda w: triton_gemv.gemv(x, w, norm=norm),
            lambda w: F.linear(norm(x), w),
            qkv_weight,
        ),
        (
            f"output projection + residual, {rows} row{s}, {hidden} → {hidden}: archlab's GEMV vs linear(x) + r",
            lambda w: triton_gemv.gemv(x, w, residual=residual),
            lambda w: F.linear(x, w) + residual,
            o_weight,
        ),
        (
            f"RMSNorm + gate/up projection + SwiGLU, {rows} row{s}, {hidden} → 2 × {inner} → {inner}: archlab's"
            " gated GEMV vs silu(gate) * up of linear(norm(x))",
            lambda w: triton_gemv.gated_gemv(x, w, norm=norm),
            swiglu_of_gate_up,
            gate_up_weight,
        ),
        (
            f"down projection + residual, {rows} row{s}, {inner} → {hidden}: archlab's GEMV vs linear(h) + r",
            lambda w: triton_gemv.gemv(gate, w, residual=residual),
            lambda w: F.linear(gate, w) + residual,
            down_weight,
        ),
        (
            f"SwiGLU + down projection + residual, {rows} row{s}, {inner} → {hidden}: archlab's GEMV with SwiGLU"
            " before (gated_down) vs down(silu(gate) * up) + r",
            lambda w: torch.ops.archlab.gated_down(gate, up, w, None, residual),
            lambda w: F.linear(F.silu(gate) * up, w) + residual,
            down_weight,
        ),
    ]
    for metric, kernel, peer, weight in cases:
        with torch.no_grad():
            bytes_read, operands = _weight_copies(setup, weight)
            kernel_row(setup, report, metric, kernel, _compiled(setup, peer), bytes_read, operands=operands)
        report.rows[-1].extra["kernel's choice"] = _best_config(triton_gemv.kernel_for(rows))
        if rows > triton_gemv.STREAMED_ROWS:  # the tensor-core kernel: split-K's shares (1: whole)
            shares = triton_gemv.split_count(weight.shape[0], weight.shape[1], x.device)
            report.rows[-1].extra["kernel's choice"] += f", {shares} shares of the inputs"
    if rows > triton_gemv.STREAMED_ROWS:  # split-K against the same kernel whole, on the q/k/v product

        def whole(weight):
            with mock.patch.object(triton_gemv, "split_count", lambda *args: 1):
                return triton_gemv.gemv(x, weight, norm=norm)

        metric = f"split-K tensor-core GEMV vs whole, RMSNorm + q/k/v projection, {rows} rows"
        with torch.no_grad():
            bytes_read, operands = _weight_copies(setup, qkv_weight)
            kernel_row(setup, report, metric, cases[0][1], whole, bytes_read, operands=operands)


def _weight_copies(setup, weight: torch.Tensor) -> tuple[int, list[tuple[torch.Tensor]]]:
    """The bytes a call reads of `weight`, and the calls' arguments: `weight` and its `cold_copies`."""
    bytes_read = weight.numel() * weight.element_size()
    return bytes_read, [(weight,)] + [(weight.clone(),) for _ in range(cold_copies(setup, bytes_read) - 1)]


def qkv_rotary_row(setup, report: Report, rows: int) -> None:
    """The q/k/v product with RoPE and the cache writes in one kernel (triton_qkv.py, in the fused step of the compiled
    loops) against the fused step's GEMV followed by what the step compiled around it: the rotation of q and k and
    the writes of k and v into the static cache (one inductor kernel). `rows` batch rows of one token each, a cache
    of 384 positions written at 100."""
    from archlab.modeling import triton_qkv
    from archlab.modeling.normalization import RMSNorm
    from archlab.modeling.rotary import rotary_formula

    dense = shape("dense", setup.quick)
    hidden, heads, kv_heads = dense["hidden_size"], dense["num_attention_heads"], dense["num_key_value_heads"]
    head_dim = hidden // heads
    qkv = hidden + 2 * kv_heads * head_dim
    generator = torch.Generator(device=setup.device).manual_seed(0)
    to = dict(device=setup.device, dtype=_dtype(setup))
    x = torch.randn(rows, 1, hidden, generator=generator, **to)
    weight = torch.randn(qkv, hidden, generator=generator, **to) * hidden**-0.5
    norm = RMSNorm(hidden).to(**to)
    angles = torch.rand(rows, 1, head_dim // 2, generator=generator, device=setup.device).repeat(1, 1, 2) * 6
    cos, sin = angles.cos().to(to["dtype"]), angles.sin().to(to["dtype"])
    caches = [torch.zeros(rows, kv_heads, KEY_COUNTS[0] + 1, head_dim, **to) for _ in range(4)]
    positions = torch.tensor([100], device=setup.device)

    def kernel(weight):
        return torch.ops.archlab.qkv_rotary_cache(
            x, weight, None, norm.weight, norm.variance_epsilon, cos, sin, caches[0], caches[1], positions, heads
        )

    def rotary_and_writes(projected):
        q, k, v = (
            t.view(rows, 1, -1, head_dim).transpose(1, 2)
            for t in projected.split([hidden, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
        )
        q, k = rotary_formula(q, k, cos, sin)
        caches[2].index_copy_(2, positions, k)
        caches[3].index_copy_(2, positions, v)
        return q

    compiled = _compiled(setup, rotary_and_writes)

    def peer(weight):
        return compiled(triton_gemv.gemv(x, weight, norm=norm))

    s = "s" if rows > 1 else ""
    metric = (
        f"RMSNorm + q/k/v projection + RoPE + cache writes, {rows} row{s}, {hidden} → {qkv}: archlab's one kernel "
        "vs its GEMV then the compiled rotation and index_copy_"
    )
    with torch.no_grad():
        bytes_read, operands = _weight_copies(setup, weight)
        kernel_row(setup, report, metric, kernel, peer, bytes_read, operands=operands)
    report.rows[-1].extra["kernel's choice"] = _best_config(triton_qkv.kernel_for(rows))


def layer_row(setup, report: Report, rows: int, pdl: bool = False) -> None:
    """A pre-norm layer of the dense model (1.1B shape) on one decoding step, fused (decode_block.py: four GEMVs,
    the norms and residual adds inside) against the default's step (inductor's norm, SwiGLU and add kernels around
    cuBLAS's GEMVs), both compiled with the decoding step's options, q/k/v and gate/up read as one product each
    (as generate reads them on CUDA). The attention has no cache here (it attends to the step's own token): it is
    the same kernel on both sides, and what differs is everything around it. `pdl`: the fused step with its kernels
    launched dependent on the kernel before (the ops' PDL twins, triton_launch.py; inductor's kernels with
    `triton.enable_pdl`) against the fused step."""
    from archlab import DecoderConfig, DecoderForCausalLM
    from archlab.modeling import decode_block, step_compile, triton_launch
    from archlab.modeling.fused_projections import inference_projections

    config = DecoderConfig(**{**shape("dense", setup.quick), "num_hidden_layers": 1})
    model = DecoderForCausalLM(config).to(setup.device, _dtype(setup)).eval()
    layer = model.model.layers[0]
    generator = torch.Generator(device=setup.device).manual_seed(0)
    hidden = torch.randn(rows, 1, config.hidden_size, generator=generator, device=setup.device, dtype=_dtype(setup))
    positions = torch.full((rows, 1), 100, device=setup.device)
    rotary = model.model.rotary_emb(hidden, positions)
    device = (setup.device.type,)
    # each side states all it runs (on CUDA the default fuses steps of one row, through the PDL twins)
    fused_on = [
        mock.patch.object(decode_block, "FUSED_BLOCK_DEVICES", device),
        mock.patch.object(decode_block, "FUSED_BLOCK_ROWS", rows),
    ]
    pdl_off, pdl_on = (mock.patch.object(triton_launch, "PDL_DEVICES", devices) for devices in ((), device))
    unfused = [mock.patch.object(decode_block, "FUSED_BLOCK_DEVICES", ()), pdl_off]
    options = step_compile.TUNED_STEP_OPTIONS
    pdl_options = {**options, **step_compile.DEPENDENT_LAUNCH_OPTIONS}

    def runner(patches: list, compile_options: dict | None) -> Callable[[], None]:
        """The layer's step with `patches` on, compiled with `compile_options` on CUDA (each a function of its own:
        a cache entry of its own), graphed; under the interpreter, the patches entered at each call."""

        def step():
            return layer(hidden, position_embeddings=rotary)[0]

        with contextlib.ExitStack() as stack:
            for patch in patches:
                stack.enter_context(patch)
            if setup.cuda:
                return graphed(setup, torch.compile(step, dynamic=False, options=compile_options))

        def patched_step():
            with contextlib.ExitStack() as stack:
                for patch in patches:
                    stack.enter_context(patch)
                return step()

        return graphed(setup, patched_step)

    weights = sum(p.numel() * p.element_size() for name, p in layer.named_parameters() if "norm" not in name)
    s = "s" if rows > 1 else ""
    if pdl:
        metric = (
            f"a pre-norm layer's decoding step (no cache), {rows} row{s}: the fused step launched dependent on the "
            "kernel before (archlab's PDL twins, inductor's triton.enable_pdl) vs the fused step, both compiled"
        )
    else:
        metric = (
            f"a pre-norm layer's decoding step (no cache), {rows} row{s}: the fused step (four GEMVs, "
            "decode_block.py) vs the default's (norms, GEMVs, SwiGLU, adds), both compiled"
        )
    with torch.no_grad(), inference_projections(model, force=True):
        if pdl:
            pair = (runner([*fused_on, pdl_on], pdl_options), runner([*fused_on, pdl_off], options))
        else:
            pair = (runner([*fused_on, pdl_off], options), runner(unfused, options))
        graphed_row(setup, report, metric, *pair, weights)


# The persistent layer tail's settings timed against its defaults (4 programs a processor, blocks (4, 1024, 2, 4)):
# fewer and more programs resident (registers capped to fit them), tiles of more rows and wider blocks of inputs
# over 8 warps, and every phase's tiles of 4 rows (not halved where that balances the programs' rows)
TAIL_VARIANTS = (
    ("PROGRAMS_PER_PROCESSOR", 2),
    ("PROGRAMS_PER_PROCESSOR", 8),
    ("TAIL_BLOCKS", (8, 2048, 1, 8)),
    ("BALANCED_TILES", False),
)


def layer_tail_rows(setup, report: Report) -> None:
    """The rest of a pre-norm layer's step after its attention (the dense 1.1B shape, one row): output projection +
    residual, RMSNorm + gate/up + SwiGLU, down + residual as one persistent kernel (triton_layer_tail.py) against the
    fused step's three GEMVs through their PDL twins (the default's); then the persistent kernel with other programs
    a processor and other blocks against its default. Each call reads one copy of the three weights (`cold_copies`)."""
    from archlab import DecoderConfig
    from archlab.modeling import triton_launch, triton_layer_tail
    from archlab.modeling.triton_gemv import gated_gemv, gemv
    from archlab.modeling.triton_layer_tail import (
        DOWN,
        GATE_UP,
        OUTPUT,
        launch_layer_tail,
        tail_counts,
        tail_programs,
    )

    config = DecoderConfig(**shape("dense", setup.quick))
    width, intermediate, dtype = config.hidden_size, config.intermediate_size, _dtype(setup)
    generator = torch.Generator(device=setup.device).manual_seed(0)

    def randn(*size, scale=1.0):
        return (torch.randn(*size, generator=generator, device=setup.device) * scale).to(dtype)

    heads, residual = randn(1, width), randn(1, width)
    norm = torch.nn.RMSNorm(width, eps=1e-6, device=setup.device, dtype=dtype)
    norm.variance_epsilon = norm.eps
    shapes = ((width, width), (2 * intermediate, width), (width, intermediate))
    bytes_read = sum(rows * inputs for rows, inputs in shapes) * torch.finfo(dtype).bits // 8
    operands = [
        tuple(randn(rows, inputs, scale=inputs**-0.5) for rows, inputs in shapes)
        for _ in range(cold_copies(setup, bytes_read))
    ]
    counts, pdl = tail_counts(setup.device), setup.cuda and triton_launch.has_dependent_launch(setup.device)

    def persistent(output, gate_up, down):
        programs = tail_programs(setup.device)
        args = (heads, residual, output, None, norm.weight, norm.eps, gate_up, None, down, None)
        return launch_layer_tail(*args, counts=counts, programs=programs, pdl=pdl)[0]

    def three_gemvs(output, gate_up, down):
        with mock.patch.object(triton_launch, "PDL_DEVICES", (setup.device.type,)):
            hidden = gemv(heads, output, residual=residual)
            return gemv(gated_gemv(hidden, gate_up, norm=norm), down, residual=hidden)

    def three_launches(output, gate_up, down):
        """The persistent kernel's phases as three launches of it (each dependent on the one before): the same code,
        kernel boundaries in place of the barriers."""
        programs = tail_programs(setup.device)
        args = (heads, residual, output, None, norm.weight, norm.eps, gate_up, None, down, None)
        _, hidden, _ = launch_layer_tail(*args, counts=counts, programs=programs, phases=OUTPUT, pdl=pdl)
        _, _, activated = launch_layer_tail(
            *args, counts=counts, programs=programs, phases=GATE_UP, hidden=hidden, pdl=pdl
        )
        return launch_layer_tail(
            *args, counts=counts, programs=programs, phases=DOWN, hidden=hidden, activated=activated, pdl=pdl
        )[0]

    metric = (
        "a layer's output projection, gate/up + SwiGLU and down projection, 1 row: one persistent kernel "
        "(triton_layer_tail.py) vs the three GEMVs through their PDL twins"
    )
    programs = str(tail_programs(setup.device))
    extra = {"kernel's choice": f"{programs} programs, blocks {triton_layer_tail.TAIL_BLOCKS}"}
    kernel_row(setup, report, metric, persistent, three_gemvs, bytes_read, extra, operands=operands)
    metric = (
        "the persistent layer tail, 1 row: its phases met at barriers vs the same phases as three dependent "
        "launches (kernel boundaries)"
    )
    kernel_row(setup, report, metric, persistent, three_launches, bytes_read, operands=operands)
    for setting, value in TAIL_VARIANTS:

        def varied(*weights, setting=setting, value=value):
            with mock.patch.object(triton_layer_tail, setting, value):
                return persistent(*weights)

        metric = f"the persistent layer tail, 1 row: {setting} = {value} vs the default's"
        kernel_row(setup, report, metric, varied, persistent, bytes_read, operands=operands)


def _compiled(setup, peer: Callable) -> Callable:
    """`peer` as the decoding step's compile runs it (inductor, on CUDA); as it is under the interpreter."""
    return torch.compile(peer, dynamic=False) if setup.cuda else peer


def moe_row(setup, report: Report, tokens: int) -> None:
    from archlab import DecoderConfig, DecoderForCausalLM

    config = DecoderConfig(**{**shape("moe", setup.quick), "num_hidden_layers": 1})
    experts = DecoderForCausalLM(config).model.layers[0].mlp.experts.to(setup.device, _dtype(setup)).eval()
    generator = torch.Generator(device=setup.device).manual_seed(0)
    hidden = torch.randn(tokens, config.hidden_size, generator=generator, device=setup.device, dtype=_dtype(setup))
    choice = torch.stack(
        [torch.randperm(config.num_local_experts, generator=generator, device=setup.device)[:2] for _ in range(tokens)]
    )
    weights = torch.softmax(torch.randn(tokens, 2, generator=generator, device=setup.device), -1).to(_dtype(setup))

    def kernel(experts):
        return triton_moe.moe_decode(experts, hidden, choice, weights)

    def peer(experts):
        with mock.patch.object(triton_moe, "MOE_DECODE_DEVICES", ()):
            return experts(hidden, choice, weights)

    used = choice.unique().numel()
    all_experts = sum(p.numel() * p.element_size() for p in (experts.gate_up_proj, experts.down_proj))
    bytes_read = all_experts * used // config.num_local_experts
    operands = [(experts,)] + [(copy.deepcopy(experts),) for _ in range(cold_copies(setup, bytes_read) - 1)]
    metric = (
        f"MoE routed experts, {tokens} token{'s' if tokens > 1 else ''} × 2 of {config.num_local_experts} experts "
        f"({used} distinct): archlab's Triton kernels vs archlab's default experts"
    )
    kernel_row(setup, report, metric, kernel, peer, bytes_read, operands=operands)
    report.rows[-1].extra["kernel's choice"] = _best_config(triton_moe._expert_down_kernel)


def _dtype(setup) -> torch.dtype:
    return torch.bfloat16 if setup.cuda else torch.float32  # (the interpreter computes with NumPy: no bfloat16)


def kernels_run_here(setup) -> bool:
    """Whether the kernels run on `setup`'s device: CUDA with Triton, or Triton's interpreter."""
    interpreting = os.environ.get("TRITON_INTERPRET") == "1"
    return triton_decoding.triton is not None and (setup.cuda or (interpreting and setup.device.type == "cpu"))


def _best_config(autotuned) -> str:
    best = getattr(autotuned, "best_config", None)
    if best is None:  # (Triton's interpreter does not autotune: triton_launch.py launches the first configuration)
        best = autotuned.configs[0]
        return f"{best.kwargs} warps {best.num_warps} (the first: not autotuned)"
    return f"{best.kwargs} warps {best.num_warps}"


def run(args: argparse.Namespace) -> Report:
    setup = setup_from(args)
    report = Report(
        title=f"CUDA suite, archlab's Triton kernels for the decoding step — {setup.peaks.name} — "
        f"{str(_dtype(setup)).removeprefix('torch.')}, {calls_per_round(setup)} calls per CUDA graph"
        + (" — --quick shapes" if setup.quick else ""),
        peer_name="peer",
    )
    if not kernels_run_here(setup):
        report.notes.append(
            "Nothing measured: the kernels run on CUDA with Triton installed, or on a CPU under Triton's interpreter "
            "(TRITON_INTERPRET=1), which times nothing useful."
        )
        return report
    # the layer's step first (does the fused step win at all?), then the attention, the GEMVs, the MoE's kernels
    for rows in (1, triton_gemv.STREAMED_ROWS, triton_gemv.MAX_ROWS):
        guarded(report, setup, f"layer, {rows} rows", functools.partial(layer_row, setup, report, rows))
    guarded(report, setup, "layer with PDL, 1 row", functools.partial(layer_row, setup, report, 1, pdl=True))
    guarded(report, setup, "persistent layer tail, 1 row", functools.partial(layer_tail_rows, setup, report))
    for batch, keys in ((1, KEY_COUNTS[0]), (1, KEY_COUNTS[1]), (16, KEY_COUNTS[0])):
        measure = functools.partial(attention_rows, setup, report, batch, keys)
        guarded(report, setup, f"attention, batch {batch}, {keys} keys", measure)
    for keys in KEY_COUNTS:
        guarded(report, setup, f"attention combine, {keys} keys", functools.partial(combine_row, setup, report, keys))
    for rows in (1, triton_gemv.STREAMED_ROWS, triton_gemv.MAX_ROWS):
        guarded(report, setup, f"GEMV, {rows} rows", functools.partial(gemv_rows, setup, report, rows))
    for rows in (1, triton_gemv.STREAMED_ROWS):
        guarded(report, setup, f"q/k/v + RoPE, {rows} rows", functools.partial(qkv_rotary_row, setup, report, rows))
    for tokens in (1, triton_moe.MAX_TOKENS):
        guarded(report, setup, f"MoE, {tokens} tokens", functools.partial(moe_row, setup, report, tokens))
    release(setup.device)
    report.notes.append(
        "µs per call: a CUDA graph of the calls replayed, its time over the calls; % roofline: the bytes a call must "
        "read once (keys and values; the weights; the chosen experts' weights) at the peak bandwidth, over that time; "
        "copies: of what a call reads, cycled through by the calls so that they span twice the L2 cache (up to "
        f"{CALLS}; a layer row's calls read one layer, larger than the L2 at the reference shape)."
    )
    return report


def main(argv: list[str] | None = None) -> int:
    from archlab.scripts import benchmark

    return benchmark.main(["--suite", "cuda-kernels", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
