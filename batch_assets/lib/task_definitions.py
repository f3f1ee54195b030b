"""Every task's pipeline as Dagster definitions: its assets, checks, job and sensors, and the
resources they run with (`build_definitions`).

The components (component.py) call `component_definitions`: `TaskPipelinesComponent` with the
tasks of its folder (the code location, `batch_assets/definitions.py`, loads it), `TaskComponent`
with its one task. Tests and custom code locations call `build_definitions` with their own tasks
or engines. A task's job carries what its run pod needs on Kubernetes.
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import dagster as dg

from batch_assets.engines.kinds import ENGINE_KINDS, default_engines, resolve_settings
from batch_assets.engines.openai_engine import OpenAIEngine
from batch_assets.engines.vllm_engine import VLLMEngine
from batch_assets.lib.asset_metadata import asset_key
from batch_assets.lib.assets import IO_MANAGER_KEY, build_task_assets
from batch_assets.lib.automation import build_automation_sensor
from batch_assets.lib.checks import build_task_checks
from batch_assets.lib.drops_sensor import build_drops_sensor
from batch_assets.lib.range_failures import RANGE_FAILURE_SENSOR_NAME, build_range_failure_sensor
from batch_assets.lib.ray_runs import RAY_CONFIG_TAG, ray_run_config
from batch_assets.lib.split_job import build_split_job
from batch_assets.lib.task_file_errors import build_task_file_error_sensor, fail_validation_on
from batch_assets.pipeline.task_spec import TaskFileError, TaskSpec, TaskSpecError, load_tasks
from batch_assets.runtime.run_recovery import build_recovery_sensor
from batch_assets.storage.parquet_io_manager import ParquetStorage

# Partitioned asset checks are marked "preview" in Dagster 1.13; they are what lets each check read
# only its own partition, so we use them and silence the notice.
warnings.filterwarnings("ignore", message=".*partitions_def on an AssetCheckSpec.*")


def pipeline_job_name(task: str) -> str:
    return f"{task}_pipeline"


K8S_CONFIG_TAG = "dagster-k8s/config"


# GPUs of each GPU node, set on the code server (Helm: the user deployment's `env`): a task with
# `engine.data_parallel_size: auto` then asks for a whole node. One setting for the deployment, read where
# the job's run tags are built; unset, `auto` means one engine replica (deploy/README.md).
GPUS_PER_NODE_ENV = "BATCH_ASSETS_GPUS_PER_NODE"
# Kubernetes CPUs per vLLM process. vLLM asks for one physical core per process, and warns that fewer
# degrade throughput (its engine core busy-loops): docs "Optimization and Tuning" → "CPU Resources for
# GPU Deployments". A Kubernetes CPU is one hyperthread on nodes with SMT (cloud GPU nodes have it), so two.
CPUS_PER_VLLM_PROCESS = 2
# Host memory (GiB) of a run pod, requested and limit: the run's own process (a shard's rows, the
# tokenizer) and one GPU's vLLM processes take the instance default (deploy/k8s/dagster.yaml, Helm
# values); each further GPU adds a worker process, and each further replica an engine core, with a
# CUDA context, pinned transfer buffers and weights staged through host memory at load. An estimate
# (no GPU node was measured here): raise it in the task's run tag where a model needs more.
POD_MEMORY_GIB = (32, 48)
MEMORY_PER_EXTRA_GPU_GIB = (8, 12)


@dataclass(frozen=True)
class RunPodResources:
    """What a run pod asks Kubernetes for: GPUs (limit), CPUs (request) and memory (GiB, request and limit)."""

    gpus: int
    cpus: int
    memory_gib: int = POD_MEMORY_GIB[0]
    memory_limit_gib: int = POD_MEMORY_GIB[1]


def engine_pod_resources(tensor_parallel_size: int, data_parallel_size: int) -> RunPodResources:
    """A pod for `data_parallel_size` engine replicas of `tensor_parallel_size` GPUs each.

    vLLM's processes, per its docs: the front end (here the run's own process: tokenization and output
    processing, as vLLM's API server does), one engine core per replica, one worker per GPU and, with
    several replicas, a data-parallel coordinator: `1 + DP + N + (1 if DP > 1)`, one physical core each."""
    gpus = tensor_parallel_size * data_parallel_size
    processes = 1 + data_parallel_size + gpus + (1 if data_parallel_size > 1 else 0)
    (memory, limit), (more, more_limit) = POD_MEMORY_GIB, MEMORY_PER_EXTRA_GPU_GIB
    return RunPodResources(
        gpus=gpus,
        cpus=CPUS_PER_VLLM_PROCESS * processes,
        memory_gib=memory + more * (gpus - 1),
        memory_limit_gib=limit + more_limit * (gpus - 1),
    )


# The run pod of deploy/k8s/dagster.yaml and deploy/helm/values.yaml (one GPU, its CPUs): tasks that
# need no more send no tag (batch_assets_tests/test_k8s_deploy.py checks the files agree).
DEFAULT_RUN_POD = engine_pod_resources(1, 1)

# An endpoint task's run pod (`engine.kind: openai`) is a client: it renders prompts, counts tokens with
# a local tokenizer and holds a shard's rows. dagster-k8s deep-merges the tag into the instance's GPU
# pod, where a key cannot be removed, so the GPU limit is set to 0 rather than left out.
ENDPOINT_POD_RESOURCES = {
    "limits": {"nvidia.com/gpu": "0", "memory": "16Gi"},
    "requests": {"cpu": "2", "memory": "8Gi"},
}


# A split run (lib/split_job.py) streams one drop file: a CPU and little memory, no GPU.
SPLIT_POD_CONFIG = {
    "container_config": {
        "resources": {"limits": {"nvidia.com/gpu": "0", "memory": "2Gi"}, "requests": {"cpu": "1", "memory": "1Gi"}},
        "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}],
    }
}


def api_key_secret_name(variable: str) -> str:
    """The Kubernetes secret an endpoint task's key comes from: named after its variable
    (`VLLM_API_KEY` in the secret `vllm-api-key`, key `VLLM_API_KEY`; deploy/README.md)."""
    return variable.lower().replace("_", "-")


def endpoint_pod_config(api_key_env: str | None) -> dict[str, object]:
    """The `dagster-k8s/config` of an endpoint task's runs: no GPU, a client's CPUs and memory, and
    the API key from its secret (optional: without it the run fails at once naming `api_key_env`,
    rather than as a pod that never starts)."""
    env: list[dict[str, object]] = [
        # CUDA base images set NVIDIA_VISIBLE_DEVICES=all, which shows a GPU node's devices to a pod
        # that asked for none; `void` shows none.
        {"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"},
    ]
    if api_key_env:
        secret = {"name": api_key_secret_name(api_key_env), "key": api_key_env, "optional": True}
        env.append({"name": api_key_env, "value_from": {"secret_key_ref": secret}})
    return {"container_config": {"resources": ENDPOINT_POD_RESOURCES, "env": env}}


def gpus_per_node() -> int | None:
    """The `BATCH_ASSETS_GPUS_PER_NODE` setting; None when unset. Read for tasks with `auto`, where a
    bad value stops the code location from loading with this message rather than sending runs to
    pods that never schedule."""
    raw = os.environ.get(GPUS_PER_NODE_ENV, "").strip()
    if not raw:
        return None
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{GPUS_PER_NODE_ENV}={raw!r}: expected the number of GPUs of each GPU node (1 or more)")
    return int(raw)


def run_tags_for(task: TaskSpec) -> dict[str, object]:
    """Tags of a task's job runs. An endpoint task asks for a pod without a GPU that carries its API
    key (`endpoint_pod_config`). An engine on N GPUs (`engine.tensor_parallel_size` ×
    `engine.data_parallel_size`) asks Dagster's Kubernetes run launcher for N GPUs and the CPUs vLLM
    needs for them in its run pod (deploy/README.md); other run launchers ignore the tag. With
    `data_parallel_size: auto` the replicas are those that fit one node (`BATCH_ASSETS_GPUS_PER_NODE`
    divided by `tensor_parallel_size`), or one when that is unset; the engine in the pod then finds
    exactly those GPUs. On Ray every in-process engine's run asks for one `batch_assets_engine` slot
    and the same GPUs (`dagster-ray/config`, lib/ray_runs.py)."""
    spec = task.engine
    if spec.kind in ("openai", "batch_api"):
        return {K8S_CONFIG_TAG: endpoint_pod_config(spec.api_key_env)}
    if isinstance(spec.data_parallel_size, int):
        replicas = spec.data_parallel_size
    else:  # auto
        node_gpus = gpus_per_node()
        replicas = max(1, node_gpus // spec.tensor_parallel_size) if node_gpus else 1
    pod = engine_pod_resources(spec.tensor_parallel_size, replicas)
    # On Ray (dagster-ray's RayRunLauncher) the same GPUs and one engine slot (lib/ray_runs.py).
    tags: dict[str, object] = {RAY_CONFIG_TAG: ray_run_config(pod.gpus)}
    if pod == DEFAULT_RUN_POD:
        return tags
    # dagster-k8s merges this into the instance's run pod config key by key: tolerations, volumes
    # and the Hugging Face token stay as the instance sets them.
    resources = {
        "limits": {"nvidia.com/gpu": str(pod.gpus), "memory": f"{pod.memory_limit_gib}Gi"},
        "requests": {"cpu": str(pod.cpus), "memory": f"{pod.memory_gib}Gi"},
    }
    return {**tags, K8S_CONFIG_TAG: {"container_config": {"resources": resources}}}


def build_task_job(task: TaskSpec):
    selection: dg.AssetSelection = dg.AssetSelection.groups(task.name)
    if task.output.cascade is not None:
        # A cascade's label_model (unpartitioned, over every partition) is materialized on its own.
        selection -= dg.AssetSelection.assets(asset_key(task.name, "label_model"))
    return dg.define_asset_job(
        name=pipeline_job_name(task.name),
        selection=selection,
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
    (lib/task_file_errors.py) and the other tasks load as usual. Each engine kind's resource
    key comes from `ENGINE_KINDS`."""
    if tasks is None:
        loaded = load_tasks()
        tasks, task_errors = loaded.tasks, loaded.errors
    resources: dict[str, Any] = {
        IO_MANAGER_KEY: ParquetStorage(),
        **default_engines(),
        **({ENGINE_KINDS["vllm"].resource_key: engine} if engine else {}),
        **({ENGINE_KINDS["openai"].resource_key: endpoint} if endpoint else {}),
    }
    return pipelines_definitions(tasks, resources, task_errors, [build_recovery_sensor()])


