"""training/benchmarking.py beyond what the benchmark script's tests cover: tables with further columns, the bytes a
model owns, and (on a GPU only) timers that wait for the kernels and the allocator's peak per call."""

from __future__ import annotations

import pytest
import torch

from archlab import DecoderForCausalLM
from archlab.training.benchmarking import (
    Report,
    Row,
    interleaved_rounds,
    make_optimizer,
    peak_cuda_memory,
    peak_training_memory,
    resident_bytes,
    training_step,
)

from helpers import tiny_decoder_config


def test_extra_columns_are_the_union_in_order_and_goal_shows_only_when_set():
    report = Report(title="t", peer_name="peer")
    report.rows.append(Row("a", 2.0, 1.0, 2.0, "tok/s", extra={"MFU archlab": "40.0 %", "MFU peer": "20.0 %"}))
    report.rows.append(Row("b", 1.0, 1.0, 1.0, "tok/s", extra={"MFU archlab": "n/a", "first call archlab": "9.0 s"}))
    lines = report.markdown().splitlines()
    assert lines[2] == "| metric | archlab | peer | ratio | MFU archlab | MFU peer | first call archlab |"
    assert lines[4] == "| a | 2.0 tok/s | 1.0 tok/s | 2.00× | 40.0 % | 20.0 % |  |"
    assert lines[5] == "| b | 1.0 tok/s | 1.0 tok/s | 1.00× | n/a |  | 9.0 s |"
    report.rows.append(Row("c", 1.0, 1.0, 1.0, "MiB", goal="≥ 1.0×"))
    assert report.markdown().splitlines()[2].endswith("| first call archlab | goal |")


def test_resident_bytes_count_tied_weights_once_and_the_optimizer_state():
    model = DecoderForCausalLM(tiny_decoder_config(tie_word_embeddings=True))
    parameters = sum(p.numel() * p.element_size() for p in model.parameters())  # parameters() yields tied ones once
    buffers = sum(b.untyped_storage().nbytes() for b in model.buffers())
    assert resident_bytes(model) == parameters + buffers
    optimizer = make_optimizer(model)
    ids = torch.randint(3, 97, (2, 8))
    training_step(model, {"input_ids": ids, "labels": ids}, optimizer)()
    # AdamW keeps two moments per parameter, plus a step counter each
    state = sum(v.untyped_storage().nbytes() for s in optimizer.state.values() for v in s.values())
    assert state >= 2 * parameters
    assert resident_bytes(model, optimizer) == parameters + buffers + state


@pytest.mark.gpu
def test_cuda_timer_waits_for_the_kernels():
    """Without a synchronize the timer would read the launch time only, a fraction of the kernels' time."""
    a = torch.randn(4096, 4096, device="cuda")

    def run():
        for _ in range(20):
            a @ a

    run()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run()
    end.record()
    torch.cuda.synchronize()
    kernel_seconds = start.elapsed_time(end) / 1000
    seconds = interleaved_rounds({"run": run}, rounds=3, device="cuda")["run"]
    assert min(seconds) >= 0.8 * kernel_seconds


@pytest.mark.gpu
def test_cuda_peak_counts_the_run_and_what_it_owns_not_other_tensors():
    elsewhere = torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda")  # another model's weights, say
    owned = 8 * 2**20

    def run():
        temporary = torch.empty(32 * 2**20, dtype=torch.uint8, device="cuda")
        temporary.fill_(1)

    assert peak_cuda_memory(run, owned, "cuda") == 32 * 2**20 + owned
    del elsewhere


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_training_step_autocasts_on_the_models_own_device(device):
    """bf16 autocast must be the model's device's: a CUDA model under CPU autocast would train in fp32."""
    model = DecoderForCausalLM(tiny_decoder_config()).to(device)
    optimizer = make_optimizer(model)
    ids = torch.randint(3, 97, (2, 16), device=device)
    step = training_step(model, {"input_ids": ids, "labels": ids}, optimizer, torch.bfloat16)
    seen = []
    model.model.layers[0].self_attn.q_proj.register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    step()
    assert seen == [torch.bfloat16]
    assert all(p.dtype == torch.float32 for p in model.parameters())  # autocast, not a cast of the weights


@pytest.mark.gpu
def test_cuda_training_peak_exceeds_weights_and_optimizer_state():
    model = DecoderForCausalLM(tiny_decoder_config()).cuda()
    optimizer = make_optimizer(model)
    ids = torch.randint(3, 97, (2, 16), device="cuda")
    step = training_step(model, {"input_ids": ids, "labels": ids}, optimizer, torch.bfloat16)
    step()  # the optimiser's state exists from here on
    assert peak_training_memory(model, step, optimizer) > resident_bytes(model, optimizer)


def test_torch_threads_restores_the_callers_setting():
    from archlab.training.benchmarking import torch_threads

    before = torch.get_num_threads()
    with torch_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    with pytest.raises(RuntimeError), torch_threads(1):
        raise RuntimeError("a failing benchmark")
    assert torch.get_num_threads() == before
    with torch_threads(None):  # no count: left as is
        assert torch.get_num_threads() == before
