"""`<task>_range_failure_sensor`: when a run over a range of partitions fails on some of its files,
the other files of the range are run again without them.

Dagster records an asset of a run for all of the run's partitions or for none, so one bad drop file
fails its whole range: an unreadable file fails `raw_prompts` (which names every bad file of the
range in the failure's `failed_partitions` metadata), and a failed blocking check of one partition
(over budget, invalid outputs or labels) stops the range's downstream steps. This sensor watches the
task's failed runs (drops sensor ranges and UI backfills alike) and requests runs for the partitions
that did not fail, in ranges of up to `runs.max_partitions_per_run` (split around the bad files);
the bad files stay failed, each named in the failed run, until they are replaced (the drops sensor
runs a replaced file again) or re-run. What the good files had already done is reused: their
checkpoints and result-cache entries.

It does nothing when the engine failed (`inference_outputs`: the step retries, and a re-run resumes
from the checkpoints), when the failure names no partition (a task-wide problem would fail every
file again), for single-partition runs, for `batch-assets run` (the CLI runs a failed range again
file by file itself) and for runs this sensor requested (no chains). Run keys name the failed run,
so a retried tick requests nothing twice.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import dagster as dg

from batch_assets.dagster_defs.sensors import LAUNCHED_BY_TAG, RANGE_END_TAG, RANGE_START_TAG, partition_ranges
from batch_assets.pipeline.task_spec import TaskSpec
from batch_assets.storage.drop_files import partitions_def_name

RERUN_OF_TAG = "batch_assets/rerun_of"
# Where raw_prompts lists the files of its range that cannot be read (assets.py).
FAILED_PARTITIONS_METADATA = "failed_partitions"


@dataclass(frozen=True)
class RangeFailure:
    """What a failed run tells about its partitions."""

    partitions: list[str]  # the run's range, in the partitions' order
    bad: set[str]  # partitions the failure names (unreadable files, failed blocking checks)
    engine_failed: bool  # inference_outputs failed: retries and re-runs resume from checkpoints


def ranges_to_rerun(failure: RangeFailure, ordered_keys: Sequence[str], max_per_run: int) -> list[list[str]]:
    """The good partitions of a failed range, as the runs to request (ranges around the bad ones)."""
    if failure.engine_failed or len(failure.partitions) < 2 or not failure.bad:
        return []
    good = [key for key in failure.partitions if key not in failure.bad]
    return partition_ranges(ordered_keys, good, max_per_run)


def range_of(run: dg.DagsterRun, ordered_keys: Sequence[str]) -> list[str]:
    """The partitions of a run over a range (empty for a single-partition run, or keys now gone)."""
    start, end = run.tags.get(RANGE_START_TAG), run.tags.get(RANGE_END_TAG)
    if start is None or end is None or start not in ordered_keys or end not in ordered_keys:
        return []
    return list(ordered_keys[ordered_keys.index(start) : ordered_keys.index(end) + 1])


def failed_partitions_of(step_failures: Iterable[dg.DagsterEvent]) -> set[str]:
    """The partitions a step failure names in its `failed_partitions` metadata."""
    named: set[str] = set()
    for event in step_failures:
        user_data = event.step_failure_data.user_failure_data
        value = user_data.metadata.get(FAILED_PARTITIONS_METADATA) if user_data is not None else None
        if value is not None and isinstance(value.value, list):
            named.update(str(key) for key in value.value)
    return named


def blocking_check_failures(instance: dg.DagsterInstance, run_id: str) -> set[str]:
    """Partitions of the run whose blocking check failed (their downstream steps were skipped)."""
    records = instance.get_records_for_run(run_id, of_type=dg.DagsterEventType.ASSET_CHECK_EVALUATION).records
    failed: set[str] = set()
    for record in records:
        event = record.event_log_entry.dagster_event
        evaluation = event.event_specific_data if event is not None else None
        if (
            isinstance(evaluation, dg.AssetCheckEvaluation)
            and not evaluation.passed
            and evaluation.blocking
            and evaluation.severity == dg.AssetCheckSeverity.ERROR
            and evaluation.partition is not None
        ):
            failed.add(evaluation.partition)
    return failed


def runs_task_assets(run: dg.DagsterRun, task: TaskSpec, job_name: str) -> bool:
    """A run of the task's job, or of an asset selection (sensor runs, UI backfills) with its files."""
    if run.asset_selection:
        return dg.AssetKey([task.name, "raw_prompts"]) in run.asset_selection
    return run.job_name == job_name


def describe_failure(
    task: TaskSpec,
    job_name: str,
    run: dg.DagsterRun,
    instance: dg.DagsterInstance,
    step_failures: Sequence[dg.DagsterEvent],
) -> RangeFailure | None:
    """The failed run's range and which of its partitions failed; None when it is not a range run
    of this task that the sensor should act on."""
    if run.tags.get(LAUNCHED_BY_TAG) == "cli" or RERUN_OF_TAG in run.tags or not runs_task_assets(run, task, job_name):
        return None
    partitions = range_of(run, instance.get_dynamic_partitions(partitions_def_name(task.name)))
    if len(partitions) < 2:
        return None
    return RangeFailure(
        partitions=partitions,
        bad=(failed_partitions_of(step_failures) | blocking_check_failures(instance, run.run_id)) & set(partitions),
        engine_failed=any(event.step_key == f"{task.name}__inference_outputs" for event in step_failures),
    )


def rerun_request(keys: list[str], failed_run_id: str, job_tags: Mapping[str, str]) -> dg.RunRequest:
    tags = {**job_tags, LAUNCHED_BY_TAG: "range_failure_sensor", RERUN_OF_TAG: failed_run_id}
    run_key = f"{failed_run_id}:{keys[0]}..{keys[-1]}"
    if len(keys) == 1:
        return dg.RunRequest(run_key=run_key, partition_key=keys[0], tags=tags)
    return dg.RunRequest(run_key=run_key, tags={**tags, RANGE_START_TAG: keys[0], RANGE_END_TAG: keys[-1]})


def build_range_failure_sensor(task: TaskSpec, job) -> dg.SensorDefinition:
    job_tags = {key: value if isinstance(value, str) else json.dumps(value) for key, value in (job.tags or {}).items()}

    @dg.run_failure_sensor(
        name=f"{task.name}_range_failure_sensor",
        request_job=job,
        default_status=dg.DefaultSensorStatus.RUNNING,
        description=(
            f"When a `{task.name}` run over several drop files fails on some of them (unreadable file, failed "
            "blocking check), runs the other files of its range again without them."
        ),
    )
    def range_failure_sensor(context: dg.RunFailureSensorContext):
        run = context.dagster_run
        failure = describe_failure(task, job.name, run, context.instance, context.get_step_failure_events())
        if failure is None:
            return dg.SkipReason(f"run {run.run_id[:8]} is not a {task.name} range run to split")
        ordered = context.instance.get_dynamic_partitions(partitions_def_name(task.name))
        ranges = ranges_to_rerun(failure, ordered, task.runs.max_partitions_per_run)
        if not ranges:
            why = "its engine failed" if failure.engine_failed else "its failure names none of its files"
            return dg.SkipReason(f"run {run.run_id[:8]}: nothing to run again ({why})")
        context.log.info(
            f"run {run.run_id[:8]} failed on {sorted(failure.bad)}; running the other "
            f"{sum(map(len, ranges))} file(s) of its range again in {len(ranges)} run(s)"
        )
        return [rerun_request(keys, run.run_id, job_tags) for keys in ranges]

    return range_failure_sensor
