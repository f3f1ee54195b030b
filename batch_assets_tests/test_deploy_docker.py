"""The multi-container deployment (deploy/docker/topology.py) run for real: Postgres, S3 (moto's
server), the code server, the daemon and the webserver as containers of the image `make image`
built, and each Dagster run in a container of its own through dagster-docker's DockerRunLauncher.

`make deploy-check` runs this file after `make image`; `make test` leaves it out (marker `image`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import dagster as dg
import polars as pl
import pytest

from batch_assets_tests.support import SAMPLES, free_port
from batch_assets_tests.support.topology import TOPOLOGY, drop_posts, labels_in_s3, s3

pytestmark = [pytest.mark.image, pytest.mark.slow]
WORKSPACE = ["-w", f"{TOPOLOGY.DAGSTER_HOME}/workspace.yaml"]
SAMPLE = SAMPLES / "sentiment" / "posts-sample.jsonl"
FINISHED = {dg.DagsterRunStatus.SUCCESS, dg.DagsterRunStatus.FAILURE, dg.DagsterRunStatus.CANCELED}


@pytest.fixture(scope="module")
def topology() -> Iterator[tuple]:
    settings = TOPOLOGY.Settings(webserver_port=free_port(), postgres_port=free_port(), s3_port=free_port())
    try:
        containers = TOPOLOGY.up(settings)
    except Exception:
        print(service_logs())
        TOPOLOGY.down()
        raise
    yield settings, containers
    TOPOLOGY.down()


def service_logs() -> str:
    engine = TOPOLOGY.client()
    return "\n".join(
        f"--- {c.name}\n{c.logs(tail=40).decode(errors='replace')}"
        for c in engine.containers.list(all=True, filters={"label": TOPOLOGY.LABEL})
    )


@pytest.fixture(scope="module")
def instance(topology: tuple, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dg.DagsterInstance]:
    """The deployment's instance seen from the host: its Postgres on the published port."""
    settings, _ = topology
    home = tmp_path_factory.mktemp("host_home")
    (home / "dagster.yaml").write_text((TOPOLOGY.HERE.parent / "postgres" / "dagster.yaml").read_text())
    with pytest.MonkeyPatch.context() as patch:
        for key, value in {
            **TOPOLOGY.POSTGRES,
            "DAGSTER_PG_HOST": "127.0.0.1",
            "DAGSTER_PG_PORT": str(settings.postgres_port),
        }.items():
            patch.setenv(key, value)
        with dg.DagsterInstance.from_config(str(home)) as opened:
            yield opened


def wait_for_runs(instance: dg.DagsterInstance, count: int, timeout: float, logs) -> list[dg.DagsterRun]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        runs = instance.get_runs()
        if len(runs) >= count and all(run.status in FINISHED for run in runs):
            return runs
        time.sleep(3)
    raise AssertionError(f"runs not finished after {timeout:.0f} s: {instance.get_runs()}\n{logs()}")


def test_doctor_in_the_code_server_says_ready_and_every_service_runs_as_10001_on_a_read_only_root(
    topology: tuple,
) -> None:
    _, containers = topology
    result = containers["code"].exec_run(["batch-assets", "doctor"])
    output = result.output.decode()
    assert result.exit_code == 0, output
    assert "FAIL" not in output, output
    for name in ("s3", "code", "daemon", "webserver"):
        inspected = TOPOLOGY.client().api.inspect_container(containers[name].id)
        assert (inspected["Config"]["User"], inspected["HostConfig"]["ReadonlyRootfs"]) == ("10001", True), name


@pytest.fixture(scope="module")
def sensor_on(topology: tuple) -> None:
    _, containers = topology
    started = containers["daemon"].exec_run(["dagster", "sensor", "start", "sentiment_drops_sensor", *WORKSPACE])
    assert started.exit_code == 0, started.output.decode()


def runs_of(instance: dg.DagsterInstance, partition: str) -> list[dg.DagsterRun]:
    return [run for run in instance.get_runs() if run.tags.get("dagster/partition") == partition]


