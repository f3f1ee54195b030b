"""The Dagster instance a first run uses: its storage (reachable, schema current), its run launcher,
and, for Kubernetes, whether a run pod's environment holds every variable the instance reads."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import dagster as dg
import sqlalchemy as sa

from batch_assets.doctor.context import DoctorContext, env_references
from batch_assets.doctor.report import Check, fail, ok, skip
from batch_assets.runtime.instance import INSTANCE_TEMPLATE, home_problem, prepare_instance
from batch_assets.storage.errors import exception_chain, scrub
from batch_assets.storage.result_cache import instance_postgres_url

STORAGE_SECTIONS = ("storage", "run_storage", "event_log_storage", "schedule_storage")
# What K8sRunLauncher puts into every run pod itself (dagster_k8s/job.py): DAGSTER_HOME always,
# DAGSTER_PG_PASSWORD from `postgres_password_secret` when that is set.
K8S_ALWAYS_SET = ("DAGSTER_HOME",)
K8S_PASSWORD_ENV = "DAGSTER_PG_PASSWORD"
CONNECT_TIMEOUT_S = 10  # libpq waits for a host that does not answer without end unless told
MIGRATE = "run `dagster instance migrate` once, with this DAGSTER_HOME"


def cause_line(error: BaseException) -> str:
    """The innermost cause's first line (the database driver's "connection ... failed: Connection
    refused", a config error's variable), without credentials."""
    innermost = list(exception_chain(error))[-1]
    text = str(getattr(innermost, "orig", None) or innermost).strip()
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    return scrub(first or type(innermost).__name__)


def storage_setting(ctx: DoctorContext) -> str:
    names = sorted({name for key in STORAGE_SECTIONS for name, _ in env_references(ctx.instance_config.get(key), key)})
    where = f"`storage` in {ctx.instance_file}"
    return f"{', '.join(names)} ({where})" if names else where


def storage_description(instance: dg.DagsterInstance, ctx: DoctorContext) -> str:
    url = instance_postgres_url(instance)
    if url:
        return f"Postgres {sa.make_url(url).render_as_string(hide_password=True)}"
    return f"{type(instance.run_storage).__name__} under {ctx.home}"


def check_instance_storage(ctx: DoctorContext) -> Iterator[Check]:
    name = "instance storage"
    problem = home_problem(ctx.home)
    if problem is not None:
        yield fail(name, problem, "DAGSTER_HOME")
        return
    if not ctx.home.exists():
        yield new_home_check(ctx)
        return
    refs = [ref for key in STORAGE_SECTIONS for ref in env_references(ctx.instance_config.get(key), key)]
    unset = sorted({variable for variable, _ in refs if not ctx.env.get(variable)})
    if unset:
        yield fail(name, f"{ctx.instance_file} reads {', '.join(unset)}, not set here", storage_setting(ctx))
        return
    unreachable = postgres_unreachable(ctx)
    if unreachable:
        yield fail(name, f"the instance's Postgres does not answer: {unreachable}", storage_setting(ctx))
        return
    try:
        prepare_instance()  # what every command does first: the template on a new home, its tables
        ctx.instance = dg.DagsterInstance.get()
    except Exception as error:  # noqa: BLE001 - any failure to open the storage is this line
        yield fail(name, f"the instance in {ctx.home} does not open: {cause_line(error)}", storage_setting(ctx))
        return
    yield schema_check(ctx.instance, storage_description(ctx.instance, ctx))


def new_home_check(ctx: DoctorContext) -> Check:
    """A home not made yet is left unmade (a check creates nothing): the instance the first command
    would make there, from the bundled dagster.yaml, is opened in a scratch folder instead (the later
    checks use it), removed when the doctor ends."""
    name = "instance storage"
    ctx.scratch_home = Path(tempfile.mkdtemp(prefix="batch-assets-doctor-"))
    shutil.copyfile(INSTANCE_TEMPLATE, ctx.scratch_home / "dagster.yaml")
    try:
        ctx.instance = dg.DagsterInstance.from_config(str(ctx.scratch_home))
        ctx.instance.get_runs(limit=1)  # opens (and so creates) its storage, as a first command does
    except Exception as error:  # noqa: BLE001 - any failure to open the storage is this line
        return fail(name, f"the bundled dagster.yaml's instance does not open: {cause_line(error)}", "DAGSTER_HOME")
    # The bundled dagster.yaml keeps everything in SQLite under the home.
    return ok(
        name,
        f"{ctx.home} does not exist yet: the first command creates it with the bundled dagster.yaml, whose "
        f"instance opens (SQLite, schema current for Dagster {dg.__version__})",
    )


def postgres_unreachable(ctx: DoctorContext) -> str | None:
    """Why the Postgres of `storage: postgres:` cannot be reached (one try, a bounded wait), else None:
    Dagster's own connection retries take 15 s and leave the reason in its log."""
    section = (ctx.instance_config.get("storage") or {}).get("postgres")
    if not isinstance(section, dict):
        return None
    try:
        from dagster_postgres.utils import pg_url_from_config
    except ImportError:
        return None  # loading the instance says so
    url = pg_url_from_config(resolve_env(section, ctx.env))
    engine = sa.create_engine(url, connect_args={"connect_timeout": CONNECT_TIMEOUT_S})
    try:
        with engine.connect():
            return None
    except sa.exc.SQLAlchemyError as error:
        return cause_line(error)
    finally:
        engine.dispose()


