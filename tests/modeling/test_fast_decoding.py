"""fast_decoding.py: the static cache decodes every catalogue variant as the dynamic cache does, token for token and
logit for logit (each decoder position scheme and RoPE type, all-local and local/global sliding windows, prefix-LM,
mixtures of experts; the seq2seq model's position schemes with greedy decoding and beam search); a variant that
cannot falls back with one logged line; and the default on CUDA, forced here through `decodes_compiled_by_default`,
takes the static path (sampling, stop strings, streaming and the pipeline included) unless the user opts out."""

from __future__ import annotations

import contextlib
import copy
import io
from types import SimpleNamespace

import pytest
import torch
from transformers import (
    CompileConfig,
    DynamicCache,
    EncoderDecoderCache,
    GenerationConfig,
    StaticCache,
    TextStreamer,
    pipeline,
)
from transformers.generation import GenerationMode

from archlab import DecoderForCausalLM
from archlab.modeling import beam_loop, cache_growth, decoding_loop, fast_decoding, sliding_layers
from archlab.modeling.configuration_decoder import ROPE_TYPES

from helpers import (
    DECODER_VARIANTS,
    NO_STATIC_CACHE,
    NO_STATIC_CACHE_NOTICES,
    ROPE_PARAMETERS,
    SEQ2SEQ_VARIANTS,
    character_tokenizer,
    cpu_compile_config,
    decoder_variant,
    randomised,
    seq2seq_variant,
    tiny_decoder_config,
)

# Random tiny models settle on repeating one token, which would hide a wrong step: no token may come twice.
GREEDY = dict(do_sample=False, no_repeat_ngram_size=1, output_logits=True, return_dict_in_generate=True)


def _prompts(batch: int, vocab: int, padding_side: str = "left") -> dict[str, torch.Tensor]:
    """`batch` prompts of 6 tokens; with more than one, the first is padded by 2 (decoders: on the left)."""
    ids = torch.randint(3, vocab, (batch, 6), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    if batch > 1:
        padding = slice(0, 2) if padding_side == "left" else slice(4, 6)
        mask[0, padding] = 0
        ids[0, padding] = 0
    return {"input_ids": ids, "attention_mask": mask}


def _assert_same_decoding(static, dynamic) -> None:
    assert torch.equal(static.sequences, dynamic.sequences)
    for step, (a, b) in enumerate(zip(static.logits, dynamic.logits)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=f"logits of step {step}")


def test_every_rope_type_is_covered():
    assert set(ROPE_PARAMETERS) == set(ROPE_TYPES)


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("name", sorted(set(DECODER_VARIANTS) - NO_STATIC_CACHE))
def test_decoder_static_cache_equals_dynamic_cache(name, batch):
    model = decoder_variant(name)
    inputs = _prompts(batch, model.config.vocab_size)
    if model.config.prefix_lm:
        inputs["prefix_lengths"] = torch.full((batch,), 4)
    kwargs = dict(**inputs, **GREEDY, max_new_tokens=12, pad_token_id=0, eos_token_id=None)
    static = model.generate(cache_implementation="static", **kwargs)
    dynamic = model.generate(cache_implementation="dynamic", **kwargs)
    assert isinstance(static.past_key_values, StaticCache) and isinstance(dynamic.past_key_values, DynamicCache)
    _assert_same_decoding(static, dynamic)


@pytest.mark.parametrize("num_beams", [1, 3])
@pytest.mark.parametrize("name", sorted(SEQ2SEQ_VARIANTS))
def test_seq2seq_static_cache_equals_dynamic_cache(name, num_beams):
    model = seq2seq_variant(name)
    inputs = _prompts(3, model.config.vocab_size, padding_side="right")
    kwargs = dict(**inputs, **GREEDY, num_beams=num_beams, max_new_tokens=10, eos_token_id=None)
    if num_beams > 1:
        kwargs.update(num_return_sequences=2, output_logits=False, output_scores=True)
    static = model.generate(cache_implementation="static", **kwargs)
    dynamic = model.generate(cache_implementation="dynamic", **kwargs)
    assert isinstance(static.past_key_values.self_attention_cache, StaticCache)
    assert torch.equal(static.sequences, dynamic.sequences)
    for step, (a, b) in enumerate(zip(*(out.logits or out.scores for out in (static, dynamic)))):
        finite = torch.isfinite(b)  # beam scores hold -inf for banned tokens
        torch.testing.assert_close(a[finite], b[finite], atol=1e-4, rtol=1e-4, msg=f"step {step}")


@pytest.fixture
def notices(monkeypatch) -> list[str]:
    """The one-line notices fast_decoding logs (`warning_once` shows each only once per process)."""
    logged: list[str] = []
    monkeypatch.setattr(fast_decoding.logger, "warning_once", logged.append)
    return logged


@pytest.fixture
def on_cuda(monkeypatch) -> None:
    """`generate` decides as it does on CUDA (the model stays on CPU, where nothing is compiled)."""
    monkeypatch.setattr(fast_decoding, "decodes_compiled_by_default", lambda device: True)


@pytest.mark.parametrize("name", sorted(NO_STATIC_CACHE))
def test_variants_without_a_static_path_fall_back_with_one_notice(name, notices, on_cuda):
    model = decoder_variant(name)
    kwargs = dict(**_prompts(2, model.config.vocab_size), **GREEDY, max_new_tokens=12, pad_token_id=0)
    asked = model.generate(cache_implementation="static", **kwargs)
    default = model.generate(**kwargs)  # what CUDA would choose
    dynamic = model.generate(cache_implementation="dynamic", **kwargs)
    for out in (asked, default):
        assert isinstance(out.past_key_values, DynamicCache)
        _assert_same_decoding(out, dynamic)
    named = NO_STATIC_CACHE_NOTICES[name]
    assert len(notices) == 2 and all(named in notice and "\n" not in notice for notice in notices)


def test_default_on_cuda_is_the_static_cache_and_the_user_can_opt_out(on_cuda, notices):
    model = decoder_variant("positions_rope")
    kwargs = dict(**_prompts(2, 97), **GREEDY, max_new_tokens=8, pad_token_id=0)
    default = model.generate(**kwargs)
    assert isinstance(default.past_key_values, StaticCache)
    _assert_same_decoding(default, model.generate(cache_implementation="dynamic", **kwargs))
    for opt_out in (dict(cache_implementation="dynamic"), dict(disable_compile=True)):
        assert isinstance(model.generate(**kwargs, **opt_out).past_key_values, DynamicCache), opt_out
    own = DynamicCache(config=model.config)
    assert model.generate(**kwargs, past_key_values=own).past_key_values is own  # a cache passed in is used
    assert model.generate(**kwargs, use_cache=False).past_key_values is None
    assert not notices


def _conversation(model, cache, turns: int = 3, **kwargs) -> list:
    """`turns` calls of generate, each continuing from the last one's cache with the user's next message appended
    (a left-padded batch of 2); the first call takes `cache` (None: generate's choice; a string: that
    cache_implementation; a Cache: passed in). Returns each call's output."""
    inputs = _prompts(2, model.config.vocab_size)
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    common = dict(**GREEDY, pad_token_id=0, eos_token_id=None, **kwargs)
    outputs = []
    for turn in range(turns):
        if isinstance(cache, str):
            chosen = dict(cache_implementation=cache)
        else:
            chosen = {} if cache is None else dict(past_key_values=cache)
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4 + turn, **chosen, **common)
        outputs.append(out)
        cache = out.past_key_values  # the next turn continues from it
        reply = torch.tensor([[5 + turn, 6, 7]] * 2)  # the user's next message, after the model's answer
        ids = torch.cat([out.sequences, reply], dim=-1)
        mask = torch.cat([mask, torch.ones(2, ids.shape[1] - mask.shape[1], dtype=mask.dtype)], dim=-1)
    return outputs


