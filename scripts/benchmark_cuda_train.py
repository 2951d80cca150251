"""`--suite cuda-train`: training steps on a GPU, archlab against its Hugging Face peers with the same weights.

Every step is what `Trainer(bf16=True)` runs: bf16 autocast over fp32 weights, the loss, backward, and Trainer's
default optimiser (fused AdamW, `--optim`), no KV cache. The workloads (batch × tokens per sequence):

- dense 1.1B (Llama shape: vocab 32000, hidden 2048, FFN 5632, 22 layers, 32 / 4 heads), 4 × 2048, against
  `LlamaForCausalLM`; against Llama patched by liger-kernel (`apply_liger_kernel_to_llama`, where liger is
  installed; it patches transformers' Llama for the whole process, so it runs in a child process of its own), archlab
  eager and compiled regionally (the scripts' default on a GPU); and both compiled by accelerate's `compile_regions`
  (the way scripts/benchmark_compile.py does), plus compiled archlab against eager Llama;
- a 128256-token vocabulary (16 layers, 32 / 8 heads), 4 × 2048, against Llama (and liger): peak memory is the point;
- mixture of experts (Mixtral shape: hidden 1024, 8 layers, 16 / 4 heads, 8 experts of FFN 2816, top 2), 4 × 2048,
  against `MixtralForCausalLM` (its default experts implementation, and eager) and against the dense Llama of the
  same active FLOPs (FFN 2 × 2816); cuda-train-compiled: the same both compiled regionally;
- encoder-decoder (Marian shape: d_model 1024, 6 + 6 layers, 16 heads, FFN 4096), 32 × (256 + 256), against
  `MarianMTModel`.

Per row: tokens/s both sides and the median per-round ratio, MFU (model FLOPs, attention included, over time and
the GPU's peak: archlab.training.roofline) and peak memory of a step both sides. `--quick` runs the same at tiny
shapes; `--device cpu --quick` runs it on CPU.

    python scripts/benchmark.py --suite cuda-train --device cuda --output cuda-train.md
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch

from archlab.scripts.benchmark_cuda import (
    TRAIN_GOALS,
    Setup,
    decoder_pair,
    dense_equivalent,
    describe,
    guarded,
    llama_pair,
    log,
    marian_pair,
    random_ids,
    row,
    setup_from,
    shape,
    time_pair,
    utilisation,
    with_goals,
)
from archlab.training.benchmarking import (
    Report,
    Row,
    make_optimizer,
    peak_training_memory,
    synchronize,
    training_step,
)
from archlab.training.roofline import decoder_training_flops, seq2seq_training_flops

BF16 = torch.bfloat16
# The Llama-shaped workloads (name in benchmark_cuda's shapes, label in the table), each also against liger.
DENSE_WORKLOADS = (("dense", "dense 1.1B"), ("big_vocab", "vocab 128256"))


def batch_shape(setup: Setup) -> tuple[int, int]:
    return (2, 64) if setup.quick else (4, 2048)


def decoder_batch(setup: Setup, vocab: int) -> dict:
    batch, seq = batch_shape(setup)
    ids = random_ids(vocab, batch, seq, device=setup.device)
    # No KV cache in training: Llama builds a DynamicCache even in train mode unless told not to, and a compiled
    # block would recompile for the cache objects' state.
    return {"input_ids": ids, "labels": ids, "use_cache": False}


def training_row(setup: Setup, metric: str, models, optimizers, batch: dict, flops, tokens: int) -> Row:
    """Time one training step of each side (archlab first in `models`), then measure each step's peak memory."""
    steps = [training_step(m, batch, o, BF16) for m, o in zip(models, optimizers)]
    timed = time_pair(setup, *steps, setup.rounds)
    try:
        peak = tuple(peak_training_memory(m, s, o) for m, s, o in zip(models, steps, optimizers))
    except Exception as error:  # CPU's MemTracker does not follow every model (compiled regions); say why
        log(f"{metric}: peak memory not measured: {type(error).__name__}: {error}")
        peak = (None, None)
    flops = flops if isinstance(flops, tuple) else (flops, flops)
    mfu = tuple(utilisation(f, t, setup.peaks.flops) for f, t in zip(flops, (timed.archlab, timed.peer)))
    return row(metric, timed, tokens, "tok/s", mfu=mfu, peak=peak)


