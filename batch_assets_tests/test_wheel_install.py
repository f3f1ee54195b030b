"""The wheel, installed outside the checkout as the Docker image installs it, carries everything the
code location and the CLI load: every shipped task's four assets and drops sensor, the instance
template, the sample drops; and a user's own dg project on that environment runs a task through
`batch-assets`, `dg launch` and `batch-assets ui` (docs/own-project.md).

The wheel goes into a fresh virtual environment whose only other path is this venv's site-packages,
added by a `.pth` line: Python does not process the `.pth` files of a directory added that way, so
the editable install of the checkout is invisible there and `batch_assets` can only come from the
wheel (the test asserts where it was imported from).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import time
import urllib.request
import venv
from pathlib import Path

import polars as pl
import pytest

from batch_assets_tests.support import REPO_ROOT, free_port, passed, stop_process_group, summary_lines

pytestmark = pytest.mark.slow

TASK_ASSETS = ("raw_prompts", "formatted_prompts", "inference_outputs", "validated_labels")
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
from batch_assets.lib.runner import SAMPLES_DIR
from batch_assets.runtime.instance import prepare_instance
home = prepare_instance()
graph = defs.resolve_asset_graph()
print(json.dumps({
    "package": batch_assets.__file__,
    "samples": sorted(path.name for path in SAMPLES_DIR.iterdir()),
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
    # The console scripts pip would install with the wheel (`--target` installs none): `batch-assets ui`
    # runs the `dg` next to its python.
    for script, module in (("dg", "dagster_dg_cli.cli"), ("batch-assets", "batch_assets.cli")):
        (environment / "bin" / script).write_text(f'#!/bin/sh\nexec "$(dirname "$0")/python" -m {module} "$@"\n')
        (environment / "bin" / script).chmod(0o755)
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
            *(f"{task}/{asset}" for task in SHIPPED_TASKS for asset in TASK_ASSETS),
            "industry_cascade/label_model",  # the cascade's student, unpartitioned
        ]
    )
    assert loaded["assets"] == expected_assets
    assert {f"{task}_drops_sensor" for task in SHIPPED_TASKS} <= set(loaded["sensors"])
    # The instance the installed package sets up is the one a checkout sets up (pools, run monitoring).
    template = (REPO_ROOT / "batch_assets" / "lib" / "dagster.yaml").read_text()
    assert loaded["instance_config"] == template
    assert "granularity: op" in loaded["instance_config"]
    # The sample drops `batch-assets demo` runs ship with it, one folder per task.
    assert set(SHIPPED_TASKS) <= set(loaded["samples"])


def test_installed_cli_lists_tasks(installed_wheel: tuple[Path, dict[str, str]], tmp_path: Path) -> None:
    python, env = installed_wheel
    result = subprocess.run(
        [python, "-m", "batch_assets.cli", "tasks"], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    listed = sorted(line.split("\t")[0] for line in result.stdout.splitlines())
    assert listed == SHIPPED_TASKS


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


def _user_project(python: Path, env: dict[str, str], folder: Path) -> tuple[Path, dict[str, str]]:
    """A user's dg project in `folder` on the wheel's environment, and the environment to run in it."""
    project = folder / "my_project"
    for name, text in USER_PROJECT_FILES.items():
        (project / name).parent.mkdir(parents=True, exist_ok=True)
        (project / name).write_text(text)
    # dg runs the project's `.venv`; PYTHONPATH stands for the editable install of the user's project.
    (project / ".venv").symlink_to(python.parent.parent)
    env = {**env, "PYTHONPATH": str(project / "src"), "VIRTUAL_ENV": str(project / ".venv"), "NO_COLOR": "1"}
    # The project's own data and home, as its commands pick them from its folder (docs/own-project.md).
    for name in ("BATCH_ASSETS_DATA", "DAGSTER_HOME"):
        env.pop(name)
    return project, {**env, "DAGSTER_HOME": str(project / ".dagster_home")}


OWN_PROJECT_PAGE = REPO_ROOT / "docs" / "own-project.md"
TICKETS_CSV = """\
ticket_id,customer,text
101,acme,The new dashboard is great
102,globex,I was charged twice and nobody answers
103,initech,How do I export my invoices?
"""
ASSET_KEYS_QUERY = "{ assetNodes { assetKey { path } } }"


def _docs_sample(marker: str) -> str:
    """The ```python block of docs/own-project.md whose marker line names `marker`: what users copy is what runs."""
    match = re.search(rf"^<!-- [^\n]*{re.escape(marker)}[^\n]* -->\n```python\n(.*?)^```$", _page(), re.M | re.S)
    assert match, f"docs/own-project.md has no sample marked {marker}"
    return match[1]


def _page() -> str:
    return OWN_PROJECT_PAGE.read_text(encoding="utf-8")


def _documented_label_columns() -> dict[str, str]:
    """The labels' schema as docs/own-project.md gives it: {column: polars type}, input columns left out."""
    section = _page().split("## The labels' schema", 1)[1].split("\n## ", 1)[0]
    return dict(re.findall(r"^\| `(\w+)` \| (\w+) \|", section, re.M))


def _served_asset_keys(python: Path, env: dict[str, str], folder: Path, log: Path) -> set[str]:
    """The asset keys `batch-assets ui`, started in `folder`, serves once its code location has loaded."""
    port = free_port()
    ui = subprocess.Popen(
        [python.parent / "batch-assets", "ui", "--port", str(port)],
        cwd=folder,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=log.open("w"),
        start_new_session=True,
    )
    try:
        return _asset_keys_from(port, ui, deadline_s=240)
    finally:
        stop_process_group(ui)


def _asset_keys_from(port: int, ui: subprocess.Popen, deadline_s: float) -> set[str]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/graphql",
        data=json.dumps({"query": ASSET_KEYS_QUERY}).encode(),
        headers={"Content-Type": "application/json"},
    )
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline and ui.poll() is None:
        with contextlib.suppress(OSError, ValueError):
            with urllib.request.urlopen(request, timeout=10) as response:
                nodes = json.load(response)["data"]["assetNodes"]
            if nodes:
                return {"/".join(node["assetKey"]["path"]) for node in nodes}
        time.sleep(2)
    raise AssertionError(f"no asset served on port {port} (exit status {ui.poll()})")


def test_a_users_dg_project_runs_a_task_feeds_its_asset_and_serves_the_ui(
    installed_wheel: tuple[Path, dict[str, str]], tmp_path: Path, tiny_model_path: str
) -> None:
    """Issue 49's walk, from the wheel in a dg project outside the checkout, with no Python of the user's
    for the task: `dg scaffold defs batch_assets.TaskComponent tickets` (found through the package's
    `dagster_dg_cli.registry_modules` entry point), an edit, `dg check defs`; `batch-assets run` from a
    folder inside the project labels a file with the project's task (the labels' columns and types are
    the documented ones); `dg launch --partition` materializes the docs' own asset joining them back to
    the table; `batch-assets ui` from there serves both; a bad value fails `dg check defs` naming its
    line. One engine start in all (the run's)."""
    python, env = installed_wheel
    project, env = _user_project(python, env, tmp_path)
    env["BATCH_ASSETS_MODEL"] = tiny_model_path

    scaffolded = _dg(python, project, env, "scaffold", "defs", "batch_assets.TaskComponent", "tickets")
    assert scaffolded.returncode == 0, scaffolded.stderr
    defs = project / "src" / "my_project" / "defs"
    text = (defs / "tickets" / "defs.yaml").read_text()
    assert "type: batch_assets.TaskComponent" in text
    assert "name: tickets" in text
    (defs / "tickets" / "defs.yaml").write_text(text.replace("[positive, negative,", "[positive, mixed, negative,"))
    (defs / "labelled_tickets.py").write_text(_docs_sample("labelled_tickets.py"))
    (project / "tickets.csv").write_text(TICKETS_CSV)
    checked = _dg(python, project, env, "check", "defs")
    assert checked.returncode == 0, checked.stdout + checked.stderr

    labels = _labels_of_a_run(python, env, defs)
    assert set(labels["label"]) <= {"positive", "mixed", "negative", "neutral"}

    # The partition `batch-assets run` added, launched by dg; the user's asset reads the labels.
    launched = _dg(python, project, env, "launch", "--assets", "labelled_tickets", "--partition", "tickets.csv")
    assert launched.returncode == 0, launched.stderr[-4000:]
    joined = pl.read_parquet(project / "data" / "storage" / "labelled_tickets" / "tickets.csv.parquet")
    assert joined["ticket_id"].to_list() == [101, 102, 103]
    assert joined["customer"].to_list() == ["acme", "globex", "initech"]
    assert joined["label"].to_list() == labels.sort("row_id")["label"].to_list()

    assert _served_asset_keys(python, env, defs, tmp_path / "ui.log") == {
        "labelled_tickets",
        *(f"tickets/{asset}" for asset in TASK_ASSETS),
    }

    (defs / "tickets" / "defs.yaml").write_text(text.replace("max_tokens: 10", "max_tokens: many"))
    line = next(number for number, line in enumerate(text.splitlines(), 1) if "max_tokens:" in line)
    bad = _dg(python, project, env, "check", "defs")
    assert bad.returncode != 0
    assert f"defs.yaml:{line}" in bad.stdout + bad.stderr
    assert "max_tokens" in bad.stdout + bad.stderr


def _labels_of_a_run(python: Path, env: dict[str, str], folder: Path) -> pl.DataFrame:
    """`batch-assets run tickets tickets.csv` from `folder` (in the project): its summary line, and
    the labels it stored in the project's data/, their columns those docs/own-project.md gives."""
    ran = subprocess.run(
        [python.parent / "batch-assets", "run", "tickets", "../../../tickets.csv"],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
    )
    lines = summary_lines(ran.stdout)
    assert ran.returncode == 0 and len(lines) == 1 and passed(lines[0], "tickets/tickets.csv"), ran.stdout + ran.stderr
    assert ": 3 rows" in lines[0]
    project = folder.parents[2]
    labels = pl.read_parquet(project / "data" / "storage" / "tickets" / "validated_labels" / "tickets.csv.parquet")
    documented = list(_documented_label_columns().items())
    # The input columns come after `source_line`, as read (CSV: text).
    expected = [*documented[:2], ("ticket_id", "String"), ("customer", "String"), ("text", "String"), *documented[2:]]
    assert [(name, str(dtype)) for name, dtype in labels.schema.items()] == expected
    return labels
