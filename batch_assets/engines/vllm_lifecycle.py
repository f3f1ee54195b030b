"""The process's vLLM engines: when they start, how long they stay warm, when they stop.

The engine is expensive to start (tens of seconds on a CPU, minutes for big GPU models), so it is
created lazily, when the first request needs it, and serves every partition of the step (a run over
a range of partitions starts it once). It is shut down when the step's session ends
(vllm_session.py): the step holds the `gpu` pool slot, and the next run's step may start its own
engine the moment the slot is freed, so an engine left running in this process until it exits
(after the run's other steps and checks) would still hold the GPU's memory and fail that start.
Inside a `keep_engine_warm()` block (one `batch-assets run`, the test session) it is kept across
steps and runs, unless another run waits for the pool, and shut down at the block's end; or, when
the block wants it for no later step (the last range of files of a `batch-assets run`), in the
background as soon as the stream has ended, while the run stores, validates and checks the results
(on a GPU the step waits for that shutdown before it frees the slot, as above). It is also replaced
when settings it does not serve are asked for (another model, a longer context:
`VLLMSettings.serves`), and dropped after it died.

Embedding and similarity tasks run an embedding model on vLLM's pooling runner (`runner="pooling"`):
a second engine of its own in the process (`POOLING_ENGINE`), so a run over tasks of both kinds
keeps each warm on a CPU (on a GPU one at a time: `process_engine_for`).

Engine processes die with the process that started them (a watcher process, reaper.py), so an
out-of-memory kill of the run does not leave a vLLM engine holding memory or a GPU. A start that
cannot succeed (too little /dev/shm, a KV cache larger than the free RAM) fails at once, naming the
setting to change.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import shutil
import threading
from collections.abc import Callable, Iterator

from batch_assets.engines.vllm_async_engine import AsyncEngine
from batch_assets.engines.vllm_settings import VLLMSettings, memory_hint
from batch_assets.pipeline.engine_contract import EngineStartError

log = logging.getLogger(__name__)

# On a CPU in eager mode nothing of the model is compiled, yet vLLM's sampler compiles its token-rank
# counter (`vllm/v1/sample/ops/logprobs.py`, `torch.compile` with inductor) at the first request that
# asks for log-probabilities, which every choices and regex task does (the labels' `confidence`):
# ~20 s of g++ on 2 cores in a fresh container or pod, ~4 s with the compile cache an earlier engine
# left in /tmp. Run eagerly the counter costs ~45 ms per 256-sequence step against ~4 ms compiled
# (2 cores, a 49,152-token vocabulary: ~0.16 ms per generated token; BENCHMARKS.md, "The tiny model's
# gap"). A stream of this many requests or more repays the compile; a smaller one (a demo, a test, a
# small file) runs the counter eagerly and starts at once.
COMPILE_SAMPLER_FROM_REQUESTS = 10_000


def engine_process_environment(settings: VLLMSettings, requests: int = 0) -> dict[str, str]:
    """Environment variables the engine's processes get on top of this process's, for an engine
    started by a stream of `requests` requests.

    On a CPU in eager mode, below `COMPILE_SAMPLER_FROM_REQUESTS` requests dynamo is switched off
    (`TORCHDYNAMO_DISABLE=1`): vLLM's sampler then counts ranks eagerly instead of compiling. On a
    GPU, with `enforce_eager: false` (vLLM compiles the model), for a larger stream, or when the
    user set the variable, nothing is changed.

    Workers are spawned, never forked (vLLM forks them on a GPU when CUDA is not yet initialised): a
    spawned process carries the reaper's token in its environment from its first instruction, so
    it is found and killed even when the run dies a moment after starting it (reaper.py).
    """
    environment = {} if "VLLM_WORKER_MULTIPROC_METHOD" in os.environ else {"VLLM_WORKER_MULTIPROC_METHOD": "spawn"}
    if (
        settings.on_gpu
        or not settings.vllm_args.get("enforce_eager")
        or "TORCHDYNAMO_DISABLE" in os.environ
        or requests >= COMPILE_SAMPLER_FROM_REQUESTS
    ):
        return environment
    return {**environment, "TORCHDYNAMO_DISABLE": "1"}


class ProcessEngine:
    """At most one live engine per process, replaced when settings it does not serve are asked for."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._engine: AsyncEngine | None = None
        self.starts = 0
        self.keep_warm_depth = 0
        # Asked when a step's session ends inside `keep_engine_warm`: True shuts the engine down all
        # the same (another process waits for the pool slot the step is about to free).
        self.wanted_elsewhere: Callable[[], bool] = lambda: False
        # Asked too when a step's stream has ended: False when nothing after the step will use the
        # engine, which then shuts down in the background (`shutdown_in_background`).
        self.wanted_later: Callable[[], bool] = lambda: False
        self._stopping: threading.Thread | None = None  # a shutdown in the background

    def get(self, settings: VLLMSettings, requests: int = 0) -> tuple[AsyncEngine, bool]:
        """The engine for `settings` (a warm one that serves them, `VLLMSettings.serves`), and whether
        this call started it (for a stream of `requests` requests: `engine_process_environment`)."""
        with self._lock:
            if self._engine is not None and self._engine.settings.serves(settings) and not self._engine.dead:
                return self._engine, False
            self._shutdown_locked()
            self._engine = start_engine(settings, requests)
            self.starts += 1
            return self._engine, True

    @property
    def running(self) -> bool:
        return self._engine is not None

    def shutdown(self) -> None:
        with self._lock:
            self._shutdown_locked()

    def shutdown_if_dead(self) -> None:
        with self._lock:
            if self._engine is not None and self._engine.dead:
                self._shutdown_locked()

    def shutdown_in_background(self) -> None:
        """Shut the engine down on a thread of its own, so the run's later steps need not wait for
        it (vLLM's shutdown waits ~5 s for its processes to exit); the next `get` or `shutdown`
        waits for it to finish, so this process never starts a second engine beside a stopping one
        (and on a GPU the step waits for it before freeing the pool slot)."""
        with self._lock:
            engine, self._engine = self._engine, None
            if engine is not None:
                self._join_stopping()
                self._stopping = threading.Thread(target=engine.shutdown, name="vllm-engine-shutdown", daemon=True)
                self._stopping.start()

    def wait_for_background_shutdown(self) -> None:
        with self._lock:
            self._join_stopping()

    def _shutdown_locked(self) -> None:
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.shutdown()
        self._join_stopping()

    def _join_stopping(self) -> None:
        if self._stopping is not None:
            self._stopping.join()
            self._stopping = None


