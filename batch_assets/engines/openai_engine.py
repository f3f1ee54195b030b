"""The endpoint engine: prompts sent to an OpenAI-compatible server (chat completions, embeddings).

For teams that score against a shared `vllm serve` deployment or a managed (provisioned-throughput)
endpoint instead of running vLLM inside the job. A task opts in with `engine.kind: openai` in its
YAML; the `llm_endpoint` resource can set or override every endpoint setting for all such tasks
(e.g. `api_key=dg.EnvVar("MY_KEY")`). Outputs, columns, checks, checkpoints and resumption are the
same as with the in-process engine: only `generate` differs.

- Up to `concurrency` requests in flight (asyncio), so the server can batch them continuously.
- Retries with exponential backoff and jitter on 429, 408/409, 5xx, timeouts and dropped
  connections, honouring the server's `Retry-After`; after `max_retries` a request that still
  fails becomes an error row (`endpoint_error` / `endpoint_timeout` / `endpoint_connection`).
- A server that cannot be reached, refuses the key, or fails every request of a batch fails the
  run with a message that says so; finished batches are checkpointed, so a re-run resumes.
- Structured outputs the way vLLM's server takes them: choices and regex as vLLM's
  `structured_outputs` request field, JSON schemas as the standard `response_format`.
- Token counts come from the server's `usage`.
- Embedding and similarity tasks (`output.kind: embedding`, `output.method: similarity`) call
  `/v1/embeddings` instead: several texts per request (enough to keep `concurrency` requests
  busy), the vectors as the server returns them (vLLM's server pools and normalizes as its
  `LLM.embed` does, so they equal the in-process engine's). A text the local tokenizer cut
  (`input.truncate`) is sent with vLLM's `truncate_prompt_tokens`. A request the server refuses
  (HTTP 400) is sent again text by text, so only the text at fault becomes an error row.
- The API key is read from `api_key` (use `dg.EnvVar`) or the environment variable named by
  `engine.api_key_env`. It is never logged and never put in metadata or error messages.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import math
import os
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

import dagster as dg
from pydantic import Field

from batch_assets.engines.embedded_model import model_token_limit, resolve_model
from batch_assets.engines.engine_figures import EndpointFigures
from batch_assets.engines.tokenizers import load_tokenizer
from batch_assets.engines.vllm_args import output_vllm_args
from batch_assets.pipeline.engine_contract import Generation, Prompt, ResolvedSettings, batched_stream
from batch_assets.pipeline.task_spec import (
    EMBEDDED_EMBEDDING_MODEL,
    EMBEDDED_MODEL,
    OutputSpec,
    SamplingSpec,
    TaskSpec,
    check_base_url,
    resolve_lora,
)

log = logging.getLogger(__name__)

# vLLM servers started without --api-key accept any bearer token; the client insists on one.
NO_KEY = "EMPTY"
# Statuses the client retries (see `openai._base_client._should_retry`); others fail at once.
RETRIED_STATUSES = frozenset({408, 409, 429})
# A request the server refused for what it holds (too long, malformed), not for how it is set up.
REFUSED_REQUEST_STATUSES = frozenset({400, 413, 422})
# Texts per `/v1/embeddings` request at most (OpenAI takes 2048); fewer when a batch is small, so
# that it still fills `concurrency` requests.
MAX_TEXTS_PER_EMBEDDING_REQUEST = 64


class EndpointError(RuntimeError):
    """The endpoint cannot serve this run at all (unreachable, misconfigured, refusing every request)."""


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


@dataclass(frozen=True)
class _Failure:
    error: str  # the error row's text: "<code>: <message>"
    fatal: str | None = None  # set when the whole endpoint is at fault: fail the run with this
    status: int | None = None  # the HTTP status the server answered, if it answered


@dataclass(frozen=True)
class EmbeddingRequest:
    """One `/v1/embeddings` request: the positions of its texts in the batch, and the token count
    the server is to cut them to (vLLM's `truncate_prompt_tokens`), for texts cut locally."""

    positions: tuple[int, ...]
    truncate_to: int | None = None


def embedding_requests(
    lengths: Sequence[int], concurrency: int, max_model_len: int, most: int = MAX_TEXTS_PER_EMBEDDING_REQUEST
) -> list[EmbeddingRequest]:
    """A batch of texts (their local token counts) grouped into `/v1/embeddings` requests: as many
    texts per request as keep `concurrency` requests busy, at most `most`. Texts of `max_model_len`
    tokens (cut to it by `input.truncate`, or exactly that long) go in requests of their own that ask
    the server to cut them the same way; the others are sent as they are, which any server takes."""
    whole = [i for i, n in enumerate(lengths) if n < max_model_len]
    cut = [i for i, n in enumerate(lengths) if n >= max_model_len]
    size = max(1, min(most, math.ceil(len(lengths) / concurrency)))
    return [
        EmbeddingRequest(tuple(positions[start : start + size]), truncate_to)
        for positions, truncate_to in ((whole, None), (cut, max_model_len))
        for start in range(0, len(positions), size)
    ]


def response_vectors(response, count: int) -> list[list[float]]:
    """The vectors of an embeddings response in input order (by each entry's `index`); a response
    that does not hold exactly one vector of numbers per text raises ValueError."""
    data = sorted(response.data, key=lambda entry: entry.index)
    if [entry.index for entry in data] != list(range(count)):
        raise ValueError(f"the response has embeddings for indices {[e.index for e in data][:10]}, not 0..{count - 1}")
    vectors = [entry.embedding for entry in data]
    for vector in vectors:
        if not isinstance(vector, list) or not vector or not all(isinstance(v, int | float) for v in vector):
            raise ValueError("an embedding in the response is not a list of numbers")
    return vectors


def chat_request_params(
    task: TaskSpec,
    model: str,
    structured_outputs: bool = True,
    sampling: SamplingSpec | None = None,
    output: OutputSpec | None = None,
    logprobs: bool = True,
) -> dict:
    """The chat-completions request fields (besides `messages`) for a task, or for one request
    that overrides the task's `sampling` / `output`."""
    sampling = sampling or task.sampling
    # `max_tokens` rather than `max_completion_tokens`: vLLM takes both, but many other
    # OpenAI-compatible servers (TGI, llama.cpp, managed endpoints) only know `max_tokens`.
    params: dict = {
        "model": model,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "max_tokens": sampling.max_tokens,
    }
    if sampling.seed is not None:
        params["seed"] = sampling.seed
    stop = getattr(sampling, "stop", None)  # a request's own stop strings (an OpenAI batch line's `stop`)
    if stop:
        params["stop"] = list(stop)
    top_logprobs = getattr(sampling, "logprobs", None)  # an OpenAI batch line's own `logprobs` request
    if top_logprobs is not None:
        params["logprobs"], params["top_logprobs"] = True, top_logprobs
    output = output or task.output
    if not structured_outputs or output.kind == "text":
        return params
    if logprobs and output.has_confidence:
        params["logprobs"] = True  # the sampled tokens' log-probabilities: the label's confidence
    if output.kind == "json_schema":
        # The standard OpenAI field; vLLM's server turns it into its JSON structured output.
        params["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": task.name, "schema": output.json_schema},
        }
    elif output.kind == "choices":
        # vLLM's own request field (`guided_choice` in vLLM < 0.11): no OpenAI equivalent exists.
        params["extra_body"] = {"structured_outputs": {"choice": list(output.choices or [])}}
    elif output.kind == "regex":
        params["extra_body"] = {"structured_outputs": {"regex": output.regex}}
    return params


