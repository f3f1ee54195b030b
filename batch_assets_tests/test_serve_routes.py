"""`batch-assets serve` without a model: its routes through FastAPI's TestClient, its runner's
finalizing on a real store, with files on disk. The server driven by the openai client, with real
runs, is test_serve.py (slow)."""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from openai.types import Batch, FileObject
from starlette.datastructures import UploadFile

from batch_assets.serve.app import build_app
from batch_assets.serve.batch_runs import BatchRunner
from batch_assets.serve.objects import CreateBatch, batch_object
from batch_assets.serve.settings import CHAT_TASK, UploadLimits
from batch_assets.serve.store import ServeStore, new_batch_id
from batch_assets.storage.drop_files import partition_key_for
from batch_assets.storage.locations import DATA_ENV, task_storage_dir

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
    assert api.get("/v1/batches", headers={"Host": "evil.example"}).status_code == 400
    assert api.get("/v1/batches", headers={"Host": "evil.example:8000"}).status_code == 400
    keyed = client(store, api_key="k")  # bound beyond loopback: the key guards it, any host name
    assert keyed.get("/v1/batches", headers={"Host": "batch.example", "Authorization": "Bearer k"}).status_code == 200


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
