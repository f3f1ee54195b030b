"""Storage failures as one readable error: which URL, what went wrong, what to check.

s3fs and botocore raise many shapes of exception (translated `OSError`s with a `ClientError`
behind them, `EndpointConnectionError`, timeouts). `storage_errors(action, path)` turns any of
them into a `StorageError` whose message names the URL and the cause, for the run's failure event
and the sensor's tick. Messages never carry credentials: secret values from the environment and
`user:password@` parts of URLs are replaced with `***`.
"""

from __future__ import annotations

import errno
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import urlsplit

from batch_assets.storage.s3_settings import CONNECT_TIMEOUT_ENV, READ_TIMEOUT_ENV, s3_timeouts

_SECRET_ENV_VARS = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_ACCESS_KEY_ID")
_URL_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)[^/@\s]+@")

_NO_BUCKET = {"NoSuchBucket"}
_DENIED = {
    "AccessDenied",
    "AllAccessDisabled",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "InvalidToken",
    "AccountProblem",
    "403",
    "Forbidden",
}
_THROTTLED = {
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "RequestLimitExceeded",
    "TooManyRequests",
    "TooManyRequestsException",
    "ServiceUnavailable",
    "503",
}
_STORAGE_EXCEPTION_MODULES = ("botocore", "aiobotocore", "aiohttp", "s3fs", "fsspec", "urllib3")


class StorageError(RuntimeError):
    """Reading or writing the drop zone or the output storage failed; the message says where and why.
    `errno`: the OS error's number behind it, when there was one (a full disk: ENOSPC)."""

    def __init__(self, message: str, errno: int | None = None) -> None:
        super().__init__(message)
        self.errno = errno


def scrub(text: str) -> str:
    """`text` without credentials: no `user:password@` in URLs, no secret from the AWS variables."""
    text = _URL_USERINFO.sub(r"\g<scheme>***@", text)
    for name in _SECRET_ENV_VARS:
        value = os.environ.get(name)
        # Very short values (test dummies like "x") would mangle ordinary words; real keys are long.
        if value and len(value) >= 8:
            text = text.replace(value, "***")
    return text


def exception_chain(exc: BaseException) -> Iterator[BaseException]:
    """The exception, then what it was raised from or while handling, outermost first."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _endpoint_of(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.hostname}{':' + str(parts.port) if parts.port else ''}" if parts.hostname else url


def describe(exc: BaseException) -> str:
    """A short cause for a storage exception: the S3 error code and message, or what failed."""
    from botocore.exceptions import (
        ClientError,
        ConnectTimeoutError,
        EndpointConnectionError,
        NoCredentialsError,
        ReadTimeoutError,
    )

    for cause in exception_chain(exc):
        if isinstance(cause, ClientError):
            error = cause.response.get("Error", {})
            code = str(error.get("Code") or "")
            message = str(error.get("Message") or "").strip()
            status = cause.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            detail = f"{code}: {message}" if message else code
            if code in _NO_BUCKET:
                return f"the bucket does not exist ({detail})"
            if code in _DENIED or status == 403:
                return (
                    f"access denied ({detail}); check the credentials (AWS_ACCESS_KEY_ID / AWS_PROFILE) "
                    "and the bucket's policy"
                )
            if code in _THROTTLED or status in (429, 503):
                return f"the server kept throttling requests ({detail}), still failing after retries"
            if code in ("NoSuchKey", "404"):
                return f"no such object ({detail})"
            return f"{detail or type(cause).__name__} (HTTP {status})"
        if isinstance(cause, ConnectTimeoutError | ReadTimeoutError):
            return _timeout_text(cause, connecting=isinstance(cause, ConnectTimeoutError))
        if isinstance(cause, EndpointConnectionError):
            endpoint = _endpoint_of(str(cause.kwargs.get("endpoint_url", "")))
            return (
                f"could not connect to the S3 endpoint {endpoint}, still failing after retries "
                "(is AWS_ENDPOINT_URL right and the server up?)"
            )
        if isinstance(cause, NoCredentialsError):
            return "no AWS credentials found (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE)"
    for cause in exception_chain(exc):
        if isinstance(cause, OSError) and cause.errno in _FULL_OR_READ_ONLY:
            return _FULL_OR_READ_ONLY[cause.errno]
    if isinstance(exc, PermissionError):
        return f"permission denied ({exc.strerror or exc})"
    if isinstance(exc, FileNotFoundError):
        return "not found"
    text = str(exc).strip()
    if isinstance(exc, OSError) and exc.errno is not None and not (exc.strerror or "").strip():
        # e.g. `OSError(28, "")` from a writer that drops the reason: say what the number means.
        text = f"[Errno {exc.errno}] {os.strerror(exc.errno)}"
    return f"{type(exc).__name__}: {text}" if text else f"{type(exc).__name__} (no reason given)"


# Conditions of the storage itself; the folder is named by `storage_error`.
_FULL_OR_READ_ONLY = {
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "the file system is read-only",
}


def _timeout_text(cause: BaseException, *, connecting: bool) -> str:
    endpoint = _endpoint_of(str(getattr(cause, "kwargs", {}).get("endpoint_url", ""))) or "(unknown)"
    connect_timeout: float | None
    read_timeout: float | None
    try:
        connect_timeout, read_timeout = s3_timeouts()
    except ValueError:
        connect_timeout = read_timeout = None
    if connecting:
        what, seconds, setting = "did not accept a connection within", connect_timeout, CONNECT_TIMEOUT_ENV
    else:
        what, seconds, setting = "accepted the connection but did not answer within", read_timeout, READ_TIMEOUT_ENV
    limit = f"{seconds:g} s" if seconds is not None else "the timeout"
    return (
        f"the S3 endpoint {endpoint} {what} {limit}, still failing after retries "
        f"(is AWS_ENDPOINT_URL right and the server healthy? the wait is {setting}, the attempts AWS_MAX_ATTEMPTS)"
    )


def is_storage_exception(exc: BaseException) -> bool:
    """Errors of the storage layer (I/O, S3, HTTP), as opposed to bugs or bad data."""
    return isinstance(exc, OSError | TimeoutError) or any(
        type(cause).__module__.split(".")[0] in _STORAGE_EXCEPTION_MODULES for cause in exception_chain(exc)
    )


def storage_error(action: str, url: object, exc: BaseException) -> StorageError:
    reason = describe(exc)
    if reason in _FULL_OR_READ_ONLY.values():
        folder = str(url).rstrip("/").rsplit("/", 1)[0] or str(url)
        reason += f" in {folder}: free space there (or make it writable), or point BATCH_ASSETS_DATA at other storage"
    number = next((cause.errno for cause in exception_chain(exc) if isinstance(cause, OSError) and cause.errno), None)
    return StorageError(scrub(f"{action} {url} failed: {reason}"), errno=number)


@contextmanager
def storage_errors(action: str, url: object) -> Iterator[None]:
    """Re-raise storage failures inside the block as a `StorageError` naming `url` and the cause."""
    try:
        yield
    except StorageError:
        raise
    except Exception as exc:
        if not is_storage_exception(exc):
            raise
        # `from None`: the chained botocore exception adds nothing the message lacks, and its
        # text is not scrubbed.
        raise storage_error(action, url, exc) from None
