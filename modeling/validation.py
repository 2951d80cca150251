"""Small helpers that make config validation errors name the field and what is allowed.

Shared by every archlab config class. Imports nothing but torch/transformers (remote-code constraint).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from transformers.activations import ACT2FN

# Activation names accepted by `hidden_act` / `activation_function`: whatever transformers' ACT2FN knows.
ACTIVATIONS: tuple[str, ...] = tuple(sorted(ACT2FN.keys()))


def check_positive(config: Any, name: str, integer: bool = True) -> None:
    value = getattr(config, name)
    kind = "a positive integer" if integer else "a positive number"
    if isinstance(value, bool) or (integer and not isinstance(value, int)) or value <= 0:
        raise ValueError(f"`{name}` must be {kind}, got {value!r}.")


def check_non_negative(config: Any, name: str) -> None:
    value = getattr(config, name)
    if isinstance(value, bool) or value < 0:
        raise ValueError(f"`{name}` must be >= 0, got {value!r}.")


def check_probability(config: Any, name: str) -> None:
    value = getattr(config, name)
    if not 0.0 <= value < 1.0:
        raise ValueError(f"`{name}` must be a probability in [0, 1), got {value!r}.")


def check_choice(config: Any, name: str, allowed: Iterable[str]) -> None:
    value = getattr(config, name)
    allowed = tuple(allowed)
    if value not in allowed:
        raise ValueError(f"`{name}`={value!r} is not supported; allowed values: {', '.join(map(repr, allowed))}.")


def lookup(registry: dict[str, Any], key: str, field: str) -> Any:
    """`registry[key]`, or a ValueError naming the config field and the valid keys."""
    try:
        return registry[key]
    except KeyError:
        raise ValueError(
            f"`{field}`={key!r} is not supported; allowed values: {', '.join(map(repr, registry))}."
        ) from None
