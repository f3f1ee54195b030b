"""Where a big drop file splits into shards of at most `max_rows` records, found in one streaming pass.

A shard is a run of whole records: for .jsonl and .txt every line is a record (a blank line too: it
becomes an error row), for .csv a record may span lines (a quoted field with newlines) and the
header row is read once and given to every shard, for .parquet a shard is a range of rows, made of
whole row groups where they fit. Each shard knows the `row_id` and line of its first record in the
whole file, so a shard's rows are numbered, and its errors name lines, exactly as if the file had
been read whole. Gzip-compressed files are scanned as their decompressed bytes.

Pure functions over binary streams: no Dagster, no storage (storage/shards.py reads the bytes and
keeps each file version's plan).
"""

from __future__ import annotations

import csv
import gzip
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import IO, cast

import pyarrow.parquet as pq

from batch_assets.pipeline.inputs.read_prompts import DropFileError, input_suffix

# Bytes read at a time while counting lines: large enough that the per-block Python cost vanishes.
_BLOCK = 8 << 20


@dataclass(frozen=True)
class Shard:
    first_row: int  # row_id of its first record in the whole file
    rows: int
    first_line: int  # line of its first record (parquet: its row number, 1-based)
    start: int  # byte offset of its first record in the (decompressed) file; parquet: unused (0)
    end: int  # byte offset just past its last record; parquet: unused (0)


@dataclass(frozen=True)
class ShardPlan:
    """How one version of a drop file splits; `header_end`/`header_lines`: the CSV header row that
    every shard after the first is read with (0 for other formats)."""

    version: str
    max_rows: int
    shards: tuple[Shard, ...]
    header_end: int = 0
    header_lines: int = 0

    def to_json(self) -> dict:
        return {**asdict(self), "shards": [asdict(shard) for shard in self.shards]}

    @classmethod
    def from_json(cls, data: dict) -> ShardPlan:
        return cls(**{**data, "shards": tuple(Shard(**shard) for shard in data["shards"])})


def may_need_shards(suffix: str, size: int | None, max_rows: int) -> bool:
    """False when a file cannot hold more than `max_rows` records, told without reading it: an
    uncompressed text file of at most `max_rows` bytes (every record but the last ends in a newline
    byte). Parquet and gzip files are always looked at (their footer, or a decompressing pass)."""
    return size is None or suffix in (".parquet", ".jsonl.gz", ".csv.gz", ".txt.gz") or size > max_rows


def plan_shards(stream: IO[bytes], file_name: str, version: str, max_rows: int) -> ShardPlan:
    """One pass over `stream` (the file as stored: gzip is decompressed here) to the shard plan."""
    if max_rows < 1:
        raise ValueError("max_rows must be at least 1")
    suffix = input_suffix(file_name)
    if suffix is None:
        raise DropFileError(f"{file_name}: unsupported file type")
    if suffix == ".parquet":
        return ShardPlan(version, max_rows, _parquet_shards(stream, file_name, max_rows))
    if suffix.endswith(".gz"):
        stream = cast(IO[bytes], gzip.GzipFile(fileobj=stream, mode="rb"))
    try:
        if suffix.startswith(".csv"):
            shards, header_end, header_lines = _csv_shards(stream, file_name, max_rows)
            return ShardPlan(version, max_rows, shards, header_end, header_lines)
        return ShardPlan(version, max_rows, _line_shards(stream, max_rows))
    except EOFError as exc:
        raise DropFileError(f"{file_name}: the gzip file is incomplete ({exc}); drop the whole file again") from None
    except gzip.BadGzipFile as exc:
        raise DropFileError(f"{file_name}: not a readable gzip file ({exc})") from None


class _Cutter:
    """Collects shard boundaries as records go by."""

    def __init__(self, max_rows: int, first_line: int, start: int) -> None:
        self.max_rows = max_rows
        self.shards: list[Shard] = []
        self.rows = 0  # records in the open shard
        self.first_line, self.start = first_line, start

    def close_shard(self, end: int, next_line: int) -> None:
        first_row = self.shards[-1].first_row + self.shards[-1].rows if self.shards else 0
        self.shards.append(Shard(first_row, self.rows, self.first_line, self.start, end))
        self.rows, self.first_line, self.start = 0, next_line, end

    def finish(self, end: int) -> tuple[Shard, ...]:
        # A shard is closed as soon as it is full, so the last one is never empty (unless the file is).
        if self.rows or not self.shards:
            self.close_shard(end, self.first_line)
        return tuple(self.shards)


