"""`input:`: which files a task reads and which fields of a record feed the prompt."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from .base import SettingError, _Strict

DEFAULT_MAX_ROWS_PER_PARTITION = 1_000_000


class InputSpec(_Strict):
    """Which fields of an input record feed the prompt.

    `format: records` (default): records of .jsonl/.csv/.parquet/.txt files whose `text_fields` fill
    the task's prompt template. `format: openai_batch`: .jsonl files in the OpenAI Batch API request
    format, each line carrying its own messages and sampling (see `pipeline/openai_batch/`); no
    `text_fields` and no `prompt` section then.
    """

    format: Literal["records", "openai_batch"] = "records"
    text_fields: list[str] = Field(default_factory=list)
    # `.txt` drops have one prompt a line; that line is read into this field. Unset: the only text
    # field, or `text`; a `.txt` drop of a task whose text_fields have neither is refused when read.
    txt_field: str = "text"
    # openai_batch only: a line whose `body.model` is not the task's model becomes an error line
    # (`model_mismatch`). Off: the task's engine answers every line, whatever model it names.
    require_model_match: bool = False
    # A file with more records is split into shards of at most this many, one partition each:
    # a run holds its partitions in memory, so this bounds a run's memory whatever the file's size
    # (see BENCHMARKS.md for memory per row). Not part of any code version: it decides how rows are
    # grouped into partitions, never what a row's answer is.
    max_rows_per_partition: int = Field(default=DEFAULT_MAX_ROWS_PER_PARTITION, ge=1, strict=True)
    # Embedding and similarity tasks: a text longer than the model's limit is cut to it (the row's
    # `truncated` is true) instead of becoming an `input_too_long` error row.
    truncate: bool = Field(default=False, strict=True)
    # Fields whose values are images (a path relative to the drop file, an `s3://` URI in the data
    # root's bucket, a `data:` URL, or a parquet binary cell), each sent with the row's message to a
    # vision-language model (pipeline/inputs/images.py); `images` limits them.
    image_fields: list[str] = Field(default_factory=list)
    images: ImageLimits = Field(default_factory=lambda: ImageLimits())

    @model_validator(mode="before")
    @classmethod
    def _txt_field_defaults_to_the_only_text_field(cls, raw: Any) -> Any:
        if isinstance(raw, dict) and "txt_field" not in raw:
            fields = raw.get("text_fields")
            if isinstance(fields, list) and len(fields) == 1 and isinstance(fields[0], str):
                return {**raw, "txt_field": fields[0]}
        return raw

    @property
    def shard_rows(self) -> int | None:
        """Records per shard of a bigger file; None: files are never split (OpenAI batch files)."""
        return self.max_rows_per_partition if self.format == "records" else None

    @model_validator(mode="after")
    def _fields_fit_the_format(self) -> InputSpec:
        if self.format == "openai_batch":
            if "max_rows_per_partition" in self.model_fields_set:
                raise SettingError(
                    "input.max_rows_per_partition applies to format records: OpenAI batch files are not split "
                    "(the OpenAI Batch API takes at most 50,000 requests a file); remove it",
                    ("max_rows_per_partition",),
                )
            if self.text_fields:
                raise SettingError(
                    "input.text_fields is not used with format openai_batch (each line carries its messages); "
                    "remove it",
                    ("text_fields",),
                )
            if self.image_fields:
                raise SettingError(
                    "input.image_fields is not used with format openai_batch (a line's messages carry their "
                    "images as image_url parts); remove it",
                    ("image_fields",),
                )
            return self
        if self.require_model_match:
            raise SettingError(
                "input.require_model_match applies to format openai_batch only", ("require_model_match",)
            )
        if set(self.image_fields) & set(self.text_fields):
            raise SettingError("input.image_fields and input.text_fields must not share a field", ("image_fields",))
        if not self.text_fields and not self.image_fields:
            raise SettingError("input.text_fields must name at least one input field", ("text_fields",))
        # Only a txt_field the task sets must be a text field: the default matters for .txt drops alone.
        if "txt_field" in self.model_fields_set and self.txt_field not in self.text_fields:
            raise SettingError(
                f"txt_field {self.txt_field!r} must be one of text_fields {self.text_fields}", ("txt_field",)
            )
        return self


# Image formats read unless a task names its own (`input.images.formats`): what vision-language
# models' processors take and Pillow decodes safely; anything else is an `unsupported_image_format` row.
DEFAULT_IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")


class ImageLimits(_Strict):
    """`input.images`: limits on each image an `image_fields` value names; an image over a limit is
    that row's `image_too_large` error, never read further (decompression bombs included: the pixel
    count is checked from the header, before any pixel is decoded)."""

    max_bytes: int = Field(default=20 * 1024 * 1024, ge=1, strict=True)
    max_pixels: int = Field(default=40_000_000, ge=1, strict=True)
    formats: list[str] = Field(default_factory=lambda: list(DEFAULT_IMAGE_FORMATS))
    # OpenAI batch lines' `image_url` parts with an http(s) URL are passed to the endpoint, whose
    # server fetches them (openai_batch tasks on `engine.kind: openai` or `batch_api` only); off,
    # such a line is an `image_url_not_allowed` error. `data:` URLs are always read (and checked).
    fetch_urls: bool = Field(default=False, strict=True)
