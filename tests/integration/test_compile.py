"""torch.compile: the decoder forward compiles with `fullgraph=True` (no graph break anywhere in the model), a compiled
training step gives eager's loss and gradients, and `generate` with a StaticCache and a compiled decoding step gives
eager's tokens. Cold compiles cost about a minute each on 2 CPU cores, hence few tests, all `slow`.
"""

from __future__ import annotations

import pytest
import torch
from transformers import CompileConfig

from archlab import DecoderForCausalLM

from helpers import assert_close_to_scale, tiny_decoder_config

pytestmark = pytest.mark.slow


def _batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, 97, (2, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # a left-padded row: the mask path is compiled too
    return {"input_ids": ids, "attention_mask": mask}


def _pair(**overrides) -> tuple[DecoderForCausalLM, DecoderForCausalLM]:
    eager = DecoderForCausalLM(tiny_decoder_config(**overrides))
    compiled = DecoderForCausalLM(tiny_decoder_config(**overrides))
    compiled.load_state_dict(eager.state_dict())
    return eager, compiled


def test_forward_compiles_fullgraph():
    torch._dynamo.reset()
    eager, model = _pair()
    eager.eval(), model.eval()
    compiled = torch.compile(model, fullgraph=True)  # raises on any graph break
    batch = _batch()
    with torch.no_grad():
        torch.testing.assert_close(compiled(**batch).logits, eager(**batch).logits, rtol=1e-5, atol=1e-5)


def test_compiled_training_step_matches_eager():
    """Forward, chunked LM loss (3 chunks of 8 tokens) and backward in one compiled graph; then one AdamW step."""
    torch._dynamo.reset()
    eager, model = _pair(lm_loss_chunk_size=8)
    eager.train(), model.train()
    compiled = torch.compile(model, fullgraph=True)
    batch = _batch()
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    initial = [p.detach().clone() for p in eager.parameters()]  # both models start from these weights
    losses = []
    for m, run in ((eager, eager), (model, compiled)):
        optimizer = torch.optim.AdamW(m.parameters(), lr=1e-2)
        loss = run(**batch, labels=labels).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-5)
    for (name, p_eager), p_compiled, p_initial in zip(eager.named_parameters(), model.parameters(), initial):
        torch.testing.assert_close(p_compiled.grad, p_eager.grad, rtol=1e-4, atol=1e-6, msg=name)
        # AdamW's first step is about lr x sign(grad) even for a gradient at rounding level: compare the steps,
        # relative to their size, not the weights to a fixed atol
        assert_close_to_scale(p_compiled - p_initial, p_eager - p_initial, rtol=1e-3, msg=name)


def test_static_cache_generation_compiles():
    """transformers' own path: `cache_implementation="static"` + a `CompileConfig` compiles the decoding step."""
    torch._dynamo.reset()
    model = DecoderForCausalLM(tiny_decoder_config()).eval()
    batch = _batch()
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, cache_implementation="static")
    expected = model.generate(**batch, **kwargs, disable_compile=True)
    config = CompileConfig(fullgraph=True, mode="default")
    config._compile_all_devices = True  # generate compiles only on accelerators unless told to (its testing hook)
    output = model.generate(**batch, **kwargs, compile_config=config)
    assert hasattr(model, "_compiled_call"), "generate did not compile the decoding step"
    assert torch.equal(output, expected)
    assert torch.equal(model.generate(**batch, **kwargs, compile_config=config), expected)  # reuses the graph


def test_regional_compilation_trains_like_eager_without_recompiles():
    """accelerate's `compile_regions` (what `--dynamo_use_regional_compilation` uses) compiles one block's code and
    reuses it for every layer (as many graphs for 3 layers as for 1) and every later step (no recompile), and the
    losses equal eager's."""
    from accelerate.utils import compile_regions
    from torch._dynamo.utils import counters

    batch = {**_batch(), "labels": _batch()["input_ids"]}
    graphs = {}
    for layers in (1, 3):
        torch._dynamo.reset()
        counters.clear()
        eager, model = _pair(num_hidden_layers=layers)
        compiled = compile_regions(model, dynamic=False)
        assert all(type(layer).__name__ == "OptimizedModule" for layer in compiled.model.layers)
        losses = {}
        for name, module in (("eager", eager), ("compiled", compiled)):
            module.train()
            optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
            losses[name] = []
            for step in range(3):
                with torch._dynamo.config.patch(error_on_recompile=step > 0):
                    loss = module(**batch).loss
                    loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                losses[name].append(loss.item())
        graphs[layers] = counters["stats"]["unique_graphs"]
        assert losses["eager"][-1] < losses["eager"][0]
        torch.testing.assert_close(losses["compiled"], losses["eager"], rtol=1e-5, atol=1e-5)
    assert graphs[3] == graphs[1] > 0
