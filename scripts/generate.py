"""Stream text from a saved archlab model (decoder or seq2seq) with `TextStreamer`:

    python scripts/generate.py --model_name_or_path runs/pretrain --prompt "def parse_args("
    python scripts/generate.py --model_name_or_path runs/chat --chat true --prompt "Reverse a list."
    python scripts/generate.py --model_name_or_path runs/docstrings --prompt $'def add(a, b):\\n    return a + b'
    python scripts/generate.py --model_name_or_path runs/pretrain --prompt "def f(" --stop_strings $'\\n\\n' "class "
    python scripts/generate.py --model_name_or_path runs/pretrain --prompt "def parse_args(" "class Parser"
    python scripts/generate.py --model_name_or_path runs/chat --chat true --prompts_file questions.jsonl

The usual sampling flags (`--do_sample`, `--temperature`, `--top_k`, `--top_p`, `--repetition_penalty`,
`--num_beams`, `--max_new_tokens`, `--stop_strings`) map one to one onto `GenerationConfig`; a stop string ends the
text once generated, as in transformers (it is kept, as the last words printed). The model runs on the GPU when there is
one (`--device`), where `generate` decodes with a static cache and a compiled step (docs/workflows.md), in the dtype
its folder was saved in unless `--dtype` says (`--dtype bfloat16`: half the memory). Several prompts
(`--prompt A B`, or `--prompts_file`: one a line, or JSON Lines of strings or chat conversations, given with their
tools as a training row holds them, `{"messages": [...], "tools": [...]}`, where the model was tuned with tools) are
generated as one batch, left-padded for a decoder, and printed in order after a `=== k/N` line each; greedy decoding
gives each the text it gives alone.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from archlab.scripts.arguments import (
    check_model_folder,
    check_not_empty,
    check_seed,
    check_weights,
    parse_arguments,
    run_cli,
)
from archlab.text2text import stored_prefix
from archlab.tokenization.training import has_tokenizer
from archlab.training.dtypes import check_dtype
from archlab.training.reporting import log
from archlab.training.sampling import Prompt, check_device, generate_text, generate_texts, load_for_generation
from archlab.training.task_data import check_chat_message


@dataclass
class GenerateArguments:
    model_name_or_path: str = field(metadata={"help": "A folder written by the pretrain/finetune scripts."})
    prompt: list[str] = field(
        default_factory=lambda: ["def "],
        metadata={
            "help": "The text to continue (the source, for seq2seq); several (`--prompt A B`) are generated as one "
            "batch and printed in order."
        },
    )
    prompt_file: str | None = field(default=None, metadata={"help": "Read the prompt from this file instead."})
    prompts_file: str | None = field(
        default=None,
        metadata={
            "help": "Read several prompts from this file instead, generated as one batch and printed in order: one "
            "prompt a line, or in a .jsonl file one JSON value a line, a string (newlines as \\n) or, with --chat, a "
            'conversation (a list of {"role": ..., "content": ...} messages), or a conversation with its tools as a '
            'training row holds them ({"messages": [...], "tools": [...]}).'
        },
    )
    chat: bool = field(default=False, metadata={"help": "Wrap the prompt as a user turn of the chat template."})
    max_new_tokens: int = field(
        default=100,
        metadata={
            "help": "Tokens to generate; with the prompt, within a learned or sinusoidal position table's "
            "`max_position_embeddings` (rope has no table: past its trained length it warns)."
        },
    )
    source_prefix: str | None = field(
        default=None,
        metadata={
            "help": "seq2seq: text put before the source (unset: the task prefix the folder was fine-tuned with, "
            '`task_specific_params[task]["prefix"]` as scripts/finetune.py\'s --source_prefix saves it, when it '
            'holds one; "": none; a folder with several, as T5\'s, needs the flag).'
        },
    )
    stop_strings: list[str] | None = field(
        default=None,
        metadata={"help": "Stop once the generated text ends with any of these strings (kept in the output)."},
    )
    do_sample: bool | None = field(
        default=None,
        metadata={"help": "Sample (true) or decode greedily / by beam search (default: true; false with --num_beams)."},
    )
    temperature: float = field(default=0.8, metadata={"help": "Softmax temperature when sampling."})
    top_k: int = field(default=40, metadata={"help": "Sample among the k most likely tokens (0: all)."})
    top_p: float = field(default=0.95, metadata={"help": "Nucleus sampling mass."})
    repetition_penalty: float = field(default=1.0, metadata={"help": "> 1 discourages repeats."})
    num_beams: int = field(
        default=1, metadata={"help": "Beam search width (1: none); beam search neither samples nor streams."}
    )
    num_return_sequences: int = field(
        default=1,
        metadata={
            "help": "Texts generated for each prompt, printed one after the other: sampled, or with --num_beams N "
            "(>= this) the best beams."
        },
    )
    output_file: str | None = field(
        default=None,
        metadata={
            "help": 'Also write the texts to this JSON Lines file, one {"prompt": ..., "generated_text": ...} a '
            "line, in the order they are printed."
        },
    )
    seed: int = field(default=42, metadata={"help": "Random seed for sampling."})
    stream: bool | None = field(
        default=None, metadata={"help": "Print tokens as they are generated (default: true; false with --num_beams)."}
    )
    device: str | None = field(
        default=None, metadata={"help": "Where the model runs: cpu, cuda, cuda:1, ... (default: cuda if available)."}
    )
    dtype: str | None = field(
        default=None,
        metadata={
            "aliases": ["--torch_dtype"],
            "help": "auto | bfloat16 | float16 | float32: the dtype the weights load in and the model runs in, as "
            "from_pretrained(dtype=...) (bfloat16 or float16: half the memory of float32). Default: the dtype the "
            "folder was saved in (config.json's `dtype`), as auto.",
        },
    )

    def __post_init__(self) -> None:
        check_dtype(self.dtype)


# transformers' examples/pytorch/text-generation/run_generation.py flags that this script names otherwise or does
# without, and what to pass instead: they failed on "Unknown flags" that named no alternative, --p exited with
# argparse's usage and "ambiguous option" (a prefix of --prompt, --prompt_file and --prompts_file), and --no_cuda was
# pointed to the training scripts' --use_cpu, which this script does not have
GENERATION_EXAMPLE_FLAGS = {
    "model_type": "leave it out: the folder's config.json names its model",
    "length": "--max_new_tokens",
    "stop_token": "--stop_strings (the text ends once it ends with one, which is kept; run_generation.py cut the "
    "text before it)",
    "k": "--top_k",
    "p": "--top_p",
    "prefix": "put it at the start of --prompt (a seq2seq folder's task prefix: --source_prefix)",
    "padding_text": "leave it out: it pads XLNet's and Transfo-XL's prompts, and neither family runs here",
    "xlm_language": "leave it out: it picks an XLM model's language embedding, and XLM does not run here",
    "fp16": "--dtype float16 (unset: the model loads in the dtype its folder was saved in)",
    "use_cpu": "--device cpu",
    "no_cuda": "--device cpu",
}


def resolve_defaults(args: GenerateArguments, prompts: int = 1) -> None:
    """`--do_sample` and `--stream` left unset: true, except with beam search (`--num_beams` > 1), which neither
    samples nor streams, and `--stream` with several prompts (transformers' `TextStreamer` prints one row); given
    explicitly, they stand (and `check` refuses the combinations that cannot run)."""
    beams = args.num_beams > 1
    if args.do_sample is None:
        args.do_sample = not beams
    texts = prompts * max(args.num_return_sequences, 1)
    if args.stream is None:
        args.stream = not beams and texts == 1
    if args.stream and prompts > 1:
        raise ValueError(f"Conflicting flags: --stream true and {prompts} prompts (a stream prints one text).")
    if args.stream and texts > 1:
        raise ValueError("Conflicting flags: --stream true and --num_return_sequences > 1 (a stream prints one text).")


def check(args: GenerateArguments) -> None:
    check_device(args.device)
    check_not_empty(args, ("model_name_or_path", "prompt_file", "prompts_file", "output_file"))
    if args.output_file and (
        os.path.isdir(args.output_file) or not os.path.isdir(os.path.dirname(args.output_file) or ".")
    ):
        raise ValueError(f"--output_file {args.output_file!r} is a folder or in a folder that does not exist.")
    if args.prompt_file and args.prompts_file:
        raise ValueError("Conflicting flags: --prompt_file (one prompt) and --prompts_file (several); give one.")
    if os.path.isdir(args.model_name_or_path):
        check_model_folder(args.model_name_or_path, "--model_name_or_path")
    else:
        raise FileNotFoundError(f"--model_name_or_path {args.model_name_or_path!r} holds no saved model (config.json).")
    for flag in ("prompt_file", "prompts_file"):
        if getattr(args, flag) and not os.path.isfile(getattr(args, flag)):
            raise FileNotFoundError(f"--{flag} {getattr(args, flag)!r} does not exist.")
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
    if args.stop_strings is not None and not all(args.stop_strings):
        raise ValueError("--stop_strings: an empty string would stop at once; give non-empty strings.")
    check_seed(args.seed, "--seed")
    if args.num_beams < 1:
        raise ValueError(f"--num_beams must be >= 1 (1: no beam search), got {args.num_beams}.")
    if args.num_return_sequences < 1:
        raise ValueError(f"--num_return_sequences must be >= 1, got {args.num_return_sequences}.")
    if not args.do_sample and args.num_return_sequences > args.num_beams:
        raise ValueError(
            f"--num_return_sequences {args.num_return_sequences} needs as many different texts: sample "
            f"(--do_sample true) or search that many beams (--num_beams {args.num_return_sequences} or more)."
        )
    if args.do_sample and args.num_beams > 1:
        raise ValueError("Conflicting flags: --do_sample true and --num_beams > 1 (beam search does not sample).")
    if args.stream and args.num_beams > 1:
        raise ValueError("Conflicting flags: --stream true and --num_beams > 1 (beam search cannot stream).")
    if not has_tokenizer(args.model_name_or_path):
        raise FileNotFoundError(
            f"--model_name_or_path {args.model_name_or_path!r} holds no tokenizer "
            "(tokenizer.json): save the tokenizer next to the model, as the training scripts do."
        )
    check_weights(args.model_name_or_path, "--model_name_or_path")


def main(argv: Sequence[str] | None = None) -> str | list[str]:
    """The generated text (the list of texts, in order, for several prompts)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    given = sum(arg == "--prompt" or arg.startswith("--prompt=") for arg in argv)
    if given > 1:
        raise ValueError(
            f"--prompt was given {given} times, and the last would replace the others: give several prompts after "
            "one --prompt (--prompt A B) or in --prompts_file."
        )
    (args,) = parse_arguments((GenerateArguments,), argv, __doc__, GENERATION_EXAMPLE_FLAGS)
    prompts = read_prompts(args)
    resolve_defaults(args, len(prompts))
    check(args)
    model, tokenizer, seq2seq = load_for_generation(args.model_name_or_path, args.device, args.dtype)
    if not args.chat and any(not isinstance(prompt, str) for prompt in prompts):
        raise ValueError(
            f"--prompts_file {args.prompts_file!r} holds conversations (lists of messages, or rows of messages and "
            "tools): add --chat true."
        )
    if seq2seq:
        prefix = source_prefix(model.config, args.source_prefix)
        # (a conversation is left to the chat template's check: a seq2seq tokenizer has none)
        prompts = [prefix + prompt if isinstance(prompt, str) else prompt for prompt in prompts]
    elif args.source_prefix is not None:
        raise ValueError("--source_prefix goes before a seq2seq model's source; this folder holds a decoder.")
    settings = dict(
        seq2seq=seq2seq,
        chat=args.chat,
        stream=args.stream,
        seed=args.seed,
        max_new_tokens=args.max_new_tokens,
        do_sample=args.do_sample,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        repetition_penalty=args.repetition_penalty,
        num_beams=args.num_beams,
        stop_strings=args.stop_strings,
    )
    if args.num_return_sequences > 1:
        settings["num_return_sequences"] = args.num_return_sequences
    if len(prompts) == 1 and args.num_return_sequences == 1:
        result = generate_text(model, tokenizer, prompts[0], **settings)
        texts = [result]
    else:
        texts = result = generate_texts(model, tokenizer, prompts, **settings)
    if args.output_file:
        with open(args.output_file, "w", encoding="utf-8") as f:
            for k, text in enumerate(texts):
                record = {"prompt": prompts[k // args.num_return_sequences], "generated_text": text}
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
        log(f"{len(texts)} texts written to {args.output_file}")
    return result


def read_text(path: str, flag: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        raise FileNotFoundError(f"{flag} {path!r} does not exist.") from None
    except UnicodeDecodeError as error:
        raise ValueError(f"{flag} {path!r} is not UTF-8 text ({error.reason} at byte {error.start}).") from None


def read_prompts(args: GenerateArguments) -> list[Prompt]:
    """The prompts: --prompt's, --prompt_file's whole text, or --prompts_file's lines (JSON values in a .jsonl file,
    a string, a conversation, or a conversation with its tools as a training row holds them, each; blank lines
    skipped)."""
    prompts = [args.prompt] if isinstance(args.prompt, str) else list(args.prompt)  # a .json of flags gives a string
    if args.prompt_file:
        prompts = [read_text(args.prompt_file, "--prompt_file")]
    elif args.prompts_file:
        lines = read_text(args.prompts_file, "--prompts_file").splitlines()
        numbered = [(n, line) for n, line in enumerate(lines, 1) if line.strip()]
        if not args.prompts_file.endswith(".jsonl"):
            prompts = [line for _, line in numbered]
        else:
            prompts = []
            for n, line in numbered:
                try:
                    value = json.loads(line)
                except json.JSONDecodeError as error:
                    where = f"--prompts_file {args.prompts_file!r}, line {n}"
                    raise ValueError(f"{where}: not JSON ({error.msg}).") from None
                if not (isinstance(value, str) or is_conversation(value) or is_row_with_tools(value)):
                    raise ValueError(
                        f"--prompts_file {args.prompts_file!r}, line {n}: a prompt is a JSON string or a list of "
                        f'{{"role": ..., "content": ...}} messages (or {{"messages": [...], "tools": [...]}}), got '
                        f"{line.strip()[:60]}"
                    )
                check_conversation_messages(value, f"--prompts_file {args.prompts_file!r}, line {n}")
                prompts.append(value)
        if not prompts:
            raise ValueError(f"--prompts_file {args.prompts_file!r} holds no prompt (every line is blank).")
    return prompts


def check_conversation_messages(prompt: Prompt, where: str) -> None:
    """Each message of a conversation (or of a row of messages and tools) checked as finetune.py's instruct task
    checks its rows' (`check_chat_message`: a role, content that is text or text parts, None only beside tool calls,
    each call with a name and arguments an object or a JSON string), a bad one named with `where` (the file and line)
    and its number: a call without a name failed inside the chat template, arguments that are not JSON were rendered
    as they stood, and a `"content": null` without tool calls or a message without content as an empty turn, prompts
    the model was never trained on. (A conversation need not hold an assistant turn: a prompt ends with the user's.)"""
    messages = prompt.get("messages") if isinstance(prompt, dict) else prompt
    for k, message in enumerate(messages if isinstance(messages, list) else [], 1):
        check_chat_message(message, f"{where}, message {k}")


def is_conversation(value: Any) -> bool:
    """A non-empty list of messages, each a dict with a role."""
    return isinstance(value, list) and bool(value) and all(isinstance(m, dict) and "role" in m for m in value)


def is_row_with_tools(value: Any) -> bool:
    """A training row's layout: {"messages": a conversation, "tools": a list of schemas, that list as a JSON string,
    or null}, nothing else."""
    tools = value.get("tools") if isinstance(value, dict) else None
    return (
        isinstance(value, dict)
        and set(value) <= {"messages", "tools"}
        and is_conversation(value.get("messages"))
        and (tools is None or isinstance(tools, (list, str)))
    )


def source_prefix(config, flag: str | None) -> str:
    """--source_prefix, else the task prefix the folder was fine-tuned with (one logged line says which), else ""."""
    if flag is not None:
        return flag
    prefix = stored_prefix(config, choose='--source_prefix with the one the prompt needs ("" for none)')
    if prefix:
        log(f'Source prefix {prefix!r}: the task prefix this folder was fine-tuned with (--source_prefix "": none)')
    return prefix


def cli() -> None:
    """`archlab-generate`: `main` with one-line errors for bad input (see `run_cli`)."""
    run_cli(main)


if __name__ == "__main__":
    cli()