def decoder_flops(setup: Setup, config) -> float:
    return decoder_training_flops(config, *batch_shape(setup))


# ----------------------------------------------------------------------------------------------------------------
# The workloads
# ----------------------------------------------------------------------------------------------------------------
def dense_rows(setup: Setup, report: Report, name: str, label: str, compiled: bool, eager: bool = True) -> None:
    ours, llama = llama_pair(shape(name, setup.quick), setup.device)
    ours.train(), llama.train()
    batch, (b, s) = decoder_batch(setup, llama.config.vocab_size), batch_shape(setup)
    optimizers = {id(m): make_optimizer(m, setup.optim) for m in (ours, llama)}
    flops = decoder_flops(setup, llama.config)
    if eager:
        report.rows.append(
            training_row(
                setup,
                f"{label}: archlab vs LlamaForCausalLM (eager)",
                (ours, llama),
                (optimizers[id(ours)], optimizers[id(llama)]),
                batch,
                flops,
                b * s,
            )
        )
    if compiled:
        compiled_rows(setup, report, label, (ours, llama), optimizers, batch, flops, b * s, "Llama")


def compiled_for_training(setup: Setup, model, batch: dict, optimizer, whole: bool = False, mode: str | None = None):
    """`model` compiled by accelerate's `compile_regions` (what `--torch_compile`, on by default on a GPU, gives the
    scripts' Trainer), or with `whole` by `torch.compile` in `mode` (what `--regional_compilation false` gives, with
    `--torch_compile_mode`), and the seconds of its first step (the cold compile of the forward and backward
    graphs)."""
    from accelerate.utils import compile_regions

    if whole:
        wrapper = torch.compile(model, dynamic=False, mode=mode)
    else:
        wrapper = compile_regions(model, dynamic=False)
    start = time.perf_counter()
    training_step(wrapper, batch, optimizer, BF16)()
    synchronize(setup.device)
    return wrapper, time.perf_counter() - start


def compiled_rows(
    setup: Setup, report: Report, label: str, models, optimizers: dict, batch, flops, tokens, peer, whole=False
):
    """Both models compiled regionally (`compiled_for_training`): archlab compiled against the peer compiled the same
    way, and against the peer eager (what its users get by default). With `whole`, archlab compiled whole against
    archlab compiled regionally too (a small model's regions each cost their guards and wrappers on the host), and
    archlab compiled whole with CUDA graphs (mode "reduce-overhead": the forward and backward replayed, no launch
    from the host but the optimizer's) against the peer eager.
    `optimizers` by `id` of the eager models, whose weights the compiled wrappers share. Returns archlab's
    regionally compiled wrapper."""
    compiled = [compiled_for_training(setup, m, batch, optimizers[id(m)]) for m in models]
    wrappers = tuple(wrapper for wrapper, _ in compiled)
    cold = dict(zip(("archlab", peer), (seconds for _, seconds in compiled)))
    optimizer_pair = tuple(optimizers[id(m)] for m in models)
    for metric, pair in (
        (f"archlab compiled vs {peer} compiled (same tool on both)", wrappers),
        (f"archlab compiled vs {peer} eager (the Hugging Face default)", (wrappers[0], models[1])),
    ):
        report.rows.append(training_row(setup, f"{label}: {metric}", pair, optimizer_pair, batch, flops, tokens))
    report.notes.append(
        f"{label}, accelerate `compile_regions(dynamic=False)`: cold compile + first step {cold['archlab']:.0f} s "
        f"(archlab), {cold[peer]:.0f} s ({peer})."
    )
    if whole:
        ours = optimizers[id(models[0])]
        whole_model, seconds = compiled_for_training(setup, models[0], batch, ours, whole=True)
        for metric, pair, pair_optimizers in (
            ("archlab compiled whole vs archlab compiled regionally", (whole_model, wrappers[0]), (ours, ours)),
            (f"archlab compiled whole vs {peer} eager", (whole_model, models[1]), optimizer_pair),
        ):
            report.rows.append(training_row(setup, f"{label}: {metric}", pair, pair_optimizers, batch, flops, tokens))
        report.notes.append(f"{label}, archlab `torch.compile` whole: cold compile + first step {seconds:.0f} s.")
        graphed, seconds = compiled_for_training(setup, models[0], batch, ours, whole=True, mode="reduce-overhead")
        metric = f"archlab compiled whole with CUDA graphs (mode reduce-overhead) vs {peer} eager"
        report.rows.append(
            training_row(setup, f"{label}: {metric}", (graphed, models[1]), optimizer_pair, batch, flops, tokens)
        )
        report.notes.append(
            f"{label}, archlab compiled whole with CUDA graphs: cold compile + first step {seconds:.0f} s."
        )
    return wrappers[0]


