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

import boto3
import dagster as dg
import polars as pl
import pytest

from batch_assets_tests.support import SAMPLES, free_port, load_script

pytestmark = [pytest.mark.image, pytest.mark.slow]
TOPOLOGY = load_script(Path(__file__).resolve().parent.parent / "deploy" / "docker" / "topology.py")
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


def s3(settings) -> boto3.client:
    return boto3.client(
        "s3",
        endpoint_url=f"http://127.0.0.1:{settings.s3_port}",
        aws_access_key_id=TOPOLOGY.AWS["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=TOPOLOGY.AWS["AWS_SECRET_ACCESS_KEY"],
        region_name=TOPOLOGY.AWS["AWS_REGION"],
    )


def wait_for_runs(instance: dg.DagsterInstance, count: int, timeout: float, logs) -> list[dg.DagsterRun]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        runs = instance.get_runs()
        if len(runs) >= count and all(run.status in FINISHED for run in runs):
            return runs
        time.sleep(3)
    raise AssertionError(f"runs not finished after {timeout:.0f} s: {instance.get_runs()}\n{logs()}")


def test_doctor_in_the_code_server_says_ready(topology: tuple) -> None:
    _, containers = topology
    result = containers["code"].exec_run(["batch-assets", "doctor"])
    output = result.output.decode()
    assert result.exit_code == 0, output
    assert "FAIL" not in output, output


def test_an_s3_drop_becomes_one_sensor_run_whose_container_labels_it(
    topology: tuple, instance: dg.DagsterInstance
) -> None:
    settings, containers = topology
    client = s3(settings)
    client.upload_file(str(SAMPLE), TOPOLOGY.BUCKET, "data/drops/sentiment/posts-sample.jsonl")
    started = containers["daemon"].exec_run(["dagster", "sensor", "start", "sentiment_drops_sensor", *WORKSPACE])
    assert started.exit_code == 0, started.output.decode()

    (run,) = wait_for_runs(instance, 1, timeout=1200, logs=service_logs)
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
    assert len(keys) == 1, keys
    labels = pl.read_parquet(client.get_object(Bucket=TOPOLOGY.BUCKET, Key=keys[0])["Body"].read())
    assert labels.height == 36
    assert set(labels["label"].drop_nulls()) <= {"positive", "negative", "neutral"}
    event = instance.get_latest_materialization_event(dg.AssetKey(["sentiment", "validated_labels"]))
    assert event is not None and event.run_id == run.run_id
    metadata = event.asset_materialization.metadata
    assert metadata["dagster/row_count"].value == 36, json.dumps({k: str(v) for k, v in metadata.items()})
