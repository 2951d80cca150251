"""scripts/push_to_hub.py: the dry-run folder is exactly the upload, loads without archlab, and its card's usage
snippet runs; without a token or network the push fails fast and leaves nothing; the live path (against a recording
stand-in for `HfApi`, the Hub being unreachable here) makes one commit and undoes what it created on failure."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from archlab import DecoderForCausalLM
from archlab.scripts import push_to_hub
from archlab.training import hub as training_hub

from helpers import tiny_decoder_config
from isolated import check, run_without_archlab

REPO = "someone/tiny-archlab"
WORDS = "def return if else for in while fibonacci n x y ( ) : + - * 1 2 = ==".split()


def _tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{word: i + 4 for i, word in enumerate(WORDS)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


@pytest.fixture
def trained(tmp_path) -> tuple[Path, DecoderForCausalLM]:
    """What a training run leaves: model, tokenizer, Trainer logs -- and pickles and checkpoints that must stay."""
    folder = tmp_path / "run"
    model = DecoderForCausalLM(tiny_decoder_config()).eval()
    model.save_pretrained(folder)
    _tokenizer().save_pretrained(folder)
    history = [{"step": s, "loss": 4.0 - s / 10} for s in (5, 10, 15)] + [{"step": 15, "eval_loss": 2.75}]
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": 15, "epoch": 1.0, "log_history": history}))
    (folder / "training_args.json").write_text(json.dumps({"learning_rate": 3e-4, "seed": 42}))
    torch.save({"lr": 3e-4}, folder / "training_args.bin")
    torch.save({}, folder / "optimizer.pt")
    (folder / "checkpoint-10").mkdir()
    (folder / "checkpoint-10" / "config.json").write_text("{}")
    return folder, model


@contextmanager
def one_thread():
    """The isolated interpreter runs with one thread; so does the in-process reference (bit-identical sums)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _files(folder: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir())}


def _dry_run(folder: Path, out: Path, *extra: str) -> int:
    return push_to_hub.main([str(folder), REPO, "--dry-run", str(out), "--datasets", "python-stdlib", *extra])


def test_dry_run_writes_exactly_the_upload_set(trained, tmp_path):
    folder, model = trained
    assert _dry_run(folder, tmp_path / "upload") == 0
    names = set(_files(tmp_path / "upload"))
    code = {path.name for path in folder.glob("*.py")}
    assert names == code | {
        "README.md",
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "trainer_state.json",
        "training_args.json",
        "loss_curve.png",
    } | ({"special_tokens_map.json"} & set(os.listdir(folder)))
    card = (tmp_path / "upload" / "README.md").read_text()
    assert f'model_id = "{REPO}"' in card and "python-stdlib" in card
    assert load_file(tmp_path / "upload" / "model.safetensors").keys() == load_file(folder / "model.safetensors").keys()


def test_dry_run_is_deterministic(trained, tmp_path):
    folder, _ = trained
    assert _dry_run(folder, tmp_path / "a") == 0
    assert _dry_run(folder, tmp_path / "b") == 0
    assert _files(tmp_path / "a") == _files(tmp_path / "b")


def test_dry_run_cards_snippet_loads_the_repo(trained, tmp_path):
    """(That the dry run loads without archlab and its snippet runs is checked in a fresh interpreter on a real
    training run's folder: test_pretrain_output_pushes_and_loads_anywhere.)"""
    folder, _ = trained
    assert _dry_run(folder, tmp_path / "upload") == 0
    snippet = re.search(r"```python\n(.*?)```", (tmp_path / "upload" / "README.md").read_text(), re.S).group(1)
    assert "from_pretrained(model_id, trust_remote_code=True)" in snippet and f'"{REPO}"' in snippet


