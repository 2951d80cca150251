"""archlab's Triton kernels (triton_decoding.py, triton_gemv.py, triton_moe.py) compiled ahead of time for the GPUs
users decode on, on a machine without one: Triton's compiler takes a kernel to a cubin for a named target (its own
ptxas), so a kernel that would not compile, or whose pipelined tiles would not fit a GPU's shared memory, fails
here, in CI, and not at a GPU session's first call. Each kernel is compiled as its op launches it: the attention in
every mask kind, with and without splits, for heads of 64 to 256 in bf16 and fp32; the GEMV and the MoE kernels in
every configuration their autotuners try. And what the machine code (Triton's cuobjdump) says about speed: the
weight-streaming loops issue wide loads and no warp shuffle, the attention's loads are pipelined.

Needs Triton (CPU wheels of torch come without it: `.ci/run` installs it for this file) and not its interpreter."""

from __future__ import annotations

import itertools
import re

import pytest

from triton_interpreter import HAS_TRITON, INTERPRETING

pytestmark = pytest.mark.skipif(
    not HAS_TRITON or INTERPRETING, reason="compiles with Triton (installed, not interpreting)"
)

# Compute capabilities compiled for, and the smallest opt-in shared memory per block among them (bytes): A100 (8.0)
# 163 kB, H100 (9.0) 227 kB, but the GPUs of 8.6 / 8.9 (RTX 30xx/40xx, L4, L40) 99 kB, which every launch must fit.
ARCHS = (80, 90)
SHARED_LIMIT = 99 * 1024


# How a launch specializes the kernels' integer arguments (Triton's JIT and inductor alike): an argument equal to 1
# becomes the constant 1, one divisible by 16 is marked so; pointers are 16-byte aligned (torch's allocations). The
# compiled code depends on it: unit strides make loads contiguous, and only aligned, vectorised loads are pipelined
# with asynchronous copies (more shared memory). Unit strides: the last dimension's of the attention's tensors and of
# its mask. Not divisible: the key count and the mask's row stride (dynamic sizes of a compiled step: inductor
# marks only what it knows statically), rows, heads and slots (small counts). Every other integer is a hidden size,
# a head size or a stride of rows of one: multiples of 16 in the models users run (the GEMV's 5,632 inputs, ...).
UNIT_STRIDES = ("q_d", "k_d", "v_d", "o_d", "m_s")
NOT_DIVISIBLE = ("keys", "m_b", "kv_heads", "rows", "slots", "tokens", "heads", "splits")


def _compile(
    kernel,
    constexprs: dict,
    pointers: dict,
    arch: int,
    num_warps: int = 4,
    num_stages: int = 3,
    scale: str = "fp64",
    launch_pdl: bool = False,
    maxnreg: int | None = None,
):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = kernel.fn if hasattr(kernel, "configs") else kernel  # an autotuner: its kernel
    # flags off unless asked (the MoE kernels' experts' own choices too), SiLU's α
    flags = ("PDL", "COMBINE", "SINKS", "WEIGHTED_INPUT", "BIAS", "CLAMP")
    defaults = {name: False for name in flags if name in fn.arg_names}
    defaults.update({"ALPHA": 1.0} if "ALPHA" in fn.arg_names else {})
    signature, constants, attrs = {}, {**defaults, **constexprs}, {}
    # the split attention's counts (its in-kernel combine) and sinks' logits
    pointers = {"count_ptr": "*i32", "sink_ptr": "*fp32", **pointers}
    for index, name in enumerate(fn.arg_names):
        if name in constants:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = pointers[name]
            attrs[(index,)] = [["tt.divisibility", 16]]
        elif name in ("scale", "eps", "limit", "up_offset"):
            signature[name] = scale
        elif name in UNIT_STRIDES:
            signature[name], constants[name] = "constexpr", 1
        else:
            signature[name] = "i32"
            if name not in NOT_DIVISIBLE:
                attrs[(index,)] = [["tt.divisibility", 16]]
    source = ASTSource(fn=fn, signature=signature, constexprs=constants, attrs=attrs)
    options = {"num_warps": num_warps, "num_stages": num_stages, "launch_pdl": launch_pdl}
    options.update({"maxnreg": maxnreg} if maxnreg else {})
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)


def _assert_compiles(kernel, constexprs, pointers, arch, **options):
    """`scale` (the attention's one float) is typed fp64 by default: inductor passes a Python float to a Triton kernel
    as fp64 (torch/_inductor/codegen/triton_utils.py, `signature_of`), Triton's own launcher as fp32."""
    compiled = _compile(kernel, constexprs, pointers, arch, **options)
    assert "cubin" in compiled.asm
    assert compiled.metadata.shared <= SHARED_LIMIT, (compiled.metadata.shared, constexprs)


DTYPES = {"bf16": 2, "fp32": 4}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head", [64, 128, 256])
def test_the_attention_kernels_compile_and_fit_shared_memory(arch, dtype, head):
    from archlab.modeling import triton_decoding

    for splits in (1, 4):
        for mask in (0, 1, 2):  # none, boolean, additive
            constexprs = dict(
                GROUP=8, GROUP_ROWS=16, HEAD=head, BLOCK=triton_decoding.block_keys(head, DTYPES[dtype]),
                SPLITS=splits, MASK=mask, IEEE=dtype == "fp32",
            )  # fmt: skip
            scratch = "*fp32" if splits > 1 else f"*{dtype}"
            mask_type = {0: f"*{dtype}", 1: "*i1", 2: "*fp32"}[mask]
            pointers = {name: f"*{dtype}" for name in ("q_ptr", "k_ptr", "v_ptr", "out_ptr")}
            pointers.update(mask_ptr=mask_type, part_ptr=scratch, stat_ptr=scratch)
            for scale in ("fp64", "fp32") if mask == 0 else ("fp64",):  # compiled by inductor; launched eagerly
                _assert_compiles(triton_decoding._decode_split_kernel, constexprs, pointers, arch, scale=scale)
    constexprs = dict(GROUP=8, GROUP_ROWS=16, HEAD=head, SPLITS=4)
    pointers = {"part_ptr": "*fp32", "stat_ptr": "*fp32", "out_ptr": f"*{dtype}"}
    for sinks in (False, True):  # attention sinks' logits (GPT-OSS) in the denominator
        _assert_compiles(triton_decoding._decode_combine_kernel, {**constexprs, "SINKS": sinks}, pointers, arch)
    for splits in (1, 4):  # with sinks: into the split kernel's normalisation (one split) or the combine
        constexprs = dict(
            GROUP=8, GROUP_ROWS=16, HEAD=head, BLOCK=triton_decoding.block_keys(head, DTYPES[dtype]), SPLITS=splits,
            MASK=1, IEEE=dtype == "fp32", SINKS=True, COMBINE=splits > 1,
        )  # fmt: skip
        scratch = "*fp32" if splits > 1 else f"*{dtype}"
        pointers = {name: f"*{dtype}" for name in ("q_ptr", "k_ptr", "v_ptr", "out_ptr")}
        pointers.update(mask_ptr="*i1", part_ptr=scratch, stat_ptr=scratch)
        _assert_compiles(triton_decoding._decode_split_kernel, constexprs, pointers, arch)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kernel_name", ["row", "streaming", "tensor_core", "tensor_core_split"])
