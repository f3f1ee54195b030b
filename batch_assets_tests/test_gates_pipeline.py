"""The gates through Dagster: the budget check stops a partition before the engine, the drift and
accuracy checks read real materializations, and a task edit marks earlier partitions stale."""

from __future__ import annotations

import statistics
from pathlib import Path

import dagster as dg
import polars as pl
import pytest
from dagster._core.definitions.data_version import StaleCauseCategory, StaleStatus

from batch_assets.engines.vllm_lifecycle import PROCESS_ENGINE
from batch_assets.lib.task_definitions import build_definitions, pipeline_job_name
from batch_assets.pipeline.task_spec import TaskSpec
from batch_assets.storage.drop_files import partition_key_for, partitions_def_name
from batch_assets_tests.support import drop, stale_status

# The slow tier (`make test-fast` leaves it out): every test materializes through Dagster on the engine (tiny model).
pytestmark = pytest.mark.slow

PRICE = {"input_per_million_tokens": 2.0, "output_per_million_tokens": 8.0}


ENGINE = {"max_model_len": 512, "kv_cache_memory_gib": 0.25, "max_num_seqs": 8}


def task_spec(name: str, **extra) -> TaskSpec:
    raw = {
        "name": name,
        "input": {"text_fields": ["text"]},
        "prompt": {"system": "Answer with one letter.", "template": "Item: {text}"},
        "engine": ENGINE,
        "sampling": {"temperature": 0, "max_tokens": 4},
        **extra,
    }
    return TaskSpec.model_validate(raw)


def run(task: TaskSpec, file_name: str, instance: dg.DagsterInstance, defs: dg.Definitions | None = None):
    defs = defs or build_definitions(tasks=[task])
    key = partition_key_for(file_name)
    instance.add_dynamic_partitions(partitions_def_name(task.name), [key])
    return key, defs.resolve_job_def(pipeline_job_name(task.name)).execute_in_process(
        instance=instance, partition_key=key, raise_on_error=False
    )


def latest_metadata(instance: dg.DagsterInstance, task: str, asset: str, key: str) -> dict:
    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=dg.AssetKey([task, asset]), asset_partitions=[key]), limit=1
    ).records
    return {name: value.value for name, value in records[0].asset_materialization.metadata.items()}


def output(data: Path, task: str, asset: str, file_name: str) -> pl.DataFrame:
    return pl.read_parquet(data / "storage" / task / asset / f"{partition_key_for(file_name)}.parquet")


def test_over_budget_partition_never_reaches_the_engine(data_dir: Path, tiny_model: str) -> None:
    task = task_spec(
        "budgeted",
        output={"kind": "choices", "choices": ["a", "b"]},
        budget={"max_generated_tokens": 30, "max_cost_usd": 5.0},
        engine={"max_model_len": 512, "price": {"input_per_million_tokens": 3.0, "output_per_million_tokens": 15.0}},
    )
    drop(data_dir, "budgeted", "items.jsonl", "".join(f'{{"text": "item {i}"}}\n' for i in range(10)))
    starts = PROCESS_ENGINE.starts
    with dg.instance_for_test() as instance:
        key, result = run(task, "items.jsonl", instance)
        assert not result.success
        check = {e.check_name: e for e in result.get_asset_check_evaluations()}["within_budget"]
        assert not check.passed and check.severity == dg.AssetCheckSeverity.ERROR
        # 10 rows x max_tokens 4 = 40 worst-case generated tokens, over the limit of 30.
        assert check.metadata["estimated_max_generated_tokens"].value == 40
        assert (
            "worst-case generated tokens 40 (10 rows x sampling.max_tokens) exceed budget.max_generated_tokens 30"
            in (check.description)
        )
        formatted = latest_metadata(instance, "budgeted", "formatted_prompts", key)
        prompt_tokens = formatted["estimated_prompt_tokens"]
        assert prompt_tokens == formatted["prompt_tokens"] > 0
        assert formatted["estimated_max_cost_usd"] == pytest.approx(round((prompt_tokens * 3.0 + 40 * 15.0) / 1e6, 6))
        materialized = {m.asset_key.path[-1] for m in result.get_asset_materialization_events()}
        assert materialized == {"raw_prompts", "formatted_prompts"}
        assert not instance.fetch_materializations(dg.AssetKey(["budgeted", "inference_outputs"]), limit=1).records
    assert PROCESS_ENGINE.starts == starts  # the engine was never started
    assert not (data_dir / "storage" / "budgeted" / "inference_outputs").exists()


