"""The shipped `industry_cascade` sample on the real engine (the embedded all-MiniLM-L6-v2): one run
checks that every row gets a label and who gave it, that the teacher stays within its budget, the
student's measurements and the audit reach the metadata and the `agreement_at_least` check, and that
accuracy against gold is reported; the task's label_model is then trained on that partition's teacher
labels; a second file in the same instance starts from it (no teacher sample), has teacher rows with an
unknown and an empty label (error rows naming file and line) and repeats the sample's names (embedded
once: from the result cache)."""

from __future__ import annotations

from pathlib import Path

import dagster as dg
import polars as pl
import pytest

from batch_assets.app.run_outcomes import run_outcomes
from batch_assets.app.runner import run_partitions
from batch_assets.lib.materializations import latest_materialization
from batch_assets.lib.task_definitions import build_definitions, pipeline_job_name
from batch_assets.pipeline.task_spec import PriceSpec, TaskSpec, load_task_spec, load_task_specs
from batch_assets.pipeline.task_spec.cascade import TargetSpec
from batch_assets.runtime.instance import open_instance
from batch_assets.storage.drop_files import partition_key_for, partitions_def_name
from batch_assets_tests.support import SAMPLES, drop

pytestmark = pytest.mark.slow

SHIPPED = next(task for task in load_task_specs() if task.name == "industry_cascade")
# Priced as an endpoint would be (a throughput setting: the code versions stay the shipped task's).
PRICE = PriceSpec(input_per_million_tokens=2.0)
TASK = SHIPPED.model_copy(update={"engine": SHIPPED.engine.model_copy(update={"price": PRICE})})
SAMPLE = SAMPLES / "industry_cascade" / "companies.csv"


def run(file_name: str, instance: dg.DagsterInstance):
    key = partition_key_for(file_name)
    instance.add_dynamic_partitions(partitions_def_name(TASK.name), [key])
    job = build_definitions(tasks=[TASK]).resolve_job_def(pipeline_job_name(TASK.name))
    return job.execute_in_process(instance=instance, partition_key=key, raise_on_error=False)


def metadata_of(result, node: str) -> dict:
    return {k: v.value for k, v in result.asset_materializations_for_node(node)[0].metadata.items()}


def read(data: Path, file_name: str) -> pl.DataFrame:
    return pl.read_parquet(
        data / "storage" / TASK.name / "validated_labels" / f"{partition_key_for(file_name)}.parquet"
    )