@pytest.mark.parametrize("loop", ["archlab", "transformers"])
@pytest.mark.parametrize(
    "name",
    ["positions_rope", "positions_alibi", "positions_learned", "positions_relative_bias", "moe", "local_global"],
)
def test_a_conversation_continues_from_the_returned_static_cache_as_from_a_dynamic_one(
    name, loop, on_cuda, monkeypatch
):
    """Multi-turn with `past_key_values=out.past_key_values`: the CUDA default's static cache, too short for the next
    turn, grows in place (cache_growth.py) and each turn decodes as from transformers' dynamic cache. (Stock Llama
    raises an IndexError from a static cache there.) "archlab": its compiled loop (traced eagerly here) takes every
    turn, as on CUDA; "transformers": its loop does."""
    model = decoder_variant(name)
    grown, loops = [], []
    monkeypatch.setattr(cache_growth.logger, "warning_once", grown.append)
    monkeypatch.setattr(fast_decoding, "decode", _recorded_call(fast_decoding.decode, loops))
    kwargs = {}
    if loop == "archlab":
        monkeypatch.setattr(fast_decoding, "compiled_decoding_step", lambda model, config: decoding_loop.decoding_step)
        kwargs = dict(compile_config=_on_this_cpu())
    static = _conversation(model, None, **kwargs)
    assert len(loops) == (3 if loop == "archlab" else 0)
    dynamic = _conversation(model, "dynamic", **kwargs)
    assert isinstance(static[0].past_key_values, StaticCache)
    assert all(out.past_key_values is static[0].past_key_values for out in static)  # the user's object, grown
    for turn, (a, b) in enumerate(zip(static, dynamic)):
        assert torch.equal(a.sequences, b.sequences), f"turn {turn}"
        _assert_same_decoding(a, b)
    assert len(grown) == 2 and grown[0] == grown[1] and "holds fewer positions" in grown[0] and "\n" not in grown[0]


def test_a_conversation_from_a_static_cache_of_ones_own_takes_the_whole_step_loop(on_cuda, monkeypatch):
    model = decoder_variant("positions_rope")
    loops = []
    monkeypatch.setattr(fast_decoding, "decode", _recorded_call(fast_decoding.decode, loops))
    monkeypatch.setattr(fast_decoding, "compiled_decoding_step", lambda model, config: decoding_loop.decoding_step)
    own = StaticCache(config=model.config, max_cache_len=48)
    static = _conversation(model, own, compile_config=_on_this_cpu())
    assert len(loops) == 3 and all(out.past_key_values is own for out in static)
    for a, b in zip(static, _conversation(model, "dynamic")):
        _assert_same_decoding(a, b)


