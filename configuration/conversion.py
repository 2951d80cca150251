"""Checkpoint conversion between stock Hugging Face families and archlab.

`convert_checkpoint(src, dst)` reads `src/config.json`; a stock family (e.g. "llama") becomes an archlab folder that
the Auto classes load, and an archlab folder with `to="llama"` becomes a stock folder that `LlamaForCausalLM` loads,
so every serving tool built for that family serves archlab models. A config that the target family cannot express is
refused with a message that names the offending fields.

Each family is a `FamilyConversion` in `FAMILIES`: how its config maps to an archlab config and back, and how its
parameter names map (identity for Llama, whose names archlab uses). Later families register the same way. The
Llama-like decoder families are rows of one table, `DECODER_FAMILIES`: the fields they share with archlab, the
extra fields they read, the archlab values they imply and the checks a config must pass to export. The encoder-decoder
families are Marian and the T5 family (`t5`: T5 v1.0, v1.1, flan-T5; `mt5`; `umt5`), whose members are rows of
`T5_VARIANTS` over one parameter renaming.
Weights are read and written as safetensors only; the model is built on the meta device, so converting never holds
two copies of the weights.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from transformers import AutoConfig, PreTrainedConfig, PreTrainedModel

from ..modeling import DecoderConfig, DecoderForCausalLM, Seq2SeqConfig, Seq2SeqForConditionalGeneration
from ..modeling.sinusoidal import split_table

# archlab decoder fields that change training only, never the function a checkpoint computes: any value is
# compatible with a stock family. Other archlab fields must keep their default (the LLaMA recipe) to export.
TRAINING_ONLY_FIELDS = {"lm_loss_chunk_size", "classifier_lm_loss_weight"}

# PreTrainedConfig bookkeeping fields that are never architecture.
_BOOKKEEPING = {
    "architectures", "auto_map", "transformers_version", "dtype", "torch_dtype", "model_type", "_name_or_path",
    "id2label", "label2id", "problem_type", "output_hidden_states", "return_dict", "chunk_size_feed_forward",
    "is_encoder_decoder", "tie_word_embeddings", "use_cache",
}

# LlamaConfig fields archlab's DecoderConfig shares with identical meaning.
LLAMA_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "initializer_range", "rms_norm_eps",
    "use_cache", "pad_token_id", "bos_token_id", "eos_token_id", "tie_word_embeddings", "rope_parameters",
    "attention_bias", "attention_dropout", "mlp_bias",
)


@dataclass
class FamilyConversion:
    """How one stock family maps to and from archlab."""

    model_type: str  # the stock family's `model_type`
    architecture: str  # the stock class written into `architectures`, e.g. "LlamaForCausalLM"
    shared_fields: tuple[str, ...]  # config fields with the same name and meaning on both sides
    # archlab fields that this family fixes to a value (beyond the defaults), e.g. sliding_window for Mistral
    to_archlab_extra: Callable[[dict[str, Any]], dict[str, Any]] = lambda hf: {}
    from_archlab_extra: Callable[[DecoderConfig], dict[str, Any]] = lambda cfg: {}
    # archlab fields this family can express with a non-default value (handled by `from_archlab_extra`)
    expressible_fields: set[str] = field(default_factory=set)
    # parameter renames stock -> archlab (a function over the key); identity for families archlab mirrors
    rename_to_archlab: Callable[[str], str] = lambda key: key
    rename_from_archlab: Callable[[str], str] = lambda key: key
    archlab_class: type[PreTrainedModel] = DecoderForCausalLM
    archlab_config_class: type[PreTrainedConfig] = DecoderConfig
    # adds the tensors a checkpoint leaves out but the target's state dict names (tied copies, fixed tables);
    # called in both directions with the (renamed) state dict and the archlab config
    complete_state_dict: Callable[[dict[str, torch.Tensor], PreTrainedConfig], dict[str, torch.Tensor]] = (
        lambda state_dict, config: state_dict
    )


# MistralConfig: Llama's fields without the bias flags, plus `sliding_window`, which makes every layer local.
MISTRAL_FIELDS = tuple(name for name in LLAMA_FIELDS if name not in ("attention_bias", "mlp_bias"))

# MixtralConfig: Mistral's fields plus the mixture of experts. Every layer is sparse, each expert is
# `intermediate_size` wide, the top-k weights are always renormalised (archlab: `norm_topk_prob=True`).
MIXTRAL_FIELDS = MISTRAL_FIELDS + (
    "num_local_experts", "num_experts_per_tok", "output_router_logits", "router_aux_loss_coef", "router_jitter_noise",
)


def _one_window_for_every_layer(config: DecoderConfig, architecture: str) -> None:
    expected = "full_attention" if config.sliding_window is None else "sliding_attention"
    if any(kind != expected for kind in config.layer_types):
        raise ConversionError(
            f"{architecture} applies `sliding_window` to every layer; this config's `layer_types` "
            f"({config.layer_types}) mixes local and global layers, which {architecture.removesuffix('ForCausalLM')} "
            f"cannot express."
        )


def _experts_in_every_layer(config: DecoderConfig, architecture: str) -> None:
    if config.num_local_experts < 1 or "dense" in config.mlp_layer_types:
        raise ConversionError(
            f"{architecture} has a mixture of experts in every layer; this config has num_local_experts="
            f"{config.num_local_experts} and mlp_layer_types={config.mlp_layer_types}."
        )


@dataclass(frozen=True)
class DecoderFamily:
    """One row of `DECODER_FAMILIES`: a Llama-like stock decoder family, as data."""

    prefix: str  # class-name prefix: "Mistral" -> MistralConfig, MistralForCausalLM
    shared_fields: tuple[str, ...]
    # stock fields archlab reads with the stock meaning but exports only under the `checks` (e.g. sliding_window)
    extra_fields: tuple[str, ...] = ()
    implied: dict[str, Any] = field(default_factory=dict)  # archlab values the family always has
    checks: tuple[Callable[[DecoderConfig, str], None], ...] = ()  # raise ConversionError if not expressible
    expressible_fields: frozenset[str] = frozenset()  # archlab fields it expresses with a non-default value
    complete_state_dict: Callable[[dict[str, torch.Tensor], PreTrainedConfig], dict[str, torch.Tensor]] = (
        lambda state_dict, config: state_dict
    )

    def to_archlab(self, hf_config: dict[str, Any]) -> dict[str, Any]:
        """config.json may omit fields at the stock config's defaults, which differ from archlab's: read it
        through the stock config class so that omitted fields take the stock meaning."""
        stock_config_class = getattr(__import__("transformers"), f"{self.prefix}Config")
        names = self.shared_fields + self.extra_fields + ("rope_theta", "rope_scaling")
        stock = stock_config_class(**{k: v for k, v in hf_config.items() if k in names})
        return {**{k: getattr(stock, k) for k in self.shared_fields + self.extra_fields}, **self.implied}

    def from_archlab(self, config: DecoderConfig) -> dict[str, Any]:
        for check in self.checks:
            check(config, f"{self.prefix}ForCausalLM")
        return {k: getattr(config, k) for k in self.extra_fields}

    def conversion(self, model_type: str) -> FamilyConversion:
        return FamilyConversion(
            model_type=model_type,
            architecture=f"{self.prefix}ForCausalLM",
            shared_fields=self.shared_fields,
            to_archlab_extra=self.to_archlab,
            from_archlab_extra=self.from_archlab,
            expressible_fields=set(self.expressible_fields),
            complete_state_dict=self.complete_state_dict,
        )


def _mixtral_state_dict(state_dict: dict[str, torch.Tensor], config: PreTrainedConfig) -> dict[str, torch.Tensor]:
    """Mixtral checkpoints store one module per expert (`block_sparse_moe.experts.E.w1/w3/w2` = gate/up/down and
    `block_sparse_moe.gate` the router); archlab holds them fused as transformers v5 does in memory
    (`mlp.experts.gate_up_proj` = [w1; w3] stacked over experts, `mlp.experts.down_proj`, `mlp.gate`).
    Already-fused state dicts (archlab -> Mixtral, whose `save_pretrained` writes the per-expert layout) pass."""
    legacy = re.compile(r"^(model\.layers\.\d+)\.block_sparse_moe\.(?:gate\.weight|experts\.(\d+)\.(w[123])\.weight)$")
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    for key, tensor in state_dict.items():
        match = legacy.match(key)
        if match is None:
            out[key] = tensor
        elif match.group(2) is None:
            out[f"{match.group(1)}.mlp.gate.weight"] = tensor
        else:
            experts.setdefault(match.group(1), {})[(int(match.group(2)), match.group(3))] = tensor
    for prefix, weights in experts.items():
        ids = range(config.num_local_experts)
        out[f"{prefix}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([weights[(e, "w1")], weights[(e, "w3")]]) for e in ids]
        )
        out[f"{prefix}.mlp.experts.down_proj"] = torch.stack([weights[(e, "w2")] for e in ids])
    return out


DECODER_FAMILIES: dict[str, DecoderFamily] = {
    "llama": DecoderFamily("Llama", LLAMA_FIELDS),
    "mistral": DecoderFamily(
        "Mistral",
        MISTRAL_FIELDS,
        extra_fields=("sliding_window",),
        checks=(_one_window_for_every_layer,),
        expressible_fields=frozenset({"sliding_window", "layer_types"}),
    ),
    "mixtral": DecoderFamily(
        "Mixtral",
        MIXTRAL_FIELDS,
        extra_fields=("sliding_window",),
        implied={"norm_topk_prob": True},
        checks=(_experts_in_every_layer, _one_window_for_every_layer),
        # the router z-loss only changes training; it is dropped on export
        expressible_fields=frozenset({"sliding_window", "layer_types", "router_z_loss_coef"}),
        complete_state_dict=_mixtral_state_dict,
    ),
}


# MarianConfig fields archlab's Seq2SeqConfig shares with identical meaning (Marian is archlab's classic recipe
# with GELU/Swish, the split sinusoid layout and Marian's token conventions).
MARIAN_FIELDS = (
    "vocab_size", "decoder_vocab_size", "max_position_embeddings", "encoder_layers", "encoder_ffn_dim",
    "encoder_attention_heads", "decoder_layers", "decoder_ffn_dim", "decoder_attention_heads", "encoder_layerdrop",
    "decoder_layerdrop", "use_cache", "activation_function", "d_model", "dropout", "attention_dropout",
    "activation_dropout", "init_std", "decoder_start_token_id", "scale_embedding", "pad_token_id", "eos_token_id",
    "bos_token_id", "forced_eos_token_id", "share_encoder_decoder_embeddings", "tie_word_embeddings",
)


def _marian_to_archlab(hf_config: dict[str, Any]) -> dict[str, Any]:
    """config.json omits fields at MarianConfig's defaults, which differ from archlab's: fill them in first."""
    from transformers import MarianConfig

    marian = MarianConfig(**{k: v for k, v in hf_config.items() if k in MARIAN_FIELDS})
    return {**{k: getattr(marian, k) for k in MARIAN_FIELDS}, "sinusoidal_layout": "split"}


def _marian_from_archlab(config: PreTrainedConfig) -> dict[str, Any]:
    if config.sinusoidal_layout != "split":
        raise ConversionError(
            f"Marian's sinusoid table uses the split layout; this config has sinusoidal_layout="
            f"{config.sinusoidal_layout!r}. Set it to 'split' (and retrain or fine-tune) to export."
        )
    return {}


def _marian_state_dict(state_dict: dict[str, torch.Tensor], config: PreTrainedConfig) -> dict[str, torch.Tensor]:
    """Marian's state dict names the shared embedding three times and holds the sinusoid tables; checkpoints saved
    by transformers drop the tied copies and the tables."""
    state_dict = dict(state_dict)
    dtype = next(iter(state_dict.values())).dtype
    table = split_table(config.max_position_embeddings, config.d_model).to(dtype)
    for side in ("encoder", "decoder"):
        state_dict.setdefault(f"model.{side}.embed_positions.weight", table.clone())  # one tensor per name
    if config.share_encoder_decoder_embeddings:
        shared = state_dict.get("model.shared.weight", state_dict.get("model.encoder.embed_tokens.weight"))
        for key in ("model.shared.weight", "model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight"):
            state_dict.setdefault(key, shared)
    state_dict.setdefault("final_logits_bias", torch.zeros(1, config.decoder_vocab_size, dtype=dtype))
    return state_dict


# T5 (Raffel et al. 2020) and T5 v1.1 / flan-T5 are archlab configs: pre-norm RMSNorm without bias, T5's relative
# bias (once per stack), unscaled q·kᵀ, no embedding scaling, no absolute positions, a ReLU or gated-GELU FFN, and
# (v1.0) a tied head fed d_model^-0.5 times the decoder output. mT5 (Xue et al. 2021) is T5 v1.1's layout under its own
# model_type; UMT5 (Chung et al. 2023) has a relative bias table in every self-attention layer. The three share T5's
# parameter names and T5Config's fields; `T5_VARIANTS` says where they differ. Fields with the same name and meaning:
T5_FIELDS = (
    "vocab_size", "d_model", "d_kv", "relative_attention_num_buckets", "relative_attention_max_distance", "use_cache",
    "pad_token_id", "eos_token_id", "decoder_start_token_id",
)
T5_CONFIG_FIELDS = T5_FIELDS[:-1] + (
    "d_ff", "num_layers", "num_decoder_layers", "num_heads", "dropout_rate", "layer_norm_epsilon", "feed_forward_proj",
)
# archlab values every T5 has (checked on export)
T5_IMPLIED: dict[str, Any] = {
    "norm_type": "rms_norm", "norm_position": "pre", "position_embedding_type": "relative_bias",
    "scale_embedding": False, "attention_bias": False, "mlp_bias": False, "scale_attn_weights": False,
    "share_encoder_decoder_embeddings": True, "relative_attention_bias_per_layer": False,
}
# archlab fields T5 expresses through its own fields (or that do not change the function: dropout split, init, the
# unused absolute-position length, bos, whether the pad row trains)
T5_EXPRESSIBLE = set(T5_IMPLIED) | {
    "encoder_layers", "decoder_layers", "encoder_attention_heads", "decoder_attention_heads", "encoder_key_value_heads",
    "decoder_key_value_heads", "encoder_ffn_dim", "decoder_ffn_dim", "activation_function", "mlp_type", "dropout",
    "attention_dropout", "activation_dropout", "layer_norm_eps", "scale_decoder_outputs", "decoder_vocab_size",
    "bos_token_id", "init_std", "max_position_embeddings", "train_pad_embedding",
    # every T5-family model clamps fp16 hidden states; archlab only when asked (fp32/bf16 compute the same either way)
    "clamp_fp16_hidden_states",
}
T5_SUBLAYERS = {
    "encoder": (("SelfAttention", "self_attn"),),
    "decoder": (("SelfAttention", "self_attn"), ("EncDecAttention", "encoder_attn")),
}
T5_PROJECTIONS = (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj"), ("o", "out_proj"))


@dataclass(frozen=True)
class T5Variant:
    """One member of the T5 family, as data: what its stock classes compute beyond T5's shared layout."""

    prefix: str  # stock class prefix: "MT5" -> MT5Config, MT5ForConditionalGeneration
    # whether the decoder output is multiplied by d_model^-0.5 before the head: None = T5's own rule (exactly when the
    # head is the tied embedding); a bool = always / never, whatever the config says
    scales_decoder_outputs: bool | None = None
    relative_attention_bias_per_layer: bool = False  # UMT5: a bias table in every self-attention layer

    def to_archlab(self, hf_config: dict[str, Any]) -> dict[str, Any]:
        """config.json omits fields at the stock config's defaults: read it through that class. T5: whether the head
        is the tied embedding fed d_model^-0.5 · output (v1.0) or a separate matrix fed the output as is (v1.1,
        flan-T5) is `scale_decoder_outputs` in configs saved by transformers 5 (which always write
        `tie_word_embeddings=True`) and `tie_word_embeddings` in older ones. mT5/UMT5 configs say nothing reliable
        about the head (transformers 5 forces the flag to True; Google's checkpoints say False and carry their own
        head), so `_t5_family_state_dict` decides from the weights."""
        stock = getattr(__import__("transformers"), f"{self.prefix}Config")(
            **{k: v for k, v in hf_config.items() if k in T5_CONFIG_FIELDS}
        )
        scale = self.scales_decoder_outputs
        if scale is None:
            scale = hf_config.get("scale_decoder_outputs", hf_config.get("tie_word_embeddings", True) is not False)
        return {
            **{k: getattr(stock, k) for k in T5_FIELDS[:-1]},
            **T5_IMPLIED,
            "relative_attention_bias_per_layer": self.relative_attention_bias_per_layer,
            "decoder_start_token_id": hf_config.get("decoder_start_token_id", stock.pad_token_id),  # starts from pad
            "bos_token_id": None,
            "encoder_layers": stock.num_layers,
            "decoder_layers": stock.num_decoder_layers,
            "encoder_attention_heads": stock.num_heads,
            "decoder_attention_heads": stock.num_heads,
            "encoder_ffn_dim": stock.d_ff,
            "decoder_ffn_dim": stock.d_ff,
            "mlp_type": "gated" if stock.is_gated_act else "plain",
            "activation_function": stock.dense_act_fn,  # "gated-gelu" is gelu_new (T5Config's legacy mapping)
            **{name: stock.dropout_rate for name in ("dropout", "attention_dropout", "activation_dropout")},
            "layer_norm_eps": stock.layer_norm_epsilon,
            "scale_decoder_outputs": scale,
            # mT5/UMT5: what config.json says until the weights are seen (`_mt5_state_dict`)
            "tie_word_embeddings": scale if self.scales_decoder_outputs is None else hf_config.get(
                "tie_word_embeddings", True
            ) is not False,
            "train_pad_embedding": True,  # no padding_idx: the pad row is the decoder's start and trains
            "clamp_fp16_hidden_states": True,  # the stock blocks clamp fp16 hidden states
        }

    def from_archlab(self, config: PreTrainedConfig) -> dict[str, Any]:
        """One head count, FFN width and dropout rate for both stacks, no GQA, the variant's output scaling (T5: a
        tied head exactly when scaled) and bias tables; `dropout` becomes `dropout_rate` (it changes training only)."""
        architecture = f"{self.prefix}ForConditionalGeneration"
        implied = {**T5_IMPLIED, "relative_attention_bias_per_layer": self.relative_attention_bias_per_layer}
        wrong = {k: getattr(config, k) for k, v in implied.items() if getattr(config, k) != v}
        heads = {config.encoder_attention_heads, config.decoder_attention_heads, config.encoder_key_value_heads,
                 config.decoder_key_value_heads}
        if len(heads) > 1:
            wrong["attention heads (encoder, decoder, key/value)"] = sorted(heads)
        if config.encoder_ffn_dim != config.decoder_ffn_dim:
            wrong["encoder_ffn_dim/decoder_ffn_dim"] = (config.encoder_ffn_dim, config.decoder_ffn_dim)
        if self.scales_decoder_outputs is None:
            head_rule = "a tied head exactly when `scale_decoder_outputs=True`"
            if config.tie_word_embeddings != config.scale_decoder_outputs:
                wrong["tie_word_embeddings/scale_decoder_outputs"] = (
                    config.tie_word_embeddings, config.scale_decoder_outputs
                )
        else:
            head_rule = f"`scale_decoder_outputs={self.scales_decoder_outputs}`"
            if config.scale_decoder_outputs != self.scales_decoder_outputs:
                wrong["scale_decoder_outputs"] = config.scale_decoder_outputs
        if wrong:
            details = ", ".join(f"{k}={v!r}" for k, v in wrong.items())
            raise ConversionError(
                f"{architecture} cannot express {details}; it needs {implied}, one head count without GQA, one FFN "
                f"width, and {head_rule}."
            )
        act = config.activation_function
        return {
            "d_kv": config.d_kv or config.d_model // config.encoder_attention_heads,
            "num_layers": config.encoder_layers,
            "num_decoder_layers": config.decoder_layers,
            "num_heads": config.encoder_attention_heads,
            "d_ff": config.encoder_ffn_dim,
            "feed_forward_proj": (
                ("gated-gelu" if act == "gelu_new" else f"gated-{act}") if config.mlp_type == "gated" else act
            ),
            "dropout_rate": config.dropout,
            "layer_norm_epsilon": config.layer_norm_eps,
            "tie_word_embeddings": config.tie_word_embeddings,
            "is_encoder_decoder": True,
        }


