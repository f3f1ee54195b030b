"""The endpoint engine against a local server that misbehaves on purpose.

A small stdlib HTTP server on 127.0.0.1 speaks just enough of the chat-completions API and, per
prompt, answers with 429s, 500s, slow responses (past the client's timeout) or a dropped
connection before it answers properly. The tests check what users rely on: transient faults are
retried away, a request that keeps failing becomes an error row in an otherwise good partition,
a server that is down, refuses the key or fails everything fails the run with a clear message,
finished batches resume from checkpoints, and the API key never shows up in what the run records.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import signal
import socket
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import dagster as dg
import polars as pl
import pytest

from batch_assets.engines.endpoint_failures import EndpointError
from batch_assets.engines.endpoint_requests import chat_request_params
from batch_assets.engines.engine_figures import EndpointFigures
from batch_assets.engines.openai_engine import OpenAIEngine
from batch_assets.lib.task_definitions import build_definitions
from batch_assets.pipeline.engine_contract import Prompt
from batch_assets.pipeline.task_spec import load_task_spec
from batch_assets_tests.support import REPO_ROOT, drop, failure_messages, free_port, read_output, run_partition

# The slow tier (`make test-fast` leaves it out): every test uses the tiny model's tokenizer and a local server.
pytestmark = pytest.mark.slow

API_KEY = "test-key-5f3a9c1e-never-logged"
MODEL = "fault-model"


class FaultServer:
    """Chat completions with scripted faults: `plan[word]` lists what successive requests whose
    user message contains `word` get: "429", "500", "slow", "drop", "401", "garbage" (a 200 that
    is not JSON), "sigint" (SIGINT to this process, then a slow answer),
    "400" (this request refused), "400-setting" (every request refused alike),
    "400-logprobs" (a server refusing the `logprobs` field) or "ok". The last step repeats.
    Prompts matching no word get "ok"."""

    def __init__(self, slow_seconds: float = 1.5, ok_delay: float = 0.0) -> None:
        self.plan: dict[str, list[str]] = {}
        self.slow_seconds = slow_seconds
        self.ok_delay = ok_delay
        self.attempts: Counter[str] = Counter()
        self.in_flight = 0
        self.max_in_flight = 0
        self.bodies: list[dict] = []
        self.headers_seen: list[dict] = []
        self._lock = threading.Lock()
        self._steps: dict[str, int] = defaultdict(int)
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # keep test output quiet
                pass

            def do_GET(self) -> None:
                if self.path.rstrip("/").endswith("/models"):
                    self._json(200, {"object": "list", "data": [{"id": MODEL, "object": "model"}]})
                else:
                    self._json(404, {"error": {"message": "no such route"}})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                if self.path.endswith("/embeddings"):
                    self._json(200, embeddings_response(body))
                    return
                user = body["messages"][-1]["content"]
                action = server._next_action(user, body, {k.lower(): v for k, v in self.headers.items()})
                with server._lock:
                    server.in_flight += 1
                    server.max_in_flight = max(server.max_in_flight, server.in_flight)
                try:
                    self._act(action, body)
                finally:
                    with server._lock:
                        server.in_flight -= 1

            def _act(self, action: str, body: dict) -> None:
                if action == "drop":
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                elif action == "400":  # this request's own content refused, as vLLM words it
                    tokens = 2048 + len(json.dumps(body))
                    message = f"This model's maximum context length is 2048 tokens; this request has {tokens}"
                    self._json(400, {"error": {"message": message}})
                elif action == "400-setting":  # every request refused alike: a setting of the task
                    self._json(400, {"error": {"message": "Unrecognized request argument: structured_outputs"}})
                elif action == "400-logprobs":
                    self._json(400, {"error": {"message": "logprobs is not supported for this model"}})
                elif action == "429":
                    self._json(429, {"error": {"message": "rate limited"}}, {"Retry-After": "0.05"})
                elif action == "500":
                    self._json(500, {"error": {"message": "internal server error"}})
                elif action == "401":
                    # A careless server echoing the credentials: they must not reach our errors.
                    self._json(401, {"error": {"message": f"bad key {self.headers.get('Authorization')}"}})
                elif action == "garbage":
                    data = b"<html>502 Bad Gateway</html>"
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                elif action == "sigint":  # Ctrl-C (as Dagster sees it in the step) while the request runs
                    os.kill(os.getpid(), signal.SIGINT)
                    time.sleep(server.slow_seconds)
                    with contextlib.suppress(OSError):  # the stopped run may have closed the connection
                        self._completion(body)
                elif action == "slow":
                    time.sleep(server.slow_seconds)
                    with contextlib.suppress(OSError):  # the client gave up already
                        self._completion(body)
                else:
                    time.sleep(server.ok_delay)
                    self._completion(body)

            def _completion(self, body: dict) -> None:
                choice = (body.get("structured_outputs") or {}).get("choice")
                text = choice[len(body["messages"][-1]["content"]) % len(choice)] if choice else "free text answer"
                self._json(
                    200,
                    {
                        "id": "chatcmpl-test",
                        "object": "chat.completion",
                        "created": 0,
                        "model": body["model"],
                        "choices": [
                            {
                                "index": 0,
                                "message": {"role": "assistant", "content": text},
                                "finish_reason": "stop",
                                # Two tokens at log-probability -0.1 each, when asked for; a server
                                # may also not return any ("quiet" prompts here).
                                "logprobs": {
                                    "content": [
                                        {"token": t, "logprob": -0.1, "bytes": None, "top_logprobs": []}
                                        for t in ("a", "b")
                                    ]
                                }
                                if body.get("logprobs") and "quiet" not in body["messages"][-1]["content"]
                                else None,
                            }
                        ],
                        "usage": {"prompt_tokens": 11, "completion_tokens": 2, "total_tokens": 13},
                    },
                )

            def _json(self, status: int, payload: dict, headers: dict | None = None) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for name, value in (headers or {}).items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.base_url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def _next_action(self, user: str, body: dict, headers: dict) -> str:
        with self._lock:
            self.bodies.append(body)
            self.headers_seen.append(headers)
            word = next((w for w in self.plan if w in user), None)
            if word is None:
                self.attempts["*"] += 1
                return "ok"
            self.attempts[word] += 1
            steps = self.plan[word]
            action = steps[min(self._steps[word], len(steps) - 1)]
            self._steps[word] += 1
            return action

    def __enter__(self) -> FaultServer:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def embeddings_response(body: dict) -> dict:
    """`/v1/embeddings`: a unit vector per text, the same for the same text (from its hash)."""
    vectors = []
    for text in body["input"]:
        digest = hashlib.sha256(text.encode()).digest()[:8]
        norm = sum(b * b for b in digest) ** 0.5
        vectors.append([b / norm for b in digest])
    data = [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(vectors)]
    return {"object": "list", "data": data, "model": body["model"], "usage": {"prompt_tokens": 1, "total_tokens": 1}}


@pytest.fixture
def fault_server() -> Iterator[FaultServer]:
    with FaultServer() as server:
        yield server


def endpoint_task(tmp_path: Path, base_url: str, tiny_model_path: str, **engine: object):
    """The shipped `sentiment` task pointed at an endpoint through its YAML, as a user would."""
    settings = {
        "kind": "openai",
        "base_url": base_url,
        "model": MODEL,
        "api_key_env": "BATCH_ASSETS_TEST_ENDPOINT_KEY",
        "tokenizer": tiny_model_path,
        "max_model_len": 1024,
        "concurrency": 4,
        "request_timeout_s": 0.5,
        "max_retries": 2,
        **engine,
    }
    lines = "".join(f"  {key}: {json.dumps(value)}\n" for key, value in settings.items())
    text = (REPO_ROOT / "batch_assets" / "tasks" / "sentiment.yaml").read_text(encoding="utf-8")
    text = text.replace("engine:\n  max_model_len: 1024\n", "engine:\n" + lines)
    text = text.replace("max_error_share: 0.05", "max_error_share: 0.5")
    folder = tmp_path / "tasks"
    folder.mkdir(exist_ok=True)
    (folder / "sentiment.yaml").write_text(text, encoding="utf-8")
    return load_task_spec(folder / "sentiment.yaml")


POSTS = [
    "alpha is great",
    "bravo was awful",
    "charlie meeting at noon",
    "delta is fine",
    "echo loved it",
    "foxtrot tonight",
]


def posts_jsonl(texts: list[str]) -> str:
    return "".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(texts))


@pytest.fixture
def endpoint_key(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("BATCH_ASSETS_TEST_ENDPOINT_KEY", API_KEY)
    return API_KEY


@dataclass(frozen=True)
class FaultyEndpoint:
    """The fault server with its key set, the data folder, and the sentiment task pointed at it."""

    server: FaultServer
    tasks_dir: Path
    data_dir: Path
    tokenizer: str

    def task(self, **engine: object):
        return endpoint_task(self.tasks_dir, self.server.base_url, self.tokenizer, **engine)


@pytest.fixture
def faulty(
    tmp_path: Path, data_dir: Path, tiny_model_path: str, fault_server: FaultServer, endpoint_key: str
) -> FaultyEndpoint:
    return FaultyEndpoint(fault_server, tmp_path, data_dir, tiny_model_path)


def all_run_text(instance: dg.DagsterInstance, run_id: str) -> str:
    """Everything the run recorded: events, metadata, errors."""
    return "\n".join(repr(entry) for entry in instance.all_logs(run_id))


def run_posts(data_dir: Path, task, instance: dg.DagsterInstance):
    """POSTS dropped as the sentiment task's `posts.jsonl`, run as one partition of `task`: (key, result)."""
    drop(data_dir, "sentiment", "posts.jsonl", posts_jsonl(POSTS))
    return run_partition("sentiment", "posts.jsonl", instance, build_definitions(tasks=[task]))


