"""The code location: one asset group, partitions definition, job, sensor and set of checks per task.

Load with `dg dev` (`make ui`) from the repo root (workspace.yaml points here).
"""

from __future__ import annotations

import importlib
import warnings
from pathlib import Path

import dagster as dg

from batch_assets.dagster_defs.assets import IO_MANAGER_KEY, build_automation_sensor, build_task_assets
from batch_assets.dagster_defs.checks import build_task_checks
from batch_assets.dagster_defs.pool_waits import sleep_between_pool_checks
from batch_assets.dagster_defs.range_failures import build_range_failure_sensor
from batch_assets.dagster_defs.run_recovery import build_recovery_sensor
from batch_assets.dagster_defs.sensors import build_drops_sensor
from batch_assets.dagster_defs.task_file_errors import build_task_file_error_sensor
from batch_assets.engines.openai_engine import OpenAIEngine
from batch_assets.engines.protocol import ENGINE_KINDS
from batch_assets.engines.vllm_engine import VLLMEngine
from batch_assets.pipeline.task_spec import TaskFileError, TaskSpec, load_tasks
from batch_assets.storage.parquet_io_manager import ParquetStorage

# Partitioned asset checks are marked "preview" in Dagster 1.13; they are what lets each check read
# only its own partition, so we use them and silence the notice.
warnings.filterwarnings("ignore", message=".*partitions_def on an AssetCheckSpec.*")
# Dagster's own component loader builds code references and loads modules with beta/preview APIs
# and warns about each; nothing in this project can act on those notices.
warnings.filterwarnings("ignore", category=dg.BetaWarning)
warnings.filterwarnings("ignore", category=dg.PreviewWarning)


def pipeline_job_name(task: str) -> str:
    return f"{task}_pipeline"


PROJECT_ROOT = Path(__file__).resolve().parent.parent
K8S_CONFIG_TAG = "dagster-k8s/config"


def run_tags_for(task: TaskSpec) -> dict[str, object]:
    """Tags of a task's job runs. An engine on N GPUs (`engine.tensor_parallel_size` ×
    `engine.data_parallel_size`) asks Dagster's Kubernetes run launcher for N GPUs in its run pod
    (deploy/README.md); other run launchers ignore the tag. With `data_parallel_size: auto` the pod
    keeps the launcher's GPU count and the engine uses every GPU it is given."""
    spec = task.engine
    if spec.kind != "vllm" or spec.data_parallel_size == "auto":
        return {}
    gpus = spec.tensor_parallel_size * spec.data_parallel_size
    if gpus <= 1:
        return {}
    return {K8S_CONFIG_TAG: {"container_config": {"resources": {"limits": {"nvidia.com/gpu": str(gpus)}}}}}


def build_task_job(task: TaskSpec):
    return dg.define_asset_job(
        name=pipeline_job_name(task.name),
        selection=dg.AssetSelection.groups(task.name),
        description=(
            f"Materializes the four `{task.name}` assets and their checks for one drop file, or a range of them."
        ),
        tags=run_tags_for(task) or None,
    )


def build_definitions(
    tasks: list[TaskSpec] | None = None,
    engine: VLLMEngine | OpenAIEngine | None = None,
    endpoint: OpenAIEngine | None = None,
    task_errors: list[TaskFileError] | None = None,
) -> dg.Definitions:
    """`engine` serves tasks with `engine.kind: vllm` (default: in-process vLLM; an `OpenAIEngine`
    here sends those tasks to an endpoint instead); `endpoint` serves tasks with `kind: openai`.
    With no `tasks`, the tasks folder is loaded; a bad task file becomes a failing sensor naming it
    (dagster_defs/task_file_errors.py) and the other tasks load as usual. Each engine kind's resource
    key comes from `ENGINE_KINDS`."""
    # Whoever builds these definitions executes their runs (a run worker, `batch-assets run`): a step
    # waiting for the `gpu` pool must sleep, not spin (pool_waits.py).
    sleep_between_pool_checks()
    if tasks is None:
        loaded = load_tasks()
        tasks, task_errors = loaded.tasks, loaded.errors
    assets, checks, jobs, sensors = [], [], [], []
    sensors += [build_task_file_error_sensor(error) for error in task_errors or []]
    for task in tasks:
        assets += build_task_assets(task)
        checks += build_task_checks(task)
        job = build_task_job(task)
        jobs.append(job)
        sensors.append(build_drops_sensor(task, job))
        sensors += build_automation_sensor(task)
    range_failures = build_range_failure_sensor([(task, job) for task, job in zip(tasks, jobs, strict=True)])
    sensors += [range_failures] if range_failures is not None else []
    return dg.Definitions(
        assets=assets,
        asset_checks=checks,
        jobs=jobs,
        sensors=[*sensors, build_recovery_sensor()],
        resources={
            IO_MANAGER_KEY: ParquetStorage(),
            ENGINE_KINDS["vllm"].resource_key: engine or VLLMEngine(),
            ENGINE_KINDS["openai"].resource_key: endpoint or OpenAIEngine(),
        },
        # The four steps of a partition run one after another anyway; running them in one process
        # skips a process start per step and lets the engine stay warm across partitions.
        executor=dg.in_process_executor,
    )


def load_project_defs() -> dg.Definitions:
    """The code location: the component tree under `batch_assets/defs/` (`dg` project layout).

    Loaded from the installed package, so it works without the repo's pyproject.toml (a Docker image)."""
    defs_module = importlib.import_module("batch_assets.defs")
    return dg.ComponentTree.from_module(defs_module=defs_module, project_root=PROJECT_ROOT).build_defs()


defs = load_project_defs()
