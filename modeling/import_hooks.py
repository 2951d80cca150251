"""Run a function right after a module is first imported, whoever imports it.

archlab adds its model types to tables other libraries keep by `model_type` (Liger Kernel's patch functions, PEFT's
default target modules). Importing those libraries costs seconds, so `import archlab` does not: `after_import`
installs a meta-path finder that finds nothing itself. When the module is imported, the finder asks the other
finders for its spec and wraps the loader, which runs the module as usual and then the callback on it. Every other
import costs one string comparison. Where the module is already loaded, the callback runs at once.
"""

from __future__ import annotations

import importlib.abc
import sys
from collections.abc import Callable
from types import ModuleType


class _RunAfterExec(importlib.abc.Loader):
    """Runs the module with its own loader, then the callback on it."""

    def __init__(self, loader: importlib.abc.Loader, callback: Callable[[ModuleType], None]) -> None:
        self.loader = loader
        self.callback = callback

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        module.__loader__ = module.__spec__.loader = self.loader  # the module looks as if imported plainly
        self.loader.exec_module(module)
        self.callback(module)


class _AfterImport(importlib.abc.MetaPathFinder):
    """An import hook for one module name."""

    def __init__(self, module_name: str, callback: Callable[[ModuleType], None]) -> None:
        self.module_name = module_name
        self.callback = callback

    def find_spec(self, fullname, path, target=None):
        if fullname != self.module_name:
            return None
        for finder in sys.meta_path:
            find_spec = getattr(finder, "find_spec", None)
            spec = None if finder is self or find_spec is None else find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _RunAfterExec(spec.loader, self.callback)
                return spec
        return None


def after_import(module_name: str, callback: Callable[[ModuleType], None]) -> None:
    """`callback(module)` now if `module_name` is loaded, else right after it is first imported. Idempotent: one hook
    per (module, callback) pair."""
    module = sys.modules.get(module_name)
    if module is not None:
        callback(module)
        return
    for finder in sys.meta_path:
        if isinstance(finder, _AfterImport) and (finder.module_name, finder.callback) == (module_name, callback):
            return
    sys.meta_path.insert(0, _AfterImport(module_name, callback))


__all__ = ["after_import"]
