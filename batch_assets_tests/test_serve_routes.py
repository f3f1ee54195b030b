"""`batch-assets serve` without a model: its routes through FastAPI's TestClient, its runner's
finalizing on a real store, with files on disk. The server driven by the openai client, with real
runs, is test_serve.py (slow)."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gzip
import json
import os
import resource
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import polars as pl
import pytest
import uvicorn
from fastapi.testclient import TestClient
from openai.types import Batch, FileObject
from starlette.datastructures import UploadFile

import batch_assets.serve.batch_runs as batch_runs
import batch_assets.serve.store as serve_store
from batch_assets.pipeline.inference_requests import request_keys
from batch_assets.serve.app import build_app
from batch_assets.serve.batch_runs import BatchRunner
from batch_assets.serve.objects import CreateBatch, batch_object, file_object
from batch_assets.serve.settings import CHAT_TASK, UploadLimits
from batch_assets.serve.store import ServeStore, new_batch_id, new_file_id
from batch_assets.storage.drop_files import partition_key_for
from batch_assets.storage.errors import storage_errors
from batch_assets.storage.locations import DATA_ENV, checkpoint_dir, drop_zone, output_path, task_storage_dir
from batch_assets.storage.result_cache import ResultCache
from batch_assets_tests.support import REPO_ROOT, free_port, stop_process_group

LINE = b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n'


@pytest.fixture
def store(tmp_path: Path) -> ServeStore:
    return ServeStore(tmp_path / "serve")


def client(store: ServeStore, api_key: str | None = None, max_bytes: int = 10_000) -> TestClient:
    runner = BatchRunner(store, {"/v1/chat/completions": CHAT_TASK})  # never started: no batch runs
    app = build_app(store, runner, UploadLimits(max_bytes=max_bytes, max_requests=100), api_key)
    return TestClient(app, base_url="http://127.0.0.1:8000")


def test_without_a_key_only_loopback_host_names_are_served(store: ServeStore) -> None:
    """A web page whose name resolves to 127.0.0.1 (DNS rebinding) sends its own name as Host."""
    api = client(store)
    assert api.get("/v1/batches").status_code == 200
    for host in ("localhost:8000", "127.0.0.1", "[::1]:8000"):
        assert api.get("/v1/batches", headers={"Host": host}).status_code == 200, host
    for host in ("evil.example", "evil.example:8000", "127.0.0.1:x", "[::1", "evil.example@127.0.0.1", "127.0.0.1/a"):
        refused = api.get("/v1/batches", headers={"Host": host})
        assert refused.status_code == 400, host
        error = is_openai_error(refused)  # OpenAI's error body, as every other refusal
        assert error["code"] == "invalid_host" and repr(host) in error["message"], error
        assert "127.0.0.1" in error["message"] and "BATCH_ASSETS_SERVE_API_KEY" in error["message"], error
    keyed = client(store, api_key="k")  # bound beyond loopback: the key guards it, any host name
    assert keyed.get("/v1/batches", headers={"Host": "batch.example", "Authorization": "Bearer k"}).status_code == 200


def test_the_bearer_scheme_is_read_whatever_its_case_and_the_key_exactly(store: ServeStore) -> None:
    """RFC 9110: an authentication scheme is case-insensitive; the key itself is not."""
    keyed = client(store, api_key="Key-1")
    for scheme in ("Bearer", "bearer", "BEARER"):
        assert keyed.get("/v1/batches", headers={"Authorization": f"{scheme} Key-1"}).status_code == 200, scheme
    for given in ("bearer key-1", "Bearer Key-12", "Basic Key-1", "Key-1", "Bearer", ""):
        refused = keyed.get("/v1/batches", headers={"Authorization": given})
        assert refused.status_code == 401, given
        assert is_openai_error(refused)["code"] == "invalid_api_key"


def test_a_run_whose_server_died_before_it_could_watch_it_kills_itself() -> None:
    """The run serve starts dies with its server (run_child.py); a server gone before the run asked
    for its parent-death signal (its parent is then another process) must not leave it running."""
    command = [sys.executable, "-m", "batch_assets.serve.run_child", "1", "tasks"]  # pid 1 is not its parent
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == -9 and done.stdout == "", (done.returncode, done.stdout, done.stderr)


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The sizes the upload's part is read in (-1: all of it at once)."""
    sizes: list[int] = []
    original = UploadFile.read

    async def read(self, size: int = -1) -> bytes:
        sizes.append(size)
        return await original(self, size)

    monkeypatch.setattr(UploadFile, "read", read)
    yield sizes