def test_an_s3_drop_becomes_one_sensor_run_whose_container_labels_it(
    topology: tuple, instance: dg.DagsterInstance, sensor_on: None
) -> None:
    settings, _ = topology
    client = s3(settings)
    client.upload_file(str(SAMPLE), TOPOLOGY.BUCKET, "data/drops/sentiment/posts-sample.jsonl")

    wait_for_runs(instance, 1, timeout=1200, logs=service_logs)
    (run,) = runs_of(instance, "posts-sample.jsonl")
    assert run.status == dg.DagsterRunStatus.SUCCESS, service_logs()
    assert run.tags["dagster/partition"] == "posts-sample.jsonl"

    # The run had a container of its own, as the instance's run launcher sets it up.
    inspected = TOPOLOGY.client().api.inspect_container(run.tags["docker/container_id"])
    assert inspected["Config"]["User"] == "10001"
    assert inspected["HostConfig"]["ReadonlyRootfs"] is True
    assert inspected["Config"]["Image"] == settings.image

    # Its labels are in S3, one per line of the drop; its materializations in Postgres.
    keys = [
        item["Key"]
        for item in client.list_objects_v2(Bucket=TOPOLOGY.BUCKET, Prefix="data/storage/sentiment/validated_labels")[
            "Contents"
        ]
    ]
    assert keys == ["data/storage/sentiment/validated_labels/posts-sample.jsonl.parquet"], keys
    labels = labels_in_s3(client, "posts-sample.jsonl")
    assert labels.height == 36
    assert set(labels["label"].drop_nulls()) <= {"positive", "negative", "neutral"}
    event = instance.get_latest_materialization_event(dg.AssetKey(["sentiment", "validated_labels"]))
    assert event is not None and event.run_id == run.run_id
    metadata = event.asset_materialization.metadata
    assert metadata["dagster/row_count"].value == 36, json.dumps({k: str(v) for k, v in metadata.items()})


# Enough rows that the first checkpoint (after 30 s) comes well before the end on two cores.
BIG = 1200


def test_a_run_container_killed_mid_partition_is_retried_by_the_daemon_each_row_once(
    topology: tuple, instance: dg.DagsterInstance, sensor_on: None, tmp_path: Path
) -> None:
    """kill -9 of a run's container once it checkpointed: run monitoring marks the run failed, run
    retries start it again in a new container, which reuses the checkpoints."""
    settings, _ = topology
    client = s3(settings)
    drop_posts(client, tmp_path, "big.jsonl", [f"post {i}: the delivery took {i % 9} days" for i in range(BIG)])
    checkpoints = "data/storage/sentiment/_checkpoints/big.jsonl/"

    def checkpointed() -> int:
        listed = client.list_objects_v2(Bucket=TOPOLOGY.BUCKET, Prefix=checkpoints).get("Contents", [])
        return sum(
            pl.read_parquet(client.get_object(Bucket=TOPOLOGY.BUCKET, Key=item["Key"])["Body"].read()).height
            for item in listed
        )

    deadline = time.monotonic() + 900
    while not (runs_of(instance, "big.jsonl") and checkpointed()):
        assert time.monotonic() < deadline, service_logs()
        time.sleep(1)
    (first,) = runs_of(instance, "big.jsonl")
    container = TOPOLOGY.client().containers.get(first.tags["docker/container_id"])
    container.kill(signal="SIGKILL")
    done_before_kill = checkpointed()
    assert 0 < done_before_kill < BIG

    deadline = time.monotonic() + 1200
    while True:
        runs = runs_of(instance, "big.jsonl")
        if len(runs) == 2 and all(run.status in FINISHED for run in runs):
            break
        assert time.monotonic() < deadline, f"{runs}\n{service_logs()}"
        time.sleep(3)
    retry, killed = runs  # newest first
    assert killed.run_id == first.run_id and killed.status == dg.DagsterRunStatus.FAILURE
    assert retry.status == dg.DagsterRunStatus.SUCCESS, service_logs()
    assert retry.tags["dagster/parent_run_id"] == first.run_id
    assert retry.tags["docker/container_id"] != first.tags["docker/container_id"]

    labels = labels_in_s3(client, "big.jsonl")
    assert labels["post_id"].to_list() == [f"big{i}" for i in range(BIG)]
    assert labels["label"].null_count() == 0
    record = instance.fetch_materializations(
        dg.AssetRecordsFilter(
            asset_key=dg.AssetKey(["sentiment", "inference_outputs"]), asset_partitions=["big.jsonl"]
        ),
        limit=10,
    ).records
    assert [r.run_id for r in record] == [retry.run_id]
    metadata = record[0].asset_materialization.metadata
    assert metadata["rows_from_checkpoint"].value >= done_before_kill
    assert metadata["rows_from_checkpoint"].value + metadata["rows_inferred"].value == BIG


