"""In a Kubernetes pod: whether this pod's service account may create the runs' Jobs and follow their
pods, asked of the API server with a SelfSubjectAccessReview (the `kubernetes` client dagster-k8s
depends on). `access_decision` turns the answers into the line, tested on recorded answers."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from batch_assets.doctor.context import IN_CLUSTER_ENV, DoctorContext
from batch_assets.doctor.report import Check, fail, ok, skip

NAME = "service account"
# What the run launcher does with the API (deploy/k8s/rbac.yaml): launch a run, terminate it, follow its pod.
NEEDED = (("create", "batch", "jobs"), ("delete", "batch", "jobs"), ("list", "", "pods"))
POD_NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


@dataclass(frozen=True)
class AccessAnswer:
    verb: str
    group: str
    resource: str
    allowed: bool
    reason: str = ""  # the API server's reason, often empty

    @property
    def what(self) -> str:
        return f"{self.verb} {self.group + '/' if self.group else ''}{self.resource}"


def access_decision(answers: list[AccessAnswer], namespace: str, account: str) -> Check:
    denied = [answer for answer in answers if not answer.allowed]
    if not denied:
        return ok(NAME, f"this pod's service account may {', '.join(a.what for a in answers)} in namespace {namespace}")
    reasons = "; ".join(f"{a.what}: {a.reason}" for a in denied if a.reason)
    return fail(
        NAME,
        f"this pod's service account may not {', '.join(a.what for a in denied)} in namespace {namespace}"
        + (f" ({reasons})" if reasons else ""),
        f"a Role with these rules bound to the service account {account} in {namespace} (deploy/k8s/rbac.yaml), "
        "and run_launcher.config.service_account_name",
    )


def job_namespace(launcher_config: Mapping, env: Mapping[str, str]) -> str:
    """K8sRunLauncher's `job_namespace` ({env: NAME} resolved here), else this pod's namespace."""
    raw = launcher_config.get("job_namespace")
    if isinstance(raw, dict):
        raw = env.get(str(raw.get("env")))
    if raw:
        return str(raw)
    return POD_NAMESPACE_FILE.read_text().strip() if POD_NAMESPACE_FILE.is_file() else "default"


def check_service_account(ctx: DoctorContext) -> Iterator[Check]:
    if not ctx.in_cluster:
        yield skip(NAME, f"not in a Kubernetes pod ({IN_CLUSTER_ENV} unset): run doctor in the daemon's pod to check")
        return
    if not ctx.k8s_launcher:
        yield skip(NAME, "the run launcher is not K8sRunLauncher: runs create no Jobs")
        return
    config = ctx.launcher_section.get("config") or {}
    namespace = job_namespace(config, ctx.env)
    try:
        answers = [review(namespace, *needed) for needed in NEEDED]
    except ImportError:
        yield fail(NAME, "the kubernetes client is not installed", "install batch-assets[deploy]")
        return
    yield access_decision(answers, namespace, str(config.get("service_account_name") or "default"))


def review(namespace: str, verb: str, group: str, resource: str) -> AccessAnswer:
    from kubernetes import client, config

    config.load_incluster_config()
    attributes = client.V1ResourceAttributes(namespace=namespace, verb=verb, group=group, resource=resource)
    body = client.V1SelfSubjectAccessReview(spec=client.V1SelfSubjectAccessReviewSpec(resource_attributes=attributes))
    status = client.AuthorizationV1Api().create_self_subject_access_review(body).status
    return AccessAnswer(verb, group, resource, bool(status.allowed), status.reason or "")
