"""What a GPU benchmark row is measured against: the model FLOPs of a step (for MFU), the fewest bytes a decode step
must read (for the bandwidth roofline), and the peak rates of known GPUs.

FLOPs follow PaLM's accounting (Chowdhery et al. 2022, appendix B, "model FLOPs utilization"): a matmul weight
costs 2 FLOPs per token forward and 6 per trained token (forward + backward), and attention adds 4 · L · d_attn · T
FLOPs per token forward (QKᵀ and the weighted sum of V over T positions; 12 · L · d_attn · T in training), counted
over the whole T × T score matrix as PaLM counts it (causal masking is not subtracted). d_attn is the query width,
heads × head_dim. Embedding lookups are gathers and cost nothing; the LM head is a matmul and counts. A
mixture-of-experts layer counts the k experts a token is routed to and its router. Recomputation (gradient
checkpointing) is not model FLOPs. MFU = model FLOPs / seconds / peak dense bf16 FLOP/s.

A decode step cannot be faster than reading each weight it uses once plus each sequence's KV cache once (bytes /
peak bandwidth), nor than its FLOPs at the peak rate; its roofline is the larger of the two, and a generation's is
the sum over its steps (the prompt's forward pass first); a sliding-window layer's step reads at most its window of
the cache. With batch 1 of a dense model that is the weights' bytes per token: 2.2 GB at ~3 TB/s allows ~1,400
tokens/s for a 1.1B model in bf16.
"""

from __future__ import annotations

import platform
import re
from dataclasses import dataclass

import torch

# Datasheet peaks (dense bf16 tensor-core TFLOP/s without sparsity, memory TB/s), matched in this order against
# `torch.cuda.get_device_name`; the first pattern found wins. Measured ceilings sit below these (an H100 SXM runs a
# large bf16 matmul at ~800 TFLOP/s and copies at ~3 TB/s): MFU here is against the datasheet, as usually reported.
KNOWN_GPUS: list[tuple[str, float, float]] = [
    (r"\bH100\b.*\bNVL\b", 835.0, 3.9),
    (r"\bH100\b.*\bPCIe\b", 756.0, 2.0),
    (r"\bH100\b", 989.0, 3.35),  # SXM5: "NVIDIA H100 80GB HBM3"
    (r"\bH200\b", 989.0, 4.8),
    (r"\bB200\b", 2250.0, 8.0),
    (r"\bA100\b.*SXM.*80GB", 312.0, 2.039),
    (r"\bA100\b.*80GB", 312.0, 1.935),  # PCIe
    (r"\bA100\b", 312.0, 1.555),  # 40GB, SXM4 or PCIe
    (r"\bL40S\b", 362.0, 0.864),
    (r"\bL4\b", 121.0, 0.3),
    (r"\bA10\b", 125.0, 0.6),
]


@dataclass(frozen=True)
class DevicePeaks:
    name: str
    flops: float | None  # FLOP/s, None when unknown
    bandwidth: float | None  # bytes/s, None when unknown
    source: str  # where the numbers come from: "datasheet", "--peak-tflops/--peak-bandwidth", "unknown"


def device_peaks(
    device: torch.device | str, tflops: float | None = None, bandwidth_tb_s: float | None = None
) -> DevicePeaks:
    """The device's name and peak rates: the overrides where given, else the datasheet row its name matches."""
    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
    known = next(((t, b) for pattern, t, b in KNOWN_GPUS if device.type == "cuda" and re.search(pattern, name)), None)
    flops = tflops if tflops is not None else (known[0] if known else None)
    bandwidth = bandwidth_tb_s if bandwidth_tb_s is not None else (known[1] if known else None)
    overridden = tflops is not None or bandwidth_tb_s is not None
    source = "--peak-tflops/--peak-bandwidth" if overridden else ("datasheet" if known else "unknown")
    return DevicePeaks(
        name=name,
        flops=flops * 1e12 if flops is not None else None,
        bandwidth=bandwidth * 1e12 if bandwidth is not None else None,
        source=source,
    )


# ----------------------------------------------------------------------------------------------------------------
# Decoder-only models (LlamaConfig, MixtralConfig and archlab's DecoderConfig share these field names)
# ----------------------------------------------------------------------------------------------------------------
def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def decoder_layer_weights(config) -> tuple[int, int]:
    """(matmul weights a token uses in one layer, of which routed-expert weights). A gated MLP (SwiGLU: gate, up,
    down) of `intermediate_size`, or k of `num_local_experts` such experts plus the router."""
    h, hd = config.hidden_size, _head_dim(config)
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    attention = h * hd * (heads + 2 * kv) + heads * hd * h
    experts = getattr(config, "num_local_experts", None) or 0
    mlp = 3 * h * config.intermediate_size
    if experts:
        routed = config.num_experts_per_tok * mlp
        return attention + routed + h * experts, routed
    return attention + mlp, 0


def decoder_weights_per_token(config) -> int:
    """Matmul weights one token uses: every layer's (routed experts: only its k) and the LM head."""
    per_layer, _ = decoder_layer_weights(config)
    return config.num_hidden_layers * per_layer + config.hidden_size * config.vocab_size


def decoder_training_flops(config, batch: int, seq_len: int) -> float:
    """Model FLOPs of one training step (forward + backward) over `batch` sequences of `seq_len` tokens."""
    tokens = batch * seq_len
    attention = 12 * config.num_hidden_layers * config.num_attention_heads * _head_dim(config) * seq_len
    return tokens * (6 * decoder_weights_per_token(config) + attention)


