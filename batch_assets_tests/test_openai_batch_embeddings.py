"""OpenAI batch `/v1/embeddings` lines: parsed (a text or a list of texts, one row each), formatted as
an embedding task's texts (too long, a chat line, another model: error rows naming file, line and the
setting), and written as the output lines OpenAI's Batch API documents for embeddings. The slow test
runs the shipped `openai_batch_embeddings` task through Dagster and compares it with vLLM's own
run-batch on the same file."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import dagster as dg
import numpy as np
import polars as pl
import pytest
from transformers import AutoTokenizer

from batch_assets.engines.embedded_model import embedding_model_dir, ensure_embedded_model
from batch_assets.pipeline.openai_batch.formatting import format_batch_embedding_prompts
from batch_assets.pipeline.openai_batch.lines import read_batch_requests
from batch_assets.pipeline.openai_batch.output import batch_files, validate_batch_embeddings, validate_batch_outputs
from batch_assets.pipeline.result_stores import encode_vector, vectors_column
from batch_assets.pipeline.task_spec import BUNDLED_TASKS_DIR, TaskSpecError, load_task_spec
from batch_assets_tests.support.openai_batch import (
    chat_line,
    format_lines,
    jsonl,
    materialize,
    read_jsonl,
    run_vllm_batch,
)

TASK = "openai_batch_embeddings"


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(embedding_model_dir()))


def embed_line(custom_id: str, text: object = None, **body) -> dict:
    body = {"model": "all-MiniLM-L6-v2", "input": f"text {custom_id}" if text is None else text, **body}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/embeddings", "body": body}


def format_embeddings(data: bytes, tokenizer, **options) -> pl.DataFrame:
    return format_batch_embedding_prompts(
        read_batch_requests(data, "in.jsonl"),
        tokenizer,
        max_model_len=options.pop("max_model_len", 256),
        truncate=options.pop("truncate", False),
        source_file="in.jsonl",
        **options,
    )


def test_a_text_or_a_list_of_texts_becomes_one_row_per_text() -> None:
    data = jsonl(
        embed_line("one", "A ferry."),
        embed_line("two", ["Bread.", "A router."], encoding_format="base64"),
        embed_line("single-list", ["Only one."]),
    )
    frame = read_batch_requests(data, "in.jsonl")
    assert frame["error"].null_count() == 4
    assert frame["row_id"].to_list() == [0, 1, 2, 3]
    assert frame["source_line"].to_list() == [1, 2, 2, 3]
    assert frame["custom_id"].to_list() == ["one", "two", "two", "single-list"]
    assert frame["input"].to_list() == ["A ferry.", "Bread.", "A router.", "Only one."]
    assert frame["input_index"].to_list() == [0, 0, 1, 0]
    assert frame["encoding_format"].to_list() == ["float", "base64", "base64", "float"]


@pytest.mark.parametrize(
    ("line", "code", "names"),
    [
        (embed_line("empty", ""), "empty_input", "body.input is missing or empty"),
        (embed_line("blank", "   "), "empty_input", "body.input is blank"),
        (embed_line("blank-item", ["ok", ""]), "empty_input", "body.input[1] is empty"),
        (embed_line("number", 7), "invalid_field", "body.input is a number; it must be a text or a list of texts"),
        (embed_line("mixed", ["ok", 3]), "invalid_field", "body.input[1] is a number, not a text"),
        (embed_line("ids", [101, 2023, 102]), "unsupported_field", "body.input holds token ids"),
        (embed_line("id-lists", [[101, 102]]), "unsupported_field", "body.input holds token ids"),
        (embed_line("many", ["x"] * 2049), "invalid_field", "at most 2048"),
        (embed_line("fmt", encoding_format="int8"), "invalid_field", "body.encoding_format"),
        (embed_line("dims", dimensions=64), "unsupported_field", "body.dimensions"),
        (
            {"custom_id": "chat-body", "method": "POST", "url": "/v1/embeddings", "body": chat_line("x")["body"]},
            "unsupported_field",
            "body.messages",
        ),
    ],
)
def test_every_bad_embeddings_line_is_one_error_row_naming_file_and_line(line: dict, code: str, names: str) -> None:
    frame = read_batch_requests(jsonl(embed_line("before"), line, embed_line("after")), "drop/in.jsonl")
    assert frame.height == 3
    assert frame["error"][0] is None and frame["error"][2] is None
    assert frame["error"][1].startswith(f"{code}: drop/in.jsonl line 2: ")
    assert names in frame["error"][1]


def test_formatting_refuses_chat_lines_other_models_and_too_long_texts_naming_the_setting(tokenizer) -> None:
    data = jsonl(
        embed_line("ok", "The harbor ferry leaves every hour."),
        chat_line("chat"),
        {"custom_id": "completion", "method": "POST", "url": "/v1/completions", "body": {"prompt": "Once"}},
        embed_line("long", "word " * 300),
        embed_line("other-model", model="text-embedding-3-small"),
    )
    frame = format_embeddings(data, tokenizer, accepted_models={"embedded:all-MiniLM-L6-v2", "all-MiniLM-L6-v2"})
    errors = dict(zip(frame["custom_id"], frame["error"], strict=True))
    assert errors["ok"] is None
    assert frame.filter(pl.col("custom_id") == "ok")["prompt"].item() == "The harbor ferry leaves every hour."
    assert frame.filter(pl.col("custom_id") == "ok")["num_prompt_tokens"].item() == 9  # [CLS] + 7 + [SEP]
    assert errors["chat"].startswith("unsupported_url: in.jsonl line 2: url /v1/chat/completions")
    assert "output.kind: text (such as openai_batch)" in errors["chat"]
    assert errors["completion"].startswith("unsupported_url: in.jsonl line 3: url /v1/completions")
    assert errors["long"].startswith("input_too_long: in.jsonl line 4: 302 tokens exceed the model's limit of 256")
    assert "set input.truncate: true" in errors["long"]
    assert errors["other-model"].startswith("model_mismatch: in.jsonl line 5:")
    assert "input.require_model_match: false" in errors["other-model"]
    assert frame.filter(pl.col("error").is_not_null())["prompt"].null_count() == 4

    cut = format_embeddings(jsonl(embed_line("long", "word " * 300)), tokenizer, truncate=True)
    assert cut["error"].to_list() == [None] and cut["truncated"].to_list() == [True]
    assert cut["num_prompt_tokens"].to_list() == [256]


def test_an_embeddings_line_in_a_chat_batch_task_names_the_task_to_send_it_to() -> None:
    chat_tokenizer = AutoTokenizer.from_pretrained(ensure_embedded_model())
    frame = format_lines(jsonl(chat_line("a"), embed_line("e", ["two", "texts"]), chat_line("b")), chat_tokenizer)
    assert frame["error"][0] is None and frame["error"][3] is None
    error = frame["error"][1]
    assert error.startswith("unsupported_url: in.jsonl line 2: url /v1/embeddings asks for vectors")
    assert "output.kind: embedding (such as openai_batch_embeddings)" in error
    # Its two texts are two rows; the line is one error line.
    outputs = frame.with_columns(
        generated_text=pl.when(pl.col("error").is_null()).then(pl.lit("answer")),
        finish_reason=pl.when(pl.col("error").is_null()).then(pl.lit("stop")),
        num_generated_tokens=pl.lit(1),
        cumulative_logprob=pl.lit(None, dtype=pl.Float64),
    )
    answered, failed = batch_files(validate_batch_outputs(outputs), model="m", partition_key="in.jsonl", created=0)
    assert [o["custom_id"] for o in answered] == ["a", "b"]
    assert [(e["custom_id"], e["response"]["body"]["error"]["code"]) for e in failed] == [("e", "unsupported_url")]


def embedded(formatted: pl.DataFrame, failed: dict[int, str] | None = None) -> pl.DataFrame:
    """inference_outputs of an embedding task, made by hand: row i's vector is e_i (unit length)."""
    failed = failed or {}
    texts = [
        None if error is not None or row in failed else encode_vector(np.eye(4, dtype=np.float32)[row % 4])
        for row, error in zip(formatted["row_id"], formatted["error"], strict=True)
    ]
    errors = [failed.get(row, error) for row, error in zip(formatted["row_id"], formatted["error"], strict=True)]
    return formatted.with_columns(
        vectors_column(pl.Series(texts, dtype=pl.String)), pl.Series("error", errors, dtype=pl.String)
    )