def test_the_gemvs_compile_and_fit_shared_memory_in_every_autotuned_configuration(kernel_name, arch, dtype):
    """Each prologue (plain, RMSNorm, SwiGLU) with a bias and a residual, and the gate/up product with SwiGLU after it
    (GATED, a bias), `eps` typed as inductor passes it: the one-row kernel, the streaming kernel at 2 and 4 rows, the
    tensor-core one at 5-16 (padded to 16; fp32 weights as IEEE products), whole and split-K (with the kernel that
    adds the shares up)."""
    from archlab.modeling import triton_gemv

    kernel, row_counts, extra = {
        "row": (triton_gemv._gemv_row_kernel, (1,), {}),
        "streaming": (triton_gemv._gemv_kernel, (2, 4), {}),
        "tensor_core": (triton_gemv._dot_kernel, (16,), {"IEEE": dtype == "fp32", "SPLIT": False}),
        "tensor_core_split": (triton_gemv._dot_kernel, (16,), {"IEEE": dtype == "fp32", "SPLIT": True}),
    }[kernel_name]
    pointers = {name: f"*{dtype}" for name in GEMV_POINTERS}
    pointers.update(SPLIT_POINTERS)
    for config in kernel.configs:
        for rows in row_counts:
            for prologue, gated in GEMV_VARIANTS:
                constexprs = dict(
                    ROWS=rows, PROLOGUE=prologue, HAS_BIAS=True, HAS_RESIDUAL=not gated, GATED=gated, **extra,
                    **config.kwargs,
                )  # fmt: skip
                options = dict(num_warps=config.num_warps, num_stages=config.num_stages)
                _assert_compiles(kernel, constexprs, pointers, arch, **options)
    if kernel_name == "tensor_core_split":  # and the kernel that adds the shares up
        for prologue, gated in GEMV_VARIANTS:
            constexprs = dict(
                ROWS=16, PROLOGUE=prologue, HAS_BIAS=True, HAS_RESIDUAL=not gated, GATED=gated,
                BLOCK_N=triton_gemv.SUM_LANES,
            )  # fmt: skip
            _assert_compiles(triton_gemv._split_sum_kernel, constexprs, pointers, arch)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_qkv_rotary_cache_kernel_compiles_in_every_autotuned_configuration(arch, dtype):
    """The q/k/v GEMV with RoPE and the cache writes (triton_qkv.py) at 1, 2 and 4 rows, plain and with RMSNorm and a
    bias, heads of 64 whole rotated and 128 with a quarter rotated (GPT-NeoX's partial rotary), in every configuration
    of its autotuners."""
    from archlab.modeling import triton_qkv

    pointers = {name: f"*{dtype}" for name in QKV_POINTERS}
    pointers["pos_ptr"] = "*i64"
    for kernel, rows in ((triton_qkv._row_kernel, (1,)), (triton_qkv._rows_kernel, (2, 4))):
        for config, count, prologue, (half, rotary_half) in itertools.product(
            kernel.configs, rows, (0, 1), ((32, 32), (64, 16))
        ):
            constexprs = dict(
                ROWS=count, PROLOGUE=prologue, HAS_BIAS=prologue == 1, HALF=half, ROTARY_HALF=rotary_half,
                **config.kwargs,
            )  # fmt: skip
            options = dict(num_warps=config.num_warps, num_stages=config.num_stages)
            _assert_compiles(kernel, constexprs, pointers, arch, **options)


QKV_POINTERS = ("x_ptr", "gain_ptr", "w_ptr", "bias_ptr", "cos_ptr", "sin_ptr", "q_ptr", "k_ptr", "v_ptr")
GEMV_POINTERS = ("x_ptr", "up_ptr", "gain_ptr", "w_ptr", "bias_ptr", "residual_ptr", "y_ptr")
SPLIT_POINTERS = {"part_ptr": "*fp32", "part_sq_ptr": "*fp32"}  # the tensor-core GEMV's split-K sums (float32)
GEMV_PROLOGUES = (0, 1, 2)  # triton_gemv's PLAIN, RMS_NORM, SILU_GATED
# (PROLOGUE, GATED): each prologue, and the gate/up product with SwiGLU after it (`gated_gemv`), plain and normed
GEMV_VARIANTS = ((0, False), (1, False), (2, False), (0, True), (1, True))


def moe_kernel_variants():
    """(kernel, its pointers of the weights' dtype, constexprs) of each MoE kernel variant: with the norm, the residual;
    GPT-OSS's experts (biases, the clamped quick GELU); Llama 4's (the routing weight on the input)."""
    from archlab.modeling import triton_moe

    gate_up, down = triton_moe._expert_gate_up_kernel, triton_moe._expert_down_kernel
    return (
        (gate_up, ("x_ptr", "w_ptr", "gain_ptr", "y_ptr"), {"NORM": True}),
        (gate_up, ("x_ptr", "w_ptr", "bias_ptr", "gain_ptr", "y_ptr"), {"BIAS": True, "CLAMP": True, "ALPHA": 1.702}),
        (gate_up, ("x_ptr", "w_ptr", "gain_ptr", "y_ptr"), {"NORM": True, "WEIGHTED_INPUT": True}),
        (down, ("h_ptr", "w_ptr", "residual_ptr", "y_ptr"), {"HAS_RESIDUAL": True}),
        (down, ("h_ptr", "w_ptr", "bias_ptr", "residual_ptr", "y_ptr"), {"BIAS": True}),
        (down, ("h_ptr", "w_ptr", "residual_ptr", "y_ptr"), {"HAS_RESIDUAL": True, "WEIGHTED_INPUT": True}),
    )


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_moe_kernels_compile_in_every_autotuned_configuration(arch, dtype):

    for kernel, names, extra in moe_kernel_variants():
        pointers = {name: f"*{dtype}" for name in names}
        pointers.update(index_ptr="*i64", weight_ptr="*fp32")
        for config in kernel.configs:
            constexprs = {**config.kwargs, **extra}
            if "SLOTS" in kernel.fn.arg_names:
                constexprs["SLOTS"] = 2
            options = dict(num_warps=config.num_warps, num_stages=config.num_stages)
            _assert_compiles(kernel, constexprs, pointers, arch, **options)


