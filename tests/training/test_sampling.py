"""training/sampling.py: text from the trained model after a run, and when the scripts leave it out."""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from datasets import load_dataset

import archlab
from archlab.tokenization.training import train_tokenizer
from archlab.training.sampling import (
    end_of_turn_id,
    generate_texts,
    sample_unless_sharded,
    show_chat_example,
    shown_message,
    stop_at_the_end_of_a_turn,
    stop_token_ids,
)
from archlab.training.task_data import tokenize_instruct

from helpers import tiny_decoder_config


@pytest.fixture(scope="module")
def chat_model() -> tuple:
    tokenizer = train_tokenizer(["You answer briefly. Say hi. hello there"] * 4, "decoder", vocab_size=280)
    torch.manual_seed(0)
    return archlab.DecoderForCausalLM(tiny_decoder_config(vocab_size=len(tokenizer))), tokenizer


@pytest.mark.parametrize("fsdp", [False, True])
def test_no_sample_from_a_model_fsdp_sharded_and_one_line_says_how(fsdp, capsys):
    """Under FSDP each process's parameters are its shard: `finetune.py`'s example answer generated from them (only
    `pretrain.py` skipped its sample). Both scripts now go through this guard."""
    calls = []
    sample_unless_sharded(SimpleNamespace(is_fsdp_enabled=fsdp), "out/run", lambda: calls.append("sampled"))
    printed = capsys.readouterr().out
    if fsdp:
        assert calls == []
        assert "No sample under FSDP: `python scripts/generate.py --model_name_or_path out/run`" in printed
    else:
        assert calls == ["sampled"]
        assert printed == ""


def test_the_example_answer_is_to_the_conversation_before_its_first_answer(chat_model, capsys, monkeypatch):
    """A conversation opening with a system message: the example showed the system text as the user's turn, and
    the model answered the system message alone (`messages[:1]`)."""
    model, tokenizer = chat_model
    messages = [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": "Say hi."},
        {"role": "assistant", "content": "hello there"},
        {"role": "user", "content": "Say hi."},
    ]
    prompts = []
    generate = model.generate
    monkeypatch.setattr(model, "generate", lambda **kw: prompts.append(kw["input_ids"]) or generate(**kw))
    show_chat_example(model, tokenizer, {"messages": messages}, SimpleNamespace(messages_column="messages"))
    printed = capsys.readouterr().out
    assert "Example -- system: You answer briefly.\nuser: Say hi.\nassistant:\n" in printed
    expected = tokenizer.apply_chat_template(messages[:2], add_generation_prompt=True, return_tensors="pt")
    assert torch.equal(prompts[0], expected["input_ids"])


@pytest.mark.parametrize("max_new_tokens, generated", [(None, 64), (5, 5)])
def test_the_example_answer_is_up_to_max_new_tokens_long(max_new_tokens, generated, chat_model, monkeypatch):
    """`max_new_tokens` (finetune.py's --generation_max_length) was ignored: the answer was always up to 64 tokens."""
    model, tokenizer = chat_model
    lengths = []
    generate = model.generate
    monkeypatch.setattr(model, "generate", lambda **kw: lengths.append(kw["max_new_tokens"]) or generate(**kw))
    messages = [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "hello there"}]
    args = SimpleNamespace(messages_column="messages")
    show_chat_example(model, tokenizer, {"messages": messages}, args, max_new_tokens)
    assert lengths == [generated]


def test_the_example_shows_a_content_of_text_parts_as_its_text(chat_model, capsys):
    """A message whose content is a list of text parts (OpenAI's layout, which the template reads) was logged as
    the list's repr: `user: [{'type': 'text', 'text': 'Say hi.'}]`."""
    model, tokenizer = chat_model
    parts = [{"type": "text", "text": "Say "}, {"type": "text", "text": "hi."}]
    messages = [{"role": "user", "content": parts}, {"role": "assistant", "content": "hello there"}]
    show_chat_example(model, tokenizer, {"messages": messages}, SimpleNamespace(messages_column="messages"))
    assert "Example -- user: Say hi.\nassistant:\n" in capsys.readouterr().out


