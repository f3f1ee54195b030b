"""Parquet IO manager for polars frames, on Dagster's own `UPathIOManager`.

Written here instead of using dagster-polars because dagster-polars 0.27 does not work with
polars 2; UPathIOManager already gives partition-aware paths on any fsspec filesystem, so only the
(de)serialization is ours. Files land at `<storage>/<task>/<asset>/<partition_key>.parquet`, on a
local disk or in S3, written atomically. A storage failure fails the step with a `StorageError`
naming the URL and the cause; the output is then not recorded as materialized.

A run over several partitions (a backfill with `BackfillPolicy.multi_run`) hands over one frame
per partition, as a dict keyed by partition key; each is written to its own file, the same file a
single-partition run writes. Inputs annotated `dict[str, pl.DataFrame]` are loaded the same way
(one file per partition, keyed by partition key, also for a one-partition run); an input annotated
`pl.DataFrame` loads its one partition as before.
"""

import io

import dagster as dg
import polars as pl
from upath import UPath

from batch_assets.storage.checkpoints import remove_path
from batch_assets.storage.drop_files import checked_partition_key, shard_index_of
from batch_assets.storage.errors import storage_errors
from batch_assets.storage.locations import is_local, storage_path, storage_root, write_bytes_atomically
from batch_assets.storage.shards import outdated_shards, outdated_shards_message


def _wants_dict(context: dg.InputContext) -> bool:
    typing_type = context.dagster_type.typing_type
    return typing_type is dict or getattr(typing_type, "__origin__", None) is dict


class PolarsParquetIOManager(dg.UPathIOManager):
    extension = ".parquet"

    def _asset_url(self, context: dg.OutputContext | dg.InputContext) -> UPath:
        key = context.asset_key.path if context.has_asset_key else [context.name]
        return self._base_path.joinpath(*key)

    def make_directory(self, path: UPath) -> None:
        # Object stores have no folders; s3fs's mkdir would even create a missing bucket.
        if is_local(path):
            path.mkdir(parents=True, exist_ok=True)

    def handle_output(self, context: dg.OutputContext, obj: pl.DataFrame | dict[str, pl.DataFrame]) -> None:
        with storage_errors("writing", self._asset_url(context)):
            if not isinstance(obj, dict):
                super().handle_output(context, obj)
                return
            paths = self._get_paths_for_partitions(context)
            if set(obj) != set(paths):
                raise ValueError(
                    f"{context.asset_key.to_user_string()}: the asset returned frames for partitions {sorted(obj)}, "
                    f"but the run materializes {sorted(paths)}"
                )
            for partition_key, path in paths.items():
                self.make_directory(path.parent)
                self.dump_to_path(context=context, obj=obj[partition_key], path=path)
            _remove_outdated_shard_outputs(context, paths)

    def _get_paths_for_partitions(self, context: dg.InputContext | dg.OutputContext) -> dict[str, UPath]:
        # Every path below is built from a partition key, which Dagster takes from outside nearly unchecked.
        for key in context.asset_partition_keys if context.has_asset_partitions else ():
            checked_partition_key(key)
        return super()._get_paths_for_partitions(context)

    def load_input(self, context: dg.InputContext) -> pl.DataFrame | dict[str, pl.DataFrame]:
        with storage_errors("reading", self._asset_url(context)):
            if context.has_asset_partitions and _wants_dict(context):
                paths = self._get_paths_for_partitions(context)
                return {key: self.load_from_path(context, paths[key]) for key in context.asset_partition_keys}
            return super().load_input(context)

    def dump_to_path(self, context: dg.OutputContext, obj: pl.DataFrame, path: UPath) -> None:
        buffer = io.BytesIO()
        obj.write_parquet(buffer, compression="zstd", statistics=True)
        write_bytes_atomically(path, buffer.getvalue())

    def load_from_path(self, context: dg.InputContext, path: UPath) -> pl.DataFrame:
        with storage_errors("reading", path):
            data = path.read_bytes()
        return pl.read_parquet(io.BytesIO(data))


def _remove_outdated_shard_outputs(context: dg.OutputContext, paths: dict[str, UPath]) -> None:
    """Checked after writing: a shard whose file got a new version while this run read the earlier one
    removes what it just wrote (the new version's registration deletes the outputs it finds first, so
    whichever comes second removes the old shard's output) and fails without a retry."""
    shards = [key for key in paths if shard_index_of(key) is not None]
    if not shards:
        return
    task = context.asset_key.path[0]
    run = context.step_context.instance.get_run_by_id(context.run_id)
    outdated = outdated_shards(task, shards, run.tags if run else {})
    for key in outdated:
        remove_path(paths[key])
    if outdated:
        raise dg.Failure(description=outdated_shards_message(task, outdated), allow_retries=False)


class ParquetStorage(dg.ConfigurableIOManagerFactory):
    """Stores every asset as parquet under `<BATCH_ASSETS_DATA>/storage` (local folder or S3)."""

    base_path: str | None = None

    def create_io_manager(self, context: dg.InitResourceContext) -> PolarsParquetIOManager:
        return PolarsParquetIOManager(base_path=storage_path(self.base_path) if self.base_path else storage_root())
