"""archlab's encoder-decoder: `Seq2SeqModel` and `Seq2SeqForConditionalGeneration`.

The Transformer of "Attention Is All You Need" (Vaswani et al. 2017; seeds 000 §5.1, 001 "encoder-decoder",
003 "where cross-attention's keys and values come from"):

    encoder:  x = embed(src)·√d + PE  →  N × [ self-attention (bidirectional, source padding masked) → FFN ]
    decoder:  y = embed(tgt)·√d + PE  →  N × [ masked self-attention → cross-attention over the encoder's
              final output (source padding masked) → FFN ]  →  linear (tied to the embeddings) → softmax

each sub-layer wrapped as LayerNorm(x + Dropout(sublayer(x))) with the default post-norm; `norm_position` moves the
norm before the sub-layer ("pre", with a final norm per stack) or around it ("sandwich"). T5's relative bias is one
table per stack folded into the stack's mask once, or (UMT5, `relative_attention_bias_per_layer`) one table per layer
that each layer adds to the mask; `clamp_fp16_hidden_states` is T5's fp16 guard after every residual add.
Training is teacher forcing: `labels` are shifted right behind `decoder_start_token_id` to make the decoder input,
and the loss compares logits with the *unshifted* labels. Generation (greedy, sampling, beam search) runs through
`GenerationMixin` with an `EncoderDecoderCache`: the encoder runs once, every cross-attention layer projects its
keys/values once.

Module and parameter names are Marian's (`model.encoder.layers.N.self_attn.out_proj`, `fc1`, `fc2`,
`self_attn_layer_norm`, `encoder_attn`, `final_layer_norm`, `final_logits_bias`, ...), so a Marian-equivalent config
loads a `MarianMTModel` state dict with `strict=True` and computes the same function.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import torch
from torch import nn
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache, EncoderDecoderCache
from transformers.generation import GenerationMixin
from transformers.masking_utils import (
    create_bidirectional_mask,
    create_causal_mask,
    find_packed_sequence_indices,
    packed_sequence_mask_function,
)
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import (
    BaseModelOutput,
    BaseModelOutputWithPastAndCrossAttentions,
    Seq2SeqLMOutput,
    Seq2SeqModelOutput,
)
from transformers.modeling_utils import PreTrainedModel

from .attention import Attention
from .configuration_seq2seq import Seq2SeqConfig
from .hub_mixin import HubMixin
from .input_checks import cached_length, check_attention_mask, check_token_ids
from .losses import causal_lm_loss, chunked_causal_lm_loss, is_distributed_tensor
from .normalization import NORMS, OffsetRMSNorm
from .positions import LearnedPositionEmbedding
from .relative_bias import RelativePositionBias, position_buckets
from .sinusoidal import SinusoidalPositionalEmbedding, sinusoid_table

IGNORE_INDEX = -100


def shift_tokens_right(labels: torch.Tensor, pad_token_id: int | None, decoder_start_token_id: int) -> torch.Tensor:
    """Teacher forcing: decoder input = [start, y_0, ..., y_{T-2}]; ignored label positions (-100) become padding."""
    if pad_token_id is None:
        raise ValueError("`pad_token_id` must be set in the config to build `decoder_input_ids` from `labels`.")
    shifted = labels.new_full(labels.shape, decoder_start_token_id)
    shifted[:, 1:] = labels[:, :-1]
    return shifted.masked_fill_(shifted == IGNORE_INDEX, pad_token_id)


# ---- feed-forward: fc2(act(fc1 x)), or gated fc2(act(a) ⊙ b) with [a, b] = fc1 x --------------------------------


class GatedActivation(nn.Module):
    """act(a) ⊙ b over the two halves of the last dimension (GLU variants, Shazeer 2020: SwiGLU, GeGLU)."""

    def __init__(self, activation: str) -> None:
        super().__init__()
        self.act_fn = ACT2FN[activation]

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        gate, up = hidden_states.chunk(2, dim=-1)
        return self.act_fn(gate) * up


# mlp_type -> (activation module factory, fc1 width multiplier)
FFN_ACTIVATIONS: dict[str, tuple[Callable[[str], nn.Module], int]] = {
    "plain": (lambda name: ACT2FN[name], 1),
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


def relative_bias_table(config: Seq2SeqConfig, side: str) -> RelativePositionBias:
    """One T5 relative bias table of a stack's size: bidirectional in the encoder, causal in the decoder."""
    return RelativePositionBias(
        getattr(config, f"{side}_attention_heads"),
        num_buckets=config.relative_attention_num_buckets,
        max_distance=config.relative_attention_max_distance,
        bidirectional=side == "encoder",
    )


