"""Multi-head attention (Vaswani et al. 2017) with grouped-query heads (Ainslie et al. 2023; seed 000 §5.2).

One class covers MHA (`num_key_value_heads == num_attention_heads`), GQA and MQA (`num_key_value_heads == 1`),
causal and bidirectional self-attention, and cross-attention (queries from the decoder, keys/values from the
encoder's output, computed once per sequence and kept in an `EncoderDecoderCache`, as Bart/Marian do). The kernel
is chosen through Hugging Face's attention interface (`config._attn_implementation`: "sdpa" by default, "eager",
or any registered backend); `eager_attention_forward` below is the readable reference every backend is tested
against.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn
from transformers.cache_utils import Cache, EncoderDecoderCache
from transformers.integrations.sdpa_attention import create_position_bias_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .attention_sinks import sink_sdpa
from .bitlinear import linear_class
from .continuous_batching import is_paged_cache
from .flex_decoding import flex_applies, flex_decode_attention
from .fused_projections import FusableProjections
from .normalization import PerHeadNorm, ScaleFreeRMSNorm, make_norm
from .rotary import apply_rotary
from .triton_decoding import decode_attention, triton_decoding_applies


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
    softcap: float | None = None,
    position_bias: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(cap(Q Kᵀ · scaling) + bias + mask) V, written out. Shapes: q (B, H, Tq, D), k/v (B, H_kv, Tk, D).

    `softcap` c maps scores to c · tanh(s / c) (Gemma2); `position_bias` (1 or B, H, Tq, Tk) is ALiBi or T5's bias;
    `sinks` (H,) are attention sinks' logits (GPT-OSS): one more score per head in the softmax's denominator, whose
    value is zero (the returned weights leave its column out, so a row sums to less than 1).
    """
    key = repeat_kv(key, module.num_key_value_groups)
    value = repeat_kv(value, module.num_key_value_groups)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling  # (B, H, Tq, Tk)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if position_bias is not None:
        scores = scores + position_bias
    if attention_mask is not None:  # additive float mask (0 / -inf-ish), broadcast over heads
        scores = scores + attention_mask[:, :, :, : key.shape[-2]]
    # at least float32 (half-precision scores), float64 kept: cast to float32, float64's mask value (finfo.min) was
    # -inf, and a padded query row masked whole gave NaN probabilities, which its values spread to the real rows
    softmax_dtype = torch.promote_types(scores.dtype, torch.float32)
    if sinks is not None:
        sink_column = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        probs = nn.functional.softmax(torch.cat([scores, sink_column], dim=-1), dim=-1, dtype=softmax_dtype)[..., :-1]
    else:
        probs = nn.functional.softmax(scores, dim=-1, dtype=softmax_dtype)
    probs = probs.to(query.dtype)
    probs = nn.functional.dropout(probs, p=dropout, training=module.training)
    output = torch.matmul(probs, value).transpose(1, 2).contiguous()  # (B, Tq, H, D)
    return output, probs


