"""The cascade, pure: a teacher labels a sample and the uncertain rows, a student labels the rest.

`run_cascade` takes one partition's embeddings and a teacher (a function from row positions to
answers) and decides, row by row, who labels it:

1. **sample**: `sample_rows` rows (at most half the teacher's budget) chosen to cover the data
   (`choose_sample`: k-means clusters of the embeddings, each drawn from in proportion to its size),
   labelled by the teacher;
2. **student**: scikit-learn's logistic regression on the sample's embeddings and teacher labels
   (`train_student`), its probabilities calibrated (`CalibratedClassifierCV`, temperature scaling,
   where every class has enough examples), its agreement with the teacher cross-validated;
3. **deferred**: rows whose student confidence is under `defer_below` go to the teacher, least sure
   first, within the hard budget `max_teacher_share` of the partition's rows (sample, audit and
   deferred rows together); rows past the budget keep the student's label and its low confidence;
4. **audit**: `audit_rows` random student-labelled rows also go to the teacher; the share on which
   both agree, with its 95 % Wilson interval, is what the `agreement_at_least` check holds.

With `output.cascade.target` (`_defer_by_target`) the student and its threshold are the task's
(`TaskCascade`: one student version and one calibration shared by every partition, first writer wins
in storage): a partition with none stored trains the student on its sample and calibrates it (a
random calibration set of the student's rows to the teacher; pipeline/cascade/target.py), later ones
reuse both. Step 3 is then: the rows under the threshold are deferred when the budget pays for them;
else the least sure it pays for (`on_unreachable: best_effort`, the default) or none (`stop`), and
the partition's check says what the budget guarantees.

Rows the teacher saw keep the teacher's label. What cannot be labelled honestly is an error row, never
a silent label: a teacher error on a sample or deferred row; every row the student would label when the
teacher's sample has fewer than two distinct labels. Choices the teacher never gave in the sample are
named in the report (the student cannot give them).

A partition may start from a stored student (`StoredStudent`: the task's `label_model`, trained on
the teacher labels of every partition so far): its sample is then only what the stored rows lack of
`sample_rows`, and the student is the stored one, retrained with the partition's own teacher labels
where there are any (`partition_student`).

The student (sampling, training, its stored rows and version, expected calibration error) is
pipeline/cascade/student.py. What a partition's
labels report (the audit's Wilson interval, the cost) is pipeline/cascade/summary.py.

scikit-learn (the `cascade` extra) is imported where the student is clustered, trained or
cross-validated, not with this module: the code location loads without it (pipeline/extras.py).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from batch_assets.pipeline.cascade.student import StoredStudent, Student, choose_sample, partition_student
from batch_assets.pipeline.cascade.target import (
    Calibration,
    PartitionFigures,
    TargetChoice,
    TaskFigures,
    calibrate,
    known_agreement,
    partition_bound,
)
from batch_assets.pipeline.task_spec.cascade import CascadeSpec, TargetSpec


@dataclass(frozen=True)
class TeacherAnswer:
    label: str | None  # one of the choices, or None with an error
    error: str | None = None
    confidence: float = 1.0  # a column's label is the teacher's final word
    # What asking cost, for a chat teacher (None for a column: it costs nothing to read): the row's
    # tokens, and the engine seconds per row the teacher inferred (None when every row came from its cache).
    prompt_tokens: int | None = None
    generated_tokens: int | None = None
    seconds: float | None = None


# Row positions (into the partition's embedded rows) → the teacher's answer for each.
Teacher = Callable[[np.ndarray], list[TeacherAnswer]]


def _same(kept: Any) -> Any:
    return kept


@dataclass
class TaskCascade:
    """What a partition of a cascade by target shares with the task's other partitions: the student
    version (`stored`: the task's label model) and its calibration. `keep_student` and
    `keep_calibration` settle a partition's own when the task has none yet: they return the one the
    task keeps (first writer wins, storage/label_models.py), which may be another partition's; by
    default they keep it in memory (a partition alone, or the pure tests). `partition` names the
    partition in the calibration it makes."""

    stored: StoredStudent | None = None
    calibration: Calibration | None = None
    keep_student: Callable[[StoredStudent], StoredStudent] = _same
    keep_calibration: Callable[[Calibration], Calibration] = _same
    partition: str = ""
    # (student version, partition, its figures) -> the figures of every partition that student
    # version labelled (this one's replacing an earlier run's): the task-level figures' source.
    keep_figures: Callable[[str, str, PartitionFigures], list[PartitionFigures]] | None = None
    # A student version -> its stored calibration (None: none yet); None: nothing is stored.
    read_calibration: Callable[[str], Calibration | None] | None = None
    _figures: dict[tuple[str, str], PartitionFigures] = field(default_factory=dict)

    def calibration_for(self, student_version: str, target: TargetSpec) -> Calibration | None:
        """The calibration of `student_version` for `target`: the one in hand, else the stored one."""
        if self.calibration is not None and self.calibration.matches(student_version, target):
            return self.calibration
        found = self.read_calibration(student_version) if self.read_calibration is not None else None
        if found is not None and found.matches(student_version, target):
            self.calibration = found
            return found
        return None

    def task_figures(self, student_version: str, figures: PartitionFigures) -> TaskFigures:
        """This partition's figures recorded, and the student version's over all its partitions."""
        if self.keep_figures is not None:
            every = self.keep_figures(student_version, self.partition, figures)
        else:
            self._figures[(student_version, self.partition)] = figures
            every = [f for (version, _), f in self._figures.items() if version == student_version]
        return TaskFigures.of(student_version, every)

    def settle_student(self, student: StoredStudent) -> StoredStudent:
        self.stored = self.keep_student(student)
        return self.stored

    def settle_calibration(self, calibration: Calibration) -> Calibration:
        self.calibration = self.keep_calibration(calibration)
        return self.calibration


@dataclass
class CascadeResult:
    """Per row of the partition's embedded rows: label, confidence, who labelled it, its role
    (sample, calibration, deferred, audit or student), the student's own label where it made one, and an error."""

    labels: list[str | None]
    confidence: list[float | None]
    labelled_by: list[str | None]
    roles: list[str | None]
    student_labels: list[str | None]
    errors: list[str | None]
    student: Student
    unseen_choices: list[str] = field(default_factory=list)
    over_budget_rows: int = 0  # rows under defer_below the budget left with the student
    # Per row the teacher was asked about: what it cost (TeacherAnswer); None elsewhere.
    teacher_costs: list[TeacherAnswer | None] = field(default_factory=list)
    # With output.cascade.target: the threshold chosen, what it guarantees, or why it was refused.
    target: TargetChoice | None = None
    # ...and the student version's figures over every partition it labelled, this one included.
    task: TaskFigures | None = None

    def metadata(self) -> dict[str, Any]:
        return {
            **self.student.metadata(),
            "unseen_choices": self.unseen_choices,
            "deferred_over_budget_rows": self.over_budget_rows,
            **(self.target.metadata() if self.target is not None else {}),
            **(self.task.metadata() if self.task is not None else {}),
        }


def run_cascade(
    vectors: np.ndarray,
    teacher: Teacher,
    spec: CascadeSpec,
    choices: Sequence[str],
    stored: StoredStudent | None = None,
    unembedded: Mapping[str, int] | None = None,
    task: TaskCascade | None = None,
) -> CascadeResult:
    """Label every row of `vectors` (one partition's embedded rows) by the teacher or the student.
    With a `stored` student (the task's label_model) the partition's own sample shrinks to what the
    stored training rows lack of `sample_rows`, so the teacher's budget goes to deferral and audit.
    `unembedded`: the partition's rows that have no vector, by error code: error rows, which a
    target counts as disagreeing.

    With a target the student version and its calibration are the task's (`task`; alone without
    one): a stored student labels as it is (the partition asks for no sample of its own), and a
    partition that starts with none trains one on its sample and settles it as the task's."""
    rows = vectors.shape[0]
    result = CascadeResult(
        labels=[None] * rows,
        confidence=[None] * rows,
        labelled_by=[None] * rows,
        roles=[None] * rows,
        student_labels=[None] * rows,
        errors=[None] * rows,
        student=Student(None, [], 0, None, None, False, "no rows"),
        teacher_costs=[None] * rows,
    )
    errors = _ErrorRows(dict(unembedded or {}))
    if rows == 0:
        if spec.target is not None and errors.rows:
            result.target = errors.known_agreement(spec.target, result, "no row has a vector")
        return result
    budget = max(1, math.floor(spec.max_teacher_share * rows))
    if spec.target is not None:
        task = task or TaskCascade(stored)
        stored = task.stored
    wanted = spec.sample_rows if stored is None else max(0, spec.sample_rows - len(stored.labels))
    if spec.target is not None and stored is not None:
        wanted = 0  # one student version for the task: the stored one, as it is
    # At most half the budget: the rest is for the audit and the rows the student is unsure of (a
    # sample that took it all would leave a small partition without either).
    sample = choose_sample(vectors, min(wanted, max(1, budget // 2), rows), spec.seed)
    taught = _ask(teacher, sample, result, role="sample")
    taught_labels = [result.labels[i] or "" for i in taught]
    if task is not None:
        result.student = student = _task_student(task, vectors[taught], taught_labels, spec.seed)
    else:
        result.student = student = partition_student(vectors[taught], taught_labels, stored, spec.seed)
    result.unseen_choices = [c for c in choices if c not in student.classes]
    rest = np.setdiff1d(np.arange(rows), sample)
    left = budget - sample.size
    if student.model is None or rest.size == 0:
        _ask(teacher, rest[:left], result, role="deferred")
        for i in rest[left:]:
            result.errors[i] = f"cascade_no_student: {student.note}; raise output.cascade.sample_rows"
        if spec.target is not None:
            why = (
                "the teacher was asked about every row"
                if student.model is not None
                else _no_student(spec, student, rows, budget, sample.size, wanted)
            )
            result.target = errors.known_agreement(spec.target, result, why)
        return result
    labels, confidence = student.predict(vectors[rest])
    for i, label, p in zip(rest, labels, confidence, strict=True):
        result.student_labels[i], result.confidence[i] = label, float(p)
        result.labels[i], result.labelled_by[i], result.roles[i] = label, "student", "student"
    if spec.target is not None:
        assert task is not None and task.stored is not None
        _defer_by_target(teacher, spec, spec.target, result, rest, confidence, left, errors, task)
    else:
        _defer_by_threshold(teacher, spec, result, rest, confidence, left)
    return result


def _defer_by_threshold(
    teacher: Teacher, spec: CascadeSpec, result: CascadeResult, rest: np.ndarray, confidence: np.ndarray, left: int
) -> None:
    """`defer_below`: deferral fixes labels, the audit only measures them: the unsure rows get first
    claim on at least half of the `left` teacher rows (the audit's reserve is at most the other half),
    and the audit takes what deferral did not use, so a weak student is still measured."""
    order = np.argsort(confidence, kind="stable")
    unsure = rest[order][confidence[order] < spec.defer_below]
    deferred = unsure[: left - min(spec.audit_rows, left // 2)]
    audit_size = min(spec.audit_rows, left - deferred.size)
    result.over_budget_rows = int(unsure.size - deferred.size)
    trusted = np.setdiff1d(rest, deferred)
    rng = np.random.default_rng(spec.seed + 1)
    audit = np.sort(rng.choice(trusted, size=min(audit_size, trusted.size), replace=False))
    _ask(teacher, np.sort(deferred), result, role="deferred")
    _ask(teacher, audit, result, role="audit")


def _task_student(task: TaskCascade, vectors: np.ndarray, labels: list[str], seed: int) -> Student:
    """The task's student version: the stored one, else one trained on this partition's sample and
    settled as the task's (another partition's, should it have settled first: this one's sample rows
    keep their teacher labels all the same)."""
    if task.stored is not None:
        if task.stored.vectors.shape[1] != vectors.shape[1]:
            raise ValueError(
                f"the stored label_model's vectors have {task.stored.vectors.shape[1]} dimensions, this "
                f"partition's {vectors.shape[1]}: materialize the task's label_model again"
            )
        return task.stored.student
    own = StoredStudent(vectors, labels, seed)
    if own.student.model is None:
        return own.student
    settled = task.settle_student(own)
    return own.student if settled.student_version == own.student_version else settled.student


def _defer_by_target(
    teacher: Teacher,
    spec: CascadeSpec,
    target: TargetSpec,
    result: CascadeResult,
    rest: np.ndarray,
    confidence: np.ndarray,
    left: int,
    errors: _ErrorRows,
    task: TaskCascade,
) -> None:
    """`output.cascade.target`: the rows under the task's threshold for this student version go to the
    teacher when the budget (`left` teacher rows, less the audit's reserve) pays for them; else the least
    sure it pays for (best effort) or none (`on_unreachable: stop`). The audit takes what deferral leaves.
    Without a calibration of this student version the partition makes one first: a random calibration
    set of the rows the student labelled goes to the teacher (pipeline/cascade/target.py), and the task
    keeps the first calibration settled."""
    assert task.stored is not None
    version = task.stored.student_version
    rng = np.random.default_rng(spec.seed + 2)
    held = np.zeros(0, dtype=np.int64)
    calibration = task.calibration_for(version, target)
    if calibration is None:
        held = np.sort(rng.choice(rest, size=min(target.calibration_rows, left, rest.size), replace=False))
        answered = _ask(teacher, held, result, role="calibration")
        asked, labelled = np.isin(rest, held), np.isin(rest, answered)
        # A calibration row the teacher gave no label for is an error row: out of the sample.
        usable = ~asked | labelled
        agrees = labelled & (
            np.asarray(result.student_labels, dtype=object)[rest] == np.asarray(result.labels, dtype=object)[rest]
        )
        made = calibrate(confidence[usable], labelled[usable], agrees[usable], target, version, task.partition)
        calibration = task.settle_calibration(made)
        left -= held.size
    open_rows = ~np.isin(rest, held)
    candidates, open_confidence = rest[open_rows], confidence[open_rows]
    # The audit's rows are set aside first (at most half of what is left), so the guarantee is always
    # checked by an audit; it takes whatever deferral leaves besides.
    audit_reserve = min(spec.audit_rows, left // 2)
    budget = left - audit_reserve
    threshold = calibration.threshold
    under = open_confidence < (math.inf if threshold is None else threshold)
    least_sure = candidates[np.argsort(open_confidence, kind="stable")]
    refused = int(under.sum()) > budget
    stop = refused and spec.on_unreachable == "stop"
    if stop:
        deferred = np.zeros(0, dtype=np.int64)
    elif refused:
        deferred = least_sure[:budget]
    else:
        deferred = candidates[under]
        if "defer_below" in spec.model_fields_set:
            # A floor written beside the target: its unsure rows go to the teacher too, least sure first,
            # while the budget lasts (a stricter threshold only adds teacher labels, so the bound holds).
            extra = ~under & (open_confidence < spec.defer_below)
            floor = candidates[extra][np.argsort(open_confidence[extra], kind="stable")]
            room = max(0, budget - deferred.size)
            deferred = np.concatenate([deferred, floor[:room]])
            result.over_budget_rows = int(max(0, floor.size - room))
    kept = np.setdiff1d(candidates, deferred)
    audit_size = 0 if stop else min(spec.audit_rows, left - deferred.size, kept.size)
    audit = np.sort(rng.choice(kept, size=audit_size, replace=False))
    _ask(teacher, np.sort(deferred), result, role="deferred")
    _ask(teacher, audit, result, role="audit")
    result.target = choice = _partition_choice(
        result, calibration, target, errors, least_sure, int(under.sum()), budget, deferred, best_effort=not stop
    )
    by = np.asarray(result.labelled_by, dtype=object)
    rows = len(result.labels) + errors.rows
    figures = PartitionFigures(
        rows=rows,
        teacher_rows=int((by == "teacher").sum()),
        student_rows=int((by == "student").sum()),
        bounded_agreeing=choice.lower_bound * rows,
        confidence=target.confidence,
    )
    result.task = task.task_figures(version, figures)
    if refused:
        result.over_budget_rows = int(under.sum()) - (0 if stop else budget)


def _partition_choice(
    result: CascadeResult,
    calibration: Calibration,
    target: TargetSpec,
    errors: _ErrorRows,
    least_sure: np.ndarray,
    needed: int,
    budget: int,
    deferred: np.ndarray,
    *,
    best_effort: bool,
) -> TargetChoice:
    """What the partition's labels guarantee (pipeline/cascade/target.py's bound, with its exact
    counts): met, refused by the budget (saying what the budget guarantees) or not met (the error
    rows, or the teacher's failures on deferred rows)."""
    rows = len(result.labels) + errors.rows
    by = np.asarray(result.labelled_by, dtype=object)
    teacher_rows = int((by == "teacher").sum())
    kept_confidence = np.asarray([p for p, who in zip(result.confidence, by, strict=True) if who == "student"])
    bound = partition_bound(teacher_rows, kept_confidence, rows, calibration.kept_bound, calibration.threshold)
    chosen = TargetChoice(
        target=target,
        threshold=calibration.threshold,
        lower_bound=bound,
        deferred_rows=needed,
        calibration_rows=calibration.rows,
        budget=budget,
        met=bound >= target.agreement,
        budget_bound=bound,
        kept_bound=calibration.kept_bound,
        student_version=calibration.student_version,
        calibrated_in=calibration.partition or None,
    )
    failed = sum(result.labelled_by[i] is None for i in deferred)
    asked = (
        errors.asked([result.teacher_costs[i] for i in deferred], "deferred rows")
        if failed
        else errors.asked(result.teacher_costs, "rows asked")
    )
    notes = (*asked, *errors.notes())
    if needed > budget:
        # The budget's threshold: the least sure `budget` rows to the teacher, the rest kept; beside
        # them the sample and calibration rows the teacher labelled.
        cut = float(result.confidence[least_sure[budget]]) if least_sure.size > budget else None
        roles = np.asarray(result.roles, dtype=object)
        before = int(((by == "teacher") & np.isin(roles, ["sample", "calibration"])).sum())
        kept_rows = least_sure.size - budget
        budget_bound = (before + budget + calibration.rate_bound_at(cut) * kept_rows) / rows
        return replace(chosen, met=False, budget_bound=budget_bound, best_effort=best_effort, notes=notes)
    if chosen.met:
        return chosen
    reason = (
        f"{bound:.1%} of the rows agree with the teacher or more, with probability {target.confidence:.0%}, "
        "the error rows and the rows the teacher gave no label for counting as disagreeing"
        + (f" ({failed} deferred rows)" if failed else "")
    )
    return replace(chosen, reason=reason, notes=notes)


@dataclass(frozen=True)
class _ErrorRows:
    """What a target's refusal says of the rows that cannot agree with the teacher: the rows never
    embedded (by error code), and the rows the teacher was asked about and gave no label for."""

    unembedded: dict[str, int]

    @property
    def rows(self) -> int:
        return sum(self.unembedded.values())

    def notes(self) -> tuple[str, ...]:
        if not self.rows:
            return ()
        codes = ", ".join(f"{code}: {count}" for code, count in sorted(self.unembedded.items(), key=lambda c: -c[1]))
        return (f"{self.rows} rows are error rows before the cascade ({codes})",)

    def known_agreement(self, target: TargetSpec, result: CascadeResult, why: str) -> TargetChoice:
        """The target's choice when the student labels no row: the teacher's rows agree, the others
        (error rows, unembedded ones among them) do not."""
        agreeing = sum(by == "teacher" for by in result.labelled_by)
        notes = (*self.asked(result.teacher_costs, "rows it was asked about"), *self.notes())
        return known_agreement(target, agreeing, len(result.labels) + self.rows, why, notes)

    @staticmethod
    def asked(answers: Sequence[TeacherAnswer | None], what: str) -> tuple[str, ...]:
        """The teacher's failures among `answers` (None: a row not asked), by error code with one
        example each (its file, line and cause)."""
        given = [answer for answer in answers if answer is not None]
        failed = [answer.error or "teacher_error: no label" for answer in given if answer.label is None]
        if not failed:
            return ()
        examples: dict[str, str] = {}
        for error in failed:
            code, _, detail = error.partition(": ")
            examples.setdefault(code, detail)
        counts = Counter(error.partition(": ")[0] for error in failed)
        codes = ", ".join(f"{code} {count} (e.g. {examples[code]})" for code, count in counts.most_common())
        return (f"the teacher gave no label for {len(failed)} of the {len(given)} {what}: {codes}",)


def _no_student(spec: CascadeSpec, student: Student, rows: int, budget: int, sample: int, wanted: int) -> str:
    """Why a partition has no student, and what to change: a sample of fewer than two labels, from a
    file too small to give the teacher more (the sample takes at most half the budget), or from too
    small a sample_rows."""
    named = f" ({', '.join(student.classes)})" if student.classes else ""
    held = (
        f"no student was trained: the teacher's sample of {sample} row{'' if sample == 1 else 's'} holds "
        f"{len(student.classes)} distinct label(s){named}, a student needs 2"
    )
    if sample < wanted:
        return (
            f"{held}; {rows} rows give the teacher {budget} (max_teacher_share {spec.max_teacher_share}), a sample of "
            f"at most {max(1, budget // 2)} (sample_rows {spec.sample_rows}): run files of more rows, or raise "
            "output.cascade.max_teacher_share"
        )
    return f"{held}: raise output.cascade.sample_rows"


def _ask(teacher: Teacher, positions: np.ndarray, result: CascadeResult, *, role: str) -> np.ndarray:
    """The teacher's answers for `positions` into `result`; the positions it labelled. A failed
    audit keeps the student's label (the row is then not audited); a failed sample or deferred row is
    an error row, with the teacher's error."""
    if positions.size == 0:
        return positions
    answered = []
    for i, answer in zip(positions, teacher(positions), strict=True):
        result.teacher_costs[i] = answer
        if answer.label is None:
            if role != "audit":
                result.labels[i], result.confidence[i], result.labelled_by[i] = None, None, None
                result.errors[i], result.roles[i] = answer.error or "teacher_error: the teacher gave no label", role
            continue
        result.labels[i], result.confidence[i] = answer.label, answer.confidence
        result.labelled_by[i], result.roles[i] = "teacher", role
        answered.append(i)
    return np.asarray(answered, dtype=np.int64)
