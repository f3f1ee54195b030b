"""The engine interface the assets rely on, and how each task picks its engine.

Two resources implement it, so a task can use either with no other change:

- `VLLMEngine`, resource key `llm_engine`: vLLM inside the job's process (the default).
- `OpenAIEngine`, resource key `llm_endpoint`: any OpenAI-compatible chat-completions server,
  for tasks whose YAML says `engine.kind: openai`.

What both offer (duck-typed; the assets call nothing else):

    settings_for(task)        resolved settings, with at least `.model` and `.max_model_len`
    tokenizer(task)           a local Hugging Face tokenizer: renders the chat prompt, counts tokens
    generate(task, prompts)   one `Generation` per prompt, in order; a failed request may come
                              back as a `Generation` with an `error` instead of raising
    engine_starts             engines this process has started (0 for an endpoint)

The prompts handed to `generate` are token ids (what an in-process engine runs). For an endpoint
they are `EncodedPrompt`s, token ids that also carry the chat messages the server is sent.
"""

from collections.abc import Callable

import dagster as dg
import polars as pl

from batch_assets.pipeline.format_prompts import PromptEncoder, PromptFormat, messages_for, user_message_expr
from batch_assets.pipeline.task_spec import TaskSpec

IN_PROCESS_RESOURCE_KEY = "llm_engine"
ENDPOINT_RESOURCE_KEY = "llm_endpoint"


def engine_resource_key(task: TaskSpec) -> str:
    """The resource a task's assets use: `llm_endpoint` for `engine.kind: openai`, else `llm_engine`."""
    return ENDPOINT_RESOURCE_KEY if task.engine.kind == "openai" else IN_PROCESS_RESOURCE_KEY


def engine_for(context: dg.AssetExecutionContext, task: TaskSpec):
    """The engine resource a task's asset runs with."""
    return getattr(context.resources, engine_resource_key(task))


class EncodedPrompt(list):
    """A prompt's token ids (a plain `list[int]` to everything that counts or runs tokens) plus the
    chat messages it was rendered from, which is what a chat-completions endpoint is sent."""

    __slots__ = ("messages",)

    def __init__(self, token_ids: list[int], messages: list[dict[str, str]]) -> None:
        super().__init__(token_ids)
        self.messages = messages


def prompt_encoder(engine, task: TaskSpec, tokenizer, formatted: pl.DataFrame) -> Callable[[list[str]], list[list[int]]]:
    """The `tokenize` function `run_inference` needs: prompt texts → token ids.

    For an engine that sends chat messages (`sends_chat_messages`), each result also carries the
    row's messages, rebuilt from the input columns with the task's template (the same messages the
    prompt was rendered from). The in-process engine gets plain token ids: nothing extra is built.
    """
    # Special-token text in a record stays text (format_prompts.PromptEncoder): no forged chat turns.
    encoder = PromptEncoder(PromptFormat.of(task), tokenizer)
    if not getattr(engine, "sends_chat_messages", False):
        return encoder.encode
    valid = formatted.filter(pl.col("error").is_null())
    users = valid.select(user_message_expr(task.prompt.template).alias("user"))["user"]
    # Identical prompts come from identical user messages, so the prompt text is a safe key.
    user_by_prompt = dict(zip(valid["prompt"].to_list(), users.to_list(), strict=True))

    def encode(prompts: list[str]) -> list[list[int]]:
        token_ids = encoder.encode(prompts)
        return [
            EncodedPrompt(ids, messages_for(task.prompt.system, user_by_prompt[prompt]))
            for prompt, ids in zip(prompts, token_ids, strict=True)
        ]

    return encode


def checkpoint_identity(settings) -> dict:
    """What, besides sampling and the output constraint, decides an engine's outputs.

    Checkpoints are reused only under the same identity. For the in-process engine it is the model,
    dtype and seed (unchanged from before endpoints existed, so old checkpoints stay valid); for an
    endpoint, the model and the server it is served from.
    """
    if getattr(settings, "kind", "vllm") == "openai":
        return {"engine": "openai", "model": settings.model, "base_url": settings.base_url}
    return {"model": settings.model, "dtype": settings.dtype, "seed": settings.seed}

def engine_pool(task: TaskSpec) -> str:
    """The Dagster pool of a task's inference step: `gpu` for the in-process engine (limit = GPUs);
    `llm_endpoint` for endpoints, which need no local GPU (limit = runs the server may take at once)."""
    return "llm_endpoint" if task.engine.kind == "openai" else "gpu"
