"""`EncoderForMaskedLM`: archlab's encoder stack alone, with a masked-language-model head (BERT; Devlin et al. 2019);
`EncoderModel`, the same stack without the head (BERT's `BertModel`): what `AutoModel` and
`pipeline("feature-extraction")` load from a masked LM's folder; and the fine-tuning heads that start from a masked
LM's folder as BERT's do, `EncoderForSequenceClassification`, `EncoderForTokenClassification` and
`EncoderForQuestionAnswering` (here, in the masked LM's own file, so a saved masked LM's remote code and `auto_map`
carry them too).

Seed 001 walks through the Hugging Face workflow for it (train a WordPiece tokenizer, mask 15 % of the tokens with
`DataCollatorForLanguageModeling`, train with `Trainer`, query with `pipeline("fill-mask")`); seed 003 places it
among the three architectures: bidirectional self-attention, every position sees every other, and the objective
predicts only the masked tokens.

The encoder is the one of `Seq2SeqModel` (same config, same layers: every catalogue choice applies). The head is
BERT's: dense → activation → norm → projection tied to the token embeddings + a per-token bias.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import initialization as init
from transformers.modeling_outputs import (
    BaseModelOutput,
    MaskedLMOutput,
    QuestionAnsweringModelOutput,
    SequenceClassifierOutput,
    TokenClassifierOutput,
)

from .configuration_seq2seq import Seq2SeqConfig
from .feed_forward import make_activation
from .input_checks import check_answer_positions, check_token_labels, input_shape
from .losses import IGNORE_INDEX, causal_lm_loss
from .modeling_seq2seq import Seq2SeqPreTrainedModel, _architectures
from .normalization import make_norm
from .seq2seq_stacks import Seq2SeqEncoder


class MaskedLMHead(nn.Module):
    """h → norm(act(dense h)) → logits over the vocabulary (BERT's `cls.predictions`, RoBERTa's `lm_head`)."""

    def __init__(self, config: Seq2SeqConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.d_model, config.d_model)
        self.act_fn = make_activation(config.activation_function)
        self.layer_norm = make_norm(config.norm_type, config.d_model, config.layer_norm_eps)
        self.decoder = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.layer_norm(self.act_fn(self.dense(hidden_states)))) + self.bias


# what an encoder-decoder's folder holds beyond its encoder (and the embeddings the encoder reads); a
# `Seq2SeqModel`'s names have no `model.` prefix
DECODER_KEYS = [r"^(model\.)?decoder\.", r"^final_logits_bias$", r"^lm_head\.weight$"]


class EncoderOnlyPreTrainedModel(Seq2SeqPreTrainedModel):
    """What `EncoderModel` and `EncoderForMaskedLM` share: the encoder stack of `Seq2SeqModel` as `self.encoder`
    (the same weight names in both, so either loads the other's folder), and no decoder."""

    _no_split_modules = ["Seq2SeqEncoderLayer"]  # no decoder: accelerate's FSDP wrap policy refuses absent classes
    _own_prefixes: tuple[str, ...] = ("encoder.",)
    _keys_to_ignore_on_load_unexpected = DECODER_KEYS  # an encoder-decoder's folder: its decoder (`from_pretrained`)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """An encoder-decoder's folder (`Seq2SeqForConditionalGeneration`, `Seq2SeqModel`) gives its encoder, as
        `T5EncoderModel` reads a T5 folder: its token embeddings are saved as the shared `model.shared` (`shared` in
        a `Seq2SeqModel`'s folder; the encoder's own copy is a tie, not saved), which is read as the encoder's; the
        decoder and LM head are left
        out. Without this the encoder's embeddings were left random, with only a line in the loading report. The
        model saves under its own names (transformers would save it back under the encoder-decoder's)."""
        renamed = kwargs.get("key_mapping") is None and _architectures(pretrained_model_name_or_path, kwargs) in (
            ["Seq2SeqForConditionalGeneration"],
            ["Seq2SeqModel"],
        )
        if renamed:
            kwargs["key_mapping"] = {r"^(model\.)?shared\.": "encoder.embed_tokens.", r"^model\.encoder\.": "encoder."}
        loaded = super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        if renamed:
            model = loaded[0] if isinstance(loaded, tuple) else loaded
            model._weight_conversions = None
        return loaded

    def _build_encoder(self, config: Seq2SeqConfig) -> None:
        padding_idx = None if config.train_pad_embedding else config.pad_token_id  # as Seq2SeqModel
        self.encoder = Seq2SeqEncoder(config, nn.Embedding(config.vocab_size, config.d_model, padding_idx))

    def init_parallel_plans(self) -> None:
        """The config's TP/FSDP plans cover the encoder-decoder; this model is the encoder alone, so the decoder's and
        `shared`'s rules (which would match nothing here) are dropped."""
        super().init_parallel_plans()
        own = self._own_prefixes
        self._tp_plan = {name: style for name, style in self._tp_plan.items() if name.startswith(own)}
        self._fsdp_plan = {name: style for name, style in self._fsdp_plan.items() if name.startswith(own)}

    def get_input_embeddings(self) -> nn.Embedding:
        return self.encoder.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.encoder.embed_tokens = value

    def _encode(
        self,
        input_ids,
        attention_mask,
        position_ids,
        token_type_ids,
        inputs_embeds,
        output_attentions,
        output_hidden_states,
        **kwargs,
    ) -> BaseModelOutput:
        return self.encoder(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            token_type_ids=token_type_ids,
            inputs_embeds=inputs_embeds,
            output_attentions=output_attentions if output_attentions is not None else self.config.output_attentions,
            output_hidden_states=(
                output_hidden_states if output_hidden_states is not None else self.config.output_hidden_states
            ),
            return_dict=True,
            **kwargs,
        )


class EncoderModel(EncoderOnlyPreTrainedModel):
    """The encoder stack without a head (BERT's `BertModel`): returns its last hidden states, for sentence
    embeddings or a head of one's own. It loads a masked LM's folder (the head's weights are left out), and
    `AutoModel` / `pipeline("feature-extraction")` give it for one (see `Seq2SeqModel.from_pretrained`)."""

    _keys_to_ignore_on_load_unexpected = [*DECODER_KEYS, r"^lm_head\."]  # a masked LM's head, as BertModel `cls.*`

    def __init__(self, config: Seq2SeqConfig) -> None:
        super().__init__(config)
        self._build_encoder(config)
        self.post_init()

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        position_ids: torch.LongTensor | None = None,
        **kwargs,
    ) -> BaseModelOutput | tuple:
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        outputs = self._encode(
            input_ids,
            attention_mask,
            position_ids,
            token_type_ids,
            inputs_embeds,
            output_attentions,
            output_hidden_states,
            **kwargs,
        )
        return outputs if return_dict else outputs.to_tuple()


class EncoderForMaskedLM(EncoderOnlyPreTrainedModel):
    """The encoder stack + `MaskedLMHead`; `labels` are -100 except at the masked positions.

    In training, the head runs only on the positions that carry a label (about 15 % of them with the standard
    collator), and `logits` is None; in evaluation and inference it returns logits for every position.
    """

    _tied_weights_keys = {"lm_head.decoder.weight": "encoder.embed_tokens.weight"}
    # the projection split by vocabulary rows like the embedding it is tied to, the logits gathered
    _tp_plan = {"lm_head.decoder": "colwise_gather_output"}
    _own_prefixes = ("encoder.", "lm_head.")

    def __init__(self, config: Seq2SeqConfig) -> None:
        super().__init__(config)
        self._build_encoder(config)
        self.lm_head = MaskedLMHead(config)
        self.post_init()

    def resize_token_embeddings(self, *args, **kwargs) -> nn.Embedding:
        """The head's per-token bias follows the vocabulary (kept entries keep their value, new ones start at 0)."""
        embeddings = super().resize_token_embeddings(*args, **kwargs)
        size, bias = embeddings.weight.shape[0], self.lm_head.bias
        if bias.shape[0] != size:
            resized = bias.new_zeros(size)
            kept = min(size, bias.shape[0])
            resized[:kept] = bias.detach()[:kept]
            self.lm_head.bias = nn.Parameter(resized, requires_grad=bias.requires_grad)
        return embeddings

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, MaskedLMHead):
            init.zeros_(module.bias)

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head.decoder

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head.decoder = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        token_type_ids: torch.Tensor | None = None,  # segment ids (`type_vocab_size` > 0; else ignored)
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        num_items_in_batch: torch.Tensor | int | None = None,
        position_ids: torch.LongTensor | None = None,
        **kwargs,
    ) -> MaskedLMOutput | tuple:
        r"""position_ids (`torch.LongTensor` of shape `(batch, T)`, *optional*): packed documents (positions restart
        at each one, as `pack_documents(..., causal_labels=False)` writes them) attend only within themselves."""
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        outputs = self._encode(
            input_ids,
            attention_mask,
            position_ids,
            token_type_ids,
            inputs_embeds,
            output_attentions,
            output_hidden_states,
            **kwargs,
        )
        hidden_states = outputs.last_hidden_state  # (B, T, d)
        if labels is not None and labels.shape != hidden_states.shape[:2]:
            raise ValueError(
                f"`labels` has shape {tuple(labels.shape)}; it must be the input's {tuple(hidden_states.shape[:2])}, "
                "one target per token (-100 where nothing is masked)."
            )
        loss, logits = None, None
        if labels is not None and self.training:
            labels = labels.to(hidden_states.device)
            masked = labels != IGNORE_INDEX
            picked_logits = self.lm_head(hidden_states[masked])  # (N_masked, V)
            loss = causal_lm_loss(picked_logits, labels, num_items_in_batch, shifted_labels=labels[masked])
        else:
            logits = self.lm_head(hidden_states)  # (B, T, V)
            if labels is not None:
                loss = causal_lm_loss(logits, labels, num_items_in_batch, shifted_labels=labels)

        output = MaskedLMOutput(
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions
        )
        return output if return_dict else output.to_tuple()


