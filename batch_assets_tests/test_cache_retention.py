"""Issue 36 item 5: the result cache does not grow without bound. Rows go by age and by task
version (fingerprint), on real SQLite and PostgreSQL, and a pruned cache still serves what it kept."""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

import polars as pl
import pytest
import sqlalchemy as sa
from upath import UPath

from batch_assets.cli import main
from batch_assets.pipeline.task_spec import CacheSpec, load_task_specs
from batch_assets.storage.cache_retention import DAY, prune, sizes
from batch_assets.storage.errors import StorageError
from batch_assets.storage.locations import task_storage_dir
from batch_assets.storage.result_cache import RESULTS, VERSIONS, ResultCache, cache_engine

NOW = time.time()


def results(*keys: str) -> pl.DataFrame:
    return pl.DataFrame(
        {
            "request_key": list(keys),
            "generated_text": [f"label of {key}" for key in keys],
            "finish_reason": ["stop"] * len(keys),
            "num_prompt_tokens": [5] * len(keys),
            "num_generated_tokens": [2] * len(keys),
            "error": [None] * len(keys),
            "cumulative_logprob": [-0.5] * len(keys),
        },
        schema_overrides={"error": pl.String},
    )


def store(url: str, task: str, fingerprint: str, keys: list[str], when: float, monkeypatch) -> ResultCache:
    """Add results under `fingerprint` for `task`, as a run at `when` would."""
    with monkeypatch.context() as patch:
        patch.setattr(time, "time", lambda: when)
        cache = ResultCache(UPath(f"/unused/{task}"), fingerprint, url=url)
        cache.add(results(*keys))
    return cache


def served(url: str, fingerprint: str, task: str = "sentiment") -> list[str]:
    """What a run of `task` under `fingerprint` finds in the cache (a lookup records that use)."""
    frame = ResultCache(UPath(f"/unused/{task}"), fingerprint, url=url).lookup()
    assert frame["generated_text"].to_list() == [f"label of {key}" for key in frame["request_key"]]
    return sorted(frame["request_key"].to_list())


def stored(url: str, fingerprint: str) -> int:
    """Rows under `fingerprint`, counted without using the cache."""
    with cache_engine(url).connect() as connection:
        query = sa.select(sa.func.count()).select_from(RESULTS).where(RESULTS.c.fingerprint == fingerprint)
        return int(connection.execute(query).scalar_one())


@pytest.fixture(scope="module")
def postgres_url() -> Iterator[str]:
    from batch_assets_tests.postgres_server import running_postgres

    with running_postgres() as server:
        yield f"postgresql+psycopg2://{server.username}:{server.password}@{server.host}:{server.port}/{server.db_name}"


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'results.sqlite3'}"
    found = request.getfixturevalue("postgres_url")
    with cache_engine(found).begin() as connection:  # one database for the module: start empty
        connection.execute(sa.delete(RESULTS))
        connection.execute(sa.delete(VERSIONS))
    return found


def test_results_older_than_max_age_days_go_and_the_rest_are_served(url: str, monkeypatch) -> None:
    store(url, "sentiment", "f1", ["old-1", "old-2", "old-3"], NOW - 100 * DAY, monkeypatch)
    store(url, "sentiment", "f1", ["new-1", "new-2"], NOW - 10 * DAY, monkeypatch)
    report = prune(url, {"sentiment": CacheSpec(max_age_days=90)}, now=NOW)
    assert (report.by_age.rows, report.by_fingerprint.rows) == (3, 0)
    assert report.by_age.text_bytes == 3 * len("label of old-1")
    assert served(url, "f1") == ["new-1", "new-2"]
    # --older-than overrides the setting for one prune.
    assert prune(url, {"sentiment": CacheSpec(max_age_days=90)}, older_than_days=5, now=NOW).by_age.rows == 2
    assert served(url, "f1") == []


