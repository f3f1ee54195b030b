"""A cascade task's stored student (`<task>/label_model`), pure: trained on the teacher's labels of
every partition so far, reused by the partitions that come after.

`teacher_rows` takes one partition's stored inference_outputs to its rows the teacher labelled
without an error (sample, deferred and audit rows alike: every teacher label is a training row),
their vectors and labels. `fit_label_model` trains the student (`train_student`: the same logistic
regression and calibration as a partition's) on those of every partition, each identical (vector,
label) pair once: a row repeated across files would otherwise sit in the training and the held-out
folds of its own cross-validation. What is stored, and where, is storage/label_models.py.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import polars as pl

from batch_assets.pipeline.cascade import StoredStudent
from batch_assets.pipeline.embeddings import vectors_matrix

# The inference_outputs columns a label model is trained from.
TRAINING_COLUMNS = ("embedding", "generated_text", "labelled_by", "error")
DIGEST_CHARACTERS = 12


class LabelModelError(ValueError):
    """Nothing a student can be trained on: the message says what to materialize first."""


@dataclass(frozen=True)
class LabelModel(StoredStudent):
    """The stored student, the partitions it learned from, the task version it belongs to and the
    digest of its training rows (which names it in the partitions' metadata)."""

    partitions: list[str]
    version: str
    digest: str

    @property
    def training_rows(self) -> int:
        return len(self.labels)

    def metadata(self) -> dict[str, Any]:
        student = self.student
        return {
            "training_rows": self.training_rows,
            "partitions": self.partitions,
            "partition_count": len(self.partitions),
            "cv_agreement": None if student.cv_agreement is None else round(student.cv_agreement, 4),
            "calibration_error": None if student.ece is None else round(student.ece, 4),
            "calibrated": student.calibrated,
            "classes": student.classes,
            "task_version": self.version,
            "digest": self.digest,
            **({"note": student.note} if student.note else {}),
            "dagster/row_count": self.training_rows,
        }

    def usage_metadata(self) -> dict[str, Any]:
        """What a partition that started from this model records of it."""
        return {"label_model_training_rows": self.training_rows, "label_model_digest": self.digest}


def teacher_rows(outputs: pl.DataFrame) -> tuple[np.ndarray, list[str]]:
    """One partition's inference_outputs → the vectors and labels of its rows the teacher labelled."""
    taught = outputs.filter(
        (pl.col("labelled_by") == "teacher") & pl.col("error").is_null() & pl.col("embedding").is_not_null()
    )
    return vectors_matrix(taught["embedding"]), taught["generated_text"].to_list()


def training_digest(vectors: np.ndarray, labels: list[str]) -> str:
    """A short hash of the training rows: the same rows, the same digest, in every process."""
    digest = hashlib.sha256(np.ascontiguousarray(vectors, dtype=np.float32).tobytes())
    digest.update("\x00".join(labels).encode("utf-8"))
    return digest.hexdigest()[:DIGEST_CHARACTERS]


def distinct_rows(vectors: np.ndarray, labels: list[str]) -> tuple[np.ndarray, list[str]]:
    """Each (vector, label) pair once, in first-seen order."""
    seen: set[tuple[bytes, str]] = set()
    keep = []
    for i, label in enumerate(labels):
        key = (vectors[i].tobytes(), label)
        if key not in seen:
            seen.add(key)
            keep.append(i)
    return vectors[keep], [labels[i] for i in keep]


def fit_label_model(frames: dict[str, pl.DataFrame], version: str, seed: int = 0) -> LabelModel:
    """The student trained on the teacher's labels of every partition in `frames` (inference_outputs
    by partition key). Raises LabelModelError when they hold fewer than two distinct labels."""
    parts = {key: teacher_rows(frame) for key, frame in sorted(frames.items())}
    learned = [key for key, (_, labels) in parts.items() if labels]
    if not learned:
        raise LabelModelError(
            f"no materialized inference_outputs partition of this task version ({version}) has a row the teacher "
            "labelled: materialize a partition of the task first"
        )
    vectors, labels = distinct_rows(
        np.vstack([parts[key][0] for key in learned]), [label for key in learned for label in parts[key][1]]
    )
    model = LabelModel(vectors, labels, seed, learned, version, training_digest(vectors, labels))
    if model.student.model is None:
        raise LabelModelError(f"{model.student.note}: materialize more partitions, or raise output.cascade.sample_rows")
    return model
