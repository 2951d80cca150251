"""The decoder layer in each norm placement, chosen by `norm_position` (seed 000 §5.2 "normalization position";
seed 004 "pre- vs post-norm", "parallel layers").

    pre       x + Attn(N(x)); then h + MLP(N(h)); final norm after the stack      (GPT-2, LLaMA)
    post      N(x + Attn(x)); then N(h + MLP(h)); no final norm                   (Vaswani et al., BERT, Marian)
    sandwich  x + N(Attn(N(x))); then h + N(MLP(N(h))); final norm                (CogView, Gemma2)
    parallel  x + Attn(N1(x)) + MLP(N2(x)); final norm                            (GPT-NeoX, Falcon-40B)
    parallel_shared_norm  x + Attn(N(x)) + MLP(N(x)): one norm for both; final norm  (GPT-J, Falcon-7B, Phi)
    deepnorm  N(α·x + Attn(x)); then N(α·h + MLP(h)); Attn/MLP init scaled by β  (DeepNet, GLM-130B)
    output    x + N(Attn(x)); then h + N(MLP(h)); final norm                      (OLMo 2, Swin Transformer V2)

In each, a sub-layer's output joins the residual stream times `residual_multiplier` where that is not 1 (Granite's
μP constant: x + m·Attn(N(x)); after the norm of a sandwich or output-norm block, before the post-norm's).

`output` is the OLMo 2 report's (2024) "reordered norm" (Swin Transformer V2's res-post-norm): the sandwich block
without its input norms, each sub-layer's output normed before it joins the residual stream, which itself is never
normed until the final norm.

Norm parameter names are Llama's and Gemma2's (`input_layernorm`, `post_attention_layernorm`,
`pre_feedforward_layernorm`, `post_feedforward_layernorm`); in the post-norm blocks the norm after the MLP is
`post_feedforward_layernorm`, and the output-norm block's two norms carry the sandwich block's (and OLMo 2's) names
of the norms after its sub-layers, `post_attention_layernorm` and `post_feedforward_layernorm`. Each block's `mlp` is
a sub-module built by `build_mlp`, so a layer can be dense or a mixture of experts without a block subclass per
combination.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.cache_utils import Cache
from transformers.modeling_layers import GradientCheckpointingLayer

from .attention import Attention
from .bitlinear import linear_class
from .decode_block import fused_block_applies, fused_block_forward
from .feed_forward import mlp_from_config
from .latent_attention import LatentAttention
from .moe import SparseMoeBlock
from .normalization import make_norm


def build_mlp(config, layer_idx: int) -> nn.Module:
    """The feed-forward sub-module of layer `layer_idx` (`mlp_type`, `hidden_act`, `intermediate_size`); a
    mixture of experts where `mlp_layer_types[layer_idx]` is "sparse" (see moe.py)."""
    if config.mlp_layer_types[layer_idx] == "sparse":
        return SparseMoeBlock(config)
    sub_norm = getattr(config, "sub_layer_norm", False)
    return mlp_from_config(config, config.intermediate_size, sub_norm=sub_norm, linear=linear_class(config))


def norm_from_config(config) -> nn.Module:
    """The config's norm over the model width (`norm_type`, `rms_norm_eps`, `norm_bias`)."""
    return make_norm(config.norm_type, config.hidden_size, config.rms_norm_eps, config.norm_bias)


def deepnorm_constants(config) -> tuple[float, float]:
    """(α, β) of DeepNet for a decoder-only stack of N layers: α = (2N)^(1/4), β = (8N)^(-1/4), unless given."""
    n = config.num_hidden_layers
    alpha = config.deepnorm_alpha if config.deepnorm_alpha is not None else (2 * n) ** 0.25
    beta = config.deepnorm_beta if config.deepnorm_beta is not None else (8 * n) ** -0.25
    return alpha, beta


