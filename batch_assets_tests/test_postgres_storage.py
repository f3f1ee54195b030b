"""The scale-out storage for real: deploy/postgres/dagster.yaml on a PostgreSQL server.

A throwaway PostgreSQL cluster (Debian's server binaries, `initdb` + `pg_ctl`, run as the `postgres`
user when the tests run as root) listens on a free loopback port. The real daemon ticks the
`sentiment_drops_sensor` over a burst of three dropped files; the tick asks for two runs, split as
the assets' backfill policy splits a backfill (here `runs.max_partitions_per_run: 2`): one over a
range of two partitions, one over the third. The tick, the partitions, the runs (queued, launched
and executed by the daemon through the `gpu` pool), materializations and check results of every
partition must all land in Postgres. Then a burst with a bad file: its range run fails, and the
range failure sensor runs the good file of that range again on its own.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import dagster as dg
import pytest
import sqlalchemy
import yaml

from batch_assets.pipeline.task_spec import BUNDLED_TASKS_DIR
from batch_assets.storage.drop_files import partition_key_for, partitions_def_name
from batch_assets_tests.postgres_server import PostgresServer, running_postgres
from batch_assets_tests.support import REPO_ROOT, SAMPLES, running_daemon

# The slow tier (`make test-fast` leaves it out): a PostgreSQL server and the real daemon.
pytestmark = pytest.mark.slow

psycopg2 = pytest.importorskip("psycopg2", reason="dagster-postgres is not installed (pip install -e '.[test]')")

DEPLOY_INSTANCE = REPO_ROOT / "deploy" / "postgres" / "dagster.yaml"
SENSOR = "sentiment_drops_sensor"
RUNS_TIMEOUT_S = 900


@pytest.fixture(scope="module")
def postgres() -> Iterator[PostgresServer]:
    with running_postgres() as server:
        yield server


def sensor_ticks(instance: dg.DagsterInstance, name: str) -> list:
    for state in instance.all_instigator_state():
        if state.name == name:
            return list(instance.get_ticks(state.instigator_origin_id, state.selector_id))
    return []


def test_a_burst_of_drops_becomes_grouped_runs_recorded_in_postgres(
    postgres: PostgresServer, tmp_path: Path, tiny_model_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    home, data, tasks = postgres_project(tmp_path)
    zone, keys, rows = drop_the_burst(data)
    env = start_the_sensor(postgres, home, data, tasks, tiny_model_path, monkeypatch)
    instance = dg.DagsterInstance.from_config(str(home))
    log = tmp_path / "daemon.log"
    single, rerun = run_the_drops(instance, env, log, zone)
    assert_the_good_file_ran_again(instance, rerun, log)
    assert_one_tick_grouped_the_burst(instance, keys, log)
    assert_checks_per_partition(instance, rows, keys, data)
    assert_the_single_run(instance, single, log)
    assert_all_in_postgres(instance, data, home)


def postgres_project(tmp_path: Path) -> tuple[Path, Path, Path]:
    """The Dagster home (the deployment's dagster.yaml), the data folder and the tasks folder."""
    home, data, tasks = tmp_path / "dagster_home", tmp_path / "data", tmp_path / "tasks"
    home.mkdir()
    tasks.mkdir()
    shutil.copyfile(DEPLOY_INSTANCE, home / "dagster.yaml")
    # A run fails when its code location cannot be loaded; on a busy 2-core machine the code
    # server can take longer than Dagster's default 180 s to start while engines start beside it.
    with (home / "dagster.yaml").open("a") as config:
        config.write("\ncode_servers:\n  local_startup_timeout: 900\n")
    # The shipped sentiment task, with ranges of at most two partitions per run, and a tick every 5 s
    # (the least allowed) instead of 30: the later drops are each picked up by the next tick.
    sentiment = yaml.safe_load((BUNDLED_TASKS_DIR / "sentiment.yaml").read_text(encoding="utf-8"))
    sensor = {**sentiment.get("sensor", {}), "minimum_interval_seconds": 5}
    (tasks / "sentiment.yaml").write_text(
        yaml.safe_dump({**sentiment, "runs": {"max_partitions_per_run": 2}, "sensor": sensor}), encoding="utf-8"
    )
    return home, data, tasks


# Posts with an empty text (`drop_the_burst` says why).
EMPTY_POSTS = '{"post_id": "e1", "text": ""}\n{"post_id": "e2", "text": "   "}\n'


def drop_the_burst(data: Path) -> tuple[Path, list[str], dict[str, int]]:
    """The drop zone, the burst's partition keys (sorted) and each file's rows."""
    # Three drops: four real posts, then two files of posts with an empty text, which become error
    # rows without reaching the engine (one engine start on a CPU is the slow part of this test).
    lines = (SAMPLES / "sentiment" / "posts-sample.jsonl").read_text(encoding="utf-8").splitlines()
    drops = {"posts-a.jsonl": "\n".join(lines[:4]) + "\n", "posts-b.jsonl": EMPTY_POSTS, "posts-c.jsonl": EMPTY_POSTS}
    rows = {"posts-a.jsonl": 4, "posts-b.jsonl": 2, "posts-c.jsonl": 2}
    zone = data / "drops" / "sentiment"
    zone.mkdir(parents=True)
    for name, content in drops.items():
        (zone / name).write_text(content, encoding="utf-8")
    keys = sorted(partition_key_for(name) for name in drops)
    return zone, keys, rows


def start_the_sensor(
    postgres: PostgresServer, home: Path, data: Path, tasks: Path, tiny_model_path: str, monkeypatch: pytest.MonkeyPatch
) -> dict[str, str]:
    """The drops sensor started in the instance; the environment the daemon runs with."""
    env = {
        **os.environ,
        **postgres.env(),
        "DAGSTER_HOME": str(home),
        "BATCH_ASSETS_DATA": str(data),
        "BATCH_ASSETS_MODEL": tiny_model_path,
        "BATCH_ASSETS_TASKS_DIR": str(tasks),
    }
    for name, value in postgres.env().items():
        monkeypatch.setenv(name, value)
    bin_dir = Path(sys.executable).parent

    started = subprocess.run(
        [str(bin_dir / "dagster"), "sensor", "start", "-w", "workspace.yaml", SENSOR],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert started.returncode == 0, started.stdout + started.stderr
    return env


def finished(runs: list[dg.DagsterRun], count: int = 1) -> list[dg.DagsterRun] | None:
    return runs if len(runs) >= count and all(run.is_finished for run in runs[:count]) else None


def run_the_drops(
    instance: dg.DagsterInstance, env: dict[str, str], log: Path, zone: Path
) -> tuple[list[dg.DagsterRun], list[dg.DagsterRun]]:
    """The daemon over the burst, then a single file, then a burst with a bad file: the single file's
    run and the good file's re-run."""
    with running_daemon(env, log) as daemon:
        daemon.wait_until(
            lambda: finished(instance.get_runs(filters=dg.RunsFilter(tags={"batch_assets/launched_by": "sensor"})), 2),
            lambda: "the burst's runs not finished",
            RUNS_TIMEOUT_S,
        )
        # A single new file later is one run of its partition.
        (zone / "posts-d.jsonl").write_text(EMPTY_POSTS, encoding="utf-8")
        single = daemon.wait_until(
            lambda: finished(
                instance.get_runs(filters=dg.RunsFilter(tags={"dagster/partition": partition_key_for("posts-d.jsonl")}))
            ),
            lambda: "the single run not finished",
            RUNS_TIMEOUT_S,
        )
        # A burst with a bad file (no record has the task's text field): its range run fails, and
        # the range failure sensor runs the good file of that range again on its own.
        (zone / "posts-e.jsonl").write_text('{"post_id": "x1", "body": "no text field"}\n', encoding="utf-8")
        (zone / "posts-f.jsonl").write_text(EMPTY_POSTS, encoding="utf-8")
        rerun = daemon.wait_until(
            lambda: finished(
                instance.get_runs(filters=dg.RunsFilter(tags={"batch_assets/launched_by": "range_failure_sensor"}))
            ),
            lambda: "no re-run of the good file",
            RUNS_TIMEOUT_S,
        )
    return single, rerun


def assert_the_good_file_ran_again(instance: dg.DagsterInstance, rerun: list[dg.DagsterRun], log: Path) -> None:
    bad_key, good_key = partition_key_for("posts-e.jsonl"), partition_key_for("posts-f.jsonl")
    [bad_range] = [run for run in instance.get_runs() if run.tags.get("dagster/asset_partition_range_start") == bad_key]
    assert bad_range.status == dg.DagsterRunStatus.FAILURE
    [rerun] = rerun
    assert rerun.status == dg.DagsterRunStatus.SUCCESS, log.read_text()[-3000:]
    assert rerun.tags["dagster/partition"] == good_key and rerun.tags["batch_assets/rerun_of"] == bad_range.run_id
    labels_of = {
        key: instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=dg.AssetKey(["sentiment", "validated_labels"]), asset_partitions=[key]),
            limit=1,
        ).records
        for key in (bad_key, good_key)
    }
    assert labels_of[good_key][0].asset_materialization.metadata["rows"].value == 2 and not labels_of[bad_key]


