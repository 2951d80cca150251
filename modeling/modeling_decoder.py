"""archlab's decoder-only language model: `DecoderModel`, `DecoderForCausalLM` and the task heads Llama has,
`DecoderForSequenceClassification`, `DecoderForTokenClassification` and `DecoderForQuestionAnswering`.

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
from transformers.generation import GenerationMixin, MaxLengthCriteria, StoppingCriteriaList
from transformers.modeling_layers import GenericForSequenceClassification
from transformers.modeling_outputs import (
    MoeCausalLMOutputWithPast,
    MoeModelOutputWithPast,
    QuestionAnsweringModelOutput,
    SequenceClassifierOutputWithPast,
    TokenClassifierOutput,
)
from transformers.models.auto import modeling_auto

from .attention_patterns import build_masks, build_position_biases
from .blocks import BLOCKS, norm_from_config
from .cache_names import cache_argument, output_cache, with_cache
from .catalogue import POSITION_SCHEMES
from .configuration_decoder import TOKEN_CLASSIFIER_DROPOUT_FIELDS, DecoderConfig
from .continuous_batching import continuous_batching_refusal
from .fast_decoding import FastDecodingMixin
from .generic_head_rules import FollowsGenericHead
from .input_checks import (
    cached_length,
    can_read_values,
    check_answer_positions,
    check_attention_mask,
    check_cache_heads,
    check_token_ids,
    check_token_labels,
    embedding_rows,
    input_shape,
)
from .latent_attention import LatentAttention
from .losses import (
    IGNORE_INDEX,
    causal_lm_loss,
    embedding_matrix,
    lm_head_loss,
    scaled_and_capped,
    share_of_batch,
)
from .losses import shift_labels as next_token_targets
from .moe import collect_router_logits, count_expert_loads, load_balancing_loss, router_z_loss
from .positions import check_given_position_ids, position_bias, position_ids_from_mask, position_table
from .pretrained import ArchlabPreTrainedModel
from .rotary import LayerTypeRotaryEmbeddings, RotaryEmbedding, rotary_per_layer_type, with_query_scales


def _is_padding_mask(attention_mask: torch.Tensor | dict | None) -> bool:
    """A 2D (batch, keys) padding mask, not the prebuilt masks `generate` hands a static cache."""
    return isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2


def add_router_losses(
    config: DecoderConfig,
    loss: torch.Tensor | None,
    router_logits: tuple[torch.Tensor, ...] | None,
    attention_mask: torch.Tensor | None,
    output_router_logits: bool,
    share: torch.Tensor | float,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """A head's loss plus an MoE's router losses, and the load-balancing loss alone (None unless asked for).

    As Mixtral's causal LM: the load-balancing loss only under `output_router_logits`, times `router_aux_loss_coef`;
    the z-loss whenever `router_z_loss_coef` > 0. Each is weighted by `share`, this forward's share of the Trainer's
    `num_items_in_batch` (1 without it), so gradient accumulation adds them once per optimizer step."""
    aux_loss = None
    if output_router_logits and router_logits:
        aux_loss = load_balancing_loss(
            router_logits,
            config.num_local_experts,
            config.num_experts_per_tok,
            attention_mask,
            score_function=config.router_score_function,
        )
        if loss is not None:
            loss = loss + config.router_aux_loss_coef * share * aux_loss.to(loss.device)
    if loss is not None and router_logits and config.router_z_loss_coef > 0:
        z_loss = router_z_loss(router_logits, attention_mask).to(loss.device)
        loss = loss + config.router_z_loss_coef * share * z_loss
    return loss, aux_loss


def _share_of_labels(labels: torch.Tensor, num_items_in_batch, device: torch.device) -> torch.Tensor | float:
    """The share of the Trainer's `num_items_in_batch` (its count of `labels != -100`) that `labels` hold."""
    if num_items_in_batch is None:
        return 1.0
    return labels.ne(IGNORE_INDEX).sum().to(device) / torch.as_tensor(num_items_in_batch).to(device)


