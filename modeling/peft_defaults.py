"""PEFT's defaults for archlab models: `LoraConfig(task_type="CAUSAL_LM")` without `target_modules`, as for Llama.

PEFT picks an adapter's default target modules (LoRA's `q_proj`/`v_proj`, IA³'s feed-forward modules, LN tuning's
norms, ...) by `model_type` from the `TRANSFORMERS_MODELS_TO_*` tables of `peft.utils.constants`, and refuses a type it
does not list ("Please specify `target_modules`"). archlab's module names are Llama's in the decoder and Bart's in the
encoder-decoder and its masked LM, so each table's entry for those two is archlab's too. They are added the moment
PEFT's constants module has run, whoever imports it (`import_hooks.after_import`: importing archlab does not import
PEFT); an entry PEFT itself has for an archlab type is kept. The modeling files ask for it as they load, so a saved
model's own copy of this code (remote code, on a machine without archlab) registers too.
"""

from __future__ import annotations

from types import ModuleType

from .configuration_decoder import DecoderConfig
from .configuration_seq2seq import Seq2SeqConfig

PEFT_CONSTANTS_MODULE = "peft.utils.constants"
TABLE_PREFIX = "TRANSFORMERS_MODELS_TO_"
# the stock model type whose module names each archlab model type shares
SAME_NAMES_AS = {DecoderConfig.model_type: "llama", Seq2SeqConfig.model_type: "bart"}


def register_with_peft(constants: ModuleType) -> None:
    """Give archlab's model types the entries of Llama and Bart in every per-model-type table of PEFT's constants."""
    for name, table in vars(constants).items():
        if not (name.startswith(TABLE_PREFIX) and isinstance(table, dict)):
            continue
        for archlab_type, stock_type in SAME_NAMES_AS.items():
            if stock_type in table:
                entry = table[stock_type]
                table.setdefault(archlab_type, list(entry) if isinstance(entry, list) else entry)


__all__ = ["PEFT_CONSTANTS_MODULE", "register_with_peft"]
