"""Ctrl-C and SIGTERM stop a `batch-assets` command: the first as "stopped" (exit 130), the second at once.

Two things stand in the way of a plain KeyboardInterrupt:
- while Dagster executes a run it replaces the SIGINT/SIGTERM handlers, and an interrupt inside a
  step that has a retry policy becomes a retry of the step (`op_execution_error_boundary` in
  dagster/_core/execution/plan/utils.py): `inference_outputs` started a fresh engine and the
  command finished with 0;
- a Ctrl-C reaches the terminal's whole process group, vLLM's engine process too, so the step may
  first see its engine die, an ordinary exception.
Python's C-level handler writes every signal it catches to the wake-up fd, whichever Python handler
is installed, so a thread reading it learns of the stop at once and sets `STOP`: the step ends as
stopped instead of retrying (`stop_instead_of`), the command runs nothing more (`raise_if_stopped`)
and exits 130. Only our own entry point installs this (`watch_stop_signals`); importing the package
changes no signal handling.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable

STOP = threading.Event()
STOPPED = "stopped (interrupted)"
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# How long a step that failed waits for a stop signal that may be on its way: Ctrl-C reaches the
# engine's process and this one at the same moment, and the engine's death can surface first.
_SIGNAL_GRACE_SECONDS = 1.0
# Signals this close together are one Ctrl-C: a terminal's signal seen by this process and by forked
# children that share the wake-up fd (VLLM_WORKER_MULTIPROC_METHOD=fork).
_SAME_SIGNAL_SECONDS = 0.5
_watching = threading.Event()


class Stopped(KeyboardInterrupt):
    """The command was asked to stop (Ctrl-C or SIGTERM)."""


def watch_stop_signals(say: Callable[[str], None]) -> None:
    """From the main thread of our command line: the first SIGINT/SIGTERM sets `STOP`, the second ends
    the process with 130 (engines are ended by their reaper when this process is gone). Once per
    process: a second call (tests call `main` more than once) keeps the first watcher."""
    if _watching.is_set():
        return
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    threading.Thread(target=_watch, args=(read_end, say), name="batch-assets-stop-signals", daemon=True).start()
    _watching.set()


def _watch(read_end: int, say: Callable[[str], None]) -> None:
    first: float | None = None
    while data := os.read(read_end, 64):
        if not any(number in STOP_SIGNALS for number in data):
            continue
        now = time.monotonic()
        if first is not None and not STOP.is_set():
            # The stop was handled and the flag cleared (a process that runs `main` again, as tests
            # do): this signal starts a new stop, it is not the second of the old one.
            first = None
        STOP.set()
        if first is None:
            first = now
            _say(say, "stopping (interrupted): the running step ends without a retry; interrupt again to stop at once")
        elif now - first > _SAME_SIGNAL_SECONDS:
            _say(say, "stopped at once (interrupted twice)")
            os._exit(130)


def _say(say: Callable[[str], None], text: str) -> None:
    # The watcher must outlive a closed terminal, or a second Ctrl-C would no longer end the process.
    with contextlib.suppress(Exception):
        say(text)


def stop_requested(*, wait_for_signal: bool = False) -> bool:
    """Whether a stop signal arrived; `wait_for_signal`: after a failure, wait a moment for one that
    may be on its way (only where the command line watches for them)."""
    if STOP.is_set():
        return True
    return wait_for_signal and _watching.is_set() and STOP.wait(_SIGNAL_GRACE_SECONDS)


def stop_instead_of(error: BaseException) -> bool:
    """Whether a step's failure is the stop the user asked for (not a failure to retry)."""
    return isinstance(error, KeyboardInterrupt) or stop_requested(wait_for_signal=True)


def raise_if_stopped() -> None:
    if STOP.is_set():
        raise Stopped()
