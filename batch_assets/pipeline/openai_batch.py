"""OpenAI Batch API request files in: one row per line (an embeddings line: one per text), each line its own request.

Pure functions, no Dagster, no storage. A drop of a task with `input.format: openai_batch` is a
`.jsonl` file whose lines are

    {"custom_id": "q1", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "...", "messages": [...], "max_tokens": 64, "temperature": 0, ...}}

(`/v1/completions` lines carry `body.prompt` instead of `messages`; `/v1/embeddings` lines carry
`body.input`, a text or a list of texts, for a task whose `output.kind` is `embedding`).
`read_batch_requests` turns the file into raw_prompts rows (an embeddings line: one row per text,
`input_index` its place in `body.input`); `format_batch_prompts` renders each request's own
messages with the model's chat template, resolves its sampling (the task's `sampling:` fills what a
line leaves out) and its output constraint (`response_format`, or vLLM's `structured_outputs` with a
`choice` or `regex`, as vLLM's run-batch takes it), and counts its tokens;
`format_batch_embedding_prompts` does what an embedding task's formatting does to each text.

Every line yields its rows (one, or one per text of an embeddings line); a line that cannot be
answered is a row with an `error` (`code: file line N: message`), which ends up in the partition's batch_errors file:

    invalid_utf8        the line holds bytes that are not UTF-8
    empty_record        a blank line
    malformed_json      the line is not JSON
    not_an_object       the line is JSON but not an object
    missing_custom_id   no `custom_id`
    invalid_custom_id   a `custom_id` that is not a non-empty string (kept as given, as JSON text,
                        in the `custom_id` column; echoed as given in the error line)
    duplicate_custom_id the `custom_id` of an earlier line (that line is answered; this one is not)
    unsupported_method  `method` other than POST
    unsupported_url     `url` other than /v1/chat/completions, /v1/completions and /v1/embeddings,
                        or a url the task does not serve (/v1/embeddings lines need a task whose
                        output.kind is embedding; chat and completion lines one whose output is text)
    invalid_body        `body` missing or not an object
    unsupported_field   a body field this pipeline does not honour (tools, n > 1, a completion
                        line's logprobs, ...)
    invalid_field       a supported field with a value of the wrong type (as OpenAI's request types,
                        the `openai` SDK's, have it) or range (a max_tokens that leaves no room for a
                        prompt in the model's context included)
    empty_messages      `messages` missing or empty (chat), `prompt` missing or empty (completions)
    empty_input         `input` missing, empty or blank (embeddings), or a blank text in its list
    invalid_message     a message without a known role, with content that is neither text nor
                        text and `image_url` parts, or with an image part outside a user message
    missing_image, unreadable_image, unsupported_image_format, image_too_large, image_url_not_allowed
                        an `image_url` part whose `data:` URL is empty, not an image, of a format or
                        over a limit the task's `input.images` refuses (pipeline/inputs/images.py), or an
                        http(s) URL where the task does not let the endpoint fetch it
                        (`input.images.fetch_urls`), or another scheme
    model_mismatch      with `input.require_model_match`: `body.model` is not the task's model
    chat_template_error the model's chat template refused the messages (e.g. roles not alternating)
    prompt_too_long     prompt tokens + max_tokens exceed the model's context
    input_too_long      an embeddings text longer than the model takes (`input.truncate: true` in the
                        task cuts it instead, as sentence-transformers does)

A chat line's `image_url` parts are accepted as OpenAI takes them: a `data:` URL is decoded and
checked here (its bytes' digest names the request, `image_digest`); an http(s) URL only with
`input.images.fetch_urls` (an endpoint's server fetches it; the URL names the request). The
messages keep the parts as written: an endpoint is sent them as they are, the in-process engine
the decoded pictures with the ids (`batch_prompt_encoder`), and the chat template renders each as
the model's image placeholder (`template_messages`).

Only a file that is not `.jsonl` (or `.jsonl.gz`), or a broken gzip file, raises `DropFileError`.
Every code above is a bad request (HTTP 400 in the error file); any other code on a row (the
engine's) is a server failure (500).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from dataclasses import dataclass
from typing import Any

import polars as pl

from batch_assets.pipeline.embeddings import format_embedding_prompts
from batch_assets.pipeline.engine_contract import Prompt, keys_of
from batch_assets.pipeline.format_prompts import NO_PLACE_FOR_PICTURES, Tokenizer, count_tokens, places_pictures
from batch_assets.pipeline.inputs.images import (
    DIGEST_COLUMN,
    IMAGE_ERROR_CODES,
    PIXELS_COLUMN,
    ImageInputError,
    check_image,
    data_url_bytes,
    image_digest,
)
from batch_assets.pipeline.inputs.read_prompts import DropFileError, _gunzip, input_suffix
from batch_assets.pipeline.task_spec import OutputSpec, SamplingSpec, SettingError
from batch_assets.pipeline.task_spec.input import ImageLimits
from batch_assets.pipeline.task_spec.output import check_choices, check_label_regex

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
EMBEDDINGS_URL = "/v1/embeddings"
SUPPORTED_URLS = (CHAT_URL, COMPLETIONS_URL, EMBEDDINGS_URL)
# OpenAI's limit of texts in one embeddings request.
MAX_EMBEDDING_INPUTS = 2048
MESSAGE_ROLES = ("system", "developer", "user", "assistant")
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
# OpenAI's most alternatives per token a chat line may ask for (`top_logprobs`); vLLM's default
# `max_logprobs` engine argument is the same.
MAX_TOP_LOGPROBS = 20
# The codes of lines the request itself makes unanswerable (see the module docstring).
REQUEST_ERROR_CODES = frozenset(
    {
        "invalid_utf8",
        "empty_record",
        "malformed_json",
        "not_an_object",
        "missing_custom_id",
        "invalid_custom_id",
        "duplicate_custom_id",
        "unsupported_method",
        "unsupported_url",
        "invalid_body",
        "unsupported_field",
        "invalid_field",
        "empty_messages",
        "invalid_message",
        "model_mismatch",
        "chat_template_error",
        "prompt_too_long",
        "empty_input",
        "input_too_long",
        "empty_text",
        # The engine refused the request (e.g. a pattern its structured-output backend cannot compile).
        "invalid_request",
        *IMAGE_ERROR_CODES,
    }
)
INVALID_CUSTOM_ID = "invalid_custom_id"

RAW_SCHEMA = {
    "row_id": pl.Int64,
    "source_line": pl.Int64,
    "custom_id": pl.String,
    "method": pl.String,
    "url": pl.String,
    "model": pl.String,  # body.model as written in the line (recorded; see `require_model_match`)
    "messages": pl.String,  # chat: the messages as JSON, content parts joined into text
    "completion_prompt": pl.String,  # completions: the prompt text
    "max_tokens": pl.Int64,
    "temperature": pl.Float64,
    "top_p": pl.Float64,
    "seed": pl.Int64,
    "stop": pl.String,  # JSON list of stop strings
    "response_format": pl.String,  # JSON object as written
    "input": pl.String,  # embeddings: one text of body.input (a line with a list of texts has a row each)
    "input_index": pl.Int64,  # embeddings: the text's place in body.input (the `index` of its vector)
    "encoding_format": pl.String,  # embeddings: "float" or "base64", how the vectors are written out
    # chat: the line asked for `logprobs`, with this many `top_logprobs` alternatives per token (null: not asked)
    "top_logprobs": pl.Int64,
    "error": pl.String,
}
# The columns that only chat and completion lines fill, and those only embeddings lines fill.
GENERATION_COLUMNS = (
    "messages",
    "completion_prompt",
    "max_tokens",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "response_format",
    "top_logprobs",
)
EMBEDDING_COLUMNS = ("input", "input_index", "encoding_format")
# Where `_parse_body` leaves an embeddings line's texts for `read_batch_requests` to spread over rows.
_TEXTS = "_texts"
# The columns a file with image lines has besides RAW_SCHEMA's (null on its text lines): a file
# without images keeps the text schema, and its requests their keys.
IMAGE_SCHEMA = {DIGEST_COLUMN: pl.String, PIXELS_COLUMN: pl.Int64}
# An image part's `image_url.detail` values (OpenAI's; recorded and passed to an endpoint).
IMAGE_DETAILS = ("auto", "low", "high")


class _LineError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def _error(code: str, file_name: str, line: int, message: str) -> str:
    return f"{code}: {file_name} line {line}: {message}"


def _kind(value: object) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number", float: "a number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def _json_text(value: object) -> str:
    """`value` as the line wrote it (NaN and Infinity as JSON spells them), cut for a message."""
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 80 else text[:77] + "..."


def read_batch_requests(data: bytes, file_name: str, images: ImageLimits | None = None) -> pl.DataFrame:
    """Parse an OpenAI batch request file into raw_prompts rows (see the module docstring); `images`:
    the task's limits on its lines' images (`input.images`)."""
    limits = images or ImageLimits()
    suffix = input_suffix(file_name)
    if suffix not in (".jsonl", ".jsonl.gz"):
        raise DropFileError(
            f"{file_name}: an openai_batch task reads .jsonl (or .jsonl.gz) files in the OpenAI Batch API format"
        )
    if suffix == ".jsonl.gz":
        data = _gunzip(data, file_name)
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]
    rows: list[dict] = []
    first_line_of: dict[str, int] = {}
    lines = data.split(b"\n") if data.strip() else []
    if lines and not lines[-1]:
        lines.pop()
    for index, raw_line in enumerate(lines):
        number = index + 1
        row: dict[str, Any] = {"row_id": len(rows), "source_line": number}
        try:
            _parse_line(raw_line.removesuffix(b"\r"), row, first_line_of, limits)
        except _LineError as exc:
            row.pop(_TEXTS, None)
            row["error"] = _error(exc.code, file_name, number, str(exc))
        texts = row.pop(_TEXTS, None)
        if texts is None:
            rows.append(row)
            continue
        # An embeddings line: one row per text (its own vector, deduplicated and cached as any text).
        for position, text in enumerate(texts):
            rows.append({**row, "row_id": len(rows), "input": text, "input_index": position})
    with_images = any(DIGEST_COLUMN in row for row in rows)
    return pl.DataFrame(rows, schema={**RAW_SCHEMA, **IMAGE_SCHEMA} if with_images else RAW_SCHEMA)


def _parse_line(raw_line: bytes, row: dict, first_line_of: dict[str, int], limits: ImageLimits) -> None:
    try:
        text = raw_line.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _LineError("invalid_utf8", f"byte {exc.start + 1} of the line is not UTF-8 ({exc.reason})") from None
    if not text.strip():
        raise _LineError("empty_record", "blank line")
    try:
        request = json.loads(text)
    except json.JSONDecodeError as exc:
        raise _LineError("malformed_json", f"{exc.msg} at column {exc.colno}") from None
    except (ValueError, RecursionError) as exc:
        raise _LineError("malformed_json", str(exc) or type(exc).__name__) from None
    if not isinstance(request, dict):
        raise _LineError("not_an_object", f"{_kind(request)}, not a JSON object")
    custom_id = request.get("custom_id")
    if isinstance(custom_id, str) and custom_id:
        row["custom_id"] = custom_id
        if custom_id in first_line_of:
            raise _LineError(
                "duplicate_custom_id", f"custom_id {custom_id!r} was used first on line {first_line_of[custom_id]}"
            )
        first_line_of[custom_id] = row["source_line"]
    elif "custom_id" not in request:
        raise _LineError("missing_custom_id", "the line has no custom_id")
    else:
        # Kept as the line gave it, so its error line can echo it for the client to match.
        row["custom_id"] = json.dumps(custom_id, ensure_ascii=False)
        given = "an empty string" if custom_id == "" else _kind(custom_id)
        if isinstance(custom_id, int | float) and not isinstance(custom_id, bool):
            given = f"the number {_json_text(custom_id)}"
        raise _LineError(INVALID_CUSTOM_ID, f"custom_id is {given}; it must be a non-empty string")
    method, url, body = request.get("method"), request.get("url"), request.get("body")
    row["method"] = method if isinstance(method, str) else None
    row["url"] = url if isinstance(url, str) else None
    if method != "POST":
        raise _LineError("unsupported_method", f'method {method!r} is not supported; use "POST"')
    if url not in SUPPORTED_URLS:
        raise _LineError("unsupported_url", f"url {url!r} is not supported; use one of {', '.join(SUPPORTED_URLS)}")
    if not isinstance(body, dict):
        raise _LineError(
            "invalid_body", f"body is {_kind(body)}, not a JSON object" if "body" in request else "the line has no body"
        )
    _parse_body(body, url, row, limits)


def _parse_body(body: dict, url: str, row: dict, limits: ImageLimits) -> None:
    model = body.get("model")
    row["model"] = model if isinstance(model, str) else None
    unknown = sorted(set(body) - BODY_FIELDS[url])
    if unknown:
        supported = ", ".join(sorted(BODY_FIELDS[url]))
        raise _LineError("unsupported_field", f"body.{unknown[0]} is not supported (supported fields: {supported})")
    for field, allowed in _DEFAULT_ONLY.items():
        if field == "logprobs" and url == CHAT_URL:
            continue  # answered (see `_top_logprobs`)
        if (
            field in body
            and body[field] not in allowed
            and not (field == "logprobs" and body[field] == 0 and url == COMPLETIONS_URL)
        ):
            raise _LineError(
                "unsupported_field", f"body.{field} = {json.dumps(body[field])} is not supported (only {allowed[0]})"
            )
    given = _typed_fields(body, url)
    # OpenAI: `max_completion_tokens` replaces the deprecated `max_tokens`; either may be given.
    for field in ("max_completion_tokens", "max_tokens"):
        if field in given:
            row["max_tokens"] = _within(field, given[field], 1, 2**63 - 1)
            break
    if "temperature" in given:
        row["temperature"] = float(_within("temperature", given["temperature"], 0.0, 2.0))
    if "top_p" in given:
        row["top_p"] = float(_within("top_p", given["top_p"], 0.0, 1.0, low_open=True))
    if "seed" in given:
        row["seed"] = _within("seed", given["seed"], -(2**63), 2**63 - 1)
    if "stop" in given:
        row["stop"] = json.dumps(_stop(given["stop"]), ensure_ascii=False)
    if body.get("structured_outputs") is not None:
        if "response_format" in given:
            raise _LineError("invalid_field", "body has both response_format and structured_outputs; give one")
        row["response_format"] = json.dumps(_structured_outputs(body["structured_outputs"]), ensure_ascii=False)
    if url == CHAT_URL:
        row["top_logprobs"] = _top_logprobs(given)
        if "response_format" in given:
            row["response_format"] = json.dumps(_response_format(given["response_format"]), ensure_ascii=False)
        images = _ImageReader(limits)
        row["messages"] = json.dumps(_messages(body.get("messages"), images), ensure_ascii=False)
        if images.found:
            row[DIGEST_COLUMN], row[PIXELS_COLUMN] = images.digest(), images.pixels
    elif url == EMBEDDINGS_URL:
        row["encoding_format"] = given.get("encoding_format", "float")
        row[_TEXTS] = _embedding_texts(body.get("input"))
    else:
        row["completion_prompt"] = _completion_prompt(body.get("prompt"))


# The body fields checked here rather than by OpenAI's types: this pipeline takes less than OpenAI's
# API there (text content and text inputs only, one prompt a line) and says which part is at fault,
# where OpenAI's types (unions of message and part types, their lists checked lazily) cannot.
_OWN_CHECKS = frozenset({"messages", "prompt", "input", "structured_outputs"})
_INTEGER_FIELDS = ("max_tokens", "max_completion_tokens", "seed", "n", "top_logprobs")
# What a type error of pydantic's expects, in a message's words.
_EXPECTED = {
    "string_type": "a string",
    "int_type": "an integer",
    "float_type": "a number",
    "bool_type": "a boolean",
    "dict_type": "an object",
    "list_type": "a list",
    "is_instance_of": "a list",
    "iterable_type": "a list",
}


@functools.cache
def _body_type(url: str) -> Any:
    """OpenAI's own request type for `url` (the `openai` SDK's TypedDicts), as a pydantic validator:
    the field types follow OpenAI's API as the SDK is updated, not a copy kept here. Imported on
    first use: the SDK's types take seconds to import, and only batch lines need them."""
    from openai.types import completion_create_params, embedding_create_params
    from openai.types.chat import completion_create_params as chat_create_params
    from pydantic import TypeAdapter

    return TypeAdapter(
        {
            CHAT_URL: chat_create_params.CompletionCreateParamsNonStreaming,
            COMPLETIONS_URL: completion_create_params.CompletionCreateParamsNonStreaming,
            EMBEDDINGS_URL: embedding_create_params.EmbeddingCreateParams,
        }[url]
    )


