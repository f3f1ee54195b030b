"""`engine.kind: batch_api` against faults a provider produces only by chance.

The server is `batch_api_fault_server.FaultServer`: a real HTTP server (FastAPI under uvicorn, on
loopback) that speaks OpenAI's Files and Batches API, driven by the official `openai` client as a
provider would be, failing on demand. The engine's records are real JSON files (storage/batch_records.py).
Each case checks that every request comes back once, as an answer or an error row, or that the run
fails naming the setting, and counts the batches created on the server (no request paid for twice).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from upath import UPath

from batch_assets.engines.batch_api_engine import BatchApiEngine
from batch_assets.engines.batch_api_failures import BatchApiError
from batch_assets.pipeline.engine_contract import Generation, Prompt
from batch_assets.pipeline.task_spec import TaskSpec, load_task_spec
from batch_assets.runtime import interrupts
from batch_assets.storage.batch_records import BatchRecordStore
from batch_assets_tests.batch_api_fault_server import FaultServer
from batch_assets_tests.support import REPO_ROOT

KEY_ENV = "BATCH_API_TEST_KEY"


@pytest.fixture
def server() -> Iterator[FaultServer]:
    running = FaultServer().start()
    yield running
    running.stop()


def batch_task(tmp_path: Path, base_url: str, **engine: object) -> TaskSpec:
    """The shipped sentiment task on a batch API, as a user would write it."""
    text = (REPO_ROOT / "batch_assets" / "tasks" / "sentiment.yaml").read_text(encoding="utf-8")
    settings = {"kind": "batch_api", "base_url": base_url, "model": "tiny", "poll_seconds": 0.05}
    settings |= engine
    lines = "".join(f"  {key}: {value}\n" for key, value in settings.items())
    path = tmp_path / "tasks" / "sentiment.yaml"
    path.parent.mkdir(exist_ok=True)
    path.write_text(text.replace("engine:\n", "engine:\n" + lines, 1), encoding="utf-8")
    return load_task_spec(path)


def prompts(count: int) -> list[Prompt]:
    return [Prompt(token_ids=(1, 2), messages=({"role": "user", "content": f"post number {i}"},)) for i in range(count)]


def run_stream(task: TaskSpec, records: Path, count: int) -> list[Generation]:
    """Every prompt's generation, by position; each position exactly once."""
    engine = BatchApiEngine()
    with engine.session(task, engine.settings(task), records=BatchRecordStore(UPath(records))) as session:
        results = list(session.stream(prompts(count)))
    positions = [position for position, _ in results]
    assert sorted(positions) == list(range(count)), positions
    return [generation for _, generation in sorted(results, key=lambda item: item[0])]


def kept(records: Path) -> list[dict]:
    return BatchRecordStore(UPath(records)).load()


def test_rows_split_into_files_at_the_request_limit_and_answered(tmp_path: Path, server: FaultServer) -> None:
    task = batch_task(tmp_path, server.base_url, max_requests_per_file=2)
    generations = run_stream(task, tmp_path / "records", 5)
    assert [g.text for g in generations] == ["positive"] * 5
    assert all(g.error is None and g.num_prompt_tokens == 7 for g in generations)
    assert server.batches_created == 3  # 2 + 2 + 1 requests
    assert kept(tmp_path / "records") == []  # collected whole: the records go with the session


def test_a_file_refused_at_a_line_makes_that_row_an_error_and_sends_the_rest(
    tmp_path: Path, server: FaultServer
) -> None:
    server.faults.refuse_upload_line = 2
    generations = run_stream(batch_task(tmp_path, server.base_url), tmp_path / "records", 4)
    assert generations[1].error is not None and generations[1].error.startswith("batch_refused: line 2")
    assert [g.text for i, g in enumerate(generations) if i != 1] == ["positive"] * 3
    assert server.batches_created == 1


def test_a_batch_failed_at_a_line_makes_that_row_an_error_and_sends_the_rest(
    tmp_path: Path, server: FaultServer
) -> None:
    server.faults.fail_batch_line = 3
    generations = run_stream(batch_task(tmp_path, server.base_url), tmp_path / "records", 4)
    assert generations[2].error is not None and "line 3" in generations[2].error
    assert [g.text for i, g in enumerate(generations) if i != 2] == ["positive"] * 3
    assert server.batches_created == 2


def test_an_expired_batch_gives_its_half_and_error_rows_or_one_resubmission(
    tmp_path: Path, server: FaultServer
) -> None:
    server.faults.finish = "expired"
    generations = run_stream(batch_task(tmp_path, server.base_url), tmp_path / "records", 4)
    assert [g.text for g in generations] == ["positive", "positive", None, None]
    assert all(g.error is not None and g.error.startswith("batch_expired") for g in generations[2:])
    assert server.batches_created == 1

    task = batch_task(tmp_path, server.base_url, resubmit_failed=True)
    generations = run_stream(task, tmp_path / "again", 4)
    # The second batch (the two unanswered) expires with one answered: sent once more, never twice.
    assert [g.text for g in generations] == ["positive", "positive", "positive", None]
    assert generations[3].error is not None and generations[3].error.startswith("batch_expired")
    assert server.batches_created == 3


