"""The CLI's commands that run no pipeline (cli.py holds their arguments and exit codes):

- `batch-assets tasks`: the tasks and their drop zones;
- `batch-assets cache prune [--task T] [--older-than DAYS]`: prune the tasks' result caches by their
  `cache:` settings (storage/cache_retention.py) and print what went and what is left, per task.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from batch_assets.pipeline.task_spec import TaskSpec
    from batch_assets.storage.cache_retention import Removed


def command_tasks() -> int:
    """The loaded tasks; each task file that failed to load is named on stderr, and the exit is 1.

    A task whose settings do not resolve (e.g. an `engine.vllm_args` name vLLM's engine does not
    take) is named the same way."""
    from batch_assets.engines.kinds import resolve_settings
    from batch_assets.pipeline.task_spec import TaskFileError, TaskSpecError, load_tasks
    from batch_assets.storage.locations import drop_zone

    loaded = load_tasks()
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

    from batch_assets.storage.result_cache import corrupt_sqlite_file, driver_line, shown_url

    try:
        _prune_one(url, tasks, pruned, older_than, say)
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
    from batch_assets.storage.result_cache import shown_url

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
