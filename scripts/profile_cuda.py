"""Where the GPU time of archlab's reference workloads goes: torch.profiler over a few steps of each, summarised.

The CUDA suites of scripts/benchmark.py say how fast archlab is against its peers; this says why. For each workload
it profiles a few steps after a warm-up (which compiles what the default path compiles) and writes one markdown
file: the wall time per step, how much of it the GPU was busy (the rest is host overhead, launch gaps or syncs),
kernels per step, the GPU time by kind of kernel (GEMM, attention, fused Triton, optimizer, other), and the top
kernels. One call on a lent GPU (scripts/gpu/session.sh `profile`) then answers "kernel time or gaps? which
kernels?" for every workload at once.

    python scripts/profile_cuda.py --device cuda --output profile/           # every workload, reference shapes
    python scripts/profile_cuda.py --workload decode-1 --workload prefill    # some of them
    python scripts/profile_cuda.py --device cpu --quick --output /tmp/p      # the CPU rehearsal (tests run it)

Workloads (the shapes of scripts/benchmark_cuda.py: the dense 1.1B Llama shape unless named):
    train         a training step as scripts/pretrain.py runs it on a GPU: bf16 autocast, fused AdamW, the decoder
                  layers compiled regionally (accelerate's compile_regions), batch 4 x 2048
    train-eager   the same step uncompiled (plain Trainer, DeepSpeed, FSDP)
    train-moe     the Mixtral-shape MoE training step as the scripts run it on a GPU (compiled regionally, as
                  cuda-train-compiled times it; 8 experts, top-2, aux loss): 0.69x the dense model of equal active
                  FLOPs there; eager it was host-bound (GPU busy 58 %)
    train-moe-dense  the dense model of the MoE's active FLOPs (FFN 2 x 2816, the rest of its shape), the same way:
                  the MoE's goal is 0.9x its speed, and the two profiles side by side say where the MoE's extra time
                  goes (its 2.85x parameters: optimizer and weight casts; routing; grouped against plain GEMMs)
    train-seq2seq the Marian-shape encoder-decoder training step, the same way (compiled regionally, 32 x (256 +
                  256)); eager it was host-bound (GPU busy 46 %)
    prefill       the forward of one 2048-token prompt in bf16, logits of the last position (q/k/v and gate/up laid
                  out as generate lays them out on CUDA: one product each), eager as generate runs it
    prefill-compiled  the same compiled whole with dynamic shapes, as generate's fast path compiles its prefill
                  (modeling/compiled_prefill.py; eager, the GPU waited on the host two thirds of the time)
    ttft          `generate(max_new_tokens=1, compile_prefill=True)` on one 2048-token prompt, as the time-to-first-
                  token rows run it: on CUDA the prompt's forward replayed as a CUDA graph (prefill_buckets.py); what
                  is left of the wall time beside its ~8.5 ms of kernels is generate's own host work
    decode-1      `generate` at batch 1 (bf16, 128-token prompt, 256 new tokens), archlab's default path (on CUDA
                  archlab's Triton kernels: the attention, each layer's step as four GEMVs with the norms, SwiGLU
                  and residual adds inside, every kernel launched dependent on the one before)
    decode-64     the same at batch 64
    decode-1-tuned  decode-1 with the step compiled with coordinate-descent tuning beside the default's options
                  (inductor's batch-1 GEMVs as Triton reductions fused with the norm and SwiGLU: 0.94x the default
                  on an H100; its kernels' rates say whether hand-written fused GEMVs could beat cuBLAS's)
    decode-1-before  decode-1 without archlab's Triton kernels (the default before them: cuDNN's attention,
                  cuBLAS's GEMVs, inductor's norm, SwiGLU and add kernels): its times beside decode-1's
On CPU the "kernels" are the leaf operators the profiler records, and busy time is their union.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch
from torch.autograd import DeviceType

from archlab.modeling.fused_projections import inference_projections
from archlab.scripts.benchmark_cuda import dense_equivalent, random_ids, shape
from archlab.scripts.benchmark_cuda_decode import greedy_call
from archlab.training.benchmarking import make_optimizer, synchronize, training_step

WORKLOADS = (
    "train",
    "train-eager",
    "train-moe",
    "train-moe-dense",
    "train-seq2seq",
    "prefill",
    "prefill-compiled",
    "ttft",
    "decode-1",
    "decode-64",
    "decode-1-tuned",
    "decode-1-before",
)
# Substrings of kernel (or operator) names, lower-cased, by kind; the first kind that matches wins.
KINDS = (
    ("attention", ("flash", "fmha", "attention", "cudnn", "sdpa", "softmax")),
    # cuBLAS runs a decoding step's matrix-vector products as gemv kernels, and split-K GEMMs end in a reduction
    (
        "GEMM",
        (
            "gemm",
            "gemv",
            "splitkreduce",
            "cutlass",
            "nvjet",
            "cublas",
            "xmma",
            "wgmma",
            "aten::mm",
            "aten::addmm",
            "aten::bmm",
        ),
    ),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("fused Triton", ("triton",)),
    ("copy / cast", ("copy", "memcpy", "memset", "fill", "cat")),
)


def kind_of(name: str) -> str:
    lowered = name.lower()
    return next((kind for kind, keys in KINDS if any(key in lowered for key in keys)), "other elementwise / reduction")


def kernels(profile, device: torch.device) -> list[tuple[str, float, float]]:
    """(name, start µs, duration µs) of what ran on `device`: CUDA kernels, or on CPU the leaf operators. A
    `record_function` range shows on the GPU's timeline too (the optimiser's `Optimizer.step#AdamW.step` spans its
    kernels): a user annotation, not a kernel, so left out (it had counted the optimiser's time twice)."""
    found = []
    for event in profile.events():
        if device.type == "cuda":
            if event.device_type != DeviceType.CUDA or getattr(event, "is_user_annotation", False):
                continue
        elif event.device_type != DeviceType.CPU or event.cpu_children:
            continue
        found.append((event.name, event.time_range.start, event.time_range.elapsed_us()))
    return found


def busy_microseconds(spans: list[tuple[str, float, float]]) -> float:
    """The union of the kernels' time ranges (overlapping kernels, e.g. on two streams, counted once)."""
    busy, end = 0.0, float("-inf")
    for _, start, duration in sorted(spans, key=lambda span: span[1]):
        stop = start + duration
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    return busy


def summary(name: str, device: torch.device, steps: int, wall: float, spans, top: int = 25) -> str:
    """The markdown report of one workload: `steps` steps took `wall` seconds and ran `spans`."""

    def ms(microseconds: float) -> str:  # over all steps -> per step
        return f"{microseconds / 1e3 / steps:,.3f}"

    busy = busy_microseconds(spans)
    total = sum(duration for _, _, duration in spans) or 1.0
    by_kind, by_name, calls = defaultdict(float), defaultdict(float), defaultdict(int)
    for kernel, _, duration in spans:
        by_kind[kind_of(kernel)] += duration
        by_name[kernel] += duration
        calls[kernel] += 1
    lines = [
        f"## {name} — {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}",
        "",
        f"{steps} steps profiled: {wall * 1e3 / steps:,.2f} ms per step wall, "
        f"{ms(busy)} ms busy ({100 * busy / 1e6 / wall:.0f} % of the wall time), "
        f"{len(spans) / steps:,.0f} kernels per step.",
        "",
        "| kind | ms per step | % of kernel time |",
        "|---|---:|---:|",
    ]
    for kind, duration in sorted(by_kind.items(), key=lambda item: -item[1]):
        lines.append(f"| {kind} | {ms(duration)} | {100 * duration / total:.1f} |")
    lines += ["", "| kernel | calls per step | ms per step | % |", "|---|---:|---:|---:|"]
    for kernel, duration in sorted(by_name.items(), key=lambda item: -item[1])[:top]:
        label = kernel.replace("|", "/")[:110]
        lines.append(f"| `{label}` | {calls[kernel] / steps:g} | {ms(duration)} | {100 * duration / total:.1f} |")
    return "\n".join(lines) + "\n"


# ---- the workloads: each returns (warm-up, one step, steps per profiled call) -----------------------------------
def dense_model(device: torch.device, quick: bool, dtype: torch.dtype | None = None):
    from archlab import DecoderConfig, DecoderForCausalLM
    from archlab.scripts.benchmark_cuda import DECODER_COMMON, build_on

    model = build_on(device, lambda: DecoderForCausalLM(DecoderConfig(**DECODER_COMMON, **shape("dense", quick))))
    return model.to(dtype) if dtype is not None else model


def training(model, batch: dict, compiled: bool = False) -> tuple[Callable, Callable, int]:
    """Optimiser steps of `model` on `batch` as Trainer(bf16=True) runs them; the decoder layers compiled regionally
    (accelerate's compile_regions, what the scripts do on a GPU) when `compiled`."""
    model.train()
    wrapper = model
    if compiled:
        from accelerate.utils import compile_regions

        wrapper = compile_regions(model, dynamic=False)
    step = training_step(wrapper, batch, make_optimizer(model), torch.bfloat16)  # Trainer(bf16=True)'s autocast
    return (lambda: [step() for _ in range(2)]), step, 1


def dense_training(device: torch.device, quick: bool, compiled: bool) -> tuple[Callable, Callable, int]:
    model = dense_model(device, quick)
    batch, length = (2, 64) if quick else (4, 2048)
    ids = random_ids(model.config.vocab_size, batch, length, device=device)
    return training(model, {"input_ids": ids, "labels": ids, "use_cache": False}, compiled)


def moe_training(device: torch.device, quick: bool, dense: bool = False) -> tuple[Callable, Callable, int]:
    """The Mixtral-shape MoE (8 experts, top-2) as cuda-train-compiled times it: compiled regionally, router aux
    loss on; with `dense`, the dense model of its active FLOPs instead (one FFN of k x the expert width)."""
    from archlab import DecoderConfig, DecoderForCausalLM
    from archlab.scripts.benchmark_cuda import DECODER_COMMON, build_on

    moe = shape("moe", quick)
    if dense:
        kwargs = dict(DECODER_COMMON, **dense_equivalent(moe))
    else:
        kwargs = dict(DECODER_COMMON, **moe, output_router_logits=True, router_aux_loss_coef=0.01)
    model = build_on(device, lambda: DecoderForCausalLM(DecoderConfig(**kwargs)))
    batch, length = (2, 64) if quick else (4, 2048)
    ids = random_ids(model.config.vocab_size, batch, length, device=device)
    return training(model, {"input_ids": ids, "labels": ids, "use_cache": False}, compiled=True)


def seq2seq_training(device: torch.device, quick: bool) -> tuple[Callable, Callable, int]:
    """The Marian-shape encoder-decoder as cuda-train-compiled times it: compiled regionally, 32 × (256 source + 256
    target) tokens."""
    from archlab import Seq2SeqConfig, Seq2SeqForConditionalGeneration
    from archlab.scripts.benchmark_cuda import build_on, marian_kwargs

    batch, length = (2, 32) if quick else (32, 256)
    config = Seq2SeqConfig(**marian_kwargs(shape("marian", quick), length + 2), sinusoidal_layout="split")
    model = build_on(device, lambda: Seq2SeqForConditionalGeneration(config))
    vocab = config.vocab_size
    source = random_ids(vocab, batch, length, device=device, low=1, seed=1)
    labels = random_ids(vocab, batch, length, device=device, low=1, seed=2)
    batch = {"input_ids": source, "attention_mask": torch.ones_like(source), "labels": labels}
    return training(model, batch, compiled=True)


def prefill(device: torch.device, quick: bool, compiled: bool = False) -> tuple[Callable, Callable, int]:
    model = dense_model(device, quick, torch.bfloat16).eval()
    ids = random_ids(model.config.vocab_size, 1, 64 if quick else 2048, device=device)
    runner = model
    if compiled:  # as generate's compiled prefill compiles it (modeling/compiled_prefill.py): whole, dynamic shapes
        runner = torch.compile(model, dynamic=True, fullgraph=True)

    def forward() -> None:
        with torch.no_grad(), inference_projections(model):  # as generate's prefill runs: q/k/v, gate/up fused on CUDA
            runner(input_ids=ids, use_cache=False, logits_to_keep=1)

    return (lambda: [forward() for _ in range(2)]), forward, 1


def time_to_first_token(device: torch.device, quick: bool) -> tuple[Callable, Callable, int]:
    model = dense_model(device, quick, torch.bfloat16).eval()
    ids = random_ids(model.config.vocab_size, 1, 64 if quick else 2048, device=device)
    kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False)

    def generate() -> None:
        model.generate(**kwargs, pad_token_id=0, compile_prefill=True)

    # the cache's allocation, the prefill's compile, its warm-up and recording; then replays
    return (lambda: [generate() for _ in range(4)]), generate, 1


