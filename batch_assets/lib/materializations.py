"""What the instance recorded for one partition of an asset: the sensors, checks, automation and the
command line all ask for a partition's latest materialization, and ask it here; a sensor tick over
thousands of files asks it of all their partitions at once (`latest_materializations`)."""

from __future__ import annotations

from collections.abc import Iterable

import dagster as dg

# Partitions per query: well under SQLite's bound-parameter limit (32,766), and few round trips to
# Postgres for a drop zone of tens of thousands of files.
PARTITIONS_PER_QUERY = 2_000


def latest_materialization(
    instance: dg.DagsterInstance, asset_key: dg.AssetKey, partition_key: str
) -> dg.EventLogRecord | None:
    """The newest materialization event record of one partition of an asset, or None."""
    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=asset_key, asset_partitions=[partition_key]), limit=1
    ).records
    return records[0] if records else None


def latest_materializations(
    instance: dg.DagsterInstance, asset_key: dg.AssetKey, partition_keys: Iterable[str]
) -> dict[str, dg.EventLogRecord]:
    """`latest_materialization` of many partitions (those never materialized left out), in two
    queries per `PARTITIONS_PER_QUERY` partitions instead of one per partition: the latest storage
    id of each partition, then those records by id."""
    keys = sorted(set(partition_keys))
    latest: dict[str, dg.EventLogRecord] = {}
    for start in range(0, len(keys), PARTITIONS_PER_QUERY):
        # Never an empty set: Dagster reads an empty `partitions` as every partition.
        chunk = set(keys[start : start + PARTITIONS_PER_QUERY])
        ids = instance.get_latest_storage_id_by_partition(asset_key, dg.DagsterEventType.ASSET_MATERIALIZATION, chunk)
        if not ids:
            continue
        records = instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=asset_key, storage_ids=list(ids.values())), limit=len(ids)
        ).records
        by_id = {record.storage_id: record for record in records}
        latest.update({key: by_id[storage_id] for key, storage_id in ids.items() if storage_id in by_id})
    return latest
