"""training/roofline.py: the model FLOPs of a step equal what torch's FlopCounterMode counts on the peer models
(eager attention, so the T × T matmuls are counted as PaLM counts them); the bytes-per-step roofline reads the
weights once per step and only the experts a batch can reach; GPU names resolve to the right datasheet row."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MarianConfig,
    MarianMTModel,
    MistralConfig,
    MixtralConfig,
    MixtralForCausalLM,
)

from archlab.training import roofline

SMALL = dict(
    vocab_size=101,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    attn_implementation="eager",
)


def counted(run) -> int:
    with FlopCounterMode(display=False) as counter:
        run()
    return counter.get_total_flops()


def test_decoder_flops_match_flop_counter_forward_and_training():
    config = LlamaConfig(**SMALL)
    model = LlamaForCausalLM(config)
    ids = torch.randint(0, 100, (2, 10))
    assert counted(lambda: model(input_ids=ids, use_cache=False)) == roofline.decoder_forward_flops(config, 2, 10)
    assert counted(lambda: model(input_ids=ids, use_cache=False, logits_to_keep=1)) == (
        roofline.decoder_forward_flops(config, 2, 10, logits_positions=1)
    )
    step = lambda: model(input_ids=ids, labels=ids, use_cache=False).loss.backward()  # noqa: E731
    assert counted(step) == roofline.decoder_training_flops(config, 2, 10)


def test_moe_flops_count_the_routed_experts_and_the_router():
    config = MixtralConfig(**SMALL, num_local_experts=4, num_experts_per_tok=2, experts_implementation="eager")
    model = MixtralForCausalLM(config)
    ids = torch.randint(0, 100, (2, 10))
    assert counted(lambda: model(input_ids=ids, use_cache=False)) == roofline.decoder_forward_flops(config, 2, 10)


def test_seq2seq_training_flops_match_flop_counter():
    config = MarianConfig(
        vocab_size=101,
        d_model=32,
        encoder_layers=2,
        decoder_layers=3,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=48,
        pad_token_id=100,
        decoder_start_token_id=100,
        attn_implementation="eager",
    )
    model = MarianMTModel(config)
    source, target = torch.randint(0, 99, (2, 7)), torch.randint(0, 99, (2, 5))
    step = lambda: model(input_ids=source, labels=target).loss.backward()  # noqa: E731
    assert counted(step) == roofline.seq2seq_training_flops(config, 2, 7, 5)


BANDWIDTH_ONLY = roofline.DevicePeaks("test", flops=float("inf"), bandwidth=1e12, source="test")


def test_batch_one_decode_is_bound_by_reading_the_weights_once_per_token():
    """GPU.md's estimate: the 1.1B model reads ~2 GB of bf16 weights per token, ~1,400-1,600 tokens/s at ~3 TB/s."""
    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=22,
        num_attention_heads=32,
        num_key_value_heads=4,
    )
    weights = roofline.decoder_weights_per_token(config)
    assert 1.0e9 < weights < 1.1e9  # 1.1B parameters less the input embedding (a lookup, not a matmul)
    peaks = roofline.DevicePeaks("H100", 989e12, 3.35e12, "datasheet")
    tokens_per_s = 256 / roofline.decode_roofline_seconds(config, peaks, 1, 128, 256)
    assert 1_400 < tokens_per_s < 3.35e12 / (2 * weights) < 1_650  # the KV cache costs a little on top
    # One new token: the prompt's pass only, which reads the weights once (FLOPs are free here).
    assert roofline.decode_roofline_seconds(config, BANDWIDTH_ONLY, 1, 8, 1) == pytest.approx(2 * weights / 1e12)


def test_moe_decode_reads_k_experts_at_batch_one_and_all_of_them_at_large_batch():
    config = MixtralConfig(**SMALL, num_local_experts=8, num_experts_per_tok=2)
    per_layer, routed = roofline.decoder_layer_weights(config)
    active = roofline.decoder_weights_per_token(config)
    every_expert = active + config.num_hidden_layers * routed * 3  # 8 experts read instead of 2
    assert roofline.decode_roofline_seconds(config, BANDWIDTH_ONLY, 1, 4, 1) == pytest.approx(2 * active / 1e12)
    assert roofline.decode_roofline_seconds(config, BANDWIDTH_ONLY, 10_000, 1, 1) == pytest.approx(
        2 * every_expert / 1e12
    )