def test_the_cascade_sample_labels_every_row_within_the_teachers_budget(data_dir: Path) -> None:
    drop(data_dir, TASK.name, SAMPLE.name, SAMPLE.read_bytes())
    # Every eighth row's teacher label is unknown, the row after it empty: the sample meets many.
    position = pl.int_range(pl.len()) % 8
    bad = pl.read_csv(SAMPLE).with_columns(
        Industry=pl.when(position == 0).then(pl.lit("Aerospace")).when(position == 1).then(None).otherwise("Industry")
    )
    bad_name = "companies-relabelled.csv"
    drop(data_dir, TASK.name, bad_name, bad.write_csv())
    with dg.instance_for_test() as instance:
        result = run(SAMPLE.name, instance)
        assert result.success
        checks = {e.check_name: e for e in result.get_asset_check_evaluations()}
        inference = metadata_of(result, "industry_cascade__inference_outputs")
        labels_meta = metadata_of(result, "industry_cascade__validated_labels")
        defs = build_definitions(tasks=[TASK])
        trained = dg.materialize([defs.get_assets_def(dg.AssetKey([TASK.name, "label_model"]))], instance=instance)
        assert trained.success
        label_model = metadata_of(trained, "industry_cascade__label_model")
        second = run(bad_name, instance)
        assert second.success
        second_inference = metadata_of(second, "industry_cascade__inference_outputs")
        version = defs.resolve_asset_graph().get(dg.AssetKey([TASK.name, "inference_outputs"])).code_version
    labels = read(data_dir, SAMPLE.name)
    assert labels.height == 800 and labels["error"].null_count() == 800
    assert set(labels["labelled_by"]) == {"teacher", "student"}
    assert labels["confidence"].is_between(0, 1).all()
    # The budget: 25 % of 800 rows for sample, deferred and audit rows together.
    assert labels_meta["teacher_rows"] <= 200 and labels_meta["student_rows"] >= 600
    assert labels.filter(pl.col("cascade_role") == "sample").height == 100
    assert labels_meta["audited_rows"] == 40
    teacher_rows = labels.filter(pl.col("labelled_by") == "teacher")
    assert (teacher_rows["label"] == teacher_rows["Industry"]).all()  # the teacher's label is kept
    assert inference["student_training_rows"] == 100 and inference["student_cv_agreement"] is not None
    assert inference["student_calibration_error"] is not None and inference["rows_inferred"] == 800
    # A tenth of the names carry no cue (random labels): accuracy stays under 1; measured 0.93 (README).
    assert 0.8 <= labels_meta["accuracy"] < 1.0
    agreement = checks["agreement_at_least"]
    assert agreement.metadata["audit_agreement_95_low"].value <= agreement.metadata["audit_agreement"].value
    assert checks["accuracy_at_least"].passed
    # The labels' cost: the embedding's tokens at the price; a column teacher costs nothing to ask.
    tokens = labels["num_prompt_tokens"].sum()
    assert labels_meta["embedding_cost_usd"] == pytest.approx(tokens * 2.0 / 1e6, abs=1e-6)  # rounded to 6 places
    assert "teacher_cost_usd" not in labels_meta and labels_meta["cost_vs_all_teacher"] == labels_meta["teacher_share"]
    # label_model: every row the teacher labelled (sample, deferred, audit), of the one partition so far.
    assert inference["teacher_rows_asked"] == labels_meta["teacher_rows"]
    assert (label_model["training_rows"], label_model["partitions"]) == (
        labels_meta["teacher_rows"],
        [partition_key_for(SAMPLE.name)],
    )
    assert label_model["task_version"] == version and set(label_model["classes"]) <= set(TASK.output.choices or [])
    assert label_model["cv_agreement"] is not None and label_model["calibration_error"] is not None
    # The second file starts from it: its training rows cover sample_rows (100), so the teacher labels
    # no sample, only unsure and audit rows, and the student is the stored one.
    assert label_model["training_rows"] > 100
    assert second_inference["label_model_digest"] == label_model["digest"]
    assert second_inference["student_training_rows"] == label_model["training_rows"]
    # The second file: the same names, embedded once already (the result cache), two bad teacher rows.
    assert (second_inference["rows_inferred"], second_inference["rows_from_cache"]) == (0, 800)
    relabelled = read(data_dir, bad_name)
    roles = relabelled["cascade_role"].value_counts()
    assert relabelled.filter(pl.col("cascade_role") == "sample").height == 0, roles
    asked = relabelled.filter(pl.col("cascade_role").is_in(["deferred", "audit"])).height
    # Failed audits keep the student's label (role student), so they are asked but not counted by role.
    assert asked <= second_inference["teacher_rows_asked"] <= 200 and asked > 40
    errors = relabelled.filter(pl.col("error").is_not_null())
    assert errors.height >= 10 and "Aerospace" not in set(relabelled["label"].drop_nulls())
    for line, message in zip(errors["source_line"], errors["error"], strict=True):
        assert message in (
            f"teacher_unknown_label: {bad_name} line {line}: the teacher column 'Industry' holds 'Aerospace', "
            "not one of output.choices",
            f"teacher_no_label: {bad_name} line {line}: the teacher column 'Industry' is empty",
        )
    # Bad teacher values the teacher was never asked about do not matter: the student labels those rows.
    unasked = relabelled.filter((pl.col("Industry") == "Aerospace") & (pl.col("labelled_by") == "student"))
    assert unasked.height > 0 and unasked["label"].null_count() == 0


def target_task(name: str, agreement: float, max_teacher_share: float) -> TaskSpec:
    """The shipped cascade with `output.cascade.target` (a calibration set of 100 of its 800 rows)."""
    target = TargetSpec(agreement=agreement, confidence=0.9, calibration_rows=100)
    cascade = SHIPPED.output.cascade
    assert cascade is not None
    cascade = cascade.model_copy(update={"target": target, "max_teacher_share": max_teacher_share})
    return SHIPPED.model_copy(update={"name": name, "output": SHIPPED.output.model_copy(update={"cascade": cascade})})


