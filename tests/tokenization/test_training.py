"""Tokenizer training, saving and loading (tokenization/training.py)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

import archlab
from archlab.tokenization.training import (
    ALGORITHMS,
    BOS,
    EOS,
    MASK,
    PAD,
    UNK,
    load_tokenizer,
    save_tokenizer,
    train_tokenizer,
)

TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "for i in range(10):\n    print(i * i)  # squares\n",
    "import os\nprint(os.path.join('a', 'b'))\n",
] * 20


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_train_save_load_round_trip(tmp_path: Path, algorithm: str) -> None:
    tokenizer = train_tokenizer(TEXTS, "decoder", algorithm, vocab_size=300, min_frequency=1)
    save_tokenizer(tokenizer, tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    text = "def add(x, y):\n    return x + y\n"
    assert loaded(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert len(loaded) == len(tokenizer) <= 300
    # Ids the decoder config expects by default.
    assert (loaded.pad_token_id, loaded.bos_token_id, loaded.eos_token_id) == (0, 1, 2)
    assert loaded(text)["input_ids"][0] == loaded.bos_token_id  # LLaMA-style: <s> prepended
    decoded = loaded.decode(loaded(text)["input_ids"], skip_special_tokens=True)
    if algorithm == "bpe":
        assert decoded == text  # byte-level BPE is lossless
    else:
        assert decoded.split() == text.split() or "".join(decoded.split()) == "".join(text.split())


def test_byte_level_bpe_never_unknown() -> None:
    tokenizer = train_tokenizer(TEXTS, "decoder", "bpe", vocab_size=300, min_frequency=1)
    text = "naïve 😀 ∑ never seen"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids) == text


def test_special_tokens_per_model_kind() -> None:
    decoder = train_tokenizer(TEXTS, "decoder", vocab_size=300, min_frequency=1)
    seq2seq = train_tokenizer(TEXTS, "seq2seq", vocab_size=300, min_frequency=1)
    masked = train_tokenizer(TEXTS, "masked_lm", vocab_size=300, min_frequency=1)
    assert decoder.chat_template is not None and masked.chat_template is None
    assert "<|im_start|>" in decoder.all_special_tokens and MASK not in decoder.all_special_tokens
    assert masked.mask_token == MASK and masked.mask_token_id == 4
    for tok in (decoder, seq2seq, masked):
        assert [tok.convert_ids_to_tokens(i) for i in range(4)] == [PAD, BOS, EOS, UNK]
    ids = seq2seq("x = 1")["input_ids"]
    assert ids[-1] == seq2seq.eos_token_id and ids[0] != seq2seq.bos_token_id  # Marian-style: text </s>
    ids = masked("x = 1")["input_ids"]
    assert ids[0] == masked.cls_token_id and ids[-1] == masked.sep_token_id  # BERT-style: [CLS] text [SEP]


def test_the_masked_lm_tokenizer_gives_a_pair_berts_segment_ids(tmp_path: Path) -> None:
    """As BERT's tokenizer: `<s> first </s>` are segment 0 and `second </s>` segment 1 (every token had 0, so a
    masked LM with segment embeddings could not tell a pair's texts apart), after a save and load too."""
    masked = train_tokenizer(TEXTS, "masked_lm", vocab_size=300, min_frequency=1)
    save_tokenizer(masked, tmp_path)
    for tokenizer in (masked, load_tokenizer(tmp_path)):
        first = tokenizer("x = 1", add_special_tokens=False)["input_ids"]
        pair = tokenizer("x = 1", "y", return_token_type_ids=True)
        assert pair["input_ids"][: len(first) + 2] == [tokenizer.cls_token_id, *first, tokenizer.sep_token_id]
        segment_one = len(pair["input_ids"]) - len(first) - 2
        assert pair["token_type_ids"] == [0] * (len(first) + 2) + [1] * segment_one
        assert set(tokenizer("x = 1", return_token_type_ids=True)["token_type_ids"]) == {0}


def test_chat_template_marks_only_assistant_tokens(tmp_path: Path) -> None:
    tokenizer = train_tokenizer(TEXTS, "decoder", vocab_size=300, min_frequency=1)
    save_tokenizer(tokenizer, tmp_path)
    tokenizer = load_tokenizer(tmp_path)
    messages = [{"role": "user", "content": "add two numbers"}, {"role": "assistant", "content": "return a + b"}]
    out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = out["input_ids"], out["assistant_masks"]
    answer = [i for i, m in zip(ids, mask) if m]
    assert tokenizer.decode(answer) == "return a + b<|im_end|>"
    assert ids[0] == tokenizer.bos_token_id
    prompt = tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n")


