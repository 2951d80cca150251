"""The self-attention of a decoding step (one query per row) as one Triton kernel written for it: split-KV
attention over grouped key/value heads (Dao et al.'s Flash-Decoding, 2023; Ainslie et al.'s GQA, 2023).

Why: a batch-1 decoding step of the 1.1B model on an H100 spent 7.6 µs a layer in cuDNN's attention (a prefill kernel
given 4 KV heads × 8 query rows: a handful of thread blocks) plus a memset kernel before it, for keys and values of
~100 kB a layer at 384 positions (docs/gpu.md, the decode-1 profile): 0.19 ms of a 1.35-ms busy step, and 44 of its
272 launches (each launch in a CUDA graph also costs ~1.6 µs of idle GPU). FlexAttention's generated decoding
kernel (flex_decoding.py) lost to it (0.85×): it splits the keys across every SM and reduces the splits in more
kernels. Here one program reads one KV head of one row, its keys in blocks, all the query heads of that KV head at
once (the keys and values read once, as `attention.one_token_grouped_sdpa` does), with an online softmax; no
memset, one launch a layer where the cache is short. Long caches at a small batch split each row's keys among
`splits` programs (`split_count`: enough programs for the GPU, from the cache's capacity, a fixed number per
compiled graph) whose partial results a second kernel combines — or, a candidate off by default
(`COMBINE_IN_SPLITS_DEVICES`), the program that finishes a row's KV head last, counted by an atomic (the
"last block" reduction of split-K and stream-K GEMMs): one kernel launch fewer a layer.

`decode_attention` is a `torch.library.triton_op`: inside `torch.compile` inductor calls the kernel from its generated
code (and CUDA graphs record it), in eager code it launches as it is. Where it applies (`triton_decoding_applies`):
one query per row, Triton importable, a device in `TRITON_DECODING_DEVICES`, SDPA as the attention implementation, no
soft-cap and no position bias (ALiBi, T5's buckets), a mask shared by the heads ((batch or 1, 1, 1, keys), boolean
or additive) or none, a head size that is a power of two from 16 to 256, fp32/fp16/bf16, inference (no dropout, no
gradient: the kernel has no backward). Attention sinks (GPT-OSS, attention_sinks.py) join it: each query head's sink
logit enters the running maximum and the denominator where the row's output is normalised (in the split kernel with
one split, else where the splits are combined), as a key of value zero. Everything else runs as before. The default
on CUDA (through the op's PDL twin, triton_launch.py): `--suite cuda-kernels` timed it at 1.9-4.6x SDPA's cuDNN kernel
at the 1.1B shape (batch 1 and 16, 384 and 2,048 keys; H200), and the batch-1 step with it and the fused layers at
1.25x the step before. On CPU the
tests run the kernel through Triton's interpreter (tests/triton_interpreter.py) against SDPA.
"""

from __future__ import annotations

import functools
import math

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
)

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU wheels of torch come without Triton: nothing here applies
    triton = None

# Devices on which a decoding step's self-attention runs through `decode_attention` (`triton_decoding_applies`).
TRITON_DECODING_DEVICES: tuple[str, ...] = NVIDIA_GPUS
HEAD_SIZES = (16, 32, 64, 128, 256)
# Keys one program reads before a row's keys are split among programs; and the programs the GPU wants busy. 64 (one
# block of keys): `--suite cuda-kernels` on an H200 (batch 1, 4 KV heads, two sessions) timed 384 keys at 7.5-7.6 µs
# in 1 split, 6.2 in 2 (256 keys a program, the value before), 5.7 in 4, 5.5 in 8, and 2,048 keys at 32.4 µs in 1,
# 18.1-18.4 in 2 (1,024 keys a program, the first value), 11.3 in 4, 8.4 in 8: each doubling of the splits still
# paying at 8. Now 384 keys take 6 splits, 2,048 keys 32 (the cap: TARGET_PROGRAMS over 4 KV heads)
KEYS_PER_PROGRAM = 64
TARGET_PROGRAMS = 128
# Devices on which the PDL twin's split attention combines the splits in the program that finishes a row's head
# last (an atomic count a (row, KV head), `_combine_splits` in `_decode_split_kernel`) rather than in a second
# kernel (`_decode_combine_kernel`): one kernel fewer a layer. A candidate, off until `--suite cuda-kernels` times it.
COMBINE_IN_SPLITS_DEVICES: tuple[str, ...] = ()
# Keys a program reads at once: up to 64, fewer for large heads in wide dtypes, so the pipelined key and value tiles
# stay within ~75 kB of shared memory (`block_keys`; consumer GPUs have ~100 kB)
BLOCK_KEYS = 64


