"""What a partition will cost before it runs: `batch-assets estimate` prints it, formatted_prompts
records it as metadata (the UI shows it before inference starts).

From the formatted rows (counted with the task's tokenizer, as the run counts `prompt_tokens`):
the rows, those refused before any engine (by error code), prompt tokens, the most tokens they may
generate (`pipeline/budget.py`'s worst case), the rows the result cache answers now. From the task's
earlier partitions (their latest `inference_outputs` metadata): the tokens a row generates on average
and the engine's rows per second, hence the expected generated tokens, and for the in-process
engine GPU-hours (and dollars at `engine.price.per_gpu_hour`). Nothing here starts an engine or
sends a request.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import dagster as dg
import polars as pl

from batch_assets.pipeline.budget import CostEstimate, estimate_cost
from batch_assets.pipeline.engine_contract import EngineSettings
from batch_assets.pipeline.formats import TaskFormat
from batch_assets.pipeline.inference_requests import keyed_requests
from batch_assets.pipeline.label_quality import error_code_counts
from batch_assets.pipeline.prices import cost_usd, engine_price

# Earlier partitions read for the expected figures: the newest ones (a drop zone of 10,000 files
# costs one bounded query per formatted_prompts step, not 10,000).
HISTORY_MATERIALIZATIONS = 200
SECONDS_PER_HOUR = 3600.0


@dataclass(frozen=True)
class History:
    """What the task's earlier partitions measured (their latest inference_outputs materializations)."""

    partitions: int = 0
    generated_per_row: float | None = None  # generated tokens per row without an error
    rows_per_second: float | None = None  # rows inferred per engine second, over whole runs


def task_history(instance: dg.DagsterInstance, task_name: str) -> History:
    """The expected-figure inputs from the newest `HISTORY_MATERIALIZATIONS` inference_outputs
    materializations of the task, each partition's latest. The partitions of one run share its
    engine seconds, so the rate is summed per run: rows inferred over that run's engine seconds."""
    key = dg.AssetKey([task_name, "inference_outputs"])
    records = instance.fetch_materializations(dg.AssetRecordsFilter(asset_key=key), limit=HISTORY_MATERIALIZATIONS)
    latest: dict[str, dg.EventLogRecord] = {}
    for record in records.records:
        if record.partition_key is not None:
            latest.setdefault(record.partition_key, record)
    rows = generated = 0
    runs: dict[str, tuple[int, float]] = {}  # run id -> (rows inferred, engine seconds)
    for record in latest.values():
        values = _values(record)
        rows += int(values.get("rows") or 0) - int(values.get("error_rows") or 0)
        generated += int(values.get("generated_tokens") or 0)
        inferred, seconds = runs.get(record.run_id, (0, 0.0))
        runs[record.run_id] = (
            inferred + int(values.get("rows_inferred") or 0),
            max(seconds, float(values.get("engine_seconds") or 0.0)),
        )
    timed = [(inferred, seconds) for inferred, seconds in runs.values() if inferred and seconds > 0]
    rate = sum(i for i, _ in timed) / sum(s for _, s in timed) if timed else None
    return History(len(latest), generated / rows if rows > 0 else None, rate)


def _values(record: dg.EventLogRecord) -> dict[str, Any]:
    materialization = record.asset_materialization
    metadata = materialization.metadata if materialization is not None else {}
    return {name: entry.value for name, entry in metadata.items()}


@dataclass(frozen=True)
class PartitionEstimate:
    rows: int
    refused: dict[str, int]  # rows with an error before any engine, by error code
    worst: CostEstimate  # rows to infer, prompt tokens, most generated tokens, worst cost
    rows_from_cache: int  # rows the result cache answers now
    requests: int  # requests an engine would be sent: distinct prompts not in the cache
    history: History
    expected_generated_tokens: int | None = None
    expected_cost_usd: float | None = None
    gpus: int = 0  # the in-process engine's GPUs (0: not that engine)
    gpu_hours: float | None = None  # expected, at the measured rows/s
    per_gpu_hour: float | None = None

    @property
    def gpu_cost_usd(self) -> float | None:
        if self.gpu_hours is None or self.per_gpu_hour is None:
            return None
        return round(self.gpu_hours * self.per_gpu_hour, 6)

    def metadata(self) -> dict[str, int | float]:
        """formatted_prompts' `estimated_*` metadata (the worst case's names kept from the budget's)."""
        values: dict[str, int | float] = {
            **self.worst.metadata(),
            "estimated_rows_to_infer": self.worst.rows_to_infer,
            "estimated_rows_from_cache": self.rows_from_cache,
            "estimated_requests": self.requests,
            "estimate_based_on_partitions": self.history.partitions,
        }
        optional = {
            "estimated_generated_tokens": self.expected_generated_tokens,
            "estimated_cost_usd": self.expected_cost_usd,
            "estimated_gpu_hours": None if self.gpu_hours is None else round(self.gpu_hours, 9),
            "estimated_gpu_cost_usd": self.gpu_cost_usd,
        }
        return {**values, **{name: value for name, value in optional.items() if value is not None}}