def tuned_step_config():
    """The decoding step's default compile options with coordinate-descent tuning added (step_compile.py)."""
    from torch._inductor import list_mode_options
    from transformers import CompileConfig

    from archlab.modeling.step_compile import TUNED_STEP_OPTIONS

    options = {**list_mode_options("reduce-overhead"), **TUNED_STEP_OPTIONS, "coordinate_descent_tuning": True}
    return CompileConfig(fullgraph=True, mode=None, options=options)


def without_archlab_kernels():
    """While it is entered, the decoding step runs without archlab's Triton kernels (the fused layer steps, the
    attention, the MoE kernels, their PDL twins) and without inductor's dependent launches: the default before them
    (on a CPU rehearsal nothing changes: the kernels are CUDA's)."""
    from archlab.scripts.benchmark_cuda_decode import without_decode_kernels

    return without_decode_kernels()


def decoding(
    device: torch.device, quick: bool, batch: int, tuned: bool = False, before: bool = False
) -> tuple[Callable, Callable, int]:
    batch = min(batch, 4) if quick else batch
    model = dense_model(device, quick, torch.bfloat16).eval()
    prompt, new = (16, 16) if quick else (128, 256)
    kwargs = greedy_call(model.config.vocab_size, batch, prompt, new, device)
    if tuned:
        kwargs["compile_config"] = tuned_step_config()

    def generate() -> None:
        with without_archlab_kernels() if before else contextlib.nullcontext():
            model.generate(**kwargs)

    return generate, generate, new


