"""The encoder-decoder's fields combined, as test_catalogue_pairs.py does for the decoder: every pair of choices from
two concerns (norm, placement, MLP, positions, grouped heads, head size, scalings, vocabularies and head, stability,
embeddings, special tokens, loss, depth) meets in at least one tiny model (`helpers.AllPairsDesign`), and each
model passes: training gives finite gradients; generate with the dynamic cache equals generate without a cache
(logits and tokens), on the static cache, and in archlab's greedy and beam loops with the source padded (the CUDA
default, run uncompiled; tokens); a right-padded source decodes as it does alone; eager attention equals SDPA; the
encoder alone trains as a masked LM.

A combination fuzz of these fields found its bugs on the fast path's inputs (segment ids, packed positions) rather
than in the fields; this keeps every pair of fields covered as they grow.
"""

from __future__ import annotations

import pytest
import torch

from archlab import EncoderForMaskedLM, Seq2SeqForConditionalGeneration

from helpers import (
    AllPairsDesign,
    assert_close_to_scale,
    choice_fields,
    choice_names,
    count_archlab_loops,
    cpu_compile_config,
    randomised,
    tiny_seq2seq_config,
)

CONCERNS: dict[str, dict[str, dict]] = {
    "norm": {"rms_norm": dict(norm_type="rms_norm"), "offset_rms_norm": dict(norm_type="offset_rms_norm")},
    "placement": {"pre": dict(norm_position="pre"), "sandwich": dict(norm_position="sandwich")},
    "mlp": {
        "geglu": dict(mlp_type="gated", activation_function="gelu_new"),
        "silu": dict(activation_function="silu"),
    },
    "positions": {
        "learned": dict(position_embedding_type="learned"),
        "learned_offset": dict(position_embedding_type="learned", position_embedding_offset=2),
        "t5_bias": dict(
            position_embedding_type="relative_bias",
            relative_attention_num_buckets=8,
            relative_attention_max_distance=16,
        ),
        "umt5_bias": dict(
            position_embedding_type="relative_bias",
            relative_attention_num_buckets=8,
            relative_attention_max_distance=16,
            relative_attention_bias_per_layer=True,
        ),
        "none": dict(position_embedding_type="none"),
        "split_sinusoid": dict(sinusoidal_layout="split"),
    },
    "grouped_heads": {
        "encoder_mqa": dict(encoder_key_value_heads=1),
        "decoder_gqa": dict(decoder_key_value_heads=2),
    },
    "head_size": {"d_kv_12": dict(d_kv=12)},
    "scaling": {
        "t5_unscaled_attention": dict(scale_attn_weights=False),
        "scaled_decoder_outputs": dict(scale_decoder_outputs=True),
        "unscaled_embeddings": dict(scale_embedding=False),
    },
    "vocabularies": {
        "untied_head": dict(tie_word_embeddings=False),
        "own_target_vocabulary": dict(share_encoder_decoder_embeddings=False, decoder_vocab_size=45),
    },
    "stability": {
        "qk_norm": dict(use_qk_norm=True),
        "softcapping": dict(attn_logit_softcapping=3.0, final_logit_softcapping=5.0),
        "fp16_clamp": dict(clamp_fp16_hidden_states=True),
    },
    "embeddings": {
        "embedding_layernorm": dict(embedding_layernorm=True),
        "segments": dict(type_vocab_size=2),
        "trained_pad_row": dict(train_pad_embedding=True),
    },
    "tokens": {
        "t5_tokens": dict(pad_token_id=0, decoder_start_token_id=0, eos_token_id=1, bos_token_id=None),
        "two_eos": dict(eos_token_id=[2, 3]),
    },
    "loss": {"chunked": dict(lm_loss_chunk_size=3), "unchunked": dict(lm_loss_chunk_size=0)},
    "depth": {"1_encoder_3_decoder_layers": dict(encoder_layers=1, decoder_layers=3, encoder_ffn_dim=40)},
}


def _config(choices):
    fields = choice_fields(CONCERNS, choices)
    attn = "eager" if "attn_logit_softcapping" in fields else "sdpa"  # SDPA cannot soft-cap scores
    return tiny_seq2seq_config(**fields, attn_implementation=attn)


