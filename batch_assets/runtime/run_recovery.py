"""Runs left behind by a killed `batch-assets` process, found and closed by whoever comes next.

`batch-assets run` executes runs inside its own process. When that process dies without a word
(kill -9, out-of-memory killer, a closed laptop), its run stays STARTED in the instance and keeps
the pool slot (`gpu`) its inference step claimed; Dagster's run monitoring cannot see that, since
no run worker of a launcher was ever involved, so every later run would wait for the slot forever.

Liveness is a lease, not a pid: each `batch-assets` process holds an exclusive POSIX lock
(`fcntl.lockf`) on `$DAGSTER_HOME/batch_assets/processes/<lease>.lock` while it lives, and tags its
runs with `<lease>`. The kernel drops the lock when the process dies, however it dies, and on any
host that shares `$DAGSTER_HOME` (a container, a second shell); pids and host names are only shown
in messages. POSIX locks are not inherited by forked children, so an orphaned engine process does
not keep a dead CLI's lease alive. Whoever comes next (any `batch-assets` command, the
`dead_cli_runs_sensor` in the daemon, or a CLI waiting for a pool slot) marks the runs of dead
leases failed and frees their pool slots; slots still held by runs that already ended are freed too.

The lease also lists the partitions (task, key, file version) the process is about to run, so a drop
sensor does not queue a second run of a file that `batch-assets run` is still working through.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path

import dagster as dg

LEASE_TAG = "batch_assets/process_lease"
PID_TAG = "batch_assets/pid"
HOST_TAG = "batch_assets/host"
_UNFINISHED = [dg.DagsterRunStatus.STARTED, dg.DagsterRunStatus.STARTING, dg.DagsterRunStatus.CANCELING]
# Leases held by this process: testing one would open and close its file, and closing any descriptor
# of a file drops this process's POSIX lock on it.
_OWN_LEASES: set[str] = set()
RECOVERY_SENSOR_NAME = "dead_cli_runs_sensor"


def leases_dir(home: str | Path) -> Path:
    return Path(home) / "batch_assets" / "processes"


class ProcessLease:
    """Held by a running `batch-assets` process; dies with it. Use as a context manager."""

    def __init__(self, home: str | Path):
        self.directory = leases_dir(home)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.lease_id = uuid.uuid4().hex
        temporary = self.directory / f".{self.lease_id}.tmp"
        self._fd = os.open(temporary, os.O_CREAT | os.O_RDWR, 0o644)
        fcntl.lockf(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(self._fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname()}).encode())
        # Locked before it gets its final name, so a lease file found unlocked is always a dead one.
        os.rename(temporary, self.lock_path)
        _OWN_LEASES.add(self.lease_id)

    @property
    def lock_path(self) -> Path:
        return self.directory / f"{self.lease_id}.lock"

    @property
    def claims_path(self) -> Path:
        return self.directory / f"{self.lease_id}.claims.json"

    def tags(self) -> dict[str, str]:
        """Tags for a run executed in this process, so a later process can tell whether it died."""
        return {LEASE_TAG: self.lease_id, HOST_TAG: socket.gethostname(), PID_TAG: str(os.getpid())}

    def claim(self, task: str, partitions: Iterable[tuple[str, str]]) -> None:
        """Announce the (partition key, version digest) pairs this process is going to run."""
        temporary = self.directory / f".{self.lease_id}.claims.tmp"
        temporary.write_text(json.dumps([[task, key, digest] for key, digest in partitions]))
        os.replace(temporary, self.claims_path)

    def release(self) -> None:
        if self._fd < 0:
            return
        for path in (self.claims_path, self.lock_path):
            path.unlink(missing_ok=True)
        os.close(self._fd)
        self._fd = -1
        _OWN_LEASES.discard(self.lease_id)

    def __enter__(self) -> ProcessLease:
        return self

    def __exit__(self, *exc_info) -> None:
        self.release()


def lease_alive(home: str | Path, lease_id: str) -> bool:
    """Whether the process holding `lease_id` still lives (its lock file is locked)."""
    if lease_id in _OWN_LEASES:
        return True
    try:
        fd = os.open(leases_dir(home) / f"{lease_id}.lock", os.O_RDWR)
    except FileNotFoundError:
        return False
    except OSError:
        return True  # not ours to open (another user's process): cannot tell, so leave its runs alone
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)  # also drops the lock just taken
    return False


def _legacy_process_alive(pid: int, started_at: float | None) -> bool:
    """For runs tagged before leases existed: pid on this host (a reused pid is not the run's)."""
    import psutil

    try:
        process = psutil.Process(pid)
        return process.status() != psutil.STATUS_ZOMBIE and (
            started_at is None or process.create_time() <= started_at + 1
        )
    except psutil.NoSuchProcess:
        return False


def _run_process_dead(home: str, record) -> bool:
    tags = record.dagster_run.tags
    if LEASE_TAG in tags:
        return not lease_alive(home, tags[LEASE_TAG])
    if tags.get(HOST_TAG) != socket.gethostname():
        return False  # an old run of another host: nothing to tell its liveness by
    pid = int(tags.get(PID_TAG, "0") or 0)
    return 0 < pid != os.getpid() and not _legacy_process_alive(
        pid, record.start_time or record.create_timestamp.timestamp()
    )


def fail_runs_of_dead_processes(instance: dg.DagsterInstance) -> list[str]:
    """Mark unfinished runs of dead `batch-assets` processes failed and free their pool slots.

    Also frees pool slots still claimed by runs that have already ended. Returns the failed run ids.
    """
    home = instance.root_directory
    closed = []
    for record in instance.get_run_records(filters=dg.RunsFilter(statuses=_UNFINISHED), limit=1000):
        tags = record.dagster_run.tags
        if (LEASE_TAG not in tags and PID_TAG not in tags) or not _run_process_dead(home, record):
            continue
        run = instance.get_run_by_id(record.dagster_run.run_id)  # it may have finished while we looked
        if run is None or run.status not in _UNFINISHED:
            continue
        holder = f"pid {tags.get(PID_TAG, '?')} on {tags.get(HOST_TAG, '?')}"
        instance.report_run_failed(
            run,
            message=f"The batch-assets process that ran this run ({holder}) died before finishing it; marked failed.",
        )
        instance.event_log_storage.free_concurrency_slots_for_run(run.run_id)
        closed.append(run.run_id)
    _free_slots_of_ended_runs(instance)
    _remove_dead_lease_files(home)
    return closed


def _free_slots_of_ended_runs(instance: dg.DagsterInstance) -> None:
    storage = instance.event_log_storage
    if not storage.supports_global_concurrency_limits:
        return
    for pool in storage.get_concurrency_keys():
        for run_id in storage.get_concurrency_info(pool).active_run_ids:
            run = instance.get_run_by_id(run_id)
            if run is None or run.is_finished:
                storage.free_concurrency_slots_for_run(run_id)


def assign_stranded_pool_steps(instance: dg.DagsterInstance) -> list[str]:
    """Give a free pool slot to a step left waiting for it; returns the pools where one was given.

    Dagster 1.13 (SQL storage) queues a step that finds no free slot as pending, and a step that
    frees its slot assigns the oldest pending one. The two are not atomic: a step that looked (no
    slot), then is queued just after the holder freed the slot and assigned nobody, waits forever
    with the slot free (seen here with two range runs whose inference steps met, a cached re-run:
    `Step still blocked by limit for pool gpu` for minutes, no slot claimed). Done here, by the
    recovery sensor every 30 s and by `batch-assets run` while it waits for a slot.
    """
    from batch_assets.runtime.dagster_private import sql_event_log_storage

    storage = instance.event_log_storage
    if not isinstance(storage, sql_event_log_storage()) or not storage.supports_global_concurrency_limits:
        return []
    given = []
    for pool in sorted(storage.get_concurrency_keys()):
        info = storage.get_concurrency_info(pool)
        # A pending step keeps its assignment until it ends, claimed or not yet: those hold the slots.
        holding = sum(1 for step in info.pending_steps if step.assigned_timestamp is not None)
        waiting = any(step.assigned_timestamp is None for step in info.pending_steps)
        if waiting and holding < info.slot_count:
            storage.assign_pending_steps([pool])  # the oldest waiting step of the highest priority
            given.append(pool)
    return given


def _remove_dead_lease_files(home: str) -> None:
    directory = leases_dir(home)
    if not directory.is_dir():
        return
    for path in directory.glob("*.lock"):
        lease_id = path.name.removesuffix(".lock")
        if not lease_alive(home, lease_id):
            (directory / f"{lease_id}.claims.json").unlink(missing_ok=True)
            path.unlink(missing_ok=True)


def partitions_claimed_by_live_processes(home: str | Path, task: str) -> set[tuple[str, str]]:
    """(partition key, version digest) of `task` that live `batch-assets` processes are running or about to."""
    directory = leases_dir(home)
    claimed: set[tuple[str, str]] = set()
    if not directory.is_dir():
        return claimed
    for path in directory.glob("*.claims.json"):
        lease_id = path.name.removesuffix(".claims.json")
        if not lease_alive(home, lease_id):
            continue
        try:
            entries = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # removed while we read it: its process is done
        claimed |= {(key, digest) for claim_task, key, digest in entries if claim_task == task}
    return claimed


def wait_for_pool_slot(
    instance: dg.DagsterInstance,
    pool: str,
    *,
    say: Callable[[str], None],
    poll_seconds: float = 2.0,
    before_waiting: Callable[[], None] = lambda: None,
) -> None:
    """Return once `pool` has a free slot; meanwhile say once who holds it and keep closing dead runs.
    `before_waiting` is called once if the pool is full (the CLI frees its warm engine: the holder's
    engine needs the device).

    Interrupt it with Ctrl-C (or SIGTERM, which the CLI maps to the same): it only sleeps and reads.
    """
    storage = instance.event_log_storage
    if not storage.supports_global_concurrency_limits:
        return
    told = None
    while True:
        info = storage.get_concurrency_info(pool)
        limit = info.limit if info.limit is not None else info.slot_count
        if not limit or info.active_slot_count < limit:
            return
        holders = sorted(info.active_run_ids)
        if told is None:
            before_waiting()
        if holders != told:
            names = ", ".join(f"run {run_id[:8]} ({_launched_by(instance, run_id)})" for run_id in holders)
            say(
                f"waiting for a slot of pool `{pool}` (limit {limit}), held by {names}; "
                "Ctrl-C stops waiting (the limit: `dagster instance concurrency set " + pool + " N`)"
            )
            told = holders
        time.sleep(poll_seconds)
        fail_runs_of_dead_processes(instance)
        assign_stranded_pool_steps(instance)


def others_wait_for_pool(instance: dg.DagsterInstance, pool: str) -> bool:
    """Whether a step is waiting for a slot of `pool` (asked by a step that holds one: the waiting
    step belongs to another run, which will start its own engine once the slot is freed)."""
    storage = instance.event_log_storage
    if not storage.supports_global_concurrency_limits:
        return False
    # Dagster lists a step that holds a slot among the pending ones too, with the time it was assigned.
    return any(step.assigned_timestamp is None for step in storage.get_concurrency_info(pool).pending_steps)


def _launched_by(instance: dg.DagsterInstance, run_id: str) -> str:
    run = instance.get_run_by_id(run_id)
    if run is None:
        return "unknown run"
    who = run.tags.get("batch_assets/launched_by") or (
        "a backfill" if "dagster/backfill" in run.tags else "the UI or daemon"
    )
    return f"{run.job_name}, {run.tags.get('dagster/partition', '')}, launched by {who}, {run.status.value}"


def build_recovery_sensor(minimum_interval_seconds: int = 30) -> dg.SensorDefinition:
    """Closes the runs of dead `batch-assets` processes from the daemon, even when no CLI runs again."""

    @dg.sensor(
        name=RECOVERY_SENSOR_NAME,
        minimum_interval_seconds=minimum_interval_seconds,
        default_status=dg.DefaultSensorStatus.RUNNING,
        description=(
            "Marks runs of `batch-assets` processes that died (kill -9, out of memory) as failed and frees "
            "their pool slots, and gives a free slot to a step Dagster left waiting for it, so runs waiting "
            "for the `gpu` pool go on."
        ),
    )
    def dead_cli_runs_sensor(context: dg.SensorEvaluationContext) -> dg.SkipReason:
        closed = fail_runs_of_dead_processes(context.instance)
        for pool in assign_stranded_pool_steps(context.instance):
            context.log.warning(f"gave a free slot of pool `{pool}` to a step Dagster had left waiting for it")
        if closed:
            context.log.warning(f"failed {len(closed)} run(s) of dead batch-assets processes: {', '.join(closed)}")
            return dg.SkipReason(f"marked {len(closed)} run(s) of dead processes failed and freed their slots")
        return dg.SkipReason("no runs of dead batch-assets processes")

    return dead_cli_runs_sensor
