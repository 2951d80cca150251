"""Liger Kernel's Triton kernels on archlab models (Hsu et al. 2024, "Liger Kernel: Efficient Triton Kernels for LLM
Training"), and the registration that makes `TrainingArguments(use_liger_kernel=True)` apply them.

`apply_liger_kernel_to_archlab(model)` patches one model instance, and only where a Liger kernel computes the same
function as the archlab module it replaces, for that module's configuration:

    archlab module                               Liger kernel
    RMSNorm (norm_type "rms_norm")               RMSNorm, casting mode "llama": statistics in fp32, weight in the
                                                 input dtype (LlamaRMSNorm's arithmetic, as archlab's)
    OffsetRMSNorm ("offset_rms_norm", 1 + w)     RMSNorm, offset 1, casting mode "gemma": everything in fp32
    LayerNorm with a bias ("layer_norm")         LayerNorm
    gated MLP / gated FFN, SiLU                  SwiGLU: silu(gate) ⊙ up
    gated MLP / gated FFN, tanh-approximate GELU GeGLU ("gelu_pytorch_tanh", "gelu_new")
    RoPE, full or partial (decoder)              RoPE (rotate-half layout, any rope_type: they differ in cos/sin)
    LM head + cross-entropy in training          fused linear cross-entropy: no logits; head bias, Marian's
                                                 `final_logits_bias`, soft-capping and z-loss included

Left as they are, and listed once in a log line: plain MLPs/FFNs (act(up x): no Liger kernel), gated FFNs with any other
activation (exact-erf GELU included: Liger's GeGLU is the tanh form), LayerNorm without a bias, the routed experts of a
mixture of experts (archlab's grouped GEMMs), the masked-LM head, and whatever the arguments switch off. Norms keep
their gradient out of place (Liger's `in_place=False`): with sandwich, output-norm (OLMo 2) and parallel blocks a norm's
output gradient can be shared with the residual path. QK-norm over the whole projection is the same RMSNorm over a wider
last dimension (heads · head_dim), and takes the same kernel. In one dtype the patched model computes what the plain one
does, up to floating-point rounding; under autocast a norm or rotation whose input is already half precision returns
half precision where archlab's promotes to the fp32 weight's dtype (as Liger does to Llama).

Patching swaps the module's `forward` on the instance (parameters, names, state dict and saved folders are
unchanged; a saved and reloaded model is a plain one), sets `attention.rotate` for RoPE and
`lm_head.fused_linear_cross_entropy` for the loss (the seams archlab's modules read; see `losses.lm_head_loss`), and
marks each patched module with `liger_kernel = "<kernel>"`. It is idempotent and not undone.

Registration: transformers' Trainer (and TRL's) call Liger's `_apply_liger_kernel_to_instance`, which looks the
model's `model_type` up in Liger's table `MODEL_TYPE_TO_APPLY_LIGER_FN` and only logs for a type it does not know.
Importing Liger costs seconds (it loads Triton and every kernel), so `import archlab` does not: through an import hook
(`import_hooks.after_import`) it adds "archlab_decoder" and "archlab_seq2seq" to the table the moment Liger's module
defining it has run, whoever imports it (Trainer when training starts, TRL, a user). Where that module is already
loaded, archlab registers at once.
"""

from __future__ import annotations

import functools
import inspect
from collections import Counter
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
from torch import nn
from transformers.activations import ACT2FN
from transformers.utils import logging

from .modeling import DecoderConfig, DecoderForCausalLM, Seq2SeqConfig, Seq2SeqForConditionalGeneration
from .modeling.attention import Attention
from .modeling.configuration_decoder import rope_parameter_sets
from .modeling.feed_forward import MLP, GatedMLP
from .modeling.import_hooks import after_import
from .modeling.losses import IGNORE_INDEX
from .modeling.modeling_decoder import DecoderModel
from .modeling.modeling_masked_lm import EncoderForMaskedLM
from .modeling.moe import Experts
from .modeling.normalization import LayerNorm, OffsetRMSNorm, RMSNorm
from .modeling.seq2seq_layers import GatedActivation, Seq2SeqDecoderLayer, Seq2SeqEncoderLayer

