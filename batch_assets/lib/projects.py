"""Where a command's tasks come from: the user's own dg project it stands in (or names with
`--project`), else the tasks bundled with batch_assets (or `BATCH_ASSETS_TASKS_DIR`).

A project is found as `dg` finds it (`dagster_shared`'s `discover_config_file`): the nearest folder,
from the one named up, with a `dg.toml` or a `pyproject.toml` holding `[tool.dg]`. Its definitions
are its component tree (`defs/`) as Dagster's own `ComponentTree.for_project` loads it, which is
what `dg dev`, `dg launch` and `dg list defs` load: its tasks are its `batch_assets.TaskComponent`
and `batch_assets.TaskPipelinesComponent` instances, run with the same jobs, resources and storage.
The project whose root module is `batch_assets` itself (this checkout) is the bundled tasks.
"""

from __future__ import annotations

import argparse
import functools
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from dagster_shared.utils.config import discover_config_file, load_toml_as_dict

if TYPE_CHECKING:
    import dagster as dg

    from batch_assets.pipeline.task_spec import TaskLoad

OUR_ROOT_MODULE = "batch_assets"


class ProjectRefused(Exception):
    """The project named or found cannot give tasks (none there, a workspace, no batch_assets task)."""


@dataclass(frozen=True)
class TaskSource:
    """The tasks and definitions a command works on; `project_root` None: the bundled tasks."""

    project_root: Path | None = None

    def load_tasks(self) -> TaskLoad:
        if self.project_root is None:
            from batch_assets.pipeline.task_spec import load_tasks

            return load_tasks()
        return _loaded_project(self.project_root)[0]

    def definitions(self) -> dg.Definitions:
        if self.project_root is None:
            from batch_assets.lib.task_definitions import build_definitions

            return build_definitions()
        return _loaded_project(self.project_root)[1]

    def describe(self) -> str:
        """Where the tasks are, for messages: "the dg project at /path" or "the bundled tasks"."""
        return "the bundled tasks" if self.project_root is None else f"the dg project at {self.project_root}"


BUNDLED = TaskSource()


def find_task_source(named: str | None, here: Path | None = None) -> TaskSource:
    """The dg project of `named` (a folder in it), else of the working folder; the bundled tasks when
    the working folder is in none. A folder named that is in no project is refused."""
    start = Path(named).expanduser().resolve() if named else (here or Path.cwd())
    if named and not start.is_dir():
        raise ProjectRefused(f"--project {named}: no such folder")
    config_file = discover_config_file(start)
    if config_file is None:
        if named:
            raise ProjectRefused(
                f"{start} is in no dg project (no dg.toml, nor a pyproject.toml with [tool.dg], there or above): "
                "name a project's folder, or create one with `create-dagster project NAME`"
            )
        return BUNDLED
    config = load_toml_as_dict(config_file)
    dg_config = config if config_file.name == "dg.toml" else config.get("tool", {}).get("dg", {})
    if dg_config.get("directory_type") == "workspace":
        raise ProjectRefused(
            f"{config_file.parent} is a dg workspace: run batch-assets from one of its projects' folders, "
            "or name one with --project PATH"
        )
    if dg_config.get("project", {}).get("root_module") == OUR_ROOT_MODULE:
        return BUNDLED  # batch_assets' own checkout: its code location is the bundled tasks
    return TaskSource(config_file.parent)


def enter_project(args: argparse.Namespace) -> TaskSource:
    """The tasks of a `batch-assets` command: a dg project's (then the command works from the project's
    folder, as `dg` does, so that `data/` and `.dagster_home/` are the project's whichever folder it
    started in; file arguments are made absolute first), or the bundled ones."""
    if not hasattr(args, "project"):  # a command on the bundled tasks only (demo, cache)
        return BUNDLED
    source = find_task_source(args.project)
    if source.project_root is not None:
        if hasattr(args, "files"):
            args.files = [os.path.abspath(file) for file in args.files]
        os.chdir(source.project_root)
    return source


@functools.cache
def _loaded_project(root: Path) -> tuple[TaskLoad, dg.Definitions]:
    """The project's tasks and definitions, from one load of its component tree (once per process)."""
    import dagster as dg

    from batch_assets.lib.component import TaskComponent, TaskPipelinesComponent
    from batch_assets.pipeline.task_spec import TaskLoad

    with warnings.catch_warnings():
        # Dagster's component loader warns of its own beta and preview APIs (as definitions.py says).
        warnings.simplefilter("ignore", dg.BetaWarning)
        warnings.simplefilter("ignore", dg.PreviewWarning)
        tree = dg.ComponentTree.for_project(root)
        definitions = tree.build_defs()  # builds every component, so the folders below have read their tasks
    tasks = [component.task for component in tree.get_all_components(TaskComponent)]
    errors = []
    for folder in tree.get_all_components(TaskPipelinesComponent):
        tasks += folder.loaded_tasks.tasks
        errors += folder.loaded_tasks.errors
    if not tasks and not errors:
        raise ProjectRefused(
            f"the dg project at {root} has no batch_assets task: add one with "
            "`dg scaffold defs batch_assets.TaskComponent NAME` there, or run outside it for the bundled tasks"
        )
    return TaskLoad(sorted(tasks, key=lambda task: task.name), errors), definitions
