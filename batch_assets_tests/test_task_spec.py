"""Task YAML validation: a broken task is a clear error naming the file, never a half-built pipeline."""

from __future__ import annotations

from pathlib import Path

import dagster as dg
import pytest

from batch_assets import cli
from batch_assets.definitions import build_definitions
from batch_assets.pipeline.task_spec import TaskSpecError, load_task_spec, load_task_specs, load_tasks

GOOD = """
input: {text_fields: [text]}
prompt: {system: "Classify.", template: "Text: {text}"}
output: {kind: choices, choices: [yes, no]}
"""


def write(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(body)
    return path


def test_every_shipped_task_file_loads_under_its_own_name() -> None:
    from batch_assets.pipeline.task_spec import BUNDLED_TASKS_DIR

    files = sorted(p.stem for p in [*BUNDLED_TASKS_DIR.glob("*.yaml"), *BUNDLED_TASKS_DIR.glob("*.yml")])
    assert files, "no bundled task files"
    assert [task.name for task in load_task_specs(BUNDLED_TASKS_DIR)] == files


def test_a_new_task_is_just_a_yaml_file(tmp_path: Path) -> None:
    write(tmp_path, "tickets", GOOD)
    defs = build_definitions(load_task_specs(tmp_path))
    keys = {key.to_user_string() for key in defs.resolve_asset_graph().get_all_asset_keys()}
    assert keys == {f"tickets/{a}" for a in ("raw_prompts", "formatted_prompts", "inference_outputs", "validated_labels")}
    assert defs.resolve_sensor_def("tickets_drops_sensor") is not None
    assert defs.resolve_job_def("tickets_pipeline") is not None


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (GOOD.replace("Text: {text}", "Text: {body}"), "not in input.text_fields"),
        (GOOD.replace("kind: choices, choices: [yes, no]", "kind: choices"), "needs a non-empty `choices`"),
        (GOOD.replace("kind: choices", "kind: sql"), "kind"),
        (GOOD + "\nunknown_key: 1\n", "unknown_key"),
        (GOOD.replace("[yes, no]", "[yes, no, a_very_long_choice_name]") + "\nsampling: {max_tokens: 4}\n", "max_tokens"),
        ("just a string", "mapping"),
        ("input: [unclosed", "not valid YAML"),
    ],
)
def test_invalid_tasks_name_the_file_and_the_problem(tmp_path: Path, body: str, message: str) -> None:
    path = write(tmp_path, "broken", body)
    with pytest.raises(TaskSpecError) as info:
        load_task_spec(path)
    assert str(path) in str(info.value) and message in str(info.value)


