"""The drops sensor on a local drop folder, partition keys, the cursor, atomic writes and error text.

The S3 side of the same sensor is in test_s3_drops.py.
"""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path

import dagster as dg
import polars as pl
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batch_assets.lib.drops_sensor import (
    build_drops_sensor,
    decode_cursor,
    encode_cursor,
    file_fingerprint,
    plan_drops_tick,
    plan_tick,
)
from batch_assets.lib.partition_versions import file_validated_from_version, read_version
from batch_assets.lib.run_requests import (
    LAUNCHED_BY_TAG,
    RANGE_END_TAG,
    RANGE_START_TAG,
    REPLACED_TAG,
    SOURCE_FILE_TAG,
    requested_partitions,
)
from batch_assets.lib.task_definitions import build_definitions, pipeline_job_name
from batch_assets.pipeline.task_spec import load_task_specs
from batch_assets.storage.drop_files import (
    DropFile,
    file_key_of,
    find_drop_file,
    list_drop_files,
    partition_key_for,
    partitions_def_name,
    skip_reason,
)
from batch_assets.storage.errors import StorageError, scrub
from batch_assets.storage.locations import data_root, storage_path, write_bytes_atomically
from batch_assets.storage.shards import partitions_by_file
from batch_assets_tests.support import drop, run_on_a_tiny_file_system
from batch_assets_tests.support.drops import settled, tick

TASK = "sentiment"
POST = '{"text": "Loving it"}\n'
SAFE_KEY = r"^[A-Za-z0-9._-]+$"

TRICKY_NAMES = [
    "posts.jsonl",
    "posts 1.jsonl",
    "posts_1.jsonl",
    "posts!1.jsonl",
    "a/b.jsonl",
    "a__b.jsonl",
    "a/b/c.jsonl",
    "a__b/c.jsonl",
    "données/été.jsonl",
    "日本語.jsonl",
    "x...y.csv",
    "x..y.csv",
    "emoji 😀.txt",
    "2026/11/posts.jsonl",
    "2026__11__posts.jsonl",
    "deep/" * 40 + "long.jsonl",
    "n" * 300 + ".jsonl",
    "n" * 301 + ".jsonl",
]


def test_partition_keys_are_path_safe_unique_and_accepted_by_dagster() -> None:
    keys = [partition_key_for(name) for name in TRICKY_NAMES]
    assert len(set(keys)) == len(keys)
    for key in keys:
        assert key and "..." not in key and len(key) <= 150
        assert re.fullmatch(SAFE_KEY, key), key
    assert partition_key_for("posts.jsonl") == "posts.jsonl"  # plain names stay readable
    assert partition_key_for("2026/11/posts.jsonl").startswith("2026__11__posts.jsonl-")
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions(partitions_def_name(TASK), keys)
        assert sorted(instance.get_dynamic_partitions(partitions_def_name(TASK))) == sorted(keys)


# No deadline or speed check: an example's time says nothing here, and it varies with the machine's load.
@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=80),
        min_size=2,
        max_size=20,
        unique=True,
    )
)
def test_partition_keys_are_safe_and_distinct_for_any_names(names: list[str]) -> None:
    names = [name.strip("/") for name in names if name.strip("/")]
    keys = {partition_key_for(name) for name in set(names)}
    assert len(keys) == len(set(names))
    for key in keys:
        assert re.fullmatch(SAFE_KEY, key) and "..." not in key and len(key) <= 150


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("posts.jsonl", None),
        ("sub/posts.CSV", None),
        (".posts.jsonl", "hidden"),
        ("_temporary/part-0.jsonl", "hidden"),
        ("~lock.csv", "hidden"),
        ("posts.jsonl.part", "still being written"),
        ("posts.jsonl.tmp", "still being written"),
        ("posts.crdownload", "still being written"),
        ("notes.md", "unknown extension"),
        ("archive.jsonl.gz", None),
        ("sub/customers.CSV.GZ", None),
        ("prompts.txt.gz", None),
        ("archive.json.gz", "unknown extension"),
        ("archive.gz", "unknown extension"),
        (".gz", "hidden"),
        ("posts.json", "unknown extension"),
    ],
)
def test_skip_reasons(name: str, reason: str | None) -> None:
    found = skip_reason(name)
    assert found is None if reason is None else reason in found


