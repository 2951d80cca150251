"""The dtype a saved model's weights load in: the scripts' `--dtype` (`--torch_dtype`), passed to transformers'
`from_pretrained(dtype=...)` as run_clm.py passes it, what `auto` reads from a folder, and what each value means for
training (the Trainer updates the weights in the dtype they load in)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from .checkpoints import check_resumed_run_facts
from .reporting import log

DTYPES = ("auto", "bfloat16", "float16", "float32")
# safetensors' names of the floating-point dtypes a saved weight can have
SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def check_dtype(value: str | None) -> None:
    """`--dtype` is unset or one of `DTYPES`, else a ValueError naming the flag and the allowed values."""
    if value is not None and value not in DTYPES:
        raise ValueError(
            f"--dtype {value!r} is not supported; allowed values: {', '.join(DTYPES)} (--torch_dtype is the same flag)."
        )


def load_dtype(value: str | None, default: Any = None) -> Any:
    """What `from_pretrained(dtype=...)` takes for `--dtype`: "auto" as it is, a torch dtype for the others, and
    `default` when the flag is unset (None: transformers' own default, which is "auto")."""
    if value is None:
        return default
    return value if value == "auto" else getattr(torch, value)


def saved_dtype(folder: str | os.PathLike) -> torch.dtype | None:
    """The dtype `from_pretrained(folder, dtype="auto")` loads: config.json's `dtype` (`torch_dtype` before
    transformers 5), else the dtype of the folder's first floating-point weight; None when neither says."""
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    name = config.get("dtype") or config.get("torch_dtype")
    if isinstance(name, str) and isinstance(getattr(torch, name, None), torch.dtype):
        return getattr(torch, name)
    for path in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(path, framework="pt") as weights:
            for key in weights.keys():
                dtype = SAFETENSORS_DTYPES.get(weights.get_slice(key).get_dtype())
                if dtype is not None:
                    return dtype
    return None


def trained_dtype(value: str | None, model_name_or_path: str | None) -> str | None:
    """The dtype of the weights a training run updates, by name (a run fact: a resume in another one is refused):
    float32 unless `--dtype` says otherwise (a new model is built in float32), `auto` the saved folder's dtype; None
    where it is known only once the model is downloaded (`auto` with a Hub name)."""
    if value in (None, "float32") or not model_name_or_path:
        return "float32"
    if value != "auto":
        return value
    if not os.path.isfile(os.path.join(model_name_or_path, "config.json")):
        return None
    weights = saved_dtype(model_name_or_path)
    return str(weights).removeprefix("torch.") if weights is not None else None


def check_training_dtype(value: str | None, model_name_or_path: str | None, fp16: bool) -> None:
    """`--dtype` for a training script, before anything is read: the weights the Trainer updates are the ones
    loaded, with no float32 copy (`--bf16` / `--fp16` are autocast over them). Unset or float32: float32 weights.
    bfloat16 (or auto on a folder saved in bfloat16): pure bfloat16 training, which one line points out. Refused:
    float16 weights (`--fp16`'s gradient scaler refuses float16 gradients, "Attempting to unscale FP16 gradients",
    at the first step; without it nothing keeps small gradients from underflowing), bfloat16 weights under `--fp16`
    (fp16 autocast over bfloat16 weights), and `--dtype` without a saved model to load."""
    if value is None or value == "float32":
        return
    if not model_name_or_path:
        raise ValueError(
            f"--dtype {value}: it sets the dtype a saved --model_name_or_path loads in, and a new model is built in "
            "float32 (mixed precision: --bf16); leave --dtype out."
        )
    weights = load_dtype(value)
    source = f"--dtype {value}"
    if value == "auto":
        if not os.path.isfile(os.path.join(model_name_or_path, "config.json")):
            return  # (a Hub name: its dtype is known once downloaded, `check_loaded_dtype`)
        weights = saved_dtype(model_name_or_path)
        source = f"--dtype auto ({model_name_or_path!r} was saved in {str(weights).removeprefix('torch.')})"
    check_weights_dtype(weights, source, fp16)


def check_loaded_dtype(model: Any, value: str | None, model_name_or_path: str | None, fp16: bool) -> str | None:
    """`--dtype auto` with a Hub name: the dtype the weights load in is known once they are downloaded, so it is
    checked on the loaded model (before training) as `check_training_dtype` checks a local folder's. Returns that
    dtype's name (the run fact `trained_dtype` could not give), or None where the earlier check had it."""
    if value != "auto" or not model_name_or_path or os.path.isfile(os.path.join(model_name_or_path, "config.json")):
        return None
    weights = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    if weights is None:
        return None
    name = str(weights).removeprefix("torch.")
    check_weights_dtype(weights, f"--dtype auto ({model_name_or_path!r} loaded in {name})", fp16)
    return name


def confirm_loaded_dtype(model: Any, model_args: Any, training_args: Any, facts: dict, resume: str | None) -> None:
    """The scripts' step after loading: `check_loaded_dtype`, and the dtype it learnt as the run fact `weights_dtype`
    (a resume of a Hub model in another dtype is refused then, as a folder's is before anything is read)."""
    loaded = check_loaded_dtype(model, model_args.dtype, model_args.model_name_or_path, training_args.fp16)
    if loaded is not None:
        facts["weights_dtype"] = loaded
        check_resumed_run_facts(resume, facts)


def check_weights_dtype(weights: Any, source: str, fp16: bool) -> None:
    """The refusals and the warning of `check_training_dtype` for weights of dtype `weights` (`source`: the flag and
    where the dtype came from)."""
    if weights == torch.float16:
        raise ValueError(
            f"{source} would train float16 weights: --fp16's loss scaling refuses float16 gradients (it scales "
            "float32 ones) and without it small gradients underflow to zero. Leave --dtype out (float32 weights) and "
            "train with --fp16 on a GPU or --bf16, or pass --dtype bfloat16."
        )
    if weights == torch.bfloat16 and fp16:
        raise ValueError(
            f"Conflicting flags: --fp16 and {source}: --fp16 is mixed precision over float32 weights (leave --dtype "
            "out); bfloat16 weights take --bf16."
        )
    if weights == torch.bfloat16:
        log(
            f"Warning: {source} trains bfloat16 weights with no float32 copy (pure bfloat16): an update smaller "
            "than ~1/256 of a weight is lost. Leave --dtype out for float32 weights (--bf16: mixed precision)."
        )
