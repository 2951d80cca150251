"""TRL's trainers on archlab decoders, with TRL's default arguments: SFT and DPO train a dense and a MoE model, the
MoE load-balancing loss TRL adds is archlab's own (same value, same weight), and a dense model is not taken for a
mixture of experts. Nothing touches the network: the model is a local folder and sockets are closed.

The only arguments set are the output folder, `use_cpu` (TRL turns bf16 on by default, which transformers refuses
without a GPU unless told to run on the CPU), the number of steps and, where a run must visibly learn in a handful of
steps, the learning rate.
"""

from __future__ import annotations

import socket

import pytest
import torch

trl = pytest.importorskip("trl")
from datasets import Dataset, load_dataset  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast  # noqa: E402

from archlab import DecoderForCausalLM  # noqa: E402

from helpers import tiny_decoder_config  # noqa: E402

WORDS = [f"w{i}" for i in range(90)]  # ids 4..93 of the tiny vocabulary (97)
KINDS = {"dense": {}, "moe": dict(num_local_experts=4, num_experts_per_tok=2)}


@pytest.fixture(autouse=True)
def _no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError(f"TRL tried to open a connection: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{w: i + 4 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def _model(kind: str, folder) -> DecoderForCausalLM:
    """A tiny archlab decoder loaded from a folder, as users load one (DPO rebuilds its reference model from it)."""
    torch.manual_seed(0)
    DecoderForCausalLM(tiny_decoder_config(**KINDS[kind])).save_pretrained(folder)
    return AutoModelForCausalLM.from_pretrained(folder)


def _text() -> Dataset:
    return Dataset.from_dict({"text": [" ".join(WORDS[(i + j) % 90] for j in range(10)) for i in range(16)]})


def _preferences() -> Dataset:
    return Dataset.from_dict(
        {
            "prompt": [f"{WORDS[i]} {WORDS[i + 1]}" for i in range(16)],
            "chosen": [f" {WORDS[i + 2]} {WORDS[i + 3]}" for i in range(16)],
            "rejected": [f" {WORDS[i + 40]} {WORDS[i + 9]}" for i in range(16)],
        }
    )


def _sft(kind: str, tmp_path, tokenizer, **args) -> trl.SFTTrainer:
    config = trl.SFTConfig(output_dir=str(tmp_path / "out"), use_cpu=True, **args)
    return trl.SFTTrainer(
        model=_model(kind, tmp_path / "model"), args=config, train_dataset=_text(), processing_class=tokenizer
    )


def _dpo(kind: str, tmp_path, tokenizer, **args) -> trl.DPOTrainer:
    config = trl.DPOConfig(output_dir=str(tmp_path / "out"), use_cpu=True, **args)
    return trl.DPOTrainer(
        model=_model(kind, tmp_path / "model"), args=config, train_dataset=_preferences(), processing_class=tokenizer
    )


def _first_batch(trainer) -> dict[str, torch.Tensor]:
    return trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))


@pytest.mark.parametrize("kind", KINDS)
def test_trl_takes_only_the_moe_model_for_a_mixture_of_experts(kind, tmp_path, tokenizer):
    for trainer in (_sft(kind, tmp_path, tokenizer), _dpo(kind, tmp_path, tokenizer)):
        assert trainer.aux_loss_enabled == (kind == "moe")
        assert trainer.router_aux_loss_coef == (0.001 if kind == "moe" else 0.0)


@pytest.mark.parametrize("kind", KINDS)
def test_sft_loss_is_archlabs_own_loss_including_the_load_balancing_term(kind, tmp_path, tokenizer):
    """TRL's fused head computes the LM loss and (for MoE) Mixtral's load-balancing loss from the config's
    `num_experts`; both must match what the archlab model computes itself."""
    trainer = _sft(kind, tmp_path, tokenizer)
    batch = _first_batch(trainer)
    model = trainer.model.train()
    with torch.no_grad():
        trl_loss = trainer.compute_loss(model, dict(batch))
        inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "labels")}
        own = model(**inputs, output_router_logits=True)
        lm_only = model(**inputs, output_router_logits=False).loss
    torch.testing.assert_close(trl_loss, own.loss, rtol=0, atol=1e-5)
    if kind == "moe":
        assert own.aux_loss > 1.0  # k = 2 when perfectly balanced
        torch.testing.assert_close(own.loss - lm_only, 0.001 * own.aux_loss, rtol=0, atol=1e-5)
    else:
        assert own.aux_loss is None
        torch.testing.assert_close(trl_loss, lm_only, rtol=0, atol=1e-5)


