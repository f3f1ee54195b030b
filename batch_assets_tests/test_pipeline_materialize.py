"""Materialize one partition of each shipped task through Dagster, on the tiny random-weight model."""

from __future__ import annotations

from pathlib import Path

import dagster as dg
import polars as pl
import pytest

from batch_assets.engines.vllm_engine import VLLMEngine
from batch_assets.lib.task_definitions import build_definitions
from batch_assets.pipeline.task_spec import load_task_specs
from batch_assets_tests.support import BAD_POSTS, SAMPLES, drop, failure_messages, read_output, run_partition

# The slow tier (`make test-fast` leaves it out): every test materializes through Dagster on the engine (tiny model).
pytestmark = pytest.mark.slow

TASKS = {task.name: task for task in load_task_specs()}
SAMPLE_FILES = {
    "industry": SAMPLES / "industry" / "customers-sample.csv",
    "sentiment": SAMPLES / "sentiment" / "posts-sample.jsonl",
    "answers": SAMPLES / "answers" / "questions-sample.txt",
}


@pytest.mark.parametrize("task", ["industry", "sentiment", "answers"])
def test_sample_partition_materializes_with_valid_labels(task: str, data_dir: Path, tiny_model: str) -> None:
    sample = SAMPLE_FILES[task]
    drop(data_dir, task, sample.name, sample.read_bytes())
    with dg.instance_for_test() as instance:
        key, result = run_partition(task, sample.name, instance)
        assert result.success, failure_messages(result)
        checks = {e.check_name: e.passed for e in result.get_asset_check_evaluations()}
        assert checks["labels_are_valid"] and checks["one_row_per_record"] and checks["outputs_satisfy_constraint"]

        raw = read_output(data_dir, task, "raw_prompts", key)
        labels = read_output(data_dir, task, "validated_labels", key)
        assert labels.height == raw.height > 0
        assert labels["row_id"].to_list() == list(range(labels.height))
        # Every input column passes through with its values, row for row.
        for column in raw.columns:
            if column != "error":
                assert labels[column].to_list() == raw[column].to_list(), column
        good = labels.filter(pl.col("error").is_null())
        assert good.height == labels.height  # the bundled samples have no bad records
        assert set(good["finish_reason"].to_list()) <= {"stop", "length"}
        assert good["num_prompt_tokens"].min() > 0
        assert good["num_generated_tokens"].max() <= TASKS[task].sampling.max_tokens
        assert good["generated_text"].null_count() == 0
        spec = TASKS[task]
        if spec.output.kind == "choices":
            assert set(labels["label"].drop_nulls().to_list()) <= set(spec.output.choices)
            assert labels["label"].null_count() == labels["error"].is_not_null().sum()
            # The label is the generated text itself (structured outputs constrain it to a choice).
            assert good["label"].to_list() == good["generated_text"].str.strip_chars().to_list()
        else:
            assert good["label"].to_list() == good["generated_text"].to_list()

        metadata = (
            instance.fetch_materializations(
                dg.AssetRecordsFilter(asset_key=dg.AssetKey([task, "inference_outputs"]), asset_partitions=[key]),
                limit=1,
            )
            .records[0]
            .asset_materialization.metadata
        )
        value = {name: entry.value for name, entry in metadata.items()}
        assert value["rows"] == raw.height
        assert value["error_rows"] == 0
        # Fresh instance and cache: every distinct prompt is inferred in this run, nothing reused.
        assert value["rows_from_checkpoint"] == 0
        assert value["rows_inferred"] + value["rows_deduplicated"] == raw.height
        assert value["prompt_tokens"] == labels["num_prompt_tokens"].sum()
        assert value["generated_tokens"] <= labels["num_generated_tokens"].sum()
        assert value["engine_seconds"] > 0 and value["generated_tokens_per_second"] > 0
        assert value["model"] == tiny_model
        assert value["sampling_params"]["max_tokens"] == spec.sampling.max_tokens
        assert value["sampling_params"]["temperature"] == spec.sampling.temperature


