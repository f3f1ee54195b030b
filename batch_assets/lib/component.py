"""`TaskPipelinesComponent`: a Dagster Component pointed at a folder of task YAML files.

Adding a task is adding a YAML file: the component reads the folder when the code location loads
and builds, per task, the four partitioned assets, their checks, the task's job and drops sensor
(`task_definitions.build_definitions`). Task files keep their own format (YAML 1.2
booleans, strict keys); errors name the file and, where it can be found, the line.
"""

from __future__ import annotations

from pathlib import Path

import dagster as dg
from pydantic import Field

from batch_assets.lib.task_definitions import build_definitions
from batch_assets.pipeline.task_spec import load_tasks, tasks_dir


class TaskPipelinesComponent(dg.Component, dg.Model, dg.Resolvable):
    """One batch-inference pipeline (asset group, checks, job, drops sensor) per task YAML file."""

    tasks_dir: str | None = Field(
        default=None,
        description=(
            "Folder of task YAML files, relative to this component's defs.yaml or absolute. "
            "Unset: BATCH_ASSETS_TASKS_DIR, else the tasks bundled with batch_assets."
        ),
    )

    def resolved_tasks_dir(self, component_path: Path) -> Path:
        if self.tasks_dir is None:
            return tasks_dir()
        folder = Path(self.tasks_dir).expanduser()
        return folder if folder.is_absolute() else (component_path / folder).resolve()

    def build_defs(self, context: dg.ComponentLoadContext) -> dg.Definitions:
        # A bad task file does not hide the good ones: it becomes a failing sensor that names it.
        loaded = load_tasks(self.resolved_tasks_dir(context.path))
        return build_definitions(loaded.tasks, task_errors=loaded.errors)
