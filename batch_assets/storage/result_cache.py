"""Result cache: outputs of deterministic decoding, reused across partitions and re-runs.

    <data>/storage/<task>/_result_cache/<fingerprint>/part-<time>-<uuid>.parquet

A cached result is keyed by `request_key` (the hash of the full prompt text the model sees) under
the same fingerprint as the checkpoints (model and its weights, dtype, engine seed, context length,
sampling params, output constraint), so it is only reused where the engine would give the same
answer. Only deterministic decoding (temperature 0, or a fixed seed) is cached, and only results
that finished without an error.

Safe under concurrent runs without locks (local disk and S3 alike): files are only ever added,
each written atomically under a unique name, and a reader takes the union of what it lists.
Compaction merges many small files into one: it writes the merged file first and only then deletes
what it merged, so a reader at any moment sees every result at least once (a reader that lists
just before the deletes retries its listing). Two runs compacting at once only write a duplicate
merged file, which the next compaction folds in.

The cache is part of the task's storage: delete `_result_cache/` (or one fingerprint folder) to
drop it, or materialize `inference_outputs` with `use_result_cache: false` to bypass it once.
"""

from __future__ import annotations

import contextlib
import io
import time
import uuid

import polars as pl
from upath import UPath

from batch_assets.storage.checkpoints import CHECKPOINT_SCHEMA, conform_results, remove_path
from batch_assets.storage.locations import write_bytes_atomically

# Files a fingerprint folder may hold before a writer merges them into one.
COMPACT_AFTER_FILES = 32
_LIST_ATTEMPTS = 3


class ResultCache:
    """The cached results of one task under one fingerprint."""

    def __init__(self, task_dir: UPath, fingerprint: str) -> None:
        self.fingerprint = fingerprint
        self.folder = task_dir / "_result_cache" / fingerprint

    def _files(self) -> list[UPath]:
        if not self.folder.exists():
            return []
        return sorted(
            (p for p in self.folder.iterdir() if p.name.startswith("part-") and p.name.endswith(".parquet")),
            key=lambda p: p.name,
        )

    def _read(self, files: list[UPath], keys: pl.Series | None) -> pl.DataFrame:
        frames = []
        for path in files:
            with path.open("rb") as handle:
                frame = conform_results(pl.read_parquet(handle))
            if keys is not None:
                frame = frame.filter(pl.col("request_key").is_in(keys.implode()))
            frames.append(frame)
        if not frames:
            return pl.DataFrame(schema=CHECKPOINT_SCHEMA)
        return pl.concat(frames).unique("request_key", keep="first", maintain_order=True)

    def lookup(self, keys: pl.Series | None = None) -> pl.DataFrame:
        """Cached results for `keys` (all cached results when None), each key once."""
        for attempt in range(_LIST_ATTEMPTS):
            try:
                return self._read(self._files(), keys)
            except FileNotFoundError:
                # A compaction deleted a file between our listing and our read; its rows are in
                # the merged file, which a new listing sees.
                if attempt == _LIST_ATTEMPTS - 1:
                    raise
        raise AssertionError("unreachable")

    def add(self, results: pl.DataFrame) -> int:
        """Store finished results (rows with an error are not cached). Returns rows stored."""
        finished = conform_results(results.filter(pl.col("error").is_null()))
        if finished.height == 0:
            return 0
        self._write(finished)
        if len(self._files()) > COMPACT_AFTER_FILES:
            self.compact()
        return finished.height

    def compact(self) -> None:
        """Merge every file into one; see the module docstring for why this is safe concurrently."""
        files = self._files()
        if len(files) < 2:
            return
        try:
            merged = self._read(files, None)
        except FileNotFoundError:
            return  # another writer is compacting the same files
        self._write(merged)
        for path in files:
            with contextlib.suppress(FileNotFoundError):
                remove_path(path)

    def _write(self, frame: pl.DataFrame) -> None:
        buffer = io.BytesIO()
        frame.write_parquet(buffer, compression="zstd")
        name = f"part-{time.time_ns():020d}-{uuid.uuid4().hex[:8]}.parquet"
        write_bytes_atomically(self.folder / name, buffer.getvalue())
