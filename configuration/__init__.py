"""archlab.configuration: the configuration API (config classes re-exported from `archlab.modeling`), named
presets, and checkpoint conversion to and from stock Hugging Face families."""

from ..modeling import DecoderConfig, Seq2SeqConfig

__all__ = ["DecoderConfig", "Seq2SeqConfig"]
