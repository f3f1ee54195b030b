"""LoRA adapters per task (`engine.lora`): checked at load, sent with every request, one engine for the
tasks of one base model, and versioned by the adapter's files rather than its folder.

The fast tests read adapter folders only; the one slow test runs the real vLLM engine (tiny model, two
tiny adapters made here) once for everything that needs it, against vLLM's own `LLM.chat` with the
same `LoRARequest` (bench/plain_vllm_script.py), kept as a golden file keyed on what decides it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import dagster as dg
import polars as pl
import pytest

from batch_assets.engines.vllm_engine import VLLMEngine
from batch_assets.engines.vllm_lifecycle import PROCESS_ENGINE
from batch_assets.lib.task_definitions import build_definitions, pipeline_job_name
from batch_assets.pipeline.code_versions import code_versions
from batch_assets.pipeline.task_spec import TaskSpec, TaskSpecError, load_task_spec
from batch_assets.storage.drop_files import partition_key_for, partitions_def_name
from batch_assets_tests.support import REPO_ROOT, drop
from batch_assets_tests.support.golden import content_digest, kept_or_made, versions
from batch_assets_tests.tiny_model import build_tiny_adapter

GOLDEN = "plain_vllm-lora-tiny.json"  # under batch_assets_tests/golden/
ROWS = 500


def task_yaml(name: str, model: str, adapter: Path | str, *, extra: str = "", lora_name: str = "") -> str:
    return f"""name: {name}
input: {{text_fields: [text]}}
prompt:
  system: Answer in a few words.
  template: "Post: {{text}}"
