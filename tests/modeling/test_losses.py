"""The chunked LM-head + cross-entropy equals the naive loss in value and gradients (incl. z-loss, a head bias and a
constant output bias, bf16 autocast); labels of the wrong shape are named; a fused kernel carried by the head gets
the head's bias, soft-cap and z-loss and its sum is reduced like the chunked one; a quantized or offloaded head runs
through its own forward."""

import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from archlab.modeling.losses import (
    _accumulate_product,
    _float32_logits,
    causal_lm_loss,
    chunked_causal_lm_loss,
    lm_head_loss,
)

from helpers import assert_close_to_scale


def _naive(hidden, weight, labels, num_items=None, z=0.0):
    return causal_lm_loss(hidden @ weight.t(), labels, num_items, z_loss_coef=z)


@pytest.mark.parametrize("chunk", [1, 5, 64])
@pytest.mark.parametrize("z", [0.0, 1e-2])
def test_chunked_matches_naive_value_and_grads(chunk, z):
    torch.manual_seed(0)
    hidden = torch.randn(3, 7, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 16, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 50, (3, 7))
    labels[0, :3] = -100
    ref = _naive(hidden, weight, labels, z=z)
    g_ref = torch.autograd.grad(ref, (hidden, weight))
    out = chunked_causal_lm_loss(hidden, weight, labels, chunk, z_loss_coef=z)
    g_out = torch.autograd.grad(out, (hidden, weight))
    torch.testing.assert_close(out, ref)
    for a, b in zip(g_out, g_ref):  # float64 in, but the chunked loss computes its logits in float32
        assert_close_to_scale(a, b, rtol=1e-5)