# transformers 5's MT5ForConditionalGeneration never scales the decoder output and UMT5ForConditionalGeneration always
# does (its config forces `tie_word_embeddings=True`, the flag its forward reads); T5 follows `scale_decoder_outputs`.
T5_VARIANTS: dict[str, T5Variant] = {
    "t5": T5Variant("T5"),
    "mt5": T5Variant("MT5", scales_decoder_outputs=False),
    "umt5": T5Variant("UMT5", scales_decoder_outputs=True, relative_attention_bias_per_layer=True),
}


def t5_parameter_names(config: PreTrainedConfig) -> dict[str, str]:
    """T5 parameter name -> archlab name (the documented key renaming), for every tensor except a gated FFN's
    `wi_0`/`wi_1`, which archlab fuses into `fc1` = [wi_0; wi_1] (its gated FFN is act(a) ⊙ b with [a, b] = fc1 x).
    T5's per-layer `layer.N.layer_norm` are archlab's `self_attn_layer_norm`, `encoder_attn_layer_norm` and
    `final_layer_norm` (Marian's name for the FFN norm); T5's stack `final_layer_norm` is archlab's `layer_norm`."""
    names = {"shared.weight": "model.shared.weight", "lm_head.weight": "lm_head.weight"}
    for stack, sublayers in T5_SUBLAYERS.items():
        ours = f"model.{stack}"
        names[f"{stack}.embed_tokens.weight"] = f"{ours}.embed_tokens.weight"
        names[f"{stack}.final_layer_norm.weight"] = f"{ours}.layer_norm.weight"
        # T5 keeps the bias table in the first block's self-attention; archlab keeps it once per stack. UMT5 has one
        # in every block's self-attention; archlab keeps those per layer.
        if not config.relative_attention_bias_per_layer:
            names[f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"] = (
                f"{ours}.position_bias.relative_attention_bias.weight"
            )
        for i in range(getattr(config, f"{stack}_layers")):
            block, layer = f"{stack}.block.{i}.layer", f"{ours}.layers.{i}"
            if config.relative_attention_bias_per_layer:
                names[f"{block}.0.SelfAttention.relative_attention_bias.weight"] = (
                    f"{layer}.position_bias.relative_attention_bias.weight"
                )
            for j, (t5_name, name) in enumerate(sublayers):
                names[f"{block}.{j}.layer_norm.weight"] = f"{layer}.{name}_layer_norm.weight"
                for t5_proj, proj in T5_PROJECTIONS:
                    names[f"{block}.{j}.{t5_name}.{t5_proj}.weight"] = f"{layer}.{name}.{proj}.weight"
            ffn = f"{block}.{len(sublayers)}"
            names[f"{ffn}.layer_norm.weight"] = f"{layer}.final_layer_norm.weight"
            names[f"{ffn}.DenseReluDense.wo.weight"] = f"{layer}.fc2.weight"
            if config.mlp_type != "gated":
                names[f"{ffn}.DenseReluDense.wi.weight"] = f"{layer}.fc1.weight"
    return names


