"""Embedding tasks and similarity labels: texts in, vectors out, pure functions over frames.

`output.kind: embedding` sends each row's text (the task's template over its input fields, no chat
template) to an embedding model on vLLM's pooling runner; `validated_labels` gets an `embedding`
column (fixed-size float32) instead of a label. `output.method: similarity` on a choices task labels
each row by the cosine similarity of its embedding to each choice's.

Both go through the same inference loop as generated labels (`run_inference`: deduplication, the
result cache, checkpoints, resume, ranges of partitions): an engine returns a `Generation.vector`,
which the loop keeps as text, base64 of its little-endian float32 bytes (`encode_vector`), so the
stores that keep results need no second schema (and results stored before read as they are).
This module turns those results into the result table (`embedding_outputs`, `validate_embeddings`),
labels rows by similarity (`similarity_outputs`) and measures what the checks check
(`embedding_report`).

What can go wrong with a row, and what it becomes:
- an empty text: an `empty_text` error row naming file and line (a non-string field is refused when
  the file is read: `non_string_text`);
- a text longer than the model takes (`engine.max_model_len`, by default the model's own limit): an
  `input_too_long` error row naming file, line and `input.truncate`, or, with `input.truncate: true`,
  cut to the limit (`truncated` is true for that row), as sentence-transformers does;
- a text the tokenizer reads as mostly its unknown token (`[UNK]` for all-MiniLM-L6-v2: a word over
  100 characters, emoji, a script missing from its vocabulary): still embedded, but the vector says
  little about the text, so formatted_prompts marks the row (`mostly_unknown_tokens`), counts such
  rows in its metadata (`unknown_token_rows`) and logs a warning naming file and lines
  (`unknown_token_warning`).
"""

from __future__ import annotations

import base64
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import polars as pl

from batch_assets.pipeline.engine_contract import Prompt, keys_of
from batch_assets.pipeline.format_prompts import TOKENIZE_CHUNK, Tokenizer, user_message_expr
from batch_assets.pipeline.task_spec import OutputSpec

# Confidence of a similarity label: softmax over the choices of `SIMILARITY_SCALE × cosine`.
# 20 is the scale all-MiniLM-L6-v2 (and most sentence-transformers models) were trained with
# (MultipleNegativesRankingLoss): the model's own probability of the pair among the candidates.
SIMILARITY_SCALE = 20.0
# An embedding whose L2 norm is further than this from 1 fails the norm check (vLLM's embed
# normalizes, as all-MiniLM-L6-v2's own Normalize module does; float32 rounding stays near 1e-7).
NORM_TOLERANCE = 1e-3
_VECTOR_DTYPE = np.dtype("<f4")
_DROPPED_FROM_RESULTS = ("generated_text", "finish_reason", "cumulative_logprob", "token_logprobs")
# A row is marked when at least this share of its text's tokens (the model's special tokens aside)
# is the tokenizer's unknown token: half a text unread leaves a vector about the other half at best.
UNKNOWN_TOKEN_SHARE = 0.5
# formatted_prompts' mark of such rows (kept out of the result table, whose columns are fixed).
UNKNOWN_TOKENS_COLUMN = "mostly_unknown_tokens"
_LINES_SHOWN = 10


# --- vectors through the result stores --------------------------------------------------------


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


# --- formatting ---------------------------------------------------------------------------------


def count_text_tokens(tokenizer: Tokenizer, column: pl.Series) -> pl.Series:
    """Tokens of each text as the model gets it (its special tokens included, [CLS] and [SEP] for BERT
    models), never cut: the count says whether the text fits. Each distinct text is tokenized once."""
    return text_token_counts(tokenizer, column)["tokens"]


