"""Multi-head attention (Vaswani et al. 2017) with grouped-query heads (Ainslie et al. 2023; seed 000 §5.2).

One class covers MHA (`num_key_value_heads == num_attention_heads`), GQA and MQA (`num_key_value_heads == 1`),
causal and bidirectional self-attention. The kernel is chosen through Hugging Face's attention interface
(`config._attn_implementation`: "sdpa" by default, "eager", or any registered backend); `eager_attention_forward`
below is the readable reference every backend is tested against.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from transformers.cache_utils import Cache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .rotary import apply_rotary


def repeat_kv(hidden_states: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(B, H_kv, T, D) -> (B, H_kv * n_rep, T, D): each key/value head serves `n_rep` query heads."""
    if n_rep == 1:
        return hidden_states
    batch, num_kv_heads, seq_len, head_dim = hidden_states.shape
    hidden_states = hidden_states[:, :, None].expand(batch, num_kv_heads, n_rep, seq_len, head_dim)
    return hidden_states.reshape(batch, num_kv_heads * n_rep, seq_len, head_dim)


def eager_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(Q Kᵀ · scaling + mask) V, written out. Shapes: q (B, H, Tq, D), k/v (B, H_kv, Tk, D)."""
    key = repeat_kv(key, module.num_key_value_groups)
    value = repeat_kv(value, module.num_key_value_groups)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling  # (B, H, Tq, Tk)
    if attention_mask is not None:  # additive float mask (0 / -inf-ish), broadcast over heads
        scores = scores + attention_mask[:, :, :, : key.shape[-2]]
    probs = nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    probs = nn.functional.dropout(probs, p=dropout, training=module.training)
    output = torch.matmul(probs, value).transpose(1, 2).contiguous()  # (B, Tq, H, D)
    return output, probs


class Attention(nn.Module):
    """Self-attention with separate q/k/v/o projections, named as in Llama (`q_proj`, ..., `o_proj`)."""

    def __init__(self, config, layer_idx: int, is_causal: bool = True) -> None:
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = is_causal
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_key_value_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_key_value_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
        past_key_values: Cache | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        batch, seq_len, _ = hidden_states.shape
        shape = (batch, seq_len, -1, self.head_dim)
        query = self.q_proj(hidden_states).view(shape).transpose(1, 2)  # (B, H, T, D)
        key = self.k_proj(hidden_states).view(shape).transpose(1, 2)  # (B, H_kv, T, D)
        value = self.v_proj(hidden_states).view(shape).transpose(1, 2)

        if position_embeddings is not None:
            cos, sin = position_embeddings
            query, key = apply_rotary(query, key, cos, sin)
        if past_key_values is not None:
            key, value = past_key_values.update(key, value, self.layer_idx)

        attention: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        output, weights = attention(
            self,
            query,
            key,
            value,
            attention_mask,
            dropout=self.attention_dropout if self.training else 0.0,
            scaling=self.scaling,
            **kwargs,
        )
        output = self.o_proj(output.reshape(batch, seq_len, -1))
        return output, weights
