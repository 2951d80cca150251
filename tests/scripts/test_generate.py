"""scripts/generate.py: streamed generation from saved decoder and seq2seq folders, and its errors."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

import archlab
from archlab.scripts import generate
from archlab.tokenization.training import save_tokenizer, train_tokenizer
from archlab.training.sampling import load_for_generation, stop_at_the_end_of_a_turn, stop_token_ids

from helpers import REPO, randomised, tiny_decoder_config, tiny_seq2seq_config

TEXTS = [f"def f{i}(x):\n    return x + {i}\n" for i in range(40)]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("generate")
    torch.manual_seed(0)
    decoder_tok = train_tokenizer(TEXTS, "decoder", vocab_size=300, min_frequency=1)
    decoder = archlab.DecoderForCausalLM(tiny_decoder_config(vocab_size=len(decoder_tok)))
    decoder.save_pretrained(folder / "decoder")
    save_tokenizer(decoder_tok, folder / "decoder")

    seq_tok = train_tokenizer(TEXTS, "seq2seq", vocab_size=300, min_frequency=1)
    config = tiny_seq2seq_config(vocab_size=len(seq_tok))
    archlab.Seq2SeqForConditionalGeneration(config).save_pretrained(folder / "seq2seq")
    save_tokenizer(seq_tok, folder / "seq2seq")

    masked_tok = train_tokenizer(TEXTS, "masked_lm", vocab_size=200, min_frequency=1)
    archlab.EncoderForMaskedLM(config).save_pretrained(folder / "masked")
    save_tokenizer(masked_tok, folder / "masked")
    return {"decoder": folder / "decoder", "seq2seq": folder / "seq2seq", "masked": folder / "masked"}


def test_decoder_streams_what_greedy_generate_returns(saved: dict[str, Path], capsys) -> None:
    text = generate.main(
        [
            "--model_name_or_path",
            str(saved["decoder"]),
            "--prompt",
            "def f1(x):",
            "--max_new_tokens",
            "12",
            "--do_sample",
            "false",
        ]
    )
    model = archlab.DecoderForCausalLM.from_pretrained(saved["decoder"]).eval()
    tokenizer = archlab.tokenization.training.load_tokenizer(saved["decoder"])
    inputs = tokenizer("def f1(x):", return_tensors="pt")
    expected = model.generate(
        **inputs,
        max_new_tokens=12,
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    assert text == tokenizer.decode(expected[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    printed = capsys.readouterr().out
    assert printed.startswith("def f1(x):") and text.strip() in printed  # the streamer printed it


def test_streamed_or_not_a_decoder_prints_its_prompt_then_the_text(saved: dict[str, Path], capsys) -> None:
    args = ["--model_name_or_path", str(saved["decoder"]), "--prompt", "def g(", "--max_new_tokens", "6"]
    printed = {}
    for stream, beams in (("true", "1"), ("false", "1"), ("false", "2")):
        text = generate.main([*args, "--do_sample", "false", "--stream", stream, "--num_beams", beams])
        out = capsys.readouterr().out
        printed[stream, beams] = out[: out.index("def g(" + text) + len("def g(" + text)]
    assert printed["true", "1"] == printed["false", "1"]
    assert printed["false", "2"].startswith("def g(")


def test_stop_strings_end_the_text_where_it_first_ends_with_one(saved: dict[str, Path]) -> None:
    args = ["--model_name_or_path", str(saved["decoder"]), "--prompt", "def f1(x):", "--do_sample", "false"]
    model = archlab.DecoderForCausalLM.from_pretrained(saved["decoder"]).eval()
    tokenizer = archlab.tokenization.training.load_tokenizer(saved["decoder"])
    inputs = tokenizer("def f1(x):", return_tensors="pt", return_token_type_ids=False)
    new = model.generate(**inputs, max_new_tokens=40, do_sample=False, pad_token_id=tokenizer.pad_token_id)[
        0, inputs["input_ids"].shape[1] :
    ]
    # the untrained model's tokens are mostly single bytes: the stop string is the first two new tokens (not the
    # first one) that read as printable text
    pairs = (tokenizer.decode(new[k : k + 2]) for k in range(1, len(new) - 1))
    stop = next(text for text in pairs if text.isascii() and text.isprintable() and len(text.strip()) > 1)
    cut = next(k for k in range(1, len(new) + 1) if tokenizer.decode(new[:k]).endswith(stop))
    for stream in ("true", "false"):
        stopped = generate.main([*args, "--max_new_tokens", "40", "--stream", stream, "--stop_strings", "@@", stop])
        assert stopped == tokenizer.decode(new[:cut], skip_special_tokens=True), stream
    with pytest.raises(ValueError, match="--stop_strings: an empty string"):
        generate.main([*args, "--stop_strings", ""])


def test_sampling_is_seeded_and_chat_works(saved: dict[str, Path]) -> None:
    args = ["--model_name_or_path", str(saved["decoder"]), "--max_new_tokens", "10", "--stream", "false"]
    assert generate.main(args + ["--seed", "3"]) == generate.main(args + ["--seed", "3"])
    assert isinstance(generate.main(args + ["--chat", "true", "--prompt", "add one"]), str)


def test_a_chat_model_that_stops_at_the_end_of_a_turn_generates(saved: dict[str, Path], tmp_path: Path) -> None:
    """A fine-tuned chat model's generation config stops at eos and at `<|im_end|>` (a list of ids): generate.py put
    that list inside another, and `generate` failed with "TypeError: not a sequence", with --chat and without."""
    model = archlab.DecoderForCausalLM.from_pretrained(saved["decoder"])
    tokenizer = archlab.tokenization.training.load_tokenizer(saved["decoder"])
    stop_at_the_end_of_a_turn(model, tokenizer)
    model.save_pretrained(tmp_path)
    save_tokenizer(tokenizer, tmp_path)
    args = ["--model_name_or_path", str(tmp_path), "--max_new_tokens", "4", "--stream", "false", "--prompt", "add"]
    for chat in ("true", "false"):
        assert isinstance(generate.main([*args, "--chat", chat]), str)


def test_seq2seq_generation(saved: dict[str, Path], capsys) -> None:
    text = generate.main(
        [
            "--model_name_or_path",
            str(saved["seq2seq"]),
            "--prompt",
            "def f(x): return x",
            "--max_new_tokens",
            "6",
            "--do_sample",
            "false",
            "--num_beams",
            "2",
            "--stream",
            "false",
        ]
    )
    assert isinstance(text, str) and "tokens generated" in capsys.readouterr().out


@pytest.mark.parametrize("beams", ["1", "2"])
def test_a_seq2seq_count_of_generated_tokens_leaves_out_the_start_token(saved: dict[str, Path], beams, capsys) -> None:
    """The count logged after a seq2seq generation included the decoder's start token, which generate puts first:
    `--max_new_tokens 5` run to its end logged "6 tokens generated"."""
    model, tokenizer, _ = load_for_generation(str(saved["seq2seq"]), "cpu")
    prompt = "def f(x): return x"
    ids = model.generate(
        **tokenizer(prompt, return_tensors="pt"),
        max_new_tokens=5,
        num_beams=int(beams),
        do_sample=False,
        eos_token_id=stop_token_ids(model, tokenizer, chat=False),
        pad_token_id=tokenizer.pad_token_id,
    )
    assert ids[0, 0] == model.config.decoder_start_token_id
    flags = ["--model_name_or_path", str(saved["seq2seq"]), "--max_new_tokens", "5", "--num_beams", beams]
    generate.main([*flags, "--prompt", prompt, "--do_sample", "false", "--stream", "false", "--device", "cpu"])
    assert f"] {ids.shape[1] - 1} tokens generated" in capsys.readouterr().out


def test_num_beams_alone_is_beam_search(saved: dict[str, Path], monkeypatch) -> None:
    """`--num_beams N` without further flags: beam search, neither sampling nor streaming (the flags default to
    false with it, true without)."""
    from archlab.scripts import generate as script

    calls = []
    monkeypatch.setattr(script, "generate_text", lambda *args, **kwargs: calls.append(kwargs) or "")
    base = ["--model_name_or_path", str(saved["decoder"])]
    script.main([*base, "--num_beams", "3"])
    script.main(base)
    beams, default = calls
    assert (beams["num_beams"], beams["do_sample"], beams["stream"]) == (3, False, False)
    assert (default["num_beams"], default["do_sample"], default["stream"]) == (1, True, True)


def test_on_cuda_the_script_decodes_on_the_static_path(saved: dict[str, Path], monkeypatch) -> None:
    """With no flag, as on a GPU (the decision forced; the model stays on this CPU): the static cache, the same text."""
    from archlab.modeling import fast_decoding

    args = ["--model_name_or_path", str(saved["decoder"]), "--max_new_tokens", "8", "--do_sample", "false"]
    expected = generate.main(args + ["--stream", "false"])
    chosen = []
    choose = fast_decoding.choose_cache_implementation
    monkeypatch.setattr(fast_decoding, "decodes_compiled_by_default", lambda device: True)
    monkeypatch.setattr(
        fast_decoding, "choose_cache_implementation", lambda *args: chosen.append(choose(*args)) or chosen[-1]
    )
    assert generate.main(args) == expected  # streamed
    assert chosen == ["static"]


def test_device_flag(saved: dict[str, Path]) -> None:
    args = ["--model_name_or_path", str(saved["decoder"]), "--max_new_tokens", "3", "--stream", "false"]
    assert isinstance(generate.main(args + ["--device", "cpu"]), str)
    with pytest.raises(ValueError, match="--device 'gpu0' is not a device; use cpu, cuda or cuda:N"):
        generate.main(args + ["--device", "gpu0"])
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="--device 'cuda': no CUDA GPU is available here"):
            generate.main(args + ["--device", "cuda"])


@pytest.fixture(scope="module")
def randomised_decoder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny decoder of weights far from ties (`randomised`), saved in float32: its greedy text in bfloat16 is not
    its text in float32."""
    folder = tmp_path_factory.mktemp("randomised")
    tokenizer = train_tokenizer(TEXTS, "decoder", vocab_size=300, min_frequency=1)
    randomised(archlab.DecoderForCausalLM(tiny_decoder_config(vocab_size=len(tokenizer)))).save_pretrained(folder)
    save_tokenizer(tokenizer, folder)
    return folder


