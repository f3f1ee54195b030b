"""The result cache: reuse across partitions and re-runs, its keys, and concurrent writers."""

from __future__ import annotations

import contextlib
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import polars as pl
import pytest
import sqlalchemy as sa
from upath import UPath

from batch_assets.pipeline.inference_requests import request_keys
from batch_assets.pipeline.result_stores import RESULT_SCHEMA
from batch_assets.storage import result_cache
from batch_assets.storage.checkpoints import CheckpointStore
from batch_assets.storage.errors import StorageError
from batch_assets.storage.result_cache import ResultCache
from batch_assets_tests.support import run_on_a_tiny_file_system
from batch_assets_tests.support.scripted_engine import Engine, Session, formatted_frame
from batch_assets_tests.support.scripted_engine import infer as infer_partition


@pytest.fixture
def task_dir(tmp_path: Path) -> UPath:
    return UPath(tmp_path / "storage" / "industry")


def infer(
    frame: pl.DataFrame,
    engine: Engine,
    cache: ResultCache | None,
    *,
    deterministic: bool = True,
    partition: str = "a.csv",
    root: UPath | None = None,
):
    store = CheckpointStore((root or UPath("/nonexistent")) / "_checkpoints" / partition, "fp") if root else None
    return infer_partition(frame, engine, store, deduplicate=deterministic, cache=cache)


def test_a_second_partition_reuses_the_first_ones_results(task_dir: UPath) -> None:
    first, second = Engine(), Engine()
    _, stats = infer(formatted_frame(["Acme", "Globex", "Initech"]), first, ResultCache(task_dir, "fp"), root=task_dir)
    assert (stats.rows_inferred, stats.rows_from_cache, stats.rows_cached) == (3, 0, 3)

    out, stats = infer(
        formatted_frame(["Globex", "Umbrella", "Acme", None]),
        second,
        ResultCache(task_dir, "fp"),
        partition="b.csv",
        root=task_dir,
    )
    # Only the new company reaches the engine; every row still gets its result, in input order.
    assert [bytes(c for c in ids if c).decode() for ids in second.seen] == ["Umbrella"]
    assert (stats.rows_inferred, stats.rows_from_cache, stats.rows_cached) == (1, 2, 1)
    assert out["generated_text"].to_list() == ["xebolG", "allerbmU", "emcA", None]
    assert out["error"][3].startswith("null_text")


def test_a_rerun_is_served_from_the_cache_without_starting_the_engine(task_dir: UPath) -> None:
    frame = formatted_frame(["a", "b", "a"])
    infer(frame, Engine(), ResultCache(task_dir, "fp"))
    session = Session(Engine(fail_after=0), batch_size=4)
    out, stats = infer_partition(frame, Engine(fail_after=0), None, cache=ResultCache(task_dir, "fp"), session=session)
    assert session.starts == 0 and stats.rows_inferred == 0 and stats.rows_from_cache == 2
    assert out["generated_text"].to_list() == ["a", "b", "a"]


def test_other_settings_and_random_sampling_never_share_results(task_dir: UPath) -> None:
    infer(formatted_frame(["a", "b"]), Engine(), ResultCache(task_dir, "fp-model-1"))
    engine = Engine()
    _, stats = infer(formatted_frame(["a", "b"]), engine, ResultCache(task_dir, "fp-model-2"))
    assert stats.rows_from_cache == 0 and len(engine.seen) == 2
    # Random sampling: every row is its own request; nothing is read from or written to the cache.
    engine = Engine()
    _, stats = infer(formatted_frame(["a", "b"]), engine, ResultCache(task_dir, "fp-model-1"), deterministic=False)
    assert (stats.rows_from_cache, stats.rows_cached, len(engine.seen)) == (0, 0, 2)


def test_failed_and_too_long_requests_are_not_cached(task_dir: UPath) -> None:
    cache = ResultCache(task_dir, "fp")
    frame = formatted_frame(["short", "x" * 80])
    out, stats = infer(frame, Engine(), cache)
    assert out["error"][1].startswith("prompt_too_long")
    assert stats.rows_cached == 1 and cache.lookup()["request_key"].to_list() == request_keys(
        frame["prompt"][:1].to_list(), [0], True
    )


