"""Task YAML validation: a broken task is a clear error naming the file, never a half-built pipeline."""

from __future__ import annotations

from pathlib import Path

import dagster as dg
import pytest

from batch_assets import cli
from batch_assets.lib.task_definitions import build_definitions
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
    assert keys == {
        f"tickets/{a}" for a in ("raw_prompts", "formatted_prompts", "inference_outputs", "validated_labels")
    }
    assert defs.resolve_sensor_def("tickets_drops_sensor") is not None
    assert defs.resolve_job_def("tickets_pipeline") is not None


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (GOOD.replace("Text: {text}", "Text: {body}"), "not in input.text_fields"),
        (GOOD.replace("kind: choices, choices: [yes, no]", "kind: choices"), "needs a non-empty `choices`"),
        (GOOD.replace("kind: choices", "kind: sql"), "kind"),
        (GOOD + "\nunknown_key: 1\n", "unknown_key"),
        (
            GOOD.replace("[yes, no]", "[yes, no, a_very_long_choice_name]") + "\nsampling: {max_tokens: 4}\n",
            "max_tokens",
        ),
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
    from batch_assets.engines.kinds import resolve_settings

    write(tmp_path, "one", GOOD)
    monkeypatch.setenv("BATCH_ASSETS_MODEL", "/models/other")
    [task] = load_task_specs(tmp_path)
    assert task.engine.model == "embedded:SmolLM2-135M-Instruct"  # the spec is the YAML's alone
    assert resolve_settings(task).model == "/models/other"


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
    known_only = r"prompt.raw_template \(line 3\): use only \{system\}, \{user\} and \{examples\}, not \['text'\]"
    with pytest.raises(TaskSpecError, match=known_only):
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


# --- hostile task files: each is refused alone, naming the file, the key and its line -------------

