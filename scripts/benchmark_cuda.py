"""What the CUDA suites share: the reference shapes of the GPU workloads (and their `--quick` miniatures), the
models built in pairs with the same weights, the device and its peak rates, and one comparison made into a table row
with MFU or the share of the bandwidth roofline, and peak memory, per side.

The suites are `cuda-train` (scripts/benchmark_cuda_train.py), `cuda-decode` and `cuda-static`
(scripts/benchmark_cuda_decode.py). They run on CPU too (`--device cpu --quick`): the same code at a tiny size,
with MFU and roofline shown as n/a unless `--peak-tflops` / `--peak-bandwidth` give the rates.
"""

from __future__ import annotations

import argparse
import gc
import re
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch

from archlab.training.benchmarking import Report, Row, compare_speed, peak_cuda_memory, resident_bytes
from archlab.training.roofline import DevicePeaks, device_peaks

# The reference workloads (LlamaConfig / MixtralConfig / MarianConfig names), and their --quick miniatures.
DENSE = dict(
    vocab_size=32000,
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=22,
    num_attention_heads=32,
    num_key_value_heads=4,
)
BIG_VOCAB = dict(DENSE, vocab_size=128256, num_hidden_layers=16, num_key_value_heads=8)
MOE = dict(
    vocab_size=32000,
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=4,
    num_local_experts=8,
    num_experts_per_tok=2,
)
MARIAN = dict(
    vocab_size=32000,
    d_model=1024,
    encoder_layers=6,
    decoder_layers=6,
    encoder_attention_heads=16,
    decoder_attention_heads=16,
    encoder_ffn_dim=4096,
    decoder_ffn_dim=4096,
)
QUICK_DENSE = dict(
    vocab_size=1024,
    hidden_size=128,
    intermediate_size=344,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
QUICK = {
    "dense": QUICK_DENSE,
    "big_vocab": dict(QUICK_DENSE, vocab_size=4096),
    "moe": dict(QUICK_DENSE, intermediate_size=176, num_local_experts=4, num_experts_per_tok=2),
    "marian": dict(
        vocab_size=1024,
        d_model=64,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=256,
        decoder_ffn_dim=256,
    ),
}
FULL = {"dense": DENSE, "big_vocab": BIG_VOCAB, "moe": MOE, "marian": MARIAN}


def shape(name: str, quick: bool) -> dict:
    return dict((QUICK if quick else FULL)[name])


def dense_equivalent(moe_shape: dict) -> dict:
    """The dense shape of an MoE shape's active FLOPs: no experts, one FFN of k × the expert width."""
    dense = {k: v for k, v in moe_shape.items() if k not in ("num_local_experts", "num_experts_per_tok")}
    dense["intermediate_size"] = moe_shape["intermediate_size"] * moe_shape["num_experts_per_tok"]
    return dense


# ----------------------------------------------------------------------------------------------------------------
# The device, and what every row needs from the command line
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class Setup:
    device: torch.device
    peaks: DevicePeaks
    quick: bool
    rounds: int
    decode_rounds: int
    optim: str

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


def setup_from(args: argparse.Namespace) -> Setup:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        if device.index is not None:  # `cuda` alone means the current device (torch >= 2.11 refuses it here)
            torch.cuda.set_device(device)
        # What Trainer and the peers' own benchmarks run with: TF32 for any fp32 matmul left outside autocast.
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    return Setup(
        device=device,
        peaks=device_peaks(device, args.peak_tflops, args.peak_bandwidth),
        quick=args.quick,
        rounds=args.rounds,
        decode_rounds=args.decode_rounds,
        optim=args.optim,
    )


def describe(setup: Setup) -> str:
    """One note naming the device, its peaks and where they come from, and the software."""
    peaks = setup.peaks
    tflops = f"{peaks.flops / 1e12:,.0f} TFLOP/s bf16" if peaks.flops else "peak FLOP/s unknown"
    bandwidth = f"{peaks.bandwidth / 1e12:,.2f} TB/s" if peaks.bandwidth else "peak bandwidth unknown"
    import transformers

    return (
        f"{peaks.name}: {tflops}, {bandwidth} ({peaks.source}); torch {torch.__version__}"
        f"{f' (CUDA {torch.version.cuda})' if setup.cuda else ''}, transformers {transformers.__version__}. "
        "MFU counts model FLOPs as PaLM (appendix B) does: the causal half of attention included, no recomputation."
    )


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


_logged: set[int] = set()


def guarded(report: Report, setup: Setup, what: str, measure: Callable[[], None]) -> None:
    """Run one comparison; if it fails (out of memory, a kernel missing on this GPU), the table says so in a note
    and the next comparison still runs. The GPU's cache is emptied after each."""
    start, rows_before = time.perf_counter(), len(report.rows)
    log(f"{what}: start")
    try:
        measure()
    except Exception as error:  # every failure becomes a note: one broken row must not cost the others
        traceback.print_exc()
        first_line = (str(error).strip().splitlines() or [""])[0][:300]
        report.notes.append(f"{what}: failed — {type(error).__name__}: {first_line}")
    finally:
        release(setup.device)
    # Each row as soon as it is measured: a run stopped at its time limit still leaves these in the log.
    for r in report.rows[rows_before:]:
        if id(r) in _logged:  # an inner comparison logged it already
            continue
        _logged.add(id(r))
        columns = ", ".join(f"{k} {v}" for k, v in r.extra.items())
        log(f"row: {r.metric}: {r.archlab:,.1f} vs {r.peer:,.1f} {r.unit}, {r.ratio:.2f}×; {columns}")
    log(f"{what}: {time.perf_counter() - start:.0f} s")


# ----------------------------------------------------------------------------------------------------------------
# The goals the GPU issues set, shown beside the rows they judge
# ----------------------------------------------------------------------------------------------------------------
# (regular expression the row's metric starts with, goal); the first match wins. Training rows also carry the
# memory goal (peak memory never above the peer's: "mem peer ÷ archlab" ≥ 1.0×). The liger rows time archlab
# eager; the 1.15× goal is for the scripts' default path (compiled).
TRAIN_MEMORY = "peer ÷ archlab mem ≥ 1.0×"
TRAIN_GOALS = [
    (r"dense 1\.1B: archlab compiled vs Llama eager", f"≥ 1.5× (the scripts' default), {TRAIN_MEMORY}"),
    (r"dense 1\.1B: archlab compiled vs Llama compiled", f"≥ 1.0×, MFU ≥ 45 %, {TRAIN_MEMORY}"),
    (r"dense 1\.1B: archlab .*vs LlamaForCausalLM \+ ", f"≥ 1.15× for the default path, {TRAIN_MEMORY}"),
    (r"vocab 128256: archlab (compiled vs Llama eager|vs LlamaForCausalLM \(eager\))", "≥ 1.2×, mem ≥ 1.3×"),
    (r"MoE \(Mixtral shape\): archlab MoE (compiled )?vs dense", f"≥ 0.9×, {TRAIN_MEMORY}"),
    (r"MoE \(Mixtral shape\): archlab (compiled (whole )?)?vs Mixtral", f"≥ 3×, {TRAIN_MEMORY}"),
    (
        r"encoder-decoder \(Marian shape, .*\): archlab (compiled (whole )?vs Marian eager|vs MarianMTModel)",
        f"≥ 1.3×, {TRAIN_MEMORY}",
    ),
    (r"[^:]*: archlab('s | compiled whole vs archlab)", ""),  # archlab against itself: settings, no goal
    (r"[^:]*: archlab", TRAIN_MEMORY),  # any other training row (e.g. compiled vs compiled peers)
]
DECODE_GOALS = [
    (
        r"dense 1\.1B greedy decode, batch 1, .*StaticCache: archlab vs Llama",
        "≥ 2.5×, ≥ 50 % roofline (H100: 808 tok/s, H200: 1,157)",
    ),
    (r"dense 1\.1B greedy decode, batch (16|64), .*StaticCache: archlab vs Llama", "≥ 1.5×"),
    (r"dense 1\.1B prefill", "MFU ≥ 50 %"),
    (r"MoE \(Mixtral shape\) greedy decode, batch \d+, each model's default", "≥ 2×"),
    (r"encoder-decoder \(Marian shape\) beam search, .*each model's default", "≥ 2×"),
]


def with_goals(report: Report, goals: list[tuple[str, str]]) -> Report:
    """Each row's goal: the first of `goals` whose pattern its metric starts with (none: no goal)."""
    for r in report.rows:
        r.goal = next((goal for pattern, goal in goals if re.match(pattern, r.metric)), "")
    return report


# ----------------------------------------------------------------------------------------------------------------
# Models in pairs: the peer built first, archlab loading its state dict (strict)
# ----------------------------------------------------------------------------------------------------------------
DECODER_COMMON = dict(
    max_position_embeddings=4096,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
    rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    attn_implementation="sdpa",
)


def build_on(device: torch.device, make: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    """Build a model directly on `device` (no fp32 copy on the host; a GPU initialises 1B weights in a blink).
    Not under the meta device: that would leave the rotary tables on meta."""
    torch.manual_seed(0)
    with torch.device(device):
        return make()


def decoder_pair(peer_class, peer_config_class, shape_kwargs: dict, device: torch.device):
    """(archlab DecoderForCausalLM, peer) with the peer's weights."""
    from archlab import DecoderConfig, DecoderForCausalLM

    kwargs = {**DECODER_COMMON, **shape_kwargs}
    peer = build_on(device, lambda: peer_class(peer_config_class(**kwargs)))
    ours = build_on(device, lambda: DecoderForCausalLM(DecoderConfig(**kwargs)))
    ours.load_state_dict(peer.state_dict(), strict=True)
    return ours, peer


def llama_pair(shape_kwargs: dict, device: torch.device):
    from transformers import LlamaConfig, LlamaForCausalLM

    return decoder_pair(LlamaForCausalLM, LlamaConfig, shape_kwargs, device)


def marian_kwargs(shape_kwargs: dict, max_positions: int) -> dict:
    return dict(
        shape_kwargs,
        max_position_embeddings=max_positions,
        activation_function="swish",
        scale_embedding=True,
        dropout=0.1,
        pad_token_id=shape_kwargs["vocab_size"] - 1,
        decoder_start_token_id=shape_kwargs["vocab_size"] - 1,
        eos_token_id=0,
        forced_eos_token_id=0,
        bos_token_id=None,
        attn_implementation="sdpa",
    )


def marian_pair(shape_kwargs: dict, max_positions: int, device: torch.device):
    """(archlab Seq2SeqForConditionalGeneration, MarianMTModel) with Marian's weights."""
    from transformers import MarianConfig, MarianMTModel

    from archlab import Seq2SeqConfig, Seq2SeqForConditionalGeneration

    kwargs = marian_kwargs(shape_kwargs, max_positions)
    peer = build_on(device, lambda: MarianMTModel(MarianConfig(**kwargs)))
    ours = build_on(device, lambda: Seq2SeqForConditionalGeneration(Seq2SeqConfig(**kwargs, sinusoidal_layout="split")))
    ours.load_state_dict(peer.state_dict(), strict=True)
    return ours, peer


def random_ids(vocab: int, *size: int, device: torch.device, low: int = 3, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(low, vocab - 1, size, generator=generator).to(device)


# ----------------------------------------------------------------------------------------------------------------
# One comparison, one row
# ----------------------------------------------------------------------------------------------------------------
def percent(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f} %"


def memory(value: int | None) -> str:
    if value is None:
        return "n/a"
    return f"{value / 2**30:,.2f} GiB" if value >= 2**30 else f"{value / 2**20:,.1f} MiB"


def utilisation(work: float | None, seconds: float, peak: float | None) -> float | None:
    """Achieved rate over peak: FLOPs / seconds / peak FLOP/s (MFU)."""
    return None if work is None or peak is None else work / seconds / peak


@dataclass
class Timed:
    """A comparison's medians: seconds per call of each side and the median per-round speed-up."""

    archlab: float
    peer: float
    ratio: float


def time_pair(setup: Setup, run_archlab: Callable, run_peer: Callable, rounds: int, warmup: int = 1) -> Timed:
    return Timed(*compare_speed(run_archlab, run_peer, rounds, warmup, device=setup.device))


def peak_memory_pair(setup: Setup, runs: tuple[Callable, Callable], models: tuple[torch.nn.Module, ...]):
    """Peak bytes each side holds over one more call, on a GPU (None on CPU, where only a training step has an
    exact counter: the training rows use theirs)."""
    if not setup.cuda:
        return None, None
    return tuple(peak_cuda_memory(run, resident_bytes(model), setup.device) for run, model in zip(runs, models))


def row(
    metric: str,
    timed: Timed,
    work: float,
    unit: str,
    *,
    mfu: tuple[float | None, float | None] | None = None,
    roofline: tuple[float | None, float | None] | None = None,
    peak: tuple[int | None, int | None] | None = None,
    extra: dict[str, str] | None = None,
) -> Row:
    """A table row: `work` units (tokens) per second each side, the ratio, then MFU or % of roofline, peak memory
    and any further columns."""
    columns: dict[str, str] = {}
    if mfu is not None:
        columns["MFU archlab"], columns["MFU peer"] = percent(mfu[0]), percent(mfu[1])
    if roofline is not None:
        columns["% roofline archlab"], columns["% roofline peer"] = percent(roofline[0]), percent(roofline[1])
    if peak is not None:
        columns["peak mem archlab"], columns["peak mem peer"] = memory(peak[0]), memory(peak[1])
        if peak[0] and peak[1]:
            columns["mem peer ÷ archlab"] = f"{peak[1] / peak[0]:.2f}×"
    columns.update(extra or {})
    return Row(metric, work / timed.archlab, work / timed.peer, timed.ratio, unit, extra=columns)


if __name__ == "__main__":
    sys.exit(
        "scripts/benchmark_cuda.py is the shared code of the cuda-* suites, not a suite: run "
        "python scripts/benchmark.py --suite cuda-train (or cuda-headline, cuda-decode, ...; --help lists them)."
    )
