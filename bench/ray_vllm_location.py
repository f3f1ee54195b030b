"""A code location of the tasks folder (`BATCH_ASSETS_TASKS_DIR`) on the real in-process vLLM engine, for
bench/bench_ray_data_llm.py's runs on Ray (loaded by path: bench/ is no package)."""

from __future__ import annotations

from batch_assets.lib.task_definitions import build_definitions

defs = build_definitions()
