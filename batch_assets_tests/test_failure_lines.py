"""The one line a user reads about a failure, and the result cache as a cause of failures: our own
error (it names the setting) rather than a library's last line; a damaged SQLite cache set aside
with a warning; `--no-result-cache`."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import dagster as dg
import polars as pl
import pytest

from batch_assets.storage import result_cache
from batch_assets.storage.errors import StorageError

POSTS = "".join(f'{{"text": "post number {i}"}}\n' for i in range(4))
UNREACHABLE = "postgresql+psycopg2://batch:secret@127.0.0.1:9/cache"
DRIVER_TEXT = (
    'connection to server at "127.0.0.1", port 9 failed: Connection refused\n'
    "\tIs the server running on that host and accepting TCP/IP connections?\n"
)
OUR_TEXT = (
    "read from the result cache postgresql+psycopg2://batch:secret@db/cache failed: Connection refused\n"
    f"(point {result_cache.URL_ENV} at a working database)"
)


def raise_wrapped_storage_error() -> None:
    """What a failing store looks like from above: a library error, our StorageError naming it, and
    something generic around both."""
    try:
        try:
            raise ConnectionRefusedError(DRIVER_TEXT)
        except ConnectionRefusedError as exc:
            raise StorageError(OUR_TEXT) from exc
    except StorageError as exc:
        raise RuntimeError("the step failed") from exc


def test_a_failed_run_is_named_by_our_outermost_error_on_one_line_without_its_password() -> None:
    from batch_assets.app.run_outcomes import failure_text

    @dg.op
    def read_cache() -> None:
        raise_wrapped_storage_error()

    @dg.job
    def job() -> None:
        read_cache()

    result = job.execute_in_process(raise_on_error=False)
    assert failure_text(result) == (
        "failed in read_cache: read from the result cache postgresql+psycopg2://***@db/cache failed: "
        f"Connection refused (point {result_cache.URL_ENV} at a working database)"
    )


def test_a_failure_our_step_raised_over_a_library_error_is_named_by_its_description() -> None:
    """Before, a step stopped by Ctrl-C read `failed in ...: EngineDeadError ...`, the engine error
    the interrupt caused, instead of the step's own `stopped (interrupted)`."""
    from batch_assets.app.run_outcomes import failure_text

    @dg.op
    def infer() -> None:
        try:
            raise RuntimeError("EngineCore encountered an issue. See stack trace for the root cause.")
        except RuntimeError as exc:
            raise dg.Failure(description="stopped (interrupted)", allow_retries=False) from exc

    @dg.job
    def job() -> None:
        infer()

    assert failure_text(job.execute_in_process(raise_on_error=False)) == "failed in infer: stopped (interrupted)"


def test_a_failed_run_without_an_error_of_ours_shows_the_innermost_line() -> None:
    from batch_assets.app.run_outcomes import failure_text

    @dg.op
    def connect() -> None:
        try:
            raise ConnectionRefusedError(DRIVER_TEXT)
        except ConnectionRefusedError as exc:
            raise RuntimeError("the step failed") from exc

    @dg.job
    def job() -> None:
        connect()

    result = job.execute_in_process(raise_on_error=False)
    assert failure_text(result) == (
        "failed in connect: Is the server running on that host and accepting TCP/IP connections?"
    )


