"""A code location for runs on Ray without a model's cost: every task of the tasks folder
(`BATCH_ASSETS_TASKS_DIR`) on the zero-cost engine (bench/zero_cost_engine.py), each answer paced by
`BATCH_ASSETS_PROMPT_SECONDS` (default 0), so that a run can be caught mid-inference.

The Ray test (batch_assets_tests/test_ray_runs.py) and bench/bench_ray.py point their workspace at it
(`python_file`); Dagster imports it in the code server and again in each run worker, the Ray job.
Everything but the engine's answers is the real pipeline: the job, its `dagster-ray/config` tag,
checkpoints, result cache, Dagster runs, the `ray_node_id` metadata.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from batch_assets.lib.task_definitions import build_definitions
from batch_assets.pipeline.engine_contract import Generation, Prompt
from batch_assets.pipeline.task_spec import TaskSpec

PACE_ENV = "BATCH_ASSETS_PROMPT_SECONDS"


def _zero_cost():
    """bench/zero_cost_engine.py by its path: this file is loaded by path, bench/ is no package."""
    path = Path(__file__).resolve().parent / "zero_cost_engine.py"
    spec = importlib.util.spec_from_file_location("zero_cost_engine", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


zero_cost = sys.modules.get("zero_cost_engine") or _zero_cost()


class PacedSession(zero_cost.ZeroCostSession):  # type: ignore[name-defined,misc]
    def stream(self, prompts: Iterable[Prompt]) -> Iterator[tuple[int, Generation]]:
        pause = float(os.environ.get(PACE_ENV, "0") or 0)
        for answer in super().stream(prompts):
            if pause:
                time.sleep(pause)
            yield answer


class PacedEngine(zero_cost.ZeroCostEngine):  # type: ignore[name-defined,misc]
    @contextlib.contextmanager
    def session(self, task: TaskSpec, settings, log: Callable[[str], None] = lambda message: None, **_):
        yield PacedSession(task)


defs = build_definitions(engine=PacedEngine())
