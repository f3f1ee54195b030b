"""batch_assets as separate containers on one Docker engine, each run in a container of its own.

    python deploy/docker/topology.py up       # start (or restart) everything, drops sensors on; prints the addresses
    python deploy/docker/topology.py down     # remove the containers, the network and the volumes
    python deploy/docker/topology.py ps       # the containers and their states

Containers, on the network `batch-assets`, all but Postgres from the image `make image` builds
(`BATCH_ASSETS_IMAGE`, default batch-assets:cpu), as UID 10001 on a read-only root:
- `batch-assets-postgres`: runs, event logs, ticks and pool slots (`POSTGRES_IMAGE`; by default
  batch-assets-postgres:15, built here from deploy/docker/postgres/ when missing);
- `batch-assets-s3`: an S3 endpoint (moto's server), where drops, outputs and checkpoints live;
- `batch-assets-code`: the code server (`dagster api grpc`);
- `batch-assets-daemon`: sensors, the run queue, run monitoring and retries; it starts each run as a
  container through the engine's socket (dagster-docker's DockerRunLauncher, deploy/docker/dagster.yaml);
- `batch-assets-webserver`: the UI, published on 127.0.0.1:`WEBSERVER_PORT` (default 3000).
Postgres and S3 are published on loopback too (`POSTGRES_PORT`, `S3_PORT`), for tools on the host.

Written on the Docker SDK (docker-py, which dagster-docker uses too) rather than a compose file: the
engines here have no compose plugin, and the checks (batch_assets_tests/test_deploy_docker.py) kill,
restart and inspect single containers with the same client.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import docker
from docker.models.containers import Container

HERE = Path(__file__).resolve().parent
NETWORK = "batch-assets"
LABEL = "batch-assets/topology"
VOLUMES = {"home": "batch-assets-home", "cache": "batch-assets-cache", "postgres": "batch-assets-pg"}
DAGSTER_HOME = "/opt/dagster/dagster_home"
BUCKET = "batch-assets"
# Credentials of this topology's own Postgres and S3 stand-in; a real deployment sets its own.
POSTGRES = {"DAGSTER_PG_USERNAME": "dagster", "DAGSTER_PG_PASSWORD": "dagster", "DAGSTER_PG_DB": "dagster"}
AWS = {"AWS_ACCESS_KEY_ID": "batch-assets", "AWS_SECRET_ACCESS_KEY": "batch-assets", "AWS_REGION": "us-east-1"}


@dataclass(frozen=True)
class Settings:
    image: str = os.environ.get("BATCH_ASSETS_IMAGE", "batch-assets:cpu")
    postgres_image: str = os.environ.get("POSTGRES_IMAGE", "batch-assets-postgres:15")
    webserver_port: int = int(os.environ.get("WEBSERVER_PORT", "3000"))
    postgres_port: int = int(os.environ.get("POSTGRES_PORT", "55432"))
    s3_port: int = int(os.environ.get("S3_PORT", "55000"))
    extra_env: dict[str, str] = field(default_factory=dict)

    def environment(self) -> dict[str, str]:
        """What every batch_assets container sees (the daemon hands it on to run containers)."""
        return {
            "DAGSTER_PG_HOST": "batch-assets-postgres",
            "DAGSTER_PG_PORT": "5432",
            **POSTGRES,
            "BATCH_ASSETS_IMAGE": self.image,
            "BATCH_ASSETS_NETWORK": NETWORK,
            "BATCH_ASSETS_DATA": f"s3://{BUCKET}/data",
            "AWS_ENDPOINT_URL": "http://batch-assets-s3:5000",
            **AWS,
            **self.extra_env,
        }


def client() -> docker.DockerClient:
    return docker.from_env(timeout=600)


# The Dagster home (instance files, compute logs) and the caches, on every container of the image.
SHARED_VOLUMES = {
    VOLUMES["home"]: {"bind": DAGSTER_HOME, "mode": "rw"},
    VOLUMES["cache"]: {"bind": "/cache", "mode": "rw"},
}


def as_batch_user(settings: Settings, **kwargs) -> dict:
    """The run options of a container of the image: UID 10001, read-only root, the shared volumes."""
    return {
        "image": settings.image,
        "user": "10001",
        "read_only": True,
        "tmpfs": {"/tmp": ""},
        "network": NETWORK,
        "environment": settings.environment(),
        "volumes": SHARED_VOLUMES,
        "labels": {LABEL: "service"},
        "detach": True,
        **kwargs,
    }


def ensure_postgres_image(engine: docker.DockerClient, settings: Settings) -> None:
    try:
        engine.images.get(settings.postgres_image)
    except docker.errors.ImageNotFound:
        if settings.postgres_image != Settings.postgres_image:
            engine.images.pull(settings.postgres_image)
            return
        print(f"topology: building {settings.postgres_image} from {HERE / 'postgres'}", flush=True)
        engine.images.build(path=str(HERE / "postgres"), tag=settings.postgres_image, rm=True)


def write_instance_files(engine: docker.DockerClient, settings: Settings, instance_file: Path | None = None) -> None:
    """dagster.yaml (this folder's, or `instance_file`) and workspace.yaml into the shared home volume
    (the image's root is read-only)."""
    script = (
        f"cat > {DAGSTER_HOME}/dagster.yaml <<'YAML'\n{(instance_file or HERE / 'dagster.yaml').read_text()}YAML\n"
        f"cat > {DAGSTER_HOME}/workspace.yaml <<'YAML'\n{(HERE / 'workspace.yaml').read_text()}YAML\n"
    )
    engine.containers.run(
        settings.image,
        ["sh", "-c", script],
        user="10001",
        volumes={VOLUMES["home"]: {"bind": DAGSTER_HOME, "mode": "rw"}},
        remove=True,
    )


def wait_for(what: str, ready, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise TimeoutError(f"topology: {what} not ready after {timeout:.0f} s")
        time.sleep(1)


def exec_ok(container: Container, command: list[str]) -> bool:
    container.reload()
    return container.status == "running" and container.exec_run(command).exit_code == 0


def up(settings: Settings) -> dict[str, Container]:
    engine = client()
    down(engine, keep_volumes=True)
    started = start_storage(engine, settings)
    start_dagster(engine, settings, started, docker_runs=True)
    return started


def start_storage(engine: docker.DockerClient, settings: Settings, instance_file: Path | None = None) -> dict:
    """The network, the volumes, the instance files, Postgres and S3 (its bucket made), ready."""
    ensure_postgres_image(engine, settings)
    engine.networks.create(NETWORK, driver="bridge", labels={LABEL: "network"})
    for volume in VOLUMES.values():
        try:
            engine.volumes.get(volume)
        except docker.errors.NotFound:
            engine.volumes.create(volume, labels={LABEL: "volume"})
    write_instance_files(engine, settings, instance_file)
    started: dict[str, Container] = {}
    started["postgres"] = engine.containers.run(
        settings.postgres_image,
        name="batch-assets-postgres",
        network=NETWORK,
        environment={
            "POSTGRES_USER": POSTGRES["DAGSTER_PG_USERNAME"],
            "POSTGRES_PASSWORD": POSTGRES["DAGSTER_PG_PASSWORD"],
            "POSTGRES_DB": POSTGRES["DAGSTER_PG_DB"],
        },
        volumes={VOLUMES["postgres"]: {"bind": "/var/lib/postgresql/data", "mode": "rw"}},
        ports={"5432/tcp": ("127.0.0.1", settings.postgres_port)},
        labels={LABEL: "service"},
        detach=True,
    )
    started["s3"] = engine.containers.run(
        **as_batch_user(
            settings,
            name="batch-assets-s3",
            command=["moto_server", "-H", "0.0.0.0", "-p", "5000"],
            ports={"5000/tcp": ("127.0.0.1", settings.s3_port)},
        )
    )
    wait_for("Postgres", lambda: exec_ok(started["postgres"], ["pg_isready", "-h", "127.0.0.1", "-q"]))
    check_s3 = ["python", "-c", f"import urllib.request; urllib.request.urlopen('http://127.0.0.1:5000/{BUCKET}')"]
    wait_for("S3", lambda: exec_ok(started["s3"], check_s3) or create_bucket(started["s3"]))
    return started


def start_dagster(engine: docker.DockerClient, settings: Settings, started: dict, docker_runs: bool) -> None:
    """The code server, the daemon (with the engine's socket when runs are containers: `docker_runs`)
    and the webserver, ready; added to `started`."""
    started["code"] = engine.containers.run(**as_batch_user(settings, name="batch-assets-code"))
    wait_for(
        "the code server",
        lambda: exec_ok(started["code"], ["dagster", "api", "grpc-health-check", "-p", "3030"]),
        timeout=300,
    )
    workspace = ["-w", f"{DAGSTER_HOME}/workspace.yaml"]
    socket = "/var/run/docker.sock"
    # The run launcher starts each run's container through the engine: its socket, and the socket's
    # group so that UID 10001 may use it.
    through_socket = (
        {
            "volumes": {**SHARED_VOLUMES, socket: {"bind": socket, "mode": "rw"}},
            "group_add": [str(os.stat(socket).st_gid)],
        }
        if docker_runs
        else {}
    )
    started["daemon"] = engine.containers.run(
        **as_batch_user(
            settings, name="batch-assets-daemon", command=["dagster-daemon", "run", *workspace], **through_socket
        )
    )
    started["webserver"] = engine.containers.run(
        **as_batch_user(
            settings,
            name="batch-assets-webserver",
            command=["dagster-webserver", "-h", "0.0.0.0", "-p", "3000", *workspace],
            ports={"3000/tcp": ("127.0.0.1", settings.webserver_port)},
        )
    )
    check_web = ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:3000/server_info')"]
    wait_for("the webserver", lambda: exec_ok(started["webserver"], check_web), timeout=300)


def start_drop_sensors(daemon: Container) -> list[str]:
    """Turns on every task's drops sensor (they ship stopped, as Dagster's sensors do), so that a file
    dropped under `data/drops/<task>/` becomes a run; the names started."""
    workspace = ["-w", f"{DAGSTER_HOME}/workspace.yaml"]
    listed = daemon.exec_run(["dagster", "sensor", "list", *workspace])
    names = re.findall(r"^Sensor: (\w+_drops_sensor) \[", listed.output.decode(), flags=re.MULTILINE)
    if listed.exit_code != 0 or not names:
        raise RuntimeError(f"topology: no drops sensor listed by the daemon:\n{listed.output.decode()}")
    for name in names:
        started = daemon.exec_run(["dagster", "sensor", "start", name, *workspace])
        if started.exit_code != 0 and "already running" not in started.output.decode():
            raise RuntimeError(f"topology: `dagster sensor start {name}` failed:\n{started.output.decode()}")
    return names


def create_bucket(s3: Container) -> bool:
    made = s3.exec_run(
        [
            "python",
            "-c",
            f"import boto3; boto3.client('s3', endpoint_url='http://127.0.0.1:5000').create_bucket(Bucket='{BUCKET}')",
        ]
    )
    return made.exit_code == 0


def down(engine: docker.DockerClient | None = None, keep_volumes: bool = False) -> None:
    """Removes this topology's containers (runs' too), its network and, unless kept, its volumes."""
    engine = engine or client()
    for container in engine.containers.list(all=True, filters={"label": LABEL}):
        container.remove(force=True)
    for network in engine.networks.list(names=[NETWORK]):
        network.remove()
    if not keep_volumes:
        for volume in VOLUMES.values():
            with contextlib.suppress(docker.errors.NotFound):
                engine.volumes.get(volume).remove(force=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["up", "down", "ps"])
    args = parser.parse_args(argv)
    settings = Settings()
    if args.command == "up":
        started = up(settings)
        print(f"topology: sensors on: {', '.join(start_drop_sensors(started['daemon']))}")
        print(
            f"topology: up. UI http://127.0.0.1:{settings.webserver_port} · S3 http://127.0.0.1:{settings.s3_port} "
            f"(bucket {BUCKET}, drops under s3://{BUCKET}/data/drops/<task>/) · "
            f"Postgres 127.0.0.1:{settings.postgres_port}"
        )
    elif args.command == "down":
        down()
    else:
        for container in client().containers.list(all=True, filters={"label": LABEL}):
            print(f"{container.name:32} {container.status:10} {container.image.tags}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