def test_the_commands_error_line_is_our_outermost_error(data_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An error outside a run (`error:` line of `batch-assets`) walks `__cause__`/`__context__` too."""
    from batch_assets import cli

    try:
        raise_wrapped_storage_error()
    except RuntimeError as error:
        assert cli._unexpected(error) == 1
    [line] = capsys.readouterr().out.splitlines()
    assert line.startswith(
        "error: read from the result cache postgresql+psycopg2://***@db/cache failed: Connection refused "
        f"(point {result_cache.URL_ENV} at a working database) (traceback: "
    )


@pytest.mark.parametrize("command", [["run", "sentiment", "posts.jsonl"], ["demo"]])
def test_run_and_demo_take_no_result_cache(command: list[str]) -> None:
    from batch_assets.cli import build_parser

    assert build_parser().parse_args(command).use_result_cache is True
    assert build_parser().parse_args([*command, "--no-result-cache"]).use_result_cache is False


def cache_file(data: Path) -> Path:
    return data / "storage" / "sentiment" / "_result_cache" / result_cache.SQLITE_NAME


def garbage_cache(data: Path) -> tuple[Path, bytes]:
    path = cache_file(data)
    path.parent.mkdir(parents=True)
    garbage = b"this is not a database " * 200
    path.write_bytes(garbage)
    return path, garbage


def passed_line(output: str, file: str) -> bool:
    """`file`'s summary line in `output` says it passed (`OK`, or WARN checks only: the tiny model's
    labels are unsure, so its `confidence_at_least` check may fail)."""
    from batch_assets_tests.support import passed

    return any(passed(line, file) and " run " in line for line in output.splitlines())


def posts_file(tmp_path: Path) -> Path:
    posts = tmp_path / "posts.jsonl"
    posts.write_text(POSTS)
    return posts


def labelled_rows(data: Path) -> int:
    return pl.read_parquet(data / "storage" / "sentiment" / "validated_labels" / "posts.jsonl.parquet")["label"].count()


@pytest.mark.slow
def test_an_unreachable_result_cache_fails_the_run_naming_the_cache_and_the_setting(
    data_dir: Path, tiny_model: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    from batch_assets import cli

    monkeypatch.setenv(result_cache.URL_ENV, UNREACHABLE)
    assert cli.main(["run", "sentiment", str(posts_file(tmp_path))]) == 1
    output = capfd.readouterr().out
    [line] = [line for line in output.splitlines() if line.startswith("sentiment/posts.jsonl:")]
    assert line.startswith("sentiment/posts.jsonl: FAILED run ")
    # The user name goes too: the line is scrubbed as a whole (a URL's user may be an access key).
    assert "read from the result cache postgresql+psycopg2://***@127.0.0.1:9/cache failed" in line
    assert result_cache.URL_ENV in line and "--no-result-cache" in line
    assert "Is the server running" not in output and "secret" not in output


@pytest.mark.slow
def test_a_damaged_sqlite_cache_is_set_aside_and_the_run_goes_on_with_a_fresh_one(
    data_dir: Path, tiny_model: str, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    from batch_assets import cli

    path, garbage = garbage_cache(data_dir)
    assert cli.main(["run", "sentiment", str(posts_file(tmp_path))]) == 0
    output = capfd.readouterr().out
    [aside] = path.parent.glob(f"{result_cache.SQLITE_NAME}.corrupt-*")
    assert aside.read_bytes() == garbage
    warning = f"sentiment/posts.jsonl: warning: the result cache {path} is damaged (file is not a database)"
    assert warning in output and f"set aside as {aside.name}" in output
    assert passed_line(output, "sentiment/posts.jsonl") and labelled_rows(data_dir) == 4
    # A fresh cache in its place, holding this run's results.
    with sqlite3.connect(path) as database:
        assert database.execute("SELECT count(*) FROM batch_assets_result_cache").fetchone() == (4,)
    # The run's log (the UI) says so too.
    with dg.DagsterInstance.get() as instance:
        [run] = instance.get_runs()
        messages = [event.user_message for event in instance.all_logs(run.run_id)]
    assert any(f"the result cache {path} is damaged" in message for message in messages)


@pytest.mark.slow
def test_no_result_cache_neither_reads_nor_writes_the_cache(
    data_dir: Path, tiny_model: str, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    from batch_assets import cli

    # A damaged cache that any read or write would meet (and set aside).
    path, garbage = garbage_cache(data_dir)
    assert cli.main(["run", "sentiment", "--no-result-cache", str(posts_file(tmp_path))]) == 0
    output = capfd.readouterr().out
    assert passed_line(output, "sentiment/posts.jsonl") and labelled_rows(data_dir) == 4
    assert path.read_bytes() == garbage and sorted(p.name for p in path.parent.iterdir()) == [path.name]
    assert "result cache" not in output


def test_a_summary_line_names_every_failed_check_and_only_error_checks_fail_the_command() -> None:
    """Issue 47: a line named failed ERROR checks only; WARN failures left it `OK`."""
    from batch_assets.app.run_outcomes import PartitionOutcome

    def outcome(errors: list[str], warnings: list[str]) -> PartitionOutcome:
        return PartitionOutcome("t", "f.csv", True, "0123456789", "3 rows", errors, failed_warn_checks=warnings)

    both = outcome(["t/validated_labels:labels_are_valid"], ["t/validated_labels:accuracy_at_least"])
    assert both.line() == (
        "t/f.csv: CHECKS FAILED (t/validated_labels:labels_are_valid (ERROR), "
        "t/validated_labels:accuracy_at_least (WARN)) run 01234567: 3 rows"
    )
    assert not both.passed() and not both.passed(fail_on_warn=True)
    warned = outcome([], ["t/validated_labels:error_share_below_threshold"])
    assert (
        warned.line()
        == "t/f.csv: WARN CHECKS FAILED (t/validated_labels:error_share_below_threshold (WARN)) run 01234567: 3 rows"
    )
    assert warned.passed() and not warned.passed(fail_on_warn=True)
    clean = outcome([], [])
    assert clean.line() == "t/f.csv: OK run 01234567: 3 rows" and clean.passed(fail_on_warn=True)
