"""Asset checks of a task, per partition: each reads only its own partition's parquet.

- `outputs_satisfy_constraint` on inference_outputs (ERROR, blocking): every output that finished
  normally is one of the choices / valid JSON for the schema / matches the regex. A failure means the
  engine did not enforce the constraint; validated_labels is skipped.
- `labels_are_valid` on validated_labels (ERROR, blocking): every label is valid, every null label
  has an error.
- `one_row_per_record` on validated_labels (ERROR): as many rows as raw records, unique row_ids in
  input order.
- `error_share_below_threshold` on validated_labels (WARN): share of error rows under the task's limit.
- `embeddings_are_valid` on inference_outputs (ERROR, blocking; embedding tasks, in place of the two
  label checks above): one dimension for every vector, every value finite, every vector of unit L2
  norm (vLLM's embed normalizes, as the model's own Normalize module does), and no row without an
  embedding or an error.

The gates a task's settings ask for are in lib/gate_checks.py; how each records its evaluations
per partition, in lib/check_evaluations.py.
"""

from collections.abc import Callable
from typing import Any

import dagster as dg
import polars as pl

from batch_assets.lib.asset_metadata import asset_key
from batch_assets.lib.check_evaluations import evaluate_per_partition, failed_rows_metadata
from batch_assets.lib.gate_checks import gate_checks
from batch_assets.pipeline.embeddings.results import NORM_TOLERANCE, embedding_report
from batch_assets.pipeline.label_quality import error_code_counts
from batch_assets.pipeline.task_formats import task_format
from batch_assets.pipeline.task_spec import TaskSpec
from batch_assets.pipeline.validate_labels import constraint_violations, invalid_labels
from batch_assets.storage.drop_files import drop_partitions


def build_task_checks(task: TaskSpec) -> list[dg.AssetChecksDefinition]:
    """The task's checks: those of its outputs (labels or vectors, by its format's `result`), one row
    per record, the error share, and the gates its settings ask for."""
    fmt = task_format(task)
    return [*OUTPUT_CHECKS[fmt.result](task), *_row_checks(task), *gate_checks(task, fmt)]


def _label_checks(task: TaskSpec) -> list[dg.AssetChecksDefinition]:
    """A row's label: the engine's output satisfies the constraint, and the parsed label is valid."""
    name = task.name
    partitions = drop_partitions(name)

    @dg.asset_check(
        asset=asset_key(name, "inference_outputs"),
        name="outputs_satisfy_constraint",
        blocking=True,
        partitions_def=partitions,
        description=f"Every output that finished normally satisfies the task's `{task.output.kind}` constraint.",
    )
    def outputs_satisfy_constraint(context: dg.AssetCheckExecutionContext, inference_outputs: dict[str, pl.DataFrame]):
        def evaluate(partition_key: str) -> dg.AssetCheckResult:
            outputs = inference_outputs[partition_key]
            bad = constraint_violations(outputs, task.output)
            metadata = {"checked_rows": outputs.height}
            if bad.height:
                metadata |= failed_rows_metadata(
                    bad,
                    ["row_id", "source_line", "generated_text", "finish_reason"],
                    name,
                    "inference_outputs",
                    partition_key,
                )
            return dg.AssetCheckResult(passed=bad.height == 0, severity=dg.AssetCheckSeverity.ERROR, metadata=metadata)

        yield from evaluate_per_partition(context, evaluate)

    @dg.asset_check(
        asset=asset_key(name, "validated_labels"),
        name="labels_are_valid",
        blocking=True,
        partitions_def=partitions,
        description=(
            "Every label is valid for the task (one of the choices / validates against the schema); "
            "rows without a label carry an error."
        ),
    )
    def labels_are_valid(context: dg.AssetCheckExecutionContext, validated_labels: dict[str, pl.DataFrame]):
        yield from evaluate_per_partition(context, lambda key: labels_valid_result(validated_labels[key], task, key))

    return [outputs_satisfy_constraint, labels_are_valid]


def labels_valid_result(validated_labels: pl.DataFrame, task: TaskSpec, partition_key: str) -> dg.AssetCheckResult:
    unexplained = validated_labels.filter(pl.col("label").is_null() & pl.col("error").is_null())
    labelled = validated_labels.filter(pl.col("label").is_not_null())
    invalid = invalid_labels(labelled, task.output)
    bad = pl.concat([invalid, unexplained]).sort("row_id")
    metadata = {
        "labelled_rows": labelled.height,
        "invalid_labels": invalid.height,
        "null_labels_without_error": unexplained.height,
    }
    if bad.height:
        metadata |= failed_rows_metadata(
            bad, ["row_id", "source_line", "label", "error"], task.name, "validated_labels", partition_key
        )
    return dg.AssetCheckResult(passed=bad.height == 0, severity=dg.AssetCheckSeverity.ERROR, metadata=metadata)


