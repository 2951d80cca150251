"""The encoder and decoder layers of archlab's encoder-decoder (Vaswani et al. 2017; seeds 000 §5.1, 001, 003).

    encoder layer:  self-attention (bidirectional) → FFN
    decoder layer:  masked self-attention → cross-attention over the encoder output → FFN

each sub-layer wrapped by the residual of `norm_position` (`RESIDUALS`: post-norm as the paper and Marian, pre-norm
as mBART and T5, sandwich). The FFN is fc2(act(fc1 x)), or gated fc2(act(a) ⊙ b) with [a, b] = fc1 x (`mlp_type`).
T5's options live here too: unscaled q·kᵀ with the scale folded into q's initialisation (`scale_attn_weights`),
a per-layer relative bias table (UMT5, `relative_attention_bias_per_layer`) and the fp16 clamp after every
residual add (`clamp_fp16_hidden_states`). Names are Marian's (`self_attn`, `out_proj`, `encoder_attn`, `fc1`,
`fc2`, `self_attn_layer_norm`, `encoder_attn_layer_norm`, `final_layer_norm`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from transformers.cache_utils import EncoderDecoderCache
from transformers.modeling_layers import GradientCheckpointingLayer

from .attention import Attention
from .configuration_seq2seq import Seq2SeqConfig
from .feed_forward import gated_activation, make_activation
from .normalization import make_norm
from .positions import position_bias


def stack_position_bias(config: Seq2SeqConfig, side: str) -> nn.Module | None:
    """The attention-score bias of `position_embedding_type` at a stack's head count: bidirectional in the encoder,
    causal in the decoder (T5's relative bias); None for the schemes without one."""
    return position_bias(
        config.position_embedding_type,
        getattr(config, f"{side}_attention_heads"),
        config.relative_attention_num_buckets,
        config.relative_attention_max_distance,
        bidirectional=side == "encoder",
    )


# ---- feed-forward: fc2(act(fc1 x)), or gated fc2(act(a) ⊙ b) with [a, b] = fc1 x --------------------------------


class GatedActivation(nn.Module):
    """act(a) ⊙ b over the two halves of the last dimension (GLU variants, Shazeer 2020: SwiGLU, GeGLU)."""

    def __init__(self, activation: str) -> None:
        super().__init__()
        self.activation = activation
        self.act_fn = make_activation(activation)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return gated_activation(self.activation, self.act_fn, *hidden_states.chunk(2, dim=-1))


# mlp_type -> (activation module factory, fc1 width multiplier)
FFN_ACTIVATIONS: dict[str, tuple[Callable[[str], nn.Module], int]] = {
    "plain": (make_activation, 1),
    "gated": (GatedActivation, 2),
}


# ---- residual wiring: where the norm sits around a sub-layer ----------------------------------------------------


def post_norm(x, sublayer, norm, output_norm, dropout):
    """LayerNorm(x + Dropout(sublayer(x))) — the paper and Marian."""
    out, weights = sublayer(x)
    return norm(x + dropout(out)), weights


def pre_norm(x, sublayer, norm, output_norm, dropout):
    """x + Dropout(sublayer(LayerNorm(x))) — mBART, T5 (stacks end with a final norm)."""
    out, weights = sublayer(norm(x))
    return x + dropout(out), weights


def sandwich_norm(x, sublayer, norm, output_norm, dropout):
    """x + Dropout(Norm_out(sublayer(Norm_in(x)))) — CogView, Gemma2."""
    out, weights = sublayer(norm(x))
    return x + dropout(output_norm(out)), weights


RESIDUALS: dict[str, Callable] = {"post": post_norm, "pre": pre_norm, "sandwich": sandwich_norm}


def additive_mask(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A boolean mask (True = attend) as an additive one (0 / finfo.min); None and additive masks pass unchanged."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)


def add_position_bias(mask: torch.Tensor | None, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """Fold an additive (1, H, Tq, Tk) position bias (T5) into an attention mask that is None, boolean or additive."""
    if bias is None:
        return mask
    bias = bias.to(dtype)
    if mask is None:
        return bias
    return additive_mask(mask, dtype) + bias


def clamp_fp16(hidden_states: torch.Tensor) -> torch.Tensor:
    """T5's fp16 guard (transformers' T5Block): if any fp16 hidden state overflowed to ±inf, clamp all of them to
    ±(finfo.max - 1000); otherwise the clamp at ±finfo.max changes nothing. The limit is chosen on the device by
    `torch.where`, so there is no host synchronisation (no `if tensor.any()`). Other dtypes pass unchanged."""
    if hidden_states.dtype != torch.float16:
        return hidden_states
    largest = torch.finfo(torch.float16).max
    limit = torch.where(torch.isinf(hidden_states).any(), largest - 1000, largest)
    return torch.clamp(hidden_states, min=-limit, max=limit)


def keep_hidden_states(hidden_states: torch.Tensor) -> torch.Tensor:
    return hidden_states


class _Seq2SeqLayer(GradientCheckpointingLayer):
    """What encoder and decoder layers share: the norms' factory, the residual wiring and the feed-forward."""

    def __init__(self, config: Seq2SeqConfig, ffn_dim: int, side: str) -> None:
        super().__init__()
        self.config = config
        self.residual = RESIDUALS[config.norm_position]
        # applied after every residual add (T5's fp16 guard), or nothing
        self.clamp = clamp_fp16 if config.clamp_fp16_hidden_states else keep_hidden_states
        self.position_bias = None  # UMT5: this layer's own relative bias table
        if config.relative_attention_bias_per_layer:
            self.position_bias = stack_position_bias(config, side)
        self.dropout = nn.Dropout(config.dropout)
        activation, width = FFN_ACTIVATIONS[config.mlp_type]
        self.fc1 = nn.Linear(config.d_model, width * ffn_dim, bias=config.mlp_bias)
        self.activation_fn = activation(config.activation_function)
        self.activation_dropout = nn.Dropout(config.activation_dropout)
        self.fc2 = nn.Linear(ffn_dim, config.d_model, bias=config.mlp_bias)
        self.final_layer_norm = self.make_norm()
        self.final_output_layer_norm = self.make_output_norm()

    def make_norm(self) -> nn.Module:
        return make_norm(self.config.norm_type, self.config.d_model, self.config.layer_norm_eps)

    def make_output_norm(self) -> nn.Module:
        """The second norm of a sandwich; nothing otherwise."""
        return self.make_norm() if self.config.norm_position == "sandwich" else nn.Identity()

    def feed_forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, None]:
        hidden_states = self.activation_dropout(self.activation_fn(self.fc1(hidden_states)))
        return self.fc2(hidden_states), None

    def add_own_bias(self, mask: torch.Tensor | None, buckets: torch.Tensor | None, dtype: torch.dtype):
        """UMT5: this layer's bias (looked up at the stack's bucket ids) added to the self-attention mask."""
        if self.position_bias is None:
            return mask
        return add_position_bias(mask, self.position_bias.lookup(buckets), dtype)


def seq2seq_attention(config: Seq2SeqConfig, side: str, layer_idx: int, is_causal: bool) -> Attention:
    """An attention module of the `side` ("encoder" / "decoder") stack, with Marian's names and T5's options."""
    heads = getattr(config, f"{side}_attention_heads")
    attention = Attention(
        config,
        layer_idx,
        is_causal=is_causal,
        hidden_size=config.d_model,
        num_attention_heads=heads,
        num_key_value_heads=getattr(config, f"{side}_key_value_heads"),
        head_dim=config.d_kv or config.d_model // heads,  # T5's d_kv may differ from d_model / heads
        bias=config.attention_bias,
        output_name="out_proj",
        scaling=None if config.scale_attn_weights else 1.0,  # T5: scores = q·kᵀ
        norm_eps=config.layer_norm_eps,
    )
    if not config.scale_attn_weights:
        # T5 folds 1/sqrt(head size) into q's initialisation: the same initial scores as scaled attention
        attention.q_proj.init_std = config.init_std * attention.head_dim**-0.5
    return attention


class Seq2SeqEncoderLayer(_Seq2SeqLayer):
    def __init__(self, config: Seq2SeqConfig, layer_idx: int) -> None:
        super().__init__(config, config.encoder_ffn_dim, "encoder")
        self.self_attn = seq2seq_attention(config, "encoder", layer_idx, is_causal=False)
        self.self_attn_layer_norm = self.make_norm()
        self.self_attn_output_layer_norm = self.make_output_norm()

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_buckets: torch.Tensor | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        attention_mask = self.add_own_bias(attention_mask, position_buckets, hidden_states.dtype)
        hidden_states, weights = self.residual(
            hidden_states,
            lambda h: self.self_attn(h, attention_mask=attention_mask, **kwargs),
            self.self_attn_layer_norm,
            self.self_attn_output_layer_norm,
            self.dropout,
        )
        hidden_states = self.clamp(hidden_states)
        hidden_states, _ = self.residual(
            hidden_states, self.feed_forward, self.final_layer_norm, self.final_output_layer_norm, self.dropout
        )
        return self.clamp(hidden_states), weights


class Seq2SeqDecoderLayer(_Seq2SeqLayer):
    def __init__(self, config: Seq2SeqConfig, layer_idx: int) -> None:
        super().__init__(config, config.decoder_ffn_dim, "decoder")
        self.self_attn = seq2seq_attention(config, "decoder", layer_idx, is_causal=True)
        self.self_attn_layer_norm = self.make_norm()
        self.self_attn_output_layer_norm = self.make_output_norm()
        self.encoder_attn = seq2seq_attention(config, "decoder", layer_idx, is_causal=False)
        self.encoder_attn.fusable = ()  # its queries and its keys/values read different inputs: nothing to fuse
        self.encoder_attn_layer_norm = self.make_norm()
        self.encoder_attn_output_layer_norm = self.make_output_norm()

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        past_key_values: EncoderDecoderCache | None = None,
        position_buckets: torch.Tensor | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        self_cache = past_key_values.self_attention_cache if past_key_values is not None else None
        attention_mask = self.add_own_bias(attention_mask, position_buckets, hidden_states.dtype)
        hidden_states, self_weights = self.residual(
            hidden_states,
            lambda h: self.self_attn(h, attention_mask=attention_mask, past_key_values=self_cache, **kwargs),
            self.self_attn_layer_norm,
            self.self_attn_output_layer_norm,
            self.dropout,
        )
        hidden_states = self.clamp(hidden_states)
        hidden_states, cross_weights = self.residual(
            hidden_states,
            lambda h: self.encoder_attn(
                h,
                key_value_states=encoder_hidden_states,
                attention_mask=encoder_attention_mask,
                past_key_values=past_key_values,
                **kwargs,
            ),
            self.encoder_attn_layer_norm,
            self.encoder_attn_output_layer_norm,
            self.dropout,
        )
        hidden_states = self.clamp(hidden_states)
        hidden_states, _ = self.residual(
            hidden_states, self.feed_forward, self.final_layer_norm, self.final_output_layer_norm, self.dropout
        )
        return self.clamp(hidden_states), self_weights, cross_weights


__all__ = [
    "RESIDUALS",
    "Seq2SeqDecoderLayer",
    "Seq2SeqEncoderLayer",
    "add_position_bias",
    "additive_mask",
    "seq2seq_attention",
    "stack_position_bias",
]
