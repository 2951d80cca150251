"""Mixture of experts (modeling/moe.py): routing maths against a slow reference, grouped GEMM forward/backward,
auxiliary losses, shared experts, Mixtral and Qwen2-MoE parity, cache, save/load, Trainer."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from transformers import MixtralConfig, MixtralForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

import archlab
from archlab.modeling import grouped_gemm, moe
from archlab.modeling.grouped_gemm import grouped_linear
from archlab.modeling.moe import SparseMoeBlock, count_parameters, load_balancing_loss, router_z_loss

from helpers import assert_close_to_scale, tiny_decoder_config

MOE = dict(num_local_experts=4, num_experts_per_tok=2)
# GPT-OSS's router and experts: a router bias, expert biases, the clamped SwiGLU with up + 1 (a limit the inputs reach)
GPT_OSS_EXPERTS = dict(
    router_bias=True, expert_bias=True, swiglu_limit=0.5, swiglu_up_offset=1.0, hidden_act="quick_gelu"
)
# Llama 4's: the sigmoid of each chosen logit weighs the expert's input (top-2 here: the sum of two inputs' outputs)
LLAMA4_EXPERTS = dict(router_score_function="sigmoid", norm_topk_prob=False, routing_weights_on_input=True)


def moe_config(**overrides) -> archlab.DecoderConfig:
    return tiny_decoder_config(**{**MOE, **overrides})


def sparse_block(**overrides) -> SparseMoeBlock:
    """The sparse block of a one-layer model; its router and expert biases (GPT-OSS's) random where it has them."""
    model = archlab.DecoderForCausalLM(moe_config(num_hidden_layers=1, **overrides))
    block = model.model.layers[0].mlp
    with torch.no_grad():
        for name, parameter in block.named_parameters():
            if name.endswith("bias") and name.startswith(("gate.", "experts.")):
                parameter.normal_(0.0, 0.5)
    return block


def _bias(bias: torch.Tensor | None, expert: int):
    return 0.0 if bias is None else bias[expert]


def reference_moe(block: SparseMoeBlock, x: torch.Tensor) -> torch.Tensor:
    """Token by token, slot by slot, with plain matmuls: softmax → top-k → (renormalise) → Σ w · expert(x); a
    sigmoid router's experts chosen by score + correction bias, weighed by the score, times the routed scale; with
    the weights on the input (Llama 4), Σ expert(w · x)."""
    gate, experts = block.gate, block.experts
    bias = gate.e_score_correction_bias
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        logits = x[t] @ gate.weight.t() + (gate.bias if gate.bias is not None else 0.0)
        probs = torch.sigmoid(logits) if gate.score_function == "sigmoid" else torch.softmax(logits, dim=-1)
        choice = probs + bias if bias is not None else probs
        top = sorted(range(gate.num_experts), key=lambda e: -choice[e].item())[: gate.top_k]
        weights = probs[top] / (probs[top].sum() if gate.norm_topk_prob else 1.0) * gate.routed_scaling_factor
        for w, e in zip(weights, top):
            x_in = w * x[t] if experts.weights_on_input else x[t]
            w = 1.0 if experts.weights_on_input else w
            if experts.gated:
                g, u = (experts.gate_up_proj[e] @ x_in + _bias(experts.gate_up_proj_bias, e)).chunk(2)
                if experts.limit is not None:  # GPT-OSS: act(min(g, L)) ⊙ (clamp(u, -L, L) + offset)
                    g, u = g.clamp(max=experts.limit), u.clamp(-experts.limit, experts.limit)
                h = experts.act_fn(g) * (u + experts.up_offset)
            else:
                h = experts.act_fn(experts.up_proj[e] @ x_in)
            out[t] += w * (experts.down_proj[e] @ h + _bias(experts.down_proj_bias, e))
        if block.shared_expert is not None:
            shared = block.shared_expert(x[t])
            if block.shared_expert_gate is not None:
                shared = torch.sigmoid(block.shared_expert_gate(x[t])) * shared
            out[t] += shared
    return out


# ---------------------------------------------------------------------------------------------------------------
# Config


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(mlp_layer_types=["sparse", "moe"]), "mlp_layer_types"),
        (dict(mlp_layer_types=["sparse"]), "mlp_layer_types"),
        (dict(num_local_experts=2, num_experts_per_tok=3), "num_experts_per_tok"),
        (dict(num_local_experts=0, mlp_layer_types=["dense", "sparse"]), "num_local_experts"),
        (dict(router_aux_loss_coef=-1.0), "router_aux_loss_coef"),
        (dict(router_z_loss_coef=-0.1), "router_z_loss_coef"),
        (dict(router_jitter_noise=1.5), "router_jitter_noise"),
        (dict(shared_expert_intermediate_size=-4), "shared_expert_intermediate_size"),
        (dict(router_score_function="sparsemax"), "router_score_function"),
        (dict(routed_scaling_factor=0.0), "routed_scaling_factor"),
        (dict(swiglu_limit=-1.0), "swiglu_limit"),
        (dict(swiglu_limit=7.0, mlp_type="plain", hidden_act="gelu"), "swiglu_limit"),
        (dict(swiglu_up_offset=float("inf")), "swiglu_up_offset"),
    ],
)
def test_bad_moe_values_fail_at_construction(overrides, field):
    with pytest.raises(ValueError, match=field):
        moe_config(**overrides)


