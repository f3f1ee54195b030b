"""Asset checks of a task, per partition: each reads only its own partition's parquet.

- `outputs_satisfy_constraint` on inference_outputs (ERROR, blocking): every output that finished
  normally is one of the choices / valid JSON for the schema / matches the regex. A failure means the
  engine did not enforce the constraint; validated_labels is skipped.
- `labels_are_valid` on validated_labels (ERROR, blocking): every label is valid, every null label
  has an error.
- `one_row_per_record` on validated_labels (ERROR): as many rows as raw records, unique row_ids in
  input order.
- `error_share_below_threshold` on validated_labels (WARN): share of error rows under the task's limit.
- `within_budget` on formatted_prompts (ERROR, blocking; tasks with a `budget`): the worst-case
  tokens and cost of the partition are within the budget, or inference_outputs is not run.
- `label_drift` on validated_labels (WARN; choices and regex tasks): the label shares are within
  `checks.max_label_drift` (total variation distance) of the task's recent partitions.
- `accuracy_at_least` on validated_labels (WARN; tasks with `checks.gold_field`): accuracy against
  the known labels is at least `checks.min_accuracy`.
- `confidence_at_least` on validated_labels (WARN; choices and regex tasks): at most
  `checks.max_low_confidence_share` of the labels have a `confidence` under `checks.min_confidence`.
- `agreement_at_least` on validated_labels (WARN; cascade tasks): the 95 % Wilson lower bound of the
  audit's agreement (student-labelled rows the teacher also labelled) is at least
  `checks.min_agreement`.
- `agreement_target_met` on validated_labels (ERROR; cascades with `output.cascade.target`): the
  target was met: the threshold it needs was within the budget (else the partition's student labels
  stand and the check says what the budget can guarantee), or, where no student labels (none could
  be trained), the rows the teacher labelled are enough; and the audit's 95 % interval of the share
  of all rows agreeing with the teacher reaches the guaranteed lower bound (it contradicts the bound
  otherwise). A failure says why, naming the setting to change.
- `embeddings_are_valid` on inference_outputs (ERROR, blocking; embedding tasks, in place of the two
  label checks above): one dimension for every vector, every value finite, every vector of unit L2
  norm (vLLM's embed normalizes, as the model's own Normalize module does), and no row without an
  embedding or an error.

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

from batch_assets.lib.asset_metadata import (
    asset_key,
    calibration_metadata,
    gold_choices,
    markdown_table,
)
from batch_assets.lib.materializations import latest_materialization
from batch_assets.pipeline.budget import budget_overruns, estimate_cost
from batch_assets.pipeline.cascade_labels import cascade_summary
from batch_assets.pipeline.embeddings import NORM_TOLERANCE, embedding_report
from batch_assets.pipeline.formats import TaskFormat
from batch_assets.pipeline.label_quality import (
    accuracy_report,
    confidence_report,
    error_code_counts,
    label_counts,
    label_drift,
)
from batch_assets.pipeline.prices import engine_price, teacher_price
from batch_assets.pipeline.task_formats import task_format
from batch_assets.pipeline.task_spec import PriceSpec, TaskSpec
from batch_assets.pipeline.task_spec.cascade import DEFAULT_MIN_AGREEMENT
from batch_assets.pipeline.validate_labels import constraint_violations, invalid_labels
from batch_assets.runtime.dagster_private import AssetCheckEvaluationTargetMaterializationData
from batch_assets.storage.drop_files import drop_partitions
from batch_assets.storage.locations import output_path

FAILED_ROWS_SHOWN = 10


def _failed_rows_metadata(
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


def build_task_checks(task: TaskSpec) -> list[dg.AssetChecksDefinition]:
    """The task's checks: those of its outputs (labels or vectors, by its format's `result`), one row
    per record, the error share, and the gates its settings ask for."""
    fmt = task_format(task)
    gates = [
        *_budget_checks(task, fmt),
        *_drift_checks(task, fmt),
        *_accuracy_checks(task),
        *_confidence_checks(task, fmt),
        *_agreement_checks(task, fmt),
        *_target_checks(task),
    ]
    return [*OUTPUT_CHECKS[fmt.result](task), *_row_checks(task), *gates]


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
                metadata |= _failed_rows_metadata(
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
        metadata |= _failed_rows_metadata(
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
        metadata |= _failed_rows_metadata(
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
        metadata |= _failed_rows_metadata(
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


def _budget_checks(task: TaskSpec, fmt: TaskFormat) -> list[dg.AssetChecksDefinition]:
    if task.budget is None:
        return []
    limits = {k: v for k, v in task.budget.model_dump().items() if v is not None}

    @dg.asset_check(
        asset=asset_key(task.name, "formatted_prompts"),
        name="within_budget",
        blocking=True,
        partitions_def=drop_partitions(task.name),
        description=(
            f"The partition's worst-case tokens and cost are within the task's budget {limits}; otherwise "
            "inference_outputs is not run and nothing is sent to the engine."
        ),
    )
    def within_budget(context: dg.AssetCheckExecutionContext, formatted_prompts: dict[str, pl.DataFrame]):
        yield from evaluate_per_partition(context, lambda key: budget_result(context, key, formatted_prompts[key]))

    def budget_result(
        context: dg.AssetCheckExecutionContext, partition_key: str, formatted_prompts: pl.DataFrame
    ) -> dg.AssetCheckResult:
        estimate = estimate_cost(formatted_prompts, fmt)
        overruns = budget_overruns(estimate, task.budget)
        metadata: dict = {**estimate.metadata(), "rows_to_infer": estimate.rows_to_infer, "budget": limits}
        if overruns:
            metadata["over_budget"] = "; ".join(overruns) + ": raise the budget in the task YAML or split the file"
            context.log.error(f"{partition_key}: not sent to the engine: {metadata['over_budget']}")
        return dg.AssetCheckResult(
            passed=not overruns,
            severity=dg.AssetCheckSeverity.ERROR,
            description=metadata.get("over_budget"),
            metadata=metadata,
        )

    return [within_budget]


def _drift_checks(task: TaskSpec, fmt: TaskFormat) -> list[dg.AssetChecksDefinition]:
    if not fmt.counts_labels:
        return []
    labels_key = asset_key(task.name, "validated_labels")
    threshold, partitions = task.checks.max_label_drift, task.checks.drift_history

    @dg.asset_check(
        asset=labels_key,
        name="label_drift",
        partitions_def=drop_partitions(task.name),
        description=(
            f"The partition's label shares are within {threshold} (total variation distance, task setting "
            f"`checks.max_label_drift`) of the task's {partitions} most recent other partitions."
        ),
    )
    def label_drift_check(context: dg.AssetCheckExecutionContext, validated_labels: dict[str, pl.DataFrame]):
        yield from evaluate_per_partition(context, lambda key: drift_result(context, key, validated_labels[key]))

    def drift_result(
        context: dg.AssetCheckExecutionContext, partition_key: str, validated_labels: pl.DataFrame
    ) -> dg.AssetCheckResult:
        counts = label_counts(validated_labels)
        history = recent_label_counts(context.instance, labels_key, partition_key, partitions)
        report = label_drift(counts, history)
        if report is None:
            note = "no earlier partition with labels to compare with" if counts else "no labelled row in this partition"
            return dg.AssetCheckResult(passed=True, metadata={"note": f"skipped: {note}", "threshold": threshold})
        passed = report.distance <= threshold
        metadata: dict[str, Any] = {
            "distance": report.distance,
            "threshold": threshold,
            "partitions_compared": report.partitions_compared,
            "moved_labels": report.moved_text() or "none",
            "shares": {k: round(v, 4) for k, v in sorted(report.shares.items())},
            "reference_shares": {k: round(v, 4) for k, v in sorted(report.reference_shares.items())},
        }
        description = (
            None if passed else f"label shares moved by {report.distance:.2f} (> {threshold}): {report.moved_text()}"
        )
        return dg.AssetCheckResult(
            passed=passed, severity=dg.AssetCheckSeverity.WARN, description=description, metadata=metadata
        )

    return [label_drift_check]


def _accuracy_checks(task: TaskSpec) -> list[dg.AssetChecksDefinition]:
    gold_field = task.checks.gold_field
    if not gold_field:
        return []
    minimum = task.checks.min_accuracy

    @dg.asset_check(
        asset=asset_key(task.name, "validated_labels"),
        name="accuracy_at_least",
        partitions_def=drop_partitions(task.name),
        description=(
            f"Labels agree with the known labels in the input column `{gold_field}` on at least {minimum:.0%} of "
            "the rows that carry one (task settings `checks.gold_field`, `checks.min_accuracy`)."
        ),
    )
    def accuracy_at_least(context: dg.AssetCheckExecutionContext, validated_labels: dict[str, pl.DataFrame]):
        yield from evaluate_per_partition(context, lambda key: accuracy_result(validated_labels[key]))

    def accuracy_result(validated_labels: pl.DataFrame) -> dg.AssetCheckResult:
        report = accuracy_report(validated_labels, gold_field, task.checks.gold_json_field, gold_choices(task))
        if report is None:
            note = f"skipped: no row has a value in the gold column {gold_field!r}"
            return dg.AssetCheckResult(passed=True, metadata={"note": note, "min_accuracy": minimum})
        passed = report.accuracy >= minimum
        return dg.AssetCheckResult(
            passed=passed,
            severity=dg.AssetCheckSeverity.WARN,
            description=(
                None if passed else f"accuracy {report.accuracy:.1%} is below checks.min_accuracy {minimum:.1%}"
            ),
            metadata={
                "accuracy": round(report.accuracy, 4),
                "min_accuracy": minimum,
                "rows_with_gold": report.rows_with_gold,
                "correct_rows": report.correct,
                "confusion": dg.MetadataValue.md(report.confusion_markdown()),
                **calibration_metadata(validated_labels, task),
            },
        )

    return [accuracy_at_least]


def _confidence_checks(task: TaskSpec, fmt: TaskFormat) -> list[dg.AssetChecksDefinition]:
    if not fmt.measures_confidence:
        return []
    minimum, max_share = task.checks.min_confidence, task.checks.max_low_confidence_share

    @dg.asset_check(
        asset=asset_key(task.name, "validated_labels"),
        name="confidence_at_least",
        partitions_def=drop_partitions(task.name),
        description=(
            f"At most {max_share:.0%} of the labels have a confidence under {minimum} (the model's probability of "
            "the label among the allowed outputs; task settings `checks.min_confidence`, "
            "`checks.max_low_confidence_share`)."
        ),
    )
    def confidence_at_least(context: dg.AssetCheckExecutionContext, validated_labels: dict[str, pl.DataFrame]):
        yield from evaluate_per_partition(context, lambda key: confidence_result(validated_labels[key], key))

    def confidence_result(validated_labels: pl.DataFrame, partition_key: str) -> dg.AssetCheckResult:
        report = confidence_report(validated_labels, minimum)
        if report is None or report.measured_rows == 0:
            note = "skipped: no label has a confidence (validated_labels' `confidence_note` says why)"
            return dg.AssetCheckResult(passed=True, metadata={"note": note, "min_confidence": minimum})
        passed = report.low_share <= max_share
        metadata: dict[str, Any] = {
            **report.metadata(),
            "measured_rows": report.measured_rows,
            "max_low_confidence_share": max_share,
            "min_confidence": minimum,
        }
        if report.low_rows:
            # The least sure labels first: the rows worth reading by hand.
            low = validated_labels.filter(pl.col("confidence") < minimum).sort("confidence", "row_id")
            columns = ["row_id", "source_line", *task.input.text_fields, "label", "confidence"]
            metadata |= _failed_rows_metadata(low, columns, task.name, "validated_labels", partition_key)
        description = (
            None
            if passed
            else f"{report.low_share:.0%} of the labels have a confidence under {minimum} (> {max_share:.0%})"
        )
        return dg.AssetCheckResult(
            passed=passed, severity=dg.AssetCheckSeverity.WARN, description=description, metadata=metadata
        )

    return [confidence_at_least]


def _cascade_labels_check(task: TaskSpec, name: str, description: str):
    """The decorator of a cascade's check on its validated_labels, per partition."""
    return dg.asset_check(
        asset=asset_key(task.name, "validated_labels"),
        name=name,
        partitions_def=drop_partitions(task.name),
        description=description,
    )