def test_concurrent_writers_and_readers_lose_nothing(task_dir: UPath) -> None:
    writers, per_writer = 4, 12
    failures: list[BaseException] = []

    def write(worker: int) -> None:
        try:
            for i in range(per_writer):
                frame = formatted_frame([f"w{worker}-{i}", "shared"])
                infer(frame, Engine(), ResultCache(task_dir, "fp"))
                # A reader between other writers' inserts sees its own results.
                keys = pl.Series(request_keys(frame["prompt"].to_list(), [0, 1], True))
                assert ResultCache(task_dir, "fp").lookup(keys).height == 2
        except BaseException as exc:  # reported by the main thread
            failures.append(exc)

    threads = [threading.Thread(target=write, args=(w,)) for w in range(writers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []
    # Every distinct result once: the shared prompt written by every writer is one row.
    assert ResultCache(task_dir, "fp").lookup().height == writers * per_writer + 1


def test_processes_writing_one_cache_at_once(task_dir: UPath) -> None:
    """Runs on one machine are processes: SQLite's locking, not a Python lock, keeps them apart."""
    script = (
        "import sys, polars as pl\n"
        "from upath import UPath\n"
        "from batch_assets.storage.result_cache import ResultCache\n"
        "worker = int(sys.argv[2])\n"
        "cache = ResultCache(UPath(sys.argv[1]), 'fp')\n"
        "for i in range(20):\n"
        "    keys = [f'{worker}-{i}-{j}' for j in range(50)] + [f'shared-{i}']\n"
        "    cache.add(pl.DataFrame({'request_key': keys, 'generated_text': keys, 'finish_reason': 'stop',\n"
        "        'num_prompt_tokens': 1, 'num_generated_tokens': 1, 'error': None, 'cumulative_logprob': -0.5}))\n"
    )
    workers = [subprocess.Popen([sys.executable, "-c", script, str(task_dir), str(w)]) for w in range(3)]
    assert [worker.wait(timeout=120) for worker in workers] == [0, 0, 0]
    stored = ResultCache(task_dir, "fp").lookup()
    assert stored.height == 3 * 20 * 50 + 20
    assert stored.filter(pl.col("request_key") == "1-7-3")["generated_text"].to_list() == ["1-7-3"]


def test_lookup_returns_only_the_keys_asked_for(task_dir: UPath) -> None:
    cache = ResultCache(task_dir, "fp")
    stored = results_frame([f"k{i}" for i in range(5_000)])
    assert cache.add(stored) == 5_000
    asked = pl.Series([f"k{i}" for i in range(0, 5_000, 1_000)] + ["missing", None, "k0"])
    found = cache.lookup(asked)
    assert sorted(found["request_key"].to_list()) == ["k0", "k1000", "k2000", "k3000", "k4000"]
    assert found.schema == pl.Schema(RESULT_SCHEMA)
    assert found.filter(pl.col("request_key") == "k2000").row(0, named=True) == result_row("k2000")
    # Another fingerprint (other model or sampling) shares nothing.
    assert ResultCache(task_dir, "other").lookup(asked).height == 0


def test_a_cache_of_an_earlier_version_is_imported_once(task_dir: UPath) -> None:
    """Parquet files under `_result_cache/<fingerprint>/` (earlier versions) move into the table."""
    legacy = Path(task_dir.path) / "_result_cache" / "fp"
    legacy.mkdir(parents=True)
    results_frame(["a", "b"]).write_parquet(legacy / "part-00000000000000000001-aaaaaaaa.parquet")
    old = results_frame(["c"]).drop("cumulative_logprob")  # written before confidence was stored
    old.write_parquet(legacy / "part-00000000000000000002-bbbbbbbb.parquet")

    found = ResultCache(task_dir, "fp").lookup(pl.Series(["a", "c", "z"]))
    assert sorted(found["request_key"].to_list()) == ["a", "c"]
    assert found.filter(pl.col("request_key") == "c")["cumulative_logprob"].to_list() == [None]
    assert not legacy.exists()
    assert (Path(task_dir.path) / "_result_cache" / result_cache.SQLITE_NAME).exists()
    assert ResultCache(task_dir, "fp").lookup().height == 3


def test_a_store_that_cannot_be_reached_names_itself_and_the_setting(
    task_dir: UPath, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A Postgres URL on a loopback port nothing listens on.
    monkeypatch.setenv(result_cache.URL_ENV, "postgresql+psycopg2://batch:secret@127.0.0.1:9/cache")
    with pytest.raises(StorageError) as raised:
        ResultCache(task_dir, "fp").lookup(pl.Series(["a"]))
    message = str(raised.value)
    assert "postgresql+psycopg2://batch:***@127.0.0.1:9/cache" in message
    assert "secret" not in message
    assert result_cache.URL_ENV in message and "use_result_cache: false" in message
    assert "--no-result-cache" in message
    # The driver's first line (what failed), not its guess that reads as if the LLM server were down.
    assert "Connection refused" in message and "Is the server running" not in message
    assert "\n" not in message


def write_garbage_cache(task_dir: UPath) -> Path:
    path = Path(task_dir.path) / "_result_cache" / result_cache.SQLITE_NAME
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not a database, " * 512)
    return path


def write_damaged_cache(task_dir: UPath) -> Path:
    """A real cache of 3,000 results whose pages after the first (the schema) were overwritten."""
    path = Path(task_dir.path) / "_result_cache" / result_cache.SQLITE_NAME
    path.parent.mkdir(parents=True)
    engine = sa.create_engine(f"sqlite:///{path}")
    result_cache.RESULTS.create(engine)
    with engine.begin() as connection:
        rows = [{"fingerprint": "fp", "request_key": f"k{i}", "generated_text": "x" * 40} for i in range(3_000)]
        connection.execute(result_cache.RESULTS.insert(), rows)
    engine.dispose()
    with contextlib.closing(sqlite3.connect(path)) as database:
        database.execute("PRAGMA journal_mode=WAL")  # as the cache sets it: the header says so
    with path.open("r+b") as handle:
        handle.seek(4096)
        handle.write(b"\xff" * (path.stat().st_size - 4096))
    return path


@pytest.mark.parametrize(
    ("damage", "reason"),
    [(write_garbage_cache, "file is not a database"), (write_damaged_cache, "database disk image is malformed")],
)
def test_a_damaged_sqlite_cache_is_set_aside_with_a_warning_and_replaced_by_a_fresh_one(
    task_dir: UPath, damage, reason: str
) -> None:
    path = damage(task_dir)
    damaged_bytes = path.read_bytes()
    warnings: list[str] = []
    cache = ResultCache(task_dir, "fp", warn=warnings.append)

    assert cache.lookup(pl.Series(["k1", "k2"])).height == 0  # nothing to reuse, but no failure
    [aside] = path.parent.glob(f"{result_cache.SQLITE_NAME}.corrupt-*")
    # Its data pages as they were (opening it may have touched its first page, the schema: the
    # retention columns and table are added to a cache on first use).
    assert aside.read_bytes()[4096 : len(damaged_bytes)] == damaged_bytes[4096:]
    [warning] = warnings
    assert f"the result cache {path} is damaged ({reason})" in warning and aside.name in warning
    # A fresh cache in its place, written and read as before.
    assert cache.add(results_frame(["a", "b"])) == 2
    assert ResultCache(task_dir, "fp").lookup()["request_key"].sort().to_list() == ["a", "b"]
    assert sqlite3.connect(path).execute("PRAGMA quick_check").fetchone() == ("ok",)


def test_a_damaged_cache_met_by_a_write_is_set_aside_too(task_dir: UPath) -> None:
    path = write_garbage_cache(task_dir)
    warnings: list[str] = []
    assert ResultCache(task_dir, "fp", warn=warnings.append).add(results_frame(["a"])) == 1
    assert len(warnings) == 1 and str(path) in warnings[0]
    assert ResultCache(task_dir, "fp").lookup()["request_key"].to_list() == ["a"]


def test_a_cache_another_run_set_aside_already_is_not_set_aside_again(task_dir: UPath) -> None:
    """Two runs meet the same damage: the second finds the fresh cache the first made and keeps it."""
    path = write_garbage_cache(task_dir)
    assert result_cache.set_aside(path) is not None
    ResultCache(task_dir, "fp").add(results_frame(["a"]))
    assert result_cache.set_aside(path) is None
    assert len(list(path.parent.glob("*.corrupt-*"))) == 1
    assert ResultCache(task_dir, "fp").lookup()["request_key"].to_list() == ["a"]


def test_a_table_made_before_token_logprobs_gets_the_column_and_keeps_its_rows(task_dir: UPath) -> None:
    """A cache table of an earlier version (no `token_logprobs`, no `created_at`) is given the
    columns when opened: its rows read with none, and a new row's log-probabilities round trip."""
    folder = Path(task_dir.path) / "_result_cache"
    folder.mkdir(parents=True)
    with contextlib.closing(sqlite3.connect(folder / result_cache.SQLITE_NAME)) as connection, connection:
        connection.execute(
            "CREATE TABLE batch_assets_result_cache (fingerprint VARCHAR(64), request_key VARCHAR(64), "
            "generated_text TEXT, finish_reason VARCHAR(32), num_prompt_tokens BIGINT, num_generated_tokens BIGINT, "
            "cumulative_logprob FLOAT, PRIMARY KEY (fingerprint, request_key))"
        )
        connection.execute("INSERT INTO batch_assets_result_cache VALUES ('fp', 'old', 'x', 'stop', 1, 1, -0.5)")
    cache = ResultCache(task_dir, "fp")
    tokens = '[{"token": "x", "logprob": -0.5, "bytes": [120], "top_logprobs": []}]'
    assert cache.add(results_frame(["new"]).with_columns(token_logprobs=pl.lit(tokens))) == 1
    found = {row["request_key"]: row for row in cache.lookup(pl.Series(["old", "new"])).to_dicts()}
    assert (found["old"]["cumulative_logprob"], found["old"]["token_logprobs"]) == (-0.5, None)
    assert found["new"]["token_logprobs"] == tokens


def write_earlier_cache(folder: Path) -> Path:
    """A cache file of an earlier version: no `token_logprobs`, no `created_at`, no versions table;
    one result, `old`, under fingerprint `fp`."""
    folder.mkdir(parents=True)
    path = folder / result_cache.SQLITE_NAME
    with contextlib.closing(sqlite3.connect(path)) as connection, connection:
        connection.execute(
            "CREATE TABLE batch_assets_result_cache (fingerprint VARCHAR(64), request_key VARCHAR(64), "
            "generated_text TEXT, finish_reason VARCHAR(32), num_prompt_tokens BIGINT, num_generated_tokens BIGINT, "
            "cumulative_logprob FLOAT, PRIMARY KEY (fingerprint, request_key))"
        )
        connection.execute("INSERT INTO batch_assets_result_cache VALUES ('fp', 'old', 'x', 'stop', 1, 1, -0.5)")
    return path


def test_a_read_only_cache_of_an_earlier_version_is_read_and_never_written(
    task_dir: UPath, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Opening it used to add the later columns (ALTER TABLE), which a read-only store refuses: the
    partition failed. Now its rows read with the missing columns empty, adds write nothing, one
    warning names the store and the setting, and a partition over it infers and finishes.
    Read-only as SQLite's `mode=ro` opens it (tests may run as root, whom file permissions do not stop)."""
    path = write_earlier_cache(tmp_path / "shared")
    before = path.read_bytes()
    url = f"sqlite:///file:{path}?mode=ro&uri=true"
    monkeypatch.setenv(result_cache.URL_ENV, url)
    warnings: list[str] = []
    cache = ResultCache(task_dir, "fp", warn=warnings.append)

    [old] = cache.lookup(pl.Series(["old", "missing"])).to_dicts()
    assert (old["request_key"], old["generated_text"], old["cumulative_logprob"]) == ("old", "x", -0.5)
    assert old["token_logprobs"] is None
    assert cache.add(results_frame(["new"])) == 0  # nothing stored, and no failure
    assert cache.lookup()["request_key"].to_list() == ["old"]
    [warning] = warnings
    assert f"the result cache {path} cannot be written here (attempt to write a readonly database)" in warning
    assert "its column(s) token_logprobs read as empty" in warning
    assert result_cache.URL_ENV in warning and "--no-result-cache" in warning
    # A partition over it: every row inferred, none cached, no error.
    out, stats = infer(formatted_frame(["Acme", "Globex"]), Engine(), ResultCache(task_dir, "fp", warn=warnings.append))
    assert (stats.rows_inferred, stats.rows_from_cache, stats.rows_cached) == (2, 0, 0)
    assert out["error"].to_list() == [None, None] and len(warnings) == 2
    assert path.read_bytes() == before and not list(path.parent.glob("*-wal"))
    assert not Path("file:").exists()  # no folder named after the URI's text


def result_row(key: str) -> dict:
    """The cached answer the tests store for `key`."""
    return {
        "request_key": key,
        "generated_text": f"text {key}",
        "finish_reason": "stop",
        "num_prompt_tokens": 3,
        "num_generated_tokens": 2,
        "error": None,
        "cumulative_logprob": -0.25,
        "token_logprobs": None,
    }


def results_frame(keys: list[str]) -> pl.DataFrame:
    return pl.DataFrame([result_row(key) for key in keys], schema=RESULT_SCHEMA)


_FULL_CACHE_SCRIPT = """
import os, sys
import polars as pl
from upath import UPath
from batch_assets.pipeline.result_stores import RESULT_SCHEMA
from batch_assets.storage.result_cache import ResultCache, cache_engine

def results(keys):
    rows = {"request_key": keys, "generated_text": "positive", "finish_reason": "stop", "error": None}
    return pl.DataFrame(rows).with_columns(
        *(pl.lit(None, dtype=dtype).alias(name) for name, dtype in RESULT_SCHEMA.items() if name not in rows)
    )

os.environ["BATCH_ASSETS_DATA"] = sys.argv[1]
cache = ResultCache(UPath(sys.argv[1]) / "storage" / "sentiment", "fp")
cache.add(results(["a"]))
cache_engine(cache.url).dispose()  # what a later run meets: a database it opens anew
try:
    with open(os.path.join(sys.argv[1], "filler"), "wb") as filler:
        while True:
            filler.write(bytes(4096))
            filler.flush()
except OSError:
    pass
for work in (cache.lookup, lambda: cache.add(results([f"b{i}" for i in range(2000)]))):
    try:
        work()
        print("ok")
    except Exception as exc:
        print(type(exc).__name__, exc)
"""


def test_a_full_disk_under_the_cache_names_the_folder_not_the_cache_url(tmp_path: Path) -> None:
    """Issue 56.12: a real full file system (a 256 KiB tmpfs) under a SQLite cache gave SQLite's
    "disk I/O error" with advice to point BATCH_ASSETS_RESULT_CACHE_URL at a working database."""
    result = run_on_a_tiny_file_system(tmp_path, _FULL_CACHE_SCRIPT, size="256k")
    folder = tmp_path / "tiny" / "storage" / "sentiment" / "_result_cache"
    said = (
        f"the result cache {folder / result_cache.SQLITE_NAME} failed: no space left on device in {folder}: "
        "free space there, or point BATCH_ASSETS_DATA at other storage (BATCH_ASSETS_RESULT_CACHE_URL for the "
        "cache alone)"
    )
    assert result.stdout.splitlines() == [f"StorageError read from {said}", f"StorageError write to {said}"], (
        result.stdout + result.stderr[-3000:]
    )


def test_the_cache_in_the_instance_database_connects_as_the_instance_does(tmp_path: Path) -> None:
    """Before, its engine was made from the URL alone: an instance whose Postgres password is a token
    fetched per connection (dagster-postgres' `PgTokenProvider`, a cloud's workload identity) had a
    cache that could not log in. No server is needed: the token is fetched before connecting."""
    import inspect
    from types import SimpleNamespace

    from dagster_postgres.auth import PgTokenProvider
    from dagster_postgres.run_storage import PostgresRunStorage

    # The private attribute read, as dagster-postgres sets it.
    assert "self._token_provider = token_provider" in inspect.getsource(PostgresRunStorage.__init__)

    class CountingTokens(PgTokenProvider):
        fetched = 0

        def _fetch_token(self) -> tuple[str, float]:
            CountingTokens.fetched += 1
            return "token", time.time() + 3600

    url = "postgresql+psycopg2://identity@127.0.0.1:9/dagster"
    instance = SimpleNamespace(run_storage=SimpleNamespace(postgres_url=url, _token_provider=CountingTokens()))
    assert result_cache.cache_url(UPath(tmp_path), instance) == url
    with pytest.raises(sa.exc.OperationalError):
        result_cache.cache_engine(url)  # creating its tables connects: refused, after the token was fetched
    assert CountingTokens.fetched == 1


def test_the_assets_cache_warns_through_the_runs_log_and_is_none_when_off(data_dir: Path) -> None:
    """inference_outputs and the cascade's teacher build their cache through `result_cache_for`: a
    damaged cache's warning reaches the run's log (the Dagster UI), not only Python's logging."""
    import dagster as dg

    from batch_assets.lib.assets import result_cache_for
    from batch_assets.pipeline.task_spec import TaskSpec

    task = TaskSpec.model_validate(
        {"name": "t", "input": {"text_fields": ["text"]}, "prompt": {"template": "{text}"}, "output": {"kind": "text"}}
    )
    with dg.DagsterInstance.get() as instance:
        context = dg.build_asset_context(instance=instance)
        cache = result_cache_for(context, task, "fp", use=True)
        assert cache is not None and cache.warn == context.log.warning
        assert result_cache_for(context, task, "fp", use=False) is None
