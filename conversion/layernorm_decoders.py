"""StableLM, Phi, OPT, StarCoder2 and GPT-J: LayerNorm decoders with separate q/k/v projections, as `Family` rows.

StableLM has Llama's parameter names (its weights need no rule but for StableLM 2 12B's per-head QK LayerNorms, stacked
into archlab's (heads, head_dim) gains); Phi, OPT, StarCoder2 and GPT-J have their own, renamed
by the rules of `layouts.py` (GPT-J's q/k rows also reordered for its interleaved RoPE: `interleaved_rope.py`). The
blocks they select with a flag are archlab's `norm_position` values: StableLM's `use_parallel_residual` and Phi's and
GPT-J's only block are the parallel block with one shared norm ("parallel_shared_norm"), OPT's
`do_layer_norm_before=False` (OPT-350m) is the post-norm block. Every stock LayerNorm epsilon is archlab's
`rms_norm_eps` (OPT's is nn.LayerNorm's fixed 1e-5). Dropouts other than attention dropout only change training;
archlab has none, so they are dropped on import and exported as 0.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch
from transformers import (
    GPTJConfig,
    GPTJForCausalLM,
    OPTConfig,
    OPTForCausalLM,
    PhiConfig,
    PhiForCausalLM,
    PreTrainedConfig,
    StableLmConfig,
    StableLmForCausalLM,
    Starcoder2Config,
    Starcoder2ForCausalLM,
)

from ..modeling import DecoderForCausalLM
from .checks import (
    head_dim_given,
    head_dim_to_write,
    one_window_for_every_layer,
    qkv_bias_of,
    refuse_export,
    refuse_import,
    setting,
)
from .family import ConversionError, Family, Layout, StateDict, same
from .fused_decoders import ATTN, LAYER, MLP
from .interleaved_rope import interleaved_rope, rotary_dimension
from .layouts import Rename, WeightRules

# fields StableLM and Phi share with archlab (and Llama) under the same names
SHARED_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "hidden_act",
    "max_position_embeddings",
    "initializer_range",
    "use_cache",
    "tie_word_embeddings",
    "rope_parameters",
    "attention_dropout",
    "pad_token_id",
    "bos_token_id",
    "eos_token_id",
)


def _separate_qkv(stock_attention: str) -> tuple[Rename, ...]:
    return tuple(Rename(f"{stock_attention}.{proj}", f"{ATTN}.{proj}") for proj in ("q_proj", "k_proj", "v_proj"))


def _full_rotary_unless_given(config: PreTrainedConfig) -> dict[str, Any]:
    """archlab's rope_parameters without `partial_rotary_factor` rotate every channel; StableLM (0.25) and Phi (0.5)
    would fill in their own default, so the factor is written out."""
    return {**config.rope_parameters, "partial_rotary_factor": config.rope_parameters.get("partial_rotary_factor", 1.0)}


# --- StableLM: Llama's names, LayerNorm, partial rotary, sequential or shared-norm parallel block -------------------


def _stablelm_to_archlab(stock: PreTrainedConfig, values: Mapping[str, Any]) -> dict[str, Any]:
    # StableLM 2 12B's `qk_layernorm`: a LayerNorm (no bias) of its own per head, archlab's "per_head" QK-norm
    qk_norm = {"use_qk_norm": True, "qk_norm_scope": "per_head"} if stock.qk_layernorm else {}
    return {"norm_position": "parallel_shared_norm" if stock.use_parallel_residual else "pre", **qk_norm}


def _stablelm_from_archlab(config: PreTrainedConfig) -> dict[str, Any]:
    if config.norm_position not in ("parallel_shared_norm", "pre"):
        refuse_export(
            "StableLmForCausalLM",
            {setting(config, "norm_position"): "StableLM has 'pre' or 'parallel_shared_norm' (use_parallel_residual)"},
        )
    if config.use_qk_norm and config.qk_norm_scope != "per_head":
        refuse_export(
            "StableLmForCausalLM",
            {setting(config, "qk_norm_scope"): "StableLM's qk_layernorm is a LayerNorm per head: 'per_head'"},
        )
    return {
        "use_parallel_residual": config.norm_position == "parallel_shared_norm",
        "qk_layernorm": config.use_qk_norm,
        "use_qkv_bias": qkv_bias_of(config),
        "rope_parameters": _full_rotary_unless_given(config),
    }


# StableLM's per-head QK LayerNorms (`q_layernorm.norms.H`, no bias) and archlab's `q_norm` of (heads, head_dim) gains,
# whose biases (archlab's LayerNorms have one) are zero on import and must be zero to export
STOCK_HEAD_NORM = re.compile(
    r"^(?P<attn>model\.layers\.\d+\.self_attn)\.(?P<qk>[qk])_layernorm\.norms\.(?P<head>\d+)\.weight$"
)
ARCHLAB_HEAD_NORM = re.compile(r"^(?P<attn>model\.layers\.\d+\.self_attn)\.(?P<qk>[qk])_norm\.(?P<leaf>weight|bias)$")


def _head_norms_to_archlab(state_dict: StateDict, config: PreTrainedConfig) -> StateDict:
    out: StateDict = {}
    gains: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    for key, tensor in state_dict.items():
        match = STOCK_HEAD_NORM.match(key)
        if match is None:
            out[key] = tensor
        else:
            gains.setdefault((match["attn"], match["qk"]), {})[int(match["head"])] = tensor
    for (attn, qk), per_head in gains.items():
        weight = torch.stack([per_head[head] for head in sorted(per_head)])
        out[f"{attn}.{qk}_norm.weight"] = weight
        out[f"{attn}.{qk}_norm.bias"] = torch.zeros_like(weight)
    return out


def _head_norms_from_archlab(state_dict: StateDict, config: PreTrainedConfig) -> StateDict:
    out: StateDict = {}
    for key, tensor in state_dict.items():
        match = ARCHLAB_HEAD_NORM.match(key)
        if match is None:
            out[key] = tensor
        elif match["leaf"] == "bias":
            if tensor.any():
                raise ConversionError(
                    f"`{key}` is not zero: StableLM's per-head QK LayerNorms have no bias, so a stock "
                    "StableLmForCausalLM cannot compute this model."
                )
        else:
            for head, gain in enumerate(tensor):
                out[f"{match['attn']}.{match['qk']}_layernorm.norms.{head}.weight"] = gain.contiguous()
    return out


STABLELM = Family(
    StableLmConfig,
    StableLmForCausalLM,
    DecoderForCausalLM,
    fields={**same(*SHARED_FIELDS), "layer_norm_eps": "rms_norm_eps", "use_qkv_bias": "qkv_bias"},
    implied={"norm_type": "layer_norm"},
    to_archlab=_stablelm_to_archlab,
    from_archlab=_stablelm_from_archlab,
    expressible=frozenset({"norm_position", "use_qk_norm", "qk_norm_scope"}),
    layout=Layout(to_archlab=_head_norms_to_archlab, from_archlab=_head_norms_from_archlab),
)


# --- Phi: one shared LayerNorm per block, biases everywhere (the head too), partial rotary --------------------------


# Phi's config has no `head_dim` field, but its attention and RoPE read one from config.json (`head_dim_given`);
# its QK LayerNorms are always hidden / heads wide, so with them a head of another size fails in the stock forward.
QK_NORM_HEAD_SIZE = "Phi's q_layernorm/k_layernorm are hidden_size / num_attention_heads wide whatever head_dim is"


def _phi_to_archlab(stock: PreTrainedConfig, values: Mapping[str, Any]) -> dict[str, Any]:
    head_dim = head_dim_given(stock, values)
    if stock.qk_layernorm and head_dim["head_dim"] * stock.num_attention_heads != stock.hidden_size:
        refuse_import("phi", {f"head_dim={head_dim['head_dim']!r} with qk_layernorm=True": QK_NORM_HEAD_SIZE})
    return head_dim


def _phi_from_archlab(config: PreTrainedConfig) -> dict[str, Any]:
    head_dim = head_dim_to_write(config)
    if head_dim and config.use_qk_norm:
        refuse_export("PhiForCausalLM", {f"{setting(config, 'head_dim')}, use_qk_norm=True": QK_NORM_HEAD_SIZE})
    return {
        "rope_parameters": _full_rotary_unless_given(config),
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        **head_dim,
    }


PHI = Family(
    PhiConfig,
    PhiForCausalLM,
    DecoderForCausalLM,
    # Phi's qk_layernorm is one LayerNorm over head_dim shared by the heads, as archlab's QK-norm
    fields={**same(*SHARED_FIELDS), "layer_norm_eps": "rms_norm_eps", "qk_layernorm": "use_qk_norm"},
    implied={
        "norm_type": "layer_norm",
        "norm_position": "parallel_shared_norm",
        "mlp_type": "plain",
        "attention_bias": True,
        "mlp_bias": True,
        "lm_head_bias": True,
    },
    to_archlab=_phi_to_archlab,
    from_archlab=_phi_from_archlab,
    expressible=frozenset({"head_dim"}),
    layout=WeightRules(
        (
            Rename("model.embed_tokens", "model.embed_tokens"),
            Rename("model.layers.{n}.input_layernorm", f"{LAYER}.input_layernorm"),
            *_separate_qkv("model.layers.{n}.self_attn"),
            Rename("model.layers.{n}.self_attn.dense", f"{ATTN}.o_proj"),
            Rename("model.layers.{n}.self_attn.q_layernorm", f"{ATTN}.q_norm"),
            Rename("model.layers.{n}.self_attn.k_layernorm", f"{ATTN}.k_norm"),
            Rename("model.layers.{n}.mlp.fc1", f"{MLP}.up_proj"),
            Rename("model.layers.{n}.mlp.fc2", f"{MLP}.down_proj"),
            Rename("model.final_layernorm", "model.norm"),
            Rename("lm_head", "lm_head"),
        ),
        base_prefix="model",
        ignore=(r"inv_freq$",),
    ).layout(),
)


# --- OPT: learned positions offset by 2 and numbered from the mask, pre- or post-norm, ReLU ------------------------


def _opt_to_archlab(stock: PreTrainedConfig, values: Mapping[str, Any]) -> dict[str, Any]:
    wrong = {}
    if stock.word_embed_proj_dim != stock.hidden_size:
        wrong[setting(stock, "word_embed_proj_dim")] = (
            f"embeddings narrower than hidden_size={stock.hidden_size} (project_in/project_out, OPT-350m) have no "
            "archlab field"
        )
    if stock.do_layer_norm_before and stock._remove_final_layer_norm:
        wrong[setting(stock, "_remove_final_layer_norm")] = "archlab's pre-norm stack always ends with a norm"
    if not stock.layer_norm_elementwise_affine:
        wrong[setting(stock, "layer_norm_elementwise_affine")] = "archlab's norms always have a gain and bias"
    refuse_import("opt", wrong)
    return {"norm_position": "pre" if stock.do_layer_norm_before else "post"}


def _opt_from_archlab(config: PreTrainedConfig) -> dict[str, Any]:
    if config.norm_position not in ("pre", "post"):
        refuse_export(
            "OPTForCausalLM", {setting(config, "norm_position"): "OPT has 'pre' or 'post' (do_layer_norm_before=False)"}
        )
    return {
        "do_layer_norm_before": config.norm_position == "pre",
        "word_embed_proj_dim": config.hidden_size,
        "dropout": 0.0,
        "layerdrop": 0.0,
    }


def _opt_norms(position: str, attention_norm: str, mlp_norm: str) -> tuple[Rename, ...]:
    """OPT names a layer's two norms by what they sit next to; archlab by where they sit in its pre/post block."""
    layer, when = "model.decoder.layers.{n}", {"norm_position": position}
    return (
        Rename(f"{layer}.self_attn_layer_norm", f"{LAYER}.{attention_norm}", when=when),
        Rename(f"{layer}.final_layer_norm", f"{LAYER}.{mlp_norm}", when=when),
    )


