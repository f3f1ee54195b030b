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
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from dagster_shared.utils.config import discover_config_file, load_toml_as_dict

if TYPE_CHECKING:
    import dagster as dg
    from pydantic import ValidationError

    from batch_assets.pipeline.task_spec import TaskFileError, TaskLoad

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
        return _loaded_project(self.project_root).tasks

    def definitions(self) -> dg.Definitions:
        if self.project_root is None:
            from batch_assets.lib.task_definitions import build_definitions

            with dagster_notices_off():
                return build_definitions()
        project = _loaded_project(self.project_root)
        if project.defined_twice:
            # Its definitions hold those tasks' assets twice: Dagster refuses them (DuplicateAssetKey).
            reason = project.defined_twice[0].message
            raise ProjectRefused(f"the dg project at {self.project_root} does not load: {reason}")
        return project.definitions

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


@contextmanager
def dagster_notices_off() -> Iterator[None]:
    """Dagster's warnings of its own beta and preview APIs (the component loader's, an asset's
    `backfill_policy`) kept off the terminal: nothing a user of batch_assets can act on."""
    import dagster as dg

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dg.BetaWarning)
        warnings.simplefilter("ignore", dg.PreviewWarning)
        yield


@dataclass(frozen=True)
class _Project:
    tasks: TaskLoad  # its errors include those of `defined_twice`
    definitions: dg.Definitions
    defined_twice: list[TaskFileError]  # tasks two components define (both files named)


@functools.cache
def _loaded_project(root: Path) -> _Project:
    """The project's tasks and definitions, from one load of its component tree (once per process).
    A task two components define is refused (an error naming both files), as two files of one folder are."""
    import dagster as dg

    from batch_assets.lib.component import TaskComponent, TaskPipelinesComponent
    from batch_assets.pipeline.task_spec import TaskFileError, TaskLoad

    with dagster_notices_off(), _load_errors_named(root):
        tree = dg.ComponentTree.for_project(root)
        definitions = tree.build_defs()  # builds every component, so the folders below have read their tasks
    defined = [
        (component.task, component.defined_in or root / f"(a TaskComponent built in Python: {component.task.name})")
        for component in tree.get_all_components(TaskComponent)
    ]
    errors = []
    for folder in tree.get_all_components(TaskPipelinesComponent):
        defined += [(task, folder.task_file(task.name)) for task in folder.loaded_tasks.tasks]
        errors += folder.loaded_tasks.errors
    if not defined and not errors:
        raise ProjectRefused(
            f"the dg project at {root} has no batch_assets task: add one with "
            "`dg scaffold defs batch_assets.TaskComponent NAME` there, or run outside it for the bundled tasks"
        )
    files: dict[str, list[Path]] = {}
    for task, path in defined:
        files.setdefault(task.name, []).append(path)
    twice = []
    for name, paths in sorted(files.items()):
        if len(paths) > 1:
            both = " and ".join(str(path) for path in sorted(paths))
            message = f"{both} both define the task {name!r}: keep one of them (rename or remove the other)"
            twice.append(TaskFileError(name, tuple(sorted(paths)), message))
    tasks = sorted((task for task, _ in defined if len(files[task.name]) == 1), key=lambda task: task.name)
    return _Project(TaskLoad(tasks, errors + twice), definitions, twice)


@contextmanager
def _load_errors_named(root: Path) -> Iterator[None]:
    """A component that does not load as one `ProjectRefused` line: Dagster's own error shows the
    tree of components and a row of `^` under the one that failed, its cause only in the traceback.
    The cause, with the file and line of each attribute it refuses, is what the line says."""
    try:
        yield
    except Exception as error:
        from pydantic import ValidationError

        from batch_assets.app.error_causes import error_line
        from batch_assets.storage.errors import exception_chain

        causes = list(exception_chain(error))
        invalid = next((cause for cause in causes if isinstance(cause, ValidationError)), None)
        if invalid is not None:
            raise ProjectRefused(attribute_problems(invalid)) from error
        if type(error).__module__.startswith("dagster.") and len(causes) > 1:  # the tree's error around the cause
            raise ProjectRefused(f"the dg project at {root} does not load: {error_line(causes[1])}") from error
        raise


def attribute_problems(error: ValidationError) -> str:
    """Dagster's validation errors of a component's attributes as `file: setting (line N): rule`, one
    clause per error (Dagster puts each error's file and line in its context)."""
    problems = []
    for item in error.errors(include_url=False, include_input=False):
        position = (item.get("ctx") or {}).get("source_position")
        where = str(item["loc"][0]).split(" at ", 1)[0] if item["loc"] else ""
        message = str(item["msg"]).removeprefix("Value error, ")
        if position is None:
            problems.append(f"{where}: {message}" if where else message)
        else:
            problems.append(f"{position.filename}: {where} (line {position.start.line}): {message}")
    return "; ".join(problems)