def test_request_fields_follow_vllms_protocol(tmp_path: Path, tiny_model_path: str) -> None:
    task = endpoint_task(tmp_path, "http://127.0.0.1:9/v1", tiny_model_path)
    params = chat_request_params(task, "m")
    assert params["extra_body"] == {"structured_outputs": {"choice": ["positive", "negative", "neutral"]}}
    assert params["max_tokens"] == 10 and params["temperature"] == 0
    # vLLM's own request model accepts exactly these fields, constraint included.
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    body = {k: v for k, v in params.items() if k != "extra_body"} | params["extra_body"]
    request = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **body})
    assert request.structured_outputs.choice == ["positive", "negative", "neutral"]
    # Choice (and regex) tasks ask for the sampled tokens' log-probabilities: the labels' confidence.
    assert params["logprobs"] is True and request.logprobs is True and not request.top_logprobs
    assert "logprobs" not in chat_request_params(task, "m", logprobs=False)

    schema = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    json_task = task.model_copy(
        update={
            "output": task.output.model_copy(update={"kind": "json_schema", "json_schema": schema, "choices": None})
        }
    )
    params = chat_request_params(json_task, "m")
    request = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **params})
    assert request.extract_structured_outputs().json == schema
    assert "logprobs" not in params  # a JSON object's probability says little: no confidence asked


