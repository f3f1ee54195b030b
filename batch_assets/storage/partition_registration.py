"""A drop file's partitions in the Dagster instance, registered by `batch-assets run`.

The sensor asks Dagster to add and delete partitions in its tick's result; a command that runs files
itself registers them directly, and may meet a sensor or another command adding the same key at the
same moment. A file with more records than `input.max_rows_per_partition` is several shard
partitions, and a new version that splits differently retires the partitions it no longer has,
outputs and all (storage/shards.py).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from sqlalchemy.exc import IntegrityError

from batch_assets.pipeline.inputs.read_prompts import DropFileError
from batch_assets.storage.drop_files import DropFile, partitions_def_name
from batch_assets.storage.shards import file_partition_keys, retire, retired_partitions

if TYPE_CHECKING:
    import dagster as dg

    from batch_assets.pipeline.task_spec import TaskSpec


def add_partitions(instance: dg.DagsterInstance, partitions_name: str, keys: list[str]) -> None:
    """Register the partitions; one that another process (CLI, sensor) added meanwhile is fine too."""
    missing = _unregistered(instance, partitions_name, keys)
    if not missing:
        return
    try:
        instance.add_dynamic_partitions(partitions_name, missing)
    except (IntegrityError, sqlite3.IntegrityError):
        # Dagster's check-then-insert races with a concurrent add of the same key; one insert wins.
        still = _unregistered(instance, partitions_name, missing)
        if still:
            instance.add_dynamic_partitions(partitions_name, still)


def _unregistered(instance: dg.DagsterInstance, partitions_name: str, keys: list[str]) -> list[str]:
    # One query for the whole list: a drop zone of thousands of files is not thousands of lookups.
    registered = set(instance.get_dynamic_partitions(partitions_name))
    return [key for key in dict.fromkeys(keys) if key not in registered]


def file_partitions(
    instance: dg.DagsterInstance,
    task: TaskSpec,
    drop: DropFile,
    registered: Sequence[str],
    *,
    say: Callable[[str], None],
) -> list[str]:
    """The file's partitions (its own, or its shards); partitions of the file that its new version
    no longer has (split differently) are retired, outputs and all. `registered`: the file's
    partitions in the instance (`partitions_by_file`)."""
    try:
        keys = file_partition_keys(task.name, drop, task.input.shard_rows)
    except DropFileError:
        return [drop.partition_key]  # its run fails with this error, naming the file
    if len(keys) > 2 and drop.relative_path.lower().endswith(".gz"):
        say(
            f"{drop.relative_path}: {len(keys)} shards of a gzip file; each decompresses the file from its start "
            "(shard N reads N shards' worth), so a big file is better dropped uncompressed or as parquet"
        )
    partitions_name = partitions_def_name(task.name)
    retired = retired_partitions(registered, drop.partition_key, keys)
    if retired:
        say(f"{drop.relative_path}: split differently than before; retiring partitions {', '.join(retired)}")
        retire(task.name, drop, keys, retired, task.input.shard_rows)
        for key in retired:
            instance.delete_dynamic_partition(partitions_name, key)
    return keys
