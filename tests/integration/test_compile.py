"""torch.compile: the decoder forward compiles with `fullgraph=True` (no graph break anywhere in the model), a compiled
training step gives eager's loss and gradients, and `generate` with a StaticCache and a compiled decoding step gives
eager's tokens: the dense decoder, the mixture of experts, and seq2seq beam search (fast_decoding.py compiles its
steps); every catalogue variant's decoding step traces without a graph break. Cold compiles cost about a minute each
on 2 CPU cores, hence few tests, all `slow`; the tracing checks use dynamo's "eager" backend (no code generation).
"""

from __future__ import annotations

import re

import pytest
import torch
from transformers import CompileConfig

from archlab import DecoderForCausalLM, Seq2SeqForConditionalGeneration

from helpers import (
    DECODER_VARIANTS,
    NO_STATIC_CACHE,
    SEQ2SEQ_VARIANTS,
    assert_close_to_scale,
    decoder_variant,
    randomised,
    seq2seq_variant,
    tiny_decoder_config,
    tiny_seq2seq_config,
)

pytestmark = pytest.mark.slow


def _batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, 97, (2, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # a left-padded row: the mask path is compiled too
    return {"input_ids": ids, "attention_mask": mask}


def _pair(**overrides) -> tuple[DecoderForCausalLM, DecoderForCausalLM]:
    eager = DecoderForCausalLM(tiny_decoder_config(**overrides))
    compiled = DecoderForCausalLM(tiny_decoder_config(**overrides))
    compiled.load_state_dict(eager.state_dict())
    return eager, compiled


def test_forward_compiles_fullgraph():
    torch._dynamo.reset()
    eager, model = _pair()
    eager.eval(), model.eval()
    compiled = torch.compile(model, fullgraph=True)  # raises on any graph break
    batch = _batch()
    with torch.no_grad():
        torch.testing.assert_close(compiled(**batch).logits, eager(**batch).logits, rtol=1e-5, atol=1e-5)


def test_compiled_training_step_matches_eager():
    """Forward, chunked LM loss (3 chunks of 8 tokens) and backward in one compiled graph; then one AdamW step."""
    torch._dynamo.reset()
    eager, model = _pair(lm_loss_chunk_size=8)
    eager.train(), model.train()
    compiled = torch.compile(model, fullgraph=True)
    batch = _batch()
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    initial = [p.detach().clone() for p in eager.parameters()]  # both models start from these weights
    losses = []
    for m, run in ((eager, eager), (model, compiled)):
        optimizer = torch.optim.AdamW(m.parameters(), lr=1e-2)
        loss = run(**batch, labels=labels).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-5)
    for (name, p_eager), p_compiled, p_initial in zip(eager.named_parameters(), model.parameters(), initial):
        torch.testing.assert_close(p_compiled.grad, p_eager.grad, rtol=1e-4, atol=1e-6, msg=name)
        # AdamW's first step is about lr x sign(grad) even for a gradient at rounding level: compare the steps,
        # relative to their size, not the weights to a fixed atol
        assert_close_to_scale(p_compiled - p_initial, p_eager - p_initial, rtol=1e-3, msg=name)


def test_static_cache_generation_compiles():
    """`cache_implementation="static"` + a `CompileConfig`: greedy decoding compiles its whole step with inductor
    (decoding_loop.py) and gives eager's tokens, with rows ending at end-of-sequence tokens after a minimum length;
    the spans of the cache it reads (cache_spans.py; 2-position steps in the tests) share one graph, and a second call
    with another prompt length recompiles nothing."""
    torch._dynamo.reset()
    model = DecoderForCausalLM(tiny_decoder_config()).eval()
    batch = _batch()
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, cache_implementation="static")
    kwargs.update(eos_token_id=[5, 9, 17], min_new_tokens=3)
    expected = model.generate(**batch, **kwargs, disable_compile=True)
    config = CompileConfig(fullgraph=True, mode="default")
    config._compile_all_devices = True  # generate compiles only on accelerators unless told to (its testing hook)
    with torch._dynamo.config.patch(recompile_limit=1):  # fullgraph: a second graph for another span would raise
        output = model.generate(**batch, **kwargs, compile_config=config)
    assert hasattr(model, "_compiled_decoding_step"), "generate did not compile the decoding step"
    assert torch.equal(output, expected)
    shorter = {key: value[:, 2:] for key, value in batch.items()}
    with torch._dynamo.config.patch(error_on_recompile=True):
        expected = model.generate(**shorter, **kwargs, disable_compile=True)
        assert torch.equal(model.generate(**shorter, **kwargs, compile_config=config), expected)


