"""Every decoder family the converter knows, both ways, on tiny stock models with every parameter perturbed.

Per family (and per block variant a flag selects): stock folder -> archlab folder -> logits within 1e-4 (fp32) of
the stock model on a plain and a left-padded batch, the same greedy generation from a left-padded batch, then
archlab -> stock folder -> the very same tensors and bit-identical logits. A config each family cannot express is
refused with the fields named, both ways.
"""

from __future__ import annotations

import inspect
import json

import pytest
import torch
from transformers import (
    BloomConfig,
    FalconConfig,
    Gemma2Config,
    GemmaConfig,
    GPT2Config,
    GPTNeoXConfig,
    MptConfig,
    OpenAIGPTConfig,
    Qwen3Config,
)

from archlab import DecoderConfig, DecoderForCausalLM
from archlab.conversion import FAMILIES, ConversionError, convert_checkpoint

ATOL = 1e-4
VOCAB = 101
IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
LLAMA_LIKE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, max_position_embeddings=64, **IDS)
GPT_SHAPE = dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, **IDS)
NEOX_SHAPE = {k: v for k, v in LLAMA_LIKE.items() if k not in ("num_key_value_heads", "head_dim")}  # MHA only
ROPE_25 = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}

# case id -> (stock config, the archlab values the conversion must turn on)
CASES = {
    "gemma": (GemmaConfig(**LLAMA_LIKE, attention_bias=True),
              {"norm_type": "offset_rms_norm", "scale_embedding": True}),
    "gemma2": (Gemma2Config(**LLAMA_LIKE, query_pre_attn_scalar=16, sliding_window=4, attn_logit_softcapping=5.0,
                            final_logit_softcapping=3.0),
               {"norm_position": "sandwich", "layer_types": ["sliding_attention", "full_attention"]}),
    "qwen3": (Qwen3Config(**{**LLAMA_LIKE, "head_dim": 16}, attention_bias=True, use_sliding_window=True,
                          sliding_window=4, max_window_layers=1),
              {"use_qk_norm": True, "layer_types": ["full_attention", "sliding_attention"]}),
    "gpt_neox": (GPTNeoXConfig(**NEOX_SHAPE, rope_parameters=ROPE_25),
                 {"norm_position": "parallel", "norm_type": "layer_norm", "mlp_type": "plain"}),
    "gpt_neox-sequential": (
        GPTNeoXConfig(**NEOX_SHAPE, rope_parameters=ROPE_25, use_parallel_residual=False),
        {"norm_position": "pre"}),
    "falcon": (FalconConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                            num_kv_heads=2, new_decoder_architecture=True, bias=True, ffn_hidden_size=48,
                            max_position_embeddings=64, **IDS),
               {"norm_position": "parallel", "num_key_value_heads": 2, "attention_bias": True}),
    "falcon-sequential-mqa": (
        FalconConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, multi_query=True,
                     parallel_attn=False, max_position_embeddings=64, **IDS),
        {"norm_position": "pre", "num_key_value_heads": 1, "attention_bias": False}),
    "bloom": (BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4, **IDS),
              {"position_embedding_type": "alibi", "embedding_layernorm": True, "intermediate_size": 128}),
    "mpt": (MptConfig(vocab_size=VOCAB, d_model=48, n_heads=6, n_layers=2, max_seq_len=64,
                      attn_config={"softmax_scale": 0.3}, **IDS),
            {"position_embedding_type": "alibi", "norm_bias": False, "attention_bias": False,
             "num_attention_heads": 6}),
    "gpt2": (GPT2Config(**GPT_SHAPE, n_inner=48),
             {"position_embedding_type": "learned", "intermediate_size": 48, "hidden_act": "gelu_new"}),
    "gpt2-unscaled": (GPT2Config(**GPT_SHAPE, scale_attn_weights=False, activation_function="relu"),
                      {"query_pre_attn_scalar": 1.0, "hidden_act": "relu"}),
    "openai-gpt": (OpenAIGPTConfig(**GPT_SHAPE),
                   {"norm_position": "post", "position_embedding_type": "learned", "hidden_act": "gelu_new"}),
}


