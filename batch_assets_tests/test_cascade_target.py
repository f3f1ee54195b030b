"""The cascade by target (`output.cascade.target`): the bound, its guarantee, the refusal and the
settings. Pure: no engine."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from pathlib import Path

import dagster as dg
import numpy as np
import polars as pl
import pytest

from batch_assets.lib.checks import target_result
from batch_assets.lib.run_outcomes import _quality_notes
from batch_assets.pipeline.cascade import TeacherAnswer, TeacherCost, run_cascade, wilson_interval
from batch_assets.pipeline.cascade_labels import cascade_outputs, cascade_summary
from batch_assets.pipeline.cascade_target import TargetChoice, choose_threshold, clopper_pearson_lower
from batch_assets.pipeline.task_formats import task_format
from batch_assets.pipeline.task_spec import PriceSpec, TaskSpecError, load_task_spec
from batch_assets.pipeline.task_spec.cascade import TargetSpec
from batch_assets_tests.test_cascade import (
    CASCADE_TASK,
    CHOICES,
    blobs,
    embedded_results,
    perfect_teacher,
    spec,
    write,
)

TARGET = TargetSpec(agreement=0.95, confidence=0.95)


def calibrated(rows: int, right: np.ndarray, held: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each row's confidence (uniform), a random calibration set of `held` rows, and whether the
    student agreed on them (`right`: per row, whether its label is the teacher's)."""
    rng = np.random.default_rng(seed)
    confidence = rng.uniform(0.2, 1.0, rows)
    calibration = np.zeros(rows, dtype=bool)
    calibration[rng.choice(rows, held, replace=False)] = True
    return confidence, calibration, right & calibration


def test_clopper_pearson_has_the_textbook_values() -> None:
    # One-sided 95 % lower bounds: 10/10 -> 0.05 ** (1/10); 0 successes -> 0; 50/100 -> 0.4136 (the lower
    # end of the 90 % two-sided interval).
    low = clopper_pearson_lower(np.array([10, 0, 50]), np.array([10, 10, 100]), 0.95)
    assert low == pytest.approx([0.05 ** (1 / 10), 0.0, 0.4136], abs=1e-4)


def test_a_student_that_is_always_right_keeps_every_row() -> None:
    confidence, calibration, agrees = calibrated(5000, np.ones(5000, dtype=bool), 500)
    choice = choose_threshold(confidence, calibration, agrees, teacher_rows=300, rows=5300, target=TARGET, budget=1000)
    assert choice.met and choice.deferred_rows == 0
    assert choice.threshold == pytest.approx(confidence.min())
    # 500 of 500 right: the bound on the kept rows is 0.05 ** (1/500) = 0.994.
    assert 0.95 <= choice.lower_bound <= 1.0 and choice.lower_bound == pytest.approx(0.994, abs=0.002)


def test_a_student_that_is_always_wrong_keeps_no_more_rows_than_the_target_can_lose() -> None:
    confidence, calibration, agrees = calibrated(5000, np.zeros(5000, dtype=bool), 500)
    choice = choose_threshold(confidence, calibration, agrees, teacher_rows=300, rows=5300, target=TARGET, budget=5000)
    # 5 % of 5,300 rows may disagree: the student keeps 265 rows, the teacher labels the other 5,035.
    assert choice.met and choice.deferred_rows == 5300 - 300 - 500 - 265
    assert choice.lower_bound == pytest.approx(0.95)
    # With 99.99 % asked (half a row to lose), it keeps none.
    strict = choose_threshold(
        confidence,
        calibration,
        agrees,
        teacher_rows=300,
        rows=5300,
        target=TargetSpec(agreement=0.9999, confidence=0.95),
        budget=5000,
    )
    assert strict.threshold is None and strict.lower_bound == 1.0 and strict.deferred_rows == 4500