def test_chat_template_reads_text_parts_as_their_text_and_names_other_content() -> None:
    """Content as a list of text parts (OpenAI's layout, transformers' multimodal one) failed inside the template with
    "can only concatenate list (not "str") to list"; it now renders, and is masked, as the same text; other content
    (an image part, a bare part) is refused by name."""
    tokenizer = train_tokenizer(TEXTS, "decoder", vocab_size=300, min_frequency=1)
    texts = [("system", ["be brief"]), ("user", ["add ", "two numbers"]), ("assistant", ["return a + b"])]
    as_strings = [{"role": role, "content": "".join(parts)} for role, parts in texts]
    as_parts = [{"role": role, "content": [{"type": "text", "text": p} for p in parts]} for role, parts in texts]
    for options in (
        dict(tokenize=True, return_dict=True, return_assistant_tokens_mask=True),
        dict(tokenize=False, continue_final_message=True),
    ):
        assert tokenizer.apply_chat_template(as_parts, **options) == tokenizer.apply_chat_template(
            as_strings, **options
        )
    for content in ([{"type": "image", "url": "cat.png"}], {"type": "text", "text": "hi"}):
        with pytest.raises(Exception, match=r"content as text or a list of text parts .*, got: .*(cat.png|'hi')"):
            tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False)


def test_chat_template_renders_tools_and_tool_calls_and_refuses_documents() -> None:
    """`apply_chat_template(..., tools=[...])` rendered the conversation without the tools, and an assistant's
    `tool_calls` as an empty turn (a `None` content was refused): the tools' schemas now open the conversation in a
    system turn after its own system message, each call is `<tool_call>` JSON inside the assistant's generated (and
    masked) turn, and documents are refused by name. Conversations without tools render as before."""
    tokenizer = train_tokenizer(TEXTS, "decoder", vocab_size=300, min_frequency=1)

    def get_weather(city: str) -> str:
        """The weather.

        Args:
            city: where
        """

    system, user = {"role": "system", "content": "be brief"}, {"role": "user", "content": "weather?"}
    text = tokenizer.apply_chat_template([system, user], tools=[get_weather], tokenize=False)
    schema = '{"type": "function", "function": {"name": "get_weather", "description": "The weather."'
    assert text.startswith("<s><|im_start|>system\nbe brief\n\n# Tools\n") and f"<tools>\n{schema}" in text
    assert text.count("be brief") == 1 and text.endswith("<|im_start|>user\nweather?<|im_end|>\n")
    as_parts = {"role": "system", "content": [{"type": "text", "text": "be brief"}]}
    assert tokenizer.apply_chat_template([as_parts, user], tools=[get_weather], tokenize=False) == text
    plain = tokenizer.apply_chat_template([system, user], tokenize=False)
    assert plain == "<s><|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nweather?<|im_end|>\n"
    calls = [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]
    conversation = [
        user,
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "name": "get_weather", "content": "sunny"},
        {"role": "assistant", "content": "Sunny."},
    ]
    out = tokenizer.apply_chat_template(conversation, return_dict=True, return_assistant_tokens_mask=True)
    answers = tokenizer.decode([i for i, m in zip(out["input_ids"], out["assistant_masks"]) if m])
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert answers == f"{call}<|im_end|>Sunny.<|im_end|>"
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>" in tokenizer.decode(out["input_ids"])
    with pytest.raises(Exception, match="does not render documents"):
        tokenizer.apply_chat_template([user], documents=[{"title": "a", "text": "b"}], tokenize=False)


def test_chat_template_renders_tool_answers_as_qwen2_5_does() -> None:
    """A tool's answer was a turn of role `tool`, where Qwen2.5's template (which the tools' rendering follows) writes
    it as `<tool_response>` text in a `user` turn, consecutive answers (parallel calls) in one turn."""
    tokenizer = train_tokenizer(TEXTS, "decoder", vocab_size=300, min_frequency=1)
    calls = [{"name": name, "arguments": {}} for name in ("weather", "time")]
    conversation = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "", "tool_calls": calls},
        {"role": "tool", "content": "sunny"},
        {"role": "tool", "content": "noon"},
        {"role": "assistant", "content": "Sunny."},
        {"role": "tool", "content": "late"},
    ]
    text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    answers = "\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nnoon\n</tool_response><|im_end|>\n"
    assert "<|im_start|>user" + answers + "<|im_start|>assistant\nSunny.<|im_end|>\n" in text
    last = "<|im_start|>user\n<tool_response>\nlate\n</tool_response><|im_end|>\n"
    assert text.endswith(last + "<|im_start|>assistant\n")
    assert "<|im_start|>tool" not in text


