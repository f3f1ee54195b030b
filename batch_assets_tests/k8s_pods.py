"""Run pods as dagster-k8s builds them, and what Dagster's Helm chart renders from deploy/helm/values.yaml,
for the deploy tests (test_k8s_deploy.py, test_k8s_first_run.py). Nothing here talks to a cluster.

The Helm functions reproduce the chart's templates (dagster-io/dagster, helm/dagster, chart 1.13.x)
for the values this repo sets; each cites the template it follows. The chart itself is not vendored
and `helm` is not run here, so the Helm half of the deploy tests checks values.yaml against this model
of the chart (which leaves out what does not bear on them, e.g. the `<release>-pipeline-env` ConfigMap
the chart adds to every run), not against a rendering by Helm.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import dagster as dg
import yaml
from dagster._core.code_pointer import ModuleCodePointer
from dagster._core.origin import JobPythonOrigin, RepositoryPythonOrigin
from dagster._core.utils import make_new_run_id
from dagster._serdes.config_class import ConfigurableClassData
from dagster_k8s import K8sRunLauncher
from dagster_k8s.job import construct_dagster_k8s_job, get_job_name_from_run_id

from batch_assets.lib.task_definitions import build_definitions, pipeline_job_name
from batch_assets.pipeline.task_spec import TaskSpec
from batch_assets_tests.support import REPO_ROOT

DEPLOY = REPO_ROOT / "deploy"
IMAGE = "registry.example.com/batch-assets:0.1.0"
NAMESPACE = "batch-assets"
# `helm upgrade --install dagster dagster/dagster -n batch-assets` (deploy/README.md): the chart's
# fullname is then `dagster`.
HELM_RELEASE = "dagster"


def write_kubeconfig(path: Path) -> Path:
    """A kubeconfig for a cluster that is never contacted: building a run pod needs no API call."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "none", "cluster": {"server": "https://127.0.0.1:9"}}],
        "users": [{"name": "none", "user": {"token": "unused"}}],
        "contexts": [{"name": "none", "context": {"cluster": "none", "user": "none"}}],
        "current-context": "none",
    }
    path.write_text(yaml.safe_dump(config))
    return path


def launcher_config() -> dict:
    return yaml.safe_load((DEPLOY / "k8s" / "dagster.yaml").read_text())["run_launcher"]


def build_launcher(kubeconfig: Path, run_k8s_config: dict | None = None, config: dict | None = None) -> K8sRunLauncher:
    """A K8sRunLauncher from its instance config (deploy/k8s/dagster.yaml's unless `config`), told to
    read our kubeconfig instead of the in-cluster one."""
    section = launcher_config()
    config = {**(config or section["config"]), "load_incluster_config": False, "kubeconfig_file": str(kubeconfig)}
    if run_k8s_config is not None:
        config["run_k8s_config"] = run_k8s_config
    data = ConfigurableClassData(section["module"], section["class"], yaml.safe_dump(config))
    return data.rehydrate(as_type=K8sRunLauncher)


def run_pod_job(launcher: K8sRunLauncher, tags: dict[str, Any], container_context: dict | None = None):
    """The Kubernetes Job the launcher creates for a run with these tags, from a code location whose
    container context is `container_context` (what Helm's `includeConfigInLaunchedRuns` sends), built
    as `K8sRunLauncher._launch_k8s_job_with_args` builds it."""
    job_name_in_dagster = "sentiment_pipeline"
    repository = RepositoryPythonOrigin(
        executable_path=sys.executable,
        code_pointer=ModuleCodePointer("batch_assets.definitions", "defs", working_directory=None),
        container_image=IMAGE,
        container_context=container_context,
    )
    run = dg.DagsterRun(
        job_name=job_name_in_dagster,
        run_id=make_new_run_id(),
        tags=tags,
        job_code_origin=JobPythonOrigin(job_name_in_dagster, repository),
    )
    context = launcher.get_container_context_for_run(run)
    job_name = get_job_name_from_run_id(run.run_id)
    return construct_dagster_k8s_job(
        job_config=context.get_k8s_job_config(job_image=repository.container_image, run_launcher=launcher),
        args=["dagster", "api", "execute_run", "{}"],
        job_name=job_name,
        pod_name=job_name,
        component="run_worker",
        user_defined_k8s_config=context.run_k8s_config,
        labels={"dagster/job": job_name_in_dagster, "dagster/run-id": run.run_id},
        env_vars=[{"name": "DAGSTER_RUN_JOB_NAME", "value": job_name_in_dagster}],
    )


