"""The settings of `output.method: cascade` (`output.cascade`), and the rules they follow.

`OutputSpec` (output.py) only names `CascadeSpec` as a field and calls `cascade_problem` from its
validators: the cascade's settings and their defaults live here.

Defaults (measured by `bench/bench_cascade.py` on 20,000 generated rows with a perfect teacher:
accuracy 0.994 with the teacher on 21.4 % of rows; docs/cascade.md): a sample of 1,000 rows per
partition, about a hundred per label on nine labels; `defer_below: 0.6` sends the rows the student
is least sure of to the teacher; `max_teacher_share: 0.25` caps every teacher request (sample,
deferred and audit rows together) at a quarter of a partition's rows (the issue's target); 200 audit
rows measure agreement to about ±3 percentage points (the 95 % Wilson interval near 95 %).

`target` (`TargetSpec`) replaces the fixed `defer_below` by a threshold chosen once per task and
student version to meet a stated agreement with a stated confidence (pipeline/cascade/target.py); a
`defer_below` written beside it is a floor, and `on_unreachable` says what a partition whose budget
cannot pay for it does. Unset, both are left out of the code versions.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .base import _Strict
from .engine import PriceSpec

DEFAULT_SAMPLE_ROWS = 1000
DEFAULT_DEFER_BELOW = 0.6
DEFAULT_MAX_TEACHER_SHARE = 0.25
DEFAULT_AUDIT_ROWS = 200
DEFAULT_CALIBRATION_ROWS = 500
# The label model's training rows at most: logistic regression and its 3-fold calibration on 50,000
# rows take seconds to a minute, and 50,000 rows of 1,024-dimension float32 vectors are 200 MB held
# and stored; past a few thousand rows per label more rows change the student little.
DEFAULT_MAX_TRAINING_ROWS = 50_000
# `checks.min_agreement` when unset: the audit's 95 % lower bound under this fails the WARN check.
DEFAULT_MIN_AGREEMENT = 0.8


class ColumnTeacher(_Strict):
    """The teacher's answer for a row is this input column's value (hand labels, an earlier
    labelling pass; how the benchmark simulates a perfect teacher). Read only for the rows the
    cascade asks the teacher about."""

    column: str = Field(min_length=1)


class TargetSpec(_Strict):
    """`output.cascade.target`: the share of a partition's rows whose final label is the teacher's must
    be at least `agreement`, with probability at least `confidence` (pipeline/cascade/target.py)."""

    agreement: float = Field(gt=0, lt=1)
    confidence: float = Field(gt=0, lt=1)
    # Rows drawn at random from those the student did not train on, labelled by the teacher to choose
    # the threshold (once per student version, in the first partition it labels; at most what the
    # budget leaves after the sample). The bound's margin shrinks with it:
    # about +-2 points of agreement at 500 rows near 95 %.
    calibration_rows: int = Field(default=DEFAULT_CALIBRATION_ROWS, ge=1)


class CascadeSpec(_Strict):
    """`output.cascade`: who teaches, how many rows it labels, and when the student defers to it."""

    # `llm`: `teacher_model` (a chat model, on the task's engine kind) labels each row it is asked
    # about as a choices task of the same prompt (system prompt, template, examples) and choices.
    teacher: Literal["llm"] | ColumnTeacher
    # The chat model of `teacher: llm` (resolved as a chat task's `engine.model` is: BATCH_ASSETS_MODEL
    # or the engine resource's `model` take precedence, as for every chat task).
    teacher_model: str | None = None
    # What the chat teacher's tokens cost (`engine.price` is the embedding model's: a chat model's
    # tokens cost many times more). Without it the teacher's cost is in engine seconds, not dollars.
    teacher_price: PriceSpec | None = None
    # Rows per partition the teacher labels to train the student, chosen to cover the data (one
    # draw per embedding cluster, in proportion to its size), not the head of the file.
    sample_rows: int = Field(default=DEFAULT_SAMPLE_ROWS, ge=2)
    # A row the student labels with a (calibrated) confidence under this goes to the teacher...
    defer_below: float = Field(default=DEFAULT_DEFER_BELOW, ge=0, le=1)
    # ...or, with a target, under the threshold chosen to meet it (pipeline/cascade/target.py); a
    # `defer_below` written beside the target is then a floor: rows under it go to the teacher too.
    target: TargetSpec | None = None
    # ...within this share of the partition's rows for every teacher request together.
    max_teacher_share: float = Field(default=DEFAULT_MAX_TEACHER_SHARE, gt=0, le=1)
    # With a target, what a partition does when the budget cannot pay for the rows the target needs
    # deferred: `best_effort` defers the least sure rows the budget pays for (accuracy as high as the
    # budget allows; the check still fails, naming what the budget guarantees); `stop` asks the
    # teacher for nothing more, the student's labels stand. Without a target it plays no part.
    on_unreachable: Literal["best_effort", "stop"] = "best_effort"
    # Random student-labelled rows also sent to the teacher, to measure their agreement.
    audit_rows: int = Field(default=DEFAULT_AUDIT_ROWS, ge=0)
    # The `<task>/label_model` trains on at most this many teacher labels of its partitions: each
    # label keeps its share, spread evenly over the partitions (pipeline/cascade/label_model.py).
    max_training_rows: int = Field(default=DEFAULT_MAX_TRAINING_ROWS, ge=2)
    seed: int = 0


def cascade_problem(kind: str, method: str, cascade: CascadeSpec | None) -> tuple[str, tuple[str | int, ...]] | None:
    """Why the cascade settings of a task do not fit it (message, key of the setting), or None."""
    if method != "cascade":
        if cascade is not None:
            return (
                "output.cascade is read by output.method: cascade only: set it, or remove output.cascade",
                ("cascade",),
            )
        return None
    if kind != "choices":
        return (
            f"output.method cascade labels a choices task, not kind {kind!r}: set output.kind: choices with "
            "output.choices",
            ("method",),
        )
    if cascade is None:
        return (
            "output.method cascade needs output.cascade: {teacher: {column: NAME}} (who labels the sample)",
            ("method",),
        )
    for name in ("teacher_model", "teacher_price"):
        if getattr(cascade, name) is not None and cascade.teacher != "llm":
            return (
                f"output.cascade.{name} is the chat teacher's (teacher: llm); the teacher here is a column: "
                f"remove {name}, or set teacher: llm",
                ("cascade", name),
            )
    return None