def resolve_env(config: Any, env: Mapping[str, str]) -> Any:
    """A Dagster config with each `{env: NAME}` replaced by its value here."""
    if isinstance(config, dict):
        if set(config) == {"env"}:
            return env.get(str(config["env"]), "")
        return {key: resolve_env(value, env) for key, value in config.items()}
    if isinstance(config, list):
        return [resolve_env(value, env) for value in config]
    return config


def schema_check(instance: dg.DagsterInstance, where: str) -> Check:
    """Each storage's alembic revision against the head of the installed Dagster (Dagster's own
    `alembic_version`, as `dagster instance migrate` compares them)."""
    behind = []
    versions = {
        "runs": instance.run_storage.alembic_version(),
        "event log": instance.event_log_storage.alembic_version(),
        "schedules": instance.schedule_storage.alembic_version() if instance.schedule_storage else None,
    }
    for label, version in versions.items():
        if not version:
            continue
        current, head = version
        heads = head if isinstance(head, tuple) else (head,)
        if current not in heads:
            behind.append(f"{label} at {current}, Dagster {dg.__version__} expects {head}")
    if behind:
        return fail("instance storage", f"{where}: schema not current ({'; '.join(behind)})", MIGRATE)
    return ok("instance storage", f"{where}: reachable, schema current for Dagster {dg.__version__}")


def check_run_launcher(ctx: DoctorContext) -> Iterator[Check]:
    name = "run launcher"
    section = ctx.launcher_section
    config = section.get("config") or {}
    if ctx.instance is None:
        yield skip(name, "the instance did not open (above)")
        return
    if ctx.k8s_launcher and config.get("load_incluster_config", True) and not ctx.in_cluster:
        yield skip(
            name, "K8sRunLauncher loads its in-cluster credentials: run doctor in the daemon's or code server's pod"
        )
        return
    try:
        launcher = ctx.instance.run_launcher
    except Exception as error:  # noqa: BLE001 - a launcher that does not load is this line
        label = section.get("class") or "the run launcher"
        yield fail(name, f"{label} does not load: {cause_line(error)}", f"`run_launcher` in {ctx.instance_file}")
        return
    yield ok(name, f"{type(launcher).__name__} loads")


def check_run_pod_env(ctx: DoctorContext) -> Iterator[Check]:
    refs = dict(env_references(ctx.instance_config))
    launcher = ctx.launcher_section if ctx.k8s_launcher else None
    yield run_pod_env_check(refs, launcher, ctx.in_cluster, ctx.env, ctx.instance_file)


def run_pod_env_check(
    refs: Mapping[str, str],
    k8s_launcher: Mapping[str, Any] | None,
    in_pod: bool,
    env: Mapping[str, str],
    instance_file: Path,
) -> Check:
    """Whether every variable the instance reads (`refs`: name -> setting path) is where a run reads
    it: this process's environment (local runs inherit it; in a pod, the pod's is what a run pod of
    the same launcher config gets), else, outside a pod, what K8sRunLauncher's config gives run pods."""
    name = "run pod environment"
    if not refs:
        return ok(name, f"{instance_file} reads no environment variable")
    listed = ", ".join(sorted(refs))
    if k8s_launcher is None or in_pod:
        missing = sorted(variable for variable in refs if not env.get(variable))
        if not missing:
            where = "this pod" if in_pod else "this environment (runs started here inherit it)"
            return ok(name, f"{listed} set in {where}")
        detail = "; ".join(f"{variable} ({refs[variable]}) is not set" for variable in missing)
        return fail(name, f"the instance reads {detail}", _where_to_add(missing, k8s_launcher, instance_file))
    config = k8s_launcher.get("config") or {}
    given = set(K8S_ALWAYS_SET) | {entry.split("=", 1)[0] for entry in config.get("env_vars") or []}
    given |= {
        item.get("name")
        for item in ((config.get("run_k8s_config") or {}).get("container_config") or {}).get("env") or []
    }
    if config.get("postgres_password_secret"):
        given.add(K8S_PASSWORD_ENV)
    missing = sorted(set(refs) - given)
    if not missing:
        return ok(name, f"{listed} given to run pods by run_launcher.config")
    sources = [*(config.get("env_config_maps") or []), *(config.get("env_secrets") or [])]
    if sources:
        return Check(
            "WARN",
            name,
            f"run pods must get {', '.join(missing)} from {', '.join(map(str, sources))}, whose contents are "
            "only seen in the cluster: run doctor in a pod to check",
            _where_to_add(missing, k8s_launcher, instance_file),
        )
    return fail(
        name,
        f"the instance reads {', '.join(missing)}, which a run pod will not have",
        _where_to_add(missing, k8s_launcher, instance_file),
    )


def _where_to_add(missing: list[str], k8s_launcher: Mapping[str, Any] | None, instance_file: Path) -> str:
    names = ", ".join(missing)
    if k8s_launcher is None:
        return f"{names} in the environment of every process that loads {instance_file}"
    maps = (k8s_launcher.get("config") or {}).get("env_config_maps") or []
    into = f"the ConfigMap {', '.join(map(str, maps))}" if maps else "a ConfigMap (deploy/k8s/instance-env.yaml)"
    return (
        f"{names} in {into} named by run_launcher.config.env_config_maps (or in run_launcher.config.env_vars) "
        f"in {instance_file}"
    )
