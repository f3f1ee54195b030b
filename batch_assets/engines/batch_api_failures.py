"""What goes wrong with a provider's batches, in the words a user acts on: a refusal of the whole
run naming the setting to change (`BatchApiError`), lines of a file the provider refused by number
(`Refused`), a batch given up on past its window (`Expired`), the error row of a request no batch
answered (`unanswered_error`), and which exceptions stop a run rather than fail it (`is_stop`).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

from batch_assets.engines.batch_api_files import refused_lines
from batch_assets.engines.endpoint_client import EndpointSettings
from batch_assets.engines.endpoint_failures import EndpointError, classify_failure, redact


class BatchApiError(EndpointError):
    """The batch API cannot serve this run (refused key, quota, unreachable); the message names the setting."""


def is_stop(error: BaseException) -> bool:
    """Whether `error` stops the run: Dagster's terminate inside a step (its
    `DagsterExecutionInterruptedError`, raised from the polling sleep), Ctrl-C and SIGTERM
    (KeyboardInterrupt, runtime/interrupts.py), SystemExit. Not an ordinary failure, whose batches
    are kept for the retry to collect, nor a consumer that closed the stream (GeneratorExit)."""
    return not isinstance(error, Exception | GeneratorExit)


class Refused(Exception):
    """A file the provider refused for the lines it named (numbered from 1), with its words."""

    def __init__(self, lines: set[int], detail: str, message: str) -> None:
        super().__init__(message)
        self.lines, self.detail, self.message = lines, detail, message


def batch_api_failure(action: str, exc, settings: EndpointSettings, task_name: str, api_key: str) -> Exception:
    """The client's exception when it tried to `action`: a `BatchApiError` naming the setting, or a
    `Refused` for a 400 that names lines of the file."""
    import openai

    s, key = settings, api_key
    where = f"{s.base_url} (task {task_name!r})"
    status = getattr(exc, "status_code", None)
    detail = redact(str(getattr(exc, "message", exc)), key)[:300]
    if status == 400 and (lines := refused_lines(None, detail)):
        return Refused(lines, detail, f"the batch API at {where} refused to {action}: {detail}")
    if status == 429:
        return BatchApiError(
            f"the batch API at {where} refused to {action} with HTTP 429 after {s.max_retries + 1} attempts "
            f"({detail}): a rate limit or the provider's batch quota (enqueued tokens). Nothing more was "
            "submitted and kept batches stay kept: re-run later, raise `engine.max_retries`, or lower "
            "`engine.max_requests_per_file`"
        )
    if isinstance(exc, openai.APIStatusError) and status not in (401, 403, 404):
        return BatchApiError(
            f"the batch API at {where} refused to {action} with HTTP {status}: {detail}. Check "
            "`engine.model` and the request settings (and `engine.max_bytes_per_file` for a file too large)"
        )
    failure = classify_failure(
        exc,
        base_url=s.base_url,
        model=s.model,
        timeout_s=s.request_timeout_s,
        max_retries=s.max_retries,
        api_key=key,
    )
    return BatchApiError(f"cannot {action}: {failure.fatal or failure.error}")


@dataclass(frozen=True)
class Expired:
    """A batch the run gave up on past its window (`BatchRun._past_window`), collected as expired: with
    the files the provider gave it, if any."""

    id: str
    output_file_id: str | None
    error_file_id: str | None
    expires_at: float
    status: str = "expired"


# A completion window as providers write it: "24h", "7d", "30m".
_WINDOW = re.compile(r"^\s*(\d+)\s*([smhd])\s*$")
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def expires_at(batch, completion_window: str) -> float:
    """When the provider's window for `batch` ends: its `expires_at`, else its `created_at` plus its
    completion window (the task's when the provider names none it can read)."""
    if getattr(batch, "expires_at", None):
        return float(batch.expires_at)
    match = _WINDOW.match(getattr(batch, "completion_window", None) or "") or _WINDOW.match(completion_window)
    window = int(match[1]) * _UNIT_SECONDS[match[2]] if match else 24 * 3600
    return float(batch.created_at) + window


def unanswered_error(batch) -> str:
    if isinstance(batch, Expired):
        ended = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(batch.expires_at))
        return (
            f"batch_expired: batch {batch.id} was not finished by the end of its window ({ended}) plus "
            "engine.expiry_grace_seconds; the run cancelled it before this request was run"
        )
    if batch.status in ("expired", "cancelled"):
        return f"batch_{batch.status}: batch {batch.id} {batch.status} before this request was run"
    return f"batch_missing: batch {batch.id} completed without an output or error line for this request"
