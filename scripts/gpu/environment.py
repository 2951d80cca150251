"""What a GPU session runs on: the GPU, torch and CUDA, where each package is imported from (the carried wheels in
PYTHONPATH must shadow the image's older copies), and every requirement of archlab and of the carried packages that
the installed versions do not meet. Exit status 1 when there is no usable GPU or something is missing.

    PYTHONPATH=/tmp/site python3 scripts/gpu/environment.py     # scripts/gpu/session.sh's `info` step
"""

from __future__ import annotations

import importlib
import platform
import sys
from importlib.metadata import PackageNotFoundError, distribution, version

# Import name by distribution name, for the packages the suites and tests load.
PACKAGES = {
    "torch": "torch",
    "triton": "triton",
    "transformers": "transformers",
    "accelerate": "accelerate",
    "datasets": "datasets",
    "tokenizers": "tokenizers",
    "safetensors": "safetensors",
    "huggingface-hub": "huggingface_hub",
    "liger-kernel": "liger_kernel",
    "pyarrow": "pyarrow",
    "pytest": "pytest",
    "archlab": "archlab",
}
# Whose declared requirements must hold (extras left out).
CHECKED = ("archlab", "transformers", "datasets", "accelerate", "liger-kernel", "multiprocess")


def unmet_requirements(name: str) -> list[str]:
    from packaging.requirements import Requirement

    problems = []
    for line in distribution(name).requires or []:
        requirement = Requirement(line)
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue
        try:
            installed = version(requirement.name)
        except PackageNotFoundError:
            problems.append(f"{name} needs {requirement}: not installed")
            continue
        if requirement.specifier and not requirement.specifier.contains(installed, prereleases=True):
            problems.append(f"{name} needs {requirement}: {installed} installed")
    return problems


def main() -> int:
    ok = True
    print(f"python {platform.python_version()} ({sys.executable}), {platform.platform()}")
    for dist, module in PACKAGES.items():
        try:
            imported = importlib.import_module(module)
            where = getattr(imported, "__file__", None) or "?"
            print(f"{dist:<16} {version(dist):<22} {where}")
        except Exception as error:  # report every package, whatever breaks its import
            print(f"{dist:<16} NOT IMPORTABLE: {type(error).__name__}: {error}")
            ok &= dist in ("liger-kernel",)  # only liger is optional (its rows are skipped without it)
    import torch

    if torch.cuda.is_available():
        properties = torch.cuda.get_device_properties(0)
        print(
            f"GPU: {torch.cuda.get_device_name(0)}, compute capability {properties.major}.{properties.minor}, "
            f"{properties.total_memory / 2**30:.1f} GiB, {properties.multi_processor_count} SMs; "
            f"torch {torch.__version__}, CUDA {torch.version.cuda}, bf16 supported: {torch.cuda.is_bf16_supported()}"
        )
    else:
        print(f"no CUDA device visible to torch {torch.__version__}")
        ok = False
    for name in CHECKED:
        try:
            problems = unmet_requirements(name)
        except PackageNotFoundError:
            problems = [f"{name} is not installed"]
        for problem in problems:
            print(f"UNMET: {problem}")
        ok &= not problems or name == "liger-kernel"
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
