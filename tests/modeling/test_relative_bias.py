"""T5's bucketed relative position bias against transformers' T5Attention, both directions."""

import pytest
import torch
from transformers import T5Config
from transformers.models.t5.modeling_t5 import T5Attention

from archlab.modeling.relative_bias import RelativePositionBias, relative_position_bucket


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize(("num_buckets", "max_distance"), [(32, 128), (8, 16), (6, 20)])
def test_buckets_match_t5(bidirectional, num_buckets, max_distance):
    relative = torch.arange(-300, 301)[:, None].expand(-1, 2)
    ours = relative_position_bucket(relative, bidirectional, num_buckets, max_distance)
    theirs = T5Attention._relative_position_bucket(relative, bidirectional, num_buckets, max_distance)
    assert torch.equal(ours, theirs)
    assert ours.min() >= 0 and ours.max() < num_buckets


@pytest.mark.parametrize("is_decoder", [False, True])
def test_bias_matches_t5_compute_bias(is_decoder):
    config = T5Config(
        d_model=32,
        d_kv=8,
        num_heads=4,
        relative_attention_num_buckets=16,
        relative_attention_max_distance=40,
        is_decoder=is_decoder,
    )
    t5 = T5Attention(config, has_relative_attention_bias=True)
    ours = RelativePositionBias(4, num_buckets=16, max_distance=40, bidirectional=not is_decoder)
    ours.load_state_dict(t5.state_dict(), strict=False)
    assert torch.equal(ours.relative_attention_bias.weight, t5.relative_attention_bias.weight)
    q_len, k_len = 7, 50
    expected = t5.compute_bias(q_len, k_len)  # queries at 0..6 against keys 0..49
    got = ours(torch.arange(q_len), torch.arange(k_len))
    assert got.shape == (1, 4, q_len, k_len)
    assert torch.equal(got, expected)
    # Only the distance matters: shifting both sides leaves the bias unchanged (the KV-cache case).
    assert torch.equal(ours(torch.arange(q_len) + 100, torch.arange(k_len) + 100), got)


def test_invalid_bucketing_is_refused():
    with pytest.raises(ValueError, match="relative_attention_num_buckets"):
        RelativePositionBias(4, num_buckets=3, bidirectional=True)
    with pytest.raises(ValueError, match="relative_attention_max_distance"):
        RelativePositionBias(4, num_buckets=32, max_distance=8)


def test_bias_carries_no_gradient_under_onnx_export_and_is_unchanged(monkeypatch):
    """torch.onnx.export fails on an SDPA mask that requires grad (a view at its decomposition step), and an ONNX
    graph has no gradients: under it the bias is detached, the same values; outside it, trainable."""
    bias = RelativePositionBias(4, num_buckets=8, max_distance=16)
    positions = torch.arange(5)
    trained = bias(positions, positions)
    assert trained.requires_grad
    monkeypatch.setattr(torch.onnx, "is_in_onnx_export", lambda: True)
    exported = bias(positions, positions)
    assert not exported.requires_grad
    assert torch.equal(exported, trained)
