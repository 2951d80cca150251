"""Sinusoid tables: Marian's split layout bit-for-bit, the paper's interleaved layout against the formula."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.models.marian.modeling_marian import MarianSinusoidalPositionalEmbedding

from archlab.modeling.sinusoidal import SinusoidalPositionalEmbedding, sinusoid_table


@pytest.mark.parametrize("dim", [16, 17, 64])
def test_split_layout_matches_marian(dim):
    marian = MarianSinusoidalPositionalEmbedding(50, dim).create_weight()
    ours = sinusoid_table(50, dim, layout="split")
    torch.testing.assert_close(ours, marian, atol=1e-7, rtol=0)


@pytest.mark.parametrize("dim", [8, 9])
def test_interleaved_layout_is_the_papers_formula(dim):
    table = sinusoid_table(20, dim, layout="interleaved", dtype=torch.float64)
    for pos in range(20):
        for channel in range(dim):
            angle = pos / 10000 ** (2 * (channel // 2) / dim)
            expected = math.sin(angle) if channel % 2 == 0 else math.cos(angle)
            assert table[pos, channel].item() == pytest.approx(expected, abs=1e-12)


def test_layouts_are_permutations_of_each_other():
    dim = 12
    interleaved, split = sinusoid_table(30, dim, "interleaved"), sinusoid_table(30, dim, "split")
    order = [*range(0, dim, 2), *range(1, dim, 2)]  # sines first, then cosines
    torch.testing.assert_close(interleaved[:, order], split)


def test_relative_offset_is_a_linear_map():
    """The paper's motivation: PE(pos + k) is a fixed linear function (a rotation per frequency) of PE(pos)."""
    dim, k = 16, 5
    table = sinusoid_table(40, dim, "interleaved", dtype=torch.float64)
    # (sin, cos) of each frequency w, moved on by k positions: [sin, cos] @ [[cos kw, -sin kw], [sin kw, cos kw]].
    # Built from the paper's frequencies, not fitted (a least-squares fit of this ill-conditioned table rounds
    # differently with each BLAS and thread count).
    shift = torch.zeros(dim, dim, dtype=torch.float64)
    for i in range(dim // 2):
        angle = k / 10000 ** (2 * i / dim)
        block = [[math.cos(angle), -math.sin(angle)], [math.sin(angle), math.cos(angle)]]
        shift[2 * i : 2 * i + 2, 2 * i : 2 * i + 2] = torch.tensor(block, dtype=torch.float64)
    torch.testing.assert_close(table[:-k] @ shift, table[k:], atol=1e-12, rtol=0)


def test_module_lookup_reset_and_errors():
    module = SinusoidalPositionalEmbedding(32, 8, layout="split")
    ids = torch.tensor([[0, 3, 31]])
    assert module(ids).shape == (1, 3, 8)
    torch.testing.assert_close(module(ids)[0], sinusoid_table(32, 8, "split")[[0, 3, 31]])
    assert "weight" in module.state_dict()
    assert "weight" not in SinusoidalPositionalEmbedding(4, 8, persistent=False).state_dict()
    module.weight.zero_()
    module.reset_parameters()
    torch.testing.assert_close(module.weight, sinusoid_table(32, 8, "split"))
    with pytest.raises(ValueError, match="'interleaved', 'split'"):
        sinusoid_table(4, 8, layout="halves")
