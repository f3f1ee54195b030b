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

from batch_assets.app.run_outcomes import _quality_notes
from batch_assets.lib.gate_checks import target_result
from batch_assets.pipeline.cascade.labels import cascade_outputs, cascade_summary
from batch_assets.pipeline.cascade.run import TaskCascade, TeacherAnswer, run_cascade
from batch_assets.pipeline.cascade.student import StoredStudent
from batch_assets.pipeline.cascade.summary import TeacherCost, wilson_interval
from batch_assets.pipeline.cascade.target import TargetChoice, calibrate, clopper_pearson_lower, partition_bound
from batch_assets.pipeline.task_formats import task_format
from batch_assets.pipeline.task_spec import PriceSpec, TaskSpecError, load_task_spec
from batch_assets.pipeline.task_spec.cascade import TargetSpec
from batch_assets_tests.support import cascade as support

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
    made = calibrate(confidence, calibration, agrees, TARGET, "v1")
    assert made.threshold == pytest.approx(confidence.min()) and made.rows == 500
    # Every row kept (q = 1): a kept row must agree with chance 0.95, and 500 of 500 right pass it.
    assert made.kept_bound == pytest.approx(0.95)
    assert partition_bound(0, confidence, 5000, made.kept_bound, made.threshold) == pytest.approx(0.95)
    # The budget's own bound at the laxest threshold is Clopper-Pearson's: 0.05 ** (1/500) = 0.994.
    assert made.rate_bound_at(confidence.min()) == pytest.approx(0.994, abs=0.002)


def test_a_student_that_is_always_wrong_keeps_no_more_rows_than_the_target_can_lose() -> None:
    confidence, calibration, agrees = calibrated(5000, np.zeros(5000, dtype=bool), 500)
    made = calibrate(confidence, calibration, agrees, TARGET, "v1")
    kept = (confidence >= made.threshold).sum()
    # 5 % of the rows may disagree; the kept share is taken at its upper 97.5 % end, so a little less.
    assert 0.04 * 5000 < kept <= 0.05 * 5000 and made.kept_bound == 0.0
    # A partition of the same kind keeping as many agrees on 95 % or more: the rows kept all disagree.
    rng = np.random.default_rng(1)
    later = rng.uniform(0.2, 1.0, 5000)
    assert 1 - (later >= made.threshold).mean() >= 0.95 - 0.01
    # With 99.99 % asked (half a row to lose), it keeps none.
    strict = calibrate(confidence, calibration, agrees, TargetSpec(agreement=0.9999, confidence=0.95), "v1")
    assert strict.threshold is None and strict.kept_bound == 1.0


def simulated_job(rng: np.random.Generator, right_chance, partitions: int, rows: int, held: int) -> tuple[float, float]:
    """One task of `partitions` exchangeable partitions: the first calibrates (`held` calibration
    rows to the teacher), every one defers its rows under the threshold; the share of all rows
    agreeing with the teacher, and the teacher's share."""
    agreeing = teacher = 0
    made = None
    for _ in range(partitions):
        confidence = rng.uniform(0.0, 1.0, rows)
        right = rng.uniform(size=rows) < right_chance(confidence)
        calibration = np.zeros(rows, dtype=bool)
        if made is None:
            calibration[rng.choice(rows, held, replace=False)] = True
            made = calibrate(confidence, calibration, right & calibration, TARGET, "v1")
        kept = ~calibration & (confidence >= (np.inf if made.threshold is None else made.threshold))
        agreeing += rows - int((kept & ~right).sum())
        teacher += rows - int(kept.sum())
    return agreeing / (partitions * rows), teacher / (partitions * rows)


@pytest.mark.parametrize(
    ("name", "right_chance"),
    [
        ("always right", lambda c: np.ones_like(c)),
        ("always wrong", lambda c: np.zeros_like(c)),
        ("right at random", lambda c: np.full_like(c, 0.9)),
        ("right more when sure", lambda c: 0.5 + 0.5 * c),
    ],
)
def test_the_per_task_guarantee_holds_its_confidence_over_many_simulated_jobs(name: str, right_chance) -> None:
    """One calibration per task, six partitions labelled with it: over 300 jobs, the share of all
    the task's rows agreeing with the teacher is under the target in at most 5 % of them."""
    rng = np.random.default_rng(7)
    results = [simulated_job(rng, right_chance, partitions=6, rows=2000, held=300) for _ in range(300)]
    misses = sum(agreement < TARGET.agreement for agreement, _ in results)
    assert misses <= 0.05 * 300, name
    shares = [share for _, share in results]
    if name == "always right":  # it keeps (nearly) every row: the teacher saw the calibration rows alone
        assert np.median(shares) < 0.03
    if name == "right more when sure":  # and it keeps rows with the student
        assert np.median(shares) < 0.75


