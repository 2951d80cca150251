"""Mixture-of-experts feed-forward (seed 000 §5.2 "mixture of experts"; seed 002 "MoE: top-k gating and a
load-balancing loss").

A router scores each token against K expert FFNs, keeps the top k, and mixes their outputs with the softmax
weights (Shazeer et al. 2017; Mixtral, Jiang et al. 2024). Training adds the Switch Transformer load-balancing
loss (Fedus et al. 2021, eqs. 4-6, computed exactly as transformers' Mixtral does) and optionally the ST-MoE router
z-loss (Zoph et al. 2022, eq. 5). Shared experts that every token passes through follow Qwen2-MoE / DeepSeekMoE.

Parameter layout is Hugging Face v5's (`mlp.gate.weight`, `mlp.experts.gate_up_proj`, `mlp.experts.down_proj`,
`mlp.shared_expert.*`, `mlp.shared_expert_gate.weight`), so a Mixtral or Qwen2-MoE state dict loads as is.

Speed: the (token, slot) pairs are sorted by expert once per layer and both expert projections run as grouped
GEMMs over the sorted rows (`torch.nn.functional.grouped_mm`), with the backward pass written out as two more
grouped GEMMs (so that compiled graphs use the same opaque custom ops). No Python loop over experts, no
host synchronisation, no data-dependent shapes: the layer traces with `torch.compile(fullgraph=True)` and CUDA
graphs. The one-token decode step on CPU (eager, no gradients) instead runs k plain matrix-vector products on the
chosen experts, whose ids it reads on the host (free on CPU, faster than the grouped path's bookkeeping).
Builds without grouped_mm (torch < 2.9) or with feature sizes the kernel cannot stride over (it needs rows of a
multiple of 16 bytes) fall back to one GEMM per expert, which does synchronise.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init
from transformers.activations import ACT2FN

from .feed_forward import MLPS
from .validation import check_non_negative, check_positive

_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)

MLP_LAYER_TYPES = ("dense", "sparse")


# --------------------------------------------------------------------------------------------------------------
# Grouped GEMM: rows sorted by expert, `offsets[e]` = end row of expert e's group.


def _rows_aligned(*tensors: torch.Tensor) -> bool:
    """grouped_mm needs every non-unit stride to be a multiple of 16 bytes (a static, shape-only check)."""
    return all((stride * t.element_size()) % 16 == 0 for t in tensors for stride in t.stride() if stride != 1)


def _grouped_mm_eager(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Rows of group e of a (S, K) times b[e] (K, N) -> (S, N); one GEMM per expert without the kernel."""
    if _GROUPED_MM is not None and _rows_aligned(a, b):
        return _GROUPED_MM(a, b, offs=offsets)
    out = a.new_empty(a.shape[0], b.shape[-1])
    start = 0
    for expert, end in enumerate(offsets.tolist()):  # fallback only: reads the offsets on the host
        out[start:end] = a[start:end] @ b[expert]
        start = end
    return out


