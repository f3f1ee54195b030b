"""What the instance recorded for one partition of an asset: the sensors, checks, automation and the
command line all ask for a partition's latest materialization, and ask it here."""

from __future__ import annotations

import dagster as dg


def latest_materialization(
    instance: dg.DagsterInstance, asset_key: dg.AssetKey, partition_key: str
) -> dg.EventLogRecord | None:
    """The newest materialization event record of one partition of an asset, or None."""
    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=asset_key, asset_partitions=[partition_key]), limit=1
    ).records
    return records[0] if records else None
