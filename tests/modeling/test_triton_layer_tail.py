"""A pre-norm layer's output projection + residual, RMSNorm + gate/up + SwiGLU and down projection + residual as one
persistent kernel of one row (modeling/triton_layer_tail.py): the unfused formulas' values and the three GEMVs'
(with and without biases, sizes that are not multiples of the blocks, several blocks of inputs); each phase alone over
any number of programs (the tiles' division); the barriers' counts back at zero after every launch; the grid's
registers capped so that it is resident at once; used by the fused layer step only where it applies, and greedy
decoding through it (transformers' loop and archlab's traced step) gives the block's tokens.

Triton's interpreter runs programs one after another, so the whole kernel, whose barriers wait on every program, runs
here as one program: the barriers across programs run on a GPU only (tests/gpu, and test_triton_compile.py checks
their machine code). The kernels run where Triton does: on a GPU, or on a CPU through the interpreter
(tests/triton_interpreter.py), which `test_kernels_through_the_triton_interpreter` starts in a fresh process."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from archlab import DecoderForCausalLM
from archlab.modeling import decode_block, fused_projections, triton_layer_tail
from archlab.modeling.fused_projections import inference_projections
from archlab.modeling.triton_layer_tail import (
    ALL_PHASES,
    DOWN,
    GATE_UP,
    OUTPUT,
    launch_layer_tail,
    layer_tail_applies,
    max_registers,
    tile_rows,
)

from helpers import assert_close_to_scale, randomised, tiny_decoder_config
from triton_interpreter import (
    DEVICE,
    greedy_tokens,
    interpreted_run_of,
    interpreter_gaps_filled,
    runs_kernels,
)

_interpreter_gaps = interpreter_gaps_filled("archlab.modeling.triton_")


def _weights(width: int, attended: int, intermediate: int, biases: bool, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(DEVICE)

    return dict(
        heads=rand(1, attended),
        residual=rand(1, width),
        output_weight=rand(width, attended, scale=attended**-0.5),
        output_bias=rand(width) if biases else None,
        gain=(torch.rand(width, generator=g) + 0.5).to(DEVICE),
        eps=1e-6,
        gate_up_weight=rand(2 * intermediate, width, scale=width**-0.5),
        gate_up_bias=rand(2 * intermediate) if biases else None,
        down_weight=rand(width, intermediate, scale=intermediate**-0.5),
        down_bias=rand(width) if biases else None,
    )


def _formula(w: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the block's output, hidden, activated) as the unfused layer computes them (fp32)."""
    hidden = F.linear(w["heads"], w["output_weight"], w["output_bias"]) + w["residual"]
    normed = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + w["eps"]) * w["gain"]
    gate, up = F.linear(normed, w["gate_up_weight"], w["gate_up_bias"]).chunk(2, dim=-1)
    activated = F.silu(gate) * up
    return F.linear(activated, w["down_weight"], w["down_bias"]) + hidden, hidden, activated


def _close(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    # fp32 sums in another order: within 1e-5 of the tensor's scale
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5 * theirs.abs().max().item())


# (width, attended, intermediate): each within one block of the default's 1,024 inputs; with blocks of 32 inputs
# (`small_blocks`), 3 to 5 blocks each (the loop past the first block, unrolled), the last block and tile partial
SHAPE = (102, 70, 150)
SMALL_BLOCKS = (4, 32, 2, 4)


@pytest.fixture(params=["one-block", "several-blocks"])
def blocks(request, monkeypatch):
    """The default blocks, or blocks of 32 inputs (the interpreter's time grows with the blocks run)."""
    if request.param == "several-blocks":
        monkeypatch.setattr(triton_layer_tail, "TAIL_BLOCKS", SMALL_BLOCKS)
    return request.param