def _t5_gated_ffns(config: PreTrainedConfig):
    """(T5 prefix of wi_0/wi_1, archlab fc1 name) of every gated FFN."""
    if config.mlp_type != "gated":
        return
    for stack, sublayers in T5_SUBLAYERS.items():
        for i in range(getattr(config, f"{stack}_layers")):
            yield f"{stack}.block.{i}.layer.{len(sublayers)}.DenseReluDense", f"model.{stack}.layers.{i}.fc1.weight"


def t5_state_dict_to_archlab(state_dict: dict[str, torch.Tensor], config: PreTrainedConfig) -> dict[str, torch.Tensor]:
    """A `T5ForConditionalGeneration` state dict as a `Seq2SeqForConditionalGeneration` one (loads with strict=True)."""
    names = t5_parameter_names(config)
    unknown = [k for k in state_dict if k not in names and ".wi_" not in k and "EncDecAttention.relative" not in k]
    if unknown:
        raise ConversionError(f"Not T5 parameters of this config: {unknown[:5]}.")
    out = {names[k]: v for k, v in state_dict.items() if k in names}
    for t5_ffn, fc1 in _t5_gated_ffns(config):
        out[fc1] = torch.cat((state_dict[f"{t5_ffn}.wi_0.weight"], state_dict[f"{t5_ffn}.wi_1.weight"]))
    shared = out.get("model.shared.weight", out.get("model.encoder.embed_tokens.weight"))
    for key in ("model.shared.weight", "model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight"):
        out.setdefault(key, shared)
    if config.tie_word_embeddings:
        head = out.get("lm_head.weight")
        if head is not None and not torch.equal(head, shared):
            raise ConversionError("The config ties the head to the embeddings but the checkpoint's lm_head differs.")
        out["lm_head.weight"] = shared
    out.setdefault("final_logits_bias", torch.zeros(1, config.decoder_vocab_size, dtype=shared.dtype))  # T5 has none
    return out


