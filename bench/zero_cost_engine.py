"""An engine that costs nothing: the pipeline's own ceiling, with no model in the way.

`ZeroCostEngine` is the in-process vLLM engine resource (`VLLMEngine`: the same model, settings,
tokenizer and checkpoint fingerprint a real run has) whose session answers every prompt at once
with the task's first choice (for a task without choices, the text `x`) instead of starting vLLM.
Passed as the `llm_engine` resource to `build_definitions`, it runs a task through exactly the steps,
checkpoints, result cache and Dagster runs of `batch-assets run`; what a run then costs is the
pipeline's own work, the ceiling a fast engine (a GPU node) meets.

    from zero_cost_engine import ZeroCostEngine   # bench/ on sys.path
    definitions = build_definitions(engine=ZeroCostEngine())
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from batch_assets.engines.vllm_engine import VLLMEngine
from batch_assets.engines.vllm_settings import VLLMSettings
from batch_assets.pipeline.engine_contract import Generation, Prompt
from batch_assets.pipeline.task_spec import TaskSpec

# The log-probability of every answer: a confident label (the industry task's confidence check passes).
ANSWER_LOGPROB = -0.01


class ZeroCostSession:
    """Answers each prompt as it is asked for; nothing to start or stop."""

    started_here = False
    start_seconds = 0.0

    def __init__(self, task: TaskSpec) -> None:
        choices = task.output.choices
        self.answer = choices[0] if choices else "x"
        self.prompts_seen = 0

    def start(self, requests: int = 0) -> None:
        pass

    @property
    def metadata(self) -> dict[str, Any]:
        return {"engine": "zero-cost (bench/zero_cost_engine.py)"}

    def stream(self, prompts: Iterable[Prompt]) -> Iterator[tuple[int, Generation]]:
        answer = self.answer
        for position, prompt in enumerate(prompts):
            self.prompts_seen += 1
            yield position, Generation(answer, "stop", len(prompt), 1, ANSWER_LOGPROB)


class ZeroCostEngine(VLLMEngine):
    """`VLLMEngine` in everything but the session: no vLLM process, every answer at once."""

    @contextlib.contextmanager
    def session(  # type: ignore[override]  # the same contract; yields a session of its own
        self, task: TaskSpec, settings: VLLMSettings, log: Callable[[str], None] = lambda message: None
    ) -> Iterator[ZeroCostSession]:
        yield ZeroCostSession(task)
