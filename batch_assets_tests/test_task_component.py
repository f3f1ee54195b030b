"""A task as a Dagster component (`batch_assets.TaskComponent`, lib/component.py): its attributes are
the task file's fields, `dg scaffold` writes a working defs.yaml, a bad value names its line, and
`{{ env(...) }}` templates render. Loaded through Dagster's own component tree, in a temporary
defs folder (`create_defs_folder_sandbox`), as `dg` loads a project; no engine starts.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Iterator
from pathlib import Path

import dagster as dg
import pytest
from dagster.components.testing import DefsFolderSandbox, create_defs_folder_sandbox

import batch_assets
from batch_assets.lib.component import TaskComponent, TaskPipelinesComponent
from batch_assets.pipeline.task_spec import BUNDLED_TASKS_DIR, TaskSpec, load_task_spec
from batch_assets.runtime.run_recovery import RECOVERY_SENSOR_NAME

FOUR_ASSETS = ("formatted_prompts", "inference_outputs", "raw_prompts", "validated_labels")


@pytest.fixture
def sandbox() -> Iterator[DefsFolderSandbox]:
    with warnings.catch_warnings(), create_defs_folder_sandbox() as folder:
        # Dagster's component loader warns about its own beta APIs on every load.
        warnings.simplefilter("ignore", dg.BetaWarning)
        yield folder


def _load(sandbox: DefsFolderSandbox, path: Path) -> tuple[dg.Component, dg.Definitions]:
    with sandbox.load_component_and_build_defs(defs_path=path) as (component, defs):
        return component, defs


def _load_error(sandbox: DefsFolderSandbox, path: Path) -> str:
    """The innermost error of loading the component at `path` (Dagster wraps it in its tree's)."""
    with pytest.raises(Exception) as raised:
        _load(sandbox, path)
    error: BaseException = raised.value
    while error.__cause__ is not None:
        error = error.__cause__
    return str(error)


def _line_of(text: str, needle: str) -> int:
    (line,) = [number for number, line in enumerate(text.splitlines(), 1) if needle in line]
    return line


def test_the_attributes_schema_is_the_task_files() -> None:
    """The schema `dg` validates defs.yaml with and editors complete from is TaskSpec's, field by
    field and rule by rule: a setting added to TaskSpec is an attribute with nothing else to edit."""
    attributes = TaskComponent.get_model_cls()
    assert attributes is not None
    properties = attributes.model_json_schema()["properties"]
    assert properties == TaskSpec.model_json_schema()["properties"]
    # What a task file holds, section by section, and a nested setting's own schema.
    assert {"name", "input", "prompt", "output", "engine", "sampling", "checks", "runs"} <= set(properties)
    output = attributes.model_json_schema()["$defs"]["OutputSpec"]["properties"]
    assert {"kind", "choices", "method", "cascade", "calibrate"} <= set(output)
    assert attributes.model_json_schema()["required"] == ["name", "input", "output"]
    # `dg` finds the component types in the package named by our registry entry point.
    assert batch_assets.TaskComponent is TaskComponent
    assert batch_assets.TaskPipelinesComponent is TaskPipelinesComponent
    assert {"TaskComponent", "TaskPipelinesComponent"} <= set(dir(batch_assets))


def test_scaffolded_task_is_the_bundled_one_under_its_folder_name(sandbox: DefsFolderSandbox) -> None:
    path = sandbox.scaffold_component(TaskComponent, defs_path="tickets", scaffold_params={"like": "industry"})
    text = (path / "defs.yaml").read_text()
    assert text.startswith("type: batch_assets.lib.component.TaskComponent\n")
    assert "\n  name: tickets\n" in text
    assert "  # The bundled sample carries hand-made labels in this column" in text  # the comments come along

    component, defs = _load(sandbox, path)

    assert isinstance(component, TaskComponent)
    assert type(component.task) is TaskSpec
    bundled = load_task_spec(BUNDLED_TASKS_DIR / "industry.yaml")
    assert component.task.model_dump() == {**bundled.model_dump(), "name": "tickets"}
    assert component.task.engine.model_fields_set == bundled.engine.model_fields_set
    keys = sorted(key.to_user_string() for key in defs.resolve_asset_graph().get_all_asset_keys())
    assert keys == [f"tickets/{asset}" for asset in FOUR_ASSETS]
    assert {sensor.name for sensor in defs.sensors or []} == {
        "tickets_drops_sensor",
        "tickets_range_failure_sensor",
        RECOVERY_SENSOR_NAME,
    }
    assert sorted(job.name for job in defs.jobs or []) == ["tickets_pipeline", "tickets_split_file"]


def test_every_bundled_task_scaffolds_as_itself(sandbox: DefsFolderSandbox) -> None:
    """Dagster reads defs.yaml as YAML 1.1 (task files are read as 1.2): every bundled task, copied
    into a component, is the same task."""
    bundled = {path.stem: load_task_spec(path) for path in sorted(BUNDLED_TASKS_DIR.glob("*.yaml"))}
    for name in bundled:
        sandbox.scaffold_component(TaskComponent, defs_path=f"copy_of_{name}", scaffold_params={"like": name})
    with sandbox.build_component_tree() as tree:
        copies = {component.task.name: component.task for component in tree.get_all_components(TaskComponent)}
    assert copies == {
        f"copy_of_{name}": task.model_copy(update={"name": f"copy_of_{name}"}) for name, task in bundled.items()
    }


def test_a_bad_value_names_its_line_of_defs_yaml(sandbox: DefsFolderSandbox) -> None:
    path = sandbox.scaffold_component(TaskComponent, defs_path="posts")
    good = (path / "defs.yaml").read_text()

    # A rule over two settings (max_tokens against the longest choice) points at max_tokens' line.
    (path / "defs.yaml").write_text(good.replace("max_tokens: 10", "max_tokens: 3"))
    message = _load_error(sandbox, path)
    assert f"attributes.sampling.max_tokens at {path / 'defs.yaml'}:{_line_of(good, 'max_tokens:')}" in message
    assert "too small for the choice 'positive'" in message

    # A key the task does not have.
    (path / "defs.yaml").write_text(good.replace("  max_model_len: 1024", "  max_model_length: 1024"))
    message = _load_error(sandbox, path)
    assert f"attributes.engine.max_model_length at {path / 'defs.yaml'}:{_line_of(good, 'max_model_len')}" in message
    assert "Extra inputs are not permitted" in message


def test_env_templates_render_and_a_missing_variable_names_its_line(
    sandbox: DefsFolderSandbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = sandbox.scaffold_component(TaskComponent, defs_path="posts")
    templated = (
        (path / "defs.yaml").read_text().replace("max_model_len: 1024", "max_model_len: \"{{ env('POSTS_LEN') }}\"")
    )
    (path / "defs.yaml").write_text(templated)

    monkeypatch.setenv("POSTS_LEN", "2048")
    component, _ = _load(sandbox, path)
    assert isinstance(component, TaskComponent)
    assert component.task.engine.max_model_len == 2048

    monkeypatch.delenv("POSTS_LEN")
    message = _load_error(sandbox, path)
    assert f"attributes.engine.max_model_len at {path / 'defs.yaml'}:{_line_of(templated, 'POSTS_LEN')}" in message
    assert "Environment variable POSTS_LEN is not set" in message


def test_plain_strings_that_read_as_numbers_stay_strings(sandbox: DefsFolderSandbox) -> None:
    """Dagster's own rendering reads "1" as the number 1; only templates are rendered here."""
    path = sandbox.scaffold_component(TaskComponent, defs_path="stars")
    text = (path / "defs.yaml").read_text()
    assert "choices: [positive, negative, neutral]" in text
    (path / "defs.yaml").write_text(text.replace("[positive, negative, neutral]", "['1', '2', '3']"))
    component, _ = _load(sandbox, path)
    assert isinstance(component, TaskComponent)
    assert component.task.output.choices == ["1", "2", "3"]


def test_task_components_and_a_task_folder_share_one_code_location(sandbox: DefsFolderSandbox, tmp_path: Path) -> None:
    """Every component builds on the same resources and recovery sensor: their definitions merge."""
    folder = tmp_path / "tasks"
    folder.mkdir()
    (folder / "answers.yaml").write_text((BUNDLED_TASKS_DIR / "answers.yaml").read_text())
    sandbox.scaffold_component(TaskComponent, defs_path="posts")
    sandbox.scaffold_component(TaskComponent, defs_path="tickets", scaffold_params={"like": "industry"})
    folder_defs = sandbox.defs_folder_path / "folder"
    folder_defs.mkdir()
    (folder_defs / "defs.yaml").write_text(
        textwrap.dedent(f"""\
            type: batch_assets.TaskPipelinesComponent
            attributes:
              tasks_dir: {folder}
            """)
    )

    with sandbox.build_all_defs() as defs:
        keys = {key.to_user_string() for key in defs.resolve_asset_graph().get_all_asset_keys()}
        sensors = [sensor.name for sensor in defs.get_repository_def().sensor_defs]

    assert keys == {f"{task}/{asset}" for task in ("answers", "posts", "tickets") for asset in FOUR_ASSETS}
    assert sensors.count(RECOVERY_SENSOR_NAME) == 1
    assert {"range_failure_sensor", "posts_range_failure_sensor", "tickets_range_failure_sensor"} <= set(sensors)


def test_scaffolding_refuses_a_folder_name_that_cannot_name_a_task(sandbox: DefsFolderSandbox) -> None:
    with pytest.raises(ValueError, match=r"'my-task' cannot name a task: the folder name must match"):
        sandbox.scaffold_component(TaskComponent, defs_path="my-task")
    with pytest.raises(ValueError, match=r"like: 'nope' is no bundled task; one of answers, "):
        sandbox.scaffold_component(TaskComponent, defs_path="posts", scaffold_params={"like": "nope"})


def test_the_docs_example_loads(sandbox: DefsFolderSandbox, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/tasks.md's defs.yaml, by the type's short name, with its template rendered."""
    page = (Path(__file__).parent.parent / "docs" / "tasks.md").read_text()
    (example,) = [block for block in re.findall(r"```yaml\n(.*?)```", page, re.DOTALL) if "TaskComponent" in block]
    (sandbox.defs_folder_path / "tickets").mkdir()
    (sandbox.defs_folder_path / "tickets" / "defs.yaml").write_text(example)
    monkeypatch.setenv("TICKETS_MODEL", "embedded:SmolLM2-135M-Instruct")
    component, defs = _load(sandbox, sandbox.defs_folder_path / "tickets")
    assert isinstance(component, TaskComponent)
    assert component.task.engine.model == "embedded:SmolLM2-135M-Instruct"
    assert component.task.prompt is not None
    assert component.task.prompt.template == "Subject: {subject}\n\n{body}"
    assert len(defs.resolve_asset_graph().get_all_asset_keys()) == 4


# A dg project of a user's, as `create-dagster project` lays it out, with a folder-of-tasks component.
DG_PROJECT_FILES = {
    "pyproject.toml": """\
[project]
name = "tasks_project"
version = "0.1.0"

[tool.dg]
directory_type = "project"

[tool.dg.project]
root_module = "tasks_project"
""",
    "src/tasks_project/__init__.py": "",
    "src/tasks_project/definitions.py": """\
from pathlib import Path

import dagster as dg


@dg.definitions
def defs() -> dg.Definitions:
    return dg.load_from_defs_folder(path_within_project=Path(__file__).parent)
""",
    "src/tasks_project/defs/__init__.py": "",
    "src/tasks_project/defs/labels/defs.yaml": """\
type: batch_assets.TaskPipelinesComponent
attributes:
  tasks_dir: ../../../../tasks
""",
}


def dg_check_defs(project: Path) -> subprocess.CompletedProcess[str]:
    """The real `dg check defs`, run in `project` on this environment (its `.venv` is a link to it)."""
    env = {**os.environ, "PYTHONPATH": str(project / "src"), "VIRTUAL_ENV": str(project / ".venv"), "NO_COLOR": "1"}
    env.pop("BATCH_ASSETS_TASKS_DIR", None)
    return subprocess.run(
        [sys.executable, "-m", "dagster_dg_cli.cli", "check", "defs"],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow  # `dg` loads the code location in a process of its own
def test_dg_check_defs_fails_naming_each_broken_task_file_and_its_line(tmp_path: Path) -> None:
    """Issue 47: five broken task files in a folder-of-tasks component, and `dg check defs` printed
    "All definitions loaded successfully" with exit 0 (the UI shows each as a failing sensor, which
    a CI gate never sees). The good task in the folder is not named; a component's own defs.yaml
    is still checked by dg's schema (test_wheel_install.py)."""
    project = tmp_path / "tasks_project"
    for name, text in DG_PROJECT_FILES.items():
        (project / name).parent.mkdir(parents=True, exist_ok=True)
        (project / name).write_text(text)
    (project / ".venv").symlink_to(sys.prefix)
    tasks = project / "tasks"
    tasks.mkdir()
    good = (BUNDLED_TASKS_DIR / "sentiment.yaml").read_text()
    (tasks / "posts.yaml").write_text(good)
    (tasks / "tokens.yaml").write_text(good.replace("max_tokens: 10", "max_tokens: many"))
    (tasks / "broken.yaml").write_text("name: [\n")
    (tasks / "engine.yaml").write_text(
        good.replace("  max_model_len: 1024", "  max_model_len: 1024\n  vllm_args: {no_such_arg: 1}")
    )
    checked = dg_check_defs(project)
    output = checked.stdout + checked.stderr
    assert checked.returncode != 0, output
    assert "All definitions loaded successfully" not in output
    assert f"{tasks / 'tokens.yaml'}: sampling.max_tokens (line {_line_of(good, 'max_tokens:')})" in output
    assert f"{tasks / 'broken.yaml'}: not valid YAML" in output and "line 2, column 1" in output
    assert "engine.vllm_args.no_such_arg in the task file of 'engine' is not an argument of vLLM's engine" in output
    assert "3 task files do not load" in output and "posts.yaml" not in output
