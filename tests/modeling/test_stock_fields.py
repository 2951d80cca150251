"""The fields that make more stock families archlab configs, each checked against the stock model that has the
feature (random perturbed weights, fp32 logits within 1e-4 on a left-padded batch) and shown to be active (the same
weights with the field off compute something else):

- `qkv_bias` (Qwen2: biases on q/k/v only), `lm_head_bias` and `norm_position="parallel_shared_norm"` (Phi),
  `position_embedding_offset` and `position_ids_from_attention_mask` (OPT);
- for the encoder-decoder, `embedding_layernorm` and `position_embedding_offset` (Bart), `type_vocab_size` (BERT's
  segment embeddings, through `EncoderForMaskedLM`), the encoder's `position_ids_from_attention_mask` (RoBERTa's
  positions, numbered past the padding) and `position_ids_are_table_rows` (RoBERTa's explicit position ids).
"""

from __future__ import annotations

import re

import pytest
import torch
from transformers import (
    BartConfig,
    BartForConditionalGeneration,
    BertConfig,
    BertForMaskedLM,
    OPTConfig,
    OPTForCausalLM,
    PhiConfig,
    PhiForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    RobertaConfig,
    RobertaForMaskedLM,
)

from archlab import (
    DecoderConfig,
    DecoderForCausalLM,
    EncoderForMaskedLM,
    Seq2SeqConfig,
    Seq2SeqForConditionalGeneration,
)

SHAPE = dict(vocab_size=60, hidden_size=32, num_hidden_layers=2, num_attention_heads=4)


def perturbed(model: torch.nn.Module) -> torch.nn.Module:
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.1)
        for name, buffer in model.named_buffers():
            if name.endswith("final_logits_bias"):
                buffer.normal_(generator=generator)
    return model.eval()


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, 60, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    return ids, mask


def renamed(state_dict: dict[str, torch.Tensor], renames: dict[str, str]) -> dict[str, torch.Tensor]:
    out = {}
    for key, tensor in state_dict.items():
        for pattern, replacement in renames.items():
            key = re.sub(pattern, replacement, key)
        out[key] = tensor
    return out


def assert_matches_and_field_is_active(
    stock, ours, state_dict, field: str, off_value, off_state_dict=None, **inputs
) -> None:
    """`ours` with the stock weights computes the stock logits; with `field` at `off_value` (same weights, those it
    has) it does not."""
    ours.load_state_dict(state_dict, strict=True)
    with torch.no_grad():
        expected, got = stock(**inputs).logits, ours(**inputs).logits
    assert (got - expected).abs().max() <= 1e-4
    without = type(ours)(type(ours.config)(**{**ours.config.to_dict(), field: off_value})).eval()
    without.load_state_dict(off_state_dict or state_dict, strict=False)
    with torch.no_grad():
        assert (without(**inputs).logits - expected).abs().max() > 1e-3, f"{field} changes nothing"


def decoder(**fields) -> DecoderForCausalLM:
    return DecoderForCausalLM(DecoderConfig(**SHAPE, bos_token_id=None, eos_token_id=None, **fields)).eval()


def test_qkv_bias_is_qwen2s_attention():
    stock = perturbed(Qwen2ForCausalLM(Qwen2Config(**SHAPE, intermediate_size=64, num_key_value_heads=2)))
    ours = decoder(
        intermediate_size=64,
        num_key_value_heads=2,
        qkv_bias=True,
        rope_parameters=stock.config.rope_parameters,
        max_position_embeddings=stock.config.max_position_embeddings,
    )
    assert ours.model.layers[0].self_attn.q_proj.bias is not None and ours.model.layers[0].self_attn.o_proj.bias is None
    ids, mask = batch()
    assert_matches_and_field_is_active(
        stock, ours, stock.state_dict(), "qkv_bias", None, input_ids=ids, attention_mask=mask
    )


@pytest.mark.parametrize("field", ["lm_head_bias", "norm_position"])
def test_phi_shares_one_norm_and_biases_its_head(field):
    stock = perturbed(PhiForCausalLM(PhiConfig(**SHAPE, intermediate_size=64, partial_rotary_factor=0.5)))
    config = stock.config
    ours = decoder(
        intermediate_size=64,
        norm_position="parallel_shared_norm",
        norm_type="layer_norm",
        rms_norm_eps=config.layer_norm_eps,
        mlp_type="plain",
        hidden_act=config.hidden_act,
        attention_bias=True,
        mlp_bias=True,
        lm_head_bias=True,
        rope_parameters=config.rope_parameters,
        max_position_embeddings=config.max_position_embeddings,
    )
    state_dict = renamed(
        stock.state_dict(),
        {
            r"self_attn\.dense": "self_attn.o_proj",
            r"mlp\.fc1": "mlp.up_proj",
            r"mlp\.fc2": "mlp.down_proj",
            r"final_layernorm": "norm",
        },
    )
    off = {"lm_head_bias": False, "norm_position": "parallel"}[field]
    ids, mask = batch()
    assert_matches_and_field_is_active(stock, ours, state_dict, field, off, input_ids=ids, attention_mask=mask)


