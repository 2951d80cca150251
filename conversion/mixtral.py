"""Mixtral's expert weights: one module per expert in its checkpoints, fused in archlab.

Mixtral checkpoints store `block_sparse_moe.experts.E.w1/w3/w2` (gate/up/down) and `block_sparse_moe.gate` (the
router); archlab holds them fused as transformers 5 does in memory (`mlp.experts.gate_up_proj` = [w1; w3] stacked
over experts, `mlp.experts.down_proj`, `mlp.gate`). The other direction needs nothing: transformers 5's Mixtral
loads the fused names itself and saves its own layout.
"""

from __future__ import annotations

import re

import torch
from transformers import PreTrainedConfig

from .family import Layout, StateDict

_PER_EXPERT = re.compile(r"^(model\.layers\.\d+)\.block_sparse_moe\.(?:gate\.weight|experts\.(\d+)\.(w[123])\.weight)$")


def fuse_experts(state_dict: StateDict, config: PreTrainedConfig) -> StateDict:
    out: StateDict = {}
    experts: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    for key, tensor in state_dict.items():
        match = _PER_EXPERT.match(key)
        if match is None:
            out[key] = tensor
        elif match.group(2) is None:
            out[f"{match.group(1)}.mlp.gate.weight"] = tensor
        else:
            experts.setdefault(match.group(1), {})[(int(match.group(2)), match.group(3))] = tensor
    for prefix, weights in experts.items():
        ids = range(config.num_local_experts)
        out[f"{prefix}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([weights[(e, "w1")], weights[(e, "w3")]]) for e in ids]
        )
        out[f"{prefix}.mlp.experts.down_proj"] = torch.stack([weights[(e, "w2")] for e in ids])
    return out


MIXTRAL_LAYOUT = Layout(to_archlab=fuse_experts)

__all__ = ["MIXTRAL_LAYOUT", "fuse_experts"]
