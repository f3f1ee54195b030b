"""A cascade task's frames: embedded rows in, labels by the teacher or the student out.

`cascade_outputs` turns one partition's embedding results into inference_outputs shaped as a choices
task's (the label in `generated_text`, the log of its confidence in `cumulative_logprob`, so
validation, accuracy, confidence and drift apply unchanged), with `labelled_by` (teacher or student),
`cascade_role` (sample, calibration, deferred, audit or student), `student_label` (the student's own label on
rows it labelled, audited ones included) and, on rows a chat teacher was asked about, what asking
cost (`teacher_prompt_tokens`, `teacher_generated_tokens`, `teacher_seconds`). `cascade_summary`
reads a partition's labels back into what the metadata and the `agreement_at_least` check report.
The cascade itself is pipeline/cascade/run.py.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import polars as pl

from batch_assets.pipeline.cascade.label_model import LabelModel
from batch_assets.pipeline.cascade.run import CascadeResult, TaskCascade, Teacher, TeacherAnswer, run_cascade
from batch_assets.pipeline.cascade.student import StoredStudent
from batch_assets.pipeline.cascade.summary import CascadeSummary, TeacherCost
from batch_assets.pipeline.inference_requests import InferenceStats
from batch_assets.pipeline.label_quality import error_code_counts
from batch_assets.pipeline.result_stores import RESULT_SCHEMA, vectors_column, vectors_matrix
from batch_assets.pipeline.task_spec import EngineSpec, OutputSpec, PriceSpec, TaskSpec
from batch_assets.pipeline.task_spec.cascade import CascadeSpec, ColumnTeacher
from batch_assets.pipeline.task_spec.engine import EMBEDDED_MODEL

# `teacher: llm`: (partition label, the rows asked about, with their input columns) → those rows'
# validated labels as a choices task's (`label`, `confidence`, `error`), in order, and the stats of
# the inference that gave them (result cache, checkpoints, rows inferred). lib/assets.py's
# `teacher_session` runs it through the normal inference path with the teacher's chat engine.
Teach = Callable[[str, pl.DataFrame], tuple[pl.DataFrame, InferenceStats]]
EMBEDDING_RESULTS = [c for c in RESULT_SCHEMA if c not in ("error", "num_prompt_tokens")]
TEACHER_STATS = ("rows_inferred", "rows_from_cache", "rows_from_checkpoint", "error_rows")
log = logging.getLogger(__name__)


def teacher_task(task: TaskSpec) -> TaskSpec:
    """The chat task `teacher: llm` asks: the cascade task's prompt, sampling and choices as a choices
    task (confidence from log-probabilities) on `teacher_model`, at the chat engine's default context."""
    cascade = task.output.cascade
    assert cascade is not None and cascade.teacher == "llm"
    engine = task.engine.model_copy(
        update={
            "model": cascade.teacher_model or EMBEDDED_MODEL,
            "max_model_len": EngineSpec.model_fields["max_model_len"].default,
        }
    )
    output = OutputSpec(kind="choices", choices=task.output.choices, confidence=True)
    return task.model_copy(update={"engine": engine, "output": output})


def llm_teacher(frame: pl.DataFrame, teach: Teach, source_file: str, counts: dict[str, int]) -> Teacher:
    """The teacher whose answers for rows of `frame` are the chat model's (through `teach`); a row
    the model gave no valid choice for is that row's error. `counts` adds up what the calls cost."""

    def answer(positions: np.ndarray) -> list[TeacherAnswer]:
        # The rows' inputs only: the embedding's results would shadow the teacher's when joined.
        labels, stats = teach(source_file, frame[positions.tolist()].drop(EMBEDDING_RESULTS, strict=False))
        for name in TEACHER_STATS:
            counts[name] = counts.get(name, 0) + getattr(stats, name)
        # Seconds per row the engine inferred (cached rows took none, and say nothing of the cost).
        seconds = stats.engine_seconds / stats.rows_inferred if stats.rows_inferred else None
        answers = []
        for label, confidence, error, prompt_tokens, generated_tokens in zip(
            labels["label"],
            labels["confidence"],
            labels["error"],
            labels["num_prompt_tokens"],
            labels["num_generated_tokens"],
            strict=True,
        ):
            valid = label is not None and error is None
            answer = (
                TeacherAnswer(label, None, 1.0 if confidence is None else float(confidence))
                if valid
                else TeacherAnswer(None, f"teacher_{error or 'error: the teacher gave no label'}")
            )
            answers.append(
                replace(
                    answer, prompt_tokens=prompt_tokens or 0, generated_tokens=generated_tokens or 0, seconds=seconds
                )
            )
        return answers

    return answer


