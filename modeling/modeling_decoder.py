"""archlab's decoder-only language model: `DecoderModel`, `DecoderForCausalLM`, `DecoderForSequenceClassification`.

The default configuration is the LLaMA recipe (Touvron et al. 2023; seed 000 §5.2): token embedding → N × [pre-RMSNorm
→ GQA self-attention with RoPE → residual → pre-RMSNorm → SwiGLU MLP → residual] → final RMSNorm → LM head. Module
and parameter names are Llama's, so a Llama-equivalent config loads a `LlamaForCausalLM` state dict as is.

Plugs into transformers through its public interfaces only: `PreTrainedModel`, `GenerationMixin`, the `Cache`
classes, `masking_utils` mask builders and the attention-backend registry.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.cache_utils import Cache, DynamicCache
from transformers.generation import GenerationMixin
from transformers.masking_utils import create_causal_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import (
    BaseModelOutputWithPast,
    CausalLMOutputWithPast,
    SequenceClassifierOutputWithPast,
)
from transformers.modeling_utils import PreTrainedModel

from .attention import Attention
from .configuration_decoder import DecoderConfig
from .feed_forward import GatedMLP
from .hub_mixin import HubMixin
from .losses import causal_lm_loss, chunked_causal_lm_loss
from .normalization import RMSNorm
from .rotary import RotaryEmbedding


class DecoderLayer(GradientCheckpointingLayer):
    """x + Attn(Norm(x)), then h + MLP(Norm(h)) — the pre-norm block."""

    def __init__(self, config: DecoderConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_idx, is_causal=True)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act, config.mlp_bias)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        past_key_values: Cache | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        attn_out, attn_weights = self.self_attn(
            self.input_layernorm(hidden_states),
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
            past_key_values=past_key_values,
            **kwargs,
        )
        hidden_states = hidden_states + attn_out
        hidden_states = hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))
        return hidden_states, attn_weights


class DecoderPreTrainedModel(HubMixin, PreTrainedModel):
    config_class = DecoderConfig
    config: DecoderConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["DecoderLayer"]
    _skip_keys_device_placement = ["past_key_values"]
    _supports_sdpa = True
    _supports_flash_attn = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    _can_compile_fullgraph = True


class DecoderModel(DecoderPreTrainedModel):
    """The decoder stack without a head: returns the final-normed hidden states."""

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList([DecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)
        self.gradient_checkpointing = False
        self.post_init()

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast | tuple:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Pass exactly one of `input_ids` or `inputs_embeds`.")
        output_attentions = output_attentions if output_attentions is not None else self.config.output_attentions
        output_hidden_states = (
            output_hidden_states if output_hidden_states is not None else self.config.output_hidden_states
        )
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        use_cache = use_cache if use_cache is not None else self.config.use_cache
        if self.gradient_checkpointing and self.training and use_cache:
            use_cache = False  # caching is pointless while recomputing activations
        if use_cache and past_key_values is None and not self.training:
            past_key_values = DynamicCache(config=self.config)

        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if position_ids is None:
            past_seen = past_key_values.get_seq_length() if past_key_values is not None else 0
            position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen
            position_ids = position_ids.unsqueeze(0)

        mask = create_causal_mask(
            config=self.config,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            past_key_values=past_key_values,
            position_ids=position_ids,
        )
        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids)

        all_hidden_states = () if output_hidden_states else None
        all_attentions = () if output_attentions else None
        for layer in self.layers:
            if output_hidden_states:
                all_hidden_states += (hidden_states,)
            hidden_states, attn_weights = layer(
                hidden_states,
                attention_mask=mask,
                position_embeddings=position_embeddings,
                past_key_values=past_key_values,
                output_attentions=output_attentions,
                **kwargs,
            )
            if output_attentions:
                all_attentions += (attn_weights,)
        hidden_states = self.norm(hidden_states)
        if output_hidden_states:
            all_hidden_states += (hidden_states,)

        output = BaseModelOutputWithPast(
            last_hidden_state=hidden_states,
            past_key_values=past_key_values if use_cache else None,
            hidden_states=all_hidden_states,
            attentions=all_attentions,
        )
        return output if return_dict else output.to_tuple()


class DecoderForCausalLM(DecoderPreTrainedModel, GenerationMixin):
    """Decoder + LM head. In training with `labels`, the head and the loss run chunked and `logits` is None."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__(config)
        self.model = DecoderModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        num_items_in_batch: torch.Tensor | int | None = None,
        shift_labels: torch.LongTensor | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast | tuple:
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
            return_dict=True,
            **kwargs,
        )
        hidden_states = outputs.last_hidden_state
        loss, logits = None, None
        chunk = self.config.lm_loss_chunk_size
        if (labels is not None or shift_labels is not None) and self.training and chunk > 0:
            loss = chunked_causal_lm_loss(
                hidden_states, self.lm_head.weight, labels, chunk, num_items_in_batch, shifted_labels=shift_labels
            )
        else:
            keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
            logits = self.lm_head(hidden_states[:, keep, :])
            if labels is not None or shift_labels is not None:
                loss = causal_lm_loss(logits, labels, num_items_in_batch, shifted_labels=shift_labels)

        output = CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            past_key_values=outputs.past_key_values,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )
        return output if return_dict else output.to_tuple()


