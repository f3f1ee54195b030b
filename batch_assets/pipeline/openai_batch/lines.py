"""An OpenAI batch request file → raw_prompts rows: one row per line (an embeddings line: one per
text, `input_index` its place in `body.input`), a line that cannot be answered an error row
(protocol.py lists the codes). Only a file that is not `.jsonl` (or `.jsonl.gz`), or a broken gzip
file, raises `DropFileError`."""

from __future__ import annotations

import json
from typing import Any

import polars as pl

from batch_assets.pipeline.inputs.images import DIGEST_COLUMN
from batch_assets.pipeline.inputs.read_prompts import DropFileError, gunzip, input_suffix
from batch_assets.pipeline.openai_batch.body import parse_body
from batch_assets.pipeline.openai_batch.protocol import (
    IMAGE_SCHEMA,
    INVALID_CUSTOM_ID,
    RAW_SCHEMA,
    SUPPORTED_URLS,
    LineError,
    json_text,
    kind_of,
    line_error,
)
from batch_assets.pipeline.task_spec.input import ImageLimits


def read_batch_requests(data: bytes, file_name: str, images: ImageLimits | None = None) -> pl.DataFrame:
    """Parse an OpenAI batch request file into raw_prompts rows (one per line, an embeddings line one
    per text); `images`: the task's limits on its lines' images (`input.images`)."""
    limits = images or ImageLimits()
    suffix = input_suffix(file_name)
    if suffix not in (".jsonl", ".jsonl.gz"):
        raise DropFileError(
            f"{file_name}: an openai_batch task reads .jsonl (or .jsonl.gz) files in the OpenAI Batch API format"
        )
    if suffix == ".jsonl.gz":
        data = gunzip(data, file_name)
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]
    rows: list[dict] = []
    first_line_of: dict[str, int] = {}
    lines = data.split(b"\n") if data.strip() else []
    if lines and not lines[-1]:
        lines.pop()
    for index, raw_line in enumerate(lines):
        number = index + 1
        row: dict[str, Any] = {"row_id": len(rows), "source_line": number}
        texts = None
        try:
            texts = _parse_line(raw_line.removesuffix(b"\r"), row, first_line_of, limits)
        except LineError as exc:
            row["error"] = line_error(exc.code, file_name, number, str(exc))
        if texts is None:
            rows.append(row)
            continue
        # An embeddings line: one row per text (its own vector, deduplicated and cached as any text).
        for position, text in enumerate(texts):
            rows.append({**row, "row_id": len(rows), "input": text, "input_index": position})
    with_images = any(DIGEST_COLUMN in row for row in rows)
    return pl.DataFrame(rows, schema={**RAW_SCHEMA, **IMAGE_SCHEMA} if with_images else RAW_SCHEMA)


def _parse_line(raw_line: bytes, row: dict, first_line_of: dict[str, int], limits: ImageLimits) -> list[str] | None:
    """Fill `row` from the line (raising its `LineError`); an embeddings line's texts are returned."""
    try:
        text = raw_line.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise LineError("invalid_utf8", f"byte {exc.start + 1} of the line is not UTF-8 ({exc.reason})") from None
    if not text.strip():
        raise LineError("empty_record", "blank line")
    try:
        request = json.loads(text)
    except json.JSONDecodeError as exc:
        raise LineError("malformed_json", f"{exc.msg} at column {exc.colno}") from None
    except (ValueError, RecursionError) as exc:
        raise LineError("malformed_json", str(exc) or type(exc).__name__) from None
    if not isinstance(request, dict):
        raise LineError("not_an_object", f"{kind_of(request)}, not a JSON object")
    custom_id = request.get("custom_id")
    if isinstance(custom_id, str) and custom_id:
        row["custom_id"] = custom_id
        if custom_id in first_line_of:
            raise LineError(
                "duplicate_custom_id", f"custom_id {custom_id!r} was used first on line {first_line_of[custom_id]}"
            )
        first_line_of[custom_id] = row["source_line"]
    elif "custom_id" not in request:
        raise LineError("missing_custom_id", "the line has no custom_id")
    else:
        # Kept as the line gave it, so its error line can echo it for the client to match.
        row["custom_id"] = json.dumps(custom_id, ensure_ascii=False)
        given = "an empty string" if custom_id == "" else kind_of(custom_id)
        if isinstance(custom_id, int | float) and not isinstance(custom_id, bool):
            given = f"the number {json_text(custom_id)}"
        raise LineError(INVALID_CUSTOM_ID, f"custom_id is {given}; it must be a non-empty string")
    method, url, body = request.get("method"), request.get("url"), request.get("body")
    row["method"] = method if isinstance(method, str) else None
    row["url"] = url if isinstance(url, str) else None
    if method != "POST":
        raise LineError("unsupported_method", f'method {method!r} is not supported; use "POST"')
    if url not in SUPPORTED_URLS:
        raise LineError("unsupported_url", f"url {url!r} is not supported; use one of {', '.join(SUPPORTED_URLS)}")
    if not isinstance(body, dict):
        raise LineError(
            "invalid_body",
            f"body is {kind_of(body)}, not a JSON object" if "body" in request else "the line has no body",
        )
    return parse_body(body, url, row, limits)