def make_layer_position_bias(config: Seq2SeqConfig, side: str) -> RelativePositionBias | None:
    """UMT5: this layer's own relative bias table; else None."""
    return relative_bias_table(config, side) if config.relative_attention_bias_per_layer else None


class TiedEmbedding(nn.Embedding):
    """A stack's token embedding that `_tied_weights_keys` ties to `source` (`shared`): transformers replaces its
    weight with the source's parameter after initialisation, and after loading (tying the parameter that a
    checkpoint has). Until then it holds an uninitialised placeholder: it draws no random numbers, neither here nor
    in `_init_weights`, so a seed builds the same model as when the stacks used the `shared` module itself."""

    def __init__(self, source: nn.Embedding) -> None:
        placeholder = torch.empty_like(source.weight)
        super().__init__(source.num_embeddings, source.embedding_dim, source.padding_idx, _weight=placeholder)


class _Seq2SeqLayer(GradientCheckpointingLayer):
    """What encoder and decoder layers share: the norms' factory, the residual wiring and the feed-forward."""

    def __init__(self, config: Seq2SeqConfig, ffn_dim: int, side: str) -> None:
        super().__init__()
        self.config = config
        self.residual = RESIDUALS[config.norm_position]
        # applied after every residual add (T5's fp16 guard), or nothing
        self.clamp = clamp_fp16 if config.clamp_fp16_hidden_states else keep_hidden_states
        self.position_bias = make_layer_position_bias(config, side)  # UMT5: this layer's own table; else None
        self.dropout = nn.Dropout(config.dropout)
        activation, width = FFN_ACTIVATIONS[config.mlp_type]
        self.fc1 = nn.Linear(config.d_model, width * ffn_dim, bias=config.mlp_bias)
        self.activation_fn = activation(config.activation_function)
        self.activation_dropout = nn.Dropout(config.activation_dropout)
        self.fc2 = nn.Linear(ffn_dim, config.d_model, bias=config.mlp_bias)
        self.final_layer_norm = self.make_norm()
        self.final_output_layer_norm = self.make_output_norm()

    def make_norm(self) -> nn.Module:
        return NORMS[self.config.norm_type](self.config.d_model, eps=self.config.layer_norm_eps)

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


def _attention(config: Seq2SeqConfig, side: str, layer_idx: int, is_causal: bool) -> Attention:
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
        self.self_attn = _attention(config, "encoder", layer_idx, is_causal=False)
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
        self.self_attn = _attention(config, "decoder", layer_idx, is_causal=True)
        self.self_attn_layer_norm = self.make_norm()
        self.self_attn_output_layer_norm = self.make_output_norm()
        self.encoder_attn = _attention(config, "decoder", layer_idx, is_causal=False)
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


