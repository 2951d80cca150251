"""GPT-2, OpenAI-GPT, GPT-NeoX, Falcon, BLOOM and MPT: decoders with their own parameter names, fused q/k/v
projections and (GPT-2, OpenAI-GPT) Conv1D weights, as `Family` rows.

Each row is data: the field mapping, the archlab values the family always has (`implied`), its weight rules
(`layouts.py`), and small config callables for what is computed (widths fixed at 4·hidden, activation names, the
block a flag selects) or refused (settings archlab cannot compute, or that transformers' stock class ignores, so
the checkpoint would not compute what its config says). Every stock LayerNorm epsilon is archlab's one
`rms_norm_eps`. Dropouts other than attention dropout only change training; archlab has none, so they are dropped
on import and exported as 0.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from transformers import (
    BloomConfig,
    BloomForCausalLM,
    FalconConfig,
    FalconForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    MptConfig,
    MptForCausalLM,
    OpenAIGPTConfig,
    OpenAIGPTLMHeadModel,
    PreTrainedConfig,
)

from ..modeling import DecoderForCausalLM
from .checks import fixed_ratio_width, refuse_export, refuse_import, setting
from .family import Family, same
from .layouts import FusedQKV, Rename, WeightRules

# archlab's parameter names (Llama's), per layer and at the top
LAYER = "model.layers.{n}"
ATTN, MLP = f"{LAYER}.self_attn", f"{LAYER}.mlp"
TOKENS = ("pad_token_id", "bos_token_id", "eos_token_id", "tie_word_embeddings", "initializer_range")
NO_DROPOUT = {"resid_pdrop": 0.0, "embd_pdrop": 0.0}  # GPT-2 and OpenAI-GPT default to 0.1; archlab has none


# --- GPT-NeoX (Pythia): parallel or sequential block, partial rotary ------------------------------------------------


def _neox_to_archlab(stock: PreTrainedConfig, values: Mapping[str, Any]) -> dict[str, Any]:
    # use_parallel_residual=False is the sequential block with its two norms: plain pre-norm
    return {"norm_position": "parallel" if stock.use_parallel_residual else "pre"}


def _neox_from_archlab(config: PreTrainedConfig) -> dict[str, Any]:
    if config.norm_position not in ("parallel", "pre"):
        refuse_export("GPTNeoXForCausalLM", {setting(config, "norm_position"): "GPT-NeoX has 'parallel' or 'pre'"})
    rope = dict(config.rope_parameters)
    rope.setdefault("partial_rotary_factor", 1.0)  # GPTNeoXConfig would fill in its own 0.25
    return {"use_parallel_residual": config.norm_position == "parallel", "rope_parameters": rope}


GPT_NEOX = Family(
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    DecoderForCausalLM,
    fields={
        **same(
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "hidden_act",
            "max_position_embeddings",
            "use_cache",
            "rope_parameters",
            "attention_bias",
            "attention_dropout",
            *TOKENS,
        ),
        "layer_norm_eps": "rms_norm_eps",
    },
    implied={"norm_type": "layer_norm", "mlp_type": "plain", "mlp_bias": True},
    to_archlab=_neox_to_archlab,
    from_archlab=_neox_from_archlab,
    expressible=frozenset({"norm_position"}),
    layout=WeightRules(
        (
            Rename("gpt_neox.embed_in", "model.embed_tokens"),
            Rename("gpt_neox.layers.{n}.input_layernorm", f"{LAYER}.input_layernorm"),
            Rename("gpt_neox.layers.{n}.post_attention_layernorm", f"{LAYER}.post_attention_layernorm"),
            FusedQKV("gpt_neox.layers.{n}.attention.query_key_value", ATTN, "per_head"),
            Rename("gpt_neox.layers.{n}.attention.dense", f"{ATTN}.o_proj"),
            Rename("gpt_neox.layers.{n}.mlp.dense_h_to_4h", f"{MLP}.up_proj"),
            Rename("gpt_neox.layers.{n}.mlp.dense_4h_to_h", f"{MLP}.down_proj"),
            Rename("gpt_neox.final_layer_norm", "model.norm"),
            Rename("lm_head", "lm_head"),
            Rename("embed_out", "lm_head"),  # the head's name before transformers 5
        ),
        base_prefix="gpt_neox",
        ignore=(r"\.attention\.(masked_)?bias$", r"inv_freq$"),
    ).layout(),
)


# --- Falcon: the new decoder architecture (parallel block, grouped k/v) and the old one (Falcon-7B, sequential) ------


def _falcon_to_archlab(stock: PreTrainedConfig, values: Mapping[str, Any]) -> dict[str, Any]:
    """The new architecture has a parallel block with two norms (`ln_attn`, `ln_mlp`; `num_ln_in_parallel_attn=2`,
    the default) or one shared norm (`num_ln_in_parallel_attn=1`); the old one has the parallel block with one shared
    norm (`parallel_attn=True`, Falcon-7B) or the sequential pre-norm block, with one key/value head (`multi_query`)
    or one per query head."""
    wrong = {}
    if stock.alibi:
        wrong[setting(stock, "alibi")] = (
            "Falcon adds its ALiBi bias before the 1/sqrt(head_dim) scaling and in bfloat16; archlab's ALiBi is neither"
        )
    layer_norms = stock.num_ln_in_parallel_attn
    if stock.new_decoder_architecture:
        if not stock.parallel_attn or layer_norms not in (None, 1, 2):
            wrong[f"{setting(stock, 'parallel_attn')}, {setting(stock, 'num_ln_in_parallel_attn')}"] = (
                "the new decoder architecture runs only with parallel_attn=True and 1 or 2 norms"
            )
        kv_heads, position = stock.num_kv_heads, "parallel_shared_norm" if layer_norms == 1 else "parallel"
    else:
        if stock.parallel_attn and layer_norms == 2:
            wrong[f"{setting(stock, 'num_ln_in_parallel_attn')} with new_decoder_architecture=False"] = (
                "the stock model builds ln_attn/ln_mlp but its old architecture reads input_layernorm: it cannot run"
            )
        if not stock.multi_query and stock.num_kv_heads != stock.num_attention_heads:
            wrong[setting(stock, "num_kv_heads")] = "the old architecture without multi_query has one per head"
        kv_heads = 1 if stock.multi_query else stock.num_attention_heads
        position = "parallel_shared_norm" if stock.parallel_attn else "pre"
    refuse_import("falcon", wrong)
    return {"num_key_value_heads": kv_heads, "norm_position": position}


def _falcon_from_archlab(config: PreTrainedConfig) -> dict[str, Any]:
    """The parallel block is the new architecture; the shared-norm block is the old one (Falcon-7B) where its heads
    allow (multi-query or one key/value head per query head), else the new one with one norm; the pre-norm block is
    the old sequential one."""
    heads, kv_heads, position = config.num_attention_heads, config.num_key_value_heads, config.norm_position
    old_heads = kv_heads in (1, heads)
    if position == "parallel" or (position == "parallel_shared_norm" and not old_heads):
        return {
            "new_decoder_architecture": True,
            "parallel_attn": True,
            "alibi": False,
            "num_kv_heads": kv_heads,
            "num_ln_in_parallel_attn": 2 if position == "parallel" else 1,
        }
    if position in ("parallel_shared_norm", "pre") and old_heads:
        return {
            "new_decoder_architecture": False,
            "parallel_attn": position == "parallel_shared_norm",
            "multi_query": kv_heads != heads,
            "num_kv_heads": kv_heads,
            "alibi": False,
        }
    refuse_export(
        "FalconForCausalLM",
        {
            f"{setting(config, 'norm_position')}, {setting(config, 'num_key_value_heads')}": (
                "Falcon has the parallel block with one or two norms and any key/value heads, or the pre-norm block "
                f"with num_key_value_heads 1 or {heads}"
            )
        },
    )
    return {}


FALCON = Family(
    FalconConfig,
    FalconForCausalLM,
    DecoderForCausalLM,
    fields={
        **same(
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "max_position_embeddings",
            "use_cache",
            "rope_parameters",
            "attention_dropout",
            *TOKENS,
        ),
        "ffn_hidden_size": "intermediate_size",
        "activation": "hidden_act",
        "layer_norm_epsilon": "rms_norm_eps",
        "bias": ("attention_bias", "mlp_bias"),
    },
    implied={"norm_type": "layer_norm", "mlp_type": "plain"},
    to_archlab=_falcon_to_archlab,
    from_archlab=_falcon_from_archlab,
    expressible=frozenset({"norm_position", "num_key_value_heads"}),
    layout=WeightRules(
        (
            Rename("transformer.word_embeddings", "model.embed_tokens"),
            Rename("transformer.h.{n}.ln_attn", f"{LAYER}.input_layernorm", when={"norm_position": "parallel"}),
            Rename("transformer.h.{n}.ln_mlp", f"{LAYER}.post_attention_layernorm", when={"norm_position": "parallel"}),
            Rename("transformer.h.{n}.input_layernorm", f"{LAYER}.input_layernorm"),  # pre-norm and shared norm
            Rename(
                "transformer.h.{n}.post_attention_layernorm",
                f"{LAYER}.post_attention_layernorm",
                when={"norm_position": "pre"},
            ),
            # new architecture: per k/v group; old multi-query: [q; k; v] = one group; old MHA: per head
            FusedQKV("transformer.h.{n}.self_attention.query_key_value", ATTN, "grouped"),
            Rename("transformer.h.{n}.self_attention.dense", f"{ATTN}.o_proj"),
            Rename("transformer.h.{n}.mlp.dense_h_to_4h", f"{MLP}.up_proj"),
            Rename("transformer.h.{n}.mlp.dense_4h_to_h", f"{MLP}.down_proj"),
            Rename("transformer.ln_f", "model.norm"),
            Rename("lm_head", "lm_head"),
        ),
        base_prefix="transformer",
        ignore=(r"inv_freq$",),
    ).layout(),
)


# --- BLOOM: ALiBi, embedding LayerNorm, MLP 4 x hidden ---------------------------------------------------------------


def _bloom_to_archlab(stock: PreTrainedConfig, values: Mapping[str, Any]) -> dict[str, Any]:
    if stock.slow_but_exact and stock.pretraining_tp > 1:
        refuse_import(
            "bloom",
            {
                f"{setting(stock, 'slow_but_exact')} with {setting(stock, 'pretraining_tp')}": (
                    "transformers' BloomForCausalLM then sums the sliced output projections without their biases "
                    "(self_attention.dense, mlp.dense_4h_to_h), which archlab does not compute"
                )
            },
        )
    if stock.apply_residual_connection_post_layernorm:
        refuse_import(
            "bloom",
            {
                setting(
                    stock, "apply_residual_connection_post_layernorm"
                ): "the residual taken after the norm has no archlab field"
            },
        )
    return {"intermediate_size": 4 * stock.hidden_size}


def _bloom_from_archlab(config: PreTrainedConfig) -> dict[str, Any]:
    refuse_export("BloomForCausalLM", fixed_ratio_width(config, "BLOOM"))
    return {}


BLOOM = Family(
    BloomConfig,
    BloomForCausalLM,
    DecoderForCausalLM,
    fields={
        **same("vocab_size", "hidden_size", "use_cache", "attention_dropout", *TOKENS),
        "n_layer": "num_hidden_layers",
        "n_head": "num_attention_heads",
        "layer_norm_epsilon": "rms_norm_eps",
    },
    implied={
        "position_embedding_type": "alibi",
        "norm_type": "layer_norm",
        "embedding_layernorm": True,
        "mlp_type": "plain",
        "hidden_act": "gelu_pytorch_tanh",
        "attention_bias": True,
        "mlp_bias": True,
    },
    to_archlab=_bloom_to_archlab,
    from_archlab=_bloom_from_archlab,
    # ALiBi has no table: the length does not change the function
    expressible=frozenset({"intermediate_size", "max_position_embeddings"}),
    layout=WeightRules(
        (
            Rename("transformer.word_embeddings", "model.embed_tokens"),
            Rename("transformer.word_embeddings_layernorm", "model.embedding_layernorm"),
            Rename("transformer.h.{n}.input_layernorm", f"{LAYER}.input_layernorm"),
            Rename("transformer.h.{n}.post_attention_layernorm", f"{LAYER}.post_attention_layernorm"),
            FusedQKV("transformer.h.{n}.self_attention.query_key_value", ATTN, "per_head"),
            Rename("transformer.h.{n}.self_attention.dense", f"{ATTN}.o_proj"),
            Rename("transformer.h.{n}.mlp.dense_h_to_4h", f"{MLP}.up_proj"),
            Rename("transformer.h.{n}.mlp.dense_4h_to_h", f"{MLP}.down_proj"),
            Rename("transformer.ln_f", "model.norm"),
            Rename("lm_head", "lm_head"),
        ),
        base_prefix="transformer",
    ).layout(),
)


# --- MPT: ALiBi, LayerNorm without bias, no linear biases ----------------------------------------------------------


def _mpt_to_archlab(stock: PreTrainedConfig, values: Mapping[str, Any]) -> dict[str, Any]:
    attn = stock.attn_config
    ignored = "transformers' MptForCausalLM ignores it, so its logits are not what the checkpoint was trained for"
    wrong = {}
    if not stock.no_bias:
        wrong[setting(stock, "no_bias")] = "transformers' MptForCausalLM has no biases"
    if stock.expansion_ratio != 4:
        wrong[setting(stock, "expansion_ratio")] = "transformers' MPT MLP is always 4 x d_model wide"
    if stock.logit_scale is not None:
        wrong[setting(stock, "logit_scale")] = ignored
    if attn.clip_qkv is not None:
        wrong[f"attn_config.{setting(attn, 'clip_qkv')}"] = ignored
    for name, default in (
        ("qk_ln", False),
        ("prefix_lm", False),
        ("alibi", True),
        ("attn_type", "multihead_attention"),
    ):
        if getattr(attn, name) != default:
            wrong[f"attn_config.{setting(attn, name)}"] = ignored
    if attn.alibi_bias_max != 8:
        wrong[f"attn_config.{setting(attn, 'alibi_bias_max')}"] = "archlab's ALiBi slopes are those of alibi_bias_max=8"
    refuse_import("mpt", wrong)
    return {
        "intermediate_size": 4 * stock.d_model,
        "attention_dropout": attn.attn_pdrop,
        # softmax_scale s scales the scores; archlab's query_pre_attn_scalar q scales them by q^-1/2
        "query_pre_attn_scalar": None if attn.softmax_scale is None else attn.softmax_scale**-2,
    }


def _mpt_from_archlab(config: PreTrainedConfig) -> dict[str, Any]:
    wrong = fixed_ratio_width(config, "MPT")
    dropout = config.attention_dropout
    if dropout != int(dropout):  # MptAttentionConfig types attn_pdrop as an int in transformers 5
        wrong[setting(config, "attention_dropout")] = "transformers' MptAttentionConfig takes an integer attn_pdrop"
    refuse_export("MptForCausalLM", wrong)
    scalar = config.query_pre_attn_scalar
    return {
        "attn_config": {
            "attn_pdrop": int(dropout),
            "softmax_scale": None if scalar is None else scalar**-0.5,
            "alibi": True,
            "alibi_bias_max": 8,
        },
        "no_bias": True,
        "expansion_ratio": 4,
    }


MPT = Family(
    MptConfig,
    MptForCausalLM,
    DecoderForCausalLM,
    fields={
        **same("vocab_size", "use_cache", *TOKENS),
        "d_model": "hidden_size",
        "n_heads": "num_attention_heads",
        "n_layers": "num_hidden_layers",
        "max_seq_len": "max_position_embeddings",
        "layer_norm_epsilon": "rms_norm_eps",
    },
    implied={
        "position_embedding_type": "alibi",
        "norm_type": "layer_norm",
        "norm_bias": False,
        "mlp_type": "plain",
        "hidden_act": "gelu",
    },
    to_archlab=_mpt_to_archlab,
    from_archlab=_mpt_from_archlab,
    expressible=frozenset({"intermediate_size", "attention_dropout", "query_pre_attn_scalar"}),
    layout=WeightRules(
        (
            Rename("transformer.wte", "model.embed_tokens"),
            Rename("transformer.blocks.{n}.norm_1", f"{LAYER}.input_layernorm"),
            FusedQKV("transformer.blocks.{n}.attn.Wqkv", ATTN, "concat"),
            Rename("transformer.blocks.{n}.attn.out_proj", f"{ATTN}.o_proj"),
            Rename("transformer.blocks.{n}.norm_2", f"{LAYER}.post_attention_layernorm"),
            Rename("transformer.blocks.{n}.ffn.up_proj", f"{MLP}.up_proj"),
            Rename("transformer.blocks.{n}.ffn.down_proj", f"{MLP}.down_proj"),
            Rename("transformer.norm_f", "model.norm"),
            Rename("lm_head", "lm_head"),
        ),
        base_prefix="transformer",
    ).layout(),
)


# --- GPT-2: learned positions, pre-norm, Conv1D weights ------------------------------------------------------------


def _gpt2_to_archlab(stock: PreTrainedConfig, values: Mapping[str, Any]) -> dict[str, Any]:
    wrong = {}
    if stock.scale_attn_by_inverse_layer_idx:
        wrong[setting(stock, "scale_attn_by_inverse_layer_idx")] = "per-layer score scaling has no archlab field"
    if stock.reorder_and_upcast_attn:
        wrong[setting(stock, "reorder_and_upcast_attn")] = "the upcast score kernel has no archlab field"
    if stock.add_cross_attention:
        wrong[setting(stock, "add_cross_attention")] = "archlab's decoder has no cross-attention"
    refuse_import("gpt2", wrong)
    return {
        "intermediate_size": stock.n_inner if stock.n_inner is not None else 4 * stock.n_embd,
        "query_pre_attn_scalar": None if stock.scale_attn_weights else 1.0,  # unscaled q·kᵀ: 1^-1/2
    }


def _gpt2_from_archlab(config: PreTrainedConfig) -> dict[str, Any]:
    scalar = config.query_pre_attn_scalar
    if scalar not in (None, 1, config.head_dim):
        refuse_export(
            "GPT2LMHeadModel",
            {
                setting(
                    config, "query_pre_attn_scalar"
                ): f"GPT-2 scales scores by head_dim^-1/2 (None or {config.head_dim}) or not at all (1)"
            },
        )
    return {"n_inner": config.intermediate_size, "scale_attn_weights": scalar != 1, **NO_DROPOUT}


def _conv1d_rules(layer: str, ln_1: str, ln_2: str) -> tuple[Rename | FusedQKV, ...]:
    """GPT-2 and OpenAI-GPT blocks: Conv1D projections, the norms named `ln_1`/`ln_2`."""
    return (
        Rename(f"{layer}.ln_1", f"{LAYER}.{ln_1}"),
        FusedQKV(f"{layer}.attn.c_attn", ATTN, "concat", transpose=True),
        Rename(f"{layer}.attn.c_proj", f"{ATTN}.o_proj", transpose=True),
        Rename(f"{layer}.ln_2", f"{LAYER}.{ln_2}"),
        Rename(f"{layer}.mlp.c_fc", f"{MLP}.up_proj", transpose=True),
        Rename(f"{layer}.mlp.c_proj", f"{MLP}.down_proj", transpose=True),
    )


GPT2 = Family(
    GPT2Config,
    GPT2LMHeadModel,
    DecoderForCausalLM,
    fields={
        **same("vocab_size", "use_cache", *TOKENS),
        "n_embd": "hidden_size",
        "n_layer": "num_hidden_layers",
        "n_head": "num_attention_heads",
        "n_positions": "max_position_embeddings",
        "activation_function": "hidden_act",
        "layer_norm_epsilon": "rms_norm_eps",
        "attn_pdrop": "attention_dropout",
    },
    implied={
        "position_embedding_type": "learned",
        "norm_type": "layer_norm",
        "mlp_type": "plain",
        "attention_bias": True,
        "mlp_bias": True,
    },
    to_archlab=_gpt2_to_archlab,
    from_archlab=_gpt2_from_archlab,
    expressible=frozenset({"intermediate_size", "query_pre_attn_scalar"}),
    layout=WeightRules(
        (
            Rename("transformer.wte", "model.embed_tokens"),
            Rename("transformer.wpe", "model.embed_positions"),
            *_conv1d_rules("transformer.h.{n}", "input_layernorm", "post_attention_layernorm"),
            Rename("transformer.ln_f", "model.norm"),
            Rename("lm_head", "lm_head"),
        ),
        base_prefix="transformer",
        ignore=(r"\.attn\.(masked_)?bias$",),  # causal-mask buffers in older checkpoints
    ).layout(),
)


# --- OpenAI-GPT (GPT-1): learned positions, post-norm, Conv1D weights, no final norm ------------------------------

# OpenAI-GPT's `afn` -> archlab `hidden_act`: its "gelu" is the tanh approximation (gelu_new)
OPENAI_ACTIVATIONS = {"gelu": "gelu_new", "relu": "relu", "silu": "silu", "swish": "silu"}


def _openai_to_archlab(stock: PreTrainedConfig, values: Mapping[str, Any]) -> dict[str, Any]:
    if stock.afn not in OPENAI_ACTIVATIONS:
        refuse_import("openai-gpt", {setting(stock, "afn"): f"OpenAI-GPT has {sorted(OPENAI_ACTIVATIONS)}"})
    return {"intermediate_size": 4 * stock.n_embd, "hidden_act": OPENAI_ACTIVATIONS[stock.afn]}


def _openai_from_archlab(config: PreTrainedConfig) -> dict[str, Any]:
    wrong = fixed_ratio_width(config, "OpenAI-GPT")
    afn = {ours: name for name, ours in reversed(OPENAI_ACTIVATIONS.items())}.get(config.hidden_act)
    if afn is None:
        wrong[setting(config, "hidden_act")] = f"OpenAI-GPT has {sorted(set(OPENAI_ACTIVATIONS.values()))}"
    refuse_export("OpenAIGPTLMHeadModel", wrong)
    return {"afn": afn, **NO_DROPOUT}


OPENAI_GPT = Family(
    OpenAIGPTConfig,
    OpenAIGPTLMHeadModel,
    DecoderForCausalLM,
    fields={
        **same("vocab_size", *TOKENS),
        "n_embd": "hidden_size",
        "n_layer": "num_hidden_layers",
        "n_head": "num_attention_heads",
        "n_positions": "max_position_embeddings",
        "layer_norm_epsilon": "rms_norm_eps",
        "attn_pdrop": "attention_dropout",
    },
    implied={
        "position_embedding_type": "learned",
        "norm_type": "layer_norm",
        "norm_position": "post",
        "mlp_type": "plain",
        "attention_bias": True,
        "mlp_bias": True,
    },
    to_archlab=_openai_to_archlab,
    from_archlab=_openai_from_archlab,
    expressible=frozenset({"intermediate_size", "hidden_act"}),
    layout=WeightRules(
        (
            Rename("transformer.tokens_embed", "model.embed_tokens"),
            Rename("transformer.positions_embed", "model.embed_positions"),
            *_conv1d_rules("transformer.h.{n}", "post_attention_layernorm", "post_feedforward_layernorm"),
            Rename("lm_head", "lm_head"),
        ),
        base_prefix="transformer",
        ignore=(r"\.attn\.bias$", r"position_ids$"),  # buffers in older checkpoints
    ).layout(),
)

FUSED_DECODERS = (GPT2, OPENAI_GPT, GPT_NEOX, FALCON, BLOOM, MPT)

__all__ = ["BLOOM", "FALCON", "FUSED_DECODERS", "GPT2", "GPT_NEOX", "MPT", "OPENAI_GPT", "OPENAI_ACTIVATIONS"]