def test_chunked_bias_matches_naive_value_and_grads():
    torch.manual_seed(0)
    hidden = torch.randn(3, 7, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 16, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(50, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 50, (3, 7))
    labels[1, 4:] = -100
    ref = causal_lm_loss(hidden @ weight.t() + bias, labels)
    out = chunked_causal_lm_loss(hidden, weight, labels, chunk_size=4, bias=bias)
    torch.testing.assert_close(out, ref)
    for a, b in zip(torch.autograd.grad(out, (hidden, weight, bias)), torch.autograd.grad(ref, (hidden, weight, bias))):
        assert_close_to_scale(a, b, rtol=1e-5)


@pytest.mark.parametrize("with_bias", [False, True])
def test_chunked_loss_traced_by_dynamo_keeps_its_gradients(with_bias):
    """The loss inside a compiled graph (Trainer's `torch_compile`, a whole-model `torch.compile`) gives the eager
    gradients. torch 2.11's dynamo — the GPU image's — dropped every gradient (zeros, loss right) while the
    function's output was a tensor it had updated in place; dynamo's "eager" backend is enough to show it."""
    torch.manual_seed(0)
    hidden = torch.randn(2, 9, 16, requires_grad=True)
    weight = torch.randn(50, 16, requires_grad=True)
    bias = torch.randn(50, requires_grad=True) if with_bias else None
    labels = torch.randint(0, 50, (2, 9))
    labels[0, :2] = -100
    inputs = (hidden, weight) + ((bias,) if with_bias else ())

    def loss(hidden, weight, labels, bias):
        return chunked_causal_lm_loss(hidden, weight, labels, chunk_size=4, z_loss_coef=1e-2, bias=bias)

    torch._dynamo.reset()
    compiled = torch.compile(loss, backend="eager", fullgraph=True)
    ref, out = loss(hidden, weight, labels, bias), compiled(hidden, weight, labels, bias)
    torch.testing.assert_close(out, ref)
    for a, b in zip(torch.autograd.grad(out, inputs), torch.autograd.grad(ref, inputs)):
        assert b.abs().max() > 0
        torch.testing.assert_close(a, b)


def _head_losses(
    training_chunk: int, autocast: bool, device: str = "cpu", bias: bool = True
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Loss and gradients of an LM head with its own bias (or none) and a constant output bias (Marian's), chunked
    or not."""
    torch.manual_seed(0)
    head = nn.Linear(16, 40, bias=bias).to(device)
    output_bias = torch.randn(1, 40, device=device)
    hidden = torch.randn(2, 9, 16, device=device, requires_grad=True)
    labels = torch.randint(0, 40, (2, 9), device=device)
    labels[0, 3] = -100
    with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
        loss, _ = lm_head_loss(
            hidden, head, training=True, chunk_size=training_chunk, labels=labels, output_bias=output_bias
        )
    return loss, list(torch.autograd.grad(loss, [hidden, head.weight] + ([head.bias] if bias else [])))


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_lm_head_loss_chunked_equals_unchunked_with_biases(autocast):
    """The training path of both families' heads: chunked (the default) against the plain head + cross-entropy, with
    the head's bias and the output bias. bf16: the two round at different places, so a bf16-sized tolerance."""
    loss, grads = _head_losses(4, autocast)
    ref_loss, ref_grads = _head_losses(0, autocast)
    rtol = 2e-2 if autocast else 1e-5
    torch.testing.assert_close(loss, ref_loss, rtol=rtol, atol=0)
    for name, a, b in zip(("hidden", "weight", "bias"), grads, ref_grads):
        assert_close_to_scale(a, b, rtol=rtol, msg=name)


def test_weight_gradient_accumulates_in_float32():
    """acc += a @ b for half inputs: the float32 result of the half product, on every device (on CUDA through the
    float32-output GEMM, elsewhere through a float32 copy)."""
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    a = torch.randn(64, 48, device=device).to(torch.bfloat16)
    b = torch.randn(48, 32, device=device).to(torch.bfloat16)
    acc = torch.randn(64, 32, device=device)
    expected = acc + a.double().mm(b.double()).float()
    _accumulate_product(acc, a, b)
    assert acc.dtype == torch.float32
    assert_close_to_scale(acc, expected, rtol=1e-2)  # the half product rounds to bf16 on the fallback path


def test_float32_logits_of_half_inputs():
    """h @ wᵀ + b in float32 from bf16 inputs, on every device (on CUDA written by the GEMM in float32)."""
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    h, w, b = (torch.randn(*shape, device=device).to(torch.bfloat16) for shape in ((16, 24), (40, 24), (40,)))
    for bias in (None, b):
        logits = _float32_logits(h, w, bias)
        expected = h.double() @ w.double().t() + (0 if bias is None else bias.double())
        assert logits.dtype == torch.float32 and logits.shape == (16, 40)
        assert_close_to_scale(logits, expected.float(), rtol=1e-2)


def test_num_items_in_batch_sums_then_divides():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11)
    labels = torch.randint(0, 11, (2, 5))
    mean = causal_lm_loss(logits, labels)
    summed = causal_lm_loss(logits, labels, num_items_in_batch=1)
    assert torch.allclose(summed / 8, mean)  # 2 rows x 4 predicted positions
    assert torch.allclose(causal_lm_loss(logits, labels, num_items_in_batch=torch.tensor(16)), summed / 16)


def test_all_ignored_gives_zero_not_nan():
    logits = torch.randn(1, 4, 11)
    labels = torch.full((1, 4), -100)
    assert causal_lm_loss(logits, labels).item() == 0.0


def test_labels_of_the_wrong_shape_are_named():
    """One target per token: a labels tensor of another shape is a ValueError naming both shapes, not a size error
    inside cross_entropy (both the plain and the chunked loss)."""
    hidden, weight = torch.randn(2, 5, 8), torch.randn(11, 8)
    for labels in (torch.zeros(2, 4, dtype=torch.long), torch.zeros(10, dtype=torch.long)):
        message = re.escape(f"`labels` has shape {tuple(labels.shape)}; it must be (2, 5), one target per token")
        with pytest.raises(ValueError, match=message):
            causal_lm_loss(hidden @ weight.t(), labels)
        with pytest.raises(ValueError, match=message):
            chunked_causal_lm_loss(hidden, weight, labels, chunk_size=4)


def _reference_fused_loss(hidden, weight, bias, targets, softcap, z_loss_coef):
    """The fused-kernel protocol of `losses.fused_causal_lm_loss`, written out with full logits."""
    logits = hidden @ weight.t() + (bias if bias is not None else 0)
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    valid = targets != -100
    log_z = torch.logsumexp(logits, -1)
    picked = logits.gather(1, targets.clamp(min=0)[:, None]).squeeze(1)
    return ((log_z - picked + z_loss_coef * log_z.square()) * valid).sum()


@pytest.mark.parametrize("shifted", [False, True])
def test_a_fused_kernel_on_the_head_gets_bias_softcap_and_z_loss_and_is_reduced_like_the_chunked_one(shifted):
    torch.manual_seed(0)
    head = nn.Linear(16, 50, bias=True)
    hidden = torch.randn(2, 7, 16, requires_grad=True)
    labels = torch.randint(0, 50, (2, 7))
    labels[0, :3] = -100
    output_bias = torch.randn(1, 50)
    kwargs = dict(
        chunk_size=4,
        output_bias=output_bias,
        softcap=3.0,
        z_loss_coef=1e-2,
        num_items_in_batch=9,
        **({"shifted_labels": labels} if shifted else {"labels": labels}),
    )
    expected, logits = lm_head_loss(hidden, head, training=False, **kwargs)  # full logits, then the loss
    calls = []
    head.fused_linear_cross_entropy = lambda *args: calls.append(args) or _reference_fused_loss(*args)
    loss, no_logits = lm_head_loss(hidden, head, training=True, **kwargs)
    assert no_logits is None and logits is not None and len(calls) == 1
    _, weight, bias, targets, softcap, z_loss_coef = calls[0]
    assert weight is head.weight and (softcap, z_loss_coef) == (3.0, 1e-2) and targets.shape == (14,)
    torch.testing.assert_close(bias, head.bias + output_bias[0])
    torch.testing.assert_close(loss, expected)
    for grad, expected_grad in zip(
        torch.autograd.grad(loss, (hidden, head.weight)), torch.autograd.grad(expected, (hidden, head.weight))
    ):
        assert_close_to_scale(grad, expected_grad)
    del head.fused_linear_cross_entropy  # in evaluation the head computes logits as usual
    assert lm_head_loss(hidden, head, training=False, **kwargs)[1] is not None


@pytest.mark.parametrize("path", ["chunked", "fused"])
def test_a_logit_scale_gives_the_training_losses_the_scaled_logits_loss(path):
    """`logit_scale` s (Cohere, Granite): the chunked and fused losses read s·h and s·b, and must give the loss and
    gradients of the full logits s·(h Wᵀ + b), soft-capped after."""
    torch.manual_seed(0)
    head = nn.Linear(16, 50, bias=True)
    hidden = torch.randn(2, 7, 16, requires_grad=True)
    labels = torch.randint(0, 50, (2, 7))
    kwargs = dict(chunk_size=4, output_bias=torch.randn(1, 50), softcap=3.0, logit_scale=0.125, labels=labels)
    expected, logits = lm_head_loss(hidden, head, training=False, **kwargs)
    unscaled = head(hidden) + kwargs["output_bias"]
    torch.testing.assert_close(logits, 3.0 * torch.tanh(0.125 * unscaled / 3.0))
    if path == "fused":
        head.fused_linear_cross_entropy = _reference_fused_loss
    else:
        kwargs["softcap"] = None  # (the chunked loss runs without a soft-cap)
        expected = lm_head_loss(hidden, head, training=False, **kwargs)[0]
    loss, no_logits = lm_head_loss(hidden, head, training=True, **kwargs)
    assert no_logits is None
    torch.testing.assert_close(loss, expected)
    for grad, expected_grad in zip(
        torch.autograd.grad(loss, (hidden, head.weight, head.bias)),
        torch.autograd.grad(expected, (hidden, head.weight, head.bias)),
    ):
        assert_close_to_scale(grad, expected_grad)


class _Int8Linear(nn.Linear):
    """A quantized head as bitsandbytes' `Linear8bitLt` stores one: int8 weight, a row scale, dequantized in forward."""

    def __init__(self, linear: nn.Linear):
        super().__init__(linear.in_features, linear.out_features, bias=False)
        scale = linear.weight.detach().abs().amax(dim=1, keepdim=True) / 127
        self.weight = nn.Parameter((linear.weight.detach() / scale).round().to(torch.int8), requires_grad=False)
        self.register_buffer("scale", scale)

    def forward(self, x):
        return F.linear(x, self.weight.to(x.dtype) * self.scale)


class _OffloadedLinear(nn.Linear):
    """A head accelerate offloads: the weight on the meta device, brought in by a hook for the call."""

    def __init__(self, linear: nn.Linear):
        super().__init__(linear.in_features, linear.out_features, bias=False, device="meta")
        self.offloaded = linear.weight.detach()

    def forward(self, x):
        return F.linear(x, self.offloaded)


@pytest.mark.parametrize("wrap", [_Int8Linear, _OffloadedLinear])
def test_a_quantized_or_offloaded_head_runs_through_its_forward_in_training(wrap):
    """The chunked loss read the head's weight itself: bitsandbytes' int8 weight gave a training loss of ~970 where
    evaluation gave 5.5, its packed 4-bit weight a shape error, an offloaded (meta) weight garbage."""
    torch.manual_seed(0)
    head = wrap(nn.Linear(16, 50, bias=False))
    hidden = torch.randn(2, 7, 16)
    labels = torch.randint(0, 50, (2, 7))
    expected, _ = lm_head_loss(hidden, head, training=False, chunk_size=4, labels=labels)
    loss, logits = lm_head_loss(hidden, head, training=True, chunk_size=4, labels=labels)
    assert logits is not None  # unchunked: through the head's forward
    torch.testing.assert_close(loss, expected)


def _chunk_case(z: float):
    torch.manual_seed(0)
    logits = torch.randn(6, 11) * 3
    targets = torch.tensor([0, 3, -100, 10, 5, 7])
    valid = (targets != -100).float()
    safe = targets.clamp(min=0)
    log_z = torch.logsumexp(logits, dim=-1)
    eager = torch.exp_(logits.clone().sub_(log_z[:, None]))
    if z:
        eager.mul_((1 + 2 * z * log_z)[:, None])
    eager.scatter_add_(1, safe[:, None], -torch.ones(6, 1))
    eager.mul_(valid[:, None])
    return logits, log_z, safe, valid, eager


@pytest.mark.parametrize("z", [0.0, 1e-2])
def test_the_out_of_place_logits_gradient_equals_the_in_place_chain(z):
    from archlab.modeling.losses import logits_gradient

    logits, log_z, safe, valid, eager = _chunk_case(z)
    torch.testing.assert_close(logits_gradient(logits, log_z, safe, valid, z), eager, atol=1e-7, rtol=1e-6)
    assert logits_gradient(logits, log_z, safe, valid, z, torch.bfloat16).dtype == torch.bfloat16


def test_the_compiled_logits_gradient_gives_the_chunked_loss_its_gradients(monkeypatch):
    """On CUDA the gradient chain is one compiled kernel; compiled here (inductor on CPU) the chunked loss and its
    gradients equal the eager chain's, with a z-loss and an ignored token, and batches of other lengths (other
    last-chunk row counts) share its graphs: the rows become symbolic after a change (one graph per remainder would
    hit dynamo's recompile limit in variable-length fine-tuning)."""
    from torch._dynamo.utils import counters

    from archlab.modeling import losses

    torch.manual_seed(0)
    hidden = torch.randn(2, 9, 16, requires_grad=True)
    weight = torch.randn(40, 16, requires_grad=True)
    labels = torch.randint(0, 40, (2, 9))
    labels[0, 2] = -100

    def run(length=9):
        loss = chunked_causal_lm_loss(hidden[:, :length], weight, labels[:, :length], chunk_size=3, z_loss_coef=1e-3)
        return (loss, *torch.autograd.grad(loss, (hidden, weight)))

    expected = [run(length) for length in (9, 5, 4, 6, 7)]
    monkeypatch.setattr(losses, "FUSED_GRADIENT_DEVICES", ("cpu",))
    monkeypatch.setattr(losses.CHUNK_LOSS, "compiled", {})
    torch._dynamo.reset()
    counters.clear()
    for length, reference in zip((9, 5, 4, 6, 7), expected):
        for a, b in zip(run(length), reference):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert losses.CHUNK_LOSS.compiled["cpu"] is not None  # compiled, no fallback to the eager chain
    # full chunks, one row (specialised), symbolic rows — and those at the start of a group's buffer (dynamo
    # specialises a storage offset of 0 apart from the others once it is symbolic)
    assert 1 <= counters["stats"]["unique_graphs"] <= 4

    def eager(*args):
        raise AssertionError("a chunk's loss ran eagerly beside the compiled function")

    monkeypatch.setattr(losses, "_eager_chunk_loss", eager)  # the loss sum comes out of the compiled function too
    for a, b in zip(run(9), expected[0]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("z", [0.0, 1e-2])
def test_a_chunks_loss_and_gradient_together_equal_the_eager_chain(z):
    from archlab.modeling.losses import _eager_chunk_loss, chunk_loss_and_gradient

    logits, log_z, safe, valid, expected_grad = _chunk_case(z)
    expected = ((log_z - logits.gather(1, safe[:, None])[:, 0]) * valid).sum() + z * (log_z.square() * valid).sum()
    rows = torch.full((10, 11), float("nan"))  # a group's buffer: the chunk's gradient goes into its rows 2-7
    torch.testing.assert_close(chunk_loss_and_gradient(logits, safe, valid, z, rows[2:8]), expected)
    torch.testing.assert_close(rows[2:8], expected_grad, atol=1e-7, rtol=1e-6)
    assert rows[:2].isnan().all() and rows[8:].isnan().all()
    rows = torch.empty(6, 11, dtype=torch.bfloat16)
    torch.testing.assert_close(_eager_chunk_loss(logits.clone(), safe, valid, z, rows), expected)
    torch.testing.assert_close(rows, expected_grad.bfloat16())
    torch.testing.assert_close(_eager_chunk_loss(logits.clone(), safe, valid, z, None), expected)


def test_a_failing_compiler_leaves_the_eager_gradient_chain(monkeypatch):
    from archlab.modeling import compiled_kernels, losses

    warnings = []
    monkeypatch.setattr(compiled_kernels.logger, "warning", warnings.append)

    def failing(*args):
        raise torch._dynamo.exc.BackendCompilerFailed(None, RuntimeError("no working triton"), None)

    monkeypatch.setattr(losses, "FUSED_GRADIENT_DEVICES", ("cpu",))
    monkeypatch.setattr(losses.CHUNK_LOSS, "compiled", {"cpu": failing})
    logits, _, safe, valid, _ = _chunk_case(0.0)
    out = torch.empty_like(logits)
    assert losses.fused_chunk_loss(logits, safe, valid, 0.0, out) is None
    assert losses.CHUNK_LOSS.compiled["cpu"] is None  # not tried again
    assert losses.fused_chunk_loss(logits, safe, valid, 0.0, out) is None
    assert len(warnings) == 1 and "no working triton" in warnings[0]
    monkeypatch.setattr(losses.CHUNK_LOSS, "compiled", {})
    with torch._dynamo.config.patch(disable=True):  # TORCHDYNAMO_DISABLE=1
        assert losses.fused_chunk_loss(logits, safe, valid, 0.0, out) is None
    assert not losses.CHUNK_LOSS.compiled


@pytest.fixture
def without_tf32():
    """fp32 matmuls without TF32 for the test, then as they were. Set by hand: pytest >= 9.2's monkeypatch puts an
    attribute back from the object's `__dict__`, and `torch.backends.cuda.matmul` keeps none (its undo would raise)."""
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = previous


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused loss gradient and fp32-output GEMMs are CUDA's")
@pytest.mark.parametrize("bias", [True, False], ids=["head-bias", "no-bias"])
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_the_chunked_loss_on_cuda_equals_the_unchunked_one(autocast, bias, without_tf32):
    """On CUDA the chunked loss runs its CUDA-only paths — the compiled gradient kernel, the float32-output GEMMs —
    and equals the plain head + cross-entropy in value and gradients (fp32 without TF32, which the CUDA benchmark
    suites switch on for the process)."""
    loss, grads = _head_losses(4, autocast, "cuda", bias)
    ref_loss, ref_grads = _head_losses(0, autocast, "cuda", bias)
    rtol = 2e-2 if autocast else 1e-5
    torch.testing.assert_close(loss, ref_loss, rtol=rtol, atol=0)
    for a, b in zip(grads, ref_grads):
        assert_close_to_scale(a, b, rtol=rtol)


@pytest.mark.parametrize("family", ["decoder", "seq2seq"])
def test_regional_compilation_keeps_the_chunked_loss(family, monkeypatch):
    """accelerate's `compile_regions` (the scripts' `--torch_compile` on a GPU) wraps the LM head in torch.compile's
    `OptimizedModule`: the training loss still runs chunked through it (no logits returned, the full logits' memory
    never held), with the loss and gradients of the uncompiled model. Traced by dynamo's eager backend."""
    import accelerate.utils

    from archlab import DecoderForCausalLM, Seq2SeqForConditionalGeneration
    from archlab.modeling import losses

    from helpers import randomised, tiny_decoder_config, tiny_seq2seq_config, trace_only_compile_regions

    trace_only_compile_regions(monkeypatch)
    torch._dynamo.reset()
    torch.manual_seed(0)
    if family == "decoder":
        model = randomised(DecoderForCausalLM(tiny_decoder_config(lm_loss_chunk_size=8)))
        ids = torch.randint(3, 97, (2, 12))
        batch = {"input_ids": ids, "labels": ids}
    else:
        model = randomised(Seq2SeqForConditionalGeneration(tiny_seq2seq_config(lm_loss_chunk_size=8)))
        source, target = torch.randint(3, 60, (2, 10)), torch.randint(3, 60, (2, 9))
        batch = {"input_ids": source, "attention_mask": torch.ones_like(source), "labels": target}
    model.train()
    chunked, original = [], losses.chunked_causal_lm_loss
    monkeypatch.setattr(losses, "chunked_causal_lm_loss", lambda *a, **k: chunked.append(1) or original(*a, **k))
    results = {}
    for name, runner in (("eager", model), ("compiled", accelerate.utils.compile_regions(model, dynamic=False))):
        model.zero_grad()
        torch.manual_seed(1)
        out = runner(**batch)
        out.loss.backward()
        results[name] = (out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert type(accelerate.utils.compile_regions(model).lm_head).__name__ == "OptimizedModule"
    assert len(chunked) == 2 and results["compiled"][0].logits is None
    torch.testing.assert_close(results["compiled"][0].loss, results["eager"][0].loss, rtol=1e-5, atol=1e-6)
    for name, grad in results["eager"][1].items():
        assert_close_to_scale(results["compiled"][1][name], grad, rtol=1e-4, msg=name)


def test_the_weight_gradient_is_written_by_the_first_chunk_and_zero_without_tokens():
    """The float32 weight gradient is not zero-filled first: the first chunk's product writes it (garbage in the
    fresh buffer would show in a gradient that differs from the unchunked one), and a batch without tokens gives
    zeros."""
    from archlab.modeling.losses import ChunkedLinearCrossEntropy

    torch.manual_seed(0)
    weight = torch.randn(30, 8, requires_grad=True)
    hidden = torch.randn(7, 8, requires_grad=True)
    targets = torch.randint(0, 30, (7,))
    for _ in range(3):  # fresh buffers from the caching allocator, which hold the last call's values
        total = ChunkedLinearCrossEntropy.apply(hidden, weight, None, targets, 3, 0.0)
        grad_weight, grad_hidden = torch.autograd.grad(total, (weight, hidden))
        reference = F.cross_entropy(hidden @ weight.t(), targets, reduction="sum")
        torch.testing.assert_close(total, reference)
        for grad, expected in zip((grad_weight, grad_hidden), torch.autograd.grad(reference, (weight, hidden))):
            torch.testing.assert_close(grad, expected)
    empty = hidden[:0]
    total = ChunkedLinearCrossEntropy.apply(empty, weight, None, targets[:0], 3, 0.0)
    (grad_weight,) = torch.autograd.grad(total, (weight,))
    assert total.item() == 0 and torch.count_nonzero(grad_weight) == 0


def test_the_chunked_gradients_become_the_parameters_gradients_without_a_copy():
    """The forward pass's float32 weight gradient, scaled in place by the backward pass, is the weight's `.grad`
    itself (autograd takes it over): no second (vocab x hidden) tensor at the start of the backward pass. A second
    backward through the loss (retain_graph) says how to do it."""
    from archlab.modeling.losses import ChunkedLinearCrossEntropy

    torch.manual_seed(0)
    weight = torch.randn(30, 8, requires_grad=True)
    hidden = torch.randn(7, 8, requires_grad=True)
    targets = torch.randint(0, 30, (7,))
    pointers = []
    forward = ChunkedLinearCrossEntropy.forward

    def recording(ctx, *args):
        total = forward(ctx, *args)
        pointers.extend(g.data_ptr() for g in ctx.gradients[:2])
        return total

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ChunkedLinearCrossEntropy, "forward", staticmethod(recording))
        loss = ChunkedLinearCrossEntropy.apply(hidden, weight, None, targets, 3, 0.0) / 5
    loss.backward(retain_graph=True)
    reference = F.cross_entropy(hidden @ weight.t(), targets, reduction="sum") / 5
    expected = torch.autograd.grad(reference, (hidden, weight))
    torch.testing.assert_close(hidden.grad, expected[0])
    torch.testing.assert_close(weight.grad, expected[1])
    assert [hidden.grad.data_ptr(), weight.grad.data_ptr()] == pointers
    with pytest.raises(RuntimeError, match="lm_loss_chunk_size=0"):
        loss.backward()


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_the_weight_gradient_takes_a_group_of_chunks_at_a_time(bias, monkeypatch):
    """One weight-gradient product per WEIGHT_GRADIENT_CHUNKS chunks (its float32 accumulator read and written once
    per group), one per chunk where the head's bias takes a float32 gradient too; the loss and every gradient as the
    unchunked loss's, over 9 chunks (two full groups and a group of one short chunk)."""
    from archlab.modeling import losses

    torch.manual_seed(0)
    head = nn.Linear(8, 30, bias=bias)
    hidden = torch.randn(1, 26, 8, requires_grad=True)
    labels = torch.randint(0, 30, (1, 26))
    products = []
    accumulate = losses._accumulate_product
    monkeypatch.setattr(
        losses, "_accumulate_product", lambda *a, **k: products.append(a[2].shape[0]) or accumulate(*a, **k)
    )
    loss = chunked_causal_lm_loss(hidden, head.weight, labels, chunk_size=3, bias=head.bias)
    parameters = (hidden, *head.parameters())
    expected = causal_lm_loss(head(hidden), labels)
    torch.testing.assert_close(loss, expected)
    for grad, reference in zip(torch.autograd.grad(loss, parameters), torch.autograd.grad(expected, parameters)):
        torch.testing.assert_close(grad, reference)
    assert products == ([3] * 8 + [2] if bias else [12, 12, 2])
