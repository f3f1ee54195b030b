"""One dynamic partition per drop file, keyed by a path-safe name derived from the file's path.

Partition key rule (documented in README): the file's path relative to the task's drop zone, with
`/` written as `__` and every character outside `A-Z a-z 0-9 . _ -` written as `_`. When that
changes the name (spaces, unicode, other punctuation), 8 hex digits of the SHA-1 of the original
relative path are appended, so two different names never share a key. `posts 1.jsonl` →
`posts_1.jsonl-2b1f0c3a`, `2026/11/posts.jsonl` → `2026__11__posts.jsonl`.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import PurePosixPath

import dagster as dg
from upath import UPath

from batch_assets.parsing.read_prompts import SUPPORTED_SUFFIXES
from batch_assets.storage.locations import drop_zone

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")
# Names of files still being written or that are not inputs: editors, uploaders, our own temp files.
_IN_PROGRESS_MARKERS = (".tmp", ".part", ".partial", ".crdownload", ".swp", ".filepart", ".uploading")


def partitions_def_name(task: str) -> str:
    return f"{task}_drops"


def drop_partitions(task: str) -> dg.DynamicPartitionsDefinition:
    return dg.DynamicPartitionsDefinition(name=partitions_def_name(task))


def partition_key_for(relative_path: str) -> str:
    relative_path = relative_path.strip("/")
    safe = _UNSAFE.sub("_", relative_path.replace("/", "__"))
    if safe != relative_path.replace("/", "__"):
        safe = f"{safe}-{hashlib.sha1(relative_path.encode('utf-8')).hexdigest()[:8]}"
    return safe


def skip_reason(relative_path: str) -> str | None:
    """Why a file in the drop zone is not an input (None when it is one)."""
    parts = PurePosixPath(relative_path).parts
    name = parts[-1] if parts else relative_path
    if any(part.startswith((".", "_", "~")) for part in parts):
        return "hidden or temporary name"
    if name.lower().endswith(_IN_PROGRESS_MARKERS):
        return "still being written (temporary suffix)"
    if PurePosixPath(name).suffix.lower() not in SUPPORTED_SUFFIXES:
        return f"unknown extension (inputs are {', '.join(SUPPORTED_SUFFIXES)})"
    return None


@dataclass(frozen=True)
class DropFile:
    relative_path: str
    path: UPath
    version: str  # ETag / modification time + size: changes when the file is replaced

    @property
    def partition_key(self) -> str:
        return partition_key_for(self.relative_path)


def _version_of(info: dict) -> str:
    for key in ("ETag", "etag", "mtime", "LastModified", "last_modified", "created"):
        if info.get(key) is not None:
            value = info[key]
            value = value.isoformat() if hasattr(value, "isoformat") else str(value)
            return f"{key}={value.strip(chr(34))};size={info.get('size')}"
    return f"size={info.get('size')}"


def list_drop_files(task: str, zone: UPath | None = None) -> tuple[list[DropFile], dict[str, str]]:
    """Input files in the task's drop zone (recursive) and, separately, skipped names with reasons."""
    zone = zone or drop_zone(task)
    fs = zone.fs
    root = zone.path.rstrip("/")
    if not fs.exists(root):
        return [], {}
    files: list[DropFile] = []
    skipped: dict[str, str] = {}
    for full_path, info in sorted(fs.find(root, detail=True).items()):
        if info.get("type") == "directory":
            continue
        relative = full_path[len(root) :].lstrip("/")
        reason = skip_reason(relative)
        if reason:
            skipped[relative] = reason
            continue
        files.append(DropFile(relative_path=relative, path=zone / relative, version=_version_of(info)))
    return files, skipped


def find_drop_file(task: str, partition_key: str) -> DropFile:
    files, _ = list_drop_files(task)
    for drop in files:
        if drop.partition_key == partition_key:
            return drop
    raise FileNotFoundError(
        f"no file in {drop_zone(task)} maps to partition {partition_key!r} (was it removed or renamed?)"
    )
