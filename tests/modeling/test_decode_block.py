"""A pre-norm layer's decoding step with its norms and residual adds inside the GEMVs (modeling/decode_block.py): used
only where it applies; each layer's output equals the block's own forward (every decoder variant of the tests:
position schemes, masks, a mixture of experts' attention half; QK-norm, biases); greedy decoding through it
(transformers' loop, and archlab's loop with its step traced by dynamo) gives the block's tokens, four GEMV kernels a
dense layer in the traced step.

The kernels run where Triton does: on a GPU, or on a CPU through Triton's interpreter (tests/triton_interpreter.py),
which `test_kernels_through_the_triton_interpreter` starts in a fresh process."""

from __future__ import annotations

import copy

import pytest
import torch

from archlab import DecoderForCausalLM
from archlab.modeling import (
    decode_block,
    fused_projections,
    triton_decoding,
    triton_gemv,
    triton_launch,
    triton_moe,
    triton_qkv,
)
from archlab.modeling.decode_block import fused_block_applies
from archlab.modeling.fused_projections import inference_projections

from helpers import DECODER_VARIANTS, randomised, tiny_decoder_config
from triton_interpreter import (
    DEVICE,
    greedy_tokens,
    interpreted_run_of,
    interpreter_gaps_filled,
    left_padded_batch,
    runs_kernels,
    with_dependent_launch_code,
)

MOE = dict(num_local_experts=4, num_experts_per_tok=2)
# every decoder variant of the catalogue's tests (RMSNorm: position schemes, RoPE types, sliding and prefix-LM masks,
# soft-capping, mixtures of experts, QK-norm over the projections), biases, QK-norm, and the parallel blocks; the
# output-norm block (`test_an_output_norm_layer_s_step_runs_the_block_s_forward`), a gated attention, Sub-LN and latent
# attention (`test_the_fused_step_applies_only_to_plain_pre_norm_layers_of_a_few_rows`) never take the fused step
UNFUSED_PLACEMENTS = {
    "output_norm",
    "gated_attention",
    "sub_layer_norm",
    "latent_attention",
    "latent_attention_query_rank_yarn",
}
VARIANTS = {
    **{name: fields for name, fields in DECODER_VARIANTS.items() if name not in UNFUSED_PLACEMENTS},
    "biases": dict(attention_bias=True, mlp_bias=True),
    "qk_norm": dict(use_qk_norm=True),
    **{position: dict(norm_position=position) for position in ("parallel", "parallel_shared_norm")},
    "parallel_moe": dict(norm_position="parallel", **MOE),
}
# μP's constants but the residual multiplier, whose block keeps its forward (the kernels add the residual unscaled:
# `test_the_fused_step_applies_only_to_plain_pre_norm_layers_of_a_few_rows`)
VARIANTS["mup_multipliers"] = {
    name: value for name, value in DECODER_VARIANTS["mup_multipliers"].items() if name != "residual_multiplier"
}


_interpreter_gaps = interpreter_gaps_filled("archlab.modeling.triton_")


@pytest.fixture(autouse=True)
def _every_row_count_fused(monkeypatch):
    """The tests fuse every step the kernels take (`triton_gemv.MAX_ROWS`); the default fuses steps of one row. The
    q/k/v kernel with RoPE and the cache writes runs where it applies, as on an NVIDIA GPU."""
    monkeypatch.setattr(decode_block, "FUSED_BLOCK_ROWS", triton_gemv.MAX_ROWS)
    monkeypatch.setattr(triton_qkv, "QKV_ROTARY_CACHE_DEVICES", (DEVICE,))


def _model(**overrides):
    return randomised(DecoderForCausalLM(tiny_decoder_config(**overrides))).to(DEVICE)