def text_token_counts(tokenizer: Tokenizer, column: pl.Series) -> pl.DataFrame:
    """Per text: `tokens` (as `count_text_tokens`) and `unknown_tokens`, how many of them are the
    tokenizer's unknown token (null for a tokenizer without one, as byte-level ones are).

    A copy of the Rust tokenizer is used where there is one, with truncation and padding off
    (`_encoding_backend`): a tokenizer.json may carry settings of its own (all-MiniLM-L6-v2's cuts
    and pads to 128 tokens), which transformers switches on or off at each call, so they depend on the
    call before (on a fresh tokenizer every short text counted 128 tokens).
    """
    distinct = column.drop_nulls().unique().to_list()
    backend = _encoding_backend(tokenizer, None)
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk in {getattr(tokenizer, name, None) for name in ("bos_token_id", "eos_token_id", "pad_token_id")}:
        unk = None  # GPT-2-like tokenizers: the "unknown" id is the one they add to every text
    counts: list[int] = []
    unknown: list[int | None] = []
    for start in range(0, len(distinct), TOKENIZE_CHUNK):
        chunk = distinct[start : start + TOKENIZE_CHUNK]
        if backend is not None:
            encodings = backend.encode_batch_fast(chunk, add_special_tokens=True)
            counts.extend(len(encoding) for encoding in encodings)
            # `.ids` builds a list per text: only for tokenizers that have an unknown token at all.
            unknown.extend(encoding.ids.count(unk) if unk is not None else None for encoding in encodings)
        else:
            ids = tokenizer(chunk, add_special_tokens=True)["input_ids"]
            counts.extend(len(token_ids) for token_ids in ids)
            unknown.extend(token_ids.count(unk) if unk is not None else None for token_ids in ids)
    lengths = pl.DataFrame(
        {
            "text": pl.Series(distinct, dtype=pl.String),
            "tokens": pl.Series(counts, dtype=pl.Int64),
            "unknown_tokens": pl.Series(unknown, dtype=pl.Int64),
        }
    )
    return column.to_frame("text").join(lengths, on="text", how="left", maintain_order="left").drop("text")


def mostly_unknown(tokenizer: Tokenizer, counts: pl.DataFrame) -> pl.Series:
    """Whether at least `UNKNOWN_TOKEN_SHARE` of each text's own tokens (`text_token_counts`, the
    special tokens the tokenizer adds left out) are its unknown token; null where not counted."""
    special = _special_tokens_added(tokenizer)
    own = (pl.col("tokens") - special).clip(lower_bound=1)
    unknown = pl.col("unknown_tokens")
    return counts.select(((unknown > 0) & (unknown >= own * UNKNOWN_TOKEN_SHARE)).alias(UNKNOWN_TOKENS_COLUMN))[
        UNKNOWN_TOKENS_COLUMN
    ]


def _special_tokens_added(tokenizer: Tokenizer) -> int:
    count = getattr(tokenizer, "num_special_tokens_to_add", None)
    return int(count(pair=False)) if callable(count) else 0


def unknown_token_rows(formatted: pl.DataFrame) -> int:
    """How many rows of a formatted partition are marked `mostly_unknown_tokens`."""
    return int(formatted[UNKNOWN_TOKENS_COLUMN].sum() or 0) if UNKNOWN_TOKENS_COLUMN in formatted.columns else 0


def unknown_token_warning(formatted: pl.DataFrame, source_file: str) -> str | None:
    """The log line for a partition's rows marked `mostly_unknown_tokens`, naming file and lines."""
    if not unknown_token_rows(formatted):
        return None
    lines = formatted.filter(pl.col(UNKNOWN_TOKENS_COLUMN).fill_null(False))["source_line"].to_list()
    if not lines:
        return None
    shown = ", ".join(str(line) for line in lines[:_LINES_SHOWN]) + (", ..." if len(lines) > _LINES_SHOWN else "")
    return (
        f"{source_file}: {len(lines)} row(s) are mostly the tokenizer's unknown token (at least "
        f"{UNKNOWN_TOKEN_SHARE:.0%} of their tokens; line {shown}): their embeddings say little about their text "
        "(a word over 100 characters, emoji, a script missing from the model's vocabulary). They are embedded "
        "anyway; formatted_prompts counts them in unknown_token_rows"
    )


