"""The range failure sensor in the real daemon, over a burst with two kinds of bad file.

A burst of four drops (an unreadable parquet file, a file over the task's budget and two good files,
`runs.max_partitions_per_run: 5`) becomes one range run, which fails reading the parquet file. The
range failure sensor runs the other three again; that run fails the budget check of one, and the
sensor splits its own re-run again, so both good files end labelled, each once. The good files hold
only empty texts (error rows that never reach the engine), so no engine starts.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import dagster as dg
import pytest
import yaml

from batch_assets.storage.drop_files import partition_key_for
from batch_assets_tests.support import REPO_ROOT, running_daemon

# The slow tier (`make test-fast` leaves it out): the real daemon and the engine (tiny model).
pytestmark = pytest.mark.slow

TASK = "chain"
RUNS_TIMEOUT_S = 900
EMPTY = '{"text": ""}\n{"text": "   "}\n'


def task_yaml() -> dict:
    return {
        "name": TASK,
        "input": {"text_fields": ["text"]},
        "prompt": {"system": "Answer with one letter.", "template": "Item: {text}"},
        "engine": {"max_model_len": 512, "kv_cache_memory_gib": 0.25},
        "sampling": {"temperature": 0, "max_tokens": 4},
        "output": {"kind": "choices", "choices": ["a", "b"]},
        # 10 rows x max_tokens 4 = 40 worst-case generated tokens: over budget.
        "budget": {"max_generated_tokens": 30},
        "runs": {"max_partitions_per_run": 5},
        "sensor": {"running_by_default": True, "minimum_interval_seconds": 5},
    }


def labelled(instance: dg.DagsterInstance, key: str) -> int:
    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=dg.AssetKey([TASK, "validated_labels"]), asset_partitions=[key]), limit=5
    ).records
    return len(records)


def test_the_daemon_labels_every_good_file_of_a_burst_with_two_kinds_of_bad_file(
    tmp_path: Path, tiny_model_path: str
) -> None:
    home, data, tasks = tmp_path / "dagster_home", tmp_path / "data", tmp_path / "tasks"
    for folder in (home, tasks):
        folder.mkdir()
    shutil.copyfile(REPO_ROOT / "dagster.yaml", home / "dagster.yaml")
    # A busy 2-core machine can take longer than Dagster's default 180 s to start the code server.
    with (home / "dagster.yaml").open("a") as config:
        config.write("\ncode_servers:\n  local_startup_timeout: 900\n")
    (tasks / f"{TASK}.yaml").write_text(yaml.safe_dump(task_yaml()), encoding="utf-8")
    zone = data / "drops" / TASK
    zone.mkdir(parents=True)
    files = {
        "broken.parquet": b"not a parquet file",
        "small1.jsonl": EMPTY.encode(),
        "big.jsonl": "".join(f'{{"text": "big item {i}"}}\n' for i in range(10)).encode(),
        "small2.jsonl": EMPTY.encode(),
    }
    for age, (name, content) in enumerate(files.items()):
        (zone / name).write_bytes(content)
        settled = time.time() - 100 + age  # copied in well before the first tick, in this order
        os.utime(zone / name, (settled, settled))
    broken, small1, big, small2 = (partition_key_for(name) for name in files)

    env = {
        **os.environ,
        "DAGSTER_HOME": str(home),
        "BATCH_ASSETS_DATA": str(data),
        "BATCH_ASSETS_MODEL": tiny_model_path,
        "BATCH_ASSETS_TASKS_DIR": str(tasks),
    }
    instance = dg.DagsterInstance.from_config(str(home))

    def good_files_labelled() -> bool:
        runs = instance.get_runs()
        return labelled(instance, small1) and labelled(instance, small2) and all(run.is_finished for run in runs)

    def runs_so_far() -> str:
        runs = instance.get_runs()
        return (
            f"good files not labelled; runs {[(r.tags.get('batch_assets/launched_by'), r.status.value) for r in runs]}"
        )

    with running_daemon(env, tmp_path / "daemon.log") as daemon:
        daemon.wait_until(good_files_labelled, runs_so_far, RUNS_TIMEOUT_S)

    def summary(run: dg.DagsterRun) -> tuple:
        keys = run.tags.get("dagster/partition") or (
            f"{run.tags['dagster/asset_partition_range_start']}..{run.tags['dagster/asset_partition_range_end']}"
        )
        return keys, run.status, run.tags.get("batch_assets/left_out")

    runs = list(reversed(instance.get_runs()))  # oldest first
    by_sensor = [run for run in runs if run.tags.get("batch_assets/launched_by") == "sensor"]
    reruns = [run for run in runs if run.tags.get("batch_assets/launched_by") == "range_failure_sensor"]
    assert len(runs) == len(by_sensor) + len(reruns)
    failed, succeeded = dg.DagsterRunStatus.FAILURE, dg.DagsterRunStatus.SUCCESS
    assert [summary(run) for run in by_sensor] == [(f"{broken}..{small2}", failed, None)]
    assert [summary(run) for run in reruns] == [
        (f"{small1}..{small2}", failed, broken),
        (small1, succeeded, big),
        (small2, succeeded, big),
    ]
    first_rerun = next(run for run in reruns if run.status == failed)
    assert first_rerun.tags["batch_assets/rerun_of"] == by_sensor[0].run_id
    assert {run.tags["batch_assets/rerun_of"] for run in reruns if run.status == succeeded} == {first_rerun.run_id}
    assert {key: labelled(instance, key) for key in (broken, small1, big, small2)} == {
        broken: 0,
        small1: 1,
        big: 0,
        small2: 1,
    }
