"""Calibrated confidence: how far a partition's `confidence` is from the share of its labels that are
right, measured on the rows with a gold label (`checks.gold_field`), and a calibration that closes
the gap (`output.calibrate: true`).

`calibration_report` gives the expected calibration error (ECE, 10 equal-width bins:
`expected_calibration_error`, by which the cascade's student is measured too) of the raw
confidence, and of the calibrated one **cross-validated**: each gold row's calibrated value comes
from a calibration fitted on the other folds, so the "after" number is not measured on the rows it
was fitted on.

The calibration is isotonic regression (scikit-learn) from the raw confidence to "the label is
right". Temperature scaling needs the probability of every choice; a partition keeps only the chosen
label's (its tokens' log-probabilities), so a monotone map of that one number is what can be
fitted. Being monotone, it keeps the order of the rows: the least sure labels stay the ones to read
first. `calibrate_confidence` fits it on all the partition's gold rows and maps every other labelled
row's `confidence` through it; a gold row gets its out-of-fold value (the report's folds), so its
stored confidence is not fitted on itself. The raw value is kept in `raw_confidence`. A partition with too few gold
rows keeps its raw confidence (the report says why).

scikit-learn is the `cascade` extra's: without it the report gives the raw confidence's error and a
note naming the extra (a gold field is a check any task may have), and `output.calibrate` fails its
run naming it (pipeline/extras.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import polars as pl

from batch_assets.pipeline.extras import CASCADE, MissingExtra, needs_extra
from batch_assets.pipeline.task_spec import TaskSpec

if TYPE_CHECKING:
    from sklearn.isotonic import IsotonicRegression

RAW_CONFIDENCE = "raw_confidence"
# Equal-width confidence bins of the expected calibration error (the cascade's student is measured so too).
ECE_BINS = 10
CALIBRATION_METHOD = "isotonic"
# Folds of the cross-validated "after" ECE; fewer gold rows than MIN_CALIBRATION_ROWS fit nothing
# (two per fold and bin would be too few to say anything).
FOLDS = 5
MIN_CALIBRATION_ROWS = 20


def expected_calibration_error(confidence: np.ndarray, correct: np.ndarray, bins: int = ECE_BINS) -> float | None:
    """ECE: over `bins` equal-width confidence bins, the row-weighted gap between each bin's mean
    confidence and its accuracy; None with no rows."""
    confidence = np.asarray(confidence, dtype=np.float64)
    correct = np.asarray(correct, dtype=np.float64)
    if confidence.size == 0:
        return None
    # Bin i holds (i/bins, (i+1)/bins]; a confidence of exactly 0 goes into the first.
    index = np.clip(np.ceil(confidence * bins).astype(int) - 1, 0, bins - 1)
    total = 0.0
    for b in range(bins):
        members = index == b
        if members.any():
            total += members.sum() * abs(confidence[members].mean() - correct[members].mean())
    return float(total / confidence.size)


@dataclass(frozen=True)
class CalibrationReport:
    rows: int  # gold rows with a label and a confidence
    ece_before: float | None  # of the raw confidence; None with no such row
    ece_after: float | None  # of the calibrated confidence, cross-validated; None when too few rows
    note: str | None = None

    def metadata(self) -> dict[str, Any]:
        metadata: dict[str, Any] = {"calibration_rows": self.rows}
        if self.ece_before is not None:
            metadata["calibration_error_raw"] = round(self.ece_before, 4)
        if self.ece_after is not None:
            metadata["calibration_error_calibrated"] = round(self.ece_after, 4)
            metadata["calibration_method"] = CALIBRATION_METHOD
        if self.note:
            metadata["calibration_note"] = self.note
        return metadata


def _gold_rows(labels: pl.DataFrame, gold_field: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The raw confidence of each gold row with a label and a confidence, whether its label is right
    (compared as text with surrounding spaces removed, as accuracy is), and its position in `labels`."""
    raw = RAW_CONFIDENCE if RAW_CONFIDENCE in labels.columns else "confidence"
    if gold_field not in labels.columns or raw not in labels.columns:
        return np.zeros(0), np.zeros(0), np.zeros(0, dtype=np.int64)
    gold = pl.col(gold_field).cast(pl.String).str.strip_chars()
    rows = (
        labels.with_row_index("position")
        .select(
            "position",
            confidence=pl.col(raw),
            correct=gold == pl.col("label").cast(pl.String).str.strip_chars(),
            gold=gold,
        )
        .filter(pl.col("gold").is_not_null() & (pl.col("gold") != "") & pl.col("confidence").is_not_null())
    )
    return (
        rows["confidence"].to_numpy().astype(np.float64),
        rows["correct"].to_numpy().astype(np.float64),
        rows["position"].to_numpy().astype(np.int64),
    )


