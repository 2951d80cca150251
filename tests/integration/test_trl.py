"""TRL's trainers on archlab decoders, with TRL's default arguments: SFT and DPO train a dense and a MoE model, the
MoE load-balancing loss TRL adds is archlab's own (same value, same weight), and a dense model is not taken for a
mixture of experts. Nothing touches the network: the model is a local folder and sockets are closed.

The only arguments set are the output folder, `use_cpu` (TRL turns bf16 on by default, which transformers refuses
without a GPU unless told to run on the CPU), the number of steps and, where a run must visibly learn in a handful of
steps, the learning rate.

RewardTrainer (`DecoderForSequenceClassification`), GRPOTrainer and RLOOTrainer (`DecoderForCausalLM`, generating with
`generate`) are compared with a stock twin carrying the same weights (`LlamaFor*` for the dense model, `MixtralFor*`
for the MoE one): the same batches give the same losses, rewards and per-token log-probabilities. Where a twin run
trains and samples, it runs in float32 (`bf16=False`), so that sampled tokens cannot differ by a bf16 rounding.
"""

from __future__ import annotations

import contextlib
import logging
import socket

import pytest
import torch

trl = pytest.importorskip("trl")
from datasets import Dataset, load_dataset  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
    MixtralConfig,
    MixtralForCausalLM,
    MixtralForSequenceClassification,
    PreTrainedTokenizerFast,
)
from transformers.utils import logging as transformers_logging  # noqa: E402

from archlab import DecoderConfig, DecoderForCausalLM, DecoderForSequenceClassification  # noqa: E402

from helpers import DECODER_VARIANTS, TINY, assert_close_to_scale, decoder_variant, tiny_decoder_config  # noqa: E402

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


# ---- stock twins: RewardTrainer, GRPOTrainer, RLOOTrainer -------------------------------------------------------

STOCK = {  # (config class, causal LM, sequence classifier) of the twin of each kind
    "dense": (LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification),
    "moe": (MixtralConfig, MixtralForCausalLM, MixtralForSequenceClassification),
}
# Mixtral's defaults that differ from archlab's are set to archlab's
TWIN_FIELDS = dict(rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def _twins(kind: str, head: str, folder=None, **fields):
    """(stock, archlab) models of `head` ("lm" or "classifier") with the same weights; saved under `folder` if given
    (TRL then loads them by path, as users do, and GRPO/RLOO's reference model reloads from there)."""
    config_class, lm, classifier = STOCK[kind]
    fields = {**TINY, **TWIN_FIELDS, **KINDS[kind], **fields}
    torch.manual_seed(0)
    stock = (lm if head == "lm" else classifier)(config_class(**fields))
    ours = (DecoderForCausalLM if head == "lm" else DecoderForSequenceClassification)(DecoderConfig(**fields))
    ours.load_state_dict(stock.state_dict(), strict=True)
    if folder is None:
        return stock, ours
    stock.save_pretrained(folder / "stock")
    ours.save_pretrained(folder / "archlab")
    auto = AutoModelForCausalLM if head == "lm" else AutoModelForSequenceClassification
    return auto.from_pretrained(folder / "stock"), auto.from_pretrained(folder / "archlab")


@pytest.fixture(scope="module")
def chat_tokenizer():
    """archlab's decoder tokenizer (ChatML template, pads on the left) over the tiny vocabulary's words."""
    from archlab.tokenization.training import train_tokenizer

    return train_tokenizer([" ".join(WORDS)] * 4 + ["user assistant"], "decoder", vocab_size=400, min_frequency=1)


def _tokenizer_fields(tokenizer) -> dict:
    ids = ("pad_token_id", "bos_token_id", "eos_token_id")
    return {"vocab_size": len(tokenizer), **{name: getattr(tokenizer, name) for name in ids}}


def _ragged_preferences() -> Dataset:
    """`_preferences` with chosen completions of 2 to 4 words, so that batches are padded."""
    rows = _preferences().to_dict()
    rows["chosen"] = [c + " w5" * (i % 3) for i, c in enumerate(rows["chosen"])]
    return Dataset.from_dict(rows)


def _conversational_preferences() -> Dataset:
    rows = _ragged_preferences()
    return Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": p}] for p in rows["prompt"]],
            "chosen": [[{"role": "assistant", "content": c.strip()}] for c in rows["chosen"]],
            "rejected": [[{"role": "assistant", "content": r.strip()}] for r in rows["rejected"]],
        }
    )