@pytest.mark.parametrize("name", ["positions_rope", "moe", "local_global"])
def test_beam_search_from_a_static_cache_of_ones_own_takes_the_whole_step_loop(name, on_cuda, monkeypatch):
    model = decoder_variant(name)
    loops = []
    monkeypatch.setattr(fast_decoding, "beam_search", _recorded_call(fast_decoding.beam_search, loops))
    monkeypatch.setattr(fast_decoding, "compiled_beam_step", lambda model, config: beam_loop.beam_step)
    kwargs = dict(**_prompts(2, model.config.vocab_size), **GREEDY, num_beams=3, max_new_tokens=6, pad_token_id=0)
    own = model.generate(
        **kwargs, past_key_values=StaticCache(config=model.config, max_cache_len=20), compile_config=_on_this_cpu()
    )
    dynamic = model.generate(**kwargs, past_key_values=DynamicCache(config=model.config))
    assert len(loops) == 1
    _assert_same_decoding(own, dynamic)
    torch.testing.assert_close(own.sequences_scores, dynamic.sequences_scores, atol=1e-5, rtol=1e-5)


def _recorded_call(function, calls: list):
    def recorded(*args, **kwargs):
        calls.append(function)
        return function(*args, **kwargs)

    return recorded


def test_a_static_cache_that_fits_the_next_turn_is_not_copied():
    model = decoder_variant("positions_rope")
    cache = StaticCache(config=model.config, max_cache_len=40)
    kwargs = dict(**GREEDY, pad_token_id=0, eos_token_id=None, max_new_tokens=4, past_key_values=cache)
    turn = model.generate(**_prompts(1, 97), **kwargs)
    addresses = [layer.keys.data_ptr() for layer in cache.layers]
    model.generate(input_ids=torch.cat([turn.sequences, torch.tensor([[5, 6]])], dim=-1), **kwargs)
    assert [layer.keys.data_ptr() for layer in cache.layers] == addresses and cache.get_max_length() == 40


def _window_long(output) -> bool:
    return bool(sliding_layers.window_long_layers(output.past_key_values))


@pytest.mark.parametrize("name", ["local_global", "all_sliding_attention", "alibi_local_global"])
def test_generations_over_four_windows_decode_as_rings_by_default(name, on_cuda, notices, monkeypatch):
    """Past `WHOLE_CACHE_WINDOWS` windows (and, on CUDA, past what the memory bounds allow: next test) a static
    cache's sliding layers are transformers' window-long ones: greedy decoding, sampling and beam search take them
    (the loops decode them as rings, sliding_layers.py), with the dynamic cache's tokens and logits; beam sampling,
    which runs transformers' loop, keeps the dynamic cache by default, with one notice."""
    kwargs = dict(**_prompts(2, 97), **GREEDY, pad_token_id=0, max_new_tokens=12)  # a 17-position cache
    model = randomised(DecoderForCausalLM(tiny_decoder_config(**DECODER_VARIANTS[name])))  # window 4
    assert isinstance(model.generate(**dict(kwargs, max_new_tokens=10)).past_key_values, StaticCache)  # 15 positions
    rings = []
    monkeypatch.setattr(sliding_layers.RingSlidingLayer, "fill_from", _recorded(rings, "fill_from"))
    monkeypatch.setattr(fast_decoding, "compiled_decoding_step", lambda model, config: decoding_loop.decoding_step)
    default = model.generate(**kwargs, compile_config=_on_this_cpu())  # the loop takes the call, as on CUDA
    assert _window_long(default) and rings and not notices
    _assert_same_decoding(default, model.generate(**kwargs, cache_implementation="dynamic"))
    beams = dict(kwargs, num_beams=2, output_logits=False)
    assert _window_long(model.generate(**beams)) and not notices  # beam search decodes them as rings too
    assert isinstance(model.generate(**dict(beams, do_sample=True)).past_key_values, DynamicCache)
    assert len(notices) == 1 and "(window 4;" in notices[0] and "beam sampling" in notices[0] and "\n" not in notices[0]


