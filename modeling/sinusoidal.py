"""Sinusoidal absolute position embeddings (Vaswani et al. 2017, §3.5; seed 000 §5.2 and seed 001 "positional
encoding").

    angle(pos, i) = pos / base^(2i / d)            for i = 0 .. ceil(d/2) - 1

Two channel layouts of the same angles exist in the wild, and checkpoints depend on which one they were trained with:

- `"interleaved"` — the paper's: channel 2i holds sin(angle(pos, i)) and channel 2i+1 holds cos(angle(pos, i)).
- `"split"` — Marian's (and tensor2tensor's): the first ceil(d/2) channels hold the sines, the remaining floor(d/2)
  channels the cosines. `MarianSinusoidalPositionalEmbedding` builds exactly this table.

`SINUSOID_LAYOUTS` is the registry a config's layout field resolves through. The table is computed in float64 (as
Marian does with numpy) and stored in the requested dtype; the module's buffer is made in torch's default dtype, so it
follows `from_pretrained(..., dtype=torch.bfloat16)` (which builds the model under that default) as parameters do.
"""

from __future__ import annotations

import torch
from torch import nn


def _angles(num_positions: int, dim: int, base: float) -> torch.Tensor:
    """(num_positions, ceil(dim/2)) float64 angles pos / base^(2i/dim)."""
    positions = torch.arange(num_positions, dtype=torch.float64)[:, None]
    exponents = torch.arange(0, dim, 2, dtype=torch.float64) / dim  # 2i / d
    return positions / torch.pow(torch.tensor(base, dtype=torch.float64), exponents)


def interleaved_table(num_positions: int, dim: int, base: float = 10000.0) -> torch.Tensor:
    """PE[pos, 2i] = sin, PE[pos, 2i+1] = cos — the layout of the paper."""
    angles = _angles(num_positions, dim, base)
    table = torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(1)  # (P, 2·ceil(d/2))
    return table[:, :dim]


def split_table(num_positions: int, dim: int, base: float = 10000.0) -> torch.Tensor:
    """PE[pos, :ceil(d/2)] = sin, PE[pos, ceil(d/2):] = cos — Marian's layout."""
    angles = _angles(num_positions, dim, base)
    return torch.cat((angles.sin(), angles[:, : dim // 2].cos()), dim=-1)


SINUSOID_LAYOUTS = {"interleaved": interleaved_table, "split": split_table}


# Where each forward checks its position ids against the table (reading the largest id costs one small reduction).
CHECKED_PER_FORWARD = ("cpu",)


def check_position_ids(position_ids: torch.Tensor, num_positions: int, table: str) -> None:
    """Refuse position ids past an absolute position table (learned or sinusoidal) with a ValueError that names
    `max_position_embeddings`, instead of an index error deep inside the embedding lookup.

    Runs on CPU only (`CHECKED_PER_FORWARD`). On accelerators it would make every forward (every decoding step) wait
    for the device and break CUDA-graph capture, so there the lookup's own device-side bounds check reports the error
    (`check_generation_fits_the_table` refuses a `generate` call up front instead); skipped too while torch.compile
    traces.
    """
    if position_ids.numel() == 0 or position_ids.device.type not in CHECKED_PER_FORWARD:
        return
    if torch.compiler.is_compiling():
        return
    largest = int(position_ids.max())
    if largest >= num_positions:
        raise ValueError(
            f"Position ids reach {largest} (a sequence of {largest + 1} tokens, counting any cached ones), but the "
            f"{table} position table has `max_position_embeddings` = {num_positions} rows. Use sequences of at most "
            f"{num_positions} tokens, or a config with a larger `max_position_embeddings`; position types without a "
            f"table (rope, alibi, relative_bias) have no such limit."
        )


def check_generation_fits_the_table(
    config, device: torch.device, positions: int, table: str | None, what: str, fewer: str
) -> None:
    """Where no forward checks its position ids (an accelerator, `CHECKED_PER_FORWARD`), a `generate` call that would
    look up `positions` positions of an absolute table (`table`: "learned" or "sinusoidal"; None for position types
    without one) longer than `max_position_embeddings` is refused before anything runs: the lookup's device-side
    assert would otherwise end the process's CUDA context at the step that crosses it. `what` says what needs the
    positions, `fewer` what to lower."""
    limit = getattr(config, "max_position_embeddings", None)
    if table is None or device.type in CHECKED_PER_FORWARD or limit is None or positions <= limit:
        return
    raise ValueError(
        f"{what} needs {positions} positions, but the {table} position table has `max_position_embeddings` = "
        f"{limit} rows. On {device.type} the positions are not checked at each step (an out-of-range lookup is a "
        f"device-side assert that ends the CUDA context), so this call is refused before it starts: {fewer}."
    )


def sinusoid_table(
    num_positions: int,
    dim: int,
    layout: str = "interleaved",
    base: float = 10000.0,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The (num_positions, dim) table in the given layout ("interleaved" or "split")."""
    if layout not in SINUSOID_LAYOUTS:
        allowed = ", ".join(map(repr, SINUSOID_LAYOUTS))
        raise ValueError(f"Unknown sinusoid layout {layout!r}; allowed values: {allowed}.")
    return SINUSOID_LAYOUTS[layout](num_positions, dim, base).to(dtype)


class SinusoidalPositionalEmbedding(nn.Module):
    """A fixed (not trained) table looked up by position id: (…, T) -> (…, T, dim).

    The table is a buffer named `weight`, so the state-dict key is `embed_positions.weight` as in Marian. It is
    `persistent` by default because Marian state dicts carry it (strict loading needs the key); models that do not
    want it in their checkpoints pass `persistent=False`. `reset_parameters` recomputes it (models call it from
    `_init_weights`, e.g. after meta-device initialisation).
    """

    weight: torch.Tensor

    def __init__(
        self,
        num_positions: int,
        dim: int,
        layout: str = "interleaved",
        base: float = 10000.0,
        persistent: bool = True,
    ) -> None:
        super().__init__()
        self.num_positions, self.dim, self.layout, self.base = num_positions, dim, layout, base
        table = sinusoid_table(num_positions, dim, layout, base, dtype=torch.get_default_dtype())
        self.register_buffer("weight", table, persistent=persistent)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        table = sinusoid_table(self.num_positions, self.dim, self.layout, self.base)
        self.weight.copy_(table.to(device=self.weight.device, dtype=self.weight.dtype))

    def forward(self, position_ids: torch.Tensor) -> torch.Tensor:
        check_position_ids(position_ids, self.num_positions, "sinusoidal")
        # padding numbered -1 (`position_ids_from_attention_mask`) reads row 0, as the learned table's clamp does
        return nn.functional.embedding(position_ids.clamp(min=0), self.weight)

    def extra_repr(self) -> str:
        return f"{self.num_positions}, {self.dim}, layout={self.layout!r}"


__all__ = [
    "SINUSOID_LAYOUTS",
    "SinusoidalPositionalEmbedding",
    "check_generation_fits_the_table",
    "check_position_ids",
    "interleaved_table",
    "sinusoid_table",
    "split_table",
]
