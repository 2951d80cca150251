"""Convert a checkpoint folder between a stock Hugging Face family and archlab.

    python scripts/convert_checkpoint.py path/to/llama   path/to/archlab          # stock -> archlab
    python scripts/convert_checkpoint.py path/to/archlab path/to/llama --to llama  # archlab -> stock

The source family is read from SRC/config.json. Families: llama, mistral, ministral, ministral3, mixtral, qwen2,
qwen2_moe, qwen3, qwen3_moe, olmo, olmo2, olmo3, smollm3, exaone4, helium, arcee, seed_oss, glm, glm4, glm4_moe, dots1,
solar_open, minimax_m2, exaone_moe, afmoe, mellum, hunyuan_v1_dense, hunyuan_v1_moe, gpt_oss, llama4_text (and a llama4
folder's language model; so gemma3, mistral3, llava, llava_next, llava_onevision, vipllava, aya_vision, internvl,
qwen2_vl, qwen2_5_vl and qwen3_vl folders give theirs), bitnet (BitNet b1.58's bf16 and packed folders), deepseek_v2,
deepseek_v3, glm4_moe_lite, sarvam_mla, youtu, granite, granitemoe, granitemoeshared, granite_swa, cohere, cohere2,
olmoe, flex_olmo, cwm, ernie4_5, ernie4_5_moe, jais2, nemotron, internlm3, iquestcoder, exaone, apertus, gemma, gemma2,
vaultgemma, gemma3_text, gpt_neox, gptj, falcon, bloom, mpt, opt, gpt2, openai-gpt, phi, phi3, stablelm, starcoder2
(archlab decoder); marian, bart, mbart, t5 (T5 v1.0, v1.1, flan-T5), mt5 and umt5 (archlab encoder-decoder); bert and
roberta (archlab's EncoderForMaskedLM). A config the other side cannot compute is refused with the fields named. A
decoder family's `<Family>ForSequenceClassification` (a reward model, a classifier) converts to archlab's
`DecoderForSequenceClassification` and back; `<Family>ForTokenClassification` and `<Family>ForQuestionAnswering` to
`DecoderForTokenClassification` / `DecoderForQuestionAnswering` for the families whose heads are transformers' generic
ones (Llama, Mistral, Mixtral, Qwen2, Qwen2-MoE, Qwen3, Qwen3-MoE; Gemma, Gemma2, Phi, Phi-3 and StableLM for tokens);
and BERT's (RoBERTa's) `BertForSequenceClassification` / `BertForTokenClassification` / `BertForQuestionAnswering` to
`EncoderForSequenceClassification` / `EncoderForTokenClassification` / `EncoderForQuestionAnswering`, the head read from
`architectures`. The logic lives in `archlab.conversion`; docs/conversion.md lists what each family turns on and what is
refused.
"""

from __future__ import annotations

import argparse
import sys

from archlab.conversion import FAMILIES, ConversionError, convert_checkpoint


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("src", help="source model folder (config.json + *.safetensors)")
    parser.add_argument("dst", help="destination folder (must not exist or be empty)")
    parser.add_argument(
        "--to",
        choices=sorted(FAMILIES),
        default=None,
        help="export an archlab folder to this stock family (omit to import a stock folder into archlab)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        out = convert_checkpoint(args.src, args.dst, to=args.to)
    except ConversionError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