def shared_task(rows: int = 6000, noise: float = 2.0, seed: int = 3):
    """Rows of one kind, cut into partitions of 2,000, and a cascade by target that shares its
    student and calibration across them."""
    x, y = support.blobs(rows, noise=noise, seed=seed)
    parts = [(x[i : i + 2000], y[i : i + 2000]) for i in range(0, rows, 2000)]
    return parts, TaskCascade()


TASK_TARGET = TargetSpec(agreement=0.95, confidence=0.9, calibration_rows=300)


def test_later_partitions_reuse_the_task_s_student_and_calibration_paying_only_their_deferred_rows() -> None:
    parts, task = shared_task()
    settings = support.spec(sample_rows=200, audit_rows=50, target=TASK_TARGET, max_teacher_share=0.6)
    results = []
    for n, (x, y) in enumerate(parts):
        task.partition = f"p{n}"
        asked: list[int] = []
        results.append(
            (run_cascade(x, support.perfect_teacher(y, asked), settings, support.CHOICES, task=task), asked, y)
        )
    first, second, third = (Counter(r.roles) for r, _, _ in results)
    assert first["sample"] == 200 and first["calibration"] == 300
    assert second["sample"] == second["calibration"] == third["sample"] == third["calibration"] == 0
    assert second["deferred"] > 0 and second["audit"] == 50
    choices = [r.target for r, _, _ in results]
    assert all(c is not None and c.met and c.student_version == task.stored.student_version for c in choices)
    assert {c.threshold for c in choices if c is not None} == {choices[0].threshold}
    assert all(c.calibrated_in == "p0" for c in choices if c is not None)
    # Each row labelled once: every partition's teacher requests are distinct rows.
    assert all(len(asked) == len(set(asked)) for _, asked, _ in results)
    # The task-level figures: every row so far, the teacher's share, the bound at the confidence.
    figures = results[-1][0].task
    assert figures is not None and (figures.partitions, figures.rows) == (3, 6000)
    teacher = sum(sum(by == "teacher" for by in r.labelled_by) for r, _, _ in results)
    assert figures.teacher_rows == teacher and figures.confidence == 0.9
    assert figures.lower_bound >= 0.95
    accuracy = np.mean(
        [label == support.CHOICES[i] for r, _, y in results for label, i in zip(r.labels, y, strict=True)]
    )
    assert accuracy >= figures.lower_bound - 0.01
    metadata = results[-1][0].metadata()
    assert metadata["task_rows"] == 6000 and metadata["task_teacher_share"] == round(teacher / 6000, 4)


def test_a_new_student_version_recalibrates() -> None:
    parts, task = shared_task()
    settings = support.spec(sample_rows=200, audit_rows=50, target=TASK_TARGET, max_teacher_share=0.6)
    (x0, y0), (x1, y1), (x2, y2) = parts
    run_cascade(x0, support.perfect_teacher(y0), settings, support.CHOICES, task=task)
    first = task.calibration
    # The label model retrained on more teacher rows: a new student version, calibrated again.
    task.stored = StoredStudent(
        np.vstack([x0[:500], x1[:500]]), [support.CHOICES[i] for i in [*y0[:500], *y1[:500]]], 0
    )
    again = run_cascade(x2, support.perfect_teacher(y2), settings, support.CHOICES, task=task)
    assert Counter(again.roles)["calibration"] == 300 and Counter(again.roles)["sample"] == 0
    assert first is not None and task.calibration is not None
    assert task.calibration.student_version == task.stored.student_version != first.student_version
    assert again.target is not None and again.target.student_version == task.stored.student_version


