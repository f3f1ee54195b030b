"""How every S3 request is made: retries and timeouts, from the environment.

Retries follow `AWS_RETRY_MODE` / `AWS_MAX_ATTEMPTS` (default: standard mode, 5 attempts per
request). Every request is bounded: `BATCH_ASSETS_S3_CONNECT_TIMEOUT` (default 10 s) to connect,
`BATCH_ASSETS_S3_READ_TIMEOUT` (default 60 s) of silence while waiting for an answer. s3fs retries
timeouts 5 times on top of botocore's attempts, so an endpoint that never answers fails a call after
at most about 5 × AWS_MAX_ATTEMPTS × the read timeout, with an error naming the endpoint and these
settings (errors.py reads them back for that message, which is why they live apart from
locations.py: locations reports its failures through errors.py).
"""

from __future__ import annotations

import os

DEFAULT_MAX_ATTEMPTS = 5
CONNECT_TIMEOUT_ENV = "BATCH_ASSETS_S3_CONNECT_TIMEOUT"
READ_TIMEOUT_ENV = "BATCH_ASSETS_S3_READ_TIMEOUT"
DEFAULT_CONNECT_TIMEOUT = 10.0
DEFAULT_READ_TIMEOUT = 60.0


def _seconds_setting(name: str, default: float) -> float:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise ValueError(f"{name}={raw!r}: must be a number of seconds greater than 0 (default {default:g})")
    return value


def s3_timeouts() -> tuple[float, float]:
    """(connect, read) timeouts in seconds for every S3 request."""
    return (
        _seconds_setting(CONNECT_TIMEOUT_ENV, DEFAULT_CONNECT_TIMEOUT),
        _seconds_setting(READ_TIMEOUT_ENV, DEFAULT_READ_TIMEOUT),
    )


def s3_storage_options() -> dict:
    """s3fs options: no listing cache (a long-lived sensor must see new objects) and retries.

    Transient failures (throttling, 5xx, dropped connections, timeouts) are retried by botocore
    with backoff; s3fs retries `SlowDown` and timeouts on top. Every request is bounded by the
    connect and read timeouts (see `s3_session` for the one wait aiohttp would otherwise leave
    open). Nothing here names a credential: botocore finds those.
    """
    from batch_assets.storage.s3_session import BoundedAIOHTTPSession

    connect_timeout, read_timeout = s3_timeouts()
    options: dict = {
        "use_listings_cache": False,
        "config_kwargs": {
            "retries": {
                "mode": os.environ.get("AWS_RETRY_MODE") or "standard",
                "max_attempts": int(os.environ.get("AWS_MAX_ATTEMPTS") or DEFAULT_MAX_ATTEMPTS),
            },
            "connect_timeout": connect_timeout,
            "read_timeout": read_timeout,
            "http_session_cls": BoundedAIOHTTPSession,
        },
    }
    # botocore reads these itself; naming the endpoint here as well gives each endpoint its own
    # cached filesystem (fsspec caches instances by their options).
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        options["endpoint_url"] = endpoint
    return options
