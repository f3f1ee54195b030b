"""The CLI's commands that run no pipeline (cli.py holds their arguments and exit codes):

- `batch-assets tasks`: the tasks and their drop zones;
- `batch-assets drop TASK FILE...`: files copied into the drop zone, their partitions registered, and
  the `dg launch` line that runs each;
- `batch-assets ui`: `dg dev`, one per Dagster home;
- `batch-assets cache prune [--task T] [--older-than DAYS]`: prune the tasks' result caches by their
  `cache:` settings (storage/cache_retention.py) and print what went and what is left, per task.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from batch_assets.app.projects import TaskSource
    from batch_assets.pipeline.task_spec import TaskSpec
    from batch_assets.storage.cache_retention import Removed


def command_tasks(source: TaskSource) -> int:
    """The loaded tasks (of a dg project, or the bundled ones); each task file that failed to load is
    named on stderr, and the exit is 1.

    A task whose settings do not resolve (e.g. an `engine.vllm_args` name vLLM's engine does not
    take) is named the same way."""
    from batch_assets.engines.kinds import resolve_settings
    from batch_assets.pipeline.task_spec import TaskFileError, TaskSpecError
    from batch_assets.storage.locations import drop_zone

    loaded = source.load_tasks()
    for task in loaded.tasks:
        try:
            settings = resolve_settings(task)
        except TaskSpecError as exc:
            loaded.errors.append(TaskFileError(task.name, (), str(exc)))
            continue
        model = "(the endpoint's only model)" if settings.model_from_server else settings.model
        print(f"{task.name}\t{task.output.kind}\t{model}\tdrop zone: {drop_zone(task.name)}")
    for error in loaded.errors:
        print(f"ERROR: task {error.name!r} not loaded: {error.message}", file=sys.stderr)
    return 1 if loaded.errors else 0


def command_drop(args: argparse.Namespace, say: Callable[[str], None]) -> int:
    """Each file's partitions, registered, with the `dg launch` line that runs them."""
    from batch_assets.app.runner import register_partitions

    files = [Path(file) for file in args.files]
    registered = register_partitions(args.task, files, args.source, say, replace=args.replace)
    for file_key, partition_keys in registered.items():
        for key in partition_keys:
            say(f"{args.task}/{file_key}: partition {key!r} registered; run it: {launch_line(args.task, key)}")
    return 0


def launch_line(task_name: str, partition_key: str) -> str:
    """The `dg launch` command that materializes one partition of a task's four assets and their checks."""
    return f"dg launch --assets {shlex.quote(f'group:{task_name}')} --partition {shlex.quote(partition_key)}"


UI_LOCK_NAME = ".batch_assets_ui.lock"
# The checkout's workspace file (its code location's working directory and name).
BUNDLED_WORKSPACE = "workspace.yaml"


def command_ui(host: str, port: int, workspace: str | None, source: TaskSource, say: Callable[[str], None]) -> int:
    """`dg dev` (webserver and daemon) on this home, at most one per home: a second one is refused.

    In a dg project, `dg dev` of that project (the working folder is its root by then); elsewhere the
    workspace file named, or workspace.yaml where there is one, or the bundled code location."""
    import fcntl
    import shutil

    from batch_assets.runtime.instance import prepare_instance

    home = prepare_instance()
    handle = (home / UI_LOCK_NAME).open("a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        say(
            f"error: the Dagster UI and daemon of {home} already run ({holder}); open that UI, or stop it "
            "(Ctrl-C in its terminal) before starting another"
        )
        return 2
    handle.truncate(0)
    handle.write(f"pid {os.getpid()}, http://{host}:{port}")
    handle.flush()
    # The lock travels into `dg dev` through exec and lasts as long as it does.
    os.set_inheritable(handle.fileno(), True)
    dg = shutil.which("dg", path=str(Path(sys.executable).parent)) or "dg"
    os.execv(dg, [dg, "dev", "-h", host, "-p", str(port), *_ui_target(workspace, source, home)])
    return 1  # not reached


# The bundled code location where no workspace file is at hand (an installed package): the checkout's
# workspace.yaml without its working directory, so the location has the same name.
INSTALLED_WORKSPACE = """load_from:
  - python_module:
      module_name: batch_assets.definitions
      attribute: defs
      location_name: batch_assets
"""


