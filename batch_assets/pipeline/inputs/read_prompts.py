"""Parse a drop file into one row per input record, never losing a record.

Pure functions over bytes: no Dagster, no storage. The result always has `row_id` (0-based, input
order), `source_line` (1-based line of the file where the record starts; the row number for
parquet), every input column as read, and `error` (null, or `code: message` naming the file and line).

A record that cannot be read becomes a row with an error, so the partition still succeeds and the
row is visible in the output:

    invalid_utf8      the line holds bytes that are not UTF-8 (kept with U+FFFD in their place)
    invalid_unicode   a JSON `\\uXXXX` escape is half a surrogate pair (replaced by U+FFFD)
    malformed_json    the line is not JSON
    not_an_object     the line is JSON but not an object
    empty_record      a blank line in a .jsonl or .csv file
    malformed_csv     a CSV record with more or fewer fields than the header
    missing_field     the record lacks a text field (other records have it)
    null_text         the text field is null
    non_string_text   the text field is a number, list, object... (kept as JSON text)

Inputs are `.jsonl`, `.csv`, `.parquet` and `.txt`; `.jsonl.gz`, `.csv.gz` and `.txt.gz` are the
same formats gzip-compressed (parquet compresses inside the file).

Only a problem with the file as a whole raises `DropFileError` and fails the partition: an unknown
suffix, an incomplete or corrupt gzip file, an unreadable parquet file, or a text field that no
record has (the message lists the columns or fields that were found, which is what a wrong field
name in the task YAML looks like).
An empty file (nothing but whitespace), or a CSV with only its header row, gives zero rows.
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import re
import sys
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import polars as pl

if TYPE_CHECKING:
    from batch_assets.pipeline.task_spec.input import ImageLimits

SUPPORTED_SUFFIXES = (".jsonl", ".csv", ".parquet", ".txt", ".jsonl.gz", ".csv.gz", ".txt.gz")
# Columns the pipeline adds or uses on the way; an input column with one of these names is kept
# as `input.<name>` so it can never be overwritten or confused with the pipeline's own.
RESERVED_COLUMNS = frozenset(
    {
        "row_id",
        "source_line",
        "error",
        "prompt",
        "user_message",
        "num_prompt_tokens",
        "request_key",
        "label",
        "generated_text",
        "finish_reason",
        "num_generated_tokens",
        "cumulative_logprob",
        "token_logprobs",
        "confidence",
        "embedding",
        "similarity",
        "truncated",
        "images",
        "image_digest",
        "image_pixels",
    }
)
# Records are collected into polars frames this many at a time, so a file of millions of rows
# never holds more than one chunk as Python objects.
CHUNK_ROWS = 100_000
_BOM = b"\xef\xbb\xbf"
_SURROGATE = re.compile("[\ud800-\udfff]")
_FIELDS_SHOWN = 50


class DropFileError(ValueError):
    """The file as a whole cannot be used (as opposed to one bad record, which becomes an error row)."""


@dataclass(frozen=True)
class ParseOptions:
    text_fields: tuple[str, ...]
    txt_field: str = "text"
    format: str = "records"  # or "openai_batch": OpenAI Batch API request lines (pipeline/openai_batch/ reads them)
    # `input.images`: an openai_batch file's limits on its lines' `image_url` parts (None: the defaults).
    images: ImageLimits | None = None


@dataclass(frozen=True)
class FilePart:
    """Where the bytes being read sit in their drop file, when they are one shard of it
    (pipeline/inputs/file_shards.py): the `row_id` of their first record, how many lines of the file come
    before their first line (a CSV shard starts with the header row, so those lines are not counted
    twice), and whether they are already decompressed. Rows and error messages then number
    records and lines as in the whole file."""

    first_row: int = 0
    line_offset: int = 0
    decompressed: bool = False


WHOLE_FILE = FilePart()


def input_suffix(file_name: str) -> str | None:
    """The supported suffix a file name ends with (`.jsonl.gz` before `.gz`), any case; else None."""
    name = file_name.rsplit("/", 1)[-1].lower()
    for suffix in sorted(SUPPORTED_SUFFIXES, key=len, reverse=True):
        if name.endswith(suffix) and len(name) > len(suffix):
            return suffix
    return None


def read_prompts(data: bytes, file_name: str, options: ParseOptions, part: FilePart = WHOLE_FILE) -> pl.DataFrame:
    """Parse the bytes of one drop file of records (or of one shard of it, see `FilePart`), by its
    suffix, into the raw_prompts table. (OpenAI batch files: `openai_batch.read_batch_requests`.)"""
    suffix = input_suffix(file_name)
    if suffix is None:
        raise DropFileError(f"{file_name}: unsupported file type; inputs are {', '.join(SUPPORTED_SUFFIXES)}")
    if suffix.endswith(".gz"):
        data = data if part.decompressed else gunzip(data, file_name)
        suffix = suffix.removesuffix(".gz")
    if suffix == ".parquet":
        return read_parquet_frame(_parquet_frame(data, file_name), file_name, options, part)
    if data.startswith(_BOM):
        data = data[len(_BOM) :]
    if not data.strip():
        return _finish(pl.DataFrame(), [], [], options, part)
    if suffix == ".jsonl":
        return _finish(*_read_jsonl(data, file_name, options, part.line_offset), options, part)
    if suffix == ".csv":
        return _finish(*_read_csv(data, file_name, options, part.line_offset), options, part)
    return _finish(*_read_txt(data, file_name, options, part.line_offset), options, part)


def read_parquet_frame(frame: pl.DataFrame, file_name: str, options: ParseOptions, part: FilePart) -> pl.DataFrame:
    """The raw_prompts table of rows read from a parquet file (all of it, or a shard's rows)."""
    return _finish(*_read_parquet(frame, file_name, options, part.first_row), options, part)


def gunzip(data: bytes, file_name: str) -> bytes:
    """A gzip drop file's bytes; an incomplete or unreadable one is a `DropFileError` naming it."""
    try:
        return gzip.decompress(data)
    except EOFError as exc:  # an upload cut short, or still in progress
        raise DropFileError(f"{file_name}: the gzip file is incomplete ({exc}); drop the whole file again") from None
    except (OSError, zlib.error) as exc:  # gzip.BadGzipFile is an OSError
        raise DropFileError(f"{file_name}: not a readable gzip file ({exc})") from None


def _error(code: str, file_name: str, line: int, message: str) -> str:
    return f"{code}: {file_name} line {line}: {message}"


def _lines(data: bytes, file_name: str, line_offset: int) -> Iterator[tuple[int, str, str | None]]:
    """(line number, text, decoding error) per line; only `\\n` ends a line, a trailing `\\r` is dropped.

    A final newline ends the last line; it does not start an empty record.
    """
    try:
        lines: list = data.decode("utf-8").split("\n")
        strict = True
    except UnicodeDecodeError:
        lines, strict = data.split(b"\n"), False
    if lines and not lines[-1]:
        lines.pop()
    for index, line in enumerate(lines):
        number = index + 1 + line_offset
        if strict:
            yield number, line[:-1] if line.endswith("\r") else line, None
            continue
        raw = line[:-1] if line.endswith(b"\r") else line
        try:
            yield number, raw.decode("utf-8"), None
        except UnicodeDecodeError as exc:
            reason = f"byte {exc.start + 1} of the line is not UTF-8 ({exc.reason}); replaced by U+FFFD"
            yield number, raw.decode("utf-8", errors="replace"), _error("invalid_utf8", file_name, number, reason)


def _without_surrogates(text: str) -> str:
    return _SURROGATE.sub("\ufffd", text)


def _json_cell(value: object) -> str | None:
    """Input values are kept as text: strings as they are, other JSON values as JSON."""
    if value is None or isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False)


