"""A pre-norm decoder layer's decoding step with its norms and residual adds inside the matrix-vector products
(triton_gemv.py): four kernels beside RoPE and attention, where the unfused step runs about ten.

    unfused (a 1.1B layer on an H100, the decode-1 profile)         here
    add + RMSNorm, q/k/v GEMV                                       RMSNorm inside the q/k/v GEMV, and in the
    RoPE + cache writes (one inductor kernel)                       compiled loops RoPE and the cache writes after it
    attention                                                       the same (any of attention.py's kernels)
    o GEMV                                                          o GEMV + the residual
    add + RMSNorm, gate/up GEMV                                     RMSNorm inside the gate/up GEMV, SwiGLU after it
    SwiGLU, down GEMV (split in two) + its reduction                down GEMV + the residual

A CUDA graph leaves ~1.6 µs between kernels, and the decode-1 profile measured ~12 kernels a layer, 1.79 ms a token
of which ~0.45 ms idle; the GEMVs ran at 45-68 % of the bandwidth. Four fewer launches a layer (~0.14 ms over 22
layers) and GEMVs at the bandwidth are what the batch-1 goal (1.33 ms a token on an H100) needs.

In the compiled decoding loops (a `SpannedLayer` cache reading a span) the q/k/v GEMV also rotates the queries and
keys and writes the keys and values into the cache (triton_qkv.py, where `qkv_rotary_cache_applies`): one kernel
fewer a layer.

`fused_block_applies` says where: Triton importable, a device in `FUSED_BLOCK_DEVICES` (checked first: elsewhere a
traced step guards on nothing new), at most `triton_gemv.MAX_ROWS` rows (a decoding step of a small batch; a short
prompt), inference (no gradient), a pre-norm or parallel block (GPT-NeoX's two norms, or GPT-J's shared one) whose
norms are archlab's `RMSNorm` and whose attention reads q/k/v as one product (`fused_projections`'
`inference_projections`: generate enters it on CUDA), one dtype, no hooks or patched forwards (accelerate's, Liger's).
A dense layer's MLP joins where it is a SiLU `GatedMLP` with gate/up laid out as one product; a mixture of experts'
where triton_moe.py's kernels take its experts (`MOE_DECODE_DEVICES`) and it has no shared expert: RMSNorm inside the
router's GEMV and inside the experts' gate/up kernel, the residual added by their down kernel (two launches and the
router's top-k beside the experts'); otherwise it keeps its MLP (and its norm), the attention half fused. With
`triton_layer_tail.TAIL_DEVICES` listing the device (a candidate, off: not yet timed on a GPU), a sequential block's
output projection and dense MLP run as one persistent kernel of one row, three phases apart by barriers across the
grid instead of three kernels. A parallel block's MLP reads the block's input and adds its output after the
attention's (GPT-J's shared norm is computed inside both input GEMVs). Everything else runs the block's own forward:
the post-norm, DeepNorm, sandwich and output-norm (OLMo 2) blocks norm a product's output, where these kernels put a
norm before a product, so their forwards never ask; a block whose sub-layers' outputs are scaled
(`residual_multiplier`, Granite) or whose attention gates or norms its output (`attention_output_gate`,
`sub_layer_norm`) runs its forward too
(attention sinks take the attention's own kernel choice, as every variant does in `attend_heads`). QK-norm is the
attention's: over the whole projection in its `split_heads`, per head in its `position_and_cache`, both of which the
fused step calls as the attention does. The default on CUDA, for steps of one row (`FUSED_BLOCK_ROWS`: batch-1
decoding), with archlab's attention and MoE kernels and every kernel launched through the ops' PDL twins
(triton_launch.py): `--suite cuda-tuning` measured that step at 1.25x the step before on an H200 (886 against 709
tok/s, the 1.1B model in bf16; docs/gpu.md). On CPU the tests run the kernels through Triton's interpreter against the
block's forward.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.cache_utils import Cache

from .feed_forward import GatedMLP
from .fused_projections import _hooked
from .moe import Experts, SparseMoeBlock, TopKRouter
from .normalization import RMSNorm
from .triton_gemv import ACTIVATIONS, gated_gemv, gemv, gemv_applies
from .triton_launch import NVIDIA_GPUS, kernels_fit
from .triton_layer_tail import layer_tail, layer_tail_applies
from .triton_moe import moe_decode, moe_decode_applies
from .triton_qkv import qkv_rotary_cache, qkv_rotary_cache_applies

# Devices on which a pre-norm layer's decoding step runs through `fused_block_forward` (`fused_block_applies`).
FUSED_BLOCK_DEVICES: tuple[str, ...] = NVIDIA_GPUS
# The most rows (batch × new tokens) a step fuses: one, where `--suite cuda-tuning` measured the fused step faster
# (H200: 886 against 709 tok/s at batch 1); the kernels suite timed the GEMVs of 4 rows at 0.87-1.10x cuBLAS's and
# the tensor-core GEMVs of 16 rows at 0.14-0.45x. `triton_gemv.MAX_ROWS` (16) fuses every step the kernels take.
FUSED_BLOCK_ROWS = 1


def _plain(module: nn.Module) -> bool:
    """No hooks and no forward replaced on the instance (accelerate's offload hooks, Liger's kernels)."""
    return not _hooked(module)


def _norm_fits(norm: nn.Module, hidden_states: torch.Tensor) -> bool:
    return type(norm) is RMSNorm and _plain(norm) and norm.weight.dtype == hidden_states.dtype


def fused_block_applies(block: nn.Module, hidden_states: torch.Tensor) -> bool:
    """Whether `block`'s step over `hidden_states` (B, T, d) runs through `fused_block_forward` (module docstring).
    `block` is a `PreNormBlock`, `ParallelBlock` or `SharedNormParallelBlock` (its forward asks)."""
    if hidden_states.device.type not in FUSED_BLOCK_DEVICES:  # first: elsewhere a traced step guards on nothing new
        return False
    if hidden_states.shape[0] * hidden_states.shape[1] > FUSED_BLOCK_ROWS or not kernels_fit(hidden_states):
        return False
    attention = block.self_attn
    fused = attention.fused_weights() if _plain(attention) else None
    output = getattr(attention, attention.output_name, None)
    return (
        fused is not None
        and block.residual_multiplier == 1.0  # the kernels add the residual unscaled
        and attention.output_gate is None  # (and the output GEMV reads the heads ungated
        and getattr(attention, "attn_sub_norm", None) is None  # and unnormed: no Sub-LN)
        and _norm_fits(block.input_layernorm, hidden_states)
        and type(output) is nn.Linear
        and _plain(output)
        and gemv_applies(hidden_states, fused[0], fused[1], block.input_layernorm.weight)
        and gemv_applies(hidden_states, output.weight, output.bias)
    )


def _cache_layer(cache: Cache | None, index: int):
    """Layer `index` of `cache` where its `update` is `Cache.update` (a layer's own, nothing around it: no offloading,
    no quantisation), else None."""
    if cache is None or type(cache).update is not Cache.update or getattr(cache, "offloading", False):
        return None
    layers = getattr(cache, "layers", None)
    return layers[index] if layers is not None and index < len(layers) else None


def _mlp_norm(block: nn.Module) -> nn.Module:
    """The norm before the block's MLP (`mlp_norm_name`: the shared norm of a parallel block is its input norm)."""
    return getattr(block, block.mlp_norm_name)


