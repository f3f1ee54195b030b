"""Big drop files split into shards: one streaming pass finds record boundaries, and the shards read
one by one give exactly the rows (row_id, source_line, errors naming whole-file lines) that reading
the whole file gives."""

from __future__ import annotations

import gzip
import io
import json
import os
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from polars.testing import assert_frame_equal

from batch_assets.pipeline.inputs.file_shards import may_need_shards, plan_shards
from batch_assets.pipeline.inputs.read_prompts import DropFileError, read_prompts
from batch_assets.storage import shards as shards_module
from batch_assets.storage.drop_files import file_key_of, find_drop_file, shard_index_of, shard_key
from batch_assets.storage.shards import (
    delete_partition_outputs,
    file_partition_keys,
    partitions_by_file,
    read_partition_rows,
    retired_partitions,
    shard_plan,
)
from batch_assets_tests.support import drop
from batch_assets_tests.support.drops import OPTIONS, jsonl_with_bad_lines

TASK = "sentiment"


def csv_with_quoted_newlines(rows: int) -> bytes:
    out = io.StringIO()
    out.write('text,"multi\nline header"\n')
    for n in range(rows):
        if n % 3 == 0:
            out.write(f'"row {n}\nspans\ntwo lines",{n}\n')
        elif n == 5:
            out.write(f"row {n},{n},an extra field\n")  # malformed: 3 fields
        else:
            out.write(f"row {n},{n}\n")
    return out.getvalue().encode()


def read_by_shards(data: Path, name: str, max_rows: int) -> tuple[list[str], pl.DataFrame]:
    found = find_drop_file(TASK, name.replace("/", "__"))
    keys = file_partition_keys(TASK, found, max_rows)
    frames = [read_partition_rows(TASK, find_drop_file(TASK, key), key, OPTIONS, max_rows) for key in keys]
    return keys, pl.concat(frames, how="diagonal")


@pytest.mark.parametrize(
    ("name", "content"),
    [
        ("posts.jsonl", jsonl_with_bad_lines(11)),
        ("posts.jsonl.gz", gzip.compress(jsonl_with_bad_lines(11))),
        ("posts.csv", csv_with_quoted_newlines(11)),
        ("posts.csv.gz", gzip.compress(csv_with_quoted_newlines(11))),
        ("posts.txt", b"a\nb\n\nd\ne\nf\ng\nh\ni\nj\nlast line without newline"),
        ("bom.csv", b"\xef\xbb\xbftext,n\n" + b"".join(f"r{n},{n}\r\n".encode() for n in range(11))),
    ],
)
def test_shards_read_one_by_one_give_the_rows_of_the_whole_file(data_dir: Path, name: str, content: bytes) -> None:
    drop(data_dir, TASK, name, content)
    whole = read_prompts(content, name, OPTIONS)
    keys, sharded = read_by_shards(data_dir, name, max_rows=3)
    assert whole.height == 11
    assert keys == [shard_key(name, index) for index in range(4)] == [f"{name}~0000{n}" for n in (1, 2, 3, 4)]
    assert_frame_equal(sharded, whole)
    assert sharded["row_id"].to_list() == list(range(11))


def test_errors_name_lines_of_the_whole_file(data_dir: Path) -> None:
    drop(data_dir, TASK, "posts.csv", csv_with_quoted_newlines(11))
    _, rows = read_by_shards(data_dir, "posts.csv", max_rows=2)
    errors = rows.filter(pl.col("error").is_not_null())
    # The header takes lines 1-2; rows 0, 3 take three lines each: row 5 starts on line 12.
    assert errors.select("row_id", "source_line").rows() == [(5, 12)]
    assert errors["error"][0] == "malformed_csv: posts.csv line 12: 3 fields, the header has 2"
    assert rows.filter(pl.col("row_id") == 3)["text"][0] == "row 3\nspans\ntwo lines"

    drop(data_dir, TASK, "posts.jsonl", jsonl_with_bad_lines(11))
    _, rows = read_by_shards(data_dir, "posts.jsonl", max_rows=2)
    assert rows.filter(pl.col("error").is_not_null())["error"].to_list() == [
        "malformed_json: posts.jsonl line 5: Expecting property name enclosed in double quotes at column 2",
        "empty_record: posts.jsonl line 8: blank line",
    ]


def test_parquet_shards_follow_row_groups_and_cut_a_group_larger_than_a_shard(data_dir: Path) -> None:
    table = pa.table({"text": [f"row {n}" if n != 6 else None for n in range(10)], "n": list(range(10))})
    sink = io.BytesIO()
    pq.write_table(table, sink, row_group_size=4)  # groups of 4, 4, 2 rows
    content = sink.getvalue()
    plan = plan_shards(io.BytesIO(content), "t.parquet", "v1", max_rows=5)
    assert [(s.first_row, s.rows) for s in plan.shards] == [(0, 4), (4, 4), (8, 2)]
    plan = plan_shards(io.BytesIO(content), "t.parquet", "v1", max_rows=3)
    assert [(s.first_row, s.rows) for s in plan.shards] == [(0, 3), (3, 3), (6, 3), (9, 1)]

    drop(data_dir, TASK, "t.parquet", content)
    whole = read_prompts(content, "t.parquet", OPTIONS)
    _, sharded = read_by_shards(data_dir, "t.parquet", max_rows=3)
    assert_frame_equal(sharded, whole)
    assert sharded.filter(pl.col("error").is_not_null())["error"].to_list() == [
        "null_text: t.parquet row 7: field 'text' is null"
    ]


