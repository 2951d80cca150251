"""A Llama-equivalent DecoderConfig reproduces LlamaForCausalLM: strict state-dict load, logits, loss, generation."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from archlab import DecoderForCausalLM

from helpers import TINY, tiny_decoder_config

ATOL = 1e-4


def _pair(attn="sdpa", **overrides):
    kw = {**TINY, **overrides}
    reference = LlamaForCausalLM(LlamaConfig(**kw, attn_implementation=attn)).eval()
    model = DecoderForCausalLM(tiny_decoder_config(**overrides, attn_implementation=attn)).eval()
    model.load_state_dict(reference.state_dict(), strict=True)
    return model, reference


def _batch():
    input_ids = torch.randint(3, TINY["vocab_size"], (3, 11))
    mask = torch.ones_like(input_ids)
    mask[0, :4] = 0  # left padding
    mask[1, -3:] = 0  # right padding
    input_ids = input_ids.masked_fill(mask == 0, TINY["pad_token_id"])
    return input_ids, mask


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"num_key_value_heads": 1},
        {"num_key_value_heads": 4, "attention_bias": True, "mlp_bias": True},
        {"tie_word_embeddings": True},
        {"head_dim": 16},
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            }
        },
        {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}},
    ],
    ids=["gqa", "mqa", "mha-bias", "tied", "head_dim", "llama3-rope", "linear-rope"],
)
def test_logits_match_llama_with_and_without_padding(attn, overrides):
    model, reference = _pair(attn, **overrides)
    input_ids, mask = _batch()
    with torch.no_grad():
        full = (model(input_ids).logits - reference(input_ids).logits).abs().max()
        padded = model(input_ids, attention_mask=mask).logits - reference(input_ids, attention_mask=mask).logits
    assert full <= ATOL
    assert padded[mask.bool()].abs().max() <= ATOL


def test_loss_and_gradients_match_llama():
    model, reference = _pair()
    model.train(), reference.train()
    input_ids, mask = _batch()
    labels = input_ids.masked_fill(mask == 0, -100)
    ours = model(input_ids, attention_mask=mask, labels=labels).loss  # chunked head + CE in training
    theirs = reference(input_ids, attention_mask=mask, labels=labels).loss
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-5)
    ours.backward(), theirs.backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_greedy_generation_matches_llama_token_for_token(cache):
    model, reference = _pair()
    input_ids, _ = _batch()
    mask = torch.ones_like(input_ids)
    mask[0, :4] = 0
    input_ids = input_ids.masked_fill(mask == 0, TINY["pad_token_id"])
    kwargs = dict(
        attention_mask=mask,
        max_new_tokens=12,
        do_sample=False,
        cache_implementation=cache,
        pad_token_id=TINY["pad_token_id"],
    )
    ours = model.generate(input_ids, **kwargs)
    theirs = reference.generate(input_ids, **kwargs)
    assert torch.equal(ours, theirs)
