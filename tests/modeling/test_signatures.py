"""The signatures `generate` inspects every call, computed once per class (modeling/signatures.py): the same
parameters `inspect` finds by walking, on archlab's own functions only, and generate's calls still routed by them."""

from __future__ import annotations

import inspect

import pytest
import torch
from transformers import GenerationMixin

from archlab import (
    DecoderForCausalLM,
    DecoderForQuestionAnswering,
    DecoderForSequenceClassification,
    DecoderForTokenClassification,
    EncoderForMaskedLM,
    Seq2SeqForConditionalGeneration,
)
from archlab.modeling.signatures import GENERATE_INSPECTS, PACKAGE

from helpers import tiny_decoder_config

MODEL_CLASSES = (
    DecoderForCausalLM,
    DecoderForSequenceClassification,
    DecoderForTokenClassification,
    DecoderForQuestionAnswering,
    EncoderForMaskedLM,
    Seq2SeqForConditionalGeneration,
)


def _walked(function) -> inspect.Signature:
    """The signature `inspect` computes without the stored one."""
    stored = function.__dict__.pop("__signature__")
    try:
        return inspect.signature(function)
    finally:
        function.__signature__ = stored


@pytest.mark.parametrize("cls", MODEL_CLASSES, ids=lambda cls: cls.__name__)
def test_archlab_methods_keep_the_signature_inspect_computes(cls):
    kept = 0
    for name in GENERATE_INSPECTS:
        function = getattr(cls, name, None)
        if not inspect.isfunction(function):
            continue
        if function.__module__.startswith(PACKAGE + "."):
            assert "__signature__" in function.__dict__, name
            assert function.__signature__ == _walked(function), name
            kept += 1
        else:  # transformers' own methods are left as they are
            assert "__signature__" not in function.__dict__, (name, function.__module__)
    assert kept >= 1  # every model class defines its forward


def test_transformers_generation_methods_are_untouched():
    for name in GENERATE_INSPECTS:
        function = getattr(GenerationMixin, name, None)
        if function is not None:
            assert "__signature__" not in function.__dict__, name


def test_a_bound_forward_drops_self_and_is_not_walked_again(monkeypatch):
    model = DecoderForCausalLM(tiny_decoder_config())
    walks = []
    walk = inspect._signature_from_function  # what inspect runs per call without a stored signature
    monkeypatch.setattr(inspect, "_signature_from_function", lambda *a, **k: walks.append(1) or walk(*a, **k))
    parameters = list(inspect.signature(model.forward).parameters)
    assert parameters[0] == "input_ids" and "attention_mask" in parameters and "position_ids" in parameters
    assert "self" not in parameters and walks == []
    inspect.signature(GenerationMixin._prepare_cache_for_generation)  # transformers' own: walked as before
    assert walks == [1]


def test_generate_still_passes_the_inputs_forward_accepts():
    """generate reads the stored signature to decide what to pass (attention mask, position ids, logits_to_keep):
    the tokens equal a forward-by-forward greedy decode."""
    torch.manual_seed(0)
    model = DecoderForCausalLM(tiny_decoder_config()).eval()
    ids = torch.randint(3, 90, (2, 5))
    mask = torch.ones_like(ids)
    mask[0, 0] = 0
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    sequence, full_mask = ids, mask
    with torch.no_grad():
        for _ in range(4):
            positions = (full_mask.cumsum(-1) - 1).clamp(min=0)
            logits = model(input_ids=sequence, attention_mask=full_mask, position_ids=positions).logits[:, -1]
            sequence = torch.cat([sequence, logits.argmax(-1, keepdim=True)], dim=1)
            full_mask = torch.cat([full_mask, torch.ones_like(full_mask[:, :1])], dim=1)
    assert torch.equal(out, sequence)
