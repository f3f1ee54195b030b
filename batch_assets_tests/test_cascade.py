"""The cascade without an engine, on fixed embeddings (synthetic unit vectors around one centre per
label): the sample covers the clusters, the student's training, deferral and its hard budget, the
audit and its Wilson interval, calibration error, bad input as error rows naming file and line, and
the settings refused at load."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import dagster as dg
import numpy as np
import polars as pl
import pytest

from batch_assets.app.run_outcomes import _quality_notes
from batch_assets.engines.kinds import resolve_settings
from batch_assets.pipeline.calibration import expected_calibration_error
from batch_assets.pipeline.cascade.formats import CascadeRecords
from batch_assets.pipeline.cascade.labels import cascade_outputs, cascade_summary, column_teacher, teacher_task
from batch_assets.pipeline.cascade.run import TeacherAnswer, run_cascade
from batch_assets.pipeline.cascade.student import choose_sample, train_student
from batch_assets.pipeline.cascade.summary import wilson_interval
from batch_assets.pipeline.code_versions import code_versions
from batch_assets.pipeline.inference_requests import InferenceStats
from batch_assets.pipeline.task_formats import task_format, task_format_key
from batch_assets.pipeline.task_spec import PriceSpec, TaskSpecError, load_task_spec
from batch_assets_tests.support import cascade as support

# --- pure pieces ----------------------------------------------------------------------------------


def test_wilson_interval_has_the_textbook_values() -> None:
    low, high = wilson_interval(95, 100)
    assert (round(low, 4), round(high, 4)) == (0.8882, 0.9785)
    assert wilson_interval(0, 0) == (0.0, 1.0)
    low, high = wilson_interval(10, 10)
    assert high == pytest.approx(1.0) and round(low, 4) == 0.7225


def test_expected_calibration_error_of_known_bins() -> None:
    # Bin (0.8, 0.9]: confidence 0.9 twice, one right: |0.9 - 0.5| over 2 of 4 rows; bin (0.2, 0.3]:
    # confidence 0.3 twice, none right: |0.3 - 0| over 2 of 4 rows.
    ece = expected_calibration_error(np.array([0.9, 0.9, 0.3, 0.3]), np.array([1, 0, 0, 0]))
    assert ece == pytest.approx(0.5 * 0.4 + 0.5 * 0.3)
    assert expected_calibration_error(np.array([1.0, 1.0]), np.array([1, 1])) == 0.0
    assert expected_calibration_error(np.zeros(0), np.zeros(0)) is None


def test_the_sample_covers_a_small_cluster_the_head_of_the_file_never_reaches() -> None:
    # 1,900 rows of one kind first, then 100 of another far away: the head holds none of them.
    rng = np.random.default_rng(3)
    common = rng.normal(size=(1900, 8)) + np.array([5.0, *[0.0] * 7])
    rare = rng.normal(size=(100, 8)) + np.array([-5.0, *[0.0] * 7])
    vectors = np.vstack([common, rare])
    sample = choose_sample(vectors, 100, seed=0)
    assert sample.size == 100 and np.unique(sample).size == 100
    assert 1 <= int((sample >= 1900).sum()) <= 15  # about its 5 % share, and never none
    assert np.array_equal(sample, choose_sample(vectors, 100, seed=0))  # the same rows every run
    assert np.array_equal(choose_sample(vectors, 5000), np.arange(2000))


def test_the_student_learns_the_teachers_labels_and_says_how_well() -> None:
    x, y = support.blobs(600, noise=0.6)
    student = train_student(x, [support.CHOICES[i] for i in y])
    assert student.classes == sorted(support.CHOICES) and student.calibrated and student.training_rows == 600
    assert student.cv_agreement is not None and student.cv_agreement > 0.95
    assert student.ece is not None and student.ece < 0.1
    test_x, test_y = support.blobs(400, noise=0.6, seed=0)
    labels, confidence = student.predict(test_x)
    assert np.mean([label == support.CHOICES[i] for label, i in zip(labels, test_y, strict=True)]) > 0.95
    assert ((confidence > 0) & (confidence <= 1)).all()


def test_a_class_with_one_example_trains_an_uncalibrated_student_and_says_why() -> None:
    x, y = support.blobs(60, noise=0.3, classes=3)
    labels = [support.CHOICES[i] for i in y]
    labels[0] = "delta"  # one example of delta
    student = train_student(x, labels)
    assert not student.calibrated and student.model is not None
    assert student.note == "not calibrated: a label has fewer than 3 examples in the sample (delta: 1)"


def test_a_sample_whose_folds_cannot_hold_two_labels_trains_a_student_without_cross_validation() -> None:
    """Eleven rows of one label and one of another (a small sample from a chat teacher): a fold that
    holds the lone row leaves one label to train on; the student is trained, its agreement unmeasured."""
    x, _ = support.blobs(12, noise=0.3, classes=2)
    student = train_student(x, ["alpha"] * 11 + ["beta"])
    assert student.model is not None and student.classes == ["alpha", "beta"]
    assert (student.cv_agreement, student.ece) == (None, None)


def test_one_distinct_label_trains_no_student_and_says_why() -> None:
    student = train_student(np.eye(4, dtype=np.float32), ["alpha"] * 4)
    assert student.model is None
    assert student.note == "the teacher's sample holds 1 distinct label(s) (alpha): no student can be trained"


# --- the cascade ----------------------------------------------------------------------------------


def test_the_teacher_labels_the_sample_the_unsure_rows_and_the_audit_within_its_budget() -> None:
    x, y = support.blobs(2000, noise=1.2, seed=1)
    asked: list[int] = []
    result = run_cascade(
        x,
        support.perfect_teacher(y, asked),
        support.spec(sample_rows=200, audit_rows=50, defer_below=0.95),
        support.CHOICES,
    )
    roles = Counter(result.roles)
    assert roles["sample"] == 200 and roles["audit"] == 50
    # Budget 25 % of 2,000 = 500 teacher rows: 250 left for the rows the student is least sure of.
    assert roles["deferred"] == 250 and len(asked) == 500 == len(set(asked))
    assert result.over_budget_rows > 0  # more rows under 0.95 than the budget took
    deferred = [c for c, r in zip(result.confidence, result.roles, strict=True) if r == "deferred"]
    assert set(deferred) == {1.0}  # a column teacher's label is its final word
    # Rows the teacher saw have the teacher's (right) label.
    for i, role in enumerate(result.roles):
        if role != "student":
            assert result.labels[i] == support.CHOICES[y[i]] and result.labelled_by[i] == "teacher"
    accuracy = np.mean([label == support.CHOICES[i] for label, i in zip(result.labels, y, strict=True)])
    student_only = np.mean(
        [
            label == support.CHOICES[i]
            for label, i, role in zip(result.student_labels, y, result.roles, strict=True)
            if role == "student"
        ]
    )
    assert accuracy > student_only  # deferral moved the hard rows to the teacher
    assert result.errors == [None] * 2000


def test_deferral_takes_the_least_sure_rows_first() -> None:
    x, y = support.blobs(1000, noise=1.2, seed=2)
    result = run_cascade(
        x, support.perfect_teacher(y), support.spec(sample_rows=100, audit_rows=0, defer_below=1.0), support.CHOICES
    )
    student = train_student(
        x[[i for i, r in enumerate(result.roles) if r == "sample"]],
        [support.CHOICES[y[i]] for i, r in enumerate(result.roles) if r == "sample"],
    )
    _, confidence = student.predict(x)
    deferred = [confidence[i] for i, r in enumerate(result.roles) if r == "deferred"]
    kept = [confidence[i] for i, r in enumerate(result.roles) if r == "student"]
    assert len(deferred) == 150 and max(deferred) <= min(kept)


def test_defer_below_zero_sends_nothing_but_sample_and_audit_to_the_teacher() -> None:
    x, y = support.blobs(800, noise=0.5, seed=4)
    result = run_cascade(
        x, support.perfect_teacher(y), support.spec(sample_rows=80, audit_rows=40, defer_below=0.0), support.CHOICES
    )
    assert Counter(result.roles) == {"sample": 80, "audit": 40, "student": 680}
    summary_frame = pl.DataFrame(
        {
            "label": result.labels,
            "labelled_by": result.labelled_by,
            "cascade_role": result.roles,
            "student_label": result.student_labels,
        }
    )
    summary = cascade_summary(summary_frame)
    assert (summary.teacher_rows, summary.student_rows, summary.audited_rows) == (120, 680, 40)
    low, high = summary.agreement_interval
    assert summary.agreement is not None and low <= summary.agreement <= high
    assert summary.metadata()["teacher_share"] == 0.15


def test_a_teacher_error_is_an_error_row_and_a_failed_audit_keeps_the_students_label() -> None:
    x, y = support.blobs(400, noise=0.5, seed=5)

    def teacher(positions: np.ndarray) -> list[TeacherAnswer]:
        return [
            TeacherAnswer(None, f"teacher_error: row {i}") if i % 7 == 0 else TeacherAnswer(support.CHOICES[y[i]])
            for i in positions
        ]

    result = run_cascade(x, teacher, support.spec(sample_rows=40, audit_rows=30, defer_below=0.0), support.CHOICES)
    for i, role in enumerate(result.roles):
        if i % 7 == 0 and role == "sample":
            assert result.labels[i] is None and result.errors[i] == f"teacher_error: row {i}"
        if i % 7 == 0 and role == "student" and result.student_labels[i] is not None:
            assert result.labels[i] == result.student_labels[i] and result.errors[i] is None
    assert sum(1 for e in result.errors if e) == sum(
        1 for i, r in enumerate(result.roles) if r == "sample" and i % 7 == 0
    )
    assert result.student.training_rows == 40 - sum(1 for e in result.errors if e)


def test_a_sample_of_one_label_leaves_the_other_rows_as_error_rows_not_guesses() -> None:
    x = np.random.default_rng(0).normal(size=(100, 8)).astype(np.float32)
    result = run_cascade(
        x, lambda positions: [TeacherAnswer("alpha") for _ in positions], support.spec(sample_rows=10), support.CHOICES
    )
    # Budget 25 rows: a sample of 10 (sample_rows), then 15 more for the teacher; no student for the rest.
    assert Counter(result.labelled_by) == {"teacher": 25, None: 75}
    assert result.unseen_choices == ["beta", "gamma", "delta"]
    errors = [e for e in result.errors if e]
    assert len(errors) == 75 and errors[0].startswith("cascade_no_student: the teacher's sample holds 1 distinct")
    assert errors[0].endswith("raise output.cascade.sample_rows")


def test_an_empty_partition_labels_nothing() -> None:
    result = run_cascade(
        np.zeros((0, 8), dtype=np.float32), support.perfect_teacher(np.zeros(0, int)), support.spec(), support.CHOICES
    )
    assert result.labels == [] and result.student.model is None


# --- frames: the column teacher -----------------------------------------------------------------


def test_a_teacher_column_with_an_unknown_label_is_an_error_row_naming_file_and_line() -> None:
    x, y = support.blobs(300, noise=1.5, seed=6)  # noisy: the student is never sure, every row goes to the teacher
    gold: list[str | None] = [support.CHOICES[i] for i in y]
    gold[0], gold[1] = "Omega", None
    frame = support.embedded_results(x, gold, errors={2: "empty_text: f.csv line 4: the text is empty"})
    teacher = column_teacher(frame, "gold", support.CHOICES, "f.csv")
    assert teacher(np.array([0, 1, 3])) == [
        TeacherAnswer(
            None,
            "teacher_unknown_label: f.csv line 2: the teacher column 'gold' holds 'Omega', not one of output.choices",
        ),
        TeacherAnswer(None, "teacher_no_label: f.csv line 3: the teacher column 'gold' is empty"),
        TeacherAnswer(gold[3]),
    ]
    with pytest.raises(ValueError, match="f.csv: output.cascade.teacher.column 'Gold' is not a column of the file"):
        column_teacher(frame, "Gold", support.CHOICES, "f.csv")
    # Through the cascade: a teacher that is asked about every row (a budget of all rows, none sure enough).
    cascade = support.spec(sample_rows=400, max_teacher_share=1.0, defer_below=1.0, audit_rows=0)
    outputs, measured = cascade_outputs(frame, cascade, support.CHOICES, "f.csv")
    assert outputs["error"][0].startswith("teacher_unknown_label: f.csv line 2:")
    assert outputs["error"][1].startswith("teacher_no_label: f.csv line 3:")
    assert outputs["error"][2] == "empty_text: f.csv line 4: the text is empty"  # untouched, never labelled
    assert outputs["generated_text"][:3].to_list() == [None, None, None]
    assert outputs["generated_text"][3:].to_list() == gold[3:]
    assert measured["student_training_rows"] <= 150  # the sample: half the budget of 299 embedded rows


def test_a_partition_through_the_cascade_kind_gives_every_row_a_label_or_an_error(tmp_path: Path) -> None:
    task = load_task_spec(support.write(tmp_path, support.CASCADE_TASK))
    fmt = task_format(task)
    assert isinstance(fmt, CascadeRecords) and fmt.task.output.pooling
    x, y = support.blobs(1200, noise=1.0, seed=7)
    outputs, measured = cascade_outputs(
        support.embedded_results(x, [support.CHOICES[i] for i in y]), task.output.cascade, support.CHOICES, "f"
    )
    labels = fmt.validate(outputs)
    assert labels.height == 1200 and labels["error"].null_count() == 1200
    assert labels["label"].null_count() == 0 and labels["confidence"].is_between(0, 1).all()
    assert "embedding" not in labels.columns
    metadata = fmt.label_metadata(labels)
    assert metadata["teacher_rows"] + metadata["student_rows"] == 1200
    assert metadata["teacher_rows"] <= 300 and metadata["audited_rows"] == 30
    assert metadata["audit_agreement_95_low"] <= metadata["audit_agreement"] <= metadata["audit_agreement_95_high"]
    assert measured["student_calibrated"] is True and measured["unseen_choices"] == []


def test_the_embedding_cost_counts_the_rows_embedded_not_a_text_refused_before(tmp_path: Path) -> None:
    """Issue 56.6: a text too long for the embedding model was never sent: it costs nothing."""
    task = load_task_spec(support.write(tmp_path, support.CASCADE_TASK))
    priced = task.model_copy(
        update={"engine": task.engine.model_copy(update={"price": PriceSpec(input_per_million_tokens=1.0)})}
    )
    assert priced.output.cascade is not None
    x, y = support.blobs(200, noise=0.5, seed=7)
    too_long = "input_too_long: f line 2: 900 tokens exceed the model's limit of 256 (engine.max_model_len)"
    frame = support.embedded_results(x, [support.CHOICES[i] for i in y], errors={0: too_long})
    frame = frame.with_columns(num_prompt_tokens=pl.Series([900] + [3] * 199))
    outputs, _ = cascade_outputs(frame, priced.output.cascade, support.CHOICES, "f")
    fmt = task_format(priced)
    assert fmt.label_metadata(fmt.validate(outputs))["embedding_cost_usd"] == pytest.approx(199 * 3 / 1e6)


# --- settings -----------------------------------------------------------------------------------


def test_a_cascade_task_loads_with_the_documented_defaults(tmp_path: Path) -> None:
    task = load_task_spec(
        support.write(tmp_path, support.CASCADE_TASK.replace(", sample_rows: 150, audit_rows: 30", ""))
    )
    cascade = task.output.cascade
    assert cascade is not None and task.engine.model == "embedded:all-MiniLM-L6-v2"
    assert (cascade.sample_rows, cascade.defer_below, cascade.max_teacher_share, cascade.audit_rows) == (
        1000,
        0.6,
        0.25,
        200,
    )
    assert task.checks.min_agreement == 0.9
    assert task.output.decision()["cascade"]["teacher"] == {"column": "gold"}


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ("kind: choices", "kind: text", "output.method cascade labels a choices task, not kind 'text'"),
        (
            "{teacher: {column: gold}, sample_rows: 150",
            "{teacher: {column: gold}, teacher_model: m, sample_rows: 150",
            "output.cascade.teacher_model is the chat teacher.s .teacher: llm.; the teacher here is a column",
        ),
        (
            "{teacher: {column: gold}, sample_rows: 150",
            "{teacher: {column: gold}, teacher_price: {input_per_million_tokens: 1.0}, sample_rows: 150",
            "output.cascade.teacher_price is the chat teacher.s .teacher: llm.; the teacher here is a column",
        ),
        (
            'prompt: {template: "{name}"}',
            'prompt: {system: Label it., template: "{name}"}',
            "output.method: cascade embeds the template.s text as it is",
        ),
        ("  cascade: {teacher: {column: gold}, sample_rows: 150, audit_rows: 30}\n", "", "needs output.cascade"),
        ("method: cascade", "method: generate", "output.cascade is read by output.method: cascade only"),
        ("sample_rows: 150", "sample_rows: 1", "greater than or equal to 2"),
        ("audit_rows: 30", "defer_below: 1.5", "less than or equal to 1"),
    ],
)
def test_cascade_settings_that_do_not_fit_are_refused_naming_the_setting(
    tmp_path: Path, old: str, new: str, message: str
) -> None:
    body = support.CASCADE_TASK.replace(old, new)
    assert body != support.CASCADE_TASK
    with pytest.raises(TaskSpecError, match=message.replace("(", r"\(")):
        load_task_spec(support.write(tmp_path, body))


def test_min_agreement_on_a_task_without_a_cascade_is_refused(tmp_path: Path) -> None:
    body = (
        'input: {text_fields: [name]}\nprompt: {template: "{name}"}\n'
        "output: {kind: choices, choices: [a, b]}\nchecks: {min_agreement: 0.9}\n"
    )
    with pytest.raises(TaskSpecError, match="checks.min_agreement applies to output.method: cascade"):
        load_task_spec(support.write(tmp_path, body))


# --- teacher: llm -------------------------------------------------------------------------------

LLM_TASK = support.CASCADE_TASK.replace("{teacher: {column: gold}", "{teacher: llm").replace(
    'prompt: {template: "{name}"}', 'prompt: {system: "Label the name.", template: "{name}"}'
)


def test_an_llm_teacher_is_the_same_prompt_as_a_chat_choices_task_and_versions_the_labels(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("BATCH_ASSETS_MODEL", raising=False)
    task = load_task_spec(support.write(tmp_path, LLM_TASK))
    teacher = teacher_task(task)
    assert teacher.engine.model == "embedded:SmolLM2-135M-Instruct" and teacher.engine.max_model_len == 2048
    assert (teacher.output.kind, teacher.output.method, teacher.output.choices) == (
        "choices",
        "generate",
        support.CHOICES,
    )
    assert teacher.output.has_confidence and teacher.prompt == task.prompt and task_format_key(teacher)[1] == "generate"
    settings = resolve_settings(task)
    assert settings.model == "embedded:all-MiniLM-L6-v2"
    assert settings.teacher is not None and settings.teacher.model == "embedded:SmolLM2-135M-Instruct"
    # Another teacher model changes the labels' code versions (not the formatted prompts').
    other = load_task_spec(
        support.write(tmp_path, LLM_TASK.replace("{teacher: llm", "{teacher: llm, teacher_model: m"), "b")
    )
    assert teacher_task(other).engine.model == "m"
    before, after = code_versions(task, settings), code_versions(other, resolve_settings(other))
    assert before["formatted_prompts"] == after["formatted_prompts"]
    assert before["inference_outputs"] != after["inference_outputs"]
    # BATCH_ASSETS_MODEL routes the teacher (a chat task), not the embedding model.
    monkeypatch.setenv("BATCH_ASSETS_MODEL", "some/chat-model")
    routed = resolve_settings(task)
    assert routed.model == "embedded:all-MiniLM-L6-v2" and routed.teacher is not None
    assert routed.teacher.model == "some/chat-model"
    assert code_versions(task, routed)["inference_outputs"] != before["inference_outputs"]


def test_an_llm_teachers_error_is_an_error_row_never_the_students_label(tmp_path: Path) -> None:
    """The chat teacher's answers come as a choices task's validated labels; one it gave no valid
    choice for is the row's error (sample or deferred row), and the calls are counted."""
    task = load_task_spec(support.write(tmp_path, LLM_TASK))
    x, y = support.blobs(300, noise=1.5, seed=6)
    gold = [support.CHOICES[i] for i in y]
    frame = support.embedded_results(x, gold)
    asked: list[list[int]] = []

    def teach(source: str, rows: pl.DataFrame) -> tuple[pl.DataFrame, InferenceStats]:
        assert source == "f.csv" and {"name", "source_line", "row_id"} <= set(rows.columns)
        assert "generated_text" not in rows.columns  # the embedding's results: not the teacher's
        ids = rows["row_id"].to_list()
        asked.append(ids)
        bad = [i % 50 == 0 for i in ids]
        labels = pl.DataFrame(
            {
                "label": [None if b else g for b, g in zip(bad, rows["gold"], strict=True)],
                "confidence": [None if b else 0.7 for b in bad],
                "error": ["invalid_choice: 'Omega' is not a choice" if b else None for b in bad],
                "num_prompt_tokens": [40] * len(ids),
                "num_generated_tokens": [2] * len(ids),
            }
        )
        # 0.1 s for each row the engine inferred (one came from the cache).
        stats = InferenceStats(
            rows=len(ids), rows_inferred=len(ids) - 1, rows_from_cache=1, engine_seconds=0.1 * (len(ids) - 1)
        )
        return labels, stats

    cascade = task.output.cascade
    assert cascade is not None
    outputs, measured = cascade_outputs(
        frame, cascade.model_copy(update={"max_teacher_share": 1.0}), support.CHOICES, "f.csv", teach
    )
    asked_rows = [i for call in asked for i in call]
    assert len(asked_rows) == len(set(asked_rows)) and len(asked) == 3  # sample, deferred, audit
    assert measured["teacher_rows_inferred"] == len(asked_rows) - 3 and measured["teacher_rows_from_cache"] == 3
    assert measured["teacher_rows_asked"] == len(asked_rows)
    # What each asked row cost is on it; the labels' cost at the engine's price, and against every row.
    asked_outputs = outputs.filter(pl.col("row_id").is_in(asked_rows))
    assert asked_outputs["teacher_prompt_tokens"].to_list() == [40] * len(asked_rows)
    assert asked_outputs["teacher_seconds"].to_list() == pytest.approx([0.1] * len(asked_rows))
    assert outputs.filter(~pl.col("row_id").is_in(asked_rows))["teacher_prompt_tokens"].null_count() == 300 - len(
        asked_rows
    )
    price = PriceSpec(input_per_million_tokens=0.5)
    teacher_price = PriceSpec(input_per_million_tokens=1.0, output_per_million_tokens=4.0)
    priced = task.model_copy(
        update={
            "engine": task.engine.model_copy(update={"price": price}),
            "output": task.output.model_copy(
                update={"cascade": cascade.model_copy(update={"teacher_price": teacher_price})}
            ),
        }
    )
    fmt = task_format(priced)
    cost = fmt.label_metadata(fmt.validate(outputs))
    # 40 prompt tokens at $1/M and 2 generated at $4/M per asked row; the embedding's 3 tokens a row at $0.5/M.
    assert cost["teacher_cost_usd"] == pytest.approx(len(asked_rows) * 48 / 1e6)
    assert cost["all_teacher_cost_usd"] == pytest.approx(300 * 48 / 1e6)
    assert cost["embedding_cost_usd"] == pytest.approx(450 / 1e6)
    assert cost["cascade_cost_usd"] == pytest.approx((len(asked_rows) * 48 + 450) / 1e6)
    unpriced = task_format(task).label_metadata(task_format(task).validate(outputs))
    assert unpriced["all_teacher_engine_seconds"] == pytest.approx(30.0)  # 0.1 s a row, 300 rows
    by_id = dict(zip(outputs["row_id"], outputs["error"], strict=True))
    assert any(error and error.startswith("teacher_invalid_choice") for error in by_id.values())
    for i in asked_rows:
        role = outputs["cascade_role"][i]
        if i % 50 == 0 and role != "student":  # a failed audit keeps the student's label, unaudited
            assert by_id[i] == "teacher_invalid_choice: 'Omega' is not a choice"
            assert outputs["generated_text"][i] is None
        elif i % 50 != 0:
            assert outputs["labelled_by"][i] == "teacher" and outputs["generated_text"][i] == gold[i]
            assert outputs["cumulative_logprob"][i] == pytest.approx(np.log(0.7))


