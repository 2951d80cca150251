"""A pre-norm layer's decoding step after its attention — the output projection + residual, RMSNorm + the gate/up
product + SwiGLU, the down projection + residual — as one persistent Triton kernel for one row (batch-1 decoding): the
three GEMVs of the fused layer step (decode_block.py, triton_gemv.py) as three phases of one launch, separated by
barriers across the whole grid instead of kernel boundaries (the "megakernel" decoders: Hazy Research's Llama-1B
decoder, 2025; Mirage's persistent kernels).

Why: the eighth GPU session (docs/gpu.md) timed each GEMV of the batch-1 step 2.5-4.7 µs slower than its bytes at the
bandwidth allow: ~12.7 µs a layer of fixed cost per kernel (ramp-up, the last programs' tail, the launch) of which
programmatic dependent launch won back ~4.3. The batch-1 goal (50 % of the roofline) needs ~7 µs a layer of it. Here a
launch has exactly as many programs as the GPU holds at once (`tail_programs`: `PROGRAMS_PER_PROCESSOR` a
multiprocessor, their registers capped so that they fit: `max_registers`), each taking the phase's tiles of weight
rows in turn (tile t to program t mod programs; tiles of 4 rows, or 2 where that leaves the busiest program fewer
rows: `tile_rows`) with the streaming GEMV's own loop and epilogue (`_row_products`, `_store_row`: the same arithmetic
and rounding as the three kernels). Between two phases each program first reads its next tile's first weight block (a
few MB over the grid: no kernel of a decoding step writes a weight), then waits at the barrier for every program's
outputs of the phase before — so the next phase's weight stream starts before the slowest program of the last one
ends, where a kernel boundary starts it only once the next kernel's programs are resident. The first phase, launched
dependent on the attention (the PDL twins' `griddepcontrol.wait`), reads its first block before that wait too.

The barrier (`_grid_barrier`): the program's threads synchronise (their stores done), one thread adds 1 to the phase's
count at GPU scope with release semantics and re-reads it with acquire semantics until every program has arrived, and
the threads synchronise again (CUDA cooperative groups' grid sync, written with Triton's scalar atomics, which one
thread executes and broadcasts). It can only end if every program is resident at once: the grid never exceeds the
processors × `PROGRAMS_PER_PROCESSOR` and each program's registers are capped to fit that many (the kernel uses no
shared memory beyond its reductions), as long as no kernel on another stream holds processors for ever (a collective
spinning on its peers: decoding does not run beside one). The counts are three int32 per device, kept for the process
(a recorded CUDA graph keeps their address; launches on two streams at once would share them), put back to zero by the
last program past the second barrier, so each launch and graph replay starts from zero.

Under Triton's interpreter (the CPU tests) the programs run one after another, so a barrier would wait for ever on a
program not yet run: there the launch is one program, which runs every tile of every phase; the tests run each
phase alone over many programs too (`PHASES`), checking the tiles' division. Only a GPU runs the barriers across
programs (tests/gpu). A candidate, off by default (`TAIL_DEVICES`): `--suite cuda-kernels` times it against the three
PDL-launched GEMVs and `cuda-tuning` the batch-1 step with it, before it may become the default.
"""

from __future__ import annotations

import torch

from .triton_gemv import _processors
from .triton_launch import launchable, pdl_launch, registered

try:
    import triton
    import triton.language as tl

    from .triton_gemv import _row_products, _store_row, _weight_block, _weight_rows
    from .triton_launch import dependent_launch
except ImportError:  # the CPU wheels of torch come without Triton: nothing here applies
    triton = None

# Devices on which the fused layer step runs its MLP half, with the output projection before it, as this kernel
# (`layer_tail_applies`). A candidate: none until a GPU session has timed it (module docstring).
TAIL_DEVICES: tuple[str, ...] = ()
# Programs resident on each multiprocessor: the launch's grid is this many times the processors
PROGRAMS_PER_PROCESSOR = 4
# (BLOCK_N weight rows a tile, BLOCK_K inputs a block, UNROLL, warps): the one-row GEMV's first configuration
# (triton_gemv.ROW_CONFIGS), blocks of inputs spanning the program's threads (8 half-precision values a thread)
TAIL_BLOCKS = (4, 1024, 2, 4)
# Whether each phase's tiles are sized to balance the programs' rows (`tile_rows`)
BALANCED_TILES = True
# 32-bit registers of one multiprocessor (every NVIDIA GPU from Volta to Blackwell) and the allocation's unit
REGISTERS_PER_PROCESSOR = 65536
REGISTER_UNIT = 8
# The phases, as the kernel's PHASES bits: the output projection, the gate/up product, the down projection
OUTPUT, GATE_UP, DOWN = 1, 2, 4
ALL_PHASES = OUTPUT | GATE_UP | DOWN
# The barriers' counts: before the gate/up phase, before the down phase, and the programs past the second
COUNTS = 3


