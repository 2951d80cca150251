"""The embedded corpus (tokenization/corpus.py): the standard library's source and its code -> docstring pairs."""

from __future__ import annotations

import ast
import itertools

from archlab.tokenization.corpus import (
    _function_pairs,
    code_docstring_pairs,
    first_sentence,
    stdlib_documents,
    stdlib_files,
    stdlib_root,
)


def test_split_is_disjoint_deterministic_and_complete() -> None:
    train, validation = stdlib_files("train"), stdlib_files("validation")
    assert len(train) > 300 and 5 < len(validation) < len(train) // 5
    assert set(train).isdisjoint(validation)
    assert sorted(train + validation) == stdlib_files()
    assert stdlib_files("validation") == validation
    assert not any("site-packages" in p.parts for p in train)


def test_documents_are_source_files() -> None:
    first = next(stdlib_documents("validation"))
    assert set(first) == {"text", "path"} and first["path"].endswith(".py") and first["text"].strip()


def test_first_sentence() -> None:
    assert first_sentence("Return the sum.  More text here.") == "Return the sum."
    assert first_sentence("\n    Compute a\n    value. Then more.\n") == "Compute a value."
    assert first_sentence("Summary line\n\nDetails. More.") == "Summary line"
    assert first_sentence("Use e.g.x here") == "Use e.g.x here"


def test_function_pairs_remove_the_docstring_and_stay_valid_python() -> None:
    source = '''
class A:
    @staticmethod
    def add(a, b):
        """Add two numbers. Longer explanation follows."""
        return a + b

    def only_doc(self):
        """Nothing but a docstring here."""

def short(): "Too short to keep."
'''
    pairs = list(_function_pairs(source, max_code_chars=1000, min_words=3, max_words=40))
    by_name = {p["name"]: p for p in pairs}
    assert set(by_name) == {"add", "only_doc"}
    assert by_name["add"]["code"] == "@staticmethod\ndef add(a, b):\n    return a + b"
    assert by_name["add"]["docstring"] == "Add two numbers."
    for pair in pairs:
        ast.parse(pair["code"])


def test_stdlib_pairs_are_real_and_split_by_file() -> None:
    pairs = list(itertools.islice(code_docstring_pairs("validation"), 200))
    assert len(pairs) > 50
    for pair in pairs:
        function = ast.parse(pair["code"]).body[0]
        assert isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)) and function.name == pair["name"]
        assert pair["docstring"] and ast.get_docstring(function) is None
    train_paths = {p.relative_to(stdlib_root()).as_posix() for p in stdlib_files("train")}
    assert all(pair["path"] not in train_paths for pair in pairs)
