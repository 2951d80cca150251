"""The KV cache's name in transformers' interfaces: `past_key_values` up to transformers 5.23, `cache` from 5.24.

transformers 5.24 renamed the cache in `generate` (its `model_kwargs` and the inputs it passes to a model's
`forward`), in the models' forwards and masking functions, and in the output classes (`CausalLMOutputWithPast.cache`);
the old name still works there until 5.40, with a deprecation warning. archlab's public forwards take either name
(`cache_argument`), build their outputs under the installed release's name (`CACHE_NAME`) and read the cache from
`generate`'s keyword arguments and from outputs by that name, so one code base runs on both sides of the rename
without warnings. Internally (blocks, attention layers) the cache keeps the name `past_key_values`.
"""

from __future__ import annotations

import warnings
from dataclasses import fields

import torch
from transformers.cache_utils import Cache
from transformers.modeling_outputs import CausalLMOutputWithPast

# "cache" from transformers 5.24 on, "past_key_values" before
CACHE_NAME = "cache" if "cache" in {field.name for field in fields(CausalLMOutputWithPast)} else "past_key_values"
# both, for lists of keyword names that must hold the cache whichever release passes it
CACHE_NAMES = ("past_key_values", "cache")


def cache_argument(past_key_values: Cache | None, cache: Cache | None) -> Cache | None:
    """The cache a forward was given under either name. From transformers 5.24 on, `past_key_values` gets the
    FutureWarning the stock models give for it (their `deprecate_kwarg`).

    Two different caches at once come from a caller written for the old name beside `generate`, which passes its
    own under the new one: PEFT's prefix tuning hands its prefix cache as `past_key_values` next to generate's
    empty `cache` in the prefill, and a fresh prefix again beside the filled cache at every step. The one holding
    tokens is used — `cache` where both do, with a warning naming the one left out (the stock models keep the new
    name always, and so drop a prefix given beside an empty cache without a word)."""
    if past_key_values is None:
        return cache
    if cache is not None and past_key_values is not cache:
        if int(cache.get_seq_length()) > 0 or int(past_key_values.get_seq_length()) == 0:
            warnings.warn(
                "Both `cache` and `past_key_values` (its name before transformers 5.24) were given: `cache` is used "
                "and `past_key_values` left out.",
                UserWarning,
                stacklevel=3,
            )
            return cache
    elif CACHE_NAME == "cache" and not torch.compiler.is_compiling():
        warnings.warn(
            "`past_key_values` is deprecated and will be removed in version 5.40.0. Use `cache` instead.",
            FutureWarning,
            stacklevel=3,
        )
    return past_key_values


def with_cache(cache: Cache | None) -> dict[str, Cache | None]:
    """`{CACHE_NAME: cache}`: the keyword under which transformers' output classes and forwards take the cache."""
    return {CACHE_NAME: cache}


def cache_in(kwargs: dict) -> Cache | None:
    """The cache in `generate`'s model keyword arguments (or a forward's), under either name."""
    cache = kwargs.get(CACHE_NAME)
    return cache if cache is not None else kwargs.get(CACHE_NAMES[CACHE_NAME == "past_key_values"])


def output_cache(output) -> Cache | None:
    """The cache a model output carries (under the installed release's field name)."""
    return getattr(output, CACHE_NAME, None)


__all__ = ["CACHE_NAME", "CACHE_NAMES", "cache_argument", "cache_in", "output_cache", "with_cache"]
