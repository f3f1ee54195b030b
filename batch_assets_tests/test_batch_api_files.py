"""The batch API engine's pure parts: request lines and their ids, files cut at the provider's
limits, answers read back by `custom_id`, refused line numbers, the batch price, the pool."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from batch_assets.engines.batch_api_files import (
    Answer,
    AnswerCounts,
    chat_body,
    refused_lines,
    request_lines,
    settle_answers,
    split_files,
)
from batch_assets.engines.kinds import ENGINE_KINDS
from batch_assets.pipeline.budget import estimate_cost
from batch_assets.pipeline.code_versions import code_versions
from batch_assets.pipeline.engine_contract import Prompt, ResolvedSettings
from batch_assets.pipeline.prices import engine_price
from batch_assets.pipeline.task_spec import PriceSpec, TaskSpec, TaskSpecError, load_task_spec
from batch_assets_tests.support import REPO_ROOT


def sentiment(tmp_path: Path, engine: str) -> TaskSpec:
    text = (REPO_ROOT / "batch_assets" / "tasks" / "sentiment.yaml").read_text(encoding="utf-8")
    path = tmp_path / "sentiment.yaml"
    path.write_text(text.replace("engine:\n", "engine:\n" + engine, 1), encoding="utf-8")
    return load_task_spec(path)


def test_custom_ids_are_the_bodies_hash_and_rank_so_a_rerun_finds_the_same_ids() -> None:
    bodies = [{"model": "m", "messages": [{"role": "user", "content": text}]} for text in ("a", "b", "a")]
    lines = request_lines(bodies)
    ids = [line.custom_id for line in lines]
    assert ids == [line.custom_id for line in request_lines(bodies)]  # the same in every run
    assert len(set(ids)) == 3 and ids[0].endswith("-0") and ids[2].endswith("-1") and ids[0][:-2] == ids[2][:-2]
    first = json.loads(lines[1].line)
    assert first == {"custom_id": ids[1], "method": "POST", "url": "/v1/chat/completions", "body": bodies[1]}


def test_custom_ids_of_identical_bodies_follow_their_keys_not_their_order() -> None:
    """Without deduplication identical bodies are different rows: a re-run that sends only some of
    them (the others checkpointed) must give each the id it had, not a rank renumbered from 0."""
    body = {"model": "m", "messages": [{"role": "user", "content": "same"}]}
    first = [line.custom_id for line in request_lines([body] * 3, keys=["k0", "k1", "k2"])]
    again = [line.custom_id for line in request_lines([body] * 2, keys=["k1", "k2"])]
    assert len(set(first)) == 3 and again == first[1:]


def test_chat_body_merges_vllm_fields_into_the_body() -> None:
    prompt = Prompt(token_ids=(1,), messages=({"role": "user", "content": "hi"},))
    params = {"model": "m", "max_tokens": 4, "extra_body": {"structured_outputs": {"choice": ["a", "b"]}}}
    assert chat_body(prompt, params) == {
        "model": "m",
        "max_tokens": 4,
        "structured_outputs": {"choice": ["a", "b"]},
        "messages": [{"role": "user", "content": "hi"}],
    }


def test_files_are_cut_at_the_request_and_byte_limits() -> None:
    lines = request_lines([{"n": i, "pad": "x" * 50} for i in range(7)])
    size = len(lines[0].line)
    assert [len(f) for f in split_files(lines, max_requests=3, max_bytes=10**6)] == [3, 3, 1]
    assert [len(f) for f in split_files(lines, max_requests=100, max_bytes=2 * size + 1)] == [2, 2, 2, 1]
    with pytest.raises(ValueError, match="engine.max_bytes_per_file"):
        list(split_files(lines, max_requests=100, max_bytes=size - 1))


def test_answers_are_read_by_custom_id_from_output_and_error_lines() -> None:
    completion = {
        "choices": [{"message": {"content": "positive"}, "finish_reason": "stop", "logprobs": {"content": [
            {"token": "pos", "logprob": -0.25}, {"token": "itive", "logprob": -0.5}]}}],
        "usage": {"prompt_tokens": 12, "completion_tokens": 2},
    }  # fmt: skip
    data = (
        b"\n".join(
            json.dumps(line).encode()
            for line in [
                {"custom_id": "a", "response": {"status_code": 200, "body": completion}, "error": None},
                # OGX sends the body as a JSON string
                {"custom_id": "b", "response": {"status_code": 200, "body": json.dumps(completion)}},
                {"custom_id": "c", "response": {"status_code": 400, "body": {"error": {"message": "too  long"}}}},
                {"custom_id": "d", "response": None, "error": {"code": "batch_expired", "message": "expired"}},
                {"no_custom_id": True},
            ]
        )
        + b"\nnot json\n"
    )
    counts = AnswerCounts()
    answers = settle_answers([data], {"a", "b", "c", "d", "e"}, counts)
    assert set(answers) == {"a", "b", "c", "d"}
    assert counts == AnswerCounts(unreadable_lines=2)  # the line without a custom_id, and "not json"
    for key in ("a", "b"):
        generation = answers[key].generation
        assert generation is not None
        assert (generation.text, generation.num_prompt_tokens, generation.num_generated_tokens) == ("positive", 12, 2)
        assert generation.cumulative_logprob == -0.75
        # The tokens too, for a request that asked for them (the engine keeps them only then).
        assert json.loads(generation.token_logprobs or "")[1] == {
            "token": "itive",
            "logprob": -0.5,
            "bytes": None,
            "top_logprobs": [],
        }
    assert answers["c"] == Answer(error="batch_error: HTTP 400: too long", retryable=False)
    assert answers["d"] == Answer(error="batch_error: batch_expired: expired", retryable=True)


def test_refused_lines_come_from_the_batch_errors_or_the_message() -> None:
    class Entry:
        def __init__(self, line: int | None) -> None:
            self.line = line

    class Errors:
        data = [Entry(3), Entry(None), Entry(7)]

    assert refused_lines(Errors(), "line 9") == {3, 7}
    assert refused_lines(None, "Invalid request on line 12: body.messages is malformed") == {12}
    assert refused_lines(None, "the file is too large") == set()


def test_a_batch_costs_the_price_times_the_batch_factor(tmp_path: Path) -> None:
    price = "  price: {input_per_million_tokens: 2.0, output_per_million_tokens: 8.0}\n"
    batch = sentiment(tmp_path, f"  kind: batch_api\n  base_url: http://127.0.0.1:9/v1\n{price}")
    assert engine_price(batch.engine) == PriceSpec(input_per_million_tokens=1.0, output_per_million_tokens=4.0)
    quarter = sentiment(tmp_path, f"  kind: batch_api\n  batch_price_factor: 0.25\n{price}")
    assert engine_price(quarter.engine) == PriceSpec(input_per_million_tokens=0.5, output_per_million_tokens=2.0)
    endpoint = sentiment(tmp_path, f"  kind: openai\n  batch_price_factor: 0.25\n{price}")
    assert engine_price(endpoint.engine) == endpoint.engine.price  # only a batch API is discounted

    import polars as pl

    from batch_assets.pipeline.task_formats import task_format

    formatted = pl.DataFrame({"error": [None, None], "num_prompt_tokens": [500_000, 500_000]})
    listed, discounted = estimate_cost(formatted, task_format(endpoint)), estimate_cost(formatted, task_format(batch))
    assert listed.cost_usd is not None and discounted.cost_usd == pytest.approx(listed.cost_usd / 2)


def test_batch_settings_change_no_code_version_and_batch_api_has_its_own_pool(tmp_path: Path) -> None:
    resolved = ResolvedSettings(kind="batch_api", model="m", model_setting="", max_model_len=1024)
    plain = sentiment(tmp_path, "  kind: batch_api\n")
    tuned = sentiment(
        tmp_path, "  kind: batch_api\n  poll_seconds: 5\n  max_requests_per_file: 10\n  resubmit_failed: true\n"
    )
    assert code_versions(plain, resolved) == code_versions(tuned, resolved)
    assert ENGINE_KINDS["batch_api"].pool == "batch_api" != ENGINE_KINDS["vllm"].pool


def test_an_embedding_task_on_a_batch_api_is_refused_naming_the_kind(tmp_path: Path) -> None:
    from batch_assets.engines.kinds import resolve_settings

    text = (REPO_ROOT / "batch_assets" / "tasks" / "embeddings.yaml").read_text(encoding="utf-8")
    path = tmp_path / "embeddings.yaml"
    path.write_text(text.replace("engine:\n", "engine:\n  kind: batch_api\n", 1), encoding="utf-8")
    with pytest.raises(TaskSpecError, match="engine.kind openai"):
        resolve_settings(load_task_spec(path))


def test_the_resources_poll_seconds_wins_even_when_zero(tmp_path: Path) -> None:
    from batch_assets.engines.batch_api_engine import BatchApiEngine

    task = sentiment(tmp_path, "  kind: batch_api\n  base_url: http://127.0.0.1:9/v1\n  model: m\n  poll_seconds: 5\n")
    assert BatchApiEngine(poll_seconds=0.0).settings(task).poll_seconds == 0.0
    assert BatchApiEngine(poll_seconds=2.0).settings(task).poll_seconds == 2.0
    assert BatchApiEngine().settings(task).poll_seconds == 5.0


def _line(custom_id: str, text: str | None = None, status: int = 200) -> bytes:
    """An output line answering `text` (status 200), or an error line with `status`."""
    if text is None:
        return json.dumps({"custom_id": custom_id, "response": {"status_code": status, "body": {}}}).encode() + b"\n"
    body = {"choices": [{"message": {"content": text}, "finish_reason": "stop"}], "usage": {"prompt_tokens": 3}}
    return json.dumps({"custom_id": custom_id, "response": {"status_code": 200, "body": body}}).encode() + b"\n"


def test_contradicting_answers_are_settled_and_counted() -> None:
    output = b"".join(
        [_line("same", "positive"), _line("same", "positive"), _line("two", "positive"), _line("two", "negative")]
        + [_line("paid", "neutral"), _line("stranger", "positive"), b'{"custom_id": "cut\n']
    )
    errors = _line("paid", status=500) + _line("failed", status=500) + _line("failed", status=500)
    counts = AnswerCounts()
    answers = settle_answers([output, errors], {"same", "two", "paid", "failed", "unmentioned"}, counts)
    assert {key: (a.generation.text if a.generation else a.error) for key, a in answers.items()} == {
        "same": "positive",
        "two": "batch_conflict: the provider answered this request 2 times with different content "
        "('positive', 'negative'); none of them is kept",
        "paid": "neutral",  # answered 200: the error file's line for it does not throw it away
        "failed": "batch_error: HTTP 500: no detail",
    }
    assert counts == AnswerCounts(conflicts=1, repeated=2, errors_overridden=1, unknown_ids=1, unreadable_lines=1)
    assert counts.summary() == (
        "answer conflicts: 1, answers repeated: 2, errors overridden: 1, unknown ids: 1, unreadable lines: 1"
    )