class Seq2SeqPreTrainedModel(HubMixin, PreTrainedModel):
    config_class = Seq2SeqConfig
    config: Seq2SeqConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["Seq2SeqEncoderLayer", "Seq2SeqDecoderLayer"]
    _skip_keys_device_placement = ["past_key_values"]
    _supports_sdpa = True
    _supports_flash_attn = True
    _supports_flex_attn = True
    _supports_attention_backend = True

    # T5's relative bias reaches the kernel folded into the attention mask; flash kernels take no mask and flex
    # rebuilds masks from mask functions, so both would silently drop it: refuse them (at construction or later).
    def _refuse_bias_backend(self, implementation: str) -> None:
        if self.config.position_embedding_type == "relative_bias":
            raise ValueError(
                f"`position_embedding_type`='relative_bias' adds a bias to the attention scores, which "
                f"`attn_implementation`={implementation!r} cannot take; use 'sdpa' or 'eager'."
            )

    def _sdpa_can_dispatch(self, is_init_check: bool = False) -> bool:
        # SDPA has no score hook for soft-capping: the default then falls back to eager, an explicit request fails
        if self.config.attn_logit_softcapping is not None:
            raise ValueError(
                "`attn_logit_softcapping` cannot be applied by `attn_implementation='sdpa'` (SDPA has no score hook); "
                "use 'eager' (the default falls back to it when soft-capping is set)."
            )
        return super()._sdpa_can_dispatch(is_init_check)

    def _flash_attn_can_dispatch(self, flash_attn_version: int, is_init_check: bool = False) -> bool:
        self._refuse_bias_backend(f"flash_attention_{flash_attn_version}")
        return super()._flash_attn_can_dispatch(flash_attn_version, is_init_check)

    def _flex_attn_can_dispatch(self, is_init_check: bool = False) -> bool:
        self._refuse_bias_backend("flex_attention")
        return super()._flex_attn_can_dispatch(is_init_check)

    @classmethod
    def maybe_distribute_model(cls, model: PreTrainedModel, distributed_config, mesh_manager) -> PreTrainedModel:
        """Tie the weights before transformers' native FSDP2 shards the model. `from_pretrained` shards the model on
        meta, before loading, with tying switched off: FSDP2 would then wrap each tied alias (the stacks' embeddings,
        a tied head) as a parameter of its own, and after the tie at the end of loading keep gathering those stale
        copies, so training drifts from one process after the first step. Tied first, they are one parameter,
        sharded once. Not with tensor parallelism, whose plan shards each tied module's parameter by name (loading
        ties them again)."""
        if mesh_manager is not None and distributed_config.tp_size == 1:
            model.tie_weights(recompute_mapping=False)
        return super().maybe_distribute_model(model, distributed_config, mesh_manager)

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, TiedEmbedding):
            return  # tied to `shared`, which is initialised
        super()._init_weights(module)
        if isinstance(module, OffsetRMSNorm):
            init.zeros_(module.weight)  # the gain is 1 + w
        elif isinstance(module, SinusoidalPositionalEmbedding):
            init.copy_(module.weight, sinusoid_table(module.num_positions, module.dim, module.layout, module.base))
        elif isinstance(module, Seq2SeqForConditionalGeneration):
            init.zeros_(module.final_logits_bias)
        elif isinstance(module, nn.Linear) and hasattr(module, "init_std"):
            init.normal_(module.weight, mean=0.0, std=module.init_std)  # T5's q_proj, see `_attention`


def make_position_embedding(config: Seq2SeqConfig) -> nn.Module | None:
    """The absolute position table added to the (scaled) token embeddings, or None."""
    if config.position_embedding_type == "sinusoidal":
        return SinusoidalPositionalEmbedding(config.max_position_embeddings, config.d_model, config.sinusoidal_layout)
    if config.position_embedding_type == "learned":
        return LearnedPositionEmbedding(config.max_position_embeddings, config.d_model)
    return None


def make_position_bias(config: Seq2SeqConfig, side: str) -> RelativePositionBias | None:
    """T5's relative bias, one per stack: bidirectional in the encoder, causal in the decoder; else None (also when
    every layer has its own table, UMT5)."""
    if config.position_embedding_type != "relative_bias" or config.relative_attention_bias_per_layer:
        return None
    return relative_bias_table(config, side)


def make_position_buckets(config: Seq2SeqConfig, side: str) -> Callable | None:
    """UMT5: (query positions, key positions) -> (Tq, Tk) bucket ids, computed once per stack and forward; each layer
    looks its own table up at them. None when there are no per-layer tables."""
    if not config.relative_attention_bias_per_layer:
        return None
    return partial(
        position_buckets,
        bidirectional=side == "encoder",
        num_buckets=config.relative_attention_num_buckets,
        max_distance=config.relative_attention_max_distance,
    )