OPT = Family(
    OPTConfig,
    OPTForCausalLM,
    DecoderForCausalLM,
    fields={
        **same(
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "max_position_embeddings",
            "attention_dropout",
            "use_cache",
            "pad_token_id",
            "bos_token_id",
            "eos_token_id",
            "tie_word_embeddings",
        ),
        "ffn_dim": "intermediate_size",
        "activation_function": "hidden_act",
        "init_std": "initializer_range",
        "enable_bias": ("attention_bias", "mlp_bias"),
    },
    implied={
        "norm_type": "layer_norm",
        "rms_norm_eps": 1e-5,
        "mlp_type": "plain",
        "position_embedding_type": "learned",
        "position_embedding_offset": 2,
        "position_ids_from_attention_mask": True,
    },
    to_archlab=_opt_to_archlab,
    from_archlab=_opt_from_archlab,
    expressible=frozenset({"norm_position"}),
    layout=WeightRules(
        (
            Rename("model.decoder.embed_tokens", "model.embed_tokens"),
            Rename("model.decoder.embed_positions", "model.embed_positions"),
            *_opt_norms("pre", "input_layernorm", "post_attention_layernorm"),
            *_opt_norms("post", "post_attention_layernorm", "post_feedforward_layernorm"),
            *_separate_qkv("model.decoder.layers.{n}.self_attn"),
            Rename("model.decoder.layers.{n}.self_attn.out_proj", f"{ATTN}.o_proj"),
            Rename("model.decoder.layers.{n}.fc1", f"{MLP}.up_proj"),
            Rename("model.decoder.layers.{n}.fc2", f"{MLP}.down_proj"),
            Rename("model.decoder.final_layer_norm", "model.norm"),
            Rename("lm_head", "lm_head"),
        ),
        base_prefix="model",
    ).layout(),
)

