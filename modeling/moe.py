"""Mixture-of-experts feed-forward (seed 000 §5.2 "mixture of experts"; seed 002 "MoE: top-k gating and a
load-balancing loss").

A router scores each token against K expert FFNs, keeps the top k, and mixes their outputs with the softmax
weights (Shazeer et al. 2017; Mixtral, Jiang et al. 2024). Training adds the Switch Transformer load-balancing
loss (Fedus et al. 2021, eqs. 4-6, computed exactly as transformers' Mixtral does) and optionally the ST-MoE router
z-loss (Zoph et al. 2022, eq. 5). Shared experts that every token passes through follow Qwen2-MoE / DeepSeekMoE.

Parameter layout is Hugging Face v5's (`mlp.gate.weight`, `mlp.experts.gate_up_proj`, `mlp.experts.down_proj`,
`mlp.shared_expert.*`, `mlp.shared_expert_gate.weight`), so a Mixtral or Qwen2-MoE state dict loads as is.

Speed: the (token, slot) pairs are sorted by expert once per layer and both expert projections run as grouped
GEMMs over the sorted rows (`grouped_gemm.py`); the rows go there and back by gathers, so every sum over a token's
slots runs in the same order each time (`moe_slots.py`). No Python loop over experts, no host synchronisation, no
data-dependent shapes: the layer traces with `torch.compile(fullgraph=True)` and CUDA graphs. The one-token decode
step on CPU (eager, no gradients) instead runs k plain matrix-vector products on the chosen experts, whose ids it
reads on the host (free on CPU, faster than the grouped path's bookkeeping); a GPU candidate for a decoding step's
few tokens, two Triton kernels indexed by the router's choice, is in triton_moe.py.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init
from transformers.utils import logging

from .feed_forward import gated_activation, gated_options, make_activation, mlp_from_config
from .grouped_gemm import grouped_compute_dtype, grouped_linear
from .moe_slots import slots_to_tokens, sort_slots, tokens_to_slots
from .triton_moe import moe_decode, moe_decode_applies

logger = logging.get_logger(__name__)


def _one_token_on_cpu(hidden_states: torch.Tensor) -> bool:
    """Inference on CPU in eager mode with one token (a static check, no data read): `Experts._forward_one_token`."""
    return (
        hidden_states.shape[0] == 1
        and hidden_states.device.type == "cpu"
        and not torch.is_grad_enabled()
        and not torch.compiler.is_compiling()
    )


# --------------------------------------------------------------------------------------------------------------
# Router, experts, sparse block


class TopKRouter(nn.Module):
    """Linear scores → softmax over the K experts → top k (optionally renormalised to sum to 1). The linear map has a
    bias with `bias` (GPT-OSS, whose softmax over the top k logits is this softmax renormalised over the top k).

    With `score_function="sigmoid"` (DeepSeek-V3, GLM-4.5, dots.llm1) each expert's score is sigmoid(logit), not a
    softmax over the experts; with `correction_bias` a per-expert bias (`e_score_correction_bias`, DeepSeek-V3's
    auxiliary-loss-free balancing bias) is added to the scores to choose the top k but not to weigh them; the top-k
    weights are renormalised under `norm_topk_prob` and then times `routed_scaling_factor`. The scores and weights
    are computed in fp32, as transformers' routers compute them. The bias is a buffer: kept as loaded (as transformers
    keeps it) unless `bias_update_rate` γ > 0, DeepSeek-V3's auxiliary-loss-free balancing: training forwards count
    the slots each expert takes for the tokens the attention mask keeps (`expert_load`, `count_expert_loads`) and
    `update_router_biases`, called after each optimizer step (the Trainer callback
    `archlab.training.callbacks.RouterBiasCallback`), moves each expert's bias by γ towards the mean load. Both
    buffers stay float32 when the model is cast (`_apply`)."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        norm_topk_prob: bool,
        score_function: str = "softmax",
        correction_bias: bool = False,
        routed_scaling_factor: float = 1.0,
        bias_update_rate: float = 0.0,
        groups: int = 1,
        top_groups: int | None = None,
        bias: bool = False,
        group_score: str = "top2_sum",
    ) -> None:
        super().__init__()
        self.groups = groups
        self.group_score = group_score
        self.top_groups = groups if top_groups is None else top_groups
        self.top_k = top_k
        self.num_experts = num_experts
        self.norm_topk_prob = norm_topk_prob
        self.score_function = score_function
        self.routed_scaling_factor = float(routed_scaling_factor)
        self.bias_update_rate = float(bias_update_rate)
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.bias = nn.Parameter(torch.zeros(num_experts)) if bias else None  # the logits' bias (GPT-OSS)
        correction = torch.zeros(num_experts, dtype=torch.float32) if correction_bias else None
        self.register_buffer("e_score_correction_bias", correction)
        # the slots each expert took in training since the last balancing step
        load = torch.zeros(num_experts, dtype=torch.float32) if correction_bias and bias_update_rate > 0 else None
        self.register_buffer("expert_load", load, persistent=False)

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.route(F.linear(hidden_states, self.weight, self.bias))  # (N, K) logits

    def route(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(logits, top-k weights, top-k experts) from the (N, K) logits (the fused layer step computes them)."""
        scores = router_scores(router_logits, self.score_function)
        if self.e_score_correction_bias is None and self.top_groups == self.groups:
            top_weights, top_index = torch.topk(scores, self.top_k, dim=-1)  # (N, k)
        else:  # the bias (and the groups) choose, the scores weigh
            top_index = torch.topk(self.choice_scores(scores), self.top_k, dim=-1).indices
            top_weights = scores.gather(-1, top_index)
        if self.norm_topk_prob:
            top_weights = top_weights / top_weights.sum(dim=-1, keepdim=True)
        if self.routed_scaling_factor != 1.0:
            top_weights = top_weights * self.routed_scaling_factor
        return router_logits, top_weights, top_index

    def choice_scores(self, scores: torch.Tensor) -> torch.Tensor:
        """The (N, K) fp32 scores the top k is chosen by: plus the correction bias, and with group-limited routing
        (DeepSeek-V3's `n_group` / `topk_group`) -inf outside each token's `top_groups` best groups, a group scored
        by the sum of its two best (as transformers' GLM-4.5 and dots.llm1 routers choose), or by its best one
        (`group_score="max"`: DeepSeek-V2's group-limited greedy routing)."""
        if self.e_score_correction_bias is not None:
            scores = scores + self.e_score_correction_bias.float()
        if self.top_groups == self.groups:
            return scores
        rows, experts = scores.shape
        grouped = scores.view(rows, self.groups, experts // self.groups)
        if self.group_score == "max":
            group_scores = grouped.max(dim=-1).values  # (N, groups)
        else:
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        chosen = torch.topk(group_scores, self.top_groups, dim=-1).indices
        kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, chosen, True)
        return grouped.masked_fill(~kept[..., None], -math.inf).view(rows, experts)

    @torch.no_grad()
    def count_load(self, router_logits: torch.Tensor, rows_mask: torch.Tensor | None) -> None:
        """Add the slots each expert took for the (N, K) `router_logits` of a training forward to `expert_load`,
        the rows `rows_mask` zeroes (padding) left out: the experts the bias chose, as `route` chose them."""
        scores = router_scores(router_logits.detach(), self.score_function)
        top_index = torch.topk(self.choice_scores(scores), self.top_k, dim=-1).indices  # (N, k)
        if rows_mask is None:
            counted = torch.ones(top_index.shape, dtype=torch.float32, device=top_index.device)
        else:
            counted = rows_mask[:, None].expand(top_index.shape)
        self.expert_load.scatter_add_(0, top_index.reshape(-1), counted.reshape(-1).to(self.expert_load.dtype))

    def _apply(self, fn, recurse=True):
        """`Module._apply` (`.to`, `.half()`, `.cuda()` ...), the balancing buffers kept in float32 whatever the
        model is cast to: in bf16 a bias of ~1 moves in steps of 2^-7 (a γ of 1e-3 would never move it) and a count
        past 256 rounds. They go to the device `fn` moves them to."""
        kept = {
            name: self._buffers.pop(name)
            for name in ("e_score_correction_bias", "expert_load")
            if self._buffers.get(name) is not None and self._buffers[name].dtype == torch.float32
        }
        super()._apply(fn, recurse)
        for name, buffer in kept.items():
            moved = fn(buffer)
            if moved.dtype != torch.float32:  # cast: the float32 values on the device `fn` chose
                meta = buffer.is_meta
                moved = torch.empty_like(moved, dtype=torch.float32) if meta else buffer.to(moved.device)
            self._buffers[name] = moved
        return self


def router_scores(router_logits: torch.Tensor, score_function: str = "softmax") -> torch.Tensor:
    """Each token's (N, K) expert scores in fp32: a softmax over the experts (Mixtral) or each expert's sigmoid
    (DeepSeek-V3)."""
    logits = router_logits.float()
    return torch.sigmoid(logits) if score_function == "sigmoid" else torch.softmax(logits, dim=-1)


class Experts(nn.Module):
    """K expert FFNs stored as 3-D tensors: gated `gate_up_proj` (K, 2f, d) = [gate; up], or plain `up_proj`
    (K, f, d); `down_proj` (K, d, f)."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        hidden_act: str,
        gated: bool,
        bias: bool = False,
        limit: float | None = None,
        up_offset: float = 0.0,
        weights_on_input: bool = False,
    ):
        super().__init__()
        self.num_experts = num_experts
        self.intermediate_size = intermediate_size
        self.gated = gated
        in_rows = 2 * intermediate_size if gated else intermediate_size
        self.in_name = "gate_up_proj" if gated else "up_proj"
        self.register_parameter(self.in_name, nn.Parameter(torch.empty(num_experts, in_rows, hidden_size)))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        # GPT-OSS: a bias per expert on both products (`gate_up_proj_bias` (K, 2f), `down_proj_bias` (K, d))
        self.register_parameter(
            f"{self.in_name}_bias", nn.Parameter(torch.zeros(num_experts, in_rows)) if bias else None
        )
        self.down_proj_bias = nn.Parameter(torch.zeros(num_experts, hidden_size)) if bias else None
        self.hidden_act = hidden_act
        self.act_fn = make_activation(hidden_act)
        self.limit, self.up_offset = limit, float(up_offset)  # GPT-OSS's clamps and offset (feed_forward.py)
        # Llama 4: an expert reads the token times its routing weight, the outputs summed unweighted
        self.weights_on_input = weights_on_input

    def _activation(self, projected: torch.Tensor) -> torch.Tensor:
        """act(gate) ⊙ up of a gated expert's (…, 2f) product (with its clamps and offset); act(up) of a plain one."""
        if not self.gated:
            return self.act_fn(projected)
        gate, up = projected.chunk(2, dim=-1)
        return gated_activation(self.hidden_act, self.act_fn, gate, up, self.limit, self.up_offset)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        """hidden_states (N, d), top_k_index/top_k_weights (N, k) -> Σ_slots weight · expert(x), (N, d). With biases
        (GPT-OSS) each sorted row gets its expert's, gathered (backward, summed into each expert's bias by an
        index-add: atomic, so not bit-reproducible on a GPU as the rest of the layer is)."""
        if moe_decode_applies(self, hidden_states):  # a decoding step's few tokens: two Triton kernels (triton_moe.py)
            return moe_decode(self, hidden_states, top_k_index, top_k_weights)
        if _one_token_on_cpu(hidden_states):
            return self._forward_one_token(hidden_states, top_k_index, top_k_weights)
        if torch.onnx.is_in_onnx_export():  # ONNX has no stable sort and no grouped GEMM: `_forward_every_expert`
            return self._forward_every_expert(hidden_states, top_k_index, top_k_weights)
        order, inverse, offsets = sort_slots(top_k_index, self.num_experts)  # S = N·k slots (moe_slots.py)
        dtype = grouped_compute_dtype(hidden_states, self.down_proj)
        x = tokens_to_slots(hidden_states, order, inverse, top_k_index.shape[-1], dtype)  # (S, d), expert order
        if self.weights_on_input:  # Llama 4: each slot's row times its weight; the outputs summed with weight 1
            x = x * top_k_weights.reshape(-1).index_select(0, order).unsqueeze(-1).to(dtype)
            top_k_weights = torch.ones_like(top_k_weights)
        # each sorted row's expert, for the biases (GPT-OSS)
        experts = None if self.down_proj_bias is None else top_k_index.reshape(-1).index_select(0, order)
        projected = self._with_bias(grouped_linear(x, getattr(self, self.in_name), offsets), self.in_name, experts)
        y = self._with_bias(grouped_linear(self._activation(projected), self.down_proj, offsets), "down_proj", experts)
        return slots_to_tokens(y, top_k_weights, order, inverse).to(hidden_states.dtype)

    def _with_bias(self, rows: torch.Tensor, name: str, experts: torch.Tensor | None) -> torch.Tensor:
        """A product's rows (S, n) plus the bias of each row's expert (`experts`, (S,)), where the experts have
        biases."""
        bias = getattr(self, f"{name}_bias")
        return rows if bias is None else rows + bias.to(rows.dtype).index_select(0, experts)

    def _forward_every_expert(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """Every expert over every token, mixed with the routing weights scattered to (N, K) (zero for the experts a
        token did not choose): the same sum as the sorted path, in K / k times its FLOPs, from batched matrix
        products alone. For `torch.onnx.export`, whose ONNX has no translation of the expert sort's stable
        `aten.sort` nor of the grouped GEMMs' custom ops (transformers' Mixtral fails on its grouped GEMM too)."""
        dtype = grouped_compute_dtype(hidden_states, self.down_proj)
        x = hidden_states.to(dtype).unsqueeze(0)  # (1, N, d)
        weights = torch.zeros(
            top_k_index.shape[0], self.num_experts, dtype=top_k_weights.dtype, device=top_k_weights.device
        ).scatter(1, top_k_index, top_k_weights)  # (N, K)
        if self.weights_on_input:  # Llama 4: expert e reads x · w_e (zero where not chosen), its output weighed 1
            x = x * weights.t().unsqueeze(-1).to(dtype)  # (K, N, d)
            weights = torch.zeros_like(weights).scatter(1, top_k_index, 1.0)
        projected = torch.matmul(x, getattr(self, self.in_name).to(dtype).transpose(1, 2))  # (K, N, 2f or f)
        projected = self._every_expert_bias(projected, self.in_name)
        y = torch.matmul(self._activation(projected), self.down_proj.to(dtype).transpose(1, 2))  # (K, N, d)
        y = self._every_expert_bias(y, "down_proj")
        out = (weights.t().unsqueeze(-1).to(dtype) * y).sum(dim=0)  # (N, d)
        return out.to(hidden_states.dtype)

    def _every_expert_bias(self, products: torch.Tensor, name: str) -> torch.Tensor:
        """Every expert's (K, N, n) product plus its bias (K, n), where the experts have biases."""
        bias = getattr(self, f"{name}_bias")
        return products if bias is None else products + bias.to(products.dtype).unsqueeze(1)

    def _forward_one_token(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        """The one-token decode step on CPU: k plain matrix-vector products on the chosen experts' weights.

        Reading the k chosen experts on the host costs nothing on CPU, and at one token the grouped path's sort,
        gathers, scatter and per-expert kernel calls (including empty ones) cost more than they save.
        """
        out = None
        in_bias, down_bias = getattr(self, f"{self.in_name}_bias"), self.down_proj_bias
        for expert, weight in zip(top_k_index[0].tolist(), top_k_weights[0].tolist()):
            x = hidden_states * weight if self.weights_on_input else hidden_states  # (Llama 4: the input weighed)
            in_rows = F.linear(x, getattr(self, self.in_name)[expert], _row(in_bias, expert))
            y = F.linear(self._activation(in_rows), self.down_proj[expert], _row(down_bias, expert))  # (1, d)
            y = y if self.weights_on_input else y * weight
            out = y if out is None else out.add_(y)
        return out.to(hidden_states.dtype)


def _row(bias: torch.Tensor | None, expert: int) -> torch.Tensor | None:
    return None if bias is None else bias[expert]


class SparseMoeBlock(nn.Module):
    """Router + routed experts (+ shared experts): the `mlp` of a sparse layer.

    `forward` returns the mixed output; the layer's router logits (N, K) are left in `router_logits` for the
    model to collect (`collect_router_logits`), so the decoder blocks treat dense and sparse MLPs alike.
    """

    def __init__(self, config) -> None:
        super().__init__()
        mlp_type = getattr(config, "mlp_type", "gated")
        self.jitter_noise = config.router_jitter_noise
        # read here, not from `gate`: PEFT's `target_parameters` wraps the router and the experts (a `ParamWrapper`
        # that does not forward their attributes)
        self.num_experts, self.top_k = config.num_local_experts, config.num_experts_per_tok
        self.gate = TopKRouter(
            config.hidden_size,
            config.num_local_experts,
            config.num_experts_per_tok,
            config.norm_topk_prob,
            score_function=getattr(config, "router_score_function", "softmax"),
            correction_bias=getattr(config, "router_correction_bias", False),
            routed_scaling_factor=getattr(config, "routed_scaling_factor", 1.0),
            bias_update_rate=getattr(config, "router_bias_update_rate", 0.0),
            groups=getattr(config, "router_groups", 1),
            top_groups=getattr(config, "router_top_groups", None),
            bias=getattr(config, "router_bias", False),
            group_score=getattr(config, "router_group_score", "top2_sum"),
        )
        self.experts = Experts(
            config.num_local_experts,
            config.hidden_size,
            config.moe_intermediate_size,
            config.hidden_act,
            gated=mlp_type == "gated",
            bias=getattr(config, "expert_bias", False),
            weights_on_input=getattr(config, "routing_weights_on_input", False),
            **(gated_options(config) if mlp_type == "gated" else {}),
        )
        self.shared_expert = self.shared_expert_gate = None
        if config.shared_expert_intermediate_size > 0:
            self.shared_expert = mlp_from_config(config, config.shared_expert_intermediate_size)
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


def collect_router_logits(layers: Iterable[nn.Module]) -> tuple[torch.Tensor, ...]:
    """The router logits the sparse layers left in their last forward, in layer order (and clears them)."""
    collected = []
    trains_a_router = False
    for layer in layers:
        mlp = getattr(layer, "mlp", None)
        if isinstance(mlp, SparseMoeBlock) and mlp.router_logits is not None:
            collected.append(mlp.router_logits)
            mlp.router_logits = None
            trains_a_router = trains_a_router or any(p.requires_grad for p in mlp.gate.parameters())  # or its LoRA
    if trains_a_router and torch.is_grad_enabled() and not any(logits.requires_grad for logits in collected):
        # reentrant checkpointing runs each layer's forward without autograd and gives back only its output: the
        # logits left beside it carry no graph, so the router losses would train nothing (Mixtral's do the same)
        logger.warning_once(
            "The mixture of experts' router logits carry no gradient (gradient checkpointing with "
            "use_reentrant=True): the load-balancing and router z-losses train nothing. Use "
            "gradient_checkpointing_kwargs={'use_reentrant': False}, transformers' default."
        )
    return tuple(collected)


def count_expert_loads(layers: Iterable[nn.Module], attention_mask: torch.Tensor | None) -> None:
    """In a training forward, each balancing router (`TopKRouter.expert_load`) counts the slots its experts took, from
    the router logits its sparse layer left (call before `collect_router_logits` clears them); the tokens a 2-D
    `attention_mask` pads out are not counted (a padded batch's pads would push the biases against the experts
    they route to). Counted once a forward: a checkpointed layer's recomputation does not count again."""
    for layer in layers:
        mlp = getattr(layer, "mlp", None)
        if not isinstance(mlp, SparseMoeBlock) or mlp.router_logits is None:
            continue
        # the router itself, inside PEFT's wrapper where `target_parameters` wrapped it (which forwards no attribute)
        router = next(module for module in mlp.gate.modules() if isinstance(module, TopKRouter))
        if router.expert_load is not None:
            router.count_load(mlp.router_logits, _rows_mask((mlp.router_logits,), attention_mask))


@torch.no_grad()
def update_router_biases(model: nn.Module) -> int:
    """DeepSeek-V3's auxiliary-loss-free balancing step (Liu et al. 2024, §2.1.2), for every router with a correction
    bias and `bias_update_rate` γ > 0: b_e += γ · sign(mean load − load_e) over the slots counted since the last
    call, which are then cleared. Call it after each optimizer step; under data parallelism on every process, where
    the counts are summed first (a collective) so every replica moves its biases alike. Returns the routers updated."""
    routers = [m for m in model.modules() if isinstance(m, TopKRouter) and m.expert_load is not None]
    if not routers:
        return 0
    loads = torch.stack([router.expert_load for router in routers])  # (routers, K)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(loads)
    for router, load in zip(routers, loads):
        step = router.bias_update_rate * torch.sign(load.mean() - load)
        router.e_score_correction_bias.add_(step.to(router.e_score_correction_bias.dtype))
        router.expert_load.zero_()
    return len(routers)


@torch.no_grad()
def init_moe_weights(module: nn.Module, std: float) -> None:
    """Normal(0, std) for the 3-D expert tensors and the router, zeros for their biases (nn.Linear parts are handled by
    transformers)."""
    if isinstance(module, Experts):
        for name, param in module.named_parameters(recurse=False):
            (init.zeros_ if name.endswith("_bias") else partial(init.normal_, mean=0.0, std=std))(param)
    elif isinstance(module, TopKRouter):
        init.normal_(module.weight, mean=0.0, std=std)
        if module.bias is not None:
            init.zeros_(module.bias)


# --------------------------------------------------------------------------------------------------------------
# Auxiliary losses


def _rows_mask(router_logits: tuple[torch.Tensor, ...], attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """The (N,) float mask of real tokens for one layer's router rows (the last N // B columns of the mask)."""
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
        return None  # no mask, a 4-D mask, or the masks `generate` builds per layer type for a static cache (a dict)
    rows = router_logits[0].shape[0]
    batch = attention_mask.shape[0]
    return attention_mask[:, -(rows // batch) :].reshape(-1).to(router_logits[0].device, torch.float32)


def load_balancing_loss(
    router_logits: tuple[torch.Tensor, ...] | None,
    num_experts: int,
    top_k: int,
    attention_mask: torch.Tensor | None = None,
    score_function: str = "softmax",
) -> torch.Tensor | None:
    """Switch Transformer's auxiliary loss K · Σ_e f_e · P_e, as transformers' Mixtral computes it.

    f_e: share of the (token, slot) assignments that went to expert e, P_e: mean router probability of e, both
    pooled over all sparse layers and the non-pad tokens. Equals k when routing is perfectly balanced. Under sigmoid
    scores the probabilities are each token's scores normalised to sum to 1 (DeepSeek-V3's balance loss); the
    assignments are the top k of the scores (a router's correction bias, which only training-free balancing moves,
    is not counted).
    """
    if not router_logits:
        return None
    mask = _rows_mask(router_logits, attention_mask)
    logits = torch.cat([layer.to(router_logits[0].device) for layer in router_logits]).float()  # (L·N, K)
    probs = router_scores(logits, score_function)
    if score_function == "sigmoid":
        probs = probs / probs.sum(dim=-1, keepdim=True)
    chosen = torch.topk(probs, top_k, dim=-1).indices  # (L·N, k)
    row_weight = mask.repeat(len(router_logits)) if mask is not None else probs.new_ones(probs.shape[0])  # (L·N,)
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
            inactive += experts * (module.num_experts - module.top_k) // module.num_experts
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    return {
        "total": total,
        "active": total - inactive,
        "embedding": embedding.weight.numel() if embedding is not None else 0,
    }


__all__ = [
    "Experts",
    "SparseMoeBlock",
    "TopKRouter",
    "collect_router_logits",
    "count_expert_loads",
    "count_parameters",
    "init_moe_weights",
    "load_balancing_loss",
    "router_scores",
    "router_z_loss",
    "update_router_biases",
]
