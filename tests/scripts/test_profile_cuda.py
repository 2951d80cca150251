"""scripts/profile_cuda.py: the profile summaries — kernel kinds, the GPU's busy time as a union of kernel spans —
and the CPU rehearsal of the workloads, writing one report per workload."""

from __future__ import annotations

import functools

import pytest

from archlab.scripts import profile_cuda

from helpers import trace_only_compile_regions, trace_only_torch_compile


@pytest.mark.parametrize(
    "name, kind",
    [
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1", "GEMM"),
        ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNN", "GEMM"),
        ("void gemv2T_kernel_val<int, int, __nv_bfloat16, __nv_bfloat16, float, 128, 16, 4, 4, false>", "GEMM"),
        ("void splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float, __nv_bfloat16>", "GEMM"),
        ("pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4>>", "attention"),
        ("fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel)", "attention"),
        ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "fused Triton"),
        ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>", "optimizer"),
        ("void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda>", "copy / cast"),
        ("void at::native::vectorized_elementwise_kernel<4, at::native::silu_kernel>", "other elementwise / reduction"),
    ],
)
def test_kernels_are_sorted_by_kind(name, kind):
    assert profile_cuda.kind_of(name) == kind


def test_busy_time_counts_overlapping_kernels_once():
    spans = [("a", 0.0, 10.0), ("b", 5.0, 10.0), ("c", 30.0, 5.0), ("d", 31.0, 1.0)]
    assert profile_cuda.busy_microseconds(spans) == 20.0
    assert profile_cuda.busy_microseconds([]) == 0.0


def test_a_record_function_range_on_the_gpu_timeline_is_not_a_kernel():
    """On CUDA the optimiser's `Optimizer.step#AdamW.step` range shows among the GPU events beside the fused AdamW
    kernels it spans: counted as a kernel it had doubled the optimiser's share (H100 profile, 23.8 for 11.9 ms)."""
    from types import SimpleNamespace

    import torch
    from torch.autograd import DeviceType

    def event(name, start, duration, device_type=DeviceType.CUDA, annotation=False):
        span = SimpleNamespace(start=start, elapsed_us=lambda: duration)
        return SimpleNamespace(
            name=name, time_range=span, device_type=device_type, is_user_annotation=annotation, cpu_children=[]
        )

    events = [
        event("Optimizer.step#AdamW.step", 0.0, 12.0, annotation=True),
        event("multi_tensor_apply_kernel<FusedAdamMathFunctor>", 0.0, 11.0),
        event("aten::add", 0.0, 1.0, device_type=DeviceType.CPU),
    ]
    found = profile_cuda.kernels(SimpleNamespace(events=lambda: events), torch.device("cuda"))
    assert found == [("multi_tensor_apply_kernel<FusedAdamMathFunctor>", 0.0, 11.0)]


def test_summary_reports_per_step_times_kinds_and_top_kernels():
    import torch

    one_step = [("sm90_gemm", 0.0, 3000.0), ("triton_poi_fused_add_0", 4000.0, 1000.0)]
    spans = one_step + [(name, start + 5000.0, duration) for name, start, duration in one_step]
    text = profile_cuda.summary("prefill", torch.device("cpu"), 2, 0.010, spans)
    assert "5.00 ms per step wall, 4.000 ms busy (80 % of the wall time), 2 kernels per step" in text
    assert "| GEMM | 3.000 | 75.0 |" in text and "| fused Triton | 1.000 | 25.0 |" in text
    assert "| `sm90_gemm` | 1 | 3.000 | 75.0 |" in text


def test_the_cpu_rehearsal_writes_every_report_to_one_file(tmp_path, capsys, monkeypatch):

    trace_only_compile_regions(monkeypatch)  # the compiled training steps traced, no code generated
    trace_only_torch_compile(monkeypatch)  # and the compiled prefill
    # every kernel listed, not the top 25 by time: on a loaded CPU the router's topk can fall out of those
    monkeypatch.setattr(profile_cuda, "summary", functools.partial(profile_cuda.summary, top=100_000))
    # all but the dense compiled step and batch 64, the same code as train-moe's compile and decode-1
    workloads = [name for name in profile_cuda.WORKLOADS if name not in ("train", "decode-64")]
    output = tmp_path / "out" / "profile.md"
    argv = ["--device", "cpu", "--quick", "--rounds", "1", "--output", str(output)]
    assert profile_cuda.main(argv + [arg for name in workloads for arg in ("--workload", name)]) == 0
    reports = output.read_text().split("\n## ")
    assert len(reports) == len(workloads)
    for name, report in zip(workloads, reports):
        assert report.lstrip("# ").startswith(f"{name} — CPU"), report[:80]
        assert "ms per step wall" in report and "| kernel |" in report
    assert "## decode-1" in capsys.readouterr().out
    moe, dense = (reports[workloads.index(name)] for name in ("train-moe", "train-moe-dense"))
    assert "topk" in moe and "topk" not in dense  # the router (its aux loss) only in the MoE


def test_the_tuned_decoding_profile_adds_coordinate_descent_to_the_default_options():
    from archlab.modeling import step_compile

    options = profile_cuda.tuned_step_config().options
    assert options["coordinate_descent_tuning"] and options["triton.cudagraphs"]  # (reduce-overhead's kept)
    assert all(options[name] == value for name, value in step_compile.TUNED_STEP_OPTIONS.items())


def test_the_decoding_profile_before_archlab_s_kernels_turns_each_off_while_it_runs():
    from archlab.modeling import step_compile
    from archlab.scripts.benchmark_cuda_decode import decode_kernel_switches

    switches = decode_kernel_switches()
    assert len(switches) == 4
    with profile_cuda.without_archlab_kernels():
        assert all(getattr(module, name) == () for module, name in switches)
        assert step_compile.DEPENDENT_LAUNCH_OPTIONS == {}
    assert all(getattr(module, name) == ("cuda",) for module, name in switches)  # the defaults, back
    assert step_compile.DEPENDENT_LAUNCH_OPTIONS == {"triton.enable_pdl": True}


def test_bad_arguments_fail_early(capsys):
    with pytest.raises(SystemExit):
        profile_cuda.main(["--rounds", "0"])
    assert "--rounds must be >= 1, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        profile_cuda.main(["--workload", "decode-2"])
