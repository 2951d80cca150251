"""Text from a trained model: the sample printed after pretraining, and streamed generation from a saved decoder or
seq2seq folder (what `scripts/generate.py` runs)."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

import torch
from datasets import Json
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSeq2SeqLM,
    BatchEncoding,
    TextStreamer,
    set_seed,
)
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
)

from archlab.tokenization.training import load_tokenizer

from .dtypes import load_dtype
from .reporting import log
from .task_data import TOOLS_COLUMN, message_text, row_tools, template_messages

END_OF_TURN = "<|im_end|>"  # archlab's chat template closes every turn with it
CAUSAL_LM_HEADS = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())  # the stock decoders' generating classes
SEQ2SEQ_HEADS = set(MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES.values())  # ... and encoder-decoders'


def print_sample(model: Any, tokenizer: Any, prompt: str, max_new_tokens: int, seed: int) -> str:
    """A seeded sample (temperature 0.8, top-k 40) continuing `prompt`, logged and returned."""
    model.eval()
    inputs = tokenizer(prompt, return_tensors="pt")
    set_seed(seed)
    with torch.no_grad():
        output = model.generate(
            **inputs,
            max_new_tokens=max_new_tokens,
            do_sample=True,
            temperature=0.8,
            top_k=40,
            pad_token_id=tokenizer.pad_token_id,
            disable_compile=True,  # one short sample: on a GPU, compiling the decoding step would cost more
        )
    text = tokenizer.decode(output[0], skip_special_tokens=True)
    log(f"Sample (prompt {prompt!r}, temperature 0.8, top-k 40):\n{text}\n")
    return text


def sample_unless_sharded(trainer: Any, output_dir: str, sample: Callable[[], object]) -> None:
    """Run `sample` (text from the trained model) unless FSDP trained it: each process's parameters are then its own
    shard, so one line says how to generate from the saved folder instead."""
    if trainer.is_fsdp_enabled:
        log(f"No sample under FSDP: `python scripts/generate.py --model_name_or_path {output_dir}`")
        return
    sample()


def default_device() -> str:
    """Where generation runs unless told: the GPU when there is one (archlab decodes there with a static cache and
    a compiled step), else the CPU."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def check_device(device: str | None) -> None:
    """A ValueError naming `--device` for a device torch does not know, or a CUDA device on a machine without one."""
    if device is None:
        return
    try:
        kind = torch.device(device).type
    except RuntimeError:
        raise ValueError(f"--device {device!r} is not a device; use cpu, cuda or cuda:N.") from None
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device!r}: no CUDA GPU is available here; use --device cpu.")


def load_for_generation(folder: str, device: str | None = None, dtype: str | None = None) -> tuple[Any, Any, bool]:
    """The model saved in `folder` (in eval mode, on `device`, by default `default_device()`, its weights in `dtype`:
    one of `dtypes.DTYPES`, by default the dtype the folder was saved in), its tokenizer, and whether it is an
    encoder-decoder; a ValueError for a model that does not generate text (a classifier, a masked LM)."""
    config = AutoConfig.from_pretrained(folder)
    architectures = config.architectures or []
    # the stock heads are also read from transformers' own lists: GPT-2's `GPT2LMHeadModel`, Marian's `MarianMTModel`
    # (their folders were refused as models that do not generate text)
    seq2seq = any(name.endswith("ForConditionalGeneration") or name in SEQ2SEQ_HEADS for name in architectures)
    loading = {} if dtype is None else {"dtype": load_dtype(dtype)}
    if seq2seq:
        model = AutoModelForSeq2SeqLM.from_pretrained(folder, **loading)
    elif any(name.endswith("ForCausalLM") or name in CAUSAL_LM_HEADS for name in architectures):
        model = AutoModelForCausalLM.from_pretrained(folder, **loading)
    else:
        raise ValueError(
            f"{folder!r} holds a {config.architectures} model, which does not "
            "generate text; generate.py needs a decoder (ForCausalLM) or a seq2seq model."
        )
    tokenizer = load_tokenizer(folder)
    model.to(device or default_device()).eval()
    return model, tokenizer, seq2seq


