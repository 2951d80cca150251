"""The ablation study: tiny decoder variants trained with the same budget on the same batches, measured for the
seeds' claims (final and extrapolation loss, training speed and peak memory, KV-cache size, decoding speed).

Each variant is the LLaMA-recipe baseline with one or two config fields changed (`VARIANTS`); all of them see the same
batches in the same order (one seeded sampler over a byte-level token stream), the same optimiser and the same
schedule, unless the variant is about the schedule (the "no warm-up" rows). Tokens are UTF-8 bytes (vocabulary 256):
no tokenizer training, and the same text gives the same tokens everywhere. `scripts/ablate.py` runs it.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from archlab import DecoderConfig, DecoderForCausalLM
from archlab.modeling.cache_names import output_cache

from .ablation_report import markdown_table, paired_speed
from .ablation_variants import VARIANTS, VOCAB, AblationSettings, Variant, base_config
from .benchmarking import peak_training_memory
from .plots import plot_ablation_curves


# ----------------------------------------------------------------------------------------------------------------
# Data: a byte stream, fixed random windows
# ----------------------------------------------------------------------------------------------------------------
def load_texts(args: AblationSettings, split: str) -> list[str]:
    if args.dataset_name is None:
        from archlab.tokenization.corpus import stdlib_documents

        return [doc["text"] for doc in stdlib_documents(split=split)]
    import datasets

    try:
        dataset = datasets.load_dataset(args.dataset_name)
    except (FileNotFoundError, ValueError, ConnectionError) as error:  # (datasets' traceback, before: a wrong path)
        raise ValueError(
            f"--dataset_name {args.dataset_name!r} could not be loaded ({type(error).__name__}: {error}); give a "
            "`datasets.load_dataset` path (a Hub dataset, or a local dataset folder), or leave it out for the stdlib "
            "corpus."
        ) from None
    names = list(dataset)
    columns = dataset[names[0]].column_names
    if args.text_column not in columns:  # (a KeyError from the first row, before)
        raise ValueError(
            f"--text_column {args.text_column!r} is not a column of --dataset_name {args.dataset_name!r}; its "
            f"columns: {', '.join(columns)}."
        )
    if split == "validation" and "validation" not in dataset:
        return [row[args.text_column] for row in dataset[names[0]].select(range(min(200, len(dataset[names[0]]))))]
    return [row[args.text_column] for row in dataset["train" if split == "train" else split]]


def byte_stream(texts: list[str], limit: int) -> torch.Tensor:
    data = bytearray()
    for text in texts:
        data += text.encode("utf-8") + b"\n"
        if len(data) >= limit:
            break
    if len(data) < 4096:
        raise ValueError(f"The corpus has only {len(data)} bytes; `--dataset_name` needs more text.")
    return torch.tensor(list(data[:limit]), dtype=torch.long)


def windows(stream: torch.Tensor, count: int, length: int, generator: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, stream.numel() - length - 1, (count,), generator=generator)
    return torch.stack([stream[s : s + length] for s in starts.tolist()])


# ----------------------------------------------------------------------------------------------------------------
# One variant
# ----------------------------------------------------------------------------------------------------------------
def learning_rate(step: int, args: AblationSettings, warmup: bool) -> float:
    warm = args.warmup_steps if warmup else 0
    if step < warm:
        return args.lr * (step + 1) / warm
    progress = (step - warm) / max(1, args.steps - warm)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))  # cosine to 10 %


@torch.no_grad()
def evaluate(model: DecoderForCausalLM, batches: torch.Tensor, from_position: int = 0) -> float:
    """Mean next-token loss over target positions >= from_position."""
    model.eval()
    logits = model(batches[:, :-1]).logits[:, from_position:]
    targets = batches[:, 1 + from_position :]
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB).float(), targets.reshape(-1))
    model.train()
    return loss.item()


@torch.no_grad()
def kv_cache_bytes_per_token(model: DecoderForCausalLM, prompt: torch.Tensor) -> float:
    model.eval()
    cache = output_cache(model(prompt, use_cache=True))
    total = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    return total / prompt.numel()


@torch.no_grad()
def decode_tokens_per_second(model: DecoderForCausalLM, prompt: torch.Tensor, new_tokens: int) -> float:
    model.eval()
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    model.generate(prompt, **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4})  # warm-up
    start = time.perf_counter()
    model.generate(prompt, **kwargs)
    return prompt.shape[0] * new_tokens / (time.perf_counter() - start)


def run_variant(
    name: str, variant: Variant, args: AblationSettings, train: torch.Tensor, val: torch.Tensor, val_long: torch.Tensor
) -> dict[str, Any]:
    torch.manual_seed(args.seed)  # same initial weights wherever shapes agree
    config = DecoderConfig(**{**base_config(args), **variant.config}, attn_implementation="sdpa")
    model = DecoderForCausalLM(config).train()
    params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    generator = torch.Generator().manual_seed(args.seed)  # same batches, same order, for every variant
    curve, step_times = [], []
    diverged = False
    for step in range(args.steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, args, variant.warmup)
        batch = windows(train, args.batch_size, args.seq_len + 1, generator)
        start = time.perf_counter()
        loss = model(batch[:, :-1], labels=batch[:, :-1]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step_times.append(time.perf_counter() - start)
        curve.append(loss.item())
        if not math.isfinite(curve[-1]):
            diverged = True
            break
    # labels are the inputs: the model shifts them itself, so batch[:, :-1] predicts its own next bytes
    step_time = statistics.median(step_times[min(5, len(step_times) - 1) :])
    batch = windows(train, args.batch_size, args.seq_len + 1, torch.Generator().manual_seed(1))
    peak = peak_training_memory(model, lambda: _train_step(model, batch, optimizer), optimizer)
    prompt = val[:4, :32]
    return dict(
        name=name,
        claim=variant.claim,
        config=variant.config,
        warmup=variant.warmup,
        parameters=params,
        diverged=diverged,
        loss_curve=curve,
        val_loss=evaluate(model, val) if not diverged else float("nan"),
        val_loss_2x_tail=evaluate(model, val_long, from_position=args.seq_len) if not diverged else float("nan"),
        tokens_per_second=args.batch_size * args.seq_len / step_time,
        peak_memory_mb=peak / 2**20,
        kv_bytes_per_token=kv_cache_bytes_per_token(model, prompt),
        decode_tokens_per_second=decode_tokens_per_second(model, prompt, args.decode_tokens),
    )


def _train_step(model: DecoderForCausalLM, batch: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
    model(batch[:, :-1], labels=batch[:, :-1]).loss.backward()
    optimizer.zero_grad(set_to_none=True)  # measure the step's tensors without changing the trained weights


# ----------------------------------------------------------------------------------------------------------------
# The study
# ----------------------------------------------------------------------------------------------------------------
def run_ablation(args: AblationSettings, output_dir: str | Path) -> list[dict[str, Any]]:
    """Train and measure every variant of `args.variant_names`, writing `results.json` (after each variant),
    `ablations.md` (the table) and `loss_curves.png` to `output_dir`, and with `args.paired_speed` also `paired.md`
    (`ablation_report.paired_speed`). Returns one result per variant."""
    out = Path(output_dir)
    train = byte_stream(load_texts(args, "train"), args.corpus_bytes)
    val_stream = byte_stream(load_texts(args, "validation"), args.corpus_bytes // 10)
    out.mkdir(parents=True, exist_ok=True)  # after the data loads: a run that cannot start leaves no folder
    val = windows(val_stream, 32, args.seq_len + 1, torch.Generator().manual_seed(123))
    val_long = windows(val_stream, 16, 2 * args.seq_len + 1, torch.Generator().manual_seed(456))
    results = []
    for name in args.variant_names:
        start = time.perf_counter()
        results.append(run_variant(name, VARIANTS[name], args, train, val, val_long))
        r = results[-1]
        print(
            f"{name:22s} val {r['val_loss']:.3f}  2x-tail {r['val_loss_2x_tail']:.3f}  "
            f"{r['tokens_per_second']:,.0f} tok/s  ({time.perf_counter() - start:.0f}s)",
            flush=True,
        )
        (out / "results.json").write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    table = markdown_table(results, args)
    (out / "ablations.md").write_text(table + "\n")
    plot_ablation_curves(results, out / "loss_curves.png")
    print(table)
    if args.paired_speed:
        paired = "\n".join(paired_speed(args))
        (out / "paired.md").write_text(paired + "\n")
        print(paired)
    return results
