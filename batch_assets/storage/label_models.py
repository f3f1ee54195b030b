"""A cascade task's stored student (`<task>/label_model`), kept by task version:

    <storage>/<task>/label_model/<task version>/current.json            which model is current (written last)
    <storage>/<task>/label_model/<task version>/<digest>/training.parquet its training rows: embedding, label

A cascade by target keeps beside each model (each student version) what its partitions share:

    <task version>/<digest>/calibration.json               its calibration: threshold, kept-row bound, rows
    <task version>/<digest>/labelled/<partition>.json      what each partition labelled with it

The first partition of a task with no model trains its student on its sample and settles it as the
model (`settle_label_model`), and the first partition of a model with no calibration calibrates it
(`settle_calibration`): **first writer wins**. Locally the read-or-write happens under an exclusive
`flock` on `<task version>/.settle.lock`, so two partitions run in parallel (two runs of a backfill, two
processes) agree on one model and one calibration; the one that lost uses the winner's (its own sample
and calibration rows keep their teacher labels). On object storage there is no lock: the winner is
the object read back after writing, and two writers within the same moment may each keep their own;
every partition records the student version it used (`target_student_version`), and the guarantee
is per version, so it holds either way.

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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
from upath import UPath

from batch_assets.pipeline.cascade.label_model import (
    TRAINING_COLUMNS,
    LabelModel,
    LabelModelError,
    fit_label_model,
    teacher_labelled,
    training_digest,
    training_selection,
)
from batch_assets.pipeline.cascade.target import Calibration, PartitionFigures
from batch_assets.pipeline.result_stores import vectors_matrix
from batch_assets.runtime.instance import exclusive_file_lock
from batch_assets.storage.checkpoints import remove_path
from batch_assets.storage.errors import StorageError, storage_errors
from batch_assets.storage.locations import (
    is_local,
    one_name,
    output_path,
    task_storage_dir,
    write_bytes_atomically,
)

CURRENT = "current.json"
CALIBRATION = "calibration.json"
LABELLED = "labelled"
SETTLE_LOCK = ".settle.lock"


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


@contextmanager
def _settling(folder: UPath) -> Iterator[None]:
    """One settler at a time in `folder` (a task version's): an exclusive flock locally; none on
    object storage (the module says what that leaves)."""
    if not is_local(folder):
        yield
        return
    with storage_errors("locking", folder):
        folder.mkdir(parents=True, exist_ok=True)
    with exclusive_file_lock(Path(folder.path) / SETTLE_LOCK):
        yield


def settle_label_model(task: str, model: LabelModel, warn: Callable[[str], None]) -> LabelModel:
    """The task version's current model; `model` written and made current when there is none (first
    writer wins). A current model that cannot be read is replaced (`warn` says so)."""
    folder = label_model_dir(task, model.version)
    with _settling(folder):
        current = read_label_model(task, model.version, warn, model.seed)
        if current is not None:
            return current
        write_label_model(task, model)
    return model


def _calibration_path(task: str, version: str, student_version: str) -> UPath:
    return label_model_dir(task, version) / one_name(student_version) / CALIBRATION


def read_calibration(task: str, version: str, student_version: str, warn: Callable[[str], None]) -> Calibration | None:
    """The stored calibration of a student version; None when there is none (or it cannot be read:
    `warn` says why, and the partition calibrates again)."""
    path = _calibration_path(task, version, student_version)
    try:
        with storage_errors("reading", path):
            if not path.exists():
                return None
            return Calibration.from_json(path.read_bytes())
    except (StorageError, KeyError, TypeError, ValueError) as exc:
        warn(f"{path}: the calibration could not be read ({exc}); calibrating again")
        return None


def settle_calibration(task: str, version: str, calibration: Calibration, warn: Callable[[str], None]) -> Calibration:
    """The student version's stored calibration for the same target; `calibration` written when there
    is none (first writer wins)."""
    path = _calibration_path(task, version, calibration.student_version)
    with _settling(label_model_dir(task, version)):
        stored = read_calibration(task, version, calibration.student_version, warn)
        if stored is not None and (stored.agreement, stored.confidence) == (
            calibration.agreement,
            calibration.confidence,
        ):
            return stored
        write_bytes_atomically(path, calibration.to_json())
    return calibration


def record_figures(
    task: str, version: str, student_version: str, partition: str, figures: PartitionFigures
) -> list[PartitionFigures]:
    """`figures` stored as what `partition` labelled with the student version (a re-run replaces its
    own), and those of every partition that version labelled."""
    folder = label_model_dir(task, version) / one_name(student_version) / LABELLED
    write_bytes_atomically(folder / f"{one_name(partition)}.json", json.dumps(figures.to_dict()).encode("utf-8"))
    every = []
    with storage_errors("reading", folder):
        for path in sorted(folder.iterdir(), key=lambda p: p.name):
            if path.name.endswith(".json") and not path.name.startswith("."):
                every.append(PartitionFigures(**json.loads(path.read_bytes())))
    return every


def record_cost(
    task: str, version: str, student_version: str, partition: str, cost_usd: float
) -> list[PartitionFigures] | None:
    """The partition's labels' cost added to its figures (validated_labels knows it, after the
    inference recorded the rest); the figures of every partition of the student version. None when
    the partition recorded none (it ran alone: a partition the stored student learned from)."""
    folder = label_model_dir(task, version) / one_name(student_version) / LABELLED
    path = folder / f"{one_name(partition)}.json"
    with storage_errors("reading", path):
        if not path.exists():
            return None
        figures = PartitionFigures(**json.loads(path.read_bytes()))
    return record_figures(task, version, student_version, partition, replace(figures, cost_usd=cost_usd))


def teacher_row_count(task: str, partition_keys: list[str]) -> int:
    """The rows the teacher labelled without an error in the partitions' stored inference_outputs
    (two small columns of each file read, never the embeddings)."""
    count = 0
    for key in partition_keys:
        path = output_path(task, "inference_outputs", key)
        with storage_errors("reading", path), path.open("rb") as handle:
            who = pl.from_arrow(pq.ParquetFile(handle).read(columns=["labelled_by", "error"]))
        assert isinstance(who, pl.DataFrame)
        count += who.filter(teacher_labelled()).height
    return count


def grow_label_model(
    task: str, stored: LabelModel, partition_keys: list[str], max_rows: int, warn: Callable[[str], None]
) -> LabelModel:
    """The task version's model retrained on the teacher labels of `partition_keys` and made current,
    unless another run did so first (the current model is no longer `stored`: that one is returned).
    Trained under the settling lock, so two runs starting together grow it once."""
    with _settling(label_model_dir(task, stored.version)):
        current = read_label_model(task, stored.version, warn, stored.seed)
        if current is not None and current.digest != stored.digest:
            return current
        try:
            model = fit_label_model(
                read_training_rows(task, partition_keys, max_rows, stored.seed), stored.version, stored.seed
            )
        except LabelModelError as exc:
            warn(f"{task}: the label model was not grown ({exc}); the current one stays")
            return stored
        write_label_model(task, model)
    return model