def _held_out(confidence: np.ndarray, correct: np.ndarray) -> np.ndarray:
    """Each gold row's calibrated confidence from a calibration fitted on the other folds."""
    with needs_extra(CASCADE):
        from sklearn.model_selection import KFold, cross_val_predict

    return cross_val_predict(_isotonic(), confidence, correct, cv=KFold(FOLDS, shuffle=True, random_state=0))


def _isotonic() -> IsotonicRegression:
    with needs_extra(CASCADE):
        from sklearn.isotonic import IsotonicRegression

    return IsotonicRegression(y_min=0.0, y_max=1.0, out_of_bounds="clip")


def calibration_report(labels: pl.DataFrame, gold_field: str) -> CalibrationReport | None:
    """ECE of the partition's confidence before and (cross-validated) after calibration; None when
    the frame has no confidence or no gold column."""
    if gold_field not in labels.columns or "confidence" not in labels.columns:
        return None
    confidence, correct, _ = _gold_rows(labels, gold_field)
    before = expected_calibration_error(confidence, correct)
    if confidence.size < MIN_CALIBRATION_ROWS:
        note = (
            f"{confidence.size} gold rows with a label and a confidence: a calibration needs at least "
            f"{MIN_CALIBRATION_ROWS}"
        )
        return CalibrationReport(int(confidence.size), before, None, note)
    try:
        held_out = _held_out(confidence, correct)
    except MissingExtra:
        note = f"the calibrated error needs scikit-learn: install {CASCADE.install}"
        return CalibrationReport(int(confidence.size), before, None, note)
    return CalibrationReport(int(confidence.size), before, expected_calibration_error(held_out, correct))


def calibrate_confidence(labels: pl.DataFrame, gold_field: str) -> pl.DataFrame:
    """`confidence` mapped through an isotonic calibration fitted on the partition's gold rows, the
    raw value kept in `raw_confidence`; with too few gold rows both are the raw value."""
    if "confidence" not in labels.columns:
        return labels
    # Just before `confidence`, so the trailing columns that readers rely on keep their places.
    columns = [c for c in labels.columns if c != RAW_CONFIDENCE]
    at = columns.index("confidence")
    columns[at:at] = [RAW_CONFIDENCE]
    labels = labels.with_columns(pl.col("confidence").alias(RAW_CONFIDENCE)).select(columns)
    confidence, correct, gold = _gold_rows(labels, gold_field)
    if confidence.size < MIN_CALIBRATION_ROWS:
        return labels
    fitted = _isotonic().fit(confidence, correct)
    raw = labels[RAW_CONFIDENCE]
    measured = raw.is_not_null().to_numpy()
    mapped = np.full(labels.height, np.nan)
    mapped[measured] = fitted.predict(raw.drop_nulls().to_numpy().astype(np.float64))
    # A gold row mapped by a fit on itself would look better calibrated than it is: it gets its
    # out-of-fold value, the one the report's "after" number is measured on.
    mapped[gold] = _held_out(confidence, correct)
    calibrated = pl.Series("confidence", mapped, dtype=pl.Float64).fill_nan(None)
    return labels.with_columns(calibrated)


def calibrated_labels(labels: pl.DataFrame, task: TaskSpec) -> pl.DataFrame:
    """A partition's validated_labels as the task asks: calibrated with `output.calibrate: true`."""
    if not task.output.calibrate or not task.checks.gold_field:
        return labels
    return calibrate_confidence(labels, task.checks.gold_field)
