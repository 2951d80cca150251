"""QK-norm and attention/final logit soft-capping in the encoder-decoder (seed 004), judged by a slow reference.

No Hugging Face encoder-decoder has these, so `reference_logits` below recomputes the whole pre-norm model from its
weights with explicit loops over layers and einsums: RMSNorm over each head's queries and keys (self- and
cross-attention), scores c · tanh(s / c), logits c · tanh(z / c) (Gemma2's formula, as the decoder).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from archlab import Seq2SeqConfig, Seq2SeqForConditionalGeneration

from helpers import TINY_SEQ2SEQ, assert_close_to_scale, seq2seq_incremental_logits

CONFIG = dict(
    TINY_SEQ2SEQ,
    vocab_size=53,
    decoder_key_value_heads=2,
    norm_position="pre",
    norm_type="rms_norm",
    position_embedding_type="learned",
    max_position_embeddings=32,
    init_std=0.3,
    use_qk_norm=True,
    attn_logit_softcapping=1.5,
    final_logit_softcapping=2.0,
)


def model_with(**overrides) -> Seq2SeqForConditionalGeneration:
    torch.manual_seed(0)
    model = Seq2SeqForConditionalGeneration(Seq2SeqConfig(**{**CONFIG, **overrides})).eval()
    with torch.no_grad():  # non-trivial norm gains, so that a missing or misplaced norm shows
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.uniform_(0.5, 1.5)
    return model


def batch():
    generator = torch.Generator().manual_seed(1)
    source = torch.randint(3, 53, (2, 9), generator=generator)
    mask = torch.ones_like(source)
    mask[1, 5:] = 0
    target = torch.randint(3, 53, (2, 7), generator=generator)
    return source, mask, target


def rms(x, norm):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon) * norm.weight


def reference_attention(module, x, memory, allowed, qk_norm: bool, cap: float | None):
    """softmax(cap(norm(q)·norm(k)ᵀ / √D)) v over `allowed` (B, Tq, Tk) key positions, head by head."""
    heads, kv_heads, dim = module.num_heads, module.num_key_value_heads, module.head_dim
    q = (x @ module.q_proj.weight.T + module.q_proj.bias).unflatten(-1, (heads, dim))
    k = (memory @ module.k_proj.weight.T + module.k_proj.bias).unflatten(-1, (kv_heads, dim))
    v = (memory @ module.v_proj.weight.T + module.v_proj.bias).unflatten(-1, (kv_heads, dim))
    if qk_norm:
        q, k = rms(q, module.q_norm), rms(k, module.k_norm)
    outputs = []
    for h in range(heads):
        g = h // (heads // kv_heads)  # the key/value head this query head reads
        scores = torch.einsum("bqd,bkd->bqk", q[:, :, h], k[:, :, g]) / dim**0.5
        if cap is not None:
            scores = cap * torch.tanh(scores / cap)
        scores = scores.masked_fill(~allowed, float("-inf"))
        outputs.append(torch.einsum("bqk,bkd->bqd", scores.softmax(-1), v[:, :, g]))
    return torch.cat(outputs, -1) @ module.out_proj.weight.T + module.out_proj.bias


def reference_logits(model, source, mask, target, qk_norm=True, attn_cap=1.5, final_cap=2.0):
    encoder, decoder = model.model.encoder, model.model.decoder
    ffn = lambda layer, x: layer.fc2(torch.relu(layer.fc1(x)))  # noqa: E731
    h = encoder.embed_tokens(source) * encoder.embed_scale + encoder.embed_positions.weight[: source.shape[1]]
    source_allowed = mask.bool()[:, None, :].expand(-1, source.shape[1], -1)
    for layer in encoder.layers:
        h = h + reference_attention(
            layer.self_attn,
            rms(h, layer.self_attn_layer_norm),
            rms(h, layer.self_attn_layer_norm),
            source_allowed,
            qk_norm,
            attn_cap,
        )
        h = h + ffn(layer, rms(h, layer.final_layer_norm))
    memory = rms(h, encoder.layer_norm)

    steps = target.shape[1]
    y = decoder.embed_tokens(target) * decoder.embed_scale + decoder.embed_positions.weight[:steps]
    causal = torch.ones(steps, steps, dtype=torch.bool).tril()[None].expand(target.shape[0], -1, -1)
    cross_allowed = mask.bool()[:, None, :].expand(-1, steps, -1)
    for layer in decoder.layers:
        normed = rms(y, layer.self_attn_layer_norm)
        y = y + reference_attention(layer.self_attn, normed, normed, causal, qk_norm, attn_cap)
        y = y + reference_attention(
            layer.encoder_attn, rms(y, layer.encoder_attn_layer_norm), memory, cross_allowed, qk_norm, attn_cap
        )
        y = y + ffn(layer, rms(y, layer.final_layer_norm))
    logits = rms(y, decoder.layer_norm) @ model.lm_head.weight.T + model.final_logits_bias
    return logits if final_cap is None else final_cap * torch.tanh(logits / final_cap)


def test_qk_norm_and_soft_capping_match_the_slow_reference():
    model = model_with()
    assert model.config._attn_implementation == "eager"  # SDPA cannot soft-cap: the default falls back
    source, mask, target = batch()
    with torch.no_grad():
        got = model(input_ids=source, attention_mask=mask, decoder_input_ids=target).logits
        expected = reference_logits(model, source, mask, target)
        # every feature is active here: leaving any one out of the reference changes the logits
        for ablation in (dict(qk_norm=False), dict(attn_cap=None), dict(final_cap=None)):
            assert (reference_logits(model, source, mask, target, **ablation) - expected).abs().max() > 1e-2
    assert (got - expected).abs().max() <= 1e-4


def test_qk_norm_alone_matches_the_reference_under_sdpa_and_eager():
    model = model_with(attn_logit_softcapping=None, final_logit_softcapping=None)
    assert model.config._attn_implementation == "sdpa"
    source, mask, target = batch()
    with torch.no_grad():
        sdpa = model(input_ids=source, attention_mask=mask, decoder_input_ids=target).logits
        expected = reference_logits(model, source, mask, target, attn_cap=None, final_cap=None)
        model.set_attn_implementation("eager")
        eager = model(input_ids=source, attention_mask=mask, decoder_input_ids=target).logits
    assert (sdpa - expected).abs().max() <= 1e-4
    assert_close_to_scale(eager, sdpa, rtol=1e-5)


def test_qk_norm_parameters_in_self_and_cross_attention():
    names = set(model_with().state_dict())
    for prefix in (
        "model.encoder.layers.0.self_attn",
        "model.decoder.layers.1.self_attn",
        "model.decoder.layers.1.encoder_attn",
    ):
        assert {f"{prefix}.q_norm.weight", f"{prefix}.k_norm.weight"} <= names
    assert not any("q_norm" in name for name in model_with(use_qk_norm=False).state_dict())


def test_incremental_decoding_equals_full_forward():
    model = model_with()
    source, mask, target = batch()
    with torch.no_grad():
        full = model(input_ids=source, attention_mask=mask, decoder_input_ids=target).logits
    incremental = seq2seq_incremental_logits(model, source, mask, target, prefix=2)
    assert_close_to_scale(incremental, full, rtol=1e-5)


def test_training_loss_is_the_cross_entropy_of_the_capped_logits():
    model = model_with(lm_loss_chunk_size=4).train()  # the chunked loss has no cap: the model must not use it
    source, mask, labels = batch()
    labels[0, -2:] = -100
    out = model(input_ids=source, attention_mask=mask, labels=labels)
    with torch.no_grad():
        decoder_input_ids = model.prepare_decoder_input_ids_from_labels(labels)
        expected = F.cross_entropy(
            reference_logits(model, source, mask, decoder_input_ids).flatten(0, 1), labels.flatten(), ignore_index=-100
        )
    assert out.logits is not None and out.logits.abs().max() <= 2.0
    torch.testing.assert_close(out.loss, expected, atol=1e-5, rtol=1e-5)


def test_backends_and_bad_values_are_refused():
    with pytest.raises(ValueError, match="`attn_logit_softcapping` cannot be applied by `attn_implementation='sdpa'`"):
        Seq2SeqConfig(**CONFIG, attn_implementation="sdpa")
    model = model_with()
    with pytest.raises(ValueError, match="`attn_logit_softcapping`"):
        model.set_attn_implementation("sdpa")
    for name in ("attn_logit_softcapping", "final_logit_softcapping", "d_kv"):
        with pytest.raises(ValueError, match=f"`{name}` must be a positive"):
            Seq2SeqConfig(**{**CONFIG, name: 0})
    # the decoder-only QK-norm over the whole projection: the shared attention would have read it, untested here
    with pytest.raises(ValueError, match="`qk_norm_scope`='projection' is a DecoderConfig field"):
        Seq2SeqConfig(**CONFIG, qk_norm_scope="projection")
