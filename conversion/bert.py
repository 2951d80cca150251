"""BERT (`BertForMaskedLM`) as archlab's `EncoderForMaskedLM`: the encoder stack with BERT's MLM head.

BERT is a `Seq2SeqConfig` encoder: post-LayerNorm, learned absolute positions, segment embeddings
(`type_vocab_size`), a norm after the embeddings, a plain FFN, biases everywhere. It has no decoder: the archlab
config's decoder fields are kept minimal on import (one layer with the encoder's heads and width, no start token),
and exporting ignores every decoder-only field, since `EncoderForMaskedLM` builds no decoder.

Weights are renamed by the rules of `layouts.py`. The stock head holds the projection tied to the word embeddings
and a bias (`cls.predictions.bias`); checkpoints may also hold the tied copies (`cls.predictions.decoder.weight`,
`.bias`), which must equal what they copy, the pooler and next-sentence head of `BertForPreTraining` (which
`BertForMaskedLM` drops too), buffers (`position_ids`, `token_type_ids`) and, in old checkpoints, LayerNorm
parameters named `gamma`/`beta`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from transformers import BertConfig, BertForMaskedLM, PreTrainedConfig

from ..modeling import EncoderForMaskedLM
from .checks import refuse_export, refuse_import, setting
from .family import ConversionError, Family, Layout, StateDict, same
from .layouts import Rename, WeightRules

LAYER = "encoder.layers.{n}"


def encoder_rules(base: str) -> tuple[Rename, ...]:
    """The encoder of BERT (`base` = "bert") and RoBERTa ("roberta"): the same modules under the base model's name."""
    layer = f"{base}.encoder.layer.{{n}}"
    return (
        Rename(f"{base}.embeddings.word_embeddings", "encoder.embed_tokens"),
        Rename(f"{base}.embeddings.position_embeddings", "encoder.embed_positions"),
        Rename(f"{base}.embeddings.token_type_embeddings", "encoder.token_type_embeddings"),
        Rename(f"{base}.embeddings.LayerNorm", "encoder.layernorm_embedding"),
        Rename(f"{layer}.attention.self.query", f"{LAYER}.self_attn.q_proj"),
        Rename(f"{layer}.attention.self.key", f"{LAYER}.self_attn.k_proj"),
        Rename(f"{layer}.attention.self.value", f"{LAYER}.self_attn.v_proj"),
        Rename(f"{layer}.attention.output.dense", f"{LAYER}.self_attn.out_proj"),
        Rename(f"{layer}.attention.output.LayerNorm", f"{LAYER}.self_attn_layer_norm"),
        Rename(f"{layer}.intermediate.dense", f"{LAYER}.fc1"),
        Rename(f"{layer}.output.dense", f"{LAYER}.fc2"),
        Rename(f"{layer}.output.LayerNorm", f"{LAYER}.final_layer_norm"),
    )


RULES = WeightRules(
    (
        *encoder_rules("bert"),
        Rename("cls.predictions.transform.dense", "lm_head.dense"),
        Rename("cls.predictions.transform.LayerNorm", "lm_head.layer_norm"),
        Rename("cls.predictions", "lm_head"),  # the head's own `bias`
    ),
    ignore=(r"\.position_ids$", r"\.token_type_ids$", r"^bert\.pooler\.", r"^cls\.seq_relationship\."),
)
# the tied copies in the stock head -> what they copy
TIED_COPIES = {
    "cls.predictions.decoder.weight": "bert.embeddings.word_embeddings.weight",
    "cls.predictions.decoder.bias": "cls.predictions.bias",
}
LEGACY_NORM_NAMES = {".gamma": ".weight", ".beta": ".bias"}


def _bert_weights_to_archlab(state_dict: StateDict, config: PreTrainedConfig) -> StateDict:
    """Names as `BertForMaskedLM` has them (checkpoints of the base model lack `bert.`), tied copies checked and
    dropped, then the rules."""
    renamed: StateDict = {}
    for key, tensor in state_dict.items():
        for old, new in LEGACY_NORM_NAMES.items():
            if "LayerNorm" in key and key.endswith(old):
                key = key.removesuffix(old) + new
        renamed[key if key.startswith(("bert.", "cls.")) else f"bert.{key}"] = tensor
    for copy, source in TIED_COPIES.items():
        tensor = renamed.pop(copy, None)
        if tensor is not None and source in renamed and not torch.equal(tensor, renamed[source]):
            raise ConversionError(
                f"The checkpoint's `{copy}` differs from `{source}`; BertForMaskedLM would then not "
                "tie them, and archlab's head has one projection and one bias."
            )
    return RULES.to_archlab(renamed, config)


