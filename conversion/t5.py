"""The T5 family: T5 v1.0, T5 v1.1 / flan-T5, mT5 and UMT5 as archlab encoder-decoder configs, and their weights.

T5 (Raffel et al. 2020) is an archlab config: pre-norm RMSNorm without bias, T5's relative bias (once per stack),
unscaled q·kᵀ, no embedding scaling, no absolute positions, a ReLU or gated-GELU FFN, and (v1.0) a tied head fed
d_model^-0.5 times the decoder output. mT5 (Xue et al. 2021) is T5 v1.1's layout under its own model_type; UMT5
(Chung et al. 2023) has a relative bias table in every self-attention layer. The three share T5's parameter names and
T5Config's fields; `T5Variant` says where they differ, and `t5_family` turns a variant into a `Family` row.

Parameter names: T5's per-layer `layer.N.layer_norm` are archlab's `self_attn_layer_norm`, `encoder_attn_layer_norm`
and `final_layer_norm` (Marian's name for the FFN norm); T5's stack `final_layer_norm` is archlab's `layer_norm`; a
gated FFN's `wi_0`/`wi_1` are fused into archlab's `fc1` = [wi_0; wi_1] (its gated FFN is act(a) ⊙ b, [a, b] = fc1 x).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from transformers import (
    MT5Config,
    MT5ForConditionalGeneration,
    PreTrainedConfig,
    T5Config,
    T5ForConditionalGeneration,
    UMT5Config,
    UMT5ForConditionalGeneration,
)

from ..modeling import Seq2SeqForConditionalGeneration
from .family import ConversionError, Family, Layout, StateDict, same

FIELDS: dict[str, str | tuple[str, ...]] = {
    **same(
        "vocab_size",
        "d_model",
        "relative_attention_num_buckets",
        "relative_attention_max_distance",
        "use_cache",
        "pad_token_id",
        "eos_token_id",
    ),
    "num_layers": "encoder_layers",
    "num_decoder_layers": "decoder_layers",
    "num_heads": (
        "encoder_attention_heads",
        "decoder_attention_heads",
        "encoder_key_value_heads",
        "decoder_key_value_heads",
    ),
    "d_ff": ("encoder_ffn_dim", "decoder_ffn_dim"),
    "dropout_rate": "dropout",
    "layer_norm_epsilon": "layer_norm_eps",
}
# archlab values every T5 has
IMPLIED: dict[str, Any] = {
    "norm_type": "rms_norm",
    "norm_position": "pre",
    "position_embedding_type": "relative_bias",
    "scale_embedding": False,
    "attention_bias": False,
    "mlp_bias": False,
    "scale_attn_weights": False,
    "share_encoder_decoder_embeddings": True,
}
# archlab fields T5 expresses through its own fields (or that do not change the function: the dropout split, init,
# the unused absolute-position length, bos, whether the pad row trains)
EXPRESSIBLE = frozenset(
    {
        "d_kv",
        "decoder_start_token_id",
        "activation_function",
        "mlp_type",
        "attention_dropout",
        "activation_dropout",
        "scale_decoder_outputs",
        "decoder_vocab_size",
        "bos_token_id",
        "init_std",
        "max_position_embeddings",
        "train_pad_embedding",
        # every T5-family model clamps fp16 hidden states; archlab only when asked
        # (fp32/bf16 compute the same either way)
        "clamp_fp16_hidden_states",
    }
)
SUBLAYERS = {
    "encoder": (("SelfAttention", "self_attn"),),
    "decoder": (("SelfAttention", "self_attn"), ("EncDecAttention", "encoder_attn")),
}
PROJECTIONS = (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj"), ("o", "out_proj"))


@dataclass(frozen=True)
class T5Variant:
    """One member of the T5 family, as data: what its stock classes compute beyond T5's shared layout."""

    config_class: type[PreTrainedConfig]
    model_class: type[torch.nn.Module]
    # whether the decoder output is multiplied by d_model^-0.5 before the head: None = T5's own rule (exactly when the
    # head is the tied embedding); a bool = always / never, whatever the config says
    scales_decoder_outputs: bool | None = None
    relative_attention_bias_per_layer: bool = False  # UMT5: a bias table in every self-attention layer

    def to_archlab(self, stock: PreTrainedConfig, values: Mapping[str, Any]) -> dict[str, Any]:
        """T5: whether the head is the tied embedding fed d_model^-0.5 · output (v1.0) or a separate matrix fed the
        output as is (v1.1, flan-T5) is `scale_decoder_outputs` in configs saved by transformers 5 (which always write
        `tie_word_embeddings=True`) and `tie_word_embeddings` in older ones. mT5/UMT5 configs say nothing reliable
        about the head (transformers 5 forces the flag to True; Google's checkpoints say False and carry their own
        head), so the weights decide (`_weights_decide_the_tie`)."""
        scale = self.scales_decoder_outputs
        if scale is None or (scale and _reads_scaling_from_the_tie_flag(self.config_class)):
            # T5; UMT5 from transformers 5.24 on: the saved `scale_decoder_outputs` (folders written by transformers 5,
            # whose `tie_word_embeddings` is always True), else the legacy tie flag -- what the stock config reads
            scale = values.get("scale_decoder_outputs", values.get("tie_word_embeddings", True) is not False)
        # whether the head is tied: the weights decide (`_weights_decide_the_tie`); this is the guess until then
        tied = scale if self.scales_decoder_outputs is None else values.get("tie_word_embeddings", True) is not False
        return {
            "d_kv": stock.d_kv,
            "decoder_start_token_id": values.get("decoder_start_token_id", stock.pad_token_id),  # starts from pad
            "bos_token_id": None,
            "mlp_type": "gated" if stock.is_gated_act else "plain",
            "activation_function": stock.dense_act_fn,  # "gated-gelu" is gelu_new (T5Config's legacy mapping)
            "attention_dropout": stock.dropout_rate,
            "activation_dropout": stock.dropout_rate,
            "scale_decoder_outputs": scale,
            "tie_word_embeddings": tied,  # mT5/UMT5: what config.json says until the weights are seen
            "train_pad_embedding": True,  # no padding_idx: the pad row is the decoder's start and trains
            "clamp_fp16_hidden_states": True,  # the stock blocks clamp fp16 hidden states
        }

    def from_archlab(self, config: PreTrainedConfig) -> dict[str, Any]:
        """One head count and FFN width for both stacks, no GQA, the variant's output scaling (T5: a tied head exactly
        when scaled) and bias tables."""
        architecture = self.model_class.__name__
        implied = {**IMPLIED, "relative_attention_bias_per_layer": self.relative_attention_bias_per_layer}
        wrong = {k: getattr(config, k) for k, v in implied.items() if getattr(config, k) != v}
        heads = {
            config.encoder_attention_heads,
            config.decoder_attention_heads,
            config.encoder_key_value_heads,
            config.decoder_key_value_heads,
        }
        if len(heads) > 1:
            wrong["attention heads (encoder, decoder, key/value)"] = sorted(heads)
        if config.mlp_type == "gated" and config.activation_function == "gelu":
            # T5Config reads feed_forward_proj="gated-gelu" as the tanh approximation (dense_act_fn="gelu_new")
            wrong["activation_function (gated)"] = "gelu (T5's 'gated-gelu' is gelu_new)"
        if config.encoder_ffn_dim != config.decoder_ffn_dim:
            wrong["encoder_ffn_dim/decoder_ffn_dim"] = (config.encoder_ffn_dim, config.decoder_ffn_dim)
        scaling_field = _reads_scaling_from_the_tie_flag(self.config_class)
        if scaling_field:  # transformers 5.24: the stock config stores `scale_decoder_outputs`; any head
            head_rule = "any `scale_decoder_outputs`"
        elif self.scales_decoder_outputs is None:
            head_rule = "a tied head exactly when `scale_decoder_outputs=True`"
            if config.tie_word_embeddings != config.scale_decoder_outputs:
                wrong["tie_word_embeddings/scale_decoder_outputs"] = (
                    config.tie_word_embeddings,
                    config.scale_decoder_outputs,
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
            "feed_forward_proj": (
                ("gated-gelu" if act == "gelu_new" else f"gated-{act}") if config.mlp_type == "gated" else act
            ),
            "decoder_start_token_id": config.decoder_start_token_id,
            # a variant that always scales (UMT5) writes True: transformers up to 5.23 forces it, 5.24 scales by it
            "tie_word_embeddings": config.tie_word_embeddings or bool(self.scales_decoder_outputs),
            "is_encoder_decoder": True,
            **(
                {
                    "tie_word_embeddings": config.scale_decoder_outputs,
                    "scale_decoder_outputs": config.scale_decoder_outputs,
                }
                if scaling_field
                else {}
            ),
        }