def _reward(model, tmp_path, tokenizer, data=None, **args) -> trl.RewardTrainer:
    config = trl.RewardConfig(output_dir=str(tmp_path / "out"), use_cpu=True, **args)
    data = _ragged_preferences() if data is None else data
    return trl.RewardTrainer(model=model, args=config, train_dataset=data, processing_class=tokenizer)


@pytest.mark.parametrize("form", ["plain", "conversational"])
@pytest.mark.parametrize("kind", KINDS)
def test_reward_loss_rewards_and_margin_equal_the_stock_twins(kind, form, tmp_path, tokenizer, chat_tokenizer):
    """The same preference batch (right-padded by TRL's collator, pooled at the last real token) gives the Llama or
    Mixtral twin's rewards, loss and margin. TRL's reward loss is -log σ(r_chosen - r_rejected) alone: it passes no
    labels, so neither archlab's MoE classifier nor Mixtral's adds a router loss (the routers are not balanced)."""
    tok, data = (tokenizer, None) if form == "plain" else (chat_tokenizer, _conversational_preferences())
    results = []
    for model in _twins(kind, "classifier", num_labels=1, **_tokenizer_fields(tok)):
        trainer = _reward(model, tmp_path, tok, data)
        batch = _first_batch(trainer)
        with torch.no_grad():
            loss, outputs = trainer.compute_loss(trainer.model.train(), dict(batch), return_outputs=True)
        results.append((loss, outputs.logits, trainer._metrics["train"]["margin"][-1], batch))
    (stock_loss, stock_rewards, stock_margin, batch), (loss, rewards, margin, _) = results
    mask = batch["attention_mask"]
    assert (mask[:, 0] == 1).all() and (mask.sum(1) < mask.shape[1]).any()  # right padding, ragged rows
    assert_close_to_scale(rewards, stock_rewards, rtol=1e-5)
    assert_close_to_scale(loss, stock_loss, rtol=1e-5)
    assert abs(margin - stock_margin) <= 1e-5 * max(abs(stock_margin), rewards.abs().max().item())
    chosen, rejected = rewards.squeeze(-1).chunk(2)
    torch.testing.assert_close(loss, -torch.nn.functional.logsigmoid(chosen - rejected).mean(), rtol=0, atol=1e-6)


def test_reward_model_saved_by_the_trainer_reloads_with_the_stock_twins_rewards(tmp_path, chat_tokenizer):
    """After training, the saved folder loads with AutoModelForSequenceClassification and scores a left-padded batch
    (archlab's tokenizers pad on the left) as the Llama twin trained the same way scores it, and as it scores each
    text alone."""
    texts = [
        chat_tokenizer.apply_chat_template(p + c, tokenize=False)
        for p, c in zip(_conversational_preferences()["prompt"][:3], _conversational_preferences()["chosen"][:3])
    ]
    texts[1] = texts[1] + " w5 w6 w7"  # rows of different lengths
    batch = chat_tokenizer(texts, return_tensors="pt", padding=True)
    assert chat_tokenizer.padding_side == "left" and (batch["attention_mask"][:, 0] == 0).any()
    rewards = []
    for name, model in zip(
        ("stock", "archlab"), _twins("dense", "classifier", num_labels=1, **_tokenizer_fields(chat_tokenizer))
    ):
        trainer = _reward(
            model,
            tmp_path / name,
            chat_tokenizer,
            _conversational_preferences(),
            max_steps=3,
            learning_rate=1e-2,
            bf16=False,
        )
        trainer.train()
        trainer.save_model(tmp_path / name / "saved")
        reloaded = AutoModelForSequenceClassification.from_pretrained(tmp_path / name / "saved").eval()
        with torch.no_grad():
            rewards.append(reloaded(**batch).logits)
            alone = [reloaded(**chat_tokenizer(t, return_tensors="pt")).logits for t in texts]
        assert_close_to_scale(torch.cat(alone), rewards[-1], rtol=1e-5)
    assert type(reloaded).__name__ == "DecoderForSequenceClassification" and reloaded.config.pad_token_id is not None
    assert_close_to_scale(rewards[1], rewards[0], rtol=1e-4)


