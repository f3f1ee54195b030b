"""What goes wrong with an endpoint's requests, and what it means for the run.

The client's final exception for a request (after its own retries) becomes a `RequestFailure`
(`classify_failure`): an error row (`endpoint_error`, `endpoint_timeout`, `endpoint_connection`),
or, when the endpoint as a whole is at fault (unreachable, refusing the key, no such model), a
failure of the run with what to change. `check_outcomes` fails the run when every request of a
batch failed without the server refusing each for its own content. The API key never appears in
a message (`redact`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

log = logging.getLogger(__name__)

# vLLM servers started without --api-key accept any bearer token; the client insists on one.
NO_KEY = "EMPTY"
# Statuses the client retries (see `openai._base_client._should_retry`); others fail at once.
RETRIED_STATUSES = frozenset({408, 409, 429})
# A request the server refused for what it holds (too long, malformed), not for how it is set up.
REFUSED_REQUEST_STATUSES = frozenset({400, 413, 422})


class EndpointError(RuntimeError):
    """The endpoint cannot serve this run at all (unreachable, misconfigured, refusing every request)."""


@dataclass(frozen=True)
class RequestFailure:
    """One request that failed: its error row, and the run's failure when the endpoint is at fault."""

    error: str  # the error row's text: "<code>: <message>"
    fatal: str | None = None  # set when the whole endpoint is at fault: fail the run with this
    status: int | None = None  # the HTTP status the server answered, if it answered


def redact(text: str, secret: str | None) -> str:
    if secret and secret != NO_KEY and len(secret) >= 4:
        text = text.replace(secret, "***")
    return text


def _cause_names(exc: BaseException) -> set[str]:
    names: set[str] = set()
    seen = exc.__cause__ or exc.__context__
    while seen is not None and len(names) < 10:
        names.add(type(seen).__name__)
        seen = seen.__cause__ or seen.__context__
    return names


def classify_failure(
    exc: Exception,
    *,
    base_url: str,
    model: str,
    timeout_s: float,
    max_retries: int,
    api_key: str | None,
    embeddings: bool = False,
) -> RequestFailure:
    """Turn the client's final exception (after its retries) into an error row or a run failure
    (`embeddings`: the request went to `/embeddings`, not `/chat/completions`)."""
    import openai

    where = f"{base_url} (model {model!r})"
    retried = f"gave up after {max_retries + 1} attempts"
    if isinstance(exc, openai.APIConnectionError):
        causes = _cause_names(exc)
        if causes & {"ConnectError", "ConnectTimeout"}:
            return RequestFailure(
                "endpoint_unreachable: cannot connect",
                fatal=f"cannot connect to the endpoint {where}: {retried}. Is the server running and "
                "is `engine.base_url` (or the `llm_endpoint` resource's base_url) right?",
            )
        if isinstance(exc, openai.APITimeoutError):
            return RequestFailure(f"endpoint_timeout: no response within {timeout_s:g} s; {retried}")
        detail = ", ".join(sorted(causes)) or type(exc).__name__
        return RequestFailure(f"endpoint_connection: the connection failed or was dropped ({detail}); {retried}")
    if isinstance(exc, openai.APIStatusError):
        status = exc.status_code
        message = redact(_status_message(exc), api_key)
        if status in (401, 403):
            return RequestFailure(
                f"endpoint_auth: HTTP {status}",
                fatal=f"the endpoint {where} refused the request with HTTP {status} ({message}): check the API key "
                "(`engine.api_key_env` names its environment variable, or the `llm_endpoint` resource's api_key)",
            )
        if status == 404:
            served = (
                "an embedding model served for embeddings (`vllm serve MODEL --runner pooling`; a chat model's "
                "server has no /embeddings)"
                if embeddings
                else "a chat model (an embedding model's server has no /chat/completions)"
            )
            return RequestFailure(
                "endpoint_not_found: HTTP 404",
                fatal=f"the endpoint {where} answered HTTP 404 ({message}): check that base_url ends with the API "
                f"prefix (usually /v1) and that `engine.model` is a model the server serves, {served}",
                status=status,
            )
        attempts = retried if status in RETRIED_STATUSES or status >= 500 else "not retried"
        if status == 400 and "logprob" in message.lower() and not embeddings:
            return RequestFailure(
                f"endpoint_error: HTTP 400: {message}",
                fatal=f"the endpoint {where} refuses `logprobs` ({message}): set `logprobs=False` on the "
                "`llm_endpoint` resource (labels then come without a confidence)",
                status=status,
            )
        return RequestFailure(f"endpoint_error: HTTP {status}: {message}; {attempts}", status=status)
    return RequestFailure(f"endpoint_error: {type(exc).__name__}: {redact(str(exc), api_key)[:200]}")


def _status_message(exc) -> str:
    body = getattr(exc, "body", None)
    if isinstance(body, dict):
        inner = body.get("error", body)
        text = inner.get("message") if isinstance(inner, dict) else inner
        if text:
            return " ".join(str(text).split())[:200]
    return " ".join(str(getattr(exc, "message", exc)).split())[:200]


def check_outcomes(base_url: str, outcomes: list) -> None:
    """Fail the run when the endpoint as a whole failed (a fatal error, or every request of the
    batch failed without the server refusing it); else log how many requests became error rows."""
    fatal = next((o.fatal for o in outcomes if isinstance(o, RequestFailure) and o.fatal), None)
    if fatal:
        raise EndpointError(fatal)
    failures = [o for o in outcomes if isinstance(o, RequestFailure)]
    if len(failures) == len(outcomes) and not _refused_for_themselves(failures):
        raise EndpointError(
            f"all {len(outcomes)} requests of this batch to {base_url} failed; the server is not "
            f"serving (first error: {failures[0].error}). Finished batches are checkpointed: re-run to resume."
        )
    if failures:
        log.warning(
            "%d of %d requests to %s failed after retries, e.g. %s",
            len(failures),
            len(outcomes),
            base_url,
            failures[0].error,
        )


def _refused_for_themselves(failures: list[RequestFailure]) -> bool:
    """Whether the server refused these requests each for its own content (a text too long: 400,
    413, 422), so they are error rows: a single request, or refusals that differ. The same refusal
    of every request of a batch is a setting (a field the server does not know, a model without a
    chat template, a smaller --max-model-len), which fails the run."""
    if not all(f.status in REFUSED_REQUEST_STATUSES for f in failures):
        return False
    return len(failures) == 1 or len({f.error for f in failures}) > 1