HEAD = 'input: {text_fields: [text]}\nprompt: {system: "Classify.", template: "Text: {text}"}\n'


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (
            HEAD + "output: {kind: text}\nsampling:\n  temprature: 0.2\n",
            "sampling.temprature (line 5): Extra inputs are not permitted; did you mean temperature?",
        ),
        (
            HEAD + "output: {kind: text}\nsamplng: {max_tokens: 5}\n",
            "samplng (line 4): Extra inputs are not permitted; did you mean sampling?",
        ),
        (
            HEAD + "output: {kind: text}\nengine:\n  price: {input_per_million: 1}\n",
            "engine.price.input_per_million (line 5): Extra inputs are not permitted; "
            "did you mean input_per_million_tokens, output_per_million_tokens?",
        ),
        (
            'input: {text_fields: [text]}\nprompt:\n  template: "Text: {text}"\n  examples:\n'
            "    - {input: {text: a}, answr: b}\noutput: {kind: text}\n",
            "prompt.examples.0.answer (line 5): Field required; "
            "prompt.examples.0.answr (line 5): Extra inputs are not permitted; did you mean answer?",
        ),
        # Nothing close: pydantic's message alone.
        (HEAD + "output: {kind: text}\nzzz: 1\n", "zzz (line 4): Extra inputs are not permitted"),
    ],
)
def test_a_misspelt_key_is_refused_with_the_closest_valid_keys(tmp_path: Path, body: str, expected: str) -> None:
    path = write(tmp_path, "typo", body)
    with pytest.raises(TaskSpecError) as info:
        load_task_spec(path)
    assert str(info.value) == f"{path}: {expected}"


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        # A regex Python cannot compile (`re.error` is no ValueError: it used to escape every check).
        (HEAD + 'output: {kind: regex, regex: "[a-"}\n', "output.regex (line 3): not a valid regular expression"),
        # Regexes that can only match the empty string, or nothing: every label would be invalid.
        (HEAD + 'output: {kind: regex, regex: "^$"}\n', "output.regex (line 3): '^$' can only match the empty string"),
        (HEAD + 'output: {kind: regex, regex: "(?!)"}\n', "output.regex (line 3): '(?!)' can only match the empty"),
        (HEAD + 'output: {kind: regex, regex: "a{0}"}\n', "output.regex (line 3): 'a{0}' can only match the empty"),
        # JSON schemas are checked against their metaschema, naming the key inside the schema.
        (
            HEAD + "output:\n  kind: json_schema\n  json_schema: {type: objekt}\n",
            "output.json_schema.type (line 5): not a valid JSON schema: 'objekt' is not valid",
        ),
        (
            HEAD + "output:\n  kind: json_schema\n  json_schema: {$schema: 5, type: object}\n",
            "output.json_schema.$schema (line 5): must be a string",
        ),
        (
            HEAD + "output:\n  kind: json_schema\n  json_schema:\n    type: object\n    properties:\n"
            "      label: {type: strin}\n",
            "output.json_schema.properties.label.type (line 8): not a valid JSON schema",
        ),
        # max_tokens that leave no room for a prompt: both keys named, each with its line.
        (
            HEAD + "output: {kind: text}\nengine:\n  max_model_len: 1024\nsampling:\n  max_tokens: 5000\n",
            "line 7: sampling.max_tokens 5000 leaves no room for a prompt in engine.max_model_len (line 5) 1024",
        ),
        # Empty, blank and duplicate choices.
        (HEAD + 'output: {kind: choices, choices: ["", " "]}\n', "output.choices.0 (line 3): '' is empty or blank"),
        (HEAD + 'output: {kind: choices, choices: [a, " "]}\n', "output.choices.1 (line 3): ' ' is empty or blank"),
        (
            HEAD + "output:\n  kind: choices\n  choices:\n    - yes\n    - no\n    - yes\n",
            "output.choices.2 (line 8): 'yes' repeats choice 0 ('yes'); choices must be distinct",
        ),
        (
            HEAD + 'output: {kind: choices, choices: ["yes", " yes"]}\n',
            "output.choices.1 (line 3): ' yes' differs only in surrounding spaces from choice 0 ('yes')",
        ),
        # Refusals of one setting against another name the offending key's line.
        (
            HEAD + "output: {kind: text}\nbudget:\n  max_cost_usd: 5\n",
            "line 5: budget.max_cost_usd needs engine.price",
        ),
        (
            'input: {text_fields: [text]}\nprompt:\n  template: "Text: {body}"\noutput: {kind: text}\n',
            "prompt.template (line 3): uses ['body'], not in input.text_fields (line 1) ['text']",
        ),
        (
            HEAD + "output: {kind: choices, choices: [yes, no, a_very_long_choice_name]}\nsampling:\n  max_tokens: 4\n",
            "line 5: sampling.max_tokens 4 is too small for the choice 'a_very_long_choice_name'",
        ),
        (
            HEAD + "output: {kind: text}\nchecks:\n  gold_field: label\n",
            "line 5: checks.gold_field needs a closed output",
        ),
        (HEAD + "output:\n  kind: choices\n", "output.kind (line 4): output kind 'choices' needs a non-empty"),
        (HEAD + "output: {kind: text}\nname: other\n", "name (line 4): task name 'other' must equal the file name"),
        # A run over more partitions than one run can sensibly hold.
        (
            HEAD + "output: {kind: text}\nruns:\n  max_partitions_per_run: 100000\n",
            "runs.max_partitions_per_run (line 5): Input should be less than or equal to 1000",
        ),
        # Wrong types, unknown keys, negative and non-finite numbers.
        (
            HEAD + "output: {kind: text}\nsampling: {max_tokens: lots}\n",
            "sampling.max_tokens (line 4): Input should be",
        ),
        (HEAD + "output: {kind: text}\nsampling: 5\n", "sampling (line 4): Input should be a valid dictionary"),
        (HEAD + "output: {kind: text}\nsamplng: {max_tokens: 5}\n", "samplng (line 4): Extra inputs are not permitted"),
        (
            HEAD + "output: {kind: choices, choices: [1, 2]}\n",
            "output.choices.0 (line 3): Input should be a valid string",
        ),
        (
            HEAD + "output: {kind: text}\nsampling: {temperature: -1}\n",
            "sampling.temperature (line 4): Input should be",
        ),
        (
            HEAD + "output: {kind: text}\nsampling: {temperature: .inf}\n",
            "sampling.temperature (line 4): Input should be a finite",
        ),
        (
            HEAD + "output: {kind: text}\nengine: {max_model_len: -5}\n",
            "engine.max_model_len (line 4): Input should be",
        ),
        (
            HEAD + "output: {kind: text}\nsampling: {max_tokens: 99999999999999999999999}\n",
            "sampling.max_tokens (line 4): Input should be less than or equal to 2147483647",
        ),
        # Numbers no model or machine takes: refused at load, not when the engine starts.
        (
            HEAD + "output: {kind: text}\nengine: {max_model_len: 99999999999}\n",
            "engine.max_model_len (line 4): Input should be less than or equal to 2147483647",
        ),
        (
            HEAD + "output: {kind: text}\nengine: {batch_size: 99999999999}\n",
            "engine.batch_size (line 4): Input should be less than or equal to 2147483647",
        ),
        (
            HEAD + "output: {kind: text}\nengine: {kv_cache_memory_gib: 1.0e+12}\n",
            "engine.kv_cache_memory_gib (line 4): Input should be less than or equal to 1048576",
        ),
    ],
)
def test_hostile_task_files_are_refused_naming_file_key_and_line(tmp_path: Path, body: str, expected: str) -> None:
    path = write(tmp_path, "hostile", body)
    with pytest.raises(TaskSpecError) as info:
        load_task_spec(path)
    assert str(info.value).startswith(f"{path}: ")
    assert expected in str(info.value)


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        # A key given twice: YAML would keep the second silently.
        (
            HEAD + "output: {kind: text}\nsampling: {max_tokens: 8}\nsampling: {max_tokens: 9}\n",
            "duplicate key 'sampling' on line 4 and line 5: keep one",
        ),
        (
            HEAD + "output:\n  kind: text\n  kind: choices\n",
            "duplicate key 'kind' on line 4 and line 5",
        ),
        ("", "empty: a task file is a mapping of settings"),
        ("# nothing but a comment\n", "empty: a task file is a mapping of settings"),
        ("- input\n- output\n", "line 1: expected a mapping of settings (input, prompt, output, ...) at the top level"),
        (
            "input:\n\ttext_fields: [text]\n",
            "found character '\\t' that cannot start any token\n  in \"<unicode string>\", line 2",
        ),
        ("input: [unclosed\n", "not valid YAML"),
        ("description: " + "[" * 3000 + "]" * 3000 + "\n", "nested too deeply"),
        # A few hundred bytes of aliases standing for a million values.
        (
            HEAD + "output: {kind: text}\ndescription: [&a [x,x,x,x,x,x,x,x,x,x], &b [*a,*a,*a,*a,*a,*a,*a,*a,*a,*a], "
            "&c [*b,*b,*b,*b,*b,*b,*b,*b,*b,*b], &d [*c,*c,*c,*c,*c,*c,*c,*c,*c,*c], "
            "&e [*d,*d,*d,*d,*d,*d,*d,*d,*d,*d], &f [*e,*e,*e,*e,*e,*e,*e,*e,*e,*e]]\n",
            "on line 4 expands (through YAML aliases) to more than 100000 values",
        ),
    ],
)
def test_malformed_yaml_is_refused_naming_file_and_line(tmp_path: Path, body: str, expected: str) -> None:
    path = write(tmp_path, "hostile", body)
    with pytest.raises(TaskSpecError) as info:
        load_task_spec(path)
    assert str(info.value).startswith(f"{path}: ")
    assert expected in str(info.value)