def moe_rows(setup: Setup, report: Report, compiled: bool = False) -> None:
    """Eager: archlab against Mixtral (its default experts and eager) and the dense Llama of the same active FLOPs;
    `compiled`: archlab against Mixtral, both compiled regionally and Mixtral eager (`compiled_rows`)."""
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    base = shape("moe", setup.quick)
    moe = dict(base, output_router_logits=True, router_aux_loss_coef=0.01)
    ours, mixtral = decoder_pair(MixtralForCausalLM, MixtralConfig, moe, setup.device)
    dense_shape = dense_equivalent(base)
    llama = decoder_pair(LlamaForCausalLM, LlamaConfig, dense_shape, setup.device)[1]
    for model in (ours, mixtral, llama):
        model.train()
    batch, (b, s) = decoder_batch(setup, mixtral.config.vocab_size), batch_shape(setup)
    optimizers = {id(m): make_optimizer(m, setup.optim) for m in (ours, mixtral, llama)}
    flops = decoder_flops(setup, mixtral.config)
    default = mixtral.config._experts_implementation
    label = "MoE (Mixtral shape)"
    dense_metric = f"dense LlamaForCausalLM of the same active FLOPs (FFN {dense_shape['intermediate_size']})"
    if compiled:  # the goal against the dense model on the scripts' default path: both compiled regionally
        pair = (ours, mixtral)
        ours_compiled = compiled_rows(setup, report, label, pair, optimizers, batch, flops, b * s, "Mixtral", True)
        llama_compiled, _ = compiled_for_training(setup, llama, batch, optimizers[id(llama)])
        report.rows.append(
            training_row(
                setup,
                f"{label}: archlab MoE compiled vs {dense_metric.replace('CausalLM', 'CausalLM compiled', 1)}",
                (ours_compiled, llama_compiled),
                (optimizers[id(ours)], optimizers[id(llama)]),
                batch,
                (flops, decoder_flops(setup, llama.config)),
                b * s,
            )
        )
        return
    for implementation in dict.fromkeys([default, "eager"]):
        mixtral.set_experts_implementation(implementation)
        report.rows.append(
            training_row(
                setup,
                f"{label}: archlab vs MixtralForCausalLM (experts: {implementation})",
                (ours, mixtral),
                (optimizers[id(ours)], optimizers[id(mixtral)]),
                batch,
                flops,
                b * s,
            )
        )
    mixtral.set_experts_implementation(default)
    report.rows.append(
        training_row(
            setup,
            f"{label}: archlab MoE vs {dense_metric}",
            (ours, llama),
            (optimizers[id(ours)], optimizers[id(llama)]),
            batch,
            (flops, decoder_flops(setup, llama.config)),
            b * s,
        )
    )


