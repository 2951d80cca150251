#!/usr/bin/env bash
# Fill .whl/ (git-ignored) with the wheels a GPU machine needs beside its own torch, for its Python 3.12 on
# manylinux x86_64. Run it here, where PyPI is reachable; the GPU machine has no network, so the device tool carries
# the folder (carry: [".whl"]) and scripts/gpu/session.sh installs it there into /tmp/site.
#
#   bash scripts/gpu/fetch_wheels.sh                 # the pinned set below
#   bash scripts/gpu/fetch_wheels.sh pyarrow==26.0.1 # ... plus more, e.g. what session.sh's `info` step reports missing
#
# The pins are the versions archlab is tested with on CPU. The image's torch, triton, tokenizers, safetensors,
# huggingface_hub, jinja2, pyarrow, pandas, xxhash, fsspec and pytest are used as they are (`info` checks them).
set -euo pipefail
cd "$(dirname "$0")/../.."

PYTHON="${PYTHON:-python3}"
DEST="${WHEEL_DIR:-.whl}"
PYTHON_VERSION="${PYTHON_VERSION:-3.12}"
PACKAGES=(
    transformers==5.24.0  # the image has an older 5.x
    datasets==5.2.0       # not in the image; archlab's data pipeline imports it
    dill==0.4.1           # datasets' needs that the image lacks
    multiprocess==0.70.19
    accelerate==1.15.0    # in the image today; pinned so a different image still runs the same compile_regions
    regex==2026.11.15     # transformers checks regex >= 2025.10.22 at import
    liger-kernel==0.8.5   # the cuda-train suite's Llama + liger rows (Triton kernels; triton is in the image)
)

# One version per package: two wheels of one name stop the whole install on the GPU machine.
mkdir -p "$DEST"
rm -f "$DEST"/*.whl
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: \
    --python-version "$PYTHON_VERSION" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    -d "$DEST" "${PACKAGES[@]}" "$@"

ls -l "$DEST"
echo "$(find "$DEST" -type f -name '*.whl' | wc -l) wheels, $(du -sh "$DEST" | cut -f1) in $DEST (the device tool carries at most 64 MiB with the checkout)"