def test_model_override_applies_to_every_task(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    write(tmp_path, "one", GOOD)
    monkeypatch.setenv("BATCH_ASSETS_MODEL", "/models/other")
    assert load_task_specs(tmp_path)[0].model == "/models/other"


@pytest.mark.parametrize(
    ("template", "placeholder"),
    [
        ("Text: {}", "{}"),
        ("Text: {0}", "{0}"),
        ("Text: {text!r}", "{text!r}"),
        ("Text: {text:>10}", "{text:>10}"),
        ("Text: {text.upper}", "{text.upper}"),
        ("Text: {text[0]}", "{text[0]}"),
    ],
)
def test_template_placeholders_other_than_plain_fields_are_refused_at_load(
    tmp_path: Path, template: str, placeholder: str
) -> None:
    path = write(tmp_path, "broken", GOOD.replace("Text: {text}", template))
    with pytest.raises(TaskSpecError) as info:
        load_task_spec(path)
    assert str(path) in str(info.value) and "prompt.template" in str(info.value)
    assert f"prompt.template (line 3): placeholder {placeholder}: " in str(info.value)
    assert "errors.pydantic.dev" not in str(info.value) and "validation error" not in str(info.value)


def test_unbalanced_braces_and_unknown_raw_template_fields_are_refused_at_load(tmp_path: Path) -> None:
    unbalanced = write(tmp_path, "unbalanced", GOOD.replace("Text: {text}", "Text: {text"))
    with pytest.raises(TaskSpecError, match=r"prompt.template \(line 3\): not a valid template .*literal brace"):
        load_task_spec(unbalanced)
    raw = write(
        tmp_path,
        "raw",
        GOOD.replace(
            'prompt: {system: "Classify.", template: "Text: {text}"}',
            'prompt: {template: "Text: {text}", raw_template: "{system} {text}"}',
        ),
    )
    only_system_and_user = r"prompt.raw_template \(line 3\): use only \{system\} and \{user\}, not \['text'\]"
    with pytest.raises(TaskSpecError, match=only_system_and_user):
        load_task_spec(raw)
    # Literal braces, escaped, are text.
    fine = write(tmp_path, "fine", GOOD.replace("Text: {text}", 'Reply as {{\\"label\\": ...}}. Text: {text}'))
    assert load_task_spec(fine).prompt.placeholders() == {"text"}


def test_one_bad_task_file_leaves_the_others_loaded_and_fails_a_sensor_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write(tmp_path, "good", GOOD)
    bad = write(tmp_path, "bad", GOOD.replace("Text: {text}", "Text: {text!r}"))
    monkeypatch.setenv("BATCH_ASSETS_TASKS_DIR", str(tmp_path))
    defs = build_definitions()
    dg.Definitions.validate_loadable(defs)
    keys = {key.to_user_string() for key in defs.resolve_asset_graph().get_all_asset_keys()}
    assert keys == {f"good/{a}" for a in ("raw_prompts", "formatted_prompts", "inference_outputs", "validated_labels")}
    assert defs.resolve_sensor_def("good_drops_sensor") is not None
    # The bad task's sensor is where a user looks for it, runs by default and fails every tick.
    sensor = defs.resolve_sensor_def("bad_drops_sensor")
    assert sensor.default_status == dg.DefaultSensorStatus.RUNNING
    assert str(bad) in sensor.description and "{text!r}" in sensor.description
    with dg.instance_for_test() as instance, pytest.raises(Exception) as info:
        sensor(dg.build_sensor_context(instance=instance))
    assert str(bad) in str(info.value) and "placeholder {text!r}: conversions" in str(info.value)
    # Asking for every task strictly still refuses, naming the file.
    with pytest.raises(TaskSpecError, match="bad.yaml"):
        load_task_specs(tmp_path)


def test_two_files_for_one_task_name_are_refused_naming_both(tmp_path: Path) -> None:
    write(tmp_path, "good", GOOD)
    yaml_file = write(tmp_path, "twice", GOOD)
    yml_file = tmp_path / "twice.yml"
    yml_file.write_text(GOOD)
    loaded = load_tasks(tmp_path)
    assert [task.name for task in loaded.tasks] == ["good"]
    [error] = loaded.errors
    assert error.name == "twice" and str(yaml_file) in error.message and str(yml_file) in error.message
    assert "both define the task 'twice'" in error.message


def test_tasks_command_lists_good_tasks_and_names_the_bad_file_with_a_non_zero_exit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    write(tmp_path, "good", GOOD)
    bad = write(tmp_path, "bad", GOOD.replace("kind: choices, choices: [yes, no]", "kind: choices"))
    monkeypatch.setenv("BATCH_ASSETS_TASKS_DIR", str(tmp_path))
    monkeypatch.setenv("BATCH_ASSETS_DATA", str(tmp_path / "data"))
    assert cli.main(["tasks"]) == 1
    out, err = capsys.readouterr()
    assert out.startswith("good\tchoices") and "bad" not in out
    assert f"ERROR: task 'bad' not loaded: {bad}" in err and "needs a non-empty `choices`" in err


def test_run_of_a_bad_task_names_its_file_and_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    write(tmp_path, "good", GOOD)
    bad = write(tmp_path, "bad", GOOD.replace("Text: {text}", "Text: {}"))
    monkeypatch.setenv("BATCH_ASSETS_TASKS_DIR", str(tmp_path))
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("BATCH_ASSETS_DATA", str(tmp_path / "data"))
    posts = tmp_path / "posts.jsonl"
    posts.write_text('{"text": "hi"}\n')
    assert cli.main(["run", "bad", str(posts)]) == 2
    out = capsys.readouterr().out
    assert out.startswith(f"error: task 'bad' cannot be loaded: {bad}") and "placeholder {}" in out
    assert not (tmp_path / "data" / "drops" / "bad").exists()
