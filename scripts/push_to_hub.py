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
import sys
from collections.abc import Callable, Sequence

from huggingface_hub import HfApi

from archlab.model_cards.facts import PIPELINE_TAGS, SEQ2SEQ_PIPELINE_TAGS
from archlab.training.hub import PushError, check_repo_id, default_commit_message, dry_run, push


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", help="a folder written by save_pretrained (e.g. a training run's output_dir)")
    parser.add_argument("repo_id", help="the Hub repository, `user/name` or `org/name`")
    parser.add_argument("--private", action="store_true", help="create the repository private (refuses a public one)")
    parser.add_argument("--revision", default=None, help="branch to push to (created from main if missing)")
    parser.add_argument("--commit_message", default=None, help="defaults to 'Upload <class> with archlab'")
    parser.add_argument("--token", default=None, help="Hub token (defaults to HF_TOKEN or the `hf auth login` one)")
    parser.add_argument(
        "--dry-run",
        "--dry_run",
        dest="dry_run",
        metavar="DIR",
        default=None,
        help="write exactly what would be uploaded to DIR (must not exist or be empty) and stop",
    )
    card = parser.add_argument_group("model card (defaults come from the folder's existing card)")
    card.add_argument("--base_model", default=None, help="Hub id of the model this one was fine-tuned from")
    card.add_argument("--datasets", nargs="+", default=None, help="training data set name(s)")
    card.add_argument("--license", default=None, help="license identifier (default apache-2.0)")
    card.add_argument("--language", nargs="+", default=None, help="language code(s) of the training data")
    card.add_argument("--tags", nargs="+", default=None, help="extra Hub tags")
    card.add_argument(
        "--pipeline_tag",
        choices=sorted({*PIPELINE_TAGS.values(), *SEQ2SEQ_PIPELINE_TAGS}),
        default=None,
        help="the Hub task (default: the card's, else the model class's; an encoder-decoder is "
        "`translation` or `summarization`)",
    )
    return parser


def main(argv: Sequence[str] | None = None, api_factory: Callable[[], HfApi] = HfApi) -> int:
    args = build_parser().parse_args(argv)
    card = dict(
        base_model=args.base_model,
        datasets=args.datasets,
        license=args.license,
        language=args.language,
        tags=args.tags,
        pipeline_tag=args.pipeline_tag,
    )
    try:
        check_repo_id(args.repo_id)
        if args.dry_run is not None:
            names = dry_run(args.folder, args.dry_run, args.repo_id, card)
            print(
                f"dry run: {len(names)} files in {args.dry_run} would be uploaded to {args.repo_id} "
                f"(revision {args.revision or 'main'}, {'private' if args.private else 'public'}, "
                f"commit message {args.commit_message or default_commit_message(args.dry_run)!r}):"
            )
            print("\n".join(f"  {name}" for name in names))
            return 0
        url = push(
            args.folder,
            args.repo_id,
            private=args.private,
            revision=args.revision,
            commit_message=args.commit_message,
            token=args.token,
            card=card,
            api=api_factory(),
        )
    except PushError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except Exception as error:
        if args.dry_run is not None:  # nothing is uploaded in a dry run; DIR is left as it was
            print(
                f"error: the dry run failed, {args.dry_run} was left as it was: {type(error).__name__}: {error}",
                file=sys.stderr,
            )
            return 1
        # the upload itself failed; what this push created has been removed again
        print(
            f"error: the upload failed, nothing was left on the Hub: {type(error).__name__}: {error}", file=sys.stderr
        )
        return 1
    print(url)
    return 0


if __name__ == "__main__":
    sys.exit(main())