def test_a_row_refused_as_too_long_is_not_billed(data_dir: Path, tiny_model: str) -> None:
    """Issue 56.6: `prompt_tokens` and `cost_usd` of inference_outputs count the rows sent to the
    engine; a row refused as `prompt_too_long` never was, so it is not billed (the estimate agreed)."""
    task = task_spec("priced", output={"kind": "choices", "choices": ["a", "b"]}, engine={**ENGINE, "price": PRICE})
    long = "word " * 2000
    drop(data_dir, "priced", "items.jsonl", f'{{"text": "one"}}\n{{"text": "{long}"}}\n{{"text": "two"}}\n')
    with dg.instance_for_test() as instance:
        key, result = run(task, "items.jsonl", instance)
        assert result.success
        outputs = latest_metadata(instance, "priced", "inference_outputs", key)
        formatted = latest_metadata(instance, "priced", "formatted_prompts", key)
    labels = output(data_dir, "priced", "validated_labels", "items.jsonl")
    refused = labels.filter(pl.col("error").str.starts_with("prompt_too_long: "))
    assert refused["row_id"].to_list() == [1] and refused["num_prompt_tokens"][0] > 2000
    sent = labels.filter(pl.col("error").is_null())
    assert outputs["prompt_tokens"] == sent["num_prompt_tokens"].sum() == formatted["estimated_prompt_tokens"]
    expected = (outputs["prompt_tokens"] * 2.0 + outputs["generated_tokens"] * 8.0) / 1e6
    assert outputs["cost_usd"] == pytest.approx(expected, abs=1e-6)
    assert outputs["cost_usd"] <= formatted["estimated_max_cost_usd"]


# Six rows whose gold label is "y"; then four whose gold is x, x, y and none.
EARLY_LETTERS = "".join(f'{{"text": "e{i}", "truth": "y"}}\n' for i in range(6))
LATE_LETTERS = (
    '{"text": "l0", "truth": "x"}\n{"text": "l1", "truth": "x"}\n'
    '{"text": "l2", "truth": "y"}\n{"text": "l3", "truth": ""}\n'
)


