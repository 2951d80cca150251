"""RoPE over interleaved channel pairs (GPT-J, Helium, Meta's original Llama checkpoints) as archlab's rotate-half RoPE:
the same function once the query and key projections' rows are reordered.

Interleaved RoPE (Su et al. 2021's formulation, GPT-J's `rotate_every_two`) rotates the channel pairs (2i, 2i + 1) of
each head by the angle of frequency i; rotate-half RoPE (GPT-NeoX's, Llama's, archlab's) rotates the pairs
(i, i + R/2), R the rotary dimension. An attention score is the dot product of a query head and a key head, which does
not change when both have their channels permuted alike: so a model whose q and k rows are reordered
[0, 2, 4, ..., R - 2, 1, 3, ..., R - 1] within the first R channels of each head computes, with rotate-half RoPE, what
the stock model computes with interleaved RoPE — the permutation transformers' own Llama converter applies to Meta's
checkpoints. The channels past R (partial rotary: GPT-J rotates 64 of 256) stay where they are, and the values are
untouched; a QK-norm's gains (and biases) per head channel are permuted alike. Exporting applies the inverse
permutation. `interleaved_rope` wraps a family's `Layout` with it.
"""

from __future__ import annotations

import re

import torch
from transformers import PreTrainedConfig

from .family import Layout, StateDict

# archlab's query and key projections, whose rows (and biases) are permuted
PROJECTIONS = re.compile(r"^model\.layers\.\d+\.self_attn\.(?P<proj>q_proj|k_proj)\.(weight|bias)$")
# their QK-norms' gains and biases, per channel of a head ((head_dim,); (heads, head_dim) with a gain per head; heads ·
# head_dim over a projection), which follow the channels (a head's or a projection's statistics do not change when the
# channels are permuted)
QK_NORMS = re.compile(r"^model\.layers\.\d+\.self_attn\.(?P<norm>q_norm|k_norm)\.(weight|bias)$")


def rotate_half_order(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """Channel j of a head in rotate-half order is channel `order[j]` in interleaved order."""
    pairs = torch.arange(rotary_dim).view(rotary_dim // 2, 2)
    return torch.cat([pairs[:, 0], pairs[:, 1], torch.arange(rotary_dim, head_dim)])


def permute_heads(tensor: torch.Tensor, head_dim: int, rotary_dim: int, inverse: bool = False) -> torch.Tensor:
    """The rows of a projection's weight (or bias) of heads × `head_dim` rows, each head's channels reordered from
    interleaved to rotate-half order (`inverse`: back)."""
    order = rotate_half_order(head_dim, rotary_dim)
    if inverse:
        order = torch.argsort(order)
    heads = tensor.shape[0] // head_dim
    rows = tensor.reshape(heads, head_dim, *tensor.shape[1:])
    return rows[:, order].reshape(tensor.shape)


def rotary_dimension(config: PreTrainedConfig) -> int:
    """The channels of each head RoPE rotates: `head_dim` × `partial_rotary_factor` (one flat parameter set)."""
    partial = config.rope_parameters.get("partial_rotary_factor", 1.0)
    return int(config.head_dim * partial)


def _permuted(state_dict: StateDict, config: PreTrainedConfig, inverse: bool) -> StateDict:
    rotary_dim = rotary_dimension(config)
    out = {}
    for name, tensor in state_dict.items():
        if PROJECTIONS.match(name):
            tensor = permute_heads(tensor, config.head_dim, rotary_dim, inverse)
        elif QK_NORMS.match(name):  # (any scope: a gain per channel of each head, of all heads, or shared)
            flat = permute_heads(tensor.reshape(-1), config.head_dim, rotary_dim, inverse)
            tensor = flat.reshape(tensor.shape)
        out[name] = tensor
    return out


def interleaved_rope(layout: Layout) -> Layout:
    """`layout` with the query and key rows permuted after importing and before exporting (module docstring)."""

    def to_archlab(state_dict: StateDict, config: PreTrainedConfig) -> StateDict:
        return _permuted(layout.to_archlab(state_dict, config), config, inverse=False)

    def from_archlab(state_dict: StateDict, config: PreTrainedConfig) -> StateDict:
        return layout.from_archlab(_permuted(state_dict, config, inverse=True), config)

    return Layout(to_archlab, from_archlab)


__all__ = ["interleaved_rope", "permute_heads", "rotate_half_order", "rotary_dimension"]
