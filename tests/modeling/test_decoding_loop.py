"""decoding_loop.py: greedy decoding with the whole step in one function gives transformers' own loop's output — the
same tokens, the same logits and scores per step, the same returned cache — for every catalogue variant it takes,
with end-of-sequence tokens ending rows at different steps or all rows early, and min_length / min_new_tokens; it
compiles as one graph (`fullgraph=True`) that a second call with another prompt reuses; the calls it does not take
run transformers' loop; and generate's static cache is reused by the next call.

Here the step runs uncompiled, or compiled by dynamo's "eager" backend (tracing only, no code generation); a real
inductor compile is in tests/integration/test_compile.py, CUDA graphs in tests/integration/test_fast_decoding_gpu.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import CompileConfig, StoppingCriteria, StoppingCriteriaList, TextStreamer

from archlab import DecoderForCausalLM
from archlab.modeling import (
    cache_spans,
    compile_fallback,
    decoding_loop,
    fast_decoding,
    loop_processors,
    sliding_layers,
)

from helpers import (
    DECODER_VARIANTS,
    NO_STATIC_CACHE,
    SEQ2SEQ_VARIANTS,
    assert_close_to_scale,
    character_tokenizer,
    decoder_variant,
    digit_tokenizer,
    randomised,
    seq2seq_variant,
    tiny_decoder_config,
)

# Sliding-window variants (window 4): their own tests, generations shorter and longer than WHOLE_CACHE_WINDOWS windows.
SLIDING = {"all_sliding_attention", "local_global", "alibi_local_global"}
OUTPUTS = dict(do_sample=False, return_dict_in_generate=True, output_logits=True, output_scores=True)


def _prompts(batch: int, vocab: int = 97) -> dict[str, torch.Tensor]:
    """`batch` prompts of 6 tokens; with more than one, the first is left-padded by 2."""
    ids = torch.randint(3, vocab, (batch, 6), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    if batch > 1:
        mask[0, :2] = 0
        ids[0, :2] = 0
    return {"input_ids": ids, "attention_mask": mask}


def _compile_config(backend: str | None) -> CompileConfig:
    """A config under which transformers compiles the decoding step on CPU too (`_compile_all_devices`)."""
    config = CompileConfig(backend=backend or "eager", mode=None, fullgraph=True)
    config._compile_all_devices = True
    return config


@pytest.fixture
def loop_calls(monkeypatch) -> list[int]:
    """Counts `decode` calls; the step runs uncompiled (tracing every variant would take minutes)."""
    calls: list[int] = []
    decode = decoding_loop.decode

    def counted(*args, **kwargs):
        calls.append(1)
        return decode(*args, **kwargs)

    monkeypatch.setattr(fast_decoding, "decode", counted)
    monkeypatch.setattr(fast_decoding, "compiled_decoding_step", lambda model, config: decoding_loop.decoding_step)
    return calls


def _both(model, loop_calls, **kwargs):
    """(transformers' loop, this loop) on a static cache, with the same arguments."""
    reference = model.generate(cache_implementation="static", **kwargs)
    assert not loop_calls
    ours = model.generate(cache_implementation="static", compile_config=_compile_config(None), **kwargs)
    assert loop_calls == [1]
    loop_calls.clear()
    return reference, ours


def _assert_same(reference, ours) -> None:
    assert torch.equal(ours.sequences, reference.sequences)
    for name in ("logits", "scores"):
        expected, actual = getattr(reference, name), getattr(ours, name)
        assert len(actual) == len(expected), name
        for step, (a, b) in enumerate(zip(actual, expected)):
            assert_close_to_scale(a, b, msg=f"{name} of step {step}")  # cache spans: sums of other lengths
    cache, expected_cache = (cache_spans.self_attention_cache(o.past_key_values) for o in (ours, reference))
    assert int(cache.get_seq_length()) == int(expected_cache.get_seq_length())


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("name", sorted(set(DECODER_VARIANTS) - NO_STATIC_CACHE - SLIDING))
def test_every_variant_decodes_as_transformers_loop(name, batch, loop_calls):
    model = decoder_variant(name)
    inputs = _prompts(batch)
    if model.config.prefix_lm:
        inputs["prefix_lengths"] = torch.full((batch,), 4)
    reference, ours = _both(model, loop_calls, **inputs, **OUTPUTS, max_new_tokens=12, pad_token_id=0)
    _assert_same(reference, ours)


def _sources(model) -> dict[str, torch.Tensor]:
    """3 source sentences of 7 tokens for an encoder-decoder, the second right-padded by 2."""
    ids = torch.randint(3, model.config.vocab_size, (3, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    return {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask}


@pytest.mark.parametrize("name", sorted(SEQ2SEQ_VARIANTS))
def test_encoder_decoders_decode_as_transformers_loop(name, loop_calls):
    """Greedy decoding of the encoder-decoder (what `archlab.translate` does by default): the decoder's steps take the
    encoder states and the source mask; rows end at end-of-sequence tokens after a minimum length."""
    model = seq2seq_variant(name)
    inputs = _sources(model)
    free = model.generate(**inputs, do_sample=False, max_new_tokens=12, eos_token_id=None)
    eos = sorted({int(free[row, 1 + step]) for row, step in enumerate((3, 6, 9))})  # after the start token
    kwargs = dict(**inputs, **OUTPUTS, max_new_tokens=20, eos_token_id=eos, min_new_tokens=2)
    reference, ours = _both(model, loop_calls, **kwargs)
    _assert_same(reference, ours)


def _assert_same_windows(reference, ours) -> None:
    """The returned caches' window-long sliding layers hold the same length and keys (ours unrolled from rings)."""
    for index in sliding_layers.window_long_layers(reference.past_key_values):
        expected, actual = reference.past_key_values.layers[index], ours.past_key_values.layers[index]
        assert type(actual) is type(expected) and actual.cumulative_length_int == expected.cumulative_length_int
        held = min(expected.cumulative_length_int, expected.max_cache_len)
        for name in ("keys", "values"):
            assert_close_to_scale(getattr(actual, name)[:, :, :held], getattr(expected, name)[:, :, :held], msg=name)


@pytest.mark.parametrize("prompt", [6, 30])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("name", sorted(SLIDING))
def test_caches_over_four_windows_decode_sliding_layers_as_rings(name, batch, prompt, loop_calls):
    """Past `WHOLE_CACHE_WINDOWS` windows (window 4, 40 new tokens: the ring of 4 + 16 slots wraps twice; a prompt of
    30 is longer than the ring), the loop decodes the window-long sliding layers as rings: transformers' loop's
    tokens and logits, the dynamic cache's, and a returned cache whose window-long layers hold transformers' keys."""
    model = decoder_variant(name)
    inputs = _prompts(batch)
    if prompt > 6:
        inputs = {key: torch.cat([value, value[:, -1:].expand(-1, prompt - 6)], dim=1) for key, value in inputs.items()}
        inputs["input_ids"][:, 6:] = torch.arange(3, 3 + prompt - 6)
    kwargs = dict(**inputs, **OUTPUTS, max_new_tokens=40, pad_token_id=0, eos_token_id=None, no_repeat_ngram_size=1)
    reference, ours = _both(model, loop_calls, **kwargs)
    assert ours.sequences.shape[1] == prompt + 40
    _assert_same(reference, ours)
    _assert_same_windows(reference, ours)
    dynamic = model.generate(**kwargs, cache_implementation="dynamic")
    assert torch.equal(dynamic.sequences, ours.sequences)
    for step, (a, b) in enumerate(zip(ours.logits, dynamic.logits)):
        assert_close_to_scale(a, b, msg=f"logits of step {step}")


def test_rings_rewind_the_steps_past_the_end(loop_calls):
    """Rows ending at new tokens 21, 25 and 27: the loop ran on to its next check (step 31), and the rings, rewound,
    leave transformers' window in the returned cache, which then goes on decoding as transformers' does. A ring
    keeps enough slots past its window for every step the loop may run past the end."""
    assert sliding_layers.RING_SPARE_SLOTS >= decoding_loop.CHECK_EVERY - 1
    model = decoder_variant("local_global")
    inputs = _prompts(3)
    eos = _ending_tokens(model, inputs, (21, 25, 27))
    kwargs = dict(**inputs, **OUTPUTS, max_new_tokens=40, pad_token_id=0, eos_token_id=eos)
    reference, ours = _both(model, loop_calls, **kwargs)
    assert ours.sequences.shape[1] < inputs["input_ids"].shape[1] + 40
    _assert_same(reference, ours)
    _assert_same_windows(reference, ours)
    _assert_continue_alike(model, reference, ours)


def test_rings_sample_and_stream_as_whole_layers(loop_calls, monkeypatch):
    """Sampling (top-k 10) over 40 new tokens with a fixed seed: the loop draws the same tokens with rings as with the
    sliding layers kept whole (the same loop, the same draws, the same window), and a streamer gets them all."""
    model = decoder_variant("local_global")
    kwargs = dict(**_prompts(3), do_sample=True, top_k=10, max_new_tokens=40, min_new_tokens=40, pad_token_id=0)
    kwargs.update(cache_implementation="static", compile_config=_compile_config(None))

    class Collected:
        def __init__(self):
            self.tokens = []

        def put(self, value):
            self.tokens.append(value)

        def end(self):
            pass

    def sampled(streamer=None):
        torch.manual_seed(7)
        return model.generate(**kwargs, streamer=streamer)

    streamer = Collected()
    rings = sampled(streamer)
    monkeypatch.setattr(sliding_layers, "WHOLE_CACHE_WINDOWS", 100)
    model.release_decoding_memory()
    whole = sampled()
    assert loop_calls == [1, 1]
    assert torch.equal(rings, whole)
    streamed = torch.cat([chunk.reshape(3, -1) for chunk in streamer.tokens[1:]], dim=1)  # after the prompt
    assert torch.equal(streamed, rings[:, 6:])


@pytest.mark.parametrize("name", ["all_sliding_attention", "all_chunked_attention"])
def test_ring_steps_compile_as_one_graph_and_keep_their_rings(name, loop_calls):
    """The ring's slot, mask and write trace into the step (fullgraph=True); a second call with another prompt
    recompiles nothing and reuses the window-long layers' rings (the same addresses: CUDA graphs replay). Sliding
    and chunked (Llama 4) layers alike."""
    torch._dynamo.reset()
    model = decoder_variant(name)
    config = _compile_config("eager")
    kwargs = dict(do_sample=False, max_new_tokens=24, pad_token_id=0, eos_token_id=None, cache_implementation="static")
    inputs = _prompts(2)
    loop_calls.clear()
    monkey = pytest.MonkeyPatch()
    with monkey.context() as patch:  # the compiled step this time
        patch.setattr(fast_decoding, "compiled_decoding_step", decoding_loop.compiled_decoding_step)
        expected = model.generate(**inputs, **kwargs)
        assert torch.equal(model.generate(**inputs, compile_config=config, **kwargs), expected)
        cache = model._kept_static_cache.cache
        rings = [layer.ring for layer in cache.layers]
        addresses = [ring.keys.data_ptr() for ring in rings]
        with torch._dynamo.config.patch(error_on_recompile=True):
            shorter = {key: value[:, 1:] for key, value in inputs.items()}
            expected = model.generate(**shorter, **kwargs)
            assert torch.equal(model.generate(**shorter, compile_config=config, **kwargs), expected)
    assert model._kept_static_cache.cache is cache
    assert [layer.ring.keys.data_ptr() for layer in cache.layers] == addresses


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("name", sorted(SLIDING))
def test_sliding_windows_keep_the_whole_cache_and_take_the_loop(name, batch, loop_calls):
    """A cache of at most `WHOLE_CACHE_WINDOWS` windows (here 4 windows of 4, the first row left-padded, and the
    usual case of windows of thousands and generations of hundreds): its sliding layers keep every key
    (`WholeCacheSlidingLayer`) with the window in the mask, the loop takes the call, and the output is transformers'
    loop's and the dynamic cache's, whose sliding layers drop the keys that leave the window."""
    model = decoder_variant(name)
    kwargs = dict(**_prompts(batch), **OUTPUTS, max_new_tokens=10, pad_token_id=0)  # 15 positions, 10 past the window
    assert model.config.sliding_window == 4
    reference, ours = _both(model, loop_calls, **kwargs)
    _assert_same(reference, ours)
    assert any(isinstance(layer, sliding_layers.WholeCacheSlidingLayer) for layer in ours.past_key_values.layers)
    dynamic = model.generate(**kwargs, cache_implementation="dynamic")
    assert torch.equal(dynamic.sequences, ours.sequences)
    for step, (a, b) in enumerate(zip(ours.logits, dynamic.logits)):
        assert_close_to_scale(a, b, msg=f"logits of step {step}")


def _ending_tokens(model, inputs, steps: tuple[int, ...]) -> list[int]:
    """Tokens that, taken as end-of-sequence tokens, end row b at new token `steps[b]` (or later, when a row ends
    earlier at one of them): the tokens greedy decoding picks there without any end-of-sequence token."""
    free = model.generate(**inputs, do_sample=False, max_new_tokens=max(steps) + 1, eos_token_id=None, pad_token_id=0)
    prompt = inputs["input_ids"].shape[1]
    return sorted({int(free[row, prompt + step]) for row, step in enumerate(steps)})


def _assert_continue_alike(model, reference, ours) -> None:
    """Both returned caches (the first row left-padded by 2) go on decoding 5 tokens alike, in transformers' loop."""
    follow = dict(max_new_tokens=5, do_sample=False, eos_token_id=None, pad_token_id=0, cache_implementation=None)
    mask = torch.ones_like(reference.sequences)
    mask[0, :2] = 0
    continued = [
        model.generate(input_ids=out.sequences, attention_mask=mask, past_key_values=out.past_key_values, **follow)
        for out in (reference, ours)
    ]
    assert torch.equal(continued[0], continued[1])


def test_rows_ending_at_different_steps(loop_calls):
    model = decoder_variant("positions_rope")
    inputs = _prompts(3)
    eos = _ending_tokens(model, inputs, (2, 9, 30))
    reference, ours = _both(model, loop_calls, **inputs, **OUTPUTS, max_new_tokens=40, pad_token_id=0, eos_token_id=eos)
    _assert_same(reference, ours)
    assert (ours.sequences[:, 6:] == 0).any()  # finished rows were padded


def test_all_rows_ending_early_drop_the_extra_steps_and_rewind_the_cache(loop_calls):
    """Every row ends by new token 3; the loop reads the device every CHECK_EVERY steps, so it ran further: those
    tokens are not returned and the cache forgets their keys (its length is transformers')."""
    model = decoder_variant("positions_rope")
    inputs = _prompts(2)
    eos = _ending_tokens(model, inputs, (1, 3))
    reference, ours = _both(model, loop_calls, **inputs, **OUTPUTS, max_new_tokens=40, pad_token_id=0, eos_token_id=eos)
    assert ours.sequences.shape[1] < inputs["input_ids"].shape[1] + decoding_loop.CHECK_EVERY
    _assert_same(reference, ours)
    _assert_continue_alike(model, reference, ours)  # the returned cache goes on decoding as transformers' does


@pytest.mark.parametrize("minimum", [dict(min_new_tokens=7), dict(min_length=10), dict(min_length=9, min_new_tokens=5)])
def test_minimum_lengths_ban_the_end_of_sequence_tokens_as_transformers_does(minimum, loop_calls):
    model = decoder_variant("positions_rope")
    inputs = _prompts(3)
    eos = _ending_tokens(model, inputs, (1, 2, 3))
    kwargs = dict(**inputs, **OUTPUTS, **minimum, max_new_tokens=20, pad_token_id=0, eos_token_id=eos)
    reference, ours = _both(model, loop_calls, **kwargs)
    _assert_same(reference, ours)


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_as_transformers_applies_it(penalty, loop_calls):
    """Every token of the sequence so far is penalised — the prompt's too, except each row's left padding (generate
    skips it) — and the tokens chosen since; sampling with top-k 1 shows it applies before the warpers."""
    model = decoder_variant("positions_rope")
    inputs = _prompts(3)
    kwargs = dict(**inputs, **OUTPUTS, max_new_tokens=16, pad_token_id=0, repetition_penalty=penalty)
    reference, ours = _both(model, loop_calls, **kwargs)
    _assert_same(reference, ours)
    plain = model.generate(**dict(kwargs, repetition_penalty=1.0), cache_implementation="static")
    assert not torch.equal(plain.sequences, reference.sequences)  # the penalty changed the choices
    sampled = dict(kwargs, do_sample=True, top_k=1, temperature=0.9)
    reference, ours = _both(model, loop_calls, **sampled)
    assert torch.equal(ours.sequences, reference.sequences)


@pytest.mark.parametrize("kind", ["decoder", "seq2seq"])
@pytest.mark.parametrize("n", [1, 2, 3])
def test_no_repeat_ngram_size_as_transformers_bans(n, kind, loop_calls):
    """The n-gram ban on device (every window of the sequence so far compared with its last n - 1 tokens) bans what
    transformers' host-side n-gram table bans: the same tokens and the same -inf pattern at every step."""
    model = decoder_variant("positions_rope") if kind == "decoder" else seq2seq_variant("positions_sinusoidal")
    inputs = _prompts(3) if kind == "decoder" else _sources(model)
    kwargs = dict(**inputs, **OUTPUTS, max_new_tokens=10 if n == 1 else 24, pad_token_id=0, no_repeat_ngram_size=n)
    reference, ours = _both(model, loop_calls, **kwargs)
    _assert_same(reference, ours)
    assert any(torch.isinf(a).any() for a in ours.scores)  # the ban did ban something


@pytest.mark.parametrize("kind", ["decoder", "seq2seq"])
def test_forced_bos_and_eos_tokens_as_transformers_forces_them(kind, loop_calls):
    """forced_bos_token_id (the first token of an encoder-decoder's output, or of a decoder's after a one-token
    prompt) and forced_eos_token_id (the last one at max_length): Marian's and BART's generation settings."""
    model = decoder_variant("positions_rope") if kind == "decoder" else seq2seq_variant("positions_sinusoidal")
    inputs = _sources(model) if kind == "seq2seq" else {"input_ids": torch.ones(3, 1, dtype=torch.long)}
    kwargs = dict(**inputs, **OUTPUTS, max_new_tokens=9, pad_token_id=0, eos_token_id=None)
    kwargs.update(forced_bos_token_id=11, forced_eos_token_id=[7, 9], repetition_penalty=1.3, no_repeat_ngram_size=2)
    reference, ours = _both(model, loop_calls, **kwargs)
    _assert_same(reference, ours)
    start = 1  # the decoder start token, or the one-token prompt
    assert (ours.sequences[:, start] == 11).all() and torch.isin(ours.sequences[:, -1], torch.tensor([7, 9])).all()


def test_forced_tokens_in_an_unusual_order_keep_transformers_loop():
    """The step forces after the bans and the penalty, as transformers' own processor list does; a hand-made list
    that bans after forcing, or forces EOS before BOS, is left to transformers' loop."""
    from transformers import LogitsProcessorList
    from transformers.generation.logits_process import (
        ForcedBOSTokenLogitsProcessor,
        ForcedEOSTokenLogitsProcessor,
        NoRepeatNGramLogitsProcessor,
        SuppressTokensLogitsProcessor,
    )

    bos, eos, ngram = (
        ForcedBOSTokenLogitsProcessor(4),
        ForcedEOSTokenLogitsProcessor(10, 2),
        NoRepeatNGramLogitsProcessor(2),
    )
    split = loop_processors.split_processors
    assert split(LogitsProcessorList([ngram, bos, eos])).forced[1][0] == 9
    assert split(LogitsProcessorList([bos, ngram])) is None
    assert split(LogitsProcessorList([eos, bos])) is None
    assert split(LogitsProcessorList([bos, bos])) is None
    suppress = SuppressTokensLogitsProcessor([5, 6])  # transformers lists it after the forced ones
    assert split(LogitsProcessorList([bos, eos, suppress])).bans[0][1] == loop_processors.ALWAYS
    assert split(LogitsProcessorList([bos, eos, SuppressTokensLogitsProcessor([4])])) is None  # a forced one banned


@pytest.mark.parametrize("kind", ["decoder", "seq2seq"])
def test_suppressed_tokens_and_one_token_bad_words_are_banned_as_transformers_bans_them(kind, loop_calls):
    model = decoder_variant("positions_rope") if kind == "decoder" else seq2seq_variant("positions_sinusoidal")
    inputs = _prompts(3) if kind == "decoder" else _sources(model)
    free = model.generate(**inputs, do_sample=False, max_new_tokens=10, pad_token_id=0, eos_token_id=None)
    picked = sorted(set(free[:, -10:].flatten().tolist()))  # tokens greedy decoding picks: the bans matter
    chosen = (picked + [token for token in range(3, 40) if token not in picked])[:4]
    kwargs = dict(**inputs, **OUTPUTS, max_new_tokens=10, pad_token_id=0, eos_token_id=[chosen[0]])
    kwargs.update(suppress_tokens=chosen[1:3], bad_words_ids=[[chosen[3]], [chosen[0]]])  # the EOS one is dropped
    reference, ours = _both(model, loop_calls, **kwargs)
    _assert_same(reference, ours)
    assert not torch.isin(ours.sequences[:, -10:], torch.tensor(chosen[1:])).any()


def test_repetition_penalty_in_an_encoder_decoder(loop_calls):
    model = seq2seq_variant("positions_sinusoidal")
    kwargs = dict(**_sources(model), **OUTPUTS, max_new_tokens=16, repetition_penalty=1.5)
    reference, ours = _both(model, loop_calls, **kwargs)
    _assert_same(reference, ours)


def test_plain_sequences_without_return_dict(loop_calls):
    model = decoder_variant("moe")
    inputs = _prompts(3)
    kwargs = dict(
        **inputs, do_sample=False, max_new_tokens=10, pad_token_id=0, eos_token_id=_ending_tokens(model, inputs, (4,))
    )
    reference, ours = _both(model, loop_calls, **kwargs)
    assert isinstance(ours, torch.Tensor) and torch.equal(ours, reference)


class _NeverStop(StoppingCriteria):
    def __call__(self, input_ids, scores, **kwargs):
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(sequence_bias={(5,): -2.0}),  # a processor of its own
        dict(bad_words_ids=[[5, 6]]),  # bad words of several tokens (one-token ones are bans: taken)
        dict(output_hidden_states=True, return_dict_in_generate=True),
        dict(stopping_criteria=StoppingCriteriaList([_NeverStop()])),  # a stopping criterion of its own
    ],
)
def test_calls_it_does_not_take_run_transformers_loop(kwargs, loop_calls):
    model = decoder_variant("positions_rope")
    inputs = _prompts(2)
    config = _compile_config(None)
    model.generate(
        **inputs, **kwargs, max_new_tokens=4, pad_token_id=0, cache_implementation="static", compile_config=config
    )
    assert not loop_calls
    model.generate(**inputs, max_new_tokens=4, pad_token_id=0, cache_implementation="static", compile_config=config)
    assert loop_calls  # the same call without it takes the loop


def _stop_string_case():
    """A one-character-per-token model, three left-padded prompts, and per row the text of two of its own greedy
    new tokens (at steps 2-3, 7-8 and 12-13): stop strings that end every row, each at its own step (or earlier,
    where another row's string comes first)."""
    tokenizer = character_tokenizer()
    model = randomised(DecoderForCausalLM(tiny_decoder_config(vocab_size=len(tokenizer))))
    inputs = tokenizer(["def f", "ab", "hello wor"], return_tensors="pt", padding=True)
    prompt = inputs["input_ids"].shape[1]
    free = model.generate(**inputs, do_sample=False, max_new_tokens=30, pad_token_id=0, eos_token_id=None)
    stops = [tokenizer.decode(free[row, prompt + step : prompt + step + 2]) for row, step in enumerate((2, 7, 12))]
    return tokenizer, model, inputs, stops


@pytest.mark.parametrize("eos_token_id", [None, 2])
def test_stop_strings_end_rows_as_transformers_loop(eos_token_id, loop_calls):
    """Matched inside the step, on each row's prompt and new tokens; with an end-of-sequence id the rows that
    stopped are padded, without one they go on until every row has stopped, as transformers' loop does."""
    tokenizer, model, inputs, stops = _stop_string_case()
    kwargs = dict(**inputs, **OUTPUTS, max_new_tokens=30, pad_token_id=0, eos_token_id=eos_token_id)
    reference, ours = _both(model, loop_calls, **kwargs, stop_strings=stops, tokenizer=tokenizer)
    _assert_same(reference, ours)
    prompt = inputs["input_ids"].shape[1]
    assert ours.sequences.shape[1] <= prompt + 14  # every row stopped by step 13
    if eos_token_id is not None:
        assert (ours.sequences[:, prompt:] == 0).any()  # rows that stopped first were padded


def test_stop_strings_compile_in_the_step():
    """fullgraph=True: transformers' StopStringCriteria traces into the step; a second call recompiles nothing."""
    torch._dynamo.reset()
    tokenizer, model, inputs, stops = _stop_string_case()
    kwargs = dict(**inputs, do_sample=False, max_new_tokens=30, pad_token_id=0, eos_token_id=2, tokenizer=tokenizer)
    kwargs.update(stop_strings=stops, cache_implementation="static")
    expected = model.generate(**kwargs)
    for index in range(2):
        with torch._dynamo.config.patch(error_on_recompile=index > 0):
            assert torch.equal(model.generate(**kwargs, compile_config=_compile_config("eager")), expected)
    assert hasattr(model, "_compiled_decoding_step")


def test_max_time_is_read_at_the_loops_device_checks(loop_calls):
    """max_time is not checked every token but at the host's read every CHECK_EVERY tokens: a call past its time
    ends there, with every token chosen so far; a call within it is unchanged."""
    model = decoder_variant("positions_rope")
    inputs = _prompts(2)
    kwargs = dict(**inputs, do_sample=False, max_new_tokens=40, pad_token_id=0, eos_token_id=None)
    kwargs.update(cache_implementation="static", compile_config=_compile_config(None))
    full = model.generate(**kwargs)
    assert torch.equal(model.generate(**kwargs, max_time=0.0), full[:, : 6 + decoding_loop.CHECK_EVERY])
    assert torch.equal(model.generate(**kwargs, max_time=600.0), full)
    assert loop_calls == [1, 1, 1]


def test_streaming_gives_the_text_as_transformers_loop(loop_calls, capsys):
    """The first new token at once, then chunks: the printed text is transformers' loop's."""
    tokenizer = digit_tokenizer()
    model = randomised(DecoderForCausalLM(tiny_decoder_config(vocab_size=len(tokenizer))))
    inputs = tokenizer(["1 2 3"], return_tensors="pt")
    kwargs = dict(**inputs, do_sample=False, max_new_tokens=40, pad_token_id=0, eos_token_id=None)
    printed = []
    for config in (None, _compile_config(None)):
        model.generate(**kwargs, streamer=TextStreamer(tokenizer), cache_implementation="static", compile_config=config)
        printed.append(capsys.readouterr().out)
    assert loop_calls == [1] and printed[0] == printed[1] and len(printed[0].split()) > 40


def test_sampling_with_top_k_1_is_greedy_decoding(loop_calls):
    model = decoder_variant("positions_rope")
    inputs = _prompts(3)
    greedy = model.generate(**inputs, do_sample=False, max_new_tokens=20, pad_token_id=0, cache_implementation="static")
    kwargs = dict(do_sample=True, top_k=1, temperature=0.7, max_new_tokens=20, pad_token_id=0)
    sampled = model.generate(**inputs, **kwargs, cache_implementation="static", compile_config=_compile_config(None))
    assert loop_calls == [1] and torch.equal(sampled, greedy)


def test_sampling_draws_within_the_warped_scores_and_repeats_with_the_seed(loop_calls):
    """Every sampled token has a finite processed score (inside top-k and top-p), the scores are transformers'
    warped scores of the sampled sequence, and the same seed draws the same sequence."""
    model = decoder_variant("positions_rope")
    inputs = _prompts(3)
    kwargs = dict(
        OUTPUTS,
        do_sample=True,
        temperature=1.5,
        top_k=20,
        top_p=0.9,
        max_new_tokens=24,
        pad_token_id=0,
        eos_token_id=None,
    )
    config = _compile_config(None)
    runs = []
    for _ in range(2):
        torch.manual_seed(0)
        runs.append(model.generate(**inputs, **kwargs, cache_implementation="static", compile_config=config))
    assert loop_calls == [1, 1] and torch.equal(runs[0].sequences, runs[1].sequences)
    tokens = runs[0].sequences[:, 6:]
    assert len(set(tokens.flatten().tolist())) > 10  # sampled, not one repeated token
    for step, scores in enumerate(runs[0].scores):
        assert torch.isfinite(scores.gather(1, tokens[:, step : step + 1])).all(), f"step {step}"
        assert (torch.isfinite(scores).sum(-1) <= 20).all()
    # transformers' loop, fed the sampled tokens, gives the same logits and warped scores step by step
    forced = model.generate(
        **inputs, **kwargs, cache_implementation="static", prefix_allowed_tokens_fn=_force(tokens, prompt=6)
    )
    assert torch.equal(forced.sequences, runs[0].sequences)
    for step, (ours, theirs) in enumerate(zip(runs[0].logits, forced.logits)):
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4, msg=f"logits of step {step}")