def test_what_is_not_a_task_file_is_refused_without_reading_it(tmp_path: Path) -> None:
    import os

    (tmp_path / "folder.yaml").mkdir()
    os.mkfifo(tmp_path / "fifo.yaml")  # opening it would block the code location's load
    (tmp_path / "zero.yaml").symlink_to("/dev/zero")  # reading it would never end
    (tmp_path / "big.yaml").write_text("description: " + "x" * (2 << 20) + "\n")
    write(tmp_path, "good", GOOD)
    loaded = load_tasks(tmp_path)
    assert [task.name for task in loaded.tasks] == ["good"]
    messages = {error.name: error.message for error in loaded.errors}
    assert messages["folder"] == f"{tmp_path / 'folder.yaml'}: not a regular file"
    assert messages["fifo"] == f"{tmp_path / 'fifo.yaml'}: not a regular file"
    assert messages["zero"] == f"{tmp_path / 'zero.yaml'}: not a regular file"
    assert messages["big"] == f"{tmp_path / 'big.yaml'}: larger than 1024 KiB; a task file is a few settings"


def test_settings_near_the_limits_still_load(tmp_path: Path) -> None:
    # A regex that may match the empty string but also labels, a valid schema, a merge key that
    # overrides on purpose, choices with inner spaces, max_tokens just under the context.
    regex = load_task_spec(write(tmp_path, "regex", HEAD + 'output: {kind: regex, regex: "[A-Z]*"}\n'))
    assert regex.output.regex == "[A-Z]*"
    schema = HEAD + "output:\n  kind: json_schema\n  json_schema: {type: object, properties: {a: {type: string}}}\n"
    assert load_task_spec(write(tmp_path, "schema", schema)).output.json_schema["type"] == "object"
    merged_body = (
        HEAD + "output: {kind: choices, choices: [Real Estate, Law Firm]}\n"
        "engine: {max_model_len: 64}\nsampling:\n  <<: {max_tokens: 8, temperature: 0.5}\n  max_tokens: 63\n"
    )
    merged = load_task_spec(write(tmp_path, "merged", merged_body))
    assert merged.sampling.max_tokens == 63 and merged.sampling.temperature == 0.5
    assert merged.output.choices == ["Real Estate", "Law Firm"]
    runs = load_task_spec(
        write(tmp_path, "runs", HEAD + "output: {kind: text}\nruns: {max_partitions_per_run: 1000}\n")
    )
    assert runs.runs.max_partitions_per_run == 1000


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (
            HEAD + "output: {kind: text}\nengine:\n  max_model_len: 100000\n",
            "task 'long': engine.max_model_len 100000 exceeds the 8192 tokens the model "
            "embedded:SmolLM2-135M-Instruct (`engine.model` in the task file of 'long') takes; "
            "set engine.max_model_len to at most 8192",
        ),
        (
            'input: {text_fields: [text]}\nprompt: {template: "{text}"}\noutput: {kind: embedding}\n'
            "engine:\n  max_model_len: 512\n",
            "engine.max_model_len 512 exceeds the 256 tokens the model embedded:all-MiniLM-L6-v2",
        ),
    ],
)
def test_more_context_than_the_embedded_model_takes_is_refused_before_a_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str, expected: str
) -> None:
    """vLLM would refuse it at start-up, after the files were read and formatted."""
    from batch_assets.engines.kinds import resolve_settings

    monkeypatch.delenv("BATCH_ASSETS_MODEL", raising=False)
    monkeypatch.delenv("BATCH_ASSETS_EMBEDDING_MODEL", raising=False)
    task = load_task_spec(write(tmp_path, "long", body))
    with pytest.raises(TaskSpecError) as refused:
        resolve_settings(task)
    assert expected in str(refused.value)