def test_rings_compile_with_inductor():
    """Sliding layers decoded as rings (window 4, 12 + 24 positions: past 4 windows) compiled by inductor: the ring's
    slot arithmetic, its mask and ALiBi's bias over its slots in the graph give eager's tokens, and a second call
    recompiles nothing. (Beam search over rings: traced in test_beam_loop.py, compiled on the GPU.)"""
    torch._dynamo.reset()
    model = randomised(DecoderForCausalLM(tiny_decoder_config(**DECODER_VARIANTS["alibi_local_global"]))).eval()
    batch = _batch()
    config = CompileConfig(fullgraph=True, mode="default")
    config._compile_all_devices = True
    kwargs = dict(max_new_tokens=24, do_sample=False, pad_token_id=0, cache_implementation="static")
    expected = model.generate(**batch, **kwargs, disable_compile=True)
    assert torch.equal(model.generate(**batch, **kwargs, compile_config=config), expected)
    assert any(hasattr(layer, "ring") for layer in model._kept_static_cache.cache.layers)
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert torch.equal(model.generate(**batch, **kwargs, compile_config=config), expected)


def test_sampling_compiles_with_its_draw_in_the_graph():
    """Sampling through decoding_loop.py compiled by inductor: the draw (an exponential race, inductor's random
    numbers) repeats with the seed, stays inside top-k, and a second call recompiles nothing."""
    torch._dynamo.reset()
    model = randomised(DecoderForCausalLM(tiny_decoder_config()))
    batch = _batch()
    config = _compile_config(mode="default")
    kwargs = dict(do_sample=True, top_k=5, max_new_tokens=12, pad_token_id=0, eos_token_id=None, compile_config=config)
    kwargs.update(cache_implementation="static", return_dict_in_generate=True, output_scores=True)
    runs = []
    for _ in range(2):
        torch.manual_seed(0)
        with torch._dynamo.config.patch(error_on_recompile=bool(runs)):
            runs.append(model.generate(**batch, **kwargs))
    assert hasattr(model, "_compiled_decoding_step")
    assert torch.equal(runs[0].sequences, runs[1].sequences)
    tokens = runs[0].sequences[:, batch["input_ids"].shape[1] :]
    assert len(set(tokens.flatten().tolist())) > 3
    for step, scores in enumerate(runs[0].scores):
        assert torch.isfinite(scores.gather(1, tokens[:, step : step + 1])).all(), f"step {step}"