def triton_decoding_applies(module, query: torch.Tensor, attention_mask: torch.Tensor | None, kwargs: dict) -> bool:
    """Whether `module`'s attention of `query` (B, H, T, D) runs through `decode_attention`."""
    return (
        triton is not None
        and query.device.type in TRITON_DECODING_DEVICES  # first: no guard on a traced length where it is not listed
        and kernels_fit(query)
        and query.shape[2] == 1
        and module.config._attn_implementation == "sdpa"
        and module.softcap is None
        and kwargs.get("position_bias") is None
        and (attention_mask is None or (attention_mask.dim() == 4 and attention_mask.shape[1:3] == (1, 1)))
        and query.shape[-1] in HEAD_SIZES
        and query.dtype in (torch.float32, torch.float16, torch.bfloat16)
        and not module.training  # no attention dropout
        and not (torch.is_grad_enabled() and query.requires_grad)  # no backward: inference only
    )


def block_keys(head_dim: int, element_size: int) -> int:
    """Keys a program reads at once for heads of `head_dim` values of `element_size` bytes (`BLOCK_KEYS` at most)."""
    return max(16, min(BLOCK_KEYS, 16384 // (head_dim * element_size)))


def split_count(rows: int, kv_heads: int, capacity: int) -> int:
    """How many programs share one row's keys of one KV head: one while `capacity` keys fit one program's
    `KEYS_PER_PROGRAM` or the batch's rows × heads alone keep the GPU busy; else enough for `TARGET_PROGRAMS`."""
    wanted = math.ceil(capacity / KEYS_PER_PROGRAM)
    room = max(1, TARGET_PROGRAMS // max(1, rows * kv_heads))
    return max(1, min(wanted, room))


if triton is not None:

    @triton.jit
    def _sink_logits(sink_ptr, h, GROUP: tl.constexpr, GROUP_ROWS: tl.constexpr):
        """The attention sinks' logits (float32) of KV head h's query heads, -inf past them (attention_sinks.py)."""
        rows = tl.arange(0, GROUP_ROWS)
        return tl.load(sink_ptr + h * GROUP + rows, mask=rows < GROUP, other=float("-inf")).to(tl.float32)

    @triton.jit
    def _combine_splits(
        part_ptr, stat_ptr, sink_ptr, out_ptr, pid, b, h, o_b, o_h, o_d,
        GROUP: tl.constexpr, GROUP_ROWS: tl.constexpr, HEAD: tl.constexpr, SPLITS: tl.constexpr,
        CACHE: tl.constexpr, SINKS: tl.constexpr,
    ):  # fmt: skip
        """Row b, KV head h (program `pid` of the split kernel's first axis): the splits' partial outputs rescaled to
        their common maximum and summed, in split order; with SINKS each query head's sink logit joins the maximum
        and the denominator (a key of value zero). CACHE: the loads' cache modifier (".cg": past the L1 cache, for
        partial results another multiprocessor wrote during this kernel)."""
        rows = tl.arange(0, GROUP_ROWS)
        dims = tl.arange(0, HEAD)
        best = tl.full([GROUP_ROWS], float("-inf"), tl.float32)
        if SINKS:
            sinks = _sink_logits(sink_ptr, h, GROUP, GROUP_ROWS)
            best = sinks
        for split in range(SPLITS):
            slot = (pid * SPLITS + split) * GROUP_ROWS + rows
            best = tl.maximum(best, tl.load(stat_ptr + slot * 2, cache_modifier=CACHE))
        safe = tl.where(best == float("-inf"), 0.0, best)
        total = tl.zeros([GROUP_ROWS], tl.float32)
        if SINKS:
            total = tl.exp(sinks - safe)
        acc = tl.zeros([GROUP_ROWS, HEAD], tl.float32)
        for split in range(SPLITS):
            slot = (pid * SPLITS + split) * GROUP_ROWS + rows
            factor = tl.exp(tl.load(stat_ptr + slot * 2, cache_modifier=CACHE) - safe)
            total += tl.load(stat_ptr + slot * 2 + 1, cache_modifier=CACHE) * factor
            part = tl.load(part_ptr + slot[:, None] * HEAD + dims[None, :], cache_modifier=CACHE)
            acc += part * factor[:, None]
        out = acc / tl.where(total == 0.0, 1.0, total)[:, None]
        tl.store(
            out_ptr + b * o_b + (h * GROUP + rows)[:, None] * o_h + dims[None, :] * o_d,
            out.to(out_ptr.dtype.element_ty),
            mask=(rows < GROUP)[:, None],
        )

    @triton.jit
    def _decode_split_kernel(
        q_ptr, k_ptr, v_ptr, mask_ptr, out_ptr, part_ptr, stat_ptr, count_ptr, sink_ptr,
        keys, kv_heads, scale,
        q_b, q_h, q_d,
        k_b, k_h, k_s, k_d,
        v_b, v_h, v_s, v_d,
        m_b, m_s,
        o_b, o_h, o_d,
        GROUP: tl.constexpr, GROUP_ROWS: tl.constexpr, HEAD: tl.constexpr, BLOCK: tl.constexpr,
        SPLITS: tl.constexpr, MASK: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr, COMBINE: tl.constexpr,
        SINKS: tl.constexpr,
    ):  # fmt: skip
        """One program: row b, KV head h, its split of the keys. MASK: 0 none, 1 boolean (True attends), 2 additive.
        SINKS: each query head's sink logit (`sink_ptr`, (H,) float32) joins the softmax's denominator.
        SPLITS == 1 writes the output; otherwise the unnormalised partial output and (max, sum) of the split, and
        with COMBINE the program that finishes its (row, KV head) last — the count at `count_ptr`, which it puts back
        to zero — combines the splits (`_combine_splits`)."""
        dependent_launch(PDL)
        pid = tl.program_id(0)
        split = tl.program_id(1)
        b = pid // kv_heads
        h = pid % kv_heads
        rows = tl.arange(0, GROUP_ROWS)
        row_ok = rows < GROUP
        dims = tl.arange(0, HEAD)
        q = tl.load(
            q_ptr + b * q_b + (h * GROUP + rows)[:, None] * q_h + dims[None, :] * q_d, mask=row_ok[:, None], other=0.0
        )
        blocks = tl.cdiv(tl.cdiv(keys, SPLITS), BLOCK)  # each split's blocks of keys; the last split's may end early
        start = split * blocks * BLOCK
        # once: inductor passes a Python float as an fp64 scalar (an fp64 tile otherwise), torch's mutation analysis of
        # a traced launch (torch 2.11) as a constant
        scale = tl.cast(scale, tl.float32)
        best = tl.full([GROUP_ROWS], float("-inf"), tl.float32)
        total = tl.zeros([GROUP_ROWS], tl.float32)
        acc = tl.zeros([GROUP_ROWS, HEAD], tl.float32)
        for block in range(0, blocks):
            cols = start + block * BLOCK + tl.arange(0, BLOCK)
            col_ok = cols < keys
            k_at = k_ptr + b * k_b + h * k_h + cols[:, None] * k_s + dims[None, :] * k_d
            k = tl.load(k_at, mask=col_ok[:, None], other=0.0)
            if IEEE:
                scores = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                scores = tl.dot(q, tl.trans(k))
            scores = scores * scale
            keep = col_ok
            if MASK == 1:
                keep = keep & (tl.load(mask_ptr + b * m_b + cols * m_s, mask=col_ok, other=0) != 0)
            if MASK == 2:
                scores += tl.load(mask_ptr + b * m_b + cols * m_s, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            scores = tl.where(keep[None, :], scores, float("-inf"))
            new_best = tl.maximum(best, tl.max(scores, 1))
            safe = tl.where(new_best == float("-inf"), 0.0, new_best)  # rows with nothing kept yet
            weights = tl.exp(scores - safe[:, None])
            rescale = tl.exp(best - safe)
            total = total * rescale + tl.sum(weights, 1)
            v_at = v_ptr + b * v_b + h * v_h + cols[:, None] * v_s + dims[None, :] * v_d
            v = tl.load(v_at, mask=col_ok[:, None], other=0.0)
            if IEEE:
                acc = acc * rescale[:, None] + tl.dot(weights.to(v.dtype), v, input_precision="ieee")
            else:
                acc = acc * rescale[:, None] + tl.dot(weights.to(v.dtype), v)
            best = new_best
        if SPLITS == 1:
            if SINKS:  # the sink as one more key of value zero: into the maximum and the denominator
                sinks = _sink_logits(sink_ptr, h, GROUP, GROUP_ROWS)
                both = tl.maximum(best, sinks)
                safe = tl.where(both == float("-inf"), 0.0, both)
                rescale = tl.exp(best - safe)
                total = total * rescale + tl.exp(sinks - safe)
                acc = acc * rescale[:, None]
            out = acc / tl.where(total == 0.0, 1.0, total)[:, None]
            tl.store(
                out_ptr + b * o_b + (h * GROUP + rows)[:, None] * o_h + dims[None, :] * o_d,
                out.to(out_ptr.dtype.element_ty),
                mask=row_ok[:, None],
            )
        else:
            slot = (pid * SPLITS + split) * GROUP_ROWS + rows
            tl.store(part_ptr + slot[:, None] * HEAD + dims[None, :], acc)
            tl.store(stat_ptr + slot * 2, best)
            tl.store(stat_ptr + slot * 2 + 1, total)
            if COMBINE:
                tl.debug_barrier()  # every thread's stores before the count (released with it to the whole GPU)
                finished = tl.atomic_add(count_ptr + pid, 1, sem="acq_rel", scope="gpu")
                if finished == SPLITS - 1:  # the last split of this row's KV head: the others' results are visible
                    _combine_splits(
                        part_ptr, stat_ptr, sink_ptr, out_ptr, pid, b, h, o_b, o_h, o_d, GROUP, GROUP_ROWS, HEAD,
                        SPLITS, ".cg", SINKS,
                    )  # fmt: skip
                    tl.atomic_xchg(count_ptr + pid, 0, sem="relaxed", scope="gpu")  # for the next launch

    @triton.jit
    def _decode_combine_kernel(
        part_ptr, stat_ptr, sink_ptr, out_ptr,
        kv_heads,
        o_b, o_h, o_d,
        GROUP: tl.constexpr, GROUP_ROWS: tl.constexpr, HEAD: tl.constexpr, SPLITS: tl.constexpr, PDL: tl.constexpr,
        SINKS: tl.constexpr,
    ):  # fmt: skip
        """One program: row b, KV head h; the splits' partial outputs rescaled to their common maximum and summed."""
        dependent_launch(PDL)
        pid = tl.program_id(0)
        _combine_splits(
            part_ptr, stat_ptr, sink_ptr, out_ptr, pid, pid // kv_heads, pid % kv_heads, o_b, o_h, o_d, GROUP,
            GROUP_ROWS, HEAD, SPLITS, "", SINKS,
        )  # fmt: skip


# Per device, every tensor of counts allocated, the last the largest: none is ever freed (a recorded CUDA graph keeps
# the address it was recorded with)
_SPLIT_COUNTS: dict[str, list[torch.Tensor]] = {}


def split_counts(device: torch.device, programs: int) -> torch.Tensor | None:
    """Zeroed int32 counts, one a (row, KV head), for the split kernel's combine (`COMBINE_IN_SPLITS_DEVICES`), kept
    per device for the process: each launch leaves them at zero, so a recorded CUDA graph replays on them (launches on
    two streams at once would share them: one model decoding at a time). None where the device is not listed, or
    where larger counts would be allocated while a CUDA graph is recorded (from the graph's memory pool): the second
    kernel combines then."""
    if device.type not in COMBINE_IN_SPLITS_DEVICES:
        return None
    kept = _SPLIT_COUNTS.setdefault(str(device), [])
    if not kept or kept[-1].numel() < programs:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        kept.append(torch.zeros(max(programs, 1024), dtype=torch.int32, device=device))
    return kept[-1]


def _decode_attention_body(query, key, value, mask, scale, splits, sinks=None, pdl: bool = False) -> torch.Tensor:
    """The op's body; `sinks`: the attention sinks' logits (H,), or None; `pdl`: launched by its PDL twin
    (triton_launch.py)."""
    batch, heads, _, head_dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    group = heads // kv_heads
    output = query.new_empty(batch, 1, heads, head_dim)
    if mask is None:
        kind, mask_ptr, mask_strides = 0, query, (0, 0)
    else:
        rows = mask[:, 0, 0, :keys]
        kind = 1 if rows.dtype == torch.bool else 2
        mask_ptr = rows  # a boolean mask as it is (*i1): inductor cannot lower a bool→uint8 view
        mask_strides = (rows.stride(0) if rows.shape[0] > 1 else 0, rows.stride(1))
    group_rows = max(16, triton.next_power_of_2(group))
    if splits > 1:
        parts = query.new_empty(batch * kv_heads * splits * group_rows, head_dim, dtype=torch.float32)
        stats = query.new_empty(batch * kv_heads * splits * group_rows, 2, dtype=torch.float32)
    else:  # not read or written with one split; not `output` either: a traced launch must not alias what it writes
        parts = stats = query.new_empty(0, dtype=torch.float32)
    dependent = pdl and pdl_launch(query)
    # the twin (opaque to torch.compile: the counts are its own) combines in the split kernel where listed
    counts = split_counts(query.device, batch * kv_heads) if pdl and splits > 1 else None
    sink_ptr = query.new_empty(0, dtype=torch.float32) if sinks is None else sinks.float()
    launchable(_decode_split_kernel, query, "decode_attention", pdl=dependent)[(batch * kv_heads, splits)](
        query, key, value, mask_ptr, output, parts, stats,
        query.new_empty(0, dtype=torch.int32) if counts is None else counts, sink_ptr,
        keys, kv_heads, scale,
        query.stride(0), query.stride(1), query.stride(3),
        key.stride(0), key.stride(1), key.stride(2), key.stride(3),
        value.stride(0), value.stride(1), value.stride(2), value.stride(3),
        *mask_strides,
        output.stride(0), output.stride(2), output.stride(3),
        GROUP=group, GROUP_ROWS=group_rows, HEAD=head_dim, BLOCK=block_keys(head_dim, query.element_size()),
        SPLITS=splits, MASK=kind, IEEE=query.dtype == torch.float32, PDL=dependent, COMBINE=counts is not None,
        SINKS=sinks is not None,
    )  # fmt: skip
    if splits > 1 and counts is None:
        launchable(_decode_combine_kernel, query, "decode_attention", pdl=dependent)[(batch * kv_heads,)](
            parts, stats, sink_ptr, output, kv_heads,
            output.stride(0), output.stride(2), output.stride(3),
            GROUP=group, GROUP_ROWS=group_rows, HEAD=head_dim, SPLITS=splits, PDL=dependent, SINKS=sinks is not None,
        )  # fmt: skip
    return output


if triton is not None and not registered("decode_attention"):

    @torch.library.triton_op("archlab::decode_attention", mutates_args=())
    def _decode_attention_op(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        mask: torch.Tensor | None,
        scale: float,
        splits: int,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return _decode_attention_body(query, key, value, mask, scale, splits, sinks)


if triton is not None:
    register_pdl_twin("decode_attention", functools.partial(_decode_attention_body, pdl=True))


def decode_attention(
    module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    capacity: int | None = None,
    sinks: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Queries (B, H, 1, D) over keys and values (B, H_kv, S, D), with a boolean or additive mask (B or 1, 1, 1, ≥ S)
    or none, as SDPA computes it; `sinks` (H,): attention sinks' logits in each head's denominator (GPT-OSS), or none;
    `capacity`: the most keys the cache holds (it sets the split, `split_count`, so one compiled graph serves every
    length). Returns (B, 1, H, D), as every attention function of the interface."""
    splits = split_count(query.shape[0], key.shape[1], capacity if capacity is not None else key.shape[2])
    output = archlab_op("decode_attention", query)(query, key, value, attention_mask, float(scaling), splits, sinks)
    return output, None


__all__ = [
    "COMBINE_IN_SPLITS_DEVICES",
    "TRITON_DECODING_DEVICES",
    "block_keys",
    "decode_attention",
    "split_count",
    "triton_decoding_applies",
]
