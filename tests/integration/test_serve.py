"""`transformers serve` with an archlab decoder (modeling/serving.py): the OpenAI-compatible app answers greedy chat
and text completions, streamed or not, with the text of the model's own `generate`, with and without continuous
batching, and from the folder's remote code where archlab is not installed.

The app is the one the `transformers serve <folder>` command builds (its `Serve` class), driven through Starlette's
`TestClient`, in-process: no port is opened.
"""

from __future__ import annotations

import inspect
import json
import socket
import types

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("openai")
from starlette.testclient import TestClient
from transformers import AutoTokenizer

from archlab import DecoderForCausalLM
from archlab.tokenization.training import CHAT_TEMPLATE, IM_END, IM_START

from helpers import character_tokenizer, randomised, tiny_decoder_config
from isolated import check, run_without_archlab

NEW_TOKENS = 10
MESSAGES = [{"role": "user", "content": "hello world"}]
PROMPT = "the quick brown"
# small paged cache: the default sizes it from the free memory, slow on a CPU
CB_OPTIONS = dict(continuous_batching=True, cb_num_blocks=16, cb_max_batch_tokens=64)


@pytest.fixture(autouse=True)
def _no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError(f"the server tried to open a connection: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny decoder with a one-token-per-character tokenizer (whole characters: streamed text splits nowhere) and
    archlab's ChatML template."""
    path = tmp_path_factory.mktemp("served")
    tokenizer = character_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": [IM_START, IM_END]})
    tokenizer.chat_template = CHAT_TEMPLATE
    model = randomised(DecoderForCausalLM(tiny_decoder_config(vocab_size=len(tokenizer))))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def generated(folder) -> dict[str, str]:
    """The chat and text completions' greedy text by `model.generate`, as the server decodes it."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = DecoderForCausalLM.from_pretrained(folder).eval()
    chat = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=True, return_tensors="pt")
    text = tokenizer(PROMPT, return_tensors="pt")
    texts = {}
    for name, inputs in (("chat", chat), ("completion", text)):
        ids = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
        texts[name] = tokenizer.decode(ids[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    return texts


def ask(client, model) -> dict[str, str]:
    """Chat and text completions, greedy, whole and streamed: {name: text}. Self-contained: the run without archlab
    executes its source."""
    import json

    common = {"model": model, "max_tokens": NEW_TOKENS, "temperature": 0}
    chat = {**common, "messages": MESSAGES}
    text = {**common, "prompt": PROMPT}
    texts = {
        "chat": client.post("/v1/chat/completions", json=chat).json()["choices"][0]["message"]["content"],
        "completion": client.post("/v1/completions", json=text).json()["choices"][0]["text"],
    }
    for name, route, body, field in (
        ("chat", "/v1/chat/completions", chat, lambda choice: choice["delta"].get("content")),
        ("completion", "/v1/completions", text, lambda choice: choice.get("text")),
    ):
        streamed = client.post(route, json={**body, "stream": True}).text
        events = [json.loads(line[6:]) for line in streamed.splitlines() if line.startswith("data: {")]
        texts[name + " streamed"] = "".join(field(e["choices"][0]) or "" for e in events if e.get("choices"))
    return texts


def serve_app(monkeypatch, folder, **options):
    """The `Serve` instance `transformers serve <folder> --device cpu` builds, with uvicorn's blocking run skipped."""
    import uvicorn
    from transformers.cli.serve import Serve

    monkeypatch.setattr(uvicorn.Server, "run", lambda server: None)
    return Serve(force_model=str(folder), device="cpu", **options)


@pytest.mark.parametrize("options", [{}, CB_OPTIONS], ids=["generate", "continuous-batching"])
def test_served_greedy_completions_are_generates(monkeypatch, folder, options):
    serve = serve_app(monkeypatch, folder, **options)
    try:
        with TestClient(serve.server.config.app) as client:
            texts = ask(client, str(folder))
        # the requests went through the paged-cache manager exactly when asked to
        assert (serve._generation_state._cb_model_id is not None) == bool(options)
    finally:
        serve._generation_state.shutdown()
    expected = generated(folder)
    assert texts == {**expected, **{f"{name} streamed": text for name, text in expected.items()}}
    assert all(expected.values())


@pytest.mark.slow  # a fresh interpreter that imports transformers' serving app: ~15 s
def test_served_from_remote_code_without_archlab(folder, tmp_path):
    """`transformers serve <folder> --trust-remote-code` where archlab is not installed: the folder's own code exposes
    its class to the server (the command stopped with `module transformers has no attribute DecoderForCausalLM`)."""
    script = f"""
import json, socket
socket.socket.connect = lambda *args: (_ for _ in ()).throw(AssertionError(f"connection: {{args}}"))
import uvicorn
from starlette.testclient import TestClient
from transformers.cli.serve import Serve

uvicorn.Server.run = lambda server: None
NEW_TOKENS, MESSAGES, PROMPT = {NEW_TOKENS}, {MESSAGES!r}, {PROMPT!r}
{inspect.getsource(ask)}
serve = Serve(force_model={str(folder)!r}, device="cpu", trust_remote_code=True)
with TestClient(serve.server.config.app) as client:
    print(json.dumps(ask(client, {str(folder)!r})))
    print(type(serve._model_manager.loaded_models[{str(folder)!r}].model).__module__)
"""
    *_, texts, module = check(run_without_archlab(script, tmp_path)).strip().splitlines()
    assert module.startswith("transformers_modules.")  # the folder's own code, not archlab's
    expected = generated(folder)
    assert json.loads(texts) == {**expected, **{f"{name} streamed": text for name, text in expected.items()}}


def test_a_model_manager_without_transformers_namespace_is_left_as_it_is():
    """The class goes into the namespace the model manager looks classes up in (`model_manager.transformers`); a
    manager that has none (another transformers version) is left alone, its import not failed with it."""
    from archlab.modeling.serving import expose_decoder_to_serve

    namespace = types.ModuleType("transformers")
    manager = types.ModuleType("model_manager")
    manager.transformers = namespace
    expose_decoder_to_serve(manager)
    assert namespace.DecoderForCausalLM is DecoderForCausalLM
    bare = types.ModuleType("model_manager")
    expose_decoder_to_serve(bare)
    assert vars(bare).keys() == vars(types.ModuleType("model_manager")).keys()
