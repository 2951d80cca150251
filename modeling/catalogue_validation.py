"""Defaults and cross-field checks of `DecoderConfig`'s architecture-catalogue fields (issue 3).

The fields (names from Mistral/Gemma2/T5/Bart where those models have the concept):

    norm_type            "rms_norm" | "offset_rms_norm" (Gemma's (1 + w) gain) | "layer_norm"
    norm_position        "pre" | "post" | "sandwich" | "parallel" | "deepnorm"        (see blocks.py)
    norm_bias            LayerNorm bias; None = True for "layer_norm", False for the RMS norms
    deepnorm_alpha/beta  DeepNet's residual weight α and init gain β; None = (2N)^(1/4), (8N)^(-1/4)
    mlp_type             "gated" (SwiGLU with silu, GeGLU with gelu) | "plain" (ReLU/GELU/SiLU MLP)
    mlp_width_rule       used when `intermediate_size` is None: "4d" or "8/3d", rounded up to a multiple of
    mlp_width_multiple_of   (LLaMA: 8/3 · 4096 -> 11008 with multiple 256)
    position_embedding_type  "rope" | "alibi" | "relative_bias" (T5) | "learned" | "sinusoidal" | "none"
    relative_attention_num_buckets / relative_attention_max_distance   T5's bucketing
    scale_embedding      multiply token embeddings by sqrt(hidden_size) (Vaswani et al., Gemma)
    embedding_layernorm  a norm right after the embeddings (BLOOM's `word_embeddings_layernorm`)
    sliding_window       window size of "sliding_attention" layers (Mistral: every layer when layer_types is None)
    layer_types          per layer "full_attention" | "sliding_attention" (Gemma2: interleaved local/global)
    prefix_lm            bidirectional attention over a prefix given as `prefix_lengths` (seed 003)
    use_qk_norm          RMSNorm over each head's query and key before RoPE (Qwen3 `q_norm`/`k_norm`; seed 004)
    query_pre_attn_scalar    scores scaled by query_pre_attn_scalar^-1/2 instead of head_dim^-1/2 (Gemma2)
    attn_logit_softcapping / final_logit_softcapping   c · tanh(x / c) on scores / logits (Gemma2; seed 004)
    lm_z_loss_coef       PaLM's z-loss coefficient: + z · log²Z per token in the LM loss (seed 004)

Every invalid value or combination raises `ValueError` here, naming the fields and the allowed values.
"""

from __future__ import annotations

from typing import Any

from .blocks import BLOCKS
from .feed_forward import MLPS
from .normalization import NORMS
from .positions import POSITION_EMBEDDINGS
from .validation import check_choice, check_non_negative, check_positive

MLP_WIDTH_RULES: dict[str, float] = {"4d": 4.0, "8/3d": 8.0 / 3.0}
LAYER_TYPES = ("full_attention", "sliding_attention")
BIAS_POSITIONS = ("alibi", "relative_bias")  # the position types that add a bias to the attention scores


