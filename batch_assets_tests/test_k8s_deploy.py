"""deploy/ for Kubernetes, checked without a cluster: Dagster validates the instance config, the
K8sRunLauncher class resolves and accepts its config, and dagster-k8s builds the run pod it
describes (one GPU, GPU nodes only, shared memory for vLLM), for the shipped tasks and for a task
split over four GPUs. The Helm values must describe the same run pod.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import dagster as dg
import pytest
import yaml

from batch_assets.definitions import K8S_CONFIG_TAG, build_definitions, pipeline_job_name, run_tags_for
from batch_assets.pipeline.task_spec import load_task_spec, load_task_specs
from batch_assets_tests.conftest import REPO_ROOT

dagster_k8s = pytest.importorskip("dagster_k8s", reason="dagster-k8s is not installed (pip install -e '.[test]')")
from dagster._config import process_config, resolve_to_config_type  # noqa: E402
from dagster._core.instance.config import dagster_instance_config  # noqa: E402
from dagster._core.utils import make_new_run_id  # noqa: E402
from dagster._serdes.config_class import ConfigurableClassData  # noqa: E402
from dagster_k8s.job import construct_dagster_k8s_job, get_job_name_from_run_id  # noqa: E402

DEPLOY = REPO_ROOT / "deploy"
IMAGE = "registry.example.com/batch-assets:0.1.0"
ENV = {
    "DAGSTER_PG_HOST": "postgres.example.internal",
    "DAGSTER_PG_PORT": "5432",
    "DAGSTER_PG_USERNAME": "dagster",
    "DAGSTER_PG_PASSWORD": "secret",
    "DAGSTER_PG_DB": "dagster",
    "DAGSTER_K8S_JOB_NAMESPACE": "batch-assets",
}
# What the Helm chart's run launcher template does with `runK8sConfig`.
HELM_RUN_K8S_KEYS = {
    "containerConfig": "container_config",
    "podSpecConfig": "pod_spec_config",
    "podTemplateSpecMetadata": "pod_template_spec_metadata",
    "jobSpecConfig": "job_spec_config",
    "jobMetadata": "job_metadata",
}


@pytest.fixture(autouse=True)
def k8s_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The variables deploy/k8s/dagster.yaml reads (set by the Helm chart / the deployment)."""
    for name, value in ENV.items():
        monkeypatch.setenv(name, value)


@pytest.fixture
def kubeconfig(tmp_path: Path) -> Path:
    """A kubeconfig for a cluster that is never contacted: building a run pod needs no API call."""
    path = tmp_path / "kubeconfig"
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "none", "cluster": {"server": "https://127.0.0.1:9"}}],
                "users": [{"name": "none", "user": {"token": "unused"}}],
                "contexts": [{"name": "none", "context": {"cluster": "none", "user": "none"}}],
                "current-context": "none",
            }
        )
    )
    return path


def launcher_config() -> dict:
    return yaml.safe_load((DEPLOY / "k8s" / "dagster.yaml").read_text())["run_launcher"]


def build_launcher(kubeconfig: Path, run_k8s_config: dict | None = None):
    """The deploy file's K8sRunLauncher, told to read our kubeconfig instead of the in-cluster one."""
    section = launcher_config()
    config = {**section["config"], "load_incluster_config": False, "kubeconfig_file": str(kubeconfig)}
    if run_k8s_config is not None:
        config["run_k8s_config"] = run_k8s_config
    data = ConfigurableClassData(section["module"], section["class"], yaml.safe_dump(config))
    return data.rehydrate(as_type=dagster_k8s.K8sRunLauncher)


def run_pod_job(launcher, tags: dict[str, str]):
    """The Kubernetes Job the launcher would create for a run with these tags."""
    run = dg.DagsterRun(job_name="sentiment_pipeline", run_id=make_new_run_id(), tags=tags)
    context = launcher.get_container_context_for_run(run)
    job_name = get_job_name_from_run_id(run.run_id)
    return construct_dagster_k8s_job(
        job_config=context.get_k8s_job_config(job_image=IMAGE, run_launcher=launcher),
        args=["dagster", "api", "execute_run", "{}"],
        job_name=job_name,
        pod_name=job_name,
        component="run_worker",
        user_defined_k8s_config=context.run_k8s_config,
        labels={"dagster/run-id": run.run_id},
    )


def test_k8s_instance_config_validates_and_its_run_launcher_resolves(tmp_path: Path) -> None:
    shutil.copyfile(DEPLOY / "k8s" / "dagster.yaml", tmp_path / "dagster.yaml")
    config, _ = dagster_instance_config(str(tmp_path))  # raises on any schema error
    assert config["storage"]["postgres"]["postgres_db"]["hostname"] == {"env": "DAGSTER_PG_HOST"}
    assert config["concurrency"]["pools"] == {"default_limit": 8, "granularity": "run"}

    section = config["run_launcher"]
    launcher_class = ConfigurableClassData(section["module"], section["class"], yaml.safe_dump(section["config"]))
    assert launcher_class.info_dict()["class"] == "K8sRunLauncher"
    resolved = process_config(resolve_to_config_type(dagster_k8s.K8sRunLauncher.config_type()), section["config"])
    assert resolved.success, resolved.errors
    assert resolved.value["job_namespace"] == "batch-assets"
    assert resolved.value["run_k8s_config"]["container_config"]["resources"]["limits"]["nvidia.com/gpu"] == "1"


