"""Every head loads in bfloat16 and float16 through its Auto class and runs forward (and generate), the way people
serve translation models: `AutoModelForSeq2SeqLM.from_pretrained(folder, dtype=torch.bfloat16)`.

Loading in float32 and calling `.to(torch.bfloat16)` casts every floating tensor; loading with `dtype=` builds the
model under that default dtype instead, so a tensor made in float32 at init stays float32 and meets half weights at
the first forward. Every parameter and buffer must follow the dtype, except the ones kept in float32 on purpose.
"""

from __future__ import annotations

import pytest
import torch
from transformers import (
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    AutoModelForQuestionAnswering,
    AutoModelForSeq2SeqLM,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)

from archlab import (
    DecoderForCausalLM,
    DecoderForQuestionAnswering,
    DecoderForSequenceClassification,
    DecoderForTokenClassification,
    DecoderModel,
    EncoderForMaskedLM,
    Seq2SeqForConditionalGeneration,
    Seq2SeqModel,
)

from helpers import tiny_decoder_config, tiny_seq2seq_config

# Kept in float32 whatever the model's dtype, as transformers' Llama keeps them: RoPE's inverse frequencies
# (positions times frequencies lose whole rotations in half precision) and ALiBi's head slopes.
FLOAT32_BY_DESIGN = ("inv_freq", "original_inv_freq", "slopes")

# (Auto class, model class, config): every head, and the position variants with a tensor made at init
HEADS = {
    "causal_lm": (AutoModelForCausalLM, DecoderForCausalLM, tiny_decoder_config()),
    "causal_lm_sinusoidal": (
        AutoModelForCausalLM,
        DecoderForCausalLM,
        tiny_decoder_config(position_embedding_type="sinusoidal"),
    ),
    "causal_lm_alibi": (AutoModelForCausalLM, DecoderForCausalLM, tiny_decoder_config(position_embedding_type="alibi")),
    "sequence_classification": (
        AutoModelForSequenceClassification,
        DecoderForSequenceClassification,
        tiny_decoder_config(num_labels=3),
    ),
    "token_classification": (
        AutoModelForTokenClassification,
        DecoderForTokenClassification,
        tiny_decoder_config(num_labels=3),
    ),
    "question_answering": (AutoModelForQuestionAnswering, DecoderForQuestionAnswering, tiny_decoder_config()),
    "decoder_model": (AutoModel, DecoderModel, tiny_decoder_config()),
    "seq2seq_lm": (AutoModelForSeq2SeqLM, Seq2SeqForConditionalGeneration, tiny_seq2seq_config()),
    "seq2seq_lm_marian": (  # Marian's layout of the sinusoid, persistent in checkpoints
        AutoModelForSeq2SeqLM,
        Seq2SeqForConditionalGeneration,
        tiny_seq2seq_config(sinusoidal_layout="split"),
    ),
    "seq2seq_lm_t5_bias": (
        AutoModelForSeq2SeqLM,
        Seq2SeqForConditionalGeneration,
        tiny_seq2seq_config(position_embedding_type="relative_bias", norm_position="pre"),
    ),
    "seq2seq_model": (AutoModel, Seq2SeqModel, tiny_seq2seq_config()),
    "masked_lm": (AutoModelForMaskedLM, EncoderForMaskedLM, tiny_seq2seq_config()),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, str]:
    folders = {}
    for name, (_, model_class, config) in HEADS.items():
        torch.manual_seed(0)
        folders[name] = str(tmp_path_factory.mktemp(name))
        model_class(config).save_pretrained(folders[name])
    return folders


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", list(HEADS))
def test_loads_and_runs_in_half_precision_through_the_auto_class(saved, name, dtype):
    auto_class, model_class, config = HEADS[name]
    model = auto_class.from_pretrained(saved[name], dtype=dtype).eval()
    assert type(model) is model_class
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    wrong = {
        key: value.dtype
        for key, value in tensors.items()
        if value.is_floating_point() and value.dtype != dtype and not key.endswith(FLOAT32_BY_DESIGN)
    }
    assert not wrong, wrong
    kept = [key for key, value in tensors.items() if key.endswith(FLOAT32_BY_DESIGN)]
    assert all(tensors[key].dtype == torch.float32 for key in kept)

    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 60, (2, 7), generator=generator)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # a padded row
    inputs = {"input_ids": ids, "attention_mask": mask}
    if config.is_encoder_decoder and model_class is not EncoderForMaskedLM:
        inputs["decoder_input_ids"] = torch.randint(3, 60, (2, 5), generator=generator)
    with torch.no_grad():
        output = model(**inputs)
    names = ("logits", "start_logits", "last_hidden_state")
    result = next(getattr(output, name) for name in names if getattr(output, name, None) is not None)
    assert result.dtype == dtype and torch.isfinite(result).all()

    if model.can_generate():
        generated = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=4,
            do_sample=False,
            num_beams=2 if config.is_encoder_decoder else 1,
        )
        assert generated.shape[0] == 2 and generated.shape[1] >= 2
