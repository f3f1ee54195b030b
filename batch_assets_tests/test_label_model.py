"""A cascade task's stored student (`<task>/label_model`) without an engine, on fixed embeddings: a
partition that starts from it asks the teacher for no sample (or only what it lacks), the model is
trained on every teacher label of the partitions of the task's version once, stored by version with
its training rows and read back (retrained where scikit-learn changed), the asset on a real Dagster
instance and its automation; and what the labels cost in dollars or engine seconds."""

from __future__ import annotations

import json
import threading
from collections import Counter
from dataclasses import replace
from pathlib import Path

import dagster as dg
import numpy as np
import polars as pl
import pytest

from batch_assets.app.run_outcomes import _quality_notes
from batch_assets.engines.kinds import resolve_settings
from batch_assets.lib.automation import CODE_VERSION_TAG
from batch_assets.lib.task_definitions import build_definitions
from batch_assets.pipeline.cascade.label_model import LabelModel, LabelModelError, fit_label_model, training_digest
from batch_assets.pipeline.cascade.labels import cascade_outputs
from batch_assets.pipeline.cascade.run import run_cascade
from batch_assets.pipeline.cascade.student import StoredStudent
from batch_assets.pipeline.cascade.summary import CascadeSummary, TeacherCost
from batch_assets.pipeline.cascade.target import Calibration, PartitionFigures, TaskFigures, calibrate
from batch_assets.pipeline.code_versions import code_versions
from batch_assets.pipeline.task_spec import PriceSpec, load_task_spec
from batch_assets.pipeline.task_spec.cascade import TargetSpec
from batch_assets.storage.drop_files import partitions_def_name
from batch_assets.storage.label_models import (
    label_model_dir,
    read_calibration,
    read_label_model,
    read_training_rows,
    record_cost,
    record_figures,
    settle_calibration,
    settle_label_model,
    write_label_model,
)
from batch_assets.storage.locations import output_path
from batch_assets_tests.support.cascade import (
    CHOICES,
    blobs,
    cascade_task_yaml,
    embedded_results,
    perfect_teacher,
    spec,
)

TASK = cascade_task_yaml(100, 20, "automation: {rematerialize_stale: true}\n")


def partition_outputs(x: np.ndarray, y: np.ndarray, **settings) -> pl.DataFrame:
    """A partition's inference_outputs as the cascade kind writes them, with a column teacher."""
    outputs, _ = cascade_outputs(embedded_results(x, [CHOICES[i] for i in y]), spec(**settings), CHOICES, "f.csv")
    return outputs


# --- a partition that starts from a stored student ------------------------------------------------


def test_a_stored_student_takes_the_place_of_the_partitions_sample() -> None:
    x, y = blobs(1200, noise=1.0, seed=4)
    labels = [CHOICES[i] for i in y[:150]]
    stored = StoredStudent(x[:150], labels, 0)
    asked: list[int] = []
    settings = spec(sample_rows=100, audit_rows=30)
    result = run_cascade(x[150:], perfect_teacher(y[150:], asked), settings, CHOICES, stored)
    roles = Counter(result.roles)
    # 150 stored rows cover sample_rows: no sample; the budget (262 of 1,050 rows) goes to the rest.
    assert roles["sample"] == 0 and roles["audit"] == 30 and roles["deferred"] > 0
    assert len(asked) == roles["deferred"] + roles["audit"]
    assert result.student is stored.student  # used as stored: the partition added no training row
    # Without it the same partition samples 100 rows.
    assert Counter(run_cascade(x[150:], perfect_teacher(y[150:]), settings, CHOICES).roles)["sample"] == 100
    # A stored student of 60 rows: the partition samples the 40 it lacks and retrains on all 100.
    few = StoredStudent(x[:60], labels[:60], 0)
    result = run_cascade(x[150:], perfect_teacher(y[150:]), settings, CHOICES, few)
    assert Counter(result.roles)["sample"] == 40 and result.student.training_rows == 100
    # The stored rows' own student was never trained: the partition's student is the only training.
    assert "student" not in vars(few)
    with pytest.raises(ValueError, match="the stored label_model's vectors have 24 dimensions, this partition's 8"):
        run_cascade(x[150:, :8], perfect_teacher(y[150:]), settings, CHOICES, stored)


# --- training and storing it ------------------------------------------------------------------------


