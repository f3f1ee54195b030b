"""One dynamic partition per drop file, keyed by a path-safe name derived from the file's path.

Partition key rule (documented in README): the file's path relative to the task's drop zone, with
`/` written as `__`, every character outside `A-Z a-z 0-9 . _ -` written as `_` (and runs of three
dots, which Dagster rejects, as underscores). When that changes anything, or the key would be longer
than 150 characters, the key is cut to fit and `-` plus 8 hex digits of the SHA-1 of the original
relative path are appended, so two different paths never share a key and every key is a safe file
name. `posts.jsonl` → `posts.jsonl`, `posts 1.jsonl` → `posts_1.jsonl-<hash>`,
`2026/11/posts.jsonl` → `2026__11__posts.jsonl-<hash>` (distinct from a file named
`2026__11__posts.jsonl`).

Which files are inputs: `.jsonl`, `.csv`, `.parquet`, `.txt` and the gzip-compressed `.jsonl.gz`,
`.csv.gz`, `.txt.gz`, anywhere below the drop zone. Skipped,
with a reason: hidden or temporary names (a path part starting with `.`, `_` or `~`), names of
uploads in progress (`.tmp`, `.part`, `.crdownload`, ...), unknown extensions, and local files
modified within the last few seconds (still being copied in). S3 objects need no such wait: an
object is listed only once its upload has completed.
"""

from __future__ import annotations

import hashlib
import re
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import PurePosixPath

import dagster as dg
from upath import UPath

from batch_assets.pipeline.read_prompts import SUPPORTED_SUFFIXES, input_suffix
from batch_assets.storage.errors import storage_errors
from batch_assets.storage.locations import drop_zone, is_local

MAX_KEY_LENGTH = 150
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")
_DOT_RUNS = re.compile(r"\.{3,}")
_HASH_SUFFIX = re.compile(r"-[0-9a-f]{8}$")
# Names of files still being written or that are not inputs: editors, uploaders, our own temp files.
_IN_PROGRESS_MARKERS = (".tmp", ".part", ".partial", ".crdownload", ".swp", ".filepart", ".uploading", ".download")


def partitions_def_name(task: str) -> str:
    return f"{task}_drops"


def drop_partitions(task: str) -> dg.DynamicPartitionsDefinition:
    return dg.DynamicPartitionsDefinition(name=partitions_def_name(task))


def partition_key_for(relative_path: str) -> str:
    """The partition key of a drop file, from its path relative to the drop zone (see module doc)."""
    relative_path = relative_path.strip("/")
    safe = _UNSAFE.sub("_", relative_path.replace("/", "__"))
    safe = _DOT_RUNS.sub(lambda run: "_" * len(run.group()), safe)
    if safe == relative_path and len(safe) <= MAX_KEY_LENGTH:
        return safe
    digest = hashlib.sha1(relative_path.encode("utf-8")).hexdigest()[:8]
    return f"{safe[: MAX_KEY_LENGTH - 9]}-{digest}"


def skip_reason(relative_path: str) -> str | None:
    """Why a file in the drop zone is not an input (None when it is one)."""
    parts = PurePosixPath(relative_path).parts
    name = parts[-1] if parts else relative_path
    if any(part.startswith((".", "_", "~")) for part in parts):
        return "hidden or temporary name"
    if name.lower().endswith(_IN_PROGRESS_MARKERS):
        return "still being written (temporary suffix)"
    if input_suffix(name) is None:
        return f"unknown extension (inputs are {', '.join(SUPPORTED_SUFFIXES)})"
    return None


def input_file_problem(name: str) -> str | None:
    """Why a file of this name would not be read from the drop zone, said for the user who is about
    to put it there (None when it would be); checked before anything is copied."""
    reason = skip_reason(name)
    if reason is None:
        return None
    formats = f"inputs are {', '.join(SUPPORTED_SUFFIXES)}"
    lower = name.lower()
    if name.startswith((".", "_", "~")):
        return "names starting with '.', '_' or '~' are hidden or temporary files the drop zone skips; rename the file"
    if lower.endswith(_IN_PROGRESS_MARKERS):
        markers = ", ".join(_IN_PROGRESS_MARKERS)
        return f"names ending in {markers} are files still being written, which the drop zone skips; rename the file"
    if lower.endswith((".json", ".json.gz")):
        return f"a .json file is not read: write one JSON object per line and name the file .jsonl ({formats})"
    if lower.endswith(".gz"):
        return f"unsupported compressed file; {formats}"
    return f"unsupported file type; {formats}"


