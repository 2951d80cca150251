"""Pushing a saved archlab model to the Hub: the folder re-saved through archlab into a staging folder (safetensors
weights, the bundled model code and `auto_map`, tokenizer files, the JSON Trainer logs, the loss curve and a model
card whose usage snippet loads the repository), never a pickled file; a dry run that writes exactly that folder; and
a live push that checks the token and the connection first, uploads in ONE commit and deletes what it created
again if the upload fails."""

from __future__ import annotations

import fnmatch
import shutil
import tempfile
from pathlib import Path
from typing import Any

import transformers
from huggingface_hub import HfApi, ModelCard, get_token
from huggingface_hub.constants import ENDPOINT, is_offline_mode

from archlab.model_cards import write_model_card
from archlab.model_cards.card import snippet_pair
from archlab.model_cards.facts import auto_class_for, check_pipeline_tag, pipeline_tags_allowed, read_config

# copied as they are, beside what `save_pretrained` writes (config, weights, code)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.txt",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "spm.model",
    "chat_template.jinja",
)
# (run_facts.json: the training scripts' record of the run, whose weights' dtype the re-rendered card states)
LOG_FILES = (
    "trainer_state.json",
    "training_args.json",
    "run_facts.json",
    "all_results.json",
    "eval_results.json",
    "loss_curve.png",
)
PICKLE_PATTERNS = ("*.bin", "*.pt", "*.pth", "*.pkl", "*.pickle", "*.ckpt")


class PushError(RuntimeError):
    """A problem found before anything was uploaded; the message says what to do."""


def check_repo_id(repo_id: str) -> None:
    parts = repo_id.split("/")
    if len(parts) != 2 or not all(parts) or any(part.startswith((".", "-")) for part in parts):
        raise PushError(f"`repo_id`={repo_id!r} must look like `user/name` (or `org/name`).")


def _existing_card_data(folder: Path, architecture: str) -> dict[str, Any]:
    readme = folder / "README.md"
    if not readme.is_file():
        return {}
    card = ModelCard.load(readme)
    data = card.data
    pair = snippet_pair(card.text)  # a sentence-pair classifier's snippet: kept a pair
    return {
        **({"example_text": pair[0], "example_pair": pair[1]} if pair else {}),
        "base_model": data.base_model,
        "datasets": data.datasets,
        "license": data.license,
        "language": data.language,
        "eval_results": data.eval_results,
        # kept when it still fits (a summariser stays one); an older card's tag that no longer does is dropped
        "pipeline_tag": data.pipeline_tag if data.pipeline_tag in pipeline_tags_allowed(architecture) else None,
        "tags": [
            tag
            for tag in (data.tags or [])
            if tag not in ("archlab", "custom_code", "safetensors") and not tag.startswith("archlab_")
        ],
    }