def archlab_state_dict_to_t5(state_dict: dict[str, torch.Tensor], config: PreTrainedConfig) -> dict[str, torch.Tensor]:
    """The inverse of `t5_state_dict_to_archlab`; refuses a non-zero `final_logits_bias` (T5 has no output bias)."""
    bias = state_dict.get("final_logits_bias")
    if bias is not None and bias.any():
        raise ConversionError("This model has a non-zero `final_logits_bias`, which T5 cannot express.")
    names = {ours: t5 for t5, ours in t5_parameter_names(config).items()}
    out = {names[k]: v for k, v in state_dict.items() if k in names}
    for t5_ffn, fc1 in _t5_gated_ffns(config):
        out[f"{t5_ffn}.wi_0.weight"], out[f"{t5_ffn}.wi_1.weight"] = state_dict[fc1].chunk(2)
    shared = out.get("shared.weight", out.get("encoder.embed_tokens.weight"))
    for key in ("shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight"):
        out.setdefault(key, shared)  # checkpoints saved by transformers drop the tied copies
    return out


def _t5_state_dict(state_dict: dict[str, torch.Tensor], config: PreTrainedConfig) -> dict[str, torch.Tensor]:
    """Both directions (`convert_checkpoint` renames nothing for T5): archlab names start with "model."."""
    if any(key.startswith("model.") for key in state_dict):
        return archlab_state_dict_to_t5(state_dict, config)
    return t5_state_dict_to_archlab(state_dict, config)


