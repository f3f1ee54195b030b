"""raw_prompts → formatted_prompts for OpenAI batch lines: each chat line's own messages rendered
with the model's chat template (a completion line's prompt as `/v1/completions` tokenizes it), its
request resolved (sampling.py) and its tokens counted; an embeddings line's texts formatted as an
embedding task's are. A line the task cannot answer (another url's kind, another model, a prompt
too long) becomes an error row naming the setting to change."""

from __future__ import annotations

import json
from dataclasses import dataclass

import polars as pl

from batch_assets.pipeline.embeddings.prompts import format_embedding_prompts
from batch_assets.pipeline.format_prompts import NO_PLACE_FOR_PICTURES, Tokenizer, count_tokens, places_pictures
from batch_assets.pipeline.inputs.images import DIGEST_COLUMN
from batch_assets.pipeline.openai_batch.messages import template_messages
from batch_assets.pipeline.openai_batch.protocol import EMBEDDINGS_URL, line_error
from batch_assets.pipeline.openai_batch.sampling import RequestSpec, request_spec
from batch_assets.pipeline.task_spec import SamplingSpec


def model_matches(requested: str | None, accepted: set[str]) -> bool:
    """A line without `body.model` matches any task; a named model must be one of `accepted`."""
    return requested is None or requested in accepted


def accepted_model_names(task_model: str) -> set[str]:
    """The task's model as a line may name it: as configured, or a local folder by its last part."""
    names = {task_model, task_model.rstrip("/").rsplit("/", 1)[-1]}
    if ":" in task_model:  # embedded:SmolLM2-135M-Instruct
        names.add(task_model.split(":", 1)[1])
    return names


def _completion_prefix(tokenizer: Tokenizer) -> str:
    """The special tokens the tokenizer puts before a plain prompt (e.g. Llama's BOS), as text:
    a completion prompt is tokenized as `/v1/completions` would, not as a chat prompt."""
    bos = getattr(tokenizer, "bos_token", None)
    bos_id = getattr(tokenizer, "bos_token_id", None)
    if not bos or bos_id is None:
        return ""
    with_special = tokenizer("a", add_special_tokens=True)["input_ids"]
    return bos if with_special and with_special[0] == bos_id else ""


def _max_tokens_problem(value: int, max_model_len: int) -> str:
    """A line's own max_tokens that no prompt fits beside: its mistake, not its prompt's length."""
    return (
        f"body.max_tokens / max_completion_tokens is {value}; it must be less than the model's context "
        f"(max_model_len {max_model_len}), which holds the prompt and the answer"
    )


NO_CHAT_TEMPLATE = "the model's tokenizer has no chat template; use /v1/completions lines"
_NO_PLACE_FOR_LINE_PICTURES = f"the line's image_url parts are pictures, and {NO_PLACE_FOR_PICTURES}"
COMPLETIONS_NEED_VLLM = "/v1/completions lines need the in-process engine (engine.kind: vllm)"


@dataclass(frozen=True)
class _LineFormat:
    """What formatting a line needs besides the line: the tokenizer and the task's settings."""

    tokenizer: Tokenizer
    sampling_defaults: SamplingSpec
    max_model_len: int
    source_file: str
    accepted_models: set[str] | None
    chat_only: bool
    chat_template: str | None
    completion_prefix: str
    # Whether the chat template has a place for a line's pictures (`places_pictures`): asked once.
    takes_pictures: bool

    def error(self, code: str, line: int, message: str) -> str:
        return line_error(code, self.source_file, line, message)


_NOT_AN_EMBEDDING_TASK = (
    "url /v1/embeddings asks for vectors, and this task's output.kind is text (its model writes answers): "
    "send embeddings lines to a task with output.kind: embedding (such as openai_batch_embeddings)"
)
_NOT_A_CHAT_TASK = (
    "url {url} asks for an answer, and this task's output.kind is embedding (its model returns vectors): "
    "send chat and completion lines to a task with output.kind: text (such as openai_batch)"
)


def _model_mismatch(requested: str | None, accepted: set[str]) -> str:
    return (
        f"body.model {requested!r} is not the task's model ({', '.join(sorted(accepted))}); "
        "set input.require_model_match: false to answer every line with the task's model"
    )


def format_batch_embedding_prompts(
    raw: pl.DataFrame,
    tokenizer: Tokenizer,
    *,
    max_model_len: int,
    truncate: bool,
    source_file: str,
    accepted_models: set[str] | None = None,
) -> pl.DataFrame:
    """raw_prompts → formatted_prompts for the lines of a task whose `output.kind` is embedding: each
    `/v1/embeddings` text formatted as an embedding task's text is (`prompt` = the text, its token
    count with the model's special tokens; too long: an `input_too_long` row naming the file, the
    line and `input.truncate`, or cut with it); a chat or completion line, or (with
    `accepted_models`) a line naming another model, is an error row naming the setting to change."""
    errors: list[str | None] = []
    for row in raw.select("error", "url", "model", "source_line").iter_rows(named=True):
        error, line = row["error"], row["source_line"]
        if error is None and row["url"] != EMBEDDINGS_URL:
            error = line_error("unsupported_url", source_file, line, _NOT_A_CHAT_TASK.format(url=row["url"]))
        if error is None and accepted_models is not None and not model_matches(row["model"], accepted_models):
            error = line_error("model_mismatch", source_file, line, _model_mismatch(row["model"], accepted_models))
        errors.append(error)
    frame = raw.with_columns(pl.Series("error", errors, dtype=pl.String))
    return format_embedding_prompts(
        frame,
        "{input}",
        ["input"],
        tokenizer,
        max_model_len=max_model_len,
        truncate=truncate,
        source_file=source_file,
    )


