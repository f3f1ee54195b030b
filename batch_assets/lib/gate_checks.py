"""The gates a task's settings ask for, checks of a partition beside its output checks (lib/checks.py):

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
"""

from typing import Any

import dagster as dg
import polars as pl

from batch_assets.lib.asset_metadata import (
    asset_key,
    calibration_metadata,
    gold_choices,
)
from batch_assets.lib.check_evaluations import evaluate_per_partition, failed_rows_metadata, recent_label_counts
from batch_assets.lib.materializations import latest_materialization
from batch_assets.pipeline.budget import budget_overruns, estimate_cost
from batch_assets.pipeline.cascade.labels import cascade_summary
from batch_assets.pipeline.formats import TaskFormat
from batch_assets.pipeline.label_quality import (
    accuracy_report,
    confidence_report,
    label_counts,
    label_drift,
)
from batch_assets.pipeline.prices import engine_price, teacher_price
from batch_assets.pipeline.task_spec import PriceSpec, TaskSpec
from batch_assets.pipeline.task_spec.cascade import DEFAULT_MIN_AGREEMENT
from batch_assets.storage.drop_files import drop_partitions


def gate_checks(task: TaskSpec, fmt: TaskFormat) -> list[dg.AssetChecksDefinition]:
    """The gates the task's settings ask for: budget, drift, accuracy, confidence, agreement, target."""
    return [
        *_budget_checks(task, fmt),
        *_drift_checks(task, fmt),
        *_accuracy_checks(task),
        *_confidence_checks(task, fmt),
        *_agreement_checks(task, fmt),
        *_target_checks(task),
    ]


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
            metadata |= failed_rows_metadata(low, columns, task.name, "validated_labels", partition_key)
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
