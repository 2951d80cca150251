"""The compiled prefill's prompts padded to buckets (modeling/prefill_buckets.py), so a GPU can replay one CUDA graph
per bucket: the bucket rule; for every decoder variant, generate's tokens with padded prefills equal eager
decoding's and the variants that cannot be padded are not; the padded forward's logits, cache contents and lengths
equal the unpadded forward's; what is never padded. On CPU the devices' list is opened to it and the forward is
traced by dynamo's eager backend (no CUDA graphs here)."""

from __future__ import annotations

import pytest
import torch
from transformers import CompileConfig, StaticCache

from archlab import DecoderForCausalLM
from archlab.modeling import compiled_prefill, prefill_buckets
from archlab.modeling.cache_names import with_cache
from archlab.modeling.cache_spans import make_spanned, self_attention_layers
from archlab.modeling.prefill_buckets import bucket_length, pad_blocker

from helpers import (
    DECODER_VARIANTS,
    NO_STATIC_CACHE,
    assert_close_to_scale,
    decoder_variant,
    randomised,
    tiny_decoder_config,
)


@pytest.fixture
def padded_on_cpu(monkeypatch):
    monkeypatch.setattr(prefill_buckets, "PADDED_PREFILL_DEVICES", ("cpu",))
    monkeypatch.setattr(prefill_buckets, "MIN_BUCKET", 8)  # pads at the tiny prompts' lengths


def _compile_config() -> CompileConfig:
    config = CompileConfig(backend="eager", mode=None, fullgraph=True)
    config._compile_all_devices = True
    return config