@pytest.mark.parametrize("field", ["position_ids_from_attention_mask", "position_embedding_offset"])
def test_opt_numbers_positions_from_the_mask_in_an_offset_table(field):
    stock = perturbed(
        OPTForCausalLM(
            OPTConfig(**SHAPE, ffn_dim=64, max_position_embeddings=40, word_embed_proj_dim=32, pad_token_id=1)
        )
    )
    ours = decoder(
        intermediate_size=64,
        mlp_type="plain",
        hidden_act="relu",
        norm_type="layer_norm",
        rms_norm_eps=1e-5,
        attention_bias=True,
        mlp_bias=True,
        position_embedding_type="learned",
        position_embedding_offset=2,
        position_ids_from_attention_mask=True,
        max_position_embeddings=40,
        tie_word_embeddings=True,
        pad_token_id=1,
    )
    state_dict = renamed(
        stock.state_dict(),
        {
            r"^model\.decoder\.": "model.",
            r"self_attn\.out_proj": "self_attn.o_proj",
            r"self_attn_layer_norm": "input_layernorm",
            r"layers\.(\d+)\.final_layer_norm": r"layers.\1.post_attention_layernorm",
            r"^model\.final_layer_norm": "model.norm",
            r"fc1": "mlp.up_proj",
            r"fc2": "mlp.down_proj",
        },
    )
    ids, mask = batch()
    if field == "position_embedding_offset":  # without it, the same table is read from row 0: every row 2 early
        ignored = {**state_dict, "model.embed_positions.weight": state_dict["model.embed_positions.weight"][:40]}
        assert_matches_and_field_is_active(
            stock, ours, state_dict, field, 0, input_ids=ids, attention_mask=mask, off_state_dict=ignored
        )
    else:
        assert_matches_and_field_is_active(stock, ours, state_dict, field, False, input_ids=ids, attention_mask=mask)
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=1)
    assert torch.equal(ours.generate(ids, **kwargs), stock.generate(ids, **kwargs))


def seq2seq_config(**fields) -> Seq2SeqConfig:
    return Seq2SeqConfig(
        vocab_size=60,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=40,
        position_embedding_type="learned",
        activation_function="gelu",
        scale_embedding=False,
        dropout=0.0,
        **fields,
    )


def test_bart_normalises_its_embeddings():
    stock = perturbed(
        BartForConditionalGeneration(
            BartConfig(
                vocab_size=60,
                d_model=32,
                encoder_layers=2,
                decoder_layers=2,
                encoder_attention_heads=4,
                decoder_attention_heads=4,
                encoder_ffn_dim=64,
                decoder_ffn_dim=64,
                max_position_embeddings=40,
                dropout=0.0,
                pad_token_id=1,
                bos_token_id=0,
                eos_token_id=2,
                decoder_start_token_id=2,
                forced_eos_token_id=None,
            )
        )
    )
    ours = Seq2SeqForConditionalGeneration(
        seq2seq_config(
            embedding_layernorm=True,
            position_embedding_offset=2,
            pad_token_id=1,
            bos_token_id=0,
            eos_token_id=2,
            decoder_start_token_id=2,
        )
    ).eval()
    ids, mask = batch()
    target = torch.randint(3, 60, (2, 7), generator=torch.Generator().manual_seed(2))
    assert_matches_and_field_is_active(
        stock,
        ours,
        stock.state_dict(),
        "embedding_layernorm",
        False,
        input_ids=ids,
        attention_mask=mask,
        decoder_input_ids=target,
    )
    beams = dict(attention_mask=mask, num_beams=3, max_new_tokens=8)
    assert torch.equal(ours.generate(ids, **beams), stock.generate(ids, **beams))


