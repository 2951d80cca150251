"""Projections that read one input, computed as one matrix product at inference: q/k/v, and an MLP's gate/up.

A decoding step on a GPU is a few hundred small kernels, and the matrix products are most of its bytes: for a 1B
Llama-shaped model at batch 1, seven matrix-vector products per layer, three of them (k, v at 1 MB each, q at 8 MB)
too small to reach the memory bandwidth. Reading q, k and v as one (q + k + v rows) matrix, and gate and up as one,
makes four products per layer out of seven, each larger; serving stacks do the same (vLLM's `QKVParallelLinear`
and `MergedColumnParallelLinear`, gpt-fast's `wqkv`). Checkpoints, parameter names and PEFT's `target_modules`
stay Llama's because the parameters stay separate: only their storage moves.

`inference_projections(model)` — `generate` runs in it on CUDA — lays each group out side by side the first time:
its weights (and biases) are copied into one new block and every parameter becomes a view of its rows — the same
`nn.Parameter` objects and values, the same memory once the old storage is freed; an optimizer's in-place updates
keep the layout, so later entries find it and copy nothing. Inside, a forward that records no gradient reads each
group as one matrix (`FusableProjections.fused_weights`), compiled or not; outside, and wherever the layout does not
hold, the projections run as before. Nothing refers to a block outside the context (the parameters' views hold the
memory), so a model whose parameters are later replaced — `.to()`, FSDP, `load_state_dict(assign=True)` — keeps
no stale copy.

Modules with hooks on a projection (accelerate's offload hooks, DeepSpeed ZeRO-3, a user's forward hook), other
`nn.Linear` subclasses (LoRA, quantized layers), tensor subclasses (DTensor) and mixed dtypes or devices are left as
they are. Parameters that are views of someone else's buffer (DeepSpeed's and FSDP's flat parameters, which their
optimizers update through the buffer) are never moved: read as one product where they already lie side by side,
separately otherwise. `FUSED_PROJECTION_DEVICES` lists where `generate` enters the context: CUDA, where the step is
launch- and bandwidth-bound; on CPU the products run at the same rate separate or fused, and nothing changes.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from transformers.utils import logging

logger = logging.get_logger(__name__)

# The devices on which `generate` reads the projections as one product per group (`inference_projections`).
FUSED_PROJECTION_DEVICES: tuple[str, ...] = ("cuda",)


class FusableProjections:
    """Mixin for an `nn.Module` whose child `nn.Linear`s named in `fusable` read the same input: inside
    `inference_projections` it computes them as one product (`fused_weights`), outputs side by side in `fusable`'s
    order."""

    fusable: tuple[str, ...] = ()
    _fused: tuple[torch.Tensor, torch.Tensor | None] | None = None  # (weight, bias) views, inside the context only

    def fused_weights(self) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """(weight, bias) of the projections as one linear layer when this forward may use them, else None."""
        fused = self._fused
        if fused is None or torch.is_grad_enabled():
            return None
        if torch.compiler.is_compiling():  # the context checked the layout on entry; compiled code cannot
            return fused
        if torch.jit.is_tracing():  # a trace would keep the block as a constant
            return None
        return fused if _is_laid_out(self, fused) else None  # eager: checked per call (~5 µs)


def _linears(module: FusableProjections) -> list[nn.Module]:
    return [module._modules[name] for name in module.fusable]  # type: ignore[attr-defined]  # (getattr: 5x slower)


def _side_by_side_in_memory(parts: list[torch.Tensor]) -> bool:
    """Whether `parts` are contiguous and lie one after the other in memory, in order, with one dtype and one row
    shape (pointer arithmetic only, a few µs). Addresses are unique across devices (CUDA's unified address space),
    so equal addresses mean the same memory — but not the same storage (`_view_over` checks that too)."""
    first = parts[0]
    address, size, row = first.data_ptr(), first.element_size(), first.shape[1:]
    for part in parts:
        if part.data_ptr() != address or part.dtype != first.dtype or part.shape[1:] != row:
            return False
        if not part.is_contiguous():
            return False
        address += part.numel() * size
    return True


def _views_in_order(parts: list[torch.Tensor | None], block: torch.Tensor | None) -> bool:
    """Whether `parts` are, in order, the consecutive rows of the contiguous `block` (all None for a None block).
    Pointers only: the block keeps its storage alive, so no other storage can own memory inside it."""
    if block is None:
        return all(part is None for part in parts)
    if any(part is None for part in parts) or not _side_by_side_in_memory(parts):
        return False
    return (
        parts[0].data_ptr() == block.data_ptr()
        and parts[0].dtype == block.dtype
        and sum(part.numel() for part in parts) == block.numel()
    )


def _is_laid_out(module: FusableProjections, fused: tuple[torch.Tensor, torch.Tensor | None]) -> bool:
    """The projections are still plain `nn.Linear`s whose parameters are views of the blocks (pointer checks)."""
    linears = _linears(module)
    if any(type(linear) is not nn.Linear for linear in linears):
        return False
    weight, bias = fused
    return _views_in_order([linear._parameters["weight"] for linear in linears], weight) and _views_in_order(
        [linear._parameters["bias"] for linear in linears], bias
    )


def _hooked(linear: nn.Module) -> bool:
    """Forward hooks, or a forward replaced on the instance (accelerate's `add_hook_to_module` does that)."""
    return bool(linear._forward_hooks or linear._forward_pre_hooks) or "forward" in linear.__dict__


def _storage_of(tensor: torch.Tensor) -> tuple[int, int]:
    storage = tensor.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


def _may_move(parameter: torch.Tensor, laid_out_at: set[tuple[int, int]]) -> bool:
    """A parameter may get new storage when it owns its storage whole, or when that storage is a block this module
    laid out earlier (`laid_out_at`). A view of anything larger belongs to someone else's layout — DeepSpeed's and
    FSDP's flat parameters, which their optimizers update through the buffer: moving it would detach it."""
    whole = (
        parameter.storage_offset() == 0 and parameter.numel() * parameter.element_size() == _storage_of(parameter)[1]
    )
    return whole or _storage_of(parameter) in laid_out_at


def _fusion_blocker(linears: list[nn.Module], laid_out_at: set[tuple[int, int]]) -> str | None:
    """Why these plain, unhooked projections (all with a bias or none: `_enter` checked) cannot be moved into one
    block, or None."""
    weights = [linear.weight for linear in linears]
    biases = [linear.bias for linear in linears]
    tensors = weights + [bias for bias in biases if bias is not None]
    if any(type(tensor.data) is not torch.Tensor or tensor.is_meta for tensor in tensors):
        return "a parameter is a tensor subclass or on the meta device"
    if any(not _may_move(tensor, laid_out_at) for tensor in tensors):
        return "a parameter is a view of a larger buffer (an optimizer's or a wrapper's flat parameters)"
    if len({(tensor.device, tensor.dtype) for tensor in tensors}) != 1:
        return "the parameters differ in device or dtype"
    if len({weight.shape[1] for weight in weights}) != 1:
        return "the projections differ in input size"
    return None


def _view_over(parameters: list[nn.Parameter]) -> torch.Tensor | None:
    """The (rows of all, ...) view over `parameters` if they lie side by side, in order, in one storage; else None.
    The usual case: a layout made by an earlier call. Adjacent addresses alone do not make one block: CUDA's caching
    allocator often places separately allocated weights back to back in one segment, and a view from the first
    across the others would reach past its storage. `_side_by_side_in_memory` plus one storage, in one loop (every
    `generate` call checks 2 groups a layer). A tensor subclass (torchao's quantized weights, a DTensor) is never
    one: it may hold no storage of its own, whose address then raises."""
    first = parameters[0]
    if type(first) is not nn.Parameter:
        return None
    address, storage, dtype, row = first.data_ptr(), first.untyped_storage().data_ptr(), first.dtype, first.shape[1:]
    size, rows = first.element_size(), 0
    for parameter in parameters:
        if (
            type(parameter) is not nn.Parameter  # a tensor subclass (DTensor, ...)
            or parameter.data_ptr() != address
            or parameter.dtype != dtype
            or parameter.shape[1:] != row
            or not parameter.is_contiguous()
            or parameter.untyped_storage().data_ptr() != storage
        ):
            return None
        address += parameter.numel() * size
        rows += parameter.shape[0]
    strides = (row[0], 1) if row else (1,)
    return torch.as_strided(first.detach(), (rows, *row), strides, first.storage_offset())


def _side_by_side(parameters: list[nn.Parameter]) -> torch.Tensor:
    """Copy `parameters` into one new block, rows in order, and make each a view of its rows. Returns the block.
    A normal tensor even under `torch.inference_mode()`: an inference tensor would break the next training step."""
    with torch.inference_mode(False), torch.no_grad():
        block = torch.cat([parameter.detach() for parameter in parameters])
        for parameter, rows in zip(parameters, block.split([p.shape[0] for p in parameters])):
            parameter.data = rows
    return block


def _enter(module: FusableProjections) -> bool:
    """Set `module._fused` to views over its projections laid out side by side (laying them out the first time).
    False, and nothing set, where the projections are hooked, wrapped or otherwise not plain (`_fusion_blocker`)."""
    linears = _linears(module)
    if any(type(linear) is not nn.Linear or _hooked(linear) for linear in linears):
        return False
    weights = [linear._parameters["weight"] for linear in linears]
    biases = [linear._parameters["bias"] for linear in linears]
    with_bias = biases[0] is not None
    if any((bias is not None) != with_bias for bias in biases):
        return False
    weight, bias = _view_over(weights), _view_over(biases) if with_bias else None
    if weight is None or (with_bias and bias is None):  # not laid out yet, or no longer
        laid_out_at = module.__dict__.setdefault("_laid_out_at", set())
        if _fusion_blocker(linears, laid_out_at) is not None:
            return False
        try:  # each block is recorded as this module's own as soon as it exists (a later failure keeps it movable)
            weight = _side_by_side(weights)
            laid_out_at.add(_storage_of(weight))
            bias = _side_by_side(biases) if with_bias else None
            if bias is not None:
                laid_out_at.add(_storage_of(bias))
        except torch.OutOfMemoryError:  # the copy needs one group's size free for a moment: without it, as before
            logger.warning_once("Too little free memory to lay out q/k/v and gate/up side by side; read separately.")
            return False
    for block in (weight, bias):
        if block is not None:  # CUDA graphs read it in place, as they read parameters (a new view, same address)
            torch._dynamo.mark_static_address(block)
    module.__dict__["_fused"] = (weight, bias)
    return True


def fusable_modules(model: nn.Module) -> list[FusableProjections]:
    """`model`'s modules with projections to fuse, each once, in `modules()` order. The walk does not descend into
    a `FusableProjections` (its children are the projections themselves): a 22-layer decoder's walk visits ~70 of
    its ~290 modules, ~0.1 ms less host time every `generate` call before the prefill."""
    found, seen, stack = [], set(), [model]
    while stack:
        module = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        if isinstance(module, FusableProjections):
            if module.fusable:
                found.append(module)
            continue
        stack.extend(child for child in reversed(module._modules.values()) if child is not None)
    return found


def fuses_on(model: nn.Module, devices: tuple[str, ...] | None = None) -> bool:
    """Whether `generate` reads `model`'s projections as one product per group: its parameters are on a device of
    `devices` (by default `FUSED_PROJECTION_DEVICES`) and no global module hook would miss the projections' own
    calls."""
    parameter = next(model.parameters(), None)
    devices = FUSED_PROJECTION_DEVICES if devices is None else devices
    if parameter is None or parameter.device.type not in devices:
        return False
    hooks = nn.modules.module
    return not (hooks._global_forward_hooks or hooks._global_forward_pre_hooks)


@contextmanager
def inference_projections(model: nn.Module, force: bool = False) -> Iterator[int]:
    """Inside, forwards of `model` without gradients read q/k/v and gate/up as one product per group, compiled or
    not, where `fuses_on(model)` (or `force`). Yields how many groups are read so."""
    if not (force or fuses_on(model)):
        yield 0
        return
    modules = fusable_modules(model)
    previous = [module._fused for module in modules]  # None, unless this context is nested in another
    try:
        yield sum(_enter(module) for module in modules)
    finally:
        for module, fused in zip(modules, previous):
            if fused is None:
                module.__dict__.pop("_fused", None)
            else:
                module.__dict__["_fused"] = fused


__all__ = [
    "FUSED_PROJECTION_DEVICES",
    "FusableProjections",
    "fusable_modules",
    "fuses_on",
    "inference_projections",
]