def test_cursor_round_trips_and_stays_small() -> None:
    fingerprints = {index.to_bytes(8, "big") for index in range(10_000)}
    cursor = encode_cursor(fingerprints)
    assert decode_cursor(cursor) == fingerprints
    assert len(cursor) < 110_000
    assert decode_cursor(None) == set()
    for bad in ('{"posts.jsonl": "abc"}', "v2:@@@", "v2:" + "A" * 4):
        with pytest.raises(ValueError):
            decode_cursor(bad)


def sensor_for(**kwargs) -> dg.SensorDefinition:
    task = next(task for task in load_task_specs() if task.name == TASK)
    job = build_definitions().resolve_job_def(pipeline_job_name(TASK))
    return build_drops_sensor(task, job, **kwargs)


def ordered_partitions(instance: dg.DagsterInstance) -> list[str]:
    return list(instance.get_dynamic_partitions(partitions_def_name(TASK)))


def test_local_drop_folder_new_replaced_in_progress_and_restart(data_dir: Path) -> None:
    settled(drop(data_dir, TASK, "posts.jsonl", POST))
    settled(drop(data_dir, TASK, "team a/été.jsonl", POST))
    # Modified "just now" however long the steps below take on a loaded machine: still being copied in.
    settled(drop(data_dir, TASK, "copying.jsonl", POST), age=-600)
    settled(drop(data_dir, TASK, ".posts.jsonl.swp", POST))
    sensor = sensor_for()
    with dg.instance_for_test() as instance:
        # Two new files in one tick: one run over the range of both partitions (oldest file first).
        first, cursor = tick(sensor, instance, None)
        [burst] = first.run_requests
        pair = [partition_key_for("posts.jsonl"), partition_key_for("team a/été.jsonl")]
        assert ordered_partitions(instance) == pair
        assert burst.partition_key is None and requested_partitions(burst, ordered_partitions(instance)) == pair
        assert (burst.tags[RANGE_START_TAG], burst.tags[RANGE_END_TAG]) == tuple(pair)
        assert burst.tags[LAUNCHED_BY_TAG] == "sensor" and REPLACED_TAG not in burst.tags
        assert burst.run_key.startswith(f"{pair[0]}..{pair[1]}@")
        # The same tick evaluated again (its cursor lost) asks for the same run key, which Dagster
        # launches only once.
        retried, _ = tick(sensor, instance, None)
        assert [request.run_key for request in retried.run_requests] == [burst.run_key]

        settled(data_dir / "drops" / TASK / "copying.jsonl", age=-600)  # still being written to
        quiet, cursor = tick(sensor, instance, cursor)
        assert not quiet.run_requests
        assert "copying.jsonl: still being written" in quiet.skip_reason.skip_message
        assert ".posts.jsonl.swp: hidden or temporary name" in quiet.skip_reason.skip_message

        settled(data_dir / "drops" / TASK / "copying.jsonl")
        copied, cursor = tick(sensor, instance, cursor)
        assert [request.tags[SOURCE_FILE_TAG] for request in copied.run_requests] == ["copying.jsonl"]

        # The burst's run read posts.jsonl (its raw_prompts records the version); then the file is
        # replaced (new modification time and size): one run, tagged as a replacement.
        job = build_definitions().resolve_job_def(pipeline_job_name(TASK))
        raw = [dg.AssetKey([TASK, "raw_prompts"])]
        assert job.execute_in_process(instance=instance, partition_key=pair[0], asset_selection=raw).success
        settled(drop(data_dir, TASK, "posts.jsonl", POST + POST), age=30)
        replaced, cursor = tick(sensor, instance, cursor)
        assert [request.partition_key for request in replaced.run_requests] == ["posts.jsonl"]
        assert replaced.run_requests[0].tags[REPLACED_TAG] == "true"
        assert not replaced.dynamic_partitions_requests  # the partition exists already

        # A removed file leaves the cursor; nothing runs.
        (data_dir / "drops" / TASK / "copying.jsonl").unlink()
        removed, cursor = tick(sensor, instance, cursor)
        assert not removed.run_requests and len(decode_cursor(cursor)) == 2

        # A cursor from elsewhere is ignored with a warning; every file is checked again, and the
        # ones not yet validated from their current version are requested (here: none has run).
        reset, _ = tick(sensor, instance, '{"old": "format"}')
        # été.jsonl was never read: a new file; posts.jsonl has new content since its run read it.
        new, again = reset.run_requests
        assert (new.partition_key, REPLACED_TAG in new.tags) == (pair[1], False)
        assert (again.partition_key, again.tags[REPLACED_TAG]) == (pair[0], "true")
        assert again.run_key != burst.run_key


