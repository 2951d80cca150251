"""generate() with greedy, sampling and beam search on Dynamic and Static caches, and the text-generation pipeline."""

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, pipeline

from archlab import DecoderForCausalLM

from helpers import tiny_decoder_config


def _model():
    return DecoderForCausalLM(tiny_decoder_config()).eval()


def _no_cache_greedy(model, ids, steps):
    """Reference: re-run the full forward for every new token (no cache at all)."""
    for _ in range(steps):
        nxt = model(ids, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], dim=1)
    return ids


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_greedy_with_cache_equals_no_cache_reference(cache):
    model = _model()
    ids = torch.randint(3, 97, (2, 5))
    out = model.generate(ids, max_new_tokens=10, do_sample=False, cache_implementation=cache, eos_token_id=None)
    assert torch.equal(out, _no_cache_greedy(model, ids, 10))


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_a_prompt_given_as_embeddings_generates_what_its_ids_do(cache):
    """`generate(inputs_embeds=...)` (soft prompts, multimodal inputs) is taken only from models whose
    `prepare_inputs_for_generation` names it; it returns the new tokens alone, those of the same prompt as ids."""
    model = _model()
    ids = torch.randint(3, 97, (2, 5))
    ids[0, :2] = 0  # a left-padded row
    mask = (ids != 0).long()
    kwargs = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, cache_implementation=cache, pad_token_id=0)
    from_embeddings = model.generate(inputs_embeds=model.get_input_embeddings()(ids), **kwargs)
    assert torch.equal(from_embeddings, model.generate(ids, **kwargs)[:, 5:])


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_beam_search_and_sampling_run_and_are_reproducible(cache):
    model = _model()
    ids = torch.randint(3, 97, (2, 5))
    beams = model.generate(
        ids, max_new_tokens=8, num_beams=3, num_return_sequences=2, cache_implementation=cache, eos_token_id=None
    )
    assert beams.shape == (4, 13)
    torch.manual_seed(1)
    a = model.generate(ids, max_new_tokens=8, do_sample=True, top_k=20, temperature=0.8, cache_implementation=cache)
    torch.manual_seed(1)
    b = model.generate(ids, max_new_tokens=8, do_sample=True, top_k=20, temperature=0.8, cache_implementation=cache)
    assert torch.equal(a, b)


def test_beam_search_with_one_beam_is_greedy():
    model = _model()
    ids = torch.randint(3, 97, (1, 5))
    greedy = model.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=None)
    beam = model.generate(ids, max_new_tokens=6, num_beams=1, do_sample=False, eos_token_id=None)
    assert torch.equal(greedy, beam)


def _word_tokenizer(words):
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{w: i + 4 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def test_text_generation_pipeline():
    tokenizer = _word_tokenizer([f"w{i}" for i in range(90)])
    model = _model()
    generator = pipeline("text-generation", model=model, tokenizer=tokenizer)
    out = generator(["w1 w2 w3", "w4"], max_new_tokens=5, do_sample=False)
    assert len(out) == 2 and out[0][0]["generated_text"].startswith("w1 w2 w3")
