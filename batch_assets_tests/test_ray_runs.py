"""Dagster runs as Ray jobs on a real single-node Ray (a head on 127.0.0.1 offering one
`batch_assets_engine` slot), launched by a real daemon with docs/ray.md's launcher block.

Four files are dropped for the sensor (`runs.max_partitions_per_run: 2`: two range runs). Each run
is a Ray job asking for one engine slot, so the second waits in Ray for the first. The second run's
Ray job is killed (its processes, SIGKILL: what a lost node does to them) once a checkpoint chunk of
its big file exists; run monitoring sees the job failed and resumes (or, resumes used up, retries) the
run in a new Ray job, which takes the checkpointed rows. Every file ends labelled once, each row once,
each partition's node recorded. The engine is the zero-cost one (bench/ray_location.py), paced so
that the run can be caught mid-inference: what is under test is Ray, Dagster and the pipeline's
checkpoints, not a model. `doctor` is checked against the same head.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import dagster as dg
import psutil
import pytest
import yaml

from batch_assets.doctor.context import DoctorContext
from batch_assets.doctor.ray_cluster import alive_nodes, check_ray_cluster
from batch_assets.storage.drop_files import partition_key_for
from batch_assets_tests.ray_head import RayHead, ray_head
from batch_assets_tests.support import REPO_ROOT, free_port, read_output, running_daemon

# The slow tier (`make test-fast` leaves it out): a Ray head, the real daemon and its runs.
pytestmark = pytest.mark.slow

TASK = "rayjobs"
BIG = 200  # rows of the file whose run is killed: 10 rows a chunk, one answer each PACE_S
PACE_S = "0.05"
RUNS_TIMEOUT_S = 240
DOCS = REPO_ROOT / "docs" / "ray.md"


def launcher_block(address: str) -> dict:
    """The first ```yaml block of docs/ray.md holding RayRunLauncher, for this head."""
    blocks = re.findall(r"```yaml\n(.*?)```", DOCS.read_text(), flags=re.DOTALL)
    block = next(block for block in blocks if "RayRunLauncher" in block)
    assert "<ray-address>" in block
    return yaml.safe_load(block.replace("<ray-address>", address))


def task_yaml() -> dict:
    return {
        "name": TASK,
        "input": {"text_fields": ["text"]},
        "prompt": {"system": "Answer with one letter.", "template": "Item: {text}"},
        "engine": {"max_model_len": 512, "batch_size": 10},
        "sampling": {"temperature": 0, "max_tokens": 4},
        "output": {"kind": "choices", "choices": ["a", "b"]},
        "runs": {"max_partitions_per_run": 2},
        "sensor": {"running_by_default": True, "minimum_interval_seconds": 5},
    }


@pytest.fixture(scope="module")
def head() -> Iterator[RayHead]:
    with ray_head({"batch_assets_engine": 1}) as started:
        yield started


def test_doctor_finds_the_head_its_version_and_its_engine_slot(head: RayHead, tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    (home / "dagster.yaml").write_text(yaml.safe_dump(launcher_block(head.address)))
    lines = [check.line() for check in check_ray_cluster(DoctorContext(home=home))]
    assert lines == [
        f"OK    ray cluster: {head.address} answers, Ray 2.60.0 as installed here, 1 alive node(s)",
        "OK    ray cluster: 1 alive node(s) offer batch_assets_engine (1 slots in all)",
    ]
    nobody = f"http://127.0.0.1:{free_port()}"
    (home / "dagster.yaml").write_text(yaml.safe_dump(launcher_block(nobody)))
    [line] = check_ray_cluster(DoctorContext(home=home))
    assert line.status == "FAIL" and line.detail.startswith(f"{nobody} does not answer as a Ray dashboard: ")
    assert line.setting == f"run_launcher.config.ray.address in {home / 'dagster.yaml'}"


def instance_home(folder: Path, address: str) -> Path:
    """The repo's dagster.yaml with docs/ray.md's block; run monitoring polls every 5 s instead of 30 s
    (the test's time), everything else as documented."""
    folder.mkdir()
    config = yaml.safe_load((REPO_ROOT / "dagster.yaml").read_text())
    block = launcher_block(address)
    config.update(block)
    config["run_monitoring"]["poll_interval_seconds"] = 5
    config["code_servers"] = {"local_startup_timeout": 600}  # a busy 2-core machine
    (folder / "dagster.yaml").write_text(yaml.safe_dump(config))
    return folder


def drop_files(zone: Path) -> dict[str, int]:
    zone.mkdir(parents=True)
    rows = {"small1.jsonl": 5, "small2.jsonl": 5, "small3.jsonl": 5, "big.jsonl": BIG}
    for age, (name, n) in enumerate(rows.items()):
        (zone / name).write_text("".join(f'{{"text": "{name} item {i}"}}\n' for i in range(n)))
        settled = time.time() - 100 + age  # copied in well before the first tick, in this order
        os.utime(zone / name, (settled, settled))
    return {partition_key_for(name): n for name, n in rows.items()}


def kill_run_worker(run_id: str) -> list[int]:
    """SIGKILL every process of the run's Ray job (the entrypoint's shell and `dagster api`), as a lost
    node leaves them."""
    killed = []
    for process in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(process.info["cmdline"] or ())
        if run_id in cmdline and " api " in cmdline:
            try:
                os.kill(process.pid, signal.SIGKILL)
                killed.append(process.pid)
            except ProcessLookupError:
                pass
    return killed


def job_requests(address: str) -> dict[str, dict[str, float]]:
    """What each Ray job's entrypoint asked for, by submission id: the resources its supervisor actor
    (`_ray_internal_job_actor_<submission id>`, where the entrypoint runs) was placed with."""
    prefix = "_ray_internal_job_actor_"
    with urllib.request.urlopen(f"{address}/api/v0/actors?detail=1&limit=10000", timeout=10) as response:
        actors = json.loads(response.read())["data"]["result"]["result"]
    return {
        actor["name"][len(prefix) :]: actor.get("required_resources") or {}
        for actor in actors
        if (actor.get("name") or "").startswith(prefix)
    }


def materializations(instance: dg.DagsterInstance, asset: str, key: str) -> list[dg.EventLogRecord]:
    return list(
        instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=dg.AssetKey([TASK, asset]), asset_partitions=[key]), limit=10
        ).records
    )


def test_drops_become_ray_jobs_and_a_killed_job_is_resumed_each_row_once(
    head: RayHead, tmp_path: Path, tiny_model_path: str
) -> None:
    from ray.job_submission import JobSubmissionClient

    home, data, tasks = instance_home(tmp_path / "home", head.address), tmp_path / "data", tmp_path / "tasks"
    tasks.mkdir()
    (tasks / f"{TASK}.yaml").write_text(yaml.safe_dump(task_yaml()))
    workspace = tmp_path / "workspace.yaml"
    location = {"python_file": {"relative_path": str(REPO_ROOT / "bench" / "ray_location.py")}}
    location["python_file"] |= {"working_directory": str(REPO_ROOT), "location_name": "ray_test"}
    workspace.write_text(yaml.safe_dump({"load_from": [location]}))
    rows = drop_files(data / "drops" / TASK)
    small1, small2, small3, big = rows
    env = {
        **os.environ,
        "DAGSTER_HOME": str(home),
        "BATCH_ASSETS_DATA": str(data),
        "BATCH_ASSETS_MODEL": tiny_model_path,
        "BATCH_ASSETS_TASKS_DIR": str(tasks),
        "BATCH_ASSETS_RAY_CPU_ONLY": "1",
        "BATCH_ASSETS_PROMPT_SECONDS": PACE_S,
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # the run workers' Ray driver on loopback too
        # A Ray job's entrypoint is `dagster api execute_run ...`: found on PATH, as in a node's image.
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    # The launcher block passes the variables it names; these are the test's own.
    env_vars = launcher_block(head.address)["run_launcher"]["config"]["ray"]["env_vars"]
    home_config = yaml.safe_load((home / "dagster.yaml").read_text())
    home_config["run_launcher"]["config"]["ray"]["env_vars"] = [
        *env_vars,
        "BATCH_ASSETS_RAY_CPU_ONLY",
        "BATCH_ASSETS_PROMPT_SECONDS",
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER",
        "PYTHONPATH",
        "PATH",
    ]
    (home / "dagster.yaml").write_text(yaml.safe_dump(home_config))
    instance = dg.DagsterInstance.from_config(str(home))
    client = JobSubmissionClient(head.address)
    chunks = data / "storage" / TASK / "_checkpoints" / big

    def big_run_checkpointed() -> dg.DagsterRun | None:
        if not list(chunks.glob("*/chunk-*.parquet")):
            return None
        return next(run for run in instance.get_runs() if run.tags.get("dagster/asset_partition_range_end") == big)

    def all_done() -> bool:
        runs = instance.get_runs()
        return (
            bool(runs)
            and all(run.is_finished for run in runs)
            and all(materializations(instance, "validated_labels", key) for key in rows)
        )

    def runs_so_far() -> str:
        jobs = client.list_jobs()
        failed = [job.submission_id for job in jobs if job.status.value == "FAILED"]
        logs = "".join(f"\n{job}: ...{client.get_job_logs(job)[-1500:]}" for job in failed[:1])
        listed = [(job.submission_id, job.status.value) for job in jobs]
        return f"runs {[(run.run_id[:8], run.status.value) for run in instance.get_runs()]}, Ray jobs {listed}{logs}"

    with running_daemon(env, tmp_path / "daemon.log", workspace) as daemon:
        killed_run = daemon.wait_until(big_run_checkpointed, runs_so_far, RUNS_TIMEOUT_S)
        assert kill_run_worker(killed_run.run_id), runs_so_far()
        daemon.wait_until(all_done, runs_so_far, RUNS_TIMEOUT_S)

    [node] = [node["node_id"] for node in alive_nodes(head.address)]
    runs = list(reversed(instance.get_runs()))  # oldest first
    jobs = {job.submission_id: job for job in client.list_jobs()}
    asked = job_requests(head.address)
    for run in runs:
        submission = f"dagster-run-{run.run_id}"
        assert jobs[submission].driver_node_id == node
        assert asked[submission].get("batch_assets_engine") == 1.0 and "GPU" not in asked[submission]
    # The killed run: its first Ray job failed; resumed in the run's own next job, or retried as a new run.
    assert jobs[f"dagster-run-{killed_run.run_id}"].status.value == "FAILED"
    resumed = jobs.get(f"dagster-run-{killed_run.run_id}-1")
    final = instance.get_run_by_id(killed_run.run_id)
    if resumed is not None and final is not None and final.status == dg.DagsterRunStatus.SUCCESS:
        assert resumed.status.value == "SUCCEEDED" and asked[resumed.submission_id].get("batch_assets_engine") == 1.0
    else:
        retries = [run for run in runs if run.tags.get("dagster/parent_run_id") == killed_run.run_id]
        assert [run.status for run in retries] == [dg.DagsterRunStatus.SUCCESS], runs_so_far()
    for key, n in rows.items():
        [labelled] = materializations(instance, "validated_labels", key)
        [inferred] = materializations(instance, "inference_outputs", key)
        metadata = inferred.asset_materialization.metadata  # type: ignore[union-attr]
        assert metadata["ray_node_id"].value == node
        labels = read_output(data, TASK, "validated_labels", key)
        assert labels["row_id"].to_list() == list(range(n)) and labels["error"].is_null().all()
        assert labelled.run_id in {run.run_id for run in runs}
    big_metadata = materializations(instance, "inference_outputs", big)[0].asset_materialization.metadata  # type: ignore[union-attr]
    assert big_metadata["rows_from_checkpoint"].value > 0
    assert big_metadata["rows_inferred"].value + big_metadata["rows_from_checkpoint"].value == BIG
    assert {small1, small2, small3, big} == set(rows)
