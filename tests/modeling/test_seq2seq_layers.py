"""T5's fp16 overflow guard (`clamp_fp16_hidden_states`) against `T5ForConditionalGeneration` in float16.

transformers' T5 blocks clamp fp16 hidden states after every residual add (self-attention, cross-attention, FFN) to
±(finfo.max - 1000) whenever one of them overflowed to ±inf. The test scales the first FFN output projection of both
stacks in both models (same weights, all in fp16, CPU kernels, SDPA on both sides) until some of its outputs overflow:
T5 stays finite, archlab with the guard gives T5's logits exactly, and archlab without it turns inf into NaN in the
next norm. The guard decides on the device; tracing it with fake tensors proves it never reads a value on the host.
"""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from archlab import Seq2SeqConfig, Seq2SeqForConditionalGeneration
from archlab.modeling.seq2seq_layers import clamp_fp16

from helpers import T5_VERSIONS, t5_batch, t5_pair

OVERFLOW = 1e4  # FFN outputs reach ~1e5 > 65504 with this factor (1e3 stays finite)


def first_ffn_outputs(reference, ours):
    """The first FFN output projection of each stack, in T5 and in archlab."""
    return [
        reference.encoder.block[0].layer[1].DenseReluDense.wo.weight,
        reference.decoder.block[0].layer[2].DenseReluDense.wo.weight,
        ours.model.encoder.layers[0].fc2.weight,
        ours.model.decoder.layers[0].fc2.weight,
    ]


@pytest.mark.parametrize("version", list(T5_VERSIONS))
def test_fp16_clamping_matches_t5_where_unclamped_hidden_states_overflow(version):
    reference, ours = t5_pair(version)
    assert ours.config.clamp_fp16_hidden_states  # the T5 conversion turns the guard on
    unguarded = Seq2SeqForConditionalGeneration(
        Seq2SeqConfig(**{**ours.config.to_dict(), "clamp_fp16_hidden_states": False})
    ).eval()
    unguarded.load_state_dict(ours.state_dict())
    source, mask, target = t5_batch()
    with torch.no_grad():
        for model in (reference, ours, unguarded):
            model.half()
        for weight in first_ffn_outputs(reference, ours) + first_ffn_outputs(reference, unguarded)[2:]:
            weight.mul_(OVERFLOW)
        expected = reference(input_ids=source, attention_mask=mask, decoder_input_ids=target)
        got = ours(input_ids=source, attention_mask=mask, decoder_input_ids=target)
        overflowed = unguarded(input_ids=source, attention_mask=mask, decoder_input_ids=target)
    assert expected.logits.dtype == got.logits.dtype == torch.float16
    assert torch.isfinite(expected.logits).all() and torch.isfinite(expected.encoder_last_hidden_state).all()
    # without the guard the overflow reaches the output of both stacks
    assert not torch.isfinite(overflowed.encoder_last_hidden_state).all()
    assert not torch.isfinite(overflowed.logits).all()
    torch.testing.assert_close(got.encoder_last_hidden_state, expected.encoder_last_hidden_state, atol=0, rtol=0)
    torch.testing.assert_close(got.logits, expected.logits, atol=0, rtol=0)


def test_fp16_clamp_is_t5s_rule_and_needs_no_host_synchronisation():
    largest = torch.finfo(torch.float16).max
    finite = torch.tensor([1.0, -60000.0, largest], dtype=torch.float16)
    assert torch.equal(clamp_fp16(finite), finite)  # nothing overflowed: nothing changes, even at finfo.max
    overflowed = torch.tensor([1.0, float("inf"), -float("inf"), largest], dtype=torch.float16)
    limit = torch.tensor(largest - 1000, dtype=torch.float16)  # 64504 rounds to 64512 in fp16, as in T5
    assert torch.equal(clamp_fp16(overflowed), torch.stack([overflowed[0], limit, -limit, limit]))
    big = torch.tensor([float("inf"), 1e38], dtype=torch.float32)
    assert torch.equal(clamp_fp16(big), big)  # other dtypes pass unchanged
    # with fake tensors there are no values to read: a host-side `if tensor.any()` would raise here
    make_fx(clamp_fp16, tracing_mode="fake")(overflowed)


def test_marian_style_configs_do_not_clamp():
    assert not Seq2SeqConfig().clamp_fp16_hidden_states
