"""OpenAI Batch API files out: validated rows, then one output or error line per input line.

Pure functions, no storage. `validate_batch_outputs` is validated_labels for batch requests:
`label` is the answer's text, checked against the line's own `response_format` (a JSON answer
must parse and match its schema; a miss is an `invalid_json` / `schema_mismatch` error on the row,
and the answer still goes to the output file, as OpenAI returns it with status 200).

`validate_batch_embeddings` is the same for a task whose `output.kind` is embedding (one row per
text of a `/v1/embeddings` line, with its `embedding`).

`batch_files` splits the rows into the two files of OpenAI's batch API:

    batch_output   one line per answered request, in input order:
                   {"id", "custom_id", "response": {"status_code": 200, "request_id",
                    "body": <chat.completion or text_completion>}, "error": null}
                   (a chat line that asked for `logprobs`: its choice's `logprobs` is
                    {"content": [{"token", "logprob", "bytes", "top_logprobs"}, ...]}, as
                    vLLM's run-batch writes it)
                   (embeddings: "body": {"object": "list", "data": [{"object": "embedding",
                    "index", "embedding"}, ...], "model", "usage": {"prompt_tokens",
                    "total_tokens"}}, one `data` entry per text of the line, the vectors as
                    floats or, with `encoding_format: base64`, base64 of little-endian float32)
    batch_errors   one line per input line that got no answer (bad line, prompt too long,
                   engine error), as OpenAI writes a request that failed with an HTTP error:
                   {"id", "custom_id", "response": {"status_code": 400 (the request's fault) or
                    500 (the engine's), "request_id", "body": {"error": {"message" (naming the
                    file and line), "type", "param", "code"}}}, "error": null}

`custom_id` is the line's as given: null when it has none, a number when it wrote one (refused as
`invalid_custom_id`, echoed so the client can still match it). `error` stays null, as in OpenAI's
files, where it is kept for failures without an HTTP answer. Every input line is in exactly one of
the two files. Ids are derived from the partition and the line, so writing the files again gives
the same ids.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re

import polars as pl

from batch_assets.pipeline.embeddings.results import validate_embeddings
from batch_assets.pipeline.openai_batch.protocol import (
    COMPLETIONS_URL,
    EMBEDDING_COLUMNS,
    GENERATION_COLUMNS,
    INVALID_CUSTOM_ID,
    REQUEST_ERROR_CODES,
)
from batch_assets.pipeline.result_stores import encode_vector
from batch_assets.pipeline.task_spec import schema_error

_CODE = re.compile(r"^([a-z_]+): (.*)$", re.DOTALL)
# The first body field a message names (`body.messages[0].content`), as OpenAI's `param`.
_PARAM = re.compile(r"\bbody\.([A-Za-z_]\w*(?:\[\d+\])*(?:\.[A-Za-z_]\w*(?:\[\d+\])*)*)")


def validate_batch_outputs(outputs: pl.DataFrame) -> pl.DataFrame:
    """inference_outputs → validated_labels for batch requests (every column kept, `label` added)."""
    labels: list[str | None] = []
    errors: list[str | None] = []
    columns = ("generated_text", "finish_reason", "response_format", "error", "source_line")
    for text, finish_reason, response_format, error, line in zip(*(outputs[c] for c in columns), strict=True):
        if error is None and text is None:
            error = f"no_output: line {line}: the engine returned no text"
        if error is not None:
            labels.append(None)
            errors.append(error)
            continue
        kind = json.loads(response_format)["type"] if response_format else "text"
        if kind in ("choice", "regex"):
            # The engine's structured output holds the text to the choices or the pattern; only an
            # answer cut at max_tokens can fall outside them.
            spec = json.loads(response_format)
            fits = text in spec["choice"] if kind == "choice" else re.fullmatch(spec["regex"], text) is not None
            labels.append(text if fits else None)
            errors.append(None if fits else f"invalid_label: line {line}: {text!r} is not one of the line's {kind}")
            continue
        if kind == "text":
            labels.append(text)
            errors.append(None)
            continue
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            hint = " (truncated at max_tokens: raise the line's max_tokens)" if finish_reason == "length" else ""
            labels.append(None)
            errors.append(f"invalid_json: line {line}: {exc.msg} (column {exc.colno}){hint}")
            continue
        schema = json.loads(response_format).get("json_schema", {}).get("schema") or {"type": "object"}
        mismatch = schema_error(value, schema)
        labels.append(None if mismatch else text)
        errors.append(f"{mismatch.split(': ', 1)[0]}: line {line}: {mismatch.split(': ', 1)[1]}" if mismatch else None)
    frame = outputs.with_columns(
        pl.Series("label", labels, dtype=pl.String), pl.Series("error", errors, dtype=pl.String)
    )
    trailing = ["label", "generated_text", "finish_reason", "num_prompt_tokens", "num_generated_tokens", "error"]
    # A line's log-probabilities are written out from `token_logprobs` (kept); embeddings lines have
    # no place in a task that writes text.
    dropped = {"prompt", "request_params", "cumulative_logprob", *EMBEDDING_COLUMNS}
    middle = [c for c in frame.columns if c not in trailing and c not in dropped and c not in ("row_id", "source_line")]
    return frame.select("row_id", "source_line", *middle, *trailing)


def validate_batch_embeddings(outputs: pl.DataFrame) -> pl.DataFrame:
    """inference_outputs → validated_labels for the `/v1/embeddings` lines of an embedding task: an
    embedding task's table (`embedding`, `num_prompt_tokens`, `error`, every other column kept)
    without the columns only chat and completion lines fill."""
    labels = validate_embeddings(outputs)
    return labels.drop([c for c in GENERATION_COLUMNS if c in labels.columns])


def _short_id(prefix: str, *parts: object) -> str:
    digest = hashlib.sha256("\x00".join(str(p) for p in parts).encode("utf-8")).hexdigest()[:24]
    return f"{prefix}{digest}"


def _response_body(row: dict, *, model: str, created: int, partition_key: str) -> dict:
    prompt_tokens = row["num_prompt_tokens"] or 0
    completion_tokens = row["num_generated_tokens"] or 0
    usage = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if row["url"] == COMPLETIONS_URL:
        choice = {"index": 0, "text": row["generated_text"], "logprobs": None, "finish_reason": row["finish_reason"]}
        kind, prefix = "text_completion", "cmpl-"
    else:
        message = {"role": "assistant", "content": row["generated_text"], "refusal": None}
        # A line that asked for `logprobs`: OpenAI's `{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}`.
        logprobs = {"content": json.loads(row["token_logprobs"])} if row.get("token_logprobs") else None
        choice = {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": row["finish_reason"]}
        kind, prefix = "chat.completion", "chatcmpl-"
    return {
        "id": _short_id(prefix, partition_key, row["row_id"]),
        "object": kind,
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": usage,
    }


def error_object(error: str, line: int) -> dict:
    """`code: message` as the error object of OpenAI's API: `{"message", "type", "param", "code"}`;
    the message always names the line."""
    match = _CODE.match(error)
    code, message = (match.group(1), match.group(2)) if match else ("error", error)
    if f"line {line}" not in message:
        message = f"line {line}: {message}"
    param = _PARAM.search(message)
    return {
        "message": message,
        "type": "invalid_request_error" if code in REQUEST_ERROR_CODES else "server_error",
        "param": param.group(1) if param else ("custom_id" if code == INVALID_CUSTOM_ID else None),
        "code": code,
    }


def _custom_id_as_given(row: dict, code: str) -> object:
    """The line's custom_id as the client wrote it (a refused one is kept as its JSON text)."""
    if code != INVALID_CUSTOM_ID or row["custom_id"] is None:
        return row["custom_id"]
    value = json.loads(row["custom_id"])
    try:
        json.dumps(value, allow_nan=False)
    except ValueError:
        # NaN or Infinity, alone or inside a list or object, is not JSON: strict readers of the
        # error file would reject the line, so the value stays the text the client wrote.
        return row["custom_id"]
    return value


