"""Label parsing and validation as pure functions, one case per kind of bad output."""

from __future__ import annotations

import json

import polars as pl

from batch_assets.pipeline.task_spec import OutputSpec
from batch_assets.pipeline.validate_labels import constraint_violations, parse_label, validate_labels
from batch_assets_tests.support import ANSWER_COLUMNS

CHOICES = OutputSpec(kind="choices", choices=["positive", "negative", "neutral"])
SCHEMA = OutputSpec(
    kind="json_schema",
    json_schema={
        "type": "object",
        "properties": {"sentiment": {"enum": ["pos", "neg"]}, "score": {"type": "number"}},
        "required": ["sentiment", "score"],
    },
)
REGEX = OutputSpec(kind="regex", regex=r"[A-Z]{3}-\d+")
TEXT = OutputSpec(kind="text")


def test_choice_labels() -> None:
    assert parse_label("positive", "stop", CHOICES).value == "positive"
    assert parse_label(" neutral\n", "stop", CHOICES).value == "neutral"
    bad = parse_label("Positive!", "stop", CHOICES)
    assert bad.value is None and bad.error.startswith("invalid_label") and "not one of the choices" in bad.error
    cut = parse_label("negat", "length", CHOICES)
    assert cut.value is None and "truncated" in cut.error


def test_json_labels_are_parsed_and_validated_against_the_schema() -> None:
    assert parse_label('{"sentiment": "pos", "score": 0.9}', "stop", SCHEMA).value == {"sentiment": "pos", "score": 0.9}
    missing = parse_label('{"sentiment": "pos"}', "stop", SCHEMA)
    assert missing.value is None and missing.error.startswith("schema_mismatch") and "score" in missing.error
    wrong = parse_label('{"sentiment": "meh", "score": 1}', "stop", SCHEMA)
    assert wrong.error.startswith("schema_mismatch: at sentiment")
    broken = parse_label('{"sentiment": "pos", "sco', "length", SCHEMA)
    assert broken.error.startswith("invalid_json") and "max_tokens" in broken.error


def test_regex_and_text_labels() -> None:
    assert parse_label("ABC-12", "stop", REGEX).value == "ABC-12"
    assert parse_label("abc-12", "stop", REGEX).error.startswith("invalid_label")
    assert parse_label("  An answer.  ", "stop", TEXT).value == "An answer."
    assert parse_label(None, None, TEXT).error.startswith("no_output")


def outputs(texts, reasons, errors=None) -> pl.DataFrame:
    n = len(texts)
    return pl.DataFrame(
        {
            "row_id": list(range(n)),
            "source_line": list(range(1, n + 1)),
            "text": [f"input {i}" for i in range(n)],
            "prompt": ["p"] * n,
            "num_prompt_tokens": [10] * n,
            "generated_text": texts,
            "finish_reason": reasons,
            "num_generated_tokens": [1] * n,
            "error": errors or [None] * n,
        },
        schema_overrides={"error": pl.String, "generated_text": pl.String, "finish_reason": pl.String},
    )


def test_validate_labels_keeps_one_row_per_input_with_contract_columns() -> None:
    frame = outputs(["positive", "bogus", None], ["stop", "stop", None], [None, None, "empty_text: f line 3: empty"])
    labels = validate_labels(frame, CHOICES)
    assert labels["row_id"].to_list() == [0, 1, 2]
    assert labels.columns[0] == "row_id"
    assert labels.columns[-6:] == ["label", *ANSWER_COLUMNS]
    assert "text" in labels.columns and "prompt" not in labels.columns
    assert labels["label"].to_list() == ["positive", None, None]
    assert labels["error"][1].startswith("invalid_label") and labels["error"][2].startswith("empty_text")


def test_json_labels_column_holds_the_parsed_objects() -> None:
    frame = outputs(['{"sentiment": "neg", "score": 0.1}'], ["stop"])
    labels = validate_labels(frame, SCHEMA)
    assert json.loads(labels["label"][0]) == {"sentiment": "neg", "score": 0.1}


def test_constraint_violations_are_outputs_that_break_the_constraint() -> None:
    frame = outputs(["positive", "bogus", "negat", None], ["stop", "stop", "length", None], [None, None, None, "x: y"])
    assert constraint_violations(frame, CHOICES)["row_id"].to_list() == [1, 2]
    assert constraint_violations(frame, TEXT).height == 0


def test_choice_and_regex_labels_carry_their_confidence_others_none() -> None:
    frame = outputs(
        ["positive", "bogus", None, "negative"], ["stop", "stop", None, "stop"], [None, None, "x: y", None]
    ).with_columns(cumulative_logprob=pl.Series([-0.105360516, -0.5, None, None], dtype=pl.Float64))
    labels = validate_labels(frame, CHOICES)
    # exp(log p): 0.9 for the first; none for an invalid label, an error row, or a result without logprobs.
    assert [None if c is None else round(c, 4) for c in labels["confidence"]] == [0.9, None, None, None]
    assert labels.columns[-7:-5] == ["confidence", "label"] and "cumulative_logprob" not in labels.columns

    regex = validate_labels(outputs(["ABC-1"], ["stop"]).with_columns(cumulative_logprob=pl.lit(0.0)), REGEX)
    assert regex["confidence"].to_list() == [1.0]
    for output in (TEXT, SCHEMA):
        text = '{"sentiment": "neg", "score": 0.1}'
        labels = validate_labels(outputs([text], ["stop"]).with_columns(cumulative_logprob=pl.lit(-1.0)), output)
        assert "confidence" not in labels.columns and "cumulative_logprob" not in labels.columns
    # Outputs stored before confidence was measured have no log-probabilities: the column is null.
    assert validate_labels(outputs(["neutral"], ["stop"]), CHOICES)["confidence"].to_list() == [None]
