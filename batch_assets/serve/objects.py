"""OpenAI's shapes for what `batch-assets serve` answers: file and batch objects, lists, errors.

File and batch objects are built with the `openai` SDK's own models (`FileObject`, `Batch`,
`BatchRequestCounts`, `BatchUsage`), which check each field as OpenAI's API has it, so any OpenAI
client reads them.
"""

from __future__ import annotations

import time
from typing import Any, get_args

from openai.types import Batch, BatchRequestCounts, BatchUsage, FileObject
from openai.types.batch_usage import InputTokensDetails, OutputTokensDetails
from pydantic import BaseModel, ConfigDict, Field

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
COMPLETION_WINDOW = "24h"  # the only window OpenAI accepts
WINDOW_SECONDS = 24 * 3600
# A batch that is in one of these has no more to do.
FINISHED = ("completed", "failed", "expired", "cancelled")
# The rest of the statuses the SDK's Batch model allows: those the runner still has work for.
UNFINISHED = tuple(status for status in get_args(Batch.model_fields["status"].annotation) if status not in FINISHED)


class CreateBatch(BaseModel):
    """The body of `POST /v1/batches`; `output_expires_after` sets its output files' lifetime; other
    fields OpenAI added since are accepted and have no effect here."""

    model_config = ConfigDict(extra="allow")

    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = Field(default=None)


def api_error(message: str, *, code: str | None = None, param: str | None = None, kind: str = "") -> dict[str, Any]:
    """OpenAI's error body."""
    return {"error": {"message": message, "type": kind or "invalid_request_error", "param": param, "code": code}}


# The lifetimes `expires_after` (an upload) and `output_expires_after` (a batch) may ask for, as OpenAI's.
EXPIRY_RANGE = (3600, 30 * 86_400)


def file_object(file_id: str, filename: str, size: int, purpose: str, expires_in: int | None = None) -> dict[str, Any]:
    """`expires_in`: seconds from now until the file is deleted (None: kept until deleted)."""
    now = int(time.time())
    return FileObject(
        id=file_id,
        object="file",
        bytes=size,
        created_at=now,
        filename=filename,
        purpose=purpose,  # type: ignore[arg-type]  # "batch" or "batch_output": the SDK's Literal checks it
        status="processed",
        expires_at=None if expires_in is None else now + expires_in,
    ).model_dump(mode="json")


def expiry_seconds(anchor: object, seconds: object, param: str) -> int:
    """The seconds of an `expires_after` ({"anchor": "created_at", "seconds": N}); `ValueError`
    (message, param) when OpenAI would refuse it."""
    low, high = EXPIRY_RANGE
    if anchor != "created_at":
        raise ValueError(f"{param}[anchor] must be 'created_at', not {anchor!r}", f"{param}[anchor]")
    try:
        number = int(str(seconds))
    except ValueError:
        number = -1
    if not low <= number <= high:
        raise ValueError(f"{param}[seconds] must be a whole number from {low} to {high}, not {seconds!r}", param)
    return number


def batch_object(batch_id: str, request: CreateBatch) -> dict[str, Any]:
    now = int(time.time())
    return Batch(
        id=batch_id,
        object="batch",
        endpoint=request.endpoint,
        input_file_id=request.input_file_id,
        completion_window=request.completion_window,
        status="validating",
        created_at=now,
        expires_at=now + WINDOW_SECONDS,
        request_counts=BatchRequestCounts(total=0, completed=0, failed=0),
        metadata=request.metadata,
    ).model_dump(mode="json")


def batch_errors(code: str, message: str, *, line: int | None = None, param: str | None = None) -> dict[str, Any]:
    """The `errors` of a batch that failed as a whole."""
    return {"object": "list", "data": [{"code": code, "message": message, "param": param, "line": line}]}


def create_problem(request: CreateBatch) -> tuple[str, str] | None:
    """(message, param) when a batch cannot be created as asked, as OpenAI refuses it."""
    if request.endpoint not in ENDPOINTS:
        return f"endpoint must be one of {', '.join(ENDPOINTS)}, not {request.endpoint!r}", "endpoint"
    if request.completion_window != COMPLETION_WINDOW:
        return f"completion_window must be {COMPLETION_WINDOW!r}", "completion_window"
    metadata = request.metadata or {}
    if len(metadata) > 16 or any(len(key) > 64 or len(value) > 512 for key, value in metadata.items()):
        return "metadata: at most 16 pairs, keys of at most 64 characters, values of at most 512", "metadata"
    try:
        output_expiry(request)
    except ValueError as exc:
        return exc.args[0], exc.args[1]
    return None


def output_expiry(request: CreateBatch) -> int | None:
    """The seconds the batch's output and error files are kept, when `output_expires_after` asks."""
    asked = (request.model_extra or {}).get("output_expires_after")
    if asked is None:
        return None
    if not isinstance(asked, dict):
        raise ValueError("output_expires_after must be {'anchor': 'created_at', 'seconds': N}", "output_expires_after")
    return expiry_seconds(asked.get("anchor"), asked.get("seconds"), "output_expires_after")


def usage(outputs: list[dict[str, Any]]) -> dict[str, Any]:
    """A batch's token counts, summed over its output lines' response bodies."""
    prompt = completion = 0
    for line in outputs:
        counts = ((line.get("response") or {}).get("body") or {}).get("usage") or {}
        prompt += int(counts.get("prompt_tokens") or 0)
        completion += int(counts.get("completion_tokens") or 0)
    return BatchUsage(
        input_tokens=prompt,
        input_tokens_details=InputTokensDetails(cached_tokens=0),
        output_tokens=completion,
        output_tokens_details=OutputTokensDetails(reasoning_tokens=0),
        total_tokens=prompt + completion,
    ).model_dump(mode="json")


def page(objects: list[dict[str, Any]], after: str | None, limit: int) -> dict[str, Any]:
    """One page of a list, newest first, after the object `after` (cursor pagination as OpenAI's)."""
    if after is not None:
        ids = [obj["id"] for obj in objects]
        objects = objects[ids.index(after) + 1 :] if after in ids else []
    data = objects[:limit]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": len(objects) > limit,
    }