def test_transient_faults_are_retried_and_every_row_succeeds(
    tmp_path: Path, tiny_model_path: str, fault_server: FaultServer, endpoint_key: str
) -> None:
    fault_server.plan = {
        "alpha": ["429", "429", "ok"],
        "bravo": ["500", "ok"],
        "charlie": ["drop", "ok"],
        "delta": ["slow", "ok"],
    }
    task = endpoint_task(tmp_path, fault_server.base_url, tiny_model_path)
    engine = OpenAIEngine()
    tokenizer = engine.tokenizer(engine.settings(task))
    prompts = [Prompt(tuple(tokenizer(p)["input_ids"]), ({"role": "user", "content": p},)) for p in POSTS]
    figures = EndpointFigures()
    generations = engine.generate(task, prompts, figures=figures)
    assert [g.error for g in generations] == [None] * len(POSTS)
    assert all(g.text in ("positive", "negative", "neutral") for g in generations)
    assert (generations[0].num_prompt_tokens, generations[0].num_generated_tokens) == (11, 2)  # the server's usage
    assert fault_server.attempts == Counter({"alpha": 3, "bravo": 2, "charlie": 2, "delta": 2, "*": 2})
    # What inference_outputs records of the traffic: every attempt, the retries, the 429s, the latency
    # (the slow request's 0.5 s timeout and its retry within its call's).
    seen = figures.metadata()
    assert (seen["http_requests"], seen["http_retries"], seen["http_429s"]) == (11, 5, 2), seen
    assert 0 < seen["latency_p50_s"] <= seen["latency_p95_s"] and seen["latency_p95_s"] > 0.5
    assert {h.get("authorization") for h in fault_server.headers_seen} == {f"Bearer {API_KEY}"}