def test_a_budget_too_small_for_the_target_is_refused_saying_what_it_can_guarantee() -> None:
    confidence, calibration, agrees = calibrated(5000, np.zeros(5000, dtype=bool), 500)
    choice = choose_threshold(confidence, calibration, agrees, teacher_rows=300, rows=5300, target=TARGET, budget=1000)
    assert not choice.met
    # The budget defers the 1,000 least sure rows: 300 + 500 + 1,000 teacher rows of 5,300 agree.
    assert choice.budget_bound == pytest.approx(1800 / 5300)
    refusal = choice.refusal()
    assert refusal is not None and "max_teacher_share leaves 1000" in refusal and "can guarantee 34.0%" in refusal
    assert choice.metadata()["target_met"] is False and choice.metadata()["target_lower_bound"] == 0.3396


def test_a_random_student_holds_the_guarantee_over_many_files() -> None:
    """A student right with probability rising with its confidence (0.5 to 1.0): over 300 files, the
    chosen threshold's agreement is under the target in at most 5 % of them (the confidence asked)."""
    rng = np.random.default_rng(7)
    misses, shares = 0, []
    for seed in range(300):
        confidence = rng.uniform(0.0, 1.0, 4000)
        right = rng.uniform(size=4000) < 0.5 + 0.5 * confidence
        _, calibration, agrees = calibrated(4000, right, 400, seed)
        choice = choose_threshold(
            confidence, calibration, agrees, teacher_rows=0, rows=4000, target=TARGET, budget=4000
        )
        assert choice.met
        kept = ~calibration & (confidence >= (np.inf if choice.threshold is None else choice.threshold))
        agreement = 1 - (kept & ~right).sum() / 4000
        misses += agreement < TARGET.agreement
        shares.append(1 - kept.mean())
    assert misses <= 0.05 * 300
    # ...and it keeps rows with the student: the teacher does not label everything.
    assert np.median(shares) < 0.75


def test_the_cascade_by_target_defers_the_threshold_s_rows_and_audits_the_rest() -> None:
    x, y = blobs(3000, noise=1.0, seed=3)
    asked: list[int] = []
    target = TargetSpec(agreement=0.95, confidence=0.9, calibration_rows=300)
    result = run_cascade(
        x,
        perfect_teacher(y, asked),
        spec(sample_rows=200, audit_rows=100, target=target, max_teacher_share=0.6),
        CHOICES,
    )
    choice = result.target
    assert choice is not None and choice.met and choice.threshold is not None
    roles = Counter(result.roles)
    assert roles["sample"] == 200 and roles["calibration"] == 300 and roles["audit"] == 100
    assert roles["deferred"] == choice.deferred_rows and len(asked) == len(set(asked)) <= 0.6 * 3000
    # The student keeps exactly the rows at or above the threshold (calibration rows aside).
    for role, p in zip(result.roles, result.confidence, strict=True):
        if role == "student":
            assert p >= choice.threshold
    accuracy = np.mean([label == CHOICES[i] for label, i in zip(result.labels, y, strict=True)])
    assert accuracy >= choice.lower_bound - 0.01 and choice.lower_bound >= 0.95
    assert result.metadata()["target_met"] is True


def test_a_refused_target_asks_the_teacher_for_nothing_beyond_the_sample() -> None:
    x, y = blobs(2000, noise=2.0, seed=4)
    asked: list[int] = []
    target = TargetSpec(agreement=0.99, confidence=0.95, calibration_rows=100)
    result = run_cascade(
        x, perfect_teacher(y, asked), spec(sample_rows=100, target=target, max_teacher_share=0.15), CHOICES
    )
    assert result.target is not None and not result.target.met
    assert Counter(result.roles) == Counter({"student": 1800, "sample": 100, "calibration": 100})
    assert len(asked) == 200
    assert "target_refused" in result.metadata()


def test_a_target_loads_and_bad_values_are_refused_naming_the_setting(tmp_path: Path) -> None:
    with_target = CASCADE_TASK.replace("audit_rows: 30}", "audit_rows: 30, target: {agreement: 0.95, confidence: 0.9}}")
    assert with_target != CASCADE_TASK
    cascade = load_task_spec(write(tmp_path, with_target)).output.cascade
    assert cascade is not None and cascade.target == TargetSpec(agreement=0.95, confidence=0.9, calibration_rows=500)
    with pytest.raises(TaskSpecError, match=r"cascaded.yaml: output.cascade.target.agreement \(line 8\)"):
        load_task_spec(write(tmp_path, with_target.replace("agreement: 0.95", "agreement: 95")))
    with pytest.raises(TaskSpecError, match=r"output.cascade.target.confidence"):
        load_task_spec(write(tmp_path, with_target.replace("confidence: 0.9", "confidence: 1")))