def test_defaults_dense_unless_experts():
    assert tiny_decoder_config().mlp_layer_types == ["dense", "dense"]
    config = moe_config()
    assert config.mlp_layer_types == ["sparse", "sparse"] and config.moe_intermediate_size == config.intermediate_size
    model = archlab.DecoderForCausalLM(moe_config(mlp_layer_types=["dense", "sparse"]))
    assert not isinstance(model.model.layers[0].mlp, SparseMoeBlock)
    assert isinstance(model.model.layers[1].mlp, SparseMoeBlock)


def test_router_aux_loss_coef_only_on_models_with_experts_and_num_experts_alias(tmp_path):
    """Mixtral's 0.001 with sparse layers; 0 on a dense model (trainers such as TRL take a positive coefficient as
    the mark of a mixture of experts), also for a dense config.json saved with 0.001. `num_experts` is Mixtral's
    alias of `num_local_experts`: read and set through it, never written to config.json."""
    assert tiny_decoder_config().router_aux_loss_coef == 0.0
    assert moe_config().router_aux_loss_coef == 0.001
    assert moe_config(mlp_layer_types=["dense", "sparse"], router_aux_loss_coef=0.02).router_aux_loss_coef == 0.02
    assert tiny_decoder_config(router_aux_loss_coef=0.001).router_aux_loss_coef == 0.0

    archlab.DecoderForCausalLM(tiny_decoder_config()).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert "num_experts" not in saved
    (tmp_path / "config.json").write_text(json.dumps({**saved, "router_aux_loss_coef": 0.001}))
    assert archlab.DecoderConfig.from_pretrained(tmp_path).router_aux_loss_coef == 0.0

    config = moe_config()
    assert config.num_experts == config.num_local_experts == MOE["num_local_experts"]
    assert tiny_decoder_config(num_experts=3, num_experts_per_tok=1).num_local_experts == 3


# ---------------------------------------------------------------------------------------------------------------
# Routing maths and the grouped GEMM


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        dict(norm_topk_prob=False),
        dict(num_experts_per_tok=1),
        dict(mlp_type="plain", hidden_act="gelu"),
        dict(shared_expert_intermediate_size=48),
        dict(shared_expert_intermediate_size=48, shared_expert_gate=False, norm_topk_prob=False),
        dict(router_score_function="sigmoid", norm_topk_prob=False),
        dict(router_score_function="sigmoid", router_correction_bias=True, routed_scaling_factor=2.5),
        GPT_OSS_EXPERTS,
        LLAMA4_EXPERTS,
        dict(LLAMA4_EXPERTS, mlp_type="plain", hidden_act="gelu", num_experts_per_tok=1),
    ],
)
def test_block_matches_slow_reference(overrides):
    block = sparse_block(**overrides)
    if block.gate.e_score_correction_bias is not None:  # large enough to change choices
        block.gate.e_score_correction_bias.copy_(torch.tensor([0.3, -0.3, 0.0, 0.2]))
    x = torch.randn(13, 32)
    torch.testing.assert_close(block(x[None])[0], reference_moe(block, x), atol=1e-5, rtol=1e-5)
    assert block.router_logits.shape == (13, 4)


