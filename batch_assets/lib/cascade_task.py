"""A cascade task's partitions and what they share, for the inference and validated_labels steps: the
stored student a run starts from (`stored_label_model`, grown when the task's teacher labels have
outgrown it: `grown_label_model`), a cascade by target's student version and calibration shared by
its partitions through the task's storage (`cascade_task`, first writer wins: storage/label_models.py),
the stream its kind's inference gets them in (`cascade_stream`), and the task-level figures
validated_labels reports (`task_cascade_metadata`)."""

from typing import Any

import dagster as dg

from batch_assets.lib.asset_metadata import asset_key
from batch_assets.lib.label_model_asset import partitions_by_version
from batch_assets.lib.materializations import latest_materialization
from batch_assets.pipeline.cascade.formats import CascadeStream
from batch_assets.pipeline.cascade.label_model import GROWTH, LabelModel
from batch_assets.pipeline.cascade.labels import Teach
from batch_assets.pipeline.cascade.run import TaskCascade
from batch_assets.pipeline.cascade.student import StoredStudent
from batch_assets.pipeline.cascade.target import TaskFigures
from batch_assets.pipeline.formats import InferenceStream
from batch_assets.pipeline.task_spec import TaskSpec
from batch_assets.storage.label_models import (
    grow_label_model,
    read_calibration,
    read_label_model,
    record_cost,
    record_figures,
    settle_calibration,
    settle_label_model,
    teacher_row_count,
)


def cascade_stream(
    task: TaskSpec,
    stream: InferenceStream,
    teach: Teach | None,
    stored: LabelModel | None,
    shared: TaskCascade | None,
) -> InferenceStream:
    """The stream a task's inference gets: a cascade task's with its chat teacher, stored student and
    what its partitions share (pipeline/cascade/formats.py); every other task's as it is."""
    if task.output.cascade is None:
        return stream
    return CascadeStream(stream.run, stream.tokenizer, stream.max_model_len, teach, stored, shared)


def stored_label_model(context: dg.AssetExecutionContext, task: TaskSpec, version: str) -> LabelModel | None:
    """A cascade task's label_model of this `version`, as stored (None: not a cascade, or none yet)."""
    if task.output.cascade is None:
        return None
    stored = read_label_model(task.name, version, context.log.warning, task.output.cascade.seed)
    if stored is not None:
        context.log.info(
            f"{task.name}: the cascade starts from label_model {stored.digest} ({stored.training_rows} training rows)"
        )
    return stored


def grown_label_model(
    context: dg.AssetExecutionContext, task: TaskSpec, version: str, stored: LabelModel | None
) -> LabelModel | None:
    """The label model a cascade by target's run starts from: the stored one, grown (retrained on
    every teacher label of the task version's materialized partitions, storage/label_models.py) when
    they are at least GROWTH times its training rows and it is under max_training_rows. The same for
    `batch-assets run`, a backfill and the sensor: each run looks once."""
    cascade = task.output.cascade
    if cascade is None or cascade.target is None or stored is None:
        return stored
    if stored.training_rows >= cascade.max_training_rows:
        return stored
    keys, _ = partitions_by_version(context.instance, task, version)
    available = teacher_row_count(task.name, keys)
    if available < GROWTH * stored.training_rows:
        return stored
    grown = grow_label_model(task.name, stored, keys, cascade.max_training_rows, context.log.warning)
    if grown.digest != stored.digest:
        context.log.info(
            f"{task.name}: the cascade's student grew from {stored.training_rows} to {grown.training_rows} teacher "
            f"labels of {len(grown.partitions)} partition(s) (label_model {grown.digest}): a new student version, "
            "calibrated once by the first partition that uses it"
        )
    return grown


def cascade_task(
    context: dg.AssetExecutionContext, task: TaskSpec, version: str, stored: LabelModel | None
) -> TaskCascade | None:
    """What the partitions of a cascade by target share, kept in the task's storage by `version`
    (storage/label_models.py): the student version (the label model; a first partition's sample
    settles it) and its calibration, first writer wins, and each partition's figures. None for
    other tasks."""
    cascade = task.output.cascade
    if cascade is None or cascade.target is None:
        return None
    warn = context.log.warning
    shared = TaskCascade(stored=stored)

    def keep_student(own: StoredStudent) -> StoredStudent:
        model = LabelModel(own.vectors, own.labels, own.seed, [shared.partition], version, own.student_version)
        kept = settle_label_model(task.name, model, warn)
        context.log.info(
            f"{task.name}: the cascade's student is label_model {kept.digest} ({kept.training_rows} training rows"
            + (f", from {shared.partition}'s sample)" if kept is model else ", settled by another partition)")
        )
        return kept

    # Set on the object the partitions share: `keep_student` reads the partition it is settling for.
    shared.keep_student = keep_student
    shared.keep_calibration = lambda made: settle_calibration(task.name, version, made, warn)
    shared.keep_figures = lambda student, key, figures: record_figures(task.name, version, student, key, figures)
    shared.read_calibration = lambda student: read_calibration(task.name, version, student, warn)
    return shared


def task_cascade_metadata(
    context: dg.AssetExecutionContext, task: TaskSpec, partition_key: str, cost_usd: float | None
) -> dict[str, Any]:
    """A cascade by target's task-level figures (`task_*`: the student version's over every partition
    it labelled, as the partition's inference recorded them), with the labels' cost per 1,000 rows
    guaranteed to agree once this partition's cost is added (priced embedding and chat teacher)."""
    if task.output.cascade is None or task.output.cascade.target is None:
        return {}
    upstream = latest_materialization(context.instance, asset_key(task.name, "inference_outputs"), partition_key)
    recorded = upstream.asset_materialization.metadata if upstream and upstream.asset_materialization else {}
    figures = {name: entry.value for name, entry in recorded.items() if name.startswith("task_")}
    student, version = figures.get("task_student_version"), figures.get("task_version")
    if cost_usd is None or not student or not version:
        return figures
    every = record_cost(task.name, str(version), str(student), partition_key, float(cost_usd))
    return figures if every is None else figures | TaskFigures.of(str(student), every).metadata()