def _force(tokens: torch.Tensor, prompt: int):
    """A `prefix_allowed_tokens_fn` allowing only the given token at each new position (for each batch row)."""
    return lambda row, ids: [int(tokens[row, len(ids) - prompt])]


def test_the_exponential_race_draws_from_the_softmax():
    """`sample` draws index i with probability softmax(scores)_i, like torch.multinomial: 20,000 draws from one
    distribution are within 0.02 total variation of it (a wrong draw, e.g. argmax of probs + noise, is far off)."""
    generator = torch.Generator().manual_seed(0)
    scores = torch.randn(12, generator=generator) * 1.5
    scores[3] = -math.inf  # never drawn
    torch.manual_seed(0)
    draws = loop_processors.sample(scores.expand(20_000, 12).clone())
    frequencies = torch.bincount(draws, minlength=12).double() / len(draws)
    probabilities = torch.softmax(scores.double(), -1)
    assert frequencies[3] == 0
    assert 0.5 * (frequencies - probabilities).abs().sum() < 0.02


def test_without_compilation_transformers_loop_runs(loop_calls):
    """The loop is for compiled decoding: a static cache on CPU without a compile config stays in transformers' loop."""
    model = decoder_variant("positions_rope")
    model.generate(**_prompts(2), max_new_tokens=4, pad_token_id=0, cache_implementation="static")
    model.generate(
        **_prompts(2), max_new_tokens=4, pad_token_id=0, compile_config=_compile_config(None), disable_compile=True
    )
    assert not loop_calls