@pytest.mark.parametrize("name", ["all_chunked_attention", "llama4_attention"])
def test_generations_over_four_chunks_decode_chunked_layers_as_rings(name, on_cuda, notices, monkeypatch):
    """Llama 4's chunked layers: up to 4 chunks the static cache keeps them whole; past that greedy decoding and beam
    search decode transformers' chunk-long layers as rings whose masks give each query its chunk (counted, as
    transformers counts it, from each row's first token after its left padding): the dynamic cache's tokens and
    logits. Beam sampling, transformers' loop, keeps them whole at any length, as before the rings."""
    kwargs = dict(**_prompts(2, 97), **GREEDY, pad_token_id=0, max_new_tokens=12)  # a 17-position cache, chunks of 4
    model = randomised(DecoderForCausalLM(tiny_decoder_config(**DECODER_VARIANTS[name])))
    short = model.generate(**dict(kwargs, max_new_tokens=10))  # 16 positions: 4 chunks
    assert isinstance(short.past_key_values, StaticCache) and not _window_long(short)
    rings = []
    monkeypatch.setattr(sliding_layers.RingSlidingLayer, "fill_from", _recorded(rings, "fill_from"))
    monkeypatch.setattr(fast_decoding, "compiled_decoding_step", lambda model, config: decoding_loop.decoding_step)
    monkeypatch.setattr(fast_decoding, "compiled_beam_step", lambda model, config: beam_loop.beam_step)
    default = model.generate(**kwargs, compile_config=_on_this_cpu())  # the loop takes the call, as on CUDA
    assert _window_long(default) and rings and all(ring.chunked and ring.window == 4 for ring in rings)
    _assert_same_decoding(default, model.generate(**kwargs, cache_implementation="dynamic"))
    beams = dict(kwargs, num_beams=2, output_logits=False, output_scores=True, max_new_tokens=16)
    rings.clear()
    static = model.generate(**beams, compile_config=_on_this_cpu())
    assert _window_long(static) and rings
    dynamic = model.generate(**beams, cache_implementation="dynamic")
    assert torch.equal(static.sequences, dynamic.sequences)
    torch.testing.assert_close(static.sequences_scores, dynamic.sequences_scores, atol=1e-5, rtol=1e-5)
    sampled = model.generate(**dict(beams, do_sample=True))
    assert isinstance(sampled.past_key_values, StaticCache) and not _window_long(sampled)
    assert not notices


def test_chunked_layers_beside_sliding_ones_stay_whole():
    """transformers sizes the masks of both local kinds from one cache layer: such a model never decodes as rings."""
    config = tiny_decoder_config(
        sliding_window=4, attention_chunk_size=6, layer_types=["sliding_attention", "chunked_attention"]
    )
    model = DecoderForCausalLM(config)
    assert sliding_layers.local_window(config) is None
    assert "side by side" in sliding_layers.ring_blocker(model)
    assert sliding_layers.kept_whole(model, 1000, 1, rings=True)
    chunked = DecoderForCausalLM(tiny_decoder_config(**DECODER_VARIANTS["all_chunked_attention"]))
    assert sliding_layers.ring_blocker(chunked) is None and sliding_layers.local_window(chunked.config) == 4
    assert sliding_layers.kept_whole(chunked, 16, 1, rings=True) and not sliding_layers.kept_whole(chunked, 17, 1, True)
    assert sliding_layers.kept_whole(chunked, 1000, 1)  # a call without rings: whole at any length


def _on_this_cpu() -> CompileConfig:
    """A compile config under which generate compiles its decoding steps on CPU too (dynamo's tracing backend)."""
    config = CompileConfig(backend="eager", mode=None, fullgraph=True)
    config._compile_all_devices = True
    return config


def _recorded(calls: list, name: str):
    """`RingSlidingLayer.<name>`, counting its calls in `calls`."""
    method = getattr(sliding_layers.RingSlidingLayer, name)

    def recorded(self, *args, **kwargs):
        calls.append(self)
        return method(self, *args, **kwargs)

    return recorded


def test_window_long_layers_in_transformers_loop_run_its_steps_eagerly(monkeypatch):
    """A call the loop does not take (here a bad-words processor) with window-long sliding layers runs transformers'
    loop with its steps uncompiled where they would run as CUDA graphs: each step would record a graph of its own."""
    model = randomised(DecoderForCausalLM(tiny_decoder_config(**DECODER_VARIANTS["local_global"])))
    config = _on_this_cpu()  # transformers would compile the steps on this CPU too
    config.mode = "reduce-overhead"  # generate's default mode: CUDA graphs

    def refuse(*args, **kwargs):
        raise AssertionError("transformers' loop compiled its steps")

    monkeypatch.setattr(model, "get_compiled_call", refuse)
    monkeypatch.setattr(model, "compiled_decoding_steps", refuse, raising=False)
    kwargs = dict(**_prompts(2, 97), **GREEDY, pad_token_id=0, max_new_tokens=12, bad_words_ids=[[5, 6]])
    static = model.generate(**kwargs, cache_implementation="static", compile_config=config)
    assert _window_long(static)
    _assert_same_decoding(static, model.generate(**kwargs, cache_implementation="dynamic"))
    beams = dict(kwargs, num_beams=2, output_logits=False, output_scores=True)
    monkeypatch.setattr(fast_decoding, "compiled_decoding_steps", refuse)
    static = model.generate(**beams, cache_implementation="static", compile_config=config)
    dynamic = model.generate(**beams, cache_implementation="dynamic")
    assert _window_long(static) and torch.equal(static.sequences, dynamic.sequences)


