"""Images of a row (`input.image_fields`): where a value points, whether its bytes are an image the
task accepts, and the content digest that names the request.

Pure functions over values and bytes: reading the bytes is storage's (`storage/image_sources.py`).
A value that cannot become an image is that row's error, `code: file line N: field 'f': cause`:

    missing_image             the field is absent, null or empty
    image_not_found           no file (or S3 object) at the path
    unsafe_image_path         an absolute path, a path leaving the drop zone (`../`), a symbolic link
    image_url_not_allowed     a URL the pipeline does not fetch (http(s), another bucket, another scheme)
    unreadable_image          bytes Pillow cannot decode (not an image, truncated, a bad data: URL)
    unsupported_image_format  an image format outside `input.images.formats`
    image_too_large           over `input.images.max_bytes` or `max_pixels` (decompression bombs too)

A request is named by its images' content, never their names: the same bytes under two paths are
one request, a file replaced under the same path is a new one (`image_digest`).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import posixpath
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import unquote_to_bytes

if TYPE_CHECKING:
    from PIL.Image import Image

    from batch_assets.pipeline.task_spec.input import ImageLimits

# The columns raw_prompts adds for an image task: each row's image bytes (one per image field, in
# the task's order), their content digest (part of the request key) and their pixel count.
IMAGES_COLUMN, DIGEST_COLUMN, PIXELS_COLUMN = "images", "image_digest", "image_pixels"
IMAGE_ERROR_CODES = (
    "missing_image",
    "image_not_found",
    "unsafe_image_path",
    "image_url_not_allowed",
    "unreadable_image",
    "unsupported_image_format",
    "image_too_large",
)


class ImageInputError(ValueError):
    """One value that is not a usable image: `code` (IMAGE_ERROR_CODES) and the cause in words."""

    def __init__(self, code: str, cause: str) -> None:
        super().__init__(cause)
        self.code, self.cause = code, cause


@dataclass(frozen=True)
class ImageSource:
    """Where a value's bytes are: `inline` bytes (a data: URL or a parquet cell), a `path` relative to
    the drop zone, or an `s3` URI."""

    inline: bytes | None = None
    path: str | None = None
    s3: str | None = None


def image_source(value: object, drop_relative_path: str) -> ImageSource:
    """What an image field's value names, relative paths resolved against the drop file's folder.
    Never reads anything; a value that may not be read raises `ImageInputError`."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        if not value:
            raise ImageInputError("missing_image", "the field is empty")
        return ImageSource(inline=bytes(value))
    if isinstance(value, dict) and set(value) <= {"bytes", "path"}:
        return _image_struct_source(value, drop_relative_path)
    if value is None or (isinstance(value, str) and not value.strip()):
        raise ImageInputError("missing_image", "the field is empty" if value is not None else "the field is null")
    if not isinstance(value, str):
        raise ImageInputError("missing_image", f"the field is {type(value).__name__}, not a path, URI or bytes")
    text = value.strip()
    lowered = text.lower()
    if lowered.startswith("data:"):
        return ImageSource(inline=data_url_bytes(text))
    if lowered.startswith("s3://"):
        return ImageSource(s3=text)
    if "://" in text:
        raise ImageInputError(
            "image_url_not_allowed",
            f"{text[:80]} is a URL, which the pipeline does not fetch: put the image in the drop zone (a path "
            "relative to the drop file), in the data root's S3 bucket, or inline it as a data: URL",
        )
    if text.startswith("/") or text.startswith("\\"):
        raise ImageInputError(
            "unsafe_image_path", f"{text[:80]} is an absolute path; paths are relative to the drop file"
        )
    if "\x00" in text:
        raise ImageInputError("unsafe_image_path", f"{text[:80]!r} holds a NUL byte, which no file name can")
    if text.endswith("/"):
        raise ImageInputError("unsafe_image_path", f"{text[:80]} names a folder, not a picture")
    joined = posixpath.normpath(posixpath.join(posixpath.dirname(drop_relative_path), text))
    if joined == ".." or joined.startswith("../") or joined in ("", "."):
        raise ImageInputError("unsafe_image_path", f"{text[:80]} leads outside the drop zone")
    return ImageSource(path=joined)


