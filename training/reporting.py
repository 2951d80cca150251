"""The lines the training scripts print: progress messages, one-line metric summaries, and how a run trains."""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch


def is_main_process() -> bool:
    """Whether this is the first process of a torchrun / accelerate launch run (or the only process)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank() == 0
    return int(os.environ.get("RANK", "0")) == 0


def log(message: str) -> None:
    """One `[archlab] ...` line, printed by the first process only: the processes of a data-parallel run each printed
    every line (as transformers' example scripts leave their replicas' logs at warning level)."""
    if is_main_process():
        print(f"[archlab] {message}", flush=True)


def summary(metrics: dict[str, float], keys: Sequence[str]) -> str:
    """'loss 1.234, accuracy 0.9' for the `eval_*` keys present in `metrics`, in the order of `keys`."""
    return ", ".join(f"{k[5:]} {metrics[k]:.4g}" for k in keys if k in metrics)


def training_setup(args, weights: torch.dtype = torch.float32) -> str:
    """How a run trains, as the scripts resolved `args` (`ArchlabTrainingArguments`) for this machine: the device,
    the processes, the precision (and the `weights`' dtype where it is not float32: `--dtype`) and whether the model
    is compiled — the defaults differ between a CPU and a GPU, and a user should see which took effect. Reads
    `args.device`, which sets up the processes as the Trainer would."""
    device = args.device
    if device.type == "cuda":
        where = f"{device} ({torch.cuda.get_device_name(device)})"
    else:
        where = "the CPU" if device.type == "cpu" else str(device)
    if args.world_size > 1:
        where += f", {args.world_size} processes"
    precision = "bf16 autocast" if args.bf16 else "fp16 autocast" if args.fp16 else "float32"
    if weights != torch.float32:
        name = str(weights).removeprefix("torch.")
        precision = f"{name} weights" + (f", {precision}" if args.bf16 or args.fp16 else "")
    if not args.torch_compile:
        how = "eager (no compilation)"
    else:
        regional = getattr(args, "regional_compilation", False)
        how = "compiled regionally (one block, reused by every layer)" if regional else "compiled"
        how += "; the first steps wait for the compiler"
    return f"Training on {where}: {precision}, {how}"