def test_on_cuda_longer_caches_keep_their_sliding_layers_whole_while_the_keys_past_the_window_fit(
    on_cuda, notices, monkeypatch
):
    """Past 4 windows, where a call does not decode as rings (rings switched off here; beam sampling), on CUDA (its free
    memory stood in for here) the sliding layers stay whole while the keys kept past the window weigh no more than the
    weights and a quarter of the free memory: the tokens and logits of the dynamic cache (whose sliding layers drop
    those keys). Beyond either bound, the dynamic cache. Greedy decoding with rings takes them past 4 windows whatever
    the memory: they hold and read less."""
    kwargs = dict(**_prompts(2, 97), **GREEDY, pad_token_id=0, max_new_tokens=12)  # a 17-position cache, window 4
    model = randomised(DecoderForCausalLM(tiny_decoder_config(**DECODER_VARIANTS["local_global"])))
    extra = sliding_layers.bytes_past_the_window(model.config, 17, 2, model.dtype)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert 0 < extra < weights
    monkeypatch.setattr(sliding_layers, "free_device_memory", lambda device: 4 * extra)
    assert _window_long(model.generate(**kwargs)) and not notices  # rings
    monkeypatch.setattr(sliding_layers, "RINGS", False)
    whole = model.generate(**kwargs)
    assert isinstance(whole.past_key_values, StaticCache) and not notices
    assert any(isinstance(layer, sliding_layers.WholeCacheSlidingLayer) for layer in whole.past_key_values.layers)
    _assert_same_decoding(whole, model.generate(**kwargs, cache_implementation="dynamic"))
    model.release_decoding_memory()
    monkeypatch.setattr(sliding_layers, "free_device_memory", lambda device: 4 * extra - 1)
    assert isinstance(model.generate(**kwargs).past_key_values, DynamicCache)
    assert len(notices) == 1 and "too long to keep whole" in notices[0] and "switched off" in notices[0]


def test_keys_past_the_window_are_bounded_by_the_weights(monkeypatch):
    """The rule itself: up to 4 windows always; past them only where the free memory is known (CUDA) and the rows'
    keys past the window weigh at most the weights."""
    model = DecoderForCausalLM(tiny_decoder_config(**DECODER_VARIANTS["local_global"]))  # window 4, 1 sliding layer
    config = model.config
    per_row_position = 2 * config.num_key_value_heads * config.head_dim * 4  # keys and values, float32
    assert sliding_layers.bytes_past_the_window(config, 20, 3, torch.float32) == 3 * 16 * per_row_position
    assert sliding_layers.kept_whole(model, 16, None)  # 4 windows
    assert not sliding_layers.kept_whole(model, 17, 1)  # on CPU no free memory is known
    monkeypatch.setattr(sliding_layers, "free_device_memory", lambda device: 1 << 50)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    rows = weights // (13 * per_row_position)  # the most rows whose keys past the window, 13 positions, fit
    assert sliding_layers.kept_whole(model, 17, rows) and not sliding_layers.kept_whole(model, 17, rows + 1)
    assert not sliding_layers.kept_whole(model, 17, None)
    # a call decoding as rings keeps whole layers up to 4 windows only
    assert sliding_layers.kept_whole(model, 16, 1, rings=True) and not sliding_layers.kept_whole(
        model, 17, 1, rings=True
    )
    greedy, beams, beam_sampling = GenerationMode.GREEDY_SEARCH, GenerationMode.BEAM_SEARCH, GenerationMode.BEAM_SAMPLE
    assert sliding_layers.decodes_as_rings(model, greedy) and sliding_layers.decodes_as_rings(model, beams)
    assert not sliding_layers.decodes_as_rings(model, beam_sampling)  # transformers' loop
    flash = SimpleNamespace(config=SimpleNamespace(is_encoder_decoder=False, _attn_implementation="flash_attention_2"))
    assert "flash_attention_2" in sliding_layers.ring_blocker(flash)  # no mask of a ring's slots


def test_transformers_full_sliding_layers_take_their_length_as_a_symbolic_input():
    """Why the default above: once a `StaticSlidingWindowLayer` is full, transformers' compiled forward takes the
    layer's Python length as a symbolic int input, a new value every step (CUDA graphs record one graph per
    distinct value). Should transformers change that, this fails and the fallback can go."""
    graphs = []

    def backend(graph, example_inputs):
        graphs.append([node.meta.get("example_value") for node in graph.graph.nodes if node.op == "placeholder"])
        return graph.forward

    torch._dynamo.reset()
    model = decoder_variant("local_global")
    config = GenerationConfig(cache_implementation="static", max_new_tokens=12, do_sample=False, pad_token_id=0)
    config.compile_config = CompileConfig(backend=backend, mode=None, fullgraph=False)
    config.compile_config._compile_all_devices = True
    model.generate(**_prompts(1, 97), generation_config=config)  # transformers' loop: the window is shorter
    symbolic = [value for graph in graphs for value in graph if isinstance(value, torch.SymInt)]
    assert symbolic, "transformers' static sliding layers no longer take a per-step int"


def test_flash_attention_keeps_the_dynamic_cache_by_default(on_cuda, notices):
    """Only the choice is checked (no flash kernel here): FlashAttention breaks the compiled graph."""
    model = decoder_variant("positions_rope")
    model.config._attn_implementation = "flash_attention_2"
    chosen = fast_decoding.choose_cache_implementation(model, GenerationConfig(), {}, GenerationMode.GREEDY_SEARCH)
    assert chosen is None and len(notices) == 1 and "flash_attention_2" in notices[0]
    asked = GenerationConfig(cache_implementation="static")  # transformers' own FlashAttention + static cache path
    assert fast_decoding.choose_cache_implementation(model, asked, {}, GenerationMode.GREEDY_SEARCH) == "static"