def _typed_fields(body: dict, url: str) -> dict[str, Any]:
    """The body's fields (but `_OWN_CHECKS`) once their types are OpenAI's; a wrong type is an
    `invalid_field` naming the field (as OpenAI's `param`) and what OpenAI's API takes there.

    What OpenAI's types leave to the server (ranges, at most 4 stops) is checked by the caller.
    Two differences from OpenAI's types keep what vLLM's request models, which answer these lines,
    accept: a JSON null is a field not given (OpenAI's types allow null on some fields only), and
    an integral number such as 12.0 is an integer (vLLM's models are lax there; some JSON writers
    write every number as a float)."""
    from pydantic import ValidationError

    given = {key: value for key, value in body.items() if value is not None and key not in _OWN_CHECKS}
    for field in _INTEGER_FIELDS:
        if isinstance(value := given.get(field), float) and value.is_integer():
            given[field] = int(value)
    try:
        # Strict: a text is not a number ("0.5" for a temperature is refused, as before these types).
        _body_type(url).validate_python(given, strict=True)
    except ValidationError as exc:
        # A top-level field missing is one this pipeline does without (`model`) or checks itself.
        errors = [e for e in exc.errors(include_url=False) if e["type"] != "missing" or len(e["loc"]) > 1]
        if errors:
            raise _LineError("invalid_field", _type_problem(given, errors)) from None
    return given


