"""`DecoderConfig`: the configuration of archlab's decoder-only language model.

Field names and meanings follow `LlamaConfig` (and, for the variants, Mistral/Mixtral/Qwen2-MoE/Qwen3/Gemma2
configs); new concepts get new, self-explaining fields. The default architecture is the LLaMA recipe
(seed 000, section 5.x): pre-RMSNorm, RoPE, grouped-query attention, SwiGLU feed-forward, no biases.

Every impossible value fails here, at construction, with a `ValueError` that names the field and what is
allowed -- never later as a shape error inside `forward`.

This file is part of the flat `modeling/` folder that Hugging Face's remote-code export copies next to a saved
model: it may import only torch, transformers and sibling modules (`from .x import y`).
"""

from __future__ import annotations

import math
from typing import Any

from huggingface_hub.dataclasses import strict
from transformers.configuration_utils import PreTrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from .catalogue import (
    ATTENTION_OUTPUT_GATES,
    DECODER_NORM_POSITIONS,
    LAYER_NORM_TYPES,
    LAYER_TYPES,
    MLP_LAYER_TYPES,
    MLP_TYPES,
    MLP_WIDTH_RULES,
    NORM_TYPES,
    POSITION_SCHEMES,
    QK_NORM_SCOPES,
    ROUTER_GROUP_SCORES,
    ROUTER_SCORE_FUNCTIONS,
    intermediate_size_from_rule,
)
from .import_hooks import after_import
from .serving import SERVE_MODEL_MANAGER_MODULE, expose_decoder_to_serve
from .validation import (
    ACTIVATIONS,
    check_attention_backend,
    check_choice,
    check_field_types,
    check_non_negative,
    check_positive,
    check_probability,
    check_relative_buckets,
    requested_attention,
)

# `rope_parameters["rope_type"]` values: transformers' registry of inverse-frequency functions, which rotary.py uses.
ROPE_TYPES = ("default", *ROPE_INIT_FUNCTIONS)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# Numeric `rope_parameters` entries of the scaled rope types (transformers only warns about a bad one, or reads it
# unchecked): a scaling `factor` or pre-training length of 0 gives NaN frequencies that train silently, and a string
# (a hand-written config.json) a TypeError in the first forward.
# The token classifier's dropout fields, read as Llama's token classifier reads them (the first given, else 0.1), and
# every field `DecoderForTokenClassification` reads where given: DecoderConfig declares none of them.
TOKEN_CLASSIFIER_DROPOUT_FIELDS = ("classifier_dropout", "hidden_dropout")
UNDECLARED_HEAD_FIELDS = (*TOKEN_CLASSIFIER_DROPOUT_FIELDS, "token_classification_bias")
ROPE_POSITIVE_KEYS = ("factor", "original_max_position_embeddings")
ROPE_NUMBER_KEYS = ("attention_factor", "beta_fast", "beta_slow", "low_freq_factor", "high_freq_factor", "mscale")


def rope_type_of(parameters: dict) -> str:
    """A RoPE parameter set's type (`rope_type`, the legacy `type`, else "default")."""
    return parameters.get("rope_type", parameters.get("type", "default"))


def rope_parameter_sets(rope_parameters: Any) -> list[dict]:
    """The parameter sets of `rope_parameters`: the dict itself, or its one dict per layer type."""
    if not isinstance(rope_parameters, dict):
        return []
    return [v for v in rope_parameters.values() if isinstance(v, dict)] or [rope_parameters]


def check_rope_parameters(rope_parameters: Any) -> None:
    """Each `rope_type` of `rope_parameters` (flat, or one dict per layer type) is one that RoPE can be built with,
    its `rope_theta` a positive number, its `partial_rotary_factor` in (0, 1] and its scaling `factor` a positive
    number (transformers checks none of these: a theta or factor of 0 or below gives NaN or infinite frequencies that
    train silently, a partial factor above 1 a shape error in the first forward)."""
    for parameters in rope_parameter_sets(rope_parameters):
        rope_type = rope_type_of(parameters)
        if rope_type not in ROPE_TYPES:
            raise ValueError(
                f"`rope_parameters['rope_type']`={rope_type!r} is not supported; allowed values: "
                f"{', '.join(map(repr, ROPE_TYPES))}."
            )
        theta = parameters.get("rope_theta")
        if "rope_theta" in parameters and not (_is_number(theta) and theta > 0):  # None: a TypeError in forward
            raise ValueError(
                f"`rope_theta` (`rope_parameters['rope_theta']`) must be a positive number (the RoPE base, "
                f"10000.0 by default), got {theta!r}."
            )
        factor = parameters.get("partial_rotary_factor")
        if factor is not None and not (_is_number(factor) and 0 < factor <= 1):
            raise ValueError(
                "`partial_rotary_factor` (`rope_parameters['partial_rotary_factor']`, the share of each head's "
                f"channels that RoPE rotates) must be in (0, 1], got {factor!r}."
            )
        for key in ROPE_POSITIVE_KEYS + ROPE_NUMBER_KEYS:
            value = parameters.get(key)
            if value is None or (_is_number(value) and (value > 0 or key not in ROPE_POSITIVE_KEYS)):
                continue
            kind = "a positive number" if key in ROPE_POSITIVE_KEYS else "a number"
            raise ValueError(f"`rope_parameters['{key}']` (rope_type {rope_type!r}) must be {kind}, got {value!r}.")


# The legacy keyword arguments transformers still reads for RoPE. Beside an explicit `rope_parameters`, transformers
# drops the scalar ones (`rope_theta`, `partial_rotary_factor`: the dict's entry wins) and lets `rope_scaling` replace
# the whole dict, its `rope_theta` included, without a word.
LEGACY_ROPE_SCALARS = ("rope_theta", "partial_rotary_factor")
LEGACY_ROPE_FIELDS = ("rope_scaling", *LEGACY_ROPE_SCALARS)


def _rope_disagreements(legacy: dict, given: dict, where: str = "") -> list[str]:
    """The entries of a legacy `rope_scaling` dict that `rope_parameters` (`given`) lacks or holds otherwise."""
    wrong = []
    for key, value in legacy.items():
        name = f"{where}[{key!r}]"
        if isinstance(value, dict):
            other = given.get(key)
            if isinstance(other, dict):
                wrong += _rope_disagreements(value, other, name)
            else:
                wrong.append(f"`rope_scaling{name}`={value!r} beside `rope_parameters{name}`={other!r}")
        elif key in ("type", "rope_type"):
            held = rope_type_of(given)
            if rope_type_of(legacy) != held:
                wrong.append(f"`rope_scaling{name}`={value!r} beside `rope_parameters{where}['rope_type']`={held!r}")
        elif key not in given or given[key] != value:
            held = f"={given[key]!r}" if key in given else " unset"
            wrong.append(f"`rope_scaling{name}`={value!r} beside `rope_parameters{name}`{held}")
    return wrong


def check_legacy_rope_fields(rope_parameters: Any, legacy: dict[str, Any]) -> dict[str, Any]:
    """The legacy RoPE keyword arguments given beside an explicit `rope_parameters` must agree with it: a
    `rope_theta` (`partial_rotary_factor`) with every set that holds one, a `rope_scaling` entry by entry. They
    disagree: a `ValueError` naming both. They agree: `rope_scaling` is dropped (`rope_parameters` says all it says,
    and transformers would replace the dict by it); the scalars stay, to fill the sets that lack them."""
    if not isinstance(rope_parameters, dict):
        return legacy
    for name in LEGACY_ROPE_SCALARS:
        value = legacy.get(name)
        if value is None:
            continue
        per_type = {k: v for k, v in rope_parameters.items() if isinstance(v, dict)}
        sets = {f"[{k!r}]": v for k, v in per_type.items()} if per_type else {"": rope_parameters}
        for where, parameters in sets.items():
            if name in parameters and parameters[name] != value:
                raise ValueError(
                    f"`{name}`={value!r} and `rope_parameters{where}['{name}']`={parameters[name]!r} disagree: "
                    f"transformers would ignore `{name}`. Give it once, inside `rope_parameters` "
                    f"(`rope_parameters{where}['{name}']`), and drop the legacy `{name}`."
                )
    scaling = legacy.get("rope_scaling")
    if isinstance(scaling, dict):
        wrong = _rope_disagreements(scaling, rope_parameters)
        if wrong:
            raise ValueError(
                f"`rope_scaling` and `rope_parameters` are both given and disagree: {'; '.join(wrong)}. "
                "transformers would replace `rope_parameters` by `rope_scaling` (its `rope_theta` included): give "
                "the RoPE once, as `rope_parameters` with `rope_type`, `rope_theta` and the scaling inside, and drop "
                "`rope_scaling`."
            )
        legacy = {k: v for k, v in legacy.items() if k != "rope_scaling"}
    return legacy