# --- StarCoder2: Llama's attention with biases, LayerNorm, a plain GELU MLP (c_fc / c_proj), one window ---------------


def _starcoder2_from_archlab(config: PreTrainedConfig) -> dict[str, Any]:
    return {
        **one_window_for_every_layer(config, "Starcoder2ForCausalLM"),
        **head_dim_to_write(config),
        "residual_dropout": 0.0,
        "embedding_dropout": 0.0,
    }


STARCODER2 = Family(
    Starcoder2Config,
    Starcoder2ForCausalLM,
    DecoderForCausalLM,
    fields={
        **same(*SHARED_FIELDS, "sliding_window"),
        "norm_epsilon": "rms_norm_eps",
        "use_bias": ("attention_bias", "mlp_bias"),
    },
    implied={"norm_type": "layer_norm", "mlp_type": "plain"},
    # its config has no head_dim field, but its attention and RoPE read one from config.json
    to_archlab=lambda stock, values: head_dim_given(stock, values),
    from_archlab=_starcoder2_from_archlab,
    expressible=frozenset({"head_dim", "layer_types"}),
    layout=WeightRules(
        (
            Rename("model.embed_tokens", "model.embed_tokens"),
            Rename("model.layers.{n}.input_layernorm", f"{LAYER}.input_layernorm"),
            Rename("model.layers.{n}.post_attention_layernorm", f"{LAYER}.post_attention_layernorm"),
            *_separate_qkv("model.layers.{n}.self_attn"),
            Rename("model.layers.{n}.self_attn.o_proj", f"{ATTN}.o_proj"),
            Rename("model.layers.{n}.mlp.c_fc", f"{MLP}.up_proj"),
            Rename("model.layers.{n}.mlp.c_proj", f"{MLP}.down_proj"),
            Rename("model.norm", "model.norm"),
            Rename("lm_head", "lm_head"),
        ),
        base_prefix="model",
        ignore=(r"inv_freq$",),
    ).layout(),
)

