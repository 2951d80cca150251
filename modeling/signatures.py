"""Signatures computed once per class: `generate` asks for them on every call.

transformers' `generate` calls `inspect.signature` on the model's `forward` six times a call (which inputs it
accepts: an attention mask, position ids, `logits_to_keep`, the model kwargs it validates), once on
`prepare_inputs_for_generation` and once on the decoding method. `inspect` walks the decorators' `__wrapped__`
chain and rebuilds every parameter each time: ~26 µs for a forward of archlab's size on the development CPU, ~0.18
ms of host time per `generate` call, all of it before the prefill is launched — where a long prompt's time to
first token on a GPU has ~1 ms of room beside its kernels (docs/gpu.md). A function's `__signature__` is what
`inspect` returns first, before any walk; `keep_signatures` stores the computed signature there, unchanged, so
every caller sees the same parameters, only sooner (a bound method still drops `self` as before).
"""

from __future__ import annotations

import inspect
import types

# The methods of a model class whose signatures `generate` reads every call.
GENERATE_INSPECTS = ("forward", "prepare_inputs_for_generation", "_sample", "_beam_search")


# This package's name (archlab.modeling, or the module folder of a model exported as remote code)
PACKAGE = __name__.rpartition(".")[0]


def keep_signature(function) -> None:
    """Store `function`'s signature on it (`__signature__`), unless it has one. This package's plain functions only:
    transformers' own methods, and a method patched in later by another library (accelerate's hooks, liger), are
    computed as before."""
    if (
        isinstance(function, types.FunctionType)
        and function.__module__.startswith(PACKAGE + ".")
        and "__signature__" not in function.__dict__
    ):
        function.__signature__ = inspect.signature(function)


def keep_signatures(cls: type, names: tuple[str, ...] = GENERATE_INSPECTS) -> None:
    """`keep_signature` for the methods `names` of `cls` (its own or inherited)."""
    for name in names:
        keep_signature(getattr(cls, name, None))


__all__ = ["GENERATE_INSPECTS", "keep_signature", "keep_signatures"]