def seq2seq_rows(setup: Setup, report: Report, compiled: bool = False) -> None:
    """archlab against Marian, eager; `compiled`: both compiled regionally, and Marian eager (`compiled_rows`)."""
    batch_size, length = (2, 32) if setup.quick else (32, 256)
    ours, marian = marian_pair(shape("marian", setup.quick), length + 2, setup.device)
    ours.train(), marian.train()
    vocab = marian.config.vocab_size
    source = random_ids(vocab, batch_size, length, device=setup.device, low=1, seed=1)
    labels = random_ids(vocab, batch_size, length, device=setup.device, low=1, seed=2)
    batch = {"input_ids": source, "attention_mask": torch.ones_like(source), "labels": labels}
    flops = seq2seq_training_flops(marian.config, batch_size, length, length)
    optimizers = (make_optimizer(ours, setup.optim), make_optimizer(marian, setup.optim))
    # MemTracker (CPU) hooks every parameter's gradient; Marian's sinusoid tables are frozen parameters.
    if not setup.cuda:
        for parameter in marian.parameters():
            parameter.requires_grad_(True)  # no gradient reaches them (computed under no_grad): none is stored
    label = f"encoder-decoder (Marian shape, {batch_size} × ({length} + {length}))"
    if compiled:
        by_model = {id(ours): optimizers[0], id(marian): optimizers[1]}
        tokens = 2 * batch_size * length
        compiled_rows(setup, report, label, (ours, marian), by_model, batch, flops, tokens, "Marian", whole=True)
        return
    report.rows.append(
        training_row(
            setup,
            f"{label}: archlab vs MarianMTModel",
            (ours, marian),
            optimizers,
            batch,
            flops,
            2 * batch_size * length,
        )
    )


# ----------------------------------------------------------------------------------------------------------------
# liger-kernel, in a child process (it patches transformers' Llama classes for the whole process)
# ----------------------------------------------------------------------------------------------------------------
LIGER_TIMEOUT_S = (
    300  # two workloads of about a minute each on a GPU (a compile each); a hung child must not cost the table
)


def liger_child(args: argparse.Namespace, output: Path) -> None:
    """In a fresh process: patch Llama with liger, then time archlab against it for each workload; write the rows."""
    from importlib.metadata import PackageNotFoundError, version

    from liger_kernel.transformers import apply_liger_kernel_to_llama

    from archlab.liger import apply_liger_kernel_to_archlab

    apply_liger_kernel_to_llama()
    try:
        liger = f"liger-kernel {version('liger-kernel')}"
    except PackageNotFoundError:
        liger = "liger-kernel (version unknown)"
    setup = setup_from(args)
    report, rows = Report(title="liger", peer_name="peer"), {}
    for name, label in DENSE_WORKLOADS:

        def measure(name=name, label=label) -> None:
            ours, llama = llama_pair(shape(name, setup.quick), setup.device)
            ours.train(), llama.train()
            batch, (b, s) = decoder_batch(setup, llama.config.vocab_size), batch_shape(setup)
            optimizers = (make_optimizer(ours, setup.optim), make_optimizer(llama, setup.optim))
            metric = f"{label}: archlab vs LlamaForCausalLM + {liger}"
            flops = decoder_flops(setup, llama.config)
            rows[name] = asdict(training_row(setup, metric, (ours, llama), optimizers, batch, flops, b * s))
            # the goal's comparison: archlab's default training path on a GPU (regionally compiled, as the scripts'
            # `--torch_compile` runs it) against the fastest Llama a user gets without compiling
            compiled, _ = compiled_for_training(setup, ours, batch, optimizers[0])
            metric = f"{label}: archlab compiled (the scripts' default) vs LlamaForCausalLM + {liger}"
            rows[f"{name} compiled"] = asdict(
                training_row(setup, metric, (compiled, llama), optimizers, batch, flops, b * s)
            )
            try:  # what Trainer's use_liger_kernel does to an archlab model
                apply_liger_kernel_to_archlab(ours)
            except ImportError as error:  # a liger-kernel without the modules archlab's patch uses
                report.notes.append(
                    f"archlab + use_liger_kernel: not measured, Liger's modules did not import ({error})."
                )
                return
            metric = f"{label}: archlab + use_liger_kernel vs LlamaForCausalLM + {liger}"
            optimizers = (make_optimizer(ours, setup.optim), make_optimizer(llama, setup.optim))
            rows[f"{name} archlab-liger"] = asdict(
                training_row(setup, metric, (ours, llama), optimizers, batch, flops, b * s)
            )

        guarded(report, setup, f"{label} vs Llama + liger", measure)
    output.write_text(json.dumps({"rows": rows, "notes": report.notes}))


