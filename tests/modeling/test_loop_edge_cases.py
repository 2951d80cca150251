"""Edge cases of the compiled decoding loops (decoding_loop.py, beam_loop.py, loop_processors.py) found by a fuzz of
generation options: a prompt given as `inputs_embeds`, an n-gram longer than the generation, bad words past the
vocabulary, and the step's recompile limit under `fullgraph=True`. Each gives transformers' own loop's result."""

from __future__ import annotations

import pytest
import torch
from transformers import CompileConfig

from archlab.modeling import compile_fallback

from helpers import count_archlab_loops, cpu_compile_config, decoder_variant, seq2seq_variant


def _both(model, monkeypatch, loop: str, **kwargs):
    reference = model.generate(cache_implementation="static", **kwargs)
    calls = count_archlab_loops(monkeypatch)
    ours = model.generate(cache_implementation="static", compile_config=cpu_compile_config(), **kwargs)
    assert calls == [loop]
    return reference, ours


@pytest.mark.parametrize("penalty", [None, 1.5])
@pytest.mark.parametrize("num_beams", [1, 2])
def test_a_prompt_given_as_embeddings_decodes_as_transformers_loop(num_beams, penalty, monkeypatch):
    """The prefill writes the embeddings' positions (input_ids is empty): the loops' cache spans cover them, and the
    repetition penalty skips the first new tokens of left-padded rows as transformers' does."""
    model = decoder_variant("positions_rope")
    ids = torch.randint(3, 97, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    embeds = model.get_input_embeddings()(ids).detach()
    kwargs = dict(inputs_embeds=embeds, attention_mask=mask, max_new_tokens=12, num_beams=num_beams, pad_token_id=0)
    if penalty:
        kwargs["repetition_penalty"] = penalty
    reference, ours = _both(model, monkeypatch, "greedy" if num_beams == 1 else "beams", **kwargs)
    assert torch.equal(ours, reference)


@pytest.mark.parametrize("num_beams", [1, 2])
@pytest.mark.parametrize("kind", ["decoder", "seq2seq"])
def test_an_ngram_longer_than_the_generation_bans_nothing(kind, num_beams, monkeypatch):
    model = decoder_variant("positions_rope") if kind == "decoder" else seq2seq_variant("positions_sinusoidal")
    ids = torch.randint(3, 61, (2, 6), generator=torch.Generator().manual_seed(0))
    kwargs = dict(input_ids=ids, max_new_tokens=1, no_repeat_ngram_size=9, num_beams=num_beams, pad_token_id=0)
    reference, ours = _both(model, monkeypatch, "greedy" if num_beams == 1 else "beams", **kwargs)
    assert torch.equal(ours, reference)


@pytest.mark.parametrize("num_beams", [1, 3])
def test_one_new_token_from_a_padded_prompt_decodes_as_transformers_loop(num_beams, monkeypatch):
    """max_new_tokens=1 on a fresh model: the static cache holds the prompt alone, and the mask the prefill extends by
    the next token's column is one longer than the loops' mask buffer (this raised a size mismatch)."""
    model = decoder_variant("positions_rope")
    ids = torch.randint(3, 97, (2, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=1, num_beams=num_beams, pad_token_id=0)
    reference, ours = _both(model, monkeypatch, "greedy" if num_beams == 1 else "beams", **kwargs)
    assert torch.equal(ours, reference)


@pytest.mark.parametrize("num_beams", [1, 2])
def test_bad_words_past_the_vocabulary_raise_transformers_error(num_beams, monkeypatch):
    model = decoder_variant("positions_rope")
    kwargs = dict(max_new_tokens=3, bad_words_ids=[[5], [200]], num_beams=num_beams, pad_token_id=0)
    ids = torch.randint(3, 97, (2, 6), generator=torch.Generator().manual_seed(0))
    count_archlab_loops(monkeypatch)
    for extra in ({}, dict(compile_config=cpu_compile_config())):
        with pytest.raises(ValueError, match="following tokens were being biased: \\[200\\]"):
            model.generate(ids, cache_implementation="static", **kwargs, **extra)


# dynamo's config patched by its own `patch`: pytest >= 9.2's monkeypatch restores a module's attribute from its
# `__dict__`, where a torch config module keeps none, and so deletes it (torch then hides the setting for good)
@torch._dynamo.config.patch(recompile_limit=2)
def test_steps_past_the_recompile_limit_run_eagerly_with_fullgraph(monkeypatch):
    """Each no_repeat_ngram_size is a graph of its own: past dynamo's recompile limit a fullgraph compile raises
    before the step runs, and the call decodes eagerly instead (generate's behaviour; the other tests make it raise)."""
    monkeypatch.setattr(compile_fallback, "FALL_BACK_TO_EAGER", True)
    torch._dynamo.reset()
    model = decoder_variant("positions_rope")
    ids = torch.randint(3, 97, (2, 6), generator=torch.Generator().manual_seed(0))
    for n in (1, 2, 3, 4):
        config = CompileConfig(backend="eager", mode=None, fullgraph=True)
        config._compile_all_devices = True
        kwargs = dict(max_new_tokens=4, no_repeat_ngram_size=n, pad_token_id=0, cache_implementation="static")
        expected = model.generate(ids, **kwargs)
        assert torch.equal(model.generate(ids, **kwargs, compile_config=config), expected)
