"""`range_failure_sensor`: when a run over a range of partitions fails on some of its files, the
other files of the range are run again without them.

Dagster records an asset of a run for all of the run's partitions or for none, so one bad drop file
fails its whole range: an unreadable file fails `raw_prompts` (which names every bad file of the
range in the failure's `failed_partitions` metadata), and a failed blocking check of one partition
(over budget, invalid outputs or labels) stops the range's later steps. This sensor watches the
failed runs of every task (drops sensor ranges and UI backfills alike) and requests runs of the
task's job for the partitions that did not fail, in ranges of up to `runs.max_partitions_per_run`
(split around the bad files); the bad files stay failed, each named in the failed run, until they
are replaced (the drops sensor runs a replaced file again) or re-run. Partitions whose labels the
failed run did store (a blocking check on `validated_labels` fails after the asset) are not run
again. What the re-run partitions had done before is reused: checkpoints and result-cache entries.

Its own re-runs are split again when they fail: a range can hold bad files of several kinds, and
each kind shows only once the others are gone (an unreadable file fails `raw_prompts` before the
budget check of another file is reached). This converges: every partition a failure names was in
the failed run's range, and no re-run covers it, so each re-run covers fewer partitions than the
run it replaces, and a single-partition run that fails is not run again. Every good file of a
burst ends materialized once, however many bad files it holds. The files left out are named in
the tick's log and in the re-runs' `batch_assets/left_out` tag.

It does nothing when the engine failed (`inference_outputs`: the step retries, and a re-run resumes
from the checkpoints), when the failure names no partition (a task-wide problem would fail every
file again; the files left unlabelled are logged), for single-partition runs and for
`batch-assets run` (the CLI runs a failed range again file by file itself). Run keys name the
failed run's root (a re-execution of it from the UI shares it), so nothing is requested twice.

A run status sensor ends its tick at the first run it returns requests for, and Dagster ticks it
every 30 s: one sensor for all tasks, returning nothing for runs it leaves alone, so those never
cost a tick.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import dagster as dg

from batch_assets.lib.materializations import latest_materialization
from batch_assets.lib.run_requests import LAUNCHED_BY_TAG, RANGE_END_TAG, RANGE_START_TAG, partition_ranges
from batch_assets.pipeline.task_spec import TaskSpec
from batch_assets.storage.drop_files import partitions_def_name

RANGE_FAILURE_SENSOR_NAME = "range_failure_sensor"
RERUN_OF_TAG = "batch_assets/rerun_of"
# The partitions of the failed run that its re-runs leave out (they failed, or were labelled).
LEFT_OUT_TAG = "batch_assets/left_out"
LEFT_OUT_TAG_MAX_CHARS = 1000  # a tag names the first ones; the tick's log names them all
# Where raw_prompts lists the files of its range that cannot be read.
FAILED_PARTITIONS_METADATA = "failed_partitions"
ROOT_RUN_TAG = "dagster/root_run_id"  # set by Dagster on a re-execution of a run


@dataclass(frozen=True)
class RangeFailure:
    """What a failed run tells about its partitions."""

    partitions: list[str]  # the run's range, in the partitions' order
    bad: set[str]  # partitions the failure names (unreadable files, failed blocking checks)
    engine_failed: bool  # inference_outputs failed: retries and re-runs resume from checkpoints
    labelled: set[str] = field(default_factory=set)  # partitions whose labels the failed run stored


def splits_failed_run(tags: Mapping[str, str]) -> bool:
    """Whether the sensor acts on a failed run with these tags: every range run but the CLI's, which
    runs its failed ranges again file by file itself. Its own re-runs included (see the module)."""
    return tags.get(LAUNCHED_BY_TAG) != "cli"


def ranges_to_rerun(failure: RangeFailure, ordered_keys: Sequence[str], max_per_run: int) -> list[list[str]]:
    """The good partitions of a failed range, as the runs to request (ranges around the bad ones).
    None of them is a partition the failure names, so the re-runs cover fewer partitions than the
    failed run did."""
    if failure.engine_failed or len(failure.partitions) < 2 or not failure.bad:
        return []
    good = [key for key in failure.partitions if key not in failure.bad and key not in failure.labelled]
    return partition_ranges(ordered_keys, good, max_per_run)


def left_out_text(keys: Iterable[str], max_chars: int = LEFT_OUT_TAG_MAX_CHARS) -> str:
    """`keys`, sorted and comma-separated, in at most `max_chars`: those past it are counted."""
    keys = sorted(keys)
    text = ", ".join(keys)
    if len(text) <= max_chars:
        return text
    shown: list[str] = []
    for key in keys:
        if len(", ".join([*shown, key]) + f" and {len(keys) - len(shown) - 1} more") > max_chars:
            break
        shown.append(key)
    return ", ".join(shown) + f" and {len(keys) - len(shown)} more" if shown else f"{len(keys)} partition(s)"


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
    """Partitions of the run whose blocking check failed (Dagster's rule: not passed, ERROR, blocking)."""
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


def labelled_by(instance: dg.DagsterInstance, task: str, run_id: str, partitions: Sequence[str]) -> set[str]:
    """Partitions whose latest `validated_labels` the run stored."""
    labelled = set()
    for key in partitions:
        record = latest_materialization(instance, dg.AssetKey([task, "validated_labels"]), key)
        if record is not None and record.run_id == run_id:
            labelled.add(key)
    return labelled


def task_of_run(run: dg.DagsterRun, tasks_by_job: dict[str, TaskSpec]) -> TaskSpec | None:
    """The task a run works for: its job's, or the one whose files an asset-selection run reads
    (drops sensor runs and UI backfills run Dagster's asset job with a selection)."""
    if run.asset_selection:
        return next(
            (task for task in tasks_by_job.values() if dg.AssetKey([task.name, "raw_prompts"]) in run.asset_selection),
            None,
        )
    return tasks_by_job.get(run.job_name)


def describe_failure(
    task: TaskSpec, run: dg.DagsterRun, instance: dg.DagsterInstance, step_failures: Sequence[dg.DagsterEvent]
) -> RangeFailure | None:
    """The failed run's range and which of its partitions failed; None when it is not a range run
    the sensor should act on."""
    if not splits_failed_run(run.tags):
        return None
    partitions = range_of(run, instance.get_dynamic_partitions(partitions_def_name(task.name)))
    if len(partitions) < 2:
        return None
    return RangeFailure(
        partitions=partitions,
        # Not limited to the range's keys: a bad file's partition may have been deleted since.
        bad=failed_partitions_of(step_failures) | blocking_check_failures(instance, run.run_id),
        engine_failed=any(event.step_key == f"{task.name}__inference_outputs" for event in step_failures),
        labelled=labelled_by(instance, task.name, run.run_id, partitions),
    )


def rerun_requests(
    task: TaskSpec, job_name: str, run: dg.DagsterRun, ranges: list[list[str]], left_out: Iterable[str] = ()
) -> list[dg.RunRequest]:
    root = run.tags.get(ROOT_RUN_TAG, run.run_id)
    tags = {LAUNCHED_BY_TAG: RANGE_FAILURE_SENSOR_NAME, RERUN_OF_TAG: run.run_id}
    if left_out:
        tags[LEFT_OUT_TAG] = left_out_text(left_out)
    requests = []
    for keys in ranges:
        run_key = f"{task.name}:{root}:{keys[0]}..{keys[-1]}"
        if len(keys) == 1:
            requests.append(dg.RunRequest(run_key=run_key, job_name=job_name, partition_key=keys[0], tags=tags))
        else:
            range_tags = {**tags, RANGE_START_TAG: keys[0], RANGE_END_TAG: keys[-1]}
            requests.append(dg.RunRequest(run_key=run_key, job_name=job_name, tags=range_tags))
    return requests


def build_range_failure_sensor(
    task_jobs: Sequence[tuple[TaskSpec, Any]], name: str = RANGE_FAILURE_SENSOR_NAME
) -> dg.SensorDefinition | None:
    """The sensor over every task's failed runs (None without tasks); `task_jobs`: each task with its
    job. Its runs are of the task's job, which brings the job's run tags (a GPU count for the
    Kubernetes run launcher). `name`: one per code location, or per task where each task is a
    component of its own (lib/component.py)."""
    if not task_jobs:
        return None
    tasks_by_job = {job.name: task for task, job in task_jobs}
    job_names = {task.name: job.name for task, job in task_jobs}

    @dg.run_failure_sensor(
        name=name,
        request_jobs=[job for _, job in task_jobs],
        default_status=dg.DefaultSensorStatus.RUNNING,
        description=(
            "When a run over several drop files fails on some of them (unreadable file, failed blocking check), "
            "runs the other files of its range again without them."
        ),
    )
    def range_failure_sensor(context: dg.RunFailureSensorContext):
        run = context.dagster_run
        task = task_of_run(run, tasks_by_job)
        failure = describe_failure(task, run, context.instance, context.get_step_failure_events()) if task else None
        if task is None or failure is None:
            return None  # not a range run of a task: the next failed run is looked at in this tick
        ordered = context.instance.get_dynamic_partitions(partitions_def_name(task.name))
        ranges = ranges_to_rerun(failure, ordered, task.runs.max_partitions_per_run)
        rerun = {key for keys in ranges for key in keys}
        unlabelled = [key for key in failure.partitions if key not in rerun and key not in failure.labelled]
        if not ranges:
            if failure.engine_failed:
                why = "its engine failed; a re-run resumes from its checkpoints"
            elif not failure.bad:
                why = "its failure names none of its files"
            else:
                why = "no other file of its range is left to run"
            context.log.warning(
                f"run {run.run_id[:8]} ({task.name}): nothing to run again ({why}); "
                f"left without labels: {left_out_text(unlabelled)}"
            )
            return None
        left_out = [key for key in failure.partitions if key not in rerun]
        context.log.info(
            f"run {run.run_id[:8]} ({task.name}) failed on {left_out_text(failure.bad)}; running "
            f"{len(rerun)} other file(s) of its range again in {len(ranges)} run(s); left out: "
            f"{left_out_text(unlabelled)} (failed)"
            + (f", {left_out_text(failure.labelled)} (labelled by the failed run)" if failure.labelled else "")
        )
        return rerun_requests(task, job_names[task.name], run, ranges, left_out)

    return range_failure_sensor
