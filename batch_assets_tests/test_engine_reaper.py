"""The vLLM engine's processes die with the process that started them, at any moment of its life.

Issue 29.4: a `batch-assets run` killed with SIGKILL while its engine was starting left the engine
core and its worker running, reparented to init (the watcher was told about them only once
`AsyncLLM.from_engine_args` had returned). Start-up is when an out-of-memory kill comes. Real
processes, the tiny model, SIGKILL to the main process alone, as the out-of-memory killer sends it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import dagster as dg
import psutil
import pytest

from batch_assets_tests.support import CLI, REPO_ROOT, open_instance

# The slow tier (`make test-fast` leaves it out): every test starts vLLM engine processes and kills them.
pytestmark = pytest.mark.slow


# Starts the engine in this process and, once the engine's first process exists, a child of its
# own that is not the engine's (it inherits the engine's environment all the same): the watcher
# must leave it alone.
ENGINE_STARTER = textwrap.dedent(
    """
    import subprocess, sys, threading, time

    import psutil

    from batch_assets.engines.vllm_engine import VLLMEngine
    from batch_assets.engines.vllm_lifecycle import PROCESS_ENGINE
    from batch_assets.pipeline.task_spec import load_task_specs

    def spawned_yet():
        for child in psutil.Process().children():
            try:
                if "--multiprocessing-fork" in " ".join(child.cmdline()):
                    return True
            except psutil.Error:
                pass
        return False

    def bystander():
        while not spawned_yet():
            time.sleep(0.05)
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        print("bystander", child.pid, flush=True)

    if __name__ == "__main__":
        task = next(task for task in load_task_specs() if task.name == "sentiment")
        threading.Thread(target=bystander, daemon=True).start()
        PROCESS_ENGINE.get(VLLMEngine().settings(task))
        print("engine started", flush=True)
        time.sleep(600)
    """
)


def engine_core(parent: psutil.Process) -> psutil.Process | None:
    """The engine core among `parent`'s descendants, once vLLM has titled it."""
    for process in parent.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if "EngineCore" in " ".join(process.cmdline()):
                return process
    return None


def wait_for_engine_core(parent: subprocess.Popen, log: Path) -> psutil.Process:
    deadline = time.monotonic() + 300
    while True:
        assert parent.poll() is None, f"the process ended before its engine core started:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        core = engine_core(psutil.Process(parent.pid))
        if core is not None:
            return core
        time.sleep(0.05)


def kill_main_process_only(process: subprocess.Popen) -> list[psutil.Process]:
    """SIGKILL to the main process (not its group); what it had started, as it was at that moment."""
    descendants = psutil.Process(process.pid).children(recursive=True)
    os.kill(process.pid, signal.SIGKILL)
    process.wait(timeout=30)
    return descendants


def survivors(processes: list[psutil.Process], timeout: float) -> list[str]:
    _, alive = psutil.wait_procs(processes, timeout=timeout)
    described = []
    for process in alive:
        with contextlib.suppress(psutil.Error):
            described.append(f"{process.pid} {' '.join(process.cmdline())[:80]}")
    return described


def kill_group(process: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)


@pytest.fixture
def engine_env(tiny_model_path: str, tmp_path: Path) -> dict[str, str]:
    return {
        **os.environ,
        "BATCH_ASSETS_MODEL": tiny_model_path,
        "BATCH_ASSETS_DATA": str(tmp_path / "data"),
        "DAGSTER_HOME": str(tmp_path / "home"),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])),
    }


def test_engine_killed_while_starting_dies_and_other_children_live(engine_env, tmp_path: Path) -> None:
    log = tmp_path / "starter.log"
    script = tmp_path / "start_engine.py"
    script.write_text(ENGINE_STARTER)
    with log.open("wb") as out:
        starter = subprocess.Popen(
            [sys.executable, str(script)], env=engine_env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        core = wait_for_engine_core(starter, log)
        deadline = time.monotonic() + 60
        while "bystander " not in log.read_text():
            assert time.monotonic() < deadline and starter.poll() is None, log.read_text()[-3000:]
            time.sleep(0.05)
        started = kill_main_process_only(starter)
        # Killed while starting: the engine had not been handed over yet.
        assert "engine started" not in log.read_text(), "the engine finished starting before the kill"
        bystander_pid = int(log.read_text().split("bystander ")[1].split()[0])
        engine = [process for process in started if process.pid != bystander_pid]
        assert core.pid in {process.pid for process in engine}
        alive = survivors(engine, timeout=15)
        assert alive == [], "engine processes outlived the kill:\n" + "\n".join(alive)
        # The child that is not the engine's lives on.
        assert psutil.Process(bystander_pid).is_running()
        assert psutil.Process(bystander_pid).status() != psutil.STATUS_ZOMBIE
    finally:
        kill_group(starter)


def test_batch_assets_run_killed_while_its_engine_starts_leaves_no_engine(engine_env, tmp_path: Path) -> None:
    """The issue's case: `batch-assets run` itself, killed once its engine core exists."""
    posts = tmp_path / "posts.jsonl"
    posts.write_text('{"text": "the delivery was late"}\n{"text": "great support"}\n')
    log = tmp_path / "cli.log"
    with log.open("wb") as out:
        cli = subprocess.Popen(
            [CLI, "run", "sentiment", str(posts)],
            env=engine_env,
            cwd=tmp_path,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        wait_for_engine_core(cli, log)
        started = kill_main_process_only(cli)
        alive = survivors(started, timeout=15)
        assert alive == [], "engine processes outlived the kill:\n" + "\n".join(alive)
        # The kill came before the engine had started: the run never got to say it had.
        with open_instance(tmp_path / "home") as instance:
            [run] = instance.get_runs()
            messages = [entry.message for entry in instance.all_logs(run.run_id)]
            assert run.status == dg.DagsterRunStatus.STARTED
            assert not any("started the vLLM engine" in message for message in messages), messages
    finally:
        kill_group(cli)
