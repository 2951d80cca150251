"""The checks both config classes share, each raising a ValueError that names the field and what is allowed:
scalar types and ranges, choices from the catalogue's registries, T5's relative-bias bucketing, and which attention
backends can run a config's variants (at construction, and when a model switches backend later).

Config-side: imports no model code, only the catalogue's names (`catalogue.py`) and transformers.
"""

from __future__ import annotations

import functools
import math
import sys
import typing
from collections.abc import Iterable
from typing import Any

from transformers.activations import ACT2FN

from .catalogue import POSITION_SCHEMES

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
                hint = eval(hint, namespace)  # the class's own annotation, in its own module
            except Exception:  # a name that only exists for type checkers
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
    kind = "a positive integer" if integer else "a positive, finite number"
    # (NaN and infinity pass `value <= 0`; as a scale or an epsilon they make every output NaN)
    finite = isinstance(value, (int, float)) and math.isfinite(value)
    if isinstance(value, bool) or (integer and not isinstance(value, int)) or not finite or value <= 0:
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


def check_relative_buckets(num_buckets: int, max_distance: int, bidirectional: bool) -> None:
    """T5's bucketing needs log-spaced buckets beyond the exact ones: at least 2 buckets per direction, and a
    `max_distance` above the exactly-bucketed distances (half of a direction's buckets)."""
    per_direction = num_buckets // 2 if bidirectional else num_buckets
    exact = per_direction // 2
    if per_direction < 2:
        raise ValueError(
            f"`relative_attention_num_buckets` must be >= {4 if bidirectional else 2}"
            f"{' (bidirectional attention splits them between the two directions)' if bidirectional else ''}, "
            f"got {num_buckets}."
        )
    if max_distance <= exact:
        raise ValueError(
            f"`relative_attention_max_distance` ({max_distance}) must exceed the {exact} exactly-bucketed distances "
            f"of `relative_attention_num_buckets`={num_buckets}, or no bucket is log-spaced."
        )


def requested_attention(config: Any) -> str | None:
    """The `attn_implementation` a user asked for in the config, if any (None while transformers picks one)."""
    impl = getattr(config, "_attn_implementation_internal", None)
    return impl if isinstance(impl, str) else None


def check_attention_backend(config: Any, implementation: str) -> None:
    """Refuse an attention backend that cannot honour the config's variants: flash kernels take no bias and no
    arbitrary (prefix-LM) mask; transformers' flex path indexes a bias per batch row, which the batch-shared position
    biases do not have; SDPA has no hook to soft-cap scores. Both families run this from their config and from their
    models' backend dispatch checks."""
    position_type = getattr(config, "position_embedding_type", "none")
    if getattr(config, "prefix_lm", False) and implementation.startswith("flash"):
        raise ValueError(
            f"`prefix_lm=True` needs an arbitrary mask, which `attn_implementation`={implementation!r} cannot take; "
            "use 'sdpa', 'eager' or 'flex_attention'."
        )
    if POSITION_SCHEMES[position_type].bias and (implementation.startswith("flash") or "flex" in implementation):
        raise ValueError(
            f"`position_embedding_type`={position_type!r} adds a bias to the attention scores, which "
            f"`attn_implementation`={implementation!r} cannot take here; use 'sdpa' or 'eager'."
        )
    if getattr(config, "attention_sinks", False) and implementation.split("|")[-1] == "flash_attention_2":
        raise ValueError(
            "`attention_sinks=True` needs a kernel that takes the sinks' logits, which "
            f"`attn_implementation`={implementation!r} does not; use 'sdpa', 'eager', 'flex_attention' (GPU) or a "
            "flash kernel from the Hub that takes them (transformers' `s_aux`, e.g. vllm-flash-attn3)."
        )
    if getattr(config, "attn_logit_softcapping", None) is not None and "sdpa" in implementation:
        raise ValueError(
            "`attn_logit_softcapping` cannot be applied by `attn_implementation='sdpa'` (SDPA has no score hook); use "
            "'eager' or 'flex_attention' (the default falls back to 'eager' when soft-capping is set)."
        )