def test_a_target_chooses_the_threshold_or_is_refused_by_the_check_on_the_shipped_sample(data_dir: Path) -> None:
    met, refused = target_task("industry_target", 0.85, 0.6), target_task("industry_refused", 0.999, 0.3)
    results = {}
    with dg.instance_for_test() as instance:
        for task in (met, refused):
            drop(data_dir, task.name, SAMPLE.name, SAMPLE.read_bytes())
            key = partition_key_for(SAMPLE.name)
            instance.add_dynamic_partitions(partitions_def_name(task.name), [key])
            job = build_definitions(tasks=[task]).resolve_job_def(pipeline_job_name(task.name))
            results[task.name] = job.execute_in_process(instance=instance, partition_key=key, raise_on_error=False)
    chosen = results["industry_target"]
    assert chosen.success
    inference = metadata_of(chosen, "industry_target__inference_outputs")
    labels_meta = metadata_of(chosen, "industry_target__validated_labels")
    check = {e.check_name: e for e in chosen.get_asset_check_evaluations()}["agreement_target_met"]
    assert check.passed and inference["target_met"] is True and inference["target_calibration_rows"] == 100
    assert inference["target_lower_bound"] >= 0.85
    assert labels_meta["teacher_share"] <= 0.6
    # The labels reach what the bound guarantees (the gold column is the teacher).
    assert labels_meta["accuracy"] >= inference["target_lower_bound"]
    assert labels_meta["all_rows_agreement_95_high"] >= inference["target_lower_bound"]
    # The task-level figures: the one partition so far, in inference_outputs' and validated_labels'
    # metadata; its student and calibration are stored for the partitions to come.
    assert labels_meta["task_rows"] == 800 and labels_meta["task_partitions"] == 1
    assert labels_meta["task_teacher_share"] == labels_meta["teacher_share"]
    assert labels_meta["task_lower_bound"] == inference["target_lower_bound"] and labels_meta["task_confidence"] == 0.9
    version = labels_meta["task_version"]
    stored = data_dir / "storage" / "industry_target" / "label_model" / version / labels_meta["task_student_version"]
    assert (stored / "calibration.json").exists() and (stored / "training.parquet").exists()
    assert inference["target_student_version"] == labels_meta["task_student_version"]
    # 99.9 % cannot be guaranteed within 30 % of the rows: best effort, the least sure rows the budget
    # pays for go to the teacher, and the check fails by name, saying what the budget can guarantee.
    failed = results["industry_refused"]
    check = {e.check_name: e for e in failed.get_asset_check_evaluations()}["agreement_target_met"]
    assert not check.passed and check.severity == dg.AssetCheckSeverity.ERROR
    assert check.description.startswith("output.cascade.target agreement 99.9% at confidence 90% needs ")
    assert "the budget can guarantee" in check.description and "best effort" in check.description
    refused_meta = metadata_of(failed, "industry_refused__validated_labels")
    roles = set(
        pl.read_parquet(
            data_dir / "storage" / "industry_refused" / "validated_labels" / f"{partition_key_for(SAMPLE.name)}.parquet"
        )["cascade_role"]
    )
    assert roles == {"sample", "calibration", "deferred", "audit", "student"}
    assert refused_meta["teacher_share"] <= 0.3 and refused_meta["teacher_rows"] >= 0.29 * 800


def test_a_target_on_degenerate_files_fails_its_check_naming_why(data_dir: Path) -> None:
    """Issue 56: the shipped cascade with a lenient target over whole files (`calibration_rows` past
    their size) on 10-row files: the sample's head, one class, an empty teacher column, teacher
    answers outside the choices. The teacher's budget (25 % of 10 rows) pays for a sample of 1 row:
    no student, 8 rows `cascade_no_student` errors. The ERROR check fails on each, saying why, with
    the target's metadata on inference_outputs and a note in the run's summary line."""
    cascade = SHIPPED.output.cascade
    assert cascade is not None
    lenient = TargetSpec(agreement=0.5, confidence=0.5, calibration_rows=100000)
    output = SHIPPED.output.model_copy(update={"cascade": cascade.model_copy(update={"target": lenient})})
    task = SHIPPED.model_copy(update={"name": "industry_degenerate", "output": output})
    sample = pl.read_csv(SAMPLE)
    head = sample.head(10)
    files = {
        "head.csv": (head, "the teacher's sample of 1 row holds 1 distinct label(s)"),
        "one-class.csv": (sample.filter(pl.col("Industry") == "Manufacturing").head(10), "(Manufacturing)"),
        "empty-teacher.csv": (
            head.with_columns(Industry=pl.lit(None, dtype=pl.String)),
            "teacher_no_label 2 (e.g. empty-teacher.csv line ",
        ),
        "outside-choices.csv": (
            head.with_columns(Industry=pl.lit("Aerospace")),
            "the teacher column 'Industry' holds 'Aerospace', not one of output.choices",
        ),
    }
    job = build_definitions(tasks=[task]).resolve_job_def(pipeline_job_name(task.name))
    with dg.instance_for_test() as instance:
        for name, (frame, why) in files.items():
            drop(data_dir, task.name, name, frame.write_csv())
            key = partition_key_for(name)
            instance.add_dynamic_partitions(partitions_def_name(task.name), [key])
            result = job.execute_in_process(instance=instance, partition_key=key, raise_on_error=False)
            assert result.success
            inference = metadata_of(result, f"{task.name}__inference_outputs")
            check = {e.check_name: e for e in result.get_asset_check_evaluations()}["agreement_target_met"]
            assert not check.passed and check.severity == dg.AssetCheckSeverity.ERROR
            assert check.description.startswith(
                "output.cascade.target agreement 50.0% at confidence 50% is not met: "
            ), check.description
            assert why in check.description and "no student was trained" in check.description, check.description
            assert inference["target_met"] is False and inference["target_refused"] == check.description
            labels = pl.read_parquet(data_dir / "storage" / task.name / "validated_labels" / f"{key}.parquet")
            teacher_rows = int((labels["labelled_by"] == "teacher").sum())
            assert inference["target_lower_bound"] == teacher_rows / 10 <= 0.2
            assert check.metadata["target_lower_bound"].value == inference["target_lower_bound"]
            (outcome,) = run_outcomes(task.name, [key], result, instance)
            assert not outcome.ok and f"{task.name}/validated_labels:agreement_target_met (ERROR)" in outcome.status
            assert f"target not met: {check.description}" in outcome.line()


