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


def test_shift_labels_without_labels_give_the_logits_and_no_loss_as_llama():
    """Trainer's label smoother pops `labels` and keeps `shift_labels` (context parallelism adds them): in training
    the model ran its chunked loss on them and returned no logits, and the smoother failed (KeyError 'logits')."""
    model, reference = _pair()
    input_ids, mask = _batch()
    shifted = torch.nn.functional.pad(input_ids[:, 1:], (0, 1), value=-100)
    for mode in ("train", "eval"):
        getattr(model, mode)(), getattr(reference, mode)()
        ours = model(input_ids, attention_mask=mask, shift_labels=shifted)
        theirs = reference(input_ids, attention_mask=mask, shift_labels=shifted)
        assert ours.loss is None and theirs.loss is None, mode
        torch.testing.assert_close(ours.logits, theirs.logits, atol=ATOL, rtol=1e-4, msg=mode)
    labels = input_ids.masked_fill(mask == 0, -100)
    ours = model(input_ids, attention_mask=mask, labels=labels, shift_labels=shifted).loss  # as given: no shift
    theirs = reference(input_ids, attention_mask=mask, labels=labels, shift_labels=shifted).loss
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-5)


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


# rope types whose frequencies depend on the length (dynamic, longrope) or scale a pretraining length of 8 positions
LONG_ROPE = {
    "dynamic": {"factor": 2.0},
    "yarn": {"factor": 4.0, "original_max_position_embeddings": 8, "beta_fast": 16.0, "mscale": 0.9},
    "longrope": {
        "short_factor": [1.0, 1.2, 1.5, 2.0],
        "long_factor": [2.0, 3.0, 4.0, 5.0],
        "original_max_position_embeddings": 8,
    },
}


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("rope_type", sorted(LONG_ROPE))
def test_rope_past_the_pretraining_length_matches_llama_in_forward_and_generate(rope_type, cache):
    """Logits of sequences shorter and longer than `original_max_position_embeddings` / `max_position_embeddings`
    (16), and greedy decoding from 6 to 30 tokens, each step's scores: dynamic RoPE and longrope recompute their
    frequencies as the sequence grows, as Llama's do. (Dynamic RoPE decodes with the dynamic cache either way.)"""
    rope = {"rope_type": rope_type, "rope_theta": 10000.0, **LONG_ROPE[rope_type]}
    model, reference = _pair("eager", max_position_embeddings=16, rope_parameters=rope)
    with torch.no_grad():
        for length in (6, 12, 40):
            input_ids = torch.randint(3, TINY["vocab_size"], (2, length))
            assert (model(input_ids).logits - reference(input_ids).logits).abs().max() <= ATOL, length
    model, reference = _pair("eager", max_position_embeddings=16, rope_parameters=rope)  # dynamic RoPE's state anew
    input_ids = torch.randint(3, TINY["vocab_size"], (2, 6))
    kwargs = dict(max_new_tokens=24, do_sample=False, cache_implementation=cache, eos_token_id=None)
    kwargs |= dict(output_scores=True, return_dict_in_generate=True, pad_token_id=TINY["pad_token_id"])
    ours, theirs = model.generate(input_ids, **kwargs), reference.generate(input_ids, **kwargs)
    assert torch.equal(ours.sequences, theirs.sequences)
    for step, (a, b) in enumerate(zip(ours.scores, theirs.scores)):
        assert (a - b).abs().max() <= ATOL, step