# One engine per runner and process: a chat model for generated labels, an embedding model for
# embedding and similarity tasks (a range of tasks of both kinds keeps each warm).
PROCESS_ENGINE = ProcessEngine()
POOLING_ENGINE = ProcessEngine()
PROCESS_ENGINES = {"generate": PROCESS_ENGINE, "pooling": POOLING_ENGINE}


def process_engine_for(settings: VLLMSettings) -> ProcessEngine:
    """The process's engine of this runner. On a GPU the other runner's engine is shut down first:
    each takes `gpu_memory_utilization` of the device, and vLLM refuses to start a second one in
    what the first leaves; on a CPU both stay warm (their KV caches are set in GiB)."""
    if settings.on_gpu:
        for runner, engine in PROCESS_ENGINES.items():
            if runner != settings.runner:
                engine.shutdown()
    return PROCESS_ENGINES[settings.runner]


def shutdown_engines() -> None:
    """Shut down every engine of this process (chat and embedding)."""
    for engine in PROCESS_ENGINES.values():
        engine.shutdown()


atexit.register(shutdown_engines)


@contextlib.contextmanager
def keep_engine_warm(
    wanted_elsewhere: Callable[[], bool] = lambda: False, wanted_later: Callable[[], bool] = lambda: True
) -> Iterator[None]:
    """Reuse one engine for every step and run inside this block, and shut it down at its end
    (without the block each step's session shuts it down).

    `wanted_elsewhere` is asked when a step's session ends: True shuts the engine down then, as
    without the block, because another process is waiting for the device (the CLI asks whether a
    step of another run waits for the `gpu` pool slot this step is about to free).

    `wanted_later` is asked when a step's stream of requests has ended: False (and no enclosing
    block wants it either) means no later step of the block will use the engine (the CLI's last
    range of files), so it shuts down in the background while the step stores its results and the
    run validates and checks them; the block's end only waits for what is left of that."""
    PROCESS_ENGINE.keep_warm_depth += 1
    outer, PROCESS_ENGINE.wanted_elsewhere = PROCESS_ENGINE.wanted_elsewhere, wanted_elsewhere
    outer_later = PROCESS_ENGINE.wanted_later
    PROCESS_ENGINE.wanted_later = lambda: wanted_later() or outer_later()
    try:
        yield
    finally:
        PROCESS_ENGINE.keep_warm_depth -= 1
        PROCESS_ENGINE.wanted_elsewhere = outer
        PROCESS_ENGINE.wanted_later = outer_later
        if PROCESS_ENGINE.keep_warm_depth == 0:
            shutdown_engines()