LLM_TASK = """
input: {text_fields: [Company]}
prompt: {system: "Name the company's industry.", template: "{Company}"}
engine:
  model: embedded:all-MiniLM-L6-v2
  max_model_len: 256
  vllm_args: {dtype: float32}
  price: {input_per_million_tokens: 0.02}
output:
  kind: choices
  method: cascade
  choices: [Law Firm, Healthcare, Technology, Retail, Consulting, Manufacturing, Finance, Real Estate, Other]
  cascade:
    teacher: llm
    teacher_price: {input_per_million_tokens: 0.5, output_per_million_tokens: 2.0}
    sample_rows: 12
    audit_rows: 4
    defer_below: 0.6
    max_teacher_share: 0.5
"""


def test_a_chat_teacher_labels_the_sample_the_unsure_and_the_audit_once_then_from_the_cache(
    data_dir: Path, tiny_model: str, tmp_path: Path
) -> None:
    """`teacher: llm` on the embedded MiniLM and the tiny chat model (BATCH_ASSETS_MODEL routes the
    teacher, a chat task, not the embedding model): every row once, labelled by both; a second file of
    the same rows pays no teacher call (the teacher's result cache) and gets the same labels."""
    path = tmp_path / "industry_teacher.yaml"
    path.write_text(LLM_TASK)
    task = load_task_spec(path)
    rows = pl.read_csv(SAMPLE).head(80)
    for name in ("first.csv", "again.csv"):
        drop(data_dir, task.name, name, rows.write_csv())
    job = build_definitions(tasks=[task]).resolve_job_def(pipeline_job_name(task.name))
    measured, labels, costs = [], [], []
    with dg.instance_for_test() as instance:
        for name in ("first.csv", "again.csv"):
            key = partition_key_for(name)
            instance.add_dynamic_partitions(partitions_def_name(task.name), [key])
            result = job.execute_in_process(instance=instance, partition_key=key, raise_on_error=False)
            assert result.success
            measured.append(metadata_of(result, f"{task.name}__inference_outputs"))
            costs.append(metadata_of(result, f"{task.name}__validated_labels"))
            labels.append(pl.read_parquet(data_dir / "storage" / task.name / "validated_labels" / f"{key}.parquet"))
    first, again = labels
    assert first.height == 80 and first["row_id"].n_unique() == 80
    # Every row has a label or an error, never both; who labelled it is said.
    assert (first["label"].is_null() == first["error"].is_not_null()).all()
    assert set(first["labelled_by"].drop_nulls()) == {"teacher", "student"}, first["error"].value_counts()
    asked = first.filter(pl.col("cascade_role") != "student").height
    assert 12 <= asked <= 40  # the budget: half of 80 rows
    assert measured[0]["teacher_rows_inferred"] + measured[0]["teacher_rows_from_cache"] >= 12
    assert measured[0]["teacher_rows_inferred"] > 0
    assert (measured[1]["teacher_rows_inferred"], measured[1]["rows_inferred"]) == (0, 0)
    assert (
        measured[1]["teacher_rows_from_cache"]
        == measured[0]["teacher_rows_inferred"] + measured[0]["teacher_rows_from_cache"]
    )
    assert again.select("label", "labelled_by", "error").equals(first.select("label", "labelled_by", "error"))
    # The cost at teacher_price: the teacher's tokens as its calls used them, every row at their mean per
    # asked row; the embedding's tokens at engine.price besides.
    taught = first.filter(pl.col("teacher_prompt_tokens").is_not_null())
    assert taught.height == measured[0]["teacher_rows_asked"] >= 12
    teacher_usd = (taught["teacher_prompt_tokens"].sum() * 0.5 + taught["teacher_generated_tokens"].sum() * 2.0) / 1e6
    assert teacher_usd > 0 and costs[0]["teacher_cost_usd"] == pytest.approx(teacher_usd, abs=1e-6)
    assert costs[0]["all_teacher_cost_usd"] == pytest.approx(teacher_usd / taught.height * 80, abs=1e-6)
    assert costs[0]["embedding_cost_usd"] == pytest.approx(first["num_prompt_tokens"].sum() * 0.02 / 1e6, abs=1e-6)
    assert costs[0]["cascade_cost_usd"] < costs[0]["all_teacher_cost_usd"]
    # The teacher's checkpoints have served their purpose once the labels are stored.
    teacher_checkpoints = data_dir / "storage" / task.name / "_teacher_checkpoints"
    assert not teacher_checkpoints.exists() or not any(teacher_checkpoints.iterdir())


