"""Image values and bytes (pipeline/inputs/images.py), the chat an image task renders, bad picture names as
their rows' errors, and the pictures `batch-assets run` brings from beside a file into the drop zone
(storage/drop_pictures.py): no engine."""

from __future__ import annotations

import base64
import io
import json
import os
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from PIL import Image

from batch_assets.pipeline.format_prompts import PromptFormat, render_prompt
from batch_assets.pipeline.inference_requests import request_keys
from batch_assets.pipeline.inputs.images import (
    IMAGES_COLUMN,
    ImageInputError,
    ImageSource,
    check_image,
    image_digest,
    image_source,
)
from batch_assets.pipeline.inputs.read_prompts import ParseOptions, read_prompts
from batch_assets.pipeline.task_spec import TaskSpec, TaskSpecError, load_task_spec
from batch_assets.pipeline.task_spec.input import ImageLimits, InputSpec
from batch_assets.storage.drop_files import DropFile
from batch_assets.storage.drop_zone_copies import CopyRefused, copy_into_drop_zone, read_named_files
from batch_assets.storage.image_sources import attach_images
from batch_assets.storage.locations import drop_zone
from batch_assets_tests.tiny_vlm import CHAT_TEMPLATE, REPO_ROOT

EXAMPLE_TASK = REPO_ROOT / "examples" / "tasks" / "images.yaml"


def picture(fmt: str = "PNG", size: tuple[int, int] = (20, 10)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, (200, 30, 30)).save(buffer, format=fmt)
    return buffer.getvalue()


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("a.png", ImageSource(path="batch/a.png")),
        ("./sub/../b.jpg", ImageSource(path="batch/b.jpg")),
        ("../top.png", ImageSource(path="top.png")),  # still inside the zone: the drop file is in batch/
        ("s3://bucket/x.png", ImageSource(s3="s3://bucket/x.png")),
        (b"\x89PNG", ImageSource(inline=b"\x89PNG")),
        ("data:image/png;base64," + base64.b64encode(b"abc").decode(), ImageSource(inline=b"abc")),
        ("data:,a%20b", ImageSource(inline=b"a b")),
    ],
)
def test_a_value_names_its_bytes_relative_to_the_drop_file(value: object, expected: ImageSource) -> None:
    assert image_source(value, "batch/pictures.jsonl") == expected


@pytest.mark.parametrize(
    ("value", "code"),
    [
        ("../../etc/passwd", "unsafe_image_path"),
        ("..", "unsafe_image_path"),
        ("/etc/passwd", "unsafe_image_path"),
        ("https://example.com/a.png", "image_url_not_allowed"),
        ("file:///etc/passwd", "image_url_not_allowed"),
        (None, "missing_image"),
        ("  ", "missing_image"),
        (b"", "missing_image"),
        ("data:image/png;base64,@@@", "unreadable_image"),
    ],
)
def test_a_value_that_may_not_be_read_is_refused_before_any_read(value: object, code: str) -> None:
    with pytest.raises(ImageInputError) as refused:
        image_source(value, "batch/pictures.jsonl")
    assert refused.value.code == code


def test_limits_formats_and_broken_bytes_are_each_named() -> None:
    limits = ImageLimits(max_bytes=100_000, max_pixels=10_000)
    assert check_image(picture(), limits) == 200
    assert check_image(picture("JPEG"), limits) == 200
    cases = [
        (picture(size=(200, 100)), "image_too_large", "20000 pixels"),
        (picture("TIFF"), "unsupported_image_format", "a TIFF image"),
        (picture()[:45], "unreadable_image", "image file is truncated"),
        (b"just text", "unreadable_image", "not an image"),
        (b"x" * 100_001, "image_too_large", "100001 bytes"),
    ]
    for data, code, words in cases:
        with pytest.raises(ImageInputError) as refused:
            check_image(data, limits)
        assert refused.value.code == code and words in refused.value.cause, refused.value.cause


def test_a_decompression_bomb_is_refused_from_its_header() -> None:
    # A 20,000 x 20,000 PNG of one colour is a few hundred kB; decoded it would be 1.2 GB.
    buffer = io.BytesIO()
    Image.new("1", (20_000, 20_000)).save(buffer, format="PNG")
    with pytest.raises(ImageInputError) as refused:
        check_image(buffer.getvalue(), ImageLimits())
    assert refused.value.code == "image_too_large" and "400000000 pixels" in refused.value.cause


