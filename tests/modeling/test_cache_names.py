"""cache_names.py: the models take the KV cache as `cache` (transformers 5.24's name) or `past_key_values` (before),
return it under the installed release's name, and decode the same either way; of two caches, the one holding
tokens.
CI installs the newest transformers; the suite also runs on 5.23 (the GPU kit's pin before 5.24)."""

from __future__ import annotations

import warnings

import torch
from transformers import DynamicCache

from archlab import DecoderForCausalLM, Seq2SeqForConditionalGeneration
from archlab.modeling.cache_names import CACHE_NAME, cache_argument, cache_in, output_cache

from helpers import tiny_decoder_config, tiny_seq2seq_config


def _forward_both_ways(model, **inputs):
    """Prefill, then one step through the cache given by each name: the logits of both steps and their caches."""
    results = []
    for name in ("cache", "past_key_values"):
        first = model(**inputs, use_cache=True)
        cache = output_cache(first)
        assert cache is not None and getattr(first, CACHE_NAME) is cache
        step = {"input_ids": torch.tensor([[7], [9]])} if "input_ids" in inputs else {}
        if "decoder_input_ids" in inputs:
            step = {**inputs, "decoder_input_ids": torch.tensor([[7], [9]])}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # the old name warns from 5.24 on
            second = model(**step, **{name: cache}, use_cache=True)
        assert output_cache(second) is cache
        results.append(second.logits)
    return results


def test_the_decoder_takes_its_cache_under_either_name():
    model = DecoderForCausalLM(tiny_decoder_config()).eval()
    with torch.no_grad():
        by_new_name, by_old_name = _forward_both_ways(model, input_ids=torch.randint(3, 97, (2, 5)))
    torch.testing.assert_close(by_new_name, by_old_name, rtol=0, atol=0)


def test_the_encoder_decoder_takes_its_cache_under_either_name():
    model = Seq2SeqForConditionalGeneration(tiny_seq2seq_config()).eval()
    source = torch.randint(3, 61, (2, 6))
    with torch.no_grad():
        by_new_name, by_old_name = _forward_both_ways(
            model, input_ids=source, decoder_input_ids=torch.randint(3, 61, (2, 4))
        )
    torch.testing.assert_close(by_new_name, by_old_name, rtol=0, atol=0)


def _filled(length: int) -> DynamicCache:
    cache = DynamicCache()
    if length:
        cache.update(torch.zeros(1, 2, length, 4), torch.zeros(1, 2, length, 4), 0)
    return cache


def test_of_two_caches_the_one_holding_tokens_is_used_and_the_old_name_warns_only_where_deprecated():
    """Both names at once (PEFT's prefix tuning beside generate): an empty `cache` yields to a filled
    `past_key_values`; otherwise `cache` is used, with a warning naming the one left out."""
    prefix, empty, filled = _filled(4), _filled(0), _filled(6)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cache_argument(prefix, empty) is prefix  # the prefill: generate's cache is still empty
        assert not caught
        assert cache_argument(prefix, filled) is filled  # the steps after: generate's cache holds the prefix
        assert cache_argument(_filled(0), empty) is empty
        assert sum("`cache` is used and `past_key_values` left out" in str(w.message) for w in caught) == 2
    one, other = DynamicCache(), DynamicCache()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cache_argument(one, one) is one and cache_argument(None, other) is other
        assert cache_argument(one, None) is one
    deprecations = [w for w in caught if "`past_key_values` is deprecated" in str(w.message)]
    assert len(deprecations) == (2 if CACHE_NAME == "cache" else 0)


def test_generate_keyword_arguments_are_read_under_either_name():
    cache = DynamicCache()
    assert cache_in({"cache": cache}) is cache and cache_in({"past_key_values": cache}) is cache
    assert cache_in({"attention_mask": None}) is None