def _type_problem(body: dict, errors: list[Any]) -> str:
    """pydantic's errors for one body as one message: the deepest field they name (of a union, the
    member that matched furthest), what it is and what OpenAI's API takes there."""
    located = [(_body_path(body, error["loc"], missing=error["type"] == "missing"), error) for error in errors]
    where = max((path for path, _ in located), key=len)
    same = [error for path, error in located if path == where]
    name = "body" + "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in where)
    if same[0]["type"] == "missing":
        return f"{name} is missing; OpenAI's API requires it"
    expected = [_EXPECTED.get(e["type"], str(e["msg"]).removeprefix("Input should be ")) for e in same]
    if "a string" in expected:  # a model name: any string, OpenAI's own model names among them
        expected = [words for words, e in zip(expected, same, strict=True) if e["type"] != "literal_error"]
    value = same[0]["input"]
    given = _json_text(value) if same[0]["type"] == "literal_error" else _kind(value)
    return f"{name} is {given}; OpenAI's API takes {' or '.join(dict.fromkeys(expected))}"


def _body_path(body: dict, loc: tuple, *, missing: bool) -> tuple[str | int, ...]:
    """An error location as the body's keys and list positions: pydantic adds a union member's
    name to it (`stop.str`, `response_format.ResponseFormatText.type`), which the body has not."""
    value: Any = body
    path: list[str | int] = []
    for position, part in enumerate(loc):
        in_dict = isinstance(value, dict) and part in value
        if in_dict or (isinstance(value, list) and isinstance(part, int) and part < len(value)):
            value = value[part]
        elif not (missing and position == len(loc) - 1 and isinstance(value, dict)):
            continue  # a union member's name
        path.append(part)
    return tuple(path)