def _grouped_mm_tn_eager(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Per group e: a[rows of e]ᵀ @ b[rows of e] -> (E, M, N), zeros for empty groups (the weight gradient)."""
    a_t = a.t()
    if _GROUPED_MM is not None and _rows_aligned(a_t, b):
        return _GROUPED_MM(a_t, b, offs=offsets)
    out = a.new_zeros(offsets.shape[0], a.shape[1], b.shape[1])
    start = 0
    for expert, end in enumerate(offsets.tolist()):
        out[expert] = a[start:end].t() @ b[start:end]
        start = end
    return out


# torch.compile: the meta function of aten._grouped_mm accepts only bf16, so under compilation the kernels are
# opaque custom ops with their own shape functions (eager calls them directly and skips the dispatcher cost).
@torch.library.custom_op("archlab::grouped_mm", mutates_args=())
def _grouped_mm_op(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return _grouped_mm_eager(a, b, offsets)


@_grouped_mm_op.register_fake
def _(a, b, offsets):
    return a.new_empty(a.shape[0], b.shape[-1])


@torch.library.custom_op("archlab::grouped_mm_tn", mutates_args=())
def _grouped_mm_tn_op(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return _grouped_mm_tn_eager(a, b, offsets)


@_grouped_mm_tn_op.register_fake
def _(a, b, offsets):
    return a.new_empty(offsets.shape[0], a.shape[1], b.shape[1])


def _grouped_mm(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return _grouped_mm_op(a, b, offsets) if torch.compiler.is_compiling() else _grouped_mm_eager(a, b, offsets)


def _grouped_mm_tn(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return _grouped_mm_tn_op(a, b, offsets) if torch.compiler.is_compiling() else _grouped_mm_tn_eager(a, b, offsets)


def _one_token_on_cpu(hidden_states: torch.Tensor) -> bool:
    """Inference on CPU in eager mode with one token (a static check, no data read): `Experts._forward_one_token`."""
    return (
        hidden_states.shape[0] == 1
        and hidden_states.device.type == "cpu"
        and not torch.is_grad_enabled()
        and not torch.compiler.is_compiling()
    )


class GroupedLinear(torch.autograd.Function):
    """y[rows of e] = x[rows of e] @ weight[e]ᵀ for weight (E, out, in) stored like nn.Linear, rows sorted by e."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, weight, offsets)
        return _grouped_mm(x, weight.transpose(1, 2), offsets)  # (S, out)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):  # type: ignore[override]
        x, weight, offsets = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        grad_x = _grouped_mm(grad_out, weight, offsets) if ctx.needs_input_grad[0] else None  # (S, in)
        grad_weight = _grouped_mm_tn(grad_out, x, offsets) if ctx.needs_input_grad[1] else None  # (E, out, in)
        return grad_x, grad_weight, None


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Grouped `F.linear` over expert-sorted rows; follows autocast like `nn.Linear` does."""
    if torch.is_autocast_enabled(x.device.type):
        dtype = torch.get_autocast_dtype(x.device.type)
        x, weight = x.to(dtype), weight.to(dtype)
    else:
        x = x.to(weight.dtype)
    return GroupedLinear.apply(x, weight, offsets)


# --------------------------------------------------------------------------------------------------------------
# Router, experts, sparse block


class TopKRouter(nn.Module):
    """Linear scores → softmax over the K experts → top k (optionally renormalised to sum to 1)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, norm_topk_prob: bool) -> None:
        super().__init__()
        self.top_k = top_k
        self.num_experts = num_experts
        self.norm_topk_prob = norm_topk_prob
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        router_logits = F.linear(hidden_states, self.weight)  # (N, K)
        probs = torch.softmax(router_logits.float(), dim=-1)
        top_weights, top_index = torch.topk(probs, self.top_k, dim=-1)  # (N, k)
        if self.norm_topk_prob:
            top_weights = top_weights / top_weights.sum(dim=-1, keepdim=True)
        return router_logits, top_weights, top_index