def test_the_encoder_decoder_step_compiles_as_one_graph():
    torch._dynamo.reset()
    model = seq2seq_variant("positions_relative_bias")
    inputs = _sources(model)
    kwargs = dict(do_sample=False, max_new_tokens=12, eos_token_id=[5, 7], cache_implementation="static")
    kwargs["no_repeat_ngram_size"] = 2  # the device-side n-gram ban traces too
    kwargs["forced_eos_token_id"] = 5  # and the forced tokens (Marian's setting)
    for index, minimum in enumerate((3, 6)):
        expected = model.generate(**inputs, min_new_tokens=minimum, **kwargs)
        with torch._dynamo.config.patch(error_on_recompile=index > 0):
            compiled = model.generate(
                **inputs, compile_config=_compile_config("eager"), min_new_tokens=minimum, **kwargs
            )
        assert torch.equal(compiled, expected)
    assert hasattr(model, "_compiled_decoding_step")


@pytest.mark.parametrize("name", ["positions_rope", "moe_shared_expert_dense_sparse", "positions_alibi", "prefix_lm"])
def test_the_step_compiles_as_one_graph_reused_by_later_calls(name):
    """fullgraph=True: no graph break anywhere in the step (masks, forward, token choice); then calls with another
    prompt length, another batch content and other minimum lengths recompile nothing."""
    torch._dynamo.reset()
    model = decoder_variant(name)
    config = _compile_config("eager")
    inputs = _prompts(3)
    if model.config.prefix_lm:
        inputs["prefix_lengths"] = torch.full((3,), 4)
    kwargs = dict(
        do_sample=False, max_new_tokens=12, pad_token_id=0, eos_token_id=[5, 7], cache_implementation="static"
    )
    expected = model.generate(**inputs, min_new_tokens=3, **kwargs)
    assert torch.equal(model.generate(**inputs, compile_config=config, min_new_tokens=3, **kwargs), expected)
    assert hasattr(model, "_compiled_decoding_step")
    with torch._dynamo.config.patch(error_on_recompile=True):
        shorter = {key: value[:, 1:] if key != "prefix_lengths" else value for key, value in inputs.items()}
        later = dict(min_new_tokens=6, repetition_penalty=1.2)  # other bans, a penalty: buffers, not graph constants
        expected = model.generate(**shorter, **later, **kwargs)
        assert torch.equal(model.generate(**shorter, compile_config=config, **later, **kwargs), expected)