def format_embedding_prompts(
    raw: pl.DataFrame,
    template: str,
    text_fields: Sequence[str],
    tokenizer: Tokenizer,
    *,
    max_model_len: int,
    truncate: bool,
    source_file: str,
) -> pl.DataFrame:
    """raw_prompts → formatted_prompts of an embedding or similarity task: `prompt` is the template's
    text (what the model embeds, no chat template), `num_prompt_tokens` counts the model's special
    tokens too; empty and over-long texts become error rows (or, with `truncate`, cut: `truncated`)."""
    ok = pl.col("error").is_null()
    empty = pl.any_horizontal([pl.col(f).fill_null("").str.strip_chars().str.len_chars() == 0 for f in text_fields])
    frame = raw.with_columns(
        error=pl.when(ok & empty)
        .then(pl.format("empty_text: {} line {}: the text is empty", pl.lit(source_file), pl.col("source_line")))
        .otherwise(pl.col("error"))
    )
    ok = pl.col("error").is_null()
    frame = frame.with_columns(prompt=pl.when(ok).then(user_message_expr(template)))
    counts = text_token_counts(tokenizer, frame["prompt"])
    frame = frame.with_columns(
        num_prompt_tokens=counts["tokens"], **{UNKNOWN_TOKENS_COLUMN: mostly_unknown(tokenizer, counts)}
    )
    over = ok & (pl.col("num_prompt_tokens") > max_model_len)
    if truncate:
        return frame.with_columns(
            truncated=pl.when(ok).then(over),
            num_prompt_tokens=pl.when(over).then(pl.lit(max_model_len, dtype=pl.Int64)).otherwise("num_prompt_tokens"),
        )
    frame = frame.with_columns(
        error=pl.when(over)
        .then(
            pl.format(
                "input_too_long: {} line {}: {} tokens exceed the model's limit of {} (engine.max_model_len); "
                "set input.truncate: true in the task to embed the first {} tokens instead",
                pl.lit(source_file),
                pl.col("source_line"),
                pl.col("num_prompt_tokens"),
                pl.lit(max_model_len),
                pl.lit(max_model_len),
            )
        )
        .otherwise(pl.col("error"))
    )
    return frame.with_columns(prompt=pl.when(pl.col("error").is_null()).then(pl.col("prompt")))


def embedding_encoder(tokenizer: Tokenizer, max_model_len: int, truncate: bool) -> Callable[..., list[Prompt]]:
    """Texts → the token ids the pooling runner embeds: the model's special tokens added, as
    sentence-transformers and vLLM's `LLM.embed` tokenize; cut to `max_model_len` with `truncate`
    (too-long texts never get here otherwise: they are error rows). Each prompt keeps its text too:
    an endpoint is sent the text, and its server tokenizes it the same way."""
    backend = _encoding_backend(tokenizer, max_model_len if truncate else None)
    options: dict[str, Any] = {"add_special_tokens": True}
    if truncate:
        options |= {"truncation": True, "max_length": max_model_len}

    def encode(texts: list[str], keys: list[str] | None = None) -> list[Prompt]:
        if not texts:
            return []
        if backend is not None:
            ids = [encoding.ids for encoding in backend.encode_batch_fast(texts, add_special_tokens=True)]
        else:
            ids = tokenizer(texts, **options)["input_ids"]
        return [
            Prompt(tuple(token_ids), text=text, key=key)
            for token_ids, text, key in zip(ids, texts, keys_of(texts, keys), strict=True)
        ]

    return encode


def _encoding_backend(tokenizer: Tokenizer, max_length: int | None) -> Any:
    """A copy of the tokenizer's Rust tokenizer that encodes as `tokenizer(texts, truncation=...,
    max_length=max_length)` does (the same ids), without the Python layer of that call (a third of
    its time, spent on the thread that feeds the engine); None without a Rust tokenizer. A copy of
    its own, set once: the tokenizer's own one has its truncation and padding switched at each call,
    and its tokenizer.json may pad or cut of its own accord."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not hasattr(backend, "encode_batch_fast"):
        return None
    try:
        copy = type(backend).from_str(backend.to_str())
    except Exception:  # a tokenizer with parts that do not serialize: the ordinary call
        return None
    if hasattr(copy, "encode_special_tokens"):  # what transformers sets on each call
        copy.encode_special_tokens = bool(getattr(tokenizer, "split_special_tokens", False))
    copy.no_padding()
    if max_length is None:
        copy.no_truncation()
    else:
        copy.enable_truncation(max_length, direction=getattr(tokenizer, "truncation_side", "right"))
    return copy


# --- results ------------------------------------------------------------------------------------


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


# --- similarity labels --------------------------------------------------------------------------


def choice_texts(output: OutputSpec) -> list[str]:
    """What each choice's embedding is made of: its description when the task gives one, else its name."""
    descriptions = output.descriptions or {}
    return [descriptions.get(choice, choice) for choice in output.choices or []]