def test_confidence_comes_from_the_servers_log_probabilities_when_it_returns_them(
    tmp_path: Path, tiny_model_path: str, fault_server: FaultServer, endpoint_key: str
) -> None:
    task = endpoint_task(tmp_path, fault_server.base_url, tiny_model_path)
    prompts = [Prompt((1, 2, 3), ({"role": "user", "content": text},)) for text in ("loud post", "quiet post")]
    answered, quiet = OpenAIEngine().generate(task, prompts)
    assert answered.cumulative_logprob == pytest.approx(-0.2) and quiet.cumulative_logprob is None
    assert [body.get("logprobs") for body in fault_server.bodies] == [True, True]
    assert answered.token_logprobs is None  # a label's confidence keeps only the sum
    # An OpenAI batch line's own `logprobs` request: sent as asked, the server's tokens kept.
    from batch_assets.pipeline.openai_batch.sampling import RequestSampling

    fault_server.bodies = []
    line = Prompt((1, 2, 3), ({"role": "user", "content": "loud line"},), RequestSampling(logprobs=1))
    [asked] = OpenAIEngine().generate(task, [line])
    assert (fault_server.bodies[0]["logprobs"], fault_server.bodies[0]["top_logprobs"]) == (True, 1)
    tokens = [{"token": t, "logprob": -0.1, "bytes": None, "top_logprobs": []} for t in ("a", "b")]
    assert json.loads(asked.token_logprobs) == tokens
    # A server that refuses the field fails the run naming the switch, which turns it off.
    fault_server.plan = {"loud": ["400-logprobs"]}
    with pytest.raises(EndpointError, match="refuses `logprobs`.*set `logprobs=False` on the `llm_endpoint` resource"):
        OpenAIEngine().generate(task, prompts[:1])
    fault_server.plan, fault_server.bodies = {}, []
    [plain] = OpenAIEngine(logprobs=False).generate(task, prompts[:1])
    assert plain.cumulative_logprob is None and "logprobs" not in fault_server.bodies[0]


def test_per_request_sampling_and_output_overrides_reach_the_server(
    tmp_path: Path, tiny_model_path: str, fault_server: FaultServer, endpoint_key: str
) -> None:
    """`Prompt.sampling` / `Prompt.output` replace the task's for one request (the OpenAI batch format)."""
    from batch_assets.pipeline.task_spec import OutputSpec, SamplingSpec

    task = endpoint_task(tmp_path, fault_server.base_url, tiny_model_path)
    prompts = [
        Prompt((1, 2, 3), ({"role": "user", "content": "task defaults"},)),
        Prompt(
            (1, 2, 3),
            ({"role": "user", "content": "overridden"},),
            sampling=SamplingSpec(max_tokens=5, temperature=0.7),
            output=OutputSpec(kind="choices", choices=["yes", "no"]),
        ),
    ]
    defaults, overridden = OpenAIEngine().generate(task, prompts)
    assert defaults.text in ("positive", "negative", "neutral") and overridden.text in ("yes", "no")
    sent = {body["messages"][-1]["content"]: body for body in fault_server.bodies}
    assert (sent["task defaults"]["max_tokens"], sent["task defaults"]["temperature"]) == (
        task.sampling.max_tokens,
        0.0,
    )
    assert (sent["overridden"]["max_tokens"], sent["overridden"]["temperature"]) == (5, 0.7)
    assert sent["overridden"]["structured_outputs"] == {"choice": ["yes", "no"]}


def test_requests_in_flight_are_limited_by_concurrency(tmp_path: Path, tiny_model_path: str, endpoint_key: str) -> None:
    with FaultServer(ok_delay=0.3) as server:
        task = endpoint_task(tmp_path, server.base_url, tiny_model_path, concurrency=3, request_timeout_s=30)
        prompts = [Prompt((1, 2, 3), ({"role": "user", "content": f"post {i}"},)) for i in range(12)]
        generations = OpenAIEngine().generate(task, prompts)
    assert all(g.error is None for g in generations)
    assert 1 < server.max_in_flight <= 3


def test_a_request_that_keeps_failing_becomes_an_error_row(faulty: FaultyEndpoint) -> None:
    faulty.server.plan = {
        "bravo": ["500"],
        "delta": ["slow"],
        "echo": ["drop"],
        "foxtrot": ["garbage"],
        "alpha": ["429", "ok"],
    }
    task = faulty.task()
    with dg.instance_for_test() as instance:
        key, result = run_posts(faulty.data_dir, task, instance)
        assert result.success, failure_messages(result)
        recorded = all_run_text(instance, result.run_id)
    labels = read_output(faulty.data_dir, "sentiment", "validated_labels", key)
    errors = dict(zip(labels["text"], labels["error"], strict=True))
    assert errors["bravo was awful"].startswith("endpoint_error: HTTP 500")
    assert errors["delta is fine"].startswith("endpoint_timeout:")
    assert errors["echo loved it"].startswith("endpoint_connection:")
    assert errors["foxtrot tonight"].startswith("endpoint_error:")
    assert errors["alpha is great"] is None and errors["charlie meeting at noon"] is None
    assert labels.filter(pl.col("error").is_null())["label"].is_in(["positive", "negative", "neutral"]).all()
    assert faulty.server.attempts["bravo"] == 3  # max_retries 2: three attempts before giving up
    assert API_KEY not in recorded


