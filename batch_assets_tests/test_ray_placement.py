"""Runs on Ray, without a Ray cluster: what each task's runs ask Ray for (read back by dagster-ray's own
tag parser), docs/ray.md's launcher block as an instance loads it, doctor's Ray lines on recorded
answers, no `ray_node_id` off Ray, and the KubeRay RayCluster manifest field by field (no RayCluster
schema ships in a package; its pod templates against Kubernetes' own schema). The runs themselves on
a real Ray: test_ray_runs.py (slow tier)."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import dagster as dg
import pytest
import yaml

from batch_assets.doctor.ray_cluster import SLOT_SETTING, ray_decision
from batch_assets.lib.ray_runs import CPU_ONLY_ENV, RAY_CONFIG_TAG, ray_node_metadata
from batch_assets.lib.task_definitions import GPUS_PER_NODE_ENV, engine_pod_resources
from batch_assets.pipeline.task_spec import load_task_spec
from batch_assets_tests.k8s_pods import DEPLOY, job_tags, large_task
from batch_assets_tests.support import REPO_ROOT

SHIPPED = REPO_ROOT / "batch_assets" / "tasks"
INDUSTRY_SHARED = DEPLOY / "examples" / "tasks" / "industry_shared.yaml"
RAYCLUSTER = DEPLOY / "kuberay" / "raycluster.yaml"
KUBERNETES_VERSION = "1.33.0"  # as test_k8s_first_run.py validates the other manifests


def ray_request(tags: dict) -> dict:
    """The run's request as dagster-ray reads it from the run's tags (RayRunLauncher._launch_ray_job)."""
    from dagster_ray.core.run_launcher import RayLauncherConfig

    config = RayLauncherConfig.from_tags(tags)
    return {"num_gpus": config.num_gpus, "resources": config.resources}


@pytest.mark.parametrize(
    ("tensor_parallel_size", "data_parallel_size", "gpus"),
    [(1, 1, 1), (4, 1, 4), (2, 2, 4), (2, 4, 8)],
)
def test_an_in_process_run_asks_for_one_slot_and_the_gpus_its_pod_would(
    tmp_path: Path, tensor_parallel_size: int, data_parallel_size: int, gpus: int
) -> None:
    tags = job_tags(large_task(tmp_path, tensor_parallel_size, data_parallel_size))
    assert engine_pod_resources(tensor_parallel_size, data_parallel_size).gpus == gpus
    assert ray_request(tags) == {"num_gpus": float(gpus), "resources": {"batch_assets_engine": 1.0}}


def test_auto_on_a_node_of_eight_gpus_asks_for_the_whole_node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(GPUS_PER_NODE_ENV, "8")
    assert ray_request(job_tags(large_task(tmp_path, 2, "auto")))["num_gpus"] == 8.0


def test_on_cpu_nodes_a_run_asks_for_its_slot_and_no_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CPU_ONLY_ENV, "1")
    for task in (load_task_spec(SHIPPED / "sentiment.yaml"), large_task(tmp_path, 2, 2)):
        assert ray_request(job_tags(task)) == {"num_gpus": None, "resources": {"batch_assets_engine": 1.0}}


@pytest.mark.parametrize("value", ["yes", "2", "true"])
def test_a_bad_cpu_only_setting_is_refused_naming_it(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(CPU_ONLY_ENV, value)
    with pytest.raises(ValueError, match=f"{CPU_ONLY_ENV}={value!r}: expected 1"):
        job_tags(load_task_spec(SHIPPED / "sentiment.yaml"))


def test_endpoint_and_split_runs_ask_ray_for_nothing(tmp_path: Path) -> None:
    """No tag: dagster-ray then takes the launcher block's request, which asks for none."""
    assert RAY_CONFIG_TAG not in job_tags(load_task_spec(INDUSTRY_SHARED))
    assert ray_request({}) == {"num_gpus": None, "resources": None}
    from batch_assets.lib.task_definitions import build_definitions

    sentiment = load_task_spec(SHIPPED / "sentiment.yaml")
    jobs = {job.name: job for job in build_definitions(tasks=[sentiment]).resolve_all_job_defs()}
    assert RAY_CONFIG_TAG not in jobs["sentiment_split_file"].tags
    assert RAY_CONFIG_TAG in jobs["sentiment_pipeline"].tags


def docs_block() -> str:
    text = (REPO_ROOT / "docs" / "ray.md").read_text()
    return next(block for block in re.findall(r"```yaml\n(.*?)```", text, flags=re.DOTALL) if "RayRunLauncher" in block)


def test_the_documented_block_loads_as_the_instances_launcher_with_resumes_and_retries(tmp_path: Path) -> None:
    block = yaml.safe_load(docs_block().replace("<ray-address>", "http://127.0.0.1:8265"))
    (tmp_path / "dagster.yaml").write_text(yaml.safe_dump(block))
    instance = dg.DagsterInstance.from_config(str(tmp_path))
    launcher = instance.run_launcher
    assert type(launcher).__name__ == "RayRunLauncher" and launcher.address == "http://127.0.0.1:8265"  # type: ignore[attr-defined]
    assert {"BATCH_ASSETS_DATA", "DAGSTER_HOME", "AWS_ACCESS_KEY_ID"} <= set(launcher.env_vars)  # type: ignore[attr-defined]
    # Nothing asked of every run: endpoint runs must fit the head.
    assert (launcher.num_gpus, launcher.resources, launcher.num_cpus) == (None, None, None)  # type: ignore[attr-defined]
    assert launcher.supports_resume_run and instance.run_monitoring_enabled
    assert instance.run_monitoring_max_resume_run_attempts == 2
    assert instance.run_retries_enabled and instance.run_retries_max_retries == 1


