"""Parse a drop file into one row per input record, never losing a record.

Pure functions over bytes: no Dagster, no storage. The result always has `row_id` (0-based, input
order), `source_line` (1-based line of the file where the record starts), every input column as read,
and `error` (null, or `code: message` naming the file and line). A record that cannot be read
becomes a row with an error; only a file-level problem (unknown format, the text field absent from
every record) raises `DropFileError`.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import PurePosixPath

import polars as pl

SUPPORTED_SUFFIXES = (".jsonl", ".csv", ".parquet", ".txt")
# Columns the pipeline adds; an input column with one of these names is kept as `input.<name>`.
RESERVED_COLUMNS = frozenset(
    {
        "row_id",
        "source_line",
        "error",
        "prompt",
        "num_prompt_tokens",
        "label",
        "generated_text",
        "finish_reason",
        "num_generated_tokens",
    }
)


class DropFileError(ValueError):
    """The file as a whole cannot be used (as opposed to one bad record, which becomes an error row)."""


@dataclass(frozen=True)
class ParseOptions:
    text_fields: tuple[str, ...]
    txt_field: str = "text"


def read_prompts(data: bytes, file_name: str, options: ParseOptions) -> pl.DataFrame:
    """Parse the bytes of one drop file, by its suffix, into the raw_prompts table."""
    suffix = PurePosixPath(file_name).suffix.lower()
    if suffix == ".jsonl":
        frame = _read_jsonl(data, file_name, options)
    elif suffix == ".csv":
        frame = _read_csv(data, file_name, options)
    elif suffix == ".parquet":
        frame = _read_parquet(data, file_name, options)
    elif suffix == ".txt":
        frame = _read_txt(data, file_name, options)
    else:
        raise DropFileError(f"{file_name}: unsupported file type {suffix!r}; use one of {', '.join(SUPPORTED_SUFFIXES)}")
    return _finish(frame, file_name, options)


def _error(code: str, file_name: str, line: int, message: str) -> str:
    return f"{code}: {file_name} line {line}: {message}"


def _split_lines(data: bytes) -> list[bytes]:
    # A final newline ends the last line; it does not start an empty record.
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    return [line[:-1] if line.endswith(b"\r") else line for line in lines]


def _decode_line(raw: bytes, file_name: str, line_number: int) -> tuple[str, str | None]:
    try:
        return raw.decode("utf-8"), None
    except UnicodeDecodeError as exc:
        return raw.decode("utf-8", errors="replace"), _error(
            "invalid_utf8", file_name, line_number, f"byte {exc.start} is not UTF-8 ({exc.reason})"
        )


def _json_cell(value: object) -> str | None:
    """Input values are kept as text: strings as they are, other JSON values as JSON."""
    if value is None or isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False)


def _text_field_error(record: dict, fields: Iterable[str], file_name: str, line: int) -> str | None:
    for field in fields:
        if field not in record:
            return _error("missing_field", file_name, line, f"field {field!r} is missing")
        value = record[field]
        if value is None:
            return _error("null_text", file_name, line, f"field {field!r} is null")
        if not isinstance(value, str):
            return _error("non_string_text", file_name, line, f"field {field!r} is a {type(value).__name__}, not a string")
    return None


def _read_jsonl(data: bytes, file_name: str, options: ParseOptions) -> pl.DataFrame:
    columns: dict[str, list[str | None]] = {}
    lines_out: list[int] = []
    errors: list[str | None] = []
    for index, raw in enumerate(_split_lines(data)):
        line_number = index + 1
        text, error = _decode_line(raw, file_name, line_number)
        record: dict = {}
        if error is None:
            if not text.strip():
                error = _error("empty_record", file_name, line_number, "blank line")
            else:
                try:
                    parsed = json.loads(text)
                except json.JSONDecodeError as exc:
                    error = _error("malformed_json", file_name, line_number, exc.msg + f" at column {exc.colno}")
                else:
                    if isinstance(parsed, dict):
                        record = parsed
                        error = _text_field_error(record, options.text_fields, file_name, line_number)
                    else:
                        error = _error("not_an_object", file_name, line_number, f"a JSON {type(parsed).__name__}, not an object")
        row = len(lines_out)
        for key in record:
            columns.setdefault(key, [None] * row)
        for key, values in columns.items():
            values.append(_json_cell(record.get(key)))
        lines_out.append(line_number)
        errors.append(error)
    if lines_out and not any(field in columns for field in options.text_fields):
        raise DropFileError(
            f"{file_name}: no record has the field(s) {list(options.text_fields)}; fields found: {sorted(columns)}"
        )
    return pl.DataFrame(
        {"source_line": lines_out, **columns, "error": errors},
        schema={"source_line": pl.Int64, **{key: pl.String for key in columns}, "error": pl.String},
    )


def _read_txt(data: bytes, file_name: str, options: ParseOptions) -> pl.DataFrame:
    texts: list[str] = []
    errors: list[str | None] = []
    for index, raw in enumerate(_split_lines(data)):
        text, error = _decode_line(raw, file_name, index + 1)
        texts.append(text)
        errors.append(error)
    return pl.DataFrame(
        {"source_line": list(range(1, len(texts) + 1)), options.txt_field: texts, "error": errors},
        schema={"source_line": pl.Int64, options.txt_field: pl.String, "error": pl.String},
    )


def _read_csv(data: bytes, file_name: str, options: ParseOptions) -> pl.DataFrame:
    if not data.strip():
        raise DropFileError(f"{file_name}: empty CSV file (a header row is required)")
    try:
        frame = pl.read_csv(data, infer_schema=False, raise_if_empty=False)
    except (pl.exceptions.ComputeError, pl.exceptions.NoDataError):
        # Ragged rows or bad bytes: the slow path reports each bad record with its line number.
        return _read_csv_by_record(data, file_name, options)
    _require_columns(frame.columns, file_name, options)
    # Quoted fields may hold newlines; count them so `source_line` points at the record's first line.
    newlines_per_row = pl.sum_horizontal(
        [pl.col(name).str.count_matches("\n").fill_null(0) for name in frame.columns]
    ) if frame.columns else pl.lit(0)
    frame = frame.with_columns(
        source_line=(pl.int_range(pl.len(), dtype=pl.Int64) + 2 + newlines_per_row.cum_sum().shift(1, fill_value=0)).cast(
            pl.Int64
        ),
        error=pl.lit(None, dtype=pl.String),
    )
    return frame.select("source_line", *[c for c in frame.columns if c not in ("source_line", "error")], "error")


def _require_columns(found: list[str], file_name: str, options: ParseOptions) -> None:
    missing = [field for field in options.text_fields if field not in found]
    if missing:
        raise DropFileError(f"{file_name}: column(s) {missing} not found; columns found: {found}")


def _read_csv_by_record(data: bytes, file_name: str, options: ParseOptions) -> pl.DataFrame:
    text = data.decode("utf-8", errors="surrogateescape")
    reader = csv.reader(io.StringIO(text, newline=""))
    try:
        header = next(reader)
    except StopIteration:
        raise DropFileError(f"{file_name}: empty CSV file (a header row is required)") from None
    _require_columns(header, file_name, options)
    columns: dict[str, list[str | None]] = {name: [] for name in header}
    lines: list[int] = []
    errors: list[str | None] = []
    line_number = reader.line_num + 1
    while True:
        try:
            record = next(reader)
        except StopIteration:
            break
        except csv.Error as exc:
            lines.append(line_number)
            errors.append(_error("malformed_csv", file_name, line_number, str(exc)))
            for values in columns.values():
                values.append(None)
            line_number = reader.line_num + 1
            continue
        error = None
        if len(record) != len(header):
            error = _error("malformed_csv", file_name, line_number, f"{len(record)} fields, header has {len(header)}")
        cells = []
        for value in record:
            try:
                value.encode("utf-8")
                cells.append(value)
            except UnicodeEncodeError:
                cells.append(value.encode("utf-8", errors="surrogateescape").decode("utf-8", errors="replace"))
                error = error or _error("invalid_utf8", file_name, line_number, "bytes that are not UTF-8")
        for index, values in enumerate(columns.values()):
            values.append(cells[index] if index < len(cells) else None)
        lines.append(line_number)
        errors.append(error)
        line_number = reader.line_num + 1
    return pl.DataFrame(
        {"source_line": lines, **columns, "error": errors},
        schema={"source_line": pl.Int64, **{name: pl.String for name in header}, "error": pl.String},
    )


def _read_parquet(data: bytes, file_name: str, options: ParseOptions) -> pl.DataFrame:
    try:
        frame = pl.read_parquet(io.BytesIO(data))
    except Exception as exc:  # polars raises several types for a corrupt file
        raise DropFileError(f"{file_name}: not a readable parquet file: {exc}") from exc
    _require_columns(frame.columns, file_name, options)
    errors = pl.lit(None, dtype=pl.String)
    for field in reversed(options.text_fields):
        dtype = frame.schema[field]
        if dtype != pl.String:
            frame = frame.with_columns(pl.col(field).cast(pl.String, strict=False).alias(field))
            errors = pl.when(pl.col(field).is_not_null()).then(
                pl.format("non_string_text: {} row {}: field '{}' is {}", pl.lit(file_name), pl.col("source_line"), pl.lit(field), pl.lit(str(dtype)))
            ).otherwise(errors)
        errors = pl.when(pl.col(field).is_null()).then(
            pl.format("null_text: {} row {}: field '{}' is null", pl.lit(file_name), pl.col("source_line"), pl.lit(field))
        ).otherwise(errors)
    frame = frame.with_columns(source_line=pl.int_range(1, pl.len() + 1, dtype=pl.Int64))
    frame = frame.with_columns(error=errors)
    return frame.select("source_line", *[c for c in frame.columns if c not in ("source_line", "error")], "error")


def _finish(frame: pl.DataFrame, file_name: str, options: ParseOptions) -> pl.DataFrame:
    renames = {name: f"input.{name}" for name in frame.columns if name in RESERVED_COLUMNS - {"source_line", "error"}}
    if renames:
        frame = frame.rename(renames)
    for field in options.text_fields:
        if field not in frame.columns:
            frame = frame.with_columns(pl.lit(None, dtype=pl.String).alias(field))
    return frame.with_row_index("row_id").with_columns(pl.col("row_id").cast(pl.Int64))
