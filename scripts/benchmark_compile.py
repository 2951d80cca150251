"""Regional compilation: archlab's decoder and `LlamaForCausalLM`, both compiled the way accelerate does it.

`accelerate.utils.compile_regions` (what `TorchDynamoPlugin(use_regional_compilation=True)` and Trainer's
`torch_compile` with regional compilation use) compiles the repeated decoder block once and reuses the code for
every layer, so the cold start is one block's compile, not the whole model's. This suite times a full training
step (optimiser: `--optim`, Trainer's default fused AdamW) of four models with identical weights and inputs, side by
side (warm-up, alternating order, median of per-round ratios; see `scripts/benchmark.py`):

- archlab compiled vs Llama compiled: the same tool applied to both;
- archlab compiled vs Llama eager: what a user gains over the Hugging Face default;
- archlab compiled vs archlab eager: what compilation gives archlab itself.

It also checks that the compiled step's loss equals the eager one and reports the cold-compile seconds.

    python scripts/benchmark.py --suite compile --threads 2
"""

from __future__ import annotations

import argparse
import time

import torch
from accelerate.utils import compile_regions
from transformers import LlamaConfig, LlamaForCausalLM

from archlab import DecoderConfig, DecoderForCausalLM
from archlab.scripts.benchmark import SUITE_POSITIONS, dense_shape
from archlab.training.benchmarking import Report, Row, compare_speed, make_optimizer, training_step


def build_models(quick: bool) -> dict[str, torch.nn.Module]:
    shape = dense_shape(quick)
    common = dict(
        **shape, max_position_embeddings=SUITE_POSITIONS["compile"], pad_token_id=0, bos_token_id=1, eos_token_id=2
    )
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(**common))
    models: dict[str, torch.nn.Module] = {"llama eager": llama}
    for name in ("archlab eager", "archlab compiled", "llama compiled"):
        model = (
            LlamaForCausalLM(LlamaConfig(**common))
            if name.startswith("llama")
            else DecoderForCausalLM(DecoderConfig(**common))
        )
        model.load_state_dict(llama.state_dict(), strict=True)
        models[name] = model
    for name in ("archlab compiled", "llama compiled"):
        models[name] = compile_regions(models[name], dynamic=False)
    for model in models.values():
        model.train()
    return models


def run(args: argparse.Namespace) -> Report:
    batch_size, seq_len = (2, 64) if args.quick else (args.batch_size, args.seq_len)
    models = build_models(args.quick)
    vocab = models["llama eager"].config.vocab_size
    ids = torch.randint(3, vocab, (batch_size, seq_len), generator=torch.Generator().manual_seed(0))
    # No KV cache in training: Llama builds a DynamicCache even in train mode unless told not to, and the cache
    # objects' state would trigger a recompile of the shared block code for every layer.
    batch = {"input_ids": ids, "labels": ids, "use_cache": False}
    tokens = batch_size * seq_len

    with torch.no_grad():
        reference = models["llama eager"](**batch).loss.item()
    cold, losses = {}, {}
    steps = {}
    for name, model in models.items():
        optimizer = make_optimizer(model, args.optim)
        steps[name] = training_step(model, batch, optimizer)
        if name.endswith("compiled"):
            start = time.perf_counter()
            losses[name] = model(**batch).loss.item()  # also compiles the forward graph
            steps[name]()  # compiles the backward graph
            cold[name] = time.perf_counter() - start

    report = Report(
        title=f"Regional compilation (accelerate `compile_regions`), training step, batch {batch_size}×{seq_len}, fp32",
        peer_name="peer",
    )
    pairs = [
        ("archlab compiled", "llama compiled", "same tool on both"),
        ("archlab compiled", "llama eager", "vs the Hugging Face default"),
        ("archlab compiled", "archlab eager", "what compiling gives archlab"),
    ]
    for ours, peer, what in pairs:
        t_a, t_p, ratio = compare_speed(steps[ours], steps[peer], args.rounds)
        report.rows.append(
            Row(f"training tokens/s: {ours} vs {peer} ({what})", tokens / t_a, tokens / t_p, ratio, "tok/s")
        )
    for name, loss in losses.items():
        report.notes.append(
            f"{name}: cold compile + first step {cold[name]:.0f} s; first loss {loss:.6f} "
            f"(eager Llama {reference:.6f}, |diff| {abs(loss - reference):.1e})."
        )
    report.notes.append(f"{args.rounds} rounds, torch {torch.__version__}, {torch.get_num_threads()} threads.")
    return report


def main(argv: list[str] | None = None) -> int:
    from archlab.scripts.benchmark import main as benchmark_main

    return benchmark_main(["--suite", "compile", *(argv or [])])


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
