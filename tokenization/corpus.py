"""The embedded default corpus: the Python standard library's own source files.

Every machine that runs archlab has them (`sysconfig.get_paths()["stdlib"]`), they are real text nobody here wrote
(about 10 MB without the test suite and generated tables, 30+ MB with the tests), so pretraining demos and tests
need no download. Two views:

- `stdlib_documents`: one document per `.py` file (`{"text", "path"}`), the pretraining corpus;
- `code_docstring_pairs`: a real seq2seq task extracted with `ast` -- a function's code (docstring removed) ->
  the first sentence of its docstring (`{"code", "docstring", "name", "path"}`);
- `instruction_examples`: the same pairs the other way round as chat turns, for instruction tuning.

The train/validation split is by file (a stable hash of the relative path), so no file -- and no function -- is in
both splits, and the split is the same on every machine and Python version that has the same files.
"""

from __future__ import annotations

import ast
import hashlib
import os
import re
import sysconfig
import textwrap
from collections.abc import Iterator
from pathlib import Path

SPLITS = ("train", "validation")
# Not source a language model should imitate: installed packages, generated tables (`encodings`' character maps,
# `pydoc_data`'s help text), grammar fixtures and demo folders.
_SKIP_DIRS = {
    "site-packages",
    "dist-packages",
    "__pycache__",
    "lib2to3",
    "idlelib",
    "ensurepip",
    "turtledemo",
    "encodings",
    "pydoc_data",
}
_TEST_DIRS = {"test", "tests", "idle_test"}


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _split_of(relative: str, validation_fraction: float) -> str:
    bucket = int.from_bytes(hashlib.sha1(relative.encode()).digest()[:4], "big") / 2**32
    return "validation" if bucket < validation_fraction else "train"


def stdlib_files(
    split: str | None = None, validation_fraction: float = 0.05, include_tests: bool = False
) -> list[Path]:
    """Sorted `.py` files of the standard library (no site-packages), optionally one split of them."""
    if split is not None and split not in SPLITS:
        raise ValueError(f"`split`={split!r} is not supported; allowed values: {SPLITS + (None,)}.")
    root = stdlib_root()
    skip = _SKIP_DIRS if include_tests else _SKIP_DIRS | _TEST_DIRS
    files = []
    for folder, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip)  # prune site-packages before descending
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            path = Path(folder, name)
            if split is None or _split_of(path.relative_to(root).as_posix(), validation_fraction) == split:
                files.append(path)
    files.sort()
    return files


def corpus_fingerprint(split: str | None = None, validation_fraction: float = 0.05) -> str:
    """A hash of exactly which files (path, size, mtime) make up a split: the cache key of the embedded corpus."""
    root = stdlib_root()
    digest = hashlib.sha1(f"{split}|{validation_fraction}".encode())
    for path in stdlib_files(split, validation_fraction):
        stat = path.stat()
        digest.update(f"{path.relative_to(root).as_posix()}|{stat.st_size}|{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None  # a handful of files are deliberately not UTF-8


def stdlib_documents(
    split: str | None = None, validation_fraction: float = 0.05, include_tests: bool = False
) -> Iterator[dict[str, str]]:
    """One `{"text", "path"}` record per non-empty source file."""
    root = stdlib_root()
    for path in stdlib_files(split, validation_fraction, include_tests):
        text = _read(path)
        if text and text.strip():
            yield {"text": text, "path": path.relative_to(root).as_posix()}


_SENTENCE_END = re.compile(r"(?<=[.!?])\s")


def first_sentence(docstring: str) -> str:
    """The docstring's first paragraph, cut at its first sentence end, whitespace collapsed."""
    paragraph = docstring.strip().split("\n\n", 1)[0]
    paragraph = " ".join(paragraph.split())
    return _SENTENCE_END.split(paragraph, 1)[0].strip()


def _function_pairs(source: str, max_code_chars: int, min_words: int, max_words: int) -> Iterator[dict[str, str]]:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return
    lines = source.splitlines(keepends=True)
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        docstring = ast.get_docstring(node)
        if not docstring or not node.body or node.end_lineno is None:
            continue
        target = first_sentence(docstring)
        if not min_words <= len(target.split()) <= max_words:
            continue
        doc_node = node.body[0]
        if doc_node.lineno == node.lineno:
            continue  # `def f(): "doc"` on one line: nothing would be left
        start = (node.decorator_list[0].lineno if node.decorator_list else node.lineno) - 1
        # The function's lines without the docstring statement's lines.
        kept = lines[start : doc_node.lineno - 1] + lines[doc_node.end_lineno : node.end_lineno]
        code = textwrap.dedent("".join(kept)).strip("\n")
        if len(node.body) == 1:
            code += "\n    pass"  # the docstring was the whole body; keep the code valid Python
        if len(code) > max_code_chars:
            continue
        yield {"code": code, "docstring": target, "name": node.name}


def code_docstring_pairs(
    split: str | None = None,
    validation_fraction: float = 0.05,
    max_code_chars: int = 1200,
    min_words: int = 3,
    max_words: int = 40,
    include_tests: bool = False,
) -> Iterator[dict[str, str]]:
    """`{"code", "docstring", "name", "path"}` for every documented function whose code fits `max_code_chars`."""
    root = stdlib_root()
    for path in stdlib_files(split, validation_fraction, include_tests):
        source = _read(path)
        if source:
            for pair in _function_pairs(source, max_code_chars, min_words, max_words):
                yield {**pair, "path": path.relative_to(root).as_posix()}


def instruction_examples(split: str | None = None, validation_fraction: float = 0.05, max_code_chars: int = 600):
    """Chat-format instruction data from the same pairs: the user asks for a function by name and docstring
    sentence, the assistant answers with its code (`{"messages": [user, assistant]}`)."""
    for pair in code_docstring_pairs(split, validation_fraction, max_code_chars=max_code_chars):
        request = f"Write a Python function `{pair['name']}`: {pair['docstring']}"
        yield {"messages": [{"role": "user", "content": request}, {"role": "assistant", "content": pair["code"]}]}


__all__ = [
    "SPLITS",
    "code_docstring_pairs",
    "instruction_examples",
    "first_sentence",
    "stdlib_documents",
    "stdlib_files",
    "stdlib_root",
]
