"""What an OpenAI Batch API request file is to this pipeline: its urls, the codes of the lines it
cannot answer, and the raw_prompts table its lines become.

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

Every code above is a bad request (HTTP 400 in the error file); any other code on a row (the
engine's) is a server failure (500).
"""

from __future__ import annotations

import json

import polars as pl

from batch_assets.pipeline.inputs.images import DIGEST_COLUMN, IMAGE_ERROR_CODES, PIXELS_COLUMN

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
EMBEDDINGS_URL = "/v1/embeddings"
SUPPORTED_URLS = (CHAT_URL, COMPLETIONS_URL, EMBEDDINGS_URL)

# The codes of lines the request itself makes unanswerable (the list above).
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
# The columns a file with image lines has besides RAW_SCHEMA's (null on its text lines): a file
# without images keeps the text schema, and its requests their keys.
IMAGE_SCHEMA = {DIGEST_COLUMN: pl.String, PIXELS_COLUMN: pl.Int64}


class LineError(Exception):
    """A line this pipeline cannot answer: its `code` (one of REQUEST_ERROR_CODES) and why."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def line_error(code: str, file_name: str, line: int, message: str) -> str:
    """An error row's `error`: `code: file line N: message`."""
    return f"{code}: {file_name} line {line}: {message}"


def kind_of(value: object) -> str:
    """What a JSON value is, in a message's words."""
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number", float: "a number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def json_text(value: object) -> str:
    """`value` as the line wrote it (NaN and Infinity as JSON spells them), cut for a message."""
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 80 else text[:77] + "..."
