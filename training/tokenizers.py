"""Which tokenizer a run uses: the one saved in the checkpoint it resumes (when the run trained its own), the one
the user named, or a new one trained for the run."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from transformers.tokenization_utils_base import VERY_LARGE_INTEGER

from archlab.tokenization.training import has_tokenizer, load_tokenizer

from .reporting import log


class TokenizerChoices(Protocol):
    """The scripts' `ModelArguments`, or any object with these attributes."""

    model_kind: str
    model_name_or_path: str | None
    tokenizer_name: str | None
    tokenizer_algorithm: str | None
    tokenizer_vocab_size: int | None
    tokenizer_train_samples: int | None


def checkpoint_tokenizer(choices: TokenizerChoices, resume: str | None) -> Any | None:
    """When resuming a run that trained its own tokenizer: the one saved in the checkpoint (training another would
    repeat that work and need not give the vocabulary the weights were trained with); else None."""
    if resume is None or choices.tokenizer_name or choices.model_name_or_path or not has_tokenizer(resume):
        return None
    log(f"Using the tokenizer saved in {resume}")
    return load_tokenizer(resume)


def get_tokenizer(choices: TokenizerChoices, resume: str | None, train: Callable[[], Any]) -> Any:
    """The checkpoint's tokenizer (see `checkpoint_tokenizer`), else the one at --tokenizer_name or
    --model_name_or_path, else `train()`'s."""
    saved = checkpoint_tokenizer(choices, resume)
    if saved is not None:
        return saved
    if choices.tokenizer_name or choices.model_name_or_path:
        return load_tokenizer(choices.tokenizer_name or choices.model_name_or_path)
    return train()


def adopt_context_length(tokenizer: Any, config: Any, kind: Any) -> None:
    """A tokenizer trained in this run (no `model_max_length` of its own) takes the model's context,
    `max_position_embeddings`, as transformers' tokenizers carry their model's: `truncation=True` then cuts where
    the model stops, not at the training block size. A loaded tokenizer keeps its own."""
    positions = getattr(config, kind.max_positions_field, None)
    if positions is not None and tokenizer.model_max_length >= VERY_LARGE_INTEGER:
        tokenizer.model_max_length = positions
