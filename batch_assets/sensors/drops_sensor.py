"""`<task>_drops_sensor`: a new or replaced file in the task's drop zone becomes a partition and a run.

Each tick lists the drop zone (local folder or S3 prefix, paged by s3fs), compares every input
file's version (ETag / modification time and size) with the cursor, and in the same tick adds the
new partitions and requests their runs. The cursor (partition key → short digest of the version)
and the run keys (`<partition>@<digest>`) are stored by Dagster, so a daemon restart neither loses
nor repeats work; a replaced file gets a new digest and therefore one new run, tagged as a replacement.
"""


import hashlib
import json

import dagster as dg

from batch_assets.partitions.drop_files import list_drop_files, partitions_def_name
from batch_assets.specs.task_spec import TaskSpec

SOURCE_FILE_TAG = "batch_assets/source_file"
SOURCE_VERSION_TAG = "batch_assets/source_version"
REPLACED_TAG = "batch_assets/replaced_file"


def version_digest(version: str) -> str:
    return hashlib.sha1(version.encode("utf-8")).hexdigest()[:12]


def build_drops_sensor(task: TaskSpec, job) -> dg.SensorDefinition:
    @dg.sensor(
        name=f"{task.name}_drops_sensor",
        job=job,
        minimum_interval_seconds=task.sensor.minimum_interval_seconds,
        default_status=dg.DefaultSensorStatus.RUNNING if task.sensor.running_by_default else dg.DefaultSensorStatus.STOPPED,
        description=f"Turns each new or replaced file in the `{task.name}` drop zone into a partition and a run.",
    )
    def drops_sensor(context: dg.SensorEvaluationContext) -> dg.SensorResult | dg.SkipReason:
        seen: dict[str, str] = json.loads(context.cursor) if context.cursor else {}
        files, skipped = list_drop_files(task.name)
        for relative, reason in list(skipped.items())[:20]:
            context.log.info(f"skipped {relative}: {reason}")
        existing = set(context.instance.get_dynamic_partitions(partitions_def_name(task.name)))
        new_partitions: list[str] = []
        run_requests: list[dg.RunRequest] = []
        for drop in files:
            key = drop.partition_key
            digest = version_digest(drop.version)
            if seen.get(key) == digest:
                continue
            replaced = key in seen
            seen[key] = digest
            if key not in existing:
                new_partitions.append(key)
            run_requests.append(
                dg.RunRequest(
                    run_key=f"{key}@{digest}",
                    partition_key=key,
                    tags={
                        SOURCE_FILE_TAG: drop.relative_path,
                        SOURCE_VERSION_TAG: digest,
                        **({REPLACED_TAG: "true"} if replaced else {}),
                    },
                )
            )
        if not run_requests:
            detail = f"; skipped {len(skipped)} non-input file(s)" if skipped else ""
            return dg.SkipReason(f"no new or changed files in the drop zone ({len(files)} known){detail}")
        return dg.SensorResult(
            run_requests=run_requests,
            dynamic_partitions_requests=[dg.AddDynamicPartitionsRequest(partitions_def_name(task.name), new_partitions)]
            if new_partitions
            else [],
            cursor=json.dumps(seen, separators=(",", ":")),
        )

    return drops_sensor
