"""With dagster-ray's `RayRunLauncher` configured: the Ray cluster its address names answers, runs the
Ray version installed here (a Ray job client refuses another), and has an alive node offering the
engine slots in-process runs ask for (`batch_assets_engine`, lib/ray_runs.py). `ray_decision` turns
what the cluster said into the lines, tested on recorded answers; the cluster itself is asked over
the dashboard's HTTP API (docs/ray.md)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from batch_assets.doctor.context import DoctorContext
from batch_assets.doctor.instance_checks import resolve_env
from batch_assets.doctor.report import Check, fail, ok, skip
from batch_assets.lib.ray_runs import ENGINE_RESOURCE

NAME = "ray cluster"
RAY_LAUNCHER = "RayRunLauncher"
ADDRESS_SETTING = "run_launcher.config.ray.address"
SLOT_SETTING = f"`ray start --resources '{{\"{ENGINE_RESOURCE}\": N}}'` on each worker node (docs/ray.md)"
TIMEOUT_S = 10


def installed_ray() -> str | None:
    try:
        import ray
    except ImportError:
        return None
    return str(ray.__version__)


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response:
        return json.loads(response.read())


def alive_nodes(address: str) -> list[dict[str, Any]]:
    """Each alive node's id and total resources, from the dashboard's state API (what `ray list nodes
    --detail` prints)."""
    answer = _get(f"{address}/api/v0/nodes?detail=1&limit=10000")
    nodes = answer["data"]["result"]["result"]
    return [node for node in nodes if node.get("state") == "ALIVE"]


def ray_decision(
    address: str, cluster_version: str, installed: str, nodes: Sequence[Mapping[str, Any]], engine_tasks: Sequence[str]
) -> list[Check]:
    """The lines for a cluster that answered: its version against the installed one, then its engine slots."""
    if cluster_version != installed:
        return [
            fail(
                NAME,
                f"{address} runs Ray {cluster_version}, this machine has Ray {installed}: jobs are refused",
                "the same Ray on both: the `ray` extra's pin (pyproject.toml) and the cluster's image",
            )
        ]
    lines = [ok(NAME, f"{address} answers, Ray {cluster_version} as installed here, {len(nodes)} alive node(s)")]
    slots = {
        str(node.get("node_id")): float((node.get("resources_total") or {}).get(ENGINE_RESOURCE, 0)) for node in nodes
    }
    offering = {node: n for node, n in slots.items() if n > 0}
    if offering:
        lines.append(
            ok(NAME, f"{len(offering)} alive node(s) offer {ENGINE_RESOURCE} ({sum(offering.values()):g} slots in all)")
        )
    elif engine_tasks:
        lines.append(
            fail(
                NAME,
                f"no alive node offers the resource {ENGINE_RESOURCE}: the runs of {', '.join(engine_tasks)} "
                "(in-process engine) ask for one and would wait for ever",
                SLOT_SETTING,
            )
        )
    else:
        lines.append(ok(NAME, f"no node offers {ENGINE_RESOURCE}, and no task runs an in-process engine"))
    return lines


def launcher_address(ctx: DoctorContext) -> str | None:
    config = (ctx.launcher_section.get("config") or {}).get("ray") or {}
    address = resolve_env(config.get("address"), ctx.env)
    return str(address).rstrip("/") if address else None


def check_ray_cluster(ctx: DoctorContext) -> Iterator[Check]:
    if ctx.launcher_section.get("class") != RAY_LAUNCHER:
        yield skip(NAME, f"the run launcher is not {RAY_LAUNCHER}: runs are not Ray jobs")
        return
    address = launcher_address(ctx)
    if not address:
        yield fail(NAME, "RayRunLauncher has no address", f"{ADDRESS_SETTING} in {ctx.instance_file}")
        return
    if not address.startswith(("http://", "https://")):
        yield skip(NAME, f"{address}: doctor asks a Ray dashboard address (http://<head>:8265), as jobs are sent")
        return
    installed = installed_ray()
    if installed is None:
        yield fail(NAME, "Ray is not installed here: RayRunLauncher cannot send jobs", "install batch-assets[ray]")
        return
    try:
        version = str(_get(f"{address}/api/version")["ray_version"])
        nodes = alive_nodes(address)
    except (OSError, ValueError, KeyError, TypeError) as error:
        reason = error.reason if isinstance(error, urllib.error.URLError) else error
        yield fail(
            NAME, f"{address} does not answer as a Ray dashboard: {reason}", f"{ADDRESS_SETTING} in {ctx.instance_file}"
        )
        return
    engine_tasks = [task.name for task in ctx.tasks.tasks if task.engine.kind == "vllm"]
    yield from ray_decision(address, version, installed, nodes, engine_tasks)
