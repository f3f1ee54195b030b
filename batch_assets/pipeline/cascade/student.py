"""A cascade's student: the sample that covers a partition's embeddings (`choose_sample`), the
logistic regression trained on the teacher's labels of it (`train_student`, its probabilities
calibrated and its agreement cross-validated), the rows kept across partitions (`StoredStudent`) and
its version (`rows_digest`); its calibration is measured by pipeline/calibration.py's
`expected_calibration_error`.

scikit-learn (the `cascade` extra) is imported where the student is clustered, trained or
cross-validated, not with this module: the code location loads without it (pipeline/extras.py).
"""

from __future__ import annotations

import functools
import hashlib
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from batch_assets.pipeline.calibration import expected_calibration_error
from batch_assets.pipeline.extras import CASCADE, needs_extra

# Inverse regularization of the student: sentence embeddings are unit vectors spread over hundreds of
# dimensions, so each coordinate is small and sklearn's default C=1 regularizes them towards one
# class. 20 is a first choice, not yet tuned: bench/bench_cascade.py prints the student's
# cross-validated agreement to compare settings by.
STUDENT_C = 20.0
# Folds of the student's cross-validated agreement and of its calibration; a class with fewer
# teacher examples than this leaves the student's probabilities uncalibrated (logistic regression's own).
FOLDS = 3
# One cluster per this many sample rows (at least 2, at most MAX_CLUSTERS): enough clusters that a
# rare kind of row gets drawn, few enough that each holds several.
ROWS_PER_CLUSTER = 10
MAX_CLUSTERS = 100


@dataclass(frozen=True)
class Student:
    """A trained student and what its training measured."""

    model: Any  # a fitted scikit-learn classifier with predict_proba, or None with fewer than 2 labels
    classes: list[str]
    training_rows: int
    cv_agreement: float | None  # cross-validated agreement with the teacher on the sample
    ece: float | None  # expected calibration error of the cross-validated probabilities
    calibrated: bool
    note: str | None = None  # why it is not calibrated, or why there is no student

    def predict(self, vectors: np.ndarray) -> tuple[list[str], np.ndarray]:
        """Each row's most probable label and its probability."""
        if self.model is None or vectors.shape[0] == 0:
            return [], np.zeros(0)
        probabilities = self.model.predict_proba(vectors)
        best = probabilities.argmax(axis=1)
        return [self.classes[i] for i in best], probabilities[np.arange(len(best)), best]

    def metadata(self) -> dict[str, Any]:
        return {
            "student_training_rows": self.training_rows,
            "student_classes": len(self.classes),
            "student_cv_agreement": None if self.cv_agreement is None else round(self.cv_agreement, 4),
            "student_calibration_error": None if self.ece is None else round(self.ece, 4),
            "student_calibrated": self.calibrated,
            **({"student_note": self.note} if self.note else {}),
        }


@dataclass(frozen=True)
class StoredStudent:
    """The teacher-labelled rows kept across partitions (`<task>/label_model`, pipeline/cascade/label_model.py),
    which a partition's own sample adds to, and the student trained on them alone (`student`, trained
    when first asked: read back from storage, the rows are all there is)."""

    vectors: np.ndarray  # (rows, dimension)
    labels: list[str]
    seed: int

    @functools.cached_property
    def student(self) -> Student:
        return train_student(self.vectors, self.labels, self.seed)

    @functools.cached_property
    def student_version(self) -> str:
        """A short hash of the training rows (the same rows, the same version): a label model's digest."""
        return rows_digest(self.vectors, self.labels)


DIGEST_CHARACTERS = 12


def rows_digest(vectors: np.ndarray, labels: Sequence[str]) -> str:
    """A short hash of training rows: the same rows, the same digest, in every process."""
    digest = hashlib.sha256(np.ascontiguousarray(vectors, dtype=np.float32).tobytes())
    digest.update("\x00".join(labels).encode("utf-8"))
    return digest.hexdigest()[:DIGEST_CHARACTERS]