def test_an_output_file_missing_custom_ids_gives_error_rows(tmp_path: Path, server: FaultServer) -> None:
    server.faults.drop_last, server.faults.error_last = 1, 1
    generations = run_stream(batch_task(tmp_path, server.base_url), tmp_path / "records", 4)
    assert [g.text for g in generations] == ["positive", "positive", None, None]
    assert generations[2].error == ("batch_error: HTTP 500: The server had an error while processing your request")
    assert generations[3].error is not None and generations[3].error.startswith("batch_missing: batch ")
    assert server.batches_created == 1


def test_a_batch_create_whose_answer_was_lost_is_found_not_made_twice(tmp_path: Path, server: FaultServer) -> None:
    # The create reached the server (the batch exists) but its answer was a 500: the client's own
    # retry of that POST would make (and bill) a second batch of the same requests.
    server.faults.lose_create_answer = True
    task = batch_task(tmp_path, server.base_url, max_retries=2)
    assert [g.text for g in run_stream(task, tmp_path / "records", 3)] == ["positive"] * 3
    assert server.batches_created == 1
    assert [b.metadata.get("batch_assets_record") for b in server.batches.values()] != [None]


def test_a_server_restart_mid_poll_is_waited_out(tmp_path: Path, server: FaultServer) -> None:
    server.faults.hold = True
    task = batch_task(tmp_path, server.base_url, max_retries=2, poll_seconds=0.3)
    results: list[Generation] = []
    worker = threading.Thread(target=lambda: results.extend(run_stream(task, tmp_path / "records", 3)))
    worker.start()
    _wait_for(lambda: server.batches_created == 1 and kept(tmp_path / "records")[0].get("batch_id"))
    server.stop()
    time.sleep(0.5)  # polls fail: connection refused
    server.start()
    server.release()
    worker.join(timeout=60)
    assert [g.text for g in results] == ["positive"] * 3
    assert server.batches_created == 1