def _mt5_state_dict(state_dict: dict[str, torch.Tensor], config: PreTrainedConfig) -> dict[str, torch.Tensor]:
    """`_t5_state_dict` for mT5/UMT5, whose configs cannot say whether the head is tied: on import, it is tied exactly
    when the checkpoint has no `lm_head` or one equal to the embeddings (the archlab config is set accordingly)."""
    if not any(key.startswith("model.") for key in state_dict):
        head = state_dict.get("lm_head.weight")
        shared = state_dict.get("shared.weight", state_dict.get("encoder.embed_tokens.weight"))
        config.tie_word_embeddings = head is None or (shared is not None and torch.equal(head, shared))
    return _t5_state_dict(state_dict, config)


FAMILIES: dict[str, FamilyConversion] = {
    **{model_type: row.conversion(model_type) for model_type, row in DECODER_FAMILIES.items()},
    "marian": FamilyConversion(
        model_type="marian",
        architecture="MarianMTModel",
        shared_fields=MARIAN_FIELDS,
        to_archlab_extra=_marian_to_archlab,
        from_archlab_extra=_marian_from_archlab,
        expressible_fields={"sinusoidal_layout"},
        archlab_class=Seq2SeqForConditionalGeneration,
        archlab_config_class=Seq2SeqConfig,
        complete_state_dict=_marian_state_dict,
    ),
    **{
        model_type: FamilyConversion(
            model_type=model_type,
            architecture=f"{variant.prefix}ForConditionalGeneration",
            shared_fields=T5_FIELDS,
            to_archlab_extra=variant.to_archlab,
            from_archlab_extra=variant.from_archlab,
            expressible_fields=T5_EXPRESSIBLE,
            archlab_class=Seq2SeqForConditionalGeneration,
            archlab_config_class=Seq2SeqConfig,
            complete_state_dict=_t5_state_dict if variant.scales_decoder_outputs is None else _mt5_state_dict,
        )
        for model_type, variant in T5_VARIANTS.items()
    },
}