def test_industry_repeated_companies_are_inferred_once(data_dir: Path, tiny_model: str) -> None:
    sample = SAMPLE_FILES["industry"]
    companies = pl.read_csv(sample)["Company"]
    drop(data_dir, "industry", sample.name, sample.read_bytes())
    with dg.instance_for_test() as instance:
        key, result = run_partition("industry", sample.name, instance)
        assert result.success
        metadata = result.asset_materializations_for_node("industry__inference_outputs")[0].metadata
        assert metadata["rows_deduplicated"].value == companies.len() - companies.n_unique()
        assert metadata["rows_inferred"].value == companies.n_unique()
        labels = read_output(data_dir, "industry", "validated_labels", key)
        # Same company, same label: deduplication must not mix rows up.
        assert labels.group_by("Company").agg(pl.col("label").n_unique())["label"].max() == 1


def test_bad_records_become_error_rows_and_nothing_is_lost(data_dir: Path, tiny_model: str) -> None:
    drop(data_dir, "sentiment", "mixed.jsonl", BAD_POSTS + "\n")
    with dg.instance_for_test() as instance:
        key, result = run_partition("sentiment", "mixed.jsonl", instance)
        assert result.success
        labels = read_output(data_dir, "sentiment", "validated_labels", key)
    assert labels.height == 9
    assert labels["source_line"].to_list() == list(range(1, 10))
    errors = dict(zip(labels["source_line"].to_list(), labels["error"].to_list(), strict=True))
    assert errors[1] is None and errors[7] is None and errors[9] is None
    assert errors[2].startswith("empty_text")
    assert errors[3].startswith("null_text")
    assert errors[4].startswith("missing_field")
    assert errors[5].startswith("malformed_json")
    assert errors[6].startswith("prompt_too_long")
    assert errors[8].startswith("non_string_text")
    for line in (2, 3, 4, 5, 6, 8):
        assert "mixed.jsonl" in errors[line] and f"line {line}" in errors[line]
    good = labels.filter(pl.col("error").is_null())
    assert set(good["label"].to_list()) <= {"positive", "negative", "neutral"}
    assert good["label"].null_count() == 0


def test_wrong_text_field_fails_the_partition_listing_columns(data_dir: Path, tiny_model: str) -> None:
    drop(data_dir, "industry", "no-company.csv", "Name,City\nAcme,Paris\n")
    with dg.instance_for_test() as instance:
        _, result = run_partition("industry", "no-company.csv", instance)
    assert not result.success
    message = "\n".join(failure_messages(result))
    assert "Company" in message and "['Name', 'City']" in message


def test_outputs_outside_the_choices_fail_the_blocking_check_and_skip_labels(data_dir: Path, tiny_model: str) -> None:
    """With structured outputs switched off the random model writes free text: the check must catch it."""
    defs = build_definitions(engine=VLLMEngine(structured_outputs=False))
    drop(data_dir, "sentiment", "posts.jsonl", SAMPLE_FILES["sentiment"].read_bytes())
    with dg.instance_for_test() as instance:
        key, result = run_partition("sentiment", "posts.jsonl", instance, defs)
        assert not result.success
        evaluations = {e.check_name: e for e in result.get_asset_check_evaluations()}
        failed = evaluations["outputs_satisfy_constraint"]
        assert not failed.passed and failed.severity == dg.AssetCheckSeverity.ERROR
        assert failed.metadata["failed_rows"].value > 0
        materialized = {m.asset_key for m in result.get_asset_materialization_events()}
        assert dg.AssetKey(["sentiment", "inference_outputs"]) in materialized
        assert dg.AssetKey(["sentiment", "validated_labels"]) not in materialized
    assert not (data_dir / "storage" / "sentiment" / "validated_labels" / f"{key}.parquet").exists()
