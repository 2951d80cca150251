"""compiled_kernels.py: the rotary embedding and the gated activations as compiled kernels (listed devices, eager
code only) give the formulas' values and gradients, keep no more for the backward pass (the gated activation
less: act(gate) is recomputed), serve new lengths from one
symbolic graph, stay out of compiled code, and leave the formula running where the compiler fails or dynamo is
disabled. Inductor compiles them here on CPU (C++), as it compiles them on CUDA (Triton) by default."""

from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.utils import counters
from transformers.activations import ACT2FN

from archlab import DecoderForCausalLM, Seq2SeqForConditionalGeneration
from archlab.modeling import compiled_kernels, feed_forward, rotary

from helpers import randomised, tiny_decoder_config, tiny_seq2seq_config


@pytest.fixture
def on_cpu(monkeypatch):
    """The element-wise kernels compile on CPU too, from a fresh cache."""
    monkeypatch.setattr(compiled_kernels, "FUSED_KERNEL_DEVICES", ("cpu",))
    monkeypatch.setattr(rotary.ROTARY_KERNEL, "compiled", {})
    monkeypatch.setattr(feed_forward, "_GATED_KERNELS", {})
    torch._dynamo.reset()
    counters.clear()


def _rotary_inputs(length: int, rotary_dim: int = 16):
    generator = torch.Generator().manual_seed(length)
    query = torch.randn(2, 4, length, 16, generator=generator, requires_grad=True)
    key = torch.randn(2, 2, length, 16, generator=generator, requires_grad=True)
    cos, sin = (torch.randn(2, length, rotary_dim, generator=generator) for _ in range(2))
    return query, key, cos, sin


def _values_and_gradients(function, inputs):
    outputs = function(*inputs)
    weights = [torch.randn(o.shape, generator=torch.Generator().manual_seed(9)) for o in outputs]
    loss = sum((o * w).sum() for o, w in zip(outputs, weights))
    return (*outputs, *torch.autograd.grad(loss, [t for t in inputs if t.requires_grad]))


@pytest.mark.parametrize("rotary_dim", [16, 8], ids=["full", "partial"])
def test_the_rotary_kernel_gives_the_formula_and_one_graph_serves_new_lengths(rotary_dim, on_cpu):
    for length in (7, 5, 11):
        inputs = _rotary_inputs(length, rotary_dim)
        ours = _values_and_gradients(rotary.apply_rotary, inputs)
        formula = _values_and_gradients(rotary.rotary_formula, inputs)
        for a, b in zip(ours, formula):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    assert rotary.ROTARY_KERNEL.compiled["cpu"] is not None
    assert counters["stats"]["unique_graphs"] <= 2  # the first length, then symbolic lengths


def test_under_autocast_the_rotary_kernel_writes_the_autocast_dtype(on_cpu):
    """The formula's float32 result (float32 rotary table, as under Llama's autocast), rounded once to bf16: what
    attention would cast it to; gradients flow back to the bf16 queries and keys alike."""
    query, key, cos, sin = _rotary_inputs(7)
    query, key = (t.detach().bfloat16().requires_grad_() for t in (query, key))
    with torch.autocast("cpu", torch.bfloat16):
        ours = rotary.apply_rotary(query, key, cos, sin)
        formula = rotary.rotary_formula(query, key, cos, sin)
    assert [t.dtype for t in ours] == [torch.bfloat16] * 2 and formula[0].dtype == torch.float32
    for a, b in zip(ours, formula):
        torch.testing.assert_close(a, b.bfloat16(), atol=0, rtol=0)
    gradients = torch.autograd.grad(sum(t.float().sum() for t in ours), (query, key))
    expected = torch.autograd.grad(sum(t.bfloat16().float().sum() for t in formula), (query, key))
    for a, b in zip(gradients, expected):
        torch.testing.assert_close(a, b, atol=1e-2, rtol=1e-2)


def _saved_bytes(function, inputs) -> int:
    saved = []

    def pack(tensor):
        saved.append(tensor.numel() * tensor.element_size())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        function(*inputs)
    return sum(saved)


def test_the_kernels_keep_no_more_for_the_backward_pass(on_cpu):
    inputs = _rotary_inputs(64)
    assert _saved_bytes(rotary.apply_rotary, inputs) <= _saved_bytes(rotary.rotary_formula, inputs)  # cos, sin
    gate, up = (torch.randn(4, 64, 32, requires_grad=True) for _ in range(2))
    silu = ACT2FN["silu"]
    fused = _saved_bytes(lambda g, u: feed_forward.gated_activation("silu", silu, g, u), (gate, up))
    assert fused < _saved_bytes(lambda g, u: silu(g) * u, (gate, up))  # act(gate) is not kept


