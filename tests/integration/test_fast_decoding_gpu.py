"""The fast decoding path on a CUDA GPU (skipped without one): `generate` with no cache setting takes the static cache
and compiles its decoding step (inductor, CUDA graphs), and gives the tokens of eager decoding (`disable_compile=True`:
the dynamic cache, nothing compiled) at batch 1 and 16 — in fp32 exactly, in bf16 up to a divergence at a near-tie,
with the logits of the steps up to it within bf16 rounding — and a second call recompiles nothing: the
dense decoder, the mixture of experts (its one-token step), local/global sliding windows (kept whole, and past 4
windows as rings), latent attention (DeepSeek-V3's), GPT-OSS's layers (sinks, biased clamped experts), and seq2seq beam
search.

    python -m pytest -m gpu tests/integration/test_fast_decoding_gpu.py
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import DynamicCache, StaticCache

from archlab import DecoderConfig, DecoderForCausalLM, Seq2SeqConfig, Seq2SeqForConditionalGeneration
from archlab.modeling import sliding_layers
from archlab.modeling.fused_projections import inference_projections

from helpers import assert_close_to_scale

# `gpu`: skipped without CUDA (tests/conftest.py) and selected by the GPU session's `-m gpu`; `slow`: CI's second run
pytestmark = [pytest.mark.gpu, pytest.mark.slow]

VOCAB = 512
SHAPE = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8)
MODELS = {
    "dense": lambda: DecoderForCausalLM(DecoderConfig(**SHAPE, num_key_value_heads=2)),
    "moe": lambda: DecoderForCausalLM(
        DecoderConfig(**SHAPE, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2)
    ),
    # window 16: keys leave it from the prompt on; 32 + 24 positions is under 4 windows, so the sliding layers are
    # kept whole (sliding_layers.WholeCacheSlidingLayer) where eager decoding's drop them
    "sliding": lambda: DecoderForCausalLM(
        DecoderConfig(
            **SHAPE, num_key_value_heads=2, sliding_window=16, layer_types=["sliding_attention", "full_attention"] * 2
        )
    ),
    # DeepSeek-V3's latent attention (decoding steps attend over the latents, kv_b_proj absorbed)
    "latent": lambda: DecoderForCausalLM(
        DecoderConfig(**SHAPE, kv_lora_rank=64, q_lora_rank=48, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32)
    ),
    # GPT-OSS's layers: sinks on local and global layers, biased attention, biased experts with the clamped SwiGLU
    "gpt_oss": lambda: DecoderForCausalLM(
        DecoderConfig(
            **SHAPE,
            num_key_value_heads=2,
            attention_sinks=True,
            attention_bias=True,
            sliding_window=16,
            layer_types=["sliding_attention", "full_attention"] * 2,
            num_local_experts=8,
            num_experts_per_tok=2,
            router_bias=True,
            expert_bias=True,
            swiglu_limit=7.0,
            swiglu_up_offset=1.0,
            hidden_act="quick_gelu",
        )
    ),
    # Llama 4's layers: chunked rotating layers (blocks of 16) with a QK-norm without a gain, NoPE global layers with
    # the temperature tuning, experts weighing their input with a shared expert
    "llama4": lambda: DecoderForCausalLM(
        DecoderConfig(
            **SHAPE,
            num_key_value_heads=2,
            attention_chunk_size=16,
            layer_types=["chunked_attention", "full_attention"] * 2,
            nope_layers=[1, 3],
            use_qk_norm=True,
            qk_norm_after_rope=True,
            qk_norm_weight=False,
            qk_norm_nope_layers=False,
            attn_temperature_tuning=True,
            floor_scale=16,
            num_local_experts=8,
            num_experts_per_tok=1,
            router_score_function="sigmoid",
            norm_topk_prob=False,
            routing_weights_on_input=True,
            shared_expert_intermediate_size=512,
            shared_expert_gate=False,
        )
    ),
    "seq2seq": lambda: Seq2SeqForConditionalGeneration(
        Seq2SeqConfig(
            vocab_size=VOCAB,
            d_model=256,
            encoder_layers=3,
            decoder_layers=3,
            encoder_attention_heads=8,
            decoder_attention_heads=8,
            encoder_ffn_dim=512,
            decoder_ffn_dim=512,
            dropout=0.0,
        )
    ),
}
NEW_TOKENS = 24


def _model(kind: str, dtype: torch.dtype):
    torch.manual_seed(0)
    model = MODELS[kind]()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # std 0.08 (~1.3 / sqrt(d)): logits spread out, greedy decoding does not loop on one token
        for name, parameter in model.named_parameters():
            if "norm" not in name:
                parameter.normal_(0.0, 0.08, generator=generator)
    return model.to("cuda", dtype).eval()


def _inputs(kind: str, batch: int) -> dict[str, torch.Tensor]:
    """Prompts of 16 to 32 tokens, padded to the longest: on the left for decoders, on the right for the encoder."""
    generator = torch.Generator().manual_seed(batch)
    ids = torch.randint(3, VOCAB, (batch, 32), generator=generator)
    lengths = torch.randint(16, 33, (batch,), generator=generator)
    lengths[0] = 32
    positions = torch.arange(32)
    real = positions[None] >= 32 - lengths[:, None] if kind != "seq2seq" else positions[None] < lengths[:, None]
    return {"input_ids": ids.masked_fill(~real, 0).cuda(), "attention_mask": real.long().cuda()}


def _generate(model, inputs, kind: str, **kwargs):
    beams = dict(num_beams=4, num_return_sequences=2) if kind == "seq2seq" else {}
    return model.generate(
        **inputs,
        **beams,
        **kwargs,
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        do_sample=False,
        pad_token_id=0,
        output_logits=kind != "seq2seq",
        output_scores=kind == "seq2seq",
        return_dict_in_generate=True,
    )


def _count_recordings(monkeypatch) -> list:
    """From now on, one entry per CUDA graph recorded (`torch.cuda.CUDAGraph.capture_begin` calls)."""
    captures = []
    capture_begin = torch.cuda.CUDAGraph.capture_begin
    monkeypatch.setattr(
        torch.cuda.CUDAGraph, "capture_begin", lambda *a, **k: captures.append(1) or capture_begin(*a, **k)
    )
    return captures


def _stage_of_recording(monkeypatch) -> list:
    """From now on, for each CUDA graph recorded, the stack's archlab frames that led to it (prefill or step), then
    why cudagraph trees recorded rather than replayed: the recorded graphs of that function it checked and failed
    since the last recording (`CUDAGraphNode.check_invariants`' status and, for moved static or graph-managed
    inputs, which ones), or none — a function (a compiled graph, or a new size of a dynamic one) not recorded before."""
    import traceback

    from torch._inductor import cudagraph_trees

    stages, failed = [], []
    capture_begin = torch.cuda.CUDAGraph.capture_begin
    check_invariants = cudagraph_trees.CUDAGraphNode.check_invariants

    def checked(node, inputs):
        status, reason = check_invariants(node, inputs)
        if status != cudagraph_trees.CheckInvariantStatus.SUCCESS:
            failed.append(f"{status.name}: {reason()}"[:600])
        return status, reason

    def recording(*args, **kwargs):
        frames = [
            f"{f.name}@{f.filename.rsplit('/', 1)[-1]}" for f in traceback.extract_stack() if "archlab" in f.filename
        ]
        stages.append([*frames[-4:], failed[:] or "no recorded graph of this function was checked"])
        failed.clear()
        return capture_begin(*args, **kwargs)

    monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_begin", recording)
    monkeypatch.setattr(cudagraph_trees.CUDAGraphNode, "check_invariants", checked)
    return stages


def _assert_agree(fast, eager, dtype: torch.dtype, prompt: int, kind: str) -> None:
    """fp32: the same tokens, every step's logits within 1e-3 of the scale. bf16: every step's logits within bf16
    rounding of the scale (3e-2) up to the first step at which some row picks another token, that step included:
    both sides score the same prefix there, so logits that close make the different pick a near-tie. Behind a
    router (`moe`), a near-tie among the expert scores sends a token to another expert and moves some logits by more
    than rounding without changing a token (an H200 run: 18 of 512 at step 9, by 4.4 % of the scale): there the steps
    before the first different token, each with 90 % of its logits within rounding. Beam search (`seq2seq`) swaps
    beams at near-ties before the returned sequences show it (a first token of a returned sequence can differ): there
    the first step, which scores one prefix for every beam."""
    steps, eager_steps = fast.logits or fast.scores, eager.logits or eager.scores
    if dtype == torch.float32:
        assert torch.equal(fast.sequences, eager.sequences)
        compared, rtol = len(steps), 1e-3
    elif kind == "seq2seq":
        compared, rtol = 1, 3e-2
    else:
        differs = (fast.sequences != eager.sequences).any(0).nonzero()
        first_difference = int(differs[0]) - prompt if len(differs) else len(steps)
        compared, rtol = max(1, min(len(steps), first_difference + (kind != "moe"))), 3e-2
    for step in range(compared):
        a, b = steps[step].float(), eager_steps[step].float()
        finite = torch.isfinite(b)  # beam scores hold -inf
        if kind in ("moe", "gpt_oss", "llama4") and dtype != torch.float32:  # (a router choice flips at a near-tie)
            scale = b[finite].abs().max()
            close = ((a[finite] - b[finite]).abs() <= rtol * scale).float().mean().item()
            assert close >= 0.9, f"step {step}: {close:.1%} of the logits within {rtol:g} of the scale"
        else:
            assert_close_to_scale(a[finite], b[finite], rtol=rtol, msg=f"step {step}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("batch", [1, 16])
@pytest.mark.parametrize("kind", sorted(MODELS))
def test_fast_decoding_equals_eager_and_does_not_recompile(kind: str, batch: int, dtype: torch.dtype):
    torch._dynamo.reset()
    counters.clear()
    model = _model(kind, dtype)
    inputs = _inputs(kind, batch)
    prompt = 1 if kind == "seq2seq" else inputs["input_ids"].shape[1]  # seq2seq outputs start with the start token

    eager = _generate(model, inputs, kind, disable_compile=True)
    fast = _generate(model, inputs, kind)  # no flag: the default on CUDA, which compiles while it warms up
    cache = fast.past_key_values.self_attention_cache if kind == "seq2seq" else fast.past_key_values
    eager_cache = eager.past_key_values.self_attention_cache if kind == "seq2seq" else eager.past_key_values
    assert isinstance(cache, StaticCache) and isinstance(eager_cache, DynamicCache)
    graphs = counters["stats"]["unique_graphs"]
    assert graphs > 0, "the decoding step was not compiled"
    # greedy decoders and beam search compile their whole step (decoding_loop.py, beam_loop.py)
    assert hasattr(model, "_compiled_beam_step" if kind == "seq2seq" else "_compiled_decoding_step")
    assert counters["inductor"]["cudagraph_skips"] == 0, "the compiled step does not run as a CUDA graph"
    _assert_agree(fast, eager, dtype, prompt, kind)

    with torch._dynamo.config.patch(error_on_recompile=True):
        again = _generate(model, inputs, kind)
    assert counters["stats"]["unique_graphs"] == graphs
    assert torch.equal(again.sequences, fast.sequences)


def test_the_projection_layout_costs_no_memory_and_keeps_the_logits():
    """generate on CUDA reads q/k/v and gate/up as one product per group (fused_projections.py): laying the
    parameters out side by side does not grow the memory in use, and the one-product forward gives the separate
    products' logits within bf16 rounding (other GEMM shapes, other kernels)."""
    model = _model("dense", torch.bfloat16)
    inputs = _inputs("dense", 4)
    with torch.no_grad():
        expected = model(**inputs).logits.float()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        with inference_projections(model) as groups:
            torch.cuda.synchronize()
            assert groups == 2 * SHAPE["num_hidden_layers"]
            assert torch.cuda.memory_allocated() <= before + 512 * groups  # the allocator rounds blocks to 512 bytes
            actual = model(**inputs).logits.float()
    assert_close_to_scale(actual, expected, rtol=3e-2)
    address = model.model.layers[0].self_attn.q_proj.weight.data_ptr()
    _generate(model, inputs, "dense")
    assert model.model.layers[0].self_attn.q_proj.weight.data_ptr() == address  # generate reuses the layout


