"""The OGX environment of test_batch_api_server.py (slow) is found and built, or skipped saying why:
its Python from pyenv wherever pyenv keeps it, and a failed install a skip naming the command."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from batch_assets_tests.support.ogx import python_312, run_or_skip


def test_a_failed_install_is_a_skip_naming_the_command_and_its_error() -> None:
    command = [sys.executable, "-c", "import sys; sys.exit('no index at https://pypi.invalid')"]
    with pytest.raises(pytest.skip.Exception) as skipped:
        run_or_skip(command, "installing ogx==1.5.0")
    message = str(skipped.value)
    assert message.startswith("installing ogx==1.5.0 failed (no index at https://pypi.invalid)")
    assert "to build it by hand: " in message and "sys.exit" in message
    with pytest.raises(pytest.skip.Exception, match="no_such_tool"):
        run_or_skip(["/nonexistent/no_such_tool"], "creating OGX's virtual environment")


def test_the_oldest_python_312_or_later_that_runs_is_found_under_pyenv_root(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fake_python(path: Path, runs: bool) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"#!/bin/sh\nexit {0 if runs else 1}\n")
        path.chmod(0o755)

    root = tmp_path / "pyenv"
    # 3.12.2 is broken (as a pyenv shim for a version pyenv's global setting does not enable is).
    for version, runs in (("3.11.9", True), ("3.12.2", False), ("3.12.8", True), ("3.13.1", True)):
        fake_python(root / "versions" / version / "bin" / "python", runs)
    fake_python(tmp_path / "bin" / "python3.12", runs=False)  # a shim on PATH that fails
    monkeypatch.delenv("BATCH_ASSETS_OGX_PYTHON", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    monkeypatch.setenv("PYENV_ROOT", str(root))
    assert python_312() == str(root / "versions" / "3.12.8" / "bin" / "python")