def test_weights_on_the_input_train_the_router_and_experts_as_the_reference():
    """Llama 4's experts read w · x: the router's gradient comes through the experts' inputs, on the grouped path as in
    the slow reference (the sorted slots' weights gathered in expert order)."""
    block = sparse_block(**LLAMA4_EXPERTS)
    x = torch.randn(13, 32)
    probe = torch.randn(13, 32)
    grads = []
    for forward in (lambda: block(x[None])[0], lambda: reference_moe(block, x)):
        block.zero_grad()
        (forward() * probe).sum().backward()
        grads.append({name: p.grad.clone() for name, p in block.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and "gate.weight" in grads[0]
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        dict(mlp_type="plain", hidden_act="gelu"),
        dict(num_experts_per_tok=3, shared_expert_intermediate_size=48),
        GPT_OSS_EXPERTS,
        LLAMA4_EXPERTS,
    ],
)
def test_one_token_decode_path_matches_reference_and_grouped_path(overrides, monkeypatch):
    block = sparse_block(**overrides).eval()
    x = torch.randn(1, 32)
    calls = []
    one_token = moe.Experts._forward_one_token
    monkeypatch.setattr(moe.Experts, "_forward_one_token", lambda self, *a: calls.append(1) or one_token(self, *a))
    with torch.no_grad():
        fast = block(x[None])[0]
    assert len(calls) == 1  # the decode path ran
    grouped = block(x[None])[0].detach()  # gradients enabled: the grouped path
    assert len(calls) == 1
    torch.testing.assert_close(fast, reference_moe(block, x), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fast, grouped, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        dict(mlp_type="plain", hidden_act="gelu"),
        dict(num_experts_per_tok=3, shared_expert_intermediate_size=48),
        GPT_OSS_EXPERTS,
        dict(LLAMA4_EXPERTS, expert_bias=True),
    ],
)
def test_onnx_export_path_runs_every_expert_without_sort_or_grouped_gemm_and_matches(overrides, monkeypatch):
    """Under `torch.onnx.export` (no ONNX translation of a stable sort or of the grouped GEMM ops) every expert runs
    over every token, mixed by the scattered routing weights: the same output as the reference."""
    block = sparse_block(**overrides).eval()
    x = torch.randn(13, 32)
    monkeypatch.setattr(torch.onnx, "is_in_onnx_export", lambda: True)
    monkeypatch.setattr(moe, "sort_slots", lambda *a: pytest.fail("the expert sort ran under ONNX export"))
    monkeypatch.setattr(moe, "grouped_linear", lambda *a: pytest.fail("a grouped GEMM ran under ONNX export"))
    with torch.no_grad():
        torch.testing.assert_close(block(x[None])[0], reference_moe(block, x), atol=1e-5, rtol=1e-5)


def test_grouped_linear_kernel_matches_per_expert_loop_forward_and_backward():
    offsets = torch.tensor([3, 3, 10, 16], dtype=torch.int32)  # expert 1 gets no rows
    x = torch.randn(16, 8, requires_grad=True)
    w = torch.randn(4, 12, 8, requires_grad=True)
    y = grouped_linear(x, w, offsets)
    starts = [0, 3, 3, 10]
    ref = torch.cat([x[s:e] @ w[i].t() for i, (s, e) in enumerate(zip(starts, offsets.tolist()))])
    torch.testing.assert_close(y, ref)
    grad = torch.randn_like(y)
    gx, gw = torch.autograd.grad(y, (x, w), grad)
    rx, rw = torch.autograd.grad(ref, (x, w), grad)
    torch.testing.assert_close(gx, rx)
    torch.testing.assert_close(gw, rw)
    assert gw[1].abs().sum() == 0
    # rows of 7 floats (28 bytes) are not 16-byte strided: the per-expert fallback gives the same numbers
    x7, w7 = x.detach()[:, :7].contiguous(), w.detach()[:, :, :7].contiguous()
    ref7 = torch.cat([x7[s:e] @ w7[i].t() for i, (s, e) in enumerate(zip(starts, offsets.tolist()))])
    torch.testing.assert_close(grouped_linear(x7, w7, offsets), ref7)


def test_fallback_without_kernel_matches(monkeypatch):
    block = sparse_block()
    x = torch.randn(2, 9, 32, requires_grad=True)
    out = block(x)
    grads = torch.autograd.grad(out.square().sum(), (x, block.experts.gate_up_proj, block.experts.down_proj))
    monkeypatch.setattr(grouped_gemm, "_GROUPED_MM", None)
    out_fb = block(x)
    grads_fb = torch.autograd.grad(out_fb.square().sum(), (x, block.experts.gate_up_proj, block.experts.down_proj))
    torch.testing.assert_close(out_fb, out, atol=1e-6, rtol=1e-5)
    for g, g_fb in zip(grads, grads_fb):
        torch.testing.assert_close(g_fb, g, atol=1e-6, rtol=1e-5)


