"""Bad input through the whole pipeline: every record one row, clear errors, other partitions unharmed."""

from __future__ import annotations

from pathlib import Path

import dagster as dg
import polars as pl
import pytest

from batch_assets.app.runner import run_partitions
from batch_assets.lib.task_definitions import build_definitions, pipeline_job_name
from batch_assets.storage.drop_files import partition_key_for, partitions_def_name
from batch_assets_tests.support import drop

# The slow tier (`make test-fast` leaves it out): every test runs the pipeline on the engine (tiny model).
pytestmark = pytest.mark.slow


def run(task: str, file_name: str, instance: dg.DagsterInstance):
    key = partition_key_for(file_name)
    instance.add_dynamic_partitions(partitions_def_name(task), [key])
    return (
        build_definitions()
        .resolve_job_def(pipeline_job_name(task))
        .execute_in_process(instance=instance, partition_key=key, raise_on_error=False)
    )


def output(data: Path, task: str, asset: str, file_name: str) -> pl.DataFrame:
    return pl.read_parquet(data / "storage" / task / asset / f"{partition_key_for(file_name)}.parquet")


def test_empty_and_header_only_files_succeed_with_zero_rows(data_dir: Path, tiny_model: str) -> None:
    drop(data_dir, "sentiment", "empty.jsonl", b"")
    drop(data_dir, "industry", "header-only.csv", b"Index,Company,City\n")
    with dg.instance_for_test() as instance:
        for task, name in (("sentiment", "empty.jsonl"), ("industry", "header-only.csv")):
            result = run(task, name, instance)
            assert result.success
            assert all(e.passed for e in result.get_asset_check_evaluations())
            labels = output(data_dir, task, "validated_labels", name)
            assert labels.height == 0 and {"row_id", "label", "error"} <= set(labels.columns)
            assert any("has no records" in record.user_message for record in instance.all_logs(result.run_id))
    assert "City" in output(data_dir, "industry", "validated_labels", "header-only.csv").columns


MESSY_CSV = (
    b"Index,Company,City\n"
    b'1,"Hartley & Boone, LLP","Columbus, OH"\n'
    b'2,"St. Brigid\nCommunity Hospital",Cork\n'
    b"3,Caf\xe9 Lumi\xe8re,Lyon\n"
    b"4,Too,many,fields\n"
    b"\n"
    b'5,"' + b"Enormous Holdings " * 2000 + b'",Berlin\n'
    b"6,Acme Corp,Paris\n"
    b"7,Acme Corp,Paris\n"
)


def test_a_messy_csv_keeps_every_record_with_errors_naming_file_and_line(data_dir: Path, tiny_model: str) -> None:
    drop(data_dir, "industry", "messy.csv", MESSY_CSV)
    with dg.instance_for_test() as instance:
        result = run("industry", "messy.csv", instance)
        assert result.success
        metadata = result.asset_materializations_for_node("industry__inference_outputs")[0].metadata
        assert metadata["rows_deduplicated"].value == 1  # the two Acme Corp rows: inferred once
    labels = output(data_dir, "industry", "validated_labels", "messy.csv")
    assert labels.height == 8 and labels["row_id"].to_list() == list(range(8))
    by_line = {row["source_line"]: row for row in labels.to_dicts()}
    assert sorted(by_line) == [2, 3, 5, 6, 7, 8, 9, 10]
    assert (
        by_line[2]["Company"] == "Hartley & Boone, LLP"
        and by_line[2]["City"] == "Columbus, OH"
        and by_line[2]["error"] is None
    )
    assert by_line[3]["Company"] == "St. Brigid\nCommunity Hospital" and by_line[3]["error"] is None
    expected = {5: "invalid_utf8", 6: "malformed_csv", 7: "empty_record", 8: "prompt_too_long"}
    for line, code in expected.items():
        assert by_line[line]["error"].startswith(f"{code}: messy.csv line {line}"), by_line[line]["error"]
        assert by_line[line]["label"] is None
    assert by_line[9]["label"] is not None and by_line[9]["label"] == by_line[10]["label"]


def test_a_bad_file_fails_only_its_own_partition(data_dir: Path, tiny_model: str, tmp_path: Path) -> None:
    """`batch-assets run` with a wrong-column file first: the next file's partition still succeeds."""
    bad = tmp_path / "wrong-column.csv"
    bad.write_bytes(b"Name,City\nAcme,Paris\n")
    good = tmp_path / "good.csv"
    good.write_bytes(b"Company\nAcme Corp\nGlobex\n")
    outcomes = {o.partition_key: o for o in run_partitions("industry", [bad, good])}
    assert not outcomes["wrong-column.csv"].success
    assert "['Company'] not found; columns found: ['Name', 'City']" in outcomes["wrong-column.csv"].summary
    assert outcomes["good.csv"].ok
    assert output(data_dir, "industry", "validated_labels", "good.csv").height == 2