@runs_kernels
@pytest.mark.parametrize("biases", [False, True], ids=["no-bias", "biases"])
def test_one_launch_gives_the_unfused_layer_s_values_and_leaves_the_counts_at_zero(blocks, biases):
    w = _weights(*SHAPE, biases)
    counts = torch.zeros(3, dtype=torch.int32, device=DEVICE)
    for _ in range(2):  # a second launch on the same counts
        results = launch_layer_tail(**w, counts=counts, programs=1)
        for ours, theirs in zip(results, _formula(w)):
            _close(ours, theirs)
        assert counts.tolist() == [0, 0, 0]


@runs_kernels
@pytest.mark.parametrize("phase", [OUTPUT, GATE_UP, DOWN], ids=["output", "gate_up", "down"])
@pytest.mark.parametrize("programs", [2, 7, 90])  # the last: more programs than two phases have tiles
def test_each_phase_divides_its_tiles_among_the_programs(phase, programs, monkeypatch):
    """Each phase alone (no barrier) over `programs` programs, its input the formula's: every output written once,
    as the formula gives it; outputs of the phases not run are left as they were."""
    monkeypatch.setattr(triton_layer_tail, "TAIL_BLOCKS", SMALL_BLOCKS)
    w = _weights(*SHAPE, biases=True, seed=1)
    out, hidden, activated = _formula(w)
    counts = torch.zeros(3, dtype=torch.int32, device=DEVICE)
    given_hidden = hidden.clone() if phase != OUTPUT else torch.full_like(hidden, float("nan"))
    given_activated = activated.clone() if phase == DOWN else torch.full_like(activated, float("nan"))
    results = launch_layer_tail(
        **w, counts=counts, programs=programs, phases=phase, hidden=given_hidden, activated=given_activated
    )
    written = {OUTPUT: (1, hidden), GATE_UP: (2, activated), DOWN: (0, out)}[phase]
    _close(results[written[0]], written[1])
    if phase != OUTPUT:
        assert torch.equal(results[1], hidden)  # read, not written
    assert counts.tolist() == [0, 0, 0]  # no barrier


def test_each_phase_waits_at_the_barrier_after_the_phase_before():
    """WAIT: the first phase run waits for the kernel before only where launched dependent on it (1), each later one
    at the barrier (2); phases not run never wait."""
    waits = triton_layer_tail._waits
    assert waits(ALL_PHASES, True) == dict(WAIT_OUTPUT=1, WAIT_GATE_UP=2, WAIT_DOWN=2)
    assert waits(ALL_PHASES, False) == dict(WAIT_OUTPUT=0, WAIT_GATE_UP=2, WAIT_DOWN=2)
    assert waits(GATE_UP | DOWN, True) == dict(WAIT_OUTPUT=0, WAIT_GATE_UP=1, WAIT_DOWN=2)
    assert waits(DOWN, False) == dict(WAIT_OUTPUT=0, WAIT_GATE_UP=0, WAIT_DOWN=0)


def test_each_phase_s_tiles_balance_the_programs_rows(monkeypatch):
    """A phase's tiles hold TAIL_BLOCKS' rows or half as many, whichever leaves the busiest program fewer rows."""
    assert tile_rows(2 * 5632, 528, 4) == 2  # the 1.1B gate/up product on an H200: 22 rows at most, not 24
    assert tile_rows(2048, 528, 4) == 4  # its output and down projections: one tile each either way (the wider)
    assert tile_rows(2 * SHAPE[2], 2, 4) == 2  # (the phase test's gate/up product over 2 programs: 150 rows, not 152)
    assert tile_rows(300, 1, 4) == 4 and tile_rows(11264, 528, 2) == 2  # one program; never below 2 (gate, up)
    monkeypatch.setattr(triton_layer_tail, "BALANCED_TILES", False)
    assert tile_rows(2 * 5632, 528, 4) == 4


@pytest.mark.parametrize("warps", [2, 4, 8])
@pytest.mark.parametrize("per_processor", [1, 2, 4, 8])
def test_the_registers_are_capped_so_that_the_whole_grid_is_resident(warps, per_processor):
    """A barrier across programs ends only if every program is resident at once: `per_processor` programs of
    `warps` warps within one multiprocessor's 64 Ki registers, a multiple of the allocation's unit, at most 255."""
    registers = max_registers(warps, per_processor)
    assert registers % 8 == 0 and registers < 256
    assert registers * 32 * warps * per_processor <= 65536
    assert max_registers(4, 4) == 128  # the default: four programs of four warps