def test_a_pure_bfloat16_runs_card_keeps_its_weights_dtype_through_a_push(trained, tmp_path):
    """The card of a run that trained bfloat16 weights (`--dtype bfloat16`) says so from the run's `run_facts.json`;
    the push re-renders the card from the staged folder, so the file goes with the Trainer logs."""
    folder, model = trained
    model.to(torch.bfloat16).save_pretrained(folder)
    (folder / "run_facts.json").write_text(json.dumps({"examples_per_step": 4, "weights_dtype": "bfloat16"}))
    assert _dry_run(folder, tmp_path / "upload") == 0
    assert (tmp_path / "upload" / "run_facts.json").read_bytes() == (folder / "run_facts.json").read_bytes()
    assert "**Weights:** trained in bfloat16 (pure bfloat16" in (tmp_path / "upload" / "README.md").read_text()


def test_a_sentence_pair_classifiers_card_keeps_its_pair_through_a_push(tmp_path):
    """The card of a classifier of sentence pairs (finetune.py's --text_column_names a,b) tokenizes a pair; the push
    re-renders the card from the folder, whose config does not say so, and the snippet became a single text."""
    from archlab import DecoderForSequenceClassification
    from archlab.model_cards import write_model_card

    folder = tmp_path / "pairs"
    DecoderForSequenceClassification(tiny_decoder_config(num_labels=2)).save_pretrained(folder)
    _tokenizer().save_pretrained(folder)
    write_model_card(folder, example_text="def f ( x ) :", example_pair="return x + 1")
    assert _dry_run(folder, tmp_path / "upload") == 0
    snippet = re.search(r"```python\n(.*?)```", (tmp_path / "upload" / "README.md").read_text(), re.S).group(1)
    assert "inputs = tokenizer('def f ( x ) :', 'return x + 1', return_tensors=" in snippet


def test_dry_run_refuses_a_non_empty_target(trained, tmp_path, capsys):
    folder, _ = trained
    (tmp_path / "upload").mkdir()
    (tmp_path / "upload" / "keep.txt").write_text("mine")
    assert _dry_run(folder, tmp_path / "upload") == 2
    assert "not empty" in capsys.readouterr().err
    assert _files(tmp_path / "upload") == {"keep.txt": b"mine"}
    (tmp_path / "a_file").write_text("mine")
    assert _dry_run(folder, tmp_path / "a_file") == 2
    assert "is a file; give a folder" in capsys.readouterr().err


def test_failed_dry_run_leaves_nothing(trained, tmp_path, capsys):
    folder, _ = trained
    (folder / "model.safetensors").unlink()  # only pickled weights remain: refused
    out = tmp_path / "out" / "upload"
    assert _dry_run(folder, out) == 2
    assert "use_safetensors=False" in capsys.readouterr().err
    assert not out.exists() and os.listdir(out.parent) == []


def test_dry_run_refuses_a_quantized_folder_naming_it(trained, tmp_path, capsys):
    """transformers cannot save a quantized model it loaded: staging one failed with a bare "NotImplementedError: "."""
    folder, _ = trained
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (folder / "config.json").write_text(json.dumps(config))
    assert _dry_run(folder, tmp_path / "upload") == 2
    error = capsys.readouterr().err
    assert "holds a quantized model (quant_method='bitsandbytes')" in error and "unquantized folder" in error, error
    assert not (tmp_path / "upload").exists()


def test_dry_run_refuses_weights_that_do_not_match_the_config(trained, tmp_path, capsys):
    """A checkpoint missing a weight would be uploaded with it freshly initialised (exit 0 before); a config whose
    shapes the weights do not fit failed as "the upload failed, nothing was left on the Hub" in a dry run. Both are
    refused before anything is written, naming the problem."""
    folder, _ = trained
    weights = load_file(folder / "model.safetensors")
    del weights["lm_head.weight"]
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "out" / "upload"
    assert _dry_run(folder, out) == 2
    assert "missing keys: lm_head.weight" in capsys.readouterr().err
    assert not out.exists() and os.listdir(out.parent) == []

    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    assert _dry_run(folder, out) == 2
    err = capsys.readouterr().err
    assert "Cannot load the model" in err and "upload failed" not in err
    assert not out.exists() and os.listdir(out.parent) == []