def test_the_sampling_step_compiles_as_one_graph():
    """Sampling with temperature, top-k and top-p: the warpers and the draw are in the graph too (fullgraph=True), a
    second call recompiles nothing, and top-k 1 gives greedy decoding's tokens."""
    torch._dynamo.reset()
    model = decoder_variant("positions_rope")
    inputs = _prompts(2)
    kwargs = dict(do_sample=True, temperature=0.8, top_p=0.95, max_new_tokens=10, pad_token_id=0, eos_token_id=None)
    kwargs["cache_implementation"] = "static"
    greedy = model.generate(**inputs, do_sample=False, max_new_tokens=10, pad_token_id=0, eos_token_id=None)
    config = _compile_config("eager")
    assert torch.equal(model.generate(**inputs, **kwargs, top_k=1, compile_config=config), greedy)
    assert hasattr(model, "_compiled_decoding_step")
    with torch._dynamo.config.patch(error_on_recompile=True):
        sampled = model.generate(**inputs, **kwargs, top_k=1, compile_config=config)
    assert torch.equal(sampled, greedy)


def _failing_backend(graph, example_inputs):
    raise RuntimeError("Cannot find a working triton installation")


@pytest.mark.parametrize(
    "name, kwargs, pieces",
    [
        ("positions_rope", {}, {"the decoding step"}),  # this loop's step
        ("positions_rope", dict(compile_prefill=True), {"the prefill", "the decoding step"}),  # and its prefill
        ("positions_rope", dict(bad_words_ids=[[5, 6]]), {"the decoding step"}),  # transformers' loop, its forward
        ("positions_sinusoidal", dict(num_beams=3), {"the beam-search step"}),  # beam search's steps (seq2seq)
    ],
)
def test_a_failing_compiler_leaves_eager_decoding_with_one_notice(name, kwargs, pieces, monkeypatch):
    """No working Triton, an inductor error: the piece the compiler failed on (a step, the prefill) runs eagerly,
    and so do the next ones, in each decoding loop that compiles: one notice per piece."""
    torch._dynamo.reset()
    model = seq2seq_variant(name) if "num_beams" in kwargs else decoder_variant(name)
    inputs = _prompts(2, model.config.vocab_size)
    kwargs = dict(kwargs, do_sample=False, max_new_tokens=10, pad_token_id=0, eos_token_id=None)
    kwargs["cache_implementation"] = "static"
    expected = model.generate(**inputs, **kwargs)
    config = CompileConfig(backend=_failing_backend, mode=None)
    config._compile_all_devices = True
    notices: list[str] = []
    monkeypatch.setattr(compile_fallback.logger, "warning", notices.append)
    monkeypatch.setattr(compile_fallback, "FALL_BACK_TO_EAGER", True)  # (the tests' default raises: conftest.py)
    for _ in range(2):
        assert torch.equal(model.generate(**inputs, **kwargs, compile_config=config), expected)
    assert {piece for piece in pieces for notice in notices if f"Compiling {piece} failed" in notice} == pieces
    assert len(notices) == len(pieces), notices
    assert all("triton" in notice and "decodes eagerly" in notice for notice in notices), notices