def test_by_default_the_fused_step_takes_the_steps_of_one_row_on_cuda(monkeypatch):
    """What `--suite cuda-tuning` measured faster: batch-1 decoding steps (one row), on CUDA; a step of two rows (a
    batch of two, a prompt of two tokens) runs the block's own forward."""
    monkeypatch.undo()  # the module's defaults
    assert decode_block.FUSED_BLOCK_DEVICES == ("cuda",) and decode_block.FUSED_BLOCK_ROWS == 1
    monkeypatch.setattr(triton_gemv, "triton", object())  # as where Triton is installed
    monkeypatch.setattr(decode_block, "FUSED_BLOCK_DEVICES", (DEVICE,))
    model = _model()
    layer = model.model.layers[0]
    with torch.no_grad(), inference_projections(model, force=True):
        assert fused_block_applies(layer, torch.zeros(1, 1, model.config.hidden_size, device=DEVICE))
        for shape in ((2, 1), (1, 2)):
            assert not fused_block_applies(layer, torch.zeros(*shape, model.config.hidden_size, device=DEVICE))


def test_the_fused_step_applies_only_to_plain_pre_norm_layers_of_a_few_rows(monkeypatch):
    monkeypatch.setattr(triton_gemv, "triton", object())  # as where Triton is installed
    monkeypatch.setattr(decode_block, "FUSED_BLOCK_DEVICES", (DEVICE,))
    model = _model()
    layer = model.model.layers[0]
    step = torch.zeros(2, 1, model.config.hidden_size, device=DEVICE)
    with torch.no_grad():
        assert not fused_block_applies(layer, step)  # q/k/v not laid out as one product
        with inference_projections(model, force=True):
            assert fused_block_applies(layer, step)
            assert fused_block_applies(_laid_out(_model(**MOE)), step)  # the attention half
            assert fused_block_applies(layer, torch.zeros(16, 1, step.shape[-1], device=DEVICE))  # 16 rows
            assert not fused_block_applies(layer, torch.zeros(1, 17, step.shape[-1], device=DEVICE))  # a prefill
            assert not fused_block_applies(layer, step.half())  # the weights' dtype differs
            layer.input_layernorm.register_forward_hook(lambda *args: None)
            assert not fused_block_applies(layer, step)  # hooked (accelerate, a user's hook)
            for variant in (dict(norm_type="layer_norm"), dict(norm_type="offset_rms_norm")):
                assert not fused_block_applies(_laid_out(_model(**variant)), step), variant
            for position in ("parallel", "parallel_shared_norm"):
                assert fused_block_applies(_laid_out(_model(norm_position=position)), step), position
            # the kernels add the residual unscaled: Granite's scaled sub-layer outputs keep the block's forward
            assert not fused_block_applies(_laid_out(_model(residual_multiplier=0.5)), step)
            assert fused_block_applies(_laid_out(_model(logit_scale=0.5, attention_multiplier=0.1)), step)
            assert not fused_block_applies(_laid_out(_model(attention_output_gate="elementwise")), step)  # gated heads
            assert not fused_block_applies(_laid_out(_model(sub_layer_norm=True)), step)  # heads normed (Sub-LN)
            assert fused_block_applies(_laid_out(_model(attention_sinks=True)), step)  # sinks: attend_heads' choice
            latent = dict(num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)
            assert not fused_block_applies(_model(**latent).model.layers[0], step)  # no q/k/v product: latents
        layer.input_layernorm._forward_hooks.clear()
        monkeypatch.setattr(decode_block, "FUSED_BLOCK_DEVICES", ())
        with inference_projections(model, force=True):
            assert not fused_block_applies(layer, step)
    with inference_projections(model, force=True):
        monkeypatch.setattr(decode_block, "FUSED_BLOCK_DEVICES", (DEVICE,))
        assert not fused_block_applies(layer, step)  # gradients recorded: the kernels have no backward


