"""How good and how steady a partition's labels are: accuracy against known labels, the model's
confidence in them, drift from the task's recent partitions. Pure functions over `validated_labels`
frames and label counts.

Accuracy: the share of rows with a non-empty gold value whose label equals it (both compared as
text with surrounding spaces removed; an error row counts as wrong), per-label precision, recall
and support, and a confusion table (gold label by row, predicted label by column; given the task's
choices, every choice is a column, predicted or not).

Confidence: of the labelled rows, how many have a `confidence` under the task's `min_confidence`
(rows the model was unsure of: the ones to read first), and how many have none (the engine gave no
log-probabilities).

Drift: the total variation distance between the partition's label shares and the pooled shares of
the recent partitions, 0 (same distribution) to 1 (no label in common), and the labels that moved.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import polars as pl

NO_LABEL = "(error)"  # the predicted column of rows that got no label
MOVED_SHARE = 0.05  # a label "moved" when its share changed by at least this much


def error_code_counts(frame: pl.DataFrame) -> dict[str, int]:
    """Error rows by the code their `error` starts with (`other` for an error without one), by code."""
    codes = frame.filter(pl.col("error").is_not_null()).select(
        pl.col("error").str.extract(r"^([a-z_]+):", 1).alias("code")
    )
    return {
        row["code"] or "other": row["count"] for row in codes.group_by("code").len(name="count").sort("code").to_dicts()
    }


@dataclass(frozen=True)
class LabelScore:
    label: str
    precision: float | None  # None when the label was never predicted
    recall: float | None  # None when no gold row has the label
    support: int  # gold rows with this label


@dataclass(frozen=True)
class AccuracyReport:
    rows_with_gold: int
    correct: int
    per_label: list[LabelScore]
    confusion: dict[str, dict[str, int]]  # gold label -> predicted label (or NO_LABEL) -> rows
    choices: tuple[str, ...] = ()  # the task's closed label set, in its order (empty: open labels)

    @property
    def accuracy(self) -> float:
        return self.correct / self.rows_with_gold if self.rows_with_gold else 0.0

    def _ordered(self, labels: set[str]) -> list[str]:
        """The task's choices in their order, then any other label sorted, `(error)` last."""
        others = sorted(labels - set(self.choices) - {NO_LABEL})
        return [*self.choices, *others, *([NO_LABEL] if NO_LABEL in labels else [])]

    def confusion_markdown(self) -> str:
        """Gold label by row, predicted label by column: every choice is a column (a choice never
        predicted shows its zeros), then other predictions, then `(error)` for rows without a label."""
        predicted = self._ordered({p for row in self.confusion.values() for p in row})
        lines = [
            "| gold \\ predicted | " + " | ".join(_cell(p) for p in predicted) + " |",
            "|" + "---|" * (len(predicted) + 1),
        ]
        for gold in [g for g in self._ordered(set(self.confusion)) if g in self.confusion]:
            lines.append(
                f"| {_cell(gold)} | " + " | ".join(str(self.confusion[gold].get(p, 0)) for p in predicted) + " |"
            )
        return "\n".join(lines)

    def per_label_metadata(self) -> dict[str, dict]:
        return {
            score.label: {
                "precision": None if score.precision is None else round(score.precision, 4),
                "recall": None if score.recall is None else round(score.recall, 4),
                "support": score.support,
            }
            for score in self.per_label
        }

    def per_label_records(self) -> list[dict[str, str | int | float | None]]:
        """`per_label_metadata` as table rows: label, precision, recall, support (None: undefined)."""
        return [{"label": label, **scores} for label, scores in self.per_label_metadata().items()]


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _json_field(label: str | None, name: str) -> str | None:
    if label is None:
        return None
    value = json.loads(label)
    if not isinstance(value, dict) or name not in value or value[name] is None:
        return None
    found = value[name]
    return found if isinstance(found, str) else json.dumps(found)