@functools.cache
def _shared_resources() -> Mapping[str, Any]:
    return MappingProxyType({IO_MANAGER_KEY: ParquetStorage(), **default_engines()})


def component_definitions(
    tasks: list[TaskSpec],
    task_errors: list[TaskFileError] | None = None,
    range_failure_sensor: str = RANGE_FAILURE_SENSOR_NAME,
    recovery_sensor: bool = True,
) -> dg.Definitions:
    """What a component builds (lib/component.py): its tasks' pipelines on the default resources.

    Every component of a code location gets the same resource objects, which `dg.Definitions.merge`
    takes once (objects of their own would clash by key). Sensors are copied per component, so each
    names its range failure sensor (`range_failure_sensor`) and one of them carries the recovery
    sensor (`recovery_sensor`)."""
    shared = [build_recovery_sensor()] if recovery_sensor else []
    return pipelines_definitions(tasks, dict(_shared_resources()), task_errors, shared, range_failure_sensor)


def pipelines_definitions(
    tasks: list[TaskSpec],
    resources: dict[str, Any],
    task_errors: list[TaskFileError] | None,
    shared_sensors: list[dg.SensorDefinition],
    range_failure_sensor: str = RANGE_FAILURE_SENSOR_NAME,
) -> dg.Definitions:
    """Each task's assets, checks, jobs and sensors on `resources` (by resource key), with
    `shared_sensors` (those of the whole code location)."""
    task_errors = list(task_errors or [])
    assets, checks, jobs, sensors, task_jobs = [], [], [], [], []
    for task in tasks:
        try:
            settings = resolve_settings(task, resources)
        except TaskSpecError as exc:  # e.g. BATCH_ASSETS_MODEL names a model too short for the task
            task_errors.append(TaskFileError(task.name, (), str(exc)))
            continue
        assets += build_task_assets(task, settings)
        checks += build_task_checks(task)
        job = build_task_job(task)
        split_job = build_split_job(task, tags={K8S_CONFIG_TAG: SPLIT_POD_CONFIG}) if task.input.shard_rows else None
        jobs += [job, split_job] if split_job else [job]
        task_jobs.append((task, job))
        sensors.append(build_drops_sensor(task, job, split_job=split_job))
        sensors += build_automation_sensor(task)
    fail_validation_on(task_errors)
    sensors = [build_task_file_error_sensor(error) for error in task_errors] + sensors
    range_failures = build_range_failure_sensor(task_jobs, range_failure_sensor)
    sensors += [range_failures] if range_failures is not None else []
    return dg.Definitions(
        assets=assets,
        asset_checks=checks,
        jobs=jobs,
        sensors=[*sensors, *shared_sensors],
        resources=resources,
        # The four steps of a partition run one after another anyway; running them in one process
        # skips a process start per step and lets the engine stay warm across partitions.
        executor=dg.in_process_executor,
    )