@pytest.mark.parametrize("hidden_act", ["silu", "gelu_pytorch_tanh", "relu"])
def test_the_gated_kernel_gives_the_formula(hidden_act, on_cpu):
    act = ACT2FN[hidden_act]
    inputs = tuple(torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(i), requires_grad=True) for i in (1, 2))
    ours = _values_and_gradients(lambda g, u: (feed_forward.gated_activation(hidden_act, act, g, u),), inputs)
    formula = _values_and_gradients(lambda g, u: (act(g) * u,), inputs)
    for a, b in zip(ours, formula):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    assert feed_forward._GATED_KERNELS[hidden_act][0].compiled["cpu"] is not None
    swapped = _values_and_gradients(lambda g, u: (feed_forward.gated_activation(hidden_act, torch.tanh, g, u),), inputs)
    for a, b in zip(swapped, _values_and_gradients(lambda g, u: (torch.tanh(g) * u,), inputs)):
        torch.testing.assert_close(a, b, atol=0, rtol=0)  # an activation swapped in by hand is the one that runs


MODELS = {
    "llama": lambda: randomised(DecoderForCausalLM(tiny_decoder_config())),
    "moe_partial_rotary": lambda: randomised(
        DecoderForCausalLM(
            tiny_decoder_config(
                num_local_experts=4,
                num_experts_per_tok=2,
                shared_expert_intermediate_size=32,
                rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
            )
        )
    ),
    "seq2seq_gated": lambda: randomised(
        Seq2SeqForConditionalGeneration(tiny_seq2seq_config(mlp_type="gated", activation_function="silu"))
    ),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_training_step_through_the_kernels_equals_the_formulas(name, monkeypatch):
    model = MODELS[name]().train()
    reference = copy.deepcopy(model)
    ids = torch.randint(3, 61, (2, 9), generator=torch.Generator().manual_seed(0))
    extra = {"decoder_input_ids": ids[:, :6]} if model.config.is_encoder_decoder else {}
    labels = ids[:, :6] if extra else ids
    reference(input_ids=ids, labels=labels, **extra).loss.backward()
    monkeypatch.setattr(compiled_kernels, "FUSED_KERNEL_DEVICES", ("cpu",))
    monkeypatch.setattr(feed_forward, "_GATED_KERNELS", {})
    torch._dynamo.reset()
    loss = model(input_ids=ids, labels=labels, **extra).loss
    loss.backward()
    torch.testing.assert_close(loss, reference(input_ids=ids, labels=labels, **extra).loss, atol=1e-5, rtol=1e-5)
    for (parameter_name, ours), theirs in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(ours.grad, theirs.grad, atol=1e-5, rtol=1e-4, msg=parameter_name)
    assert any(kernel.compiled.get("cpu") for kernel, _ in feed_forward._GATED_KERNELS.values())


def test_compiled_code_runs_the_formulas_without_a_graph_break(on_cpu):
    model = MODELS["llama"]()
    ids = torch.randint(3, 61, (2, 9), generator=torch.Generator().manual_seed(0))
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(input_ids=ids).logits, model(input_ids=ids).logits)
    before = dict(rotary.ROTARY_KERNEL.compiled)
    torch._dynamo.reset()
    compiled = torch.compile(MODELS["llama"](), backend="eager", fullgraph=True)
    compiled(input_ids=ids)
    assert rotary.ROTARY_KERNEL.compiled == before  # inside a compiled graph nothing else is compiled


def test_a_failing_compiler_or_disabled_dynamo_leaves_the_formula(on_cpu, monkeypatch):
    warnings = []
    monkeypatch.setattr(compiled_kernels.logger, "warning", warnings.append)

    def failing(*args):
        raise torch._dynamo.exc.BackendCompilerFailed(None, RuntimeError("no working triton"), None)

    monkeypatch.setattr(rotary.ROTARY_KERNEL, "compiled", {"cpu": failing})
    inputs = _rotary_inputs(7)
    for _ in range(2):
        for a, b in zip(rotary.apply_rotary(*inputs), rotary.rotary_formula(*inputs)):
            torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert rotary.ROTARY_KERNEL.compiled["cpu"] is None
    assert len(warnings) == 1 and "no working triton" in warnings[0] and "rotary" in warnings[0]
    monkeypatch.setattr(rotary.ROTARY_KERNEL, "compiled", {})
    with torch._dynamo.config.patch(disable=True):  # TORCHDYNAMO_DISABLE=1
        assert rotary.ROTARY_KERNEL(*inputs, torch.float32) is None
    assert not rotary.ROTARY_KERNEL.compiled