logger = logging.get_logger(__name__)

ARCHLAB_MODEL_TYPES = (DecoderConfig.model_type, Seq2SeqConfig.model_type)
LIGER_TABLE_MODULE = "liger_kernel.transformers.monkey_patch"  # defines MODEL_TYPE_TO_APPLY_LIGER_FN

# Activations whose gated form a Liger kernel computes: SwiGLU (silu) and GeGLU (GELU's tanh approximation).
SWIGLU_ACTIVATIONS = ("silu", "swish")
GEGLU_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_new")


@functools.cache
def _liger() -> SimpleNamespace:
    """Liger's kernels, imported on first use."""
    from liger_kernel.transformers import functional
    from liger_kernel.transformers.rope import liger_rotary_pos_emb

    return SimpleNamespace(
        rms_norm=functional.liger_rms_norm,
        layer_norm=functional.liger_layer_norm,
        swiglu=functional.liger_swiglu,
        geglu=functional.liger_geglu,
        rope=liger_rotary_pos_emb,
        fused_linear_cross_entropy=functional.liger_fused_linear_cross_entropy,
    )


# ---- the patched forwards: the archlab module's arithmetic, as one Liger kernel -----------------------------------


def _rms_norm_forward(self: RMSNorm, hidden_states: torch.Tensor) -> torch.Tensor:
    return _liger().rms_norm(hidden_states, self.weight, self.variance_epsilon, 0.0, "llama", False)


def _offset_rms_norm_forward(self: OffsetRMSNorm, hidden_states: torch.Tensor) -> torch.Tensor:
    return _liger().rms_norm(hidden_states, self.weight, self.eps, 1.0, "gemma", False)


def _layer_norm_forward(self: LayerNorm, hidden_states: torch.Tensor) -> torch.Tensor:
    return _liger().layer_norm(hidden_states, self.weight, self.bias, self.eps)


def _swiglu_mlp_forward(self: GatedMLP, hidden_states: torch.Tensor) -> torch.Tensor:
    return _down(self, _liger().swiglu(self.gate_proj(hidden_states), self.up_proj(hidden_states)))


def _geglu_mlp_forward(self: GatedMLP, hidden_states: torch.Tensor) -> torch.Tensor:
    return _down(self, _liger().geglu(self.gate_proj(hidden_states), self.up_proj(hidden_states)))


def _down(mlp: GatedMLP, hidden: torch.Tensor) -> torch.Tensor:
    """The down projection of a gated MLP's activation, after its Sub-LN norm where it has one (`sub_layer_norm`)."""
    return mlp.down_proj(hidden if mlp.ffn_sub_norm is None else mlp.ffn_sub_norm(hidden))


def _swiglu_halves_forward(self: GatedActivation, hidden_states: torch.Tensor) -> torch.Tensor:
    gate, up = hidden_states.chunk(2, dim=-1)
    return _liger().swiglu(gate, up)


def _geglu_halves_forward(self: GatedActivation, hidden_states: torch.Tensor) -> torch.Tensor:
    gate, up = hidden_states.chunk(2, dim=-1)
    return _liger().geglu(gate, up)


def _liger_rope_takes_rotary_dim() -> bool:
    """Liger versions whose RoPE takes `rotary_dim` rotate the first cos/sin-width channels of each head (partial
    rotary, as `rotary.apply_rotary`); earlier ones assumed whole heads."""
    return "rotary_dim" in inspect.signature(_liger().rope).parameters


