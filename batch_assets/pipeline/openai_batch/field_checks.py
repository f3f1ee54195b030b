"""A line's body fields checked on maintained models: their types on OpenAI's own request types
(the `openai` SDK's TypedDicts, as a pydantic validator), the ranges OpenAI's types leave to the
server on a pydantic model of them. A wrong field is an `invalid_field` naming it (as OpenAI's
`param`) and what OpenAI's API takes there.

The fields this pipeline takes less of than OpenAI's API (messages, prompt, input,
structured_outputs) are checked where they are read (messages.py, body.py), which can say which
part of them is at fault.
"""

from __future__ import annotations

import functools
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, create_model

from batch_assets.pipeline.openai_batch.protocol import (
    CHAT_URL,
    COMPLETIONS_URL,
    EMBEDDINGS_URL,
    LineError,
    json_text,
    kind_of,
)

# OpenAI's most alternatives per token a chat line may ask for (`top_logprobs`); vLLM's default
# `max_logprobs` engine argument is the same.
MAX_TOP_LOGPROBS = 20
_INT64 = (-(2**63), 2**63 - 1)
# OpenAI's ranges of the body's numbers: (lowest, highest, whether the lowest is excluded).
RANGES: dict[str, tuple[float, float, bool]] = {
    "max_completion_tokens": (1, _INT64[1], False),
    "max_tokens": (1, _INT64[1], False),
    "temperature": (0.0, 2.0, False),
    "top_p": (0.0, 1.0, True),
    "seed": (*_INT64, False),
    "top_logprobs": (0, MAX_TOP_LOGPROBS, False),
}
# The body fields checked where they are read (messages.py, body.py): OpenAI's types
# (unions of message and part types, their lists checked lazily) cannot say which part is at fault.
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

    return TypeAdapter(
        {
            CHAT_URL: chat_create_params.CompletionCreateParamsNonStreaming,
            COMPLETIONS_URL: completion_create_params.CompletionCreateParamsNonStreaming,
            EMBEDDINGS_URL: embedding_create_params.EmbeddingCreateParams,
        }[url]
    )


def typed_fields(body: dict, url: str) -> dict[str, Any]:
    """The body's fields (but `_OWN_CHECKS`) once their types are OpenAI's; a wrong type is an
    `invalid_field` naming the field (as OpenAI's `param`) and what OpenAI's API takes there.

    What OpenAI's types leave to the server is checked after: ranges by `range_problems`, at most
    4 stops by the caller.
    Two differences from OpenAI's types keep what vLLM's request models, which answer these lines,
    accept: a JSON null is a field not given (OpenAI's types allow null on some fields only), and
    an integral number such as 12.0 is an integer (vLLM's models are lax there; some JSON writers
    write every number as a float)."""
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
            raise LineError("invalid_field", _type_problem(given, errors)) from None
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
    given = json_text(value) if same[0]["type"] == "literal_error" else kind_of(value)
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


def _ranged(low: float, high: float, low_open: bool) -> Any:
    bound = Field(gt=low, le=high) if low_open else Field(ge=low, le=high)
    return Annotated[float, bound] if isinstance(low, float) else Annotated[int, bound]


# The numbers' ranges as a model: NaN and Infinity are not numbers there (OpenAI refuses them).
_Ranges: type[BaseModel] = create_model(
    "BodyRanges",
    __config__=ConfigDict(allow_inf_nan=False),
    **{field: (_ranged(*bounds), None) for field, bounds in RANGES.items()},  # type: ignore[call-overload]
)


def range_problems(given: dict[str, Any]) -> dict[str, str]:
    """Each field of `given` (its types OpenAI's) outside OpenAI's range, with the line's problem."""
    numbers = {field: given[field] for field in RANGES if field in given}
    try:
        _Ranges.model_validate(numbers)
    except ValidationError as exc:
        problems = {}
        for error in exc.errors(include_url=False):
            field = str(error["loc"][0])
            value = numbers[field]
            if error["type"] == "finite_number" and isinstance(value, float):
                problems[field] = f"body.{field} is {json_text(value)}; it must be a finite number"
            else:
                low, high, low_open = RANGES[field]
                bound = f"more than {low}" if low_open else f"at least {low}"
                problems[field] = f"body.{field} is {value}; it must be {bound} and at most {high}"
        return problems
    return {}