CachedKeys = Callable[[pl.Series], set[str]]


def estimate_partition(
    formatted: pl.DataFrame,
    fmt: TaskFormat,
    settings: EngineSettings,
    history: History,
    cached_keys: CachedKeys | None = None,
) -> PartitionEstimate:
    """The estimate of one partition of formatted_prompts; `cached_keys`: which request keys the
    task's result cache holds (None: no cache to ask)."""
    worst = estimate_cost(formatted, fmt)
    keyed = keyed_requests(formatted, fmt.deduplicate)
    found = cached_keys(keyed["request_key"].unique()) if cached_keys is not None and fmt.deduplicate else set()
    hit = keyed["request_key"].is_in(list(found)) if found else pl.Series([False] * keyed.height, dtype=pl.Boolean)
    requests = keyed.filter(~hit)["request_key"]
    price = engine_price(fmt.task.engine)
    expected = None
    if history.generated_per_row is not None:
        expected = min(worst.max_generated_tokens, round(history.generated_per_row * worst.rows_to_infer))
    to_send = requests.n_unique() if fmt.deduplicate else requests.len()
    gpus = engine_devices(settings)
    hours = to_send / history.rows_per_second / SECONDS_PER_HOUR * gpus if gpus and history.rows_per_second else None
    return PartitionEstimate(
        rows=formatted.height,
        refused=error_code_counts(formatted),
        worst=worst,
        rows_from_cache=int(hit.sum()),
        requests=to_send,
        history=history,
        expected_generated_tokens=expected,
        expected_cost_usd=None if expected is None else cost_usd(worst.prompt_tokens, expected, price),
        gpus=gpus,
        gpu_hours=hours,
        per_gpu_hour=price.per_gpu_hour if price is not None else None,
    )


def engine_devices(settings: EngineSettings) -> int:
    """The devices the in-process engine holds (tensor x data parallel); on a CPU one (its hours still
    cost), for an endpoint none (priced by its tokens)."""
    if settings.kind != "vllm":
        return 0
    if not getattr(settings, "on_gpu", False):
        return 1
    return int(getattr(settings, "tensor_parallel_size", 1)) * int(getattr(settings, "data_parallel_size", 1))


def cached_keys_in(task_name: str, fingerprint: str, instance: dg.DagsterInstance) -> CachedKeys | None:
    """A look-up of the task's result cache for this fingerprint, or None where the cache has never
    been written (a local SQLite file not there: looking would create it)."""
    from batch_assets.storage.locations import task_storage_dir
    from batch_assets.storage.result_cache import ResultCache, cache_url, sqlite_file

    task_dir = task_storage_dir(task_name)
    url = cache_url(task_dir, instance)
    local = sqlite_file(url)
    if local is not None and not local.exists():
        return None
    cache = ResultCache(task_dir, fingerprint, url=url, instance=instance)

    def lookup(keys: pl.Series) -> set[str]:
        try:
            return set(cache.lookup(keys)["request_key"].to_list())
        except Exception:  # noqa: BLE001 - an estimate's figure: a cache that cannot be read answers nothing
            # (the run's own look-up says what is wrong with it, and fails or goes on as it decides).
            return set()

    return lookup


def estimate_lines(label: str, estimate: PartitionEstimate) -> list[str]:
    """What `batch-assets estimate` prints of one file."""
    worst = estimate.worst
    refused = sum(estimate.refused.values())
    codes = ", ".join(f"{code}={count}" for code, count in sorted(estimate.refused.items(), key=lambda c: -c[1]))
    lines = [
        f"{label}: {estimate.rows:,} rows, {refused:,} refused{f' ({codes})' if codes else ''}, "
        f"{worst.rows_to_infer:,} to infer",
        f"  prompt tokens: {worst.prompt_tokens:,}",
    ]
    generated = f"  generated tokens: at most {worst.max_generated_tokens:,}"
    if estimate.expected_generated_tokens is not None:
        generated += (
            f", expected {estimate.expected_generated_tokens:,} (from {estimate.history.partitions} earlier "
            "partition(s))"
        )
    else:
        generated += " (no earlier partition to expect from)"
    lines.append(generated)
    lines.append(f"  result cache: answers {estimate.rows_from_cache:,} rows; {estimate.requests:,} requests to send")
    if worst.cost_usd is not None:
        expected = f", expected ${estimate.expected_cost_usd:,.6f}" if estimate.expected_cost_usd is not None else ""
        lines.append(f"  cost: at most ${worst.cost_usd:,.6f}{expected}")
    if estimate.gpu_hours is not None:
        rate = estimate.history.rows_per_second or 0.0
        gpu = (
            f"  GPU time: {estimate.gpu_hours * SECONDS_PER_HOUR:,.1f} s = {estimate.gpu_hours:,.6f} GPU-hours "
            f"({estimate.gpus} device(s) at {rate:,.1f} rows/s measured)"
        )
        if estimate.gpu_cost_usd is not None:
            gpu += f", ${estimate.gpu_cost_usd:,.6f} at ${estimate.per_gpu_hour:,.2f}/GPU-hour"
        lines.append(gpu)
    return lines
