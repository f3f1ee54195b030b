"""The keys of a task's assets and what their materializations and checks record: shared by the
asset factory (assets.py) and the checks (checks.py), which import it and not each other.

Each helper turns a partition's frame (and the run's figures) into Dagster metadata; what a kind
of task adds (its label metadata, preview columns, files) comes from its format object
(pipeline/task_formats.py).
"""

from __future__ import annotations

from typing import Any, cast

import dagster as dg
import polars as pl

from batch_assets.lib.estimates import PartitionEstimate
from batch_assets.pipeline.budget import actual_cost_metadata, estimate_cost
from batch_assets.pipeline.calibration import calibration_report
from batch_assets.pipeline.engine_contract import EngineSession, EngineSettings
from batch_assets.pipeline.formats import TaskFormat
from batch_assets.pipeline.inference_requests import InferenceStats
from batch_assets.pipeline.label_quality import AccuracyReport, accuracy_report, confidence_report, error_code_counts
from batch_assets.pipeline.prices import engine_price, gpu_cost_usd
from batch_assets.pipeline.task_spec import TaskSpec

PREVIEW_ROWS = 5
PREVIEW_DIGITS = 3  # floats in the preview (confidence, similarity): 0.873, not 0.8731892456817627
ERROR_ROWS_SHOWN = 5  # error rows listed in validated_labels' metadata, whatever their share
ERROR_ROWS_COLUMNS = ("row_id", "source_line", "error")
# Engine-neutral: resources can route a task to an engine other than its YAML's `engine.kind`.
NO_CONFIDENCE_REASONS = (
    "their results were reused from checkpoints or the result cache stored before confidence was measured "
    "(materialize inference_outputs with `use_result_cache: false` to measure it), the endpoint returned no "
    "log-probabilities (or `logprobs=False` on the `llm_endpoint` resource), or structured outputs are off"
)


def asset_key(task: str, asset: str) -> dg.AssetKey:
    return dg.AssetKey([task, asset])


def markdown_table(rows: list[dict], columns: list[str], *, width: int = 80) -> str:
    def cell(value: object) -> str:
        text = "" if value is None else str(value)
        text = text.replace("|", "\\|").replace("\n", " ")
        return text if len(text) <= width else text[: width - 3] + "..."

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row.get(c)) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def column_schema(frame: pl.DataFrame) -> dg.TableSchema:
    """`dagster/column_schema`: the catalog shows an asset's columns and their types."""
    return dg.TableSchema(columns=[dg.TableColumn(name, str(dtype)) for name, dtype in frame.schema.items()])


def prompt_tokens(frame: pl.DataFrame) -> int:
    return int(frame["num_prompt_tokens"].sum() or 0)


def formatted_metadata(
    frame: pl.DataFrame, fmt: TaskFormat, seconds: float, estimate: PartitionEstimate | None = None
) -> dict[str, Any]:
    """A partition of formatted_prompts: its rows, errors, prompt tokens and its estimate (worst case,
    and with `estimate` the cache's share and the expected figures: lib/estimates.py)."""
    errors = error_code_counts(frame)
    return {
        "rows": frame.height,
        "error_rows": sum(errors.values()),
        "errors_by_code": errors,
        "prompt_tokens": prompt_tokens(frame),
        # polars types Series.max() as any literal; an Int64 column gives an int or None
        "max_prompt_tokens": int(cast("int | None", frame["num_prompt_tokens"].max()) or 0),
        "seconds": round(seconds, 3),
        **fmt.formatting_metadata(frame),
        **(estimate.metadata() if estimate is not None else estimate_cost(frame, fmt).metadata()),
        "dagster/row_count": frame.height,
        "dagster/column_schema": column_schema(frame),
    }


