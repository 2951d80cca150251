"""Catalogue fields combined: every pair of choices from two different concerns (norm, placement, MLP, positions,
attention pattern, prefix LM, stability, embeddings, biases, experts, tied head, loss) meets in at least one tiny
model, and each model passes the checks that combinations broke before: training gives finite gradients; generate
with the dynamic cache equals generate without a cache (logits and tokens), on the static cache and in archlab's
greedy and beam loops (the CUDA default, run uncompiled; tokens), on a left-padded batch whose padded row generates
as it does alone; eager attention equals SDPA.

test_catalogue_variants.py checks each choice alone. A combination fuzz found bugs that no choice shows alone (an
MoE's router loss given the static cache's masks, sinusoidal positions counted from a padded mask), so here every
pair of choices is covered by a greedy all-pairs design (`helpers.AllPairsDesign`): each model combines up to one
choice per concern, picked to cover the most pairs not yet covered, ~80 models for ~920 pairs. A pair that cannot
be built is refused when its config is made, with a ValueError that names a field (its own test).
"""

from __future__ import annotations

import copy
import re

import pytest
import torch

from archlab import DecoderForCausalLM

from helpers import (
    AllPairsDesign,
    assert_close_to_scale,
    choice_fields,
    choice_names,
    count_archlab_loops,
    cpu_compile_config,
    randomised,
    tiny_decoder_config,
)

WINDOW = 4
CONCERNS: dict[str, dict[str, dict]] = {
    "norm": {
        "layer_norm": dict(norm_type="layer_norm"),
        "offset_rms_norm": dict(norm_type="offset_rms_norm"),
        "offset_layer_norm": dict(norm_type="offset_layer_norm"),
    },
    "placement": {
        name: dict(norm_position=name)
        for name in ("post", "sandwich", "parallel", "parallel_shared_norm", "deepnorm", "output")
    },
    "mlp": {
        "relu": dict(mlp_type="plain", hidden_act="relu"),
        "gelu": dict(mlp_type="plain", hidden_act="gelu"),
        "geglu": dict(hidden_act="gelu_pytorch_tanh"),
    },
    "positions": {
        "alibi": dict(position_embedding_type="alibi"),
        "relative_bias": dict(
            position_embedding_type="relative_bias",
            relative_attention_num_buckets=8,
            relative_attention_max_distance=16,
        ),
        "learned": dict(position_embedding_type="learned"),
        "sinusoidal": dict(position_embedding_type="sinusoidal"),
        "none": dict(position_embedding_type="none"),
        "partial_rope": dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}),
        "yarn": dict(
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 1e4,
                "factor": 4.0,
                "original_max_position_embeddings": 32,
            }
        ),
    },
    "positions_from_mask": {"from_mask": dict(position_ids_from_attention_mask=True)},
    "attention": {
        "mqa": dict(num_key_value_heads=1),
        "mha": dict(num_key_value_heads=4),
        "all_sliding": dict(sliding_window=WINDOW),
        "local_global": dict(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"]),
        "chunked": dict(attention_chunk_size=WINDOW),  # Llama 4's chunked attention
        "gated_heads": dict(attention_output_gate="headwise"),
        "sinks": dict(attention_sinks=True),  # GPT-OSS
        # DeepSeek-V3's multi-head latent attention
        "latent": dict(num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6),
    },
    "prefix": {"prefix_lm": dict(prefix_lm=True)},
    "stability": {
        "qk_norm": dict(use_qk_norm=True),
        "qk_norm_over_projection": dict(use_qk_norm=True, qk_norm_scope="projection"),
        "qk_norm_per_head": dict(use_qk_norm=True, qk_norm_scope="per_head"),
        "qk_norm_without_gain": dict(use_qk_norm=True, qk_norm_weight=False, qk_norm_after_rope=True),  # Llama 4
        "softcapping": dict(attn_logit_softcapping=2.0, final_logit_softcapping=5.0),
        "query_pre_attn_scalar": dict(query_pre_attn_scalar=16),
        "attention_multiplier": dict(attention_multiplier=0.2),  # Granite's scores scale
    },
    "embeddings": {"scaled_and_normed": dict(scale_embedding=True, embedding_layernorm=True)},
    # μP's constants (Granite): embeddings, each sub-layer's output and the logits scaled
    "multipliers": {"mup": dict(embedding_multiplier=3.0, residual_multiplier=0.5, logit_scale=0.25)},
    "biases": {
        "all_biases": dict(attention_bias=True, mlp_bias=True, lm_head_bias=True),
        "qkv_bias": dict(qkv_bias=True),
    },
    "experts": {
        "moe_router_logits": dict(num_local_experts=4, num_experts_per_tok=2, output_router_logits=True),
        "moe_sigmoid_router": dict(
            num_local_experts=4,
            num_experts_per_tok=2,
            router_score_function="sigmoid",
            router_correction_bias=True,
            routed_scaling_factor=2.0,
            output_router_logits=True,
        ),
        # Llama 4's: the chosen expert reads the token times its sigmoid weight
        "moe_weights_on_input": dict(
            num_local_experts=4,
            num_experts_per_tok=1,
            router_score_function="sigmoid",
            norm_topk_prob=False,
            routing_weights_on_input=True,
        ),
        "moe_shared_dense_sparse": dict(
            num_local_experts=4,
            num_experts_per_tok=1,
            shared_expert_intermediate_size=32,
            mlp_layer_types=["dense", "sparse"],
        ),
    },
    "head": {"tied": dict(tie_word_embeddings=True)},
    "loss": {"z_loss_chunked": dict(lm_z_loss_coef=1e-3, lm_loss_chunk_size=8)},
}
PREFIX_LENGTH = 3