@pytest.mark.parametrize(
    ("value", "saved_in", "expected"),
    [
        (None, "bfloat16", torch.bfloat16),  # unset: the dtype the folder was saved in
        (None, "float32", torch.float32),
        ("auto", "bfloat16", torch.bfloat16),
        ("float32", "bfloat16", torch.float32),
        ("bfloat16", "float32", torch.bfloat16),
        ("float16", "float32", torch.float16),
    ],
)
def test_the_weights_load_in_the_dtype_asked(randomised_decoder: Path, tmp_path: Path, value, saved_in, expected):
    folder = randomised_decoder
    if saved_in == "bfloat16":
        folder = tmp_path / "bfloat16"
        archlab.DecoderForCausalLM.from_pretrained(randomised_decoder).to(torch.bfloat16).save_pretrained(folder)
        save_tokenizer(archlab.tokenization.training.load_tokenizer(randomised_decoder), folder)
    model, _, _ = load_for_generation(str(folder), "cpu", value)
    assert {p.dtype for p in model.parameters()} == {expected}


@pytest.mark.parametrize("flag", ["--dtype", "--torch_dtype"])
def test_bfloat16_generates_what_the_model_converted_to_bfloat16_generates(randomised_decoder: Path, flag) -> None:
    args = ["--model_name_or_path", str(randomised_decoder), "--prompt", "def f1(x):", "--max_new_tokens", "12"]
    text = generate.main([*args, "--do_sample", "false", flag, "bfloat16"])
    tokenizer = archlab.tokenization.training.load_tokenizer(randomised_decoder)
    inputs = tokenizer("def f1(x):", return_tensors="pt")
    texts = {}
    for dtype in (torch.bfloat16, torch.float32):
        model = archlab.DecoderForCausalLM.from_pretrained(randomised_decoder).to(dtype).eval()
        ids = model.generate(**inputs, max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        texts[dtype] = tokenizer.decode(ids[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert text == texts[torch.bfloat16] != texts[torch.float32]


def test_a_dtype_outside_the_allowed_values_is_refused_before_anything_is_read(tmp_path: Path) -> None:
    for flag in ("--dtype", "--torch_dtype"):
        with pytest.raises(
            ValueError, match="--dtype 'fp16' is not supported; allowed values: auto, bfloat16, float16"
        ):
            generate.main(["--model_name_or_path", str(tmp_path / "nothing"), flag, "fp16"])


def test_errors(saved: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="holds no saved model"):
        generate.main(["--model_name_or_path", str(tmp_path / "nothing")])
    with pytest.raises(ValueError, match="does not generate text"):
        generate.main(["--model_name_or_path", str(saved["masked"])])
    beams = ["--model_name_or_path", str(saved["decoder"]), "--num_beams", "3"]
    with pytest.raises(ValueError, match="Conflicting flags: --do_sample true and --num_beams > 1"):
        generate.main([*beams, "--do_sample", "true"])
    with pytest.raises(ValueError, match="Conflicting flags: --stream true and --num_beams > 1"):
        generate.main([*beams, "--stream"])
    with pytest.raises(ValueError, match="--chat true needs a tokenizer with a chat template"):
        generate.main(["--model_name_or_path", str(saved["seq2seq"]), "--chat", "true"])
    latin1 = tmp_path / "prompt.txt"
    latin1.write_bytes("café".encode("latin-1"))
    with pytest.raises(ValueError, match="--prompt_file .* is not UTF-8 text"):
        generate.main(["--model_name_or_path", str(saved["decoder"]), "--prompt_file", str(latin1)])


@pytest.mark.parametrize("damage", ["truncated", "empty"])
def test_a_damaged_weights_file_is_named_in_one_error_line(
    saved: dict[str, Path], tmp_path: Path, capsys, damage: str
) -> None:
    import shutil

    from archlab.scripts.arguments import run_cli

    folder = tmp_path / "decoder"
    shutil.copytree(saved["decoder"], folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2] if damage == "truncated" else b"")
    with pytest.raises(SystemExit) as exit_:
        run_cli(lambda: generate.main(["--model_name_or_path", str(folder)]))
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert (
        err.startswith(f"error: --model_name_or_path {str(folder)!r}: {weights} is damaged or not a safetensors file")
        and err.count("\n") == 1
    )


def test_a_peft_adapter_folder_is_named_as_one(tmp_path: Path) -> None:
    """A LoRA adapter folder was "a folder that holds no saved model (config.json)", which does not say why."""
    (tmp_path / "adapter_config.json").write_text('{"peft_type": "LORA"}')
    with pytest.raises(ValueError, match="holds a PEFT adapter \\(adapter_config.json\\), not a whole model: merge it"):
        generate.main(["--model_name_or_path", str(tmp_path)])


def test_a_folder_without_tokenizer_files_is_named(saved: dict[str, Path], tmp_path: Path) -> None:
    import shutil

    folder = tmp_path / "no_tokenizer"
    folder.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(saved["decoder"] / name, folder / name)
    with pytest.raises(FileNotFoundError, match="--model_name_or_path '.*no_tokenizer' holds no tokenizer"):
        generate.main(["--model_name_or_path", str(folder)])


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("--top_p", "2", r"--top_p must be in \(0, 1\], got 2.0"),
        ("--top_p", "0", r"--top_p must be in \(0, 1\], got 0.0"),
        ("--top_k", "-1", "--top_k must be >= 0"),
        ("--repetition_penalty", "0", "--repetition_penalty must be > 0"),
        ("--num_beams", "0", "--num_beams must be >= 1"),
        # numpy's traceback from set_seed, after the model was loaded
        ("--seed", "-1", r"--seed must be in \[0, 2\*\*32 - 1\] \(numpy's seeds\), got -1"),
        # the prompt was --prompt's default without a word
        ("--prompt_file", "", "--prompt_file is an empty string: give a value, or leave the flag out"),
    ],
)
def test_out_of_range_values_fail_before_loading(tmp_path: Path, flag: str, value: str, message: str) -> None:
    (tmp_path / "config.json").write_text("{}")  # check() runs before any model or tokenizer is read
    with pytest.raises(ValueError, match=message):
        generate.main(["--model_name_or_path", str(tmp_path), flag, value, "--do_sample", "false"])


