"""Pictures to endpoints and from OpenAI batch lines, no engine: the chat requests an image task sends
an endpoint or a batch API (`image_url` parts with `data:` URLs of the bytes, in field order, before
the text), what an endpoint server receives, and how batch lines with `image_url` parts are read,
checked, rendered, keyed and handed to each kind of engine; a tokenizer with no place for a picture is
refused before anything is sent. One slow test runs the example task through Dagster on an endpoint."""

from __future__ import annotations

import base64
import io
import json
import os
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import polars as pl
import pytest
import yaml
from jinja2 import Template
from PIL import Image

from batch_assets.engines.batch_api_files import chat_body
from batch_assets.engines.embedded_model import ensure_embedded_model
from batch_assets.engines.openai_engine import OpenAIEngine
from batch_assets.engines.tokenizers import load_tokenizer
from batch_assets.pipeline.format_prompts import PromptFormat, format_prompts, prompt_encoders, render_prompt
from batch_assets.pipeline.inference_requests import request_keys
from batch_assets.pipeline.inputs.images import DIGEST_COLUMN, IMAGES_COLUMN, PIXELS_COLUMN, image_digest
from batch_assets.pipeline.openai_batch.engine_prompts import batch_prompt_encoder
from batch_assets.pipeline.openai_batch.formatting import format_batch_prompts
from batch_assets.pipeline.openai_batch.lines import read_batch_requests
from batch_assets.pipeline.openai_batch.output import error_object
from batch_assets.pipeline.openai_batch.protocol import REQUEST_ERROR_CODES
from batch_assets.pipeline.prompt_tokens import PROMPT_TOKEN_IDS
from batch_assets.pipeline.task_spec import SamplingSpec, TaskSpec
from batch_assets.pipeline.task_spec.input import ImageLimits
from batch_assets_tests.tiny_vlm import CHAT_TEMPLATE, REPO_ROOT, built_tiny_vlm


def picture(fmt: str = "PNG", size: tuple[int, int] = (20, 10), colour: tuple[int, int, int] = (200, 30, 30)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, colour).save(buffer, format=fmt)
    return buffer.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def decoded(url: str) -> tuple[str, bytes]:
    header, _, payload = url.partition(",")
    return header, base64.b64decode(payload)


class TemplateTokenizer:
    """The tiny VLM's chat template (`<image>` per image part) without a model's files; ids are the
    characters' code points, which is all the encoders need of them."""

    chat_template = CHAT_TEMPLATE

    def apply_chat_template(self, conversation, tokenize=False, add_generation_prompt=True):
        return Template(CHAT_TEMPLATE).render(messages=conversation, add_generation_prompt=add_generation_prompt)

    def __call__(self, texts, add_special_tokens=False, split_special_tokens=False):
        return {"input_ids": [[ord(c) for c in text] for text in texts]}


IN_PROCESS, ENDPOINT = SimpleNamespace(sends_chat_messages=False), SimpleNamespace(sends_chat_messages=True)


# --- an image task's requests to an endpoint or a batch API -------------------------------------


def image_task(engine: dict) -> TaskSpec:
    return TaskSpec.model_validate(
        {
            "name": "pictures",
            "input": {"image_fields": ["front", "back"], "text_fields": ["caption"]},
            "prompt": {"system": "Label it.", "template": "Caption: {caption}"},
            "engine": {"max_model_len": 512, "tokenizer": "a vision tokenizer", **engine},
            "sampling": {"temperature": 0, "max_tokens": 5},
            "output": {"kind": "choices", "choices": ["cat", "dog"]},
        }
    )


def example_task(engine: dict) -> TaskSpec:
    """examples/tasks/images.yaml (`text_fields: []`, a template naming no field) on another engine."""
    raw = yaml.safe_load((REPO_ROOT / "examples" / "tasks" / "images.yaml").read_text())
    return TaskSpec.model_validate({**raw, "name": "images", "engine": {**raw["engine"], **engine}})