def test_a_wrong_key_fails_the_run_naming_api_key_env(
    tmp_path: Path, server: FaultServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    server.faults.key = "right-key"
    monkeypatch.setenv(KEY_ENV, "wrong-key")
    task = batch_task(tmp_path, server.base_url, api_key_env=KEY_ENV, max_retries=0)
    with pytest.raises(BatchApiError, match="HTTP 401") as failure:
        run_stream(task, tmp_path / "records", 2)
    assert "engine.api_key_env" in str(failure.value) and "wrong-key" not in str(failure.value)
    assert server.batches_created == 0


def test_quota_429_fails_the_run_naming_the_settings_then_a_rerun_submits_once(
    tmp_path: Path, server: FaultServer
) -> None:
    server.faults.quota = True
    task = batch_task(tmp_path, server.base_url, max_retries=0)
    with pytest.raises(BatchApiError, match="HTTP 429") as failure:
        run_stream(task, tmp_path / "records", 3)
    assert "engine.max_retries" in str(failure.value) and "engine.max_requests_per_file" in str(failure.value)
    assert server.batches_created == 0
    server.faults.quota = False
    assert [g.text for g in run_stream(task, tmp_path / "records", 3)] == ["positive"] * 3
    assert server.batches_created == 1
    assert kept(tmp_path / "records") == []


def test_a_stop_cancels_the_batch_and_a_rerun_sends_what_it_left_once(tmp_path: Path, server: FaultServer) -> None:
    server.faults.hold = True
    task = batch_task(tmp_path, server.base_url)
    outcome: list[BaseException] = []

    def run() -> None:
        try:
            run_stream(task, tmp_path / "records", 3)
        except BaseException as exc:  # noqa: BLE001 - the stop is what this test expects
            outcome.append(exc)

    worker = threading.Thread(target=run)
    worker.start()
    _wait_for(lambda: server.batches_created == 1)
    interrupts.STOP.set()
    try:
        worker.join(timeout=30)
    finally:
        interrupts.STOP.clear()
    assert len(outcome) == 1 and isinstance(outcome[0], interrupts.Stopped)
    first = next(iter(server.batches))
    assert server.cancelled == [first]
    assert kept(tmp_path / "records")[0]["cancelled_by_run"] is True

    server.release()
    assert [g.text for g in run_stream(task, tmp_path / "records", 3)] == ["positive"] * 3
    assert server.batches_created == 2  # the cancelled one (nothing answered) and the rest, once
    assert kept(tmp_path / "records") == []


def _wait_for(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_batch_failed_without_a_line_fails_the_run_naming_the_settings(tmp_path: Path, server: FaultServer) -> None:
    server.faults.fail_batch_line = 0  # the provider names no line of the file
    with pytest.raises(BatchApiError, match="failed as a whole") as failure:
        run_stream(batch_task(tmp_path, server.base_url), tmp_path / "records", 2)
    assert "`engine.model`" in str(failure.value)
    assert server.batches_created == 1
    assert kept(tmp_path / "records") == []  # a failed batch is not adopted by the next run
    # The re-run (or Dagster's retry) submits a new batch instead of failing on the same one again.
    assert [g.text for g in run_stream(batch_task(tmp_path, server.base_url), tmp_path / "records", 2)] == [
        "positive"
    ] * 2
    assert server.batches_created == 2
    assert kept(tmp_path / "records") == []


def test_a_kept_record_of_a_failed_batch_is_dropped_and_its_requests_sent_fresh(
    tmp_path: Path, server: FaultServer
) -> None:
    # A run killed after its batch failed as a whole (before it read the status) left its record.
    server.faults.hold = True
    task = batch_task(tmp_path, server.base_url)
    worker = threading.Thread(target=lambda: _swallow(lambda: run_stream(task, tmp_path / "records", 2)))
    worker.start()
    _wait_for(lambda: server.batches_created == 1 and kept(tmp_path / "records")[0].get("batch_id"))
    interrupts.STOP.set()
    try:
        worker.join(timeout=30)
    finally:
        interrupts.STOP.clear()
    first = next(iter(server.batches.values()))
    first.status, first.errors = "failed", {"object": "list", "data": [{"code": "x", "message": "quota"}]}
    record = kept(tmp_path / "records")[0]
    record.pop("cancelled_by_run", None)
    BatchRecordStore(UPath(tmp_path / "records")).save(record)
    server.release()
    assert [g.text for g in run_stream(task, tmp_path / "records", 2)] == ["positive"] * 2
    assert server.batches_created == 2
    assert kept(tmp_path / "records") == []


def _swallow(function) -> None:
    with contextlib.suppress(BaseException):  # the stop is what the caller expects
        function()


def test_a_stop_between_two_results_cancels_the_batch_in_flight(tmp_path: Path, server: FaultServer) -> None:
    # The stop reaches the stream's consumer (writing a checkpoint, say), not the stream: the
    # session, left by that stop, cancels what the stream had in flight.
    server.faults.refuse_upload_line, server.faults.hold = 1, True  # line 1 an error row at once, the rest held
    task = batch_task(tmp_path, server.base_url)
    engine = BatchApiEngine()
    records = BatchRecordStore(UPath(tmp_path))
    with pytest.raises(KeyboardInterrupt), engine.session(task, engine.settings(task), records=records) as session:
        for position, generation in session.stream(prompts(3)):
            assert (position, generation.error is not None) == (0, True)
            raise KeyboardInterrupt
    assert server.cancelled == list(server.batches) and len(server.cancelled) == 1
    assert [record["cancelled_by_run"] for record in kept(tmp_path)] == [True]


def test_a_batch_without_expires_at_ends_with_created_at_plus_its_window(tmp_path: Path, server: FaultServer) -> None:
    # No `expires_at`: its created_at plus its completion_window ("1s") is the end of its window.
    server.faults.hold, server.faults.window_seconds, server.faults.send_expires_at = True, 1, False
    started = time.monotonic()
    generations = run_stream(batch_task(tmp_path, server.base_url, expiry_grace_seconds=0.5), tmp_path / "r", 2)
    assert time.monotonic() - started < 10
    assert [g.text for g in generations] == [None, None]
    assert all(g.error is not None and g.error.startswith("batch_expired: batch ") for g in generations)
    assert server.cancelled == list(server.batches)
    assert [b.status for b in server.batches.values()] == ["cancelled"]


def test_a_batch_cancelled_slowly_past_its_window_keeps_its_answers_and_expires_the_rest(
    tmp_path: Path, server: FaultServer
) -> None:
    # Past its window the run cancels it; the provider answers "cancelling", and "cancelled" (with
    # one answer in its output file) at the next status read: collected as expired, not cancelled.
    faults = server.faults
    faults.hold, faults.window_seconds, faults.cancel_slowly, faults.answered_when_cancelled = True, 1, True, 1
    generations = run_stream(batch_task(tmp_path, server.base_url, expiry_grace_seconds=2), tmp_path / "r", 3)
    [batch] = server.batches.values()
    assert batch.polls >= 2 and batch.status == "cancelled" and server.cancelled == [batch.id]
    assert [g.text for g in generations] == ["positive", None, None]
    assert all(g.error is not None and g.error.startswith("batch_expired: batch ") for g in generations[1:])
