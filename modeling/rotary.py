"""Rotary position embedding (RoPE; Su et al. 2021, seed 000 §5.2 "position encoding").

The inverse frequencies come from transformers' `ROPE_INIT_FUNCTIONS`, so every `rope_parameters["rope_type"]`
Hugging Face supports (default, linear, dynamic, yarn, llama3, ...) means exactly what it means there, and
`cos`/`sin` are bit-identical to Llama's. `partial_rotary_factor` rotates only the first fraction of each head's
channels (GPT-NeoX / Phi style).

RoPE has no position table, so positions past `max_position_embeddings` compute; the model was just never trained on
them. `warn_past_max_positions` says so once per model, through transformers' logging, in the forward that first
reaches them: before `generate` streams any token, instead of transformers' length reminder after the first one. The
types that scale a pretraining length (`SCALING_ROPE_TYPES`) run as far as `factor` x `original_max_position_embeddings`
where that is longer (`rope_length`: Qwen2.5's yarn recipe keeps `max_position_embeddings` at the pretraining length).

`rope_parameters` may hold one parameter set per layer type (`{"full_attention": {...}, "sliding_attention": {...}}`,
transformers 5's form: Gemma3's local layers rotate with a base of 10k, its global ones with 1M):
`LayerTypeRotaryEmbeddings` then builds one `RotaryEmbedding` per layer type present.

With `query_scaling_beta` (Mistral 3) the tables carry a third entry, each position's query scale
(`with_query_scales`), which the attention multiplies its rotated queries by.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, dynamic_rope_update
from transformers.utils import logging

from .compiled_kernels import elementwise_kernel
from .input_checks import can_read_values

logger = logging.get_logger(__name__)

# rope types that rescale themselves for sequences past `max_position_embeddings`: running there is their purpose
LENGTH_EXTENDING_ROPE_TYPES = ("dynamic",)
# rope types that stretch `original_max_position_embeddings` by `factor` (transformers' yarn, llama3 and longrope)
SCALING_ROPE_TYPES = ("yarn", "llama3", "longrope")


def rope_length(config) -> tuple[int, str]:
    """The positions a RoPE config runs as intended, and how that length reads in a message: `max_position_embeddings`,
    or for `SCALING_ROPE_TYPES` `factor` x `original_max_position_embeddings` where that is longer."""
    length, source = config.max_position_embeddings, f"`max_position_embeddings` ({config.max_position_embeddings})"
    parameters = config.rope_parameters
    factor, original = parameters.get("factor"), parameters.get("original_max_position_embeddings")
    if parameters.get("rope_type") in SCALING_ROPE_TYPES and factor and original and factor * original > length:
        length = int(factor * original)
        source = (
            f"the {length} positions of rope_type {parameters['rope_type']!r} (`factor` {factor} x "
            f"`original_max_position_embeddings` {original})"
        )
    return length, source


def default_rope_parameters(config, device=None, **kwargs) -> tuple[torch.Tensor, float]:
    """θ_i = base^(-2i/d) over the rotary dimension d = head_dim · partial_rotary_factor."""
    base = config.rope_parameters["rope_theta"]
    partial = config.rope_parameters.get("partial_rotary_factor", 1.0)
    dim = int(config.head_dim * partial)
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim))
    return inv_freq, 1.0


class RotaryEmbedding(nn.Module):
    """Computes (cos, sin) of shape (batch, seq, rotary_dim) for the given position ids, once per forward."""

    inv_freq: torch.Tensor

    def __init__(self, config, device=None, layer_type: str | None = None) -> None:
        super().__init__()
        if layer_type is not None:  # one set of per-layer-type parameters: a view of the config holding it alone
            config = copy.copy(config)
            config.rope_parameters = config.rope_parameters[layer_type]
        self.config = config
        self.max_seq_len_cached = config.max_position_embeddings
        self.original_max_seq_len = config.max_position_embeddings
        self.rope_type = config.rope_parameters.get("rope_type", "default")
        init_fn = default_rope_parameters if self.rope_type == "default" else ROPE_INIT_FUNCTIONS[self.rope_type]
        inv_freq, self.attention_scaling = init_fn(config, device)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("original_inv_freq", inv_freq.clone(), persistent=False)
        self.warned_past_max_positions = self.rope_type in LENGTH_EXTENDING_ROPE_TYPES
        self.intended_length, self.intended_length_source = rope_length(config)

    def warn_past_max_positions(self, position_ids: torch.Tensor, length: int | None = None) -> None:
        """Warn once if positions reach `max_position_embeddings` (for `SCALING_ROPE_TYPES`, the length they scale to:
        `rope_length`). `length` (largest position + 1) comes from shapes when the caller made the positions;
        otherwise the ids are read, on CPU only (never a device sync)."""
        if self.warned_past_max_positions or torch.compiler.is_compiling():
            return
        if length is None and position_ids.numel() and can_read_values(position_ids):
            length = int(position_ids.max()) + 1
        if length is None or length <= self.intended_length:
            return
        self.warned_past_max_positions = True
        extend = (
            "extend it with `rope_parameters` (e.g. rope_type 'yarn' or 'dynamic')"
            if self.rope_type == "default"
            else "a larger `rope_parameters['factor']` extends it further"
        )
        logger.warning(
            f"Position {length - 1} is past {self.intended_length_source}: RoPE has no position table, so the model "
            f"runs, but it was not trained this far and its outputs usually degrade; {extend} if this is intended. "
            "Shown once."
        )

    # transformers' `_init_weights` re-derives `inv_freq` through this name for the default rope type.
    compute_default_rope_parameters = staticmethod(default_rope_parameters)

    @torch.no_grad()
    @dynamic_rope_update  # recomputes inv_freq for the "dynamic" / "longrope" types
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)  # (B, T, rotary_dim)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


class LayerTypeRotaryEmbeddings(nn.Module):
    """One `RotaryEmbedding` per layer type of `rope_parameters` given per layer type; returns {layer type: (cos,
    sin)} for the layer types present."""

    def __init__(self, config, layer_types, device=None) -> None:
        super().__init__()
        self.per_type = nn.ModuleDict({kind: RotaryEmbedding(config, device, kind) for kind in layer_types})

    def warn_past_max_positions(self, position_ids: torch.Tensor, length: int | None = None) -> None:
        """`RotaryEmbedding.warn_past_max_positions` of each layer type's set, once for the model: the first set to
        warn silences the others."""
        for rotary in self.per_type.values():
            warned = rotary.warned_past_max_positions
            rotary.warn_past_max_positions(position_ids, length)
            if rotary.warned_past_max_positions and not warned:
                for other in self.per_type.values():
                    other.warned_past_max_positions = True
                return

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        return {kind: rotary(x, position_ids) for kind, rotary in self.per_type.items()}


def rope_types(config) -> list[str]:
    """The `rope_type` of each RoPE parameter set of `config` (flat, or one per layer type); [] without RoPE."""
    parameters = getattr(config, "rope_parameters", None)
    if getattr(config, "position_embedding_type", None) != "rope" or not isinstance(parameters, dict):
        return []
    sets = [value for value in parameters.values() if isinstance(value, dict)] or [parameters]
    return [p.get("rope_type", p.get("type", "default")) for p in sets]


def rotary_per_layer_type(config) -> bool:
    """Whether `rope_parameters` holds one parameter set per layer type (False for a config without it: the
    encoder-decoder's and the masked LM's)."""
    parameters = getattr(config, "rope_parameters", None)
    return isinstance(parameters, dict) and any(isinstance(value, dict) for value in parameters.values())


def with_query_scales(position_embeddings, position_ids: torch.Tensor, config):
    """The rotary tables (cos, sin), or one per layer type, with a third entry: each position's query scale
    1 + query_scaling_beta · log(1 + floor(p / query_scaling_length)), shaped (B or 1, 1, T, 1) to multiply the
    rotated queries (B, H, T, D) — Mistral 3's `llama_4_scaling` from the rows' own position ids (a left-padded row's
    count from its first token), as transformers' Ministral 3 computes it (float32, then the queries' dtype)."""
    if isinstance(position_embeddings, dict):
        return {kind: with_query_scales(tables, position_ids, config) for kind, tables in position_embeddings.items()}
    steps = torch.floor(position_ids.float() / config.query_scaling_length)
    scales = 1 + config.query_scaling_beta * torch.log(1 + steps)
    return (*position_embeddings, scales[:, None, :, None])


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(
    query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate (B, H, T, D) queries and keys; channels past cos.shape[-1] pass through (partial rotary). On CUDA in
    eager mode one compiled kernel forward and one backward (`compiled_kernels.py`), the formula elsewhere.

    Under autocast the kernel writes the autocast dtype: the formula's result is float32 there (the rotary table
    follows the float32 residual stream, as Llama's), and attention casts it down anyway — the kernel rounds the
    same float32 values once, and saves writing and reading them in float32."""
    if not ROTARY_KERNEL.serves(query, key, cos, sin):  # first: the dtype below is the kernel's alone
        return rotary_formula(query, key, cos, sin)
    device = query.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
    else:
        dtype = torch.promote_types(query.dtype, cos.dtype)
    fused = ROTARY_KERNEL(query, key, cos, sin, dtype)
    return fused if fused is not None else rotary_formula(query, key, cos, sin)


