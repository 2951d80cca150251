"""Position-wise feed-forward networks (seed 000 §5.2 "activation functions").

- `GatedMLP`: down(act(gate(x)) ⊙ up(x)) — SwiGLU with `silu`, GeGLU with `gelu` (Shazeer 2020); Llama's MLP.
- `MLP`: down(act(up(x))) — the original Transformer's ReLU FFN, GPT's GELU FFN.

`MLPS` is the registry the config's `mlp_type` resolves through.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.activations import ACT2FN

from .compiled_kernels import CompiledKernel, elementwise_kernel
from .fused_projections import FusableProjections
from .triton_gemv import gated_down, gated_down_applies

_GATED_KERNELS: dict[str, tuple[CompiledKernel, type]] = {}  # by activation name: (kernel, its activation's class)


def gated_activation(hidden_act: str, act_fn, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """act(gate) ⊙ up, `act_fn` being `ACT2FN[hidden_act]`: on CUDA in eager mode one compiled kernel forward and one
    backward (compiled_kernels.py; eager, two kernels forward, and autograd keeps act(gate) as well), the formula
    elsewhere — and wherever `act_fn` was swapped for another activation. Inside compiled code the formula, which
    the compiler fuses itself, without a look at the kernel table: a table filled during a trace would be guarded
    on, and the next call recompile the whole compiled region (a regionally compiled block, once per process)."""
    if torch.compiler.is_compiling():
        return act_fn(gate) * up
    if hidden_act not in _GATED_KERNELS:
        act = ACT2FN[hidden_act]

        def gated(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
            return act(gate) * up

        _GATED_KERNELS[hidden_act] = (elementwise_kernel(gated, f"the gated activation ({hidden_act})"), type(act))
    kernel, act_class = _GATED_KERNELS[hidden_act]
    fused = kernel(gate, up) if type(act_fn) is act_class else None
    return fused if fused is not None else act_fn(gate) * up


class GatedMLP(FusableProjections, nn.Module):
    fusable = ("gate_proj", "up_proj")  # inference reads both as one matrix where laid out (fused_projections.py)

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.hidden_act = hidden_act
        self.act_fn = ACT2FN[hidden_act]

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        fused = self.fused_weights()
        if fused is not None:
            gate, up = nn.functional.linear(hidden_states, *fused).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(hidden_states), self.up_proj(hidden_states)
        if gated_down_applies(self, gate):  # a decoding step: the activation inside the down GEMV (triton_gemv.py)
            return gated_down(self, gate, up)
        return self.down_proj(gated_activation(self.hidden_act, self.act_fn, gate, up))


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str, bias: bool = False) -> None:
        super().__init__()
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.act_fn = ACT2FN[hidden_act]

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.up_proj(hidden_states)))


MLPS: dict[str, type[nn.Module]] = {"gated": GatedMLP, "plain": MLP}
