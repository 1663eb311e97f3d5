#!/usr/bin/env bash
# Fill .whl/ with the wheels a GPU machine without network needs for benchmarks/gpu_session.sh: what its image
# lacks (pydantic, bitsandbytes) and the versions of peft CI runs. Run on a machine with network, in the repo:
#
#   benchmarks/gpu_wheels.sh [PYTHON_VERSION]      (default 3.12, the GPU image's python3)
#
# Versions are read from this checkout's .venv (what CI tests), so the GPU runs the same code. Together with
# the working tree they must stay under the device tool's 64 MiB per call; bitsandbytes is most of it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY_VERSION="${1:-3.12}"
version() { .venv/bin/python -c "import importlib.metadata as m; print(m.version('$1'))"; }
mkdir -p .whl
rm -f .whl/*.whl
PACKAGES=()
for name in pydantic pydantic_core annotated-types typing-inspection typing_extensions peft bitsandbytes; do
    PACKAGES+=("$name==$(version "$name")")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    -d .whl "${PACKAGES[@]}"
du -sh .whl
