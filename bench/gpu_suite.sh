#!/usr/bin/env bash
# The GPU suite (bench/gpu_suite.py) on a bare GPU machine: Python 3.12, torch with CUDA,
# transformers and pyarrow installed, no network. What else it needs travels with the
# checkout as wheels in .gpu-wheels/ (git-ignored; within the 64 MiB a checkout may carry:
# Ray and vLLM do not fit, so the suite runs Ray-free and skips vLLM where it is absent).
#
#   bench/gpu_suite.sh --fetch           # on a machine with the registries: fill .gpu-wheels
#   bench/gpu_suite.sh OUT.json [ARGS]   # on the GPU machine: install them, run, write OUT.json
#
# ARGS go to bench/gpu_suite.py (--only STEP..., --device cuda:1, --quick); `--only issue30`
# runs issue 30's four GPU figures (about 5 minutes on one H100).
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=.gpu-wheels
# Ours and the tests' pure-Python needs (pydantic-core is the one compiled wheel).
NEEDS="pydantic pydantic-core annotated-types typing-inspection typing-extensions pyyaml
pytest pluggy iniconfig packaging hypothesis sortedcontainers attrs fsspec"
if [ "${1:-}" = "--fetch" ]; then
  rm -rf "$WHEELS" && mkdir -p "$WHEELS"
  # shellcheck disable=SC2086
  python3 -m pip download -q --dest "$WHEELS" --only-binary=:all: --no-deps \
    --python-version 3.12 --implementation cp --abi cp312 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_28_x86_64 --platform any $NEEDS
  du -sh "$WHEELS"
  exit 0
fi
OUT=${1:-gpu_suite.json}
PY=${PYTHON:-python3}
if [ -d "$WHEELS" ]; then
  $PY -m pip install -q --no-index --no-deps "$WHEELS"/*.whl
else
  echo "gpu_suite: no $WHEELS/ (run bench/gpu_suite.sh --fetch where PyPI is reachable)" >&2
fi
PYTHONPATH="$PWD" exec $PY bench/gpu_suite.py --out "$OUT" "${@:2}"
