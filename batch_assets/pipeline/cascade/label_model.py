"""A cascade task's stored student (`<task>/label_model`), pure: trained on the teacher's labels of
every partition so far, reused by the partitions that come after.

`teacher_rows` takes one partition's stored inference_outputs to its rows the teacher labelled
without an error (sample, deferred and audit rows alike: every teacher label is a training row),
their vectors and labels. `training_selection` keeps at most `output.cascade.max_training_rows` of
them across the partitions (storage reads the embeddings of those alone, once). `fit_label_model` trains
the student (`train_student`: the same logistic regression and calibration as a partition's) on
them, each identical (vector, label) pair once: a row repeated across files would otherwise sit in
the training and the held-out folds of its own cross-validation. What is stored, and where, is
storage/label_models.py.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import polars as pl

from batch_assets.pipeline.cascade.student import StoredStudent, rows_digest
from batch_assets.pipeline.result_stores import vectors_matrix

# The inference_outputs columns a label model is trained from.
TRAINING_COLUMNS = ("embedding", "generated_text", "labelled_by", "error")


# A cascade by target's stored student is retrained (at a run's start, or by the label_model asset)
# once the task's partitions hold this many times its training rows in teacher labels: a better
# student defers fewer rows, and each new student version pays for one calibration, so growing
# geometrically pays for it a few times at most.
GROWTH = 2


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


def teacher_labelled() -> pl.Expr:
    """The inference_outputs rows the teacher labelled without an error (read without their embeddings)."""
    return (pl.col("labelled_by") == "teacher") & pl.col("error").is_null()


def teacher_rows(outputs: pl.DataFrame) -> tuple[np.ndarray, list[str]]:
    """One partition's inference_outputs → the vectors and labels of its rows the teacher labelled."""
    taught = outputs.filter(teacher_labelled() & pl.col("embedding").is_not_null())
    return vectors_matrix(taught["embedding"]), taught["generated_text"].to_list()


def training_selection(labels: Mapping[str, Sequence[str]], max_rows: int, seed: int) -> dict[str, np.ndarray]:
    """Which of each partition's teacher labels to train on (positions into `labels[key]`, ascending):
    all of them when there are at most `max_rows`, else `max_rows`. Each label keeps its share of the
    rows (at least one row): the student's calibration learns how often each label occurs, and a
    sample balanced across labels would skew its confidence. Each label's rows are spread evenly over
    the partitions (one with fewer keeps all of its own, the others share the rest), so one large
    file does not stand for the task; within a partition they are drawn at random with `seed`: the
    same rows every time."""
    if sum(len(rows) for rows in labels.values()) <= max_rows:
        return {key: np.arange(len(rows)) for key, rows in labels.items()}
    keys = sorted(labels)
    arrays = {key: np.asarray(labels[key], dtype=object) for key in keys}
    counts = Counter(label for key in keys for label in labels[key])
    quotas = _label_quotas(counts, max_rows)
    rng = np.random.default_rng(seed)
    chosen: dict[str, list[np.ndarray]] = {key: [] for key in keys}
    for label in sorted(counts):
        where = [np.flatnonzero(arrays[key] == label) for key in keys]
        for key, rows, take in zip(keys, where, _even_split([r.size for r in where], quotas[label]), strict=True):
            chosen[key].append(rng.choice(rows, take, replace=False))
    return {key: np.sort(np.concatenate(chosen[key])).astype(np.int64) for key in keys}


def _label_quotas(counts: Counter[str], max_rows: int) -> dict[str, int]:
    """`max_rows` shared among the labels in proportion to their `counts` (largest remainders get
    the rows rounding left), each label at least one row, paid for by the largest."""
    total = sum(counts.values())
    exact = {label: count * max_rows / total for label, count in counts.items()}
    quotas = {label: max(1, int(share)) for label, share in exact.items()}
    left = max_rows - sum(quotas.values())
    for label in sorted(counts, key=lambda label: (int(exact[label]) - exact[label], label)):
        if left > 0 and quotas[label] < exact[label]:
            quotas[label] += 1
            left -= 1
    while left < 0:
        largest = min(quotas, key=lambda label: (-quotas[label], label))
        quotas[largest] -= 1
        left += 1
    return quotas


def _even_split(sizes: list[int], quota: int) -> list[int]:
    """`quota` rows taken evenly from groups of `sizes` rows: the smallest first, each an equal share
    of what is left, so a group with fewer rows than its share gives the rest to the larger ones."""
    takes = [0] * len(sizes)
    order = sorted(range(len(sizes)), key=lambda i: sizes[i])
    for n, i in enumerate(order):
        takes[i] = min(sizes[i], quota // (len(order) - n))
        quota -= takes[i]
    return takes


def training_digest(vectors: np.ndarray, labels: list[str]) -> str:
    """A short hash of the training rows: the same rows, the same digest, in every process (the
    student version a cascade by target calibrates, `StoredStudent.student_version`)."""
    return rows_digest(vectors, labels)


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
    by partition key, as storage read them: already at most `max_training_rows`, chosen by
    `training_selection`). Raises LabelModelError when they hold fewer than two distinct labels."""
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
