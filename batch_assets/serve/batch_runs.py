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
import functools
import json
import logging
import os
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from batch_assets.serve.objects import FINISHED, UNFINISHED, batch_errors, file_object, usage
from batch_assets.serve.run_processes import kill_orphan, process_started, start_run, stop_group
from batch_assets.serve.settings import CHAT_TASK, NO_ROOM
from batch_assets.serve.store import ServeStore, new_file_id
from batch_assets.serve.uploads import scan_lines
from batch_assets.storage.drop_files import partition_key_for
from batch_assets.storage.errors import StorageError
from batch_assets.storage.locations import task_storage_dir
from batch_assets.storage.partition_purge import purge_partition

logger = logging.getLogger(__name__)

_POLL_SECONDS = 0.5
# A failed step (a full disk, say) is tried again after a wait that doubles from the first to the
# last; after this many failures in a row the runner cannot go on for now, and the server refuses
# new files and batches (503) until a step succeeds again.
_BACKOFF_SECONDS = (0.5, 30.0)
TROUBLE_AFTER = 3
# How often expired files are looked for (each look reads every file object).
_EXPIRY_SWEEP_SECONDS = 10.0


def _now() -> int:
    return int(time.time())


def count_lines(content: bytes) -> int:
    return content.count(b"\n") + (bool(content) and not content.endswith(b"\n"))