def _bert_weights_from_archlab(state_dict: StateDict, config: PreTrainedConfig) -> StateDict:
    """A model without segment types exports with one segment type whose embedding is zero (the same function)."""
    if config.type_vocab_size == 0:
        reference = state_dict["encoder.embed_tokens.weight"]
        state_dict = {**state_dict, "encoder.token_type_embeddings.weight": reference.new_zeros(1, config.d_model)}
    return RULES.from_archlab(state_dict, config)


def _bert_to_archlab(stock: PreTrainedConfig, values: Mapping[str, Any]) -> dict[str, Any]:
    wrong = {}
    for name in ("is_decoder", "add_cross_attention"):
        if getattr(stock, name):
            wrong[setting(stock, name)] = "BertForMaskedLM is a bidirectional encoder, as archlab's EncoderForMaskedLM"
    position_type = values.get("position_embedding_type", "absolute")
    if position_type != "absolute":
        wrong[f"position_embedding_type={position_type!r}"] = (
            "transformers 5's BERT has absolute positions only and ignores it, so its logits are not what the "
            "checkpoint was trained for"
        )
    if not stock.tie_word_embeddings:
        wrong[setting(stock, "tie_word_embeddings")] = (
            "the untied stock head reads `cls.predictions.decoder.bias` and ignores `cls.predictions.bias`; archlab's "
            "head has one bias"
        )
    refuse_import("bert", wrong)
    return minimal_decoder(stock)


def _bert_from_archlab(config: PreTrainedConfig) -> dict[str, Any]:
    if not config.tie_word_embeddings:
        refuse_export(
            "BertForMaskedLM", {setting(config, "tie_word_embeddings"): "BertForMaskedLM's head is the word embeddings"}
        )
    return {"type_vocab_size": max(config.type_vocab_size, 1)}


# BertConfig fields archlab's Seq2SeqConfig has (RoBERTa's are the same)
BERT_FIELDS = {
    **same(
        "vocab_size",
        "max_position_embeddings",
        "type_vocab_size",
        "layer_norm_eps",
        "use_cache",
        "pad_token_id",
        "bos_token_id",
        "eos_token_id",
        "tie_word_embeddings",
        "classifier_dropout",  # (read by the fine-tuning heads, heads.py)
    ),
    "hidden_size": "d_model",
    "num_hidden_layers": "encoder_layers",
    "num_attention_heads": "encoder_attention_heads",
    "intermediate_size": "encoder_ffn_dim",
    "hidden_act": "activation_function",
    "hidden_dropout_prob": "dropout",
    "attention_probs_dropout_prob": "attention_dropout",
    "initializer_range": "init_std",
}
BERT_IMPLIED = {
    "position_embedding_type": "learned",
    "embedding_layernorm": True,
    "scale_embedding": False,
    "norm_position": "post",
    "norm_type": "layer_norm",
    "mlp_type": "plain",
    "attention_bias": True,
    "mlp_bias": True,
}
# the decoder's fields (EncoderForMaskedLM has no decoder), and the dropouts BERT has no field for (training only)
DECODER_FIELDS = frozenset(
    {
        "decoder_layers",
        "decoder_attention_heads",
        "decoder_key_value_heads",
        "decoder_ffn_dim",
        "decoder_layerdrop",
        "decoder_start_token_id",
        "decoder_vocab_size",
        "forced_eos_token_id",
        "scale_decoder_outputs",
        "share_encoder_decoder_embeddings",
        "activation_dropout",
        "encoder_layerdrop",
    }
)


def minimal_decoder(stock: PreTrainedConfig) -> dict[str, Any]:
    """The decoder fields of an encoder-only import: one layer with the encoder's heads and width, no start token."""
    return {
        "decoder_layers": 1,
        "decoder_attention_heads": stock.num_attention_heads,
        "decoder_ffn_dim": stock.intermediate_size,
        "decoder_start_token_id": None,
    }


BERT = Family(
    BertConfig,
    BertForMaskedLM,
    EncoderForMaskedLM,
    fields=BERT_FIELDS,
    implied=BERT_IMPLIED,
    to_archlab=_bert_to_archlab,
    from_archlab=_bert_from_archlab,
    expressible=DECODER_FIELDS,
    layout=Layout(_bert_weights_to_archlab, _bert_weights_from_archlab),
)

__all__ = ["BERT", "BERT_FIELDS", "BERT_IMPLIED", "DECODER_FIELDS", "encoder_rules", "minimal_decoder"]
