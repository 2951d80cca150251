"""`Seq2SeqConfig`: the configuration of archlab's encoder-decoder and of its encoder as a masked LM.

Field names and meanings follow `MarianConfig` / `BartConfig` (`d_model`, `encoder_layers`, `decoder_ffn_dim`,
`activation_function`, `scale_embedding`, `decoder_start_token_id`, ...). The defaults are the base model of
"Attention Is All You Need" (Vaswani et al. 2017; seeds 000 §5.1, 001 and 003): 6 + 6 layers, d_model 512, 8 heads,
ReLU feed-forward of 2048, dropout 0.1, post-LayerNorm, sinusoidal positions (the paper's interleaved layout) added
to embeddings scaled by sqrt(d_model), one vocabulary shared by source, target and output projection.

The catalogue's blocks are config choices here too (seed 000 §5.2, seed 004): `norm_type`, `norm_position`,
`mlp_type`, `position_embedding_type` (T5's relative bias among them) and grouped-query attention through
`encoder_key_value_heads` / `decoder_key_value_heads`. With T5's own fields (`d_kv`, `scale_decoder_outputs`) and
GPT-2's `scale_attn_weights`, T5 (Raffel et al. 2020), T5 v1.1 / flan-T5 and mT5 (Xue et al. 2021) are configs of this
model, at parity with `T5ForConditionalGeneration` / `MT5ForConditionalGeneration`, and so is UMT5 (Chung et al. 2023)
with `relative_attention_bias_per_layer`; `clamp_fp16_hidden_states` is T5's fp16 overflow guard (docs/seq2seq.md
has the mapping). The decoder's stability fields (seed 004) apply here
too, with the same names: `use_qk_norm`, `attn_logit_softcapping`, `final_logit_softcapping`.

Every impossible value fails here, at construction, with a `ValueError` naming the field and what is allowed.
This file is part of the flat `modeling/` folder that the remote-code export copies: torch/transformers imports and
sibling modules only.
"""

from __future__ import annotations

from typing import Any

from huggingface_hub.dataclasses import strict
from transformers.configuration_utils import PreTrainedConfig

from .catalogue import (
    LABEL_SHIFTS,
    MLP_TYPES,
    NORM_TYPES,
    SEQ2SEQ_NORM_POSITIONS,
    SEQ2SEQ_POSITION_SCHEMES,
    SINUSOIDAL_LAYOUTS,
)
from .validation import (
    ACTIVATIONS,
    check_attention_backend,
    check_choice,
    check_field_types,
    check_non_negative,
    check_positive,
    check_probability,
    check_relative_buckets,
    requested_attention,
)

TP_ATTENTION = {"q_proj": "colwise", "k_proj": "colwise", "v_proj": "colwise", "out_proj": "rowwise"}


