"""beam_loop.py: beam search with the whole step in one function gives transformers' own beam search — the same
sequences, `sequences_scores`, `beam_indices`, per-step scores and logits, and cache length — for the decoder and
the encoder-decoder variants it takes, with searches ending early under each `early_stopping` setting and length
penalty, and with min_new_tokens; it compiles as one graph that later calls reuse; the calls it does not take run
transformers' loop.

The step runs uncompiled here, or traced by dynamo's "eager" backend; a real inductor compile is in
tests/integration/test_compile.py, CUDA graphs in tests/integration/test_fast_decoding_gpu.py.
"""

from __future__ import annotations

import pytest
import torch
from transformers import CompileConfig

from archlab.modeling import beam_loop, cache_spans, fast_decoding, sliding_layers, source_padding

from helpers import (
    DECODER_VARIANTS,
    NO_STATIC_CACHE,
    SEQ2SEQ_VARIANTS,
    assert_close_to_scale,
    decoder_variant,
    seq2seq_variant,
)

OUTPUTS = dict(return_dict_in_generate=True, output_scores=True, output_logits=True, pad_token_id=0)


def _compile_config(backend: str = "eager", fullgraph: bool = True) -> CompileConfig:
    config = CompileConfig(backend=backend, mode=None, fullgraph=fullgraph)
    config._compile_all_devices = True  # transformers compiles on CPU too when told to (its testing hook)
    return config


@pytest.fixture
def loop_calls(monkeypatch) -> list[int]:
    """Counts `beam_search` calls; the step runs uncompiled."""
    calls: list[int] = []
    search = beam_loop.beam_search

    def counted(*args, **kwargs):
        calls.append(1)
        return search(*args, **kwargs)

    monkeypatch.setattr(fast_decoding, "beam_search", counted)
    monkeypatch.setattr(fast_decoding, "compiled_beam_step", lambda model, config: beam_loop.beam_step)
    return calls


def _model(kind: str, name: str):
    return seq2seq_variant(name) if kind == "seq2seq" else decoder_variant(name)