ARCHLAB_MODEL_TYPES = {"archlab_decoder": DecoderConfig, "archlab_seq2seq": Seq2SeqConfig}


class ConversionError(ValueError):
    """The source cannot be converted as asked; the message says why and what would work."""


def _read_config(folder: Path) -> dict[str, Any]:
    path = folder / "config.json"
    if not path.is_file():
        raise ConversionError(f"{folder} has no config.json: not a Hugging Face model folder.")
    return json.loads(path.read_text())


def load_safetensors_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of a folder's `model.safetensors` or sharded `model-*.safetensors` (pickles are refused)."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        pickles = [p.name for p in folder.glob("*.bin")] + [p.name for p in folder.glob("*.pt")]
        hint = f" It has pickled weights ({', '.join(pickles)}); re-save them as safetensors first." if pickles else ""
        raise ConversionError(f"{folder} has no *.safetensors weights.{hint}")
    state_dict: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            state_dict.update(load_file(str(file)))
        except SafetensorError as error:  # a truncated or empty file
            raise ConversionError(f"{file} is damaged or not a safetensors file ({error}).") from None
    return state_dict


def archlab_config_from(family: FamilyConversion, hf_config: dict[str, Any]) -> PreTrainedConfig:
    kwargs = {k: hf_config[k] for k in family.shared_fields if k in hf_config}
    # Legacy configs carry rope_theta/rope_scaling instead of rope_parameters; PreTrainedConfig standardises them.
    for legacy in ("rope_theta", "rope_scaling", "partial_rotary_factor"):
        if legacy in hf_config and "rope_parameters" not in hf_config:
            kwargs[legacy] = hf_config[legacy]
    kwargs.update(family.to_archlab_extra(hf_config))
    return family.archlab_config_class(**kwargs)


