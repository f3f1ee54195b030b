"""An embedding task's results: inference_outputs with their vectors decoded, the result table,
and what the embedding checks check."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import polars as pl

from batch_assets.pipeline.result_stores import vectors_column, vectors_matrix
from batch_assets.pipeline.validate_labels import UNKNOWN_TOKENS_COLUMN

# An embedding whose L2 norm is further than this from 1 fails the norm check (vLLM's embed
# normalizes, as all-MiniLM-L6-v2's own Normalize module does; float32 rounding stays near 1e-7).
NORM_TOLERANCE = 1e-3
_DROPPED_FROM_RESULTS = ("generated_text", "finish_reason", "cumulative_logprob", "token_logprobs")


def embedding_outputs(results: pl.DataFrame) -> pl.DataFrame:
    """inference results of an embedding task → inference_outputs: the encoded vectors decoded into an
    `embedding` column; the text-generation columns (none of which an embedding has) left out."""
    embedding = vectors_column(results["generated_text"])
    return results.with_columns(embedding).drop(*[c for c in _DROPPED_FROM_RESULTS if c in results.columns])


def validate_embeddings(outputs: pl.DataFrame) -> pl.DataFrame:
    """inference_outputs → validated_labels of an embedding task: `row_id`, `source_line`, every input
    column, (`truncated`,) `embedding`, `num_prompt_tokens`, `error`; a row without an embedding and
    without an error gets one (the checks then fail on it, never silently)."""
    missing = pl.col("embedding").is_null() & pl.col("error").is_null()
    frame = outputs.with_columns(
        error=pl.when(missing).then(pl.lit("no_output: the engine returned no embedding")).otherwise("error")
    )
    trailing = [*(["truncated"] if "truncated" in frame.columns else []), "embedding", "num_prompt_tokens", "error"]
    dropped = {
        "row_id",
        "source_line",
        "prompt",
        "num_generated_tokens",
        UNKNOWN_TOKENS_COLUMN,
        *_DROPPED_FROM_RESULTS,
        *trailing,
    }
    middle = [c for c in frame.columns if c not in dropped]
    return frame.select("row_id", "source_line", *middle, *trailing)


@dataclass(frozen=True)
class EmbeddingReport:
    """What the embedding checks check, for one partition."""

    rows: int
    embedded_rows: int
    dimensions: list[int]  # the distinct vector sizes (one, when all is well)
    non_finite_rows: list[int]  # row_ids of vectors with a NaN or an infinite value
    off_norm_rows: list[int]  # row_ids of vectors whose L2 norm is not 1 (± NORM_TOLERANCE)
    norm_min: float | None
    norm_max: float | None

    @property
    def dimension(self) -> int | None:
        return self.dimensions[0] if len(self.dimensions) == 1 else None

    def metadata(self) -> dict[str, Any]:
        return {
            "embedded_rows": self.embedded_rows,
            "dimension": self.dimension if self.dimension is not None else str(self.dimensions),
            "non_finite_rows": len(self.non_finite_rows),
            "off_norm_rows": len(self.off_norm_rows),
            "norm_min": None if self.norm_min is None else round(self.norm_min, 6),
            "norm_max": None if self.norm_max is None else round(self.norm_max, 6),
        }


def embedding_report(labels: pl.DataFrame, *, expected_norm: float = 1.0) -> EmbeddingReport:
    embedded = labels.filter(pl.col("embedding").is_not_null())
    row_ids = embedded["row_id"].to_list()
    if isinstance(embedded.schema["embedding"], pl.Array):
        vectors = vectors_matrix(embedded["embedding"])
        dimensions = [int(vectors.shape[1])] if len(row_ids) else []
        finite = np.isfinite(vectors).all(axis=1)
        norms = np.linalg.norm(np.where(np.isfinite(vectors), vectors, 0.0), axis=1)
    else:  # vectors of several sizes: checked one by one
        rows = [np.asarray(v, dtype=np.float32) for v in embedded["embedding"].to_list()]
        dimensions = sorted({len(v) for v in rows})
        finite = np.array([bool(np.isfinite(v).all()) for v in rows], dtype=bool)
        norms = np.array([float(np.linalg.norm(np.where(np.isfinite(v), v, 0.0))) for v in rows])
    off_norm = finite & (np.abs(norms - expected_norm) > NORM_TOLERANCE)
    measured = norms[finite]
    return EmbeddingReport(
        rows=labels.height,
        embedded_rows=len(row_ids),
        dimensions=dimensions,
        non_finite_rows=[row_id for row_id, ok in zip(row_ids, finite, strict=True) if not ok],
        off_norm_rows=[row_id for row_id, off in zip(row_ids, off_norm, strict=True) if off],
        norm_min=float(measured.min()) if measured.size else None,
        norm_max=float(measured.max()) if measured.size else None,
    )
