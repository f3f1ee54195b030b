"""Issue 36 item 2: a drops-sensor tick does bounded work whatever the size of a new file; a file
too big to split in the tick is split by a run, and the tick after it requests its shards."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import dagster as dg
import pytest
from upath import UPath

from batch_assets.lib import drops_sensor
from batch_assets.lib.drops_sensor import build_drops_sensor, plan_tick
from batch_assets.lib.run_requests import SOURCE_FILE_TAG
from batch_assets.lib.split_job import RUN_KEY_TAG, failed_split_runs, split_job_name
from batch_assets.lib.task_definitions import build_definitions, pipeline_job_name
from batch_assets.pipeline.task_spec import load_task_specs
from batch_assets.storage.drop_files import DropFile, partitions_def_name
from batch_assets_tests.support import drop
from batch_assets_tests.support.drops import settled, tick

TASK = "sentiment"
ROWS = 3_000_000  # three shards at the default input.max_rows_per_partition (1,000,000)
SHARDS = [f"big.jsonl~{index:05d}" for index in (1, 2, 3)]


@pytest.fixture
def bytes_read(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every byte read from drop files, through `DropFile.open` or `DropFile.read_bytes`."""
    read = [0]
    opener, reader = DropFile.open, DropFile.read_bytes

    class Counted:
        def __init__(self, stream) -> None:
            self.stream = stream

        def read(self, size: int = -1) -> bytes:
            data = self.stream.read(size)
            read[0] += len(data)
            return data

        def __iter__(self) -> Iterator[bytes]:
            for line in self.stream:
                read[0] += len(line)
                yield line

        def __getattr__(self, name: str):
            return getattr(self.stream, name)

    @contextmanager
    def counted_open(drop_file: DropFile):
        with opener(drop_file) as stream:
            yield Counted(stream)

    def counted_read_bytes(drop_file: DropFile) -> bytes:
        data = reader(drop_file)
        read[0] += len(data)
        return data

    monkeypatch.setattr(DropFile, "open", counted_open)
    monkeypatch.setattr(DropFile, "read_bytes", counted_read_bytes)
    return read


def pipeline_partitions(requests: list[dg.RunRequest]) -> list[str]:
    return [r.partition_key for r in requests if r.job_name == pipeline_job_name(TASK) and r.partition_key]


def test_a_tick_reads_no_big_file_and_its_shards_are_requested_once_after_its_split_run(
    data_dir: Path, bytes_read: list[int]
) -> None:
    big = settled(drop(data_dir, TASK, "big.jsonl", b'{"text": "p"}\n' * ROWS), age=200)
    # Over max_rows_per_partition bytes, so the tick must read it to know it is one partition.
    middle = settled(drop(data_dir, TASK, "middle.jsonl", b'{"text": "a longer post"}\n' * 50_000), age=100)
    assert big.stat().st_size > drops_sensor.TICK_SPLIT_BYTES > middle.stat().st_size > 1_000_000
    task = next(task for task in load_task_specs() if task.name == TASK)
    defs = build_definitions()
    sensor = build_drops_sensor(task, defs.resolve_job_def(pipeline_job_name(TASK)))
    requested: list[str] = []
    with dg.instance_for_test() as instance:
        first, cursor = tick(sensor, instance, None)
        # The tick read the middle file only; the big one is left to a split run, out of the cursor.
        assert bytes_read[0] == middle.stat().st_size
        [split] = [request for request in first.run_requests if request.job_name == split_job_name(TASK)]
        assert split.tags[SOURCE_FILE_TAG] == "big.jsonl" and split.run_key.startswith("split:big.jsonl@")
        assert pipeline_partitions(first.run_requests) == ["middle.jsonl"]
        assert list(instance.get_dynamic_partitions(partitions_def_name(TASK))) == ["middle.jsonl"]
        requested += pipeline_partitions(first.run_requests)

        # Until the split run is done, every tick asks for the same run key (Dagster launches it once).
        bytes_read[0] = 0
        waiting, cursor = tick(sensor, instance, cursor)
        assert [request.run_key for request in waiting.run_requests] == [split.run_key] and bytes_read[0] == 0

        split_job = defs.resolve_job_def(split_job_name(TASK))
        assert split_job.execute_in_process(run_config=split.run_config, instance=instance, tags=split.tags).success
        assert bytes_read[0] == big.stat().st_size  # the run made the one pass over the file

        bytes_read[0] = 0
        shards, cursor = tick(sensor, instance, cursor)
        assert bytes_read[0] == 0  # the kept plan, not the file
        assert pipeline_partitions(shards.run_requests) == SHARDS
        assert all(request.job_name == pipeline_job_name(TASK) for request in shards.run_requests)
        assert list(instance.get_dynamic_partitions(partitions_def_name(TASK))) == ["middle.jsonl", *SHARDS]
        requested += pipeline_partitions(shards.run_requests)

        quiet, cursor = tick(sensor, instance, cursor)
        assert not quiet.run_requests and bytes_read[0] == 0
    assert requested == ["middle.jsonl", *SHARDS]  # every partition once


def test_a_failed_split_run_is_named_and_a_new_version_is_split_anew(
    data_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(drops_sensor, "TICK_SPLIT_BYTES", 1000)
    settled(drop(data_dir, TASK, "broken.jsonl.gz", b"not gzip" * 200), age=100)
    task = next(task for task in load_task_specs() if task.name == TASK)
    defs = build_definitions()
    sensor = build_drops_sensor(task, defs.resolve_job_def(pipeline_job_name(TASK)))
    with dg.instance_for_test() as instance:
        first, cursor = tick(sensor, instance, None)
        [split] = first.run_requests
        tags = {**split.tags, RUN_KEY_TAG: split.run_key}  # as the daemon tags the run it launches
        result = defs.resolve_job_def(split_job_name(TASK)).execute_in_process(
            run_config=split.run_config, instance=instance, tags=tags, raise_on_error=False
        )
        assert not result.success
        assert failed_split_runs(instance, TASK, [split.run_key]) == {split.run_key: result.run_id}
        assert not list(instance.get_dynamic_partitions(partitions_def_name(TASK)))

        settled(drop(data_dir, TASK, "broken.jsonl.gz", b"still not gzip" * 200), age=50)
        again, _ = tick(sensor, instance, cursor)
        [new_split] = again.run_requests
        assert new_split.run_key != split.run_key
        assert failed_split_runs(instance, TASK, [new_split.run_key]) == {}


def test_a_tick_splits_files_within_its_budget_and_leaves_the_rest() -> None:
    files = [DropFile(name, UPath("/drops"), "v1", modified=index) for index, name in enumerate("abcde")]
    costs = {"a": 0, "b": 6, "c": 6, "d": 20, "e": None}
    plan = plan_tick(files, set(), set(), max_runs=None, split_cost=lambda f: costs[f.relative_path], split_budget=10)
    assert [f.relative_path for f, _ in plan.to_run] == ["a", "b"]
    assert plan.waiting == 1  # c: 6 more bytes than the tick has left; the next tick splits it
    assert [f.relative_path for f in plan.to_split] == ["d", "e"]  # over any tick's budget, or of unknown size
    assert len(plan.seen) == 2  # only the files requested are in the cursor