def test_compiling_on_cuda_is_announced_once_with_how_to_skip_it(monkeypatch):
    """generate's first calls on CUDA wait for the compiler: one line says so, once per model class and step, and
    names `disable_compile=True`; on CPU (nothing compiled by default) nothing is said."""
    lines: list[str] = []
    monkeypatch.setattr(compile_fallback.logger, "warning_once", lines.append)

    class Model:
        def __init__(self, device: str) -> None:
            self.device = torch.device(device)

    compile_fallback.announce_compiling(Model("cpu"), "the decoding step")
    assert lines == []
    compile_fallback.eager_on_compiler_failure(Model("cuda"), None, None, "the beam-search step")
    assert len(lines) == 1 and "Model: compiling the beam-search step" in lines[0], lines
    assert "disable_compile=True" in lines[0] and "\n" not in lines[0]


def _spy_on_static_caches(model) -> list:
    """The static caches `model.generate` prepares from now on, in order (`del model._prepare_static_cache` stops)."""
    caches = []
    prepare = model._prepare_static_cache

    def spy(*args, **kwargs):
        caches.append(prepare(*args, **kwargs))
        return caches[-1]

    model._prepare_static_cache = spy
    return caches


def test_generate_reuses_its_static_cache_unless_it_returned_it():
    """Compiled graphs and CUDA graphs hold the cache's addresses: a new cache every call records them again.
    `release_decoding_memory` frees the kept cache and the loop's buffers."""
    model = decoder_variant("positions_rope")
    inputs = _prompts(2)
    caches = _spy_on_static_caches(model)
    kwargs = dict(do_sample=False, max_new_tokens=8, pad_token_id=0, eos_token_id=None, cache_implementation="static")
    first = model.generate(**inputs, **kwargs)
    second = model.generate(**inputs, **kwargs)
    assert caches[0] is caches[1] and torch.equal(first, second)
    returned = model.generate(**inputs, **kwargs, return_dict_in_generate=True)  # reused, then handed to the user
    assert caches[2] is caches[0] and torch.equal(returned.sequences, first)
    after = model.generate(**inputs, **kwargs)
    assert caches[3] is not returned.past_key_values and torch.equal(after, first)
    assert model.generate(**inputs, **dict(kwargs, max_new_tokens=9)).shape[1] == first.shape[1] + 1  # longer: new
    assert caches[4] is not caches[3]
    assert torch.equal(model.generate(**inputs, **kwargs, compile_config=_compile_config("eager")), first)
    assert "_decoding_buffers" in model.__dict__  # the compiled loop's
    model.release_decoding_memory()
    assert "_kept_static_cache" not in model.__dict__ and "_decoding_buffers" not in model.__dict__
    assert torch.equal(model.generate(**inputs, **kwargs), first)  # allocated again


