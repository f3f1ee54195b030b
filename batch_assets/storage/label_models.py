"""A cascade task's stored student (`<task>/label_model`), kept by task version:

    <storage>/<task>/label_model/<task version>/current.json            which model is current (written last)
    <storage>/<task>/label_model/<task version>/<digest>/training.parquet its training rows: embedding, label

A new model goes into a folder of its own (named by its training rows' digest), and only then does
`current.json` name it, written atomically: a run killed at any moment leaves the previous model
current and whole. After the switch, folders older than the previous model are removed (a partition
run that read `current.json` just before the switch still finds the previous one).

What is stored is the training rows, not a fitted estimator: task storage is often a shared bucket,
and unpickling an estimator from it (joblib, scikit-learn's own persistence) would run whatever code
the file holds. A partition trains the student again from the rows (logistic regression on a few
thousand rows: seconds; the same rows and seed give the same student, in any scikit-learn version).
"""

from __future__ import annotations

import importlib.metadata
import io
import json
import re
from collections.abc import Callable

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
from upath import UPath

from batch_assets.pipeline.embeddings import vectors_matrix
from batch_assets.pipeline.label_model import (
    TRAINING_COLUMNS,
    LabelModel,
    teacher_labelled,
    training_digest,
    training_selection,
)
from batch_assets.storage.checkpoints import remove_path
from batch_assets.storage.errors import StorageError, storage_errors
from batch_assets.storage.locations import one_name, output_path, task_storage_dir, write_bytes_atomically

CURRENT = "current.json"


def label_model_dir(task: str, version: str) -> UPath:
    return task_storage_dir(task) / "label_model" / one_name(version)


def read_training_rows(task: str, partition_keys: list[str], max_rows: int, seed: int) -> dict[str, pl.DataFrame]:
    """The teacher-labelled rows of each partition's stored inference_outputs (its training columns),
    at most `max_rows` in all, chosen by `training_selection`. Each file is read twice, a column set
    at a time: its labels (who gave them, and errors) first, then the embeddings of the chosen rows
    alone, a row group at a time; memory holds the chosen rows, never every partition's embeddings."""
    taught = {}
    for key in partition_keys:
        path = output_path(task, "inference_outputs", key)
        with storage_errors("reading", path), path.open("rb") as handle:
            who = pl.from_arrow(pq.ParquetFile(handle).read(columns=["generated_text", "labelled_by", "error"]))
        assert isinstance(who, pl.DataFrame)
        taught[key] = who.with_row_index("row").filter(teacher_labelled())
    labels = {key: frame["generated_text"].to_list() for key, frame in taught.items()}
    chosen = training_selection(labels, max_rows, seed)
    frames = {}
    for key, frame in taught.items():
        rows = frame.select(pl.all().gather(chosen[key]))
        path = output_path(task, "inference_outputs", key)
        with storage_errors("reading", path):
            embeddings = _rows_of_column(path, "embedding", rows["row"].to_numpy())
        frames[key] = rows.select(*(pl.col(c) for c in TRAINING_COLUMNS if c != "embedding")).with_columns(embeddings)
    return frames


def _rows_of_column(path: UPath, column: str, rows: np.ndarray) -> pl.Series:
    """`column` of a parquet file at `rows` (ascending), read one row group at a time: a row group
    with none of them is never read."""
    with path.open("rb") as handle:
        parquet = pq.ParquetFile(handle)
        pieces, start = [parquet.schema_arrow.empty_table().select([column])], 0
        for group in range(parquet.num_row_groups):
            size = parquet.metadata.row_group(group).num_rows
            inside = rows[(rows >= start) & (rows < start + size)] - start
            if inside.size:
                pieces.append(parquet.read_row_group(group, columns=[column]).take(pa.array(inside)))
            start += size
    values = pl.from_arrow(pa.concat_tables(pieces).column(column))
    assert isinstance(values, pl.Series)
    return values.alias(column)


def write_label_model(task: str, model: LabelModel) -> UPath:
    """Store `model` under its task version and make it current; its folder."""
    folder = label_model_dir(task, model.version)
    target = folder / model.digest
    training = pl.DataFrame(
        {"embedding": pl.Series(model.vectors.astype(np.float32)), "label": pl.Series(model.labels, dtype=pl.String)}
    )
    parquet = io.BytesIO()
    training.write_parquet(parquet, compression="zstd")
    write_bytes_atomically(target / "training.parquet", parquet.getvalue())
    student = model.student
    current = {
        "digest": model.digest,
        "version": model.version,
        "partitions": model.partitions,
        "classes": student.classes,
        "cv_agreement": student.cv_agreement,
        "calibration_error": student.ece,
        "calibrated": student.calibrated,
        "note": student.note,
        "scikit_learn": importlib.metadata.version("scikit-learn"),
    }
    with storage_errors("reading", folder):
        previous = json.loads((folder / CURRENT).read_bytes()).get("digest") if (folder / CURRENT).exists() else None
    write_bytes_atomically(folder / CURRENT, json.dumps(current, indent=2).encode("utf-8"))
    with storage_errors("cleaning up", folder):
        for earlier in folder.iterdir():
            if earlier.name not in (CURRENT, model.digest, previous) and not earlier.name.startswith("."):
                remove_path(earlier)
    return target


def read_label_model(task: str, version: str, warn: Callable[[str], None], seed: int = 0) -> LabelModel | None:
    """The current label model of `task` at `version`; None when there is none (or it cannot be
    used: `warn` says why, and the partition trains its own student as without one).

    Only the training rows come back; the student is trained from them when a partition uses it
    (deterministic with `seed`), never unpickled: task storage is often a shared bucket, and a
    pickle from it would run its code here.
    """
    folder = label_model_dir(task, version)
    try:
        with storage_errors("reading", folder):
            if not (folder / CURRENT).exists():
                return None
            current = json.loads((folder / CURRENT).read_bytes())
            digest = str(current["digest"])
            if not re.fullmatch(r"[0-9a-f]{8,64}", digest):
                warn(f"{folder / CURRENT}: its digest {digest!r} is not one this project writes; not used")
                return None
            target = folder / digest
            training = pl.read_parquet(io.BytesIO((target / "training.parquet").read_bytes()))
    except (StorageError, KeyError, ValueError) as exc:
        # A label_model run replacing it right now, or a damaged file: this run goes without it.
        warn(f"{folder}: the label model could not be read ({exc}); not used: materialize label_model again")
        return None
    vectors, labels = vectors_matrix(training["embedding"]), training["label"].to_list()
    if training_digest(vectors, labels) != digest:
        warn(f"{target}: its training rows do not match their digest; not used: materialize label_model again")
        return None
    # The student is trained by the partition that uses it (`StoredStudent.student`), once.
    return LabelModel(vectors, labels, seed, current["partitions"], version, digest)