@torch.no_grad()
def _perturb(model: torch.nn.Module) -> None:
    """Every parameter random: norm gains around 1 (Gemma's (1 + w) around w = 0), the rest around 0."""
    for module in model.modules():
        is_norm = "norm" in type(module).__name__.lower()
        offset = "gemma" in type(module).__name__.lower()
        for name, param in module.named_parameters(recurse=False):
            mean = 1.0 if is_norm and name == "weight" and not offset else 0.0
            param.normal_(mean, 0.2 if is_norm else 0.3)


def _stock(case: str):
    stock_config, _ = CASES[case]
    model = FAMILIES[stock_config.model_type].model_class(stock_config).eval()
    _perturb(model)
    return model


def _batches():
    ids = torch.randint(3, VOCAB, (3, 12))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding
    mask[1, :1] = 0
    return ids, ids.masked_fill(mask == 0, 0), mask


def _max_diff(model, reference, **inputs) -> float:
    """Max |Δlogit| over the real (unmasked) tokens."""
    ours, theirs = model(**inputs).logits, reference(**inputs).logits
    real = inputs.get("attention_mask", torch.ones(ours.shape[:2])).bool()
    return (ours - theirs)[real].abs().max().item()


def _generate(model, ids, mask):
    return model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """case -> (stock model, its folder, the converted archlab folder, the folder exported back)."""
    torch.manual_seed(0)
    out = {}
    for case in CASES:
        root = tmp_path_factory.mktemp(case)
        reference = _stock(case)
        reference.save_pretrained(root / "stock")
        convert_checkpoint(root / "stock", root / "archlab")
        convert_checkpoint(root / "archlab", root / "back", to=reference.config.model_type)
        out[case] = reference, root
    return out


@pytest.mark.parametrize("case", CASES)
def test_stock_to_archlab_to_stock(case, folders):
    reference, root = folders[case]
    family = FAMILIES[reference.config.model_type]
    model = DecoderForCausalLM.from_pretrained(root / "archlab").eval()
    for name, value in CASES[case][1].items():
        assert getattr(model.config, name) == value, name

    ids, padded, mask = _batches()
    with torch.no_grad():
        assert _max_diff(model, reference, input_ids=ids) <= ATOL
        assert _max_diff(model, reference, input_ids=padded, attention_mask=mask) <= ATOL
        if "position_ids" in inspect.signature(reference.forward).parameters:
            # what `generate` passes: positions counted from the first real token (archlab's default is arange)
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            assert _max_diff(model, reference, input_ids=padded, attention_mask=mask, position_ids=positions) <= ATOL
    assert torch.equal(_generate(model, padded, mask), _generate(reference, padded, mask))

    back = family.model_class.from_pretrained(root / "back").eval()
    assert json.loads((root / "back" / "config.json").read_text())["architectures"] == [family.architecture]
    theirs, ours = reference.state_dict(), back.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    with torch.no_grad():
        assert torch.equal(back(input_ids=padded, attention_mask=mask).logits,
                           reference(input_ids=padded, attention_mask=mask).logits)


# family -> (archlab config changes it cannot express, the fields its refusal must name)
NOT_EXPRESSIBLE = {
    "gemma": ({"norm_type": "rms_norm"}, ["norm_type"]),
    "gemma2": ({"norm_position": "pre"}, ["norm_position"]),
    "qwen3": ({"use_qk_norm": False}, ["use_qk_norm"]),
    "gpt_neox": ({"num_key_value_heads": 2}, ["num_key_value_heads"]),
    "falcon": ({"norm_position": "pre", "num_key_value_heads": 2}, ["norm_position", "num_key_value_heads"]),
    "bloom": ({"intermediate_size": 96}, ["intermediate_size"]),
    "mpt": ({"norm_bias": True}, ["norm_bias"]),
    "gpt2": ({"norm_position": "post"}, ["norm_position"]),
    "openai-gpt": ({"hidden_act": "gelu"}, ["hidden_act"]),
}


