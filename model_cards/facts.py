"""The facts a model card states, read from a saved folder without loading the model.

- `architecture_rows`: the architecture table, generated from `config.json`. Every field is read with a default
  (the LLaMA recipe for the decoder, Marian's for the encoder-decoder), so a folder written before a field existed
  still gets a correct table.
- `parameter_counts`: total parameters from the safetensors headers (tied weights are stored once, so they count
  once) and active parameters per token for a mixture of experts (only `num_experts_per_tok` of the experts run);
  for a quantized folder, from the model its config describes, built on the meta device.
- `training_summary`: the training data, hyper-parameters, final losses and evaluation metrics from the Trainer's
  state (`trainer_state.json`) and arguments (`TrainingArguments` or a JSON dict; never the pickled
  `training_args.bin`), and the dtype of the weights trained from the training scripts' `run_facts.json`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from safetensors import safe_open

# architecture class name suffix -> Hub pipeline tag. The encoder-decoder's default is `translation`, the task of the
# model it implements (Vaswani et al.) and of the checkpoints it converts (Marian opus-mt); a summariser passes
# `pipeline_tag="summarization"`. Not `text2text-generation`: the Hub now files that tag under `text-generation`,
# whose widget and snippets call `pipeline("text-generation")`, which cannot load an encoder-decoder. For
# `translation`/`summarization` the Hub itself says that transformers 5 has no such pipeline and shows loading the
# model directly, which is what the card's usage snippet does.
SEQ2SEQ_PIPELINE_TAGS = ("translation", "summarization")
PIPELINE_TAGS = {
    "ForCausalLM": "text-generation",
    "ForSequenceClassification": "text-classification",
    "ForTokenClassification": "token-classification",
    "ForQuestionAnswering": "question-answering",
    "ForConditionalGeneration": "translation",
    "ForMaskedLM": "fill-mask",
    "Model": "feature-extraction",
}

# architecture class name suffix -> the Auto class that loads it
AUTO_CLASSES = {
    "ForCausalLM": "AutoModelForCausalLM",
    "ForSequenceClassification": "AutoModelForSequenceClassification",
    "ForTokenClassification": "AutoModelForTokenClassification",
    "ForQuestionAnswering": "AutoModelForQuestionAnswering",
    "ForConditionalGeneration": "AutoModelForSeq2SeqLM",
    "ForMaskedLM": "AutoModelForMaskedLM",
    "Model": "AutoModel",
}

# the hyper-parameters worth stating, in TrainingArguments' names
HYPERPARAMETERS = (
    "learning_rate",
    "lr_scheduler_type",
    "warmup_steps",
    "warmup_ratio",
    "num_train_epochs",
    "max_steps",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "optim",
    "adam_beta1",
    "adam_beta2",
    "adam_epsilon",
    "weight_decay",
    "max_grad_norm",
    "bf16",
    "fp16",
    "seed",
)

# the training scripts' record of a run (`archlab.training.checkpoints.run_facts`), saved in each checkpoint and
# beside the final model: its `weights_dtype` is the dtype of the weights the Trainer updated (`--dtype`), which
# `TrainingArguments` (`bf16`/`fp16`: autocast) do not hold
RUN_FACTS = "run_facts.json"

# Trainer metrics about speed, not quality
_TIMING_KEYS = ("_runtime", "_samples_per_second", "_steps_per_second", "_preparation_time", "_flos")

_FFN_NAMES = {("gated", "silu"): "SwiGLU", ("gated", "swish"): "SwiGLU", ("gated", "gelu"): "GeGLU"}


def _suffix(architecture: str, table: dict[str, str]) -> str | None:
    for suffix, value in table.items():
        if architecture.endswith(suffix):
            return value
    return None


def pipeline_tag_for(architecture: str) -> str | None:
    return _suffix(architecture, PIPELINE_TAGS)


def pipeline_tags_allowed(architecture: str) -> tuple[str, ...]:
    """The Hub tasks a card may give this architecture: an encoder-decoder translates or summarises, every other
    head has the one task its class does."""
    if architecture.endswith("ForConditionalGeneration"):
        return SEQ2SEQ_PIPELINE_TAGS
    default = pipeline_tag_for(architecture)
    return (default,) if default else ()


def check_pipeline_tag(architecture: str, pipeline_tag: str | None) -> None:
    """ValueError naming `pipeline_tag` and the allowed values when the tag does not fit the architecture."""
    allowed = pipeline_tags_allowed(architecture)
    if pipeline_tag is not None and pipeline_tag not in allowed:
        raise ValueError(f"pipeline_tag={pipeline_tag!r} does not fit a {architecture}; allowed: {list(allowed)}")


def auto_class_for(architecture: str) -> str:
    return _suffix(architecture, AUTO_CLASSES) or "AutoModel"


def read_config(folder: str | Path) -> dict[str, Any]:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"No config.json in {folder}: is it a folder written by `save_pretrained`?")
    return json.loads(path.read_text(encoding="utf-8"))


def _first(config: dict[str, Any], *names: str, default: Any = None) -> Any:
    for name in names:
        if config.get(name) is not None:
            return config[name]
    return default


def _attention_kind(heads: int | None, kv_heads: int | None) -> str:
    if not heads:
        return "multi-head"
    kv_heads = kv_heads or heads
    if kv_heads == heads:
        return f"multi-head (MHA), {heads} heads"
    if kv_heads == 1:
        return f"multi-query (MQA), {heads} query heads, 1 key/value head"
    return f"grouped-query (GQA), {heads} query heads, {kv_heads} key/value heads"


def _positions(config: dict[str, Any], encoder_decoder: bool) -> str:
    kind = config.get("position_embedding_type", "sinusoidal" if encoder_decoder else "rope")
    if kind != "rope":
        return str(kind)
    rope = config.get("rope_parameters") or {}
    per_layer_type = {name: value for name, value in rope.items() if isinstance(value, dict)}
    if per_layer_type:  # one set per layer type (Gemma3's local and global bases)
        text = "RoPE per layer type: " + "; ".join(
            f"{name} {_rope_set(value)}" for name, value in per_layer_type.items()
        )
    else:
        text = f"RoPE {_rope_set(rope)}"
    nope = config.get("nope_layers")
    if nope:  # RoPE interleaved with layers that see no positions (SmolLM3, Llama 4)
        text += f"; no positions (NoPE) in layers {', '.join(map(str, sorted(nope)))}"
        if config.get("attn_temperature_tuning"):  # Llama 4
            text += (
                f", their queries' temperature tuned (attn_scale {config.get('attn_scale'):g}, floor_scale "
                f"{config.get('floor_scale'):g})"
            )
    return text


# The entries of a RoPE parameter set besides its type, base and partial factor, in the order a card shows them: the
# scaled types' factor and pre-training length first, then what each type reads besides (yarn's betas and scales,
# longrope's per-frequency factors, llama3's frequency bands). An entry a set holds that is not listed comes after.
ROPE_ENTRY_ORDER = (
    "factor",
    "original_max_position_embeddings",
    "low_freq_factor",
    "high_freq_factor",
    "beta_fast",
    "beta_slow",
    "attention_factor",
    "mscale",
    "mscale_all_dim",
    "truncate",
    "short_factor",
    "long_factor",
)
ROPE_SET_OWN_ENTRIES = ("rope_type", "type", "rope_theta", "partial_rotary_factor")


def _rope_entry(name: str, value: Any) -> str:
    """`name=value`; a list of per-frequency factors as its range and length (`1..4 (32 values)`)."""
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, (int, float)) for v in value):
        low, high = min(value), max(value)
        return f"{name}={low:g} (x{len(value)})" if low == high else f"{name}={low:g}..{high:g} ({len(value)} values)"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return f"{name}={value:g}"
    return f"{name}={value}"


def _rope_set(rope: dict[str, Any]) -> str:
    """One RoPE parameter set: `(type, theta=..., partial ..., factor=..., ...)`, every entry its type reads."""
    text = f"({rope.get('rope_type', rope.get('type', 'default'))}, theta={rope.get('rope_theta', 10000.0):g}"
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        text += f", partial {rope['partial_rotary_factor']:g}"
    others = sorted(name for name in rope if name not in ROPE_ENTRY_ORDER + ROPE_SET_OWN_ENTRIES)
    for name in [name for name in ROPE_ENTRY_ORDER if name in rope] + others:
        text += f", {_rope_entry(name, rope[name])}"
    return text + ")"


def _attention_pattern(config: dict[str, Any]) -> str:
    layer_types = config.get("layer_types")
    window = config.get("sliding_window")
    if layer_types:
        counts: dict[str, int] = {}
        for kind in layer_types:
            counts[kind] = counts.get(kind, 0) + 1
        text = ", ".join(f"{kind} x{n}" for kind, n in counts.items())
    else:
        text = "sliding window" if window else "full"
    if window:
        text += f" (window {window})"
    if config.get("attention_chunk_size"):  # Llama 4's chunked attention
        text += f" (chunks of {config['attention_chunk_size']})"
    return text


def _experts(config: dict[str, Any]) -> str:
    experts = _first(config, "num_local_experts", "num_experts", default=0) or 0
    if experts <= 1:
        return "none (dense)"
    text = f"{experts} experts, top-{config.get('num_experts_per_tok', 2)} routing"
    if config.get("router_score_function") == "sigmoid":  # DeepSeek-V3's router
        text += " on sigmoid scores" + (" with a correction bias" if config.get("router_correction_bias") else "")
        if config.get("router_bias_update_rate"):
            text += f" (auxiliary-loss-free balancing, rate {config['router_bias_update_rate']:g})"
    groups, top_groups = config.get("router_groups") or 1, config.get("router_top_groups")
    if groups > 1 and top_groups and top_groups < groups:  # DeepSeek-V3's group-limited routing
        text += f", from the best {top_groups} of {groups} expert groups"
        if config.get("router_group_score") == "max":  # DeepSeek-V2's group-limited greedy routing
            text += " (scored by their best expert)"
    if config.get("router_bias"):  # GPT-OSS
        text += ", a router bias"
    if config.get("moe_intermediate_size"):
        text += f", expert width {config['moe_intermediate_size']}"
    if config.get("expert_bias"):
        text += ", expert biases"
    if config.get("routing_weights_on_input"):  # Llama 4
        text += ", the routing weight applied to each expert's input"
    shared = _first(config, "num_shared_experts", "shared_expert_intermediate_size", default=0)
    if shared:
        text += ", shared expert" + ("s" if config.get("num_shared_experts", 1) > 1 else "")
    layer_types = config.get("mlp_layer_types")
    if layer_types and "dense" in layer_types:
        text += f"; sparse in {sum(kind != 'dense' for kind in layer_types)} of {len(layer_types)} layers"
    return text


def architecture_rows(config: dict[str, Any]) -> list[tuple[str, str]]:
    """(property, value) rows for the card's architecture table."""
    encoder_decoder = bool(config.get("is_encoder_decoder") or "encoder_layers" in config)
    architecture = (config.get("architectures") or [config.get("model_type", "?")])[0]
    hidden = _first(config, "hidden_size", "d_model")
    rows = [("class", f"`{architecture}` (`model_type={config.get('model_type')}`)")]
    if encoder_decoder:
        rows.append(("layers", f"{config.get('encoder_layers')} encoder, {config.get('decoder_layers')} decoder"))
        heads = _first(config, "encoder_attention_heads", "num_attention_heads")
        kv_heads = _first(config, "encoder_key_value_heads", "num_key_value_heads")
        ffn_width = _first(config, "encoder_ffn_dim", "intermediate_size")
        act = _first(config, "activation_function", "hidden_act", default="relu")
        default_norm, default_position, default_mlp = "layer_norm", "post", "plain"
    else:
        rows.append(("layers", str(config.get("num_hidden_layers"))))
        heads = config.get("num_attention_heads")
        kv_heads = config.get("num_key_value_heads")
        ffn_width = config.get("intermediate_size")
        act = _first(config, "hidden_act", "activation_function", default="silu")
        default_norm, default_position, default_mlp = "rms_norm", "pre", "gated"
    rows.append(("hidden size", str(hidden)))
    if config.get("kv_lora_rank"):  # DeepSeek-V2/V3's multi-head latent attention
        query = f", queries through a rank-{config['q_lora_rank']} latent" if config.get("q_lora_rank") else ""
        rows.append(
            (
                "attention",
                f"multi-head latent (MLA), {heads} heads, keys and values from a cached rank-"
                f"{config['kv_lora_rank']} latent{query}; per head {config.get('qk_nope_head_dim')} + "
                f"{config.get('qk_rope_head_dim')} (RoPE) query/key channels, {config.get('v_head_dim')} value "
                "channels",
            )
        )
    else:
        rows.append(("attention", _attention_kind(heads, kv_heads)))
    head_dim = _first(config, "head_dim", "d_kv")  # T5's d_kv in the encoder-decoder
    if head_dim:
        rows.append(("head dim", str(head_dim)))
    rows.append(("attention pattern", _attention_pattern(config)))
    if config.get("attention_output_gate"):  # gated attention (AFMoE, Qwen3-Next)
        rows.append(("attention output gate", f"sigmoid, {config['attention_output_gate']}"))
    if config.get("attention_sinks"):  # GPT-OSS
        rows.append(("attention sinks", "a learned logit per head in the softmax's denominator"))
    rows.append(("positions", _positions(config, encoder_decoder)))
    if config.get("query_scaling_beta"):  # Mistral 3's `llama_4_scaling_beta`
        beta, length = config["query_scaling_beta"], config.get("query_scaling_length")
        rows.append(("query scaling", f"× 1 + {beta:g} · log(1 + floor(position / {length})) after RoPE"))
    norm = config.get("norm_type", default_norm)
    eps = _first(config, "rms_norm_eps", "layer_norm_eps", "norm_eps")
    rows.append(("normalization", f"{norm}" + (f" (eps={eps:g})" if isinstance(eps, (int, float)) else "")))
    if config.get("sub_layer_norm"):  # Sub-LN (Foundation Transformers, BitNet)
        rows.append(("sub-layer norms", "Sub-LN: heads' output before o_proj, MLP activation before down_proj"))
    if config.get("bitlinear"):  # BitNet b1.58
        rows.append(("projections", "BitLinear: ternary weights, 8-bit activations (BitNet b1.58)"))
    rows.append(("norm position", str(config.get("norm_position", default_position))))
    mlp_type = config.get("mlp_type", default_mlp)
    ffn_name = _FFN_NAMES.get((mlp_type, act), f"{mlp_type} MLP, {act}")
    limit, offset = config.get("swiglu_limit"), config.get("swiglu_up_offset")
    if limit is not None:  # GPT-OSS's clamped SwiGLU
        ffn_name += f", gate ≤ {limit:g} and |up| ≤ {limit:g}"
    if offset:
        ffn_name += f", up + {offset:g}"
    rows.append(("feed-forward", f"{ffn_name}, width {ffn_width}"))
    rows.append(("experts", _experts(config)))
    stability = [
        f"{name}={config[name]}"
        for name in (
            "use_qk_norm",
            "qk_norm",
            "attn_logit_softcapping",
            "final_logit_softcapping",
            "lm_z_loss_coef",
            "z_loss_coef",
            "router_z_loss_coef",
        )
        if config.get(name)
    ]
    if config.get("use_qk_norm") and config.get("qk_norm_scope", "head") != "head":  # OLMo 2's, over the projection
        stability.insert(1, f"qk_norm_scope={config['qk_norm_scope']}")
    if config.get("qk_norm_after_rope"):
        stability.append("qk_norm_after_rope=True")
    for name in ("qk_norm_weight", "qk_norm_nope_layers"):  # Llama 4's: no gain, none on the NoPE layers
        if config.get("use_qk_norm") and config.get(name) is False:
            stability.append(f"{name}=False")
    if stability:
        rows.append(("stability", ", ".join(stability)))
    multipliers = [  # μP's constants (Granite), where they are not 1 (the attention's: where given)
        f"{name}={config[name]:g}"
        for name in ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logit_scale")
        if isinstance(config.get(name), (int, float)) and (config[name] != 1 or name == "attention_multiplier")
    ]
    if multipliers:
        rows.append(("multipliers", ", ".join(multipliers)))
    rows.append(("vocabulary", str(config.get("vocab_size"))))
    context = _first(config, "max_position_embeddings")
    if context:
        rows.append(("context length", str(context)))
    rows.append(("tied embeddings", str(bool(config.get("tie_word_embeddings", False)))))
    return rows


