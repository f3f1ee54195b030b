"""Dagster 1.13 internals batch_assets uses, each for a reason Dagster's public API does not cover.

- `InstanceConcurrencyContext` and `_calculate_timeout_interval` (the in-process executor's wait for
  a pool slot): replaced in `pool_waits.py` so a waiting step sleeps and looks again within 2 s.
  Relied on: the context's `_pending_claims` and `_pending_timeouts` (step key → when it may look
  again), its `interval_to_next_pending_claim_check()`, and `_calculate_timeout_interval(sleep_interval,
  pending_claim_count)` returning seconds.
- `SqlEventLogStorage` and its `assign_pending_steps(concurrency_keys)`: `run_recovery.py` gives a
  free slot to a step left waiting by a race in Dagster's slot hand-over.
- `SqliteEventLogStorage` and `ConsolidatedSqliteEventLogStorage` (the single-machine instance's
  event logs): `pool_waits.py` wraps their slot methods (`claim_concurrency_slot`,
  `free_concurrency_slot_for_step`, `free_concurrency_slots_for_run`, `assign_pending_steps`) in a
  file lock in their folder (`_base_dir`), since SQLite has no row lock between a claim's read and write.
- `AssetCheckEvaluationTargetMaterializationData(run_id, storage_id, timestamp)`: what a check result
  is about; `lib/check_evaluations.py` records per-partition evaluations against that materialization, as Dagster
  does for an `AssetCheckResult` (there is no public constructor for it).
- `SerializableErrorInfo` (a step failure's error, with `.message`, `.cause` and `.context`): only
  its type, for `app/error_causes.py`, which walks a failed run's error chain.

The event log storages are imported when first asked for, never with this module: their module
brings SQLAlchemy and Alembic (about a second), which loading the code location does not need
(`when_event_log_storages_load` runs a function once they are imported, by whichever module).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import wrapt
from dagster._core.definitions.asset_checks.asset_check_evaluation import (
    AssetCheckEvaluationTargetMaterializationData,
)
from dagster._core.execution.plan import instance_concurrency_context
from dagster._utils.error import SerializableErrorInfo

if TYPE_CHECKING:
    from dagster._core.storage.event_log import SqlEventLogStorage

EVENT_LOG_MODULE = "dagster._core.storage.event_log"

__all__ = [
    "AssetCheckEvaluationTargetMaterializationData",
    "SerializableErrorInfo",
    "instance_concurrency_context",
    "sql_event_log_storage",
    "sqlite_event_log_storages",
    "when_event_log_storages_load",
]


def sql_event_log_storage() -> type[SqlEventLogStorage]:
    from dagster._core.storage.event_log import SqlEventLogStorage

    return SqlEventLogStorage


def sqlite_event_log_storages() -> tuple[type[SqlEventLogStorage], ...]:
    from dagster._core.storage.event_log import ConsolidatedSqliteEventLogStorage, SqliteEventLogStorage

    return (SqliteEventLogStorage, ConsolidatedSqliteEventLogStorage)


def when_event_log_storages_load(change: Callable[[tuple[type[SqlEventLogStorage], ...]], Any]) -> None:
    """`change(sqlite_event_log_storages())` now if Dagster's event log module is imported, else right
    after its import, before any instance can use the classes (wrapt's post-import hook)."""
    wrapt.register_post_import_hook(lambda _module: change(sqlite_event_log_storages()), EVENT_LOG_MODULE)
