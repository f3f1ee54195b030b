"""batch_assets: offline LLM batch inference as a Dagster asset pipeline.

The component types (`batch_assets.TaskComponent`, `batch_assets.TaskPipelinesComponent`, in
lib/component.py) are loaded on first use: importing the pure core (`batch_assets.pipeline`) or
the command line does not import the Dagster pipeline.
"""

from __future__ import annotations

from typing import Any

COMPONENTS = ("TaskComponent", "TaskPipelinesComponent")


def __getattr__(name: str) -> Any:
    if name in COMPONENTS:
        from batch_assets.lib import component

        return getattr(component, name)
    raise AttributeError(f"module 'batch_assets' has no attribute {name!r}")


def __dir__() -> list[str]:
    # `dg` lists a registry module's component types by dir() and getattr().
    return sorted([*globals(), *COMPONENTS])