def test_a_file_within_the_limit_stays_one_partition_and_is_not_read_to_plan(data_dir: Path) -> None:
    drop(data_dir, TASK, "small.jsonl", jsonl_with_bad_lines(11))
    found = find_drop_file(TASK, "small.jsonl")
    assert not may_need_shards(".jsonl", found.size, max_rows=10_000)
    assert file_partition_keys(TASK, found, 10_000) == ["small.jsonl"]
    assert not (data_dir / "storage" / TASK / "_shards").exists()
    # More bytes than the limit but not more records: one pass, one partition.
    assert file_partition_keys(TASK, found, 11) == ["small.jsonl"]
    assert may_need_shards(".jsonl.gz", 10, 10_000) and may_need_shards(".parquet", 10, 10_000)


def test_plan_is_kept_per_version_and_a_replaced_file_retires_the_shards_it_no_longer_has(
    data_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = drop(data_dir, TASK, "posts.jsonl", jsonl_with_bad_lines(11))
    first = find_drop_file(TASK, "posts.jsonl")
    assert file_partition_keys(TASK, first, 3) == [f"posts.jsonl~0000{n}" for n in (1, 2, 3, 4)]
    kept = data_dir / "storage" / TASK / "_shards" / "posts.jsonl.json"
    assert json.loads(kept.read_text())["version"] == first.version
    planned = shard_plan(TASK, first, 3)
    with monkeypatch.context() as no_second_pass:
        no_second_pass.setattr(shards_module, "plan_shards", lambda *args: pytest.fail("the file was read again"))
        assert shard_plan(TASK, first, 3) == planned  # the same version: the kept plan, no pass

    path.write_bytes(jsonl_with_bad_lines(9))
    os.utime(path, (1_900_000_000, 1_900_000_000))
    second = find_drop_file(TASK, "posts.jsonl")
    keys = file_partition_keys(TASK, second, 3)
    assert keys == ["posts.jsonl~00001", "posts.jsonl~00002", "posts.jsonl~00003"]
    existing = ["other.csv", "posts.jsonl~00001", "posts.jsonl~00002", "posts.jsonl~00003", "posts.jsonl~00004"]
    assert retired_partitions(existing, "posts.jsonl", keys) == ["posts.jsonl~00004"]
    by_file = partitions_by_file(existing + ["posts.jsonl"])
    assert by_file == {
        "other.csv": ["other.csv"],
        "posts.jsonl": [
            "posts.jsonl~00001",
            "posts.jsonl~00002",
            "posts.jsonl~00003",
            "posts.jsonl~00004",
            "posts.jsonl",
        ],
    }
    assert retired_partitions(by_file["posts.jsonl"], "posts.jsonl", keys) == ["posts.jsonl~00004", "posts.jsonl"]
    assert retired_partitions(["posts.jsonl", "posts.jsonl~00001"], "posts.jsonl", ["posts.jsonl"]) == [
        "posts.jsonl~00001"
    ]
    with pytest.raises(DropFileError, match=r"posts.jsonl~00004 is a shard of an earlier version.*3 partition"):
        read_partition_rows(TASK, second, "posts.jsonl~00004", OPTIONS, 3)

    stored = data_dir / "storage" / TASK / "validated_labels" / "posts.jsonl~00004.parquet"
    stored.parent.mkdir(parents=True)
    stored.write_bytes(b"old")
    delete_partition_outputs(TASK, ["posts.jsonl~00004"])
    assert not stored.exists()


def test_a_shard_read_after_its_file_was_replaced_is_refused(data_dir: Path) -> None:
    path = drop(data_dir, TASK, "posts.jsonl", jsonl_with_bad_lines(11))
    listed = find_drop_file(TASK, "posts.jsonl")
    file_partition_keys(TASK, listed, 3)
    path.write_bytes(jsonl_with_bad_lines(12))
    with pytest.raises(DropFileError, match="replaced since it was listed"):
        read_partition_rows(TASK, listed, "posts.jsonl~00002", OPTIONS, 3)


def test_shard_keys_name_their_file() -> None:
    assert file_key_of("posts_1.csv-0a1b2c3d~00012") == "posts_1.csv-0a1b2c3d"
    assert shard_index_of("posts_1.csv-0a1b2c3d~00012") == 11
    assert shard_index_of("posts.csv") is None and file_key_of("posts.csv") == "posts.csv"


def test_a_corrupt_gzip_or_bad_csv_header_cannot_be_planned() -> None:
    with pytest.raises(DropFileError, match="gzip"):
        plan_shards(io.BytesIO(gzip.compress(b"a\n" * 10)[:-6]), "x.jsonl.gz", "v", 3)
    with pytest.raises(DropFileError, match="parquet"):
        plan_shards(io.BytesIO(b"not parquet"), "x.parquet", "v", 3)


def test_a_shard_whose_records_cannot_be_read_fails_alone_naming_file_and_lines(data_dir: Path) -> None:
    # Records 10-19 (lines 11-20) lack the text field the task reads: that shard fails, the others read.
    records = [{"text": f"post {n}"} if not 10 <= n < 20 else {"body": f"post {n}"} for n in range(25)]
    drop(data_dir, TASK, "posts.jsonl", "".join(json.dumps(record) + "\n" for record in records))
    found = find_drop_file(TASK, "posts.jsonl")
    first, second, third = file_partition_keys(TASK, found, 10)
    assert read_partition_rows(TASK, found, first, OPTIONS, 10)["row_id"].to_list() == list(range(10))
    assert read_partition_rows(TASK, found, third, OPTIONS, 10)["source_line"].to_list() == list(range(21, 26))
    with pytest.raises(DropFileError) as failed:
        read_partition_rows(TASK, found, second, OPTIONS, 10)
    assert str(failed.value) == (
        "posts.jsonl: no record has the field(s) ['text']; fields found: ['body'] (shard 2 of 3: lines 11-20)"
    )
