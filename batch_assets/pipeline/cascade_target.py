"""The cascade by target (`output.cascade.target`), pure: the deferral threshold chosen from held rows.

The user asks that the share of a partition's rows whose final label is the teacher's be at least
`agreement` (A), with probability at least `confidence` (C). The teacher labels a *calibration* set:
rows drawn at random from those the student did not train on. For a threshold t (the student keeps
rows with confidence >= t, the teacher labels the others), the final agreement of the N rows is

    teacher-labelled rows (the sample, the calibration rows, the deferred rows: they agree by definition)
    + the student-kept rows that agree.

The second term is the one unknown. Let P_t be the rows the student labelled (not its training rows)
with confidence >= t, calibration rows included: the calibration rows among them are a random sample
of P_t, so Clopper-Pearson's exact one-sided bound L_t (at level 1 - C, from scipy's beta
distribution) on their agreement bounds the agreement of P_t; sampling without replacement from a
finite P_t varies less than the binomial, so the bound is conservative. P_t's agreeing rows are then at
least L_t * |P_t|, of which the k_t agreeing calibration rows are teacher-labelled already, so

    lower_bound(t) = (teacher rows + max(0, L_t * |P_t| - k_t)) / N,

where |P_t| and the deferred rows come from every row's confidence, known exactly.

Choosing t after looking at many thresholds would spend the error probability once per look. Fixed-
sequence testing (the Learn-then-Test framework, Angelopoulos et al. 2021) does not: the thresholds are
ordered from strict (every row to the teacher) to lax, the null "agreement < A" is tested at each at
level 1 - C, and the walk stops at the first threshold whose bound falls under A; the last one passed is
chosen. The probability that the chosen threshold's agreement is under A is then at most 1 - C.

Assumptions: the rows are exchangeable and the calibration rows are drawn at random from the rows the
student did not train on (run_cascade draws them so); the teacher's label is the reference, so rows
the teacher labelled agree. A calibration row the teacher gave no label for is an error row: it counts
as disagreeing and is left out of the calibration sample.
"""

from __future__ import annotations

from dataclasses import dataclass
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
            f"leaves {self.budget}: the budget can guarantee {self.budget_bound:.1%} at that confidence: raise "
            "max_teacher_share, or lower the target"
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
        }


def known_agreement(target: TargetSpec, agreeing: int, rows: int, why: str, notes: tuple[str, ...]) -> TargetChoice:
    """The choice where the student labels no row (none could be trained, or the teacher labelled
    them all): the share agreeing with the teacher is known exactly, `agreeing` of `rows`. `why`
    says why no student labels, should that share miss the target."""
    share = agreeing / rows
    met = share >= target.agreement
    reason = f"{agreeing} of {rows} rows ({share:.1%}) have the teacher's label, the other {rows - agreeing} do not"
    return TargetChoice(target, None, share, 0, 0, 0, met, share, None if met else f"{reason}: {why}", notes)


def choose_threshold(
    confidence: np.ndarray,
    calibration: np.ndarray,
    agrees: np.ndarray,
    *,
    teacher_rows: int,
    rows: int,
    target: TargetSpec,
    budget: int,
) -> TargetChoice:
    """The laxest threshold that meets `target` by fixed-sequence testing (the module's bound).

    `confidence`: the student's confidence on each row it labelled (not its training rows);
    `calibration`: which of those the teacher labelled as the calibration sample (answered);
    `agrees`: on those, whether the student's label was the teacher's; `teacher_rows`: the rows
    labelled by the teacher outside these (the sample), which agree; `rows`: every row of the
    partition (error rows, those never embedded too, count as disagreeing); `budget`: the teacher
    rows left for deferral."""
    confidence = np.asarray(confidence, dtype=np.float64)
    order = np.argsort(-confidence, kind="stable")
    ranked = confidence[order]
    in_calibration = np.asarray(calibration, dtype=bool)[order]
    agreeing = np.asarray(agrees, dtype=bool)[order] & in_calibration
    # Cut j keeps the j most confident rows with the student (the ones not in the calibration set);
    # only cuts between distinct confidences are thresholds.
    cuts = np.arange(ranked.size + 1)
    valid = np.ones(ranked.size + 1, dtype=bool)
    valid[1:-1] = ranked[1:] != ranked[:-1]
    sampled = np.concatenate([[0], np.cumsum(in_calibration)])
    agreed = np.concatenate([[0], np.cumsum(agreeing)])
    deferred = int((~in_calibration).sum()) - (cuts - sampled)
    bound = clopper_pearson_lower(agreed, sampled, target.confidence)
    kept_agreeing = np.maximum(0.0, bound * cuts - agreed)
    lower = (teacher_rows + int(in_calibration.sum()) + deferred + kept_agreeing) / rows
    passing = lower[valid] >= target.agreement
    candidates = cuts[valid]
    # Fixed sequence: walk from strict to lax, stop at the first failure.
    failed = np.flatnonzero(~passing)
    last = (failed[0] if failed.size else passing.size) - 1
    chosen = int(candidates[max(last, 0)])
    affordable = candidates[deferred[candidates] <= budget]
    budget_cut = int(affordable[0]) if affordable.size else int(candidates[-1])
    met = last >= 0 and deferred[chosen] <= budget
    # Even the strictest threshold (every row the student labelled to the teacher) misses: the error
    # rows alone (calibration rows without a teacher label, rows outside `confidence`) cost too much.
    unreachable = (
        None
        if last >= 0
        else f"with every row the student labelled sent to the teacher, at most {lower[0]:.1%} of the rows would agree"
    )
    return TargetChoice(
        target=target,
        threshold=float(ranked[chosen - 1]) if chosen > 0 else None,
        lower_bound=float(lower[chosen]) if last >= 0 else float(lower[0]),
        deferred_rows=int(deferred[chosen]),
        calibration_rows=int(in_calibration.sum()),
        budget=budget,
        met=bool(met),
        budget_bound=float(lower[budget_cut]),
        reason=unreachable,
    )