def incompatible_fields(family: FamilyConversion, config: PreTrainedConfig) -> dict[str, Any]:
    """archlab fields whose value the stock family cannot express: {field: value}."""
    # Defaults that derive from shared fields (one `layer_types` entry per layer, `moe_intermediate_size` =
    # `intermediate_size`, ...) are compared at this config's values of those fields.
    defaults = type(config)(**{name: getattr(config, name) for name in family.shared_fields}).to_dict()
    current = config.to_dict()
    allowed = set(family.shared_fields) | TRAINING_ONLY_FIELDS | family.expressible_fields | _BOOKKEEPING
    return {
        key: value
        for key, value in current.items()
        if key not in allowed and not key.startswith("_") and key in defaults and value != defaults[key]
    }


def stock_config_from(family: FamilyConversion, config: PreTrainedConfig) -> dict[str, Any]:
    bad = incompatible_fields(family, config)
    if bad:
        details = ", ".join(f"{k}={v!r}" for k, v in sorted(bad.items()))
        raise ConversionError(
            f"This archlab config is not {family.model_type}-equivalent: {details}. "
            f"A stock {family.architecture} cannot compute these variants; keep them at their defaults to export."
        )
    out = {k: getattr(config, k) for k in family.shared_fields}
    out.update(family.from_archlab_extra(config))
    out["model_type"] = family.model_type
    out["architectures"] = [family.architecture]
    return out