def test_bursts_are_worked_through_oldest_first_a_few_runs_per_tick(data_dir: Path) -> None:
    for age, name in enumerate(["e.jsonl", "d.jsonl", "c.jsonl", "b.jsonl", "a.jsonl"]):
        settled(drop(data_dir, TASK, name, POST), age=100 + age)  # a.jsonl is the oldest
    sensor = sensor_for(max_runs_per_tick=2)
    order: list[list[str]] = []
    runs: list[int] = []
    with dg.instance_for_test() as instance:
        cursor = None
        for _ in range(4):
            result, cursor = tick(sensor, instance, cursor)
            ordered = ordered_partitions(instance)
            order.append([key for request in result.run_requests for key in requested_partitions(request, ordered)])
            runs.append(len(result.run_requests))
    assert order == [["a.jsonl", "b.jsonl"], ["c.jsonl", "d.jsonl"], ["e.jsonl"], []]
    assert runs == [1, 1, 1, 0]  # each tick's files in one range run


def test_a_burst_larger_than_a_run_becomes_ranges_of_max_partitions_per_run(data_dir: Path) -> None:
    for age, name in enumerate(["e.jsonl", "d.jsonl", "c.jsonl", "b.jsonl", "a.jsonl"]):
        settled(drop(data_dir, TASK, name, POST), age=100 + age)
    task = next(task for task in load_task_specs() if task.name == TASK)
    task = task.model_copy(update={"runs": task.runs.model_copy(update={"max_partitions_per_run": 2})})
    sensor = build_drops_sensor(task, build_definitions().resolve_job_def(pipeline_job_name(TASK)))
    with dg.instance_for_test() as instance:
        result, _ = tick(sensor, instance, None)
        ordered = ordered_partitions(instance)
        assert ordered == ["a.jsonl", "b.jsonl", "c.jsonl", "d.jsonl", "e.jsonl"]  # arrival order
        ranges = [requested_partitions(request, ordered) for request in result.run_requests]
        assert ranges == [["a.jsonl", "b.jsonl"], ["c.jsonl", "d.jsonl"], ["e.jsonl"]]
        # The last file alone is an ordinary single-partition run.
        assert result.run_requests[2].partition_key == "e.jsonl"
        assert result.run_requests[2].tags[SOURCE_FILE_TAG] == "e.jsonl"
        assert len({request.run_key for request in result.run_requests}) == 3


@pytest.mark.slow
def test_sensor_skips_files_already_run_from_the_command_line(data_dir: Path, tiny_model: str, tmp_path: Path) -> None:
    from batch_assets.app.runner import run_partitions

    source = tmp_path / "posts.jsonl"
    source.write_text(POST * 3)
    [outcome] = run_partitions(TASK, [source])
    assert outcome.ok
    sensor = sensor_for(settle_seconds=0)
    instance = dg.DagsterInstance.get()  # the instance at DAGSTER_HOME the command recorded into
    result, cursor = tick(sensor, instance, None)
    assert not result.run_requests
    assert decode_cursor(cursor)  # remembered, not checked again next tick
    # Changed content under the same name is another matter.
    source.write_text(POST * 4)
    drop(data_dir, TASK, "posts.jsonl", source.read_bytes())
    changed, _ = tick(sensor, instance, cursor)
    assert [request.partition_key for request in changed.run_requests] == ["posts.jsonl"]
    assert changed.run_requests[0].tags[REPLACED_TAG] == "true"