def test_sharded_parameters_keep_the_dynamic_cache_by_default(on_cuda, notices, tmp_path, monkeypatch):
    """A DTensor parameter (FSDP2, tensor parallelism: here one replicated on a single-process group) keeps the
    dynamic cache; without a process group no parameter is looked at (a walk over every module per call)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    model = decoder_variant("positions_rope")
    walked = []
    parameters = type(model).parameters

    def counted(self, recurse=True):
        for parameter in parameters(self, recurse):
            walked.append(parameter)
            yield parameter

    with monkeypatch.context() as patch:
        patch.setattr(type(model), "parameters", counted)
        chosen = fast_decoding.choose_cache_implementation(model, GenerationConfig(), {}, GenerationMode.GREEDY_SEARCH)
    assert chosen == "static" and not notices
    assert len(walked) <= 2  # `model.device` reads the first parameter; nothing walks them all
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'group'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        weight = model.lm_head.weight
        model.lm_head.weight = torch.nn.Parameter(distribute_tensor(weight.detach(), mesh, [Replicate()]))
        chosen = fast_decoding.choose_cache_implementation(model, GenerationConfig(), {}, GenerationMode.GREEDY_SEARCH)
        assert chosen is None and len(notices) == 1 and "sharded" in notices[0]
    finally:
        dist.destroy_process_group()


def test_assistants_and_other_decoding_loops_keep_the_dynamic_cache(on_cuda):
    model = decoder_variant("positions_rope")
    assistant = GenerationConfig()
    assistant.is_assistant = True
    assert fast_decoding.choose_cache_implementation(model, assistant, {}, GenerationMode.GREEDY_SEARCH) is None
    for mode in set(GenerationMode) - set(fast_decoding.STATIC_CACHE_MODES):
        assert fast_decoding.choose_cache_implementation(model, GenerationConfig(), {}, mode) is None, mode
    # assisted decoding through generate: the main model's and the assistant's caches stay dynamic
    inputs = _prompts(1, 97)
    out = model.generate(**inputs, assistant_model=decoder_variant("positions_rope"), max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 10)


def test_cpu_default_is_unchanged():
    assert not fast_decoding.decodes_compiled_by_default(torch.device("cpu"))
    model = decoder_variant("positions_rope")
    out = model.generate(**_prompts(2, 97), **GREEDY, max_new_tokens=4, pad_token_id=0)
    assert isinstance(out.past_key_values, DynamicCache)


def test_seq2seq_default_on_cuda_is_the_static_cache_for_greedy_and_beam_search(on_cuda):
    model = seq2seq_variant("positions_relative_bias")
    inputs = _prompts(2, model.config.vocab_size)
    for num_beams in (1, 3):
        out = model.generate(**inputs, **GREEDY, num_beams=num_beams, max_new_tokens=6)
        assert isinstance(out.past_key_values, EncoderDecoderCache)
        assert isinstance(out.past_key_values.self_attention_cache, StaticCache)


def test_sampling_stop_strings_and_streaming_on_the_default_path(on_cuda, capsys):
    tokenizer = character_tokenizer()
    model = randomised(DecoderForCausalLM(tiny_decoder_config(vocab_size=len(tokenizer))))
    inputs = tokenizer(["def f"], return_tensors="pt")
    prompt = inputs["input_ids"].shape[1]
    sampling = dict(**inputs, do_sample=True, temperature=1.5, max_new_tokens=12, pad_token_id=0, eos_token_id=None)
    runs = {}
    for cache in (None, "dynamic"):  # None: the default, which is static here
        torch.manual_seed(3)
        runs[cache] = model.generate(**sampling, return_dict_in_generate=True, cache_implementation=cache)
    assert isinstance(runs[None].past_key_values, StaticCache)
    sampled = runs[None].sequences[0]
    assert torch.equal(sampled, runs["dynamic"].sequences[0])
    assert len(set(sampled[prompt:].tolist())) > 3  # sampled, not one repeated token

    # stop at the text of new tokens 3 and 4: the same sample, cut where its text first ends with it
    stop = tokenizer.decode(sampled[prompt + 2 : prompt + 4])
    cut = next(k for k in range(prompt + 1, len(sampled) + 1) if tokenizer.decode(sampled[:k]).endswith(stop))
    torch.manual_seed(3)
    streamer = TextStreamer(tokenizer, skip_prompt=True)
    stopped = model.generate(**sampling, stop_strings=[stop], tokenizer=tokenizer, streamer=streamer)
    assert torch.equal(stopped[0], sampled[:cut])
    assert capsys.readouterr().out == tokenizer.decode(sampled[prompt:cut]) + "\n"  # streamed as it was generated


def test_text_generation_pipeline_takes_the_static_path(on_cuda, monkeypatch):
    tokenizer = character_tokenizer()
    model = randomised(DecoderForCausalLM(tiny_decoder_config(vocab_size=len(tokenizer))))
    caches = []
    prepare = model._prepare_static_cache
    monkeypatch.setattr(model, "_prepare_static_cache", lambda *a, **k: caches.append(prepare(*a, **k)) or caches[-1])
    generator = pipeline("text-generation", model=model, tokenizer=tokenizer)
    text = generator("def f", max_new_tokens=5, do_sample=False)[0]["generated_text"]
    assert text.startswith("def f") and len(caches) == 1


def test_static_beam_reorder_keeps_the_tensors_in_place():
    """Compiled graphs and CUDA graphs hold the static cache's addresses: the beam reorder must copy into them."""
    model = decoder_variant("positions_rope")
    inputs = _prompts(3, 97)
    cache = StaticCache(config=model.config, max_cache_len=10)
    model(**inputs, past_key_values=cache, use_cache=True)
    expected = [(layer.keys[[2, 0, 0]].clone(), layer.values[[2, 0, 0]].clone()) for layer in cache.layers]
    addresses = [layer.keys.data_ptr() for layer in cache.layers]
    model._reorder_cache(cache, torch.tensor([2, 0, 0]))
    assert [layer.keys.data_ptr() for layer in cache.layers] == addresses
    for layer, (keys, values) in zip(cache.layers, expected):
        assert torch.equal(layer.keys, keys) and torch.equal(layer.values, values)