class ScaledEmbedding(nn.Embedding):
    """Token embeddings times `scale` (√d under `scale_embedding`, times `embedding_multiplier`), inside the module,
    as Gemma's `GemmaTextScaledWordEmbedding` computes them: what a hook on `get_input_embeddings()` sees (NEFTune's
    noise, added to the module's output, was √d times Gemma's when the model scaled afterwards) and what `inputs_embeds`
    holds (`get_input_embeddings()(ids)`, used as is, as in Gemma)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None, scale: float | None) -> None:
        super().__init__(num_embeddings, embedding_dim, padding_idx)
        if scale is not None:
            # PEFT's LoRA `Embedding` scales its adapter's output by the base layer's `embed_scale` (as Gemma's):
            # without it, an unmerged adapter on `embed_tokens` would add an unscaled delta, unlike its merged weights
            self.embed_scale = scale

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        embeddings = super().forward(input_ids)
        scale = getattr(self, "embed_scale", None)
        return embeddings if scale is None else embeddings * torch.tensor(scale, dtype=embeddings.dtype)


class DecoderPreTrainedModel(ArchlabPreTrainedModel):
    config_class = DecoderConfig
    config: DecoderConfig
    _no_split_modules = [block.__name__ for block in BLOCKS.values()]
    _can_compile_fullgraph = True

    def __init__(self, config: DecoderConfig, *inputs, **kwargs) -> None:
        super().__init__(config, *inputs, **kwargs)
        # The instance lists only the block this config builds: accelerate's FSDP wrap policy (TRANSFORMER_BASED_WRAP)
        # raises on a listed class the model does not contain. The class attribute keeps every block.
        self._no_split_modules = [BLOCKS[config.norm_position].__name__]
        # a router's correction bias stays fp32 in a bf16/fp16 load (as transformers' DeepSeek-V3 / GLM-4.5 routers');
        # on the instance, where the model has one (transformers' tests require every listed module to exist)
        if getattr(config, "router_correction_bias", False):
            self._keep_in_fp32_modules_strict = ["e_score_correction_bias"]

    def resize_token_embeddings(self, *args, **kwargs) -> nn.Embedding:
        """transformers' resize, and a warning when the new size drops `pad_token_id` or `bos_token_id`."""
        embeddings = super().resize_token_embeddings(*args, **kwargs)
        self._warn_if_resize_left_an_unsavable_config(f"resize_token_embeddings to {embeddings.weight.shape[0]}")
        return embeddings