def test_drift_accuracy_and_stale_partitions(data_dir: Path, tiny_model: str) -> None:
    """A regex task whose constraint admits a single label makes the random model's labels certain."""
    only_y = task_spec(
        "letters", output={"kind": "regex", "regex": "y"}, checks={"gold_field": "truth", "min_accuracy": 0.9}
    )
    # A price changes no output: `relaxed` below, without one, has the same code versions.
    priced = {**ENGINE, "price": PRICE}
    only_x = task_spec(
        "letters",
        engine=priced,
        output={"kind": "regex", "regex": "x"},
        checks={"gold_field": "truth", "min_accuracy": 0.9},
    )
    drop(data_dir, "letters", "early.jsonl", EARLY_LETTERS)
    drop(data_dir, "letters", "late.jsonl", LATE_LETTERS)
    with dg.instance_for_test() as instance:
        _, result = run(only_y, "early.jsonl", instance)
        assert result.success
        checks = {e.check_name: e for e in result.get_asset_check_evaluations()}
        assert checks["label_drift"].passed
        assert (
            checks["label_drift"].metadata["note"].value == "skipped: no earlier partition with labels to compare with"
        )
        assert checks["accuracy_at_least"].passed and checks["accuracy_at_least"].metadata["accuracy"].value == 1.0
        # Confidence is the probability among the outputs the constraint allows: one allowed
        # output, so 1.0 exactly, though the random model alone would almost never write "y".
        assert output(data_dir, "letters", "validated_labels", "early.jsonl")["confidence"].to_list() == [1.0] * 6
        assert checks["confidence_at_least"].passed
        assert checks["confidence_at_least"].metadata["confidence_median"].value == 1.0

        late, result = run(only_x, "late.jsonl", instance)
        assert result.success  # WARN checks do not fail the run
        checks = {e.check_name: e for e in result.get_asset_check_evaluations()}
        drift = checks["label_drift"]
        assert not drift.passed and drift.severity == dg.AssetCheckSeverity.WARN
        assert drift.metadata["distance"].value == 1.0
        assert drift.metadata["moved_labels"].value == "x 0% -> 100%, y 100% -> 0%"
        assert drift.metadata["partitions_compared"].value == 1

        # With a price, inference_outputs records what the partition's tokens cost.
        outputs = latest_metadata(instance, "letters", "inference_outputs", late)
        expected_cost = (outputs["prompt_tokens"] * 2.0 + outputs["generated_tokens"] * 8.0) / 1e6
        assert outputs["generated_tokens"] > 0 and outputs["cost_usd"] == pytest.approx(expected_cost, abs=1e-6)

        # 3 rows carry a gold value; every label is "x": 2 of 3 correct.
        labels = latest_metadata(instance, "letters", "validated_labels", late)
        assert labels["accuracy"] == pytest.approx(0.6667)
        assert (labels["rows_with_gold"], labels["correct_rows"]) == (3, 2)
        assert [record.data for record in labels["per_label"].records] == [
            {"label": "x", "precision": 0.6667, "recall": 1.0, "support": 2},
            {"label": "y", "precision": None, "recall": 0.0, "support": 1},
        ]
        assert "| y | 1 |" in labels["confusion"]
        accuracy = checks["accuracy_at_least"]
        assert not accuracy.passed and accuracy.severity == dg.AssetCheckSeverity.WARN
        assert accuracy.description == "accuracy 66.7% is below checks.min_accuracy 90.0%"
        schema = labels["dagster/column_schema"]
        assert {c.name: c.type for c in schema.columns}["truth"] == "String"

        # Same task: fresh. Edited prompt: the partition's assets show as stale, caused by the code version.
        def status(task: TaskSpec, asset: str):
            return stale_status(instance, task, asset, late)

        assert status(only_x, "inference_outputs")[0] == StaleStatus.FRESH
        edited = task_spec(
            "letters",
            prompt={"system": "Answer with one letter.", "template": "Thing: {text}"},
            output={"kind": "regex", "regex": "x"},
            checks={"gold_field": "truth"},
        )
        state, causes = status(edited, "formatted_prompts")
        assert state == StaleStatus.STALE
        assert [(c.category, c.reason) for c in causes] == [(StaleCauseCategory.CODE, "has a new code version")]
        for asset in ("inference_outputs", "validated_labels"):
            assert status(edited, asset)[0] == StaleStatus.STALE
        # A change of a check's threshold leaves the labels fresh.
        relaxed = task_spec(
            "letters", output={"kind": "regex", "regex": "x"}, checks={"gold_field": "truth", "min_accuracy": 0.5}
        )
        assert status(relaxed, "validated_labels")[0] == StaleStatus.FRESH


def test_labels_the_model_is_unsure_of_fail_the_confidence_warning(data_dir: Path, tiny_model: str) -> None:
    pairs = task_spec(
        "pairs",
        output={"kind": "choices", "choices": ["x", "y"]},
        checks={"min_confidence": 1.0, "max_low_confidence_share": 0.5},
    )
    drop(data_dir, "pairs", "items.jsonl", "".join(f'{{"text": "item {i}"}}\n' for i in range(8)))
    with dg.instance_for_test() as instance:
        key, result = run(pairs, "items.jsonl", instance)
        assert result.success  # a WARN check does not fail the run
        check = {e.check_name: e for e in result.get_asset_check_evaluations()}["confidence_at_least"]
        labels = output(data_dir, "pairs", "validated_labels", "items.jsonl")
        confidence = labels["confidence"].to_list()
        # Greedy decoding picks the likelier of two single-token choices: at least 0.5, never certain.
        assert labels["label"].null_count() == 0 and all(0.5 <= c < 1.0 for c in confidence), confidence
        assert not check.passed and check.severity == dg.AssetCheckSeverity.WARN
        assert check.description == "100% of the labels have a confidence under 1.0 (> 50%)"
        assert check.metadata["low_confidence_rows"].value == 8
        least_sure_first = labels.sort("confidence", "row_id")["row_id"].to_list()
        assert check.metadata["failed_row_ids"].value == least_sure_first
        metadata = latest_metadata(instance, "pairs", "validated_labels", key)
        assert metadata["low_confidence_share"] == 1.0 and metadata["min_confidence"] == 1.0
        assert metadata["confidence_median"] == pytest.approx(statistics.median(confidence), abs=1e-4)


