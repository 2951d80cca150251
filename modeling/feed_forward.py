"""Position-wise feed-forward networks (seed 000 §5.2 "activation functions").

- `GatedMLP`: down(act(gate(x)) ⊙ up(x)) — SwiGLU with `silu`, GeGLU with `gelu` (Shazeer 2020); Llama's MLP.
  GPT-OSS clamps both halves (gate ≤ L, |up| ≤ L: `swiglu_limit`) and adds 1 to up (`swiglu_up_offset`), with
  act(x) = x · σ(1.702 x) (`quick_gelu`): act(min(gate, L)) ⊙ (clamp(up, -L, L) + 1).
- `MLP`: down(act(up(x))) — the original Transformer's ReLU FFN, GPT's GELU FFN.

Either takes Sub-LN (`sub_layer_norm`; Wang et al. 2022, "Foundation Transformers"; BitNet b1.58): a norm over the
hidden activation before `down_proj` (`ffn_sub_norm`); and BitNet's `BitLinear` projections (`bitlinear.py`).

`MLPS` is the registry the config's `mlp_type` resolves through.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.activations import ACT2CLS, ACT2FN

from .compiled_kernels import CompiledKernel, elementwise_kernel
from .fused_projections import FusableProjections
from .normalization import make_norm
from .triton_gemv import gated_down, gated_down_applies


def make_activation(name: str) -> nn.Module:
    """`ACT2FN[name]`, but an activation with parameters (xIELU: Apertus, Huang 2024) built in torch's default dtype:
    transformers builds xIELU's parameters in bfloat16 unless told, which the rest of an fp32 model is not (the model's
    `.to(dtype)` casts them with everything else)."""
    if name == "xielu":
        return ACT2CLS["xielu"](dtype=torch.get_default_dtype())
    return ACT2FN[name]


def has_parameters(module) -> bool:
    """Whether an activation learns something of its own (xIELU's α): a compiled kernel built from its name alone
    would compute it with fresh values."""
    return isinstance(module, nn.Module) and next(module.parameters(), None) is not None


# by activation name, or (name, limit, up offset) with GPT-OSS's clamps: (kernel, its activation's class)
_GATED_KERNELS: dict[str | tuple[str, float | None, float], tuple[CompiledKernel, type]] = {}


def gated_formula(act_fn, gate: torch.Tensor, up: torch.Tensor, limit: float | None = None, up_offset: float = 0.0):
    """act(gate) ⊙ up, with GPT-OSS's clamps where `limit` is set (gate ≤ limit, |up| ≤ limit) and `up_offset` added
    to up."""
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    if up_offset:
        up = up + up_offset
    return act_fn(gate) * up


def gated_activation(
    hidden_act: str, act_fn, gate: torch.Tensor, up: torch.Tensor, limit: float | None = None, up_offset: float = 0.0
) -> torch.Tensor:
    """`gated_formula`, `act_fn` being `ACT2FN[hidden_act]`: on CUDA in eager mode one compiled kernel forward and one
    backward (compiled_kernels.py; eager, two kernels forward, and autograd keeps act(gate) as well), the formula
    elsewhere — and wherever `act_fn` was swapped for another activation. Inside compiled code the formula, which
    the compiler fuses itself, without a look at the kernel table: a table filled during a trace would be guarded
    on, and the next call recompile the whole compiled region (a regionally compiled block, once per process)."""
    if torch.compiler.is_compiling() or has_parameters(act_fn):
        return gated_formula(act_fn, gate, up, limit, up_offset)
    key = hidden_act if limit is None and not up_offset else (hidden_act, limit, up_offset)
    if key not in _GATED_KERNELS:
        act = ACT2FN[hidden_act]

        def gated(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
            return gated_formula(act, gate, up, limit, up_offset)

        _GATED_KERNELS[key] = (elementwise_kernel(gated, f"the gated activation ({hidden_act})"), type(act))
    kernel, act_class = _GATED_KERNELS[key]
    fused = kernel(gate, up) if type(act_fn) is act_class else None
    return fused if fused is not None else gated_formula(act_fn, gate, up, limit, up_offset)


class GatedMLP(FusableProjections, nn.Module):
    fusable = ("gate_proj", "up_proj")  # inference reads both as one matrix where laid out (fused_projections.py)

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        hidden_act: str,
        bias: bool = False,
        limit: float | None = None,
        up_offset: float = 0.0,
        sub_norm: nn.Module | None = None,
        linear: type[nn.Linear] = nn.Linear,
    ) -> None:
        super().__init__()
        self.gate_proj = linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = linear(intermediate_size, hidden_size, bias=bias)
        self.hidden_act = hidden_act
        self.act_fn = make_activation(hidden_act)
        self.limit, self.up_offset = limit, float(up_offset)  # GPT-OSS's clamps and offset (module docstring)
        self.ffn_sub_norm = sub_norm  # Sub-LN (module docstring), or None

    @property
    def clamped(self) -> bool:
        """Whether the activation clamps or offsets (GPT-OSS): the plain act(gate) ⊙ up kernels do not apply."""
        return self.limit is not None or self.up_offset != 0.0

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        fused = self.fused_weights()
        if fused is not None:
            gate, up = nn.functional.linear(hidden_states, *fused).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(hidden_states), self.up_proj(hidden_states)
        if gated_down_applies(self, gate):  # a decoding step: the activation inside the down GEMV (triton_gemv.py)
            return gated_down(self, gate, up)
        hidden = gated_activation(self.hidden_act, self.act_fn, gate, up, self.limit, self.up_offset)
        return self.down_proj(hidden if self.ffn_sub_norm is None else self.ffn_sub_norm(hidden))


class MLP(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        hidden_act: str,
        bias: bool = False,
        sub_norm: nn.Module | None = None,
        linear: type[nn.Linear] = nn.Linear,
    ) -> None:
        super().__init__()
        self.up_proj = linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = linear(intermediate_size, hidden_size, bias=bias)
        self.act_fn = make_activation(hidden_act)
        self.ffn_sub_norm = sub_norm  # Sub-LN (module docstring), or None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden = self.act_fn(self.up_proj(hidden_states))
        return self.down_proj(hidden if self.ffn_sub_norm is None else self.ffn_sub_norm(hidden))


MLPS: dict[str, type[nn.Module]] = {"gated": GatedMLP, "plain": MLP}


def gated_options(config) -> dict:
    """The gated activation's clamp and up offset of `config` (`swiglu_limit`, `swiglu_up_offset`; GPT-OSS) as the
    `limit` and `up_offset` keyword arguments of `GatedMLP` and `moe.Experts`."""
    return {"limit": getattr(config, "swiglu_limit", None), "up_offset": getattr(config, "swiglu_up_offset", 0.0)}


def mlp_from_config(config, intermediate_size: int, sub_norm: bool = False, linear=nn.Linear) -> nn.Module:
    """The config's MLP (`mlp_type`, `hidden_act`, `mlp_bias`, and a gated one's clamp and offset) of this width;
    with `sub_norm`, Sub-LN's norm of the config's `norm_type` before its down projection; its projections of class
    `linear` (BitNet's `BitLinear`, or `nn.Linear`)."""
    options = gated_options(config) if config.mlp_type == "gated" else {}
    options["linear"] = linear
    if sub_norm:
        norm_bias = getattr(config, "norm_bias", None)
        options["sub_norm"] = make_norm(config.norm_type, intermediate_size, config.rms_norm_eps, norm_bias)
    return MLPS[config.mlp_type](config.hidden_size, intermediate_size, config.hidden_act, config.mlp_bias, **options)