def test_the_label_model_learns_every_teacher_label_of_its_partitions_once() -> None:
    x, y = blobs(1000, noise=1.0, seed=5)
    first, second = partition_outputs(x[:500], y[:500]), partition_outputs(x[500:], y[500:])
    taught = [int((frame["labelled_by"] == "teacher").sum()) for frame in (first, second)]
    # The same file dropped twice (another partition of the same rows) adds no training row.
    model = fit_label_model({"b": second, "a": first, "a-again": first}, "v1", seed=0)
    assert model.training_rows == sum(taught) and model.partitions == ["a", "a-again", "b"]
    teacher = first.filter(pl.col("labelled_by") == "teacher")
    assert set(model.labels) <= set(CHOICES) and model.labels[: teacher.height] == teacher["generated_text"].to_list()
    metadata = model.metadata()
    assert (metadata["training_rows"], metadata["partition_count"], metadata["task_version"]) == (sum(taught), 3, "v1")
    assert metadata["classes"] == sorted(CHOICES) and metadata["calibrated"] is True
    assert 0.5 < metadata["cv_agreement"] <= 1 and 0 <= metadata["calibration_error"] < 0.5
    assert metadata["digest"] == training_digest(model.vectors, model.labels) and len(metadata["digest"]) == 12
    # Teacher errors are no training rows; nothing to learn from is said, naming what to do.
    failed = first.with_columns(error=pl.lit("teacher_no_label: f.csv line 2: empty"))
    with pytest.raises(LabelModelError, match=r"no materialized inference_outputs partition .*\(v1\)"):
        fit_label_model({"a": failed}, "v1")
    one_label = first.with_columns(generated_text=pl.lit("alpha"))
    with pytest.raises(LabelModelError, match=r"1 distinct label\(s\) \(alpha\).*raise output.cascade.sample_rows"):
        fit_label_model({"a": one_label}, "v1")


def test_a_stored_label_model_reads_back_as_it_was_written(data_dir: Path) -> None:
    x, y = blobs(1000, noise=1.0, seed=6)
    model = fit_label_model({"a": partition_outputs(x[:500], y[:500])}, "v1")
    folder = write_label_model("cascaded", model)
    assert folder == label_model_dir("cascaded", "v1") / model.digest
    assert read_label_model("cascaded", "v2", print) is None  # another task version has none
    back = read_label_model("cascaded", "v1", print)
    assert back is not None and (back.digest, back.partitions, back.labels) == (model.digest, ["a"], model.labels)
    assert back.student.cv_agreement == model.student.cv_agreement
    assert back.student.predict(x[500:])[0] == model.student.predict(x[500:])[0]
    # A newer model replaces it: current.json names it; the previous folder stays (a run that read
    # current.json just before the switch still finds it); one older than that is removed.
    newer = fit_label_model({"a": partition_outputs(x[:500], y[:500]), "b": partition_outputs(x[500:], y[500:])}, "v1")
    write_label_model("cascaded", newer)
    current = label_model_dir("cascaded", "v1") / "current.json"
    assert json.loads(current.read_text())["digest"] == newer.digest
    names = sorted(p.name for p in label_model_dir("cascaded", "v1").iterdir())
    assert names == sorted(["current.json", model.digest, newer.digest])
    newest = fit_label_model({"b": partition_outputs(x[500:], y[500:])}, "v1")
    write_label_model("cascaded", newest)
    names = sorted(p.name for p in label_model_dir("cascaded", "v1").iterdir())
    assert names == sorted(["current.json", newer.digest, newest.digest])
    write_label_model("cascaded", newer)
    # Nothing is unpickled: the student is trained again from the stored rows, to the same labels.
    assert not list(label_model_dir("cascaded", "v1").rglob("*.joblib"))
    retrained = read_label_model("cascaded", "v1", print)
    assert retrained is not None and retrained.student.predict(x)[0] == newer.student.predict(x)[0]
    pinned = json.loads(current.read_text())
    # A digest this project never writes (a path) is refused before anything is read.
    current.write_text(json.dumps(pinned | {"digest": "../../elsewhere"}))
    refused: list[str] = []
    assert read_label_model("cascaded", "v1", refused.append) is None
    assert refused and "is not one this project writes" in refused[0]
    # A current model whose folder is gone (removed under a reader) is a warning, not a failed run.
    current.write_text(json.dumps(pinned | {"digest": "0123456789ab"}))
    gone: list[str] = []
    assert read_label_model("cascaded", "v1", gone.append) is None
    assert gone and "could not be read" in gone[0]
    # Training rows that do not match their digest are not used, and the warning says why.
    current.write_text(json.dumps(pinned | {"digest": model.digest}))
    (label_model_dir("cascaded", "v1") / model.digest).mkdir(exist_ok=True)
    (label_model_dir("cascaded", "v1") / newer.digest / "training.parquet").replace(
        label_model_dir("cascaded", "v1") / model.digest / "training.parquet"
    )
    warnings: list[str] = []
    assert read_label_model("cascaded", "v1", warnings.append) is None
    assert warnings and "do not match their digest; not used: materialize label_model again" in warnings[0]


