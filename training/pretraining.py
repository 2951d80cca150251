"""The data of each pretraining objective (`--model_kind`): a tokenizer trained on the training documents, and the
documents tokenized and packed into blocks with their collator.

- `decoder`: next-token prediction on packed blocks (position ids restart per document);
- `seq2seq`: continuation -- the encoder reads the first half of a block, the decoder predicts the second half;
- `masked_lm`: BERT's 15 % masking on packed blocks (`mlm_probability`).
"""

from __future__ import annotations

from typing import Any

from transformers import DataCollatorForLanguageModeling, default_data_collator

from archlab.tokenization.data import IGNORE_INDEX, limit, pack_causal_lm, tokenize_documents
from archlab.tokenization.training import train_tokenizer

from .reporting import log
from .tokenizers import TokenizerChoices, get_tokenizer


def pretraining_tokenizer(
    choices: TokenizerChoices, train_split: Any, text_column: str, resume: str | None = None
) -> Any:
    """`get_tokenizer` for pretraining: a new tokenizer is trained on (at most --tokenizer_train_samples of) the
    training documents."""

    def train() -> Any:
        source = limit(train_split, choices.tokenizer_train_samples)
        log(f"Training a {choices.tokenizer_algorithm or 'default'} tokenizer for the {choices.model_kind} ...")
        return train_tokenizer(
            source,
            model_kind=choices.model_kind,
            algorithm=choices.tokenizer_algorithm,
            vocab_size=choices.tokenizer_vocab_size or 4096,
            text_column=text_column,
        )

    tokenizer = get_tokenizer(choices, resume, train)
    if choices.model_kind == "masked_lm" and tokenizer.mask_token is None:  # the collator's error came after the data
        named = "--tokenizer_name" if choices.tokenizer_name else "--model_name_or_path"
        raise ValueError(
            f"--model_kind masked_lm needs a tokenizer with a mask token (BERT's [MASK]), and the one of {named} "
            f"has none: give one that has, or leave {named} out to train a masked_lm tokenizer."
        )
    return tokenizer


def split_for_seq2seq(blocks: Any, num_proc: int | None) -> Any:
    """Encoder input = first half of each block, labels = second half (continuation objective)."""

    def split(batch: dict[str, list]) -> dict[str, list]:
        half = len(batch["input_ids"][0]) // 2
        masks = batch["attention_mask"]  # 0 on the padding of a batch's last block
        return {
            "input_ids": [ids[:half] for ids in batch["input_ids"]],
            "attention_mask": [mask[:half] for mask in masks],
            "labels": [
                [t if m else IGNORE_INDEX for t, m in zip(ids[half:], mask[half:])]
                for ids, mask in zip(batch["input_ids"], masks)
            ],
        }

    kwargs = {} if not hasattr(blocks, "__len__") else {"num_proc": num_proc, "desc": "Splitting blocks"}
    halves = blocks.map(split, batched=True, remove_columns=blocks.column_names, **kwargs)
    # A tail block that is mostly padding can leave nothing to predict (or an all-padding encoder input).
    return halves.filter(lambda row: any(row["attention_mask"]) and any(t != IGNORE_INDEX for t in row["labels"]))


def prepare_data(
    kind: str,
    raw: Any,
    tokenizer: Any,
    block_size: int,
    text_column: str = "text",
    num_proc: int | None = None,
    overwrite_cache: bool = False,
    mlm_probability: float = 0.15,
) -> dict[str, Any]:
    """Tokenized, packed train/validation sets and the collator for `kind` (seq2seq packs blocks twice as long and
    splits each into source and target; masked_lm masks `mlm_probability` of the tokens)."""
    block_size = block_size * (2 if kind == "seq2seq" else 1)
    packed = {}
    for split in ("train", "validation"):
        documents = tokenize_documents(raw[split], tokenizer, text_column, num_proc, overwrite_cache)
        packed[split] = pack_causal_lm(
            documents,
            block_size,
            tokenizer.pad_token_id,
            num_proc,
            overwrite_cache,
            restart_positions=kind != "seq2seq",
            causal_labels=kind == "decoder",
        )
        if kind == "seq2seq":
            packed[split] = split_for_seq2seq(packed[split], num_proc)
    if kind == "masked_lm":
        collator = DataCollatorForLanguageModeling(tokenizer, mlm=True, mlm_probability=mlm_probability)
    else:
        collator = default_data_collator
    return {"train": packed["train"], "validation": packed["validation"], "collator": collator}
