"""Where drops and outputs live: one layout for a local folder and for `s3://bucket/prefix` alike.

    <data>/drops/<task>/<file>                                      input files (one partition each)
    <data>/storage/<task>/<asset>/<partition_key>.parquet           asset outputs
    <data>/storage/<task>/_checkpoints/<partition_key>/<run fingerprint>/   inference checkpoints
    <data>/storage/<task>/_result_cache/<run fingerprint>/          results reused across runs

`<data>` is `BATCH_ASSETS_DATA` (default `data/` under the working directory). Every path is a
`UPath`, so the same code reads and writes a local folder or an S3 prefix (s3fs underneath).

S3 endpoint and credentials come only from the standard AWS variables (`AWS_ENDPOINT_URL`,
`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`, `AWS_PROFILE`,
`AWS_DEFAULT_REGION`), read by botocore itself; retries and timeouts of every request are in
`s3_settings.py`.
"""

from __future__ import annotations

import io
import os
import shutil
import uuid
from typing import IO
from urllib.parse import urlsplit

from upath import UPath

from batch_assets.storage.errors import StorageError, scrub, storage_errors
from batch_assets.storage.s3_settings import s3_storage_options

DATA_ENV = "BATCH_ASSETS_DATA"
DEFAULT_DATA_DIR = "data"


def storage_path(url: str) -> UPath:
    """A `UPath` for a local path or an `s3://` URL, with this project's S3 options."""
    path = UPath(url)
    if is_local(path):
        return UPath(os.path.abspath(os.path.expanduser(url)))
    if urlsplit(url).username is not None or urlsplit(url).password is not None:
        # s3://KEY:SECRET@bucket would put a secret into every path, log line and metadata entry.
        raise ValueError(
            f"{scrub(url)}: credentials do not belong in a storage URL; "
            "set AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) instead"
        )
    if path.protocol in ("s3", "s3a"):
        return UPath(url, **s3_storage_options())
    return path


def data_root() -> UPath:
    return storage_path(os.environ.get(DATA_ENV) or DEFAULT_DATA_DIR)


def drop_zone(task: str) -> UPath:
    return data_root() / "drops" / task


def storage_root() -> UPath:
    return data_root() / "storage"


def output_path(task: str, asset: str, partition_key: str) -> UPath:
    return task_storage_dir(task) / one_name(asset) / f"{one_name(partition_key)}.parquet"


def checkpoint_dir(task: str, partition_key: str) -> UPath:
    return task_storage_dir(task) / "_checkpoints" / one_name(partition_key)


def task_storage_dir(task: str) -> UPath:
    return storage_root() / one_name(task)


def one_name(name: str) -> str:
    """`name` when it is a single name inside a folder, so a path joined from it stays under that
    folder; anything that would leave it (`/`, `..`) raises `ValueError` before a path is made.
    Partition keys come from outside (Dagster accepts nearly any), and paths built from them are
    read, written and deleted."""
    if name in ("", ".", "..") or any(sign in name for sign in ("/", "\\", "\0")):
        raise ValueError(f"{name!r} is not a name inside a folder; refused (nothing read, written or deleted)")
    return name


def is_local(path: UPath) -> bool:
    return path.protocol in ("", "file", "local")


def write_bytes_atomically(path: UPath, data: bytes) -> None:
    """`data` at `path`, as `write_stream_atomically` writes it."""
    write_stream_atomically(path, io.BytesIO(data))


def write_stream_atomically(path: UPath, source: IO[bytes]) -> None:
    """The rest of `source` at `path`, copied in chunks; readers never see a half-written file.

    Locally: write a hidden temporary file in the same folder, then rename over the target (atomic
    on POSIX). On S3 one PUT (or one completed multipart upload) is atomic already: an object is
    visible whole or not at all, and a failed upload leaves the previous object in place.
    Failures raise `StorageError` naming the URL and the cause.
    """
    with storage_errors("writing", path):
        if is_local(path):
            path.parent.mkdir(parents=True, exist_ok=True)
            # Hidden and `.tmp` (drop listings skip it); at most 102 bytes, so a target name of up
            # to the file system's 255 bytes still has a temporary name that fits.
            stem = path.name.encode("utf-8")[:64].decode("utf-8", errors="ignore")
            temporary = path.parent / f".{stem}.{uuid.uuid4().hex}.tmp"
            try:
                with open(temporary.path, "wb") as handle:
                    shutil.copyfileobj(source, handle)
                    handle.flush()
                    os.fsync(handle.fileno())
                os.replace(temporary.path, path.path)
            finally:
                if os.path.exists(temporary.path):
                    os.unlink(temporary.path)
        else:
            with path.open("wb") as handle:
                shutil.copyfileobj(source, handle)


__all__ = [
    "DATA_ENV",
    "StorageError",
    "checkpoint_dir",
    "data_root",
    "drop_zone",
    "is_local",
    "one_name",
    "output_path",
    "storage_path",
    "storage_root",
    "task_storage_dir",
    "write_bytes_atomically",
    "write_stream_atomically",
]