def workload(name: str, device: torch.device, quick: bool) -> tuple[Callable, Callable, int]:
    if name.startswith("train-moe"):
        return moe_training(device, quick, dense=name == "train-moe-dense")
    if name == "train-seq2seq":
        return seq2seq_training(device, quick)
    if name.startswith("train"):
        return dense_training(device, quick, compiled=name == "train")
    if name.startswith("prefill"):
        return prefill(device, quick, compiled=name == "prefill-compiled")
    if name == "ttft":
        return time_to_first_token(device, quick)
    batch = int(name.split("-")[1])
    return decoding(device, quick, batch, tuned=name.endswith("-tuned"), before=name.endswith("-before"))


def profile_workload(name: str, device: torch.device, quick: bool, rounds: int) -> str:
    warm_up, step, steps_per_call = workload(name, device, quick)
    warm_up()
    synchronize(device)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as profile:
        start = time.perf_counter()
        for _ in range(rounds):
            step()
        synchronize(device)
        wall = time.perf_counter() - start
    return summary(name, device, rounds * steps_per_call, wall, kernels(profile, device))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", action="append", choices=WORKLOADS, help="repeatable (default: every one)")
    parser.add_argument("--device", default=None, help="cuda, cuda:1 or cpu (default: cuda when one is visible)")
    parser.add_argument("--quick", action="store_true", help="tiny shapes (the CPU rehearsal)")
    parser.add_argument("--rounds", type=int, default=3, help="profiled calls per workload, >= 1 (default: 3)")
    parser.add_argument(
        "--output", type=Path, default=Path("profile.md"), help="markdown file: every workload's report, in order"
    )
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: no CUDA device is visible")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    # One file, rewritten after each workload: what a run cut short had finished is on disk, and a GPU session gets
    # it back as one file (the device tool returns at most 8 files of a call).
    reports: list[str] = []
    failed = 0
    for name in args.workload or WORKLOADS:
        print(f"[{time.strftime('%H:%M:%S')}] profiling {name}", file=sys.stderr, flush=True)
        try:
            report = profile_workload(name, device, args.quick, args.rounds)
        except Exception as error:  # one workload failing (out of memory, a compile error) leaves the others
            failed += 1
            report = f"## {name}\n\nfailed: {type(error).__name__}: {error}\n"
        reports.append(report)
        args.output.write_text("\n".join(reports))
        print(report, flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