def _mlp_fits(block: nn.Module, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """gate/up's (weight, bias) as one product where the dense MLP joins the fused step, else None."""
    mlp = block.mlp
    if type(mlp) is not GatedMLP or not _plain(mlp) or mlp.hidden_act not in ACTIVATIONS or mlp.clamped:
        return None
    if mlp.ffn_sub_norm is not None:  # Sub-LN: a norm between the activation and the down GEMV
        return None
    fused = mlp.fused_weights()
    down = mlp.down_proj
    fits = (
        fused is not None
        and _norm_fits(_mlp_norm(block), hidden_states)
        and type(down) is nn.Linear
        and _plain(down)
        and gemv_applies(hidden_states, *fused)
        and gemv_applies(hidden_states, down.weight, down.bias)
    )
    return fused if fits else None


def _moe_fits(block: nn.Module, hidden_states: torch.Tensor) -> bool:
    """Whether the block's mixture of experts joins the fused step: routed experts only (no shared expert), plain
    modules, its experts taking triton_moe.py's kernels, the router a GEMV with the norm inside. A router or experts
    that PEFT wraps (LoRA through `target_parameters`) keep the block's forward: the step reads their weights."""
    mlp = block.mlp
    return (
        type(mlp) is SparseMoeBlock
        and type(mlp.gate) is TopKRouter
        and type(mlp.experts) is Experts
        and _plain(mlp)
        and _plain(mlp.gate)
        and _plain(mlp.experts)
        and mlp.shared_expert is None
        and not mlp.training  # no router jitter
        and _norm_fits(_mlp_norm(block), hidden_states)
        and moe_decode_applies(mlp.experts, hidden_states.reshape(-1, hidden_states.shape[-1]))
        and gemv_applies(hidden_states, mlp.gate.weight, mlp.gate.bias)
    )


def _fused_moe(block: nn.Module, mlp_input: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """The mixture of experts' half of the step: RMSNorm inside the router's GEMV and inside the experts' gate/up
    kernel, the residual added by their down kernel; the router's logits left on the MLP as its forward leaves them."""
    mlp, norm = block.mlp, _mlp_norm(block)
    shape = mlp_input.shape
    x = mlp_input.reshape(-1, shape[-1])
    router_logits, top_weights, top_index = mlp.gate.route(gemv(x, mlp.gate.weight, mlp.gate.bias, norm=norm))
    out = moe_decode(mlp.experts, x, top_index, top_weights, norm=norm, residual=residual.reshape(-1, shape[-1]))
    mlp.router_logits = router_logits
    return out.reshape(shape)


def fused_block_forward(
    block: nn.Module,
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None,
    past_key_values: Cache | None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The block's forward for a decoding step where `fused_block_applies`: the same values (the norms' and
    residuals' rounding aside, triton_gemv.py), the attention weights as the attention kernel returns them. A
    parallel block's MLP reads the block's input, and its output is added after the attention's."""
    attention = block.self_attn
    batch, length, _ = hidden_states.shape
    block_input = hidden_states
    layer = _cache_layer(past_key_values, attention.layer_idx)
    if layer is not None and qkv_rotary_cache_applies(attention, layer, hidden_states, position_embeddings):
        query, key, value = qkv_rotary_cache(
            attention, layer, hidden_states, position_embeddings, norm=block.input_layernorm
        )
    else:
        projected = gemv(hidden_states, *attention.fused_weights(), norm=block.input_layernorm)
        query, key, value = attention.split_heads(projected)
        # (the keyword arguments as `Attention.forward` passes them: continuous batching's paged cache reads its
        # indices)
        query, key, value = attention.position_and_cache(
            query, key, value, position_embeddings, past_key_values, kwargs
        )
    heads, weights = attention.attend_heads(query, key, value, attention_mask, past_key_values, **kwargs)
    output = getattr(attention, attention.output_name)
    if not block.parallel and layer_tail_applies(hidden_states):  # the rest of the layer as one persistent kernel
        gate_up = _mlp_fits(block, hidden_states)
        if gate_up is not None:
            heads = heads.reshape(batch, length, -1)
            return layer_tail(heads, hidden_states, output, _mlp_norm(block), gate_up, block.mlp.down_proj), weights
    hidden_states = gemv(heads.reshape(batch, length, -1), output.weight, output.bias, residual=hidden_states)
    mlp_input = block_input if block.parallel else hidden_states
    if _moe_fits(block, mlp_input):
        return _fused_moe(block, mlp_input, hidden_states), weights
    gate_up = _mlp_fits(block, mlp_input)
    if gate_up is None:  # an MLP the kernels do not cover: as the block runs it
        return hidden_states + block.mlp(_mlp_norm(block)(mlp_input)), weights
    activated = gated_gemv(mlp_input, *gate_up, norm=_mlp_norm(block))
    down = block.mlp.down_proj
    return gemv(activated, down.weight, down.bias, residual=hidden_states), weights


__all__ = ["FUSED_BLOCK_DEVICES", "FUSED_BLOCK_ROWS", "fused_block_applies", "fused_block_forward"]
