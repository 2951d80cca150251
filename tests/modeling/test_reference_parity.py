"""Catalogue variants against the Hugging Face models that have them: same weights, same logits (fp32, <= 1e-4).

Mistral (sliding window, sequences longer than the window), Gemma2 (sandwich norm, (1 + w) RMSNorm, sqrt(d)
embedding scale, GeGLU, attention and final soft-capping, interleaved local/global layers), Qwen3 (QK-norm),
OLMo 2 (each sub-layer's output normed before the residual add, QK-norm over the whole projections), GPT-NeoX
(parallel block, partial rotary, LayerNorm, biases) and BLOOM (ALiBi, embedding LayerNorm).
"""

import pytest
import torch
from transformers import (
    BloomConfig,
    BloomForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Olmo2Config,
    Olmo2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from archlab import DecoderConfig, DecoderForCausalLM

ATOL = 1e-4
VOCAB = 97
BASE = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    max_position_embeddings=64,
)


def _batch(seq_len=20):
    input_ids = torch.randint(3, VOCAB, (3, seq_len))
    mask = torch.ones_like(input_ids)
    mask[0, :5] = 0  # left padding
    mask[1, -4:] = 0  # right padding
    return input_ids.masked_fill(mask == 0, 0), mask


def _assert_logits_match(model, reference, seq_len=20):
    input_ids, mask = _batch(seq_len)
    with torch.no_grad():
        full = (model(input_ids).logits - reference(input_ids).logits).abs().max()
        padded = model(input_ids, attention_mask=mask).logits - reference(input_ids, attention_mask=mask).logits
    assert full <= ATOL
    assert padded[mask.bool()].abs().max() <= ATOL


def _assert_generation_matches(model, reference, cache="dynamic", prompt_len=9, new_tokens=14):
    input_ids, _ = _batch(prompt_len)
    mask = torch.ones_like(input_ids)
    mask[0, :3] = 0
    input_ids = input_ids.masked_fill(mask == 0, 0)
    kwargs = dict(
        attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0, cache_implementation=cache
    )
    assert torch.equal(model.generate(input_ids, **kwargs), reference.generate(input_ids, **kwargs))


# --- Mistral: the converter maps it; every layer slides -------------------------------------------------------------


def _mistral_pair(attn):
    from archlab.conversion import FAMILIES

    hf_config = MistralConfig(
        **BASE, intermediate_size=64, num_key_value_heads=2, sliding_window=6, attn_implementation=attn
    )
    reference = MistralForCausalLM(hf_config).eval()
    config = FAMILIES["mistral"].archlab_config(hf_config.to_dict())
    config._attn_implementation = attn
    assert config.sliding_window == 6 and set(config.layer_types) == {"sliding_attention"}
    model = DecoderForCausalLM(config).eval()
    model.load_state_dict(reference.state_dict(), strict=True)
    return model, reference


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_mistral_logits_past_the_window(attn):
    model, reference = _mistral_pair(attn)
    _assert_logits_match(model, reference, seq_len=20)  # window 6 << 20 tokens


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_mistral_generation_past_the_window(cache):
    model, reference = _mistral_pair("sdpa")
    _assert_generation_matches(model, reference, cache=cache)  # 9 + 14 tokens through a window of 6


def test_mistral_checkpoint_converts_both_ways(tmp_path):
    from transformers import AutoModelForCausalLM

    from archlab.conversion import ConversionError, convert_checkpoint

    _, reference = _mistral_pair("sdpa")
    reference.save_pretrained(tmp_path / "mistral")
    convert_checkpoint(tmp_path / "mistral", tmp_path / "archlab")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "archlab").eval()
    assert isinstance(model, DecoderForCausalLM) and model.config.sliding_window == 6
    _assert_logits_match(model, reference, seq_len=20)

    convert_checkpoint(tmp_path / "archlab", tmp_path / "back", to="mistral")
    back = MistralForCausalLM.from_pretrained(tmp_path / "back").eval()
    _assert_logits_match(model, back, seq_len=20)

    mixed = DecoderForCausalLM(
        DecoderConfig(
            **BASE,
            intermediate_size=64,
            sliding_window=6,
            layer_types=["sliding_attention", "full_attention", "full_attention"],
        )
    )
    mixed.save_pretrained(tmp_path / "mixed")
    with pytest.raises(ConversionError, match="layer_types"):
        convert_checkpoint(tmp_path / "mixed", tmp_path / "mixed_out", to="mistral")
    with pytest.raises(ConversionError, match="sliding_window"):  # Llama has no window at all
        convert_checkpoint(tmp_path / "archlab", tmp_path / "as_llama", to="llama")


# --- Gemma2 ---------------------------------------------------------------------------------------------------------


