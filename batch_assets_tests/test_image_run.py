"""The image as a platform engineer runs it (deploy/README.md, "The image"): built by `make image`
(deploy/build_image.sh), started as UID 10001 on a read-only root with the volumes the README names.

`make image-check` runs this file after `make image`; `make test` leaves it out (marker `image`): an
image build takes minutes and a Docker engine that CI's machine does not start by itself.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import uuid
from collections.abc import Iterator

import pytest

from batch_assets_tests.support import passed, summary_lines

pytestmark = [pytest.mark.image, pytest.mark.slow]
IMAGE = os.environ.get("BATCH_ASSETS_IMAGE", "batch-assets:cpu")
# The folders deploy/README.md mounts: the Dagster home, the caches and the data (drops, outputs).
VOLUMES = {"home": "/opt/dagster/dagster_home", "cache": "/cache", "data": "/data"}


def docker(*args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout, check=False)


@pytest.fixture(scope="module")
def volumes() -> Iterator[list[str]]:
    """Fresh named volumes for this module (Docker gives them the image folders' owner, UID 10001)."""
    if shutil.which("docker") is None or docker("image", "inspect", IMAGE).returncode != 0:
        pytest.fail(f"no image {IMAGE}: run `make image` first (deploy/README.md, 'The image')")
    prefix = f"batch-assets-test-{uuid.uuid4().hex[:8]}"
    names = {folder: f"{prefix}-{name}" for name, folder in VOLUMES.items()}
    yield [option for folder, name in names.items() for option in ("-v", f"{name}:{folder}")]
    docker("volume", "rm", "-f", *names.values())


def run_in_image(volumes: list[str], *command: str, shm: str | None = "1g") -> subprocess.CompletedProcess[str]:
    shm_option = [f"--shm-size={shm}"] if shm else []
    return docker(
        "run", "--rm", "--user", "10001", "--read-only", "--tmpfs", "/tmp", *shm_option, *volumes, IMAGE, *command
    )


def test_the_demo_runs_to_the_end_as_uid_10001_on_a_read_only_root(volumes: list[str]) -> None:
    result = run_in_image(volumes, "batch-assets", "demo")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    lines = summary_lines(result.stdout)
    assert len(lines) >= 8, result.stdout
    assert all(passed(line, line.split(":")[0]) for line in lines), lines
    # The outputs are on the data volume, the instance on the home volume: a second run finds them.
    again = run_in_image(volumes, "batch-assets", "demo")
    assert again.returncode == 0, again.stdout[-4000:]
    assert all(": UP TO DATE" in line for line in summary_lines(again.stdout)), again.stdout


def test_docker_runs_default_dev_shm_is_named_with_the_flag_to_set(volumes: list[str]) -> None:
    """Docker's default 64 MiB of /dev/shm: vLLM's engine cannot start, and the message says so."""
    sample = "/opt/batch_assets/batch_assets/samples/sentiment/posts-sample.jsonl"
    result = run_in_image(
        volumes, "batch-assets", "run", "sentiment", sample, "--replace", "--no-result-cache", shm=None
    )
    assert result.returncode != 0
    # Docker's 64 MiB, less what the container's processes already hold.
    assert re.search(r"/dev/shm has 6\d MiB free and vLLM's engine needs 160 MiB there", result.stdout), result.stdout
    assert "`docker run --shm-size=1g`" in result.stdout
