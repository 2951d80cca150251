"""archlab.configuration: the configuration API (config classes re-exported from `archlab.modeling`) and named
presets. Checkpoint conversion to and from stock Hugging Face families is `archlab.conversion`."""

from ..modeling import DecoderConfig, Seq2SeqConfig
from .presets import PRESET_NOTES, PRESETS, list_presets, preset_config, preset_kwargs

__all__ = [
    "DecoderConfig",
    "Seq2SeqConfig",
    "PRESETS",
    "PRESET_NOTES",
    "list_presets",
    "preset_config",
    "preset_kwargs",
]