def test_server_down_fails_the_run_with_a_clear_message(
    tmp_path: Path, data_dir: Path, tiny_model_path: str, endpoint_key: str
) -> None:
    base_url = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens here
    task = endpoint_task(tmp_path, base_url, tiny_model_path, max_retries=1)
    with dg.instance_for_test() as instance:
        key, result = run_posts(data_dir, task, instance)
        assert not result.success
        message = "\n".join(failure_messages(result))
        assert "cannot connect to the endpoint" in message and base_url in message
        assert API_KEY not in all_run_text(instance, result.run_id)
    # The failure is in the inference step; parsing and formatting did not need the server.
    assert (data_dir / "storage" / "sentiment" / "formatted_prompts" / f"{key}.parquet").exists()
    assert not (data_dir / "storage" / "sentiment" / "inference_outputs" / f"{key}.parquet").exists()


def test_model_discovery_against_a_down_server_names_the_server(
    tmp_path: Path, tiny_model_path: str, endpoint_key: str
) -> None:
    base_url = f"http://127.0.0.1:{free_port()}/v1"
    task = endpoint_task(tmp_path, base_url, tiny_model_path, model="embedded:SmolLM2-135M-Instruct", max_retries=0)
    with pytest.raises(EndpointError, match="cannot connect to the endpoint"):
        OpenAIEngine().settings(task)


def test_a_refused_key_fails_the_run_without_revealing_it(faulty: FaultyEndpoint) -> None:
    faulty.server.plan = {"": ["401"]}  # every prompt
    task = faulty.task()
    with dg.instance_for_test() as instance:
        _, result = run_posts(faulty.data_dir, task, instance)
        assert not result.success
        message = "\n".join(failure_messages(result))
        assert "HTTP 401" in message and "API key" in message
        assert API_KEY not in all_run_text(instance, result.run_id)


def test_a_batch_whose_every_request_the_server_refuses_becomes_error_rows_not_a_failed_run(
    faulty: FaultyEndpoint,
) -> None:
    # Batches of 2: the server answers both requests of [charlie, delta] with a 400 of their own.
    faulty.server.plan = {"charlie": ["400"], "delta": ["400"]}
    task = faulty.task(batch_size=2, max_retries=0)
    with dg.instance_for_test() as instance:
        key, result = run_posts(faulty.data_dir, task, instance)
        assert result.success, failure_messages(result)
    labels = read_output(faulty.data_dir, "sentiment", "validated_labels", key)
    errors = dict(zip(labels["text"], labels["error"], strict=True))
    assert errors["charlie meeting at noon"].startswith("endpoint_error: HTTP 400: This model's maximum context")
    assert errors["delta is fine"].startswith("endpoint_error: HTTP 400")
    assert sum(error is not None for error in errors.values()) == 2 and labels.height == len(POSTS)
    assert faulty.server.attempts["charlie"] == 1  # a refusal is not retried


def test_the_same_refusal_of_every_request_of_a_batch_is_a_setting_and_fails_the_run(faulty: FaultyEndpoint) -> None:
    faulty.server.plan = {"charlie": ["400-setting"], "delta": ["400-setting"]}
    task = faulty.task(batch_size=2, max_retries=0)
    with dg.instance_for_test() as instance:
        _, failed = run_posts(faulty.data_dir, task, instance)
        assert not failed.success
        assert "Unrecognized request argument" in "\n".join(failure_messages(failed))


