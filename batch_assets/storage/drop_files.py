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
uploads in progress (`.tmp`, `.part`, `.crdownload`, ...), unknown extensions, unsafe names (a `.`
or `..` path part, which tools resolve to another path), names that are not UTF-8, and local files
modified within the last few seconds (still being copied in). S3 objects need no such wait: an
object is listed only once its upload has completed; an S3 key is read under exactly the name it is
listed under (`a//b.jsonl` included).

A local drop zone reads regular files only, because whoever can write into a shared drop folder
must not make the pipeline read what only the worker may read: a symbolic link (to a file or a
folder, inside the zone or not, dangling or not), a FIFO, a socket or a device is skipped with a
reason, and a folder behind a link is not walked into. `BATCH_ASSETS_DATA` may go through links
(that is whoever configured it); the `drops/<task>` folders below it must be real folders. Reading
opens every part of the path below `BATCH_ASSETS_DATA` without following links (`O_NOFOLLOW`), so a
file (or folder) swapped for a link or a FIFO after the listing is refused too.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import stat
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import PurePosixPath
from typing import IO

import dagster as dg
from upath import UPath

from batch_assets.pipeline.inputs.read_prompts import SUPPORTED_SUFFIXES, DropFileError, input_suffix
from batch_assets.storage.errors import StorageError, storage_errors
from batch_assets.storage.locations import data_root, drop_zone, is_local

MAX_KEY_LENGTH = 150
# Between a file's key and a shard's number; outside the characters a file's key is made of.
SHARD_MARK = "~"
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
    safe = _UNSAFE.sub("_", relative_path.replace("/", "__"))
    safe = _DOT_RUNS.sub(lambda run: "_" * len(run.group()), safe)
    if safe == relative_path and len(safe) <= MAX_KEY_LENGTH:
        return safe
    digest = hashlib.sha1(relative_path.encode("utf-8")).hexdigest()[:8]
    return f"{safe[: MAX_KEY_LENGTH - 9]}-{digest}"


def version_digest(version: str) -> str:
    """A short, stable digest of a file version, used in run keys and the tags that pin a version."""
    return hashlib.sha1(version.encode("utf-8")).hexdigest()[:12]


def shard_key(file_key: str, index: int) -> str:
    """The partition key of shard `index` (0-based) of a file split into shards (storage/shards.py):
    `posts.csv~00001`, `posts.csv~00002`, ... A file's own key never holds a `~`, so no file's key
    is a shard's, and `<file key>~*` names exactly the file's shards."""
    return f"{file_key}{SHARD_MARK}{index + 1:05d}"


def file_key_of(partition_key: str) -> str:
    """The key of the file a partition reads: its own key, or the file's key for a shard."""
    return partition_key.split(SHARD_MARK, 1)[0]


class InvalidPartitionKey(DropFileError):
    """A partition key this package never makes: refused before anything is read, written or deleted."""


_FILE_KEY = re.compile(rf"[A-Za-z0-9._-]{{1,{MAX_KEY_LENGTH}}}")
# A shard number as `shard_key` writes it; nine digits at most, so no key makes a number too big to read.
_SHARD_NUMBER = re.compile(r"[0-9]{5,9}")


def partition_key_problem(partition_key: str) -> str | None:
    """Why a key is not one `partition_key_for` or `shard_key` makes (None when it is one).

    Dagster accepts nearly any dynamic partition key (the UI's "Add partition", GraphQL, the Python
    API), and every storage path of a partition is built from its key: a key with `/` or `..` in it
    would read, write or delete outside the data folder."""
    file_key, mark, number = partition_key.partition(SHARD_MARK)
    if not _FILE_KEY.fullmatch(file_key) or file_key in (".", "..") or _DOT_RUNS.search(file_key):
        return (
            f"partition key {partition_key!r} is not a drop file's key (letters, digits, '.', '_' and '-', "
            f"at most {MAX_KEY_LENGTH} characters)"
        )
    canonical = _SHARD_NUMBER.fullmatch(number) and shard_key(file_key, int(number) - 1) == partition_key
    if mark and not (canonical and int(number) >= 1):
        return f"partition key {partition_key!r} is not a shard's key ('<file key>~' and a 5-digit number from 00001)"
    return None