def job_tags(task: TaskSpec) -> dict[str, Any]:
    return dict(build_definitions(tasks=[task]).resolve_job_def(pipeline_job_name(task.name)).tags)


def large_task(tmp_path: Path, tensor_parallel_size: int, data_parallel_size: int | str) -> TaskSpec:
    """deploy/examples/tasks/industry_large.yaml (a 70B model) with other parallel sizes."""
    from batch_assets.pipeline.task_spec import load_task_spec

    text = (DEPLOY / "examples" / "tasks" / "industry_large.yaml").read_text()
    path = tmp_path / f"industry_tp{tensor_parallel_size}_dp{data_parallel_size}.yaml"
    engine = f"tensor_parallel_size: {tensor_parallel_size}\n  data_parallel_size: {data_parallel_size}"
    path.write_text(text.replace("tensor_parallel_size: 4", engine))
    return load_task_spec(path)


def helm_values() -> dict:
    return yaml.safe_load((DEPLOY / "helm" / "values.yaml").read_text())


def helm_run_launcher_config(values: dict) -> dict:
    """The K8sRunLauncher config the chart renders (templates/helpers/instance/_run-launcher.tpl,
    `dagsterYaml.runLauncher.k8s`), for the fields deploy/helm/values.yaml uses."""
    launcher = values["runLauncher"]["config"]["k8sRunLauncher"]
    config: dict[str, Any] = {
        "load_incluster_config": launcher["loadInclusterConfig"],
        "job_namespace": launcher.get("jobNamespace") or NAMESPACE,
        "image_pull_policy": launcher["imagePullPolicy"],
        # `dagster.serviceAccountName`: serviceAccount.name, else the chart's fullname.
        "service_account_name": HELM_RELEASE,
        "dagster_home": "/opt/dagster/dagster_home",  # global.dagsterHome's default
        "instance_config_map": f"{HELM_RELEASE}-instance",
        "postgres_password_secret": "dagster-postgresql-secret",
    }
    names = {"envConfigMaps": "env_config_maps", "envSecrets": "env_secrets"}
    for camel, snake in names.items():
        if launcher.get(camel):
            config[snake] = [entry["name"] for entry in launcher[camel] if "name" in entry]
    for camel, snake in {"envVars": "env_vars", "volumeMounts": "volume_mounts", "volumes": "volumes"}.items():
        if launcher.get(camel):
            config[snake] = launcher[camel]
    for camel, snake in {"resources": "resources", "securityContext": "security_context", "labels": "labels"}.items():
        if launcher.get(camel):
            config[snake] = launcher[camel]
    if launcher.get("failPodOnRunFailure"):
        config["fail_pod_on_run_failure"] = True
    run_keys = {
        "containerConfig": "container_config",
        "podSpecConfig": "pod_spec_config",
        "podTemplateSpecMetadata": "pod_template_spec_metadata",
        "jobSpecConfig": "job_spec_config",
        "jobMetadata": "job_metadata",
    }
    if launcher.get("runK8sConfig"):
        config["run_k8s_config"] = {run_keys[key]: value for key, value in launcher["runK8sConfig"].items() if value}
    return config


def helm_code_location_context(values: dict) -> dict | None:
    """The container context the chart gives our code server (DAGSTER_CLI_API_GRPC_CONTAINER_CONTEXT),
    which every run of the location carries; None when `includeConfigInLaunchedRuns` is off.
    charts/dagster-user-deployments/templates/deployment-user.yaml (on unless `enabled: false`) and
    helpers/_helpers.tpl, `dagsterUserDeployments.k8sContainerContext`."""
    [deployment] = values["dagster-user-deployments"]["deployments"]
    if not (deployment.get("includeConfigInLaunchedRuns") or {"enabled": True})["enabled"]:
        return None
    k8s: dict[str, Any] = {
        "image_pull_policy": deployment["image"]["pullPolicy"],
        "env_config_maps": [
            f"{HELM_RELEASE}-{deployment['name']}-user-env",
            *(entry["name"] for entry in deployment.get("envConfigMaps", []) if "name" in entry),
        ],
        "namespace": NAMESPACE,
        "service_account_name": f"{HELM_RELEASE}-dagster-user-deployments-user-deployments",
        "run_k8s_config": {"pod_spec_config": {"automount_service_account_token": True}},
    }
    if deployment.get("envSecrets"):
        k8s["env_secrets"] = [entry["name"] for entry in deployment["envSecrets"] if "name" in entry]
    for camel, snake in {"volumeMounts": "volume_mounts", "volumes": "volumes", "labels": "labels"}.items():
        if deployment.get(camel):
            k8s[snake] = deployment[camel]
    if deployment.get("resources"):
        k8s["resources"] = deployment["resources"]
    if isinstance(deployment.get("env"), list) and deployment["env"]:
        k8s["env"] = deployment["env"]
    return {"k8s": k8s}


