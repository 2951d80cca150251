"""The compiled loops' prefill, compiled whole with dynamic shapes (modeling/compiled_prefill.py): the tokens of eager
decoding, one graph for every prompt length (no recompile), and eager where it must be (the first call of a new
cache, an encoder-decoder, chunked prefill). Traced by dynamo's eager backend on CPU (transformers' testing hook
`_compile_all_devices`), as the decoding steps' tests do."""

from __future__ import annotations

import pytest
import torch
from transformers import CompileConfig

from archlab import DecoderForCausalLM
from archlab.modeling import compiled_prefill

from helpers import DECODER_VARIANTS, decoder_variant, randomised, seq2seq_variant, tiny_decoder_config


def _compile_config() -> CompileConfig:
    config = CompileConfig(backend="eager", mode=None, fullgraph=True)
    config._compile_all_devices = True
    return config


def _prompts(length: int, vocab: int = 97, seed: int = 1) -> dict[str, torch.Tensor]:
    """Two prompts of `length` tokens, the first left-padded by 2."""
    ids = torch.randint(3, vocab, (2, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    ids[0, :2] = 0
    return {"input_ids": ids, "attention_mask": mask}


def _spy_on_prefills(model, monkeypatch) -> list[bool]:
    """For each prefill of `model` from now on: whether it ran through the compiled forward."""
    ran = []
    prefill = type(model)._prefill

    def spy(self, *args, **kwargs):
        ran.append(self.__dict__.get("forward") is not None)
        return prefill(self, *args, **kwargs)

    monkeypatch.setattr(type(model), "_prefill", spy)
    return ran


@pytest.mark.parametrize("name", ["positions_rope", "positions_alibi", "moe"])
def test_the_compiled_prefill_gives_eager_tokens_for_every_prompt_length_without_recompiling(name, monkeypatch):
    torch._dynamo.reset()
    model = decoder_variant(name)
    common = dict(do_sample=False, pad_token_id=0, eos_token_id=None, cache_implementation="static")
    # the same cache length (prompt + new tokens) every call: generate keeps the cache, the prefill's length varies
    calls = [(_prompts(6), 10), (_prompts(6, seed=2), 10), (_prompts(9, seed=3), 7), (_prompts(4, seed=4), 12)]
    expected = [model.generate(**p, **common, max_new_tokens=n, disable_compile=True) for p, n in calls]
    ran = _spy_on_prefills(model, monkeypatch)
    for index, (prompts, new) in enumerate(calls):
        with torch._dynamo.config.patch(error_on_recompile=index >= 1):  # dynamic lengths from the first call
            ours = model.generate(
                **prompts, **common, max_new_tokens=new, compile_config=_compile_config(), compile_prefill=True
            )
        assert torch.equal(ours, expected[index]), index
    assert ran == [True] * 4  # the eager calls above allocated the kept cache
    assert "_compiled_prefill" in model.__dict__


def test_a_new_cache_is_filled_eagerly_then_prefills_compile(monkeypatch):
    """The first prefill into a new cache runs eagerly: the cache allocates its tensors inside its first update. The
    decoding step compiled after it does not compile again at the next call, whose prefill is compiled (the cache's
    head sizes were marked static by the compiled prefill only: the step failed its guard on the marks)."""
    torch._dynamo.reset()
    model = decoder_variant("positions_rope")
    ran = _spy_on_prefills(model, monkeypatch)
    kwargs = dict(do_sample=False, pad_token_id=0, eos_token_id=None, max_new_tokens=6, cache_implementation="static")
    kwargs |= dict(compile_config=_compile_config(), compile_prefill=True)
    first = model.generate(**_prompts(6), **kwargs)
    with torch._dynamo.config.patch(error_on_recompile=True):
        second = model.generate(**_prompts(6), **kwargs)
    assert ran == [False, True] and torch.equal(first, second)
    assert not getattr(model.generation_config, "compile_prefill", False)  # a keyword of one call, not kept
    config = model.generation_config
    config.compile_prefill = True  # or an attribute of the model's generation config
    third = model.generate(**_prompts(6), **dict(kwargs, compile_prefill=None))
    assert ran == [False, True, True] and torch.equal(third, first)


def test_the_prefill_is_compiled_only_when_asked_for(monkeypatch):
    """Compiling the prefill costs about a minute once (H100): by default generate's compiled path leaves it eager;
    `compile_prefill` must be a bool, and a wrong value is named before anything runs."""
    model = decoder_variant("positions_rope")
    ran = _spy_on_prefills(model, monkeypatch)
    kwargs = dict(do_sample=False, pad_token_id=0, eos_token_id=None, max_new_tokens=4, cache_implementation="static")
    for _ in range(2):
        model.generate(**_prompts(6), **kwargs, compile_config=_compile_config())
    assert ran == [False, False] and "_compiled_prefill" not in model.__dict__
    with pytest.raises(ValueError, match=r"`compile_prefill` must be True or False, got 'yes'"):
        model.generate(**_prompts(6), **kwargs, compile_prefill="yes")
    assert ran == [False, False]


def test_where_the_prefill_stays_eager():
    model = seq2seq_variant("positions_sinusoidal")
    config = model.generation_config
    assert "not asked for" in compiled_prefill.prefill_blocker(model, config, {})
    config.compile_prefill = True
    assert "encoder-decoder" in compiled_prefill.prefill_blocker(model, config, {})
    decoder = decoder_variant("positions_rope")
    config = decoder.generation_config
    config.compile_prefill = True
    assert "allocates its tensors" in compiled_prefill.prefill_blocker(decoder, config, {})
    config.prefill_chunk_size = 4
    assert "chunked prefill" in compiled_prefill.prefill_blocker(decoder, config, {})


def _recording_config(graphs: list) -> CompileConfig:
    """Dynamo's traced graphs kept in `graphs`, run as traced (no code generated)."""

    def backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    config = CompileConfig(backend=backend, mode=None, fullgraph=True)
    config._compile_all_devices = True
    return config


def _subgraph_calls(graph_module) -> list[str]:
    """The nested compile regions a traced graph calls, by the name of the subgraph each call runs."""
    return [
        node.args[0].target
        for node in graph_module.graph.nodes
        if node.op == "call_function" and "invoke_subgraph" in str(node.target)
    ]


@pytest.mark.parametrize("name, regions", [("positions_rope", True), ("positions_alibi", True), ("moe", False)])
def test_the_prefill_compiles_the_decoder_blocks_as_one_nested_region(name, regions, monkeypatch):
    """The prefill's graph calls one compiled region for every layer after the first (`nested_block_regions`: each
    later layer's trace matches the second layer's installed subgraph, compiled once)
    where the layers were unrolled; a mixture of experts keeps them unrolled. The tokens are eager decoding's, and
    the block classes get their own forward back after each call."""
    torch._dynamo.reset()
    model = randomised(DecoderForCausalLM(tiny_decoder_config(**{**DECODER_VARIANTS[name], "num_hidden_layers": 4})))
    classes = {type(layer) for layer in model.model.layers}
    forwards = {cls: cls.forward for cls in classes}
    kwargs = dict(do_sample=False, pad_token_id=0, eos_token_id=None, max_new_tokens=5, cache_implementation="static")
    expected = model.generate(**_prompts(6), **kwargs, disable_compile=True)
    graphs = []
    config = _recording_config(graphs)
    model.generate(**_prompts(6), **kwargs, compile_config=config, compile_prefill=True)  # allocates the cache
    ours = model.generate(**_prompts(6), **kwargs, compile_config=config, compile_prefill=True)
    assert torch.equal(ours, expected)
    assert {cls: cls.forward for cls in classes} == forwards
    (prefill,) = [graph for graph in graphs if any(node.name == "l_input_ids_" for node in graph.graph.nodes)]
    calls = _subgraph_calls(prefill)
    if regions:  # the first layer's own subgraph is inlined back by torch 2.13, called as a region by 2.11
        layers = model.config.num_hidden_layers
        assert len(calls) in (layers - 1, layers) and len(set(calls[-(layers - 1) :])) == 1, calls
    else:
        assert calls == []
    monkeypatch.setattr(compiled_prefill, "NESTED_REGIONS", False)
    assert compiled_prefill.region_block_classes(model) == []
