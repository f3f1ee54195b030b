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

import contextlib
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, ClassVar

import dagster as dg
from pydantic import Field

from batch_assets.engines.embedded_model import model_token_limit, resolve_model
from batch_assets.engines.endpoint_client import (
    EndpointSettings,
    chat_call,
    embedding_call,
    gather_calls,
    run_coroutine,
)
from batch_assets.engines.endpoint_failures import (
    NO_KEY,
    EndpointError,
    RequestFailure,
    check_outcomes,
    classify_failure,
)
from batch_assets.engines.endpoint_requests import EmbeddingRequest, chat_request_params, embedding_requests
from batch_assets.engines.engine_figures import EndpointFigures
from batch_assets.engines.tokenizers import load_tokenizer
from batch_assets.engines.vllm_args import output_vllm_args
from batch_assets.pipeline.engine_contract import Generation, Prompt, ResolvedSettings, batched_stream
from batch_assets.pipeline.task_spec import (
    EMBEDDED_EMBEDDING_MODEL,
    EMBEDDED_MODEL,
    TaskSpec,
    check_base_url,
    resolve_lora,
)

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
        api_key = self.api_key_for(task)
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
        calls = [chat_call(prompt, p) for prompt, p in zip(prompts, params, strict=True)]
        outcomes = run_coroutine(gather_calls(settings, api_key, calls, figures=figures))
        check_outcomes(settings.base_url, outcomes)
        tokenizer = None
        results = []
        for prompt, outcome in zip(prompts, outcomes, strict=True):
            if isinstance(outcome, RequestFailure):
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
            calls = [embedding_call(settings.model, [texts[i] for i in r.positions], r) for r in requests]
            return list(
                zip(requests, run_coroutine(gather_calls(settings, api_key, calls, True, figures)), strict=True)
            )

        results = send(embedding_requests([len(p) for p in prompts], settings.concurrency, settings.max_model_len))
        refused = [r for r, o in results if isinstance(o, RequestFailure) and o.status == 400 and len(r.positions) > 1]
        if refused:  # one text at fault fails its whole request: find it
            alone = [EmbeddingRequest((i,), r.truncate_to) for r in refused for i in r.positions]
            results = [(r, o) for r, o in results if r not in refused] + send(alone)
        outcomes: list = [None] * len(prompts)
        for request, outcome in results:
            vectors = [outcome] * len(request.positions) if isinstance(outcome, RequestFailure) else outcome
            for position, vector in zip(request.positions, vectors, strict=True):
                outcomes[position] = vector
        check_outcomes(settings.base_url, outcomes)
        return [
            Generation(
                text=None, finish_reason=None, num_prompt_tokens=len(prompt), num_generated_tokens=0, error=o.error
            )
            if isinstance(o, RequestFailure)
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

    def api_key_for(self, task: TaskSpec) -> str:
        """The key sent to the server: this resource's `api_key`, else the variable the task's
        `engine.api_key_env` names, else a placeholder (a server without a key takes any)."""
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
            api_key = self.api_key_for(task)
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
