"""A decoding step's routed experts as two Triton kernels indexed by the router's choice (modeling/triton_moe.py): the
PyTorch experts' output for one to four tokens, one or two slots, sizes not a multiple of the blocks; used only
where it applies; greedy decoding of a mixture of experts through them (transformers' loop, and archlab's loop with
its step traced by dynamo) gives the PyTorch path's tokens.

The kernels run where Triton does: on a GPU, or on a CPU through Triton's interpreter (tests/triton_interpreter.py),
which `test_kernels_through_the_triton_interpreter` starts in a fresh process."""

from __future__ import annotations

import pytest
import torch

from archlab import DecoderForCausalLM
from archlab.modeling import triton_launch, triton_moe
from archlab.modeling.moe import Experts
from archlab.modeling.normalization import RMSNorm
from archlab.modeling.triton_moe import moe_decode, moe_decode_applies

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

MOE = dict(num_local_experts=4, num_experts_per_tok=2)


_interpreter_gaps = interpreter_gaps_filled("archlab.modeling.triton_moe")


# the experts' own choices the kernels compute: GPT-OSS's (biases on both products, the clamped quick-GELU SwiGLU with
# up + 1; a limit the products reach) and Llama 4's (the routing weight on the expert's input)
GPT_OSS = dict(act="quick_gelu", bias=True, limit=0.5, up_offset=1.0)
LLAMA4 = dict(weights_on_input=True)


def _experts(experts=4, hidden=48, intermediate=72, act="silu", gated=True, dtype=torch.float32, seed=0, **options):
    torch.manual_seed(seed)
    module = Experts(experts, hidden, intermediate, act, gated, **options)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.normal_(0.0, parameter.shape[-1] ** -0.5)
    return module.to(DEVICE, dtype).eval()


def test_the_kernels_apply_only_to_a_few_tokens_of_gated_silu_experts_on_the_listed_devices(monkeypatch):
    experts = _experts()
    x = torch.zeros(1, 48)
    monkeypatch.setattr(triton_moe, "triton", object())  # as where Triton is installed
    monkeypatch.setattr(triton_moe, "MOE_DECODE_DEVICES", (x.device.type,))
    with torch.no_grad():
        assert moe_decode_applies(experts.cpu(), x)
        assert moe_decode_applies(experts, torch.zeros(4, 48))
        assert not moe_decode_applies(experts, torch.zeros(5, 48))  # a prefill, a larger batch: grouped GEMMs
        assert not moe_decode_applies(_experts(act="gelu_pytorch_tanh").cpu(), x)
        assert not moe_decode_applies(_experts(gated=False).cpu(), x)
        # GPT-OSS's experts (biases, clamps, up + 1, quick GELU) and Llama 4's (weights on the input) take them too
        for options in (GPT_OSS, LLAMA4):
            assert moe_decode_applies(_experts(**options).cpu(), x), options
        assert not moe_decode_applies(experts, x.double())
    assert not moe_decode_applies(experts, x)  # gradients wanted (the weights'): no backward
    with torch.no_grad():
        monkeypatch.setattr(triton_moe, "MOE_DECODE_DEVICES", ())
        assert not moe_decode_applies(experts, x)
        monkeypatch.setattr(triton_moe, "MOE_DECODE_DEVICES", ("cpu",))
        monkeypatch.setattr(triton_moe, "triton", None)  # CPU wheels of torch: no Triton
        assert not moe_decode_applies(experts, x)


def _routing(tokens, experts, slots, dtype=torch.float32, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, 48, generator=g).to(DEVICE, dtype)
    probs = torch.softmax(torch.randn(tokens, experts, generator=g), dim=-1)
    weights, index = torch.topk(probs, slots, dim=-1)
    return x, index.to(DEVICE), weights.to(DEVICE)


def _reference(experts, x, index, weights):
    """The PyTorch experts (the grouped GEMMs, or on CPU at one token the chosen experts' products)."""
    with torch.no_grad():
        return experts(x, index, weights)


