"""Language-modelling losses.

- `causal_lm_loss`: next-token cross-entropy, ignoring -100, summed and divided by `num_items_in_batch` when the
  Trainer passes it (so gradient accumulation equals one big batch), else averaged — as transformers'
  `ForCausalLMLoss`, plus the optional z-loss of PaLM (Chowdhery et al. 2022; seed 004): z · log²Z.
- `ChunkedLinearCrossEntropy`: the same loss fused with the LM head. Logits exist one chunk of tokens at a time and
  the gradient is computed in the forward pass, so training never holds the full (tokens × vocab) logits
  (the memory peak of a small-model training step) and the big GEMMs stay cache-friendly. On CUDA each chunk's
  loss and gradient are one compiled function (`fused_chunk_loss`), the GEMMs write and accumulate float32 themselves,
  and the weight's gradient takes a group of chunks per GEMM (`WEIGHT_GRADIENT_CHUNKS`).
- `lm_head_loss`: the head and its loss as both families' LM heads run them (chunked in training, logits otherwise,
  soft-capping and output biases), or through a fused kernel the head carries (`fused_causal_lm_loss`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.utils import logging

from .compiled_kernels import CompiledKernel

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # a torch build without distributed support
    DTensor = ()

logger = logging.get_logger(__name__)

IGNORE_INDEX = -100


def is_distributed_tensor(tensor: torch.Tensor) -> bool:
    """True for a DTensor: a weight FSDP2 has not gathered (its module's forward has not run, e.g. an LM head in a
    shard group of its own) or one tensor parallelism splits. The chunked loss reads the weight directly and needs
    a plain tensor; with a DTensor the head must run through its module, whose hooks gather it."""
    return isinstance(tensor, DTensor)


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """Targets for next-token prediction: position t predicts labels[t + 1]; the last position predicts nothing."""
    return F.pad(labels[..., 1:], (0, 1), value=IGNORE_INDEX)


def flat_targets(labels: torch.Tensor | None, shifted_labels: torch.Tensor | None, tokens: torch.Size) -> torch.Tensor:
    """The flat (N,) targets of next-token labels (shifted here) or of already aligned `shifted_labels`; a tensor of
    another shape than the tokens' is a ValueError naming both shapes (cross_entropy would report a bare size
    error)."""
    given, name = (labels, "labels") if shifted_labels is None else (shifted_labels, "shift_labels")
    if given.shape != tokens:
        raise ValueError(
            f"`{name}` has shape {tuple(given.shape)}; it must be {tuple(tokens)}, one target per token "
            "(-100 where nothing is predicted)."
        )
    return (shift_labels(labels) if shifted_labels is None else shifted_labels).reshape(-1)


def _reduce(total: torch.Tensor, targets: torch.Tensor, num_items_in_batch) -> torch.Tensor:
    if num_items_in_batch is None:
        return total / (targets != IGNORE_INDEX).sum().clamp(min=1)
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


def share_of_batch(
    labels: torch.Tensor | None, shifted_labels: torch.Tensor | None, num_items_in_batch: torch.Tensor | int | None
) -> torch.Tensor | float:
    """The share of `num_items_in_batch` that this forward's targets are: the weight of a per-batch mean (an MoE's
    load-balancing or router z-loss) added to a loss that `num_items_in_batch` divides. The Trainer then divides the
    loss by neither the gradient accumulation steps nor the processes (it multiplies it by their number under
    `average_tokens_across_devices`), so an unweighted mean counted once per micro-batch and process: its gradient
    was gradient_accumulation_steps x processes times that of one big batch. 1 without `num_items_in_batch`."""
    if num_items_in_batch is None or (labels is None and shifted_labels is None):
        return 1.0
    targets = shifted_labels if shifted_labels is not None else labels[..., 1:]
    count = (targets != IGNORE_INDEX).sum()
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(count.device)
    return count / num_items_in_batch


def causal_lm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    num_items_in_batch: torch.Tensor | int | None = None,
    z_loss_coef: float = 0.0,
    shifted_labels: torch.Tensor | None = None,
) -> torch.Tensor:
    """Cross-entropy of logits (B, T, V) against next-token labels (B, T)."""
    targets = flat_targets(labels, shifted_labels, logits.shape[:-1])
    logits = logits.reshape(-1, logits.shape[-1]).float()
    targets = targets.to(logits.device)
    total = F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")
    if z_loss_coef:
        log_z = torch.logsumexp(logits, dim=-1)
        total = total + z_loss_coef * (log_z.square() * (targets != IGNORE_INDEX)).sum()
    return _reduce(total, targets, num_items_in_batch)


_FP32_OUTPUT_GEMM: dict[str, bool] = {}  # by device: do the float32-output GEMMs work there


def _fp32_output_gemm_works(device: torch.device) -> bool:
    """Whether `torch.mm(a, b, out_dtype=float32)` (into a new tensor or `out=`) and `torch.addmm(acc, a, b,
    out_dtype=float32, out=acc)` (half inputs, float32 result and accumulator, one GEMM) run on this device and give
    the float32 products. They do on CUDA in recent torch; elsewhere the ops are missing."""
    key = str(device)
    if key not in _FP32_OUTPUT_GEMM:
        try:
            a = torch.arange(12.0, device=device).reshape(3, 4).to(torch.bfloat16)
            expected = a.float() @ a.float().t()
            acc = torch.ones(3, 3, device=device)
            torch.addmm(acc, a, a.t(), out_dtype=torch.float32, out=acc)
            product = torch.mm(a, a.t(), out_dtype=torch.float32)
            written = torch.full((3, 3), float("nan"), device=device)
            torch.mm(a, a.t(), out_dtype=torch.float32, out=written)
            _FP32_OUTPUT_GEMM[key] = all(
                torch.equal(result, wanted)
                for result, wanted in ((acc, 1 + expected), (product, expected), (written, expected))
            )
        except (RuntimeError, TypeError, NotImplementedError):
            _FP32_OUTPUT_GEMM[key] = False
    return _FP32_OUTPUT_GEMM[key]


def _use_fp32_output_gemm(a: torch.Tensor) -> bool:
    """Half inputs on a device that has the float32-output GEMMs. Under torch.compile the plain forms: the compiler
    fuses the casts itself, and the probe would break the graph."""
    half = a.dtype in (torch.bfloat16, torch.float16)
    return half and not torch.compiler.is_compiling() and _fp32_output_gemm_works(a.device)


def _float32_logits(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """(h @ wᵀ + b) in float32 for the loss. With half inputs on CUDA the GEMM writes float32 itself (no half
    logits and no float32 copy of them: one pass less over a chunk of logits, and logits rounded once, not twice)."""
    if _use_fp32_output_gemm(h):
        logits = torch.mm(h, w.t(), out_dtype=torch.float32)
        return logits if b is None else logits.add_(b.float())
    return (h @ w.t() if b is None else torch.addmm(b, h, w.t())).float()


def _accumulate_product(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, first: bool = False) -> None:
    """acc (float32) += a @ b, or acc = a @ b for the `first` product (no zero-filled accumulator read back: for a
    vocabulary of 128256 a gigabyte written and read less per step). Half inputs on a device with a float32-output
    GEMM accumulate in the GEMM's epilogue: no half product and no float32 copy of it, which for a (vocab x hidden)
    weight gradient is the difference between one and three passes over a tensor of up to a gigabyte per chunk."""
    if _use_fp32_output_gemm(a):
        if first:
            torch.mm(a, b, out_dtype=torch.float32, out=acc)
        else:
            torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    elif first:
        acc.copy_(a @ b)
    else:
        acc.add_((a @ b).float())


def logits_gradient(
    logits: torch.Tensor,
    log_z: torch.Tensor,
    targets: torch.Tensor,
    valid: torch.Tensor,
    z_loss_coef: float,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """d(loss)/d(logits) of one chunk, computed in float32 and returned in `dtype`: softmax · (1 + 2 z log Z) -
    onehot(target), zero for ignored tokens. Written out-of-place so that, compiled, it is one pass over the chunk's
    logits (`fused_chunk_loss`)."""
    grad = torch.exp(logits - log_z[:, None])
    if z_loss_coef:
        grad = grad * (1 + 2 * z_loss_coef * log_z)[:, None]
    columns = torch.arange(logits.shape[-1], device=logits.device)
    grad = torch.where(columns == targets[:, None], grad - 1, grad)
    return (grad * valid[:, None]).to(dtype)


def chunk_loss_sum(logits: torch.Tensor, targets: torch.Tensor, valid: torch.Tensor, z_loss_coef: float):
    """(sum over the chunk's tokens of CE [+ z · log²Z], log Z per token) from its float32 logits."""
    log_z = torch.logsumexp(logits, dim=-1)
    picked = logits.gather(1, targets[:, None]).squeeze(1)
    total = ((log_z - picked) * valid).sum()
    if z_loss_coef:
        total = total + z_loss_coef * (log_z.square() * valid).sum()
    return total, log_z


def chunk_loss_and_gradient(
    logits: torch.Tensor, targets: torch.Tensor, valid: torch.Tensor, z_loss_coef: float, out: torch.Tensor
) -> torch.Tensor:
    """The chunk's loss sum, its logits' gradient written into `out` (in `out`'s dtype): `chunk_loss_sum` and
    `logits_gradient` as one function, so that compiled the log-sum-exp is a reduction inside the kernels that read
    the chunk anyway, and the gradient is stored straight into its rows of the group's buffer."""
    total, log_z = chunk_loss_sum(logits, targets, valid, z_loss_coef)
    out.copy_(logits_gradient(logits, log_z, targets, valid, z_loss_coef, out.dtype))
    return total


# Where compiling it pays (on CPU the eager chain is about as fast as a C++ kernel); `()` turns it off, as does
# TORCHDYNAMO_DISABLE=1.
FUSED_GRADIENT_DEVICES = ("cuda",)
# automatic dynamic shapes: the last chunk's row count varies with the batch (variable-length fine-tuning); after
# the first change the rows become symbolic, so a few graphs serve every batch (not one per remainder; a storage
# offset of 0 into the group's buffer is specialised apart once symbolic)
CHUNK_LOSS = CompiledKernel(chunk_loss_and_gradient, "the LM loss and its gradient", lambda: FUSED_GRADIENT_DEVICES)


def fused_chunk_loss(logits, targets, valid, z_loss_coef: float, out: torch.Tensor):
    """`chunk_loss_and_gradient` compiled on CUDA: the float32 chunk read twice (log Z, then the gradient, written
    once into `out` in the GEMMs' dtype). The eager chain reads and writes it about ten times — torch's log-sum-exp
    alone (max, subtract into a new chunk-sized tensor, exp, sum), then subtract, exp, scatter, mask, cast: at
    vocabulary 32000 and 8192 tokens ~9 GB a step, most of the loss's non-GEMM time. None elsewhere, or where the
    compiler fails (one logged line), and the caller runs the eager chain (TORCHDYNAMO_DISABLE=1: the in-place eager
    chain, not the out-of-place one uncompiled)."""
    return CHUNK_LOSS(logits, targets, valid, z_loss_coef, out)


def _eager_chunk_loss(logits, targets, valid, z_loss_coef: float, out: torch.Tensor | None):
    """`chunk_loss_and_gradient` eagerly, the gradient computed in float32 over the logits (no second chunk-sized
    float32 buffer) and copied into `out`; the loss sum alone where `out` is None."""
    total, log_z = chunk_loss_sum(logits, targets, valid, z_loss_coef)
    if out is None:
        return total
    grad = torch.exp_(logits.sub_(log_z[:, None]))
    if z_loss_coef:
        grad.mul_((1 + 2 * z_loss_coef * log_z)[:, None])
    grad.scatter_add_(1, targets[:, None], -torch.ones_like(log_z)[:, None])
    out.copy_(grad.mul_(valid[:, None]))
    return total


# Chunks whose logits' gradients one weight-gradient GEMM takes (`ChunkedLinearCrossEntropy`): the float32
# accumulator, (vocab x hidden), is read and written once per group instead of once per chunk (at 1024-token chunks
# and vocabulary 32000 it is as many bytes as the chunk's GEMM reads; 128256: 1 GB a chunk), for a group's gradients
# held in the GEMMs' dtype until its product (4 chunks of bf16: the bytes of two chunks' float32 logits).
WEIGHT_GRADIENT_CHUNKS = 4


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """sum over tokens of CE(hidden @ weightᵀ + bias, target) [+ z·logsumexp²], gradient computed chunk by chunk.

    The bias is a separate input (not a column of ones appended to the hidden states): the GEMMs keep the model's
    inner dimension, a multiple of 8 that tensor cores run at full rate, where `d + 1` falls back to slow kernels."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk_size: int, z_loss_coef: float):  # type: ignore[override]
        device_type = hidden.device.type
        autocast = torch.is_autocast_enabled(device_type)
        compute_dtype = torch.get_autocast_dtype(device_type) if autocast else hidden.dtype
        with torch.autocast(device_type, enabled=False):
            w = weight.to(compute_dtype)
            b = bias.to(compute_dtype) if bias is not None else None
            needs_hidden, needs_weight, needs_bias = ctx.needs_input_grad[:3]
            grad_hidden = torch.empty_like(hidden) if needs_hidden else None
            # written by the first chunk's product (zeroed where there is none)
            grad_weight = torch.empty_like(weight, dtype=torch.float32) if needs_weight else None
            needs_grad_bias = bias is not None and needs_bias
            grad_bias = torch.zeros_like(bias, dtype=torch.float32) if needs_grad_bias else None
            total = hidden.new_zeros((), dtype=torch.float32)
            with_gradient = grad_hidden is not None or grad_weight is not None or grad_bias is not None
            # the gradient's dtype: the GEMMs', or float32 where the bias's gradient sums it (one chunk a group then)
            grad_dtype = torch.float32 if grad_bias is not None else compute_dtype
            grouped = grad_weight is not None and grad_bias is None
            group_rows = chunk_size * (WEIGHT_GRADIENT_CHUNKS if grouped else 1)
            for group in range(0, hidden.shape[0], group_rows):
                rows = min(group_rows, hidden.shape[0] - group)
                grads = hidden.new_empty(rows, weight.shape[0], dtype=grad_dtype) if with_gradient else None
                group_hidden = hidden[group : group + rows].to(compute_dtype)
                for start in range(group, group + rows, chunk_size):
                    h = group_hidden[start - group : start - group + chunk_size]
                    t = targets[start : start + chunk_size]
                    logits = _float32_logits(h, w, b)  # (n, V)
                    valid = (t != IGNORE_INDEX).float()
                    safe_t = t.clamp(min=0)
                    # the chunk's loss sum, and d/dlogits: softmax · (1 + 2 z log Z) - onehot(target), 0 where
                    # ignored, written into the chunk's rows of the group's gradients
                    out = grads[start - group : start - group + h.shape[0]] if grads is not None else None
                    chunk_total = fused_chunk_loss(logits, safe_t, valid, z_loss_coef, out) if out is not None else None
                    if chunk_total is None:
                        chunk_total = _eager_chunk_loss(logits, safe_t, valid, z_loss_coef, out)
                    # out of place: torch 2.11's dynamo loses the gradient of an output it saw updated in place
                    total = total + chunk_total
                    del logits
                    if out is None:
                        continue
                    if grad_bias is not None:
                        grad_bias.add_(out.sum(0))
                    if grad_hidden is not None:
                        grad_hidden[start : start + chunk_size] = out.to(compute_dtype) @ w
                if grad_weight is not None:
                    _accumulate_product(grad_weight, grads.to(compute_dtype).t(), group_hidden, first=group == 0)
                grads = None  # freed before the next group's buffer is taken
        if grad_weight is not None and hidden.shape[0] == 0:
            grad_weight.zero_()
        # kept on the context, not saved for backward: `backward` scales them in place and hands them over (autograd
        # then takes them as the parameters' gradients without a copy); a saved tensor stays referenced by the graph,
        # so its scaled copy was a second (vocab x hidden) float32 tensor at the start of the backward pass
        ctx.gradients = (
            grad_hidden,
            grad_weight.to(weight.dtype) if grad_weight is not None else None,
            grad_bias.to(bias.dtype) if grad_bias is not None else None,
        )
        return total

    @staticmethod
    def backward(ctx, grad_output):  # type: ignore[override]
        gradients = ctx.gradients
        if gradients is None:
            raise RuntimeError(
                "backward ran twice through the chunked LM loss (retain_graph=True): its gradients, computed in the "
                "forward pass, were handed over by the first; set the config's lm_loss_chunk_size=0 (unchunked loss) "
                "to backpropagate through it more than once"
            )
        ctx.gradients = None
        grad_hidden, grad_weight, grad_bias = (
            g.mul_(grad_output.to(g.dtype)) if g is not None else None for g in gradients
        )
        return grad_hidden, grad_weight, grad_bias, None, None, None


def chunked_causal_lm_loss(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: int,
    num_items_in_batch: torch.Tensor | int | None = None,
    z_loss_coef: float = 0.0,
    shifted_labels: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """`causal_lm_loss(hidden_states @ weightᵀ + bias, labels)` without materialising the logits."""
    targets = flat_targets(labels, shifted_labels, hidden_states.shape[:-1])
    hidden = hidden_states.reshape(-1, hidden_states.shape[-1])
    total = ChunkedLinearCrossEntropy.apply(hidden, weight, bias, targets.to(hidden.device), chunk_size, z_loss_coef)
    return _reduce(total, targets, num_items_in_batch)


def fused_causal_lm_loss(
    fused_loss,
    hidden_states: torch.Tensor,
    head: nn.Module,
    labels: torch.Tensor | None,
    shifted_labels: torch.Tensor | None,
    output_bias: torch.Tensor | None,
    softcap: float | None,
    z_loss_coef: float,
    num_items_in_batch: torch.Tensor | int | None,
    logit_scale: float = 1.0,
) -> torch.Tensor:
    """`lm_head_loss`'s training loss through a fused linear cross-entropy kernel (e.g. Liger's, see archlab.liger).

    `fused_loss(hidden (N, d), weight (V, d), bias (V,) | None, targets (N,), softcap, z_loss_coef)` returns the sum
    over tokens of CE(logits, target) + z · logsumexp(logits)², logits = hidden @ Wᵀ + b soft-capped to
    c · tanh(logits / c) when `softcap` c is given, tokens with target -100 adding nothing. The labels are shifted and
    the sum reduced here, exactly as on the chunked path.
    """
    targets = flat_targets(labels, shifted_labels, hidden_states.shape[:-1])
    bias = head.bias
    if output_bias is not None:
        bias = output_bias.reshape(-1) if bias is None else bias + output_bias.reshape(-1)
    hidden = hidden_states.reshape(-1, hidden_states.shape[-1])
    if logit_scale != 1.0:  # s·(h Wᵀ + b) = (s·h) Wᵀ + s·b: the kernel computes the scaled logits
        hidden = hidden * logit_scale
        bias = None if bias is None else bias * logit_scale
    total = fused_loss(hidden, head.weight, bias, targets.to(hidden.device), softcap, z_loss_coef)
    return _reduce(total, targets, num_items_in_batch)


def uncompiled(module: nn.Module) -> nn.Module:
    """The module a `torch.compile` wrapper (`OptimizedModule`, nested or not) runs, or `module` itself.
    accelerate's `compile_regions` (Trainer's `--torch_compile` with regional compilation, the scripts' default on a
    GPU) wraps every module outside the repeated blocks, the LM head included: a check `isinstance(head, nn.Linear)`
    on the wrapper fails, and the chunked loss had silently given way to the full logits."""
    while isinstance(module, torch._dynamo.eval_frame.OptimizedModule):
        module = module._orig_mod
    return module


def weight_is_readable(linear: nn.Module) -> bool:
    """Whether the chunked and fused losses may read `linear`'s weight and bias themselves instead of calling it: a
    plain `nn.Linear` (or `nn.Embedding`, for `embedding_matrix`) whose weight is a whole tensor, here.

    Not a quantized layer (bitsandbytes' `Linear8bitLt` / `Linear4bit` and optimum-quanto's `QLinear` subclass
    `nn.Linear`; torchao swaps the weight for a tensor subclass): its weight is int8 or packed 4-bit data and only its
    forward dequantizes it (read directly, bitsandbytes' int8 weight gave a training loss of ~970 for 5.5). Not a
    weight that accelerate offloads (`device_map` with `max_memory`/`offload_folder`): it sits on the meta device and
    the module's hook loads it for the call (read directly: losses of 1e17..1e23, or nan). Not a DTensor
    (`is_distributed_tensor`), nor a layer PEFT wraps.
    """
    weight = getattr(linear, "weight", None)
    return (
        type(linear) in (nn.Linear, nn.Embedding)
        and type(weight) in (nn.Parameter, torch.Tensor)  # not a quantized tensor subclass
        and not is_distributed_tensor(weight)
        and not weight.is_meta
    )


def embedding_matrix(embedding: nn.Embedding, device: torch.device) -> torch.Tensor:
    """The (V, d) weight of a token embedding, for a product with it outside its forward (a classifier's auxiliary
    LM loss): the weight itself where `weight_is_readable`, else every row through the module's forward, which
    accelerate's hook fills in for an offloaded weight (on the meta device outside the call: read directly, a
    classifier's loss came out 1.5e25 for 3.8)."""
    if weight_is_readable(embedding):
        return embedding.weight
    return embedding(torch.arange(embedding.num_embeddings, device=device))


def scaled_and_capped(logits: torch.Tensor, logit_scale: float = 1.0, softcap: float | None = None) -> torch.Tensor:
    """An LM head's logits times `logit_scale` s (Cohere, Granite), then soft-capped to c · tanh(z / c) (Gemma2)."""
    if logit_scale != 1.0:
        logits = logits * logit_scale
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return logits


def lm_head_loss(
    hidden_states: torch.Tensor,
    head: nn.Module,
    *,
    training: bool,
    chunk_size: int,
    labels: torch.Tensor | None = None,
    shifted_labels: torch.Tensor | None = None,
    output_bias: torch.Tensor | None = None,
    softcap: float | None = None,
    z_loss_coef: float = 0.0,
    num_items_in_batch: torch.Tensor | int | None = None,
    logits_to_keep: int | torch.Tensor = 0,
    logit_scale: float = 1.0,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(loss, logits) of an LM head over hidden states (B, T, d), as both families' generation heads compute them.

    In training with labels the head and the cross-entropy run chunked (`chunk_size` tokens at a time, never the
    full logits) and `logits` is None; otherwise the logits of the last `logits_to_keep` positions (0: all) are
    returned, with the loss when labels are given. `labels` are next-token labels (shifted here), `shifted_labels`
    targets aligned with the positions. `output_bias` (1, V) is a constant bias added after the head (Marian's
    `final_logits_bias`); a bias of the head itself is added too. `softcap` c applies c · tanh(z / c) to the logits
    (Gemma2), after `logit_scale` s multiplies them (Cohere, Granite: the chunked and fused losses read s·h for h and
    s·b for a bias b, the same logits); the chunked loss has no soft-cap, so then, when the head's weight is a DTensor
    (FSDP2 / tensor parallelism must gather it through the module), when the head is not a Linear (PEFT's LoRA layer
    on it), and when it is quantized or offloaded (`weight_is_readable`), the loss runs unchunked. A head carrying a
    fused kernel (`head.fused_linear_cross_entropy`, set by archlab.liger) runs the training loss through it instead,
    soft-cap too.
    """
    wants_loss = labels is not None or shifted_labels is not None
    scaled = logit_scale != 1.0
    if wants_loss and training:  # (only these losses look at the head: not a decoding step's forward)
        # the fused and chunked losses read the head's weight and bias themselves: right only for a Linear whose
        # weight is a whole tensor, not for a head PEFT wraps (a LoRA layer on `lm_head`), a sharded weight (DTensor),
        # a quantized or an offloaded one (`weight_is_readable`); a head torch.compile wraps (accelerate's regional
        # compilation compiles it apart) is read through the wrapper
        linear = uncompiled(head)
        # (a head on another device than the hidden states, as accelerate's `device_map` may place it, runs through
        # its hook, which moves them)
        reads_weight = weight_is_readable(linear) and linear.weight.device == hidden_states.device
        fused_loss = getattr(linear, "fused_linear_cross_entropy", None)
        if fused_loss is not None and reads_weight:
            args = (
                hidden_states,
                linear,
                labels,
                shifted_labels,
                output_bias,
                softcap,
                z_loss_coef,
                num_items_in_batch,
                logit_scale,
            )
            return fused_causal_lm_loss(fused_loss, *args), None
        if reads_weight and chunk_size > 0 and softcap is None:
            weight, bias = linear.weight, linear.bias
            if output_bias is not None:
                bias = output_bias.reshape(-1) if bias is None else bias + output_bias.reshape(-1)
            if scaled:  # s·(h Wᵀ + b) = (s·h) Wᵀ + s·b
                hidden_states = hidden_states * logit_scale
                bias = None if bias is None else bias * logit_scale
            loss = chunked_causal_lm_loss(
                hidden_states, weight, labels, chunk_size, num_items_in_batch, z_loss_coef, shifted_labels, bias
            )
            return loss, None
    keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
    logits = head(hidden_states[:, keep, :])
    if output_bias is not None:
        logits = logits + output_bias.to(hidden_states.dtype)
    logits = scaled_and_capped(logits, logit_scale, softcap)
    loss = None
    if wants_loss:
        loss = causal_lm_loss(logits, labels, num_items_in_batch, z_loss_coef, shifted_labels=shifted_labels)
    return loss, logits
