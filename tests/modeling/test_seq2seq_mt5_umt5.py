"""mT5 and UMT5 parity: `MT5ForConditionalGeneration` and `UMT5ForConditionalGeneration` are configs of archlab's
encoder-decoder, and the converter takes their folders to archlab and back.

mT5 is T5 v1.1's layout (gated-GELU, a separate head, no output scaling). UMT5 adds a relative bias table to every
self-attention layer (`relative_attention_bias_per_layer`); in transformers 5 its forward always multiplies the decoder
output by d_model^-0.5 (its config forces `tie_word_embeddings=True`). The references are transformers' own models
with random weights; their state dicts reach archlab through `FAMILIES[...].layout.to_archlab` and load with
`strict=True`. Checked: logits (fp32, <= 1e-4), loss, greedy and beam generation, incremental decoding, eager vs sdpa,
the converter both ways, and what export refuses.
"""

from __future__ import annotations

import pytest
import torch
from transformers import (
    AutoModelForSeq2SeqLM,
    MT5Config,
    MT5ForConditionalGeneration,
    UMT5Config,
    UMT5ForConditionalGeneration,
)

from archlab import Seq2SeqConfig, Seq2SeqForConditionalGeneration
from archlab.conversion import FAMILIES, ConversionError, convert_checkpoint

from helpers import (
    T5_SHAPE,
    T5_VOCAB,
    assert_close_to_scale,
    check_generation_matches,
    check_incremental_and_eager_equal_full,
    check_logits_and_loss_match,
    t5_batch,
    training_gradients,
)

REFERENCES = {"mt5": (MT5Config, MT5ForConditionalGeneration), "umt5": (UMT5Config, UMT5ForConditionalGeneration)}
SHAPE = dict(T5_SHAPE, num_layers=3, num_decoder_layers=2, feed_forward_proj="gated-gelu")


def reference_model(family: str, tied: bool = False) -> MT5ForConditionalGeneration | UMT5ForConditionalGeneration:
    """Random weights large enough that greedy decoding does not repeat one token. Google's mT5/UMT5 checkpoints carry
    their own head (transformers 5 ties one at construction, so the untied case gets a fresh parameter)."""
    config_class, model_class = REFERENCES[family]
    reference = model_class(config_class(**SHAPE)).eval()
    if not tied:
        reference.lm_head.weight = torch.nn.Parameter(torch.empty(T5_VOCAB, SHAPE["d_model"]))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in reference.named_parameters():
            if "layer_norm" in name:
                parameter.uniform_(0.5, 1.5, generator=generator)
            else:
                parameter.normal_(0.0, 0.2, generator=generator)
    return reference


def pair(family: str, tied: bool = False):
    reference = reference_model(family, tied)
    conversion = FAMILIES[family]
    config = conversion.archlab_config(reference.config.to_dict())
    state_dict = conversion.layout.to_archlab(reference.state_dict(), config)  # also decides the head's tying
    ours = Seq2SeqForConditionalGeneration(config).eval()
    ours.load_state_dict(state_dict, strict=True)
    return reference, ours


def test_configs_map_to_the_family_recipes():
    mt5 = pair("mt5")[1].config
    umt5 = pair("umt5")[1].config
    for config in (mt5, umt5):
        recipe = (config.norm_type, config.norm_position, config.position_embedding_type)
        assert recipe == ("rms_norm", "pre", "relative_bias")
        assert (config.mlp_type, config.activation_function) == ("gated", "gelu_new")
        assert config.clamp_fp16_hidden_states and config.train_pad_embedding and config.decoder_start_token_id == 0
        assert (config.encoder_layers, config.decoder_layers) == (3, 2)
        assert not config.tie_word_embeddings  # the checkpoint's own head, whatever the stock config says
    assert not mt5.relative_attention_bias_per_layer and not mt5.scale_decoder_outputs
    assert umt5.relative_attention_bias_per_layer and umt5.scale_decoder_outputs
    assert pair("mt5", tied=True)[1].config.tie_word_embeddings


def test_umt5_has_a_bias_table_in_every_self_attention_layer_and_uses_each():
    reference, ours = pair("umt5")
    names = [name for name, _ in ours.named_parameters() if "relative_attention_bias" in name]
    assert names == [f"model.encoder.layers.{i}.position_bias.relative_attention_bias.weight" for i in range(3)] + [
        f"model.decoder.layers.{i}.position_bias.relative_attention_bias.weight" for i in range(2)
    ]
    assert ours.model.encoder.position_bias is None and ours.model.decoder.position_bias is None
    source, mask, target = t5_batch()
    with torch.no_grad():
        before = ours(input_ids=source, attention_mask=mask, decoder_input_ids=target).logits
        for stack in (ours.model.encoder, ours.model.decoder):  # the last layer's table matters on its own
            stack.layers[-1].position_bias.relative_attention_bias.weight.zero_()
            after = ours(input_ids=source, attention_mask=mask, decoder_input_ids=target).logits
            assert (after - before).abs().max() > 1e-3
            before = after


