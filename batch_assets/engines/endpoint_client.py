"""How the endpoint engine talks to its server: the resolved settings of the connection, the calls
in flight (`concurrency` at once through the official `openai` client, which retries them; every
attempt counted in `EndpointFigures`), and one chat-completions or embeddings call.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from batch_assets.engines.endpoint_failures import RequestFailure, classify_failure, redact
from batch_assets.engines.endpoint_requests import (
    EmbeddingRequest,
    cumulative_logprob,
    response_vectors,
    token_logprobs_text,
)
from batch_assets.engines.engine_figures import EndpointFigures
from batch_assets.pipeline.engine_contract import Prompt, ResolvedSettings


@dataclass(frozen=True)
class EndpointSettings:
    """Fully resolved endpoint settings. No secrets: this goes into materialization metadata."""

    kind: str
    base_url: str
    model: str
    max_model_len: int
    concurrency: int
    request_timeout_s: float
    max_retries: int
    tokenizer: str
    structured_outputs: bool
    logprobs: bool  # ask for the sampled tokens' log-probabilities (choices/regex tasks)
    api_key_source: str  # where the key comes from ("resource", "env:NAME", "none"), never its value
    batch_size: int = 1024  # requests per call (each call's results are checkpointed)
    resolved: ResolvedSettings = field(kw_only=True, compare=False)  # what it was made from
    # Why the prompt texts and token counts are approximate (no local tokenizer of the served model:
    # another model's renders and counts them); None: the served model's own tokenizer.
    tokenizer_note: str | None = field(default=None, kw_only=True, compare=False)

    def identity(self) -> dict[str, Any]:
        """What decides the outputs besides sampling and the output constraint: the model and the
        server it is served from."""
        identity = {"engine": "openai", "model": self.model, "base_url": self.base_url}
        if self.resolved.lora is not None:  # absent otherwise, so other tasks keep their fingerprints
            identity["lora"] = self.resolved.lora.identity
        return identity

    def metadata(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if k not in ("model", "resolved", "tokenizer_note")}


def run_coroutine(coroutine):
    """Run a coroutine to completion from synchronous code, even inside a running event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


async def gather_calls(
    settings: EndpointSettings,
    api_key: str,
    calls: list[Callable[[Any], Awaitable[Any]]],
    embeddings: bool = False,
    figures: EndpointFigures | None = None,
) -> list:
    """Each call's outcome (or the `RequestFailure` it raised), `concurrency` calls in flight; once the
    endpoint as a whole has failed, what is left is not sent."""
    # The official `openai` client (installed with vLLM, kept in step with the API): typed
    # responses, auth, and a tested retry policy (exponential backoff with jitter, Retry-After,
    # one idempotency key across attempts) that we would otherwise re-implement.
    import openai

    gate = asyncio.Semaphore(settings.concurrency)
    stop = asyncio.Event()  # set once the endpoint as a whole has failed: skip what is left
    counted = figures or EndpointFigures()

    async def on_request(_request) -> None:
        counted.attempt()

    async def on_response(response) -> None:
        counted.response(response.status_code)

    # The client's own HTTP client (its defaults), with hooks that see every attempt, retries included.
    http_client = openai.DefaultAsyncHttpxClient(event_hooks={"request": [on_request], "response": [on_response]})
    async with openai.AsyncOpenAI(
        base_url=settings.base_url,
        api_key=api_key,
        timeout=settings.request_timeout_s,
        max_retries=settings.max_retries,
        http_client=http_client,
    ) as client:

        async def one(call: Callable[[Any], Awaitable[Any]]):
            async with gate:
                if stop.is_set():
                    return RequestFailure("endpoint_error: not sent, the endpoint failed", fatal=None)
                started = time.monotonic()
                try:
                    return await call(client)
                except openai.APIError as exc:
                    failure = classify_failure(
                        exc,
                        base_url=settings.base_url,
                        model=settings.model,
                        timeout_s=settings.request_timeout_s,
                        max_retries=settings.max_retries,
                        api_key=api_key,
                        embeddings=embeddings,
                    )
                    if failure.fatal:
                        stop.set()
                    return failure
                except Exception as exc:  # e.g. a reply that is not a chat completion: this request only
                    return RequestFailure(
                        f"endpoint_error: unreadable response ({type(exc).__name__}): {redact(str(exc), api_key)[:200]}"
                    )
                finally:
                    counted.call_done(time.monotonic() - started)

        return await asyncio.gather(*(one(call) for call in calls))


def chat_call(prompt: Prompt, params: dict) -> Callable[[Any], Awaitable[Any]]:
    async def call(client):
        assert prompt.messages is not None  # generate() refuses prompts without messages
        response = await client.chat.completions.create(
            # plain role/content dicts: the client's message TypedDicts are stricter
            messages=list(prompt.messages),
            **params,
        )
        if not response.choices or response.choices[0].message.content is None:
            return RequestFailure("endpoint_error: the response has no message content")
        choice = response.choices[0]
        # The tokens themselves only for a request that asked for them (a batch line's `top_logprobs`).
        content = getattr(choice.logprobs, "content", None) if "top_logprobs" in params else None
        tokens = token_logprobs_text([token.model_dump() for token in content] if content else None)
        return (choice.message.content, choice.finish_reason, response.usage, cumulative_logprob(choice), tokens)

    return call


def embedding_call(model: str, texts: list, request: EmbeddingRequest) -> Callable[[Any], Awaitable[Any]]:
    async def call(client):
        # vLLM's own field: sent only for texts cut locally, so other servers get plain requests.
        extra = {"extra_body": {"truncate_prompt_tokens": request.truncate_to}} if request.truncate_to else {}
        response = await client.embeddings.create(model=model, input=texts, encoding_format="float", **extra)
        return response_vectors(response, len(texts))

    return call