def _rotary_in(
    query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The formula, its results in `dtype` (what the compiled kernel computes)."""
    query, key = rotary_formula(query, key, cos, sin)
    return query.to(dtype), key.to(dtype)


def heads_side_by_side(query: torch.Tensor, key: torch.Tensor) -> torch.Tensor | None:
    """Queries (B, H, T, D) and keys (B, H_kv, T, D) as one (B, H + H_kv, T, D) view where the keys' heads follow the
    queries' in memory with the same strides — q/k/v read as one product (fused_projections.py: `generate` on CUDA)
    — else None. Eager inference only (no gradient, not compiling: compiled code fuses the formula anyway), where the
    rotation is otherwise ~5 kernels for each of the two: its eager prefill and decoding steps wait on the host."""
    if torch.compiler.is_compiling() or torch.jit.is_tracing():  # first: a trace reads no pointer
        return None
    if query.requires_grad or key.requires_grad or query.dim() != 4 or key.dim() != 4 or query.dtype != key.dtype:
        return None
    (batch, heads, length, width), (_, key_heads, key_length, key_width) = query.shape, key.shape
    if key.shape[0] != batch or key_length != length or key_width != width:
        return None
    strides, key_strides = query.stride(), key.stride()
    for size, stride, own in zip(key.shape, key_strides, strides):
        if size > 1 and stride != own:  # (a dimension of size 1 has any stride: a one-token step's)
            return None
    if key.data_ptr() != query.data_ptr() + heads * strides[1] * query.element_size():
        return None
    if key.untyped_storage().data_ptr() != query.untyped_storage().data_ptr():  # adjacent is not one tensor
        return None
    return query.as_strided((batch, heads + key_heads, length, width), strides, query.storage_offset())


def rotary_formula(
    query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`apply_rotary` written out: q · cos + rotate_half(q) · sin, the same for k (Llama's arithmetic)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # broadcast over heads
    rotary_dim = cos.shape[-1]
    if rotary_dim == query.shape[-1]:
        heads = heads_side_by_side(query, key)
        if heads is not None:  # q and k of one product: the same arithmetic in half the kernels
            rotated = heads * cos + rotate_half(heads) * sin
            return rotated[:, : query.shape[1]], rotated[:, query.shape[1] :]
        return query * cos + rotate_half(query) * sin, key * cos + rotate_half(key) * sin
    q_rot, q_pass = query[..., :rotary_dim], query[..., rotary_dim:]
    k_rot, k_pass = key[..., :rotary_dim], key[..., rotary_dim:]
    q_rot = q_rot * cos + rotate_half(q_rot) * sin
    k_rot = k_rot * cos + rotate_half(k_rot) * sin
    return torch.cat((q_rot, q_pass), dim=-1), torch.cat((k_rot, k_pass), dim=-1)


# Eager, the formula is ~8 kernels per tensor forward (multiply, split, negate, concatenate, multiply, add) and as
# many backward, each a full pass over q or k; compiled, one pass each way.
ROTARY_KERNEL = elementwise_kernel(_rotary_in, "the rotary embedding")
