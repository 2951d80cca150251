"""scripts/finetune.py: instruction tuning (loss on responses only), classification (accuracy/F1), seq2seq on the
embedded code -> docstring task (BLEU/chrF/exact match), and its bad inputs."""

from __future__ import annotations

import ast
import json
import random
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from datasets import ClassLabel, Dataset, DatasetDict, Features, List, Value, load_dataset
from huggingface_hub import ModelCard
from transformers import (
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    AutoTokenizer,
    EvalPrediction,
    TrainerCallback,
    pipeline,
)

import archlab
from archlab.scripts import finetune
from archlab.tokenization.data import IGNORE_INDEX
from archlab.tokenization.training import load_tokenizer, save_tokenizer, train_tokenizer
from archlab.training import sources
from archlab.training.metrics import classification_metrics, entity_scores, text_metrics
from archlab.training.question_answering import squad_metrics, tokenize_question_answering
from archlab.training.task_data import (
    as_messages,
    check_classification_columns,
    check_pair_columns,
    classification_texts,
    glue_text_columns,
    instruct_texts,
    is_multi_label,
    label_maps,
    pair_texts,
    text_pair_column,
    tokenize_classification,
    tokenize_instruct,
    tokenize_seq2seq,
)
from archlab.training.token_classification import aligned_labels, tokenize_token_classification

from helpers import (
    TINY_DECODER_OVERRIDES,
    TINY_SEQ2SEQ,
    TINY_SEQ2SEQ_OVERRIDES,
    assert_close_to_scale,
    forbid,
    tiny_decoder_config,
)


def sentiment_rows(n: int, seed: int) -> list[dict[str, str]]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        positive = rng.random() < 0.5
        words = ["great", "lovely", "fine", "good"] if positive else ["bad", "awful", "poor", "sad"]
        rows.append({"text": " ".join(rng.choices(words, k=6)) + f" {i}", "label": "pos" if positive else "neg"})
    return rows


