"""One step's use of the process's vLLM engine: started on its first request, not before; at the
session's end kept warm for the next step or shut down before the step frees its pool slot
(vllm_lifecycle.py says when each applies).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from batch_assets.engines.engine_figures import EngineFigures, Mark
from batch_assets.engines.vllm_async_engine import AsyncEngine
from batch_assets.engines.vllm_lifecycle import PROCESS_ENGINE, PROCESS_ENGINES, process_engine_for
from batch_assets.engines.vllm_requests import pooling_params, sampling_params_for
from batch_assets.engines.vllm_settings import VLLMSettings
from batch_assets.pipeline.engine_contract import Generation, Prompt
from batch_assets.pipeline.task_spec import OutputSpec, SamplingSpec, TaskSpec


class VLLMSession:
    """One step's use of the process engine: started on the first request, not before."""

    def __init__(self, task: TaskSpec, settings: VLLMSettings, log: Callable[[str], None]) -> None:
        self._task, self._settings, self._log = task, settings, log
        # Off by the resource's `structured_outputs`, and for an embedding model (nothing to constrain).
        self._structured = settings.structured_outputs
        self._engine: AsyncEngine | None = None
        self.started_here = False
        self.start_seconds = 0.0
        self._default_params = None
        # The engine's figures from this session's first stream on (a warm engine ran others before).
        self._figures: tuple[EngineFigures, Mark] | None = None

    def start(self, requests: int = 0) -> None:
        if self._engine is not None:
            return
        started = time.monotonic()
        self._engine, self.started_here = process_engine_for(self._settings).get(self._settings, requests)
        if self._figures is None:
            self._figures = (self._engine.figures, self._engine.figures.mark())
        if self.started_here:
            self.start_seconds = time.monotonic() - started
            self._log(f"started the vLLM engine in {self.start_seconds:.1f} s")

    def _params_for(self, prompt: Prompt):
        if prompt.sampling is None and prompt.output is None:
            if self._default_params is None:
                self._default_params = self._params(self._task.sampling, self._task.output)
            return self._default_params
        return self._params(prompt.sampling or self._task.sampling, prompt.output or self._task.output)

    def _params(self, sampling: SamplingSpec, output: OutputSpec):
        if self._settings.runner == "pooling":
            return pooling_params()
        # Confidence is a probability among the outputs the constraint allows: only asked for with it.
        logprobs = self._structured and output.has_confidence
        return sampling_params_for(sampling, output if self._structured else None, logprobs=logprobs)

    def stream(self, prompts: Iterable[Prompt]) -> Iterator[tuple[int, Generation]]:
        self.start()
        assert self._engine is not None  # start() sets it
        return self._let_go_after(self._engine.stream(prompts, self._params_for, self._settings.lora_request()))

    def _let_go_after(self, results: Iterator[tuple[int, Generation]]) -> Iterator[tuple[int, Generation]]:
        yield from results
        # Every prompt is answered. When no later step of the `keep_engine_warm` block wants the
        # engine (the last range of a `batch-assets run`), it shuts down now, in the background,
        # while the step stores its results and the run validates and checks them; a later stream
        # of this session would start one again.
        if PROCESS_ENGINE.keep_warm_depth and not PROCESS_ENGINE.wanted_later():
            self._engine = None
            PROCESS_ENGINES[self._settings.runner].shutdown_in_background()

    @property
    def metadata(self) -> dict[str, Any]:
        starts = PROCESS_ENGINES[self._settings.runner].starts
        figures = self._figures[0].since(self._figures[1]) if self._figures is not None else {}
        return {"engine_started_by_this_run": self.started_here, "engine_starts_in_process": starts, **figures}


@contextlib.contextmanager
def vllm_session(
    task: TaskSpec, settings: VLLMSettings, log: Callable[[str], None] = lambda message: None
) -> Iterator[VLLMSession]:
    session = VLLMSession(task, settings, log)
    process_engine = PROCESS_ENGINES[settings.runner]
    try:
        yield session
    finally:
        if PROCESS_ENGINE.keep_warm_depth and not _wanted_elsewhere(log):
            # A dead engine (its process killed, out of memory) is dropped, so the retry starts
            # a fresh one and resumes from the checkpoints; a live one stays for the next step.
            process_engine.shutdown_if_dead()
            if settings.on_gpu:
                # An engine stopping in the background still holds the device: a run that asks
                # for the slot a moment from now must find it gone. On a CPU the overlap stays.
                process_engine.wait_for_background_shutdown()
        else:
            # Freed while this step still holds the pool slot (vllm_lifecycle.py); a shutdown
            # begun in the background when the stream ended is waited for too.
            running, started = process_engine.running, time.monotonic()
            process_engine.shutdown()
            if running:
                seconds = time.monotonic() - started
                log(f"shut the vLLM engine down in {seconds:.1f} s, before freeing the pool slot")


def _wanted_elsewhere(log: Callable[[str], None]) -> bool:
    """Asks `keep_engine_warm`'s question. No answer (the instance's database failed) keeps the engine
    for the next range: a step whose work is done should not fail on a question about the next one."""
    try:
        return PROCESS_ENGINE.wanted_elsewhere()
    except Exception as exc:
        log(f"could not tell whether another run waits for the engine's device ({exc}); keeping the engine")
        return False