def stage(folder: str | Path, out: str | Path, repo_id: str, card: dict[str, Any] | None = None) -> list[str]:
    """Write into the empty folder `out` exactly what a push of `folder` to `repo_id` uploads; returns file names."""
    folder, out = Path(folder), Path(out)
    if not (folder / "config.json").is_file():
        raise PushError(f"{folder} has no config.json: pass a folder written by `save_pretrained`.")
    config = read_config(folder)
    if not str(config.get("model_type", "")).startswith("archlab_"):
        raise PushError(f"{folder} holds a `{config.get('model_type')}` model, not an archlab one.")
    quantization = config.get("quantization_config")
    if quantization:  # transformers (5.24) raises a bare NotImplementedError re-saving a quantized model it loaded
        method = quantization.get("quant_method", "?") if isinstance(quantization, dict) else "?"
        raise PushError(
            f"{folder} holds a quantized model (quant_method={method!r}), which transformers cannot save again once "
            "loaded, so it cannot be staged. Push the unquantized folder (users pass `quantization_config` when they "
            "load it), or push right after quantizing with `model.push_to_hub(...)`."
        )
    architecture = (config.get("architectures") or [""])[0]
    try:  # an explicit tag that does not fit the model fails before anything is loaded or written
        check_pipeline_tag(architecture, (card or {}).get("pipeline_tag"))
    except ValueError as error:
        raise PushError(str(error)) from error
    auto_class = getattr(transformers, auto_class_for(architecture))
    try:  # safetensors only (archlab refuses pickled weights): a `.bin`-only folder fails here, before any upload
        model, info = auto_class.from_pretrained(folder, dtype="auto", output_loading_info=True)
    except (OSError, RuntimeError, ValueError) as error:  # no weights, pickled only, shapes that do not fit, ...
        raise PushError(f"Cannot load the model in {folder}: {error}") from error
    # a weight the checkpoint lacks would be uploaded freshly initialised, one it has beyond the model dropped
    incomplete = {kind: info.get(kind) for kind in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    incomplete = {kind: sorted(map(str, keys)) for kind, keys in incomplete.items() if keys}
    if incomplete:
        details = "; ".join(f"{kind.replace('_', ' ')}: {', '.join(keys)}" for kind, keys in incomplete.items())
        raise PushError(
            f"The weights in {folder} do not match its config.json ({details}): the upload would hold freshly "
            "initialised or dropped weights. Save the model again with `save_pretrained`."
        )
    model.save_pretrained(out)  # weights, config with auto_map, generation config, the bundled code
    for name in TOKENIZER_FILES + LOG_FILES:
        if (folder / name).is_file():
            shutil.copyfile(folder / name, out / name)
    given = {k: v for k, v in (card or {}).items() if v is not None}
    card_kwargs = {**_existing_card_data(folder, architecture), **given}
    card_kwargs = {k: v for k, v in card_kwargs.items() if v not in (None, [], "")}
    write_model_card(out, model_id=repo_id, **card_kwargs)
    names = sorted(path.name for path in out.iterdir())
    pickled = [name for name in names if any(fnmatch.fnmatch(name, pattern) for pattern in PICKLE_PATTERNS)]
    if pickled or any((out / name).is_dir() for name in names):
        raise PushError(f"Refusing to upload pickled files or folders: {pickled or names}.")
    return names


def default_commit_message(folder: str | Path) -> str:
    return f"Upload {(read_config(folder).get('architectures') or ['model'])[0]} with archlab"


def dry_run(folder: str | Path, out: str | Path, repo_id: str, card: dict[str, Any] | None = None) -> list[str]:
    """`stage` into `out` atomically: on any error `out` is left as it was (absent or empty)."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise PushError(f"--dry-run {out} is a file; give a folder that does not exist or is empty.")
    if out.exists() and any(out.iterdir()):
        raise PushError(f"--dry-run folder {out} exists and is not empty.")
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        names = stage(folder, partial, repo_id, card)
        partial.chmod(0o755)  # mkdtemp makes it private to the user; the result is an ordinary folder
        if out.exists():
            out.rmdir()
        partial.rename(out)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return names


def _preflight(api: HfApi, token: str | None, repo_id: str, private: bool) -> bool:
    """Token, connection, visibility -- checked before anything is written. Returns whether the repo exists."""
    if is_offline_mode():
        raise PushError("The Hub is in offline mode (HF_HUB_OFFLINE=1): unset it to push, or use --dry-run DIR.")
    if not token:
        raise PushError(
            "No Hugging Face token: run `hf auth login`, set HF_TOKEN or pass --token (a token with write access), "
            "or use --dry-run DIR to see what would be uploaded."
        )
    try:
        user = api.whoami(token=token)
    except Exception as error:  # network errors come from the HTTP client, auth errors from huggingface_hub
        raise PushError(f"Cannot reach the Hub at {ENDPOINT} or the token was rejected: {error}") from error
    print(f"logged in to {ENDPOINT} as {user.get('name', '?')}")
    exists = api.repo_exists(repo_id, token=token)
    if exists and private and not getattr(api.repo_info(repo_id, token=token, timeout=30), "private", False):
        raise PushError(f"{repo_id} exists and is public; refusing --private upload into it (make it private first).")
    return exists


def push(
    folder: str | Path,
    repo_id: str,
    *,
    private: bool = False,
    revision: str | None = None,
    commit_message: str | None = None,
    token: str | None = None,
    card: dict[str, Any] | None = None,
    api: HfApi | None = None,
) -> str:
    """Push `folder` to `repo_id` in one commit; returns the commit URL."""
    check_repo_id(repo_id)
    token = token or get_token()
    api = api or HfApi()
    existed = _preflight(api, token, repo_id, private)
    with tempfile.TemporaryDirectory(prefix="archlab-push-") as staging:
        names = stage(folder, staging, repo_id, card)
        message = commit_message or default_commit_message(staging)
        created_branch = False
        api.create_repo(repo_id, token=token, private=private, exist_ok=True)
        try:
            if revision not in (None, "main"):
                created_branch = revision not in {ref.name for ref in api.list_repo_refs(repo_id, token=token).branches}
                api.create_branch(repo_id, branch=revision, token=token, exist_ok=True)
            commit = api.upload_folder(
                repo_id=repo_id, folder_path=staging, revision=revision, commit_message=message, token=token
            )
        except BaseException:
            # one commit is atomic; undo what this push created around it
            if not existed:
                api.delete_repo(repo_id, token=token, missing_ok=True)
            elif created_branch:
                api.delete_branch(repo_id, branch=revision, token=token)
            raise
    print(f"uploaded {len(names)} files: {', '.join(names)}")
    return getattr(commit, "commit_url", str(commit))
