"""Files and batches of `batch-assets serve`, on disk under `$DAGSTER_HOME/serve`.

    serve/files/<file id>.jsonl      an uploaded file, or a batch's output or error file
    serve/files/<file id>.json       its OpenAI file object (with `expires_at`: an expired file is gone)
    serve/batches/<batch id>.json    {"batch": the OpenAI batch object, "run": what the server keeps of its run}
    serve/runs/<batch id>.jsonl      the input file under the batch's name, given to `batch-assets run`
    serve/logs/<batch id>.log        that command's output

Ids are generated here (`file-<32 hex>`, `batch_<32 hex>`) and a path is only ever made from an id
that matches that pattern, so no id a client sends (`../../etc/passwd`) reaches outside these
folders. Every JSON file is written whole (a temporary file renamed over it), so a server killed
mid-write leaves the previous state, and batches survive a restart.

Batches are read from disk once, when the store opens, and kept in memory: only one server writes
a home's store (`batch-assets serve` holds the home's serve lock), and its runner looks at every
batch each second, which re-reading the folder would make grow with the server's history.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import re
import threading
import time
import uuid
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import Any

from upath import UPath

from batch_assets.serve.settings import DEFAULT_EXPIRY_SECONDS
from batch_assets.storage.locations import write_bytes_atomically

FILE_ID = re.compile(r"file-[0-9a-f]{32}")
BATCH_ID = re.compile(r"batch_[0-9a-f]{32}")


def new_file_id() -> str:
    return f"file-{uuid.uuid4().hex}"


def new_batch_id() -> str:
    return f"batch_{uuid.uuid4().hex}"


def write_atomically(path: Path, data: bytes) -> None:
    write_bytes_atomically(UPath(path), data)


class ServeStore:
    """The server's files and batches. One lock orders every change of a batch (the routes run in
    a thread pool, the batch runner in a thread of its own)."""

    def __init__(self, root: Path, expiry_seconds: int = DEFAULT_EXPIRY_SECONDS) -> None:
        self.root = root
        self.expiry_seconds = expiry_seconds
        self.files, self.batches, self.runs, self.logs = (root / name for name in ("files", "batches", "runs", "logs"))
        for folder in (self.files, self.batches, self.runs, self.logs):
            folder.mkdir(parents=True, exist_ok=True)
        self.lock = threading.RLock()
        self._batches = {
            path.stem: json.loads(path.read_text(encoding="utf-8"))
            for path in self.batches.glob("batch_*.json")
            if BATCH_ID.fullmatch(path.stem)
        }

    # Files

    def content_path(self, file_id: str) -> Path | None:
        """Where a file's content is, or None for an id this server never made or a file deleted.
        Whether it expired is `file_object`'s to say (that reads its object; the runner's looks do not)."""
        if not FILE_ID.fullmatch(file_id):
            return None
        path = self.files / f"{file_id}.jsonl"
        return path if path.is_file() and (self.files / f"{file_id}.json").is_file() else None

    def file_object(self, file_id: str) -> dict[str, Any] | None:
        found = self._stored_object(file_id)
        # Expired: gone from now on, though the runner removes it at its next look only.
        return None if found is None or (found.get("expires_at") or math.inf) <= time.time() else found

    def _stored_object(self, file_id: str) -> dict[str, Any] | None:
        if self.content_path(file_id) is None:
            return None
        try:
            return json.loads((self.files / f"{file_id}.json").read_text(encoding="utf-8"))
        except FileNotFoundError:  # deleted since it was looked for
            return None

    def add_file(self, content: bytes, file_object: dict[str, Any]) -> dict[str, Any]:
        """Store a file (content first: an object always has its content) under its object's id;
        failing (a full disk), nothing of it stays."""
        file_id = file_object["id"]
        assert FILE_ID.fullmatch(file_id), file_id
        with self._or_nothing(file_id):
            write_atomically(self.files / f"{file_id}.jsonl", content)
            write_atomically(self.files / f"{file_id}.json", json.dumps(file_object).encode("utf-8"))
        return file_object

    @contextlib.contextmanager
    def _or_nothing(self, file_id: str) -> Iterator[None]:
        try:
            yield
        except BaseException:
            (self.files / f"{file_id}.jsonl").unlink(missing_ok=True)
            raise

    def staging_path(self) -> Path:
        """Where an upload is copied while it is checked (no file id matches it: never listed or served)."""
        return self.files / f".upload-{uuid.uuid4().hex}.tmp"

    def add_staged_file(self, staged: Path, file_object: dict[str, Any]) -> dict[str, Any]:
        """A checked upload (`staging_path`) stored under its object's id, as `add_file` stores content."""
        file_id = file_object["id"]
        assert FILE_ID.fullmatch(file_id), file_id
        with self._or_nothing(file_id):
            os.replace(staged, self.files / f"{file_id}.jsonl")
            write_atomically(self.files / f"{file_id}.json", json.dumps(file_object).encode("utf-8"))
        return file_object

    def delete_file(self, file_id: str) -> bool:
        """Remove a file (an expired one too); False when there is none. Its object goes first: a
        file without one is never listed or served."""
        if self._stored_object(file_id) is None:
            return False
        (self.files / f"{file_id}.json").unlink(missing_ok=True)
        (self.files / f"{file_id}.jsonl").unlink(missing_ok=True)
        return True

    def list_files(self) -> list[dict[str, Any]]:
        found = [self.file_object(path.stem) for path in self.files.glob("file-*.json")]
        return sorted((f for f in found if f), key=lambda f: (f["created_at"], f["id"]), reverse=True)

    def expired_files(self, now: float) -> list[str]:
        found = (self._stored_object(path.stem) for path in self.files.glob("file-*.json"))
        return [f["id"] for f in found if f and (f.get("expires_at") or math.inf) <= now]

    def stored_bytes(self) -> int:
        """The bytes of the files kept (inputs, outputs and errors; expired ones until removed), as
        the upload quota counts them."""
        return sum(_size(path) for path in self.files.glob("file-*.jsonl"))

    # Batches

    def batch_record(self, batch_id: str) -> dict[str, Any] | None:
        """{"batch": the OpenAI object, "run": the server's own notes}, or None for an unknown id. A
        copy: a change is kept only when saved (`save_batch`, `update_batch`)."""
        with self.lock:
            record = self._batches.get(batch_id)
            return copy.deepcopy(record) if record is not None else None

    def save_batch(self, record: dict[str, Any]) -> None:
        batch_id = record["batch"]["id"]
        assert BATCH_ID.fullmatch(batch_id), batch_id
        with self.lock:
            write_atomically(self.batches / f"{batch_id}.json", json.dumps(record).encode("utf-8"))
            self._batches[batch_id] = copy.deepcopy(record)

    def update_batch(
        self, batch_id: str, change: Callable[[dict[str, Any]], dict[str, Any] | None]
    ) -> dict[str, Any] | None:
        """Apply `change` to the batch's record under the lock and save it; `change` returns the
        record to save, or None to leave it as it was. The record as it is afterwards."""
        with self.lock:
            record = self.batch_record(batch_id)
            if record is None:
                return None
            changed = change(record)
            if changed is None:
                return record
            self.save_batch(changed)
            return changed

    def batch_records(self, statuses: Collection[str] | None = None) -> Iterator[dict[str, Any]]:
        """Every batch (or those in `statuses`), oldest first; copies, as `batch_record`'s."""
        with self.lock:
            kept = (r for r in self._batches.values() if statuses is None or r["batch"]["status"] in statuses)
            records = sorted(kept, key=_creation_order)
            copies = [copy.deepcopy(record) for record in records]
        yield from copies


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:  # deleted since it was listed
        return 0


def _creation_order(record: dict[str, Any]) -> tuple[int, int, str]:
    """Oldest first: `created_at` (seconds), then the nanoseconds kept in the run's notes (batches
    made within one second; a record without them sorts first), then the id."""
    return (record["batch"]["created_at"], record["run"].get("created_ns", 0), record["batch"]["id"])