def test_bad_input_is_one_error_line_not_a_traceback(tmp_path, capsys):
    """The scripts' command-line entry: archlab's own input errors print `error: ...` and exit 2 (as argparse does);
    an error raised inside another library keeps its traceback."""
    import json

    from archlab.scripts.arguments import run_cli

    with pytest.raises(SystemExit) as exit_:
        run_cli(lambda: generate.main(["--model_name_or_path", str(tmp_path / "nowhere")]))
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --model_name_or_path ") and "holds no saved model" in err
    with pytest.raises(json.JSONDecodeError):
        run_cli(lambda: json.loads("{"))


def test_command_line_error_exit_code(tmp_path, monkeypatch, capsys):
    """The script file run as a program (`python scripts/generate.py ...`, here through runpy in this process: a
    fresh interpreter costs ~10 s of imports): a bad argument is one error line and exit status 2."""
    import runpy

    script = REPO / "scripts" / "generate.py"
    monkeypatch.setattr("sys.argv", [str(script), "--model_name_or_path", str(tmp_path / "nowhere")])
    with pytest.raises(SystemExit) as exit_status:
        runpy.run_path(str(script), run_name="__main__")
    assert exit_status.value.code == 2
    printed = capsys.readouterr().err
    assert "Traceback" not in printed
    assert "error: --model_name_or_path" in printed and "holds no saved model (config.json)" in printed


