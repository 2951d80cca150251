"""A gated MLP's down projection of a decoding step as one Triton kernel with SiLU inside (modeling/triton_gemv.py):
the unfused formula's output for one to four rows, with and without a bias, inputs not a multiple of the blocks;
used only where it applies; greedy decoding through it (transformers' loop, and archlab's loop with its step traced by
dynamo) gives the formula's tokens.

The kernels run where Triton does: on a GPU, or on a CPU through Triton's interpreter (tests/triton_interpreter.py),
which `test_kernels_through_the_triton_interpreter` starts in a fresh process."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from archlab import DecoderForCausalLM
from archlab.modeling import triton_gemv, triton_launch
from archlab.modeling.triton_gemv import gated_down_applies

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

_interpreter_gaps = interpreter_gaps_filled("archlab.modeling.triton_gemv")


def _mlp(**overrides):
    model = DecoderForCausalLM(tiny_decoder_config(**overrides)).eval()
    return model.model.layers[0].mlp


def test_the_kernel_applies_only_to_a_few_rows_of_silu_on_the_listed_devices(monkeypatch):
    mlp = _mlp()
    gate = torch.zeros(1, 1, mlp.down_proj.in_features)
    monkeypatch.setattr(triton_gemv, "triton", object())  # as where Triton is installed
    monkeypatch.setattr(triton_gemv, "GATED_DOWN_DEVICES", ("cpu",))
    with torch.no_grad():
        assert gated_down_applies(mlp, gate)
        assert gated_down_applies(mlp, torch.zeros(2, 2, gate.shape[-1]))  # 4 rows
        assert gated_down_applies(mlp, torch.zeros(16, 1, gate.shape[-1]))  # 16 rows: the tensor-core kernel
        assert not gated_down_applies(mlp, torch.zeros(17, 1, gate.shape[-1]))  # a prefill, a larger batch
        assert not gated_down_applies(mlp, gate.double())
        assert not gated_down_applies(_mlp(hidden_act="gelu_pytorch_tanh"), gate)  # GeGLU: not written
        assert not gated_down_applies(_mlp(swiglu_limit=7.0), gate)  # GPT-OSS's clamps: not written either
        assert not gated_down_applies(_mlp(sub_layer_norm=True), gate)  # Sub-LN's norm before the down projection
    assert not gated_down_applies(mlp, gate)  # gradients wanted (the weights'): the kernel has no backward
    monkeypatch.setattr(triton_gemv, "GATED_DOWN_DEVICES", ())
    with torch.no_grad():
        assert not gated_down_applies(mlp, gate)
        monkeypatch.setattr(triton_gemv, "GATED_DOWN_DEVICES", ("cpu",))
        monkeypatch.setattr(triton_gemv, "triton", None)  # CPU wheels of torch: no Triton
        assert not gated_down_applies(mlp, gate)


def _down(weight, bias) -> SimpleNamespace:
    """What `gated_down` reads of a gated MLP: its down projection's weight and bias."""
    return SimpleNamespace(down_proj=SimpleNamespace(weight=weight, bias=bias))


def _formula(gate, up, weight, bias):
    return nn.functional.linear((nn.functional.silu(gate) * up).to(weight.dtype), weight, bias)


