"""Attention sinks: a learned logit per head in the softmax's denominator (GPT-OSS, OpenAI 2025; after Xiao et al.
2024, "Efficient Streaming Language Models with Attention Sinks", whose sink is the first token instead).

Head h's weights become exp(s_j) / (Σ_j exp(s_j) + exp(σ_h)): the sink's score σ_h (`self_attn.sinks`, shape (H,),
trained) takes a share of the attention whose value is zero, so a head can attend to next to nothing, where a plain
softmax must spread a whole unit of weight over the keys. The eager function writes it out as one more column of
scores (attention.py, `eager_attention_forward`, as transformers' GPT-OSS does).

SDPA has no such term; `sink_sdpa` gives it one, exactly, as one more key. The queries get one more channel holding
σ_h / scale, every key a zero there, and a last key is added whose channels are zero but that one, which is 1: its
score q'·k'·scale is σ_h for every query of head h, whatever the query, and its value is zero. The sink key is the
same for every head, so a decoding step's query heads regroup per KV head (as transformers' SDPA function regroups
them: the cache read once); longer queries take the keys repeated per query head, as transformers' SDPA function does
under a mask. The mask gets a column that shows the sink to every query (SDPA's own `is_causal` would hide a last key
from all but the last query, so a causal mask is written out); channels are padded to a multiple of 8 (the fused
kernels' alignment; the values keep their size). Gradients reach σ_h through the queries' extra channel. Memory: the
padded copies of q and k (B · 2H · T · 8 values more) and an explicit boolean mask of (B, 1, T, S + 1), where
transformers' SDPA call could use `is_causal` — the memory-efficient kernel's instead of flash's on a GPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import create_position_bias_mask, repeat_kv

ALIGNMENT = 8  # channels of q and k padded to a multiple of this


def _visible_mask(
    attention_mask: torch.Tensor | None,
    position_bias: torch.Tensor | None,
    query: torch.Tensor,
    key: torch.Tensor,
    causal: bool,
) -> torch.Tensor | None:
    """The mask over the S keys as SDPA takes it (bool: True attends; float: added), a causal one written out where
    transformers left it to `is_causal` (as SDPA aligns it: query i sees keys 0 … i, the prompt at the start of the
    cache, any slots after it empty), the position bias folded in; None where every query sees every key."""
    q_len, k_len = query.shape[2], key.shape[2]
    mask = attention_mask[..., :k_len] if attention_mask is not None else None
    if mask is None and causal and q_len > 1:  # SDPA's `is_causal`, which transformers left it to: top-left aligned
        keys = torch.arange(k_len, device=query.device)
        queries = torch.arange(q_len, device=query.device)
        mask = (keys[None, :] <= queries[:, None]).view(1, 1, q_len, k_len)
    if position_bias is not None:
        mask = create_position_bias_mask(position_bias, mask, False, query, key)
    return mask


def _with_sink_column(mask: torch.Tensor) -> torch.Tensor:
    """`mask` (…, T, S) with a last column that shows the sink key to every query."""
    shown = torch.ones if mask.dtype == torch.bool else torch.zeros
    column = shown((*mask.shape[:-1], 1), dtype=mask.dtype, device=mask.device)
    return torch.cat([mask, column], dim=-1)


def sink_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    sinks: torch.Tensor | None = None,
    position_bias: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """SDPA with attention sinks (module docstring): q (B, H, T, D), k/v (B, H_kv, S, D), `sinks` (H,) -> (B, T, H, D),
    equal to `eager_attention_forward(..., sinks=sinks)`. Grouped KV heads: a decoding step's query heads regrouped per
    KV head (the cache read once), longer queries over keys repeated per query head before the sink key joins them (a
    mask keeps SDPA's memory-efficient kernel from taking grouped heads, and repeated keys with the sink key appended
    keep their strides free of the length for torch.export)."""
    batch, heads, q_len, head_dim = query.shape
    kv_heads = key.shape[1]
    pad = ALIGNMENT - head_dim % ALIGNMENT  # at least one channel: the sink's
    causal = kwargs.get("is_causal")  # continuous batching passes its own
    causal = getattr(module, "is_causal", True) if causal is None else causal
    mask = _visible_mask(attention_mask, position_bias, query, key, causal)
    if mask is not None:
        mask = _with_sink_column(mask)
    regroup = q_len == 1 and kv_heads != heads
    if not regroup:
        key, value = repeat_kv(key, heads // kv_heads), repeat_kv(value, heads // kv_heads)
    sink_channel = (sinks.to(query.dtype) / scaling).view(1, heads, 1, 1).expand(batch, heads, q_len, 1)
    query = torch.cat([query, sink_channel, query.new_zeros(batch, heads, q_len, pad - 1)], dim=-1)
    sink_key = key.new_zeros(batch, key.shape[1], 1, head_dim + pad)
    sink_key[..., head_dim] = 1.0
    key = torch.cat([F.pad(key, (0, pad)), sink_key], dim=2)
    value = torch.cat([value, value.new_zeros(batch, value.shape[1], 1, value.shape[-1])], dim=2)
    if regroup:  # (B, H_kv, H / H_kv, D'): each KV head's query heads as its query positions
        query = query.reshape(batch, kv_heads, heads // kv_heads, head_dim + pad)
        if mask is not None and mask.shape[1] != 1:
            mask = mask.reshape(mask.shape[0], kv_heads, heads // kv_heads, mask.shape[-1])
    output = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling)
    return output.reshape(batch, heads, q_len, value.shape[-1]).transpose(1, 2).contiguous(), None


__all__ = ["sink_sdpa"]
