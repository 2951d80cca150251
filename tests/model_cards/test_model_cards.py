"""archlab.model_cards.write_model_card: metadata, architecture table, parameter counts, training facts, loss curve,
and a usage snippet that runs (executed against the saved folder, without archlab, for every registered head)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from huggingface_hub import ModelCard
from transformers import TrainerState, TrainingArguments

from archlab import (
    DecoderForCausalLM,
    DecoderForQuestionAnswering,
    DecoderForSequenceClassification,
    DecoderForTokenClassification,
    registration,
)
from archlab.model_cards import write_model_card
from archlab.model_cards.facts import architecture_rows

from helpers import LLAMA4_ATTENTION, LLAMA4_EXPERTS, tiny_config_for, tiny_decoder_config
from isolated import check, run_without_archlab


def _save(model, folder: Path) -> Path:
    model.save_pretrained(folder)
    return folder


def _table(text: str, first_header: str) -> dict[str, str]:
    """The two-column Markdown table whose header starts with `first_header`, as a dict."""
    block = text.split(f"| {first_header} |", 1)[1].split("\n\n", 1)[0]
    rows = [line.strip("|").split("|") for line in block.splitlines()[2:] if line.startswith("|")]
    return {key.strip(): value.strip() for key, value in rows}


def test_metadata_and_model_index(tmp_path):
    folder = _save(DecoderForCausalLM(tiny_decoder_config()), tmp_path / "m")
    write_model_card(
        folder,
        model_id="someone/ft",
        base_model="someone/base",
        datasets=["stdlib", "docs"],
        eval_results={"loss": 2.0, "accuracy": 0.5},
        license="mit",
        language="en",
        tags=["demo"],
    )
    data = ModelCard.load(folder / "README.md").data
    assert data.library_name == "transformers" and data.pipeline_tag == "text-generation"
    assert data.license == "mit" and data.language == "en" and data.base_model == "someone/base"
    assert data.datasets == ["stdlib", "docs"]
    assert {"archlab", "archlab_decoder", "custom_code", "safetensors", "demo"} <= set(data.tags)
    metrics = {result.metric_type: result.metric_value for result in data.eval_results}
    assert metrics == {"loss": 2.0, "accuracy": 0.5, "perplexity": round(math.exp(2.0), 4)}
    assert {result.dataset_name for result in data.eval_results} == {"stdlib"}
    assert data.model_name == "someone/ft"


def test_model_index_leaves_out_values_the_hub_rejects(tmp_path):
    """A NaN or infinite metric was written as YAML's `.nan`/`.inf`, and a flag as 1.0."""
    folder = _save(DecoderForCausalLM(tiny_decoder_config()), tmp_path / "m")
    metrics = {"loss": 2.0, "bleu": float("nan"), "chrf": float("inf"), "converged": True, "steps": 3}
    write_model_card(folder, model_id="someone/ft", datasets=["stdlib"], eval_results=metrics)
    text = (folder / "README.md").read_text()
    assert ".nan" not in text and ".inf" not in text
    kept = {r.metric_type for r in ModelCard.load(folder / "README.md").data.eval_results}
    assert kept == {"loss", "perplexity", "steps"}


def test_architecture_table_follows_the_config(tmp_path):
    config = tiny_decoder_config(num_key_value_heads=1)
    folder = _save(DecoderForCausalLM(config), tmp_path / "m")
    table = _table(write_model_card(folder).read_text(), "property")
    assert table["layers"] == str(config.num_hidden_layers) and table["hidden size"] == str(config.hidden_size)
    assert table["attention"].startswith("multi-query (MQA)")
    assert table["normalization"].startswith(getattr(config, "norm_type", "rms_norm"))
    assert table["norm position"] == getattr(config, "norm_position", "pre")
    assert table["positions"].startswith("RoPE") or table["positions"] == config.position_embedding_type
    assert table["feed-forward"] == f"SwiGLU, width {config.intermediate_size}"
    assert table["experts"] == "none (dense)"


