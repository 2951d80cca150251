"""Mixture-of-experts weights stored one module per expert in checkpoints, fused in archlab.

transformers 5 holds a sparse layer's experts fused in memory (`mlp.experts.gate_up_proj` = [gate; up] stacked over
experts, (K, 2f, d), and `mlp.experts.down_proj`, (K, d, f)) and archlab uses the same names and shapes, but
`save_pretrained` writes (and the Hub holds) the families' original layout, one module per expert:

    Mixtral     `block_sparse_moe.experts.E.w1/w3/w2` (gate/up/down), router `block_sparse_moe.gate`
    Qwen2-MoE   `mlp.experts.E.gate_proj/up_proj/down_proj`, router `mlp.gate` (Qwen3-MoE's too)

`PerExpertWeights` is that layout as data; its `Layout` fuses them on import. Exporting needs nothing: the stock
class is handed the fused tensors in memory and saves its own layout.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property

import torch
from transformers import PreTrainedConfig

from .family import Layout, StateDict


@dataclass(frozen=True)
class PerExpertWeights:
    """A family's per-expert checkpoint names: the sparse block's module name and each expert's gate/up/down."""

    block: str
    gate: str
    up: str
    down: str

    @cached_property
    def _pattern(self) -> re.Pattern:
        parts = "|".join(map(re.escape, (self.gate, self.up, self.down)))
        block = re.escape(self.block)
        return re.compile(rf"^(model\.layers\.\d+)\.{block}\.(?:gate\.weight|experts\.(\d+)\.({parts})\.weight)$")

    def fuse(self, state_dict: StateDict, config: PreTrainedConfig) -> StateDict:
        out: StateDict = {}
        experts: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
        for key, tensor in state_dict.items():
            match = self._pattern.match(key)
            if match is None:
                out[key] = tensor
            elif match.group(2) is None:
                out[f"{match.group(1)}.mlp.gate.weight"] = tensor
            else:
                experts.setdefault(match.group(1), {})[(int(match.group(2)), match.group(3))] = tensor
        for prefix, weights in experts.items():
            ids = range(config.num_local_experts)
            out[f"{prefix}.mlp.experts.gate_up_proj"] = torch.stack(
                [torch.cat([weights[(e, self.gate)], weights[(e, self.up)]]) for e in ids]
            )
            out[f"{prefix}.mlp.experts.down_proj"] = torch.stack([weights[(e, self.down)] for e in ids])
        return out

    def layout(self) -> Layout:
        return Layout(to_archlab=self.fuse)


MIXTRAL_LAYOUT = PerExpertWeights("block_sparse_moe", "w1", "w3", "w2").layout()
QWEN2_MOE_LAYOUT = PerExpertWeights("mlp", "gate_proj", "up_proj", "down_proj").layout()

__all__ = ["MIXTRAL_LAYOUT", "PerExpertWeights", "QWEN2_MOE_LAYOUT"]