class DecoderModel(DecoderPreTrainedModel):
    """The decoder stack without a head: returns the final-normed hidden states."""

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        scale = (config.hidden_size**0.5 if config.scale_embedding else 1.0) * config.embedding_multiplier
        scale = None if scale == 1.0 else scale
        self.embed_tokens = ScaledEmbedding(config.vocab_size, config.hidden_size, self.padding_idx, scale)
        # Registered before the final norm: accelerate's FSDP2 preparation takes the base model's last `*Norm` child
        # for the final norm and groups it with the LM head.
        self.embedding_layernorm = norm_from_config(config) if config.embedding_layernorm else None
        block = BLOCKS[config.norm_position]
        self.layers = nn.ModuleList([block(config, i) for i in range(config.num_hidden_layers)])
        self.norm = norm_from_config(config) if block.has_final_norm else nn.Identity()
        # Positions (catalogue.POSITION_SCHEMES): each of these is None unless `position_embedding_type` needs it.
        kind = config.position_embedding_type
        if POSITION_SCHEMES[kind].rotary and rotary_per_layer_type(config):  # {layer type: (cos, sin)} (Gemma3)
            self.rotary_emb = LayerTypeRotaryEmbeddings(config, dict.fromkeys(config.layer_types))
        else:
            self.rotary_emb = RotaryEmbedding(config) if POSITION_SCHEMES[kind].rotary else None
        # a fixed sinusoid is fully determined by the config: kept out of checkpoints
        self.embed_positions = position_table(
            kind,
            config.max_position_embeddings,
            config.hidden_size,
            persistent=False,
            offset=config.position_embedding_offset,
        )
        # prefix-LM: keys after the query inside the prefix, so T5's buckets cover both directions
        self.position_bias = position_bias(
            kind,
            config.num_attention_heads,
            config.relative_attention_num_buckets,
            config.relative_attention_max_distance,
            bidirectional=config.prefix_lm,
        )
        # Layer types present, and the first layer of each (the cache layer that sizes its mask and bias).
        self.first_layer_of_type: dict[str, int] = {}
        for i, layer in enumerate(self.layers):
            self.first_layer_of_type.setdefault(layer.attention_type, i)
        self.layer_types = tuple(self.first_layer_of_type)
        self.has_sparse_layers = "sparse" in config.mlp_layer_types  # mixture-of-experts layers (`build_mlp`)
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
        prefix_lengths: torch.LongTensor | None = None,
        output_router_logits: bool | None = None,
        cache: Cache | None = None,
        **kwargs,
    ) -> MoeModelOutputWithPast | tuple:
        r"""prefix_lengths (`torch.LongTensor` of shape `(batch,)`, *optional*):
        With `config.prefix_lm`, the first `prefix_lengths[b]` tokens of row b attend to each other in both
        directions (the prefix must be inside the first forward). None: plain causal attention.
        cache (`Cache`, *optional*): the KV cache, transformers 5.24's name for `past_key_values` (either works)."""
        past_key_values = cache_argument(past_key_values, cache)
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
        fresh_cache = use_cache and past_key_values is None and not self.training

        if inputs_embeds is None:
            check_token_ids(input_ids, embedding_rows(self.embed_tokens))
            inputs_embeds = self.embed_tokens(input_ids)
        batch_size, seq_len = inputs_embeds.shape[:2]
        heads = self.layers[0].self_attn
        if not isinstance(heads, LatentAttention):  # (MLA's cache layers hold its latents: latent_attention.py)
            check_cache_heads(
                past_key_values, heads.num_key_value_heads, heads.head_dim, "num_key_value_heads", "head_dim"
            )
        past = cached_length(past_key_values)  # None only for a static cache on an accelerator
        check_attention_mask(
            attention_mask, batch_size, None if past is None else past + seq_len, keys="cached + new tokens"
        )
        if position_ids is not None and self.embed_positions is not None:
            check_given_position_ids(position_ids, self.embed_positions)
        positions_length = None  # known without reading a tensor when the positions are ours: 0 .. past + seq_len - 1
        if position_ids is None and self.config.position_ids_from_attention_mask and _is_padding_mask(attention_mask):
            position_ids = position_ids_from_mask(attention_mask, seq_len)  # OPT: a padded row starts at 0
        if position_ids is None:
            past_seen = past_key_values.get_seq_length() if past_key_values is not None else 0
            position_ids = torch.arange(seq_len, device=inputs_embeds.device) + past_seen
            position_ids = position_ids.unsqueeze(0)
            positions_length = None if past is None else past + seq_len
        if self.rotary_emb is not None:
            self.rotary_emb.warn_past_max_positions(position_ids, positions_length)

        if prefix_lengths is not None and not self.config.prefix_lm:
            raise ValueError("`prefix_lengths` was given but `config.prefix_lm` is False.")
        masks = build_masks(
            self.config, self.layer_types, inputs_embeds, attention_mask, past_key_values, position_ids, prefix_lengths
        )
        biases = None
        if self.position_bias is not None:  # ALiBi / T5 bias, one per layer type, shared by its layers
            biases = build_position_biases(
                self.position_bias, self.first_layer_of_type, inputs_embeds, attention_mask, past_key_values
            )
        if fresh_cache:
            # Created only after the masks: an empty cache and no cache give the same mask, and only `None` lets
            # transformers detect packed sequences (position ids restarting per document) in eval mode too.
            past_key_values = DynamicCache(config=self.config)
        hidden_states = inputs_embeds  # scaled by `embed_tokens` under `scale_embedding`, as Gemma's
        if self.embed_positions is not None:
            hidden_states = hidden_states + self.embed_positions(position_ids).to(hidden_states.dtype)
        if self.embedding_layernorm is not None:
            hidden_states = self.embedding_layernorm(hidden_states)
        position_embeddings = self.rotary_emb(hidden_states, position_ids) if self.rotary_emb is not None else None
        if position_embeddings is not None and self.config.query_scaling_beta:
            position_embeddings = with_query_scales(position_embeddings, position_ids, self.config)

        all_hidden_states = () if output_hidden_states else None
        all_attentions = () if output_attentions else None
        for layer in self.layers:
            if output_hidden_states:
                all_hidden_states += (hidden_states,)
            # Positional: checkpointing with `use_reentrant=True` back-propagates only a layer's positional inputs
            # itself. T5's learned bias, shared by the layers, as a keyword would have its graph freed by the first.
            if not layer.rotates:  # a NoPE layer (`nope_layers`)
                rotary = None
            elif isinstance(position_embeddings, dict):
                rotary = position_embeddings[layer.attention_type]
            else:
                rotary = position_embeddings
            hidden_states, attn_weights = layer(
                hidden_states,
                masks[layer.attention_type],
                rotary,
                past_key_values,
                None if biases is None else biases[layer.attention_type],
                output_attentions=output_attentions,
                **kwargs,
            )
            if output_attentions:
                all_attentions += (attn_weights,)
        hidden_states = self.norm(hidden_states)
        if output_hidden_states:
            all_hidden_states += (hidden_states,)
        if self.training and self.has_sparse_layers:
            count_expert_loads(self.layers, attention_mask)  # the balancing routers' loads (DeepSeek-V3's biases)
        # one (B·T, K) per sparse layer; () if dense (without the walk over the layers: every decoding step)
        router_logits = collect_router_logits(self.layers) if self.has_sparse_layers else ()
        if output_router_logits is None:
            output_router_logits = self.config.output_router_logits

        output = MoeModelOutputWithPast(
            last_hidden_state=hidden_states,
            **with_cache(past_key_values if use_cache else None),
            hidden_states=all_hidden_states,
            attentions=all_attentions,
            router_logits=router_logits if output_router_logits and router_logits else None,
        )
        return output if return_dict else output.to_tuple()


