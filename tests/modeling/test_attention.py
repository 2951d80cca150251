"""modeling/attention.py on its own: the eager kernel against softmax(QKᵀ/√d)V written out head by head, grouped
key/value heads, soft-capping and position biases, eager against SDPA, cross-attention's cached keys/values, an
instance's own rotary kernel, and QK-norm per head or over the projection (the latter at no extra op)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.cache_utils import DynamicCache, EncoderDecoderCache

from archlab import DecoderForCausalLM
from archlab.modeling import attention as attention_module
from archlab.modeling.attention import Attention, eager_attention_forward, one_token_grouped_sdpa, repeat_kv
from archlab.modeling.fused_projections import inference_projections
from archlab.modeling.rotary import apply_rotary

from helpers import assert_close_to_scale, randomised, tiny_decoder_config

BATCH, HEADS, QUERIES, KEYS, DIM = 2, 4, 5, 7, 8


def qkv(kv_heads: int = HEADS, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    query = torch.randn(BATCH, HEADS, QUERIES, DIM, generator=generator) * scale
    key = torch.randn(BATCH, kv_heads, KEYS, DIM, generator=generator) * scale
    value = torch.randn(BATCH, kv_heads, KEYS, DIM, generator=generator)
    return query, key, value


def padding_mask(queries: int = QUERIES, keys: int = KEYS, causal: bool = False) -> torch.Tensor:
    """Additive (B, 1, Tq, Tk) mask: the second row's last 2 keys are padding; causal aligns the queries with the
    last keys (as when decoding after a cached prefix)."""
    allowed = torch.ones(BATCH, 1, queries, keys, dtype=torch.bool)
    allowed[1, :, :, -2:] = False
    if causal:
        allowed &= torch.ones(queries, keys, dtype=torch.bool).tril(keys - queries)
    return torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)


def slow_attention(query, key, value, mask=None, scaling=None, softcap=None, bias=None):
    """softmax(cap(q·kᵀ · scaling) + bias + mask) v for each batch row and head, in float64; query head h reads
    key/value head h // (H / H_kv)."""
    heads, kv_heads = query.shape[1], key.shape[1]
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    out = torch.empty(query.shape[0], query.shape[2], heads, value.shape[-1], dtype=torch.float64)
    for b in range(query.shape[0]):
        for h in range(heads):
            g = h // (heads // kv_heads)
            scores = query[b, h].double() @ key[b, g].double().T * scaling
            if softcap is not None:
                scores = softcap * torch.tanh(scores / softcap)
            if bias is not None:
                scores = scores + bias[min(b, bias.shape[0] - 1), h].double()
            if mask is not None:
                scores = scores + mask[b, 0].double()
            out[b, :, h] = scores.softmax(-1) @ value[b, g].double()
    return out