def _reads_scaling_from_the_tie_flag(config_class: type[PreTrainedConfig]) -> bool:
    """Whether the stock config turns config.json's `tie_word_embeddings` into its `scale_decoder_outputs` (UMT5 from
    transformers 5.24: Google's UMT5 checkpoints, `tie_word_embeddings: false`, no longer scale) rather than the
    variant's fixed rule (UMT5 up to 5.23 always scales)."""
    return "scale_decoder_outputs" in vars(config_class(tie_word_embeddings=False))


def t5_parameter_names(config: PreTrainedConfig) -> dict[str, str]:
    """T5 parameter name -> archlab name, for every tensor except a gated FFN's `wi_0`/`wi_1` (fused into `fc1`)."""
    names = {"shared.weight": "model.shared.weight", "lm_head.weight": "lm_head.weight"}
    for stack, sublayers in SUBLAYERS.items():
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
                for t5_proj, proj in PROJECTIONS:
                    names[f"{block}.{j}.{t5_name}.{t5_proj}.weight"] = f"{layer}.{name}.{proj}.weight"
            ffn = f"{block}.{len(sublayers)}"
            names[f"{ffn}.layer_norm.weight"] = f"{layer}.final_layer_norm.weight"
            names[f"{ffn}.DenseReluDense.wo.weight"] = f"{layer}.fc2.weight"
            if config.mlp_type != "gated":
                names[f"{ffn}.DenseReluDense.wi.weight"] = f"{layer}.fc1.weight"
    return names