def override_rope(values: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """`values` (a preset's or a config file's fields) with `overrides` applied, RoPE's read as a user means them:
    a legacy `rope_theta` / `partial_rotary_factor` / `rope_scaling` override changes those entries of the preset's
    `rope_parameters` (beside it, the config would refuse it as a disagreement), and a `rope_parameters` override
    without a base keeps the preset's, as `from_pretrained(folder, rope_parameters=...)` keeps the saved one.
    `preset_config("llama-2-7b", rope_theta=1e6)` sets its base to 1e6."""
    merged = {**values, **overrides}
    base = values.get("rope_parameters")
    if not isinstance(base, dict):
        return merged
    if "rope_parameters" in overrides:
        given = overrides["rope_parameters"]
        sets = rope_parameter_sets(given)
        if "rope_theta" not in base or any("rope_theta" in one for one in sets):
            return merged
        if sets == [given]:
            merged["rope_parameters"] = {"rope_theta": base["rope_theta"], **given}
        elif sets:
            merged["rope_parameters"] = {key: {"rope_theta": base["rope_theta"], **one} for key, one in given.items()}
        return merged
    legacy = {name: overrides[name] for name in LEGACY_ROPE_FIELDS if overrides.get(name) is not None}
    if not legacy:
        return merged
    if rope_parameter_sets(base) != [base]:
        raise ValueError(
            f"{', '.join(f'`{name}`' for name in legacy)}: the RoPE here has one parameter set per layer type "
            f"({', '.join(base)}); override `rope_parameters` with a set for each instead."
        )
    scaling = legacy.pop("rope_scaling", None)
    if scaling is not None and not isinstance(scaling, dict):
        raise ValueError(f"`rope_scaling` must be a dict (`{{'rope_type': ..., 'factor': ...}}`), got {scaling!r}.")
    if scaling is not None:
        scaling = {("rope_type" if key == "type" else key): value for key, value in scaling.items()}
        kept = {key: base[key] for key in ("rope_theta", "partial_rotary_factor") if key in base}
        base = {**kept, **scaling}
    merged["rope_parameters"] = {**base, **legacy}
    for name in LEGACY_ROPE_FIELDS:
        merged.pop(name, None)
    return merged


@strict
class DecoderConfig(PreTrainedConfig):
    r"""Configuration of [`DecoderModel`], [`DecoderForCausalLM`], [`DecoderForSequenceClassification`],
    [`DecoderForTokenClassification`] and [`DecoderForQuestionAnswering`].

    The defaults are the LLaMA recipe at LLaMA-7B's shape. docs/catalogue.md shows the variants side by side.

    LlamaConfig fields (same names, meanings and defaults):
        vocab_size (`int`, 32000), hidden_size (`int`, 4096), num_hidden_layers (`int`, 32),
        num_attention_heads (`int`, 32), max_position_embeddings (`int`, 2048), initializer_range (`float`, 0.02),
        use_cache (`bool`, True), pad_token_id / bos_token_id / eos_token_id (None / 1 / 2),
        tie_word_embeddings (`bool`, False), attention_dropout (`float`, 0.0).
        intermediate_size (`int`, *optional*): the MLP width; None derives it from `mlp_width_rule` (11008 at 4096).
        num_key_value_heads (`int`, *optional*): key/value heads, a divisor of `num_attention_heads` (GQA); None is
            `num_attention_heads` (MHA), 1 is MQA.
        head_dim (`int`, *optional*): channels per head; None is `hidden_size // num_attention_heads`.
        hidden_act (`str`, `"silu"`): the MLP activation, any name of transformers' `ACT2FN`.
        rms_norm_eps (`float`, 1e-6): epsilon of every norm (RMSNorm or LayerNorm).
        rope_parameters (`dict`, *optional*): `{"rope_type": ..., "rope_theta": ..., ...}` exactly as transformers
            reads it (default, linear, dynamic, yarn, llama3, ...; `partial_rotary_factor` rotates a fraction of
            each head, as GPT-NeoX). Legacy `rope_theta` / `rope_scaling` / `partial_rotary_factor` are accepted;
            beside `rope_parameters` they must agree with it (a `ValueError` names both). Or one such dict per layer
            type (`{"full_attention": {...}, "sliding_attention": {...}}`, transformers 5's form: Gemma3's global and
            local RoPE bases), a set for every type in `layer_types`.
        attention_bias (`bool`, False): biases on the q/k/v/o projections. mlp_bias (`bool`, False): on the MLP.
        qkv_bias (`bool`, *optional*): biases on the q/k/v projections alone (Qwen2-MoE's name; Qwen2, StableLM-2:
            True with `attention_bias=False`, the output projection without); None follows `attention_bias`.

    Architecture catalogue (seed 000 §5.2, seed 004; Mistral / Gemma2 / Qwen3 / T5 names where they have the concept;
    the allowed values are the registries of `catalogue.py`):
        norm_type (`str`, `"rms_norm"`): `"rms_norm"`, `"offset_rms_norm"` (Gemma's (1 + w) gain), `"layer_norm"` or
            `"offset_layer_norm"` (Nemotron's LayerNorm1P: a (1 + w) gain and a bias).
        norm_position (`str`, `"pre"`): where the norms sit (blocks.py): `"pre"` (Llama), `"post"` (Vaswani et al.),
            `"sandwich"` (Gemma2), `"parallel"` (attention and MLP on the same input: GPT-NeoX, PaLM),
            `"parallel_shared_norm"` (the parallel block with one norm for both: GPT-J, Falcon-7B, Phi),
            `"deepnorm"` (post-norm with DeepNet's α-weighted residual and β-scaled init) or `"output"` (no norm
            before a sub-layer: its output is normed before the residual add, x + N(Attn(x)); OLMo 2's "reordered
            norm", OLMo 2 report 2024, and Swin Transformer V2's res-post-norm; a final norm after the stack).
        norm_bias (`bool`, *optional*): a LayerNorm bias; None is True for the LayerNorms, False for the RMS norms.
        deepnorm_alpha / deepnorm_beta (`float`, *optional*): DeepNet's α and β; None is (2N)^¼ and (8N)^-¼.
        mlp_type (`str`, `"gated"`): `"gated"` = down(act(gate x) ⊙ up x) (SwiGLU with silu, GeGLU with gelu) or
            `"plain"` = down(act(up x)) (the ReLU/GELU FFN of the original Transformer and GPT).
        mlp_width_rule (`str`, `"8/3d"`) and mlp_width_multiple_of (`int`, 256): with `intermediate_size=None`, the
            width is `"4d"` or `"8/3d"` times `hidden_size`, rounded up to the multiple (LLaMA's rule).
        position_embedding_type (`str`, `"rope"`): `"rope"`, `"alibi"` (BLOOM, MPT), `"relative_bias"` (T5's
            bucketed bias), `"learned"` (GPT-2, OPT), `"sinusoidal"` (Vaswani et al.) or `"none"` (NoPE).
        relative_attention_num_buckets (`int`, 32) / relative_attention_max_distance (`int`, 128): T5's bucketing.
        scale_embedding (`bool`, False): multiply the token embeddings by sqrt(hidden_size) (Vaswani et al., Gemma).
        embedding_layernorm (`bool`, False): a norm right after the embeddings (BLOOM's `word_embeddings_layernorm`).
        position_embedding_offset (`int`, 0): a `"learned"` table with this many extra leading rows, looked up at
            position + offset (OPT's and Bart's table has 2).
        position_ids_from_attention_mask (`bool`, False): number positions by counting the attention mask's ones
            (OPT), so a left-padded row starts at 0 as it does alone; False numbers them 0, 1, ... from the first
            column (GPT-2, Llama). Explicit `position_ids` (as `generate` passes them) always win.
        lm_head_bias (`bool`, False): a bias on the LM head (Phi).
        sliding_window (`int`, *optional*): the window of `"sliding_attention"` layers; alone, every layer slides
            (Mistral).
        attention_chunk_size (`int`, *optional*): the blocks of `"chunked_attention"` layers: a query sees the keys
            of its own block of this many positions (from the row's first real token), up to itself (Llama 4's
            chunked local attention, 8192 there); alone, every layer is chunked. Their dynamic cache keeps the last
            block's keys (transformers' sliding-window cache layers, as Llama 4's); generate's static cache keeps
            every key up to 4 blocks, and past that the compiled loops decode them as rings of one block
            (`sliding_layers.py`).
        layer_types (`list[str]`, *optional*): per layer `"full_attention"`, `"sliding_attention"` (Gemma2's
            interleaved local/global layers) or `"chunked_attention"` (Llama 4); None follows `sliding_window` or
            `attention_chunk_size`.
        nope_layers (`list[int]`, *optional*): the layers (0-based indices) that get no RoPE: their attention sees no
            positions (NoPE; causal masking alone leaks order), the others rotate as `rope_parameters` says — RoPE
            interleaved with NoPE layers, as SmolLM3 (every fourth layer) and Llama 4 ("iRoPE") do. Only with
            `position_embedding_type="rope"`; None: every layer rotates.
        attn_temperature_tuning (`bool`, False): the queries of the NoPE layers (`nope_layers`) times
            1 + attn_scale · log(1 + floor((p + 1) / floor_scale)) at token index p (counted from the cache's
            start, as Llama 4), sharpening attention over long contexts (Llama 4's temperature tuning; Nakanishi
            2025, "Scalable-Softmax"). floor_scale (`float`, 8192) / attn_scale (`float`, 0.1): its two constants.
        query_scaling_beta (`float`, 0.0): the queries of every layer with RoPE times
            1 + query_scaling_beta · log(1 + floor(p / query_scaling_length)) at the row's position p (its position
            id), after RoPE: attention sharpened past the length the model was trained at (Mistral 3's
            `llama_4_scaling_beta`, Ministral 3). 0: off. query_scaling_length (`int`, *optional*): the length of
            each step (Ministral 3: its YaRN's `original_max_position_embeddings`); required with a beta.
        prefix_lm (`bool`, False): bidirectional attention over a per-row prefix given as `prefix_lengths` to
            `forward` / `generate`, causal after it (seed 003).
        use_qk_norm (`bool`, False): a `norm_type` norm of the queries and keys before RoPE (Qwen3, OLMo 2).
        qk_norm_scope (`str`, `"head"`): what QK-norm normalises: `"head"` = each head's queries and keys, one gain of
            `head_dim` shared by the heads (Qwen3); `"projection"` = the whole q and k projections before they are
            split into heads, gains of `num_attention_heads * head_dim` and `num_key_value_heads * head_dim` (OLMo 2);
            `"per_head"` = each head's queries and keys with a gain of its own, (heads, head_dim) (Command R+,
            StableLM 2 12B). Only with `use_qk_norm=True`.
        qk_norm_after_rope (`bool`, False): apply a per-head QK-norm (`"head"`, `"per_head"`) to the rotated queries
            and keys instead of before RoPE (Hunyuan); the cache holds the normed keys either way.
        qk_norm_weight (`bool`, True): False: the QK-norm has no gain, x / sqrt(mean(x²) + eps) (Llama 4's
            `L2Norm`). Only with `use_qk_norm=True`, `norm_type="rms_norm"` and `qk_norm_scope` "head" or
            "projection".
        qk_norm_nope_layers (`bool`, True): False: the NoPE layers (`nope_layers`) have no QK-norm, the rotating
            ones do (Llama 4). Only with `use_qk_norm=True` and `nope_layers`.
        query_pre_attn_scalar (`float`, *optional*): scores scaled by its -½ power instead of head_dim's (Gemma2).
        attention_multiplier (`float`, *optional*): the scores' scale itself, in place of head_dim^-½ (Granite's
            field; μP's 1/head_dim, Tensor Programs V, Yang et al. 2022). At most one of it and
            `query_pre_attn_scalar`.
        kv_lora_rank (`int`, *optional*): multi-head latent attention (MLA; DeepSeek-V2/V3, Kimi K2;
            latent_attention.py): keys and values expanded per head (`kv_b_proj`) from a cached latent of this many
            channels and one rotary key every head shares (`kv_a_proj_with_mqa`). None: the attention of
            `num_key_value_heads`. With it, `head_dim` is the rotary size `qk_rope_head_dim` (derived when unset) and
            `num_key_value_heads` equals `num_attention_heads`.
        q_lora_rank (`int`, *optional*): MLA's queries through a low-rank latent of this many channels (`q_a_proj`,
            `q_a_layernorm`, `q_b_proj`); None: one `q_proj`. Only with `kv_lora_rank`.
        qk_nope_head_dim / qk_rope_head_dim / v_head_dim (`int`, 128 / 64 / 128): MLA's channels of a head's query
            and key without positions, with RoPE, and of its value (DeepSeek-V3's sizes). Only read with
            `kv_lora_rank`.
        attention_output_gate (`str`, *optional*): a sigmoid gate on the attention's output before the output
            projection, computed from the layer's input by `self_attn.gate_proj` (Qiu et al. 2025, "Gated Attention
            for Large Language Models"; AFMoE, Qwen3-Next): `"elementwise"` (one gate per channel of each head) or
            `"headwise"` (one per head). None: no gate.
        sub_layer_norm (`bool`, False): Sub-LN (Wang et al. 2022, "Foundation Transformers"; BitNet b1.58): a norm of
            the config's `norm_type` inside each sub-layer, before its output projection: over the heads' output
            before `o_proj` (`self_attn.attn_sub_norm`) and over the MLP's hidden activation before `down_proj`
            (`mlp.ffn_sub_norm`). Dense MLPs only (not with `num_local_experts`) and not with `kv_lora_rank`; such a
            layer's decoding step runs its own forward (no fused GEMV kernels).
        bitlinear (`bool`, False): BitNet b1.58's BitLinear (`bitlinear.py`): every projection of the layers (q/k/v/o
            and the dense MLP's; not the embeddings or the LM head) computes with ternary weights (rounded to
            {-1, 0, 1} times their mean absolute value, per tensor) and 8-bit activations (per token), quantized in
            each forward from the full-precision weights, the gradient passed straight through in training. Dense
            MLPs only and not with `kv_lora_rank`; no tensor-parallel plan (a weight's scale is over the whole
            tensor); decoding steps run the layers' own forward.
        swiglu_limit (`float`, *optional*): a gated MLP (every one: dense, shared and routed experts) clamps its gate
            to at most this and its up to [-limit, limit] before act(gate) ⊙ up (GPT-OSS: 7.0). Only with
            `mlp_type="gated"`.
        swiglu_up_offset (`float`, 0.0): added to a gated MLP's up before the product, act(gate) ⊙ (up + offset)
            (GPT-OSS: 1.0, with `hidden_act="quick_gelu"`, x · σ(1.702 x)). Only with `mlp_type="gated"`.
        attention_sinks (`bool`, False): a learned logit per head (`self_attn.sinks`, (heads,)) that joins each
            softmax's denominator with a value of zero, so a head can attend to next to nothing (GPT-OSS; StreamingLLM's
            sinks, Xiao et al. 2024, learned). Runs under `"eager"`, `"sdpa"` (as one more key), `"flex_attention"` on a
            GPU, and the flash kernels that take transformers' `s_aux` (not `"flash_attention_2"`).
        embedding_multiplier (`float`, 1.0): the token embeddings times this constant (Granite; MiniCPM's `scale_emb`;
            μP's input multiplier), inside `embed_tokens` as `scale_embedding`'s √d (both given: their product).
        residual_multiplier (`float`, 1.0): each sub-layer's output times this constant before it joins the residual
            stream, x + m·Attn(N(x)) (Granite; MiniCPM's scale_depth / √N), in every `norm_position`.
        logit_scale (`float`, 1.0): the output logits times this constant, before `final_logit_softcapping` (Cohere's
            `logit_scale`; Granite's 1 / `logits_scaling`; μP's output multiplier); the chunked and fused losses
            apply it too.
        attn_logit_softcapping / final_logit_softcapping (`float`, *optional*): c · tanh(x / c) on the attention
            scores / the output logits (Gemma2). SDPA cannot cap scores: the default backend then falls back to
            eager and an explicit `attn_implementation="sdpa"` fails.
        lm_z_loss_coef (`float`, 0.0): PaLM's z-loss, + z · log²Z per token in the LM loss.

    Mixture of experts (Mixtral / Qwen2-MoE names and meanings; moe.py):
        num_local_experts (`int`, 0): routed experts K per sparse layer; 0 is a dense model.
        num_experts_per_tok (`int`, 2): experts k each token is sent to.
        moe_intermediate_size (`int`, *optional*): width of each routed expert; None is `intermediate_size`.
        shared_expert_intermediate_size (`int`, 0): width of the shared expert every token passes through
            (Qwen2-MoE); 0 is none.
        shared_expert_gate (`bool`, True): scale the shared expert by a per-token sigmoid gate (Qwen2-MoE); False
            adds it ungated (DeepSeekMoE).
        norm_topk_prob (`bool`, True): renormalise the k chosen probabilities to sum to 1 (Mixtral always does).
        mlp_layer_types (`list[str]`, *optional*): `"dense"` or `"sparse"` per layer; None is all sparse when
            `num_local_experts` > 0, else all dense.
        output_router_logits (`bool`, False): return the router logits and the load-balancing loss, and add
            `router_aux_loss_coef` times it to the LM loss (as Mixtral); the task heads add it to their loss too
            (Mixtral's add none, so by default they match them).
        router_aux_loss_coef (`float`, *optional*): weight of the load-balancing loss; None is Mixtral's 0.001 with
            sparse layers. A dense model has no router, so it is 0 there whatever is given.
        router_z_loss_coef (`float`, 0.0): weight of the ST-MoE router z-loss added to the loss (every head's).
        router_jitter_noise (`float`, 0.0): Mixtral's multiplicative input noise in training.
        router_score_function (`str`, `"softmax"`): how the router scores the experts: `"softmax"` over them
            (Mixtral) or `"sigmoid"` of each (DeepSeek-V3, GLM-4.5, dots.llm1); the load-balancing loss then reads
            each token's scores normalised to sum to 1.
        router_correction_bias (`bool`, False): a per-expert bias (`mlp.gate.e_score_correction_bias`, fp32) added
            to the scores to choose the top k, not to weigh them (DeepSeek-V3's auxiliary-loss-free balancing bias).
            Kept as loaded (as in transformers) unless `router_bias_update_rate` > 0.
        router_bias_update_rate (`float`, 0.0): DeepSeek-V3's auxiliary-loss-free balancing speed γ (0.001 there):
            after each optimizer step every expert's correction bias moves by γ towards the mean load of the steps'
            training forwards (b_e += γ · sign(mean − load_e), summed over data-parallel processes), through
            `modeling.moe.update_router_biases`, which archlab's Trainer (the scripts') calls; with another Trainer add
            `archlab.training.callbacks.RouterBiasCallback`. Needs `router_correction_bias=True`.
        routed_scaling_factor (`float`, 1.0): the routed experts' top-k weights times this (DeepSeek-V3), after
            `norm_topk_prob`'s renormalisation.
        router_groups (`int`, 1): DeepSeek-V3's group-limited routing (`n_group`): the experts in this many equal
            groups, each scored by the sum of its two best choice scores (scores plus the correction bias); a
            token's top k is chosen among the experts of its `router_top_groups` best groups only.
        router_top_groups (`int`, *optional*): how many groups a token's experts come from (`topk_group`); None is
            every group (no limit).
        router_group_score (`str`, `"top2_sum"`): how a group is scored to choose the best ones: `"top2_sum"`, the
            sum of its two best choice scores (DeepSeek-V3, GLM-4.5), or `"max"`, its best score (DeepSeek-V2's
            `topk_method="group_limited_greedy"`). Only with `router_top_groups` below `router_groups`.
        router_bias (`bool`, False): the router's logits get a learned bias per expert (`mlp.gate.bias`; GPT-OSS),
            which, unlike `router_correction_bias`, weighs the experts as well as choosing them.
        expert_bias (`bool`, False): the routed experts' two products get a bias each (`mlp.experts.gate_up_proj_bias`
            (K, 2f), `mlp.experts.down_proj_bias` (K, d); GPT-OSS).
        routing_weights_on_input (`bool`, False): each chosen expert reads the token times its routing weight and
            the experts' outputs are summed unweighted, Σ expert(w · x), instead of Σ w · expert(x) (Llama 4, whose
            weight is the sigmoid of the expert's logit: `router_score_function="sigmoid"`, `norm_topk_prob=False`).

    Training:
        classifier_lm_loss_weight (`float`, 0.0): λ in L = L_FT + λ·L_PT for [`DecoderForSequenceClassification`]
            (seed 001, GPT fine-tuning): when positive and `labels` are given, the next-token loss over the
            (non-pad) input is added.
        classifier_dropout (`float`, *optional*): not a declared field; given, the dropout before
            [`DecoderForTokenClassification`]'s `score` (else `hidden_dropout`, else 0.1, as Llama's token classifier);
            either, given, must be a probability in [0, 1).
        lm_loss_chunk_size (`int`, 1024): in training, the LM head and cross-entropy run over chunks of this many
            tokens so the full `(tokens, vocab)` logits never exist at once; 0 turns chunking off. The chunked loss
            computes its gradients in the forward pass: one backward through it (not two with `retain_graph=True`,
            which then needs 0).

    Example:
    ```python
    >>> from archlab import DecoderConfig, DecoderForCausalLM
    >>> config = DecoderConfig(vocab_size=1000, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
    ...                        num_attention_heads=4, num_key_value_heads=2)
    >>> model = DecoderForCausalLM(config)
    ```
    """

    model_type = "archlab_decoder"
    keys_to_ignore_at_inference = ["past_key_values", "cache"]  # the cache under its names before and from 5.24
    # Mixtral's alias: code written for transformers 5's MoE configs (TRL's load-balancing loss) reads `num_experts`.
    attribute_map = {"num_experts": "num_local_experts"}

    @property
    def base_model_tp_plan(self) -> dict[str, str]:
        """Tensor parallelism for `from_pretrained(..., tp_plan="auto")`: Llama's plan (q/k/v and gate/up split by
        output columns, o/down by input rows: each rank runs whole heads and a slice of the MLP). A QK-norm over the
        whole projections (`qk_norm_scope="projection"`) needs every head of a token: as OLMo 2's plan, q/k/v are
        gathered after their split product and the output projection splits its input again; so with a gain per head
        (`"per_head"`), whose (heads, head_dim) gains every rank holds whole. Multi-head latent attention splits its
        per-head products (the queries', `kv_b_proj`'s expansion) by heads and keeps the latents whole on every rank.
        Sub-LN (`sub_layer_norm`) norms all heads' output and the MLP's whole hidden activation: q/k/v and gate/up are
        gathered after their split product, o/down split their input again (as OLMo 2's QK-norm). BitLinear layers
        (`bitlinear`) have no plan: a weight's ternary scale is its whole tensor's mean magnitude."""
        if self.bitlinear:
            return {}
        attention = {"q_proj": "colwise", "k_proj": "colwise", "v_proj": "colwise", "o_proj": "rowwise"}
        if self.kv_lora_rank is not None:
            query = "q_b_proj" if self.q_lora_rank is not None else "q_proj"
            attention = {query: "colwise", "kv_b_proj": "colwise", "o_proj": "rowwise"}
        # (Sub-LN norms every head's output of a token together, as such a QK-norm does its queries and keys)
        if self.sub_layer_norm or (self.use_qk_norm and self.qk_norm_scope in ("projection", "per_head")):
            attention = {name: "colwise_gather_output" for name in ("q_proj", "k_proj", "v_proj")}
            attention["o_proj"] = "rowwise_split_input"
        if self.attention_output_gate is not None:  # the gate's rows follow the heads, as q's
            attention["gate_proj"] = attention["q_proj"]
        if self.attention_sinks and attention.get("q_proj") == "colwise":  # each rank's heads' sinks (GPT-OSS's plan)
            attention["sinks"] = "local_rowwise"
        plan = {f"layers.*.self_attn.{name}": style for name, style in attention.items()}
        # (Sub-LN norms the MLP's whole hidden activation of a token: gathered after gate/up, split again before down)
        split = "colwise_gather_output" if self.sub_layer_norm else "colwise"
        plan.update({"layers.*.mlp.gate_proj": split, "layers.*.mlp.up_proj": split})
        plan["layers.*.mlp.down_proj"] = "rowwise_split_input" if self.sub_layer_norm else "rowwise"
        return plan

    base_model_pp_plan = {
        "embed_tokens": (["input_ids"], ["inputs_embeds"]),
        "layers": (["hidden_states", "attention_mask"], ["hidden_states"]),
        "norm": (["hidden_states"], ["hidden_states"]),
    }
    # Expert parallelism (`DistributedConfig(ep_size=N)`), Mixtral's plan: each rank owns num_local_experts / N experts
    # of every sparse layer and tokens are dispatched to them (dense layers and a TP run ignore it).
    base_model_ep_plan = {
        "layers.*.mlp.experts.gate_up_proj": "grouped_gemm",
        "layers.*.mlp.experts.down_proj": "grouped_gemm",
        "layers.*.mlp.experts": "ep_dispatch_experts",
    }

    # --- LlamaConfig fields ---
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int | None = None  # None: from `mlp_width_rule` (LLaMA-7B's 11008 by default)
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    tie_word_embeddings: bool = False
    rope_parameters: dict | None = None
    attention_bias: bool = False
    qkv_bias: bool | None = None  # None: as attention_bias (Qwen2-MoE's name)
    attention_dropout: int | float = 0.0
    mlp_bias: bool = False

    # --- mixture of experts (Mixtral / Qwen2-MoE fields, plus router_z_loss_coef) ---
    num_local_experts: int = 0
    num_experts_per_tok: int = 2
    moe_intermediate_size: int | None = None
    shared_expert_intermediate_size: int = 0
    shared_expert_gate: bool = True
    norm_topk_prob: bool = True
    mlp_layer_types: list[str] | None = None
    output_router_logits: bool = False
    router_aux_loss_coef: int | float | None = None  # None: 0.001 with sparse layers, else 0.0
    router_z_loss_coef: int | float = 0.0
    router_jitter_noise: int | float = 0.0
    router_score_function: str = "softmax"
    router_correction_bias: bool = False
    routed_scaling_factor: int | float = 1.0
    router_bias_update_rate: int | float = 0.0
    router_groups: int = 1
    router_top_groups: int | None = None
    router_group_score: str = "top2_sum"
    router_bias: bool = False
    expert_bias: bool = False
    routing_weights_on_input: bool = False

    # --- archlab fields ---
    classifier_lm_loss_weight: int | float = 0.0
    lm_loss_chunk_size: int = 1024

    # --- the architecture catalogue; Mistral/Gemma2 names where they have the concept ---
    norm_type: str = "rms_norm"
    norm_position: str = "pre"
    norm_bias: bool | None = None
    deepnorm_alpha: int | float | None = None
    deepnorm_beta: int | float | None = None
    mlp_type: str = "gated"
    mlp_width_rule: str = "8/3d"
    mlp_width_multiple_of: int = 256
    swiglu_limit: int | float | None = None
    swiglu_up_offset: int | float = 0.0
    position_embedding_type: str = "rope"
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    scale_embedding: bool = False
    embedding_layernorm: bool = False
    position_embedding_offset: int = 0
    position_ids_from_attention_mask: bool = False
    lm_head_bias: bool = False
    sliding_window: int | None = None
    attention_chunk_size: int | None = None
    layer_types: list[str] | None = None
    nope_layers: list[int] | None = None
    attn_temperature_tuning: bool = False
    floor_scale: int | float = 8192
    attn_scale: int | float = 0.1
    query_scaling_beta: int | float = 0.0
    query_scaling_length: int | None = None
    prefix_lm: bool = False
    use_qk_norm: bool = False
    qk_norm_scope: str = "head"
    qk_norm_after_rope: bool = False
    qk_norm_weight: bool = True
    qk_norm_nope_layers: bool = True
    query_pre_attn_scalar: int | float | None = None
    attention_multiplier: int | float | None = None
    attention_output_gate: str | None = None
    sub_layer_norm: bool = False
    bitlinear: bool = False
    attention_sinks: bool = False
    kv_lora_rank: int | None = None
    q_lora_rank: int | None = None
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    embedding_multiplier: int | float = 1.0
    residual_multiplier: int | float = 1.0
    logit_scale: int | float = 1.0
    attn_logit_softcapping: int | float | None = None
    final_logit_softcapping: int | float | None = None
    lm_z_loss_coef: int | float = 0.0

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs: Any) -> DecoderConfig:
        """`from_pretrained(folder, num_hidden_layers=n)`: transformers sets the field after construction, which
        would leave the saved per-layer lists (`layer_types`, `mlp_layer_types`) at the old length -- a model that
        cannot be built (more layers) or saved (fewer). They follow here, as with Llama, whose config has none: the
        first n layers keep their types (they are the layers loaded from the checkpoint), and a list of one type
        grows with it; a mixed list cannot grow without a choice, so pass that list with the new length too."""
        layers = kwargs.get("num_hidden_layers")
        if isinstance(layers, int) and not isinstance(layers, bool) and layers > 0:
            config_dict = dict(config_dict, num_hidden_layers=layers)
            for name in ("layer_types", "mlp_layer_types"):
                types = config_dict.get(name)
                if name in kwargs:  # given with the new length: built with it
                    config_dict[name] = kwargs[name]
                    continue
                if not isinstance(types, list) or not types or len(types) == layers:
                    continue
                if layers < len(types):
                    config_dict[name] = types[:layers]
                elif len(set(types)) == 1:
                    config_dict[name] = types[:1] * layers
                else:
                    raise ValueError(
                        f"`num_hidden_layers={layers}` adds layers to a model whose `{name}` mixes types ({types}): "
                        f"pass `{name}` with {layers} entries too."
                    )
            nope = config_dict.get("nope_layers")
            if isinstance(nope, list) and "nope_layers" not in kwargs:  # the layers kept keep theirs; new ones rotate
                config_dict["nope_layers"] = [index for index in nope if isinstance(index, int) and index < layers]
        config_dict = _derive_per_layer_types_again(config_dict, kwargs)
        # RoPE overrides are construction arguments: transformers would drop a `rope_theta`, and set a `rope_scaling`
        # or `rope_parameters` on the built config unstandardised (no `rope_theta`: a model that cannot be built).
        # They change the saved `rope_parameters` as a preset's (`override_rope`): a legacy `rope_theta` sets the
        # base, a `rope_parameters` without a base keeps the saved one.
        rope = {name: kwargs.pop(name) for name in ("rope_parameters", *LEGACY_ROPE_FIELDS) if name in kwargs}
        config_dict = override_rope(config_dict, rope)
        loaded = super().from_dict(config_dict, **kwargs)
        # transformers sets the other overrides (`from_pretrained(folder, num_key_value_heads=3)`) on the built
        # config, past `__post_init__`'s checks: without these, an impossible value failed late, in the model
        _check_resolved(loaded[0] if isinstance(loaded, tuple) else loaded)
        return loaded

    def __post_init__(self, **kwargs: Any) -> None:
        check_field_types(self)
        _resolve_catalogue_defaults(self)
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.kv_lora_rank is not None and self.head_dim is None:  # MLA: the rotary size (latent_attention.py)
            self.head_dim = self.qk_rope_head_dim
        heads, hidden = self.num_attention_heads, self.hidden_size
        if self.head_dim is None and isinstance(heads, int) and heads > 0 and isinstance(hidden, int) and hidden > 0:
            if self.hidden_size % self.num_attention_heads != 0:
                raise ValueError(
                    f"`hidden_size` ({self.hidden_size}) must be divisible by `num_attention_heads` "
                    f"({self.num_attention_heads}): allowed values are "
                    f"{[h for h in range(1, self.hidden_size + 1) if self.hidden_size % h == 0]}, or set "
                    "`head_dim` (the head size)."
                )
            self.head_dim = self.hidden_size // self.num_attention_heads
        # (a hidden size <= 0 leaves head_dim unset: validate_architecture names the field)
        _resolve_moe_defaults(self)
        for name, value in (("rope_parameters", self.rope_parameters), ("rope_scaling", kwargs.get("rope_scaling"))):
            _check_rope_dict(name, value)  # transformers' standardising would fail on it
        kwargs = check_legacy_rope_fields(self.rope_parameters, kwargs)
        super().__post_init__(**kwargs)  # standardises `rope_parameters` (legacy `rope_theta` / `rope_scaling`)
        _check_resolved(self)

    def validate_rope(self) -> None:
        """transformers' checks of `rope_parameters` (an even `head_dim` among them) where the model builds RoPE: with
        other positions the parameters are unused, and an odd `head_dim` is fine (`_validate_unused_rope` refuses
        parameters that ask for a RoPE variant there)."""
        if self.position_embedding_type == "rope":
            super().validate_rope()

    def validate_architecture(self) -> None:
        """Every cross-field check; run at construction and again by `@strict` at save time."""
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            check_positive(self, name)
        check_positive(self, "rms_norm_eps", integer=False)
        check_non_negative(self, "initializer_range")
        check_probability(self, "attention_dropout")
        for name in TOKEN_CLASSIFIER_DROPOUT_FIELDS:
            value = getattr(self, name, None)
            if value is not None:
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    raise ValueError(f"`{name}` must be a probability in [0, 1) or None, got {value!r}.")
                check_probability(self, name)
        check_non_negative(self, "classifier_lm_loss_weight")
        check_non_negative(self, "lm_loss_chunk_size")
        check_choice(self, "hidden_act", ACTIVATIONS)
        _validate_moe(self)
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"`num_key_value_heads` ({self.num_key_value_heads}) must divide `num_attention_heads` "
                f"({self.num_attention_heads}): allowed values are "
                f"{[d for d in range(1, self.num_attention_heads + 1) if self.num_attention_heads % d == 0]}."
            )
        if self.position_embedding_type == "rope":
            _validate_rotary_dimension(self)
        else:
            _validate_unused_rope(self)
        _validate_nope_layers(self)
        _validate_latent_attention(self)
        for name in ("pad_token_id", "bos_token_id"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < self.vocab_size:
                raise ValueError(f"`{name}` ({value}) must be None or in [0, vocab_size={self.vocab_size}).")
        _validate_catalogue(self)


# Attention variants that multi-head latent attention does not compute (latent_attention.py): refused beside it
NOT_WITH_LATENT_ATTENTION = (
    "attention_sinks",
    "attention_output_gate",
    "sub_layer_norm",
    "bitlinear",
    "use_qk_norm",
    "qkv_bias",
    "query_pre_attn_scalar",
    "attention_multiplier",
    "attn_temperature_tuning",
    "query_scaling_beta",
)


def _validate_latent_attention(config: Any) -> None:
    """MLA's sizes positive, `head_dim` its rotary size, a key and value per query head, and none of the attention
    variants it does not compute; `q_lora_rank` only with it."""
    if config.kv_lora_rank is None:
        if config.q_lora_rank is not None:
            raise ValueError(
                f"`q_lora_rank` ({config.q_lora_rank}) is multi-head latent attention's query rank, but `kv_lora_rank` "
                "is None (no latent attention): set `kv_lora_rank`, or leave `q_lora_rank` unset."
            )
        return
    for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        check_positive(config, name)
    if config.q_lora_rank is not None:
        check_positive(config, "q_lora_rank")
    if config.head_dim != config.qk_rope_head_dim:
        raise ValueError(
            f"With multi-head latent attention (`kv_lora_rank`) `head_dim` is the rotary size `qk_rope_head_dim` "
            f"({config.qk_rope_head_dim}), got {config.head_dim}: leave `head_dim` unset."
        )
    if config.num_key_value_heads != config.num_attention_heads:
        raise ValueError(
            f"Multi-head latent attention (`kv_lora_rank`) expands a key and value for every query head: "
            f"`num_key_value_heads` must equal `num_attention_heads` ({config.num_attention_heads}), got "
            f"{config.num_key_value_heads}."
        )
    defaults = {
        "qkv_bias": None,
        "use_qk_norm": False,
        "attention_sinks": False,
        "attn_temperature_tuning": False,
        "query_scaling_beta": 0.0,
        "sub_layer_norm": False,
        "bitlinear": False,
    }
    given = [name for name in NOT_WITH_LATENT_ATTENTION if getattr(config, name) != defaults.get(name)]
    if given:
        raise ValueError(
            f"`{given[0]}` ({getattr(config, given[0])!r}) changes an attention that multi-head latent attention "
            f"(`kv_lora_rank`) replaces: leave it unset with `kv_lora_rank`."
        )


def _derive_per_layer_types_again(config_dict: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """`from_pretrained(folder, sliding_window=w)` (or `num_local_experts=K`) on a folder saved without a window
    (without experts): its saved `layer_types` (`mlp_layer_types`) are the ones construction derived, every layer
    full (dense), and kept as saved they left the window (the experts) silently unused. They are derived again here,
    as `DecoderConfig(sliding_window=w)` makes every layer slide (Mistral) and `num_local_experts=K` every layer
    sparse (Mixtral), with Mixtral's router loss weight; a list given with the override wins."""
    experts = overrides.get("num_local_experts", overrides.get("num_experts"))
    for field, value, name, plain, dropped in (
        ("sliding_window", overrides.get("sliding_window"), "layer_types", "full_attention", ()),
        ("num_local_experts", experts, "mlp_layer_types", "dense", ("router_aux_loss_coef",)),
    ):
        if value is None or value == 0 or name in overrides or config_dict.get(field):
            continue
        types = config_dict.get(name)
        if isinstance(types, list) and set(types) <= {plain}:
            unset = {name, *(key for key in dropped if key not in overrides)}
            config_dict = {key: v for key, v in config_dict.items() if key not in unset}
            config_dict[field] = value
    return config_dict


def _check_rope_dict(name: str, value: Any) -> None:
    if value is not None and not isinstance(value, dict):
        raise ValueError(
            f"`{name}` must be a dict (`{{'rope_type': ..., 'rope_theta': ..., ...}}`) or None, got {value!r}."
        )


def _check_resolved(config: DecoderConfig) -> None:
    """Every check of a config whose derived fields are resolved: at construction, and again on the overrides that
    `from_pretrained(folder, field=value)` sets after it."""
    check_field_types(config)
    _check_rope_dict("rope_parameters", config.rope_parameters)
    check_rope_parameters(config.rope_parameters)  # transformers only warns about an unknown type; the build fails
    try:  # run again by `@strict` after `__post_init__`, where a key missing from `rope_parameters` is a KeyError
        config.validate_rope()
    except KeyError as error:
        raise ValueError(error.args[0] if error.args else str(error)) from None
    config.validate_architecture()  # raise a plain ValueError now; `@strict` would wrap it in its own error type


def _validate_unused_rope(config: Any) -> None:
    """Without RoPE (`position_embedding_type` other than 'rope') `rope_parameters` are unused: transformers fills in
    the default ones for every config, but a scaled rope type or a partial rotary factor asks for a RoPE variant that
    the model would silently not compute."""
    for parameters in rope_parameter_sets(config.rope_parameters):
        rope_type = rope_type_of(parameters)
        asked = [f"rope_type={rope_type!r}"] if rope_type != "default" else []
        if parameters.get("partial_rotary_factor", 1.0) != 1.0:
            asked.append(f"partial_rotary_factor={parameters['partial_rotary_factor']!r}")
        if asked:
            raise ValueError(
                f"`rope_parameters` asks for a RoPE variant ({', '.join(asked)}) but `position_embedding_type` is "
                f"{config.position_embedding_type!r}, which builds no RoPE: set `position_embedding_type='rope'`, or "
                "leave `rope_parameters` unset."
            )


def _validate_nope_layers(config: Any) -> None:
    """`nope_layers`: distinct layer indices, and only where the model builds RoPE to leave out."""
    layers = config.nope_layers
    if layers is None:
        return
    if config.position_embedding_type != "rope":
        raise ValueError(
            f"`nope_layers` ({layers}) leaves RoPE out of those layers, but `position_embedding_type` is "
            f"{config.position_embedding_type!r}: allowed values are None, or layer indices with 'rope'."
        )
    wrong = [index for index in layers if not 0 <= index < config.num_hidden_layers]
    if wrong or len(set(layers)) < len(layers):
        raise ValueError(
            f"`nope_layers` must hold distinct layer indices in [0, num_hidden_layers={config.num_hidden_layers}), "
            f"got {layers}."
        )


def _validate_rotary_dimension(config: Any) -> None:
    """One flat RoPE parameter set, or one per layer type (`{"full_attention": {...}, "sliding_attention": {...}}`,
    transformers 5's form: Gemma3's local and global bases) with a set for every layer type present, each with a
    rotary dimension that is a positive even number and longrope's factors one per rotary frequency (transformers only
    warns about their length; the first forward would fail on it)."""
    per_layer_type = {name: value for name, value in config.rope_parameters.items() if isinstance(value, dict)}
    if not per_layer_type:
        _validate_rotary_set(config, config.rope_parameters)
        return
    others = sorted(name for name in config.rope_parameters if name not in per_layer_type or name not in LAYER_TYPES)
    missing = sorted(set(config.layer_types or ()) - set(per_layer_type))
    if others or missing:
        wrong = [f"got {', '.join(map(repr, others))}"] if others else []
        wrong += [f"no set for {', '.join(map(repr, missing))}"] if missing else []
        raise ValueError(
            f"`rope_parameters` holds parameter sets per layer type ({', '.join(map(repr, per_layer_type))}): its "
            f"keys must be layer types ({', '.join(map(repr, LAYER_TYPES))}) holding a dict each, one for every type "
            f"in `layer_types`; {' and '.join(wrong)}."
        )
    for parameters in per_layer_type.values():
        _validate_rotary_set(config, parameters)


def _validate_rotary_set(config: Any, parameters: dict) -> None:
    """One RoPE parameter set of `config`: its rotary dimension, and the rope types that need more of it."""
    partial = parameters.get("partial_rotary_factor", 1.0)
    rotary_dim = int(config.head_dim * partial)
    if rotary_dim % 2 != 0 or rotary_dim == 0:
        raise ValueError(
            f"The rotary dimension (`head_dim` {config.head_dim} x `rope_parameters['partial_rotary_factor']` "
            f"{partial} = {rotary_dim}) must be a positive even number: RoPE rotates pairs of channels."
        )
    rope_type = rope_type_of(parameters)
    if rope_type == "dynamic" and rotary_dim < 4:
        # dynamic NTK rescales the base by a power d / (d - 2): transformers divides by zero building the model
        raise ValueError(
            f"`rope_parameters['rope_type']`='dynamic' needs a rotary dimension of at least 4, got {rotary_dim} "
            f"(`head_dim` {config.head_dim} x `partial_rotary_factor` {partial}): raise either, or use another rope "
            "type."
        )
    if rope_type == "longrope":
        for name in ("short_factor", "long_factor"):
            factors = parameters.get(name)
            if isinstance(factors, (list, tuple)) and len(factors) != rotary_dim // 2:
                raise ValueError(
                    f"`rope_parameters['{name}']` has {len(factors)} entries; longrope needs one per rotary "
                    f"frequency: {rotary_dim // 2} (the rotary dimension {rotary_dim} = `head_dim` {config.head_dim} "
                    f"x `partial_rotary_factor` {partial}, halved)."
                )


# --- defaults that depend on other fields, and the catalogue's and the experts' cross-field checks ---


def _resolve_catalogue_defaults(config: Any) -> None:
    """Fill the fields whose default depends on others (before validation)."""
    if config.intermediate_size is None and isinstance(config.hidden_size, int):
        if not isinstance(config.mlp_width_multiple_of, int) or config.mlp_width_multiple_of <= 0:
            raise ValueError(
                f"`mlp_width_multiple_of` must be a positive integer, got {config.mlp_width_multiple_of!r}."
            )
        config.intermediate_size = intermediate_size_from_rule(
            config.hidden_size, config.mlp_width_rule, config.mlp_width_multiple_of
        )
    if config.norm_bias is None:
        config.norm_bias = config.norm_type in LAYER_NORM_TYPES
    if config.layer_types is None and isinstance(config.num_hidden_layers, int):
        # Mistral: a window means every layer is local (a chunk size: every layer chunked). Always a list, as
        # transformers' mask/cache helpers expect.
        if config.sliding_window is not None and config.attention_chunk_size is not None:
            raise ValueError(
                f"`sliding_window` ({config.sliding_window}) and `attention_chunk_size` ({config.attention_chunk_size})"
                " each make every layer local without `layer_types`: give `layer_types` to say which layers slide "
                "('sliding_attention') and which are chunked ('chunked_attention'), or set only one of them."
            )
        kind = "full_attention"
        if config.sliding_window is not None:
            kind = "sliding_attention"
        elif config.attention_chunk_size is not None:
            kind = "chunked_attention"
        config.layer_types = [kind] * config.num_hidden_layers


def _validate_swiglu_clamps(config: Any) -> None:
    """GPT-OSS's clamps and up offset: a positive limit, a finite offset, a gated MLP to apply them to."""
    if config.swiglu_limit is not None:
        check_positive(config, "swiglu_limit", integer=False)
    if not math.isfinite(config.swiglu_up_offset):
        raise ValueError(f"`swiglu_up_offset` must be a finite number, got {config.swiglu_up_offset!r}.")
    clamps = [name for name in ("swiglu_limit", "swiglu_up_offset") if getattr(config, name) not in (None, 0, 0.0)]
    if clamps and config.mlp_type != "gated":
        raise ValueError(
            f"`{clamps[0]}` changes a gated MLP's act(gate) ⊙ up, but `mlp_type` is {config.mlp_type!r}: set "
            "`mlp_type='gated'`, or leave it unset."
        )


def _validate_catalogue(config: Any) -> None:
    check_choice(config, "norm_type", NORM_TYPES)
    check_choice(config, "norm_position", DECODER_NORM_POSITIONS)
    check_choice(config, "mlp_type", MLP_TYPES)
    check_choice(config, "mlp_width_rule", MLP_WIDTH_RULES)
    _validate_swiglu_clamps(config)
    check_choice(config, "position_embedding_type", POSITION_SCHEMES)
    check_choice(config, "qk_norm_scope", QK_NORM_SCOPES)
    if config.qk_norm_after_rope and (not config.use_qk_norm or config.qk_norm_scope == "projection"):
        raise ValueError(
            "`qk_norm_after_rope=True` moves a per-head QK-norm after RoPE: it needs `use_qk_norm=True` with "
            f"`qk_norm_scope` 'head' or 'per_head' (got use_qk_norm={config.use_qk_norm}, "
            f"qk_norm_scope={config.qk_norm_scope!r})."
        )
    if config.qk_norm_scope != "head" and not config.use_qk_norm:
        raise ValueError(
            f"`qk_norm_scope`={config.qk_norm_scope!r} says what QK-norm normalises, but `use_qk_norm` is False: set "
            "`use_qk_norm=True`, or leave `qk_norm_scope` at 'head'."
        )
    check_positive(config, "mlp_width_multiple_of")
    check_non_negative(config, "lm_z_loss_coef")
    check_non_negative(config, "position_embedding_offset")
    if config.position_embedding_offset and config.position_embedding_type != "learned":
        raise ValueError(
            f"`position_embedding_offset` ({config.position_embedding_offset}) shifts a learned position table; "
            f"`position_embedding_type` is {config.position_embedding_type!r}: allowed values are 0, or any with "
            "'learned'."
        )
    if config.norm_bias and config.norm_type not in LAYER_NORM_TYPES:
        raise ValueError(
            f"`norm_bias=True` needs `norm_type` 'layer_norm' or 'offset_layer_norm': {config.norm_type!r} has no bias."
        )
    for name in ("deepnorm_alpha", "deepnorm_beta"):
        if getattr(config, name) is not None:
            check_positive(config, name, integer=False)
            if config.norm_position != "deepnorm":
                raise ValueError(
                    f"`{name}` is only used with `norm_position='deepnorm'` (got {config.norm_position!r})."
                )
    for name in (
        "query_pre_attn_scalar",
        "attention_multiplier",
        "attn_logit_softcapping",
        "final_logit_softcapping",
        "sliding_window",
    ):
        if getattr(config, name) is not None:
            check_positive(config, name, integer=name == "sliding_window")
    for name in ("embedding_multiplier", "residual_multiplier", "logit_scale"):
        check_positive(config, name, integer=False)
    if config.attention_output_gate is not None:
        check_choice(config, "attention_output_gate", ATTENTION_OUTPUT_GATES)
    if config.sub_layer_norm and "sparse" in (config.mlp_layer_types or ()):
        raise ValueError(
            "`sub_layer_norm=True` norms a dense MLP's hidden activation (`mlp.ffn_sub_norm`); the experts of "
            "`num_local_experts` have none: allowed with `num_local_experts` 0/None, or `mlp_layer_types` all 'dense'."
        )
    if config.bitlinear and "sparse" in (config.mlp_layer_types or ()):
        raise ValueError(
            "`bitlinear=True` makes the dense layers' projections BitLinear; the experts of `num_local_experts` are "
            "not: allowed with `num_local_experts` 0/None, or `mlp_layer_types` all 'dense'."
        )
    if config.attention_multiplier is not None and config.query_pre_attn_scalar is not None:
        raise ValueError(
            f"`attention_multiplier` ({config.attention_multiplier}) and `query_pre_attn_scalar` "
            f"({config.query_pre_attn_scalar}) both set the attention scores' scale: give at most one of them."
        )
    if config.sliding_window == 1 and "sliding_attention" in (config.layer_types or ()):
        # transformers' sliding-window cache layers keep the last `window - 1` keys as `keys[..., -window + 1:, :]`,
        # which keeps every key when the window is 1: decoding would see keys its mask leaves out
        raise ValueError(
            "`sliding_window` must be at least 2 for 'sliding_attention' layers, got 1 (each token attending to "
            "itself alone); transformers' caches cannot keep a window that small."
        )

    if config.position_embedding_type == "relative_bias":
        check_positive(config, "relative_attention_num_buckets")
        check_positive(config, "relative_attention_max_distance")
        # prefix-LM: keys after the query inside the prefix, so the buckets cover both directions
        check_relative_buckets(
            config.relative_attention_num_buckets,
            config.relative_attention_max_distance,
            bidirectional=config.prefix_lm,
        )

    # --- attention pattern ---
    if config.sliding_window is not None and config.sliding_window > config.max_position_embeddings:
        raise ValueError(
            f"`sliding_window` ({config.sliding_window}) is larger than the context `max_position_embeddings` "
            f"({config.max_position_embeddings}): the window would never slide. Use a smaller window or "
            "`sliding_window=None` (full attention)."
        )
    if config.layer_types is not None:
        if len(config.layer_types) != config.num_hidden_layers:
            raise ValueError(
                f"`layer_types` has {len(config.layer_types)} entries but `num_hidden_layers` is "
                f"{config.num_hidden_layers}: give one attention type per layer."
            )
        for layer_type in config.layer_types:
            if layer_type not in LAYER_TYPES:
                raise ValueError(
                    f"`layer_types` contains {layer_type!r}; allowed values: {', '.join(map(repr, LAYER_TYPES))}."
                )
        if "sliding_attention" in config.layer_types and config.sliding_window is None:
            raise ValueError("`layer_types` has 'sliding_attention' layers but `sliding_window` is None: set it.")
        _validate_chunked_attention(config)

    local = {"sliding_attention", "chunked_attention"} & set(config.layer_types or ())
    if config.prefix_lm and local:
        raise ValueError(
            f"`prefix_lm=True` cannot be combined with {' or '.join(sorted(local))} layers (`layer_types`): their "
            "cache drops prefix keys that later queries must still see. Use full attention layers."
        )
    _validate_llama4_attention(config)
    _validate_query_scaling(config)
    requested = requested_attention(config)
    if requested is not None:
        check_attention_backend(config, requested)


def _validate_chunked_attention(config: Any) -> None:
    """`attention_chunk_size`: a block of at least 2 positions, given exactly when some layer is chunked."""
    chunked = "chunked_attention" in config.layer_types
    size = config.attention_chunk_size
    if size is None:
        if chunked:
            raise ValueError("`layer_types` has 'chunked_attention' layers but `attention_chunk_size` is None: set it.")
        return
    check_positive(config, "attention_chunk_size")
    if size < 2:
        # (transformers' sliding-window cache layers, which chunked layers use, cannot keep a window of 1)
        raise ValueError(
            f"`attention_chunk_size` must be at least 2, got {size}: transformers' cache layers for chunked "
            "attention keep the last `attention_chunk_size - 1` keys."
        )
    if not chunked:
        raise ValueError(
            f"`attention_chunk_size` ({size}) sets the blocks of 'chunked_attention' layers, but `layer_types` has "
            "none: add them to `layer_types`, or leave `attention_chunk_size` unset."
        )


def _validate_llama4_attention(config: Any) -> None:
    """Llama 4's attention choices: a QK-norm without a gain, none on the NoPE layers, the NoPE layers' temperature."""
    if not config.qk_norm_weight:
        if not config.use_qk_norm or config.norm_type != "rms_norm" or config.qk_norm_scope == "per_head":
            raise ValueError(
                "`qk_norm_weight=False` leaves the QK-norm's gain out: it needs `use_qk_norm=True`, "
                "`norm_type='rms_norm'` and `qk_norm_scope` 'head' or 'projection' (got "
                f"use_qk_norm={config.use_qk_norm}, norm_type={config.norm_type!r}, "
                f"qk_norm_scope={config.qk_norm_scope!r})."
            )
    if not config.qk_norm_nope_layers and not (config.use_qk_norm and config.nope_layers):
        raise ValueError(
            "`qk_norm_nope_layers=False` leaves QK-norm out of the NoPE layers: it needs `use_qk_norm=True` and "
            f"`nope_layers` (got use_qk_norm={config.use_qk_norm}, nope_layers={config.nope_layers})."
        )
    check_positive(config, "floor_scale", integer=False)
    if not math.isfinite(config.attn_scale) or config.attn_scale < 0:
        raise ValueError(f"`attn_scale` must be a finite number >= 0, got {config.attn_scale!r}.")
    if config.attn_temperature_tuning and not config.nope_layers:
        raise ValueError(
            "`attn_temperature_tuning=True` scales the queries of the NoPE layers, but `nope_layers` is "
            f"{config.nope_layers!r}: list the layers without RoPE in `nope_layers`, or leave it False."
        )


def _validate_query_scaling(config: Any) -> None:
    """Mistral 3's query scaling: a finite beta >= 0, a positive step length with a beta, RoPE to scale after."""
    beta = config.query_scaling_beta
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not math.isfinite(beta) or beta < 0:
        raise ValueError(f"`query_scaling_beta` must be a finite number >= 0 (0: off), got {beta!r}.")
    if not beta:
        return
    if config.query_scaling_length is None:
        raise ValueError(
            f"`query_scaling_beta={beta}` scales the queries at every `query_scaling_length` positions, but "
            "`query_scaling_length` is None: set it (Ministral 3: its YaRN's original_max_position_embeddings)."
        )
    check_positive(config, "query_scaling_length")
    if config.position_embedding_type != "rope":
        raise ValueError(
            f"`query_scaling_beta` scales the queries of the layers with RoPE, but `position_embedding_type` is "
            f"{config.position_embedding_type!r}: use 'rope', or leave `query_scaling_beta` at 0."
        )


def _resolve_moe_defaults(config: Any) -> None:
    """Fill `moe_intermediate_size` (= `intermediate_size`, as Mixtral), `mlp_layer_types` (all sparse when
    `num_local_experts` > 0, else all dense) and `router_aux_loss_coef` (Mixtral's 0.001 with sparse layers, else 0)."""
    if config.moe_intermediate_size is None:
        config.moe_intermediate_size = config.intermediate_size
    if config.mlp_layer_types is None and isinstance(config.num_hidden_layers, int):
        kind = "sparse" if config.num_local_experts > 0 else "dense"
        config.mlp_layer_types = [kind] * config.num_hidden_layers
    sparse = config.mlp_layer_types is not None and "sparse" in config.mlp_layer_types
    coef = config.router_aux_loss_coef
    if coef is None:
        config.router_aux_loss_coef = 0.001 if sparse else 0.0
    elif not sparse and isinstance(coef, (int, float)) and coef > 0:
        # No router to balance. A positive weight would make trainers that take it as the MoE marker (TRL) ask for
        # a load-balancing loss the model cannot return; files saved before this rule carry Mixtral's 0.001 here.
        config.router_aux_loss_coef = 0.0


def _validate_router_groups(config: Any) -> None:
    """`router_groups` divides the experts into groups of at least 2 (a group is scored by its two best experts);
    `router_top_groups` is 1 to `router_groups` and leaves at least `num_experts_per_tok` experts to choose from."""
    check_positive(config, "router_groups")
    check_choice(config, "router_group_score", ROUTER_GROUP_SCORES)
    groups, experts = config.router_groups, config.num_local_experts
    if config.router_top_groups is not None:
        check_positive(config, "router_top_groups")
        if config.router_top_groups > groups:
            raise ValueError(
                f"`router_top_groups` ({config.router_top_groups}) chooses among `router_groups` ({groups}) groups: "
                f"allowed values are 1 to {groups}, or None (every group)."
            )
    limited = groups > 1 and (config.router_top_groups or groups) < groups
    if config.router_group_score != "top2_sum" and not limited:
        raise ValueError(
            f"`router_group_score`={config.router_group_score!r} scores the expert groups of group-limited routing, "
            f"but every group is kept (router_groups={groups}, router_top_groups={config.router_top_groups}): set "
            "`router_top_groups` below `router_groups`, or leave it at 'top2_sum'."
        )
    if groups == 1 or not experts:
        return
    if experts % groups or experts // groups < 2:
        raise ValueError(
            f"`router_groups` ({groups}) splits the `num_local_experts` ({experts}) experts into equal groups of at "
            "least 2 (a group is scored by its two best experts): allowed values divide it into groups of 2 or more."
        )
    top = config.router_top_groups or groups
    if top * (experts // groups) < config.num_experts_per_tok:
        raise ValueError(
            f"`router_top_groups` ({top}) x {experts // groups} experts a group leaves fewer than "
            f"`num_experts_per_tok` ({config.num_experts_per_tok}) experts to choose."
        )


def _validate_moe(config: Any) -> None:
    check_choice(config, "router_score_function", ROUTER_SCORE_FUNCTIONS)
    check_positive(config, "routed_scaling_factor", integer=False)
    check_non_negative(config, "router_bias_update_rate")
    if config.router_bias_update_rate > 0 and not config.router_correction_bias:
        raise ValueError(
            f"`router_bias_update_rate` ({config.router_bias_update_rate}) moves the routers' correction bias, but "
            "`router_correction_bias` is False: set `router_correction_bias=True`, or leave the rate at 0."
        )
    check_non_negative(config, "num_local_experts")
    check_positive(config, "num_experts_per_tok")
    _validate_router_groups(config)
    check_non_negative(config, "router_aux_loss_coef")
    check_non_negative(config, "router_z_loss_coef")
    check_non_negative(config, "shared_expert_intermediate_size")
    if not 0.0 <= config.router_jitter_noise < 1.0:
        raise ValueError(f"`router_jitter_noise` must be in [0, 1), got {config.router_jitter_noise!r}.")
    types = config.mlp_layer_types
    if len(types) != config.num_hidden_layers:
        raise ValueError(
            f"`mlp_layer_types` has {len(types)} entries but `num_hidden_layers` is {config.num_hidden_layers}: "
            "give one of 'dense'/'sparse' per layer."
        )
    bad = sorted({t for t in types if t not in MLP_LAYER_TYPES})
    if bad:
        raise ValueError(f"`mlp_layer_types` contains {bad}; allowed values: {', '.join(map(repr, MLP_LAYER_TYPES))}.")
    if "sparse" in types:
        check_positive(config, "moe_intermediate_size")
        if config.num_local_experts < 1:
            raise ValueError(
                "`mlp_layer_types` has sparse layers, so `num_local_experts` must be a positive integer, got "
                f"{config.num_local_experts!r}."
            )
        if config.num_experts_per_tok > config.num_local_experts:
            raise ValueError(
                f"`num_experts_per_tok` ({config.num_experts_per_tok}) must be in [1, num_local_experts="
                f"{config.num_local_experts}]."
            )


# `transformers serve` finds DecoderForCausalLM (serving.py); here, since it loads a folder's config before its model
after_import(SERVE_MODEL_MANAGER_MODULE, expose_decoder_to_serve)

__all__ = ["DecoderConfig"]