def test_each_run_is_one_pod_with_one_gpu_on_a_gpu_node(kubeconfig: Path) -> None:
    job = run_pod_job(build_launcher(kubeconfig), tags={})
    pod = job.spec.template.spec
    assert len(pod.containers) == 1
    container = pod.containers[0]
    assert container.image == IMAGE
    assert container.args == ["dagster", "api", "execute_run", "{}"]
    assert container.resources.limits["nvidia.com/gpu"] == "1"
    assert pod.node_selector == {"nvidia.com/gpu.present": "true"}
    assert any(t.key == "nvidia.com/gpu" and t.effect == "NoSchedule" for t in pod.tolerations)
    shm = next(v for v in pod.volumes if v.name == "dshm")
    assert shm.empty_dir.medium == "Memory"
    assert any(m.name == "dshm" and m.mount_path == "/dev/shm" for m in container.volume_mounts)
    assert any(source.secret_ref and source.secret_ref.name == "batch-assets-env" for source in container.env_from)
    assert pod.service_account_name == "dagster"
    assert job.spec.backoff_limit == 0


def test_shipped_tasks_take_the_one_gpu_default() -> None:
    assert all(run_tags_for(task) == {} for task in load_task_specs())


def test_a_task_split_over_four_gpus_gets_a_four_gpu_pod(kubeconfig: Path) -> None:
    task = load_task_spec(DEPLOY / "examples" / "tasks" / "industry_large.yaml")
    assert task.engine.tensor_parallel_size == 4
    job_def = build_definitions(tasks=[task]).resolve_job_def(pipeline_job_name(task.name))
    assert K8S_CONFIG_TAG in job_def.tags

    pod = run_pod_job(build_launcher(kubeconfig), tags=dict(job_def.tags)).spec.template.spec
    limits = pod.containers[0].resources.limits
    # The task's tag raises the GPU count; everything else still comes from the instance config.
    assert limits["nvidia.com/gpu"] == "4"
    assert limits["memory"] == "48Gi"
    assert pod.node_selector == {"nvidia.com/gpu.present": "true"}
    assert any(v.name == "dshm" for v in pod.volumes)


def test_data_parallel_replicas_multiply_the_pods_gpus(kubeconfig: Path, tmp_path: Path) -> None:
    """Two replicas of a model split over two GPUs: one run pod with all four GPUs of a node."""
    text = (DEPLOY / "examples" / "tasks" / "industry_large.yaml").read_text()
    path = tmp_path / "industry_dp.yaml"
    path.write_text(text.replace("tensor_parallel_size: 4", "tensor_parallel_size: 2\n  data_parallel_size: 2"))
    task = load_task_spec(path)
    assert (task.engine.tensor_parallel_size, task.engine.data_parallel_size) == (2, 2)
    tags = dict(build_definitions(tasks=[task]).resolve_job_def(pipeline_job_name(task.name)).tags)
    pod = run_pod_job(build_launcher(kubeconfig), tags=tags).spec.template.spec
    assert pod.containers[0].resources.limits["nvidia.com/gpu"] == "4"
    # `auto` (every GPU the pod is given) keeps the launcher's GPU count.
    auto = task.model_copy(update={"engine": task.engine.model_copy(update={"data_parallel_size": "auto"})})
    assert run_tags_for(auto) == {}


def test_helm_values_describe_the_same_run_pod(kubeconfig: Path) -> None:
    values = yaml.safe_load((DEPLOY / "helm" / "values.yaml").read_text())
    launcher_values = values["runLauncher"]["config"]["k8sRunLauncher"]
    assert values["runLauncher"]["type"] == "K8sRunLauncher"
    helm_run_k8s_config = {HELM_RUN_K8S_KEYS[key]: value for key, value in launcher_values["runK8sConfig"].items()}

    from_file = run_pod_job(build_launcher(kubeconfig), tags={}).spec.template.spec
    from_helm = run_pod_job(build_launcher(kubeconfig, helm_run_k8s_config), tags={}).spec.template.spec
    for field in ("node_selector", "tolerations", "volumes"):
        assert getattr(from_helm, field) == getattr(from_file, field), field
    assert from_helm.containers[0].resources == from_file.containers[0].resources
    assert from_helm.containers[0].volume_mounts == from_file.containers[0].volume_mounts

    # The rest of the instance settings agree too.
    instance = yaml.safe_load((DEPLOY / "k8s" / "dagster.yaml").read_text())
    assert values["concurrency"]["pools"] == {
        "defaultLimit": instance["concurrency"]["pools"]["default_limit"],
        "granularity": instance["concurrency"]["pools"]["granularity"],
    }
    assert values["concurrency"]["runs"]["maxConcurrentRuns"] == instance["concurrency"]["runs"]["max_concurrent_runs"]
    assert values["dagsterDaemon"]["runRetries"]["maxRetries"] == instance["run_retries"]["max_retries"]
    assert values["postgresql"]["postgresqlScheme"] == instance["storage"]["postgres"]["postgres_db"]["scheme"]
    deployment = values["dagster-user-deployments"]["deployments"][0]
    assert deployment["dagsterApiGrpcArgs"] == ["-m", "batch_assets.definitions", "-a", "defs"]


