"""Which file version a partition's latest materializations came from: the version its raw_prompts
read, and whether its validated_labels were made from exactly that version (the drops sensor's
once-per-version rule, and `batch-assets run`'s files already done)."""

from collections.abc import Iterable, Mapping, Sequence

import dagster as dg

from batch_assets.lib.materializations import latest_materialization, latest_materializations
from batch_assets.storage.drop_files import (
    DropFile,
)


def _latest_record(instance: dg.DagsterInstance, task: str, asset: str, partition_key: str):
    return latest_materialization(instance, dg.AssetKey([task, asset]), partition_key)


def read_version(instance: dg.DagsterInstance, task: str, partition_key: str) -> str | None:
    """The file version the partition's latest raw_prompts read (None: never read)."""
    return _version_read(_latest_record(instance, task, "raw_prompts", partition_key))


def validated_from_version(instance: dg.DagsterInstance, task: str, partition_key: str, version: str) -> bool:
    """The partition's latest validated_labels came from exactly this file version: made after the
    latest raw_prompts, which read this version (in a run of its own or of a range)."""
    labels = _latest_record(instance, task, "validated_labels", partition_key)
    raw = _latest_record(instance, task, "raw_prompts", partition_key)
    return _validated_from(labels, raw, version)


def _version_read(raw: dg.EventLogRecord | None) -> str | None:
    version = raw.asset_materialization.metadata.get("source_version") if raw and raw.asset_materialization else None
    return str(version.value) if version is not None else None


def _validated_from(labels: dg.EventLogRecord | None, raw: dg.EventLogRecord | None, version: str) -> bool:
    if labels is None or raw is None or raw.storage_id > labels.storage_id or raw.asset_materialization is None:
        return False
    read = raw.asset_materialization.metadata.get("source_version")
    return read is not None and read.value == version


class PartitionRecords:
    """The latest raw_prompts and validated_labels of many partitions, read from the instance in a
    few queries and kept for one tick: the same answers as `validated_from_version` and
    `read_version`, which ask once per partition (two queries per file: minutes on a first tick over
    thousands of files already run, where Dagster gives a sensor evaluation 60 s)."""

    def __init__(self, instance: dg.DagsterInstance, task: str) -> None:
        self._instance, self._task = instance, task
        self._loaded: set[str] = set()
        self._raw: dict[str, dg.EventLogRecord] = {}
        self._labels: dict[str, dg.EventLogRecord] = {}

    def load(self, partition_keys: Iterable[str]) -> None:
        """Read the records of the partitions not read yet, all in one go."""
        missing = set(partition_keys) - self._loaded
        if not missing:
            return
        self._raw.update(latest_materializations(self._instance, dg.AssetKey([self._task, "raw_prompts"]), missing))
        labels_key = dg.AssetKey([self._task, "validated_labels"])
        self._labels.update(latest_materializations(self._instance, labels_key, missing))
        self._loaded |= missing

    def file_done(self, drop: DropFile, partition_keys: Sequence[str]) -> bool:
        """`file_validated_from_version`, from the records read."""
        self.load(partition_keys)
        return all(_validated_from(self._labels.get(k), self._raw.get(k), drop.version) for k in partition_keys)

    def file_read_version(self, registered: Mapping[str, list[str]], drop: DropFile) -> str | None:
        """The version the file's partitions (its own or its shards) last read, None when never read."""
        keys = registered.get(drop.partition_key, [])
        self.load(keys)
        return next((v for k in keys if (v := _version_read(self._raw.get(k))) is not None), None)


def file_validated_from_version(
    instance: dg.DagsterInstance, task: str, drop: DropFile, partition_keys: Sequence[str]
) -> bool:
    """Every partition of the file (its own, or each shard) has validated_labels from this version."""
    return all(validated_from_version(instance, task, key, drop.version) for key in partition_keys)