def test_files_left_by_a_failed_or_killed_command_line_run_are_not_replacements(data_dir: Path) -> None:
    """`batch-assets run` registers a file's partition before its run: killed before reading the
    file, or failed after reading this same version, the file the sensor then runs replaces nothing."""
    settled(drop(data_dir, TASK, "killed.jsonl", POST))
    settled(drop(data_dir, TASK, "failed.jsonl", POST))
    killed, failed = partition_key_for("killed.jsonl"), partition_key_for("failed.jsonl")
    sensor = sensor_for()
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions(partitions_def_name(TASK), [killed, failed])
        # The failed run read the file (raw_prompts records its version), then failed later on.
        job = build_definitions().resolve_job_def(pipeline_job_name(TASK))
        raw = [dg.AssetKey([TASK, "raw_prompts"])]
        assert job.execute_in_process(instance=instance, partition_key=failed, asset_selection=raw).success
        first, cursor = tick(sensor, instance, None)
        [burst] = first.run_requests
        assert requested_partitions(burst, ordered_partitions(instance)) == [killed, failed]
        assert REPLACED_TAG not in burst.tags
        assert not first.dynamic_partitions_requests  # both partitions exist already
        # New content under the name whose earlier version was read is a replacement.
        settled(drop(data_dir, TASK, "failed.jsonl", POST + POST), age=30)
        replaced, _ = tick(sensor, instance, cursor)
        assert [(r.partition_key, r.tags.get(REPLACED_TAG)) for r in replaced.run_requests] == [(failed, "true")]


def test_a_burst_over_the_cap_is_split_into_as_few_and_as_even_runs_as_it_allows(data_dir: Path) -> None:
    names = [f"post-{i:02}.jsonl" for i in range(20)]
    for age, name in enumerate(reversed(names)):
        settled(drop(data_dir, TASK, name, POST), age=100 + age)  # post-00 is the oldest
    sensor = sensor_for()  # the task's default cap: 16 partitions per run
    with dg.instance_for_test() as instance:
        result, _ = tick(sensor, instance, None)
        ordered = ordered_partitions(instance)
        ranges = [requested_partitions(request, ordered) for request in result.run_requests]
    # Two runs are the fewest 16 allows; ten files each rather than 16 + 4.
    assert ranges == [names[:10], names[10:]]


def test_drop_files_are_found_by_partition_key(data_dir: Path) -> None:
    for name in ["posts.jsonl", "2026/11/posts.jsonl", "2026__11__posts.jsonl", "données/été.jsonl", "a...b.csv"]:
        drop(data_dir, TASK, name, POST)
    files, _ = list_drop_files(TASK)
    assert len(files) == 5
    for listed in files:
        found = find_drop_file(TASK, listed.partition_key)
        assert found.relative_path == listed.relative_path and found.version == listed.version
        assert found.read_bytes() == POST.encode()
    with pytest.raises(FileNotFoundError, match="removed or renamed"):
        find_drop_file(TASK, "gone.jsonl")


