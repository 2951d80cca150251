"""fused_projections.py: inside `inference_projections`, q/k/v and gate/up laid out side by side are read as one
product per group, with the same outputs, the same parameters, state dict and checkpoints, and training untouched;
anything that replaces, wraps or hooks a projection falls back to the separate products; `generate` enters the
context on the listed devices only (CUDA by default; here the tests list the CPU), in transformers' loop, archlab's
compiled loops and beam search alike, and later calls reuse the layout without recompiling."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from archlab import DecoderForCausalLM
from archlab.modeling import fused_projections
from archlab.modeling.attention import Attention
from archlab.modeling.feed_forward import GatedMLP
from archlab.modeling.fused_projections import fusable_modules, inference_projections

from helpers import decoder_variant, randomised, seq2seq_variant, tiny_decoder_config

IDS = torch.randint(3, 61, (2, 7), generator=torch.Generator().manual_seed(0))


def _qwen2_like() -> DecoderForCausalLM:
    """Biases on q/k/v only (Qwen2), a shared expert beside routed ones: every group the layout covers."""
    config = tiny_decoder_config(
        qkv_bias=True, num_local_experts=4, num_experts_per_tok=2, shared_expert_intermediate_size=32
    )
    return randomised(DecoderForCausalLM(config))


MODELS = {
    "llama": lambda: decoder_variant("positions_rope"),
    "qwen2_moe": _qwen2_like,
    "seq2seq_gqa": lambda: seq2seq_variant("pre_norm_gqa"),
}


def _laid_out(model) -> list[bool]:
    """Per group: are its weights side by side in one storage (a view over them exists)?"""
    groups = fusable_modules(model)
    return [fused_projections._view_over([getattr(m, name).weight for name in m.fusable]) is not None for m in groups]


def _separate_groups(model) -> int:
    """Products a forward saves with every group read as one."""
    return sum(len(module.fusable) - 1 for module in fusable_modules(model))


@pytest.fixture
def linear_calls(monkeypatch) -> list[int]:
    """Counts matrix products (`F.linear`, which nn.Linear calls too)."""
    calls: list[int] = []
    linear = nn.functional.linear

    def counted(*args, **kwargs):
        calls.append(1)
        return linear(*args, **kwargs)

    monkeypatch.setattr(nn.functional, "linear", counted)
    return calls


def _logits(model) -> torch.Tensor:
    if model.config.is_encoder_decoder:
        return model(input_ids=IDS, decoder_input_ids=IDS[:, :5]).logits
    return model(input_ids=IDS).logits


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_layout_keeps_parameters_state_dict_and_checkpoints(name, tmp_path):
    model = MODELS[name]()
    before = {key: value.clone() for key, value in model.state_dict().items()}
    parameters = dict(model.named_parameters())
    assert not any(_laid_out(model))
    with inference_projections(model, force=True) as groups:
        assert groups == len(fusable_modules(model)) > 0
        attention = next(module for module in model.modules() if isinstance(module, Attention))
        assert attention._fused[0].data_ptr() == attention.q_proj.weight.data_ptr()
    assert all(module._fused is None for module in fusable_modules(model))  # nothing refers to a block outside
    assert all(_laid_out(model))
    assert dict(model.named_parameters()) == parameters  # the same Parameter objects, only their storage moved
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[key], before[key]) for key in before)
    address = attention.q_proj.weight.data_ptr()
    with inference_projections(model, force=True):
        pass
    assert attention.q_proj.weight.data_ptr() == address  # laid out already: nothing copied again

    model.save_pretrained(tmp_path)  # parameters sharing one storage: transformers saves them apart
    loaded = type(model).from_pretrained(tmp_path)
    assert all(torch.equal(loaded.state_dict()[key], before[key]) for key in before)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_inside_the_context_each_group_is_one_product(name, linear_calls):
    model = MODELS[name]()
    with torch.no_grad():
        expected = _logits(model)
        separate = len(linear_calls)
        linear_calls.clear()
        with inference_projections(model, force=True):
            actual = _logits(model)
        fused = len(linear_calls)
        linear_calls.clear()
        after = _logits(model)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    assert _separate_groups(model) > 0
    assert fused == separate - _separate_groups(model)
    assert len(linear_calls) == separate  # outside the context, the separate products again
    torch.testing.assert_close(after, expected, atol=0, rtol=0)


def test_training_records_gradients_through_the_separate_projections(linear_calls):
    model = MODELS["qwen2_moe"]().train()
    reference = copy.deepcopy(model)
    with inference_projections(model, force=True):  # laid out, and gradients recorded inside the context
        for candidate in (reference, model):
            linear_calls.clear()
            candidate(input_ids=IDS, labels=IDS).loss.backward()
            calls = len(linear_calls)
        assert calls == len(linear_calls)
    assert all(_laid_out(model))
    for (name, ours), theirs in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(ours.grad, theirs.grad, atol=1e-6, rtol=1e-5, msg=name)
    for candidate in (reference, model):
        torch.optim.AdamW(candidate.parameters(), lr=1e-2).step()
    assert all(_laid_out(model))  # the optimizer updates in place: the layout holds
    with torch.no_grad(), inference_projections(model.eval(), force=True):
        torch.testing.assert_close(_logits(model), _logits(reference.eval()), atol=1e-5, rtol=1e-5)


def test_a_layout_made_in_inference_mode_still_trains():
    model = MODELS["llama"]()
    with torch.inference_mode(), inference_projections(model, force=True):
        expected = _logits(model)
    assert all(_laid_out(model))
    assert not any(parameter.is_inference() for parameter in model.parameters())
    model(input_ids=IDS, labels=IDS).loss.backward()  # inference tensors would refuse to be saved for backward
    with torch.no_grad():
        torch.testing.assert_close(_logits(model), expected, atol=1e-5, rtol=1e-5)


def _back_to_back_storages(parameters: list[nn.Parameter]) -> None:
    """Give each parameter a storage of its own, the storages back to back in one buffer: what CUDA's caching
    allocator often does with weights allocated one after the other (one segment, adjacent blocks)."""
    nbytes = [parameter.numel() * parameter.element_size() for parameter in parameters]
    memory = memoryview(bytearray(sum(nbytes)))
    start = 0
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # frombuffer: "the given buffer is not writable" is not true
        for parameter, size in zip(parameters, nbytes):
            own = torch.frombuffer(memory[start : start + size], dtype=parameter.dtype).view(parameter.shape)
            own.copy_(parameter)
            parameter.data = own
            start += size


def test_weights_in_adjacent_storages_are_laid_out_not_read_across():
    """Adjacent addresses are not one block: a view across separate storages would reach past the first (CUDA
    raised 'setStorage: ... out of bounds'); the layout copies them into one block instead."""
    model = MODELS["llama"]()
    with torch.no_grad():
        expected = _logits(model)
    for module in fusable_modules(model):
        weights = [getattr(module, name).weight for name in module.fusable]
        _back_to_back_storages(weights)
        assert fused_projections._side_by_side_in_memory(weights)  # adjacent addresses ...
        assert fused_projections._view_over(weights) is None  # ... of separate storages: no view across
    assert not any(_laid_out(model))
    with torch.no_grad(), inference_projections(model, force=True) as groups:
        torch.testing.assert_close(_logits(model), expected, atol=1e-5, rtol=1e-5)
    assert groups == len(fusable_modules(model))
    assert all(_laid_out(model))


def test_too_little_memory_to_lay_out_leaves_the_separate_products(monkeypatch):
    """A failed block allocation leaves the group separate; one that fails after the weights moved (at the biases)
    leaves the weights' block this module's own, so the next call completes the layout."""
    model = MODELS["qwen2_moe"]()
    with torch.no_grad():
        expected = _logits(model)
    side_by_side = fused_projections._side_by_side

    def out_of_memory_at_biases(parameters):
        if parameters[0].dim() == 1:
            raise torch.OutOfMemoryError("CUDA out of memory (test)")
        return side_by_side(parameters)

    monkeypatch.setattr(fused_projections, "_side_by_side", out_of_memory_at_biases)
    with torch.no_grad(), inference_projections(model, force=True) as groups:
        torch.testing.assert_close(_logits(model), expected, atol=1e-5, rtol=1e-5)
    attentions = len(fusable_modules(model)) - groups
    assert attentions == 2  # the q/k/v biases failed; the shared experts' MLPs (no biases) are laid out
    monkeypatch.setattr(fused_projections, "_side_by_side", side_by_side)
    with torch.no_grad(), inference_projections(model, force=True) as groups:
        torch.testing.assert_close(_logits(model), expected, atol=1e-5, rtol=1e-5)
    assert groups == len(fusable_modules(model))


def test_replaced_or_converted_parameters_are_read_separately():
    model = MODELS["llama"]()
    other = randomised(DecoderForCausalLM(model.config))
    with torch.no_grad():
        other.model.layers[0].self_attn.q_proj.weight.mul_(-1)
    new = {key: value.clone() for key, value in other.state_dict().items()}
    with torch.no_grad(), inference_projections(model, force=True):
        model.load_state_dict(new, assign=True)  # new Parameter objects inside the context: the views are stale
        torch.testing.assert_close(_logits(model), _logits(other), atol=1e-5, rtol=1e-5)
    assert not any(_laid_out(model))
    with torch.no_grad(), inference_projections(model, force=True):  # laid out anew
        torch.testing.assert_close(_logits(model), _logits(other), atol=1e-5, rtol=1e-5)
    assert all(_laid_out(model))

    model.to(torch.float64)  # new storage for every parameter: the layout is gone, and no block kept the old one
    assert not any(_laid_out(model))
    with torch.no_grad(), inference_projections(model, force=True):
        torch.testing.assert_close(_logits(model), _logits(other.double()), atol=1e-9, rtol=1e-9)


def _flattened(model) -> torch.Tensor:
    """Every parameter made a view of one flat buffer, in registration order, as DeepSpeed's bf16 optimizer and
    FSDP's flat parameters lay them out (their optimizers then update the buffer)."""
    parameters = list(model.parameters())
    flat = torch.cat([parameter.detach().reshape(-1) for parameter in parameters])
    offset = 0
    for parameter in parameters:
        parameter.data = flat[offset : offset + parameter.numel()].view_as(parameter)
        offset += parameter.numel()
    return flat


