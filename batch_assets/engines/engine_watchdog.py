"""Turn an engine process that dies mid-`generate` into an error instead of a hang.

vLLM runs the engine in a child process. When that process is killed (kill -9, the kernel's
out-of-memory killer), vLLM notices, marks the engine dead and shuts its client down, but a
`generate` call already waiting for outputs keeps waiting forever (seen with vLLM 0.32). While a
call runs, this watchdog checks once a second and, when the engine is dead, wakes the waiting call
with vLLM's own `EngineDeadError`, so the step fails, its checkpoints stay, and the retry starts a
fresh engine.
"""

import contextlib
import threading
from collections.abc import Iterator

_POLL_SECONDS = 1.0


@contextlib.contextmanager
def fail_if_engine_dies(llm) -> Iterator[None]:
    """Around a `vllm.LLM` call: raise EngineDeadError in it when the engine process dies."""
    client = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    resources = getattr(client, "resources", None)
    outputs = getattr(client, "outputs_queue", None)
    if resources is None or outputs is None or not hasattr(outputs, "put_nowait"):
        yield  # another vLLM layout: nothing to watch
        return
    done = threading.Event()

    def watch() -> None:
        while not done.wait(_POLL_SECONDS):
            if getattr(resources, "engine_dead", False):
                from vllm.v1.engine.exceptions import EngineDeadError

                outputs.put_nowait(EngineDeadError())
                return

    watcher = threading.Thread(target=watch, name="batch-assets-engine-watchdog", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()