def _inputs(model, kind: str, length: int = 7) -> dict[str, torch.Tensor]:
    """3 prompts (sources): one padded by 2, on the left for a decoder, on the right for an encoder."""
    ids = torch.randint(3, model.config.vocab_size, (3, length), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    padding = slice(length - 2, length) if kind == "seq2seq" else slice(0, 2)
    mask[1, padding] = 0
    ids[1, padding] = 0
    return {"input_ids": ids, "attention_mask": mask}


def _both(model, loop_calls, **kwargs):
    reference = model.generate(cache_implementation="static", **kwargs)
    assert not loop_calls
    ours = model.generate(cache_implementation="static", compile_config=_compile_config(), **kwargs)
    assert loop_calls == [1]
    loop_calls.clear()
    return reference, ours


def _assert_same(reference, ours, kind: str) -> None:
    assert torch.equal(ours.sequences, reference.sequences)
    torch.testing.assert_close(ours.sequences_scores, reference.sequences_scores, atol=1e-5, rtol=1e-5)
    assert torch.equal(ours.beam_indices, reference.beam_indices)
    for name in ("scores", "logits"):
        expected, actual = getattr(reference, name), getattr(ours, name)
        assert len(actual) == len(expected), name
        for step, (a, b) in enumerate(zip(actual, expected)):
            assert_close_to_scale(a, b, msg=f"{name} of step {step}")  # cache spans: sums of other lengths
    caches = [out.past_key_values for out in (reference, ours)]
    if kind == "seq2seq":
        caches = [cache.self_attention_cache for cache in caches]
    assert int(caches[1].get_seq_length()) == int(caches[0].get_seq_length())


# Sliding-window variants (window 4) included: a 16-position cache is 4 windows, kept whole (`WholeCacheSlidingLayer`).
VARIANTS = [("decoder", name) for name in sorted(set(DECODER_VARIANTS) - NO_STATIC_CACHE)] + [
    ("seq2seq", name) for name in sorted(SEQ2SEQ_VARIANTS)
]


@pytest.mark.parametrize("kind, name", VARIANTS)
def test_every_variant_searches_as_transformers_loop(kind, name, loop_calls):
    model = _model(kind, name)
    inputs = _inputs(model, kind)
    if getattr(model.config, "prefix_lm", False):
        inputs["prefix_lengths"] = torch.full((3,), 4)
    kwargs = dict(**inputs, **OUTPUTS, num_beams=3, num_return_sequences=2, max_new_tokens=10, eos_token_id=[5, 7])
    reference, ours = _both(model, loop_calls, **kwargs)
    _assert_same(reference, ours, kind)


def test_sliding_windows_search_as_the_dynamic_cache(loop_calls):
    """Beam search over whole-cache sliding layers (keys past the window masked, reordered with the rest) gives what
    the dynamic cache's sliding layers, which drop those keys, give."""
    model = decoder_variant("local_global")
    kwargs = dict(**_inputs(model, "decoder"), **OUTPUTS, num_beams=3, num_return_sequences=2, max_new_tokens=10)
    ours = model.generate(cache_implementation="static", compile_config=_compile_config(), **kwargs)
    assert loop_calls == [1]
    assert any(isinstance(layer, sliding_layers.WholeCacheSlidingLayer) for layer in ours.past_key_values.layers)
    dynamic = model.generate(cache_implementation="dynamic", **kwargs)
    assert torch.equal(ours.sequences, dynamic.sequences)
    torch.testing.assert_close(ours.sequences_scores, dynamic.sequences_scores, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("eos", [None, list(range(3, 9))], ids=["to_the_end", "ending_early"])
@pytest.mark.parametrize("name", ["local_global", "all_sliding_attention", "alibi_local_global"])
def test_sliding_windows_past_four_windows_search_as_rings(name, eos, loop_calls, monkeypatch):
    """Past 4 windows (window 4, 7 + 40 positions, a prompt longer than the window) the loop searches over rings of
    the window-long sliding layers, reordered with the beams: transformers' loop's sequences and scores, the dynamic
    cache's sequences, and a returned cache whose windows hold the keys of the same search over whole layers and of
    transformers' loop, whether the search ran to the end or ended early."""
    model = decoder_variant(name)
    kwargs = dict(**_inputs(model, "decoder"), **OUTPUTS, num_beams=3, num_return_sequences=2, max_new_tokens=40)
    kwargs["eos_token_id"] = eos
    reference, ours = _both(model, loop_calls, **kwargs)
    _assert_same(reference, ours, "decoder")
    assert torch.equal(ours.sequences, model.generate(cache_implementation="dynamic", **kwargs).sequences)
    monkeypatch.setattr(sliding_layers, "WHOLE_CACHE_WINDOWS", 100)
    model.release_decoding_memory()
    _, whole = _both(model, loop_calls, **kwargs)
    windows = sliding_layers.window_long_layers(ours.past_key_values)
    assert windows
    for index in windows:
        expected, actual = (out.past_key_values.layers[index] for out in (reference, ours))
        length = actual.cumulative_length_int
        assert length == expected.cumulative_length_int
        kept = whole.past_key_values.layers[index].keys[:, :, length - actual.max_cache_len : length]
        assert_close_to_scale(actual.keys, kept, msg="window keys against whole layers")
        assert_close_to_scale(actual.keys, expected.keys, msg="window keys against transformers' loop")


@pytest.mark.parametrize(
    "search",
    [
        dict(early_stopping=True, eos_token_id=list(range(3, 20))),
        dict(early_stopping=False, eos_token_id=list(range(3, 12))),
        dict(early_stopping=False, length_penalty=-1.0, eos_token_id=list(range(3, 8))),
        dict(early_stopping="never", length_penalty=2.0, eos_token_id=list(range(3, 30))),
        dict(min_new_tokens=6, eos_token_id=list(range(3, 20))),
    ],
    ids=["early_stopping", "heuristic", "negative_length_penalty", "never", "min_new_tokens"],
)
def test_searches_ending_early_end_as_transformers_loop(search, loop_calls):
    """Many end-of-sequence tokens end the search well before max_new_tokens; the loop reads the device every
    CHECK_EVERY steps and freezes the finished hypotheses after the end, so nothing of the extra steps shows."""
    model = decoder_variant("positions_rope")
    kwargs = dict(**_inputs(model, "decoder"), **OUTPUTS, num_beams=3, num_return_sequences=3, max_new_tokens=45)
    reference, ours = _both(model, loop_calls, **kwargs, **search)
    if "min_new_tokens" not in search and search["early_stopping"] != "never":
        assert len(reference.scores) < 45  # it did end early
    _assert_same(reference, ours, "decoder")


@pytest.mark.parametrize("kind, name", [("decoder", "positions_rope"), ("seq2seq", "positions_sinusoidal")])
def test_a_search_ending_early_returns_transformers_cache(kind, name, loop_calls):
    """The steps run past the end (the device is read every CHECK_EVERY steps) leave the returned cache's rows in
    the order of transformers' last choice: they reordered it to their own choices, so rows held other beams' keys."""
    model = _model(kind, name)
    kwargs = dict(**_inputs(model, kind), **OUTPUTS, num_beams=3, max_new_tokens=40, eos_token_id=list(range(3, 40)))
    reference, ours = _both(model, loop_calls, **kwargs)
    _assert_same(reference, ours, kind)
    assert len(reference.scores) < 40 - beam_loop.CHECK_EVERY  # it ended early, with steps run past its end
    caches = [out.past_key_values for out in (reference, ours)]
    if kind == "seq2seq":
        caches = [cache.self_attention_cache for cache in caches]
    length = int(caches[0].get_seq_length())
    for expected, actual in zip(*(cache.layers for cache in caches)):
        for name in ("keys", "values"):
            expected_tensor, actual_tensor = (getattr(layer, name)[:, :, :length] for layer in (expected, actual))
            assert_close_to_scale(actual_tensor, expected_tensor, msg=name)


@pytest.mark.parametrize("config_eos", [None, [2]], ids=["alone", "over_the_config"])
def test_a_custom_end_of_sequence_criterion_ends_beams_as_transformers_loop(config_eos, loop_calls):
    """An `EosTokenCriteria` passed in `stopping_criteria` ends beams on its ids, alone or over the config's (which
    then still size the top-k): the loop ended them on the config's ids only (with none, every beam ran to the end)."""
    from transformers import StoppingCriteriaList
    from transformers.generation.stopping_criteria import EosTokenCriteria

    model = decoder_variant("positions_rope")
    criteria = StoppingCriteriaList([EosTokenCriteria(eos_token_id=list(range(3, 20)))])
    kwargs = dict(**_inputs(model, "decoder"), **OUTPUTS, num_beams=3, max_new_tokens=30, eos_token_id=config_eos)
    reference, ours = _both(model, loop_calls, stopping_criteria=criteria, **kwargs)
    _assert_same(reference, ours, "decoder")
    assert len(reference.scores) < 30  # the criterion ended the search


def test_a_custom_maximum_length_criterion_runs_transformers_loop(loop_calls):
    """A `MaxLengthCriteria` in `stopping_criteria` takes precedence over `max_new_tokens` in transformers' loop (its
    beams end at its length; the early-stop heuristic still reads the config's): the loop, which searched to the
    config's length (20 new tokens, not 5), leaves it to transformers."""
    from transformers import StoppingCriteriaList
    from transformers.generation.stopping_criteria import MaxLengthCriteria

    model = decoder_variant("positions_rope")
    criteria = StoppingCriteriaList([MaxLengthCriteria(max_length=12)])  # 7 + 5
    kwargs = dict(**_inputs(model, "decoder"), **OUTPUTS, num_beams=3, max_new_tokens=20, stopping_criteria=criteria)
    reference = model.generate(cache_implementation="static", **kwargs)
    ours = model.generate(cache_implementation="static", compile_config=_compile_config(), **kwargs)
    assert not loop_calls
    assert ours.sequences.shape[1] == reference.sequences.shape[1] == 12
    _assert_same(reference, ours, "decoder")


def test_low_memory_raises_transformers_error(loop_calls):
    """transformers' beam search refuses `low_memory=True` (sequential beams were dropped); the loop ran without it."""
    model = decoder_variant("positions_rope")
    kwargs = dict(**_inputs(model, "decoder"), num_beams=3, max_new_tokens=4, pad_token_id=0, low_memory=True)
    for extra in ({}, dict(compile_config=_compile_config())):
        with pytest.raises(ValueError, match="low_memory=True"):
            model.generate(cache_implementation="static", **kwargs, **extra)
    assert not loop_calls


@pytest.mark.parametrize("length_penalty", [-1, 2])
def test_an_integer_length_penalty_searches_as_transformers_loop(length_penalty, loop_calls):
    """`length_penalty=-1` as an int: the step raises the length, a tensor, to it (an int tensor's negative powers
    raised 'Integers to negative integer powers are not allowed'); transformers raises a Python int."""
    model = decoder_variant("positions_rope")
    kwargs = dict(**_inputs(model, "decoder"), **OUTPUTS, num_beams=3, max_new_tokens=12, eos_token_id=[5, 7, 9])
    reference, ours = _both(model, loop_calls, length_penalty=length_penalty, **kwargs)
    _assert_same(reference, ours, "decoder")


@pytest.mark.parametrize("kind, name", [("decoder", "positions_rope"), ("seq2seq", "positions_sinusoidal")])
@pytest.mark.parametrize("n", [2, 3])
def test_no_repeat_ngram_size_as_transformers_bans(n, kind, name, loop_calls):
    """Summarization's usual setting (beams with `no_repeat_ngram_size`): the ban on every beam's sequence so far.
    (Prompts of 8 tokens: at 7, bans leave two beams of one sentence holding the same hypothesis, and which of them
    a continuation comes from — the beam indices and the order of the per-step scores — is a tie rounding breaks.)"""
    model = _model(kind, name)
    kwargs = dict(**_inputs(model, kind, length=8), **OUTPUTS, num_beams=4, max_new_tokens=20, no_repeat_ngram_size=n)
    reference, ours = _both(model, loop_calls, **kwargs)
    _assert_same(reference, ours, kind)
    assert any(torch.isinf(scores).any() for scores in ours.scores)  # the ban did ban something


def test_plain_sequences(loop_calls):
    model = seq2seq_variant("positions_relative_bias")
    kwargs = dict(**_inputs(model, "seq2seq"), num_beams=4, max_new_tokens=8, eos_token_id=[4, 9])
    reference, ours = _both(model, loop_calls, **kwargs)
    assert isinstance(ours, torch.Tensor) and torch.equal(ours, reference)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(do_sample=True),  # beam sampling: torch.multinomial reads the device
        dict(bad_words_ids=[[5, 6]]),  # several tokens (one-token bad words are bans: taken)
        dict(output_attentions=True, return_dict_in_generate=True),
        dict(max_time=30.0),  # a stopping criterion of its own
    ],
)
def test_calls_it_does_not_take_run_transformers_loop(kwargs, loop_calls):
    model = decoder_variant("positions_rope")
    inputs = _inputs(model, "decoder")
    common = dict(num_beams=3, max_new_tokens=4, pad_token_id=0, cache_implementation="static")
    # not fullgraph: transformers' compiled forward breaks its graph to warn about attention outputs under sdpa
    model.generate(**inputs, **kwargs, **common, compile_config=_compile_config(fullgraph=False))
    assert not loop_calls
    model.generate(**inputs, **common, compile_config=_compile_config())
    assert loop_calls == [1]  # the same call without it takes the loop


