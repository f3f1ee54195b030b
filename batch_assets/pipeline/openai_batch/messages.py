"""A chat line's `messages`: checked, normalized, and as the chat template renders them.

This pipeline takes less than OpenAI's API here (text content, and `image_url` parts in user
messages only) and says which message and part is at fault, which OpenAI's types (unions of
message and part types) cannot; so these fields are checked here, not by the SDK's types.
"""

from __future__ import annotations

from batch_assets.pipeline.openai_batch.image_parts import ImageReader
from batch_assets.pipeline.openai_batch.protocol import LineError, kind_of

MESSAGE_ROLES = ("system", "developer", "user", "assistant")


def template_messages(messages: list[dict]) -> list[dict]:
    """The messages a chat template renders: each `image_url` part as the image placeholder part
    (`{"type": "image"}`), which a vision-language model's template turns into its image token."""
    return [
        {**message, "content": [{"type": "image"} if p["type"] == "image_url" else p for p in message["content"]]}
        if isinstance(message["content"], list)
        else message
        for message in messages
    ]


def chat_messages(value: object, images: ImageReader) -> list[dict]:
    """`body.messages` as the row keeps them: role, content (text, or text and image parts) and name."""
    if value is None or value == []:
        raise LineError("empty_messages", "body.messages is missing or empty")
    if not isinstance(value, list):
        raise LineError("invalid_field", f"body.messages is {kind_of(value)}, not a list")
    messages = []
    for position, message in enumerate(value):
        where = f"body.messages[{position}]"
        if not isinstance(message, dict):
            raise LineError("invalid_message", f"{where} is {kind_of(message)}, not an object")
        role = message.get("role")
        if role not in MESSAGE_ROLES:
            hint = " (tool calls are not supported)" if role in ("tool", "function") else ""
            raise LineError("invalid_message", f"{where}.role {role!r} is not one of {', '.join(MESSAGE_ROLES)}{hint}")
        for field in message:
            if field not in ("role", "content", "name"):
                raise LineError("unsupported_field", f"{where}.{field} is not supported (role, content and name are)")
        normalized = {"role": role, "content": _content(message.get("content"), where, images, role)}
        if isinstance(message.get("name"), str):
            normalized["name"] = message["name"]
        messages.append(normalized)
    return messages


def _content(content: object, where: str, images: ImageReader, role: str) -> str | list[dict]:
    """Text content; a list of text parts is joined with newlines, as vLLM does for string templates.
    A list with `image_url` parts (a user message's only, as OpenAI has it) stays a list of text
    and image parts in the line's order, each picture read and checked."""
    if isinstance(content, str):
        return content
    if content == []:
        raise LineError("invalid_message", f"{where}.content is an empty list")
    if not isinstance(content, list):
        raise LineError("invalid_message", f"{where}.content is {kind_of(content)}, not text")
    if not any(isinstance(part, dict) and part.get("type") == "image_url" for part in content):
        return "\n".join(_text_part(part, f"{where}.content[{index}]") for index, part in enumerate(content))
    if role != "user":
        raise LineError("invalid_message", f"{where} is a {role} message; only user messages may hold image_url parts")
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
        raise LineError("invalid_message", f"{where} is {kind_of(part)}, not a content part object")
    if part.get("type") != "text":
        raise LineError(
            "invalid_message",
            f"{where} is a part of type {part.get('type')!r}; only text and image_url parts are supported",
        )
    text = part.get("text")
    if not isinstance(text, str):
        given = "missing" if "text" not in part else kind_of(text)
        raise LineError("invalid_message", f"{where}.text is {given}; the text of a text part must be a string")
    return text
