"""Train, save and load archlab tokenizers with the `tokenizers` library (seed 001: "train a WordPiece tokenizer").

Three algorithms, each a small builder in `ALGORITHMS`:
- `"bpe"`: byte-level BPE (GPT-2 / LLaMA-3 style), lossless on any text, the default for the decoder and seq2seq;
- `"wordpiece"`: BERT's WordPiece over whitespace/punctuation-split words, the default for the masked LM;
- `"unigram"`: the SentencePiece Unigram LM over `▁`-marked words.

The special tokens follow the model kind (`MODEL_KINDS`): every kind gets `<pad>`=0, `<s>`=1, `</s>`=2, `<unk>`=3
(the ids `DecoderConfig` defaults to); the masked LM adds `<mask>`, the decoder adds the ChatML turn markers and a
chat template whose assistant turns sit in `{% generation %}` blocks, so
`apply_chat_template(..., return_assistant_tokens_mask=True)` marks the tokens to train on.

`save_tokenizer` writes a folder `AutoTokenizer` loads, with `tokenizer_class` = "PreTrainedTokenizerFast" (the
class every transformers version can load) instead of transformers 5's default "TokenizersBackend".
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

PAD, BOS, EOS, UNK, MASK = "<pad>", "<s>", "</s>", "<unk>", "<mask>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")  # "gpt2", "org/name"

# ChatML with the assistant's answer (and its end marker) inside a generation block: the tokens a chat model is
# trained to produce. The bos token opens the conversation because chat templates are tokenized without specials.
# A message's content is its text, or a list of text parts ({"type": "text", "text": ...}, OpenAI's and transformers'
# multimodal layout) joined; none (an assistant turn that only calls tools) is no text; anything else (images) is
# refused by name. Tools (`apply_chat_template(..., tools=[...])`) are rendered as Qwen2.5's ChatML template renders
# them: their JSON schemas in a system turn (after the conversation's own system message), an assistant's
# `tool_calls` as `<tool_call>` JSON inside its generated turn, a tool's answer as `<tool_response>` text in a `user`
# turn (consecutive answers in one turn). One difference: arguments given as a JSON string (OpenAI's layout) are
# written as that JSON, where Qwen2.5's template encodes the string again. Documents (RAG) are refused by name rather
# than silently dropped.
TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function "
    "signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_FORMAT = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call>"
)
CHAT_TEMPLATE = (
    "{%- if documents %}"
    "{{ raise_exception('archlab\\'s chat template does not render documents; put their text in a message') }}"
    "{%- endif %}"
    "{{ bos_token }}"
    "{%- set system_first = messages and messages[0]['role'] == 'system' and tools %}"
    "{%- if tools %}"
    "{{ '<|im_start|>system\n' }}"
    "{%- if system_first and messages[0]['content'] is string %}{{ messages[0]['content'] + '\n\n' }}"
    "{%- elif system_first %}{{ messages[0]['content'] | map(attribute='text') | join('') + '\n\n' }}{%- endif %}"
    "{{ '" + TOOLS_PREAMBLE + "' }}"
    "{%- for tool in tools %}{{ '\n' + tool | tojson }}{%- endfor %}"
    "{{ '" + TOOLS_FORMAT.replace("'", "\\'") + "<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (loop.first and system_first) %}"
    "{%- if message['content'] is string %}"
    "{%- set content = message['content'] %}"
    "{%- elif message['content'] is none or message['content'] is undefined %}"
    "{%- set content = '' %}"
    "{%- elif message['content'] is iterable and message['content'] is not mapping "
    "and message['content'] | rejectattr('type', 'equalto', 'text') | list | length == 0 %}"
    "{%- set content = message['content'] | map(attribute='text') | join('') %}"
    "{%- else %}"
    "{{ raise_exception('archlab\\'s chat template takes a message\\'s content as text or a list of text parts "
    '({"type": "text", "text": ...}), got: \' + message[\'content\'] | string) }}'
    "{%- endif %}"
    "{%- if message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{ '<|im_start|>user' }}{%- endif %}"
    "{{ '\n<tool_response>\n' + content + '\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{ '<|im_end|>\n' }}{%- endif %}"
    "{%- else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{% generation %}{{ content }}"
    "{%- for call in message['tool_calls'] or [] %}"
    "{%- set call = call['function'] if call['function'] is defined else call %}"
    "{%- if content or not loop.first %}{{ '\n' }}{%- endif %}"
    "{{ '<tool_call>\n{\"name\": \"' + call['name'] + '\", \"arguments\": ' }}"
    "{%- if call['arguments'] is string %}{{ call['arguments'] }}"
    "{%- else %}{{ call['arguments'] | tojson }}{%- endif %}"
    "{{ '}\n</tool_call>' }}"
    "{%- endfor %}"
    "{{ '<|im_end|>' }}{% endgeneration %}"
    "{%- else %}"
    "{{ content + '<|im_end|>' }}"
    "{%- endif %}"
    "{{ '\n' }}"
    "{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{%- endif %}"
)


@dataclass(frozen=True)
class TokenizerSpec:
    """What a model kind needs from its tokenizer: special tokens, how single texts are wrapped, a chat template."""

    special_tokens: tuple[str, ...]
    single: str  # TemplateProcessing pattern for one sequence
    pair: str  # ... and for a pair
    default_algorithm: str
    extra_special: tuple[str, ...] = ()
    chat_template: str | None = None
    named: dict[str, str] = field(default_factory=dict)  # tokenizer attribute -> token
    # the side `tokenizer(texts, padding=True)` pads: a decoder's on the left, as Llama's, Mistral's and Gemma's
    # tokenizers pad, so a batch of prompts goes straight to `generate` (each row's new tokens follow its own prompt;
    # right padding put them after the padding, and transformers warns "right-padding was detected"); an encoder's
    # and an encoder-decoder's on the right, as BERT's and Marian's
    padding_side: str = "right"


_BASE = (PAD, BOS, EOS, UNK)
MODEL_KINDS: dict[str, TokenizerSpec] = {
    # LLaMA-style: prepend <s>; documents get </s> appended by the data pipeline.
    "decoder": TokenizerSpec(
        special_tokens=_BASE + (IM_START, IM_END),
        single=f"{BOS} $A",
        pair=f"{BOS} $A {BOS} $B",
        default_algorithm="bpe",
        extra_special=(IM_START, IM_END),
        chat_template=CHAT_TEMPLATE,
        named={"pad_token": PAD, "bos_token": BOS, "eos_token": EOS, "unk_token": UNK},
        padding_side="left",
    ),
    # Marian/T5-style: sources and targets end with </s>.
    "seq2seq": TokenizerSpec(
        special_tokens=_BASE,
        single=f"$A {EOS}",
        pair=f"$A {EOS} $B {EOS}",
        default_algorithm="bpe",
        named={"pad_token": PAD, "bos_token": BOS, "eos_token": EOS, "unk_token": UNK},
    ),
    # BERT/RoBERTa-style: <s> plays [CLS], </s> plays [SEP]; a pair's second text and its </s> are segment 1, as
    # BERT's tokenizer gives them (a model with segment embeddings, `type_vocab_size` >= 2, reads them)
    "masked_lm": TokenizerSpec(
        special_tokens=_BASE + (MASK,),
        single=f"{BOS} $A {EOS}",
        pair=f"{BOS} $A {EOS} $B:1 {EOS}:1",
        default_algorithm="wordpiece",
        named={
            "pad_token": PAD,
            "bos_token": BOS,
            "eos_token": EOS,
            "unk_token": UNK,
            "mask_token": MASK,
            "cls_token": BOS,
            "sep_token": EOS,
        },
    ),
}


def _bpe(vocab_size: int, min_frequency: int, specials: list[str]) -> tuple[Tokenizer, Any]:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes: nothing is ever unknown
        show_progress=False,
    )
    return tokenizer, trainer


def _wordpiece(vocab_size: int, min_frequency: int, specials: list[str]) -> tuple[Tokenizer, Any]:
    tokenizer = Tokenizer(models.WordPiece(unk_token=UNK))
    # BERT's normalizer puts spaces around each CJK ideograph (as bert-base-chinese does), and nothing else here:
    # Chinese and Japanese text has no spaces, so without it a sentence was one "word", and a word over WordPiece's
    # 100 characters encodes as a single <unk>.
    cjk_apart = normalizers.BertNormalizer(
        clean_text=False, handle_chinese_chars=True, strip_accents=False, lowercase=False
    )
    tokenizer.normalizer = normalizers.Sequence([normalizers.NFC(), cjk_apart])
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=specials, show_progress=False
    )
    return tokenizer, trainer


def _unigram(vocab_size: int, min_frequency: int, specials: list[str]) -> tuple[Tokenizer, Any]:
    tokenizer = Tokenizer(models.Unigram())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    trainer = trainers.UnigramTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        unk_token=UNK,
        max_piece_length=16,
        seed_size=100_000,  # the default 1M seed pieces make training minutes long on a few MB of code
        show_progress=False,
    )
    return tokenizer, trainer


ALGORITHMS = {"bpe": _bpe, "wordpiece": _wordpiece, "unigram": _unigram}


def check_vocab_size(vocab_size: int, model_kind: str, algorithm: str, name: str = "`vocab_size`") -> None:
    """A ValueError naming `name` when no vocabulary trained can be that small: it holds the special tokens, and for
    BPE its 256 bytes as well (the texts' characters add to it for WordPiece and Unigram, checked after training)."""
    specials = len(MODEL_KINDS[model_kind].special_tokens)
    smallest = specials + (len(pre_tokenizers.ByteLevel.alphabet()) if algorithm == "bpe" else 1)
    if vocab_size < smallest:
        raise ValueError(
            f"{name} must be at least {smallest} for a {algorithm} {model_kind} tokenizer (its {specials} special "
            f"tokens{' and 256 bytes' if algorithm == 'bpe' else ''}), got {vocab_size}."
        )


def _check_choice(name: str, value: str, allowed: Iterable[str]) -> None:
    allowed = list(allowed)
    if value not in allowed:
        raise ValueError(f"`{name}`={value!r} is not supported; allowed values: {', '.join(map(repr, allowed))}.")


def _batches(texts: Iterable[str], batch_size: int = 1000) -> Iterator[list[str]]:
    batch: list[str] = []
    for text in texts:
        if text:
            batch.append(text)
        if len(batch) == batch_size:
            yield batch
            batch = []
    if batch:
        yield batch


def _starting_with_text(texts: Iterable[str]) -> Iterator[str]:
    """`texts` unchanged, or a ValueError before training when none has a character other than whitespace: WordPiece
    and Unigram then trained a vocabulary of the special tokens alone (every text encoded as `<unk>`), and an empty
    source was found only after the trainer's pass."""
    iterator = iter(texts)
    skipped: list[str] = []
    for text in iterator:
        if text and not text.isspace():
            return itertools.chain(skipped, [text], iterator)
        if text:
            skipped.append(text)
    raise ValueError(
        "The tokenizer training data is empty: no text has a character other than whitespace "
        f"({len(skipped)} whitespace-only texts)."
    )


def _holds_text(path: str | os.PathLike, chunk: int = 1 << 20) -> bool:
    """Whether the file has a character other than whitespace (read until the first one)."""
    with open(path, encoding="utf-8", errors="replace") as f:
        while block := f.read(chunk):
            if not block.isspace():
                return True
    return False


@contextlib.contextmanager
def _vocabulary_holds_the_alphabet(vocab_size: int, algorithm: str) -> Iterator[None]:
    """Unigram training fails with a bare `Exception` of `tokenizers` when `vocab_size` cannot hold every character
    of the texts: a ValueError naming the flag instead."""
    try:
        yield
    except Exception as error:
        if "not large enough to contain all chars" not in str(error):
            raise
        raise ValueError(
            f"`vocab_size` {vocab_size} (--tokenizer_vocab_size) is too small for {algorithm} training: the "
            "vocabulary must hold every character of the training texts; give a larger one."
        ) from None


def _check_the_vocabulary_kept_its_size(trained: int, vocab_size: int, algorithm: str) -> None:
    """BPE's 256 bytes and WordPiece's characters (with their `##` forms) enter the vocabulary whatever its size, so
    `tokenizers` silently returns more entries than asked for: a ValueError with the smallest size that works."""
    if trained > vocab_size:
        raise ValueError(
            f"`vocab_size` {vocab_size} (--tokenizer_vocab_size) is too small for {algorithm} training: the "
            f"alphabet of the training texts and the special tokens alone take {trained} entries; give "
            f"{trained} or more."
        )


def _wordpiece_in_a_fixed_order(
    tokenizer: Tokenizer, fit: Callable[[list[str]], Tokenizer], specials: list[str]
) -> Tokenizer:
    """WordPiece training again, its `##` characters given in a fixed order. `tokenizers` gives each `##` form of a
    character its id in the order of a hash map (huggingface/tokenizers#1794), and breaks ties between merges of
    equal counts by those ids: the same texts trained other ids, and other tokens, from one run to the next. Given
    as special tokens of the trainer they take fixed ids before training starts; they are then made ordinary
    vocabulary entries again (no added tokens)."""
    continuations = sorted(t for t in tokenizer.get_vocab() if len(t) == 3 and t.startswith("##"))
    trained = json.loads(fit(specials + continuations).to_str())
    trained["added_tokens"] = [t for t in trained["added_tokens"] if t["content"] in specials]
    return Tokenizer.from_str(json.dumps(trained))


def _unigram_in_a_fixed_order(tokenizer: Tokenizer, specials: int) -> Tokenizer:
    """The Unigram pieces sorted by their score, rounded to 1e-6 (finer than a SentencePiece model's float32 scores
    hold), then by the piece. `tokenizers` sums the scores in a hash map's order, so pieces of the same score came
    out with scores 1e-15 to 1e-10 apart, in another order (other ids) from one run to the next."""
    trained = json.loads(tokenizer.to_str())
    model = trained["model"]
    pieces = [[piece, round(score, 6)] for piece, score in model["vocab"][specials:]]
    model["vocab"] = model["vocab"][:specials] + sorted(pieces, key=lambda entry: (-entry[1], entry[0]))
    return Tokenizer.from_str(json.dumps(trained))


def train_tokenizer(
    source: Iterable[str] | Sequence[str | os.PathLike] | Any,
    model_kind: str = "decoder",
    algorithm: str | None = None,
    vocab_size: int = 8192,
    min_frequency: int = 2,
    text_column: str = "text",
    model_max_length: int | None = None,
) -> PreTrainedTokenizerFast:
    """Train a tokenizer for `model_kind` and wrap it as a transformers fast tokenizer.

    `source` is any of: a `datasets.Dataset`/`IterableDataset` (its `text_column` is read), a list of file paths
    (`pathlib.Path`s, read by the Rust trainer), or any iterable of strings.
    """
    _check_choice("model_kind", model_kind, MODEL_KINDS)
    spec = MODEL_KINDS[model_kind]
    algorithm = algorithm or spec.default_algorithm
    _check_choice("tokenizer algorithm", algorithm, ALGORITHMS)
    check_vocab_size(vocab_size, model_kind, algorithm)

    files: list[str] | None = None
    if hasattr(source, "column_names") or hasattr(source, "features"):  # a datasets (Iterable)Dataset
        columns = source.column_names
        if columns is not None and text_column not in columns:
            raise ValueError(f"Text column {text_column!r} not found; the dataset has columns {columns}.")

        def texts() -> Iterable[str]:
            return (text for batch in source.iter(1000) for text in batch[text_column])

    elif isinstance(source, (list, tuple)) and source and all(isinstance(s, os.PathLike) for s in source):
        missing = [str(p) for p in source if not os.path.isfile(p)]
        if missing:
            raise FileNotFoundError(f"Tokenizer training files not found: {missing}")
        if not any(_holds_text(p) for p in source):
            raise ValueError("The tokenizer training files are all empty or whitespace only.")
        files = [os.fspath(p) for p in source]
    else:
        if algorithm == "wordpiece" and iter(source) is source:  # read twice below: kept
            source = list(source)

        def texts() -> Iterable[str]:
            return source

    def fit(specials: list[str]) -> Tokenizer:
        tokenizer, trainer = ALGORITHMS[algorithm](vocab_size, min_frequency, specials)
        with _vocabulary_holds_the_alphabet(vocab_size, algorithm):
            if files is not None:
                tokenizer.train(files, trainer)
            else:
                tokenizer.train_from_iterator(_batches(_starting_with_text(texts())), trainer)
        return tokenizer

    tokenizer = fit(list(spec.special_tokens))
    _check_the_vocabulary_kept_its_size(tokenizer.get_vocab_size(), vocab_size, algorithm)
    if algorithm == "wordpiece":
        tokenizer = _wordpiece_in_a_fixed_order(tokenizer, fit, list(spec.special_tokens))
    elif algorithm == "unigram":
        tokenizer = _unigram_in_a_fixed_order(tokenizer, len(spec.special_tokens))
    ids = {token: tokenizer.token_to_id(token) for token in spec.special_tokens}
    tokenizer.post_processor = processors.TemplateProcessing(
        single=spec.single, pair=spec.pair, special_tokens=[(t, ids[t]) for t in (BOS, EOS)]
    )
    kwargs: dict[str, Any] = dict(spec.named)
    if spec.extra_special:
        kwargs["extra_special_tokens"] = list(spec.extra_special)
    if model_max_length is not None:
        kwargs["model_max_length"] = model_max_length
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, padding_side=spec.padding_side, **kwargs)
    if spec.chat_template is not None:
        fast.chat_template = spec.chat_template
    return fast