def test_train_from_files_and_datasets(tmp_path: Path) -> None:
    files = []
    for i, text in enumerate(TEXTS[:4]):
        path = tmp_path / f"f{i}.py"
        path.write_text(text * 5)
        files.append(path)
    from_files = train_tokenizer(files, "masked_lm", "wordpiece", vocab_size=200, min_frequency=1)
    from_dataset = train_tokenizer(
        Dataset.from_dict({"body": TEXTS}),
        "masked_lm",
        "wordpiece",
        vocab_size=200,
        min_frequency=1,
        text_column="body",
    )
    assert from_files.tokenize("return") == ["return"] and from_dataset.tokenize("return") == ["return"]
    with pytest.raises(ValueError, match="Text column 'text' not found"):
        train_tokenizer(Dataset.from_dict({"body": TEXTS}), vocab_size=300)
    with pytest.raises(FileNotFoundError, match="not found"):
        train_tokenizer([tmp_path / "missing.txt"], vocab_size=300)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="model_kind.*allowed values: 'decoder', 'seq2seq', 'masked_lm'"):
        train_tokenizer(TEXTS, "encoder")
    with pytest.raises(ValueError, match="algorithm.*'bpe'"):
        train_tokenizer(TEXTS, algorithm="sentencepiece")
    with pytest.raises(ValueError, match="empty"):
        train_tokenizer(["", ""], vocab_size=300)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer("./no/such/folder")


def test_a_unigram_vocabulary_smaller_than_the_alphabet_is_a_value_error(tmp_path: Path) -> None:
    """`tokenizers` raised a bare Exception, so the scripts printed a traceback instead of one `error:` line."""
    with pytest.raises(ValueError, match=r"`vocab_size` 12 \(--tokenizer_vocab_size\) is too small for unigram"):
        train_tokenizer(TEXTS, algorithm="unigram", vocab_size=12)
    (tmp_path / "texts.txt").write_text("".join(TEXTS))
    with pytest.raises(ValueError, match="too small for unigram"):
        train_tokenizer([tmp_path / "texts.txt"], algorithm="unigram", vocab_size=12)


def test_a_vocabulary_smaller_than_what_training_returns_is_a_value_error() -> None:
    """BPE keeps its 256 bytes and WordPiece every character (and its `##` form) whatever `vocab_size` says:
    `tokenizers` silently returned 262 entries for 100 asked (BPE), and 40 for 20 (WordPiece)."""
    with pytest.raises(ValueError, match=r"`vocab_size` must be at least 262 for a bpe decoder tokenizer \(its 6 "):
        train_tokenizer(TEXTS, algorithm="bpe", vocab_size=261, min_frequency=1)
    assert len(train_tokenizer(TEXTS, algorithm="bpe", vocab_size=262, min_frequency=1)) == 262
    with pytest.raises(ValueError, match=r"`vocab_size` 20 \(--tokenizer_vocab_size\) is too small for wordpiece") as e:
        train_tokenizer(TEXTS, algorithm="wordpiece", vocab_size=20, min_frequency=1)
    smallest = int(re.search(r"give (\d+) or more", str(e.value)).group(1))
    assert len(train_tokenizer(TEXTS, algorithm="wordpiece", vocab_size=smallest, min_frequency=1)) == smallest