def _agreement_checks(task: TaskSpec, fmt: TaskFormat) -> list[dg.AssetChecksDefinition]:
    if not fmt.audits_agreement:
        return []
    minimum = DEFAULT_MIN_AGREEMENT if task.checks.min_agreement is None else task.checks.min_agreement

    @_cascade_labels_check(
        task,
        "agreement_at_least",
        f"The student's labels agree with the teacher's on the audited rows (random student-labelled rows the "
        f"teacher also labelled) with a 95 % lower bound of at least {minimum:.0%} (task settings "
        "`checks.min_agreement`, `output.cascade.audit_rows`).",
    )
    def agreement_at_least(context: dg.AssetCheckExecutionContext, validated_labels: dict[str, pl.DataFrame]):
        yield from evaluate_per_partition(
            context,
            lambda key: agreement_result(
                validated_labels[key], minimum, engine_price(task.engine), teacher_price(task)
            ),
        )

    return [agreement_at_least]


def agreement_result(
    validated_labels: pl.DataFrame,
    minimum: float,
    price: PriceSpec | None = None,
    teacher_price: PriceSpec | None = None,
) -> dg.AssetCheckResult:
    """Passes when the audit's 95 % lower bound reaches `minimum`; skipped (passing, with a note) when no
    row was audited (a partition the teacher labelled whole, or `audit_rows: 0`)."""
    summary = cascade_summary(validated_labels, price, teacher_price)
    metadata: dict[str, Any] = {**summary.metadata(), "min_agreement": minimum}
    if summary.agreement is None:
        note = "skipped: no row was audited (the teacher labelled every row, or output.cascade.audit_rows is 0)"
        return dg.AssetCheckResult(passed=True, metadata={**metadata, "note": note})
    low, high = summary.agreement_interval
    passed = low >= minimum
    description = (
        None
        if passed
        else f"the audit's agreement with the teacher is {summary.agreement:.1%} (95 % interval {low:.1%}-{high:.1%}, "
        f"{summary.audited_rows} rows): its lower bound is under checks.min_agreement {minimum:.0%}: raise "
        "output.cascade.defer_below (more rows to the teacher) or sample_rows (a better student)"
    )
    return dg.AssetCheckResult(
        passed=passed, severity=dg.AssetCheckSeverity.WARN, description=description, metadata=metadata
    )