@pytest.mark.parametrize("name", ["llama", "qwen2_moe"])
def test_parameters_in_someone_elses_flat_buffer_are_never_moved(name):
    """Projections already side by side in the buffer (no biases) are read as one product where they lie; others
    (Qwen2: q weight, q bias, k weight, ...) stay separate. Either way the buffer still holds every parameter."""
    model = MODELS[name]()
    with torch.no_grad():
        expected = _logits(model)
    flat = _flattened(model)
    with torch.no_grad(), inference_projections(model, force=True) as groups:
        torch.testing.assert_close(_logits(model), expected, atol=1e-5, rtol=1e-5)
    mlps = sum(isinstance(module, GatedMLP) for module in fusable_modules(model))
    assert groups == (len(fusable_modules(model)) if name == "llama" else mlps)  # Qwen2: the shared experts' MLPs
    assert all(parameter.untyped_storage().data_ptr() == flat.data_ptr() for parameter in model.parameters())
    before = [parameter.detach().clone() for parameter in model.parameters()]
    with torch.no_grad():
        flat.add_(1.0)  # an optimizer step through the buffer reaches every parameter
    assert all(torch.equal(parameter, old + 1.0) for parameter, old in zip(model.parameters(), before))


def test_wrapped_or_hooked_projections_are_left_as_they_are():
    from accelerate.hooks import ModelHook, add_hook_to_module
    from peft import LoraConfig, get_peft_model

    model = MODELS["llama"]()
    seen = []
    model.model.layers[1].mlp.up_proj.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    add_hook_to_module(model.model.layers[0].mlp.gate_proj, ModelHook())  # replaces the instance's forward
    lora = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    with torch.no_grad():
        expected = lora(input_ids=IDS).logits
        with inference_projections(lora, force=True) as groups:
            actual = lora(input_ids=IDS).logits
    assert groups == 0  # of four: both attentions are LoRA'd, both MLPs hooked (accelerate's way, torch's way)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    assert len(seen) == 2  # the hook saw its projection inside the context too


