"""Partitions made with an earlier version of a task, materialized again (`automation:
{rematerialize_stale: true}`): the asset condition and the sensor that evaluates it; with the same
option, a cascade task's label_model retrained after new partitions."""

from collections.abc import Iterable

import dagster as dg

from batch_assets.lib.materializations import latest_materializations
from batch_assets.pipeline.task_spec import TaskSpec

# The code version Dagster records on each materialization.
CODE_VERSION_TAG = "dagster/code_version"


def materialized_code_versions(
    instance: dg.DagsterInstance, key: dg.AssetKey, partitions: Iterable[str]
) -> dict[str, str | None]:
    """The code version each partition's latest materialization recorded (None: none recorded, or
    never materialized), read for all of them at once."""
    records = latest_materializations(instance, key, partitions)
    versions: dict[str, str | None] = {}
    for partition, record in records.items():
        materialization = record.asset_materialization
        versions[partition] = (
            materialization.tags.get(CODE_VERSION_TAG) if materialization and materialization.tags else None
        )
    return versions


class MadeWithOlderCodeVersion(dg.AutomationCondition):
    """True for the partitions whose latest materialization recorded another code version than the
    asset's current one. `code_version_changed` sees only a change between two evaluations, never
    one made before the first (the option turned on in the same edit as the prompt)."""

    @property
    def name(self) -> str:
        return "made_with_older_code_version"

    @property
    def requires_cursor(self) -> bool:
        return False

    def evaluate(self, context: dg.AutomationContext) -> dg.AutomationResult:
        current = context.asset_graph.get(context.key).code_version
        instance = context.asset_graph_view.instance
        # Evaluated on the first tick only (see stale_partitions_condition).
        candidates = context.candidate_subset.expensively_compute_partition_keys()
        versions = materialized_code_versions(instance, context.key, candidates)
        outdated = {partition for partition, version in versions.items() if version not in (None, current)}
        if not outdated or context.partitions_def is None:
            return dg.AutomationResult(context, context.get_empty_subset())
        subset = context.asset_graph_view.get_subset_from_partition_keys(context.key, context.partitions_def, outdated)
        return dg.AutomationResult(context, subset)


def stale_partitions_condition() -> dg.AutomationCondition:
    """Re-materialize partitions made before a task edit (`automation: {rematerialize_stale: true}`).

    True for every materialized partition on the tick the asset's code version changes; on the
    condition's first evaluation (the option just turned on, perhaps with an edit) for the
    partitions made with another code version; or when an upstream partition was updated by a run
    that did not include this asset. Then held until the partition is requested or updated, so a
    partition whose run fails is not requested again before the next change. New partitions are
    left to the drops sensor (`~missing`).
    """
    on_first_evaluation = dg.AutomationCondition.initial_evaluation() & MadeWithOlderCodeVersion()
    changed = (
        dg.AutomationCondition.code_version_changed() | on_first_evaluation | dg.AutomationCondition.any_deps_updated()
    )
    # Not since_last_handled(): it also resets on the first evaluation, which would drop exactly
    # the partitions found outdated then.
    handled = dg.AutomationCondition.newly_requested() | dg.AutomationCondition.newly_updated()
    return (
        changed.since(handled)
        & ~dg.AutomationCondition.missing()
        & ~dg.AutomationCondition.any_deps_missing()
        & ~dg.AutomationCondition.any_deps_in_progress()
        & ~dg.AutomationCondition.in_progress()
    ).with_label("rematerialize_stale")


def label_model_condition() -> dg.AutomationCondition:
    """Retrain a cascade task's `label_model` (lib/label_model_asset.py) with the same option: when a
    partition of inference_outputs was updated since it was last requested or updated (new teacher
    labels; a task edit re-materializes the partitions first), once no partition is in progress, so
    a backfill of many files retrains it once at its end rather than once per file. Not `~missing`:
    the first partition trains the first model. A new code version alone does not request it: the
    partitions of that version, which it learns from, come first."""
    # Not any_deps_updated(): it is also true on the tick a partition is requested, which would train
    # the model on the labels that partition is about to replace.
    updated = dg.AutomationCondition.any_deps_match(dg.AutomationCondition.newly_updated())
    pending = (
        dg.AutomationCondition.any_deps_match(dg.AutomationCondition.will_be_requested())
        | dg.AutomationCondition.any_deps_in_progress()
    )
    handled = dg.AutomationCondition.newly_requested() | dg.AutomationCondition.newly_updated()
    return (updated.since(handled) & ~pending & ~dg.AutomationCondition.in_progress()).with_label("retrain_label_model")


def build_automation_sensor(task: TaskSpec) -> list[dg.AutomationConditionSensorDefinition]:
    """The sensor that evaluates a task's stale-partition condition (running whenever the daemon is).
    It runs in the code server: the condition's own Python part cannot be evaluated by the daemon."""
    if not task.automation.rematerialize_stale:
        return []
    return [
        dg.AutomationConditionSensorDefinition(
            f"{task.name}_automation_sensor",
            target=dg.AssetSelection.groups(task.name),
            default_status=dg.DefaultSensorStatus.RUNNING,
            use_user_code_server=True,
            description=(
                f"Re-materializes `{task.name}` partitions made with an earlier version of the task"
                + (", and retrains its label_model after new partitions." if task.output.cascade else ".")
            ),
        )
    ]
