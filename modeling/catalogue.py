"""The architecture catalogue as data: every variant a config string can name, and what it means (seed 000 §5.2;
seed 004). Both config classes validate against these registries and both model families build from them; the
model code keys its own module registries (`normalization.NORMS`, `blocks.BLOCKS`, `feed_forward.MLPS`,
`positions.POSITION_MODULES`) by exactly these names, which a test checks.

This module holds names and properties only, no model code, so importing a config imports no `nn.Module`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PositionScheme:
    """What a `position_embedding_type` adds to the model (at most one of the three)."""

    table: bool = False  # absolute embeddings added to the token embeddings, looked up by position id
    rotary: bool = False  # rotates queries and keys by position (RoPE)
    bias: bool = False  # an additive bias on the attention scores, from query/key distances
    trained: bool = False  # has parameters


POSITION_SCHEMES: dict[str, PositionScheme] = {
    "rope": PositionScheme(rotary=True),  # Su et al. 2021; Llama
    "alibi": PositionScheme(bias=True),  # Press et al. 2022; BLOOM, MPT
    "relative_bias": PositionScheme(bias=True, trained=True),  # T5's bucketed bias
    "learned": PositionScheme(table=True, trained=True),  # GPT-2, OPT, BERT
    "sinusoidal": PositionScheme(table=True),  # Vaswani et al. 2017
    "none": PositionScheme(),  # NoPE: causal masking alone leaks order
}
# The schemes the encoder-decoder implements.
SEQ2SEQ_POSITION_SCHEMES = ("sinusoidal", "learned", "relative_bias", "none")

# offset: the gain stored as w of (1 + w) (Gemma's RMSNorm, Nemotron's LayerNorm1P)
NORM_TYPES = ("rms_norm", "offset_rms_norm", "layer_norm", "offset_layer_norm")
LAYER_NORM_TYPES = ("layer_norm", "offset_layer_norm")  # a bias by default
OFFSET_NORM_TYPES = ("offset_rms_norm", "offset_layer_norm")  # the gain stored as w of (1 + w)

# Where the norms sit around a layer's sub-layers (blocks.py for the decoder, seq2seq_layers.py for the stacks).
DECODER_NORM_POSITIONS = ("pre", "post", "sandwich", "parallel", "parallel_shared_norm", "deepnorm", "output")
SEQ2SEQ_NORM_POSITIONS = ("post", "pre", "sandwich")
# How the encoder-decoder's teacher forcing makes `decoder_input_ids` from `labels`: behind `decoder_start_token_id`
# (Marian, Bart, T5), or behind each row's last real label token, wrapped to the front (mBART: the target language).
LABEL_SHIFTS = ("decoder_start_token", "wrap_last_token")

# What QK-norm normalises: each head's queries and keys with one gain the heads share (Qwen3, Gemma3), the whole q and
# k projections before they are split into heads (OLMo 2; one gain per channel of the projection), or each head with
# a gain of its own (Command R+, StableLM 2 12B: gains of (heads, head_dim)).
QK_NORM_SCOPES = ("head", "projection", "per_head")

MLP_TYPES = ("gated", "plain")  # act(gate x) ⊙ up x (SwiGLU, GeGLU) | act(up x) (ReLU/GELU FFN)
MLP_LAYER_TYPES = ("dense", "sparse")  # per-layer feed-forward: one MLP, or a mixture of experts
# A sigmoid gate on the attention's output before the output projection, from the layer's input (Qiu et al. 2025,
# "Gated Attention for Large Language Models"; AFMoE, Qwen3-Next): one gate per channel of each head, or one per head
ATTENTION_OUTPUT_GATES = ("elementwise", "headwise")
# How a router scores the experts: a softmax over them (Mixtral, Qwen2-MoE) or a sigmoid each (DeepSeek-V3, GLM-4.5)
ROUTER_SCORE_FUNCTIONS = ("softmax", "sigmoid")
# How group-limited routing scores a group of experts: the sum of its two best (DeepSeek-V3, GLM-4.5) or its best one
# (DeepSeek-V2's "group_limited_greedy")
ROUTER_GROUP_SCORES = ("top2_sum", "max")
# per-layer attention span: every key, the last `sliding_window` (Mistral, Gemma2), or the keys of the query's own
# block of `attention_chunk_size` positions (Llama 4's chunked attention)
LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")
SINUSOIDAL_LAYOUTS = ("interleaved", "split")  # the paper's sin/cos per pair | Marian's sines then cosines

# `intermediate_size` when it is None: ratio · d rounded up to `mlp_width_multiple_of`.
MLP_WIDTH_RULES: dict[str, float] = {"4d": 4.0, "8/3d": 8.0 / 3.0}


def intermediate_size_from_rule(hidden_size: int, rule: str, multiple_of: int = 256) -> int:
    """ceil(ratio · d / multiple) · multiple, ratio 4 ("4d") or 8/3 ("8/3d", the gated FFNs' equal-parameter width)."""
    if rule not in MLP_WIDTH_RULES:
        raise ValueError(
            f"`mlp_width_rule`={rule!r} is not supported; allowed values: {', '.join(map(repr, MLP_WIDTH_RULES))}."
        )
    width = int(MLP_WIDTH_RULES[rule] * hidden_size + 0.5) if rule == "4d" else -(-8 * hidden_size // 3)
    return -(-width // multiple_of) * multiple_of


__all__ = [
    "ATTENTION_OUTPUT_GATES",
    "DECODER_NORM_POSITIONS",
    "LABEL_SHIFTS",
    "LAYER_TYPES",
    "MLP_LAYER_TYPES",
    "MLP_TYPES",
    "MLP_WIDTH_RULES",
    "NORM_TYPES",
    "LAYER_NORM_TYPES",
    "OFFSET_NORM_TYPES",
    "POSITION_SCHEMES",
    "PositionScheme",
    "QK_NORM_SCOPES",
    "ROUTER_GROUP_SCORES",
    "ROUTER_SCORE_FUNCTIONS",
    "SEQ2SEQ_NORM_POSITIONS",
    "SEQ2SEQ_POSITION_SCHEMES",
    "SINUSOIDAL_LAYOUTS",
    "intermediate_size_from_rule",
]