def _copy_side_files(src: Path, dst: Path) -> None:
    """Tokenizer, generation config and other non-weight, non-code files travel along."""
    skip_suffixes = {".safetensors", ".bin", ".pt", ".pth", ".py"}
    skip_names = {"config.json", "model.safetensors.index.json", "README.md"}
    for path in src.iterdir():
        if path.is_file() and path.suffix not in skip_suffixes and path.name not in skip_names:
            shutil.copy2(path, dst / path.name)


def convert_checkpoint(src: str | os.PathLike, dst: str | os.PathLike, to: str | None = None) -> Path:
    """Convert the model folder `src` into `dst` (complete or absent: written to a temp folder, then renamed).

    - `src` of a stock family in `FAMILIES` -> an archlab folder (`to` must be None or "archlab").
    - `src` an archlab folder and `to` a family name -> a stock folder of that family.
    Returns `dst`.
    """
    src, dst = Path(src), Path(dst)
    if dst.exists() and any(dst.iterdir()):
        raise ConversionError(f"Destination {dst} exists and is not empty; choose a new folder.")
    hf_config = _read_config(src)
    model_type = hf_config.get("model_type")

    if model_type in ARCHLAB_MODEL_TYPES:
        if to is None or to == "archlab":
            raise ConversionError(
                f"{src} is already an archlab checkpoint; pass a target family to export it: "
                f"to one of {sorted(FAMILIES)}."
            )
        if to not in FAMILIES:
            raise ConversionError(f"Unknown target family {to!r}; allowed: {sorted(FAMILIES)}.")
        family = FAMILIES[to]
        config = AutoConfig.from_pretrained(src)
        if not isinstance(config, family.archlab_config_class):
            raise ConversionError(
                f"{src} is an {model_type} checkpoint; {to} models are {family.archlab_config_class.model_type}."
            )
        stock_config = stock_config_from(family, config)
        state_dict = {family.rename_from_archlab(k): v for k, v in load_safetensors_state_dict(src).items()}
        state_dict = family.complete_state_dict(state_dict, config)
        stock_cls = getattr(__import__("transformers"), family.architecture)
        stock_config_obj = AutoConfig.for_model(**stock_config)
        return _write(stock_cls, stock_config_obj, state_dict, src, dst)

    if model_type in FAMILIES:
        if to not in (None, "archlab"):
            raise ConversionError(f"{src} is a {model_type} checkpoint; it converts to archlab only (no `to`).")
        family = FAMILIES[model_type]
        config = archlab_config_from(family, hf_config)
        state_dict = {family.rename_to_archlab(k): v for k, v in load_safetensors_state_dict(src).items()}
        state_dict = family.complete_state_dict(state_dict, config)
        return _write(family.archlab_class, config, state_dict, src, dst)

    known = sorted(FAMILIES) + sorted(ARCHLAB_MODEL_TYPES)
    raise ConversionError(f"{src} has model_type={model_type!r}; the converter knows: {known}.")


def _write(model_cls: type[PreTrainedModel], config: PreTrainedConfig, state_dict, src: Path, dst: Path) -> Path:
    with torch.device("meta"):
        model = model_cls(config)
    missing, unexpected = model.load_state_dict(state_dict, strict=False, assign=True)
    # Tie only when the head is the embedding: T5Config always says tie_word_embeddings=True, though T5 v1.1
    # checkpoints carry their own head (transformers unties those at load time for the same reason).
    head = state_dict.get("lm_head.weight")
    tied = getattr(config, "tie_word_embeddings", False) and (
        head is None or torch.equal(head, model.get_input_embeddings().weight)
    )
    missing = [k for k in missing if not (tied and k == "lm_head.weight")]
    if missing or unexpected:
        raise ConversionError(
            f"Weights do not match {model_cls.__name__}: missing {missing[:5]}, unexpected {unexpected[:5]}."
        )
    if tied:
        model.tie_weights()
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", dir=dst.parent))
    try:
        model.save_pretrained(tmp)
        _copy_side_files(src, tmp)
        if dst.exists():
            dst.rmdir()
        tmp.rename(dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst
