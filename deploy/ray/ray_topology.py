"""batch_assets on a multi-node Ray cluster of containers on one Docker engine (`make ray-up`, docs/ray.md).

    python deploy/ray/ray_topology.py up [--workers 2]   # start everything, drops sensors on; prints the addresses
    python deploy/ray/ray_topology.py add-worker         # one more Ray worker (the next number)
    python deploy/ray/ray_topology.py restart-head       # restart the Ray head (the workers rejoin it)
    python deploy/ray/ray_topology.py down               # remove the containers, the network and the volumes

deploy/docker/topology.py's Postgres, S3, code server, daemon and webserver (same names, network and
volumes: one topology or the other runs at a time), with this folder's instance file (runs are Ray
jobs, dagster-ray's RayRunLauncher) and, from the same image (`BATCH_ASSETS_IMAGE`, with the `ray`
extra its lock carries):
- `batch-assets-ray-head`: the Ray head (GCS, dashboard and job server); no engine slot;
- `batch-assets-ray-worker-<n>`: Ray workers, each offering `batch_assets_engine: 1` (CPU nodes),
  labelled `batch-assets.role=ray-worker`, restarted by the engine when their raylet exits (a head
  restarted without GCS fault tolerance is a new cluster: the old workers' raylets die, and rejoin).
Ray's multi-node mode dials each node's interface address, so every node is a container on the
topology's network; the dashboard is published on 127.0.0.1:`RAY_DASHBOARD_PORT` (default 8265).
`up` and `add-worker` set the `gpu` pool's limit to the running workers' engine slots.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "docker"))

import topology as base  # noqa: E402  # deploy/docker/topology.py

HEAD = "batch-assets-ray-head"
WORKER_ROLE = {"batch-assets.role": "ray-worker"}
RAY_LABEL = "batch-assets/ray"
# Ray's object store lives in /dev/shm: the container's shared memory must hold it.
OBJECT_STORE_BYTES = 256 * 1024 * 1024
# `ray start --block` exits when its raylet does; the engine starts it again. `docker kill` (a lost
# node) and `docker stop` are not restarted.
RESTART = {"Name": "unless-stopped"}
# The Dagster pool of in-process engines' inference steps (batch_assets/engines/kinds.py).
ENGINE_POOL = "gpu"
NODE_ID_SCRIPT = (
    "import ray; ray.init(address='auto', logging_level='ERROR'); print(ray.get_runtime_context().get_node_id())"
)


@dataclass(frozen=True)
class RaySettings:
    base: base.Settings = field(
        default_factory=lambda: replace(base.Settings(), extra_env={"BATCH_ASSETS_RAY_CPU_ONLY": "1", "HOME": "/tmp"})
    )
    dashboard_port: int = int(os.environ.get("RAY_DASHBOARD_PORT", "8265"))


def ray_node(settings: RaySettings, name: str, command: list[str], labels: dict[str, str], **kwargs) -> dict:
    options = base.as_batch_user(settings.base, name=name, command=command, shm_size="1g", **kwargs)
    options["labels"] = {**options["labels"], **labels}
    return options


def wait_for_dashboard(head) -> None:
    check = ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8265/api/version')"]
    base.wait_for("the Ray head", lambda: base.exec_ok(head, check), timeout=180)


def start_head(engine, settings: RaySettings):
    command = ["ray", "start", "--head", "--block", "--disable-usage-stats", "--port=6379"]
    command += ["--dashboard-host=0.0.0.0", "--num-gpus=0", f"--object-store-memory={OBJECT_STORE_BYTES}"]
    head = engine.containers.run(
        **ray_node(
            settings,
            HEAD,
            command,
            {RAY_LABEL: "head"},
            ports={"8265/tcp": ("127.0.0.1", settings.dashboard_port)},
            # `ray start` gives its raylet 30 s to register and exits otherwise (a loaded machine).
            restart_policy=RESTART,
        )
    )
    wait_for_dashboard(head)
    return head


def restart_head(engine) -> None:
    """Stops and starts the head container: a new GCS, which knows none of the jobs before it."""
    head = engine.containers.get(HEAD)
    head.restart(timeout=10)
    wait_for_dashboard(head)


def start_worker(engine, settings: RaySettings, number: int):
    command = ["ray", "start", "--block", "--disable-usage-stats", f"--address={HEAD}:6379"]
    command += ["--resources", '{"batch_assets_engine": 1}', f"--object-store-memory={OBJECT_STORE_BYTES}"]
    name = f"batch-assets-ray-worker-{number}"
    return engine.containers.run(
        **ray_node(settings, name, command, {RAY_LABEL: "worker", **WORKER_ROLE}, restart_policy=RESTART)
    )


def workers(engine, running_only: bool = False) -> list:
    label = next(iter(WORKER_ROLE.items()))
    return engine.containers.list(all=not running_only, filters={"label": f"{label[0]}={label[1]}"})


def add_worker(engine, settings: RaySettings):
    """The next worker, and the `gpu` pool's limit raised to its slot too."""
    worker = start_worker(engine, settings, len(workers(engine)) + 1)
    set_engine_slots(engine.containers.get("batch-assets-daemon"), len(workers(engine, running_only=True)))
    return worker