def test_a_task_without_a_target_keeps_its_code_version(tmp_path: Path) -> None:
    task = load_task_spec(write(tmp_path, CASCADE_TASK))
    assert "target" not in task.output.decision()["cascade"]


def audited_labels(agreeing: int) -> pl.DataFrame:
    """100 rows: 10 deferred and 20 audited by the teacher, 70 the student's; on `agreeing` of the 20
    audited rows the student's label was the teacher's."""
    roles = ["deferred"] * 10 + ["audit"] * 20 + ["student"] * 70
    student = ["a"] * 10 + ["a"] * agreeing + ["b"] * (20 - agreeing) + ["a"] * 70
    return pl.DataFrame(
        {
            "labelled_by": ["teacher"] * 30 + ["student"] * 70,
            "cascade_role": roles,
            "label": ["a"] * 100,
            "student_label": student,
        }
    )


MET = {"target_met": True, "target_lower_bound": 0.95, "target_threshold": 0.4, "target_confidence": 0.95}


def test_the_audit_estimates_the_agreement_of_all_rows_and_the_cost_per_correct_label() -> None:
    summary = replace(
        cascade_summary(audited_labels(19)),
        teacher_cost=TeacherCost(rows=30, prompt_tokens=3000),
        price=PriceSpec(input_per_million_tokens=1.0),
        teacher_price=PriceSpec(input_per_million_tokens=1000.0),
    )
    estimate = summary.all_rows_agreement()
    assert estimate is not None and estimate[0] == pytest.approx((30 + 0.95 * 70) / 100)
    low, high = wilson_interval(19, 20)
    assert estimate[1:] == pytest.approx(((30 + low * 70) / 100, (30 + high * 70) / 100))
    cost = summary.cost_metadata()
    # $3 of teacher tokens for 96.5 rows agreeing; the teacher alone: $10 for 100 rows, its own labels.
    assert cost["cost_per_1000_correct_usd"] == pytest.approx(3.0 / 96.5 * 1000, rel=1e-4)
    assert cost["all_teacher_cost_per_1000_correct_usd"] == pytest.approx(100.0)


def test_the_target_check_passes_when_the_audit_agrees_with_the_bound() -> None:
    result = target_result(audited_labels(19), MET)
    assert result.passed and result.severity == dg.AssetCheckSeverity.ERROR
    assert result.metadata["all_rows_agreement"].value == 0.965


def test_the_target_check_fails_when_the_audit_contradicts_the_bound() -> None:
    result = target_result(audited_labels(5), MET)
    assert not result.passed
    assert result.description is not None and "under the guaranteed 95.0%" in result.description


def test_the_target_check_fails_a_refused_target_by_name() -> None:
    refused = TargetChoice(TARGET, None, 0.9, 2000, 500, 1000, False, 0.34).metadata()
    result = target_result(audited_labels(20), refused)
    assert not result.passed
    assert result.description is not None and result.description.startswith(
        "output.cascade.target agreement 95.0% at confidence 95% needs 2000 rows deferred to the teacher, "
        "output.cascade.max_teacher_share leaves 1000: the budget can guarantee 34.0%"
    )


def test_the_target_check_passes_a_partition_with_nothing_left_to_the_student() -> None:
    empty = audited_labels(20).clear()
    assert target_result(empty, {}).passed
    assert not target_result(audited_labels(20), {}).passed  # student rows, but no choice recorded