# What transformers 5 writes into tokenizer_config.json of a tokenizer it loaded from a local folder: facts of that
# load, not of the tokenizer (a load -> save -> load -> save changed the file).
_LOAD_FACTS = ("is_local", "local_files_only")


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, folder: str | os.PathLike) -> None:
    """`save_pretrained`, with the chat template inside tokenizer_config.json and a loadable `tokenizer_class`. A
    template file of an earlier save in the folder (`chat_template.jinja`, transformers' default layout, which the
    Trainer's own save writes) is removed: it would stand beside the one in tokenizer_config.json.

    `padding_side` and `truncation_side` are saved as the tokenizer has them: transformers saves only the values given
    at construction, so `tokenizer.padding_side = "left"` (what batched generation with a decoder wants) was lost
    on reload; so is `model_input_names` where it differs from the class's (`token_type_ids` added for a model with
    segment embeddings). The load facts transformers adds to a loaded tokenizer's config (`is_local`, ...) are left
    out, so saving a loaded tokenizer again writes the same files."""
    tokenizer.save_pretrained(folder, save_jinja_files=False)
    for name in ("chat_template.jinja", "chat_template.json"):
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(folder, name))
    path = os.path.join(folder, "tokenizer_config.json")
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    if config.get("tokenizer_class") == "TokenizersBackend":
        # transformers 5 aliases PreTrainedTokenizerFast to TokenizersBackend; 4.x only knows the former.
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
    for name in _LOAD_FACTS:
        config.pop(name, None)
    config["padding_side"] = tokenizer.padding_side
    if list(tokenizer.model_input_names) != list(type(tokenizer).model_input_names):
        # (set on the tokenizer after construction, as for a model with segment embeddings, they were not saved)
        config["model_input_names"] = list(tokenizer.model_input_names)
    config["truncation_side"] = tokenizer.truncation_side
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, sort_keys=True, ensure_ascii=False)
        f.write("\n")


