"""The modules of each position scheme, for both families (seed 000 §5.2 "position encoding"; seed 001
"positional encoding"). `catalogue.POSITION_SCHEMES` says what a `position_embedding_type` adds; the factories here
build it, once, in the model's `__init__`:

- a table (`position_table`): absolute embeddings added to the token embeddings (`embed_positions(position_ids)`
  -> (B, T, d)): `LearnedPositionEmbedding` (GPT/OPT; rows beyond the training length are never trained) and the
  fixed sinusoid of Vaswani et al. (`SinusoidalPositionalEmbedding` in `sinusoidal.py`);
- a bias (`position_bias`): additive attention scores (`bias(query_positions, key_positions)` -> (1, H, Tq, Tk))
  handed to the attention kernel: `ALiBiBias` here (Press et al. 2022, "Train Short, Test Long") and T5's bucketed
  relative bias (`relative_bias.py`);
- a rotation: "rope" is `rotary.RotaryEmbedding`, built by the decoder. "none" adds nothing (NoPE: causal masking
  alone leaks order).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from .catalogue import POSITION_SCHEMES
from .relative_bias import RelativePositionBias
from .sinusoidal import CHECKED_PER_FORWARD, SinusoidalPositionalEmbedding, check_position_ids


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
    bidirectional part of prefix-LM and for encoders. The distance counts columns, as MPT's does: BLOOM counts only
    the attended keys (`attention_mask.cumsum(-1) - 1`), which differs where a row's mask has zeros between attended
    tokens (docs/conversion.md, "Positions and padding").
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
    `max_position_embeddings` (not an index error inside the lookup). `offset` extra leading rows are looked up at
    position + offset (OPT's and Bart's tables have 2); a padding position numbered -1 (positions counted from the
    attention mask) reads row offset - 1, or row 0. (Negative ids a caller passes are refused before they get here:
    `check_given_position_ids`.)
    """

    def __init__(self, num_positions: int, dim: int, offset: int = 0) -> None:
        super().__init__(num_positions + offset, dim)
        self.num_positions, self.offset = num_positions, offset

    def forward(self, position_ids: torch.Tensor) -> torch.Tensor:
        check_position_ids(position_ids, self.num_positions, "learned")
        return super().forward((position_ids + self.offset).clamp(min=0))


def check_given_position_ids(position_ids: torch.Tensor, table: nn.Module, rows: bool = False) -> None:
    """`position_ids` a caller passes, checked before an absolute position table (learned or sinusoidal) reads them:
    none below 0. A stock table (an `nn.Embedding`) raises an IndexError for one; the tables here read the -1 of
    padding, which only positions counted from the attention mask hold, and so read a given negative id as row 0
    without a word. With `rows` (RoBERTa's `position_ids_are_table_rows`) they are rows of a learned table, its
    `offset` leading rows included: from 0 to its last row, and one past it is named as a row (the table's own
    check named the position the offset is taken off, and the table's length without those rows). On the CPU only,
    and not while torch.compile traces, as `check_position_ids`."""
    if position_ids.numel() == 0 or position_ids.device.type not in CHECKED_PER_FORWARD:
        return
    if torch.compiler.is_compiling():
        return
    smallest, largest = (int(value) for value in torch.aminmax(position_ids))
    if rows:
        last = table.num_positions + table.offset - 1
        if smallest < 0 or largest > last:
            raise ValueError(
                f"`position_ids` hold row {smallest if smallest < 0 else largest}, but with "
                f"`position_ids_are_table_rows` they are rows of the learned position table, 0 to {last} "
                f"(`position_embedding_offset` = {table.offset} leading rows, then `max_position_embeddings` = "
                f"{table.num_positions} positions)."
            )
    elif smallest < 0:
        kind = "learned" if isinstance(table, LearnedPositionEmbedding) else "sinusoidal"
        raise ValueError(
            f"`position_ids` hold {smallest}, but positions start at 0: the {kind} position table has no row for a "
            "negative one. (Padding is numbered -1 only where the model counts positions from `attention_mask`, "
            "`position_ids_from_attention_mask`: leave `position_ids` out for that.)"
        )


# The table and bias modules by scheme name (the keys of `catalogue.POSITION_SCHEMES` with `table` / `bias`).
POSITION_TABLES: dict[str, Callable[..., nn.Module]] = {
    "learned": lambda num_positions, dim, layout, persistent, offset: LearnedPositionEmbedding(
        num_positions, dim, offset
    ),
    "sinusoidal": lambda num_positions, dim, layout, persistent, offset: SinusoidalPositionalEmbedding(
        num_positions, dim, layout, persistent=persistent
    ),
}
POSITION_BIASES: dict[str, Callable[..., nn.Module]] = {
    "alibi": lambda num_heads, num_buckets, max_distance, bidirectional: ALiBiBias(num_heads),
    "relative_bias": lambda num_heads, num_buckets, max_distance, bidirectional: RelativePositionBias(
        num_heads, num_buckets=num_buckets, max_distance=max_distance, bidirectional=bidirectional
    ),
}


def position_table(
    kind: str, num_positions: int, dim: int, layout: str = "interleaved", persistent: bool = True, offset: int = 0
) -> nn.Module | None:
    """The absolute position table of scheme `kind` (`persistent`: whether a fixed table is in checkpoints;
    `offset`: a learned table's extra leading rows), or None when the scheme has none."""
    if not POSITION_SCHEMES[kind].table:
        return None
    return POSITION_TABLES[kind](num_positions, dim, layout, persistent, offset)


def position_ids_from_mask(attention_mask: torch.Tensor, length: int) -> torch.Tensor:
    """(B, length) positions of the last `length` columns of a 2D padding mask, counting only its ones: a
    left-padded row starts at 0 as it does alone (OPT's numbering); padding columns get -1."""
    mask = attention_mask.long()  # a float or bool mask counts the same (PEFT's prompt tuning prepends float ones)
    positions = mask.cumsum(-1) * mask - 1
    return positions[:, -length:]


def position_bias(
    kind: str, num_heads: int, num_buckets: int = 32, max_distance: int = 128, bidirectional: bool = False
) -> nn.Module | None:
    """The attention-score bias of scheme `kind` over `num_heads` heads (T5's bucketing for "relative_bias";
    `bidirectional` for keys after the query: encoders, a prefix-LM's prefix), or None when the scheme has none."""
    if not POSITION_SCHEMES[kind].bias:
        return None
    return POSITION_BIASES[kind](num_heads, num_buckets, max_distance, bidirectional)


__all__ = [
    "ALiBiBias",
    "LearnedPositionEmbedding",
    "POSITION_BIASES",
    "POSITION_TABLES",
    "alibi_slopes",
    "check_given_position_ids",
    "position_bias",
    "position_ids_from_mask",
    "position_table",
]
