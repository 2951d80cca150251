"""`--suite cuda-kernels` (scripts/benchmark_cuda_kernels.py): archlab's Triton kernels each against the PyTorch path it
would replace — rows for the attention (the split count chosen, and others at batch 1), the GEMV in each of a fused
layer's uses at 1, 4 and 16 rows (at 16 the split-K shares chosen, and q/k/v split against whole; and q/k/v with RoPE
and the cache writes at 1 and 4), a whole layer's step fused and not at 1, 4 and 16 rows (and at 1 row fused with its
kernels launched dependent on the one before against fused), the rest of a layer after its attention as one
persistent kernel against three GEMVs (and the persistent kernel's settings against its defaults), and the MoE's
experts at 1 and 4 tokens, with µs per call, the bytes read and the autotuner's choice; where the kernels cannot run,
a note and no row.

The rows run where the kernels do: on a GPU (quick shapes), or on a CPU through Triton's interpreter (fp32), which
`test_kernels_through_the_triton_interpreter` starts in a fresh process (CI's interpreter step runs this file)."""

from __future__ import annotations

import re

from archlab.scripts import benchmark, benchmark_cuda_kernels
from archlab.scripts.benchmark_cuda_kernels import TAIL_VARIANTS

from triton_interpreter import (
    DEVICE,
    INTERPRETING,
    fill_interpreter_gaps,
    interpreted_run_of,
    runs_kernels,
)


def _wide_tiles(monkeypatch) -> None:
    """Under the interpreter, which runs a kernel's programs one after another at a cost a program, each streaming
    kernel's first configuration (the one it runs) with many weight rows a program: the 4-row GEMVs of the quick shapes
    took ~20 s a call in tiles of 4 rows, ~0.5 s in tiles of 128. This test checks the suite's rows, not the kernels'
    arithmetic in their own tiles (their own tests do, in the configurations a GPU runs)."""
    import triton

    from archlab.modeling import triton_gemv, triton_moe, triton_qkv

    wide = {"BLOCK_N": 128, "BLOCK_K": 1024, "UNROLL": 1}
    for kernel in (
        triton_gemv._gemv_row_kernel,
        triton_gemv._gemv_kernel,
        triton_qkv._row_kernel,
        triton_qkv._rows_kernel,
        triton_moe._expert_gate_up_kernel,
        triton_moe._expert_down_kernel,
    ):
        monkeypatch.setattr(kernel, "configs", [triton.Config(wide, num_warps=4, num_stages=1), *kernel.configs])


def _table(tmp_path, device: str) -> str:
    out = tmp_path / "kernels.md"
    rates = ["--peak-bandwidth", "0.05"] if device == "cpu" else []
    argv = ["--suite", "cuda-kernels", "--device", device, "--quick", "--rounds", "1", *rates, "--output", str(out)]
    assert benchmark.main(argv) == 0
    return out.read_text()


def _rows(table: str, start: str) -> list[list[str]]:
    return [
        [cell.strip() for cell in line.strip("|").split("|")]
        for line in table.splitlines()
        if line.startswith(f"| {start}")
    ]