def test_a_failed_batch_fails_the_run_and_a_rerun_resumes_from_checkpoints(faulty: FaultyEndpoint) -> None:
    # Batches of 2: [alpha, bravo] succeeds, then the server fails everything in [charlie, delta].
    faulty.server.plan = {"charlie": ["500"], "delta": ["500"]}
    task = faulty.task(batch_size=2, max_retries=0)
    drop(faulty.data_dir, "sentiment", "posts.jsonl", posts_jsonl(POSTS))
    defs = build_definitions(tasks=[task])
    with dg.instance_for_test() as instance:
        key, first = run_partition("sentiment", "posts.jsonl", instance, defs)
        assert not first.success
        assert "all 2 requests of this batch" in "\n".join(failure_messages(first))
        sent_before = Counter(faulty.server.attempts)

        faulty.server.plan = {}  # the server recovers
        faulty.server.attempts.clear()
        job = defs.resolve_job_def("sentiment_pipeline")
        second = job.execute_in_process(instance=instance, partition_key=key, raise_on_error=False)
        assert second.success, failure_messages(second)
        metadata = second.asset_materializations_for_node("sentiment__inference_outputs")[0].metadata
    assert sent_before["*"] == 2  # alpha and bravo were answered in the first run ...
    assert metadata["rows_from_checkpoint"].value == 2  # ... and reused, not asked again
    assert metadata["rows_inferred"].value == 4 and faulty.server.attempts["*"] == 4
    labels = read_output(faulty.data_dir, "sentiment", "validated_labels", key)
    assert labels["error"].null_count() == labels.height == len(POSTS)


def test_endpoint_settings_are_checked_without_echoing_secrets(tmp_path: Path, tiny_model_path: str) -> None:
    from batch_assets.pipeline.task_spec import TaskSpecError

    task = endpoint_task(tmp_path, "http://127.0.0.1:9/v1", tiny_model_path)
    path = tmp_path / "tasks" / "sentiment.yaml"
    text = path.read_text()
    path.write_text(text.replace('api_key_env: "BATCH_ASSETS_TEST_ENDPOINT_KEY"', f'api_key_env: "{API_KEY}"'))
    with pytest.raises(TaskSpecError, match="api_key_env must be the name of an environment variable") as error:
        load_task_spec(path)
    assert API_KEY not in str(error.value)

    path.write_text(text.replace("http://127.0.0.1:9/v1", f"http://user:{API_KEY}@127.0.0.1:9/v1"))
    with pytest.raises(TaskSpecError, match="must not contain credentials") as error:
        load_task_spec(path)
    assert API_KEY not in str(error.value)

    no_server = task.model_copy(update={"engine": task.engine.model_copy(update={"base_url": None})})
    with pytest.raises(EndpointError, match="set `engine.base_url`"):
        OpenAIEngine().settings(no_server)