def one_token_grouped_sdpa(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    position_bias: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """SDPA for one query token per row with grouped key/value heads, the keys and values read once per KV head.

    A decoding step's queries (B, H, 1, D) are regrouped as (B, H_kv, H / H_kv, D): the query heads of one KV head
    become that head's "query positions", all attending to every key, so nothing is repeated. transformers' SDPA
    function does the same in eager mode but not under `torch.compile` — where its decoding steps repeat the whole
    cache once per query head of a group (`repeat_kv`): for a 1B Llama-shaped model with 8 query heads per KV head,
    16× its KV cache read and written per step, at batch 64 four times the weights' bytes. The mask, and ALiBi's or
    T5's bias (per head: regrouped the same way), are folded into one additive or boolean mask as transformers does.
    Returns (B, 1, H, D), as every attention function of the interface."""
    batch, heads, _, head_dim = query.shape
    kv_heads = key.shape[1]
    query = query.reshape(batch, kv_heads, heads // kv_heads, head_dim)
    mask = attention_mask
    if mask is not None and mask.shape[1] != 1:
        mask = mask.reshape(mask.shape[0], kv_heads, heads // kv_heads, mask.shape[-1])
    if position_bias is not None:
        bias = position_bias.reshape(position_bias.shape[0], kv_heads, heads // kv_heads, position_bias.shape[-1])
        mask = create_position_bias_mask(bias, mask, False, query, key)  # transformers' folding, not causal: 1 query
    output = nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling
    )
    return output.reshape(batch, 1, heads, head_dim), None


def grouped_queries_sdpa(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """SDPA without a causal structure (cross-attention) for queries (B, H, T, D) over grouped key/value heads
    (B, H_kv, S, D), the keys read once per KV head: as `one_token_grouped_sdpa`, with the query heads of a KV head
    and their T queries as that head's H / H_kv · T query rows. The mask (B, 1, T or 1, S) is shared by the heads.
    Returns (B, T, H, D)."""
    batch, heads, length, head_dim = query.shape
    kv_heads = key.shape[1]
    per_kv = heads // kv_heads
    query = query.reshape(batch, kv_heads, per_kv * length, head_dim)  # head k · per_kv + i, query t: row i · T + t
    mask = attention_mask
    if mask is not None and mask.shape[2] != 1:
        mask = mask.repeat(1, 1, per_kv, 1)
    output = nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling
    )
    return output.reshape(batch, heads, length, head_dim).transpose(1, 2), None


def cache_capacity(cache: Cache | None, layer_idx: int) -> int | None:
    """The most keys layer `layer_idx` of `cache` holds: a static layer's length; None for a dynamic cache."""
    layers = getattr(cache, "layers", None)
    if not layers or layer_idx is None or layer_idx >= len(layers):
        return None
    return getattr(layers[layer_idx], "max_cache_len", None)


def rows_per_source(cache: Cache | None) -> int:
    """How many consecutive rows of the batch share one source, whose cross-attention keys and values `cache` holds
    once (beam search's beams of a sentence: `EncoderDecoderCache.rows_per_source`, set by generate's static cache);
    1 for any other cache."""
    return getattr(cache, "rows_per_source", 1) if cache is not None else 1


def queries_per_source(query: torch.Tensor, mask: torch.Tensor | None, group: int):
    """Queries (B, H, T, D) of `group` rows per source as (B / group, H, group · T, D): each source's rows attend to
    its keys together, as one row of group · T queries (row r's query t at r · T + t). The mask (B, 1 or H, T or 1, S)
    of those rows is the same for each: the first row's, repeated over the group's queries."""
    batch, heads, length, head_dim = query.shape
    query = query.view(batch // group, group, heads, length, head_dim).transpose(1, 2)
    query = query.reshape(batch // group, heads, group * length, head_dim)
    if mask is not None:
        mask = mask[::group]
        if mask.shape[2] != 1:
            mask = mask.repeat(1, 1, group, 1)
    return query, mask


class Attention(FusableProjections, nn.Module):
    """Attention with separate q/k/v/o projections, named as in Llama (`q_proj`, ..., `o_proj`); inference reads
    q/k/v as one matrix where they are laid out side by side (`fused_projections.py`).

    Sizes default to the decoder config's fields (`hidden_size`, `num_attention_heads`, `num_key_value_heads`,
    `head_dim`, `attention_bias`, `qkv_bias`); the encoder-decoder passes its own (`d_model`,
    `encoder_attention_heads`, ...) and `output_name="out_proj"`, Marian/Bart's name for the output projection;
    `scaling` (T5: 1.0) and `norm_eps` (the QK-norm's epsilon) override the config's.
    QK-norm applies to cross-attention too (keys normalised before caching).
    """

    # RoPE on (B, H, T, D) queries and keys. An instance may carry a fused kernel with the same arguments and result
    # instead (archlab.liger sets Liger's); the class keeps the plain one, which is what saved models run.
    rotate = staticmethod(apply_rotary)
    fusable = ("q_proj", "k_proj", "v_proj")

    def __init__(
        self,
        config,
        layer_idx: int,
        is_causal: bool = True,
        *,
        hidden_size: int | None = None,
        num_attention_heads: int | None = None,
        num_key_value_heads: int | None = None,
        head_dim: int | None = None,
        bias: bool | None = None,
        output_name: str = "o_proj",
        scaling: float | None = None,
        norm_eps: float | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        hidden = hidden_size if hidden_size is not None else config.hidden_size
        self.num_heads = num_attention_heads if num_attention_heads is not None else config.num_attention_heads
        self.num_key_value_heads = (
            num_key_value_heads if num_key_value_heads is not None else config.num_key_value_heads
        )
        self.head_dim = head_dim if head_dim is not None else config.head_dim
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        # Catalogue variants, fixed at construction; configs without these fields get the plain attention.
        if getattr(config, "query_pre_attn_scalar", None) is not None:
            self.scaling = config.query_pre_attn_scalar**-0.5  # Gemma2
        if getattr(config, "attention_multiplier", None) is not None:
            self.scaling = float(config.attention_multiplier)  # Granite, μP
        if scaling is not None:
            self.scaling = scaling  # e.g. 1.0: T5's unscaled q·kᵀ
        self.softcap = getattr(config, "attn_logit_softcapping", None)
        layer_types = getattr(config, "layer_types", None)
        is_sliding = layer_types is not None and layer_types[layer_idx] == "sliding_attention"
        self.sliding_window = config.sliding_window if is_sliding else None  # the mask does it; flash reads it
        self.q_norm = self.k_norm = None
        # a NoPE layer of a model that rotates the others (`nope_layers`: SmolLM3, Llama 4)
        rotates = layer_idx not in (getattr(config, "nope_layers", None) or ())
        # Llama 4's temperature tuning: a NoPE layer's queries scaled up with the token's index (`temperature`)
        self.temperature = None
        if getattr(config, "attn_temperature_tuning", False) and not rotates:
            self.temperature = (float(config.floor_scale), float(config.attn_scale))
        # QK-norm (seed 004): over each head (Qwen3; with a gain per head, Command R+), or over the whole q / k
        # projection (OLMo 2: `qk_norm_scope`); without a gain (Llama 4), and left out of NoPE layers (Llama 4)
        self.qk_norm_per_head = self.qk_norm_over_projection = False
        self.qk_norm_after_rope = bool(getattr(config, "qk_norm_after_rope", False))
        if getattr(config, "use_qk_norm", False) and (rotates or getattr(config, "qk_norm_nope_layers", True)):
            self.qk_norm_over_projection = getattr(config, "qk_norm_scope", "head") == "projection"
            self.qk_norm_per_head = not self.qk_norm_over_projection
            eps = norm_eps if norm_eps is not None else config.rms_norm_eps
            norm_bias = getattr(config, "norm_bias", None)  # None: the norm's own default
            q_size, k_size = self.head_dim, self.head_dim
            if self.qk_norm_over_projection:
                q_size, k_size = self.num_heads * self.head_dim, self.num_key_value_heads * self.head_dim
            if not getattr(config, "qk_norm_weight", True):  # no gain (Llama 4's L2Norm)
                self.q_norm, self.k_norm = ScaleFreeRMSNorm(eps), ScaleFreeRMSNorm(eps)
            elif getattr(config, "qk_norm_scope", "head") == "per_head":  # a gain per head (Command R+): (H, D)
                self.q_norm = PerHeadNorm(config.norm_type, self.num_heads, self.head_dim, eps, norm_bias)
                self.k_norm = PerHeadNorm(config.norm_type, self.num_key_value_heads, self.head_dim, eps, norm_bias)
            else:
                self.q_norm = make_norm(config.norm_type, q_size, eps, norm_bias)
                self.k_norm = make_norm(config.norm_type, k_size, eps, norm_bias)
        self.attention_dropout = config.attention_dropout
        self.is_causal = is_causal
        bias = bias if bias is not None else config.attention_bias
        qkv_bias = getattr(config, "qkv_bias", None)  # Qwen2: q/k/v with a bias, the output projection without
        qkv_bias = bias if qkv_bias is None else qkv_bias
        linear = linear_class(config)  # nn.Linear, or BitNet's BitLinear (`bitlinear`)
        self.q_proj = linear(hidden, self.num_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = linear(hidden, self.num_key_value_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = linear(hidden, self.num_key_value_heads * self.head_dim, bias=qkv_bias)
        self.output_name = output_name
        self.add_module(output_name, linear(self.num_heads * self.head_dim, hidden, bias=bias))
        # Gated attention (AFMoE, Qwen3-Next): sigmoid(gate_proj(x)) times the heads' output, per channel or per head
        self.output_gate = getattr(config, "attention_output_gate", None)
        if self.output_gate is not None:
            gates = self.num_heads * self.head_dim if self.output_gate == "elementwise" else self.num_heads
            self.gate_proj = nn.Linear(hidden, gates, bias=False)
        # Sub-LN (Foundation Transformers, BitNet): a norm over the heads' output before the output projection
        self.attn_sub_norm = None
        if getattr(config, "sub_layer_norm", False):
            eps = norm_eps if norm_eps is not None else config.rms_norm_eps
            norm_bias = getattr(config, "norm_bias", None)
            self.attn_sub_norm = make_norm(config.norm_type, self.num_heads * self.head_dim, eps, norm_bias)
        # Attention sinks (GPT-OSS): a learned logit per head in the softmax's denominator (attention_sinks.py)
        self.sinks = nn.Parameter(torch.zeros(self.num_heads)) if getattr(config, "attention_sinks", False) else None

    def _project_self(self, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(B, T, d) -> queries (B, H, T, D), keys and values (B, H_kv, T, D): one product where laid out."""
        fused = self.fused_weights()
        if fused is None:
            return self.to_heads(self.q_proj(states), self.q_norm), *self._project_key_value(states)
        return self.split_heads(nn.functional.linear(states, *fused))

    def split_heads(self, projected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q/k/v's product (B, T, (H + 2 H_kv) D) -> queries (B, H, T, D), keys and values (B, H_kv, T, D) (views
        of the product, or of the QK-norm's output where it reads the whole projection)."""
        sizes = (self.num_heads * self.head_dim, *(2 * (self.num_key_value_heads * self.head_dim,)))
        query, key, value = projected.split(sizes, dim=-1)
        return self.to_heads(query, self.q_norm), self.to_heads(key, self.k_norm), self.to_heads(value)

    def to_heads(self, projection: torch.Tensor, norm: nn.Module | None = None) -> torch.Tensor:
        """A projection (B, T, n · D) -> its n heads (B, n, T, D), a view. With `qk_norm_scope="projection"` the
        q or k projection's QK-norm (`norm`) comes first, over a token's n · D channels as the projection lays them
        out (OLMo 2): one op, where normalising the heads would regroup them before and after."""
        if norm is not None and self.qk_norm_over_projection:
            projection = norm(projection)
        return projection.view(*projection.shape[:-1], -1, self.head_dim).transpose(1, 2)

    def position_and_cache(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None,
        past_key_values: Cache | None,
        attention_kwargs: dict | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Self-attention's heads (as `split_heads` makes them) -> the heads attended: QK-norm per head (over the
        projection, `to_heads` has applied it), RoPE (before the norm under `qk_norm_after_rope`), and the keys and
        values of the cache (this step's appended).
        Continuous batching's paged cache reads its indices from `attention_kwargs` (the keyword arguments the
        attention function gets next) and sets this layer type's own there, in place."""
        if self.qk_norm_per_head and not self.qk_norm_after_rope:
            query, key = self.q_norm(query), self.k_norm(key)
        query_scales = None
        if position_embeddings is not None:
            cos, sin, *query_scales = position_embeddings  # (a third: Mistral 3's query scales, `with_query_scales`)
            query, key = self.rotate(query, key, cos, sin)
        if self.qk_norm_per_head and self.qk_norm_after_rope:  # (Hunyuan, Llama 4)
            query, key = self.q_norm(query), self.k_norm(key)
        if query_scales:
            query = query * query_scales[0].to(query.dtype)
        if self.temperature is not None:
            query = self.tuned_temperature(query, past_key_values)
        if is_paged_cache(past_key_values):
            key, value = past_key_values.update(key, value, self.layer_idx, attention_kwargs)
        elif past_key_values is not None:
            key, value = past_key_values.update(key, value, self.layer_idx)
        return query, key, value

    def tuned_temperature(self, query: torch.Tensor, past_key_values: Cache | None) -> torch.Tensor:
        """Llama 4's temperature tuning of a NoPE layer's queries (B, H, T, D): query t times
        1 + attn_scale · log(1 + floor((p + 1) / floor_scale)), p = t + the tokens the layer's cache held before (the
        same p for every row, as transformers' Llama 4 counts it), rounded back to the queries' dtype."""
        floor_scale, attn_scale = self.temperature
        past = past_key_values.get_seq_length(self.layer_idx) if past_key_values is not None else 0
        positions = torch.arange(query.shape[2], device=query.device, dtype=torch.float32) + past
        scales = torch.log1p(torch.floor((positions + 1.0) / floor_scale)) * attn_scale + 1.0
        return (query * scales.view(1, 1, -1, 1)).to(query.dtype)

    def _project_key_value(self, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, S, d) -> keys, values (B, H_kv, S, D); the keys normed where QK-norm reads the whole projection."""
        return self.to_heads(self.k_proj(states), self.k_norm), self.to_heads(self.v_proj(states))

    def _cross_key_value(
        self, encoder_states: torch.Tensor, cache: EncoderDecoderCache | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values of the encoder output: projected at the first decoding step, then read back from the cache."""
        if cache is not None and cache.is_updated.get(self.layer_idx):
            layer = cache.cross_attention_cache.layers[self.layer_idx]
            return layer.keys, layer.values
        key, value = self._project_key_value(encoder_states)
        if self.qk_norm_per_head:
            key = self.k_norm(key)  # normalised once, before caching
        if cache is not None:
            key, value = cache.cross_attention_cache.update(key, value, self.layer_idx)
            cache.is_updated[self.layer_idx] = True
        return key, value

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
        past_key_values: Cache | None = None,
        key_value_states: torch.Tensor | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Self-attention, or cross-attention over `key_value_states` (B, S, d) when given; for cross-attention
        `past_key_values` is the `EncoderDecoderCache` (self-attention gets a plain per-layer cache)."""
        batch, seq_len, _ = hidden_states.shape
        group = 1
        if key_value_states is not None:
            query = self.to_heads(self.q_proj(hidden_states), self.q_norm)  # (B, H, T, D)
            group = rows_per_source(past_key_values)
            if group > 1:  # the source's keys cached once for its `group` rows: projected from its first row
                key_value_states = key_value_states[::group]
            key, value = self._cross_key_value(key_value_states, past_key_values)  # (B / group, H_kv, S, D)
            if self.qk_norm_per_head:
                query = self.q_norm(query)
            if group > 1:
                query, attention_mask = queries_per_source(query, attention_mask, group)
        else:
            query, key, value = self._project_self(hidden_states)  # (B, H, T, D), (B, H_kv, T, D) twice
            query, key, value = self.position_and_cache(query, key, value, position_embeddings, past_key_values, kwargs)
        cross = key_value_states is not None
        output, weights = self.attend_heads(
            query, key, value, attention_mask, past_key_values, cross=cross, group=group, **kwargs
        )
        # (B / group, group · T, H, D) for grouped rows: row-major, so the same memory as (B, T, H, D)
        output = output.reshape(batch, seq_len, -1)
        if self.output_gate is not None:
            output = self.gated(output, hidden_states)
        if self.attn_sub_norm is not None:
            output = self.attn_sub_norm(output)
        output = getattr(self, self.output_name)(output)
        return output, weights

    def gated(self, heads: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        """The heads' output (B, T, H · D) times sigmoid(gate_proj(hidden_states)): a gate per channel, or one per head
        (`attention_output_gate`)."""
        gate = torch.sigmoid(self.gate_proj(hidden_states))
        if self.output_gate == "elementwise":
            return heads * gate
        # (-1: this rank's heads under tensor parallelism, whose gates are split alike)
        return (heads.view(*heads.shape[:-1], -1, self.head_dim) * gate.unsqueeze(-1)).view(heads.shape)

    def attend_heads(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        past_key_values: Cache | None,
        cross: bool = False,
        group: int = 1,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The attention of the heads through the kernel that fits the call: (B, T, H, D) before the output
        projection, and the weights where the kernel returns them. `group` rows share one source (cross-attention)."""
        implementation = self.config._attn_implementation
        attention: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, eager_attention_forward)
        if implementation == "paged|eager":
            # continuous batching's eager backend: transformers' has no soft-cap; this one takes its packed mask as is
            attention = eager_attention_forward
        if self.sinks is not None:
            # attention sinks: written out (eager), as one more key (SDPA), else transformers' `s_aux` (flash, flex);
            # continuous batching's backends by the same kernel names
            kernel = implementation.split("|")[-1]
            sink_functions = {"eager": eager_attention_forward, "sdpa": sink_sdpa}
            attention = sink_functions.get(kernel, attention)
            kwargs = {**kwargs, ("sinks" if kernel in sink_functions else "s_aux"): self.sinks}
        if is_paged_cache(past_key_values):
            pass  # continuous batching: its packed row and keys go to the backend it chose, as in Llama
        elif (
            not cross
            and value.shape[-1] == query.shape[-1]
            and triton_decoding_applies(self, query, attention_mask, kwargs)
        ):
            # a decoding step: one Triton kernel (sinks too), the split of a row's keys set by the cache's capacity
            attention = functools.partial(decode_attention, capacity=cache_capacity(past_key_values, self.layer_idx))
        elif self.sinks is not None:
            pass  # attention sinks: the function chosen above
        elif not cross and value.shape[-1] == query.shape[-1] and flex_applies(self, query, attention_mask, kwargs):
            attention = flex_decode_attention  # a compiled decoding step: FlexAttention's split-KV kernel
        elif (
            self.num_key_value_groups > 1
            and query.shape[2] == 1
            and self.config._attn_implementation == "sdpa"
            and self.softcap is None  # transformers' SDPA refuses a soft-cap; so does the call below
        ):
            attention = one_token_grouped_sdpa  # a decoding step: the cache read once per KV head, compiled or not
        elif (
            group > 1
            and self.num_key_value_groups > 1
            and self.config._attn_implementation == "sdpa"
            and self.softcap is None
            and (attention_mask is None or attention_mask.shape[1] == 1)
        ):
            attention = grouped_queries_sdpa  # a source's beams and heads over its keys, read once per KV head
        output, weights = attention(
            self,
            query,
            key,
            value,
            attention_mask,
            dropout=self.attention_dropout if self.training else 0.0,
            scaling=self.scaling,
            softcap=self.softcap,
            sliding_window=self.sliding_window,
            **kwargs,
        )
        return output, weights