@pytest.mark.parametrize(
    "kind, name",
    [("decoder", "positions_rope"), ("decoder", "alibi_local_global"), ("seq2seq", "positions_relative_bias")],
)
def test_the_step_compiles_as_one_graph_reused_by_later_calls(kind, name):
    """fullgraph=True: the masks, forward, top-k, bookkeeping and cache reorder in one graph; a later call with
    other minimum and maximum lengths (and, for the decoder, another prompt length) recompiles nothing (a new source
    length does, as for transformers' compiled forward). The sliding-window decoder's 18-position cache is past 4
    windows: its sliding layers are rings (sliding_layers.py), their mask and ALiBi's bias traced per slot."""
    torch._dynamo.reset()
    model = _model(kind, name)
    inputs = _inputs(model, kind)
    common = dict(num_beams=3, num_return_sequences=2, pad_token_id=0, eos_token_id=[5, 7], no_repeat_ngram_size=3)
    common["forced_eos_token_id"] = 7  # Marian's setting: a buffer too, its length follows each call's
    common["repetition_penalty"] = 1.2  # traced too (the seen tokens gathered from the running sequences)
    calls = [dict(inputs, max_new_tokens=12, min_new_tokens=3)]
    shorter = {key: value[:, 1:] for key, value in inputs.items()} if kind == "decoder" else inputs
    calls.append(dict(shorter, max_new_tokens=10, min_new_tokens=5))
    for index, kwargs in enumerate(calls):
        expected = model.generate(**kwargs, **common, cache_implementation="static")
        with torch._dynamo.config.patch(error_on_recompile=index > 0):
            compiled = model.generate(
                **kwargs, **common, cache_implementation="static", compile_config=_compile_config()
            )
            assert torch.equal(compiled, expected)
    assert hasattr(model, "_compiled_beam_step")