def inference_metadata(
    task: TaskSpec,
    fmt: TaskFormat,
    settings: EngineSettings,
    session: EngineSession,
    frame: pl.DataFrame,
    stats: InferenceStats,
    fingerprint: str,
    gpu_hours: float | None = None,
) -> dict[str, Any]:
    """A partition of inference_outputs: where its rows came from, tokens, speed, model and settings,
    what the engine itself measured (`session.metadata`) and the cost. `gpu_hours`: the in-process
    engine's device time this partition took (its share of the stream's)."""
    generated = int(frame["num_generated_tokens"].sum() or 0)
    price = engine_price(task.engine)
    # Nine digits: a partition of seconds is a few millionths of an hour.
    gpu = {} if gpu_hours is None else {"gpu_hours": round(gpu_hours, 9)}
    if gpu_hours is not None and (gpu_cost := gpu_cost_usd(gpu_hours, price)) is not None:
        gpu["gpu_cost_usd"] = gpu_cost
    return {
        "rows": stats.rows,
        "rows_inferred": stats.rows_inferred,
        "rows_from_checkpoint": stats.rows_from_checkpoint,
        "rows_from_cache": stats.rows_from_cache,
        "rows_added_to_cache": stats.rows_cached,
        "rows_deduplicated": stats.rows_deduplicated,
        "error_rows": stats.error_rows,
        "errors_by_code": error_code_counts(frame),
        # What was sent: a row refused before the engine (too long, empty) costs nothing.
        "prompt_tokens": stats.sent_prompt_tokens,
        "generated_tokens": generated,
        "engine_seconds": round(stats.engine_seconds, 3),
        "engine_start_seconds": round(session.start_seconds, 3),
        "inference_seconds": round(stats.inference_seconds, 3),
        "generated_tokens_per_second": round(stats.generated_tokens_per_second, 2),
        "rows_per_second": round(stats.rows_per_second, 2),
        **fmt.inference_metadata(frame),
        **stats.format_metadata,
        "model": settings.model,
        "model_chosen_by": settings.resolved.model_setting,  # the setting to change for another model
        "engine_settings": settings.metadata(),
        "sampling_params": task.sampling.model_dump(),
        "output_constraint": task.output.kind,
        **session.metadata,
        "checkpoint_fingerprint": fingerprint,
        **actual_cost_metadata(stats.sent_prompt_tokens, generated, price),
        **gpu,
        "dagster/row_count": frame.height,
        "dagster/column_schema": column_schema(frame),
    }


def gold_choices(task: TaskSpec) -> list[str]:
    """The labels a choices task can give, each a column of its confusion table and a row of
    `per_label` even when never predicted; none for other tasks (or a gold JSON field)."""
    if task.output.kind != "choices" or task.checks.gold_json_field is not None:
        return []
    return list(task.output.choices or [])


PER_LABEL_SCHEMA = dg.TableSchema(
    columns=[
        dg.TableColumn("label", "string"),
        dg.TableColumn("precision", "float", description="empty: the label was never predicted"),
        dg.TableColumn("recall", "float", description="empty: no gold row has the label"),
        dg.TableColumn("support", "int", description="gold rows with the label"),
    ]
)


def per_label_table(report: AccuracyReport) -> dg.MetadataValue:
    """Precision, recall and support per label, one table row each (the UI shows it as a table)."""
    records = [dg.TableRecord(row) for row in report.per_label_records()]
    return dg.MetadataValue.table(records, schema=PER_LABEL_SCHEMA)


def accuracy_metadata(labels: pl.DataFrame, task: TaskSpec) -> dict[str, Any]:
    """Accuracy against the task's `checks.gold_field`, when the partition carries one."""
    if not task.checks.gold_field:
        return {}
    report = accuracy_report(labels, task.checks.gold_field, task.checks.gold_json_field, gold_choices(task))
    if report is None:
        note = f"no row has a value in the gold column {task.checks.gold_field!r}: accuracy not measured"
        return {"accuracy_note": note}
    return {
        "accuracy": round(report.accuracy, 4),
        "rows_with_gold": report.rows_with_gold,
        "correct_rows": report.correct,
        "per_label": per_label_table(report),
        "confusion": dg.MetadataValue.md(report.confusion_markdown()),
        **calibration_metadata(labels, task),
    }


def calibration_metadata(labels: pl.DataFrame, task: TaskSpec) -> dict[str, Any]:
    """The expected calibration error of the labels' confidence against the gold column, raw and
    calibrated (cross-validated), for tasks whose labels have a confidence."""
    if not task.checks.gold_field or not task.output.has_confidence:
        return {}
    report = calibration_report(labels, task.checks.gold_field)
    return {} if report is None else report.metadata()


