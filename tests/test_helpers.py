"""The scale-aware comparison the parity tests use (helpers.assert_close_to_scale) accepts what it should and fails
what it should."""

import pytest
import torch

from helpers import assert_close_to_scale


def test_the_tolerance_follows_the_largest_entry():
    expected = torch.tensor([3.0, 1e-3, -2.0])
    assert_close_to_scale(expected + torch.tensor([0.0, 2.9e-4, 0.0]), expected)  # 0.29 x the 3e-4 allowed
    with pytest.raises(AssertionError, match="(?s)grad: .*allowed: 0.0001 x max\\|expected\\| 3"):
        assert_close_to_scale(expected + torch.tensor([0.0, 3.1e-4, 0.0]), expected, msg="grad")
    with pytest.raises(AssertionError):
        assert_close_to_scale(torch.ones(2), torch.zeros(2))  # all zeros expected: only zeros pass
    with pytest.raises(AssertionError):
        assert_close_to_scale(expected[:2], expected)  # shapes must match