def max_registers(warps: int, programs_per_processor: int = PROGRAMS_PER_PROCESSOR) -> int:
    """The registers a thread may use so that `programs_per_processor` programs of `warps` warps fit on one
    multiprocessor at once (Triton's `maxnreg`), rounded down to the allocation's unit."""
    per_thread = min(255, REGISTERS_PER_PROCESSOR // (programs_per_processor * warps * 32))
    return per_thread - per_thread % REGISTER_UNIT


def tail_programs(device: torch.device) -> int:
    """The launch's programs: every one resident at once on a GPU (module docstring); one elsewhere (Triton's
    interpreter runs programs one after another)."""
    return max(1, _processors(device) * PROGRAMS_PER_PROCESSOR)


# Per device, the barriers' counts (never freed: a recorded CUDA graph keeps the address it was recorded with)
_TAIL_COUNTS: dict[str, torch.Tensor] = {}


def tail_counts(device: torch.device) -> torch.Tensor | None:
    """The barriers' zeroed int32 counts for `device`, kept for the process (each launch leaves them at zero); None
    where they would first be allocated while a CUDA graph is recorded (from the graph's memory pool): the caller
    then runs the three GEMVs."""
    counts = _TAIL_COUNTS.get(str(device))
    if counts is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        counts = _TAIL_COUNTS[str(device)] = torch.zeros(COUNTS, dtype=torch.int32, device=device)
    return counts


if triton is not None:

    @triton.jit
    def _grid_barrier(count_ptr, programs):
        """Wait until `programs` programs have arrived at the count at `count_ptr` (module docstring): every store
        of this program before it is visible to every program after it."""
        tl.debug_barrier()  # the program's threads' stores before its arrival (released with it to the whole GPU)
        arrived = tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu") + 1
        while arrived < programs:
            arrived = tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")
        tl.debug_barrier()  # the threads' loads after the arrival of all

    @triton.jit
    def _reset_counts(count_ptr, programs):
        """The last program past the second barrier puts the counts back to zero for the next launch: every program
        is past both waits by then."""
        done = tl.atomic_add(count_ptr + 2, 1, sem="acq_rel", scope="gpu")
        if done == programs - 1:
            tl.atomic_xchg(count_ptr, 0, sem="relaxed", scope="gpu")
            tl.atomic_xchg(count_ptr + 1, 0, sem="relaxed", scope="gpu")
            tl.atomic_xchg(count_ptr + 2, 0, sem="relaxed", scope="gpu")

    @triton.jit
    def _tile(
        w0, x_ptr, gain_ptr, w_ptr, bias_ptr, residual_ptr, y_ptr, tile, outputs, inputs, eps, w_n,
        PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, GATED: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UNROLL: tl.constexpr,
    ):  # fmt: skip
        """Tile `tile` of a phase: its BLOCK_N weight rows against the one input row, w0 their first block (read
        already), then the one-row GEMV's loop and epilogue (triton_gemv.py)."""
        ws, w_ok = _weight_rows(tile, outputs, GATED, BLOCK_N)
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        squares = tl.zeros([1, BLOCK_K], tl.float32)
        acc, squares = _row_products(
            acc, squares, w0, x_ptr, x_ptr, gain_ptr, w_ptr, 0, 1, 0, inputs, 0, 0, PROLOGUE, BLOCK_K
        )
        for first in tl.range(1, tl.cdiv(inputs, BLOCK_K), loop_unroll_factor=UNROLL):
            w = _weight_block(w_ptr, ws, w_ok, first, inputs, w_n, BLOCK_K)
            acc, squares = _row_products(
                acc, squares, w, x_ptr, x_ptr, gain_ptr, w_ptr, 0, 1, first, inputs, 0, 0, PROLOGUE, BLOCK_K
            )
        _store_row(
            acc, squares, 0, 1, inputs, eps, bias_ptr, residual_ptr, y_ptr, tile, outputs, ws, w_ok, 0, 0,
            PROLOGUE, HAS_BIAS, HAS_RESIDUAL, GATED, BLOCK_N,
        )  # fmt: skip

    @triton.jit
    def _phase(
        x_ptr, gain_ptr, w_ptr, bias_ptr, residual_ptr, y_ptr, count_ptr, pid, programs, outputs, inputs, eps, w_n,
        WAIT: tl.constexpr, PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
        GATED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UNROLL: tl.constexpr,
    ):  # fmt: skip
        """One GEMV of the layer's tail over the program's tiles (pid, pid + programs, ...). WAIT: 0 none, 1 for the
        kernel before (launched dependent on it), 2 at the grid's barrier `count_ptr` — after the first tile's first
        weight block is read."""
        tiles = tl.cdiv(outputs, BLOCK_N // 2 if GATED else BLOCK_N)
        ws, w_ok = _weight_rows(pid, outputs, GATED, BLOCK_N)
        w0 = _weight_block(w_ptr, ws, w_ok, 0, inputs, w_n, BLOCK_K)  # (rows past the weight's: masked)
        if WAIT == 1:
            dependent_launch(True)
        if WAIT == 2:
            _grid_barrier(count_ptr, programs)
        args = (x_ptr, gain_ptr, w_ptr, bias_ptr, residual_ptr, y_ptr)
        if pid < tiles:
            _tile(
                w0, *args, pid, outputs, inputs, eps, w_n,
                PROLOGUE, HAS_BIAS, HAS_RESIDUAL, GATED, BLOCK_N, BLOCK_K, UNROLL,
            )  # fmt: skip
        for tile in tl.range(pid + programs, tiles, programs):
            ws, w_ok = _weight_rows(tile, outputs, GATED, BLOCK_N)
            w0 = _weight_block(w_ptr, ws, w_ok, 0, inputs, w_n, BLOCK_K)
            _tile(
                w0, *args, tile, outputs, inputs, eps, w_n,
                PROLOGUE, HAS_BIAS, HAS_RESIDUAL, GATED, BLOCK_N, BLOCK_K, UNROLL,
            )  # fmt: skip

    @triton.jit
    def _layer_tail_kernel(
        heads_ptr, residual_ptr, o_w_ptr, o_b_ptr, hidden_ptr,
        gain_ptr, gu_w_ptr, gu_b_ptr, act_ptr,
        d_w_ptr, d_b_ptr, out_ptr, count_ptr,
        width, attended, intermediate, eps, programs, o_n, gu_n, d_n,
        HAS_O_BIAS: tl.constexpr, HAS_GU_BIAS: tl.constexpr, HAS_D_BIAS: tl.constexpr,
        WAIT_OUTPUT: tl.constexpr, WAIT_GATE_UP: tl.constexpr, WAIT_DOWN: tl.constexpr, PHASES: tl.constexpr,
        ROWS_OUTPUT: tl.constexpr, ROWS_GATE_UP: tl.constexpr, ROWS_DOWN: tl.constexpr, BLOCK_K: tl.constexpr,
        UNROLL: tl.constexpr,
    ):  # fmt: skip
        """The phases PHASES names (bits: OUTPUT, GATE_UP, DOWN), in order:
            hidden = o_w · heads (+ o_b) + residual
            act = SiLU(gate) ⊙ up, [gate; up] = gu_w · RMSNorm(hidden) (+ gu_b)
            out = d_w · act (+ d_b) + hidden
        each phase waiting as its WAIT_* says (0 none, 1 the kernel before, 2 the barrier after the phase before),
        its tiles of ROWS_* weight rows (`tile_rows`)."""
        pid = tl.program_id(0)
        # each phase's (WAIT, PROLOGUE: triton_gemv's PLAIN 0 or RMS_NORM 1, HAS_BIAS, HAS_RESIDUAL, GATED, blocks)
        if PHASES & 1:
            _phase(
                heads_ptr, heads_ptr, o_w_ptr, o_b_ptr, residual_ptr, hidden_ptr, count_ptr, pid, programs,
                width, attended, eps, o_n,
                WAIT_OUTPUT, 0, HAS_O_BIAS, True, False, ROWS_OUTPUT, BLOCK_K, UNROLL,
            )  # fmt: skip
        if PHASES & 2:
            _phase(
                hidden_ptr, gain_ptr, gu_w_ptr, gu_b_ptr, hidden_ptr, act_ptr, count_ptr, pid, programs,
                intermediate, width, eps, gu_n,
                WAIT_GATE_UP, 1, HAS_GU_BIAS, False, True, ROWS_GATE_UP, BLOCK_K, UNROLL,
            )  # fmt: skip
        if PHASES & 4:
            _phase(
                act_ptr, act_ptr, d_w_ptr, d_b_ptr, hidden_ptr, out_ptr, count_ptr + 1, pid, programs,
                width, intermediate, eps, d_n,
                WAIT_DOWN, 0, HAS_D_BIAS, True, False, ROWS_DOWN, BLOCK_K, UNROLL,
            )  # fmt: skip
            if WAIT_DOWN == 2:
                _reset_counts(count_ptr, programs)


def tile_rows(weight_rows: int, programs: int, most: int) -> int:
    """The weight rows of a phase's tiles: `most` (TAIL_BLOCKS' BLOCK_N) or half of it (at least 2: a gated tile
    holds gate and up rows in pairs), whichever leaves the busiest program fewer rows to stream (each program takes
    every programs-th tile: the phase waits for the busiest at the barrier after it); the wider on a tie (more bytes
    in flight a load). The 1.1B model's gate/up product on an H200 (11,264 rows, 528 programs): tiles of 2 rows, 22
    rows for the busiest program against 24 with tiles of 4 (21.3 on average); its output and down projections
    (2,048 rows) keep tiles of 4 (`BALANCED_TILES` False: `most` everywhere)."""
    if not BALANCED_TILES:
        return most
    candidates = [rows for rows in (most, most // 2) if rows >= 2]
    return min(candidates, key=lambda rows: (-(-weight_rows // rows) + programs - 1) // programs * rows)


def _waits(phases: int, dependent: bool) -> dict[str, int]:
    """Each phase's WAIT: the first phase run waits for the kernel before where launched dependent on it, each later
    one at the barrier after the phase before it."""
    waits, first = {}, True
    for bit, name in ((OUTPUT, "WAIT_OUTPUT"), (GATE_UP, "WAIT_GATE_UP"), (DOWN, "WAIT_DOWN")):
        waits[name] = (int(dependent) if first else 2) if phases & bit else 0
        first = first and not phases & bit
    return waits


def launch_layer_tail(
    heads: torch.Tensor,
    residual: torch.Tensor,
    output_weight: torch.Tensor,
    output_bias: torch.Tensor | None,
    gain: torch.Tensor,
    eps: float,
    gate_up_weight: torch.Tensor,
    gate_up_bias: torch.Tensor | None,
    down_weight: torch.Tensor,
    down_bias: torch.Tensor | None,
    *,
    counts: torch.Tensor,
    programs: int,
    phases: int = ALL_PHASES,
    hidden: torch.Tensor | None = None,
    activated: torch.Tensor | None = None,
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel over one row: (the block's output, hidden, activated), each (1, n) in the heads' dtype. `phases`
    below ALL_PHASES runs those alone (the tests: any `programs`, no barrier between them), reading `hidden` /
    `activated` where the phase that writes them is not run. `pdl`: launched dependent on the kernel before."""
    width, attended = output_weight.shape
    intermediate = gate_up_weight.shape[0] // 2
    hidden = heads.new_empty(1, width) if hidden is None else hidden
    activated = heads.new_empty(1, intermediate) if activated is None else activated
    out = heads.new_empty(1, width)
    block_n, block_k, unroll, warps = TAIL_BLOCKS
    options = {} if heads.device.type != "cuda" else {"num_warps": warps, "num_stages": 1, "launch_pdl": pdl}
    if heads.device.type == "cuda":
        options["maxnreg"] = max_registers(warps)
    launchable(_layer_tail_kernel, heads, "layer_tail")[(programs,)](
        heads, residual, output_weight, output_weight if output_bias is None else output_bias, hidden,
        gain, gate_up_weight, gate_up_weight if gate_up_bias is None else gate_up_bias, activated,
        down_weight, down_weight if down_bias is None else down_bias, out, counts,
        width, attended, intermediate, eps, programs,
        output_weight.stride(0), gate_up_weight.stride(0), down_weight.stride(0),
        HAS_O_BIAS=output_bias is not None, HAS_GU_BIAS=gate_up_bias is not None, HAS_D_BIAS=down_bias is not None,
        **_waits(phases, pdl), PHASES=phases, ROWS_OUTPUT=tile_rows(width, programs, block_n),
        ROWS_GATE_UP=tile_rows(2 * intermediate, programs, block_n), ROWS_DOWN=tile_rows(width, programs, block_n),
        BLOCK_K=block_k, UNROLL=unroll, **options,
    )  # fmt: skip
    return out, hidden, activated


def _layer_tail_body(
    heads: torch.Tensor,
    residual: torch.Tensor,
    output_weight: torch.Tensor,
    output_bias: torch.Tensor | None,
    gain: torch.Tensor,
    eps: float,
    gate_up_weight: torch.Tensor,
    gate_up_bias: torch.Tensor | None,
    down_weight: torch.Tensor,
    down_bias: torch.Tensor | None,
) -> torch.Tensor:
    """The op's body: one launch where the barriers' counts exist, else the three GEMVs (`tail_counts`)."""
    counts = tail_counts(heads.device)
    shape = residual.shape
    if counts is None:
        from .triton_gemv import gated_gemv, gemv

        hidden = gemv(heads, output_weight, output_bias, residual=residual)
        activated = gated_gemv(hidden, gate_up_weight, gate_up_bias, norm=_Norm(gain, eps))
        return gemv(activated, down_weight, down_bias, residual=hidden)
    heads2, residual2 = heads.reshape(1, -1), residual.reshape(1, -1)
    out, _, _ = launch_layer_tail(
        heads2, residual2, output_weight, output_bias, gain, eps, gate_up_weight, gate_up_bias, down_weight,
        down_bias, counts=counts, programs=tail_programs(heads.device), pdl=pdl_launch(heads),
    )  # fmt: skip
    return out.reshape(shape)


class _Norm:
    """An RMSNorm's gain and epsilon as triton_gemv's `norm=` reads them."""

    def __init__(self, weight: torch.Tensor, eps: float):
        self.weight, self.variance_epsilon = weight, eps


if triton is not None and not registered("layer_tail"):
    # Opaque to torch.compile (inductor calls it from its generated code, CUDA graphs record its launch): the grid
    # and the counts are the machine's, read when it runs
    @torch.library.custom_op("archlab::layer_tail", mutates_args=())
    def _layer_tail_op(
        heads: torch.Tensor,
        residual: torch.Tensor,
        output_weight: torch.Tensor,
        output_bias: torch.Tensor | None,
        gain: torch.Tensor,
        eps: float,
        gate_up_weight: torch.Tensor,
        gate_up_bias: torch.Tensor | None,
        down_weight: torch.Tensor,
        down_bias: torch.Tensor | None,
    ) -> torch.Tensor:
        return _layer_tail_body(
            heads, residual, output_weight, output_bias, gain, eps, gate_up_weight, gate_up_bias, down_weight,
            down_bias,
        )  # fmt: skip

    @_layer_tail_op.register_fake
    def _(heads, residual, *args):
        return torch.empty_like(residual)


def layer_tail_applies(hidden_states: torch.Tensor) -> bool:
    """Whether the fused layer step (decode_block.py) runs its output projection and dense gated MLP as this kernel:
    Triton importable, a device in `TAIL_DEVICES` (checked first: elsewhere a traced step guards on nothing new),
    one row. The caller has checked the rest (the kernels' dtypes, the MLP's SiLU, the fused gate/up weight)."""
    return (
        hidden_states.device.type in TAIL_DEVICES
        and triton is not None
        and hidden_states.shape[0] * hidden_states.shape[1] == 1
    )


def layer_tail(
    heads: torch.Tensor,
    residual: torch.Tensor,
    output: torch.nn.Linear,
    norm: torch.nn.Module,
    gate_up: tuple[torch.Tensor, torch.Tensor | None],
    down: torch.nn.Linear,
) -> torch.Tensor:
    """down(SiLU(gate) ⊙ up) + hidden, [gate; up] = gate_up(norm(hidden)), hidden = output(heads) + residual: the
    block's output for one row (module docstring). `heads` (1, 1, attended), `residual` (1, 1, width)."""
    heads, residual = heads.contiguous(), residual.contiguous()
    return torch.ops.archlab.layer_tail(
        heads, residual, output.weight, output.bias, norm.weight, float(norm.variance_epsilon), *gate_up,
        down.weight, down.bias,
    )  # fmt: skip


__all__ = [
    "PROGRAMS_PER_PROCESSOR",
    "TAIL_BLOCKS",
    "TAIL_DEVICES",
    "layer_tail",
    "layer_tail_applies",
    "max_registers",
    "tail_programs",
]
