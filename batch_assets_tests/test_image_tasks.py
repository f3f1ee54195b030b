"""Image tasks through the whole pipeline on the tiny vision-language model (tiny_vlm.py): labels equal
a plain vLLM script's (`LLM.chat` with the images) for every row of 200+ PNG and JPEG pictures, from
a local drop zone and from S3 over loopback (moto); every bad image is its row's error; a request
is named by its image's bytes, not its path.

One engine start for the module: every run here asks for the same engine, which the session keeps warm.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import boto3
import dagster as dg
import polars as pl
import pytest
import s3fs

from batch_assets.lib.task_definitions import build_definitions, pipeline_job_name
from batch_assets.storage.drop_files import partition_key_for, partitions_def_name
from batch_assets_tests.support.golden import content_digest, kept_or_made, versions
from batch_assets_tests.support.s3 import use_endpoint
from batch_assets_tests.tiny_vlm import built_tiny_vlm, write_test_images

# The slow tier (`make test-fast` leaves it out): the engine, and an S3 server.
pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parent.parent
TASKS_DIR = REPO_ROOT / "examples" / "tasks"
TASK = "images"
PICTURES = 200
GOLDEN = "plain_vlm-images.json"  # under batch_assets_tests/golden/
BUCKET, PREFIX = "image-bucket", "team"


@pytest.fixture(scope="module")
def vlm() -> Iterator[str]:
    """The tiny VLM as every task's model, and the shipped `images` task (examples/tasks) as the task."""
    path = str(built_tiny_vlm())
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("BATCH_ASSETS_MODEL", path)
        patch.setenv("BATCH_ASSETS_TASKS_DIR", str(TASKS_DIR))
        yield path