def formatted_rows(
    rows: list[tuple[str, list[bytes]]], fmt: PromptFormat | None = None, template: str = "Caption: {}"
) -> pl.DataFrame:
    """formatted_prompts rows of an image task: the prompt texts rendered (a placeholder per image),
    their ids, each row's image bytes in field order and their digest."""
    fmt = fmt or PromptFormat.of(image_task({"kind": "openai", "base_url": "http://127.0.0.1:1/v1"}))
    tokenizer = TemplateTokenizer()
    prompts = [render_prompt(fmt, tokenizer, template.format(caption)) for caption, _ in rows]
    return pl.DataFrame(
        {
            "row_id": list(range(len(rows))),
            "caption": [caption for caption, _ in rows],
            "prompt": prompts,
            PROMPT_TOKEN_IDS: tokenizer(prompts)["input_ids"],
            IMAGES_COLUMN: [images for _, images in rows],
            DIGEST_COLUMN: [image_digest(images) for _, images in rows],
            "error": [None] * len(rows),
        },
        schema_overrides={IMAGES_COLUMN: pl.List(pl.Binary), "error": pl.String},
    )


def test_an_endpoint_is_sent_each_picture_as_a_data_url_part_before_the_text_in_field_order() -> None:
    front, back, other = picture("PNG"), picture("JPEG", (16, 16)), picture("PNG", colour=(0, 0, 255))
    formatted = formatted_rows([("a tabby", [front, back]), ("a tabby", [other, back])])
    fmt = PromptFormat.of(image_task({"kind": "openai", "base_url": "http://127.0.0.1:1/v1"}))
    encode = prompt_encoders(ENDPOINT, fmt, TemplateTokenizer())(formatted)
    prompts = encode(formatted["prompt"].to_list(), keys=["k0", "k1"], image_digests=formatted[DIGEST_COLUMN].to_list())
    system, user = prompts[0].messages
    assert system == {"role": "system", "content": "Label it."}
    assert [part["type"] for part in user["content"]] == ["image_url", "image_url", "text"]
    assert user["content"][2] == {"type": "text", "text": "Caption: a tabby"}
    assert [decoded(part["image_url"]["url"]) for part in user["content"][:2]] == [
        ("data:image/png;base64", front),
        ("data:image/jpeg;base64", back),
    ]
    # The same text with another picture: its own request, with its own bytes.
    assert decoded(prompts[1].messages[1]["content"][0]["image_url"]["url"])[1] == other
    assert prompts[0].key == "k0" and prompts[0].token_ids == tuple(formatted[PROMPT_TOKEN_IDS][0])
    # The batch API's request line carries the same parts (batch_api_files.chat_body).
    body = chat_body(prompts[0], {"model": "m", "max_tokens": 5})
    assert body["messages"][1]["content"] == list(user["content"])
    # The in-process engine gets the bytes with the ids instead, no messages.
    [local] = prompt_encoders(IN_PROCESS, fmt, TemplateTokenizer())(formatted.head(1))(
        formatted["prompt"].to_list()[:1], image_digests=formatted[DIGEST_COLUMN].to_list()[:1]
    )
    assert local.images == (front, back) and local.messages is None


@pytest.mark.parametrize("kind", ["openai", "batch_api"])
def test_a_template_naming_no_field_sends_every_row_its_own_picture(kind: str) -> None:
    # The documented example: `text_fields: []` and a constant template, on an endpoint or a batch API.
    engine = {"kind": kind, "base_url": "http://127.0.0.1:1/v1", "tokenizer": "a vision tokenizer"}
    task = example_task(engine)
    fmt = PromptFormat.of(task)
    pictures = [picture(colour=(60 * n, 0, 0)) for n in range(3)]
    formatted = formatted_rows([("", [data]) for data in pictures], fmt, template=task.prompt.template)
    prompts = prompt_encoders(ENDPOINT, fmt, TemplateTokenizer())(formatted)(
        formatted["prompt"].to_list(), image_digests=formatted[DIGEST_COLUMN].to_list()
    )
    assert len(prompts) == 3
    for prompt, data in zip(prompts, pictures, strict=True):
        image, text = prompt.messages[1]["content"]
        assert decoded(image["image_url"]["url"]) == ("data:image/png;base64", data)
        assert text == {"type": "text", "text": "What does the picture show?"}


@pytest.fixture
def recording_server() -> Iterator[tuple[str, list[dict]]]:
    """A chat-completions server on loopback that answers `cat` and keeps each request body."""
    bodies: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def do_POST(self) -> None:
            bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            answer = {
                "id": "c1",
                "object": "chat.completion",
                "created": 0,
                "model": "vlm",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "cat"}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 70, "completion_tokens": 1, "total_tokens": 71},
            }
            data = json.dumps(answer).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1", bodies
    finally:
        server.shutdown()
        server.server_close()


