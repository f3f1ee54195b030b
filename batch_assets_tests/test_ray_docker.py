"""Runs on a multi-node Ray cluster of containers (deploy/ray/ray_topology.py, `make ray-up`): a Ray head and
two workers beside Postgres, S3 and the Dagster services, each run a Ray job (dagster-ray's RayRunLauncher).

In order, on one cluster: a burst of drops placed on both workers; a third worker started mid-backfill
takes runs; the worker a run infers on killed, the run finished on another from its checkpoints; the
head restarted mid-run (last: it replaces the cluster), the run ended succeeded or failed-and-retried,
never left started. `make ray-check` runs this file after `make image`; `make test` leaves it out
(marker `image`).
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
# The later tests' own bounds: together with the first two, `make ray-check` stays near 12 minutes.
THIRD_WORKER_TIMEOUT_S = 300
HEAD_RESTART_TIMEOUT_S = 420


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


def inferred(instance: dg.DagsterInstance, key: str, asset: str = "inference_outputs") -> dict | None:
    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=dg.AssetKey(["sentiment", asset]), asset_partitions=[key]),
        limit=1,
    ).records
    if not records:
        return None
    return {name: value.value for name, value in records[0].asset_materialization.metadata.items()}  # type: ignore[union-attr]


def wait(what: str, done, timeout: float = TIMEOUT_S, describe=lambda: ""):
    deadline = time.monotonic() + timeout
    while not (found := done()):
        assert time.monotonic() < deadline, f"{what} within {timeout} s. {describe()}"
        time.sleep(3)
    return found


def runs_of(instance: dg.DagsterInstance, key: str) -> list[dg.DagsterRun]:
    """The runs of a partition (a one-file run or a range run ending there) and their retries, oldest first."""
    tags = ("dagster/partition", "dagster/asset_partition_range_end")
    runs = list(reversed(instance.get_runs()))
    roots = {run.run_id for run in runs if any(run.tags.get(tag) == key for tag in tags)}
    return [run for run in runs if run.run_id in roots or run.tags.get("dagster/root_run_id") in roots]


def drop_and_wait_for_its_run(instance: dg.DagsterInstance, client, folder: Path, name: str, rows: int) -> None:
    drop_posts(client, folder, name, [f"{name} post {i}: the delivery took {i % 7} days" for i in range(rows)])
    wait(f"a run of {name}", lambda: runs_of(instance, partition_key_for(name)), timeout=THIRD_WORKER_TIMEOUT_S)


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
    wait("four partitions labelled", lambda: all(inferred(instance, key, "validated_labels") for key in keys))
    nodes = [inferred(instance, key) for key in keys]
    assert len({metadata["ray_node_id"] for metadata in nodes}) >= 2, nodes
    for key in keys:
        labels = labels_in_s3(client, key)
        assert labels["row_id"].to_list() == list(range(40))


def test_a_third_worker_started_mid_backfill_takes_runs(
    cluster: tuple, instance: dg.DagsterInstance, tmp_path: Path
) -> None:
    settings, _ = cluster
    client = s3(settings.base)
    engine = BASE.client()
    # One run a tick: the first holds a worker while the third worker joins and the next two are
    # placed, so at least one of them finds only the new worker free (max_concurrent_runs is above
    # the slots: a run waits in Ray, not in Dagster's queue).
    rows = {"backfill0.jsonl": 400, "backfill1.jsonl": 100, "backfill2.jsonl": 100}
    names = list(rows)
    drop_and_wait_for_its_run(instance, client, tmp_path, names[0], rows[names[0]])
    third = RAY.add_worker(engine, settings)
    for name in names[1:]:
        drop_and_wait_for_its_run(instance, client, tmp_path, name, rows[name])
    third_node = wait("the third worker joined", lambda: RAY.node_id(third), timeout=THIRD_WORKER_TIMEOUT_S)
    keys = [partition_key_for(name) for name in names]
    wait(
        "the backfill's partitions labelled",
        lambda: all(inferred(instance, key, "validated_labels") for key in keys),
        timeout=THIRD_WORKER_TIMEOUT_S,
    )
    nodes = [inferred(instance, key) for key in keys]
    print(f"third worker {third_node}: partitions on nodes {[metadata['ray_node_id'] for metadata in nodes]}")
    assert third_node in {metadata["ray_node_id"] for metadata in nodes}, nodes
    for name, key in zip(names, keys, strict=True):
        assert labels_in_s3(client, key)["row_id"].to_list() == list(range(rows[name]))


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
    by_node = {RAY.node_id(worker): worker for worker in RAY.workers(engine, running_only=True)}
    by_node[running.driver_node_id].kill()

    wait("the killed run's partition labelled", lambda: inferred(instance, key, "validated_labels"))
    metadata = inferred(instance, key)
    assert metadata["rows_from_checkpoint"] > 0
    assert metadata["ray_node_id"] != running.driver_node_id
    labels = labels_in_s3(client, key)
    assert labels["row_id"].to_list() == list(range(rows))


def test_the_head_restarted_mid_run_ends_the_run_succeeded_or_retried_each_row_once(
    cluster: tuple, instance: dg.DagsterInstance, tmp_path: Path
) -> None:
    settings, _ = cluster
    client = s3(settings.base)
    name, rows = "headless.jsonl", 600
    drop_posts(client, tmp_path, name, [f"post {i}: it arrived in {i % 5} days" for i in range(rows)])
    key = partition_key_for(name)
    prefix = f"data/storage/sentiment/_checkpoints/{key}/"
    # Reaching the first chunk is the run's own pace (engine start, a loaded machine); what happens after
    # the restart is what is bounded.
    wait(
        "a checkpoint chunk before the head restarts",
        lambda: client.list_objects_v2(Bucket=BASE.BUCKET, Prefix=prefix).get("KeyCount"),
    )
    [first] = runs_of(instance, key)
    RAY.restart_head(BASE.client())

    def family() -> str:
        return str([(run.run_id[:8], run.status.value) for run in runs_of(instance, key)])

    def settled() -> list[dg.DagsterRun] | None:
        runs = runs_of(instance, key)
        succeeded = any(run.status == dg.DagsterRunStatus.SUCCESS for run in runs)
        return runs if succeeded and all(run.is_finished for run in runs) else None

    runs = wait("the run ended, succeeded or retried", settled, timeout=HEAD_RESTART_TIMEOUT_S, describe=family)
    [final] = [run for run in runs if run.run_id == first.run_id]
    metadata = inferred(instance, key)
    print(
        f"head restarted: run {first.run_id[:8]} {final.status.value} after "
        f"{instance.count_resume_run_attempts(first.run_id)} resume(s); runs {family()}; "
        f"rows_from_checkpoint {metadata['rows_from_checkpoint']} on {metadata['ray_node_id']}"
    )
    assert final.status == dg.DagsterRunStatus.SUCCESS or (
        final.status == dg.DagsterRunStatus.FAILURE and len(runs) > 1
    ), family()
    labels = labels_in_s3(client, key)
    assert labels["row_id"].to_list() == list(range(rows))