def batch_files(labels: pl.DataFrame, *, model: str, partition_key: str, created: int) -> tuple[list[dict], list[dict]]:
    """(batch_output records, batch_errors records) of a partition's validated rows, in input order.

    A row with an answer goes to the output file (its `error`, if any, is about the answer's
    format and stays in the parquet); a row without one goes to the error file.
    """
    if "embedding" in labels.columns:
        return _embedding_batch_files(labels, model=model, partition_key=partition_key)
    outputs: list[dict] = []
    errors: list[dict] = []
    previous_line = None
    for row in labels.iter_rows(named=True):
        if row["source_line"] == previous_line:
            continue  # another text of an embeddings line (an error line here), reported with its first
        previous_line = row["source_line"]
        line_id = _short_id("batch_req_", partition_key, row["row_id"])
        request_id = _short_id("req_", partition_key, row["row_id"])
        if row["generated_text"] is not None:
            body = _response_body(row, model=model, created=created, partition_key=partition_key)
            response = {"status_code": 200, "request_id": request_id, "body": body}
            outputs.append({"id": line_id, "custom_id": row["custom_id"], "response": response, "error": None})
        else:
            error = error_object(row["error"] or "no_output: the engine returned no text", row["source_line"])
            errors.append(_error_line(row, error, line_id, request_id))
    return outputs, errors