def test_sliding_window_layers_read_at_most_their_window():
    """Past the window a sliding layer's step reads the window's keys only: Mistral's all-sliding layers (a window and
    no layer types), and Gemma 2's alternation (every other layer full)."""
    kv = 2 * SMALL["num_key_value_heads"] * (SMALL["hidden_size"] // SMALL["num_attention_heads"]) * 2
    layers = SMALL["num_hidden_layers"]
    weights = 2 * roofline.decoder_weights_per_token(LlamaConfig(**SMALL)) / 1e12
    step = lambda config, context: (  # noqa: E731 - one step's seconds: a generation of two tokens less its prompt
        roofline.decode_roofline_seconds(config, BANDWIDTH_ONLY, 1, context - 1, 2)
        - roofline.decode_roofline_seconds(config, BANDWIDTH_ONLY, 1, context - 1, 1)
    )
    full, mistral = LlamaConfig(**SMALL), MistralConfig(**SMALL, sliding_window=4)
    assert step(full, 3) == pytest.approx(weights + layers * kv * 3 / 1e12)
    assert step(mistral, 3) == pytest.approx(step(full, 3))  # inside the window
    assert step(mistral, 10) == pytest.approx(weights + layers * kv * 4 / 1e12)
    alternating = ["sliding_attention", "full_attention"] * (layers // 2)
    gemma = SimpleNamespace(**SMALL, sliding_window=4, layer_types=alternating)  # Gemma 2-like, Llama-shaped
    assert step(gemma, 10) == pytest.approx(weights + layers // 2 * kv * (4 + 10) / 1e12)


def test_unknown_peaks_give_no_roofline():
    config = LlamaConfig(**SMALL)
    unknown = roofline.DevicePeaks("CPU", None, None, "unknown")
    assert roofline.decode_roofline_seconds(config, unknown, 1, 4, 4) is None


@pytest.mark.parametrize(
    "name, tflops, bandwidth",
    [
        ("NVIDIA H100 80GB HBM3", 989.0, 3.35),
        ("NVIDIA H100 PCIe", 756.0, 2.0),
        ("NVIDIA H100 NVL", 835.0, 3.9),
        ("NVIDIA H200", 989.0, 4.8),
        ("NVIDIA A100-SXM4-80GB", 312.0, 2.039),
        ("NVIDIA A100 80GB PCIe", 312.0, 1.935),
        ("NVIDIA A100-SXM4-40GB", 312.0, 1.555),
        ("NVIDIA L4", 121.0, 0.3),
        ("NVIDIA L40S", 362.0, 0.864),
        ("NVIDIA GH200 480GB", None, None),  # not an H200: unknown rather than wrong
        ("NVIDIA GeForce RTX 4090", None, None),
    ],
)
def test_gpu_names_resolve_to_their_datasheet_row(monkeypatch, name, tflops, bandwidth):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    peaks = roofline.device_peaks("cuda")
    assert peaks.name == name
    assert peaks.flops == (tflops * 1e12 if tflops else None)
    assert peaks.bandwidth == (bandwidth * 1e12 if bandwidth else None)
    assert peaks.source == ("datasheet" if tflops else "unknown")


def test_overrides_win_and_a_cpu_has_no_datasheet(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    peaks = roofline.device_peaks("cuda", tflops=800.0)
    assert (peaks.flops, peaks.bandwidth, peaks.source) == (800e12, 3.35e12, "--peak-tflops/--peak-bandwidth")
    cpu = roofline.device_peaks("cpu")
    assert cpu.name.startswith("CPU") and (cpu.flops, cpu.bandwidth, cpu.source) == (None, None, "unknown")
    assert roofline.device_peaks("cpu", bandwidth_tb_s=0.1).bandwidth == 0.1e12