def format_batch_prompts(
    raw: pl.DataFrame,
    tokenizer: Tokenizer,
    *,
    sampling_defaults: SamplingSpec,
    max_model_len: int,
    source_file: str,
    accepted_models: set[str] | None = None,
    chat_only: bool = False,
) -> pl.DataFrame:
    """raw_prompts → formatted_prompts for batch requests: adds `prompt`, `num_prompt_tokens` and
    `request_params` (the resolved sampling and output constraint as canonical JSON).

    `accepted_models`: when given, a line naming another `body.model` becomes a `model_mismatch` row.
    `chat_only`: the engine sends chat messages (an endpoint), so `/v1/completions` lines are error rows.
    """
    how = _LineFormat(
        tokenizer,
        sampling_defaults,
        max_model_len,
        source_file,
        accepted_models,
        chat_only,
        getattr(tokenizer, "chat_template", None),
        _completion_prefix(tokenizer),
        DIGEST_COLUMN in raw.columns and places_pictures(tokenizer),
    )
    errors: list[str | None] = []
    prompts: list[str | None] = []
    params: list[str | None] = []
    max_tokens: list[int | None] = []
    for row in raw.iter_rows(named=True):
        error, prompt, spec = _format_line(row, how)
        sample_id = None
        if spec is not None and not spec.sampling.deterministic:
            sample_id = f"{source_file}#{row['row_id']}"
        errors.append(error)
        prompts.append(prompt if error is None else None)
        params.append(spec.params_json(sample_id) if error is None and spec is not None else None)
        max_tokens.append(spec.sampling.max_tokens if spec is not None else None)
    valid = [p for p in prompts if p is not None]
    counts = iter(count_tokens(tokenizer, valid) if valid else [])
    num_tokens = [next(counts) if p is not None else None for p in prompts]
    _refuse_too_long(raw["source_line"], num_tokens, max_tokens, how, errors, prompts, params)
    return raw.with_columns(
        pl.Series("error", errors, dtype=pl.String),
        pl.Series("prompt", prompts, dtype=pl.String),
        pl.Series("num_prompt_tokens", num_tokens, dtype=pl.Int64),
        pl.Series("request_params", params, dtype=pl.String),
    )


def _format_line(row: dict, how: _LineFormat) -> tuple[str | None, str | None, RequestSpec | None]:
    """One line's error (its own from parsing, or found here), prompt text and resolved request."""
    error, prompt, spec = row["error"], None, None
    line = row["source_line"]
    if error is None and row["url"] == EMBEDDINGS_URL:
        error = how.error("unsupported_url", line, _NOT_AN_EMBEDDING_TASK)
    if error is None and how.accepted_models is not None and not model_matches(row["model"], how.accepted_models):
        error = how.error("model_mismatch", line, _model_mismatch(row["model"], how.accepted_models))
    if error is None and row["max_tokens"] is not None and row["max_tokens"] >= how.max_model_len:
        error = how.error("invalid_field", line, _max_tokens_problem(row["max_tokens"], how.max_model_len))
    if error is not None:
        return error, None, None
    spec = request_spec(row, how.sampling_defaults)
    if row["messages"] is not None:
        if not how.chat_template:
            return how.error("chat_template_error", line, NO_CHAT_TEMPLATE), None, spec
        if row.get(DIGEST_COLUMN) is not None and not how.takes_pictures:
            return how.error("chat_template_error", line, _NO_PLACE_FOR_LINE_PICTURES), None, spec
        try:
            prompt = how.tokenizer.apply_chat_template(
                template_messages(json.loads(row["messages"])), tokenize=False, add_generation_prompt=True
            )
        except Exception as exc:  # a template may raise on roles it does not accept
            return how.error("chat_template_error", line, f"{type(exc).__name__}: {exc}"), None, spec
    elif how.chat_only:
        return how.error("unsupported_url", line, COMPLETIONS_NEED_VLLM), None, spec
    else:
        prompt = how.completion_prefix + row["completion_prompt"]
    return None, prompt, spec


def _refuse_too_long(
    source_lines: pl.Series,
    num_tokens: list[int | None],
    max_tokens: list[int | None],
    how: _LineFormat,
    errors: list[str | None],
    prompts: list[str | None],
    params: list[str | None],
) -> None:
    """Lines whose prompt tokens and max_tokens exceed the context become `prompt_too_long` rows (in place)."""
    for index, (tokens, limit) in enumerate(zip(num_tokens, max_tokens, strict=True)):
        if tokens is None:
            continue
        assert limit is not None  # a line gets a prompt only after its request spec (and max_tokens)
        if tokens + limit > how.max_model_len:
            errors[index] = how.error(
                "prompt_too_long",
                source_lines[index],
                f"{tokens} prompt tokens + {limit} max_tokens exceed max_model_len {how.max_model_len}",
            )
            prompts[index] = params[index] = None