# the seed of a new pooler's weights (see `EncoderForSequenceClassification._init_weights`)
POOLER_SEED = 0


class EncoderPooler(nn.Module):
    """BERT's pooler (`BertPooler`): the first token's ([CLS]) state → dense → tanh."""

    def __init__(self, config: Seq2SeqConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.d_model, config.d_model)
        self.activation = nn.Tanh()

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.activation(self.dense(hidden_states[:, 0]))


def classifier_dropout(config: Seq2SeqConfig) -> float:
    """BERT's `classifier_dropout`, falling back to the hidden states' dropout (BERT's `hidden_dropout_prob`)."""
    return config.classifier_dropout if config.classifier_dropout is not None else config.dropout


def share_of_the_batch(labels: torch.Tensor, num_items_in_batch, device: torch.device) -> torch.Tensor | float:
    """This batch's share of the labels the Trainer counted over the accumulated batch (`labels.ne(-100)`, on every
    process under `average_tokens_across_devices`); 1 without that count."""
    if num_items_in_batch is None:
        return 1.0
    return labels.ne(IGNORE_INDEX).sum().to(device) / torch.as_tensor(num_items_in_batch).to(device)


class EncoderForSequenceClassification(EncoderOnlyPreTrainedModel):
    """BERT's sequence classifier (`BertForSequenceClassification`) on archlab's encoder: the first token's state
    (the tokenizer's [CLS], archlab's masked-LM tokenizer's `<s>`) → BERT's pooler (dense + tanh;
    `config.classifier_pooler`) → dropout (`config.classifier_dropout`, else `dropout`) → a linear classifier. With
    `config.classifier_dropout_before_pooler` the same dropout also comes before the pooler: RoBERTa's head (dropout,
    dense + tanh, dropout, out_proj), which a converted `RobertaForSequenceClassification` has.

    The loss is BERT's, chosen by `config.problem_type` (set from `num_labels` and the labels' dtype on the first
    call when None): mean squared error (`"regression"`), cross-entropy (`"single_label_classification"`) or binary
    cross-entropy with logits (`"multi_label_classification"`). A masked LM's folder loads into it: its encoder's
    weights are kept, its MLM head is left out, and the pooler and classifier start new. A new pooler is BERT's
    N(0, `init_std`) draw from a fixed seed, the same at every load: a masked LM's folder has none (a BERT checkpoint
    has its pretrained one), and PEFT's `task_type="SEQ_CLS"` saves only `classifier`, so a LoRA adapter reloaded on
    the masked LM's folder met another random pooler and gave other predictions.

    Under the Trainer's gradient accumulation the loss is this batch's mean weighted by its share of the labels of
    the whole accumulated batch (`num_items_in_batch`), so uneven batches weigh each example as one big batch does
    (as `DecoderForSequenceClassification`); called without it, it is BERT's loss.
    """

    _keys_to_ignore_on_load_unexpected = [*DECODER_KEYS, r"^lm_head\."]  # a masked LM's head, as BertModel `cls.*`
    accepts_loss_kwargs = True

    def __init__(self, config: Seq2SeqConfig) -> None:
        super().__init__(config)
        self.num_labels = config.num_labels
        self._build_encoder(config)
        self.pooler = EncoderPooler(config) if config.classifier_pooler else None
        self.dropout = nn.Dropout(classifier_dropout(config))
        self.classifier = nn.Linear(config.d_model, config.num_labels)
        self.post_init()

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if module is getattr(self.pooler, "dense", None):  # (transformers skips the pooler: it has no own tensors)
            generator = torch.Generator().manual_seed(POOLER_SEED)
            draw = torch.randn(module.weight.shape, generator=generator) * self.config.init_std
            init.copy_(module.weight, draw.to(device=module.weight.device, dtype=module.weight.dtype))
            init.zeros_(module.bias)

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,  # segment ids (`type_vocab_size` > 0; else ignored)
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        position_ids: torch.LongTensor | None = None,
        **kwargs,
    ) -> SequenceClassifierOutput | tuple:
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        num_items_in_batch = kwargs.pop("num_items_in_batch", None)
        outputs = self._encode(
            input_ids,
            attention_mask,
            position_ids,
            token_type_ids,
            inputs_embeds,
            output_attentions,
            output_hidden_states,
            **kwargs,
        )
        hidden_states = outputs.last_hidden_state  # (B, T, d)
        first = hidden_states[:, :1]  # (B, 1, d): the first token's state
        if self.pooler is not None and self.config.classifier_dropout_before_pooler:  # RoBERTa's head
            first = self.dropout(first)
        pooled = self.pooler(first) if self.pooler is not None else first[:, 0]
        logits = self.classifier(self.dropout(pooled))  # (B, num_labels)

        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, pooled_logits=logits, config=self.config)
            loss = loss * share_of_the_batch(labels, num_items_in_batch, loss.device)

        output = SequenceClassifierOutput(
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions
        )
        return output if return_dict else output.to_tuple()


