"""Which runs the range failure sensor splits, and into which runs (pure: no engine, no daemon)."""

from __future__ import annotations

import dagster as dg

from batch_assets.dagster_defs.range_failures import RangeFailure, ranges_to_rerun, rerun_requests, task_of_run
from batch_assets.pipeline.task_spec import load_task_specs

TASKS = {task.name: task for task in load_task_specs()}


def test_a_failed_range_is_run_again_without_its_bad_files_unless_the_engine_failed() -> None:
    order = ["a", "b", "c", "d", "e", "f"]
    failed_on_c = RangeFailure(partitions=["a", "b", "c", "d", "e"], bad={"c"}, engine_failed=False)
    assert ranges_to_rerun(failed_on_c, order, 16) == [["a", "b"], ["d", "e"]]
    assert ranges_to_rerun(failed_on_c, order, 1) == [["a"], ["b"], ["d"], ["e"]]
    # Labels the failed run stored (a blocking check on validated_labels fails after the asset) stay.
    stored = RangeFailure(partitions=["a", "b", "c"], bad={"b"}, engine_failed=False, labelled={"a", "c"})
    assert ranges_to_rerun(stored, order, 16) == []
    every_file_bad = RangeFailure(partitions=["a", "b"], bad={"a", "b"}, engine_failed=False)
    assert ranges_to_rerun(every_file_bad, order, 16) == []
    # A bad file whose partition was deleted since still counts as named: the others run again.
    deleted = RangeFailure(partitions=["a", "b"], bad={"gone"}, engine_failed=False)
    assert ranges_to_rerun(deleted, order, 16) == [["a", "b"]]
    # A failure that names no file (the task's template, a full disk) would fail every file again.
    assert ranges_to_rerun(RangeFailure(partitions=["a", "b"], bad=set(), engine_failed=False), order, 16) == []
    # The engine's failures are retried from checkpoints, not split.
    assert ranges_to_rerun(RangeFailure(partitions=["a", "b"], bad={"a"}, engine_failed=True), order, 16) == []


def test_a_run_belongs_to_the_task_whose_files_it_reads() -> None:
    tasks_by_job = {"industry_pipeline": TASKS["industry"], "sentiment_pipeline": TASKS["sentiment"]}
    sensor_run = dg.DagsterRun(
        job_name="__ASSET_JOB",
        asset_selection=frozenset({dg.AssetKey(["sentiment", "raw_prompts"]), dg.AssetKey(["sentiment", "x"])}),
    )
    assert task_of_run(sensor_run, tasks_by_job) is TASKS["sentiment"]
    # A selection without the task's raw prompts (say, only its labels re-validated) is not split.
    labels_only = dg.DagsterRun(
        job_name="__ASSET_JOB", asset_selection=frozenset({dg.AssetKey(["industry", "validated_labels"])})
    )
    assert task_of_run(labels_only, tasks_by_job) is None
    assert task_of_run(dg.DagsterRun(job_name="industry_pipeline"), tasks_by_job) is TASKS["industry"]
    assert task_of_run(dg.DagsterRun(job_name="someone_elses_job"), tasks_by_job) is None


def test_rerun_requests_name_the_failed_runs_root_so_a_reexecution_requests_nothing_twice() -> None:
    failed = dg.DagsterRun(job_name="__ASSET_JOB", run_id="run-2", tags={"dagster/root_run_id": "run-1"})
    single, pair = rerun_requests(TASKS["industry"], "industry_pipeline", failed, [["a"], ["c", "d"]])
    assert (single.partition_key, single.job_name, single.run_key) == ("a", "industry_pipeline", "industry:run-1:a..a")
    assert pair.partition_key is None and pair.run_key == "industry:run-1:c..d"
    assert (pair.tags["dagster/asset_partition_range_start"], pair.tags["dagster/asset_partition_range_end"]) == (
        "c",
        "d",
    )
    assert single.tags["batch_assets/rerun_of"] == pair.tags["batch_assets/rerun_of"] == "run-2"