def checked_partition_key(partition_key: str) -> str:
    """The key itself, or `InvalidPartitionKey` saying why it is refused and what to do."""
    problem = partition_key_problem(partition_key)
    if problem:
        raise InvalidPartitionKey(
            f"{problem}; batch_assets makes every key itself from a drop file's name, so this one was added by "
            "hand (the UI's 'Add partition', GraphQL or the Python API) and nothing is read, written or deleted "
            "for it: delete that partition, and drop the file into the task's drop zone instead"
        )
    return partition_key


def shard_index_of(partition_key: str) -> int | None:
    """The 0-based shard a partition key names, None for a whole file."""
    _, mark, number = partition_key.partition(SHARD_MARK)
    return int(number) - 1 if mark and number.isdigit() else None


def skip_reason(relative_path: str) -> str | None:
    """Why a file in the drop zone is not an input (None when it is one)."""
    unsafe = unsafe_name_reason(relative_path)
    if unsafe:
        return unsafe
    parts = PurePosixPath(relative_path).parts
    name = parts[-1] if parts else relative_path
    if any(part.startswith((".", "_", "~")) for part in parts):
        return "hidden or temporary name"
    if name.lower().endswith(_IN_PROGRESS_MARKERS):
        return "still being written (temporary suffix)"
    if input_suffix(name) is None:
        return f"unknown extension (inputs are {', '.join(SUPPORTED_SUFFIXES)})"
    return None


def unsafe_name_reason(relative_path: str) -> str | None:
    """Why a name cannot be read back as itself: a `.` or `..` part (a key `x/../a.jsonl` looks like
    `a.jsonl` one folder up to every tool that resolves it), or bytes that are not UTF-8."""
    try:
        relative_path.encode("utf-8")
    except UnicodeEncodeError:
        return "the name is not valid UTF-8; rename the file"
    if any(part in (".", "..") for part in relative_path.split("/")):
        return "unsafe name: a '.' or '..' path part, which tools resolve to another path; rename it"
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
    size: int | None = None  # bytes, as listed

    @property
    def url(self) -> str:
        """The file's URL, joined by hand: `UPath`'s `/` would make `//a.jsonl` absolute."""
        return f"{str(self.zone).rstrip('/')}/{self.relative_path}"

    @property
    def path(self) -> UPath:
        return UPath(self.url, **self.zone.storage_options)

    @property
    def partition_key(self) -> str:
        return partition_key_for(self.relative_path)

    def read_bytes(self) -> bytes:
        """The file's content; a storage failure raises `StorageError` naming the URL and cause,
        a local file that is no longer a regular file (a link, a FIFO) `DropFileError`."""
        with storage_errors("reading drop file", self.url):
            if is_local(self.zone):
                with _open_local_regular_file(self.zone, self.relative_path) as file:
                    return file.read()
            # The exact key as listed: joining paths would fold `a//b.jsonl` into another key.
            return self.zone.fs.cat_file(_full_path(self.zone, self.relative_path))

    @contextmanager
    def open(self) -> Iterator[IO[bytes]]:
        """The file as a seekable binary stream, opened as `read_bytes` reads it. Locally the opened
        file must still be this version (a file replaced since it was listed raises
        `DropFileError`); on S3 reads are ranged requests of the key as listed."""
        with storage_errors("reading drop file", self.url):
            if is_local(self.zone):
                with _open_local_regular_file(self.zone, self.relative_path) as file:
                    info = os.fstat(file.fileno())
                    if _version_of({"mtime": info.st_mtime, "size": info.st_size}) != self.version:
                        raise DropFileError(
                            f"{self.relative_path}: replaced since it was listed; the new version is run on its own"
                        )
                    yield file
                return
            with self.zone.fs.open(_full_path(self.zone, self.relative_path), "rb") as file:
                # s3fs reads the object it looked up on opening (its ETag); that must be this version.
                details = getattr(file, "details", None)
                if isinstance(details, dict) and _version_of(details) != self.version:
                    raise DropFileError(
                        f"{self.relative_path}: replaced since it was listed; the new version is run on its own"
                    )
                yield file


