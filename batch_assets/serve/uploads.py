"""`POST /v1/files`: the multipart body read with a size limit, and the file checked before anything is stored.

The body is counted as it arrives and refused (413) past the limit, whatever Content-Length says
(or leaves out), so a client cannot fill the disk; Starlette's multipart parser then spools the one
file part, which is copied to the store a chunk at a time (never held whole in memory) and checked
there before it gets an id: the files kept, this one with them, fit in the server's quota
(`--max-stored-mb`, counted as it arrives), `purpose` is `batch`, the file is not empty, not
compressed, has at most `max_requests` lines and at least one line that is a JSON object (a PNG or a
CSV is refused with the reason). Bad lines among good ones are not refused here: the batch answers
each with an error line, as the `openai_batch` task does.
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from pathlib import Path

from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import Request

from batch_assets.serve.objects import expiry_seconds
from batch_assets.serve.settings import UploadLimits

# The part is copied to disk, and the stored file checked, this much at a time.
_CHUNK = 1024 * 1024
# Room for the multipart boundaries and the `purpose` field around the file.
_MULTIPART_SLACK = 64 * 1024


class UploadRefused(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


@dataclass(frozen=True)
class Upload:
    filename: str
    purpose: str
    size: int
    expires_in: int | None  # seconds, when `expires_after` asks (else the server's retention)


def _too_large(limits: UploadLimits) -> UploadRefused:
    megabytes = limits.max_bytes / 1024 / 1024
    return UploadRefused(
        413,
        f"the file is larger than this server's limit of {megabytes:g} MB (batch-assets serve --max-file-mb)",
        "file",
        "file_too_large",
    )


async def _limited(request: Request, limits: UploadLimits) -> AsyncGenerator[bytes, None]:
    received = 0
    async for chunk in request.stream():
        received += len(chunk)
        if received > limits.max_bytes + _MULTIPART_SLACK:
            raise _too_large(limits)
        yield chunk


def _over_quota(limits: UploadLimits, stored: int) -> UploadRefused:
    megabytes, kept = limits.max_stored_bytes / 1024 / 1024, stored / 1024 / 1024
    return UploadRefused(
        400,
        f"the files this server keeps ({kept:.1f} MB) and this one would pass its quota of {megabytes:g} MB "
        "(batch-assets serve --max-stored-mb): delete files (DELETE /v1/files/{id}) or wait for them to expire",
        "file",
        "storage_quota_exceeded",
    )


async def read_upload(request: Request, limits: UploadLimits, into: Path, stored: int = 0) -> Upload:
    """The upload's file copied to `into` and checked there; `UploadRefused` says why not (and
    `into` is removed). `stored`: the bytes of the files kept already (the quota's share used)."""
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise UploadRefused(400, "upload the file as multipart/form-data with fields `file` and `purpose`")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limits.max_bytes + _MULTIPART_SLACK:
        raise _too_large(limits)
    parser = MultiPartParser(request.headers, _limited(request, limits), max_files=1, max_fields=8)
    try:
        form = await parser.parse()
    except MultiPartException as exc:
        raise UploadRefused(400, f"the multipart body cannot be read: {exc.message}") from None
    part, purpose = form.get("file"), form.get("purpose")
    if not isinstance(part, UploadFile):
        raise UploadRefused(400, "the `file` field is missing", "file")
    if purpose != "batch":
        raise UploadRefused(400, f"purpose must be 'batch' (this server runs batches), not {purpose!r}", "purpose")
    expires_in = _expires_after(form.get("expires_after[anchor]"), form.get("expires_after[seconds]"))
    # Only the name's last part is kept, for display: the file is stored under its id.
    filename = os.path.basename((part.filename or "upload.jsonl").replace("\\", "/"))[:255] or "upload.jsonl"
    try:
        size = await _copy(part, into, limits, stored)
        check_batch_file(into, filename, limits)
    except BaseException:
        into.unlink(missing_ok=True)
        raise
    finally:
        await part.close()
    return Upload(filename, purpose, size, expires_in)


def _expires_after(anchor: object, seconds: object) -> int | None:
    """OpenAI's `expires_after` as multipart fields (`expires_after[anchor]`, `expires_after[seconds]`)."""
    if anchor is None and seconds is None:
        return None
    try:
        return expiry_seconds(anchor, seconds, "expires_after")
    except ValueError as exc:
        raise UploadRefused(400, exc.args[0], exc.args[1], "invalid_value") from None


async def _copy(part: UploadFile, into: Path, limits: UploadLimits, stored: int) -> int:
    """The spooled part written to `into` a chunk at a time (never whole in memory); its size."""
    size = 0
    with into.open("wb") as out:
        while chunk := await part.read(_CHUNK):
            size += len(chunk)
            if size > limits.max_bytes:
                raise _too_large(limits)
            if stored + size > limits.max_stored_bytes:
                raise _over_quota(limits, stored)
            out.write(chunk)
    return size


def check_batch_file(path: Path, filename: str, limits: UploadLimits) -> None:
    """The stored file's checks, reading it a chunk (and for the JSON check, a line) at a time."""
    with path.open("rb") as file:
        first = file.read(2)
    if first == b"\x1f\x8b":
        raise UploadRefused(400, f"{filename} is gzip-compressed; upload the .jsonl itself", "file", "invalid_file")
    lines, blank = scan_lines(path)
    if blank:
        raise UploadRefused(400, f"{filename} is empty", "file", "empty_file")
    if lines > limits.max_requests:
        raise UploadRefused(
            400,
            f"{filename} has {lines} lines; a batch file may have at most {limits.max_requests} "
            "(batch-assets serve --max-requests)",
            "file",
            "too_many_requests",
        )
    with path.open("rb") as file:
        if not any(_is_object(line) for line in file):
            raise UploadRefused(
                400,
                f"{filename}: no line is a JSON object; a batch file has one request per line, "
                '{"custom_id": ..., "method": "POST", "url": ..., "body": {...}}',
                "file",
                "invalid_file",
            )


def scan_lines(path: Path) -> tuple[int, bool]:
    """A file's lines (a last one without a newline counted) and whether it is blank, read a chunk
    at a time: a batch file is never held whole in memory."""
    lines, blank, last = 0, True, b""
    with path.open("rb") as file:
        while chunk := file.read(_CHUNK):
            lines += chunk.count(b"\n")
            blank = blank and not chunk.strip()
            last = chunk
    return lines + (bool(last) and not last.endswith(b"\n")), blank


def _is_object(line: bytes) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False
