"""A line's `body`: which fields this pipeline honours, their values checked (field_checks.py,
messages.py), and what the raw_prompts row records of them."""

from __future__ import annotations

import json
from typing import Any

from batch_assets.pipeline.inputs.images import DIGEST_COLUMN, PIXELS_COLUMN
from batch_assets.pipeline.openai_batch.field_checks import range_problems, typed_fields
from batch_assets.pipeline.openai_batch.image_parts import ImageReader
from batch_assets.pipeline.openai_batch.messages import chat_messages
from batch_assets.pipeline.openai_batch.protocol import (
    CHAT_URL,
    COMPLETIONS_URL,
    EMBEDDINGS_URL,
    LineError,
    kind_of,
)
from batch_assets.pipeline.task_spec import SettingError
from batch_assets.pipeline.task_spec.input import ImageLimits
from batch_assets.pipeline.task_spec.output import check_choices, check_label_regex

# OpenAI's limit of texts in one embeddings request.
MAX_EMBEDDING_INPUTS = 2048
# Body fields honoured (or harmless: `user`, `metadata`, `store` are recorded by OpenAI, not used
# for generation). `n`, `stream` and `echo` are accepted at their default values only, and so is
# `logprobs` on a completion line (a chat line's `logprobs` and `top_logprobs` are answered).
_COMMON_FIELDS = {
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "n",
    "stream",
    "logprobs",
    "user",
    "metadata",
    "store",
}
BODY_FIELDS = {
    CHAT_URL: frozenset(
        _COMMON_FIELDS | {"messages", "max_completion_tokens", "response_format", "structured_outputs", "top_logprobs"}
    ),
    COMPLETIONS_URL: frozenset(_COMMON_FIELDS | {"prompt", "echo", "structured_outputs"}),
    # `dimensions` (shortened vectors) is left out: only some models are trained for it.
    EMBEDDINGS_URL: frozenset({"model", "input", "encoding_format", "user"}),
}
_DEFAULT_ONLY = {
    "n": (1, None),
    "stream": (False, None),
    "logprobs": (False, None),
    "echo": (False, None),
    "store": (False, True, None),
}
MAX_STOP_SEQUENCES = 4
# The first given of these is the line's max_tokens (OpenAI: `max_completion_tokens` replaces the
# deprecated `max_tokens`; either may be given).
_MAX_TOKENS_FIELDS = ("max_completion_tokens", "max_tokens")


def parse_body(body: dict, url: str, row: dict, limits: ImageLimits) -> list[str] | None:
    """Fill `row` from the line's body; an embeddings line's texts are returned (one row each)."""
    model = body.get("model")
    row["model"] = model if isinstance(model, str) else None
    _refuse_unsupported(body, url)
    given = typed_fields(body, url)
    problems = range_problems(given)
    tokens_field = next((field for field in _MAX_TOKENS_FIELDS if field in given), None)
    for field in (tokens_field, "temperature", "top_p", "seed"):
        if field in problems:
            raise LineError("invalid_field", problems[field])
    if tokens_field is not None:
        row["max_tokens"] = given[tokens_field]
    for field in ("temperature", "top_p"):
        if field in given:
            row[field] = float(given[field])
    if "seed" in given:
        row["seed"] = given["seed"]
    if "stop" in given:
        row["stop"] = json.dumps(_stop(given["stop"]), ensure_ascii=False)
    if body.get("structured_outputs") is not None:
        if "response_format" in given:
            raise LineError("invalid_field", "body has both response_format and structured_outputs; give one")
        row["response_format"] = json.dumps(_structured_outputs(body["structured_outputs"]), ensure_ascii=False)
    if url == CHAT_URL:
        if "top_logprobs" in problems:
            raise LineError("invalid_field", problems["top_logprobs"])
        row["top_logprobs"] = _top_logprobs(given)
        if "response_format" in given:
            row["response_format"] = json.dumps(_response_format(given["response_format"]), ensure_ascii=False)
        images = ImageReader(limits)
        row["messages"] = json.dumps(chat_messages(body.get("messages"), images), ensure_ascii=False)
        if images.found:
            row[DIGEST_COLUMN], row[PIXELS_COLUMN] = images.digest(), images.pixels
    elif url == EMBEDDINGS_URL:
        row["encoding_format"] = given.get("encoding_format", "float")
        return _embedding_texts(body.get("input"))
    else:
        row["completion_prompt"] = _completion_prompt(body.get("prompt"))
    return None


def _refuse_unsupported(body: dict, url: str) -> None:
    """A field this pipeline does not honour, or one it takes at its default value only."""
    unknown = sorted(set(body) - BODY_FIELDS[url])
    if unknown:
        supported = ", ".join(sorted(BODY_FIELDS[url]))
        raise LineError("unsupported_field", f"body.{unknown[0]} is not supported (supported fields: {supported})")
    for field, allowed in _DEFAULT_ONLY.items():
        if field == "logprobs" and url == CHAT_URL:
            continue  # answered (see `_top_logprobs`)
        if (
            field in body
            and body[field] not in allowed
            and not (field == "logprobs" and body[field] == 0 and url == COMPLETIONS_URL)
        ):
            raise LineError(
                "unsupported_field", f"body.{field} = {json.dumps(body[field])} is not supported (only {allowed[0]})"
            )


