"""The benchmark harness: two or more models timed side by side in one process (warm-up, interleaved rounds, the
median of per-round ratios), the exact peak memory of a training step, and where a step's time goes.

Absolute times drift on shared machines; ratios measured within one round do not, so every comparison is a median
of per-round ratios. `scripts/benchmark.py` runs its suites on this harness, and the ablation study
(`archlab.training.ablation`) its paired speed checks.

On a GPU the same functions take the device: kernels run asynchronously, so the timer is read only after
`torch.cuda.synchronize()` (before a run starts and after it ends), and peak memory comes from the caching
allocator's own counter (`torch.cuda.max_memory_allocated`, reset before each measured call). The columns a GPU
table adds (MFU, share of the bandwidth roofline) are computed in `archlab.training.roofline`.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch


@dataclass
class Row:
    metric: str
    archlab: float
    peer: float
    ratio: float  # > 1: archlab better (faster, or less memory)
    unit: str
    goal: str = ""
    # Further columns, already formatted, by header (MFU, peak memory, ...); a row without one shows it empty.
    extra: dict[str, str] = field(default_factory=dict)


@dataclass
class Report:
    title: str
    peer_name: str
    rows: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def markdown(self) -> str:
        extra = list(dict.fromkeys(header for r in self.rows for header in r.extra))
        goals = any(r.goal for r in self.rows)
        headers = ["metric", "archlab", self.peer_name, "ratio", *extra] + (["goal"] if goals else [])
        aligns = ["---", "---:", "---:", "---:", *("---:" for _ in extra)] + (["---"] if goals else [])
        lines = [f"### {self.title}", "", _table_line(headers), "|" + "|".join(aligns) + "|"]
        for r in self.rows:
            cells = [r.metric, f"{r.archlab:,.1f} {r.unit}", f"{r.peer:,.1f} {r.unit}", f"{r.ratio:.2f}×"]
            cells += [r.extra.get(header, "") for header in extra] + ([r.goal] if goals else [])
            lines.append(_table_line(cells))
        lines += [""] + [f"- {n}" for n in self.notes]
        return "\n".join(lines)


def _table_line(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


# ----------------------------------------------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------------------------------------------
@contextmanager
def torch_threads(count: int | None) -> Iterator[None]:
    """torch's intra-op thread count set to `count` (None: left as is) for the block, and restored after it, so a
    benchmark or study called from Python (a test, a notebook) leaves the caller's setting as it found it."""
    before = torch.get_num_threads()
    if count:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def synchronize(device: torch.device | str | None) -> None:
    """Wait for the device's queued kernels (a no-op on CPU, whose calls return when their work is done)."""
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def interleaved_rounds(
    runs: dict[str, Callable[[], object]], rounds: int, warmup: int = 1, device: torch.device | str | None = None
) -> dict[str, list[float]]:
    """Seconds of each run in each of `rounds` rounds, after `warmup` untimed calls of every run.

    Round r runs them rotated by r places, so each run takes each position equally often; with more than two runs,
    every other round also reverses that order, so no run always follows the same one (with two, the rotation alone
    alternates which goes first, and reversing it as well would undo that). On a GPU (`device`), each timer starts
    after the queue is empty and stops once the run's kernels have finished."""
    for _ in range(warmup):
        for run in runs.values():
            run()
    names = list(runs)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        if r % 2 and len(names) > 2:
            order.reverse()
        for name in order:
            synchronize(device)
            start = time.perf_counter()
            runs[name]()
            synchronize(device)
            times[name].append(time.perf_counter() - start)
    return times


def median_ratios(times: dict[str, list[float]], reference: str) -> dict[str, float]:
    """Per run, the median over rounds of (its time / `reference`'s time in the same round): > 1 means the reference
    was faster."""
    return {name: statistics.median(t / ref for t, ref in zip(ts, times[reference])) for name, ts in times.items()}


def compare_speed(
    run_archlab: Callable[[], None],
    run_peer: Callable[[], None],
    rounds: int,
    warmup: int = 1,
    device: torch.device | str | None = None,
):
    """Median seconds of each and the median per-round speed-up (peer time / archlab time), alternating order."""
    times = interleaved_rounds({"archlab": run_archlab, "peer": run_peer}, rounds, warmup, device)
    return (
        statistics.median(times["archlab"]),
        statistics.median(times["peer"]),
        median_ratios(times, "archlab")["peer"],
    )


# ----------------------------------------------------------------------------------------------------------------
# Memory and profile
# ----------------------------------------------------------------------------------------------------------------
def peak_training_memory(model: torch.nn.Module, step: Callable[[], None], optimizer) -> int:
    """Peak bytes of live tensors (params, grads, optimizer state, activations, temporaries) over one step.

    On CPU, torch's MemTracker counts every tensor the step holds. On a GPU, the allocator's peak over the step,
    less what was allocated before it, plus the model's and optimiser's own tensors: the same quantity, even when
    other models share the device (their resident tensors are in the baseline and cancel)."""
    device = next(model.parameters()).device
    if device.type == "cuda":
        return peak_cuda_memory(step, resident_bytes(model, optimizer), device)
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    with tracker:
        step()
    snapshot = tracker.get_tracker_snapshot("peak")
    return int(sum(device_stats["Total"] for device_stats in snapshot.values()))