def _within(field: str, value: int | float, low: float, high: float, *, low_open: bool = False) -> Any:
    """A number OpenAI's API takes in a range (its types leave ranges to the server)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise _LineError("invalid_field", f"body.{field} is {_json_text(value)}; it must be a finite number")
    if value > high or value < low or (low_open and value == low):
        bound = f"more than {low}" if low_open else f"at least {low}"
        raise _LineError("invalid_field", f"body.{field} is {value}; it must be {bound} and at most {high}")
    return value


def _top_logprobs(given: dict[str, Any]) -> int | None:
    """A chat line's `logprobs` request as the alternatives it wants per token (None: not asked);
    `top_logprobs` without `logprobs: true` is refused, as OpenAI and vLLM refuse it."""
    top = given.get("top_logprobs")
    if top is not None:
        top = _within("top_logprobs", top, 0, MAX_TOP_LOGPROBS)
        if top and not given.get("logprobs"):
            raise _LineError("invalid_field", "body.top_logprobs needs body.logprobs: true")
    return (top or 0) if given.get("logprobs") else None


def _stop(value: str | list[str]) -> list[str]:
    stops = [value] if isinstance(value, str) else list(value)
    if not all(stops):
        raise _LineError("invalid_field", "body.stop must be a non-empty string or a list of them")
    if len(stops) > MAX_STOP_SEQUENCES:
        raise _LineError("invalid_field", f"body.stop has {len(stops)} sequences; at most {MAX_STOP_SEQUENCES}")
    return stops


def _response_format(value: dict) -> dict:
    """OpenAI's response format (its type already checked) as the constraint recorded for the line:
    a json_schema one needs a schema (optional in OpenAI's type) that is a valid JSON schema."""
    if value["type"] != "json_schema":
        return {"type": value["type"]}
    spec = value["json_schema"]
    schema = spec.get("schema")
    if not schema:
        raise _LineError(
            "invalid_field", "body.response_format.json_schema.schema must be a non-empty JSON schema object"
        )
    import jsonschema

    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise _LineError(
            "invalid_field",
            f"body.response_format.json_schema.schema is not a valid JSON schema: {exc.message[:160]}",
        ) from None
    return {"type": "json_schema", "json_schema": {"name": spec.get("name"), "schema": schema}}


def _structured_outputs(value: object) -> dict:
    """vLLM's own constraint field (`structured_outputs: {"choice": [...]}` or `{"regex": "..."}`),
    which vLLM's run-batch takes and the `batch_api` engine sends for a choices or regex task (OpenAI
    has no equivalent), recorded in the `response_format` column as `{"type": "choice"|"regex", ...}`."""
    if not isinstance(value, dict) or len(value) != 1 or not {"choice", "regex"} & set(value):
        raise _LineError(
            "unsupported_field", 'body.structured_outputs must be {"choice": [texts]} or {"regex": "pattern"}'
        )
    if "regex" in value:
        if not isinstance(value["regex"], str) or not value["regex"]:
            raise _LineError("invalid_field", "body.structured_outputs.regex must be a non-empty string")
        _task_check(check_label_regex, value["regex"], "output.regex", "body.structured_outputs.regex")
        return {"type": "regex", "regex": value["regex"]}
    choices = value["choice"]
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise _LineError("invalid_field", "body.structured_outputs.choice must be a non-empty list of texts")
    choices = list(dict.fromkeys(choices))
    _task_check(check_choices, choices, "output.choices", "body.structured_outputs.choice")
    return {"type": "choice", "choice": choices}


def _task_check(check: Any, value: Any, key: str, field: str) -> None:
    """A task file's check of its output constraint (`OutputSpec`, which `output_for` builds from the
    line's) run on the line's, so a constraint no task could have is this line's `invalid_field`."""
    try:
        check(value)
    except SettingError as exc:
        raise _LineError("invalid_field", str(exc).replace(key, field, 1)) from None


@dataclass
class _ImageReader:
    """Reads a line's `image_url` parts: `found` gets each picture's bytes (a URL the endpoint
    fetches: `_URL_MARK` and the URL) and `details` its `detail`, in the order of the line's parts;
    `pixels` counts the pixels of the pictures read here."""

    limits: ImageLimits
    found: list[bytes] = dataclasses.field(default_factory=list)
    details: list[str] = dataclasses.field(default_factory=list)
    pixels: int = 0

    def digest(self) -> str:
        """The request's picture name: the pictures' bytes (a fetched URL: the URL), and a `detail`
        other than OpenAI's default, which changes the answer; never the data URL's text."""
        if set(self.details) == {"auto"}:
            return image_digest(self.found)
        return image_digest([*self.found, json.dumps(self.details).encode()])

    def part(self, part: dict, where: str) -> dict:
        unknown = sorted(set(part) - {"type", "image_url"})
        if unknown:
            raise _LineError("unsupported_field", f"{where}.{unknown[0]} is not supported (type and image_url are)")
        image_url = part.get("image_url")
        if not isinstance(image_url, dict) or not isinstance(image_url.get("url"), str):
            given = _kind(image_url) if not isinstance(image_url, dict) else f"url {_kind(image_url.get('url'))}"
            raise _LineError("invalid_message", f"{where}.image_url is {given}; it must be an object with a url string")
        unknown = sorted(set(image_url) - {"url", "detail"})
        if unknown:
            raise _LineError(
                "unsupported_field", f"{where}.image_url.{unknown[0]} is not supported (url and detail are)"
            )
        if "detail" in image_url and image_url["detail"] not in IMAGE_DETAILS:
            raise _LineError(
                "invalid_field",
                f"{where}.image_url.detail {_json_text(image_url['detail'])} is not one of {', '.join(IMAGE_DETAILS)}",
            )
        url = image_url["url"].strip()
        try:
            self.found.append(self._image(url))
        except ImageInputError as exc:
            raise _LineError(exc.code, f"{where}.image_url.url: {exc.cause}") from None
        self.details.append(image_url.get("detail", "auto"))
        return {"type": "image_url", "image_url": {**image_url, "url": url}}

    def _image(self, url: str) -> bytes:
        scheme = url.split(":", 1)[0].lower() if ":" in url else ""
        if scheme == "data":
            data = data_url_bytes(url)
            self.pixels += check_image(data, self.limits)
            return data
        if scheme in ("http", "https") and self.limits.fetch_urls:
            return _URL_MARK + url.encode("utf-8")
        if scheme in ("http", "https"):
            raise ImageInputError(
                "image_url_not_allowed",
                f"{url[:80]} is fetched only where the task lets its endpoint fetch image URLs "
                "(input.images.fetch_urls: true, engine.kind openai or batch_api); else send a data: URL",
            )
        raise ImageInputError("image_url_not_allowed", f"{url[:80]} is neither a data: URL nor an http(s) URL")


# Marks a fetched URL among a line's image bytes: no image's bytes begin so.
_URL_MARK = b"url\x00"


def _image_parts(messages: list[dict]) -> list[dict]:
    return [
        part
        for message in messages
        if isinstance(message["content"], list)
        for part in message["content"]
        if part["type"] == "image_url"
    ]


def line_images(messages: list[dict]) -> list[bytes]:
    """The pictures of a line's messages as the in-process engine is given them: each `data:`
    URL's bytes, in order (its lines never carry a URL to fetch: the task spec refuses it)."""
    return [data_url_bytes(part["image_url"]["url"]) for part in _image_parts(messages)]


def template_messages(messages: list[dict]) -> list[dict]:
    """The messages a chat template renders: each `image_url` part as the image placeholder part
    (`{"type": "image"}`), which a vision-language model's template turns into its image token."""
    return [
        {**message, "content": [{"type": "image"} if p["type"] == "image_url" else p for p in message["content"]]}
        if isinstance(message["content"], list)
        else message
        for message in messages
    ]


def _messages(value: object, images: _ImageReader) -> list[dict]:
    if value is None or value == []:
        raise _LineError("empty_messages", "body.messages is missing or empty")
    if not isinstance(value, list):
        raise _LineError("invalid_field", f"body.messages is {_kind(value)}, not a list")
    messages = []
    for position, message in enumerate(value):
        where = f"body.messages[{position}]"
        if not isinstance(message, dict):
            raise _LineError("invalid_message", f"{where} is {_kind(message)}, not an object")
        role = message.get("role")
        if role not in MESSAGE_ROLES:
            hint = " (tool calls are not supported)" if role in ("tool", "function") else ""
            raise _LineError("invalid_message", f"{where}.role {role!r} is not one of {', '.join(MESSAGE_ROLES)}{hint}")
        for field in message:
            if field not in ("role", "content", "name"):
                raise _LineError("unsupported_field", f"{where}.{field} is not supported (role, content and name are)")
        normalized = {"role": role, "content": _content(message.get("content"), where, images, role)}
        if isinstance(message.get("name"), str):
            normalized["name"] = message["name"]
        messages.append(normalized)
    return messages


def _content(content: object, where: str, images: _ImageReader, role: str) -> str | list[dict]:
    """Text content; a list of text parts is joined with newlines, as vLLM does for string templates.
    A list with `image_url` parts (a user message's only, as OpenAI has it) stays a list of text
    and image parts in the line's order, each picture read and checked."""
    if isinstance(content, str):
        return content
    if content == []:
        raise _LineError("invalid_message", f"{where}.content is an empty list")
    if not isinstance(content, list):
        raise _LineError("invalid_message", f"{where}.content is {_kind(content)}, not text")
    if not any(isinstance(part, dict) and part.get("type") == "image_url" for part in content):
        return "\n".join(_text_part(part, f"{where}.content[{index}]") for index, part in enumerate(content))
    if role != "user":
        raise _LineError("invalid_message", f"{where} is a {role} message; only user messages may hold image_url parts")
    parts: list[dict] = []
    for index, part in enumerate(content):
        at = f"{where}.content[{index}]"
        if isinstance(part, dict) and part.get("type") == "image_url":
            parts.append(images.part(part, at))
        else:
            parts.append({"type": "text", "text": _text_part(part, at)})
    return parts


def _text_part(part: object, where: str) -> str:
    if not isinstance(part, dict):
        raise _LineError("invalid_message", f"{where} is {_kind(part)}, not a content part object")
    if part.get("type") != "text":
        raise _LineError(
            "invalid_message",
            f"{where} is a part of type {part.get('type')!r}; only text and image_url parts are supported",
        )
    text = part.get("text")
    if not isinstance(text, str):
        given = "missing" if "text" not in part else _kind(text)
        raise _LineError("invalid_message", f"{where}.text is {given}; the text of a text part must be a string")
    return text


def _completion_prompt(value: object) -> str:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
        value = value[0]  # one prompt in a list is one request
    if isinstance(value, list) and len(value) > 1:
        raise _LineError("unsupported_field", "body.prompt holds several prompts; put each on its own line")
    if value is None or value == "":
        raise _LineError("empty_messages", "body.prompt is missing or empty")
    if not isinstance(value, str):
        raise _LineError("unsupported_field", f"body.prompt is {_kind(value)}; only a text prompt is supported")
    return value


def _embedding_texts(value: object) -> list[str]:
    """`body.input` of an embeddings line as its texts: a text, or a list of up to 2048 texts."""
    texts = [value] if isinstance(value, str) else value
    if value is None or value == "" or value == []:
        raise _LineError("empty_input", "body.input is missing or empty")
    if not isinstance(texts, list):
        raise _LineError("invalid_field", f"body.input is {_kind(value)}; it must be a text or a list of texts")
    if all(isinstance(item, int) and not isinstance(item, bool) for item in texts) or all(
        isinstance(item, list) for item in texts
    ):
        raise _LineError(
            "unsupported_field", "body.input holds token ids; this pipeline embeds text: send the text itself"
        )
    if len(texts) > MAX_EMBEDDING_INPUTS:
        raise _LineError("invalid_field", f"body.input holds {len(texts)} texts; at most {MAX_EMBEDDING_INPUTS} a line")
    for position, text in enumerate(texts):
        where = "body.input" if isinstance(value, str) else f"body.input[{position}]"
        if not isinstance(text, str):
            raise _LineError("invalid_field", f"{where} is {_kind(text)}, not a text")
        if not text.strip():
            raise _LineError("empty_input", f"{where} is {'empty' if not text else 'blank'}")
    return texts


# --- formatting -------------------------------------------------------------------------------


class RequestSampling(SamplingSpec):
    """A line's sampling: the task's sampling fields plus the line's stop strings and, when it asks
    for `logprobs`, its `top_logprobs` (the alternatives per token returned with each sampled token's
    log-probability; None: not asked)."""

    stop: tuple[str, ...] | None = None
    logprobs: int | None = None


@dataclass(frozen=True)
class RequestSpec:
    """What one line asks of the engine, resolved against the task's defaults."""

    sampling: RequestSampling
    output: OutputSpec | None  # None: free text

    def params_json(self, sample_id: str | None) -> str:
        """Canonical JSON of everything besides the prompt that decides the output: part of the
        request key, so identical requests share a result and different sampling never does.
        `sample_id` makes a non-deterministic request (temperature > 0, no seed) its own."""
        value: dict[str, Any] = {
            # `logprobs` only when asked: the keys of lines without it stay as they were before it.
            "sampling": self.sampling.model_dump(exclude={"logprobs"} if self.sampling.logprobs is None else None),
            # `confidence` asks for log-probabilities only; it decides nothing of the output.
            "output": self.output.model_dump(exclude_none=True, exclude={"confidence"})
            if self.output is not None
            else None,
        }
        if sample_id is not None:
            value["sample"] = sample_id
        return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"))

    @classmethod
    def from_params_json(cls, text: str) -> RequestSpec:
        value = json.loads(text)
        output = value.get("output")
        return cls(
            sampling=RequestSampling(**value["sampling"]),
            output=OutputSpec(**output) if output else None,
        )


def output_for(response_format: str | None) -> OutputSpec | None:
    """`response_format` as the structured-output constraint the engine enforces."""
    if response_format is None:
        return None
    value = json.loads(response_format)
    if value["type"] == "json_schema":
        return OutputSpec(kind="json_schema", json_schema=value["json_schema"]["schema"])
    if value["type"] == "json_object":
        # Any JSON object: the schema form of OpenAI's JSON mode.
        return OutputSpec(kind="json_schema", json_schema={"type": "object"})
    if value["type"] == "choice":
        return OutputSpec(kind="choices", choices=value["choice"], confidence=False)
    if value["type"] == "regex":
        return OutputSpec(kind="regex", regex=value["regex"], confidence=False)
    return None


def request_spec(row: dict, defaults: SamplingSpec) -> RequestSpec:
    def pick(field: str):
        return row[field] if row.get(field) is not None else getattr(defaults, field)

    sampling = RequestSampling(
        temperature=pick("temperature"),
        top_p=pick("top_p"),
        max_tokens=pick("max_tokens"),
        seed=pick("seed"),
        stop=tuple(json.loads(row["stop"])) if row.get("stop") else None,
        logprobs=row.get("top_logprobs"),
    )
    return RequestSpec(sampling=sampling, output=output_for(row.get("response_format")))


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
        return _error(code, self.source_file, line, message)


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
            error = _error("unsupported_url", source_file, line, _NOT_A_CHAT_TASK.format(url=row["url"]))
        if error is None and accepted_models is not None and not model_matches(row["model"], accepted_models):
            error = _error("model_mismatch", source_file, line, _model_mismatch(row["model"], accepted_models))
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


# --- what the engine is sent -------------------------------------------------------------------


def batch_prompt_encoder(engine, task, tokenizer: Tokenizer, formatted: pl.DataFrame):
    """`encode(texts, request_params)` for `run_inference`: each request as an engine `Prompt` with
    its own sampling (stop strings included) and output constraint, and, for an engine that sends
    chat messages, the line's messages (its `image_url` parts as written); for the in-process
    engine, a line's pictures (`Prompt.images`, decoded from its data: URLs)."""
    valid = formatted.filter(pl.col("error").is_null())
    digests = valid[DIGEST_COLUMN].to_list() if DIGEST_COLUMN in valid.columns else [None] * valid.height
    # Identical prompt texts come from identical messages, so the prompt is a safe key for them; a
    # rendered prompt holds no picture, so an image line's is found with its pictures' digest. The
    # in-process engine needs only image lines' messages (for their pictures).
    messages_of = {
        (prompt, digest): messages
        for prompt, digest, messages in zip(
            valid["prompt"].to_list(), digests, valid["messages"].to_list(), strict=True
        )
        if engine.sends_chat_messages or digest is not None
    }

    def encode(
        prompts: list[str],
        params: list[str],
        keys: list[str] | None = None,
        image_digests: list[str | None] | None = None,
    ) -> list[Prompt]:
        token_ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
        out = []
        digests_of = image_digests if image_digests is not None else [None] * len(prompts)
        for prompt, ids, param, key, digest in zip(
            prompts, token_ids, params, keys_of(prompts, keys), digests_of, strict=True
        ):
            spec = RequestSpec.from_params_json(param)
            text = messages_of.get((prompt, digest))
            messages = json.loads(text) if text else None
            if engine.sends_chat_messages:
                out.append(
                    Prompt(tuple(ids), tuple(messages) if messages else None, spec.sampling, spec.output, key=key)
                )
            else:
                images = tuple(line_images(messages)) if messages else ()
                out.append(Prompt(tuple(ids), None, spec.sampling, spec.output, key=key, images=images))
        return out

    return encode