@pytest.mark.parametrize("saved", [None, 2, [2, 5], [2]])
def test_stop_ids_are_one_flat_list_with_the_end_of_a_turn_for_a_chat(chat_model, saved):
    """The generation config's eos (none: the tokenizer's; one id; a list) and, for a chat, `<|im_end|>` once: flat,
    as `generate` takes them (a list inside the list failed with "TypeError: not a sequence")."""
    model, tokenizer = chat_model
    model.generation_config.eos_token_id = saved
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert end == 5 and tokenizer.eos_token_id == 2
    assert stop_token_ids(model, tokenizer, chat=False) == ([2, 5] if saved == [2, 5] else [2])
    assert stop_token_ids(model, tokenizer, chat=True) == [2, 5]


LLAMA3_STYLE = (
    "{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] }}<|eot_id|>"
    "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


def test_the_end_of_a_turn_is_read_from_another_template(chat_model):
    """A Hub tokenizer's template closes a turn with its own token (Llama 3's `<|eot_id|>`): only archlab's
    `<|im_end|>` was looked for, so a chat model fine-tuned from one ran on past its answer."""
    model, archlab_tokenizer = chat_model
    tokenizer = train_tokenizer(["Say hi. hello there"] * 4, "decoder", vocab_size=280)
    tokenizer.chat_template = LLAMA3_STYLE
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert end_of_turn_id(tokenizer) == im_end  # the template's token is not in the vocabulary: archlab's, as before
    tokenizer.add_special_tokens(
        {"additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]}
    )
    eot = tokenizer.convert_tokens_to_ids("<|eot_id|>")
    assert end_of_turn_id(tokenizer) == eot
    assert end_of_turn_id(archlab_tokenizer) == archlab_tokenizer.convert_tokens_to_ids("<|im_end|>")
    model.generation_config.eos_token_id = 2
    assert stop_token_ids(model, tokenizer, chat=True) == [2, eot]
    stop_at_the_end_of_a_turn(model, tokenizer)
    assert model.generation_config.eos_token_id == [2, eot]
    tokenizer.chat_template = None
    assert end_of_turn_id(tokenizer) == im_end


def test_the_example_answer_is_prompted_with_the_rows_tools(chat_model, capsys, monkeypatch):
    """The prompt of the example answer left out the row's `tools`, which the model was trained with: the answer was
    to a conversation without the tools' schemas."""
    model, tokenizer = chat_model
    tool = {"type": "function", "function": {"name": "hi", "parameters": {"type": "object", "properties": {}}}}
    messages = [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "hello there"}]
    prompts = []
    generate = model.generate
    monkeypatch.setattr(model, "generate", lambda **kw: prompts.append(kw["input_ids"]) or generate(**kw))
    example = {"messages": messages, "tools": json.dumps([tool])}
    show_chat_example(model, tokenizer, example, SimpleNamespace(messages_column="messages"))
    expected = tokenizer.apply_chat_template(
        messages[:1], tools=[tool], add_generation_prompt=True, return_tensors="pt"
    )
    assert torch.equal(prompts[0], expected["input_ids"])


def test_prompts_of_a_tokenizer_without_a_pad_token_leave_it_without_one(chat_model) -> None:
    """Several prompts for a tokenizer without a pad token (GPT-2's) are padded with its eos token, and the caller's
    tokenizer is left as it was: `generate_texts` set its `pad_token` to eos, which then padded everything else the
    caller did with it. Each prompt's greedy text is its own."""
    model, trained = chat_model
    tokenizer = copy.deepcopy(trained)
    tokenizer.pad_token = None
    prompts = ["Say hi.", "You answer briefly. Say hi. hello"]
    settings = dict(seq2seq=False, stream=False, do_sample=False, max_new_tokens=4)
    texts = generate_texts(model, tokenizer, prompts, **settings)
    assert tokenizer.pad_token is None and tokenizer.pad_token_id is None
    assert texts == [generate_texts(model, tokenizer, [prompt], **settings)[0] for prompt in prompts]


NULLABLE_TOOL = {  # a schema with a null default; another row's schema of another layout makes `properties` Json
    "type": "function",
    "function": {
        "name": "weather",
        "parameters": {"type": "object", "properties": {"unit": {"type": ["string", "null"], "default": None}}},
    },
}
OTHER_TOOL = {
    "type": "function",
    "function": {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}},
}