def assert_one_tick_grouped_the_burst(instance: dg.DagsterInstance, keys: list[str], log: Path) -> None:
    # One tick turned the three files into three partitions (oldest first) and two runs: a range of
    # two partitions, then the third alone; no backfill to wait for.
    assert instance.get_dynamic_partitions(partitions_def_name("sentiment"))[:3] == keys
    assert not instance.get_backfills()
    later = {partition_key_for(name) for name in ("posts-d.jsonl", "posts-e.jsonl", "posts-f.jsonl")}
    runs = [
        run
        for run in instance.get_runs()
        if not later & {run.tags.get("dagster/partition"), run.tags.get("dagster/asset_partition_range_start")}
    ]
    ranges = sorted(
        (run.tags.get("dagster/asset_partition_range_start"), run.tags.get("dagster/asset_partition_range_end"))
        if "dagster/partition" not in run.tags
        else (run.tags["dagster/partition"],)
        for run in runs
    )
    assert ranges == [(keys[0], keys[1]), (keys[2],)]
    assert all(run.tags["batch_assets/launched_by"] == "sensor" for run in runs)
    failed = {run.run_id: run.status for run in runs if run.status != dg.DagsterRunStatus.SUCCESS}
    assert not failed, f"{failed}\n{log.read_text()[-3000:]}"


