"""One decision of a task's model and settings per engine (`Engine.resolve`), read by the code
versions and by the checkpoint fingerprint alike: whatever way a model is chosen (the task's YAML,
the engine's resource, BATCH_ASSETS_MODEL, an endpoint), the assets' code versions change exactly
when the fingerprint does, so a partition shows as stale exactly when its checkpoints and cached
results stop being reused."""

from __future__ import annotations

from typing import Any

import dagster as dg
import pytest

from batch_assets.engines.kinds import resolve_settings
from batch_assets.engines.model_check import ModelNotFound, check_model
from batch_assets.engines.openai_engine import OpenAIEngine
from batch_assets.engines.vllm_engine import VLLMEngine
from batch_assets.lib.assets import inference_fingerprint
from batch_assets.pipeline.code_versions import code_versions
from batch_assets.pipeline.task_formats import task_format
from batch_assets.pipeline.task_spec import EMBEDDED_MODEL, TaskSpec

CHAT: dict[str, Any] = {
    "name": "t",
    "input": {"text_fields": ["text"]},
    "prompt": {"system": "Classify.", "template": "Post: {text}"},
    "output": {"kind": "choices", "choices": ["positive", "negative"]},
    "engine": {"model": "org/model-a"},
}
EMBED: dict[str, Any] = {
    "name": "e",
    "input": {"text_fields": ["text"]},
    "prompt": {"template": "{text}"},
    "output": {"kind": "embedding"},
    "engine": {"model": "org/embedder-a", "max_model_len": 256},
}


def task(raw: dict[str, Any], **engine: Any) -> TaskSpec:
    return TaskSpec.model_validate({**raw, "engine": {**raw["engine"], **engine}})


def decided(task: TaskSpec, engine: VLLMEngine | OpenAIEngine) -> tuple[str, str, str]:
    """(model the engine runs, inference_outputs' code version, checkpoint fingerprint)."""
    resolved = engine.resolve(task)
    settings = engine.settings(task, gpus=0) if isinstance(engine, VLLMEngine) else engine.settings(task)
    assert settings.resolved == resolved
    fingerprint = inference_fingerprint(task_format(task), settings)
    return settings.model, code_versions(task, resolved)["inference_outputs"], fingerprint


@pytest.fixture(autouse=True)
def no_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    for variable in ("BATCH_ASSETS_MODEL", "BATCH_ASSETS_EMBEDDING_MODEL"):
        monkeypatch.delenv(variable, raising=False)


def assert_both_change(before: tuple[str, str, str], after: tuple[str, str, str], model: str) -> None:
    assert after[0] == model
    assert after[1] != before[1] and after[2] != before[2]


def test_a_model_named_in_the_yaml_changes_version_and_fingerprint() -> None:
    before = decided(task(CHAT), VLLMEngine())
    assert before[0] == "org/model-a"
    assert_both_change(before, decided(task(CHAT, model="org/model-b"), VLLMEngine()), "org/model-b")
    # A throughput setting changes neither.
    tuned = decided(task(CHAT, batch_size=8, vllm_args={"max_num_seqs": 4}), VLLMEngine())
    assert tuned == before


def test_a_model_set_on_the_resource_changes_version_and_fingerprint() -> None:
    chat = task(CHAT)
    before = decided(chat, VLLMEngine())
    assert_both_change(before, decided(chat, VLLMEngine(model="org/model-b")), "org/model-b")
    assert VLLMEngine(model="org/model-b").resolve(chat).model_setting == "`model` of the vLLM engine resource"
    # An output-deciding vLLM argument or a context set there counts too; a throughput one does not.
    quantized = decided(chat, VLLMEngine(vllm_args={"quantization": "fp8"}))
    assert quantized[1:] != before[1:] and quantized[1] != before[1] and quantized[2] != before[2]
    longer = decided(chat, VLLMEngine(max_model_len=1024))
    assert longer[1] != before[1] and longer[2] != before[2]
    assert decided(chat, VLLMEngine(vllm_args={"max_num_seqs": 4})) == before
    # The resource's model is a chat model: an embedding task keeps its own, and neither changes.
    embed = task(EMBED)
    assert decided(embed, VLLMEngine(model="org/model-b")) == decided(embed, VLLMEngine())


def test_batch_assets_model_changes_version_and_fingerprint(monkeypatch: pytest.MonkeyPatch) -> None:
    chat, embed = task(CHAT), task(EMBED)
    before, embed_before = decided(chat, VLLMEngine()), decided(embed, VLLMEngine())
    monkeypatch.setenv("BATCH_ASSETS_MODEL", "org/model-env")
    assert_both_change(before, decided(chat, VLLMEngine()), "org/model-env")
    assert resolve_settings(chat).model_setting == "BATCH_ASSETS_MODEL"
    assert decided(embed, VLLMEngine()) == embed_before  # a chat model's override
    monkeypatch.setenv("BATCH_ASSETS_EMBEDDING_MODEL", "org/embedder-env")
    assert_both_change(embed_before, decided(embed, VLLMEngine()), "org/embedder-env")
    # The resource's model still wins over the environment's for a chat task.
    assert decided(chat, VLLMEngine(model="org/model-b"))[0] == "org/model-b"