def test_reward_trainer_with_lora_from_a_causal_lm_folder_matches_the_stock_twin(tmp_path, tokenizer):
    """A causal LM folder given by path gets a new one-label `score` head and LoRA adapters (`task_type="SEQ_CLS"`:
    PEFT's default target modules, the head trained whole); training logs and the reloaded adapters' rewards are
    the Llama twin's."""
    from peft import AutoPeftModelForSequenceClassification, LoraConfig

    _twins("dense", "lm", tmp_path)
    batch = tokenizer(["w1 w2 w3 </s>", "w4 </s>"], return_tensors="pt", padding=True, padding_side="left")
    runs = []
    for name in ("stock", "archlab"):
        config = trl.RewardConfig(
            output_dir=str(tmp_path / name / "out"), use_cpu=True, max_steps=2, learning_rate=1e-2
        )
        trainer = trl.RewardTrainer(
            model=str(tmp_path / name),
            args=config,
            train_dataset=_ragged_preferences(),
            processing_class=tokenizer,
            peft_config=LoraConfig(r=4, task_type="SEQ_CLS"),
        )
        trainer.train()
        trainer.save_model(tmp_path / name / "adapters")
        reloaded = AutoPeftModelForSequenceClassification.from_pretrained(tmp_path / name / "adapters", num_labels=1)
        with torch.no_grad():
            runs.append((trainer.state.log_history[-1]["train_loss"], reloaded.eval()(**batch).logits))
    assert type(reloaded.get_base_model()).__name__ == "DecoderForSequenceClassification"
    assert abs(runs[1][0] - runs[0][0]) <= 1e-5 * runs[0][0]
    # AdamW's first steps move each weight by ~lr whatever its gradient's size, so a gradient near zero whose sign
    # differs by rounding (archlab's compiled RoPE and SwiGLU kernels where the CUDA paths are opened to the CPU,
    # against Llama's eager ops) moves its weight by up to 2 lr the other way: the rewards of the tiny head then differ
    # by a few tenths of a percent of their scale (CI saw 0.32 % once; its other runs stayed within 0.01 %)
    assert_close_to_scale(runs[1][1], runs[0][1], rtol=1e-2)


@contextlib.contextmanager
def _load_reports():
    """The load reports transformers logs meanwhile (the table of missing and unexpected keys), as a list."""
    reports = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "LOAD REPORT" in record.getMessage():
                reports.append(record.getMessage())

    handler = Collect()
    transformers_logging.add_handler(handler)
    try:
        yield reports
    finally:
        transformers_logging.remove_handler(handler)


@pytest.mark.parametrize("kind", KINDS)
def test_a_causal_lm_folder_loads_as_a_reward_model_with_the_stock_twins_load_report(kind, tmp_path, tokenizer):
    """RewardTrainer loads a causal LM folder given by path without transformers' load report (the new `score`, the
    unused `lm_head`): TRL sets the keys to ignore on `GenericForSequenceClassification`, the stock classifiers'
    base, for the load, and archlab's classifier printed the report the twin's did not. A plain load reports both
    keys, for either model."""
    _twins(kind, "lm", tmp_path)
    reports = {}
    for name in ("stock", "archlab"):
        with _load_reports() as by_trl:
            _reward(str(tmp_path / name), tmp_path / name, tokenizer)
        with _load_reports() as plain:
            model = AutoModelForSequenceClassification.from_pretrained(tmp_path / name, num_labels=1)
        names = (type(model).__name__, "<class>"), (str(tmp_path / name), "<folder>")
        reports[name] = by_trl, [r.replace(*names[0]).replace(*names[1]) for r in plain]
    assert reports["archlab"] == reports["stock"]
    by_trl, plain = reports["stock"]
    assert by_trl == [] and len(plain) == 1
    assert "lm_head.weight | UNEXPECTED" in plain[0] and "score.weight   | MISSING" in plain[0]


def _count_w5(completions, **kwargs) -> list[float]:
    return [float(c.count("w5")) + 0.1 * len(c.split()) for c in completions]


def _prompts() -> Dataset:
    return Dataset.from_dict({"prompt": [" ".join(WORDS[i : i + 1 + i % 3]) for i in range(8)]})


RL_TRAINERS = {"grpo": (trl.GRPOConfig, trl.GRPOTrainer), "rloo": (trl.RLOOConfig, trl.RLOOTrainer)}
SMALL_RL = dict(num_generations=4, per_device_train_batch_size=4, max_completion_length=6, logging_steps=1)


