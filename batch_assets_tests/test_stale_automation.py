"""`automation: {rematerialize_stale: true}` on a real instance: partitions made with an earlier
version of the task are requested, also when the option is turned on together with the edit."""

from __future__ import annotations

from pathlib import Path

import dagster as dg
import pytest

from batch_assets.lib.task_definitions import build_definitions, pipeline_job_name
from batch_assets.pipeline.task_spec import TaskSpec
from batch_assets.storage.drop_files import partition_key_for, partitions_def_name
from batch_assets_tests.support import drop

# The slow tier (`make test-fast` leaves it out): every test materializes on the engine (tiny model).
pytestmark = pytest.mark.slow

TASK = "stale"
FORMATTED = dg.AssetKey([TASK, "formatted_prompts"])


def task_spec(template: str, *, rematerialize_stale: bool) -> TaskSpec:
    return TaskSpec.model_validate(
        {
            "name": TASK,
            "input": {"text_fields": ["text"]},
            "prompt": {"system": "Answer with one letter.", "template": template},
            "engine": {"max_model_len": 512, "kv_cache_memory_gib": 0.25},
            "sampling": {"temperature": 0, "max_tokens": 4},
            "output": {"kind": "choices", "choices": ["a", "b"]},
            "automation": {"rematerialize_stale": rematerialize_stale},
        }
    )


def format_partition(task: TaskSpec, instance: dg.DagsterInstance, file_name: str) -> str:
    """Materializes the partition's raw and formatted prompts (no engine needed)."""
    key = partition_key_for(file_name)
    instance.add_dynamic_partitions(partitions_def_name(TASK), [key])
    job = build_definitions(tasks=[task]).resolve_job_def(pipeline_job_name(TASK))
    selection = [dg.AssetKey([TASK, "raw_prompts"]), FORMATTED]
    assert job.execute_in_process(instance=instance, partition_key=key, asset_selection=selection).success
    return key


def test_turning_the_option_on_with_an_edit_requests_the_partitions_made_before(
    data_dir: Path, tiny_model: str
) -> None:
    drop(data_dir, TASK, "old.jsonl", '{"text": "one"}\n{"text": "two"}\n')
    drop(data_dir, TASK, "current.jsonl", '{"text": "three"}\n')
    before = task_spec("Item: {text}", rematerialize_stale=False)
    edited = task_spec("Thing: {text}", rematerialize_stale=True)
    with dg.instance_for_test() as instance:
        old = format_partition(before, instance, "old.jsonl")
        current = format_partition(edited, instance, "current.jsonl")
        # The prompt edit and the option arrive together: the sensor's first tick, evaluated in the
        # code server as the daemon has it evaluated, requests the partition made before.
        defs = build_definitions(tasks=[edited])
        tick = defs.get_sensor_def(f"{TASK}_automation_sensor").evaluate_tick(
            dg.build_sensor_context(instance=instance, definitions=defs)
        )
        assert [(r.partition_key, r.asset_selection) for r in tick.run_requests or []] == [(old, [FORMATTED])]
        first = dg.evaluate_automation_conditions(defs=defs, instance=instance)
        # Only the partition formatted with the old prompt; its downstream assets were never made.
        assert first.get_requested_partitions(FORMATTED) == {old}
        assert first.total_requested == 1
        assert current not in first.get_requested_partitions(FORMATTED)
        # Requested once: a run that fails is not requested again and again.
        second = dg.evaluate_automation_conditions(
            defs=build_definitions(tasks=[edited]), instance=instance, cursor=first.cursor
        )
        assert second.total_requested == 0
        # A later edit requests every materialized partition once more.
        again = task_spec("Entry: {text}", rematerialize_stale=True)
        third = dg.evaluate_automation_conditions(
            defs=build_definitions(tasks=[again]), instance=instance, cursor=second.cursor
        )
        assert third.get_requested_partitions(FORMATTED) == {old, current}


def test_turning_the_option_on_without_an_edit_requests_nothing(data_dir: Path, tiny_model: str) -> None:
    drop(data_dir, TASK, "made.jsonl", '{"text": "one"}\n')
    with dg.instance_for_test() as instance:
        format_partition(task_spec("Item: {text}", rematerialize_stale=False), instance, "made.jsonl")
        opted = build_definitions(tasks=[task_spec("Item: {text}", rematerialize_stale=True)])
        assert dg.evaluate_automation_conditions(defs=opted, instance=instance).total_requested == 0