@runs_kernels
@pytest.mark.parametrize("tokens, slots", [(1, 2), (3, 2), (4, 1)])
@pytest.mark.parametrize("op", ["moe_decode", "moe_decode_pdl"])
def test_the_kernels_equal_the_pytorch_experts(tokens, slots, op, monkeypatch):
    """The op, and its PDL twin running the kernels' dependent-launch code (triton_launch.py)."""
    with_dependent_launch_code(monkeypatch, triton_moe)
    experts = _experts()
    x, index, weights = _routing(tokens, 4, slots)
    expected = _reference(experts, x, index, weights)
    with torch.no_grad():
        output = getattr(torch.ops.archlab, op)(x, index, weights, experts.gate_up_proj, experts.down_proj)
    assert output.shape == x.shape and output.dtype == x.dtype
    torch.testing.assert_close(output, expected, rtol=1e-5, atol=1e-5)


@runs_kernels
@pytest.mark.parametrize(
    "options", [GPT_OSS, LLAMA4, dict(GPT_OSS, act="silu", limit=None)], ids=["gpt-oss", "llama4", "biases"]
)
@pytest.mark.parametrize("fused", [False, True], ids=["alone", "norm-residual"])
@pytest.mark.parametrize("tokens, slots", [(1, 2), (3, 2), (2, 1)])
def test_the_experts_own_choices_equal_the_pytorch_experts(options, fused, tokens, slots):
    """GPT-OSS's experts (both biases, the clamped quick-GELU SwiGLU with up + 1; biases alone) and Llama 4's (the
    routing weight on the expert's input), alone and as the fused layer step's MLP half (norm inside, residual
    after), equal to the PyTorch experts."""
    experts = _experts(**options)
    x, index, weights = _routing(tokens, 4, slots)
    x = x * 3.0
    norm = RMSNorm(48, eps=1e-5).to(DEVICE) if fused else None
    residual = torch.randn(tokens, 48, generator=torch.Generator().manual_seed(4)).to(DEVICE) if fused else None
    with torch.no_grad():
        normed = norm(x) if fused else x
        expected = _reference(experts, normed, index, weights) + (residual if fused else 0.0)
        output = moe_decode(experts, x, index, weights, norm=norm, residual=residual)
    if experts.limit is not None:  # the clamps bite
        projected = torch.einsum("td,efd->tef", normed, experts.gate_up_proj) + experts.gate_up_proj_bias
        assert (projected.abs() > experts.limit).any()
    torch.testing.assert_close(output, expected, rtol=1e-5, atol=1e-5)


@runs_kernels
@pytest.mark.parametrize("tokens, slots", [(1, 2), (3, 2)])
@pytest.mark.parametrize("dependent", [False, True], ids=["op", "pdl-twin"])
def test_the_norm_inside_and_the_residual_after_equal_the_unfused_step(tokens, slots, dependent, monkeypatch):
    """The fused layer step's MLP half (decode_block.py): RMSNorm(x) computed inside the gate/up kernel, the residual
    added by the down kernel, against the norm module, the PyTorch experts and the add; through the op and its PDL
    twin."""
    if dependent:
        monkeypatch.setattr(triton_launch, "PDL_DEVICES", (DEVICE,))
        with_dependent_launch_code(monkeypatch, triton_moe)
    experts = _experts()
    x, index, weights = _routing(tokens, 4, slots)
    x = x * 3.0  # an input far from unit scale, so a missing 1/rms shows
    norm = RMSNorm(48, eps=1e-5).to(DEVICE)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, 48))
        residual = torch.randn(tokens, 48, generator=torch.Generator().manual_seed(4)).to(DEVICE)
        expected = _reference(experts, norm(x), index, weights) + residual
        output = moe_decode(experts, x, index, weights, norm=norm, residual=residual)
    torch.testing.assert_close(output, expected, rtol=1e-5, atol=1e-5)