@pytest.fixture(scope="module")
def pictures(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder of 200 pictures (PNG and JPEG, five sizes) and `pictures.jsonl` naming each once."""
    folder = tmp_path_factory.mktemp("pictures")
    names = write_test_images(folder / "photos", PICTURES)
    lines = [json.dumps({"image": f"photos/{name}", "id": index}) for index, name in enumerate(names)]
    (folder / "pictures.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def reference_labels(pictures: Path, vlm: str, work: Path) -> list[str]:
    """bench/plain_vlm_script.py's labels for pictures.jsonl: kept as a golden file (a vLLM start
    costs CI time), made again when vLLM, torch, the CPU, the weights, the task or the pictures change."""
    identity = {
        **versions(),
        "model": content_digest(Path(vlm)),
        "task": (TASKS_DIR / f"{TASK}.yaml").read_text(),
        "pictures": content_digest(pictures),
    }
    return kept_or_made(
        GOLDEN, identity, lambda: plain_vlm_labels(pictures, work), field="labels", made_of="weights or pictures"
    )


def plain_vlm_labels(pictures: Path, work: Path) -> list[str]:
    target = work / "plain.parquet"
    completed = subprocess.run(
        [
            sys.executable,
            str(REPO_ROOT / "bench" / "plain_vlm_script.py"),
            str(pictures / "pictures.jsonl"),
            str(target),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"},
        timeout=600,
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    return pl.read_parquet(target)["label"].to_list()


def run(file_name: str, instance: dg.DagsterInstance) -> dg.ExecuteInProcessResult:
    key = partition_key_for(file_name)
    instance.add_dynamic_partitions(partitions_def_name(TASK), [key])
    job = build_definitions().resolve_job_def(pipeline_job_name(TASK))
    return job.execute_in_process(instance=instance, partition_key=key, raise_on_error=False)


def metadata(result: dg.ExecuteInProcessResult, asset: str) -> dict:
    [event] = [e for e in result.get_asset_materialization_events() if e.asset_key.path[-1] == asset]
    return {name: value.value for name, value in event.materialization.metadata.items()}


def copy_pictures(pictures: Path, zone: Path) -> None:
    (zone / "photos").mkdir(parents=True, exist_ok=True)
    for path in (pictures / "photos").iterdir():
        (zone / "photos" / path.name).write_bytes(path.read_bytes())
    (zone / "pictures.jsonl").write_bytes((pictures / "pictures.jsonl").read_bytes())


def test_labels_equal_plain_vllm_for_every_picture_and_a_request_is_its_image_bytes(
    vlm: str, pictures: Path, data_dir: Path, tmp_path: Path
) -> None:
    expected = reference_labels(pictures, vlm, tmp_path)
    assert len(expected) == PICTURES and set(expected) <= {"cat", "dog", "bird"}
    assert len(set(expected)) > 1  # the pictures move the random model's answers: images reach it
    zone = data_dir / "drops" / TASK
    copy_pictures(pictures, zone)
    with dg.instance_for_test() as instance:
        result = run("pictures.jsonl", instance)
        assert result.success
        labels = pl.read_parquet(data_dir / "storage" / TASK / "validated_labels" / "pictures.jsonl.parquet")
        assert labels["error"].null_count() == PICTURES
        assert labels.sort("row_id")["label"].to_list() == expected
        assert "images" not in labels.columns and labels["image_pixels"].null_count() == 0
        raw = metadata(result, "raw_prompts")
        assert raw["images"] == PICTURES and raw["image_error_rows"] == 0
        assert raw["image_pixels"] == labels["image_pixels"].sum()

        # The same pictures under other names are the same requests (answered from the result
        # cache); one picture replaced under its own name is a new request, answered as plain vLLM would.
        # A picture whose label differs from img-0002's, to replace it with.
        other = next(i for i in range(4, PICTURES, 2) if expected[i] != expected[2])
        (zone / "copies").mkdir()
        for name in ("img-0000.png", "img-0001.jpg"):
            (zone / "copies" / name).write_bytes((zone / "photos" / name).read_bytes())
        (zone / "photos" / "img-0002.png").write_bytes((zone / "photos" / f"img-{other:04d}.png").read_bytes())
        again = [{"image": "copies/img-0000.png"}, {"image": "copies/img-0001.jpg"}, {"image": "photos/img-0002.png"}]
        (zone / "renamed.jsonl").write_text("".join(json.dumps(r) + "\n" for r in again))
        result = run("renamed.jsonl", instance)
        assert result.success
        assert metadata(result, "inference_outputs")["rows_from_cache"] == 3  # no request sent again
        renamed = pl.read_parquet(data_dir / "storage" / TASK / "validated_labels" / "renamed.jsonl.parquet")
        assert renamed.sort("row_id")["label"].to_list() == [expected[0], expected[1], expected[other]]


def test_the_documented_run_command_brings_the_pictures_and_labels_every_row(
    vlm: str, cli_in_process, tmp_path: Path
) -> None:
    """`batch-assets run images examples/images/pictures.jsonl` (docs/images.md): the pictures the
    file names beside it come into the drop zone with it, and every row is labelled."""
    example = REPO_ROOT / "examples" / "images" / "pictures.jsonl"
    result = cli_in_process(["run", TASK, str(example)], BATCH_ASSETS_MODEL=vlm)
    assert result.returncode == 0, result.stdout + result.stderr
    data = Path(os.environ["BATCH_ASSETS_DATA"])
    labels = pl.read_parquet(data / "storage" / TASK / "validated_labels" / "pictures.jsonl.parquet")
    names = [json.loads(line)["image"] for line in example.read_text().splitlines()]
    assert labels.height == len(names) == 4
    assert labels["error"].to_list() == [None] * 4
    assert set(labels["label"]) <= {"cat", "dog", "bird"} and labels["label"].null_count() == 0
    for name in names:
        assert (data / "drops" / TASK / name).read_bytes() == (example.parent / name).read_bytes()

    # A file naming a picture that is not beside it: refused before anything is copied, naming it.
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "more.jsonl").write_text('{"image": "img-0000.png"}\n{"image": "photos/absent.png"}\n')
    refused = cli_in_process(["run", TASK, str(mine / "more.jsonl")], BATCH_ASSETS_MODEL=vlm)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    said = refused.stdout + refused.stderr
    assert "photos/absent.png" in said and str(mine / "photos" / "absent.png") in said, said
    assert not (data / "drops" / TASK / "more.jsonl").exists()


BAD_PNG_TRUNCATED_AT = 60


def test_bad_images_are_their_rows_errors_and_good_rows_are_labelled(
    vlm: str, pictures: Path, data_dir: Path, tmp_path: Path
) -> None:
    from PIL import Image

    expected = reference_labels(pictures, vlm, tmp_path)
    zone = data_dir / "drops" / TASK
    copy_pictures(pictures, zone)
    photos = zone / "photos"
    png = (photos / "img-0000.png").read_bytes()
    (photos / "truncated.png").write_bytes(png[:BAD_PNG_TRUNCATED_AT])
    (photos / "notes.png").write_text("not a picture")
    Image.new("RGB", (3000, 2000)).save(photos / "huge.png")  # 6 MP, over the task's 4 MP: a bomb's header
    Image.new("RGB", (8, 8)).save(photos / "scan.tiff")
    (photos / "link.png").symlink_to(photos / "img-0000.png")
    outside = data_dir / "secret.png"
    outside.write_bytes(png)
    data_url = "data:image/jpeg;base64," + base64.b64encode((photos / "img-0001.jpg").read_bytes()).decode()
    records = [
        ({"image": "photos/img-0000.png"}, None),
        ({"image": "photos/absent.png"}, "image_not_found"),
        ({"image": "photos/truncated.png"}, "unreadable_image"),
        ({"image": "photos/notes.png"}, "unreadable_image"),
        ({"image": "photos/huge.png"}, "image_too_large"),
        ({"image": "photos/scan.tiff"}, "unsupported_image_format"),
        ({"image": "../../secret.png"}, "unsafe_image_path"),
        ({"image": "photos/link.png"}, "unsafe_image_path"),
        ({"image": "/etc/passwd"}, "unsafe_image_path"),
        ({"image": "https://example.com/cat.png"}, "image_url_not_allowed"),
        ({"image": f"s3://{BUCKET}/{PREFIX}/cat.png"}, "image_url_not_allowed"),
        ({"image": None}, "missing_image"),
        ({"image": data_url}, None),
        ({"image": "photos/img-0003.jpg"}, None),
    ]
    (zone / "mixed.jsonl").write_text("".join(json.dumps(record) + "\n" for record, _ in records))
    with dg.instance_for_test() as instance:
        result = run("mixed.jsonl", instance)
        assert result.success
    labels = pl.read_parquet(data_dir / "storage" / TASK / "validated_labels" / "mixed.jsonl.parquet").sort("row_id")
    assert labels.height == len(records)
    for (record, code), (label, error, line) in zip(
        records, labels.select("label", "error", "source_line").iter_rows(), strict=True
    ):
        if code is None:
            assert error is None and label is not None, (record, error)
        else:
            assert error is not None and label is None, record
            assert error.startswith(f"{code}: mixed.jsonl line {line}: field 'image': "), error
    assert labels["label"].to_list()[0] == expected[0]
    assert labels["label"].to_list()[-2:] == [expected[1], expected[3]]
    assert "truncated" in labels["error"][2] or "decoded" in labels["error"][2]
    assert "4000000" in labels["error"][4]


@pytest.fixture
def s3_data(moto_endpoint: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[boto3.client]:  # noqa: F811
    use_endpoint(monkeypatch, moto_endpoint)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("BATCH_ASSETS_DATA", f"s3://{BUCKET}/{PREFIX}")
    home = tmp_path / "dagster_home"
    home.mkdir()
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    client = boto3.client("s3")
    client.create_bucket(Bucket=BUCKET)
    yield client
    s3fs.S3FileSystem.clear_instance_cache()


def test_pictures_in_s3_get_the_plain_vllm_labels(vlm: str, pictures: Path, s3_data, tmp_path: Path) -> None:
    expected = reference_labels(pictures, vlm, tmp_path)
    zone = f"{PREFIX}/drops/{TASK}"
    for path in (pictures / "photos").iterdir():
        s3_data.put_object(Bucket=BUCKET, Key=f"{zone}/photos/{path.name}", Body=path.read_bytes())
    records = [json.loads(line) for line in (pictures / "pictures.jsonl").read_text().splitlines()]
    # One picture by its s3:// URI, one inline as a data: URL: the same bytes, the same labels.
    records[5]["image"] = f"s3://{BUCKET}/{zone}/{records[5]['image']}"
    records[6]["image"] = (
        "data:image/png;base64," + base64.b64encode((pictures / records[6]["image"]).read_bytes()).decode()
    )
    body = "".join(json.dumps(record) + "\n" for record in records)
    s3_data.put_object(Bucket=BUCKET, Key=f"{zone}/pictures.jsonl", Body=body.encode())
    with dg.instance_for_test() as instance:
        result = run("pictures.jsonl", instance)
        assert result.success, [e.message for e in result.all_events if e.is_failure]
    output = s3_data.get_object(Bucket=BUCKET, Key=f"{PREFIX}/storage/{TASK}/validated_labels/pictures.jsonl.parquet")
    import io

    labels = pl.read_parquet(io.BytesIO(output["Body"].read())).sort("row_id")
    assert labels["error"].null_count() == PICTURES
    assert labels["label"].to_list() == expected


BATCH_TASK, BATCH_PICTURES = "images_batch", 40


def test_openai_batch_lines_with_pictures_get_the_image_tasks_labels(
    vlm: str, pictures: Path, data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same pictures as `image_url` parts of OpenAI batch lines (`data:` URLs), with the image
    task's system prompt, text and choices, get the image task's labels, on the same warm engine."""
    import yaml

    expected = reference_labels(pictures, vlm, tmp_path)
    images_task = yaml.safe_load((TASKS_DIR / f"{TASK}.yaml").read_text())
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    batch_task = {
        "description": "OpenAI batch lines with pictures",
        "input": {"format": "openai_batch", "images": images_task["input"]["images"]},
        "engine": images_task["engine"],  # the image task's engine: the session's warm one serves both
        "sampling": images_task["sampling"],
        "output": {"kind": "text"},
    }
    (tasks / f"{BATCH_TASK}.yaml").write_text(yaml.safe_dump(batch_task))
    monkeypatch.setenv("BATCH_ASSETS_TASKS_DIR", str(tasks))

    def line(custom_id: str, url: str) -> str:
        user = [
            {"type": "image_url", "image_url": {"url": url}},
            {"type": "text", "text": images_task["prompt"]["template"]},
        ]
        body = {
            "model": "tiny-vlm",
            "messages": [
                {"role": "system", "content": images_task["prompt"]["system"]},
                {"role": "user", "content": user},
            ],
            "structured_outputs": {"choice": images_task["output"]["choices"]},
        }
        return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body})

    records = [json.loads(text) for text in (pictures / "pictures.jsonl").read_text().splitlines()][:BATCH_PICTURES]
    urls = []
    for record in records:
        path = pictures / record["image"]
        mime = "image/png" if path.suffix == ".png" else "image/jpeg"
        urls.append(f"data:{mime};base64,{base64.b64encode(path.read_bytes()).decode()}")
    lines = [line(f"p{index}", url) for index, url in enumerate(urls)]
    lines += [
        line("again", urls[0]),  # the first picture again: the same request, answered once
        line("broken", "data:image/png;base64," + base64.b64encode(b"not a picture").decode()),
        line("remote", "https://example.com/cat.png"),  # the in-process engine fetches nothing
    ]
    zone = data_dir / "drops" / BATCH_TASK
    zone.mkdir(parents=True)
    (zone / "pictures.jsonl").write_text("\n".join(lines) + "\n")
    key = partition_key_for("pictures.jsonl")
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions(partitions_def_name(BATCH_TASK), [key])
        job = build_definitions().resolve_job_def(pipeline_job_name(BATCH_TASK))
        result = job.execute_in_process(instance=instance, partition_key=key, raise_on_error=False)
        assert result.success, [e.message for e in result.all_events if e.is_failure]
    storage = data_dir / "storage" / BATCH_TASK
    labels = pl.read_parquet(storage / "validated_labels" / "pictures.jsonl.parquet").sort("row_id")
    assert labels.height == BATCH_PICTURES + 3
    assert labels["label"].to_list()[:BATCH_PICTURES] == expected[:BATCH_PICTURES]
    assert labels["label"][BATCH_PICTURES] == expected[0]
    assert metadata(result, "inference_outputs")["rows_deduplicated"] == 1
    errors = labels["error"].to_list()[BATCH_PICTURES + 1 :]
    assert errors[0].startswith("unreadable_image: pictures.jsonl line 42: body.messages[1].content[0].image_url.url:")
    assert errors[1].startswith("image_url_not_allowed: pictures.jsonl line 43: ")
    # OpenAI's output file answers each good line; the error file each bad one, as a bad request.
    outputs = [json.loads(text) for text in (storage / "batch_output" / f"{key}.jsonl").read_text().splitlines()]
    answers = {o["custom_id"]: o["response"]["body"]["choices"][0]["message"]["content"] for o in outputs}
    assert answers["p1"] == expected[1] and len(answers) == BATCH_PICTURES + 1
    failed = [json.loads(text) for text in (storage / "batch_errors" / f"{key}.jsonl").read_text().splitlines()]
    assert [(f["custom_id"], f["response"]["status_code"]) for f in failed] == [("broken", 400), ("remote", 400)]