def _calls(tool: dict, arguments: Any, opens_with_the_call: bool) -> dict[str, Any]:
    call = {"type": "function", "function": {"name": tool["function"]["name"], "arguments": arguments}}
    messages = [
        *([] if opens_with_the_call else [{"role": "user", "content": "Say hi."}]),
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "hi"},
        {"role": "assistant", "content": "hello there"},
    ]
    return {"messages": messages, "tools": [tool]}


@pytest.mark.parametrize("opens_with_the_call", [False, True])
def test_the_example_prompt_keeps_the_nulls_training_keeps(opens_with_the_call, chat_model, tmp_path, monkeypatch):
    """JSON lines whose rows differ in layout (a call's arguments an object in one row, a JSON string in another; a
    schema's property types) load as `datasets`' Json feature, and training renders each row as the file holds it,
    nulls included. The example's prompt, read without the split's features, left out every None entry: the
    schema's `"default": null` (and a call's `"unit": null`, where the conversation opens with the call), so the
    model was asked about a conversation it was not trained on."""
    model, tokenizer = chat_model
    rows = [
        _calls(NULLABLE_TOOL, {"unit": None}, opens_with_the_call),
        _calls(OTHER_TOOL, '{"a": 1}', opens_with_the_call=False),
    ]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    split = load_dataset("json", data_files=str(tmp_path / "rows.jsonl"), split="train")
    args = SimpleNamespace(messages_column="messages")
    trained = tokenizer.decode(
        tokenize_instruct(split, tokenizer, args, max_length=1024, num_proc=None)[0]["input_ids"]
    )
    prompts = []
    generate = model.generate
    monkeypatch.setattr(model, "generate", lambda **kw: prompts.append(kw["input_ids"]) or generate(**kw))
    show_chat_example(model, tokenizer, split[0], args, features=split.features)
    first = rows[0]["messages"][:1]  # the user's turn, or the call the conversation opens with
    expected = tokenizer.apply_chat_template(first, tools=rows[0]["tools"], add_generation_prompt=True)
    assert prompts[0][0].tolist() == expected["input_ids"]
    nulls = ['"default": null', *(['"unit": null'] if opens_with_the_call else [])]
    assert all(null in trained and null in tokenizer.decode(prompts[0][0]) for null in nulls)


@pytest.mark.parametrize("arguments", [{"unit": "C"}, '{"unit": null}'])
def test_the_example_of_a_conversation_opening_with_a_tool_call_logs_the_call(arguments, chat_model, capsys):
    """A conversation that opens with the assistant's tool call is prompted with that turn, whose content is None:
    the log showed `assistant: None`. The call is shown as name(arguments), an object as JSON, a string as given."""
    model, tokenizer = chat_model
    example = _calls(NULLABLE_TOOL, arguments, opens_with_the_call=True)
    show_chat_example(model, tokenizer, example, SimpleNamespace(messages_column="messages"), max_new_tokens=2)
    shown = '{"unit": "C"}' if isinstance(arguments, dict) else arguments
    assert f"Example -- assistant: weather({shown})\nassistant:\n" in capsys.readouterr().out


def test_a_message_with_text_and_tool_calls_shows_both() -> None:
    message = {
        "role": "assistant",
        "content": [{"type": "text", "text": "Checking."}],
        "tool_calls": [{"function": {"name": "f", "arguments": {"a": 1}}}, {"name": "g", "arguments": "{}"}],
    }
    assert shown_message(message) == 'Checking.; f({"a": 1}); g({})'
    assert shown_message({"role": "user", "content": "Say hi."}) == "Say hi."
