"""source_padding.py: the lengths an encoder-decoder's sources are padded to on the fast path, the padding itself,
and which calls are padded. (That later calls reuse the kept cache, with the unpadded source's tokens:
test_decoding_loop.py; every variant's tokens against transformers' unpadded loop: test_beam_loop.py and
test_decoding_loop.py, padded by the suite's step of 4; CUDA graphs replayed across source lengths:
tests/integration/test_fast_decoding_gpu.py.)"""

from __future__ import annotations

import pytest
import torch

from archlab import Seq2SeqForConditionalGeneration
from archlab.modeling import source_padding
from archlab.modeling.source_padding import pad_source, padded_source_length

from helpers import count_archlab_loops, cpu_compile_config, randomised, seq2seq_variant, tiny_seq2seq_config


def test_lengths_grow_by_steps_to_the_longest_so_far_within_the_position_table(monkeypatch):
    monkeypatch.setattr(source_padding, "SOURCE_STEP", 64)
    assert [padded_source_length(n, 0, 1024) for n in (1, 63, 64, 65, 200)] == [64, 64, 64, 128, 256]
    assert padded_source_length(10, 256, 1024) == 256  # never shorter than an earlier call's
    assert padded_source_length(1000, 0, 1024) == 1024  # the learned/sinusoidal table's end
    assert padded_source_length(1100, 0, 1024) == 1100  # a source past it is left as it is (the model refuses it)
    assert padded_source_length(70, 0, None) == 128
    monkeypatch.setattr(source_padding, "SOURCE_STEP", None)
    assert padded_source_length(70, 256, 1024) == 70


def test_padding_is_masked_pad_tokens_on_the_right():
    ids = torch.tensor([[5, 6, 7], [8, 9, 0]])
    ids_out, kwargs = pad_source(ids, {"attention_mask": torch.tensor([[1, 1, 1], [1, 1, 0]]), "other": 1}, 5, 2)
    assert ids_out.tolist() == [[5, 6, 7, 2, 2], [8, 9, 0, 2, 2]]
    assert kwargs["attention_mask"].tolist() == [[1, 1, 1, 0, 0], [1, 1, 0, 0, 0]] and kwargs["other"] == 1
    ids_out, kwargs = pad_source(ids, {}, 4, None)  # no mask given: ones for the source; no pad token: 0
    assert ids_out[:, 3].tolist() == [0, 0] and kwargs["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 1, 1, 0]]
    segments, positions = torch.tensor([[0, 1, 1], [0, 0, 1]]), torch.tensor([[0, 1, 2], [0, 1, 0]])
    _, kwargs = pad_source(ids, {"token_type_ids": segments, "position_ids": positions}, 5, 2)
    assert kwargs["token_type_ids"].tolist() == [[0, 1, 1, 0, 0], [0, 0, 1, 0, 0]]
    assert kwargs["position_ids"].tolist() == [[0, 1, 2, 0, 0], [0, 1, 0, 0, 0]]


@pytest.mark.parametrize(
    "call, padded",
    [
        (dict(cache_implementation="static", compile_config=cpu_compile_config()), True),
        (dict(cache_implementation="static"), False),  # not compiled (CPU without transformers' testing hook)
        (dict(), False),  # the dynamic cache (the CPU default)
        (dict(cache_implementation="static", compile_config=cpu_compile_config(), disable_compile=True), False),
        (dict(cache_implementation="static", compile_config=cpu_compile_config(), output_hidden_states=True), False),
    ],
    ids=["fast path", "static not compiled", "dynamic", "compile disabled", "encoder states returned"],
)
def test_only_the_fast_paths_sources_are_padded(call, padded):
    """The encoder sees the padded source only where the decoding step is compiled on a static cache, and not where
    the caller gets the encoder's states back."""
    model = seq2seq_variant("positions_sinusoidal")
    seen = []  # the source lengths the encoder gets
    model.get_encoder().register_forward_pre_hook(
        lambda module, args, kwargs: seen.append((args[0] if args else kwargs["input_ids"]).shape[1]), with_kwargs=True
    )
    source = torch.randint(3, 50, (2, 5), generator=torch.Generator().manual_seed(0))
    model.generate(source, max_new_tokens=3, do_sample=False, return_dict_in_generate=True, **call)
    assert seen == [8 if padded else 5]  # the suite's step of 4


@pytest.mark.parametrize("num_beams", [1, 3])
def test_segment_ids_and_positions_follow_the_padded_source(num_beams, monkeypatch):
    """A source with segment ids (`type_vocab_size`) or packed positions raised a shape error in the encoder on the
    fast path (the CUDA default): only the ids and the mask were padded. The tokens equal the dynamic cache's, and
    segment ids keep the call in archlab's loops (only the encoder reads them)."""
    calls = count_archlab_loops(monkeypatch)
    config = tiny_seq2seq_config(position_embedding_type="sinusoidal", type_vocab_size=2)
    model = randomised(Seq2SeqForConditionalGeneration(config))
    source = torch.randint(3, 50, (2, 6), generator=torch.Generator().manual_seed(0))
    segments = torch.tensor([[0, 0, 0, 1, 1, 1], [0, 0, 1, 1, 1, 1]])
    positions = torch.tensor([[0, 1, 2, 0, 1, 2], [0, 1, 0, 1, 2, 3]])  # two packed sources a row
    kwargs = dict(max_new_tokens=5, num_beams=num_beams, do_sample=False)
    fast_path = dict(cache_implementation="static", compile_config=cpu_compile_config())
    for extra in ({"token_type_ids": segments}, {"token_type_ids": segments, "position_ids": positions}):
        expected = model.generate(source, **extra, **kwargs)
        fast = model.generate(source, **extra, **kwargs, **fast_path)
        assert torch.equal(fast, expected)
    assert calls == ["greedy" if num_beams == 1 else "beams"]  # segment ids alone: the loop; with positions: not