def start_engine(settings: VLLMSettings, requests: int = 0) -> AsyncEngine:
    """A new engine for `settings`; one that cannot start fails with the cause and the setting to change."""
    if settings.kv_cache_memory_gib is not None and not settings.on_gpu:
        _check_cpu_memory(settings.kv_cache_memory_gib)
    environment = engine_process_environment(settings, requests)
    log.info("starting vLLM engine: %s, environment %s", settings.engine_args(), environment)
    try:
        return AsyncEngine(settings, environment)
    except Exception as exc:
        message = str(exc)
        lowered = message.lower()
        too_little_shm = shared_memory_shortage()
        if too_little_shm:
            raise EngineStartError(f"the vLLM engine failed to start for {settings.model}: {too_little_shm}") from exc
        if "memory" in lowered or "initialization failed" in lowered:
            # vLLM starts the engine in a child process; when that fails (out of memory is the
            # usual cause) only "Engine core initialization failed" reaches us, the cause is in its log.
            cause = (
                "ran out of memory"
                if "memory" in lowered
                else "failed (its log lines above give the cause; out of memory is the usual one)"
            )
            raise EngineStartError(
                f"the vLLM engine {cause} at start-up for {settings.model}: {message}\n{memory_hint(settings)}"
            ) from exc
        raise EngineStartError(f"the vLLM engine failed to start for {settings.model}: {message}") from exc


# vLLM's engine passes its work to the model's processes through a ring buffer in /dev/shm: 10 chunks
# (MessageQueue's default) of VLLM_MQ_MAX_CHUNK_BYTES_MB (16 by default), 160 MiB, checked by vLLM in
# the engine's child process, whose message does not reach the caller.
def shared_memory_needed() -> int:
    return 10 * int(os.environ.get("VLLM_MQ_MAX_CHUNK_BYTES_MB", "16")) << 20


def shared_memory_shortage(path: str = "/dev/shm") -> str | None:
    """Why the engine cannot start when /dev/shm is smaller than vLLM needs (Docker gives a container
    64 MiB), in the words of the setting to change; None when it is large enough or absent."""
    try:
        free = shutil.disk_usage(path).free
    except OSError:
        return None
    needed = shared_memory_needed()
    if free >= needed:
        return None
    return (
        f"{path} has {free >> 20} MiB free and vLLM's engine needs {needed >> 20} MiB there (not RAM: the "
        "shared memory of the container). Give it more: `docker run --shm-size=1g`, or in Kubernetes an "
        "emptyDir volume with `medium: Memory` mounted at /dev/shm."
    )


def _check_cpu_memory(kv_gib: float) -> None:
    """Fail in one second, not after a minute of engine start, when the KV cache cannot fit in RAM."""
    try:
        import psutil
    except ImportError:  # vLLM depends on psutil; without it vLLM's own check still runs
        return
    available_gib = psutil.virtual_memory().available / (1 << 30)
    if kv_gib > available_gib:
        raise EngineStartError(
            f"the vLLM engine would run out of memory at start-up: `kv_cache_memory_gib` is {kv_gib} GiB but only "
            f"{available_gib:.1f} GiB of RAM is available. Lower `kv_cache_memory_gib` in the task YAML's `engine:` "
            "section or the `llm_engine` resource config, or free memory held by other processes."
        )