def _text_field_error(record: dict, fields: tuple[str, ...], file_name: str, line: int) -> str | None:
    for field in fields:
        if field not in record:
            return _error("missing_field", file_name, line, f"field {field!r} is missing")
        value = record[field]
        if value is None:
            return _error("null_text", file_name, line, f"field {field!r} is null")
        if not isinstance(value, str):
            kind = {dict: "an object", list: "a list", bool: "a boolean", int: "a number", float: "a number"}.get(
                type(value), type(value).__name__
            )
            return _error("non_string_text", file_name, line, f"field {field!r} is {kind}, not a string")
    return None


class _ColumnChunks:
    """Collects records as string columns and turns every CHUNK_ROWS of them into a polars frame."""

    def __init__(self, columns: list[str] | None = None) -> None:
        self.fixed = columns
        self.frames: list[pl.DataFrame] = []
        self.rows = 0
        self._reset()

    def _reset(self) -> None:
        self.columns: dict[str, list[str | None]] = {name: [] for name in self.fixed or []}
        self.rows = 0

    def add(self, record: dict[str, str | None]) -> None:
        for key in record:
            if key not in self.columns:
                self.columns[key] = [None] * self.rows
        for key, values in self.columns.items():
            values.append(record.get(key))
        self.rows += 1
        if self.rows >= CHUNK_ROWS:
            self.flush()

    def add_row(self, cells: list[str | None]) -> None:
        """A record of a fixed-column (CSV) file, one cell per column."""
        for values, cell in zip(self.columns.values(), cells, strict=True):
            values.append(cell)
        self.rows += 1
        if self.rows >= CHUNK_ROWS:
            self.flush()

    def flush(self) -> None:
        if self.rows or not self.frames:
            self.frames.append(pl.DataFrame(self.columns, schema=dict.fromkeys(self.columns, pl.String)))
        self._reset()

    def frame(self) -> pl.DataFrame:
        self.flush()
        frames = [frame for frame in self.frames if frame.height] or self.frames[:1]
        return pl.concat(frames, how="diagonal") if len(frames) > 1 else frames[0]