def read_zone_file(zone: UPath, relative_path: str, max_bytes: int) -> bytes:
    """Another file of the drop zone (an image a record names), read as a drop file is (see
    `open_zone_file`). More than `max_bytes` is refused by reading one byte past it, never the whole
    of a huge file."""
    with open_zone_file(zone, relative_path) as file:
        return file.read(max_bytes + 1)


@contextmanager
def open_zone_file(folder: UPath, relative_path: str) -> Iterator[IO[bytes]]:
    """A file below `folder` (a drop zone, or a user's folder beside the file `batch-assets run`
    copies) opened as a drop file is: locally without following a link anywhere below the data root
    or below `folder`, regular files only (`DropFileError` otherwise); a missing file raises
    `FileNotFoundError`."""
    if is_local(folder):
        with _open_local_regular_file(folder, relative_path) as file:
            yield file
    else:
        with folder.fs.open(_full_path(folder, relative_path), "rb") as file:
            yield file


def _zone_root(zone: UPath) -> str:
    return zone.path.rstrip("/") or "/"


def _zone_anchor(zone: UPath) -> tuple[str, list[str]]:
    """(the folder whose path may go through links, the folders from it down to the zone).

    Links in `BATCH_ASSETS_DATA` are whoever configured it; the `drops/<task>` folders below it
    may be writable by droppers, so they are real folders or the zone is refused.
    """
    root = _zone_root(zone)
    data = _zone_root(data_root())
    if is_local(data_root()) and root.startswith(data.rstrip("/") + "/"):
        return data, root[len(data.rstrip("/")) + 1 :].split("/")
    return root, []


def _check_zone_folders(zone: UPath) -> None:
    """Refuse a local zone reached through a link below `BATCH_ASSETS_DATA` (see `_zone_anchor`)."""
    path, folders = _zone_anchor(zone)
    for depth, folder in enumerate(folders):
        path = os.path.join(path, folder)
        try:
            if stat.S_ISLNK(os.lstat(path).st_mode):
                raise StorageError(_zone_link_message(zone, folders[: depth + 1]))
        except FileNotFoundError:
            return


def _zone_link_message(zone: UPath, folders: list[str]) -> str:
    return (
        f"drop zone {zone}: {'/'.join(folders)} under BATCH_ASSETS_DATA is a symbolic link; drop zones "
        "are read through real folders only (point BATCH_ASSETS_DATA at the linked storage instead)"
    )


def _full_path(zone: UPath, relative_path: str) -> str:
    return f"{zone.path.rstrip('/')}/{relative_path}"


_NOT_REGULAR = (
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISDIR, "a folder"),
)
_LINK_REASON = "symbolic link: the drop zone reads regular files only (copy the file in instead)"


def _not_regular_reason(mode: int) -> str:
    kind = next((name for test, name in _NOT_REGULAR if test(mode)), "not a file")
    return f"{kind}, not a regular file: the drop zone reads regular files only"


