"""`checks:` and `budget:`: what a partition is checked against, before the engine (budget) and
after it (error share, label drift, accuracy, confidence)."""

from __future__ import annotations

from pydantic import Field

from .base import _Strict


class BudgetSpec(_Strict):
    """Limits per partition, checked on `formatted_prompts` before anything reaches the engine.
    Generated tokens are counted at their worst case: every row runs to `sampling.max_tokens`."""

    max_prompt_tokens: int | None = Field(default=None, ge=0, strict=True)
    max_generated_tokens: int | None = Field(default=None, ge=0, strict=True)
    max_cost_usd: float | None = Field(default=None, ge=0, allow_inf_nan=False, strict=True)


class ChecksSpec(_Strict):
    # Share of rows allowed to carry an `error` before the WARN check fails.
    max_error_share: float = Field(default=0.05, ge=0, le=1)
    # Total variation distance (0..1) between a partition's label shares and those of the task's
    # recent partitions above which the WARN check `label_drift` fails (choices and regex tasks).
    max_label_drift: float = Field(default=0.25, ge=0, le=1)
    # Recent partitions the drift check compares with.
    drift_history: int = Field(default=5, ge=1)
    # An input column holding the known label: `validated_labels` reports accuracy against it.
    gold_field: str | None = None
    # JSON-schema tasks: the field of the parsed label compared with the gold column.
    gold_json_field: str | None = None
    # The WARN check `accuracy_at_least` fails below this share of correct rows.
    min_accuracy: float = Field(default=0.0, ge=0, le=1)
    # Choices and regex tasks: a label whose `confidence` (the model's probability of it among the
    # outputs the constraint allows) is under this is "low confidence"...
    min_confidence: float = Field(default=0.5, ge=0, le=1)
    # ...and the WARN check `confidence_at_least` fails when more than this share of labels are.
    max_low_confidence_share: float = Field(default=0.2, ge=0, le=1)
    # Cascade tasks: the WARN check `agreement_at_least` fails when the 95 % lower bound of the
    # audit's agreement with the teacher is under this (None: DEFAULT_MIN_AGREEMENT).
    min_agreement: float | None = Field(default=None, ge=0, le=1)