def _inputs(rows, inputs, outputs, bias, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    gate, up = torch.randn(rows, 1, 2 * inputs, generator=g).chunk(2, dim=-1)  # halves of the fused gate/up product
    weight = torch.randn(outputs, inputs, generator=g) / inputs**0.5
    to = dict(device=DEVICE, dtype=dtype)
    bias = torch.randn(outputs, generator=g).to(**to) if bias else None
    return gate.to(**to), up.to(**to), weight.to(**to), bias


@runs_kernels
@pytest.mark.parametrize("rows, inputs, outputs, bias", [(1, 300, 40, False), (3, 1000, 70, True), (4, 64, 8, False)])
def test_the_kernel_equals_the_formula(rows, inputs, outputs, bias):
    gate, up, weight, bias = _inputs(rows, inputs, outputs, bias)
    output = torch.ops.archlab.gated_down(gate, up, weight, bias)
    assert output.shape == (rows, 1, outputs) and output.dtype == gate.dtype
    torch.testing.assert_close(output, _formula(gate, up, weight, bias), rtol=1e-5, atol=1e-5)


@runs_kernels
@pytest.mark.parametrize("compiled", [False, True], ids=["transformers-loop", "archlab-loop"])
def test_greedy_decoding_through_the_kernel_gives_the_formula_s_tokens(compiled, monkeypatch):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = DecoderForCausalLM(tiny_decoder_config()).to(DEVICE).eval()
    batch = left_padded_batch(model.config.vocab_size)
    expected = greedy_tokens(model, batch, [] if compiled else None)
    model.release_decoding_memory()
    torch._dynamo.reset()
    monkeypatch.setattr(triton_gemv, "GATED_DOWN_DEVICES", (DEVICE,))
    if compiled:
        graphs = []
        assert torch.equal(greedy_tokens(model, batch, graphs), expected)
        assert graphs and all(graph.count("archlab.gated_down") == 2 for graph in graphs)  # both layers' steps
    else:
        calls = []
        kernel = triton_gemv.gated_down
        monkeypatch.setattr("archlab.modeling.feed_forward.gated_down", lambda *a: calls.append(1) or kernel(*a))
        assert torch.equal(greedy_tokens(model, batch), expected)
        assert len(calls) == 2 * 9  # two layers, the nine steps after the prefill (two rows each)


def _norm(inputs, dtype=torch.float32, seed=1):
    from archlab.modeling.normalization import RMSNorm

    norm = RMSNorm(inputs, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(1 + torch.randn(inputs, generator=torch.Generator().manual_seed(seed)) / 4)
    return norm.to(DEVICE, dtype)


def _launched_as(launch: str, monkeypatch) -> None:
    """`dependent`: the ops go through their PDL twins and the kernels run their dependent-launch code; `plain`: the
    ops as they are."""
    if launch == "dependent":
        monkeypatch.setattr(triton_launch, "PDL_DEVICES", (DEVICE,))
        with_dependent_launch_code(monkeypatch, triton_gemv)


@runs_kernels
@pytest.mark.parametrize("prologue", ["plain", "rms_norm", "silu_gated"])
@pytest.mark.parametrize(
    "rows, inputs, outputs, bias",
    [
        (1, 300, 40, False),
        (2, 2100, 24, True),
        (3, 1000, 70, True),
        (4, 64, 8, False),
        (7, 300, 40, True),
        (16, 520, 72, False),
    ],
)
@pytest.mark.parametrize("launch", ["plain", "dependent"])
def test_each_prologue_with_a_residual_equals_the_unfused_step(
    prologue, rows, inputs, outputs, bias, launch, monkeypatch
):
    """y = W·input (+ b) + r, the input x as it comes, RMSNorm(x), or silu(gate) ⊙ up: the block's unfused arithmetic
    (the norm module, nn.Linear, the residual added after); up to 4 rows the streaming kernel (2 rows over three
    blocks of its first configuration's 1,024 inputs: the loop and its unrolling's remainder), 7 and 16 the
    tensor-core one. `dependent`: through the ops' PDL twins with the kernels' dependent-launch code (the streaming
    kernel's first weight block read before the wait, outside its loop); on Hopper with the launch attribute, under
    the interpreter with the `griddepcontrol` instructions left out (they are Hopper's)."""
    _launched_as(launch, monkeypatch)
    gate, up, weight, bias = _inputs(rows, inputs, outputs, bias)
    residual = torch.randn(rows, 1, outputs, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    if prologue == "silu_gated":
        output = triton_gemv.gated_down(_down(weight, bias), gate, up, residual)
        expected = _formula(gate, up, weight, bias) + residual
    else:
        norm = _norm(inputs) if prologue == "rms_norm" else None
        output = triton_gemv.gemv(gate, weight, bias, norm=norm, residual=residual)
        expected = nn.functional.linear(norm(gate) if norm else gate, weight, bias) + residual
    assert output.shape == (rows, 1, outputs) and output.dtype == gate.dtype
    torch.testing.assert_close(output, expected, rtol=1e-5, atol=1e-5)


@runs_kernels
@pytest.mark.parametrize("prologue", ["plain", "rms_norm"])
@pytest.mark.parametrize(
    "rows, inputs, outputs, bias",
    [
        (1, 300, 40, False),
        (1, 1100, 9, True),
        (3, 1000, 70, True),
        (4, 2100, 10, False),
        (7, 300, 40, True),
        (16, 520, 72, False),
    ],
)
@pytest.mark.parametrize("launch", ["plain", "dependent"])
def test_the_gated_gemv_equals_the_unfused_gate_up_product_and_swiglu(
    prologue, rows, inputs, outputs, bias, launch, monkeypatch
):
    """silu(gate) ⊙ up of [gate, up] = W·input (+ b), W = [gate; up] (a gated MLP's gate/up product laid out as one):
    the unfused arithmetic — the product rounded to the output's dtype (fp32 here), then SwiGLU — for one row (the
    one-row kernel), 3 and 4 (streaming; 4 over three blocks of inputs) and 7 and 16 (tensor cores); output counts
    not a multiple of a program's (9: the last program's second half of its pairs masked)."""
    _launched_as(launch, monkeypatch)
    x, _, weight, bias = _inputs(rows, inputs, 2 * outputs, bias)
    norm = _norm(inputs) if prologue == "rms_norm" else None
    output = triton_gemv.gated_gemv(x, weight, bias, norm=norm)
    gate, up = nn.functional.linear(norm(x) if norm else x, weight, bias).chunk(2, dim=-1)
    assert output.shape == (rows, 1, outputs) and output.dtype == x.dtype
    torch.testing.assert_close(output, nn.functional.silu(gate) * up, rtol=1e-5, atol=1e-5)


@runs_kernels
@pytest.mark.parametrize("variant", ["plain", "rms_norm", "silu_gated", "gated", "rms_norm-gated"])
@pytest.mark.parametrize("rows, inputs, splits", [(7, 520, 3), (16, 300, 4)])
@pytest.mark.parametrize("launch", ["plain", "dependent"])
def test_the_split_k_tensor_core_kernel_equals_the_unfused_step(variant, rows, inputs, splits, launch, monkeypatch):
    """5-16 rows with the input blocks split among programs (`split_count`: where the tiles would leave a GPU's
    processors idle), added up in split order by `_split_sum_kernel`, which runs the epilogue: each prologue with a
    bias and a residual, and the gate/up product with SwiGLU after it, to 1e-5 of the unsplit arithmetic. Uneven
    shares (520 inputs: 5 blocks of the interpreter's 128 in shares of 2, 2, 1) and an empty one (300: 3 blocks in
    4 shares)."""
    _launched_as(launch, monkeypatch)
    asked = []
    monkeypatch.setattr(triton_gemv, "split_count", lambda *args: asked.append(args[:2]) or splits)
    outputs = 36
    gated = variant.endswith("gated") and variant != "silu_gated"
    gate, up, weight, bias = _inputs(rows, inputs, 2 * outputs if gated else outputs, True)
    norm = _norm(inputs) if variant.startswith("rms_norm") else None
    residual = torch.randn(rows, 1, outputs, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    if variant == "silu_gated":
        output = triton_gemv.gated_down(_down(weight, bias), gate, up, residual)
        expected = _formula(gate, up, weight, bias) + residual
    elif gated:
        output = triton_gemv.gated_gemv(gate, weight, bias, norm=norm)
        product_gate, product_up = nn.functional.linear(norm(gate) if norm else gate, weight, bias).chunk(2, dim=-1)
        expected = nn.functional.silu(product_gate) * product_up
    else:
        output = triton_gemv.gemv(gate, weight, bias, norm=norm, residual=residual)
        expected = nn.functional.linear(norm(gate) if norm else gate, weight, bias) + residual
    assert asked == [(weight.shape[0], inputs)]  # the tensor-core kernel asked, with the weight's rows
    assert output.shape == (rows, 1, outputs)
    torch.testing.assert_close(output, expected, rtol=1e-5, atol=1e-5)


def test_the_split_count_fills_the_processors_with_shares_of_at_least_512_inputs(monkeypatch):
    """The 1.1B model's products at 16 rows on a GPU of 132 processors (an H100 or H200): q/k/v (2,560 rows), output
    (2,048) and down (2,048 from 5,632 inputs) in 4, 4 and 5 shares; the gate/up product (11,264 rows: 352 programs
    of 32) and short inputs unsplit; none without a processor count (the interpreter's CPU)."""
    monkeypatch.setattr(triton_gemv, "_processors", lambda device: 132)
    cpu = torch.device("cpu")
    counts = [triton_gemv.split_count(rows, inputs, cpu) for rows, inputs in [(2560, 2048), (2048, 2048), (2048, 5632)]]
    assert counts == [4, 4, 5]
    assert triton_gemv.split_count(11264, 2048, cpu) == 1
    assert triton_gemv.split_count(2048, 700, cpu) == 1  # one share of at least 512 inputs
    assert triton_gemv.split_count(256, 65536, cpu) == triton_gemv.MAX_SPLITS
    monkeypatch.undo()
    assert triton_gemv.split_count(2560, 2048, cpu) == 1  # PROCESSORS_ELSEWHERE


@runs_kernels
def test_the_norm_s_epsilon_counts():
    """A tiny input: mean(x²) far below eps, so 1/rms is set by eps (a kernel that dropped it would blow up)."""
    gate, _, weight, _ = _inputs(2, 256, 16, False)
    norm = _norm(256)
    norm.variance_epsilon = 1e-2
    output = triton_gemv.gemv(gate * 1e-3, weight, norm=norm)
    torch.testing.assert_close(output, nn.functional.linear(norm(gate * 1e-3), weight), rtol=1e-5, atol=1e-7)


def test_the_gemv_applies_to_a_few_rows_of_one_dtype_without_gradients(monkeypatch):
    monkeypatch.setattr(triton_gemv, "triton", object())  # as where Triton is installed
    x, weight, gain = torch.zeros(4, 1, 8), torch.zeros(16, 8), torch.ones(8)
    with torch.no_grad():
        assert triton_gemv.gemv_applies(x, weight, None, gain)
        assert triton_gemv.gemv_applies(torch.zeros(16, 8), weight)  # the tensor-core kernel's rows
        assert not triton_gemv.gemv_applies(torch.zeros(17, 8), weight)  # more than MAX_ROWS rows
        assert not triton_gemv.gemv_applies(x, weight, gain.half())  # mixed dtypes
        assert not triton_gemv.gemv_applies(x.double(), weight.double())
        assert not triton_gemv.gemv_applies(x, weight.t().contiguous().t())  # the weight's rows strided
    assert not triton_gemv.gemv_applies(x, nn.Parameter(weight))  # a gradient wanted: no backward
    monkeypatch.setattr(triton_gemv, "triton", None)
    with torch.no_grad():
        assert not triton_gemv.gemv_applies(x, weight)


# ---- on a GPU: half precision, and the kernel inside inductor's code and CUDA graphs --------------------------------


@runs_kernels
@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, marks=pytest.mark.gpu), torch.float16])
@pytest.mark.parametrize("rows", [1, 4, 16])
def test_the_kernel_in_half_precision_is_as_close_as_the_formula(dtype, rows):
    """The 1.1B model's down projection (5,632 → 2,048; a quarter of each under the interpreter): the kernel's error
    against fp32 within twice the unfused formula's own in `dtype` (autotuned on its first call; bf16 on a GPU
    only: the interpreter computes with NumPy, which has no bfloat16)."""
    inputs, outputs = (5632, 2048) if torch.cuda.is_available() else (1408, 512)
    gate, up, weight, _ = _inputs(rows, inputs, outputs, False, dtype=dtype)
    exact = _formula(gate.float(), up.float(), weight.float(), None)
    unfused = _formula(gate, up, weight, None)
    output = torch.ops.archlab.gated_down(gate, up, weight, None)
    assert output.dtype == dtype
    ours, theirs = (output.float() - exact).abs().max(), (unfused.float() - exact).abs().max()
    assert ours <= 2 * theirs + 1e-3, (ours, theirs)


@runs_kernels
@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, marks=pytest.mark.gpu), torch.float16])
@pytest.mark.parametrize("rows", [1, 4, 16])
def test_the_normed_gemv_with_a_residual_in_half_precision_is_as_close_as_the_unfused_step(dtype, rows):
    """The 1.1B model's q/k/v product (2,048 → 2,560; a quarter of each under the interpreter) after its RMSNorm,
    plus a residual: the kernel's error against fp32 within twice the unfused step's own in `dtype` (the kernel scales
    by 1/rms after the sum, the unfused step rounds x/rms first: each within the other's rounding)."""
    inputs, outputs = (2048, 2560) if torch.cuda.is_available() else (512, 640)
    x, _, weight, _ = _inputs(rows, inputs, outputs, False, dtype=dtype)
    x = x * 3  # a residual stream's scale: the norm's 1/rms away from 1
    residual = torch.randn(rows, 1, outputs, generator=torch.Generator().manual_seed(4)).to(DEVICE, dtype)
    norm = _norm(inputs, dtype)
    fp32_norm = _norm(inputs)
    exact = nn.functional.linear(fp32_norm(x.float()), weight.float()) + residual.float()
    unfused = nn.functional.linear(norm(x), weight) + residual
    output = triton_gemv.gemv(x, weight, norm=norm, residual=residual)
    assert output.dtype == dtype
    ours, theirs = (output.float() - exact).abs().max(), (unfused.float() - exact).abs().max()
    assert ours <= 2 * theirs + 1e-3, (ours, theirs)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 16], ids=["one-row", "split-k"])
