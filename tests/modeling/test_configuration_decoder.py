"""DecoderConfig: defaults, derived fields, and early, field-naming errors for impossible values."""

import pytest

from archlab import DecoderConfig
from helpers import TINY, tiny_decoder_config


def test_llama_defaults_and_derived_fields():
    config = DecoderConfig()
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (4096, 32, 32)
    assert config.num_key_value_heads == 32 and config.head_dim == 128
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 10000.0}
    assert config.model_type == "archlab_decoder"


def test_legacy_rope_theta_is_standardised():
    config = tiny_decoder_config(rope_theta=500000.0)
    assert config.rope_parameters["rope_theta"] == 500000.0


def test_round_trip_through_dict():
    config = tiny_decoder_config(num_key_value_heads=1)
    again = DecoderConfig.from_dict(config.to_dict())
    assert again.to_dict() == config.to_dict()


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(hidden_size=30), "hidden_size"),
        (dict(num_key_value_heads=3), "num_key_value_heads"),
        (dict(vocab_size=0), "vocab_size"),
        (dict(num_hidden_layers=-1), "num_hidden_layers"),
        (dict(intermediate_size=0), "intermediate_size"),
        (dict(hidden_act="swishy"), "hidden_act"),
        (dict(head_dim=7), "rotary dimension"),
        (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.1}), "rotary"),
        (dict(attention_dropout=1.5), "attention_dropout"),
        (dict(pad_token_id=1000), "pad_token_id"),
        (dict(rms_norm_eps=0.0), "rms_norm_eps"),
    ],
)
def test_impossible_values_fail_at_construction_naming_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        DecoderConfig(**{**TINY, **overrides})


def test_unknown_activation_lists_allowed_values():
    with pytest.raises(ValueError, match="allowed values:.*'silu'"):
        tiny_decoder_config(hidden_act="swishy")


def test_explicit_head_dim_allows_non_dividing_heads():
    config = tiny_decoder_config(hidden_size=30, head_dim=8)
    assert config.head_dim == 8


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(hidden_size="128"), "`hidden_size` must be an int, got '128' \\(a str\\)"),
        (dict(rms_norm_eps="1e-5"), "`rms_norm_eps` must be a float, got '1e-5' \\(a str\\)"),
        (dict(attention_dropout="0.1"), "`attention_dropout` must be an int or a float, got '0.1'"),
        (dict(tie_word_embeddings="yes"), "`tie_word_embeddings` must be a bool, got 'yes'"),
        (dict(eos_token_id="2"), "`eos_token_id` must be an int, a list of int or None, got '2'"),
        (dict(sliding_window=8.5), "`sliding_window` must be an int or None, got 8.5"),
    ],
)
def test_a_value_of_the_wrong_type_is_named_at_construction(overrides, message):
    """A JSON-quoted number ("128" from a hand-written config or --config_overrides) is a ValueError naming the field,
    not a TypeError from the arithmetic that first touches it."""
    with pytest.raises(ValueError, match=message):
        DecoderConfig(**{**TINY, **overrides})


def test_rope_type_is_checked_at_construction():
    with pytest.raises(ValueError, match="`rope_parameters\\['rope_type'\\]`='spiral' is not supported; allowed values: "
                                         "'default', 'linear', 'dynamic'"):
        tiny_decoder_config(rope_parameters={"rope_type": "spiral", "rope_theta": 1e4})
    with pytest.raises(ValueError, match="Missing required keys in `rope_parameters` for 'rope_type'='linear': {'factor'}"):
        tiny_decoder_config(rope_parameters={"rope_type": "linear", "rope_theta": 1e4})
    assert tiny_decoder_config(rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0})