def test_the_endpoint_engine_posts_the_picture_parts_to_the_server(recording_server) -> None:
    base_url, bodies = recording_server
    task = image_task({"kind": "openai", "base_url": base_url, "model": "vlm", "tokenizer": "unused"})
    front, back = picture("PNG"), picture("JPEG", (16, 16))
    formatted = formatted_rows([("a tabby", [front, back])])
    encode = prompt_encoders(ENDPOINT, PromptFormat.of(task), TemplateTokenizer())(formatted)
    prompts = encode(formatted["prompt"].to_list(), image_digests=formatted[DIGEST_COLUMN].to_list())
    [generation] = OpenAIEngine().generate(task, prompts)
    assert generation.error is None and generation.text == "cat" and generation.num_prompt_tokens == 70
    [body] = bodies
    parts = body["messages"][1]["content"]
    assert [decoded(part["image_url"]["url"])[1] for part in parts[:2]] == [front, back]
    assert parts[2] == {"type": "text", "text": "Caption: a tabby"}
    assert body["model"] == "vlm" and body["max_tokens"] == 5


def text_only_tokenizer():
    """The tokenizer an endpoint falls back to without `engine.tokenizer`: the embedded text model's,
    whose chat template joins strings and has no place for a picture."""
    return load_tokenizer(str(ensure_embedded_model()))


def test_a_tokenizer_without_a_place_for_pictures_is_refused_before_anything_is_sent() -> None:
    task = example_task({"kind": "batch_api", "tokenizer": "HuggingFaceTB/SmolLM2-135M-Instruct"})
    raw = pl.DataFrame(
        {
            "row_id": [0, 1],
            "source_line": [1, 2],
            "image": ["a.png", "b.png"],
            IMAGES_COLUMN: [[picture()], [picture("JPEG")]],
            DIGEST_COLUMN: [image_digest([picture()]), image_digest([picture("JPEG")])],
            "error": [None, None],
        },
        schema_overrides={IMAGES_COLUMN: pl.List(pl.Binary), "error": pl.String},
    )
    with pytest.raises(ValueError) as refused:
        format_prompts(
            raw, PromptFormat.of(task), text_only_tokenizer(), max_model_len=512, max_tokens=5, source_file="p.jsonl"
        )
    message = str(refused.value)
    assert "engine.tokenizer" in message and "vision-language" in message, message
    assert "\n" not in message and "concatenate" not in message
    # A tokenizer whose chat template places pictures formats the same rows.
    formatted = format_prompts(
        raw, PromptFormat.of(task), TemplateTokenizer(), max_model_len=512, max_tokens=5, source_file="p.jsonl"
    )
    assert formatted["error"].null_count() == 2 and "<image>" in formatted["prompt"][0]


@pytest.mark.slow  # a Dagster run of the pipeline (cli_in_process), against the recording server
def test_the_example_task_on_an_endpoint_labels_every_row_with_its_own_picture(
    recording_server, cli_in_process, tmp_path: Path
) -> None:
    """`batch-assets run images examples/images/pictures.jsonl` with the example task on an endpoint:
    the pictures come into the drop zone, the server gets each row's picture, every row is labelled."""
    base_url, bodies = recording_server
    raw = yaml.safe_load((REPO_ROOT / "examples" / "tasks" / "images.yaml").read_text())
    raw["engine"] = {**raw["engine"], "kind": "openai", "base_url": base_url, "model": "vlm"}
    raw["engine"]["tokenizer"] = str(built_tiny_vlm())  # a vision-language model's tokenizer
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "images.yaml").write_text(yaml.safe_dump(raw))
    example = REPO_ROOT / "examples" / "images" / "pictures.jsonl"
    result = cli_in_process(["run", "images", str(example)], BATCH_ASSETS_TASKS_DIR=str(tasks))
    assert result.returncode == 0, result.stdout + result.stderr
    data = Path(os.environ["BATCH_ASSETS_DATA"])
    labels = pl.read_parquet(data / "storage" / "images" / "validated_labels" / "pictures.jsonl.parquet")
    assert labels.sort("row_id")["label"].to_list() == ["cat"] * 4 and labels["error"].null_count() == 4
    names = [json.loads(line)["image"] for line in example.read_text().splitlines()]
    sent = sorted(decoded(body["messages"][1]["content"][0]["image_url"]["url"])[1] for body in bodies)
    assert sent == sorted((example.parent / name).read_bytes() for name in names)
    assert {json.dumps(body["messages"][1]["content"][1]) for body in bodies} == {
        json.dumps({"type": "text", "text": "What does the picture show?"})
    }


