"""`("records", "cascade")`: records embedded as embedding tasks' are; a teacher labels a sample
and the uncertain rows, a student on the embeddings the rest (`output.method: cascade`,
pipeline/cascade/run.py).

What the cascade needs of the run besides the contract's stream (its chat teacher, its stored
student, what its partitions share) comes in a `CascadeStream`, which the assets build for a
cascade task (lib/cascade_task.py's `cascade_stream`): the contract names nothing of the cascade."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import polars as pl

from batch_assets.pipeline.cascade.label_model import LabelModel
from batch_assets.pipeline.cascade.labels import Teach, cascade_outputs, cascade_summary
from batch_assets.pipeline.cascade.run import TaskCascade
from batch_assets.pipeline.embeddings.formats import EmbeddedRecords
from batch_assets.pipeline.engine_contract import EngineSettings
from batch_assets.pipeline.formats import InferenceStream
from batch_assets.pipeline.inference_requests import InferenceStats, PartitionInput
from batch_assets.pipeline.prices import engine_price, teacher_price
from batch_assets.pipeline.validate_labels import validate_labels


@dataclass(frozen=True)
class CascadeStream(InferenceStream):
    """A cascade task's stream: `teach`, its chat teacher (`teacher: llm`; None for a teacher
    column), `label_model`, its stored student for this task version (None: none yet), and
    `cascade_task`, what the partitions of a cascade by target share (its student version and
    calibration, stored by the assets: first writer wins; None without a target)."""

    teach: Teach | None = None
    label_model: LabelModel | None = None
    cascade_task: TaskCascade | None = None


class CascadeRecords(EmbeddedRecords):
    """`output.method: cascade` on a choices task: rows embedded as EmbeddingRecords; the teacher
    labels a sample of them and the rows the student (a classifier on the embeddings, trained on the
    sample) is unsure of, the student the rest (pipeline/cascade/run.py). The labels are then those of a
    choices task, with who gave each (`labelled_by`)."""

    audits_agreement = True

    def inference_description(self, engine_name: str) -> str:
        return (
            f"Embeddings of each `{self.task.name}` row from {self.embedder(engine_name)}, and its label by the "
            "cascade: the teacher's on a sample and on the rows the student is unsure of, the student's elsewhere. "
            "The student starts from the task's label_model where one of this task version is stored "
            "(`label_model_digest`)."
        )

    def validated_description(self) -> str:
        return (
            f"The `{self.task.name}` result table: every input column, `label` and its `confidence`, "
            "`labelled_by` (teacher or student), `cascade_role` (sample, calibration, deferred, audit or student), "
            "`student_label` and `error`. Exactly one row per input record, in input order."
        )

    def labelled_by(self, model: str) -> str:
        teacher = "a chat model" if self.task.output.chat_teacher else "a teacher column"
        return f"cascade: {teacher} and a student on {model} embeddings"

    def output_identity(self, settings: EngineSettings) -> dict[str, Any]:
        # The vectors depend on the model and the text alone (so the cache holds embeddings, reused
        # whatever the cascade's settings); the labels are decided again from them on every run.
        return {"output": "embedding"}

    def infer(self, parts: list[PartitionInput], stream: InferenceStream) -> list[tuple[pl.DataFrame, InferenceStats]]:
        output = self.task.output
        assert output.cascade is not None  # method cascade requires it (OutputSpec)
        if not isinstance(stream, CascadeStream):
            raise TypeError(
                f"task {self.task.name!r}: a cascade's inference needs a CascadeStream (its teacher and stored "
                f"student), not a {type(stream).__name__}"
            )
        inferred = []
        for part, (frame, stats) in zip(parts, stream.run(parts), strict=True):
            # A partition the stored student learned from (a re-run, a replaced file) trains its own:
            # the stored one has seen its teacher rows, and its audit would measure them again.
            shared = stream.cascade_task
            stored = stream.label_model if shared is None else shared.stored
            learned_here = isinstance(stored, LabelModel) and part.label in stored.partitions
            task: TaskCascade | None = None
            if shared is not None:
                # A partition the task's student learned from runs alone: its own sample and calibration.
                task = TaskCascade(partition=part.label) if learned_here else shared
                task.partition = part.label
            labelled, measured = cascade_outputs(
                frame,
                output.cascade,
                output.choices or [],
                part.label,
                stream.teach,
                None if learned_here else stored,
                task,
            )
            inferred.append((labelled, replace(stats, format_metadata=measured)))
        return inferred

    def validate(self, outputs: pl.DataFrame) -> pl.DataFrame:
        return validate_labels(outputs.drop("embedding"), self.task.output)

    def preview_columns(self, labels: pl.DataFrame) -> list[str]:
        return [*self.task.input.text_fields, "label", "confidence", "labelled_by", "error"]

    def label_metadata(self, labels: pl.DataFrame) -> dict[str, Any]:
        summary = cascade_summary(labels, engine_price(self.task.engine), teacher_price(self.task))
        return {**super().label_metadata(labels), **summary.metadata()}
