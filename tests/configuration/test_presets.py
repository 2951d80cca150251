"""Named presets: every one is a valid config, builds and runs when shrunk, and the full-size shapes have the
published parameter counts."""

import pytest
import torch

from archlab import DecoderForCausalLM
from archlab.configuration import PRESETS, DecoderConfig, list_presets, preset_config, preset_kwargs


@pytest.mark.parametrize("name", list_presets())
def test_every_preset_is_a_valid_config_and_runs_shrunk(name):
    config = preset_config(name)
    assert isinstance(config, DecoderConfig)
    head_dim = 16
    heads = 4
    kv = 1 if config.num_key_value_heads == 1 else 2
    shrunk = {}
    if config.kv_lora_rank is not None:  # latent attention: a key and value per head, head_dim its rotary size
        kv = heads
        shrunk.update(kv_lora_rank=16, q_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=head_dim, v_head_dim=8)
    if config.num_local_experts:  # few narrow experts (still two a group under group-limited routing)
        shrunk.update(num_local_experts=2 * config.router_groups, moe_intermediate_size=32)
        shrunk.update(num_experts_per_tok=min(config.num_experts_per_tok, 2))
        if config.shared_expert_intermediate_size:
            shrunk["shared_expert_intermediate_size"] = 32
    small = preset_config(
        name,
        vocab_size=64,
        hidden_size=heads * head_dim,
        head_dim=head_dim,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        num_hidden_layers=len(config.layer_types) if config.nope_layers else 2,  # (Llama 4: a NoPE layer in 4)
        intermediate_size=96,
        max_position_embeddings=32,
        **({"sliding_window": 8} if config.sliding_window else {}),
        **({"query_pre_attn_scalar": head_dim} if config.query_pre_attn_scalar else {}),
        **shrunk,
    )
    for field in ("norm_type", "norm_position", "position_embedding_type", "mlp_type", "hidden_act"):
        assert getattr(small, field) == getattr(config, field)
    model = DecoderForCausalLM(small).eval()
    input_ids = torch.randint(0, 64, (1, 12))
    assert torch.isfinite(model(input_ids).logits).all()


@pytest.mark.parametrize(
    ("name", "params"),
    [
        ("llama-2-7b", 6_738_415_616),
        ("llama-2-13b", 13_015_864_320),
        ("mistral-7b", 7_241_732_096),
        ("olmo-2-1b", 1_484_916_736),
        ("gpt-oss-20b", 20_914_757_184),  # OpenAI: "21B parameters with 3.6B active"
        ("deepseek-v3", 671_026_404_352),  # DeepSeek: 671 B (its multi-token-prediction module aside)
        ("llama-4-scout", 107_769_861_120),  # Meta: 109 B with the vision tower, which the preset leaves out
    ],
)
def test_full_size_parameter_counts(name, params):
    with torch.device("meta"):
        model = DecoderForCausalLM(preset_config(name))
    assert sum(p.numel() for p in model.parameters()) == params


# allenai/OLMo-2-0425-1B's config.json (the architecture fields; transformers 5 reads `rope_theta` into
# `rope_parameters`)
OLMO_2_1B = dict(
    hidden_size=2048,
    num_hidden_layers=16,
    num_attention_heads=16,
    num_key_value_heads=16,
    intermediate_size=8192,
    vocab_size=100352,
    max_position_embeddings=4096,
    rope_theta=500000,
    rms_norm_eps=1e-6,
    attention_bias=False,
    hidden_act="silu",
    tie_word_embeddings=False,
    bos_token_id=None,
    eos_token_id=100257,
    pad_token_id=100277,
)


# openai/gpt-oss-20b's config.json (the architecture fields, without its MXFP4 quantization config)
GPT_OSS_20B = dict(
    attention_bias=True,
    head_dim=64,
    hidden_act="silu",
    hidden_size=2880,
    intermediate_size=2880,
    layer_types=["sliding_attention", "full_attention"] * 12,
    max_position_embeddings=131072,
    num_attention_heads=64,
    num_experts_per_tok=4,
    num_hidden_layers=24,
    num_key_value_heads=8,
    num_local_experts=32,
    rms_norm_eps=1e-5,
    rope_scaling={
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "rope_type": "yarn",
        "truncate": False,
    },
    rope_theta=150000,
    sliding_window=128,
    swiglu_limit=7.0,
    tie_word_embeddings=False,
    vocab_size=201088,
    eos_token_id=200002,
    pad_token_id=199999,
)


