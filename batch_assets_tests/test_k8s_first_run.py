"""What a first run on a cluster meets, checked with the real objects and no cluster (issue 36):

- the instance Dagster's Helm chart renders from deploy/helm/values.yaml carries the run and `gpu`
  pool limits (loaded by Dagster as an instance);
- a run pod asks for its own GPUs, CPUs and memory, with Helm too (where the chart can copy the code
  server's settings into every run), for the default pod, tensor parallel, `data_parallel_size: auto`
  on 8-GPU nodes and an endpoint task (no GPU, its API key from its secret);
- without Helm, the environment a run pod gets is enough to load the instance it is handed (a real
  PostgreSQL server in the slow test), and the service account may create the runs' Jobs;
- every manifest in deploy/ and the built run Jobs pass `kubernetes-validate --strict`, and the run
  pods, the code server and the shared vLLM server meet the "restricted" pod security level.

Pods are built with dagster-k8s's own merge and Job construction (batch_assets_tests/k8s_pods.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import dagster as dg
import pytest
import yaml

from batch_assets.lib.task_definitions import GPUS_PER_NODE_ENV, api_key_secret_name
from batch_assets.pipeline.task_spec import load_task_spec

pytest.importorskip("dagster_k8s", reason="dagster-k8s is not installed (pip install -e '.[test]')")
import kubernetes  # noqa: E402
from dagster._config import process_config, resolve_to_config_type  # noqa: E402
from dagster._core.instance.ref import InstanceRef  # noqa: E402
from dagster._serdes import serialize_value  # noqa: E402

from batch_assets_tests.k8s_pods import (  # noqa: E402
    DEPLOY,
    NAMESPACE,
    SECRETS,
    build_launcher,
    config_maps,
    helm_code_location_context,
    helm_instance_limits,
    helm_run_launcher_config,
    helm_values,
    job_tags,
    kubernetes_objects,
    large_task,
    launcher_config,
    pod_environment,
    run_pod_job,
    write_kubeconfig,
)

INDUSTRY_SHARED = DEPLOY / "examples" / "tasks" / "industry_shared.yaml"


# deploy/kuberay/ holds a RayCluster, a custom resource kubernetes-validate has no schema for
# (test_ray_placement.py checks it field by field).
MANIFESTS = sorted(
    path for path in DEPLOY.rglob("*.yaml") if kubernetes_objects(path) and not path.is_relative_to(DEPLOY / "kuberay")
)


@pytest.fixture
def kubeconfig(tmp_path: Path) -> Path:
    return write_kubeconfig(tmp_path / "kubeconfig")


@pytest.fixture(autouse=True)
def daemon_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The daemon's environment without Helm: deploy/k8s/instance-env.yaml (its launcher reads the
    job namespace from it)."""
    for name, value in config_maps().get("dagster-instance-env", {}).items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv(GPUS_PER_NODE_ENV, raising=False)


def as_manifest(model: Any) -> dict:
    """A kubernetes client object as the API (and `kubectl`) sees it: camelCase, no nulls."""
    return kubernetes.client.ApiClient().sanitize_for_serialization(model)


def the_four_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, dict]:
    """Tags of the runs of the default pod, tensor parallel 4, `auto` on 8-GPU nodes and an endpoint task."""
    monkeypatch.setenv(GPUS_PER_NODE_ENV, "8")
    return {
        "default": {},
        "tp4": job_tags(large_task(tmp_path, 4, 1)),
        "auto_on_8": job_tags(large_task(tmp_path, 1, "auto")),
        "endpoint": job_tags(load_task_spec(INDUSTRY_SHARED)),
    }


# GPUs (limit), CPUs (request), memory (request, limit) of each run's pod.
EXPECTED_RESOURCES = {
    "default": ("1", "6", "32Gi", "48Gi"),
    "tp4": ("4", "12", "56Gi", "84Gi"),  # before: 32Gi/48Gi whatever the GPUs
    "auto_on_8": ("8", "36", "88Gi", "132Gi"),
    "endpoint": ("0", "2", "8Gi", "16Gi"),
}


def resources_of(pod) -> tuple[str, str, str, str]:
    resources = pod.containers[0].resources
    limits, requests = resources.limits, resources.requests
    return limits["nvidia.com/gpu"], requests["cpu"], requests["memory"], limits["memory"]