class DecoderBlock(GradientCheckpointingLayer):
    """Attention + MLP of one layer; subclasses add the norms and say how they are wired."""

    has_final_norm: bool = True  # whether the stack needs a norm after its last layer

    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        self.attention_type = config.layer_types[layer_idx] if config.layer_types else "full_attention"
        self.rotates = layer_idx not in (getattr(config, "nope_layers", None) or ())  # False: a NoPE layer
        # multi-head latent attention with `kv_lora_rank` (DeepSeek-V2/V3), else q/k/v heads
        attention_class = LatentAttention if getattr(config, "kv_lora_rank", None) is not None else Attention
        self.self_attn = attention_class(config, layer_idx, is_causal=True)
        self.mlp = build_mlp(config, layer_idx)
        # each sub-layer's output times this before it joins the residual stream (Granite, μP); 1.0: untouched
        self.residual_multiplier = float(getattr(config, "residual_multiplier", 1.0))

    def scaled(self, branch: torch.Tensor) -> torch.Tensor:
        """A sub-layer's output as it joins the residual stream: times `residual_multiplier` where that is not 1."""
        return branch if self.residual_multiplier == 1.0 else branch * self.residual_multiplier

    def attend(self, hidden_states, attention_mask, position_embeddings, past_key_values, **kwargs):
        return self.self_attn(
            hidden_states,
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
            past_key_values=past_key_values,
            **kwargs,
        )