def _ui_target(workspace: str | None, source: TaskSource, home: Path) -> list[str]:
    """What `dg dev` loads: nothing named in a project (dg finds it), else a workspace file: the one
    named, workspace.yaml where there is one, or the bundled code location's (written in the home)."""
    if workspace is not None:
        return ["-w", workspace]
    if source.project_root is not None:
        return []
    if Path(BUNDLED_WORKSPACE).is_file():
        return ["-w", BUNDLED_WORKSPACE]
    installed = home / "workspace.yaml"
    installed.write_text(INSTALLED_WORKSPACE)
    return ["-w", str(installed)]


def command_cache(args: argparse.Namespace, say: Callable[[str], None]) -> int:
    # Imported here: the CLI builds its parser from this module, and `--help` stays quick.
    from batch_assets.pipeline.task_spec import load_tasks
    from batch_assets.runtime.instance import open_instance
    from batch_assets.storage.locations import task_storage_dir
    from batch_assets.storage.result_cache import cache_url

    loaded = load_tasks()
    tasks = [task for task in loaded.tasks if args.task in (None, task.name)]
    if args.task and not tasks:
        say(f"error: unknown task {args.task!r}; tasks: {', '.join(sorted(t.name for t in loaded.tasks))}")
        return 2
    with open_instance() as instance:
        by_url: dict[str, list[TaskSpec]] = {}
        for task in loaded.tasks:
            by_url.setdefault(cache_url(task_storage_dir(task.name), instance), []).append(task)
    failed = False
    for url, at_url in by_url.items():
        pruned = {task.name for task in tasks} & {task.name for task in at_url}
        if pruned:
            failed |= not _prune_or_say_why(url, at_url, pruned if args.task else None, args.older_than, say)
    return 1 if failed else 0


def _prune_or_say_why(url: str, tasks: list[TaskSpec], pruned: set[str] | None, older_than: float | None, say) -> bool:
    """Prune one cache; a cache that fails is one line naming it and the cause (the others are
    pruned all the same). A damaged SQLite file is left as it is: the next run of its task sets it
    aside, as runs do (storage/result_cache.py), and a prune deletes no file it did not make."""
    import sqlalchemy as sa

    from batch_assets.storage.errors import StorageError
    from batch_assets.storage.result_cache import corrupt_sqlite_file, driver_line, shown_url

    try:
        _prune_one(url, tasks, pruned, older_than, say)
    except StorageError as exc:  # e.g. the database's driver is not installed
        say(f"error: {exc}")
        return False
    except sa.exc.SQLAlchemyError as exc:
        damaged = corrupt_sqlite_file(url, exc) if isinstance(exc, sa.exc.DatabaseError) else None
        if damaged is not None:
            say(
                f"error: the result cache {damaged} is damaged ({getattr(exc, 'orig', exc)}): nothing pruned there; "
                "the next run of its task sets it aside and starts an empty one (or delete the file)"
            )
        else:
            say(f"error: pruning the result cache {shown_url(url)} failed: {driver_line(exc)}")
        return False
    return True


def _prune_one(url: str, tasks: list[TaskSpec], pruned: set[str] | None, older_than: float | None, say) -> None:
    from batch_assets.storage.cache_retention import database_bytes, prune, sizes
    from batch_assets.storage.result_cache import shown_url, sqlite_file

    database = sqlite_file(url)
    if database is not None and not database.exists():  # no run cached anything there: nothing is made
        say(f"{shown_url(url)}: no cache there yet, nothing to prune")
        return
    before = database_bytes(url)
    report = prune(url, {task.name: task.cache for task in tasks}, tasks=pruned, older_than_days=older_than)
    say(
        f"{shown_url(url)}: removed {_removed(report.by_age)} by age and {_removed(report.by_fingerprint)} of "
        f"{len(report.fingerprints)} fingerprint(s) no longer kept" + _bytes(before, database_bytes(url))
    )
    for task, size in sizes(url).items():
        if pruned is None or task in pruned:
            say(f"  {task}: {size.rows:,} results, {size.fingerprints} fingerprint(s), {size.text_bytes:,} text bytes")


def _removed(removed: Removed) -> str:
    return f"{removed.rows:,} results ({removed.text_bytes:,} bytes of text)"


def _bytes(before: int | None, after: int | None) -> str:
    return "" if before is None or after is None else f"; database {before:,} → {after:,} bytes"
