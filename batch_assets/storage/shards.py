"""A drop file's partitions: the file's own, or one per shard when it holds more records than the
task's `input.max_rows_per_partition`.

A run holds its partitions whole in memory, so a file of 50 million records would need a machine
sized for the file and could not be spread over pods. A bigger file is split into shards of at most
that many records (pipeline/inputs/file_shards.py finds them in one streaming pass), each its own
partition `<file key>~00001`, `~00002`, ...: run, retried and backfilled on its own, read by seeking
to its bytes (or row groups) so that memory follows the shard, not the file. Rows keep the whole
file's `row_id` and `source_line`; the file's result is every `<file key>~*.parquet` of an asset.

Each file version's plan is kept at `<storage>/<task>/_shards/<file key>.json`, so the pass runs once
per version (in the sensor's tick for a small file, in a split run for a big one: lib/split_job.py,
or in `batch-assets run`), and the shards of one run read the version
they were planned for: a file replaced while its shards run fails the shards that meet the new
version (locally) and is run again, whole, as a new version. When a new version splits differently,
the partitions it no longer has (the whole-file partition, or shards past its last) are retired:
their partitions removed and their stored outputs deleted, so `<file key>~*` never mixes versions.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterable, Mapping

import polars as pl
import pyarrow.parquet as pq

from batch_assets.pipeline.inputs.file_shards import Shard, ShardPlan, may_need_shards, plan_shards
from batch_assets.pipeline.inputs.read_prompts import (
    DropFileError,
    FilePart,
    ParseOptions,
    input_suffix,
    read_parquet_frame,
    read_prompts,
)
from batch_assets.pipeline.task_formats import raw_file_reader
from batch_assets.storage.checkpoints import clear_checkpoints
from batch_assets.storage.drop_files import (
    DropFile,
    file_key_of,
    partition_key_problem,
    shard_index_of,
    shard_key,
    version_digest,
)
from batch_assets.storage.errors import storage_errors
from batch_assets.storage.locations import (
    checkpoint_dir,
    one_name,
    output_path,
    task_storage_dir,
    write_bytes_atomically,
)

# Run tag: JSON {shard key: digest of the file version it read}, set by raw_prompts (lib/assets.py).
SHARD_VERSIONS_TAG = "batch_assets/shard_versions"
PIPELINE_ASSETS = ("raw_prompts", "formatted_prompts", "inference_outputs", "validated_labels")
# Text compresses about this much: a gzip file's split decompresses and scans that many bytes per stored byte.
GZIP_SPLIT_COST = 8
# Discarded a block at a time while skipping to a shard inside a gzip file.
_SKIP_BLOCK = 8 << 20


def _plan_path(task: str, file_key: str):
    return task_storage_dir(task) / "_shards" / f"{one_name(file_key)}.json"


def kept_shard_plan(task: str, file_key: str) -> ShardPlan | None:
    """The plan the file was last split by (None when it never was, or the plan is unreadable)."""
    path = _plan_path(task, file_key)
    with storage_errors("reading shard plan", path):
        if not path.exists():
            return None
        try:
            return ShardPlan.from_json(json.loads(path.read_bytes()))
        except (ValueError, TypeError, KeyError):
            return None  # an unreadable plan is made again


def shard_plan(task: str, drop: DropFile, max_rows: int | None) -> ShardPlan:
    """The plan of this version of `drop` for shards of `max_rows`: kept from an earlier pass, or
    made by one pass over the file (and kept). A file that cannot hold more than `max_rows` records
    is not read at all, nor is any file of a task whose files are not split (`max_rows` None): its
    plan has no shards (the file is one partition).

    Only registration (`batch-assets run`, the drops sensor) makes a plan; reading a shard uses the
    kept one (`read_partition_rows`). A new plan replacing one of another version (or size) deletes
    the outputs of the old shards after it is kept, so `<file key>~*` never mixes versions: a shard
    of the old version still running notices the new plan once it has written, and removes its own
    output (`outdated_shards`)."""
    if max_rows is None or not _needs_a_pass(drop, max_rows):
        return ShardPlan(drop.version, max_rows or 0, ())
    kept = kept_shard_plan(task, drop.partition_key)
    if _plan_is_current(kept, drop, max_rows):
        assert kept is not None
        return kept
    with drop.open() as stream:
        plan = plan_shards(stream, drop.relative_path, drop.version, max_rows)
    # Another process (a split run, `batch-assets run`) may have split this version during the pass,
    # and its shards may be running already: their outputs are this version's, not the old ones.
    if _plan_is_current(kept_shard_plan(task, drop.partition_key), drop, max_rows):
        return plan
    write_bytes_atomically(_plan_path(task, drop.partition_key), json.dumps(plan.to_json()).encode("utf-8"))
    if kept is not None and len(kept.shards) > 1:
        delete_partition_outputs(task, partition_keys(drop, kept))
    return plan


def retire(task: str, drop: DropFile, current: list[str], retired: list[str], max_rows: int | None) -> None:
    """Delete the outputs of the partitions the file's current version no longer has. When that
    version is one partition but an earlier one was split, a plan saying so is kept first, so that a
    shard of the earlier version still running finds its file replaced and removes its output
    instead of leaving it beside the new whole-file one (only then: a lookup per file would make a
    tick over thousands of files as many requests)."""
    if current == [drop.partition_key] and any(shard_index_of(key) is not None for key in retired):
        plan = ShardPlan(drop.version, max_rows or 0, ())
        write_bytes_atomically(_plan_path(task, drop.partition_key), json.dumps(plan.to_json()).encode("utf-8"))
    delete_partition_outputs(task, retired)


def _needs_a_pass(drop: DropFile, max_rows: int) -> bool:
    return may_need_shards(input_suffix(drop.relative_path) or "", drop.size, max_rows)


def _plan_is_current(plan: ShardPlan | None, drop: DropFile, max_rows: int) -> bool:
    return plan is not None and plan.version == drop.version and plan.max_rows == max_rows


def split_cost(task: str, drop: DropFile, max_rows: int | None) -> int | None:
    """Bytes `shard_plan` would read to find this file version's partitions, a gzip file's stored
    bytes counted `GZIP_SPLIT_COST` times (decompressing and scanning them is that much work): 0 when
    it reads nothing (the plan is kept, or the file cannot need shards), None when the size is unknown."""
    if max_rows is None or not _needs_a_pass(drop, max_rows):
        return 0
    if _plan_is_current(kept_shard_plan(task, drop.partition_key), drop, max_rows):
        return 0
    if drop.size is None:
        return None
    return drop.size * (GZIP_SPLIT_COST if drop.relative_path.lower().endswith(".gz") else 1)


def partition_keys(drop: DropFile, plan: ShardPlan) -> list[str]:
    """The partitions of this file version: its own key, or one per shard."""
    if len(plan.shards) <= 1:
        return [drop.partition_key]
    return [shard_key(drop.partition_key, index) for index in range(len(plan.shards))]


def file_partition_keys(task: str, drop: DropFile, max_rows: int | None) -> list[str]:
    return partition_keys(drop, shard_plan(task, drop, max_rows))


def partitions_by_file(existing: Iterable[str]) -> dict[str, list[str]]:
    """Registered partitions grouped by their file's key, so that finding one file's among tens of
    thousands is a lookup, not a scan per file."""
    grouped: dict[str, list[str]] = {}
    for key in existing:
        grouped.setdefault(file_key_of(key), []).append(key)
    return grouped


def retired_partitions(existing: Iterable[str], file_key: str, current: Iterable[str]) -> list[str]:
    """Partitions of the file `file_key` among `existing` that its current version no longer has
    (a key the package never makes among them too: it is deregistered, nothing of it deleted)."""
    keep = set(current)
    return [key for key in existing if file_key_of(key) == file_key and key not in keep]


def delete_partition_outputs(task: str, keys: Iterable[str]) -> None:
    """Delete what the pipeline stored for these partitions (outputs and checkpoints), so that a
    file's `~*` glob holds only its current version. A key the package never makes (added by hand,
    e.g. `a.jsonl~/../x`) names no output of ours: nothing is deleted for it."""
    for key in keys:
        if partition_key_problem(key):
            continue
        for asset in PIPELINE_ASSETS:
            path = output_path(task, asset, key)
            with storage_errors("deleting retired output", path):
                if path.exists():
                    path.unlink()
        folder = checkpoint_dir(task, key)
        with storage_errors("deleting retired checkpoints", folder):
            clear_checkpoints(folder)


def read_partition_rows(
    task: str, drop: DropFile, partition_key: str, options: ParseOptions, max_rows: int | None
) -> pl.DataFrame:
    """The raw_prompts rows of one partition: the whole file, or one shard of it."""
    index = shard_index_of(partition_key)
    if index is None:
        return raw_file_reader(options.format)(drop.read_bytes(), drop.relative_path, options)
    if max_rows is None:
        raise DropFileError(
            f"{drop.relative_path}: partition {partition_key} is a shard, but this task's files are not split"
        )
    plan = _plan_to_read(task, drop, partition_key, max_rows)
    shard = plan.shards[index]
    try:
        if input_suffix(drop.relative_path) == ".parquet":
            return _read_parquet_shard(drop, shard, options)
        data = _shard_bytes(drop, plan, shard, first=index == 0)
        offset = shard.first_line - 1 - plan.header_lines
        return read_prompts(data, drop.relative_path, options, FilePart(shard.first_row, offset, decompressed=True))
    except DropFileError as error:
        # Only this shard fails; say which records it holds.
        where = "rows" if input_suffix(drop.relative_path) == ".parquet" else "lines"
        following = plan.shards[index + 1].first_line - 1 if index + 1 < len(plan.shards) else None
        span = f"{shard.first_line}-{following}" if following else f"{shard.first_line} to the end"
        raise DropFileError(f"{error} (shard {index + 1} of {len(plan.shards)}: {where} {span})") from None


def _plan_to_read(task: str, drop: DropFile, partition_key: str, max_rows: int) -> ShardPlan:
    """The kept plan that the shard `partition_key` belongs to, when it is the plan of the file as it
    is now; else `DropFileError`. A shard never splits the file again: a file replaced since it was
    split is split (and all its shards run) by whoever registers the new version."""
    plan, index = kept_shard_plan(task, drop.partition_key), shard_index_of(partition_key)
    assert index is not None
    if plan is None or plan.version != drop.version or plan.max_rows != max_rows:
        raise DropFileError(
            f"{drop.relative_path}: replaced (or input.max_rows_per_partition changed) since it was split into "
            f"shards; shard {partition_key} of the earlier split is not run, so that no output mixes versions. "
            "The drops sensor, or `batch-assets run` with the file, splits the new version and runs all its shards"
        )
    if index >= len(plan.shards) or len(plan.shards) == 1:
        raise DropFileError(
            f"{drop.relative_path}: partition {partition_key} is a shard of an earlier version of the file, "
            f"which now splits into {max(len(plan.shards), 1)} partition(s) of up to {max_rows} records "
            "(input.max_rows_per_partition); the current ones are run instead"
        )
    return plan


def outdated_shards(task: str, partition_keys: Iterable[str], run_tags: Mapping[str, str]) -> list[str]:
    """The shards among `partition_keys` whose file is no longer split from the version their run
    read (`SHARD_VERSIONS_TAG` of the run's tags): a new version was registered meanwhile, and their
    outputs must not be stored (see `shard_plan`)."""
    read = json.loads(run_tags.get(SHARD_VERSIONS_TAG, "{}"))
    # One plan read per file, not per shard: a range of a big file's shards shares one plan.
    plans = {file_key: kept_shard_plan(task, file_key) for file_key in {file_key_of(key) for key in read}}
    return [
        key
        for key in partition_keys
        if key in read and ((plan := plans[file_key_of(key)]) is None or version_digest(plan.version) != read[key])
    ]


def outdated_shards_message(task: str, keys: list[str]) -> str:
    return (
        f"{task}: the drop file of shard(s) {', '.join(keys)} was replaced while this run read its earlier "
        "version; their outputs are not stored, so that a file's shards never mix versions. The new version's "
        "shards are run instead (by the drops sensor, or `batch-assets run` with the file)"
    )


def _shard_bytes(drop: DropFile, plan: ShardPlan, shard: Shard, *, first: bool) -> bytes:
    """The shard's records, after the CSV header row when the shard is not the first (the first
    shard is read from the file's start, header included)."""
    start = 0 if first else shard.start
    with drop.open() as raw:
        stream = gzip.GzipFile(fileobj=raw, mode="rb") if drop.relative_path.lower().endswith(".gz") else raw
        try:
            header = b"" if first or not plan.header_end else stream.read(plan.header_end)
            if stream is raw:
                raw.seek(start)
            else:
                _skip(stream, start - len(header))
            return header + stream.read(shard.end - start)
        except (EOFError, gzip.BadGzipFile) as exc:
            raise DropFileError(f"{drop.relative_path}: not a readable gzip file ({exc})") from None


def _skip(stream, count: int) -> None:
    while count > 0:
        block = stream.read(min(count, _SKIP_BLOCK))
        if not block:
            raise EOFError("the file ends before the shard")
        count -= len(block)


def _read_parquet_shard(drop: DropFile, shard: Shard, options: ParseOptions) -> pl.DataFrame:
    """The shard's rows, reading only the row groups they lie in."""
    with drop.open() as stream:
        try:
            parquet = pq.ParquetFile(stream)
            groups, first_row_of_groups, row = [], None, 0
            for index in range(parquet.metadata.num_row_groups):
                rows = parquet.metadata.row_group(index).num_rows
                if row + rows > shard.first_row and row < shard.first_row + shard.rows:
                    groups.append(index)
                    first_row_of_groups = row if first_row_of_groups is None else first_row_of_groups
                row += rows
            table = parquet.read_row_groups(groups)
        except (OSError, ValueError) as exc:  # pyarrow's errors for a corrupt file are one or the other
            raise DropFileError(f"{drop.relative_path}: not a readable parquet file: {exc}") from exc
    offset = shard.first_row - (first_row_of_groups or 0)
    frame = pl.from_arrow(table.slice(offset, shard.rows))
    assert isinstance(frame, pl.DataFrame)
    return read_parquet_frame(frame, drop.relative_path, options, FilePart(first_row=shard.first_row))
