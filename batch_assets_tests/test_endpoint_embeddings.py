"""Embedding and similarity tasks through the endpoint engine (`/v1/embeddings`) against a real
`vllm serve` of the embedded all-MiniLM-L6-v2 on vLLM's pooling runner, started with the engine
arguments the in-process engine uses for the shipped `embeddings` task. The shipped tasks, pointed
at it through their YAML, give the vectors (cosine ≥ 0.9999 per row), token counts and similarity
labels the in-process engine gives; a text the server refuses is an error row while the other texts
of its request are embedded."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import dagster as dg
import numpy as np
import pytest

from batch_assets.engines.endpoint_failures import EndpointError
from batch_assets.engines.openai_engine import OpenAIEngine
from batch_assets.pipeline.embeddings.prompts import embedding_encoder
from batch_assets.pipeline.engine_contract import Prompt
from batch_assets.pipeline.result_stores import vectors_matrix
from batch_assets_tests.support import SAMPLES, SERVER_KEY, Server, drop, serving, task_on_endpoint
from batch_assets_tests.support.embeddings import TASKS, TEXTS, cosines, jsonl, metadata_of, read, run
from batch_assets_tests.support.openai_batch import engine_flags

# The slow tier: every test serves the embedding model with `vllm serve`.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def embedding_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """`vllm serve` of the embedded embedding model with the in-process engine's arguments for the
    shipped `embeddings` task (`--runner pooling`, float32, no prefix caching, the CPU's KV cache)."""
    flags = engine_flags(TASKS["embeddings"])
    at = flags.index("--model")
    model = flags[at + 1]
    del flags[at : at + 2]
    with serving(model, tmp_path_factory.mktemp("embedding_server"), *flags) as server:
        yield server


def test_embedding_task_through_vllm_serve_matches_the_in_process_engine(
    tmp_path: Path, data_dir: Path, embedding_server: Server, server_key: str
) -> None:
    drop(data_dir, "embeddings", "via-endpoint.jsonl", jsonl(TEXTS))
    drop(data_dir, "embeddings", "in-process.jsonl", jsonl(TEXTS))
    task = task_on_endpoint(tmp_path, embedding_server, "embeddings")
    with dg.instance_for_test() as instance:
        endpoint_run = run(task, "via-endpoint.jsonl", instance)
        assert endpoint_run.success
        checks = {e.check_name: e.passed for e in endpoint_run.get_asset_check_evaluations()}
        assert checks == {"embeddings_are_valid": True, "one_row_per_record": True, "error_share_below_threshold": True}
        metadata = metadata_of(endpoint_run, "embeddings__inference_outputs")
        recorded = "\n".join(repr(entry) for entry in instance.all_logs(endpoint_run.run_id))
        assert run(TASKS["embeddings"], "in-process.jsonl", instance).success
    assert metadata["engine_settings"]["kind"] == "openai" and metadata["model"] == embedding_server.model
    assert metadata["engine_settings"]["max_model_len"] == 256
    assert SERVER_KEY not in recorded
    via_endpoint = read(data_dir, "embeddings", "validated_labels", "via-endpoint.jsonl")
    in_process = read(data_dir, "embeddings", "validated_labels", "in-process.jsonl")
    assert via_endpoint.schema == in_process.schema
    assert via_endpoint["error"].null_count() == len(TEXTS)
    # The shipped task cuts the last text (300 words) to 256 tokens: locally and, asked to, on the server.
    assert via_endpoint["truncated"].to_list() == in_process["truncated"].to_list() == [False] * 7 + [True]
    assert via_endpoint["num_prompt_tokens"].to_list() == in_process["num_prompt_tokens"].to_list()
    similarity = cosines(vectors_matrix(via_endpoint["embedding"]), vectors_matrix(in_process["embedding"]))
    print(f"min cosine endpoint vs in-process: {similarity.min():.7f}")
    assert similarity.min() >= 0.9999, similarity


def test_similarity_labels_through_vllm_serve_equal_the_in_process_labels(
    tmp_path: Path, data_dir: Path, embedding_server: Server, server_key: str
) -> None:
    sample = SAMPLES / "industry_similarity" / "customers-sample.csv"
    drop(data_dir, "industry_similarity", "via-endpoint.csv", sample.read_bytes())
    drop(data_dir, "industry_similarity", "in-process.csv", sample.read_bytes())
    task = task_on_endpoint(tmp_path, embedding_server, "industry_similarity")
    with dg.instance_for_test() as instance:
        assert run(task, "via-endpoint.csv", instance).success
        assert run(TASKS["industry_similarity"], "in-process.csv", instance).success
    via_endpoint = read(data_dir, "industry_similarity", "validated_labels", "via-endpoint.csv")
    in_process = read(data_dir, "industry_similarity", "validated_labels", "in-process.csv")
    assert via_endpoint.height == in_process.height == 40
    assert via_endpoint["error"].null_count() == 40
    assert via_endpoint["label"].to_list() == in_process["label"].to_list()
    assert np.allclose(via_endpoint["similarity"].to_numpy(), in_process["similarity"].to_numpy(), atol=1e-4)


def test_a_text_the_server_refuses_is_an_error_row_and_the_rest_of_its_request_is_embedded(
    tmp_path: Path, embedding_server: Server, server_key: str
) -> None:
    base = task_on_endpoint(tmp_path, embedding_server, "embeddings")
    # The task believes the model takes 512 tokens; the server knows it takes 256. One request of three.
    engine_settings = {"max_model_len": 512, "concurrency": 1}
    task = base.model_copy(update={"engine": base.engine.model_copy(update=engine_settings)})
    engine = OpenAIEngine()
    texts = ["A ferry leaves hourly.", "word " * 300, "Fresh bread every day."]
    prompts = embedding_encoder(engine.tokenizer(engine.settings(task)), 512, False)(texts)
    generations = engine.generate(task, prompts)
    assert [g.error is None for g in generations] == [True, False, True]
    assert generations[1].error.startswith("endpoint_error: HTTP 400"), generations[1].error
    assert [g.num_prompt_tokens for g in generations] == [len(p) for p in prompts]
    assert [len(g.vector) for g in generations if g.vector is not None] == [384, 384]


def test_a_chat_task_sent_to_the_embedding_models_server_fails_the_run_saying_why(
    tmp_path: Path, embedding_server: Server, server_key: str
) -> None:
    task = task_on_endpoint(tmp_path, embedding_server, "sentiment")
    prompt = Prompt((1, 2, 3), ({"role": "user", "content": "Lovely day at the beach!"},))
    with pytest.raises(EndpointError, match="HTTP 404.*an embedding model's server has no /chat/completions"):
        OpenAIEngine().generate(task, [prompt])
