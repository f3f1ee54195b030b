"""What a cascade partition's labels report, pure: who labelled how many rows, the audit's agreement
with its 95 % Wilson interval, and what the labels cost against asking the teacher for every row
(`CascadeSummary`, read from validated_labels' columns by pipeline/cascade/labels.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from batch_assets.pipeline.prices import cost_usd
from batch_assets.pipeline.task_spec import PriceSpec

WILSON_Z = 1.959963984540054  # the 97.5th percentile of the normal distribution: a 95 % interval
# validated_labels' metadata: the share of all rows agreeing with the teacher as the audit estimates it.
ALL_ROWS_AGREEMENT_KEYS = ("all_rows_agreement", "all_rows_agreement_95_low", "all_rows_agreement_95_high")


def wilson_interval(successes: int, trials: int, z: float = WILSON_Z) -> tuple[float, float]:
    """The Wilson score interval of a proportion (95 % by default); (0, 1) with no trials. Written
    out: four lines, where statsmodels would be a dependency for one function."""
    if trials == 0:
        return 0.0, 1.0
    p = successes / trials
    denominator = 1 + z * z / trials
    centre = (p + z * z / (2 * trials)) / denominator
    half = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / denominator
    return max(0.0, centre - half), min(1.0, centre + half)


@dataclass(frozen=True)
class TeacherCost:
    """What a partition's teacher requests measured: over the `rows` a chat teacher was asked about,
    their tokens; over the `timed_rows` of calls that inferred, the engine seconds. A column teacher
    measures nothing (reading a column costs nothing)."""

    rows: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    timed_rows: int = 0
    seconds: float = 0.0


@dataclass(frozen=True)
class CascadeSummary:
    """What a partition's labels say of the cascade (from validated_labels' columns)."""

    rows: int
    teacher_rows: int
    student_rows: int
    deferred_rows: int
    audited_rows: int
    audit_agreed: int
    teacher_cost: TeacherCost = TeacherCost()
    embedding_prompt_tokens: int = 0
    # engine.price (prices.engine_price: a batch API's discount applied), the embedding model's. None:
    # no embedding cost.
    price: PriceSpec | None = None
    # output.cascade.teacher_price (prices.teacher_price), the chat teacher's. None: its cost in
    # engine seconds (a chat model's tokens do not cost what the embedding model's do).
    teacher_price: PriceSpec | None = None

    @property
    def teacher_share(self) -> float:
        return self.teacher_rows / self.rows if self.rows else 0.0

    @property
    def agreement(self) -> float | None:
        return self.audit_agreed / self.audited_rows if self.audited_rows else None

    @property
    def agreement_interval(self) -> tuple[float, float]:
        return wilson_interval(self.audit_agreed, self.audited_rows)

    def all_rows_agreement(self) -> tuple[float, float, float] | None:
        """The share of all rows whose label is the teacher's, estimated from the audit, with its 95 %
        interval (the audit's Wilson interval on the student's rows; teacher rows agree, error rows
        do not): what `output.cascade.target` guarantees a lower bound of. None with no audit."""
        if self.agreement is None or not self.rows:
            return None
        low, high = self.agreement_interval

        def of_all(share: float) -> float:
            return (self.teacher_rows + share * self.student_rows) / self.rows

        return of_all(self.agreement), of_all(low), of_all(high)

    def metadata(self) -> dict[str, Any]:
        low, high = self.agreement_interval
        return {
            "teacher_rows": self.teacher_rows,
            "student_rows": self.student_rows,
            "deferred_rows": self.deferred_rows,
            "deferred_share": round(self.deferred_rows / self.rows, 4) if self.rows else 0.0,
            "teacher_share": round(self.teacher_share, 4),
            # Teacher requests against one per row: the cost's share where each request costs the same.
            "cost_vs_all_teacher": round(self.teacher_share, 4),
            **self.cost_metadata(),
            "audited_rows": self.audited_rows,
            "audit_agreement": None if self.agreement is None else round(self.agreement, 4),
            "audit_agreement_95_low": round(low, 4),
            "audit_agreement_95_high": round(high, 4),
            **self.all_rows_metadata(),
        }

    def all_rows_metadata(self) -> dict[str, Any]:
        estimate = self.all_rows_agreement()
        if estimate is None:
            return {}
        return dict(zip(ALL_ROWS_AGREEMENT_KEYS, (round(value, 4) for value in estimate), strict=True))

    def _per_correct_label(self, cascade_usd: float, all_teacher_usd: float) -> dict[str, Any]:
        """Dollars per thousand labels that agree with the teacher: the cascade's (its rows agreeing as
        the audit estimates) and the teacher's alone (every row its own label). Empty with no audit."""
        estimate = self.all_rows_agreement()
        if estimate is None or not estimate[0]:
            return {}
        return {
            "cost_per_1000_correct_usd": round(cascade_usd / (estimate[0] * self.rows) * 1000, 6),
            "all_teacher_cost_per_1000_correct_usd": round(all_teacher_usd / self.rows * 1000, 6),
        }

    def cost_metadata(self) -> dict[str, Any]:
        """The labels' estimated cost against asking the teacher for every row. The embedding in
        dollars at `price`; the chat teacher in dollars at `teacher_price` (its tokens as used;
        all-teacher: their mean per asked row times the rows), and the two together, else in engine
        seconds (seconds per inferred teacher row times the rows asked, and all rows). Each price
        costs its own model's tokens alone. Empty for a column teacher without a price."""
        cost, rows = self.teacher_cost, self.rows
        spent: dict[str, Any] = {}
        if self.price is not None:
            spent["embedding_cost_usd"] = cost_usd(self.embedding_prompt_tokens, 0, self.price) or 0.0
        if self.teacher_price is not None and cost.rows:
            teacher = cost_usd(cost.prompt_tokens, cost.generated_tokens, self.teacher_price) or 0.0
            spent |= {"teacher_cost_usd": teacher, "all_teacher_cost_usd": round(teacher / cost.rows * rows, 6)}
            if self.price is not None:
                spent["cascade_cost_usd"] = round(teacher + spent["embedding_cost_usd"], 6)
                spent |= self._per_correct_label(spent["cascade_cost_usd"], spent["all_teacher_cost_usd"])
        elif cost.timed_rows:
            per_row = cost.seconds / cost.timed_rows
            spent |= {
                "teacher_engine_seconds": round(per_row * cost.rows, 3),
                "all_teacher_engine_seconds": round(per_row * rows, 3),
            }
        return spent