def test_architecture_rows_name_olmo2_s_norm_position_and_qk_norm_scope():
    config = tiny_decoder_config(norm_position="output", use_qk_norm=True, qk_norm_scope="projection").to_dict()
    rows = dict(architecture_rows(config))
    assert rows["norm position"] == "output" and rows["stability"] == "use_qk_norm=True, qk_norm_scope=projection"
    assert dict(architecture_rows(tiny_decoder_config(use_qk_norm=True).to_dict()))["stability"] == "use_qk_norm=True"


def test_architecture_rows_name_each_layer_type_s_rope():
    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4}, "full_attention": {"rope_theta": 1e6}}
    config = tiny_decoder_config(
        sliding_window=4, layer_types=["sliding_attention", "full_attention"], rope_parameters=rope
    )
    assert dict(architecture_rows(config.to_dict()))["positions"] == (
        "RoPE per layer type: sliding_attention (default, theta=10000); full_attention (default, theta=1e+06)"
    )


def test_architecture_rows_name_the_mup_multipliers_that_are_set():
    config = tiny_decoder_config(embedding_multiplier=12.0, residual_multiplier=0.22, logit_scale=0.125).to_dict()
    rows = dict(architecture_rows(config))
    assert rows["multipliers"] == "embedding_multiplier=12, residual_multiplier=0.22, logit_scale=0.125"
    assert dict(architecture_rows(tiny_decoder_config(attention_multiplier=0.25).to_dict()))["multipliers"] == (
        "attention_multiplier=0.25"
    )
    assert "multipliers" not in dict(architecture_rows(tiny_decoder_config().to_dict()))
    bitnet = dict(architecture_rows(tiny_decoder_config(sub_layer_norm=True, bitlinear=True).to_dict()))
    plain = dict(architecture_rows(tiny_decoder_config().to_dict()))
    assert bitnet["sub-layer norms"].startswith("Sub-LN") and "sub-layer norms" not in plain
    assert bitnet["projections"].startswith("BitLinear") and "projections" not in plain


def test_architecture_rows_name_the_router_the_output_gate_a_late_qk_norm_and_gpt_oss_s_choices():
    config = tiny_decoder_config(
        num_local_experts=4,
        router_score_function="sigmoid",
        router_correction_bias=True,
        router_bias_update_rate=0.001,
        attention_output_gate="headwise",
        use_qk_norm=True,
        qk_norm_after_rope=True,
        attention_sinks=True,
    ).to_dict()
    rows = dict(architecture_rows(config))
    assert rows["attention sinks"] == "a learned logit per head in the softmax's denominator"
    gpt_oss = tiny_decoder_config(
        num_local_experts=4,
        router_bias=True,
        expert_bias=True,
        swiglu_limit=7.0,
        swiglu_up_offset=1.0,
        hidden_act="quick_gelu",
    ).to_dict()
    latent = tiny_decoder_config(
        num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6
    ).to_dict()
    assert dict(architecture_rows(latent))["attention"] == (
        "multi-head latent (MLA), 4 heads, keys and values from a cached rank-16 latent, queries through a rank-12 "
        "latent; per head 8 + 4 (RoPE) query/key channels, 6 value channels"
    )
    gpt_oss_rows = dict(architecture_rows(gpt_oss))
    assert gpt_oss_rows["feed-forward"].startswith("gated MLP, quick_gelu, gate ≤ 7 and |up| ≤ 7, up + 1, width")
    assert gpt_oss_rows["experts"] == "4 experts, top-2 routing, a router bias, expert width 64, expert biases"
    assert rows["experts"].startswith(
        "4 experts, top-2 routing on sigmoid scores with a correction bias (auxiliary-loss-free balancing, rate 0.001)"
    )
    assert rows["attention output gate"] == "sigmoid, headwise"
    assert rows["stability"].endswith("qk_norm_after_rope=True")
    grouped = tiny_decoder_config(num_local_experts=8, router_groups=4, router_top_groups=2).to_dict()
    assert dict(architecture_rows(grouped))["experts"].startswith(
        "8 experts, top-2 routing, from the best 2 of 4 expert groups"
    )
    grouped_v2 = tiny_decoder_config(
        num_local_experts=8, router_groups=4, router_top_groups=2, router_group_score="max"
    ).to_dict()
    assert dict(architecture_rows(grouped_v2))["experts"].startswith(
        "8 experts, top-2 routing, from the best 2 of 4 expert groups (scored by their best expert)"
    )