# --- OpenAI batch lines with image_url parts ----------------------------------------------------


def batch_line(custom_id: str, content: object, role: str = "user", **body: object) -> str:
    messages = [{"role": "system", "content": "Label it."}, {"role": role, "content": content}]
    return json.dumps(
        {
            "custom_id": custom_id,
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": "vlm", "messages": messages, **body},
        }
    )


def read(lines: list[str], **limits: object) -> pl.DataFrame:
    return read_batch_requests(("\n".join(lines) + "\n").encode(), "batch.jsonl", ImageLimits(**limits))


def image_part(url: str, **extra: object) -> dict:
    return {"type": "image_url", "image_url": {"url": url, **extra}}


def test_batch_lines_with_pictures_keep_their_parts_in_order_and_are_named_by_the_bytes() -> None:
    png, jpeg = picture("PNG", (20, 10)), picture("JPEG", (8, 8))
    lines = [
        batch_line("a", [{"type": "text", "text": "Look:"}, image_part(data_url(png), detail="auto")]),
        batch_line("b", [image_part(data_url(png)), image_part(data_url(jpeg, "image/jpeg"))]),
        batch_line("c", "plain text"),
        # The same bytes under another type in its header: the same picture.
        batch_line("d", [{"type": "text", "text": "Look:"}, image_part(data_url(png, "image/x-whatever"))]),
        # A `detail` other than OpenAI's default changes the answer: another request.
        batch_line("e", [{"type": "text", "text": "Look:"}, image_part(data_url(png), detail="low")]),
    ]
    raw = read(lines)
    assert raw["error"].null_count() == 5
    assert raw[DIGEST_COLUMN].to_list()[:4] == [
        image_digest([png]),
        image_digest([png, jpeg]),
        None,
        image_digest([png]),
    ]
    assert raw[DIGEST_COLUMN][4] not in (None, image_digest([png]))
    assert raw[PIXELS_COLUMN].to_list() == [200, 264, None, 200, 200]
    first = json.loads(raw["messages"][0])[1]["content"]
    assert first == [{"type": "text", "text": "Look:"}, image_part(data_url(png), detail="auto")]
    assert json.loads(raw["messages"][2])[1]["content"] == "plain text"
    # A file without pictures keeps the text schema (and its requests their keys).
    assert DIGEST_COLUMN not in read([batch_line("c", "plain text")]).columns

    tokenizer = TemplateTokenizer()
    formatted = format_batch_prompts(
        raw, tokenizer, sampling_defaults=SamplingSpec(temperature=0), max_model_len=4096, source_file="batch.jsonl"
    )
    prompts = formatted["prompt"].to_list()
    assert "<|im_start|>user\nLook:<image>\n<|im_end|>" in prompts[0]
    assert "<|im_start|>user\n<image>\n<image>\n<|im_end|>" in prompts[1]
    assert prompts[0] == prompts[3] == prompts[4]
    keys = request_keys(
        prompts,
        formatted["row_id"].to_list(),
        True,
        formatted["request_params"].to_list(),
        raw[DIGEST_COLUMN].to_list(),
    )
    assert keys[0] == keys[3] and len(set(keys)) == 4

    digests = formatted[DIGEST_COLUMN].to_list()
    params = formatted["request_params"].to_list()
    # An endpoint is sent the parts as the line wrote them; the in-process engine the pictures.
    sent = batch_prompt_encoder(ENDPOINT, None, tokenizer, formatted)(prompts, params, image_digests=digests)
    assert sent[1].messages[1]["content"] == json.loads(raw["messages"][1])[1]["content"] and sent[1].images == ()
    assert sent[4].messages[1]["content"][1] == image_part(data_url(png), detail="low")
    assert decoded(sent[0].messages[1]["content"][1]["image_url"]["url"])[1] == png  # one request, either line's part
    assert sent[2].messages[1]["content"] == "plain text"
    local = batch_prompt_encoder(IN_PROCESS, None, tokenizer, formatted)(prompts, params, image_digests=digests)
    assert [p.images for p in local] == [(png,), (png, jpeg), (), (png,), (png,)]
    assert all(p.messages is None for p in local)


