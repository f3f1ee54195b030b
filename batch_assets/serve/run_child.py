"""A batch's `batch-assets run` as `serve` starts it: killed the moment its server dies.

    python -m batch_assets.serve.run_child SERVER_PID run TASK FILE

asks Linux for SIGKILL when its parent dies (kill -9, the out-of-memory killer), then becomes
`python -m batch_assets.cli run TASK FILE` by exec: the same process (the pid and start time the
server keeps for it), and the parent-death signal is kept across the exec. Why: the run has a
process group of its own (so that a cancel can stop it as Ctrl-C stops a command), so it would
outlive such a server, handed to init and watched by nobody; the restarted server runs the batch
again, and two runs of one partition would collect the same provider batches, or the older one be
interrupted and cancel them. SIGKILL, not SIGINT or SIGTERM: a stopped run cancels the provider
batches it has in flight (a stop is someone's decision), a killed one leaves them kept for the next
run to collect (docs/batch-api.md), and its engine processes are reaped (engines/reaper.py), as
after kill -9 of a `batch-assets run`. Where the kernel has no such signal, a restarted server kills
a run that outlived its server (`run_processes.kill_orphan`).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

# prctl(2)'s option: the signal this process gets when the thread that started it ends.
_PR_SET_PDEATHSIG = 1


def die_with(server_pid: int) -> None:
    """SIGKILL for this process once `server_pid`, its parent, is gone (already gone: at once)."""
    _parent_death_signal(signal.SIGKILL)
    # The server may have died before the signal was asked for (then nothing would send it).
    if os.getppid() != server_pid:
        os.kill(os.getpid(), signal.SIGKILL)


def _parent_death_signal(signum: int) -> bool:
    """Linux's parent-death signal, which the kernel sends whatever this process is doing. One system
    call through ctypes: the packages that wrap prctl are C extensions unmaintained for years, or a
    dependency for one call."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0) == 0


def main(argv: list[str]) -> None:
    die_with(int(argv[0]))
    os.execv(sys.executable, [sys.executable, "-m", "batch_assets.cli", *argv[1:]])


if __name__ == "__main__":
    main(sys.argv[1:])