def test_saved_tokenizer_loads_in_a_process_without_archlab(tmp_path: Path) -> None:
    """Only transformers is needed to read it back (what a Hub user of the model has)."""
    tokenizer = train_tokenizer(TEXTS, "decoder", vocab_size=300, min_frequency=1)
    save_tokenizer(tokenizer, tmp_path)
    code = (
        "import sys; sys.modules['archlab'] = None\n"
        "from transformers import AutoTokenizer\n"
        f"t = AutoTokenizer.from_pretrained({str(tmp_path)!r})\n"
        "print(t('x = 1')['input_ids'], t.chat_template is not None)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == f"{tokenizer('x = 1')['input_ids']} True"


def test_a_named_tokenizer_that_moves_the_models_token_ids_is_warned_about(tmp_path: Path, capsys) -> None:
    """--model_name_or_path with a --tokenizer_name of other ids (smaller than the embedding, so not refused) would
    train the pretrained embeddings under other meanings: one line says so. Same ids plus added tokens: silent."""
    from types import SimpleNamespace

    from archlab.training.tokenizers import get_tokenizer

    model, same, other = tmp_path / "model", tmp_path / "same", tmp_path / "other"
    save_tokenizer(train_tokenizer(TEXTS, "decoder", "bpe", vocab_size=300, min_frequency=1), model)
    extended = load_tokenizer(model)
    extended.add_tokens(["<extra>"])
    save_tokenizer(extended, same)
    save_tokenizer(train_tokenizer(TEXTS[:2], "decoder", "wordpiece", vocab_size=200, min_frequency=1), other)

    def choose(tokenizer_name):
        choices = SimpleNamespace(model_name_or_path=str(model), tokenizer_name=str(tokenizer_name))
        return get_tokenizer(choices, None, train=lambda: None)

    assert len(choose(same)) == len(extended) and "Warning" not in capsys.readouterr().out
    assert len(choose(other)) < len(extended)
    out = capsys.readouterr().out
    assert "tokens of the model's own tokenizer" in out and "other ids" in out and out.count("\n") == 1


def test_a_saved_tokenizer_keeps_its_sides_and_saves_again_as_the_same_files(tmp_path: Path) -> None:
    """`padding_side = "left"` set after construction came back "right" (transformers saves the values given at
    construction only), and a loaded tokenizer saved again gained `is_local`/`local_files_only` in its config."""
    from isolated import check, run_without_archlab

    tokenizer = train_tokenizer(TEXTS, "decoder", vocab_size=300, min_frequency=1, model_max_length=64)
    tokenizer.padding_side, tokenizer.truncation_side = "left", "left"
    first, second = tmp_path / "first", tmp_path / "second"
    save_tokenizer(tokenizer, first)
    save_tokenizer(load_tokenizer(first), second)
    assert sorted(p.name for p in first.iterdir()) == sorted(p.name for p in second.iterdir())
    for path in first.iterdir():
        assert path.read_bytes() == (second / path.name).read_bytes(), path.name
    code = (
        "from transformers import AutoTokenizer\n"
        f"t = AutoTokenizer.from_pretrained({str(second)!r})\n"
        "print(t.padding_side, t.truncation_side, t.model_max_length, t('x = 1')['input_ids'])"
    )
    out = check(run_without_archlab(code, tmp_path / "isolated"))
    assert out.strip() == f"left left 64 {tokenizer('x = 1')['input_ids']}"


def test_a_saved_tokenizer_keeps_the_inputs_it_returns(tmp_path: Path) -> None:
    """`model_input_names` with `token_type_ids` added (a masked LM with segment embeddings: its pairs' second text is
    segment 1, as BERT's tokenizer returns them) came back without them, and the pipelines fed segment 0 throughout;
    a tokenizer left as trained saves no such entry."""
    tokenizer = train_tokenizer(TEXTS, "masked_lm", vocab_size=300, min_frequency=1)
    save_tokenizer(tokenizer, tmp_path / "plain")
    assert "model_input_names" not in json.loads((tmp_path / "plain" / "tokenizer_config.json").read_text())
    tokenizer.model_input_names = [*tokenizer.model_input_names, "token_type_ids"]
    save_tokenizer(tokenizer, tmp_path / "segments")
    assert (
        load_tokenizer(tmp_path / "segments")("x = 1", "y = 2")["token_type_ids"]
        == tokenizer("x = 1", "y = 2", return_token_type_ids=True)["token_type_ids"]
    )


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_whitespace_only_training_data_is_refused_before_training(tmp_path: Path, algorithm: str) -> None:
    """WordPiece and Unigram trained a vocabulary of the special tokens alone on texts of spaces and newlines, and
    encoded every later text as <unk>; an empty source was found only after the trainer's pass."""
    texts = ["   ", "\n\n", "\t ", ""] * 10
    with pytest.raises(ValueError, match=r"empty: no text has a character other than whitespace \(30 "):
        train_tokenizer(texts, algorithm=algorithm, vocab_size=300, min_frequency=1)
    with pytest.raises(ValueError, match="empty"):
        train_tokenizer(Dataset.from_dict({"text": texts}), algorithm=algorithm, vocab_size=300)
    (tmp_path / "blank.txt").write_text("\n  \n\t\n")
    with pytest.raises(ValueError, match="all empty or whitespace only"):
        train_tokenizer([tmp_path / "blank.txt"], algorithm=algorithm, vocab_size=300)
    assert len(train_tokenizer([*texts, "x = 1"], algorithm=algorithm, vocab_size=300, min_frequency=1)) > 6


@pytest.mark.parametrize("algorithm", ["wordpiece", "unigram"])
def test_the_same_texts_train_the_same_tokenizer_files(tmp_path: Path, algorithm: str) -> None:
    """`tokenizers` orders WordPiece's `##` characters and Unigram's equal scores by hash-map order: five trainings
    on these texts gave five different tokenizer.json files (other ids, for WordPiece other tokens too)."""
    saved = set()
    for run in range(5):
        tokenizer = train_tokenizer(TEXTS, algorithm=algorithm, vocab_size=120, min_frequency=1)
        save_tokenizer(tokenizer, tmp_path / str(run))
        saved.add((tmp_path / str(run) / "tokenizer.json").read_text())
    assert len(saved) == 1
    assert not [t for t in tokenizer.added_tokens_decoder.values() if t.content.startswith("##")]


def test_wordpiece_splits_cjk_ideographs_as_bert_does() -> None:
    """Chinese text has no spaces between words: without BERT's CJK splitting a sentence was one WordPiece "word",
    and one over 100 characters encoded as a single <unk>."""
    sentence = "注意力机制让模型在每一步都能看到整个输入序列并按相关性加权求和" * 4  # 124 ideographs, no spaces
    texts = [sentence, "自注意力与交叉注意力", "self café"] * 10
    tokenizer = train_tokenizer(texts, "masked_lm", "wordpiece", 200, min_frequency=1)
    ids = tokenizer(sentence, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(sentence) and tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids).replace(" ", "") == sentence
    assert tokenizer("self 注意力 café", add_special_tokens=False).tokens() == ["self", "注", "意", "力", "café"]


@pytest.mark.parametrize("kind", ["decoder", "seq2seq", "masked_lm"])
def test_a_decoder_tokenizer_pads_on_the_left_and_the_others_on_the_right(tmp_path: Path, kind: str) -> None:
    """A decoder's tokenizer pads on the left, as Llama's, Mistral's and Gemma's do (a batch of prompts goes straight
    to `generate`); an encoder-decoder's and a masked LM's on the right, as Marian's and BERT's. Saved and loaded so."""
    tokenizer = train_tokenizer(TEXTS, kind, "bpe", vocab_size=300, min_frequency=1)
    save_tokenizer(tokenizer, tmp_path)
    side = "left" if kind == "decoder" else "right"
    assert tokenizer.padding_side == AutoTokenizer.from_pretrained(tmp_path).padding_side == side
    mask = tokenizer(["x", "x = 1"], padding=True)["attention_mask"][0]
    assert mask[0 if side == "left" else -1] == 0


@pytest.mark.parametrize("position_embedding_type", ["rope", "learned", "alibi"])
def test_prompts_padded_by_a_saved_decoder_tokenizer_generate_each_their_own_text(
    tmp_path: Path, position_embedding_type: str
) -> None:
    """`tok(prompts, padding=True)` into `generate`, as users write it: each row's greedy tokens are those of its
    prompt alone. Padded on the right (archlab's decoder tokenizer until now), the short prompt's new tokens came
    after its padding and differed from its own, with transformers' "right-padding was detected" warning."""
    save_tokenizer(train_tokenizer(TEXTS, "decoder", vocab_size=300, min_frequency=1), tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    config = archlab.DecoderConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        position_embedding_type=position_embedding_type,
    )
    torch.manual_seed(0)
    archlab.DecoderForCausalLM(config).save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    for parameter in model.parameters():  # sharper logits than the initialisation's: greedy choices that differ
        torch.nn.init.normal_(parameter, std=0.3)
    prompts = ["x", "for i in range(10):\n    print(i"]
    settings = dict(max_new_tokens=6, do_sample=False, eos_token_id=None)
    batch = tokenizer(prompts, padding=True, return_tensors="pt")
    generated = model.generate(**batch, **settings)[:, batch["input_ids"].shape[1] :]
    for row, prompt in zip(generated, prompts):
        alone = tokenizer(prompt, return_tensors="pt")
        assert row.tolist() == model.generate(**alone, **settings)[0, alone["input_ids"].shape[1] :].tolist()


def test_a_tokenizer_saved_padding_on_the_right_loads_so(tmp_path: Path) -> None:
    """A decoder tokenizer saved before decoder tokenizers padded on the left keeps the side it was saved with."""
    tokenizer = train_tokenizer(TEXTS, "decoder", vocab_size=300, min_frequency=1)
    tokenizer.padding_side = "right"
    save_tokenizer(tokenizer, tmp_path)
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["padding_side"] == "right"
    assert load_tokenizer(tmp_path).padding_side == "right"