def _error_line(row: dict, error: dict, line_id: str, request_id: str) -> dict:
    """The error file's line for an input line: the HTTP answer of a failed request (400: the
    request's fault, 500: the engine's), its error in the body."""
    status = 400 if error["type"] == "invalid_request_error" else 500
    response = {"status_code": status, "request_id": request_id, "body": {"error": error}}
    return {"id": line_id, "custom_id": _custom_id_as_given(row, error["code"]), "response": response, "error": None}


def _embedding_batch_files(labels: pl.DataFrame, *, model: str, partition_key: str) -> tuple[list[dict], list[dict]]:
    """The batch files of an embedding task: one line per input line (its rows, one per text of
    `body.input`, share its `source_line`); a line with a text that got no vector is an error line,
    as OpenAI fails a request with one bad input."""
    outputs: list[dict] = []
    errors: list[dict] = []
    for _, group in itertools.groupby(labels.iter_rows(named=True), key=lambda row: row["source_line"]):
        rows = list(group)
        first = rows[0]
        line_id = _short_id("batch_req_", partition_key, first["row_id"])
        request_id = _short_id("req_", partition_key, first["row_id"])
        failed = next((row for row in rows if row["embedding"] is None), None)
        if failed is not None:
            error = error_object(failed["error"] or "no_output: the engine returned no embedding", first["source_line"])
            if error["param"] is None and error["code"] in ("input_too_long", "empty_text"):
                error["param"] = "input" if len(rows) == 1 else f"input[{failed['input_index']}]"
            errors.append(_error_line(failed, error, line_id, request_id))
            continue
        tokens = sum(row["num_prompt_tokens"] or 0 for row in rows)
        body = {
            "object": "list",
            "data": [
                {
                    "object": "embedding",
                    "index": row["input_index"],
                    "embedding": encode_vector(row["embedding"])
                    if row["encoding_format"] == "base64"
                    else row["embedding"],
                }
                for row in rows
            ],
            "model": model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
        response = {"status_code": 200, "request_id": request_id, "body": body}
        outputs.append({"id": line_id, "custom_id": first["custom_id"], "response": response, "error": None})
    return outputs, errors


def jsonl_bytes(records: list[dict]) -> bytes:
    return "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records).encode("utf-8")