@pytest.mark.parametrize("own_cache", [False, True], ids=["returned", "own"])
def test_a_conversation_continued_from_the_cache_equals_eager_decoding(own_cache):
    """Three turns, each passing the last call's cache back with the next message appended: from the default's
    returned static cache (grown in place each turn, cache_growth.py) or from a StaticCache of one's own, every turn
    on the compiled whole-step loop, the tokens of eager decoding from a dynamic cache (fp32)."""
    torch._dynamo.reset()
    counters.clear()
    model = _model("dense", torch.float32)
    inputs = _inputs("dense", 4)
    kwargs = dict(do_sample=False, max_new_tokens=8, pad_token_id=0, eos_token_id=None, return_dict_in_generate=True)
    runs = {}
    for side in ("fast", "eager"):
        ids, mask = inputs["input_ids"], inputs["attention_mask"]
        cache = StaticCache(config=model.config, max_cache_len=128) if own_cache and side == "fast" else None
        if side == "eager":
            cache = DynamicCache(config=model.config)
        runs[side] = []
        for turn in range(3):
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                **kwargs,
                **({"past_key_values": cache} if cache is not None else {}),
            )
            runs[side].append(out.sequences)
            cache = out.past_key_values
            reply = torch.randint(3, VOCAB, (4, 5), generator=torch.Generator().manual_seed(turn)).cuda()
            ids = torch.cat([out.sequences, reply], dim=-1)
            mask = torch.cat([mask, torch.ones_like(ids[:, mask.shape[1] :])], dim=-1)
        if side == "fast":
            assert isinstance(cache, StaticCache)
    assert counters["inductor"]["cudagraph_skips"] == 0
    for turn, (fast, eager) in enumerate(zip(runs["fast"], runs["eager"])):
        assert torch.equal(fast, eager), f"turn {turn}"