class RecordingHub:
    """Stands in for `HfApi`: records calls, snapshots the uploaded folder, can fail the upload."""

    def __init__(self, existing: bool = False, public: bool = False, fail_upload: bool = False, branches=("main",)):
        self.calls: list[tuple[str, dict]] = []
        self.existing, self.public, self.fail_upload, self.branches = existing, public, fail_upload, branches
        self.uploaded: dict[str, bytes] = {}

    def _record(self, name, **kwargs):
        self.calls.append((name, kwargs))

    def whoami(self, token=None):
        self._record("whoami", token=token)
        return {"name": "someone"}

    def repo_exists(self, repo_id, token=None):
        return self.existing

    def repo_info(self, repo_id, token=None, timeout=None):
        return SimpleNamespace(private=not self.public)

    def list_repo_refs(self, repo_id, token=None):
        return SimpleNamespace(branches=[SimpleNamespace(name=name) for name in self.branches])

    def create_repo(self, repo_id, **kwargs):
        self._record("create_repo", repo_id=repo_id, **kwargs)

    def create_branch(self, repo_id, **kwargs):
        self._record("create_branch", repo_id=repo_id, **kwargs)

    def upload_folder(self, **kwargs):
        self._record("upload_folder", **kwargs)
        if self.fail_upload:
            raise ConnectionError("connection reset")
        self.uploaded = _files(Path(kwargs["folder_path"]))
        return SimpleNamespace(commit_url=f"https://huggingface.co/{kwargs['repo_id']}/commit/0")

    def delete_repo(self, repo_id, **kwargs):
        self._record("delete_repo", repo_id=repo_id)

    def delete_branch(self, repo_id, **kwargs):
        self._record("delete_branch", repo_id=repo_id, **kwargs)


def _live(folder: Path, hub: RecordingHub, *extra: str) -> int:
    return push_to_hub.main(
        [str(folder), REPO, "--token", "hf_test", "--datasets", "python-stdlib", *extra], api_factory=lambda: hub
    )


def test_live_push_uploads_the_dry_run_in_one_commit(trained, tmp_path, monkeypatch):
    monkeypatch.setattr(training_hub, "is_offline_mode", lambda: False)
    folder, _ = trained
    hub = RecordingHub()
    assert _live(folder, hub, "--private", "--revision", "v1", "--commit_message", "first model") == 0
    assert [name for name, _ in hub.calls] == ["whoami", "create_repo", "create_branch", "upload_folder"]
    calls = dict(hub.calls)
    assert calls["create_repo"]["private"] is True
    assert calls["create_branch"]["branch"] == "v1"
    assert calls["upload_folder"]["revision"] == "v1" and calls["upload_folder"]["commit_message"] == "first model"
    assert _dry_run(folder, tmp_path / "upload", "--private") == 0
    assert hub.uploaded == _files(tmp_path / "upload")


@pytest.mark.parametrize("existing", [False, True], ids=["new-repo", "existing-repo"])
def test_failed_upload_removes_what_the_push_created(trained, monkeypatch, capsys, existing):
    monkeypatch.setattr(training_hub, "is_offline_mode", lambda: False)
    folder, _ = trained
    hub = RecordingHub(existing=existing, fail_upload=True)
    assert _live(folder, hub, "--revision", "v2") == 1
    assert "nothing was left" in capsys.readouterr().err
    undo = [(name, kwargs.get("branch")) for name, kwargs in hub.calls if name.startswith("delete")]
    assert undo == ([("delete_branch", "v2")] if existing else [("delete_repo", None)])


def test_private_push_into_a_public_repo_is_refused(trained, monkeypatch, capsys):
    monkeypatch.setattr(training_hub, "is_offline_mode", lambda: False)
    folder, _ = trained
    hub = RecordingHub(existing=True, public=True)
    assert _live(folder, hub, "--private") == 2
    assert "is public" in capsys.readouterr().err
    assert [name for name, _ in hub.calls] == ["whoami"]