def test_a_daemon_restarted_during_a_burst_of_ten_drops_loses_none_and_runs_none_twice(
    topology: tuple, instance: dg.DagsterInstance, sensor_on: None, tmp_path: Path
) -> None:
    settings, containers = topology
    client = s3(settings)
    names = [f"burst-{i}.jsonl" for i in range(10)]
    for number, name in enumerate(names):
        drop_posts(client, tmp_path, name, [f"burst {number}, post {i}" for i in range(4)])
    containers["daemon"].restart(timeout=30)

    labels_key = dg.AssetKey(["sentiment", "validated_labels"])
    deadline = time.monotonic() + 1200
    while not set(names) <= instance.get_materialized_partitions(labels_key):
        assert time.monotonic() < deadline, service_logs()
        time.sleep(3)
    wait_for_runs(instance, 1, timeout=600, logs=service_logs)
    for name in names:
        records = instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=labels_key, asset_partitions=[name]), limit=10
        ).records
        assert len(records) == 1, (name, [r.run_id for r in records])
    # Each file in exactly one run (a run covers one file or a range of them).
    burst_runs = [
        run
        for run in instance.get_runs()
        if run.tags.get("dagster/partition", "").startswith("burst-")
        or run.tags.get("dagster/asset_partition_range_start", "").startswith("burst-")
    ]
    assert burst_runs and all(run.status == dg.DagsterRunStatus.SUCCESS for run in burst_runs), burst_runs


def test_postgres_restarted_during_a_run_records_nothing_twice(
    topology: tuple, instance: dg.DagsterInstance, sensor_on: None, tmp_path: Path
) -> None:
    """The run goes on (or fails loudly and is retried); either way each row is labelled once and
    the partition's labels are recorded once."""
    settings, containers = topology
    client = s3(settings)
    rows = 600
    drop_posts(client, tmp_path, "pg.jsonl", [f"pg post {i}: it arrived {i % 7} days late" for i in range(rows)])
    deadline = time.monotonic() + 900
    while not any(run.status == dg.DagsterRunStatus.STARTED for run in runs_of(instance, "pg.jsonl")):
        assert time.monotonic() < deadline, service_logs()
        time.sleep(1)
    time.sleep(20)  # into the run's steps (the engine starting, events being written)
    containers["postgres"].restart(timeout=10)

    deadline = time.monotonic() + 1200
    while True:
        try:
            runs = runs_of(instance, "pg.jsonl")
        except Exception:  # noqa: BLE001 - the host's connection to the restarted database: ask again
            runs = []
        if runs and all(run.status in FINISHED for run in runs) and runs[0].status == dg.DagsterRunStatus.SUCCESS:
            break
        assert time.monotonic() < deadline, f"{runs}\n{service_logs()}"
        time.sleep(3)
    for failed in runs[1:]:
        # A run that failed said why, in its own event log.
        assert failed.status == dg.DagsterRunStatus.FAILURE
        failures = [
            event
            for event in instance.all_logs(failed.run_id)
            if event.is_dagster_event and event.dagster_event.is_failure
        ]
        assert failures, failed.run_id
    labels_key = dg.AssetKey(["sentiment", "validated_labels"])
    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=labels_key, asset_partitions=["pg.jsonl"]), limit=10
    ).records
    assert len(records) == 1, [r.run_id for r in records]
    labels = labels_in_s3(client, "pg.jsonl")
    assert labels["post_id"].to_list() == [f"pg{i}" for i in range(rows)]