def test_architecture_rows_name_llama_4_s_choices():
    config = tiny_decoder_config(**LLAMA4_ATTENTION, **LLAMA4_EXPERTS).to_dict()
    rows = dict(architecture_rows(config))
    assert rows["attention pattern"] == "chunked_attention x1, full_attention x1 (chunks of 4)"
    assert rows["positions"].endswith(
        "no positions (NoPE) in layers 1, their queries' temperature tuned (attn_scale 0.5, floor_scale 4)"
    )
    assert rows["stability"].endswith("qk_norm_after_rope=True, qk_norm_weight=False, qk_norm_nope_layers=False")
    assert rows["experts"].endswith("the routing weight applied to each expert's input, shared expert")


def test_architecture_rows_name_the_nope_layers():
    config = tiny_decoder_config(nope_layers=[1]).to_dict()
    assert dict(architecture_rows(config))["positions"].endswith("; no positions (NoPE) in layers 1")
    assert "NoPE" not in dict(architecture_rows(tiny_decoder_config().to_dict()))["positions"]


LONG_FACTORS = [1.0, 2.0, 3.0, 4.0]


@pytest.mark.parametrize(
    "rope, shown",
    [
        ({"rope_type": "default"}, "(default, theta=10000)"),
        ({"rope_type": "linear", "factor": 2.0}, "(linear, theta=10000, factor=2)"),
        ({"rope_type": "dynamic", "factor": 3.0}, "(dynamic, theta=10000, factor=3)"),
        (
            {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 16.0},
            "(yarn, theta=10000, factor=4, original_max_position_embeddings=32, beta_fast=16)",
        ),
        (
            {
                "rope_type": "longrope",
                "factor": 4.0,
                "original_max_position_embeddings": 32,
                "short_factor": [1.0] * 4,
                "long_factor": LONG_FACTORS,
                "attention_factor": 1.2,
            },
            "(longrope, theta=10000, factor=4, original_max_position_embeddings=32, attention_factor=1.2, "
            "short_factor=1 (x4), long_factor=1..4 (4 values))",
        ),
        (
            {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
            "(llama3, theta=10000, factor=8, original_max_position_embeddings=32, low_freq_factor=1, "
            "high_freq_factor=4)",
        ),
        (
            {"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5},
            "(linear, theta=10000, partial 0.5, factor=2)",
        ),
    ],
    ids=["default", "linear", "dynamic", "yarn", "longrope", "llama3", "partial"],
)
def test_the_card_shows_the_entries_each_rope_type_reads(tmp_path, rope, shown):
    """A scaled RoPE's card showed its type and base alone: a linear RoPE's factor, yarn's and llama3's pre-training
    length, longrope's per-frequency factors were missing."""
    config = tiny_decoder_config(rope_parameters={"rope_theta": 1e4, **rope})
    table = _table(write_model_card(_save(DecoderForCausalLM(config), tmp_path / "m")).read_text(), "property")
    assert table["positions"] == f"RoPE {shown}"


def test_architecture_rows_read_missing_fields_with_defaults():
    rows = dict(
        architecture_rows(
            {
                "model_type": "archlab_decoder",
                "num_hidden_layers": 2,
                "hidden_size": 8,
                "num_attention_heads": 2,
                "intermediate_size": 16,
            }
        )
    )
    assert rows["normalization"] == "rms_norm" and rows["norm position"] == "pre"
    assert rows["positions"].startswith("RoPE") and rows["attention"].startswith("multi-head (MHA)")
    rows = dict(
        architecture_rows(
            {
                "model_type": "archlab_seq2seq",
                "encoder_layers": 3,
                "decoder_layers": 2,
                "d_model": 8,
                "encoder_attention_heads": 2,
                "encoder_ffn_dim": 32,
            }
        )
    )
    assert rows["layers"] == "3 encoder, 2 decoder" and rows["norm position"] == "post"
    assert rows["normalization"] == "layer_norm" and rows["positions"] == "sinusoidal"
    assert rows["feed-forward"] == "plain MLP, relu, width 32"
    rows = dict(
        architecture_rows(
            {
                "num_local_experts": 8,
                "num_experts_per_tok": 2,
                "sliding_window": 64,
                "layer_types": ["sliding_attention", "full_attention"] * 2,
            }
        )
    )
    assert rows["experts"] == "8 experts, top-2 routing"
    assert rows["attention pattern"] == "sliding_attention x2, full_attention x2 (window 64)"


def _count(text: str, which: str) -> int:
    return int(re.search(rf"\(([\d,]+)\) {which}", text).group(1).replace(",", ""))


@pytest.mark.parametrize("tie", [False, True])
def test_parameter_counts_dense(tmp_path, tie):
    model = DecoderForCausalLM(tiny_decoder_config(tie_word_embeddings=tie))
    text = write_model_card(_save(model, tmp_path / "m")).read_text()
    unique = sum(p.numel() for p in model.parameters())  # parameters() yields a tied weight once
    assert _count(text, "in total") == _count(text, "active per token") == unique


@pytest.mark.parametrize(
    "moe",
    [dict(), dict(shared_expert_intermediate_size=16, mlp_layer_types=["dense", "sparse"])],
    ids=["all-sparse", "shared-expert-and-dense-layer"],
)
def test_parameter_counts_mixture_of_experts(tmp_path, moe):
    config = tiny_decoder_config(num_local_experts=4, num_experts_per_tok=2, **moe)
    model = DecoderForCausalLM(config)
    text = write_model_card(_save(model, tmp_path / "m")).read_text()
    # reference: per token, everything outside the routed experts runs, and k of the E experts of each MoE layer
    routed = {name: p.numel() for name, p in model.named_parameters() if ".experts." in name}
    assert routed, "expected routed-expert parameters named `...experts...`"
    one_expert_per_layer = sum(routed.values()) // 4
    dense = sum(p.numel() for p in model.parameters()) - sum(routed.values())
    assert _count(text, "in total") == dense + 4 * one_expert_per_layer
    assert _count(text, "active per token") == dense + 2 * one_expert_per_layer
    assert "4 experts, top-2 routing" in text
    # and the same numbers as the MoE module's own count, which walks the modules instead of the file
    from archlab.modeling.moe import count_parameters

    counts = count_parameters(model)
    assert (_count(text, "in total"), _count(text, "active per token")) == (counts["total"], counts["active"])
    if moe:
        assert "shared expert" in text and "sparse in 1 of 2 layers" in text


def test_training_facts_from_trainer_objects(tmp_path):
    folder = _save(DecoderForCausalLM(tiny_decoder_config()), tmp_path / "m")
    state = TrainerState(
        global_step=30,
        epoch=2.0,
        train_batch_size=4,
        log_history=[
            {"step": 10, "loss": 3.0},
            {"step": 20, "loss": 2.5},
            {"step": 30, "loss": 2.25},
            {"step": 30, "eval_loss": 2.5, "eval_runtime": 1.5, "eval_accuracy": 0.25},
        ],
    )
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), learning_rate=1e-3, per_device_train_batch_size=4, seed=7, report_to=[]
    )
    text = write_model_card(folder, trainer_state=state, training_args=args, datasets="stdlib").read_text()
    hyper = _table(text, "name")
    assert hyper["learning_rate"] == "0.001" and hyper["per_device_train_batch_size"] == "4" and hyper["seed"] == "7"
    results = _table(text, "result")
    assert results["steps"] == "30" and results["final training loss"] == "2.25"
    assert results["evaluation loss"] == "2.5" and results["evaluation accuracy"] == "0.25"
    assert "evaluation runtime" not in results
    metrics = {r.metric_type: r.metric_value for r in ModelCard.load(folder / "README.md").data.eval_results}
    assert metrics["loss"] == 2.5 and metrics["accuracy"] == 0.25
    assert (folder / "loss_curve.png").read_bytes().startswith(b"\x89PNG")
    assert "![training loss](loss_curve.png)" in text


