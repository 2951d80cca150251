"""Every catalogue variant, one config field away from the LLaMA recipe: forward, backward, decoding with the cache
equal to the full forward (past any sliding window), eager equal to sdpa, and save/load round trips."""

import pytest
import torch

from archlab import DecoderForCausalLM

from helpers import LLAMA4_ATTENTION, LLAMA4_EXPERTS, assert_close_to_scale, tiny_decoder_config

ATOL = 1e-4

VARIANTS = {
    "layer_norm": dict(norm_type="layer_norm"),
    "offset_rms_norm": dict(norm_type="offset_rms_norm"),
    "offset_layer_norm": dict(norm_type="offset_layer_norm"),
    "post_norm": dict(norm_position="post"),
    "sandwich_norm": dict(norm_position="sandwich"),
    "parallel_block": dict(norm_position="parallel", norm_type="layer_norm"),
    "deepnorm": dict(norm_position="deepnorm", norm_type="layer_norm"),
    "output_norm": dict(norm_position="output"),
    "relu_mlp": dict(
        mlp_type="plain", hidden_act="relu", intermediate_size=None, mlp_width_rule="4d", mlp_width_multiple_of=8
    ),
    "gelu_mlp": dict(mlp_type="plain", hidden_act="gelu"),
    "silu_mlp": dict(mlp_type="plain", hidden_act="silu"),
    "xielu_mlp": dict(mlp_type="plain", hidden_act="xielu"),  # Apertus: the activation learns α per layer
    "geglu": dict(hidden_act="gelu_pytorch_tanh", intermediate_size=None, mlp_width_multiple_of=8),
    "no_positions": dict(position_embedding_type="none"),
    "sinusoidal": dict(position_embedding_type="sinusoidal"),
    "learned": dict(position_embedding_type="learned"),
    "relative_bias": dict(
        position_embedding_type="relative_bias", relative_attention_num_buckets=8, relative_attention_max_distance=16
    ),
    "alibi": dict(position_embedding_type="alibi"),
    "partial_rope": dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
    "yarn_rope": dict(
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 32,
        }
    ),
    "mqa": dict(num_key_value_heads=1),
    "sliding_window": dict(sliding_window=4),
    "interleaved_local_global": dict(sliding_window=4, layer_types=["sliding_attention", "full_attention"]),
    "alibi_sliding": dict(
        position_embedding_type="alibi", sliding_window=4, layer_types=["sliding_attention", "full_attention"]
    ),
    "qk_norm": dict(use_qk_norm=True),
    "qk_norm_over_projection": dict(use_qk_norm=True, qk_norm_scope="projection"),
    "qk_norm_per_head": dict(use_qk_norm=True, qk_norm_scope="per_head", norm_type="offset_rms_norm"),
    "softcapping": dict(attn_logit_softcapping=2.0, final_logit_softcapping=5.0),
    "scaled_embedding_layernorm": dict(scale_embedding=True, embedding_layernorm=True),
    "z_loss": dict(lm_z_loss_coef=1e-3),
    "gated_attention_headwise": dict(attention_output_gate="headwise"),
    "attention_sinks": dict(attention_sinks=True, num_key_value_heads=2),  # GPT-OSS
    "attention_sinks_alibi": dict(attention_sinks=True, position_embedding_type="alibi"),
    "latent_attention": dict(
        num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6
    ),
    "mup_multipliers": dict(
        embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.2, logit_scale=0.25
    ),
    # a QK-norm without a gain over the whole projections (OLMo 2's scope, Llama 4's L2Norm)
    "qk_norm_projection_without_gain": dict(use_qk_norm=True, qk_norm_scope="projection", qk_norm_weight=False),
    "chunked_attention": dict(attention_chunk_size=4),  # Llama 4's blocks of 4 positions
    # Llama 4's attention and experts (helpers.py)
    "llama4_attention": LLAMA4_ATTENTION,
    "moe_llama4": LLAMA4_EXPERTS,
}
EAGER_ONLY = {"softcapping"}  # sdpa cannot soft-cap: refused at construction


def _model(name, attn="eager", **extra):
    config = tiny_decoder_config(**{**VARIANTS[name], **extra}, attn_implementation=attn)
    return DecoderForCausalLM(config).eval()