class _Wrapped(torch.Tensor):
    """A weight that holds no storage of its own and computes through the tensor it wraps, as torchao's quantized
    weights (`Int8Tensor`, ...) do."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype, device=inner.device)

    def __init__(self, inner: torch.Tensor):
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.detach.default:  # a Parameter of it stays one
            return _Wrapped(args[0].inner.detach())
        unwrap = lambda value: value.inner if isinstance(value, _Wrapped) else value  # noqa: E731
        return func(*torch.utils._pytree.tree_map(unwrap, args), **torch.utils._pytree.tree_map(unwrap, kwargs or {}))


def test_a_projection_whose_weight_is_a_wrapper_subclass_is_read_separately(monkeypatch):
    """torchao's int8 weights: `generate` (on CUDA, where the layout is on by default) failed with "Attempted to access
    the data pointer on an invalid python storage" before the first token."""
    monkeypatch.setattr(fused_projections, "FUSED_PROJECTION_DEVICES", ("cpu",))
    model = MODELS["llama"]()
    expected = _generation(model)
    for module in fusable_modules(model):
        for linear in fused_projections._linears(module):
            linear.weight = nn.Parameter(_Wrapped(linear.weight.detach()), requires_grad=False)
    with torch.no_grad(), inference_projections(model, force=True) as groups:
        assert groups == 0
    assert torch.equal(_generation(model), expected)