def _rl(name: str, model, tmp_path, tokenizer, peft_config=None, **args):
    config_class, trainer_class = RL_TRAINERS[name]
    config = config_class(output_dir=str(tmp_path / "out"), use_cpu=True, **SMALL_RL, **args)
    return trainer_class(
        model=model,
        reward_funcs=_count_w5,
        args=config,
        train_dataset=_prompts(),
        processing_class=tokenizer,
        peft_config=peft_config,
    )


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", RL_TRAINERS)
def test_rl_per_token_log_probs_and_entropies_equal_the_stock_twins(name, kind, tmp_path, tokenizer):
    """TRL's fused LM head (its own projection of the backbone's hidden states, `fused_lm_head=True`) scores the
    completions of a left- and right-padded batch as it scores the Llama or Mixtral twin's, at temperature 0.7, and
    for MoE returns the twin's load-balancing loss. In float32: under TRL's default bf16 autocast the MoE models differ
    by bf16 rounding (3e-4 of the largest log-probability), the dense ones not at all."""
    ids = torch.randint(4, 94, (3, 10))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # a short prompt, left-padded
    mask[1, -2:] = 0  # a short completion, right-padded
    results = []
    for model in _twins(kind, "lm", tmp_path, output_router_logits=kind == "moe"):
        trainer = _rl(name, model, tmp_path, tokenizer, temperature=0.7, bf16=False)
        with torch.no_grad():
            results.append(
                trainer._get_per_token_logps_and_entropies(
                    trainer.model.eval(), ids, mask, 6, compute_entropy=True, compute_aux_loss=kind == "moe"
                )
            )
    (stock_logps, stock_entropy, stock_aux), (logps, entropy, aux) = results
    assert_close_to_scale(logps, stock_logps, rtol=1e-5)
    assert_close_to_scale(entropy, stock_entropy, rtol=1e-5)
    if kind == "moe":
        assert_close_to_scale(aux, stock_aux, rtol=1e-5)
        assert aux > 1.0
    else:
        assert aux is None and stock_aux is None


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", RL_TRAINERS)
def test_rl_trains_as_the_stock_twin_with_sampling_arguments(name, kind, tmp_path, tokenizer):
    """Two steps of GRPO or RLOO with sampling arguments (`temperature`, `top_k`, `top_p`, `min_p`,
    `repetition_penalty`, `generation_kwargs`) and a reference model (`beta`): the same completions (hence rewards)
    as the twin's, the same losses, KL and entropies, and for MoE the load-balancing loss logged."""
    _twins(kind, "lm", tmp_path)
    sampling = dict(temperature=0.8, top_k=20, top_p=0.9, min_p=0.02, repetition_penalty=1.2)
    logs = []
    for folder in ("stock", "archlab"):
        trainer = _rl(
            name,
            str(tmp_path / folder),
            tmp_path / folder,
            tokenizer,
            max_steps=2,
            beta=0.04,
            bf16=False,
            generation_kwargs={"no_repeat_ngram_size": 2},
            **sampling,
        )
        trainer.train()
        logs.append([entry for entry in trainer.state.log_history if "loss" in entry])
    for stock, ours in zip(*logs, strict=True):
        assert ours["reward"] == stock["reward"] and ours["completions/mean_length"] == stock["completions/mean_length"]
        for key in ("loss", "kl", "entropy", "aux_loss"):
            assert (key in ours) == (key in stock), key
            if key in ours:
                assert abs(ours[key] - stock[key]) <= 1e-5 * max(1.0, abs(stock[key])), (key, ours[key], stock[key])
    assert ("aux_loss" in logs[1][0]) == (kind == "moe")