def test_fingerprints_beyond_keep_fingerprints_go_unless_another_task_keeps_them(url: str, monkeypatch) -> None:
    for age, fingerprint in enumerate(["f4", "f3", "f2", "f1"]):  # f1 used longest ago
        store(url, "sentiment", fingerprint, [f"{fingerprint}-a", f"{fingerprint}-b"], NOW - age * DAY, monkeypatch)
    store(url, "industry", "f1", ["f1-c"], NOW - 5 * DAY, monkeypatch)  # same settings: a shared fingerprint
    retention = {"sentiment": CacheSpec(keep_fingerprints=2), "industry": CacheSpec(keep_fingerprints=3)}
    report = prune(url, retention, tasks={"sentiment"}, now=NOW)
    assert report.fingerprints == ["f2"]  # f1 is industry's
    assert (report.by_fingerprint.rows, report.by_age.rows) == (2, 0)
    assert [stored(url, fp) for fp in ("f1", "f2", "f3", "f4")] == [3, 0, 2, 2]
    assert {task: (s.fingerprints, s.rows) for task, s in sizes(url).items()} == {
        "industry": (1, 3),
        "sentiment": (2, 4),  # f3 and f4: f1 and f2 left its record (f1 stays, as industry's)
    }
    assert served(url, "f3") == ["f3-a", "f3-b"] and served(url, "f4") == ["f4-a", "f4-b"]
    assert served(url, "f1", task="industry") == ["f1-a", "f1-b", "f1-c"]
    # Once industry is gone from the tasks, nobody keeps f1.
    assert prune(url, {"sentiment": CacheSpec(keep_fingerprints=2)}, now=NOW).fingerprints == ["f1"]
    assert stored(url, "f1") == 0 and served(url, "f3") == ["f3-a", "f3-b"]


