"""The pictures an image task's file names, brought into the drop zone with it (`batch-assets run`
and `drop` copy a user's file; without its pictures every row would be `image_not_found`).

A record's picture path is relative to its file (pipeline/inputs/images.py, `image_source`), and the file
is copied to the top of the drop zone, so `photos/a.png` beside `~/mine/pictures.jsonl` goes to
`<zone>/photos/a.png`. It is read beside the file as the drop zone reads its files: no link followed
below the file's folder, regular files only. A value the pipeline never reads from the drop zone (a
`data:` URL, an `s3://` URI, a path leading out of the zone) is not copied: it stays its row's
business. Before anything is copied every picture must be beside its file or already in the drop
zone; one that is neither, a link, not a regular file, or another picture than the drop zone's of
that name (without `--replace`) refuses the whole copy, naming the pictures and where they go.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
from dataclasses import dataclass
from pathlib import Path

import polars as pl
from upath import UPath

from batch_assets.pipeline.inputs.images import ImageInputError, image_source
from batch_assets.pipeline.inputs.read_prompts import DropFileError, ParseOptions, read_prompts
from batch_assets.pipeline.task_spec.input import InputSpec
from batch_assets.storage.drop_files import open_zone_file
from batch_assets.storage.locations import is_local, write_stream_atomically

# How many refused pictures a refusal names (the rest are counted).
_SHOWN = 5


class PicturesRefused(Exception):
    """A picture the named files need cannot be brought into the drop zone; nothing was copied."""


@dataclass(frozen=True)
class PictureCopy:
    folder: Path  # of the user's file naming it
    relative_path: str  # below that folder, and in the drop zone
    note: str | None  # said before it is copied (it replaces the drop zone's picture of that name)

    def copy_into(self, zone: UPath) -> None:
        """Copy the picture, read as it was checked (no link followed below the file's folder)."""
        with open_zone_file(UPath(str(self.folder)), self.relative_path) as source:
            write_stream_atomically(zone / self.relative_path, source)


def picture_paths(content: bytes, file_name: str, spec: InputSpec) -> list[str]:
    """The drop-zone paths of the pictures a file's readable records name, once each, in order."""
    options = ParseOptions(text_fields=tuple(spec.text_fields), txt_field=spec.txt_field)
    try:
        frame = read_prompts(content, file_name, options)
    except DropFileError:
        return []  # the run says what is wrong with the file itself
    readable = frame.filter(pl.col("error").is_null())
    paths: dict[str, None] = {}
    for field in (field for field in spec.image_fields if field in readable.columns):
        for value in readable[field].to_list():
            try:
                source = image_source(value, file_name)
            except ImageInputError:
                continue  # the row's own error when it is read
            if source.path is not None:
                paths[source.path] = None
    return list(paths)


def pictures_to_copy(
    zone: UPath, files: list[tuple[Path, bytes]], spec: InputSpec | None, *, replace: bool
) -> list[PictureCopy]:
    """What to copy for the named files (each: the path the user named, its content), every picture
    checked first; `PicturesRefused` names those that cannot be brought."""
    if spec is None or not spec.image_fields or spec.format != "records":
        return []
    wanted: dict[str, Path] = {}  # a picture's drop-zone path: the file naming it first
    for path, content in files:
        for relative in picture_paths(content, path.name, spec):
            wanted.setdefault(relative, path)
    copies: list[PictureCopy] = []
    missing: list[str] = []
    refused: list[str] = []
    for relative, file in wanted.items():
        beside = file.parent / relative
        try:
            digest = _digest(UPath(str(file.parent)), relative)
        except DropFileError as exc:
            refused.append(f"{beside}: {_cause(exc)}")
            continue
        existing = _zone_digest(zone, relative)
        if digest is None:
            if existing is None:
                missing.append(f"{relative} (named by {file}: put it at {beside} or {_joined(zone, relative)})")
            continue
        if existing == digest:
            continue  # copying identical bytes again would change nothing
        problem = _zone_folder_problem(zone, relative)
        if problem is not None:
            refused.append(problem)
        elif existing is not None and not replace:
            refused.append(
                f"{beside}: the drop zone holds another picture of that name ({_joined(zone, relative)}); "
                "pass --replace to replace it"
            )
        else:
            note = f"{beside}: replaces the drop zone's picture {relative} (--replace)" if existing else None
            copies.append(PictureCopy(file.parent, relative, note))
    if missing:
        raise PicturesRefused(
            f"{len(missing)} picture(s) are neither beside the file naming them nor in the drop zone, so their "
            f"rows would be image_not_found; nothing was copied: {_listed(missing)}"
        )
    if refused:
        raise PicturesRefused(f"nothing was copied: {_listed(refused)}")
    return copies


def _digest(folder: UPath, relative: str) -> str | None:
    """The SHA-256 of a file below `folder` (read as drop files are), None when there is none."""
    try:
        digest = hashlib.sha256()
        with open_zone_file(folder, relative) as file:
            for chunk in iter(lambda: file.read(1 << 20), b""):
                digest.update(chunk)
        return digest.hexdigest()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        if exc.errno == errno.ENAMETOOLONG:
            return None
        raise


# What the drop zone holds under a name that is no regular file (a link, a FIFO): never a picture's digest.
_NOT_A_REGULAR_FILE = "not a regular file"


def _zone_digest(zone: UPath, relative: str) -> str | None:
    try:
        return _digest(zone, relative)
    except DropFileError:
        return _NOT_A_REGULAR_FILE


def _zone_folder_problem(zone: UPath, relative: str) -> str | None:
    """Why a picture may not be written below the local drop zone: a folder on its way that is a
    link (writing through it would put the picture elsewhere) or no folder."""
    if not is_local(zone):
        return None
    folder = Path(zone.path)
    for part in relative.split("/")[:-1]:
        folder = folder / part
        try:
            mode = os.lstat(folder).st_mode
        except FileNotFoundError:
            return None
        if not stat.S_ISDIR(mode):
            kind = "a symbolic link" if stat.S_ISLNK(mode) else "not a folder"
            return f"{folder}: {kind}, so {relative} cannot be written into the drop zone"
    return None


def _cause(error: DropFileError) -> str:
    """A drop-file error's cause without the path it starts with (the message names the full path)."""
    return str(error).split(": ", 1)[-1].removesuffix("; not read")


def _joined(zone: UPath, relative: str) -> str:
    return f"{str(zone).rstrip('/')}/{relative}"


def _listed(items: list[str]) -> str:
    more = f"; and {len(items) - _SHOWN} more" if len(items) > _SHOWN else ""
    return "; ".join(items[:_SHOWN]) + more