def test_a_range_of_partitions_is_one_run_pod(kubeconfig: Path) -> None:
    """A backfill run over a range of partitions (up to `runs.max_partitions_per_run`) is one
    Kubernetes Job with one pod: one engine start for the whole range."""
    task = load_task_spec(DEPLOY / "examples" / "tasks" / "industry_large.yaml")
    defs = build_definitions(tasks=[task])
    inference = defs.resolve_assets_def(dg.AssetKey([task.name, "inference_outputs"]))
    assert inference.backfill_policy.max_partitions_per_run == task.runs.max_partitions_per_run == 16
    tags = {
        **defs.resolve_job_def(pipeline_job_name(task.name)).tags,
        "dagster/asset_partition_range_start": "customers-0001.csv",
        "dagster/asset_partition_range_end": "customers-0016.csv",
        "dagster/backfill": "abcdefgh",
    }
    job = run_pod_job(build_launcher(kubeconfig), tags=tags)
    assert job.spec.parallelism in (None, 1) and job.spec.completions in (None, 1)
    pod = job.spec.template.spec
    [container] = pod.containers
    assert container.args == ["dagster", "api", "execute_run", "{}"]  # one process runs the range
    assert container.resources.limits["nvidia.com/gpu"] == "4"


def test_the_shared_vllm_serve_deployment_matches_the_task_that_uses_it() -> None:
    from urllib.parse import urlsplit

    deployment, service = yaml.safe_load_all((DEPLOY / "k8s" / "vllm-serve.yaml").read_text())
    task = load_task_spec(DEPLOY / "examples" / "tasks" / "industry_shared.yaml")
    assert (deployment["kind"], service["kind"]) == ("Deployment", "Service")
    namespace = "batch-assets"  # the namespace deploy/README.md creates
    assert deployment["metadata"]["namespace"] == service["metadata"]["namespace"] == namespace

    pod = deployment["spec"]["template"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    [container] = pod["spec"]["containers"]
    assert container["command"] == ["vllm", "serve"]
    args = dict(arg[2:].split("=", 1) for arg in container["args"] if arg.startswith("--"))
    assert container["args"][0] == args["served-model-name"] == task.engine.model
    assert int(args["max-model-len"]) == task.engine.max_model_len
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert [env["name"] for env in container["env"] if env["name"] == task.engine.api_key_env] == ["VLLM_API_KEY"]

    # The task's base_url is the Service's cluster DNS name and port.
    url = urlsplit(task.engine.base_url)
    assert task.engine.kind == "openai" and url.path == "/v1"
    assert url.hostname == f"{service['metadata']['name']}.{namespace}.svc.cluster.local"
    [port] = service["spec"]["ports"]
    assert url.port == port["port"]
    assert port["targetPort"] in [p["name"] for p in container["ports"]]
    assert int(args["port"]) == next(p["containerPort"] for p in container["ports"] if p["name"] == port["targetPort"])


def test_a_burst_of_drops_for_a_four_gpu_task_asks_for_four_gpus_per_range_run(kubeconfig: Path) -> None:
    """The sensor's runs use Dagster's implicit asset job; the sensor passes the task job's GPU tag on."""
    from upath import UPath

    from batch_assets.dagster_defs.sensors import run_requests_for
    from batch_assets.storage.drop_files import DropFile

    task = load_task_spec(DEPLOY / "examples" / "tasks" / "industry_large.yaml")
    defs = build_definitions(tasks=[task])
    job_def = defs.resolve_job_def(pipeline_job_name(task.name))
    drops = [DropFile(f"customers-{i}.csv", UPath("/drops"), f"v{i}") for i in range(3)]
    keys = [drop.partition_key for drop in drops]
    [request] = run_requests_for([(drop, False) for drop in drops], keys, 16, job_tags=job_def.tags)
    assert request.tags["dagster/asset_partition_range_end"] == keys[-1]  # one pod for the three files
    pod = run_pod_job(build_launcher(kubeconfig), tags=dict(request.tags)).spec.template.spec
    assert pod.containers[0].resources.limits["nvidia.com/gpu"] == "4"
