"""beam_reorder.py: beam search's cache reorder from a spare buffer equals the in-place reorder, the beam searches
that use spares give the in-place searches' outputs (decoder and encoder-decoder, compiled as one graph whose
inputs swap roles without a recompile), spares are kept for the next call, and on CUDA they are taken only where
they fit in the free memory. (Inductor and CUDA graphs: tests/integration/test_compile.py, test_fast_decoding_gpu.py.)
"""

from __future__ import annotations

import pytest
import torch
from transformers import CompileConfig, StaticCache

from archlab.modeling import beam_loop, beam_reorder, cache_spans, fast_decoding
from archlab.modeling.beam_reorder import Spares
from archlab.modeling.cache_spans import Spans

from helpers import assert_close_to_scale, decoder_variant, seq2seq_variant


def _compile_config() -> CompileConfig:
    config = CompileConfig(backend="eager", mode=None, fullgraph=True)
    config._compile_all_devices = True  # transformers' testing hook: compile on CPU too
    return config


def _filled_cache(batch: int = 3, positions: int = 5) -> StaticCache:
    cache = StaticCache(config=decoder_variant("positions_rope").config, max_cache_len=10)
    cache_spans.make_spanned(cache)
    generator = torch.Generator().manual_seed(0)
    for index in range(len(cache.layers)):
        keys = torch.randn(batch, 2, positions, 8, generator=generator)
        cache.update(keys, torch.randn(keys.shape, generator=generator), index)
    return cache


def test_the_reorder_from_spares_equals_the_reorder_in_place():
    beams = [torch.tensor([2, 0, 0]), torch.tensor([1, 2, 1]), torch.tensor([0, 0, 2])]
    in_place, spared = _filled_cache(), _filled_cache()
    spans = [Spans(cache) for cache in (in_place, spared)]
    with Spares(spared) as spares:
        assert spares.layers and all(layer.spare is not None for layer in spared.layers)
        for beam_idx in beams:
            for span in spans:
                span.cover(6)
            beam_reorder.reorder(in_place, beam_idx)
            spares.swap()
            beam_reorder.reorder(spared, beam_idx)
            for ours, theirs in zip(spared.layers, in_place.layers):
                assert torch.equal(ours.keys[:, :, :6], theirs.keys[:, :, :6])
                assert torch.equal(ours.values[:, :, :6], theirs.values[:, :, :6])
    assert all(layer.spare is None for layer in spared.layers)  # outside: reorders in place
    kept = [layer._spares[0].data_ptr() for layer in spared.layers]
    with Spares(spared):  # the next search: the same spare tensors
        assert [layer.spare[0].data_ptr() for layer in spared.layers] == kept


def test_no_spares_when_switched_off_or_for_plain_static_layers(monkeypatch):
    plain = StaticCache(config=decoder_variant("positions_rope").config, max_cache_len=10)
    plain.update(torch.randn(3, 2, 5, 8), torch.randn(3, 2, 5, 8), 0)
    assert not Spares(plain).layers
    monkeypatch.setattr(beam_reorder, "DOUBLE_BUFFER", False)
    assert not Spares(_filled_cache()).layers


def test_spares_on_cuda_only_within_a_share_of_the_free_memory(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (4000, 8000))
    cuda = torch.device("cuda")
    assert beam_reorder.fits(1000, cuda) and not beam_reorder.fits(1001, cuda)  # a quarter of 4000 free bytes
    assert beam_reorder.fits(10**12, torch.device("cpu"))


@pytest.mark.parametrize("kind", ["decoder", "seq2seq"])
def test_beam_search_with_spares_gives_the_in_place_search(kind, monkeypatch):
    """The compiled step (dynamo's eager backend, fullgraph) with spares swapping every step: the same sequences and
    scores as reordering in place, one graph for both roles of the two buffers, and the returned cache's rows
    follow the last choice as the in-place cache's do."""
    model = decoder_variant("positions_rope") if kind == "decoder" else seq2seq_variant("positions_sinusoidal")
    ids = torch.randint(3, model.config.vocab_size, (3, 7), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    if kind == "decoder":
        ids[0, :2], mask[0, :2] = 0, 0
    kwargs = dict(input_ids=ids, attention_mask=mask, num_beams=3, max_new_tokens=12, pad_token_id=0)
    kwargs.update(eos_token_id=[5, 7], cache_implementation="static", return_dict_in_generate=True, output_scores=True)
    monkeypatch.setattr(beam_reorder, "DOUBLE_BUFFER", False)
    in_place = model.generate(**kwargs, compile_config=_compile_config())
    model.release_decoding_memory()
    monkeypatch.setattr(beam_reorder, "DOUBLE_BUFFER", True)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=1):
        ours = model.generate(**kwargs, compile_config=_compile_config())
        again = model.generate(**dict(kwargs, return_dict_in_generate=False), compile_config=_compile_config())
    assert torch.equal(ours.sequences, in_place.sequences) and torch.equal(again, in_place.sequences)
    assert_close_to_scale(ours.sequences_scores, in_place.sequences_scores)
    layers = cache_spans.self_attention_layers(ours.past_key_values)
    expected = cache_spans.self_attention_layers(in_place.past_key_values)
    filled = int(layers[0].cumulative_length)
    assert filled == int(expected[0].cumulative_length)
    for layer, reference in zip(layers, expected):
        assert getattr(layer, "_spares", None) is not None
        assert_close_to_scale(layer.keys[:, :, :filled], reference.keys[:, :, :filled])


def test_the_beam_step_reads_spares_only_inside_a_search(monkeypatch):
    """Outside `beam_search` (transformers' loop on a spanned cache, a user's reorder) no layer has a spare."""
    model = seq2seq_variant("positions_sinusoidal")
    monkeypatch.setattr(fast_decoding, "compiled_beam_step", lambda model, config: beam_loop.beam_step)
    source = torch.randint(3, 50, (2, 5), generator=torch.Generator().manual_seed(3))
    kwargs = dict(num_beams=2, max_new_tokens=4, cache_implementation="static", return_dict_in_generate=True)
    out = model.generate(source, **kwargs, compile_config=_compile_config())
    layers = cache_spans.self_attention_layers(out.past_key_values)
    assert all(layer.spare is None and layer._spares is not None for layer in layers)