def test_greedy_calls_reuse_one_recorded_step(monkeypatch):
    """Calls that do not return the cache reuse generate's static cache and the loop's buffers: the CUDA graph
    recorded in the first call is replayed by the next ones (no new recording, no skip), with the same tokens, and
    rows ending at an end-of-sequence token end as in eager decoding."""
    torch._dynamo.reset()
    counters.clear()
    model = _model("dense", torch.float32)
    inputs = _inputs("dense", 4)
    free = model.generate(**inputs, do_sample=False, max_new_tokens=NEW_TOKENS, pad_token_id=0, disable_compile=True)
    eos = sorted({int(free[row, 32 + 3 * row]) for row in range(4)})  # rows end around new tokens 0, 3, 6, 9
    kwargs = dict(do_sample=False, max_new_tokens=NEW_TOKENS, pad_token_id=0, eos_token_id=eos)
    expected = model.generate(**inputs, **kwargs, disable_compile=True)
    outputs = [model.generate(**inputs, **kwargs) for _ in range(2)]  # the first records the step
    captures = _count_recordings(monkeypatch)
    outputs += [model.generate(**inputs, **kwargs) for _ in range(2)]
    assert counters["inductor"]["cudagraph_skips"] == 0
    assert not captures, "a later call recorded the step again"
    for output in outputs:
        assert torch.equal(output, expected)