def test_a_request_is_named_by_its_image_bytes_not_its_name() -> None:
    one, other = picture(), picture(size=(21, 10))
    prompts, rows = ["same prompt"] * 3, [0, 1, 2]
    digests = [image_digest([one]), image_digest([one]), image_digest([other])]
    keys = request_keys(prompts, rows, True, None, digests)
    assert keys[0] == keys[1] != keys[2]
    assert request_keys(prompts, rows, True)[0] not in keys  # a text-only request never shares an image's key


def test_the_chat_template_gets_an_image_part_before_the_text() -> None:
    class Tokenizer:
        chat_template = CHAT_TEMPLATE

        def apply_chat_template(self, conversation, tokenize=False, add_generation_prompt=True):
            from jinja2 import Template

            return Template(CHAT_TEMPLATE).render(messages=conversation, add_generation_prompt=add_generation_prompt)

    fmt = PromptFormat("Label it.", "What is {caption}?", None, ("caption",), image_count=1)
    rendered = render_prompt(fmt, Tokenizer(), "a thing")
    assert "<|im_start|>user\n<image>\na thing<|im_end|>" in rendered


def test_image_fields_may_stand_alone_but_never_share_a_text_field() -> None:
    assert InputSpec(image_fields=["image"]).text_fields == []
    with pytest.raises(ValueError, match="must not share"):
        InputSpec(image_fields=["x"], text_fields=["x"])
    with pytest.raises(ValueError, match="image_url parts"):
        InputSpec(format="openai_batch", image_fields=["x"])


def test_an_image_task_runs_on_every_engine_kind_but_only_as_a_chat_task(tmp_path: Path) -> None:
    raw = {**yaml.safe_load(EXAMPLE_TASK.read_text()), "name": "images"}
    assert TaskSpec.model_validate(raw).input.image_fields == ["image"]
    # Endpoints and batch APIs take the pictures as image_url content parts (format_prompts.py), with
    # the vision-language model's tokenizer: a Hugging Face id, or the model's own local folder.
    (tmp_path / "vlm").mkdir()
    for engine in (
        {"kind": "openai", "base_url": "http://127.0.0.1:1/v1", "tokenizer": "HuggingFaceTB/SmolVLM-256M-Instruct"},
        {"kind": "batch_api", "tokenizer": "HuggingFaceTB/SmolVLM-256M-Instruct"},
        {"kind": "batch_api", "model": str(tmp_path / "vlm")},
    ):
        task = TaskSpec.model_validate({**raw, "engine": {**raw["engine"], **engine}})
        assert task.engine.kind == engine["kind"] and task.input.image_fields == ["image"]
    # A completion-style prompt has no place for a picture; an embedding or similarity task embeds text.
    with pytest.raises(ValueError, match="raw_template"):
        TaskSpec.model_validate({**raw, "prompt": {**raw["prompt"], "raw_template": "{system} {user}"}})
    plain = {**raw, "prompt": {"template": raw["prompt"]["template"]}, "engine": {"max_model_len": 256}}
    with pytest.raises(ValueError, match="needs a chat task"):
        TaskSpec.model_validate({**plain, "output": {**raw["output"], "method": "similarity"}})
    with pytest.raises(ValueError, match="needs a chat task"):
        TaskSpec.model_validate({**plain, "output": {"kind": "embedding"}})


def test_image_urls_are_fetched_only_by_an_endpoint_for_openai_batch_lines() -> None:
    from batch_assets.pipeline.task_spec import TaskSpec

    batch = {
        "name": "batch",
        "input": {"format": "openai_batch", "images": {"fetch_urls": True}},
        "output": {"kind": "text"},
    }
    for kind in ("openai", "batch_api"):
        engine = {"kind": kind, "base_url": "http://127.0.0.1:1/v1"} if kind == "openai" else {"kind": kind}
        assert TaskSpec.model_validate({**batch, "engine": engine}).input.images.fetch_urls
    # The in-process engine fetches nothing; a records task's image fields read the drop zone and S3.
    with pytest.raises(ValueError, match="fetch_urls"):
        TaskSpec.model_validate(batch)
    records = {
        "name": "pictures",
        "input": {"image_fields": ["image"], "images": {"fetch_urls": True}},
        "prompt": {"template": "What is it?"},
        "engine": {"kind": "openai", "base_url": "http://127.0.0.1:1/v1", "tokenizer": "a vision tokenizer"},
        "output": {"kind": "text"},
    }
    with pytest.raises(ValueError, match="fetch_urls"):
        TaskSpec.model_validate(records)