class EncoderForTokenClassification(EncoderOnlyPreTrainedModel):
    """BERT's token classifier (`BertForTokenClassification`, named-entity recognition, tagging) on archlab's
    encoder: every token's state → dropout (`config.classifier_dropout`, else `dropout`) → a linear classifier; the
    loss is the cross-entropy over the tokens whose label is not -100.

    Under the Trainer's gradient accumulation the loss is summed over the batch's labelled tokens and divided by
    those of the whole accumulated batch (`num_items_in_batch`), so uneven batches weigh each token as one big batch
    does; called without it, it is BERT's mean over this batch's labelled tokens.
    """

    _keys_to_ignore_on_load_unexpected = [*DECODER_KEYS, r"^lm_head\."]  # a masked LM's head, as BertModel `cls.*`
    accepts_loss_kwargs = True

    def __init__(self, config: Seq2SeqConfig) -> None:
        super().__init__(config)
        self.num_labels = config.num_labels
        self._build_encoder(config)
        self.dropout = nn.Dropout(classifier_dropout(config))
        self.classifier = nn.Linear(config.d_model, config.num_labels)
        self.post_init()

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        token_type_ids: torch.Tensor | None = None,  # segment ids (`type_vocab_size` > 0; else ignored)
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        position_ids: torch.LongTensor | None = None,
        **kwargs,
    ) -> TokenClassifierOutput | tuple:
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        num_items_in_batch = kwargs.pop("num_items_in_batch", None)
        check_token_labels(labels, input_shape(input_ids, inputs_embeds), self.config.num_labels)
        outputs = self._encode(
            input_ids,
            attention_mask,
            position_ids,
            token_type_ids,
            inputs_embeds,
            output_attentions,
            output_hidden_states,
            **kwargs,
        )
        hidden_states = outputs.last_hidden_state  # (B, T, d)
        logits = self.classifier(self.dropout(hidden_states))  # (B, T, num_labels)

        loss = None
        if labels is not None:
            loss = self.loss_function(logits, labels, self.config, num_items_in_batch=num_items_in_batch)

        output = TokenClassifierOutput(
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions
        )
        return output if return_dict else output.to_tuple()


