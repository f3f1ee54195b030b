"""Inference checkpoints: results persisted chunk by chunk while a partition is being inferred.

    <data>/storage/<task>/_checkpoints/<partition_key>/<fingerprint>/chunk-<time>-<uuid>.parquet

A chunk is a parquet file of finished requests keyed by `request_key` (a hash of the full prompt
text, plus the row for non-deterministic decoding, see `run_inference.request_keys`). Chunks live
under a fingerprint of everything else that decides an output (model and its weights, dtype,
engine seed, context length, sampling params, output constraint), so a checkpoint made with other
settings is never reused, and a changed prompt has other keys. Each chunk is written atomically
(rename locally, one PUT on S3): a crash loses at most the chunk in flight, never a finished one.

Life cycle: `inference_outputs` loads the chunks of its fingerprint, infers only what is missing,
and saves a chunk per engine batch; a partition's checkpoints are removed once its
`inference_outputs` is stored (by `validated_labels`), and checkpoints of other fingerprints are
removed when a run with new settings starts.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import time
import uuid
from pathlib import Path

import polars as pl
from upath import UPath

from batch_assets.pipeline.result_stores import RESULT_SCHEMA
from batch_assets.storage.locations import write_bytes_atomically

# Columns added after results were first stored: files written before lack them and read as null.
_LATER_COLUMNS = ("cumulative_logprob", "token_logprobs")
# Files whose change means "other weights" in a local model folder.
_MODEL_FILE_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".json", ".model", ".jinja")


def conform_results(frame: pl.DataFrame) -> pl.DataFrame:
    """A stored or new results frame in `RESULT_SCHEMA`: its columns, in order, with their types.

    Checkpoints and cached results outlive upgrades, so a file without a later column is still
    used (the column is null: e.g. no confidence for results cached before it was measured).
    """
    missing = [pl.lit(None).alias(name) for name in _LATER_COLUMNS if name not in frame.columns]
    if missing:
        frame = frame.with_columns(missing)
    return frame.select(list(RESULT_SCHEMA)).cast(RESULT_SCHEMA)  # type: ignore[arg-type]  # see RESULT_SCHEMA


def run_fingerprint(parts: dict) -> str:
    """Stable hash of the settings that decide an output."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode("utf-8")).hexdigest()[:16]


def model_identity(model: str) -> list | str:
    """What identifies a model's weights: for a local folder its files' names, sizes and times
    (weights replaced in place count as another model); for a hub id, the id."""
    folder = Path(model)
    if not folder.is_dir():
        return model
    files = [path for path in folder.iterdir() if path.suffix in _MODEL_FILE_SUFFIXES]
    return sorted([path.name, path.stat().st_size, path.stat().st_mtime_ns] for path in files)


class CheckpointStore:
    """The checkpoint chunks of one partition and one fingerprint."""

    def __init__(self, partition_dir: UPath, fingerprint: str) -> None:
        self.partition_dir = partition_dir
        self.fingerprint = fingerprint
        self.folder = partition_dir / fingerprint
        self.chunks_saved = 0

    def chunk_paths(self) -> list[UPath]:
        if not self.folder.exists():
            return []
        return sorted(
            (p for p in self.folder.iterdir() if p.name.startswith("chunk-") and p.name.endswith(".parquet")),
            key=lambda p: p.name,
        )

    def load(self) -> pl.DataFrame:
        """Every finished request of this fingerprint, each once."""
        frames = []
        for chunk in self.chunk_paths():
            with chunk.open("rb") as handle:
                frames.append(conform_results(pl.read_parquet(handle)))
        if not frames:
            return pl.DataFrame(schema=RESULT_SCHEMA)
        return pl.concat(frames).unique("request_key", keep="first", maintain_order=True)

    def save(self, chunk: pl.DataFrame) -> None:
        buffer = io.BytesIO()
        conform_results(chunk).write_parquet(buffer)
        name = f"chunk-{time.time_ns():020d}-{uuid.uuid4().hex[:8]}.parquet"
        write_bytes_atomically(self.folder / name, buffer.getvalue())
        self.chunks_saved += 1

    def discard_other_fingerprints(self) -> list[str]:
        """Remove checkpoints made with other settings: this partition's output will not use them."""
        if not self.partition_dir.exists():
            return []
        stale = [p for p in self.partition_dir.iterdir() if p.name != self.fingerprint]
        for path in stale:
            remove_path(path)
        return [p.name for p in stale]


def clear_checkpoints(partition_dir: UPath) -> None:
    """Remove every checkpoint of a partition (all fingerprints): its output is final now."""
    if partition_dir.exists():
        remove_path(partition_dir)


def remove_path(path: UPath) -> None:
    if path.protocol in ("", "file", "local"):
        if os.path.isdir(path.path):
            shutil.rmtree(path.path, ignore_errors=True)
        elif os.path.exists(path.path):
            os.unlink(path.path)
    else:
        path.fs.rm(path.path, recursive=True)
