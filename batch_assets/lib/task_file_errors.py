"""A task file that fails to load shows up in the UI as a failing sensor, not as a dead code location.

The good tasks load as usual. Each bad file (or pair of files claiming one task name) gets a sensor
named where the user will look for it, `<task>_drops_sensor`, running by default so that the daemon
evaluates it: every tick fails with the file, the field and the rule, and the sensor's description
says the same. Fix the file and reload the code location; the sensor then becomes the task's own.

A CI gate never sees a sensor: under `dg check defs` (and `dagster definitions validate`, which it
runs) the code location fails to load instead, naming every bad file with its line.
"""

from __future__ import annotations

import hashlib
import os
import re

import dagster as dg

from batch_assets.pipeline.task_spec import TASK_NAME_PATTERN, TaskFileError, TaskSpecError

# Set by `dagster definitions validate` (and so by `dg check defs`) while it loads the code location.
VALIDATION_ENV = "DAGSTER_IS_DEFS_VALIDATION_CLI"
# A failing tick is logged by the daemon each time; once a minute is enough to keep it visible.
ERROR_SENSOR_INTERVAL_SECONDS = 60


def task_file_error_sensor_name(error: TaskFileError) -> str:
    if TASK_NAME_PATTERN.match(error.name):
        return f"{error.name}_drops_sensor"
    # File names that are no valid task name: still a valid, distinct sensor name.
    safe = re.sub(r"[^A-Za-z0-9_]", "_", error.name)[:40]
    return f"invalid_task_file_{safe}_{hashlib.sha1(error.name.encode()).hexdigest()[:6]}"


def build_task_file_error_sensor(error: TaskFileError) -> dg.SensorDefinition:
    @dg.sensor(
        name=task_file_error_sensor_name(error),
        minimum_interval_seconds=ERROR_SENSOR_INTERVAL_SECONDS,
        default_status=dg.DefaultSensorStatus.RUNNING,
        description=(
            f"TASK FILE ERROR, this task is not loaded: {error.message}. Fix the file and reload the code location."
        ),
        tags={"batch_assets/task_file_error": "true"},
    )
    def task_file_error_sensor(context: dg.SensorEvaluationContext):
        raise TaskSpecError(error.message)

    return task_file_error_sensor


class TaskFilesNotLoaded(TaskSpecError):
    """Task files that do not load, found while a command validates the definitions."""


def fail_validation_on(errors: list[TaskFileError]) -> None:
    """While `dg check defs` validates the definitions, task files that do not load fail the check
    (elsewhere each becomes a failing sensor, so that one bad file leaves the others running)."""
    if errors and os.environ.get(VALIDATION_ENV) == "1":
        listed = "\n".join(f"- {error.message}" for error in errors)
        raise TaskFilesNotLoaded(
            f"{len(errors)} task files do not load (in the UI and the daemon each is a failing sensor "
            f"`<task>_drops_sensor`):\n{listed}"
        )
