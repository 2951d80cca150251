"""Multi-head latent attention (modeling/latent_attention.py) against transformers' DeepSeek-V3 attention: the same
logits and greedy tokens for the same weights (eager and SDPA, a query rank or none, YaRN with DeepSeek's mscale),
the latents as what the cache holds, and the config's rules."""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from archlab import DecoderConfig, DecoderForCausalLM
from archlab.modeling.latent_attention import LatentAttention, yarn_mscale

from helpers import tiny_decoder_config

MLA = dict(num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6)
SHAPE = dict(vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, **MLA)
YARN = {
    "rope_type": "yarn",
    "rope_theta": 1e4,
    "factor": 4.0,
    "original_max_position_embeddings": 16,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}


def _pair(q_lora_rank: int | None, rope: dict | None, implementation: str):
    """transformers' DeepSeek-V3 (dense layers, rotate-half RoPE) with random weights, and archlab's model of the
    same config holding them."""
    extra = dict(q_lora_rank=q_lora_rank, max_position_embeddings=64, **({"rope_parameters": rope} if rope else {}))
    stock = DeepseekV3ForCausalLM(
        DeepseekV3Config(
            **SHAPE, **extra, first_k_dense_replace=2, rope_interleave=False, attn_implementation=implementation
        )
    ).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in stock.named_parameters():
            norm = "norm" in name
            parameter.normal_(1.0 if norm else 0.0, 0.2 if norm else 0.3, generator=generator)
    ours = DecoderForCausalLM(DecoderConfig(**SHAPE, **extra, attn_implementation=implementation)).eval()
    ours.load_state_dict(stock.state_dict(), strict=True)  # transformers' DeepSeek-V3 names
    return ours, stock


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("q_lora_rank, rope", [(None, None), (12, YARN)], ids=["q_proj", "query_rank_yarn"])
def test_latent_attention_equals_transformers_deepseek_v3(q_lora_rank, rope, implementation):
    ours, stock = _pair(q_lora_rank, rope, implementation)
    ids = torch.randint(3, 101, (3, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    with torch.no_grad():
        diff = (ours(ids, attention_mask=mask).logits - stock(ids, attention_mask=mask).logits)[mask.bool()]
    assert diff.abs().max() <= 1e-4
    greedy = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.generate(ids, **greedy), stock.generate(ids, **greedy))


def test_the_cache_holds_the_latents_and_the_shared_rotary_key():
    model = DecoderForCausalLM(tiny_decoder_config(**MLA)).eval()
    assert isinstance(model.model.layers[0].self_attn, LatentAttention)
    ids = torch.randint(3, 97, (2, 5))
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
    layer = cache.layers[0]
    assert layer.keys.shape == (2, 1, 5, 16) and layer.values.shape == (2, 1, 5, 4)  # kv_lora_rank, qk_rope_head_dim


def test_yarn_mscale_scales_the_scores_as_deepseek_v3():
    assert yarn_mscale({"rope_type": "default"}, 0.5) == 0.5
    assert yarn_mscale({"rope_type": "yarn", "factor": 40.0}, 0.5) == 0.5  # no mscale_all_dim: unscaled
    mscale = 0.1 * 1.0 * torch.log(torch.tensor(40.0)).item() + 1.0
    assert yarn_mscale({"rope_type": "yarn", "factor": 40.0, "mscale_all_dim": 1.0}, 0.5) == pytest.approx(
        0.5 * mscale**2
    )


def test_the_config_derives_the_rotary_size_and_refuses_what_latent_attention_does_not_compute():
    config = tiny_decoder_config(**MLA)
    assert config.head_dim == 4  # the rotary size: the model's RoPE serves MLA's rotary channels
    assert config.base_model_tp_plan["layers.*.self_attn.kv_b_proj"] == "colwise"
    assert "layers.*.self_attn.k_proj" not in config.base_model_tp_plan
    with pytest.raises(ValueError, match="`head_dim` is the rotary size `qk_rope_head_dim` \\(4\\), got 8"):
        tiny_decoder_config(**MLA, head_dim=8)
    with pytest.raises(ValueError, match="`num_key_value_heads` must equal `num_attention_heads` \\(4\\), got 2"):
        tiny_decoder_config(**{**MLA, "num_key_value_heads": 2})
    with pytest.raises(ValueError, match="`q_lora_rank` \\(8\\) is multi-head latent attention's query rank"):
        tiny_decoder_config(q_lora_rank=8)
    for field, value in (("use_qk_norm", True), ("attention_sinks", True), ("qkv_bias", True)):
        with pytest.raises(ValueError, match=f"`{field}` \\({value!r}\\) changes an attention that multi-head latent"):
            tiny_decoder_config(**MLA, **{field: value})
    with pytest.raises(ValueError, match="kv_lora_rank"):
        tiny_decoder_config(**{**MLA, "kv_lora_rank": 0})


def test_a_decoding_step_attends_over_the_latents_with_kv_b_proj_absorbed(monkeypatch):
    """Greedy decoding of a left-padded batch on the dynamic and the static cache: the steps take the absorbed path
    (queries into the latent space, outputs out of it) and give the expanded path's logits; with gradients (training)
    the cache is expanded."""
    from archlab.modeling import latent_attention

    model = DecoderForCausalLM(tiny_decoder_config(**MLA, q_lora_rank=12)).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.3, generator=torch.Generator().manual_seed(parameter.numel()))
    ids = torch.randint(3, 97, (2, 6), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    greedy = dict(
        attention_mask=mask, max_new_tokens=8, do_sample=False, output_logits=True, return_dict_in_generate=True
    )
    calls = []
    absorbed = latent_attention.LatentAttention._absorbed
    monkeypatch.setattr(latent_attention.LatentAttention, "_absorbed", lambda *a: calls.append(1) or absorbed(*a))
    for cache in ("dynamic", "static"):
        fast = model.generate(ids, cache_implementation=cache, **greedy)
        assert len(calls) == 2 * 7  # two layers, every step after the prompt's
        calls.clear()
        with monkeypatch.context() as patch:
            patch.setattr(latent_attention.LatentAttention, "_absorbs", lambda *a: False)
            expanded = model.generate(ids, cache_implementation=cache, **greedy)
        assert torch.equal(fast.sequences, expanded.sequences)
        torch.testing.assert_close(torch.stack(fast.logits), torch.stack(expanded.logits), atol=1e-5, rtol=1e-5)
    model.train()
    model(ids[:, :1], attention_mask=mask[:, :1]).logits.sum().backward()
    assert calls == []  # one token, but gradients: expanded
