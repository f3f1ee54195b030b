"""`<task>/label_model`: a cascade task's student, trained on the teacher's labels of every partition.

    inference_outputs (every partition) ─► label_model ┄┄► inference_outputs of later partitions

Unpartitioned, downstream of the task's `inference_outputs`. Materializing it reads every
materialized partition of the task's current version (partitions made with another version hold
another teacher's or another embedding's rows, and are left out, named in the metadata), trains the
student on their teacher-labelled rows, at most `output.cascade.max_training_rows`
(pipeline/cascade/label_model.py) and stores it by task version
(storage/label_models.py). A partition inferred after that starts from it (lib/assets.py); the
partition records which model it used in its own metadata, since that dependency cannot be declared
(label_model already depends on inference_outputs: the graph would have a cycle).

Retraining: every partition materialized since makes it stale (an upstream update), and with
`automation: {rematerialize_stale: true}` the task's automation sensor retrains it once no partition
is in progress (`label_model_condition`); else materialize it by hand (the UI, or `dagster asset
materialize --select '<task>/label_model'`).
"""

import dagster as dg

from batch_assets.lib.asset_metadata import asset_key
from batch_assets.lib.automation import label_model_condition, materialized_code_versions
from batch_assets.pipeline.cascade.label_model import GROWTH, LabelModelError, fit_label_model
from batch_assets.pipeline.extras import MissingExtra
from batch_assets.pipeline.task_spec import TaskSpec
from batch_assets.storage.drop_files import partitions_def_name
from batch_assets.storage.label_models import (
    read_label_model,
    read_training_rows,
    teacher_row_count,
    write_label_model,
)


def label_model_assets(task: TaskSpec, version: str) -> list[dg.AssetsDefinition]:
    """The task's label_model asset, for a cascade task (none for any other), at task `version`
    (the inference_outputs code version: the partitions of that version train it and use it)."""
    cascade = task.output.cascade
    if cascade is None:
        return []
    upstream = asset_key(task.name, "inference_outputs")

    @dg.asset(
        key=asset_key(task.name, "label_model"),
        group_name=task.name,
        deps=[upstream],
        code_version=version,
        kinds={"scikitlearn"},
        automation_condition=label_model_condition() if task.automation.rematerialize_stale else None,
        description=(
            f"The `{task.name}` cascade's student (a calibrated logistic regression on the embeddings), trained on "
            "every teacher label (sample, deferred and audit rows) of the materialized inference_outputs partitions "
            "of this task version, with its training rows beside it. Partitions inferred after it start from it: "
            "their own teacher sample shrinks to what its training rows lack of output.cascade.sample_rows. They "
            "record the model they used (`label_model_digest`) in their own metadata: the dependency cannot be "
            "declared, it would be a cycle. New partitions make it stale."
        ),
    )
    def label_model(context: dg.AssetExecutionContext) -> dg.MaterializeResult:
        keys, other = partitions_by_version(context.instance, task, version)
        if (kept := _kept_student(context, task, version, keys)) is not None:
            return kept
        try:
            rows = read_training_rows(task.name, keys, cascade.max_training_rows, cascade.seed)
            model = fit_label_model(rows, version, cascade.seed)
        except (LabelModelError, MissingExtra) as exc:
            raise dg.Failure(description=f"{task.name}/label_model: {exc}", allow_retries=False) from exc
        folder = write_label_model(task.name, model)
        context.log.info(
            f"{task.name}/label_model: {model.training_rows} teacher-labelled rows of {len(model.partitions)} "
            f"partition(s), stored at {folder}"
        )
        metadata = {**model.metadata(), "other_version_partitions": other, "path": dg.MetadataValue.path(str(folder))}
        return dg.MaterializeResult(metadata=metadata)

    return [label_model]


def partitions_by_version(instance: dg.DagsterInstance, task: TaskSpec, version: str) -> tuple[list[str], list[str]]:
    """The task's current partitions with materialized inference_outputs: those last materialized at
    `version`, and those at another."""
    upstream = asset_key(task.name, "inference_outputs")
    current = set(instance.get_dynamic_partitions(partitions_def_name(task.name)))
    materialized = sorted(current & instance.get_materialized_partitions(upstream))
    versions = materialized_code_versions(instance, upstream, materialized)
    same = [key for key in materialized if versions.get(key) == version]
    return same, [key for key in materialized if key not in same]


def _kept_student(
    context: dg.AssetExecutionContext, task: TaskSpec, version: str, keys: list[str]
) -> dg.MaterializeResult | None:
    """A cascade by target keeps its current student until the task's teacher labels are GROWTH times
    its training rows (lib/cascade_task.py): each new student version pays for a calibration, so a
    retrain after every partition (the sensor's) would pay for one per file. None: retrain."""
    cascade = task.output.cascade
    if cascade is None or cascade.target is None:
        return None
    current = read_label_model(task.name, version, context.log.warning, cascade.seed)
    if current is None or current.training_rows >= cascade.max_training_rows:
        return None
    available = teacher_row_count(task.name, keys)
    if available >= GROWTH * current.training_rows:
        return None
    why = (
        f"kept: the partitions hold {available} teacher labels, under {GROWTH} x the current student's "
        f"{current.training_rows} training rows; a new student version would pay for a calibration"
    )
    context.log.info(f"{task.name}/label_model: {why}")
    return dg.MaterializeResult(metadata={**current.metadata(), "not_retrained": why})
