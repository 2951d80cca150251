"""torch.compile: the decoder forward compiles with `fullgraph=True` (no graph break anywhere in the model), a compiled
training step gives eager's loss and gradients, and `generate` with a StaticCache and a compiled decoding step gives
eager's tokens. Cold compiles cost about a minute each on 2 CPU cores, hence few tests, all `slow`.
"""

from __future__ import annotations

import pytest
import torch
from transformers import CompileConfig

from archlab import DecoderForCausalLM
from conftest import tiny_decoder_config

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
    losses = []
    for m, run in ((eager, eager), (model, compiled)):
        optimizer = torch.optim.AdamW(m.parameters(), lr=1e-2)
        loss = run(**batch, labels=labels).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-5)
    for (name, p_eager), p_compiled in zip(eager.named_parameters(), model.parameters()):
        torch.testing.assert_close(p_compiled.grad, p_eager.grad, rtol=1e-4, atol=1e-6, msg=name)
        torch.testing.assert_close(p_compiled, p_eager, rtol=1e-5, atol=1e-6, msg=name)


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