def _rope(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """`rotary.apply_rotary` as Liger's kernel: the rotary width (partial rotary) is the width of cos/sin."""
    return _liger().rope(query, key, cos, sin)


def _fused_linear_cross_entropy(hidden, weight, bias, targets, softcap, z_loss_coef) -> torch.Tensor:
    """The protocol of `losses.fused_causal_lm_loss`: the summed loss over tokens, as Liger's fused kernel."""
    return _liger().fused_linear_cross_entropy(
        hidden,
        weight,
        targets,
        bias=bias,
        ignore_index=IGNORE_INDEX,
        lse_square_scale=z_loss_coef,
        reduction="sum",
        softcap=softcap,
    )


# ---- which module gets which kernel --------------------------------------------------------------------------------


def _is_activation(act_fn: nn.Module, names: tuple[str, ...]) -> bool:
    return any(type(act_fn) is type(ACT2FN[name]) for name in names)


def _gated_kernel(act_fn: nn.Module) -> str | None:
    if _is_activation(act_fn, SWIGLU_ACTIVATIONS):
        return "swiglu"
    if _is_activation(act_fn, GEGLU_ACTIVATIONS):
        return "geglu"
    return None


def _classify(module: nn.Module):
    """(kernel argument, patched forward) for a module a Liger kernel covers; (None, why it stays as it is) for one of
    a kind Liger could cover but not with this configuration; (None, None) for every other module."""
    if isinstance(module, RMSNorm):
        return "rms_norm", _rms_norm_forward
    if isinstance(module, OffsetRMSNorm):
        return "rms_norm", _offset_rms_norm_forward
    if isinstance(module, LayerNorm):
        return ("layer_norm", _layer_norm_forward) if module.bias is not None else (None, "LayerNorm without bias")
    if isinstance(module, (GatedMLP, GatedActivation)):
        kernel = _gated_kernel(module.act_fn)
        if kernel is None:
            return None, f"gated MLP with {type(module.act_fn).__name__}"
        if getattr(module, "clamped", False):
            return None, "gated MLP with GPT-OSS's clamps (swiglu_limit, swiglu_up_offset)"
        halves = isinstance(module, GatedActivation)  # the encoder-decoder's fc1 holds gate and up side by side
        forwards = {
            "swiglu": (_swiglu_mlp_forward, _swiglu_halves_forward),
            "geglu": (_geglu_mlp_forward, _geglu_halves_forward),
        }
        return kernel, forwards[kernel][halves]
    if isinstance(module, MLP):
        return None, "plain MLP"
    if isinstance(module, (Seq2SeqEncoderLayer, Seq2SeqDecoderLayer)):
        return None, None if isinstance(module.activation_fn, GatedActivation) else "plain FFN"
    if isinstance(module, Experts):
        return None, "routed experts"
    return None, None


@dataclass
class LigerPatchReport:
    """What `apply_liger_kernel_to_archlab` did: patched modules per kernel, and the modules left as they are."""

    applied: Counter = field(default_factory=Counter)
    left_as_is: Counter = field(default_factory=Counter)

    def summary(self) -> str:
        applied = ", ".join(f"{kernel} × {n}" for kernel, n in self.applied.items()) or "none"
        left = ", ".join(f"{what} × {n}" for what, n in self.left_as_is.items())
        return f"{applied}; left as they are: {left}" if left else applied


def _mark(module: nn.Module, kernel: str) -> None:
    module.liger_kernel = kernel


def _patch_rope(decoder: DecoderModel, patch, report: LigerPatchReport) -> None:
    """Liger's RoPE in every attention of a decoder stack with rotary positions."""
    sets = rope_parameter_sets(decoder.config.rope_parameters)  # (one per layer type, Gemma3's form, or the one)
    partial = any(parameters.get("partial_rotary_factor", 1.0) < 1.0 for parameters in sets)
    attentions = [module for module in decoder.modules() if isinstance(module, Attention)]
    if partial and not _liger_rope_takes_rotary_dim():
        report.left_as_is["partial RoPE (this Liger rotates whole heads)"] += len(attentions)
        return
    for attention in attentions:
        if patch("rope"):
            attention.rotate = _rope
            _mark(attention, "rope")


def apply_liger_kernel_to_archlab(
    model: nn.Module | None = None,
    rope: bool = True,
    rms_norm: bool = True,
    layer_norm: bool = True,
    swiglu: bool = True,
    geglu: bool = True,
    fused_linear_cross_entropy: bool = True,
) -> LigerPatchReport | None:
    """Patch an archlab model instance with Liger's kernels where they compute its function (module docstring).

    The keyword names are Liger's (`TrainingArguments.liger_kernel_config` passes them through): each switches one
    kernel. Returns what was patched and what was left as it is, and logs it once.
    """
    if model is None:
        # Liger's `_apply_liger_kernel(model_type)` (AutoLigerKernelForCausalLM) patches classes before a model exists.
        logger.warning(
            "archlab patches model instances: load the model first, then call "
            "`archlab.liger.apply_liger_kernel_to_archlab(model)` (Trainer's `use_liger_kernel` does so by itself)."
        )
        return None
    enabled = {
        "rms_norm": rms_norm,
        "layer_norm": layer_norm,
        "swiglu": swiglu,
        "geglu": geglu,
        "rope": rope,
        "fused_linear_cross_entropy": fused_linear_cross_entropy,
    }
    _liger()  # import Liger now: a missing or broken install fails here, before any module changes
    report = LigerPatchReport()

    def patch(kernel: str) -> bool:
        if not enabled[kernel]:
            report.left_as_is[f"{kernel} (switched off)"] += 1
            return False
        report.applied[kernel] += 1
        return True

    for module in model.modules():
        kernel, forward_or_reason = _classify(module)
        if kernel is None:
            if forward_or_reason is not None:
                report.left_as_is[forward_or_reason] += 1
        elif patch(kernel):
            module.forward = forward_or_reason.__get__(module, type(module))
            _mark(module, kernel)
        if isinstance(module, DecoderModel) and module.rotary_emb is not None:
            _patch_rope(module, patch, report)

    if isinstance(model, (DecoderForCausalLM, Seq2SeqForConditionalGeneration)):
        if patch("fused_linear_cross_entropy"):
            model.lm_head.fused_linear_cross_entropy = _fused_linear_cross_entropy
            _mark(model.lm_head, "fused_linear_cross_entropy")
    elif isinstance(model, EncoderForMaskedLM):
        report.left_as_is["masked-LM head"] += 1

    log = logger.warning if report.left_as_is else logger.info
    log(f"Liger kernels on {type(model).__name__}: {report.summary()}.")
    return report


# ---- registration with Liger's table, when Liger loads --------------------------------------------------------------


def register_with_liger(table: dict | None = None) -> None:
    """Add archlab's model types to Liger's `MODEL_TYPE_TO_APPLY_LIGER_FN` (imports Liger when no table is given).
    A type Liger already maps keeps its entry."""
    if table is None:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN as table
    for model_type in ARCHLAB_MODEL_TYPES:
        table.setdefault(model_type, apply_liger_kernel_to_archlab)


def _register_in(module) -> None:
    table = getattr(module, "MODEL_TYPE_TO_APPLY_LIGER_FN", None)
    if isinstance(table, dict):
        register_with_liger(table)
    else:
        logger.warning(
            f"{LIGER_TABLE_MODULE} has no MODEL_TYPE_TO_APPLY_LIGER_FN table in this liger-kernel version, so "
            "`use_liger_kernel` cannot find archlab models: call `archlab.liger.apply_liger_kernel_to_archlab(model)`."
        )


def register_with_liger_when_loaded() -> None:
    """Register now if Liger's table module is loaded, else when it is (`import archlab` calls this; idempotent)."""
    after_import(LIGER_TABLE_MODULE, _register_in)


__all__ = [
    "ARCHLAB_MODEL_TYPES",
    "LigerPatchReport",
    "apply_liger_kernel_to_archlab",
    "register_with_liger",
    "register_with_liger_when_loaded",
]