class DecoderForCausalLM(FastDecodingMixin, DecoderPreTrainedModel, GenerationMixin):
    """Decoder + LM head. In training with `labels`, the head and the loss run chunked and `logits` is None.
    `generate` decodes with a static cache and a compiled step by default on CUDA (fast_decoding.py);
    `generate_batch` (transformers' continuous batching) runs on its paged cache for the variants that allow it
    (continuous_batching.py, `init_continuous_batching`)."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}
    # FSDP2 (transformers-native): the head is gathered once and kept whole, grouped with the final norm (Llama's rule)
    _fsdp_plan = {"lm_head": "keep_full_weight"}

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__(config)
        self.model = DecoderModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=config.lm_head_bias)  # Phi: a bias
        # Gemma2's c · tanh(logits / c); with it the loss runs unchunked (losses.lm_head_loss).
        self.final_logit_softcapping = config.final_logit_softcapping
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
        output_router_logits: bool | None = None,
        prefix_lengths: torch.LongTensor | None = None,
        skip_logits: bool | None = None,
        cache: Cache | None = None,
        **kwargs,
    ) -> MoeCausalLMOutputWithPast | tuple:
        r"""skip_logits (`bool`, *optional*):
        With labels, True returns the loss alone (no logits, as in training; Trainer asks for it in evaluation under
        `use_liger_kernel`), False the logits too, in training as well. None: by `self.training`.
        cache (`Cache`, *optional*): the KV cache, transformers 5.24's name for `past_key_values` (either works)."""
        past_key_values = cache_argument(past_key_values, cache)
        # `shift_labels` (pre-shifted targets, as transformers' loss accepts) comes through kwargs: a named
        # argument with "label" in it would make Trainer wait for it as a label column and report no eval_loss.
        # As in Llama they take the place of `labels`' shift only when `labels` are given: without them there is no
        # loss and the logits come back. Trainer's label smoother and `compute_loss_func`, and TRL's, pop `labels`
        # and keep `shift_labels` (context parallelism adds them, a collator may): the chunked loss then ran on them
        # and returned no logits, and the smoother failed on the missing `logits` (KeyError).
        shift_labels = kwargs.pop("shift_labels", None) if labels is not None else None
        kwargs.pop("shift_labels", None)
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        if output_router_logits is None:
            output_router_logits = self.config.output_router_logits
        outputs = self.model(
            output_router_logits=True,  # the z-loss needs them even when they are not returned
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            **with_cache(past_key_values),
            use_cache=use_cache,
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
            return_dict=True,
            prefix_lengths=prefix_lengths,  # prefix-LM (config.prefix_lm); a named argument so `generate` passes it
            **kwargs,
        )
        hidden_states = outputs.last_hidden_state
        loss, logits = lm_head_loss(
            hidden_states,
            self.lm_head,
            training=self.training if skip_logits is None else skip_logits,
            chunk_size=self.config.lm_loss_chunk_size,
            labels=labels,
            shifted_labels=shift_labels,
            softcap=self.final_logit_softcapping,
            z_loss_coef=self.config.lm_z_loss_coef,
            num_items_in_batch=num_items_in_batch,
            logits_to_keep=logits_to_keep,
            logit_scale=self.config.logit_scale,
        )

        # Mixture of experts: load-balancing loss (returned, and added to the LM loss as Mixtral) and z-loss.
        # Under the Trainer's `num_items_in_batch` each is weighted by this forward's share of the batch's targets, so
        # gradient accumulation and data parallelism add them once per optimizer step (Mixtral adds them per micro-batch
        # and process: gradient_accumulation_steps x processes times one big batch's weight).
        router_logits = outputs.router_logits
        share = 1.0
        if loss is not None:
            share = share_of_batch(labels, shift_labels, num_items_in_batch)
            share = share.to(loss.device) if torch.is_tensor(share) else share
        loss, aux_loss = add_router_losses(
            self.config, loss, router_logits, attention_mask, output_router_logits, share
        )

        output = MoeCausalLMOutputWithPast(
            loss=loss,
            aux_loss=aux_loss,
            logits=logits,
            **with_cache(output_cache(outputs)),
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            router_logits=router_logits if output_router_logits else None,
        )
        return output if return_dict else output.to_tuple()

    def prepare_inputs_for_generation(
        self,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        past_key_values: Cache | None = None,
        is_first_iteration: bool | None = False,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs,
    ) -> dict:
        """transformers' inputs, with prefix-LM's `prefix_lengths` routed for the cache in use.

        `generate` precomputes a static cache's masks without the prefix. In the prefill the model gets the 2D mask
        instead and builds the prefix-LM masks itself; after it, every new token comes after the prefix, where
        prefix-LM attention is causal attention, so the decoding steps take the precomputed masks (fixed shapes,
        what the compiled step needs) and no prefix. A dynamic cache gets the 2D mask and the prefix at every step.
        `inputs_embeds` (a prompt given as embeddings) is a named parameter because `generate` takes it only from
        models whose `prepare_inputs_for_generation` names it.
        """
        past_key_values = cache_argument(past_key_values, cache)
        static = past_key_values is not None and past_key_values.is_compileable
        prefix_lengths = kwargs.get("prefix_lengths")
        if static and prefix_lengths is not None and not is_first_iteration:
            kwargs.pop("prefix_lengths")
        inputs = super().prepare_inputs_for_generation(
            input_ids,
            attention_mask=attention_mask,
            is_first_iteration=is_first_iteration,
            inputs_embeds=inputs_embeds,
            **with_cache(past_key_values),
            **kwargs,
        )
        if inputs.get("prefix_lengths") is not None:
            if static and can_read_values(prefix_lengths) and int(prefix_lengths.max()) > input_ids.shape[1]:
                raise ValueError(
                    f"prefix-LM: `prefix_lengths` reaches {int(prefix_lengths.max())} but the prompt has "
                    f"{input_ids.shape[1]} tokens; the whole prefix must be in the prompt."
                )
            inputs["attention_mask"] = attention_mask
        return inputs

    def init_continuous_batching(self, *args, **kwargs):
        """transformers' continuous batching (`generate_batch`, `continuous_batching_context_manager`,
        `init_continuous_batching`; TRL's `use_transformers_continuous_batching=True`): the model runs on a paged KV
        cache with packed rows (continuous_batching.py), and gives each request the greedy tokens `generate` gives its
        prompt alone. Variants it cannot express (ALiBi, T5's relative bias, prefix-LM, dynamic and longrope RoPE) are
        refused here, by name, before the manager's generation thread starts (there a failure is only logged and every
        request comes back empty)."""
        reason = continuous_batching_refusal(self.config)
        if reason is not None:
            raise NotImplementedError(
                f"{type(self).__name__} cannot run transformers' continuous batching (`generate_batch`, "
                f"`init_continuous_batching`, TRL's `use_transformers_continuous_batching=True`): {reason}. Use "
                "`generate()` with a batch of prompts (TRL's default)."
            )
        return super().init_continuous_batching(*args, **kwargs)

    def _get_stopping_criteria(self, *args, **kwargs) -> StoppingCriteriaList:
        """`generate`'s criteria without transformers' "exceeded the model's predefined maximum length" reminder
        when there is no position table: it comes after the first streamed token, in the middle of the text, while
        RoPE models already warned once before generating (`RotaryEmbedding.warn_past_max_positions`) and ALiBi,
        T5-bias and NoPE models run past the training length by design. Tables keep it (their forward refuses
        positions past the table on CPU; on accelerators the reminder is the only word before the lookup fails)."""
        criteria = super()._get_stopping_criteria(*args, **kwargs)
        if self.model.embed_positions is None:
            for criterion in criteria:
                if isinstance(criterion, MaxLengthCriteria):
                    criterion.max_position_embeddings = None
        return criteria


