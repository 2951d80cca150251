"""Checkpoints whose weights are stored quantized, refused before any tensor is converted.

Many published folders hold their linear weights quantized, with the method in config.json's `quantization_config`:
DeepSeek-V3/R1 and Kimi K2 in FP8 with a scale per 128 × 128 block (`weight_scale_inv`), FP8 with per-tensor or
per-channel scales (`weight_scale`, compressed-tensors), GPTQ's and AWQ's packed integers (`qweight`, `qzeros`,
`scales`, `g_idx`), compressed-tensors' packed INT4 (`weight_packed`), bitsandbytes' 4-bit and 8-bit states
(`absmax`, `quant_map`, `quant_state`, `SCB`). The converter reads floating-point weights: such a folder used to fail
only when the model's keys did not match, naming a scale tensor. It is refused here by its method, saying how to get
a floating-point copy. GPT-OSS's MXFP4 experts have their own refusal in its family (conversion/gpt_oss.py);
BitNet's packed ternary weights are read by its family before this check (`Family.dequantize`, conversion/bitnet.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .family import ConversionError, StateDict

# the names of the tensors quantization methods store beside (or instead of) a weight
QUANTIZATION_SUFFIXES = (
    ".weight_scale_inv",
    ".weight_scale",
    ".input_scale",
    ".qweight",
    ".qzeros",
    ".scales",
    ".g_idx",
    ".weight_packed",
    ".weight_shape",
    ".weight_zero_point",
    ".absmax",
    ".quant_map",
    ".SCB",
    ".weight_format",
)
FLOAT8_DTYPES = tuple(
    getattr(torch, name)
    for name in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu")
    if hasattr(torch, name)
)


def quantized_tensors(state_dict: StateDict) -> list[str]:
    """The tensors of `state_dict` that only a quantized checkpoint holds: float8 tensors, and the tensors quantization
    methods store beside a weight (their scales, zero points, packed integers, states)."""
    return sorted(
        key
        for key, tensor in state_dict.items()
        if tensor.dtype in FLOAT8_DTYPES or key.endswith(QUANTIZATION_SUFFIXES) or ".quant_state." in key
    )


def refuse_quantized_weights(src: Path, values: dict[str, Any], state_dict: StateDict) -> None:
    """Raise a `ConversionError` naming the method and a tensor where `state_dict` (read from `src`, whose config.json
    holds `values`) holds quantized weights."""
    found = quantized_tensors(state_dict)
    if not found:
        return
    settings = values.get("quantization_config")
    method = settings.get("quant_method") if isinstance(settings, dict) else None
    what = f"{method}-quantized weights" if method else "quantized weights"
    raise ConversionError(
        f"{src} holds {what} ({found[0]}: {state_dict[found[0]].dtype}, ...); the converter reads floating-point "
        "weights. Save a floating-point copy first: load the folder with transformers in bfloat16, dequantized (FP8 "
        "and MXFP4 take `dequantize=True` in their quantization config), `save_pretrained` it, and convert that "
        "folder; or start from the model's published bf16 weights."
    )


__all__ = ["QUANTIZATION_SUFFIXES", "quantized_tensors", "refuse_quantized_weights"]
