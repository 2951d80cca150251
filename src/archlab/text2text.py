"""One call to translate or summarise a batch of strings with any encoder-decoder (transformers 5 removed the
`text2text-generation`, `translation` and `summarization` pipelines).

    >>> from archlab import translate
    >>> translate(["Where is the bus stop?", "I like tea."], model, tokenizer, num_beams=4)
    ['Wo ist die Bushaltestelle?', 'Ich mag Tee.']

Works with archlab's `Seq2SeqForConditionalGeneration` and with stock seq2seq models (Marian, Bart, T5): texts are
tokenized in batches (padded, truncated to what the model's positions allow), passed to `model.generate` with
the given generation arguments (beam search, sampling, length penalty, ... as in `GenerationConfig`), and the
outputs are decoded without special tokens, in input order.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase


@torch.no_grad()
def translate(
    texts: str | Sequence[str],
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    batch_size: int = 16,
    max_source_length: int | None = None,
    **generate_kwargs,
) -> list[str]:
    """Generate one output string per input string (`num_return_sequences=k` gives k per input, grouped).

    `max_source_length` truncates the inputs (default: the model's `max_position_embeddings`, else the tokenizer's
    `model_max_length`). `generate_kwargs` go to `model.generate` (e.g. `num_beams=4, max_new_tokens=128`).
    """
    if isinstance(texts, str):
        texts = [texts]
    if not getattr(model.config, "is_encoder_decoder", False):
        raise ValueError(
            f"translate() needs an encoder-decoder (`config.is_encoder_decoder` True); {type(model).__name__} is "
            'decoder-only: use `model.generate` or `pipeline("text-generation")`, whose output continues the prompt.'
        )
    if batch_size < 1:
        raise ValueError(f"`batch_size` must be a positive integer, got {batch_size!r}.")
    if max_source_length is None:
        max_source_length = getattr(model.config, "max_position_embeddings", None) or tokenizer.model_max_length
    was_training = model.training
    model.eval()
    outputs: list[str] = []
    try:
        for start in range(0, len(texts), batch_size):
            batch = tokenizer(
                list(texts[start : start + batch_size]),
                return_tensors="pt",
                padding=True,
                truncation=True,
                max_length=max_source_length,
                return_token_type_ids=False,
            ).to(model.device)
            generated = model.generate(**batch, **generate_kwargs)
            outputs.extend(tokenizer.batch_decode(generated, skip_special_tokens=True))
    finally:
        model.train(was_training)
    return outputs


__all__ = ["translate"]
