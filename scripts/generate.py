"""Stream text from a saved archlab model (decoder or seq2seq) with `TextStreamer`:

    python scripts/generate.py --model_name_or_path runs/pretrain --prompt "def parse_args("
    python scripts/generate.py --model_name_or_path runs/chat --chat true --prompt "Reverse a list."
    python scripts/generate.py --model_name_or_path runs/docstrings --prompt "def add(a, b):\\n    return a + b"

The usual sampling flags (`--do_sample`, `--temperature`, `--top_k`, `--top_p`, `--repetition_penalty`,
`--num_beams`, `--max_new_tokens`) map one to one onto `GenerationConfig`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM, TextStreamer, set_seed

from archlab.scripts.common import check_weights, log, parse_arguments, run_cli
from archlab.tokenization.training import has_tokenizer, load_tokenizer


@dataclass
class GenerateArguments:
    model_name_or_path: str = field(metadata={"help": "A folder written by the pretrain/finetune scripts."})
    prompt: str = field(default="def ", metadata={"help": "The text to continue (the source, for seq2seq)."})
    prompt_file: str | None = field(default=None, metadata={"help": "Read the prompt from this file instead."})
    chat: bool = field(default=False, metadata={"help": "Wrap the prompt as a user turn of the chat template."})
    max_new_tokens: int = field(default=100, metadata={"help": "Tokens to generate."})
    do_sample: bool = field(default=True, metadata={"help": "Sample (true) or decode greedily / by beam search."})
    temperature: float = field(default=0.8, metadata={"help": "Softmax temperature when sampling."})
    top_k: int = field(default=40, metadata={"help": "Sample among the k most likely tokens (0: all)."})
    top_p: float = field(default=0.95, metadata={"help": "Nucleus sampling mass."})
    repetition_penalty: float = field(default=1.0, metadata={"help": "> 1 discourages repeats."})
    num_beams: int = field(default=1, metadata={"help": "Beam search width (with --do_sample false)."})
    seed: int = field(default=42, metadata={"help": "Random seed for sampling."})
    stream: bool = field(default=True, metadata={"help": "Print tokens as they are generated."})


def check(args: GenerateArguments) -> None:
    if not os.path.isfile(os.path.join(args.model_name_or_path, "config.json")):
        raise FileNotFoundError(f"--model_name_or_path {args.model_name_or_path!r} holds no saved model (config.json).")
    if args.prompt_file and not os.path.isfile(args.prompt_file):
        raise FileNotFoundError(f"--prompt_file {args.prompt_file!r} does not exist.")
    if args.max_new_tokens < 1:
        raise ValueError(f"--max_new_tokens must be >= 1, got {args.max_new_tokens}.")
    if args.do_sample and args.temperature <= 0:
        raise ValueError(f"--temperature must be > 0 when sampling, got {args.temperature}.")
    if args.top_k < 0:
        raise ValueError(f"--top_k must be >= 0 (0: all tokens), got {args.top_k}.")
    if not 0 < args.top_p <= 1:
        raise ValueError(f"--top_p must be in (0, 1], got {args.top_p}.")
    if args.repetition_penalty <= 0:
        raise ValueError(f"--repetition_penalty must be > 0 (1.0: none), got {args.repetition_penalty}.")
    if args.num_beams < 1:
        raise ValueError(f"--num_beams must be >= 1 (1: no beam search), got {args.num_beams}.")
    if args.do_sample and args.num_beams > 1:
        raise ValueError("Conflicting flags: --num_beams > 1 is beam search; pass --do_sample false with it.")
    if args.stream and args.num_beams > 1:
        raise ValueError("Conflicting flags: beam search (--num_beams > 1) cannot stream; pass --stream false.")
    if not has_tokenizer(args.model_name_or_path):
        raise FileNotFoundError(f"--model_name_or_path {args.model_name_or_path!r} holds no tokenizer "
                                "(tokenizer.json): save the tokenizer next to the model, as the training scripts do.")
    check_weights(args.model_name_or_path, "--model_name_or_path")


def main(argv: Sequence[str] | None = None) -> str:
    (args,) = parse_arguments((GenerateArguments,), argv, __doc__)
    check(args)
    config = AutoConfig.from_pretrained(args.model_name_or_path)
    architectures = config.architectures or []
    seq2seq = any(name.endswith("ForConditionalGeneration") for name in architectures)
    if seq2seq:
        model = AutoModelForSeq2SeqLM.from_pretrained(args.model_name_or_path)
    elif any(name.endswith("ForCausalLM") for name in architectures):
        model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path)
    else:
        raise ValueError(f"{args.model_name_or_path!r} holds a {config.architectures} model, which does not "
                         "generate text; generate.py needs a decoder (ForCausalLM) or a seq2seq model.")
    tokenizer = load_tokenizer(args.model_name_or_path)
    model.eval()

    prompt = args.prompt
    if args.prompt_file:
        with open(args.prompt_file, encoding="utf-8") as f:
            prompt = f.read()
    if args.chat:
        if tokenizer.chat_template is None:
            raise ValueError("--chat true needs a tokenizer with a chat template (train one with --model_kind decoder).")
        inputs = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                               return_tensors="pt", return_dict=True)
    else:
        inputs = tokenizer(prompt, return_tensors="pt")
    inputs.pop("token_type_ids", None)

    eos = [model.generation_config.eos_token_id or tokenizer.eos_token_id]
    if args.chat and "<|im_end|>" in tokenizer.get_vocab():
        eos.append(tokenizer.convert_tokens_to_ids("<|im_end|>"))  # a chat turn ends with the end-of-turn marker
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True) if args.stream else None
    set_seed(args.seed)
    if args.stream and not seq2seq and not args.chat:
        print(prompt, end="", flush=True)
    with torch.no_grad():
        output = model.generate(
            **inputs,
            max_new_tokens=args.max_new_tokens,
            do_sample=args.do_sample,
            temperature=args.temperature if args.do_sample else None,
            top_k=args.top_k if args.do_sample else None,
            top_p=args.top_p if args.do_sample else None,
            repetition_penalty=args.repetition_penalty,
            num_beams=args.num_beams,
            eos_token_id=eos,
            pad_token_id=tokenizer.pad_token_id,
            streamer=streamer,
        )
    new_tokens = output[0] if seq2seq else output[0, inputs["input_ids"].shape[1]:]
    text = tokenizer.decode(new_tokens, skip_special_tokens=True)
    if not args.stream:
        print(text)
    log(f"{len(new_tokens)} tokens generated")
    return text


def cli() -> None:
    """`archlab-generate`: `main` with one-line errors for bad input (see `run_cli`)."""
    run_cli(main)


if __name__ == "__main__":
    cli()