def column_teacher(frame: pl.DataFrame, column: str, choices: Sequence[str], source_file: str) -> Teacher:
    """The teacher whose answer for a row is `column`'s value; an empty value or one that is not a
    choice is that row's error, naming file, line and column."""
    if column not in frame.columns:
        raise ValueError(
            f"{source_file}: output.cascade.teacher.column {column!r} is not a column of the file "
            f"(columns: {', '.join(c for c in frame.columns if c not in ('row_id', 'source_line', 'prompt'))})"
        )
    values = frame[column].cast(pl.String).to_list()
    lines = frame["source_line"].to_list()
    allowed = set(choices)

    def answer(positions: np.ndarray) -> list[TeacherAnswer]:
        answers = []
        for i in positions:
            value, line = values[i], lines[i]
            if value is None or not value.strip():
                error = f"teacher_no_label: {source_file} line {line}: the teacher column {column!r} is empty"
                answers.append(TeacherAnswer(None, error))
            elif value.strip() not in allowed:
                error = (
                    f"teacher_unknown_label: {source_file} line {line}: the teacher column {column!r} holds "
                    f"{value[:80]!r}, not one of output.choices"
                )
                answers.append(TeacherAnswer(None, error))
            else:
                answers.append(TeacherAnswer(value.strip()))
        return answers

    return answer


def cascade_outputs(
    results: pl.DataFrame,
    spec: CascadeSpec,
    choices: Sequence[str],
    source_file: str,
    teach: Teach | None = None,
    stored: StoredStudent | None = None,
    task: TaskCascade | None = None,
) -> tuple[pl.DataFrame, dict[str, Any]]:
    """One partition's embedding results → its inference_outputs (see the module) and what the
    cascade's run measured (the student's training; the teacher's calls; the stored label model it
    started from) for the metadata."""
    embedding = vectors_column(results["generated_text"])
    ok = embedding.is_not_null()
    embedded = results.filter(ok)
    counts: dict[str, int] = {}
    if isinstance(spec.teacher, ColumnTeacher):
        teacher = column_teacher(embedded, spec.teacher.column, choices, source_file)
    else:
        assert teach is not None  # the inference step opens the teacher's session for `teacher: llm`
        teacher = llm_teacher(embedded, teach, source_file, counts)
    unembedded = error_code_counts(results.filter(~ok))
    if task is not None:
        stored = task.stored
    result = run_cascade(vectors_matrix(embedding.filter(ok)), teacher, spec, choices, stored, unembedded, task)
    if result.target is not None and (refusal := result.target.refusal()):
        # Said as soon as it is known; the check agreement_target_met fails the partition by name.
        log.warning("%s: %s", source_file, refusal)
    positions = np.flatnonzero(ok.to_numpy())
    measured = {
        **result.metadata(),
        # Every row the teacher was asked about has its answer (and cost) in the result.
        "teacher_rows_asked": sum(answer is not None for answer in result.teacher_costs),
        **{f"teacher_{name}": counts.get(name, 0) for name in TEACHER_STATS if teach is not None},
        **(_usage(task.stored if task is not None else stored)),
    }
    return _with_cascade_columns(results, embedding, positions, result), measured


def _usage(stored: StoredStudent | None) -> dict[str, Any]:
    """What a partition records of the stored student it labelled with (its digest, its rows)."""
    if isinstance(stored, LabelModel):
        return stored.usage_metadata()
    return {}