def short_table_folder(saved: dict[str, Path], kind: str, folder: Path, **config) -> Path:
    """`saved[kind]`'s tokenizer with a new model of 16 positions."""
    tokenizer = archlab.tokenization.training.load_tokenizer(saved[kind])
    torch.manual_seed(0)
    if kind == "decoder":
        model = archlab.DecoderForCausalLM(tiny_decoder_config(vocab_size=len(tokenizer), **config))
    else:
        model = archlab.Seq2SeqForConditionalGeneration(tiny_seq2seq_config(vocab_size=len(tokenizer), **config))
    model.save_pretrained(folder)
    save_tokenizer(tokenizer, folder)
    return folder


@pytest.mark.parametrize("kind", ["decoder", "seq2seq"])
def test_max_new_tokens_past_a_position_table_is_refused_before_generating(
    saved: dict[str, Path], tmp_path: Path, kind: str, capsys
) -> None:
    """A learned or sinusoidal table of 16 positions: --max_new_tokens 30 printed the prompt and the first tokens,
    then failed at the step that crossed the table with an error that named no flag. It is refused first, with the
    largest value that fits, which runs; RoPE (no table) runs past with a warning."""
    table = {"position_embedding_type": "learned"} if kind == "decoder" else {}
    folder = short_table_folder(saved, kind, tmp_path / kind, max_position_embeddings=16, **table)
    prompt = "def f1(x):"
    tokenizer = archlab.tokenization.training.load_tokenizer(folder)
    length = len(tokenizer(prompt)["input_ids"])
    most = 16 if kind == "seq2seq" else 16 + 1 - length
    args = ["--model_name_or_path", str(folder), "--prompt", prompt, "--do_sample", "false", "--device", "cpu"]
    capsys.readouterr()
    with pytest.raises(ValueError, match=f"--max_new_tokens 30 is past the model's .* give --max_new_tokens {most} or"):
        generate.main([*args, "--max_new_tokens", "30"])
    assert prompt not in capsys.readouterr().out  # nothing was printed
    with pytest.raises(ValueError, match=f"--max_new_tokens {most + 1} is past"):
        generate.main([*args, "--max_new_tokens", str(most + 1), "--stream", "false"])
    generate.main([*args, "--max_new_tokens", str(most), "--stream", "false"])
    assert f"] {most} tokens generated" in capsys.readouterr().out
    if kind == "decoder":
        rope = short_table_folder(saved, kind, tmp_path / "rope", max_position_embeddings=16)
        args[1] = str(rope)
        generate.main([*args, "--max_new_tokens", "30", "--stream", "false"])
        assert "] 30 tokens generated" in capsys.readouterr().out


