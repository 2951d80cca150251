"""Which tokenizer a run uses: the one saved in the checkpoint it resumes (when the run trained its own), the one
the user named, or a new one trained for the run."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, Protocol

import torch.distributed as dist
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
        tokenizer = load_tokenizer(choices.tokenizer_name or choices.model_name_or_path)
        if choices.tokenizer_name and choices.model_name_or_path:
            warn_about_other_token_ids(tokenizer, choices.tokenizer_name, choices.model_name_or_path)
        return tokenizer
    return train_on_the_main_process(train)


def check_resumed_tokenizer(choices: TokenizerChoices, resume: str | None) -> None:
    """A resumed run must read its data with the tokenizer its checkpoint was trained with: one named by
    --tokenizer_name or --model_name_or_path that gives any of its tokens another id than the checkpoint's saved
    tokenizer is refused, before any data is read. One of the same size trained the checkpoint's embeddings on other
    token ids without a word. (The checkpoint's may hold more tokens: those a task adds after loading.)"""
    name = choices.tokenizer_name or choices.model_name_or_path
    if resume is None or not name or not has_tokenizer(resume):
        return
    saved = load_tokenizer(resume).get_vocab()
    named = load_tokenizer(name).get_vocab()
    moved = sum(saved.get(token) != index for token, index in named.items())
    if moved:
        flag = "--tokenizer_name" if choices.tokenizer_name else "--model_name_or_path"
        raise ValueError(
            f"--resume_from_checkpoint: {resume} was trained with another tokenizer: {moved} of the {len(named)} "
            f"tokens of {flag} {name} have other ids or none in the one saved there. Resume with the run's own "
            f"{flag}, or start a new run in another --output_dir."
        )


def train_on_the_main_process(train: Callable[[], Any]) -> Any:
    """`train()`, run once under torchrun / accelerate launch: the first process trains and hands its tokenizer to the
    others. WordPiece and Unigram training were not deterministic across processes (each process's hash seeds
    ordered ties differently; `train_tokenizer` now fixes that order), so a tokenizer trained by every process gave
    each its own token ids for the same text, and the processes trained one model on differently encoded data while
    only the first process's tokenizer was saved. Training once also spares the other processes the work.
    An error of the first process's training is raised by every process."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return train()
    result: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            result[0] = train()
        except Exception as error:  # the others would wait for a tokenizer forever
            result[0] = error
    dist.broadcast_object_list(result, src=0)
    if isinstance(result[0], Exception):
        raise result[0]
    return result[0]


def warn_about_other_token_ids(tokenizer: Any, tokenizer_name: str, model_path: str) -> None:
    """One line when --tokenizer_name gives tokens of the model's own tokenizer (saved beside its weights) other ids:
    the pretrained embeddings would be read under other meanings. (A tokenizer larger than the embedding is refused
    later, `configs.check_fits`; one that only adds tokens after the model's keeps every id and passes.)"""
    if not os.path.isdir(model_path) or not has_tokenizer(model_path):
        return
    own = load_tokenizer(model_path).get_vocab()
    named = tokenizer.get_vocab()
    moved = sum(named.get(token) != index for token, index in own.items())
    if moved:
        log(
            f"Warning: --tokenizer_name {tokenizer_name} gives {moved} of the {len(own)} tokens of the model's own "
            f"tokenizer ({model_path}) other ids or none: its pretrained embeddings will be read under other meanings. "
            "Leave --tokenizer_name out to use the model's own."
        )


def adopt_context_length(tokenizer: Any, config: Any, kind: Any) -> None:
    """A tokenizer trained in this run (no `model_max_length` of its own) takes the model's context,
    `max_position_embeddings`, as transformers' tokenizers carry their model's: `truncation=True` then cuts where
    the model stops, not at the training block size. A loaded tokenizer keeps its own."""
    positions = getattr(config, kind.max_positions_field, None)
    if positions is not None and tokenizer.model_max_length >= VERY_LARGE_INTEGER:
        tokenizer.model_max_length = positions