def _open_local_regular_file(zone: UPath, relative_path: str) -> IO[bytes]:
    """Open the zone's `relative_path` without following a link anywhere below the zone's anchor
    (see `_zone_anchor`), refusing anything but a regular file. A FIFO is opened without waiting
    for a writer, then refused."""
    parts = relative_path.split("/")
    if any(part in ("", ".", "..") for part in parts):
        raise DropFileError(f"{relative_path}: unsafe name; not read")
    anchor, zone_folders = _zone_anchor(zone)
    # (folder to open, what an error names): the zone's own folders, then the file's.
    steps = [(part, f"drop zone folder {'/'.join(zone_folders[: n + 1])}") for n, part in enumerate(zone_folders)]
    steps += [(part, relative_path) for part in parts[:-1]]
    folder = os.open(anchor, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part, shown in steps:
            inner = _open_below(folder, part, os.O_DIRECTORY, shown)
            os.close(folder)
            folder = inner
        handle = _open_below(folder, parts[-1], os.O_NONBLOCK, relative_path)
    finally:
        os.close(folder)
    # Checked before `fdopen`, which refuses a folder with IsADirectoryError.
    mode = os.fstat(handle).st_mode
    if not stat.S_ISREG(mode):
        os.close(handle)
        raise DropFileError(f"{relative_path}: {_not_regular_reason(mode)}; not read")
    return os.fdopen(handle, "rb")


def _open_below(folder: int, name: str, flags: int, shown: str) -> int:
    try:
        return os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | flags, dir_fd=folder)
    except OSError as exc:
        # O_NOFOLLOW refuses a link with ELOOP; O_DIRECTORY a link (or a file) with ENOTDIR.
        if exc.errno in (errno.ELOOP, errno.ENOTDIR) and _is_link(folder, name):
            raise DropFileError(f"{shown}: {_LINK_REASON}; not read") from None
        raise


def _is_link(folder: int, name: str) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=folder, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _version_of(info: dict) -> str:
    for key in ("ETag", "etag", "mtime", "LastModified", "last_modified", "created"):
        if info.get(key) is not None:
            value = info[key]
            value = value.isoformat() if hasattr(value, "isoformat") else str(value)
            return f"{key}={value.strip(chr(34))};size={info.get('size')}"
    return f"size={info.get('size')}"


def _size_of(info: dict) -> int | None:
    size = info.get("size")
    return int(size) if isinstance(size, int | float) else None


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
    with storage_errors("listing drop zone", zone):
        if local:
            _check_zone_folders(zone)
        entries = list(_local_entries(_zone_root(zone)) if local else _remote_entries(zone))
    now = time.time() if now is None else now
    files: list[DropFile] = []
    skipped: dict[str, str] = {}
    for relative, info, refused in sorted(entries, key=lambda entry: entry[0]):
        reason = refused or skip_reason(relative)
        modified = _modified_of(info)
        if reason is None and local and settle_seconds > 0 and modified is not None and now - modified < settle_seconds:
            reason = (
                f"still being written (modified {max(now - modified, 0):.1f} s ago; "
                f"picked up once unchanged for {settle_seconds:g} s)"
            )
        if reason:
            skipped[relative] = reason
            continue
        files.append(DropFile(relative, zone, _version_of(info), modified, _size_of(info)))
    return files, skipped


# (path relative to the zone, file info, why it is refused before its name is even looked at)
_Entry = tuple[str, dict, str | None]


def _remote_entries(zone: UPath) -> Iterator[_Entry]:
    root = zone.path.rstrip("/")
    # s3fs pages through ListObjectsV2 (1,000 keys a page) until the prefix is exhausted.
    for full_path, info in zone.fs.find(root, detail=True).items():
        # A key ending in `/` is a folder marker (the S3 console's "Create folder"), not a file,
        # whatever its name looks like (`reports.csv/`).
        if info.get("type") == "directory" or full_path.endswith("/") or not full_path.startswith(root + "/"):
            continue
        # Exactly one separator off: the rest of the key, `/` included, is the name (`//a.jsonl`
        # under the prefix is another object than `a.jsonl`).
        yield full_path[len(root) + 1 :], info, None