def _with_cascade_columns(
    results: pl.DataFrame, embedding: pl.Series, positions: np.ndarray, result: CascadeResult
) -> pl.DataFrame:
    """The cascade's per-row answers placed on the partition's rows (error rows stay as they are)."""

    def placed(values: list[Any], dtype: pl.DataType) -> pl.Series:
        column: list[Any] = [None] * results.height
        for position, value in zip(positions, values, strict=True):
            column[position] = value
        return pl.Series(column, dtype=dtype)

    logprob = [None if p is None else (math.log(p) if p > 0 else -math.inf) for p in result.confidence]
    labelled = placed(result.labels, pl.String())
    costs = result.teacher_costs
    return results.with_columns(
        generated_text=labelled,
        finish_reason=pl.when(labelled.is_not_null()).then(pl.lit("stop")),
        num_generated_tokens=pl.when(labelled.is_not_null()).then(pl.lit(0, dtype=pl.Int64)),
        cumulative_logprob=placed(logprob, pl.Float64()),
        labelled_by=placed(result.labelled_by, pl.String()),
        cascade_role=placed(result.roles, pl.String()),
        student_label=placed(result.student_labels, pl.String()),
        teacher_prompt_tokens=placed([None if c is None else c.prompt_tokens for c in costs], pl.Int64()),
        teacher_generated_tokens=placed([None if c is None else c.generated_tokens for c in costs], pl.Int64()),
        teacher_seconds=placed([None if c is None else c.seconds for c in costs], pl.Float64()),
        error=pl.coalesce(pl.col("error"), placed(result.errors, pl.String())),
        embedding=embedding,
    )


def cascade_summary(
    labels: pl.DataFrame, price: PriceSpec | None = None, teacher_price: PriceSpec | None = None
) -> CascadeSummary:
    """What a partition's validated labels say of the cascade: who labelled how many rows, the audit
    (rows the student labelled and the teacher checked) agreement, and what the embedding (at
    `price`, the task's `prices.engine_price`) and the chat teacher (at `teacher_price`,
    `prices.teacher_price`; else in engine seconds) cost."""
    by = labels["labelled_by"]
    role = labels["cascade_role"]
    audit = labels.filter(role == "audit")
    return CascadeSummary(
        rows=labels.height,
        teacher_rows=int((by == "teacher").sum()),
        student_rows=int((by == "student").sum()),
        deferred_rows=int((role == "deferred").sum()),
        audited_rows=audit.height,
        audit_agreed=int((audit["label"] == audit["student_label"]).sum()),
        teacher_cost=_teacher_cost(labels),
        embedding_prompt_tokens=_embedded_tokens(labels),
        price=price,
        teacher_price=teacher_price,
    )


def _embedded_tokens(labels: pl.DataFrame) -> int:
    """The prompt tokens the embedding model was sent: the rows the cascade labelled or made error
    rows of its own (`cascade_*`, `teacher_*`); other error rows never reached it (a text too long, empty)."""
    if "num_prompt_tokens" not in labels.columns:
        return 0
    embedded = labels.filter(pl.col("error").is_null() | pl.col("error").str.contains(r"^(cascade|teacher)_"))
    return int(embedded["num_prompt_tokens"].sum() or 0)


def _teacher_cost(labels: pl.DataFrame) -> TeacherCost:
    """The chat teacher's tokens and seconds over the rows it was asked about (labels stored before
    they were recorded, and a column teacher's, have none)."""
    if "teacher_prompt_tokens" not in labels.columns:
        return TeacherCost()
    timed = labels["teacher_seconds"].drop_nulls()
    return TeacherCost(
        rows=int(labels["teacher_prompt_tokens"].is_not_null().sum()),
        prompt_tokens=int(labels["teacher_prompt_tokens"].sum() or 0),
        generated_tokens=int(labels["teacher_generated_tokens"].sum() or 0),
        timed_rows=timed.len(),
        seconds=float(timed.sum() or 0.0),
    )
