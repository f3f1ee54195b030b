"""`<task>_split_file`: the run that splits a big drop file into shards, off the drops sensor's tick.

Where a file splits takes one pass over it (storage/shards.py): seconds for a CSV of 3,000,000
rows on a local disk, minutes for 50 million rows on S3, while Dagster fails a sensor tick after
60 s and the next tick would only start the same pass again. So a tick reads at most
`TICK_SPLIT_BYTES` of drop files (lib/drops_sensor.py). A file whose pass would read more gets a
run of this job, which splits it and keeps its plan; the file stays out of the sensor's cursor, and
the first tick that finds its plan kept adds the shards' partitions and requests their runs, as it
does for a file it split itself. Meanwhile each tick requests the same split run again under the
run key `split:<file key>@<version digest>`, which Dagster launches once.

Why a run of its own, picked up by a later tick:
- A run is where Dagster does long work: no time limit, its log and failure in the UI, a
  re-execution from there, and on Kubernetes a pod of its own (no GPU: its job's tags), not the
  code server's process.
- The sensor stays the one place that adds a file's partitions and requests their runs, so a big
  file follows the rules of every file: once per version (cursor, run keys
  `<partition key>@<version digest>`), replaced-file tag, already-done files skipped, partitions of
  an earlier split retired. A split run writes a plan and nothing else.
- Not a guess from a sample: a file's partitions must be exact (a shard's bounds decide which rows
  its run holds, and a file is split once per version); nor a pass spread over ticks: a gzip
  stream cannot resume in the middle.
A split run that fails (an unreadable file) leaves the file waiting, named in each tick's log
with that run: a new version of the file is split anew, or re-execute the run once fixed.
"""

from collections.abc import Mapping

import dagster as dg
from pydantic import Field

from batch_assets.pipeline.task_spec import TaskSpec
from batch_assets.storage.drop_files import find_drop_file
from batch_assets.storage.shards import shard_plan

# The run key Dagster gives each run a sensor requests (and filters runs by).
RUN_KEY_TAG = "dagster/run_key"


def split_job_name(task: str) -> str:
    return f"{task}_split_file"


def _op_name(task: str) -> str:
    return f"{task}__split_file"


class SplitFileConfig(dg.Config):
    partition_key: str = Field(description="The drop file's partition key (its own, not a shard's).")


def split_run_config(task: str, partition_key: str) -> dict:
    return {"ops": {_op_name(task): {"config": {"partition_key": partition_key}}}}


def build_split_job(task: TaskSpec, tags: Mapping[str, object] | None = None) -> dg.JobDefinition:
    """The task's split job; `tags`: its runs' (a small pod without a GPU on Kubernetes)."""

    @dg.op(name=_op_name(task.name))
    def split_file(context: dg.OpExecutionContext, config: SplitFileConfig) -> None:
        # The file as it is now: a version newer than the one the sensor saw is split too, and the
        # sensor's request for that version then finds its plan kept.
        drop = find_drop_file(task.name, config.partition_key)
        plan = shard_plan(task.name, drop, task.input.shard_rows)
        shards = len(plan.shards)
        context.log.info(
            f"{drop.relative_path}: {shards} shard(s) of up to {task.input.shard_rows} records"
            if shards > 1
            else f"{drop.relative_path}: one partition (at most {task.input.shard_rows} records)"
        )

    @dg.job(
        name=split_job_name(task.name),
        tags=dict(tags or {}) or None,
        description=(
            f"Splits one big `{task.name}` drop file into shards for `{task.name}_drops_sensor`, which then runs them."
        ),
    )
    def split_job() -> None:
        split_file()

    return split_job


def failed_split_runs(instance: dg.DagsterInstance, task: str, run_keys: list[str]) -> dict[str, str]:
    """Run key → id of its failed split run, for the split runs among `run_keys` that failed."""
    failed = {}
    for key in run_keys:
        runs = instance.get_runs(dg.RunsFilter(job_name=split_job_name(task), tags={RUN_KEY_TAG: key}), limit=1)
        if runs and runs[0].status == dg.DagsterRunStatus.FAILURE:
            failed[key] = runs[0].run_id
    return failed