def _gemma2_pair():
    shape = dict(BASE, num_hidden_layers=4, intermediate_size=48, num_key_value_heads=2, head_dim=8)
    reference = Gemma2ForCausalLM(
        Gemma2Config(
            **shape,
            hidden_activation="gelu_pytorch_tanh",
            query_pre_attn_scalar=16,
            sliding_window=5,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=3.0,
            rms_norm_eps=1e-6,
            attn_implementation="eager",
        )
    ).eval()
    with torch.no_grad():  # Gemma2 initialises its (1 + w) gains at w = 0; make them matter
        for name, p in reference.named_parameters():
            if "norm" in name:
                p.normal_(0, 0.3)
    config = DecoderConfig(
        **shape,
        hidden_act="gelu_pytorch_tanh",
        query_pre_attn_scalar=16,
        sliding_window=5,
        layer_types=reference.config.layer_types,
        attn_logit_softcapping=5.0,
        final_logit_softcapping=3.0,
        norm_type="offset_rms_norm",
        norm_position="sandwich",
        scale_embedding=True,
        tie_word_embeddings=True,
        rope_parameters=reference.config.rope_parameters,
    )
    model = DecoderForCausalLM(config).eval()
    assert model.config._attn_implementation == "eager"  # soft-capping falls back from sdpa explicitly
    model.load_state_dict(reference.state_dict(), strict=True)
    return model, reference


def test_gemma2_logits():
    model, reference = _gemma2_pair()
    assert reference.config.layer_types == ["sliding_attention", "full_attention"] * 2
    _assert_logits_match(model, reference, seq_len=20)


def test_gemma2_generation():
    model, reference = _gemma2_pair()
    _assert_generation_matches(model, reference)


# --- Qwen3: QK-norm -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_qwen3_qk_norm_logits(attn):
    shape = dict(BASE, intermediate_size=64, num_key_value_heads=2, head_dim=16)
    reference = Qwen3ForCausalLM(Qwen3Config(**shape, attn_implementation=attn)).eval()
    with torch.no_grad():
        for name, p in reference.named_parameters():
            if "q_norm" in name or "k_norm" in name:
                p.normal_(1, 0.3)
    config = DecoderConfig(
        **shape,
        use_qk_norm=True,
        rope_parameters=reference.config.rope_parameters,
        rms_norm_eps=reference.config.rms_norm_eps,
        attn_implementation=attn,
    )
    model = DecoderForCausalLM(config).eval()
    model.load_state_dict(reference.state_dict(), strict=True)
    _assert_logits_match(model, reference)


# --- OLMo 2: output norms, QK-norm over the projections -------------------------------------------------------------


def _olmo2_pair(attn):
    """A 16-wide head (not hidden / heads = 8: Olmo2's attention reads `head_dim` from its config), GQA, every weight
    perturbed (the QK-norm's gains one per channel of the projection), so each norm's place and scope shows."""
    shape = dict(BASE, intermediate_size=64, num_key_value_heads=2)
    reference = Olmo2ForCausalLM(Olmo2Config(**shape, head_dim=16, attn_implementation=attn)).eval()
    with torch.no_grad():
        for name, p in reference.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.3)
    config = DecoderConfig(
        **shape,
        head_dim=16,
        norm_position="output",
        use_qk_norm=True,
        qk_norm_scope="projection",
        rope_parameters=reference.config.rope_parameters,
        rms_norm_eps=reference.config.rms_norm_eps,
        attn_implementation=attn,
    )
    model = DecoderForCausalLM(config).eval()
    model.load_state_dict(reference.state_dict(), strict=True)
    assert model.model.layers[0].self_attn.q_norm.weight.shape == (4 * 16,)
    return model, reference


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_olmo2_output_norm_and_projection_qk_norm_logits(attn):
    _assert_logits_match(*_olmo2_pair(attn))


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_olmo2_generation(cache):
    _assert_generation_matches(*_olmo2_pair("sdpa"), cache=cache)


# --- GPT-NeoX: parallel attention + MLP, partial rotary ------------------------------------------------------------


def _split_fused_qkv(state, prefix, num_heads, head_dim, ours):
    """Per-head interleaved [q | k | v] rows (GPT-NeoX, BLOOM) -> separate q/k/v projections."""
    for kind in ("weight", "bias"):
        fused = state.pop(f"{prefix}.query_key_value.{kind}")
        parts = fused.view(num_heads, 3, head_dim, *fused.shape[1:])
        for i, name in enumerate(("q_proj", "k_proj", "v_proj")):
            ours[f"{name}.{kind}"] = parts[:, i].reshape(num_heads * head_dim, *fused.shape[1:])


