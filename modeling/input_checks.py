"""Early, cheap checks of what `forward` is given: token ids inside the vocabulary, padding masks of the input's shape.

Without them a token id past the embedding table ends in a bare `IndexError: index out of range in self` deep in the
lookup, and a 2D `attention_mask` of the wrong length or batch is silently truncated, padded or broadcast by the
mask builders. Each check raises one ValueError naming the argument and the config field instead.

They never make an accelerator wait: shapes are free; values are read only from CPU tensors and not while
torch.compile traces (the pattern of `check_position_ids` in sinusoidal.py). On accelerators an out-of-range id is
still caught by the lookup's own device-side bounds check.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.cache_utils import Cache
from transformers.utils import logging

logger = logging.get_logger(__name__)

IGNORE_INDEX = -100  # a label that is not scored


def can_read_values(tensor: torch.Tensor) -> bool:
    """Reading this tensor's values costs no device synchronisation and no graph break."""
    return tensor.device.type == "cpu" and not torch.compiler.is_compiling()


def embedding_rows(embedding: nn.Module) -> int:
    """The vocabulary size of a token embedding: its weight's rows. Also for an embedding that PEFT wraps (a LoRA
    `Embedding`, `modules_to_save`), which gives its base layer's `weight` but not `num_embeddings`."""
    return embedding.weight.shape[0]


def check_token_ids(
    input_ids: torch.Tensor, vocab_size: int, name: str = "input_ids", field: str = "vocab_size"
) -> None:
    """Refuse ids outside [0, vocab_size) (CPU tensors only) with a ValueError naming `field`."""
    if input_ids.numel() == 0 or not can_read_values(input_ids):
        return
    low, high = (int(value) for value in torch.aminmax(input_ids))
    if low < 0 or high >= vocab_size:
        bad = high if high >= vocab_size else low
        raise ValueError(
            f"`{name}` holds token id {bad}, outside the model's vocabulary: `{field}` is {vocab_size}, so ids must "
            f"be in [0, {vocab_size}). Is the tokenizer larger than the model's vocabulary? Use the tokenizer the "
            f"model was trained with, or grow the model with `model.resize_token_embeddings(len(tokenizer))`."
        )


def check_segment_ids(token_type_ids: torch.Tensor, type_vocab_size: int) -> None:
    """Refuse segment ids outside [0, type_vocab_size) (CPU tensors only) with a ValueError naming the field; the
    embedding lookup failed with "index out of range in self"."""
    if token_type_ids.numel() == 0 or not can_read_values(token_type_ids):
        return
    low, high = (int(value) for value in torch.aminmax(token_type_ids))
    if low < 0 or high >= type_vocab_size:
        raise ValueError(
            f"`token_type_ids` holds segment id {high if high >= type_vocab_size else low}, but the model has "
            f"`type_vocab_size`={type_vocab_size} segment types (ids in [0, {type_vocab_size})). A tokenizer gives a "
            "pair's second text segment 1: encode pairs with `return_token_type_ids=False` for a model with one "
            "segment type (it reads 0 everywhere)."
        )


def cached_length(past_key_values: Cache | None) -> int | None:
    """Tokens already in the cache; None when only a device tensor knows (a static cache on an accelerator) or no
    one length exists (continuous batching's paged cache: a packed row of requests, each with its own)."""
    if past_key_values is None:
        return 0
    if not hasattr(past_key_values, "get_seq_length"):
        return None
    length = past_key_values.get_seq_length()
    if isinstance(length, torch.Tensor):
        return int(length) if can_read_values(length) else None
    return length


def check_attention_mask(
    attention_mask: torch.Tensor | None,
    batch_size: int,
    key_length: int | None,
    name: str = "attention_mask",
    keys: str = "tokens",
) -> None:
    """A 2D padding mask must be (batch, key_length); `keys` says what the columns count. 4D masks and the dicts
    of masks that `generate` prebuilds for static caches are the caller's own layout and pass unchecked; a None
    `key_length` checks the batch only."""
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
        return
    rows, columns = attention_mask.shape
    if rows != batch_size or (key_length is not None and columns != key_length):
        expected = f"({batch_size}, {key_length if key_length is not None else '...'})"
        raise ValueError(f"`{name}` has shape {tuple(attention_mask.shape)}, but must be (batch, {keys}) = {expected}.")