def test_a_float64_model_with_experts_runs_and_trains():
    """grouped_mm takes float32/bf16/fp16 only: `model.double()` (gradient checks, float64 references) raised
    "Expected mat_a to be Float32, BFloat16 or Float16 matrix" in the first forward; the per-expert loop runs it."""
    config = tiny_decoder_config(num_local_experts=4, num_experts_per_tok=2)
    model = archlab.DecoderForCausalLM(config)
    ids = torch.randint(3, 97, (2, 7), generator=torch.Generator().manual_seed(0))
    expected = model.eval()(ids).logits
    wide = copy.deepcopy(model).double()
    assert_close_to_scale(wide(ids).logits.float(), expected, rtol=1e-5)
    wide.train()(ids, labels=ids).loss.backward()
    assert torch.isfinite(wide.model.layers[0].mlp.experts.gate_up_proj.grad).all()


def test_while_a_cuda_graph_records_non_bf16_groups_run_without_host_reads(monkeypatch):
    """fp32/fp16 inside a CUDA-graph recording (decoding's compiled step): grouped_mm's ATen fallback and the
    per-expert loop both read the offsets on the host, which a recording refuses; the masked path gives the same
    forward and backward, empty groups and rows past the last group included."""
    block = sparse_block()
    x = torch.randn(2, 9, 32, requires_grad=True)
    out = block(x)
    grads = torch.autograd.grad(out.square().sum(), (x, block.experts.gate_up_proj, block.experts.down_proj))

    def no_host_reads(*args, **kwargs):
        raise AssertionError("read the offsets on the host while recording")

    assert not grouped_gemm._must_not_read_offsets_on_host(x)  # on the CPU, never
    monkeypatch.setattr(grouped_gemm, "_must_not_read_offsets_on_host", lambda a: True)
    monkeypatch.setattr(grouped_gemm, "_GROUPED_MM", no_host_reads)
    monkeypatch.setattr(torch.Tensor, "tolist", no_host_reads)
    out_masked = block(x)
    grads_masked = torch.autograd.grad(
        out_masked.square().sum(), (x, block.experts.gate_up_proj, block.experts.down_proj)
    )
    torch.testing.assert_close(out_masked, out, atol=1e-6, rtol=1e-5)
    for g, g_masked in zip(grads, grads_masked):
        torch.testing.assert_close(g_masked, g, atol=1e-6, rtol=1e-5)
    offsets = torch.tensor([3, 3, 10], dtype=torch.int32)  # expert 1 empty, rows 10-11 in no group
    a, b = torch.randn(12, 8), torch.randn(3, 8, 5)
    starts = [0, 3, 3]
    expected = torch.zeros(12, 5)
    for expert, (start, end) in enumerate(zip(starts, [3, 3, 10])):
        expected[start:end] = a[start:end] @ b[expert]
    torch.testing.assert_close(grouped_gemm._grouped_mm_eager(a, b, offsets), expected)
    c = torch.randn(12, 5)
    weight_grads = grouped_gemm._grouped_mm_tn_eager(a, c, offsets)
    for expert, (start, end) in enumerate(zip(starts, [3, 3, 10])):
        torch.testing.assert_close(weight_grads[expert], a[start:end].t() @ c[start:end])


def test_gradients_reach_exactly_the_chosen_experts():
    block = sparse_block(num_local_experts=8)
    x = torch.randn(3, 32)
    chosen = set(block.gate(x)[2].flatten().tolist())
    assert len(chosen) < 8  # 3 tokens x top-2 cannot reach all 8 experts
    block(x[None]).square().sum().backward()
    for e in range(8):
        hit = block.experts.gate_up_proj.grad[e].abs().sum() > 0
        assert hit == (e in chosen), e
        assert (block.experts.down_proj.grad[e].abs().sum() > 0) == (e in chosen), e
    assert block.gate.weight.grad.abs().sum() > 0  # the router learns through the mixing weights


def test_balanced_router_uses_every_expert_equally():
    """Token t prefers experts t mod K and t+1 mod K: each expert gets exactly N·k/K rows; the aux loss is k."""
    block = sparse_block(hidden_size=32, num_local_experts=4)
    with torch.no_grad():
        block.gate.weight.copy_(torch.eye(4, 32) * 10)
    x = torch.zeros(16, 32)
    for t in range(16):
        x[t, t % 4], x[t, (t + 1) % 4] = 1.0, 0.9
    logits, _, index = block.gate(x)
    assert torch.bincount(index.flatten(), minlength=4).tolist() == [8, 8, 8, 8]
    aux = load_balancing_loss((logits,), num_experts=4, top_k=2)
    torch.testing.assert_close(aux, torch.tensor(2.0))