class PreNormBlock(DecoderBlock):
    # how decode_block.py's fused step wires the MLP: after the attention's residual, through this norm
    parallel = False
    mlp_norm_name = "post_attention_layernorm"

    def __init__(self, config, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.input_layernorm = norm_from_config(config)
        self.post_attention_layernorm = norm_from_config(config)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        past_key_values: Cache | None = None,
        position_bias: torch.Tensor | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if fused_block_applies(self, hidden_states):  # a decoding step: norms and residuals inside the GEMVs
            return fused_block_forward(
                self,
                hidden_states,
                attention_mask,
                position_embeddings,
                past_key_values,
                position_bias=position_bias,
                **kwargs,
            )
        attn_out, weights = self.attend(
            self.input_layernorm(hidden_states),
            attention_mask,
            position_embeddings,
            past_key_values,
            position_bias=position_bias,
            **kwargs,
        )
        hidden_states = hidden_states + self.scaled(attn_out)
        hidden_states = hidden_states + self.scaled(self.mlp(self.post_attention_layernorm(hidden_states)))
        return hidden_states, weights


class PostNormBlock(DecoderBlock):
    has_final_norm = False

    def __init__(self, config, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.post_attention_layernorm = norm_from_config(config)
        self.post_feedforward_layernorm = norm_from_config(config)
        self.residual_scale = 1.0

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        past_key_values: Cache | None = None,
        position_bias: torch.Tensor | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        attn_out, weights = self.attend(
            hidden_states, attention_mask, position_embeddings, past_key_values, position_bias=position_bias, **kwargs
        )
        hidden_states = self.post_attention_layernorm(hidden_states * self.residual_scale + self.scaled(attn_out))
        mlp_out = self.scaled(self.mlp(hidden_states))
        hidden_states = self.post_feedforward_layernorm(hidden_states * self.residual_scale + mlp_out)
        return hidden_states, weights


class DeepNormBlock(PostNormBlock):
    """Post-norm with the residual up-weighted by α, and DeepNet's init: Xavier-normal with gain β for v/o and the
    MLP, gain 1 for q/k. The gains are tagged on the linear layers (`deepnorm_gain`) and applied by the model's
    `_init_weights`, which skips weights loaded from a checkpoint. Latent attention's value expansion (`kv_b_proj`,
    which expands the keys too) takes v's gain, its latents q's and k's."""

    def __init__(self, config, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.residual_scale, beta = deepnorm_constants(config)
        attn = self.self_attn
        if isinstance(attn, LatentAttention):
            queries = ("q_proj",) if attn.q_lora_rank is None else ("q_a_proj", "q_b_proj")
            gains = [*((name, 1.0) for name in (*queries, "kv_a_proj_with_mqa")), ("kv_b_proj", beta), ("o_proj", beta)]
        else:
            gains = [("q_proj", 1.0), ("k_proj", 1.0), ("v_proj", beta), ("o_proj", beta)]
        for name, gain in gains:
            getattr(attn, name).deepnorm_gain = gain
        for module in self.mlp.modules():
            if isinstance(module, nn.Linear):
                module.deepnorm_gain = beta


class SandwichNormBlock(DecoderBlock):
    def __init__(self, config, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.input_layernorm = norm_from_config(config)
        self.post_attention_layernorm = norm_from_config(config)
        self.pre_feedforward_layernorm = norm_from_config(config)
        self.post_feedforward_layernorm = norm_from_config(config)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        past_key_values: Cache | None = None,
        position_bias: torch.Tensor | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        attn_out, weights = self.attend(
            self.input_layernorm(hidden_states),
            attention_mask,
            position_embeddings,
            past_key_values,
            position_bias=position_bias,
            **kwargs,
        )
        hidden_states = hidden_states + self.scaled(self.post_attention_layernorm(attn_out))
        mlp_out = self.mlp(self.pre_feedforward_layernorm(hidden_states))
        hidden_states = hidden_states + self.scaled(self.post_feedforward_layernorm(mlp_out))
        return hidden_states, weights


class OutputNormBlock(DecoderBlock):
    """Each sub-layer reads the residual stream as it is and its output is normed before the add (OLMo 2). A
    decoding step runs this forward: decode_block.py's fused step puts a norm before a product, not after it."""

    def __init__(self, config, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.post_attention_layernorm = norm_from_config(config)
        self.post_feedforward_layernorm = norm_from_config(config)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        past_key_values: Cache | None = None,
        position_bias: torch.Tensor | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        attn_out, weights = self.attend(
            hidden_states, attention_mask, position_embeddings, past_key_values, position_bias=position_bias, **kwargs
        )
        hidden_states = hidden_states + self.scaled(self.post_attention_layernorm(attn_out))
        hidden_states = hidden_states + self.scaled(self.post_feedforward_layernorm(self.mlp(hidden_states)))
        return hidden_states, weights


class ParallelBlock(DecoderBlock):
    """Attention and MLP read the same input: one residual add, and the two input GEMMs could be fused."""

    parallel = True  # (decode_block.py's fused step)
    mlp_norm_name = "post_attention_layernorm"

    def __init__(self, config, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.input_layernorm = norm_from_config(config)
        self.post_attention_layernorm = norm_from_config(config)  # GPT-NeoX's name for the MLP's input norm

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        past_key_values: Cache | None = None,
        position_bias: torch.Tensor | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if fused_block_applies(self, hidden_states):  # a decoding step: norms and residuals inside the GEMVs
            return fused_block_forward(
                self,
                hidden_states,
                attention_mask,
                position_embeddings,
                past_key_values,
                position_bias=position_bias,
                **kwargs,
            )
        attn_out, weights = self.attend(
            self.input_layernorm(hidden_states),
            attention_mask,
            position_embeddings,
            past_key_values,
            position_bias=position_bias,
            **kwargs,
        )
        mlp_out = self.mlp(self.post_attention_layernorm(hidden_states))
        return hidden_states + self.scaled(attn_out) + self.scaled(mlp_out), weights


class SharedNormParallelBlock(DecoderBlock):
    """The parallel block with one norm whose output both the attention and the MLP read."""

    parallel = True  # (decode_block.py's fused step: the norm computed inside each of the two input GEMVs)
    mlp_norm_name = "input_layernorm"

    def __init__(self, config, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.input_layernorm = norm_from_config(config)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        past_key_values: Cache | None = None,
        position_bias: torch.Tensor | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if fused_block_applies(self, hidden_states):  # a decoding step: norms and residuals inside the GEMVs
            return fused_block_forward(
                self,
                hidden_states,
                attention_mask,
                position_embeddings,
                past_key_values,
                position_bias=position_bias,
                **kwargs,
            )
        normed = self.input_layernorm(hidden_states)
        attn_out, weights = self.attend(
            normed, attention_mask, position_embeddings, past_key_values, position_bias=position_bias, **kwargs
        )
        return hidden_states + self.scaled(attn_out) + self.scaled(self.mlp(normed)), weights


BLOCKS: dict[str, type[DecoderBlock]] = {
    "pre": PreNormBlock,
    "post": PostNormBlock,
    "sandwich": SandwichNormBlock,
    "parallel": ParallelBlock,
    "parallel_shared_norm": SharedNormParallelBlock,
    "deepnorm": DeepNormBlock,
    "output": OutputNormBlock,
}

__all__ = [
    "BLOCKS",
    "DecoderBlock",
    "DeepNormBlock",
    "OutputNormBlock",
    "ParallelBlock",
    "PostNormBlock",
    "PreNormBlock",
    "SandwichNormBlock",
    "SharedNormParallelBlock",
    "build_mlp",
    "deepnorm_constants",
    "norm_from_config",
]