def _sass(compiled) -> str:
    """A compiled kernel's machine code, from Triton's own cuobjdump."""
    import os
    import subprocess
    import tempfile

    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        return subprocess.run([tool, "-sass", cubin.name], capture_output=True, text=True, check=True).stdout


def _sass_loops(compiled) -> list[list[str]]:
    """The instructions of each loop of a compiled kernel's machine code (the span from a backward branch's target to
    the branch)."""
    import re

    code = [(int(m[1], 16), m[2]) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", _sass(compiled))]
    branches = [(int(target, 16), at) for at, text in code for target in re.findall(r"BRA\s+0x([0-9a-f]+)", text)]
    return [[text for at, text in code if start <= at <= end] for start, end in branches if start < end]


ONE_ROW_GEMVS = ("gemv-plain", "gemv-rms_norm", "gemv-silu_gated", "gemv-gated")
FEW_ROW_GEMVS = ("gemv-two-rows", "gemv-four-rows", "gemv-four-rows-gated")
QKV_CASES = ("qkv-rotary-cache", "qkv-rotary-cache-four-rows")
STREAMING_CASES = (*ONE_ROW_GEMVS, *FEW_ROW_GEMVS, *QKV_CASES, "moe_gate_up", "moe_down")


def _streaming_case(kernel_name: str):
    """(kernel, its pointer arguments, constants) of a weight-streaming launch: the GEMVs of one row in each variant
    (the one-row kernel), of two and four rows (the streaming kernel; RMSNorm before, SwiGLU after), the q/k/v GEMV
    with RoPE and the cache writes of one and four rows (RMSNorm before, heads of 64), the MoE's experts of one
    token."""
    from archlab.modeling import triton_gemv, triton_moe, triton_qkv

    row = (triton_gemv._gemv_row_kernel, GEMV_POINTERS)
    gemv = dict(ROWS=1, HAS_RESIDUAL=True, GATED=False)
    return {
        "gemv-plain": (*row, dict(gemv, PROLOGUE=0)),
        "gemv-rms_norm": (*row, dict(gemv, PROLOGUE=1, HAS_RESIDUAL=False)),
        "gemv-silu_gated": (*row, dict(gemv, PROLOGUE=2)),
        "gemv-gated": (*row, dict(gemv, PROLOGUE=1, HAS_RESIDUAL=False, GATED=True)),
        "gemv-two-rows": (triton_gemv._gemv_kernel, GEMV_POINTERS, dict(gemv, ROWS=2, PROLOGUE=1)),
        "gemv-four-rows": (triton_gemv._gemv_kernel, GEMV_POINTERS, dict(gemv, ROWS=4, PROLOGUE=1)),
        "gemv-four-rows-gated": (
            triton_gemv._gemv_kernel,
            GEMV_POINTERS,
            dict(gemv, ROWS=4, PROLOGUE=1, HAS_RESIDUAL=False, GATED=True),
        ),
        "qkv-rotary-cache": (triton_qkv._row_kernel, QKV_POINTERS, dict(ROWS=1, PROLOGUE=1, HALF=32, ROTARY_HALF=32)),
        "qkv-rotary-cache-four-rows": (
            triton_qkv._rows_kernel,
            QKV_POINTERS,
            dict(ROWS=4, PROLOGUE=1, HALF=32, ROTARY_HALF=32),
        ),
        "moe_gate_up": (triton_moe._expert_gate_up_kernel, ("x_ptr", "w_ptr", "gain_ptr", "y_ptr"), {"NORM": True}),
        "moe_down": (
            triton_moe._expert_down_kernel,
            ("h_ptr", "w_ptr", "residual_ptr", "y_ptr"),
            {"SLOTS": 2, "HAS_RESIDUAL": True},
        ),
    }[kernel_name]


def _streaming_loops(kernel_name: str):
    """Each autotuned configuration of a streaming case compiled for sm90 in bf16: (config, its loops' code)."""
    kernel, names, extra = _streaming_case(kernel_name)
    pointers = {name: "*bf16" for name in names}
    pointers.update(index_ptr="*i64", weight_ptr="*fp32", pos_ptr="*i64")
    for config in kernel.configs:
        constexprs = {**extra, **config.kwargs}
        if "HAS_BIAS" in kernel.fn.arg_names:
            constexprs["HAS_BIAS"] = False
        options = dict(num_warps=config.num_warps, num_stages=config.num_stages)
        loops = _sass_loops(_compile(kernel, constexprs, pointers, 90, **options))
        assert loops, config
        yield config, loops


@pytest.mark.parametrize("kernel_name", STREAMING_CASES)
def test_the_streaming_loops_issue_wide_loads_and_no_shuffles(kernel_name):
    """What the GEMV and the MoE kernels are for — streaming weights at the memory's rate — as their sm90 code shows
    it, for every autotuned configuration: each loop issues 128-bit loads, several per iteration, and no warp
    shuffle (the first GEMV summed across threads in every block: 56-256 shuffles in its loop, each block's load
    waited for in turn, and an H200 measured it at 0.88x the default step)."""
    for config, loops in _streaming_loops(kernel_name):
        for loop in loops:
            assert not [text for text in loop if "SHFL" in text], (config, "a warp shuffle inside a loop")
            assert sum("LDG.E.128" in text for text in loop) >= 2, (config, "fewer than two 128-bit loads a loop")


@pytest.mark.parametrize("kernel_name", STREAMING_CASES)
def test_the_streaming_loops_touch_no_shared_memory(kernel_name):
    """The GEMVs of 1-4 rows and the MoE's expert kernels multiply each weight block in the registers it was loaded
    into: their loops hold no shared-memory store or load and no barrier, in every configuration (bf16, sm90) and, at
    one row, every variant. The GEMV before (a three-dimensional rows × weight rows × inputs tile) passed every
    weight block through shared memory, and its input too, with a barrier for each (16 a loop in its chosen
    configuration for the 1.1B model's q/k/v at one row, 16-24 at two and four), and reached 44-61 % of an H200's
    bandwidth at one row; the MoE kernels' narrower blocks passed the input so, in every configuration."""
    for config, loops in _streaming_loops(kernel_name):
        for loop in loops:
            shared = [text for text in loop if text.split()[0].startswith(("STS", "LDS", "BAR"))]
            assert not shared, (config, shared)


def _spills(compiled) -> int:
    """Local-memory loads and stores in a kernel's machine code: registers spilled (none of its arrays is indexed
    dynamically, the other reason for local memory)."""
    import re

    return len(re.findall(r"\b(?:STL|LDL)(?:\.[A-Z0-9]+)*\s", _sass(compiled)))


def _gemv_spills(kernel, rows: int):
    pointers = {name: "*bf16" for name in GEMV_POINTERS}
    for config, (prologue, gated), pdl in itertools.product(kernel.configs, GEMV_VARIANTS, (False, True)):
        constexprs = dict(
            ROWS=rows, PROLOGUE=prologue, HAS_BIAS=False, HAS_RESIDUAL=not gated, GATED=gated, PDL=pdl,
            **config.kwargs,
        )  # fmt: skip
        options = dict(num_warps=config.num_warps, num_stages=config.num_stages, launch_pdl=pdl)
        if _spills(_compile(kernel, constexprs, pointers, 90, **options)):
            yield "gemv", constexprs, config.num_warps


def _qkv_spills(kernel, rows: int):
    pointers = {**{name: "*bf16" for name in QKV_POINTERS}, "pos_ptr": "*i64"}
    for config, pdl in itertools.product(kernel.configs, (False, True)):
        constexprs = dict(ROWS=rows, PROLOGUE=1, HAS_BIAS=True, HALF=32, ROTARY_HALF=32, PDL=pdl, **config.kwargs)
        options = dict(num_warps=config.num_warps, num_stages=config.num_stages, launch_pdl=pdl)
        if _spills(_compile(kernel, constexprs, pointers, 90, **options)):
            yield "qkv", constexprs, config.num_warps


def _moe_spills():
    for kernel, names, extra in moe_kernel_variants():
        pointers = {name: "*bf16" for name in names}
        pointers.update(index_ptr="*i64", weight_ptr="*fp32")
        for config in kernel.configs:
            constexprs = {**config.kwargs, **extra, **({"SLOTS": 2} if "SLOTS" in kernel.fn.arg_names else {})}
            options = dict(num_warps=config.num_warps, num_stages=config.num_stages)
            if _spills(_compile(kernel, constexprs, pointers, 90, **options)):
                yield kernel.fn.__name__, constexprs, config.num_warps


def _attention_spills():
    from archlab.modeling import triton_decoding

    pointers = {name: "*bf16" for name in ("q_ptr", "k_ptr", "v_ptr", "out_ptr")}
    for head, splits, mask in itertools.product((64, 128, 256), (1, 4), (0, 1, 2)):
        block = triton_decoding.block_keys(head, DTYPES["bf16"])
        constexprs = dict(GROUP=8, GROUP_ROWS=16, HEAD=head, BLOCK=block, SPLITS=splits, MASK=mask, IEEE=False)
        scratch = "*fp32" if splits > 1 else "*bf16"
        masks = {0: "*bf16", 1: "*i1", 2: "*fp32"}[mask]
        compiled = _compile(
            triton_decoding._decode_split_kernel, constexprs, {**pointers, "mask_ptr": masks, "part_ptr": scratch,
            "stat_ptr": scratch}, 90,
        )  # fmt: skip
        if _spills(compiled):
            yield "attention", constexprs


# each a test of its own: together one test of ~200 s that held one worker while the others had finished
REGISTER_CASES = ("gemv-one-row", "gemv-two-rows", "gemv-four-rows", "qkv-one-row", "qkv-four-rows", "moe", "attention")


@pytest.mark.parametrize("case", REGISTER_CASES)
def test_the_decoding_kernels_keep_everything_in_registers(case):
    """A weight-streaming loop that spills its accumulators to local memory reads and writes them every iteration
    beside the weights. In bf16 on sm90, as the decoding steps of batch 1 to 4 launch them, no kernel spills: the
    GEMV of one row (the one-row kernel) and of two and four (the streaming kernel: one accumulator a row, at most
    4 weight rows a program) in every configuration and variant (each prologue; the gate/up product with SwiGLU
    after it), launched plain or dependent (PDL, the first weight block read before the wait), the q/k/v GEMV with
    RoPE and the cache writes at one and four rows (RMSNorm, a bias), both MoE kernels in
    every configuration, the attention for heads of 64-256, with and without splits, every mask kind. (The
    three-dimensional tile the streaming kernel had before spilled at 4 rows in some configurations.)"""
    from archlab.modeling import triton_gemv, triton_qkv

    spilled = {
        "gemv-one-row": lambda: _gemv_spills(triton_gemv._gemv_row_kernel, 1),
        "gemv-two-rows": lambda: _gemv_spills(triton_gemv._gemv_kernel, 2),
        "gemv-four-rows": lambda: _gemv_spills(triton_gemv._gemv_kernel, 4),
        "qkv-one-row": lambda: _qkv_spills(triton_qkv._row_kernel, 1),
        "qkv-four-rows": lambda: _qkv_spills(triton_qkv._rows_kernel, 4),
        "moe": _moe_spills,
        "attention": _attention_spills,
    }[case]()
    assert not list(spilled)


@pytest.mark.parametrize("prologue", GEMV_PROLOGUES)
def test_the_tensor_core_gemv_loads_are_pipelined(prologue):
    """The tensor-core GEMV's weight blocks feed `tl.dot`: its sm90 code copies them to shared memory asynchronously
    (LDGSTS) inside the loop, in every configuration and prologue, whole and split-K (a loop over a share of the
    blocks)."""
    from archlab.modeling import triton_gemv

    kernel = triton_gemv._dot_kernel
    pointers = {**{name: "*bf16" for name in GEMV_POINTERS}, **SPLIT_POINTERS}
    for config, split in itertools.product(kernel.configs, (False, True)):
        constexprs = dict(
            ROWS=16, PROLOGUE=prologue, HAS_BIAS=False, HAS_RESIDUAL=True, GATED=False, IEEE=False, SPLIT=split,
            **config.kwargs,
        )  # fmt: skip
        options = dict(num_warps=config.num_warps, num_stages=config.num_stages)
        loops = _sass_loops(_compile(kernel, constexprs, pointers, 90, **options))
        assert any(sum("LDGSTS" in text for text in loop) >= 1 for loop in loops), config


@pytest.mark.parametrize("arch", ARCHS)
def test_the_split_attention_combining_in_its_last_program_compiles(arch):
    """COMBINE (`COMBINE_IN_SPLITS_DEVICES`): the split kernel counts its (row, KV head)'s finished splits with an
    acquire-release atomic at GPU scope after a barrier, the last one reads the others' partial results past the L1
    cache (`ld.global.cg`) and puts the count back to zero; in shared memory as without. Without COMBINE no atomic."""
    from archlab.modeling import triton_decoding

    constexprs = dict(GROUP=8, GROUP_ROWS=16, HEAD=64, BLOCK=64, SPLITS=4, MASK=1, IEEE=False, PDL=arch >= 90)
    pointers = {name: "*bf16" for name in ("q_ptr", "k_ptr", "v_ptr", "out_ptr")}
    pointers.update(mask_ptr="*i1", part_ptr="*fp32", stat_ptr="*fp32")
    combined = _compile(triton_decoding._decode_split_kernel, {**constexprs, "COMBINE": True}, pointers, arch)
    plain = _compile(triton_decoding._decode_split_kernel, constexprs, pointers, arch)
    ptx = combined.asm["ptx"]
    assert re.search(r"atom\.global\.gpu\.acq_rel\.add", ptx) and re.search(r"atom\.global\.gpu\.\w+\.exch", ptx)
    assert "ld.global.cg" in ptx and "atom.global" not in plain.asm["ptx"]
    assert combined.metadata.shared <= SHARED_LIMIT


def test_the_attention_loads_are_pipelined():
    """The attention's key and value blocks feed `tl.dot`, which Triton pipelines: its sm90 code copies them to shared
    memory asynchronously (LDGSTS) inside the loop, as launched (aligned pointers, unit strides)."""
    from archlab.modeling import triton_decoding

    constexprs = dict(GROUP=8, GROUP_ROWS=16, HEAD=64, BLOCK=64, SPLITS=1, MASK=1, IEEE=False)
    pointers = {name: "*bf16" for name in ("q_ptr", "k_ptr", "v_ptr", "out_ptr", "part_ptr", "stat_ptr")}
    pointers["mask_ptr"] = "*i1"
    loops = _sass_loops(_compile(triton_decoding._decode_split_kernel, constexprs, pointers, 90))
    assert any(sum("LDGSTS" in text for text in loop) >= 2 for loop in loops)


# Each kernel as its op's PDL twin launches it on Hopper (triton_launch.py): `PDL` set, Triton's `launch_pdl`
PDL_CASES = {
    "gemv-tensor-core": (
        "triton_gemv",
        "_dot_kernel",
        dict(ROWS=16, PROLOGUE=1, HAS_BIAS=False, HAS_RESIDUAL=False, GATED=True, IEEE=False, SPLIT=False),
        GEMV_POINTERS,
    ),
    "gemv-tensor-core-split": (
        "triton_gemv",
        "_dot_kernel",
        dict(ROWS=16, PROLOGUE=1, HAS_BIAS=False, HAS_RESIDUAL=False, GATED=True, IEEE=False, SPLIT=True),
        GEMV_POINTERS,
    ),
    "gemv-split-sum": (
        "triton_gemv",
        "_split_sum_kernel",
        dict(ROWS=16, PROLOGUE=1, HAS_BIAS=True, HAS_RESIDUAL=True, GATED=False, BLOCK_N=64),
        ("bias_ptr", "residual_ptr", "y_ptr"),
    ),
    "attention-split": (
        "triton_decoding",
        "_decode_split_kernel",
        dict(GROUP=8, GROUP_ROWS=16, HEAD=64, BLOCK=64, SPLITS=4, MASK=1, IEEE=False),
        ("q_ptr", "k_ptr", "v_ptr", "out_ptr", "part_ptr", "stat_ptr", "mask_ptr"),
    ),
    "attention-combine": (
        "triton_decoding",
        "_decode_combine_kernel",
        dict(GROUP=8, GROUP_ROWS=16, HEAD=64, SPLITS=4),
        ("part_ptr", "stat_ptr", "out_ptr"),
    ),
    "moe-gate-up": (
        "triton_moe",
        "_expert_gate_up_kernel",
        dict(NORM=True),
        ("x_ptr", "index_ptr", "w_ptr", "gain_ptr", "y_ptr"),
    ),
    "moe-down": (
        "triton_moe",
        "_expert_down_kernel",
        dict(SLOTS=2, HAS_RESIDUAL=True),
        ("h_ptr", "index_ptr", "weight_ptr", "w_ptr", "residual_ptr", "y_ptr"),
    ),
}


def _pdl_ptx(kernel, constexprs: dict, pointers: dict, config, pdl: bool = True) -> str:
    """The PTX of `kernel` in `config` (None: not autotuned) with `PDL` and Triton's `launch_pdl`, or without."""
    constexprs = {**constexprs, **(config.kwargs if config else {}), "PDL": pdl}
    options = dict(num_warps=config.num_warps, num_stages=config.num_stages) if config else {}
    compiled = _compile(kernel, constexprs, pointers, 90, launch_pdl=bool(pdl), **options)
    assert compiled.metadata.launch_pdl == bool(pdl)
    return compiled.asm["ptx"]


def _global_accesses(ptx: str) -> list[str]:
    ops = ("ld.global", "st.global", "cp.async", "atom.global", "red.global")
    return [line.strip() for line in ptx.splitlines() if any(op in line for op in ops)]


@pytest.mark.parametrize("case", PDL_CASES)
def test_dependent_launches_wait_for_the_kernel_before_touching_memory(case):
    """With `PDL` (the ops' PDL twins on Hopper) each kernel's code starts with `griddepcontrol.wait` — no load or
    store of global memory before it: the kernel before may still be writing the input, or reading the memory the
    output reuses — then `griddepcontrol.launch_dependents`; the kernel is marked for a dependent launch; without
    `PDL` neither instruction is there. (The streaming GEMV reads its first weight block before: the next test.)"""
    import importlib

    module_name, kernel_name, constexprs, names = PDL_CASES[case]
    kernel = getattr(importlib.import_module(f"archlab.modeling.{module_name}"), kernel_name)
    pointers = {name: "*bf16" for name in names}
    pointers.update({"index_ptr": "*i64", "weight_ptr": "*fp32"} if module_name == "triton_moe" else {})
    if module_name == "triton_decoding":
        pointers.update(mask_ptr="*i1", part_ptr="*fp32", stat_ptr="*fp32")
    if module_name == "triton_gemv":
        pointers.update(SPLIT_POINTERS)
    config = kernel.configs[0] if hasattr(kernel, "configs") else None
    ptx, plain = _pdl_ptx(kernel, constexprs, pointers, config), _pdl_ptx(kernel, constexprs, pointers, config, False)
    wait, launch = ptx.find("griddepcontrol.wait"), ptx.find("griddepcontrol.launch_dependents")
    assert 0 <= wait < launch and not _global_accesses(ptx[:wait]) and _global_accesses(ptx[wait:]), case
    assert "griddepcontrol" not in plain


@pytest.mark.parametrize("prologue, gated", GEMV_VARIANTS)
def test_the_streaming_gemv_reads_its_first_weight_block_before_waiting(prologue, gated):
    """The streaming GEMVs launched dependent read the first block of their weight while the kernel before ends (no
    kernel of a decoding step writes a weight), and nothing else: before `griddepcontrol.wait` their code holds
    exactly the 128-bit loads of one BLOCK_N × BLOCK_K block of bf16 per thread and no store; the input (which the
    kernel before writes), the gain, the up projection, the bias and the residual after it. Every configuration of
    the one-row kernel and of the streaming one at 4 rows."""
    from archlab.modeling import triton_gemv

    pointers = {name: "*bf16" for name in GEMV_POINTERS}
    for kernel, rows in ((triton_gemv._gemv_row_kernel, 1), (triton_gemv._gemv_kernel, 4)):
        for config in kernel.configs:
            constexprs = dict(ROWS=rows, PROLOGUE=prologue, HAS_BIAS=True, HAS_RESIDUAL=not gated, GATED=gated)
            ptx = _pdl_ptx(kernel, constexprs, pointers, config)
            wait, launch = ptx.find("griddepcontrol.wait"), ptx.find("griddepcontrol.launch_dependents")
            assert 0 <= wait < launch, config
            early = _global_accesses(ptx[:wait])
            threads = 32 * config.num_warps
            block_loads = config.kwargs["BLOCK_N"] * config.kwargs["BLOCK_K"] * 2 // (16 * threads)
            assert len(early) == block_loads and all("ld.global.v4" in line for line in early), (config, early)
    assert "griddepcontrol" not in _pdl_ptx(kernel, constexprs, pointers, config, pdl=False)


class _DriverWithoutGPU:
    """What Triton's JIT asks its active driver before it compiles (the device, its stream, the target), answered for
    an sm90 GPU that is not there: launches would fail, compiling works (Triton's own ptxas)."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)


def _gemv_launch(prologue: int) -> tuple[tuple, dict]:
    """A one-row GEMV launch's arguments as `gemv`'s PDL twin gives them (1.1B gate/up shapes)."""
    import torch

    x, w, y = (torch.zeros(*shape, dtype=torch.bfloat16) for shape in ((1, 2048), (5632, 2048), (1, 5632)))
    args = (x, x, x, w, w, y, y, 1, 5632, 2048, 1e-6, 2048, 2048, 2048, 5632, 5632)
    constants = dict(ROWS=1, PROLOGUE=prologue, HAS_BIAS=False, HAS_RESIDUAL=False, GATED=False, PDL=True)
    return args, dict(constants, launch_pdl=True)


def test_the_autotuners_key_is_the_one_archlab_computes(monkeypatch):
    """`autotuning_key` (triton_launch.py) is the key under which Triton's autotuner keeps its choice for a launch, so
    a shape it has tuned is not compiled again at once."""
    from archlab.modeling import triton_gemv, triton_launch

    kernel = triton_gemv._gemv_row_kernel
    monkeypatch.setattr(kernel, "cache", {})
    monkeypatch.setattr(kernel, "_bench", lambda *args, **kwargs: [1.0, 1.0, 1.0])  # no GPU to time them on
    monkeypatch.setattr(kernel.fn, "run", lambda *args, **kwargs: None)
    args, kwargs = _gemv_launch(prologue=1)
    kernel[(1,)](*args, **kwargs)
    assert list(kernel.cache) == [triton_launch.autotuning_key(kernel, args, kwargs)]


def test_every_configuration_compiles_at_once_into_the_kernels_cache(monkeypatch):
    """Through Triton's JIT and its AsyncCompileMode (a driver that answers for an sm90 GPU): a launch's every
    configuration compiled in one go, each as the autotuner's benchmark launches it — those launches then find them
    compiled and compile nothing."""
    import triton.runtime.jit as jit
    from triton.runtime import driver

    from archlab.modeling import triton_gemv, triton_launch

    kernel = triton_gemv._gemv_row_kernel
    monkeypatch.setattr(kernel, "cache", {})
    monkeypatch.setattr(triton_launch, "_CONFIGS_COMPILED", set())
    monkeypatch.setattr(driver, "_active", _DriverWithoutGPU())  # `set_active`; put back as it was (no driver)
    warnings = []
    monkeypatch.setattr(triton_launch.logger, "warning_once", warnings.append)
    args, kwargs = _gemv_launch(prologue=2)
    triton_launch.compile_configs_at_once(kernel, args, kwargs)
    assert not warnings

    def compiling(*args, **kwargs):
        raise AssertionError("a configuration compiled again")

    monkeypatch.setattr(jit.JITFunction, "_do_compile", compiling)
    for config in kernel.configs:  # as the autotuner's `_bench` launches each (here without the launch)
        compiled = kernel.fn.run(*args, grid=(1,), warmup=True, **kwargs, **config.all_kwargs())
        assert "cubin" in compiled.asm and compiled.metadata.launch_pdl


def _traced_launch(case: str) -> tuple:
    """(kernel, its arguments by name, the tensors it writes) for a launch as the ops give it, on small CPU tensors
    (what torch's analysis reads of a tensor: its dtype and alignment)."""
    import torch

    from archlab.modeling import triton_decoding, triton_gemv, triton_moe, triton_qkv

    bf16, fp32 = (
        lambda *shape, dtype=dtype: torch.zeros(*shape, dtype=dtype) for dtype in (torch.bfloat16, torch.float32)
    )
    strides = {name: 64 for name in ("q_b", "q_h", "k_b", "k_h", "k_s", "v_b", "v_h", "v_s", "m_b", "o_b", "o_h")}
    strides.update(q_d=1, k_d=1, v_d=1, m_s=1, o_d=1)
    attention = dict(
        q_ptr=bf16(64), k_ptr=bf16(64), v_ptr=bf16(64), out_ptr=bf16(64), keys=384, kv_heads=4, scale=0.125
    )
    attention.update(strides, GROUP=8, GROUP_ROWS=16, HEAD=64, BLOCK=64, IEEE=False, PDL=False, COMBINE=False)
    attention.update(count_ptr=torch.zeros(0, dtype=torch.int32), sink_ptr=fp32(32), SINKS=True)
    gemv = dict(x_ptr=bf16(64), up_ptr=bf16(64), gain_ptr=bf16(64), w_ptr=bf16(64), bias_ptr=bf16(64))
    gemv.update(residual_ptr=bf16(64), y_ptr=bf16(64), rows=1, outputs=2560, inputs=2048, eps=1e-6, x_m=2048)
    gemv.update(up_m=2048, w_n=2048, residual_m=2560, y_m=2560, HAS_BIAS=False, HAS_RESIDUAL=True, PDL=False)
    gemv.update(GATED=False)
    moe = dict(index_ptr=torch.zeros(2, dtype=torch.int64), w_ptr=bf16(64), y_ptr=bf16(64), outputs=2048)
    moe.update(inputs=1024, w_e=2048 * 1024, w_n=1024, y_m=2048, PDL=False, weight_ptr=fp32(2), WEIGHTED_INPUT=False)
    empty = fp32(0)
    return {
        "attention-one-split": (
            triton_decoding._decode_split_kernel,
            dict(
                attention, mask_ptr=torch.ones(64, dtype=torch.bool), part_ptr=empty, stat_ptr=empty, SPLITS=1, MASK=1
            ),
            ["out_ptr"],
        ),
        "attention-splits": (
            triton_decoding._decode_split_kernel,
            dict(attention, mask_ptr=attention["q_ptr"], part_ptr=fp32(64), stat_ptr=fp32(64), SPLITS=4, MASK=0),
            ["part_ptr", "stat_ptr"],
        ),
        "attention-combine": (
            triton_decoding._decode_combine_kernel,
            dict(
                part_ptr=fp32(64),
                stat_ptr=fp32(64),
                sink_ptr=fp32(32),
                out_ptr=bf16(64),
                kv_heads=4,
                o_b=64,
                o_h=64,
                o_d=1,
                GROUP=8,
                GROUP_ROWS=16,
                HEAD=64,
                SPLITS=4,
                PDL=False,
                SINKS=True,
            ),
            ["out_ptr"],
        ),  # fmt: skip
        "gemv-rms-norm": (triton_gemv._gemv_row_kernel, dict(gemv, ROWS=1, PROLOGUE=1), ["y_ptr"]),
        "gemv-two-rows-gated": (
            triton_gemv._gemv_kernel,
            dict(gemv, rows=2, ROWS=2, PROLOGUE=1, HAS_RESIDUAL=False, GATED=True),
            ["y_ptr"],
        ),
        "gemv-tensor-core-swiglu": (
            triton_gemv._dot_kernel,
            dict(gemv, part_ptr=empty, part_sq_ptr=empty, ROWS=16, PROLOGUE=2, IEEE=False, SPLIT=False),
            ["y_ptr"],
        ),
        "gemv-tensor-core-split": (
            triton_gemv._dot_kernel,
            dict(gemv, part_ptr=fp32(64), part_sq_ptr=fp32(64), ROWS=16, PROLOGUE=1, IEEE=False, SPLIT=True),
            ["part_ptr", "part_sq_ptr"],
        ),
        "gemv-split-sum": (
            triton_gemv._split_sum_kernel,
            dict(
                part_ptr=fp32(64),
                part_sq_ptr=fp32(64),
                bias_ptr=bf16(64),
                residual_ptr=bf16(64),
                y_ptr=bf16(64),
                rows=16,
                outputs=2048,
                inputs=2048,
                eps=1e-6,
                splits=4,
                residual_m=2048,
                y_m=2048,
                ROWS=16,
                PROLOGUE=1,
                HAS_BIAS=True,
                HAS_RESIDUAL=True,
                GATED=False,
                PDL=False,
                BLOCK_N=64,
            ),
            ["y_ptr"],
        ),  # fmt: skip
        "qkv-rotary-cache": (
            triton_qkv._row_kernel,
            dict(
                x_ptr=bf16(64),
                gain_ptr=bf16(64),
                w_ptr=bf16(64),
                bias_ptr=bf16(64),
                cos_ptr=bf16(64),
                sin_ptr=bf16(64),
                pos_ptr=torch.zeros(1, dtype=torch.int64),
                q_ptr=bf16(64),
                k_ptr=bf16(64),
                v_ptr=bf16(64),
                rows=1,
                tokens=1,
                pairs=1280,
                inputs=2048,
                heads=32,
                kv_heads=4,
                eps=1e-6,
                x_m=2048,
                w_n=2048,
                cos_m=64,
                q_m=2048,
                c_b=4 * 385 * 64,
                c_h=385 * 64,
                c_s=64,
                ROWS=1,
                PROLOGUE=1,
                HAS_BIAS=False,
                HALF=32,
                ROTARY_HALF=32,
                PDL=False,
            ),
            ["k_ptr", "q_ptr", "v_ptr"],
        ),  # fmt: skip
        "moe-gate-up": (
            triton_moe._expert_gate_up_kernel,
            dict(
                moe,
                x_ptr=bf16(64),
                gain_ptr=bf16(64),
                bias_ptr=bf16(64),
                slots=2,
                eps=1e-6,
                limit=7.0,
                up_offset=1.0,
                x_m=1024,
                b_e=4096,
                NORM=True,
                BIAS=True,
                CLAMP=True,
                ALPHA=1.702,
            ),  # fmt: skip
            ["y_ptr"],
        ),
        "moe-down": (
            triton_moe._expert_down_kernel,
            dict(
                moe,
                h_ptr=bf16(64),
                bias_ptr=bf16(64),
                residual_ptr=bf16(64),
                h_m=1024,
                b_e=2048,
                residual_m=2048,
                SLOTS=2,
                HAS_RESIDUAL=True,
                BIAS=True,
            ),
            ["y_ptr"],
        ),  # fmt: skip
    }[case]


TRACED_LAUNCHES = (
    "attention-one-split",
    "attention-splits",
    "attention-combine",
    "gemv-rms-norm",
    "gemv-two-rows-gated",
    "gemv-tensor-core-swiglu",
    "gemv-tensor-core-split",
    "gemv-split-sum",
    "qkv-rotary-cache",
    "moe-gate-up",
    "moe-down",
)


@pytest.mark.parametrize("case", TRACED_LAUNCHES)
def test_torch_compile_sees_what_each_kernel_writes(case, monkeypatch):
    """torch.compile records a launch of a user-defined Triton kernel by the tensors it writes, found in the kernel's
    TTIR (torch/_higher_order_ops/triton_kernel_wrap.py). Where that analysis fails, torch takes every tensor argument
    as written and the compiled step copies each one — the weights too — around every launch: an H200 timed a fused
    layer's step at 0.65× the unfused one, and a launch whose output aliased its unused scratch arguments gave NaN
    logits. The analysis, as the installed torch runs it (a driver answering for an sm90 GPU), names the kernel's
    outputs and nothing else."""
    from torch._higher_order_ops import triton_kernel_wrap
    from triton.runtime import driver

    monkeypatch.setattr(driver, "_active", _DriverWithoutGPU())
    kernel, kwargs, written = _traced_launch(case)
    if hasattr(triton_kernel_wrap, "identify_accessed_tensors"):  # torch 2.12 and later
        accesses = triton_kernel_wrap.identify_accessed_tensors(kernel, kwargs, {})
        found = sorted(dep.name for dep in accesses.read_writes.writes)
    else:
        found = sorted(triton_kernel_wrap.identify_mutated_tensors(kernel, kwargs, {}))
    assert found == written


@pytest.mark.parametrize("case", TRACED_LAUNCHES)
def test_the_kernels_compile_with_every_scalar_argument_a_constant(case):
    """torch 2.11's analysis (the GPU machine's torch) builds the TTIR with every argument that is not a tensor as a
    constant, so a float argument is a Python float there, which has no `.to` (`tl.cast` takes both): the analysis
    failed on the attention's scale and the GEMV's and MoE's eps ("'float' object has no attribute 'to'")."""
    import torch

    kernel, kwargs, _ = _traced_launch(case)
    fn = kernel.fn if hasattr(kernel, "configs") else kernel
    config = kernel.configs[0].kwargs if hasattr(kernel, "configs") else {}
    types = {
        torch.bfloat16: "*bf16",
        torch.float32: "*fp32",
        torch.int64: "*i64",
        torch.int32: "*i32",
        torch.bool: "*i1",
    }
    pointers = {name: types[value.dtype] for name, value in kwargs.items() if isinstance(value, torch.Tensor)}
    constants = {name: value for name, value in kwargs.items() if name not in pointers and name in fn.arg_names}
    assert "cubin" in _compile(kernel, {**constants, **config}, pointers, 90).asm


# The 1.1B model's weight rows of the tail's phases: output projection, gate/up product, down projection
TAIL_WEIGHT_ROWS = {"ROWS_OUTPUT": 2048, "ROWS_GATE_UP": 2 * 5632, "ROWS_DOWN": 2048}


def _layer_tail(arch: int, dtype: str, pdl: bool = False):
    """The persistent layer tail (triton_layer_tail.py) compiled as the op launches it for the 1.1B model on an H200
    (528 programs): every phase, biases, its default blocks, the gate/up product's tiles halved to balance the
    programs (`tile_rows`), the registers capped for `PROGRAMS_PER_PROCESSOR` programs a multiprocessor."""
    from archlab.modeling import triton_layer_tail as tail

    block_n, block_k, unroll, warps = tail.TAIL_BLOCKS
    kernel = tail._layer_tail_kernel
    rows = {name: tail.tile_rows(weight_rows, 528, block_n) for name, weight_rows in TAIL_WEIGHT_ROWS.items()}
    assert rows == {"ROWS_OUTPUT": block_n, "ROWS_GATE_UP": block_n // 2, "ROWS_DOWN": block_n}
    constexprs = dict(
        HAS_O_BIAS=True, HAS_GU_BIAS=True, HAS_D_BIAS=True, **tail._waits(tail.ALL_PHASES, pdl),
        PHASES=tail.ALL_PHASES, **rows, BLOCK_K=block_k, UNROLL=unroll,
    )  # fmt: skip
    pointers = {name: f"*{dtype}" for name in kernel.arg_names if name.endswith("_ptr") and name != "count_ptr"}
    return _compile(
        kernel, constexprs, pointers, arch, num_warps=warps, num_stages=1, scale="fp32", launch_pdl=pdl,
        maxnreg=tail.max_registers(warps),
    )  # fmt: skip


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_layer_tail_compiles_to_resident_programs_and_grid_barriers(arch, dtype):
    """The persistent kernel compiles within its capped registers (in bf16 without spilling: the decoding step's
    dtype), and its two barriers are what they must be for the phases to see each other's outputs: each program's
    arrival an acquire-release atomic add at GPU scope, its wait an acquire load at GPU scope which the machine code
    turns into a strong load and an invalidation of the multiprocessor's L1 cache (so the plain loads of the next
    phase read what other programs wrote), and the counts put back to zero once (three exchanges)."""
    import re

    compiled = _layer_tail(arch, dtype)
    assert "cubin" in compiled.asm and compiled.metadata.shared <= SHARED_LIMIT
    if dtype == "bf16":
        assert not _spills(compiled)
    ptx = compiled.asm["ptx"]
    assert len(re.findall(r"atom\.global\.gpu\.acq_rel\.add", ptx)) == 3  # two arrivals, the programs done
    assert len(re.findall(r"ld\.global\.gpu\.acquire", ptx)) == 2  # the two waits
    assert len(re.findall(r"atom\.global\.gpu\.relaxed\.exch", ptx)) == 3
    waits = [loop for loop in _sass_loops(compiled) if any("STRONG.GPU" in text for text in loop)]
    assert len(waits) == 2 and all(any(text.startswith("CCTL.IVALL") for text in loop) for loop in waits), waits


def test_the_layer_tail_reads_its_first_weight_block_before_waiting():
    """Launched dependent on the attention (Hopper), the tail reads the first block of the output projection's weight
    before `griddepcontrol.wait` and nothing else: the 128-bit loads of one BLOCK_N × BLOCK_K block of bf16 per
    thread, no store, no atomic; without the dependent launch no `griddepcontrol`."""
    from archlab.modeling import triton_layer_tail as tail

    ptx = _layer_tail(90, "bf16", pdl=True).asm["ptx"]
    wait, launch = ptx.find("griddepcontrol.wait"), ptx.find("griddepcontrol.launch_dependents")
    assert 0 <= wait < launch
    block_n, block_k, _, warps = tail.TAIL_BLOCKS
    early = _global_accesses(ptx[:wait])
    assert len(early) == block_n * block_k * 2 // (16 * 32 * warps) and all("ld.global.v4" in line for line in early)
    assert "griddepcontrol" not in _layer_tail(90, "bf16").asm["ptx"]