def test_the_run_summary_says_what_the_target_guarantees_or_why_it_was_refused() -> None:
    def report(instance: dg.DagsterInstance, asset: str, key: str, **metadata) -> None:
        event = dg.AssetMaterialization(dg.AssetKey(["cascaded", asset]), partition=key, metadata=metadata)
        instance.report_runless_asset_event(event)

    counts = {"rows": 1000, "teacher_rows": 200, "student_rows": 800, "audited_rows": 100, "audit_agreement": 0.95}
    met = TargetChoice(TARGET, 0.2941, 0.9512, 100, 400, 500, True, 0.99).metadata()
    refused = TargetChoice(TARGET, None, 0.9, 2000, 500, 1000, False, 0.34).metadata()
    with dg.instance_for_test() as instance:
        for key, choice in (("a", met), ("b", refused)):
            report(instance, "inference_outputs", key, **{k: v for k, v in choice.items() if v is not None})
            report(
                instance,
                "validated_labels",
                key,
                **counts,
                all_rows_agreement=0.96,
                cascade_cost_usd=0.5,
                all_teacher_cost_usd=2.0,
            )
        notes = _quality_notes("cascaded", ["a"], instance)
        assert notes[-2:] == [
            "cost $0.5000 against $2.0000 with the teacher on every row; $0.5208 per 1,000 labels agreeing with "
            "the teacher (the audit's estimate) against $2.0000 with the teacher alone",
            "target: 95.1% of rows agree with the teacher or more, with probability 95% (the student keeps "
            "confidence >= 0.294)",
        ]
        assert _quality_notes("cascaded", ["b"], instance)[-1].startswith(
            "target not met: output.cascade.target agreement 95.0% at confidence 95% needs 2000 rows deferred"
        )


def test_a_defer_below_written_beside_the_target_is_a_floor() -> None:
    x, y = blobs(2000, noise=1.0, seed=5)
    target = TargetSpec(agreement=0.8, confidence=0.9, calibration_rows=200)
    settings = {"sample_rows": 200, "audit_rows": 50, "target": target, "max_teacher_share": 1.0}
    alone = run_cascade(x, perfect_teacher(y), spec(**settings), CHOICES)
    floored = run_cascade(x, perfect_teacher(y), spec(**settings, defer_below=0.99), CHOICES)
    assert alone.target == floored.target and alone.target is not None and alone.target.met

    def kept(result) -> list[float]:
        return [p for p, role in zip(result.confidence, result.roles, strict=True) if role == "student"]

    assert min(kept(alone)) < 0.99 <= min(kept(floored))


# --- a target that cannot be evaluated or is not met (issue 56, item 1) ----------------------------

# The whole file as calibration set: what a user asks who wants every row checked.
LENIENT = TargetSpec(agreement=0.5, confidence=0.5, calibration_rows=100000)


def test_a_target_on_a_file_too_small_for_a_student_is_not_met_and_says_why() -> None:
    """10 rows, 25 % of them for the teacher: a sample of 1 row, one label, no student; 8 rows are
    `cascade_no_student` errors, 2 of 10 agree: the target is not met, and the refusal says why."""
    x, y = blobs(10, noise=0.5, seed=8)
    result = run_cascade(x, perfect_teacher(y), spec(sample_rows=100, target=LENIENT), CHOICES)
    choice = result.target
    assert choice is not None and not choice.met and choice.threshold is None
    assert choice.lower_bound == pytest.approx(0.2)
    refusal = choice.refusal()
    assert refusal is not None and refusal.startswith(
        "output.cascade.target agreement 50.0% at confidence 50% is not met: 2 of 10 rows (20.0%) have the "
        "teacher's label, the other 8 do not: no student was trained: the teacher's sample of 1 row holds 1 "
        "distinct label(s)"
    )
    assert refusal.endswith(
        "; 10 rows give the teacher 2 (max_teacher_share 0.25), a sample of at most 1 (sample_rows 100): run files "
        "of more rows, or raise output.cascade.max_teacher_share"
    )
    metadata = result.metadata()
    assert (metadata["target_met"], metadata["target_lower_bound"], metadata["target_refused"]) == (
        False,
        0.2,
        refusal,
    )


def test_a_partition_the_teacher_labels_whole_meets_the_target_exactly() -> None:
    """A sample of one label trains no student, but a budget of every row leaves none to it: the
    agreement is known, not bounded."""
    x, _ = blobs(6, noise=0.5, seed=8)
    teacher = lambda positions: [TeacherAnswer("alpha") for _ in positions]  # noqa: E731
    result = run_cascade(x, teacher, spec(sample_rows=100, max_teacher_share=1.0, target=LENIENT), CHOICES)
    assert result.labelled_by == ["teacher"] * 6
    assert result.target is not None and result.target.met and result.target.lower_bound == 1.0