def test_output_lines_are_the_embeddings_response_and_failed_lines_go_to_the_error_file(tokenizer) -> None:
    data = jsonl(
        embed_line("one", "A ferry."),
        embed_line("two", ["Bread.", "A router."]),
        embed_line("b64", "Revenue grew.", encoding_format="base64"),
        "{broken",
        embed_line("long", ["fine", "word " * 300]),
        embed_line("engine", "The server failed this one."),
        chat_line("chat"),
    )
    formatted = format_embeddings(data, tokenizer)
    engine_row = formatted.filter(pl.col("custom_id") == "engine")["row_id"].item()
    labels = validate_batch_embeddings(
        embedded(formatted, {engine_row: "endpoint_error: HTTP 503: overloaded; gave up after 5 attempts"})
    )
    assert {"messages", "max_tokens", "response_format", "prompt"}.isdisjoint(labels.columns)
    assert labels.columns[-3:] == ["embedding", "num_prompt_tokens", "error"]
    outputs, errors = batch_files(labels, model="all-MiniLM-L6-v2", partition_key="in.jsonl", created=0)

    assert [o["custom_id"] for o in outputs] == ["one", "two", "b64"]
    assert [e["custom_id"] for e in errors] == [None, "long", "engine", "chat"]  # every line in one of the files
    one, two, b64 = (o["response"] for o in outputs)
    assert all(o["error"] is None and o["id"].startswith("batch_req_") for o in outputs)
    assert one["status_code"] == 200 and one["request_id"].startswith("req_")
    assert one["body"] == {
        "object": "list",
        "data": [{"object": "embedding", "index": 0, "embedding": [1.0, 0.0, 0.0, 0.0]}],
        "model": "all-MiniLM-L6-v2",
        "usage": {"prompt_tokens": 5, "total_tokens": 5},
    }
    assert [(d["index"], d["embedding"]) for d in two["body"]["data"]] == [
        (0, [0.0, 1.0, 0.0, 0.0]),
        (1, [0.0, 0.0, 1.0, 0.0]),
    ]
    assert two["body"]["usage"]["prompt_tokens"] == sum(
        labels.filter(pl.col("custom_id") == "two")["num_prompt_tokens"]
    )
    vector = np.frombuffer(base64.b64decode(b64["body"]["data"][0]["embedding"]), dtype="<f4")
    assert vector.tolist() == [0.0, 0.0, 0.0, 1.0]

    codes = [(e["response"]["status_code"], e["response"]["body"]["error"]["code"]) for e in errors]
    assert codes == [
        (400, "malformed_json"),
        (400, "input_too_long"),
        (500, "endpoint_error"),
        (400, "unsupported_url"),
    ]
    too_long = errors[1]["response"]["body"]["error"]
    assert too_long["message"].startswith("in.jsonl line 5: 302 tokens exceed") and too_long["param"] == "input[1]"
    assert "input.truncate: true" in too_long["message"]
    assert errors[2]["response"]["body"]["error"]["message"].startswith("line 6: HTTP 503")
    # Written twice, the files are the same (ids derive from the partition and the line).
    assert batch_files(labels, model="all-MiniLM-L6-v2", partition_key="in.jsonl", created=1) == (outputs, errors)