DESIGN = AllPairsDesign(CONCERNS, _config)


def test_the_design_covers_every_pair_and_every_pair_builds():
    assert not DESIGN.refused_pairs()
    assert DESIGN.buildable_pairs() <= DESIGN.covered_pairs()
    assert len(DESIGN.buildable_pairs()) > 300 and len(DESIGN.models()) < 60


@pytest.fixture
def loop_calls(monkeypatch) -> list[str]:
    return count_archlab_loops(monkeypatch)


def _sources(config) -> dict:
    """Two sources of 7 tokens, the second right-padded by 2; segment ids where the config has segment types."""
    ids = torch.randint(4, 40, (2, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    ids[1, 5:] = config.pad_token_id
    sources = {"input_ids": ids, "attention_mask": mask}
    if config.type_vocab_size:
        sources["token_type_ids"] = (torch.arange(7) >= 3).long().expand(2, 7)
    return sources


@pytest.mark.parametrize("choices", DESIGN.models(), ids=choice_names)
def test_combined_choices_train_and_decode_consistently(choices, loop_calls):
    torch.manual_seed(0)
    model = randomised(Seq2SeqForConditionalGeneration(_config(choices)))
    config = model.config
    sources = _sources(config)

    # training: finite loss and gradients
    labels = torch.randint(4, 40, (2, 5), generator=torch.Generator().manual_seed(2))
    loss = model.train()(**sources, labels=labels).loss
    assert torch.isfinite(loss)
    loss.backward()
    for name, parameter in model.named_parameters():
        if parameter.grad is not None:
            assert torch.isfinite(parameter.grad).all(), name
    model.eval().zero_grad(set_to_none=True)

    # generate: dynamic cache = no cache (logits, tokens) = static cache = archlab's loops (source padded)
    common = dict(max_new_tokens=6, do_sample=False, eos_token_id=None, forced_eos_token_id=None)
    scored = dict(return_dict_in_generate=True, output_logits=True)
    cached = model.generate(**sources, **common, **scored)
    uncached = model.generate(**sources, **common, **scored, use_cache=False)
    assert torch.equal(cached.sequences, uncached.sequences)
    for step, (a, b) in enumerate(zip(cached.logits, uncached.logits)):
        assert_close_to_scale(a, b, msg=f"logits of step {step}")
    assert torch.equal(model.generate(**sources, **common, cache_implementation="static"), cached.sequences)
    looped = model.generate(**sources, **common, cache_implementation="static", compile_config=cpu_compile_config())
    assert loop_calls == ["greedy"] and torch.equal(looped, cached.sequences)
    beams = {**common, "num_beams": 2, "max_new_tokens": 4}
    expected = model.generate(**sources, **beams)
    searched = model.generate(**sources, **beams, cache_implementation="static", compile_config=cpu_compile_config())
    assert loop_calls == ["greedy", "beams"] and torch.equal(searched, expected)

    # the right-padded source decodes as it does alone
    alone = {name: value[1:, :5] for name, value in sources.items() if name != "attention_mask"}
    assert torch.equal(model.generate(**alone, **common)[0], cached.sequences[1])

    # eager attention = SDPA
    if config._attn_implementation == "sdpa":
        fields = choice_fields(CONCERNS, choices)
        eager = Seq2SeqForConditionalGeneration(tiny_seq2seq_config(**fields, attn_implementation="eager"))
        eager.eval().load_state_dict(model.state_dict())
        targets = {"decoder_input_ids": labels}
        with torch.no_grad():
            a, b = eager(**sources, **targets).logits, model(**sources, **targets).logits
        assert_close_to_scale(a, b, msg="eager vs sdpa")

    # the encoder alone as a masked LM
    masked_lm = EncoderForMaskedLM(config).train()
    masked = sources["input_ids"].masked_fill(torch.rand(2, 7, generator=torch.Generator().manual_seed(3)) > 0.3, -100)
    assert torch.isfinite(masked_lm(**sources, labels=masked).loss)