def assert_checks_per_partition(
    instance: dg.DagsterInstance, rows: dict[str, int], keys: list[str], data: Path
) -> None:
    # Each partition's labels and check results are in the event log, per partition.
    labels_key = dg.AssetKey(["sentiment", "validated_labels"])
    for name, expected_rows in rows.items():
        records = instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=labels_key, asset_partitions=[partition_key_for(name)]), limit=1
        ).records
        assert records and records[0].asset_materialization.metadata["rows"].value == expected_rows
    evaluations = [
        record.event_log_entry.dagster_event.event_specific_data
        for record in instance.get_event_records(
            dg.EventRecordsFilter(event_type=dg.DagsterEventType.ASSET_CHECK_EVALUATION)
        )
    ]
    passed = {(e.partition, e.check_name) for e in evaluations if e.passed}
    for key in keys:
        assert {(key, "labels_are_valid"), (key, "one_row_per_record"), (key, "outputs_satisfy_constraint")} <= passed
    # The empty posts are error rows, flagged by the WARN check of their partition only, whose
    # result points at the failing rows and the file that holds them.
    assert (partition_key_for("posts-a.jsonl"), "error_share_below_threshold") in passed
    empty_key = partition_key_for("posts-b.jsonl")
    flagged = next(e for e in evaluations if e.partition == empty_key and e.check_name == "error_share_below_threshold")
    assert not flagged.passed
    assert flagged.metadata["failed_row_ids"].value == [0, 1]
    assert flagged.metadata["rows_file"].value == str(
        data / "storage" / "sentiment" / "validated_labels" / f"{empty_key}.parquet"
    )
    # The first two partitions were processed in one run, the third in another.
    inference = {
        key: instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=dg.AssetKey(["sentiment", "inference_outputs"]), asset_partitions=[key]),
            limit=1,
        ).records[0]
        for key in keys
    }
    assert inference[keys[0]].run_id == inference[keys[1]].run_id != inference[keys[2]].run_id


def assert_the_single_run(instance: dg.DagsterInstance, single: list[dg.DagsterRun], log: Path) -> None:
    # The later single file: one run with the sensor's tags, its checks evaluated for its partition.
    [run] = single
    assert run.status == dg.DagsterRunStatus.SUCCESS, log.read_text()[-3000:]
    assert run.tags["batch_assets/source_file"] == "posts-d.jsonl" and "dagster/backfill" not in run.tags
    assert {"labels_are_valid", "one_row_per_record", "outputs_satisfy_constraint", "error_share_below_threshold"} <= {
        r.event_log_entry.dagster_event.event_specific_data.check_name
        for r in instance.get_records_for_run(run.run_id, of_type=dg.DagsterEventType.ASSET_CHECK_EVALUATION).records
    }

    # The `gpu` pool got its default limit of 1 and is free again.
    pool = instance.event_log_storage.get_concurrency_info("gpu")
    assert pool.slot_count == 1 and pool.active_slot_count == 0


def assert_all_in_postgres(instance: dg.DagsterInstance, data: Path, home: Path) -> None:
    # And all of it is in Postgres itself, not in files under DAGSTER_HOME.
    assert type(instance.run_storage).__name__ == "PostgresRunStorage"
    assert type(instance.event_log_storage).__name__ == "PostgresEventLogStorage"
    # The result cache too: the four inferred posts are rows of its table in the same database, and
    # no SQLite cache was made beside the outputs or the instance.
    from batch_assets.storage.result_cache import RESULTS, instance_postgres_url

    url = instance_postgres_url(instance)
    assert url is not None
    engine = sqlalchemy.create_engine(url)
    try:
        with engine.connect() as connection:
            cached = connection.execute(sqlalchemy.select(sqlalchemy.func.count()).select_from(RESULTS)).scalar()
    finally:
        engine.dispose()
    assert cached == 4
    assert not list(data.rglob("*.sqlite3")) and not list(home.rglob("*.sqlite3"))