@pytest.mark.parametrize("num_beams", [1, 3])
def test_an_encoder_decoder_reuses_its_static_cache_for_sources_padded_to_one_length(num_beams):
    """An encoder-decoder's cache (self-attention and cross-attention parts) is kept too, for the next call whose
    source pads to the same length (source_padding.py: multiples of SOURCE_STEP, 4 here, and at least the longest so
    far): what a translation server replays without recording again. The tokens are those of the unpadded source."""
    model = seq2seq_variant("positions_sinusoidal")
    caches = _spy_on_static_caches(model)
    lengths = (5, 7, 9, 5, 12)  # padded to 8, 8, 12, 12, 12
    sources = [torch.randint(3, 50, (2, n), generator=torch.Generator().manual_seed(n)) for n in lengths]
    kwargs = dict(num_beams=num_beams, max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None)
    kwargs.update(cache_implementation="static")
    outputs = [model.generate(source, **kwargs, compile_config=_compile_config("eager")) for source in sources]
    assert caches[1] is caches[0] and caches[2] is not caches[0]  # past the step: a cross-attention cache of its own
    assert caches[3] is caches[2] and caches[4] is caches[2]  # shorter sources after it pad to the longest
    assert model._kept_static_cache.cache.cross_attention_cache.layers[0].keys.shape[2] == 12
    del model._prepare_static_cache
    for source, output in zip(sources, outputs):
        assert torch.equal(output, model.generate(source, **kwargs, disable_compile=True))  # unpadded