def test_partitions_settling_in_parallel_agree_on_one_student_and_one_calibration(data_dir: Path) -> None:
    """Issue 59: eight partitions with no stored student settle their own at once (threads of one
    process and the file lock: as two runs of a backfill would); every one gets the same model, then
    the same calibration, whatever each brought, and what each labelled is kept for the task."""
    x, y = blobs(1600, noise=1.0, seed=6)
    models = [
        LabelModel(x[i * 200 : (i + 1) * 200], [f"c{j}" for j in y[i * 200 : (i + 1) * 200]], 0, [f"p{i}"], "v1", "")
        for i in range(8)
    ]
    models = [replace(m, digest=m.student_version) for m in models]
    target = TargetSpec(agreement=0.9, confidence=0.9)
    settled_models: list[LabelModel] = []
    settled_calibrations: list[Calibration] = []

    def settle(model: LabelModel) -> None:
        kept = settle_label_model("cascaded", model, print)
        settled_models.append(kept)
        confidence = np.linspace(0.1, 1.0, 50) + int(model.partitions[0][1:]) / 1000
        made = calibrate(
            confidence, np.ones(50, dtype=bool), confidence > 0.2, target, kept.digest, model.partitions[0]
        )
        settled_calibrations.append(settle_calibration("cascaded", "v1", made, print))

    threads = [threading.Thread(target=settle, args=(model,)) for model in models]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    digests = {model.digest for model in settled_models}
    assert len(digests) == 1 and digests <= {model.digest for model in models}
    assert len({(c.partition, c.threshold) for c in settled_calibrations}) == 1
    [digest] = digests
    stored = read_calibration("cascaded", "v1", digest, print)
    assert stored is not None and stored == settled_calibrations[0] and stored.matches(digest, target)
    assert read_calibration("cascaded", "v1", "0123456789ab", print) is None  # another student version
    # Each partition's figures are kept once (a re-run replaces its own); the cost is added later.
    figures = PartitionFigures(rows=100, teacher_rows=20, student_rows=80, bounded_agreeing=92.0, confidence=0.9)
    record_figures("cascaded", "v1", digest, "p0", figures)
    record_figures("cascaded", "v1", digest, "p1", replace(figures, teacher_rows=30))
    every = record_figures("cascaded", "v1", digest, "p1", replace(figures, teacher_rows=10))
    task = TaskFigures.of(digest, every)
    assert (task.partitions, task.rows, task.teacher_rows, task.lower_bound) == (2, 200, 30, 0.92)
    assert task.cost_per_1000_correct_usd is None
    record_cost("cascaded", "v1", digest, "p0", 0.5)
    priced_rows = record_cost("cascaded", "v1", digest, "p1", 1.34)
    assert priced_rows is not None
    priced = TaskFigures.of(digest, priced_rows)
    assert priced.cost_per_1000_correct_usd == pytest.approx(1.84 / 184 * 1000)
    assert record_cost("cascaded", "v1", digest, "ran-alone", 1.0) is None  # it recorded no figures