def helm_run_pod(kubeconfig: Path, tags: dict) -> Any:
    values = helm_values()
    launcher = build_launcher(kubeconfig, config=helm_run_launcher_config(values))
    return run_pod_job(launcher, tags, container_context=helm_code_location_context(values)).spec.template.spec


# --- Helm: the instance's limits -------------------------------------------------------------------


def test_the_helm_instance_limits_runs_and_the_gpu_pool(tmp_path: Path) -> None:
    """Loaded by Dagster as the chart renders it (storage aside): 8 runs at once, 8 `gpu` pods."""
    rendered = helm_instance_limits(helm_values())
    (tmp_path / "dagster.yaml").write_text(
        yaml.safe_dump({"storage": {"sqlite": {"base_dir": str(tmp_path / "storage")}}, **rendered})
    )
    with dg.DagsterInstance.from_config(str(tmp_path)) as instance:
        limits = instance.get_concurrency_config()
    assert limits.pool_config.default_pool_limit == 8
    assert limits.pool_config.pool_granularity is not None and limits.pool_config.pool_granularity.value == "run"
    assert limits.run_queue_config is not None and limits.run_queue_config.max_concurrent_runs == 8
    # The same as the instance without Helm.
    k8s = yaml.safe_load((DEPLOY / "k8s" / "dagster.yaml").read_text())["concurrency"]
    assert (k8s["pools"]["default_limit"], k8s["runs"]["max_concurrent_runs"]) == (8, 8)


# --- Run pods: their own resources, with Helm and without -----------------------------------------


@pytest.mark.parametrize("run", list(EXPECTED_RESOURCES))
def test_a_run_pod_asks_for_its_own_gpus_cpus_and_memory(
    kubeconfig: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, run: str
) -> None:
    """With Helm, not the code server's 500m CPU and 1Gi (which `includeConfigInLaunchedRuns` would
    merge over the launcher's); without Helm, the same pod."""
    tags = the_four_runs(tmp_path, monkeypatch)[run]
    helm_pod = helm_run_pod(kubeconfig, tags)
    assert resources_of(helm_pod) == EXPECTED_RESOURCES[run]
    plain_pod = run_pod_job(build_launcher(kubeconfig), tags).spec.template.spec
    assert resources_of(plain_pod) == EXPECTED_RESOURCES[run]
    assert helm_pod.containers[0].resources == plain_pod.containers[0].resources


def test_an_endpoint_run_pod_takes_no_gpu_and_gets_its_api_key(kubeconfig: Path) -> None:
    task = load_task_spec(INDUSTRY_SHARED)
    assert task.engine.kind == "openai" and task.engine.api_key_env == "VLLM_API_KEY"
    pod = run_pod_job(build_launcher(kubeconfig), job_tags(task)).spec.template.spec
    [container] = pod.containers
    assert container.resources.limits["nvidia.com/gpu"] == "0"
    assert pod.node_selector is None  # any node, GPU or not
    env = pod_environment(container, SECRETS)
    assert env["VLLM_API_KEY"] == "example-key"
    assert env["NVIDIA_VISIBLE_DEVICES"] == "void"  # the image's `all` would show a GPU node's devices
    [key] = [item for item in container.env if item.name == "VLLM_API_KEY"]
    # The secret the shared server reads (deploy/k8s/vllm-serve.yaml) is the one the run pod reads.
    serve = next(yaml.safe_load_all((DEPLOY / "k8s" / "vllm-serve.yaml").read_text()))
    serve_env = {item["name"]: item for item in serve["spec"]["template"]["spec"]["containers"][0]["env"]}
    served = serve_env["VLLM_API_KEY"]["valueFrom"]["secretKeyRef"]
    assert (key.value_from.secret_key_ref.name, key.value_from.secret_key_ref.key) == (served["name"], served["key"])
    assert api_key_secret_name("VLLM_API_KEY") == served["name"]
    # A run without the secret still starts and fails naming `api_key_env` (not a pod stuck unstarted).
    assert "VLLM_API_KEY" not in pod_environment(container, {k: v for k, v in SECRETS.items() if k != "vllm-api-key"})


