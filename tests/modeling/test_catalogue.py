"""modeling/catalogue.py: the registries every config string resolves through. The model code keys its module
registries by exactly the catalogue's names, and the config modules import no model code."""

from __future__ import annotations

import ast

from archlab.modeling.blocks import BLOCKS
from archlab.modeling.catalogue import (
    DECODER_NORM_POSITIONS,
    MLP_TYPES,
    NORM_TYPES,
    POSITION_SCHEMES,
    SEQ2SEQ_NORM_POSITIONS,
    SEQ2SEQ_POSITION_SCHEMES,
)
from archlab.modeling.feed_forward import MLPS
from archlab.modeling.normalization import NORMS
from archlab.modeling.positions import POSITION_BIASES, POSITION_TABLES
from archlab.modeling.seq2seq_layers import FFN_ACTIVATIONS, RESIDUALS

from helpers import REPO

MODELING = REPO / "modeling"
# (the last two: `transformers serve`'s hook, which the decoder config registers for its folder's remote code too)
CONFIG_SIDE = {"configuration_decoder", "configuration_seq2seq", "catalogue", "validation", "import_hooks", "serving"}


def test_model_registries_use_the_catalogue_names():
    assert set(NORMS) == set(NORM_TYPES)
    assert set(BLOCKS) == set(DECODER_NORM_POSITIONS)
    assert set(RESIDUALS) == set(SEQ2SEQ_NORM_POSITIONS)
    assert set(MLPS) == set(MLP_TYPES) == set(FFN_ACTIVATIONS)
    assert set(POSITION_TABLES) == {name for name, scheme in POSITION_SCHEMES.items() if scheme.table}
    assert set(POSITION_BIASES) == {name for name, scheme in POSITION_SCHEMES.items() if scheme.bias}
    assert {name for name, scheme in POSITION_SCHEMES.items() if scheme.rotary} == {"rope"}
    assert set(SEQ2SEQ_POSITION_SCHEMES) <= set(POSITION_SCHEMES)


def test_each_scheme_adds_at_most_one_thing():
    for name, scheme in POSITION_SCHEMES.items():
        assert scheme.table + scheme.rotary + scheme.bias <= 1, name


def imports_run_on_import(tree: ast.AST) -> list[ast.ImportFrom]:
    """The `from ... import` statements that run when the module is imported: not those inside a function, which
    run when it is called (serving.py's model class, imported once `transformers serve` loads)."""
    found = []
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.ImportFrom):
            found.append(node)
        elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            found += imports_run_on_import(node)
    return found


def test_config_modules_import_only_config_modules():
    """Importing a config builds no `nn.Module` machinery: its modules import their config-side siblings only."""
    for name in CONFIG_SIDE:
        tree = ast.parse((MODELING / f"{name}.py").read_text())
        siblings = {node.module for node in imports_run_on_import(tree) if node.level == 1}
        assert siblings <= CONFIG_SIDE, (name, siblings - CONFIG_SIDE)


def test_imports_run_on_import_leave_out_function_bodies_only():
    tree = ast.parse(
        "from .a import x\nif x:\n    from .b import y\nclass C:\n    from .c import z\n"
        "    def f(self):\n        from .d import w\ndef g():\n    from .e import v\n"
    )
    assert [node.module for node in imports_run_on_import(tree)] == ["a", "b", "c"]
