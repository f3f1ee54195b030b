"""The engine interface: what the inference step asks of every engine kind, and which engine a task uses.

Two kinds implement it, so a task can use either with no other change:

- `vllm` (`VLLMEngine`, resource key `llm_engine`, pool `gpu`): vLLM's async engine inside the
  run's process (the default).
- `openai` (`OpenAIEngine`, resource key `llm_endpoint`, pool `llm_endpoint`): any
  OpenAI-compatible chat-completions server, for tasks whose YAML says `engine.kind: openai`.

An engine offers (see `Engine`):

    settings(task)        resolved settings: `.model`, `.max_model_len`, `.identity()` (what decides
                          the outputs, for the checkpoint fingerprint) and `.metadata()`
    tokenizer(task)       a local Hugging Face tokenizer: renders the chat prompt, counts tokens
    session(task, log)    a context manager that starts the engine (or connects) on entry and
                          tears down on exit; start failures raise `EngineStartError` with a hint
    session.stream(ps)    `(position, Generation)` for each `Prompt`, in the order they finish; a
                          failed request may come back as a `Generation` with an `error`

The asset never names an engine class: `ENGINE_KINDS[task.engine.kind]` gives the resource key,
pool and display name, and the resource under that key is the engine.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import polars as pl

from batch_assets.pipeline.format_prompts import PromptEncoder, PromptFormat, messages_for, user_message_expr
from batch_assets.pipeline.task_spec import OutputSpec, SamplingSpec, TaskSpec


@dataclass(frozen=True)
class Generation:
    text: str | None
    finish_reason: str | None
    num_prompt_tokens: int
    num_generated_tokens: int
    # Sum of the log-probabilities of the generated tokens, from the distribution the engine sampled
    # from (the output constraint applied), when the request asked for them and the engine returned them.
    cumulative_logprob: float | None = None
    # Set when the engine gave up on this request (e.g. an endpoint failing after its retries):
    # the row becomes an error row instead of failing the partition.
    error: str | None = None


@dataclass(frozen=True)
class Prompt:
    """One request: the rendered prompt's token ids (what an in-process engine runs), the chat
    messages it was rendered from (what an endpoint is sent; None when the engine does not need
    them), and optional per-request overrides of the task's sampling and output constraint."""

    token_ids: tuple[int, ...]
    messages: tuple[dict[str, str], ...] | None = None
    sampling: SamplingSpec | None = None
    output: OutputSpec | None = None

    def __len__(self) -> int:
        return len(self.token_ids)


class EngineStartError(RuntimeError):
    """The engine could not start (or be reached) with these settings; retrying will not help."""


class EngineSettings(Protocol):
    kind: str
    model: str
    max_model_len: int
    structured_outputs: bool  # the task's output constraint is sent with each request

    def identity(self) -> dict[str, Any]: ...

    def metadata(self) -> dict[str, Any]: ...


@runtime_checkable
class EngineSession(Protocol):
    started_here: bool  # this session started the engine (False: reused a warm one, or an endpoint)
    start_seconds: float

    def start(self) -> None:
        """Start the engine now (idempotent); `stream` starts it too. Never called when no request
        needs the engine, so a fully cached partition costs no engine start."""

    @property
    def metadata(self) -> dict[str, Any]: ...

    def stream(self, prompts: Iterable[Prompt]) -> Iterator[tuple[int, Generation]]: ...


class Engine(Protocol):
    # The engine sends `Prompt.messages` (so callers must build them); else token ids are enough.
    sends_chat_messages: bool

    def settings(self, task: TaskSpec) -> EngineSettings: ...

    def tokenizer(self, task: TaskSpec): ...

    def session(self, task: TaskSpec, log: Callable[[str], None]) -> AbstractContextManager[EngineSession]: ...


@dataclass(frozen=True)
class EngineKind:
    resource_key: str
    pool: str  # the Dagster pool of the inference step
    display_name: str


# `gpu`: limit = runs per node (one run uses every GPU of its node); `llm_endpoint`: limit = runs the
# server may take at once.
ENGINE_KINDS: dict[str, EngineKind] = {
    "vllm": EngineKind("llm_engine", "gpu", "the vLLM engine"),
    "openai": EngineKind("llm_endpoint", "llm_endpoint", "an OpenAI-compatible endpoint"),
}


def engine_kind(task: TaskSpec) -> EngineKind:
    return ENGINE_KINDS[task.engine.kind]


def engine_for(resources: Any, task: TaskSpec) -> Engine:
    """The engine a task's assets run with: the resource registered for its `engine.kind`."""
    return getattr(resources, engine_kind(task).resource_key)


def prompt_encoder(
    engine: Engine, task: TaskSpec, tokenizer, formatted: pl.DataFrame
) -> Callable[[list[str]], list[Prompt]]:
    """Prompt texts of `formatted` → `Prompt`s for `engine`.

    For an engine that sends chat messages, each prompt also carries the row's messages, rebuilt
    from the input columns with the task's template (the same messages the prompt was rendered
    from, few-shot examples included). The in-process engine gets token ids only: nothing extra is built.
    """
    # Special-token text in a record stays text (format_prompts.PromptEncoder): no forged chat turns.
    prompt_format = PromptFormat.of(task)
    token_ids = PromptEncoder(prompt_format, tokenizer).encode
    if not engine.sends_chat_messages:
        return lambda prompts: [Prompt(tuple(ids)) for ids in token_ids(prompts)]
    prompt_spec = task.prompt
    assert prompt_spec is not None  # a records task (openai_batch lines go through batch_prompt_encoder)
    valid = formatted.filter(pl.col("error").is_null())
    users = valid.select(user_message_expr(prompt_spec.template).alias("user"))["user"]
    # Identical prompts come from identical user messages, so the prompt text is a safe key.
    user_by_prompt = dict(zip(valid["prompt"].to_list(), users.to_list(), strict=True))

    def encode(prompts: list[str]) -> list[Prompt]:
        return [
            Prompt(tuple(ids), tuple(messages_for(prompt_spec.system, user_by_prompt[prompt], prompt_format.examples)))
            for prompt, ids in zip(prompts, token_ids(prompts), strict=True)
        ]

    return encode


def batched_stream(
    generate: Callable[[list[Prompt]], list[Generation]], batch_size: int
) -> Callable[[Iterable[Prompt]], Iterator[tuple[int, Generation]]]:
    """A stream over a batch `generate` function: up to `batch_size` prompts per call, results in order."""
    import itertools

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
