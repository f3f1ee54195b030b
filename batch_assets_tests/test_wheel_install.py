"""The wheel, installed outside the checkout as the Docker image installs it, carries everything the
code location and the CLI load: every shipped task's four assets and drops sensor, the instance
template, the sample drops.

The wheel goes into a fresh virtual environment whose only other path is this venv's site-packages,
added by a `.pth` line: Python does not process the `.pth` files of a directory added that way, so
the editable install of the checkout is invisible there and `batch_assets` can only come from the
wheel (the test asserts where it was imported from).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

from batch_assets.pipeline.task_spec import TaskSpec
from batch_assets_tests.support import REPO_ROOT

pytestmark = pytest.mark.slow

SHIPPED_TASKS = sorted(path.stem for path in (REPO_ROOT / "batch_assets" / "tasks").glob("*.yaml"))
# What a checkout holds that is no part of the source tree; some of it (the Hypothesis database, the
# screenshots, a Dagster home) another test may be writing while this one copies the tree.
NOT_SOURCE = shutil.ignore_patterns(
    ".git", ".venv", "data", ".dagster_home", "build", "dist", "*.egg-info", "__pycache__", ".*_cache",
    ".screenshots", ".hypothesis", "site",
)  # fmt: skip

LOAD_DEFINITIONS = """
import json, batch_assets
from batch_assets.definitions import defs
from batch_assets.runtime.instance import prepare_instance
home = prepare_instance()
graph = defs.resolve_asset_graph()
print(json.dumps({
    "package": batch_assets.__file__,
    "assets": sorted(key.to_user_string() for key in graph.get_all_asset_keys()),
    "sensors": sorted(sensor.name for sensor in defs.sensors or []),
    "instance_config": (home / "dagster.yaml").read_text(),
}))
"""


@pytest.fixture(scope="module")
def installed_wheel(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """(python of a fresh environment with only the wheel as batch_assets, its environment)."""
    root = tmp_path_factory.mktemp("wheel")
    source = root / "source"
    shutil.copytree(REPO_ROOT, source, ignore=NOT_SOURCE, symlinks=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", root / "dist", source],
        check=True,
    )
    (wheel,) = (root / "dist").glob("batch_assets-*.whl")
    environment = root / "env"
    venv.create(environment, with_pip=False, symlinks=True)
    python = environment / "bin" / "python"
    site_packages = Path(
        subprocess.run(
            [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    (site_packages / "dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", site_packages, wheel], check=True
    )
    env = {
        **{name: value for name, value in os.environ.items() if name != "PYTHONPATH"},
        "DAGSTER_HOME": str(root / "home"),
        "BATCH_ASSETS_DATA": str(root / "data"),
    }
    env.pop("BATCH_ASSETS_TASKS_DIR", None)
    return python, env


def test_wheel_loads_every_shipped_task(installed_wheel: tuple[Path, dict[str, str]], tmp_path: Path) -> None:
    python, env = installed_wheel
    result = subprocess.run([python, "-c", LOAD_DEFINITIONS], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    loaded = json.loads(result.stdout.strip().splitlines()[-1])

    assert not loaded["package"].startswith(str(REPO_ROOT)), loaded["package"]
    assert SHIPPED_TASKS == [
        "answers",
        "document_qa",
        "embeddings",
        "industry",
        "industry_cascade",
        "industry_similarity",
        "openai_batch",
        "openai_batch_embeddings",
        "sentiment",
    ]
    expected_assets = sorted(
        [
            *(
                f"{task}/{asset}"
                for task in SHIPPED_TASKS
                for asset in ("raw_prompts", "formatted_prompts", "inference_outputs", "validated_labels")
            ),
            "industry_cascade/label_model",  # the cascade's student, unpartitioned
        ]
    )
    assert loaded["assets"] == expected_assets
    assert {f"{task}_drops_sensor" for task in SHIPPED_TASKS} <= set(loaded["sensors"])
    # The instance the installed package sets up is the one a checkout sets up (pools, run monitoring).
    template = (REPO_ROOT / "batch_assets" / "lib" / "dagster.yaml").read_text()
    assert loaded["instance_config"] == template
    assert "granularity: op" in loaded["instance_config"]


def test_installed_cli_lists_tasks_and_ships_samples(
    installed_wheel: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    python, env = installed_wheel
    result = subprocess.run(
        [python, "-m", "batch_assets.cli", "tasks"], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    listed = sorted(line.split("\t")[0] for line in result.stdout.splitlines())
    assert listed == SHIPPED_TASKS
    samples = subprocess.run(
        [
            python,
            "-c",
            "from batch_assets.lib.runner import SAMPLES_DIR; print(sorted(p.name for p in SAMPLES_DIR.iterdir()))",
        ],
        cwd=tmp_path,
        env=env,
        check=True,
        capture_output=True,
        text=True,
    )
    for task in SHIPPED_TASKS:
        assert f"'{task}'" in samples.stdout


# A user's own dg project, as `create-dagster project` lays it out: no Python of theirs for a task.
USER_PROJECT_FILES = {
    "pyproject.toml": """\
