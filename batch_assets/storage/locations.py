"""Where drops and outputs live: one layout for a local folder and for `s3://bucket/prefix` alike.

    <data>/drops/<task>/<file>                                      input files (one partition each)
    <data>/storage/<task>/<asset>/<partition_key>.parquet           asset outputs
    <data>/storage/<task>/_checkpoints/<partition_key>/<run fingerprint>/   inference checkpoints

`<data>` is `BATCH_ASSETS_DATA` (default `data/` under the working directory). S3 endpoint and
credentials come only from the standard AWS variables, read by s3fs/botocore themselves.
"""

from __future__ import annotations

import os
import uuid

from upath import UPath

DATA_ENV = "BATCH_ASSETS_DATA"
DEFAULT_DATA_DIR = "data"


def data_root() -> UPath:
    raw = os.environ.get(DATA_ENV) or DEFAULT_DATA_DIR
    path = UPath(raw)
    if path.protocol in ("", "file", "local"):
        return UPath(os.path.abspath(os.path.expanduser(raw)))
    return path


def drop_zone(task: str) -> UPath:
    return data_root() / "drops" / task


def storage_root() -> UPath:
    return data_root() / "storage"


def output_path(task: str, asset: str, partition_key: str) -> UPath:
    return storage_root() / task / asset / f"{partition_key}.parquet"


def checkpoint_dir(task: str, partition_key: str) -> UPath:
    return storage_root() / task / "_checkpoints" / partition_key


def is_local(path: UPath) -> bool:
    return path.protocol in ("", "file", "local")


def write_bytes_atomically(path: UPath, data: bytes) -> None:
    """Readers never see a half-written file.

    Locally: write a hidden temporary file in the same folder, then rename over the target (atomic
    on POSIX). On S3 a single PUT is atomic already: an object is visible whole or not at all.
    """
    if is_local(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.parent / f".{path.name}.{uuid.uuid4().hex}.tmp"
        try:
            with open(temporary.path, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temporary.path, path.path)
        finally:
            if os.path.exists(temporary.path):
                os.unlink(temporary.path)
    else:
        path.write_bytes(data)