def _weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        return [folder / shard for shard in shards]
    single = folder / "model.safetensors"
    return [single] if single.is_file() else []


def parameter_counts(folder: str | Path, config: dict[str, Any]) -> tuple[int, int] | None:
    """(total, active per token), or None when the folder has no safetensors weights.

    Active = total minus the experts a token does not visit: expert tensors (names containing `.experts.`) count
    with the fraction `num_experts_per_tok / num_local_experts`; shared experts, attention and embeddings count fully.
    """
    files = _weight_files(Path(folder))
    if not files:
        return None
    if config.get("quantization_config"):
        sizes = _unquantized_sizes(config)
        if sizes is None:
            return None
    else:
        sizes = {}
        for file in files:
            with safe_open(str(file), framework="pt") as handle:
                sizes.update((name, math.prod(handle.get_slice(name).get_shape())) for name in handle.keys())
    total = sum(sizes.values())
    expert = sum(size for name, size in sizes.items() if ".experts." in f".{name}")
    num_experts = _first(config, "num_local_experts", "num_experts", default=0) or 0
    if expert and num_experts > 1:
        active_fraction = min(config.get("num_experts_per_tok", 2), num_experts) / num_experts
        return total, total - round(expert * (1.0 - active_fraction))
    return total, total


def _unquantized_sizes(config: dict[str, Any]) -> dict[str, int] | None:
    """{name: size} of what a save of the unquantized model holds (parameters, tied ones once, and persistent
    buffers), from the model `config` describes built on the meta device (nothing allocated or read). A quantized
    folder's headers hold packed data and quantization constants instead: bitsandbytes' 4-bit weights are two
    values a byte beside their absmax and quant-map tensors (the counts came out 4 % low on a tiny MoE, about half
    on a model of mostly projections). None where the folder's class is not archlab's."""
    import torch

    from .. import modeling
    from ..modeling.pretrained import ArchlabPreTrainedModel

    model_class = getattr(modeling, (config.get("architectures") or [""])[0], None)
    if not (isinstance(model_class, type) and issubclass(model_class, ArchlabPreTrainedModel)):
        return None
    values = {key: value for key, value in config.items() if key != "quantization_config"}
    with torch.device("meta"):
        model = model_class(model_class.config_class.from_dict(values))
    sizes = {name: parameter.numel() for name, parameter in model.named_parameters()}
    for name, buffer in model.named_buffers():
        owner, _, leaf = name.rpartition(".")
        if leaf not in model.get_submodule(owner)._non_persistent_buffers_set:
            sizes[name] = buffer.numel()
    return sizes


