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


def fixed_ratio_width(config: PreTrainedConfig, architecture: str, ratio: int = 4) -> dict[str, str]:
    """The families whose MLP is always `ratio`·hidden wide (BLOOM, MPT, OpenAI-GPT): the refusal if it is not."""
    if config.intermediate_size != ratio * config.hidden_size:
        return {
            setting(config, "intermediate_size"): f"{architecture}'s MLP is always {ratio} x hidden_size = "
            f"{ratio * config.hidden_size} wide"
        }
    return {}


__all__ = ["fixed_ratio_width", "refuse_export", "refuse_import", "setting"]