[project]
name = "my_project"
version = "0.1.0"
dependencies = ["batch-assets"]

[tool.dg]
directory_type = "project"

[tool.dg.project]
root_module = "my_project"
""",
    "src/my_project/__init__.py": "",
    "src/my_project/defs/__init__.py": "",
    "src/my_project/definitions.py": """\
from pathlib import Path

import dagster as dg


@dg.definitions
def defs() -> dg.Definitions:
    return dg.load_from_defs_folder(path_within_project=Path(__file__).parent)
""",
}


def _dg(python: Path, project: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [python, "-m", "dagster_dg_cli.cli", *args], cwd=project, env=env, capture_output=True, text=True
    )


def test_a_users_dg_project_adds_a_task_with_no_python(
    installed_wheel: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    """`dg scaffold defs batch_assets.TaskComponent tickets`, an edit, `dg check defs` (a bad value named
    with its line), `dg list defs` (the task's four assets), from the wheel: the component type is
    found through the package's `dagster_dg_cli.registry_modules` entry point."""
    python, env = installed_wheel
    project = tmp_path / "my_project"
    for name, text in USER_PROJECT_FILES.items():
        (project / name).parent.mkdir(parents=True, exist_ok=True)
        (project / name).write_text(text)
    # dg runs the project's `.venv`; PYTHONPATH stands for the editable install of the user's project.
    (project / ".venv").symlink_to(python.parent.parent)
    env = {**env, "PYTHONPATH": str(project / "src"), "VIRTUAL_ENV": str(project / ".venv"), "NO_COLOR": "1"}

    # The schema editors get (`dg utils configure-editor` installs the same) has the task's fields.
    schema = _dg(
        python, project, env, "utils", "inspect-component", "batch_assets.TaskComponent", "--defs-yaml-json-schema"
    )
    assert schema.returncode == 0, schema.stderr
    attributes = json.loads(schema.stdout)["properties"]["attributes"]
    assert attributes["properties"] == TaskSpec.model_json_schema()["properties"]

    scaffolded = _dg(python, project, env, "scaffold", "defs", "batch_assets.TaskComponent", "tickets")
    assert scaffolded.returncode == 0, scaffolded.stderr
    defs_yaml = project / "src" / "my_project" / "defs" / "tickets" / "defs.yaml"
    text = defs_yaml.read_text()
    assert "type: batch_assets.TaskComponent" in text
    assert "name: tickets" in text
    defs_yaml.write_text(text.replace("[positive, negative, neutral]", "[positive, negative, neutral, mixed]"))

    checked = _dg(python, project, env, "check", "defs")
    assert checked.returncode == 0, checked.stdout + checked.stderr

    listed_defs = _dg(python, project, env, "list", "defs", "--json")
    assert listed_defs.returncode == 0, listed_defs.stderr
    assets = sorted(asset["asset_key"] for asset in json.loads(listed_defs.stdout)["assets"])
    expected = ["formatted_prompts", "inference_outputs", "raw_prompts", "validated_labels"]
    assert assets == [f"tickets/{asset}" for asset in expected]

    defs_yaml.write_text(text.replace("max_tokens: 10", "max_tokens: many"))
    line = next(number for number, line in enumerate(text.splitlines(), 1) if "max_tokens:" in line)
    bad = _dg(python, project, env, "check", "defs")
    assert bad.returncode != 0
    assert f"defs.yaml:{line}" in bad.stdout + bad.stderr
    assert "max_tokens" in bad.stdout + bad.stderr