def format_count(count: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= scale:
            return f"{count / scale:.2f}{unit} ({count:,})"
    return f"{count:,}"


def _as_dict(obj: Any) -> dict[str, Any] | None:
    """A TrainerState/TrainingArguments/dict/JSON path as a plain dict (None stays None)."""
    if obj is None:
        return None
    if isinstance(obj, dict):
        return obj
    if isinstance(obj, (str, Path)):
        return json.loads(Path(obj).read_text(encoding="utf-8"))
    if hasattr(obj, "to_dict"):
        return obj.to_dict()
    if dataclasses.is_dataclass(obj):
        return dataclasses.asdict(obj)
    raise TypeError(f"Cannot read training information from {type(obj).__name__}: pass a dict, a path or a dataclass.")


def training_summary(folder: Path, trainer_state: Any = None, training_args: Any = None) -> dict[str, Any]:
    """What the card says about training; looks for trainer_state.json / training_args.json / run_facts.json in the
    folder. `weights_dtype`: the dtype the weights were trained in, None where the folder does not record it."""
    state = _as_dict(trainer_state)
    if state is None and (folder / "trainer_state.json").is_file():
        state = _as_dict(folder / "trainer_state.json")
    args = _as_dict(training_args)
    if args is None and (folder / "training_args.json").is_file():
        args = _as_dict(folder / "training_args.json")
    summary: dict[str, Any] = {"hyperparameters": [], "results": [], "losses": [], "eval_metrics": {}}
    facts = _as_dict(folder / RUN_FACTS) if (folder / RUN_FACTS).is_file() else {}
    summary["weights_dtype"] = facts.get("weights_dtype")
    if args:
        skip = {"num_train_epochs"} if (args.get("max_steps") or -1) > 0 else set()  # max_steps overrides epochs
        summary["hyperparameters"] = [
            (k, args[k]) for k in HYPERPARAMETERS if k not in skip and args.get(k) not in (None, "", -1)
        ]
    if state:
        history = state.get("log_history") or []
        summary["losses"] = [(entry["step"], entry["loss"]) for entry in history if "loss" in entry and "step" in entry]
        evals = [entry for entry in history if any(key.startswith("eval_") for key in entry)]
        if evals:
            summary["eval_metrics"] = {
                key[len("eval_") :]: value
                for key, value in evals[-1].items()
                if key.startswith("eval_") and isinstance(value, (int, float)) and not key.endswith(_TIMING_KEYS)
            }
        epoch = state.get("epoch")
        results = [("steps", state.get("global_step")), ("epochs", round(epoch, 4) if epoch is not None else None)]
        if state.get("train_batch_size"):
            results.append(("train batch size (per device)", state["train_batch_size"]))
        if state.get("num_input_tokens_seen"):
            results.append(("tokens seen", state["num_input_tokens_seen"]))
        if summary["losses"]:
            results.append(("final training loss", round(summary["losses"][-1][1], 4)))
        for key, value in summary["eval_metrics"].items():
            results.append((f"evaluation {key}", round(value, 4) if isinstance(value, float) else value))
        summary["results"] = [(k, v) for k, v in results if v is not None]
    return summary
