"""archlab.conversion: checkpoints of stock Hugging Face families to archlab and back.

- `family.py`: what a family is (`Family`: the stock classes, the config mapping, the weight `Layout`);
- `families.py`: the table of families the converter knows (`FAMILIES`, by `model_type`);
- `fused_decoders.py`: GPT-2, OpenAI-GPT, GPT-NeoX, Falcon, BLOOM and MPT, whose weights are renamed, split and
  transposed by the rules of `layouts.py` (refusal messages in `checks.py`);
- `layernorm_decoders.py`: StableLM, Phi and OPT (LayerNorm decoders; Phi's and OPT's weights renamed by rules);
- `phi3.py`: Phi-3 (Llama's block with fused q/k/v and gate/up projections, split and joined by rules);
- `experts.py`: Mixtral's and Qwen2-MoE's (and Qwen3-MoE's) per-expert checkpoint modules, fused as archlab holds them;
- `marian.py`, `bart.py`, `t5.py`: the encoder-decoders; `bert.py`, `roberta.py`: BERT and RoBERTa as archlab's
  masked LM;
- `heads.py`: a decoder family's `<Family>ForSequenceClassification` as archlab's `DecoderForSequenceClassification`
  (the `score` head on the family's body), and BERT's (and RoBERTa's) sequence and token classifiers as
  `EncoderForSequenceClassification` / `EncoderForTokenClassification`, the head chosen from `architectures`;
- `folders.py`: model folders on disk (safetensors only; a written folder is complete or absent);
- `quantized.py`: folders whose weights are stored quantized (FP8 with scales, GPTQ/AWQ, bitsandbytes, ...), refused
  by their method with the way to a floating-point copy;
- `convert.py`: `convert_checkpoint(src, dst, to=None)`, what `scripts/convert_checkpoint.py` runs.
"""

from .convert import ARCHLAB_MODEL_TYPES, convert_checkpoint
from .families import FAMILIES
from .family import ConversionError, Family, Layout

__all__ = ["ARCHLAB_MODEL_TYPES", "ConversionError", "FAMILIES", "Family", "Layout", "convert_checkpoint"]