# --- GPT-J: one shared LayerNorm per block (the parallel block), interleaved partial RoPE, biased MLP and head -------

GPTJ_ROPE_BASE = 10000.0  # GPT-J's `create_sinusoidal_positions`: fixed


def _gptj_to_archlab(stock: PreTrainedConfig, values: Mapping[str, Any]) -> dict[str, Any]:
    head_dim = stock.n_embd // stock.n_head
    rotary = stock.rotary_dim or head_dim
    return {
        "intermediate_size": stock.n_inner or 4 * stock.n_embd,
        "head_dim": head_dim,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": GPTJ_ROPE_BASE,
            "partial_rotary_factor": rotary / head_dim,
        },
    }


def _gptj_from_archlab(config: PreTrainedConfig) -> dict[str, Any]:
    rope = config.rope_parameters
    wrong = {}
    if rope.get("rope_type", "default") != "default" or rope.get("rope_theta") != GPTJ_ROPE_BASE:
        wrong[f"rope_parameters={rope!r}"] = f"GPT-J's RoPE is the default one with base {GPTJ_ROPE_BASE:g}"
    if config.head_dim * config.num_attention_heads != config.hidden_size:
        wrong[setting(config, "head_dim")] = "GPT-J's heads are hidden_size / n_head wide"
    refuse_export("GPTJForCausalLM", wrong)
    return {
        "n_inner": config.intermediate_size,
        "rotary_dim": rotary_dimension(config),
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
    }