def eager(query, key, value, mask=None, **kwargs) -> torch.Tensor:
    module = SimpleNamespace(num_key_value_groups=query.shape[1] // key.shape[1], training=False)
    output, _ = eager_attention_forward(module, query, key, value, mask, scaling=query.shape[-1] ** -0.5, **kwargs)
    return output


@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_eager_kernel_is_softmax_of_scaled_scores_times_values(kv_heads):
    query, key, value = qkv(kv_heads)
    mask = padding_mask()
    output = eager(query, key, value, mask)
    assert output.shape == (BATCH, QUERIES, HEADS, DIM)
    assert_close_to_scale(output, slow_attention(query, key, value, mask).float(), rtol=1e-5)
    # the padded keys carry no weight: changing their values changes nothing in that row
    changed = value.clone()
    changed[:, :, -2:] = 100.0  # both rows; only the first may see them
    torch.testing.assert_close(eager(query, key, changed, mask)[1], output[1])
    assert not torch.allclose(eager(query, key, changed, mask)[0], output[0])


def test_repeat_kv_gives_query_head_h_the_key_value_head_h_over_groups():
    states = torch.randn(BATCH, 2, KEYS, DIM)
    repeated = repeat_kv(states, 3)
    assert repeated.shape == (BATCH, 6, KEYS, DIM)
    for head in range(6):
        assert torch.equal(repeated[:, head], states[:, head // 3])
    assert repeat_kv(states, 1) is states


@pytest.mark.parametrize("kv_heads", [2, 1], ids=["gqa", "mqa"])
def test_grouped_heads_equal_multi_head_attention_with_repeated_key_value_weights(kv_heads):
    """A GQA/MQA module computes what an MHA module computes when each of its key/value projections is copied to
    the query heads that share it (head h reads key/value head h // groups)."""
    grouped = Attention(tiny_decoder_config(num_key_value_heads=kv_heads), layer_idx=0).eval()
    full = Attention(tiny_decoder_config(num_key_value_heads=HEADS), layer_idx=0).eval()
    groups = HEADS // kv_heads
    state = grouped.state_dict()
    for name in ("k_proj.weight", "v_proj.weight"):
        state[name] = state[name].view(kv_heads, -1, state[name].shape[-1]).repeat_interleave(groups, 0).flatten(0, 1)
    full.load_state_dict(state)
    hidden = torch.randn(BATCH, QUERIES, grouped.q_proj.in_features)
    mask = padding_mask(QUERIES, QUERIES, causal=True)
    with torch.no_grad():
        got, expected = grouped(hidden, attention_mask=mask)[0], full(hidden, attention_mask=mask)[0]
        assert_close_to_scale(got, expected, rtol=1e-5)
        if kv_heads > 1:  # the other grouping (query head h reading key/value head h % H_kv) is a different model
            tiled = grouped.state_dict()
            for name in ("k_proj.weight", "v_proj.weight"):
                tiled[name] = tiled[name].repeat(groups, 1)
            full.load_state_dict(tiled)
            assert (full(hidden, attention_mask=mask)[0] - got).abs().max() > 1e-3


def test_soft_capping_bounds_the_scores_before_the_mask():
    query, key, value = qkv(scale=4.0)  # scores up to ~50: the cap changes them
    mask = padding_mask()
    capped = eager(query, key, value, mask, softcap=5.0)
    assert_close_to_scale(capped, slow_attention(query, key, value, mask, softcap=5.0).float(), rtol=1e-5)
    assert (capped - eager(query, key, value, mask)).abs().max() > 1e-2


@pytest.mark.parametrize("bias_batch", [1, BATCH], ids=["shared", "per_row"])
def test_position_bias_is_added_to_the_scores(bias_batch):
    query, key, value = qkv()
    mask = padding_mask()
    bias = torch.randn(bias_batch, HEADS, QUERIES, KEYS)
    biased = eager(query, key, value, mask, position_bias=bias)
    assert_close_to_scale(biased, slow_attention(query, key, value, mask, bias=bias).float(), rtol=1e-5)
    assert (biased - eager(query, key, value, mask)).abs().max() > 1e-2


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_eager_equals_sdpa(causal):
    eager_module = Attention(tiny_decoder_config(attn_implementation="eager"), layer_idx=0, is_causal=causal).eval()
    sdpa_module = Attention(tiny_decoder_config(attn_implementation="sdpa"), layer_idx=0, is_causal=causal).eval()
    sdpa_module.load_state_dict(eager_module.state_dict())
    hidden = torch.randn(BATCH, QUERIES, eager_module.q_proj.in_features)
    mask = padding_mask(QUERIES, QUERIES, causal=causal)
    bias = torch.randn(1, HEADS, QUERIES, QUERIES)
    with torch.no_grad():
        for kwargs in (dict(attention_mask=mask), dict(attention_mask=mask, position_bias=bias)):
            assert_close_to_scale(sdpa_module(hidden, **kwargs)[0], eager_module(hidden, **kwargs)[0], rtol=1e-5)
        if causal:  # without a mask SDPA runs its own causal kernel; eager needs the causal mask spelled out
            future = ~torch.ones(QUERIES, QUERIES, dtype=torch.bool).tril()
            causal_mask = torch.zeros(1, 1, QUERIES, QUERIES).masked_fill(future, torch.finfo(torch.float32).min)
            expected = eager_module(hidden, attention_mask=causal_mask)[0]
            assert_close_to_scale(sdpa_module(hidden)[0], expected, rtol=1e-5)
            assert (eager_module(hidden)[0] - expected).abs().max() > 1e-3  # the mask matters


def test_eager_attention_in_float64_keeps_padded_rows_finite():
    """A padded query row masked whole: in float64 the mask value is float64's finfo.min, which the softmax's float32
    cast made -inf, so that row's probabilities were NaN and the next layer's values spread them to every real token.
    The softmax now runs in float64 there: a left-padded float64 batch gives the float64 SDPA model's logits."""
    configs = [tiny_decoder_config(attn_implementation=kind) for kind in ("eager", "sdpa")]
    models = [randomised(DecoderForCausalLM(config)).double() for config in configs]
    ids, mask = torch.tensor([[0, 0, 5, 6, 7], [3, 4, 5, 6, 7]]), torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    with torch.no_grad():
        eager, sdpa = (model(input_ids=ids, attention_mask=mask).logits for model in models)
    assert torch.isfinite(eager).all()
    torch.testing.assert_close(eager[mask.bool()], sdpa[mask.bool()], atol=1e-10, rtol=0)


@pytest.mark.parametrize("kv_heads", [2, 1], ids=["gqa", "mqa"])
@pytest.mark.parametrize("masking", ["none", "additive", "boolean", "bias", "boolean+bias", "per-head"])
def test_one_token_grouped_sdpa_is_attention_without_repeated_keys(kv_heads, masking):
    """A decoding step's SDPA with the query heads of each KV head regrouped as its query positions: the keys and
    values are not repeated, and every mask and bias form gives the written-out attention."""
    query, key, value = qkv(kv_heads)
    query = query[:, :, -1:]  # one query token per row
    additive = padding_mask(1, KEYS)
    bias = torch.randn(1, HEADS, 1, KEYS)
    mask, kwargs, expected_bias = None, {}, None
    if masking in ("additive", "per-head"):
        mask = additive if masking == "additive" else additive.expand(-1, HEADS, -1, -1) + bias
    if masking.startswith("boolean"):
        mask = additive == 0
    if "bias" in masking:
        kwargs["position_bias"] = expected_bias = bias
    expected_mask = None if mask is None else additive
    if masking == "per-head":
        expected_bias = bias
    module = SimpleNamespace(num_key_value_groups=HEADS // kv_heads, training=False)
    output, _ = one_token_grouped_sdpa(module, query, key, value, mask, scaling=DIM**-0.5, **kwargs)
    expected = slow_attention(query, key, value, expected_mask, bias=expected_bias).float()
    assert output.shape == (BATCH, 1, HEADS, DIM)
    assert_close_to_scale(output, expected, rtol=1e-5)


def test_decoding_steps_of_grouped_heads_take_the_regrouped_sdpa(monkeypatch):
    """One query token with grouped KV heads under SDPA: `one_token_grouped_sdpa`, compiled or not (transformers'
    SDPA function repeats the keys when compiled); equal to the eager kernel with repeated keys."""
    from transformers.integrations import sdpa_attention

    def refuse(*args, **kwargs):
        raise AssertionError("the keys were repeated")

    sdpa_module = Attention(tiny_decoder_config(attn_implementation="sdpa"), layer_idx=0).eval()
    eager_module = Attention(tiny_decoder_config(attn_implementation="eager"), layer_idx=0).eval()
    eager_module.load_state_dict(sdpa_module.state_dict())
    hidden = torch.randn(BATCH, 1, sdpa_module.q_proj.in_features)
    keys = torch.randn(BATCH, sdpa_module.num_key_value_heads, KEYS, DIM)
    mask = padding_mask(1, KEYS + 1)  # the cached keys and the step's own

    def step(module, hidden):
        cache = DynamicCache()
        cache.update(keys.clone(), keys.clone(), 0)
        return module(hidden, attention_mask=mask, past_key_values=cache)[0]

    monkeypatch.setattr(sdpa_attention, "repeat_kv", refuse)
    with torch.no_grad():
        expected = step(eager_module, hidden)
        assert_close_to_scale(step(sdpa_module, hidden), expected, rtol=1e-5)
        torch._dynamo.reset()
        compiled = torch.compile(step, backend="eager", fullgraph=True)
        assert_close_to_scale(compiled(sdpa_module, hidden), expected, rtol=1e-5)


def test_cross_attention_projects_the_encoder_output_once_and_reads_it_from_the_cache():
    module = Attention(tiny_decoder_config(attn_implementation="eager"), layer_idx=0, is_causal=False).eval()
    calls = {"k": 0, "v": 0}
    module.k_proj.register_forward_hook(lambda *_: calls.__setitem__("k", calls["k"] + 1))
    module.v_proj.register_forward_hook(lambda *_: calls.__setitem__("v", calls["v"] + 1))
    width = module.q_proj.in_features
    encoder_states = torch.randn(BATCH, KEYS, width)
    mask = padding_mask(1, KEYS)
    cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
    with torch.no_grad():
        for step in range(3):
            hidden = torch.randn(BATCH, 1, width)
            uncached = module(hidden, attention_mask=mask, key_value_states=encoder_states)[0]
            calls_before = dict(calls)
            # after the first step the cache answers: other encoder states passed in change nothing
            states = encoder_states if step == 0 else torch.zeros_like(encoder_states)
            cached = module(hidden, attention_mask=mask, key_value_states=states, past_key_values=cache)[0]
            assert_close_to_scale(cached, uncached, rtol=1e-5)
            assert calls == {"k": calls_before["k"] + (step == 0), "v": calls_before["v"] + (step == 0)}
    assert cache.is_updated[0]
    keys = cache.cross_attention_cache.layers[0].keys
    assert keys.shape == (BATCH, module.num_key_value_heads, KEYS, module.head_dim)
    torch.testing.assert_close(keys, module._project_key_value(encoder_states)[0])
    assert cache.self_attention_cache.get_seq_length() == 0  # cross-attention leaves the decoder's own cache alone


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("kv_heads", [HEADS, 2])
@pytest.mark.parametrize("queries", [1, 3])
def test_rows_sharing_a_source_read_its_cross_attention_keys_once(attn_implementation, kv_heads, queries, monkeypatch):
    """A cache with `rows_per_source` g (beam search's beams of a sentence) holds each source's keys and values once,
    projected from its first row, and each source's g rows attend to them together (one row of g · T queries; with
    grouped heads under SDPA, `grouped_queries_sdpa`: no key repeated per query head): the output of every row equals
    per-row cross-attention over a per-row cache, padded sources included."""
    calls = []
    grouped = attention_module.grouped_queries_sdpa
    monkeypatch.setattr(attention_module, "grouped_queries_sdpa", lambda *a, **k: calls.append(1) or grouped(*a, **k))
    config = tiny_decoder_config(attn_implementation=attn_implementation, num_key_value_heads=kv_heads)
    module = Attention(config, layer_idx=0, is_causal=False).eval()
    width, group, sources = module.q_proj.in_features, 3, 2
    encoder_states = torch.randn(sources, KEYS, width).repeat_interleave(group, dim=0)  # as generate expands them
    mask = padding_mask(queries, KEYS)[:sources].repeat_interleave(group, dim=0)  # (sources · g, 1, T, S)
    shared = EncoderDecoderCache(DynamicCache(), DynamicCache())
    shared.rows_per_source = group
    per_row = EncoderDecoderCache(DynamicCache(), DynamicCache())
    with torch.no_grad():
        for step in range(2):
            hidden = torch.randn(sources * group, queries, width)
            ours = module(hidden, attention_mask=mask, key_value_states=encoder_states, past_key_values=shared)[0]
            reference = module(hidden, attention_mask=mask, key_value_states=encoder_states, past_key_values=per_row)[0]
            assert_close_to_scale(ours, reference, rtol=1e-5, msg=f"step {step}")
    assert shared.cross_attention_cache.layers[0].keys.shape[0] == sources
    assert per_row.cross_attention_cache.layers[0].keys.shape[0] == sources * group
    assert bool(calls) == (attn_implementation == "sdpa" and kv_heads < HEADS)


def test_an_instance_may_carry_its_own_rotary_kernel():
    """The seam archlab.liger uses for Liger's RoPE: `attention.rotate` on one instance, the class's elsewhere."""
    config = tiny_decoder_config()
    patched, plain = Attention(config, 0), Attention(config, 0)
    plain.load_state_dict(patched.state_dict())
    calls = []
    patched.rotate = lambda q, k, cos, sin: calls.append(q.shape) or apply_rotary(q, k, cos, sin)
    hidden = torch.randn(2, 5, config.hidden_size)
    cos, sin = torch.randn(2, 5, config.head_dim), torch.randn(2, 5, config.head_dim)
    torch.testing.assert_close(patched(hidden, (cos, sin))[0], plain(hidden, (cos, sin))[0])
    assert calls == [(2, config.num_attention_heads, 5, config.head_dim)]
    assert Attention.rotate is apply_rotary and "rotate" not in plain.__dict__


def _queries_attended(attention: Attention, query_projection: torch.Tensor) -> torch.Tensor:
    """Queries (B, H, T, D) from a q projection (B, T, H·D) through `split_heads` and `position_and_cache`, no RoPE:
    the steps of the forward over one q/k/v product and of the fused decoding block."""
    batch, length, _ = query_projection.shape
    key_value = torch.ones(batch, length, 2 * attention.num_key_value_heads * attention.head_dim)
    with torch.no_grad():
        heads = attention.split_heads(torch.cat([query_projection, key_value], dim=-1))
        return attention.position_and_cache(*heads, None, None)[0]


@pytest.mark.parametrize("scope", ["head", "projection"])
def test_qk_norm_normalises_each_head_or_the_whole_projection(scope):
    """Per head (Qwen3), a head's normed queries ignore the other heads; over the projection (OLMo 2), one RMS per
    token over all heads: the queries equal the q projection (B, T, H·D) normed as one vector, then split."""
    config = tiny_decoder_config(use_qk_norm=True, qk_norm_scope=scope)
    attention = Attention(config, layer_idx=0).eval()
    with torch.no_grad():
        attention.q_norm.weight.uniform_(0.5, 1.5)
    projection = torch.randn(2, 3, 4 * 8, generator=torch.Generator().manual_seed(0))
    loud = projection.clone()
    loud[..., :8] *= 10.0  # only the first head changes
    normed, loud_normed = _queries_attended(attention, projection), _queries_attended(attention, loud)
    if scope == "head":
        assert attention.q_norm.weight.shape == (8,)
        torch.testing.assert_close(normed[:, 1:], loud_normed[:, 1:])
    else:
        assert attention.q_norm.weight.shape == (4 * 8,) and attention.k_norm.weight.shape == (2 * 8,)
        rms = projection.pow(2).mean(-1, keepdim=True).add(config.rms_norm_eps).sqrt()
        expected = projection / rms * attention.q_norm.weight
        assert_close_to_scale(normed, expected.view(2, 3, 4, 8).transpose(1, 2), rtol=1e-6)
        assert not torch.allclose(normed[:, 1:], loud_normed[:, 1:])


@pytest.mark.parametrize("gate", ["elementwise", "headwise"])
def test_a_gated_attention_scales_the_heads_output_by_the_sigmoid_of_its_gate(gate):
    """`attention_output_gate`: o_proj(heads ⊙ sigmoid(gate_proj(x))), a gate per channel of each head or one per
    head, against the ungated attention's heads (o_proj is linear: the heads are o_proj's input)."""
    torch.manual_seed(0)
    gated = Attention(tiny_decoder_config(attention_output_gate=gate), layer_idx=0).eval()
    plain = Attention(tiny_decoder_config(), layer_idx=0).eval()
    plain.load_state_dict({k: v for k, v in gated.state_dict().items() if not k.startswith("gate_proj")})
    assert gated.gate_proj.weight.shape == ((4 * 8 if gate == "elementwise" else 4), 32)
    x = torch.randn(2, 5, 32)
    heads = []
    plain.o_proj.register_forward_hook(lambda module, inputs, output: heads.append(inputs[0]))
    with torch.no_grad():
        plain(x)
        expected_heads = heads[0]
        g = torch.sigmoid(gated.gate_proj(x))
        if gate == "headwise":
            g = g.repeat_interleave(8, dim=-1)
        torch.testing.assert_close(gated(x)[0], gated.o_proj(expected_heads * g), atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="`attention_output_gate`='sigmoid' is not supported; allowed values"):
        tiny_decoder_config(attention_output_gate="sigmoid")


class _RecordOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("laid_out", [False, True], ids=["separate", "one-product"])
def test_qk_norm_over_the_projection_runs_the_ops_of_the_per_head_norm(laid_out):
    """OLMo 2's norm reads the projection before the split into heads, as the projection lays it out: no
    transposes or reshapes around it, so a decoding step runs the same aten ops as with per-head QK-norm
    (in another order: the norms before the views)."""
    hidden = torch.randn(2, 1, 32, generator=torch.Generator().manual_seed(0))
    cos, sin = torch.ones(2, 1, 8), torch.zeros(2, 1, 8)
    ops = {}
    for scope in ("head", "projection"):
        attention = Attention(tiny_decoder_config(use_qk_norm=True, qk_norm_scope=scope), layer_idx=0).eval()
        with torch.no_grad(), inference_projections(attention, force=laid_out) as groups, _RecordOps() as record:
            # with the CUDA paths opened to the CPU (CI's second pass) the projections are laid out as one anyway
            assert bool(groups) == laid_out or os.environ.get("ARCHLAB_TEST_CUDA_PATHS_ON_CPU") in ("1", "all")
            attention(hidden, (cos, sin), past_key_values=DynamicCache())
        ops[scope] = record.ops
    assert sorted(ops["projection"]) == sorted(ops["head"])  # the same ops, the norms earlier