def _image_struct_source(value: dict, drop_relative_path: str) -> ImageSource:
    """A Hugging Face `datasets` Image value (parquet's struct<bytes, path>): its bytes when it has
    them (the path is then only the picture's old name), else its path, as a path field is read."""
    data, path = value.get("bytes"), value.get("path")
    if isinstance(data, (bytes, bytearray, memoryview)) and data:
        return ImageSource(inline=bytes(data))
    if isinstance(path, str) and path.strip():
        return image_source(path, drop_relative_path)
    raise ImageInputError("missing_image", "the image struct has neither bytes nor a path")


def data_url_bytes(url: str) -> bytes:
    """The bytes of a `data:[<type>][;base64],<data>` URL."""
    header, comma, payload = url.partition(",")
    if not comma:
        raise ImageInputError("unreadable_image", "a data: URL without a comma before its data")
    if header.lower().endswith(";base64"):
        try:
            data = base64.b64decode(payload.strip(), validate=True)
        except (binascii.Error, ValueError) as exc:
            raise ImageInputError("unreadable_image", f"the data: URL is not valid base64 ({exc})") from None
    else:
        data = unquote_to_bytes(payload)
    if not data:
        raise ImageInputError("missing_image", "the data: URL holds no data")
    return data


def check_image(data: bytes, limits: ImageLimits) -> int:
    """The image's pixel count, when `data` is an image within `limits`; else `ImageInputError`.
    The size is read from the header first, so a decompression bomb is refused before it is decoded."""
    from PIL import Image, UnidentifiedImageError

    if len(data) > limits.max_bytes:
        raise ImageInputError("image_too_large", f"{len(data)} bytes, over input.images.max_bytes {limits.max_bytes}")
    try:
        with warnings.catch_warnings():
            # Pillow warns (and refuses past twice its own limit); the task's limit decides here.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as image:
                fmt = (image.format or "").upper()
                if fmt not in {name.upper() for name in limits.formats}:
                    raise ImageInputError(
                        "unsupported_image_format",
                        f"a {fmt or 'unknown'} image; input.images.formats allows {', '.join(limits.formats)}",
                    )
                pixels = image.width * image.height
                if pixels > limits.max_pixels:
                    raise ImageInputError(
                        "image_too_large",
                        f"{image.width}x{image.height} = {pixels} pixels, over input.images.max_pixels "
                        f"{limits.max_pixels}",
                    )
                image.load()  # decodes every pixel: a truncated or corrupt image fails here
    except Image.DecompressionBombError as exc:
        raise ImageInputError("image_too_large", f"a decompression bomb ({exc})") from None
    except UnidentifiedImageError:
        raise ImageInputError("unreadable_image", "not an image Pillow can identify") from None
    except (OSError, SyntaxError, ValueError) as exc:  # e.g. "image file is truncated"
        if isinstance(exc, ImageInputError):
            raise
        raise ImageInputError("unreadable_image", f"the image cannot be decoded ({exc})") from None
    return pixels


def image_digest(images: list[bytes]) -> str:
    """The content name of a row's images (in field order): equal bytes, equal digest."""
    inner = ",".join(hashlib.sha256(data).hexdigest() for data in images)
    return hashlib.sha256(inner.encode()).hexdigest()


def image_error(code: str, file_name: str, line: int, field: str, cause: str) -> str:
    return f"{code}: {file_name} line {line}: field {field!r}: {cause}"


def image_data_url(data: bytes) -> str:
    """The `data:image/<fmt>;base64,...` URL of checked image bytes: how an endpoint or a batch API
    is sent a picture (an OpenAI `image_url` content part); the type is read from the image's header."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        mime = Image.MIME.get(image.format or "", "application/octet-stream")
    return f"data:{mime};base64,{base64.b64encode(data).decode('ascii')}"


def image_url_part(url: str) -> dict[str, object]:
    """An OpenAI chat content part carrying one image by URL (a `data:` URL or one the server fetches)."""
    return {"type": "image_url", "image_url": {"url": url}}


def decoded_image(data: bytes) -> Image:
    """The RGB image a model is given (the bytes were checked when the row was read)."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        return image.convert("RGB")