def test_an_endpoint_is_sent_its_own_model_whatever_batch_assets_model_says(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    # A local tokenizer folder, never loaded here: settings name it, nothing reads it.
    endpoint = {"kind": "openai", "base_url": "http://127.0.0.1:9/v1", "tokenizer": str(tmp_path)}
    chat = task(CHAT, **endpoint, model="served-a")
    before = decided(chat, OpenAIEngine())
    assert before[0] == "served-a"
    monkeypatch.setenv("BATCH_ASSETS_MODEL", "org/model-env")
    assert decided(chat, OpenAIEngine()) == before  # neither changes: the endpoint ignores it
    assert_both_change(before, decided(chat, OpenAIEngine(model="served-b")), "served-b")
    # No model named: the server's only one, asked at the run; the code version cannot know it, so
    # the task's default name stands for it wherever the run's model is read.
    unnamed = task({**CHAT, "engine": {}}, **endpoint)
    resolved = OpenAIEngine().resolve(unnamed)
    assert resolved.model_from_server and "server's only model" in resolved.model_setting
    assert resolved.model == EMBEDDED_MODEL and not OpenAIEngine(model="served-b").resolve(unnamed).model_from_server


def test_the_code_location_versions_assets_with_its_resources_settings() -> None:
    from batch_assets.lib.task_definitions import build_definitions

    chat = task(CHAT)
    key = dg.AssetKey(["t", "inference_outputs"])
    plain = build_definitions(tasks=[chat]).resolve_asset_graph().get(key).code_version
    other = build_definitions(tasks=[chat], engine=VLLMEngine(model="org/model-b")).resolve_asset_graph().get(key)
    assert plain == code_versions(chat, VLLMEngine().resolve(chat))["inference_outputs"]
    assert other.code_version == code_versions(chat, VLLMEngine(model="org/model-b").resolve(chat))["inference_outputs"]
    assert other.code_version != plain


def test_a_model_too_short_for_the_task_fails_the_task_not_the_code_location(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from batch_assets.lib.task_definitions import build_definitions

    model = tmp_path / "short"
    model.mkdir()
    (model / "config.json").write_text('{"max_position_embeddings": 1024}')
    monkeypatch.setenv("BATCH_ASSETS_MODEL", str(model))
    defs = build_definitions(tasks=[task(CHAT), task(EMBED)])
    assert defs.resolve_asset_graph().has(dg.AssetKey(["e", "inference_outputs"]))
    assert not defs.resolve_asset_graph().has(dg.AssetKey(["t", "inference_outputs"]))
    sensor = defs.resolve_sensor_def("t_drops_sensor")  # the task's failing stand-in (lib/task_file_errors.py)
    assert "(BATCH_ASSETS_MODEL) takes; set engine.max_model_len to at most 1024" in (sensor.description or "")


def test_the_model_check_names_the_setting_that_chose_the_model(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    missing = str(tmp_path / "nowhere")
    with pytest.raises(ModelNotFound, match=r"set `model` of the vLLM engine resource to a model folder"):
        check_model(VLLMEngine(model=missing).resolve(task(CHAT)))
    monkeypatch.setenv("BATCH_ASSETS_MODEL", missing)
    with pytest.raises(ModelNotFound, match=r"does not exist; set BATCH_ASSETS_MODEL to a model folder"):
        check_model(resolve_settings(task(CHAT)))


def test_the_cli_and_the_demo_name_the_model_the_engine_resolved(
    tmp_path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    from batch_assets import cli
    from batch_assets.app.runner import demo_note

    endpoint = {"kind": "openai", "base_url": "http://127.0.0.1:9/v1"}
    tasks = {
        "yaml": {**CHAT, "name": "yaml"},
        "default": {**CHAT, "name": "default", "engine": {}},
        "served": {**CHAT, "name": "served", "engine": endpoint},
    }
    folder = tmp_path / "tasks"
    folder.mkdir()
    for name, raw in tasks.items():
        (folder / f"{name}.yaml").write_text(json.dumps({key: value for key, value in raw.items() if key != "name"}))
    monkeypatch.setenv("BATCH_ASSETS_TASKS_DIR", str(folder))
    monkeypatch.setenv("BATCH_ASSETS_DATA", str(tmp_path / "data"))
    monkeypatch.setenv("BATCH_ASSETS_MODEL", "org/model-env")
    assert cli.main(["tasks"]) == 0
    models = {line.split("\t")[0]: line.split("\t")[2] for line in capsys.readouterr().out.splitlines()}
    # BATCH_ASSETS_MODEL wins over the YAML's model in process; an endpoint serves its own.
    assert models == {"default": "org/model-env", "served": "(the endpoint's only model)", "yaml": "org/model-env"}
    # The demo's caution about the embedded model: for a task that runs it, not an endpoint's stand-in name.
    monkeypatch.delenv("BATCH_ASSETS_MODEL")
    assert demo_note([TaskSpec.model_validate(tasks["served"])]) is None
    assert demo_note([TaskSpec.model_validate(tasks["default"])]) is not None