def test_a_run_off_ray_records_no_node(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAY_JOB_CONFIG_JSON_ENV_VAR", raising=False)
    assert ray_node_metadata() == {}


NODES = [
    {"node_id": "head", "state": "ALIVE", "resources_total": {"CPU": 4.0}},
    {"node_id": "w1", "state": "ALIVE", "resources_total": {"CPU": 8.0, "GPU": 8.0, "batch_assets_engine": 8.0}},
]


def test_doctor_counts_the_engine_slots_of_alive_nodes() -> None:
    lines = [check.line() for check in ray_decision("http://h:8265", "2.60.0", "2.60.0", NODES, ["sentiment"])]
    assert lines == [
        "OK    ray cluster: http://h:8265 answers, Ray 2.60.0 as installed here, 2 alive node(s)",
        "OK    ray cluster: 1 alive node(s) offer batch_assets_engine (8 slots in all)",
    ]


def test_doctor_fails_a_cluster_without_engine_slots_naming_the_setting() -> None:
    [_, slots] = ray_decision("http://h:8265", "2.60.0", "2.60.0", NODES[:1], ["sentiment", "industry"])
    assert slots.status == "FAIL" and slots.setting == SLOT_SETTING
    assert slots.detail.startswith("no alive node offers the resource batch_assets_engine: the runs of sentiment, ")
    assert "ray start --resources" in SLOT_SETTING
    # Endpoint tasks alone need no slot.
    [_, fine] = ray_decision("http://h:8265", "2.60.0", "2.60.0", NODES[:1], [])
    assert fine.status == "OK"


def test_doctor_fails_another_ray_version() -> None:
    [line] = ray_decision("http://h:8265", "2.59.1", "2.60.0", NODES, ["sentiment"])
    assert line.status == "FAIL"
    assert line.detail == "http://h:8265 runs Ray 2.59.1, this machine has Ray 2.60.0: jobs are refused"


# --- KubeRay ----------------------------------------------------------------------------------


def raycluster() -> dict:
    [cluster] = list(yaml.safe_load_all(RAYCLUSTER.read_text()))
    return cluster


def started_resources(params: dict) -> dict:
    """`rayStartParams.resources` as `ray start` gets it: KubeRay puts the value on a shell command line."""
    [value] = shlex.split(params.get("resources", "{}"))
    return json.loads(value)


def test_the_raycluster_runs_our_ray_on_a_head_without_slots_and_gpu_workers_with_them() -> None:
    import ray

    cluster = raycluster()
    assert (cluster["apiVersion"], cluster["kind"]) == ("ray.io/v1", "RayCluster")
    assert cluster["metadata"]["namespace"] == "batch-assets"
    spec = cluster["spec"]
    assert spec["rayVersion"] == ray.__version__ == "2.60.0"
    head = spec["headGroupSpec"]
    assert head["rayStartParams"]["num-gpus"] == "0" and "batch_assets_engine" not in started_resources(
        head["rayStartParams"]
    )
    [head_container] = head["template"]["spec"]["containers"]
    assert {port["containerPort"] for port in head_container["ports"]} >= {6379, 8265, 10001}
    [workers] = spec["workerGroupSpecs"]
    assert workers["minReplicas"] <= workers["replicas"] <= workers["maxReplicas"]
    [worker] = workers["template"]["spec"]["containers"]
    gpus = int(worker["resources"]["limits"]["nvidia.com/gpu"])
    # One slot per GPU, Ray told the same GPUs the pod has.
    assert started_resources(workers["rayStartParams"]) == {"batch_assets_engine": gpus}
    assert int(workers["rayStartParams"]["num-gpus"]) == gpus == engine_pod_resources(1, 1).gpus
    assert worker["resources"]["requests"]["cpu"] == str(engine_pod_resources(1, 1).cpus)
    assert head_container["image"] == worker["image"]
    assert any(t["key"] == "nvidia.com/gpu" for t in workers["template"]["spec"]["tolerations"])
    mounts = {mount["mountPath"]: mount["name"] for mount in worker["volumeMounts"]}
    volumes = {volume["name"]: volume for volume in workers["template"]["spec"]["volumes"]}
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    assert volumes[mounts["/cache"]]["persistentVolumeClaim"]["claimName"] == "batch-assets-cache"


def test_the_raycluster_pod_templates_pass_kubernetes_strict_schema() -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    spec = raycluster()["spec"]
    for name, group in [("head", spec["headGroupSpec"]), *((g["groupName"], g) for g in spec["workerGroupSpecs"])]:
        template = {
            "apiVersion": "v1",
            "kind": "PodTemplate",
            "metadata": {"name": name},
            "template": group["template"],
        }
        kubernetes_validate.validate(template, KUBERNETES_VERSION, strict=True)  # raises on any error