# deepseek-ai/DeepSeek-V3's config.json (the architecture fields; its `rope_scaling` as transformers 5 names it)
DEEPSEEK_V3 = dict(
    hidden_size=7168,
    intermediate_size=18432,
    moe_intermediate_size=2048,
    num_hidden_layers=61,
    num_attention_heads=128,
    num_key_value_heads=128,
    n_shared_experts=1,
    n_routed_experts=256,
    routed_scaling_factor=2.5,
    kv_lora_rank=512,
    q_lora_rank=1536,
    qk_rope_head_dim=64,
    v_head_dim=128,
    qk_nope_head_dim=128,
    n_group=8,
    topk_group=4,
    num_experts_per_tok=8,
    first_k_dense_replace=3,
    norm_topk_prob=True,
    vocab_size=129280,
    rms_norm_eps=1e-6,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 40.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
    },
    max_position_embeddings=163840,
    tie_word_embeddings=False,
    attention_bias=False,
    bos_token_id=0,
    eos_token_id=1,
)


# meta-llama/Llama-4-Scout-17B-16E's config.json, its `text_config` (the architecture fields; `no_rope_layers`,
# `moe_layers` and `layer_types` as Llama4TextConfig derives them from the interval fields, as published)
LLAMA_4_SCOUT = dict(
    attention_bias=False,
    attention_chunk_size=8192,
    attn_scale=0.1,
    attn_temperature_tuning=True,
    floor_scale=8192,
    head_dim=128,
    hidden_act="silu",
    hidden_size=5120,
    interleave_moe_layer_step=1,
    intermediate_size=8192,
    intermediate_size_mlp=16384,
    max_position_embeddings=10485760,
    num_attention_heads=40,
    num_experts_per_tok=1,
    num_hidden_layers=48,
    num_key_value_heads=8,
    num_local_experts=16,
    output_router_logits=False,
    rms_norm_eps=1e-5,
    rope_scaling={
        "factor": 16.0,
        "high_freq_factor": 1.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    rope_theta=500000.0,
    router_aux_loss_coef=0.001,
    tie_word_embeddings=False,
    use_qk_norm=True,
    vocab_size=202048,
    bos_token_id=200000,
    eos_token_id=[200001, 200007, 200008],
    pad_token_id=200018,
)


# preset -> (converter family, the published config.json above, active parameters a token as its authors count them,
# in billions: OpenAI's "3.6B active" and DeepSeek's "37B activated" besides the input embeddings, Meta's "17B active"
# with them; None for a dense model)
PUBLISHED = {
    "olmo-2-1b": ("olmo2", OLMO_2_1B, None),
    "gpt-oss-20b": ("gpt_oss", GPT_OSS_20B, 3.6),
    "deepseek-v3": ("deepseek_v3", DEEPSEEK_V3, 37),
    "llama-4-scout": ("llama4_text", LLAMA_4_SCOUT, 17),
}
ACTIVE_WITH_EMBEDDINGS = {"llama-4-scout"}


@pytest.mark.parametrize("name", PUBLISHED)
def test_a_preset_is_the_published_model(name):
    """The converter's reading of the model's config.json is the preset (token ids aside: presets give shapes), and
    the stock model of that config.json has the preset model's parameters, name for name (under archlab's names: the
    converter's layout) and shape for shape."""
    from archlab.conversion.families import FAMILIES
    from archlab.modeling.moe import count_parameters

    family_name, config_json, active = PUBLISHED[name]
    family = FAMILIES[family_name]
    published = family.archlab_config(config_json).to_dict()
    preset = preset_config(name).to_dict()
    token_ids = {"bos_token_id", "eos_token_id", "pad_token_id"}
    assert {k: v for k, v in published.items() if k not in token_ids} == {
        k: v for k, v in preset.items() if k not in token_ids
    }
    with torch.device("meta"):
        stock = family.model_class(family.stock_config(config_json))
        ours = DecoderForCausalLM(preset_config(name))
    shapes = {k: tuple(v.shape) for k, v in family.layout.to_archlab(stock.state_dict(), ours.config).items()}
    assert shapes == {k: tuple(v.shape) for k, v in ours.state_dict().items()}
    if active is not None:
        counts = count_parameters(ours)
        embedding = 0 if name in ACTIVE_WITH_EMBEDDINGS else counts["embedding"]
        assert abs((counts["active"] - embedding) / 1e9 - active) < 0.5  # as rounded by its authors


def test_overrides_and_errors():
    config = preset_config("tiny", position_embedding_type="alibi", vocab_size=500)
    assert config.position_embedding_type == "alibi" and config.vocab_size == 500
    assert config.hidden_size == PRESETS["tiny"]["hidden_size"]
    with pytest.raises(ValueError, match="Unknown preset 'llama-9'.*'tiny'"):
        preset_config("llama-9")
    with pytest.raises(ValueError, match="norm_position"):
        preset_config("tiny", norm_position="middle")
    kwargs = preset_kwargs("gemma-2-9b")
    kwargs["layer_types"].append("x")  # a copy: the registry is untouched
    assert len(PRESETS["gemma-2-9b"]["layer_types"]) == 42


def test_legacy_rope_overrides_change_the_presets_rope_parameters():
    """Every preset sets `rope_parameters`: a `rope_theta=` override beside it was dropped without a word, then
    refused as a disagreement; it sets the preset's base now, and a scaling override keeps the preset's base."""
    assert preset_config("llama-2-7b", rope_theta=5e5).rope_parameters == {"rope_type": "default", "rope_theta": 5e5}
    pythia = preset_config("pythia-1.4b", rope_scaling={"type": "linear", "factor": 2.0}).rope_parameters
    assert pythia == {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0, "partial_rotary_factor": 0.25}
    linear = preset_config("mistral-7b", rope_parameters={"rope_type": "linear", "factor": 4.0}).rope_parameters
    assert linear == {
        "rope_type": "linear",
        "factor": 4.0,
        "rope_theta": PRESETS["mistral-7b"]["rope_parameters"]["rope_theta"],
    }
    assert preset_config("tiny", partial_rotary_factor=0.5).rope_parameters["partial_rotary_factor"] == 0.5
    with pytest.raises(ValueError, match="`rope_scaling` must be a dict"):
        preset_config("tiny", rope_scaling=2.0)


def test_interleaved_preset_follows_a_new_depth():
    config = preset_config("gemma-2-9b", num_hidden_layers=5)
    assert config.layer_types == ["sliding_attention", "full_attention"] * 2 + ["sliding_attention"]


def test_fewer_layers_keep_the_first_dense_layers_while_a_sparse_one_remains():
    assert preset_config("deepseek-v3", num_hidden_layers=5).mlp_layer_types == ["dense"] * 3 + ["sparse"] * 2
    assert preset_config("deepseek-v3", num_hidden_layers=2).mlp_layer_types == ["dense", "sparse"]


def test_a_preset_repeats_its_layer_pattern_to_a_new_depth():
    """Llama 4 Scout's period of three chunked layers and a global NoPE one, at any depth."""
    config = preset_config("llama-4-scout", num_hidden_layers=6)
    assert config.layer_types == ["chunked_attention"] * 3 + ["full_attention"] + ["chunked_attention"] * 2
    assert config.nope_layers == [3] and config.mlp_layer_types == ["sparse"] * 6
    full = preset_config("llama-4-scout")
    assert full.nope_layers == list(range(3, 48, 4)) and full.layer_types.count("full_attention") == 12
    assert preset_config("gpt-oss-20b").layer_types == PRESETS["gpt-oss-20b"]["layer_types"]