# The files any transformers tokenizer is saved as; a folder with none of them holds no tokenizer.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "spiece.model",
    "vocab.json",
    "vocab.txt",
    "sentencepiece.bpe.model",
)


def has_tokenizer(folder: str | os.PathLike) -> bool:
    return any(os.path.isfile(os.path.join(folder, name)) for name in TOKENIZER_FILES)


def load_tokenizer(name_or_path: str | os.PathLike, **kwargs: Any) -> PreTrainedTokenizerFast:
    """`AutoTokenizer.from_pretrained`, with a clear error when a local folder does not exist or holds no tokenizer
    (AutoTokenizer would then ask for sentencepiece or tiktoken)."""
    path = os.path.expanduser(os.fspath(name_or_path))
    if not os.path.isdir(path) and not _HUB_ID.match(path):
        raise FileNotFoundError(f"Tokenizer folder {path!r} does not exist.")
    if os.path.isdir(path) and not has_tokenizer(path):
        raise FileNotFoundError(f"{path!r} holds no tokenizer (none of {', '.join(TOKENIZER_FILES[:2])}, ...).")
    try:
        return AutoTokenizer.from_pretrained(path, **kwargs)
    except OSError as error:
        raise OSError(f"Tokenizer {path!r} is neither a local folder nor loadable from the Hub ({error})") from error


__all__ = [
    "ALGORITHMS",
    "CHAT_TEMPLATE",
    "MODEL_KINDS",
    "TOKENIZER_FILES",
    "TokenizerSpec",
    "has_tokenizer",
    "load_tokenizer",
    "save_tokenizer",
    "train_tokenizer",
]