def choose_sample(vectors: np.ndarray, size: int, seed: int = 0) -> np.ndarray:
    """`size` row positions covering the data: the rows are clustered (mini-batch k-means), and each
    cluster gives rows in proportion to its size (largest remainders; at least one from each cluster
    while `size` allows), drawn at random within it. Sorted positions."""
    rows = vectors.shape[0]
    if size >= rows:
        return np.arange(rows)
    if size <= 0:
        return np.zeros(0, dtype=np.int64)
    with needs_extra(CASCADE):
        from sklearn.cluster import MiniBatchKMeans

    rng = np.random.default_rng(seed)
    clusters = min(MAX_CLUSTERS, max(2, size // ROWS_PER_CLUSTER), rows)
    assignment = MiniBatchKMeans(n_clusters=clusters, random_state=seed, n_init=3).fit_predict(vectors)
    sizes = np.bincount(assignment, minlength=clusters)
    quota = _quotas(sizes, size)
    chosen = [
        rng.choice(np.flatnonzero(assignment == c), size=int(quota[c]), replace=False)
        for c in range(clusters)
        if quota[c]
    ]
    return np.sort(np.concatenate(chosen))


def _quotas(sizes: np.ndarray, total: int) -> np.ndarray:
    """Rows to draw from each cluster: one from each non-empty cluster first (as many as `total`
    allows, the largest first), the rest in proportion to size by largest remainders."""
    quota = np.zeros(len(sizes), dtype=np.int64)
    by_size = np.argsort(-sizes, kind="stable")
    for c in by_size[: min(total, int((sizes > 0).sum()))]:
        quota[c] = 1
    left = total - int(quota.sum())
    room = sizes - quota
    if left > 0 and room.sum() > 0:
        share = room / room.sum() * left
        extra = np.minimum(np.floor(share).astype(np.int64), room)
        remainder_order = np.argsort(-(share - extra), kind="stable")
        for c in remainder_order:
            if extra.sum() >= left:
                break
            if extra[c] < room[c]:
                extra[c] += 1
        quota += extra
    return quota


def train_student(vectors: np.ndarray, labels: Sequence[str], seed: int = 0) -> Student:
    """Logistic regression on the teacher's labels; calibrated by temperature scaling (cross-fitted)
    when every class has at least `FOLDS` examples. Its agreement with the teacher and its expected
    calibration error are measured by `FOLDS`-fold cross-validation on the same rows."""
    y = np.asarray(labels, dtype=object)
    classes, counts = np.unique(y, return_counts=True)
    if len(classes) < 2:
        only = f" ({classes[0]})" if len(classes) else ""
        note = f"the teacher's sample holds {len(classes)} distinct label(s){only}: no student can be trained"
        return Student(None, [str(c) for c in classes], len(y), None, None, False, note)
    with needs_extra(CASCADE):
        from sklearn.calibration import CalibratedClassifierCV
        from sklearn.exceptions import ConvergenceWarning
        from sklearn.linear_model import LogisticRegression

    base = LogisticRegression(C=STUDENT_C, max_iter=1000)
    calibrated = bool(counts.min() >= FOLDS)
    model: Any = CalibratedClassifierCV(base, method="temperature", cv=FOLDS) if calibrated else base
    uncalibrated_note: str | None = (
        None
        if calibrated
        else f"not calibrated: a label has fewer than {FOLDS} examples in the sample "
        f"({', '.join(f'{c}: {n}' for c, n in zip(classes, counts, strict=True) if n < FOLDS)})"
    )
    with warnings.catch_warnings():
        # A class with one example warns in the stratified folds; lbfgs may stop at max_iter on
        # separable data: the measured agreement says how good the student is either way.
        warnings.simplefilter("ignore", (UserWarning, ConvergenceWarning))
        cv_agreement, ece = _cross_validated(model, vectors, y, classes, counts, seed)
        model.fit(vectors, y)
    classes_ = [str(c) for c in model.classes_]
    return Student(model, classes_, len(y), cv_agreement, ece, calibrated, uncalibrated_note)


def _cross_validated(
    model: Any, vectors: np.ndarray, y: np.ndarray, classes: np.ndarray, counts: np.ndarray, seed: int
) -> tuple[float | None, float | None]:
    """Agreement with the teacher and calibration error of out-of-fold predictions (None when a
    fold cannot be made or fitted: too few rows, or a fold's training rows of one label)."""
    if len(y) < 2 * FOLDS:
        return None, None
    with needs_extra(CASCADE):
        from sklearn.model_selection import StratifiedKFold, cross_val_predict

    folds = StratifiedKFold(n_splits=FOLDS, shuffle=True, random_state=seed)
    try:
        probabilities = cross_val_predict(model, vectors, y, cv=folds, method="predict_proba")
    except ValueError:
        # A fold whose training rows hold one label (a small sample with a rare label) cannot fit:
        # the agreement is unmeasured, the student is still trained on every row.
        return None, None
    best = probabilities.argmax(axis=1)
    predicted = classes[best]
    correct = predicted == y
    return float(correct.mean()), expected_calibration_error(probabilities[np.arange(len(y)), best], correct)


def partition_student(vectors: np.ndarray, labels: list[str], stored: StoredStudent | None, seed: int = 0) -> Student:
    """The student of a partition whose teacher labelled `labels` of `vectors`: trained on them alone;
    with stored rows, the stored student when the partition adds no label, else one trained on the
    stored rows and the partition's together (each trained once)."""
    if stored is None:
        return train_student(vectors, labels, seed)
    if stored.vectors.shape[1] != vectors.shape[1]:
        raise ValueError(
            f"the stored label_model's vectors have {stored.vectors.shape[1]} dimensions, this partition's "
            f"{vectors.shape[1]}: materialize the task's label_model again"
        )
    if not labels:
        return stored.student
    return train_student(np.vstack([stored.vectors, vectors]), [*stored.labels, *labels], seed)
