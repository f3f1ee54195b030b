"""Golden files: vLLM's own answers that tests compare with, kept under batch_assets_tests/golden/.

A vLLM process costs a start and a model load per CI run, and its answers change only with what a
file's key covers: vLLM, torch and the CPU's vector instructions (kernels differ with them, and
near-ties can flip), plus what the caller names (weights, engine flags, requests). A key that does not
match runs vLLM again, with a warning (nothing is tested less); `make golden` writes the files anew.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

GOLDEN_DIR = Path(__file__).resolve().parent.parent / "golden"
WRITE_GOLDEN_ENV = "BATCH_ASSETS_WRITE_GOLDEN"
T = TypeVar("T")


def content_digest(folder: Path) -> str:
    """The folder's files (names and bytes), not its path: the same weights anywhere."""
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(folder)).encode())
        with path.open("rb") as handle:
            while chunk := handle.read(1 << 22):
                digest.update(chunk)
    return digest.hexdigest()


def versions() -> dict[str, str]:
    """What every golden file's key holds: vLLM's and torch's versions, and the CPU's vector instructions."""
    import torch
    import vllm

    return {"vllm": vllm.__version__, "torch": torch.__version__, "cpu": torch.backends.cpu.get_cpu_capability()}


def golden_file_key(identity: Any) -> str:
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()


def kept_or_made(name: str, identity: Any, make: Callable[[], T], *, field: str = "outputs", made_of: str) -> T:
    """The `field` of golden file `name` when its key is `identity`'s, else `make()` (written to the file
    under `BATCH_ASSETS_WRITE_GOLDEN`); `made_of` names what else the key covers, for the warning."""
    golden = GOLDEN_DIR / name
    key = golden_file_key(identity)
    writing = bool(os.environ.get(WRITE_GOLDEN_ENV))
    stored = json.loads(golden.read_text(encoding="utf-8")) if golden.exists() else {}
    if stored.get("key") == key and not writing:
        return stored[field]
    if not writing:
        # stacklevel 3: the warning names the test's call of the helper that called this.
        warnings.warn(f"{golden.name} was made for other versions, {made_of}: `make golden`", stacklevel=3)
    made = make()
    if writing:
        golden.parent.mkdir(exist_ok=True)
        golden.write_text(json.dumps({"key": key, field: made}, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    return made
