"""The dg project a command stands in (app/projects.py): found as `dg` finds it, its tasks those of its
components, the bundled tasks elsewhere, and a one-line refusal naming the folder for what cannot
give tasks. In process, on projects written here (test_wheel_install.py runs one from the wheel)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import yaml

from batch_assets import cli
from batch_assets.app.commands import _ui_target
from batch_assets.app.projects import BUNDLED, ProjectRefused, TaskSource, find_task_source
from batch_assets.pipeline.task_spec import BUNDLED_TASKS_DIR
from batch_assets_tests.support import REPO_ROOT, open_instance


def _project(root: Path, module: str, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A dg project laid out as `create-dagster project` does, importable as `module` (as installed)."""
    (root / "src" / module / "defs").mkdir(parents=True)
    (root / "pyproject.toml").write_text(
        f'[project]\nname = "{module}"\n\n[tool.dg]\ndirectory_type = "project"\n\n'
        f'[tool.dg.project]\nroot_module = "{module}"\n'
    )
    (root / "src" / module / "__init__.py").write_text("")
    (root / "src" / module / "defs" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(root / "src"))
    return root / "src" / module / "defs"


def _task_component(defs: Path, name: str) -> None:
    """A TaskComponent as `dg scaffold defs batch_assets.TaskComponent NAME` writes it."""
    task = textwrap.indent((BUNDLED_TASKS_DIR / "sentiment.yaml").read_text(), "  ", lambda line: bool(line.strip()))
    (defs / name).mkdir()
    (defs / name / "defs.yaml").write_text(f"type: batch_assets.TaskComponent\n\nattributes:\n  name: {name}\n{task}")


def test_the_project_is_found_from_a_folder_inside_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    defs = _project(tmp_path / "shop", "shop_found", monkeypatch)
    assert find_task_source(None, here=defs) == TaskSource(tmp_path / "shop")
    assert find_task_source(str(defs)) == TaskSource(tmp_path / "shop")
    # Outside any project, and in batch_assets' own checkout: the bundled tasks.
    assert find_task_source(None, here=tmp_path) is BUNDLED
    assert find_task_source(None, here=REPO_ROOT / "docs") is BUNDLED