@pytest.mark.parametrize("kind", ["decoder", "seq2seq"])
def test_forced_bos_and_eos_tokens_as_transformers_forces_them(kind, loop_calls):
    """Marian's and BART's settings (forced_eos_token_id; BART's forced_bos_token_id too) take the compiled beam
    loop and give transformers' search."""
    model = _model(kind, "positions_rope" if kind == "decoder" else "positions_sinusoidal")
    inputs = _inputs(model, kind) if kind == "seq2seq" else {"input_ids": torch.ones(3, 1, dtype=torch.long)}
    kwargs = dict(**inputs, **OUTPUTS, num_beams=3, max_new_tokens=8, eos_token_id=[5, 7])
    kwargs.update(forced_bos_token_id=11, forced_eos_token_id=7, no_repeat_ngram_size=2)
    reference, ours = _both(model, loop_calls, **kwargs)
    _assert_same(reference, ours, kind)
    assert (ours.sequences[:, 1] == 11).all()


def test_the_marian_shaped_benchmark_model_takes_the_beam_loop(loop_calls):
    """The cuda-loops suite's beam-search row: a Marian-shaped config, whose forced_eos_token_id used to keep every
    search in transformers' loop."""
    from archlab.scripts.benchmark_cuda import marian_pair, shape

    ours = marian_pair(shape("marian", True), 64, torch.device("cpu"))[0].eval()  # the suite decodes in eval mode
    assert ours.generation_config.forced_eos_token_id is not None
    inputs = _inputs(ours, "seq2seq")
    kwargs = dict(**inputs, num_beams=4, max_new_tokens=6, return_dict_in_generate=True, output_scores=True)
    reference, searched = _both(ours, loop_calls, **kwargs)
    assert torch.equal(searched.sequences, reference.sequences)


