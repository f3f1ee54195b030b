"""Turn generated text into labels and say, row by row, what is wrong.

Pure functions: `parse_label` for one text, `validate_labels` for a partition's inference outputs,
and `constraint_violations` for the blocking asset check (outputs that finished normally but do not
satisfy the task's constraint, which structured outputs should make impossible).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import polars as pl

from batch_assets.pipeline.task_spec import OutputSpec, schema_error

# formatted_prompts' mark of an embedded text that is mostly the tokenizer's unknown token
# (pipeline/embeddings/prompts.py): kept out of every result table, whose columns are fixed.
UNKNOWN_TOKENS_COLUMN = "mostly_unknown_tokens"


@dataclass(frozen=True)
class ParsedLabel:
    value: Any
    error: str | None


def parse_label(text: str | None, finish_reason: str | None, output: OutputSpec) -> ParsedLabel:
    if text is None:
        return ParsedLabel(None, "no_output: the engine returned no text")
    if output.kind == "text":
        if finish_reason == "length":
            return ParsedLabel(text, None)  # free text may be cut at max_tokens; that is still an answer
        return ParsedLabel(text.strip(), None)
    if output.kind == "choices":
        candidate = text.strip()
        if candidate in (output.choices or []):
            return ParsedLabel(candidate, None)
        reason = "truncated at max_tokens" if finish_reason == "length" else "not one of the choices"
        return ParsedLabel(None, f"invalid_label: {candidate[:80]!r} is {reason}")
    if output.kind == "regex":
        if re.fullmatch(output.regex or "", text):
            return ParsedLabel(text, None)
        return ParsedLabel(None, f"invalid_label: {text[:80]!r} does not match the task's regex")
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        hint = " (truncated at max_tokens: raise sampling.max_tokens)" if finish_reason == "length" else ""
        return ParsedLabel(None, f"invalid_json: {exc.msg} at column {exc.colno}{hint}")
    error = schema_error(value, output.json_schema or {})
    return ParsedLabel(None, error) if error else ParsedLabel(value, None)


def _choice_labels(outputs: pl.DataFrame, output: OutputSpec) -> tuple[pl.Series, pl.Series]:
    """Vectorized `parse_label` for choices: the common case on million-row partitions."""
    candidate = pl.col("generated_text").str.strip_chars()
    valid = candidate.is_in(output.choices or [])
    reason = (
        pl.when(pl.col("finish_reason") == "length")
        .then(pl.lit("truncated at max_tokens"))
        .otherwise(pl.lit("not one of the choices"))
    )
    shown = pl.lit("'") + candidate.str.slice(0, 80).str.replace_all("'", "\\'", literal=True) + pl.lit("'")
    result = outputs.select(
        label=pl.when(pl.col("error").is_null() & valid).then(candidate),
        error=pl.when(pl.col("error").is_not_null())
        .then(pl.col("error"))
        .when(pl.col("generated_text").is_null())
        .then(pl.lit("no_output: the engine returned no text"))
        .when(~valid)
        .then(pl.lit("invalid_label: ") + shown + pl.lit(" is ") + reason),
    )
    return result["label"], result["error"]


def validate_labels(outputs: pl.DataFrame, output: OutputSpec) -> pl.DataFrame:
    """inference_outputs → validated_labels: `label` parsed and checked, problems in `error`, and
    for choices and regex tasks the label's `confidence`."""
    if output.kind == "choices":
        label_series, error_series = _choice_labels(outputs, output)
        labelled = outputs.with_columns(label_series.alias("label"), error_series.alias("error"))
        return _arrange(_with_confidence(labelled, output))
    labels: list[Any] = []
    errors: list[str | None] = []
    for text, finish_reason, error in zip(
        outputs["generated_text"], outputs["finish_reason"], outputs["error"], strict=True
    ):
        if error is not None:
            labels.append(None)
            errors.append(error)
            continue
        parsed = parse_label(text, finish_reason, output)
        labels.append(parsed.value)
        errors.append(parsed.error)
    if output.kind == "json_schema":
        # One JSON string column keeps any schema storable; the objects are parsed and validated.
        label_series = pl.Series(
            "label", [json.dumps(v, ensure_ascii=False) if v is not None else None for v in labels], dtype=pl.String
        )
    else:
        label_series = pl.Series("label", labels, dtype=pl.String)
    labelled = outputs.with_columns(label_series, pl.Series("error", errors, dtype=pl.String))
    return _arrange(_with_confidence(labelled, output))


def _with_confidence(labelled: pl.DataFrame, output: OutputSpec) -> pl.DataFrame:
    """`confidence` (0–1) of each label: exp of its generated tokens' summed log-probabilities (each
    among the tokens the constraint allows at its step): the probability of that token sequence. For
    single-token choices, the label's probability among the choices; for a label of several tokens,
    at most that (other token sequences spelling it are not counted: docs/outputs.md). Null for rows
    without a label and for results the engine returned no log-probabilities for."""
    if not output.has_confidence:
        return labelled
    if "cumulative_logprob" not in labelled.columns:  # outputs stored before confidence was measured
        return labelled.with_columns(confidence=pl.lit(None, dtype=pl.Float64))
    probability = pl.col("cumulative_logprob").fill_nan(None).exp().clip(0.0, 1.0)
    return labelled.with_columns(confidence=pl.when(pl.col("label").is_not_null()).then(probability))


def _arrange(result: pl.DataFrame) -> pl.DataFrame:
    leading = ["row_id"]
    trailing = ["label", "generated_text", "finish_reason", "num_prompt_tokens", "num_generated_tokens", "error"]
    if "confidence" in result.columns:  # only choices and regex tasks have it (input columns cannot)
        # Before `label`, so the trailing columns that readers of the table rely on keep their places.
        trailing.insert(0, "confidence")
    # The engine's log-probability lives on in inference_outputs; the result table has `confidence`.
    dropped = {"prompt", "source_line", "cumulative_logprob", "token_logprobs", UNKNOWN_TOKENS_COLUMN}
    if "similarity" in result.columns and "embedding" in result.columns:
        # Similarity labels (pipeline/embeddings/similarity.py): the label's cosine similarity before its confidence;
        # the row embeddings stay in inference_outputs.
        trailing.insert(0, "similarity")
        dropped.add("embedding")
    middle = [c for c in result.columns if c not in leading + trailing and c not in dropped]
    return result.select(*leading, "source_line", *middle, *trailing)


def constraint_violations(outputs: pl.DataFrame, output: OutputSpec) -> pl.DataFrame:
    """Rows with an output that breaks the constraint (cut at max_tokens included: raise max_tokens)."""
    if output.kind == "text":
        return outputs.head(0)
    finished = outputs.filter(pl.col("error").is_null())
    bad = [
        parse_label(text, reason, output).error is not None
        for text, reason in zip(finished["generated_text"], finished["finish_reason"], strict=True)
    ]
    return finished.filter(pl.Series(bad, dtype=pl.Boolean))


def invalid_labels(labelled: pl.DataFrame, output: OutputSpec) -> pl.DataFrame:
    """Rows of `validated_labels` (with a label) whose label the constraint does not allow: not one of
    the choices, or not valid against the schema / the regex. Free text is always valid."""
    if output.kind == "choices":
        return labelled.filter(~pl.col("label").is_in(output.choices or []))
    if output.kind in ("json_schema", "regex"):
        invalid = [parse_label(text, "stop", output).error is not None for text in labelled["label"]]
        return labelled.filter(pl.Series(invalid, dtype=pl.Boolean))
    return labelled.head(0)
