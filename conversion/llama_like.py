"""CWM, ERNIE 4.5 and Jais 2: Llama's names and block with one or two changes each, as `Family` rows.

- CWM (Meta's Code World Model): local layers interleaved with global ones (`sliding_window`, `layer_types`: every
  fourth layer global by default), llama3 RoPE scaling, no attention bias.
- ERNIE 4.5 (Baidu, dense): RoPE over interleaved channel pairs of each head (the q/k rows reordered,
  `interleaved_rope.py`), one `use_bias` flag for every projection (archlab's `attention_bias` and `mlp_bias`, which
  must then be equal to export).
- Jais 2 (Inception): LayerNorm with biases (`layer_norm_eps`), a plain MLP (up, ReLU², down) with biases, biases on
  q/k/v/o.
"""

from __future__ import annotations

from transformers import (
    CwmConfig,
    CwmForCausalLM,
    Ernie4_5Config,
    Ernie4_5ForCausalLM,
    Jais2Config,
    Jais2ForCausalLM,
)

from ..modeling import DecoderForCausalLM
from .family import IDENTITY, Family, same
from .field_lists import LLAMA_FIELDS
from .interleaved_rope import interleaved_rope

CWM_FIELDS = (*(name for name in LLAMA_FIELDS if name != "attention_bias"), "sliding_window", "layer_types")
ERNIE4_5_FIELDS = {
    **same(*(name for name in LLAMA_FIELDS if name not in ("attention_bias", "mlp_bias", "attention_dropout"))),
    "use_bias": ("attention_bias", "mlp_bias"),
}
JAIS2_FIELDS = {**same(*(name for name in LLAMA_FIELDS if name != "rms_norm_eps")), "layer_norm_eps": "rms_norm_eps"}

CWM = Family(CwmConfig, CwmForCausalLM, DecoderForCausalLM, fields=same(*CWM_FIELDS))
ERNIE4_5 = Family(
    Ernie4_5Config,
    Ernie4_5ForCausalLM,
    DecoderForCausalLM,
    fields=ERNIE4_5_FIELDS,
    layout=interleaved_rope(IDENTITY),
)
JAIS2 = Family(
    Jais2Config,
    Jais2ForCausalLM,
    DecoderForCausalLM,
    fields=JAIS2_FIELDS,
    implied={"norm_type": "layer_norm", "norm_bias": True, "mlp_type": "plain"},
)
LLAMA_LIKE_FAMILIES = (CWM, ERNIE4_5, JAIS2)

__all__ = ["CWM", "ERNIE4_5", "JAIS2", "LLAMA_LIKE_FAMILIES"]
