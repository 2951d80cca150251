"""CWM, ERNIE 4.5, Jais 2, Nemotron, InternLM3, IQuest-Coder, EXAONE 3 and Apertus: Llama's names and block with one
or two changes each, as `Family` rows.

- CWM (Meta's Code World Model): local layers interleaved with global ones (`sliding_window`, `layer_types`: every
  fourth layer global by default), llama3 RoPE scaling, no attention bias.
- ERNIE 4.5 (Baidu, dense): RoPE over interleaved channel pairs of each head (the q/k rows reordered,
  `interleaved_rope.py`), one `use_bias` flag for every projection (archlab's `attention_bias` and `mlp_bias`, which
  must then be equal to export).
- ERNIE 4.5 MoE: ERNIE 4.5's attention with sparse layers every `moe_layer_interval` layers between
  `moe_layer_start_index` and `moe_layer_end_index` (archlab's `mlp_layer_types`): a softmax router whose top k is
  chosen with a correction bias (`mlp.gate.moe_statics.e_score_correction_bias`, (1, K), archlab's
  `mlp.gate.e_score_correction_bias`) and renormalised, an ungated shared expert of `moe_num_shared_experts` experts;
  `use_bias` also gives the LM head a bias. Its multi-token-prediction tensors (`mtp*`) are dropped, as transformers
  drops them.
- Jais 2 (Inception): LayerNorm with biases (`layer_norm_eps`), a plain MLP (up, ReLU², down) with biases, biases on
  q/k/v/o.
- Nemotron (NVIDIA: Nemotron-4, Minitron): LayerNorm1P — a LayerNorm with a bias whose gain is stored as w of
  (1 + w) (archlab's `norm_type="offset_layer_norm"`, `norm_eps`), a plain MLP (up, ReLU², down), RoPE over
  `partial_rotary_factor` of each head (0.5 by default).
- InternLM3 (Shanghai AI Laboratory) and IQuest-Coder (IQuestLab): Llama itself under their own `model_type`
  (transformers runs both on `LlamaForCausalLM`, which their folders name); InternLM3's attention and MLP biases are
  one setting (its config refuses them unequal: archlab's `attention_bias` and `mlp_bias` must then be equal to
  export).
- EXAONE 3.0 / 3.5 (LG AI Research, `exaone`): Llama itself (transformers runs it on `LlamaForCausalLM`) under GPT-2's
  names (`transformer.h.N.attn.attention.q_proj`, `ln_1`, `mlp.c_fc_0` / `c_fc_1` / `c_proj`, ...), which
  transformers also writes back when it saves one; a folder with Llama's names converts too.
- Apertus (Swiss AI, EPFL, ETH Zurich): a plain MLP (up, xIELU, down; xIELU's α learned per layer,
  `mlp.act_fn.alpha_p` / `alpha_n` with its β and ε buffers, the same names in archlab) and QK-norm per head
  (Qwen3's); its norms are named `attention_layernorm` and `feedforward_layernorm` (archlab's `input_layernorm`,
  `post_attention_layernorm`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from transformers import (
    ApertusConfig,
    ApertusForCausalLM,
    CwmConfig,
    CwmForCausalLM,
    Ernie4_5_MoeConfig,
    Ernie4_5_MoeForCausalLM,
    Ernie4_5Config,
    Ernie4_5ForCausalLM,
    ExaoneConfig,
    InternLM3Config,
    IQuestCoderConfig,
    Jais2Config,
    Jais2ForCausalLM,
    LlamaForCausalLM,
    NemotronConfig,
    NemotronForCausalLM,
    PreTrainedConfig,
)

from ..modeling import DecoderForCausalLM
from .checks import head_dim_given, head_dim_to_write, refuse_export, setting
from .experts import QWEN2_MOE_LAYOUT
from .family import IDENTITY, Family, Layout, StateDict, renamed, same
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

# --- ERNIE 4.5 MoE ----------------------------------------------------------------------------------------------------

ERNIE4_5_MOE_FIELDS = {
    **same(*(name for name in ERNIE4_5_FIELDS if name not in ("use_bias", "head_dim")), "moe_intermediate_size"),
    **same("output_router_logits", "router_aux_loss_coef"),
    "use_bias": ("attention_bias", "mlp_bias", "lm_head_bias"),
    "moe_num_experts": "num_local_experts",
    "moe_k": "num_experts_per_tok",
}
STOCK_BIAS = ".mlp.gate.moe_statics.e_score_correction_bias"
ARCHLAB_BIAS = ".mlp.gate.e_score_correction_bias"
MTP = re.compile(r"(^|\.)mtp")


def _sparse_layers(layers: int, interval: int, start: int, end: int) -> list[str]:
    end = layers - 1 if end == -1 else end
    return ["sparse" if (i + 1) % interval == 0 and start <= i <= end else "dense" for i in range(layers)]


def _ernie_moe_to_archlab(stock: PreTrainedConfig, values: Mapping[str, Any]) -> dict[str, Any]:
    types = _sparse_layers(
        stock.num_hidden_layers, stock.moe_layer_interval, stock.moe_layer_start_index, stock.moe_layer_end_index
    )
    return {
        **head_dim_given(stock, values),
        "mlp_layer_types": types,
        "shared_expert_intermediate_size": stock.moe_intermediate_size * stock.moe_num_shared_experts,
    }


def _ernie_moe_from_archlab(config: PreTrainedConfig) -> dict[str, Any]:
    """The (interval, start, end) that lays out archlab's sparse layers, and the shared expert's count."""
    types, layers = config.mlp_layer_types, config.num_hidden_layers
    sparse = [i for i, kind in enumerate(types) if kind == "sparse"]
    pattern = None
    for interval in range(1, layers + 1):
        if sparse and _sparse_layers(layers, interval, sparse[0], sparse[-1]) == types:
            pattern = {"moe_layer_interval": interval, "moe_layer_start_index": sparse[0]}
            pattern["moe_layer_end_index"] = sparse[-1]
            break
    wrong = {}
    if pattern is None:
        wrong[setting(config, "mlp_layer_types")] = "ERNIE 4.5 MoE's sparse layers are every n-th between two layers"
    shared, width = config.shared_expert_intermediate_size, config.moe_intermediate_size
    if shared % width:
        wrong[setting(config, "shared_expert_intermediate_size")] = f"a multiple of moe_intermediate_size={width}"
    refuse_export("Ernie4_5_MoeForCausalLM", wrong)
    return {**pattern, "moe_num_shared_experts": shared // width, **head_dim_to_write(config)}


def _ernie_moe_weights_to_archlab(state_dict: StateDict, config: PreTrainedConfig) -> StateDict:
    kept = {key: tensor for key, tensor in state_dict.items() if not MTP.search(key)}
    kept = {key.replace(".mlp.moe_statics.", ".mlp.gate.moe_statics."): tensor for key, tensor in kept.items()}
    fused = QWEN2_MOE_LAYOUT.to_archlab(kept, config)
    return {
        key.replace(STOCK_BIAS, ARCHLAB_BIAS).replace(".mlp.shared_experts.", ".mlp.shared_expert."): (
            tensor.reshape(-1) if key.endswith(STOCK_BIAS) else tensor
        )
        for key, tensor in fused.items()
    }


def _ernie_moe_weights_from_archlab(state_dict: StateDict, config: PreTrainedConfig) -> StateDict:
    return {
        key.replace(ARCHLAB_BIAS, STOCK_BIAS).replace(".mlp.shared_expert.", ".mlp.shared_experts."): (
            tensor.reshape(1, -1) if key.endswith(ARCHLAB_BIAS) else tensor
        )
        for key, tensor in state_dict.items()
    }


ERNIE4_5_MOE = Family(
    Ernie4_5_MoeConfig,
    Ernie4_5_MoeForCausalLM,
    DecoderForCausalLM,
    fields=ERNIE4_5_MOE_FIELDS,
    implied={"router_correction_bias": True, "norm_topk_prob": True, "shared_expert_gate": False},
    to_archlab=_ernie_moe_to_archlab,
    from_archlab=_ernie_moe_from_archlab,
    # the router z-loss only changes training; it is dropped on export
    expressible=frozenset({"head_dim", "mlp_layer_types", "shared_expert_intermediate_size", "router_z_loss_coef"}),
    layout=interleaved_rope(
        Layout(to_archlab=_ernie_moe_weights_to_archlab, from_archlab=_ernie_moe_weights_from_archlab)
    ),
)

# --- Nemotron: LayerNorm1P, ReLU², partial RoPE ---------------------------------------------------------------------

NEMOTRON = Family(
    NemotronConfig,
    NemotronForCausalLM,
    DecoderForCausalLM,
    fields={**same(*(name for name in LLAMA_FIELDS if name != "rms_norm_eps")), "norm_eps": "rms_norm_eps"},
    implied={"norm_type": "offset_layer_norm", "norm_bias": True, "mlp_type": "plain"},
)

# --- InternLM3, IQuest-Coder: Llama under another model_type ---------------------------------------------------------

INTERNLM3_FIELDS = {
    **same(*(name for name in LLAMA_FIELDS if name not in ("attention_bias", "mlp_bias"))),
    "attention_bias": ("attention_bias", "mlp_bias"),  # its `mlp_bias` equals it (InternLM3Config refuses otherwise)
}
INTERNLM3 = Family(
    InternLM3Config,
    LlamaForCausalLM,
    DecoderForCausalLM,
    fields=INTERNLM3_FIELDS,
    from_archlab=lambda config: {"mlp_bias": config.mlp_bias},
)
IQUESTCODER = Family(IQuestCoderConfig, LlamaForCausalLM, DecoderForCausalLM, fields=same(*LLAMA_FIELDS))

# EXAONE 3's names -> Llama's (the output projection's before the attention's prefix); `LlamaForCausalLM` saves them
EXAONE_NAMES = (
    ("transformer.wte.", "model.embed_tokens."),
    ("transformer.h.", "model.layers."),
    ("transformer.ln_f.", "model.norm."),
    (".attn.attention.out_proj.", ".self_attn.o_proj."),
    (".attn.attention.", ".self_attn."),
    (".ln_1.", ".input_layernorm."),
    (".ln_2.", ".post_attention_layernorm."),
    (".mlp.c_fc_0.", ".mlp.gate_proj."),
    (".mlp.c_fc_1.", ".mlp.up_proj."),
    (".mlp.c_proj.", ".mlp.down_proj."),
)
EXAONE = Family(
    ExaoneConfig,
    LlamaForCausalLM,
    DecoderForCausalLM,
    fields=same(*LLAMA_FIELDS),
    layout=Layout(to_archlab=lambda state_dict, config: renamed(state_dict, EXAONE_NAMES)),
)

# --- Apertus: a plain xIELU MLP, QK-norm per head, its norms named after their sub-layers --------------------------

APERTUS_NORMS = (
    (".attention_layernorm.", ".input_layernorm."),
    (".feedforward_layernorm.", ".post_attention_layernorm."),
)
APERTUS = Family(
    ApertusConfig,
    ApertusForCausalLM,
    DecoderForCausalLM,
    fields=same(*(name for name in LLAMA_FIELDS if name not in ("mlp_bias", "head_dim"))),
    implied={"mlp_type": "plain", "use_qk_norm": True},
    # (no `head_dim` field: its attention reads one from config.json, hidden / heads without)
    to_archlab=head_dim_given,
    from_archlab=head_dim_to_write,
    expressible=frozenset({"head_dim"}),
    layout=Layout(
        to_archlab=lambda state_dict, config: renamed(state_dict, APERTUS_NORMS),
        from_archlab=lambda state_dict, config: renamed(state_dict, APERTUS_NORMS, back=True),
    ),
)

LLAMA_LIKE_FAMILIES = (CWM, ERNIE4_5, ERNIE4_5_MOE, JAIS2, NEMOTRON, INTERNLM3, IQUESTCODER, EXAONE, APERTUS)

__all__ = [
    "CWM",
    "ERNIE4_5",
    "ERNIE4_5_MOE",
    "EXAONE",
    "INTERNLM3",
    "IQUESTCODER",
    "JAIS2",
    "LLAMA_LIKE_FAMILIES",
    "NEMOTRON",
]
