"""Runs over a range of partitions (`BackfillPolicy.multi_run`): same outputs as one run per partition,
metadata and check evaluations per partition, and a bad file in a range."""

from __future__ import annotations

import io
from pathlib import Path

import dagster as dg
import polars as pl
import pytest
from dagster._core.event_api import PartitionKeyFilter

from batch_assets.lib.task_definitions import build_definitions, pipeline_job_name
from batch_assets.storage.drop_files import partition_key_for, partitions_def_name
from batch_assets_tests.support import drop

# The slow tier (`make test-fast` leaves it out): every test materializes ranges on the engine (tiny model).
pytestmark = pytest.mark.slow

TASK = "industry"
ASSETS = ("raw_prompts", "formatted_prompts", "inference_outputs", "validated_labels")
BLOCKING_CHECKS = {"outputs_satisfy_constraint", "labels_are_valid", "one_row_per_record"}
NO_CACHE = {"ops": {f"{TASK}__inference_outputs": {"config": {"use_result_cache": False}}}}
RANGE_START, RANGE_END = "dagster/asset_partition_range_start", "dagster/asset_partition_range_end"


def customers_csv(first: int, count: int) -> str:
    rows = [f"{i},Customer {i},Acme Widgets {i} Inc" for i in range(first, first + count)]
    return "Index,Name,Company\n" + "\n".join(rows) + "\n"


def drop_files(data: Path, instance: dg.DagsterInstance, contents: dict[str, bytes | str]) -> list[str]:
    for name, content in contents.items():
        drop(data, TASK, name, content)
    keys = [partition_key_for(name) for name in contents]
    instance.add_dynamic_partitions(partitions_def_name(TASK), keys)
    return keys


def run_range(instance: dg.DagsterInstance, keys: list[str]):
    job = build_definitions().resolve_job_def(pipeline_job_name(TASK))
    tags = {RANGE_START: keys[0], RANGE_END: keys[-1]}
    return job.execute_in_process(instance=instance, run_config=NO_CACHE, tags=tags, raise_on_error=False)


def read(data: Path, asset: str, key: str) -> pl.DataFrame:
    return pl.read_parquet(data / "storage" / TASK / asset / f"{key}.parquet")


def materialization_metadata(instance: dg.DagsterInstance, asset: str, key: str) -> dict:
    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=dg.AssetKey([TASK, asset]), asset_partitions=[key]), limit=1
    ).records
    return {name: value.value for name, value in records[0].asset_materialization.metadata.items()} if records else {}


def test_a_range_run_equals_one_run_per_partition(data_dir: Path, tiny_model: str) -> None:
    files = {"a.csv": customers_csv(0, 4), "b.csv": customers_csv(10, 7), "c.csv": customers_csv(30, 2)}
    with dg.instance_for_test() as instance:
        keys = drop_files(data_dir, instance, files)
        job = build_definitions().resolve_job_def(pipeline_job_name(TASK))
        singles = {}
        for key in keys:
            result = job.execute_in_process(instance=instance, partition_key=key, run_config=NO_CACHE)
            assert result.success
            singles[key] = read(data_dir, "validated_labels", key)

        result = run_range(instance, keys)
        assert result.success
        assert len(instance.get_runs()) == 4  # three single runs, then one run for the range
        for key, rows in zip(keys, (4, 7, 2), strict=True):
            labels = read(data_dir, "validated_labels", key)
            assert labels.height == rows
            # Row for row the same labels and outputs; a confidence is a float from batched arithmetic,
            # and the range batches other rows together, so it is compared to a tolerance.
            assert labels.drop("confidence").equals(singles[key].drop("confidence")), key
            confidence = labels["confidence"].to_list()
            assert confidence == pytest.approx(singles[key]["confidence"].to_list(), abs=1e-4), key
            # Metadata per partition: each partition's own row count, not the range's.
            for asset in ASSETS:
                metadata = materialization_metadata(instance, asset, key)
                assert metadata["rows"] == rows, (asset, key)
                assert (
                    instance.fetch_materializations(
                        dg.AssetRecordsFilter(asset_key=dg.AssetKey([TASK, asset]), asset_partitions=[key]), limit=5
                    )
                    .records[0]
                    .run_id
                    == result.run_id
                )
            assert materialization_metadata(instance, "inference_outputs", key)["rows_inferred"] == rows
            assert materialization_metadata(instance, "raw_prompts", key)["source_file"] == key

        # One evaluation per check of the task and partition, each recorded against that partition.
        checks = {
            key.name
            for key in build_definitions().resolve_asset_graph().asset_check_keys
            if key.asset_key.path[0] == TASK
        }
        assert checks > BLOCKING_CHECKS
        evaluations = result.get_asset_check_evaluations()
        assert sorted((e.check_name, e.partition) for e in evaluations) == sorted(
            (check, key) for check in checks for key in keys
        )
        assert all(e.passed for e in evaluations if e.check_name in BLOCKING_CHECKS)
        one_row = {
            e.partition: e.metadata["output_rows"].value for e in evaluations if e.check_name == "one_row_per_record"
        }
        assert one_row == dict(zip(keys, (4, 7, 2), strict=True))
        # The instance records them per partition too (what the UI shows on each partition).
        check_key = dg.AssetCheckKey(dg.AssetKey([TASK, "validated_labels"]), "labels_are_valid")
        for key in keys:
            latest = instance.event_log_storage.get_latest_asset_check_execution_by_key(
                [check_key], partition_filter=PartitionKeyFilter(key=key)
            )
            assert latest[check_key].run_id == result.run_id, key


