"""A kept static cache reset with one foreach kernel per dtype (modeling/cache_reset.py): the state `reset` leaves,
without a kernel per tensor."""

from __future__ import annotations

import copy

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import EncoderDecoderCache, StaticCache

from archlab.modeling.cache_reset import reset_at_once

from helpers import tiny_decoder_config


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket.__name__))
        return func(*args, **(kwargs or {}))


def _filled(cache, layers: int):
    g = torch.Generator().manual_seed(0)
    for layer in range(layers):
        keys = torch.randn(2, 2, 5, 8, generator=g)
        cache.update(keys, keys + 1, layer)
    return cache


def _state(cache) -> list:
    """Every tensor and host counter a reset touches, layer by layer."""
    caches = (cache.self_attention_cache, cache.cross_attention_cache) if hasattr(cache, "is_updated") else (cache,)
    state = [dict(cache.is_updated)] if hasattr(cache, "is_updated") else []
    for part in caches:
        for layer in part.layers:
            state.append(
                (
                    layer.is_initialized,
                    None if layer.keys is None else layer.keys.clone(),
                    None if layer.values is None else layer.values.clone(),
                    getattr(layer, "cumulative_length", None),
                    getattr(layer, "cumulative_length_int", None),
                )
            )
    return state


def _assert_same_state(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        if isinstance(x, dict):
            assert x == y
            continue
        for u, v in zip(x, y):
            if isinstance(u, torch.Tensor):
                assert torch.equal(u, v)
            else:
                assert u == v


def _caches():
    sliding = tiny_decoder_config(
        num_hidden_layers=3, layer_types=["sliding_attention", "full_attention", "sliding_attention"], sliding_window=4
    )
    yield _filled(StaticCache(config=tiny_decoder_config(num_hidden_layers=3), max_cache_len=12), 3)
    yield _filled(StaticCache(config=sliding, max_cache_len=12), 3)
    config = tiny_decoder_config(num_hidden_layers=2)
    cache = EncoderDecoderCache(
        StaticCache(config=config, max_cache_len=12), StaticCache(config=config, max_cache_len=7)
    )
    _filled(cache.self_attention_cache, 2)
    _filled(cache.cross_attention_cache, 2)
    cache.is_updated.update({0: True, 1: True})
    yield cache


def test_the_same_state_as_reset_with_one_foreach_call_per_dtype():
    for cache in _caches():
        expected = copy.deepcopy(cache)
        expected.reset()
        recorder = _Ops()
        with recorder:
            reset_at_once(cache)
        _assert_same_state(_state(cache), _state(expected))
        assert "zero_" not in recorder.ops
        assert recorder.ops.count("_foreach_zero_") == 2, recorder.ops  # the float keys and values, the int counters
        assert all(op == "_foreach_zero_" for op in recorder.ops), recorder.ops