def _neox_state_dict(reference, config):
    state = dict(reference.state_dict())
    out = {
        "model.embed_tokens.weight": state.pop("gpt_neox.embed_in.weight"),
        "lm_head.weight": state.pop("lm_head.weight"),
    }
    for kind in ("weight", "bias"):
        out[f"model.norm.{kind}"] = state.pop(f"gpt_neox.final_layer_norm.{kind}")
    for i in range(config.num_hidden_layers):
        src, dst = f"gpt_neox.layers.{i}", f"model.layers.{i}"
        attn = {}
        _split_fused_qkv(state, f"{src}.attention", config.num_attention_heads, config.head_dim, attn)
        out.update({f"{dst}.self_attn.{k}": v for k, v in attn.items()})
        for kind in ("weight", "bias"):
            out[f"{dst}.self_attn.o_proj.{kind}"] = state.pop(f"{src}.attention.dense.{kind}")
            out[f"{dst}.mlp.up_proj.{kind}"] = state.pop(f"{src}.mlp.dense_h_to_4h.{kind}")
            out[f"{dst}.mlp.down_proj.{kind}"] = state.pop(f"{src}.mlp.dense_4h_to_h.{kind}")
            for norm in ("input_layernorm", "post_attention_layernorm"):
                out[f"{dst}.{norm}.{kind}"] = state.pop(f"{src}.{norm}.{kind}")
    assert not [k for k in state if not k.endswith("inv_freq")], state.keys()
    return out


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_gpt_neox_parallel_block_partial_rotary(attn):
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}
    reference = GPTNeoXForCausalLM(
        GPTNeoXConfig(
            **BASE,
            intermediate_size=128,
            hidden_act="gelu",
            rope_parameters=rope,
            attn_implementation=attn,
        )
    ).eval()
    with torch.no_grad():  # nonzero biases and norm parameters, so a wiring mistake shows
        for name, p in reference.named_parameters():
            if "bias" in name or "norm" in name:
                p.normal_(0.5 if "norm" in name and "weight" in name else 0.0, 0.2)
    config = DecoderConfig(
        **BASE,
        intermediate_size=128,
        hidden_act="gelu",
        rope_parameters=rope,
        norm_type="layer_norm",
        norm_position="parallel",
        mlp_type="plain",
        attention_bias=True,
        mlp_bias=True,
        rms_norm_eps=1e-5,
        attn_implementation=attn,
    )
    model = DecoderForCausalLM(config).eval()
    model.load_state_dict(_neox_state_dict(reference, config), strict=True)
    _assert_logits_match(model, reference)


# --- BLOOM: ALiBi ---------------------------------------------------------------------------------------------------


def _bloom_pair(attn, num_heads=4):
    reference = BloomForCausalLM(
        BloomConfig(
            vocab_size=VOCAB,
            hidden_size=48,
            n_layer=3,
            n_head=num_heads,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            attn_implementation="eager",
        )
    ).eval()
    with torch.no_grad():
        for name, p in reference.named_parameters():
            if "bias" in name or "layernorm" in name or "ln_f" in name:
                p.normal_(0.5 if "weight" in name else 0.0, 0.2)
    config = DecoderConfig(
        vocab_size=VOCAB,
        hidden_size=48,
        num_hidden_layers=3,
        num_attention_heads=num_heads,
        intermediate_size=192,
        hidden_act="gelu_pytorch_tanh",
        position_embedding_type="alibi",
        norm_type="layer_norm",
        rms_norm_eps=1e-5,
        embedding_layernorm=True,
        mlp_type="plain",
        attention_bias=True,
        mlp_bias=True,
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        max_position_embeddings=64,
        attn_implementation=attn,
    )
    model = DecoderForCausalLM(config).eval()
    state = dict(reference.state_dict())
    out = {
        "model.embed_tokens.weight": state.pop("transformer.word_embeddings.weight"),
        "lm_head.weight": state.pop("lm_head.weight"),
    }
    for kind in ("weight", "bias"):
        out[f"model.embedding_layernorm.{kind}"] = state.pop(f"transformer.word_embeddings_layernorm.{kind}")
        out[f"model.norm.{kind}"] = state.pop(f"transformer.ln_f.{kind}")
    for i in range(3):
        src, dst = f"transformer.h.{i}", f"model.layers.{i}"
        attn_state = {}
        _split_fused_qkv(state, f"{src}.self_attention", num_heads, 48 // num_heads, attn_state)
        out.update({f"{dst}.self_attn.{k}": v for k, v in attn_state.items()})
        for kind in ("weight", "bias"):
            out[f"{dst}.self_attn.o_proj.{kind}"] = state.pop(f"{src}.self_attention.dense.{kind}")
            out[f"{dst}.mlp.up_proj.{kind}"] = state.pop(f"{src}.mlp.dense_h_to_4h.{kind}")
            out[f"{dst}.mlp.down_proj.{kind}"] = state.pop(f"{src}.mlp.dense_4h_to_h.{kind}")
            for norm in ("input_layernorm", "post_attention_layernorm"):
                out[f"{dst}.{norm}.{kind}"] = state.pop(f"{src}.{norm}.{kind}")
    assert not state, state.keys()
    model.load_state_dict(out, strict=True)
    return model, reference


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("num_heads", [4, 6], ids=["heads-pow2", "heads-6"])
def test_bloom_alibi_logits(attn, num_heads):
    model, reference = _bloom_pair(attn, num_heads)
    _assert_logits_match(model, reference, seq_len=20)


def test_bloom_alibi_generation_with_sdpa():
    model, reference = _bloom_pair("sdpa")
    _assert_generation_matches(model, reference)