def test_bert_adds_segment_embeddings():
    stock = perturbed(
        BertForMaskedLM(
            BertConfig(
                vocab_size=60,
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=4,
                intermediate_size=64,
                max_position_embeddings=40,
                type_vocab_size=2,
                hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0,
            )
        )
    )
    ours = EncoderForMaskedLM(
        seq2seq_config(
            embedding_layernorm=True,
            type_vocab_size=2,
            layer_norm_eps=1e-12,
            pad_token_id=0,
            bos_token_id=None,
            eos_token_id=None,
            decoder_start_token_id=None,
        )
    ).eval()
    state_dict = renamed(
        stock.state_dict(),
        {
            r"^bert\.embeddings\.word_embeddings": "encoder.embed_tokens",
            r"^bert\.embeddings\.position_embeddings": "encoder.embed_positions",
            r"^bert\.embeddings\.token_type_embeddings": "encoder.token_type_embeddings",
            r"^bert\.embeddings\.LayerNorm": "encoder.layernorm_embedding",
            r"^bert\.encoder\.layer\.": "encoder.layers.",
            r"attention\.self\.query": "self_attn.q_proj",
            r"attention\.self\.key": "self_attn.k_proj",
            r"attention\.self\.value": "self_attn.v_proj",
            r"attention\.output\.dense": "self_attn.out_proj",
            r"attention\.output\.LayerNorm": "self_attn_layer_norm",
            r"intermediate\.dense": "fc1",
            r"output\.dense": "fc2",
            r"output\.LayerNorm": "final_layer_norm",
            r"^cls\.predictions\.transform\.dense": "lm_head.dense",
            r"^cls\.predictions\.transform\.LayerNorm": "lm_head.layer_norm",
            r"^cls\.predictions\.decoder": "lm_head.decoder",
            r"^cls\.predictions\.bias": "lm_head.bias",
        },
    )
    state_dict = {
        k: v for k, v in state_dict.items() if k not in ("lm_head.decoder.bias", "bert.embeddings.position_ids")
    }
    ids, mask = batch()
    segments = torch.randint(0, 2, ids.shape, generator=torch.Generator().manual_seed(3))
    assert_matches_and_field_is_active(
        stock, ours, state_dict, "type_vocab_size", 0, input_ids=ids, attention_mask=mask, token_type_ids=segments
    )


@pytest.mark.parametrize("field", ["position_ids_from_attention_mask", "position_ids_are_table_rows"])
def test_roberta_numbers_encoder_positions_from_the_mask_in_an_offset_table(field):
    """RoBERTa numbers a row's real tokens from pad_token_id + 1 and its padding pad_token_id: archlab's encoder with
    the mask's numbering and a table of pad_token_id + 1 leading rows, on a left-padded batch. Explicit
    `position_ids` are rows of that table, read as given (here from row pad_token_id + 3, on the rows unpadded:
    padding repeating a row would read as a packed document of its own, whose logits differ)."""
    stock = perturbed(
        RobertaForMaskedLM(
            RobertaConfig(
                **SHAPE,
                intermediate_size=64,
                max_position_embeddings=42,
                type_vocab_size=1,
                pad_token_id=1,
                hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0,
            )
        )
    )
    ours = EncoderForMaskedLM(
        seq2seq_config(
            embedding_layernorm=True,
            type_vocab_size=1,
            layer_norm_eps=1e-12,
            position_embedding_offset=2,
            position_ids_from_attention_mask=True,
            position_ids_are_table_rows=True,
            pad_token_id=1,
            bos_token_id=None,
            eos_token_id=None,
            decoder_start_token_id=None,
        )
    ).eval()
    state_dict = renamed(
        stock.state_dict(),
        {
            r"^roberta\.embeddings\.word_embeddings": "encoder.embed_tokens",
            r"^roberta\.embeddings\.position_embeddings": "encoder.embed_positions",
            r"^roberta\.embeddings\.token_type_embeddings": "encoder.token_type_embeddings",
            r"^roberta\.embeddings\.LayerNorm": "encoder.layernorm_embedding",
            r"^roberta\.encoder\.layer\.": "encoder.layers.",
            r"attention\.self\.query": "self_attn.q_proj",
            r"attention\.self\.key": "self_attn.k_proj",
            r"attention\.self\.value": "self_attn.v_proj",
            r"attention\.output\.dense": "self_attn.out_proj",
            r"attention\.output\.LayerNorm": "self_attn_layer_norm",
            r"intermediate\.dense": "fc1",
            r"output\.dense": "fc2",
            r"output\.LayerNorm": "final_layer_norm",
        },
    )
    state_dict = {k: v for k, v in state_dict.items() if k != "lm_head.decoder.bias"}
    ids, mask = batch()
    inputs = dict(input_ids=ids.masked_fill(mask == 0, 1), attention_mask=mask)  # RoBERTa reads padding from ids
    if field == "position_ids_are_table_rows":
        inputs = dict(input_ids=ids, position_ids=torch.arange(ids.shape[1]).expand_as(ids) + 4)
    assert_matches_and_field_is_active(stock, ours, state_dict, field, False, **inputs)


def test_offsets_need_a_learned_table():
    with pytest.raises(ValueError, match="position_embedding_offset"):
        DecoderConfig(position_embedding_offset=2)
    with pytest.raises(ValueError, match="position_embedding_offset"):
        Seq2SeqConfig(position_embedding_offset=2)
    with pytest.raises(ValueError, match="position_ids_are_table_rows.*allowed values are False"):
        Seq2SeqConfig(position_ids_are_table_rows=True)