class DecoderForSequenceClassification(DecoderPreTrainedModel):
    """Classifies a sequence from the hidden state of its last non-pad token (GPT fine-tuning, seed 001).

    With `config.classifier_lm_loss_weight = λ > 0` the loss is L_FT + λ·L_PT, L_PT the next-token loss on the
    input (the auxiliary LM objective of GPT-1); the LM head is tied to the embeddings for that.
    """

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__(config)
        self.num_labels = config.num_labels
        self.model = DecoderModel(config)
        self.score = nn.Linear(config.hidden_size, self.num_labels, bias=False)
        self.post_init()

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> SequenceClassifierOutputWithPast | tuple:
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        kwargs.pop("num_items_in_batch", None)
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
            return_dict=True,
            **kwargs,
        )
        hidden_states = outputs.last_hidden_state  # (B, T, d)
        last = self._last_token_index(input_ids, attention_mask, hidden_states)
        pooled = hidden_states[torch.arange(hidden_states.shape[0], device=hidden_states.device), last]
        logits = self.score(pooled)  # (B, num_labels)

        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, pooled_logits=logits, config=self.config)
            weight = self.config.classifier_lm_loss_weight
            if weight > 0 and input_ids is not None:
                lm_labels = input_ids.masked_fill(attention_mask == 0, -100) if attention_mask is not None else input_ids
                lm_logits = hidden_states @ self.model.embed_tokens.weight.t()
                loss = loss + weight * causal_lm_loss(lm_logits, lm_labels)

        output = SequenceClassifierOutputWithPast(
            loss=loss,
            logits=logits,
            past_key_values=outputs.past_key_values,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )
        return output if return_dict else output.to_tuple()

    def _last_token_index(
        self, input_ids: torch.Tensor | None, attention_mask: torch.Tensor | None, hidden_states: torch.Tensor
    ) -> torch.Tensor:
        """Index of the last real token per row; works for left and right padding."""
        batch, seq_len = hidden_states.shape[:2]
        positions = torch.arange(seq_len, device=hidden_states.device)
        if attention_mask is not None:
            real = attention_mask.to(hidden_states.device).bool()
        elif input_ids is not None and self.config.pad_token_id is not None:
            real = input_ids != self.config.pad_token_id
        else:
            return torch.full((batch,), seq_len - 1, device=hidden_states.device)
        return (positions * real).argmax(-1)


__all__ = ["DecoderPreTrainedModel", "DecoderModel", "DecoderForCausalLM", "DecoderForSequenceClassification"]
