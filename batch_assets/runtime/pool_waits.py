"""How a run's step waits for a pool slot (the `gpu` pool): asleep, and taking a freed slot within seconds.

Range runs of one burst meet in the `gpu` pool: the second run's `inference_outputs` waits while the
first run's engine works. Two defects of Dagster 1.13's in-process executor make that wait costly,
and every run that waits behind another pays them:

- It never sleeps while a step waits. `InstanceConcurrencyContext.interval_to_next_pending_claim_check`
  returns `min([0, ...])`, never more than 0, so the run worker polls in a loop and takes a whole
  core for as long as the wait lasts (144 CPU s in a measured burst of 20 drops, on a 2-core
  machine whose other run was working its engine).
- Between two looks at the pool it backs off exponentially up to 15 s, so a freed slot was taken
  8.8 s late in the same burst, time added straight to the burst's wall.

`sleep_between_pool_checks()` makes the executor sleep until its next look and caps the gap between
looks at `POOL_CHECK_SECONDS` (a look is one small query of the instance's database). It replaces
two private members of Dagster's module (there is no setting for either); the test of this module
fails if a Dagster upgrade renames them or changes what they mean.

A third defect gives one slot to two steps: on SQLite storage (the single-machine instance) a
claim reads "is a slot free?" and then writes, with no row lock between (`FOR UPDATE SKIP LOCKED`
is a no-op there), so two runs whose inference steps ask within the same few milliseconds (both
runs of a burst, formatted side by side) both get the `gpu` slot and start two engines at once,
measured with bench/bench_backfill.py (both steps started 22.7 s after the drop, each at half
speed; on a GPU the second engine would not fit). `serialize_pool_claims()` makes each claim and
release of a pool slot hold an exclusive lock on a file beside the database, so they happen one
after another across processes; Postgres storage locks its rows itself and is left alone.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from batch_assets.runtime.instance import exclusive_file_lock


def install_pool_workarounds() -> None:
    """Both workarounds below, for every run this process executes. Called by our own entry points
    only (the code location module `batch_assets.definitions`, which code servers and run workers
    load, and `batch-assets run`/`demo`), never as a side effect of importing or building definitions:
    a user's own code location that imports batch_assets keeps Dagster as it is, and calls this
    itself to get them (docs/runs.md "Many partitions, one engine start")."""
    sleep_between_pool_checks()
    serialize_pool_claims()


# How late a waiting step may notice a freed slot, at most: one database query per waiting run per period.
POOL_CHECK_SECONDS = 2.0
_applied = False


def sleep_between_pool_checks() -> None:
    """Idempotent; applies to every run executed in this process (a run worker loads the definitions
    before it executes anything, `batch-assets run` builds them too)."""
    global _applied
    if _applied:
        return
    from batch_assets.runtime.dagster_private import instance_concurrency_context as module

    context_class = module.InstanceConcurrencyContext
    dagster_backoff = module._calculate_timeout_interval

    def next_check_in(self) -> float:
        # Seconds until the earliest waiting step may look again: the executor sleeps that long.
        if not self._pending_claims:
            return 0.0
        now = time.time()
        return max(0.0, min((ready_at - now for ready_at in self._pending_timeouts.values()), default=0.0))

    def capped_backoff(sleep_interval: float | None, pending_claim_count: int) -> float:
        return min(POOL_CHECK_SECONDS, dagster_backoff(sleep_interval, pending_claim_count))

    context_class.interval_to_next_pending_claim_check = next_check_in  # type: ignore[method-assign]
    module._calculate_timeout_interval = capped_backoff
    _applied = True


# The storage methods that read and then change who holds a slot (or is next for one).
_SLOT_CHANGES = (
    "claim_concurrency_slot",
    "free_concurrency_slot_for_step",
    "free_concurrency_slots_for_run",
    "assign_pending_steps",
)
POOL_CLAIMS_LOCK = ".batch_assets_pool_claims.lock"
_serialized = False


def serialize_pool_claims() -> None:
    """Idempotent; every SQLite event log storage in this process claims and frees pool slots under
    an exclusive lock on `POOL_CLAIMS_LOCK` in its folder (one instance's processes share it). The
    classes are changed when Dagster's event log module is imported, now or later."""
    global _serialized
    if _serialized:
        return
    from batch_assets.runtime.dagster_private import when_event_log_storages_load

    when_event_log_storages_load(_lock_slot_changes)
    _serialized = True


def _lock_slot_changes(storage_classes: tuple[type, ...]) -> None:
    for storage_class in storage_classes:
        for name in _SLOT_CHANGES:
            setattr(storage_class, name, _under_claims_lock(getattr(storage_class, name)))


def _under_claims_lock(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def locked(storage: Any, *args: Any, **kwargs: Any) -> Any:
        with _claims_lock(storage._base_dir):
            return method(storage, *args, **kwargs)

    return locked


_held = threading.local()  # inside a locked method: freeing a slot calls assign_pending_steps


@contextmanager
def _claims_lock(folder: str) -> Iterator[None]:
    if getattr(_held, "inside", False):  # this thread holds the lock already
        yield
        return
    with exclusive_file_lock(Path(folder).resolve() / POOL_CLAIMS_LOCK):
        _held.inside = True
        try:
            yield
        finally:
            _held.inside = False
