"""A mixture-of-experts layer's rows moved into expert order and back, by permutation: deterministic for any top-k.

Each token is sent to k experts: its (token, slot) pairs, S = N·k of them, are sorted by expert so that the expert
products run as grouped GEMMs over contiguous rows (grouped_gemm.py). `sort_slots` gives the sort's permutation
`order` (sorted row i is flat slot order[i], token order[i] // k), its inverse `inverse` (flat slot j sits at
sorted row inverse[j]) and each expert's end row.

Going there and back with scatter-adds (`index_add_`, as transformers' Mixtral does) sums a token's k slots with
atomic additions in whatever order the GPU runs them: from k = 3 the bf16 sums change from run to run, in the
forward's mixture and in the backward of the input's gather alike (inductor lowers both to atomic adds too). Here
both ways are gathers: `tokens_to_slots` copies each token's row to its k sorted rows and, backward, gathers a
token's k gradient rows by `inverse` and sums them; `slots_to_tokens` gathers each token's k expert outputs by
`inverse` and mixes them with the routing weights (Σ_j w_j · y_j: eagerly one batched product over a (k × d) matrix
per token, as torchtitan's MoE does; compiled, a multiply and a sum that inductor fuses with the gather into one
kernel, where it would keep a bmm as a separate cuBLAS call), whose backward gathers by `order`. The same sums in
the same order every run, and fewer passes over the (S × d) rows than weighting them, zero-filling the output and
scattering onto it.
"""

from __future__ import annotations

import torch


def sort_slots(top_k_index: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(order, inverse, offsets) of the (N, k) expert choices: the stable sort of the flat slots by expert, its
    inverse permutation, and the end row of each expert's group (int32, grouped_mm's `offs`)."""
    sorted_experts, order = torch.sort(top_k_index.reshape(-1), stable=True)  # (S,)
    expert_ids = torch.arange(num_experts, device=sorted_experts.device)
    offsets = torch.searchsorted(sorted_experts, expert_ids, right=True).to(torch.int32)
    rows = torch.arange(order.shape[0], device=order.device, dtype=order.dtype)
    inverse = torch.empty_like(order).scatter_(0, order, rows)  # a permutation: no two writes to one place
    return order, inverse, offsets


class _TokensToSlots(torch.autograd.Function):
    """(N, d) token rows -> (S, d) rows in expert order, cast to the experts' dtype before the copy (half the bytes
    under bf16 autocast); backward: each token's k gradient rows gathered and summed in the input's dtype."""

    @staticmethod
    def forward(ctx, hidden, order, inverse, top_k: int, dtype: torch.dtype) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(inverse)
        ctx.tokens, ctx.top_k, ctx.input_dtype = hidden.shape[0], top_k, hidden.dtype
        return hidden.to(dtype).index_select(0, torch.div(order, top_k, rounding_mode="floor"))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        (inverse,) = ctx.saved_tensors
        per_token = grad.index_select(0, inverse).view(ctx.tokens, ctx.top_k, grad.shape[-1])
        return per_token.sum(dim=1, dtype=ctx.input_dtype), None, None, None, None


class _SlotsToTokens(torch.autograd.Function):
    """(S, d) expert outputs in expert order and (N, k) routing weights -> (N, d) = Σ_j w[n, j] · y[slot (n, j)]."""

    @staticmethod
    def forward(ctx, y, weights, order, inverse) -> torch.Tensor:  # type: ignore[override]
        tokens, top_k = weights.shape
        slots = y.index_select(0, inverse).view(tokens, top_k, y.shape[-1])  # (N, k, d), token order
        mix = weights.to(y.dtype).unsqueeze(1)  # (N, 1, k)
        ctx.save_for_backward(slots, mix, order)
        ctx.weights_dtype = weights.dtype
        if torch.compiler.is_compiling():  # one fused gather-multiply-sum kernel (inductor keeps a bmm extern)
            return (slots * mix.transpose(1, 2)).sum(dim=1)
        return torch.bmm(mix, slots).squeeze(1)  # eager: no (N, k, d) product written

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        slots, mix, order = ctx.saved_tensors
        grad = grad.to(slots.dtype).unsqueeze(1)  # (N, 1, d)
        grad_weights = None
        if ctx.needs_input_grad[1] and torch.compiler.is_compiling():
            grad_weights = (grad * slots).sum(dim=-1).to(ctx.weights_dtype)  # (N, k), fused
        elif ctx.needs_input_grad[1]:
            grad_weights = torch.bmm(grad, slots.transpose(1, 2)).squeeze(1).to(ctx.weights_dtype)  # (N, k)
        grad_y = None
        if ctx.needs_input_grad[0]:
            grad_slots = mix.transpose(1, 2) * grad  # (N, k, d): w[n, j] · grad[n]
            grad_y = grad_slots.flatten(0, 1).index_select(0, order)
        return grad_y, grad_weights, None, None


def tokens_to_slots(
    hidden: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor, top_k: int, dtype: torch.dtype
) -> torch.Tensor:
    """Each token's row once per chosen expert, in expert order, in `dtype` (S, d); its backward sums without
    atomics."""
    return _TokensToSlots.apply(hidden, order, inverse, top_k, dtype)


def slots_to_tokens(y: torch.Tensor, weights: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """The expert outputs y (S, d, expert order) mixed back per token with the (N, k) routing weights: (N, d)."""
    return _SlotsToTokens.apply(y, weights, order, inverse)


__all__ = ["slots_to_tokens", "sort_slots", "tokens_to_slots"]
