"""Task YAML validation: a broken task is a clear error naming the file, never a half-built pipeline."""

from __future__ import annotations

from pathlib import Path

import pytest

from batch_assets.definitions import build_definitions
from batch_assets.pipeline.task_spec import TaskSpecError, load_task_spec, load_task_specs

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
