"""Engine kinds: which Dagster resource serves a task's `engine.kind`, and in which pool it runs.

Two kinds implement the engine contract (`pipeline/engine_contract.py`), so a task can use either
with no other change:

- `vllm` (`VLLMEngine`, resource key `llm_engine`, pool `gpu`): vLLM's async engine inside the
  run's process (the default).
- `openai` (`OpenAIEngine`, resource key `llm_endpoint`, pool `llm_endpoint`): any
  OpenAI-compatible server (chat completions; `/v1/embeddings` for embedding and similarity tasks),
  for tasks whose YAML says `engine.kind: openai`.

The asset never names an engine class: `ENGINE_KINDS[task.engine.kind]` gives the resource key,
pool and display name, and the resource under that key is the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from batch_assets.pipeline.engine_contract import Engine
from batch_assets.pipeline.task_spec import TaskSpec


@dataclass(frozen=True)
class EngineKind:
    resource_key: str
    pool: str  # the Dagster pool of the inference step
    display_name: str


# `gpu`: limit = runs per node (one run uses every GPU of its node); `llm_endpoint`: limit = runs the
# server may take at once.
ENGINE_KINDS: dict[str, EngineKind] = {
    "vllm": EngineKind("llm_engine", "gpu", "the vLLM engine"),
    "openai": EngineKind("llm_endpoint", "llm_endpoint", "an OpenAI-compatible endpoint"),
}


def engine_kind(task: TaskSpec) -> EngineKind:
    return ENGINE_KINDS[task.engine.kind]


def engine_for(resources: Any, task: TaskSpec) -> Engine:
    """The engine a task's assets run with: the resource registered for its `engine.kind`."""
    return getattr(resources, engine_kind(task).resource_key)