class DecoderForSequenceClassification(DecoderPreTrainedModel):
    """Classifies a sequence from the hidden state of its last non-pad token (GPT fine-tuning, seed 001).

    The last token is the last one `attention_mask` keeps; without a mask, the last that is not `pad_token_id` (as
    `LlamaForSequenceClassification` finds it, from the ids alone); with neither, the last position. So where the
    pad token is also the end-of-sequence token, a text that ends with it is pooled at that token when a mask is
    given, where Llama's head pools the token before it; and a batch without mask or pad token is pooled at its last
    position, where Llama's head refuses a batch of more than one row.

    With `config.classifier_lm_loss_weight = λ > 0` the loss is L_FT + λ·L_PT, L_PT the next-token loss on the
    input (the auxiliary LM objective of GPT-1); the LM head is tied to the embeddings for that (its logits scaled and
    soft-capped as the causal LM's, `logit_scale` and `final_logit_softcapping`). With sparse layers,
    `output_router_logits` adds the load-balancing loss and `router_z_loss_coef` > 0 the router z-loss, as in
    `DecoderForCausalLM` (Mixtral's classifier adds neither, and fine-tuning it leaves the routers unbalanced).

    It builds and returns a KV cache only when asked (`use_cache=True`, or a cache passed in to continue), whatever
    `config.use_cache` says: `LlamaForSequenceClassification` (transformers' `GenericForSequenceClassification`)
    follows `config.use_cache`, True by default, and so returns a `DynamicCache` from every plain call, which
    `torch.export` and `torch.onnx.export` of the model refuse (`Found <class 'DynamicCache'> in output`) unless
    `use_cache=False` is passed; archlab's token classifier and question-answering heads build none either.
    """

    # The loss follows the Trainer's `num_items_in_batch` (the labels of the whole accumulated batch, on every process
    # under `average_tokens_across_devices`), so gradient accumulation and data parallelism weigh each example as one
    # big batch does: the classification term is this batch's mean weighted by its share of those labels. The
    # auxiliary LM term is a mean over tokens: divided by `num_lm_items_in_batch`, the LM targets of the whole batch,
    # where the trainer gives it (archlab's `AtomicCheckpointTrainer` does, see `auxiliary_lm_targets`), else this
    # batch's token mean weighted by its share of the labels. As a per-micro-batch token mean (the Trainer dividing
    # it by the accumulation steps), a batch of 4 ragged rows accumulated one row at a time moved the weights 24 %
    # away from the one big batch's update.
    accepts_loss_kwargs = True
    # the keys a load leaves out of its report, as the stock classifiers' (none, unless a tool sets some there: TRL's
    # RewardTrainer for a causal LM folder's `lm_head` and the new `score`)
    _keys_to_ignore_on_load_missing = FollowsGenericHead(GenericForSequenceClassification)
    _keys_to_ignore_on_load_unexpected = FollowsGenericHead(GenericForSequenceClassification)

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
        output_router_logits: bool | None = None,
        cache: Cache | None = None,
        **kwargs,
    ) -> SequenceClassifierOutputWithPast | tuple:
        r"""output_router_logits (`bool`, *optional*): with sparse layers, add `router_aux_loss_coef` times the
        load-balancing loss to the loss, as Mixtral's causal LM does (Mixtral's classifiers add none); None reads the
        config. The router z-loss is added whenever `router_z_loss_coef` > 0.
        cache (`Cache`, *optional*): the KV cache, transformers 5.24's name for `past_key_values` (either works)."""
        past_key_values = cache_argument(past_key_values, cache)
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        if output_router_logits is None:
            output_router_logits = self.config.output_router_logits
        num_items_in_batch = kwargs.pop("num_items_in_batch", None)
        num_lm_items_in_batch = kwargs.pop("num_lm_items_in_batch", None)
        if use_cache is None:  # a cache only when asked for, or one given to continue (see the class docstring)
            use_cache = past_key_values is not None
        outputs = self.model(
            output_router_logits=True,  # the router losses need them
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            **with_cache(past_key_values),
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
            # of the accumulated batch's labels (the Trainer counts them as `labels.ne(-100)`)
            share = _share_of_labels(labels, num_items_in_batch, loss.device)
            loss = loss * share
            weight = self.config.classifier_lm_loss_weight
            if weight > 0 and input_ids is not None:
                targets = self._lm_targets(input_ids, attention_mask)
                lm_logits = hidden_states @ embedding_matrix(self.model.embed_tokens, hidden_states.device).t()
                lm_logits = scaled_and_capped(lm_logits, self.config.logit_scale, self.config.final_logit_softcapping)
                if num_lm_items_in_batch is not None:
                    lm_loss = causal_lm_loss(lm_logits, None, num_lm_items_in_batch, shifted_labels=targets)
                else:
                    lm_loss = causal_lm_loss(lm_logits, None, shifted_labels=targets) * share
                loss = loss + weight * lm_loss
            loss, _ = add_router_losses(
                self.config, loss, outputs.router_logits, attention_mask, output_router_logits, share
            )

        output = SequenceClassifierOutputWithPast(
            loss=loss,
            logits=logits,
            **with_cache(output_cache(outputs)),
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )
        return output if return_dict else output.to_tuple()

    def auxiliary_lm_targets(self, batch: dict) -> torch.Tensor | None:
        """The next-token targets of the auxiliary LM loss for a training batch (aligned with the positions, -100 on
        padding), which a trainer counts over the accumulated batch and passes as `num_lm_items_in_batch`; None
        without the loss (`classifier_lm_loss_weight` 0) or without `input_ids`."""
        if self.config.classifier_lm_loss_weight <= 0 or batch.get("input_ids") is None:
            return None
        return self._lm_targets(batch["input_ids"], batch.get("attention_mask"))

    @staticmethod
    def _lm_targets(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        if attention_mask is not None:  # this call's columns of a mask that also covers earlier positions
            attention_mask = attention_mask[:, -input_ids.shape[1] :]
        labels = input_ids if attention_mask is None else input_ids.masked_fill(attention_mask == 0, IGNORE_INDEX)
        return next_token_targets(labels)

    def _last_token_index(
        self, input_ids: torch.Tensor | None, attention_mask: torch.Tensor | None, hidden_states: torch.Tensor
    ) -> torch.Tensor:
        """Index of the last real token per row; works for left and right padding."""
        batch, seq_len = hidden_states.shape[:2]
        positions = torch.arange(seq_len, device=hidden_states.device)
        if attention_mask is not None:
            # this call's columns: a mask also covers the positions before it (a cache given, PEFT's prefix tuning)
            real = attention_mask[:, -seq_len:].to(hidden_states.device).bool()
        elif input_ids is not None and self.config.pad_token_id is not None:
            real = input_ids != self.config.pad_token_id
        else:
            return torch.full((batch,), seq_len - 1, device=hidden_states.device)
        return (positions * real).argmax(-1)


def classifier_dropout(config: DecoderConfig) -> float:
    """The token classifier's dropout, read as transformers' `GenericForTokenClassification` reads it:
    `classifier_dropout`, else `hidden_dropout`, else 0.1 (DecoderConfig declares neither; either can be given)."""
    for name in TOKEN_CLASSIFIER_DROPOUT_FIELDS:
        if getattr(config, name, None) is not None:
            return getattr(config, name)
    return 0.1


class DecoderForTokenClassification(DecoderPreTrainedModel):
    """A label per token (NER, POS tagging) from the final hidden states: dropout, then the `score` Linear (hidden ->
    `num_labels`, with a bias unless `config.token_classification_bias` is False), as `LlamaForTokenClassification`;
    the dropout is `config.classifier_dropout`, else `hidden_dropout`, else 0.1, as there.

    The loss is the cross-entropy over the labels that are not -100, as Llama's; under the Trainer's
    `num_items_in_batch` it is the sum over this batch's labels divided by the accumulated batch's count, so gradient
    accumulation gives the update of one big batch (Llama's head takes the argument and keeps the per-batch mean,
    which the Trainer then does not divide by the accumulation steps: a gradient accumulation_steps times too big).
    With sparse layers, `output_router_logits` adds the load-balancing loss (Mixtral's token classifier adds none),
    and `router_z_loss_coef` > 0 the router z-loss, weighted as in `DecoderForCausalLM`.
    """

    accepts_loss_kwargs = True

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__(config)
        self.num_labels = config.num_labels
        self.model = DecoderModel(config)
        self.dropout = nn.Dropout(classifier_dropout(config))
        bias = getattr(config, "token_classification_bias", True)
        self.score = nn.Linear(config.hidden_size, config.num_labels, bias=bias)
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
        output_router_logits: bool | None = None,
        cache: Cache | None = None,
        **kwargs,
    ) -> TokenClassifierOutput | tuple:
        r"""labels (`torch.LongTensor` of shape `(batch, seq_len)`, *optional*): a class per token, -100 to skip it
        (checked before the forward: the shape, or the same labels flattened, and the classes; `check_token_labels`).
        output_router_logits (`bool`, *optional*): with sparse layers, add `router_aux_loss_coef` times the
        load-balancing loss to the loss; None reads the config.
        cache (`Cache`, *optional*): the KV cache, transformers 5.24's name for `past_key_values` (either works)."""
        past_key_values = cache_argument(past_key_values, cache)
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        if output_router_logits is None:
            output_router_logits = self.config.output_router_logits
        num_items_in_batch = kwargs.pop("num_items_in_batch", None)
        check_token_labels(labels, input_shape(input_ids, inputs_embeds), self.config.num_labels)
        outputs = self.model(
            output_router_logits=True,  # the router losses need them
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            **with_cache(past_key_values),
            use_cache=bool(use_cache),  # the output has no cache to return: none is built unless asked for
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
            return_dict=True,
            **kwargs,
        )
        logits = self.score(self.dropout(outputs.last_hidden_state))  # (B, T, num_labels)

        loss = None
        if labels is not None:
            loss = self.loss_function(logits, labels, self.config, num_items_in_batch=num_items_in_batch)
            share = _share_of_labels(labels, num_items_in_batch, loss.device)
            loss, _ = add_router_losses(
                self.config, loss, outputs.router_logits, attention_mask, output_router_logits, share
            )

        output = TokenClassifierOutput(
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions
        )
        return output if return_dict else output.to_tuple()


class DecoderForQuestionAnswering(DecoderPreTrainedModel):
    """Extractive question answering: the `qa_outputs` Linear (hidden -> 2, with a bias) gives each token a start and
    an end logit, as `LlamaForQuestionAnswering`. The loss is the mean of the start and end cross-entropies, positions
    outside the sequence clamped to its length and ignored, as there.

    The body is `model`, as in every archlab head and in Mistral's, Mixtral's and Qwen2-MoE's QA classes; Llama's,
    Qwen2's and Qwen3's name it `transformer` (checkpoint compatibility), the one difference in parameter names (the
    converter renames it both ways). So a causal LM's folder loads into this class with its body, where
    `LlamaForQuestionAnswering.from_pretrained` of a `LlamaForCausalLM` folder finds no `transformer.*` weights and
    initialises the whole body at random. With sparse layers, `output_router_logits` adds the load-balancing loss
    (Mixtral's QA class adds none), and `router_z_loss_coef` > 0 the router z-loss.
    """

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__(config)
        self.model = DecoderModel(config)
        self.qa_outputs = nn.Linear(config.hidden_size, 2)
        self.post_init()

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        start_positions: torch.LongTensor | None = None,
        end_positions: torch.LongTensor | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        output_router_logits: bool | None = None,
        cache: Cache | None = None,
        **kwargs,
    ) -> QuestionAnsweringModelOutput | tuple:
        r"""start_positions, end_positions (`torch.LongTensor` of shape `(batch,)`, *optional*): the answer's first
        and last token, both or neither (checked before the forward: `check_answer_positions`); positions past the
        sequence are left out of the loss and negative ones read as 0 (the "no answer" index), as in Llama's head.
        output_router_logits (`bool`, *optional*): with sparse layers, add `router_aux_loss_coef` times the
        load-balancing loss to the loss; None reads the config.
        cache (`Cache`, *optional*): the KV cache, transformers 5.24's name for `past_key_values` (either works)."""
        past_key_values = cache_argument(past_key_values, cache)
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        if output_router_logits is None:
            output_router_logits = self.config.output_router_logits
        num_items_in_batch = kwargs.pop("num_items_in_batch", None)
        use_cache = kwargs.pop("use_cache", None)
        shape = input_shape(input_ids, inputs_embeds)
        check_answer_positions(start_positions, end_positions, shape[0] if shape else None)
        outputs = self.model(
            output_router_logits=True,  # the router losses need them
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            **with_cache(past_key_values),
            use_cache=bool(use_cache),  # the output has no cache to return: none is built unless asked for
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
            return_dict=True,
            **kwargs,
        )
        logits = self.qa_outputs(outputs.last_hidden_state)
        start_logits, end_logits = (side.squeeze(-1).contiguous() for side in logits.split(1, dim=-1))

        loss = None
        if start_positions is not None and end_positions is not None:
            loss = self.loss_function(
                start_logits, end_logits, start_positions, end_positions, num_items_in_batch=num_items_in_batch
            )
            share = 1.0  # of the Trainer's `num_items_in_batch`, where given: rows here
            if num_items_in_batch is not None:
                share = start_logits.shape[0] / torch.as_tensor(num_items_in_batch).to(loss.device)
            loss, _ = add_router_losses(
                self.config, loss, outputs.router_logits, attention_mask, output_router_logits, share
            )

        output = QuestionAnsweringModelOutput(
            loss=loss,
            start_logits=start_logits,
            end_logits=end_logits,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )
        return output if return_dict else output.to_tuple()


# Trainer's label smoother (`label_smoothing_factor`: it pops `labels`, so the model's own shifted loss does not run)
# shifts the labels only for the class names of this table; without the entry a causal LM would be trained to predict
# the token it is given. Here rather than in archlab.registration, so that the remote-code copy of this file does it
# too. The auto mapping reads registered classes first and, iterating, skips model types CONFIG_MAPPING_NAMES lacks,
# so the entry changes nothing else there.
modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.setdefault(DecoderConfig.model_type, DecoderForCausalLM.__name__)

__all__ = [
    "DecoderPreTrainedModel",
    "DecoderModel",
    "DecoderForCausalLM",
    "DecoderForSequenceClassification",
    "DecoderForTokenClassification",
    "DecoderForQuestionAnswering",
]