def input_shape(input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None) -> tuple[int, int] | None:
    """(batch, tokens) of a forward's input, from `input_ids` or else `inputs_embeds`; None without either."""
    given = input_ids if input_ids is not None else inputs_embeds
    return tuple(given.shape[:2]) if isinstance(given, torch.Tensor) and given.dim() >= 2 else None


def check_token_labels(labels: torch.Tensor | None, shape: tuple[int, int] | None, num_labels: int) -> None:
    """A token classifier's `labels`: one class per token, in [0, num_labels) or -100, checked before the forward.
    The layouts the stock heads read right are accepted: (batch, tokens), and the same labels flattened
    (`(batch * tokens,)`) or with a trailing 1 (their loss flattens both sides). Other shapes failed after the whole
    forward ("Expected input batch_size (21) to match target batch_size (24)"), or, with as many labels in another
    layout (tokens x batch), were silently read in the wrong order; a float tensor failed in the loss, a class past
    the head in it too ("Target 5 is out of bounds", a device-side assert on a GPU). Values are read from CPU tensors
    only (`can_read_values`)."""
    if labels is None or shape is None:
        return
    batch, tokens = shape
    layouts = {(batch, tokens), (batch * tokens,), (batch, tokens, 1)}
    if tuple(labels.shape) not in layouts:
        raise ValueError(
            f"`labels` has shape {tuple(labels.shape)}; it must be the input's ({batch}, {tokens}), one class per "
            "token (-100 where a token has none)."
        )
    if labels.is_floating_point() or labels.is_complex():
        raise ValueError(f"`labels` holds {labels.dtype} values; they must be class ids (an integer tensor).")
    if labels.numel() == 0 or not can_read_values(labels):
        return
    bad = labels[(labels != IGNORE_INDEX) & ((labels < 0) | (labels >= num_labels))]
    if bad.numel():
        raise ValueError(
            f"`labels` holds {int(bad[0])}, not a class of the head: `num_labels` is {num_labels}, so labels must be "
            f"in [0, {num_labels}), or -100 where a token has none."
        )


def check_answer_positions(
    start_positions: torch.Tensor | None, end_positions: torch.Tensor | None, batch: int | None
) -> None:
    """A question-answering head's `start_positions` and `end_positions`: both or neither (given one, the stock heads
    return no loss), one integer token index per row: `(batch,)`, or `(batch, 1)` as the stock loss squeezes it.
    Other shapes failed after the whole forward (a `(batch, 2)` with "0D or 1D target tensor expected,
    multi-target not supported", another batch size with "Expected input batch_size (3) to match target batch_size
    (4)", naming neither argument). The values are left to the loss, as in the stock heads: positions past the
    sequence are clamped to its length and left out, negative ones clamped to 0 (the "no answer" index)."""
    if (start_positions is None) != (end_positions is None):
        given, missing = (
            ("start_positions", "end_positions") if end_positions is None else ("end_positions", "start_positions")
        )
        raise ValueError(f"`{given}` is given without `{missing}`: the loss needs both (or neither, for no loss).")
    if start_positions is None or batch is None:
        return
    for name, positions in (("start_positions", start_positions), ("end_positions", end_positions)):
        if not isinstance(positions, torch.Tensor) or tuple(positions.shape) not in {(batch,), (batch, 1)}:
            shape = tuple(positions.shape) if isinstance(positions, torch.Tensor) else type(positions).__name__
            raise ValueError(
                f"`{name}` has shape {shape}; it must be ({batch},), one token index per row of the input "
                f"(or ({batch}, 1))."
            )
        if positions.is_floating_point() or positions.is_complex():
            raise ValueError(
                f"`{name}` holds {positions.dtype} values; they must be token indices (an integer tensor)."
            )


def check_cache_heads(cache: Cache | None, kv_heads: int, head_dim: int, heads_field: str, dim_field: str) -> None:
    """Keys already in `cache` must have the attention's head size, and a head count that divides its key/value heads
    (a tensor-parallel rank caches its share of them): a cache built elsewhere (a PEFT prefix, sized from
    `num_attention_heads` and the model width) otherwise fails inside the cache's concatenation."""
    layers = getattr(cache, "layers", None)
    keys = getattr(layers[0], "keys", None) if layers else None
    if not isinstance(keys, torch.Tensor) or keys.dim() != 4 or keys.numel() == 0:
        return
    if kv_heads % keys.shape[1] or keys.shape[-1] != head_dim:
        raise ValueError(
            f"`past_key_values` holds keys of {keys.shape[1]} heads of size {keys.shape[-1]}, but the model's "
            f"attention has `{heads_field}`={kv_heads} key/value heads of size {head_dim} (`{dim_field}`). A PEFT "
            f"prefix is sized from `num_attention_heads` and the model width: pass "
            f"`PrefixTuningConfig(num_attention_heads={kv_heads}, token_dim={kv_heads * head_dim})`."
        )


