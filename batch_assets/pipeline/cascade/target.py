"""The cascade by target (`output.cascade.target`), pure: one threshold per task and student version,
chosen on a calibration set, and what it guarantees for every partition that student labels.

The user asks that the share of rows whose final label is the teacher's be at least `agreement` (A),
with probability at least `confidence` (C). A student version (the task's stored student, named by
the digest of its training rows) is calibrated once: the teacher labels a *calibration* set, rows
drawn at random from those of one partition the student did not train on (`calibrate`). Every later
partition the same version labels reuses its threshold t (the student keeps rows with confidence
>= t, the teacher labels the others) and pays only its deferred rows and its audit.

**The threshold.** For a threshold t let p_t be the probability that a row the student keeps at t
agrees with the teacher, and q_t the share of rows it keeps. A row the teacher labels agrees, so the
expected share of rows agreeing is 1 - q_t (1 - p_t), at least A when p_t >= r_t = 1 - (1 - A) / q_t.
q_t is measured on the calibrating partition's rows (every row's confidence is known) and taken at its
upper 97.5 % Clopper-Pearson end, so that a later partition keeping a little more than the calibrating
one still meets A. The null "p_t < r_t" is tested at each t by Clopper-Pearson's exact one-sided lower
bound L_t on the calibration rows the student keeps (scipy's beta distribution, level 1 - C): rejected
when L_t >= r_t. Choosing t after many looks would spend the error probability once per look;
**fixed-sequence testing** (Learn then Test, Angelopoulos et al. 2021) does not: the thresholds are
walked from strict (every row to the teacher) to lax and the walk stops at the first whose null
stands. With probability at least C, then, p_t >= r_t at the chosen t (`Calibration.kept_bound`).

**What it guarantees.** On that event every partition the student version labels, and all of them
together, has an expected share of rows agreeing of at least

    bound = (teacher-labelled rows + r_t * rows the student kept at confidence >= t) / rows,

computed with each partition's exact counts (`partition_bound`); rows the student kept under t
(a partition whose budget could not pay for all its deferred rows: best effort) and error rows count
as disagreeing. One event covers every partition of the version: the per-partition figures are not
independent chances, the calibration draw is the one chance of 1 - C.

**A budget that cannot pay** for a partition's rows under t: by default (`on_unreachable:
best_effort`) the least sure rows the budget pays for go to the teacher; the partition's figure is
then what the budget guarantees: at the budget's own threshold t_b (fixed by the confidences and the
budget, not by any teacher label, so one test), the Clopper-Pearson bound L_{t_b} of the calibration
rows kept at t_b (`Calibration.rate_bound_at`). `on_unreachable: stop` asks the teacher for nothing
more (the student's labels stand).

Assumptions: the rows are exchangeable across the partitions the version labels (their order and
their file say nothing about their labels), the calibration rows are drawn at random from the rows
the student did not train on (run_cascade draws them so), and the teacher's label is the reference.
The bound is on the expected share: a partition's realized share varies around it by about
sqrt(q (1 - q) / rows). A calibration row the teacher gave no label for is left out of the sample.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from batch_assets.pipeline.extras import CASCADE, needs_extra
from batch_assets.pipeline.task_spec.cascade import TargetSpec


def clopper_pearson_lower(successes: np.ndarray, trials: np.ndarray, confidence: float) -> np.ndarray:
    """The exact one-sided lower bound on a proportion, at `confidence`, for each pair (0 with no
    successes or no trials)."""
    with needs_extra(CASCADE):  # scipy, imported by the runs that choose a threshold
        from scipy.stats import beta

    successes = np.asarray(successes, dtype=np.float64)
    trials = np.asarray(trials, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        low = beta.ppf(1 - confidence, successes, trials - successes + 1)
    return np.where(successes > 0, np.nan_to_num(low, nan=0.0), 0.0)


@dataclass(frozen=True)
class TargetChoice:
    """The threshold chosen for a target, what it guarantees, and whether the budget allows it."""

    target: TargetSpec
    # The student keeps its label at a confidence of at least this; None: it keeps none.
    threshold: float | None
    # The share of all rows agreeing with the teacher, guaranteed at the target's confidence.
    lower_bound: float
    # Rows the threshold sends to the teacher besides the sample and the calibration rows.
    deferred_rows: int
    calibration_rows: int
    # The teacher rows the budget left for deferral.
    budget: int
    # False: the target is not met. With no `reason`, the budget cannot pay for the threshold the
    # target needs; `budget_bound` is then what the budget's own threshold guarantees at the target's
    # confidence, and nothing more was asked.
    met: bool
    budget_bound: float
    # Why the target is not met when the budget is not the cause: no student could be trained (too
    # few rows, a sample of one label), the error rows alone miss it, the teacher failed on deferred rows.
    reason: str | None = None
    # What else the user needs to see beside the cause (the teacher's failures, rows never embedded).
    notes: tuple[str, ...] = ()
    # Refused by the budget: True when its rows were deferred all the same (on_unreachable: best_effort).
    best_effort: bool = False
    # The chance that a row the student keeps agrees, at least (with probability `confidence`), and the
    # student version calibrated and the partition it was calibrated on.
    kept_bound: float | None = None
    student_version: str | None = None
    calibrated_in: str | None = None

    def refusal(self) -> str | None:
        """Why the target was not met (naming what the budget can meet), or None when it was met."""
        if self.met:
            return None
        target = self.target
        asked = f"output.cascade.target agreement {target.agreement:.1%} at confidence {target.confidence:.0%}"
        cause = (
            f"{asked} is not met: {self.reason}"
            if self.reason
            else f"{asked} needs {self.deferred_rows} rows deferred to the teacher, output.cascade.max_teacher_share "
            f"leaves {self.budget}: the budget can guarantee {self.budget_bound:.1%} at that confidence"
            + (
                f" (best effort: the {self.budget} least sure rows went to the teacher)"
                if self.best_effort
                else " (on_unreachable: stop: nothing more was asked)"
            )
            + ": raise max_teacher_share, or lower the target"
        )
        return "; ".join((cause, *self.notes))

    def metadata(self) -> dict[str, Any]:
        return {
            "target_agreement": self.target.agreement,
            "target_confidence": self.target.confidence,
            "target_met": self.met,
            "target_threshold": None if self.threshold is None else round(self.threshold, 4),
            "target_lower_bound": round(self.lower_bound if self.met else self.budget_bound, 4),
            "target_calibration_rows": self.calibration_rows,
            **({"target_refused": self.refusal()} if not self.met else {}),
            **({"target_best_effort": True} if self.best_effort else {}),
            **({"target_kept_bound": round(self.kept_bound, 4)} if self.kept_bound is not None else {}),
            **({"target_student_version": self.student_version} if self.student_version else {}),
            **({"target_calibrated_in": self.calibrated_in} if self.calibrated_in else {}),
        }


def known_agreement(target: TargetSpec, agreeing: int, rows: int, why: str, notes: tuple[str, ...]) -> TargetChoice:
    """The choice where the student labels no row (none could be trained, or the teacher labelled
    them all): the share agreeing with the teacher is known exactly, `agreeing` of `rows`. `why`
    says why no student labels, should that share miss the target."""
    share = agreeing / rows
    met = share >= target.agreement
    reason = f"{agreeing} of {rows} rows ({share:.1%}) have the teacher's label, the other {rows - agreeing} do not"
    return TargetChoice(target, None, share, 0, 0, 0, met, share, None if met else f"{reason}: {why}", notes)


def clopper_pearson_upper(successes: np.ndarray, trials: np.ndarray, confidence: float) -> np.ndarray:
    """The exact one-sided upper bound on a proportion, at `confidence` (1 with all successes)."""
    with needs_extra(CASCADE):
        from scipy.stats import beta

    successes = np.asarray(successes, dtype=np.float64)
    trials = np.asarray(trials, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        high = beta.ppf(confidence, successes + 1, trials - successes)
    return np.where(successes < trials, np.nan_to_num(high, nan=1.0), 1.0)


# The kept share q_t is taken at this one-sided upper end: a later partition that keeps a little more
# than the calibrating one (sampling) still meets the target.
KEPT_SHARE_CONFIDENCE = 0.975


@dataclass(frozen=True)
class Calibration:
    """One student version's calibration: the threshold, what it guarantees of a kept row, and the
    calibration rows themselves (each one's confidence and whether the student agreed with the
    teacher), kept so a partition whose budget cannot pay for the threshold can say what its own can."""

    student_version: str  # the digest of the student's training rows
    agreement: float
    confidence: float
    threshold: float | None  # the student keeps confidence >= it; None: it keeps none
    kept_bound: float  # r_t: a kept row agrees with at least this chance (with probability `confidence`)
    confidences: tuple[float, ...] = field(repr=False)
    agrees: tuple[bool, ...] = field(repr=False)
    partition: str = ""  # where the calibration rows were drawn

    @property
    def rows(self) -> int:
        return len(self.confidences)

    def matches(self, student_version: str, target: TargetSpec) -> bool:
        """Calibrated for this student version and this target (agreement and confidence)."""
        return (self.student_version, self.agreement, self.confidence) == (
            student_version,
            target.agreement,
            target.confidence,
        )

    def rate_bound_at(self, threshold: float | None) -> float:
        """Clopper-Pearson's lower bound (at `confidence`) on the agreement of the rows kept at
        `threshold`, from the calibration rows kept there: one test, for a threshold chosen without
        looking at the teacher's labels (the budget's)."""
        if threshold is None:
            return 1.0
        kept = np.asarray(self.confidences) >= threshold
        agreed = int(np.asarray(self.agrees, dtype=bool)[kept].sum())
        return float(clopper_pearson_lower(np.array([agreed]), np.array([int(kept.sum())]), self.confidence)[0])

    def to_json(self) -> bytes:
        fields = {name: getattr(self, name) for name in self.__dataclass_fields__}
        return json.dumps({**fields, "confidences": list(self.confidences), "agrees": list(self.agrees)}).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Calibration:
        values = json.loads(data)
        values["confidences"] = tuple(float(c) for c in values["confidences"])
        values["agrees"] = tuple(bool(a) for a in values["agrees"])
        return cls(**values)


def calibrate(
    confidence: np.ndarray,
    calibration: np.ndarray,
    agrees: np.ndarray,
    target: TargetSpec,
    student_version: str,
    partition: str = "",
) -> Calibration:
    """The laxest threshold that meets `target` by fixed-sequence testing (the module's test).

    `confidence`: the student's confidence on each row of the calibrating partition it did not train
    on; `calibration`: which of those the teacher labelled as the calibration sample (answered);
    `agrees`: on those, whether the student's label was the teacher's."""
    confidence = np.asarray(confidence, dtype=np.float64)
    order = np.argsort(-confidence, kind="stable")
    ranked = confidence[order]
    in_calibration = np.asarray(calibration, dtype=bool)[order]
    agreeing = np.asarray(agrees, dtype=bool)[order] & in_calibration
    rows = ranked.size
    # Cut j keeps the j most confident rows; only cuts between distinct confidences are thresholds.
    cuts = np.arange(rows + 1)
    valid = np.ones(rows + 1, dtype=bool)
    valid[1:-1] = ranked[1:] != ranked[:-1]
    sampled = np.concatenate([[0], np.cumsum(in_calibration)])
    agreed = np.concatenate([[0], np.cumsum(agreeing)])
    kept_share = clopper_pearson_upper(cuts, np.full(cuts.size, max(rows, 1)), KEPT_SHARE_CONFIDENCE)
    with np.errstate(divide="ignore"):
        required = np.where(cuts > 0, 1 - (1 - target.agreement) / kept_share, -np.inf)
    passing = clopper_pearson_lower(agreed, sampled, target.confidence)[valid] >= required[valid]
    candidates = cuts[valid]
    # Fixed sequence: walk from strict to lax, stop at the first null that stands (cut 0, keeping no
    # row, always passes).
    failed = np.flatnonzero(~passing)
    chosen = int(candidates[(failed[0] if failed.size else passing.size) - 1])
    return Calibration(
        student_version=student_version,
        agreement=target.agreement,
        confidence=target.confidence,
        threshold=float(ranked[chosen - 1]) if chosen > 0 else None,
        kept_bound=float(min(1.0, max(0.0, required[chosen]))) if chosen > 0 else 1.0,
        confidences=tuple(float(c) for c in confidence[np.asarray(calibration, dtype=bool)]),
        agrees=tuple(bool(a) for a in np.asarray(agrees, dtype=bool)[np.asarray(calibration, dtype=bool)]),
        partition=partition,
    )


def partition_bound(
    teacher_rows: int, kept_confidence: np.ndarray, rows: int, rate: float, threshold: float | None
) -> float:
    """The expected share of `rows` agreeing, at least: the teacher's rows, and `rate` of the rows the
    student kept at confidence >= `threshold` (`kept_confidence`: every row it kept); rows it kept
    under the threshold and error rows count as disagreeing."""
    if not rows:
        return 0.0
    above = 0 if threshold is None else int((np.asarray(kept_confidence) >= threshold).sum())
    return (teacher_rows + rate * above) / rows


@dataclass(frozen=True)
class PartitionFigures:
    """What one partition labelled with a student version, for the task-level figures: its rows, the
    teacher's rows, and the rows agreeing at least (the teacher's, and the kept-row bound times the
    rows the student kept at the threshold: pipeline/cascade/target.py)."""

    rows: int
    teacher_rows: int
    student_rows: int
    bounded_agreeing: float
    confidence: float
    # What its labels cost in dollars (the embedding and the chat teacher, both priced), once known.
    cost_usd: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


@dataclass(frozen=True)
class TaskFigures:
    """A student version's figures over every partition it labelled: the guarantee's scale."""

    student_version: str
    partitions: int
    rows: int
    teacher_rows: int
    lower_bound: float
    confidence: float
    # Dollars per 1,000 rows guaranteed to agree (the bound's), when every partition's cost is known.
    cost_per_1000_correct_usd: float | None = None

    @classmethod
    def of(cls, student_version: str, every: Sequence[PartitionFigures]) -> TaskFigures:
        rows = sum(f.rows for f in every)
        agreeing = sum(f.bounded_agreeing for f in every)
        confidence = min((f.confidence for f in every), default=0.0)
        teacher = sum(f.teacher_rows for f in every)
        costs = [f.cost_usd for f in every]
        per_1000 = (
            sum(c for c in costs if c is not None) / agreeing * 1000
            if costs and agreeing and all(c is not None for c in costs)
            else None
        )
        bound = agreeing / rows if rows else 0.0
        return cls(student_version, len(every), rows, teacher, bound, confidence, per_1000)

    def metadata(self) -> dict[str, Any]:
        return {
            "task_student_version": self.student_version,
            "task_partitions": self.partitions,
            "task_rows": self.rows,
            "task_teacher_rows": self.teacher_rows,
            "task_teacher_share": round(self.teacher_rows / self.rows, 4) if self.rows else 0.0,
            "task_lower_bound": round(self.lower_bound, 4),
            "task_confidence": self.confidence,
            **(
                {"task_cost_per_1000_correct_usd": round(self.cost_per_1000_correct_usd, 6)}
                if self.cost_per_1000_correct_usd is not None
                else {}
            ),
        }
