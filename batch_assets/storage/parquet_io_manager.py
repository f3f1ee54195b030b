"""Parquet IO manager for polars frames, on Dagster's own `UPathIOManager`.

Written here instead of using dagster-polars because dagster-polars 0.27 does not work with
polars 2; UPathIOManager already gives partition-aware paths on any fsspec filesystem, so only the
(de)serialization is ours. Files land at `<storage>/<task>/<asset>/<partition_key>.parquet`.
"""


import io

import dagster as dg
import polars as pl
from upath import UPath

from batch_assets.storage.locations import storage_root, write_bytes_atomically


class PolarsParquetIOManager(dg.UPathIOManager):
    extension = ".parquet"

    def dump_to_path(self, context: dg.OutputContext, obj: pl.DataFrame, path: UPath) -> None:
        buffer = io.BytesIO()
        obj.write_parquet(buffer, compression="zstd", statistics=True)
        write_bytes_atomically(path, buffer.getvalue())

    def load_from_path(self, context: dg.InputContext, path: UPath) -> pl.DataFrame:
        with path.open("rb") as handle:
            return pl.read_parquet(handle)


class ParquetStorage(dg.ConfigurableIOManagerFactory):
    """Stores every asset as parquet under `<BATCH_ASSETS_DATA>/storage` (local folder or S3)."""

    base_path: str | None = None

    def create_io_manager(self, context: dg.InitResourceContext) -> PolarsParquetIOManager:
        return PolarsParquetIOManager(base_path=UPath(self.base_path) if self.base_path else storage_root())