# a prompt: a text, a conversation (a list of messages), or a conversation with its tools as a training row holds
# them ({"messages": [...], "tools": [...]}, TRL's layout)
Prompt = str | list[dict[str, Any]] | dict[str, Any]


def generate_text(model: Any, tokenizer: Any, prompt: Prompt, **kwargs: Any) -> str:
    """`generate_texts` for one prompt: its generated text."""
    return generate_texts(model, tokenizer, [prompt], **kwargs)[0]


def generate_texts(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[Prompt],
    *,
    seq2seq: bool,
    chat: bool = False,
    stream: bool = True,
    seed: int = 42,
    max_new_tokens: int = 100,
    do_sample: bool = True,
    temperature: float = 0.8,
    top_k: int = 40,
    top_p: float = 0.95,
    repetition_penalty: float = 1.0,
    num_beams: int = 1,
    stop_strings: Sequence[str] | None = None,
    num_return_sequences: int = 1,
) -> list[str]:
    """Generate after each of `prompts` (with `chat`, a user turn of the chat template, or a whole conversation given
    as a list of messages, continued from its last message where that is the assistant's, or as a row of
    `{"messages": ..., "tools": ...}` whose tools the chat template is given as in training) in one batch, printing
    the text as it is generated with `stream` (one row only, as transformers' `TextStreamer` takes one) or at the
    end without, either way after a decoder's prompt (not a
    chat's or a seq2seq source); returns the generated texts in the order of `prompts`. Several prompts are padded
    on the left for a decoder, as transformers' text-generation pipeline pads them (each row's new tokens follow
    its own prompt; the attention mask hides the padding), on the right for a seq2seq source; greedy decoding gives
    each the text it gives alone. The sampling arguments are `GenerationConfig`'s; temperature, top-k and top-p
    apply only with `do_sample`; `stop_strings` ends a row's generation once its text ends with one of them;
    `num_return_sequences` texts are returned for each prompt, one after the other (sampled, or a beam search's
    best)."""
    rows = len(prompts) * num_return_sequences
    if stream and rows > 1:
        raise ValueError(f"--stream prints one text as it is generated; {rows} were asked for.")
    if chat:
        if tokenizer.chat_template is None:
            raise ValueError(
                "--chat true needs a tokenizer with a chat template (train one with --model_kind decoder)."
            )
        chats = [as_chat_row(p) for p in prompts]
        # rendered, then tokenized as `apply_chat_template` tokenizes (the template writes its own special tokens); a
        # conversation that ends with the assistant's words is continued from them, as the text-generation pipeline
        # continues it (a new assistant turn was opened after them); a row's tools are the file's own, nulls
        # included, as training keeps those of JSON lines read as the Json feature
        texts = [
            tokenizer.apply_chat_template(
                chat["messages"],
                tools=row_tools(chat.get(TOOLS_COLUMN), Json()),
                add_generation_prompt=chat["messages"][-1]["role"] != "assistant",
                continue_final_message=chat["messages"][-1]["role"] == "assistant",
                tokenize=False,
            )
            for chat in chats
        ]
        encode = dict(add_special_tokens=False)
    else:
        texts, encode = list(prompts), {}
    pad_id = tokenizer.pad_token_id
    if pad_id is None and len(texts) > 1:
        if tokenizer.eos_token_id is None:
            raise ValueError("Several prompts are padded to one batch: the tokenizer has no pad or eos token.")
        pad_id = tokenizer.eos_token_id  # a GPT-2 style tokenizer pads with eos, as in transformers' docs
    inputs = pad_prompts(tokenizer(texts, **encode)["input_ids"], pad_id, "right" if seq2seq else "left")
    lengths = inputs["attention_mask"].sum(dim=1).tolist()
    if 0 in lengths:
        which = lengths.index(0)
        raise ValueError(
            f"Prompt {which + 1} ({texts[which]!r}) is no token at all for this tokenizer, and a model cannot "
            "continue from nothing: give a non-empty --prompt."
        )
    check_fits_the_positions(model.config, inputs["input_ids"].shape[1], max_new_tokens, seq2seq)
    inputs = inputs.to(model.device)

    eos = stop_token_ids(model, tokenizer, chat)
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True) if stream else None
    set_seed(seed)
    continues_prompt = not seq2seq and not chat  # what it prints reads on from the prompt
    if stream and continues_prompt:
        print(prompts[0], end="", flush=True)
    with torch.no_grad():
        output = model.generate(
            **inputs,
            max_new_tokens=max_new_tokens,
            do_sample=do_sample,
            temperature=temperature if do_sample else None,
            top_k=top_k if do_sample else None,
            top_p=top_p if do_sample else None,
            repetition_penalty=repetition_penalty,
            num_beams=num_beams,
            num_return_sequences=num_return_sequences,
            eos_token_id=eos,
            pad_token_id=pad_id,
            streamer=streamer,
            **(dict(stop_strings=list(stop_strings), tokenizer=tokenizer) if stop_strings else {}),
        )
    # (a seq2seq output opens with the decoder's start token, which generate puts there and did not generate)
    new_tokens = output[:, 1:] if seq2seq else output[:, inputs["input_ids"].shape[1] :]
    results, generated = [], 0
    for k, row in enumerate(new_tokens):
        if rows > 1:  # a row that ended before the longest is filled up with padding after its end
            ended = torch.isin(row, torch.tensor(eos or [-1], device=row.device)).nonzero()
            row = row[: int(ended[0]) + 1] if len(ended) else row
            while len(row) and int(row[-1]) == pad_id and pad_id not in eos:
                row = row[:-1]
        text = tokenizer.decode(row, skip_special_tokens=True)
        generated += len(row)
        if not stream:
            if rows > 1:
                print(f"=== {k + 1}/{rows}")
            print(prompts[k // num_return_sequences] + text if continues_prompt else text)
        results.append(text)
    log(f"{generated} tokens generated" + (f" in {rows} texts" if rows > 1 else ""))
    return results


def as_chat_row(prompt: Prompt) -> dict[str, Any]:
    """A prompt as a row of `{"messages": ..., "tools": ...}`: a text is a user's turn, a list its messages."""
    if isinstance(prompt, str):
        return {"messages": [{"role": "user", "content": prompt}]}
    return prompt if isinstance(prompt, dict) else {"messages": prompt}


def pad_prompts(rows: list[list[int]], pad_id: int | None, side: str) -> BatchEncoding:
    """Token id rows as one batch (`input_ids`, `attention_mask`), padded with `pad_id` on `side`: padded here
    rather than by the tokenizer, which pads only with a pad token of its own, so a tokenizer without one (GPT-2's)
    is not given the eos token as its pad token (the caller's tokenizer object kept it afterwards)."""
    longest = max(len(row) for row in rows)
    ids = torch.full((len(rows), longest), pad_id if pad_id is not None else 0, dtype=torch.long)
    mask = torch.zeros((len(rows), longest), dtype=torch.long)
    for k, row in enumerate(rows):
        columns = slice(longest - len(row), longest) if side == "left" else slice(0, len(row))
        ids[k, columns] = torch.tensor(row, dtype=torch.long)
        mask[k, columns] = 1
    return BatchEncoding({"input_ids": ids, "attention_mask": mask})


# stock model types whose positions are rows of a table of `max_position_embeddings` (GPT-2's `n_positions`): an
# `nn.Embedding` (OPT and the Bart family offset by 2 rows they add) or a fixed sinusoidal one (Marian, Pegasus)
STOCK_POSITION_TABLES = {
    **dict.fromkeys(("gpt2", "openai-gpt", "opt", "gpt_neo", "gpt_bigcode", "biogpt"), "learned"),
    **dict.fromkeys(("bart", "mbart", "plbart", "blenderbot", "blenderbot-small"), "learned"),
    **dict.fromkeys(("marian", "pegasus"), "sinusoidal"),
}


def check_fits_the_positions(
    config: Any,
    prompt_tokens: int,
    max_new_tokens: int,
    seq2seq: bool,
    flag: str = "--max_new_tokens",
    prompt_flag: str = "--prompt / --prompt_file",
) -> None:
    """A model with an absolute position table (learned or sinusoidal, `max_position_embeddings` rows) looks up one
    position per token it reads: a decoder's prompt and the new tokens but the last, a seq2seq decoder its start
    token and the new tokens but the last, its encoder the source. Past the table, a ValueError naming the flag to
    lower, before anything is generated: on the CPU the forward refused the position only at the step that crossed
    it, after the text so far had been printed (on a GPU, a device-side assert). Position types without a table
    (rope, alibi, relative_bias) are let through: rope warns once past its trained length. `flag` and `prompt_flag`
    name the flags that set the two lengths."""
    from archlab.modeling.fast_decoding import table_of

    table = table_of(config) or STOCK_POSITION_TABLES.get(getattr(config, "model_type", None))
    limit = getattr(config, "max_position_embeddings", None)  # (GPT-2's `n_positions` answers to this name too)
    if table is None or limit is None:
        return
    source = "source" if seq2seq else "prompt"
    if prompt_tokens > limit:
        raise ValueError(
            f"The {source} is {prompt_tokens} tokens, more than the model's {table} position table's "
            f"`max_position_embeddings` ({limit}): give a shorter {prompt_flag}."
        )
    most = limit if seq2seq else limit + 1 - prompt_tokens
    if max_new_tokens > most:
        after = "" if seq2seq else f" after a prompt of {prompt_tokens} tokens"
        raise ValueError(
            f"{flag} {max_new_tokens} is past the model's {table} position table (`max_position_embeddings` = "
            f"{limit}){after}: give {flag} {most} or fewer."
        )


def end_of_turn_id(tokenizer: Any) -> int | None:
    """The token the tokenizer's chat template closes an assistant's turn with: the special token it writes right
    after an answer's text (archlab's `<|im_end|>`; a Hub model's Llama 3 `<|eot_id|>`, Gemma `<end_of_turn>`, Phi-3
    `<|end|>`); else `<|im_end|>` where the vocabulary has it, else None."""
    fallback = tokenizer.convert_tokens_to_ids(END_OF_TURN) if END_OF_TURN in tokenizer.get_vocab() else None
    if not getattr(tokenizer, "chat_template", None):
        return fallback
    answer = "archlab answer text"
    conversation = [{"role": "user", "content": "a question"}, {"role": "assistant", "content": answer}]
    try:
        text = tokenizer.apply_chat_template(conversation, tokenize=False)
    except Exception:  # a template that takes other roles or content: no turn end to read
        return fallback
    after = text.split(answer, 1)[1] if answer in text else ""
    ids = tokenizer(after, add_special_tokens=False)["input_ids"] if after else []
    special = set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder)
    return ids[0] if ids and ids[0] in special else fallback


def eos_ids(generation_config: Any) -> list[int]:
    """A generation config's end-of-sequence ids as a list (none, one id, or several)."""
    eos = generation_config.eos_token_id
    return [] if eos is None else list(eos) if isinstance(eos, (list, tuple)) else [eos]


def stop_token_ids(model: Any, tokenizer: Any, chat: bool) -> list[int]:
    """The ids `generate` stops at: the model's generation config's (one id or several; the tokenizer's eos when it
    has none), and with `chat` the chat template's end-of-turn token as well. (One id or a list was put in a list
    as it was: a fine-tuned chat model's config holds a list, and `generate` failed on the nested one with
    "TypeError: not a sequence".)"""
    ids = eos_ids(model.generation_config)
    if not ids and tokenizer.eos_token_id is not None:
        ids = [tokenizer.eos_token_id]
    end = end_of_turn_id(tokenizer) if chat else None  # a chat turn ends with the template's end-of-turn token
    ids += [end] if end is not None and end not in ids else []
    return ids


def stop_at_the_end_of_a_turn(model: Any, tokenizer: Any) -> None:
    """A chat model's generation config stops at the chat template's end-of-turn token (`end_of_turn_id`) as well as
    at eos, as chat models on the Hub ship it: `generate` and `pipeline("text-generation")` with a conversation then
    end with the assistant's turn instead of running on into the next one."""
    end = end_of_turn_id(tokenizer)
    if end is None:
        return
    ids = eos_ids(model.generation_config)
    model.generation_config.eos_token_id = ids + [end] if end not in ids else ids


def show_chat_example(
    model: Any,
    tokenizer: Any,
    example: dict[str, Any],
    args: Any,
    max_new_tokens: int | None = None,
    features: Any = None,
) -> None:
    """Log the fine-tuned chat model's greedy answer (up to `max_new_tokens` tokens, 64 when None) to the example's
    conversation up to its first assistant turn (in the column `args.messages_column`): a system message and the
    user's turn, not the first message alone (a conversation that opens with a system message showed the system text
    as the user's turn and the answer to it); a conversation that opens with the assistant's turn (a tool call) is
    prompted with that turn, logged as `shown_message` shows it. The example's tools (a `tools` column) are given to
    the chat template, as in training. `features` (its split's) say which None entries Arrow added, as
    `tokenize_instruct` reads them: without them, every None entry was left out, and a null argument or schema
    default that JSON lines loaded as `datasets`' Json feature keep in training was missing from the prompt."""
    features = features or {}
    messages = template_messages(example[args.messages_column], features.get(args.messages_column))
    first_answer = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), len(messages))
    prompt = messages[:first_answer] or messages[:1]
    model.eval()
    with torch.no_grad():
        inputs = tokenizer.apply_chat_template(
            prompt,
            tools=row_tools(example.get(TOOLS_COLUMN), features.get(TOOLS_COLUMN)),
            add_generation_prompt=True,
            return_tensors="pt",
            return_dict=True,
        )
        output = model.generate(
            **inputs,
            max_new_tokens=max_new_tokens or 64,
            do_sample=False,
            eos_token_id=stop_token_ids(model, tokenizer, chat=True),
            pad_token_id=tokenizer.pad_token_id,
            disable_compile=True,  # one example: compiling the decoding step would cost more than it saves
        )
        answer = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
        turns = "\n".join(f"{m['role']}: {shown_message(m)}" for m in prompt)
        log(f"Example -- {turns}\nassistant:\n{answer}")