@pytest.mark.parametrize("family", NOT_EXPRESSIBLE)
def test_export_refuses_what_the_family_cannot_compute(family, folders, tmp_path):
    changes, named = NOT_EXPRESSIBLE[family]
    _, root = folders[family]
    config = DecoderConfig.from_pretrained(root / "archlab")
    DecoderForCausalLM(DecoderConfig(**{**config.to_dict(), **changes})).save_pretrained(tmp_path / "archlab")
    with pytest.raises(ConversionError) as err:
        convert_checkpoint(tmp_path / "archlab", tmp_path / "out", to=family)
    assert all(name in str(err.value) for name in named), str(err.value)
    assert not (tmp_path / "out").exists()


# stock configs archlab cannot compute yet (or that transformers' stock class silently ignores)
NOT_IMPORTABLE = {
    "falcon-new-sequential": (FalconConfig(hidden_size=32, num_attention_heads=4, num_hidden_layers=1,
                                           new_decoder_architecture=True, parallel_attn=False), ["parallel_attn"]),
    "falcon-alibi": (FalconConfig(hidden_size=32, num_attention_heads=4, num_hidden_layers=1, alibi=True,
                                  parallel_attn=False), ["alibi"]),
    "bloom-post-ln-residual": (BloomConfig(hidden_size=32, n_head=4, apply_residual_connection_post_layernorm=True),
                               ["apply_residual_connection_post_layernorm"]),
    "mpt-clip-qkv": (MptConfig(d_model=32, n_heads=4, attn_config={"clip_qkv": 8.0, "alibi_bias_max": 16}),
                     ["clip_qkv", "alibi_bias_max"]),
    "mpt-biases": (MptConfig(d_model=32, n_heads=4, no_bias=False), ["no_bias"]),
    "gpt2-layer-scaled": (GPT2Config(n_embd=32, n_head=4, scale_attn_by_inverse_layer_idx=True,
                                     reorder_and_upcast_attn=True),
                          ["scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"]),
    "gemma-bidirectional": (GemmaConfig(hidden_size=32, num_attention_heads=4, head_dim=8,
                                        use_bidirectional_attention=True), ["use_bidirectional_attention"]),
}


@pytest.mark.parametrize("case", NOT_IMPORTABLE)
def test_import_refuses_what_archlab_cannot_compute(case):
    stock_config, named = NOT_IMPORTABLE[case]
    with pytest.raises(ConversionError) as err:
        FAMILIES[stock_config.model_type].archlab_config(stock_config.to_dict())
    assert all(name in str(err.value) for name in named), str(err.value)


def test_checkpoints_saved_from_the_base_model_and_legacy_names_convert(folders, tmp_path):
    """Hub checkpoints of GPT-2/BLOOM lack the `transformer.` prefix and carry causal-mask buffers; Pythia's head
    is `embed_out`. They convert to the same archlab weights."""
    from safetensors.torch import load_file, save_file

    for case, rename in (("gpt2", lambda k: k.removeprefix("transformer.")),
                         ("gpt_neox", lambda k: k.replace("lm_head.", "embed_out."))):
        reference, root = folders[case]
        src = tmp_path / case
        src.mkdir()
        (src / "config.json").write_text((root / "stock" / "config.json").read_text())
        state = {rename(k): v.clone() for k, v in reference.state_dict().items()}
        if case == "gpt2":
            state["h.0.attn.bias"] = torch.ones(1, 1, 4, 4)
        save_file(state, str(src / "model.safetensors"))
        convert_checkpoint(src, tmp_path / f"{case}-archlab")
        ours = load_file(str(tmp_path / f"{case}-archlab" / "model.safetensors"))
        expected = load_file(str(root / "archlab" / "model.safetensors"))
        assert ours.keys() == expected.keys() and all(torch.equal(ours[k], expected[k]) for k in ours)