def _config(choices):
    fields = choice_fields(CONCERNS, choices)
    attn = "eager" if "attn_logit_softcapping" in fields else "sdpa"  # SDPA cannot soft-cap scores
    return tiny_decoder_config(**fields, attn_implementation=attn)


DESIGN = AllPairsDesign(CONCERNS, _config)


def test_the_design_covers_every_pair_that_builds():
    assert DESIGN.buildable_pairs() <= DESIGN.covered_pairs()
    assert len(DESIGN.buildable_pairs()) > 900 and len(DESIGN.models()) < 90  # ~920 pairs in ~80 models


@pytest.mark.parametrize("pair", DESIGN.refused_pairs(), ids=choice_names)
def test_a_pair_that_cannot_be_built_is_refused_naming_a_field(pair):
    with pytest.raises(ValueError) as refusal:
        _config(pair)
    named = set(re.findall(r"`(\w+)", str(refusal.value)))
    assert named & (set(choice_fields(CONCERNS, pair)) | {"attn_implementation"}), str(refusal.value)


def _model(choices) -> DecoderForCausalLM:
    torch.manual_seed(0)
    return randomised(DecoderForCausalLM(_config(choices)))


def _prompts(config) -> dict:
    """Two prompts of 7 tokens, the first left-padded by 2; a prefix LM's prefix is each row's first 3 real tokens
    (`prefix_lengths` counts key columns, padding included)."""
    ids = torch.randint(3, 97, (2, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    ids[0, :2] = 0
    inputs = {"input_ids": ids, "attention_mask": mask}
    if config.prefix_lm:
        inputs["prefix_lengths"] = torch.tensor([2 + PREFIX_LENGTH, PREFIX_LENGTH])
    return inputs


@pytest.fixture
def loop_calls(monkeypatch) -> list[str]:
    return count_archlab_loops(monkeypatch)


@pytest.mark.parametrize("choices", DESIGN.models(), ids=choice_names)
def test_combined_choices_train_and_decode_consistently(choices, loop_calls):
    model = _model(choices)
    config = model.config

    # training: finite loss, every parameter of the model gets a finite gradient
    ids = torch.randint(3, 97, (2, 12), generator=torch.Generator().manual_seed(2))
    extra = {"prefix_lengths": torch.full((2,), PREFIX_LENGTH)} if config.prefix_lm else {}
    loss = model.train()(ids, labels=ids, **extra).loss
    assert torch.isfinite(loss)
    loss.backward()
    for name, parameter in model.named_parameters():
        if parameter.requires_grad and parameter.grad is not None:
            assert torch.isfinite(parameter.grad).all(), name
    model.eval().zero_grad(set_to_none=True)

    # generate: dynamic cache = no cache (logits and tokens, 10 tokens: past the window of 4) = static cache
    inputs = _prompts(config)
    common = dict(max_new_tokens=10, do_sample=False, pad_token_id=0, eos_token_id=None)
    scored = dict(return_dict_in_generate=True, output_logits=True)
    cached = model.generate(**inputs, **common, **scored)
    uncached = model.generate(**inputs, **common, **scored, use_cache=False)
    assert torch.equal(cached.sequences, uncached.sequences)
    for step, (a, b) in enumerate(zip(cached.logits, uncached.logits)):
        assert_close_to_scale(a, b, msg=f"logits of step {step}")
    static = model.generate(**inputs, **common, cache_implementation="static")
    assert torch.equal(static, cached.sequences)
    looped = model.generate(**inputs, **common, cache_implementation="static", compile_config=cpu_compile_config())
    assert loop_calls == ["greedy"] and torch.equal(looped, cached.sequences)

    # beam search: archlab's beam loop on the static cache = transformers' on the dynamic cache
    beams = dict(max_new_tokens=6, num_beams=2, do_sample=False, pad_token_id=0, eos_token_id=None)
    expected = model.generate(**inputs, **beams)
    searched = model.generate(**inputs, **beams, cache_implementation="static", compile_config=cpu_compile_config())
    assert loop_calls == ["greedy", "beams"] and torch.equal(searched, expected)

    # the left-padded row generates as it does alone
    alone = {"input_ids": inputs["input_ids"][:1, 2:]}
    if config.prefix_lm:
        alone["prefix_lengths"] = torch.full((1,), PREFIX_LENGTH)
    assert torch.equal(model.generate(**alone, **common)[0], cached.sequences[0, 2:])

    # eager attention = SDPA over the padded batch, in float64: in float32 the two kernels' rounding (which differs
    # between CPUs: AVX-512/AMX against AVX2) can flip an expert's top-k choice at a near tie, and that token's logits
    # then differ by whole units
    if config._attn_implementation == "sdpa":
        eager = DecoderForCausalLM(tiny_decoder_config(**choice_fields(CONCERNS, choices), attn_implementation="eager"))
        eager.eval().load_state_dict(model.state_dict())
        with torch.no_grad():
            a, b = eager.double()(**inputs).logits, copy.deepcopy(model).double()(**inputs).logits
        real = inputs["attention_mask"].bool()
        assert_close_to_scale(a[real], b[real], msg="eager vs sdpa")