def test_a_refused_target_defers_what_the_budget_pays_for_by_default_and_nothing_with_stop() -> None:
    parts, _ = shared_task()
    (x0, y0), (x1, y1), _ = parts
    settings = {"sample_rows": 200, "audit_rows": 50, "max_teacher_share": 0.15}
    results = {}
    for mode in ("best_effort", "stop"):
        task = TaskCascade()
        mode_spec = support.spec(**settings, target=TASK_TARGET, on_unreachable=mode)
        run_cascade(x0, support.perfect_teacher(y0), mode_spec, support.CHOICES, task=task)
        asked: list[int] = []
        result = run_cascade(x1, support.perfect_teacher(y1, asked), mode_spec, support.CHOICES, task=task)
        results[mode] = result, asked
    best, asked = results["best_effort"]
    stopped, nothing = results["stop"]
    assert best.target is not None and not best.target.met and best.target.best_effort
    # The budget: 15 % of 2,000 rows, the least sure of them deferred, the audit's 50 besides.
    assert Counter(best.roles)["deferred"] == 300 - 50 and len(asked) == 300
    refusal = best.target.refusal()
    assert refusal is not None and "best effort: the 250 least sure rows went to the teacher" in refusal
    assert f"the budget can guarantee {best.target.budget_bound:.1%} at that confidence" in refusal
    assert best.metadata()["target_best_effort"] is True
    assert stopped.target is not None and not stopped.target.met and not stopped.target.best_effort
    assert nothing == [] and set(stopped.roles) == {"student"}
    assert "on_unreachable: stop: nothing more was asked" in (stopped.target.refusal() or "")

    def accuracy(result) -> float:
        return float(np.mean([label == support.CHOICES[i] for label, i in zip(result.labels, y1, strict=True)]))

    assert accuracy(best) > accuracy(stopped)


def test_at_the_same_budget_the_target_is_never_less_accurate_than_the_threshold() -> None:
    """A partition after the first: the target mode pays its deferred rows and its audit alone, so at
    the threshold mode's budget it is at least as accurate (a refused target defers the least sure
    rows the budget pays for, as many as the threshold mode could, or more)."""
    parts, task = shared_task()
    (x0, y0), (x1, y1), _ = parts
    budget = {"sample_rows": 200, "audit_rows": 50, "max_teacher_share": 0.2}
    run_cascade(x0, support.perfect_teacher(y0), support.spec(**budget, target=TASK_TARGET), support.CHOICES, task=task)
    by_target = run_cascade(
        x1, support.perfect_teacher(y1), support.spec(**budget, target=TASK_TARGET), support.CHOICES, task=task
    )
    assert task.stored is not None
    by_threshold = run_cascade(x1, support.perfect_teacher(y1), support.spec(**budget), support.CHOICES, task.stored)

    def accuracy_and_share(result) -> tuple[float, float]:
        right = np.mean([label == support.CHOICES[i] for label, i in zip(result.labels, y1, strict=True)])
        return float(right), float(np.mean([by == "teacher" for by in result.labelled_by]))

    (target_accuracy, target_share), (threshold_accuracy, threshold_share) = map(
        accuracy_and_share, (by_target, by_threshold)
    )
    assert target_share <= 0.2 and threshold_share <= 0.2
    assert target_accuracy >= threshold_accuracy


def test_a_target_loads_and_bad_values_are_refused_naming_the_setting(tmp_path: Path) -> None:
    with_target = support.CASCADE_TASK.replace(
        "audit_rows: 30}", "audit_rows: 30, target: {agreement: 0.95, confidence: 0.9}}"
    )
    assert with_target != support.CASCADE_TASK
    cascade = load_task_spec(support.write(tmp_path, with_target)).output.cascade
    assert cascade is not None and cascade.target == TargetSpec(agreement=0.95, confidence=0.9, calibration_rows=500)
    with pytest.raises(TaskSpecError, match=r"cascaded.yaml: output.cascade.target.agreement \(line 8\)"):
        load_task_spec(support.write(tmp_path, with_target.replace("agreement: 0.95", "agreement: 95")))
    with pytest.raises(TaskSpecError, match=r"output.cascade.target.confidence"):
        load_task_spec(support.write(tmp_path, with_target.replace("confidence: 0.9", "confidence: 1")))
    assert cascade.on_unreachable == "best_effort"
    stop = with_target.replace("audit_rows: 30,", "audit_rows: 30, on_unreachable: stop,")
    stopped = load_task_spec(support.write(tmp_path, stop)).output.cascade
    assert stopped is not None and stopped.on_unreachable == "stop"
    with pytest.raises(TaskSpecError, match=r"output.cascade.on_unreachable"):
        load_task_spec(support.write(tmp_path, stop.replace("on_unreachable: stop", "on_unreachable: relax")))