def _row_checks(task: TaskSpec) -> list[dg.AssetChecksDefinition]:
    """Every task's: one result row per input record, and few enough error rows."""
    name = task.name
    partitions = drop_partitions(name)
    labels_key = asset_key(name, "validated_labels")

    @dg.asset_check(
        asset=labels_key,
        name="one_row_per_record",
        partitions_def=partitions,
        additional_ins={"raw_prompts": dg.AssetIn(key=asset_key(name, "raw_prompts"))},
        description="Every input record has exactly one output row, with a unique row_id, in input order.",
    )
    def one_row_per_record(
        context: dg.AssetCheckExecutionContext,
        validated_labels: dict[str, pl.DataFrame],
        raw_prompts: dict[str, pl.DataFrame],
    ):
        yield from evaluate_per_partition(context, lambda key: one_row_result(validated_labels[key], raw_prompts[key]))

    @dg.asset_check(
        asset=labels_key,
        name="error_share_below_threshold",
        partitions_def=partitions,
        description=(
            f"Fewer than {task.checks.max_error_share:.0%} of rows carry an error "
            "(task setting `checks.max_error_share`)."
        ),
    )
    def error_share_below_threshold(context: dg.AssetCheckExecutionContext, validated_labels: dict[str, pl.DataFrame]):
        yield from evaluate_per_partition(context, lambda key: error_share_result(validated_labels[key], task, key))

    return [one_row_per_record, error_share_below_threshold]


def one_row_result(validated_labels: pl.DataFrame, raw_prompts: pl.DataFrame) -> dg.AssetCheckResult:
    row_ids = validated_labels["row_id"]
    expected = raw_prompts["row_id"]
    duplicates = int(row_ids.is_duplicated().sum())
    missing = expected.filter(~expected.is_in(row_ids.implode()))
    in_order = row_ids.to_list() == expected.to_list()
    passed = validated_labels.height == raw_prompts.height and duplicates == 0 and missing.len() == 0 and in_order
    return dg.AssetCheckResult(
        passed=passed,
        severity=dg.AssetCheckSeverity.ERROR,
        metadata={
            "input_records": raw_prompts.height,
            "output_rows": validated_labels.height,
            "duplicate_row_ids": duplicates,
            "missing_row_ids": missing.head(50).to_list(),
            "in_input_order": in_order,
        },
    )


def error_share_result(validated_labels: pl.DataFrame, task: TaskSpec, partition_key: str) -> dg.AssetCheckResult:
    errors = validated_labels.filter(pl.col("error").is_not_null())
    share = errors.height / validated_labels.height if validated_labels.height else 0.0
    metadata: dict[str, Any] = {
        "error_rows": errors.height,
        "rows": validated_labels.height,
        "error_share": round(share, 4),
        "threshold": task.checks.max_error_share,
        "errors_by_code": error_code_counts(validated_labels),
    }
    if errors.height:
        metadata |= failed_rows_metadata(
            errors, ["row_id", "source_line", "error"], task.name, "validated_labels", partition_key
        )
    return dg.AssetCheckResult(
        passed=share <= task.checks.max_error_share, severity=dg.AssetCheckSeverity.WARN, metadata=metadata
    )


def embedding_check_result(outputs: pl.DataFrame, task: str, partition_key: str) -> dg.AssetCheckResult:
    """One partition's vectors: one dimension, finite values, unit norm; every row embedded or an error."""
    report = embedding_report(outputs)
    unexplained = outputs.filter(pl.col("embedding").is_null() & pl.col("error").is_null())
    problems = []
    if len(report.dimensions) > 1:
        problems.append(f"vectors of {len(report.dimensions)} sizes {report.dimensions}")
    if report.non_finite_rows:
        problems.append(f"{len(report.non_finite_rows)} vectors with NaN or infinite values")
    if report.off_norm_rows:
        problems.append(f"{len(report.off_norm_rows)} vectors whose L2 norm is not 1 (± {NORM_TOLERANCE})")
    if unexplained.height:
        problems.append(f"{unexplained.height} rows with neither an embedding nor an error")
    metadata: dict[str, Any] = {"checked_rows": outputs.height, **report.metadata()}
    bad_ids = sorted({*report.non_finite_rows, *report.off_norm_rows, *unexplained["row_id"].to_list()})
    if bad_ids:
        bad = outputs.filter(pl.col("row_id").is_in(bad_ids))
        metadata |= failed_rows_metadata(
            bad, ["row_id", "source_line", "num_prompt_tokens", "error"], task, "inference_outputs", partition_key
        )
    return dg.AssetCheckResult(
        passed=not problems,
        severity=dg.AssetCheckSeverity.ERROR,
        description="; ".join(problems) or None,
        metadata=metadata,
    )


def _embedding_checks(task: TaskSpec) -> list[dg.AssetChecksDefinition]:
    @dg.asset_check(
        asset=asset_key(task.name, "inference_outputs"),
        name="embeddings_are_valid",
        blocking=True,
        partitions_def=drop_partitions(task.name),
        description=(
            "Every embedding has the partition's one dimension, only finite values and unit L2 norm; "
            "every row without one carries an error."
        ),
    )
    def embeddings_are_valid(context: dg.AssetCheckExecutionContext, inference_outputs: dict[str, pl.DataFrame]):
        yield from evaluate_per_partition(
            context, lambda key: embedding_check_result(inference_outputs[key], task.name, key)
        )

    return [embeddings_are_valid]


# What a validated row carries (`TaskFormat.result`) → the checks of a task's outputs.
OUTPUT_CHECKS: dict[str, Callable[[TaskSpec], list[dg.AssetChecksDefinition]]] = {
    "labels": _label_checks,
    "embeddings": _embedding_checks,
}
