"""OGX's Python and environment (test_batch_api_server.py builds it, test_ogx_setup.py checks how): a
Python >= 3.12 found wherever it is kept, and a failed build step a skip naming the command."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest


def python_312() -> str | None:
    """A Python >= 3.12 for OGX that runs: BATCH_ASSETS_OGX_PYTHON, python3.12+ on PATH, else pyenv's
    oldest 3.12+ (the one OGX is tested with here; `pyenv root`, PYENV_ROOT, ~/.pyenv or /root/.pyenv).
    Each is tried, because a pyenv shim is on PATH for every version pyenv knows but fails for one its
    global setting does not enable."""
    on_path = [
        os.environ.get("BATCH_ASSETS_OGX_PYTHON"),
        *(shutil.which(f"python3.{minor}") for minor in range(12, 16)),
    ]
    in_pyenv = [
        str(found)
        for root in _pyenv_roots()
        for found in sorted(
            root.glob("versions/3.1[2-9].*/bin/python"),
            key=lambda p: [int(n) for n in p.parts[-3].split(".")[:2]],
        )
    ]
    return next((candidate for candidate in (*on_path, *in_pyenv) if candidate and _runs_312(candidate)), None)


def _runs_312(python: str) -> bool:
    check = [python, "-c", "import sys; sys.exit(sys.version_info < (3, 12))"]
    try:
        return subprocess.run(check, capture_output=True, check=False, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _pyenv_roots() -> list[Path]:
    roots = [os.environ.get("PYENV_ROOT"), str(Path.home() / ".pyenv"), "/root/.pyenv"]
    if pyenv := shutil.which("pyenv"):
        asked = subprocess.run([pyenv, "root"], capture_output=True, text=True, check=False)
        roots.insert(0, asked.stdout.strip() if asked.returncode == 0 else None)
    return [Path(root) for root in dict.fromkeys(roots) if root]


def run_or_skip(command: list[str], what: str) -> None:
    """`command`, or a skip saying why and what to run: a machine without the package index (or the
    tool) cannot build OGX's environment, which is not a failure of batch_assets."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, check=False)
    except OSError as exc:
        pytest.skip(f"{what} failed ({exc}): {shlex.join(command)}")
    if done.returncode != 0:
        reason = (done.stderr.strip() or done.stdout.strip()).splitlines()[-1:] or [f"exit status {done.returncode}"]
        pytest.skip(f"{what} failed ({reason[0]}); to build it by hand: {shlex.join(command)}")
