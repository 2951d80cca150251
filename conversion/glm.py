"""GLM and GLM-4 (THUDM / Zhipu's GLM-4-9B and GLM-4-0414 families) as `Family` rows.

Both are Llama's decoder with three changes archlab expresses: RoPE over interleaved channel pairs of the first half of
each head (`partial_rotary_factor` 0.5; the q/k rows reordered, `interleaved_rope.py`), the MLP's gate and up
projections held as one `gate_up_proj` ([gate; up], split on import and joined on export), and biases on q/k/v only
(`attention_bias`, archlab's `qkv_bias`). GLM-4 adds a norm after each sub-layer's output, inside the residual: the
sandwich block (archlab's `norm_position="sandwich"`, Gemma2's names), whose norms GLM-4 names by what precedes them:

    GLM-4                          archlab (Gemma2)
    input_layernorm                input_layernorm              before attention
    post_self_attn_layernorm       post_attention_layernorm     after attention, before the residual add
    post_attention_layernorm       pre_feedforward_layernorm    before the MLP
    post_mlp_layernorm             post_feedforward_layernorm   after the MLP, before the residual add
"""

from __future__ import annotations

from typing import Any

from transformers import Glm4Config, Glm4ForCausalLM, GlmConfig, GlmForCausalLM, PreTrainedConfig

from ..modeling import DecoderForCausalLM
from .checks import qkv_bias_of
from .family import Family, same
from .field_lists import LLAMA_FIELDS
from .fused_decoders import ATTN, LAYER, MLP
from .interleaved_rope import interleaved_rope
from .layouts import FusedGateUp, Rename, WeightRules

# GlmConfig / Glm4Config fields archlab has with the same meaning (`attention_bias` is archlab's `qkv_bias`)
GLM_FIELDS = {
    **same(*(name for name in LLAMA_FIELDS if name not in ("attention_bias", "mlp_bias"))),
    "attention_bias": "qkv_bias",
}
STOCK = "model.layers.{n}"


def _from_archlab(config: PreTrainedConfig) -> dict[str, Any]:
    return {"attention_bias": qkv_bias_of(config)}


def _layout(norms: tuple[Rename, ...]):
    return interleaved_rope(
        WeightRules(
            (
                Rename("model.embed_tokens", "model.embed_tokens"),
                *norms,
                *(Rename(f"{STOCK}.self_attn.{proj}", f"{ATTN}.{proj}") for proj in ("q_proj", "k_proj", "v_proj")),
                Rename(f"{STOCK}.self_attn.o_proj", f"{ATTN}.o_proj"),
                FusedGateUp(f"{STOCK}.mlp.gate_up_proj", MLP),
                Rename(f"{STOCK}.mlp.down_proj", f"{MLP}.down_proj"),
                Rename("model.norm", "model.norm"),
                Rename("lm_head", "lm_head"),
            ),
            base_prefix="model",
            ignore=(r"inv_freq$",),
        ).layout()
    )


GLM = Family(
    GlmConfig,
    GlmForCausalLM,
    DecoderForCausalLM,
    fields=GLM_FIELDS,
    implied={"attention_bias": False},
    from_archlab=_from_archlab,
    layout=_layout(
        (
            Rename(f"{STOCK}.input_layernorm", f"{LAYER}.input_layernorm"),
            Rename(f"{STOCK}.post_attention_layernorm", f"{LAYER}.post_attention_layernorm"),
        )
    ),
)

GLM4 = Family(
    Glm4Config,
    Glm4ForCausalLM,
    DecoderForCausalLM,
    fields=GLM_FIELDS,
    implied={"attention_bias": False, "norm_position": "sandwich"},
    from_archlab=_from_archlab,
    layout=_layout(
        (
            Rename(f"{STOCK}.input_layernorm", f"{LAYER}.input_layernorm"),
            Rename(f"{STOCK}.post_self_attn_layernorm", f"{LAYER}.post_attention_layernorm"),
            Rename(f"{STOCK}.post_attention_layernorm", f"{LAYER}.pre_feedforward_layernorm"),
            Rename(f"{STOCK}.post_mlp_layernorm", f"{LAYER}.post_feedforward_layernorm"),
        )
    ),
)

GLM_FAMILIES = (GLM, GLM4)

__all__ = ["GLM", "GLM4", "GLM_FAMILIES", "GLM_FIELDS"]