def resident_bytes(model: torch.nn.Module, optimizer=None) -> int:
    """Bytes of the model's parameters and buffers and the optimiser's state, each storage counted once (tied or
    shared weights are one tensor)."""
    tensors = [*model.parameters(), *model.buffers()]
    if optimizer is not None:
        tensors += [value for state in optimizer.state.values() for value in state.values() if torch.is_tensor(value)]
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t.device.type != "meta"
    }
    return sum(storages.values())


def peak_cuda_memory(run: Callable[[], object], resident: int, device: torch.device | str = "cuda") -> int:
    """Peak bytes `run` holds on a GPU: the allocator's peak during the call above what was allocated before it,
    plus `resident`, the bytes of what the run owns that already existed (its weights, optimiser state)."""
    synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    run()
    synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before + resident


GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_grouped_mm")


def time_breakdown(step: Callable[[], None]) -> dict[str, float]:
    """Share of one step's CPU time spent in GEMMs, in fused attention kernels and in everything else (profiler,
    self time per op). With the same GEMMs, no implementation can be faster than 1 / (gemm + attention) times this
    step: the rest (norms, activations, RoPE, loss, optimizer) is all there is to remove."""
    from torch.profiler import ProfilerActivity, profile

    # Kineto, the profiler's C++ backend, prints "USDT: ... profiler_start" / "profiler_stop" to stderr at every
    # profile. USDT is its highest severity, above ERROR, so only a level past it (6) silences them, and Kineto's
    # error lines with them: a profile that recorded nothing fails below instead. Kineto reads the variable once
    # per process, at the first profile; a value the caller set wins.
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    step()  # warm: the first profiled call would also count one-off costs (allocations, lazy initialisation)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    total = gemm = attention = 0.0
    for event in prof.key_averages():
        total += event.self_cpu_time_total
        if event.key in GEMM_OPS:
            gemm += event.self_cpu_time_total
        elif "scaled_dot_product" in event.key:
            attention += event.self_cpu_time_total
    if total <= 0:
        raise RuntimeError("The profiler recorded no CPU time; run again with KINETO_LOG_LEVEL=0 to see why.")
    return {"gemm": gemm / total, "attention": attention / total, "other": 1 - (gemm + attention) / total}


def breakdown_notes(models: list[tuple[str, torch.nn.Module, object]], batch: dict) -> list[str]:
    """One `time_breakdown` sentence per (name, model, optimizer): where its training step goes, and the ceiling."""
    notes = []
    for name, model, optimizer in models:
        shares = time_breakdown(training_step(model, batch, optimizer))
        notes.append(
            f"Where {name}'s training step goes: GEMMs {shares['gemm']:.0%}, attention kernels "
            f"{shares['attention']:.0%}, everything else {shares['other']:.0%} — with these GEMMs, even a free "
            f"'everything else' would make the step at most {1 / (1 - shares['other']):.2f}× faster."
        )
    return notes


def native_bf16() -> str:
    """Whether this CPU multiplies bf16 natively (AMX or AVX512-BF16); without it bf16 GEMMs are emulated."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return "unknown (no /proc/cpuinfo)"
    native = sorted(flags & {"amx_bf16", "avx512_bf16"})
    return f"yes ({', '.join(native)})" if native else "no (no amx_bf16 / avx512_bf16: bf16 GEMMs are emulated)"


# ----------------------------------------------------------------------------------------------------------------
# The training step timed
# ----------------------------------------------------------------------------------------------------------------
# The optimisers a benchmark can step, by Trainer's `optim` names. Trainer's default is "adamw_torch_fused"
# (torch >= 2.8), so that is what a training benchmark times unless asked otherwise; the optimiser is the same for
# both models.
OPTIMIZERS = {"adamw_torch_fused": {"fused": True}, "adamw_torch": {"foreach": True}}


def make_optimizer(model: torch.nn.Module, optim: str = "adamw_torch_fused", lr: float = 1e-4) -> torch.optim.AdamW:
    """AdamW over `model`'s parameters as Trainer builds it for `optim` (one of `OPTIMIZERS`)."""
    if optim not in OPTIMIZERS:
        raise ValueError(f"optim={optim!r} is not a benchmark optimiser; allowed: {sorted(OPTIMIZERS)}")
    return torch.optim.AdamW(model.parameters(), lr=lr, **OPTIMIZERS[optim])


def training_step(model, batch: dict, optimizer, autocast_dtype: torch.dtype | None = None) -> Callable[[], None]:
    """One optimiser step over `batch`, under autocast to `autocast_dtype` on the model's device when given (bf16
    autocast over fp32 weights is what `Trainer(bf16=True)` does)."""
    device_type = next(model.parameters()).device.type

    def step() -> None:
        with torch.autocast(device_type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step