def test_a_seq2seq_folder_s_task_prefix_goes_before_the_source(saved: dict[str, Path], tmp_path: Path, monkeypatch):
    """A folder fine-tuned with --source_prefix keeps it in `task_specific_params[task]["prefix"]`: generate.py left
    it out of the source. One stored prefix is used; --source_prefix gives another ("": none); several need the flag;
    a decoder refuses it."""
    import json
    import shutil

    from archlab.scripts import generate as script

    folder = tmp_path / "seq2seq"
    shutil.copytree(saved["seq2seq"], folder)
    config = json.loads((folder / "config.json").read_text())
    params = {"summarization": {"prefix": "summarize: "}}
    (folder / "config.json").write_text(json.dumps({**config, "task_specific_params": params}))
    sources = []
    monkeypatch.setattr(script, "generate_text", lambda model, tokenizer, prompt, **kwargs: sources.append(prompt))
    base = ["--model_name_or_path", str(folder), "--prompt", "def f(x): return x", "--device", "cpu"]
    script.main(base)
    script.main([*base, "--source_prefix", ""])
    script.main([*base, "--source_prefix", "explain: "])
    assert sources == ["summarize: def f(x): return x", "def f(x): return x", "explain: def f(x): return x"]
    params["translation_en_to_de"] = {"prefix": "translate English to German: "}
    (folder / "config.json").write_text(json.dumps({**config, "task_specific_params": params}))
    with pytest.raises(ValueError, match="several tasks .* pass --source_prefix with the one the prompt needs"):
        script.main(base)
    with pytest.raises(ValueError, match="--source_prefix goes before a seq2seq model's source; this folder holds a"):
        script.main(["--model_name_or_path", str(saved["decoder"]), "--source_prefix", "summarize: "])


@pytest.mark.parametrize("kind", ["decoder", "learned", "seq2seq"])
def test_several_prompts_are_one_batch_that_gives_each_its_own_greedy_text(
    saved: dict[str, Path], tmp_path: Path, kind: str, capsys
) -> None:
    """Several prompts of different lengths (`--prompt A B C`, `--prompts_file`): one left-padded batch (a decoder's)
    whose texts, printed in order, are each prompt's greedy text alone. There was no way to give several: a second
    `--prompt` silently replaced the first."""
    folder = saved["seq2seq" if kind == "seq2seq" else "decoder"]
    if kind == "learned":
        folder = short_table_folder(saved, "decoder", tmp_path / kind, position_embedding_type="learned")
    prompts = ["def f1(x):", "def f22(x):\n    return x + 22\n", "d"]
    args = ["--model_name_or_path", str(folder), "--max_new_tokens", "8", "--do_sample", "false", "--device", "cpu"]
    alone = [generate.main([*args, "--prompt", prompt, "--stream", "false"]) for prompt in prompts]
    capsys.readouterr()
    assert generate.main([*args, "--prompt", *prompts]) == alone
    printed = capsys.readouterr().out
    assert [printed.index(f"=== {k}/3") for k in (1, 2, 3)] == sorted(printed.index(f"=== {k}/3") for k in (1, 2, 3))
    lines = tmp_path / "prompts.jsonl"
    lines.write_text("\n".join(json.dumps(prompt) for prompt in prompts) + "\n\n")
    assert generate.main([*args, "--prompts_file", str(lines)]) == alone
    with pytest.raises(ValueError, match="--prompt was given 2 times, and the last would replace the others"):
        generate.main([*args, "--prompt", prompts[0], "--prompt", prompts[1]])
    with pytest.raises(ValueError, match="Conflicting flags: --stream true and 3 prompts"):
        generate.main([*args, "--prompt", *prompts, "--stream", "true"])


def test_a_prompts_file_holds_a_prompt_a_line_or_chat_conversations(saved: dict[str, Path], tmp_path: Path) -> None:
    """--prompts_file: one prompt a line (blank lines skipped), or JSON Lines of strings and, with --chat, whole
    conversations, each answered as `apply_chat_template(..., add_generation_prompt=True)` renders it alone."""
    args = ["--model_name_or_path", str(saved["decoder"]), "--max_new_tokens", "6", "--do_sample", "false"]
    text = tmp_path / "prompts.txt"
    text.write_text("def f1(x):\n\nd\n")
    assert generate.main([*args, "--prompts_file", str(text)]) == generate.main([*args, "--prompt", "def f1(x):", "d"])
    conversation = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "add one"}]
    chats = tmp_path / "chats.jsonl"
    chats.write_text(json.dumps("add one") + "\n" + json.dumps(conversation) + "\n")
    model, tokenizer, _ = load_for_generation(str(saved["decoder"]), "cpu")
    expected = []
    for messages in ([conversation[1]], conversation):
        inputs = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_dict=True, return_tensors="pt"
        )
        ids = model.generate(
            **inputs, max_new_tokens=6, do_sample=False, eos_token_id=stop_token_ids(model, tokenizer, chat=True)
        )[0, inputs["input_ids"].shape[1] :]
        expected.append(tokenizer.decode(ids, skip_special_tokens=True))
    assert generate.main([*args, "--chat", "true", "--prompts_file", str(chats)]) == expected
    with pytest.raises(ValueError, match="holds conversations .*: add --chat true"):
        generate.main([*args, "--prompts_file", str(chats)])
    (tmp_path / "bad.jsonl").write_text('"a"\n{"text": "b"}\n')
    with pytest.raises(ValueError, match="line 2: a prompt is a JSON string or a list of"):
        generate.main([*args, "--prompts_file", str(tmp_path / "bad.jsonl")])
    with pytest.raises(ValueError, match="Conflicting flags: --prompt_file .* and --prompts_file"):
        generate.main([*args, "--prompts_file", str(text), "--prompt_file", str(text)])


