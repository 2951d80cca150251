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

from typing import Any

from huggingface_hub.dataclasses import strict
from transformers.configuration_utils import PreTrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from .catalogue_validation import resolve_catalogue_defaults, validate_catalogue
from .validation import (
    ACTIVATIONS,
    check_choice,
    check_field_types,
    check_non_negative,
    check_positive,
    check_probability,
)
from .moe import resolve_moe_defaults, validate_moe

# `rope_parameters["rope_type"]` values: transformers' registry of inverse-frequency functions, which rotary.py uses.
ROPE_TYPES = ("default", *ROPE_INIT_FUNCTIONS)


def check_rope_type(rope_parameters: Any) -> None:
    """Each `rope_type` of `rope_parameters` (flat, or one dict per layer type) is one that RoPE can be built with."""
    if not isinstance(rope_parameters, dict):
        return
    for parameters in [v for v in rope_parameters.values() if isinstance(v, dict)] or [rope_parameters]:
        rope_type = parameters.get("rope_type", parameters.get("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"`rope_parameters['rope_type']`={rope_type!r} is not supported; allowed values: "
                             f"{', '.join(map(repr, ROPE_TYPES))}.")


@strict
class DecoderConfig(PreTrainedConfig):
    r"""Configuration of [`DecoderModel`], [`DecoderForCausalLM`] and [`DecoderForSequenceClassification`].

    The LLaMA fields (with LlamaConfig's defaults, i.e. a LLaMA-7B shape) are:
    `vocab_size`, `hidden_size`, `intermediate_size`, `num_hidden_layers`, `num_attention_heads`,
    `num_key_value_heads` (GQA; defaults to `num_attention_heads`, 1 is MQA), `head_dim` (defaults to
    `hidden_size // num_attention_heads`), `hidden_act`, `max_position_embeddings`, `initializer_range`,
    `rms_norm_eps`, `use_cache`, `pad_token_id`, `bos_token_id`, `eos_token_id`, `tie_word_embeddings`,
    `rope_parameters` (`{"rope_type": ..., "rope_theta": ..., ...}` exactly as in transformers),
    `attention_bias`, `attention_dropout`, `mlp_bias`.

    Mixture-of-experts fields (Mixtral / Qwen2-MoE names and meanings; see `moe.py`):
        num_local_experts (`int`, defaults to 0): routed experts K per sparse layer; 0 means a dense model.
        num_experts_per_tok (`int`, defaults to 2): experts k each token is sent to.
        moe_intermediate_size (`int`, *optional*): width of each routed expert; defaults to `intermediate_size`.
        shared_expert_intermediate_size (`int`, defaults to 0): width of the shared expert every token passes
            through (Qwen2-MoE); 0 means none.
        shared_expert_gate (`bool`, defaults to `True`): scale the shared expert by a per-token sigmoid gate
            (Qwen2-MoE); `False` adds it ungated (DeepSeekMoE).
        norm_topk_prob (`bool`, defaults to `True`): renormalise the k chosen probabilities to sum to 1 (Mixtral
            always does; Qwen2-MoE's default is `False`).
        mlp_layer_types (`list[str]`, *optional*): `"dense"` or `"sparse"` per layer; defaults to all sparse when
            `num_local_experts` > 0, else all dense.
        output_router_logits (`bool`, defaults to `False`): return the router logits and the load-balancing loss,
            and add `router_aux_loss_coef` times it to the LM loss (as Mixtral).
        router_aux_loss_coef (`float`, *optional*): weight of the load-balancing loss; defaults to Mixtral's 0.001
            when there are sparse layers. A dense model has no router, so it is 0 there whatever is given.
        router_z_loss_coef (`float`, defaults to 0.0): weight of the ST-MoE router z-loss added to the LM loss.
        router_jitter_noise (`float`, defaults to 0.0): Mixtral's multiplicative input noise in training.

    archlab fields:
        classifier_lm_loss_weight (`float`, defaults to 0.0):
            λ in L = L_FT + λ·L_PT for [`DecoderForSequenceClassification`] (seed 001, GPT fine-tuning): when
            positive and `labels` are given, the next-token loss over the (non-pad) input is added.
        lm_loss_chunk_size (`int`, defaults to 1024):
            In training, the LM head and cross-entropy run over chunks of this many tokens so the full
            `(tokens, vocab)` logits never exist at once; `0` turns chunking off.

    Example:
    ```python
    >>> from archlab import DecoderConfig, DecoderForCausalLM
    >>> config = DecoderConfig(vocab_size=1000, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
    ...                        num_attention_heads=4, num_key_value_heads=2)
    >>> model = DecoderForCausalLM(config)
    ```
    """

    model_type = "archlab_decoder"
    keys_to_ignore_at_inference = ["past_key_values"]
    # Mixtral's alias: code written for transformers 5's MoE configs (TRL's load-balancing loss) reads `num_experts`.
    attribute_map = {"num_experts": "num_local_experts"}
    base_model_tp_plan = {
        "layers.*.self_attn.q_proj": "colwise",
        "layers.*.self_attn.k_proj": "colwise",
        "layers.*.self_attn.v_proj": "colwise",
        "layers.*.self_attn.o_proj": "rowwise",
        "layers.*.mlp.gate_proj": "colwise",
        "layers.*.mlp.up_proj": "colwise",
        "layers.*.mlp.down_proj": "rowwise",
    }
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

    # --- archlab fields ---
    classifier_lm_loss_weight: int | float = 0.0
    lm_loss_chunk_size: int = 1024

    # --- the architecture catalogue (issue 3); Mistral/Gemma2 names where they have the concept ---
    norm_type: str = "rms_norm"
    norm_position: str = "pre"
    norm_bias: bool | None = None
    deepnorm_alpha: int | float | None = None
    deepnorm_beta: int | float | None = None
    mlp_type: str = "gated"
    mlp_width_rule: str = "8/3d"
    mlp_width_multiple_of: int = 256
    position_embedding_type: str = "rope"
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    scale_embedding: bool = False
    embedding_layernorm: bool = False
    sliding_window: int | None = None
    layer_types: list[str] | None = None
    prefix_lm: bool = False
    use_qk_norm: bool = False
    query_pre_attn_scalar: int | float | None = None
    attn_logit_softcapping: int | float | None = None
    final_logit_softcapping: int | float | None = None
    lm_z_loss_coef: int | float = 0.0

    def __post_init__(self, **kwargs: Any) -> None:
        check_field_types(self)
        resolve_catalogue_defaults(self)
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None and isinstance(self.num_attention_heads, int) and self.num_attention_heads > 0:
            if self.hidden_size % self.num_attention_heads != 0:
                raise ValueError(
                    f"`hidden_size` ({self.hidden_size}) must be divisible by `num_attention_heads` "
                    f"({self.num_attention_heads}) unless `head_dim` is given explicitly."
                )
            self.head_dim = self.hidden_size // self.num_attention_heads
        resolve_moe_defaults(self)
        super().__post_init__(**kwargs)  # standardises `rope_parameters` (legacy `rope_theta` / `rope_scaling`)
        check_rope_type(self.rope_parameters)  # transformers only warns about an unknown type; the model build fails
        try:  # run again by `@strict` after this method, where a key missing from `rope_parameters` is a KeyError
            self.validate_rope()
        except KeyError as error:
            raise ValueError(error.args[0] if error.args else str(error)) from None
        self.validate_architecture()  # raise a plain ValueError now; `@strict` would wrap it in its own error type

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
        check_non_negative(self, "classifier_lm_loss_weight")
        check_non_negative(self, "lm_loss_chunk_size")
        check_choice(self, "hidden_act", ACTIVATIONS)
        validate_moe(self)
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"`num_key_value_heads` ({self.num_key_value_heads}) must divide `num_attention_heads` "
                f"({self.num_attention_heads}): allowed values are "
                f"{[d for d in range(1, self.num_attention_heads + 1) if self.num_attention_heads % d == 0]}."
            )
        rotary_dim = int(self.head_dim * self.rope_parameters.get("partial_rotary_factor", 1.0))
        if self.position_embedding_type == "rope" and (rotary_dim % 2 != 0 or rotary_dim == 0):
            raise ValueError(
                f"The rotary dimension (`head_dim` {self.head_dim} x `rope_parameters['partial_rotary_factor']` "
                f"{self.rope_parameters.get('partial_rotary_factor', 1.0)} = {rotary_dim}) must be a positive even "
                "number: RoPE rotates pairs of channels."
            )
        for name in ("pad_token_id", "bos_token_id"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < self.vocab_size:
                raise ValueError(f"`{name}` ({value}) must be None or in [0, vocab_size={self.vocab_size}).")
        validate_catalogue(self)


__all__ = ["DecoderConfig"]
