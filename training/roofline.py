"""What a GPU benchmark row is measured against: the model FLOPs of a step (for MFU), the fewest bytes a decode step
must read (for the bandwidth roofline), and the peak rates of known GPUs.

FLOPs follow PaLM's accounting (Chowdhery et al. 2022, appendix B, "model FLOPs utilization"): a matmul weight
costs 2 FLOPs per token forward and 6 per trained token (forward + backward), and attention adds 4 · L · d_attn · T
FLOPs per token forward (QKᵀ and the weighted sum of V over T positions; 12 · L · d_attn · T in training), counted
over the whole T × T score matrix as PaLM counts it (causal masking is not subtracted). d_attn is the query width,
heads × head_dim. A sliding-window layer's T is its window where the window is shorter (the keys its last query
spans, as the decode roofline reads them). Embedding lookups are gathers and cost nothing; the LM head is a matmul
and counts. A mixture-of-experts layer counts the k experts a token is routed to (of `moe_intermediate_size`), its
router and its shared expert; dense layers (`mlp_layer_types`) their MLP; a plain MLP (`mlp_type="plain"`) two
matrices, a gated one three. Recomputation (gradient checkpointing) is not model FLOPs. MFU = model FLOPs / seconds
/ peak dense bf16 FLOP/s.

A decode step cannot be faster than reading each weight it uses once plus each sequence's KV cache once (bytes /
peak bandwidth), nor than its FLOPs at the peak rate; its roofline is the larger of the two, and a generation's is
the sum over its steps (the prompt's forward pass first); a sliding-window layer's step reads at most its window of
the cache. Beam search's cross-attention keys and values are the same for every beam of a source: read once per
source, not per beam. With batch 1 of a dense model that is the weights' bytes per token: 2.2 GB at ~3 TB/s allows
~1,400 tokens/s for a 1.1B model in bf16.
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
    (r"\bH200\b.*\bNVL\b", 835.0, 4.8),
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
    # A MIG slice ("NVIDIA H100 80GB HBM3 MIG 1g.10gb") has a share of the chip's SMs and memory bandwidth: the
    # whole chip's datasheet row would understate its MFU several times, so it has none (the overrides still apply).
    mig = device.type == "cuda" and re.search(r"\bMIG\b", name) is not None
    known = next(
        ((t, b) for pattern, t, b in KNOWN_GPUS if device.type == "cuda" and not mig and re.search(pattern, name)), None
    )
    flops = tflops if tflops is not None else (known[0] if known else None)
    bandwidth = bandwidth_tb_s if bandwidth_tb_s is not None else (known[1] if known else None)
    overridden = tflops is not None or bandwidth_tb_s is not None
    unknown = "unknown (a MIG slice)" if mig else "unknown"
    source = "--peak-tflops/--peak-bandwidth" if overridden else ("datasheet" if known else unknown)
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


def _latent(config) -> bool:
    """Multi-head latent attention (DeepSeek-V2/V3's `kv_lora_rank`)."""
    return getattr(config, "kv_lora_rank", None) is not None


def _attention_weights(config) -> int:
    """Matmul weights of one layer's attention: q/k/v/o of its heads; with latent attention the query's (through its
    own latent with `q_lora_rank`), the latents' (`kv_a_proj_with_mqa`), their expansion (`kv_b_proj`) and the
    output's."""
    h, heads = config.hidden_size, config.num_attention_heads
    if not _latent(config):
        hd, kv = _head_dim(config), config.num_key_value_heads
        return h * hd * (heads + 2 * kv) + heads * hd * h
    qk = config.qk_nope_head_dim + config.qk_rope_head_dim
    rank = getattr(config, "q_lora_rank", None)
    query = h * rank + rank * heads * qk if rank else h * heads * qk
    latents = h * (config.kv_lora_rank + config.qk_rope_head_dim)
    expansion = config.kv_lora_rank * heads * (config.qk_nope_head_dim + config.v_head_dim)
    return query + latents + expansion + heads * config.v_head_dim * h


def _attention_flops_per_key(config) -> int:
    """Forward FLOPs of one query and one key in one layer: 2 · heads · (query/key width + value width) — QKᵀ and the
    weighted sum of V (4 · heads · head_dim with equal widths)."""
    heads = config.num_attention_heads
    if _latent(config):
        return 2 * heads * (config.qk_nope_head_dim + config.qk_rope_head_dim + config.v_head_dim)
    return 4 * heads * _head_dim(config)


def _cache_values_per_position(config) -> int:
    """Values one layer's cache holds per position: a key and a value per KV head, or the latent and the shared
    rotary key (latent attention: what archlab caches)."""
    if _latent(config):
        return config.kv_lora_rank + config.qk_rope_head_dim
    return 2 * config.num_key_value_heads * _head_dim(config)


def _mlp_weights(config, width: int) -> int:
    """Matmul weights of one MLP of `width`: gate, up and down (gated, SwiGLU), or up and down (`mlp_type="plain"`)."""
    return (2 if getattr(config, "mlp_type", "gated") == "plain" else 3) * config.hidden_size * width


def _sparse_layers(config) -> list[bool]:
    """Per layer, whether its MLP is a mixture of experts: every layer of a config with experts (Mixtral), or those
    `mlp_layer_types` names "sparse" (archlab's DecoderConfig)."""
    if not getattr(config, "num_local_experts", None):
        return [False] * config.num_hidden_layers
    kinds = getattr(config, "mlp_layer_types", None)
    return [kind == "sparse" for kind in kinds] if kinds else [True] * config.num_hidden_layers


def decoder_layer_weights(config, sparse: bool | None = None) -> tuple[int, int]:
    """(matmul weights a token uses in one layer, of which routed-expert weights). A dense layer: an MLP of
    `intermediate_size`; a sparse one (`sparse`; None: whether the config has experts): k of `num_local_experts`
    experts of `moe_intermediate_size` (default `intermediate_size`), the router, and a shared expert of
    `shared_expert_intermediate_size` with its one-column gate where there is one."""
    h = config.hidden_size
    attention = _attention_weights(config)
    experts = getattr(config, "num_local_experts", None) or 0
    if not (experts if sparse is None else sparse):
        return attention + _mlp_weights(config, config.intermediate_size), 0
    width = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    routed = config.num_experts_per_tok * _mlp_weights(config, width)
    shared = getattr(config, "shared_expert_intermediate_size", None) or 0
    if shared:
        shared = _mlp_weights(config, shared) + (h if getattr(config, "shared_expert_gate", True) else 0)
    return attention + routed + h * experts + shared, routed


def decoder_stack_weights(config) -> tuple[int, int]:
    """(matmul weights one token uses over all layers, of which routed-expert weights)."""
    layers = [decoder_layer_weights(config, sparse) for sparse in _sparse_layers(config)]
    return sum(weights for weights, _ in layers), sum(routed for _, routed in layers)


def decoder_weights_per_token(config) -> int:
    """Matmul weights one token uses: every layer's (routed experts: only its k) and the LM head."""
    return decoder_stack_weights(config)[0] + config.hidden_size * config.vocab_size


def decoder_training_flops(config, batch: int, seq_len: int) -> float:
    """Model FLOPs of one training step (forward + backward) over `batch` sequences of `seq_len` tokens."""
    tokens = batch * seq_len
    attention = 3 * _attention_flops_per_key(config) * attended_positions(config, seq_len)
    return tokens * (6 * decoder_weights_per_token(config) + attention)


def decoder_forward_flops(config, batch: int, seq_len: int, logits_positions: int | None = None) -> float:
    """Model FLOPs of one forward pass (a prefill); the LM head runs on `logits_positions` per sequence (None: all,
    1: the last only, as `generate` does)."""
    head = config.hidden_size * config.vocab_size
    body = decoder_weights_per_token(config) - head
    attention = _attention_flops_per_key(config) * attended_positions(config, seq_len)
    positions = seq_len if logits_positions is None else logits_positions
    return batch * (seq_len * (2 * body + attention) + positions * 2 * head)


def decode_roofline_seconds(
    config, peaks: DevicePeaks, batch: int, prompt: int, new_tokens: int, bytes_per_value: int = 2
) -> float | None:
    """The least time greedy decoding can take: the prompt's forward pass, then one step per further token, each
    bounded by the bytes it must read (the weights it uses once, each sequence's KV cache) and by its FLOPs. None
    when a peak is unknown. With a mixture of experts, a pass over n tokens reads the experts they are routed to:
    with uniform routing, K · (1 − (1 − k/K)^n) of K per layer (n: the batch in a step, batch × prompt in the
    prompt's pass)."""
    if peaks.flops is None or peaks.bandwidth is None:
        return None
    stack, routed = decoder_stack_weights(config)

    def weights_read(tokens: int) -> float:
        """The weights a pass over `tokens` tokens reads: the routed experts they reach in place of k per layer."""
        weights = stack + config.hidden_size * config.vocab_size
        if routed:
            experts, k = config.num_local_experts, config.num_experts_per_tok
            weights += routed * (experts * (1 - (1 - k / experts) ** tokens) / k - 1)
        return weights

    weights = weights_read(batch)
    kv_per_layer_position = _cache_values_per_position(config) * bytes_per_value
    seconds = max(
        weights_read(batch * prompt) * bytes_per_value / peaks.bandwidth,
        decoder_forward_flops(config, batch, prompt, 1) / peaks.flops,
    )
    for context in range(prompt + 1, prompt + new_tokens):
        attended = attended_positions(config, context)  # summed over the layers
        read = weights * bytes_per_value + batch * kv_per_layer_position * attended
        flops = batch * (2 * decoder_weights_per_token(config) + _attention_flops_per_key(config) * attended)
        seconds += max(read / peaks.bandwidth, flops / peaks.flops)
    return seconds


def attended_positions(config, context: int) -> int:
    """Positions a one-token step at sequence length `context` must read, summed over the layers: `context` for a
    full-attention layer, at most `sliding_window` for a sliding one (`layer_types`, Mistral / Gemma 2; a config
    with a window and no layer types slides in every layer), at most `attention_chunk_size` for a chunked one (Llama
    4; its block can be shorter: this bounds it, as the window bounds a sliding layer's)."""
    window = getattr(config, "sliding_window", None)
    chunk = getattr(config, "attention_chunk_size", None)
    kinds = getattr(config, "layer_types", None) or ["sliding_attention" if window else "full_attention"] * (
        config.num_hidden_layers
    )
    spans = {"sliding_attention": window, "chunked_attention": chunk}
    return sum(min(context, spans[kind]) if spans.get(kind) else context for kind in kinds)


# ----------------------------------------------------------------------------------------------------------------
# Encoder-decoder models (MarianConfig / BartConfig names, which archlab's Seq2SeqConfig shares)
# ----------------------------------------------------------------------------------------------------------------
def seq2seq_widths(config, side: str) -> tuple[int, int]:
    """(query width heads × head_dim, key/value width kv_heads × head_dim) of `side`'s ("encoder" / "decoder")
    attention; a decoder's cross-attention has the decoder's. Marian/Bart: both d_model; archlab's Seq2SeqConfig
    also has GQA (`{side}_key_value_heads`) and T5's head size `d_kv`."""
    heads = getattr(config, f"{side}_attention_heads")
    kv_heads = getattr(config, f"{side}_key_value_heads", None) or heads
    head_dim = getattr(config, "d_kv", None) or config.d_model // heads
    return heads * head_dim, kv_heads * head_dim


def seq2seq_weights(config) -> dict[str, int]:
    """Matmul weights per token: `encoder` per source token, `cross_kv` per source token (each decoder layer's
    cross-attention keys and values), `decoder` per target token (self-attention, cross-attention queries and
    output, MLP, LM head). A plain FFN (Marian) has two matrices, a gated one (`mlp_type="gated"`) three."""
    d = config.d_model
    ffn = 3 if getattr(config, "mlp_type", "plain") == "gated" else 2
    (eq, ekv), (dq, dkv) = seq2seq_widths(config, "encoder"), seq2seq_widths(config, "decoder")
    vocab = getattr(config, "decoder_vocab_size", None) or config.vocab_size
    return {
        "encoder": config.encoder_layers * (2 * d * (eq + ekv) + ffn * d * config.encoder_ffn_dim),
        "cross_kv": config.decoder_layers * 2 * d * dkv,
        "decoder": config.decoder_layers * (2 * d * (2 * dq + dkv) + ffn * d * config.decoder_ffn_dim) + d * vocab,
    }


def seq2seq_training_flops(config, batch: int, source_len: int, target_len: int) -> float:
    """Model FLOPs of one training step: 6 per weight per token it sees, plus encoder self-attention, decoder
    self-attention and cross-attention (12 · query width per query-key pair)."""
    w = seq2seq_weights(config)
    eq, dq = seq2seq_widths(config, "encoder")[0], seq2seq_widths(config, "decoder")[0]
    weights = (w["encoder"] + w["cross_kv"]) * source_len + w["decoder"] * target_len
    attention = eq * config.encoder_layers * source_len**2
    attention += dq * config.decoder_layers * (target_len**2 + target_len * source_len)
    return batch * (6 * weights + 12 * attention)


def beam_search_roofline_seconds(
    config, peaks: DevicePeaks, batch: int, beams: int, source_len: int, new_tokens: int, bytes_per_value: int = 2
) -> float | None:
    """The least time beam search can take: the encoder pass, then one decoder step per token for batch × beams
    sequences, each step reading the decoder's weights once, every sequence's self-attention cache and each
    source's cross-attention keys and values once (its beams attend to the same ones)."""
    if peaks.flops is None or peaks.bandwidth is None:
        return None
    w, layers = seq2seq_weights(config), config.decoder_layers
    eq = seq2seq_widths(config, "encoder")[0]
    dq, dkv = seq2seq_widths(config, "decoder")
    encoder_attention = 4 * config.encoder_layers * eq * source_len
    encoder_flops = batch * source_len * (2 * (w["encoder"] + w["cross_kv"]) + encoder_attention)
    encoder_bytes = (w["encoder"] + w["cross_kv"]) * bytes_per_value
    seconds = max(encoder_bytes / peaks.bandwidth, encoder_flops / peaks.flops)
    sequences = batch * beams
    kv_per_layer_position = 2 * dkv * bytes_per_value
    cross = batch * layers * source_len * kv_per_layer_position
    for context in range(1, new_tokens + 1):
        read = w["decoder"] * bytes_per_value + sequences * layers * context * kv_per_layer_position + cross
        flops = sequences * (2 * w["decoder"] + 4 * layers * dq * (context + source_len))
        seconds += max(read / peaks.bandwidth, flops / peaks.flops)
    return seconds