def instruction_rows(n: int) -> list[dict[str, str]]:
    return [{"prompt": f"Return {i} squared.", "response": f"def f():\n    return {i} ** 2"} for i in range(n)]


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny saved decoder with its tokenizer, plus data files."""
    folder = tmp_path_factory.mktemp("finetune")
    texts = [r["text"] for r in sentiment_rows(50, 0)] + [r["prompt"] + r["response"] for r in instruction_rows(50)]
    tokenizer = train_tokenizer(texts, "decoder", vocab_size=300, min_frequency=1)
    model = archlab.DecoderForCausalLM(tiny_decoder_config(vocab_size=len(tokenizer)))
    model.save_pretrained(folder / "base")
    save_tokenizer(tokenizer, folder / "base")
    Dataset.from_list(sentiment_rows(80, 1)).to_csv(folder / "train.csv")
    Dataset.from_list(sentiment_rows(40, 2)).to_csv(folder / "validation.csv")
    (folder / "instruct.jsonl").write_text("".join(json.dumps(r) + "\n" for r in instruction_rows(24)))
    return folder


def classification_args(out: Path, base: Path, train: Path, validation: Path, *extra: str) -> list[str]:
    """`run_args` of `--task classification` from the model at `base` on the two CSV files, blocks of 32 tokens."""
    files = ["--train_file", str(train), "--validation_file", str(validation)]
    return run_args(
        out, "--task", "classification", "--model_name_or_path", str(base), *files, "--block_size", "32", *extra
    )


def run_args(out: Path, *extra: str) -> list[str]:
    return [
        "--output_dir",
        str(out),
        "--max_steps",
        "10",
        "--per_device_train_batch_size",
        "8",
        "--per_device_eval_batch_size",
        "8",
        "--learning_rate",
        "3e-3",
        "--warmup_steps",
        "0",
        "--logging_steps",
        "2",
        "--eval_strategy",
        "no",
        "--save_steps",
        "5",
        "--disable_tqdm",
        "true",
        "--dataloader_pin_memory",
        "false",
        *extra,
    ]


def test_instruct_labels_cover_only_the_responses(work: Path) -> None:
    tokenizer = archlab.tokenization.training.load_tokenizer(work / "base")
    args = finetune.FinetuneArguments(prompt_column="prompt", response_column="response")
    dataset = as_messages(Dataset.from_list(instruction_rows(5)), args)
    encoded = tokenize_instruct(dataset, tokenizer, args, max_length=128, num_proc=None)
    for row, source in zip(encoded, instruction_rows(5)):
        trained = [t for t in row["labels"] if t != IGNORE_INDEX]
        assert tokenizer.decode(trained) == source["response"] + "<|im_end|>"
        assert len(row["labels"]) == len(row["input_ids"])


def test_instruct_reads_text_parts_as_their_text(work: Path) -> None:
    """A messages column of text parts ({"type": "text", "text": ...}) gives the labels of the same text as strings,
    and a new tokenizer is trained on that text (the lists of parts went to the tokenizer trainer)."""
    tokenizer = archlab.tokenization.training.load_tokenizer(work / "base")
    args = finetune.FinetuneArguments(prompt_column="prompt", response_column="response")
    strings = as_messages(Dataset.from_list(instruction_rows(3)), args)
    parts = Dataset.from_list(
        [
            {"messages": [{**m, "content": [{"type": "text", "text": m["content"]}]} for m in row]}
            for row in strings["messages"]
        ]
    )
    args = finetune.FinetuneArguments()
    assert as_messages(parts, args) is parts
    encoded = [tokenize_instruct(d, tokenizer, args, max_length=128, num_proc=None) for d in (strings, parts)]
    assert encoded[0]["labels"] == encoded[1]["labels"] and encoded[0]["input_ids"] == encoded[1]["input_ids"]
    assert list(instruct_texts(parts, args, "text")) == list(instruct_texts(strings, args, "text"))


def test_instruct_takes_generation_blocks_written_with_whitespace_control(work: Path) -> None:
    """`{%- generation -%}` marks the assistant's tokens for transformers and TRL as `{% generation %}` does: such a
    template was refused as having no markers."""
    tokenizer = archlab.tokenization.training.load_tokenizer(work / "base")
    args = finetune.FinetuneArguments(prompt_column="prompt", response_column="response")
    dataset = as_messages(Dataset.from_list(instruction_rows(3)), args)
    plain = tokenize_instruct(dataset, tokenizer, args, max_length=128, num_proc=None)
    tokenizer.chat_template = tokenizer.chat_template.replace("{% generation %}", "{%- generation -%}")
    assert tokenize_instruct(dataset, tokenizer, args, max_length=128, num_proc=None)["labels"] == plain["labels"]


def test_instruct_conversations_that_all_lose_their_answer_are_named(work: Path) -> None:
    """Cut before every answer, the split was "empty" with no reason given."""
    tokenizer = archlab.tokenization.training.load_tokenizer(work / "base")
    args = finetune.FinetuneArguments(prompt_column="prompt", response_column="response")
    dataset = as_messages(Dataset.from_list(instruction_rows(3)), args)
    with pytest.raises(ValueError, match="Every one of the 3 conversations loses its answer when cut to 4 tokens"):
        tokenize_instruct(dataset, tokenizer, args, max_length=4, num_proc=None)


def test_instruct_conversations_that_lose_their_answer_are_counted_as_they_are_left_out(work: Path, capsys) -> None:
    """Conversations cut before their answer (longer than --block_size) were dropped, from the validation split as
    well, without a word."""
    tokenizer = archlab.tokenization.training.load_tokenizer(work / "base")
    args = finetune.FinetuneArguments(prompt_column="prompt", response_column="response")
    rows = [*instruction_rows(2), {"prompt": "Return 7 squared. " * 20, "response": "49"}]
    encoded = tokenize_instruct(as_messages(Dataset.from_list(rows), args), tokenizer, args, 64, num_proc=None)
    assert len(encoded) == 2
    assert "1 of 3 conversations lose their answer when cut to 64 tokens" in capsys.readouterr().out


WEATHER = {
    "type": "function",
    "function": {"name": "weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
}
ADD = {
    "type": "function",
    "function": {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}},
}


def tool_rows(arguments: tuple[Any, Any] = ({"city": "Paris"}, {"a": 1})) -> list[dict[str, Any]]:
    """Two conversations that call a tool (OpenAI's layout: no content beside the call) with its own tools, and one
    without tools."""

    def row(tool: dict, args: Any, answer: str) -> dict[str, Any]:
        call = {"type": "function", "function": {"name": tool["function"]["name"], "arguments": args}}
        messages = [
            {"role": "user", "content": "Go."},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "content": answer},
            {"role": "assistant", "content": "Done."},
        ]
        return {"messages": messages, "tools": [tool]}

    plain = {"messages": [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Yo."}], "tools": []}
    return [row(WEATHER, arguments[0], "sunny"), row(ADD, arguments[1], "3"), plain]


def test_instruct_trains_tool_calls_with_each_rows_tools(work: Path, tmp_path: Path) -> None:
    """Conversations with tool calls were refused (a call's `content` None), and the `tools` column TRL reads was
    never given to the chat template: each row's tools now open its conversation, its calls are trained on, the
    tools' schemas and the tools' answers are not (as TRL's SFTTrainer with `assistant_only_loss=True`)."""
    tokenizer = load_tokenizer(work / "base")
    (tmp_path / "tools.jsonl").write_text("".join(json.dumps(r) + "\n" for r in tool_rows()))
    dataset = load_dataset("json", data_files=str(tmp_path / "tools.jsonl"), split="train")
    args = finetune.FinetuneArguments()
    encoded = tokenize_instruct(as_messages(dataset, args), tokenizer, args, max_length=2048, num_proc=None)
    texts = [tokenizer.decode(row["input_ids"]) for row in encoded]
    trained = [tokenizer.decode([t for t in row["labels"] if t != IGNORE_INDEX]) for row in encoded]
    assert f"<tools>\n{json.dumps(WEATHER)}\n</tools>" in texts[0] and "add" not in texts[0]
    assert f"<tools>\n{json.dumps(ADD)}\n</tools>" in texts[1] and "<tools>" not in texts[2]
    call = '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'
    assert trained[0] == call + "Done.<|im_end|>"
    assert (
        trained[1].startswith('<tool_call>\n{"name": "add", "arguments": {"a": 1}}') and trained[2] == "Yo.<|im_end|>"
    )
    assert any("weather" in text for text in instruct_texts(dataset, args, "text"))  # a new tokenizer sees the calls


def test_instruct_leaves_out_the_keys_arrow_adds_to_tool_calls_and_tools(work: Path) -> None:
    """Arrow stores a column of dicts as one struct of all rows' keys: `Dataset.from_list` (a Parquet data set) gave
    the `add` call `{"city": null, "a": 1}` and its schema a `city` property of null, trained as they stood. Arguments
    as JSON strings (OpenAI's layout) are written as they are."""
    tokenizer = load_tokenizer(work / "base")
    args = finetune.FinetuneArguments()
    for arguments in [({"city": "Paris"}, {"a": 1}), ('{"city": "Paris"}', '{"a": 1}')]:
        dataset = Dataset.from_list(tool_rows(arguments))
        encoded = tokenize_instruct(as_messages(dataset, args), tokenizer, args, max_length=2048, num_proc=None)
        text = tokenizer.decode(encoded[1]["input_ids"])
        assert "null" not in text and '{"name": "add", "arguments": {"a": 1}}' in text
        assert json.dumps(ADD) in text


def test_instruct_renders_json_lines_with_mixed_arguments_as_each_row_alone(work: Path, tmp_path: Path) -> None:
    """JSON lines whose tool-call arguments are an object in one row and a JSON string in another load as `datasets`'
    Json feature, no struct merged from the rows: a null argument there is the row's own, and was dropped from the
    object (`{"city": "Paris"}` trained where the row says `{"city": "Paris", "unit": null}`) but kept in the string."""
    tokenizer = load_tokenizer(work / "base")
    rows = tool_rows(({"city": "Paris", "unit": None}, '{"a": 1, "b": null}'))
    (tmp_path / "mixed.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    dataset = load_dataset("json", data_files=str(tmp_path / "mixed.jsonl"), split="train")
    args = finetune.FinetuneArguments()
    encoded = tokenize_instruct(as_messages(dataset, args), tokenizer, args, max_length=2048, num_proc=None)
    for row, source in zip(encoded, rows):
        alone = tokenizer.apply_chat_template(source["messages"], tools=source["tools"] or None, return_dict=True)
        assert row["input_ids"] == alone["input_ids"]
    assert '"arguments": {"city": "Paris", "unit": null}' in tokenizer.decode(encoded[0]["input_ids"])


def test_instruct_example_is_prompted_with_the_nulls_training_keeps(work: Path, tmp_path: Path, monkeypatch) -> None:
    """The example answer after training is prompted with the validation split's features: read without them, every
    None entry was left out of its tools, so a schema's `"default": null` that training keeps (its `properties` load
    as the Json feature, the rows' schemas differing in layout) was missing from the prompt."""
    tokenizer = load_tokenizer(work / "base")
    config = tiny_decoder_config(vocab_size=len(tokenizer), max_position_embeddings=1024)  # (the tools' turn is long)
    archlab.DecoderForCausalLM(config).save_pretrained(tmp_path / "base")
    save_tokenizer(tokenizer, tmp_path / "base")
    rows = tool_rows(({"city": "Paris"}, '{"a": 1}'))
    nullable = {"type": ["string", "null"], "default": None}
    rows[0]["tools"][0]["function"]["parameters"]["properties"]["unit"] = nullable
    (tmp_path / "tools.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    prompts = []
    generate = archlab.DecoderForCausalLM.generate
    monkeypatch.setattr(
        archlab.DecoderForCausalLM,
        "generate",
        lambda self, **kw: prompts.append(kw["input_ids"]) or generate(self, **kw),
    )
    data = ["--train_file", str(tmp_path / "tools.jsonl"), "--validation_file", str(tmp_path / "tools.jsonl")]
    base = ["--model_name_or_path", str(tmp_path / "base"), "--save_strategy", "no"]
    finetune.main(run_args(tmp_path / "chat", "--task", "instruct", *base, *data))
    assert len(prompts) == 1 and '"unit": {"type": ["string", "null"], "default": null}' in tokenizer.decode(
        prompts[0][0]
    )


@pytest.mark.parametrize(
    "call, message",
    [
        ({"function": {"arguments": {}}}, r"row 0 has a tool call .* without a name"),
        ({"function": {"name": "f", "arguments": "{'a': 1}"}}, r"tool call of 'f' whose arguments .* are not JSON"),
        ({"function": {"name": "f", "arguments": 3}}, r"tool call of 'f' whose arguments are 3: an object or a JSON"),
    ],
)
def test_tool_calls_without_a_name_or_json_arguments_are_named(call, message) -> None:
    """A call without a name failed inside the chat template's `datasets.map`; arguments as a Python repr were
    trained as they stood, a call no parser reads back."""
    messages = [{"role": "user", "content": "Go."}, {"role": "assistant", "content": None, "tool_calls": [call]}]
    with pytest.raises(ValueError, match=message):
        as_messages(Dataset.from_list([{"messages": messages}]), finetune.FinetuneArguments())


def test_instruct_end_to_end(tmp_path: Path, work: Path, capsys) -> None:
    data = str(work / "instruct.jsonl")
    metrics = finetune.main(
        run_args(
            tmp_path / "chat",
            "--task",
            "instruct",
            "--model_name_or_path",
            str(work / "base"),
            "--train_file",
            data,
            "--validation_file",
            data,
            "--prompt_column",
            "prompt",
            "--response_column",
            "response",
        )
    )
    assert metrics["eval_loss"] < metrics["before_eval_loss"]
    assert (tmp_path / "chat" / "model.safetensors").exists() and (tmp_path / "chat" / "loss_curve.png").exists()
    assert "[archlab] Example -- user:" in capsys.readouterr().out  # the answer to a validation prompt, after the save
    # generate and the text-generation pipeline stop at the end of the assistant's turn, as Hub chat models do
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "chat")
    for folder in ("", "checkpoint-5"):  # a checkpoint as well: it stopped at eos only
        saved = json.loads((tmp_path / "chat" / folder / "generation_config.json").read_text())["eos_token_id"]
        assert saved == [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")]


def test_classification_end_to_end(tmp_path: Path, work: Path) -> None:
    out = tmp_path / "cls"
    metrics = finetune.main(classification_args(out, work / "base", work / "train.csv", work / "validation.csv"))
    assert metrics["eval_accuracy"] >= 0.9 and metrics["eval_f1"] >= 0.9
    assert metrics["before_eval_accuracy"] < 0.9
    model = AutoModelForSequenceClassification.from_pretrained(out)
    assert model.config.id2label == {0: "neg", 1: "pos"}


class WeightDtypes(TrainerCallback):
    """The dtypes of the weights the Trainer updates, seen at each step."""

    def __init__(self) -> None:
        self.seen: set[torch.dtype] = set()

    def on_step_end(self, args, state, control, model=None, **kwargs) -> None:
        self.seen |= {p.dtype for p in model.parameters()}


def test_dtype_chooses_the_weights_trained_float32_by_default(tmp_path: Path, work: Path, capsys) -> None:
    """A base folder saved in bfloat16 (as Hub checkpoints are): transformers 5 loads the saved dtype unless told, and
    the script trained its bfloat16 weights as they were (pure bfloat16) where its help said float32; unset, --dtype
    is float32, and --dtype bfloat16 / auto train the bfloat16 weights, said so in the log."""
    base = tmp_path / "bf16"
    archlab.DecoderForCausalLM.from_pretrained(work / "base").to(torch.bfloat16).save_pretrained(base)
    save_tokenizer(load_tokenizer(work / "base"), base)
    data = (work / "train.csv", work / "validation.csv")
    for flags, expected in (([], torch.float32), (["--torch_dtype", "bfloat16"], torch.bfloat16)):
        dtypes = WeightDtypes()
        out = tmp_path / f"out-{expected}"
        finetune.main(classification_args(out, base, *data, "--max_steps", "2", *flags), callbacks=[dtypes])
        assert dtypes.seen == {expected}
        saved = AutoModelForSequenceClassification.from_pretrained(out, dtype="auto")
        assert {p.dtype for p in saved.parameters()} == {expected}
        log = capsys.readouterr().out
        assert ("bfloat16 weights, eager" in log) is (expected == torch.bfloat16), log
        assert ("Warning: --dtype bfloat16 trains bfloat16 weights" in log) is (expected == torch.bfloat16)
        card = (out / "README.md").read_text()  # the card says so too (float32's is unchanged)
        assert ("**Weights:** trained in bfloat16 (pure bfloat16" in card) is (expected == torch.bfloat16)


def test_a_resume_in_another_dtype_is_refused_before_anything_is_read(
    tmp_path: Path, work: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run of bfloat16 weights resumed without --dtype (float32) went on without a word: the checkpoint's weights
    and optimizer state were cast to float32 for the rest of the run. The checkpoint records the weights' dtype, and
    --dtype auto on the same bfloat16 folder is the same dtype and trains on."""
    base = tmp_path / "bf16"
    archlab.DecoderForCausalLM.from_pretrained(work / "base").to(torch.bfloat16).save_pretrained(base)
    save_tokenizer(load_tokenizer(work / "base"), base)
    out, data = tmp_path / "out", (work / "train.csv", work / "validation.csv")
    finetune.main(classification_args(out, base, *data, "--max_steps", "1", "--save_steps", "1", "--dtype", "bfloat16"))
    assert json.loads((out / "checkpoint-1" / "run_facts.json").read_text())["weights_dtype"] == "bfloat16"
    resume = ["--max_steps", "2", "--save_steps", "1", "--resume_from_checkpoint", "true"]
    with monkeypatch.context() as patched:
        forbid(patched, sources, "load_raw_datasets", "data was loaded before the checkpoint was compared")
        with pytest.raises(ValueError, match=r"--dtype \(the weights' dtype\) = 'bfloat16', but these flags give "):
            finetune.main(classification_args(out, base, *data, *resume))
    finetune.main(classification_args(out, base, *data, *resume, "--torch_dtype", "auto"))
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == 2


def test_a_dtype_that_cannot_train_is_refused_before_anything_is_read(tmp_path: Path, work: Path) -> None:
    """float16 weights (asked, or a folder saved in float16 under auto): --fp16's gradient scaler refuses their
    gradients at the first step and nothing else scales them; --dtype without a folder to load would be ignored."""
    half = tmp_path / "fp16"
    archlab.DecoderForCausalLM.from_pretrained(work / "base").to(torch.float16).save_pretrained(half)
    save_tokenizer(load_tokenizer(work / "base"), half)
    out, data = tmp_path / "out", (work / "train.csv", work / "validation.csv")
    with pytest.raises(ValueError, match="--dtype float16 would train float16 weights: --fp16's loss scaling refuses"):
        finetune.main(classification_args(out, work / "base", *data, "--dtype", "float16"))
    with pytest.raises(ValueError, match=r"--dtype auto \(.* was saved in float16\) would train float16 weights"):
        finetune.main(classification_args(out, half, *data, "--dtype", "auto"))
    with pytest.raises(ValueError, match="--dtype bfloat16: it sets the dtype a saved --model_name_or_path loads in"):
        finetune.main(run_args(out, "--task", "classification", "--dtype", "bfloat16"))
    assert not out.exists()


@pytest.mark.slow
def test_seq2seq_on_the_embedded_docstring_task(tmp_path: Path) -> None:
    """... with a T5-style --source_prefix, and a --test_file of sources without targets predicted after training
    (generated_predictions.txt, one line per source, as run_translation.py writes it)."""
    sources = ["def add(a, b):\n    return a + b", "def neg(x):\n    return -x", "def one():\n    return 1"]
    Dataset.from_list([{"code": code} for code in sources]).to_json(tmp_path / "test.jsonl")
    metrics = finetune.main(
        run_args(
            tmp_path / "docstrings",
            "--task",
            "seq2seq",
            "--max_train_samples",
            "64",
            "--max_eval_samples",
            "8",
            "--tokenizer_vocab_size",
            "400",
            "--config_overrides",
            TINY_SEQ2SEQ_OVERRIDES,
            "--generation_max_length",
            "8",
            "--max_steps",
            "4",
            "--source_prefix",
            "summarize: ",
            "--test_file",
            str(tmp_path / "test.jsonl"),
        )
    )
    for key in ("eval_bleu", "eval_chrf", "eval_exact_match", "before_eval_chrf"):
        assert 0.0 <= metrics[key] <= 100.0
    assert len((tmp_path / "docstrings" / "generated_predictions.txt").read_text().split("\n")) == len(sources) + 1
    assert "predict_bleu" not in metrics  # no targets to score
    assert json.loads((tmp_path / "docstrings" / "config.json").read_text())["model_type"] == "archlab_seq2seq"
    # evaluation by generation leaves the saved generation config as the model had it: no stray max_length=20
    saved = json.loads((tmp_path / "docstrings" / "generation_config.json").read_text())
    assert "max_length" not in saved and "num_beams" not in saved, saved
    # code -> first docstring sentence is a summarisation task, and the card says so
    assert ModelCard.load(tmp_path / "docstrings" / "README.md").data.pipeline_tag == "summarization"
    # the prefix is saved where T5 keeps its own (checkpoints too), and the card's snippet puts it before its source
    for folder in ("", "checkpoint-4"):
        config = json.loads((tmp_path / "docstrings" / folder / "config.json").read_text())
        assert config["task_specific_params"] == {"summarization": {"prefix": "summarize: "}}
    facts = json.loads((tmp_path / "docstrings" / "checkpoint-4" / "run_facts.json").read_text())
    assert facts["source_prefix"] and facts["columns"] == {"--source_column": "code", "--target_column": "docstring"}
    card = (tmp_path / "docstrings" / "README.md").read_text()
    assert "tokenizer(prefix + 'def fibonacci(n):'" in card


def test_metrics() -> None:
    logits = np.array([[2.0, 0.0], [0.0, 1.0], [3.0, 1.0], [0.0, 5.0]])
    result = classification_metrics(EvalPrediction(predictions=logits, label_ids=np.array([0, 1, 1, 1])))
    # class 0: P=1/2, R=1 -> F1 2/3; class 1: P=1, R=2/3 -> F1 4/5
    assert result["accuracy"] == 0.75 and result["f1"] == pytest.approx((2 / 3 + 4 / 5) / 2)
    same = text_metrics(["Return the sum of a and b."], ["Return the  sum of a and b."])
    assert same == {"bleu": pytest.approx(100.0), "chrf": pytest.approx(100.0), "exact_match": 100.0}
    assert text_metrics(["zzz"], ["Return the sum."])["exact_match"] == 0.0
    # a regression head (one output): mean squared error and Pearson's r
    scores = classification_metrics(
        EvalPrediction(predictions=np.array([[1.0], [2.0], [4.0]]), label_ids=np.array([1.0, 3.0, 5.0]))
    )
    assert scores == {"mse": pytest.approx(2 / 3), "pearson": pytest.approx(np.corrcoef([1, 2, 4], [1, 3, 5])[0, 1])}


def test_bad_inputs(tmp_path: Path, work: Path) -> None:
    out = tmp_path / "bad"
    base = ["--model_name_or_path", str(work / "base")]
    with pytest.raises(ValueError, match="classification needs --train_file"):
        finetune.main(run_args(out, "--task", "classification", *base))
    with pytest.raises(ValueError, match="allowed values: instruct, classification, seq2seq"):
        finetune.main(run_args(out, "--task", "translation", *base))
    with pytest.raises(ValueError, match="Column 'category' not found.*: name the column with --label_column_name"):
        finetune.main(
            run_args(
                out,
                "--task",
                "classification",
                *base,
                "--train_file",
                str(work / "train.csv"),
                "--label_column_name",
                "category",
            )
        )
    with pytest.raises(ValueError, match="Conflicting flags: --task seq2seq trains a seq2seq, not --model_kind"):
        finetune.main(run_args(out, "--task", "seq2seq", "--model_kind", "masked_lm"))
    with pytest.raises(ValueError, match="only --task seq2seq chooses its card's task, one of translation, summar"):
        finetune.main(run_args(out, "--task", "instruct", *base, "--pipeline_tag", "summarization"))
    # (a misspelled tag under --task seq2seq was told "only --task seq2seq chooses its card's task")
    with pytest.raises(
        ValueError, match="`--pipeline_tag`='translaton' is not supported; allowed values: translation, summarization"
    ):
        finetune.main(run_args(out, "--task", "seq2seq", "--pipeline_tag", "translaton"))
    with pytest.raises(ValueError, match="`--pipeline_tag`='text-generation' is not supported"):
        finetune.main(run_args(out, "--task", "seq2seq", "--pipeline_tag", "text-generation"))
    with pytest.raises(ValueError, match="--prompt_column and --response_column go together"):
        finetune.main(
            run_args(
                out,
                "--task",
                "instruct",
                *base,
                "--train_file",
                str(work / "instruct.jsonl"),
                "--prompt_column",
                "prompt",
            )
        )
    with pytest.raises(ValueError, match="--max_source_length must be >= 1"):
        finetune.main(run_args(out, "--task", "seq2seq", "--max_source_length", "-3"))
    with pytest.raises(ValueError, match="--max_target_length must be >= 1"):
        finetune.main(run_args(out, "--task", "seq2seq", "--max_target_length", "0"))
    with pytest.raises(ValueError, match="--learning_rate must be > 0, got -1.0"):
        finetune.main(run_args(out, "--task", "instruct", *base, "--learning_rate", "-1"))
    with pytest.raises(ValueError, match="--per_device_train_batch_size must be >= 1, got 0"):
        finetune.main(run_args(out, "--task", "instruct", *base, "--per_device_train_batch_size", "0"))
    train = ["--train_file", str(work / "train.csv")]
    with pytest.raises(ValueError, match="--do_predict predicts a test split: pass --test_file"):
        finetune.main(run_args(out, "--task", "classification", *base, *train, "--do_predict", "true"))
    with pytest.raises(ValueError, match="--task instruct has no test predictions"):
        finetune.main(run_args(out, "--task", "instruct", *base, "--test_file", str(work / "instruct.jsonl")))
    with pytest.raises(FileNotFoundError, match="Data file 'nowhere.csv' does not exist"):
        finetune.main(run_args(out, "--task", "classification", *base, *train, "--test_file", "nowhere.csv"))
    with pytest.raises(ValueError, match="--max_predict_samples limits the test split: pass it with --test_file"):
        finetune.main(run_args(out, "--task", "classification", *base, *train, "--max_predict_samples", "3"))
    with pytest.raises(ValueError, match="--source_prefix is for --task seq2seq"):
        finetune.main(run_args(out, "--task", "classification", *base, *train, "--source_prefix", "classify: "))
    with pytest.raises(ValueError, match="--do_predict with --task seq2seq writes generated texts: leave --predict_"):
        finetune.main(
            run_args(out, "--task", "seq2seq", "--test_file", str(work / "train.csv"), "--predict_with_generate", "0")
        )
    assert not out.exists()


def test_a_resume_that_would_skip_other_data_or_read_other_token_ids_is_refused_first(
    tmp_path: Path, work: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both resumed without a word: another batch size skipped examples never trained (a warning in the log only),
    another base model's tokenizer trained the checkpoint on other token ids."""
    checkpoint = tmp_path / "out" / "checkpoint-5"
    checkpoint.mkdir(parents=True)
    (checkpoint / "trainer_state.json").write_text(json.dumps({"global_step": 5}))
    (checkpoint / "run_facts.json").write_text(json.dumps({"examples_per_step": 8}))
    save_tokenizer(AutoTokenizer.from_pretrained(work / "base"), checkpoint)
    forbid(monkeypatch, sources, "load_raw_datasets", "data was loaded before the checkpoint was compared")
    args = run_args(tmp_path / "out", "--task", "classification", "--model_name_or_path", str(work / "base"))
    args += ["--train_file", str(work / "train.csv"), "--resume_from_checkpoint", "true"]
    with pytest.raises(ValueError, match="x processes = 8, but these flags give 4: the resumed run would skip"):
        finetune.main(args + ["--per_device_train_batch_size", "4"])
    other = tmp_path / "other"
    texts = [row["text"].upper() for row in sentiment_rows(50, 0)]
    save_tokenizer(train_tokenizer(texts, "decoder", vocab_size=300, min_frequency=1), other)
    (checkpoint / "tokenizer.json").unlink()
    save_tokenizer(load_tokenizer(other), checkpoint)
    with pytest.raises(
        ValueError, match="checkpoint-5 was trained with another tokenizer: \\d+ of the \\d+ tokens of --m"
    ):
        finetune.main(args)


def test_predicting_after_a_finished_run_is_refused_not_skipped(
    tmp_path: Path, work: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A resumed run that is already finished returned its saved results: --test_file was skipped without a word."""
    out = tmp_path / "out"
    checkpoint = out / "checkpoint-10"
    checkpoint.mkdir(parents=True)
    for folder in (checkpoint, out):
        (folder / "trainer_state.json").write_text(json.dumps({"global_step": 10}))
    (checkpoint / "run_facts.json").write_text(json.dumps({"examples_per_step": 8}))
    (out / "config.json").write_text("{}")
    save_tokenizer(AutoTokenizer.from_pretrained(work / "base"), checkpoint)
    forbid(monkeypatch, sources, "load_raw_datasets", "data was loaded for a finished run")
    args = classification_args(out, work / "base", work / "train.csv", work / "validation.csv")
    args += ["--resume_from_checkpoint", "true"]
    assert finetune.main(args) == {}  # finished: nothing to do
    with pytest.raises(ValueError, match="the run in .* is finished and saved, and the test split is predicted after"):
        finetune.main([*args, "--test_file", str(work / "validation.csv")])


def test_a_damaged_base_model_is_named_before_anything_is_read(tmp_path: Path, work: Path) -> None:
    import shutil

    base = tmp_path / "base"
    shutil.copytree(work / "base", base)
    (base / "model.safetensors").write_bytes(b"")
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=f"--model_name_or_path '{base}': {base / 'model.safetensors'} is damaged"):
        finetune.main(run_args(out, "--task", "instruct", "--model_name_or_path", str(base)))
    assert not out.exists()


def test_a_base_model_of_the_wrong_kind_is_named_before_anything_is_read(tmp_path: Path, work: Path) -> None:
    """A decoder folder given to --task seq2seq (and an encoder-decoder to the decoder tasks) is one error naming the
    folder's model type and the flag, not transformers' list of every config class after the data is tokenized."""
    seq2seq = tmp_path / "seq2seq"
    archlab.Seq2SeqForConditionalGeneration(archlab.Seq2SeqConfig(**TINY_SEQ2SEQ)).save_pretrained(seq2seq)
    out = tmp_path / "out"
    decoder = r"of type `archlab_decoder` \(DecoderConfig, saved as DecoderForCausalLM\), which --task seq2seq"
    with pytest.raises(ValueError, match=decoder):
        finetune.main(run_args(out, "--task", "seq2seq", "--model_name_or_path", str(work / "base")))
    for task, auto in (("instruct", "AutoModelForCausalLM"), ("classification", "AutoModelForSequenceClassification")):
        with pytest.raises(ValueError, match=f"of type `archlab_seq2seq` .*--task {task} cannot train: .*{auto}"):
            finetune.main(run_args(out, "--task", task, "--model_name_or_path", str(seq2seq)))
    assert not out.exists()


def test_a_masked_lm_given_to_instruct_is_named_as_one(tmp_path: Path) -> None:
    """A masked LM's folder given to --task instruct was "a `archlab_seq2seq` model", which AutoModelForCausalLM
    was said to build as "a masked LM's encoder" (the note of the encoder heads): the folder's class is named, and
    the note is left to the tasks whose heads take an encoder."""
    mlm = tmp_path / "mlm"
    archlab.EncoderForMaskedLM(archlab.Seq2SeqConfig(**TINY_SEQ2SEQ)).save_pretrained(mlm)
    out = tmp_path / "out"
    with pytest.raises(
        ValueError, match=r"\(Seq2SeqConfig, saved as EncoderForMaskedLM\), which --task instruct"
    ) as error:
        finetune.main(run_args(out, "--task", "instruct", "--model_name_or_path", str(mlm)))
    assert "a masked LM's encoder" not in str(error.value)
    assert not out.exists()


def test_each_task_has_its_own_default_output_dir() -> None:
    """Fine-tuning a second task without --output_dir does not meet the first task's checkpoints (refused)."""
    tasks = ("instruct", "classification", "seq2seq", "question-answering")
    folders = {task: finetune.parse(["--task", task])[2].output_dir for task in tasks}
    assert folders == {task: f"runs/finetune-{task}" for task in folders}
    assert finetune.parse(["--task", "seq2seq", "--output_dir", "mine"])[2].output_dir == "mine"


def test_the_task_table_has_one_row_per_task_choice() -> None:
    """`--task` takes exactly the rows of the task table, and each row names a model kind the scripts build and
    reports every metric it computes in its before/after lines."""
    import dataclasses

    from archlab.training.kinds import MODEL_KINDS
    from archlab.training.tasks import TASKS

    task_flag = next(f for f in dataclasses.fields(finetune.FinetuneArguments) if f.name == "task")
    assert task_flag.metadata["help"].split(" | ") == list(TASKS)
    assert list(TASKS) == ["instruct", "classification", "seq2seq", "token-classification", "question-answering"]
    assert task_flag.default in TASKS
    assert {name: task.model_kind for name, task in TASKS.items()} == {
        "instruct": "decoder",
        "classification": "decoder",
        "seq2seq": "seq2seq",
        "token-classification": "decoder",
        "question-answering": "decoder",
    }
    assert all(task.model_kind in MODEL_KINDS for task in TASKS.values())

    logits = np.array([[2.0, 0.0], [0.0, 1.0]])
    computed = {
        "instruct": TASKS["instruct"].view({"eval_loss": 1.0}),
        "classification": {
            "eval_loss": 1.0,
            **{
                f"eval_{k}": v
                for predictions, labels in ((logits, np.array([0, 1])), (logits[:, :1], np.array([0.5, 1.5])))
                for k, v in TASKS["classification"]
                .compute_metrics(None, None)(EvalPrediction(predictions=predictions, label_ids=labels))
                .items()
            },
        },
        "seq2seq": {"eval_loss": 1.0, **{f"eval_{k}": v for k, v in text_metrics(["a b"], ["a b"]).items()}},
        "token-classification": {
            "eval_loss": 1.0,
            **{f"eval_{k}": v for k, v in entity_scores([["B-PER", "O"]], [["B-PER", "O"]]).items()},
        },
        "question-answering": {
            "eval_loss": 1.0,
            **{f"eval_{k}": v for k, v in squad_metrics({}, {"a": ["b"]}).items()},
        },
    }
    for name, metrics in computed.items():
        assert set(TASKS[name].summary_keys) == set(metrics), name


def test_the_help_counts_and_lists_every_task_and_prints_its_commands_as_typed() -> None:
    """`--help` prints the module docstring: it said "one of four tasks" over five, and its two-line commands were
    joined into one with a run of spaces (a backslash-newline in a plain string is a line continuation)."""
    from archlab.training.tasks import TASKS

    doc = finetune.__doc__
    count = {4: "four", 5: "five", 6: "six", 7: "seven"}[len(TASKS)]
    assert f"for one of {count} tasks (`--task`)" in doc
    assert [line.split("`")[1] for line in doc.splitlines() if line.startswith("- `")] == list(TASKS)
    assert not re.search(r"\S {4,}--", doc)
    assert doc.count("\\\n          --") == 2


def test_the_evaluation_generates_up_to_max_target_length() -> None:
    """--max_target_length 96 trained 96-token targets while the evaluation generated 48 (a fixed default), scoring
    every longer target as cut; unset, --generation_max_length follows --max_target_length, as in run_translation."""
    parsed = finetune.parse(["--task", "seq2seq", "--max_target_length", "96"])[2]
    assert parsed.generation_max_length == 96
    assert finetune.parse(["--task", "seq2seq"])[2].generation_max_length == 48
    given = ["--task", "seq2seq", "--max_target_length", "96", "--generation_max_length", "20"]
    assert finetune.parse(given)[2].generation_max_length == 20


def test_the_instruct_example_answer_is_as_long_as_generation_max_length(
    tmp_path: Path, work: Path, monkeypatch
) -> None:
    """finetune.py passed --generation_max_length to the example answer after training, which generated 64 tokens
    whatever it said; unset, instruct's stays unset (--max_target_length is seq2seq's) and the answer is 64 long."""
    lengths = []
    generate = archlab.DecoderForCausalLM.generate
    monkeypatch.setattr(
        archlab.DecoderForCausalLM,
        "generate",
        lambda self, **kw: lengths.append(kw["max_new_tokens"]) or generate(self, **kw),
    )
    data = ["--train_file", str(work / "instruct.jsonl"), "--validation_file", str(work / "instruct.jsonl")]
    columns = ["--prompt_column", "prompt", "--response_column", "response"]
    base = ["--model_name_or_path", str(work / "base"), "--save_strategy", "no", "--max_steps", "1", *data, *columns]
    finetune.main(run_args(tmp_path / "chat", "--task", "instruct", *base, "--generation_max_length", "5"))
    assert lengths == [5]
    assert finetune.parse(["--task", "instruct"])[2].generation_max_length is None


def test_seq2seq_lengths_past_the_position_table_fail_before_training(tmp_path: Path) -> None:
    """A sinusoidal encoder-decoder of 64 positions and --max_source_length 256 (the default): one error naming the
    flag and the limit, before any training step (it would fail inside the first forward otherwise)."""
    args = run_args(tmp_path / "run", "--task", "seq2seq", "--max_train_samples", "16", "--max_eval_samples", "4")
    args += ["--config_overrides", TINY_SEQ2SEQ_OVERRIDES + ",max_position_embeddings=64", "--tokenizer_vocab_size"]
    with pytest.raises(ValueError, match=r"--max_source_length 256 is more than the model's 64 positions"):
        finetune.main([*args, "400"])
    assert not (tmp_path / "run" / "checkpoint-5").exists()


def test_a_missing_chat_column_is_named_with_its_split() -> None:
    args = finetune.FinetuneArguments(prompt_column="prompt", response_column="answer")
    with pytest.raises(ValueError, match=r"Column 'answer' not found in the validation split.*--response_column\."):
        as_messages(Dataset.from_list(instruction_rows(2)), args, "validation")


def test_a_missing_default_column_names_the_flag_that_names_it() -> None:
    """The code -> docstring task's default columns ('code', 'docstring') on the user's own pairs: the error named a
    column the user never gave, and not the flag to change it."""
    pairs = Dataset.from_list([{"en": "one", "fr": "un"}])
    with pytest.raises(
        ValueError, match=r"Column 'code' not found .*\['en', 'fr'\]: name the column with --source_col"
    ):
        check_pair_columns(pairs, "train", finetune.FinetuneArguments(), "text")


@pytest.mark.parametrize(
    "conversation, message",
    [
        ("hello", r"Column 'messages' of the train split holds str in row 0, not a conversation"),
        ([{"user": "hi"}, {"assistant": "yo"}], r"row 0 has a message \{'user': 'hi'.*\} without a \"role\""),
        ([{"role": "user", "content": "hi"}], r"no assistant message in any of its 3 conversations"),
        ([{"role": "assistant", "content": None}], r"row 0 has a message whose content is None; .* list of text"),
        (
            [
                {"role": "user", "content": [{"type": "image", "text": None}]},
                {"role": "assistant", "content": [{"type": "text", "text": "yo"}]},
            ],
            r"row 0 has a message whose content is \[\{'type': 'image'.*images and other parts are not read",
        ),
    ],
)
def test_a_messages_column_that_is_not_conversations_is_named(conversation, message) -> None:
    """Strings failed inside the chat template's `datasets.map` ("Chat messages should be dicts"), messages without
    a role as jinja's UndefinedError, and conversations without an answer as each "losing its answer when cut"."""
    with pytest.raises(ValueError, match=message):
        as_messages(Dataset.from_list([{"messages": conversation}] * 3), finetune.FinetuneArguments())


@pytest.mark.parametrize(
    "flags, alternative",
    [
        (["--text_column", "document", "--summary_column", "summary"], "--source_column.*--target_column"),
        (["--num_beams", "4"], "--generation_num_beams"),
        (["--val_max_target_length=64"], "--generation_max_length"),
        (["--pad_to_max_length", "--ignore_pad_token_for_loss", "true"], "padded to its longest.*always -100"),
    ],
)
def test_run_translation_flags_are_refused_naming_what_to_pass_instead(flags, alternative) -> None:
    """A run_translation.py / run_summarization.py command failed on "Unknown flags" that named no alternative, or,
    for --text_column, exited with argparse's usage ("ambiguous option": a prefix of --text_column_name)."""
    with pytest.raises(
        ValueError, match=f"^Unknown flags: --.* flag of transformers' example scripts; here: .*{alternative}"
    ):
        finetune.parse(["--task", "seq2seq", *flags])


def test_seq2seq_targets_are_cut_at_max_target_length_not_at_max_source_length() -> None:
    """Sources and targets were tokenized in one call (`text_target`) with the sources' max_length: with
    --max_source_length below --max_target_length every target was cut at the source length."""
    pairs = [{"code": "x", "docstring": " ".join(f"w{i}" for i in range(40))}, {"code": "y " * 40, "docstring": "z"}]
    tokenizer = train_tokenizer([p["code"] + p["docstring"] for p in pairs], "seq2seq", vocab_size=300, min_frequency=1)
    for source_length, target_length in ((8, 24), (24, 8)):
        args = finetune.FinetuneArguments(max_source_length=source_length, max_target_length=target_length)
        encoded = tokenize_seq2seq(Dataset.from_list(pairs), tokenizer, args, max_length=None, num_proc=None)
        assert [len(row["input_ids"]) for row in encoded][1] == source_length
        assert [len(row["labels"]) for row in encoded][0] == target_length
        for row in encoded:  # each side keeps its closing token
            assert row["input_ids"][-1] == row["labels"][-1] == tokenizer.eos_token_id


def test_integer_labels_keep_their_values_as_ids() -> None:
    """Labels 0..11 were sorted as text ("10" before "2"): label 10 got id 2, so `logits.argmax(-1)` of the saved
    classifier did not give the label (run_glue.py sorts them as numbers)."""
    label2id, id2label = label_maps(Dataset.from_list([{"label": i % 12} for i in range(36)]), "label")
    assert label2id == {i: i for i in range(12)}
    assert id2label == {i: str(i) for i in range(12)}
    label2id, _ = label_maps(Dataset.from_list([{"label": v} for v in ("pos", "neg", "neutral")]), "label")
    assert label2id == {"neg": 0, "neutral": 1, "pos": 2}
    # a Hub data set's ClassLabel column keeps its own ids and names (they were the ids as text: "0", "1")
    features = Features({"label": ClassLabel(names=["negative", "positive"])})
    label2id, id2label = label_maps(Dataset.from_dict({"label": [1, 1]}, features=features), "label")
    assert label2id == {0: 0, 1: 1} and id2label == {0: "negative", 1: "positive"}


def test_float_labels_train_a_regression_head(tmp_path: Path, work: Path) -> None:
    """A float label column is a regression target, as run_glue.py reads it: one output trained by mean squared
    error. Each distinct float was a class of its own (80 classes for 80 rows), and a validation split of other
    values failed on labels "not in the training split"."""
    for name, n, seed in (("train", 80, 1), ("validation", 40, 2)):
        rows = [
            {**row, "score": (0.9 if row["label"] == "pos" else 0.1) + 0.01 * (i % 5)}
            for i, row in enumerate(sentiment_rows(n, seed))
        ]
        Dataset.from_list(rows).to_csv(tmp_path / f"{name}.csv")
    out = tmp_path / "reg"
    train, validation = tmp_path / "train.csv", tmp_path / "validation.csv"
    metrics = finetune.main(
        classification_args(out, work / "base", train, validation, "--label_column_name", "score", "--max_steps", "20")
    )
    assert metrics["eval_mse"] == pytest.approx(metrics["eval_loss"], rel=1e-4)
    assert metrics["eval_mse"] < 0.02 < metrics["before_eval_mse"] and metrics["eval_pearson"] > 0.9
    model = AutoModelForSequenceClassification.from_pretrained(out)
    assert model.config.num_labels == 1 and model.config.problem_type == "regression"
    # label smoothing has no classes to smooth: it failed in the first step, "gather(): Expected dtype int32/int64"
    smoothed = classification_args(tmp_path / "smoothed", work / "base", train, validation, "--label_column_name")
    with pytest.raises(ValueError, match="--label_smoothing_factor 0.1 smooths class targets, and the float labels"):
        finetune.main([*smoothed, "score", "--label_smoothing_factor", "0.1"])
    assert not (tmp_path / "smoothed").exists()


def test_rows_without_one_label_are_named_before_training(tmp_path: Path, work: Path) -> None:
    """A row without a label (a CSV's empty field) trained as a class "None"; a multi-hot vector or scores in a
    list column would be read as lists of class ids ([0, 1, 1] as the classes 0 and 1) and train the wrong targets."""
    rows = sentiment_rows(20, 0)
    Dataset.from_list([{**row, "label": None if i == 3 else row["label"]} for i, row in enumerate(rows)]).to_csv(
        tmp_path / "missing.csv"
    )
    hot = [[1, 0, 1], [0, 1, 1]]
    Dataset.from_list([{**row, "label": hot[i % 2]} for i, row in enumerate(rows)]).to_json(tmp_path / "hot.jsonl")
    Dataset.from_list([{**row, "label": [0.2, 0.8]} for row in rows]).to_json(tmp_path / "scores.jsonl")
    out = tmp_path / "out"
    base = ["--task", "classification", "--model_name_or_path", str(work / "base"), "--train_file"]
    with pytest.raises(ValueError, match=r"Column 'label' of the train split has 1 empty cell\(s\)"):
        finetune.main(run_args(out, *base, str(tmp_path / "missing.csv")))
    with pytest.raises(ValueError, match=r"row \d+ names a label twice, \[[01], [01], 1\]: a multi-label row is a li"):
        finetune.main(run_args(out, *base, str(tmp_path / "hot.jsonl")))
    with pytest.raises(ValueError, match=r"holds List\(Value\('float64'\)\): a multi-label row is a list of its"):
        finetune.main(run_args(out, *base, str(tmp_path / "scores.jsonl")))
    assert not out.exists()


@pytest.mark.parametrize("task", ["classification", "instruct"])
def test_a_tokenizer_without_a_pad_token_pads_with_its_eos_token(tmp_path: Path, work: Path, task: str) -> None:
    """A base model whose tokenizer has no pad token (a converted Llama's): the collator failed with "Asking to pad
    but the tokenizer does not have a padding token" at the first evaluation. Batches are padded with the
    end-of-sequence token, masked out, and the saved classifier gives the same logits padded or not."""
    base = tmp_path / "base"
    tokenizer = AutoTokenizer.from_pretrained(work / "base")
    tokenizer.pad_token = None
    tokenizer.save_pretrained(base)
    archlab.DecoderForCausalLM(tiny_decoder_config(vocab_size=len(tokenizer), pad_token_id=None)).save_pretrained(base)
    data = {
        "classification": ["--train_file", str(work / "train.csv"), "--block_size", "32"],
        "instruct": [
            "--train_file",
            str(work / "instruct.jsonl"),
            "--prompt_column",
            "prompt",
            "--response_column",
            "response",
        ],
    }[task]
    out = tmp_path / "out"
    metrics = finetune.main(run_args(out, "--task", task, "--model_name_or_path", str(base), *data))
    assert metrics["eval_loss"] < metrics["before_eval_loss"]
    saved = AutoTokenizer.from_pretrained(out)
    assert saved.pad_token == saved.eos_token
    if task == "classification":
        model = AutoModelForSequenceClassification.from_pretrained(out).eval()
        texts = ["great good lovely", "bad sad awful poor awful sad bad"]
        batch = saved(texts, return_tensors="pt", padding=True)
        alone = torch.cat([model(**saved(text, return_tensors="pt")).logits for text in texts])
        assert_close_to_scale(model(**batch).logits, alone)


@pytest.mark.parametrize("task", ["classification", "instruct"])
def test_a_tokenizer_that_pads_on_the_left_trains_on_batches_padded_on_the_right(
    tmp_path: Path, work: Path, task: str
) -> None:
    """archlab's decoder tokenizer pads on the left, for generation; the collators pad on the right all the same, so
    a model with a position table reads a short example at its own positions: the loss before fine-tuning is that of
    the same tokenizer padding on the right (left-padded batches moved it). The classifier's folder saves its
    tokenizer padding on the right (its plain forwards read positions from the first column), the chat model's as
    it came."""
    data = {
        "classification": ["--train_file", str(work / "train.csv"), "--block_size", "32"],
        "instruct": ["--train_file", str(work / "instruct.jsonl"), "--validation_file", str(tmp_path / "v.jsonl")]
        + ["--prompt_column", "prompt", "--response_column", "response"],
    }[task]
    rows = [{"prompt": "Return 1.", "response": "1"}, {"prompt": "Return 2 squared plus 3.", "response": "2 ** 2 + 3"}]
    (tmp_path / "v.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))  # two lengths: padded
    losses = {}
    for side in ("left", "right"):
        base = tmp_path / f"base-{side}"
        tokenizer = AutoTokenizer.from_pretrained(work / "base")
        tokenizer.padding_side = side
        save_tokenizer(tokenizer, base)
        config = tiny_decoder_config(vocab_size=len(tokenizer), position_embedding_type="learned")
        torch.manual_seed(0)
        archlab.DecoderForCausalLM(config).save_pretrained(base)
        out = tmp_path / f"out-{side}"
        args = run_args(out, "--task", task, "--model_name_or_path", str(base), *data)
        losses[side] = finetune.main([*args, "--max_steps", "1"])["before_eval_loss"]
        assert AutoTokenizer.from_pretrained(out).padding_side == (side if task == "instruct" else "right")
    assert losses["left"] == pytest.approx(losses["right"], rel=1e-5)


def test_a_classifier_is_fine_tuned_under_its_own_label_ids(tmp_path: Path, work: Path) -> None:
    """A classifier whose head has the data's labels in another order (pos=0, neg=1) keeps its ids, as run_glue.py
    keeps them: the data's sorted order relabelled its outputs, and every prediction read as the other class. One
    with another number of labels gets a new head (it failed in `from_pretrained` on the head's size)."""
    tokenizer = AutoTokenizer.from_pretrained(work / "base")
    for name, labels in (("swapped", ["pos", "neg"]), ("three", ["a", "b", "c"])):
        id2label = dict(enumerate(labels))
        config = tiny_decoder_config(vocab_size=len(tokenizer), id2label=id2label)
        archlab.DecoderForSequenceClassification(config).save_pretrained(tmp_path / name)
        tokenizer.save_pretrained(tmp_path / name)
    files = ["--train_file", str(work / "train.csv"), "--validation_file", str(work / "validation.csv")]
    before = {}
    for name in ("swapped", "three"):
        args = ["--task", "classification", "--model_name_or_path", str(tmp_path / name), *files, "--block_size", "32"]
        before[name] = finetune.main(run_args(tmp_path / f"out-{name}", *args, "--max_steps", "1"))
    swapped = AutoModelForSequenceClassification.from_pretrained(tmp_path / "out-swapped")
    assert swapped.config.id2label == {0: "pos", 1: "neg"} and swapped.config.label2id == {"pos": 0, "neg": 1}
    three = AutoModelForSequenceClassification.from_pretrained(tmp_path / "out-three")
    assert three.config.id2label == {0: "neg", 1: "pos"} and three.score.weight.shape[0] == 2


def mood_rows(n: int, seed: int) -> list[dict]:
    """Multi-label rows: "happy" where the text has happy words, "sad" where it has sad ones, both, or neither."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        labels = [label for label in ("happy", "sad") if rng.random() < 0.5]
        words = [str(i)]
        words += rng.choices(["great", "lovely", "fine", "good"], k=3) if "happy" in labels else []
        words += rng.choices(["bad", "awful", "poor", "sad"], k=3) if "sad" in labels else []
        rng.shuffle(words)
        rows.append({"text": " ".join(words), "label": labels})
    return rows


def test_multi_label_loss_is_binary_cross_entropy_on_multi_hot_targets(work: Path) -> None:
    """A list of labels per row becomes a multi-hot float target, and the head built for it (problem_type
    multi_label_classification) is trained by the mean binary cross-entropy over every class of every row."""
    rows = mood_rows(6, 0)
    dataset = Dataset.from_list(rows)
    args = finetune.FinetuneArguments()
    label2id, id2label = label_maps(dataset, "label")
    assert label2id == {"happy": 0, "sad": 1} and is_multi_label(dataset, "label")
    tokenizer = AutoTokenizer.from_pretrained(work / "base")
    encoded = tokenize_classification(dataset, tokenizer, args, 32, None, "text", label2id)
    targets = torch.tensor(encoded["labels"])
    assert targets.tolist() == [[float("happy" in r["label"]), float("sad" in r["label"])] for r in rows]
    config = tiny_decoder_config(
        vocab_size=len(tokenizer), id2label=id2label, problem_type="multi_label_classification"
    )
    torch.manual_seed(0)
    model = archlab.DecoderForSequenceClassification(config).eval()
    batch = tokenizer([r["text"] for r in rows], return_tensors="pt", padding=True)
    out = model(**batch, labels=targets)
    p = torch.sigmoid(out.logits.double())
    by_hand = -(targets * p.log() + (1 - targets) * (1 - p).log()).mean()
    assert_close_to_scale(out.loss.double(), by_hand, rtol=1e-5)


def test_multi_label_metrics_are_subset_accuracy_and_micro_f1() -> None:
    logits = np.array([[2.0, -1.0, 3.0], [-1.0, -2.0, -3.0], [1.0, 1.0, -1.0]])  # predicted {0, 2}, {}, {0, 1}
    labels = np.array([[1.0, 0.0, 1.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    # tp 3 (row 0: 2, row 2: 1), fp 1 (row 2, class 1), fn 1 (row 1, class 2): micro-F1 6 / 8; row 0 alone exact
    scores = classification_metrics(EvalPrediction(predictions=logits, label_ids=labels))
    assert scores == {"accuracy": pytest.approx(1 / 3), "f1": pytest.approx(6 / 8)}


def test_a_hub_multi_label_column_keeps_its_class_names(work: Path) -> None:
    """A `Sequence(ClassLabel)` column (go_emotions' form): ids and names as the data set defines them, and
    multi-hot float targets even where the column is named `labels` (`map` gave the output its ClassLabel type:
    integer targets, and binary cross-entropy failed on Long labels)."""
    features = Features({"text": Value("string"), "labels": List(ClassLabel(names=["anger", "joy", "fear"]))})
    dataset = Dataset.from_dict({"text": ["a", "b", "c"], "labels": [[0, 2], [1], []]}, features=features)
    assert is_multi_label(dataset, "labels")
    label2id, id2label = label_maps(dataset, "labels")
    assert (label2id, id2label) == ({0: 0, 1: 1, 2: 2}, {0: "anger", 1: "joy", 2: "fear"})
    tokenizer = AutoTokenizer.from_pretrained(work / "base")
    args = finetune.FinetuneArguments(label_column_name="labels")
    encoded = tokenize_classification(dataset, tokenizer, args, 32, None, "text", label2id)
    assert encoded["labels"] == [[1.0, 0.0, 1.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0]]
    assert encoded.features["labels"] == List(Value("float64"))


def test_multi_label_end_to_end_with_test_predictions(tmp_path: Path, work: Path) -> None:
    """Lists of labels (JSON) train a multi-label classifier as run_classification.py does: micro-F1 rises on a
    separable set, the saved folder answers `pipeline("text-classification", top_k=None)` with a sigmoid per class,
    and a --test_file is predicted after training (`predict_results.txt`: each row's list of classes)."""
    for name, n, seed in (("train", 96, 1), ("validation", 40, 2), ("test", 12, 3)):
        Dataset.from_list(mood_rows(n, seed)).to_json(tmp_path / f"{name}.jsonl")
    out = tmp_path / "moods"
    files = [str(tmp_path / f"{name}.jsonl") for name in ("train", "validation")]
    args = classification_args(
        out, work / "base", *files, "--max_steps", "24", "--test_file", str(tmp_path / "test.jsonl")
    )
    metrics = finetune.main(args)
    assert metrics["eval_f1"] >= 0.9 > metrics["before_eval_f1"] and metrics["eval_accuracy"] >= 0.8
    assert metrics["predict_f1"] >= 0.8 and "predict_loss" in metrics
    model = AutoModelForSequenceClassification.from_pretrained(out).eval()
    assert model.config.problem_type == "multi_label_classification"
    assert model.config.id2label == {0: "happy", 1: "sad"}
    classify = pipeline("text-classification", model=str(out), top_k=None)
    text = "lovely great sad awful"
    scores = {row["label"]: row["score"] for row in classify([text])[0]}
    tokenizer = AutoTokenizer.from_pretrained(out)
    with torch.no_grad():
        logits = model(**tokenizer(text, return_tensors="pt", return_token_type_ids=False)).logits[0]
    assert scores == {name: pytest.approx(p, rel=1e-4) for name, p in zip(["happy", "sad"], logits.sigmoid().tolist())}
    lines = (out / "predict_results.txt").read_text().splitlines()
    assert lines[0] == "index\tprediction" and len(lines) == 13
    right = [ast.literal_eval(line.split("\t")[1]) == row["label"] for line, row in zip(lines[1:], mood_rows(12, 3))]
    assert np.mean(right) == pytest.approx(json.loads((out / "predict_results.json").read_text())["predict_accuracy"])


def test_a_labelled_test_file_is_predicted_and_scored(tmp_path: Path, work: Path) -> None:
    """--test_file (as run_glue.py's, with --do_predict implied): `predict_results.txt` holds each example's class,
    `predict_*` metrics are computed from the file's labels; a test file without the label column is predicted
    only; --max_predict_samples cuts it."""
    Dataset.from_list(sentiment_rows(10, 3)).to_csv(tmp_path / "test.csv")
    Dataset.from_list([{"text": row["text"]} for row in sentiment_rows(10, 3)]).to_csv(tmp_path / "unlabelled.csv")
    out = tmp_path / "cls"
    metrics = finetune.main(
        classification_args(out, work / "base", work / "train.csv", work / "validation.csv", "--test_file")
        + [str(tmp_path / "test.csv")]
    )
    lines = (out / "predict_results.txt").read_text().splitlines()
    assert lines[0] == "index\tprediction" and [line.split("\t")[0] for line in lines[1:]] == list(map(str, range(10)))
    predicted = [line.split("\t")[1] for line in lines[1:]]
    right = np.mean([p == row["label"] for p, row in zip(predicted, sentiment_rows(10, 3))])
    assert metrics["predict_accuracy"] == pytest.approx(right) and "predict_f1" in metrics
    saved = json.loads((out / "all_results.json").read_text())
    assert saved["predict_accuracy"] == metrics["predict_accuracy"] and "eval_accuracy" in saved
    # predicted only, and cut
    out = tmp_path / "unlabelled"
    metrics = finetune.main(
        classification_args(out, work / "base", work / "train.csv", work / "validation.csv", "--max_steps", "1")
        + ["--test_file", str(tmp_path / "unlabelled.csv"), "--max_predict_samples", "4"]
    )
    assert len((out / "predict_results.txt").read_text().splitlines()) == 5
    assert "predict_accuracy" not in metrics and "predict_loss" not in metrics


def test_a_data_sets_test_split_is_predicted_not_tokenized_as_validation(tmp_path: Path, work: Path) -> None:
    """A data set with train/validation/test splits (GLUE's layout: test labels -1) failed with "Labels ['-1'] of
    the validation split are not in the training split": every split was tokenized and checked as a validation one.
    Now the test split is left out unless --do_predict, which predicts it without scores."""
    rows = {"train": sentiment_rows(80, 1), "validation": sentiment_rows(20, 2), "test": sentiment_rows(6, 3)}
    label = {"neg": 0, "pos": 1}
    splits = {
        split: Dataset.from_list(
            [{"text": r["text"], "label": -1 if split == "test" else label[r["label"]]} for r in rs]
        )
        for split, rs in rows.items()
    }
    DatasetDict(splits).save_to_disk(tmp_path / "glue")
    args = run_args(tmp_path / "out", "--task", "classification", "--model_name_or_path", str(work / "base"))
    args += ["--dataset_name", str(tmp_path / "glue"), "--block_size", "32", "--max_steps", "1"]
    metrics = finetune.main(args)
    assert not (tmp_path / "out" / "predict_results.txt").exists() and "eval_accuracy" in metrics
    metrics = finetune.main([*args, "--do_predict", "true", "--overwrite_output_dir", "true"])
    lines = (tmp_path / "out" / "predict_results.txt").read_text().splitlines()
    assert len(lines) == 7 and {line.split("\t")[1] for line in lines[1:]} <= {"0", "1"}
    assert "predict_accuracy" not in metrics
    # no test split: named, with the splits there are
    DatasetDict({split: splits[split] for split in ("train", "validation")}).save_to_disk(tmp_path / "two")
    args[args.index(str(tmp_path / "glue"))] = str(tmp_path / "two")
    with pytest.raises(ValueError, match=r"has the splits \['train', 'validation'\], none named 'test'"):
        finetune.main([*args, "--do_predict", "true", "--overwrite_output_dir", "true"])
    # the labels of a labelled test split are checked against the training split's, naming the split
    splits["test"] = Dataset.from_list([{"text": "x", "label": 7}])
    DatasetDict(splits).save_to_disk(tmp_path / "seven")
    args[args.index(str(tmp_path / "two"))] = str(tmp_path / "seven")
    with pytest.raises(ValueError, match=r"Labels \['7'\] of the test split are not in the training split's"):
        finetune.main([*args, "--do_predict", "true", "--overwrite_output_dir", "true"])


def test_regression_predictions_are_values() -> None:
    """A regression head's predict_results.txt line is its value with 3 decimals, as run_glue.py writes it."""
    from archlab.training.tasks import classification_lines

    config = tiny_decoder_config(num_labels=1, problem_type="regression")
    assert classification_lines(np.array([[0.25], [1.5]]), config) == ["index\tprediction", "0\t0.250", "1\t1.500"]


def test_source_prefix_goes_before_every_source(work: Path) -> None:
    """--source_prefix ("translate English to German: ", as T5 is prompted) is put before each source when it is
    tokenized, and is in the texts a new tokenizer learns; the targets stay as they are."""
    pairs = [{"code": "def f(): pass", "docstring": "Do nothing."}, {"code": "x = 1", "docstring": "Set x."}]
    tokenizer = train_tokenizer([p["code"] + p["docstring"] for p in pairs], "seq2seq", vocab_size=300, min_frequency=1)
    args = finetune.FinetuneArguments(source_prefix="summarize: ")
    encoded = tokenize_seq2seq(Dataset.from_list(pairs), tokenizer, args, max_length=None, num_proc=None)
    plain = tokenize_seq2seq(Dataset.from_list(pairs), tokenizer, finetune.FinetuneArguments(), None, None)
    for row, pair in zip(encoded, pairs):
        assert row["input_ids"] == tokenizer("summarize: " + pair["code"])["input_ids"]
    assert encoded["labels"] == plain["labels"]
    assert list(pair_texts(Dataset.from_list(pairs), args, "text"))[0] == "summarize: def f(): pass"


def test_generated_predictions_are_one_line_per_example() -> None:
    """generated_predictions.txt: the decoded texts without special tokens; -100 (the gathered batches' padding) read
    as pad, and a line break inside a text written as a space so that line i stays example i."""
    from archlab.training.tasks import generated_lines

    tokenizer = train_tokenizer(["one two\nthree"], "seq2seq", vocab_size=300, min_frequency=1)
    ids = tokenizer(["one two\nthree", "two"], padding=True)["input_ids"]
    ids = np.array([ids[0], [i if i != tokenizer.pad_token_id else IGNORE_INDEX for i in ids[1]]])
    assert generated_lines(ids, tokenizer) == ["one two three", "two"]


def test_translation_pairs_are_read_by_their_languages() -> None:
    """run_translation.py's form (wmt16, opus_books): a `translation` column of {language: text}, read with
    --source_lang / --target_lang into columns named by the languages; a row without one of them is named."""
    args = finetune.FinetuneArguments(task="seq2seq", source_lang="en", target_lang="de")
    finetune.check_language_flags(args)
    assert (args.source_column, args.target_column) == ("en", "de")
    codes = finetune.FinetuneArguments(task="seq2seq", source_lang="en_XX", target_lang="de_DE")
    finetune.check_language_flags(codes)  # an mBART tokenizer's codes: the keys before the '_', as run_translation.py
    assert (codes.source_column, codes.target_column) == ("en", "de")
    rows = [{"id": "0", "translation": {"en": "Hello.", "de": "Hallo.", "fr": "Salut."}}]
    pairs = check_pair_columns(Dataset.from_list(rows), "train", args, "text")
    assert pairs.column_names == ["en", "de"] and pairs[0] == {"en": "Hello.", "de": "Hallo."}
    with pytest.raises(ValueError, match=r"row 0 holds \['en', 'fr'\], not the languages \['en', 'de'\]"):
        check_pair_columns(Dataset.from_list([{"translation": {"en": "Hi.", "fr": "Salut."}}]), "train", args, "text")
    for given, message in (
        ({"source_lang": "en"}, "--source_lang and --target_lang go together and differ"),
        ({"source_lang": "en", "target_lang": "de", "source_column": "english"}, "Conflicting flags: --source_col"),
        ({"source_lang": "en", "target_lang": "de", "task": "classification"}, "are for --task seq2seq, not --ta"),
        ({"source_lang": "en_XX", "target_lang": "en_GB"}, "read the same key 'en' of the `translation` column"),
    ):
        with pytest.raises(ValueError, match=message):
            finetune.check_language_flags(finetune.FinetuneArguments(**{"task": "seq2seq", **given}))
    # a column flag given with its default value conflicts all the same (`--source_column code`)
    with pytest.raises(ValueError, match="Conflicting flags: --source_column with --source_lang"):
        finetune.check_language_flags(
            finetune.FinetuneArguments(task="seq2seq", source_lang="en", target_lang="de"), {"source_column"}
        )


MBART_WORDS = "hello world good morning thank you bonjour le monde merci beaucoup".split()


def mbart_folder(root: Path) -> Path:
    """A converted tiny mBART (pre-norm, mBART's label shift) with a tiny mBART tokenizer (its 25 language codes)."""
    from transformers import MBartConfig, MBartForConditionalGeneration, MBartTokenizer

    from archlab.conversion import convert_checkpoint

    vocab = [("<s>", 0.0), ("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    tokenizer = MBartTokenizer(vocab=vocab + [("▁" + word, -1.0) for word in MBART_WORDS])
    shape = dict(d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2)
    config = MBartConfig(
        vocab_size=len(tokenizer), **shape, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32
    )
    torch.manual_seed(0)
    MBartForConditionalGeneration(config).save_pretrained(root / "stock")
    tokenizer.save_pretrained(root / "stock")
    convert_checkpoint(root / "stock", root / "archlab")
    return root / "archlab"


def test_mbart_translates_between_its_language_codes(tmp_path: Path) -> None:
    """run_translation.py's mBART recipe: --source_lang / --target_lang as the tokenizer's language codes read the
    `translation` column's keys before the '_' and mark the texts (sources and targets end with `</s>` and their
    code, the decoder input starts with the target's); --forced_bos_token is saved as the generation config's
    `forced_bos_token_id`, and a
    model without a `decoder_start_token_id` starts from the target's code. Unknown codes are refused, naming the
    allowed ones, before anything is written."""
    folder = mbart_folder(tmp_path)
    rows = [{"translation": {"en": "hello world", "fr": "bonjour le monde"}}] * 6
    rows += [{"translation": {"en": "thank you", "fr": "merci beaucoup"}}] * 6
    Dataset.from_list(rows).to_json(tmp_path / "pairs.jsonl")
    files = ["--train_file", str(tmp_path / "pairs.jsonl"), "--validation_file", str(tmp_path / "pairs.jsonl")]
    lengths = ["--max_source_length", "16", "--max_target_length", "16"]
    base = ["--task", "seq2seq", "--model_name_or_path", str(folder), *files, *lengths, "--max_steps", "2"]
    languages = ["--source_lang", "en_XX", "--target_lang", "fr_XX"]
    out = tmp_path / "out"
    for wrong, message in (
        (["--source_lang", "en", "--target_lang", "fr_XX"], r"`--source_lang`='en' is not a language code .* en_XX"),
        ([*languages, "--forced_bos_token", "xx_YY"], "`--forced_bos_token`='xx_YY' is not a token of the tokenizer"),
    ):
        with pytest.raises(ValueError, match=message):
            finetune.main(run_args(out, *base, *wrong, "--save_strategy", "no"))
        assert not out.exists()
    finetune.main(run_args(out, *base, *languages, "--forced_bos_token", "fr_XX", "--generation_max_length", "4"))

    tokenizer = AutoTokenizer.from_pretrained(out)
    assert (tokenizer.src_lang, tokenizer.tgt_lang) == ("en_XX", "fr_XX")
    code = tokenizer.convert_tokens_to_ids("fr_XX")
    labels = tokenizer(text_target="merci beaucoup")["input_ids"]
    assert labels[-2:] == [tokenizer.eos_token_id, code]
    model = archlab.Seq2SeqForConditionalGeneration.from_pretrained(out)
    assert model.prepare_decoder_input_ids_from_labels(torch.tensor([labels]))[0, 0] == code
    assert model.generation_config.forced_bos_token_id == code
    assert model.config.decoder_start_token_id == model.generation_config.decoder_start_token_id == code
    assert model.generate(**tokenizer("hello world", return_tensors="pt"), max_new_tokens=3)[0, 1] == code


def pair_rows(n: int, seed: int) -> list[dict[str, str]]:
    """GLUE-style pairs whose label is the mood of the second sentence alone (the first is noise): a classifier that
    read only `sentence1` could not learn them."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        positive = rng.random() < 0.5
        words = ["great", "lovely", "fine", "good"] if positive else ["bad", "awful", "poor", "sad"]
        noise = " ".join(rng.choices(["great", "lovely", "bad", "awful"], k=4))
        second = " ".join(rng.choices(words, k=4))
        rows.append({"sentence1": f"{noise} {i}", "sentence2": second, "label": int(positive)})
    return rows


def bert_tokenizer() -> AutoTokenizer:
    from transformers import BertTokenizer

    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "good", "bad", "one", "two", "three"]
    return BertTokenizer(vocab={w: i for i, w in enumerate(words)})


def test_sentence_pairs_are_encoded_as_the_tokenizers_pair(work: Path) -> None:
    """--text_column_names first,second: each row is `tokenizer(first, second)` (archlab's decoder template `<s> a
    <s> b`), the longer text cut first to the length (`longest_first`, as run_glue.py's `truncation=True`), and
    `token_type_ids` kept only for a model with segment embeddings (a BERT's, second text 1), dropped otherwise."""
    tokenizer = AutoTokenizer.from_pretrained(work / "base")
    args = finetune.FinetuneArguments(text_column_names="sentence1,sentence2")
    rows = pair_rows(3, 0)
    encoded = tokenize_classification(Dataset.from_list(rows), tokenizer, args, 64, None, "sentence1", {0: 0, 1: 1})
    for row, source in zip(encoded, rows):
        assert row["input_ids"] == tokenizer(source["sentence1"], source["sentence2"])["input_ids"]
        assert row["input_ids"].count(tokenizer.bos_token_id) == 2 and "token_type_ids" not in row
    assert set(classification_texts(Dataset.from_list(rows), args, "sentence1")) == {
        text for row in rows for text in (row["sentence1"], row["sentence2"])
    }
    bert = bert_tokenizer()
    pair = Dataset.from_list([{"a": "one two three", "b": "good bad", "label": 0}])
    args = finetune.FinetuneArguments(text_column_names="a,b")
    cut = tokenize_classification(pair, bert, args, 7, None, "a", {0: 0}, segments=True)[0]
    assert bert.convert_ids_to_tokens(cut["input_ids"]) == ["[CLS]", "one", "two", "[SEP]", "good", "bad", "[SEP]"]
    assert cut["token_type_ids"] == [0, 0, 0, 0, 1, 1, 1]
    assert "token_type_ids" not in tokenize_classification(pair, bert, args, 7, None, "a", {0: 0})[0]


def test_sentence_pair_classification_end_to_end(tmp_path: Path, work: Path) -> None:
    """GLUE's `sentence1`/`sentence2` columns are read as pairs without flags, as run_glue.py reads them: the label
    of the second sentence is learnt, a --test_file of pairs is predicted, and the card's snippet (a pair) runs."""
    for name, n, seed in (("train", 80, 1), ("validation", 40, 2), ("test", 6, 3)):
        Dataset.from_list(pair_rows(n, seed)).to_csv(tmp_path / f"{name}.csv")
    out = tmp_path / "pairs"
    files = [tmp_path / f"{name}.csv" for name in ("train", "validation")]
    metrics = finetune.main(classification_args(out, work / "base", *files, "--test_file", str(tmp_path / "test.csv")))
    assert metrics["eval_accuracy"] >= 0.9 and "predict_accuracy" in metrics
    lines = (out / "predict_results.txt").read_text().splitlines()
    assert len(lines) == 7 and {line.split("\t")[1] for line in lines[1:]} <= {"0", "1"}
    snippet = re.search(r"```python\n(.*?)```", (out / "README.md").read_text(), re.S).group(1)
    assert f"tokenizer('def fibonacci(n):', {finetune.PAIR_EXAMPLE!r}, " in snippet
    exec(snippet.replace('"pairs"', repr(str(out))), {})


def test_a_missing_second_text_column_is_named_before_training(tmp_path: Path, work: Path) -> None:
    Dataset.from_list(pair_rows(8, 1)).to_csv(tmp_path / "train.csv")
    args = classification_args(tmp_path / "out", work / "base", tmp_path / "train.csv", tmp_path / "train.csv")
    with pytest.raises(ValueError, match=r"Column 'sentence3' not found in the train split.*--text_column_names\."):
        finetune.main([*args, "--text_column_names", "sentence1,sentence3"])
    for given, message in (
        (["--text_column_names", "a,a"], "different column names separated by commas"),
        (["--text_column_names", "a,"], "different column names separated by commas"),
        (["--text_column_names", "a", "--text_column_delimiter", " "], "joins two or more columns; .* names one"),
        (["--text_column_delimiter", "\\n"], "joins the columns of --text_column_names"),
        (["--text_column_names", "sentence1,sentence2,sentence3"], r"Column 'sentence3' not found in the train split"),
    ):
        with pytest.raises(ValueError, match=message):
            finetune.main([*args, *given])
    with pytest.raises(ValueError, match="--text_column_delimiter is for --task classification, not --task seq2seq"):
        finetune.main(run_args(tmp_path / "out", "--task", "seq2seq", "--text_column_delimiter", " "))
    with pytest.raises(ValueError, match="Conflicting flags: --text_column_name and --text_column_names"):
        finetune.main([*args, "--text_column_names", "a,b", "--text_column_name", "a"])
    with pytest.raises(ValueError, match="--text_column_names is for --task classification, not --task seq2seq"):
        finetune.main(run_args(tmp_path / "out", "--task", "seq2seq", "--text_column_names", "a,b"))
    assert not (tmp_path / "out").exists()


def test_more_text_columns_are_joined_into_one_text_as_run_classification_joins_them(
    tmp_path: Path, work: Path
) -> None:
    """--text_column_names title,body,tag (run_classification.py's amazon_reviews_multi example): the texts joined by
    --text_column_delimiter (a space unless given; `\\n` read as a line break) into one text; two columns with the
    delimiter are joined too, not a pair. End to end: the joined text is what the classifier learns from."""
    rows = [{"title": "one", "body": "two three", "tag": "good", "label": 0}]
    args = finetune.FinetuneArguments(task="classification", text_column_names="title,body,tag")
    assert finetune.check_text_column_flags(args, "text") == "title"
    joined = check_classification_columns(Dataset.from_list(rows), "train", args, "title")
    assert joined.column_names == ["title", "label"] and joined[0]["title"] == "one two three good"
    args = finetune.FinetuneArguments(text_column_names="title,body", text_column_delimiter="\\n")
    assert text_pair_column(args) is None
    assert check_classification_columns(Dataset.from_list(rows), "train", args, "title")[0]["title"] == "one\ntwo three"

    # the label is the mood of the third column alone: a classifier reading only the first could not learn it
    def rows_of(n: int, seed: int) -> list[dict[str, Any]]:
        return [{**row, "sentence3": row["sentence2"]} | {"sentence2": "one two"} for row in pair_rows(n, seed)]

    for name, n, seed in (("train", 80, 1), ("validation", 40, 2)):
        Dataset.from_list(rows_of(n, seed)).to_csv(tmp_path / f"{name}.csv")
    files = [tmp_path / f"{name}.csv" for name in ("train", "validation")]
    flags = ["--text_column_names", "sentence1,sentence2,sentence3", "--text_column_delimiter", " | "]
    flags += ["--block_size", "64"]  # the joined text whole (32 tokens cut into the third column)
    metrics = finetune.main(classification_args(tmp_path / "out", work / "base", *files, *flags))
    assert metrics["eval_accuracy"] >= 0.9
    facts = json.loads((tmp_path / "out" / "checkpoint-10" / "run_facts.json").read_text())
    assert facts["columns"]["--text_column_delimiter"] == " | "


def test_glue_text_columns_are_read_as_run_glue_reads_them() -> None:
    assert glue_text_columns(["sentence1", "sentence2", "label", "idx"]) == ("sentence1", "sentence2")
    assert glue_text_columns(["question", "sentence", "label"]) == ("question", "sentence")
    assert glue_text_columns(["premise", "hypothesis", "label"]) == ("premise", "hypothesis")
    assert glue_text_columns(["question1", "question2", "label"]) == ("question1", "question2")
    assert glue_text_columns(["sentence", "label"]) == ("sentence",)
    assert glue_text_columns(["review", "label"]) is None
    args = finetune.FinetuneArguments(task="classification")
    assert finetune.read_glue_text_columns(args, "text", ["text", "sentence1", "sentence2"]) == "text"
    assert args.text_column_names is None  # a `text` column is read as it is
    assert finetune.read_glue_text_columns(args, "text", ["premise", "hypothesis", "label"]) == "premise"
    assert args.text_column_names == "premise,hypothesis"


def test_the_source_prefix_is_saved_where_t5_keeps_its_task_prefixes(capsys) -> None:
    """--source_prefix goes into `config.task_specific_params[task]["prefix"]` (T5's place; the card's snippet reads it
    there): the saved folder did not record it. Other tasks' entries stay; a base model's prefix for the task is
    dropped, with a warning, when the run trains without one."""
    config = archlab.Seq2SeqConfig(**TINY_SEQ2SEQ)
    finetune.record_source_prefix(config, finetune.FinetuneArguments(source_prefix="summarize: "), "summarization")
    assert config.task_specific_params == {"summarization": {"prefix": "summarize: "}}
    args = finetune.FinetuneArguments(source_prefix="translate English to German: ", source_lang="en", target_lang="de")
    finetune.record_source_prefix(config, args, "translation")
    assert config.task_specific_params["translation_en_to_de"] == {"prefix": "translate English to German: "}
    assert config.task_specific_params["summarization"] == {"prefix": "summarize: "}
    finetune.record_source_prefix(config, finetune.FinetuneArguments(), "summarization")
    assert "prefix" not in config.task_specific_params["summarization"]
    assert "gives summarization inputs the prefix 'summarize: ', and no --source_prefix" in capsys.readouterr().out
    plain = archlab.Seq2SeqConfig(**TINY_SEQ2SEQ)
    finetune.record_source_prefix(plain, finetune.FinetuneArguments(), "translation")
    assert plain.task_specific_params is None


def test_a_resume_with_another_source_prefix_is_refused_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkpoint trained with one --source_prefix resumed with another (or none) trained the rest of the run on
    other inputs without a word; the prefix is one of the checkpoint's run facts."""
    checkpoint = tmp_path / "out" / "checkpoint-5"
    checkpoint.mkdir(parents=True)
    (checkpoint / "trainer_state.json").write_text(json.dumps({"global_step": 5}))
    (checkpoint / "run_facts.json").write_text(json.dumps({"examples_per_step": 8, "source_prefix": "summarize: "}))
    forbid(monkeypatch, sources, "load_raw_datasets", "data was loaded before the checkpoint was compared")
    args = run_args(tmp_path / "out", "--task", "seq2seq", "--resume_from_checkpoint", "true")
    with pytest.raises(ValueError, match="--source_prefix = 'summarize: ', but these flags give 'explain: ': the res"):
        finetune.main([*args, "--source_prefix", "explain: "])
    with pytest.raises(ValueError, match="but these flags give none: the resumed run would train the rest of the run"):
        finetune.main(args)


@pytest.mark.parametrize(
    "task, saved, flags, message",
    [
        (
            "seq2seq",
            {"--source_column": "code", "--target_column": "docstring"},
            ["--source_column", "body"],
            "the data columns = --source_column 'code', --target_column 'docstring', but these flags give "
            "--source_column 'body', --target_column 'docstring': the resumed run would train the rest of the run on "
            "other columns",
        ),
        (
            "classification",
            {"--text_column_name(s)": "sentence1,sentence2", "--label_column_name": "label"},
            ["--text_column_names", "sentence1"],
            r"--text_column_name\(s\) 'sentence1,sentence2', .* these flags give --text_column_name\(s\) 'sentence1',",
        ),
        (
            "instruct",
            {"--messages_column": "messages", "--prompt_column": None, "--response_column": None},
            ["--prompt_column", "question", "--response_column", "answer"],
            "these flags give --messages_column 'messages', --prompt_column 'question', --response_column 'answer'",
        ),
        (  # other windows of the contexts: the resumed run would skip other features than it trained
            "question-answering",
            {
                "--question_column": "question",
                "--context_column": "context",
                "--answer_column": "answers",
                "--max_seq_length": "384",
                "--doc_stride": "128",
            },
            ["--doc_stride", "64"],
            "these flags give .*--max_seq_length '384', --doc_stride '64'",
        ),
        (
            "token-classification",
            {"--text_column_name": "tokens", "--label_column_name": "ner_tags", "--label_all_tokens": "false"},
            ["--label_all_tokens", "true"],
            "these flags give --text_column_name 'tokens', --label_column_name 'ner_tags', --label_all_tokens 'true'",
        ),
    ],
)
def test_a_resume_that_reads_other_columns_is_refused_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, task: str, saved: dict, flags: list[str], message: str
) -> None:
    """The columns a run reads were not among its run facts: a resume with other text columns trained the rest of
    the run on other texts without a word. A checkpoint saved before the fact existed is not checked."""
    checkpoint = tmp_path / "out" / "checkpoint-5"
    checkpoint.mkdir(parents=True)
    (checkpoint / "trainer_state.json").write_text(json.dumps({"global_step": 5}))
    facts = {"examples_per_step": 8, **({"source_prefix": ""} if task == "seq2seq" else {})}
    (checkpoint / "run_facts.json").write_text(json.dumps({**facts, "columns": saved}))
    forbid(monkeypatch, sources, "load_raw_datasets", "data was loaded")
    args = run_args(tmp_path / "out", "--task", task, "--resume_from_checkpoint", "true")
    if task in ("classification", "token-classification"):
        (tmp_path / "train.csv").write_text("sentence1,sentence2,label\na,b,0\n")
        args += ["--train_file", str(tmp_path / "train.csv")]
    with pytest.raises(ValueError, match=message):
        finetune.main([*args, *flags])
    (checkpoint / "run_facts.json").write_text(json.dumps(facts))  # saved without the columns: the next check fails
    with pytest.raises(ValueError, match="was saved with --save_only_model and holds the weights alone"):
        finetune.main([*args, *flags])


def masked_lm_folder(folder: Path, rows: list[dict], **config) -> archlab.EncoderForMaskedLM:
    """A tiny masked LM saved in `folder` with archlab's masked-LM tokenizer trained on the rows' texts."""
    tokenizer = train_tokenizer([f"{r['sentence1']} {r['sentence2']}" for r in rows], "masked_lm", vocab_size=200)
    config = archlab.Seq2SeqConfig(
        **{**TINY_SEQ2SEQ, "vocab_size": len(tokenizer), "position_embedding_type": "learned", **config},
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=None,
    )
    model = archlab.EncoderForMaskedLM(config)
    model.save_pretrained(folder)
    save_tokenizer(tokenizer, folder)
    return model


def test_a_masked_lm_folder_is_fine_tuned_as_berts_classifier(tmp_path: Path) -> None:
    """--task classification from a masked LM's folder (pretrain --model_kind masked_lm, or a converted BERT) fine-tunes
    its encoder with BERT's head (`EncoderForSequenceClassification`: the first token, the pooler), sentence pairs
    read with BERT's segment ids (second text 1) through the segment embeddings, whose second row then moves; an
    encoder-decoder's folder stays refused (its decoder would be dropped)."""
    rows = pair_rows(80, 1)
    base = masked_lm_folder(tmp_path / "mlm", rows, type_vocab_size=2)
    Dataset.from_list(rows).to_csv(tmp_path / "train.csv")
    Dataset.from_list(pair_rows(40, 2)).to_csv(tmp_path / "validation.csv")
    files = [tmp_path / "train.csv", tmp_path / "validation.csv"]
    out = tmp_path / "out"
    metrics = finetune.main(classification_args(out, tmp_path / "mlm", *files, "--max_steps", "40"))
    assert metrics["eval_accuracy"] >= 0.9
    model = AutoModelForSequenceClassification.from_pretrained(out)
    assert type(model) is archlab.EncoderForSequenceClassification and model.pooler is not None
    before, after = base.encoder.token_type_embeddings.weight, model.encoder.token_type_embeddings.weight
    assert not torch.equal(after[1], before[1])
    # the saved tokenizer returns the segment ids, as BERT's does: the pipeline fed the pair segment 0 throughout
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert "token_type_ids" in tokenizer(rows[0]["sentence1"], rows[0]["sentence2"])
    pair = {"text": rows[0]["sentence1"], "text_pair": rows[0]["sentence2"]}
    scores = pipeline("text-classification", model=model, tokenizer=tokenizer, top_k=None)(pair)
    inputs = tokenizer(pair["text"], pair["text_pair"], return_tensors="pt", return_token_type_ids=True)
    with torch.no_grad():
        expected = model(**inputs).logits.softmax(-1)[0]
    by_label = {s["label"]: s["score"] for s in scores}
    assert_close_to_scale(torch.tensor([by_label[model.config.id2label[i]] for i in range(2)]), expected)

    archlab.Seq2SeqForConditionalGeneration(base.config).save_pretrained(tmp_path / "seq2seq")
    with pytest.raises(ValueError, match="--task classification cannot train: .*a masked LM's encoder"):
        finetune.main(classification_args(tmp_path / "refused", tmp_path / "seq2seq", *files))
    assert not (tmp_path / "refused").exists()


def test_pairs_for_a_model_with_one_segment_type_leave_the_segment_ids_out(tmp_path: Path) -> None:
    """A masked LM with one segment type (`type_vocab_size=1`: a RoBERTa's, or one exported to BERT and back) reads
    segment 0 everywhere; the pair's segment ids 1 indexed past its table ("index out of range in self" at the first
    step): they are left out, as for a model without segment embeddings."""
    rows = pair_rows(16, 1)
    masked_lm_folder(tmp_path / "mlm", rows, type_vocab_size=1)
    Dataset.from_list(rows).to_csv(tmp_path / "train.csv")
    files = [tmp_path / "train.csv", tmp_path / "train.csv"]
    metrics = finetune.main(classification_args(tmp_path / "out", tmp_path / "mlm", *files, "--max_steps", "2"))
    assert np.isfinite(metrics["eval_loss"])


# ---------------------------------------------------------------------------------------------------------------
# Token classification (named entities), as run_ner.py trains it
# ---------------------------------------------------------------------------------------------------------------
PEOPLE = (("John", "Smith"), ("Mary",), ("Ann", "Lee"), ("Bob",))
PLACES = (("New", "York"), ("Paris",), ("Rome",), ("San", "Diego"))


def ner_rows(n: int, seed: int) -> list[dict[str, list[str]]]:
    """Sentences of a person, a verb and a place, tagged IOB2: the entities' words never occur elsewhere, and a
    name's second word follows its first, so a causal model tells B- from I- as well."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        person, place = rng.choice(PEOPLE), rng.choice(PLACES)
        verb = rng.choice(["lives in", "went to", "likes"]).split()
        tags = ["B-PER", *["I-PER"] * (len(person) - 1), *["O"] * len(verb), "B-LOC", *["I-LOC"] * (len(place) - 1)]
        rows.append({"tokens": [*person, *verb, *place, "."], "ner_tags": [*tags, "O"]})
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def ner_args(out: Path, base: Path, train: Path, validation: Path, *extra: str) -> list[str]:
    files = ["--train_file", str(train), "--validation_file", str(validation)]
    return run_args(
        out, "--task", "token-classification", "--model_name_or_path", str(base), *files, "--block_size", "32", *extra
    )


def test_word_labels_sit_on_the_first_sub_token() -> None:
    """run_ner.py's alignment: a word's label on its first sub-token, -100 on the later ones and on special tokens;
    --label_all_tokens labels the later ones too, a B- label as its I- (a B- without an I- keeps its label)."""
    word_ids, labels = [None, 0, 0, 1, 2, 2, None], [0, 2, 3]  # B-PER, O, B-MISC
    b_to_i = {0: 1, 1: 1, 2: 2, 3: 3}  # B-PER -> I-PER; B-MISC has no I-MISC
    assert aligned_labels(word_ids, labels, False, b_to_i) == [-100, 0, -100, 2, 3, -100, -100]
    assert aligned_labels(word_ids, labels, True, b_to_i) == [-100, 0, 1, 2, 3, 3, -100]


@pytest.mark.parametrize("kind", ["decoder", "masked_lm"])
def test_words_are_tokenized_as_the_sentence_the_pipeline_reads(kind: str) -> None:
    """Each word's tokens are those of the words joined by spaces (what the pipeline tokenizes): archlab's byte-level
    BPE encoded every word of `is_split_into_words` as the start of a text (`lives` -> `liv es`, not `Ġlives`), so
    the model was trained on tokens it never sees at inference. Labels follow each word's first token."""
    rows = ner_rows(30, 0)
    algorithm = "bpe" if kind == "decoder" else "wordpiece"
    tokenizer = train_tokenizer([" ".join(r["tokens"]) for r in rows], kind, algorithm, 300, min_frequency=1)
    options = finetune.FinetuneArguments(label_column_name="ner_tags")
    label2id = {"B-LOC": 0, "B-PER": 1, "I-LOC": 2, "I-PER": 3, "O": 4}
    encoded = tokenize_token_classification(Dataset.from_list(rows), tokenizer, options, 32, None, "tokens", label2id)
    for row, example in zip(rows, encoded):
        assert example["input_ids"] == tokenizer(" ".join(row["tokens"]))["input_ids"]
        assert [label2id[t] for t in row["ner_tags"]] == [i for i in example["labels"] if i != IGNORE_INDEX]
    as_starts = tokenizer(rows[0]["tokens"], is_split_into_words=True)["input_ids"]  # (each word a text's start)
    assert (as_starts == encoded[0]["input_ids"]) == (kind == "masked_lm")  # (WordPiece drops the space anyway)


def test_a_csv_gives_words_and_labels_as_whitespace_separated_text() -> None:
    """A CSV cell holds text, not a list: its words and its labels are read split on whitespace, the counts checked."""
    from archlab.training.token_classification import check_token_classification_columns

    options = finetune.FinetuneArguments(label_column_name="ner_tags")
    csv = Dataset.from_list([{"tokens": "Ann Lee  went", "ner_tags": "B-PER I-PER O"}])
    read = check_token_classification_columns(csv, "train", options, "tokens")
    assert read[0] == {"tokens": ["Ann", "Lee", "went"], "ner_tags": ["B-PER", "I-PER", "O"]}
    with pytest.raises(ValueError, match="Row 0 of the validation split has 3 words and 2 labels"):
        bad = Dataset.from_list([{"tokens": "Ann Lee went", "ner_tags": "B-PER O"}])
        check_token_classification_columns(bad, "validation", options, "tokens")


def test_entity_scores_follow_seqeval() -> None:
    """Entity-level precision/recall/F1 by seqeval's default (conlleval) rules, and token accuracy, hand-computed:
    a `B-PER I-LOC` is a one-token PER and a one-token LOC (neither the gold PER), a lone `I-ORG` after `O` an ORG."""
    gold = [["B-PER", "I-PER", "O", "B-LOC"], ["B-ORG", "O"]]
    found = [["B-PER", "I-LOC", "O", "B-LOC"], ["I-ORG", "O"]]
    # gold: PER 0-1, LOC 3, ORG 0; found: PER 0, LOC 1, LOC 3, ORG 0 -> 2 right of 4 found, of 3 there
    scores = entity_scores(gold, found)
    assert scores == pytest.approx({"precision": 2 / 4, "recall": 2 / 3, "f1": 4 / 7, "accuracy": 4 / 6})
    assert entity_scores(gold, [["O"] * 4, ["O"] * 2]) == pytest.approx(
        {"precision": 0.0, "recall": 0.0, "f1": 0.0, "accuracy": 2 / 6}
    )
    # IOBES: E- and S- close an entity; another type's tag inside one splits it: found X 0, Y 1, Y 2 (1 right of 3),
    # of X 0-1, Y 2 -> P 1/3, R 1/2, F1 2/5
    assert entity_scores([["B-X", "E-X", "S-Y"]], [["B-X", "I-Y", "S-Y"]])["f1"] == pytest.approx(2 / 5)


def test_entity_level_metrics_score_each_type_as_seqeval() -> None:
    """--return_entity_level_metrics (run_ner.py's flag): each entity type's precision, recall, F1 and number (its
    entities in the references), hand-computed; a type only predicted is listed with 0s and number 0 (seqeval's
    report lists the types of either side, `zero_division` 0)."""
    from archlab.training.metrics import entity_type_scores, token_classification_metrics

    gold = [["B-PER", "I-PER", "O", "B-LOC"], ["B-ORG", "O"], ["O"]]
    found = [["B-PER", "I-LOC", "O", "B-LOC"], ["I-ORG", "O"], ["B-MISC"]]
    # gold: PER 0-1, LOC 3, ORG 0; found: PER 0, LOC 1, LOC 3, ORG 0, MISC 0
    assert entity_type_scores(gold, found) == pytest.approx(
        {
            **{"LOC_precision": 1 / 2, "LOC_recall": 1.0, "LOC_f1": 2 / 3, "LOC_number": 1},
            **{"MISC_precision": 0.0, "MISC_recall": 0.0, "MISC_f1": 0.0, "MISC_number": 0},
            **{"ORG_precision": 1.0, "ORG_recall": 1.0, "ORG_f1": 1.0, "ORG_number": 1},
            **{"PER_precision": 0.0, "PER_recall": 0.0, "PER_f1": 0.0, "PER_number": 1},
        }
    )
    id2label = {0: "O", 1: "B-PER", 2: "I-PER"}
    logits = np.eye(3)[[[1, 2, 0, 0], [0, 1, 1, 0]]]  # row 2: B-PER B-PER vs gold B-PER I-PER
    labels = np.array([[1, -100, 0, -100], [0, 1, 2, -100]])
    prediction = EvalPrediction(predictions=logits, label_ids=labels)
    overall = {"precision": 1 / 3, "recall": 1 / 2, "f1": 0.4, "accuracy": 4 / 5}
    assert token_classification_metrics(id2label)(prediction) == pytest.approx(overall)
    with_types = {**overall, "PER_precision": 1 / 3, "PER_recall": 1 / 2, "PER_f1": 0.4, "PER_number": 2}
    assert token_classification_metrics(id2label, entity_level=True)(prediction) == pytest.approx(with_types)
    # a type of the label set that neither side holds is listed with 0s, so every evaluation reports the same keys
    with_loc = {**with_types, "LOC_precision": 0.0, "LOC_recall": 0.0, "LOC_f1": 0.0, "LOC_number": 0}
    scores = token_classification_metrics({**id2label, 3: "B-LOC", 4: "I-LOC"}, entity_level=True)(prediction)
    assert scores == pytest.approx(with_loc)


def test_an_entity_types_score_can_be_the_metric_for_best_model(tmp_path: Path, ner_files: Path) -> None:
    """With --return_entity_level_metrics, `--metric_for_best_model PER_f1` was refused at the start as a metric the
    evaluations do not report; it is now read once the labels are known, and a type the labels lack is refused then,
    naming the types, before anything is written."""
    rows = ner_rows(50, 0)
    tokenizer = train_tokenizer([" ".join(r["tokens"]) for r in rows], "decoder", vocab_size=300, min_frequency=1)
    archlab.DecoderForCausalLM(tiny_decoder_config(vocab_size=len(tokenizer))).save_pretrained(tmp_path / "base")
    save_tokenizer(tokenizer, tmp_path / "base")
    out = tmp_path / "out"
    args = ner_args(out, tmp_path / "base", ner_files / "train.jsonl", ner_files / "validation.jsonl")
    best = ["--eval_strategy", "steps", "--eval_steps", "1", "--save_steps", "1", "--load_best_model_at_end", "true"]
    flags = [*args, "--max_steps", "2", *best, "--return_entity_level_metrics"]
    with pytest.raises(ValueError, match="labels tag the entity types LOC, PER; --return_entity_level_metrics"):
        finetune.main([*flags, "--metric_for_best_model", "ORG_f1"])
    assert not out.exists()
    with pytest.raises(ValueError, match="--metric_for_best_model PER_f1: --task token-classification's evaluations"):
        finetune.main([*args, "--metric_for_best_model", "PER_f1"])  # (without the flag)
    metrics = finetune.main([*flags, "--metric_for_best_model", "PER_f1"])
    assert "eval_PER_f1" in metrics and "eval_LOC_number" in metrics


def test_token_classification_metrics_score_the_labelled_tokens_only() -> None:
    """`compute_metrics` reads the argmax at the tokens with a label (the words' first sub-tokens) alone."""
    from archlab.training.metrics import token_classification_metrics

    id2label = {0: "O", 1: "B-PER", 2: "I-PER"}
    logits = np.eye(3)[[[1, 2, 0, 0], [0, 1, 1, 0]]]  # (2, 4, 3)
    labels = np.array([[1, -100, 0, -100], [0, 1, 2, -100]])  # row 2: B-PER B-PER vs gold B-PER I-PER
    scores = token_classification_metrics(id2label)(EvalPrediction(predictions=logits, label_ids=labels))
    assert scores == pytest.approx({"precision": 1 / 3, "recall": 1 / 2, "f1": 0.4, "accuracy": 4 / 5})


@pytest.fixture(scope="module")
def ner_files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("ner")
    write_jsonl(folder / "train.jsonl", ner_rows(80, 1))
    write_jsonl(folder / "validation.jsonl", ner_rows(24, 2))
    return folder


@pytest.mark.parametrize("start", ["decoder", "masked_lm"])
def test_token_classification_end_to_end(tmp_path: Path, ner_files: Path, start: str) -> None:
    """A causal LM's folder trains `DecoderForTokenClassification`, a masked LM's `EncoderForTokenClassification`, to
    entity F1 1 on the toy set; the labels are saved in the config, the test file's predictions as run_ner.py writes
    them (the labels of each example's scored tokens, one line each), the card reports the metrics, and the saved folder
    tags entities through `pipeline("token-classification", aggregation_strategy="simple")`."""
    rows = ner_rows(50, 0)
    if start == "decoder":
        tokenizer = train_tokenizer([" ".join(r["tokens"]) for r in rows], "decoder", vocab_size=300, min_frequency=1)
        archlab.DecoderForCausalLM(tiny_decoder_config(vocab_size=len(tokenizer))).save_pretrained(tmp_path / "base")
        save_tokenizer(tokenizer, tmp_path / "base")
    else:
        masked_lm_folder(tmp_path / "base", [{"sentence1": " ".join(r["tokens"]), "sentence2": ""} for r in rows])
    out, validation = tmp_path / "out", ner_files / "validation.jsonl"
    args = ner_args(out, tmp_path / "base", ner_files / "train.jsonl", validation, "--max_steps", "40")
    # (byte-level BPE cuts words into pieces: the pipeline's "simple" grouping reads each piece's own label, so the
    # decoder learns them all; WordPiece keeps these words whole)
    every_piece = ["--label_all_tokens", "true"] if start == "decoder" else []
    metrics = finetune.main([*args, *every_piece, "--test_file", str(validation), "--return_entity_level_metrics"])
    assert metrics["eval_f1"] == 1.0 and metrics["eval_accuracy"] == 1.0 and metrics["predict_f1"] == 1.0
    assert metrics["eval_PER_f1"] == metrics["eval_LOC_f1"] == 1.0 and metrics["predict_PER_number"] == 24
    assert metrics["before_eval_f1"] < 0.5
    model = AutoModelForTokenClassification.from_pretrained(out)
    classes = {"decoder": archlab.DecoderForTokenClassification, "masked_lm": archlab.EncoderForTokenClassification}
    assert type(model) is classes[start]
    assert model.config.id2label == {0: "B-LOC", 1: "B-PER", 2: "I-LOC", 3: "I-PER", 4: "O"}
    lines = (out / "predictions.txt").read_text().splitlines()  # (with --label_all_tokens: a label per piece)
    assert len(lines) == 24 and (start == "decoder" or lines == [" ".join(r["ner_tags"]) for r in ner_rows(24, 2)])
    card = ModelCard.load(out / "README.md")
    assert card.data.pipeline_tag == "token-classification"
    assert {"precision", "recall", "f1"} <= {m.metric_type for m in card.data.eval_results}
    tagger = pipeline("token-classification", model=str(out), aggregation_strategy="simple")
    found = {(e["entity_group"], e["word"].strip()) for e in tagger("Ann Lee went to San Diego .")}
    assert {("PER", "Ann Lee"), ("LOC", "San Diego")} <= found


def test_a_new_token_classifiers_dropout_is_set_by_config_overrides(tmp_path: Path, ner_files: Path) -> None:
    """`DecoderForTokenClassification` reads its dropout from `classifier_dropout` (else `hidden_dropout`, else 0.1,
    as Llama's head), fields DecoderConfig does not declare: --config_overrides refused them as unknown, so a new
    token classifier trained with dropout 0.1 whatever was asked."""
    train = str(ner_files / "train.jsonl")
    overrides = f"{TINY_DECODER_OVERRIDES},classifier_dropout=0.0"
    args = run_args(tmp_path / "out", "--task", "token-classification", "--train_file", train, "--max_steps", "1")
    finetune.main([*args, "--config_overrides", overrides, "--tokenizer_vocab_size", "300", "--max_eval_samples", "4"])
    assert AutoModelForTokenClassification.from_pretrained(tmp_path / "out").dropout.p == 0.0


def test_hub_class_labels_train_under_their_names(tmp_path: Path, ner_files: Path) -> None:
    """A data set whose labels are a `Sequence(ClassLabel)` (CoNLL-2003's `ner_tags`) trains under the ClassLabel's
    ids and names; --label_all_tokens gives a word's later sub-tokens its I- label by name."""
    from datasets import Sequence

    names = ["O", "B-PER", "I-PER", "B-LOC", "I-LOC"]
    rows = [{"tokens": r["tokens"], "ner_tags": [names.index(t) for t in r["ner_tags"]]} for r in ner_rows(30, 3)]
    features = Features({"tokens": Sequence(Value("string")), "ner_tags": Sequence(ClassLabel(names=names))})
    DatasetDict({split: Dataset.from_list(rows, features=features) for split in ("train", "validation")}).save_to_disk(
        tmp_path / "data"
    )
    bytes_only = train_tokenizer(["xyz"] * 5, "decoder", vocab_size=270)  # "John" -> J o h n
    encoded = tokenize_token_classification(
        Dataset.from_list([{"tokens": ["John"], "ner_tags": [1]}], features=features),
        bytes_only,
        finetune.FinetuneArguments(label_column_name="ner_tags", label_all_tokens=True),
        32,
        None,
        "tokens",
        {i: i for i in range(len(names))},
    )
    assert encoded[0]["labels"] == [IGNORE_INDEX, 1, 2, 2, 2]  # <s>, then B-PER and its I-PER by name
    base = tmp_path / "base"
    tokenizer = train_tokenizer([" ".join(r["tokens"]) for r in rows], "decoder", vocab_size=300)
    archlab.DecoderForCausalLM(tiny_decoder_config(vocab_size=len(tokenizer))).save_pretrained(base)
    save_tokenizer(tokenizer, base)
    args = run_args(tmp_path / "out", "--task", "token-classification", "--model_name_or_path", str(base))
    finetune.main([*args, "--dataset_name", str(tmp_path / "data"), "--max_steps", "2"])
    assert AutoModelForTokenClassification.from_pretrained(tmp_path / "out").config.id2label == dict(enumerate(names))


def test_bad_token_classification_inputs_are_named_before_training(tmp_path: Path, ner_files: Path) -> None:
    """Rows whose words and labels differ in number, one label per row, an unlabelled test file (run_ner.py scores its
    predictions), --label_all_tokens or --return_entity_level_metrics for another task and an encoder-decoder's
    folder are refused before anything is written."""
    rows = ner_rows(8, 0)
    bad = write_jsonl(tmp_path / "bad.jsonl", [*rows[:3], {**rows[3], "ner_tags": rows[3]["ner_tags"][:-1]}])
    train = ner_files / "train.jsonl"
    out = tmp_path / "out"
    new_model = run_args(out, "--task", "token-classification", "--validation_file", str(train))
    with pytest.raises(ValueError, match=r"Row 3 of the train split has \d+ words and \d+ labels"):
        finetune.main([*new_model, "--train_file", str(bad)])
    per_row = write_jsonl(tmp_path / "per_row.jsonl", [{"tokens": r["tokens"], "ner_tags": 1} for r in rows])
    with pytest.raises(ValueError, match="one integer per row.*--task classification"):
        finetune.main([*run_args(out, "--task", "token-classification"), "--train_file", str(per_row)])
    unlabelled = write_jsonl(tmp_path / "test.jsonl", [{"tokens": r["tokens"]} for r in rows])
    with pytest.raises(ValueError, match="test split has no label column 'ner_tags'"):
        finetune.main(
            [
                *run_args(out, "--task", "token-classification", "--train_file", str(train)),
                "--test_file",
                str(unlabelled),
            ]
        )
    with pytest.raises(ValueError, match="--label_all_tokens is for --task token-classification"):
        finetune.main(run_args(out, "--task", "classification", "--label_all_tokens", "true"))
    with pytest.raises(ValueError, match="--return_entity_level_metrics is for --task token-classification, not"):
        finetune.main(run_args(out, "--task", "classification", "--return_entity_level_metrics"))
    config = archlab.Seq2SeqConfig(**TINY_SEQ2SEQ)
    archlab.Seq2SeqForConditionalGeneration(config).save_pretrained(tmp_path / "seq2seq")
    with pytest.raises(ValueError, match="--task token-classification cannot train: .*a masked LM's encoder"):
        finetune.main(ner_args(out, tmp_path / "seq2seq", train, train))
    assert not out.exists()


def test_a_classifier_of_the_other_kind_gets_a_new_head(tmp_path: Path, work: Path, ner_files: Path) -> None:
    """A sequence classifier's folder (a reward model) given to --task token-classification, or a token classifier's
    to --task classification: both heads are `score`, and another number of labels failed at the load ("You set
    `ignore_mismatched_sizes` to `False`") after the data was tokenized; a new head is trained."""
    tokenizer = load_tokenizer(work / "base")
    config = tiny_decoder_config(vocab_size=len(tokenizer), num_labels=3)
    for head, task in (("DecoderForSequenceClassification", "token"), ("DecoderForTokenClassification", "sequence")):
        getattr(archlab, head)(config).save_pretrained(tmp_path / head)
        save_tokenizer(tokenizer, tmp_path / head)
        out = tmp_path / f"{task}-out"
        if task == "token":
            train = ner_files / "train.jsonl"
            metrics = finetune.main(ner_args(out, tmp_path / head, train, train, "--max_steps", "2"))
            loaded = AutoModelForTokenClassification.from_pretrained(out)
        else:
            files = (work / "train.csv", work / "validation.csv")
            metrics = finetune.main(classification_args(out, tmp_path / head, *files, "--max_steps", "2"))
            loaded = AutoModelForSequenceClassification.from_pretrained(out)
        assert np.isfinite(metrics["eval_loss"]) and loaded.score.out_features == len(loaded.config.id2label) != 3


# --- question answering (SQuAD's layout) ------------------------------------------------------------------------

QA_WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def qa_options(**flags) -> finetune.FinetuneArguments:
    return finetune.FinetuneArguments(task="question-answering", **flags)


def test_the_default_question_answering_rows_each_have_their_own_id() -> None:
    """The embedded corpus's questions are evaluated by id: two functions of one name in a file (two classes'
    `__init__`) gave both the same id, and `--task question-answering` without data stopped at the id check."""
    from archlab.training.question_answering import check_unique_ids, function_questions

    rows = list(function_questions("validation"))
    ids = [row["id"] for row in rows]
    assert len(set(ids)) == len(ids) > 100
    check_unique_ids(Dataset.from_list(rows), "validation")


@pytest.mark.parametrize("kind", ["masked_lm", "decoder"])
def test_question_answering_windows_label_the_answer_only_where_it_is_whole(kind: str) -> None:
    """A context longer than --max_seq_length is cut into windows overlapping by --doc_stride tokens; a window that
    holds the whole answer is labelled at its first and last token (also for an answer that ends the context, with a
    decoder tokenizer's no closing token after it), and one that holds part of it (split by a window boundary) or
    none of it at index 0, as run_qa.py labels them."""
    tokenizer = train_tokenizer(
        [" ".join(QA_WORDS), "which word ?"] * 10, kind, vocab_size=120 if kind != "decoder" else 300
    )
    context = " ".join(QA_WORDS)
    rows = [
        {"question": "which word ?", "context": context, "answers": {"text": [a], "answer_start": [context.index(a)]}}
        for a in ("zeta eta", "mu")
    ]
    question = len(tokenizer("which word ?", add_special_tokens=False)["input_ids"])
    window = question + tokenizer.num_special_tokens_to_add(pair=True) + 4  # 4 context tokens a window
    features = tokenize_question_answering(Dataset.from_list(rows), tokenizer, qa_options(doc_stride=2), window, None)
    labelled = {0: [], 1: []}
    for feature in features:
        answer = rows[feature["example_id"]]["answers"]["text"][0]
        start, end = feature["start_positions"], feature["end_positions"]
        spans = [o for o in feature["offset_mapping"] if o is not None]
        first, last = spans[0][0], spans[-1][1]
        at = context.index(answer)
        if (start, end) == (0, 0):
            assert not (first <= at and at + len(answer) <= last)
            continue
        labelled[feature["example_id"]].append(feature)
        assert tokenizer.decode(feature["input_ids"][start : end + 1]).strip() == answer
        assert context[feature["offset_mapping"][start][0] : feature["offset_mapping"][end][1]].strip() == answer
    assert len(labelled[0]) == 1 and len(labelled[1]) == 1
    split = [f for f in features if f["example_id"] == 0 and (f["start_positions"], f["end_positions"]) == (0, 0)]
    assert any("zeta" in tokenizer.decode(f["input_ids"]) for f in split)  # the answer cut by a window's end
    last_context_token = max(i for i, o in enumerate(labelled[1][0]["offset_mapping"]) if o is not None)
    assert labelled[1][0]["end_positions"] == last_context_token


def test_question_answering_batches_pad_on_the_right_whatever_the_tokenizer_says() -> None:
    """The labels and offsets are computed on unpadded windows: a tokenizer that pads on the left (a decoder's, for
    generation) shifted a short row's tokens under its labels (the stock `DataCollatorWithPadding`); the task's
    collator pads on the right and leaves the evaluation's columns out of the batch."""
    from transformers import DataCollatorWithPadding

    from archlab.training.question_answering import QuestionAnsweringCollator

    tokenizer = train_tokenizer([" ".join(QA_WORDS)] * 10, "decoder", vocab_size=300)
    tokenizer.padding_side = "left"
    context = " ".join(QA_WORDS)
    rows = [
        {"question": "which?", "context": text, "answers": {"text": ["beta"], "answer_start": [text.index("beta")]}}
        for text in (context, "alpha beta")
    ]
    features = tokenize_question_answering(Dataset.from_list(rows), tokenizer, qa_options(doc_stride=8), 64, None)
    beta = tokenizer.convert_tokens_to_ids("Ġbeta")
    batch = QuestionAnsweringCollator(tokenizer, 64)(list(features))
    assert set(batch) == {"input_ids", "attention_mask", "start_positions", "end_positions"}
    assert batch["input_ids"][torch.arange(2), batch["start_positions"]].tolist() == [beta, beta]
    columns = ["input_ids", "attention_mask", "start_positions", "end_positions"]
    stock = DataCollatorWithPadding(tokenizer)([{k: f[k] for k in columns} for f in features])
    assert stock["input_ids"][1, stock["start_positions"][1]] != beta  # what the stock collator did


def test_a_windows_loss_does_not_depend_on_the_batch_it_falls_in() -> None:
    """The start and end losses are softmaxes over every position, padding included: padded to the longest window of
    its batch, a short window's loss changed with the windows beside it, so 2 batches of 2 (2 processes, or gradient
    accumulation) did not train what 1 batch of 4 does. Every window is padded to the window length (run_qa.py's
    default): the mean of the halves' losses is the whole batch's."""
    from archlab.training.question_answering import QuestionAnsweringCollator

    tokenizer = train_tokenizer([" ".join(QA_WORDS)] * 10, "decoder", vocab_size=300)
    rows = [
        {"question": "which?", "context": text, "answers": {"text": ["beta"], "answer_start": [text.index("beta")]}}
        for text in (" ".join(QA_WORDS), "alpha beta", "beta gamma delta", "alpha beta gamma")
    ]
    features = list(tokenize_question_answering(Dataset.from_list(rows), tokenizer, qa_options(doc_stride=4), 20, None))
    features = features[:4]  # (the long context's windows, then two short contexts)
    assert max(len(f["input_ids"]) for f in features[:2]) > max(len(f["input_ids"]) for f in features[2:])
    model = archlab.DecoderForQuestionAnswering(tiny_decoder_config(vocab_size=len(tokenizer))).eval()
    collate = QuestionAnsweringCollator(tokenizer, 20)
    with torch.no_grad():
        whole = model(**collate(features)).loss
        halves = [model(**collate(features[:2])).loss, model(**collate(features[2:])).loss]
    torch.testing.assert_close(whole, sum(halves) / 2, rtol=1e-5, atol=1e-6)


def test_squad_exact_match_and_f1_are_the_official_scripts() -> None:
    """Hand-computed with SQuAD v1.1's evaluation script: lower case, punctuation and articles dropped; each row's
    best over its true answers; a row without a true answer (v2) right only when the prediction is empty."""
    from archlab.training.question_answering import normalize_answer

    assert normalize_answer("  The  Cat's,  an ear! ") == "cats ear"
    predictions = {"a": "The Cat!", "b": "big red dog", "c": "x", "d": ""}
    references = {"a": ["cat"], "b": ["the red dog", "dog"], "c": ["y"], "d": []}
    # a: exact. b: "big red dog" vs "red dog": precision 2/3, recall 1, F1 0.8 (vs "dog": 0.5). c: 0. d: right.
    scores = squad_metrics(predictions, references)
    assert scores["exact_match"] == pytest.approx(100 * 2 / 4)
    assert scores["f1"] == pytest.approx(100 * (1 + 0.8 + 0 + 1) / 4)


def test_answers_are_the_best_span_over_every_window_of_a_row() -> None:
    """n-best starts and ends within the context (never the question's tokens), ending at or after their start and
    at most --max_answer_length tokens long, the best sum over both windows of row 0; the -100 the evaluation pads
    short batches with is never read."""
    from archlab.training.question_answering import answers_from_logits

    context = "one two three four"
    spans = [(0, 3), (4, 7), (8, 13), (14, 18)]
    features = {
        "example_id": [0, 0, 1],
        "id": ["r0", "r0", "r1"],
        "context": [context] * 3,
        "offset_mapping": [[None, None, *spans[:2]], [None, None, *spans[2:]], [None, spans[0], spans[1]]],
    }
    start, end = np.full((3, 5), -100.0), np.full((3, 5), -100.0)
    start[0, :4], end[0, :4] = [9, 9, 0.5, 2], [9, 9, 3, 1]  # the question's tokens score highest: never chosen
    start[1, :4], end[1, :4] = [0, 0, 3, 0], [0, 0, 0, 4]  # "three four" (3 + 4): the best
    start[2, :3], end[2, :3] = [0, 1, 5], [0, 2, -50]  # the best start's only end is poor: "one" (1 + 2)
    assert answers_from_logits(features, start, end, 20, 30) == {"r0": "three four", "r1": "one"}
    assert answers_from_logits(features, start, end, 20, 1)["r0"] == "four"  # one token at most: 0 + 4


def test_no_answer_is_predicted_where_the_null_score_wins_by_more_than_the_threshold() -> None:
    """--version_2_with_negative (utils_qa.py's rule): a row's null score is the smallest over its windows of the
    logits at index 0, and the row is predicted "" where the null score minus its best span's score is above
    --null_score_diff_threshold (strictly), else its best span. Without the flag every row gets its span."""
    from archlab.training.question_answering import answers_from_logits

    context = "one two three four"
    spans = [(0, 3), (4, 7), (8, 13), (14, 18)]
    features = {
        "example_id": [0, 0, 1],
        "id": ["r0", "r0", "r1"],
        "context": [context] * 3,
        "offset_mapping": [[None, None, *spans[:2]], [None, None, *spans[2:]], [None, spans[0], spans[1]]],
    }
    start, end = np.full((3, 5), -100.0), np.full((3, 5), -100.0)
    start[0, :4], end[0, :4] = [3, 9, 2, 0.5], [3, 9, 0, 3]  # null 6; best span "one two": 2 + 3 = 5
    start[1, :4], end[1, :4] = [1, 0, 1, 0], [1, 0, 0, 1]  # null 2, the row's smallest; spans at most 2
    start[2, :3], end[2, :3] = [4, 1, 5], [4, 2, -50]  # null 8; best span "one": 1 + 2 = 3

    def answers(threshold: float) -> dict[str, str]:
        return answers_from_logits(features, start, end, 20, 30, True, threshold)

    assert answers_from_logits(features, start, end, 20, 30) == {"r0": "one two", "r1": "one"}
    # r0: 2 - 5 = -3 (with window 0's null, 6 - 5 = 1, or the largest, it was ""); r1: 8 - 3 = 5
    assert answers(0.0) == {"r0": "one two", "r1": ""}
    assert answers(-3.0)["r0"] == "one two" and answers(-3.01)["r0"] == ""
    assert answers(5.0)["r1"] == "one" and answers(4.99)["r1"] == ""


def test_nbest_lists_and_null_odds_are_utils_qas() -> None:
    """utils_qa.py's n-best lists: the `n_best_size` best spans over every window of a row, best first, each with its
    start and end logits and a probability (a softmax over the listed spans' scores); with
    --version_2_with_negative the row's null answer ("", the smallest null score over its windows) is listed too,
    appended where it is not among the best, and the null odds are the null score minus the best span's score."""
    from archlab.training.question_answering import best_spans

    context = "one two three four"
    features = {
        "example_id": [0, 0, 1],
        "id": ["r0", "r0", "r1"],
        "context": [context] * 3,
        "offset_mapping": [[None, None, (0, 3), (4, 7)], [None, None, (8, 13), (14, 18)], [None, (0, 3)]],
    }
    start, end = np.full((3, 4), -100.0), np.full((3, 4), -100.0)
    start[0], end[0] = [4, -9, 2, 0.5], [3, -9, 0.25, 3.5]  # null 7; "one two" 5.5, "two" 4, "one" 2.25
    start[1], end[1] = [1, -9, 1.5, 0], [0.5, -9, 0, 1]  # null 1.5 (the row's); "three four" 2.5, "three" 1.5, ...
    start[2, :2], end[2, :2] = [2, 1], [1, 2]  # null 3; "one" 3
    e = np.exp

    def entry(start_logit, end_logit, text, probability):
        return {"start_logit": start_logit, "end_logit": end_logit, "text": text, "probability": probability}

    found = best_spans(features, start, end, 3, 30)
    top = e(5.5) + e(4) + e(2.5)
    assert found.answers == {"r0": "one two", "r1": "one"} and found.null_odds is None
    assert found.nbest["r0"] == [
        entry(2, 3.5, "one two", pytest.approx(e(5.5) / top)),
        entry(0.5, 3.5, "two", pytest.approx(e(4) / top)),
        entry(1.5, 1, "three four", pytest.approx(e(2.5) / top)),
    ]
    assert found.nbest["r1"] == [entry(1, 2, "one", 1.0)]

    found = best_spans(features, start, end, 3, 30, True)
    top += e(1.5)  # the null answer, below the best 3, appended
    assert found.nbest["r0"][-1] == entry(1, 0.5, "", pytest.approx(e(1.5) / top))
    assert [s["probability"] for s in found.nbest["r0"][:3]] == pytest.approx([e(5.5) / top, e(4) / top, e(2.5) / top])
    assert found.null_odds == {"r0": 1.5 - 5.5, "r1": 0.0}  # r1: 3 - 3, not above the threshold 0: its span
    assert found.answers == {"r0": "one two", "r1": "one"}
    assert found.nbest["r1"] == [entry(1, 2, "one", 0.5), entry(2, 1, "", 0.5)]
    assert best_spans(features, start, end, 3, 30, True, -4.5).answers == {"r0": "", "r1": ""}


def test_squad_v2_scores_every_row_and_breaks_them_down_by_answer() -> None:
    """Hand-computed with SQuAD v2.0's script: exact match and F1 over every row, a row without an answer right only
    for an empty prediction (and an answerable one wrong for it), then `HasAns_*` and `NoAns_*` over each kind with
    their counts; a true answer that normalises to nothing is no answer."""
    from archlab.training.question_answering import squad_v2_metrics

    predictions = {"a": "The Cat!", "b": "big red dog", "c": "", "d": "", "e": "x"}
    references = {"a": ["cat"], "b": ["the red dog"], "c": ["y"], "d": [], "e": []}
    # HasAns a, b, c: exact 1, 0, 0; F1 1, 0.8, 0. NoAns d, e: 1, 0 (both scores).
    assert squad_v2_metrics(predictions, references) == pytest.approx(
        {
            "exact_match": 100 * 2 / 5,
            "f1": 100 * 2.8 / 5,
            "HasAns_exact": 100 / 3,
            "HasAns_f1": 100 * 1.8 / 3,
            "HasAns_total": 3,
            "NoAns_exact": 50,
            "NoAns_f1": 50,
            "NoAns_total": 2,
        }
    )
    assert squad_v2_metrics({"f": ""}, {"f": ["The"]}) == {
        "exact_match": 100,
        "f1": 100,
        "NoAns_exact": 100,
        "NoAns_f1": 100,
        "NoAns_total": 1,
    }


COLOURS = ["red", "blue", "green", "amber", "violet", "cyan"]
FILLER = "the cat sat on a mat near big old tree by river and then slept".split()


def colour_rows(n: int, seed: int, unanswerable: int = 0) -> list[dict]:
    """SQuAD-layout rows whose answer is the one colour word in a context of filler words; every `unanswerable`-th
    row (SQuAD v2's) has no colour and no answer."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        words = rng.choices(FILLER, k=rng.randint(6, 14))
        if unanswerable and i % unanswerable == 0:
            answers = {"text": [], "answer_start": []}
            rows.append({"id": f"q{i}", "question": "which colour?", "context": " ".join(words), "answers": answers})
            continue
        at, colour = rng.randint(0, len(words)), rng.choice(COLOURS)
        words.insert(at, colour)
        start = len(" ".join(words[:at])) + (1 if at else 0)
        answers = {"text": [colour], "answer_start": [start]}
        rows.append({"id": f"q{i}", "question": "which colour?", "context": " ".join(words), "answers": answers})
    return rows


def qa_folder(folder: Path, kind: str) -> None:
    texts = [f"{r['question']} {r['context']}" for r in colour_rows(50, 0)]
    tokenizer = train_tokenizer(texts, kind, vocab_size=300 if kind == "decoder" else 200, min_frequency=1)
    if kind == "decoder":
        model = archlab.DecoderForCausalLM(tiny_decoder_config(vocab_size=len(tokenizer)))
    else:
        config = archlab.Seq2SeqConfig(
            **{**TINY_SEQ2SEQ, "vocab_size": len(tokenizer), "position_embedding_type": "learned"},
            type_vocab_size=2,
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            decoder_start_token_id=None,
        )
        model = archlab.EncoderForMaskedLM(config)
    model.save_pretrained(folder)
    save_tokenizer(tokenizer, folder)


def qa_args(out: Path, base: Path, files: Path, *extra: str) -> list[str]:
    data = ["--train_file", str(files / "train.jsonl"), "--validation_file", str(files / "dev.jsonl")]
    windows = ["--max_seq_length", "16", "--doc_stride", "4"]  # contexts of up to 16 tokens: some in two windows
    return run_args(out, "--task", "question-answering", "--model_name_or_path", str(base), *data, *windows, *extra)


@pytest.fixture(scope="module")
def qa_files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("qa")
    Dataset.from_list(colour_rows(160, 1)).to_json(folder / "train.jsonl")
    Dataset.from_list(colour_rows(40, 2)).to_json(folder / "dev.jsonl")
    return folder


def test_question_answering_from_a_masked_lm_end_to_end(tmp_path: Path, qa_files: Path) -> None:
    """--task question-answering from a masked LM's folder trains BERT's QA head to exact answers (SQuAD's exact
    match and F1 over the rows, their windows put back together), predicts a --test_file as {id: answer} JSON
    (run_qa.py's predict_predictions.json), and writes a question-answering card; an encoder-decoder's folder is
    refused before anything is read."""
    qa_folder(tmp_path / "mlm", "masked_lm")
    out = tmp_path / "out"
    test = ["--test_file", str(qa_files / "dev.jsonl"), "--max_steps", "60", "--per_device_train_batch_size", "16"]
    metrics = finetune.main(qa_args(out, tmp_path / "mlm", qa_files, *test))
    assert metrics["eval_exact_match"] >= 90 and metrics["eval_f1"] >= 90
    assert metrics["before_eval_exact_match"] < 50
    assert metrics["predict_exact_match"] == metrics["eval_exact_match"]
    predictions = json.loads((out / "predict_predictions.json").read_text())
    rows = colour_rows(40, 2)
    assert list(predictions) == [r["id"] for r in rows]
    assert sum(predictions[r["id"]] == r["answers"]["text"][0] for r in rows) >= 36
    check_utils_qa_files(out, [r["id"] for r in rows], version_2=False)
    model = archlab.EncoderForQuestionAnswering.from_pretrained(out)
    assert model.config.architectures == ["EncoderForQuestionAnswering"]
    assert ModelCard.load(out / "README.md").data.pipeline_tag == "question-answering"

    with pytest.raises(ValueError, match="holds an encoder-only `EncoderForQuestionAnswering`, and --task seq2seq"):
        finetune.main(run_args(tmp_path / "refused", "--task", "seq2seq", "--model_name_or_path", str(out)))
    archlab.Seq2SeqForConditionalGeneration(model.config).save_pretrained(tmp_path / "seq2seq")
    with pytest.raises(ValueError, match="--task question-answering cannot train: .*a masked LM's encoder"):
        finetune.main(qa_args(tmp_path / "refused", tmp_path / "seq2seq", qa_files))
    assert not (tmp_path / "refused").exists()


def test_squad_v2_rows_without_an_answer_are_predicted_empty_end_to_end(tmp_path: Path) -> None:
    """With --version_2_with_negative a third of the rows, without a colour and without an answer, are predicted
    "" where the model's null score wins: exact match goes past the 66.7 that predicting a span for every row caps
    it at, the v2 breakdowns are reported, and predict_predictions.json writes "" for them."""
    qa_folder(tmp_path / "mlm", "masked_lm")
    Dataset.from_list(colour_rows(160, 1, unanswerable=3)).to_json(tmp_path / "train.jsonl")
    dev = colour_rows(30, 2, unanswerable=3)
    Dataset.from_list(dev).to_json(tmp_path / "dev.jsonl")
    out = tmp_path / "out"
    flags = ["--version_2_with_negative", "--test_file", str(tmp_path / "dev.jsonl"), "--max_steps", "60"]
    metrics = finetune.main(qa_args(out, tmp_path / "mlm", tmp_path, *flags, "--per_device_train_batch_size", "16"))
    assert metrics["eval_exact_match"] > 100 * 2 / 3 and metrics["eval_NoAns_exact"] >= 80
    assert (metrics["eval_HasAns_total"], metrics["eval_NoAns_total"]) == (20, 10)
    predictions = json.loads((out / "predict_predictions.json").read_text())
    assert sum(predictions[r["id"]] == "" for r in dev if not r["answers"]["text"]) >= 8
    check_utils_qa_files(out, [r["id"] for r in dev], version_2=True)


def check_utils_qa_files(out: Path, ids: list[str], version_2: bool, prefixes=("eval", "predict")) -> None:
    """utils_qa.py's files of the evaluation and the prediction: {id: answer}, {id: n-best list} whose best span is
    the answer (where one is predicted) and whose probabilities add up to 1, and with v2 {id: null odds}, "" predicted
    exactly where they are above the threshold 0."""
    for prefix in prefixes:
        predictions = json.loads((out / f"{prefix}_predictions.json").read_text())
        nbest = json.loads((out / f"{prefix}_nbest_predictions.json").read_text())
        assert list(predictions) == list(nbest) == ids
        for row_id, answer in predictions.items():
            assert sum(entry["probability"] for entry in nbest[row_id]) == pytest.approx(1.0)
            assert {"start_logit", "end_logit", "text", "probability"} == set(nbest[row_id][0])
            assert answer == "" or answer == next(entry["text"] for entry in nbest[row_id] if entry["text"])
        if not version_2:
            assert not (out / f"{prefix}_null_odds.json").exists()
            continue
        null_odds = json.loads((out / f"{prefix}_null_odds.json").read_text())
        assert list(null_odds) == ids
        assert all((predictions[row_id] == "") == (odds > 0) for row_id, odds in null_odds.items())
        assert all(sum(entry["text"] == "" for entry in nbest[row_id]) == 1 for row_id in ids)  # the null answer


def test_squad_v2_from_a_decoder_runs_end_to_end(tmp_path: Path) -> None:
    """--version_2_with_negative from a decoder's folder, whose null answer is its first token (`<s>`): a few steps
    evaluate and predict without error and write utils_qa.py's files, null odds included."""
    qa_folder(tmp_path / "decoder", "decoder")
    Dataset.from_list(colour_rows(32, 1, unanswerable=3)).to_json(tmp_path / "train.jsonl")
    dev = colour_rows(9, 2, unanswerable=3)
    Dataset.from_list(dev).to_json(tmp_path / "dev.jsonl")
    flags = ["--version_2_with_negative", "--test_file", str(tmp_path / "dev.jsonl"), "--max_steps", "2"]
    metrics = finetune.main(qa_args(tmp_path / "out", tmp_path / "decoder", tmp_path, *flags))
    assert (metrics["eval_HasAns_total"], metrics["eval_NoAns_total"]) == (6, 3)
    check_utils_qa_files(tmp_path / "out", [r["id"] for r in dev], version_2=True)


def test_question_answering_from_a_decoder(tmp_path: Path, qa_files: Path) -> None:
    """From a decoder's folder the same task trains `DecoderForQuestionAnswering` (index 0, its `<s>`, labels the
    windows without the answer) well above where it starts."""
    qa_folder(tmp_path / "decoder", "decoder")
    flags = ["--max_steps", "60", "--per_device_train_batch_size", "16"]
    metrics = finetune.main(qa_args(tmp_path / "out", tmp_path / "decoder", qa_files, *flags))
    assert metrics["eval_exact_match"] >= 50 and metrics["before_eval_exact_match"] < 20
    check_utils_qa_files(tmp_path / "out", [r["id"] for r in colour_rows(40, 2)], version_2=False, prefixes=["eval"])
    assert type(archlab.DecoderForQuestionAnswering.from_pretrained(tmp_path / "out")).__name__.startswith("Decoder")


def test_bad_question_answering_inputs_are_named_before_training(tmp_path: Path, qa_files: Path) -> None:
    """An answer that is not at its `answer_start`, a row that is not SQuAD's answers, and a --doc_stride not below
    --max_seq_length each stop the run with the row or flag named, before anything is written."""
    qa_folder(tmp_path / "mlm", "masked_lm")
    out = tmp_path / "out"
    rows = colour_rows(8, 3)
    rows[5]["answers"]["answer_start"][0] += 1
    Dataset.from_list(rows).to_json(tmp_path / "train.jsonl")
    Dataset.from_list(colour_rows(4, 4)).to_json(tmp_path / "dev.jsonl")
    with pytest.raises(ValueError, match=r"Column 'answers' of the train split: row 5: the answer .* is not at"):
        finetune.main(qa_args(out, tmp_path / "mlm", tmp_path))
    with pytest.raises(ValueError, match="--doc_stride 16 must be less than --max_seq_length 16"):
        finetune.main([*qa_args(out, tmp_path / "mlm", qa_files), "--doc_stride", "16"])
    Dataset.from_list([{**r, "answers": r["answers"]["text"][0]} for r in rows]).to_json(tmp_path / "train.jsonl")
    with pytest.raises(ValueError, match="row 0 holds '[a-z]+', not SQuAD's answers"):
        finetune.main(qa_args(out, tmp_path / "mlm", tmp_path))
    assert not out.exists()


@pytest.mark.parametrize(
    ("task", "flags", "message"),
    [
        (
            "token-classification",
            ["--max_seq_length", "128"],
            "--max_seq_length: for --task question-answering, not --task token-classification .* cuts its examples at "
            "--block_size",
        ),
        ("classification", ["--doc_stride", "4", "--question_column", "q"], "--question_column, --doc_stride: for"),
        ("seq2seq", ["--max_seq_length", "64"], "cuts its examples at --max_source_length / --max_target_length"),
        # the defaults themselves (run_qa.py's 384 and 128), given: they were taken for flags left out
        ("token-classification", ["--max_seq_length", "384"], "--max_seq_length: for --task question-answering"),
        ("classification", ["--max-seq-length=384", "--doc_stride", "128"], "--max_seq_length, --doc_stride: for"),
    ],
)
def test_question_answering_flags_given_to_another_task_are_refused(tmp_path: Path, task, flags, message) -> None:
    """run_ner.py's and run_glue.py's --max_seq_length is question-answering's window here: given to another task it
    was ignored without a word (the examples cut at --block_size instead); each question-answering flag is refused
    for the other tasks, named, before anything is read, whatever its value."""
    train = write_jsonl(tmp_path / "train.jsonl", ner_rows(2, 0))
    with pytest.raises(ValueError, match=message):
        finetune.main([*run_args(tmp_path / "out", "--task", task, "--train_file", str(train)), *flags])
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("task", "flags", "message"),
    [
        ("seq2seq", ["--text_column_name", "document"], "--text_column_name: .* --source_column, --target_column"),
        ("instruct", ["--source_column", "q", "--label_column_name", "y"], "--label_column_name, --source_column: "),
        ("classification", ["--prompt_column", "q"], "--prompt_column: .* --text_column_name, --label_column_name"),
        ("question-answering", ["--target_column", "a"], "its columns are named by --question_column, --context_"),
        # given with their default values: refused all the same (they were taken for flags left out)
        ("seq2seq", ["--text_column_name", "text"], "--text_column_name: .* --source_column, --target_column"),
        ("classification", ["--messages_column=messages"], "--messages_column: .* --text_column_name, --label_col"),
    ],
)
def test_column_flags_of_another_task_are_refused_naming_the_tasks_own(tmp_path: Path, task, flags, message) -> None:
    """`--text_column_name document` given to --task seq2seq (run_summarization.py's --text_column, spelt as
    run_clm.py's) was ignored without a word and the run read the default `code` column."""
    train = write_jsonl(tmp_path / "train.jsonl", ner_rows(2, 0))
    with pytest.raises(ValueError, match=message):
        finetune.main([*run_args(tmp_path / "out", "--task", task, "--train_file", str(train)), *flags])
    assert not (tmp_path / "out").exists()


def test_rows_that_share_an_id_are_named_before_they_are_scored() -> None:
    """Answers are scored and written by row id: an evaluated or predicted split whose rows share an id (an article's
    id on each of its questions) was scored on the last of them alone, without a word. The training split's ids are
    not read."""
    from archlab.training.question_answering import check_question_answering_columns

    rows = colour_rows(4, 0)
    rows[3]["id"] = rows[1]["id"]
    for split in ("validation", "test"):
        with pytest.raises(ValueError, match=f"Column 'id' of the {split} split: rows 1 and 3 share the id 'q1'"):
            check_question_answering_columns(Dataset.from_list(rows), split, qa_options(), "text")
    assert len(check_question_answering_columns(Dataset.from_list(rows), "train", qa_options(), "text")) == 4


def test_unanswerable_rows_of_an_evaluated_split_are_announced(capsys) -> None:
    """SQuAD v2's rows without an answer are accepted (trained towards index 0), but every row is predicted a span:
    they score 0, and a v2 evaluation capped exact match and F1 at the answerable share without a word."""
    from archlab.training.question_answering import check_question_answering_columns

    rows = colour_rows(4, 0)
    rows[2]["answers"] = {"text": [], "answer_start": []}
    check_question_answering_columns(Dataset.from_list(rows), "train", qa_options(), "text")
    assert "no answer" not in capsys.readouterr().out
    check_question_answering_columns(Dataset.from_list(rows), "validation", qa_options(), "text")
    warning = capsys.readouterr().out
    assert "1 of the 4 rows of the validation split have no answer (SQuAD v2's)" in warning
    assert "without --version_2_with_negative" in warning and "at most 75.0" in warning
    check_question_answering_columns(
        Dataset.from_list(rows), "validation", qa_options(version_2_with_negative=True), "text"
    )
    assert "no answer" not in capsys.readouterr().out


def test_a_null_score_threshold_without_squad_v2_is_refused(tmp_path: Path) -> None:
    """--null_score_diff_threshold decides v2's "no answer" only: without --version_2_with_negative (where run_qa.py
    ignored it without a word), or given to another task with it, the run stops before anything is read."""
    train = write_jsonl(tmp_path / "train.jsonl", ner_rows(2, 0))
    qa = run_args(tmp_path / "out", "--task", "question-answering", "--train_file", str(train))
    with pytest.raises(ValueError, match="--null_score_diff_threshold 1 decides .* with --version_2_with_negative"):
        finetune.main([*qa, "--null_score_diff_threshold", "1"])
    token = run_args(tmp_path / "out", "--task", "token-classification", "--train_file", str(train))
    with pytest.raises(ValueError, match="--version_2_with_negative: for --task question-answering, not --task token"):
        finetune.main([*token, "--version_2_with_negative"])
    assert not (tmp_path / "out").exists()


def test_a_question_that_leaves_no_room_for_the_stride_is_named() -> None:
    """A question that leaves no more context tokens in the window than --doc_stride made the tokenizers library
    panic (a PanicException, "`stride` must be strictly less than `max_len`", past `except Exception`); it is named
    with its row and the flags to change."""
    tokenizer = train_tokenizer([" ".join(QA_WORDS)] * 10, "masked_lm", vocab_size=120)
    rows = [
        {"question": q, "context": " ".join(QA_WORDS), "answers": {"text": ["mu"], "answer_start": [64]}}
        for q in ("alpha", "alpha beta gamma delta epsilon")
    ]
    with pytest.raises(ValueError, match=r"Row 1's question is 5 tokens long: .* keeps 2 for the context, which must "):
        tokenize_question_answering(Dataset.from_list(rows), tokenizer, qa_options(doc_stride=2), 10, None)


@pytest.mark.parametrize(
    ("task", "metric", "reported"),
    [
        ("token-classification", "eval_exact_match", "report loss, runtime, .*steps_per_second, precision"),
        ("question-answering", "accuracy", "report .*, exact_match, f1, HasAns_exact"),
        ("instruct", "perplexity", "report loss, runtime, samples_per_second, steps_per_second \\(with"),
    ],
)
def test_a_metric_for_best_model_the_task_does_not_report_is_refused_first(tmp_path: Path, task, metric, reported):
    """The Trainer looked --metric_for_best_model up in the first evaluation that compared checkpoints and raised a
    KeyError there, after the data was prepared and the first steps trained (instruct's perplexity is derived after
    the evaluation, which never reports it)."""
    train = write_jsonl(tmp_path / "train.jsonl", ner_rows(2, 0))
    flags = ["--metric_for_best_model", metric]
    with pytest.raises(ValueError, match=f"--metric_for_best_model {metric}: --task {task}'s evaluations {reported}"):
        finetune.main([*run_args(tmp_path / "out", "--task", task, "--train_file", str(train)), *flags])
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("metric", ["f1", "eval_f1", "eval_loss", "precision"])
def test_a_metric_the_task_reports_is_accepted_with_or_without_its_prefix(metric: str) -> None:
    from archlab.scripts.arguments import check_metric_for_best_model
    from archlab.training.tasks import TASKS

    check_metric_for_best_model(
        SimpleNamespace(metric_for_best_model=metric), TASKS["token-classification"].metrics, ""
    )
