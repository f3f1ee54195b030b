"""Which runs the range failure sensor splits, and into which runs (pure: no engine, no daemon)."""

from __future__ import annotations

from collections import Counter

import dagster as dg
import pytest

from batch_assets.lib.range_failures import (
    LEFT_OUT_TAG,
    RangeFailure,
    left_out_text,
    ranges_to_rerun,
    rerun_requests,
    splits_failed_run,
    task_of_run,
)
from batch_assets.lib.run_requests import RANGE_END_TAG, RANGE_START_TAG, partition_ranges
from batch_assets.pipeline.task_spec import load_task_specs

TASKS = {task.name: task for task in load_task_specs()}
RERUN_OF = "batch_assets/rerun_of"


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


def burst_outcome(kinds: dict[str, str], max_per_run: int) -> tuple[Counter[str], list[list[str]]]:
    """Plays a burst through the drops sensor's ranges and the range failure sensor's re-runs until
    no run is left: which partitions end materialized (how often), and every run's partitions.

    `kinds`: each file, in arrival order, "good", "unreadable" (fails raw_prompts, which names every
    unreadable file of its range) or "over_budget" (fails the budget check, reached only when every
    file of the range could be read)."""
    order = list(kinds)
    queue: list[tuple[list[str], dict[str, str]]] = [
        (keys, {"batch_assets/launched_by": "sensor"}) for keys in partition_ranges(order, order, max_per_run)
    ]
    materialized: Counter[str] = Counter()
    runs: list[list[str]] = []
    while queue:
        keys, tags = queue.pop(0)
        runs.append(keys)
        assert len(runs) <= 4 * len(order), runs  # no endless chain of re-runs
        unreadable = {key for key in keys if kinds[key] == "unreadable"}
        bad = unreadable or {key for key in keys if kinds[key] == "over_budget"}
        if not bad:
            materialized.update(keys)
            continue
        if not splits_failed_run(tags):
            continue
        run = dg.DagsterRun(job_name="t_pipeline", run_id=f"run-{len(runs)}", tags=tags)
        failure = RangeFailure(partitions=keys, bad=bad, engine_failed=False)
        ranges = ranges_to_rerun(failure, order, max_per_run)
        assert sum(map(len, ranges)) < len(keys)  # each re-run covers fewer partitions than its failed run
        for request in rerun_requests(TASKS["industry"], "t_pipeline", run, ranges, left_out=bad):
            rerun = [request.partition_key] if request.partition_key else None
            rerun = (
                rerun
                or order[order.index(request.tags[RANGE_START_TAG]) : order.index(request.tags[RANGE_END_TAG]) + 1]
            )
            queue.append((rerun, dict(request.tags)))
    return materialized, runs


@pytest.mark.parametrize(
    ("kinds", "max_per_run"),
    [
        # The issue's burst: the re-run of the three readable files fails the budget check of one.
        ({"broken": "unreadable", "small1": "good", "big": "over_budget", "small2": "good"}, 5),
        (
            {
                "a": "good",
                "b": "over_budget",
                "c": "unreadable",
                "d": "good",
                "e": "over_budget",
                "f": "good",
                "g": "unreadable",
                "h": "good",
                "i": "over_budget",
                "j": "good",
            },
            16,
        ),
        ({f"f{i:02}": ("over_budget", "good", "unreadable")[i % 3] for i in range(20)}, 4),
        ({"x": "over_budget", "y": "over_budget", "z": "unreadable"}, 16),
        ({f"g{i}": "good" for i in range(5)}, 2),
    ],
)
def test_every_good_file_of_a_burst_ends_materialized_once_however_many_bad_files_it_holds(
    kinds: dict[str, str], max_per_run: int
) -> None:
    materialized, runs = burst_outcome(kinds, max_per_run)
    assert materialized == Counter(key for key, kind in kinds.items() if kind == "good")
    assert all(len(keys) <= max_per_run for keys in runs)


def test_the_issues_burst_takes_three_rounds_and_tags_what_each_leaves_out() -> None:
    kinds = {"broken": "unreadable", "small1": "good", "big": "over_budget", "small2": "good"}
    _, runs = burst_outcome(kinds, 5)
    assert runs == [["broken", "small1", "big", "small2"], ["small1", "big", "small2"], ["small1"], ["small2"]]
    failed = dg.DagsterRun(job_name="t_pipeline", run_id="run-2", tags={RERUN_OF: "run-1"})
    [request] = rerun_requests(TASKS["industry"], "t_pipeline", failed, [["a", "b"]], left_out={"big"})
    assert request.tags[LEFT_OUT_TAG] == "big" and request.tags[RERUN_OF] == "run-2"


def test_only_the_command_lines_runs_are_left_to_it() -> None:
    assert not splits_failed_run({"batch_assets/launched_by": "cli"})
    assert splits_failed_run({"batch_assets/launched_by": "sensor"})
    assert splits_failed_run({"batch_assets/launched_by": "range_failure_sensor", RERUN_OF: "run-1"})
    assert splits_failed_run({})  # a backfill from the UI


def test_left_out_partitions_are_named_within_a_tags_length() -> None:
    assert left_out_text({"b.csv", "a.csv"}) == "a.csv, b.csv"
    assert left_out_text(["aaaa", "bbbb", "cccc"], max_chars=15) == "aaaa and 2 more"
    many = left_out_text([f"file-{i:04}.jsonl" for i in range(500)])
    assert len(many) <= 1000 and many.startswith("file-0000.jsonl, file-0001.jsonl") and many.endswith(" more")
