"""transformers' own common model tests (`ModelTesterMixin` from `tests/test_modeling_common.py`), fetched for archlab.

Every model in transformers runs the same ~120 checks from that mixin (save/load round trips, tied weights, meta-device
initialisation of missing weights, eager vs. SDPA in fp32/fp16/bf16, batching equivalence, gradient checkpointing,
resizing embeddings, ...). They are not part of the transformers wheel; they ship in its source distribution on PyPI.

Fetched, not vendored: the test module is ~7,000 lines of someone else's code, and a copy would drift from the
transformers release it tests. `load()` runs `pip download --no-binary :all: --no-deps transformers==5.24.0` once (the
package registry is the one network source CI and developers have; pip prepares the sdist's metadata, ~20 s),
extracts `tests/test_modeling_common.py` and the LICENSE into a cache folder (`$ARCHLAB_TEST_CACHE`, default
`~/.cache/archlab`; written to a temporary folder and renamed into place, so concurrent runs never see half a copy)
and imports it from there. Later runs read the cache and need no network.

The version is pinned: the mixins test the library release they come from, so they run only when the installed
transformers is that release (`PINNED`); with another one the caller skips, naming both versions. Raise `PINNED`
together with the transformers version in use, and re-check the skips in `test_transformers_common.py`. A failed
fetch skips too on a developer's machine without the registry, but fails under CI (`CI` set), which has it.

Two sibling modules of the upstream test tree are imported by `test_modeling_common.py` but are not in the sdist:
`exporters/test_export.py` (ExportTesterMixin, torch.export tests) and `generation/test_utils.py`
(GenerationTesterMixin, generate tests). Both become empty mixins here; archlab's generation is tested against the
stock models by its own suite (tests/modeling/: test_generation.py, test_modeling_seq2seq.py, test_seq2seq_*.py).
"""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from types import ModuleType

import transformers

PINNED = "5.24.0"
PACKAGE = "hf_common_tests"  # the import name of the extracted test tree
FILES = ("tests/test_modeling_common.py", "LICENSE")
STUBS = {
    "exporters/test_export.py": "class ExportTesterMixin:\n    pass\n",
    "generation/test_utils.py": "class GenerationTesterMixin:\n    pass\n",
}


class Unavailable(RuntimeError):
    """The common tests do not apply here: the installed transformers is not the pinned release."""


class FetchFailed(Unavailable):
    """pip could not fetch the sdist (no package registry and no cache), or the cache could not be written."""


def cache_root() -> Path:
    return Path(os.environ.get("ARCHLAB_TEST_CACHE", Path.home() / ".cache" / "archlab")) / f"transformers-{PINNED}"


def _fetch(root: Path) -> None:
    """Download the sdist with pip and write the package folder `root/PACKAGE` atomically."""
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        command = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--quiet",
            "--no-binary",
            ":all:",
            "--no-deps",
            f"transformers=={PINNED}",
            "--dest",
            tmp,
        ]
        proc = subprocess.run(command, capture_output=True, text=True, timeout=600)
        archives = list(Path(tmp).glob("transformers-*.tar.gz"))
        if proc.returncode != 0 or not archives:
            raise FetchFailed(f"`{' '.join(command[2:])}` failed: {proc.stderr.strip()[-2000:]}")
        package = Path(tmp) / PACKAGE
        with tarfile.open(archives[0]) as archive:
            for name in FILES:
                member = archive.getmember(f"transformers-{PINNED}/{name}")
                target = package / Path(name).name
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(archive.extractfile(member).read())
        for name, text in STUBS.items():
            (package / name).parent.mkdir(parents=True, exist_ok=True)
            (package / name).write_text(f'"""Stand-in: not in the transformers {PINNED} sdist."""\n\n\n{text}')
        for folder in (package, package / "exporters", package / "generation"):
            (folder / "__init__.py").touch()
        try:
            os.rename(package, root / PACKAGE)
        except OSError:  # another run put it there first
            if not (root / PACKAGE / "test_modeling_common.py").is_file():
                raise
            shutil.rmtree(package, ignore_errors=True)


def load() -> ModuleType:
    """transformers' `test_modeling_common` module of the pinned release; raises `Unavailable` (another
    transformers release is installed) or `FetchFailed`."""
    if transformers.__version__ != PINNED:
        raise Unavailable(
            f"transformers' common model tests are pinned to transformers {PINNED}; installed is "
            f"{transformers.__version__} (see tests/transformers_common_tests.py to move the pin)."
        )
    root = cache_root()
    if not (root / PACKAGE / "test_modeling_common.py").is_file():
        try:
            _fetch(root)
        except (OSError, subprocess.SubprocessError) as error:
            raise FetchFailed(f"could not fetch transformers' common tests into {root}: {error}") from error
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    return importlib.import_module(f"{PACKAGE}.test_modeling_common")