def _target_checks(task: TaskSpec) -> list[dg.AssetChecksDefinition]:
    cascade = task.output.cascade
    if cascade is None or cascade.target is None:
        return []
    target = cascade.target
    outputs = asset_key(task.name, "inference_outputs")

    @_cascade_labels_check(
        task,
        "agreement_target_met",
        f"The cascade guarantees that at least {target.agreement:.0%} of the rows agree with the teacher, with "
        f"probability {target.confidence:.0%}, within its budget, and the audit does not contradict it (task "
        "settings `output.cascade.target`, `output.cascade.max_teacher_share`).",
    )
    def agreement_target_met(context: dg.AssetCheckExecutionContext, validated_labels: dict[str, pl.DataFrame]):
        def evaluate(key: str) -> dg.AssetCheckResult:
            record = latest_materialization(context.instance, outputs, key)
            metadata = record.asset_materialization.metadata if record and record.asset_materialization else {}
            choice = {name: entry.value for name, entry in metadata.items() if name.startswith("target_")}
            return target_result(validated_labels[key], choice)

        yield from evaluate_per_partition(context, evaluate)

    return [agreement_target_met]


def target_result(validated_labels: pl.DataFrame, choice: dict[str, Any]) -> dg.AssetCheckResult:
    """Fails when the target was not met (`target_refused` of inference_outputs' metadata says why:
    what the budget can guarantee, or why nothing could be guaranteed) or when the audit's interval
    of all rows' agreement lies under the guaranteed `target_lower_bound`."""
    summary = cascade_summary(validated_labels)
    audit = summary.all_rows_agreement()
    metadata: dict[str, Any] = {**choice, **summary.all_rows_metadata()}
    if "target_met" not in choice:
        # The cascade records a choice for every partition with a row (when no student labels, the
        # agreement is counted, not bounded): none means an empty partition, or outputs made before
        # the target was set.
        passed = validated_labels.height == 0
        description = (
            None
            if passed
            else "inference_outputs recorded no output.cascade.target choice: materialize it again with the target"
        )
    elif not choice["target_met"]:
        description, passed = str(choice.get("target_refused")), False
    elif audit is not None and audit[2] < choice["target_lower_bound"]:
        description = (
            f"the audit estimates {audit[0]:.1%} of the rows agree with the teacher (95 % interval "
            f"{audit[1]:.1%}-{audit[2]:.1%}): under the guaranteed {choice['target_lower_bound']:.1%}, so the "
            "rows are not exchangeable as the bound assumes (or this is the 1 - confidence case)"
        )
        passed = False
    else:
        description, passed = None, True
    return dg.AssetCheckResult(
        passed=passed, severity=dg.AssetCheckSeverity.ERROR, description=description, metadata=metadata
    )