def upload(api: TestClient, content: bytes):
    return api.post("/v1/files", files={"file": ("in.jsonl", content)}, data={"purpose": "batch"})


def test_an_upload_is_copied_to_disk_in_chunks_and_checked_there(store: ServeStore, reads: list[int]) -> None:
    api = client(store, max_bytes=600 * 1024)
    content = LINE * 90 + b"not json\n" + LINE * 9  # 100 lines, ~7.8 KB
    answer = upload(api, content)
    assert answer.status_code == 200, answer.text
    assert answer.json()["bytes"] == len(content)
    assert api.get(f"/v1/files/{answer.json()['id']}/content").content == content
    assert reads and -1 not in reads  # never the whole part at once

    assert upload(api, LINE * 101).json()["error"]["code"] == "too_many_requests"
    assert upload(api, b"  \n").json()["error"]["code"] == "empty_file"
    assert upload(api, gzip.compress(LINE)).json()["error"]["code"] == "invalid_file"
    assert upload(api, b"a,b\n1,2\n").json()["error"]["code"] == "invalid_file"
    big = b'{"x": "' + b"y" * (700 * 1024) + b'"}\n'
    assert upload(api, big).status_code == 413
    # Refused uploads leave nothing behind.
    assert sorted(p.suffix for p in store.files.iterdir()) == [".json", ".jsonl"]


def waiting_batch(store: ServeStore) -> tuple[str, Path]:
    """A batch whose run has ended, with its input linked under runs/ as `_run` links it."""
    content = LINE * 2
    obj = store.add_file(content, {"id": "file-" + "0" * 32, "created_at": 0, "purpose": "batch"})
    batch = batch_object(
        new_batch_id(), CreateBatch(input_file_id=obj["id"], endpoint="/v1/chat/completions", completion_window="24h")
    )
    batch["status"] = "in_progress"
    store.save_batch({"batch": batch, "run": {"task": CHAT_TASK, "started": True}})
    link = store.runs / f"{batch['id']}.jsonl"
    os.link(store.files / f"{obj['id']}.jsonl", link)
    return batch["id"], link


def run_outputs(batch_id: str, output: bytes, errors: bytes) -> None:
    key = partition_key_for(f"{batch_id}.jsonl")
    for folder, content in (("batch_output", output), ("batch_errors", errors)):
        path = Path(str(task_storage_dir(CHAT_TASK) / folder / f"{key}.jsonl"))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)