def shown_message(message: dict[str, Any]) -> str:
    """A message as the example's log line shows it: its text (a content of text parts as its text, as the template
    reads it, not as the list's repr), then each tool call as `name(arguments)`, the arguments as compact JSON (a
    conversation that opens with the assistant's call showed `assistant: None`)."""
    text = message_text(message.get("content"))
    calls = [shown_call(call.get("function", call)) for call in message.get("tool_calls") or ()]
    return "; ".join(([text] if text else []) + calls) if calls else str(text)


def shown_call(function: dict[str, Any]) -> str:
    """A tool call's function as `name(arguments)`: a JSON string of arguments as it stands, an object as JSON."""
    arguments = function.get("arguments")
    return f"{function['name']}({arguments if isinstance(arguments, str) else json.dumps(arguments)})"


def show_seq2seq_example(
    model: Any,
    tokenizer: Any,
    example: dict[str, Any],
    args: Any,
    max_new_tokens: int | None = None,
    features: Any = None,
) -> None:
    """Log the fine-tuned encoder-decoder's greedy output for the example's source (`args.source_column`, after
    `args.source_prefix` as in training, truncated to `args.max_source_length`) beside its reference
    (`args.target_column`). (`features`, its split's, are `show_chat_example`'s: a source is text.)"""
    model.eval()
    source = (getattr(args, "source_prefix", None) or "") + example[args.source_column]
    with torch.no_grad():
        inputs = tokenizer(source, return_tensors="pt", truncation=True, max_length=args.max_source_length)
        inputs.pop("token_type_ids", None)
        output = model.generate(  # one example: compiling the decoding step would cost more than it saves
            **inputs, max_new_tokens=max_new_tokens or 48, num_beams=1, do_sample=False, disable_compile=True
        )
        log(
            f"Example -- {args.source_column}:\n{example[args.source_column]}\n"
            f"generated: {tokenizer.decode(output[0], skip_special_tokens=True)}\n"
            f"reference: {example[args.target_column]}"
        )
