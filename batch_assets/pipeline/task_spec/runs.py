"""`runs:`, `sensor:`, `automation:` and `cache:`: when partitions run, how many per run, and how
long their results are kept."""

from __future__ import annotations

from pydantic import Field

from .base import _Strict


class AutomationSpec(_Strict):
    # Re-materialize partitions made with an earlier version of the task (a Declarative Automation
    # condition, evaluated by the task's automation sensor while the Dagster daemon runs).
    rematerialize_stale: bool = False


class SensorSpec(_Strict):
    running_by_default: bool = False
    minimum_interval_seconds: int = Field(default=30, ge=5)


MAX_PARTITIONS_PER_RUN = 1000


class RunsSpec(_Strict):
    """How partitions are grouped into runs. A backfill (`BackfillPolicy.multi_run`), a burst of drops
    picked up by the sensor and `batch-assets run` with several files put up to
    `max_partitions_per_run` partitions in one run, whose rows reach the engine as one stream: one
    engine start per run."""

    # Bounded: a run's partitions are one engine stream and one run's event log (each partition's
    # four materializations and checks), its outputs are held per partition until the step ends,
    # and a failed range is re-run whole; a thousand drop files per run already amortize the
    # engine start (tens of seconds to minutes) to well under a second each.
    max_partitions_per_run: int = Field(default=16, ge=1, le=MAX_PARTITIONS_PER_RUN)


class CacheSpec(_Strict):
    """How long the task's result cache keeps results, applied by `batch-assets cache prune`: a
    result is removed once stored more than `max_age_days` ago, and every result of a fingerprint
    (a version of the task's settings) once the task has used `keep_fingerprints` newer ones. A
    removed result is inferred again if a prompt asks for it. None keeps everything on that count."""

    max_age_days: float | None = Field(default=90, gt=0, allow_inf_nan=False)
    keep_fingerprints: int | None = Field(default=3, ge=1, strict=True)
