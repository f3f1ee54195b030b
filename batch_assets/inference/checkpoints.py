"""Inference checkpoints: results persisted chunk by chunk while a partition is being inferred.

A chunk is a parquet file of finished requests keyed by `request_key` (a hash of the prompt, plus
the row for non-deterministic decoding). Chunks live under a fingerprint of everything that decides
the output (model, sampling params, output constraint), so a checkpoint made with other settings is
never reused. Each chunk is written atomically; a crash loses at most the chunk in flight.
"""

from __future__ import annotations

import hashlib
import io
import json
import uuid

import polars as pl
from upath import UPath

from batch_assets.storage.locations import write_bytes_atomically

CHECKPOINT_SCHEMA = {
    "request_key": pl.String,
    "generated_text": pl.String,
    "finish_reason": pl.String,
    "num_prompt_tokens": pl.Int64,
    "num_generated_tokens": pl.Int64,
    "error": pl.String,
}


def run_fingerprint(parts: dict) -> str:
    """Stable hash of the settings that decide an output."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode("utf-8")).hexdigest()[:16]


class CheckpointStore:
    def __init__(self, partition_dir: UPath, fingerprint: str) -> None:
        self.partition_dir = partition_dir
        self.folder = partition_dir / fingerprint

    def load(self) -> pl.DataFrame:
        if not self.folder.exists():
            return pl.DataFrame(schema=CHECKPOINT_SCHEMA)
        frames = []
        for chunk in sorted(self.folder.iterdir(), key=lambda p: p.name):
            if chunk.name.endswith(".parquet") and not chunk.name.startswith("."):
                with chunk.open("rb") as handle:
                    frames.append(pl.read_parquet(handle).select(list(CHECKPOINT_SCHEMA)).cast(CHECKPOINT_SCHEMA))
        if not frames:
            return pl.DataFrame(schema=CHECKPOINT_SCHEMA)
        return pl.concat(frames).unique("request_key", keep="first", maintain_order=True)

    def save(self, chunk: pl.DataFrame) -> None:
        buffer = io.BytesIO()
        chunk.select(list(CHECKPOINT_SCHEMA)).cast(CHECKPOINT_SCHEMA).write_parquet(buffer)
        write_bytes_atomically(self.folder / f"chunk-{uuid.uuid4().hex}.parquet", buffer.getvalue())

    def clear(self) -> None:
        """Remove every checkpoint of the partition (all fingerprints): the output is final now."""
        if self.partition_dir.exists():
            self.partition_dir.fs.rm(self.partition_dir.path, recursive=True)