@runs_kernels
@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, marks=pytest.mark.gpu), torch.float16])
def test_the_kernels_in_half_precision_are_as_close_as_the_pytorch_experts(dtype):
    """The GPU.md MoE shape (d 1024, 8 experts of 2,816; a quarter of each width under the interpreter): the
    kernels' error against fp32 within twice the PyTorch path's own in `dtype` (bf16 on a GPU only)."""
    hidden, intermediate = (1024, 2816) if torch.cuda.is_available() else (256, 704)
    experts = _experts(8, hidden, intermediate)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, hidden, generator=g).to(DEVICE)
    weights, index = torch.topk(torch.softmax(torch.randn(2, 8, generator=g), dim=-1), 2, dim=-1)
    index, weights = index.to(DEVICE), weights.to(DEVICE)
    exact = _reference(experts, x, index, weights)
    half = experts.to(dtype)
    pytorch = _reference(half, x.to(dtype), index, weights)
    with torch.no_grad():
        output = torch.ops.archlab.moe_decode(x.to(dtype), index, weights, half.gate_up_proj, half.down_proj)
    assert output.dtype == dtype
    ours, theirs = (output.float() - exact).abs().max(), (pytorch.float() - exact).abs().max()
    assert ours <= 2 * theirs + 1e-3, (ours, theirs)


@runs_kernels
@pytest.mark.parametrize("compiled", [False, True], ids=["transformers-loop", "archlab-loop"])
def test_greedy_decoding_through_the_kernels_gives_the_pytorch_tokens(compiled, monkeypatch):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = DecoderForCausalLM(tiny_decoder_config(**MOE)).to(DEVICE).eval()
    with torch.no_grad():  # weights of std d^-1/2: routing and logits spread out, no near-ties
        for name, parameter in model.named_parameters():
            if "norm" not in name:
                parameter.normal_(0.0, parameter.shape[-1] ** -0.5)
    batch = left_padded_batch(model.config.vocab_size)
    expected = greedy_tokens(model, batch, [] if compiled else None)
    model.release_decoding_memory()
    torch._dynamo.reset()
    monkeypatch.setattr(triton_moe, "MOE_DECODE_DEVICES", (DEVICE,))
    if compiled:
        graphs = []
        assert torch.equal(greedy_tokens(model, batch, graphs), expected)
        assert graphs and all(graph.count("archlab.moe_decode") == 2 for graph in graphs)  # both layers' steps
    else:
        calls = []
        kernel = triton_moe.moe_decode
        monkeypatch.setattr("archlab.modeling.moe.moe_decode", lambda *a: calls.append(1) or kernel(*a))
        assert torch.equal(greedy_tokens(model, batch), expected)
        assert len(calls) == 2 * 9  # two layers, the nine steps after the prefill (two tokens each)


@pytest.mark.gpu
def test_the_kernels_compiled_with_cuda_graphs_replay_without_recompiling():
    torch._dynamo.reset()
    experts = _experts(8, 1024, 2816, dtype=torch.bfloat16)

    def routed(x, index, weights):
        return torch.ops.archlab.moe_decode(x, index, weights, experts.gate_up_proj, experts.down_proj)

    compiled = torch.compile(routed, mode="reduce-overhead", fullgraph=True)
    for step in range(4):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(1, 1024, generator=g).to(DEVICE, torch.bfloat16)
        weights, index = torch.topk(torch.softmax(torch.randn(1, 8, generator=g), dim=-1), 2, dim=-1)
        index, weights = index.to(DEVICE), weights.to(DEVICE)
        torch.compiler.cudagraph_mark_step_begin()
        with torch.no_grad(), torch._dynamo.config.patch(error_on_recompile=step > 0):
            output = compiled(x, index, weights).clone()
        with torch.no_grad():  # (inductor autotunes apart from the eager call: another block size, another rounding)
            torch.testing.assert_close(output, routed(x, index, weights), rtol=1e-2, atol=1e-2)


# ---- on a CPU: the kernel tests above, through Triton's interpreter ------------------------------------------------


test_kernels_through_the_triton_interpreter = interpreted_run_of(__file__)