def _local_entries(root: str) -> Iterator[_Entry]:
    """Every entry below `root`, walking folders without following links (`os.scandir` and
    `lstat`): regular files with their info, anything else with the reason it is not read."""
    if not os.path.isdir(root):
        return
    pending = [""]
    while pending:
        prefix = pending.pop()
        try:
            with os.scandir(os.path.join(root, prefix) if prefix else root) as scan:
                found = list(scan)
        except (FileNotFoundError, NotADirectoryError):
            continue  # removed (or replaced) since its parent was listed
        except PermissionError:
            if not prefix:
                raise
            yield prefix, {}, "a folder this process may not list (permission denied)"
            continue
        for entry in found:
            relative = f"{prefix}/{entry.name}" if prefix else entry.name
            try:
                info = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if stat.S_ISLNK(info.st_mode):
                yield relative, {}, _LINK_REASON
            elif stat.S_ISDIR(info.st_mode):
                pending.append(relative)
            elif stat.S_ISREG(info.st_mode):
                # The same fields fsspec's local `info` gave, so file versions stay what they were.
                yield relative, {"mtime": info.st_mtime, "size": info.st_size, "type": "file"}, None
            else:
                yield relative, {}, _not_regular_reason(info.st_mode)


def _candidate_paths(partition_key: str) -> list[str]:
    """Relative paths that may have produced `partition_key`, to look up before listing the zone."""
    candidates = [partition_key]
    if _HASH_SUFFIX.search(partition_key):
        candidates.append(partition_key[:-9].replace("__", "/"))
    return candidates


def find_drop_file(task: str, partition_key: str, zone: UPath | None = None) -> DropFile:
    """The drop file behind a partition (of the whole file or of one of its shards): a direct
    lookup for plain names, a listing otherwise.

    A partition whose name the zone now refuses (a link, a FIFO: e.g. one registered before links
    were refused, or a file swapped for a link) raises `DropFileError` saying why.
    """
    zone = zone or drop_zone(task)
    partition_key = file_key_of(checked_partition_key(partition_key))
    for candidate in _candidate_paths(partition_key):
        if partition_key_for(candidate) != partition_key or skip_reason(candidate) is not None:
            continue
        found = _lookup(zone, candidate)
        if found is not None:
            return found
    files, skipped = list_drop_files(task, zone)
    for drop in files:
        if drop.partition_key == partition_key:
            return drop
    for relative, reason in skipped.items():
        if partition_key_for(relative) == partition_key:
            raise DropFileError(f"{relative}: {reason}; not read")
    raise FileNotFoundError(f"no file in {zone} maps to partition {partition_key!r} (was it removed or renamed?)")


def _lookup(zone: UPath, relative: str) -> DropFile | None:
    """The drop file at `relative`, or None when there is none; a local path that is not a regular
    file all the way down raises `DropFileError`."""
    url = f"{str(zone).rstrip('/')}/{relative}"
    with storage_errors("reading drop file", url):
        if is_local(zone):
            _check_zone_folders(zone)
            info = _local_info(_zone_root(zone), relative)
        else:
            try:
                info = zone.fs.info(_full_path(zone, relative))
            except FileNotFoundError:
                return None
    if info is None or info.get("type") != "file":
        return None
    return DropFile(relative, zone, _version_of(info), _modified_of(info), _size_of(info))


def _local_info(root: str, relative: str) -> dict | None:
    """lstat of every part below `root`: None when a part is missing (or the name has an empty
    part, which no local file has)."""
    parts = relative.split("/")
    if "" in parts:
        return None
    path = root
    for position, part in enumerate(parts):
        path = os.path.join(path, part)
        try:
            info = os.lstat(path)
        except (FileNotFoundError, NotADirectoryError):
            return None
        if stat.S_ISLNK(info.st_mode):
            raise DropFileError(f"{relative}: {_LINK_REASON}; not read")
        if position < len(parts) - 1:
            if not stat.S_ISDIR(info.st_mode):
                return None
            continue
        if stat.S_ISDIR(info.st_mode):
            return None  # a folder of that name: the listing says whether any file maps to the key
        if not stat.S_ISREG(info.st_mode):
            raise DropFileError(f"{relative}: {_not_regular_reason(info.st_mode)}; not read")
    return {"mtime": info.st_mtime, "size": info.st_size, "type": "file"}
