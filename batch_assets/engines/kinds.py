"""Engine kinds: which Dagster resource serves a task's `engine.kind`, and in which pool it runs.

Three kinds implement the engine contract (`pipeline/engine_contract.py`), so a task can use any
with no other change:

- `vllm` (`VLLMEngine`, resource key `llm_engine`, pool `gpu`): vLLM's async engine inside the
  run's process (the default).
- `openai` (`OpenAIEngine`, resource key `llm_endpoint`, pool `llm_endpoint`): any
  OpenAI-compatible server (chat completions; `/v1/embeddings` for embedding and similarity tasks),
  for tasks whose YAML says `engine.kind: openai`.
- `batch_api` (`BatchApiEngine`, resource key `batch_api`, pool `batch_api`): a provider's
  OpenAI-compatible Batch API (`/v1/files` + `/v1/batches`): half price, results within hours. Its
  step waits for the batch, so it has a pool of its own: a waiting batch never holds a `gpu` slot.

The asset never names an engine class: `ENGINE_KINDS[task.engine.kind]` gives the resource key,
pool and display name, and the resource under that key is the engine. That engine also decides the
task's model and settings (`resolve_settings`): the code versions, the model check and
`batch-assets tasks` ask it, as the run does.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from batch_assets.pipeline.cascade.labels import teacher_task
from batch_assets.pipeline.engine_contract import Engine, ResolvedSettings
from batch_assets.pipeline.task_spec import TaskSpec


@dataclass(frozen=True)
class EngineKind:
    resource_key: str
    pool: str  # the Dagster pool of the inference step
    display_name: str
    # The engine keeps the batches it submitted (`session(..., records=...)`, storage/batch_records.py).
    keeps_batch_records: bool = False


# `gpu`: limit = runs per node (one run uses every GPU of its node); `llm_endpoint`: limit = runs the
# server may take at once; `batch_api`: limit = runs waiting for batches at once (each holds a run
# process, no GPU).
ENGINE_KINDS: dict[str, EngineKind] = {
    "vllm": EngineKind("llm_engine", "gpu", "the vLLM engine"),
    "openai": EngineKind("llm_endpoint", "llm_endpoint", "an OpenAI-compatible endpoint"),
    "batch_api": EngineKind("batch_api", "batch_api", "an OpenAI-compatible Batch API", keeps_batch_records=True),
}


def engine_kind(task: TaskSpec) -> EngineKind:
    return ENGINE_KINDS[task.engine.kind]


def engine_for(resources: Any, task: TaskSpec) -> Engine:
    """The engine a task's assets run with: the resource registered for its `engine.kind`."""
    return getattr(resources, engine_kind(task).resource_key)


def default_engines() -> dict[str, Any]:
    """The engine of each kind, by resource key, when none is configured (Dagster resources)."""
    from batch_assets.engines.batch_api_engine import BatchApiEngine
    from batch_assets.engines.openai_engine import OpenAIEngine
    from batch_assets.engines.vllm_engine import VLLMEngine

    return {
        ENGINE_KINDS["vllm"].resource_key: VLLMEngine(),
        ENGINE_KINDS["openai"].resource_key: OpenAIEngine(),
        ENGINE_KINDS["batch_api"].resource_key: BatchApiEngine(),
    }


def resolve_settings(task: TaskSpec, engines: Mapping[str, Any] | None = None) -> ResolvedSettings:
    """The task's settings as the engine serving it decides them; `engines`: by resource key (a
    `Definitions`' resources), else `default_engines()`. Raises `TaskSpecError` for settings that do
    not fit the model it chose."""
    engine: Engine = (default_engines() if engines is None else engines)[engine_kind(task).resource_key]
    resolved = engine.resolve(task)
    if task.output.chat_teacher:
        # The chat teacher runs on the same engine kind: resolved as its own chat task would be.
        resolved = replace(resolved, teacher=engine.resolve(teacher_task(task)))
    return resolved