def write_partition(task: str, key: str, teacher: dict[str, int], rng: np.random.Generator) -> pl.DataFrame:
    """A cascade partition's inference_outputs file, in row groups of 16 rows: `teacher` rows per
    label, 5 teacher errors and 50 student rows, shuffled. Each embedding says its row and label."""
    kinds = [("teacher", label, None) for label, count in teacher.items() for _ in range(count)]
    kinds += [("teacher", None, "teacher_no_label: f.csv line 2: empty")] * 5 + [("student", "alpha", None)] * 50
    kinds = [kinds[i] for i in rng.permutation(len(kinds))]
    frame = pl.DataFrame(
        {
            "row_id": range(len(kinds)),
            "embedding": [[float(label == "beta"), i / 100, rng.normal()] for i, (_, label, _) in enumerate(kinds)],
            "generated_text": [label for _, label, _ in kinds],
            "labelled_by": [by for by, _, _ in kinds],
            "error": [error for _, _, error in kinds],
        },
        schema_overrides={"embedding": pl.Array(pl.Float32, 3), "error": pl.String},
    )
    path = output_path(task, "inference_outputs", key)
    path.parent.mkdir(parents=True, exist_ok=True)
    frame.write_parquet(path.path, row_group_size=16)
    return frame


def test_the_label_model_reads_teacher_rows_alone_and_at_most_its_cap_spread_over_partitions_and_labels(
    data_dir: Path,
) -> None:
    """Before, every partition's whole inference_outputs (each row's embedding) was read and every
    teacher label trained on. Now the files' teacher rows alone come back, and past
    `max_training_rows` each label keeps its share (alpha 70 of 120 rows: 35 of 60), spread evenly
    over the partitions that have it: a partition with fewer rows than its share keeps them all."""
    rng = np.random.default_rng(0)
    teacher = {"a": {"alpha": 40, "beta": 20}, "b": {"alpha": 10, "beta": 30}, "c": {"alpha": 20}}
    files = {key: write_partition("capped", key, counts, rng) for key, counts in teacher.items()}

    rows = read_training_rows("capped", ["a", "b", "c"], 60, seed=0)
    spread = {key: dict(sorted(Counter(frame["generated_text"]).items())) for key, frame in rows.items()}
    # alpha's 35: b's 10 (all it has), then c 12 and a 13; beta's 25: a 12, b 13.
    assert spread == {"a": {"alpha": 13, "beta": 12}, "b": {"alpha": 10, "beta": 13}, "c": {"alpha": 12}}
    for key, frame in rows.items():
        assert frame["labelled_by"].to_list() == ["teacher"] * frame.height
        assert frame["error"].null_count() == frame.height
        # Each embedding is that of the file's row with the same label (row order kept).
        positions = [round(vector[1] * 100) for vector in frame["embedding"].to_list()]
        assert positions == sorted(positions)
        assert files[key]["generated_text"].gather(positions).to_list() == frame["generated_text"].to_list()
        assert files[key]["embedding"].gather(positions).to_list() == frame["embedding"].to_list()
    assert read_training_rows("capped", ["a", "b", "c"], 60, seed=0)["a"].equals(rows["a"])  # the same rows again
    # Under the cap: every teacher label, and the model trains on the cap's rows.
    assert {key: frame.height for key, frame in read_training_rows("capped", ["a", "b", "c"], 1000, 0).items()} == {
        "a": 60,
        "b": 40,
        "c": 20,
    }
    model = fit_label_model(rows, "v1", seed=0)
    assert (model.training_rows, Counter(model.labels)) == (60, Counter(alpha=35, beta=25))


# --- the asset on a Dagster instance ----------------------------------------------------------------