def _ids(value) -> list[int]:
    """A special token setting as a list of ids: None, an int, a list of ints or a tensor."""
    if value is None:
        return []
    if isinstance(value, torch.Tensor):
        return [int(v) for v in value.flatten().tolist()]
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def resolved_pad_token_id(generation_config) -> tuple[int | None, str]:
    """The id `generate` writes after a row's end (transformers' rule: `pad_token_id`, else the first
    `eos_token_id`), and where it comes from, for messages."""
    if generation_config.pad_token_id is not None:
        return int(generation_config.pad_token_id), "`pad_token_id`"
    eos = _ids(generation_config.eos_token_id)
    return (eos[0], "`pad_token_id` (unset, so the first `eos_token_id`)") if eos else (None, "")


def check_special_token_ids(generation_config, vocab_size: int, is_encoder_decoder: bool, batch_size: int | None):
    """The special token ids of a `generate` call against the model's output vocabulary [0, vocab_size), checked
    before anything runs (transformers only warns, when the model config is built, about int ids):

    - `forced_bos_token_id`, `forced_eos_token_id` and an encoder-decoder's `decoder_start_token_id` outside it fail
      every call that uses them (an IndexError at the step that forces them, the last one for `forced_eos_token_id`;
      the embedding's lookup of the start token, a device-side assert on a GPU): a ValueError naming the field;
    - `pad_token_id` (or the first `eos_token_id` standing in for it) outside it is fed to the model by the rows of a
      batch that end before the others: a ValueError when rows can end (an `eos_token_id` in the vocabulary) and
      there are several (beam search writes it into finished hypotheses only, and passes);
    - `eos_token_id` ids outside it can never be generated, so generation never stops at them: a warning naming
      them (legacy configs carry such ids; the call is otherwise sound).
    """
    allowed = f"must be in [0, {vocab_size}) (the model's output vocabulary)"

    def outside(value) -> list[int]:
        return [i for i in _ids(value) if not 0 <= i < vocab_size]

    fields = ["forced_bos_token_id", "forced_eos_token_id"]
    if is_encoder_decoder:  # transformers starts from `bos_token_id` where `decoder_start_token_id` is unset
        unset = generation_config.decoder_start_token_id is None
        fields.append("bos_token_id" if unset else "decoder_start_token_id")
    for field in fields:
        bad = outside(getattr(generation_config, field, None))
        if bad:
            raise ValueError(
                f"`{field}` ({getattr(generation_config, field)}) {allowed}; {bad} is not. Set it in the generation "
                f"config or pass `{field}=` to `generate`."
            )
    eos = _ids(generation_config.eos_token_id)
    bad_eos = outside(eos)
    if bad_eos:
        logger.warning_once(
            f"`eos_token_id` ({generation_config.eos_token_id}) holds {bad_eos}, outside the model's output "
            f"vocabulary [0, {vocab_size}): the model never generates {'them' if len(bad_eos) > 1 else 'it'}, so "
            "generation does not stop there."
        )
    pad, source = resolved_pad_token_id(generation_config)
    rows = (batch_size or 1) * max(generation_config.num_return_sequences or 1, 1)
    can_end = len(bad_eos) < len(eos)
    if pad is not None and not 0 <= pad < vocab_size and can_end and rows > 1 and generation_config.num_beams == 1:
        raise ValueError(
            f"{source} ({pad}) {allowed}: the rows of a batch that end before the others are fed it for the "
            "remaining steps. Pass `pad_token_id=` an id of the vocabulary (the tokenizer's pad token, or an "
            "`eos_token_id`)."
        )


__all__ = [
    "cached_length",
    "can_read_values",
    "check_answer_positions",
    "check_attention_mask",
    "check_cache_heads",
    "check_segment_ids",
    "check_special_token_ids",
    "check_token_ids",
    "check_token_labels",
    "input_shape",
    "resolved_pad_token_id",
]