def test_decoding_step_is_told_from_the_prefill_without_reading_the_device():
    model = seq2seq_variant("positions_sinusoidal")
    inputs = _prompts(2, model.config.vocab_size)
    cache = EncoderDecoderCache(StaticCache(config=model.config, max_cache_len=8), StaticCache(model.config, 6))
    assert not fast_decoding.is_decoding_step(cache)
    model(**inputs, decoder_input_ids=torch.ones(2, 1, dtype=torch.long), past_key_values=cache, use_cache=True)
    assert fast_decoding.is_decoding_step(cache)
    assert not fast_decoding.is_decoding_step(EncoderDecoderCache(DynamicCache(), DynamicCache()))  # not compiled


def test_prefix_lm_on_the_static_path_needs_the_whole_prefix_in_the_prompt():
    """Its decoding steps attend causally (every new token comes after the prefix), so a longer prefix is refused."""
    model = decoder_variant("prefix_lm")
    with pytest.raises(ValueError, match="whole prefix must be in the prompt"):
        model.generate(
            **_prompts(1, 97), prefix_lengths=torch.tensor([8]), cache_implementation="static", max_new_tokens=2
        )


def _compile_everywhere() -> CompileConfig:
    config = CompileConfig(backend="eager", mode=None, fullgraph=True)
    config._compile_all_devices = True  # transformers' testing hook: compile (and take the static path) on CPU too
    return config


def test_beam_search_holds_each_source_once_in_the_cross_attention_cache(monkeypatch):
    """On generate's static cache an encoder-decoder's beam search keeps each source's cross-attention keys once, not
    once per beam (`SHARED_SOURCE_KEYS`): the same sequences and scores as keys per beam, in the compiled loop and in
    transformers' loop (beam sampling) alike, with a padded source; the cache is kept for the next beam search, and a
    greedy call of the same cache batch gets a cache of its own. The steps run uncompiled (their compiled graphs with
    shared keys: tests/integration/test_compile.py)."""
    monkeypatch.setattr(fast_decoding, "compiled_beam_step", lambda model, config: beam_loop.beam_step)
    monkeypatch.setattr(fast_decoding, "compiled_decoding_step", lambda model, config: decoding_loop.decoding_step)
    monkeypatch.setattr(fast_decoding, "compiled_decoding_steps", lambda model, config: contextlib.nullcontext())
    model = seq2seq_variant("positions_sinusoidal")  # Marian's (every variant: tests/modeling/test_beam_loop.py)
    inputs = _prompts(2, model.config.vocab_size, padding_side="right")
    kwargs = dict(**inputs, num_beams=3, max_new_tokens=8, cache_implementation="static", pad_token_id=0)
    kwargs.update(return_dict_in_generate=True, output_scores=True, compile_config=_compile_everywhere())
    sampled = dict(kwargs, do_sample=True, top_k=5)
    monkeypatch.setattr(fast_decoding, "SHARED_SOURCE_KEYS", False)
    expected = model.generate(**kwargs)
    torch.manual_seed(0)
    expected_sample = model.generate(**sampled)
    monkeypatch.setattr(fast_decoding, "SHARED_SOURCE_KEYS", True)
    model.release_decoding_memory()
    for reference, call in ((expected, kwargs), (expected_sample, sampled)):
        torch.manual_seed(0)
        ours = model.generate(**call)
        assert torch.equal(ours.sequences, reference.sequences)
        torch.testing.assert_close(ours.sequences_scores, reference.sequences_scores, atol=1e-5, rtol=1e-5)
        assert ours.past_key_values.cross_attention_cache.layers[0].keys.shape[0] == 2  # 2 sources, 6 beams
    kept = dict(kwargs, return_dict_in_generate=False)
    first = model.generate(**kept)
    cache = model._kept_static_cache.cache
    assert torch.equal(model.generate(**kept), first) and model._kept_static_cache.cache is cache
    greedy = dict(
        kept, input_ids=inputs["input_ids"].repeat(3, 1), attention_mask=inputs["attention_mask"].repeat(3, 1)
    )
    greedy.update(num_beams=1, do_sample=False)
    out = model.generate(**greedy)
    assert (
        model._kept_static_cache.cache is not cache
        and getattr(model._kept_static_cache.cache, "rows_per_source", 1) == 1
    )
    model.release_decoding_memory()
    monkeypatch.setattr(fast_decoding, "SHARED_SOURCE_KEYS", False)
    assert torch.equal(out, model.generate(**greedy))


