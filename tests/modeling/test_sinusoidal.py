"""Sinusoid tables: Marian's split layout bit-for-bit, the paper's interleaved layout against the formula."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.models.marian.modeling_marian import MarianSinusoidalPositionalEmbedding

from archlab import DecoderForCausalLM, Seq2SeqForConditionalGeneration
from archlab.modeling import sinusoidal
from archlab.modeling.sinusoidal import SinusoidalPositionalEmbedding, sinusoid_table

from helpers import tiny_decoder_config, tiny_seq2seq_config


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


@pytest.mark.parametrize("positions", ["learned", "sinusoidal"])
def test_generation_past_the_table_is_refused_up_front_where_no_forward_checks(monkeypatch, positions):
    """On an accelerator no forward checks its position ids (it would wait for the device every step), and the
    lookup past the table was a device-side assert at the step that crossed it, ending the CUDA context: there a
    `generate` call that needs more positions than the table has is refused before anything runs. Stood in for on the
    CPU by checking no forward; the limit is exact (the last token generated is fed to no forward)."""
    monkeypatch.setattr(sinusoidal, "CHECKED_PER_FORWARD", ())
    calls = []
    decoder = DecoderForCausalLM(tiny_decoder_config(position_embedding_type=positions, max_position_embeddings=16))
    decoder.register_forward_pre_hook(lambda module, args: calls.append(1))
    prompt = torch.randint(3, 60, (1, 5))
    assert decoder.eval().generate(prompt, max_new_tokens=12, min_new_tokens=12).shape[1] == 17  # 16 positions fed
    with pytest.raises(
        ValueError,
        match=f"needs 17 positions, but the {positions} position table has .* 16 rows.*ask for at most 12 new tokens",
    ):
        calls.clear()
        decoder.generate(prompt, max_new_tokens=13)
    assert calls == []
    seq2seq = Seq2SeqForConditionalGeneration(
        tiny_seq2seq_config(position_embedding_type=positions, max_position_embeddings=16)
    )
    with pytest.raises(ValueError, match="A source of 17 tokens needs 17 positions.*truncate the sources"):
        seq2seq.eval().generate(torch.randint(3, 60, (1, 17)), max_new_tokens=3)
    with pytest.raises(ValueError, match="needs 17 positions.*ask for at most 16 new tokens"):
        seq2seq.generate(prompt, max_new_tokens=17)
    assert seq2seq.generate(torch.randint(3, 60, (1, 16)), max_new_tokens=16, min_new_tokens=16).shape[1] == 17
