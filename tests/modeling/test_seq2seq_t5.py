"""T5 parity: a T5-equivalent `Seq2SeqConfig` computes `T5ForConditionalGeneration`'s function (v1.0 and v1.1).

The reference is transformers' own T5 with random weights; its state dict reaches archlab through the documented
key renaming of `conversion/t5.py` and loads with `strict=True`. Checked: logits (fp32, <= 1e-4), loss,
greedy and beam generation, incremental decoding, eager vs sdpa, and the converter in both directions.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForSeq2SeqLM, T5ForConditionalGeneration

from archlab import Seq2SeqConfig, Seq2SeqForConditionalGeneration
from archlab.conversion import FAMILIES, ConversionError, convert_checkpoint
from archlab.conversion.t5 import archlab_state_dict_to_t5

from helpers import (
    T5_SHAPE,
    T5_VERSIONS,
    assert_close_to_scale,
    check_generation_matches,
    check_incremental_and_eager_equal_full,
    check_logits_and_loss_match,
    t5_batch,
    t5_pair,
    t5_reference,
    training_gradients,
)


def test_t5_config_maps_to_the_t5_recipe():
    config = FAMILIES["t5"].archlab_config(t5_reference("v1.0").config.to_dict())
    assert (config.norm_type, config.norm_position, config.position_embedding_type) == (
        "rms_norm",
        "pre",
        "relative_bias",
    )
    assert not (config.scale_embedding or config.scale_attn_weights or config.attention_bias or config.mlp_bias)
    assert config.layer_norm_eps == 1e-6 and config.d_kv == 12 and config.decoder_start_token_id == 0
    assert config.scale_decoder_outputs and config.tie_word_embeddings and config.mlp_type == "plain"
    v11 = FAMILIES["t5"].archlab_config(t5_reference("v1.1").config.to_dict())
    assert (v11.mlp_type, v11.activation_function) == ("gated", "gelu_new")
    assert not (v11.scale_decoder_outputs or v11.tie_word_embeddings)
    # a config.json written before transformers 5 says only tie_word_embeddings=False for v1.1
    legacy = FAMILIES["t5"].archlab_config({**T5_SHAPE, **T5_VERSIONS["v1.1"]})
    assert not (legacy.scale_decoder_outputs or legacy.tie_word_embeddings)


@pytest.mark.parametrize("version", list(T5_VERSIONS))
def test_t5_logits_and_loss_match(version):
    check_logits_and_loss_match(*t5_pair(version))


@pytest.mark.parametrize("version", list(T5_VERSIONS))
def test_t5_gradients_match(version):
    """Fine-tuning a converted T5 updates what T5 updates: every gradient equals T5's, including the pad token's
    embedding row (T5's decoder start), which a Marian-style `padding_idx` would freeze.

    At the weights of 0.3 the generation tests need, attention is so saturated that float32 rounding alone moves
    v1.1's gradients by up to 7e-4 of their scale on some inputs (float64 does not help: both RMSNorms round to
    float32 even on float64 input); at 0.15 that stays below 1e-5, so the comparison can be strict."""
    reference, ours = t5_pair(version, std=0.15)
    assert ours.config.train_pad_embedding
    as_t5, expected = training_gradients(reference, ours)
    assert expected["shared.weight"][0].abs().max() > 0 and as_t5["shared.weight"][0].abs().max() > 0  # pad row
    for name, grad in expected.items():
        assert_close_to_scale(as_t5[name], grad, msg=name)


@pytest.mark.parametrize("version", list(T5_VERSIONS))
@pytest.mark.parametrize(
    "generate_kwargs", [dict(num_beams=1), dict(num_beams=3, length_penalty=0.8)], ids=["greedy", "beam"]
)
def test_t5_generation_matches(version, generate_kwargs):
    check_generation_matches(*t5_pair(version), generate_kwargs)


@pytest.mark.parametrize("version", list(T5_VERSIONS))
def test_t5_incremental_decoding_and_eager_equal_full_sdpa(version):
    check_incremental_and_eager_equal_full(t5_pair(version)[1])


def test_t5_state_dict_round_trips_exactly():
    for version in T5_VERSIONS:
        reference, ours = t5_pair(version)
        back = archlab_state_dict_to_t5(ours.state_dict(), ours.config)
        expected = reference.state_dict()
        assert set(back) == set(expected)
        assert all(torch.equal(back[key], expected[key]) for key in back)


def test_unscaled_attention_folds_the_scale_into_the_query_initialisation():
    config = FAMILIES["t5"].archlab_config({**T5_SHAPE, "d_model": 256, "d_kv": 64, "num_heads": 4})
    model = Seq2SeqForConditionalGeneration(config)
    attention = model.model.encoder.layers[0].self_attn
    assert attention.scaling == 1.0
    q_std, k_std = attention.q_proj.weight.std().item(), attention.k_proj.weight.std().item()
    assert k_std == pytest.approx(config.init_std, rel=0.1)
    assert q_std == pytest.approx(config.init_std / 8, rel=0.1)  # init_std · d_kv^-1/2


@pytest.mark.parametrize("version", list(T5_VERSIONS))
def test_converter_imports_and_exports_t5_folders(version, tmp_path):
    reference = t5_reference(version)
    reference.save_pretrained(tmp_path / "t5")
    convert_checkpoint(tmp_path / "t5", tmp_path / "archlab")
    ours = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "archlab").eval()
    assert type(ours) is Seq2SeqForConditionalGeneration
    assert (ours.lm_head.weight is ours.model.shared.weight) == (version == "v1.0")
    source, mask, target = t5_batch()
    with torch.no_grad():
        expected = reference(input_ids=source, attention_mask=mask, decoder_input_ids=target).logits
        got = ours(input_ids=source, attention_mask=mask, decoder_input_ids=target).logits
    assert (got - expected).abs().max() <= 1e-4

    convert_checkpoint(tmp_path / "archlab", tmp_path / "back", to="t5")
    back = T5ForConditionalGeneration.from_pretrained(tmp_path / "back").eval()
    assert back.config.scale_decoder_outputs == (version == "v1.0")
    with torch.no_grad():
        exported = back(input_ids=source, attention_mask=mask, decoder_input_ids=target).logits
    torch.testing.assert_close(exported, expected)


def test_converter_refuses_what_t5_cannot_express(tmp_path):
    _, ours = t5_pair("v1.1")
    for name, overrides, message in [
        ("gqa", dict(decoder_key_value_heads=1), "attention heads"),
        ("scaled", dict(scale_attn_weights=True), "scale_attn_weights=True"),
        ("layer_norm", dict(norm_type="layer_norm"), "norm_type='layer_norm'"),
        ("qk_norm", dict(use_qk_norm=True), "use_qk_norm=True"),
    ]:
        model = Seq2SeqForConditionalGeneration(Seq2SeqConfig(**{**ours.config.to_dict(), **overrides}))
        model.save_pretrained(tmp_path / name)
        with pytest.raises(ConversionError, match=message):
            convert_checkpoint(tmp_path / name, tmp_path / f"{name}_refused", to="t5")
    ours.final_logits_bias.fill_(0.5)
    ours.save_pretrained(tmp_path / "bias")
    with pytest.raises(ConversionError, match="final_logits_bias"):
        convert_checkpoint(tmp_path / "bias", tmp_path / "bias_refused", to="t5")