def test_max_model_len_is_checked_against_the_model_that_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from batch_assets.engines.kinds import resolve_settings

    monkeypatch.delenv("BATCH_ASSETS_MODEL", raising=False)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"max_position_embeddings": 1024, "rope_scaling": {"factor": 4.0}}')
    body = HEAD + f"output: {{kind: text}}\nengine:\n  model: {model}\n  max_model_len: LENGTH\n"
    assert (
        resolve_settings(load_task_spec(write(tmp_path, "fits", body.replace("LENGTH", "4096")))).max_model_len == 4096
    )
    with pytest.raises(TaskSpecError, match=r"engine.max_model_len 4097 exceeds the 4096"):
        resolve_settings(load_task_spec(write(tmp_path, "over", body.replace("LENGTH", "4097"))))
    # The default counts too: it is what vLLM would be asked for.
    (model / "config.json").write_text('{"max_position_embeddings": 1024}')
    default = load_task_spec(write(tmp_path, "default", HEAD + f"output: {{kind: text}}\nengine:\n  model: {model}\n"))
    with pytest.raises(TaskSpecError, match=r"engine.max_model_len 2048 \(the default\) exceeds the 1024 tokens"):
        resolve_settings(default)
    # An override names itself; and a longer model chosen by it lifts the YAML model's limit.
    monkeypatch.setenv("BATCH_ASSETS_MODEL", str(model))
    overridden = load_task_spec(write(tmp_path, "overridden", HEAD + "output: {kind: text}\n"))
    with pytest.raises(
        TaskSpecError, match=r"the model .*/model \(BATCH_ASSETS_MODEL\) takes; set engine.max_model_len"
    ):
        resolve_settings(overridden)
    (model / "config.json").write_text('{"max_position_embeddings": 32768}')
    longer = load_task_spec(write(tmp_path, "longer", HEAD + "output: {kind: text}\nengine: {max_model_len: 16384}\n"))
    assert resolve_settings(longer).max_model_len == 16384  # past the embedded model's 8192: fine here
    # vLLM's own switch to go past the trained length turns the check off.
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    assert (
        resolve_settings(load_task_spec(write(tmp_path, "allowed", body.replace("LENGTH", "8192")))).max_model_len
        == 8192
    )