def test_suppressed_tokens_and_one_token_bad_words_in_beam_search(loop_calls):
    model = _model("seq2seq", "positions_sinusoidal")
    kwargs = dict(**_inputs(model, "seq2seq"), **OUTPUTS, num_beams=3, max_new_tokens=8, eos_token_id=[5, 7])
    kwargs.update(suppress_tokens=[8, 9, 10], bad_words_ids=[[11], [12]])
    reference, ours = _both(model, loop_calls, **kwargs)
    _assert_same(reference, ours, "seq2seq")
    assert not torch.isin(ours.sequences[:, 1:], torch.tensor([8, 9, 10, 11, 12])).any()


@pytest.mark.parametrize("kind", ["decoder", "seq2seq"])
@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_in_beam_search_as_transformers_applies_it(kind, penalty, loop_calls, monkeypatch):
    """On each beam's log-probabilities, over its own sequence so far (a decoder's left padding skipped). The steps
    read the whole cache and the source unpadded, as transformers' do: a penalty below 1 makes beams of repeated
    tokens whose scores tie to float32 rounding, which attention over a shorter span (cache_spans.py) or a padded
    source (source_padding.py) rounds differently."""
    monkeypatch.setattr(cache_spans, "MIN_SPAN_STEP", 10**6)
    monkeypatch.setattr(source_padding, "SOURCE_STEP", None)
    model = _model(kind, "positions_rope" if kind == "decoder" else "positions_sinusoidal")
    kwargs = dict(**_inputs(model, kind), **OUTPUTS, num_beams=3, num_return_sequences=2, max_new_tokens=10)
    kwargs.update(eos_token_id=[5, 7], repetition_penalty=penalty)
    reference, ours = _both(model, loop_calls, **kwargs)
    _assert_same(reference, ours, kind)
    plain = model.generate(**dict(kwargs, repetition_penalty=1.0), cache_implementation="static")
    assert not torch.equal(plain.sequences, reference.sequences)  # the penalty changed the search