def test_a_projects_tasks_are_its_components_tasks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A TaskComponent and a folder of task files (TaskPipelinesComponent) in one project: both tasks,
    each with its job, in the definitions the runs use; `batch-assets tasks` lists them from the
    project's folder with the project's drop zones."""
    defs = _project(tmp_path / "shop", "shop_tasks", monkeypatch)
    _task_component(defs, "tickets")
    (defs / "more" / "tasks").mkdir(parents=True)
    (defs / "more" / "defs.yaml").write_text(
        "type: batch_assets.TaskPipelinesComponent\nattributes:\n  tasks_dir: tasks\n"
    )
    (defs / "more" / "tasks" / "reviews.yaml").write_text((BUNDLED_TASKS_DIR / "sentiment.yaml").read_text())
    monkeypatch.delenv("BATCH_ASSETS_DATA", raising=False)
    monkeypatch.chdir(defs)

    source = find_task_source(None)
    assert [task.name for task in source.load_tasks().tasks] == ["reviews", "tickets"]
    assert source.definitions().resolve_job_def("tickets_pipeline").name == "tickets_pipeline"

    assert cli.main(["tasks"]) == 0
    # Commands work from the project's folder, as dg does: its data/ wherever they started.
    listed = [line.split("\t") for line in capsys.readouterr().out.splitlines()]
    drops = tmp_path / "shop" / "data" / "drops"
    assert [(row[0], row[-1]) for row in listed] == [
        ("reviews", f"drop zone: {drops / 'reviews'}"),
        ("tickets", f"drop zone: {drops / 'tickets'}"),
    ]


def test_drop_registers_a_files_partition_for_dg_launch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`batch-assets drop` in a project: the file in the project's drop zone, its partition in the
    instance, and the `dg launch` line that runs it (test_wheel_install.py launches such a partition)."""
    _task_component(_project(tmp_path / "shop", "shop_drop", monkeypatch), "tickets")
    monkeypatch.delenv("BATCH_ASSETS_DATA", raising=False)
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "shop" / ".dagster_home"))
    (tmp_path / "more.csv").write_text("text\nThe app crashes on start\n")
    monkeypatch.chdir(tmp_path)

    assert cli.main(["drop", "tickets", "more.csv", "--project", "shop"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == (
        "tickets/more.csv: partition 'more.csv' registered; "
        "run it: dg launch --assets group:tickets --partition more.csv"
    )
    assert (tmp_path / "shop" / "data" / "drops" / "tickets" / "more.csv").is_file()
    with open_instance(tmp_path / "shop" / ".dagster_home") as instance:
        assert instance.get_dynamic_partitions("tickets_drops") == ["more.csv"]


def test_what_cannot_give_tasks_is_refused_naming_the_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _project(tmp_path / "empty", "shop_empty", monkeypatch)
    monkeypatch.chdir(tmp_path / "empty")
    assert cli.main(["tasks"]) == 2
    assert capsys.readouterr().out.strip() == (
        f"error: the dg project at {tmp_path / 'empty'} has no batch_assets task: add one with "
        "`dg scaffold defs batch_assets.TaskComponent NAME` there, or run outside it for the bundled tasks"
    )

    nowhere = tmp_path / "nowhere"
    nowhere.mkdir()
    assert cli.main(["tasks", "--project", str(nowhere)]) == 2
    assert capsys.readouterr().out.startswith(f"error: {nowhere} is in no dg project")

    (tmp_path / "ws").mkdir()
    (tmp_path / "ws" / "dg.toml").write_text('directory_type = "workspace"\n\n[workspace]\nprojects = []\n')
    with pytest.raises(ProjectRefused, match=f"{tmp_path / 'ws'} is a dg workspace"):
        find_task_source(str(tmp_path / "ws"))


def test_ui_serves_the_project_else_the_bundled_code_location_from_any_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What `batch-assets ui` hands `dg dev`: a project's own discovery, the checkout's workspace.yaml,
    or, in any other folder (an installed package), the bundled code location under its own name."""
    home = tmp_path / "home"
    home.mkdir()
    assert _ui_target(None, TaskSource(tmp_path / "shop"), home) == []
    assert _ui_target("mine.yaml", BUNDLED, home) == ["-w", "mine.yaml"]
    monkeypatch.chdir(REPO_ROOT)
    assert _ui_target(None, BUNDLED, home) == ["-w", "workspace.yaml"]
    monkeypatch.chdir(tmp_path)
    assert _ui_target(None, BUNDLED, home) == ["-w", str(home / "workspace.yaml")]
    location = yaml.safe_load((home / "workspace.yaml").read_text())["load_from"][0]["python_module"]
    assert location == {"module_name": "batch_assets.definitions", "attribute": "defs", "location_name": "batch_assets"}


def test_two_components_of_one_task_name_are_refused_naming_both_files(
    data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 56.9: `tasks` listed the task twice, `doctor` said ready and `run` failed with Dagster's
    DuplicateAssetKey. The task is refused when the project loads, naming both files, as two files
    of one folder are; the project's other tasks are listed, and runs of them are refused too (the
    definitions would hold its assets twice)."""
    defs = _project(tmp_path / "shop", "shop_twice", monkeypatch)
    _task_component(defs, "tickets")
    _task_component(defs, "reviews")
    (defs / "again").mkdir()
    (defs / "again" / "defs.yaml").write_text((defs / "tickets" / "defs.yaml").read_text())
    (tmp_path / "more.csv").write_text("text\nThe app crashes on start\n")
    monkeypatch.chdir(defs)
    first, second = defs / "again" / "defs.yaml", defs / "tickets" / "defs.yaml"
    why = f"{first} and {second} both define the task 'tickets': keep one of them (rename or remove the other)"

    assert cli.main(["tasks"]) == 1
    listed = capsys.readouterr()
    assert [line.split("\t")[0] for line in listed.out.splitlines()] == ["reviews"]
    assert listed.err.strip() == f"ERROR: task 'tickets' not loaded: {why}"
    assert cli.main(["run", "tickets", str(tmp_path / "more.csv")]) == 2
    assert capsys.readouterr().out.strip() == f"error: task 'tickets' cannot be loaded: {why}"
    assert cli.main(["run", "reviews", str(tmp_path / "more.csv")]) == 2
    assert capsys.readouterr().out.strip() == f"error: the dg project at {tmp_path / 'shop'} does not load: {why}"
    assert not (tmp_path / "shop" / "data" / "drops").exists()  # nothing copied
    code, lines = cli.main(["doctor"]), capsys.readouterr().out.splitlines()
    assert code == 1 and f"FAIL  task tickets: not loaded: {why} [set: {first}, {second}]" in lines, lines

    # A folder of task files holding a task of that name: named by its task file.
    defs = _project(tmp_path / "shop2", "shop_twice_folder", monkeypatch)
    _task_component(defs, "tickets")
    (defs / "more" / "tasks").mkdir(parents=True)
    (defs / "more" / "tasks" / "tickets.yml").write_text((BUNDLED_TASKS_DIR / "sentiment.yaml").read_text())
    (defs / "more" / "defs.yaml").write_text(
        "type: batch_assets.TaskPipelinesComponent\nattributes:\n  tasks_dir: tasks\n"
    )
    monkeypatch.chdir(defs)
    assert cli.main(["tasks"]) == 1
    folder_task, component = defs / "more" / "tasks" / "tickets.yml", defs / "tickets" / "defs.yaml"
    assert f"{folder_task} and {component} both define the task 'tickets'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("name", "rule"),
    [
        ("../evil", "task name '../evil' must match ^[a-z][a-z0-9_]{0,62}$"),
        ("Tickets", "task name 'Tickets' must match ^[a-z][a-z0-9_]{0,62}$"),
        ("a b", "task name 'a b' must match ^[a-z][a-z0-9_]{0,62}$"),
    ],
)
def test_a_refused_component_task_name_is_one_line_with_its_file_and_line(
    name: str, rule: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 56.10: only `ComponentTreeException: ^^^^^^` reached the terminal; the cause was in the log."""
    module = f"shop_name_{abs(hash(name)) % 10_000}"
    defs = _project(tmp_path / "shop", module, monkeypatch)
    _task_component(defs, "tickets")
    defs_file = defs / "tickets" / "defs.yaml"
    defs_file.write_text(defs_file.read_text().replace("  name: tickets\n", f"  name: {name!r}\n"))
    monkeypatch.chdir(defs)
    assert cli.main(["tasks"]) == 2
    assert capsys.readouterr().out.strip() == f"error: {defs_file}: attributes.name (line 4): {rule}"


def test_an_empty_project_path_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 56.17: `--project ""` silently used the bundled tasks."""
    with pytest.raises(SystemExit) as exited:
        cli.main(["tasks", "--project", ""])
    assert exited.value.code == 2
    assert "argument --project: must name a folder (not an empty string)" in capsys.readouterr().err


def test_drop_of_the_bundled_tasks_prints_no_dagster_notices(
    data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 56.17: `batch-assets drop` printed Dagster's BetaWarnings (one per asset with a backfill policy)."""
    import warnings

    import dagster as dg

    (tmp_path / "posts.jsonl").write_text('{"text": "fine"}\n')
    monkeypatch.chdir(tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cli.main(["drop", "sentiment", "posts.jsonl"]) == 0
    assert [w for w in caught if issubclass(w.category, dg.BetaWarning | dg.PreviewWarning)] == []
    assert capsys.readouterr().out.startswith("sentiment/posts.jsonl: partition 'posts.jsonl' registered")