def test_a_task_without_a_target_keeps_its_code_version(tmp_path: Path) -> None:
    task = load_task_spec(support.write(tmp_path, support.CASCADE_TASK))
    assert "target" not in task.output.decision()["cascade"]
    assert "on_unreachable" not in task.output.decision()["cascade"]


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
    x, y = support.blobs(2000, noise=1.0, seed=5)
    target = TargetSpec(agreement=0.8, confidence=0.9, calibration_rows=200)
    settings = {"sample_rows": 200, "audit_rows": 50, "target": target, "max_teacher_share": 1.0}
    alone = run_cascade(x, support.perfect_teacher(y), support.spec(**settings), support.CHOICES)
    floored = run_cascade(x, support.perfect_teacher(y), support.spec(**settings, defer_below=0.99), support.CHOICES)
    assert alone.target is not None and floored.target is not None and alone.target.met and floored.target.met
    # The same threshold; the floor's teacher rows only raise the bound.
    assert alone.target.threshold == floored.target.threshold
    assert floored.target.lower_bound > alone.target.lower_bound

    def kept(result) -> list[float]:
        return [p for p, role in zip(result.confidence, result.roles, strict=True) if role == "student"]

    assert min(kept(alone)) < 0.99 <= min(kept(floored))


# --- a target that cannot be evaluated or is not met (issue 56, item 1) ----------------------------

# The whole file as calibration set: what a user asks who wants every row checked.
LENIENT = TargetSpec(agreement=0.5, confidence=0.5, calibration_rows=100000)


def test_a_target_on_a_file_too_small_for_a_student_is_not_met_and_says_why() -> None:
    """10 rows, 25 % of them for the teacher: a sample of 1 row, one label, no student; 8 rows are
    `cascade_no_student` errors, 2 of 10 agree: the target is not met, and the refusal says why."""
    x, y = support.blobs(10, noise=0.5, seed=8)
    result = run_cascade(x, support.perfect_teacher(y), support.spec(sample_rows=100, target=LENIENT), support.CHOICES)
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
    x, _ = support.blobs(6, noise=0.5, seed=8)
    teacher = lambda positions: [TeacherAnswer("alpha") for _ in positions]  # noqa: E731
    result = run_cascade(
        x, teacher, support.spec(sample_rows=100, max_teacher_share=1.0, target=LENIENT), support.CHOICES
    )
    assert result.labelled_by == ["teacher"] * 6
    assert result.target is not None and result.target.met and result.target.lower_bound == 1.0


def degenerate_labels(tmp_path: Path, gold: list[str | None], errors: dict[int, str] | None = None):
    """A partition of `gold` (the teacher column) through the cascade of support.CASCADE_TASK with the lenient
    target: its labels and the `agreement_target_met` result on them."""
    body = support.CASCADE_TASK.replace(
        "audit_rows: 30}", "audit_rows: 30, target: {agreement: 0.5, confidence: 0.5, calibration_rows: 100000}}"
    )
    task = load_task_spec(support.write(tmp_path, body))
    assert task.output.cascade is not None
    x, _ = support.blobs(len(gold), noise=0.3, seed=9)
    outputs, measured = cascade_outputs(
        support.embedded_results(x, gold, errors), task.output.cascade, support.CHOICES, "f.csv"
    )
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
    gold = [support.CHOICES[i % 4] for i in range(40)]
    empty = {i: f"empty_text: f.csv line {i + 2}: the text is empty" for i in range(25)}
    _, choice, result = degenerate_labels(tmp_path, gold, empty)
    assert not result.passed and choice["target_lower_bound"] <= 15 / 40
    assert result.description is not None and "25 rows are error rows before the cascade (empty_text: 25)" in (
        result.description
    )


def test_deferred_rows_the_teacher_gives_no_label_for_lower_the_bound_and_fail_the_target() -> None:
    """The bound counts the deferred rows as the teacher's; a teacher that fails on them (here every
    row of the third call: sample, calibration, then the deferred rows) leaves them error rows."""
    x, y = support.blobs(2000, noise=2.0, seed=3)
    calls: list[int] = []

    def teacher(positions: np.ndarray) -> list[TeacherAnswer]:
        calls.append(len(positions))
        if len(calls) == 3:
            return [TeacherAnswer(None, "teacher_no_label: f.csv line 1: the teacher column 'gold' is empty")] * len(
                positions
            )
        return [TeacherAnswer(support.CHOICES[y[i]]) for i in positions]

    target = TargetSpec(agreement=0.95, confidence=0.9, calibration_rows=300)
    result = run_cascade(
        x, teacher, support.spec(sample_rows=200, audit_rows=50, max_teacher_share=0.8, target=target), support.CHOICES
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
