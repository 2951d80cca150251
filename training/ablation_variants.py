"""The ablation study's variants: the LLaMA-recipe baseline (`base_config`, a byte-level decoder) and each variant's
config fields, warm-up and the claim it tests; and the settings a study runs with."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

VOCAB = 256  # bytes


@dataclass
class Variant:
    config: dict[str, Any] = field(default_factory=dict)  # DecoderConfig overrides of the baseline
    warmup: bool = True  # linear warm-up over `--warmup_steps`, else full learning rate from step 0
    claim: str = ""


VARIANTS: dict[str, Variant] = {
    "baseline": Variant(claim="LLaMA recipe: pre-RMSNorm, RoPE, SwiGLU (8/3·d), MHA"),
    "layer_norm": Variant(dict(norm_type="layer_norm"), claim="RMSNorm is faster than LayerNorm at equal quality"),
    "baseline_no_warmup": Variant(warmup=False, claim="pre-norm trains without warm-up"),
    "post_norm": Variant(dict(norm_position="post"), claim="post-norm needs warm-up"),
    "post_norm_no_warmup": Variant(dict(norm_position="post"), warmup=False, claim="post-norm without warm-up"),
    "deepnorm_no_warmup": Variant(dict(norm_position="deepnorm"), warmup=False, claim="DeepNorm stabilises post-norm"),
    "sandwich_norm": Variant(dict(norm_position="sandwich"), claim="sandwich norm (Gemma2)"),
    "parallel_block": Variant(dict(norm_position="parallel"), claim="parallel block: faster, little quality loss"),
    "output_norm": Variant(
        dict(norm_position="output"), claim="output norms (OLMo 2's reordered norm) train as well as pre-norm"
    ),
    "gelu_mlp": Variant(
        dict(mlp_type="plain", hidden_act="gelu", intermediate_size=None, mlp_width_rule="4d"),
        claim="gated FFNs beat plain ones at equal parameters",
    ),
    "relu_mlp": Variant(
        dict(mlp_type="plain", hidden_act="relu", intermediate_size=None, mlp_width_rule="4d"),
        claim="gated FFNs beat plain ones at equal parameters",
    ),
    "geglu": Variant(dict(hidden_act="gelu_pytorch_tanh"), claim="GeGLU ≈ SwiGLU"),
    "alibi": Variant(dict(position_embedding_type="alibi"), claim="ALiBi extrapolates past L"),
    "learned_positions": Variant(dict(position_embedding_type="learned"), claim="learned positions cannot extrapolate"),
    "sinusoidal": Variant(dict(position_embedding_type="sinusoidal"), claim="sinusoidal extrapolates poorly"),
    "t5_relative_bias": Variant(dict(position_embedding_type="relative_bias"), claim="relative bias extrapolates"),
    "no_positions": Variant(dict(position_embedding_type="none"), claim="NoPE: causal mask alone"),
    "gqa_2kv": Variant(dict(num_key_value_heads=2), claim="GQA shrinks the KV cache, little quality loss"),
    "mqa": Variant(dict(num_key_value_heads=1), claim="MQA shrinks the KV cache most"),
    "qk_norm_z_loss": Variant(dict(use_qk_norm=True, lm_z_loss_coef=1e-4), claim="stability tricks cost nothing"),
    "qk_norm_over_projection": Variant(
        dict(use_qk_norm=True, qk_norm_scope="projection"),
        claim="QK-norm over the whole projection (OLMo 2) costs nothing",
    ),
    "qk_norm_per_head_gains": Variant(
        dict(use_qk_norm=True, qk_norm_scope="per_head"),
        claim="QK-norm with a gain per head (Cohere's Command R+) costs nothing",
    ),
    "gated_attention": Variant(
        dict(attention_output_gate="elementwise"),
        claim="a sigmoid gate on the heads' output before o_proj (Qiu et al. 2025) lowers the loss",
    ),
    "gated_attention_headwise": Variant(
        dict(attention_output_gate="headwise"),
        claim="one gate per head keeps most of the elementwise gate's gain at 1/head_dim of its parameters",
    ),
}


class AblationSettings(Protocol):
    """The flags of `scripts/ablate.py` (an `argparse.Namespace`), or any object with these attributes."""

    variant_names: list[str]
    dataset_name: str | None
    text_column: str
    steps: int
    warmup_steps: int
    batch_size: int
    seq_len: int
    hidden_size: int
    layers: int
    lr: float
    decode_tokens: int
    corpus_bytes: int
    seed: int
    paired_speed: bool


def base_config(args: AblationSettings) -> dict[str, Any]:
    return dict(
        vocab_size=VOCAB,
        hidden_size=args.hidden_size,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=None,
        mlp_width_rule="8/3d",
        mlp_width_multiple_of=8,
        max_position_embeddings=4 * args.seq_len,
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
        tie_word_embeddings=True,
        lm_loss_chunk_size=0,
    )
