"""Calibrated confidence (pipeline/calibration.py): the expected calibration error of a partition's
confidence against its gold labels, before and (cross-validated) after an isotonic calibration; the
calibrated value in `confidence` with `output.calibrate: true`, the raw one kept; the setting refused
without a gold column."""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest
from sklearn.isotonic import IsotonicRegression
from sklearn.model_selection import KFold, cross_val_predict

from batch_assets.engines.kinds import resolve_settings
from batch_assets.lib.asset_metadata import labels_metadata
from batch_assets.pipeline.calibration import (
    FOLDS,
    calibrate_confidence,
    calibrated_labels,
    calibration_report,
    expected_calibration_error,
)
from batch_assets.pipeline.code_versions import code_versions
from batch_assets.pipeline.task_formats import task_format
from batch_assets.pipeline.task_spec import TaskSpec, TaskSpecError, load_task_spec

# An overconfident model: at each confidence level the labels are right 0.4 less often than it says.
LEVELS = {0.6: 0.2, 0.7: 0.3, 0.8: 0.4, 0.9: 0.5, 1.0: 0.6}
PER_LEVEL = 80


def overconfident_labels() -> pl.DataFrame:
    """400 gold rows (PER_LEVEL per level, the right share of each labelled `a` like its gold), then a
    row without gold and an error row."""
    confidence: list[float | None] = []
    label: list[str | None] = []
    for level, accuracy in LEVELS.items():
        right = round(accuracy * PER_LEVEL)
        confidence += [level] * PER_LEVEL
        label += ["a"] * right + ["b"] * (PER_LEVEL - right)
    gold: list[str | None] = ["a"] * len(label) + [None, "a"]
    confidence += [0.95, None]
    label += ["b", None]
    rows = len(label)
    return pl.DataFrame(
        {
            "row_id": range(rows),
            "text": [f"row {i}" for i in range(rows)],
            "truth": gold,
            "confidence": confidence,
            "label": label,
            "error": [None] * (rows - 1) + ["no_output: the engine returned no text"],
        },
        schema_overrides={"confidence": pl.Float64, "truth": pl.String, "label": pl.String, "error": pl.String},
    )


def task(**output: object) -> TaskSpec:
    return TaskSpec.model_validate(
        {
            "name": "t",
            "input": {"text_fields": ["text"]},
            "prompt": {"template": "{text}"},
            "output": {"kind": "choices", "choices": ["a", "b"], **output},
            "checks": {"gold_field": "truth"},
        }
    )


def test_an_overconfident_partition_is_calibrated_and_its_error_drops() -> None:
    labels = overconfident_labels()
    report = calibration_report(labels, "truth")
    assert report is not None and report.rows == 400  # the row without gold and the error row left out
    assert report.ece_before == pytest.approx(0.4)
    # Cross-validated: each row's calibrated value was fitted on the other folds.
    assert report.ece_after is not None and report.ece_after < 0.1

    calibrated = calibrate_confidence(labels, "truth")
    assert calibrated.columns == ["row_id", "text", "truth", "raw_confidence", "confidence", "label", "error"]
    assert calibrated["raw_confidence"].to_list() == labels["confidence"].to_list()
    # A gold row's stored confidence is out of fold (fitted on the other folds, the report's folds),
    # never fitted on the row itself: the stored gold rows' ECE is the report's "after" number, not
    # the in-sample 0 that a fit on every gold row would give them.
    gold = calibrated.head(400)
    correct = (gold["label"] == gold["truth"]).to_numpy().astype(float)
    folds = KFold(FOLDS, shuffle=True, random_state=0)
    isotonic = IsotonicRegression(y_min=0.0, y_max=1.0, out_of_bounds="clip")
    held_out = cross_val_predict(isotonic, gold["raw_confidence"].to_numpy(), correct, cv=folds)
    assert gold["confidence"].to_list() == pytest.approx(list(held_out))
    assert expected_calibration_error(gold["confidence"].to_numpy(), correct) == pytest.approx(report.ece_after)
    assert expected_calibration_error(gold["confidence"].to_numpy(), correct) > 0.001
    # A row without gold is mapped by the fit on every gold row, which makes each level its share of
    # right labels (0.95 lies between the levels 0.9 and 1.0: 0.55); an error row stays null.
    assert calibrated["confidence"][400] == pytest.approx(0.55)
    assert calibrated["confidence"][401] is None
    # The report reads the raw column of calibrated labels: the same numbers from the stored table.
    assert calibration_report(calibrated, "truth") == report


def test_validated_labels_metadata_reports_the_error_before_and_after() -> None:
    labels = calibrated_labels(overconfident_labels(), task(calibrate=True))
    metadata = labels_metadata(labels, task(calibrate=True), task_format(task(calibrate=True)))
    assert metadata["calibration_rows"] == 400
    assert metadata["calibration_error_raw"] == pytest.approx(0.4)
    assert metadata["calibration_error_calibrated"] < 0.1
    assert metadata["calibration_method"] == "isotonic"
    # Without `calibrate` the labels are left alone, and their error is reported all the same.
    plain = calibrated_labels(overconfident_labels(), task())
    assert "raw_confidence" not in plain.columns
    assert plain["confidence"].to_list() == overconfident_labels()["confidence"].to_list()
    assert labels_metadata(plain, task(), task_format(task()))["calibration_error_raw"] == pytest.approx(0.4)