def _generate_to_56(model, inputs: dict, length: int, **kwargs):
    """Greedy tokens of the last `length` positions of `inputs` up to 56 tokens: every call ends at the same cache
    length (generate keeps its static cache between them)."""
    prompt = {name: value[:, -length:] for name, value in inputs.items()}
    kwargs.update(do_sample=False, max_new_tokens=56 - length, min_new_tokens=56 - length, pad_token_id=0)
    return model.generate(**prompt, **kwargs)


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_the_compiled_prefill_replays_one_recorded_graph_per_bucket(kind, monkeypatch):
    """`compile_prefill=True` on CUDA: prompts of 32, 20 and 27 tokens (three rows, left-padded) are padded on the
    right to their bucket (prefill_buckets.py) and the prefill replays the CUDA graph recorded for it: after
    the calls that allocate the cache, compile and record (once with a mask, once without: the 20-token prompts have
    no padding left), prompts of other lengths in the bucket record nothing and
    compile nothing, with eager decoding's fp32 tokens (the same cache length every call: the kept cache). The
    mixture of experts too (its blocks leave the router's logits on the module, from the graph's memory)."""
    from archlab.modeling import cache_spans, compiled_prefill

    # one cache span (56 positions): with the tests' 2-position span steps (conftest.py) the 27-token call's steps
    # read a span of 32 that the calls before it had not (32 tokens: 40-56; 20 tokens: another graph, no mask) and
    # recorded its CUDA graph, as designed (a graph per span, test_cache_spans_record_once_each_...): an H200 saw it
    monkeypatch.setattr(cache_spans, "MIN_SPAN_STEP", 64)
    torch._dynamo.reset()
    counters.clear()
    model = _model(kind, torch.float32)
    inputs = _inputs(kind, 3)
    pads = []
    padded = compiled_prefill.padded_prefill_inputs
    monkeypatch.setattr(
        compiled_prefill, "padded_prefill_inputs", lambda *a: (lambda r: pads.append(r and r[1]) or r)(padded(*a))
    )

    def call(length, **kwargs):
        return _generate_to_56(model, inputs, length, compile_prefill=True, **kwargs)

    expected = {length: call(length, disable_compile=True) for length in (32, 20, 27)}
    outputs = [(32, call(32)) for _ in range(3)]  # allocates the kept cache; compiles the prefill; records it
    # 20 tokens: no row left-padded, so no mask (SDPA's is_causal) and a graph of its own (test_prefill_buckets.py)
    outputs += [(20, call(20)) for _ in range(2)]
    captures = _count_recordings(monkeypatch)
    stages = _stage_of_recording(monkeypatch)
    recorded = {}  # the graphs each call recorded, by where (an H200 found one: which call and stage says why)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for length in (20, 27, 32):
            before = len(stages)
            outputs.append((length, call(length)))
            recorded[length] = stages[before:]
    assert not captures, f"a prompt in the same bucket recorded a graph again: {recorded}"
    assert counters["inductor"]["cudagraph_skips"] == 0
    assert pads[-3:] == [34, 27, 22], pads  # to 54 tokens: the bucket (64) held below the cache's 55 positions
    for length, output in outputs:
        assert torch.equal(output, expected[length]), length


def test_prompts_of_other_lengths_replay_the_recorded_step(monkeypatch):
    """The default path (prefill not compiled): prompts of 27, 32, 30 and 31 tokens, left-padded, each call ending at
    the same cache length (the kept cache): after two calls of 27 tokens (the step compiled, its graph recorded for
    every cache span those steps read: 32 to 56 positions in the tests' 2-position span steps), prompts of other
    lengths, whose steps read those spans, record nothing and compile nothing, with eager decoding's fp32 tokens —
    what a server decoding prompts of every length needs: a graph per span, recorded once. (A shorter prompt's first
    steps read a shorter span, recorded then: what the prefill-bucket test above saw on an H200.)"""
    torch._dynamo.reset()
    counters.clear()
    model = _model("dense", torch.float32)
    inputs = _inputs("dense", 3)

    def call(length, **kwargs):
        return _generate_to_56(model, inputs, length, **kwargs)

    lengths = (27, 32, 30, 31)
    expected = {length: call(length, disable_compile=True) for length in lengths}
    outputs = [(27, call(27)) for _ in range(2)]
    captures = _count_recordings(monkeypatch)
    stages = _stage_of_recording(monkeypatch)
    recorded = {}
    with torch._dynamo.config.patch(error_on_recompile=True):
        for length in lengths[1:]:
            before = len(stages)
            outputs.append((length, call(length)))
            recorded[length] = stages[before:]
    assert not captures, f"a prompt of another length recorded the step again: {recorded}"
    assert counters["inductor"]["cudagraph_skips"] == 0
    for length, output in outputs:
        assert torch.equal(output, expected[length]), length