@strict
class Seq2SeqConfig(PreTrainedConfig):
    r"""Configuration of [`Seq2SeqModel`], [`Seq2SeqForConditionalGeneration`], [`EncoderForMaskedLM`] and its
    fine-tuning heads [`EncoderForSequenceClassification`] and [`EncoderForTokenClassification`].

    Marian/Bart fields (same names and meanings): `vocab_size`, `decoder_vocab_size` (Marian: the target vocabulary
    when embeddings are not shared; defaults to `vocab_size`), `d_model`, `encoder_layers`, `decoder_layers`,
    `encoder_attention_heads`, `decoder_attention_heads`, `encoder_ffn_dim`, `decoder_ffn_dim`,
    `activation_function`, `dropout`, `attention_dropout`, `activation_dropout`, `encoder_layerdrop`,
    `decoder_layerdrop`, `max_position_embeddings`, `init_std`, `scale_embedding` (multiply token embeddings by
    sqrt(d_model)), `share_encoder_decoder_embeddings`, `tie_word_embeddings` (output projection = target
    embeddings), `use_cache`, `pad_token_id`, `bos_token_id`, `eos_token_id`, `decoder_start_token_id`,
    `forced_eos_token_id`.

    archlab fields:
        norm_type (`str`, defaults to `"layer_norm"`): `"layer_norm"`, `"rms_norm"`, `"offset_rms_norm"` or
            `"offset_layer_norm"`.
        layer_norm_eps (`float`, defaults to 1e-5): epsilon of every norm (nn.LayerNorm's default, as Marian).
        norm_position (`str`, defaults to `"post"`): `"post"` (the paper, Marian: norm after each residual add),
            `"pre"` (norm before each sub-layer, plus a final norm per stack: mBART, T5) or `"sandwich"` (pre and
            post norm around each sub-layer, inside the residual).
        mlp_type (`str`, defaults to `"plain"`): `"plain"` = fc2(act(fc1 x)); `"gated"` = fc2(act(a) ⊙ b) with
            [a, b] = fc1 x (SwiGLU with `activation_function="silu"`, GeGLU with `"gelu"`).
        position_embedding_type (`str`, defaults to `"sinusoidal"`): `"sinusoidal"` (fixed table),
            `"learned"` (a trained table of `max_position_embeddings` rows), `"relative_bias"` (T5's bucketed
            relative attention bias) or `"none"`.
        sinusoidal_layout (`str`, defaults to `"interleaved"`): `"interleaved"` (the paper) or `"split"` (Marian).
        encoder_key_value_heads / decoder_key_value_heads (`int`, default to the attention heads): GQA/MQA.
        attention_bias, mlp_bias (`bool`, default to True): biases of the q/k/v/o projections and of fc1/fc2.
        relative_attention_num_buckets, relative_attention_max_distance (`int`, 32 and 128): T5's bucketing.
        relative_attention_bias_per_layer (`bool`, defaults to False): with `position_embedding_type=
            "relative_bias"`, False is T5/mT5 (one bias table per stack, shared by its layers) and True is UMT5
            (Chung et al. 2023: every self-attention layer has its own table; cross-attention has none either way).
            Only `position_embedding_type="relative_bias"` has a table, so True requires it.
        d_kv (`int`, *optional*): T5's size of each attention head (q/k/v project to heads × d_kv); defaults to
            `d_model // heads` of each stack, as Marian/Bart.
        scale_attn_weights (`bool`, defaults to True): GPT-2's flag: scores are q·kᵀ / sqrt(head size). T5 uses
            False (scores = q·kᵀ; its initialisation of q folds the scale in).
        scale_decoder_outputs (`bool`, defaults to False): T5's flag: multiply the decoder's output by
            d_model^-0.5 before the LM head (original T5, whose head is the tied embedding matrix; not T5 v1.1).
        clamp_fp16_hidden_states (`bool`, defaults to False): T5's fp16 guard: in float16, after every sub-layer's
            residual add, if any hidden state overflowed to ±inf, clamp them all to ±(finfo.max - 1000), so the next
            norm sees finite values (decided on the device, no host synchronisation). The T5 family converts with
            True; other dtypes are never touched.
        train_pad_embedding (`bool`, defaults to False): whether the pad token's embedding row is trained. False is
            Marian/Bart's `padding_idx` (that row stays zero and gets no gradient); T5 trains it, since it starts
            decoding from the pad token.
        use_qk_norm (`bool`, defaults to False): a `norm_type` norm over each head's queries and keys, in self- and
            cross-attention (Qwen3 `q_norm`/`k_norm`; seed 004), as `DecoderConfig.use_qk_norm`.
        attn_logit_softcapping (`float`, *optional*): c · tanh(s / c) on attention scores (Gemma2); SDPA cannot do
            it, so the default backend falls back to eager and an explicit `attn_implementation="sdpa"` fails.
        final_logit_softcapping (`float`, *optional*): c · tanh(z / c) on the output logits (Gemma2); the training
            loss then runs unchunked.
        lm_loss_chunk_size (`int`, defaults to 1024): in training, the LM head and cross-entropy run over chunks of
            this many tokens so the full (tokens, vocab) logits never exist at once; 0 turns chunking off. The
            chunked loss computes its gradients in the forward pass: one backward through it (not two with
            `retain_graph=True`, which then needs 0).
        embedding_layernorm (`bool`, defaults to False): a norm right after the embeddings of each stack (Bart's
            `layernorm_embedding`, BERT's embedding LayerNorm), as `DecoderConfig.embedding_layernorm`.
        position_embedding_offset (`int`, defaults to 0): a `"learned"` table with this many extra leading rows,
            looked up at position + offset (Bart's has 2), as `DecoderConfig.position_embedding_offset`.
        position_ids_from_attention_mask (`bool`, defaults to False): the encoder numbers its positions by counting
            the attention mask's ones, so a padded row's tokens get the positions they have alone and padding gets
            -1 (with `position_embedding_offset` = o, table row o - 1): RoBERTa's numbering (its table has
            `padding_idx` + 1 leading rows), as `DecoderConfig.position_ids_from_attention_mask` (OPT). The decoder
            stack numbers from 0 as before; explicit `position_ids` always win.
        position_ids_are_table_rows (`bool`, defaults to False): explicit `position_ids` given to the encoder are
            rows of its learned table, read as given (RoBERTa's: its first token is row `padding_idx` + 1), not
            positions that `position_embedding_offset` is added to. Only with `position_embedding_type="learned"`.
        type_vocab_size (`int`, defaults to 0): BERT's segment types: the encoder adds an embedding of
            `token_type_ids` (0 when not given); 0 means none, and `token_type_ids` are ignored.
        classifier_pooler (`bool`, defaults to True): `EncoderForSequenceClassification` passes the first token's
            state through BERT's pooler (dense + tanh) before its classifier, as `BertForSequenceClassification`;
            False classifies the first token's state itself. No other model reads it.
        classifier_dropout (`float`, *optional*): BERT's dropout before the classifier of
            `EncoderForSequenceClassification` / `EncoderForTokenClassification`; None: `dropout`, as BERT falls
            back to `hidden_dropout_prob`.
        classifier_dropout_before_pooler (`bool`, defaults to False): `EncoderForSequenceClassification` applies
            that dropout to the first token's state before the pooler too, as RoBERTa's classification head (dropout,
            dense + tanh, dropout, out_proj); training only. Without the pooler it has nothing to precede and is
            ignored (the state is dropped out once).
        label_shift (`str`, defaults to `"decoder_start_token"`): how teacher forcing builds the decoder input from
            `labels` (when no `decoder_input_ids` are given): `"decoder_start_token"` (Marian, Bart, T5: the labels
            shifted right behind `decoder_start_token_id`) or `"wrap_last_token"` (mBART: shifted right behind each
            row's last real label token, which mBART's tokenizer makes the target-language code, so the decoder input
            starts with that code and needs no `decoder_start_token_id`). Generation always starts from
            `decoder_start_token_id`.

    Example:
    ```python
    >>> from archlab import Seq2SeqConfig, Seq2SeqForConditionalGeneration
    >>> config = Seq2SeqConfig(vocab_size=1000, d_model=64, encoder_layers=2, decoder_layers=2,
    ...                        encoder_attention_heads=4, decoder_attention_heads=4,
    ...                        encoder_ffn_dim=128, decoder_ffn_dim=128)
    >>> model = Seq2SeqForConditionalGeneration(config)
    ```
    """

    model_type = "archlab_seq2seq"
    keys_to_ignore_at_inference = ["past_key_values", "cache"]  # the cache under its names before and from 5.24
    attribute_map = {
        "num_attention_heads": "encoder_attention_heads",
        "hidden_size": "d_model",
        "num_hidden_layers": "encoder_layers",
        "initializer_range": "init_std",
    }

    # FSDP2 (`DistributedConfig(fsdp_size=N)`): one shard group per layer of either stack; the embeddings, final
    # norms and head stay in the root group.
    base_model_fsdp_plan = {"encoder.layers.*": "free_full_weight", "decoder.layers.*": "free_full_weight"}

    @property
    def base_model_tp_plan(self) -> dict[str, str]:
        """Tensor parallelism for `from_pretrained(..., tp_plan="auto")` (Marian/Bart in transformers have none):
        Megatron's split -- q/k/v and fc1 by output columns, out_proj and fc2 by input rows -- so each rank runs
        whole heads and a slice of the feed-forward, with one all-reduce per sub-layer. A gated fc1 packs
        [gate, up], so each rank takes its slice of both halves. The token embeddings are split by vocabulary rows
        (transformers does the same to a decoder-only model's `embed_tokens`), like the LM head tied to them
        (`colwise_gather_output` in the head models' own plans): a tied weight is one parameter, so both modules
        must read it with the same layout. `shared` is listed too: its weight is the source the stacks tie to."""
        fc1 = "packed_colwise" if self.mlp_type == "gated" else "colwise"
        plan = {"encoder.embed_tokens": "embedding_rowwise", "decoder.embed_tokens": "embedding_rowwise"}
        if self.share_encoder_decoder_embeddings:
            plan["shared"] = "embedding_rowwise"
        for stack, attentions in (("encoder", ("self_attn",)), ("decoder", ("self_attn", "encoder_attn"))):
            for attention in attentions:
                plan.update({f"{stack}.layers.*.{attention}.{proj}": style for proj, style in TP_ATTENTION.items()})
            plan.update({f"{stack}.layers.*.fc1": fc1, f"{stack}.layers.*.fc2": "rowwise"})
        return plan

    # --- MarianConfig / BartConfig fields ---
    vocab_size: int = 37000
    decoder_vocab_size: int | None = None
    max_position_embeddings: int = 1024
    encoder_layers: int = 6
    encoder_ffn_dim: int = 2048
    encoder_attention_heads: int = 8
    decoder_layers: int = 6
    decoder_ffn_dim: int = 2048
    decoder_attention_heads: int = 8
    encoder_layerdrop: float | int = 0.0
    decoder_layerdrop: float | int = 0.0
    use_cache: bool = True
    is_encoder_decoder: bool = True
    activation_function: str = "relu"
    d_model: int = 512
    dropout: float | int = 0.1
    attention_dropout: float | int = 0.0
    activation_dropout: float | int = 0.0
    init_std: float = 0.02
    scale_embedding: bool = True
    pad_token_id: int | None = 0
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    decoder_start_token_id: int | None = 1
    forced_eos_token_id: int | list[int] | None = None
    share_encoder_decoder_embeddings: bool = True
    tie_word_embeddings: bool = True

    # --- archlab fields ---
    norm_type: str = "layer_norm"
    layer_norm_eps: float = 1e-5
    norm_position: str = "post"
    mlp_type: str = "plain"
    position_embedding_type: str = "sinusoidal"
    sinusoidal_layout: str = "interleaved"
    encoder_key_value_heads: int | None = None
    decoder_key_value_heads: int | None = None
    attention_bias: bool = True
    mlp_bias: bool = True
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    relative_attention_bias_per_layer: bool = False
    lm_loss_chunk_size: int = 1024
    d_kv: int | None = None
    scale_attn_weights: bool = True
    scale_decoder_outputs: bool = False
    clamp_fp16_hidden_states: bool = False
    train_pad_embedding: bool = False
    use_qk_norm: bool = False
    attn_logit_softcapping: int | float | None = None
    final_logit_softcapping: int | float | None = None
    embedding_layernorm: bool = False
    position_embedding_offset: int = 0
    position_ids_from_attention_mask: bool = False
    position_ids_are_table_rows: bool = False
    type_vocab_size: int = 0
    classifier_pooler: bool = True
    classifier_dropout: float | int | None = None
    classifier_dropout_before_pooler: bool = False
    label_shift: str = "decoder_start_token"

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs: Any) -> Seq2SeqConfig:
        """transformers sets the overrides of `from_pretrained(folder, field=value)` on the built config, past
        `__post_init__`'s checks: they are checked here, so an impossible value fails now, naming the field, not
        later in the model."""
        loaded = super().from_dict(config_dict, **kwargs)
        config = loaded[0] if isinstance(loaded, tuple) else loaded
        check_field_types(config)
        config.validate_architecture()
        return loaded

    def __post_init__(self, **kwargs: Any) -> None:
        check_field_types(self)
        if kwargs.get("qk_norm_scope", "head") != "head":  # the attention reads it where a config has it
            raise ValueError(
                f"`qk_norm_scope`={kwargs['qk_norm_scope']!r} is a DecoderConfig field (OLMo 2's QK-norm over the "
                "whole projection); the encoder-decoder's `use_qk_norm` normalises each head: leave `qk_norm_scope` "
                "unset."
            )
        self.decoder_vocab_size = self.decoder_vocab_size or self.vocab_size
        if self.encoder_key_value_heads is None:
            self.encoder_key_value_heads = self.encoder_attention_heads
        if self.decoder_key_value_heads is None:
            self.decoder_key_value_heads = self.decoder_attention_heads
        super().__post_init__(**kwargs)
        self.validate_architecture()  # a plain ValueError now; `@strict` would wrap it in its own error type

    def validate_architecture(self) -> None:
        """Every cross-field check; run at construction and again by `@strict` at save time."""
        for name in (
            "vocab_size",
            "decoder_vocab_size",
            "d_model",
            "encoder_layers",
            "decoder_layers",
            "encoder_attention_heads",
            "decoder_attention_heads",
            "encoder_key_value_heads",
            "decoder_key_value_heads",
            "encoder_ffn_dim",
            "decoder_ffn_dim",
            "max_position_embeddings",
            "relative_attention_num_buckets",
            "relative_attention_max_distance",
        ):
            check_positive(self, name)
        for name in ("dropout", "attention_dropout", "activation_dropout", "encoder_layerdrop", "decoder_layerdrop"):
            check_probability(self, name)
        if self.classifier_dropout is not None:
            check_probability(self, "classifier_dropout")
        check_positive(self, "layer_norm_eps", integer=False)
        check_non_negative(self, "init_std")
        check_non_negative(self, "lm_loss_chunk_size")
        check_non_negative(self, "type_vocab_size")
        check_non_negative(self, "position_embedding_offset")
        if self.position_embedding_offset and self.position_embedding_type != "learned":
            raise ValueError(
                f"`position_embedding_offset` ({self.position_embedding_offset}) shifts a learned position table; "
                f"`position_embedding_type` is {self.position_embedding_type!r}: allowed values are 0, or any with "
                "'learned'."
            )
        if self.position_ids_are_table_rows and self.position_embedding_type != "learned":
            raise ValueError(
                "`position_ids_are_table_rows` (True) reads explicit position ids as rows of a learned table; "
                f"`position_embedding_type` is {self.position_embedding_type!r}: allowed values are False, or True "
                "with 'learned'."
            )
        for name in ("d_kv", "attn_logit_softcapping", "final_logit_softcapping"):
            if getattr(self, name) is not None:
                check_positive(self, name, integer=name == "d_kv")
        check_choice(self, "activation_function", ACTIVATIONS)
        check_choice(self, "norm_type", NORM_TYPES)
        check_choice(self, "norm_position", SEQ2SEQ_NORM_POSITIONS)
        check_choice(self, "mlp_type", MLP_TYPES)
        check_choice(self, "position_embedding_type", SEQ2SEQ_POSITION_SCHEMES)
        check_choice(self, "sinusoidal_layout", SINUSOIDAL_LAYOUTS)
        check_choice(self, "label_shift", LABEL_SHIFTS)
        for side in ("encoder", "decoder"):
            heads, kv_heads = getattr(self, f"{side}_attention_heads"), getattr(self, f"{side}_key_value_heads")
            if self.d_kv is None and self.d_model % heads != 0:
                raise ValueError(
                    f"`d_model` ({self.d_model}) must be divisible by `{side}_attention_heads` ({heads}): allowed "
                    f"values are {[h for h in range(1, self.d_model + 1) if self.d_model % h == 0]}, "
                    "or set `d_kv` (the head size)."
                )
            if heads % kv_heads != 0:
                raise ValueError(
                    f"`{side}_key_value_heads` ({kv_heads}) must divide `{side}_attention_heads` ({heads}): allowed "
                    f"values are {[d for d in range(1, heads + 1) if heads % d == 0]}."
                )
        if self.position_embedding_type == "relative_bias":  # the encoder's bias is bidirectional, the decoder's not
            for bidirectional in (True, False):
                check_relative_buckets(
                    self.relative_attention_num_buckets, self.relative_attention_max_distance, bidirectional
                )
        if self.relative_attention_bias_per_layer and self.position_embedding_type != "relative_bias":
            raise ValueError(
                f"`relative_attention_bias_per_layer` (True) needs `position_embedding_type`='relative_bias' (got "
                f"{self.position_embedding_type!r}): allowed values are False, or True with 'relative_bias'."
            )
        requested = requested_attention(self)
        if requested is not None:
            check_attention_backend(self, requested)
        if self.share_encoder_decoder_embeddings and self.decoder_vocab_size != self.vocab_size:
            raise ValueError(
                f"`decoder_vocab_size` ({self.decoder_vocab_size}) must equal `vocab_size` ({self.vocab_size}) when "
                "`share_encoder_decoder_embeddings=True`; set it to False for separate source/target vocabularies."
            )
        for name in ("pad_token_id", "bos_token_id", "decoder_start_token_id"):
            value = getattr(self, name)
            limit = min(self.vocab_size, self.decoder_vocab_size)
            if value is not None and not 0 <= value < limit:
                raise ValueError(f"`{name}` ({value}) must be None or in [0, {limit}) (the vocabulary sizes).")


__all__ = ["Seq2SeqConfig"]
