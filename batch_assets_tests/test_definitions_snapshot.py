"""A snapshot of every definition the code location builds from the bundled tasks: asset keys,
deps, groups, partitions, pools, retry and backfill policies, check specs, jobs and sensors.

Runs in about a second with no engine. A change to any of these shows up as a readable diff; when
the change is intended, regenerate the snapshot:

    BATCH_ASSETS_UPDATE_SNAPSHOT=1 .venv/bin/python -m pytest batch_assets_tests/test_definitions_snapshot.py
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import dagster as dg
import pytest

SNAPSHOT = Path(__file__).parent / "snapshots" / "definitions.json"


def _policy(policy: object) -> str | None:
    return None if policy is None else repr(policy)


def definitions_snapshot(defs: dg.Definitions) -> dict:
    graph = defs.resolve_asset_graph()
    assets = {}
    for key in sorted(graph.get_all_asset_keys(), key=lambda k: k.to_user_string()):
        node = graph.get(key)
        retry = node.assets_def.op.retry_policy if node.assets_def.is_executable else None
        assets[key.to_user_string()] = {
            "deps": sorted(parent.to_user_string() for parent in node.parent_keys),
            "group": node.group_name,
            "partitions": str(node.partitions_def) if node.partitions_def else None,
            "pools": sorted(node.pools or []),
            "io_manager_key": node.io_manager_key,
            "kinds": sorted(node.kinds),
            "has_code_version": node.code_version is not None,
            "automation_condition": node.automation_condition.get_label() if node.automation_condition else None,
            "retry_policy": None if retry is None else {"max_retries": retry.max_retries, "delay": retry.delay},
            "backfill_policy": _policy(node.backfill_policy),
            "checks": sorted(check.name for check in node.check_keys),
        }
    checks = {}
    for key in graph.asset_check_keys:
        spec = graph.get_check_spec(key)
        checks[f"{key.asset_key.to_user_string()}:{key.name}"] = {
            "blocking": spec.blocking,
            "partitioned": spec.partitions_def is not None,
        }
    jobs = {
        job.name: {"tags": dict(sorted(job.tags.items()))}
        for job in sorted(defs.resolve_all_job_defs(), key=lambda j: j.name)
        if not job.name.startswith("__")
    }
    sensors = {
        sensor.name: {
            "default_status": sensor.default_status.value,
            "minimum_interval_seconds": sensor.minimum_interval_seconds,
            "jobs": sorted(job.name for job in sensor.jobs) if sensor.has_jobs else None,
        }
        for sensor in sorted(defs.sensors or [], key=lambda s: s.name)
    }
    return {"assets": assets, "checks": dict(sorted(checks.items())), "jobs": jobs, "sensors": sensors}


@pytest.fixture
def bundled_defs(monkeypatch: pytest.MonkeyPatch) -> dg.Definitions:
    """The code location as `dg dev` loads it, from the bundled tasks and nothing in the environment."""
    for name in ("BATCH_ASSETS_TASKS_DIR", "BATCH_ASSETS_MODEL"):
        monkeypatch.delenv(name, raising=False)
    from batch_assets.definitions import load_project_defs

    return load_project_defs()


def test_definitions_match_snapshot(bundled_defs: dg.Definitions) -> None:
    current = definitions_snapshot(bundled_defs)
    if os.environ.get("BATCH_ASSETS_UPDATE_SNAPSHOT") == "1":
        SNAPSHOT.write_text(json.dumps(current, indent=2, sort_keys=True, default=str) + "\n", encoding="utf-8")
    expected = json.loads(SNAPSHOT.read_text(encoding="utf-8"))
    assert json.loads(json.dumps(current, default=str)) == expected


def test_every_bundled_task_has_its_four_assets_and_sensor(bundled_defs: dg.Definitions) -> None:
    from batch_assets.pipeline.task_spec import load_task_specs

    snapshot = definitions_snapshot(bundled_defs)
    for task in load_task_specs():
        for asset in ("raw_prompts", "formatted_prompts", "inference_outputs", "validated_labels"):
            assert snapshot["assets"][f"{task.name}/{asset}"]["group"] == task.name
        assert snapshot["assets"][f"{task.name}/formatted_prompts"]["deps"] == [f"{task.name}/raw_prompts"]
        assert snapshot["assets"][f"{task.name}/inference_outputs"]["pools"]
        assert f"{task.name}_drops_sensor" in snapshot["sensors"]
