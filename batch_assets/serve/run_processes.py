"""A batch's `batch-assets run` as a process of the server: started in a process group of its own
(stopped as a whole, as Ctrl-C stops a command), stopped, and killed when a killed server left it
behind."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

# How long a stopped run may take to end (it marks its Dagster run stopped) before it is killed.
STOP_SECONDS = 30.0


def start_run(task: str, run_input: Path, log_path: Path) -> subprocess.Popen:
    """`batch-assets run <task> <run_input>`, its output appended to `log_path`. Through run_child:
    the run dies with this server (a server killed with -9 leaves no run behind that the restarted
    server's run would compete with)."""
    command = [sys.executable, "-m", "batch_assets.serve.run_child", str(os.getpid()), "run", task, str(run_input)]
    with log_path.open("ab") as log:
        return subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: stopped as a whole, like Ctrl-C stops it
        )


def process_started(pid: int) -> float:
    """The process's start time: with its pid, what names it after a restart (`kill_orphan`)."""
    return psutil.Process(pid).create_time()


def stop_group(pid: int) -> None:
    """Ctrl-C for a run's process group (the run ends as stopped), then SIGKILL if it does not end."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGINT)
    deadline = time.monotonic() + STOP_SECONDS
    while time.monotonic() < deadline:
        try:
            os.killpg(pid, 0)
        except ProcessLookupError:
            return
        with contextlib.suppress(ChildProcessError):
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def kill_orphan(pid: int | None, started: float | None) -> None:
    """The run a killed server left behind, if that process still lives (same pid and start time):
    killed with its group, as its server's death kills it (run_child.py), never stopped: a stopped run
    cancels the provider batches it has in flight, which the batch's next run collects instead."""
    if pid is None:
        return
    with contextlib.suppress(psutil.Error):
        if abs(psutil.Process(pid).create_time() - (started or 0)) < 0.01:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
