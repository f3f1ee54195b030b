"""`make test` runs two pytest-xdist workers with `--dist loadgroup`: conftest.py puts each test file's
tests in one group, so that a file's module and session fixtures are built on one worker only, and
what the workers share on disk (the tiny model in .venv) is built by one of them."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

from batch_assets.runtime.instance import exclusive_file_lock
from batch_assets_tests.conftest import xdist_group
from batch_assets_tests.support import REPO_ROOT

TESTS = REPO_ROOT / "batch_assets_tests"
# A test's argument or a `request.getfixturevalue` of the session's `vllm serve`.
USES_VLLM_SERVER = re.compile(r"\bvllm_server: |getfixturevalue\(\"vllm_server\"\)")


GROUPED_TEST = """
import os, time
def test_{n}(): time.sleep(0.3); open("ran", "a").write("{file} " + os.environ["PYTEST_XDIST_WORKER"] + "\\n")
"""


def test_two_workers_run_each_file_on_one_worker(tmp_path: Path) -> None:
    """Each file's tests on one worker, the files spread over both (xdist's own loadgroup gave every test
    a group of its own under pytest 9.2: each worker built every module and session fixture)."""
    (tmp_path / "conftest.py").write_text("from batch_assets_tests.conftest import pytest_xdist_make_scheduler\n")
    for file in ("test_one", "test_two", "test_three"):
        (tmp_path / f"{file}.py").write_text("".join(GROUPED_TEST.format(n=n, file=file) for n in range(4)))
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    command = [sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-p", "no:cacheprovider", "-q"]
    done = subprocess.run([*command, str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:]
    ran = [line.split() for line in (tmp_path / "ran").read_text().splitlines()]
    workers = {
        file: {worker for name, worker in ran if name == file} for file in ("test_one", "test_two", "test_three")
    }
    assert len(ran) == 12 and all(len(used) == 1 for used in workers.values()), ran
    assert set().union(*workers.values()) == {"gw0", "gw1"}, ran


def test_the_files_that_share_the_vllm_server_are_one_group_and_the_others_their_own() -> None:
    files = sorted(TESTS.glob("test_*.py"))
    users = [path.name for path in files if USES_VLLM_SERVER.search(path.read_text(encoding="utf-8"))]
    assert users == ["test_batch_api_server.py", "test_openai_engine.py", "test_wheel_install.py"]
    assert {xdist_group(TESTS / name) for name in users} == {"vllm_server"}
    others = [xdist_group(path) for path in files if path.name not in users]
    assert len(set(others)) == len(others) and "vllm_server" not in others


def waits_for_a_lock(pid: int) -> bool:
    """Whether process `pid` is blocked on a file lock (a `->` line of /proc/locks names the waiter)."""
    for line in Path("/proc/locks").read_text().splitlines():
        fields = line.split()
        if len(fields) > 5 and fields[1] == "->" and fields[5] == str(pid):
            return True
    return False


def test_a_worker_waits_for_the_tiny_model_another_builds_and_does_not_build_it_again(tmp_path: Path) -> None:
    cached = tmp_path / "tiny-test-model"
    env = {**os.environ, "BATCH_ASSETS_TEST_MODEL_CACHE": str(cached), "PYTHONPATH": str(REPO_ROOT)}
    code = "from batch_assets_tests.tiny_model import built_tiny_model; print(built_tiny_model())"
    with exclusive_file_lock(tmp_path / "tiny-test-model.lock"):  # this process is building it
        other = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 120
        while not waits_for_a_lock(other.pid):
            assert other.poll() is None, "the other worker did not wait for the build"
            assert time.monotonic() < deadline, "the other worker never asked for the build's lock"
            time.sleep(0.05)
        cached.mkdir()
        (cached / "model.safetensors").write_bytes(b"built by the first worker")
    output, _ = other.communicate(timeout=120)
    assert other.returncode == 0 and output.strip() == str(cached)
    assert (cached / "model.safetensors").read_bytes() == b"built by the first worker"