def _prompts(length: int, seed: int) -> dict[str, torch.Tensor]:
    """Two prompts of `length` tokens, the first left-padded by 2."""
    ids = torch.randint(3, 97, (2, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    ids[0, :2] = 0
    return {"input_ids": ids, "attention_mask": mask}


def test_the_bucket_rule():
    assert [bucket_length(n, 10_000) for n in (1, 64, 65, 130, 300, 2000, 2048, 2049, 5000)] == [
        64, 64, 128, 192, 320, 2048, 2048, 2560, 5120,
    ]  # fmt: skip
    assert bucket_length(130, 150) == 150 and bucket_length(130, 100) == 130  # the cache's length bounds it
    assert bucket_length(50, 1000, avoid=64) == 128 and bucket_length(50, 100, avoid=64) == 64  # off the batch size
    lengths = range(64, 4097)
    assert len({bucket_length(n, 10_000) for n in lengths}) <= 4 * 6  # four buckets per doubling at most
    assert all(bucket_length(n, 10_000) - n <= n // 4 + 64 for n in lengths)


def _spy_on_pads(monkeypatch) -> list[int | None]:
    seen = []
    padded = prefill_buckets.padded_prefill_inputs

    def spy(*args):
        result = padded(*args)
        seen.append(None if result is None else result[1])
        return result

    monkeypatch.setattr(compiled_prefill, "padded_prefill_inputs", spy)
    return seen


# the fast suite's share of the variants (each ~4 s): positions by RoPE and by bias, a prefix, experts, and one whose
# sliding layers keep it unpadded; CI's slow run takes the others
FAST_VARIANTS = {"positions_rope", "positions_alibi", "prefix_lm", "moe", "local_global"}
# sliding layers kept whole (a window of 8: the 22-position cache is under 4 windows), padded like full ones
SLIDING_KEPT_WHOLE = dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"])


@pytest.mark.parametrize(
    "name",
    [
        name if name in FAST_VARIANTS else pytest.param(name, marks=pytest.mark.slow)
        for name in sorted(set(DECODER_VARIANTS) - NO_STATIC_CACHE)
    ]
    + ["sliding_kept_whole"],
)
def test_padded_prefills_give_eager_tokens(name, padded_on_cpu, monkeypatch):
    """Prompts of 6, 9 and 3 tokens padded to 8, 16 and 8 in a kept cache of 22 positions: generate's tokens are
    eager decoding's, for every decoder variant, compiled once; those `pad_blocker` refuses run unpadded. (The
    variant "sliding_kept_whole": local layers of a window of 8, which the 22-position cache keeps whole.)"""
    torch._dynamo.reset()
    if name == "sliding_kept_whole":
        model = randomised(DecoderForCausalLM(tiny_decoder_config(**SLIDING_KEPT_WHOLE)))
    else:
        model = decoder_variant(name)
    common = dict(do_sample=False, pad_token_id=0, eos_token_id=None, cache_implementation="static")
    calls = [(_prompts(length, seed), 22 - length) for seed, length in enumerate((6, 9, 3))]
    expected = [model.generate(**p, **common, max_new_tokens=n, disable_compile=True) for p, n in calls]
    seen = _spy_on_pads(monkeypatch)
    for index, ((prompts, new), tokens) in enumerate(zip(calls, expected)):
        # one graph for every bucket (8 is also the cache's head_dim here: no duck sizing to specialise it); an
        # unpadded sliding window's mask spans the prompt until it is a window long (one more graph past it)
        with torch._dynamo.config.patch(error_on_recompile=index >= 1 and seen[0] is not None):
            ours = model.generate(
                **prompts, **common, max_new_tokens=new, compile_config=_compile_config(), compile_prefill=True
            )
        assert torch.equal(ours, tokens)
    blocker = pad_blocker(model, model._kept_static_cache.cache)
    assert seen == ([None] * 3 if blocker else [2, 7, 5]), blocker


@pytest.mark.parametrize("name", ["positions_rope", "positions_alibi", "learned_positions_from_mask", "moe"])
def test_a_padded_forward_equals_the_prompts_own(name, padded_on_cpu):
    """The forward of a 5-token prompt padded to 8: the last position's logits, the prompt's keys and values in the
    cache and every layer's length are those of the forward of the prompt alone; the slots after it hold the pads."""
    model = decoder_variant(name)
    cache = StaticCache(config=model.config, max_cache_len=12)
    make_spanned(cache)
    prompts = _prompts(5, seed=3)

    def prefill(forward):
        cache.reset()
        with torch.no_grad():
            outputs = forward(**prompts, **with_cache(cache), use_cache=True, logits_to_keep=1, return_dict=True)
        layers = self_attention_layers(cache)
        return outputs.logits, [
            (layer.keys.clone(), layer.values.clone(), int(layer.cumulative_length)) for layer in layers
        ]

    alone = prefill(model.forward)  # (allocates the cache)
    padded = prefill(compiled_prefill.bucketed_forward(model, _compile_config(), cache))
    assert padded[0].shape == alone[0].shape == (2, 1, model.config.vocab_size)
    assert_close_to_scale(padded[0], alone[0])
    real = prompts["attention_mask"].bool()  # (a left pad's own keys are whatever its masked query row gave)
    for (keys, values, length), (own_keys, own_values, own_length) in zip(padded[1], alone[1]):
        assert length == own_length == 5
        assert_close_to_scale(keys[:, :, :5].transpose(1, 2)[real], own_keys[:, :, :5].transpose(1, 2)[real])
        assert_close_to_scale(values[:, :, :5].transpose(1, 2)[real], own_values[:, :, :5].transpose(1, 2)[real])
        assert keys[:, :, 5:8].abs().sum() > 0 and own_keys[:, :, 5:8].abs().sum() == 0  # the pads' slots


def test_what_is_never_padded(padded_on_cpu, monkeypatch):
    model = decoder_variant("positions_rope")
    cache = StaticCache(config=model.config, max_cache_len=12)
    make_spanned(cache)
    assert "spanned static layers" in pad_blocker(model, cache)  # (not yet allocated)
    model(**_prompts(5, seed=1), **with_cache(cache), use_cache=True)
    assert pad_blocker(model, cache) is None
    kwargs = dict(**_prompts(5, seed=1), **with_cache(cache), use_cache=True, logits_to_keep=1)
    assert prefill_buckets.padded_prefill_inputs(model, cache, kwargs)[1] == 3
    for extra in ({"inputs_embeds": torch.zeros(2, 5, 32)}, {"output_hidden_states": True}, {"logits_to_keep": 0}):
        assert prefill_buckets.padded_prefill_inputs(model, cache, {**kwargs, **extra}) is None, extra
    longrope = decoder_variant("rope_longrope")
    assert "sequence's length" in pad_blocker(longrope, cache)
    monkeypatch.setattr(prefill_buckets, "PADDED_PREFILL_DEVICES", ("cuda",))
    assert "not on cuda" in pad_blocker(model, cache)


def test_a_batch_as_large_as_the_bucket_compiles_once(padded_on_cpu):
    """Eight prompts of 6 tokens, then of 11: the first bucket would be 8, the batch size, and goes to 16 (duck
    sizing would give both one symbol, and the next length would fail the graph's guard and compile again)."""
    torch._dynamo.reset()
    model = decoder_variant("positions_rope")
    common = dict(do_sample=False, pad_token_id=0, eos_token_id=None, cache_implementation="static")
    calls = []
    for seed, length in enumerate((6, 11)):
        ids = torch.randint(3, 97, (8, length), generator=torch.Generator().manual_seed(seed))
        calls.append(({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, 22 - length))
    expected = [model.generate(**p, **common, max_new_tokens=n, disable_compile=True) for p, n in calls]
    for index, ((prompts, new), tokens) in enumerate(zip(calls, expected)):
        with torch._dynamo.config.patch(error_on_recompile=index >= 1):
            ours = model.generate(
                **prompts, **common, max_new_tokens=new, compile_config=_compile_config(), compile_prefill=True
            )
        assert torch.equal(ours, tokens)


def _recording_compile_config() -> tuple[list, CompileConfig]:
    """A fresh dynamo state and a compile config whose backend keeps every traced graph (run as traced) in the list."""
    torch._dynamo.reset()
    graphs = []

    def recording_backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    config = CompileConfig(backend=recording_backend, mode=None, fullgraph=True)
    config._compile_all_devices = True
    return graphs, config


def _prefill_graphs(graphs: list) -> list:
    """The recorded graphs that take the prompt's ids (the prefill's, not the decoding step's)."""
    return [graph for graph in graphs if any(node.name == "l_input_ids_" for node in graph.graph.nodes)]


def test_another_batch_size_does_not_compile_the_prefill_again(padded_on_cpu):
    """The batch stays a dynamic size of the prefill's graph: a new batch size (a new kept cache, filled eagerly
    first) reuses the compiled prefill (the decoding step, static, compiles for it)."""
    graphs, config = _recording_compile_config()
    model = decoder_variant("positions_rope")
    common = dict(do_sample=False, pad_token_id=0, eos_token_id=None, cache_implementation="static")
    for batch in (2, 2, 3, 3):
        ids = torch.randint(3, 97, (batch, 6), generator=torch.Generator().manual_seed(batch))
        expected = model.generate(ids, **common, max_new_tokens=8, disable_compile=True)
        assert torch.equal(
            model.generate(ids, **common, max_new_tokens=8, compile_config=config, compile_prefill=True), expected
        )
    prefills = _prefill_graphs(graphs)
    assert len(prefills) == 1, f"{len(prefills)} prefill graphs"


def test_prompts_with_and_without_padding_compile_one_prefill_each(padded_on_cpu):
    """Over the empty static cache a prompt without padding gets no mask from transformers (SDPA's `is_causal`, the
    flash kernel on a GPU), a left-padded one a mask tensor: one prefill graph each, whatever the order and length
    of the prompts after them (the first GPU run of the bucket test recompiled at the first prompt without
    padding), and eager decoding's tokens."""
    graphs, config = _recording_compile_config()
    model = decoder_variant("positions_rope")
    common = dict(do_sample=False, pad_token_id=0, eos_token_id=None, cache_implementation="static")
    calls = [(_prompts(length, seed), 22 - length) for seed, length in enumerate((6, 6, 9, 5, 3, 7))]
    for index in (1, 3, 5):  # no padding in these
        calls[index][0]["attention_mask"][:] = 1
    for prompts, new in calls:
        expected = model.generate(**prompts, **common, max_new_tokens=new, disable_compile=True)
        ours = model.generate(**prompts, **common, max_new_tokens=new, compile_config=config, compile_prefill=True)
        assert torch.equal(ours, expected)
    prefills = _prefill_graphs(graphs)
    assert len(prefills) == 2, f"{len(prefills)} prefill graphs"