@pytest.mark.parametrize("family", list(REFERENCES))
def test_logits_and_loss_match(family):
    check_logits_and_loss_match(*pair(family))


@pytest.mark.parametrize("family", list(REFERENCES))
def test_gradients_match(family):
    """Fine-tuning a converted model updates what the reference updates, each of UMT5's tables included (with
    gradient checkpointing on in archlab, which passes the bucket ids through each checkpointed layer)."""
    reference, ours = pair(family)
    ours.gradient_checkpointing_enable()
    as_stock, expected = training_gradients(reference, ours)
    tables = [name for name in expected if "relative_attention_bias" in name]
    assert len(tables) == (5 if family == "umt5" else 2)
    for name, grad in expected.items():
        assert_close_to_scale(as_stock[name], grad, msg=name)


@pytest.mark.parametrize("family", list(REFERENCES))
@pytest.mark.parametrize(
    "generate_kwargs", [dict(num_beams=1), dict(num_beams=3, length_penalty=0.8)], ids=["greedy", "beam"]
)
def test_generation_matches(family, generate_kwargs):
    check_generation_matches(*pair(family), generate_kwargs)


@pytest.mark.parametrize("family", list(REFERENCES))
def test_incremental_decoding_and_eager_equal_full_sdpa(family):
    check_incremental_and_eager_equal_full(pair(family)[1])


@pytest.mark.parametrize("tied", [False, True], ids=["own_head", "tied_head"])
@pytest.mark.parametrize("family", list(REFERENCES))
def test_converter_imports_and_exports_folders(family, tied, tmp_path):
    reference = reference_model(family, tied)
    reference.save_pretrained(tmp_path / family)
    convert_checkpoint(tmp_path / family, tmp_path / "archlab")
    ours = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "archlab").eval()
    assert type(ours) is Seq2SeqForConditionalGeneration
    assert (ours.lm_head.weight is ours.model.shared.weight) == tied
    source, mask, target = t5_batch()
    with torch.no_grad():
        expected = reference(input_ids=source, attention_mask=mask, decoder_input_ids=target).logits
        got = ours(input_ids=source, attention_mask=mask, decoder_input_ids=target).logits
    assert (got - expected).abs().max() <= 1e-4

    convert_checkpoint(tmp_path / "archlab", tmp_path / "back", to=family)
    back = REFERENCES[family][1].from_pretrained(tmp_path / "back").eval()
    assert back.config.model_type == family
    with torch.no_grad():
        exported = back(input_ids=source, attention_mask=mask, decoder_input_ids=target).logits
    torch.testing.assert_close(exported, expected)


def test_converter_refuses_what_each_family_cannot_express(tmp_path):
    _, mt5 = pair("mt5")
    _, umt5 = pair("umt5")
    for name, model, to, message in [
        ("umt5_as_t5", umt5, "t5", "relative_attention_bias_per_layer=True"),
        ("umt5_as_mt5", umt5, "mt5", "relative_attention_bias_per_layer=True"),
        ("mt5_as_umt5", mt5, "umt5", "relative_attention_bias_per_layer=False"),
    ]:
        model.save_pretrained(tmp_path / name)
        with pytest.raises(ConversionError, match=message):
            convert_checkpoint(tmp_path / name, tmp_path / f"{name}_refused", to=to)
    # mT5 never scales the decoder output; UMT5 always does up to transformers 5.23 (from 5.24 its config says)
    flips = [("scaled_mt5", mt5, "mt5")]
    if not hasattr(UMT5Config(), "scale_decoder_outputs"):
        flips.append(("unscaled_umt5", umt5, "umt5"))
    for name, model, to in flips:
        scaled = model.config.scale_decoder_outputs
        flipped = Seq2SeqConfig(**{**model.config.to_dict(), "scale_decoder_outputs": not scaled})
        Seq2SeqForConditionalGeneration(flipped).save_pretrained(tmp_path / name)
        with pytest.raises(ConversionError, match="scale_decoder_outputs"):
            convert_checkpoint(tmp_path / name, tmp_path / f"{name}_refused", to=to)


def test_per_layer_bias_needs_the_relative_bias():
    with pytest.raises(ValueError, match="relative_attention_bias_per_layer.*'relative_bias'"):
        Seq2SeqConfig(relative_attention_bias_per_layer=True)  # the default position type is sinusoidal
    config = Seq2SeqConfig(position_embedding_type="relative_bias", relative_attention_bias_per_layer=True)
    assert config.relative_attention_bias_per_layer
