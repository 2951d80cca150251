"""The encoder and decoder stacks of archlab's encoder-decoder: embeddings (scaled) + positions → layers → final
norm, with the masks and position biases built once per forward and shared by the stack's layers.

    encoder:  x = embed(src)·√d + PE  →  N × encoder layer (bidirectional; source padding masked; packed documents
              attend within themselves)
    decoder:  y = embed(tgt)·√d + PE  →  N × decoder layer (causal self-attention with a cache; cross-attention
              over the encoder output, source padding masked)

T5's relative bias is one table per stack folded into the stack's mask once, or (UMT5,
`relative_attention_bias_per_layer`) one table per layer that each layer adds to the mask at the stack's bucket ids.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import torch
from torch import nn
from transformers.cache_utils import DynamicCache, EncoderDecoderCache
from transformers.masking_utils import (
    create_bidirectional_mask,
    create_causal_mask,
    find_packed_sequence_indices,
    packed_sequence_mask_function,
)
from transformers.modeling_outputs import BaseModelOutput, BaseModelOutputWithPastAndCrossAttentions

from .cache_names import cache_argument, with_cache
from .configuration_seq2seq import Seq2SeqConfig
from .input_checks import (
    cached_length,
    check_attention_mask,
    check_cache_heads,
    check_segment_ids,
    check_token_ids,
    embedding_rows,
)
from .normalization import make_norm
from .positions import check_given_position_ids, position_ids_from_mask, position_table
from .relative_bias import position_buckets
from .seq2seq_layers import (
    Seq2SeqDecoderLayer,
    Seq2SeqEncoderLayer,
    add_position_bias,
    additive_mask,
    stack_position_bias,
)


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


def _is_padding_mask(attention_mask: torch.Tensor | None) -> bool:
    """A 2D (batch, source tokens) padding mask."""
    return isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2


def make_final_norm(config: Seq2SeqConfig) -> nn.Module:
    """Pre-norm and sandwich stacks end with a norm (mBART's `layer_norm`); post-norm stacks already did."""
    if config.norm_position == "post":
        return nn.Identity()
    return make_norm(config.norm_type, config.d_model, config.layer_norm_eps)


def embedding_norm(config: Seq2SeqConfig) -> nn.Module | None:
    """Bart's and BERT's norm right after token + position (+ segment) embeddings, or None."""
    return make_norm(config.norm_type, config.d_model, config.layer_norm_eps) if config.embedding_layernorm else None


class _Seq2SeqStack(nn.Module):
    """What the encoder and the decoder stack share: token embeddings (scaled) + positions (+ BERT's segments in the
    encoder) → `layer_class` layers → final norm if pre-norm, and the stack's relative-bias table (T5)."""

    def __init__(self, config: Seq2SeqConfig, embed_tokens: nn.Embedding, side: str, layer_class: type) -> None:
        super().__init__()
        self.config = config
        self.embed_scale = math.sqrt(config.d_model) if config.scale_embedding else 1.0
        self.embed_tokens = embed_tokens
        self.embed_positions = position_table(
            config.position_embedding_type,
            config.max_position_embeddings,
            config.d_model,
            config.sinusoidal_layout,
            offset=config.position_embedding_offset,
        )
        if side == "encoder":  # BERT's segment embeddings (`token_type_ids`), when the config has segment types
            self.token_type_embeddings = (
                nn.Embedding(config.type_vocab_size, config.d_model) if config.type_vocab_size else None
            )
        self.layernorm_embedding = embedding_norm(config)
        self.dropout = nn.Dropout(config.dropout)
        num_layers = config.encoder_layers if side == "encoder" else config.decoder_layers
        self.layers = nn.ModuleList([layer_class(config, i) for i in range(num_layers)])
        self.layer_norm = make_final_norm(config)
        # one relative bias table per stack (T5; the decoder's for self-attention only), unless every layer has its
        # own (UMT5)
        self.position_bias = None if config.relative_attention_bias_per_layer else stack_position_bias(config, side)
        self.position_buckets = make_position_buckets(config, side)  # per-layer tables (UMT5), or None
        self.gradient_checkpointing = False


class Seq2SeqEncoder(_Seq2SeqStack):
    """Token embeddings (scaled) + positions → `encoder_layers` bidirectional layers (→ final norm if pre-norm)."""

    def __init__(self, config: Seq2SeqConfig, embed_tokens: nn.Embedding) -> None:
        super().__init__(config, embed_tokens, "encoder", Seq2SeqEncoderLayer)

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        output_attentions: bool = False,
        output_hidden_states: bool = False,
        return_dict: bool = True,
        position_ids: torch.LongTensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        **kwargs,
    ) -> BaseModelOutput | tuple:
        r"""position_ids (`torch.LongTensor` of shape `(batch, T)`, *optional*): packed documents, as the decoder
            takes them: positions restart at each document, and attention stays inside each document. With
            `config.position_ids_are_table_rows` they are rows of the learned table (RoBERTa's), the offset not added.
        token_type_ids (`torch.LongTensor` of shape `(batch, T)`, *optional*): BERT's segment ids, with
            `config.type_vocab_size` > 0 (None: all 0); ignored otherwise, as tokenizers emit them anyway."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Pass exactly one of `input_ids` or `inputs_embeds`.")
        if inputs_embeds is None:
            check_token_ids(input_ids, embedding_rows(self.embed_tokens))
            inputs_embeds = self.embed_tokens(input_ids)
        check_attention_mask(attention_mask, *inputs_embeds.shape[:2], keys="source tokens")
        inputs_embeds = inputs_embeds * self.embed_scale
        hidden_states = inputs_embeds
        positions = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device)  # relative bias: distances
        if self.embed_positions is not None:
            if position_ids is not None:
                check_given_position_ids(position_ids, self.embed_positions, self.config.position_ids_are_table_rows)
            table_positions = positions if position_ids is None else position_ids
            if position_ids is not None and self.config.position_ids_are_table_rows:  # RoBERTa's: rows as given
                table_positions = position_ids - self.config.position_embedding_offset
            from_mask = self.config.position_ids_from_attention_mask and _is_padding_mask(attention_mask)
            if position_ids is None and from_mask:  # RoBERTa's numbering: a padded row's tokens as alone
                table_positions = position_ids_from_mask(attention_mask, inputs_embeds.shape[1])
            position_embeddings = self.embed_positions(table_positions)
            hidden_states = hidden_states + position_embeddings.to(hidden_states.dtype)  # never promote half to fp32
        if self.token_type_embeddings is not None:
            if token_type_ids is None:
                token_type_ids = torch.zeros(hidden_states.shape[:2], dtype=torch.long, device=hidden_states.device)
            check_segment_ids(token_type_ids, self.config.type_vocab_size)
            hidden_states = hidden_states + self.token_type_embeddings(token_type_ids)
        if self.layernorm_embedding is not None:
            hidden_states = self.layernorm_embedding(hidden_states)
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


class Seq2SeqDecoder(_Seq2SeqStack):
    """Token embeddings (scaled) + positions → `decoder_layers` causal layers with cross-attention."""

    def __init__(self, config: Seq2SeqConfig, embed_tokens: nn.Embedding) -> None:
        super().__init__(config, embed_tokens, "decoder", Seq2SeqDecoderLayer)

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
        cache: EncoderDecoderCache | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPastAndCrossAttentions | tuple:
        past_key_values = cache_argument(past_key_values, cache)  # `cache` from transformers 5.24 on
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Pass exactly one of `decoder_input_ids` or `decoder_inputs_embeds`.")
        if inputs_embeds is None:
            field = "vocab_size" if self.config.share_encoder_decoder_embeddings else "decoder_vocab_size"
            check_token_ids(input_ids, embedding_rows(self.embed_tokens), "decoder_input_ids", field)
            inputs_embeds = self.embed_tokens(input_ids)
        inputs_embeds = inputs_embeds * self.embed_scale
        if use_cache and past_key_values is None:
            past_key_values = EncoderDecoderCache(DynamicCache(config=self.config), DynamicCache(config=self.config))
        self_cache = past_key_values.self_attention_cache if past_key_values is not None else None
        heads = self.layers[0].self_attn
        check_cache_heads(self_cache, heads.num_key_value_heads, heads.head_dim, "decoder_key_value_heads", "d_kv")
        past = self_cache.get_seq_length() if self_cache is not None else 0  # a 0-d tensor for a static cache
        batch_size, seq_len = inputs_embeds.shape[:2]
        known_past = cached_length(self_cache)
        check_attention_mask(
            attention_mask,
            batch_size,
            None if known_past is None else known_past + seq_len,
            "decoder_attention_mask",
            "cached + new target tokens",
        )
        if encoder_hidden_states is not None:
            check_attention_mask(encoder_attention_mask, *encoder_hidden_states.shape[:2], keys="source tokens")
        positions = torch.arange(seq_len, device=inputs_embeds.device) + past  # no host read of `past`: compiles

        hidden_states = inputs_embeds
        if self.embed_positions is not None:
            hidden_states = hidden_states + self.embed_positions(positions).to(hidden_states.dtype)
        if self.layernorm_embedding is not None:
            hidden_states = self.layernorm_embedding(hidden_states)
        hidden_states = self.dropout(hidden_states)

        causal_mask = create_causal_mask(
            config=self.config,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            position_ids=positions[None],
            **with_cache(self_cache),
            allow_is_causal_skip=self.position_bias is None and self.position_buckets is None,
        )
        # the keys the cache returns: past + seq_len of them, or every slot of a static cache (unfilled ones masked)
        key_length, key_offset = self_cache.get_mask_sizes(seq_len, 0) if self_cache is not None else (seq_len, 0)
        key_positions = torch.arange(key_length, device=inputs_embeds.device) + key_offset
        buckets = None
        if self.position_bias is not None:
            bias = self.position_bias(positions, key_positions)  # (1, H, T, key_length)
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
            **with_cache(past_key_values if use_cache else None),
            hidden_states=all_hidden_states,
            attentions=all_attentions,
            cross_attentions=all_cross_attentions,
        )
        return output if return_dict else output.to_tuple()


__all__ = ["Seq2SeqDecoder", "Seq2SeqEncoder"]
