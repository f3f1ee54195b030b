"""The batches a batch API task submitted: one JSON record per batch, kept like checkpoints.

    <data>/storage/<task>/_batch_api/<run fingerprint>/<record name>.json

A record holds the provider's batch and file ids and the `custom_id`s the batch answers; it is
written before the run waits for the batch (engines/batch_api_run.py), atomically (rename
locally, one PUT on S3), so a run killed while its batch is in flight, or retried, collects that
batch instead of submitting (and paying for) the same requests again. Records live under the run
fingerprint, like checkpoints: other model or sampling settings never reuse them.
"""

from __future__ import annotations

import json

from upath import UPath

from batch_assets.storage.checkpoints import remove_path
from batch_assets.storage.errors import storage_errors
from batch_assets.storage.locations import one_name, task_storage_dir, write_bytes_atomically

FOLDER = "_batch_api"


def batch_records_dir(task: str, fingerprint: str) -> UPath:
    return task_storage_dir(task) / FOLDER / one_name(fingerprint)


class BatchRecordStore:
    """The `BatchRecords` of one task and run fingerprint (pipeline/result_stores.py)."""

    def __init__(self, folder: UPath) -> None:
        self.folder = folder

    def load(self) -> list[dict]:
        if not self.folder.exists():
            return []
        records = []
        for path in sorted(p for p in self.folder.iterdir() if p.name.endswith(".json")):
            with storage_errors("reading", path):
                records.append(json.loads(path.read_bytes()))
        return sorted(records, key=lambda record: record.get("created", 0))

    def save(self, record: dict) -> None:
        path = self.folder / f"{one_name(record['name'])}.json"
        write_bytes_atomically(path, json.dumps(record, sort_keys=True).encode("utf-8"))

    def remove(self, name: str) -> None:
        path = self.folder / f"{one_name(name)}.json"
        if path.exists():
            remove_path(path)