def test_files_of_one_task_share_one_student_and_one_calibration_across_runs(
    data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 59: `batch-assets run` of two files, then of two more. In the first run one file trains
    the student on its sample and calibrates it, the other reuses both (no sample, no calibration
    rows). The second run starts by growing the student on the first run's teacher labels (twice its
    training rows or more): a new student version, calibrated once by one file and reused by the
    other. The task-level figures count the rows each version labelled."""
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    shipped = (SAMPLES.parent / "tasks" / "industry_cascade.yaml").read_text()
    target = "    max_teacher_share: 0.6\n    target: {agreement: 0.75, confidence: 0.9, calibration_rows: 40}\n"
    (tasks / "industry_cascade.yaml").write_text(shipped.replace("    max_teacher_share: 0.25\n", target))
    monkeypatch.setenv("BATCH_ASSETS_TASKS_DIR", str(tasks))
    sample = pl.read_csv(SAMPLE)
    files = []
    for n in range(4):
        path = tmp_path / f"part{n}.csv"
        sample.slice(n * 200, 200).write_csv(path)
        files.append(path)
    outcomes = [*run_partitions("industry_cascade", files[:2]), *run_partitions("industry_cascade", files[2:])]
    assert len(outcomes) == 4
    labels = [
        pl.read_parquet(data_dir / "storage" / "industry_cascade" / "validated_labels" / f"part{n}.csv.parquet")
        for n in range(4)
    ]
    roles = [dict(frame["cascade_role"].value_counts().iter_rows()) for frame in labels]
    with open_instance() as instance:
        metadata = [
            {
                k: v.value
                for k, v in latest_materialization(
                    instance, dg.AssetKey(["industry_cascade", "validated_labels"]), f"part{n}.csv"
                ).asset_materialization.metadata.items()
            }
            for n in range(4)
        ]
    first_version = {m["task_student_version"] for m in metadata[:2]}
    grown_version = {m["task_student_version"] for m in metadata[2:]}
    assert len(first_version) == len(grown_version) == 1 and first_version != grown_version
    for run in ((0, 1), (2, 3)):
        calibrating = [n for n in run if "calibration" in roles[n]]
        assert len(calibrating) == 1 and roles[calibrating[0]]["calibration"] == 40, roles
        [reusing] = [n for n in run if n not in calibrating]
        assert "sample" not in roles[reusing] and "calibration" not in roles[reusing]
        assert roles[reusing].get("audit") == 40 and roles[reusing].get("deferred"), roles
    # The first run's student is one file's sample; the grown one asks for no sample of its own.
    assert sum("sample" in r for r in roles[:2]) == 1 and not any("sample" in r for r in roles[2:])
    # Each version's figures: the rows of its two files, the teacher's rows of both.
    for run in ((0, 1), (2, 3)):
        last = max(run, key=lambda n: metadata[n]["task_partitions"])
        teacher = sum(int((labels[n]["labelled_by"] == "teacher").sum()) for n in run)
        assert (metadata[last]["task_rows"], metadata[last]["task_partitions"]) == (400, 2)
        assert metadata[last]["task_teacher_rows"] == teacher and metadata[last]["task_confidence"] == 0.9
    stored = data_dir / "storage" / "industry_cascade" / "label_model" / metadata[0]["task_version"]
    assert sorted(p.name for p in (stored / grown_version.pop() / "labelled").iterdir()) == [
        "part2.csv.json",
        "part3.csv.json",
    ]
