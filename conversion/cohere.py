"""Cohere (Command R) and Cohere2 (Command R7B, Command A) as `Family` rows.

Both are a parallel block with one norm that the attention and the SwiGLU MLP read (archlab's
`norm_position="parallel_shared_norm"`, GPT-J's), a LayerNorm without a bias (`norm_type="layer_norm"`,
`norm_bias=False`; `layer_norm_eps` is archlab's `rms_norm_eps`), RoPE over interleaved channel pairs (the q/k rows
reordered, `interleaved_rope.py`, and the QK-norm gains' channels with them) and logits times `logit_scale` (archlab's
field of that name). Cohere's optional QK-norm (`use_qk_norm`, Command R+) is a LayerNorm of each head with a gain per
head and channel, (heads, head_dim): archlab's `qk_norm_scope="per_head"`. Cohere2 interleaves local layers
(`sliding_window`, three in four by default) with global ones, and only its local layers rotate: its global layers are
archlab's `nope_layers`. It needs a window (its model builds a sliding-window mask for every forward).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from transformers import Cohere2Config, Cohere2ForCausalLM, CohereConfig, CohereForCausalLM, PreTrainedConfig

from ..modeling import DecoderForCausalLM
from .checks import head_dim_given, head_dim_to_write, refuse_export, refuse_import, setting
from .family import IDENTITY, Family, same
from .field_lists import LLAMA_FIELDS
from .interleaved_rope import interleaved_rope

# CohereConfig: Llama's fields (no `head_dim` field, no MLP bias), its norms' epsilon and the logits' scale
COHERE_FIELDS = {
    **same(*(name for name in LLAMA_FIELDS if name not in ("head_dim", "mlp_bias", "rms_norm_eps")), "logit_scale"),
    "layer_norm_eps": "rms_norm_eps",
}
# Cohere2Config: Cohere's (its head size always hidden / heads) with the window and the layer types
COHERE2_FIELDS = {**COHERE_FIELDS, **same("sliding_window", "layer_types")}
IMPLIED = {"norm_type": "layer_norm", "norm_bias": False, "norm_position": "parallel_shared_norm"}


def _cohere_to_archlab(stock: PreTrainedConfig, values: Mapping[str, Any]) -> dict[str, Any]:
    # Command R+'s QK-norm: a LayerNorm (no bias) of each head with a gain per head and channel, (heads, head_dim)
    qk_norm = {"use_qk_norm": True, "qk_norm_scope": "per_head"} if stock.use_qk_norm else {}
    return {**qk_norm, **head_dim_given(stock, values)}


def _cohere_from_archlab(config: PreTrainedConfig) -> dict[str, Any]:
    if config.use_qk_norm and config.qk_norm_scope != "per_head":
        refuse_export(
            "CohereForCausalLM",
            {setting(config, "qk_norm_scope"): "Cohere's QK-norm has a gain per head and channel: 'per_head'"},
        )
    return {"use_qk_norm": config.use_qk_norm, **head_dim_to_write(config)}


def _global_layers(layer_types: list[str]) -> list[int] | None:
    """Cohere2's layers without RoPE, its global ones (None: none)."""
    return [i for i, kind in enumerate(layer_types) if kind == "full_attention"] or None


def _cohere2_to_archlab(stock: PreTrainedConfig, values: Mapping[str, Any]) -> dict[str, Any]:
    if stock.sliding_window is None:  # (its model builds a sliding-window mask for every forward)
        refuse_import("cohere2", {"sliding_window=None": "a stock Cohere2 cannot run without a window either"})
    return {"nope_layers": _global_layers(stock.layer_types)}


def _cohere2_from_archlab(config: PreTrainedConfig) -> dict[str, Any]:
    wrong = {}
    if config.sliding_window is None:
        wrong[setting(config, "sliding_window")] = "Cohere2 builds a sliding-window mask for every forward"
    expected = _global_layers(config.layer_types)
    if config.nope_layers != expected:
        wrong[setting(config, "nope_layers")] = (
            f"Cohere2 rotates exactly its local layers: nope_layers={expected!r} for these `layer_types`"
        )
    refuse_export("Cohere2ForCausalLM", wrong)
    return {}


COHERE = Family(
    CohereConfig,
    CohereForCausalLM,
    DecoderForCausalLM,
    fields=COHERE_FIELDS,
    implied=IMPLIED,
    to_archlab=_cohere_to_archlab,
    from_archlab=_cohere_from_archlab,
    expressible=frozenset({"head_dim", "use_qk_norm", "qk_norm_scope"}),
    layout=interleaved_rope(IDENTITY),
)
COHERE2 = Family(
    Cohere2Config,
    Cohere2ForCausalLM,
    DecoderForCausalLM,
    fields=COHERE2_FIELDS,
    implied=IMPLIED,
    to_archlab=_cohere2_to_archlab,
    from_archlab=_cohere2_from_archlab,
    expressible=frozenset({"nope_layers"}),
    layout=interleaved_rope(IDENTITY),
)
COHERE_FAMILIES = (COHERE, COHERE2)

__all__ = ["COHERE", "COHERE2", "COHERE_FAMILIES"]