def make_final_norm(config: Seq2SeqConfig) -> nn.Module:
    """Pre-norm and sandwich stacks end with a norm (mBART's `layer_norm`); post-norm stacks already did."""
    if config.norm_position == "post":
        return nn.Identity()
    return NORMS[config.norm_type](config.d_model, eps=config.layer_norm_eps)


class Seq2SeqEncoder(nn.Module):
    """Token embeddings (scaled) + positions → `encoder_layers` bidirectional layers (→ final norm if pre-norm)."""

    def __init__(self, config: Seq2SeqConfig, embed_tokens: nn.Embedding) -> None:
        super().__init__()
        self.config = config
        self.embed_scale = math.sqrt(config.d_model) if config.scale_embedding else 1.0
        self.embed_tokens = embed_tokens
        self.embed_positions = make_position_embedding(config)
        self.dropout = nn.Dropout(config.dropout)
        self.layers = nn.ModuleList([Seq2SeqEncoderLayer(config, i) for i in range(config.encoder_layers)])
        self.layer_norm = make_final_norm(config)
        self.position_bias = make_position_bias(config, "encoder")  # (1, H, T, T) added to the scores, or None
        self.position_buckets = make_position_buckets(config, "encoder")  # per-layer tables (UMT5), or None
        self.gradient_checkpointing = False

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        output_attentions: bool = False,
        output_hidden_states: bool = False,
        return_dict: bool = True,
        position_ids: torch.LongTensor | None = None,
        **kwargs,
    ) -> BaseModelOutput | tuple:
        r"""position_ids (`torch.LongTensor` of shape `(batch, T)`, *optional*): packed documents, as the decoder
            takes them: positions restart at each document, and attention stays inside each document."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Pass exactly one of `input_ids` or `inputs_embeds`.")
        if inputs_embeds is None:
            check_token_ids(input_ids, self.embed_tokens.num_embeddings)
            inputs_embeds = self.embed_tokens(input_ids)
        check_attention_mask(attention_mask, *inputs_embeds.shape[:2], keys="source tokens")
        inputs_embeds = inputs_embeds * self.embed_scale
        hidden_states = inputs_embeds
        positions = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device)  # relative bias: distances
        if self.embed_positions is not None:
            position_embeddings = self.embed_positions(positions if position_ids is None else position_ids)
            hidden_states = hidden_states + position_embeddings.to(hidden_states.dtype)  # never promote half to fp32
        hidden_states = self.dropout(hidden_states)

        # Packed documents (positions restarting, tokenization/data.py): a block-diagonal bidirectional mask
        documents = find_packed_sequence_indices(position_ids) if position_ids is not None else None
        mask = create_bidirectional_mask(
            config=self.config,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            and_mask_function=packed_sequence_mask_function(documents) if documents is not None else None,
            allow_is_bidirectional_skip=self.position_bias is None and self.position_buckets is None,
        )
        buckets = None
        if self.position_bias is not None:
            mask = add_position_bias(mask, self.position_bias(positions, positions), inputs_embeds.dtype)
        if self.position_buckets is not None:  # each layer adds its own table's bias to this (additive) mask
            buckets = self.position_buckets(positions, positions)
            mask = additive_mask(mask, inputs_embeds.dtype)

        all_hidden_states = () if output_hidden_states else None
        all_attentions = () if output_attentions else None
        for layer in self.layers:
            if output_hidden_states:
                all_hidden_states += (hidden_states,)
            if self.training and self.config.encoder_layerdrop > 0 and torch.rand([]) < self.config.encoder_layerdrop:
                continue  # LayerDrop (Fan et al. 2019), as Marian/Bart
            hidden_states, weights = layer(
                hidden_states, mask, position_buckets=buckets, output_attentions=output_attentions, **kwargs
            )
            if output_attentions:
                all_attentions += (weights,)
        hidden_states = self.layer_norm(hidden_states)
        if output_hidden_states:
            all_hidden_states += (hidden_states,)
        output = BaseModelOutput(
            last_hidden_state=hidden_states, hidden_states=all_hidden_states, attentions=all_attentions
        )
        return output if return_dict else output.to_tuple()


class Seq2SeqDecoder(nn.Module):
    """Token embeddings (scaled) + positions → `decoder_layers` causal layers with cross-attention."""

    def __init__(self, config: Seq2SeqConfig, embed_tokens: nn.Embedding) -> None:
        super().__init__()
        self.config = config
        self.embed_scale = math.sqrt(config.d_model) if config.scale_embedding else 1.0
        self.embed_tokens = embed_tokens
        self.embed_positions = make_position_embedding(config)
        self.dropout = nn.Dropout(config.dropout)
        self.layers = nn.ModuleList([Seq2SeqDecoderLayer(config, i) for i in range(config.decoder_layers)])
        self.layer_norm = make_final_norm(config)
        self.position_bias = make_position_bias(config, "decoder")  # self-attention only, as T5
        self.position_buckets = make_position_buckets(config, "decoder")  # per-layer tables (UMT5), or None
        self.gradient_checkpointing = False

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        past_key_values: EncoderDecoderCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool = False,
        output_attentions: bool = False,
        output_hidden_states: bool = False,
        return_dict: bool = True,
        **kwargs,
    ) -> BaseModelOutputWithPastAndCrossAttentions | tuple:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Pass exactly one of `decoder_input_ids` or `decoder_inputs_embeds`.")
        if inputs_embeds is None:
            field = "vocab_size" if self.config.share_encoder_decoder_embeddings else "decoder_vocab_size"
            check_token_ids(input_ids, self.embed_tokens.num_embeddings, "decoder_input_ids", field)
            inputs_embeds = self.embed_tokens(input_ids)
        inputs_embeds = inputs_embeds * self.embed_scale
        if use_cache and past_key_values is None:
            past_key_values = EncoderDecoderCache(DynamicCache(config=self.config), DynamicCache(config=self.config))
        self_cache = past_key_values.self_attention_cache if past_key_values is not None else None
        past = self_cache.get_seq_length() if self_cache is not None else 0
        batch_size, seq_len = inputs_embeds.shape[:2]
        known_past = cached_length(self_cache)
        check_attention_mask(
            attention_mask, batch_size, None if known_past is None else known_past + seq_len,
            "decoder_attention_mask", "cached + new target tokens",
        )
        if encoder_hidden_states is not None:
            check_attention_mask(encoder_attention_mask, *encoder_hidden_states.shape[:2], keys="source tokens")
        positions = torch.arange(past, past + seq_len, device=inputs_embeds.device)

        hidden_states = inputs_embeds
        if self.embed_positions is not None:
            hidden_states = hidden_states + self.embed_positions(positions).to(hidden_states.dtype)
        hidden_states = self.dropout(hidden_states)

        causal_mask = create_causal_mask(
            config=self.config,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            past_key_values=self_cache,
            position_ids=positions[None],
            allow_is_causal_skip=self.position_bias is None and self.position_buckets is None,
        )
        key_positions = torch.arange(past + seq_len, device=inputs_embeds.device)
        buckets = None
        if self.position_bias is not None:
            bias = self.position_bias(positions, key_positions)  # (1, H, T, past + T)
            causal_mask = add_position_bias(causal_mask, bias, inputs_embeds.dtype)
        if self.position_buckets is not None:  # each layer adds its own table's bias to this (additive) mask
            buckets = self.position_buckets(positions, key_positions)
            causal_mask = additive_mask(causal_mask, inputs_embeds.dtype)
        cross_mask = create_bidirectional_mask(
            config=self.config,
            inputs_embeds=inputs_embeds,
            attention_mask=encoder_attention_mask,
            encoder_hidden_states=encoder_hidden_states,
        )

        all_hidden_states = () if output_hidden_states else None
        all_attentions = () if output_attentions else None
        all_cross_attentions = () if output_attentions else None
        for layer in self.layers:
            if output_hidden_states:
                all_hidden_states += (hidden_states,)
            if self.training and self.config.decoder_layerdrop > 0 and torch.rand([]) < self.config.decoder_layerdrop:
                continue
            hidden_states, self_weights, cross_weights = layer(
                hidden_states,
                causal_mask,
                encoder_hidden_states,  # positional, for gradient checkpointing
                encoder_attention_mask=cross_mask,
                past_key_values=past_key_values,
                position_buckets=buckets,
                output_attentions=output_attentions,
                **kwargs,
            )
            if output_attentions:
                all_attentions += (self_weights,)
                all_cross_attentions += (cross_weights,)
        hidden_states = self.layer_norm(hidden_states)
        if output_hidden_states:
            all_hidden_states += (hidden_states,)
        output = BaseModelOutputWithPastAndCrossAttentions(
            last_hidden_state=hidden_states,
            past_key_values=past_key_values if use_cache else None,
            hidden_states=all_hidden_states,
            attentions=all_attentions,
            cross_attentions=all_cross_attentions,
        )
        return output if return_dict else output.to_tuple()


class Seq2SeqModel(Seq2SeqPreTrainedModel):
    """Encoder + decoder without a head; returns the decoder's last hidden states and the encoder's output."""

    def __init__(self, config: Seq2SeqConfig) -> None:
        super().__init__(config)
        padding_idx = None if config.train_pad_embedding else config.pad_token_id
        if config.share_encoder_decoder_embeddings:
            # One vocabulary for source and target (the paper's shared BPE); Marian keeps it as `shared`. Each stack
            # has its own module holding that parameter (parameter tying, as Marian and Bart: one module registered
            # under three names makes transformers' loader skip it when a checkpoint lacks it, left on meta).
            self.shared = nn.Embedding(config.vocab_size, config.d_model, padding_idx)
            self._tied_weights_keys = {
                "encoder.embed_tokens.weight": "shared.weight",
                "decoder.embed_tokens.weight": "shared.weight",
            }
            encoder_embeddings, decoder_embeddings = TiedEmbedding(self.shared), TiedEmbedding(self.shared)
        else:
            encoder_embeddings = nn.Embedding(config.vocab_size, config.d_model, padding_idx)
            decoder_embeddings = nn.Embedding(config.decoder_vocab_size, config.d_model, padding_idx)
        self.encoder = Seq2SeqEncoder(config, encoder_embeddings)
        self.decoder = Seq2SeqDecoder(config, decoder_embeddings)
        self.post_init()

    def get_expanded_tied_weights_keys(self, all_submodels: bool = False) -> dict[str, str]:
        """transformers expands `_tied_weights_keys` only under `tie_word_embeddings`, the head's tie; a shared
        vocabulary is one parameter whatever the head does (T5 v1.1: shared embeddings, separate head)."""
        if all_submodels or not self.config.share_encoder_decoder_embeddings:
            return super().get_expanded_tied_weights_keys(all_submodels)
        return dict(self._tied_weights_keys)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.encoder.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        if self.config.share_encoder_decoder_embeddings:
            self.shared = value
            self.decoder.embed_tokens = value
        self.encoder.embed_tokens = value

    def get_encoder(self, modality: str | None = None) -> Seq2SeqEncoder:
        return self.encoder

    def get_decoder(self) -> Seq2SeqDecoder:
        return self.decoder

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        decoder_input_ids: torch.LongTensor | None = None,
        decoder_attention_mask: torch.Tensor | None = None,
        encoder_outputs: BaseModelOutput | tuple | None = None,
        past_key_values: EncoderDecoderCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        decoder_inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> Seq2SeqModelOutput | tuple:
        output_attentions = output_attentions if output_attentions is not None else self.config.output_attentions
        output_hidden_states = (
            output_hidden_states if output_hidden_states is not None else self.config.output_hidden_states
        )
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        use_cache = use_cache if use_cache is not None else self.config.use_cache
        if self.training:
            use_cache = False  # teacher forcing sees the whole target at once; nothing to cache

        if encoder_outputs is None:
            encoder_outputs = self.encoder(
                input_ids=input_ids,
                attention_mask=attention_mask,
                inputs_embeds=inputs_embeds,
                output_attentions=output_attentions,
                output_hidden_states=output_hidden_states,
                return_dict=True,
                **kwargs,
            )
        elif not isinstance(encoder_outputs, BaseModelOutput):
            encoder_outputs = BaseModelOutput(
                last_hidden_state=encoder_outputs[0],
                hidden_states=encoder_outputs[1] if len(encoder_outputs) > 1 else None,
                attentions=encoder_outputs[2] if len(encoder_outputs) > 2 else None,
            )
        decoder_outputs = self.decoder(
            input_ids=decoder_input_ids,
            attention_mask=decoder_attention_mask,
            encoder_hidden_states=encoder_outputs.last_hidden_state,
            encoder_attention_mask=attention_mask,
            past_key_values=past_key_values,
            inputs_embeds=decoder_inputs_embeds,
            use_cache=use_cache,
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
            return_dict=True,
            **kwargs,
        )
        output = Seq2SeqModelOutput(
            last_hidden_state=decoder_outputs.last_hidden_state,
            past_key_values=decoder_outputs.past_key_values,
            decoder_hidden_states=decoder_outputs.hidden_states,
            decoder_attentions=decoder_outputs.attentions,
            cross_attentions=decoder_outputs.cross_attentions,
            encoder_last_hidden_state=encoder_outputs.last_hidden_state,
            encoder_hidden_states=encoder_outputs.hidden_states,
            encoder_attentions=encoder_outputs.attentions,
        )
        return output if return_dict else output.to_tuple()


class Seq2SeqForConditionalGeneration(Seq2SeqPreTrainedModel, GenerationMixin):
    """Encoder-decoder + output projection (tied to the target embeddings by default) + `final_logits_bias`.

    With `labels`, `decoder_input_ids` default to `shift_tokens_right(labels)` and the loss is the token-level
    cross-entropy of `logits[:, t]` against `labels[:, t]` (no further shift), summed over non-ignored tokens and
    divided by `num_items_in_batch` when the Trainer passes it (else by their count). In training the head and the
    loss run chunked (`lm_loss_chunk_size`) and `logits` is None; Trainer's `label_smoothing_factor` pops `labels`,
    so the model then returns full logits and the Trainer's smoother computes the loss from them.
    """

    _keys_to_ignore_on_load_missing = ["final_logits_bias"]
    _tied_weights_keys = {"lm_head.weight": "model.decoder.embed_tokens.weight"}  # with `tie_word_embeddings`
    # tensor parallelism: the head split by vocabulary rows, the logits gathered (the embeddings it may be tied to
    # are split the same way, see `Seq2SeqConfig.base_model_tp_plan`)
    _tp_plan = {"lm_head": "colwise_gather_output"}

    def __init__(self, config: Seq2SeqConfig) -> None:
        super().__init__(config)
        self.model = Seq2SeqModel(config)
        # T5 multiplies the decoder output by d_model^-0.5 before its (tied) head; Gemma2 soft-caps the logits
        self.output_scale = config.d_model**-0.5 if config.scale_decoder_outputs else 1.0
        self.final_logit_softcapping = config.final_logit_softcapping
        if config.share_encoder_decoder_embeddings:  # the source of the decoder's own tie (Seq2SeqModel)
            self._tied_weights_keys = {"lm_head.weight": "model.shared.weight"}
        self.lm_head = nn.Linear(config.d_model, config.decoder_vocab_size, bias=False)
        # Marian's constant output bias (a buffer: checkpoints carry it, training does not update it)
        self.register_buffer("final_logits_bias", torch.zeros(1, config.decoder_vocab_size))
        self.post_init()

    def get_encoder(self, modality: str | None = None) -> Seq2SeqEncoder:
        return self.model.encoder

    def get_decoder(self) -> Seq2SeqDecoder:
        return self.model.decoder

    def resize_token_embeddings(self, *args, **kwargs) -> nn.Embedding:
        """With a shared vocabulary, the target side (`decoder_vocab_size`, `final_logits_bias`) follows."""
        embeddings = super().resize_token_embeddings(*args, **kwargs)
        if self.config.share_encoder_decoder_embeddings:
            size = embeddings.weight.shape[0]
            bias = self.final_logits_bias.new_zeros(1, size)
            kept = min(size, self.final_logits_bias.shape[1])
            bias[:, :kept] = self.final_logits_bias[:, :kept]
            self.final_logits_bias = bias
            self.config.decoder_vocab_size = size
        return embeddings

    def _reorder_cache(self, past_key_values: EncoderDecoderCache, beam_idx: torch.LongTensor) -> EncoderDecoderCache:
        """Beam search (`generate` calls this between steps): reorder the self-attention cache only. Beams move only
        within their own input's group, whose cross-attention keys/values are identical copies, so reordering those
        would copy (layers × beams × source length × d_model) values per step for nothing."""
        past_key_values.self_attention_cache.reorder_cache(beam_idx)
        return past_key_values

    def prepare_decoder_input_ids_from_labels(self, labels: torch.Tensor) -> torch.Tensor:
        """Used by `DataCollatorForSeq2Seq` (needed when the Trainer pops `labels` for label smoothing)."""
        return shift_tokens_right(labels, self.config.pad_token_id, self.config.decoder_start_token_id)

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        decoder_input_ids: torch.LongTensor | None = None,
        decoder_attention_mask: torch.Tensor | None = None,
        encoder_outputs: BaseModelOutput | tuple | None = None,
        past_key_values: EncoderDecoderCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        decoder_inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        num_items_in_batch: torch.Tensor | int | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs,
    ) -> Seq2SeqLMOutput | tuple:
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        if labels is not None:
            use_cache = False
            if decoder_input_ids is None and decoder_inputs_embeds is None:
                decoder_input_ids = self.prepare_decoder_input_ids_from_labels(labels)
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            decoder_input_ids=decoder_input_ids,
            decoder_attention_mask=decoder_attention_mask,
            encoder_outputs=encoder_outputs,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            decoder_inputs_embeds=decoder_inputs_embeds,
            use_cache=use_cache,
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
            return_dict=True,
            **kwargs,
        )
        hidden_states = outputs.last_hidden_state * self.output_scale  # (B, T, d)
        loss, logits = None, None
        chunk = self.config.lm_loss_chunk_size
        softcap = self.final_logit_softcapping
        # The chunked loss has no soft-cap and reads the head's weight directly (not while FSDP2/TP shard it).
        chunked = chunk > 0 and softcap is None and not is_distributed_tensor(self.lm_head.weight)
        if labels is not None and self.training and chunked:
            # logits = [h, 1] @ [W, b]ᵀ: the constant bias rides along as one more input channel
            ones = hidden_states.new_ones(*hidden_states.shape[:-1], 1)
            weight = torch.cat((self.lm_head.weight, self.final_logits_bias.t().to(self.lm_head.weight.dtype)), 1)
            loss = chunked_causal_lm_loss(
                torch.cat((hidden_states, ones), -1), weight, labels, chunk, num_items_in_batch, shifted_labels=labels
            )
        else:
            keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
            logits = self.lm_head(hidden_states[:, keep, :]) + self.final_logits_bias.to(hidden_states.dtype)
            if softcap is not None:
                logits = torch.tanh(logits / softcap) * softcap
            if labels is not None:
                loss = causal_lm_loss(logits, labels, num_items_in_batch, shifted_labels=labels)

        output = Seq2SeqLMOutput(
            loss=loss,
            logits=logits,
            past_key_values=outputs.past_key_values,
            decoder_hidden_states=outputs.decoder_hidden_states,
            decoder_attentions=outputs.decoder_attentions,
            cross_attentions=outputs.cross_attentions,
            encoder_last_hidden_state=outputs.encoder_last_hidden_state,
            encoder_hidden_states=outputs.encoder_hidden_states,
            encoder_attentions=outputs.encoder_attentions,
        )
        return output if return_dict else output.to_tuple()


__all__ = [
    "Seq2SeqPreTrainedModel",
    "Seq2SeqModel",
    "Seq2SeqForConditionalGeneration",
    "shift_tokens_right",
]
