"""cache_spans.py: the compiled decoding loops' steps read the filled part of the static cache, rounded up to a span.

The rule's numbers; a `SpannedLayer` without a span reads like a `StaticLayer`; greedy decoding, sampling and beam
search read spans that grow with the sequence and always cover it, and give the whole-cache steps' tokens; the
compiled step is one graph for every span (dynamo's eager backend here; inductor in tests/integration/test_compile.py
runs with the suite's 2-position spans too); beam search reorders the span only; generate's returned cache reads whole.
(tests/conftest.py sets spans of 2 positions for the whole suite, so every decoding test reads spans.)
"""

from __future__ import annotations

import pytest
import torch
from transformers import CompileConfig, StaticCache
from transformers.cache_utils import StaticLayer

from archlab.modeling import beam_loop, beam_reorder, cache_spans, decoding_loop, fast_decoding, sliding_layers
from archlab.modeling.cache_spans import SpannedLayer, Spans, span_length, span_step

from helpers import assert_close_to_scale, decoder_variant, seq2seq_variant


def _compile_config() -> CompileConfig:
    config = CompileConfig(backend="eager", mode=None, fullgraph=True)
    config._compile_all_devices = True  # transformers' testing hook: compile on CPU too
    return config


def _prompts(batch: int = 3, length: int = 6) -> dict[str, torch.Tensor]:
    ids = torch.randint(3, 97, (batch, length), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    ids[0, :2] = 0
    return {"input_ids": ids, "attention_mask": mask}


def test_the_span_rule_at_production_sizes(monkeypatch):
    monkeypatch.setattr(cache_spans, "MIN_SPAN_STEP", 64)  # the module's own value (conftest shortens it)
    assert span_step(384) == 64 and span_step(512) == 64 and span_step(513) == 128 and span_step(2176) == 320
    assert span_length(129, 384) == 192  # the benchmark's first step: a 128-token prompt
    assert span_length(384, 384) == 384 and span_length(2176, 2176) == 2176
    for max_len in (1, 63, 64, 65, 384, 2176, 4096, 32768):
        spans = {span_length(needed, max_len) for needed in range(1, max_len + 1)}
        assert len(spans) <= cache_spans.MAX_SPANS, max_len
        assert max(spans) == max_len
        for needed in range(1, max_len + 1, 7):
            assert needed <= span_length(needed, max_len) <= max_len


def test_a_layer_without_a_span_reads_as_a_static_layer():
    keys, values = torch.randn(2, 3, 4, 8), torch.randn(2, 3, 4, 8)
    plain, spanned = StaticLayer(max_cache_len=10), cache_spans.as_spanned(StaticLayer(max_cache_len=10))
    for layer in (plain, spanned):
        layer.update(keys, values)
    out_plain, out_spanned = (
        plain.update(keys[:, :, :1], values[:, :, :1]),
        spanned.update(keys[:, :, :1], values[:, :, :1]),
    )
    for a, b in zip(out_plain, out_spanned):
        assert torch.equal(a, b) and a.shape[2] == 10
    assert spanned.get_mask_sizes(1) == plain.get_mask_sizes(1) == (10, 0)
    assert spanned.keys.shape[2] == 11  # one position never used: every read is a slice (module docstring)
    spanned.span = torch.empty(6, dtype=torch.uint8)
    assert spanned.update(keys[:, :, :1], values[:, :, :1])[0].shape[2] == 6
    assert spanned.get_mask_sizes(1) == (6, 0)
    assert torch.equal(spanned.keys[:, :, 5], keys[:, :, 0])  # written at its length...
    assert int(spanned.get_seq_length()) == 5  # ... which the step advances (`advance_lengths`), not the layer
    cache_spans.advance_lengths(_Layers([spanned, plain]))
    assert int(spanned.get_seq_length()) == 6 and int(plain.get_seq_length()) == 5  # a plain layer advanced itself


class _Layers:
    def __init__(self, layers):
        self.layers = layers


def test_every_deferred_length_advances_in_one_kernel(monkeypatch):
    """The lengths of the layers that read a span, and of rings, advance together in one `_foreach_add_` (not one
    `add_` per layer, one tiny GPU kernel each); layers without a span keep advancing themselves."""
    keys = torch.randn(1, 2, 3, 4)
    layers = [cache_spans.as_spanned(StaticLayer(max_cache_len=8)) for _ in range(3)]
    ring = sliding_layers.RingSlidingLayer(window=4)  # (the loops fill it from a prefilled layer)
    ring.lazy_initialization(keys[:, :, :1], keys[:, :, :1])
    ring.cumulative_length.fill_(1)
    for layer in layers:
        layer.update(keys, keys)
    for layer in layers[:2]:
        layer.span = torch.empty(4, dtype=torch.uint8)
    calls = []
    foreach_add = torch._foreach_add_
    monkeypatch.setattr(
        torch, "_foreach_add_", lambda tensors, n: calls.append(len(tensors)) or foreach_add(tensors, n)
    )
    for layer in [*layers, ring]:
        layer.update(keys[:, :, :1], keys[:, :, :1])
    assert [int(layer.cumulative_length) for layer in [*layers, ring]] == [3, 3, 4, 1]
    cache_spans.advance_lengths(_Layers([*layers, ring]))
    assert calls == [3]
    assert [int(layer.cumulative_length) for layer in [*layers, ring]] == [4, 4, 4, 2]


def _record_read_lengths(monkeypatch) -> list[tuple[int, int]]:
    """(positions filled after the update, positions returned) of every update of a spanned layer."""
    seen = []
    update = SpannedLayer.update

    def recording(self, key_states, value_states, *args, **kwargs):
        keys, values = update(self, key_states, value_states, *args, **kwargs)
        deferred = key_states.shape[2] if self.defers_length else 0  # (the step advances the length after)
        seen.append((int(self.cumulative_length) + deferred, keys.shape[2]))
        return keys, values

    monkeypatch.setattr(SpannedLayer, "update", recording)
    return seen


@pytest.mark.parametrize("do_sample", [False, True])
def test_the_decoding_loop_reads_growing_spans_that_cover_the_sequence(do_sample, monkeypatch):
    model = decoder_variant("positions_rope")
    monkeypatch.setattr(fast_decoding, "compiled_decoding_step", lambda model, config: decoding_loop.decoding_step)
    kwargs = dict(**_prompts(), max_new_tokens=20, pad_token_id=0, eos_token_id=None, do_sample=do_sample)
    kwargs.update(cache_implementation="static", return_dict_in_generate=True, output_logits=True)
    if do_sample:
        kwargs.update(top_k=1)  # sampling's own path, one possible token per step
    seen = _record_read_lengths(monkeypatch)
    monkeypatch.setattr(cache_spans, "READ_SPANS", False)  # the switch: every step reads the whole cache
    whole = model.generate(**kwargs, compile_config=_compile_config())
    max_len = model._kept_static_cache.cache.get_max_length()
    assert {read for _, read in seen} == {max_len}
    seen.clear()
    monkeypatch.setattr(cache_spans, "READ_SPANS", True)
    monkeypatch.setattr(cache_spans, "MIN_SPAN_STEP", 4)
    spans = model.generate(**kwargs, compile_config=_compile_config())

    assert torch.equal(spans.sequences, whole.sequences)
    for step, (a, b) in enumerate(zip(spans.logits, whole.logits)):
        assert_close_to_scale(a, b, msg=f"logits of step {step}")
    steps = [(filled, read) for filled, read in seen if filled > 6]  # the prefill (6 positions) reads the whole cache
    assert all(filled <= read <= max_len for filled, read in steps)
    assert all(read - filled < 4 or read == max_len for filled, read in steps)  # rounded up to the step only
    reads = [read for _, read in steps]
    assert reads == sorted(reads) and len(set(reads)) > 3 and reads[-1] == max_len
    assert all(layer.span is None for layer in spans.past_key_values.layers)  # returned to whole-cache reads


def test_the_compiled_step_is_one_graph_for_every_span(monkeypatch):
    """fullgraph=True and a recompile limit of 1: a span that changed the graph would raise."""
    torch._dynamo.reset()
    monkeypatch.setattr(cache_spans, "MIN_SPAN_STEP", 3)
    model = decoder_variant("positions_alibi")  # a position bias over the keys too
    kwargs = dict(max_new_tokens=24, pad_token_id=0, eos_token_id=[5, 7], cache_implementation="static")
    shorter = {key: value[:, 1:] for key, value in _prompts().items()}  # other spans at the same cache length
    expected = [model.generate(**_prompts(), **kwargs), model.generate(**shorter, **kwargs, min_new_tokens=24)]
    with torch._dynamo.config.patch(recompile_limit=1):
        assert torch.equal(model.generate(**_prompts(), **kwargs, compile_config=_compile_config()), expected[0])
        ours = model.generate(**shorter, **kwargs, min_new_tokens=24, compile_config=_compile_config())
    assert torch.equal(ours, expected[1])


@pytest.mark.parametrize("kind", ["decoder", "seq2seq"])
def test_beam_search_reads_spans_and_gives_the_whole_cache_search(kind, monkeypatch):
    model = decoder_variant("positions_rope") if kind == "decoder" else seq2seq_variant("positions_sinusoidal")
    monkeypatch.setattr(fast_decoding, "compiled_beam_step", lambda model, config: beam_loop.beam_step)
    inputs = _prompts(length=7)
    if kind == "seq2seq":
        inputs = {"input_ids": inputs["input_ids"] % model.config.vocab_size}
    kwargs = dict(**inputs, num_beams=3, max_new_tokens=12, pad_token_id=0, eos_token_id=[5, 7])
    kwargs.update(cache_implementation="static", return_dict_in_generate=True, output_scores=True)
    monkeypatch.setattr(cache_spans, "MIN_SPAN_STEP", 10**6)
    whole = model.generate(**kwargs, compile_config=_compile_config())
    monkeypatch.setattr(cache_spans, "MIN_SPAN_STEP", 2)
    seen = _record_read_lengths(monkeypatch)
    spans = model.generate(**kwargs, compile_config=_compile_config())
    assert torch.equal(spans.sequences, whole.sequences)
    assert_close_to_scale(spans.sequences_scores, whole.sequences_scores)
    reads = {read for filled, read in seen}
    assert len(reads) > 3 and all(filled <= read for filled, read in seen)


def test_beam_reorder_moves_the_span_only():
    cache = StaticCache(config=decoder_variant("positions_rope").config, max_cache_len=10)
    cache_spans.make_spanned(cache)
    keys = torch.randn(3, 2, 5, 8)
    for index in range(len(cache.layers)):
        cache.update(keys, keys.clone(), index)
    before = [layer.keys.clone() for layer in cache.layers]
    spans = Spans(cache)
    spans.cover(6)  # a span of 6 positions with 2-position steps
    beam_reorder.reorder(cache, torch.tensor([2, 0, 0]))
    for layer, old in zip(cache.layers, before):
        assert torch.equal(layer.keys[:, :, :6], old[[2, 0, 0], :, :6])
        assert torch.equal(layer.keys[:, :, 6:], old[:, :, 6:])  # past the span: untouched (nothing written there)
    spans.clear()
    assert all(layer.span is None for layer in cache.layers)


def test_generate_makes_its_static_caches_spanned_except_offloaded_or_initialised_ones():
    model = decoder_variant("positions_rope")
    out = model.generate(
        **_prompts(), max_new_tokens=3, pad_token_id=0, cache_implementation="static", return_dict_in_generate=True
    )
    assert all(type(layer) is SpannedLayer for layer in out.past_key_values.layers)
    seq2seq = seq2seq_variant("positions_sinusoidal")
    source = torch.randint(3, 50, (2, 5))
    out = seq2seq.generate(source, max_new_tokens=3, cache_implementation="static", return_dict_in_generate=True)
    assert all(type(layer) is SpannedLayer for layer in out.past_key_values.self_attention_cache.layers)
    assert all(type(layer) is StaticLayer for layer in out.past_key_values.cross_attention_cache.layers)

    offloaded = StaticCache(config=model.config, max_cache_len=8)
    offloaded.offloading = True  # as StaticCache(offloading=True) sets it (which needs a device with streams)
    cache_spans.make_spanned(offloaded)
    assert all(type(layer) is StaticLayer for layer in offloaded.layers)
    initialised = StaticCache(config=model.config, max_cache_len=8)
    initialised.early_initialization(batch_size=1, num_heads=2, head_dim=8, dtype=torch.float32, device="cpu")
    cache_spans.make_spanned(initialised)
    assert all(type(layer) is StaticLayer for layer in initialised.layers)


def test_whole_cache_sliding_layers_read_spans_too(monkeypatch):
    model = decoder_variant("local_global")
    monkeypatch.setattr(fast_decoding, "compiled_decoding_step", lambda model, config: decoding_loop.decoding_step)
    kwargs = dict(**_prompts(), max_new_tokens=8, pad_token_id=0, eos_token_id=None, do_sample=False)
    kwargs.update(cache_implementation="static", max_cache_len=None)
    model.config.sliding_window = 4  # a 13-position cache, at most 4 windows: its sliding layers are kept whole
    expected = model.generate(**kwargs)
    seen = _record_read_lengths(monkeypatch)
    assert torch.equal(model.generate(**kwargs, compile_config=_compile_config()), expected)
    layers = model._kept_static_cache.cache.layers
    assert any(isinstance(layer, sliding_layers.WholeCacheSlidingLayer) for layer in layers)
    assert len({read for _, read in seen}) > 2


def test_a_compiled_step_advances_every_layer_length_at_once(monkeypatch):
    """The graph of a compiled decoding step: the layers' lengths advanced by one `_foreach_add_` of them all, no
    layer's own in-place `add_`; the tokens are eager decoding's."""
    torch._dynamo.reset()
    graphs = []

    def recording_backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    model = decoder_variant("positions_rope")
    kwargs = dict(**_prompts(), max_new_tokens=6, pad_token_id=0, eos_token_id=None, cache_implementation="static")
    expected = model.generate(**kwargs)
    config = CompileConfig(backend=recording_backend, mode=None, fullgraph=True)
    config._compile_all_devices = True
    assert torch.equal(model.generate(**kwargs, compile_config=config), expected)
    (step,) = graphs
    (advance,) = [node for node in step.graph.nodes if node.target is torch._foreach_add_]
    assert [str(length) for length in advance.args[0]] == [
        f"l_past_key_values_layers_{i}_cumulative_length" for i in (0, 1)
    ]
    own = [node for node in step.graph.nodes if node.target == "add_" and "cumulative_length" in str(node.args[0])]
    assert not own, "a layer advanced its own length"


def test_an_eager_forward_with_shared_positions_makes_them_once_and_advances_lengths_once(monkeypatch):
    """Inside `shared_positions` the allocated layers write at one positions tensor, made by the first layer, and
    their lengths advance by one `_foreach_add_` when the forward ends: the keys and lengths per-layer updates give.
    A layer not yet allocated, or reading a span, keeps its own; one the forward does not write keeps its length."""
    keys = torch.randn(1, 2, 3, 4)
    layers = [cache_spans.as_spanned(StaticLayer(max_cache_len=8)) for _ in range(5)]
    for layer in [*layers[:3], layers[4]]:
        layer.update(keys, keys)  # allocated, length 3 (the fourth: a new layer)
    layers[2].span = torch.empty(8, dtype=torch.uint8)
    expected = [cache_spans.as_spanned(StaticLayer(max_cache_len=8)) for _ in range(2)]
    for layer in expected:
        layer.update(keys, keys)
        layer.update(keys[:, :, :2] * 2, keys[:, :, :2] * 2)
    aranges, advances = [], []
    arange, foreach_add = torch.arange, torch._foreach_add_
    monkeypatch.setattr(torch, "arange", lambda *a, **k: aranges.append(a) or arange(*a, **k))
    monkeypatch.setattr(
        torch, "_foreach_add_", lambda tensors, n: advances.append((len(tensors), n)) or foreach_add(tensors, n)
    )
    with cache_spans.shared_positions(_Layers(layers)):
        for layer in layers[:2]:
            layer.update(keys[:, :, :2] * 2, keys[:, :, :2] * 2)
        assert [int(layer.cumulative_length) for layer in layers[:2]] == [3, 3]  # advanced after the forward
    assert (len(aranges), advances) == (1, [(2, 2)])
    for layer, reference in zip(layers[:2], expected):
        assert int(layer.cumulative_length) == 5 and layer.shared is None
        assert torch.equal(layer.keys, reference.keys) and torch.equal(layer.values, reference.values)
    assert layers[2].shared is None and layers[3].shared is None and not layers[3].is_initialized
    assert layers[4].shared is None and int(layers[4].cumulative_length) == 3  # allocated, not written: as it was


def test_a_forward_that_raises_advances_no_length():
    keys = torch.randn(1, 2, 3, 4)
    layers = [cache_spans.as_spanned(StaticLayer(max_cache_len=8)) for _ in range(2)]
    for layer in layers:
        layer.update(keys, keys)
    with pytest.raises(RuntimeError, match="stopped"), cache_spans.shared_positions(_Layers(layers)):
        layers[0].update(keys, keys)
        raise RuntimeError("stopped")
    assert [int(layer.cumulative_length) for layer in layers] == [3, 3]
    assert all(layer.shared is None for layer in layers)


@pytest.mark.parametrize("num_beams", [1, 2], ids=["greedy", "beam"])
def test_the_loops_prefill_on_a_kept_cache_makes_its_positions_once(num_beams, monkeypatch):
    """The compiled loops' eager prefill on the cache kept from the last call: one positions tensor for every layer
    (no `arange` per layer), the tokens of dynamic-cache decoding, and the next call's too."""
    model = decoder_variant("positions_rope")
    kwargs = dict(**_prompts(), max_new_tokens=5, pad_token_id=0, eos_token_id=None, num_beams=num_beams)
    expected = model.generate(**kwargs)
    static = dict(kwargs, cache_implementation="static", compile_config=_compile_config())
    assert torch.equal(model.generate(**static), expected)  # a new cache: allocated in its prefill
    made = []
    positions = SpannedLayer._positions

    def spy(layer, tokens):
        result = positions(layer, tokens)
        made.append((layer.shared is not None, id(result)))
        return result

    monkeypatch.setattr(SpannedLayer, "_positions", spy)
    original_prefill = decoding_loop.prefill if num_beams == 1 else beam_loop.prefill
    prefill_calls = []

    def prefill(*args, **kwargs):
        made.clear()
        outputs = original_prefill(*args, **kwargs)
        prefill_calls.append(list(made))
        return outputs

    monkeypatch.setattr(decoding_loop if num_beams == 1 else beam_loop, "prefill", prefill)
    for _ in range(2):
        assert torch.equal(model.generate(**static), expected)
    for made_in_prefill in prefill_calls:
        assert len(made_in_prefill) == model.config.num_hidden_layers
        assert all(shared for shared, _ in made_in_prefill) and len({ident for _, ident in made_in_prefill}) == 1
