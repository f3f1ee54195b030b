"""What became of each file a command ran: one outcome and one summary line per file.

The summary is read back from what the run recorded (validated_labels' rows and labels, the
materialization metadata of inference_outputs and validated_labels), so it says the same as the UI.
A failure is one line saying what is wrong: for known failures what to set instead, else the
outermost error batch_assets raised (app/error_causes.py). A file run as shards gets one
outcome for all its shards together.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import dagster as dg
import polars as pl

from batch_assets.app.error_causes import error_info_chain, error_info_line
from batch_assets.engines.kinds import resolve_settings
from batch_assets.lib.materializations import latest_materialization
from batch_assets.pipeline.cascade.summary import wilson_interval
from batch_assets.pipeline.label_quality import error_code_counts
from batch_assets.pipeline.task_formats import task_format
from batch_assets.pipeline.task_spec import TaskSpec
from batch_assets.storage.locations import output_path


@dataclass(frozen=True)
class Usage:
    """What a file's inference used, from its inference_outputs metadata (summed over its shards):
    prompt tokens sent, tokens generated, and dollars where the task has a price (`cost_usd` at the
    token prices, `gpu_cost_usd` at `engine.price.per_gpu_hour`)."""

    prompt_tokens: int = 0
    generated_tokens: int = 0
    cost_usd: float | None = None
    gpu_cost_usd: float | None = None

    def __add__(self, other: Usage) -> Usage:
        def plus(a: float | None, b: float | None) -> float | None:
            return None if a is None and b is None else round((a or 0.0) + (b or 0.0), 6)

        return Usage(
            self.prompt_tokens + other.prompt_tokens,
            self.generated_tokens + other.generated_tokens,
            plus(self.cost_usd, other.cost_usd),
            plus(self.gpu_cost_usd, other.gpu_cost_usd),
        )

    def text(self) -> str:
        """`tokens 2,518 in, 41 out, $0.000620` (and the GPU's dollars where priced per GPU-hour)."""
        text = f"tokens {self.prompt_tokens:,} in, {self.generated_tokens:,} out"
        if self.cost_usd is not None:
            text += f", ${self.cost_usd:,.6f}"
        if self.gpu_cost_usd is not None:
            text += f", ${self.gpu_cost_usd:,.6f} of GPU time"
        return text


def usage_of(task_name: str, partition_keys: list[str], instance: dg.DagsterInstance) -> Usage | None:
    """The partitions' `Usage` together; None when one has no inference_outputs materialization."""
    key = dg.AssetKey([task_name, "inference_outputs"])
    total = Usage()
    for partition in partition_keys:
        record = latest_materialization(instance, key, partition)
        if record is None or record.asset_materialization is None:
            return None
        total += Usage(
            int(_metadata_value(record, "prompt_tokens") or 0),
            int(_metadata_value(record, "generated_tokens") or 0),
            _metadata_value(record, "cost_usd"),
            _metadata_value(record, "gpu_cost_usd"),
        )
    return total


def usage_total_line(outcomes: Sequence[PartitionOutcome]) -> str | None:
    """The closing line of a command that ran several files: their tokens and dollars together."""
    used = [outcome.usage for outcome in outcomes if outcome.usage is not None and not outcome.skipped]
    if len(used) < 2:
        return None
    total = sum(used[1:], used[0])
    return f"total of {len(used)} files: {total.text()}"


@dataclass
class PartitionOutcome:
    task: str
    partition_key: str
    success: bool
    run_id: str | None
    summary: str
    failed_error_checks: list[str] = field(default_factory=list)
    skipped: bool = False  # already validated from this file version: not run again
    rows: int | None = None
    error_rows: int | None = None
    # Failed checks of WARN severity: named on the line; they fail the command only when asked to
    # (`batch-assets run --fail-on-warn`).
    failed_warn_checks: list[str] = field(default_factory=list)
    usage: Usage | None = None  # tokens and dollars of its inference_outputs, when it has one

    @property
    def all_rows_failed(self) -> bool:
        return bool(self.rows) and self.error_rows == self.rows

    @property
    def ok(self) -> bool:
        """The run succeeded, no ERROR check failed and not every row is an error (WARN checks aside);
        or nothing ran: UP TO DATE evaluates nothing, so it fails nothing (its last run said how it went)."""
        return self.skipped or (self.success and not self.failed_error_checks and not self.all_rows_failed)

    def passed(self, *, fail_on_warn: bool = False) -> bool:
        """`ok`, and with `fail_on_warn` no WARN check failed either: what the exit status says."""
        return self.ok and not (fail_on_warn and self.failed_warn_checks)

    @property
    def status(self) -> str:
        """The line's verdict; every check that failed is named in it, whatever its severity (a cron
        job or CI log reads this line, not the UI)."""
        if self.skipped:
            return "UP TO DATE"
        if not self.success:
            return "FAILED"
        if self.failed_error_checks:
            verdict = "CHECKS FAILED"
        elif self.all_rows_failed:
            verdict = "ALL ROWS FAILED"
        elif self.failed_warn_checks:
            verdict = "WARN CHECKS FAILED"
        else:
            return "OK"
        failed = [f"{check} (ERROR)" for check in self.failed_error_checks]
        failed += [f"{check} (WARN)" for check in self.failed_warn_checks]
        return f"{verdict} ({', '.join(failed)})" if failed else verdict

    def line(self) -> str:
        """`task/partition: STATUS run <id>: summary`, the line the command prints for the file."""
        run = f" run {self.run_id[:8]}" if self.run_id else ""
        return f"{self.task}/{self.partition_key}: {self.status}{run}: {self.summary}"


def partition_outcome(
    task_name: str,
    key: str,
    instance: dg.DagsterInstance,
    *,
    run_id: str | None,
    failure: str | None = None,
    failed_error_checks: list[str] | None = None,
    skipped: bool = False,
    failed_warn_checks: list[str] | None = None,
) -> PartitionOutcome:
    """The outcome of one partition; `failure` says why its run failed (None: the run succeeded)."""
    checks, warnings = failed_error_checks or [], failed_warn_checks or []
    if failure is not None:
        return PartitionOutcome(task_name, key, False, run_id, failure, checks, skipped, failed_warn_checks=warnings)
    counts = _label_counts(task_name, [key], instance)
    rows, errors = (counts.rows, counts.error_rows) if counts else (None, None)
    summary = summary_line(task_name, [key], instance, counts=counts)
    usage = usage_of(task_name, [key], instance)
    return PartitionOutcome(task_name, key, True, run_id, summary, checks, skipped, rows, errors, warnings, usage)


def run_outcomes(
    task_name: str, keys: Sequence[str], result: dg.ExecuteInProcessResult, instance: dg.DagsterInstance
) -> list[PartitionOutcome]:
    """The outcome of each partition of a finished run: its failed checks (ERROR and WARN), and why
    the run failed."""
    evaluations = result.get_asset_check_evaluations()
    outcomes = []
    for key in keys:
        failed = [e for e in evaluations if e.partition == key and not e.passed]
        errors = [e for e in failed if e.severity == dg.AssetCheckSeverity.ERROR]
        # A blocking check that stopped the run says why in its description (e.g. over budget).
        stopped_by = [f"stopped by {e.check_name}: {e.description}" for e in errors if e.description]
        failure = None if result.success else (stopped_by[0] if stopped_by else failure_text(result))
        outcomes.append(
            partition_outcome(
                task_name,
                key,
                instance,
                run_id=result.run_id,
                failure=failure,
                failed_error_checks=[_check_name(e) for e in errors],
                failed_warn_checks=[_check_name(e) for e in failed if e.severity != dg.AssetCheckSeverity.ERROR],
            )
        )
    return outcomes


def _check_name(evaluation: dg.AssetCheckEvaluation) -> str:
    return f"{evaluation.asset_key.to_user_string()}:{evaluation.check_name}"


def file_outcome(
    instance: dg.DagsterInstance, task_name: str, file_key: str, keys: list[str], by_key: dict[str, PartitionOutcome]
) -> PartitionOutcome:
    """One outcome per file as the user named it: its partition's, or its shards' together."""
    if keys == [file_key]:
        return by_key[file_key]
    parts = [by_key[key] for key in keys]
    failed = [part for part in parts if not part.success]
    summary = (
        "; ".join(f"shard {part.partition_key}: {part.summary}" for part in failed)
        if failed
        else f"{summary_line(task_name, keys, instance)} ({len(keys)} shards)"
    )
    rows = [part.rows for part in parts]
    errors = [part.error_rows for part in parts]
    return PartitionOutcome(
        task_name,
        f"{file_key}~*",
        success=not failed,
        run_id=None,
        summary=summary,
        failed_error_checks=[f"{part.partition_key}: {check}" for part in parts for check in part.failed_error_checks],
        skipped=all(part.skipped for part in parts),
        rows=None if None in rows else sum(r for r in rows if r is not None),
        error_rows=None if None in errors else sum(e for e in errors if e is not None),
        failed_warn_checks=[f"{part.partition_key}: {check}" for part in parts for check in part.failed_warn_checks],
        usage=None if failed else usage_of(task_name, keys, instance),
    )


@dataclass(frozen=True)
class _LabelCounts:
    """What a file's validated_labels hold, for its summary line."""

    rows: int
    error_rows: int
    error_codes: dict[str, int]
    labels: str  # e.g. `labels: positive=3, negative=1`, `answers: 3, 40-212 characters (median 97)`

    def errors_text(self) -> str:
        """`N error rows`, with the commonest codes (`empty_text=2, malformed_json=1, 2 more codes`)."""
        text = f"{self.error_rows} error rows"
        if not self.error_codes:
            return text
        ranked = sorted(self.error_codes.items(), key=lambda code: (-code[1], code[0]))
        named = ", ".join(f"{code}={count}" for code, count in ranked[:ERROR_CODES_SHOWN])
        more = len(ranked) - ERROR_CODES_SHOWN
        return f"{text} ({named}{f', {more} more codes' if more > 0 else ''})"


# Error codes named on a summary line, the commonest first.
ERROR_CODES_SHOWN = 3


def _label_counts(task_name: str, partition_keys: list[str], instance: dg.DagsterInstance) -> _LabelCounts | None:
    """The partitions' validated_labels together (a file's own partition, or its shards), or None
    when one is not written: labels from a closed set counted per label, free-text answers by their
    number and length, vectors by their dimension."""
    frames = []
    for key in partition_keys:
        path = output_path(task_name, "validated_labels", key)
        if not path.exists():
            return None
        with path.open("rb") as handle:
            # Two columns of what may be a million-row table of many columns.
            column = "label" if "label" in pl.read_parquet_schema(handle) else "embedding"
            handle.seek(0)
            frame = pl.read_parquet(handle, columns=["error", column])
        frames.append(frame.select("error", label=_label_or_embedding(frame)))
    labels = pl.concat(frames, how="vertical_relaxed")
    errors = int(labels["error"].is_not_null().sum())
    record = latest_materialization(instance, dg.AssetKey([task_name, "inference_outputs"]), partition_keys[0])
    text = _labels_text(labels, free_text=_metadata_value(record, "output_constraint") == "text")
    return _LabelCounts(labels.height, errors, error_code_counts(labels), text)


def _labels_text(labels: pl.DataFrame, *, free_text: bool) -> str:
    """The labels of a summary line: vectors by their dimension, free text (`output.kind: text`) by
    the answers' number and length in characters, other labels counted per label when there are
    few kinds of them (a dozen at most)."""
    given = labels["label"].drop_nulls()
    if labels.schema["label"] == pl.UInt32:  # an embedding task: the vectors' dimension
        shown = "/".join(map(str, given.unique().sort().to_list())) or "-"
        return f"labels: {given.len()} embedded (dimension {shown})"
    if free_text:
        if given.is_empty():
            return "answers: 0"
        lengths = given.str.len_chars()
        low, high = int(cast("int", lengths.min())), int(cast("int", lengths.max()))
        spread = f"{low}" if low == high else f"{low}-{high}"
        return f"answers: {given.len()}, {spread} characters (median {round(cast('float', lengths.median()))})"
    counts = labels.filter(pl.col("label").is_not_null()).group_by("label").len().sort("len", descending=True)
    if counts.height and counts.height <= 12:
        return "labels: " + ", ".join(f"{row['label']}={row['len']}" for row in counts.to_dicts())
    return f"labels: {given.len()} labelled"


def sample_accuracies(
    instance: dg.DagsterInstance, tasks: Sequence[TaskSpec], samples_dir: Path
) -> list[tuple[str, str, float, int]]:
    """(task, how it labels, accuracy, rows with a gold label) of each task whose bundled samples
    carry hand-made labels, from the latest materialization of each sample partition."""
    from batch_assets.storage.drop_files import partition_key_for

    found = []
    for task in tasks:
        folder = samples_dir / task.name
        if not task.checks.gold_field or not folder.exists():
            continue
        key = dg.AssetKey([task.name, "validated_labels"])
        records = [latest_materialization(instance, key, partition_key_for(p.name)) for p in sorted(folder.glob("*"))]
        gold = _gold_accuracy(records)
        if gold:
            accuracy, rows = gold
            model = resolve_settings(task).model
            found.append((task.name, task_format(task).labelled_by(model), accuracy, rows))
    return found


def accuracy_side_by_side(accuracies: list[tuple[str, str, float, int]]) -> str | None:
    """The demo's accuracies on the hand-labelled samples, one line per task, aligned."""
    if not accuracies:
        return None
    width = max(len(name) for name, *_ in accuracies)
    lines = [f"  {name:<{width}}  {accuracy:4.0%} of {rows} rows  ({how})" for name, how, accuracy, rows in accuracies]
    return (
        "\nAccuracy on the hand-labelled samples (a few dozen invented rows; measure on your own data):\n"
        + "\n".join(lines)
    )


def _label_or_embedding(frame: pl.DataFrame) -> pl.Expr:
    """The `label` of a labelled table; an embedding table's vector sizes (null for error rows)."""
    if "label" in frame.columns or "embedding" not in frame.columns:
        return pl.col("label")
    return pl.col("embedding").cast(pl.List(pl.Float32)).list.len()


def _metadata_value(record, name: str):
    entry = record.asset_materialization.metadata.get(name) if record and record.asset_materialization else None
    return None if entry is None else entry.value


def _gold_accuracy(records: Sequence[dg.EventLogRecord | None]) -> tuple[float, int] | None:
    """(accuracy, rows with a gold label) over validated_labels materializations, each weighted by
    its rows with a gold label; None when none has an accuracy."""
    gold = [(_metadata_value(r, "accuracy"), _metadata_value(r, "rows_with_gold")) for r in records]
    gold = [(accuracy, rows) for accuracy, rows in gold if accuracy is not None and rows]
    if not gold:
        return None
    rows = sum(rows for _, rows in gold)
    return sum(accuracy * count for accuracy, count in gold) / rows, rows


def _quality_notes(task_name: str, partition_keys: list[str], instance: dg.DagsterInstance) -> list[str]:
    """Accuracy and low-confidence share over the partitions, each weighted by its rows."""
    records = [
        latest_materialization(instance, dg.AssetKey([task_name, "validated_labels"]), key) for key in partition_keys
    ]
    notes = []
    gold = _gold_accuracy(records)
    if gold:
        notes.append(f"accuracy {gold[0]:.0%} on {gold[1]} hand-labelled rows")
    low = [(_metadata_value(r, "low_confidence_share"), _metadata_value(r, "rows")) for r in records]
    minimum = _metadata_value(records[0], "min_confidence") if records else None
    low = [(share, rows) for share, rows in low if share is not None and rows]
    if low and minimum is not None:
        share = sum(share * rows for share, rows in low) / sum(rows for _, rows in low)
        notes.append(f"{share:.0%} of labels with confidence under {minimum}")
    return notes + _cascade_notes(records) + _target_notes(task_name, partition_keys, instance) + _task_notes(records)


def _task_notes(records: list[dg.EventLogRecord | None]) -> list[str]:
    """A cascade by target's task-level figures, as its newest partition recorded them: the rows its
    student version labelled over every partition so far, the teacher's share, the bound."""
    figures = [r for r in records if _metadata_value(r, "task_rows")]
    if not figures:
        return []
    latest = max(figures, key=lambda r: r.timestamp if r is not None else 0)
    rows, partitions = _metadata_value(latest, "task_rows"), _metadata_value(latest, "task_partitions")
    cost = _metadata_value(latest, "task_cost_per_1000_correct_usd")
    share, bound = _metadata_value(latest, "task_teacher_share"), _metadata_value(latest, "task_lower_bound")
    return [
        f"task: student version {_metadata_value(latest, 'task_student_version')} labelled {rows:,} rows of "
        f"{partitions} partition{'' if partitions == 1 else 's'}, the teacher {share:.1%} of them; {bound:.1%} agree "
        f"with the teacher or more, with probability {_metadata_value(latest, 'task_confidence'):.0%}"
        + (f"; ${cost:,.4f} per 1,000 rows guaranteed to agree" if cost is not None else "")
    ]


def _target_notes(task_name: str, partition_keys: list[str], instance: dg.DagsterInstance) -> list[str]:
    """What a cascade by target chose per partition (inference_outputs' metadata): the threshold and
    its guaranteed lower bound, or the refusal; none for other tasks."""
    key = dg.AssetKey([task_name, "inference_outputs"])
    notes = []
    for partition in partition_keys:
        record = latest_materialization(instance, key, partition)
        if _metadata_value(record, "target_met") is None:
            continue
        where = f" for {partition}" if len(partition_keys) > 1 else ""
        if not _metadata_value(record, "target_met"):
            notes.append(f"target not met{where}: {_metadata_value(record, 'target_refused')}")
            continue
        threshold = _metadata_value(record, "target_threshold")
        kept = "the student keeps none" if threshold is None else f"the student keeps confidence >= {threshold:.3f}"
        notes.append(
            f"target{where}: {_metadata_value(record, 'target_lower_bound'):.1%} of rows agree with the teacher or "
            f"more, with probability {_metadata_value(record, 'target_confidence'):.0%} ({kept})"
        )
    return notes


def _cascade_notes(records: list[dg.EventLogRecord | None]) -> list[str]:
    """A cascade's teacher rows and audit over the partitions (none for other kinds of task)."""
    teacher = [_metadata_value(r, "teacher_rows") for r in records]
    if not any(count is not None for count in teacher):
        return []
    rows = sum(_metadata_value(r, "rows") or 0 for r in records)
    teacher_rows = sum(count or 0 for count in teacher)
    # Error rows are neither the teacher's nor the student's: the student's are counted, not inferred.
    student_rows = sum(_metadata_value(r, "student_rows") or 0 for r in records)
    audited = sum(_metadata_value(r, "audited_rows") or 0 for r in records)
    agreed = sum(
        round((_metadata_value(r, "audit_agreement") or 0) * (_metadata_value(r, "audited_rows") or 0)) for r in records
    )
    share = f" ({teacher_rows / rows:.0%})" if rows else ""
    notes = [f"teacher labelled {teacher_rows} rows{share}, the student {student_rows}"]
    if audited:
        low, high = wilson_interval(agreed, audited)
        notes.append(f"audit agreement {agreed / audited:.0%} [{low:.0%}-{high:.0%}] on {audited} rows")
    return notes + _cascade_cost_notes(records)


def _cascade_cost_notes(records: list[dg.EventLogRecord | None]) -> list[str]:
    """What the labels cost against the teacher on every row, summed over the partitions: in dollars
    where both the embedding and the chat teacher have a price, else each as it is measured (the
    embedding in dollars at engine.price, the teacher at output.cascade.teacher_price or in engine
    seconds; none for a column teacher)."""

    def total(name: str) -> float | None:
        values = [_metadata_value(r, name) for r in records]
        return sum(v for v in values if v is not None) if any(v is not None for v in values) else None

    cascade, all_teacher = total("cascade_cost_usd"), total("all_teacher_cost_usd")
    if cascade is not None and all_teacher is not None:
        return [
            f"cost ${cascade:,.4f} against ${all_teacher:,.4f} with the teacher on every row"
            + _per_correct_label(records, cascade, all_teacher)
        ]
    notes = []
    if (embedding := total("embedding_cost_usd")) is not None:
        notes.append(f"embedding cost ${embedding:,.4f}")
    if (teacher := total("teacher_cost_usd")) is not None and all_teacher is not None:
        notes.append(f"teacher cost ${teacher:,.4f} against ${all_teacher:,.4f} on every row")
    seconds, all_seconds = total("teacher_engine_seconds"), total("all_teacher_engine_seconds")
    if seconds is not None and all_seconds is not None:
        notes.append(f"teacher engine {seconds:,.1f} s against {all_seconds:,.1f} s on every row")
    return notes


def _per_correct_label(records: list[dg.EventLogRecord | None], cascade: float, all_teacher: float) -> str:
    """Dollars per 1,000 labels agreeing with the teacher over the partitions (each partition's rows
    agreeing as its audit estimates, `all_rows_agreement`), the cascade's and the teacher's alone;
    empty unless every partition was audited."""
    estimates = [(_metadata_value(r, "all_rows_agreement"), _metadata_value(r, "rows") or 0) for r in records]
    if any(share is None for share, _ in estimates):
        return ""
    correct, rows = sum(share * count for share, count in estimates), sum(count for _, count in estimates)
    if not correct:
        return ""
    return (
        f"; ${cascade / correct * 1000:,.4f} per 1,000 labels agreeing with the teacher (the audit's estimate) "
        f"against ${all_teacher / rows * 1000:,.4f} with the teacher alone"
    )


def summary_line(
    task_name: str,
    partition_keys: list[str],
    instance: dg.DagsterInstance,
    counts: _LabelCounts | None = None,
) -> str:
    """Rows, error rows (and their commonest codes), labels or answers (with accuracy and confidence
    notes) and, for one partition, the generation rate or where its rows came from. `counts`: the
    partitions' `_label_counts`, when the caller has them already."""
    counts = counts or _label_counts(task_name, partition_keys, instance)
    if counts is None:
        return "no validated_labels written"
    rows, errors, label_text = counts.rows, counts.error_rows, counts.labels
    notes = _quality_notes(task_name, partition_keys, instance)
    if notes:
        label_text += f" ({'; '.join(notes)})"
    rate = ""
    if len(partition_keys) == 1:
        record = latest_materialization(instance, dg.AssetKey([task_name, "inference_outputs"]), partition_keys[0])
        if record is not None and record.asset_materialization is not None:
            rate = _inference_text(record.asset_materialization.metadata)
    usage = usage_of(task_name, partition_keys, instance)
    used = f"; {usage.text()}" if usage is not None else ""
    text = f"{rows} rows, {counts.errors_text()}, {label_text}{rate}{used}"
    if rows and errors == rows:
        text += "; every record is an error (see the `error` column of validated_labels)"
    return text


def _inference_text(metadata) -> str:
    """The generation rate when this run inferred rows; where the rows came from when it inferred
    none (a rate over no inference would read as a stalled engine)."""

    def count(name: str) -> int:
        entry = metadata.get(name)
        return int(entry.value) if entry is not None and entry.value is not None else 0

    rate = metadata.get("generated_tokens_per_second")
    rows_rate = metadata.get("rows_per_second")
    if count("rows_inferred") and "dimension" in metadata and rows_rate is not None:  # embeddings
        return f", {rows_rate.value:.1f} rows/s embedded"
    if count("rows_inferred") and rate is not None:
        return f", {rate.value:.1f} generated tok/s"
    sources = [
        f"{count(name)} rows from {source}"
        for name, source in (("rows_from_cache", "the result cache"), ("rows_from_checkpoint", "checkpoints"))
        if count(name)
    ]
    return f", nothing inferred: {' and '.join(sources)}" if sources else ""


# Known failures, recognised in the error text, and what to set instead.
_HINTS = [
    (
        re.compile(r"max_model_len \((\d+)\) is greater than the derived max_model_len \(\w+=(\d+)"),
        "engine.max_model_len {0} is more than the model's context length ({1} tokens): set `engine.max_model_len` "
        "in the task file to at most {1}, or leave it out",
    ),
    (
        re.compile(r"Repo id must be in the form|is not a local folder and is not a valid model identifier"),
        "the model is neither an existing folder nor a Hugging Face id: set `engine.model` in the task file "
        "(or BATCH_ASSETS_MODEL)",
    ),
]


def failure_text(result: dg.ExecuteInProcessResult) -> str:
    """Why the run failed, in one line: the first failed step and a hint for a known failure, else
    the outermost error batch_assets raised (it names the setting), else the innermost error."""
    for event in result.all_events:
        failure = event.step_failure_data if event.is_step_failure else None
        if failure is None or failure.error is None:
            continue
        full = "\n".join(error.message for error in error_info_chain(failure.error))
        for pattern, advice in _HINTS:
            match = pattern.search(full)
            if match:
                return f"failed in {event.step_key}: {advice.format(*match.groups())}"
        return f"failed in {event.step_key}: {error_info_line(failure.error)}"
    return "run failed"


def failed_before_inference(result: dg.ExecuteInProcessResult) -> bool:
    """A failed run whose failure lies in one file's input (reading, formatting, a blocking check of
    its outputs), not in the engine: worth running file by file. An engine that cannot start or died
    would fail each file again, so those failures are reported as they are."""
    if result.success:
        return False
    failed_steps = [event.step_key or "" for event in result.all_events if event.is_step_failure]
    # The step itself, not its check `<task>__inference_outputs_outputs_satisfy_constraint`.
    return not any(step.endswith("__inference_outputs") for step in failed_steps)
