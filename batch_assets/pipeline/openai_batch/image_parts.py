"""The `image_url` parts of a chat line's messages, accepted as OpenAI takes them.

A `data:` URL is decoded and checked here against the task's `input.images` (pipeline/inputs/images.py):
its bytes' digest names the request (`image_digest`). An http(s) URL is taken only with
`input.images.fetch_urls` (an endpoint's server fetches it; the URL names the request); any other
scheme is refused. The messages keep the parts as written: an endpoint is sent them as they are,
the in-process engine the decoded pictures (`line_images`).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from batch_assets.pipeline.inputs.images import ImageInputError, check_image, data_url_bytes, image_digest
from batch_assets.pipeline.openai_batch.protocol import LineError, json_text, kind_of
from batch_assets.pipeline.task_spec.input import ImageLimits

# An image part's `image_url.detail` values (OpenAI's; recorded and passed to an endpoint).
IMAGE_DETAILS = ("auto", "low", "high")
# Marks a fetched URL among a line's image bytes: no image's bytes begin so.
_URL_MARK = b"url\x00"


@dataclass
class ImageReader:
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
            raise LineError("unsupported_field", f"{where}.{unknown[0]} is not supported (type and image_url are)")
        image_url = part.get("image_url")
        if not isinstance(image_url, dict) or not isinstance(image_url.get("url"), str):
            given = kind_of(image_url) if not isinstance(image_url, dict) else f"url {kind_of(image_url.get('url'))}"
            raise LineError("invalid_message", f"{where}.image_url is {given}; it must be an object with a url string")
        unknown = sorted(set(image_url) - {"url", "detail"})
        if unknown:
            raise LineError(
                "unsupported_field", f"{where}.image_url.{unknown[0]} is not supported (url and detail are)"
            )
        if "detail" in image_url and image_url["detail"] not in IMAGE_DETAILS:
            raise LineError(
                "invalid_field",
                f"{where}.image_url.detail {json_text(image_url['detail'])} is not one of {', '.join(IMAGE_DETAILS)}",
            )
        url = image_url["url"].strip()
        try:
            self.found.append(self._image(url))
        except ImageInputError as exc:
            raise LineError(exc.code, f"{where}.image_url.url: {exc.cause}") from None
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