def intermediate_size_from_rule(hidden_size: int, rule: str, multiple_of: int = 256) -> int:
    """ceil(ratio · d / multiple) · multiple, ratio 4 ("4d") or 8/3 ("8/3d", the gated FFNs' equal-parameter width)."""
    if rule not in MLP_WIDTH_RULES:
        raise ValueError(
            f"`mlp_width_rule`={rule!r} is not supported; allowed values: {', '.join(map(repr, MLP_WIDTH_RULES))}."
        )
    width = int(MLP_WIDTH_RULES[rule] * hidden_size + 0.5) if rule == "4d" else -(-8 * hidden_size // 3)
    return -(-width // multiple_of) * multiple_of


def resolve_catalogue_defaults(config: Any) -> None:
    """Fill the fields whose default depends on others (before validation)."""
    if config.intermediate_size is None and isinstance(config.hidden_size, int):
        if not isinstance(config.mlp_width_multiple_of, int) or config.mlp_width_multiple_of <= 0:
            raise ValueError(f"`mlp_width_multiple_of` must be a positive integer, got {config.mlp_width_multiple_of!r}.")
        config.intermediate_size = intermediate_size_from_rule(
            config.hidden_size, config.mlp_width_rule, config.mlp_width_multiple_of
        )
    if config.norm_bias is None:
        config.norm_bias = config.norm_type == "layer_norm"
    if config.layer_types is None and isinstance(config.num_hidden_layers, int):
        # Mistral: a window means every layer is local. Always a list, as transformers' mask/cache helpers expect.
        kind = "full_attention" if config.sliding_window is None else "sliding_attention"
        config.layer_types = [kind] * config.num_hidden_layers


def _requested_attention(config: Any) -> str | None:
    impl = getattr(config, "_attn_implementation_internal", None)
    return impl if isinstance(impl, str) else None


def validate_catalogue(config: Any) -> None:
    check_choice(config, "norm_type", NORMS)
    check_choice(config, "norm_position", BLOCKS)
    check_choice(config, "mlp_type", MLPS)
    check_choice(config, "mlp_width_rule", MLP_WIDTH_RULES)
    check_choice(config, "position_embedding_type", POSITION_EMBEDDINGS)
    check_positive(config, "mlp_width_multiple_of")
    check_non_negative(config, "lm_z_loss_coef")
    if config.norm_bias and config.norm_type != "layer_norm":
        raise ValueError(f"`norm_bias=True` needs `norm_type='layer_norm'`: {config.norm_type!r} has no bias.")
    for name in ("deepnorm_alpha", "deepnorm_beta"):
        if getattr(config, name) is not None:
            check_positive(config, name, integer=False)
            if config.norm_position != "deepnorm":
                raise ValueError(f"`{name}` is only used with `norm_position='deepnorm'` (got {config.norm_position!r}).")
    for name in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping", "sliding_window"):
        if getattr(config, name) is not None:
            check_positive(config, name, integer=name == "sliding_window")

    if config.position_embedding_type == "relative_bias":
        check_positive(config, "relative_attention_num_buckets")
        check_positive(config, "relative_attention_max_distance")
        buckets = config.relative_attention_num_buckets
        half = buckets // 2 if config.prefix_lm else buckets  # prefix-LM uses bidirectional buckets
        if half < 2 or config.relative_attention_max_distance <= half // 2:
            raise ValueError(
                f"`relative_attention_num_buckets`={buckets} and `relative_attention_max_distance`="
                f"{config.relative_attention_max_distance} leave no log-spaced buckets: need at least "
                f"{4 if config.prefix_lm else 2} buckets and a max distance above {half // 2}."
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

    if config.prefix_lm and config.layer_types is not None and "sliding_attention" in config.layer_types:
        raise ValueError(
            "`prefix_lm=True` cannot be combined with sliding-window layers (`sliding_window`/`layer_types`): a "
            "sliding cache drops prefix keys that later queries must still see. Use full attention layers."
        )
    requested = _requested_attention(config)
    if requested is not None:
        check_attention_backend(config, requested)


def check_attention_backend(config: Any, implementation: str) -> None:
    """Refuse an attention backend that cannot honour the config's variants (at construction, or when a model
    switches backend later)."""
    if config.prefix_lm and implementation.startswith("flash"):
        raise ValueError(
            f"`prefix_lm=True` needs an arbitrary mask, which `attn_implementation`={implementation!r} cannot take; "
            "use 'sdpa', 'eager' or 'flex_attention'."
        )
    if config.position_embedding_type in BIAS_POSITIONS and (implementation.startswith("flash") or "flex" in implementation):
        raise ValueError(
            f"`position_embedding_type`={config.position_embedding_type!r} adds a bias to the attention scores, "
            f"which `attn_implementation`={implementation!r} cannot take here; use 'sdpa' or 'eager'."
        )
    if config.attn_logit_softcapping is not None and "sdpa" in implementation:
        raise ValueError(
            "`attn_logit_softcapping` cannot be applied by `attn_implementation='sdpa'` (SDPA has no score hook); use "
            "'eager' or 'flex_attention' (the default falls back to 'eager' when soft-capping is set)."
        )


__all__ = ["BIAS_POSITIONS", "LAYER_TYPES", "MLP_WIDTH_RULES", "check_attention_backend", "intermediate_size_from_rule",
           "resolve_catalogue_defaults", "validate_catalogue"]
