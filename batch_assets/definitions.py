"""The code location: the component tree under `batch_assets/defs/` (`dg` project layout).

Load with `dg dev` (`make ui`) from the repo root (workspace.yaml points here). What it builds per
task is in `lib/task_definitions.py`; `build_definitions` there makes a code location of
other tasks or engines.
"""

from __future__ import annotations

import importlib
import warnings
from pathlib import Path

import dagster as dg

from batch_assets.runtime.pool_waits import install_pool_workarounds

__all__ = ["defs"]

# Dagster's own component loader builds code references and loads modules with beta/preview APIs
# and warns about each; nothing in this project can act on those notices.
warnings.filterwarnings("ignore", category=dg.BetaWarning)
warnings.filterwarnings("ignore", category=dg.PreviewWarning)

PROJECT_ROOT = Path(__file__).resolve().parent.parent


def load_project_defs() -> dg.Definitions:
    """The code location: the component tree under `batch_assets/defs/` (`dg` project layout).

    Loaded from the installed package, so it works without the repo's pyproject.toml (a Docker image)."""
    defs_module = importlib.import_module("batch_assets.defs")
    return dg.ComponentTree.from_module(defs_module=defs_module, project_root=PROJECT_ROOT).build_defs()


# This module is our code location's entry point (code servers and run workers load it): the runs it
# executes wait for the `gpu` pool asleep and never share its slot (runtime/pool_waits.py). Users'
# own code locations import `batch_assets.lib.task_definitions.build_definitions`, which patches nothing.
install_pool_workarounds()
defs = load_project_defs()