# ---------------------------------------------------------------------------------------------------------------
# Auxiliary losses


def test_load_balancing_loss_matches_mixtral_formula():
    logits = tuple(torch.randn(2 * 7, 6) for _ in range(3))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[0, :3] = 0
    for m in (None, mask):
        ours = load_balancing_loss(logits, 6, 2, m)
        torch.testing.assert_close(ours, load_balancing_loss_func(logits, 6, 2, m))
    # with a cache the router sees only the new tokens: the mask's last columns are used
    long_mask = torch.cat([torch.ones(2, 5, dtype=torch.long), mask], dim=1)
    torch.testing.assert_close(load_balancing_loss(logits, 6, 2, long_mask), load_balancing_loss(logits, 6, 2, mask))


def test_load_balancing_loss_under_sigmoid_scores_reads_them_normalised():
    """DeepSeek-V3's balance loss: P_e from each token's sigmoid scores normalised to sum to 1, f_e from their top k;
    K · Σ f_e P_e, written out."""
    logits = (torch.randn(10, 6), torch.randn(10, 6))
    scores = torch.sigmoid(torch.cat(logits))
    normalised = scores / scores.sum(-1, keepdim=True)
    chosen = torch.nn.functional.one_hot(scores.topk(2, dim=-1).indices, 6).sum(1).float()  # (20, 6)
    expected = 6 * ((chosen.sum(0) / 20) * normalised.mean(0)).sum()
    torch.testing.assert_close(load_balancing_loss(logits, 6, 2, score_function="sigmoid"), expected)


def test_a_routers_correction_bias_is_a_saved_fp32_buffer_that_training_leaves(tmp_path):
    """`mlp.gate.e_score_correction_bias` (transformers' name): saved, loaded in fp32 under a bf16 load, and not a
    parameter an optimizer would move."""
    model = archlab.DecoderForCausalLM(moe_config(router_score_function="sigmoid", router_correction_bias=True))
    gate = model.model.layers[0].mlp.gate
    assert "e_score_correction_bias" not in dict(gate.named_parameters())
    gate.e_score_correction_bias.copy_(torch.tensor([0.5, -0.25, 0.125, 1e-3]))
    model.save_pretrained(tmp_path)
    loaded = archlab.DecoderForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    bias = loaded.model.layers[0].mlp.gate.e_score_correction_bias
    assert bias.dtype == torch.float32 and torch.equal(bias, gate.e_score_correction_bias)


def test_router_z_loss_against_definition():
    logits = (torch.randn(6, 4), torch.randn(6, 4))
    expected = torch.stack([torch.log(torch.exp(layer).sum(-1)) ** 2 for layer in logits]).mean()
    torch.testing.assert_close(router_z_loss(logits), expected)
    mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    keep = mask.flatten().bool()
    expected = torch.cat([torch.logsumexp(layer[keep], -1) ** 2 for layer in logits]).mean()
    torch.testing.assert_close(router_z_loss(logits, mask), expected)


def test_losses_are_added_to_the_lm_loss():
    ids = torch.randint(3, 97, (2, 8))
    plain = archlab.DecoderForCausalLM(moe_config()).eval()
    base = plain(ids, labels=ids)
    assert base.aux_loss is None and base.router_logits is None
    with_aux = plain(ids, labels=ids, output_router_logits=True)
    assert len(with_aux.router_logits) == 2
    torch.testing.assert_close(with_aux.loss, base.loss + 0.001 * with_aux.aux_loss)
    plain.config.router_z_loss_coef = 0.1
    with_z = plain(ids, labels=ids)
    logits = plain(ids, output_router_logits=True).router_logits
    torch.testing.assert_close(with_z.loss, base.loss + 0.1 * router_z_loss(logits))


@pytest.mark.parametrize("reentrant", [False, True])
def test_router_losses_without_a_gradient_are_named_under_reentrant_checkpointing(reentrant, monkeypatch):
    """Reentrant checkpointing gives back only a layer's output: the router logits left beside it carry no graph and
    the router losses would train nothing, silently (as Mixtral's). Non-reentrant (transformers' default): they do."""
    warned = []
    monkeypatch.setattr(moe.logger, "warning_once", warned.append)
    model = archlab.DecoderForCausalLM(moe_config(output_router_logits=True)).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    ids = torch.randint(3, 97, (2, 8))
    out = model(ids, labels=ids)
    assert out.aux_loss.requires_grad is not reentrant
    assert len(warned) == int(reentrant) and all("use_reentrant" in line and "\n" not in line for line in warned)
    with torch.no_grad():
        model(ids, labels=ids)  # evaluation: nothing to train, nothing said
    for layer in model.model.layers:
        layer.mlp.gate.requires_grad_(False)  # a frozen router (LoRA on the rest): nothing to say
    model(ids, labels=ids)
    assert len(warned) == int(reentrant)


