"""Where inference results are kept: their schema and the two stores `run_inference` uses.

A result is one answered request: its `request_key` and what the engine returned for it. The
inference loop reads results back from a partition's checkpoints (an interrupted earlier attempt)
and from the result cache (other partitions and runs), and writes new ones to both. The core
states what it needs of them here; `storage/checkpoints.py` and `storage/result_cache.py`
implement it, so the core never imports storage and its tests can use in-memory stores.

An embedding is kept as text in the same schema (`encode_vector`), and read back as a column of
vectors (`vectors_column`, `vectors_matrix`) by every kind that embeds.
"""

from __future__ import annotations

import base64
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import polars as pl

if TYPE_CHECKING:
    from polars._typing import PolarsDataType

# polars' stubs type DataFrame.cast's mapping keys as `str | selector | dtype`, and a Mapping's key type
# is invariant, so `.cast(RESULT_SCHEMA)` needs a type: ignore[arg-type] (it is fine at run time).
RESULT_SCHEMA: dict[str, PolarsDataType] = {
    "request_key": pl.String,
    "generated_text": pl.String,
    "finish_reason": pl.String,
    "num_prompt_tokens": pl.Int64,
    "num_generated_tokens": pl.Int64,
    "error": pl.String,
    "cumulative_logprob": pl.Float64,
    # `Generation.token_logprobs`: an OpenAI batch line's per-token log-probabilities, as JSON text.
    "token_logprobs": pl.String,
}


class Checkpoints(Protocol):
    """One partition's results saved while it is inferred, under one run fingerprint."""

    def load(self) -> pl.DataFrame:
        """Every result saved so far (`RESULT_SCHEMA`), each request once."""
        ...

    def save(self, chunk: pl.DataFrame) -> None:
        """Add finished results (`RESULT_SCHEMA`); a crash never loses a chunk once this returns."""
        ...


class ResultLookup(Protocol):
    """Results of deterministic requests, shared by every partition and run under one fingerprint."""

    def lookup(self, keys: pl.Series | None = None) -> pl.DataFrame:
        """The stored results of `keys` (`RESULT_SCHEMA`), each key once; every result when None."""
        ...

    def add(self, results: pl.DataFrame) -> int:
        """Store the results without an error; returns how many were offered."""
        ...


class BatchRecords(Protocol):
    """What a batch API engine keeps of the batches it submitted (engines/batch_api_run.py), one
    JSON-able record per batch, under one run fingerprint: written before the run waits, so a
    killed or retried run collects the same batch instead of paying for a second one."""

    def load(self) -> list[dict]:
        """Every record kept (oldest first)."""
        ...

    def save(self, record: dict) -> None:
        """Write (or replace) the record named `record["name"]`; durable once this returns."""
        ...

    def remove(self, name: str) -> None:
        """Forget a record whose results are all checkpointed."""
        ...


# --- vectors in the result schema -------------------------------------------------------------
# An engine's `Generation.vector` is kept as `generated_text`, so the stores need no second schema.

_VECTOR_DTYPE = np.dtype("<f4")


def encode_vector(values: Any) -> str:
    """An embedding as text: base64 of its little-endian float32 bytes (what the result stores keep)."""
    return base64.b64encode(np.asarray(values, dtype=_VECTOR_DTYPE).tobytes()).decode("ascii")


def decode_vector(text: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(text), dtype=_VECTOR_DTYPE)


def vectors_column(texts: pl.Series, name: str = "embedding") -> pl.Series:
    """Encoded vectors → one float32 column: a fixed-size `Array` when every vector has one size (null
    rows stay null), decoded by polars with no Python object per row; else a `List` (which the
    dimension check then reports)."""
    raw = texts.str.decode("base64")
    sizes = raw.bin.size().drop_nulls().unique()
    if sizes.len() == 1:
        return raw.bin.reinterpret(dtype=pl.Array(pl.Float32, sizes[0] // 4), endianness="little").alias(name)
    decoded = [None if text is None else decode_vector(text).tolist() for text in texts.to_list()]
    return pl.Series(name, decoded, dtype=pl.List(pl.Float32))


def vectors_matrix(column: pl.Series) -> np.ndarray:
    """A non-null fixed-size vector column as an (rows, dimension) float32 matrix."""
    if column.len() == 0:
        return np.zeros((0, 0), dtype=np.float32)
    if isinstance(column.dtype, pl.Array):
        return column.to_numpy().astype(np.float32, copy=False).reshape(column.len(), column.dtype.size)
    return np.asarray(column.to_list(), dtype=np.float32)
