"""How a check records what it found, per partition of a run.

In a run over a range of partitions (a backfill, a burst from the sensor), each check reads every
partition of the range and records one evaluation per partition (`evaluate_per_partition`): Dagster 1.13 gives an
`AssetCheckResult` the run's single partition only, and none in a range run. A failed blocking check
of any partition fails the check step, so validated_labels of the whole range is skipped; the
evaluations of the other partitions are still recorded.
"""

from collections.abc import Callable, Iterator
from typing import Any, cast

import dagster as dg
import polars as pl

from batch_assets.lib.asset_metadata import markdown_table
from batch_assets.lib.materializations import latest_materialization
from batch_assets.runtime.dagster_private import AssetCheckEvaluationTargetMaterializationData
from batch_assets.storage.locations import output_path

FAILED_ROWS_SHOWN = 10


def failed_rows_metadata(
    rows: pl.DataFrame, columns: list[str], task: str, asset: str, partition_key: str
) -> dict[str, Any]:
    """What a user needs to find the failing rows: their ids, a preview, and the file they are in."""
    shown = [c for c in columns if c in rows.columns]
    return {
        "failed_rows": rows.height,
        "failed_row_ids": rows["row_id"].head(50).to_list(),
        "failed_rows_preview": dg.MetadataValue.md(markdown_table(rows.head(FAILED_ROWS_SHOWN).to_dicts(), shown)),
        # The partition's parquet file; `row_id` selects the rows listed above.
        "rows_file": dg.MetadataValue.path(str(output_path(task, asset, partition_key))),
    }


def _target_materialization(
    context: dg.AssetCheckExecutionContext, asset: dg.AssetKey, partition_key: str
) -> AssetCheckEvaluationTargetMaterializationData | None:
    """The partition's latest materialization, which the evaluation is about (what Dagster itself
    attaches to an `AssetCheckResult`), so the UI shows the check against that materialization."""
    record = latest_materialization(context.instance, asset, partition_key)
    if record is None:
        return None
    return AssetCheckEvaluationTargetMaterializationData(
        run_id=record.run_id, storage_id=record.storage_id, timestamp=record.timestamp
    )


def evaluate_per_partition(
    context: dg.AssetCheckExecutionContext, evaluate: Callable[[str], dg.AssetCheckResult]
) -> Iterator[dg.AssetCheckEvaluation | dg.Output]:
    """Evaluate a check for each partition of the run (one, or a range) and record each result as an
    evaluation of that partition; then the check's output, which blocking checks gate on."""
    spec = context.check_specs[0]
    for partition_key in context.partition_keys:
        result = evaluate(partition_key)
        yield dg.AssetCheckEvaluation(
            asset_key=spec.asset_key,
            check_name=spec.name,
            passed=result.passed,
            metadata=result.metadata,
            severity=result.severity,
            description=result.description,
            blocking=spec.blocking,
            partition=partition_key,
            target_materialization_data=_target_materialization(context, spec.asset_key, partition_key),
        )
    yield dg.Output(None, output_name=context.op_def.output_defs[0].name)


def recent_label_counts(
    instance: dg.DagsterInstance, key: dg.AssetKey, partition_key: str, partitions: int
) -> list[dict]:
    """`label_counts` of the latest materialization of up to `partitions` other partitions, newest first."""
    limit = max(50, 10 * partitions)  # newest first; a partition re-run many times takes several records
    records = instance.fetch_materializations(dg.AssetRecordsFilter(asset_key=key), limit=limit).records
    found: dict[str, dict] = {}
    for record in records:
        event = record.asset_materialization
        if event is None or event.partition in (None, partition_key) or event.partition in found:
            continue
        counts = event.metadata.get("label_counts")
        # dagster types a metadata value as any packable value; label_counts is JSON of label -> count
        found[event.partition] = dict(cast("dict[str, int]", counts.value)) if counts is not None else {}
        if len(found) == partitions:
            break
    return [counts for counts in found.values() if counts]