def test_no_token_fails_before_anything(trained, monkeypatch, capsys):
    monkeypatch.setattr(training_hub, "is_offline_mode", lambda: False)
    monkeypatch.setattr(training_hub, "get_token", lambda: None)
    folder, _ = trained
    hub = RecordingHub()
    assert push_to_hub.main([str(folder), REPO], api_factory=lambda: hub) == 2
    assert "No Hugging Face token" in capsys.readouterr().err
    assert hub.calls == []


def test_bad_repo_id_fails_before_anything(trained, capsys):
    folder, _ = trained
    assert push_to_hub.main([str(folder), "no-namespace", "--dry-run", str(folder.parent / "x")]) == 2
    assert "user/name" in capsys.readouterr().err


@pytest.mark.slow  # a fresh interpreter
def test_unreachable_hub_fails_fast_and_leaves_nothing(trained, tmp_path):
    """The real client against a closed port: a clear error, exit code 2, no staging folder left behind."""
    folder, _ = trained
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    env = {key: value for key, value in os.environ.items() if not key.startswith(("HF_", "PYTEST"))}
    env.update(
        HF_TOKEN="hf_test", HF_ENDPOINT="http://127.0.0.1:9", HF_HOME=str(tmp_path / "hf_home"), TMPDIR=str(scratch)
    )
    result = subprocess.run(
        [sys.executable, "-m", "archlab.scripts.push_to_hub", str(folder), REPO],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert result.returncode == 2, result.stderr
    assert "Cannot reach the Hub at http://127.0.0.1:9" in result.stderr
    assert os.listdir(scratch) == []


@pytest.mark.slow  # a short training run and a fresh interpreter
def test_pretrain_output_pushes_and_loads_anywhere(tmp_path):
    """scripts/pretrain.py writes model, tokenizer, logs and card; the dry run of its folder loads without archlab."""
    from archlab.scripts import pretrain

    corpus = tmp_path / "train.txt"
    corpus.write_text("".join(f"def f{i}(x):\n    return x + {i}\n\n" for i in range(200)))
    run = tmp_path / "run"
    pretrain.main(
        [
            "--train_file",
            str(corpus),
            "--sample_by",
            "paragraph",
            "--tokenizer_vocab_size",
            "300",
            "--config_overrides",
            "hidden_size=32,intermediate_size=64,num_hidden_layers=2,num_attention_heads=4,num_key_value_heads=2",
            "--block_size",
            "32",
            "--max_steps",
            "3",
            "--per_device_train_batch_size",
            "4",
            "--logging_steps",
            "1",
            "--output_dir",
            str(run),
            "--report_to",
            "none",
            "--save_strategy",
            "no",
        ]
    )
    upload = tmp_path / "upload"
    assert push_to_hub.main([str(run), REPO, "--dry-run", str(upload)]) == 0
    names = set(os.listdir(upload))
    assert {"README.md", "model.safetensors", "tokenizer.json", "trainer_state.json", "loss_curve.png"} <= names
    card = (upload / "README.md").read_text()
    assert "| learning_rate |" in card and "| final training loss |" in card and "train.txt" in card
    snippet = re.search(r"```python\n(.*?)```", card, re.S).group(1).replace(f'"{REPO}"', repr(str(upload)))
    assert "AutoTokenizer.from_pretrained(model_id, trust_remote_code=True)" in snippet
    ids = torch.tensor([[1, 5, 9, 12]])
    with torch.no_grad(), one_thread():
        expected = AutoModelForCausalLM.from_pretrained(upload).eval()(ids).logits
    save_file({"ids": ids, "logits": expected}, tmp_path / "expected.safetensors")
    code = f"""
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
expected = load_file({str(tmp_path / "expected.safetensors")!r})
model = AutoModelForCausalLM.from_pretrained({str(upload)!r}, trust_remote_code=True).eval()
assert type(model).__module__.startswith("transformers_modules."), type(model).__module__
with torch.no_grad():
    assert torch.equal(model(expected["ids"]).logits, expected["logits"])
print("LOGITS-OK")
{snippet}
"""
    out = check(run_without_archlab(code, tmp_path / "isolated"))
    assert "LOGITS-OK" in out
    assert len(out.split("LOGITS-OK", 1)[1].strip()) > 0  # the snippet printed its generation