def decoder_forward_flops(config, batch: int, seq_len: int, logits_positions: int | None = None) -> float:
    """Model FLOPs of one forward pass (a prefill); the LM head runs on `logits_positions` per sequence (None: all,
    1: the last only, as `generate` does)."""
    head = config.hidden_size * config.vocab_size
    body = decoder_weights_per_token(config) - head
    attention = 4 * config.num_hidden_layers * config.num_attention_heads * _head_dim(config) * seq_len
    positions = seq_len if logits_positions is None else logits_positions
    return batch * (seq_len * (2 * body + attention) + positions * 2 * head)


def decode_roofline_seconds(
    config, peaks: DevicePeaks, batch: int, prompt: int, new_tokens: int, bytes_per_value: int = 2
) -> float | None:
    """The least time greedy decoding can take: the prompt's forward pass, then one step per further token, each
    bounded by the bytes it must read (the weights it uses once, each sequence's KV cache) and by its FLOPs. None
    when a peak is unknown. With a mixture of experts, a step reads the experts its batch is routed to: with uniform
    routing, K · (1 − (1 − k/K)^batch) of K per layer."""
    if peaks.flops is None or peaks.bandwidth is None:
        return None
    layers, hd = config.num_hidden_layers, _head_dim(config)
    per_layer, routed = decoder_layer_weights(config)
    experts = getattr(config, "num_local_experts", None) or 0
    weights = layers * per_layer + config.hidden_size * config.vocab_size
    if experts:
        touched = experts * (1 - (1 - config.num_experts_per_tok / experts) ** batch)
        weights += layers * routed * (touched / config.num_experts_per_tok - 1)
    kv_per_layer_position = 2 * config.num_key_value_heads * hd * bytes_per_value
    seconds = max(
        weights * bytes_per_value / peaks.bandwidth, decoder_forward_flops(config, batch, prompt, 1) / peaks.flops
    )
    for context in range(prompt + 1, prompt + new_tokens):
        attended = attended_positions(config, context)  # summed over the layers
        read = weights * bytes_per_value + batch * kv_per_layer_position * attended
        flops = batch * (2 * decoder_weights_per_token(config) + 4 * config.num_attention_heads * hd * attended)
        seconds += max(read / peaks.bandwidth, flops / peaks.flops)
    return seconds


def attended_positions(config, context: int) -> int:
    """Positions a one-token step at sequence length `context` must read, summed over the layers: `context` for a
    full-attention layer, at most `sliding_window` for a sliding one (`layer_types`, Mistral / Gemma 2; a config
    with a window and no layer types slides in every layer)."""
    window = getattr(config, "sliding_window", None)
    kinds = getattr(config, "layer_types", None) or ["sliding_attention" if window else "full_attention"] * (
        config.num_hidden_layers
    )
    return sum(min(context, window) if kind == "sliding_attention" and window else context for kind in kinds)


# ----------------------------------------------------------------------------------------------------------------
# Encoder-decoder models (MarianConfig / BartConfig names, which archlab's Seq2SeqConfig shares)
# ----------------------------------------------------------------------------------------------------------------
def seq2seq_weights(config) -> dict[str, int]:
    """Matmul weights per token: `encoder` per source token, `cross_kv` per source token (each decoder layer's
    cross-attention keys and values), `decoder` per target token (self-attention, cross-attention queries and
    output, MLP, LM head)."""
    d = config.d_model
    return {
        "encoder": config.encoder_layers * (4 * d * d + 2 * d * config.encoder_ffn_dim),
        "cross_kv": config.decoder_layers * 2 * d * d,
        "decoder": config.decoder_layers * (6 * d * d + 2 * d * config.decoder_ffn_dim) + d * config.vocab_size,
    }


def seq2seq_training_flops(config, batch: int, source_len: int, target_len: int) -> float:
    """Model FLOPs of one training step: 6 per weight per token it sees, plus encoder self-attention, decoder
    self-attention and cross-attention (12 · d per query-key pair)."""
    w, d = seq2seq_weights(config), config.d_model
    weights = (w["encoder"] + w["cross_kv"]) * source_len + w["decoder"] * target_len
    pairs = config.encoder_layers * source_len**2 + config.decoder_layers * (target_len**2 + target_len * source_len)
    return batch * (6 * weights + 12 * d * pairs)


def beam_search_roofline_seconds(
    config, peaks: DevicePeaks, batch: int, beams: int, source_len: int, new_tokens: int, bytes_per_value: int = 2
) -> float | None:
    """The least time beam search can take: the encoder pass, then one decoder step per token for batch × beams
    sequences, each step reading the decoder's weights once and every sequence's self- and cross-attention cache."""
    if peaks.flops is None or peaks.bandwidth is None:
        return None
    w, d, layers = seq2seq_weights(config), config.d_model, config.decoder_layers
    encoder_flops = (
        batch * source_len * (2 * (w["encoder"] + w["cross_kv"]) + 4 * config.encoder_layers * d * source_len)
    )
    encoder_bytes = (w["encoder"] + w["cross_kv"]) * bytes_per_value
    seconds = max(encoder_bytes / peaks.bandwidth, encoder_flops / peaks.flops)
    sequences = batch * beams
    for context in range(1, new_tokens + 1):
        read = w["decoder"] * bytes_per_value + sequences * 2 * layers * d * (context + source_len) * bytes_per_value
        flops = sequences * (2 * w["decoder"] + 4 * layers * d * (context + source_len))
        seconds += max(read / peaks.bandwidth, flops / peaks.flops)
    return seconds