@dataclass(frozen=True)
class DropFile:
    relative_path: str
    zone: UPath
    version: str  # ETag + size on S3, modification time + size locally: changes when the file is replaced
    modified: float | None = None  # POSIX seconds

    @property
    def path(self) -> UPath:
        return self.zone / self.relative_path

    @property
    def partition_key(self) -> str:
        return partition_key_for(self.relative_path)

    def read_bytes(self) -> bytes:
        """The file's content; a storage failure raises `StorageError` naming the URL and cause."""
        path = self.path
        with storage_errors("reading drop file", path):
            return path.read_bytes()


def _version_of(info: dict) -> str:
    for key in ("ETag", "etag", "mtime", "LastModified", "last_modified", "created"):
        if info.get(key) is not None:
            value = info[key]
            value = value.isoformat() if hasattr(value, "isoformat") else str(value)
            return f"{key}={value.strip(chr(34))};size={info.get('size')}"
    return f"size={info.get('size')}"


def _modified_of(info: dict) -> float | None:
    for key in ("mtime", "LastModified", "last_modified", "created"):
        value = info.get(key)
        if isinstance(value, datetime):
            return value.timestamp()
        if isinstance(value, int | float):
            return float(value)
    return None


def list_drop_files(
    task: str,
    zone: UPath | None = None,
    *,
    settle_seconds: float = 0.0,
    now: float | None = None,
) -> tuple[list[DropFile], dict[str, str]]:
    """Input files in the task's drop zone (recursive, all pages) and, separately, skipped names with reasons.

    `settle_seconds`: local files modified more recently than this are skipped as still being
    written (the next listing picks them up). A missing local folder or S3 prefix is an empty
    drop zone; a missing bucket, refused access or an unreachable endpoint raises `StorageError`.
    """
    zone = zone or drop_zone(task)
    local = is_local(zone)
    fs = zone.fs
    root = zone.path.rstrip("/")
    with storage_errors("listing drop zone", zone):
        if local and not fs.isdir(root):
            return [], {}
        # s3fs pages through ListObjectsV2 (1,000 keys a page) until the prefix is exhausted.
        found = fs.find(root, detail=True)
    now = time.time() if now is None else now
    files: list[DropFile] = []
    skipped: dict[str, str] = {}
    for full_path, info in sorted(found.items()):
        if info.get("type") == "directory":
            continue
        relative = full_path[len(root) :].lstrip("/")
        reason = skip_reason(relative)
        modified = _modified_of(info)
        if reason is None and local and settle_seconds > 0 and modified is not None and now - modified < settle_seconds:
            reason = (
                f"still being written (modified {max(now - modified, 0):.1f} s ago; "
                f"picked up once unchanged for {settle_seconds:g} s)"
            )
        if reason:
            skipped[relative] = reason
            continue
        files.append(DropFile(relative_path=relative, zone=zone, version=_version_of(info), modified=modified))
    return files, skipped


def _candidate_paths(partition_key: str) -> list[str]:
    """Relative paths that may have produced `partition_key`, to look up before listing the zone."""
    candidates = [partition_key]
    if _HASH_SUFFIX.search(partition_key):
        candidates.append(partition_key[:-9].replace("__", "/"))
    return candidates


def find_drop_file(task: str, partition_key: str, zone: UPath | None = None) -> DropFile:
    """The drop file behind a partition: a direct lookup for plain names, a listing otherwise."""
    zone = zone or drop_zone(task)
    for candidate in _candidate_paths(partition_key):
        if partition_key_for(candidate) != partition_key or skip_reason(candidate) is not None:
            continue
        path = zone / candidate
        with storage_errors("reading drop file", path):
            try:
                info = path.fs.info(path.path)
            except FileNotFoundError:
                continue
        if info.get("type") == "file":
            return DropFile(candidate, zone, _version_of(info), _modified_of(info))
    files, _ = list_drop_files(task, zone)
    for drop in files:
        if drop.partition_key == partition_key:
            return drop
    raise FileNotFoundError(f"no file in {zone} maps to partition {partition_key!r} (was it removed or renamed?)")
