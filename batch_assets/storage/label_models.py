"""A cascade task's stored student (`<task>/label_model`), kept by task version:

    <storage>/<task>/label_model/<task version>/current.json            which model is current (written last)
    <storage>/<task>/label_model/<task version>/<digest>/model.joblib     the fitted scikit-learn classifier
    <storage>/<task>/label_model/<task version>/<digest>/training.parquet its training rows: embedding, label

A new model goes into a folder of its own (named by its training rows' digest), and only then does
`current.json` name it, written atomically: a run killed at any moment leaves the previous model
current and whole. The folders of earlier models of the same version are removed after the switch.

The model is a joblib file, scikit-learn's documented way to persist an estimator: joblib comes with
scikit-learn (no dependency of its own) and keeps numpy arrays whole. Like any pickle it runs code
when loaded, so it is read only from this task's storage, which only the pipeline writes (skops,
the format that loads untrusted files safely, would be a new dependency for the same trust). A
model pickled by another scikit-learn version is not loaded (its behaviour may differ, scikit-learn
only warns): it is retrained from the training rows beside it, the same rows giving the same student.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable

import joblib
import numpy as np
import polars as pl
import sklearn
from upath import UPath

from batch_assets.pipeline.cascade import Student, train_student
from batch_assets.pipeline.embeddings import vectors_matrix
from batch_assets.pipeline.label_model import TRAINING_COLUMNS, LabelModel, training_digest
from batch_assets.storage.checkpoints import remove_path
from batch_assets.storage.errors import storage_errors
from batch_assets.storage.locations import one_name, output_path, task_storage_dir, write_bytes_atomically

CURRENT = "current.json"


def label_model_dir(task: str, version: str) -> UPath:
    return task_storage_dir(task) / "label_model" / one_name(version)


def read_inference_outputs(task: str, partition_keys: list[str]) -> dict[str, pl.DataFrame]:
    """The training columns of each partition's stored inference_outputs."""
    frames = {}
    for key in partition_keys:
        path = output_path(task, "inference_outputs", key)
        with storage_errors("reading", path):
            frames[key] = pl.read_parquet(io.BytesIO(path.read_bytes()), columns=list(TRAINING_COLUMNS))
    return frames


def write_label_model(task: str, model: LabelModel) -> UPath:
    """Store `model` under its task version and make it current; its folder."""
    folder = label_model_dir(task, model.version)
    target = folder / model.digest
    model_bytes = io.BytesIO()
    joblib.dump(model.student.model, model_bytes)
    write_bytes_atomically(target / "model.joblib", model_bytes.getvalue())
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
        "scikit_learn": sklearn.__version__,
    }
    write_bytes_atomically(folder / CURRENT, json.dumps(current, indent=2).encode("utf-8"))
    with storage_errors("cleaning up", folder):
        for earlier in folder.iterdir():
            if earlier.name not in (CURRENT, model.digest) and not earlier.name.startswith("."):
                remove_path(earlier)
    return target


def read_label_model(task: str, version: str, warn: Callable[[str], None], seed: int = 0) -> LabelModel | None:
    """The current label model of `task` at `version`; None when there is none (or it cannot be
    used: `warn` says why, and the partition trains its own student as without one)."""
    folder = label_model_dir(task, version)
    with storage_errors("reading", folder):
        if not (folder / CURRENT).exists():
            return None
        current = json.loads((folder / CURRENT).read_bytes())
        target = folder / current["digest"]
        training = pl.read_parquet(io.BytesIO((target / "training.parquet").read_bytes()))
        vectors, labels = vectors_matrix(training["embedding"]), training["label"].to_list()
        if training_digest(vectors, labels) != current["digest"]:
            warn(f"{target}: its training rows do not match their digest; not used: materialize label_model again")
            return None
        if current["scikit_learn"] == sklearn.__version__:
            estimator = joblib.load(io.BytesIO((target / "model.joblib").read_bytes()))
            student = Student(
                estimator,
                current["classes"],
                len(labels),
                current["cv_agreement"],
                current["calibration_error"],
                current["calibrated"],
                current["note"],
            )
        else:
            student = train_student(vectors, labels, seed)
    return LabelModel(student, vectors, labels, current["partitions"], version, current["digest"])