def test_a_prompts_file_row_gives_its_tools_to_the_chat_template(saved: dict[str, Path], tmp_path, monkeypatch):
    """A conversation with its tools as a training row holds them (`{"messages": ..., "tools": ...}`, TRL's layout,
    the tools a list or a JSON string) is rendered with its tools, nulls included, as finetune.py's instruct task
    renders the row: generate.py had no way to give tools, so a model tuned with them was asked without the tools'
    turn it was trained on. A row of another layout is refused, naming its line."""
    tool = {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {"type": "object", "properties": {"x": {"type": ["integer", "null"], "default": None}}},
        },
    }
    messages = [{"role": "user", "content": "add one"}]
    rows = [{"messages": messages, "tools": [tool]}, {"messages": messages, "tools": json.dumps([tool])}, messages]
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps(row) + "\n" for row in rows))
    prompts = []
    generate_ids = archlab.DecoderForCausalLM.generate
    monkeypatch.setattr(
        archlab.DecoderForCausalLM, "generate", lambda self, **kw: prompts.append(kw) or generate_ids(self, **kw)
    )
    args = ["--model_name_or_path", str(saved["decoder"]), "--max_new_tokens", "2", "--do_sample", "false"]
    generate.main([*args, "--chat", "true", "--prompts_file", str(chats)])
    tokenizer = archlab.tokenization.training.load_tokenizer(saved["decoder"])
    batch = prompts[0]
    for ids, mask, tools in zip(batch["input_ids"], batch["attention_mask"], ([tool], [tool], None)):
        expected = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True)["input_ids"]
        assert ids[mask.bool()].tolist() == expected
    assert '"default": null' in tokenizer.decode(batch["input_ids"][0])
    for bad in ({"messages": messages, "tools": 3}, {"messages": [], "tools": [tool]}, {"messages": messages, "x": 1}):
        chats.write_text(json.dumps(bad) + "\n")
        with pytest.raises(ValueError, match=r"line 1: a prompt is a JSON string or a list of .*\"tools\""):
            generate.main([*args, "--chat", "true", "--prompts_file", str(chats)])


@pytest.mark.parametrize(
    "call, message",
    [
        ({"function": {"arguments": {}}}, r"line 2, message 2 has a tool call .* without a name"),
        (
            {"function": {"name": "f", "arguments": "{'a': 1}"}},
            r"line 2, message 2 has a tool call of 'f' whose .* JSON",
        ),
        (
            {"function": {"name": "f", "arguments": 3}},
            r"line 2, message 2 has a tool call of 'f' whose arguments are 3",
        ),
    ],
)
@pytest.mark.parametrize("with_tools", [False, True])
def test_a_prompts_file_tool_call_is_checked_as_training_checks_it(call, message, with_tools, saved, tmp_path):
    """A conversation's tool calls in --prompts_file went to the chat template unchecked (finetune.py's instruct
    task checks its rows'): one without a name failed there, arguments that are not JSON were rendered as they
    stood. Each is refused naming the file's line and the message, before the model loads."""
    messages = [
        {"role": "user", "content": "add one"},
        {"role": "assistant", "content": None, "tool_calls": [{"type": "function", **call}]},
        {"role": "tool", "content": "2"},
    ]
    good = [{"role": "user", "content": "add one"}]
    chats = tmp_path / "chats.jsonl"
    bad = {"messages": messages, "tools": None} if with_tools else messages
    chats.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    args = ["--model_name_or_path", str(saved["decoder"]), "--chat", "true", "--prompts_file", str(chats)]
    with pytest.raises(ValueError, match=message):
        generate.main([*args, "--max_new_tokens", "2", "--do_sample", "false"])