def _top_logprobs(given: dict[str, Any]) -> int | None:
    """A chat line's `logprobs` request as the alternatives it wants per token (None: not asked);
    `top_logprobs` without `logprobs: true` is refused, as OpenAI and vLLM refuse it."""
    top = given.get("top_logprobs")
    if top and not given.get("logprobs"):
        raise LineError("invalid_field", "body.top_logprobs needs body.logprobs: true")
    return (top or 0) if given.get("logprobs") else None


def _stop(value: str | list[str]) -> list[str]:
    stops = [value] if isinstance(value, str) else list(value)
    if not all(stops):
        raise LineError("invalid_field", "body.stop must be a non-empty string or a list of them")
    if len(stops) > MAX_STOP_SEQUENCES:
        raise LineError("invalid_field", f"body.stop has {len(stops)} sequences; at most {MAX_STOP_SEQUENCES}")
    return stops


def _response_format(value: dict) -> dict:
    """OpenAI's response format (its type already checked) as the constraint recorded for the line:
    a json_schema one needs a schema (optional in OpenAI's type) that is a valid JSON schema."""
    if value["type"] != "json_schema":
        return {"type": value["type"]}
    spec = value["json_schema"]
    schema = spec.get("schema")
    if not schema:
        raise LineError(
            "invalid_field", "body.response_format.json_schema.schema must be a non-empty JSON schema object"
        )
    import jsonschema

    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise LineError(
            "invalid_field",
            f"body.response_format.json_schema.schema is not a valid JSON schema: {exc.message[:160]}",
        ) from None
    return {"type": "json_schema", "json_schema": {"name": spec.get("name"), "schema": schema}}


def _structured_outputs(value: object) -> dict:
    """vLLM's own constraint field (`structured_outputs: {"choice": [...]}` or `{"regex": "..."}`),
    which vLLM's run-batch takes and the `batch_api` engine sends for a choices or regex task (OpenAI
    has no equivalent), recorded in the `response_format` column as `{"type": "choice"|"regex", ...}`."""
    if not isinstance(value, dict) or len(value) != 1 or not {"choice", "regex"} & set(value):
        raise LineError(
            "unsupported_field", 'body.structured_outputs must be {"choice": [texts]} or {"regex": "pattern"}'
        )
    if "regex" in value:
        if not isinstance(value["regex"], str) or not value["regex"]:
            raise LineError("invalid_field", "body.structured_outputs.regex must be a non-empty string")
        _task_check(check_label_regex, value["regex"], "output.regex", "body.structured_outputs.regex")
        return {"type": "regex", "regex": value["regex"]}
    choices = value["choice"]
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise LineError("invalid_field", "body.structured_outputs.choice must be a non-empty list of texts")
    choices = list(dict.fromkeys(choices))
    _task_check(check_choices, choices, "output.choices", "body.structured_outputs.choice")
    return {"type": "choice", "choice": choices}


def _task_check(check: Any, value: Any, key: str, field: str) -> None:
    """A task file's check of its output constraint (`OutputSpec`, which `output_for` builds from the
    line's) run on the line's, so a constraint no task could have is this line's `invalid_field`."""
    try:
        check(value)
    except SettingError as exc:
        raise LineError("invalid_field", str(exc).replace(key, field, 1)) from None


def _completion_prompt(value: object) -> str:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
        value = value[0]  # one prompt in a list is one request
    if isinstance(value, list) and len(value) > 1:
        raise LineError("unsupported_field", "body.prompt holds several prompts; put each on its own line")
    if value is None or value == "":
        raise LineError("empty_messages", "body.prompt is missing or empty")
    if not isinstance(value, str):
        raise LineError("unsupported_field", f"body.prompt is {kind_of(value)}; only a text prompt is supported")
    return value


def _embedding_texts(value: object) -> list[str]:
    """`body.input` of an embeddings line as its texts: a text, or a list of up to 2048 texts."""
    texts = [value] if isinstance(value, str) else value
    if value is None or value == "" or value == []:
        raise LineError("empty_input", "body.input is missing or empty")
    if not isinstance(texts, list):
        raise LineError("invalid_field", f"body.input is {kind_of(value)}; it must be a text or a list of texts")
    if all(isinstance(item, int) and not isinstance(item, bool) for item in texts) or all(
        isinstance(item, list) for item in texts
    ):
        raise LineError(
            "unsupported_field", "body.input holds token ids; this pipeline embeds text: send the text itself"
        )
    if len(texts) > MAX_EMBEDDING_INPUTS:
        raise LineError("invalid_field", f"body.input holds {len(texts)} texts; at most {MAX_EMBEDDING_INPUTS} a line")
    for position, text in enumerate(texts):
        where = "body.input" if isinstance(value, str) else f"body.input[{position}]"
        if not isinstance(text, str):
            raise LineError("invalid_field", f"{where} is {kind_of(text)}, not a text")
        if not text.strip():
            raise LineError("empty_input", f"{where} is {'empty' if not text else 'blank'}")
    return texts