def test_training_facts_from_the_folder_json_files(tmp_path):
    folder = _save(DecoderForCausalLM(tiny_decoder_config()), tmp_path / "m")
    (folder / "trainer_state.json").write_text(
        json.dumps({"global_step": 5, "log_history": [{"step": 5, "loss": 1.5}]})
    )
    (folder / "training_args.json").write_text(json.dumps({"learning_rate": 0.01, "optim": "adamw_torch"}))
    torch.save({"learning_rate": 123.0}, folder / "training_args.bin")  # pickled: must never be read
    text = write_model_card(folder).read_text()
    assert _table(text, "name") == {"learning_rate": "0.01", "optim": "adamw_torch"}
    assert _table(text, "result")["final training loss"] == "1.5"
    assert "loss_curve.png" not in text  # one logged point is no curve


BF16_WEIGHTS_LINE = (
    "**Weights:** trained in bfloat16 (pure bfloat16, `--dtype bfloat16`): the optimizer updated bfloat16 weights, "
    "with no float32 copy."
)


def test_the_card_names_weights_trained_in_another_dtype_than_float32(tmp_path):
    """A run with `--dtype bfloat16` trains bfloat16 weights with no float32 copy, which the card did not say (its
    `bf16` row is autocast): it reads the weights' dtype from the run's `run_facts.json`. float32 weights, the
    default, leave the card as it was."""
    folder = _save(DecoderForCausalLM(tiny_decoder_config()), tmp_path / "m")
    (folder / "training_args.json").write_text(json.dumps({"learning_rate": 0.01, "bf16": True}))
    plain = write_model_card(folder, datasets="stdlib").read_text()
    (folder / "run_facts.json").write_text(json.dumps({"examples_per_step": 8, "weights_dtype": "float32"}))
    assert write_model_card(folder, datasets="stdlib").read_text() == plain
    (folder / "run_facts.json").write_text(json.dumps({"examples_per_step": 8, "weights_dtype": "bfloat16"}))
    text = write_model_card(folder, datasets="stdlib").read_text()
    assert "**Weights:**" not in plain and BF16_WEIGHTS_LINE in text
    assert text.replace(BF16_WEIGHTS_LINE + "\n\n", "") == plain  # one line more, in the Training section
    assert text.index("**Data:** stdlib") < text.index(BF16_WEIGHTS_LINE) < text.index("**Hyper-parameters:**")


