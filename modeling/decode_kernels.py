"""The switches that make archlab's Triton kernels the decoding step's default on NVIDIA GPUs, in one place: each
pre-norm layer's step of one row as four fused GEMVs (decode_block.py), the self-attention (triton_decoding.py), an
MoE's routed experts (triton_moe.py), all launched through the ops' PDL twins (triton_launch.py), and inductor's own
kernels launched dependent on the one before (step_compile.py). `without_decode_kernels` turns them all off while it
is entered: the default before them, which the CUDA suites and the profile measure the default against."""

from __future__ import annotations

import contextlib
from unittest import mock

from . import decode_block, step_compile, triton_decoding, triton_launch, triton_moe

# (module, name) of each device list that turns a kernel on
DEVICE_SWITCHES = (
    (decode_block, "FUSED_BLOCK_DEVICES"),
    (triton_decoding, "TRITON_DECODING_DEVICES"),
    (triton_moe, "MOE_DECODE_DEVICES"),
    (triton_launch, "PDL_DEVICES"),
)


def without_decode_kernels() -> contextlib.ExitStack:
    """While it is entered, every switch off (and inductor's dependent launches): PyTorch's decoding step."""
    stack = contextlib.ExitStack()
    for module, name in DEVICE_SWITCHES:
        stack.enter_context(mock.patch.object(module, name, ()))
    stack.enter_context(mock.patch.object(step_compile, "DEPENDENT_LAUNCH_OPTIONS", {}))
    return stack


__all__ = ["DEVICE_SWITCHES", "without_decode_kernels"]