def liger_rows(args: argparse.Namespace) -> tuple[dict[str, Row], list[str]]:
    """Rows by workload name from the child process, and notes (why there are none, if so)."""
    if importlib.util.find_spec("liger_kernel") is None:
        return {}, ["Llama + liger-kernel: skipped, liger-kernel is not installed."]
    with tempfile.TemporaryDirectory() as folder:
        output = Path(folder) / "liger.json"
        command = [sys.executable, "-m", "archlab.scripts.benchmark_cuda_train", "--liger-child", str(output)]
        command += forwarded_flags(args)
        log("Llama + liger-kernel: child process")
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=LIGER_TIMEOUT_S)
        except subprocess.TimeoutExpired as expired:
            sys.stderr.write(expired.stderr.decode(errors="replace") if expired.stderr else "")
            return {}, [f"Llama + liger-kernel: the child process took more than {LIGER_TIMEOUT_S} s and was stopped."]
        sys.stderr.write(done.stderr)
        if done.returncode != 0 or not output.exists():
            tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1][:300]
            return {}, [f"Llama + liger-kernel: the child process failed (exit {done.returncode}): {tail}"]
        result = json.loads(output.read_text())
    return {name: Row(**fields) for name, fields in result["rows"].items()}, result["notes"]


def forwarded_flags(args: argparse.Namespace) -> list[str]:
    flags = ["--rounds", str(args.rounds), "--optim", args.optim, "--device", str(setup_device(args))]
    for name in ("peak_tflops", "peak_bandwidth", "threads"):
        if getattr(args, name) is not None:
            flags += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    return flags + (["--quick"] if args.quick else [])


def setup_device(args: argparse.Namespace) -> str:
    return args.device or ("cuda" if torch.cuda.is_available() else "cpu")


# ----------------------------------------------------------------------------------------------------------------
# The suite
# ----------------------------------------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> Report:
    liger, liger_notes = liger_rows(args)  # first, while this process holds nothing on the GPU
    setup = setup_from(args)
    b, s = batch_shape(setup)
    report = Report(
        title=f"CUDA suite, training — {setup.peaks.name} — bf16 autocast over fp32 weights, {setup.optim} "
        f"(what `Trainer(bf16=True)` runs), batch {b} × {s} (encoder-decoder: see its row)"
        + (" — --quick shapes" if setup.quick else ""),
        peer_name="peer",
    )

    for name, label in DENSE_WORKLOADS:
        compiled = name == "dense"
        guarded(report, setup, label, lambda n=name, t=label, c=compiled: dense_rows(setup, report, n, t, c))
        for key in (name, f"{name} compiled", f"{name} archlab-liger"):
            if key in liger:
                report.rows.append(liger[key])
    guarded(report, setup, "MoE", lambda: moe_rows(setup, report))
    guarded(report, setup, "encoder-decoder", lambda: seq2seq_rows(setup, report))
    report.notes += liger_notes
    report.notes.append(
        f"MFU: model FLOPs (6 per weight per token + attention, PaLM's accounting) / time / peak; peak memory: "
        f"the step's own tensors (weights, gradients, optimiser state, activations). {setup.rounds} rounds, "
        f"median of per-round ratios."
    )
    report.notes.append(describe(setup))
    return with_goals(report, TRAIN_GOALS)


