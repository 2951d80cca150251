"""`ArchlabPreTrainedModel`: what both families' `PreTrainedModel` bases share.

- the attention backends a config's variants allow (`validation.check_attention_backend`, run when transformers
  dispatches to SDPA, flash or flex, at construction and when `set_attn_implementation` switches later);
- the weight initialisation of the catalogue's parts beyond transformers' defaults (normal Linear / Embedding,
  LayerNorm ones and zeros): Gemma's offset norm, the fixed position tables, DeepNet's gains, T5's q scale,
  the mixture of experts' 3-D tensors. transformers' `init` functions skip tensors loaded from a checkpoint, so
  this also fills in only what a checkpoint lacks (e.g. non-persistent tables after meta-device loading);
- safetensors-only loading and the family's `auto_map` (`HubMixin`);
- the signatures `generate` inspects every call, computed once per class (signatures.py).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import initialization as init
from transformers.modeling_utils import PreTrainedModel
from transformers.utils import logging

from .attention import Attention
from .hub_mixin import HubMixin
from .import_hooks import after_import
from .moe import init_moe_weights
from .normalization import OffsetLayerNorm, OffsetRMSNorm, PerHeadNorm
from .peft_defaults import PEFT_CONSTANTS_MODULE, register_with_peft
from .positions import ALiBiBias, alibi_slopes
from .signatures import keep_signatures
from .sinusoidal import SinusoidalPositionalEmbedding, sinusoid_table
from .validation import check_attention_backend

logger = logging.get_logger(__name__)


class ArchlabPreTrainedModel(HubMixin, PreTrainedModel):
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _skip_keys_device_placement = ["past_key_values", "cache"]  # the cache under its names before and from 5.24
    _supports_sdpa = True
    _supports_flash_attn = True
    _supports_flex_attn = True
    _supports_attention_backend = True

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        keep_signatures(cls)  # generate inspects forward & co. 8 times a call (signatures.py)

    def _sdpa_can_dispatch(self, is_init_check: bool = False) -> bool:
        check_attention_backend(self.config, "sdpa")
        return super()._sdpa_can_dispatch(is_init_check)

    def _flash_attn_can_dispatch(self, flash_attn_version: int, is_init_check: bool = False) -> bool:
        check_attention_backend(self.config, f"flash_attention_{flash_attn_version}")
        return super()._flash_attn_can_dispatch(flash_attn_version, is_init_check)

    def _flex_attn_can_dispatch(self, is_init_check: bool = False) -> bool:
        check_attention_backend(self.config, "flex_attention")
        return super()._flex_attn_can_dispatch(is_init_check)

    def _warn_if_resize_left_an_unsavable_config(self, resize: str) -> None:
        """After a vocabulary resize: a special-token id the smaller vocabulary no longer holds (`pad_token_id`, ...)
        makes the config one that `save_pretrained` refuses (its checks run again at save time), which a Trainer
        run would find only at its first checkpoint. Said here, at the resize; setting the ids afterwards (the
        order a new tokenizer suggests) is fine, so it is not refused."""
        try:
            self.config.validate_architecture()
        except ValueError as error:
            logger.warning(
                f"{resize} leaves a config that `save_pretrained` refuses: {error} Set it to an id of the resized "
                "vocabulary (or None) before saving."
            )

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        if getattr(module, "is_tied_alias", False):
            return  # its weight becomes another module's parameter (seq2seq's TiedEmbedding)
        super()._init_weights(module)
        init_moe_weights(module, self.config.initializer_range)  # expert tensors and routers; no-op otherwise
        if isinstance(module, (OffsetRMSNorm, OffsetLayerNorm)):
            init.zeros_(module.weight)  # the gain is 1 + w (transformers' init set a LayerNorm's to 1)
        elif isinstance(module, PerHeadNorm):  # QK-norm's gain per head: 1 (or w = 0 of 1 + w), no shift
            (init.zeros_ if module.offset else init.ones_)(module.weight)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, SinusoidalPositionalEmbedding):
            init.copy_(module.weight, sinusoid_table(module.num_positions, module.dim, module.layout, module.base))
        elif isinstance(module, Attention) and module.sinks is not None:
            init.zeros_(module.sinks)  # attention sinks' logits: a sink as likely as a key of score 0
        elif isinstance(module, ALiBiBias):
            init.copy_(module.slopes, alibi_slopes(module.num_heads))
        elif isinstance(module, nn.Linear) and hasattr(module, "deepnorm_gain"):
            init.xavier_normal_(module.weight, gain=module.deepnorm_gain)  # DeepNet's β-scaled init (blocks.py)
        elif isinstance(module, nn.Linear) and hasattr(module, "init_std"):
            init.normal_(module.weight, mean=0.0, std=module.init_std)  # T5's q_proj (seq2seq_layers.py)


# PEFT's default target modules for archlab's model types, the moment PEFT loads (peft_defaults.py); here, so a saved
# model's own copy of the code registers them too
after_import(PEFT_CONSTANTS_MODULE, register_with_peft)

__all__ = ["ArchlabPreTrainedModel"]