@pytest.mark.parametrize("local", ["sliding_attention", "chunked_attention"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_sliding_layers_decoded_as_rings_replay_one_recorded_step(dtype, local, monkeypatch):
    """Window 8, 32 + 24 positions: past 4 windows the sliding layers are window-long and the loop decodes them as
    rings — eager decoding's tokens, no cudagraph skip, and a second call records nothing and reuses the rings; beam
    search over rings gives eager beam search's sequences. Llama 4's chunked layers (chunks of 8) likewise."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    size = dict(sliding_window=8) if local == "sliding_attention" else dict(attention_chunk_size=8)
    config = DecoderConfig(**SHAPE, num_key_value_heads=2, **size, layer_types=[local, "full_attention"] * 2)
    model = DecoderForCausalLM(config).to("cuda", dtype).eval()
    model.load_state_dict(_model("dense", dtype).state_dict())
    inputs = _inputs("dense", 4)
    eager = _generate(model, inputs, "dense", disable_compile=True)
    fast = _generate(model, inputs, "dense")
    assert sliding_layers.window_long_layers(fast.past_key_values)
    assert all(layer.ring.is_initialized for layer in fast.past_key_values.layers if hasattr(layer, "ring"))
    assert counters["inductor"]["cudagraph_skips"] == 0, "the compiled step does not run as a CUDA graph"
    _assert_agree(fast, eager, dtype, inputs["input_ids"].shape[1], "sliding")
    plain = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    first = model.generate(**inputs, **plain)  # a cache of its own (the one before was returned): kept for the next
    captures = _count_recordings(monkeypatch)
    with torch._dynamo.config.patch(error_on_recompile=True):
        again = model.generate(**inputs, **plain)
    assert not captures, "a later call recorded the step again"
    assert torch.equal(again, first)
    if dtype == torch.float32:  # bf16: without output_logits the step is another graph, rounded otherwise
        assert torch.equal(first, fast.sequences)
    if dtype == torch.float32:  # beam search over the rings (bf16 beams may swap at near-ties)
        beams = dict(plain, num_beams=3)
        assert torch.equal(model.generate(**inputs, **beams), model.generate(**inputs, **beams, disable_compile=True))


def test_sampling_runs_as_a_cuda_graph_and_repeats_with_the_seed():
    """Sampling in the compiled step (the warpers and the draw inside the CUDA graph): no cudagraph skip, every token
    within top-k, different draws step to step, and the same seed draws the same tokens."""
    torch._dynamo.reset()
    counters.clear()
    model = _model("dense", torch.bfloat16)
    inputs = _inputs("dense", 4)
    kwargs = dict(do_sample=True, temperature=1.2, top_k=20, top_p=0.95, max_new_tokens=NEW_TOKENS, pad_token_id=0)
    kwargs.update(eos_token_id=None, return_dict_in_generate=True, output_scores=True)
    runs = []
    for _ in range(2):
        torch.manual_seed(0)
        runs.append(model.generate(**inputs, **kwargs))
    assert hasattr(model, "_compiled_decoding_step")
    assert counters["inductor"]["cudagraph_skips"] == 0, "the sampling step does not run as a CUDA graph"
    assert torch.equal(runs[0].sequences, runs[1].sequences)
    tokens = runs[0].sequences[:, 32:]
    assert len(set(tokens.flatten().tolist())) > NEW_TOKENS
    for step, scores in enumerate(runs[0].scores):
        assert torch.isfinite(scores.gather(1, tokens[:, step : step + 1])).all(), f"step {step}"


@pytest.mark.parametrize("num_beams", [1, 4])
def test_translation_settings_run_in_the_cuda_graph(num_beams: int):
    """Marian's and BART's generation settings — forced BOS/EOS tokens, the n-gram ban, suppressed tokens — inside
    the compiled step of greedy decoding and beam search: eager's tokens in fp32, no cudagraph skip."""
    torch._dynamo.reset()
    counters.clear()
    model = _model("seq2seq", torch.float32)
    inputs = _inputs("seq2seq", 4)
    kwargs = dict(num_beams=num_beams, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, eos_token_id=[5, 7])
    kwargs.update(forced_bos_token_id=11, forced_eos_token_id=7, no_repeat_ngram_size=3, suppress_tokens=[8, 9])
    eager = model.generate(**inputs, **kwargs, disable_compile=True)
    fast = model.generate(**inputs, **kwargs)
    assert hasattr(model, "_compiled_beam_step" if num_beams > 1 else "_compiled_decoding_step")
    assert counters["inductor"]["cudagraph_skips"] == 0
    assert torch.equal(fast, eager)
    assert (fast[:, 1] == 11).all()


def test_stop_strings_run_in_the_cuda_graph():
    """Stop strings matched inside the compiled step on the GPU: eager's tokens, no cudagraph skip."""
    from helpers import character_tokenizer

    torch._dynamo.reset()
    counters.clear()
    tokenizer = character_tokenizer()
    torch.manual_seed(0)
    model = DecoderForCausalLM(DecoderConfig(**dict(SHAPE, vocab_size=len(tokenizer)), num_key_value_heads=2))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" not in name:
                parameter.normal_(0.0, 0.08)
    model = model.cuda().eval()
    inputs = {k: v.cuda() for k, v in tokenizer(["def f", "ab", "hello"], return_tensors="pt", padding=True).items()}
    free = model.generate(**inputs, do_sample=False, max_new_tokens=20, pad_token_id=0, disable_compile=True)
    prompt = inputs["input_ids"].shape[1]
    stops = [tokenizer.decode(free[row, prompt + 2 + 3 * row : prompt + 4 + 3 * row]) for row in range(3)]
    kwargs = dict(do_sample=False, max_new_tokens=20, pad_token_id=0, eos_token_id=2)
    kwargs.update(stop_strings=stops, tokenizer=tokenizer)
    eager = model.generate(**inputs, **kwargs, disable_compile=True)
    fast = model.generate(**inputs, **kwargs)
    assert hasattr(model, "_compiled_decoding_step")
    assert counters["inductor"]["cudagraph_skips"] == 0
    assert torch.equal(fast, eager) and fast.shape[1] < prompt + 20


@pytest.mark.parametrize("kind", ["dense", "seq2seq"])
def test_cache_spans_record_once_each_and_give_the_whole_cache_tokens(kind, monkeypatch):
    """On the default path each step reads the filled part of the static cache (cache_spans.py; the suite's
    2-position minimum: several spans per call here): the same tokens as steps reading the whole cache (fp32), no
    cudagraph skip, one compiled graph for every span, and a later call replays the graphs recorded for them."""
    from archlab.modeling import cache_spans

    torch._dynamo.reset()
    counters.clear()
    model = _model(kind, torch.float32)
    inputs = _inputs(kind, 4)
    kwargs = dict(do_sample=False, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, pad_token_id=0)
    if kind == "seq2seq":
        kwargs.update(num_beams=3)
    monkeypatch.setattr(cache_spans, "READ_SPANS", False)
    whole = model.generate(**inputs, **kwargs)
    monkeypatch.setattr(cache_spans, "READ_SPANS", True)
    with torch._dynamo.config.patch(recompile_limit=2):  # the whole-cache graph, then one for every span
        spans = [model.generate(**inputs, **kwargs) for _ in range(2)]
        captures = _count_recordings(monkeypatch)
        spans.append(model.generate(**inputs, **kwargs))
    assert counters["inductor"]["cudagraph_skips"] == 0
    assert not captures, "a later call recorded a span's step again"
    for output in spans:
        assert torch.equal(output, whole)


@pytest.mark.parametrize("kind", ["dense", "seq2seq"])
def test_beam_search_reorders_from_spares_as_in_place(kind, monkeypatch):
    """Beam search on the default path reorders its cache from a spare buffer (beam_reorder.py): the same sequences
    and scores as the in-place reorder (fp32), no cudagraph skip, the spares taken (the free memory allows them), and
    a third call — both buffers' roles recorded for every span by then — records nothing."""
    from archlab.modeling import beam_reorder, cache_spans

    torch._dynamo.reset()
    counters.clear()
    model = _model(kind, torch.float32)
    inputs = _inputs(kind, 4)
    kwargs = dict(num_beams=3, do_sample=False, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, pad_token_id=0)
    kwargs.update(return_dict_in_generate=True, output_scores=True)
    monkeypatch.setattr(beam_reorder, "DOUBLE_BUFFER", False)
    in_place = model.generate(**inputs, **kwargs)
    model.release_decoding_memory()
    monkeypatch.setattr(beam_reorder, "DOUBLE_BUFFER", True)
    spared = model.generate(**inputs, **kwargs)
    assert all(layer._spares is not None for layer in cache_spans.self_attention_layers(spared.past_key_values))
    if kind == "seq2seq":  # each source's cross-attention keys once, not once per beam (attention.rows_per_source)
        assert spared.past_key_values.cross_attention_cache.layers[0].keys.shape[0] == 4
    assert torch.equal(spared.sequences, in_place.sequences)
    assert_close_to_scale(spared.sequences_scores, in_place.sequences_scores, rtol=1e-4)
    kept = dict(kwargs, return_dict_in_generate=False)  # calls that keep the cache for the next one
    outputs = [model.generate(**inputs, **kept) for _ in range(2)]
    captures = _count_recordings(monkeypatch)
    outputs.append(model.generate(**inputs, **kept))
    assert counters["inductor"]["cudagraph_skips"] == 0
    assert not captures, "a later call recorded a step again"
    for output in outputs:
        assert torch.equal(output, in_place.sequences)


@pytest.mark.parametrize("num_beams", [1, 3])
def test_sources_of_other_lengths_replay_the_recorded_steps(num_beams, monkeypatch):
    """A translation job's batches each padded to their own longest sentence: on the default path each source is
    padded to a multiple of 64 positions and to the longest so far (source_padding.py), so after the first call the
    calls with sources of other lengths reuse its cache and replay its recorded steps (no recording, no skip), with
    eager decoding's tokens for the unpadded source."""
    from archlab.modeling import source_padding

    monkeypatch.setattr(source_padding, "SOURCE_STEP", 64)  # the production step (the suite's is 4)
    torch._dynamo.reset()
    counters.clear()
    model = _model("seq2seq", torch.float32)
    kwargs = dict(num_beams=num_beams, do_sample=False, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
    kwargs.update(pad_token_id=0)
    sources = [{k: v[:, :length] for k, v in _inputs("seq2seq", 4).items()} for length in (31, 20, 27)]
    outputs = [model.generate(**sources[0], **kwargs) for _ in range(2)]  # records the steps (both spare roles)
    captures = _count_recordings(monkeypatch)
    outputs += [model.generate(**source, **kwargs) for source in sources[1:]]
    assert counters["inductor"]["cudagraph_skips"] == 0
    assert not captures, "a source of another length recorded a step again"
    assert model._kept_static_cache.cache.cross_attention_cache.layers[0].keys.shape[2] == 64
    for source, output in zip(sources[:1] + sources, outputs):
        assert torch.equal(output, model.generate(**source, **kwargs, disable_compile=True))


# each case compiles a step of its own (10-20 s on an H100): the kinds and batches where each candidate changes most
CANDIDATE_CASES = [
    ("flex", "dense", 1),
    ("flex", "dense", 16),
    ("flex", "seq2seq", 1),
    ("tuned", "dense", 1),  # one-row products: the ones coordinate-descent tuning rewrites
    ("tuned", "seq2seq", 1),
    ("combo", "dense", 1),  # inductor's combo kernels alone (the H100's best batch-1 setting)
    ("combo", "seq2seq", 1),
    ("pdl", "dense", 1),  # the default's combo kernels with programmatic dependent launch (cuda-tuning's next row)
    ("triton", "dense", 1),  # archlab's Triton decoding attention (triton_decoding.py), with the default's options
    ("triton", "dense", 16),
    ("triton", "sliding", 1),  # a window in the mask
    ("triton", "seq2seq", 1),  # beam search's self-attention
    ("gemv", "dense", 1),  # archlab's SwiGLU + down-projection GEMV (triton_gemv.py)
    ("gemv", "sliding", 1),
    ("fused-block", "dense", 1),  # each layer's step as four GEMVs, norms and residuals inside (decode_block.py)
    ("fused-block", "dense", 4),  # the most rows the streaming GEMV takes
    ("fused-block", "dense", 16),  # the tensor-core GEMV's
    ("fused-block", "moe", 1),  # the attention half of an MoE layer
    ("moe-kernels", "moe", 1),  # the MoE's routed experts through archlab's Triton kernels (triton_moe.py)
    ("moe-kernels", "moe", 4),
    # all of archlab's kernels (fused layers, attention, routed experts) through their PDL twins (triton_launch.py),
    # inductor's kernels with programmatic dependent launch too: a kernel starts while the one before ends
    ("fused-pdl", "dense", 1),
    ("fused-pdl", "dense", 16),
    ("fused-pdl", "moe", 1),
    # the default's kernels with each layer's output projection and MLP as one persistent kernel (triton_layer_tail.py)
    ("layer-tail", "dense", 1),
]


@pytest.mark.parametrize("candidate, kind, batch", CANDIDATE_CASES)
def test_candidate_defaults_equal_eager_without_falling_back(candidate, kind, batch, monkeypatch):
    """The candidates for the decoding step's default (`--suite cuda-tuning` measures them): the self-attention
    through FlexAttention (flex_decoding.py) or archlab's Triton kernel (triton_decoding.py), the gated MLP's
    SwiGLU inside archlab's down-projection GEMV (triton_gemv.py), each pre-norm layer's step as four GEMVs with the
    norms and residual adds inside (decode_block.py), the MoE's routed experts through archlab's
    Triton kernels (triton_moe.py), inductor's coordinate-descent tuning, its combo kernels (the default since) and
    programmatic dependent launch (step_compile.py); archlab's kernels launched through their PDL twins (the
    default on CUDA since: `fused-pdl`), or alone and traced into the step by inductor (`torch.library.wrap_triton`,
    which an H200 found returning NaN where torch's analysis of the kernels failed). Each compiles (no fallback to
    eager decoding, no cudagraph skip) and gives eager decoding's fp32 tokens and logits."""
    from archlab.modeling import (
        compile_fallback,
        decode_block,
        flex_decoding,
        step_compile,
        triton_decoding,
        triton_gemv,
        triton_launch,
        triton_layer_tail,
        triton_moe,
    )
    from archlab.scripts.benchmark_cuda_decode import decode_kernel_switches

    torch._dynamo.reset()
    counters.clear()
    failures = []
    warning = compile_fallback.logger.warning  # (also what warning_once calls: the "compiling ..." notice)
    monkeypatch.setattr(
        compile_fallback.logger, "warning", lambda message, *a, **k: failures.append(message) or warning(message)
    )
    if candidate in ("triton", "gemv", "fused-block", "moe-kernels"):  # archlab's kernels traced into the step
        monkeypatch.setattr(triton_launch, "PDL_DEVICES", ())
    if candidate == "flex":
        monkeypatch.setattr(flex_decoding, "FLEX_DECODING_DEVICES", ("cuda",))
        monkeypatch.setattr(triton_decoding, "TRITON_DECODING_DEVICES", ())  # archlab's attention comes first
    elif candidate == "triton":
        monkeypatch.setattr(triton_decoding, "TRITON_DECODING_DEVICES", ("cuda",))
    elif candidate == "gemv":
        monkeypatch.setattr(triton_gemv, "GATED_DOWN_DEVICES", ("cuda",))
    elif candidate == "fused-block":
        monkeypatch.setattr(decode_block, "FUSED_BLOCK_DEVICES", ("cuda",))
        monkeypatch.setattr(decode_block, "FUSED_BLOCK_ROWS", batch)
    elif candidate == "moe-kernels":
        monkeypatch.setattr(triton_moe, "MOE_DECODE_DEVICES", ("cuda",))
    elif candidate in ("fused-pdl", "layer-tail"):
        for module, name in decode_kernel_switches():
            monkeypatch.setattr(module, name, ("cuda",))
        monkeypatch.setattr(decode_block, "FUSED_BLOCK_ROWS", batch)
        monkeypatch.setattr(triton_layer_tail, "TAIL_DEVICES", ("cuda",) if candidate == "layer-tail" else ())
    else:
        monkeypatch.setattr(step_compile, "TUNED_STEP_DEVICES", ("cuda",))
    if candidate == "combo":
        options = {"combo_kernels": True}
        monkeypatch.setattr(step_compile, "TUNED_STEP_OPTIONS", options)
    if candidate in ("pdl", "fused-pdl", "layer-tail"):
        options = {**step_compile.TUNED_STEP_OPTIONS, "triton.enable_pdl": True}
        monkeypatch.setattr(step_compile, "TUNED_STEP_OPTIONS", options)
    model = _model(kind, torch.float32)
    inputs = _inputs(kind, batch)
    prompt = 1 if kind == "seq2seq" else inputs["input_ids"].shape[1]
    eager = _generate(model, inputs, kind, disable_compile=True)
    fast = _generate(model, inputs, kind)
    assert not [message for message in failures if "failed" in message], failures
    assert counters["stats"]["unique_graphs"] > 0 and counters["inductor"]["cudagraph_skips"] == 0
    _assert_agree(fast, eager, torch.float32, prompt, kind)
    if candidate == "triton":  # the kernel takes this model's steps: its one-query self-attention on the GPU
        attention = model.get_decoder().layers[0].self_attn
        query = torch.zeros(batch, model.config.num_attention_heads, 1, attention.head_dim, device="cuda")
        mask = torch.ones(batch, 1, 1, 40, dtype=torch.bool, device="cuda")
        assert triton_decoding.triton_decoding_applies(attention, query, mask, {})
    if candidate == "moe-kernels":  # the kernels take this model's experts in its steps
        experts = model.model.layers[0].mlp.experts
        with torch.no_grad():
            assert triton_moe.moe_decode_applies(experts, torch.zeros(batch, model.config.hidden_size, device="cuda"))
    if candidate == "gemv":  # the kernel takes this model's MLPs in its steps
        mlp = model.model.layers[0].mlp
        with torch.no_grad():
            assert triton_gemv.gated_down_applies(mlp, torch.zeros(batch, 1, mlp.down_proj.in_features, device="cuda"))
    if candidate.startswith("fused") or candidate == "layer-tail":  # the fused step takes this model's layers
        step = torch.zeros(batch, 1, model.config.hidden_size, device="cuda")
        with torch.no_grad(), inference_projections(model):
            assert decode_block.fused_block_applies(model.model.layers[0], step)
            assert triton_layer_tail.layer_tail_applies(step) == (candidate == "layer-tail")
