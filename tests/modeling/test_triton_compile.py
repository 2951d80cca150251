"""archlab's Triton kernels (triton_decoding.py, triton_gemv.py, triton_moe.py) compiled ahead of time for the GPUs
users decode on, on a machine without one: Triton's compiler takes a kernel to a cubin for a named target (its own
ptxas), so a kernel that would not compile, or whose pipelined tiles would not fit a GPU's shared memory, fails
here, in CI, and not at a GPU session's first call. Each kernel is compiled as its op launches it: the attention in
every mask kind, with and without splits, for heads of 64 to 256 in bf16 and fp32; the GEMV and the MoE kernels in
every configuration their autotuners try.

Needs Triton (CPU wheels of torch come without it: `.ci/run` installs it for this file) and not its interpreter."""

from __future__ import annotations

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
# its mask; sizes (lengths, counts) and the mask's row stride (a key count) are not assumed divisible; every other
# integer is a stride of rows of a hidden size or head size.
UNIT_STRIDES = ("q_d", "k_d", "v_d", "o_d", "m_s")
NOT_DIVISIBLE = ("keys", "kv_heads", "rows", "outputs", "inputs", "slots", "m_b")


def _compile(
    kernel, constexprs: dict, pointers: dict, arch: int, num_warps: int = 4, num_stages: int = 3, scale: str = "fp64"
):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = kernel.fn if hasattr(kernel, "configs") else kernel  # an autotuner: its kernel
    signature, constants, attrs = {}, dict(constexprs), {}
    for index, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = pointers[name]
            attrs[(index,)] = [["tt.divisibility", 16]]
        elif name == "scale":
            signature[name] = scale
        elif name in UNIT_STRIDES:
            signature[name], constants[name] = "constexpr", 1
        else:
            signature[name] = "i32"
            if name not in NOT_DIVISIBLE:
                attrs[(index,)] = [["tt.divisibility", 16]]
    source = ASTSource(fn=fn, signature=signature, constexprs=constants, attrs=attrs)
    options = {"num_warps": num_warps, "num_stages": num_stages}
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
    _assert_compiles(triton_decoding._decode_combine_kernel, constexprs, pointers, arch)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_gemv_compiles_in_every_autotuned_configuration(arch, dtype):
    from archlab.modeling import triton_gemv

    kernel = triton_gemv._gated_down_kernel
    pointers = {name: f"*{dtype}" for name in ("gate_ptr", "up_ptr", "w_ptr", "bias_ptr", "y_ptr")}
    for config in kernel.configs:
        for rows in (1, 4):
            constexprs = dict(ROWS=rows, HAS_BIAS=True, **config.kwargs)
            options = dict(num_warps=config.num_warps, num_stages=config.num_stages)
            _assert_compiles(kernel, constexprs, pointers, arch, **options)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_moe_kernels_compile_in_every_autotuned_configuration(arch, dtype):
    from archlab.modeling import triton_moe

    for kernel, names in (
        (triton_moe._expert_gate_up_kernel, ("x_ptr", "w_ptr", "y_ptr")),
        (triton_moe._expert_down_kernel, ("h_ptr", "w_ptr", "y_ptr")),
    ):
        pointers = {name: f"*{dtype}" for name in names}
        pointers.update(index_ptr="*i64", weight_ptr="*fp32")
        for config in kernel.configs:
            constexprs = dict(config.kwargs)
            if "SLOTS" in kernel.fn.arg_names:
                constexprs["SLOTS"] = 2
            options = dict(num_warps=config.num_warps, num_stages=config.num_stages)
            _assert_compiles(kernel, constexprs, pointers, arch, **options)
