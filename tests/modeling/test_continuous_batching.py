"""transformers' continuous batching (`generate_batch` on a paged KV cache, packed rows, `paged|eager` / `sdpa`) on
archlab's decoder: greedy tokens of Llama's and Mixtral's twins and of archlab's own `generate`, prompt by prompt,
for the variants it runs; the variants it cannot express refused by name before the generation thread starts."""

import pytest
import torch
from transformers import (
    ContinuousBatchingConfig,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
)

from archlab import DecoderForCausalLM
from archlab.modeling.continuous_batching import continuous_batching_refusal

from helpers import DECODER_VARIANTS, TINY, decoder_variant, randomised, tiny_decoder_config

# Prompts of 1 to 11 tokens; token 2 is the end of sequence, where a request stops as `generate` does.
PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22], [23]]
GREEDY = GenerationConfig(max_new_tokens=12, do_sample=False, eos_token_id=2, pad_token_id=0)
# A small paged cache (the default sizes it from the free memory: ~20 s on a CPU). "tight" takes 4 tokens a step, so
# long prompts are prefilled in chunks that read the cache, beside other requests' decoding steps.
BATCHING = {
    "roomy": ContinuousBatchingConfig(num_blocks=16, page_size=16, max_batch_tokens=64),
    "tight": ContinuousBatchingConfig(num_blocks=16, page_size=16, max_batch_tokens=4),
}
STOCK = {"llama": (LlamaForCausalLM, LlamaConfig), "mixtral": (MixtralForCausalLM, MixtralConfig)}
REFUSED = {
    "positions_alibi": "alibi",
    "positions_relative_bias": "relative_bias",
    "alibi_local_global": "alibi",
    "prefix_lm": "prefix_lm",
    "prefix_lm_alibi": "alibi",
    "rope_dynamic": "dynamic",
    "rope_longrope": "longrope",
    "latent_attention": "kv_lora_rank",
    "latent_attention_query_rank_yarn": "kv_lora_rank",
    "all_chunked_attention": "attention_chunk_size",
    "llama4_attention": "attention_chunk_size",
}
RUN = [name for name in DECODER_VARIANTS if name not in REFUSED]


def _batched(model, batching: str = "roomy") -> list[list[int]]:
    out = model.generate_batch(
        PROMPTS, generation_config=GREEDY, continuous_batching_config=BATCHING[batching], progress_bar=False
    )
    return [out[f"req_{i}"].generated_tokens for i in range(len(PROMPTS))]


def _one_by_one(model) -> list[list[int]]:
    def alone(prompt: list[int]) -> list[int]:
        ids = torch.tensor([prompt], device=model.device)
        return model.generate(ids, generation_config=GREEDY, disable_compile=True)[0, len(prompt) :].tolist()

    return [alone(prompt) for prompt in PROMPTS]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("kind", STOCK)
def test_generate_batch_gives_the_stock_twins_tokens(kind, attn, device):
    """Llama's (dense, GQA, RoPE) and Mixtral's (MoE) twins, the same weights: `generate_batch` gives their tokens for
    each prompt, and those of archlab's own `generate`, prompt by prompt (on CUDA, fp32: the manager's own CUDA
    path, and archlab's eager decoding)."""
    fields = {**TINY, "rms_norm_eps": 1e-6, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}
    if kind == "mixtral":
        fields.update(num_local_experts=4, num_experts_per_tok=2)
    stock_class, config_class = STOCK[kind]
    stock = randomised(stock_class(config_class(**fields, attn_implementation=attn)))
    model = DecoderForCausalLM(tiny_decoder_config(**fields, attn_implementation=attn)).eval()
    model.load_state_dict(stock.state_dict(), strict=True)
    model, stock = model.to(device), stock.to(device)
    tokens = _batched(model)
    assert tokens == _batched(stock)
    assert tokens == _one_by_one(model)
    assert sum(map(len, tokens)) > 2 * len(PROMPTS)  # not all stopped at once


@pytest.mark.parametrize("batching", BATCHING)
@pytest.mark.parametrize("name", [*RUN, "qk_norm"])
def test_generate_batch_gives_each_prompts_generate_tokens(name, batching):
    """Every variant continuous batching runs (RoPE of the other types, learned / sinusoidal / no positions, sliding
    and interleaved windows, soft-capping, MoE, QK-norm per head and over the projections, OLMo 2's output norms): per
    request the tokens of `generate` on its prompt alone, whether the prompts are prefilled at once or in chunks beside
    other requests' decoding steps. Learned and sinusoidal tables give the packed rows' `position_ids`, so they are
    read (positions counted from 0 over the packed row would give other tokens)."""
    fields = dict(use_qk_norm=True) if name == "qk_norm" else DECODER_VARIANTS[name]
    model = randomised(DecoderForCausalLM(tiny_decoder_config(**fields)))
    assert _batched(model, batching) == _one_by_one(model)


def test_eager_continuous_batching_soft_caps_the_scores():
    """Under "eager", continuous batching runs "paged|eager", whose transformers function has no soft-cap: the
    attention keeps archlab's eager function, so a soft-capped model's tokens are those of `generate`, and not those
    of the same weights without the cap."""
    model = decoder_variant("softcapping_eager_attention")
    assert model.config._attn_implementation == "eager"
    tokens = _batched(model)
    assert tokens == _one_by_one(model)
    model.config.attn_logit_softcapping = None
    for layer in model.model.layers:
        layer.self_attn.softcap = None
    assert _batched(model) != tokens


@pytest.mark.parametrize("name", REFUSED)
def test_variants_without_a_paged_form_are_refused_by_name(name):
    """ALiBi's and T5's biases (built from query and key positions the packed keys do not carry), prefix-LM (no
    `prefix_lengths` passed) and dynamic / longrope RoPE (frequencies from the largest position of the packed row,
    another request's) raise before the generation thread starts, which would return empty completions; `generate`
    still decodes the same prompts."""
    model = decoder_variant(name)
    with pytest.raises(NotImplementedError, match=f"continuous batching.*{REFUSED[name]}.*Use `generate\\(\\)`"):
        model.generate_batch(PROMPTS, generation_config=GREEDY, progress_bar=False)
    with pytest.raises(NotImplementedError, match="continuous batching"):
        with model.continuous_batching_context_manager(generation_config=GREEDY):
            pass
    assert model.generate(torch.tensor([PROMPTS[0]]), generation_config=GREEDY).shape[0] == 1


def test_refusal_reasons_are_one_line_and_only_for_those_variants():
    for name in DECODER_VARIANTS:
        reason = continuous_batching_refusal(tiny_decoder_config(**DECODER_VARIANTS[name]))
        assert (reason is not None) == (name in REFUSED), name
        assert reason is None or "\n" not in reason


def test_an_encoder_decoder_is_refused_by_name_instead_of_returning_empty_completions():
    """Continuous batching packs decoder-only requests and runs no encoder: MarianMTModel's requests come back empty,
    the failure only logged; archlab's encoder-decoder raises before the manager starts."""
    from archlab import Seq2SeqForConditionalGeneration

    from helpers import tiny_seq2seq_config

    model = Seq2SeqForConditionalGeneration(tiny_seq2seq_config()).eval()
    with pytest.raises(NotImplementedError, match="runs no encoder. Use `generate\\(\\)`"):
        model.generate_batch(PROMPTS, generation_config=GREEDY, progress_bar=False)