GPTJ = Family(
    GPTJConfig,
    GPTJForCausalLM,
    DecoderForCausalLM,
    fields={
        **same("vocab_size", "initializer_range", "use_cache", "bos_token_id", "eos_token_id", "pad_token_id"),
        "tie_word_embeddings": "tie_word_embeddings",
        "n_positions": "max_position_embeddings",
        "n_embd": "hidden_size",
        "n_layer": "num_hidden_layers",
        "n_head": ("num_attention_heads", "num_key_value_heads"),
        "activation_function": "hidden_act",
        "layer_norm_epsilon": "rms_norm_eps",
        "attn_pdrop": "attention_dropout",
    },
    implied={
        "norm_type": "layer_norm",
        "norm_position": "parallel_shared_norm",
        "mlp_type": "plain",
        "attention_bias": False,
        "mlp_bias": True,
        "lm_head_bias": True,
    },
    to_archlab=_gptj_to_archlab,
    from_archlab=_gptj_from_archlab,
    expressible=frozenset({"intermediate_size", "head_dim", "rope_parameters"}),
    layout=interleaved_rope(
        WeightRules(
            (
                Rename("transformer.wte", "model.embed_tokens"),
                Rename("transformer.h.{n}.ln_1", f"{LAYER}.input_layernorm"),
                *_separate_qkv("transformer.h.{n}.attn"),
                Rename("transformer.h.{n}.attn.out_proj", f"{ATTN}.o_proj"),
                Rename("transformer.h.{n}.mlp.fc_in", f"{MLP}.up_proj"),
                Rename("transformer.h.{n}.mlp.fc_out", f"{MLP}.down_proj"),
                Rename("transformer.ln_f", "model.norm"),
                Rename("lm_head", "lm_head"),
            ),
            base_prefix="transformer",
            # causal-mask buffers and the sinusoid table in older checkpoints
            ignore=(r"\.attn\.(masked_)?bias$", r"embed_positions$"),
        ).layout()
    ),
)

LAYERNORM_DECODERS = (STABLELM, PHI, OPT, STARCODER2, GPTJ)

__all__ = ["GPTJ", "LAYERNORM_DECODERS", "OPT", "PHI", "STABLELM", "STARCODER2"]