def test_the_label_model_asset_learns_the_partitions_of_its_version_and_is_retrained_after_new_ones(
    data_dir: Path, tmp_path: Path
) -> None:
    path = tmp_path / "cascaded.yaml"
    path.write_text(TASK)
    task = load_task_spec(path)
    version = code_versions(task, resolve_settings(task))["inference_outputs"]
    defs = build_definitions(tasks=[task])
    key, upstream = dg.AssetKey(["cascaded", "label_model"]), dg.AssetKey(["cascaded", "inference_outputs"])
    x, y = blobs(1000, noise=1.0, seed=8)
    outputs = {"a": partition_outputs(x[:500], y[:500]), "old": partition_outputs(x[500:], y[500:])}

    def materialized(instance: dg.DagsterInstance, partition: str, code_version: str) -> None:
        """A partition of inference_outputs as a run leaves it: its file, and its materialization."""
        target = output_path("cascaded", "inference_outputs", partition)
        target.parent.mkdir(parents=True, exist_ok=True)
        outputs[partition].write_parquet(target.path)
        materialization = dg.AssetMaterialization(upstream, partition=partition, tags={CODE_VERSION_TAG: code_version})
        instance.report_runless_asset_event(materialization)

    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions(partitions_def_name("cascaded"), ["a", "old"])
        materialized(instance, "old", "an-earlier-version")
        first = dg.evaluate_automation_conditions(defs=defs, instance=instance)
        # New teacher labels upstream: the automation sensor's condition requests a retraining, once.
        materialized(instance, "a", version)
        second = dg.evaluate_automation_conditions(defs=defs, instance=instance, cursor=first.cursor)
        assert second.get_num_requested(key) == 1
        third = dg.evaluate_automation_conditions(defs=defs, instance=instance, cursor=second.cursor)
        assert third.get_num_requested(key) == 0
        result = dg.materialize([defs.get_assets_def(key)], instance=instance)
        assert result.success
        [event] = result.asset_materializations_for_node("cascaded__label_model")
        metadata = {k: v.value for k, v in event.metadata.items()}
    # Not in the task's partitioned job: it is materialized on its own.
    assert key not in set(defs.resolve_job_def("cascaded_pipeline").asset_layer.executable_asset_keys)
    teacher_rows = int((outputs["a"]["labelled_by"] == "teacher").sum())
    assert (metadata["training_rows"], metadata["partitions"], metadata["other_version_partitions"]) == (
        teacher_rows,
        ["a"],
        ["old"],
    )
    assert metadata["task_version"] == version and metadata["classes"] == sorted(CHOICES)
    stored = read_label_model("cascaded", version, print)
    assert stored is not None and stored.digest == metadata["digest"] and stored.training_rows == teacher_rows


def test_a_target_task_s_label_model_keeps_its_student_until_the_teacher_labels_double(
    data_dir: Path, tmp_path: Path
) -> None:
    """Issue 59: each new student version of a cascade by target pays for a calibration, so the
    label_model asset (the sensor retrains it after every partition) keeps the current student until
    the partitions hold twice its training rows in teacher labels, and says so."""
    path = tmp_path / "cascaded.yaml"
    path.write_text(TASK.replace("audit_rows: 20}", "audit_rows: 20, target: {agreement: 0.9, confidence: 0.9}}"))
    task = load_task_spec(path)
    version = code_versions(task, resolve_settings(task))["inference_outputs"]
    defs = build_definitions(tasks=[task])
    key, upstream = dg.AssetKey(["cascaded", "label_model"]), dg.AssetKey(["cascaded", "inference_outputs"])
    x, y = blobs(2000, noise=1.0, seed=8)
    bounds = {"a": (0, 800), "b": (800, 1200), "c": (1200, 2000)}
    outputs = {name: partition_outputs(x[lo:hi], y[lo:hi]) for name, (lo, hi) in bounds.items()}

    def materialized(instance: dg.DagsterInstance, partition: str) -> None:
        target = output_path("cascaded", "inference_outputs", partition)
        target.parent.mkdir(parents=True, exist_ok=True)
        outputs[partition].write_parquet(target.path)
        event = dg.AssetMaterialization(upstream, partition=partition, tags={CODE_VERSION_TAG: version})
        instance.report_runless_asset_event(event)

    def retrain(instance: dg.DagsterInstance) -> dict:
        result = dg.materialize([defs.get_assets_def(key)], instance=instance)
        assert result.success
        [event] = result.asset_materializations_for_node("cascaded__label_model")
        return {k: v.value for k, v in event.metadata.items()}

    teacher = {name: int((frame["labelled_by"] == "teacher").sum()) for name, frame in outputs.items()}
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions(partitions_def_name("cascaded"), list("abc"))
        materialized(instance, "a")
        first = retrain(instance)  # none stored: trained
        materialized(instance, "b")
        kept = retrain(instance)  # a and b hold under twice a's labels: kept
        materialized(instance, "c")
        grown = retrain(instance)  # a, b and c hold at least twice: retrained
    assert first["training_rows"] == teacher["a"] and "not_retrained" not in first
    assert kept["digest"] == first["digest"] and kept["not_retrained"].startswith(
        f"kept: the partitions hold {teacher['a'] + teacher['b']} teacher labels, under 2 x the current student's "
        f"{teacher['a']} training rows"
    )
    assert teacher["a"] + teacher["b"] < 2 * teacher["a"] <= sum(teacher.values())
    assert grown["digest"] != first["digest"] and grown["training_rows"] == sum(teacher.values())