def test_a_bad_file_fails_its_range_before_the_engine_and_a_rerun_infers_nothing_twice(
    data_dir: Path, tiny_model: str
) -> None:
    files = {
        "good1.csv": customers_csv(0, 3),
        "broken.parquet": b"not a parquet file",
        "good2.csv": customers_csv(5, 2),
    }
    with dg.instance_for_test() as instance:
        keys = drop_files(data_dir, instance, files)
        result = run_range(instance, keys)
        assert not result.success
        failure = next(e for e in result.all_events if e.is_step_failure)
        assert failure.step_key == f"{TASK}__raw_prompts"
        assert "broken.parquet: not a readable parquet file" in failure.step_failure_data.error.to_string()
        # Nothing of the range is recorded as materialized; the engine was never reached.
        assert not any(materialization_metadata(instance, "raw_prompts", key) for key in keys)
        assert not (data_dir / "storage" / TASK / "inference_outputs").exists()

        # The user replaces the bad file; the range runs again and each partition is inferred once.
        fixed = io.BytesIO()
        pl.DataFrame({"Company": ["Bolt Legal LLP"]}).write_parquet(fixed)
        drop(data_dir, TASK, "broken.parquet", fixed.getvalue())
        assert run_range(instance, keys).success
        inferred = {key: materialization_metadata(instance, "inference_outputs", key)["rows_inferred"] for key in keys}
        assert inferred == dict(zip(keys, (3, 1, 2), strict=True))


def test_the_range_failure_sensor_runs_the_good_files_of_a_failed_range_again(data_dir: Path, tiny_model: str) -> None:
    files = {
        "good1.csv": customers_csv(0, 3),
        "broken.parquet": b"not a parquet file",
        "good2.csv": customers_csv(5, 2),
        "good3.csv": customers_csv(9, 1),
    }
    defs = build_definitions()
    sensor = defs.get_sensor_def("range_failure_sensor")
    with dg.instance_for_test() as instance:
        keys = drop_files(data_dir, instance, files)
        failed = run_range(instance, keys)
        assert not failed.success

        def evaluate(result) -> list:
            run_failure = next(e for e in result.all_events if e.event_type_value == "PIPELINE_FAILURE")
            context = dg.build_run_status_sensor_context(
                sensor_name=sensor.name,
                dagster_event=run_failure,
                dagster_instance=instance,
                dagster_run=instance.get_run_by_id(result.run_id),
            ).for_run_failure()
            outcome = sensor(context)
            return outcome if isinstance(outcome, list) else []

        # The good files around the bad one: the first alone, the other two as a range.
        requests = evaluate(failed)
        assert [(r.partition_key, r.tags.get(RANGE_START), r.tags.get(RANGE_END)) for r in requests] == [
            (keys[0], None, None),
            (None, keys[2], keys[3]),
        ]
        assert {r.tags["batch_assets/rerun_of"] for r in requests} == {failed.run_id}
        assert len({r.run_key for r in requests}) == 2

        job = defs.resolve_job_def(pipeline_job_name(TASK))
        for request in requests:
            rerun = job.execute_in_process(
                instance=instance, partition_key=request.partition_key, tags=request.tags, run_config=NO_CACHE
            )
            assert rerun.success
        assert {key: read(data_dir, "validated_labels", key).height for key in (keys[0], keys[2], keys[3])} == {
            keys[0]: 3,
            keys[2]: 2,
            keys[3]: 1,
        }
        assert not materialization_metadata(instance, "raw_prompts", keys[1])  # the bad file stays failed

        # A failed run the sensor requested is split again without the file it failed on, so the
        # re-runs shrink until only good files are left.
        drop(data_dir, TASK, "good2.csv", "Index,Name\n1,no company column\n")
        again = job.execute_in_process(
            instance=instance, tags=requests[1].tags, run_config=NO_CACHE, raise_on_error=False
        )
        assert not again.success
        [last] = evaluate(again)
        assert last.partition_key == keys[3] and last.tags["batch_assets/rerun_of"] == again.run_id
        assert last.tags["batch_assets/left_out"] == keys[2]
        # A single-partition run that fails is not run again: it is the bad file itself.
        alone = job.execute_in_process(
            instance=instance, partition_key=keys[2], tags=last.tags, run_config=NO_CACHE, raise_on_error=False
        )
        assert not alone.success and evaluate(alone) == []