def test_a_small_partition_with_the_default_settings_defers_its_unsure_rows_before_auditing() -> None:
    # Default budget: 25 % of 1,000 = 250, a sample of 125 (half of it): 125 left. The audit (200 by
    # default) is kept to at most half of that when every row is unsure, so deferral gets the other 63.
    x, y = support.blobs(1000, noise=1.2, seed=2)
    roles = Counter(run_cascade(x, support.perfect_teacher(y), support.spec(defer_below=1.0), support.CHOICES).roles)
    assert (roles["sample"], roles["deferred"], roles["audit"]) == (125, 63, 62)
    # With the default defer_below all 30 unsure rows fit, and the audit takes the rest of the budget.
    result = run_cascade(x, support.perfect_teacher(y), support.spec(), support.CHOICES)
    roles = Counter(result.roles)
    assert (roles["sample"], roles["deferred"], roles["audit"], result.over_budget_rows) == (125, 30, 95, 0)


# --- the run's summary --------------------------------------------------------------------------


def test_the_summary_counts_the_students_rows_not_the_error_rows_and_survives_an_empty_file() -> None:
    """The summary's teacher note reads validated_labels' metadata over the run's partitions: error
    rows are neither the teacher's nor the student's, and a run of empty files says nothing of shares."""

    def labelled(instance: dg.DagsterInstance, key: str, **metadata: float) -> None:
        asset = dg.AssetKey(["cascaded", "validated_labels"])
        instance.report_runless_asset_event(dg.AssetMaterialization(asset, partition=key, metadata=metadata))

    with dg.instance_for_test() as instance:
        labelled(instance, "a", rows=100, teacher_rows=20, student_rows=70, audited_rows=10, audit_agreement=0.9)
        labelled(instance, "b", rows=0, teacher_rows=0, student_rows=0, audited_rows=0)
        assert _quality_notes("cascaded", ["a", "b"], instance) == [
            "teacher labelled 20 rows (20%), the student 70",
            "audit agreement 90% [60%-98%] on 10 rows",
        ]
        assert _quality_notes("cascaded", ["b"], instance) == ["teacher labelled 0 rows, the student 0"]