def test_too_few_gold_rows_keep_the_raw_confidence_and_say_why() -> None:
    labels = overconfident_labels().tail(12)  # 10 gold rows, the row without gold, the error row
    calibrated = calibrate_confidence(labels, "truth")
    assert calibrated["confidence"].to_list() == labels["confidence"].to_list()
    report = calibration_report(calibrated, "truth")
    assert report is not None and (report.rows, report.ece_after) == (10, None)
    assert report.metadata()["calibration_note"] == (
        "10 gold rows with a label and a confidence: a calibration needs at least 20"
    )


def test_calibrate_changes_the_labels_version_not_the_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BATCH_ASSETS_MODEL", raising=False)
    plain, calibrated = (code_versions(t, resolve_settings(t)) for t in (task(), task(calibrate=True)))
    assert calibrated["inference_outputs"] == plain["inference_outputs"]  # outputs and caches stay valid
    assert calibrated["validated_labels"] != plain["validated_labels"]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            "output: {kind: choices, choices: [a, b], calibrate: true}\n",
            "line 3: output.calibrate fits the confidence to known labels: set checks.gold_field",
        ),
        (
            "output: {kind: text, calibrate: true}\nchecks: {gold_field: truth}\n",
            "output.calibrate maps the labels' confidence: it needs `kind: choices` or `regex`",
        ),
        (
            "output: {kind: choices, choices: [a, b], confidence: false, calibrate: true}\nchecks: {gold_field: t}\n",
            "output.calibrate maps the labels' confidence",
        ),
    ],
)
def test_calibrate_is_refused_at_load_where_it_cannot_apply(tmp_path: Path, body: str, message: str) -> None:
    path = tmp_path / "t.yaml"
    path.write_text("input: {text_fields: [text]}\nprompt: {template: '{text}'}\n" + body)
    with pytest.raises(TaskSpecError) as refused:
        load_task_spec(path)
    assert str(refused.value).startswith(f"{path}: ") and message in str(refused.value)


def test_a_materialized_partition_stores_and_reports_the_calibration(data_dir: Path) -> None:
    """validated_labels materialized through Dagster from a stored inference_outputs partition: the
    parquet file has the calibrated `confidence` and `raw_confidence`; the asset and the check
    `accuracy_at_least` record the error before and after."""

    import dagster as dg

    from batch_assets.lib.task_definitions import build_definitions, pipeline_job_name
    from batch_assets.storage.drop_files import partition_key_for, partitions_def_name

    labels = overconfident_labels()
    outputs = labels.select(
        "row_id",
        pl.lit(1).alias("source_line"),
        "text",
        "truth",
        generated_text=pl.col("label"),
        finish_reason=pl.lit("stop"),
        num_prompt_tokens=pl.lit(3, pl.Int64),
        num_generated_tokens=pl.lit(1, pl.Int64),
        error="error",
        cumulative_logprob=pl.col("confidence").log(),
    )
    spec = task(calibrate=True)
    key = partition_key_for("gold.jsonl")
    stored = data_dir / "storage" / spec.name / "inference_outputs" / f"{key}.parquet"
    stored.parent.mkdir(parents=True)
    outputs.write_parquet(stored)
    raw = data_dir / "storage" / spec.name / "raw_prompts" / f"{key}.parquet"
    raw.parent.mkdir(parents=True)
    outputs.select("row_id", "source_line", "text", "truth").write_parquet(raw)  # one_row_per_record reads it
    job = build_definitions(tasks=[spec]).resolve_job_def(pipeline_job_name(spec.name))
    with dg.DagsterInstance.get() as instance:
        instance.add_dynamic_partitions(partitions_def_name(spec.name), [key])
        result = job.execute_in_process(
            instance=instance,
            partition_key=key,
            raise_on_error=False,
            asset_selection=[dg.AssetKey([spec.name, "validated_labels"])],
        )
        assert result.success
        [materialization] = result.asset_materializations_for_node("t__validated_labels")
        checks = {e.check_name: e for e in result.get_asset_check_evaluations()}
    metadata = {name: value.value for name, value in materialization.metadata.items()}
    assert metadata["calibration_error_raw"] == pytest.approx(0.4)
    assert metadata["calibration_error_calibrated"] < 0.1
    check = {name: value.value for name, value in checks["accuracy_at_least"].metadata.items()}
    assert check["calibration_error_raw"] == metadata["calibration_error_raw"]
    assert check["calibration_error_calibrated"] == metadata["calibration_error_calibrated"]
    written = pl.read_parquet(data_dir / "storage" / spec.name / "validated_labels" / f"{key}.parquet")
    assert written["raw_confidence"].head(400).to_list() == pytest.approx(labels["confidence"].head(400).to_list())
    # The row without gold (raw 0.95) by the fit on every gold row; the gold rows out of fold, so
    # their stored error is the reported one.
    assert written["confidence"][400] == pytest.approx(0.55)
    gold = written.head(400)
    correct = (gold["label"] == gold["truth"]).to_numpy().astype(float)
    stored_error = expected_calibration_error(gold["confidence"].to_numpy(), correct)
    assert round(stored_error, 4) == metadata["calibration_error_calibrated"]