def _cumulative_logprob(choice) -> float | None:
    """The sum of the sampled tokens' log-probabilities, when the server returned them (a server
    may ignore `logprobs`, or return none for some tokens: then None, never a partial sum)."""
    tokens = getattr(choice.logprobs, "content", None) if choice.logprobs is not None else None
    if not tokens or any(token.logprob is None for token in tokens):
        return None
    return float(sum(token.logprob for token in tokens))


def token_logprobs_text(content: Sequence[dict] | None) -> str | None:
    """OpenAI's chat `logprobs.content` (its entries as dicts) as the JSON text of
    `Generation.token_logprobs`, each entry's fields in the order vLLM writes them; None for none."""
    if not content:
        return None

    def entry(token: dict) -> dict:
        return {"token": token["token"], "logprob": token["logprob"], "bytes": token.get("bytes")}

    entries = [{**entry(t), "top_logprobs": [entry(a) for a in t.get("top_logprobs") or []]} for t in content]
    return json.dumps(entries, ensure_ascii=False)


def _redact(text: str, secret: str | None) -> str:
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
) -> _Failure:
    """Turn the client's final exception (after its retries) into an error row or a run failure
    (`embeddings`: the request went to `/embeddings`, not `/chat/completions`)."""
    import openai

    where = f"{base_url} (model {model!r})"
    retried = f"gave up after {max_retries + 1} attempts"
    if isinstance(exc, openai.APIConnectionError):
        causes = _cause_names(exc)
        if causes & {"ConnectError", "ConnectTimeout"}:
            return _Failure(
                "endpoint_unreachable: cannot connect",
                fatal=f"cannot connect to the endpoint {where}: {retried}. Is the server running and "
                "is `engine.base_url` (or the `llm_endpoint` resource's base_url) right?",
            )
        if isinstance(exc, openai.APITimeoutError):
            return _Failure(f"endpoint_timeout: no response within {timeout_s:g} s; {retried}")
        detail = ", ".join(sorted(causes)) or type(exc).__name__
        return _Failure(f"endpoint_connection: the connection failed or was dropped ({detail}); {retried}")
    if isinstance(exc, openai.APIStatusError):
        status = exc.status_code
        message = _redact(_status_message(exc), api_key)
        if status in (401, 403):
            return _Failure(
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
            return _Failure(
                "endpoint_not_found: HTTP 404",
                fatal=f"the endpoint {where} answered HTTP 404 ({message}): check that base_url ends with the API "
                f"prefix (usually /v1) and that `engine.model` is a model the server serves, {served}",
                status=status,
            )
        attempts = retried if status in RETRIED_STATUSES or status >= 500 else "not retried"
        if status == 400 and "logprob" in message.lower() and not embeddings:
            return _Failure(
                f"endpoint_error: HTTP 400: {message}",
                fatal=f"the endpoint {where} refuses `logprobs` ({message}): set `logprobs=False` on the "
                "`llm_endpoint` resource (labels then come without a confidence)",
                status=status,
            )
        return _Failure(f"endpoint_error: HTTP {status}: {message}; {attempts}", status=status)
    return _Failure(f"endpoint_error: {type(exc).__name__}: {_redact(str(exc), api_key)[:200]}")


def _status_message(exc) -> str:
    body = getattr(exc, "body", None)
    if isinstance(body, dict):
        inner = body.get("error", body)
        text = inner.get("message") if isinstance(inner, dict) else inner
        if text:
            return " ".join(str(text).split())[:200]
    return " ".join(str(getattr(exc, "message", exc)).split())[:200]


def _run_coroutine(coroutine):
    """Run a coroutine to completion from synchronous code, even inside a running event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


_served_models: dict[str, str] = {}
_served_models_lock = threading.Lock()


class OpenAIEngine(dg.ConfigurableResource):
    """Runs prompts on an OpenAI-compatible chat-completions server (`vllm serve`, managed endpoints).

    Unset fields fall back to each task's `engine:` settings in its YAML. Set `api_key` with
    `dg.EnvVar("NAME")`, never as a literal.
    """

    base_url: str | None = Field(
        default=None, description="Server URL including the API prefix, e.g. http://host:8000/v1."
    )
    model: str | None = Field(
        default=None, description="Model name the server knows (else the task's, else the server's only model)."
    )
    api_key: str | None = Field(
        default=None, description="API key; set it with dg.EnvVar('NAME'). Else the task's engine.api_key_env."
    )
    concurrency: int | None = Field(default=None, description="Requests in flight at once.")
    request_timeout_s: float | None = Field(
        default=None, description="Seconds to wait for one response before retrying."
    )
    max_retries: int | None = Field(
        default=None, description="Retries on 429/5xx/timeouts/connection errors before a row fails."
    )
    max_model_len: int | None = Field(
        default=None, description="The served model's context length (for the too-long check)."
    )
    local_tokenizer: str | None = Field(
        default=None, description="Local tokenizer for prompt rendering and token counts."
    )
    structured_outputs: bool = Field(
        default=True, description="Send the task's choices/schema/regex constraint with each request."
    )
    logprobs: bool = Field(
        default=True,
        description=(
            "Ask for the sampled tokens' log-probabilities (the `confidence` of choices/regex labels); "
            "off for a server that refuses the `logprobs` field."
        ),
    )

    # Prompts for this engine carry their chat messages (`Prompt.messages`).
    sends_chat_messages: ClassVar[bool] = True

    def resolve(self, task: TaskSpec) -> ResolvedSettings:
        """The one place an endpoint decides a task's model and context. The model is this resource's
        `model`, else the task's `engine.model`, else (the embedded default left in place) the server's
        only model, asked when the run starts. BATCH_ASSETS_MODEL and BATCH_ASSETS_EMBEDDING_MODEL choose
        the in-process engine's model only: an endpoint is sent a name its server knows."""
        spec = task.engine
        from_server = not self.model and spec.model in (EMBEDDED_MODEL, EMBEDDED_EMBEDDING_MODEL)
        model, setting = (
            (self.model, "`model` of the endpoint resource")
            if self.model
            # The server's name is asked at the run; the default name stands for it until then.
            else (spec.model, "the server's only model (no `engine.model` set)")
            if from_server
            else (spec.model, f"`engine.model` in the task file of {task.name!r}")
        )
        return ResolvedSettings(
            kind="openai",
            model=model,
            model_setting=setting,
            model_from_server=from_server,
            max_model_len=self.max_model_len or spec.max_model_len,
            # Unused by an endpoint; kept, so its code versions stay what they were.
            vllm_args=output_vllm_args(spec.vllm_args),
            lora=resolve_lora(spec.lora) if spec.lora is not None else None,
        )

    def settings(self, task: TaskSpec, *, offline: bool = False) -> EndpointSettings:
        """`offline`: ask the server nothing (`batch-assets estimate`): a task that names no model is
        counted with the tokenizer its default model name gives."""
        spec, resolved = task.engine, self.resolve(task)
        base_url = self.base_url or spec.base_url
        if not base_url:
            raise EndpointError(
                f"task {task.name!r} uses an OpenAI-compatible endpoint but names no server: set `engine.base_url` "
                "in its YAML or `base_url` on the `llm_endpoint` resource"
            )
        check_base_url(base_url)
        base_url = base_url.rstrip("/")
        settings: dict[str, Any] = {
            "kind": "openai",
            "base_url": base_url,
            "max_model_len": resolved.max_model_len,
            "concurrency": self.concurrency or spec.concurrency,
            "request_timeout_s": self.request_timeout_s or spec.request_timeout_s,
            "max_retries": self.max_retries if self.max_retries is not None else spec.max_retries,
            "structured_outputs": self.structured_outputs,
            "logprobs": self.logprobs,
            "api_key_source": "resource" if self.api_key else f"env:{spec.api_key_env}" if spec.api_key_env else "none",
            "batch_size": spec.batch_size,
        }
        model = (
            self._served_model(task, base_url, settings["request_timeout_s"], settings["max_retries"])
            if resolved.model_from_server and not offline
            else resolved.model
        )
        tokenizer, tokenizer_note = self._tokenizer_source(task, model)
        if resolved.lora is not None:
            # The server serves the adapter under its name (`vllm serve --lora-modules NAME=...`); the
            # prompts are still rendered and counted with the base model's tokenizer (above).
            model = resolved.lora.name
        if task.output.pooling and not self.max_model_len and "max_model_len" not in spec.model_fields_set:
            # As in process: an embedding model takes what it was trained with (its tokenizer's folder
            # says so: 256 tokens for all-MiniLM-L6-v2), not the chat default.
            settings["max_model_len"] = model_token_limit(tokenizer) or settings["max_model_len"]
        return EndpointSettings(
            model=model, tokenizer=tokenizer, resolved=resolved, tokenizer_note=tokenizer_note, **settings
        )

    def tokenizer(self, settings: EndpointSettings):
        """A local tokenizer (no server call) for the prompt text and token counts."""
        return load_tokenizer(settings.tokenizer)

    @contextlib.contextmanager
    def session(
        self, task: TaskSpec, settings: EndpointSettings, log: Callable[[str], None] = lambda message: None
    ) -> Iterator[EndpointSession]:
        """Nothing to start: the server runs elsewhere; requests go in calls of `batch_size`."""
        yield EndpointSession(self, task, settings)

    def generate(
        self,
        task: TaskSpec,
        prompts: Sequence[Prompt],
        settings: EndpointSettings | None = None,
        figures: EndpointFigures | None = None,
    ) -> list[Generation]:
        """One chat completion per prompt (an embedding task: one vector per prompt, several texts
        per request), `concurrency` requests at a time; failed requests become error rows."""
        prompts = list(prompts)
        if not prompts:
            return []
        # What the engine sends: a chat task's messages, an embedding task's texts.
        sent, encoder = (
            ("text", "embeddings.embedding_encoder")
            if task.output.pooling
            else ("messages", "format_prompts.prompt_encoders")
        )
        if any(getattr(p, sent) is None for p in prompts):
            raise TypeError(
                f"the endpoint engine sends each prompt's {sent}: build its prompts with "
                f"batch_assets.pipeline.{encoder}, which fills `Prompt.{sent}`"
            )
        settings = settings or self.settings(task)
        api_key = self._api_key(task)
        if task.output.pooling:
            return self._embed(settings, api_key, prompts, figures)
        default = chat_request_params(task, settings.model, settings.structured_outputs, logprobs=settings.logprobs)
        params = [
            default
            if p.sampling is None and p.output is None
            else chat_request_params(
                task, settings.model, settings.structured_outputs, p.sampling, p.output, logprobs=settings.logprobs
            )
            for p in prompts
        ]
        calls = [_chat_call(prompt, p) for prompt, p in zip(prompts, params, strict=True)]
        outcomes = _run_coroutine(self._gather(settings, api_key, calls, figures=figures))
        _check_outcomes(settings, outcomes)
        tokenizer = None
        results = []
        for prompt, outcome in zip(prompts, outcomes, strict=True):
            if isinstance(outcome, _Failure):
                results.append(
                    Generation(
                        text=None,
                        finish_reason=None,
                        num_prompt_tokens=len(prompt),
                        num_generated_tokens=0,
                        error=outcome.error,
                    )
                )
                continue
            text, finish_reason, usage, cumulative_logprob, token_logprobs = outcome
            prompt_tokens = getattr(usage, "prompt_tokens", None)
            generated_tokens = getattr(usage, "completion_tokens", None)
            if generated_tokens is None:  # a server without `usage`: count locally
                tokenizer = tokenizer or self.tokenizer(settings)
                generated_tokens = len(tokenizer(text, add_special_tokens=False)["input_ids"])
            results.append(
                Generation(
                    text=text,
                    finish_reason=finish_reason,
                    num_prompt_tokens=prompt_tokens if prompt_tokens is not None else len(prompt),
                    num_generated_tokens=generated_tokens,
                    cumulative_logprob=cumulative_logprob,
                    token_logprobs=token_logprobs,
                )
            )
        return results

    def _embed(
        self, settings: EndpointSettings, api_key: str, prompts: list[Prompt], figures: EndpointFigures | None = None
    ) -> list[Generation]:
        """`/v1/embeddings` for an embedding or similarity task: the prompts' texts, several per request
        (`embedding_requests`); a request the server refused (HTTP 400) is sent again text by text."""
        texts = [p.text for p in prompts]

        def send(requests: list[EmbeddingRequest]) -> list[tuple[EmbeddingRequest, Any]]:
            calls = [_embedding_call(settings.model, [texts[i] for i in r.positions], r) for r in requests]
            return list(
                zip(requests, _run_coroutine(self._gather(settings, api_key, calls, True, figures)), strict=True)
            )

        results = send(embedding_requests([len(p) for p in prompts], settings.concurrency, settings.max_model_len))
        refused = [r for r, o in results if isinstance(o, _Failure) and o.status == 400 and len(r.positions) > 1]
        if refused:  # one text at fault fails its whole request: find it
            alone = [EmbeddingRequest((i,), r.truncate_to) for r in refused for i in r.positions]
            results = [(r, o) for r, o in results if r not in refused] + send(alone)
        outcomes: list = [None] * len(prompts)
        for request, outcome in results:
            vectors = [outcome] * len(request.positions) if isinstance(outcome, _Failure) else outcome
            for position, vector in zip(request.positions, vectors, strict=True):
                outcomes[position] = vector
        _check_outcomes(settings, outcomes)
        return [
            Generation(
                text=None, finish_reason=None, num_prompt_tokens=len(prompt), num_generated_tokens=0, error=o.error
            )
            if isinstance(o, _Failure)
            # The local count, the model's special tokens included, as in process: a request's `usage`
            # counts all of its texts together.
            else Generation(
                text=None,
                vector=tuple(o),
                finish_reason=None,
                num_prompt_tokens=len(prompt),
                num_generated_tokens=0,
            )
            for prompt, o in zip(prompts, outcomes, strict=True)
        ]

    async def _gather(
        self,
        settings: EndpointSettings,
        api_key: str,
        calls: list[Callable[[Any], Awaitable[Any]]],
        embeddings: bool = False,
        figures: EndpointFigures | None = None,
    ) -> list:
        """Each call's outcome (or the `_Failure` it raised), `concurrency` calls in flight; once the
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
                        return _Failure("endpoint_error: not sent, the endpoint failed", fatal=None)
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
                        return _Failure(
                            f"endpoint_error: unreadable response ({type(exc).__name__}): "
                            f"{_redact(str(exc), api_key)[:200]}"
                        )
                    finally:
                        counted.call_done(time.monotonic() - started)

            return await asyncio.gather(*(one(call) for call in calls))

    def _api_key(self, task: TaskSpec) -> str:
        if self.api_key:
            return self.api_key
        name = task.engine.api_key_env
        if name:
            value = os.environ.get(name)
            if not value:
                raise EndpointError(
                    f"task {task.name!r}: engine.api_key_env names {name}, "
                    "which is not set in this process's environment"
                )
            return value
        return NO_KEY

    def _served_model(self, task: TaskSpec, base_url: str, timeout: float, retries: int) -> str:
        """The server's only model, asked once per process (vLLM serves one model per server)."""
        import openai

        with _served_models_lock:
            if base_url in _served_models:
                return _served_models[base_url]
            api_key = self._api_key(task)
            try:
                with openai.OpenAI(
                    base_url=base_url, api_key=api_key, timeout=min(timeout, 30.0), max_retries=retries
                ) as client:
                    served = [model.id for model in client.models.list().data]
            except openai.APIError as exc:
                failure = classify_failure(
                    exc,
                    base_url=base_url,
                    model="(any)",
                    timeout_s=min(timeout, 30.0),
                    max_retries=retries,
                    api_key=api_key,
                )
                raise EndpointError(
                    f"task {task.name!r} names no `engine.model`, "
                    f"and asking {base_url}/models for the served model failed: "
                    f"{failure.fatal or failure.error}"
                ) from None
            if len(served) != 1:
                raise EndpointError(
                    f"task {task.name!r} names no `engine.model` and {base_url} serves {len(served)} models "
                    f"({', '.join(served[:10])}): set `engine.model` in the task YAML"
                )
            _served_models[base_url] = served[0]
            return served[0]

    def _tokenizer_source(self, task: TaskSpec, model: str) -> tuple[str, str | None]:
        """The local tokenizer that renders and counts the task's prompts, and, when it is not the
        served model's own, the warning that says so (formatted_prompts logs it on every run)."""
        explicit = self.local_tokenizer or task.engine.tokenizer
        if explicit:
            return resolve_model(explicit), None
        local = os.path.expanduser(model)
        if os.path.isdir(local):
            return os.path.abspath(local), None
        # An embedding task's texts are counted with the embedded embedding model's tokenizer.
        fallback = EMBEDDED_EMBEDDING_MODEL if task.output.pooling else EMBEDDED_MODEL
        note = (
            f"task {task.name}: no local tokenizer for the endpoint's model {model!r}; rendering prompts and counting "
            f"tokens with the tokenizer of {fallback}, so `prompt`, the token counts and the too-long check are "
            "approximate (the server applies its own tokenizer"
            f"{'' if task.output.pooling else ' and chat template; its token counts are reported'}). "
            "Set `engine.tokenizer` to fix."
        )
        return resolve_model(fallback), note


def _chat_call(prompt: Prompt, params: dict) -> Callable[[Any], Awaitable[Any]]:
    async def call(client):
        assert prompt.messages is not None  # generate() refuses prompts without messages
        response = await client.chat.completions.create(
            # plain role/content dicts: the client's message TypedDicts are stricter
            messages=list(prompt.messages),
            **params,
        )
        if not response.choices or response.choices[0].message.content is None:
            return _Failure("endpoint_error: the response has no message content")
        choice = response.choices[0]
        # The tokens themselves only for a request that asked for them (a batch line's `top_logprobs`).
        content = getattr(choice.logprobs, "content", None) if "top_logprobs" in params else None
        tokens = token_logprobs_text([token.model_dump() for token in content] if content else None)
        return (choice.message.content, choice.finish_reason, response.usage, _cumulative_logprob(choice), tokens)

    return call


def _embedding_call(model: str, texts: list, request: EmbeddingRequest) -> Callable[[Any], Awaitable[Any]]:
    async def call(client):
        # vLLM's own field: sent only for texts cut locally, so other servers get plain requests.
        extra = {"extra_body": {"truncate_prompt_tokens": request.truncate_to}} if request.truncate_to else {}
        response = await client.embeddings.create(model=model, input=texts, encoding_format="float", **extra)
        return response_vectors(response, len(texts))

    return call


def _check_outcomes(settings: EndpointSettings, outcomes: list) -> None:
    """Fail the run when the endpoint as a whole failed (a fatal error, or every request of the
    batch failed without the server refusing it); else log how many requests became error rows."""
    fatal = next((o.fatal for o in outcomes if isinstance(o, _Failure) and o.fatal), None)
    if fatal:
        raise EndpointError(fatal)
    failures = [o for o in outcomes if isinstance(o, _Failure)]
    if len(failures) == len(outcomes) and not _refused_for_themselves(failures):
        raise EndpointError(
            f"all {len(outcomes)} requests of this batch to {settings.base_url} failed; the server is not "
            f"serving (first error: {failures[0].error}). Finished batches are checkpointed: re-run to resume."
        )
    if failures:
        log.warning(
            "%d of %d requests to %s failed after retries, e.g. %s",
            len(failures),
            len(outcomes),
            settings.base_url,
            failures[0].error,
        )


def _refused_for_themselves(failures: list[_Failure]) -> bool:
    """Whether the server refused these requests each for its own content (a text too long: 400,
    413, 422), so they are error rows: a single request, or refusals that differ. The same refusal
    of every request of a batch is a setting (a field the server does not know, a model without a
    chat template, a smaller --max-model-len), which fails the run."""
    if not all(f.status in REFUSED_REQUEST_STATUSES for f in failures):
        return False
    return len(failures) == 1 or len({f.error for f in failures}) > 1


class EndpointSession:
    """An endpoint needs no start: `started_here` is always False."""

    started_here = False
    start_seconds = 0.0

    def __init__(self, engine: OpenAIEngine, task: TaskSpec, settings: EndpointSettings) -> None:
        self.figures = EndpointFigures()
        self._stream = batched_stream(
            lambda prompts: engine.generate(task, prompts, settings, self.figures), settings.batch_size
        )

    def start(self, requests: int = 0) -> None:
        pass

    @property
    def metadata(self) -> dict[str, Any]:
        return {"engine_started_by_this_run": False, **self.figures.metadata()}

    def stream(self, prompts: Iterable[Prompt]) -> Iterator[tuple[int, Generation]]:
        return self._stream(prompts)