def _generation(model, **kwargs) -> torch.Tensor:
    if model.config.is_encoder_decoder:
        return model.generate(input_ids=IDS, max_new_tokens=8, num_beams=3, do_sample=False, **kwargs)
    mask = torch.ones_like(IDS)
    mask[0, :2] = 0
    kwargs.update(max_new_tokens=8, do_sample=False, pad_token_id=0)
    return model.generate(input_ids=IDS, attention_mask=mask, **kwargs)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_generate_reads_one_product_per_group_only_on_the_listed_devices(name, monkeypatch, linear_calls):
    monkeypatch.setattr(fused_projections, "FUSED_PROJECTION_DEVICES", ("cuda",))  # the default (CI may list cpu)
    model = MODELS[name]()
    expected = _generation(model)
    separate = len(linear_calls)
    assert not any(_laid_out(model))  # CUDA only by default: on CPU nothing moves

    monkeypatch.setattr(fused_projections, "FUSED_PROJECTION_DEVICES", ("cpu",))
    linear_calls.clear()
    assert torch.equal(_generation(model), expected)
    assert all(_laid_out(model))
    assert len(linear_calls) < separate


def _compile_config():
    from transformers import CompileConfig

    config = CompileConfig(backend="eager", mode=None, fullgraph=True)
    config._compile_all_devices = True  # transformers compiles the decoding step on CPU too
    return config


@pytest.mark.parametrize("name", ["llama", "seq2seq_gqa"])
def test_the_compiled_loops_read_the_blocks_and_later_calls_do_not_recompile(name, monkeypatch):
    """The compiled greedy and beam-search steps trace the one-product path (fullgraph=True), and a second call —
    new views over the same memory — recompiles nothing."""
    torch._dynamo.reset()
    model = MODELS[name]()
    expected = _generation(model, cache_implementation="static")
    monkeypatch.setattr(fused_projections, "FUSED_PROJECTION_DEVICES", ("cpu",))
    kwargs = dict(cache_implementation="static", compile_config=_compile_config())
    assert torch.equal(_generation(model, **kwargs), expected)
    assert all(_laid_out(model))
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert torch.equal(_generation(model, **kwargs), expected)


def test_compiled_code_reads_the_blocks_only_inside_the_context(linear_calls):
    torch._dynamo.reset()
    mlp = MODELS["llama"]().model.layers[0].mlp
    compiled = torch.compile(mlp, backend="eager", fullgraph=True)
    x = torch.randn(2, 3, 32)
    with torch.no_grad():
        outside = compiled(x)
        separate = len(linear_calls)  # counted while dynamo traces
        linear_calls.clear()
        with inference_projections(mlp, force=True):
            inside = compiled(x)
    assert (separate, len(linear_calls)) == (3, 2)  # gate, up, down; then the block and down
    torch.testing.assert_close(inside, outside, atol=1e-5, rtol=1e-5)


def test_a_model_with_a_global_hook_is_not_laid_out(monkeypatch):
    monkeypatch.setattr(fused_projections, "FUSED_PROJECTION_DEVICES", ("cpu",))
    model = MODELS["llama"]()
    handle = nn.modules.module.register_module_forward_hook(lambda module, args, out: None)
    try:
        _generation(model)
    finally:
        handle.remove()
    assert not any(_laid_out(model))


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_walk_finds_what_every_module_finds_each_once(name):
    """`fusable_modules` skips the inside of each group (its projections): the same modules, in the same order, as
    filtering `modules()`; a group reachable twice (a module shared by two parents) is listed once."""
    model = MODELS[name]()
    everything = [m for m in model.modules() if isinstance(m, fused_projections.FusableProjections) and m.fusable]
    assert fusable_modules(model) == everything and len(everything) > 0
    shared = nn.ModuleDict({"first": model, "again": model})
    assert fusable_modules(shared) == everything