# --- what the labels cost -----------------------------------------------------------------------------


def test_the_labels_cost_each_model_at_its_own_price_and_in_engine_seconds_without() -> None:
    """`engine.price` is the embedding model's; before, it priced the chat teacher's tokens too (a
    chat model's cost many times more). The teacher is in dollars at `output.cascade.teacher_price`."""
    spent = TeacherCost(rows=25, prompt_tokens=2500, generated_tokens=100, timed_rows=10, seconds=2.0)
    summary = CascadeSummary(100, 20, 75, 5, 10, 9, spent, embedding_prompt_tokens=1000)
    embedding_priced = replace(summary, price=PriceSpec(input_per_million_tokens=2.0))
    # Embedding 1,000 × $2/M; the teacher, unpriced, in engine seconds: 2 s over 10 inferred rows,
    # times the 25 rows asked and the 100 rows.
    seconds = {"teacher_engine_seconds": 5.0, "all_teacher_engine_seconds": 20.0}
    assert embedding_priced.cost_metadata() == {"embedding_cost_usd": 0.002, **seconds}
    priced = replace(
        embedding_priced, teacher_price=PriceSpec(input_per_million_tokens=4.0, output_per_million_tokens=10.0)
    )
    # Teacher 2,500 × $4/M + 100 × $10/M; every row: its $0.011 / 25 rows × 100.
    assert priced.cost_metadata() == {
        "embedding_cost_usd": 0.002,
        "teacher_cost_usd": 0.011,
        "all_teacher_cost_usd": 0.044,
        "cascade_cost_usd": 0.013,
        # Per 1,000 rows agreeing with the teacher: 20 teacher rows and 0.9 (the audit) × 75 student rows.
        "cost_per_1000_correct_usd": round(0.013 / 87.5 * 1000, 6),
        "all_teacher_cost_per_1000_correct_usd": 0.44,
    }
    assert priced.metadata()["cost_vs_all_teacher"] == 0.2  # the share, as before
    # The teacher's price alone: its dollars, no embedding cost and so no total.
    assert replace(priced, price=None).cost_metadata() == {"teacher_cost_usd": 0.011, "all_teacher_cost_usd": 0.044}
    # No price: engine seconds.
    assert summary.cost_metadata() == seconds
    # A column teacher costs nothing measurable: the share alone, and the embedding's price.
    column = CascadeSummary(100, 20, 75, 5, 10, 9, embedding_prompt_tokens=1000)
    assert column.cost_metadata() == {}
    assert replace(column, price=priced.price).cost_metadata() == {"embedding_cost_usd": 0.002}


def test_the_run_summary_says_what_the_labels_cost_against_the_teacher_on_every_row() -> None:
    def labelled(instance: dg.DagsterInstance, key: str, **metadata: float) -> None:
        asset = dg.AssetKey(["cascaded", "validated_labels"])
        instance.report_runless_asset_event(dg.AssetMaterialization(asset, partition=key, metadata=metadata))

    counts = {"rows": 100, "teacher_rows": 20, "student_rows": 80, "audited_rows": 0}
    with dg.instance_for_test() as instance:
        labelled(instance, "a", **counts, cascade_cost_usd=0.008, all_teacher_cost_usd=0.024)
        labelled(instance, "b", **counts, cascade_cost_usd=0.002, all_teacher_cost_usd=0.026)
        labelled(instance, "c", **counts, teacher_engine_seconds=5.0, all_teacher_engine_seconds=20.0)
        notes = _quality_notes("cascaded", ["a", "b"], instance)
        assert notes[-1] == "cost $0.0100 against $0.0500 with the teacher on every row"
        assert _quality_notes("cascaded", ["c"], instance)[-1] == "teacher engine 5.0 s against 20.0 s on every row"
        # The embedding priced, the teacher not: each as measured.
        seconds = {"teacher_engine_seconds": 5.0, "all_teacher_engine_seconds": 20.0}
        labelled(instance, "d", **counts, embedding_cost_usd=0.002, **seconds)
        assert _quality_notes("cascaded", ["d"], instance)[-2:] == [
            "embedding cost $0.0020",
            "teacher engine 5.0 s against 20.0 s on every row",
        ]
