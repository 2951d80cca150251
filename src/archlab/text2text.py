"""One call to translate or summarise a batch of strings with any encoder-decoder (transformers 5 removed the
`text2text-generation`, `translation` and `summarization` pipelines).

    >>> from archlab import translate
    >>> translate(["Where is the bus stop?", "I like tea."], model, tokenizer, num_beams=4)
    ['Wo ist die Bushaltestelle?', 'Ich mag Tee.']

Works with archlab's `Seq2SeqForConditionalGeneration` and with stock seq2seq models (Marian, Bart, T5): texts are
tokenized in batches (padded, truncated to what the model's positions allow), passed to `model.generate` with
the given generation arguments (beam search, sampling, length penalty, ... as in `GenerationConfig`), and the
outputs are decoded without special tokens, in input order.

A model fine-tuned with a T5-style task prefix (scripts/finetune.py's `--source_prefix`) keeps it in
`config.task_specific_params[task]["prefix"]`, as T5 does; `translate` puts it before every text when the config
holds exactly one task prefix, as transformers 4's translation and summarization pipelines did (`prefix=None` or
`""`: the texts as they are; `task=...` chooses among several, e.g. T5's "translation_en_to_de").
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase


class _Stored(str):
    """`translate`'s default `prefix`: the task prefix the model's config holds."""

    def __repr__(self) -> str:
        return "<the config's task prefix>"


STORED = _Stored()


def task_prefixes(config) -> dict[str, str]:
    """The task prefixes a config holds, `{task: prefix}` from `task_specific_params[task]["prefix"]` (T5's place,
    where scripts/finetune.py's `--source_prefix` is saved), empty prefixes left out."""
    params = getattr(config, "task_specific_params", None) or {}
    return {
        task: value["prefix"]
        for task, value in params.items()
        if isinstance(value, dict) and isinstance(value.get("prefix"), str) and value["prefix"]
    }


def stored_prefix(
    config, task: str | None = None, choose: str = "`task=` (or `prefix=`; `None`: the texts as they are)"
) -> str:
    """The task prefix a model's inputs start with: `task`'s (a ValueError if the config holds none for it), else the
    config's only one, else "" when it holds none. With several and no `task`, a ValueError listing them, which says
    to `choose` (the arguments or flags that do)."""
    prefixes = task_prefixes(config)
    if task is not None:
        if task not in prefixes:
            held = ", ".join(map(repr, prefixes)) or "none"
            raise ValueError(f"The model's config holds no task prefix for {task!r} (task prefixes held: {held}).")
        return prefixes[task]
    if len(prefixes) > 1:
        listed = ", ".join(f"{key!r}: {value!r}" for key, value in prefixes.items())
        raise ValueError(
            f"The model's config holds task prefixes for several tasks ({listed}), and which one the texts need is "
            f"not given: pass {choose}."
        )
    return next(iter(prefixes.values()), "")


@torch.no_grad()
def translate(
    texts: str | Sequence[str],
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    batch_size: int = 16,
    max_source_length: int | None = None,
    prefix: str | None = STORED,
    task: str | None = None,
    **generate_kwargs,
) -> list[str]:
    """Generate one output string per input string (`num_return_sequences=k` gives k per input, grouped).

    `prefix` goes before every text; by default the task prefix the model was fine-tuned with, the config's
    `task_specific_params[task]["prefix"]` where it holds exactly one (`task`: the one of several, e.g.
    "translation_en_to_de"; a ValueError when it holds several and neither `task` nor `prefix` says); `None` or
    `""`: no prefix. `max_source_length` truncates the inputs, prefix included (default: the model's
    `max_position_embeddings`, else the tokenizer's `model_max_length`). `generate_kwargs` go to `model.generate`
    (e.g. `num_beams=4, max_new_tokens=128`).
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
    if prefix is STORED:
        prefix = stored_prefix(model.config, task)
    elif task is not None:
        raise ValueError("Conflicting arguments: `prefix` and `task` (which chooses a stored prefix); pass one.")
    if max_source_length is None:
        max_source_length = getattr(model.config, "max_position_embeddings", None) or tokenizer.model_max_length
    was_training = model.training
    model.eval()
    outputs: list[str] = []
    try:
        for start in range(0, len(texts), batch_size):
            batch = tokenizer(
                [(prefix or "") + text for text in texts[start : start + batch_size]],
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


__all__ = ["stored_prefix", "task_prefixes", "translate"]