@pytest.mark.parametrize(
    "engine", ["kind: openai\n  base_url: http://127.0.0.1:1/v1", "kind: batch_api\n  model: gpt-4o"]
)
def test_an_image_task_on_an_endpoint_without_a_vision_tokenizer_is_refused_when_it_loads(
    engine: str, tmp_path: Path
) -> None:
    # Without engine.tokenizer an endpoint renders and counts prompts with the embedded text model's
    # tokenizer, whose chat template has no place for a picture.
    path = tmp_path / "images.yaml"
    path.write_text(EXAMPLE_TASK.read_text().replace("engine:\n", f"engine:\n  {engine}\n"))
    with pytest.raises(TaskSpecError) as refused:
        load_task_spec(path)
    message = str(refused.value)
    assert message.startswith(f"{path}: engine.tokenizer"), message
    assert "vision-language model" in message and "\n" not in message, message


def write_picture(path: Path, fmt: str = "PNG", size: tuple[int, int] = (20, 10)) -> bytes:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = picture(fmt, size)
    path.write_bytes(data)
    return data


def image_rows(values: list[object]) -> pl.DataFrame:
    return pl.DataFrame(
        {"row_id": list(range(len(values))), "source_line": [n + 1 for n in range(len(values))], "image": values},
        schema_overrides={"image": pl.Object} if any(isinstance(v, dict) for v in values) else None,
    ).with_columns(error=pl.lit(None, dtype=pl.String))


def test_a_bad_picture_name_is_its_rows_error_not_the_files(data_dir: Path) -> None:
    zone = drop_zone("images")
    good = write_picture(Path(zone.path) / "good.png")
    (Path(zone.path) / "adir.png").mkdir()
    values = ["good.png", "adir.png/", "adir.png", "x" * 300 + ".png", "a\x00b.png", "good.png"]
    rows = attach_images(image_rows(values), DropFile("p.jsonl", zone, "v"), InputSpec(image_fields=["image"]))
    codes = [error.split(":", 1)[0] if error else None for error in rows["error"]]
    assert codes == [None, "unsafe_image_path", "unsafe_image_path", "image_not_found", "unsafe_image_path", None]
    assert rows[IMAGES_COLUMN].to_list() == [[good], None, None, None, None, [good]]
    for code, error in zip(codes, rows["error"], strict=True):
        assert error is None or error.startswith(f"{code}: p.jsonl line "), error
    assert "folder" in rows["error"][1] and "folder" in rows["error"][2]
    assert "NUL" in rows["error"][4]


def test_a_hugging_face_image_struct_in_parquet_is_read_by_its_bytes(data_dir: Path) -> None:
    # The `datasets` Image feature as parquet stores it: struct<bytes: binary, path: string>.
    zone = drop_zone("images")
    beside = write_picture(Path(zone.path) / "photos" / "b.jpg", "JPEG")
    inline = picture(size=(8, 8))
    structs = [
        {"bytes": inline, "path": "cat.png"},  # the bytes are the picture; the path only its old name
        {"bytes": None, "path": "photos/b.jpg"},  # no bytes: the path, relative to the drop file
        {"bytes": None, "path": None},
    ]
    struct = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    buffer = io.BytesIO()
    pq.write_table(pa.table({"image": pa.array(structs, type=struct)}), buffer)
    options = ParseOptions(text_fields=())
    raw = read_prompts(buffer.getvalue(), "hf.parquet", options)
    rows = attach_images(raw, DropFile("hf.parquet", zone, "v"), InputSpec(image_fields=["image"]))
    assert rows[IMAGES_COLUMN].to_list()[:2] == [[inline], [beside]]
    assert rows["error"].to_list()[:2] == [None, None]
    assert rows["error"][2].startswith("missing_image: hf.parquet line 3: field 'image': "), rows["error"][2]


# --- `batch-assets run` brings the pictures a file names from beside it ----------------------------