def test_an_output_norm_layer_s_step_runs_the_block_s_forward(monkeypatch):
    """OLMo 2's placement norms the attention's and the MLP's outputs, where the kernels put a norm before a product and
    a residual after it: a decoding step of such a layer runs the block's own forward, wherever the fused step is on."""
    monkeypatch.setattr(triton_gemv, "triton", object())  # as where Triton is installed
    monkeypatch.setattr(decode_block, "FUSED_BLOCK_DEVICES", (DEVICE,))
    calls = _counted_calls(monkeypatch)
    model = _model(norm_position="output")
    ids = torch.randint(3, model.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    with torch.no_grad(), inference_projections(model, force=True):
        prefix = model(ids[:, :5], use_cache=True)
        step = model(ids[:, 5:], past_key_values=prefix.past_key_values).logits
    assert calls == [] and torch.isfinite(step).all()


def _laid_out(model):
    """The first layer of `model`, its projections laid out as one product each (the context's layout outlives it
    for this check: `fused_weights` reads `_fused`, set inside)."""
    fused_projections._enter(model.model.layers[0].self_attn)
    return model.model.layers[0]


@runs_kernels
@pytest.mark.parametrize("variant", VARIANTS)
def test_each_layer_s_step_equals_the_block_s_forward(variant, monkeypatch):
    """A decoding step of two rows over a 5-token cache through every layer, fused against the block's forward (the
    hidden states after each layer and the logits)."""
    _assert_the_fused_step_equals_the_block_s(_model(**VARIANTS[variant]), 2, monkeypatch)


# the experts' own choices the fused step's kernels compute: GPT-OSS's router bias (inside the router's GEMV), its
# experts' biases and clamped quick-GELU SwiGLU with up + 1, and Llama 4's routing weight on the expert's input
MOE_OWN_CHOICES = {
    "moe_gpt_oss": dict(
        MOE,
        router_bias=True,
        expert_bias=True,
        swiglu_limit=1.0,
        swiglu_up_offset=1.0,
        hidden_act="quick_gelu",
    ),
    "moe_llama4": dict(
        MOE, num_experts_per_tok=1, router_score_function="sigmoid", norm_topk_prob=False, routing_weights_on_input=True
    ),
}


@runs_kernels
@pytest.mark.parametrize(
    "variant", ["moe", "parallel_moe", "moe_norm_topk", "moe_shared_expert_dense_sparse", *MOE_OWN_CHOICES]
)
def test_a_mixture_of_experts_takes_its_half_of_the_step_through_the_expert_kernels(variant, monkeypatch):
    """With triton_moe.py's kernels on too, an MoE layer's MLP half joins the fused step: RMSNorm inside the router's
    GEMV and the experts' gate/up kernel, the residual added by their down kernel; the same hidden states and logits
    as the blocks' forward, once for each sparse layer; GPT-OSS's router bias and experts and Llama 4's weights on the
    input too. A shared expert keeps the block's MLP (its layers' attention half still fused); a dense layer of a
    mixed model fuses as dense."""
    monkeypatch.setattr(triton_moe, "MOE_DECODE_DEVICES", (DEVICE,))
    calls, fused_moe = [], decode_block._fused_moe
    monkeypatch.setattr(decode_block, "_fused_moe", lambda *a: calls.append(1) or fused_moe(*a))
    overrides = {**MOE, "norm_topk_prob": True} if variant == "moe_norm_topk" else VARIANTS.get(variant)
    model = _model(**(MOE_OWN_CHOICES.get(variant) or overrides))
    _assert_the_fused_step_equals_the_block_s(model, 2, monkeypatch)
    sparse_layers = [layer for layer in model.model.layers if type(layer.mlp).__name__ == "SparseMoeBlock"]
    shared = any(layer.mlp.shared_expert is not None for layer in sparse_layers)
    assert len(calls) == (0 if shared else len(sparse_layers))


@runs_kernels
@pytest.mark.parametrize("rows", [7, 16])
@pytest.mark.parametrize("splits", [1, 2], ids=["whole", "split-k"])
def test_steps_of_more_rows_take_the_tensor_core_kernel_and_equal_the_block_s_forward(rows, splits, monkeypatch):
    """Whole, and each product's input blocks in two shares (`triton_gemv.split_count`, on a GPU from its number of
    processors)."""
    monkeypatch.setattr(triton_gemv, "split_count", lambda *args: splits)
    _assert_the_fused_step_equals_the_block_s(_model(), rows, monkeypatch)


@runs_kernels
@pytest.mark.parametrize("padded", [False, True], ids=["causal", "padded"])
def test_a_short_prompt_s_forward_takes_the_fused_step_with_its_mask(padded, monkeypatch):
    """A prefill of 12 tokens at batch 1 is 12 rows: the fused step runs it, each layer's attention with the causal
    mask (or the padded prompt's), and gives the block's logits."""
    model = _model()
    ids = torch.randint(3, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    mask = torch.ones_like(ids)
    if padded:
        mask[:, :3] = 0
    with torch.no_grad(), inference_projections(model, force=True):
        expected = model(ids, attention_mask=mask).logits
        monkeypatch.setattr(decode_block, "FUSED_BLOCK_DEVICES", (DEVICE,))
        calls = _counted_calls(monkeypatch)
        fused = model(ids, attention_mask=mask).logits
    assert len(calls) == model.config.num_hidden_layers
    torch.testing.assert_close(fused, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


def _assert_the_fused_step_equals_the_block_s(model, rows: int, monkeypatch) -> None:
    config = model.config
    ids = torch.randint(3, config.vocab_size, (rows, 6), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    with torch.no_grad(), inference_projections(model, force=True):
        prefix = model(ids[:, :5], use_cache=True)
        expected = model(ids[:, 5:], past_key_values=copy.deepcopy(prefix.past_key_values), output_hidden_states=True)
        monkeypatch.setattr(decode_block, "FUSED_BLOCK_DEVICES", (DEVICE,))
        calls = _counted_calls(monkeypatch)
        fused = model(ids[:, 5:], past_key_values=copy.deepcopy(prefix.past_key_values), output_hidden_states=True)
    assert len(calls) == config.num_hidden_layers
    # fp32 sums in another order: within 1e-5 of each tensor's scale (randomised weights: hidden states up to ~80)
    for ours, theirs in [*zip(fused.hidden_states, expected.hidden_states), (fused.logits, expected.logits)]:
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5 * theirs.abs().max().item())


def _counted_calls(monkeypatch) -> list:
    """A list that gets an entry each time a block runs `fused_block_forward`."""
    calls, forward = [], decode_block.fused_block_forward

    def counted(*args, **kwargs):
        calls.append(1)
        return forward(*args, **kwargs)

    monkeypatch.setattr("archlab.modeling.blocks.fused_block_forward", counted)
    return calls


@runs_kernels
@pytest.mark.parametrize(
    "compiled, rotary",
    [(False, "whole"), (True, "whole"), (True, "partial")],
    ids=["transformers-loop", "archlab-loop", "archlab-loop-partial-rotary"],
)
def test_greedy_decoding_through_the_fused_step_gives_the_block_s_tokens(compiled, rotary, monkeypatch):
    """Two rows, heads rotated whole or, in archlab's loop (where the q/k/v kernel writes the static cache), half of
    each (`partial_rotary_factor` 0.5: GPT-NeoX's layout, whose channels past the rotary pass through the kernel's
    epilogue as they are)."""
    torch._dynamo.reset()
    partial = {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}
    model = _model(**({"rope_parameters": partial} if rotary == "partial" else {}))
    batch = left_padded_batch(model.config.vocab_size)
    monkeypatch.setattr(fused_projections, "FUSED_PROJECTION_DEVICES", (DEVICE,))  # generate lays q/k/v out
    expected = greedy_tokens(model, batch, [] if compiled else None)
    model.release_decoding_memory()
    torch._dynamo.reset()
    monkeypatch.setattr(decode_block, "FUSED_BLOCK_DEVICES", (DEVICE,))
    if compiled:
        graphs = []
        assert torch.equal(greedy_tokens(model, batch, graphs), expected)
        # each of the two layers: q/k/v with RoPE and the cache writes through `qkv_rotary_cache` (the loop's static
        # cache), o and down through `gemv`, gate/up with SwiGLU through `gated_gemv`
        assert graphs and all(graph.count("archlab.qkv_rotary_cache") == 2 for graph in graphs)
        assert all(graph.count("archlab.gemv") == 4 for graph in graphs)
        assert all(graph.count("archlab.gated_gemv") == 2 for graph in graphs)
    else:
        calls = _counted_calls(monkeypatch)
        assert torch.equal(greedy_tokens(model, batch), expected)
        assert len(calls) == 2 * 9  # two layers, the nine steps after the prefill (two rows each)


@runs_kernels
def test_the_kernels_pdl_twins_compiled_by_inductor_give_the_block_s_tokens(monkeypatch):
    """With `PDL_DEVICES` listing the device, the fused step's GEMVs and the Triton attention go through the ops' PDL
    twins (triton_launch.py: custom ops, opaque to torch.compile); inductor compiles archlab's decoding step around
    them (on a CPU too, the interpreter running the kernels inside the compiled step) and greedy decoding gives the
    block's tokens: each layer's step 1 `qkv_rotary_cache_pdl`, 2 `gemv_pdl`, 1 `gated_gemv_pdl` and 1
    `decode_attention_pdl`, and none of the plain ops. Inductor's code calls `qkv_rotary_cache_pdl` on the static
    cache's own tensors (the step's inputs, written in place: a functionalised op not put back in place would write
    a copy of the cache, copied back after). The kernels run their dependent-launch code (the streaming GEMV's first
    weight block read before the wait); under the interpreter without the `griddepcontrol` instructions and the
    launch attribute, which are Hopper's (test_triton_compile.py checks the code that goes with them)."""
    import re

    from torch._inductor.compile_fx import compile_fx
    from torch._inductor.utils import run_and_get_code
    from transformers import CompileConfig

    torch._dynamo.reset()
    model = _model(head_dim=16, num_attention_heads=4, num_key_value_heads=2)  # a head size the attention kernel takes
    batch = left_padded_batch(model.config.vocab_size)
    monkeypatch.setattr(fused_projections, "FUSED_PROJECTION_DEVICES", (DEVICE,))
    expected = greedy_tokens(model, batch)
    model.release_decoding_memory()
    torch._dynamo.reset()
    monkeypatch.setattr(triton_decoding, "KEYS_PER_PROGRAM", 8)  # a row's keys split: the combine kernel's twin too
    for module, name in ((decode_block, "FUSED_BLOCK_DEVICES"), (triton_decoding, "TRITON_DECODING_DEVICES")):
        monkeypatch.setattr(module, name, (DEVICE,))
    monkeypatch.setattr(triton_launch, "PDL_DEVICES", (DEVICE,))
    with_dependent_launch_code(monkeypatch, triton_gemv, triton_decoding)
    graphs = []

    def inductor(graph_module, example_inputs):
        graphs.append(graph_module.code)
        return compile_fx(graph_module, example_inputs)

    config = CompileConfig(fullgraph=True, backend=inductor, mode=None)
    config._compile_all_devices = True
    kwargs = dict(max_new_tokens=10, do_sample=False, pad_token_id=0, cache_implementation="static")
    tokens, codes = run_and_get_code(model.generate, **batch, **kwargs, compile_config=config)
    assert torch.equal(tokens, expected)
    layers = model.config.num_hidden_layers
    assert graphs and all(graph.count("archlab.qkv_rotary_cache_pdl") == layers for graph in graphs)
    assert all(graph.count("archlab.gemv_pdl") == 2 * layers for graph in graphs)
    assert all(graph.count("archlab.gated_gemv_pdl") == layers for graph in graphs)
    assert all(graph.count("archlab.decode_attention_pdl") == layers for graph in graphs)
    assert not any("archlab.gemv.default" in graph or "archlab.gated_gemv.default" in graph for graph in graphs)
    calls = [call.split(", ") for code in codes for call in re.findall(r"qkv_rotary_cache_pdl\.default\((.*)\)", code)]
    assert len(calls) == layers * len(graphs)
    assert all(re.fullmatch(r"arg\d+_1", call[7]) and re.fullmatch(r"arg\d+_1", call[8]) for call in calls), calls


# ---- on a CPU: the kernel tests above, through Triton's interpreter ------------------------------------------------


test_kernels_through_the_triton_interpreter = interpreted_run_of(__file__)