def _read_jsonl(
    data: bytes, file_name: str, options: ParseOptions, line_offset: int
) -> tuple[pl.DataFrame, list[int], list[str | None]]:
    chunks = _ColumnChunks()
    lines: list[int] = []
    errors: list[str | None] = []
    objects = 0
    keys_seen: dict[str, None] = {}
    for line_number, text, error in _lines(data, file_name, line_offset):
        record: dict[str, str | None] = {}
        if not text.strip():
            error = error or _error("empty_record", file_name, line_number, "blank line")
        else:
            try:
                parsed = json.loads(text)
            except json.JSONDecodeError as exc:
                error = error or _error("malformed_json", file_name, line_number, f"{exc.msg} at column {exc.colno}")
            except (ValueError, RecursionError) as exc:  # e.g. nesting too deep for the parser
                error = error or _error("malformed_json", file_name, line_number, str(exc) or type(exc).__name__)
            else:
                if isinstance(parsed, dict):
                    objects += 1
                    error = error or _text_field_error(parsed, options.text_fields, file_name, line_number)
                    record = {key: _json_cell(value) for key, value in parsed.items()}
                    # JSON can spell half a surrogate pair (`"\ud800"`), which no UTF-8 text can hold.
                    if "\\u" in text and any(_SURROGATE.search(k + (v or "")) for k, v in record.items()):
                        record = {
                            _without_surrogates(k): None if v is None else _without_surrogates(v)
                            for k, v in record.items()
                        }
                        error = error or _error(
                            "invalid_unicode",
                            file_name,
                            line_number,
                            "a \\u escape is half a surrogate pair; replaced by U+FFFD",
                        )
                    keys_seen.update(dict.fromkeys(record))
                else:
                    kind = {list: "list", str: "string", bool: "boolean", int: "number", float: "number"}.get(
                        type(parsed), "null"
                    )
                    error = error or _error("not_an_object", file_name, line_number, f"a JSON {kind}, not an object")
        chunks.add(record)
        lines.append(line_number)
        errors.append(error)
    absent = [field for field in options.text_fields if field not in keys_seen]
    if objects and absent:
        found = list(keys_seen)
        shown = found[:_FIELDS_SHOWN] + (
            [f"... {len(found) - _FIELDS_SHOWN} more"] if len(found) > _FIELDS_SHOWN else []
        )
        raise DropFileError(f"{file_name}: no record has the field(s) {absent}; fields found: {shown}")
    return chunks.frame(), lines, errors


def _read_txt(
    data: bytes, file_name: str, options: ParseOptions, line_offset: int
) -> tuple[pl.DataFrame, list[int], list[str | None]]:
    if options.txt_field not in options.text_fields:
        raise DropFileError(
            f"{file_name}: a .txt file has one text a line, and the task does not say which field it fills: "
            f"set input.txt_field in the task file to one of input.text_fields {list(options.text_fields)}"
        )
    texts: list[str] = []
    lines: list[int] = []
    errors: list[str | None] = []
    for line_number, text, error in _lines(data, file_name, line_offset):
        texts.append(text)
        lines.append(line_number)
        errors.append(error)
    return pl.DataFrame({options.txt_field: texts}, schema={options.txt_field: pl.String}), lines, errors


def _unique_names(names: list[str]) -> list[str]:
    """CSV headers may repeat a name or leave it empty; every column needs its own."""
    out: list[str] = []
    seen: set[str] = set()
    for position, name in enumerate(names, start=1):
        name = name or f"column_{position}"
        candidate, n = name, 0
        while candidate in seen:
            candidate = f"{name}_duplicated_{n}"
            n += 1
        seen.add(candidate)
        out.append(candidate)
    return out