def helm_instance_limits(values: dict) -> dict:
    """The `concurrency` and `run_coordinator` sections of the instance the chart renders.

    templates/configmap-instance.yaml renders `concurrency:` only when `concurrency.enabled` (the
    chart's own test `test_concurrency_disabled_by_default`), from helpers/instance/_concurrency.tpl;
    the queued run coordinator (helpers/instance/_run-coordinator.tpl) writes `max_concurrent_runs`
    (-1 when unset) only while that block is off or when its own maxConcurrentRuns is set. The
    chart's default queuedRunCoordinator values set neither maxConcurrentRuns nor tag limits."""
    rendered: dict[str, Any] = {}
    concurrency = values.get("concurrency") or {}
    enabled = bool(concurrency.get("enabled", False))
    if enabled:
        block: dict[str, Any] = {}
        pools, runs = concurrency.get("pools") or {}, concurrency.get("runs") or {}
        pool_keys = {
            "defaultLimit": "default_limit",
            "granularity": "granularity",
            "opGranularityRunBuffer": "op_granularity_run_buffer",
        }
        if pools := {snake: pools[camel] for camel, snake in pool_keys.items() if pools.get(camel) is not None}:
            block["pools"] = pools
        if runs.get("maxConcurrentRuns") is not None:
            block["runs"] = {"max_concurrent_runs": runs["maxConcurrentRuns"]}
        rendered["concurrency"] = block
    coordinator = values["dagsterDaemon"]["runCoordinator"]
    if coordinator.get("enabled") and coordinator.get("type") == "QueuedRunCoordinator":
        queued = (coordinator.get("config") or {}).get("queuedRunCoordinator") or {}
        section: dict[str, Any] = {"module": "dagster.core.run_coordinator", "class": "QueuedRunCoordinator"}
        if any(value not in (None, [], {}, "") for value in queued.values()):
            maximum = queued.get("maxConcurrentRuns")
            section["config"] = {} if enabled and maximum is None else {"max_concurrent_runs": maximum or -1}
        rendered["run_coordinator"] = section
    return rendered


def kubernetes_objects(path: Path) -> list[dict]:
    """The Kubernetes objects of a YAML file (none in a Dagster instance file or Helm values)."""
    return [doc for doc in yaml.safe_load_all(path.read_text()) if isinstance(doc, dict) and "apiVersion" in doc]


# The secrets deploy/README.md has the user create, with example contents.
SECRETS = {
    "dagster-postgresql-secret": {"postgresql-password": "example-password"},
    "batch-assets-env": {"BATCH_ASSETS_DATA": "s3://my-bucket/batch-assets", "AWS_REGION": "eu-west-1"},
    "vllm-api-key": {"VLLM_API_KEY": "example-key"},
}


def config_maps() -> dict[str, dict[str, str]]:
    """The ConfigMaps of deploy/k8s, by name."""
    found = {}
    for path in (DEPLOY / "k8s").glob("*.yaml"):
        for doc in kubernetes_objects(path):
            if doc["kind"] == "ConfigMap":
                found[doc["metadata"]["name"]] = doc["data"]
    return found


def pod_environment(container, secrets: dict[str, dict[str, str]], maps: dict | None = None) -> dict[str, str]:
    """The variables a container starts with, as the kubelet resolves them from the cluster's
    ConfigMaps and Secrets: `envFrom` first, then `env` over it; a missing optional source is
    skipped and a missing required one stops the pod."""
    maps = config_maps() if maps is None else maps
    stores = {"config_map": maps, "secret": secrets}
    env: dict[str, str] = {}
    for source in container.env_from or []:
        for kind, store in stores.items():
            ref = getattr(source, f"{kind}_ref")
            if ref is None:
                continue
            if ref.name not in store:
                assert ref.optional, f"the pod would not start: {kind} {ref.name} does not exist"
                continue
            env.update(store[ref.name])
    for item in container.env or []:
        if item.value_from is None:
            env[item.name] = item.value
            continue
        for kind, store in stores.items():
            ref = getattr(item.value_from, f"{kind}_key_ref")
            if ref is None:
                continue
            if ref.key not in store.get(ref.name, {}):
                assert ref.optional, f"the pod would not start: {kind} {ref.name} has no key {ref.key}"
                continue
            env[item.name] = store[ref.name][ref.key]
    return env
