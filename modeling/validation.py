"""Small helpers that make config validation errors name the field and what is allowed.

Shared by every archlab config class. Imports nothing but torch/transformers (remote-code constraint).
"""

from __future__ import annotations

import functools
import sys
import typing
from collections.abc import Iterable
from typing import Any

from transformers.activations import ACT2FN

# Activation names accepted by `hidden_act` / `activation_function`: whatever transformers' ACT2FN knows.
ACTIVATIONS: tuple[str, ...] = tuple(sorted(ACT2FN.keys()))


# The scalar types a field may declare, how an error names each, and the values each accepts (an int where a float
# is declared: `1` for `1.0`).
_SCALARS: dict[Any, tuple[str, Any]] = {
    int: ("an int", lambda v: isinstance(v, int)),
    float: ("a float", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)),
    bool: ("a bool", lambda v: isinstance(v, bool)),
    list[int]: ("a list of int", lambda v: isinstance(v, list) and all(isinstance(x, int) for x in v)),
    type(None): ("None", lambda v: v is None),
}


@functools.cache
def _scalar_fields(config_class: type) -> tuple[tuple[str, str, tuple[Any, ...]], ...]:
    """(name, description, accepted checks) of each field `config_class` itself declares as numbers, bools or lists
    of int (str, dict and list-of-str fields are checked by their own choices)."""
    namespace = vars(sys.modules[config_class.__module__])
    fields = []
    for name, hint in config_class.__dict__.get("__annotations__", {}).items():
        if isinstance(hint, str):  # `from __future__ import annotations`
            try:
                hint = eval(hint, namespace)  # noqa: S307  (the class's own annotation, in its own module)
            except Exception:  # noqa: BLE001  (a name that only exists for type checkers)
                continue
        types = (typing.get_args(hint) if typing.get_origin(hint) is not list else ()) or (hint,)
        if all(t in _SCALARS for t in types):
            ordered = [t for t in _SCALARS if t in types]
            names = [_SCALARS[t][0] for t in ordered]
            description = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"
            fields.append((name, description, tuple(_SCALARS[t][1] for t in ordered)))
    return tuple(fields)


def check_field_types(config: Any) -> None:
    """Each number, bool and id field holds a value of its declared type: a JSON-quoted number ("128" in a
    hand-written config.json or --config_overrides) is a ValueError naming the field, not a TypeError from the
    first arithmetic that touches it."""
    for name, description, accepts in _scalar_fields(type(config)):
        value = getattr(config, name, None)
        if not any(accept(value) for accept in accepts):
            raise ValueError(f"`{name}` must be {description}, got {value!r} (a {type(value).__name__}).")


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