def test_regional_compilation_trains_like_eager_without_recompiles(monkeypatch):
    """accelerate's `compile_regions` (what `--dynamo_use_regional_compilation` uses) compiles one block's code and
    reuses it for every layer (as many graphs for 3 layers as for 1) and every later step (no recompile), and the
    losses equal eager's — also when the compiled model is the process's first to run a gated MLP (a kernel table
    filled during the first trace made the next call recompile the block)."""
    from accelerate.utils import compile_regions
    from torch._dynamo.utils import counters

    from archlab.modeling import feed_forward

    batch = {**_batch(), "labels": _batch()["input_ids"]}
    graphs = {}
    for layers in (1, 3):
        torch._dynamo.reset()
        counters.clear()
        eager, model = _pair(num_hidden_layers=layers)
        compiled = compile_regions(model, dynamic=False)
        assert all(type(layer).__name__ == "OptimizedModule" for layer in compiled.model.layers)
        losses = {}
        for name, module in (("eager", eager), ("compiled", compiled)):
            if name == "compiled":
                monkeypatch.setattr(feed_forward, "_GATED_KERNELS", {})  # as in a fresh process
            module.train()
            optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
            losses[name] = []
            for step in range(3):
                with torch._dynamo.config.patch(error_on_recompile=step > 0):
                    loss = module(**batch).loss
                    loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                losses[name].append(loss.item())
        graphs[layers] = counters["stats"]["unique_graphs"]
        assert losses["eager"][-1] < losses["eager"][0]
        torch.testing.assert_close(losses["compiled"], losses["eager"], rtol=1e-5, atol=1e-5)
    assert graphs[3] == graphs[1] > 0


def _compile_config(**kwargs) -> CompileConfig:
    config = CompileConfig(fullgraph=True, **kwargs)
    config._compile_all_devices = True  # generate compiles only on accelerators unless told to (its testing hook)
    return config


def test_moe_static_cache_generation_compiles():
    """The mixture of experts' decoding step at batch 1 compiled inside `generate`: the grouped-GEMM path (no host
    read) gives the tokens of eager's one-token path, and a second call reuses the graph."""
    torch._dynamo.reset()
    config = tiny_decoder_config(
        num_local_experts=4,
        num_experts_per_tok=2,
        shared_expert_intermediate_size=32,
        mlp_layer_types=["dense", "sparse"],
    )
    model = randomised(DecoderForCausalLM(config))
    prompt = _batch()["input_ids"][1:]
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, cache_implementation="static")
    expected = model.generate(prompt, **kwargs, disable_compile=True)
    assert torch.equal(model.generate(prompt, **kwargs, compile_config=_compile_config(mode="default")), expected)
    assert hasattr(model, "_compiled_decoding_step"), "generate did not compile the decoding step"
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert torch.equal(model.generate(prompt, **kwargs, compile_config=_compile_config(mode="default")), expected)


def test_laid_out_projections_compile(monkeypatch):
    """With q/k/v and gate/up read as one product per group (fused_projections.py; generate does it on CUDA, here
    on CPU), inductor compiles the greedy step over the blocks — a Qwen2-style q/k/v bias included — and gives the
    tokens of the separate products; a second call recompiles nothing."""
    from archlab.modeling import fused_projections

    torch._dynamo.reset()
    model = randomised(DecoderForCausalLM(tiny_decoder_config(qkv_bias=True)))
    batch = _batch()
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, cache_implementation="static")
    expected = model.generate(**batch, **kwargs, disable_compile=True)
    monkeypatch.setattr(fused_projections, "FUSED_PROJECTION_DEVICES", ("cpu",))
    config = _compile_config(mode="default")
    assert torch.equal(model.generate(**batch, **kwargs, compile_config=config), expected)
    attention = model.model.layers[0].self_attn
    assert attention.k_proj.weight.data_ptr() == attention.q_proj.weight[-1].data_ptr() + 4 * model.config.hidden_size
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert torch.equal(model.generate(**batch, **kwargs, compile_config=config), expected)