class BatchRunner:
    """The thread that validates, runs, finalizes and cancels batches."""

    def __init__(self, store: ServeStore, tasks: dict[str, str], adapters: dict[str, str] | None = None) -> None:
        self.store = store
        self.tasks = tasks  # endpoint → task name
        self.adapters = adapters or {}  # a LoRA adapter's name → the task that runs it (`engine.lora`)
        self.wake = threading.Event()
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="batch-assets-serve-runs", daemon=True)
        self._started = False
        self._recovered = False
        self._failed_steps = 0
        self._last_failure = ""
        # What a failed step left to do, tried again at each step until it is written: batches to
        # fail (batch id → code, message) and runs that ended but were not recorded (→ exit status).
        self._unfailed: dict[str, tuple[str, str]] = {}
        self._no_room: Exception | None = None  # the first no-room failure of this step's batches
        self._unsettled: dict[str, int | None] = {}
        # Batches that ended but whose cleanup (`_release_input`) failed: tried again at each sweep,
        # on their own (the batch's status stands; it is never settled or finalized again).
        self._unreleased: set[str] = set()
        # Held while a file is forgotten or a partition purged (by DELETE, an upload's sweep, the
        # runner's sweep and cleanups), so that none is purged twice at once; taken before the store's.
        self._purging = threading.RLock()
        self._next_sweep = 0.0

    def start(self) -> None:
        """The thread recovers what a stopped server left (its first step), then runs batches."""
        self._started = True
        self.thread.start()

    def stop(self) -> None:
        """Stop the batch being run (it stays in_progress and resumes when the server starts again)."""
        self.stopping.set()
        self.wake.set()
        self.thread.join()

    def trouble(self) -> str | None:
        """Why new work would not run now (the server answers 503), or None."""
        if self._started and not self.thread.is_alive() and not self.stopping.is_set():
            return "the batch runner has stopped; restart batch-assets serve"
        if self._failed_steps >= TROUBLE_AFTER:
            return (
                f"the batch runner cannot go on: its last {self._failed_steps} steps failed, the last with "
                f"{self._last_failure}; it tries again every {self._backoff():g} s, "
                "and takes new work once a step succeeds"
            )
        return None

    def cancel(self, batch_id: str) -> dict[str, Any] | None:
        """A batch that has not started is cancelled at once; a running one is `cancelling` until its run stopped."""

        cancelled = False

        def change(record: dict[str, Any]) -> dict[str, Any] | None:
            nonlocal cancelled
            batch = record["batch"]
            if batch["status"] in (*FINISHED, "cancelling"):
                return None
            batch["cancelling_at"] = _now()
            if record["run"].get("started"):
                batch["status"] = "cancelling"
            else:
                batch["status"], batch["cancelled_at"] = "cancelled", batch["cancelling_at"]
                cancelled = True
            return record

        record = self.store.update_batch(batch_id, change)
        if cancelled:
            # One that ran before a restart (`_recover` reset it) has a partition, purged if its input went.
            self._release(batch_id)
        self.wake.set()
        return record

    def task_for(self, endpoint: str, input_path: Path | None) -> str:
        """The task that runs a batch: the one whose adapter its lines name as `body.model` (read from
        the first line: a batch is one model's, as at OpenAI), else the endpoint's."""
        model = first_line_model(input_path) if input_path is not None and self.adapters else None
        return self.adapters.get(model or "", self.tasks.get(endpoint, CHAT_TASK))

    def _loop(self) -> None:
        while not self.stopping.is_set():
            try:
                busy = self._step()
            except Exception as exc:  # noqa: BLE001 - a failed step is tried again after a wait; the thread goes on
                self._stumbled(exc)
                continue
            self._failed_steps, self._last_failure = 0, ""
            if not busy:
                self.wake.wait(1.0)
                self.wake.clear()

    def _step(self) -> bool:
        """One round of the runner's work, each part safe to repeat after a failure; True when a batch ran."""
        if not self._recovered:
            self._recover()
            self._recovered = True
        self._record_failures()
        self._settle_runs()
        self._finalize_pending()
        if time.monotonic() >= self._next_sweep:
            self._release_pending()
            self.sweep_expired_files()
            self._next_sweep = time.monotonic() + _EXPIRY_SWEEP_SECONDS
        self._validate_pending()
        claimed = self._claim_next()
        if claimed is None:
            return False
        self._run_claimed(claimed)
        return True

    def _run_claimed(self, batch_id: str) -> None:
        try:
            exit_status = self._run(batch_id)
        except Exception as exc:
            self._unfailed[batch_id] = ("batch_run_failed", f"the batch could not be run: {exc}")
            raise
        if exit_status is not None:
            self._unsettled[batch_id] = exit_status  # recorded by a later step if this one fails
            self._settle_runs()

    def _settle_runs(self) -> None:
        """Each ended run recorded, one batch at a time: one whose settling failed for want of room
        stays to be settled at a later step (this one fails: the runner backs off); any other
        failure would fail again, and fails the batch."""
        for batch_id, exit_status in list(self._unsettled.items()):
            if self._settle_one(batch_id, "settling", functools.partial(self._after_run, batch_id, exit_status)):
                del self._unsettled[batch_id]
        self._record_failures()
        self._raise_no_room()

    def _settle_one(self, batch_id: str, what: str, step: Callable[[], object]) -> bool:
        """Run one batch's step; False when it failed for want of room (kept for a later step, which the
        runner backs off for). Any other failure would fail again: the batch is failed, and True."""
        try:
            step()
        except Exception as exc:
            if _no_room(exc):
                self._no_room = self._no_room or exc
                return False
            logger.warning("batch-assets serve: %s batch %s failed (%s: %s)", what, batch_id, type(exc).__name__, exc)
            self._unfailed[batch_id] = ("batch_run_failed", f"the batch's {what} failed: {_cause(exc)}")
        return True

    def _raise_no_room(self) -> None:
        no_room, self._no_room = self._no_room, None
        if no_room is not None:
            raise no_room

    def _stumbled(self, exc: Exception) -> None:
        self._failed_steps += 1
        # What clients are told (503): the cause, not the server's paths; the log has the whole error.
        number = getattr(exc, "errno", None)
        self._last_failure = os.strerror(number) if isinstance(number, int) else type(exc).__name__
        logger.warning("batch-assets serve: a step of the batch runner failed (%s: %s)", type(exc).__name__, exc)
        self.stopping.wait(self._backoff())

    def _backoff(self) -> float:
        first, last = _BACKOFF_SECONDS
        return min(last, first * 2 ** max(0, self._failed_steps - 1))

    def _record_failures(self) -> None:
        for batch_id, (code, message) in list(self._unfailed.items()):
            self._fail(batch_id, code, message)
            del self._unfailed[batch_id]

    def _finalize_pending(self) -> None:
        """Batches left `finalizing`: by a server stopped meanwhile, or by a write that failed for want
        of room (tried again: their outputs are on disk); any other error fails the batch."""
        for record in self.store.batch_records(("finalizing",)):
            batch_id = record["batch"]["id"]
            self._settle_one(batch_id, "finalizing", functools.partial(self._finalize, batch_id))
        self._record_failures()
        self._raise_no_room()

    def _recover(self) -> None:
        """After a restart: a run left by a server that was killed, if it still lives, is killed (run
        again, it resumes from its checkpoints and collects its provider batches), a batch that was
        being cancelled is cancelled, one that was being finalized is finalized. The server answers
        meanwhile: each batch is changed as it is then (a client may have cancelled it meanwhile)."""
        for record in self.store.batch_records(UNFINISHED):
            run = record["run"]
            kill_orphan(run.get("pid"), run.get("pid_started"))
            if self._recovered_batch(record["batch"]["id"]):
                self._release(record["batch"]["id"])

    def _recovered_batch(self, batch_id: str) -> bool:
        """The batch's run marked not started (one left `finalizing` is finalized by the step); True
        when it was being cancelled, and now is."""
        cancelled = False

        def change(record: dict[str, Any]) -> dict[str, Any] | None:
            nonlocal cancelled
            batch = record["batch"]
            if batch["status"] in FINISHED:
                return None  # cancelled meanwhile (one not started: at once)
            if batch["status"] == "cancelling":
                batch["status"], batch["cancelled_at"] = "cancelled", _now()
                cancelled = True
            record["run"].update(started=False, pid=None, pid_started=None)
            return record

        self.store.update_batch(batch_id, change)
        return cancelled

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
        expired: list[str] = []
        claimed: str | None = None
        with self.store.lock:
            for record in self.store.batch_records(("in_progress",)):
                batch = record["batch"]
                if record["run"].get("started"):
                    continue
                if _now() > batch["expires_at"]:
                    batch.update(status="expired", expired_at=_now())
                    self.store.save_batch(record)
                    expired.append(batch["id"])
                    continue
                record["run"]["started"] = True
                self.store.save_batch(record)
                claimed = batch["id"]
                break
        for batch_id in expired:  # without the store's lock: a purge takes `_purging` first
            self._release(batch_id)
        return claimed

    def _run(self, batch_id: str) -> int | None:
        """The batch's `batch-assets run`, until it ends or is stopped: its exit status (None: it
        could not start, and the batch is to fail)."""
        record = self.store.batch_record(batch_id)
        assert record is not None
        task = record["run"]["task"]
        source = self.store.content_path(record["batch"]["input_file_id"])
        if source is None:
            self._unfailed[batch_id] = ("invalid_file", "the input file was deleted before the batch started")
            return None
        # The run's file is named after the batch: the partition key is the batch id.
        run_input = self.store.runs / f"{batch_id}.jsonl"
        if not run_input.exists():
            os.link(source, run_input)
        # Started in this runner thread, which outlives it: its parent-death signal comes when the
        # thread that starts it ends (run_child.py).
        process = start_run(task, run_input, self.store.logs / f"{batch_id}.log")
        try:
            self._note_process(batch_id, process.pid)
            self._watch(batch_id, process)
        except BaseException:
            # The batch fails (or the server stops): its run must not go on unwatched.
            stop_group(process.pid)
            process.wait()
            raise
        return process.returncode

    def _watch(self, batch_id: str, process: subprocess.Popen) -> None:
        while process.poll() is None:
            current = self.store.batch_record(batch_id)
            if self.stopping.is_set() or (current and current["batch"]["status"] == "cancelling"):
                stop_group(process.pid)
                process.wait()
                break
            try:
                self._validate_pending()
            except Exception as exc:  # noqa: BLE001 - validated at a later look; the run goes on
                logger.warning("batch-assets serve: validating new batches failed (%s: %s)", type(exc).__name__, exc)
            self.wake.wait(_POLL_SECONDS)
            self.wake.clear()

    def _note_process(self, batch_id: str, pid: int) -> None:
        started = process_started(pid)

        def change(record: dict[str, Any]) -> dict[str, Any]:
            record["run"].update(pid=pid, pid_started=started)
            return record

        self.store.update_batch(batch_id, change)

    def _after_run(self, batch_id: str, exit_status: int | None) -> None:
        cancelled = False

        def change(record: dict[str, Any]) -> dict[str, Any] | None:
            nonlocal cancelled
            batch = record["batch"]
            if batch["status"] in FINISHED:
                return None  # settled by an earlier try (never finalized twice); its cleanup is `_release`'s
            record["run"].update(pid=None, pid_started=None, exit_status=exit_status)
            if batch["status"] == "cancelling":
                batch.update(status="cancelled", cancelled_at=_now())
                cancelled = True
            elif self.stopping.is_set():
                record["run"]["started"] = False  # resumes when the server starts again
            else:
                batch.update(status="finalizing", finalizing_at=_now())
            return record

        record = self.store.update_batch(batch_id, change)
        if cancelled:
            self._release(batch_id)
        elif record and record["batch"]["status"] == "finalizing":
            self._finalize(batch_id)  # failing, the batch stays `finalizing` and a later step finalizes it

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
        made: list[str] = []
        try:
            output_id = self._result_file(batch_id, "output", outputs, made)
            error_id = self._result_file(batch_id, "error", errors, made)
            self._complete(record, outputs, errors, output_id, error_id)
        except BaseException:
            for file_id in made:  # tried again whole: no orphan output file of this attempt stays
                with contextlib.suppress(OSError):
                    self.store.delete_file(file_id)
            raise
        self._release(batch_id)  # completed: a cleanup that fails is tried again on its own

    def _complete(
        self, record: dict[str, Any], outputs: bytes, errors: bytes, output_id: str | None, error_id: str | None
    ) -> None:
        batch_id, task = record["batch"]["id"], record["run"]["task"]
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

    def _release(self, batch_id: str) -> None:
        """`_release_input` of a batch that has ended; failing, it is logged and tried again at the
        runner's later sweeps (`_release_pending`), and the batch's status stands."""
        with self._purging:
            try:
                self._release_input(batch_id)
            except Exception as exc:  # noqa: BLE001 - said, and tried again at the next sweep
                self._unreleased.add(batch_id)
                logger.warning(
                    "batch-assets serve: cleaning up after batch %s failed, tried again later (%s: %s)",
                    batch_id,
                    type(exc).__name__,
                    exc,
                )
            else:
                self._unreleased.discard(batch_id)

    def _release_pending(self) -> None:
        with self._purging:
            pending = sorted(self._unreleased)
        for batch_id in pending:
            self._release(batch_id)

    def _release_input(self, batch_id: str) -> None:
        """A batch with no more to run: its run's input link (runs/<batch id>.jsonl) goes (while it
        exists, deleting the input file frees no space), and when its input or output file was
        deleted meanwhile, what its partition kept of it (`forget_file`)."""
        (self.store.runs / f"{batch_id}.jsonl").unlink(missing_ok=True)
        with self.store.lock:
            record = self.store.batch_record(batch_id)
            gone = record is not None and any(
                file_id and self.store.content_path(file_id) is None for file_id in _file_ids(record["batch"])
            )
        if gone and record is not None:
            self._purge(record)

    def forget_file(self, file_id: str) -> bool:
        """Delete a file (False: there is none): for each finished batch it is the input, output or
        error file of, the partition's copies of its prompts and answers (storage/partition_purge.py)
        and the run's log, then the server's copy (last: a failed purge leaves a file to delete
        again). An unfinished batch's partition goes when the batch ends (`_release_input`). One
        file at a time (DELETE and the sweeps may ask for the same file at once): a file gone
        meanwhile is False, as one never made."""
        with self._purging:
            if self.store.content_path(file_id) is None:
                return False
            purged: set[str] = set()
            self._purge_batches_of(file_id, purged)
            with self.store.lock:
                self.store.delete_file(file_id)
            self._purge_batches_of(file_id, purged)  # those that finished meanwhile (later ones: `_release_input`)
            return True

    def _purge_batches_of(self, file_id: str, purged: set[str]) -> None:
        for record in self.store.batch_records(FINISHED):
            if file_id in _file_ids(record["batch"]) and record["batch"]["id"] not in purged:
                self._purge(record)
                purged.add(record["batch"]["id"])

    def sweep_expired_files(self) -> None:
        """Expired files deleted as DELETE deletes them; one that cannot be is tried at the next sweep
        (it is gone for clients already), without holding up the batches."""
        for file_id in self.store.expired_files(_now()):
            try:
                self.forget_file(file_id)
            except Exception as exc:  # noqa: BLE001 - said, and tried again at the next sweep
                logger.warning(
                    "batch-assets serve: deleting expired file %s failed (%s: %s)", file_id, type(exc).__name__, exc
                )

    def _purge(self, record: dict[str, Any]) -> None:
        batch_id = record["batch"]["id"]
        name = f"{batch_id}.jsonl"
        with self._purging:
            purge_partition(record["run"]["task"], partition_key_for(name), name)
            (self.store.runs / name).unlink(missing_ok=True)
            (self.store.logs / f"{batch_id}.log").unlink(missing_ok=True)

    def _result_file(self, batch_id: str, kind: str, content: bytes, made: list[str]) -> str | None:
        """A batch's output or error file, as OpenAI gives them: only when it has lines. It expires
        as the batch asked (`output_expires_after`) or after the server's retention."""
        if not content.strip():
            return None
        file_id = new_file_id()
        record = self.store.batch_record(batch_id)
        expiry = (record or {}).get("run", {}).get("output_expiry_seconds") or self.store.expiry_seconds
        obj = file_object(file_id, f"{batch_id}_{kind}.jsonl", len(content), "batch_output", expires_in=expiry)
        made.append(file_id)
        self.store.add_file(content, obj)
        return file_id

    def _fail(self, batch_id: str, code: str, message: str) -> None:
        def change(record: dict[str, Any]) -> dict[str, Any] | None:
            if record["batch"]["status"] in FINISHED:
                return None  # it ended meanwhile (cancelled, completed): that stands
            record["batch"].update(status="failed", failed_at=_now(), errors=batch_errors(code, message))
            return record

        self.store.update_batch(batch_id, change)
        self._release(batch_id)

    def _log_tail(self, batch_id: str) -> str:
        log = self.store.logs / f"{batch_id}.log"
        lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()] if log.exists() else []
        last = lines[-1].strip() if lines else "it wrote nothing"
        return f"{last} (the server's log: serve/logs/{batch_id}.log under DAGSTER_HOME)"


def _no_room(exc: BaseException) -> bool:
    """A write that failed for want of room (a full disk): it succeeds once room is made."""
    return isinstance(exc, (OSError, StorageError)) and getattr(exc, "errno", None) in NO_ROOM


def _cause(exc: BaseException) -> str:
    """What went wrong, for a batch's `errors` (clients read it): an OS error by its cause, not the paths."""
    number = getattr(exc, "errno", None)
    if isinstance(exc, (OSError, StorageError)) and isinstance(number, int):
        return f"{type(exc).__name__}: {os.strerror(number)}"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _file_ids(batch: dict[str, Any]) -> list[str]:
    return [batch[field] for field in ("input_file_id", "output_file_id", "error_file_id") if batch.get(field)]


def first_line_model(path: Path) -> str | None:
    """`body.model` of the file's first line, or None (an unreadable line is the run's error row)."""
    try:
        with path.open("rb") as handle:
            line = handle.readline(1 << 20)
        model = json.loads(line).get("body", {}).get("model")
    except (OSError, ValueError, AttributeError):
        return None
    return model if isinstance(model, str) else None