@pytest.mark.parametrize("kind", KINDS)
def test_grpo_trains_lora_adapters_with_defaults(kind, tmp_path, tokenizer):
    """GRPO with `LoraConfig(task_type="CAUSAL_LM")` (PEFT's default target modules for archlab) and gradient
    checkpointing: two steps move the adapters, and the MoE model logs its load-balancing loss. (Mixtral has no PEFT
    default target modules in PEFT 0.21; the dense run is compared with Llama's.)"""
    from peft import LoraConfig

    _twins(kind, "lm", tmp_path)
    folders = ("stock", "archlab") if kind == "dense" else ("archlab",)
    losses = []
    for folder in folders:
        trainer = _rl(
            "grpo",
            str(tmp_path / folder),
            tmp_path / folder,
            tokenizer,
            peft_config=LoraConfig(r=4, task_type="CAUSAL_LM"),
            max_steps=2,
            learning_rate=1e-2,
            gradient_checkpointing=True,
        )
        before = {n: p.clone() for n, p in trainer.model.named_parameters() if "lora_B" in n}
        trainer.train()
        assert before and all(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters() if n in before)
        losses.append([entry["loss"] for entry in trainer.state.log_history if "loss" in entry])
        assert any("aux_loss" in entry for entry in trainer.state.log_history) == (kind == "moe")
    if kind == "dense":
        assert losses[1] == pytest.approx(losses[0], rel=1e-4, abs=1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_grpo_with_continuous_batching_trains_as_the_stock_twin(kind, tmp_path, tokenizer):
    """`use_transformers_continuous_batching=True` (transformers' `generate_batch` on a paged KV cache) samples the
    twin's completions, so two GRPO steps log its rewards, lengths and losses; the generation thread had returned
    empty completions, on which TRL failed with `IndexError: list index out of range`. In float32, with a small
    paged cache (the default sizes it from the free memory, ~20 s on a CPU)."""
    _twins(kind, "lm", tmp_path)
    logs = []
    for folder in ("stock", "archlab"):
        trainer = _rl(
            "grpo",
            str(tmp_path / folder),
            tmp_path / folder,
            tokenizer,
            max_steps=2,
            bf16=False,
            use_transformers_continuous_batching=True,
            transformers_continuous_batching_config=dict(num_blocks=16, page_size=16, max_batch_tokens=64),
        )
        trainer.train()
        logs.append([entry for entry in trainer.state.log_history if "loss" in entry])
    assert len(logs[1]) == 2 and logs[1][0]["completions/mean_length"] > 0
    for stock, ours in zip(*logs, strict=True):
        assert ours["reward"] == stock["reward"] and ours["completions/mean_length"] == stock["completions/mean_length"]
        assert abs(ours["loss"] - stock["loss"]) <= 1e-5 * max(1.0, abs(stock["loss"]))


@pytest.mark.parametrize("kind", KINDS)
def test_grpo_scores_completions_with_a_reward_model_folder_as_the_stock_twin(kind, tmp_path, tokenizer):
    """A reward model given to GRPO by path (loaded with AutoModelForSequenceClassification, `num_labels=1`, its
    texts right-padded by TRL) gives the completions the rewards that its Llama or Mixtral twin gives them."""
    _twins(kind, "lm", tmp_path / "policy")
    _twins(kind, "classifier", tmp_path / "reward", num_labels=1)
    rewards = []
    for folder in ("stock", "archlab"):
        config = trl.GRPOConfig(
            output_dir=str(tmp_path / folder / "out"), use_cpu=True, max_steps=1, bf16=False, **SMALL_RL
        )
        trainer = trl.GRPOTrainer(
            model=str(tmp_path / "policy" / folder),
            reward_funcs=str(tmp_path / "reward" / folder),
            args=config,
            train_dataset=_prompts(),
            processing_class=tokenizer,
            reward_processing_classes=tokenizer,
        )
        trainer.train()
        rewards.append(
            [entry[key] for entry in trainer.state.log_history for key in entry if key.startswith("rewards/")]
        )
    assert type(trainer.reward_funcs[0]).__name__ == "DecoderForSequenceClassification"
    assert rewards[1] == pytest.approx(rewards[0], rel=1e-4, abs=1e-6) and rewards[0]


@pytest.mark.parametrize("variant", DECODER_VARIANTS)
def test_trls_fused_head_scores_every_catalogue_variant_as_the_models_own_logits(variant):
    """TRL's trainers (SFT, DPO, KTO, GRPO, RLOO) score tokens with their own projection of the backbone's hidden
    states (`add_fused_lm_head`), reading logit transforms from the config by name (`final_logit_softcapping`): the
    log-probabilities at temperature 0.7 of a left-padded batch are those of the model's own logits in every variant
    (positions from the mask, sliding windows, prefix-LM, ALiBi, softcapping, MoE)."""
    from trl.trainer.utils import add_fused_lm_head

    model = decoder_variant(variant)
    ids = torch.randint(3, 97, (2, 9))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    ids = ids.masked_fill(mask == 0, model.config.pad_token_id)
    labels = ids.masked_fill(mask == 0, -100)
    with torch.no_grad():
        logits = model(ids, attention_mask=mask).logits[:, :-1].float() / 0.7
        own = logits.log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1).masked_fill(labels[:, 1:] == -100, 0)
        add_fused_lm_head(model, temperature=0.7)
        fused = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True).log_probs
    assert_close_to_scale(fused, own, rtol=1e-5)
