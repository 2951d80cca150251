"""Phi-3 (`Phi3ForCausalLM`): Llama's block with fused q/k/v and gate/up projections, as a `Family` row.

Phi-3 is archlab's default recipe (pre-RMSNorm, RoPE, SwiGLU, no biases): only its weights differ, `qkv_proj`
holding [q; k; v] and `gate_up_proj` holding [gate; up], split on import and joined on export by the rules of
`layouts.py`. Its `sliding_window`, when set, applies to every layer (Phi-3-mini's 2047), as Mistral's. Its rotary
embedding is transformers' for the `rope_parameters` it has, `partial_rotary_factor` included (Phi-4-mini's 0.75):
"default" and "longrope" (Phi-3-*-128k: short factors up to `original_max_position_embeddings`, long factors past
it, with its attention factor), the only types `Phi3Config` accepts; archlab's rotary computes both with the same
functions. `original_max_position_embeddings` is a top-level field only longrope reads, inside `rope_parameters`:
it is dropped on import otherwise, and written back from `rope_parameters` (else `max_position_embeddings`).
`resid_pdrop` and `embd_pdrop` only change training: dropped on import, exported as 0. `Phi3Config` declares no
`head_dim`, but Phi-3's attention and RoPE read one that config.json gives (`getattr(config, "head_dim", hidden //
heads)`): it is mapped both ways (written back only where it is not hidden / heads), except with longrope, whose
factors `Phi3Config` checks against hidden / heads while its RoPE takes `head_dim`: no such model can be built.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from transformers import Phi3Config, Phi3ForCausalLM, PreTrainedConfig

from ..modeling import DecoderForCausalLM
from .checks import head_dim_given, head_dim_to_write, one_window_for_every_layer, refuse_export, refuse_import
from .family import Family, same
from .layouts import FusedGateUp, FusedQKV, Rename, WeightRules

PHI3_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "hidden_act",
    "max_position_embeddings",
    "initializer_range",
    "rms_norm_eps",
    "use_cache",
    "tie_word_embeddings",
    "rope_parameters",
    "attention_dropout",
    "pad_token_id",
    "bos_token_id",
    "eos_token_id",
    "sliding_window",
)
# the rope types Phi3Config accepts (its `validate_rope`); archlab's rotary computes both as Phi-3's
ROPE_TYPES = ("default", "longrope")

LAYER = "model.layers.{n}"
RULES = WeightRules(
    (
        Rename("model.embed_tokens", "model.embed_tokens"),
        Rename(f"{LAYER}.input_layernorm", f"{LAYER}.input_layernorm"),
        FusedQKV(f"{LAYER}.self_attn.qkv_proj", f"{LAYER}.self_attn", "concat"),
        Rename(f"{LAYER}.self_attn.o_proj", f"{LAYER}.self_attn.o_proj"),
        Rename(f"{LAYER}.post_attention_layernorm", f"{LAYER}.post_attention_layernorm"),
        FusedGateUp(f"{LAYER}.mlp.gate_up_proj", f"{LAYER}.mlp"),
        Rename(f"{LAYER}.mlp.down_proj", f"{LAYER}.mlp.down_proj"),
        Rename("model.norm", "model.norm"),
        Rename("lm_head", "lm_head"),
    ),
    base_prefix="model",
    ignore=(r"inv_freq$",),
)


def _rope_type(parameters: Mapping[str, Any] | None) -> str:
    parameters = parameters or {}
    return parameters.get("rope_type", parameters.get("type", "default"))


def _longrope_head_dim(rope_type: str, head_dim: int, hidden_size: int, heads: int) -> dict[str, str]:
    """The refusal of longrope with a head size other than hidden / heads: `Phi3Config` wants one factor per rotary
    frequency of hidden / heads, its RoPE (and archlab's) one per frequency of `head_dim`."""
    if rope_type != "longrope" or head_dim == hidden_size // heads:
        return {}
    return {
        f"head_dim={head_dim!r} with rope_type 'longrope'": f"Phi3Config checks longrope's factors against "
        f"hidden_size / num_attention_heads = {hidden_size // heads} while its RoPE reads head_dim, so no such "
        "Phi-3 can be built"
    }


def _phi3_to_archlab(stock: PreTrainedConfig, values: Mapping[str, Any]) -> dict[str, Any]:
    rope_type = _rope_type(stock.rope_parameters)
    head_dim = head_dim_given(stock, values)
    wrong = _longrope_head_dim(rope_type, head_dim["head_dim"], stock.hidden_size, stock.num_attention_heads)
    if rope_type not in ROPE_TYPES:  # (Phi3Config refuses them itself; a config built past its checks)
        wrong[f"rope_parameters['rope_type']={rope_type!r}"] = f"Phi-3 computes {ROPE_TYPES} only"
    refuse_import("phi3", wrong)
    return head_dim


def _phi3_from_archlab(config: PreTrainedConfig) -> dict[str, Any]:
    rope = config.rope_parameters or {}
    rope_type = _rope_type(rope)
    wrong = _longrope_head_dim(rope_type, config.head_dim, config.hidden_size, config.num_attention_heads)
    if rope_type not in ROPE_TYPES:
        wrong[f"rope_parameters['rope_type']={rope_type!r}"] = f"Phi3Config accepts {' and '.join(ROPE_TYPES)} only"
    refuse_export("Phi3ForCausalLM", wrong)
    return {
        **one_window_for_every_layer(config, "Phi3ForCausalLM"),
        **head_dim_to_write(config),
        "original_max_position_embeddings": rope.get(
            "original_max_position_embeddings", config.max_position_embeddings
        ),
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
    }


PHI3 = Family(
    Phi3Config,
    Phi3ForCausalLM,
    DecoderForCausalLM,
    fields=same(*PHI3_FIELDS),
    to_archlab=_phi3_to_archlab,
    from_archlab=_phi3_from_archlab,
    expressible=frozenset({"head_dim", "layer_types"}),
    layout=RULES.layout(),
)

__all__ = ["PHI3", "PHI3_FIELDS"]