class EncoderForQuestionAnswering(EncoderOnlyPreTrainedModel):
    """BERT's extractive question answering (`BertForQuestionAnswering`, SQuAD) on archlab's encoder: every token's
    state -> `qa_outputs` (a Linear, d_model -> 2, with a bias) -> a start and an end logit per token. The loss is
    BERT's: the mean of the start and end cross-entropies over the batch, positions clamped to the sequence length
    and those past it left out (an answer cut off by the window), as transformers' `ForQuestionAnsweringLoss`.

    A masked LM's folder loads into it with its encoder (the MLM head left out, `qa_outputs` new); a converted
    `BertForQuestionAnswering` folder gives BERT's logits and loss.
    """

    _keys_to_ignore_on_load_unexpected = [*DECODER_KEYS, r"^lm_head\."]  # a masked LM's head, as BertModel `cls.*`

    def __init__(self, config: Seq2SeqConfig) -> None:
        super().__init__(config)
        self._build_encoder(config)
        self.qa_outputs = nn.Linear(config.d_model, 2)
        self.post_init()

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        start_positions: torch.LongTensor | None = None,
        end_positions: torch.LongTensor | None = None,
        token_type_ids: torch.Tensor | None = None,  # segment ids (`type_vocab_size` > 0; else ignored)
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        position_ids: torch.LongTensor | None = None,
        **kwargs,
    ) -> QuestionAnsweringModelOutput | tuple:
        r"""start_positions, end_positions (`torch.LongTensor` of shape `(batch,)`, *optional*): the answer's first
        and last token, both or neither (checked before the forward: `check_answer_positions`); positions past the
        sequence are left out of the loss and negative ones read as 0 (the "no answer" index), as in BERT's head."""
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        kwargs.pop("num_items_in_batch", None)  # (the Trainer counts `labels`, which QA batches do not have)
        shape = input_shape(input_ids, inputs_embeds)
        check_answer_positions(start_positions, end_positions, shape[0] if shape else None)
        outputs = self._encode(
            input_ids,
            attention_mask,
            position_ids,
            token_type_ids,
            inputs_embeds,
            output_attentions,
            output_hidden_states,
            **kwargs,
        )
        logits = self.qa_outputs(outputs.last_hidden_state)  # (B, T, 2)
        start_logits, end_logits = (side.squeeze(-1).contiguous() for side in logits.split(1, dim=-1))

        loss = None
        if start_positions is not None and end_positions is not None:
            loss = self.loss_function(start_logits, end_logits, start_positions, end_positions)

        output = QuestionAnsweringModelOutput(
            loss=loss,
            start_logits=start_logits,
            end_logits=end_logits,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )
        return output if return_dict else output.to_tuple()


__all__ = [
    "EncoderForMaskedLM",
    "EncoderForQuestionAnswering",
    "EncoderForSequenceClassification",
    "EncoderForTokenClassification",
    "EncoderModel",
    "EncoderOnlyPreTrainedModel",
    "EncoderPooler",
    "MaskedLMHead",
]
