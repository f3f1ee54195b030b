"""`batch-assets serve` driven by the official `openai` client over loopback: a real server process
on the tiny model, its batches run through Dagster (`batch-assets run` subprocesses).

One server (and one restart of it) for every check, to keep engine starts few: upload, create, a
queued batch cancelled before it starts, poll, download the output and error files (the bad lines
the openai_batch task turns into error lines), list with pagination, a batch cancelled while it
runs, refused uploads, crafted ids (404), a wrong key (401), and the state after a restart.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import time
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from batch_assets_tests.batch_api_fault_server import Faults, FaultServer
from batch_assets_tests.support import REPO_ROOT, free_port
from batch_assets_tests.support.openai_batch import as_jsonl, chat
from batch_assets_tests.support.processes import SERVE_KEY as KEY
from batch_assets_tests.support.processes import running_server

pytestmark = pytest.mark.slow


def wait_for(client: openai.OpenAI, batch_id: str, statuses: set[str], timeout: float = 240):
    deadline = time.monotonic() + timeout
    while (batch := client.batches.retrieve(batch_id)).status not in statuses:
        assert time.monotonic() < deadline, batch
        time.sleep(0.5)
    return batch


def batch_lines() -> list[dict | str]:
    good = [chat(f"q{i}", f"Question {i}: what is {i} plus {i}?", max_tokens=4, temperature=0) for i in range(6)]
    bad: list[dict | str] = [
        "{this is not json",
        chat("q1", "duplicate custom_id"),
        chat("tools", "x", tools=[{"type": "function", "function": {"name": "f"}}]),
        chat("too-long", "word " * 3000, max_tokens=4),
        {"method": "POST", "url": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": "x"}]}},
        {"custom_id": "emb", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}},
    ]
    return good + bad


def test_openai_client_drives_serve_end_to_end(workdir: tuple[Path, dict[str, str]]) -> None:
    tmp, env = workdir
    env = {**env, "BATCH_ASSETS_SERVE_API_KEY": KEY}
    port, log = free_port(), tmp / "serve.log"
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0)
    lines = batch_lines()
    requests = tmp / "requests.jsonl"
    requests.write_text(as_jsonl(lines), encoding="utf-8")
    with running_server(env, port, log, "--max-file-mb", "0.05"):
        uploaded = client.files.create(file=requests.open("rb"), purpose="batch")
        assert (uploaded.object, uploaded.purpose, uploaded.filename) == ("file", "batch", "requests.jsonl")
        assert uploaded.bytes == requests.stat().st_size
        assert client.files.content(uploaded.id).content == requests.read_bytes()
        batch = client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h", metadata={"k": "v"}
        )
        assert (batch.status, batch.metadata) == ("validating", {"k": "v"})
        # One batch runs at a time: this one waits behind the first and is cancelled before it starts.
        queued = client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        assert client.batches.cancel(queued.id).status == "cancelled"

        done = wait_for(client, batch.id, {"completed", "failed"})
        assert done.status == "completed", done.errors
        assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (12, 6, 6)
        assert done.in_progress_at and done.finalizing_at and done.completed_at
        assert done.usage is not None and done.usage.output_tokens > 0
        outputs = [json.loads(line) for line in client.files.content(done.output_file_id).text.splitlines()]
        errors = [json.loads(line) for line in client.files.content(done.error_file_id).text.splitlines()]
        assert [o["custom_id"] for o in outputs] == [f"q{i}" for i in range(6)]
        assert all(o["response"]["status_code"] == 200 and o["error"] is None for o in outputs)
        assert [(e["custom_id"], e["response"]["body"]["error"]["code"]) for e in errors] == [
            (None, "malformed_json"),
            ("q1", "duplicate_custom_id"),
            ("tools", "unsupported_field"),
            ("too-long", "prompt_too_long"),
            (None, "missing_custom_id"),
            ("emb", "unsupported_url"),
        ]
        assert client.files.retrieve(done.output_file_id).purpose == "batch_output"

        # A batch cancelled while its run is under way (its engine starting or inferring).
        running = client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        wait_for(client, running.id, {"in_progress"})
        time.sleep(2)
        assert client.batches.cancel(running.id).status == "cancelling"
        cancelled = wait_for(client, running.id, {"cancelled", "completed"}, timeout=90)
        assert cancelled.status == "cancelled" and cancelled.cancelled_at and cancelled.output_file_id is None

        first = client.batches.list(limit=2)
        assert [b.id for b in first.data] == [running.id, queued.id] and first.has_more
        assert [b.id for b in client.batches.list(limit=2, after=queued.id).data] == [batch.id]
        assert [b.id for b in client.batches.list()] == [running.id, queued.id, batch.id]  # auto-pagination

        refused_requests_and_ids(client, port, tmp)

    # A restart: the batches and their files are still there.
    with running_server(env, port, log, "--max-file-mb", "0.05"):
        again = client.batches.retrieve(batch.id)
        assert again.status == "completed" and again.output_file_id == done.output_file_id
        assert [json.loads(line) for line in client.files.content(done.output_file_id).text.splitlines()] == outputs
        assert client.batches.retrieve(running.id).status == "cancelled"

        # Deleting the input and the output files leaves nothing of their batches' partitions in
        # the data folder: drop copies, assets, OpenAI files, checkpoints, cached answers.
        data = tmp / "data"
        batch_ids = (batch.id, queued.id, running.id)
        assert any(b in path.name for path in data.rglob("*") for b in batch_ids)
        for file_id in (uploaded.id, done.output_file_id, done.error_file_id):
            assert client.files.delete(file_id).deleted
        assert [path for path in data.rglob("*") if any(b in path.name for b in batch_ids)] == []
        assert cached_answers(data / "storage" / "openai_batch") == 0
        assert not (tmp / "home" / "serve" / "logs" / f"{batch.id}.log").exists()


def cached_answers(task_storage: Path) -> int:
    with contextlib.closing(sqlite3.connect(task_storage / "_result_cache" / "results.sqlite3")) as db:
        return db.execute("SELECT count(*) FROM batch_assets_result_cache").fetchone()[0]


def refused_requests_and_ids(client: openai.OpenAI, port: int, tmp: Path) -> None:
    files = tmp / "home" / "serve" / "files"
    stored_before = sorted(files.iterdir())
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve("../../etc/passwd")
    with pytest.raises(openai.NotFoundError):
        client.files.content("file-../../../etc/passwd")
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_..%2F..%2Fetc%2Fpasswd")
    base = f"http://127.0.0.1:{port}/v1"
    auth = {"Authorization": f"Bearer {KEY}"}
    for path in ("/files/..%2F..%2Fetc%2Fpasswd/content", "/files/%2Fetc%2Fpasswd", "/files/file-0/content"):
        answer = httpx.get(base + path, headers=auth)
        assert answer.status_code == 404 and "root:" not in answer.text, (path, answer.text)
    wrong = openai.OpenAI(base_url=base, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.batches.list()
    assert httpx.get(base + "/batches").status_code == 401  # no key at all
    big = tmp / "big.jsonl"
    big.write_text(as_jsonl([chat(f"b{i}", "x" * 100) for i in range(600)]), encoding="utf-8")  # > 0.05 MB
    with pytest.raises(openai.APIStatusError) as too_large:
        client.files.create(file=big.open("rb"), purpose="batch")
    assert too_large.value.status_code == 413 and "--max-file-mb" in too_large.value.message
    not_requests = tmp / "not-requests.jsonl"
    not_requests.write_text("a,b\n1,2\n", encoding="utf-8")
    with pytest.raises(openai.BadRequestError, match="no line is a JSON object"):
        client.files.create(file=not_requests.open("rb"), purpose="batch")
    with pytest.raises(openai.BadRequestError, match="purpose must be 'batch'"):
        client.files.create(file=not_requests.open("rb"), purpose="fine-tune")
    assert sorted(files.iterdir()) == stored_before  # nothing refused was stored
    with pytest.raises(openai.BadRequestError, match="completion_window"):
        client.batches.create(input_file_id="file-" + "0" * 32, endpoint="/v1/chat/completions", completion_window="1h")
    with pytest.raises(openai.BadRequestError, match="no file with id"):
        client.batches.create(
            input_file_id="file-" + "0" * 32, endpoint="/v1/chat/completions", completion_window="24h"
        )


def batch_api_chat_task(folder: Path, provider: FaultServer) -> Path:
    """The shipped openai_batch task sending its lines on to `provider`'s Batch API."""
    text = (REPO_ROOT / "batch_assets" / "tasks" / "openai_batch.yaml").read_text(encoding="utf-8")
    engine = f"engine:\n  kind: batch_api\n  base_url: {provider.base_url}\n  model: tiny\n  poll_seconds: 0.2\n"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "openai_batch.yaml").write_text(text.replace("engine:\n", engine, 1), encoding="utf-8")
    return folder


