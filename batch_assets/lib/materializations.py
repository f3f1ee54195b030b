"""What the instance recorded for one partition of an asset: the sensors, checks, automation and the
command line all ask for a partition's latest materialization, and ask it here; a sensor tick over
thousands of files asks it of all their partitions at once (`latest_materializations`)."""

from __future__ import annotations

from collections.abc import Iterable

import dagster as dg

# Partitions per query: well under SQLite's bound-parameter limit (32,766), and few round trips to
# Postgres for a drop zone of tens of thousands of files; records per page read back.
PARTITIONS_PER_QUERY = 2_000
RECORDS_PER_PAGE = 5_000


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
    """`latest_materialization` of many partitions (those never materialized left out), read
    `PARTITIONS_PER_QUERY` partitions a query instead of one: their materializations newest first,
    each partition's first one kept, until every partition has one or none are left (a partition
    materialized once costs one record)."""
    keys = sorted(set(partition_keys))
    latest: dict[str, dg.EventLogRecord] = {}
    for start in range(0, len(keys), PARTITIONS_PER_QUERY):
        chunk = keys[start : start + PARTITIONS_PER_QUERY]
        records_filter = dg.AssetRecordsFilter(asset_key=asset_key, asset_partitions=chunk)
        found, cursor = 0, None
        while found < len(chunk):
            page = instance.fetch_materializations(records_filter, limit=RECORDS_PER_PAGE, cursor=cursor)
            for record in page.records:
                if record.partition_key is not None and record.partition_key not in latest:
                    latest[record.partition_key] = record
                    found += 1
            if not page.has_more:
                break
            cursor = page.cursor
    return latest