def test_batch_lines_with_pictures_and_a_text_only_tokenizer_are_error_lines_naming_engine_tokenizer() -> None:
    png = picture("PNG")
    lines = [
        batch_line("a", [{"type": "text", "text": "Look:"}, image_part(data_url(png))]),
        batch_line("b", "plain text"),
    ]
    formatted = format_batch_prompts(
        read(lines),
        text_only_tokenizer(),
        sampling_defaults=SamplingSpec(temperature=0),
        max_model_len=4096,
        source_file="batch.jsonl",
    )
    error = formatted["error"][0]
    assert error.startswith("chat_template_error: batch.jsonl line 1: "), error
    assert "engine.tokenizer" in error and "image_url" in error and "TypeError" not in error, error
    # A line without pictures is rendered and counted as before.
    assert formatted["error"][1] is None and formatted["num_prompt_tokens"][1] > 0


def test_each_bad_picture_is_its_lines_error_naming_the_part() -> None:
    png = picture("PNG", (20, 10))
    tiff = io.BytesIO()
    Image.new("RGB", (4, 4)).save(tiff, format="TIFF")
    cases = [
        (image_part("data:image/png;base64,@@@"), "unreadable_image", "not valid base64"),
        (image_part(data_url(png[:40])), "unreadable_image", ""),
        (image_part(data_url(b"not a picture")), "unreadable_image", "identify"),
        (image_part(data_url(picture("PNG", (100, 100)))), "image_too_large", "max_pixels 5000"),
        (image_part(data_url(tiff.getvalue(), "image/tiff")), "unsupported_image_format", "TIFF"),
        (image_part("data:image/png;base64,"), "missing_image", ""),
        (image_part("https://example.com/cat.png"), "image_url_not_allowed", "fetch_urls"),
        (image_part("file:///etc/passwd"), "image_url_not_allowed", "neither"),
        ({"type": "image_url", "image_url": "https://example.com/cat.png"}, "invalid_message", "url string"),
        (image_part(data_url(png), detail="max"), "invalid_field", "detail"),
        (image_part(data_url(png), size=3), "unsupported_field", "image_url.size"),
        ({"type": "input_audio", "input_audio": {}}, "invalid_message", "text and image_url"),
    ]
    lines = [batch_line(str(n), [{"type": "text", "text": "x"}, part]) for n, (part, _, _) in enumerate(cases)]
    lines.append(batch_line("sys", [image_part(data_url(png))], role="system"))
    raw = read(lines, max_pixels=5000)
    for (part, code, words), error in zip([*cases, (None, "invalid_message", "only user")], raw["error"], strict=True):
        assert error is not None and error.startswith(f"{code}: batch.jsonl line "), (part, error)
        assert words in error, (part, error)
        assert code in REQUEST_ERROR_CODES  # a bad request: HTTP 400 in the batch's error file
    assert "body.messages[1].content[1].image_url.url: " in raw["error"][0]
    # The batch's error file names the part as OpenAI's `param`.
    assert error_object(raw["error"][3], 4)["param"] == "messages[1].content[1].image_url.url"
    # With `input.images.fetch_urls` (an endpoint's server fetches): the URL passes, and names the request.
    fetched = read([lines[6]], fetch_urls=True)
    assert fetched["error"][0] is None and fetched[PIXELS_COLUMN][0] == 0
    assert (
        fetched[DIGEST_COLUMN][0] != read([lines[6].replace("cat.png", "dog.png")], fetch_urls=True)[DIGEST_COLUMN][0]
    )
    assert json.loads(fetched["messages"][0])[1]["content"][1] == image_part("https://example.com/cat.png")


def test_a_batch_tasks_image_limits_count_in_its_versions_only_once_set() -> None:
    from batch_assets.pipeline.code_versions import code_versions
    from batch_assets.pipeline.engine_contract import ResolvedSettings

    resolved = ResolvedSettings(kind="openai", model="m", model_setting="", max_model_len=1024)

    def versions(images: dict | None) -> dict[str, str]:
        task = TaskSpec.model_validate(
            {
                "name": "batch",
                "input": {"format": "openai_batch", **({"images": images} if images is not None else {})},
                "engine": {"kind": "openai", "base_url": "http://127.0.0.1:1/v1"},
                "output": {"kind": "text"},
            }
        )
        return code_versions(task, resolved)

    plain = versions(None)
    # The limits decide which lines are errors: set, they count; at their defaults, nothing changes
    # for tasks written before pictures were read (`fetch_urls` counts only when on).
    assert versions({}) == plain
    assert versions({"max_pixels": 1000})["formatted_prompts"] != plain["formatted_prompts"]
    assert versions({"fetch_urls": True})["formatted_prompts"] != plain["formatted_prompts"]