def set_engine_slots(daemon, slots: int) -> None:
    """The `gpu` pool's limit (in Postgres, kept across `up`): the steps that may infer at once, one
    per engine slot, so that no run placed on a free worker waits in Dagster for a slot."""
    done = daemon.exec_run(["dagster", "instance", "concurrency", "set", ENGINE_POOL, str(slots)])
    if done.exit_code != 0:
        raise RuntimeError(f"ray_topology: setting the {ENGINE_POOL} pool to {slots}: {done.output.decode()}")


def node_id(container) -> str | None:
    """The Ray node id of a running node's container, None until its raylet has joined."""
    container.reload()
    if container.status != "running":
        return None
    found = container.exec_run(["python", "-c", NODE_ID_SCRIPT])
    lines = found.output.decode().split()
    return lines[-1] if found.exit_code == 0 and lines else None


def up(settings: RaySettings, worker_count: int = 2) -> dict:
    engine = base.client()
    base.down(engine, keep_volumes=True)
    started = base.start_storage(engine, settings.base, instance_file=HERE / "dagster.yaml")
    started["ray-head"] = start_head(engine, settings)
    for number in range(1, worker_count + 1):
        started[f"ray-worker-{number}"] = start_worker(engine, settings, number)
    base.start_dagster(engine, settings.base, started, docker_runs=False)
    set_engine_slots(started["daemon"], worker_count)
    return started


def addresses(settings: RaySettings) -> list[str]:
    """The lines `make ray-up` prints: where to drop files and watch."""
    return [
        f"S3_ENDPOINT=http://127.0.0.1:{settings.base.s3_port}",
        f"DATA=s3://{base.BUCKET}/data",
        f"WEBSERVER=http://127.0.0.1:{settings.base.webserver_port}",
        f"RAY_DASHBOARD=http://127.0.0.1:{settings.dashboard_port}",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["up", "add-worker", "restart-head", "down", "ps"])
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args(argv)
    settings = RaySettings()
    if args.command == "up":
        started = up(settings, args.workers)
        print(f"sensors on: {', '.join(base.start_drop_sensors(started['daemon']))}")
        print("\n".join(addresses(settings)))
    elif args.command == "add-worker":
        print(add_worker(base.client(), settings).name)
    elif args.command == "restart-head":
        restart_head(base.client())
    elif args.command == "down":
        base.down()
    else:
        for container in base.client().containers.list(all=True, filters={"label": base.LABEL}):
            print(f"{container.name:32} {container.status:10} {container.image.tags}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