def test_a_split_run_pod_takes_no_gpu_and_little_memory(kubeconfig: Path) -> None:
    """Issue 36 item 2: a big file is split by a run of `<task>_split_file`, which streams the file."""
    from batch_assets.lib.split_job import split_job_name
    from batch_assets.lib.task_definitions import build_definitions

    task = large_task(kubeconfig.parent, 4, 1)  # a GPU task: its split runs still take none
    tags = dict(build_definitions(tasks=[task]).resolve_job_def(split_job_name(task.name)).tags)
    pod = run_pod_job(build_launcher(kubeconfig), tags).spec.template.spec
    assert resources_of(pod) == ("0", "1", "1Gi", "2Gi")
    assert pod_environment(pod.containers[0], SECRETS)["NVIDIA_VISIBLE_DEVICES"] == "void"
    assert helm_run_pod(kubeconfig, tags).containers[0].resources == pod.containers[0].resources


# --- Without Helm: the run pod's environment and the service account ------------------------------


def k8s_instance_ref(tmp_path: Path) -> InstanceRef:
    """The instance the daemon's run launcher hands a run pod (in `execute_run`'s args): deploy/k8s/dagster.yaml
    with its `{env: ...}` settings unresolved."""
    home = tmp_path / "daemon_home"
    home.mkdir()
    (home / "dagster.yaml").write_text((DEPLOY / "k8s" / "dagster.yaml").read_text())
    return InstanceRef.from_dir(str(home))