class Experts(nn.Module):
    """K expert FFNs stored as 3-D tensors: gated `gate_up_proj` (K, 2f, d) = [gate; up], or plain `up_proj`
    (K, f, d); `down_proj` (K, d, f)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, hidden_act: str, gated: bool):
        super().__init__()
        self.num_experts = num_experts
        self.intermediate_size = intermediate_size
        self.gated = gated
        in_rows = 2 * intermediate_size if gated else intermediate_size
        if gated:
            self.gate_up_proj = nn.Parameter(torch.empty(num_experts, in_rows, hidden_size))
        else:
            self.up_proj = nn.Parameter(torch.empty(num_experts, in_rows, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.act_fn = ACT2FN[hidden_act]

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        """hidden_states (N, d), top_k_index/top_k_weights (N, k) -> Σ_slots weight · expert(x), (N, d)."""
        if _one_token_on_cpu(hidden_states):
            return self._forward_one_token(hidden_states, top_k_index, top_k_weights)
        k = top_k_index.shape[-1]
        sorted_experts, order = torch.sort(top_k_index.reshape(-1), stable=True)  # (S,) with S = N·k
        expert_ids = torch.arange(self.num_experts, device=sorted_experts.device)
        offsets = torch.searchsorted(sorted_experts, expert_ids, right=True).to(torch.int32)  # (K,) group ends
        token_index = order // k  # which token each sorted row belongs to
        x = hidden_states.index_select(0, token_index)  # (S, d); its backward is one index_add_
        if self.gated:
            gate, up = grouped_linear(x, self.gate_up_proj, offsets).chunk(2, dim=-1)  # (S, f) each
            h = self.act_fn(gate) * up
        else:
            h = self.act_fn(grouped_linear(x, self.up_proj, offsets))
        y = grouped_linear(h, self.down_proj, offsets)  # (S, d)
        y = y * top_k_weights.reshape(-1)[order].unsqueeze(-1).to(y.dtype)
        out = torch.zeros(hidden_states.shape, dtype=y.dtype, device=y.device)
        return out.index_add_(0, token_index, y).to(hidden_states.dtype)

    def _forward_one_token(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        """The one-token decode step on CPU: k plain matrix-vector products on the chosen experts' weights.

        Reading the k chosen experts on the host costs nothing on CPU, and at one token the grouped path's sort,
        gathers, scatter and per-expert kernel calls (including empty ones) cost more than they save.
        """
        out = None
        for expert, weight in zip(top_k_index[0].tolist(), top_k_weights[0].tolist()):
            if self.gated:
                gate, up = F.linear(hidden_states, self.gate_up_proj[expert]).chunk(2, dim=-1)
                h = self.act_fn(gate) * up
            else:
                h = self.act_fn(F.linear(hidden_states, self.up_proj[expert]))
            y = F.linear(h, self.down_proj[expert]) * weight  # (1, d)
            out = y if out is None else out.add_(y)
        return out.to(hidden_states.dtype)


class SparseMoeBlock(nn.Module):
    """Router + routed experts (+ shared experts): the `mlp` of a sparse layer.

    `forward` returns the mixed output; the layer's router logits (N, K) are left in `router_logits` for the
    model to collect (`collect_router_logits`), so the decoder blocks treat dense and sparse MLPs alike.
    """

    def __init__(self, config) -> None:
        super().__init__()
        mlp_type = getattr(config, "mlp_type", "gated")
        self.jitter_noise = config.router_jitter_noise
        self.gate = TopKRouter(
            config.hidden_size, config.num_local_experts, config.num_experts_per_tok, config.norm_topk_prob
        )
        self.experts = Experts(
            config.num_local_experts,
            config.hidden_size,
            config.moe_intermediate_size,
            config.hidden_act,
            gated=mlp_type == "gated",
        )
        self.shared_expert = self.shared_expert_gate = None
        if config.shared_expert_intermediate_size > 0:
            self.shared_expert = MLPS[mlp_type](
                config.hidden_size, config.shared_expert_intermediate_size, config.hidden_act, config.mlp_bias
            )
            if config.shared_expert_gate:
                self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)
        self.router_logits: torch.Tensor | None = None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])  # (N, d)
        if self.training and self.jitter_noise > 0:  # Mixtral's multiplicative input jitter
            x = x * torch.empty_like(x).uniform_(1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
        router_logits, top_weights, top_index = self.gate(x)
        out = self.experts(x, top_index, top_weights)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:  # Qwen2-MoE's per-token sigmoid gate on the shared expert
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        self.router_logits = router_logits
        return out.reshape(shape)


def build_sparse_mlp(config, layer_idx: int) -> SparseMoeBlock:
    return SparseMoeBlock(config)


def collect_router_logits(layers: Iterable[nn.Module]) -> tuple[torch.Tensor, ...]:
    """The router logits the sparse layers left in their last forward, in layer order (and clears them)."""
    collected = []
    for layer in layers:
        mlp = getattr(layer, "mlp", None)
        if isinstance(mlp, SparseMoeBlock) and mlp.router_logits is not None:
            collected.append(mlp.router_logits)
            mlp.router_logits = None
    return tuple(collected)


@torch.no_grad()
def init_moe_weights(module: nn.Module, std: float) -> None:
    """Normal(0, std) for the 3-D expert tensors and the router (nn.Linear parts are handled by transformers)."""
    if isinstance(module, Experts):
        for param in module.parameters(recurse=False):
            init.normal_(param, mean=0.0, std=std)
    elif isinstance(module, TopKRouter):
        init.normal_(module.weight, mean=0.0, std=std)


# --------------------------------------------------------------------------------------------------------------
# Auxiliary losses


def _rows_mask(router_logits: tuple[torch.Tensor, ...], attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """The (N,) float mask of real tokens for one layer's router rows (the last N // B columns of the mask)."""
    if attention_mask is None or attention_mask.dim() != 2:
        return None
    rows = router_logits[0].shape[0]
    batch = attention_mask.shape[0]
    return attention_mask[:, -(rows // batch) :].reshape(-1).to(router_logits[0].device, torch.float32)


def load_balancing_loss(
    router_logits: tuple[torch.Tensor, ...] | None,
    num_experts: int,
    top_k: int,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Switch Transformer's auxiliary loss K · Σ_e f_e · P_e, as transformers' Mixtral computes it.

    f_e: share of the (token, slot) assignments that went to expert e, P_e: mean router probability of e, both
    pooled over all sparse layers and the non-pad tokens. Equals k when routing is perfectly balanced.
    """
    if not router_logits:
        return None
    mask = _rows_mask(router_logits, attention_mask)
    logits = torch.cat([layer.to(router_logits[0].device) for layer in router_logits]).float()  # (L·N, K)
    probs = torch.softmax(logits, dim=-1)
    chosen = torch.topk(probs, top_k, dim=-1).indices  # (L·N, k)
    row_weight = (
        mask.repeat(len(router_logits)) if mask is not None else probs.new_ones(probs.shape[0])
    )  # (L·N,)
    counts = probs.new_zeros(num_experts).scatter_add_(
        0, chosen.reshape(-1), row_weight.repeat_interleave(top_k)
    )  # assignments per expert
    prob_sum = (probs * row_weight.unsqueeze(-1)).sum(dim=0)
    rows = row_weight.sum()
    return num_experts * torch.sum((counts / rows) * (prob_sum / rows))


def router_z_loss(
    router_logits: tuple[torch.Tensor, ...] | None, attention_mask: torch.Tensor | None = None
) -> torch.Tensor | None:
    """ST-MoE's router z-loss: mean over layers and non-pad tokens of (log Σ_e exp logit_e)²."""
    if not router_logits:
        return None
    mask = _rows_mask(router_logits, attention_mask)
    log_z = torch.stack([torch.logsumexp(layer.float(), dim=-1) for layer in router_logits])  # (L, N)
    if mask is None:
        return log_z.square().mean()
    return (log_z.square() * mask).sum() / (mask.sum() * len(router_logits)).clamp(min=1)


# --------------------------------------------------------------------------------------------------------------
# Parameter counts


def count_parameters(model: nn.Module) -> dict[str, int]:
    """Total parameters and the parameters one token actually uses (routed experts count k of K).

    Tied weights count once. Returns `{"total": ..., "active": ..., "embedding": ...}`; `embedding` is the input
    embedding (included in both totals) so non-embedding counts are one subtraction away.
    """
    total = sum(p.numel() for p in model.parameters())
    inactive = 0
    for module in model.modules():
        if isinstance(module, SparseMoeBlock):
            experts = sum(p.numel() for p in module.experts.parameters())
            inactive += experts * (module.gate.num_experts - module.gate.top_k) // module.gate.num_experts
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    return {
        "total": total,
        "active": total - inactive,
        "embedding": embedding.weight.numel() if embedding is not None else 0,
    }


# --------------------------------------------------------------------------------------------------------------
# Config defaults and checks (called by DecoderConfig)


def resolve_moe_defaults(config) -> None:
    """Fill `moe_intermediate_size` (= `intermediate_size`, as Mixtral), `mlp_layer_types` (all sparse when
    `num_local_experts` > 0, else all dense) and `router_aux_loss_coef` (Mixtral's 0.001 with sparse layers, else 0)."""
    if config.moe_intermediate_size is None:
        config.moe_intermediate_size = config.intermediate_size
    if config.mlp_layer_types is None and isinstance(config.num_hidden_layers, int):
        kind = "sparse" if config.num_local_experts > 0 else "dense"
        config.mlp_layer_types = [kind] * config.num_hidden_layers
    sparse = config.mlp_layer_types is not None and "sparse" in config.mlp_layer_types
    coef = config.router_aux_loss_coef
    if coef is None:
        config.router_aux_loss_coef = 0.001 if sparse else 0.0
    elif not sparse and isinstance(coef, (int, float)) and coef > 0:
        # No router to balance. A positive weight would make trainers that take it as the MoE marker (TRL) ask for
        # a load-balancing loss the model cannot return; files saved before this rule carry Mixtral's 0.001 here.
        config.router_aux_loss_coef = 0.0


def validate_moe(config) -> None:
    check_non_negative(config, "num_local_experts")
    check_positive(config, "num_experts_per_tok")
    check_non_negative(config, "router_aux_loss_coef")
    check_non_negative(config, "router_z_loss_coef")
    check_non_negative(config, "shared_expert_intermediate_size")
    if not 0.0 <= config.router_jitter_noise < 1.0:
        raise ValueError(f"`router_jitter_noise` must be in [0, 1), got {config.router_jitter_noise!r}.")
    types = config.mlp_layer_types
    if len(types) != config.num_hidden_layers:
        raise ValueError(
            f"`mlp_layer_types` has {len(types)} entries but `num_hidden_layers` is {config.num_hidden_layers}: "
            "give one of 'dense'/'sparse' per layer."
        )
    bad = sorted({t for t in types if t not in MLP_LAYER_TYPES})
    if bad:
        raise ValueError(f"`mlp_layer_types` contains {bad}; allowed values: {', '.join(map(repr, MLP_LAYER_TYPES))}.")
    if "sparse" in types:
        check_positive(config, "moe_intermediate_size")
        if config.num_local_experts < 1:
            raise ValueError(
                "`mlp_layer_types` has sparse layers, so `num_local_experts` must be a positive integer, got "
                f"{config.num_local_experts!r}."
            )
        if config.num_experts_per_tok > config.num_local_experts:
            raise ValueError(
                f"`num_experts_per_tok` ({config.num_experts_per_tok}) must be in [1, num_local_experts="
                f"{config.num_local_experts}]."
            )


__all__ = [
    "Experts",
    "GroupedLinear",
    "MLP_LAYER_TYPES",
    "SparseMoeBlock",
    "TopKRouter",
    "build_sparse_mlp",
    "collect_router_logits",
    "count_parameters",
    "grouped_linear",
    "init_moe_weights",
    "load_balancing_loss",
    "resolve_moe_defaults",
    "router_z_loss",
    "validate_moe",
]
