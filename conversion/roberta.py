"""RoBERTa (`RobertaForMaskedLM`) as archlab's `EncoderForMaskedLM`: BERT's encoder with RoBERTa's positions and head.

The encoder is BERT's (`bert.py`), under `roberta.`; three things differ:

- positions: RoBERTa numbers a row's tokens from its non-pad ids (`create_position_ids_from_input_ids`: the n-th
  token that is not `pad_token_id` reads row `pad_token_id + n` of its table, padding reads row `pad_token_id`).
  archlab's encoder numbers them from the attention mask (`position_ids_from_attention_mask`) in a table with
  `position_embedding_offset = pad_token_id + 1` leading rows (padding, numbered -1, reads row `pad_token_id`), so
  `max_position_embeddings` is the stock table's rows less the offset (roberta-base: 514 -> 512). Both agree
  whenever the mask is `input_ids != pad_token_id`, as tokenizers give it. Explicit `position_ids` are RoBERTa's
  table rows, read as given (`position_ids_are_table_rows`), not positions the offset is added to;
- the sequence classifier fine-tuned from it: RoBERTa's head drops the first token's state out before its dense +
  tanh as well as after (`classifier_dropout_before_pooler`, set for every RoBERTa folder);
- the head (`lm_head`: dense, exact GELU, LayerNorm, a projection tied to the word embeddings, a bias) is archlab's
  `MaskedLMHead` under the same names, which applies the encoder's `activation_function`: RoBERTa's head is GELU
  whatever `hidden_act` says, so another `hidden_act` is refused.

Checkpoints may hold the head's tied copies (`lm_head.decoder.weight`, `.bias`), which must equal what they copy,
a pooler (`roberta.pooler`, which `RobertaForMaskedLM` drops too), buffers, and lack the `roberta.` prefix (saved from
the base model).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from transformers import PreTrainedConfig, RobertaConfig, RobertaForMaskedLM

from ..modeling import EncoderForMaskedLM
from .bert import BERT_FIELDS, BERT_IMPLIED, DECODER_FIELDS, encoder_rules, minimal_decoder
from .checks import refuse_export, refuse_import, setting
from .family import ConversionError, Family, Layout, StateDict
from .layouts import Rename, WeightRules

RULES = WeightRules(
    (
        *encoder_rules("roberta"),
        Rename("lm_head.dense", "lm_head.dense"),
        Rename("lm_head.layer_norm", "lm_head.layer_norm"),
        Rename("lm_head", "lm_head"),
    ),
    ignore=(r"\.position_ids$", r"\.token_type_ids$", r"^roberta\.pooler\."),
)
# the tied copies in the stock head -> what they copy
TIED_COPIES = {
    "lm_head.decoder.weight": "roberta.embeddings.word_embeddings.weight",
    "lm_head.decoder.bias": "lm_head.bias",
}
# what `_roberta_from_archlab` handles, and `position_ids_are_table_rows` either way: it says how explicit position
# ids are read, not what the weights compute (an archlab model's own positions, offset added, export too)
EXPRESSIBLE = DECODER_FIELDS | {"max_position_embeddings", "position_embedding_offset", "position_ids_are_table_rows"}
ROBERTA_IMPLIED = {
    "position_ids_from_attention_mask": True,
    "position_ids_are_table_rows": True,
    # RobertaForSequenceClassification's head drops the first token's state before its dense + tanh too; a masked
    # LM's folder has it for the classifier fine-tuned from it, as the stock class loads roberta-base (training only)
    "classifier_dropout_before_pooler": True,
}
# RoBERTa's head applies `gelu` (transformers' exact GELU) whatever `hidden_act` is; archlab's the encoder's
HEAD_ACTIVATION = "gelu"


def _weights_to_archlab(state_dict: StateDict, config: PreTrainedConfig) -> StateDict:
    """Names as `RobertaForMaskedLM` has them (the base model's lack `roberta.`), tied copies checked and dropped,
    then the rules."""
    renamed = {
        key if key.startswith(("roberta.", "lm_head.")) else f"roberta.{key}": t for key, t in state_dict.items()
    }
    for copy, source in TIED_COPIES.items():
        tensor = renamed.pop(copy, None)
        if tensor is not None and source in renamed and not torch.equal(tensor, renamed[source]):
            raise ConversionError(
                f"The checkpoint's `{copy}` differs from `{source}`; RobertaForMaskedLM would then not tie them, and "
                "archlab's head has one projection and one bias."
            )
    return RULES.to_archlab(renamed, config)


def _weights_from_archlab(state_dict: StateDict, config: PreTrainedConfig) -> StateDict:
    """A model without segment types exports with one segment type whose embedding is zero (the same function)."""
    if config.type_vocab_size == 0:
        reference = state_dict["encoder.embed_tokens.weight"]
        state_dict = {**state_dict, "encoder.token_type_embeddings.weight": reference.new_zeros(1, config.d_model)}
    return RULES.from_archlab(state_dict, config)


def _roberta_to_archlab(stock: PreTrainedConfig, values: Mapping[str, Any]) -> dict[str, Any]:
    wrong = {}
    for name in ("is_decoder", "add_cross_attention"):
        if getattr(stock, name):
            wrong[setting(stock, name)] = (
                "RobertaForMaskedLM is a bidirectional encoder, as archlab's EncoderForMaskedLM"
            )
    if not stock.tie_word_embeddings:
        wrong[setting(stock, "tie_word_embeddings")] = "archlab's masked-LM head is tied to the word embeddings"
    if stock.hidden_act != HEAD_ACTIVATION:
        wrong[setting(stock, "hidden_act")] = (
            "RoBERTa's LM head applies GELU whatever hidden_act is; archlab's head applies the encoder's activation"
        )
    pad = stock.pad_token_id
    if pad is None or pad < 0:
        wrong[setting(stock, "pad_token_id")] = "RoBERTa numbers positions from the pad token's id"
    elif stock.max_position_embeddings <= pad + 1:
        wrong[setting(stock, "max_position_embeddings")] = (
            f"the table has no row for a position past its pad_token_id + 1 = {pad + 1} leading rows"
        )
    refuse_import("roberta", wrong)
    return {
        **minimal_decoder(stock),
        "position_embedding_offset": pad + 1,
        "max_position_embeddings": stock.max_position_embeddings - pad - 1,
    }


def _roberta_from_archlab(config: PreTrainedConfig) -> dict[str, Any]:
    wrong = {}
    if not config.tie_word_embeddings:
        wrong[setting(config, "tie_word_embeddings")] = "RobertaForMaskedLM's head is the word embeddings"
    if config.activation_function != HEAD_ACTIVATION:
        wrong[setting(config, "activation_function")] = "RoBERTa's LM head is GELU ('gelu') whatever hidden_act is"
    pad = config.pad_token_id
    if pad is None or config.position_embedding_offset != pad + 1:
        wrong[f"{setting(config, 'position_embedding_offset')}, {setting(config, 'pad_token_id')}"] = (
            "RoBERTa's position table has pad_token_id + 1 leading rows"
        )
    refuse_export("RobertaForMaskedLM", wrong)
    return {
        "type_vocab_size": max(config.type_vocab_size, 1),
        "max_position_embeddings": config.max_position_embeddings + config.position_embedding_offset,
    }


ROBERTA = Family(
    RobertaConfig,
    RobertaForMaskedLM,
    EncoderForMaskedLM,
    fields={name: ours for name, ours in BERT_FIELDS.items() if name != "max_position_embeddings"},
    implied={**BERT_IMPLIED, **ROBERTA_IMPLIED},
    to_archlab=_roberta_to_archlab,
    from_archlab=_roberta_from_archlab,
    expressible=EXPRESSIBLE,
    layout=Layout(_weights_to_archlab, _weights_from_archlab),
)

__all__ = ["ROBERTA"]