@pytest.mark.parametrize("vocab", [1023, 1024, 1025, 32000, 5000])
def test_the_two_stage_argmax_picks_torch_argmax_index(vocab):
    """`first_argmax` (the vocabulary reduced in chunks, then the chunks): `torch.argmax`'s index for every row —
    the first of tied maxima (within a chunk, across chunks, at a chunk's edge), the first NaN, 0 for a row all -inf,
    a maximum in the last, partly padded chunk — eagerly and compiled (inductor on CPU)."""
    from archlab.modeling.loop_processors import ARGMAX_CHUNK, first_argmax

    scores = torch.randn(8, vocab, generator=torch.Generator().manual_seed(vocab))
    top = scores.max() + 1
    scores[1, [7, 900]] = top  # tied, in one chunk (or two, below the split)
    scores[2, [ARGMAX_CHUNK - 1, ARGMAX_CHUNK]] = top  # tied across a chunk's edge
    scores[3, [vocab - 1, 3]] = top  # the first of two, the other in the last chunk
    scores[4] = -math.inf
    scores[5, [vocab // 2, vocab - 2]] = math.nan
    scores[6, vocab - 1] = top  # alone in the last chunk, padded
    expected = torch.argmax(scores, dim=-1)
    assert torch.equal(first_argmax(scores), expected)
    torch._dynamo.reset()
    assert torch.equal(torch.compile(first_argmax, backend="inductor", dynamic=False)(scores), expected)


@pytest.mark.parametrize("batch", [1, 3])
def test_a_vocabulary_the_token_choice_splits_decodes_as_transformers_loop(batch, loop_calls):
    """With 2,100 tokens (the loop's argmax in chunks, `first_argmax`) greedy decoding gives transformers' tokens."""
    model = randomised(DecoderForCausalLM(tiny_decoder_config(vocab_size=2100)))
    reference, ours = _both(model, loop_calls, **_prompts(batch), **OUTPUTS, max_new_tokens=12, pad_token_id=0)
    _assert_same(reference, ours)
