"""Copying a user's files into a task's drop zone (`batch-assets run`), every file checked first.

A drop file is named after the user's file, so two files of the same name from different folders
would be one partition, the second silently replacing the first's outputs. Before anything is
copied, each named file must exist and be an input the drop zone reads, no two named files may share
a name with different content, and a drop file of that name with other content is refused unless it
came from the same file (an edit) or the user asked to replace it. Identical bytes are not copied
again: that would only change the file's version and force a re-run.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from batch_assets.storage.drop_files import DropFile, DropFileError, input_file_problem, partition_key_for
from batch_assets.storage.drop_pictures import PicturesRefused, pictures_to_copy
from batch_assets.storage.errors import StorageError, storage_errors
from batch_assets.storage.locations import DATA_ENV, data_root, drop_zone, write_bytes_atomically

if TYPE_CHECKING:
    from upath import UPath

    from batch_assets.pipeline.task_spec.input import InputSpec


class CopyRefused(Exception):
    """A named file the drop zone must not get (missing, not an input, a name clash); nothing was copied."""


@dataclass
class NamedFile:
    path: Path  # as the user named it
    content: bytes
    key: str  # its partition key in the task's drop zone

    @property
    def origin(self) -> str:
        return str(self.path.resolve())


def read_named_files(files: list[Path]) -> list[NamedFile]:
    """Every named file, checked before anything is copied: exists, is an input, no two share a name."""
    named: dict[str, NamedFile] = {}
    for file in files:
        if file.is_dir():
            raise CopyRefused(f"{file}: a folder, not a file: name the files in it to run (e.g. {file}/*.jsonl)")
        if not file.is_file():
            raise CopyRefused(f"{file}: no such file")
        problem = input_file_problem(file.name)
        if problem is not None:
            raise CopyRefused(f"{file}: not an input file: {problem}")
        entry = NamedFile(file, file.read_bytes(), partition_key_for(file.name))
        earlier = named.get(file.name)
        if earlier is not None and earlier.content != entry.content:
            raise CopyRefused(
                f"{earlier.path} and {file} are different files with the same name, so both would be the drop "
                f"file {file.name!r} (partition {entry.key}); nothing was copied. Rename one, or run them in "
                "separate commands (the second with --replace to replace the first)"
            )
        named.setdefault(file.name, entry)
    return list(named.values())


# What the drop zone holds under a name that is no regular file (a link, a FIFO): never equal to a file's bytes.
_NOT_A_REGULAR_FILE = object()


def _drop_zone_content(zone: UPath, name: str) -> bytes | object | None:
    """The bytes of the drop file `name`, None when there is none, read as the pipeline reads drops:
    a link or FIFO put there is not followed or waited on, and counts as a different file."""
    if not (zone / name).exists() and not os.path.lexists(str(zone / name)):
        return None
    try:
        return DropFile(name, zone, "").read_bytes()
    except (DropFileError, FileNotFoundError):
        return _NOT_A_REGULAR_FILE


def copy_into_drop_zone(
    task_name: str,
    files: list[NamedFile],
    *,
    last_origin: Callable[[NamedFile], str | None],
    replace: bool,
    say: Callable[[str], None],
    input_spec: InputSpec | None = None,
) -> None:
    """Copy the files into the drop zone; a different file of the same name is refused unless `replace`.
    `last_origin` is the path of the file the drop file's partition was last run from (None: unknown).
    With an image task's `input_spec`, the pictures the files name beside them come too (drop_pictures.py)."""
    zone = drop_zone(task_name)
    with _naming_the_data_root(f"copying into the {task_name} drop zone", zone):
        try:
            pictures = pictures_to_copy(zone, [(f.path, f.content) for f in files], input_spec, replace=replace)
        except PicturesRefused as exc:
            raise CopyRefused(str(exc)) from None
        plans = _copy_plans(task_name, zone, files, last_origin, replace)
        # Pictures first: a sensor that sees the drop file finds its pictures there.
        for picture in pictures:
            if picture.note:
                say(picture.note)
            picture.copy_into(zone)
        for file, target, note in plans:
            if note:
                say(note)
            write_bytes_atomically(target, file.content)


@contextmanager
def _naming_the_data_root(action: str, zone: UPath) -> Iterator[None]:
    """Storage failures (no credentials for the bucket, a full disk) as one `StorageError` naming the
    drop zone, the cause and the setting that put the drop zone there."""
    try:
        with storage_errors(action, zone):
            yield
    except StorageError as error:
        if DATA_ENV in str(error):
            raise
        raise StorageError(f"{error}; the drop zone is under {DATA_ENV}={data_root()}", errno=error.errno) from None


def _copy_plans(
    task_name: str,
    zone: UPath,
    files: list[NamedFile],
    last_origin: Callable[[NamedFile], str | None],
    replace: bool,
) -> list[tuple[NamedFile, UPath, str | None]]:
    """What to copy where, with the note to print first; a different file of the same name is refused
    unless `replace`."""
    plans: list[tuple[NamedFile, UPath, str | None]] = []
    note: str | None
    for file in files:
        target = zone / file.path.name
        existing = _drop_zone_content(zone, file.path.name)
        if existing == file.content:
            continue  # re-copying identical bytes would only change the file's version and force a re-run
        if existing is None:
            plans.append((file, target, None))
            continue
        origin = last_origin(file)
        if origin == file.origin:
            note = f"{file.path}: changed since its last run; partition {file.key} is run again from the new content"
        elif replace:
            note = (
                f"{file.path}: replaces the drop file {file.path.name} (from {origin or 'elsewhere'}) as asked "
                f"(--replace); partition {file.key} and its outputs are replaced"
            )
        else:
            raise CopyRefused(
                f"{file.path}: the {task_name} drop zone already holds a different {file.path.name} "
                f"(from {origin or 'an earlier drop'}), whose outputs running this file would replace; nothing was "
                "copied. Rename the file, or pass --replace to replace it"
            )
        plans.append((file, target, note))
    return plans
