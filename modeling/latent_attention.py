"""Multi-head latent attention (MLA; DeepSeek-V2, DeepSeek-AI 2024, §2.1; DeepSeek-V3, Kimi K2).

Keys and values come from one low-rank latent per token instead of per-head projections: `kv_a_proj_with_mqa` maps
the hidden state to a latent c of `kv_lora_rank` channels (RMS-normed by `kv_a_layernorm`) and one rotary key k_R of
`qk_rope_head_dim` channels that every head shares; `kv_b_proj` expands c to each head's key without positions
(`qk_nope_head_dim`) and its value (`v_head_dim`). A head's key is [k_nope; k_R], its query [q_nope; q_R] from
`q_proj`, or through a low-rank query latent (`q_a_proj`, `q_a_layernorm`, `q_b_proj`) with `q_lora_rank`. RoPE rotates
the `qk_rope_head_dim` channels only: the config's `head_dim` is that rotary size (as DeepSeek-V3's config sets it), so
the model's rotary embedding serves MLA unchanged. Scores are scaled by (qk_nope + qk_rope)^-½, times YaRN's mscale²
where `rope_parameters` has `mscale_all_dim` (DeepSeek-V3's long-context recipe).

The cache holds the latent and the rotary key (the "keys" and "values" of a one-head cache layer: kv_lora_rank +
qk_rope channels a token, where per-head keys and values would take heads × (qk_nope + qk_rope + v)), as transformers'
DeepSeek-V3 caches them. A forward expands the cached latents with `kv_b_proj` and attends through the config's
backend (eager, SDPA, flex, flash) like `attention.Attention`, whose kernel choice it shares — except a decoding step
under SDPA without gradients, which attends over the latents themselves with `kv_b_proj` absorbed into its queries and
outputs (`_absorbed`, DeepSeek-V2 §2.1.2; transformers expands the whole cache every step): measured on the development
CPU (fp32, one layer of 16 heads, kv_lora_rank 512, 2,048 cached tokens) 9.5 against 96.4 ms a step, 10.2x, outputs
equal to 2e-8. Parameter names are transformers' DeepSeek-V3 names.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from transformers.cache_utils import Cache

from .attention import Attention
from .normalization import make_norm
from .rotary import apply_rotary


def yarn_mscale(rope_parameters: dict, scaling: float) -> float:
    """`scaling` times YaRN's mscale², 0.1 · mscale_all_dim · ln(factor) + 1 squared, where `rope_parameters` is a
    scaled rope type with `mscale_all_dim` (DeepSeek-V3's attention scale); `scaling` as it is otherwise."""
    all_dim = (
        rope_parameters.get("mscale_all_dim", 0) if rope_parameters.get("rope_type", "default") != "default" else 0
    )
    factor = rope_parameters.get("factor", 1.0)
    if not all_dim or factor <= 1:
        return scaling
    mscale = 0.1 * all_dim * math.log(factor) + 1.0
    return scaling * mscale * mscale


class LatentAttention(nn.Module):
    """MLA (module docstring) with the interface of `attention.Attention`: (hidden_states, position_embeddings,
    attention_mask, past_key_values) -> (output before the residual, weights)."""

    # the kernel choice (eager / SDPA / flex / flash, and which decoding fast paths apply): Attention's own
    attend_heads = Attention.attend_heads
    rotate = staticmethod(apply_rotary)
    output_name = "o_proj"

    def __init__(self, config, layer_idx: int, is_causal: bool = True) -> None:
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.is_causal = is_causal
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = self.num_heads  # each head's key and value, expanded from the shared latent
        self.num_key_value_groups = 1
        self.q_lora_rank, self.kv_lora_rank = config.q_lora_rank, config.kv_lora_rank
        self.qk_nope_head_dim, self.qk_rope_head_dim = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.v_head_dim = config.v_head_dim
        self.qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        self.scaling = yarn_mscale(config.rope_parameters or {}, self.qk_head_dim**-0.5)
        self.softcap = getattr(config, "attn_logit_softcapping", None)
        layer_types = getattr(config, "layer_types", None)
        is_sliding = layer_types is not None and layer_types[layer_idx] == "sliding_attention"
        self.sliding_window = config.sliding_window if is_sliding else None
        self.attention_dropout = config.attention_dropout
        self.sinks = self.output_gate = None  # (Attention's variants that attend_heads reads)
        hidden, bias = config.hidden_size, config.attention_bias
        eps = config.rms_norm_eps
        if self.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, self.num_heads * self.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = make_norm("rms_norm", self.q_lora_rank, eps)
            self.q_b_proj = nn.Linear(self.q_lora_rank, self.num_heads * self.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.kv_lora_rank + self.qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = make_norm("rms_norm", self.kv_lora_rank, eps)
        self.kv_b_proj = nn.Linear(
            self.kv_lora_rank, self.num_heads * (self.qk_nope_head_dim + self.v_head_dim), bias=False
        )
        self.o_proj = nn.Linear(self.num_heads * self.v_head_dim, hidden, bias=bias)

    def fused_weights(self) -> None:
        """No q/k/v product to lay out side by side (fused_projections.py): MLA's projections differ in kind."""
        return None

    def _check_cache_layer(self, cache: Cache) -> None:
        """A cache layer allocated before the first update must have the latents' shape: transformers' ExecuTorch
        recipe sizes every layer as `num_key_value_heads` heads of `head_dim` keys and values alike (a clear error,
        not a failed copy inside the cache)."""
        layers = getattr(cache, "layers", None)
        layer = layers[self.layer_idx] if layers is not None and self.layer_idx < len(layers) else None
        keys = getattr(layer, "keys", None) if getattr(layer, "is_initialized", False) else None
        if isinstance(keys, torch.Tensor) and keys.dim() == 4 and tuple(keys.shape[1::2]) != (1, self.kv_lora_rank):
            raise ValueError(
                f"This cache's layer {self.layer_idx} was allocated for keys of {keys.shape[1]} heads of "
                f"{keys.shape[-1]} channels, but multi-head latent attention caches one latent of "
                f"`kv_lora_rank`={self.kv_lora_rank} channels and one rotary key a token: let the cache allocate its "
                "layers at their first update (`generate`'s static cache does; transformers' ExecuTorch recipe sizes "
                "them from the config first)."
            )

    def _queries(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """(B, T, d) -> (B, H, T, qk_nope + qk_rope)."""
        if self.q_lora_rank is None:
            projected = self.q_proj(hidden_states)
        else:
            projected = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        return projected.view(*hidden_states.shape[:-1], -1, self.qk_head_dim).transpose(1, 2)

    def _expand(self, latent: torch.Tensor, rotary_key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The cached latents (B, 1, S, kv_lora_rank) and rotary keys (B, 1, S, qk_rope) -> each head's keys
        (B, H, S, qk_nope + qk_rope) and values (B, H, S, v)."""
        batch, _, length, _ = latent.shape
        expanded = self.kv_b_proj(latent).view(batch, length, -1, self.qk_nope_head_dim + self.v_head_dim)
        key_nope, value = expanded.transpose(1, 2).split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        key = torch.cat([key_nope, rotary_key.expand(-1, key_nope.shape[1], -1, -1)], dim=-1)
        return key, value

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
        past_key_values: Cache | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        batch, length, _ = hidden_states.shape
        query_nope, query_rot = self._queries(hidden_states).split([self.qk_nope_head_dim, self.qk_rope_head_dim], -1)
        latent, rotary_key = self.kv_a_proj_with_mqa(hidden_states).split(
            [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1
        )
        latent = self.kv_a_layernorm(latent).view(batch, 1, length, self.kv_lora_rank)
        rotary_key = rotary_key.view(batch, 1, length, self.qk_rope_head_dim)
        if position_embeddings is not None:
            query_rot, rotary_key = self.rotate(query_rot, rotary_key, *position_embeddings)
        if past_key_values is not None:  # the cache holds the latents (module docstring)
            self._check_cache_layer(past_key_values)
            latent, rotary_key = past_key_values.update(latent, rotary_key, self.layer_idx)
        if self._absorbs(query_rot, kwargs):
            output, weights = self._absorbed(query_nope, query_rot, latent, rotary_key, attention_mask), None
        else:
            key, value = self._expand(latent, rotary_key)
            query = torch.cat([query_nope, query_rot], dim=-1)
            output, weights = self.attend_heads(query, key, value, attention_mask, past_key_values, **kwargs)
        return self.o_proj(output.reshape(batch, length, -1)), weights

    def _absorbs(self, query_rot: torch.Tensor, kwargs: dict) -> bool:
        """Whether this forward attends over the latents themselves (`_absorbed`): a decoding step (one query a row)
        without gradients through SDPA, with no soft-cap and no position bias (static checks: no data read)."""
        return (
            query_rot.shape[2] == 1
            and not (torch.is_grad_enabled() and (query_rot.requires_grad or self.training))
            and self.config._attn_implementation == "sdpa"
            and self.softcap is None
            and kwargs.get("position_bias") is None
        )

    def _absorbed(
        self,
        query_nope: torch.Tensor,
        query_rot: torch.Tensor,
        latent: torch.Tensor,
        rotary_key: torch.Tensor,
        attention_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """A decoding step's attention over the cached latents, `kv_b_proj` absorbed (DeepSeek-V2 §2.1.2): a head's
        score q_nope · (W_UK c) + q_R · k_R is (q_nope W_UK) · c + q_R · k_R, and its output Σ p (W_UV c) is
        W_UV (Σ p c). So the queries move into the latent space once, every head attends to the same keys
        [c; k_R] and values c (one KV head: the heads regroup as its query positions), and the heads' outputs leave
        it once: per step ~heads · (kv_lora_rank + qk_rope) per cached token where expanding the cache with
        `kv_b_proj` costs kv_lora_rank · heads · (qk_nope + v) — at DeepSeek-V3's sizes ~60x fewer FLOPs, and no
        expanded keys and values written. The same result up to the sums' order. Returns (B, 1, H · v)."""
        batch, heads = query_nope.shape[:2]
        weight = self.kv_b_proj.weight.view(heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
        absorb_key, absorb_value = weight.split([self.qk_nope_head_dim, self.v_head_dim], dim=1)
        query = torch.cat([torch.matmul(query_nope, absorb_key), query_rot], dim=-1)  # (B, H, 1, rank + rope)
        key = torch.cat([latent, rotary_key], dim=-1)  # (B, 1, S, rank + rope)
        mask = attention_mask[..., : key.shape[2]] if attention_mask is not None else None  # (B or 1, 1, 1, S)
        output = nn.functional.scaled_dot_product_attention(
            query.transpose(1, 2), key, latent, attn_mask=mask, scale=self.scaling
        )  # (B, 1, H, rank): the heads as the single KV head's query positions
        heads_out = torch.matmul(output.transpose(1, 2), absorb_value.transpose(1, 2))  # (B, H, 1, v)
        return heads_out.transpose(1, 2).reshape(batch, 1, -1)


__all__ = ["LatentAttention", "yarn_mscale"]