def test_shipped_task_loads_and_a_chat_model_is_refused_for_it(tmp_path: Path) -> None:
    task = load_task_spec(BUNDLED_TASKS_DIR / f"{TASK}.yaml")
    assert task.input.format == "openai_batch" and task.output.kind == "embedding" and task.output.pooling
    assert task.engine.model == "embedded:all-MiniLM-L6-v2"
    path = tmp_path / "vectors.yaml"
    path.write_text(
        "input: {format: openai_batch}\noutput: {kind: embedding}\nengine: {model: 'embedded:SmolLM2-135M-Instruct'}\n"
    )
    with pytest.raises(TaskSpecError, match=r"engine.model \(line 3\): embedded:SmolLM2-135M-Instruct is a chat model"):
        load_task_spec(path)


def test_the_cost_estimate_counts_no_generated_tokens(tokenizer) -> None:
    from batch_assets.pipeline.budget import estimate_cost
    from batch_assets.pipeline.task_formats import task_format

    formatted = format_embeddings(jsonl(embed_line("one", "A ferry."), embed_line("two", ["a", "b"])), tokenizer)
    estimate = estimate_cost(formatted, task_format(load_task_spec(BUNDLED_TASKS_DIR / f"{TASK}.yaml")))
    assert (estimate.rows_to_infer, estimate.prompt_tokens, estimate.max_generated_tokens) == (3, 11, 0)


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def as_vector(data: dict) -> np.ndarray:
    value = data["embedding"]
    if isinstance(value, str):
        return np.frombuffer(base64.b64decode(value), dtype="<f4")
    return np.asarray(value, dtype=np.float32)