# ---------------------------------------------------------------------------------------------------------------
# Parity with transformers


def mixtral_pair(**overrides):
    kw = dict(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        num_local_experts=4,
        num_experts_per_tok=2,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        output_router_logits=True,
        router_aux_loss_coef=0.02,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    kw.update(overrides)
    hf = MixtralForCausalLM(MixtralConfig(**kw)).eval()
    ours = archlab.DecoderForCausalLM(archlab.DecoderConfig(**kw)).eval()
    ours.load_state_dict(hf.state_dict(), strict=True)
    return hf, ours


@pytest.mark.parametrize("impl", ["eager", "grouped_mm"])
def test_mixtral_parity_logits_aux_loss_generation(impl):
    hf, ours = mixtral_pair()
    hf.set_experts_implementation(impl)
    ids = torch.randint(3, 97, (2, 11))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    a = hf(ids, attention_mask=mask, labels=ids)
    b = ours(ids, attention_mask=mask, labels=ids)
    assert (a.logits - b.logits).abs().max() <= 1e-4
    torch.testing.assert_close(b.aux_loss, a.aux_loss)
    torch.testing.assert_close(b.loss, a.loss)
    assert len(b.router_logits) == len(a.router_logits) == 2
    hf.config.output_router_logits = False  # Mixtral's aux loss cannot take a cache-length mask in generate
    gen_a = hf.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    gen_b = ours.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    assert torch.equal(gen_a, gen_b)


def test_router_logits_in_generate_on_the_static_cache():
    """With `output_router_logits=True`, generate on the static cache (the default on CUDA) gave the load-balancing
    loss the masks it builds per layer type, a dict: AttributeError. The tokens equal the dynamic cache's."""
    _, ours = mixtral_pair()
    ids = torch.randint(3, 97, (2, 7))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False)
    static = ours.generate(ids, cache_implementation="static", **kwargs)
    assert torch.equal(static, ours.generate(ids, **kwargs))


