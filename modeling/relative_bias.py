"""T5's bucketed relative position bias (Raffel et al. 2020, §2.1; seed 000 §5.2 "relative position encoding").

Each (query, key) pair gets a learned scalar per head, indexed by a bucket of the signed distance key - query:
half the buckets hold exact small distances, the rest cover distances up to `max_distance` logarithmically, and
everything farther shares the last bucket. `bidirectional=True` (encoders, the prefix of a prefix-LM) spends half
of the buckets on keys after the query; `bidirectional=False` (causal decoders) maps every future key to bucket 0,
where the causal mask removes it anyway.

The module takes explicit sizes, not a config, so the decoder (one bias shared by all layers) and a T5-style
encoder-decoder (one per stack, bidirectional in the encoder, causal in the decoder; or one per layer, as UMT5 of
Chung et al. 2023) build it the same way.
The parameter is named `relative_attention_bias` as in T5, of shape (num_buckets, num_heads).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .validation import check_relative_buckets


def relative_position_bucket(
    relative_position: torch.Tensor, bidirectional: bool, num_buckets: int, max_distance: int
) -> torch.Tensor:
    """Bucket index in [0, num_buckets) of each signed distance (key - query)."""
    buckets = torch.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (relative_position > 0).long() * num_buckets  # keys after the query: upper half
        distance = relative_position.abs()
    else:
        distance = (-relative_position).clamp(min=0)  # only the past has a distance; the future collapses to 0
    max_exact = num_buckets // 2
    is_small = distance < max_exact
    # log-spaced buckets between max_exact and max_distance (clamp avoids log(0) on the small ones, unused there)
    log_ratio = torch.log(distance.float().clamp(min=1) / max_exact) / math.log(max_distance / max_exact)
    large = (max_exact + (log_ratio * (num_buckets - max_exact)).long()).clamp(max=num_buckets - 1)
    return buckets + torch.where(is_small, distance, large)


def position_buckets(
    query_positions: torch.Tensor, key_positions: torch.Tensor, bidirectional: bool, num_buckets: int, max_distance: int
) -> torch.Tensor:
    """(Tq, Tk) bucket index of every (query, key) pair of positions."""
    relative = key_positions[None, :].long() - query_positions[:, None].long()  # (Tq, Tk)
    return relative_position_bucket(relative, bidirectional, num_buckets, max_distance)


class RelativePositionBias(nn.Module):
    """bias(query_positions, key_positions) -> (1, H, Tq, Tk) additive attention scores."""

    def __init__(self, num_heads: int, num_buckets: int = 32, max_distance: int = 128, bidirectional: bool = False):
        super().__init__()
        check_relative_buckets(num_buckets, max_distance, bidirectional)
        self.num_heads = num_heads
        self.num_buckets = num_buckets
        self.max_distance = max_distance
        self.bidirectional = bidirectional
        self.relative_attention_bias = nn.Embedding(num_buckets, num_heads)

    def buckets(self, query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
        """(Tq, Tk) bucket indices; the same for every table of one stack, so UMT5-style stacks compute them once."""
        return position_buckets(query_positions, key_positions, self.bidirectional, self.num_buckets, self.max_distance)

    def lookup(self, buckets: torch.Tensor) -> torch.Tensor:
        """(Tq, Tk) bucket indices -> (1, H, Tq, Tk) bias."""
        bias = self.relative_attention_bias(buckets).permute(2, 0, 1).unsqueeze(0)
        # `torch.onnx.export` (torch 2.13) fails on an SDPA mask that requires grad ("Cannot view a tensor with
        # shape ... as a tensor with shape ..." at its decomposition step); an ONNX graph has no gradients anyway
        return bias.detach() if torch.onnx.is_in_onnx_export() else bias

    def forward(self, query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
        return self.lookup(self.buckets(query_positions, key_positions))

    def extra_repr(self) -> str:
        return (
            f"heads={self.num_heads}, buckets={self.num_buckets}, max_distance={self.max_distance}, "
            f"bidirectional={self.bidirectional}"
        )


__all__ = ["RelativePositionBias", "position_buckets", "relative_position_bucket"]