@pytest.mark.slow
def test_batch_file_through_dagster_matches_vllm_run_batch(data_dir: Path, tmp_path: Path) -> None:
    sample = Path(__file__).resolve().parent.parent / "batch_assets" / "samples" / TASK / "requests-sample.jsonl"
    lines = [json.loads(line) for line in sample.read_text(encoding="utf-8").splitlines()]
    with dg.instance_for_test() as instance:
        key, result = materialize(data_dir, sample.name, sample.read_text(encoding="utf-8"), instance, TASK)
        checks = {e.check_name: e.passed for e in result.get_asset_check_evaluations()}
        assert checks["embeddings_are_valid"] and checks["one_row_per_record"], checks
    outputs = read_jsonl(data_dir / "storage" / TASK / "batch_output" / f"{key}.jsonl")
    errors = read_jsonl(data_dir / "storage" / TASK / "batch_errors" / f"{key}.jsonl")
    assert len(outputs) + len(errors) == len(lines)
    assert {e["custom_id"]: e["response"]["body"]["error"]["code"] for e in errors} == {
        "too-long": "input_too_long",
        "chat-line": "unsupported_url",
    }
    ours = {o["custom_id"]: o for o in outputs}
    assert list(ours) == [line["custom_id"] for line in lines if line["custom_id"] not in ("too-long", "chat-line")]
    assert [d["index"] for d in ours["bakery-and-router"]["response"]["body"]["data"]] == [0, 1]

    # The peer: vLLM's run-batch on the lines it answers (it stops at none of these; the too-long one
    # and the chat line would fail there too), the same model and engine settings as the task's.
    valid = [line for line in lines if line["custom_id"] in ours]
    peer = run_vllm_batch(valid, tmp_path, TASK, "all-MiniLM-L6-v2")
    assert set(peer) == set(ours)
    mine, theirs, counts = [], [], []
    for custom_id, record in ours.items():
        other = peer[custom_id]
        assert other["error"] is None and other["response"]["status_code"] == 200, other
        body, other_body = record["response"]["body"], other["response"]["body"]
        assert [d["index"] for d in body["data"]] == [d["index"] for d in other_body["data"]]
        mine += [as_vector(d) for d in body["data"]]
        theirs += [as_vector(d) for d in other_body["data"]]
        counts.append((body["usage"]["prompt_tokens"], other_body["usage"]["prompt_tokens"]))
    similarity = cosines(np.stack(mine), np.stack(theirs))
    print(f"min cosine vs run-batch: {similarity.min():.7f}")
    assert similarity.min() >= 0.9999, similarity
    assert all(a == b for a, b in counts), counts