def accuracy_report(
    labels: pl.DataFrame, gold_field: str, gold_json_field: str | None = None, choices: Sequence[str] = ()
) -> AccuracyReport | None:
    """Accuracy of `label` against the input column `gold_field`; None when the partition has no
    such column or no row with a gold value. JSON tasks compare the label's `gold_json_field`.
    `choices` (a choices task's label set) orders the labels and makes each a confusion column and
    a `per_label` row, predicted or not."""
    if gold_field not in labels.columns:
        return None
    gold = labels[gold_field].cast(pl.String).str.strip_chars()
    predicted = labels["label"]
    if gold_json_field is not None:
        predicted = pl.Series([_json_field(v, gold_json_field) for v in predicted], dtype=pl.String)
    frame = pl.DataFrame({"gold": gold, "predicted": predicted.cast(pl.String).str.strip_chars()}).filter(
        pl.col("gold").is_not_null() & (pl.col("gold") != "")
    )
    if frame.height == 0:
        return None
    frame = frame.with_columns(pl.col("predicted").fill_null(NO_LABEL))
    correct = int((frame["gold"] == frame["predicted"]).sum())
    confusion: dict[str, dict[str, int]] = {}
    for row in frame.group_by("gold", "predicted").len(name="rows").to_dicts():
        confusion.setdefault(row["gold"], {})[row["predicted"]] = int(row["rows"])
    support = {g: sum(row.values()) for g, row in confusion.items()}
    predicted_totals: dict[str, int] = {}
    for row in confusion.values():
        for label, count in row.items():
            predicted_totals[label] = predicted_totals.get(label, 0) + count
    scores = []
    report = AccuracyReport(frame.height, correct, [], confusion, tuple(choices))
    for label in report._ordered(set(support) | set(predicted_totals) | set(choices)):
        if label == NO_LABEL:
            continue
        hits = confusion.get(label, {}).get(label, 0)
        scores.append(
            LabelScore(
                label,
                precision=hits / predicted_totals[label] if predicted_totals.get(label) else None,
                recall=hits / support[label] if support.get(label) else None,
                support=support.get(label, 0),
            )
        )
    return replace(report, per_label=scores)


@dataclass(frozen=True)
class ConfidenceReport:
    labelled_rows: int
    measured_rows: int  # labelled rows with a confidence
    low_rows: int  # measured rows under `min_confidence`
    median: float | None

    @property
    def unmeasured_rows(self) -> int:
        return self.labelled_rows - self.measured_rows

    @property
    def low_share(self) -> float:
        """Share of the measured rows under `min_confidence` (0 when none was measured)."""
        return self.low_rows / self.measured_rows if self.measured_rows else 0.0

    def metadata(self) -> dict[str, int | float | None]:
        """What the asset and its check record; empty when no row was measured."""
        if not self.measured_rows:
            return {}
        return {
            "confidence_median": None if self.median is None else round(self.median, 4),
            "low_confidence_rows": self.low_rows,
            "low_confidence_share": round(self.low_share, 4),
        }


def confidence_report(labels: pl.DataFrame, min_confidence: float) -> ConfidenceReport | None:
    """None when the partition has no `confidence` column (a task without one)."""
    if "confidence" not in labels.columns:
        return None
    labelled = labels.filter(pl.col("label").is_not_null())
    measured = labelled["confidence"].drop_nulls()
    median = measured.median()
    return ConfidenceReport(
        labelled_rows=labelled.height,
        measured_rows=measured.len(),
        low_rows=int((measured < min_confidence).sum()),
        median=None if median is None else float(median),  # type: ignore[arg-type]  # a float for a Float64 series
    )


@dataclass(frozen=True)
class DriftReport:
    distance: float  # total variation distance, 0..1
    partitions_compared: int
    shares: dict[str, float]  # this partition
    reference_shares: dict[str, float]  # the recent partitions, pooled
    moved: list[str] = field(default_factory=list)  # labels whose share changed by >= MOVED_SHARE, largest first

    def moved_text(self) -> str:
        return ", ".join(
            f"{label} {self.reference_shares.get(label, 0):.0%} -> {self.shares.get(label, 0):.0%}"
            for label in self.moved
        )


def _shares(counts: dict[str, int]) -> dict[str, float]:
    total = sum(counts.values())
    return {label: count / total for label, count in counts.items()} if total else {}


def label_drift(counts: dict[str, int], history: list[dict[str, int]]) -> DriftReport | None:
    """Drift of one partition's label counts from the pooled counts of earlier partitions; None when
    there is nothing to compare (no history, or no labelled row on either side)."""
    pooled: dict[str, int] = {}
    for earlier in history:
        for label, count in earlier.items():
            pooled[label] = pooled.get(label, 0) + count
    shares, reference = _shares(counts), _shares(pooled)
    if not shares or not reference:
        return None
    changes = {label: shares.get(label, 0.0) - reference.get(label, 0.0) for label in set(shares) | set(reference)}
    distance = 0.5 * sum(abs(change) for change in changes.values())
    moved = sorted(
        (label for label, change in changes.items() if abs(change) >= MOVED_SHARE),
        key=lambda label: (-abs(changes[label]), label),
    )
    return DriftReport(round(distance, 4), len(history), shares, reference, moved)


def label_counts(labels: pl.DataFrame) -> dict[str, int]:
    """Rows per label (null labels left out), the most frequent first."""
    counts = (
        labels.filter(pl.col("label").is_not_null()).group_by("label").len(name="count").sort("count", descending=True)
    )
    return {str(row["label"]): int(row["count"]) for row in counts.to_dicts()}