def test_given_loss_curve_is_copied_in(tmp_path):
    folder = _save(DecoderForCausalLM(tiny_decoder_config()), tmp_path / "m")
    image = tmp_path / "curve.png"
    image.write_bytes(b"\x89PNG fake")
    text = write_model_card(folder, loss_curve=image).read_text()
    assert (folder / "loss_curve.png").read_bytes() == b"\x89PNG fake" and "(loss_curve.png)" in text


def test_no_training_information(tmp_path):
    folder = _save(DecoderForCausalLM(tiny_decoder_config()), tmp_path / "m")
    text = write_model_card(folder).read_text()
    assert "**Data:** not recorded." in text and "No Trainer state was saved" in text
    assert ModelCard.load(folder / "README.md").data.eval_results is None


def test_folder_without_config_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        write_model_card(tmp_path)


@pytest.mark.slow  # a fresh interpreter
def test_usage_snippet_runs_for_every_head_without_archlab(tmp_path):
    snippets = []
    for auto_class, config_class, model_class in registration.MODEL_REGISTRY:
        folder = _save(model_class(tiny_config_for(config_class)), tmp_path / model_class.__name__)
        text = write_model_card(folder, model_id=f"someone/{model_class.__name__}").read_text()
        snippet = re.search(r"```python\n(.*?)```", text, re.S).group(1)
        assert f'model_id = "someone/{model_class.__name__}"' in snippet
        assert f"{auto_class.__name__}.from_pretrained(model_id, trust_remote_code=True)" in snippet
        snippets.append(snippet.replace(f'"someone/{model_class.__name__}"', repr(str(folder))))
    code = "\n".join(f"exec({snippet!r}, {{}})\nprint('SNIPPET-DONE')" for snippet in snippets)
    out = check(run_without_archlab(code, tmp_path / "isolated"))
    assert out.count("SNIPPET-DONE") == len(snippets)