def loss_chunk_rows(setup: Setup, report: Report) -> None:
    """Dense 1.1B compiled regionally, archlab against itself: its LM-head loss over chunks of 4 × the default's
    tokens and unchunked (`lm_loss_chunk_size=0`: the whole (tokens × vocab) logits at once), each against the default
    chunks (1024 tokens). The chunked loss is the memory win of the dense rows (25.6 against Llama compiled's 27.9 GiB
    on an H100) and ~4 % of their speed (62.7k tok/s when a bug had it off, 60.4k on): what each size costs in both."""
    from archlab import DecoderConfig, DecoderForCausalLM
    from archlab.scripts.benchmark_cuda import DECODER_COMMON, build_on

    config = DecoderConfig(**DECODER_COMMON, **shape("dense", setup.quick))
    default = build_on(setup.device, lambda: DecoderForCausalLM(config)).train()
    batch = decoder_batch(setup, config.vocab_size)
    flops, tokens = decoder_flops(setup, config), batch_shape(setup)[0] * batch_shape(setup)[1]
    default_optimizer = make_optimizer(default, setup.optim)
    default_compiled, _ = compiled_for_training(setup, default, batch, default_optimizer)
    for chunk in (4 * config.lm_loss_chunk_size, 0):

        def measure(chunk=chunk) -> None:
            variant_config = DecoderConfig(**DECODER_COMMON, **shape("dense", setup.quick), lm_loss_chunk_size=chunk)
            variant = build_on(setup.device, lambda: DecoderForCausalLM(variant_config)).train()
            variant.load_state_dict(default.state_dict())
            optimizer = make_optimizer(variant, setup.optim)
            compiled, _ = compiled_for_training(setup, variant, batch, optimizer)
            what = f"chunks of {chunk} tokens" if chunk else "unchunked (lm_loss_chunk_size=0)"
            metric = (
                f"dense 1.1B compiled: archlab's LM-head loss {what} vs the default chunks "
                f"({config.lm_loss_chunk_size} tokens)"
            )
            pair, optimizers = (compiled, default_compiled), (optimizer, default_optimizer)
            report.rows.append(training_row(setup, metric, pair, optimizers, batch, flops, tokens))

        guarded(report, setup, f"loss chunks of {chunk}", measure)


def run_compiled(args: argparse.Namespace) -> Report:
    """`--suite cuda-train-compiled`: the workloads beside the dense one on the scripts' default GPU path (regional
    compilation, `--torch_compile`): archlab compiled against each peer compiled the same way and eager. (The dense
    model's compiled rows are in cuda-train; a suite of its own keeps each under a GPU call's time.)"""
    setup = setup_from(args)
    b, s = batch_shape(setup)
    report = Report(
        title=f"CUDA suite, training compiled regionally (the scripts' default on a GPU) — {setup.peaks.name} — bf16 "
        f"autocast over fp32 weights, {setup.optim}, batch {b} × {s} (encoder-decoder: see its row)"
        + (" — --quick shapes" if setup.quick else ""),
        peer_name="peer",
    )
    guarded(report, setup, "vocab 128256", lambda: dense_rows(setup, report, "big_vocab", "vocab 128256", True, False))
    guarded(report, setup, "MoE", lambda: moe_rows(setup, report, compiled=True))
    guarded(report, setup, "encoder-decoder", lambda: seq2seq_rows(setup, report, compiled=True))
    guarded(report, setup, "loss chunks", lambda: loss_chunk_rows(setup, report))  # last: no goal rides on it
    report.notes.append(describe(setup))
    return with_goals(report, TRAIN_GOALS)


def main(argv: list[str] | None = None) -> int:
    from archlab.scripts import benchmark

    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--liger-child":
        parser = benchmark.build_parser()
        args = parser.parse_args(argv[2:])
        benchmark.resolve_defaults(args)
        liger_child(args, Path(argv[1]))
        return 0
    return benchmark.main(["--suite", "cuda-train", *argv])


if __name__ == "__main__":
    sys.exit(main())
