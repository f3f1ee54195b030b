"""The OGX environment of test_batch_api_server.py (slow) is found and built, or skipped saying why:
its Python from pyenv wherever pyenv keeps it, and a failed install a skip naming the command."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from batch_assets_tests.test_batch_api_server import _python_312, _run_or_skip


def test_a_failed_install_is_a_skip_naming_the_command_and_its_error() -> None:
    command = [sys.executable, "-c", "import sys; sys.exit('no index at https://pypi.invalid')"]
    with pytest.raises(pytest.skip.Exception) as skipped:
        _run_or_skip(command, "installing ogx==1.5.0")
    message = str(skipped.value)
    assert message.startswith("installing ogx==1.5.0 failed (no index at https://pypi.invalid)")
    assert "to build it by hand: " in message and "sys.exit" in message
    with pytest.raises(pytest.skip.Exception, match="no_such_tool"):
        _run_or_skip(["/nonexistent/no_such_tool"], "creating OGX's virtual environment")


def test_the_newest_python_312_or_later_is_found_under_pyenv_root(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "pyenv"
    for version in ("3.11.9", "3.12.8", "3.13.1"):
        (root / "versions" / version / "bin").mkdir(parents=True)
        (root / "versions" / version / "bin" / "python").symlink_to(sys.executable)
    monkeypatch.delenv("BATCH_ASSETS_OGX_PYTHON", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no python3.12 nor pyenv on PATH
    monkeypatch.setenv("PYENV_ROOT", str(root))
    assert _python_312() == str(root / "versions" / "3.13.1" / "bin" / "python")
