"""Run Python in a fresh interpreter where `archlab` cannot be imported (the Hub user without archlab).

`python -I` drops the current directory, PYTHONPATH and user site; a meta-path finder placed first makes every
`archlab` import fail however archlab is installed (editable finder, site-packages, path entry). The script
starts by proving it: if `import archlab` succeeds, it exits with an error, so a test built on this cannot
pass with archlab silently available.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

PROLOGUE = """
import importlib.abc
import sys


class _HideArchlab(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "archlab" or name.startswith("archlab."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, _HideArchlab())
try:
    import archlab  # noqa: F401
except ModuleNotFoundError:
    pass
else:
    raise SystemExit("archlab is importable: the isolation failed")
"""

EPILOGUE = """
_leaked = sorted(name for name in sys.modules if name == "archlab" or name.startswith("archlab."))
if _leaked:
    raise SystemExit(f"archlab modules were imported: {_leaked}")
"""


def run_without_archlab(code: str, workdir: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run `code` (after the isolation prologue) with `workdir` as cwd; remote-code modules are cached there too."""
    workdir.mkdir(parents=True, exist_ok=True)
    script = workdir / "isolated_script.py"
    script.write_text(PROLOGUE + "\n" + code + "\n" + EPILOGUE, encoding="utf-8")
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("PYTHON", "PYTEST")) and key != "HF_MODULES_CACHE"
    }
    env.update(
        HF_HUB_OFFLINE="1",
        HF_MODULES_CACHE=str(workdir / "hf_modules"),
        TOKENIZERS_PARALLELISM="false",
        OMP_NUM_THREADS="1",
    )
    return subprocess.run(
        [sys.executable, "-I", str(script)], cwd=workdir, env=env, capture_output=True, text=True, timeout=timeout
    )


def check(result: subprocess.CompletedProcess) -> str:
    """The stdout of a successful run; otherwise fail with its stderr."""
    assert result.returncode == 0, f"isolated run failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"
    return result.stdout
