"""Position information other than RoPE (seed 000 §5.2 "position encoding"; seed 001 "positional encoding").

Two kinds, resolved once from `position_embedding_type` in the model's `__init__` (see `POSITION_EMBEDDINGS`):

- absolute embeddings added to the token embeddings (`embed_positions(position_ids)` -> (B, T, d)):
  `LearnedPositionEmbedding` (GPT/OPT; rows beyond the training length are never trained) and the fixed
  sinusoid of Vaswani et al. (`SinusoidalPositionalEmbedding` from `sinusoidal.py`, paper layout);
- additive attention biases (`position_bias(query_positions, key_positions)` -> (1, H, Tq, Tk)), shared by all
  layers and handed to the attention kernel: `ALiBiBias` here (Press et al. 2022, "Train Short, Test Long") and
  the T5 bucketed relative bias in `relative_bias.py`.

"rope" is handled by `rotary.py`; "none" adds nothing (NoPE: causal masking alone leaks order).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .relative_bias import RelativePositionBias
from .sinusoidal import SinusoidalPositionalEmbedding, check_position_ids


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """Head-specific slopes m_h: the geometric sequence 2^(-8h/n) for n a power of two; otherwise the sequence of
    the closest lower power of two, followed by every other slope of the next power (Press et al. 2022, as BLOOM)."""
    closest = 2 ** math.floor(math.log2(num_heads))
    base = 2.0 ** (-(2.0 ** -(math.log2(closest) - 3)))
    slopes = base ** torch.arange(1, closest + 1, dtype=torch.float64)
    if closest != num_heads:
        extra_base = 2.0 ** (-(2.0 ** -(math.log2(2 * closest) - 3)))
        remaining = min(closest, num_heads - closest)
        extra = extra_base ** torch.arange(1, 2 * remaining + 1, 2, dtype=torch.float64)
        slopes = torch.cat([slopes, extra])
    return slopes.float()


class ALiBiBias(nn.Module):
    """bias[h, i, j] = -m_h · |i - j|: attention decays linearly with distance, no parameters.

    Only the distance enters, so the bias is the same for any absolute offset and the model runs (and, per the paper,
    keeps its perplexity) past the training length. For causal attention only j <= i survives the mask, where this
    equals BLOOM's `m_h · j` up to a per-row constant that softmax cancels; the |i - j| form is also right for the
    bidirectional part of prefix-LM and for encoders.
    """

    slopes: torch.Tensor

    def __init__(self, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.register_buffer("slopes", alibi_slopes(num_heads), persistent=False)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        self.slopes.copy_(alibi_slopes(self.num_heads).to(self.slopes.device))

    def forward(self, query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
        distance = (query_positions[:, None] - key_positions[None, :]).abs().float()  # (Tq, Tk)
        return -(self.slopes[:, None, None] * distance).unsqueeze(0)  # (1, H, Tq, Tk)


class LearnedPositionEmbedding(nn.Embedding):
    """A trained (max_position_embeddings, d) table looked up by position id (GPT-2's `wpe`, OPT, GPT-3).

    It has no row past the training length: longer sequences are refused with a ValueError naming
    `max_position_embeddings` (not an index error inside the lookup).
    """

    def __init__(self, num_positions: int, dim: int) -> None:
        super().__init__(num_positions, dim)

    def forward(self, position_ids: torch.Tensor) -> torch.Tensor:
        check_position_ids(position_ids, self.num_embeddings, "learned")
        return super().forward(position_ids)


def make_absolute_position_embedding(config) -> nn.Module | None:
    """The module added to the token embeddings, or None."""
    kind = config.position_embedding_type
    if kind == "learned":
        return LearnedPositionEmbedding(config.max_position_embeddings, config.hidden_size)
    if kind == "sinusoidal":
        # Not trained and fully determined by the config: kept out of checkpoints.
        return SinusoidalPositionalEmbedding(
            config.max_position_embeddings, config.hidden_size, layout="interleaved", persistent=False
        )
    return None


def make_position_bias(config) -> nn.Module | None:
    """The attention-bias module shared by all layers, or None."""
    kind = config.position_embedding_type
    if kind == "alibi":
        return ALiBiBias(config.num_attention_heads)
    if kind == "relative_bias":
        return RelativePositionBias(
            config.num_attention_heads,
            num_buckets=config.relative_attention_num_buckets,
            max_distance=config.relative_attention_max_distance,
            bidirectional=config.prefix_lm,  # prefix-LM has keys after the query inside the prefix
        )
    return None


# position_embedding_type -> (adds to embeddings, rotates q/k, biases attention scores)
POSITION_EMBEDDINGS: dict[str, tuple[bool, bool, bool]] = {
    "rope": (False, True, False),
    "alibi": (False, False, True),
    "relative_bias": (False, False, True),
    "learned": (True, False, False),
    "sinusoidal": (True, False, False),
    "none": (False, False, False),
}

__all__ = [
    "ALiBiBias",
    "LearnedPositionEmbedding",
    "POSITION_EMBEDDINGS",
    "alibi_slopes",
    "make_absolute_position_embedding",
    "make_position_bias",
]
