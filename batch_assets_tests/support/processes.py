"""`batch-assets` as a user's shell starts it: the console script in a process group of its own, and
`batch-assets serve` up until the block ends (test_resume_kill, test_serve, test_batch_api_*)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx

from batch_assets_tests.support import REPO_ROOT, stop_process_group

# The console script in the project's .venv, as a subprocess runs it (the tests kill it and its group).
VENV_CLI = REPO_ROOT / ".venv" / "bin" / "batch-assets"
# The key `running_server` asks with: the tests that give the server a key give it this one.
SERVE_KEY = "serve-test-key"


def group_alive(pgid: int) -> list[int]:
    alive = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getpgid(int(entry.name)) == pgid and (entry / "stat").read_text().split()[2] != "Z":
                    alive.append(int(entry.name))
            except (ProcessLookupError, FileNotFoundError, PermissionError):
                pass
    return alive


def wait_while_running(child: subprocess.Popen, log: Path, done: Callable[[], object], timeout_s: float = 600) -> None:
    """Until `done()` holds, `child` still running: it must not end first (its log tells why it did)."""
    deadline = time.monotonic() + timeout_s
    while not done():
        assert child.poll() is None, f"the run ended before it could be killed:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.05)


def wait_group_gone(pgid: int) -> None:
    """Every process of the group ended, within 10 s."""
    for _ in range(100):
        if not group_alive(pgid):
            break
        time.sleep(0.1)
    assert group_alive(pgid) == []


@contextlib.contextmanager
def running_server(env: dict[str, str], port: int, log: Path, *options: str) -> Iterator[subprocess.Popen]:
    command = [sys.executable, "-m", "batch_assets.cli", "serve", "--port", str(port), *options]
    with log.open("a") as output:
        process = subprocess.Popen(
            command, cwd=REPO_ROOT, env=env, stdout=output, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, log.read_text()[-3000:]
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(
                    f"http://127.0.0.1:{port}/v1/batches", headers={"Authorization": f"Bearer {SERVE_KEY}"}
                ).is_success:
                    break
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.3)
        yield process
    finally:
        stop_process_group(process)
