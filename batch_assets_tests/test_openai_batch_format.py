"""OpenAI batch files as pure functions: lines → rows (every bad line an error row naming it),
per-request chat prompts and sampling, request keys, and the output / error files."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest
from transformers import AutoTokenizer

from batch_assets.engines.embedded_model import ensure_embedded_model
from batch_assets.pipeline.inference_requests import request_keys
from batch_assets.pipeline.inputs.read_prompts import DropFileError
from batch_assets.pipeline.openai_batch.formatting import format_batch_prompts
from batch_assets.pipeline.openai_batch.lines import read_batch_requests
from batch_assets.pipeline.openai_batch.output import batch_files, jsonl_bytes, validate_batch_outputs
from batch_assets.pipeline.openai_batch.sampling import RequestSpec
from batch_assets.pipeline.task_spec import TaskSpecError, load_task_spec
from batch_assets_tests.support.openai_batch import DEFAULTS, chat_line, format_lines, jsonl


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(ensure_embedded_model())


def test_valid_lines_keep_custom_id_model_messages_and_sampling() -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": [{"type": "text", "text": "Two"}, {"type": "text", "text": "parts"}]},
    ]
    data = jsonl(
        chat_line(
            "a", messages, model="gpt-4o-mini", max_completion_tokens=12, temperature=0.5, top_p=0.9, seed=3, stop="END"
        ),
        {
            "custom_id": "b",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"prompt": "Once upon", "max_tokens": 5},
        },
    )
    rows = read_batch_requests(data, "in.jsonl").to_dicts()
    assert [r["error"] for r in rows] == [None, None]
    first, second = rows
    assert (first["custom_id"], first["model"], first["url"], first["source_line"]) == (
        "a",
        "gpt-4o-mini",
        "/v1/chat/completions",
        1,
    )
    assert json.loads(first["messages"])[-1] == {"role": "user", "content": "Two\nparts"}
    assert json.loads(first["messages"])[:3] == messages[:3]
    assert (first["max_tokens"], first["temperature"], first["top_p"], first["seed"]) == (12, 0.5, 0.9, 3)
    assert json.loads(first["stop"]) == ["END"]
    assert (second["completion_prompt"], second["max_tokens"], second["messages"]) == ("Once upon", 5, None)


@pytest.mark.parametrize(
    ("line", "code", "names"),
    [
        ("{not json", "malformed_json", "line 2"),
        ("[1, 2]", "not_an_object", "not a JSON object"),
        ("   ", "empty_record", "blank line"),
        (
            {"method": "POST", "url": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": "x"}]}},
            "missing_custom_id",
            "no custom_id",
        ),
        (
            {"custom_id": 7, "method": "POST", "url": "/v1/chat/completions", "body": {}},
            "invalid_custom_id",
            "custom_id is the number 7; it must be a non-empty string",
        ),
        (
            {"custom_id": "", "method": "POST", "url": "/v1/chat/completions", "body": {}},
            "invalid_custom_id",
            "custom_id is an empty string; it must be a non-empty string",
        ),
        (chat_line("ok"), "duplicate_custom_id", "used first on line 1"),
        ({**chat_line("g"), "method": "GET"}, "unsupported_method", "'GET'"),
        # a chat body sent to /v1/embeddings (an embeddings line is a task's of output.kind embedding)
        ({**chat_line("e"), "url": "/v1/embeddings"}, "unsupported_field", "body.messages"),
        ({**chat_line("e"), "url": "/v1/moderations"}, "unsupported_url", "/v1/moderations"),
        ({"custom_id": "nb", "method": "POST", "url": "/v1/chat/completions"}, "invalid_body", "no body"),
        (chat_line("n", n=2), "unsupported_field", "body.n = 2"),
        (chat_line("t", tools=[{"type": "function"}]), "unsupported_field", "body.tools"),
        (chat_line("lp", logprobs=1), "invalid_field", "body.logprobs is a number"),
        (chat_line("tlp", top_logprobs=2), "invalid_field", "body.top_logprobs needs body.logprobs: true"),
        (chat_line("tlp21", logprobs=True, top_logprobs=21), "invalid_field", "body.top_logprobs is 21"),
        (
            {"custom_id": "clp", "method": "POST", "url": "/v1/completions", "body": {"prompt": "a", "logprobs": 2}},
            "unsupported_field",
            "body.logprobs = 2",
        ),
        (chat_line("em", []), "empty_messages", "body.messages"),
        (chat_line("role", [{"role": "tool", "content": "x"}]), "invalid_message", "tool calls are not supported"),
        (
            chat_line("img", [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
            "image_url_not_allowed",
            "body.messages[0].content[0].image_url.url: x is neither a data: URL nor an http(s) URL",
        ),
        (chat_line("temp", temperature="hot"), "invalid_field", "body.temperature is a string"),
        (
            '{"custom_id": "nan", "method": "POST", "url": "/v1/chat/completions", "body": {"temperature": NaN}}',
            "invalid_field",
            "body.temperature is NaN; it must be a finite number",
        ),
        (
            '{"custom_id": "inf", "method": "POST", "url": "/v1/chat/completions", "body": {"top_p": -Infinity}}',
            "invalid_field",
            "body.top_p is -Infinity; it must be a finite number",
        ),
        (
            chat_line("part", [{"role": "user", "content": [{"type": "text", "text": 5}]}]),
            "invalid_message",
            "body.messages[0].content[0].text is a number; the text of a text part must be a string",
        ),
        (
            chat_line("part2", [{"role": "user", "content": [{"type": "text"}]}]),
            "invalid_message",
            "body.messages[0].content[0].text is missing; the text of a text part must be a string",
        ),
        (
            chat_line("part3", [{"role": "user", "content": ["plain"]}]),
            "invalid_message",
            "body.messages[0].content[0] is a string, not a content part object",
        ),
        (
            chat_line("part4", [{"role": "user", "content": []}]),
            "invalid_message",
            "body.messages[0].content is an empty list",
        ),
        (chat_line("topp", top_p=0), "invalid_field", "body.top_p is 0"),
        (chat_line("mt", max_tokens=0), "invalid_field", "at least 1"),
        (chat_line("rf", response_format={"type": "xml"}), "invalid_field", "response_format.type"),
        (
            chat_line("rs", response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
            "invalid_field",
            "schema",
        ),
        (
            {"custom_id": "cp", "method": "POST", "url": "/v1/completions", "body": {"prompt": ["a", "b"]}},
            "unsupported_field",
            "several prompts",
        ),
    ],
)
def test_every_bad_line_is_an_error_row_naming_file_and_line(line, code: str, names: str) -> None:
    data = jsonl(chat_line("ok"), line, chat_line("after"))
    frame = read_batch_requests(data, "drop/in.jsonl")
    assert frame.height == 3
    assert frame["error"][0] is None and frame["error"][2] is None
    error = frame["error"][1]
    assert error.startswith(f"{code}: drop/in.jsonl line 2: ")
    assert names in error


@pytest.mark.parametrize(
    ("body", "message"),
    [
        # Fields checked by OpenAI's own request types (the `openai` SDK's), named as OpenAI's `param`.
        ({"user": 5}, "body.user is a number; OpenAI's API takes a string"),
        ({"metadata": {"team": 1}}, "body.metadata.team is a number; OpenAI's API takes a string"),
        ({"model": 5}, "body.model is a number; OpenAI's API takes a string"),
        ({"max_tokens": "12"}, "body.max_tokens is a string; OpenAI's API takes an integer"),
        ({"max_tokens": True}, "body.max_tokens is a boolean; OpenAI's API takes an integer"),
        ({"seed": 1.5}, "body.seed is a number; OpenAI's API takes an integer"),
        ({"stop": ["END", 3]}, "body.stop[1] is a number; OpenAI's API takes a string"),
        ({"stop": 3}, "body.stop is a number; OpenAI's API takes a string or a list"),
        ({"response_format": "json"}, "body.response_format is a string; OpenAI's API takes an object"),
        (
            {"response_format": {"type": "xml"}},
            "body.response_format.type is \"xml\"; OpenAI's API takes 'text' or 'json_schema' or 'json_object'",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}},
            "body.response_format.json_schema.name is missing; OpenAI's API requires it",
        ),
        # Ranges OpenAI's types leave to the server.
        ({"stop": ["END", ""]}, "body.stop must be a non-empty string or a list of them"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "body.stop has 5 sequences; at most 4"),
        ({"temperature": 2.5}, "body.temperature is 2.5; it must be at least 0.0 and at most 2.0"),
        ({"seed": 2**63}, f"body.seed is {2**63}; it must be at least {-(2**63)} and at most {2**63 - 1}"),
    ],
)
def test_body_fields_are_checked_against_openais_request_types(body: dict, message: str) -> None:
    frame = read_batch_requests(jsonl(chat_line("bad", **body)), "in.jsonl")
    assert frame["error"].to_list() == [f"invalid_field: in.jsonl line 1: {message}"]


def test_nulls_and_integral_floats_are_taken_as_vllm_takes_them() -> None:
    """OpenAI's types refuse `null` on some fields and 12.0 for an integer; vLLM's request models,
    which answer these lines, take null as not given and 12.0 as 12, and so does the pipeline."""
    data = jsonl(
        chat_line("nulls", model=None, temperature=None, response_format=None, stop=None, user=None),
        chat_line("floats", max_completion_tokens=12.0, seed=3.0),
        {"custom_id": "e", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x", "encoding_format": None}},
    )
    nulls, floats, embedding = read_batch_requests(data, "in.jsonl").to_dicts()
    assert [nulls["error"], floats["error"], embedding["error"]] == [None, None, None]
    assert (nulls["model"], nulls["temperature"], nulls["response_format"], nulls["stop"]) == (None, None, None, None)
    assert (floats["max_tokens"], floats["seed"]) == (12, 3)
    assert embedding["encoding_format"] == "float"


def test_invalid_utf8_and_non_jsonl_files() -> None:
    frame = read_batch_requests(jsonl(chat_line("a")) + b'{"custom_id": "\xff"}\n', "in.jsonl")
    assert frame["error"].to_list()[0] is None
    assert frame["error"][1].startswith("invalid_utf8: in.jsonl line 2")
    with pytest.raises(DropFileError, match=r"\.jsonl"):
        read_batch_requests(b"a,b\n", "in.csv")
    assert read_batch_requests(b"\n", "empty.jsonl").height == 0


def test_chat_prompt_is_the_template_over_the_requests_own_messages(tokenizer) -> None:
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "U1"},
        {"role": "assistant", "content": "A"},
        {"role": "user", "content": "U2"},
    ]
    raw = read_batch_requests(jsonl(chat_line("a", messages, max_tokens=9)), "in.jsonl")
    out = format_batch_prompts(raw, tokenizer, sampling_defaults=DEFAULTS, max_model_len=512, source_file="in.jsonl")
    expected = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert out["prompt"][0] == expected
    assert out["num_prompt_tokens"][0] == len(tokenizer(expected, add_special_tokens=False)["input_ids"])
    spec = RequestSpec.from_params_json(out["request_params"][0])
    assert (spec.sampling.max_tokens, spec.sampling.temperature, spec.sampling.top_p, spec.output) == (
        9,
        0.0,
        1.0,
        None,
    )


def test_completions_prompt_is_the_text_itself(tokenizer) -> None:
    line = {"custom_id": "c", "method": "POST", "url": "/v1/completions", "body": {"prompt": "Once upon a time"}}
    out = format_lines(jsonl(line), tokenizer)
    assert out["prompt"][0] == "Once upon a time"  # SmolLM2's tokenizer adds no BOS of its own
    # An endpoint engine sends chat messages only: a completion line is an error row there.
    chat_only = format_lines(jsonl(line), tokenizer, chat_only=True)
    assert chat_only["error"][0].startswith(
        "unsupported_url: in.jsonl line 1: /v1/completions lines need the in-process engine"
    )


def test_sampling_defaults_fill_what_a_line_leaves_out_and_response_format_becomes_a_constraint(tokenizer) -> None:
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    data = jsonl(
        chat_line("a"),
        chat_line(
            "b",
            temperature=0.7,
            seed=5,
            stop=["\n"],
            response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
        ),
        chat_line("c", response_format={"type": "json_object"}),
    )
    out = format_lines(data, tokenizer)
    a, b, c = (RequestSpec.from_params_json(p) for p in out["request_params"])
    assert a.sampling.model_dump() == {**DEFAULTS.model_dump(), "stop": None, "logprobs": None} and a.output is None
    assert (b.sampling.temperature, b.sampling.seed, b.sampling.max_tokens, b.sampling.stop) == (0.7, 5, 64, ("\n",))
    assert b.output.kind == "json_schema" and b.output.json_schema == schema
    assert c.output.json_schema == {"type": "object"}


def test_vllms_structured_outputs_field_becomes_a_choice_or_regex_constraint(tokenizer) -> None:
    """What the `batch_api` engine sends for a choices or regex task (and vLLM's run-batch takes)."""
    data = jsonl(
        chat_line("choice", structured_outputs={"choice": ["yes", "no"]}),
        chat_line("regex", structured_outputs={"regex": "[0-9]+"}),
        chat_line("cut", structured_outputs={"choice": ["positive", "negative"]}),
        chat_line("both", structured_outputs={"regex": "a"}, response_format={"type": "json_object"}),
        chat_line("json", structured_outputs={"json": {"type": "object"}}),
        chat_line("empty", structured_outputs={"choice": []}),
    )
    out = format_lines(data, tokenizer)
    choice, regex = (RequestSpec.from_params_json(p) for p in out["request_params"][:2])
    assert (choice.output.kind, choice.output.choices) == ("choices", ["yes", "no"])
    assert (regex.output.kind, regex.output.regex) == ("regex", "[0-9]+")
    assert [e and e.split(":")[0] for e in out["error"]] == [
        None, None, None, "invalid_field", "unsupported_field", "invalid_field"
    ]  # fmt: skip
    answered = out.head(3).with_columns(
        generated_text=pl.Series(["no", "42", "posi"]),
        finish_reason=pl.Series(["stop", "stop", "length"]),
        num_generated_tokens=pl.Series([1, 2, 1]),
    )
    labels = validate_batch_outputs(answered)
    assert labels["label"].to_list() == ["no", "42", None]
    assert labels["error"][2].startswith("invalid_label: line 3: 'posi' is not one of the line's choice")


def test_a_structured_outputs_constraint_no_task_could_have_is_that_lines_error_row(tokenizer) -> None:
    """A regex that does not compile or matches only "", choices equal but for spaces: the line's
    own `invalid_field`, never a failure of the whole file when its constraint is built."""
    data = jsonl(
        chat_line("ok", structured_outputs={"regex": "[0-9]+"}),
        chat_line("bad-regex", structured_outputs={"regex": "("}),
        chat_line("empty-regex", structured_outputs={"regex": "^$"}),
        chat_line("spaced-choices", structured_outputs={"choice": ["a", " a"]}),
    )
    out = format_lines(data, tokenizer)
    assert [e and e.split(":")[0] for e in out["error"]] == [None, "invalid_field", "invalid_field", "invalid_field"]
    assert "body.structured_outputs.regex" in out["error"][1] and "not a valid regular expression" in out["error"][1]
    assert "body.structured_outputs.choice" in out["error"][3]


def test_too_long_prompts_and_model_mismatch_are_error_rows(tokenizer) -> None:
    data = jsonl(
        chat_line("short", max_tokens=4, model="SmolLM2-135M-Instruct"),
        chat_line("long", [{"role": "user", "content": "word " * 600}], max_tokens=4),
        chat_line("needs-room", max_tokens=500),
        chat_line("other-model", model="gpt-4o"),
        chat_line("huge", max_tokens=10_000_000),
        chat_line("whole-context", max_completion_tokens=512),
    )
    raw = read_batch_requests(data, "in.jsonl")
    out = format_batch_prompts(
        raw,
        tokenizer,
        sampling_defaults=DEFAULTS,
        max_model_len=512,
        source_file="in.jsonl",
        accepted_models={"embedded:SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct"},
    )
    errors = out["error"].to_list()
    assert errors[0] is None
    assert (
        errors[1].startswith("prompt_too_long: in.jsonl line 2: ")
        and "+ 4 max_tokens exceed max_model_len 512" in errors[1]
    )
    assert errors[2].startswith("prompt_too_long: in.jsonl line 3: ") and "+ 500 max_tokens" in errors[2]
    assert (
        errors[3].startswith("model_mismatch: in.jsonl line 4: body.model 'gpt-4o'")
        and "require_model_match" in errors[3]
    )
    # A max_tokens no prompt could fit beside is the line's own mistake, whatever its prompt.
    for index, value in ((4, 10_000_000), (5, 512)):
        assert errors[index] == (
            f"invalid_field: in.jsonl line {index + 1}: body.max_tokens / max_completion_tokens is {value}; "
            "it must be less than "
            "the model's context (max_model_len 512), which holds the prompt and the answer"
        )
    assert out["prompt"].to_list()[1:] == [None] * 5
    # Without the option every line is answered by the task's model.
    relaxed = format_batch_prompts(
        raw, tokenizer, sampling_defaults=DEFAULTS, max_model_len=512, source_file="in.jsonl"
    )
    assert relaxed["error"][3] is None


def test_request_keys_share_identical_deterministic_requests_and_separate_other_sampling(tokenizer) -> None:
    same = [{"role": "user", "content": "same question"}]
    data = jsonl(
        chat_line("a", same, temperature=0),
        chat_line("b", same, temperature=0),  # identical request: one inference
        chat_line("c", same, temperature=0, max_tokens=5),  # other max_tokens
        chat_line("d", same, temperature=0.9),  # sampled without seed: its own request
        chat_line("e", same, temperature=0.9),
        chat_line("f", same, temperature=0.9, seed=1),  # seeded: deterministic, shared with g
        chat_line("g", same, temperature=0.9, seed=1),
        chat_line("h", same, temperature=0, response_format={"type": "json_object"}),
    )
    out = format_lines(data, tokenizer)
    keys = request_keys(out["prompt"].to_list(), out["row_id"].to_list(), True, out["request_params"].to_list())
    a, b, c, d, e, f, g, h = keys
    # Stable across runs (a resumed partition finds its checkpoints under the same keys).
    again = format_lines(data, tokenizer)
    assert (
        request_keys(again["prompt"].to_list(), again["row_id"].to_list(), True, again["request_params"].to_list())
        == keys
    )
    assert a == b and f == g
    assert len({a, c, d, e, f, h}) == 6
    # Task-wide sampling (no per-request params) keeps the keys it always had.
    assert request_keys(["p"], [0], True) == request_keys(["p"], [0], True, [None])


def outputs_frame(rows: list[dict]) -> pl.DataFrame:
    return pl.DataFrame(rows)


def test_output_and_error_files_follow_openais_batch_schema_one_line_per_input(tokenizer) -> None:
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    data = jsonl(
        chat_line("a"),
        "{broken",
        chat_line("json", response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}),
        {"custom_id": "c", "method": "POST", "url": "/v1/completions", "body": {"prompt": "Hi"}},
        chat_line("engine-failed"),
        {"custom_id": 42, "method": "POST", "url": "/v1/chat/completions", "body": {}},
    )
    formatted = format_lines(data, tokenizer)
    answers = {"a": ("Paris.", "stop", 3), "json": ('{"x": "no"}', "stop", 5), "c": (" there", "length", 2)}
    outputs = formatted.with_columns(
        generated_text=pl.Series([answers.get(cid, (None,))[0] for cid in formatted["custom_id"]], dtype=pl.String),
        finish_reason=pl.Series([answers.get(cid, (None, None))[1] for cid in formatted["custom_id"]], dtype=pl.String),
        num_generated_tokens=pl.Series(
            [answers.get(cid, (None, None, None))[2] for cid in formatted["custom_id"]], dtype=pl.Int64
        ),
        error=pl.when(pl.col("custom_id") == "engine-failed")
        .then(pl.lit("engine_error: the endpoint failed"))
        .otherwise(pl.col("error")),
    )
    labels = validate_batch_outputs(outputs)
    assert labels["label"].to_list() == ["Paris.", None, None, " there", None, None]
    assert labels["error"][2].startswith("schema_mismatch: line 3: at x:")
    assert "request_params" not in labels.columns and "prompt" not in labels.columns
    ok, failed = batch_files(labels, model="the-model", partition_key="in", created=1700000000)
    assert [r["custom_id"] for r in ok] == ["a", "json", "c"]
    # A custom_id that is not a string is refused, and echoed as given so the client can match it.
    assert [r["custom_id"] for r in failed] == [None, "engine-failed", 42]
    first = ok[0]
    assert first["error"] is None and first["id"].startswith("batch_req_")
    assert first["response"]["status_code"] == 200 and first["response"]["request_id"].startswith("req_")
    body = first["response"]["body"]
    assert body["object"] == "chat.completion" and body["model"] == "the-model" and body["created"] == 1700000000
    assert body["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "Paris.", "refusal": None},
            "logprobs": None,
            "finish_reason": "stop",
        }
    ]
    prompt_tokens = formatted["num_prompt_tokens"][0]
    assert body["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 3, "total_tokens": prompt_tokens + 3}
    assert ok[1]["response"]["body"]["choices"][0]["message"]["content"] == '{"x": "no"}'  # as OpenAI returns it
    completion = ok[2]["response"]["body"]
    assert completion["object"] == "text_completion" and completion["choices"][0]["text"] == " there"
    # OpenAI's error file: the request's HTTP answer (400 for a bad request, 500 when the server
    # failed) with OpenAI's error object as its body; the line's `error` is for non-HTTP failures.
    malformed, engine, numeric = failed
    assert malformed["id"].startswith("batch_req_") and malformed["error"] is None
    assert malformed["response"]["status_code"] == 400 and malformed["response"]["request_id"].startswith("req_")
    assert malformed["response"]["body"]["error"]["message"].startswith("in.jsonl line 2: ")
    assert {k: v for k, v in malformed["response"]["body"]["error"].items() if k != "message"} == {
        "type": "invalid_request_error",
        "param": None,
        "code": "malformed_json",
    }
    assert engine["response"]["status_code"] == 500 and engine["error"] is None
    assert engine["response"]["body"] == {
        "error": {
            "message": "line 5: the endpoint failed",
            "type": "server_error",
            "param": None,
            "code": "engine_error",
        }
    }
    assert numeric["response"]["status_code"] == 400
    assert numeric["response"]["body"]["error"] == {
        "message": "in.jsonl line 6: custom_id is the number 42; it must be a non-empty string",
        "type": "invalid_request_error",
        "param": "custom_id",
        "code": "invalid_custom_id",
    }
    assert len({record["id"] for record in ok + failed}) == 6
    assert batch_files(labels, model="the-model", partition_key="in", created=1)[0][0]["id"] == first["id"]


def test_shipped_openai_batch_task_and_format_rules(tmp_path) -> None:
    from batch_assets.pipeline.task_spec import BUNDLED_TASKS_DIR

    task = load_task_spec(BUNDLED_TASKS_DIR / "openai_batch.yaml")
    assert task.input.format == "openai_batch" and task.prompt is None and task.output.kind == "text"
    bad = tmp_path / "bad.yaml"
    bad.write_text("input: {format: openai_batch}\nprompt: {template: '{text}'}\noutput: {kind: text}\n")
    with pytest.raises(TaskSpecError, match="takes no `prompt` section"):
        load_task_spec(bad)
    bad.write_text(
        "input: {text_fields: [text], require_model_match: true}\nprompt: {template: '{text}'}\noutput: {kind: text}\n"
    )
    with pytest.raises(TaskSpecError, match="openai_batch only"):
        load_task_spec(bad)
    bad.write_text("input: {text_fields: [text]}\noutput: {kind: text}\n")
    with pytest.raises(TaskSpecError, match="needs a `prompt` section"):
        load_task_spec(bad)


def run_lines(formatted, tokenizer, generate, checkpoints: Path):
    """`formatted` batch lines through run_inference with checkpoints at `checkpoints`, answered by
    `generate` (prompts → Generations) as a chat engine's session would: (frame, stats)."""
    from upath import UPath

    from batch_assets.pipeline.engine_contract import batched_stream
    from batch_assets.pipeline.inference_requests import PartitionInput
    from batch_assets.pipeline.openai_batch.engine_prompts import batch_prompt_encoder
    from batch_assets.pipeline.run_inference import run_inference
    from batch_assets.storage.checkpoints import CheckpointStore

    class Session:
        started_here, start_seconds, metadata = True, 0.0, {}

        def start(self, requests: int = 0) -> None:
            pass

        def stream(self, prompts):
            return batched_stream(generate, 64)(prompts)

    class Engine:
        sends_chat_messages = True

    part = PartitionInput(
        formatted, batch_prompt_encoder(Engine(), None, tokenizer, formatted), CheckpointStore(UPath(checkpoints), "fp")
    )
    [(frame, stats)] = run_inference(
        [part], session=Session(), max_model_len=512, max_tokens=64, batch_size=64, deduplicate=True
    )
    return frame, stats


def test_run_inference_sends_each_request_once_with_its_own_sampling(tokenizer, tmp_path) -> None:

    from batch_assets.pipeline.engine_contract import Generation

    same = [{"role": "user", "content": "same question"}]
    data = jsonl(
        chat_line("a", same, max_tokens=5),
        chat_line("b", same, max_tokens=5),  # identical to a: inferred once
        chat_line("c", same, max_tokens=7, stop=["x"]),
        chat_line("d", [{"role": "user", "content": "other"}], max_tokens=6, response_format={"type": "json_object"}),
    )
    formatted = format_lines(data, tokenizer)
    seen = []

    def generate(prompts):
        seen.extend(prompts)
        return [Generation(f"max {p.sampling.max_tokens}", "stop", len(p.token_ids), 1) for p in prompts]

    def run():
        return run_lines(formatted, tokenizer, generate, tmp_path / "ck")

    frame, stats = run()
    assert frame["generated_text"].to_list() == ["max 5", "max 5", "max 7", "max 6"]
    assert (stats.rows_inferred, stats.rows_deduplicated) == (3, 1)
    # Sent in shared-prefix order, not line order: look each request up by its max_tokens.
    by_max_tokens = {p.sampling.max_tokens: p for p in seen}
    assert sorted(by_max_tokens) == [5, 6, 7]
    assert [by_max_tokens[n].sampling.stop for n in (5, 7, 6)] == [None, ("x",), None]
    assert by_max_tokens[6].output.json_schema == {"type": "object"} and by_max_tokens[5].output is None
    assert by_max_tokens[5].messages == tuple(same)
    # Killed and re-run: every finished request comes back from the checkpoints, none is sent again.
    seen.clear()
    frame2, stats2 = run()
    assert (stats2.rows_from_checkpoint, stats2.rows_inferred, seen) == (3, 0, [])
    assert frame2["generated_text"].to_list() == frame["generated_text"].to_list()


def test_error_lines_name_the_body_field_as_openais_param(tokenizer) -> None:
    data = jsonl(
        chat_line("mt", max_tokens=0),
        chat_line("tools", tools=[{"type": "function"}]),
        chat_line("part", [{"role": "user", "content": [{"type": "text", "text": 5}]}]),
        chat_line("big", max_tokens=10_000_000),
    )
    labels = validate_batch_outputs(
        format_lines(data, tokenizer).with_columns(
            generated_text=pl.lit(None, dtype=pl.String),
            finish_reason=pl.lit(None, dtype=pl.String),
            num_generated_tokens=pl.lit(None, dtype=pl.Int64),
        )
    )
    ok, failed = batch_files(labels, model="m", partition_key="in", created=1)
    assert ok == []
    errors = [record["response"]["body"]["error"] for record in failed]
    assert [(e["code"], e["param"]) for e in errors] == [
        ("invalid_field", "max_tokens"),
        ("unsupported_field", "tools"),
        ("invalid_message", "messages[0].content[0].text"),
        ("invalid_field", "max_tokens"),
    ]
    assert {record["response"]["status_code"] for record in failed} == {400}


def test_refused_custom_ids_are_echoed_as_written_and_the_error_file_stays_strict_json() -> None:
    body = '"method": "POST", "url": "/v1/chat/completions", "body": {}'
    given = ["7", "2.5", "true", "null", '{"a": [1]}', '""', "NaN", "-Infinity", "[NaN]", '{"a": Infinity}']
    data = "".join(f'{{"custom_id": {value}, {body}}}\n' for value in given).encode()
    raw = read_batch_requests(data, "in.jsonl")
    assert {code.split(":")[0] for code in raw["error"]} == {"invalid_custom_id"}
    labels = validate_batch_outputs(
        raw.with_columns(
            generated_text=pl.lit(None, dtype=pl.String),
            finish_reason=pl.lit(None, dtype=pl.String),
            num_prompt_tokens=pl.lit(None, dtype=pl.Int64),
            num_generated_tokens=pl.lit(None, dtype=pl.Int64),
        )
    )
    _, failed = batch_files(labels, model="m", partition_key="in", created=1)
    assert [record["custom_id"] for record in failed] == [
        *(7, 2.5, True, None, {"a": [1]}, ""),
        *("NaN", "-Infinity", "[NaN]", '{"a": Infinity}'),  # not JSON: kept as the text written
    ]
    for line in jsonl_bytes(failed).decode().splitlines():
        json.loads(line, parse_constant=lambda name: pytest.fail(f"{name} is not JSON"))


def test_a_chat_lines_logprobs_reach_the_engine_and_come_back_in_openais_shape(tokenizer, tmp_path) -> None:
    """`logprobs` / `top_logprobs` of a chat line: asked of the engine with the line's own sampling,
    part of its request key (a line without them keeps the key it always had), kept in the
    checkpoints, and written as the choice's `logprobs.content`."""

    from batch_assets.pipeline.engine_contract import Generation

    same = [{"role": "user", "content": "same question"}]
    data = jsonl(
        chat_line("plain", same, max_tokens=3),
        chat_line("sampled", same, max_tokens=3, logprobs=True),
        chat_line("top", same, max_tokens=3, logprobs=True, top_logprobs=2),
        chat_line("zero", same, max_tokens=3, logprobs=False, top_logprobs=0),
    )
    formatted = format_lines(data, tokenizer)
    assert formatted["top_logprobs"].to_list() == [None, 0, 2, None]
    assert "logprobs" not in json.loads(formatted["request_params"][0])["sampling"]  # the key it always had
    keys = request_keys(
        formatted["prompt"].to_list(), formatted["row_id"].to_list(), True, formatted["request_params"].to_list()
    )
    assert len(set(keys[:3])) == 3 and keys[3] == keys[0]
    asked: list[int | None] = []

    def generate(prompts):
        out = []
        for p in prompts:
            asked.append(p.sampling.logprobs)
            top = p.sampling.logprobs
            tokens = None
            if top is not None:
                alternatives = [
                    {"token": "B", "logprob": -1.5, "bytes": [66]},
                    {"token": "C", "logprob": -2.0, "bytes": [67]},
                ]
                tokens = json.dumps(
                    [{"token": "A", "logprob": -0.1, "bytes": [65], "top_logprobs": alternatives[:top]}]
                )
            out.append(Generation("A", "stop", len(p.token_ids), 1, cumulative_logprob=-0.1, token_logprobs=tokens))
        return out

    def run():
        return run_lines(formatted, tokenizer, generate, tmp_path / "ck")[0]

    run()
    assert sorted(asked, key=lambda n: -1 if n is None else n) == [None, 0, 2]
    asked.clear()
    frame = run()  # every answer from the checkpoints, log-probabilities included
    assert asked == []
    ok, failed = batch_files(validate_batch_outputs(frame), model="m", partition_key="in", created=1)
    assert failed == []
    logprobs = {line["custom_id"]: line["response"]["body"]["choices"][0]["logprobs"] for line in ok}
    entry = {"token": "A", "logprob": -0.1, "bytes": [65]}
    assert logprobs == {
        "plain": None,
        "sampled": {"content": [{**entry, "top_logprobs": []}]},
        "top": {
            "content": [
                {
                    **entry,
                    "top_logprobs": [
                        {"token": "B", "logprob": -1.5, "bytes": [66]},
                        {"token": "C", "logprob": -2.0, "bytes": [67]},
                    ],
                }
            ]
        },
        "zero": None,
    }


def test_vllms_logprobs_are_written_as_vllms_openai_server_writes_them() -> None:
    """The in-process engine's `logprobs.content` from vLLM's per-step logprobs: the sampled token's
    text, log-probability (floored at -9999) and bytes, and the step's first `top` entries in vLLM's
    order (the sampled token first), as vLLM's serving code writes them."""
    from vllm.logprobs import Logprob

    from batch_assets.engines.vllm_requests import chat_logprobs

    steps = [
        {7: Logprob(-0.5, 2, "é"), 3: Logprob(-0.2, 1, " a"), 9: Logprob(-3.0, 3, "b")},
        {4: Logprob(-float("inf"), 5, "<end>")},
        {5: Logprob(-0.1, 1, None)},
    ]
    content = chat_logprobs([7, 4, 5], steps, 2)
    assert content[0] == {
        "token": "é",
        "logprob": -0.5,
        "bytes": [195, 169],
        "top_logprobs": [
            {"token": "é", "logprob": -0.5, "bytes": [195, 169]},
            {"token": " a", "logprob": -0.2, "bytes": [32, 97]},
        ],
    }
    assert (content[1]["logprob"], content[1]["top_logprobs"][0]["logprob"]) == (-9999.0, -9999.0)
    assert (content[2]["token"], content[2]["bytes"]) == ("token_id:5", None)
    assert [len(entry["top_logprobs"]) for entry in chat_logprobs([7, 4, 5], steps, 0)] == [0, 0, 0]


def test_a_completion_whose_logprobs_miss_a_token_is_that_rows_error_only() -> None:
    """vLLM's outputs for two lines of one stream, one with a log-probability step per generated
    token and one short a step: the first gets its `logprobs.content`, the second is an error row
    naming the counts (its text kept, nothing cut to the shorter), where before the mismatch raised
    and failed the whole stream."""
    from vllm.logprobs import Logprob
    from vllm.outputs import CompletionOutput, RequestOutput

    from batch_assets.engines.vllm_requests import chat_generation
    from batch_assets.pipeline.engine_contract import Prompt
    from batch_assets.pipeline.openai_batch.sampling import RequestSampling

    def output(token_ids: list[int], steps: list[dict]) -> RequestOutput:
        completion = CompletionOutput(0, "ab", token_ids, -0.75, steps, finish_reason="stop")
        return RequestOutput("r", None, [1, 2, 3], None, [completion], finished=True)

    steps = [{7: Logprob(-0.5, 1, "a")}, {4: Logprob(-0.25, 1, "b")}]
    prompt = Prompt((1, 2, 3), sampling=RequestSampling(logprobs=0))
    whole, short = chat_generation(output([7, 4], steps), prompt), chat_generation(output([7, 4, 9], steps), prompt)
    assert whole.error is None and whole.token_logprobs is not None
    assert [(e["token"], e["logprob"]) for e in json.loads(whole.token_logprobs)] == [("a", -0.5), ("b", -0.25)]
    assert short.error == (
        "logprobs_mismatch: the engine returned 2 log-probability steps for 3 generated tokens; re-run the file, "
        "or drop `logprobs` from the line"
    )
    assert (short.token_logprobs, short.text, short.num_generated_tokens, short.num_prompt_tokens) == (None, "ab", 3, 3)
    # A line that asked for none is not looked at.
    assert chat_generation(output([7, 4, 9], steps), Prompt((1, 2, 3))).error is None
