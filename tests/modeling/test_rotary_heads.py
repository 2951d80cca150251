"""rotary.py's `heads_side_by_side`: queries and keys of one q/k/v product (fused_projections.py) rotate as one
tensor in eager inference — the same values, bit for bit, in half the kernels — and nowhere else: separate tensors,
tensors merely adjacent in memory, gradients, compiled code."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from archlab import DecoderForCausalLM
from archlab.modeling import rotary
from archlab.modeling.fused_projections import inference_projections

from helpers import randomised, tiny_decoder_config

# the operators of the formula that write a tensor (a kernel each on a GPU)
_WRITING = {"aten.mul.Tensor", "aten.add.Tensor", "aten.neg.default", "aten.cat.default"}


class _CountWrites(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.writes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.writes += str(func) in _WRITING
        return func(*args, **(kwargs or {}))


def _one_product(batch: int, length: int, heads: int, key_heads: int, dtype=torch.float32, width: int = 8):
    """Queries, keys and values as `Attention.split_heads` makes them from one q/k/v product, and cos/sin."""
    generator = torch.Generator().manual_seed(batch * 100 + length * 10 + heads + key_heads)
    product = torch.randn(batch, length, (heads + 2 * key_heads) * width, generator=generator).to(dtype)
    parts = product.split((heads * width, key_heads * width, key_heads * width), dim=-1)
    query, key, value = (part.view(batch, length, -1, width).transpose(1, 2) for part in parts)
    cos, sin = (torch.randn(batch, length, width, generator=generator).to(dtype) for _ in range(2))
    return query, key, value, cos, sin


def _separately(query, key, cos, sin):
    """The formula on copies of their own (no shared memory: the per-tensor path)."""
    return rotary.rotary_formula(query.clone(), key.clone(), cos, sin)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "batch, length, heads, key_heads",
    [(1, 1, 4, 2), (3, 1, 4, 2), (1, 7, 4, 2), (2, 5, 4, 4), (2, 3, 4, 1), (1, 1, 6, 1)],
    ids=["step", "step-batch", "prompt", "mha", "mqa", "mqa-step"],
)
def test_one_products_queries_and_keys_rotate_as_one_tensor_bit_for_bit(batch, length, heads, key_heads, dtype):
    query, key, _, cos, sin = _one_product(batch, length, heads, key_heads, dtype)
    assert rotary.heads_side_by_side(query, key) is not None
    with _CountWrites() as joint:
        rotated = rotary.rotary_formula(query, key, cos, sin)
    with _CountWrites() as separate:
        expected = _separately(query, key, cos, sin)
    for ours, theirs in zip(rotated, expected):
        assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
        assert torch.equal(ours, theirs)
    assert (joint.writes, separate.writes) == (5, 10)


def test_separate_or_merely_adjacent_tensors_rotate_each_on_its_own():
    query, key, value, cos, sin = _one_product(2, 5, 4, 2)
    assert rotary.heads_side_by_side(query.clone(), key.clone()) is None  # separate allocations
    assert rotary.heads_side_by_side(query, value) is None  # one product, but not right after the queries
    assert rotary.heads_side_by_side(key, query) is None  # keys before queries
    # one token, one row: a query and a key of storages of their own, back to back in memory (a caching allocator's
    # neighbours), look like one product by address alone
    memory = memoryview(bytearray(4 * 8 * 4 + 2 * 8 * 4))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # frombuffer: "the given buffer is not writable"
        own_query = torch.frombuffer(memory[: 4 * 8 * 4], dtype=torch.float32).view(1, 1, 4, 8).transpose(1, 2)
        own_key = torch.frombuffer(memory[4 * 8 * 4 :], dtype=torch.float32).view(1, 1, 2, 8).transpose(1, 2)
    assert own_key.data_ptr() == own_query.data_ptr() + 4 * 8 * 4
    assert rotary.heads_side_by_side(own_query, own_key) is None


def test_recording_gradients_or_compiling_rotates_each_on_its_own():
    query, key, _, cos, sin = _one_product(2, 5, 4, 2)
    leaf = query.detach().requires_grad_()
    assert rotary.heads_side_by_side(leaf, key) is None
    seen = []

    def rotate(query, key, cos, sin):
        seen.append(rotary.heads_side_by_side(query, key))
        return rotary.rotary_formula(query, key, cos, sin)

    compiled = torch.compile(rotate, backend="eager", fullgraph=True)
    for ours, theirs in zip(compiled(query, key, cos, sin), _separately(query, key, cos, sin)):
        assert torch.equal(ours, theirs)
    assert seen == [None]


def test_generate_with_one_qkv_product_gives_the_same_logits_and_takes_the_joint_rotation(monkeypatch):
    """A decoder inside `inference_projections` (generate's context on CUDA) rotates each layer's queries and keys as
    one tensor, with the logits of the separate projections exactly."""
    model = randomised(DecoderForCausalLM(tiny_decoder_config(num_hidden_layers=2)).eval())
    input_ids = torch.randint(3, model.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(input_ids).logits
    joint = []
    original = rotary.heads_side_by_side
    monkeypatch.setattr(rotary, "heads_side_by_side", lambda q, k: joint.append(original(q, k)) or joint[-1])
    with torch.no_grad(), inference_projections(model, force=True):
        logits = model(input_ids).logits
    assert len(joint) == 2 and all(heads is not None for heads in joint)
    torch.testing.assert_close(logits, expected, atol=1e-6, rtol=1e-6)  # one q/k/v product: its own rounding
