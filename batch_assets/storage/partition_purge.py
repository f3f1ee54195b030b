"""Removing what the data folder keeps of one partition: its prompts and its answers.

`batch-assets serve` calls it when a batch's input or output file is deleted (`DELETE /v1/files`,
or the file expired), so deleting a file deletes the copies the pipeline made of it:

- the drop file (`<data>/drops/<task>/<drop name>`);
- every file of the partition in the task's storage folders: the four assets' parquet
  (`<data>/storage/<task>/<asset>/<key>.parquet`), the OpenAI batch output and error files
  (`batch_output/<key>.jsonl`, `batch_errors/<key>.jsonl`), the shards of a split file
  (`<key>~<n>.*`) alike;
- its checkpoints (`_checkpoints/<key>/`, shards' too);
- the result cache's rows of its prompts, found by their request keys, computed from its
  formatted prompts (read before they go) as `run_inference` computes them. A prompt another
  partition also sent loses its cached answer too (it is inferred again when asked): the cache
  cannot tell whose it was. SQLite's deleted pages are overwritten (`secure_delete`) and its
  write-ahead log emptied, so the text does not stay in the file.

What it does not touch: the Dagster instance (runs, their event logs with the materializations'
metadata and previews, the dynamic partition), which `docs/serve.md` says how to purge.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import polars as pl
import sqlalchemy as sa
from upath import UPath

from batch_assets.pipeline.inference_requests import request_keys
from batch_assets.pipeline.inputs.images import DIGEST_COLUMN
from batch_assets.storage.checkpoints import remove_path
from batch_assets.storage.drop_files import SHARD_MARK
from batch_assets.storage.locations import drop_zone, one_name, task_storage_dir
from batch_assets.storage.result_cache import KEYS_PER_QUERY, RESULTS, cache_engine, cache_url, sqlite_file


def purge_partition(task: str, partition_key: str, drop_name: str) -> int:
    """Remove the partition's files and cached results; the number of files and folders removed."""
    folder = task_storage_dir(task)
    keys = _cached_keys(folder, partition_key)
    _forget_cached(folder, keys)
    removed = 0
    for path in [drop_zone(task) / one_name(drop_name), *_partition_paths(folder, partition_key)]:
        if path.exists():
            remove_path(path)
            removed += 1
    return removed


def _partition_paths(folder: UPath, key: str) -> Iterator[UPath]:
    """The partition's files in each folder of the task's storage (assets, OpenAI files, checkpoints)."""
    if not folder.exists():
        return
    for sub in folder.iterdir():
        if sub.is_dir() and sub.name != "_result_cache":
            yield from (path for path in sub.iterdir() if _of_partition(path.name, key))


def _of_partition(name: str, key: str) -> bool:
    """`<key>`, `<key>.<suffix>`, or a shard's `<key>~<n>…` (a key holds no `~` and no other key
    starts with `<key>.`: keys are file names of one drop zone, cut and hashed to be distinct)."""
    return name == key or name.startswith((f"{key}.", f"{key}{SHARD_MARK}"))


def _cached_keys(folder: UPath, key: str) -> list[str]:
    """The request keys the partition's rows may be cached under, as `inference_requests.plan_partition` makes
    them: without the row (identical prompts share a key: `deduplicate`, every OpenAI batch line)
    and with it (a task whose sampling is not deterministic)."""
    keys: list[str] = []
    formatted = folder / "formatted_prompts"
    if not formatted.exists():
        return keys
    for path in formatted.iterdir():
        if not (path.name.endswith(".parquet") and _of_partition(path.name, key)):
            continue
        frame = pl.read_parquet(path.read_bytes()).filter(pl.col("error").is_null() & pl.col("prompt").is_not_null())
        params = frame["request_params"].to_list() if "request_params" in frame.columns else None
        digests = frame[DIGEST_COLUMN].to_list() if DIGEST_COLUMN in frame.columns else None
        prompts, rows = frame["prompt"].to_list(), frame["row_id"].to_list()
        keys += request_keys(prompts, rows, True, params, digests) + request_keys(prompts, rows, False, params, digests)
    return keys


def _forget_cached(folder: UPath, keys: list[str]) -> None:
    if not keys:
        return
    url = cache_url(folder)
    path = sqlite_file(url)
    if path is not None and not path.exists():
        return  # no cache was ever written there: nothing to forget (and none to create)
    engine = cache_engine(url)
    with engine.begin() as connection:
        if path is not None:
            # The deleted rows' bytes are overwritten, not left in free pages of the file.
            connection.exec_driver_sql("PRAGMA secure_delete = ON")
        for start in range(0, len(keys), KEYS_PER_QUERY):
            connection.execute(
                sa.delete(RESULTS).where(RESULTS.c.request_key.in_(keys[start : start + KEYS_PER_QUERY]))
            )
    if path is not None:
        with contextlib.suppress(sa.exc.OperationalError), engine.connect() as connection:
            # The write-ahead log holds copies of the pages as they were: copied back and emptied
            # (busy with a run's reader, it is emptied at that run's next checkpoint).
            connection.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")
