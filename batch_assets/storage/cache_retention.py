"""Retention of the result cache (storage/result_cache.py), applied by `batch-assets cache prune`.

Each task's `cache:` settings (`CacheSpec`: `max_age_days`, default 90; `keep_fingerprints`,
default 3) bound its cache:
- by version: a task keeps the results of the `keep_fingerprints` fingerprints it used last (a
  fingerprint is one version of the settings that decide an output); the results of its older
  ones go, unless another task in the same database keeps that fingerprint (two tasks with the same
  settings share one);
- by age: a result stored more than `max_age_days` ago goes (`--older-than DAYS` overrides it for
  one prune); rows of fingerprints no task has recorded using (stored before uses were recorded)
  go by age only, dated from the day their table was first opened by this version.
A removed result is inferred again when a prompt asks for it; nothing else depends on it. A prune
scans the table (rows are not indexed by age, which would slow every add); run it when the
pipeline is quiet, e.g. nightly. SQLite's file keeps its size (freed pages hold later results);
`VACUUM` in `sqlite3` shrinks it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import sqlalchemy as sa

from batch_assets.pipeline.task_spec import CacheSpec
from batch_assets.storage.result_cache import RESULTS, VERSIONS, cache_engine

DAY = 86_400


@dataclass
class Removed:
    rows: int = 0
    text_bytes: int = 0  # of the removed results' generated text


@dataclass
class PruneReport:
    by_fingerprint: Removed = field(default_factory=Removed)
    by_age: Removed = field(default_factory=Removed)
    fingerprints: list[str] = field(default_factory=list)  # whose every result was removed


@dataclass(frozen=True)
class TaskCacheSize:
    fingerprints: int
    rows: int
    text_bytes: int


def kept_fingerprints(
    versions: Iterable[tuple[str, str, int]], retention: Mapping[str, CacheSpec]
) -> dict[str, set[str]]:
    """Task → the fingerprints it keeps: its `keep_fingerprints` last used (`versions`: task,
    fingerprint, last used). A task without settings here (deleted) keeps none."""
    by_task: dict[str, list[tuple[int, str]]] = {}
    for task, fingerprint, last_used in versions:
        by_task.setdefault(task, []).append((last_used, fingerprint))
    kept = {}
    for task, used in by_task.items():
        spec = retention.get(task)
        count = 0 if spec is None else (spec.keep_fingerprints or len(used))
        kept[task] = {fingerprint for _, fingerprint in sorted(used, reverse=True)[:count]}
    return kept


def prune(
    url: str,
    retention: Mapping[str, CacheSpec],
    *,
    tasks: set[str] | None = None,
    older_than_days: float | None = None,
    now: float | None = None,
) -> PruneReport:
    """Prune the cache at `url` for `tasks` (None: every task there); `retention`: the settings of
    every task whose cache lives there (what each keeps is spared for all)."""
    now = time.time() if now is None else now
    report = PruneReport()
    with cache_engine(url).begin() as connection:
        columns = (VERSIONS.c.task, VERSIONS.c.fingerprint, VERSIONS.c.last_used)
        versions = [(task, fp, int(used)) for task, fp, used in connection.execute(sa.select(*columns))]
        kept = kept_fingerprints(versions, retention)
        pruned = ({task for task, _, _ in versions} | set(retention)) if tasks is None else tasks
        dropped = [(task, fp) for task, fp, _ in versions if task in pruned and fp not in kept[task]]
        report.fingerprints = sorted({fp for _, fp in dropped} - set().union(*kept.values()))
        report.by_fingerprint = _delete(connection, RESULTS.c.fingerprint.in_(report.fingerprints))
        for task, fp in dropped:
            connection.execute(sa.delete(VERSIONS).where(VERSIONS.c.task == task, VERSIONS.c.fingerprint == fp))
        # `older_than_days` 0 is an age (every result stored before now), not "unset".
        ages = {task: _max_age(retention.get(task)) if older_than_days is None else older_than_days for task in pruned}
        for task, days in sorted(ages.items()):
            if days is not None:
                of_task = RESULTS.c.fingerprint.in_(sorted(kept.get(task, set())))
                _add(report.by_age, _delete(connection, of_task & (RESULTS.c.created_at < now - days * DAY)))
        # Rows of fingerprints no task recorded: by the shortest age of the tasks pruned.
        if limits := [days for days in ages.values() if days is not None]:
            unrecorded = RESULTS.c.fingerprint.not_in(sa.select(VERSIONS.c.fingerprint))
            _add(report.by_age, _delete(connection, unrecorded & (RESULTS.c.created_at < now - min(limits) * DAY)))
    return report


def _max_age(spec: CacheSpec | None) -> float | None:
    return None if spec is None else spec.max_age_days


def _add(total: Removed, more: Removed) -> None:
    total.rows += more.rows
    total.text_bytes += more.text_bytes


def _delete(connection: sa.Connection, where: sa.ColumnElement[bool]) -> Removed:
    measured = sa.select(sa.func.count(), sa.func.coalesce(sa.func.sum(sa.func.length(RESULTS.c.generated_text)), 0))
    rows, text_bytes = connection.execute(measured.where(where)).one()
    if rows:
        connection.execute(sa.delete(RESULTS).where(where))
    return Removed(int(rows), int(text_bytes))


def sizes(url: str) -> dict[str, TaskCacheSize]:
    """Task → its cache at `url` (results of the fingerprints it has recorded using); results of
    fingerprints no task recorded are under the task name "(unrecorded)"."""
    engine = cache_engine(url)
    with engine.connect() as connection:
        per_fingerprint = {
            fingerprint: (int(rows), int(text or 0))
            for fingerprint, rows, text in connection.execute(
                sa.select(
                    RESULTS.c.fingerprint, sa.func.count(), sa.func.sum(sa.func.length(RESULTS.c.generated_text))
                ).group_by(RESULTS.c.fingerprint)
            )
        }
        owners: dict[str, set[str]] = {}
        for task, fingerprint in connection.execute(sa.select(VERSIONS.c.task, VERSIONS.c.fingerprint)):
            owners.setdefault(task, set()).add(fingerprint)
    recorded = set().union(*owners.values()) if owners else set()
    owners["(unrecorded)"] = set(per_fingerprint) - recorded
    found = {}
    for task, fingerprints in sorted(owners.items()):
        present = [per_fingerprint[fp] for fp in fingerprints if fp in per_fingerprint]
        if present or task != "(unrecorded)":
            found[task] = TaskCacheSize(len(present), sum(r for r, _ in present), sum(t for _, t in present))
    return found


def database_bytes(url: str) -> int | None:
    """The size of the cache's database: SQLite's file (with its write-ahead log), Postgres' table
    with its index; None when not measurable."""
    parsed = sa.make_url(url)
    if parsed.get_backend_name() == "sqlite":
        path = Path(parsed.database or "")
        return sum(part.stat().st_size for part in (path, Path(f"{path}-wal")) if part.exists())
    if parsed.get_backend_name() == "postgresql":
        with cache_engine(url).connect() as connection:
            return int(connection.execute(sa.text(f"SELECT pg_total_relation_size('{RESULTS.name}')")).scalar_one())
    return None