def test_the_kernel_compiled_with_cuda_graphs_replays_without_recompiling(rows):
    """One row: SwiGLU + down (the streaming kernel); 16 rows: RMSNorm + q/k/v of the 1.1B shape with a residual,
    which a GPU's processor count splits (the tensor-core kernel's two launches and two-dimensional grid, traced by
    inductor)."""
    torch._dynamo.reset()
    gain = _norm(2048, torch.bfloat16).weight.detach()

    def step(a, b, weight):
        if rows == 1:
            return torch.ops.archlab.gated_down(a, b, weight, None)  # a, b: gate and up
        return torch.ops.archlab.gemv(a, weight, None, gain, 1e-5, b)  # b: the residual

    if rows > 1:
        assert triton_gemv.split_count(2560, 2048, torch.device(DEVICE)) > 1
    compiled = torch.compile(step, mode="reduce-overhead", fullgraph=True)
    for number in range(4):
        inputs, outputs = (5632, 2048) if rows == 1 else (2048, 2560)
        a, b, weight, _ = _inputs(rows, inputs, outputs, False, dtype=torch.bfloat16, seed=number)
        if rows > 1:
            b = torch.randn(rows, 1, outputs, generator=torch.Generator().manual_seed(number)).to(a)
        torch.compiler.cudagraph_mark_step_begin()
        with torch._dynamo.config.patch(error_on_recompile=number > 0):
            output = compiled(a, b, weight).clone()
        # (inductor autotunes the kernel apart from the eager call: another block size may round the sum differently)
        torch.testing.assert_close(output, step(a, b, weight), rtol=1e-2, atol=1e-2)


# ---- on a CPU: the kernel tests above, through Triton's interpreter ------------------------------------------------


test_kernels_through_the_triton_interpreter = interpreted_run_of(__file__)