def test_a_finished_batch_unlinks_its_run_input_and_notes_a_failed_exit_status(
    store: ServeStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(DATA_ENV, str(tmp_path / "data"))
    runner = BatchRunner(store, {"/v1/chat/completions": CHAT_TASK})
    answered = b'{"custom_id": "a", "response": {"status_code": 200, "body": {}}, "error": null}\n'

    batch_id, link = waiting_batch(store)
    run_outputs(batch_id, answered, b"")
    runner._after_run(batch_id, exit_status=0)
    record = store.batch_record(batch_id)
    assert record is not None and record["batch"]["status"] == "completed" and record["batch"]["errors"] is None
    assert not link.exists()  # DELETE /v1/files of the input frees its space

    batch_id, link = waiting_batch(store)
    run_outputs(batch_id, answered, b"")
    runner._after_run(batch_id, exit_status=1)  # outputs written, then a check at ERROR failed
    record = store.batch_record(batch_id)
    assert record is not None and record["batch"]["status"] == "completed"
    Batch.model_validate(record["batch"])  # OpenAI's schema, `errors` and `usage` included
    FileObject.model_validate(store.file_object(record["batch"]["output_file_id"]))
    [error] = record["batch"]["errors"]["data"]
    assert error["code"] == "batch_run_exit_status" and "status 1" in error["message"]
    assert not link.exists()

    batch_id, link = waiting_batch(store)  # a run that wrote nothing: the batch fails
    runner._after_run(batch_id, exit_status=1)
    record = store.batch_record(batch_id)
    assert record is not None and record["batch"]["status"] == "failed"
    assert json.dumps(record["batch"]["errors"]).count("batch_run_failed") == 1
    assert not link.exists()


def test_a_created_batch_is_validated_with_its_lines_counted(store: ServeStore) -> None:
    api = client(store)
    file_id = upload(api, LINE * 3 + LINE.rstrip(b"\n")).json()["id"]  # the last line without a newline
    batch = api.post(
        "/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    ).json()
    BatchRunner(store, {"/v1/chat/completions": CHAT_TASK})._validate_pending()
    validated = api.get(f"/v1/batches/{batch['id']}").json()
    assert (validated["status"], validated["request_counts"]["total"]) == ("in_progress", 4)
    Batch.model_validate(validated)
    FileObject.model_validate(api.get(f"/v1/files/{file_id}").json())


def test_the_runner_looks_at_its_batches_without_reading_a_file_and_a_restart_reads_them_back(
    store: ServeStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The runner claims and validates every second: its look must not re-read every batch ever made."""
    finished = []
    for _ in range(50):
        batch_id, _ = waiting_batch(store)
        store.update_batch(batch_id, lambda record: {**record, "batch": {**record["batch"], "status": "completed"}})
        finished.append(batch_id)
    waiting = new_batch_id()
    create = CreateBatch(input_file_id="file-" + "0" * 32, endpoint="/v1/chat/completions", completion_window="24h")
    store.save_batch({"batch": batch_object(waiting, create), "run": {"task": CHAT_TASK}})
    runner = BatchRunner(store, {"/v1/chat/completions": CHAT_TASK})

    def no_reads(*args, **kwargs):
        raise AssertionError("a batch record was read from disk")

    with monkeypatch.context() as patched:
        patched.setattr(Path, "read_text", no_reads)
        patched.setattr(Path, "read_bytes", no_reads)
        runner._validate_pending()
        assert runner._claim_next() == waiting
        assert runner._claim_next() is None

    # A copy handed out is not the store's: a change counts only when saved.
    record = store.batch_record(waiting)
    assert record is not None
    record["batch"]["status"] = "failed"
    assert store.batch_record(waiting)["batch"]["status"] == "in_progress"

    # A server started again on the same home sees every batch as it was saved.
    again = ServeStore(store.root)
    statuses = {record["batch"]["id"]: record["batch"]["status"] for record in again.batch_records()}
    assert statuses == {**dict.fromkeys(finished, "completed"), waiting: "in_progress"}
    assert again.batch_record(waiting)["run"]["started"] is True
    assert [r["batch"]["id"] for r in again.batch_records(("in_progress",))] == [waiting]


ANSWERED = b'{"custom_id": "a", "response": {"status_code": 200, "body": {}}, "error": null}\n'


def batch_of(store: ServeStore, batch_id: str) -> dict:
    record = store.batch_record(batch_id)
    assert record is not None
    return record["batch"]


def test_a_completed_batch_whose_cleanup_fails_is_never_finalized_again(
    store: ServeStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The purge after a batch completed failed: the batch stays completed with its one output
    file; the purge is tried again on its own, and a second look at the ended run changes nothing."""
    monkeypatch.setenv(DATA_ENV, str(tmp_path / "data"))
    runner = BatchRunner(store, {"/v1/chat/completions": CHAT_TASK})
    batch_id, _ = waiting_batch(store)
    run_outputs(batch_id, ANSWERED, b"")
    store.delete_file(batch_of(store, batch_id)["input_file_id"])  # deleted while it ran: purged when it ends
    purges: list[str] = []

    def purge(task: str, key: str, name: str) -> int:
        purges.append(name)
        if len(purges) == 1:
            raise RuntimeError("the result cache is locked")
        return 0

    monkeypatch.setattr(batch_runs, "purge_partition", purge)
    runner._unsettled[batch_id] = 0
    runner._settle_runs()
    done = batch_of(store, batch_id)
    assert done["status"] == "completed" and done["output_file_id"]
    assert runner._unsettled == {} and runner._unreleased == {batch_id}

    runner._after_run(batch_id, 0)  # as an unsettled run would be looked at again: nothing changes
    assert batch_of(store, batch_id) == done
    runner._release_pending()
    assert purges == [f"{batch_id}.jsonl"] * 2 and runner._unreleased == set()
    assert batch_of(store, batch_id) == done
    assert sorted(path.name for path in store.files.glob("file-*.json")) == [f"{done['output_file_id']}.json"]


def test_a_batch_that_cannot_be_settled_fails_and_only_a_full_disk_is_waited_out(
    store: ServeStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lasting error (a malformed output line, a write refused for another cause than room) fails
    its batch, naming the cause, and the runner goes on; a full disk keeps the batch to settle later."""
    monkeypatch.setenv(DATA_ENV, str(tmp_path / "data"))
    runner = BatchRunner(store, {"/v1/chat/completions": CHAT_TASK})

    malformed, _ = waiting_batch(store)
    run_outputs(malformed, b"not json\n", b"")
    runner._unsettled[malformed] = 0
    runner._settle_runs()  # no error: the step goes on
    batch = batch_of(store, malformed)
    assert batch["status"] == "failed" and runner._unsettled == {}
    [error] = batch["errors"]["data"]
    assert error["code"] == "batch_run_failed" and "JSONDecodeError" in error["message"]

    refused = finalizing_batch(store, ANSWERED)
    full = waiting_batch(store)[0]
    run_outputs(full, ANSWERED, b"")
    cause = {"errno": errno.EACCES}
    add_file = store.add_file

    def add_file_refused(content: bytes, obj: dict) -> dict:
        raise OSError(cause["errno"], os.strerror(cause["errno"]))

    monkeypatch.setattr(store, "add_file", add_file_refused)
    runner._finalize_pending()  # EACCES would fail again: the batch fails, the step goes on
    batch = batch_of(store, refused)
    assert batch["status"] == "failed" and "Permission denied" in batch["errors"]["data"][0]["message"]

    cause["errno"] = errno.ENOSPC
    runner._unsettled[full] = 0
    with pytest.raises(OSError, match="No space left"):
        runner._settle_runs()  # the runner backs off and tries again
    assert batch_of(store, full)["status"] == "finalizing" and runner._unsettled == {full: 0}
    monkeypatch.setattr(store, "add_file", add_file)  # room again
    runner._settle_runs()
    assert batch_of(store, full)["status"] == "completed" and runner._unsettled == {}


def test_a_cancel_while_a_restarted_server_kills_an_orphan_run_is_kept(
    store: ServeStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`_recover` runs while the server answers: a client's cancel while a run left by a killed
    server is being killed must not be overwritten."""
    running, _ = waiting_batch(store)  # in_progress, its run started by the killed server
    validating = new_batch_id()
    create = CreateBatch(input_file_id="file-" + "0" * 32, endpoint="/v1/chat/completions", completion_window="24h")
    store.save_batch({"batch": batch_object(validating, create), "run": {"task": CHAT_TASK, "started": False}})
    runner = BatchRunner(store, {"/v1/chat/completions": CHAT_TASK})

    def kill_orphan(pid: int | None, started: float | None) -> None:
        for batch_id in (running, validating):
            runner.cancel(batch_id)  # a client, while the orphan is being killed

    monkeypatch.setattr(batch_runs, "kill_orphan", kill_orphan)
    runner._recover()
    assert batch_of(store, running)["status"] == "cancelled"
    assert batch_of(store, validating)["status"] == "cancelled"


def test_a_batch_reset_by_a_restart_and_cancelled_at_once_purges_its_deleted_input(
    store: ServeStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch that ran before a restart has a partition; cancelled before it runs again, with its
    input deleted meanwhile, that partition goes as any ended batch's does."""
    monkeypatch.setenv(DATA_ENV, str(tmp_path / "data"))
    batch_id, _ = waiting_batch(store)
    run_outputs(batch_id, ANSWERED, b"")  # what its run wrote before the server stopped
    runner = BatchRunner(store, {"/v1/chat/completions": CHAT_TASK})
    runner._recover()
    assert store.batch_record(batch_id)["run"]["started"] is False
    assert runner.forget_file(batch_of(store, batch_id)["input_file_id"])  # not finished: nothing purged yet
    output = Path(str(task_storage_dir(CHAT_TASK) / "batch_output" / f"{partition_key_for(f'{batch_id}.jsonl')}.jsonl"))
    assert output.exists()
    assert runner.cancel(batch_id)["batch"]["status"] == "cancelled"
    assert not output.exists()


def test_a_file_asked_to_be_forgotten_twice_at_once_is_purged_once(
    store: ServeStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DELETE and the sweeps (the runner's, an upload's) may forget the same file at once."""
    runner = BatchRunner(store, {"/v1/chat/completions": CHAT_TASK})
    batch_id, _ = waiting_batch(store)
    output = store.add_file(ANSWERED, file_object(new_file_id(), "out.jsonl", len(ANSWERED), "batch_output"))
    store.update_batch(
        batch_id,
        lambda record: {**record, "batch": {**record["batch"], "status": "completed", "output_file_id": output["id"]}},
    )
    purges: list[str] = []

    def slow_purge(task: str, key: str, name: str) -> int:
        purges.append(name)
        time.sleep(0.3)
        return 0

    monkeypatch.setattr(batch_runs, "purge_partition", slow_purge)
    answers: list[bool | BaseException] = []

    def forget() -> None:
        try:
            answers.append(runner.forget_file(output["id"]))
        except BaseException as exc:  # noqa: BLE001 - the test's answer
            answers.append(exc)

    threads = [threading.Thread(target=forget) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(answers, key=str) == [False, True] and purges == [f"{batch_id}.jsonl"]


def test_an_upload_sweeps_expired_files_off_the_event_loop(store: ServeStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """The sweep reads and deletes files and purges partitions: not on the server's event loop."""
    swept: list[bool] = []

    def sweep(self: BatchRunner) -> None:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            swept.append(True)  # a worker thread: no loop runs here
        else:
            swept.append(False)

    monkeypatch.setattr(BatchRunner, "sweep_expired_files", sweep)
    assert upload(client(store), LINE).status_code == 200
    assert swept == [True]


def test_serve_refuses_sizes_and_days_that_are_not_finite_numbers(capsys: pytest.CaptureFixture[str]) -> None:
    from batch_assets.cli import build_parser

    for option in ("--max-stored-mb", "--file-expiry-days", "--max-file-mb"):
        for value in ("nan", "inf", "0", "-1", "ten"):
            with pytest.raises(SystemExit) as exited:
                build_parser().parse_args(["serve", option, value])
            assert exited.value.code == 2
            assert f"argument {option}: must be a number more than 0 (not {value})" in capsys.readouterr().err
    assert build_parser().parse_args(["serve", "--file-expiry-days", "0.5"]).file_expiry_days == 0.5


# --- the real server (`batch-assets serve` in a subprocess, no model: no batch here reaches an engine) ---


@dataclass
class Served:
    base: str  # http://127.0.0.1:<port>/v1
    process: subprocess.Popen
    output: list[bytes]

    def post_file(self, content: bytes, headers: dict[str, str] | None = None, **fields: str) -> httpx.Response:
        data = {"purpose": "batch", **fields}
        return httpx.post(f"{self.base}/files", files={"file": ("in.jsonl", content)}, data=data, headers=headers)

    def create_batch(self, file_id: str) -> httpx.Response:
        body = {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
        return httpx.post(f"{self.base}/batches", json=body)

    def log(self) -> str:
        return b"".join(self.output).decode(errors="replace")[-3000:]


def _drain(stream, into: list[bytes]) -> None:
    for line in iter(stream.readline, b""):
        into.append(line)


@contextlib.contextmanager
def serve(*options: str) -> Iterator[Served]:
    """`batch-assets serve` on a free port with this test's DATA and DAGSTER_HOME (the `data_dir`
    fixture). Its output goes through a pipe (which a file size limit does not touch)."""
    port = free_port()
    command = [sys.executable, "-m", "batch_assets.cli", "serve", "--port", str(port), *options]
    process = subprocess.Popen(
        command, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    served = Served(f"http://127.0.0.1:{port}/v1", process, [])
    threading.Thread(target=_drain, args=(process.stdout, served.output), daemon=True).start()
    try:
        deadline = time.monotonic() + 90
        while True:
            assert process.poll() is None, served.log()
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{served.base}/batches").is_success:
                    break
            assert time.monotonic() < deadline, served.log()
            time.sleep(0.3)
        yield served
    finally:
        stop_process_group(process)


def fill_disk(served: Served) -> None:
    """Every write of the server to a file fails from now on (RLIMIT_FSIZE 0: EFBIG, File too large),
    as on a full disk."""
    resource.prlimit(served.process.pid, resource.RLIMIT_FSIZE, (0, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


def lift_file_size_limit(served: Served) -> None:
    """The disk has room again."""
    hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
    resource.prlimit(served.process.pid, resource.RLIMIT_FSIZE, (hard, hard))


def prepared_home() -> ServeStore:
    """The home a server starts on, made before the test limits its writes (Dagster's storages)."""
    subprocess.run(
        [sys.executable, "-c", "from batch_assets.runtime.instance import prepare_instance; prepare_instance()"],
        cwd=REPO_ROOT,
        check=True,
    )
    return ServeStore(Path(os.environ["DAGSTER_HOME"]) / "serve")


def is_openai_error(answer: httpx.Response) -> dict:
    """OpenAI's error body, all four fields there; the error itself."""
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, answer.text
    assert error["message"], answer.text
    return error


def until(check, timeout: float = 60.0, every: float = 0.3):
    deadline = time.monotonic() + timeout
    while not (found := check()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(every)
    return found


@pytest.mark.slow
def test_an_upload_or_a_batch_on_a_full_disk_gets_openai_error_shape(data_dir: Path) -> None:
    """A full disk (every write to a file fails: RLIMIT_FSIZE 0 set on the running server) refuses an upload and a
    batch with OpenAI's JSON error (507, and `x-should-retry: false`: the official client would
    otherwise send a 200 MB file three more times); nothing half-stored stays; with room again, the
    server goes on."""
    store = prepared_home()
    kept = store.add_file(LINE, file_object("file-" + "1" * 32, "in.jsonl", len(LINE), "batch"))
    stored_before = sorted(store.files.iterdir())
    with serve() as served:
        fill_disk(served)
        upload_answer = served.post_file(LINE * 3)
        assert upload_answer.status_code == 507, upload_answer.text
        error = is_openai_error(upload_answer)
        assert (error["type"], error["code"]) == ("server_error", "insufficient_storage")
        assert "File too large" in error["message"] and str(data_dir.parent) not in error["message"]
        assert upload_answer.headers["x-should-retry"] == "false"

        batch_answer = served.create_batch(kept["id"])
        assert batch_answer.status_code == 507, batch_answer.text
        assert is_openai_error(batch_answer)["code"] == "insufficient_storage"
        assert sorted(store.files.iterdir()) == stored_before  # nothing half-stored
        assert list(store.batches.iterdir()) == []

        lift_file_size_limit(served)
        assert served.post_file(LINE * 3).status_code == 200


def finalizing_batch(store: ServeStore, answered: bytes) -> str:
    """A batch whose run wrote its outputs and whose server was killed while finalizing it."""
    batch_id, _ = waiting_batch(store)
    store.update_batch(batch_id, lambda record: {**record, "batch": {**record["batch"], "status": "finalizing"}})
    run_outputs(batch_id, answered, b"")
    return batch_id


@contextlib.contextmanager
def serve_in_process(store: ServeStore) -> Iterator[Served]:
    """The server `batch-assets serve` starts (store, runner, app, uvicorn), in this process on a free
    port, so that a test can make its writes fail; real HTTP requests reach it."""
    port = free_port()
    runner = BatchRunner(store, {"/v1/chat/completions": CHAT_TASK})
    app = build_app(store, runner, UploadLimits(max_bytes=10_000, max_requests=100), None)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    runner.start()
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        until(lambda: server.started)
        yield Served(f"http://127.0.0.1:{port}/v1", None, [])  # type: ignore[arg-type]  # no process
    finally:
        server.should_exit = True
        thread.join()
        runner.stop()


@pytest.mark.slow
def test_the_batch_runner_survives_failed_writes_and_the_server_refuses_work_meanwhile(
    data_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The runner's steps fail while the disk is full (the store's one write function raises ENOSPC,
    as `write_bytes_atomically` raises it on a full disk): the runner backs off and tries again, the
    server answers 503 to new files and batches (not 200 for work that would never run), reads
    still answer; with room again the batch is finalized and new work is taken."""
    store = prepared_home()
    answered = b'{"custom_id": "a", "response": {"status_code": 200, "body": {}}, "error": null}\n'
    batch_id = finalizing_batch(store, answered)  # a server was killed while it finalized this batch
    input_id = store.batch_record(batch_id)["batch"]["input_file_id"]
    full = threading.Event()
    write = serve_store.write_bytes_atomically

    def write_on_a_full_disk(path, data: bytes) -> None:
        if full.is_set():
            with storage_errors("writing", path):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        write(path, data)

    monkeypatch.setattr(serve_store, "write_bytes_atomically", write_on_a_full_disk)
    full.set()
    with serve_in_process(store) as served:
        refused = until(lambda: (answer := served.create_batch(input_id)).status_code == 503 and answer)
        error = is_openai_error(refused)
        assert (error["type"], error["code"]) == ("server_error", "batch_runner_unavailable")
        assert "no space left on device" in error["message"].lower() and "/" not in error["message"]
        assert is_openai_error(served.post_file(LINE))["code"] == "batch_runner_unavailable"
        assert httpx.get(f"{served.base}/batches/{batch_id}").json()["status"] == "finalizing"

        full.clear()
        done = until(
            lambda: (b := httpx.get(f"{served.base}/batches/{batch_id}").json())["status"] != "finalizing" and b
        )
        assert done["status"] == "completed", done
        assert httpx.get(f"{served.base}/files/{done['output_file_id']}/content").content == answered
        assert until(lambda: served.post_file(LINE).status_code == 200)
        assert [b["id"] for b in httpx.get(f"{served.base}/batches").json()["data"]] == [batch_id]


def request_line(marker: str) -> bytes:
    body = {"messages": [{"role": "user", "content": f"prompt {marker}"}], "max_tokens": 4}
    return (
        json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": body}).encode() + b"\n"
    )


def completed_batch(store: ServeStore, marker: str) -> tuple[str, str, str]:
    """A completed batch as its run left it: the input and output files of the server, and the
    partition's drop copy, four assets' parquet, OpenAI output and error files, a checkpoint, the
    result cache's row and the run's log, each holding `marker` (in the prompt or the answer).
    (batch id, input file id, output file id)."""
    content, answer = request_line(marker), f"answer {marker}"
    output = json.dumps({"custom_id": "a", "response": {"status_code": 200, "body": answer}}).encode() + b"\n"
    input_id, output_id = new_file_id(), new_file_id()
    store.add_file(content, file_object(input_id, "in.jsonl", len(content), "batch"))
    store.add_file(output, file_object(output_id, "out.jsonl", len(output), "batch_output"))
    create = CreateBatch(input_file_id=input_id, endpoint="/v1/chat/completions", completion_window="24h")
    batch = batch_object(new_batch_id(), create)
    batch.update(status="completed", output_file_id=output_id)
    store.save_batch({"batch": batch, "run": {"task": CHAT_TASK, "started": True, "exit_status": 0}})
    (store.logs / f"{batch['id']}.log").write_text(f"OK run {marker}\n")

    key = partition_key_for(f"{batch['id']}.jsonl")
    drop = Path(str(drop_zone(CHAT_TASK) / f"{batch['id']}.jsonl"))
    drop.parent.mkdir(parents=True, exist_ok=True)
    drop.write_bytes(content)
    prompt, params = f"<user>prompt {marker}</user>", '{"max_tokens": 4}'
    formatted = pl.DataFrame({"row_id": [0], "prompt": [prompt], "request_params": [params], "error": [None]})
    frames = {
        "raw_prompts": pl.DataFrame({"row_id": [0], "body": [content.decode()], "error": [None]}),
        "formatted_prompts": formatted,
        "inference_outputs": formatted.with_columns(generated_text=pl.lit(answer)),
        "validated_labels": formatted.with_columns(generated_text=pl.lit(answer)),
    }
    for asset, frame in frames.items():
        path = Path(str(output_path(CHAT_TASK, asset, key)))
        path.parent.mkdir(parents=True, exist_ok=True)
        frame.write_parquet(path, compression="uncompressed")  # the marker readable in the file's bytes
    run_outputs(batch["id"], output, b"")
    chunk = Path(str(checkpoint_dir(CHAT_TASK, key))) / "fp0" / "chunk-0.parquet"
    chunk.parent.mkdir(parents=True)
    pl.DataFrame({"request_key": ["k"], "generated_text": [answer]}).write_parquet(chunk, compression="uncompressed")
    [request_key] = request_keys([prompt], [0], True, [params])
    cached = pl.DataFrame(
        {"request_key": [request_key], "generated_text": [answer], "finish_reason": ["stop"], "error": [None]}
    ).with_columns(num_prompt_tokens=pl.lit(3), num_generated_tokens=pl.lit(2))
    assert ResultCache(task_storage_dir(CHAT_TASK), "fp0").add(cached) == 1
    return batch["id"], input_id, output_id


def files_holding(folder: Path, text: str, *, cache: bool = True) -> list[Path]:
    """`cache=False`: not the result cache's files (a checkpoint moves rows from its log to its file)."""
    found = [path for path in folder.rglob("*") if path.is_file() and text.encode() in path.read_bytes()]
    return [path for path in found if cache or "_result_cache" not in path.parts]


@pytest.mark.slow
def test_deleting_a_batch_file_removes_the_batch_partition_everywhere(data_dir: Path) -> None:
    """DELETE /v1/files of a batch's input removes the partition's copies of its prompts and answers
    in the data folder (drop copy, assets, OpenAI files, checkpoints, result cache rows) and the
    server's run log; deleting its output file too leaves nothing of it. Another batch keeps all."""
    store = prepared_home()
    gone_id, gone_input, gone_output = completed_batch(store, "MARKER-GONE")
    kept_id, _, _ = completed_batch(store, "MARKER-KEPT")
    home_serve = store.root
    assert (
        len(files_holding(data_dir, "MARKER-GONE")) == 8
    )  # drop copy, 4 assets, output, checkpoint, the cache (its file or its log)
    kept_before = files_holding(data_dir, "MARKER-KEPT", cache=False)
    with serve() as served:
        client = openai.OpenAI(base_url=served.base, api_key="unused-on-loopback", max_retries=0)
        assert client.files.delete(gone_input).deleted
        with pytest.raises(openai.NotFoundError):
            client.files.retrieve(gone_input)
        assert files_holding(data_dir, "MARKER-GONE") == []
        assert not (store.logs / f"{gone_id}.log").exists()
        assert client.files.content(gone_output).text.count("MARKER-GONE") == 1  # the user's output file stays
        assert client.files.delete(gone_output).deleted
        assert files_holding(data_dir, "MARKER-GONE") == files_holding(home_serve, "MARKER-GONE") == []
        assert client.batches.retrieve(gone_id).status == "completed"  # the batch object stays, as OpenAI's
    assert files_holding(data_dir, "MARKER-KEPT", cache=False) == kept_before
    cache = ResultCache(task_storage_dir(CHAT_TASK), "fp0")
    assert cache.lookup()["generated_text"].to_list() == ["answer MARKER-KEPT"]
    assert (store.logs / f"{kept_id}.log").exists()


@pytest.mark.slow
def test_a_keyless_server_refuses_cross_site_requests_and_bounds_what_it_stores(data_dir: Path) -> None:
    """A web page the user visits must not drive a keyless server (a multipart upload needs no CORS
    preflight); uploads count against a total quota and expire (30 days by default, `expires_after`
    as OpenAI's)."""
    prepared_home()
    files = Path(os.environ["DAGSTER_HOME"]) / "serve" / "files"
    with serve("--max-stored-mb", "0.02", "--file-expiry-days", "0.0001") as served:
        port = served.base.split(":")[2].split("/")[0]
        for headers in (
            {"Origin": "http://evil.example"},
            {"Origin": "null"},
            {"Origin": "http://localhost:3000"},
            {"Sec-Fetch-Site": "cross-site"},
            {"Sec-Fetch-Site": "same-site"},
        ):
            answer = httpx.get(f"{served.base}/batches", headers=headers)
            assert answer.status_code == 403, (headers, answer.text)
            assert is_openai_error(answer)["code"] == "cross_site_request"
        for headers in ({"Origin": f"http://127.0.0.1:{port}"}, {"Sec-Fetch-Site": "same-origin"}, {}):
            assert httpx.get(f"{served.base}/batches", headers=headers).status_code == 200, headers
        page_upload = served.post_file(
            LINE * 90, headers={"Origin": "https://evil.example", "Sec-Fetch-Site": "cross-site"}
        )
        assert page_upload.status_code == 403
        assert list(files.iterdir()) == []

        client = openai.OpenAI(base_url=served.base, api_key="unused-on-loopback", max_retries=0)
        soon = client.files.create(file=("a.jsonl", LINE * 90), purpose="batch")  # 7,110 bytes
        assert soon.expires_at == soon.created_at + 8  # --file-expiry-days 0.0001: 8.64 s
        later = client.files.create(
            file=("b.jsonl", LINE * 90), purpose="batch", expires_after={"anchor": "created_at", "seconds": 3600}
        )
        assert later.expires_at == later.created_at + 3600
        with pytest.raises(openai.BadRequestError, match="expires_after"):
            client.files.create(
                file=("c.jsonl", LINE), purpose="batch", expires_after={"anchor": "created_at", "seconds": 60}
            )
        over = served.post_file(LINE * 90)  # 21,330 bytes stored with it: over 0.02 MB
        assert over.status_code == 400, over.text
        error = is_openai_error(over)
        assert (error["code"], error["param"]) == ("storage_quota_exceeded", "file")
        assert "--max-stored-mb" in error["message"]
        assert len(list(files.iterdir())) == 4  # two files, each content and object

        until(lambda: httpx.get(f"{served.base}/files/{soon.id}").status_code == 404, timeout=30)
        until(lambda: not (files / f"{soon.id}.jsonl").exists(), timeout=30)  # removed at the runner's next look
        assert client.files.retrieve(later.id).id == later.id
        assert served.post_file(LINE * 90).status_code == 200  # the expired file's bytes count no more