@pytest.mark.parametrize(
    "message, error",
    [
        ({"role": "assistant", "content": None}, r"line 2, message 2 has a message whose content is None; .* text"),
        ({"role": "assistant"}, r"line 2, message 2 has a message \{'role': 'assistant'\} without a \"role\" and a"),
        (
            {"role": "user", "content": [{"type": "image", "url": "x.png"}]},
            r"line 2, message 2 has a message whose content is \[\{'type': 'image'.*images and other parts are not",
        ),
    ],
)
def test_a_prompts_file_message_is_checked_as_training_checks_it(message, error, saved, tmp_path):
    """A message with `"content": null` and no tool calls (or no content at all), which finetune.py's instruct task
    refuses in a training row, went to the chat template, which rendered an empty turn: each message of a
    --prompts_file conversation is checked as training checks it, named by line and message, before the model
    loads. A conversation ending with the user's turn (no assistant turn yet, the usual prompt) or with the
    assistant's words left open (continued from them) is accepted."""
    good = [{"role": "user", "content": "add one"}]
    bad = [{"role": "user", "content": "add one"}, message, {"role": "user", "content": "again"}]
    chats = tmp_path / "chats.jsonl"
    chats.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    args = ["--model_name_or_path", str(saved["decoder"]), "--chat", "true", "--prompts_file", str(chats)]
    args += ["--max_new_tokens", "2", "--do_sample", "false"]
    with pytest.raises(ValueError, match=rf"--prompts_file '{re.escape(str(chats))}', {error}"):
        generate.main(args)
    with_a_call = {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": {}}}]}
    answered = [*good, with_a_call, {"role": "tool", "content": "2"}, {"role": "user", "content": "thanks"}]
    left_open = [*good, {"role": "assistant", "content": "def add_one(x):"}]
    rows = (good, {"messages": answered, "tools": None}, left_open)
    chats.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert len(generate.main(args)) == 3


def test_a_seq2seq_folder_given_conversations_names_the_chat_flag_or_template(saved: dict[str, Path], tmp_path):
    """Conversations for a seq2seq folder failed with "can only concatenate str (not "list") to str" (the source
    prefix went before them before they were checked): without --chat they are refused naming the flag, with it
    naming the chat template the seq2seq tokenizer lacks."""
    chats = tmp_path / "chats.jsonl"
    chats.write_text(json.dumps([{"role": "user", "content": "add one"}]) + "\n")
    args = ["--model_name_or_path", str(saved["seq2seq"]), "--prompts_file", str(chats), "--max_new_tokens", "2"]
    with pytest.raises(ValueError, match="holds conversations .*: add --chat true"):
        generate.main(args)
    with pytest.raises(ValueError, match="needs a tokenizer with a chat template"):
        generate.main([*args, "--chat", "true"])


def stock_folder(saved: dict[str, Path], family: str, folder: Path) -> Path:
    """A tiny stock GPT-2, OPT, Marian or Bart with 16 positions and `saved`'s tokenizer of its kind."""
    import transformers

    kind = "decoder" if family in ("gpt2", "opt") else "seq2seq"
    tokenizer = archlab.tokenization.training.load_tokenizer(saved[kind])
    size, ids = dict(num_hidden_layers=2, num_attention_heads=4), dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
    pair = dict(d_model=32, encoder_layers=1, decoder_layers=1, encoder_ffn_dim=32, decoder_ffn_dim=32, **ids)
    pair.update(encoder_attention_heads=4, decoder_attention_heads=4, decoder_start_token_id=0)
    model = {
        "gpt2": lambda: transformers.GPT2LMHeadModel(
            transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=16, **ids, vocab_size=len(tokenizer))
        ),
        "opt": lambda: transformers.OPTForCausalLM(
            transformers.OPTConfig(
                hidden_size=32,
                ffn_dim=32,
                max_position_embeddings=16,
                word_embed_proj_dim=32,
                **size,
                **ids,
                vocab_size=len(tokenizer),
            )
        ),
        "marian": lambda: transformers.MarianMTModel(
            transformers.MarianConfig(max_position_embeddings=16, vocab_size=len(tokenizer), **pair)
        ),
        "bart": lambda: transformers.BartForConditionalGeneration(
            transformers.BartConfig(
                max_position_embeddings=16, vocab_size=len(tokenizer), **pair, forced_eos_token_id=None
            )
        ),
    }[family]()
    model.save_pretrained(folder)
    save_tokenizer(tokenizer, folder)
    return folder


@pytest.mark.parametrize("family", ["gpt2", "opt", "marian", "bart"])
def test_a_stock_folder_generates_and_its_position_table_is_checked_first(
    saved: dict[str, Path], tmp_path: Path, family: str, capsys
) -> None:
    """GPT-2 (`GPT2LMHeadModel`) and Marian (`MarianMTModel`) folders were refused as models that "do not generate
    text"; OPT and Bart generated, and past their 16 positions failed with an `IndexError` at the step that crossed
    them, after the text so far was printed. Each generates, and --max_new_tokens past the table is refused first
    with the largest value that fits, which runs to its end."""
    folder = stock_folder(saved, family, tmp_path / family)
    seq2seq = family in ("marian", "bart")
    length = len(archlab.tokenization.training.load_tokenizer(folder)("def f1(x):")["input_ids"])
    most = 16 if seq2seq else 16 + 1 - length
    args = ["--model_name_or_path", str(folder), "--prompt", "def f1(x):", "--do_sample", "false", "--device", "cpu"]
    capsys.readouterr()
    with pytest.raises(ValueError, match=f"--max_new_tokens {most + 1} is past the model's .* {most} or fewer"):
        generate.main([*args, "--max_new_tokens", str(most + 1)])
    assert "def f1(x):" not in capsys.readouterr().out  # nothing was printed
    model, tokenizer, is_seq2seq = load_for_generation(str(folder), "cpu")
    assert is_seq2seq == seq2seq
    inputs = tokenizer("def f1(x):", return_tensors="pt", return_token_type_ids=False)
    model.generate(**inputs, max_new_tokens=most, min_new_tokens=most, do_sample=False, pad_token_id=0)  # it fits
    assert isinstance(generate.main([*args, "--max_new_tokens", str(most), "--stream", "false"]), str)