def _perturb(model):
    """Random norms and attention sinks, so placements, (1 + w) gains and the sinks' logits matter."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
            elif name.endswith("sinks"):
                p.add_(torch.randn_like(p))
    return model


@pytest.mark.parametrize("name", VARIANTS)
def test_forward_backward(name):
    model = _model(name).train()
    input_ids = torch.randint(3, 97, (2, 12))
    loss = model(input_ids, labels=input_ids).loss
    assert torch.isfinite(loss)
    loss.backward()
    for param_name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), param_name
    assert model.model.layers[1].self_attn.o_proj.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("name", VARIANTS)
def test_incremental_decoding_equals_full_forward(name):
    model = _perturb(_model(name, attn="eager" if name in EAGER_ONLY else "sdpa"))
    input_ids = torch.randint(3, 97, (2, 14))  # 14 tokens: well past the window of 4
    with torch.no_grad():
        full = model(input_ids).logits
        out = model(input_ids[:, :5], use_cache=True)
        steps, cache = [out.logits], out.past_key_values
        for t in range(5, 14):
            out = model(input_ids[:, t : t + 1], past_key_values=cache, use_cache=True)
            steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    "name",
    [
        "alibi",
        "relative_bias",
        "sliding_window",
        "interleaved_local_global",
        "alibi_sliding",
        "learned",
        "sinusoidal",
        "attention_sinks",
    ],
)
def test_static_cache_generation_equals_uncached(name):
    model = _perturb(_model(name, attn="sdpa"))
    input_ids = torch.randint(3, 97, (2, 6))
    mask = torch.ones_like(input_ids)
    mask[0, :2] = 0  # left padding
    kwargs = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
    uncached = model.generate(input_ids, use_cache=False, **kwargs)
    assert torch.equal(model.generate(input_ids, cache_implementation="static", **kwargs), uncached)
    assert torch.equal(model.generate(input_ids, **kwargs), uncached)  # DynamicCache


@pytest.mark.parametrize("name", sorted(set(VARIANTS) - EAGER_ONLY))
def test_eager_equals_sdpa(name):
    eager = _perturb(_model(name, attn="eager"))
    sdpa = _model(name, attn="sdpa")
    sdpa.load_state_dict(eager.state_dict())
    input_ids = torch.randint(3, 97, (3, 13))
    mask = torch.ones_like(input_ids)
    mask[0, :4] = 0
    mask[1, -3:] = 0
    with torch.no_grad():
        a = eager(input_ids, attention_mask=mask).logits
        b = sdpa(input_ids, attention_mask=mask).logits
    torch.testing.assert_close(a[mask.bool()], b[mask.bool()], atol=ATOL, rtol=0)


def test_softcapping_refuses_sdpa_and_falls_back_by_default():
    with pytest.raises(ValueError, match="attn_logit_softcapping"):
        tiny_decoder_config(attn_logit_softcapping=2.0, attn_implementation="sdpa")
    model = DecoderForCausalLM(tiny_decoder_config(attn_logit_softcapping=2.0))
    assert model.config._attn_implementation == "eager"
    with pytest.raises(ValueError, match="attn_logit_softcapping"):
        model.set_attn_implementation("sdpa")


def test_bias_positions_refuse_flex_and_flash_when_switched_later():
    model = DecoderForCausalLM(tiny_decoder_config(position_embedding_type="alibi"))
    for backend in ("flex_attention", "flash_attention_2"):
        with pytest.raises(ValueError, match="adds a bias"):
            model.set_attn_implementation(backend)
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("name", VARIANTS)
def test_save_load_round_trip(name, tmp_path):
    model = _perturb(_model(name))
    model.save_pretrained(tmp_path)
    loaded = DecoderForCausalLM.from_pretrained(tmp_path).eval()
    ignore = {"_name_or_path"}
    assert {k: v for k, v in loaded.config.to_dict().items() if k not in ignore} == {
        k: v for k, v in model.config.to_dict().items() if k not in ignore
    }
    input_ids = torch.randint(3, 97, (2, 9))
    with torch.no_grad():
        assert_close_to_scale(loaded(input_ids).logits, model(input_ids).logits, rtol=1e-5)


def test_z_loss_adds_coefficient_times_log_z_squared():
    plain, with_z = _model("qk_norm"), _model("qk_norm", lm_z_loss_coef=0.1)
    with_z.load_state_dict(plain.state_dict())
    input_ids = torch.randint(3, 97, (2, 10))
    logits = plain(input_ids).logits[:, :-1].float()
    log_z = torch.logsumexp(logits, dim=-1)
    expected = plain(input_ids, labels=input_ids).loss + 0.1 * log_z.square().mean()
    torch.testing.assert_close(with_z(input_ids, labels=input_ids).loss, expected, atol=0, rtol=1e-5)
    with_z.train(), plain.train()  # the chunked training loss agrees
    torch.testing.assert_close(with_z(input_ids, labels=input_ids).loss, expected, atol=0, rtol=1e-5)


def test_final_logit_softcapping_bounds_logits_and_loss_path():
    model = _model("softcapping").train()
    input_ids = torch.randint(3, 97, (2, 10))
    out = model(input_ids, labels=input_ids)  # unchunked with soft-capping: logits are returned
    assert out.logits.abs().max() <= 5.0
    model.eval()
    assert torch.isfinite(model(input_ids, labels=input_ids).loss)