def test_the_run_pod_environment_resolves_the_instance_it_is_handed(
    kubeconfig: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every variable deploy/k8s/dagster.yaml's storage reads is in the pod's environment: Dagster's
    config resolution of the storage succeeds (up to connecting, which the slow test below does)."""
    from dagster_postgres import DagsterPostgresStorage

    container = run_pod_job(build_launcher(kubeconfig), {}).spec.template.spec.containers[0]
    env = pod_environment(container, SECRETS)
    for name in [name for name in os.environ if name.startswith("DAGSTER_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    storage = k8s_instance_ref(tmp_path).storage_data
    assert storage is not None and storage.class_name == "DagsterPostgresStorage"
    resolved = process_config(resolve_to_config_type(DagsterPostgresStorage.config_type()), storage.config_dict)
    assert resolved.success, resolved.errors
    db = resolved.value["postgres_db"]
    assert (db["hostname"], db["username"], db["db_name"]) == ("postgres.example.internal", "dagster", "dagster")
    assert db["password"] == "example-password"


@pytest.mark.slow
def test_a_run_pod_loads_the_instance_from_its_environment_alone(kubeconfig: Path, tmp_path: Path) -> None:
    """A process with exactly the pod's environment loads the handed instance and reads its runs
    from a real PostgreSQL server (ConfigMap and secret filled in with that server's address)."""
    from batch_assets_tests.postgres_server import running_postgres

    with running_postgres() as server:
        maps = config_maps()
        maps["dagster-instance-env"] = {
            **maps["dagster-instance-env"],
            "DAGSTER_PG_HOST": server.host,
            "DAGSTER_PG_PORT": str(server.port),
            "DAGSTER_PG_USERNAME": server.username,
            "DAGSTER_PG_DB": server.db_name,
        }
        secrets = {**SECRETS, "dagster-postgresql-secret": {"postgresql-password": server.password}}
        container = run_pod_job(build_launcher(kubeconfig), {}).spec.template.spec.containers[0]
        env = pod_environment(container, secrets, maps)
        code = (
            "import sys\n"
            "from dagster import DagsterInstance\n"
            "from dagster._serdes import deserialize_value\n"
            "with DagsterInstance.from_ref(deserialize_value(sys.stdin.read())) as instance:\n"
            "    print('runs', instance.get_runs_count())\n"
        )
        result = subprocess.run(
            [sys.executable, "-c", code],
            input=serialize_value(k8s_instance_ref(tmp_path)),
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "runs 0"


def rbac_allows(docs: list[dict], account: str, namespace: str, verb: str, group: str, resource: str) -> bool:
    """Whether the Roles bound to a service account in these manifests grant the request (RBAC's
    rule matching: api group, resource and verb, `*` matching any)."""
    roles = {doc["metadata"]["name"]: doc for doc in docs if doc["kind"] == "Role"}
    for binding in (doc for doc in docs if doc["kind"] == "RoleBinding"):
        subjects = binding.get("subjects", [])
        if binding["metadata"]["namespace"] != namespace or not any(
            s["kind"] == "ServiceAccount" and s["name"] == account and s.get("namespace", namespace) == namespace
            for s in subjects
        ):
            continue
        role = roles.get(binding["roleRef"]["name"])
        for rule in role["rules"] if role and binding["roleRef"]["kind"] == "Role" else []:
            if all(
                wanted in rule.get(field, []) or "*" in rule.get(field, [])
                for field, wanted in (("apiGroups", group), ("resources", resource), ("verbs", verb))
            ):
                return True
    return False


def test_the_launchers_service_account_may_create_and_follow_run_jobs(kubeconfig: Path) -> None:
    docs = [doc for path in (DEPLOY / "k8s").glob("*.yaml") for doc in kubernetes_objects(path)]
    config = launcher_config()["config"]
    account = config["service_account_name"]
    pod = run_pod_job(build_launcher(kubeconfig), {}).spec.template.spec
    assert pod.service_account_name == account
    assert any(doc["kind"] == "ServiceAccount" and doc["metadata"]["name"] == account for doc in docs)
    namespace = config_maps()["dagster-instance-env"]["DAGSTER_K8S_JOB_NAMESPACE"]
    assert namespace == NAMESPACE
    for verb, group, resource in [
        ("create", "batch", "jobs"),  # launch a run
        ("delete", "batch", "jobs"),  # terminate it
        ("get", "batch", "jobs/status"),  # run monitoring
        ("list", "", "pods"),
        ("get", "", "pods/log"),  # a failed run's debug information
    ]:
        assert rbac_allows(docs, account, namespace, verb, group, resource), (verb, group, resource)
    assert not rbac_allows(docs, account, namespace, "create", "", "secrets")


# --- Kubernetes' own schemas, and the "restricted" pod security level -------------------------------

# The Kubernetes version the manifests are checked against (kubernetes-validate ships its schemas).
KUBERNETES_VERSION = "1.33.0"


def test_every_manifest_in_deploy_passes_strict_schema_validation() -> None:
    """`kubernetes-validate --strict` on every Kubernetes file of deploy/, as a user runs it: unknown
    fields (a typo, a field in the wrong place) fail as well as wrong types."""
    pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed (pip install -e '.[test]')")
    names = {path.relative_to(DEPLOY).as_posix() for path in MANIFESTS}
    assert {"k8s/cache-pvc.yaml", "k8s/instance-env.yaml", "k8s/rbac.yaml", "k8s/vllm-serve.yaml"} <= names
    command = [sys.executable, "-m", "kubernetes_validate", "--strict", "-k", KUBERNETES_VERSION, *map(str, MANIFESTS)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ERROR" not in result.stdout and "WARN" not in result.stdout, result.stdout


def test_the_built_run_jobs_pass_strict_schema_validation(
    kubeconfig: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Jobs dagster-k8s creates from our settings (resources, security context, volumes, the
    endpoint task's env) are valid Kubernetes objects, with Helm and without."""
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    for run, tags in the_four_runs(tmp_path, monkeypatch).items():
        plain = run_pod_job(build_launcher(kubeconfig), tags)
        values = helm_values()
        launcher = build_launcher(kubeconfig, config=helm_run_launcher_config(values))
        helm = run_pod_job(launcher, tags, container_context=helm_code_location_context(values))
        for job in (plain, helm):
            kubernetes_validate.validate(as_manifest(job), KUBERNETES_VERSION, strict=True)  # raises on any error
            assert job.spec.template.spec.containers, run


# Volume types the restricted level allows (Kubernetes docs, "Pod Security Standards" → Restricted).
RESTRICTED_VOLUME_TYPES = {
    "configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected", "secret",
}  # fmt: skip


def restricted_violations(pod: dict) -> list[str]:
    """What the "restricted" pod security level (Kubernetes 1.25+; baseline included) refuses in a pod
    spec in its API form, one line each; empty when admitted."""
    problems = []
    pod_context = pod.get("securityContext") or {}
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(field):
            problems.append(f"pod: {field}")
    for volume in pod.get("volumes") or []:
        kinds = set(volume) - {"name"}
        if not kinds <= RESTRICTED_VOLUME_TYPES:
            problems.append(f"volume {volume['name']}: type {sorted(kinds)}")
    containers = (pod.get("containers") or []) + (pod.get("initContainers") or [])
    for container in containers:
        where = f"container {container['name']}"
        context = container.get("securityContext") or {}
        if context.get("privileged"):
            problems.append(f"{where}: privileged")
        if context.get("allowPrivilegeEscalation") is not False:
            problems.append(f"{where}: allowPrivilegeEscalation must be false")
        if context.get("runAsNonRoot", pod_context.get("runAsNonRoot")) is not True:
            problems.append(f"{where}: runAsNonRoot must be true (pod or container)")
        if context.get("runAsUser", pod_context.get("runAsUser")) == 0:
            problems.append(f"{where}: runAsUser 0")
        seccomp = (context.get("seccompProfile") or pod_context.get("seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            problems.append(f"{where}: seccompProfile.type must be RuntimeDefault or Localhost, not {seccomp}")
        capabilities = context.get("capabilities") or {}
        if "ALL" not in (capabilities.get("drop") or []):
            problems.append(f"{where}: capabilities.drop must include ALL")
        if set(capabilities.get("add") or []) - {"NET_BIND_SERVICE"}:
            problems.append(f"{where}: capabilities.add {capabilities['add']}")
        if any(port.get("hostPort") for port in container.get("ports") or []):
            problems.append(f"{where}: hostPort")
    return problems


def test_restricted_rules_refuse_a_root_pod() -> None:
    """The checker itself: a pod without a security context, and one that runs as root."""
    bare = {"containers": [{"name": "c", "image": "x"}], "volumes": [{"name": "h", "hostPath": {"path": "/"}}]}
    assert len(restricted_violations(bare)) == 5  # escalation, non-root, seccomp, capabilities, hostPath
    root = {
        "securityContext": {"runAsNonRoot": True, "runAsUser": 0, "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [
            {
                "name": "c",
                "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
            }
        ],
    }
    assert restricted_violations(root) == ["container c: runAsUser 0"]


def test_run_pods_meet_the_restricted_pod_security_level(
    kubeconfig: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each run pod, with Helm and without, runs as the image's user (deploy/Dockerfile's USER), with
    its cache and home volumes writable through the pod's fsGroup."""
    from dockerfile_parse import DockerfileParser

    user = DockerfileParser(path=str(DEPLOY / "Dockerfile")).structure
    [uid] = [entry["value"].split(":")[0] for entry in user if entry["instruction"] == "USER"][-1:]
    home = DockerfileParser(path=str(DEPLOY / "Dockerfile")).envs["HOME"]
    for run, tags in the_four_runs(tmp_path, monkeypatch).items():
        for pod in (run_pod_job(build_launcher(kubeconfig), tags).spec.template.spec, helm_run_pod(kubeconfig, tags)):
            manifest = as_manifest(pod)
            assert restricted_violations(manifest) == [], run
            context = manifest["securityContext"]
            assert context["runAsUser"] == context["fsGroup"] == int(uid), run
            [container] = manifest["containers"]
            mounts = {mount["mountPath"]: mount["name"] for mount in container["volumeMounts"]}
            volumes = {volume["name"]: volume for volume in manifest["volumes"]}
            assert "emptyDir" in volumes[mounts[home]] and "persistentVolumeClaim" in volumes[mounts["/cache"]]


def test_the_code_server_and_the_shared_vllm_server_meet_the_restricted_level() -> None:
    [deployment] = helm_values()["dagster-user-deployments"]["deployments"]
    # The chart puts the deployment's podSecurityContext and securityContext on the code server's
    # pod and container as they are (charts/dagster-user-deployments/templates/deployment-user.yaml).
    code_server = {
        "securityContext": deployment.get("podSecurityContext"),
        "containers": [{"name": "dagster-user-deployments", "securityContext": deployment.get("securityContext")}],
    }
    assert restricted_violations(code_server) == []
    serve = next(doc for doc in kubernetes_objects(DEPLOY / "k8s" / "vllm-serve.yaml") if doc["kind"] == "Deployment")
    assert restricted_violations(serve["spec"]["template"]["spec"]) == []
