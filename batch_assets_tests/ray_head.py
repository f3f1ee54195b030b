"""A single-node Ray cluster for a test: `ray start --head --block` on loopback, every port a free one,
its own temporary folder, torn down with everything it started.

Ray binds the host's interface address unless told it is not a cluster: `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`
keeps the head (GCS, raylet, dashboard) on 127.0.0.1, at the price of refusing a second node; a
multi-node cluster runs its nodes in containers (docs/ray.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil

from batch_assets.doctor.ray_cluster import alive_nodes
from batch_assets_tests.support import stop_process_group

LOOPBACK_ONLY = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}
START_TIMEOUT_S = 120


@dataclass(frozen=True)
class RayHead:
    address: str  # the dashboard's HTTP address: what JobSubmissionClient and RayRunLauncher take
    temp_dir: Path
    log: Path
    gcs_address: str = ""  # host:port of the head's GCS: what a driver's `ray.init(address=...)` takes


def distinct_free_ports(count: int) -> list[int]:
    """`count` ports free now, all different: each socket stays bound until all are picked."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200 and "ray_version" in json.loads(response.read())
    except OSError:
        return False


def _has_a_node(address: str) -> bool:
    """Whether the head's node has registered; a dashboard still starting may drop the request."""
    try:
        return bool(alive_nodes(address))
    except OSError:
        return False


def _processes_of(temp_dir: Path) -> list[psutil.Process]:
    """Ray's processes name their session folder (under `temp_dir`) on their command line; some of
    them (raylet's workers) are not in the leader's process group."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if any(str(temp_dir) in part for part in process.info["cmdline"] or ()):
                found.append(process)
    return found


def stop_ray(leader: subprocess.Popen, temp_dir: Path) -> None:
    stop_process_group(leader, signal.SIGTERM, wait_s=5)  # `ray start --block` stops its head on SIGTERM
    for process in _processes_of(temp_dir):
        with contextlib.suppress(psutil.Error):
            process.kill()


@contextlib.contextmanager
def ray_head(resources: dict[str, float], env: dict[str, str] | None = None, num_cpus: int = 2) -> Iterator[RayHead]:
    """A Ray head offering `resources` (and `num_cpus` CPUs), its processes started with `env`
    (the Ray jobs' entrypoints inherit it)."""
    # Short: Ray's Unix sockets live under it, and a socket path is limited to 107 bytes.
    temp_dir = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))
    options = ["--port", "--dashboard-port", "--ray-client-server-port", "--dashboard-agent-listen-port"]
    options += ["--dashboard-agent-grpc-port", "--metrics-export-port", "--runtime-env-agent-port"]
    ports = dict(zip(options, distinct_free_ports(len(options)), strict=True))
    dashboard = ports["--dashboard-port"]
    command = [str(Path(sys.executable).parent / "ray"), "start", "--head", "--block", "--disable-usage-stats"]
    command += ["--node-ip-address", "127.0.0.1", "--dashboard-host", "127.0.0.1", "--include-dashboard", "true"]
    command += [f"--num-cpus={num_cpus}", "--resources", json.dumps(resources), "--temp-dir", str(temp_dir)]
    for option, port in ports.items():
        command += [option, str(port)]
    # Workers bind ports the system picks, not Ray's default range (10002-19999).
    command += ["--min-worker-port", "0", "--max-worker-port", "0"]
    log = temp_dir / "ray-start.log"
    with log.open("w") as output:
        leader = subprocess.Popen(
            command,
            env={**(env or os.environ), **LOOPBACK_ONLY},
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    address = f"http://127.0.0.1:{dashboard}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        # The dashboard answers before the head's node has registered with it.
        while not (_answers(f"{address}/api/version") and _has_a_node(address)):
            assert leader.poll() is None, f"ray start exited:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"Ray's dashboard and node not up within {START_TIMEOUT_S} s"
            time.sleep(0.5)
        yield RayHead(address, temp_dir, log, gcs_address=f"127.0.0.1:{ports['--port']}")
    finally:
        stop_ray(leader, temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)