def degenerate_labels(tmp_path: Path, gold: list[str | None], errors: dict[int, str] | None = None):
    """A partition of `gold` (the teacher column) through the cascade of CASCADE_TASK with the lenient
    target: its labels and the `agreement_target_met` result on them."""
    body = CASCADE_TASK.replace(
        "audit_rows: 30}", "audit_rows: 30, target: {agreement: 0.5, confidence: 0.5, calibration_rows: 100000}}"
    )
    task = load_task_spec(write(tmp_path, body))
    assert task.output.cascade is not None
    x, _ = blobs(len(gold), noise=0.3, seed=9)
    outputs, measured = cascade_outputs(embedded_results(x, gold, errors), task.output.cascade, CHOICES, "f.csv")
    labels = task_format(task).validate(outputs)
    choice = {name: value for name, value in measured.items() if name.startswith("target_")}
    return labels, choice, target_result(labels, choice)


@pytest.mark.parametrize(
    ("gold", "why"),
    [
        (["alpha"] * 10, "the teacher's sample of 1 row holds 1 distinct label(s) (alpha), a student needs 2"),
        ([None] * 10, "the teacher gave no label for 2 of the 2 rows it was asked about: teacher_no_label 2 (e.g. "),
        ([None] * 10, "the teacher column 'gold' is empty)"),
        (["Omega"] * 10, "teacher_unknown_label 2 (e.g. f.csv line "),
        (["Omega"] * 10, "the teacher column 'gold' holds 'Omega', not one of output.choices)"),
    ],
)
def test_the_target_check_fails_a_degenerate_file_naming_why(tmp_path: Path, gold: list, why: str) -> None:
    labels, choice, result = degenerate_labels(tmp_path, gold)
    assert not result.passed and result.severity == dg.AssetCheckSeverity.ERROR
    assert result.description is not None and why in result.description, result.description
    assert "no student was trained" in result.description
    assert result.metadata["target_met"].value is False and result.metadata["target_refused"].value
    agreeing = int((labels["labelled_by"] == "teacher").sum())
    assert choice["target_lower_bound"] == agreeing / 10 < 0.5


def test_rows_that_were_never_embedded_count_against_the_target(tmp_path: Path) -> None:
    """The target is a share of all the partition's rows: empty texts are rows that do not agree."""
    gold = [CHOICES[i % 4] for i in range(40)]
    empty = {i: f"empty_text: f.csv line {i + 2}: the text is empty" for i in range(25)}
    _, choice, result = degenerate_labels(tmp_path, gold, empty)
    assert not result.passed and choice["target_lower_bound"] <= 15 / 40
    assert result.description is not None and "25 rows are error rows before the cascade (empty_text: 25)" in (
        result.description
    )


def test_deferred_rows_the_teacher_gives_no_label_for_lower_the_bound_and_fail_the_target() -> None:
    """The bound counts the deferred rows as the teacher's; a teacher that fails on them (here every
    row of the third call: sample, calibration, then the deferred rows) leaves them error rows."""
    x, y = blobs(2000, noise=2.0, seed=3)
    calls: list[int] = []

    def teacher(positions: np.ndarray) -> list[TeacherAnswer]:
        calls.append(len(positions))
        if len(calls) == 3:
            return [TeacherAnswer(None, "teacher_no_label: f.csv line 1: the teacher column 'gold' is empty")] * len(
                positions
            )
        return [TeacherAnswer(CHOICES[y[i]]) for i in positions]

    target = TargetSpec(agreement=0.95, confidence=0.9, calibration_rows=300)
    result = run_cascade(
        x, teacher, spec(sample_rows=200, audit_rows=50, max_teacher_share=0.8, target=target), CHOICES
    )
    deferred = Counter(result.roles)["deferred"]
    assert len(calls) == 4 and calls[2] == deferred > 0.05 * 2000
    choice = result.target
    assert choice is not None and not choice.met and choice.lower_bound < 0.95
    refusal = choice.refusal()
    assert (
        refusal is not None and f"the teacher gave no label for {deferred} of the {deferred} deferred rows" in refusal
    )
    assert "the teacher column 'gold' is empty" in refusal
