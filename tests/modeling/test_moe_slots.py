"""A mixture-of-experts layer's rows into expert order and back (modeling/moe_slots.py): the same sums as a
per-token reference, forward and backward, for every top-k; no scatter-add (atomic on a GPU) on either way."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import archlab
from archlab.modeling import compiled_kernels
from archlab.modeling.moe_slots import slots_to_tokens, sort_slots, tokens_to_slots

from helpers import tiny_decoder_config

# Ops whose CUDA kernels (and inductor's lowerings) add onto one place from several threads in no fixed order.
ACCUMULATING_OPS = {
    *("index_add", "index_add_", "index_put", "index_put_", "_index_put_impl_", "scatter_add", "scatter_add_"),
    *("scatter_reduce", "scatter_reduce_"),
}


class _OpNames(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def routed(tokens: int, experts: int, top_k: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    scores = torch.rand(tokens, experts, generator=generator)
    weights, index = torch.topk(scores.softmax(-1), top_k)
    return weights, index


@pytest.mark.parametrize("top_k", [1, 2, 3, 4])
def test_slots_go_to_expert_order_and_back_as_a_per_token_sum(top_k):
    tokens, experts, width = 11, 5, 6
    weights, index = routed(tokens, experts, top_k)
    order, inverse, offsets = sort_slots(index, experts)
    flat = index.reshape(-1)
    assert torch.equal(flat[order], torch.sort(flat, stable=True).values)
    assert torch.equal(order[inverse], torch.arange(tokens * top_k))
    assert offsets.dtype == torch.int32
    assert offsets.tolist() == torch.bincount(flat, minlength=experts).cumsum(0).tolist()

    hidden = torch.randn(tokens, width, dtype=torch.float64, requires_grad=True)
    weights = weights.double().requires_grad_()
    scale = torch.randn(tokens * top_k, width, dtype=torch.float64)  # stands in for the experts: row-specific
    slots = tokens_to_slots(hidden, order, inverse, top_k, torch.float64)
    assert torch.equal(slots, hidden[order // top_k])
    out = slots_to_tokens(slots * scale, weights, order, inverse)
    expected = torch.zeros(tokens, width, dtype=torch.float64)
    for row, slot in enumerate(order.tolist()):
        token, j = divmod(slot, top_k)
        expected[token] += weights[token, j] * hidden[token] * scale[row]
    torch.testing.assert_close(out, expected)

    grad = torch.randn(tokens, width, dtype=torch.float64)
    got = torch.autograd.grad(out, (hidden, weights), grad)
    want = torch.autograd.grad(expected, (hidden, weights), grad)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_no_tokens_route_to_no_rows():
    block = (
        archlab.DecoderForCausalLM(tiny_decoder_config(num_local_experts=4, num_hidden_layers=1)).model.layers[0].mlp
    )
    x = torch.randn(1, 0, 32, requires_grad=True)
    out = block(x)
    assert out.shape == (1, 0, 32)
    out.sum().backward()
    assert x.grad.shape == x.shape


def test_slots_cast_before_the_copy_and_sum_gradients_in_the_input_dtype():
    weights, index = routed(7, 4, 3)
    order, inverse, _ = sort_slots(index, 4)
    hidden = torch.randn(7, 8, requires_grad=True)
    slots = tokens_to_slots(hidden, order, inverse, 3, torch.bfloat16)
    assert slots.dtype == torch.bfloat16
    (grad,) = torch.autograd.grad(slots.float().sum(), hidden)
    assert grad.dtype == torch.float32
    torch.testing.assert_close(grad, torch.full_like(grad, 3.0))  # each token sits in 3 slots


@pytest.mark.parametrize("top_k", [2, 4])
def test_a_training_step_of_the_experts_adds_onto_nothing_with_scatters(top_k, monkeypatch):
    """Every sum over a token's slots is a gather then a sum, in a fixed order: a scatter-add (an index_add_
    mixing the slots back, or the backward of an index_select of the tokens) would sum them with atomics on a GPU,
    whose order, from top-3 on, changes the bf16 result from run to run."""
    model = archlab.DecoderForCausalLM(
        tiny_decoder_config(num_local_experts=6, num_experts_per_tok=top_k, num_hidden_layers=1)
    )
    block = model.model.layers[0].mlp
    x = torch.randn(2, 9, 32, requires_grad=True)
    monkeypatch.setattr(compiled_kernels, "FUSED_KERNEL_DEVICES", ())  # compiled kernels refuse a dispatch mode
    with _OpNames() as ops:
        out = block(x)
        out.square().sum().backward()
    assert "index_select" in ops.names  # the gathers ran
    assert not ops.names & ACCUMULATING_OPS, ops.names & ACCUMULATING_OPS
    assert x.grad is not None and block.gate.weight.grad.abs().sum() > 0


@pytest.mark.slow
def test_compiled_training_step_of_the_experts_has_no_atomic_adds():
    """Inductor lowers a scatter-add to atomic adds (`atomic_add` in its C++ and Triton code alike): the compiled
    forward and backward of a top-3 layer have none, and equal eager."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    model = archlab.DecoderForCausalLM(
        tiny_decoder_config(num_local_experts=6, num_experts_per_tok=3, num_hidden_layers=1)
    )
    block = model.model.layers[0].mlp
    x = torch.randn(2, 9, 32, requires_grad=True)
    params = (x, block.experts.gate_up_proj, block.experts.down_proj, block.gate.weight)
    expected = block(x)
    expected_grads = torch.autograd.grad(expected.square().sum(), params)
    compiled = torch.compile(block, fullgraph=True)

    def step():
        out = compiled(x)
        return out, torch.autograd.grad(out.square().sum(), params)

    (out, grads), code = run_and_get_code(step)
    assert "atomic_add" not in "\n".join(code)
    torch.testing.assert_close(out, expected)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want)


@pytest.mark.gpu
def test_a_top4_training_step_on_cuda_gives_the_same_bits_every_run():
    """On a GPU, bf16 autocast as Trainer(bf16=True) runs it: two identical steps give bitwise equal outputs and
    gradients (with scatter-adds, atomics summed a token's 4 slots in a different order each run)."""
    torch.manual_seed(0)
    model = archlab.DecoderForCausalLM(
        tiny_decoder_config(hidden_size=256, num_local_experts=8, num_experts_per_tok=4, num_hidden_layers=1)
    ).cuda()
    block = model.model.layers[0].mlp
    x = torch.randn(4, 512, 256, device="cuda", requires_grad=True)
    params = (x, block.experts.gate_up_proj, block.experts.down_proj, block.gate.weight)
    runs = []
    for _ in range(2):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = block(x)
        runs.append((out, *torch.autograd.grad(out.float().square().sum(), params)))
    for first, second in zip(*runs):
        assert torch.equal(first, second)
