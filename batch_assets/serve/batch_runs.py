"""Each batch runs as a partition of its task: `batch-assets run <task> serve/runs/<batch id>.jsonl`.

One batch at a time, in creation order, each in a `batch-assets run` subprocess that this server
starts (nothing else needs to be started), and not through the instance's run queue. Why:
- the queue (QueuedRunCoordinator) only launches runs while a Dagster daemon and a code server run:
  a second and third service to start and keep alive, which `serve` is meant not to need;
- `batch-assets run` is the path every other file takes: the file is copied into the task's drop
  zone, registered as a partition, claimed (the drops sensor of a running `batch-assets ui` leaves
  it alone) and materialized with the task's assets and checks, recorded in the instance at
  `$DAGSTER_HOME` (the runs appear in the UI), checkpointed as it goes (a stopped or killed run
  resumes where it stopped when the server starts again);
- a subprocess can be stopped like Ctrl-C stops a command (SIGINT to its process group: the run
  ends as "stopped", checkpoints kept), which is what cancelling a batch and stopping the server do;
  a run in this process could not be stopped mid-step without stopping the server;
- one at a time, because a machine holds one engine (the GPU's memory); each batch pays one
  engine start (seconds for a small model), as `vllm run-batch` does for every file.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import psutil

from batch_assets.serve.objects import FINISHED, UNFINISHED, batch_errors, file_object, usage
from batch_assets.serve.store import ServeStore, new_file_id
from batch_assets.serve.uploads import scan_lines
from batch_assets.storage.drop_files import partition_key_for
from batch_assets.storage.locations import task_storage_dir

# How long a stopped run may take to end (it marks its Dagster run stopped) before it is killed.
_STOP_SECONDS = 30.0
_POLL_SECONDS = 0.5


def _now() -> int:
    return int(time.time())


def count_lines(content: bytes) -> int:
    return content.count(b"\n") + (bool(content) and not content.endswith(b"\n"))


class BatchRunner:
    """The thread that validates, runs, finalizes and cancels batches."""

    def __init__(self, store: ServeStore, tasks: dict[str, str]) -> None:
        self.store = store
        self.tasks = tasks  # endpoint → task name
        self.wake = threading.Event()
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="batch-assets-serve-runs", daemon=True)

    def start(self) -> None:
        self._recover()
        self.thread.start()

    def stop(self) -> None:
        """Stop the batch being run (it stays in_progress and resumes when the server starts again)."""
        self.stopping.set()
        self.wake.set()
        self.thread.join()

    def cancel(self, batch_id: str) -> dict[str, Any] | None:
        """A batch that has not started is cancelled at once; a running one is `cancelling` until its run stopped."""

        def change(record: dict[str, Any]) -> dict[str, Any] | None:
            batch = record["batch"]
            if batch["status"] in (*FINISHED, "cancelling"):
                return None
            batch["cancelling_at"] = _now()
            if record["run"].get("started"):
                batch["status"] = "cancelling"
            else:
                batch["status"], batch["cancelled_at"] = "cancelled", batch["cancelling_at"]
            return record

        record = self.store.update_batch(batch_id, change)
        self.wake.set()
        return record

    def _loop(self) -> None:
        while not self.stopping.is_set():
            self._validate_pending()
            batch_id = self._claim_next()
            if batch_id is None:
                self.wake.wait(1.0)
                self.wake.clear()
                continue
            try:
                self._run(batch_id)
            except Exception as exc:  # noqa: BLE001 - the batch fails with the reason; the server goes on
                self._fail(batch_id, "batch_run_failed", f"the batch could not be run: {exc}")

    def _recover(self) -> None:
        """After a restart: a run left by a server that was killed is stopped (and resumes from its
        checkpoints when run again), a batch that was being cancelled is cancelled, one that was
        being finalized is finalized."""
        for record in self.store.batch_records(UNFINISHED):
            batch, run = record["batch"], record["run"]
            _stop_orphan(run.get("pid"), run.get("pid_started"))
            if batch["status"] == "cancelling":
                batch["status"], batch["cancelled_at"] = "cancelled", _now()
                self._release_input(batch["id"])
            run.update(started=False, pid=None, pid_started=None)
            self.store.save_batch(record)
            if batch["status"] == "finalizing":
                self._finalize(batch["id"])

    def _validate_pending(self) -> None:
        for record in self.store.batch_records(("validating",)):
            self.store.update_batch(record["batch"]["id"], self._validated)

    def _validated(self, record: dict[str, Any]) -> dict[str, Any] | None:
        batch = record["batch"]
        if batch["status"] != "validating":
            return None  # cancelled meanwhile
        path = self.store.content_path(batch["input_file_id"])
        if path is None:
            message = f"input file {batch['input_file_id']} was deleted before the batch started"
            batch.update(status="failed", failed_at=_now(), errors=batch_errors("invalid_file", message))
            return record
        batch["request_counts"]["total"] = scan_lines(path)[0]
        batch.update(status="in_progress", in_progress_at=_now())
        return record

    def _claim_next(self) -> str | None:
        """The oldest batch waiting to run, marked started (a cancel from now on has to stop its run)."""
        with self.store.lock:
            for record in self.store.batch_records(("in_progress",)):
                batch = record["batch"]
                if record["run"].get("started"):
                    continue
                if _now() > batch["expires_at"]:
                    batch.update(status="expired", expired_at=_now())
                    self.store.save_batch(record)
                    continue
                record["run"]["started"] = True
                self.store.save_batch(record)
                return batch["id"]
        return None

    def _run(self, batch_id: str) -> None:
        record = self.store.batch_record(batch_id)
        assert record is not None
        task = record["run"]["task"]
        source = self.store.content_path(record["batch"]["input_file_id"])
        if source is None:
            self._fail(batch_id, "invalid_file", "the input file was deleted before the batch started")
            return
        # The run's file is named after the batch: the partition key is the batch id.
        run_input = self.store.runs / f"{batch_id}.jsonl"
        if not run_input.exists():
            os.link(source, run_input)
        with (self.store.logs / f"{batch_id}.log").open("ab") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "batch_assets.cli", "run", task, str(run_input)],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: stopped as a whole, like Ctrl-C stops it
            )
        self._note_process(batch_id, process.pid)
        while process.poll() is None:
            current = self.store.batch_record(batch_id)
            if self.stopping.is_set() or (current and current["batch"]["status"] == "cancelling"):
                _stop_group(process.pid)
                process.wait()
                break
            self._validate_pending()
            self.wake.wait(_POLL_SECONDS)
            self.wake.clear()
        self._after_run(batch_id, process.returncode)

    def _note_process(self, batch_id: str, pid: int) -> None:
        started = psutil.Process(pid).create_time()

        def change(record: dict[str, Any]) -> dict[str, Any]:
            record["run"].update(pid=pid, pid_started=started)
            return record

        self.store.update_batch(batch_id, change)

    def _after_run(self, batch_id: str, exit_status: int | None) -> None:
        def change(record: dict[str, Any]) -> dict[str, Any]:
            batch = record["batch"]
            record["run"].update(pid=None, pid_started=None, exit_status=exit_status)
            if batch["status"] == "cancelling":
                batch.update(status="cancelled", cancelled_at=_now())
                self._release_input(batch_id)
            elif self.stopping.is_set():
                record["run"]["started"] = False  # resumes when the server starts again
            else:
                batch.update(status="finalizing", finalizing_at=_now())
            return record

        record = self.store.update_batch(batch_id, change)
        if record and record["batch"]["status"] == "finalizing":
            self._finalize(batch_id)

    def _finalize(self, batch_id: str) -> None:
        """The run's output and error files become the batch's (those of a run that wrote none: a failed batch)."""
        record = self.store.batch_record(batch_id)
        assert record is not None
        task = record["run"]["task"]
        key = partition_key_for(f"{batch_id}.jsonl")
        written = [task_storage_dir(task) / folder / f"{key}.jsonl" for folder in ("batch_output", "batch_errors")]
        if not all(path.exists() for path in written):
            self._fail(batch_id, "batch_run_failed", f"the run of task {task} failed: {self._log_tail(batch_id)}")
            return
        outputs, errors = (path.read_bytes() for path in written)
        output_id = self._result_file(batch_id, "output", outputs)
        error_id = self._result_file(batch_id, "error", errors)
        lines = [json.loads(line) for line in outputs.splitlines() if line.strip()]
        # Outputs written by a run that then failed (a check at ERROR, say): the batch completed,
        # its `errors` say so (OpenAI's clients read `errors` on any batch).
        status = record["run"].get("exit_status")
        note = (
            batch_errors(
                "batch_run_exit_status",
                f"batch-assets run of task {task} wrote every line, then exited with status {status}: "
                f"{self._log_tail(batch_id)}",
            )
            if status
            else None
        )

        def change(record: dict[str, Any]) -> dict[str, Any]:
            completed, failed = count_lines(outputs), count_lines(errors)
            record["batch"].update(
                status="completed",
                completed_at=_now(),
                output_file_id=output_id,
                error_file_id=error_id,
                request_counts={"total": completed + failed, "completed": completed, "failed": failed},
                usage=usage(lines),
                errors=note,
            )
            return record

        self.store.update_batch(batch_id, change)
        self._release_input(batch_id)

    def _release_input(self, batch_id: str) -> None:
        """The run's input link (runs/<batch id>.jsonl) of a batch with no more to run: while it
        exists, deleting the input file (DELETE /v1/files) frees no space."""
        (self.store.runs / f"{batch_id}.jsonl").unlink(missing_ok=True)

    def _result_file(self, batch_id: str, kind: str, content: bytes) -> str | None:
        """A batch's output or error file, as OpenAI gives them: only when it has lines."""
        if not content.strip():
            return None
        file_id = new_file_id()
        self.store.add_file(content, file_object(file_id, f"{batch_id}_{kind}.jsonl", len(content), "batch_output"))
        return file_id

    def _fail(self, batch_id: str, code: str, message: str) -> None:
        def change(record: dict[str, Any]) -> dict[str, Any]:
            record["batch"].update(status="failed", failed_at=_now(), errors=batch_errors(code, message))
            return record

        self.store.update_batch(batch_id, change)
        self._release_input(batch_id)

    def _log_tail(self, batch_id: str) -> str:
        log = self.store.logs / f"{batch_id}.log"
        lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()] if log.exists() else []
        last = lines[-1].strip() if lines else "it wrote nothing"
        return f"{last} (the server's log: serve/logs/{batch_id}.log under DAGSTER_HOME)"


def _stop_group(pid: int) -> None:
    """Ctrl-C for a run's process group (the run ends as stopped), then SIGKILL if it does not end."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGINT)
    deadline = time.monotonic() + _STOP_SECONDS
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


def _stop_orphan(pid: int | None, started: float | None) -> None:
    """The run a killed server left behind, if that process still lives (same pid and start time)."""
    if pid is None:
        return
    with contextlib.suppress(psutil.Error):
        if abs(psutil.Process(pid).create_time() - (started or 0)) < 0.01:
            _stop_group(pid)