def test_mixtral_parity_one_token_decoding():
    """Batch-1 greedy decoding takes the one-token expert path at every step after the prompt."""
    hf, ours = mixtral_pair(output_router_logits=False)
    ids = torch.randint(3, 97, (1, 7))
    with torch.no_grad():
        out_a, out_b = hf(ids[:, :6], use_cache=True), ours(ids[:, :6], use_cache=True)
        step_a = hf(ids[:, 6:], past_key_values=out_a.past_key_values).logits
        step_b = ours(ids[:, 6:], past_key_values=out_b.past_key_values).logits
    assert (step_a - step_b).abs().max() <= 1e-4
    gen_a = hf.generate(ids, max_new_tokens=8, do_sample=False)
    gen_b = ours.generate(ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(gen_a, gen_b)


@pytest.mark.parametrize("qkv_bias", [True, False], ids=["stock_default_qkv_bias", "no_bias"])
def test_qwen2_moe_parity_shared_experts_and_dense_layers(qkv_bias):
    kw = dict(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=40,
        num_experts_per_tok=2,
        norm_topk_prob=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        output_router_logits=True,
    )
    hf = Qwen2MoeForCausalLM(
        Qwen2MoeConfig(**kw, num_experts=6, mlp_only_layers=[1], qkv_bias=qkv_bias, use_sliding_window=False)
    ).eval()
    ours = archlab.DecoderForCausalLM(
        archlab.DecoderConfig(
            **kw, num_local_experts=6, mlp_layer_types=["sparse", "dense", "sparse"], qkv_bias=qkv_bias
        )
    ).eval()
    ours.load_state_dict(hf.state_dict(), strict=True)
    ids = torch.randint(0, 97, (2, 9))
    a, b = hf(ids, labels=ids), ours(ids, labels=ids)
    assert (a.logits - b.logits).abs().max() <= 1e-4
    torch.testing.assert_close(b.aux_loss, a.aux_loss)
    torch.testing.assert_close(b.loss, a.loss)


# ---------------------------------------------------------------------------------------------------------------
# Cache, save/load, parameter counts


def test_incremental_decoding_matches_full_forward():
    model = archlab.DecoderForCausalLM(moe_config(shared_expert_intermediate_size=16)).eval()
    ids = torch.randint(3, 97, (2, 10))
    full = model(ids).logits
    out = model(ids[:, :6], use_cache=True)
    steps = [out.logits]
    cache = out.past_key_values
    for t in range(6, 10):
        out = model(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)


def test_save_and_load_round_trip(tmp_path):
    model = archlab.DecoderForCausalLM(
        moe_config(shared_expert_intermediate_size=16, mlp_layer_types=["dense", "sparse"])
    )
    model.save_pretrained(tmp_path)
    loaded = archlab.DecoderForCausalLM.from_pretrained(tmp_path)
    assert loaded.config.mlp_layer_types == ["dense", "sparse"]
    ids = torch.randint(3, 97, (1, 7))
    torch.testing.assert_close(loaded.eval()(ids).logits, model.eval()(ids).logits)


def test_initialisation_is_normal_with_initializer_range():
    model = archlab.DecoderForCausalLM(moe_config(num_local_experts=8, initializer_range=0.05))
    experts = model.model.layers[0].mlp.experts
    assert torch.isfinite(experts.gate_up_proj).all()
    assert abs(experts.gate_up_proj.std().item() - 0.05) < 0.005
    assert abs(model.model.layers[1].mlp.gate.weight.std().item() - 0.05) < 0.01


def test_parameter_counts_total_and_active():
    config = moe_config(num_local_experts=8, num_experts_per_tok=2, shared_expert_intermediate_size=16)
    model = archlab.DecoderForCausalLM(config)
    counts = count_parameters(model)
    assert counts["total"] == sum(p.numel() for p in model.parameters())
    per_expert = 3 * config.hidden_size * config.moe_intermediate_size
    assert counts["total"] - counts["active"] == config.num_hidden_layers * 6 * per_expert  # 6 of 8 idle
    assert counts["embedding"] == config.vocab_size * config.hidden_size
    dense = count_parameters(archlab.DecoderForCausalLM(tiny_decoder_config()))
    assert dense["total"] == dense["active"]


def test_bf16_autocast_runs_close_to_fp32():
    block = sparse_block()
    x = torch.randn(1, 12, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = block(x)
    assert low.dtype == x.dtype  # as Mixtral: the expert GEMMs run in bf16, the mixture keeps the input dtype
    torch.testing.assert_close(low.float(), block(x), atol=3e-2, rtol=3e-2)


# ---------------------------------------------------------------------------------------------------------------
# Converter (archlab.conversion): Mixtral folders both ways


def test_convert_mixtral_folder_both_ways(tmp_path):
    from archlab.conversion import ConversionError, convert_checkpoint

    hf, _ = mixtral_pair(rms_norm_eps=1e-5, sliding_window=None)
    hf.save_pretrained(tmp_path / "mixtral")
    convert_checkpoint(tmp_path / "mixtral", tmp_path / "archlab")
    ours = archlab.DecoderForCausalLM.from_pretrained(tmp_path / "archlab").eval()
    assert ours.config.num_local_experts == 4 and ours.config.mlp_layer_types == ["sparse", "sparse"]
    ids = torch.randint(3, 97, (2, 9))
    assert (ours(ids).logits - hf(ids).logits).abs().max() <= 1e-4

    convert_checkpoint(tmp_path / "archlab", tmp_path / "back", to="mixtral")
    back = MixtralForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert (back(ids).logits - hf(ids).logits).abs().max() <= 1e-4

    shared = archlab.DecoderForCausalLM(moe_config(shared_expert_intermediate_size=16))
    shared.save_pretrained(tmp_path / "shared")
    with pytest.raises(ConversionError, match="shared_expert_intermediate_size"):
        convert_checkpoint(tmp_path / "shared", tmp_path / "nope", to="mixtral")
    dense = archlab.DecoderForCausalLM(tiny_decoder_config())
    dense.save_pretrained(tmp_path / "dense")
    with pytest.raises(ConversionError, match="mixture of experts in every layer"):
        convert_checkpoint(tmp_path / "dense", tmp_path / "nope2", to="mixtral")


@pytest.mark.slow
def test_sparse_block_compiles_fullgraph_without_host_sync():
    """No `.item()`/`.tolist()` and no data-dependent shape: dynamo traces forward and backward as one graph."""
    torch._dynamo.reset()
    block = sparse_block(shared_expert_intermediate_size=16)
    x = torch.randn(2, 7, 32, requires_grad=True)
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    out = compiled(x)
    grad_compiled = torch.autograd.grad(out.square().sum(), (x, block.experts.gate_up_proj))
    ref = block(x)
    grad_ref = torch.autograd.grad(ref.square().sum(), (x, block.experts.gate_up_proj))
    torch.testing.assert_close(out, ref)
    for g, r in zip(grad_compiled, grad_ref):
        torch.testing.assert_close(g, r)
    with torch.no_grad():  # one token without gradients: compiled code keeps the grouped path (no host read)
        torch.testing.assert_close(compiled(x[:1, :1]), block(x[:1, :1]))


def test_routers_count_their_training_slots_and_the_balancing_step_moves_biases_by_the_summed_loads(monkeypatch):
    """`expert_load` counts the k slots of every training token (not in evaluation); `update_router_biases` moves
    each bias by γ · sign(mean − load) over the loads summed across data-parallel processes, then clears them."""
    config = moe_config(router_score_function="sigmoid", router_correction_bias=True, router_bias_update_rate=0.1)
    model = archlab.DecoderForCausalLM(config)
    ids = torch.randint(3, 97, (2, 5))
    model.eval()
    model(ids)
    gate = model.model.layers[0].mlp.gate
    assert not gate.expert_load.any()
    model.train()
    model(ids)
    assert gate.expert_load.sum() == 2 * 5 * 2  # tokens x k

    for layer in model.model.layers:
        layer.mlp.gate.expert_load.copy_(torch.tensor([3.0, 1.0, 0.0, 0.0]))
    other_process = torch.tensor([0.0, 0.0, 1.0, 3.0])  # summed: [3, 1, 1, 3], mean 2
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda loads: loads.add_(other_process))
    assert moe.update_router_biases(model) == 2
    torch.testing.assert_close(gate.e_score_correction_bias, torch.tensor([-0.1, 0.1, 0.1, -0.1]))
    assert not gate.expert_load.any()
    assert moe.update_router_biases(archlab.DecoderForCausalLM(moe_config())) == 0  # no balancing router
    with pytest.raises(ValueError, match="`router_bias_update_rate` .* `router_correction_bias` is False"):
        moe_config(router_bias_update_rate=0.001)


def test_balancing_counts_leave_padding_out_and_the_buffers_stay_float32_when_the_model_is_cast():
    """`expert_load` counts the slots of the tokens the attention mask keeps (a left-padded row's pads route
    somewhere too, and would push the biases against those experts), once a forward; cast to bf16 or fp16, the model
    keeps its correction biases and loads in float32 (in bf16 a bias near 1 moves in steps of 2^-7: a γ of 1e-3 never
    moved it), and a balancing step still moves them by γ."""
    config = moe_config(router_score_function="sigmoid", router_correction_bias=True, router_bias_update_rate=1e-3)
    model = archlab.DecoderForCausalLM(config).train()
    ids = torch.randint(3, 97, (2, 6))
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    model(ids, attention_mask=mask)
    gate = model.model.layers[0].mlp.gate
    assert gate.expert_load.sum() == (4 + 6) * 2  # kept tokens x k
    # the same counts as routing the kept tokens alone
    router_logits = model(ids, attention_mask=mask, output_router_logits=True).router_logits[0]
    kept = router_logits[mask.reshape(-1).bool()]
    chosen = gate.route(kept)[2]
    expected = torch.bincount(chosen.reshape(-1), minlength=gate.num_experts).float()
    torch.testing.assert_close(gate.expert_load, 2 * expected)  # (two forwards)

    for dtype in (torch.bfloat16, torch.float16):
        cast = copy.deepcopy(model).to(dtype)
        router = cast.model.layers[0].mlp.gate
        assert router.weight.dtype == dtype
        assert router.e_score_correction_bias.dtype == router.expert_load.dtype == torch.float32
        torch.testing.assert_close(router.expert_load, gate.expert_load)
        router.e_score_correction_bias.fill_(1.0)
        router.expert_load.copy_(torch.tensor([5.0, 1.0, 1.0, 1.0]))
        moe.update_router_biases(cast)
        torch.testing.assert_close(
            router.e_score_correction_bias, torch.tensor([1 - 1e-3, 1 + 1e-3, 1 + 1e-3, 1 + 1e-3])
        )
        with torch.no_grad():  # and the cast model routes
            cast.eval()(ids, attention_mask=mask)
