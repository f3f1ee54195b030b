"""`engine.kind: batch_api` through the real path: `batch-assets run` (a Dagster run of the task's
assets) as a subprocess against `batch_api_fault_server.FaultServer` on loopback.

What only the real path shows: inside a Dagster step a stop arrives as Dagster's own
`DagsterExecutionInterruptedError`, not a KeyboardInterrupt; a batch the provider never finishes
must not hold the run past its window; conflicting answers in the provider's files land in
`validated_labels` and in the metadata of `inference_outputs` as the docs say.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import dagster as dg
import polars as pl
import pytest

from batch_assets_tests.batch_api_fault_server import FaultServer
from batch_assets_tests.support import REPO_ROOT
from batch_assets_tests.support.processes import VENV_CLI as CLI

# The slow tier (`make test-fast` leaves it out): each test runs `batch-assets run` against a server.
pytestmark = pytest.mark.slow

POSTS = 12


@pytest.fixture
def server() -> Iterator[FaultServer]:
    running = FaultServer().start()
    yield running
    running.stop()


def task_env(folder: Path, server: FaultServer, **engine: object) -> dict[str, str]:
    """The environment of a `batch-assets run` whose shipped sentiment task sends its requests to
    `server` (the data folder and DAGSTER_HOME are the `data_dir` fixture's)."""
    text = (REPO_ROOT / "batch_assets" / "tasks" / "sentiment.yaml").read_text(encoding="utf-8")
    settings = {"kind": "batch_api", "base_url": server.base_url, "model": "tiny", "poll_seconds": 0.2} | engine
    lines = "".join(f"  {key}: {value}\n" for key, value in settings.items())
    tasks = folder / "tasks"
    tasks.mkdir(parents=True, exist_ok=True)
    (tasks / "sentiment.yaml").write_text(text.replace("engine:\n", "engine:\n" + lines, 1), encoding="utf-8")
    return {**os.environ, "BATCH_ASSETS_TASKS_DIR": str(tasks)}


def start_run(folder: Path, env: dict[str, str]) -> subprocess.Popen:
    """`batch-assets run sentiment posts.jsonl` on POSTS posts, its own process group, output in cli.log."""
    inputs = folder / "inputs"
    inputs.mkdir(exist_ok=True)
    rows = [{"id": f"p-{i}", "text": f"post {i}: the parcel came after {i % 7} days"} for i in range(POSTS)]
    (inputs / "posts.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    with (folder / "cli.log").open("ab") as out:
        return subprocess.Popen(
            [str(CLI), "run", "sentiment", "posts.jsonl"],
            cwd=inputs,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def finished(child: subprocess.Popen, folder: Path, timeout: float) -> int:
    """The run's exit status; the test fails with the run's output when it has not ended in `timeout`."""
    try:
        return child.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
        pytest.fail(f"the run was still going after {timeout:g} s:\n{(folder / 'cli.log').read_text()[-3000:]}")


def kept_records(data: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in (data / "storage" / "sentiment" / "_batch_api").glob("*/*.json")]


def wait_until_polling(child: subprocess.Popen, folder: Path, data: Path, server: FaultServer) -> str:
    """The batch id once the run has kept it and the provider has been asked for its status: the
    run is then waiting in the polling loop of its Dagster step."""
    deadline = time.monotonic() + 120
    while True:
        records = kept_records(data)
        batch_id = records[0].get("batch_id") if records else None
        if batch_id and server.batches[batch_id].polls >= 2:
            return batch_id
        assert child.poll() is None, f"the run ended before it was stopped:\n{(folder / 'cli.log').read_text()[-3000:]}"
        assert time.monotonic() < deadline, (folder / "cli.log").read_text()[-3000:]
        time.sleep(0.05)


def labels(data: Path) -> pl.DataFrame:
    return pl.read_parquet(data / "storage" / "sentiment" / "validated_labels" / "posts.jsonl.parquet")


def inference_metadata() -> dict:
    """The metadata of the run's one materialization of inference_outputs, in the run's instance."""
    records = (
        dg.DagsterInstance.get()
        .fetch_materializations(
            dg.AssetRecordsFilter(asset_key=dg.AssetKey(["sentiment", "inference_outputs"])), limit=5
        )
        .records
    )
    assert len(records) == 1
    return {key: value.value for key, value in records[0].asset_materialization.metadata.items()}


# --- item 1: a stop cancels the batches in flight -------------------------------------------------


@pytest.mark.parametrize("stop", ["SIGINT to the process group (Ctrl-C)", "SIGTERM to the process"])
def test_a_stopped_run_cancels_its_batch_in_flight(tmp_path: Path, data_dir: Path, server: FaultServer, stop) -> None:
    server.faults.hold = True  # the provider never finishes: only the stop ends the run
    child = start_run(tmp_path, task_env(tmp_path, server))
    batch_id = wait_until_polling(child, tmp_path, data_dir, server)
    if stop.startswith("SIGINT"):
        os.killpg(child.pid, signal.SIGINT)
    else:
        os.kill(child.pid, signal.SIGTERM)
    status = finished(child, tmp_path, timeout=60)
    output = (tmp_path / "cli.log").read_text()
    assert status == 130, output[-3000:]
    assert server.cancelled == [batch_id], output[-3000:]
    assert server.batches[batch_id].status == "cancelled"
    assert [(r["batch_id"], r.get("cancelled_by_run")) for r in kept_records(data_dir)] == [(batch_id, True)]
    assert server.batches_created == 1

    # The re-run collects the cancelled batch (nothing in it) and sends its requests once more.
    server.release()
    assert finished(start_run(tmp_path, task_env(tmp_path, server)), tmp_path, timeout=120) == 0
    assert server.batches_created == 2
    assert labels(data_dir)["label"].to_list() == ["positive"] * POSTS
    assert kept_records(data_dir) == []


# --- item 2: a batch the provider never finishes ends with its window ----------------------------


@pytest.mark.parametrize("cancel", ["honoured, 5 answered", "ignored"])
def test_a_batch_past_its_window_is_cancelled_and_its_rows_expire(
    tmp_path: Path, data_dir: Path, server: FaultServer, cancel: str
) -> None:
    # The provider holds the batch in_progress past its expires_at (created_at + 2 s) and never ends it.
    server.faults.hold, server.faults.window_seconds = True, 2
    server.faults.answered_when_cancelled, server.faults.ignore_cancel = 5, cancel == "ignored"
    started = time.monotonic()
    child = start_run(tmp_path, task_env(tmp_path, server, expiry_grace_seconds=1))
    status = finished(child, tmp_path, timeout=90)
    output = (tmp_path / "cli.log").read_text()
    [batch_id] = server.batches
    assert server.cancelled == [batch_id], output[-3000:]
    assert time.monotonic() - started < 60

    # What the provider answered before the cancel is kept; every other row is a batch_expired error row.
    rows = labels(data_dir)
    answered = 5 if cancel.startswith("honoured") else 0
    kept_answers = rows.filter(pl.col("error").is_null())
    assert kept_answers["label"].to_list() == ["positive"] * answered, output[-3000:]
    expired = rows.filter(pl.col("error").is_not_null())["error"].to_list()
    assert len(expired) == POSTS - answered
    assert all(
        e.startswith(f"batch_expired: batch {batch_id} was not finished by the end of its window (") for e in expired
    )
    if answered:
        assert f"{POSTS} rows, {POSTS - answered} error rows" in output, output[-3000:]
    else:
        assert status == 1 and "ALL ROWS FAILED" in output, output[-3000:]
    assert server.batches_created == 1 and kept_records(data_dir) == []


# --- item 5: answers that contradict each other ---------------------------------------------------

ANSWER_COUNTS = ("batch_answer_conflicts", "batch_answers_repeated", "batch_errors_overridden")
LINE_COUNTS = ("batch_unknown_ids", "batch_unreadable_lines")


def test_a_request_answered_twice_differently_is_a_batch_conflict_row(
    tmp_path: Path, data_dir: Path, server: FaultServer
) -> None:
    server.faults.twice, server.faults.twice_answer = 3, "negative"  # the last line would win: silently
    status = finished(start_run(tmp_path, task_env(tmp_path, server)), tmp_path, timeout=120)
    output = (tmp_path / "cli.log").read_text()
    rows = labels(data_dir)
    assert rows.filter(pl.col("error").is_null())["label"].to_list() == ["positive"] * (POSTS - 3), output[-3000:]
    conflicts = rows.filter(pl.col("error").is_not_null())
    assert conflicts["label"].to_list() == [None] * 3
    assert (
        conflicts["error"].to_list()
        == [
            "batch_conflict: the provider answered this request 2 times with different content "
            "('positive', 'negative'); none of them is kept"
        ]
        * 3
    )
    metadata = inference_metadata()
    assert [metadata[key] for key in ANSWER_COUNTS + LINE_COUNTS] == [3, 0, 0, 0, 0]
    assert metadata["errors_by_code"] == {"batch_conflict": 3}
    assert status == 0 and f"{POSTS} rows, 3 error rows" in output, output[-3000:]


def test_a_200_answer_is_kept_over_the_error_file_and_odd_lines_are_counted(
    tmp_path: Path, data_dir: Path, server: FaultServer
) -> None:
    # Every request answered (200) and also listed in the error file: the error file would win and
    # every paid answer be thrown away. Two answered twice alike, two strangers, three broken lines.
    faults = server.faults
    faults.also_error, faults.twice, faults.unknown_ids, faults.unreadable_lines = POSTS, 2, 2, 3
    status = finished(start_run(tmp_path, task_env(tmp_path, server)), tmp_path, timeout=120)
    output = (tmp_path / "cli.log").read_text()
    rows = labels(data_dir)
    assert rows["label"].to_list() == ["positive"] * POSTS, output[-3000:]
    assert rows["error"].to_list() == [None] * POSTS
    metadata = inference_metadata()
    assert [metadata[key] for key in ANSWER_COUNTS + LINE_COUNTS] == [0, 2, POSTS, 2, 3]
    assert status == 0 and "OK run" in output, output[-3000:]