def test_where_the_kernels_cannot_run_the_suite_says_so_and_measures_nothing(tmp_path, monkeypatch):
    """On a CPU without Triton's interpreter (where this runs under it, the variable is removed for the call)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    table = _table(tmp_path, "cpu")
    assert "Nothing measured: the kernels run on CUDA" in table
    assert not _rows(table, "decoding attention") and not _rows(table, "SwiGLU") and not _rows(table, "MoE")


@runs_kernels
def test_each_kernel_has_rows_against_its_pytorch_path(tmp_path, monkeypatch):
    from archlab.modeling import triton_layer_tail

    blocks = triton_layer_tail.TAIL_BLOCKS
    if INTERPRETING:
        fill_interpreter_gaps(monkeypatch, "archlab.modeling.triton_")
        blocks = (32, 256, 1, 4)  # fewer tiles for the interpreter to run, one program after another
        monkeypatch.setattr(triton_layer_tail, "TAIL_BLOCKS", blocks)
        _wide_tiles(monkeypatch)
        variants = [(name, (64, *blocks[1:]) if name == "TAIL_BLOCKS" else value) for name, value in TAIL_VARIANTS]
        monkeypatch.setattr(benchmark_cuda_kernels, "TAIL_VARIANTS", variants)
    table = _table(tmp_path, DEVICE)
    assert "failed" not in table, table
    header = _rows(table, "metric")[0]
    micro, read = header.index("µs archlab"), header.index("MB read")
    attention = _rows(table, "decoding attention")
    # batch 1 at 24 and 128 keys (quick): the chosen split and 1, 2, 4, 8 forced; batch 16: the chosen one
    assert sum("split_count's choice" in row[0] for row in attention) == 3, table
    combined = [row for row in attention if "the splits combined by the last program of each KV head" in row[0]]
    assert [row[0].split(",")[2].strip() for row in combined] == ["24 keys", "128 keys"], table
    assert {re.search(r"(\d+) splits?", row[0])[1] for row in attention if "batch 1," in row[0]} == {"1", "2", "4", "8"}
    gemv, moe = [], _rows(table, "MoE routed experts")
    kinds = (
        "RMSNorm + q/k/v projection,",
        "output projection + residual",
        "RMSNorm + gate/up projection + SwiGLU",
        "down projection + residual",
        "SwiGLU + down projection + residual",
    )
    for kind in kinds:
        rows = _rows(table, kind)
        assert [row[0].split(",")[1].strip() for row in rows] == ["1 row", "4 rows", "16 rows"], (kind, table)
        gemv += rows
    split = _rows(table, "split-K tensor-core GEMV vs whole")
    assert len(split) == 1 and "16 rows" in split[0][0], table
    assert all(any("shares of the inputs" in cell for cell in row) for row in gemv if "16 rows" in row[0]), table
    qkv = _rows(table, "RMSNorm + q/k/v projection + RoPE + cache writes")
    assert [row[0].split(",")[1].strip() for row in qkv] == ["1 row", "4 rows"], table
    gemv += qkv
    assert len(moe) == 2, table
    layers = _rows(table, "a pre-norm layer's decoding step")
    counts = [row[0].split(",")[1].split(":")[0].strip() for row in layers]
    assert counts == ["1 row", "4 rows", "16 rows", "1 row"], table
    assert "PDL twins" in layers[3][0] and "PDL" not in layers[0][0], table
    tail = _rows(table, "a layer's output projection, gate/up + SwiGLU and down projection, 1 row")
    assert len(tail) == 1 and "PDL twins" in tail[0][0], table
    persistent = _rows(table, "the persistent layer tail, 1 row")
    assert "three dependent launches" in persistent[0][0], table
    variants = [re.search(r": (\w+) = ", row[0])[1] for row in persistent[1:]]
    assert variants == ["PROGRAMS_PER_PROCESSOR", "PROGRAMS_PER_PROCESSOR", "TAIL_BLOCKS", "BALANCED_TILES"], table
    tail += persistent
    for row in attention + gemv + moe + layers + tail:
        assert row[1].endswith("calls/s") and row[3].endswith("×"), row
        assert float(row[micro]) > 0 and float(row[read]) > 0, row
    # each call of a kernel row reads its own copy of the weights or keys, so together they span twice the L2 (one
    # copy on a CPU; on a GPU at the quick shapes, many)
    copies = header.index("copies")
    assert all(int(row[copies]) >= 1 for row in attention + gemv + moe), table
    assert all((int(row[copies]) > 1) == (DEVICE == "cuda") for row in gemv + moe), table
    choice = header.index("kernel's choice")
    assert all("BLOCK_N" in row[choice] for row in gemv + moe), table
    assert tail[0][choice] == f"{tail[0][choice].split()[0]} programs, blocks {blocks}", table
    assert all(("not autotuned" in row[choice]) == INTERPRETING for row in gemv + moe), table


# ---- on a CPU: the test above, through Triton's interpreter --------------------------------------------------------


test_kernels_through_the_triton_interpreter = interpreted_run_of(__file__)