def test_the_kernel_applies_only_to_one_row_on_the_listed_devices(monkeypatch):
    monkeypatch.setattr(triton_layer_tail, "triton", object())  # as where Triton is installed
    one_row = torch.zeros(1, 1, 8)
    assert not layer_tail_applies(one_row)  # TAIL_DEVICES: none by default (a candidate)
    monkeypatch.setattr(triton_layer_tail, "TAIL_DEVICES", ("cpu",))
    assert layer_tail_applies(one_row)
    assert not layer_tail_applies(torch.zeros(2, 1, 8))  # batch 2
    assert not layer_tail_applies(torch.zeros(1, 3, 8))  # a prompt of 3
    monkeypatch.setattr(triton_layer_tail, "triton", None)  # CPU wheels of torch: no Triton
    assert not layer_tail_applies(one_row)


@runs_kernels
def test_without_counts_the_op_runs_the_three_gemvs(monkeypatch):
    """Where the counts would first be allocated while a CUDA graph is recorded, the op runs the three GEMVs: the
    same values."""
    w = _weights(*SHAPE, biases=True, seed=2)
    monkeypatch.setattr(triton_layer_tail, "tail_counts", lambda device: None)
    ours = torch.ops.archlab.layer_tail(*[w[name] for name in _OP_ARGUMENTS])
    _close(ours, _formula(w)[0])


_OP_ARGUMENTS = (
    "heads", "residual", "output_weight", "output_bias", "gain", "eps", "gate_up_weight", "gate_up_bias",
    "down_weight", "down_bias",
)  # fmt: skip


def _tail_model(**overrides):
    return randomised(DecoderForCausalLM(tiny_decoder_config(**overrides))).to(DEVICE)


@pytest.fixture
def tail_on(monkeypatch) -> list:
    """The fused layer step on, with the layer tail on this device; a list that gets an entry per tail launched."""
    monkeypatch.setattr(decode_block, "FUSED_BLOCK_DEVICES", (DEVICE,))
    monkeypatch.setattr(triton_layer_tail, "TAIL_DEVICES", (DEVICE,))
    monkeypatch.setattr(triton_layer_tail, "TAIL_BLOCKS", (16, 32, 1, 4))  # fewer tiles for the interpreter to run
    calls, tail = [], decode_block.layer_tail

    def counted(*args, **kwargs):
        calls.append(1)
        return tail(*args, **kwargs)

    monkeypatch.setattr(decode_block, "layer_tail", counted)
    return calls