def cosine_similarities(rows: np.ndarray, choices: np.ndarray) -> np.ndarray:
    """(rows, choices) cosine similarities (vectors normalized here, whatever the model returned)."""

    def unit(matrix: np.ndarray) -> np.ndarray:
        norms = np.linalg.norm(matrix, axis=1, keepdims=True)
        return matrix / np.where(norms == 0, 1.0, norms)

    return unit(rows.astype(np.float64)) @ unit(choices.astype(np.float64)).T


def similarity_labels(
    rows: np.ndarray, choice_vectors: np.ndarray, choices: Sequence[str], scale: float = SIMILARITY_SCALE
) -> tuple[list[str], np.ndarray, np.ndarray]:
    """Per row: the most similar choice, its cosine similarity, and its confidence, the softmax over
    the choices of `scale × cosine` (ties go to the earlier choice)."""
    if rows.shape[0] == 0:
        return [], np.zeros(0), np.zeros(0)
    similarities = cosine_similarities(rows, choice_vectors)
    best = similarities.argmax(axis=1)
    logits = scale * similarities
    logits -= logits.max(axis=1, keepdims=True)
    probabilities = np.exp(logits)
    probabilities /= probabilities.sum(axis=1, keepdims=True)
    picked = np.arange(rows.shape[0])
    return [choices[i] for i in best], similarities[picked, best], probabilities[picked, best]


def similarity_outputs(results: pl.DataFrame, choice_vectors: np.ndarray, choices: Sequence[str]) -> pl.DataFrame:
    """inference results of a similarity task → inference_outputs shaped as a choices task's: the
    label in `generated_text`, the log of its confidence in `cumulative_logprob` (so the labels,
    confidence, checks, accuracy and drift of a choices task apply unchanged), its cosine in
    `similarity`; the row's embedding stays in inference_outputs as `embedding`."""
    embedding = vectors_column(results["generated_text"])
    ok = embedding.is_not_null()
    labels, similarity, confidence = similarity_labels(vectors_matrix(embedding.filter(ok)), choice_vectors, choices)
    positions = np.flatnonzero(ok.to_numpy())
    label_column: list[str | None] = [None] * results.height
    similarity_column: list[float | None] = [None] * results.height
    logprob_column: list[float | None] = [None] * results.height
    for position, label, cosine, probability in zip(positions, labels, similarity, confidence, strict=True):
        label_column[position] = label
        similarity_column[position] = float(cosine)
        logprob_column[position] = math.log(probability) if probability > 0 else -math.inf
    return results.with_columns(
        pl.Series("generated_text", label_column, dtype=pl.String),
        finish_reason=pl.when(ok).then(pl.lit("stop")),
        num_generated_tokens=pl.when(ok).then(pl.lit(0, dtype=pl.Int64)),
        cumulative_logprob=pl.Series(logprob_column, dtype=pl.Float64),
        similarity=pl.Series(similarity_column, dtype=pl.Float64),
        embedding=embedding,
    )


def choices_frame(texts: Sequence[str], tokenizer: Tokenizer) -> pl.DataFrame:
    """The choices' texts as a formatted partition of their own (`row_id` = choice index), so their
    embeddings go through the same stream, result cache and deduplication as the rows'."""
    prompts = pl.Series("prompt", list(texts), dtype=pl.String)
    return pl.DataFrame(
        {
            "row_id": pl.Series(range(len(texts)), dtype=pl.Int64),
            "prompt": prompts,
            "error": pl.Series([None] * len(texts), dtype=pl.String),
            "num_prompt_tokens": count_text_tokens(tokenizer, prompts),
        }
    )


def choice_vectors(results: pl.DataFrame, choices: Sequence[str], texts: Sequence[str]) -> np.ndarray:
    """The choices' embeddings from their partition's results; a choice the engine gave none fails
    the run, naming the setting that holds its text."""
    for choice, text, error in zip(choices, texts, results["error"].to_list(), strict=True):
        if error is not None:
            where = f"output.descriptions.{choice}" if text != choice else f"output.choices ({choice!r})"
            raise ValueError(f"the text of the choice {choice!r} ({where}) could not be embedded: {error}")
    return vectors_matrix(vectors_column(results["generated_text"]))