def run_pid(home: Path, batch_id: str) -> int | None:
    """The pid of the batch's `batch-assets run`, as the server keeps it."""
    path = home / "serve" / "batches" / f"{batch_id}.json"
    return json.loads(path.read_text(encoding="utf-8"))["run"].get("pid") if path.exists() else None


def wait_until(done, what: str, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while not (found := done()):
        assert time.monotonic() < deadline, what
        time.sleep(0.1)
    return found


def test_serve_killed_9_and_restarted_collects_the_provider_batch_it_had_in_flight(tmp_path: Path) -> None:
    """A `serve` killed with SIGKILL while its batch's run waits on the provider: its run dies with it,
    and the restarted server's run collects the provider batch already submitted (one batch, paid once),
    as a re-run of `batch-assets run` after kill -9 does; nothing cancels it."""
    provider = FaultServer(Faults(hold=True)).start()  # batches stay in_progress until released
    home = tmp_path / "home"
    env = {
        **os.environ,
        "BATCH_ASSETS_DATA": str(tmp_path / "data"),
        "DAGSTER_HOME": str(home),
        "BATCH_ASSETS_TASKS_DIR": str(batch_api_chat_task(tmp_path / "tasks", provider)),
    }
    env.pop("BATCH_ASSETS_MODEL", None)
    port, log = free_port(), tmp_path / "serve.log"
    options = ("--embeddings-task", "openai_batch")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
    requests = tmp_path / "requests.jsonl"
    requests.write_text(as_jsonl([chat(f"q{i}", f"Question {i}") for i in range(6)]), encoding="utf-8")
    orphans: list[int] = []
    try:
        with running_server(env, port, log, *options) as server:
            uploaded = client.files.create(file=requests.open("rb"), purpose="batch")
            batch = client.batches.create(
                input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
            )
            # The run has submitted its provider batch and polls it.
            [provider_batch] = wait_until(
                lambda: [b for b in provider.batches.values() if b.polls >= 2], log.read_text()[-3000:]
            )
            child = run_pid(home, batch.id)
            assert child is not None
            orphans.append(child)
            os.kill(server.pid, signal.SIGKILL)
            server.wait(timeout=30)
            # Its run does not go on unwatched: it dies with the server (as kill -9 of a run would end it).
            wait_until(lambda: not _alive(child), f"the run {child} outlived its server", timeout=10)

        with running_server(env, port, log, *options):
            wait_until(lambda: run_pid(home, batch.id) not in (None, child), "the batch did not run again")
            orphans.append(run_pid(home, batch.id) or 0)
            provider.release()
            done = wait_for(client, batch.id, {"completed", "failed", "cancelled"})
            assert done.status == "completed", (done.errors, log.read_text()[-3000:])
            answers = [json.loads(line) for line in client.files.content(done.output_file_id).text.splitlines()]
    finally:
        for pid in orphans:  # on a failure, no run is left behind
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
        provider.stop()
    assert [a["custom_id"] for a in answers] == [f"q{i}" for i in range(6)]
    assert (done.request_counts.completed, done.request_counts.failed) == (6, 0)
    # The provider saw one batch of six lines, never cancelled.
    assert provider.cancelled == [] and provider.batches_created == 1
    assert len(provider.files[provider_batch.input_file_id].splitlines()) == 6


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