@pytest.mark.parametrize(
    "loop",
    [dict(), dict(sequence_bias={(5,): -1.0})],  # archlab's loop; transformers' (a processor it does not take)
    ids=["archlab's loop", "transformers' loop"],
)
def test_a_copy_after_compiled_decoding_decodes_with_its_own_weights(loop):
    """transformers' compiled forward and archlab's are kept on the model for the next call, several bound to its
    `forward`: a `copy.deepcopy` (TRL's reference model, an EMA copy) decoded with the original's weights, and
    `torch.save(model)` failed to pickle them. Copies and pickles now leave them out and compile their own."""
    model = decoder_variant("positions_rope")
    config = cpu_compile_config(fullgraph=False)
    ids = torch.randint(3, 97, (1, 6), generator=torch.Generator().manual_seed(1))
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, **loop)
    model.generate(ids, cache_implementation="static", compile_config=config, **kwargs)
    kept = {name for name in vars(model) if name.startswith(("_compiled", "_guarded", "_kept"))}
    assert kept and kept <= set(fast_decoding.KEPT_COMPILED + fast_decoding.KEPT_MEMORY)

    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin.lm_head.weight.neg_()
    expected = twin.generate(ids, **kwargs)  # the dynamic cache, eager
    assert torch.equal(twin.generate(ids, cache_implementation="static", compile_config=config, **kwargs), expected)

    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert torch.equal(loaded.generate(ids, **kwargs), model.generate(ids, **kwargs))


# ---- assisted decoding and prompt lookup with a static cache ------------------------------------------------------


def _draft_of(model, noise: float = 0.05):
    """A copy of `model` with its weights perturbed: its drafts are accepted in part, rejected in part."""
    draft = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for parameter in draft.parameters():
            parameter.add_(noise * torch.randn(parameter.shape, generator=generator))
    return draft


ONE_ROW = dict(max_new_tokens=16, do_sample=False, pad_token_id=0, eos_token_id=None)


@pytest.mark.parametrize("name", ["positions_sinusoidal", "rope_llama3", "moe"])
def test_prompt_lookup_with_a_static_cache_decodes_as_greedy_decoding(name):
    """Prompt lookup drafts up to `max_length` tokens, one past a static cache of `max_length - 1` positions
    (transformers: an IndexError at the last check); the drafts are capped at `max_length - 1`."""
    model = decoder_variant(name)
    prompt = _prompts(1, 97)["input_ids"]
    greedy = model.generate(prompt, **ONE_ROW)
    looked_up = model.generate(prompt, prompt_lookup_num_tokens=3, cache_implementation="static", **ONE_ROW)
    assert torch.equal(looked_up, greedy)


@pytest.mark.parametrize("name", ["all_sliding_attention", "local_global"])
def test_assisted_decoding_with_a_static_cache_keeps_sliding_layers_whole(name):
    """A window-long sliding layer past its window cannot be cropped back after rejected drafts (transformers:
    "Assisted decoding requires a cache that can be cropped"); assisted decoding keeps those layers whole."""
    model = decoder_variant(name)
    prompt = _prompts(1, 97)["input_ids"]
    greedy = model.generate(prompt, **ONE_ROW)
    static = dict(cache_implementation="static", **ONE_ROW)
    assert torch.equal(model.generate(prompt, assistant_model=_draft_of(model), **static), greedy)
    assert torch.equal(model.generate(prompt, prompt_lookup_num_tokens=3, **static), greedy)


def test_seq2seq_assisted_decoding_asked_for_a_static_cache_decodes_with_the_dynamic_cache(notices):
    """transformers crops an encoder-decoder's cache only when dynamic (a TypeError after the first check): the
    static cache asked for falls back to the dynamic one with one line saying why."""
    model = seq2seq_variant("positions_relative_bias")
    source = torch.randint(3, 61, (1, 7), generator=torch.Generator().manual_seed(1))
    greedy = model.generate(source, max_new_tokens=12, do_sample=False, eos_token_id=None)
    assisted = model.generate(
        source,
        assistant_model=_draft_of(model),
        cache_implementation="static",
        max_new_tokens=12,
        do_sample=False,
        eos_token_id=None,
    )
    assert torch.equal(assisted, greedy)
    assert len(notices) == 1 and "assisted decoding" in notices[0] and "\n" not in notices[0]


def test_a_pad_outside_the_vocabulary_keeps_the_compiled_loop_out(on_cuda):
    """The compiled loop feeds the pad to a finished row for a few steps (and indexes by it): with a pad outside the
    vocabulary (legacy configs' -1) a single row decodes in transformers' loop, which stops at its end."""
    model = decoder_variant("positions_rope")
    prompt = _prompts(1, 97)["input_ids"]
    kwargs = dict(max_new_tokens=10, do_sample=False, compile_config=cpu_compile_config(fullgraph=False))
    free = model.generate(prompt, pad_token_id=0, eos_token_id=None, **kwargs)
    eos = int(free[0, 8])
    out = model.generate(prompt, pad_token_id=-1, eos_token_id=eos, **kwargs)
    assert torch.equal(out, free[:, :9])
