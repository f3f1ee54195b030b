"""Runs on a multi-node Ray cluster of containers (deploy/ray/ray_topology.py, `make ray-up`): a Ray head and
two workers beside Postgres, S3 and the Dagster services, each run a Ray job (dagster-ray's RayRunLauncher).

`make ray-check` runs this file after `make image`; `make test` leaves it out (marker `image`). Not written
yet: a third worker started mid-backfill, the head restarted mid-run.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import dagster as dg
import pytest

from batch_assets.storage.drop_files import partition_key_for
from batch_assets_tests.support import REPO_ROOT, free_port, load_script
from batch_assets_tests.support.topology import drop_posts, labels_in_s3, s3

pytestmark = [pytest.mark.image, pytest.mark.slow]
RAY = load_script(REPO_ROOT / "deploy" / "ray" / "ray_topology.py")
BASE = RAY.base
WORKSPACE = ["-w", f"{BASE.DAGSTER_HOME}/workspace.yaml"]
TIMEOUT_S = 1800


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple]:
    base = BASE.Settings(
        webserver_port=free_port(),
        postgres_port=free_port(),
        s3_port=free_port(),
        extra_env={"BATCH_ASSETS_RAY_CPU_ONLY": "1", "HOME": "/tmp"},
    )
    settings = RAY.RaySettings(base=base, dashboard_port=free_port())
    try:
        containers = RAY.up(settings)
        started = containers["daemon"].exec_run(["dagster", "sensor", "start", "sentiment_drops_sensor", *WORKSPACE])
        assert started.exit_code == 0, started.output.decode()
        yield settings, containers
    finally:
        BASE.down()


@pytest.fixture(scope="module")
def instance(cluster: tuple, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dg.DagsterInstance]:
    settings, _ = cluster
    home = tmp_path_factory.mktemp("host_home")
    (home / "dagster.yaml").write_text((REPO_ROOT / "deploy" / "postgres" / "dagster.yaml").read_text())
    env = {**BASE.POSTGRES, "DAGSTER_PG_HOST": "127.0.0.1", "DAGSTER_PG_PORT": str(settings.base.postgres_port)}
    with pytest.MonkeyPatch.context() as patch:
        for key, value in env.items():
            patch.setenv(key, value)
        with dg.DagsterInstance.from_config(str(home)) as opened:
            yield opened


def inferred(instance: dg.DagsterInstance, key: str) -> dict | None:
    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=dg.AssetKey(["sentiment", "inference_outputs"]), asset_partitions=[key]),
        limit=1,
    ).records
    if not records:
        return None
    return {name: value.value for name, value in records[0].asset_materialization.metadata.items()}  # type: ignore[union-attr]


def wait(what: str, done, timeout: float = TIMEOUT_S):
    deadline = time.monotonic() + timeout
    while not (found := done()):
        assert time.monotonic() < deadline, f"{what} within {timeout} s"
        time.sleep(3)
    return found


def test_a_burst_of_drops_runs_on_both_workers_each_row_labelled_once(
    cluster: tuple, instance: dg.DagsterInstance, tmp_path: Path
) -> None:
    settings, _ = cluster
    client = s3(settings.base)
    names = [f"burst{n}.jsonl" for n in range(4)]
    # A tick's new files are one run (a range of partitions): two drops, then two more once the first
    # run holds its worker's engine slot, so that Ray places the second run's job on the other worker.
    for name in names[:2]:
        drop_posts(client, tmp_path, name, [f"{name} post {i}: the delivery took {i} days" for i in range(40)])
    wait("the first run started", lambda: instance.get_runs(dg.RunsFilter(statuses=[dg.DagsterRunStatus.STARTED])))
    for name in names[2:]:
        drop_posts(client, tmp_path, name, [f"{name} post {i}: the delivery took {i} days" for i in range(40)])
    keys = [partition_key_for(name) for name in names]
    nodes = wait(
        "four partitions inferred",
        lambda: [inferred(instance, key) for key in keys] if all(inferred(instance, key) for key in keys) else None,
    )
    assert len({metadata["ray_node_id"] for metadata in nodes}) >= 2, nodes
    for key in keys:
        labels = labels_in_s3(client, key)
        assert labels["row_id"].to_list() == list(range(40))


def test_a_worker_killed_mid_run_resumes_on_the_other_reusing_its_checkpoints(
    cluster: tuple, instance: dg.DagsterInstance, tmp_path: Path
) -> None:
    settings, _ = cluster
    client = s3(settings.base)
    engine = BASE.client()
    name, rows = "killed.jsonl", 1000
    drop_posts(client, tmp_path, name, [f"post {i}: the parcel came after {i % 9} days" for i in range(rows)])
    key = partition_key_for(name)
    prefix = f"data/storage/sentiment/_checkpoints/{key}/"

    def checkpointed() -> bool:
        return bool(client.list_objects_v2(Bucket=BASE.BUCKET, Prefix=prefix).get("KeyCount"))

    wait("a checkpoint chunk of the big file", checkpointed)
    from ray.job_submission import JobSubmissionClient

    jobs = JobSubmissionClient(f"http://127.0.0.1:{settings.dashboard_port}").list_jobs()
    [running] = [job for job in jobs if job.status.value == "RUNNING"]
    by_node = {}
    for worker in RAY.workers(engine):
        found = worker.exec_run(
            ["python", "-c", "import ray; ray.init(address='auto'); print(ray.get_runtime_context().get_node_id())"]
        )
        by_node[found.output.decode().split()[-1]] = worker
    by_node[running.driver_node_id].kill()

    metadata = wait("the killed run's partition inferred", lambda: inferred(instance, key))
    assert metadata["rows_from_checkpoint"] > 0
    assert metadata["ray_node_id"] != running.driver_node_id
    labels = labels_in_s3(client, key)
    assert labels["row_id"].to_list() == list(range(rows))
