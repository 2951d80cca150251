"""Masks per layer type (full, sliding window, interleaved) and prefix-LM, against explicit boolean references."""

import pytest
import torch

from archlab import DecoderForCausalLM
from archlab.modeling.attention_patterns import build_masks

from helpers import tiny_decoder_config


def _allowed(T, window=None, prefix=None):
    """Which keys each query may see, written out: causal, within the window, or inside the prefix."""
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    allowed = j <= i
    if window is not None:
        allowed &= j > i - window
    if prefix is not None:
        allowed |= j < prefix
    return allowed


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_masks_per_layer_type(attn):
    config = tiny_decoder_config(
        sliding_window=3, layer_types=["sliding_attention", "full_attention"], attn_implementation=attn
    )
    embeds = torch.zeros(2, 9, 32)
    masks = build_masks(
        config, ("sliding_attention", "full_attention"), embeds, torch.ones(2, 9, dtype=torch.long), None, None
    )
    for layer_type, window in (("sliding_attention", 3), ("full_attention", None)):
        mask = masks[layer_type]
        if mask is None:  # sdpa: a plain causal mask is left to `is_causal`
            assert window is None and attn == "sdpa"
            continue
        as_bool = mask if mask.dtype == torch.bool else mask == 0
        assert torch.equal(as_bool[0, 0], _allowed(9, window))


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_prefix_lm_mask(attn):
    config = tiny_decoder_config(prefix_lm=True, attn_implementation=attn)
    embeds = torch.zeros(2, 8, 32)
    prefix = torch.tensor([3, 5])
    mask = build_masks(config, ("full_attention",), embeds, None, None, None, prefix)["full_attention"]
    as_bool = mask if mask.dtype == torch.bool else mask == 0
    for b in range(2):
        assert torch.equal(as_bool[b, 0], _allowed(8, prefix=int(prefix[b])))


def test_prefix_lm_sees_the_whole_prefix_and_stays_causal_after_it():
    model = DecoderForCausalLM(tiny_decoder_config(prefix_lm=True)).eval()
    input_ids = torch.randint(3, 97, (1, 10))
    prefix = torch.tensor([6])
    changed_in_prefix = input_ids.clone()
    changed_in_prefix[0, 4] = (input_ids[0, 4] + 1) % 97
    changed_after = input_ids.clone()
    changed_after[0, 8] = (input_ids[0, 8] + 1) % 97
    with torch.no_grad():
        base = model(input_ids, prefix_lengths=prefix).logits
        a = model(changed_in_prefix, prefix_lengths=prefix).logits
        b = model(changed_after, prefix_lengths=prefix).logits
        causal = model(input_ids).logits
    assert (a[0, 1] - base[0, 1]).abs().max() > 1e-4  # position 1 sees prefix token 4
    torch.testing.assert_close(b[0, :8], base[0, :8])  # nobody before 8 sees token 8
    assert (causal[0, :6] - base[0, :6]).abs().max() > 1e-4  # differs from a plain causal LM inside the prefix


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_prefix_lm_cached_decoding_and_generate(attn):
    model = DecoderForCausalLM(tiny_decoder_config(prefix_lm=True, attn_implementation=attn)).eval()
    input_ids = torch.randint(3, 97, (2, 12))
    prefix = torch.tensor([5, 7])
    with torch.no_grad():
        full = model(input_ids, prefix_lengths=prefix).logits
        out = model(input_ids[:, :7], prefix_lengths=prefix, use_cache=True)
        steps = [out.logits]
        for t in range(7, 12):
            out = model(input_ids[:, t : t + 1], past_key_values=out.past_key_values, prefix_lengths=prefix)
            steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-4, rtol=0)
    prompt = input_ids[:, :7]
    kwargs = dict(max_new_tokens=6, do_sample=False, prefix_lengths=prefix, pad_token_id=0)
    assert torch.equal(model.generate(prompt, **kwargs), model.generate(prompt, use_cache=False, **kwargs))


def test_prefix_lm_refusals():
    model = DecoderForCausalLM(tiny_decoder_config(prefix_lm=True)).eval()
    input_ids = torch.randint(3, 97, (1, 8))
    out = model(input_ids[:, :3], use_cache=True)
    with pytest.raises(ValueError, match="whole prefix in the first forward"):
        model(input_ids[:, 3:], past_key_values=out.past_key_values, prefix_lengths=torch.tensor([6]))
    with pytest.raises(ValueError, match="precomputed masks"):  # a dict of ready masks has no prefix in it
        model(input_ids, attention_mask={"full_attention": None}, prefix_lengths=torch.tensor([4]))
    with pytest.raises(ValueError, match="prefix_lm"):
        DecoderForCausalLM(tiny_decoder_config())(input_ids, prefix_lengths=torch.tensor([4]))
    with pytest.raises(ValueError, match=r"shape \(batch,\)"):
        model(input_ids, prefix_lengths=torch.tensor([4, 4]))


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_prefix_lm_generate_with_a_static_cache_equals_the_dynamic_cache(attn):
    model = DecoderForCausalLM(tiny_decoder_config(prefix_lm=True, attn_implementation=attn)).eval()
    input_ids = torch.randint(3, 97, (2, 8))
    mask = torch.ones_like(input_ids)
    mask[1, :2] = 0  # left padding
    kwargs = dict(
        max_new_tokens=5,
        do_sample=False,
        pad_token_id=0,
        attention_mask=mask,
        output_logits=True,
        return_dict_in_generate=True,
    )
    prefix = torch.tensor([5, 7])
    dynamic = model.generate(input_ids, prefix_lengths=prefix, **kwargs)
    static = model.generate(input_ids, prefix_lengths=prefix, cache_implementation="static", **kwargs)
    causal = model.generate(input_ids, cache_implementation="static", **kwargs)
    assert torch.equal(static.sequences, dynamic.sequences)
    for a, b in zip(static.logits, dynamic.logits):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
    assert (static.logits[0] - causal.logits[0]).abs().max() > 1e-3  # the prefix really is seen both ways


def test_prefix_lm_eager_equals_sdpa_with_padding():
    eager = DecoderForCausalLM(tiny_decoder_config(prefix_lm=True, attn_implementation="eager")).eval()
    sdpa = DecoderForCausalLM(tiny_decoder_config(prefix_lm=True, attn_implementation="sdpa")).eval()
    sdpa.load_state_dict(eager.state_dict())
    input_ids = torch.randint(3, 97, (2, 10))
    mask = torch.ones_like(input_ids)
    mask[0, :2] = 0  # left padding: the prefix counts positions of the padded row
    prefix = torch.tensor([6, 4])
    with torch.no_grad():
        a = eager(input_ids, attention_mask=mask, prefix_lengths=prefix).logits
        b = sdpa(input_ids, attention_mask=mask, prefix_lengths=prefix).logits
    torch.testing.assert_close(a[mask.bool()], b[mask.bool()], atol=1e-4, rtol=0)