def test_dpo_adds_the_load_balancing_loss_of_a_moe_model(tmp_path, tokenizer):
    trainer = _dpo("moe", tmp_path, tokenizer)
    batch = _first_batch(trainer)
    with torch.no_grad():
        with_aux = trainer.compute_loss(trainer.model.train(), dict(batch))
        aux = trainer._metrics["train"]["aux_loss"][-1]
        trainer.router_aux_loss_coef = 0.0
        without = trainer.compute_loss(trainer.model, dict(batch))
    assert aux > 1.0
    assert abs((with_aux - without).item() - 0.001 * aux) < 1e-5


def _eval_loss(model, tokenizer) -> float:
    batch = tokenizer(list(_text()["text"]), return_tensors="pt")
    model.eval()
    with torch.no_grad():
        return model(**batch, labels=batch["input_ids"]).loss.item()


def _preference_margin(model, tokenizer) -> float:
    """Mean over the preference rows of log p(chosen | prompt) - log p(rejected | prompt)."""
    model.eval()
    data, margins = _preferences(), []
    for prompt, chosen, rejected in zip(data["prompt"], data["chosen"], data["rejected"]):
        start = len(tokenizer(prompt)["input_ids"])
        logps = []
        for completion in (chosen, rejected):
            ids = torch.tensor([tokenizer(prompt + completion)["input_ids"]])
            with torch.no_grad():
                logits = model(ids).logits[0, start - 1 : -1].float()
            logps.append(logits.log_softmax(-1).gather(-1, ids[0, start:, None]).sum())
        margins.append((logps[0] - logps[1]).item())
    return sum(margins) / len(margins)


@pytest.mark.parametrize("kind", KINDS)
def test_sft_trains_with_defaults(kind, tmp_path, tokenizer):
    trainer = _sft(kind, tmp_path, tokenizer, max_steps=8, learning_rate=3e-3)
    before = _eval_loss(trainer.model, tokenizer)
    trainer.train()
    after = _eval_loss(trainer.model, tokenizer)
    assert after < before - 0.3, (before, after)
    assert any("aux_loss" in entry for entry in trainer.state.log_history) == (kind == "moe")


@pytest.mark.parametrize("kind", KINDS)
def test_dpo_trains_with_defaults(kind, tmp_path, tokenizer):
    trainer = _dpo(kind, tmp_path, tokenizer, max_steps=8, learning_rate=3e-3)
    before = _preference_margin(trainer.model, tokenizer)
    trainer.train()
    after = _preference_margin(trainer.model, tokenizer)
    assert after > before + 1.0, (before, after)
    assert any("aux_loss" in entry for entry in trainer.state.log_history) == (kind == "moe")


def test_sft_tool_calls_match_archlabs_instruct_tokens_and_labels(tmp_path):
    """TRL's SFTTrainer (`assistant_only_loss=True`, its `tools` column) and `finetune.py --task instruct` give the
    same tokens and labels to conversations that call tools, whole and cut (TRL's `max_length`, archlab's block)."""
    import json

    from archlab.scripts import finetune
    from archlab.tokenization.training import train_tokenizer
    from archlab.training.task_data import as_messages, tokenize_instruct

    tool = {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 1}}}
    messages = [
        {"role": "user", "content": "Add."},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "1"},
        {"role": "assistant", "content": "One."},
    ]
    (tmp_path / "rows.jsonl").write_text(json.dumps({"messages": messages, "tools": [tool]}) + "\n")
    rows = load_dataset("json", data_files=str(tmp_path / "rows.jsonl"), split="train")
    tokenizer = train_tokenizer([json.dumps(messages), json.dumps(tool)], "decoder", vocab_size=400, min_frequency=1)
    args = finetune.FinetuneArguments()
    whole = tokenize_instruct(as_messages(rows, args), tokenizer, args, 1024, num_proc=None)[0]
    inside_the_call = next(i for i, t in enumerate(whole["labels"]) if t != -100) + 3
    for max_length in (1024, inside_the_call):
        ours = tokenize_instruct(as_messages(rows, args), tokenizer, args, max_length, num_proc=None)[0]
        config = trl.SFTConfig(
            output_dir=str(tmp_path / "out"), use_cpu=True, assistant_only_loss=True, max_length=max_length
        )
        theirs = trl.SFTTrainer(
            model=_model("dense", tmp_path / "model"), args=config, train_dataset=rows, processing_class=tokenizer
        ).train_dataset[0]
        assert ours["input_ids"] == theirs["input_ids"] and ours["labels"] == theirs["labels"]
        assert any(t != -100 for t in ours["labels"])
