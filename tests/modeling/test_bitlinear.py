"""bitlinear.py: BitNet b1.58's BitLinear — ternary weights and 8-bit activations quantized in every forward, the
gradient passed straight through — equal to transformers' `AutoBitLinear` in its online mode, layer for layer and as
every projection of a `bitlinear=True` decoder."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from archlab import DecoderForCausalLM
from archlab.modeling.bitlinear import BitLinear, int8_activations, ternary_weights, weight_of_ternary

from helpers import randomised, tiny_decoder_config


def test_weights_become_three_values_times_their_mean_magnitude():
    weight = torch.tensor([[0.9, -0.05, 0.4], [-1.2, 0.0, 0.2]])
    mean = weight.abs().mean()  # 0.4583
    expected = torch.tensor([[1.0, 0.0, 1.0], [-1.0, 0.0, 0.0]]) * mean  # 0.4 / 0.458 = 0.87 rounds to 1
    torch.testing.assert_close(ternary_weights(weight), expected)
    assert ternary_weights(weight.bfloat16()).dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("share", [1.0, 0.6, 0.02])
def test_a_ternary_weight_and_scale_become_a_weight_quantizing_to_them(dtype, share):
    """`weight_of_ternary` (an offline BitNet folder's packed weights read): its ternary weights are the given ones
    and its mean magnitude the given scale within half a step of the dtype over the nonzero count (~5e-8 at a
    bfloat16 layer of the 2B model's size), where one value for every nonzero entry would miss it by up to 0.4 %."""
    generator = torch.Generator().manual_seed(0)
    ternary = torch.randint(-1, 2, (96, 80), generator=generator)
    ternary = torch.where(ternary == 0, 1, ternary) * (torch.rand(96, 80, generator=generator) < share)
    for magnitude in (0.0123, 1.7, 3e-5):
        weight = weight_of_ternary(ternary, magnitude, dtype)
        mean = weight.float().abs().mean().item()
        # the two values differ by a step of `dtype`: the mean lands within half a step over the nonzero count
        within = torch.finfo(dtype).eps / (2 * ternary.count_nonzero().item()) + 1e-6
        assert weight.dtype == dtype and abs(mean / magnitude - 1) <= within
        assert torch.equal((weight.float() / mean).round().clamp(-1, 1), ternary.float())
        torch.testing.assert_close(ternary_weights(weight).float(), (ternary * magnitude).to(dtype).float())
    assert not weight_of_ternary(torch.zeros(3, 4), 0.5, dtype).any()


@pytest.mark.parametrize(
    "ternary, magnitude, message",
    [
        (torch.ones(2, 2), 1e-6, "at least 1e-05"),
        (torch.ones(2, 2), float("nan"), "must be finite"),
        (torch.full((2, 2), 2.0), 0.1, "other than -1, 0 and 1"),
    ],
)
def test_weight_of_ternary_refuses_what_no_weight_quantizes_to(ternary, magnitude, message):
    with pytest.raises(ValueError, match=message):
        weight_of_ternary(ternary, magnitude, torch.float32)


def test_activations_take_8_bits_per_token():
    activation = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(0))
    quantized = int8_activations(activation)
    steps = quantized * 127 / activation.abs().amax(dim=-1, keepdim=True)  # integers in [-127, 127]
    torch.testing.assert_close(steps, steps.round(), rtol=0, atol=1e-4)
    assert (quantized - activation).abs().max() <= activation.abs().max() / 254 + 1e-6  # half a step at most
    torch.testing.assert_close(int8_activations(activation[1:2]), quantized[1:2])  # per token: rows independent


def test_the_layer_equals_transformers_online_autobitlinear_and_passes_gradients_straight_through():
    from transformers.integrations.bitnet import AutoBitLinear

    torch.manual_seed(0)
    ours = BitLinear(24, 16, bias=True)
    theirs = AutoBitLinear(24, 16, bias=True, online_quant=True)
    theirs.load_state_dict(ours.state_dict())
    inputs = torch.randn(2, 5, 24, requires_grad=True)
    with torch._dynamo.config.patch(disable=True):  # their quantizers are `torch.compile`d: eager here
        expected = theirs(inputs)
    output = ours(inputs)
    assert torch.equal(output, expected)
    assert not torch.equal(output, nn.functional.linear(inputs, ours.weight, ours.bias))  # it does quantize
    output.sum().backward()
    # straight through: the gradients of a plain linear layer at the quantized operands
    torch.testing.assert_close(
        ours.weight.grad, torch.ones(2, 5, 16).flatten(0, 1).T @ int8_activations(inputs.detach()).flatten(0, 1)
    )
    torch.testing.assert_close(inputs.grad, torch.ones(2, 5, 16) @ ternary_weights(ours.weight.detach()))


def test_a_bitlinear_decoder_quantizes_every_layer_projection_and_trains():
    model = randomised(DecoderForCausalLM(tiny_decoder_config(bitlinear=True, sub_layer_norm=True, hidden_act="relu2")))
    projections = {name for name, module in model.named_modules() if isinstance(module, BitLinear)}
    layer = {f"model.layers.0.self_attn.{p}_proj" for p in "qkvo"} | {
        f"model.layers.0.mlp.{p}_proj" for p in ("gate", "up", "down")
    }
    assert layer <= projections and len(projections) == 7 * model.config.num_hidden_layers
    assert type(model.lm_head) is nn.Linear
    assert model.config.base_model_tp_plan == {}  # a weight's scale is over its whole tensor
    ids = torch.randint(3, 90, (2, 9), generator=torch.Generator().manual_seed(0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(12):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses  # the full-precision weights learn through the quantizers


@pytest.mark.parametrize("fields", [dict(num_local_experts=4), dict(kv_lora_rank=16, num_key_value_heads=4)])
def test_bitlinear_is_refused_where_its_projections_are_not_linear_layers(fields):
    with pytest.raises(ValueError, match="bitlinear"):
        tiny_decoder_config(bitlinear=True, **fields)


def test_a_bitlinear_decoder_compiles_in_one_graph_with_the_same_loss_and_gradients():
    """The straight-through quantizers trace into one graph (fullgraph=True), forward and backward."""
    torch._dynamo.reset()
    model = randomised(DecoderForCausalLM(tiny_decoder_config(bitlinear=True)))
    ids = torch.randint(3, 90, (2, 9), generator=torch.Generator().manual_seed(1))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    eager = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)(input_ids=ids, labels=ids).loss
    compiled.backward()
    torch.testing.assert_close(compiled, loss)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, eager[name], msg=name)


def test_inference_never_reads_bitlinear_projections_as_plain_weights(monkeypatch):
    """generate's fused q/k/v and gate/up products and the gated down GEMV read `nn.Linear` weights directly: they
    leave BitLinear projections alone, so its forward (the quantizers) runs."""
    from archlab.modeling import triton_gemv
    from archlab.modeling.fused_projections import inference_projections

    model = randomised(DecoderForCausalLM(tiny_decoder_config(bitlinear=True))).eval()
    ids = torch.randint(3, 90, (1, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = model(ids).logits
        with inference_projections(model, force=True) as groups:
            assert groups == 0
            assert torch.equal(model(ids).logits, expected)
        monkeypatch.setattr(triton_gemv, "triton", object())  # as where Triton is installed
        monkeypatch.setattr(triton_gemv, "GATED_DOWN_DEVICES", ("cpu",))
        gate = torch.zeros(1, 1, model.config.intermediate_size)
        plain = randomised(DecoderForCausalLM(tiny_decoder_config())).model.layers[0].mlp
        assert triton_gemv.gated_down_applies(plain, gate)
        assert not triton_gemv.gated_down_applies(model.model.layers[0].mlp, gate)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_generate_quantizes_each_weight_once_with_the_same_tokens(cache, monkeypatch):
    """Inside `generate` (`ternary_weights_once`) every BitLinear layer's ternary weight is computed once, not once
    a step: the same tokens and logits as quantizing every step; outside, and with gradients, every forward
    quantizes again."""
    import contextlib

    from archlab.modeling import bitlinear, fast_decoding

    model = randomised(DecoderForCausalLM(tiny_decoder_config(bitlinear=True))).eval()
    ids = torch.randint(3, 90, (2, 5), generator=torch.Generator().manual_seed(3))
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None, cache_implementation=cache)
    kwargs.update(output_logits=True, return_dict_in_generate=True)
    calls = []
    quantize = bitlinear.ternary_weights
    monkeypatch.setattr(bitlinear, "ternary_weights", lambda weight: calls.append(weight) or quantize(weight))
    once = model.generate(ids, **kwargs)
    layers = 7 * model.config.num_hidden_layers
    assert len(calls) == layers  # once each, for the prefill and every step
    assert all(module._ternary is None for module in model.modules() if isinstance(module, BitLinear))
    calls.clear()
    monkeypatch.setattr(fast_decoding, "ternary_weights_once", lambda model: contextlib.nullcontext(0))
    every_step = model.generate(ids, **kwargs)
    assert len(calls) == layers * 6  # the prefill and 5 steps
    assert torch.equal(once.sequences, every_step.sequences)
    for a, b in zip(once.logits, every_step.logits):
        assert torch.equal(a, b)
    with bitlinear.ternary_weights_once(model) as count:
        assert count == layers
        calls.clear()
        model(ids, labels=ids).loss.backward()  # training: quantized afresh, gradients through
        assert len(calls) == layers and model.model.layers[0].mlp.up_proj.weight.grad is not None


def test_the_compiled_decoding_loop_reads_the_ternary_weights_in_one_graph(monkeypatch):
    """generate's own loop with its step traced by dynamo (fullgraph=True), as on CUDA: it reads each layer's ternary
    weight computed once, and gives the tokens of the same loop quantizing every step."""
    import contextlib

    from transformers import CompileConfig

    from archlab.modeling import bitlinear, fast_decoding

    torch._dynamo.reset()
    monkeypatch.setattr(fast_decoding, "decodes_compiled_by_default", lambda device: True)
    loops = []
    decode = fast_decoding.decode
    monkeypatch.setattr(fast_decoding, "decode", lambda *args, **kwargs: loops.append(1) or decode(*args, **kwargs))
    model = randomised(DecoderForCausalLM(tiny_decoder_config(bitlinear=True))).eval()
    ids = torch.randint(3, 90, (2, 5), generator=torch.Generator().manual_seed(3))
    config = CompileConfig(backend="eager", mode=None, fullgraph=True)
    config._compile_all_devices = True  # (transformers compiles generate's steps on CUDA only)
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None)
    calls = []
    quantize = bitlinear.ternary_weights
    monkeypatch.setattr(bitlinear, "ternary_weights", lambda weight: calls.append(weight) or quantize(weight))
    fast = model.generate(ids, compile_config=config, **kwargs)
    assert loops and len(calls) == 7 * model.config.num_hidden_layers
    monkeypatch.setattr(fast_decoding, "ternary_weights_once", lambda model: contextlib.nullcontext(0))
    every_step = model.generate(ids, compile_config=config, **kwargs)
    assert len(loops) == 2 and len(calls) > 7 * model.config.num_hidden_layers * 2
    assert torch.equal(fast, every_step)


def test_weights_that_are_not_whole_here_quantize_in_their_forward():
    """A hooked layer (DeepSpeed ZeRO-3 gathers its weight in a hook; accelerate's offloading) is left to its forward
    inside `ternary_weights_once`, as one without `bitlinear` is never walked."""
    from archlab.modeling.bitlinear import ternary_weights_once

    model = randomised(DecoderForCausalLM(tiny_decoder_config(bitlinear=True))).eval()
    hooked = model.model.layers[0].self_attn.q_proj
    hooked.register_forward_pre_hook(lambda module, args: None)
    with ternary_weights_once(model) as count:
        assert count == 7 * model.config.num_hidden_layers - 1 and hooked._ternary is None
    with ternary_weights_once(DecoderForCausalLM(tiny_decoder_config())) as count:
        assert count == 0