def test_good_files_of_a_range_are_labelled_however_many_kinds_of_bad_file_it_holds(
    data_dir: Path, tiny_model: str
) -> None:
    """An unreadable file fails the range before the budget check of another file is reached: the
    range failure sensor runs the other files again, that re-run fails the budget check of one,
    and the sensor splits its own re-run again, so both good files end labelled, each once."""
    task = task_spec(
        "budgeted",
        output={"kind": "choices", "choices": ["a", "b"]},
        budget={"max_generated_tokens": 30},
        runs={"max_partitions_per_run": 5},
    )
    defs = build_definitions(tasks=[task])
    drop(data_dir, "budgeted", "broken.parquet", b"not a parquet file")
    sizes = {"small1.jsonl": 3, "big.jsonl": 10, "small2.jsonl": 2}
    for name, rows in sizes.items():
        drop(data_dir, "budgeted", name, "".join(f'{{"text": "{name} item {i}"}}\n' for i in range(rows)))
    broken, small1, big, small2 = keys = [partition_key_for(name) for name in ["broken.parquet", *sizes]]
    job = defs.resolve_job_def(pipeline_job_name(task.name))
    sensor = defs.get_sensor_def("range_failure_sensor")

    def requests_after(failed) -> list[dg.RunRequest]:
        context = dg.build_run_status_sensor_context(
            sensor_name=sensor.name,
            dagster_event=next(e for e in failed.all_events if e.event_type_value == "PIPELINE_FAILURE"),
            dagster_instance=instance,
            dagster_run=instance.get_run_by_id(failed.run_id),
        ).for_run_failure()
        return sensor(context) or []

    def execute(request: dg.RunRequest):
        return job.execute_in_process(
            instance=instance, partition_key=request.partition_key, tags=request.tags, raise_on_error=False
        )

    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions(partitions_def_name(task.name), keys)
        tags = {"dagster/asset_partition_range_start": broken, "dagster/asset_partition_range_end": small2}
        first = job.execute_in_process(instance=instance, tags=tags, raise_on_error=False)
        assert not first.success and not first.get_asset_check_evaluations()  # failed reading broken.parquet
        [rerun] = requests_after(first)
        assert (rerun.tags["dagster/asset_partition_range_start"], rerun.tags["dagster/asset_partition_range_end"]) == (
            small1,
            small2,
        )
        assert rerun.tags["batch_assets/left_out"] == broken

        second = execute(rerun)
        assert not second.success
        budget = {
            e.partition: e.passed for e in second.get_asset_check_evaluations() if e.check_name == "within_budget"
        }
        assert budget == {small1: True, big: False, small2: True}
        # The sensor's own re-run is split again, around the file over budget.
        last = requests_after(second)
        assert [r.partition_key for r in last] == [small1, small2]
        assert {r.tags["batch_assets/rerun_of"] for r in last} == {second.run_id}
        assert {r.tags["batch_assets/left_out"] for r in last} == {big}
        assert all(execute(request).success for request in last)

        def labelled(key: str) -> list:
            return instance.fetch_materializations(
                dg.AssetRecordsFilter(asset_key=dg.AssetKey(["budgeted", "validated_labels"]), asset_partitions=[key]),
                limit=5,
            ).records

        assert {key: len(labelled(key)) for key in keys} == {broken: 0, small1: 1, big: 0, small2: 1}
        assert {
            name: output(data_dir, "budgeted", "validated_labels", name).height for name in sizes if name != "big.jsonl"
        } == {
            "small1.jsonl": 3,
            "small2.jsonl": 2,
        }
        assert not instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=dg.AssetKey(["budgeted", "inference_outputs"]), asset_partitions=[big]),
            limit=1,
        ).records