def test_local_writes_are_atomic_and_failures_keep_the_old_file(
    data_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = data_root() / "storage" / TASK / "validated_labels" / "posts.jsonl.parquet"
    write_bytes_atomically(target, b"old")

    def disk_full(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", disk_full)
    with pytest.raises(StorageError, match=r"writing .*posts\.jsonl\.parquet failed: no space left on device in "):
        write_bytes_atomically(target, b"new content")
    assert Path(target.path).read_bytes() == b"old"
    assert os.listdir(Path(target.path).parent) == ["posts.jsonl.parquet"]  # no temporary left behind


def test_credentials_never_appear_in_urls_or_messages(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY")
    with pytest.raises(ValueError) as error:
        storage_path("s3://AKIAEXAMPLE:hunter2hunter2@bucket/prefix")
    assert "hunter2" not in str(error.value) and "AWS_ACCESS_KEY_ID" in str(error.value)
    text = scrub("failed at https://user:pa55word@host/x with wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY")
    assert "pa55word" not in text and "wJalrXUtnFEMI" not in text and "https://***@host/x" in text


def test_partitions_are_grouped_into_ranges_of_adjacent_keys() -> None:
    from batch_assets.lib.run_requests import partition_ranges

    order = ["a", "b", "c", "d", "e", "f", "g"]
    assert partition_ranges(order, ["a", "b", "c", "d", "e"], 2) == [["a", "b"], ["c", "d"], ["e"]]
    # A key not wanted between two wanted ones splits the range: a range covers every key in it.
    assert partition_ranges(order, ["a", "b", "d", "g"], 16) == [["a", "b"], ["d"], ["g"]]
    assert partition_ranges(order, ["g"], 16) == [["g"]]
    assert partition_ranges(order, [], 16) == []
    # Adjacent keys over the cap: as few runs as the cap allows, their sizes at most one apart.
    assert partition_ranges(order, order, 4) == [["a", "b", "c", "d"], ["e", "f", "g"]]
    assert partition_ranges(order, order, 3) == [["a", "b", "c"], ["d", "e"], ["f", "g"]]
    assert partition_ranges(order, ["a", "c", "d", "e", "f", "g"], 3) == [["a"], ["c", "d", "e"], ["f", "g"]]
    keys = [f"k{i:03}" for i in range(100)]
    for count, cap, sizes in [(20, 16, [10, 10]), (16, 16, [16]), (17, 16, [9, 8]), (33, 16, [11, 11, 11])]:
        assert [len(r) for r in partition_ranges(keys, keys[:count], cap)] == sizes
    for count in range(1, 60):
        for cap in (1, 2, 5, 16):
            ranges = partition_ranges(keys, keys[:count], cap)
            assert [key for keys_ in ranges for key in keys_] == keys[:count]
            assert len(ranges) == -(-count // cap) and max(map(len, ranges)) - min(map(len, ranges)) <= 1


@pytest.mark.parametrize("length", [218, 240, 255])
def test_names_up_to_the_file_system_limit_are_written_listed_and_found(data_dir: Path, length: int) -> None:
    name = "n" * (length - len(".jsonl")) + ".jsonl"
    write_bytes_atomically(data_root() / "drops" / TASK / name, POST.encode())
    [listed], skipped = list_drop_files(TASK)
    assert listed.relative_path == name and not skipped
    assert len(listed.partition_key) <= 150
    assert find_drop_file(TASK, listed.partition_key).read_bytes() == POST.encode()
    # A multi-byte name at the limit too: the temporary name is cut by bytes, not characters.
    wide = "é" * 124 + ".jsonl"  # 254 bytes
    write_bytes_atomically(data_root() / "drops" / TASK / wide, POST.encode())
    assert (data_dir / "drops" / TASK / wide).read_bytes() == POST.encode()


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("posts.json", "a .json file is not read: write one JSON object per line and name the file .jsonl"),
        ("posts.json.gz", "a .json file is not read"),
        ("archive.gz", "unsupported compressed file; inputs are .jsonl, .csv, .parquet, .txt, .jsonl.gz"),
        ("notes.md", "unsupported file type; inputs are .jsonl, .csv, .parquet, .txt, .jsonl.gz, .csv.gz, .txt.gz"),
        ("_posts.jsonl", "names starting with '.', '_' or '~' are hidden or temporary files the drop zone skips"),
        (".posts.jsonl", "names starting with '.', '_' or '~'"),
        ("posts.jsonl.part", "names ending in .tmp, .part"),
    ],
)
def test_run_refuses_files_the_drop_zone_would_skip_before_copying_anything(
    data_dir: Path, tmp_path: Path, name: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from batch_assets import cli

    good, bad = tmp_path / "good.jsonl", tmp_path / name
    good.write_text(POST)
    bad.write_text(POST)
    assert cli.main(["run", TASK, str(good), str(bad)]) == 2
    assert capsys.readouterr().out.startswith(f"error: {bad}: not an input file: {message}")
    assert not (data_dir / "drops").exists()  # nothing copied, not even the good file


def test_a_full_disk_is_named_with_its_folder_even_when_the_writer_gives_no_reason(
    data_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = data_root() / "storage" / TASK / "inference_outputs" / "posts.jsonl.parquet"

    def disk_full_without_reason(fd: int) -> None:
        raise OSError(errno.ENOSPC, "")  # what some writers raise: the number, no text

    monkeypatch.setattr(os, "fsync", disk_full_without_reason)
    with pytest.raises(StorageError) as info:
        write_bytes_atomically(target, b"outputs")
    assert str(info.value) == (
        f"writing {target} failed: no space left on device in {target.parent}: free space there "
        "(or make it writable), or point BATCH_ASSETS_DATA at other storage"
    )


def test_storage_errors_without_any_reason_still_say_what_failed() -> None:
    from batch_assets.storage.errors import storage_error

    no_reason = storage_error("writing", "/data/x.parquet", OSError())
    assert str(no_reason) == "writing /data/x.parquet failed: OSError (no reason given)"
    assert str(storage_error("writing", "/data/x.parquet", OSError(errno.EIO, ""))) == (
        "writing /data/x.parquet failed: OSError: [Errno 5] Input/output error"
    )


_TINY_DISK_SCRIPT = """
import os, sys
from batch_assets.storage.locations import storage_path, write_bytes_atomically
target = storage_path(sys.argv[1] + "/storage/sentiment/inference_outputs/posts.jsonl.parquet")
try:
    write_bytes_atomically(target, os.urandom(256 * 1024))
except Exception as exc:
    print(type(exc).__name__, exc)
print("left:", sorted(os.listdir(target.parent.path)))
"""


def test_a_real_full_file_system_is_reported_as_such(tmp_path: Path) -> None:
    """A 64 KiB tmpfs, mounted in a user and mount namespace of its own (no root needed)."""
    result = run_on_a_tiny_file_system(tmp_path, _TINY_DISK_SCRIPT)
    mount_point = tmp_path / "tiny"
    folder = f"{mount_point}/storage/sentiment/inference_outputs"
    assert result.stdout.splitlines() == [
        f"StorageError writing {folder}/posts.jsonl.parquet failed: no space left on device in {folder}: "
        "free space there (or make it writable), or point BATCH_ASSETS_DATA at other storage",
        "left: []",  # no temporary file left behind on the full disk
    ], result.stderr[-2000:]


def test_a_file_over_max_rows_per_partition_becomes_shards_each_its_own_run(
    data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 26.2: one big file fans out over runs; a new version that splits differently retires
    the shards it no longer has (their partitions removed, their outputs deleted)."""
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    bundled = (Path(__file__).parent.parent / "batch_assets" / "tasks" / f"{TASK}.yaml").read_text()
    (tasks / f"{TASK}.yaml").write_text(bundled.replace("input:\n", "input:\n  max_rows_per_partition: 10\n", 1))
    monkeypatch.setenv("BATCH_ASSETS_TASKS_DIR", str(tasks))
    records = "".join(f'{{"text": "post {n}"}}\n' for n in range(25))
    settled(drop(data_dir, TASK, "big.jsonl", records), age=200)
    settled(drop(data_dir, TASK, "a.jsonl", POST), age=100)
    settled(drop(data_dir, TASK, "b.jsonl", POST), age=90)
    task = next(task for task in load_task_specs() if task.name == TASK)
    assert task.input.max_rows_per_partition == 10
    sensor = build_drops_sensor(task, build_definitions().resolve_job_def(pipeline_job_name(TASK)))
    shards = ["big.jsonl~00001", "big.jsonl~00002", "big.jsonl~00003"]
    with dg.instance_for_test() as instance:
        result, cursor = tick(sensor, instance, None)
        assert ordered_partitions(instance) == [*shards, "a.jsonl", "b.jsonl"]
        ordered = ordered_partitions(instance)
        assert [requested_partitions(request, ordered) for request in result.run_requests] == [
            [shards[0]],
            [shards[1]],
            [shards[2]],
            ["a.jsonl", "b.jsonl"],
        ]
        assert [request.tags.get(SOURCE_FILE_TAG) for request in result.run_requests[:3]] == ["big.jsonl"] * 3
        assert len({request.run_key for request in result.run_requests}) == 4

        # Shard 2 alone, as its run does: rows 10-19 of the file, lines 11-20.
        job = build_definitions().resolve_job_def(pipeline_job_name(TASK))
        raw = [dg.AssetKey([TASK, "raw_prompts"])]
        assert job.execute_in_process(instance=instance, partition_key=shards[1], asset_selection=raw).success
        stored = data_dir / "storage" / TASK / "raw_prompts" / f"{shards[1]}.parquet"
        rows = pl.read_parquet(stored)
        assert rows["row_id"].to_list() == list(range(10, 20))
        assert rows["source_line"].to_list() == list(range(11, 21))
        assert rows["text"][0] == "post 10"

        # The file replaced by 12 records: two shards, both re-run as a replacement; the third is retired.
        settled(drop(data_dir, TASK, "big.jsonl", records[: records.index('{"text": "post 12"}')]), age=30)
        replaced, cursor = tick(sensor, instance, cursor)
        assert [request.partition_key for request in replaced.run_requests] == shards[:2]
        assert all(request.tags[REPLACED_TAG] == "true" for request in replaced.run_requests)
        [retire] = [r for r in replaced.dynamic_partitions_requests if isinstance(r, dg.DeleteDynamicPartitionsRequest)]
        assert list(retire.partition_keys) == [shards[2]]

        # Shrunk under the limit: the file is one partition again and every shard is retired.
        settled(drop(data_dir, TASK, "big.jsonl", records[:30]), age=20)
        whole, _ = tick(sensor, instance, cursor)
        assert [request.partition_key for request in whole.run_requests] == ["big.jsonl"]
        [retire] = [r for r in whole.dynamic_partitions_requests if isinstance(r, dg.DeleteDynamicPartitionsRequest)]
        assert sorted(retire.partition_keys) == shards[:2]
        assert not stored.exists()  # outputs of retired shards are deleted with them


# The files of the bulk-read test below, each with what the instance holds of it (BULK_TICK_HISTORY).
BULK_TICK_FILES = [
    "done.jsonl",  # raw_prompts read this version, then validated_labels
    "done-again.jsonl",  # an older version run, then this one
    "changed.jsonl",  # validated from an older version: a replacement
    "raw-only.jsonl",  # read, never validated
    "labels-first.jsonl",  # validated, then read again (not validated since)
    "no-version.jsonl",  # raw_prompts without source_version
    "killed.jsonl",  # registered by `batch-assets run`, never read
    "sharded.jsonl",  # two shards, one validated from this version
    "sharded-done.jsonl",  # two shards, both validated from this version
    "new.jsonl",  # no partition yet
    "seen.jsonl",  # in the cursor
]

# Each partition's materializations in order: (asset, the file version raw_prompts read: this one, an
# older one, or none recorded).
BULK_TICK_HISTORY = {
    "done.jsonl": [("raw_prompts", "now"), ("validated_labels", None)],
    "done-again.jsonl": [
        ("raw_prompts", "old"),
        ("validated_labels", None),
        ("raw_prompts", "now"),
        ("validated_labels", None),
    ],
    "changed.jsonl": [("raw_prompts", "old"), ("validated_labels", None)],
    "raw-only.jsonl": [("raw_prompts", "now")],
    "labels-first.jsonl": [("raw_prompts", "now"), ("validated_labels", None), ("raw_prompts", "now")],
    "no-version.jsonl": [("raw_prompts", None), ("validated_labels", None)],
    "sharded.jsonl~00001": [("raw_prompts", "now"), ("validated_labels", None)],
    "sharded.jsonl~00002": [("raw_prompts", "old"), ("validated_labels", None)],
    "sharded-done.jsonl~00001": [("raw_prompts", "now"), ("validated_labels", None)],
    "sharded-done.jsonl~00002": [("raw_prompts", "now"), ("validated_labels", None)],
}


def record_materialization(
    instance: dg.DagsterInstance, asset: str, key: str, source_version: str | None = None
) -> None:
    metadata = {"source_version": source_version} if source_version else {}
    instance.report_runless_asset_event(
        dg.AssetMaterialization(asset_key=dg.AssetKey([TASK, asset]), partition=key, metadata=metadata)
    )


def test_a_tick_reads_the_instance_in_bulk_and_plans_as_asking_file_by_file_does(
    data_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tick reads the records of every partition it may ask about in a few queries
    (`PartitionRecords`), and plans exactly what asking the instance once per partition
    (`validated_from_version`, `read_version`) plans, on files done, not done and changed."""
    names = BULK_TICK_FILES
    for age, name in enumerate(names):
        settled(drop(data_dir, TASK, name, POST), age=300 - age)
    files, _ = list_drop_files(TASK)
    version = {drop.relative_path: drop.version for drop in files}
    shards = {name: [f"{name}~00001", f"{name}~00002"] for name in ("sharded.jsonl", "sharded-done.jsonl")}

    def keys_of(drop: DropFile) -> list[str]:
        return shards.get(drop.relative_path, [drop.partition_key])

    task = next(task for task in load_task_specs() if task.name == TASK)
    with dg.instance_for_test() as instance:
        registered_keys = [key for name in names[:-2] for key in shards.get(name, [partition_key_for(name)])]
        instance.add_dynamic_partitions(partitions_def_name(TASK), registered_keys)
        for key, events in BULK_TICK_HISTORY.items():
            file_version = version[file_key_of(key)]
            for asset, read in events:
                record_materialization(instance, asset, key, {"now": file_version, "old": "0:1"}.get(read or ""))
        seen = {file_fingerprint(next(drop for drop in files if drop.relative_path == "seen.jsonl"))}
        ordered = ordered_partitions(instance)
        registered = partitions_by_file(ordered)

        queries: list[str] = []
        fetch = instance.fetch_materializations
        monkeypatch.setattr(instance, "fetch_materializations", lambda *a, **k: queries.append("") or fetch(*a, **k))
        bulk = plan_drops_tick(
            dg.build_sensor_context(instance=instance), task, files, seen, ordered, registered, keys_of, None
        )
        bulk_queries = len(queries)
        one_by_one = plan_tick(
            files,
            seen,
            set(ordered),
            max_runs=None,
            already_done=lambda drop: file_validated_from_version(instance, TASK, drop, keys_of(drop)),
            read_version=lambda drop: next(
                (v for k in registered.get(drop.partition_key, []) if (v := read_version(instance, TASK, k))), None
            ),
        )
    assert bulk == one_by_one
    planned = {drop.relative_path: replaced for drop, replaced in bulk.to_run}
    assert planned == {
        "changed.jsonl": True,
        "raw-only.jsonl": False,
        "labels-first.jsonl": False,
        "no-version.jsonl": False,
        "killed.jsonl": False,
        "sharded.jsonl": False,
        "new.jsonl": False,
    }
    assert (bulk.already_done, bulk.known) == (3, 1)  # done, done-again, sharded-done; seen
    assert bulk_queries == 2  # one per asset for all 11 partitions, not one per asset and partition
