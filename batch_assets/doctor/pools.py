"""The `gpu` pool: a limit must be set (without one every queued GPU run starts at once), and it counts
run pods (Kubernetes) or engines (one machine), not GPUs: a `data_parallel_size: auto` engine takes
every GPU of its node, so each slot is a whole node."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from batch_assets.doctor.context import DoctorContext
from batch_assets.doctor.report import Check, fail, ok, skip, warn
from batch_assets.engines.kinds import ENGINE_KINDS
from batch_assets.lib.task_definitions import GPUS_PER_NODE_ENV, gpus_per_node

NAME = "gpu pool"
POOL = ENGINE_KINDS["vllm"].pool


@dataclass(frozen=True)
class PoolFacts:
    limit: int | None  # None: no limit (neither set for the pool nor a default_limit)
    kubernetes: bool  # K8sRunLauncher: a slot is one run pod
    pod_gpus: dict[str, int]  # task -> GPUs of its run pod (Kubernetes) or of its engine
    auto_tasks: tuple[str, ...]  # tasks with data_parallel_size: auto
    node_gpus: int | None  # BATCH_ASSETS_GPUS_PER_NODE (Kubernetes) or the GPUs NVML sees (one machine)


def pool_decision(facts: PoolFacts, setting: str) -> Check:
    if facts.limit is None:
        return fail(NAME, f"the `{POOL}` pool has no limit: every queued GPU run starts at once", setting)
    if facts.limit < 1:
        return fail(NAME, f"the `{POOL}` pool's limit is {facts.limit}: no GPU run ever starts", setting)
    node = facts.node_gpus or 0
    widest = max(facts.pod_gpus.values(), default=1)
    if facts.kubernetes and facts.auto_tasks and node > 1 and facts.limit > 1:
        return warn(
            NAME,
            f"limit {facts.limit}, and {', '.join(facts.auto_tasks)} (data_parallel_size: auto) take a whole "
            f"{node}-GPU node per run pod: {facts.limit} pods at once need {facts.limit} such nodes "
            f"({facts.limit * node} GPUs); with fewer, the others wait Pending until run_monitoring fails them",
            f"the `{POOL}` limit to the number of {node}-GPU nodes batch_assets may use ({setting})",
        )
    if not facts.kubernetes and node and facts.limit * widest > node:
        return warn(
            NAME,
            f"limit {facts.limit} engines at once of up to {widest} GPU(s) each need {facts.limit * widest} GPUs, "
            f"and this machine has {node} (an engine with data_parallel_size: auto takes all of them): "
            "a second engine at once finds no GPU memory free",
            f"the `{POOL}` limit to {max(1, node // widest)} ({setting}), or engine.data_parallel_size",
        )
    unit = "run pods" if facts.kubernetes else "engines"
    return ok(NAME, f"limit {facts.limit} ({unit} at once), each of up to {widest} GPU(s)")


def check_gpu_pool(ctx: DoctorContext) -> Iterator[Check]:
    if ctx.instance is None:
        yield skip(NAME, "the instance did not open (above)")
        return
    tasks = [task for task in ctx.tasks.tasks if task.engine.kind == "vllm"]
    if not tasks:
        yield skip(NAME, f"no task uses the vLLM engine (the `{POOL}` pool is unused)")
        return
    setting = f"`dagster instance concurrency set {POOL} N`, or concurrency.pools.default_limit in {ctx.instance_file}"
    try:
        node = gpus_per_node() if ctx.k8s_launcher else ctx.visible_gpus
    except ValueError as error:
        yield fail(NAME, str(error), GPUS_PER_NODE_ENV)
        return
    storage = ctx.instance.event_log_storage
    limit = storage.get_concurrency_info(POOL).limit if storage.supports_global_concurrency_limits else None
    auto = tuple(task.name for task in tasks if task.engine.data_parallel_size == "auto")
    pods = {
        task.name: _engine_gpus(task.engine.tensor_parallel_size, task.engine.data_parallel_size, node)
        for task in tasks
    }
    yield pool_decision(PoolFacts(limit, ctx.k8s_launcher, pods, auto, node), setting)


def _engine_gpus(tensor_parallel_size: int, data_parallel_size: int | str, node_gpus: int | None) -> int:
    if data_parallel_size == "auto":
        return max(1, (node_gpus or 1) // tensor_parallel_size) * tensor_parallel_size
    return tensor_parallel_size * int(data_parallel_size)