def test_a_run_resolves_the_endpoint_settings_once_per_step_not_per_batch(
    faulty: FaultyEndpoint,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """formatted_prompts and inference_outputs each work out the settings once and hand them to the
    tokenizer, the session and every batch (three batches of two here)."""
    task = faulty.task(batch_size=2)
    drop(faulty.data_dir, "sentiment", "posts.jsonl", posts_jsonl(POSTS))
    defs = build_definitions(tasks=[task])
    made = []
    settings = OpenAIEngine.settings
    monkeypatch.setattr(OpenAIEngine, "settings", lambda self, task: made.append(task.name) or settings(self, task))
    with dg.instance_for_test() as instance:
        _, result = run_partition("sentiment", "posts.jsonl", instance, defs)
    assert result.success, failure_messages(result)
    assert faulty.server.attempts["*"] == len(POSTS)
    assert made == ["sentiment", "sentiment"]
    metadata = result.asset_materializations_for_node("sentiment__inference_outputs")[0].metadata
    assert metadata["model"].value == MODEL
    assert metadata["model_chosen_by"].value == "`engine.model` in the task file of 'sentiment'"


# --- What `batch-assets run` prints and exits with when the task's own checks fail (issue 47) --------


def summary_line_of(output: str, partition: str) -> str:
    [line] = [line for line in output.splitlines() if line.startswith(f"{partition}: ")]
    return line


def test_run_names_every_failed_warn_check_and_fails_on_them_only_when_asked(
    tmp_path: Path,
    faulty: FaultyEndpoint,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
) -> None:
    """Before: `OK run ...: 6 rows ... (accuracy 0% ...)`, exit 0, naming no failed check. The server
    answers each post with choices[len(user message) % 3]; the hand labels are the next choice, so
    accuracy is 0 and `accuracy_at_least` (WARN, min_accuracy 0.8) fails; the other checks pass."""
    from batch_assets.cli import main

    faulty.task()
    monkeypatch.setenv("BATCH_ASSETS_TASKS_DIR", str(tmp_path / "tasks"))
    choices = ["positive", "negative", "neutral"]
    answered = [choices[len(f"Post: {text}\nSentiment:") % 3] for text in POSTS]
    wrong = [choices[(choices.index(label) + 1) % 3] for label in answered]
    rows = "".join(json.dumps({"text": t, "sentiment": g}) + "\n" for t, g in zip(POSTS, wrong, strict=True))
    for name in ("posts.jsonl", "again.jsonl"):
        (tmp_path / name).write_text(rows)
    failed = "WARN CHECKS FAILED (sentiment/validated_labels:accuracy_at_least (WARN))"

    assert main(["run", "sentiment", str(tmp_path / "posts.jsonl")]) == 0
    line = summary_line_of(capfd.readouterr().out, "sentiment/posts.jsonl")
    assert line.startswith(f"sentiment/posts.jsonl: {failed} run ")
    assert "6 rows, 0 error rows" in line and "(accuracy 0% on 6 hand-labelled rows" in line

    assert main(["run", "sentiment", "--fail-on-warn", str(tmp_path / "again.jsonl")]) == 1
    line = summary_line_of(capfd.readouterr().out, "sentiment/again.jsonl")
    assert line.startswith(f"sentiment/again.jsonl: {failed} run ")
    assert labels_of(faulty.data_dir, "again.jsonl") == answered


def labels_of(data: Path, file_name: str) -> list[str]:
    from batch_assets.storage.drop_files import partition_key_for

    return read_output(data, "sentiment", "validated_labels", partition_key_for(file_name))["label"].to_list()


def test_a_degenerate_cascade_names_its_failed_error_share_check(
    tmp_path: Path,
    data_dir: Path,
    fault_server: FaultServer,
    endpoint_key: str,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
) -> None:
    """Before: one choice and a teacher that gives that one label, on a 3-row file: 2 of the 3 rows
    were `cascade_no_student` errors (no student trains on one label) and the run printed `OK`."""
    from batch_assets.cli import main

    text = (REPO_ROOT / "batch_assets" / "tasks" / "industry_cascade.yaml").read_text(encoding="utf-8")
    text = re.sub(r"choices: \[Law Firm, .*\]", "choices: [Other]", text)
    engine = f"engine:\n  kind: openai\n  base_url: {fault_server.base_url}\n  model: {MODEL}\n"
    text = text.replace("engine:\n", engine + "  api_key_env: BATCH_ASSETS_TEST_ENDPOINT_KEY\n", 1)
    (tmp_path / "tasks").mkdir()
    for in_process_only in ("  model: embedded:all-MiniLM-L6-v2\n", "  vllm_args: {dtype: float32}\n"):
        text = text.replace(in_process_only, "")
    (tmp_path / "tasks" / "industry_cascade.yaml").write_text(text)
    monkeypatch.setenv("BATCH_ASSETS_TASKS_DIR", str(tmp_path / "tasks"))
    (tmp_path / "three.csv").write_text("Company,Industry\nAcme Corp,Other\nGlobex,Other\nInitech,Other\n")

    assert main(["run", "industry_cascade", "--fail-on-warn", str(tmp_path / "three.csv")]) == 1
    line = summary_line_of(capfd.readouterr().out, "industry_cascade/three.csv")
    assert line.startswith(
        "industry_cascade/three.csv: WARN CHECKS FAILED (industry_cascade/validated_labels:accuracy_at_least (WARN), "
        "industry_cascade/validated_labels:error_share_below_threshold (WARN)) run "
    )
    assert "3 rows, 2 error rows (cascade_no_student=2), labels: Other=1 (accuracy 33% on 3 hand-labelled rows" in line
    labels = read_output(data_dir, "industry_cascade", "validated_labels", "three.csv")
    assert labels["error"].str.starts_with("cascade_no_student: ").sum() == 2


def test_a_stop_during_a_range_run_keeps_every_finished_result_of_each_partition(
    tmp_path: Path,
    faulty: FaultyEndpoint,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 47: a stop is a BaseException and only an engine Exception flushed the sinks. Two files,
    one range run, calls of 4 requests: the first call answers a1-a3 (file a's last results: its
    chunk is written) and b1 (file b's first: short of a chunk); a SIGINT arrives during the second
    call. Before, b1 was in no checkpoint and nothing in the result cache."""
    from batch_assets.app.runner import run_partitions
    from batch_assets.runtime import interrupts
    from batch_assets.storage.checkpoints import CheckpointStore
    from batch_assets.storage.locations import checkpoint_dir, task_storage_dir
    from batch_assets.storage.result_cache import ResultCache

    faulty.task(batch_size=4, concurrency=2)
    monkeypatch.setenv("BATCH_ASSETS_TASKS_DIR", str(tmp_path / "tasks"))
    # One SIGINT: a plan's last action repeats, and a second request for b2 (a retry under load) would
    # be a second Ctrl-C, which ends the process at once (in a test worker: the worker).
    faulty.server.plan = {"b2": ["sigint"]}
    files = []
    for name, texts in (("a.jsonl", ["a1", "a2", "a3"]), ("b.jsonl", ["b1", "b2", "b3"])):
        (tmp_path / name).write_text(posts_jsonl(texts))
        files.append(tmp_path / name)
    # Where an earlier test ran the command line in this process, its signal watcher sees the SIGINT
    # too: the stop it records is this test's, and the runner then stops as the command would.
    monkeypatch.setattr(interrupts, "STOP", threading.Event())
    # The fault server sends SIGINT for each request of b2 (a retry under load sends a second): to
    # that watcher a later one is "interrupted twice", which ends the process at once (here: the test
    # worker, as CI saw). This test is about the first stop.
    monkeypatch.setattr(interrupts, "_SAME_SIGNAL_SECONDS", 3600.0)
    with contextlib.suppress(interrupts.Stopped):
        run_partitions("sentiment", files)
    with dg.DagsterInstance.get() as instance:
        [run] = instance.get_runs()
        failures = [
            e.dagster_event
            for e in instance.all_logs(run.run_id)
            if e.dagster_event and e.dagster_event.is_step_failure
        ]
    assert [f.step_key for f in failures] == ["sentiment__inference_outputs"]
    assert "stopped (interrupted)" in failures[0].step_failure_data.error.to_string()

    fingerprint = next(checkpoint_dir("sentiment", "a.jsonl").iterdir()).name

    def kept(partition: str) -> dict[str, str]:
        frame = CheckpointStore(checkpoint_dir("sentiment", partition), fingerprint).load()
        return dict(zip(frame["request_key"], frame["generated_text"], strict=True))

    choices = ["positive", "negative", "neutral"]
    answer = {text: choices[len(f"Post: {text}\nSentiment:") % 3] for text in ("a1", "a2", "a3", "b1")}
    assert sorted(kept("a.jsonl").values()) == sorted(answer[t] for t in ("a1", "a2", "a3"))
    assert list(kept("b.jsonl").values()) == [answer["b1"]]
    cached = ResultCache(task_storage_dir("sentiment"), fingerprint).lookup()
    assert dict(zip(cached["request_key"], cached["generated_text"], strict=True)) == kept("a.jsonl") | kept("b.jsonl")


@pytest.fixture
def run_on_fault_server(
    tmp_path: Path,
    data_dir: Path,
    endpoint_key: str,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
):
    """`batch-assets ARGS` in this process with the tasks of `tmp_path/tasks`: its exit status and output."""
    from batch_assets.cli import main

    monkeypatch.setenv("BATCH_ASSETS_TASKS_DIR", str(tmp_path / "tasks"))

    def run(args: list[str]) -> tuple[int, str]:
        status = main(args)
        return status, capfd.readouterr().out

    return run


def test_an_endpoint_without_a_local_tokenizer_says_on_every_run_that_its_counts_are_approximate(
    tmp_path: Path, fault_server: FaultServer, run_on_fault_server
) -> None:
    """Issue 56.16: docs/endpoint.md promises a warning that the token counts are approximate when no
    local tokenizer of the served model is set; it appeared nowhere (logged once per process, before
    any run). Now each run's terminal, log and formatted_prompts metadata say it."""
    endpoint_task(tmp_path, fault_server.base_url, "", tokenizer=None)
    warning = (
        "task sentiment: no local tokenizer for the endpoint's model 'fault-model'; rendering prompts and counting "
        "tokens with the tokenizer of embedded:SmolLM2-135M-Instruct, so `prompt`, the token counts and the "
        "too-long check are approximate"
    )
    for name in ("posts.jsonl", "again.jsonl"):
        (tmp_path / name).write_text(posts_jsonl(POSTS[:2] if name == "posts.jsonl" else POSTS[2:4]))
        _, out = run_on_fault_server(["run", "sentiment", str(tmp_path / name)])
        assert f"  sentiment/{name}: warning: {warning}" in out, out
        assert "Set `engine.tokenizer` to fix." in out
    with dg.DagsterInstance.get() as instance:
        record = instance.fetch_materializations(dg.AssetKey(["sentiment", "formatted_prompts"]), limit=1).records[0]
        assert record.asset_materialization is not None
        assert record.asset_materialization.metadata["token_count_note"].value.startswith(warning)