def test_num_return_sequences_gives_that_many_texts_a_prompt_in_order(saved: dict[str, Path]) -> None:
    """`--num_return_sequences N` (GenerationConfig's; the flag was unknown): N texts a prompt, prompt after prompt,
    as `generate` returns them (sampled with the seed, or a beam search's best); greedy decoding, which has one text
    to give, is refused before loading with the flags that would give N."""
    model, tokenizer, _ = load_for_generation(str(saved["decoder"]), "cpu")
    prompts = ["def f1(x):", "d"]
    args = ["--model_name_or_path", str(saved["decoder"]), "--max_new_tokens", "5", "--prompt", *prompts]
    for flags, settings in (
        (["--num_beams", "3", "--num_return_sequences", "2"], dict(num_beams=3, do_sample=False)),
        (["--num_return_sequences", "2", "--seed", "5"], dict(do_sample=True, temperature=0.8, top_k=40, top_p=0.95)),
    ):
        inputs = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left", return_token_type_ids=False)
        torch.manual_seed(5)
        ids = model.generate(**inputs, max_new_tokens=5, num_return_sequences=2, pad_token_id=0, **settings)
        expected = tokenizer.batch_decode(ids[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
        assert generate.main([*args, *flags]) == expected, flags
    with pytest.raises(ValueError, match="--num_return_sequences 2 needs .* \\(--do_sample true\\) or .* 2 or more"):
        generate.main([*args, "--num_return_sequences", "2", "--do_sample", "false"])
    with pytest.raises(ValueError, match="Conflicting flags: --stream true and --num_return_sequences > 1"):
        generate.main([*args[:4], "--num_return_sequences", "2", "--stream", "true"])


def test_a_conversation_that_ends_with_the_assistant_s_words_is_continued(saved: dict[str, Path], tmp_path) -> None:
    """A conversation whose last message is the assistant's is continued from its words, as transformers'
    text-generation pipeline continues it (`continue_final_message`): generate.py opened a new assistant turn after
    the finished one."""
    conversation = [{"role": "user", "content": "add one"}, {"role": "assistant", "content": "return x"}]
    chats = tmp_path / "chats.jsonl"
    chats.write_text(json.dumps(conversation) + "\n" + json.dumps(conversation[:1]) + "\n")
    model, tokenizer, _ = load_for_generation(str(saved["decoder"]), "cpu")
    inputs = tokenizer.apply_chat_template(
        conversation, continue_final_message=True, return_dict=True, return_tensors="pt"
    )
    assert tokenizer.decode(inputs["input_ids"][0]).endswith("<|im_start|>assistant\nreturn x")
    ids = model.generate(
        **inputs, max_new_tokens=6, do_sample=False, eos_token_id=stop_token_ids(model, tokenizer, chat=True)
    )
    expected = tokenizer.decode(ids[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    args = ["--model_name_or_path", str(saved["decoder"]), "--max_new_tokens", "6", "--do_sample", "false"]
    assert generate.main([*args, "--chat", "true", "--prompts_file", str(chats)])[0] == expected


def test_output_file_holds_each_prompt_and_its_texts_as_json_lines(saved: dict[str, Path], tmp_path: Path) -> None:
    """--output_file: the texts printed, as JSON Lines of {"prompt", "generated_text"} in the same order (one prompt,
    several, several texts a prompt); a folder, or a file in a folder that does not exist, is refused before
    loading."""
    out = tmp_path / "out.jsonl"
    args = ["--model_name_or_path", str(saved["decoder"]), "--max_new_tokens", "4", "--output_file", str(out)]
    for flags, prompts in (
        (["--prompt", "def f1(x):", "--do_sample", "false"], ["def f1(x):"]),
        (["--prompt", "a", "bc", "--num_return_sequences", "2"], ["a", "a", "bc", "bc"]),
    ):
        texts = generate.main([*args, *flags])
        texts = [texts] if isinstance(texts, str) else texts
        records = [json.loads(line) for line in out.read_text().splitlines()]
        assert records == [{"prompt": p, "generated_text": t} for p, t in zip(prompts, texts, strict=True)]
    for where in (tmp_path, tmp_path / "nowhere" / "out.jsonl"):
        (tmp_path / "config.json").write_text("{}")
        with pytest.raises(ValueError, match="--output_file .* is a folder or in a folder that does not exist"):
            generate.main(["--model_name_or_path", str(tmp_path), "--output_file", str(where)])


def test_a_prompt_of_no_tokens_is_refused_by_name(saved: dict[str, Path], tmp_path: Path) -> None:
    """A tokenizer that adds no bos (GPT-2's) reads `--prompt ""` as no token at all: `generate` failed inside the
    model with "cannot reshape tensor of 0 elements" after loading it; the prompt is now named."""
    import shutil

    from tokenizers import processors

    folder = tmp_path / "no_bos"
    shutil.copytree(saved["decoder"], folder)
    tokenizer = archlab.tokenization.training.load_tokenizer(folder)
    tokenizer.backend_tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    save_tokenizer(tokenizer, folder)
    assert archlab.tokenization.training.load_tokenizer(folder)("")["input_ids"] == []
    args = ["--model_name_or_path", str(folder), "--max_new_tokens", "3", "--do_sample", "false"]
    with pytest.raises(ValueError, match="Prompt 2 \\(''\\) is no token at all for this tokenizer"):
        generate.main([*args, "--prompt", "def", ""])
    with pytest.raises(ValueError, match="Prompt 1 \\(''\\) is no token at all"):
        generate.main([*args, "--prompt", ""])
