"""Push a saved archlab model -- weights, bundled code, tokenizer, Trainer logs and model card -- to the Hub.

    python scripts/push_to_hub.py runs/tiny  someone/tiny-python --private --commit_message "first model"
    python scripts/push_to_hub.py runs/tiny  someone/tiny-python --dry-run upload/   # writes what would be pushed

The folder is re-saved through archlab into a staging folder: safetensors weights, the model code and `auto_map`
(so the repo loads with `trust_remote_code=True` where archlab is not installed), the tokenizer files, the JSON Trainer
logs, the loss curve and a model card whose usage snippet loads REPO_ID. Pickled files (`*.bin`, `*.pt`, ...) are
never uploaded. `--dry-run DIR` writes the staging folder to DIR and stops: it is exactly what would be uploaded.

A live push checks the token and the connection before writing anything, uploads everything in ONE commit, and
deletes the repository (or branch) again if it created it and the upload failed -- nothing partial is left behind.
"""

from __future__ import annotations

import argparse
import fnmatch
import shutil
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import transformers
from huggingface_hub import HfApi, ModelCard, get_token
from huggingface_hub.constants import ENDPOINT, is_offline_mode

import archlab  # noqa: F401  (registers the archlab classes with the Auto classes)
from archlab.model_cards import write_model_card
from archlab.model_cards.facts import (
    PIPELINE_TAGS, SEQ2SEQ_PIPELINE_TAGS, auto_class_for, check_pipeline_tag, pipeline_tags_allowed, read_config,
)

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
LOG_FILES = ("trainer_state.json", "training_args.json", "all_results.json", "eval_results.json", "loss_curve.png")
PICKLE_PATTERNS = ("*.bin", "*.pt", "*.pth", "*.pkl", "*.pickle", "*.ckpt")


class PushError(RuntimeError):
    """A problem found before anything was uploaded; the message says what to do."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", help="a folder written by save_pretrained (e.g. a training run's output_dir)")
    parser.add_argument("repo_id", help="the Hub repository, `user/name` or `org/name`")
    parser.add_argument("--private", action="store_true", help="create the repository private (refuses a public one)")
    parser.add_argument("--revision", default=None, help="branch to push to (created from main if missing)")
    parser.add_argument("--commit_message", default=None, help="defaults to 'Upload <class> with archlab'")
    parser.add_argument("--token", default=None, help="Hub token (defaults to HF_TOKEN or the `hf auth login` one)")
    parser.add_argument("--dry-run", "--dry_run", dest="dry_run", metavar="DIR", default=None,
                        help="write exactly what would be uploaded to DIR (must not exist or be empty) and stop")
    card = parser.add_argument_group("model card (defaults come from the folder's existing card)")
    card.add_argument("--base_model", default=None, help="Hub id of the model this one was fine-tuned from")
    card.add_argument("--datasets", nargs="+", default=None, help="training data set name(s)")
    card.add_argument("--license", default=None, help="license identifier (default apache-2.0)")
    card.add_argument("--language", nargs="+", default=None, help="language code(s) of the training data")
    card.add_argument("--tags", nargs="+", default=None, help="extra Hub tags")
    card.add_argument("--pipeline_tag", choices=sorted({*PIPELINE_TAGS.values(), *SEQ2SEQ_PIPELINE_TAGS}), default=None,
                      help="the Hub task (default: the card's, else the model class's; an encoder-decoder is "
                           "`translation` or `summarization`)")
    return parser


def _check_repo_id(repo_id: str) -> None:
    parts = repo_id.split("/")
    if len(parts) != 2 or not all(parts) or any(part.startswith((".", "-")) for part in parts):
        raise PushError(f"`repo_id`={repo_id!r} must look like `user/name` (or `org/name`).")


def _existing_card_data(folder: Path, architecture: str) -> dict[str, Any]:
    readme = folder / "README.md"
    if not readme.is_file():
        return {}
    data = ModelCard.load(readme).data
    return {
        "base_model": data.base_model,
        "datasets": data.datasets,
        "license": data.license,
        "language": data.language,
        "eval_results": data.eval_results,
        # kept when it still fits (a summariser stays one); an older card's tag that no longer does is dropped
        "pipeline_tag": data.pipeline_tag if data.pipeline_tag in pipeline_tags_allowed(architecture) else None,
        "tags": [tag for tag in (data.tags or []) if tag not in ("archlab", "custom_code", "safetensors")
                 and not tag.startswith("archlab_")],
    }


def stage(folder: str | Path, out: str | Path, repo_id: str, card: dict[str, Any] | None = None) -> list[str]:
    """Write into the empty folder `out` exactly what a push of `folder` to `repo_id` uploads; returns file names."""
    folder, out = Path(folder), Path(out)
    if not (folder / "config.json").is_file():
        raise PushError(f"{folder} has no config.json: pass a folder written by `save_pretrained`.")
    config = read_config(folder)
    if not str(config.get("model_type", "")).startswith("archlab_"):
        raise PushError(f"{folder} holds a `{config.get('model_type')}` model, not an archlab one.")
    architecture = (config.get("architectures") or [""])[0]
    try:  # an explicit tag that does not fit the model fails before anything is loaded or written
        check_pipeline_tag(architecture, (card or {}).get("pipeline_tag"))
    except ValueError as error:
        raise PushError(str(error)) from error
    auto_class = getattr(transformers, auto_class_for(architecture))
    try:  # safetensors only (archlab refuses pickled weights): a `.bin`-only folder fails here, before any upload
        model = auto_class.from_pretrained(folder, dtype="auto")
    except OSError as error:
        raise PushError(str(error)) from error
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
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
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
    _check_repo_id(repo_id)
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


def main(argv: Sequence[str] | None = None, api_factory: Callable[[], HfApi] = HfApi) -> int:
    args = build_parser().parse_args(argv)
    card = dict(base_model=args.base_model, datasets=args.datasets, license=args.license, language=args.language,
                tags=args.tags, pipeline_tag=args.pipeline_tag)
    try:
        _check_repo_id(args.repo_id)
        if args.dry_run is not None:
            names = dry_run(args.folder, args.dry_run, args.repo_id, card)
            print(f"dry run: {len(names)} files in {args.dry_run} would be uploaded to {args.repo_id} "
                  f"(revision {args.revision or 'main'}, {'private' if args.private else 'public'}, "
                  f"commit message {args.commit_message or default_commit_message(args.dry_run)!r}):")
            print("\n".join(f"  {name}" for name in names))
            return 0
        url = push(args.folder, args.repo_id, private=args.private, revision=args.revision,
                   commit_message=args.commit_message, token=args.token, card=card, api=api_factory())
    except PushError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except Exception as error:  # the upload itself failed; what this push created has been removed again
        print(f"error: the upload failed, nothing was left on the Hub: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    print(url)
    return 0


if __name__ == "__main__":
    sys.exit(main())
