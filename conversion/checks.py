"""The refusals the families' config callables share: a stock config archlab cannot compute (import), an archlab
config a stock family cannot compute (export). Each names the fields and values, and why."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from transformers import PreTrainedConfig

from .family import ConversionError


def refuse_import(family: str, wrong: Mapping[str, str]) -> None:
    """`wrong`: {"stock_field=value": why} for every stock setting archlab cannot compute; raises if any."""
    if wrong:
        details = "; ".join(f"`{setting}`: {why}" for setting, why in wrong.items())
        raise ConversionError(f"This {family} checkpoint cannot be converted to archlab: {details}.")


def refuse_export(architecture: str, wrong: Mapping[str, str]) -> None:
    """`wrong`: {"archlab_field=value": what the stock family needs}; raises if any."""
    if wrong:
        details = "; ".join(f"{setting} ({needs})" for setting, needs in wrong.items())
        raise ConversionError(f"A stock {architecture} cannot compute this archlab config: {details}.")


def setting(config: PreTrainedConfig | Any, name: str) -> str:
    """`name=value` of a config, as the refusals name it."""
    return f"{name}={getattr(config, name)!r}"


def one_window_for_every_layer(config: PreTrainedConfig, architecture: str) -> dict[str, Any]:
    """The stock fields of a family that applies `sliding_window` to every layer: none to add where archlab's layers
    are all local or all global without a window; `sliding_window=None` where a window is set on layers that are all
    global (it is never applied, and the stock model would apply it everywhere). Mixed layers are refused."""
    if config.sliding_window is not None and all(kind == "full_attention" for kind in config.layer_types):
        return {"sliding_window": None}
    expected = "full_attention" if config.sliding_window is None else "sliding_attention"
    if any(kind != expected for kind in config.layer_types):
        raise ConversionError(
            f"{architecture} applies `sliding_window` to every layer; this config's `layer_types` "
            f"({config.layer_types}) mixes local and global layers, which {architecture.removesuffix('ForCausalLM')} "
            f"cannot express."
        )
    return {}


def qkv_bias_of(config: PreTrainedConfig) -> bool:
    """Whether archlab's q/k/v projections have a bias: `qkv_bias`, or `attention_bias` where it is None."""
    return config.attention_bias if config.qkv_bias is None else config.qkv_bias


def head_dim_given(stock: PreTrainedConfig | Any, values: Mapping[str, Any]) -> dict[str, Any]:
    """The head size config.json gives to a family whose config declares no `head_dim` but whose attention and RoPE
    read it (`getattr(config, "head_dim", hidden // heads)`: Qwen2, Qwen2-MoE, Phi, Phi-3), else hidden / heads."""
    return {"head_dim": values.get("head_dim") or stock.hidden_size // stock.num_attention_heads}


def head_dim_to_write(config: PreTrainedConfig) -> dict[str, Any]:
    """The `head_dim` such a family's config.json carries: none where it is hidden / heads (what its attention takes
    without one), else archlab's."""
    if config.head_dim * config.num_attention_heads == config.hidden_size:
        return {}
    return {"head_dim": config.head_dim}


def fixed_ratio_width(config: PreTrainedConfig, architecture: str, ratio: int = 4) -> dict[str, str]:
    """The families whose MLP is always `ratio`·hidden wide (BLOOM, MPT, OpenAI-GPT): the refusal if it is not."""
    if config.intermediate_size != ratio * config.hidden_size:
        return {
            setting(config, "intermediate_size"): f"{architecture}'s MLP is always {ratio} x hidden_size = "
            f"{ratio * config.hidden_size} wide"
        }
    return {}


__all__ = [
    "fixed_ratio_width",
    "head_dim_given",
    "head_dim_to_write",
    "one_window_for_every_layer",
    "qkv_bias_of",
    "refuse_export",
    "refuse_import",
    "setting",
]
