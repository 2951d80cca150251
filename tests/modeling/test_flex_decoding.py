"""The decoding step's self-attention through FlexAttention (modeling/flex_decoding.py): the same output as SDPA for
boolean and additive masks, grouped and plain heads, a mask shared by the batch; used only where it applies; and a
compiled greedy generation with it gives the tokens of eager decoding, its traced step holding FlexAttention."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from transformers import CompileConfig

from archlab import DecoderForCausalLM, Seq2SeqForConditionalGeneration
from archlab.modeling import flex_decoding
from archlab.modeling.attention import one_token_grouped_sdpa
from archlab.modeling.flex_decoding import flex_applies, flex_decode_attention

from helpers import tiny_decoder_config, tiny_seq2seq_config


def _unfused(function, *args, **kwargs):
    with warnings.catch_warnings():  # eager FlexAttention says it is the unfused reference, which is what we want here
        warnings.simplefilter("ignore", UserWarning)
        return function(*args, **kwargs)


@pytest.mark.parametrize("heads, kv_heads", [(8, 2), (4, 4)])
@pytest.mark.parametrize("additive", [False, True])
@pytest.mark.parametrize("mask_batch", [3, 1])
def test_flex_equals_sdpa(heads, kv_heads, additive, mask_batch):
    g = torch.Generator().manual_seed(0)
    batch, keys, dim = 3, 21, 16
    query = torch.randn(batch, heads, 1, dim, generator=g)
    key, value = (torch.randn(batch, kv_heads, keys, dim, generator=g) for _ in range(2))
    mask = torch.rand(mask_batch, 1, 1, keys, generator=g) > 0.4
    mask[..., -1] = True  # the step's own token: never every key masked
    if additive:
        mask = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    module = nn.Module()
    expected, _ = one_token_grouped_sdpa(module, query, key, value, mask, scaling=0.3)
    output, weights = _unfused(flex_decode_attention, module, query, key, value, mask, scaling=0.3)
    assert weights is None and output.shape == (batch, 1, heads, dim)
    torch.testing.assert_close(output, expected, rtol=1e-5, atol=1e-5)


def _attention(**overrides):
    model = DecoderForCausalLM(tiny_decoder_config(head_dim=16, **overrides))
    return model.model.layers[0].self_attn


def test_flex_applies_only_to_compiled_one_query_steps_on_the_listed_devices(monkeypatch):
    attention = _attention()
    query, mask = torch.zeros(2, 4, 1, 16), torch.ones(2, 1, 1, 5, dtype=torch.bool)
    monkeypatch.setattr(flex_decoding, "FLEX_DECODING_DEVICES", ("cpu",))
    assert not flex_applies(attention, query, mask, {})  # eager: SDPA (eager FlexAttention is unfused)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert flex_applies(attention, query, mask, {})
    assert not flex_applies(attention, torch.zeros(2, 4, 3, 16), torch.ones(2, 1, 3, 5, dtype=torch.bool), {})
    assert not flex_applies(attention, query, torch.ones(2, 4, 1, 5, dtype=torch.bool), {})  # a mask per head
    assert not flex_applies(attention, query, None, {})
    assert not flex_applies(attention, query, mask, {"position_bias": torch.zeros(2, 4, 1, 5)})  # ALiBi, T5
    assert not flex_applies(_attention(attn_logit_softcapping=30.0), query, mask, {})
    sliding = _attention(sliding_window=4, layer_types=["sliding_attention", "full_attention"])
    assert sliding.sliding_window == 4 and not flex_applies(sliding, query, mask, {})  # (module docstring)
    assert not flex_applies(attention, torch.zeros(2, 4, 1, 24), mask, {})  # a head size its kernels do not take
    monkeypatch.setattr(flex_decoding, "FLEX_DECODING_DEVICES", ())
    assert not flex_applies(attention, query, mask, {})


def _graph_recorder(graphs: list[str]):
    """A dynamo backend that keeps each traced graph's code in `graphs` and runs the graph as traced (no code
    generated). A function, not an object: CompileConfig.to_dict deep-copies its backend."""

    def backend(graph_module, example_inputs):
        graphs.append(graph_module.code)
        return graph_module.forward

    return backend


def _compiled_generate(model, batch, recorder, **kwargs):
    config = CompileConfig(fullgraph=True, backend=recorder, mode="default")
    config._compile_all_devices = True  # generate compiles only on accelerators unless told to (its testing hook)
    return _unfused(model.generate, **batch, **kwargs, compile_config=config)


@pytest.mark.parametrize("kind", ["decoder", "seq2seq"])
def test_compiled_decoding_through_flex_gives_eager_tokens(kind, monkeypatch):
    torch._dynamo.reset()
    torch.manual_seed(0)
    if kind == "decoder":  # heads of 16: FlexAttention's smallest head size
        model = DecoderForCausalLM(tiny_decoder_config(head_dim=16)).eval()
    else:
        model = Seq2SeqForConditionalGeneration(tiny_seq2seq_config(d_model=64)).eval()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, model.config.vocab_size, (2, 10), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # a left-padded row (a padded source for the encoder-decoder)
    batch = {"input_ids": ids, "attention_mask": mask}
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, cache_implementation="static")
    if kind == "seq2seq":
        kwargs["num_beams"] = 3  # the compiled beam-search step (beam_loop.py)
    expected = model.generate(**batch, **kwargs, disable_compile=True)
    monkeypatch.setattr(flex_decoding, "FLEX_DECODING_DEVICES", ("cpu",))
    graphs = []
    output = _compiled_generate(model, batch, _graph_recorder(graphs), **kwargs)
    assert graphs and all("flex_attention" in graph for graph in graphs)
    assert torch.equal(output, expected)