def test_a_cache_made_before_rows_were_dated_is_served_and_its_rows_age_from_the_upgrade(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite3"
    with sqlite3.connect(path) as old:
        old.execute(
            "CREATE TABLE batch_assets_result_cache (fingerprint VARCHAR(64), request_key VARCHAR(64), "
            "generated_text TEXT, finish_reason VARCHAR(32), num_prompt_tokens BIGINT, num_generated_tokens BIGINT, "
            "cumulative_logprob FLOAT, PRIMARY KEY (fingerprint, request_key)) WITHOUT ROWID"
        )
        old.execute("INSERT INTO batch_assets_result_cache VALUES ('f1', 'k', 'label of k', 'stop', 5, 2, -0.5)")
    url = f"sqlite:///{path}"
    assert served(url, "f1", task="reader") == ["k"]
    assert prune(url, {"reader": CacheSpec(max_age_days=90)}, now=time.time()).by_age.rows == 0
    assert prune(url, {"reader": CacheSpec(max_age_days=90)}, now=time.time() + 91 * DAY).by_age.rows == 1


def test_cache_prune_command_prints_what_it_removed_and_what_is_left(
    data_dir: Path, monkeypatch, capsys: pytest.CaptureFixture[str]
) -> None:
    task = next(task for task in load_task_specs() if task.name == "sentiment")
    assert (task.cache.max_age_days, task.cache.keep_fingerprints) == (90, 3)  # the documented defaults
    url = ResultCache(task_storage_dir("sentiment"), "f1").url
    assert url.startswith("sqlite:///") and str(data_dir) in url
    store(url, "sentiment", "f1", ["a", "b"], NOW - 40 * DAY, monkeypatch)
    store(url, "sentiment", "f1", ["c"], NOW, monkeypatch)
    assert main(["cache", "prune", "--task", "sentiment", "--older-than", "30"]) == 0
    out = capsys.readouterr().out
    assert "removed 2 results (20 bytes of text) by age" in out, out
    assert "  sentiment: 1 results, 1 fingerprint(s), 10 text bytes" in out, out
    assert served(url, "f1") == ["c"]
    assert main(["cache", "prune", "--task", "nope"]) == 2
    assert "unknown task 'nope'" in capsys.readouterr().out


@pytest.mark.parametrize("age", ["-5", "nan", "inf"])
def test_cache_prune_refuses_an_age_that_is_no_number_of_days_and_removes_nothing(
    age: str, data_dir: Path, monkeypatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 47: `--older-than -5` dated the limit 5 days ahead and wiped the whole cache, exit 0."""
    url = ResultCache(task_storage_dir("sentiment"), "f1").url
    store(url, "sentiment", "f1", ["a", "b"], NOW - 40 * DAY, monkeypatch)
    store(url, "sentiment", "f1", ["c"], NOW, monkeypatch)
    with pytest.raises(SystemExit) as refused:
        main(["cache", "prune", "--older-than", age])
    assert refused.value.code == 2
    assert f"argument --older-than: must be a number of days, 0 or more (not {age})" in capsys.readouterr().err
    assert served(url, "f1") == ["a", "b", "c"]


def test_cache_prune_older_than_0_removes_every_result_stored_before_now(
    data_dir: Path, monkeypatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """0 days is an age like any other, not "unset" (it fell back to `cache.max_age_days`)."""
    url = ResultCache(task_storage_dir("sentiment"), "f1").url
    store(url, "sentiment", "f1", ["a", "b"], NOW - 40 * DAY, monkeypatch)
    store(url, "sentiment", "f1", ["c"], NOW - 60, monkeypatch)
    assert main(["cache", "prune", "--task", "sentiment", "--older-than", "0"]) == 0
    assert "removed 3 results (30 bytes of text) by age" in capsys.readouterr().out
    assert served(url, "f1") == []


def test_cache_prune_of_a_damaged_sqlite_cache_names_the_file_and_the_cause_and_goes_on(
    data_dir: Path, monkeypatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 47: SQLAlchemy's generic "(Background on this error at: ...)" line, no file, no cause.
    The other tasks' caches are still pruned; the damaged file is left as it is for its next run."""
    good = ResultCache(task_storage_dir("industry"), "f1").url
    store(good, "industry", "f1", ["old"], NOW - 100 * DAY, monkeypatch)
    damaged = task_storage_dir("sentiment") / "_result_cache" / "results.sqlite3"
    damaged.parent.mkdir(parents=True)
    damaged.write_bytes(b"this is not a database, just text that took its name" * 100)
    assert main(["cache", "prune"]) == 1
    out = capsys.readouterr().out
    assert (
        f"error: the result cache {damaged} is damaged (file is not a database): nothing pruned there; "
        "the next run of its task sets it aside and starts an empty one (or delete the file)"
    ) in out
    assert "removed 1 results (12 bytes of text) by age" in out and "Background on this error" not in out
    assert damaged.read_bytes().startswith(b"this is not a database")
    assert served(good, "f1", task="industry") == []


def test_cache_prune_on_an_empty_data_root_creates_nothing(data_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 56.17: a prune where no task has run yet made an empty database per task."""
    assert main(["cache", "prune"]) == 0
    out = capsys.readouterr().out
    assert not data_dir.exists(), sorted(str(path) for path in data_dir.rglob("*"))
    sentiment = task_storage_dir("sentiment") / "_result_cache" / "results.sqlite3"
    assert f"sqlite:///{sentiment}: no cache there yet, nothing to prune" in out.splitlines(), out


def test_a_cache_database_without_its_driver_names_the_setting_and_the_package(
    data_dir: Path, monkeypatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 56.13: `ModuleNotFoundError: No module named 'psycopg'`, naming neither the setting nor
    what to install; said the same by a run (the cache's first read) and by `cache prune`."""
    import importlib.util

    if importlib.util.find_spec("psycopg") is not None:
        pytest.skip("psycopg is installed here")
    monkeypatch.setenv("BATCH_ASSETS_RESULT_CACHE_URL", "postgresql+psycopg://reader:secret@db.internal/cache")
    why = (
        "the result cache postgresql+psycopg://reader:***@db.internal/cache (BATCH_ASSETS_RESULT_CACHE_URL) needs "
        'the database driver psycopg, which is not installed: `pip install "psycopg[binary]"`, or point '
        "BATCH_ASSETS_RESULT_CACHE_URL at another database"
    )
    with pytest.raises(StorageError) as raised:
        ResultCache(task_storage_dir("sentiment"), "f1").lookup()
    assert str(raised.value) == why
    assert main(["cache", "prune"]) == 1
    assert capsys.readouterr().out.strip() == f"error: {why}"