def _line_shards(stream: IO[bytes], max_rows: int) -> tuple[Shard, ...]:
    """.jsonl/.txt: a record per line. Counts newlines a block at a time (bytes.count in C) and
    looks for a single newline only where a shard ends."""
    cutter = _Cutter(max_rows, first_line=1, start=0)
    offset = 0  # bytes before `block`
    line = 1  # line number of the next line to start
    last = b"\n"
    while block := stream.read(_BLOCK):
        position = 0
        while True:
            wanted = max_rows - cutter.rows
            newlines = block.count(b"\n", position)
            if newlines < wanted:
                cutter.rows += newlines
                line += newlines
                break
            for _ in range(wanted):
                position = block.index(b"\n", position) + 1
            cutter.rows += wanted
            line += wanted
            cutter.close_shard(offset + position, line)
        offset += len(block)
        last = block[-1:]
    if last != b"\n":  # a last line without its newline is a record too
        cutter.rows += 1
    return cutter.finish(offset)


class _LinesWithOffsets:
    """The stream's lines as text for `csv.reader`, counting the bytes handed out: the reader pulls
    lines only as it needs them, so after each record `end` is where that record's bytes end."""

    def __init__(self, stream: IO[bytes]) -> None:
        self.lines = stream
        self.end = 0

    def __iter__(self) -> Iterator[str]:
        for raw in self.lines:
            self.end += len(raw)
            # The same decoding the reader of a shard falls back to, so records split the same way.
            yield raw.decode("utf-8", errors="surrogateescape")


def _csv_shards(stream: IO[bytes], file_name: str, max_rows: int) -> tuple[tuple[Shard, ...], int, int]:
    """.csv: records as Python's csv module (the parser read_prompts uses) splits them, so quoted
    fields with newlines stay in one record. Returns (shards, header bytes, header lines)."""
    if csv.field_size_limit() < sys.maxsize:
        csv.field_size_limit(sys.maxsize)
    lines = _LinesWithOffsets(stream)
    reader = csv.reader(lines)
    try:
        next(reader)
    except StopIteration:
        return (Shard(0, 0, 2, 0, 0),), 0, 0
    except csv.Error as exc:
        raise DropFileError(f"{file_name}: the header row is not valid CSV: {exc}") from exc
    header_end, header_lines = lines.end, reader.line_num
    cutter = _Cutter(max_rows, first_line=header_lines + 1, start=header_end)
    while True:
        try:
            next(reader)
        except StopIteration:
            break
        except csv.Error:
            pass  # read_prompts makes it an error row; it is a record all the same
        cutter.rows += 1
        if cutter.rows == max_rows:
            cutter.close_shard(lines.end, reader.line_num + 1)
    return cutter.finish(lines.end), header_end, header_lines


def _parquet_shards(stream: IO[bytes], file_name: str, max_rows: int) -> tuple[Shard, ...]:
    """.parquet: whole row groups while they fit in a shard; a row group that does not fit is cut,
    and the shard holding its cut end is filled up from the next group (so no shard is left small
    by a cut). Only the footer is read."""
    try:
        groups = [group.num_rows for group in _row_groups(pq.ParquetFile(stream).metadata)]
    except Exception as exc:  # pyarrow raises several types for a corrupt file
        raise DropFileError(f"{file_name}: not a readable parquet file: {exc}") from exc
    shards: list[Shard] = []
    first, rows = 0, 0  # the open shard
    starts_mid_group = False
    for group_rows in groups:
        if rows and rows + group_rows > max_rows and not starts_mid_group:
            shards.append(Shard(first, rows, first + 1, 0, 0))
            first, rows = first + rows, 0
        rows += group_rows
        starts_mid_group = starts_mid_group and rows > max_rows
        while rows > max_rows:
            shards.append(Shard(first, max_rows, first + 1, 0, 0))
            first, rows = first + max_rows, rows - max_rows
            starts_mid_group = rows > 0
    if rows or not shards:
        shards.append(Shard(first, rows, first + 1, 0, 0))
    return tuple(shards)


def _row_groups(metadata: pq.FileMetaData) -> Iterator[pq.RowGroupMetaData]:
    for index in range(metadata.num_row_groups):
        yield metadata.row_group(index)