@runs_kernels
@pytest.mark.parametrize("overrides", [{}, dict(attention_bias=True, mlp_bias=True)], ids=["plain", "biases"])
def test_each_layer_s_step_through_the_tail_equals_the_block_s_forward(overrides, tail_on, monkeypatch):
    """One row over a 5-token cache: the hidden states after each layer and the logits, the tail in every layer."""
    import copy

    model = _tail_model(**overrides)
    ids = torch.randint(3, model.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    with torch.no_grad(), inference_projections(model, force=True):
        prefix = model(ids[:, :5], use_cache=True)
        monkeypatch.setattr(triton_layer_tail, "TAIL_DEVICES", ())
        expected = model(ids[:, 5:], past_key_values=copy.deepcopy(prefix.past_key_values), output_hidden_states=True)
        monkeypatch.setattr(triton_layer_tail, "TAIL_DEVICES", (DEVICE,))
        fused = model(ids[:, 5:], past_key_values=copy.deepcopy(prefix.past_key_values), output_hidden_states=True)
    assert len(tail_on) == model.config.num_hidden_layers
    for ours, theirs in [*zip(fused.hidden_states, expected.hidden_states), (fused.logits, expected.logits)]:
        _close(ours, theirs)


@runs_kernels
@pytest.mark.parametrize("overrides", [dict(norm_position="parallel"), dict(num_local_experts=4)], ids=str)
def test_parallel_blocks_and_experts_keep_the_three_kernels(overrides, tail_on):
    """A parallel block's MLP reads the block's input, a mixture of experts has no gate/up product: no tail."""
    model = _tail_model(**overrides)
    ids = torch.tensor([[5, 6, 7]], device=DEVICE)
    with torch.no_grad(), inference_projections(model, force=True):
        prefix = model(ids[:, :2], use_cache=True)
        model(ids[:, 2:], past_key_values=prefix.past_key_values)
    assert not tail_on


@runs_kernels
def test_greedy_decoding_through_the_tail_gives_the_block_s_tokens(tail_on, monkeypatch):
    """One prompt through transformers' loop and archlab's (its step traced by dynamo: a layer's q/k/v GEMV, then one
    `layer_tail` after the attention)."""
    torch._dynamo.reset()
    model = _tail_model()
    ids = torch.randint(3, model.config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(4)).to(DEVICE)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    monkeypatch.setattr(fused_projections, "FUSED_PROJECTION_DEVICES", (DEVICE,))  # generate lays q/k/v out
    monkeypatch.setattr(decode_block, "FUSED_BLOCK_DEVICES", ())  # the block's forward
    expected = greedy_tokens(model, batch)
    monkeypatch.setattr(decode_block, "FUSED_BLOCK_DEVICES", (DEVICE,))
    assert torch.equal(greedy_tokens(model, batch), expected)
    assert len(tail_on) == 2 * 9  # two layers, the nine steps after the prefill
    monkeypatch.setattr(decode_block, "layer_tail", triton_layer_tail.layer_tail)  # (no counting in a traced step)
    model.release_decoding_memory()
    torch._dynamo.reset()
    graphs = []
    assert torch.equal(greedy_tokens(model, batch, graphs), expected)
    assert graphs and all(graph.count("archlab.layer_tail") == 2 for graph in graphs)
    assert all(graph.count("archlab.gemv") == 2 and "archlab.gated_gemv" not in graph for graph in graphs)


test_kernels_through_the_triton_interpreter = interpreted_run_of(__file__)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_on_a_gpu_every_resident_program_meets_at_the_barriers(dtype):
    """The whole grid (`tail_programs`: every program resident, the barriers between phases across all of them) at
    the 1.1B model's shape: the unfused formula's values (fp32, from the same weights) within the dtype's rounding,
    launched plainly and (Hopper) dependent on the kernel before, three times each, and replayed as a CUDA graph (the
    counts back at zero after each launch and replay)."""
    from archlab.modeling.triton_launch import has_dependent_launch
    from archlab.modeling.triton_layer_tail import tail_counts, tail_programs

    device = torch.device("cuda")
    weights = _weights(2048, 2048, 5632, biases=False)
    w = {name: value.to(dtype) if torch.is_tensor(value) else value for name, value in weights.items()}
    expected = _formula({name: value.float() if torch.is_tensor(value) else value for name, value in w.items()})[0]
    counts, programs = tail_counts(device), tail_programs(device)
    assert programs > 1
    rtol = 2e-2 if dtype == torch.bfloat16 else 1e-5  # of the output's scale (hidden rounded, activated rounded)

    def run(pdl: bool) -> torch.Tensor:
        return launch_layer_tail(**w, counts=counts, programs=programs, pdl=pdl)[0]

    launches = (False, True) if has_dependent_launch(device) else (False,)
    for pdl in launches:
        for _ in range(3):
            assert_close_to_scale(run(pdl).float(), expected, rtol=rtol)
            assert counts.tolist() == [0, 0, 0]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run(launches[-1])
    for _ in range(3):
        captured.zero_()
        graph.replay()
        assert_close_to_scale(captured.float(), expected, rtol=rtol)
        assert counts.tolist() == [0, 0, 0]