def user_folder(tmp_path: Path, records: list[dict]) -> Path:
    """A user's folder: `pictures.jsonl` with the records, and two pictures under photos/."""
    folder = tmp_path / "mine"
    write_picture(folder / "photos" / "a.png")
    write_picture(folder / "photos" / "b.jpg", "JPEG")
    (folder / "pictures.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    return folder / "pictures.jsonl"


def copy(file: Path, replace: bool = False) -> list[str]:
    said: list[str] = []
    spec = TaskSpec.model_validate({**yaml.safe_load(EXAMPLE_TASK.read_text()), "name": "images"}).input
    named = read_named_files([file])
    copy_into_drop_zone("images", named, last_origin=lambda _: None, replace=replace, say=said.append, input_spec=spec)
    return said


def zone_files() -> list[str]:
    root = Path(drop_zone("images").path)
    return sorted(str(path.relative_to(root)) for path in root.rglob("*") if path.is_file()) if root.exists() else []


def test_the_pictures_a_file_names_beside_it_come_with_it_into_the_drop_zone(data_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "outside.png").write_bytes(picture())
    records = [
        {"image": "photos/a.png"},
        {"image": "./photos/b.jpg"},
        {"image": "photos/a.png"},
        {"image": "../outside.png"},  # leads out of the drop zone: the row's unsafe_image_path, nothing copied
        {"image": "data:image/png;base64," + base64.b64encode(picture()).decode()},
        {"image": "s3://bucket/x.png"},
        {"text": "no image: the row's missing_image"},
    ]
    file = user_folder(tmp_path, records)
    copy(file)
    assert zone_files() == ["photos/a.png", "photos/b.jpg", "pictures.jsonl"]
    zone = Path(drop_zone("images").path)
    assert (zone / "photos" / "b.jpg").read_bytes() == (file.parent / "photos" / "b.jpg").read_bytes()
    assert not (data_dir / "drops" / "outside.png").exists()
    # Copied again, nothing changes: identical pictures are not written again.
    before = os.stat(zone / "photos" / "a.png").st_mtime_ns
    copy(file)
    assert os.stat(zone / "photos" / "a.png").st_mtime_ns == before


def test_a_picture_that_cannot_be_brought_refuses_the_copy_before_anything_is_copied(
    data_dir: Path, tmp_path: Path
) -> None:
    file = user_folder(tmp_path, [{"image": "photos/a.png"}, {"image": "photos/absent.png"}, {"image": "gone.jpg"}])
    with pytest.raises(CopyRefused) as refused:
        copy(file)
    message = str(refused.value)
    zone = Path(drop_zone("images").path)
    assert "photos/absent.png" in message and "gone.jpg" in message and "nothing was copied" in message, message
    assert str(file.parent / "photos" / "absent.png") in message and str(zone / "photos" / "absent.png") in message
    assert zone_files() == []
    # A picture already in the drop zone needs nothing beside the file.
    write_picture(zone / "photos" / "absent.png")
    write_picture(zone / "gone.jpg", "JPEG")
    copy(file)
    assert zone_files() == ["gone.jpg", "photos/a.png", "photos/absent.png", "pictures.jsonl"]


def test_links_beside_the_file_are_never_followed_and_a_different_picture_is_replaced_only_when_asked(
    data_dir: Path, tmp_path: Path
) -> None:
    file = user_folder(tmp_path, [{"image": "photos/link.png"}])
    (file.parent / "photos" / "link.png").symlink_to(file.parent / "photos" / "a.png")
    with pytest.raises(CopyRefused, match="photos/link.png.*symbolic link"):
        copy(file)
    (file.parent / "linked").symlink_to(file.parent / "photos")
    file.write_text(json.dumps({"image": "linked/a.png"}) + "\n")
    with pytest.raises(CopyRefused, match="linked.*symbolic link"):
        copy(file)
    assert zone_files() == []

    file.write_text(json.dumps({"image": "photos/a.png"}) + "\n")
    zone = Path(drop_zone("images").path)
    write_picture(zone / "photos" / "a.png", size=(30, 30))  # another picture of that name
    with pytest.raises(CopyRefused, match="photos/a.png.*--replace"):
        copy(file)
    assert zone_files() == ["photos/a.png"]
    said = copy(file, replace=True)
    assert (zone / "photos" / "a.png").read_bytes() == (file.parent / "photos" / "a.png").read_bytes()
    assert any("photos/a.png" in line for line in said), said
