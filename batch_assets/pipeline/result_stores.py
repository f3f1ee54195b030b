"""Where inference results are kept: their schema and the two stores `run_inference` uses.

A result is one answered request: its `request_key` and what the engine returned for it. The
inference loop reads results back from a partition's checkpoints (an interrupted earlier attempt)
and from the result cache (other partitions and runs), and writes new ones to both. The core
states what it needs of them here; `storage/checkpoints.py` and `storage/result_cache.py`
implement it, so the core never imports storage and its tests can use in-memory stores.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

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
    """What a batch API engine keeps of the batches it submitted (engines/batch_api_engine.py), one
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