def _read_csv(
    data: bytes, file_name: str, options: ParseOptions, line_offset: int
) -> tuple[pl.DataFrame, list[int], list[str | None]]:
    # Python's csv module, not polars: it tells records with too few fields from empty cells,
    # and where each record starts, so every bad record gets its own error row and line number.
    try:
        text, strict = data.decode("utf-8"), True
    except UnicodeDecodeError:
        # Bad bytes survive as lone surrogates, found again per cell below to flag their record.
        text, strict = data.decode("utf-8", errors="surrogateescape"), False
    if csv.field_size_limit() < sys.maxsize:
        csv.field_size_limit(sys.maxsize)  # very long texts are rows like any other (prompt_too_long later)
    reader = csv.reader(io.StringIO(text, newline=""))
    try:
        header = [_without_surrogates(name) for name in next(reader)]
    except StopIteration:
        header = []
    except csv.Error as exc:
        raise DropFileError(f"{file_name}: the header row is not valid CSV: {exc}") from exc
    header = _unique_names(header)
    missing = [field for field in options.text_fields if field not in header]
    if missing:
        raise DropFileError(f"{file_name}: column(s) {missing} not found; columns found: {header}")
    chunks = _ColumnChunks(header)
    lines: list[int] = []
    errors: list[str | None] = []
    width = len(header)
    line_number = reader.line_num + 1 + line_offset
    error: str | None
    while True:
        try:
            record = next(reader)
        except StopIteration:
            break
        except csv.Error as exc:
            record, error = [], _error("malformed_csv", file_name, line_number, str(exc))
        else:
            error = None
            if not record:
                error = _error("empty_record", file_name, line_number, "blank line")
            elif len(record) != width:
                error = _error("malformed_csv", file_name, line_number, f"{len(record)} fields, the header has {width}")
            if not strict and any(_SURROGATE.search(cell) for cell in record):
                record = [
                    cell.encode("utf-8", errors="surrogateescape").decode("utf-8", errors="replace") for cell in record
                ]
                error = error or _error(
                    "invalid_utf8", file_name, line_number, "bytes that are not UTF-8; replaced by U+FFFD"
                )
        cells = record[:width] + [None] * (width - len(record))
        chunks.add_row(cells)
        lines.append(line_number)
        errors.append(error)
        line_number = reader.line_num + 1 + line_offset
    return chunks.frame(), lines, errors


def _parquet_frame(data: bytes, file_name: str) -> pl.DataFrame:
    try:
        return pl.read_parquet(io.BytesIO(data))
    except Exception as exc:  # polars raises several types for a corrupt file
        raise DropFileError(f"{file_name}: not a readable parquet file: {exc}") from exc


def _read_parquet(
    frame: pl.DataFrame, file_name: str, options: ParseOptions, first_row: int
) -> tuple[pl.DataFrame, list[int], list[str | None]]:
    missing = [field for field in options.text_fields if field not in frame.columns]
    if missing:
        raise DropFileError(f"{file_name}: column(s) {missing} not found; columns found: {frame.columns}")
    errors: list[str | None] = [None] * frame.height
    for field in reversed(options.text_fields):
        column = frame[field]
        if not (column.dtype == pl.String or isinstance(column.dtype, (pl.Categorical, pl.Enum))):
            try:
                as_text = column.cast(pl.String, strict=False)
            except Exception:  # nested types: keep them as JSON text
                as_text = pl.Series(
                    field,
                    [None if v is None else json.dumps(v, default=str) for v in column.to_list()],
                    dtype=pl.String,
                )
            message = f"field {field!r} is {column.dtype}, not a string"
            errors = [
                error if value is None else f"non_string_text: {file_name} row {first_row + index + 1}: {message}"
                for index, (value, error) in enumerate(zip(column.to_list(), errors, strict=True))
            ]
            frame = frame.with_columns(as_text.alias(field))
        else:
            frame = frame.with_columns(frame[field].cast(pl.String))
        errors = [
            f"null_text: {file_name} row {first_row + index + 1}: field {field!r} is null" if value is None else error
            for index, (value, error) in enumerate(zip(frame[field].to_list(), errors, strict=True))
        ]
    return frame, list(range(first_row + 1, first_row + frame.height + 1)), errors


def _finish(
    inputs: pl.DataFrame, lines: list[int], errors: list[str | None], options: ParseOptions, part: FilePart
) -> pl.DataFrame:
    """Add `row_id`, `source_line` and `error` around the input columns, renaming reserved names."""
    taken = set(inputs.columns)
    renames = {}
    for name in inputs.columns:
        if name in RESERVED_COLUMNS:
            candidate, n = f"input.{name}", 2
            while candidate in taken or candidate in RESERVED_COLUMNS:
                candidate, n = f"input.{name}_{n}", n + 1
            taken.add(candidate)
            renames[name] = candidate
    inputs = inputs.rename(renames)
    height = len(lines)
    columns = inputs.get_columns() if inputs.width else []
    for field in options.text_fields:
        if field not in inputs.columns:
            columns.append(pl.Series(field, [None] * height, dtype=pl.String))
    return pl.DataFrame(
        [
            pl.Series("row_id", range(part.first_row, part.first_row + height), dtype=pl.Int64),
            pl.Series("source_line", lines, dtype=pl.Int64),
            *columns,
            pl.Series("error", errors, dtype=pl.String),
        ]
    )