@pytest.mark.parametrize("kind", ["seq2seq", "decoder"])
def test_beam_search_compiles(kind):
    """Beam search on a static cache compiled by inductor (beam_loop.py: the whole step, the cache reorder included)
    gives eager's tokens — T5-style relative bias for the encoder-decoder, RoPE for the decoder, with end-of-sequence
    tokens after a minimum length — and a second call reuses the graph. (The decoder case caught an inductor
    miscompile of a cache gather placed after the forward's cache write; beam_step reorders first.)"""
    torch._dynamo.reset()
    if kind == "seq2seq":
        config = tiny_seq2seq_config(
            position_embedding_type="relative_bias",
            relative_attention_num_buckets=8,
            relative_attention_max_distance=16,
        )
        model = randomised(Seq2SeqForConditionalGeneration(config))
    else:
        model = randomised(DecoderForCausalLM(tiny_decoder_config()))
    source = torch.randint(3, 61, (2, 7), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(source)
    if kind == "seq2seq":
        mask[1, 5:] = 0
    kwargs = dict(attention_mask=mask, num_beams=3, num_return_sequences=2, max_new_tokens=10, pad_token_id=0)
    kwargs.update(cache_implementation="static", eos_token_id=[5, 7, 9], min_new_tokens=3)
    expected = model.generate(source, **kwargs, disable_compile=True)
    with torch._dynamo.config.patch(recompile_limit=1):  # one graph for every span of the cache (cache_spans.py)
        assert torch.equal(model.generate(source, **kwargs, compile_config=_compile_config(mode="default")), expected)
    assert hasattr(model, "_compiled_beam_step"), "beam search did not compile its step"
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert torch.equal(model.generate(source, **kwargs, compile_config=_compile_config(mode="default")), expected)


def test_the_reorder_from_spares_is_one_pass_per_tensor_compiled():
    """beam_reorder.py's claim, in inductor's code: reordering a layer's span from its spare writes each tensor once
    (the gather stores into the cache), where the in-place reorder writes twice (a gather into a temporary, a copy
    back), in more loop nests."""
    from torch._inductor.utils import run_and_get_code
    from transformers import StaticCache

    from archlab.modeling import beam_reorder, cache_spans

    def filled_cache():
        cache = StaticCache(config=tiny_decoder_config(num_hidden_layers=1), max_cache_len=12)
        cache_spans.make_spanned(cache)
        generator = torch.Generator().manual_seed(0)
        keys = torch.randn(4, 2, 5, 16, generator=generator)
        cache.update(keys, torch.randn(keys.shape, generator=generator), 0)
        cache_spans.Spans(cache).cover(8)
        return cache

    beam_idx = torch.tensor([3, 0, 0, 2])
    stores, nests = {}, {}
    for spared in (False, True):
        torch._dynamo.reset()
        cache, reference = filled_cache(), filled_cache()
        beam_reorder.reorder(reference, beam_idx)
        # code for 2 threads, whatever torch's count here (1 in a test worker on 2 cores): one thread has no loop nests
        with beam_reorder.Spares(cache) as spares, torch._inductor.config.patch({"cpp.threads": 2}):
            if spared:
                spares.swap()
            else:
                spares.__exit__()
            _, code = run_and_get_code(torch.compile(beam_reorder.reorder, fullgraph=True), cache, beam_idx)
            layer, expected = cache.layers[0], reference.layers[0]
            assert torch.equal(layer.keys[:, :, :8], expected.keys[:, :, :8])
            assert torch.equal(layer.values[:, :, :8], expected.values[:, :, :8])
        # one store statement per written tensor, vectorised or not
        stores[spared] = len(re.findall(r"\.store\(out_ptr\d|out_ptr\d+\[[^\]]*\] = ", code[-1]))
        nests[spared] = code[-1].count("#pragma omp for")  # parallel loop nests
    assert stores == {False: 4, True: 2}, stores
    assert nests[True] < nests[False], nests


# dynamo's "eager" backend traces the step as torch.compile does (a graph break fails `fullgraph`) but generates no
# code: seconds per variant instead of a minute
TRACE_ONLY = dict(backend="eager", mode=None)


def _traced_graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def _decoding_attention(attention: str, monkeypatch) -> None:
    """With `attention` "flex" the decoding steps' self-attention runs through FlexAttention (flex_decoding.py), a
    candidate default on CUDA, checked here on every variant (the tiny variants' heads of 8 admitted: traced, not
    generated as kernels); with "sdpa", the default."""
    from archlab.modeling import flex_decoding

    monkeypatch.setattr(flex_decoding, "FLEX_DECODING_DEVICES", ("cpu",) if attention == "flex" else ())
    monkeypatch.setattr(flex_decoding, "FLEX_HEAD_SIZES", (8, *flex_decoding.FLEX_HEAD_SIZES))


@pytest.mark.parametrize("attention", ["sdpa", "flex"])
@pytest.mark.parametrize("name", sorted(set(DECODER_VARIANTS) - NO_STATIC_CACHE))
def test_every_decoder_variant_decodes_in_one_graph(name, attention, monkeypatch):
    """Each catalogue variant's decoding step is one graph (`fullgraph=True`), gives eager's tokens on a left-padded
    batch, and a second call recompiles nothing (sliding windows recompile once, in the first call, when the window
    fills and the cache length becomes symbolic) — with the self-attention on SDPA and through FlexAttention."""
    _decoding_attention(attention, monkeypatch)
    torch._dynamo.reset()
    graphs = _traced_graphs()
    model = decoder_variant(name)
    inputs = _batch()
    if model.config.prefix_lm:
        inputs["prefix_lengths"] = torch.tensor([6, 8])
    kwargs = dict(**inputs, max_new_tokens=8, do_sample=False, pad_token_id=0, cache_implementation="static")
    expected = model.generate(**kwargs, disable_compile=True)
    assert torch.equal(model.generate(**kwargs, compile_config=_compile_config(**TRACE_ONLY)), expected)
    assert _traced_graphs() > graphs, "the decoding step was not compiled"
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert torch.equal(model.generate(**kwargs, compile_config=_compile_config(**TRACE_ONLY)), expected)


@pytest.mark.parametrize("attention", ["sdpa", "flex"])
@pytest.mark.parametrize("num_beams", [1, 3])
@pytest.mark.parametrize("name", sorted(SEQ2SEQ_VARIANTS))
def test_every_seq2seq_variant_decodes_in_one_graph(name, num_beams, attention, monkeypatch):
    """The same for the encoder-decoder, greedy and beam search (whose steps fast_decoding compiles)."""
    _decoding_attention(attention, monkeypatch)
    torch._dynamo.reset()
    graphs = _traced_graphs()
    model = seq2seq_variant(name)
    source = torch.randint(3, 61, (2, 7), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(source)
    mask[1, 5:] = 0
    kwargs = dict(attention_mask=mask, num_beams=num_beams, max_new_tokens=8, cache_implementation="static")
    expected = model.generate(source, **kwargs, disable_compile=True)
    assert torch.equal(model.generate(source, **kwargs, compile_config=_compile_config(**TRACE_ONLY)), expected)
    assert _traced_graphs() > graphs, "the decoding step was not compiled"
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert torch.equal(model.generate(source, **kwargs, compile_config=_compile_config(**TRACE_ONLY)), expected)


def test_the_prefill_compiles_once_for_every_prompt_length():
    """generate's prefill on the compiled path (compiled_prefill.py) through inductor: dynamic shapes, so a prompt
    and cache of other lengths reuse the code (no recompile), with eager's tokens both times."""
    torch._dynamo.reset()
    model = DecoderForCausalLM(tiny_decoder_config())
    common = dict(do_sample=False, pad_token_id=0, eos_token_id=None, cache_implementation="static")
    config = _compile_config(mode=None)
    for index, (length, new) in enumerate(((6, 6), (9, 3))):
        batch = {"input_ids": torch.randint(3, 97, (2, length), generator=torch.Generator().manual_seed(length))}
        batch["attention_mask"] = torch.ones_like(batch["input_ids"])
        expected = model.generate(**batch, **common, max_new_tokens=new, disable_compile=True)
        with torch._dynamo.config.patch(error_on_recompile=index > 0):
            ours = model.generate(**batch, **common, max_new_tokens=new, compile_config=config, compile_prefill=True)
            assert torch.equal(ours, expected)
    assert "_compiled_prefill" in model.__dict__