def test_a_regression_heads_snippet_prints_its_value_not_a_label(tmp_path, capsys):
    """A classifier fine-tuned on float labels (problem_type "regression", one output): the snippet printed
    `id2label[argmax]`, which over one output is always the placeholder "LABEL_0"."""
    config = tiny_decoder_config(num_labels=1, problem_type="regression")
    torch.manual_seed(0)
    model = DecoderForSequenceClassification(config).eval()
    folder = _save(model, tmp_path / "regressor")
    snippet = re.search(r"```python\n(.*?)```", write_model_card(folder).read_text(), re.S).group(1)
    assert "print(logits[0, 0].item())" in snippet and "id2label" not in snippet
    exec(snippet.replace('"regressor"', repr(str(folder))), {})
    with torch.no_grad():
        expected = model(input_ids=torch.tensor([[1, 5, 6, 7, 8]])).logits[0, 0].item()
    assert float(capsys.readouterr().out.strip().splitlines()[-1]) == pytest.approx(expected, rel=1e-5, abs=1e-6)


def test_parameter_counts_of_a_quantized_folder_are_the_models(tmp_path):
    """A quantized save (here as bitsandbytes' 4-bit writes one: each projection two values a byte, beside its absmax
    and quant map) counts the model's parameters, not the bytes and constants in the file."""
    from safetensors.torch import load_file, save_file

    config = tiny_decoder_config(num_local_experts=4, num_experts_per_tok=2)
    folder = _save(DecoderForCausalLM(config), tmp_path / "m")
    text = write_model_card(folder).read_text()
    expected = _count(text, "in total"), _count(text, "active per token")
    tensors = load_file(folder / "model.safetensors")
    for name in [name for name in tensors if name.endswith("_proj.weight")]:
        weight = tensors.pop(name)
        tensors[name] = torch.zeros(weight.numel() // 2, 1, dtype=torch.uint8)
        tensors[f"{name}.absmax"], tensors[f"{name}.quant_map"] = torch.ones(weight.numel() // 64), torch.ones(16)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    values = json.loads((folder / "config.json").read_text())
    values["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (folder / "config.json").write_text(json.dumps(values))
    text = write_model_card(folder).read_text()
    assert (_count(text, "in total"), _count(text, "active per token")) == expected


def test_parameter_counts_of_a_sharded_checkpoint(tmp_path):
    model = DecoderForCausalLM(tiny_decoder_config())
    model.save_pretrained(tmp_path / "m", max_shard_size="20KB")
    assert (tmp_path / "m" / "model.safetensors.index.json").is_file()
    text = write_model_card(tmp_path / "m").read_text()
    assert _count(text, "in total") == sum(p.numel() for p in model.parameters())


def test_a_multi_label_heads_snippet_prints_the_classes_over_one_half(tmp_path, capsys):
    """A classifier fine-tuned on lists of labels (problem_type "multi_label_classification"): the snippet printed
    `id2label[argmax]`, one class, where the head scores each class by its own sigmoid."""
    config = tiny_decoder_config(id2label={0: "a", 1: "b", 2: "c"}, problem_type="multi_label_classification")
    torch.manual_seed(0)
    model = DecoderForSequenceClassification(config).eval()
    folder = _save(model, tmp_path / "tagger")
    snippet = re.search(r"```python\n(.*?)```", write_model_card(folder).read_text(), re.S).group(1)
    assert "sigmoid()" in snippet and "argmax" not in snippet
    exec(snippet.replace('"tagger"', repr(str(folder))), {})
    with torch.no_grad():
        probabilities = model(input_ids=torch.tensor([[1, 5, 6, 7, 8]])).logits[0].sigmoid()
    expected = [name for name, p in zip("abc", probabilities) if p > 0.5]
    assert capsys.readouterr().out.strip().splitlines()[-1] == repr(expected)


@pytest.mark.parametrize("head", ["tokens", "qa"])
def test_a_token_classifier_and_a_qa_models_cards_load_and_run_their_head(head, tmp_path, capsys):
    """Their cards named no task and loaded `AutoModel` (the body alone) in the snippet; now the head's Auto class and
    Hub task, and the snippet prints a label per token / the answer span."""
    cls = DecoderForTokenClassification if head == "tokens" else DecoderForQuestionAnswering
    torch.manual_seed(0)
    model = cls(tiny_decoder_config(id2label={0: "O", 1: "X"})).eval()
    folder = _save(model, tmp_path / "head")
    card = write_model_card(folder)
    task = "token-classification" if head == "tokens" else "question-answering"
    assert ModelCard.load(card).data.pipeline_tag == task
    snippet = re.search(r"```python\n(.*?)```", card.read_text(), re.S).group(1)
    assert f"AutoModel{cls.__name__.removeprefix('Decoder')}.from_pretrained(" in snippet
    exec(snippet.replace('"head"', repr(str(folder))), {})
    ids = torch.tensor([[1, 5, 6, 7, 8]])
    with torch.no_grad():
        output = model(input_ids=ids)
    if head == "tokens":
        expected = [model.config.id2label[int(i)] for i in output.logits.argmax(-1)[0]]
    else:
        start = int(output.start_logits.argmax())
        expected = ids[0, start : start + int(output.end_logits[0, start:].argmax()) + 1].tolist()
    assert capsys.readouterr().out.strip().splitlines()[-1] == repr(expected)


def test_a_qa_models_card_asks_a_question_about_a_context(tmp_path, capsys):
    """A QA model's snippet fed one text (a context without a question) and took the start and the end apart (an
    end before the start printed nothing); it now encodes a question and a context as the tokenizer's pair, with
    the segment ids of a model that reads them, and prints the span from the best start to the best end after it."""
    from archlab import EncoderForQuestionAnswering, Seq2SeqConfig
    from archlab.tokenization.training import save_tokenizer, train_tokenizer

    tokenizer = train_tokenizer(["what is the name of the function", "def fibonacci(n):"], "masked_lm", vocab_size=80)
    torch.manual_seed(0)
    config = tiny_config_for(Seq2SeqConfig, vocab_size=len(tokenizer), type_vocab_size=2)
    model = EncoderForQuestionAnswering(config).eval()
    folder = _save(model, tmp_path / "qa")
    save_tokenizer(tokenizer, folder)
    snippet = re.search(r"```python\n(.*?)```", write_model_card(folder).read_text(), re.S).group(1)
    assert "tokenizer(question, context," in snippet and "return_token_type_ids=True" in snippet
    exec(snippet.replace('"qa"', repr(str(folder))), {})
    inputs = tokenizer("What is the name of the function?", "def fibonacci(n):", return_tensors="pt")
    with torch.no_grad():
        output = model(**inputs)
    start = int(output.start_logits.argmax())
    end = start + int(output.end_logits[0, start:].argmax())
    expected = tokenizer.decode(inputs["input_ids"][0, start : end + 1])
    assert capsys.readouterr().out.rstrip("\n").splitlines()[-1] == expected
