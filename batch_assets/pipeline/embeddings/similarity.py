"""Similarity labels (`output.method: similarity` on a choices task): each row labelled by the choice
whose embedding is the most similar, shaped as a choices task's outputs."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import polars as pl

from batch_assets.pipeline.embeddings.prompts import count_text_tokens
from batch_assets.pipeline.format_prompts import Tokenizer
from batch_assets.pipeline.result_stores import vectors_column, vectors_matrix
from batch_assets.pipeline.task_spec import OutputSpec

# Confidence of a similarity label: softmax over the choices of `SIMILARITY_SCALE × cosine`.
# 20 is the scale all-MiniLM-L6-v2 (and most sentence-transformers models) were trained with
# (MultipleNegativesRankingLoss): the model's own probability of the pair among the candidates.
SIMILARITY_SCALE = 20.0


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