engine:
  model: {model}
  kv_cache_memory_gib: 0.25
{extra}  lora:
    path: {adapter}
{f"    name: {lora_name}" + chr(10) if lora_name else ""}output: {{kind: text}}
sampling: {{max_tokens: 8, temperature: 0.0}}
automation: {{rematerialize_stale: true}}
"""


def write_task(
    folder: Path, name: str, model: str, adapter: Path | str, *, extra: str = "", lora_name: str = ""
) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.yaml"
    path.write_text(task_yaml(name, model, adapter, extra=extra, lora_name=lora_name), encoding="utf-8")
    return path


def fake_base_model(folder: Path) -> Path:
    """A base model's config.json alone: enough to shape and check an adapter without loading weights."""
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 64,
    }
    (folder / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return folder


# --- at load: no engine --------------------------------------------------------------------------


def test_an_adapter_for_another_model_or_too_large_a_rank_is_refused_naming_file_and_line(tmp_path: Path) -> None:
    base = fake_base_model(tmp_path / "base")
    adapter = build_tiny_adapter(tmp_path / "adapter", str(base), rank=32)
    tasks = tmp_path / "tasks"
    assert load_task_spec(write_task(tasks, "ok", str(base), adapter)).engine.lora is not None
    other = fake_base_model(tmp_path / "other")
    cases = {
        "other_model": (str(other), adapter, "", "line 10", "trained on"),
        "no_folder": (str(base), tmp_path / "missing", "", "line 10", "no such folder"),
        "not_adapter": (str(base), base, "", "line 10", "no adapter_config.json"),
        "rank": (str(base), adapter, "  vllm_args: {max_lora_rank: 16}\n", "line 11", "rank 32 is above"),
    }
    for name, (model, folder, extra, line, cause) in cases.items():
        path = write_task(tasks, name, model, folder, extra=extra)
        with pytest.raises(TaskSpecError) as refused:
            load_task_spec(path)
        message = str(refused.value)
        assert message.startswith(f"{path}: engine.lora.path ({line}): "), message
        assert cause in message


def _refusal_within(path: Path, seconds: float, fifo: Path | None = None) -> str:
    """What loading the task refuses it with; the test fails (and the read is released) when the load
    has not ended within `seconds`."""
    outcome: list[str] = []

    def load() -> None:
        try:
            load_task_spec(path)
        except TaskSpecError as exc:
            outcome.append(str(exc))
        else:
            outcome.append("loaded")

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        if fifo is not None:  # a writer ends the read the load is stuck in
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(10)
        pytest.fail(f"loading {path} did not end within {seconds:g} s")
    return outcome[0]


def test_an_adapter_config_that_is_a_fifo_or_malformed_is_one_line_naming_the_setting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Nothing reads a non-regular adapter_config.json (a FIFO would hang the load for good); a
    `rank_pattern` that is no object and JSON nested too deeply are refused as bad ranks are."""
    from batch_assets import cli

    base = fake_base_model(tmp_path / "base")
    tasks = tmp_path / "tasks"
    adapters = {}
    for name, config in {
        "fifo": None,
        "list_pattern": {"r": 8, "rank_pattern": [16, 32]},
        "text_pattern": {"r": 8, "rank_pattern": "q_proj=16"},
        "deep": '{"r": 8, "nested": ' + "[" * 200_000 + "]" * 200_000 + "}",
    }.items():
        adapter = build_tiny_adapter(tmp_path / name, str(base))
        (adapter / "adapter_config.json").unlink()
        if config is None:
            os.mkfifo(adapter / "adapter_config.json")
        else:
            text = config if isinstance(config, str) else json.dumps(config)
            (adapter / "adapter_config.json").write_text(text, encoding="utf-8")
        adapters[name] = write_task(tasks, name, str(base), adapter)
    causes = {
        "fifo": "adapter_config.json: a FIFO (named pipe), not a regular file",
        "list_pattern": "`rank_pattern` must be a JSON object of module names and ranks, not a list",
        "text_pattern": "`rank_pattern` must be a JSON object of module names and ranks, not a string",
        "deep": "adapter_config.json: nested more deeply than",
    }
    for name, path in adapters.items():
        message = _refusal_within(path, 20, fifo=tmp_path / name / "adapter_config.json")
        assert message.startswith(f"{path}: engine.lora.path (line 10): "), message
        assert causes[name] in message and "\n" not in message, message

    # `batch-assets tasks` (the code location loads the tasks the same way) says so, one line each.
    monkeypatch.setenv("BATCH_ASSETS_TASKS_DIR", str(tasks))
    monkeypatch.setenv("BATCH_ASSETS_DATA", str(tmp_path / "data"))
    monkeypatch.delenv("BATCH_ASSETS_MODEL", raising=False)
    assert cli.main(["tasks"]) == 1
    out, err = capsys.readouterr()
    assert out == "" and "Traceback" not in err, err
    for name, cause in causes.items():
        [line] = [line for line in err.splitlines() if line.startswith(f"ERROR: task '{name}' not loaded: ")]
        assert "engine.lora.path (line 10): " in line and cause in line, line


def test_the_adapter_identity_follows_its_files_not_its_folder(tmp_path: Path, monkeypatch) -> None:
    """Code versions and the cache's fingerprint: a copy keeps both, other weights change both."""
    base = fake_base_model(tmp_path / "base")
    monkeypatch.delenv("BATCH_ASSETS_MODEL", raising=False)
    tasks = tmp_path / "tasks"
    adapter = build_tiny_adapter(tmp_path / "a", str(base), seed=1)
    copy = Path(shutil.copytree(adapter, tmp_path / "elsewhere" / "a_copy"))
    other = build_tiny_adapter(tmp_path / "b", str(base), seed=2)
    engine = VLLMEngine()

    def versions_and_fingerprint(folder: Path) -> tuple[dict[str, str], dict]:
        task = load_task_spec(write_task(tasks, "t", str(base), folder))
        return code_versions(task, engine.resolve(task)), engine.settings(task, gpus=0).identity()

    original = versions_and_fingerprint(adapter)
    assert versions_and_fingerprint(copy) == original
    changed = versions_and_fingerprint(other)
    assert changed[0]["inference_outputs"] != original[0]["inference_outputs"]
    assert changed[0]["formatted_prompts"] == original[0]["formatted_prompts"]  # the prompts stay
    assert changed[1]["lora"] != original[1]["lora"]
    # Without an adapter the versions are those of a task that never had the field.
    plain = load_task_spec(write_task(tasks, "t", str(base), adapter)).model_copy()
    plain = plain.model_copy(update={"engine": plain.engine.model_copy(update={"lora": None})})
    assert "lora" not in engine.settings(plain, gpus=0).identity()


def test_tasks_that_differ_only_in_their_adapter_ask_for_one_engine(tmp_path: Path, monkeypatch) -> None:
    base = fake_base_model(tmp_path / "base")
    monkeypatch.delenv("BATCH_ASSETS_MODEL", raising=False)
    small = build_tiny_adapter(tmp_path / "small", str(base), rank=8)
    large = build_tiny_adapter(tmp_path / "large", str(base), rank=64)
    engine, tasks = VLLMEngine(), tmp_path / "tasks"
    with_small = engine.settings(load_task_spec(write_task(tasks, "s", str(base), small)), gpus=0)
    with_large = engine.settings(load_task_spec(write_task(tasks, "l", str(base), large)), gpus=0)
    assert with_small.vllm_args["enable_lora"] and with_small.vllm_args["max_lora_rank"] == 16  # vLLM's default
    assert with_large.vllm_args["max_lora_rank"] == 64
    # The engine of the larger adapter serves the smaller one's task, not the other way round.
    assert with_large.serves(with_small) and not with_small.serves(with_large)
    plain = load_task_spec(write_task(tasks, "p", str(base), small))
    plain = plain.model_copy(update={"engine": plain.engine.model_copy(update={"lora": None})})
    assert not with_small.serves(engine.settings(plain, gpus=0))  # a base task keeps a base engine


# --- on the engine -------------------------------------------------------------------------------


def posts(tag: str) -> str:
    words = ["late", "broken", "great", "refund", "thanks", "lost", "cold", "fast", "rude", "fine"]
    return "".join(
        json.dumps({"id": i, "text": f"{tag} order {i}: {words[i % 10]} {words[(i * 7) % 10]} {i * 37 % 101}"}) + "\n"
        for i in range(ROWS)
    )


def run_partition(task: TaskSpec, file_name: str, instance: dg.DagsterInstance) -> dict:
    key = partition_key_for(file_name)
    instance.add_dynamic_partitions(partitions_def_name(task.name), [key])
    job = build_definitions(tasks=[task]).resolve_job_def(pipeline_job_name(task.name))
    result = job.execute_in_process(instance=instance, partition_key=key)
    node = f"{task.name}__inference_outputs"
    return {k: v.value for k, v in result.asset_materializations_for_node(node)[0].metadata.items()}


def outputs_of(data: Path, task: str, file_name: str) -> list[str]:
    path = data / "storage" / task / "inference_outputs" / f"{partition_key_for(file_name)}.parquet"
    return pl.read_parquet(path).sort("row_id")["generated_text"].to_list()


def stale_partitions(task: TaskSpec, instance: dg.DagsterInstance) -> set[str]:
    evaluated = dg.evaluate_automation_conditions(defs=build_definitions(tasks=[task]), instance=instance)
    return evaluated.get_requested_partitions(dg.AssetKey([task.name, "formatted_prompts"])) | (
        evaluated.get_requested_partitions(dg.AssetKey([task.name, "inference_outputs"]))
    )


def plain_vllm_answers(task_file: Path, source: Path, work: Path, model: str, adapter: Path) -> dict[str, list]:
    """vLLM's own `LLM.chat` with the task's `LoRARequest`, and without it on the same engine: from the
    golden file when it was made for the same vLLM, torch, CPU, weights, adapter, task and rows."""
    identity = {
        **versions(),
        "model": content_digest(Path(model)),
        "adapter": content_digest(adapter),
        "task": task_yaml("x", "MODEL", "ADAPTER"),
        "rows": hashlib.sha256(source.read_bytes()).hexdigest(),
    }
    return kept_or_made(GOLDEN, identity, lambda: plain_vllm_run(task_file, source, work), made_of="weights or rows")


def plain_vllm_run(task_file: Path, source: Path, work: Path) -> dict[str, list]:
    target = work / "plain.parquet"
    env = {**os.environ, "BATCH_ASSETS_TASKS_DIR": str(task_file.parent), "VLLM_LOGGING_LEVEL": "WARNING"}
    script = [sys.executable, str(REPO_ROOT / "bench" / "plain_vllm_script.py"), str(source), str(target)]
    completed = subprocess.run(
        [*script, "--task", task_file.stem, "--base-too"], capture_output=True, text=True, env=env, timeout=600
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    frame = pl.read_parquet(target).sort("id")
    return {"lora": frame["label"].to_list(), "base": frame["base_label"].to_list()}


@pytest.mark.slow
def test_adapters_match_plain_vllm_share_one_engine_and_key_the_cache(
    data_dir: Path, tiny_model: str, tmp_path: Path
) -> None:
    adapters, tasks = tmp_path / "adapters", tmp_path / "tasks"
    adapter_a = build_tiny_adapter(adapters / "a", tiny_model, seed=1)
    adapter_b = build_tiny_adapter(adapters / "b", tiny_model, seed=2)
    task_a = load_task_spec(write_task(tasks, "lora_a", tiny_model, adapter_a))
    task_b = load_task_spec(write_task(tasks, "lora_b", tiny_model, adapter_b))
    drop(data_dir, "lora_a", "posts.jsonl", posts("p"))
    # The second adapter's task needs fewer rows to show it answers otherwise (CPU LoRA is slow).
    drop(data_dir, "lora_b", "posts.jsonl", "".join(posts("p").splitlines(keepends=True)[:100]))
    starts = PROCESS_ENGINE.starts
    with dg.instance_for_test() as instance:
        first = run_partition(task_a, "posts.jsonl", instance)
        second = run_partition(task_b, "posts.jsonl", instance)
        # Two tasks, two adapters, one base model: one engine start between them.
        assert PROCESS_ENGINE.starts - starts <= 1
        assert not second["engine_started_by_this_run"]
        with_a, with_b = outputs_of(data_dir, "lora_a", "posts.jsonl"), outputs_of(data_dir, "lora_b", "posts.jsonl")
        plain = plain_vllm_answers(
            tasks / "lora_a.yaml", data_dir / "drops" / "lora_a" / "posts.jsonl", tmp_path, tiny_model, adapter_a
        )
        assert len(with_a) == ROWS and with_a == plain["lora"]  # vLLM's own answers with the same LoRARequest
        differ = sum(a != base for a, base in zip(with_a, plain["base"], strict=True))
        assert differ > ROWS * 0.9, f"the adapter changed only {differ} of {ROWS} answers"
        assert len(with_b) == 100 and sum(a != b for a, b in zip(with_a, with_b, strict=False)) > 90
        assert first["rows_from_cache"] == 0 and stale_partitions(task_a, instance) == set()

        # The same adapter in another folder: the partition stays fresh and a new file is answered
        # from the cache.
        moved = Path(shutil.copytree(adapter_a, tmp_path / "moved" / "adapter_a"))
        shutil.rmtree(adapter_a)
        task_moved = load_task_spec(write_task(tasks, "lora_a", tiny_model, moved))
        assert stale_partitions(task_moved, instance) == set()
        drop(data_dir, "lora_a", "again.jsonl", posts("p"))
        again = run_partition(task_moved, "again.jsonl", instance)
        assert again["rows_from_cache"] == ROWS and outputs_of(data_dir, "lora_a", "again.jsonl") == with_a

        # Other weights under the same folder: both partitions are stale, and a run infers every row anew.
        build_tiny_adapter(moved, tiny_model, seed=3)
        task_changed = load_task_spec(write_task(tasks, "lora_a", tiny_model, moved))
        assert stale_partitions(task_changed, instance) == {
            partition_key_for("posts.jsonl"),
            partition_key_for("again.jsonl"),
        }
        rerun = run_partition(task_changed, "posts.jsonl", instance)
        assert rerun["rows_from_cache"] == 0 and rerun["rows_from_checkpoint"] == 0
        assert sum(a != b for a, b in zip(outputs_of(data_dir, "lora_a", "posts.jsonl"), with_a, strict=True)) > (
            ROWS * 0.9
        )
        assert PROCESS_ENGINE.starts - starts <= 1  # the changed adapter is loaded by the same engine


def test_an_endpoint_is_sent_the_adapter_name_and_serve_routes_a_batch_naming_it(tmp_path: Path) -> None:
    """kind openai / batch_api: the server holds the adapter (`vllm serve --lora-modules NAME=FOLDER`),
    requests name it as their model, prompts are counted with the base model's tokenizer; a batch
    sent to `batch-assets serve` whose lines name an adapter runs the task of that adapter."""
    from batch_assets.engines.batch_api_engine import BatchApiEngine
    from batch_assets.engines.endpoint_requests import chat_request_params
    from batch_assets.engines.openai_engine import OpenAIEngine
    from batch_assets.serve.batch_runs import BatchRunner

    base = fake_base_model(tmp_path / "base")
    adapter = build_tiny_adapter(tmp_path / "tickets", str(base))
    endpoint = "  kind: openai\n  base_url: http://127.0.0.1:9/v1\n"
    task = load_task_spec(
        write_task(tmp_path / "tasks", "named", str(base), adapter, extra=endpoint, lora_name="tickets-v2")
    )
    for engine in (OpenAIEngine(), BatchApiEngine()):
        settings = engine.settings(task)
        assert settings.model == "tickets-v2" and settings.tokenizer == str(base.resolve())
        assert chat_request_params(task, settings.model)["model"] == "tickets-v2"
        assert settings.identity()["lora"].startswith("sha256:")  # the local copy's files identify it
    chat = {"/v1/chat/completions": "openai_batch"}
    runner = BatchRunner(store=None, tasks=chat, adapters={"tickets-v2": "tickets"})  # type: ignore[arg-type]
    lines = tmp_path / "batch.jsonl"
    lines.write_text(json.dumps({"custom_id": "1", "body": {"model": "tickets-v2", "messages": []}}) + "\n")
    assert runner.task_for("/v1/chat/completions", lines) == "tickets"
    lines.write_text(json.dumps({"custom_id": "1", "body": {"model": "other", "messages": []}}) + "\n")
    assert runner.task_for("/v1/chat/completions", lines) == "openai_batch"