def _gated_ffns(config: PreTrainedConfig) -> Iterator[tuple[str, str]]:
    """(T5 prefix of wi_0/wi_1, archlab fc1 name) of every gated FFN."""
    if config.mlp_type != "gated":
        return
    for stack, sublayers in SUBLAYERS.items():
        for i in range(getattr(config, f"{stack}_layers")):
            yield f"{stack}.block.{i}.layer.{len(sublayers)}.DenseReluDense", f"model.{stack}.layers.{i}.fc1.weight"


def t5_state_dict_to_archlab(state_dict: StateDict, config: PreTrainedConfig) -> StateDict:
    """A `T5ForConditionalGeneration` state dict as a `Seq2SeqForConditionalGeneration` one (loads with strict=True)."""
    names = t5_parameter_names(config)
    unknown = [k for k in state_dict if k not in names and ".wi_" not in k and "EncDecAttention.relative" not in k]
    if unknown:
        raise ConversionError(f"Not T5 parameters of this config: {unknown[:5]}.")
    out = {names[k]: v for k, v in state_dict.items() if k in names}
    for t5_ffn, fc1 in _gated_ffns(config):
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


def archlab_state_dict_to_t5(state_dict: StateDict, config: PreTrainedConfig) -> StateDict:
    """The inverse of `t5_state_dict_to_archlab`; refuses a non-zero `final_logits_bias` (T5 has no output bias)."""
    bias = state_dict.get("final_logits_bias")
    if bias is not None and bias.any():
        raise ConversionError("This model has a non-zero `final_logits_bias`, which T5 cannot express.")
    names = {ours: t5 for t5, ours in t5_parameter_names(config).items()}
    out = {names[k]: v for k, v in state_dict.items() if k in names}
    for t5_ffn, fc1 in _gated_ffns(config):
        out[f"{t5_ffn}.wi_0.weight"], out[f"{t5_ffn}.wi_1.weight"] = state_dict[fc1].chunk(2)
    shared = out.get("shared.weight", out.get("encoder.embed_tokens.weight"))
    for key in ("shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight"):
        out.setdefault(key, shared)  # checkpoints saved by transformers drop the tied copies
    return out


def _weights_decide_the_tie(state_dict: StateDict, config: PreTrainedConfig) -> StateDict:
    """mT5/UMT5 configs cannot say whether the head is tied: it is exactly when the checkpoint has no `lm_head` or one
    equal to the embeddings (the archlab config is set accordingly)."""
    head = state_dict.get("lm_head.weight")
    shared = state_dict.get("shared.weight", state_dict.get("encoder.embed_tokens.weight"))
    config.tie_word_embeddings = head is None or (shared is not None and torch.equal(head, shared))
    return t5_state_dict_to_archlab(state_dict, config)


def t5_family(variant: T5Variant) -> Family:
    return Family(
        variant.config_class,
        variant.model_class,
        Seq2SeqForConditionalGeneration,
        fields=FIELDS,
        implied={**IMPLIED, "relative_attention_bias_per_layer": variant.relative_attention_bias_per_layer},
        to_archlab=variant.to_archlab,
        from_archlab=variant.from_archlab,
        expressible=EXPRESSIBLE,
        layout=Layout(
            _weights_decide_the_tie,
            archlab_state_dict_to_t5,
        ),
    )


# transformers 5's MT5ForConditionalGeneration never scales the decoder output and UMT5ForConditionalGeneration always
# does (its config forces `tie_word_embeddings=True`, the flag its forward reads); T5 follows `scale_decoder_outputs`.
T5_VARIANTS: dict[str, T5Variant] = {
    "t5": T5Variant(T5Config, T5ForConditionalGeneration),
    "mt5": T5Variant(MT5Config, MT5ForConditionalGeneration, scales_decoder_outputs=False),
    "umt5": T5Variant(
        UMT5Config, UMT5ForConditionalGeneration, scales_decoder_outputs=True, relative_attention_bias_per_layer=True
    ),
}

__all__ = [
    "T5Variant",
    "T5_VARIANTS",
    "archlab_state_dict_to_t5",
    "t5_family",
    "t5_parameter_names",
    "t5_state_dict_to_archlab",
]