def test_past_the_recompile_limit_or_under_error_on_recompile_new_shapes_run_the_formula(on_cpu, monkeypatch):
    """A process that runs many shapes and dtypes (a test session on a GPU, a sweep) reaches dynamo's recompile limit
    for a kernel; with fullgraph that is an error, and a caller's `error_on_recompile` (e.g. around a compiled
    decoding loop whose eager prefill calls the kernels) makes any recompile one. Either way the call runs the
    formula, one warning says so, and the graphs compiled so far keep running."""
    warnings = []
    monkeypatch.setattr(compiled_kernels.logger, "warning", warnings.append)
    monkeypatch.setattr(rotary.ROTARY_KERNEL, "told_no_recompile", False, raising=False)
    first = _rotary_inputs(7)
    rotary.ROTARY_KERNEL(*first, torch.float32)  # compiles the first graph
    for length, config in ((5, {"error_on_recompile": True}), (6, {"recompile_limit": 1})):
        inputs = _rotary_inputs(length)
        with torch._dynamo.config.patch(**config):
            assert rotary.ROTARY_KERNEL(*inputs, torch.float32) is None  # no graph for it: the caller's formula
            for a, b in zip(rotary.apply_rotary(*inputs), rotary.rotary_formula(*inputs)):
                torch.testing.assert_close(a, b, atol=0, rtol=0)
            assert rotary.ROTARY_KERNEL(*first, torch.float32) is not None  # the compiled length still compiled
    assert len(warnings) == 1 and "recompile limit" in warnings[0], warnings
    assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.gpu
def test_the_kernels_compile_on_cuda_and_train_as_the_formulas(monkeypatch):
    """On CUDA (the default list) a bf16-autocast training step runs the compiled kernels (Triton) and gives the
    formulas' loss and gradients within bf16 rounding (the kernels round once, the formulas after every operation):
    each parameter's gradient as close to the fp32 formulas' as the bf16 formulas' is, within a factor of 2 (a fixed
    share of the norm held on an H100 and failed on an H200: the tied embedding's gradient, 3.4 % against 2 %).
    A dense model: a router's near-ties could route a token differently on the two sides."""
    partial = {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}
    model = randomised(DecoderForCausalLM(tiny_decoder_config(rope_parameters=partial))).cuda().train()  # no router
    reference, exact = copy.deepcopy(model), copy.deepcopy(model)
    ids = torch.randint(3, 61, (4, 64), generator=torch.Generator().manual_seed(0)).cuda()
    with torch.autocast("cuda", torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert rotary.ROTARY_KERNEL.compiled.get("cuda") is not None
    assert feed_forward._GATED_KERNELS["silu"][0].compiled.get("cuda") is not None
    monkeypatch.setattr(compiled_kernels, "FUSED_KERNEL_DEVICES", ())
    with torch.autocast("cuda", torch.bfloat16):
        expected = reference(input_ids=ids, labels=ids).loss
    expected.backward()
    exact(input_ids=ids, labels=ids).loss.backward()  # fp32, the formulas
    torch.testing.assert_close(loss, expected, atol=2e-2, rtol=2e-2)
    for (name, ours), theirs, truth in zip(model.named_parameters(), reference.parameters(), exact.parameters()):
        error, their_error = ((grad - truth.grad).norm() / truth.grad.norm() for grad in (ours.grad, theirs.grad))
        assert error <= 2 * their_error + 1e-3, f"{name}: {error:.3g} of the fp32 gradients' norm ({their_error:.3g})"


def test_without_gradients_small_tensors_run_the_formula(on_cpu, monkeypatch):
    """A compiled call costs the host more than the formula's launches: where no gradient is recorded (generate's
    prefill, eager decoding steps) tensors under INFERENCE_MIN_ELEMENTS run the formula, larger ones the kernel;
    training calls take the kernel whatever their size."""
    model = randomised(DecoderForCausalLM(tiny_decoder_config()))
    ids = torch.randint(3, 97, (2, 12))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    assert rotary.ROTARY_KERNEL.compiled == {} and feed_forward._GATED_KERNELS["silu"][0].compiled == {}
    monkeypatch.setattr(compiled_kernels, "INFERENCE_MIN_ELEMENTS", 2 * 4 * 12 * 8)  # the queries' size: compiled
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-5)
    assert rotary.ROTARY_KERNEL.compiled["cpu"] is not None
    assert feed_forward._GATED_KERNELS["silu"][0].compiled["cpu"] is not None  # the gate (2, 12, 64): larger
    monkeypatch.setattr(compiled_kernels, "INFERENCE_MIN_ELEMENTS", 1 << 24)
    query, key, cos, sin = _rotary_inputs(5)
    assert rotary.ROTARY_KERNEL(query, key, cos, sin, torch.float32) is not None  # recording a gradient: compiled
    with torch.no_grad():
        assert rotary.ROTARY_KERNEL(query, key, cos, sin, torch.float32) is None


def test_an_activation_with_parameters_is_built_in_the_model_dtype_and_never_compiled_by_name(on_cpu):
    """xIELU (Apertus) learns α: transformers builds its parameters in bfloat16 unless told (an fp32 model's other
    parameters are not), and a kernel compiled from the activation's name would compute it with fresh α — the formula
    runs instead, with the module's own."""
    act = feed_forward.make_activation("xielu")
    assert {p.dtype for p in act.parameters()} == {torch.float32}
    with torch.no_grad():
        act.alpha_p.fill_(2.0)
    gate, up = torch.randn(4, 8), torch.randn(4, 8)
    torch.testing.assert_close(feed_forward.gated_activation("xielu", act, gate, up), act(gate) * up)
    assert "xielu" not in feed_forward._GATED_KERNELS
