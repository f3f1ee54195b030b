"""The engine contract: what the inference step asks of every engine, owned by the core.

`run_inference` and the OpenAI batch format build `Prompt`s and read `Generation`s; the engines
(`batch_assets/engines/`) implement `Engine` and `EngineSession`. The contract sits here, below
both, so the core never imports an engine and an engine never needs more of the core than this
and the task spec. Which engine serves a task is decided elsewhere (`engines/kinds.py`).

An engine offers (see `Engine`):

    resolve(task)         `ResolvedSettings`: what this engine makes of the task's YAML, its own
                          resource fields and the environment (the model above all). The one place
                          each engine kind decides them: code versions, checks and the CLI read it.
    settings(task)        the resolved settings on this machine: `.resolved`, `.model` (what the
                          engine loads or sends), `.max_model_len`, `.identity()` (what decides the
                          outputs, for the checkpoint fingerprint), `.metadata()` and
                          `.tokenizer_note` (why token counts are approximate, if they are)
    tokenizer(settings)   a local Hugging Face tokenizer: renders the chat prompt, counts tokens
    session(task, settings, log)  a context manager that starts the engine (or connects) on entry and
                          tears down on exit; start failures raise `EngineStartError` with a hint
    session.stream(ps)    `(position, Generation)` for each `Prompt`, in the order they finish; a
                          failed request may come back as a `Generation` with an `error`
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from batch_assets.pipeline.task_spec import OutputSpec, ResolvedLora, SamplingSpec, TaskSpec


@dataclass(frozen=True)
class Generation:
    text: str | None  # None for an embedding, whose result is `vector`
    finish_reason: str | None
    num_prompt_tokens: int
    num_generated_tokens: int
    # Sum of the log-probabilities of the generated tokens, from the distribution the engine sampled
    # from (the output constraint applied), when the request asked for them and the engine returned them.
    cumulative_logprob: float | None = None
    # Set when the engine gave up on this request (e.g. an endpoint failing after its retries):
    # the row becomes an error row instead of failing the partition.
    error: str | None = None
    # An embedding engine's result: the vector as the model returned it (float32 values). The core
    # encodes it for the result stores (`pipeline/embeddings.encode_vector`), one place for every engine.
    vector: tuple[float, ...] | None = None
    # OpenAI's chat `logprobs.content` as JSON text (each generated token, its log-probability, bytes
    # and `top_logprobs`), when the request itself asked for them (an OpenAI batch line's `logprobs`).
    token_logprobs: str | None = None


@dataclass(frozen=True)
class Prompt:
    """One request: the rendered prompt's token ids (what an in-process engine runs), the chat
    messages it was rendered from (what an endpoint is sent; None when the engine does not need
    them), optional per-request overrides of the task's sampling and output constraint, and, for
    an embedding, the text itself (what an endpoint's `/v1/embeddings` is sent). `key`: the
    request's name, the same in every run (its `request_key`, set by run_inference), for an engine
    that must find a request again in a later run (the batch API's `custom_id`)."""

    token_ids: tuple[int, ...]
    messages: tuple[dict[str, Any], ...] | None = None
    sampling: SamplingSpec | None = None
    output: OutputSpec | None = None
    text: str | None = None
    key: str | None = None
    # An image task's images (encoded bytes, one per image field): the in-process engine hands them
    # to the model's processor with the ids, whose image placeholder tokens say where they go.
    images: tuple[bytes, ...] = ()

    def __len__(self) -> int:
        return len(self.token_ids)


def keys_of(texts: Sequence[str], keys: Sequence[str] | None) -> Sequence[str | None]:
    """The `Prompt.key` of each text an encoder is given: `keys` (run_inference passes each
    request's), else None for each (a caller that needs no key)."""
    return [None] * len(texts) if keys is None else keys


class EngineStartError(RuntimeError):
    """The engine could not start (or be reached) with these settings; retrying will not help."""


@dataclass(frozen=True)
class ResolvedSettings:
    """What an engine decided for one task from the task's YAML, the engine's resource and the
    environment (`Engine.resolve`), before anything is loaded or asked of a server: the same in
    every process, so the assets' code versions (made at load) and the run's checkpoint fingerprint
    (made from it) change together."""

    kind: str  # the engine that runs the task: `vllm` (in process), `openai` (an endpoint) or `batch_api`
    # The model the task runs, as named (`embedded:` names unexpanded): what the code versions, the
    # labels' files, the model check and `batch-assets tasks` read; none of them reads the task's
    # `engine.model`. An endpoint told no model serves its only one, whose name only the server knows:
    # the task's default name stands for it here (`model_from_server`), as the code versions always had it.
    model: str
    model_setting: str  # where that name was set, in words a user can act on
    # The context as set (resource, else YAML); an embedding task that sets none runs at its model's limit.
    max_model_len: int
    # The vLLM arguments that decide outputs (the task's, under the resource's, over the pipeline's
    # defaults; throughput-only ones left out: engines/vllm_args.py), as code versions and fingerprint read them.
    vllm_args: dict[str, Any] = field(default_factory=dict)
    # A cascade's `teacher: llm`: the chat teacher's own resolved settings (engines/kinds.py).
    teacher: ResolvedSettings | None = None
    # The endpoint is sent no model name and the run asks the server which model it serves.
    model_from_server: bool = False
    # The task's LoRA adapter (`engine.lora`): its identity (a hash of its files) counts in the code
    # versions and the fingerprint; its path does not.
    lora: ResolvedLora | None = None


class EngineSettings(Protocol):
    kind: str
    resolved: ResolvedSettings
    model: str
    max_model_len: int
    structured_outputs: bool  # the task's output constraint is sent with each request
    # Why the prompt texts and token counts are approximate (an endpoint without a local tokenizer of
    # its model); None: exact. formatted_prompts warns with it on every run.
    tokenizer_note: str | None

    def identity(self) -> dict[str, Any]: ...

    def metadata(self) -> dict[str, Any]: ...


def model_name(settings: EngineSettings) -> str:
    """The model as a user names it: as resolved (an `embedded:` name unexpanded), or the name an
    endpoint serves when the task named none; with a LoRA adapter, the adapter's name (what `vllm
    serve --lora-modules` serves it as, and what an OpenAI batch line names)."""
    if settings.resolved.lora is not None:
        return settings.resolved.lora.name
    return settings.model if settings.resolved.model_from_server else settings.resolved.model


@runtime_checkable
class EngineSession(Protocol):
    started_here: bool  # this session started the engine (False: reused a warm one, or an endpoint)
    start_seconds: float

    def start(self, requests: int = 0) -> None:
        """Start the engine now (idempotent) for a stream of `requests` requests (an engine may
        choose how it starts by that); `stream` starts it too. Never called when no request needs
        the engine, so a fully cached partition costs no engine start."""

    @property
    def metadata(self) -> dict[str, Any]: ...

    def stream(self, prompts: Iterable[Prompt]) -> Iterator[tuple[int, Generation]]: ...


class Engine(Protocol):
    # The engine sends `Prompt.messages` (so callers must build them); else token ids are enough.
    sends_chat_messages: bool

    def resolve(self, task: TaskSpec) -> ResolvedSettings: ...

    def settings(self, task: TaskSpec) -> EngineSettings: ...

    def tokenizer(self, settings: EngineSettings): ...

    def session(
        self, task: TaskSpec, settings: EngineSettings, log: Callable[[str], None]
    ) -> AbstractContextManager[EngineSession]: ...


def batched_stream(
    generate: Callable[[list[Prompt]], list[Generation]], batch_size: int
) -> Callable[[Iterable[Prompt]], Iterator[tuple[int, Generation]]]:
    """A stream over a batch `generate` function: up to `batch_size` prompts per call, results in order."""

    def stream(prompts: Iterable[Prompt]) -> Iterator[tuple[int, Generation]]:
        position, pending = 0, iter(prompts)
        while batch := list(itertools.islice(pending, batch_size)):
            generated = generate(batch)
            if len(generated) != len(batch):
                raise RuntimeError(f"the engine returned {len(generated)} outputs for {len(batch)} prompts")
            for generation in generated:
                yield position, generation
                position += 1

    return stream