def test_a_context_the_model_takes_through_its_overrides_is_left_to_vllm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Qwen3's documented long context: a 40,960-token config made 131,072 by YaRN in `hf_overrides`.
    Before, the load-time bound read only config.json and refused it."""
    from batch_assets.engines.kinds import resolve_settings

    monkeypatch.delenv("BATCH_ASSETS_MODEL", raising=False)
    monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"max_position_embeddings": 40960}')
    body = HEAD + f"output: {{kind: text}}\nengine:\n  model: {model}\n  max_model_len: 131072\n"
    with pytest.raises(TaskSpecError, match="to at most 40960 .*VLLM_ALLOW_LONG_MAX_MODEL_LEN=1"):
        resolve_settings(load_task_spec(write(tmp_path, "plain", body)))
    yarn = (
        "  vllm_args:\n"
        "    hf_overrides: {rope_scaling: {rope_type: yarn, factor: 4.0, original_max_position_embeddings: 32768}}\n"
    )
    assert resolve_settings(load_task_spec(write(tmp_path, "yarn", body + yarn))).max_model_len == 131072


def test_the_embedded_models_limits_are_what_their_files_say() -> None:
    import gguf

    from batch_assets.engines.embedded_model import embedding_model_dir, gguf_path, model_token_limit
    from batch_assets.pipeline.task_spec import EMBEDDED_EMBEDDING_MODEL, EMBEDDED_MODEL, EMBEDDED_MODEL_LIMITS

    field = gguf.GGUFReader(str(gguf_path())).fields["llama.context_length"]
    assert EMBEDDED_MODEL_LIMITS[EMBEDDED_MODEL] == int(field.parts[field.data[0]][0])
    assert EMBEDDED_MODEL_LIMITS[EMBEDDED_EMBEDDING_MODEL] == model_token_limit(str(embedding_model_dir())) == 256


def test_txt_field_is_only_needed_where_txt_files_are_read(tmp_path: Path) -> None:
    from batch_assets.pipeline.inputs.read_prompts import DropFileError, ParseOptions, read_prompts

    # One text field: `.txt` lines fill it, whatever its name (it was refused for `txt_field 'text'`).
    one = 'input: {text_fields: [body]}\nprompt: {system: "Classify.", template: "{body}"}\noutput: {kind: text}\n'
    assert load_task_spec(write(tmp_path, "one", one)).input.txt_field == "body"
    two = one.replace("[body]", "[subject, body]").replace('"{body}"', '"{subject}: {body}"')
    task = load_task_spec(write(tmp_path, "two", two))
    options = ParseOptions(tuple(task.input.text_fields), task.input.txt_field)
    assert read_prompts(b"subject,body\nHi,there\n", "t.csv", options)["body"].to_list() == ["there"]
    with pytest.raises(DropFileError) as info:
        read_prompts(b"a line\n", "notes.txt", options)
    assert str(info.value) == (
        "notes.txt: a .txt file has one text a line, and the task does not say which field it fills: "
        "set input.txt_field in the task file to one of input.text_fields ['subject', 'body']"
    )
    # A txt_field the task sets is still checked at load.
    with pytest.raises(TaskSpecError, match=r"txt_field 'title' must be one of text_fields"):
        load_task_spec(write(tmp_path, "bad", two.replace("[subject, body]}", "[subject, body], txt_field: title}")))


BAD_REGEX = HEAD + 'output: {kind: regex, regex: "[a-"}\n'


def test_a_bad_regex_leaves_the_other_tasks_loaded(tmp_path: Path) -> None:
    write(tmp_path, "good", GOOD)
    bad = write(tmp_path, "bad", BAD_REGEX)
    loaded = load_tasks(tmp_path)
    assert [task.name for task in loaded.tasks] == ["good"]
    [error] = loaded.errors
    assert error.name == "bad" and error.paths == (bad,)
    assert error.message == (
        f"{bad}: output.regex (line 3): not a valid regular expression: unterminated character set at position 0"
    )


def test_an_unexpected_error_in_one_file_is_reported_and_logged_not_raised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from batch_assets.pipeline import task_spec

    real_load = task_spec.load_task_spec

    def load_with_a_bug(path: Path) -> task_spec.TaskSpec:
        if path.stem == "bad":
            raise RuntimeError("a bug in a check")
        return real_load(path)

    monkeypatch.setattr(task_spec, "load_task_spec", load_with_a_bug)
    write(tmp_path, "good", GOOD)
    bad = write(tmp_path, "bad", GOOD)
    loaded = load_tasks(tmp_path)
    assert [task.name for task in loaded.tasks] == ["good"]
    [error] = loaded.errors
    assert error.message == f"{bad}: could not be loaded: RuntimeError: a bug in a check"
    # Not swallowed: the traceback is logged, naming the file.
    [record] = [r for r in caplog.records if r.name == task_spec.__name__]
    assert record.levelname == "ERROR" and str(bad) in record.getMessage() and record.exc_info is not None


def test_the_code_location_loads_the_good_task_beside_a_bad_regex(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from batch_assets.definitions import load_project_defs

    write(tmp_path, "good", GOOD)
    bad = write(tmp_path, "bad", BAD_REGEX)
    monkeypatch.setenv("BATCH_ASSETS_TASKS_DIR", str(tmp_path))
    monkeypatch.setenv("BATCH_ASSETS_DATA", str(tmp_path / "data"))
    # The code location as `dagster dev`, the daemon and `batch-assets` load it (the component tree).
    defs = load_project_defs()
    dg.Definitions.validate_loadable(defs)
    keys = {key.to_user_string() for key in defs.resolve_asset_graph().get_all_asset_keys()}
    assert keys == {f"good/{a}" for a in ("raw_prompts", "formatted_prompts", "inference_outputs", "validated_labels")}
    assert defs.resolve_sensor_def("good_drops_sensor") is not None
    error_sensor = defs.resolve_sensor_def("bad_drops_sensor")
    assert str(bad) in error_sensor.description and "output.regex (line 3)" in error_sensor.description

    assert cli.main(["tasks"]) == 1
    out, err = capsys.readouterr()
    assert out.startswith("good\tchoices") and "bad" not in out
    assert f"ERROR: task 'bad' not loaded: {bad}: output.regex (line 3): not a valid regular expression" in err
