"""The decoding step's self-attention as archlab's own Triton kernel (modeling/triton_decoding.py): the output of SDPA
for grouped and plain heads, boolean, additive and no masks, one program per row's keys or several (split-KV);
used only where it applies; greedy decoding through it (transformers' loop, and archlab's loop with its step traced
by dynamo) gives SDPA's tokens.

The kernels run where Triton does: on a GPU, or on a CPU through Triton's interpreter (tests/triton_interpreter.py),
which `test_kernels_through_the_triton_interpreter` starts in a fresh process (Triton must be installed: the GPU
image's torch brings it; CPU wheels of torch do not, and then those tests skip)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from archlab import DecoderForCausalLM
from archlab.modeling import triton_decoding
from archlab.modeling.attention import eager_attention_forward, one_token_grouped_sdpa
from archlab.modeling.triton_decoding import split_count, triton_decoding_applies

from helpers import tiny_decoder_config
from triton_interpreter import (
    DEVICE,
    greedy_tokens,
    interpreted_run_of,
    interpreter_gaps_filled,
    left_padded_batch,
    runs_kernels,
    with_dependent_launch_code,
)

_interpreter_gaps = interpreter_gaps_filled("archlab.modeling.triton_decoding")


def test_a_row_s_keys_split_only_when_the_cache_is_long_and_the_batch_small():
    assert split_count(1, 4, 384) == 6  # the benchmark's 128 + 256 tokens: six programs per KV head
    assert split_count(1, 4, 2048) == 32  # TARGET_PROGRAMS (128) over 4 KV heads
    assert split_count(16, 4, 384) == 2
    assert split_count(1, 4, triton_decoding.KEYS_PER_PROGRAM) == 1
    assert split_count(1, 4, 4 * triton_decoding.KEYS_PER_PROGRAM) == 4
    assert split_count(1, 4, 1000 * triton_decoding.KEYS_PER_PROGRAM) == triton_decoding.TARGET_PROGRAMS // 4
    assert split_count(64, 4, 8 * triton_decoding.KEYS_PER_PROGRAM) == 1  # 256 programs already


def _attention(**overrides):
    model = DecoderForCausalLM(tiny_decoder_config(head_dim=16, **overrides)).eval()
    return model.model.layers[0].self_attn


def test_the_kernel_applies_only_to_one_query_steps_on_the_listed_devices(monkeypatch):
    attention = _attention()
    query, mask = torch.zeros(2, 4, 1, 16), torch.ones(2, 1, 1, 5, dtype=torch.bool)
    monkeypatch.setattr(triton_decoding, "triton", object())  # as where Triton is installed
    monkeypatch.setattr(triton_decoding, "TRITON_DECODING_DEVICES", ("cpu",))
    assert triton_decoding_applies(attention, query, mask, {})
    assert triton_decoding_applies(attention, query, None, {})  # no mask: every key
    assert triton_decoding_applies(attention, query, mask.float(), {})  # additive
    assert not triton_decoding_applies(attention, torch.zeros(2, 4, 3, 16), torch.ones(2, 1, 3, 5).bool(), {})
    assert not triton_decoding_applies(attention, query, torch.ones(2, 4, 1, 5, dtype=torch.bool), {})  # per head
    assert not triton_decoding_applies(attention, query, mask, {"position_bias": torch.zeros(2, 4, 1, 5)})
    assert not triton_decoding_applies(_attention(attn_logit_softcapping=30.0), query, mask, {})
    assert not triton_decoding_applies(attention, torch.zeros(2, 4, 1, 24), mask, {})  # not a power of two
    assert not triton_decoding_applies(attention, query.double(), mask, {})
    assert not triton_decoding_applies(attention, query.requires_grad_(), mask, {})  # no backward
    assert not triton_decoding_applies(attention.train(), query.detach(), mask, {})  # dropout
    attention.eval()
    eager = _attention(attn_implementation="eager")
    assert not triton_decoding_applies(eager, query, mask, {})
    monkeypatch.setattr(triton_decoding, "TRITON_DECODING_DEVICES", ())
    assert not triton_decoding_applies(attention, query, mask, {})
    monkeypatch.setattr(triton_decoding, "TRITON_DECODING_DEVICES", ("cpu",))
    monkeypatch.setattr(triton_decoding, "triton", None)  # CPU wheels of torch: no Triton
    assert not triton_decoding_applies(attention, query, mask, {})


def _inputs(batch, heads, kv_heads, keys, dim, mask_kind, mask_batch, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    # the query as the model hands it over: (B, 1, H, D) transposed; keys a span of a longer cache
    query = torch.randn(batch, 1, heads, dim, generator=g).transpose(1, 2)
    key, value = (torch.randn(batch, kv_heads, keys + 7, dim, generator=g)[:, :, :keys] for _ in range(2))
    mask = None
    if mask_kind is not None:
        mask = torch.rand(mask_batch, 1, 1, keys, generator=g) > 0.4
        mask[..., -1] = True  # the step's own token: never every key masked
        if mask_kind == "additive":
            mask = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    to = dict(device=DEVICE, dtype=dtype)
    return query.to(**to), key.to(**to), value.to(**to), None if mask is None else mask.to(DEVICE)


CASES = [  # batch, heads, KV heads, keys, head size, mask, the mask's batch, splits
    (1, 8, 2, 37, 16, "bool", 1, 1),
    (3, 8, 2, 130, 32, "bool", 3, 1),  # keys past one block, a padding mask per row
    (2, 4, 4, 200, 16, "additive", 2, 3),  # plain heads, split in three
    (2, 12, 4, 70, 64, None, 1, 2),  # three query heads a KV head, no mask
    (1, 32, 4, 300, 64, "bool", 1, 4),  # the 1.1B model's heads, a mask shared by the batch
    (2, 8, 2, 5, 16, "bool", 2, 4),  # splits past the keys: empty ones combine to nothing
    (1, 4, 2, 70, 256, "additive", 1, 2),  # the largest head size: blocks of 32 keys
]


@runs_kernels
@pytest.mark.parametrize("batch, heads, kv_heads, keys, dim, mask_kind, mask_batch, splits", CASES)
@pytest.mark.parametrize("op", ["decode_attention", "decode_attention_pdl", "decode_attention_pdl-combined"])
def test_the_kernel_equals_sdpa(batch, heads, kv_heads, keys, dim, mask_kind, mask_batch, splits, op, monkeypatch):
    """The op, and its PDL twin running the kernels' dependent-launch code (triton_launch.py); `combined`: the twin
    with the splits combined by the program finishing each (row, KV head) last (`COMBINE_IN_SPLITS_DEVICES`), its
    counts back at zero after the call (the next call, a CUDA graph's replay, counts from zero)."""
    with_dependent_launch_code(monkeypatch, triton_decoding)
    op, combined = op.removesuffix("-combined"), op.endswith("-combined")
    if combined:
        monkeypatch.setattr(triton_decoding, "COMBINE_IN_SPLITS_DEVICES", (DEVICE,))
        monkeypatch.setattr(triton_decoding, "_SPLIT_COUNTS", {})
    query, key, value, mask = _inputs(batch, heads, kv_heads, keys, dim, mask_kind, mask_batch)
    expected, _ = one_token_grouped_sdpa(nn.Module(), query, key, value, mask, scaling=0.3)
    for _ in range(2 if combined else 1):
        output = getattr(torch.ops.archlab, op)(query, key, value, mask, 0.3, splits)
        assert output.shape == (batch, 1, heads, dim) and output.dtype == query.dtype
        torch.testing.assert_close(output, expected, rtol=1e-5, atol=1e-5)
    # attention sinks (GPT-OSS): each query head's logit in the denominator, against the eager function's
    sinks = 2.0 * torch.randn(heads, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    module = SimpleNamespace(num_key_value_groups=heads // kv_heads, training=False)
    float_mask = mask
    if mask is not None and mask.dtype == torch.bool:
        float_mask = torch.zeros(mask.shape, device=DEVICE).masked_fill(~mask, float("-inf"))
    expected, _ = eager_attention_forward(module, query, key, value, float_mask, scaling=0.3, sinks=sinks)
    output = getattr(torch.ops.archlab, op)(query, key, value, mask, 0.3, splits, sinks)
    torch.testing.assert_close(output, expected, rtol=1e-5, atol=1e-5)
    if combined and splits > 1:
        ((counts,),) = triton_decoding._SPLIT_COUNTS.values()
        assert counts.numel() >= batch * kv_heads and not counts.any()


@runs_kernels
def test_the_kernel_traced_by_dynamo_follows_the_span():
    """One graph for every key count (the loops' spans are a dynamic size): the kernel's keys follow it."""
    torch._dynamo.reset()
    backend = "inductor" if torch.cuda.is_available() else "eager"  # the interpreter's kernels run in eager graphs

    def attend(query, key, value, mask):
        return torch.ops.archlab.decode_attention(query, key, value, mask, 0.3, 2)

    compiled = torch.compile(attend, backend=backend, fullgraph=True, dynamic=True)
    for step, keys in enumerate((40, 64, 100)):
        query, key, value, mask = _inputs(2, 8, 2, keys, 16, "bool", 2, seed=keys)
        expected, _ = one_token_grouped_sdpa(nn.Module(), query, key, value, mask, scaling=0.3)
        with torch._dynamo.config.patch(error_on_recompile=step > 0):
            output = compiled(query, key, value, mask)
        torch.testing.assert_close(output, expected, rtol=1e-5, atol=1e-5)


@runs_kernels
@pytest.mark.parametrize("compiled", [False, True], ids=["transformers-loop", "archlab-loop"])
def test_greedy_decoding_through_the_kernel_gives_sdpa_tokens(compiled, monkeypatch):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = DecoderForCausalLM(tiny_decoder_config(head_dim=16, num_attention_heads=4, num_key_value_heads=2))
    model = model.to(DEVICE).eval()
    batch = left_padded_batch(model.config.vocab_size)
    expected = greedy_tokens(model, batch, [] if compiled else None)
    model.release_decoding_memory()
    torch._dynamo.reset()
    monkeypatch.setattr(triton_decoding, "TRITON_DECODING_DEVICES", (DEVICE,))
    monkeypatch.setattr(triton_decoding, "KEYS_PER_PROGRAM", 8)  # long caches: a row's keys split among programs
    calls = []
    if compiled:
        graphs = []
        assert torch.equal(greedy_tokens(model, batch, graphs), expected)
        # the static cache holds 9 + 10 positions: 3 splits of 8 keys, from the capacity, whatever the span
        assert graphs and all(graph.count("archlab.decode_attention") == 2 for graph in graphs)
        assert all(
            ", 3, None)" in line for graph in graphs for line in graph.splitlines() if "decode_attention" in line
        )
    else:
        kernel = triton_decoding.decode_attention
        monkeypatch.setattr(
            "archlab.modeling.attention.decode_attention", lambda *a, **k: calls.append(1) or kernel(*a, **k)
        )
        assert torch.equal(greedy_tokens(model, batch), expected)
        assert len(calls) == 2 * 9  # two layers, the nine steps after the prefill


@runs_kernels
def test_a_model_with_attention_sinks_decodes_through_the_kernel_as_through_sdpa(monkeypatch):
    """GPT-OSS's sinks go into the kernel (each head's logit in its denominator): the tokens and logits of SDPA's
    sink key, every step after the prefill through the kernel, its keys split among programs."""
    torch.manual_seed(0)
    config = tiny_decoder_config(head_dim=16, num_attention_heads=4, num_key_value_heads=2, attention_sinks=True)
    model = DecoderForCausalLM(config).to(DEVICE).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 2.0)
    batch = left_padded_batch(model.config.vocab_size)
    greedy = dict(max_new_tokens=9, do_sample=False, output_logits=True, return_dict_in_generate=True)
    expected = model.generate(**batch, **greedy)
    monkeypatch.setattr(triton_decoding, "TRITON_DECODING_DEVICES", (DEVICE,))
    monkeypatch.setattr(triton_decoding, "KEYS_PER_PROGRAM", 8)
    calls, kernel = [], triton_decoding.decode_attention
    monkeypatch.setattr(
        "archlab.modeling.attention.decode_attention",
        lambda *a, **k: calls.append(k["sinks"] is not None) or kernel(*a, **k),
    )
    output = model.generate(**batch, **greedy)
    assert calls == [True] * (2 * 8)  # two layers, the eight steps after the prefill
    assert torch.equal(output.sequences, expected.sequences)
    torch.testing.assert_close(torch.stack(output.logits), torch.stack(expected.logits), atol=1e-4, rtol=1e-4)


# ---- on a GPU: half precision, and the kernel inside inductor's code and CUDA graphs --------------------------------


@runs_kernels
@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, marks=pytest.mark.gpu), torch.float16])
@pytest.mark.parametrize("splits", [1, 4])
def test_the_kernel_in_half_precision_is_as_close_as_sdpa(dtype, splits):
    """The 1.1B model's heads over 384 keys: the kernel's error against fp32 within twice SDPA's own in `dtype`
    (bf16 on a GPU only: the interpreter computes with NumPy, which has no bfloat16)."""
    query, key, value, mask = _inputs(1, 32, 4, 384, 64, "bool", 1, dtype=dtype)
    exact, _ = one_token_grouped_sdpa(nn.Module(), query.float(), key.float(), value.float(), mask, scaling=0.125)
    sdpa, _ = one_token_grouped_sdpa(nn.Module(), query, key, value, mask, scaling=0.125)
    output = torch.ops.archlab.decode_attention(query, key, value, mask, 0.125, splits)
    assert output.dtype == dtype
    ours, theirs = (output.float() - exact).abs().max(), (sdpa.float() - exact).abs().max()
    assert ours <= 2 * theirs + 1e-3, (ours, theirs)


@pytest.mark.gpu
def test_the_kernel_compiled_with_cuda_graphs_follows_the_span_without_recompiling():
    torch._dynamo.reset()

    def attend(query, key, value, mask):
        return torch.ops.archlab.decode_attention(query, key, value, mask, 0.3, 2)

    compiled = torch.compile(attend, mode="reduce-overhead", fullgraph=True, dynamic=True)
    # no key count equal to another size of the inputs (the head size 64 first made it recompile: dynamo's duck
    # sizing gives equal sizes one symbol, and a guard that they stay equal)
    for step, keys in enumerate((96, 160, 96, 224)):
        query, key, value, mask = _inputs(2, 8, 2, keys, 64, "bool", 2, dtype=torch.bfloat16, seed=keys)
        torch.compiler.cudagraph_mark_step_begin()
        with torch._dynamo.config.patch(error_on_recompile=step > 0):
            output = compiled(query, key, value, mask).clone()
        torch.testing.assert_close(output, attend(query, key, value, mask), rtol=0, atol=0)


# ---- on a CPU: the kernel tests above, through Triton's interpreter ------------------------------------------------


test_kernels_through_the_triton_interpreter = interpreted_run_of(__file__)