def confidence_metadata(labels: pl.DataFrame, task: TaskSpec) -> dict[str, Any]:
    """The labels' confidence: its median and the share under the task's `checks.min_confidence`."""
    report = confidence_report(labels, task.checks.min_confidence)
    if report is None:
        return {}
    metadata: dict[str, Any] = {"min_confidence": task.checks.min_confidence, **report.metadata()}
    if report.unmeasured_rows:
        metadata["confidence_note"] = (
            f"{report.unmeasured_rows} of {report.labelled_rows} labels have no confidence: {NO_CONFIDENCE_REASONS}"
        )
    return metadata


def label_distribution(counts: dict[str, int], rows: int) -> dg.MetadataValue:
    """Rows and share per label, as a table."""
    shares = [{"label": k, "rows": v, "share": f"{100 * v / max(rows, 1):.1f}%"} for k, v in counts.items()]
    return dg.MetadataValue.md(markdown_table(shares, ["label", "rows", "share"]))


def preview_markdown(labels: pl.DataFrame, columns: list[str], gold_field: str | None = None) -> str:
    """The first rows of a partition as a table: floats to PREVIEW_DIGITS digits, and the gold
    column (`checks.gold_field`), where the partition has it, right after `label`."""
    if gold_field and gold_field in labels.columns and "label" in columns:
        columns = [c for c in columns if c != gold_field]
        columns.insert(columns.index("label") + 1, gold_field)
    head = labels.head(PREVIEW_ROWS)
    head = head.with_columns(pl.col(pl.Float32, pl.Float64).round(PREVIEW_DIGITS))
    return markdown_table(head.to_dicts(), columns)


def error_rows_markdown(labels: pl.DataFrame) -> str | None:
    """The first ERROR_ROWS_SHOWN rows with an error (row id, line in the drop file, the error);
    None when no row has one."""
    errors = labels.filter(pl.col("error").is_not_null()).head(ERROR_ROWS_SHOWN)
    if errors.height == 0:
        return None
    columns = [c for c in ERROR_ROWS_COLUMNS if c in labels.columns]
    return markdown_table(errors.to_dicts(), columns, width=200)


def labels_metadata(labels: pl.DataFrame, task: TaskSpec, fmt: TaskFormat) -> dict[str, Any]:
    """A partition of validated_labels: what its kind reports, rows, errors (and the first few error
    rows), a preview, accuracy, confidence and, for labels from a closed set, their counts."""
    errors = error_code_counts(labels)
    preview = preview_markdown(labels, fmt.preview_columns(labels), task.checks.gold_field)
    error_rows = error_rows_markdown(labels)
    metadata: dict[str, Any] = {
        **fmt.label_metadata(labels),
        "rows": labels.height,
        "error_rows": sum(errors.values()),
        "errors_by_code": errors,
        **({"error_rows_preview": dg.MetadataValue.md(error_rows)} if error_rows else {}),
        "preview": dg.MetadataValue.md(preview),
        "dagster/row_count": labels.height,
        "dagster/column_schema": column_schema(labels),
        **accuracy_metadata(labels, task),
        **confidence_metadata(labels, task),
    }
    if counts := fmt.label_counts(labels):
        metadata["label_counts"] = counts
        metadata["label_distribution"] = label_distribution(counts, labels.height)
    return metadata


def image_metadata(frame: pl.DataFrame, errors: dict[str, int]) -> dict[str, int]:
    """An image task's raw_prompts metadata: images read, their pixels, and rows whose image failed."""
    from batch_assets.pipeline.inputs.images import IMAGE_ERROR_CODES, IMAGES_COLUMN, PIXELS_COLUMN

    return {
        "images": int(frame[IMAGES_COLUMN].list.len().sum() or 0),
        "image_pixels": int(frame[PIXELS_COLUMN].sum() or 0),
        "image_error_rows": sum(count for code, count in errors.items() if code in IMAGE_ERROR_CODES),
    }
