"""The chunked LM-head + cross-entropy equals the naive loss in value and gradients (incl. z-loss); labels of the
wrong shape are named."""

import re

import pytest
import torch

from archlab.modeling.losses import causal_lm_loss, chunked_causal_lm_loss

from helpers import assert_close_to_scale


def _naive(hidden, weight, labels, num_items=None, z=0.0):
    return causal_lm_loss(hidden @ weight.t(), labels, num_items, z_loss_coef=z)


@pytest.mark.parametrize("chunk", [1, 5, 64])
@pytest.mark.parametrize("z", [0.0, 1e-2])
def test_chunked_matches_naive_value_and_grads(chunk, z):
    torch.manual_seed(0)
    hidden = torch.randn(3, 7, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 16, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 50, (3, 7))
    labels[0, :3] = -100
    ref = _naive(hidden, weight, labels, z=z)
    g_ref = torch.autograd.grad(ref, (hidden, weight))
    out = chunked_causal_lm_loss(hidden, weight, labels, chunk, z_loss_coef=z)
    g_out = torch.autograd.grad(out, (hidden, weight))
    torch.testing.assert_close(out, ref)
    for a, b in zip(g_out, g_ref):  # float64 in, but the chunked loss computes its logits in float32
        assert_close_to_scale(a, b, rtol=1e-5)


def test_num_items_in_batch_sums_then_divides():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11)
    labels = torch.randint(0, 11, (2, 5))
    mean = causal_lm_loss(logits, labels)
    summed = causal_lm_loss(logits, labels, num_items_in_batch=1)
    assert torch.allclose(summed / 8, mean)  # 2 rows x 4 predicted positions
    assert torch.allclose(causal_lm_loss(logits, labels, num_items_in_batch=torch.tensor(16)), summed / 16)


def test_all_ignored_gives_zero_not_nan():
    logits = torch.randn(1, 4, 11)
    labels = torch.full((1, 4), -100)
    assert causal_lm_loss(logits, labels).item() == 0.0


def test_labels_of_the_wrong_shape_are_named():
    """One target per token: a labels tensor of another shape is a ValueError naming both shapes, not a size error
    inside cross_entropy (both the plain and the chunked loss)."""
    hidden, weight = torch.randn(2, 5, 8), torch.randn(11, 8)
    for labels in (torch.zeros(2, 4, dtype=torch.long), torch.zeros(10, dtype=torch.long)):
        message = re.escape(f"`labels` has shape {tuple(labels.shape)}; it must be (2, 5), one target per token")
        with pytest.raises(ValueError, match=message):
            causal_lm_loss(hidden @ weight.t(), labels)
        with pytest.raises(ValueError, match=message):
            chunked_causal_lm_loss(hidden, weight, labels, chunk_size=4)
