"""Runs left behind by a killed `batch-assets` process, found and closed so a re-run can start.

`batch-assets run` executes runs inside its own process. When that process dies without a word
(kill -9, out-of-memory killer, a closed laptop), its run stays STARTED in the instance and keeps
the `gpu` pool slot its inference step claimed, so the next run of any partition would wait for
that slot forever. Runs launched by the daemon do not need this: run monitoring fails them and
frees their slots (see `run_monitoring` in dagster.yaml).

Each in-process run is tagged with the host and process id that runs it; before running anything,
the CLI marks the runs of this host whose process is gone as failed and frees their pool slots.
"""

import os
import socket

import dagster as dg

PID_TAG = "batch_assets/pid"
HOST_TAG = "batch_assets/host"
_UNFINISHED = [dg.DagsterRunStatus.STARTED, dg.DagsterRunStatus.STARTING, dg.DagsterRunStatus.CANCELING]


def process_tags() -> dict[str, str]:
    """Tags for a run executed in this process, so a later process can tell whether it died."""
    return {HOST_TAG: socket.gethostname(), PID_TAG: str(os.getpid())}


def _process_alive(pid: int, started_at: float | None) -> bool:
    import psutil

    try:
        process = psutil.Process(pid)
        # A pid reused by a process born after the run started is not the run's process.
        return process.status() != psutil.STATUS_ZOMBIE and (started_at is None or process.create_time() <= started_at + 1)
    except psutil.NoSuchProcess:
        return False


def fail_runs_of_dead_processes(instance: dg.DagsterInstance) -> list[str]:
    """Mark this host's in-process runs whose process died as failed and free their pool slots."""
    records = instance.get_run_records(
        filters=dg.RunsFilter(statuses=_UNFINISHED, tags={HOST_TAG: socket.gethostname()}), limit=1000
    )
    closed = []
    for record in records:
        run = record.dagster_run
        pid = int(run.tags.get(PID_TAG, "0") or 0)
        if pid <= 0 or pid == os.getpid() or _process_alive(pid, record.start_time or record.create_timestamp.timestamp()):
            continue
        instance.report_run_failed(
            run, message=f"The process that ran this run (pid {pid}) died without finishing it (killed?); marked failed."
        )
        instance.event_log_storage.free_concurrency_slots_for_run(run.run_id)
        closed.append(run.run_id)
    return closed
