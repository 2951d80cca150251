"""archlab's encoder-decoder: `Seq2SeqModel` and `Seq2SeqForConditionalGeneration`.

The Transformer of "Attention Is All You Need" (Vaswani et al. 2017; seeds 000 §5.1, 001 "encoder-decoder",
003 "where cross-attention's keys and values come from"):

    encoder:  x = embed(src)·√d + PE  →  N × [ self-attention (bidirectional, source padding masked) → FFN ]
    decoder:  y = embed(tgt)·√d + PE  →  N × [ masked self-attention → cross-attention over the encoder's
              final output (source padding masked) → FFN ]  →  linear (tied to the embeddings) → softmax

each sub-layer wrapped as LayerNorm(x + Dropout(sublayer(x))) with the default post-norm; `norm_position` moves the
norm before the sub-layer ("pre", with a final norm per stack) or around it ("sandwich"). The layers are in
`seq2seq_layers.py`, the stacks in `seq2seq_stacks.py`; this file holds the models and the generation head.
Training is teacher forcing: `labels` are shifted right behind `decoder_start_token_id` (mBART: behind each row's
last label token, `label_shift`) to make the decoder input, and the loss compares logits with the *unshifted*
labels. Generation (greedy, sampling, beam search) runs through `GenerationMixin` with an `EncoderDecoderCache`: the
encoder runs once, every cross-attention layer projects its keys/values once.

Module and parameter names are Marian's (`model.encoder.layers.N.self_attn.out_proj`, `fc1`, `fc2`,
`self_attn_layer_norm`, `encoder_attn`, `final_layer_norm`, `final_logits_bias`, ...), so a Marian-equivalent config
loads a `MarianMTModel` state dict with `strict=True` and computes the same function.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import initialization as init
from transformers.cache_utils import EncoderDecoderCache
from transformers.generation import GenerationMixin
from transformers.modeling_outputs import BaseModelOutput, Seq2SeqLMOutput, Seq2SeqModelOutput
from transformers.modeling_utils import PreTrainedModel

from .cache_names import cache_argument, output_cache, with_cache
from .configuration_seq2seq import Seq2SeqConfig
from .fast_decoding import FastDecodingMixin, reorder_cache_in_place
from .losses import IGNORE_INDEX, lm_head_loss
from .pretrained import ArchlabPreTrainedModel
from .seq2seq_stacks import Seq2SeqDecoder, Seq2SeqEncoder


def shift_tokens_right(
    labels: torch.Tensor, pad_token_id: int | None, decoder_start_token_id: int | None
) -> torch.Tensor:
    """Teacher forcing: decoder input = [start, y_0, ..., y_{T-2}]; ignored label positions (-100) become padding."""
    for name, value in (("pad_token_id", pad_token_id), ("decoder_start_token_id", decoder_start_token_id)):
        if value is None:
            raise ValueError(
                f"`{name}` must be set in the config to build `decoder_input_ids` from `labels` "
                "(or pass `decoder_input_ids`)."
            )
    shifted = labels.new_full(labels.shape, decoder_start_token_id)
    shifted[:, 1:] = labels[:, :-1]
    return shifted.masked_fill_(shifted == IGNORE_INDEX, pad_token_id)


def shift_tokens_right_wrapping_last(labels: torch.Tensor, pad_token_id: int | None) -> torch.Tensor:
    """mBART's teacher forcing (`label_shift="wrap_last_token"`): decoder input = [y_last, y_0, ..., y_{T-2}], where
    y_last is each row's last real label token (the target-language code mBART's tokenizer appends after `</s>`);
    ignored label positions (-100) become padding. As `MBartForConditionalGeneration`, the real tokens are counted
    (right-padded labels); a row without any starts with padding."""
    if pad_token_id is None:
        raise ValueError(
            "`pad_token_id` must be set in the config to build `decoder_input_ids` from `labels` (or pass "
            "`decoder_input_ids`)."
        )
    tokens = labels.masked_fill(labels == IGNORE_INDEX, pad_token_id)
    last = (tokens.ne(pad_token_id).sum(dim=1, keepdim=True) - 1).clamp(min=0)
    shifted = torch.empty_like(tokens)
    shifted[:, 1:] = tokens[:, :-1]
    shifted[:, :1] = tokens.gather(1, last)
    return shifted


def decoder_input_ids_from_labels(labels: torch.Tensor, config: Seq2SeqConfig) -> torch.Tensor:
    """Teacher forcing's decoder input, as the config's `label_shift` says."""
    if config.label_shift == "wrap_last_token":
        return shift_tokens_right_wrapping_last(labels, config.pad_token_id)
    return shift_tokens_right(labels, config.pad_token_id, config.decoder_start_token_id)


def check_one_target_per_source(labels: torch.Tensor, input_ids, inputs_embeds, encoder_outputs) -> None:
    """`labels` hold one target sequence per source: a batch of another size is a ValueError naming both (the
    decoder would fail in its cross-attention with a bare matrix-size error)."""
    sources = {
        "input_ids": input_ids,
        "inputs_embeds": inputs_embeds,
        "encoder_outputs": None if encoder_outputs is None else encoder_outputs[0],
    }
    for name, source in sources.items():
        if source is not None:
            if labels.shape[0] != source.shape[0]:
                raise ValueError(
                    f"`labels` has {labels.shape[0]} rows but `{name}` has {source.shape[0]}: one target sequence "
                    "per source."
                )
            return


class TiedEmbedding(nn.Embedding):
    """A stack's token embedding that `_tied_weights_keys` ties to `source` (`shared`): transformers replaces its
    weight with the source's parameter after initialisation, and after loading (tying the parameter that a
    checkpoint has). Until then it holds an uninitialised placeholder: it draws no random numbers, neither here nor
    in `_init_weights`, so a seed builds the same model as when the stacks used the `shared` module itself."""

    is_tied_alias = True  # `ArchlabPreTrainedModel._init_weights` leaves it alone

    def __init__(self, source: nn.Embedding) -> None:
        placeholder = torch.empty_like(source.weight)
        super().__init__(source.num_embeddings, source.embedding_dim, source.padding_idx, _weight=placeholder)


class Seq2SeqPreTrainedModel(ArchlabPreTrainedModel):
    config_class = Seq2SeqConfig
    config: Seq2SeqConfig
    _no_split_modules = ["Seq2SeqEncoderLayer", "Seq2SeqDecoderLayer"]

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
        super()._init_weights(module)
        if isinstance(module, Seq2SeqForConditionalGeneration):
            init.zeros_(module.final_logits_bias)

    def resize_token_embeddings(self, *args, **kwargs) -> nn.Embedding:
        """With a shared vocabulary, `decoder_vocab_size` follows `vocab_size` (the config requires them equal, so
        the base model and the masked LM could not be saved after a resize otherwise)."""
        embeddings = super().resize_token_embeddings(*args, **kwargs)
        if self.config.share_encoder_decoder_embeddings:
            self.config.decoder_vocab_size = embeddings.weight.shape[0]
        self._warn_if_resize_left_an_unsavable_config(f"resize_token_embeddings to {embeddings.weight.shape[0]}")
        return embeddings


ENCODER_ONLY_FOLDERS = (
    ["EncoderForMaskedLM"],
    ["EncoderModel"],
    ["EncoderForSequenceClassification"],
    ["EncoderForTokenClassification"],
)
_HUB_ARGUMENTS = ("cache_dir", "force_download", "local_files_only", "token", "revision", "subfolder", "proxies")


def _architectures(pretrained_model_name_or_path, kwargs: dict) -> list[str] | None:
    """The `architectures` of the config `from_pretrained` will use (None where it cannot be read here: loading
    then reports the problem itself)."""
    config = kwargs.get("config")
    if isinstance(config, Seq2SeqConfig):
        return config.architectures
    try:
        config_dict, _ = Seq2SeqConfig.get_config_dict(
            config or pretrained_model_name_or_path, **{k: kwargs[k] for k in _HUB_ARGUMENTS if k in kwargs}
        )
    except (OSError, ValueError, TypeError):
        return None
    return config_dict.get("architectures")


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

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """A masked LM's folder (or an `EncoderModel`'s, or an encoder classifier's) gives its encoder,
        `EncoderModel`, as `BertModel` does for a BERT folder: `AutoModel` maps the seq2seq config to this class, and
        building it there made a decoder of random weights that then asked for `decoder_input_ids`
        (`pipeline("feature-extraction")` failed)."""
        if cls is Seq2SeqModel and _architectures(pretrained_model_name_or_path, kwargs) in ENCODER_ONLY_FOLDERS:
            from .modeling_masked_lm import EncoderModel  # (it imports this module)

            return EncoderModel.from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        return super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)

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
        cache: EncoderDecoderCache | None = None,
        **kwargs,
    ) -> Seq2SeqModelOutput | tuple:
        past_key_values = cache_argument(past_key_values, cache)  # `cache` from transformers 5.24 on
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
            **with_cache(past_key_values),
            inputs_embeds=decoder_inputs_embeds,
            use_cache=use_cache,
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
            return_dict=True,
            **kwargs,
        )
        output = Seq2SeqModelOutput(
            last_hidden_state=decoder_outputs.last_hidden_state,
            **with_cache(output_cache(decoder_outputs)),
            decoder_hidden_states=decoder_outputs.hidden_states,
            decoder_attentions=decoder_outputs.attentions,
            cross_attentions=decoder_outputs.cross_attentions,
            encoder_last_hidden_state=encoder_outputs.last_hidden_state,
            encoder_hidden_states=encoder_outputs.hidden_states,
            encoder_attentions=encoder_outputs.attentions,
        )
        return output if return_dict else output.to_tuple()


class Seq2SeqForConditionalGeneration(FastDecodingMixin, Seq2SeqPreTrainedModel, GenerationMixin):
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
        return embeddings

    def _resize_token_embeddings(self, new_num_tokens, pad_to_multiple_of=None, mean_resizing=True) -> nn.Embedding:
        """Separate vocabularies (`share_encoder_decoder_embeddings=False`): `resize_token_embeddings` is the source
        side alone, as Marian's; transformers' also resized an untied head, to the source size, which then no longer
        matched the target embeddings and `final_logits_bias` (a shape error in the next forward).
        `resize_decoder_token_embeddings` resizes the target side."""
        if self.config.share_encoder_decoder_embeddings:
            return super()._resize_token_embeddings(new_num_tokens, pad_to_multiple_of, mean_resizing)
        old = self.get_input_embeddings()
        new = self._get_resized_embeddings(old, new_num_tokens, pad_to_multiple_of, mean_resizing)
        new.requires_grad_(old.weight.requires_grad)
        self.set_input_embeddings(new)
        return self.get_input_embeddings()

    def resize_decoder_token_embeddings(self, new_num_tokens: int | None) -> nn.Embedding:
        """Marian's: the target vocabulary of separate vocabularies -- the decoder's embeddings, the head (tied or
        not), `final_logits_bias` and `decoder_vocab_size`."""
        if self.config.share_encoder_decoder_embeddings:
            raise ValueError(
                "`resize_decoder_token_embeddings` resizes the target side of separate vocabularies, but "
                "`share_encoder_decoder_embeddings` is True: use `resize_token_embeddings`."
            )
        decoder = self.get_decoder()
        if new_num_tokens is None:  # Marian's: the target embeddings as they are
            return decoder.embed_tokens
        decoder.embed_tokens = self._get_resized_embeddings(decoder.embed_tokens, new_num_tokens)
        if not self.config.tie_word_embeddings:
            self.lm_head = self._get_resized_lm_head(self.lm_head, new_num_tokens)
        bias = self.final_logits_bias.new_zeros(1, new_num_tokens)
        kept = min(new_num_tokens, self.final_logits_bias.shape[1])
        bias[:, :kept] = self.final_logits_bias[:, :kept]
        self.final_logits_bias = bias
        self.config.decoder_vocab_size = new_num_tokens
        self.tie_weights()
        self._warn_if_resize_left_an_unsavable_config(f"resize_decoder_token_embeddings to {new_num_tokens}")
        return decoder.embed_tokens

    def _reorder_cache(self, past_key_values: EncoderDecoderCache, beam_idx: torch.LongTensor) -> EncoderDecoderCache:
        """Beam search (`generate` calls this between steps): reorder the self-attention cache only (a static one in
        place, `reorder_cache_in_place`). Beams move only within their own input's group, whose cross-attention
        keys/values are identical copies, so reordering those would copy (layers × beams × source length × d_model)
        values per step for nothing."""
        reorder_cache_in_place(past_key_values.self_attention_cache, beam_idx)
        return past_key_values

    def init_continuous_batching(self, *args, **kwargs):
        """transformers' continuous batching (`generate_batch`, `init_continuous_batching`) packs decoder-only
        requests into one row: it has no encoder pass, and MarianMTModel's requests come back empty, the failure only
        logged. Refused here by name, before the manager's thread starts."""
        raise NotImplementedError(
            f"{type(self).__name__} cannot run transformers' continuous batching (`generate_batch`, "
            "`init_continuous_batching`): it packs decoder-only requests and runs no encoder. Use `generate()` with a "
            "batch of sources."
        )

    def prepare_decoder_input_ids_from_labels(self, labels: torch.Tensor) -> torch.Tensor:
        """Used by `DataCollatorForSeq2Seq` (needed when the Trainer pops `labels` for label smoothing)."""
        return decoder_input_ids_from_labels(labels, self.config)

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
        skip_logits: bool | None = None,
        cache: EncoderDecoderCache | None = None,
        **kwargs,
    ) -> Seq2SeqLMOutput | tuple:
        r"""skip_logits (`bool`, *optional*):
        With labels, True returns the loss alone (no logits, as in training; Trainer asks for it in evaluation under
        `use_liger_kernel`), False the logits too, in training as well. None: by `self.training`.
        cache (`EncoderDecoderCache`, *optional*): transformers 5.24's name for `past_key_values` (either works)."""
        past_key_values = cache_argument(past_key_values, cache)
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        if labels is not None:
            use_cache = False
            check_one_target_per_source(labels, input_ids, inputs_embeds, encoder_outputs)
            if decoder_input_ids is None and decoder_inputs_embeds is None:
                decoder_input_ids = self.prepare_decoder_input_ids_from_labels(labels)
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            decoder_input_ids=decoder_input_ids,
            decoder_attention_mask=decoder_attention_mask,
            encoder_outputs=encoder_outputs,
            **with_cache(past_key_values),
            inputs_embeds=inputs_embeds,
            decoder_inputs_embeds=decoder_inputs_embeds,
            use_cache=use_cache,
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
            return_dict=True,
            **kwargs,
        )
        hidden_states = outputs.last_hidden_state * self.output_scale  # (B, T, d)
        loss, logits = lm_head_loss(
            hidden_states,
            self.lm_head,
            training=self.training if skip_logits is None else skip_logits,
            chunk_size=self.config.lm_loss_chunk_size,
            shifted_labels=labels,  # aligned with the decoder input already (shifted right behind the start token)
            output_bias=self.final_logits_bias,
            softcap=self.final_logit_softcapping,
            num_items_in_batch=num_items_in_batch,
            logits_to_keep=logits_to_keep,
        )

        output = Seq2SeqLMOutput(
            loss=loss,
            logits=logits,
            **with_cache(output_cache(outputs)),
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
    "shift_tokens_right_wrapping_last",
]
