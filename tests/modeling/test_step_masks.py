"""The decoding step's masks written once into a fixed buffer (modeling/step_masks.py): what goes in, what stays out,
and inductor's code of a compiled step reading every layer's mask from that buffer."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from torch._inductor.utils import run_and_get_code
from transformers import CompileConfig

from archlab import DecoderForCausalLM, Seq2SeqForConditionalGeneration
from archlab.modeling import flex_decoding
from archlab.modeling.step_masks import (
    ALIGNMENT,
    MASK_SLOTS,
    SOURCE_SLOT,
    additive,
    realized_masks,
    realized_source_mask,
    source_length,
    step_mask_shape,
)

from helpers import tiny_decoder_config, tiny_seq2seq_config


def _buffer(rows=3, keys=13, dtype=torch.bfloat16):
    return torch.full(step_mask_shape(rows, keys), 7.0, dtype=dtype)


def test_the_buffer_rows_are_aligned_for_sdpa():
    assert step_mask_shape(3, 13) == (MASK_SLOTS, 3, 1, 1, 16)
    assert step_mask_shape(2, 64) == (MASK_SLOTS, 2, 1, 1, 72)  # a spare column: no view is a whole row
    assert all(stride % ALIGNMENT == 0 for stride in _buffer()[0].stride()[:-1])


def test_a_boolean_mask_is_written_additive_and_read_from_the_buffer():
    buffer = _buffer()
    mask = torch.rand(3, 1, 1, 11) > 0.3
    realized = realized_masks(mask, buffer)
    assert realized.shape == mask.shape and realized.dtype == torch.bfloat16
    assert realized.data_ptr() == buffer.data_ptr()  # a view of slot 0
    minimum = torch.finfo(torch.bfloat16).min
    assert torch.equal(realized, torch.where(mask, 0.0, minimum).to(torch.bfloat16))
    assert torch.equal(additive(mask, torch.bfloat16), realized)
    assert (buffer[0, :, :, :, 11:] == 7.0).all() and (buffer[1] == 7.0).all()  # nothing else written


def test_masks_by_layer_type_take_a_slot_each():
    buffer = _buffer(dtype=torch.float32)
    full = torch.rand(3, 1, 1, 13) > 0.5
    sliding = torch.zeros(1, 1, 1, 9)  # additive already, broadcast over the batch
    realized = realized_masks({"sliding_attention": sliding, "full_attention": full}, buffer)
    assert realized["full_attention"].data_ptr() == buffer[0].data_ptr()
    assert realized["sliding_attention"].data_ptr() == buffer[1].data_ptr()
    assert torch.equal(realized["sliding_attention"], sliding)
    assert torch.equal(realized["full_attention"] == 0, full)


def test_other_masks_pass_through():
    buffer = _buffer(dtype=torch.float32)
    per_head = torch.ones(3, 4, 1, 13, dtype=torch.bool)
    per_query = torch.ones(3, 1, 5, 13, dtype=torch.bool)
    padding = torch.ones(3, 13, dtype=torch.long)
    too_long = torch.ones(3, 1, 1, 17, dtype=torch.bool)
    other_dtype = torch.zeros(3, 1, 1, 13, dtype=torch.float16)
    for mask in (per_head, per_query, padding, too_long, other_dtype, None):
        assert realized_masks(mask, buffer) is mask
    masks = {name: torch.ones(3, 1, 1, 5, dtype=torch.bool) for name in "abc"}  # more masks than layer-type slots
    assert realized_masks(masks, buffer) is masks
    assert realized_masks(too_long, None) is too_long
    assert (buffer == 7.0).all()


SDPA_MASKS = r"_scaled_dot_product_\w+\.default\([^\n]*attn_mask=(\w+)\(?(\w*)"


def test_a_source_mask_takes_the_source_slot():
    buffer = _buffer(dtype=torch.float32)
    source = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
    realized = realized_source_mask(source, buffer)
    assert realized.shape == (3, 1, 1, 3) and realized.data_ptr() == buffer[SOURCE_SLOT].data_ptr()
    assert torch.equal(realized[:, 0, 0] == 0, source.bool())
    assert realized_source_mask(None, buffer) is None and realized_source_mask(source, None) is source
    assert source_length({"attention_mask": source}) == 3 and source_length({}) == 0


def _compiled_generate_code(model, batch, **kwargs):
    """generate with its decoding step compiled by inductor on CPU: (tokens, the step's generated code)."""
    config = CompileConfig(fullgraph=True, mode="default")
    config._compile_all_devices = True  # generate compiles only on accelerators unless told to (its testing hook)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return run_and_get_code(model.generate, **batch, **kwargs, compile_config=config)


@pytest.fixture
def padded_batch():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 97, (2, 10), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # a left-padded row
    return {"input_ids": ids, "attention_mask": mask}


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["sdpa", "flex"])
def test_inductor_reads_every_layer_mask_from_the_buffer(attention, padded_batch, monkeypatch):
    """Every layer's attention call in inductor's code of the step reads the mask from a graph input (the buffer),
    not a buffer the step computes per layer, and the tokens are eager decoding's. With FlexAttention this is also
    what lets inductor's CPU template compile it (it refuses a mask computed in the graph)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = DecoderForCausalLM(tiny_decoder_config(num_hidden_layers=3, head_dim=16)).eval()
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, cache_implementation="static")
    expected = model.generate(**padded_batch, **kwargs, disable_compile=True)
    monkeypatch.setattr(flex_decoding, "FLEX_DECODING_DEVICES", ("cpu",) if attention == "flex" else ())
    output, codes = _compiled_generate_code(model, padded_batch, **kwargs)
    assert torch.equal(output, expected)
    step = next(code for code in codes if "def call" in code and "index_copy" in code)
    if attention == "sdpa":
        masks = re.findall(SDPA_MASKS, step)
        assert len(masks) == 3
        assert all(call == "reinterpret_tensor" and name.startswith("arg") for call, name in masks), masks
    else:
        assert step.count("flex_attention") >= 3 and "_scaled_dot_product" not in step


@pytest.mark.slow
def test_beam_search_steps_read_every_mask_from_the_buffer():
    """An encoder-decoder's compiled beam-search step: each decoder layer's self-attention and cross-attention read
    their masks from one buffer (the source's in a slot of its own), built once per step, not once per layer."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Seq2SeqForConditionalGeneration(tiny_seq2seq_config(d_model=64, decoder_layers=3)).eval()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, model.config.vocab_size, (2, 10), generator=g)
    mask = torch.ones_like(ids)
    mask[0, 7:] = 0  # a padded source
    batch = {"input_ids": ids, "attention_mask": mask}
    kwargs = dict(max_new_tokens=6, num_beams=3, do_sample=False, pad_token_id=0, cache_implementation="static")
    expected = model.generate(**batch, **kwargs, disable_compile=True)
    output, codes = _compiled_generate_code(model, batch, **kwargs)
    assert torch.equal(output, expected)
    (step,) = codes
    masks = re.findall(SDPA_MASKS, step)
    assert len(masks) == 6
    # one buffer read by every layer: the self-attention and source masks are two writes into it, which inductor
    # makes on a copy of the input (written back at the end of the step) rather than in place
    assert all(call == "reinterpret_tensor" for call, _ in masks) and len({name for _, name in masks}) == 1, masks
