"""Drops in S3 become partitions and runs; outputs land in S3; S3 failures end runs with clear errors.

Everything talks HTTP to moto's standalone S3 server on 127.0.0.1 (no in-process patching): s3fs
and boto3 find it through `AWS_ENDPOINT_URL`, as they would find a real S3-compatible endpoint.
Throttling is injected by a small loopback proxy in front of the server that answers chosen
requests with S3's `503 SlowDown`.
"""

from __future__ import annotations

import http.client
import io
import json
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

import boto3
import dagster as dg
import polars as pl
import pytest

from batch_assets.lib.drops_sensor import build_drops_sensor
from batch_assets.lib.run_requests import REPLACED_TAG, SOURCE_FILE_TAG, requested_partitions
from batch_assets.lib.task_definitions import build_definitions, pipeline_job_name
from batch_assets.pipeline.inputs.read_prompts import DropFileError
from batch_assets.pipeline.task_spec import load_task_specs
from batch_assets.storage.drop_files import find_drop_file, list_drop_files, partition_key_for, partitions_def_name
from batch_assets.storage.errors import StorageError
from batch_assets_tests.support import free_port
from batch_assets_tests.support.s3 import BUCKET, DATA_URL, PREFIX, S3, SECRET, post, use_endpoint

# The slow tier (`make test-fast` leaves it out): an S3 server (moto) and the engine.
pytestmark = pytest.mark.slow

TASK = "sentiment"
SENSOR = f"{TASK}_drops_sensor"

POSTS_A = '{"text": "Loving the new update!"}\n{"text": "Worst support ever."}\n{"text": "Meeting at 3pm."}\n'
POSTS_B = '{"text": "Great coffee this morning"}\n{"text": "Train delayed again"}\n'
POSTS_C = '{"text": "New phone, who dis"}\n'
POSTS_D = '{"text": "Rainy day"}\n{"text": "Sunny day"}\n'


def sentiment_sensor(defs: dg.Definitions) -> dg.SensorDefinition:
    return next(sensor for sensor in defs.sensors if sensor.name == SENSOR)


def tick(
    sensor: dg.SensorDefinition, instance: dg.DagsterInstance, cursor: str | None
) -> tuple[dg.SensorResult, str | None]:
    """Evaluate one tick and apply its partition requests, as the daemon does."""
    result = sensor(dg.build_sensor_context(instance=instance, cursor=cursor, definitions=build_definitions()))
    for request in result.dynamic_partitions_requests or []:
        instance.add_dynamic_partitions(request.partitions_def_name, list(request.partition_keys))
    return result, result.cursor if result.cursor is not None else cursor


def execute(defs: dg.Definitions, instance: dg.DagsterInstance, request: dg.RunRequest):
    """Run what the sensor requested, with its partition (or range tags) and tags, as the daemon's run would."""
    job = defs.resolve_job_def(pipeline_job_name(TASK))
    return job.execute_in_process(
        instance=instance, partition_key=request.partition_key, tags=request.tags, raise_on_error=False
    )


def failure_text(result) -> str:
    return "\n".join(event.step_failure_data.error.to_string() for event in result.all_events if event.is_step_failure)


def materialized(instance: dg.DagsterInstance, asset: str) -> set[str]:
    return instance.get_materialized_partitions(dg.AssetKey([TASK, asset]))


def test_s3_drops_become_a_range_run_then_one_run_each_with_outputs_in_s3(s3: S3, tiny_model: str) -> None:
    s3.put("posts-a.jsonl", POSTS_A)
    s3.put("2026/11/posts b é.jsonl", POSTS_B)  # nested, with a space and unicode
    s3.put("posts-c.jsonl", POSTS_C)
    s3.put("upload.jsonl.part", POSTS_C)  # an upload tool's temporary name
    s3.put("README.md", "not an input")
    defs = build_definitions()
    sensor = sentiment_sensor(defs)
    with dg.instance_for_test() as instance:
        result, cursor = tick(sensor, instance, None)
        # Three new files in one tick: one run over the range of their partitions.
        [burst] = result.run_requests
        names = ["posts-a.jsonl", "2026/11/posts b é.jsonl", "posts-c.jsonl"]
        keys = requested_partitions(burst, instance.get_dynamic_partitions(partitions_def_name(TASK)))
        assert sorted(keys) == sorted(partition_key_for(name) for name in names)
        assert sorted(instance.get_dynamic_partitions(partitions_def_name(TASK))) == sorted(keys)
        assert REPLACED_TAG not in burst.tags
        run = execute(defs, instance, burst)
        assert run.success, failure_text(run)
        rows = {name: s3.read_output("validated_labels", partition_key_for(name)).height for name in names}
        assert rows == {"posts-a.jsonl": 3, "2026/11/posts b é.jsonl": 2, "posts-c.jsonl": 1}
        assert materialized(instance, "validated_labels") == set(keys)
        # One run made all three partitions.
        labels = dg.AssetRecordsFilter(asset_key=dg.AssetKey([TASK, "validated_labels"]), asset_partitions=keys)
        assert {record.run_id for record in instance.fetch_materializations(labels, limit=10).records} == {run.run_id}

        # Nothing changed: no run, and the tick says which files it skipped and why.
        again, cursor = tick(sensor, instance, cursor)
        assert not again.run_requests
        message = again.skip_reason.skip_message
        assert "upload.jsonl.part" in message and "README.md" in message and "unknown extension" in message

        # A restarted daemon loads the code anew and gets the stored cursor: still nothing to do.
        restarted, _ = tick(sentiment_sensor(build_definitions()), instance, cursor)
        assert not restarted.run_requests

        # A fourth file: exactly one more run.
        s3.put("posts-d.jsonl", POSTS_D)
        fourth, cursor = tick(sensor, instance, cursor)
        assert [request.tags[SOURCE_FILE_TAG] for request in fourth.run_requests] == ["posts-d.jsonl"]
        assert execute(defs, instance, fourth.run_requests[0]).success
        assert s3.read_output("validated_labels", fourth.run_requests[0].partition_key).height == 2

        # Replacing a file with new content re-runs that partition only, tagged as a replacement.
        key_a = partition_key_for("posts-a.jsonl")
        s3.put("posts-a.jsonl", POSTS_A + '{"text": "One more post"}\n')
        replaced, cursor = tick(sensor, instance, cursor)
        assert [request.partition_key for request in replaced.run_requests] == [key_a]
        request = replaced.run_requests[0]
        assert request.tags[REPLACED_TAG] == "true"
        assert request.run_key.startswith(f"{key_a}@")
        run = execute(defs, instance, request)
        assert run.success
        assert instance.get_run_by_id(run.run_id).tags[REPLACED_TAG] == "true"
        assert s3.read_output("validated_labels", key_a).height == 4

        # Uploading the same bytes again is no change at all (same ETag).
        s3.put("posts-a.jsonl", POSTS_A + '{"text": "One more post"}\n')
        assert not tick(sensor, instance, cursor)[0].run_requests


def put_many(count: int, relative: str) -> None:
    """Create many small objects fast, straight in the server's backend (the listing still goes over HTTP)."""
    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.s3.models import s3_backends

    backend = s3_backends[DEFAULT_ACCOUNT_ID]["aws"]
    for index in range(count):
        backend.put_object(BUCKET, f"{PREFIX}/drops/{TASK}/{relative.format(index=index)}", b'{"text": "x"}\n')


def test_tick_over_thousands_of_keys_pages_and_requests_each_file_once(s3: S3) -> None:
    put_many(2_490, "batch-{index:05d}/posts-{index:05d}.jsonl")
    put_many(10, ".staging/part-{index}.tmp")
    task = next(task for task in load_task_specs() if task.name == TASK)
    job = build_definitions().resolve_job_def(pipeline_job_name(TASK))
    files, skipped = list_drop_files(TASK)
    assert len(files) == 2_490 and len(skipped) == 10  # three pages of ListObjectsV2

    with dg.instance_for_test() as instance:
        # The shipped sensor requests at most 500 files a tick (in runs of up to 16); the rest wait.
        first, _ = tick(build_drops_sensor(task, job), instance, None)
        ordered = instance.get_dynamic_partitions(partitions_def_name(TASK))
        ranges = [requested_partitions(request, ordered) for request in first.run_requests]
        assert sum(len(keys) for keys in ranges) == 500
        assert len(ranges) == -(-500 // task.runs.max_partitions_per_run)

    with dg.instance_for_test() as instance:
        sensor = build_drops_sensor(task, job, max_runs_per_tick=None)
        result, cursor = tick(sensor, instance, None)
        ordered = instance.get_dynamic_partitions(partitions_def_name(TASK))
        keys = [key for request in result.run_requests for key in requested_partitions(request, ordered)]
        assert len(keys) == len(set(keys)) == 2_490
        assert len(instance.get_dynamic_partitions(partitions_def_name(TASK))) == 2_490
        # The cursor stays small: about 11 bytes per file.
        assert len(cursor) < 12 * 2_490

        quiet, cursor = tick(sensor, instance, cursor)
        assert not quiet.run_requests
        assert "2490 known" in quiet.skip_reason.skip_message

        s3.put("batch-late/posts.jsonl", POSTS_C)
        late, _ = tick(sensor, instance, cursor)
        assert [request.tags[SOURCE_FILE_TAG] for request in late.run_requests] == ["batch-late/posts.jsonl"]


def test_keys_with_empty_parts_are_read_under_the_name_they_are_listed_under(s3: S3) -> None:
    # `prefix//a.jsonl` (a prefix written with a trailing slash, then joined with one) and `a//b.jsonl`
    # are other objects than `a.jsonl` and `a/b.jsonl`: each its own partition, read as itself.
    contents = {
        "/lead.jsonl": '{"text": "double slash after the prefix"}\n',
        "lead.jsonl": '{"text": "plain"}\n',
        "a//b.jsonl": '{"text": "double slash inside"}\n',
        "a/b.jsonl": '{"text": "single slash inside"}\n',
    }
    for relative, body in contents.items():
        s3.put(relative, body)
    files, skipped = list_drop_files(TASK)
    assert sorted(drop.relative_path for drop in files) == sorted(contents)
    assert skipped == {}
    keys = {drop.relative_path: drop.partition_key for drop in files}
    assert len(set(keys.values())) == 4 and keys["lead.jsonl"] == "lead.jsonl"
    for relative, key in keys.items():
        drop = find_drop_file(TASK, key)
        assert (drop.relative_path, drop.read_bytes().decode()) == (relative, contents[relative])

    # Through Dagster: the partition of `//lead.jsonl` reads that object, not `lead.jsonl`.
    key = keys["/lead.jsonl"]
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions(partitions_def_name(TASK), [key])
        job = build_definitions().resolve_job_def(pipeline_job_name(TASK))
        result = job.execute_in_process(
            instance=instance, partition_key=key, asset_selection=[dg.AssetKey([TASK, "raw_prompts"])]
        )
        assert result.success
    assert s3.read_output("raw_prompts", key)["text"].to_list() == ["double slash after the prefix"]


def test_folder_markers_are_not_inputs_whatever_their_names(s3: S3) -> None:
    for marker in ("reports/", "reports.jsonl/", "reports.jsonl/inner/"):
        s3.put(marker, b"")
    s3.put("reports.jsonl/posts.jsonl", POSTS_C)
    files, skipped = list_drop_files(TASK)
    assert ([drop.relative_path for drop in files], skipped) == (["reports.jsonl/posts.jsonl"], {})


@pytest.mark.parametrize("relative", ["x/../escape.jsonl", "../../outside.jsonl", "./dot.jsonl", "a/./b.jsonl"])
def test_keys_with_dot_parts_are_skipped_as_unsafe_names(s3: S3, relative: str) -> None:
    s3.put(relative, POSTS_C)
    s3.put("ok.jsonl", POSTS_C)
    files, skipped = list_drop_files(TASK)
    assert [drop.relative_path for drop in files] == ["ok.jsonl"]
    assert list(skipped) == [relative] and skipped[relative].startswith("unsafe name: a '.' or '..' path part")
    with pytest.raises(DropFileError, match="unsafe name"):
        find_drop_file(TASK, partition_key_for(relative))


# --- failures -------------------------------------------------------------------------------------


def run_partition_expecting_failure(instance: dg.DagsterInstance, file_name: str = "posts.jsonl"):
    defs = build_definitions()
    instance.add_dynamic_partitions(partitions_def_name(TASK), [file_name])
    job = defs.resolve_job_def(pipeline_job_name(TASK))
    result = job.execute_in_process(instance=instance, partition_key=file_name, raise_on_error=False)
    assert not result.success
    return result


def all_log_text(instance: dg.DagsterInstance, run_id: str) -> str:
    """Every event of the run as stored (messages, errors, metadata)."""
    return "\n".join(dg.serialize_value(record) for record in instance.all_logs(run_id))


def test_endpoint_down_fails_the_tick_and_the_run_naming_url_and_cause(
    s3: S3, monkeypatch: pytest.MonkeyPatch, tiny_model: str
) -> None:
    s3.put("posts.jsonl", POSTS_A)
    down = f"http://127.0.0.1:{free_port()}"
    use_endpoint(monkeypatch, down)
    with dg.instance_for_test() as instance:
        with pytest.raises(StorageError) as tick_error:
            tick(sentiment_sensor(build_definitions()), instance, None)
        assert f"{DATA_URL}/drops/{TASK}" in str(tick_error.value)
        assert f"could not connect to the S3 endpoint {down}" in str(tick_error.value)

        result = run_partition_expecting_failure(instance)
        text = failure_text(result)
        assert f"{DATA_URL}/drops/{TASK}" in text and f"could not connect to the S3 endpoint {down}" in text
        assert not materialized(instance, "raw_prompts")
        assert SECRET not in all_log_text(instance, result.run_id)


class SilentServer:
    """A loopback TCP server that accepts every connection and never sends a byte."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0), backlog=128)
        self.endpoint = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.connections: list[socket.socket] = []
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self.listener.accept()
            except OSError:
                return
            self.connections.append(connection)

    def close(self) -> None:
        self.listener.close()
        for connection in self.connections:
            connection.close()


def test_silent_endpoint_fails_every_call_within_the_timeouts_naming_endpoint_and_setting(
    s3: S3, monkeypatch: pytest.MonkeyPatch, tiny_model: str
) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from batch_assets.storage.locations import storage_path, write_bytes_atomically

    s3.put("posts.jsonl", POSTS_A)
    silent = SilentServer()
    try:
        use_endpoint(monkeypatch, silent.endpoint)
        monkeypatch.setenv("BATCH_ASSETS_S3_CONNECT_TIMEOUT", "1")
        monkeypatch.setenv("BATCH_ASSETS_S3_READ_TIMEOUT", "1")
        monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
        expected = f"the S3 endpoint {silent.endpoint} accepted the connection but did not answer within 1 s"
        settings = "the wait is BATCH_ASSETS_S3_READ_TIMEOUT, the attempts AWS_MAX_ATTEMPTS"
        with dg.instance_for_test() as instance:
            with pytest.raises(StorageError) as tick_error:
                tick(sentiment_sensor(build_definitions()), instance, None)
            assert f"listing drop zone {DATA_URL}/drops/{TASK} failed: {expected}" in str(tick_error.value)
            assert settings in str(tick_error.value)

            text = failure_text(run_partition_expecting_failure(instance))
            assert f"{DATA_URL}/drops/{TASK}" in text and expected in text
            assert not materialized(instance, "raw_prompts")

        # A write waited for "100 Continue" with no timeout at all; it must end like any other call.
        target = storage_path(f"{DATA_URL}/storage/{TASK}/raw_prompts/posts.jsonl.parquet")
        with ThreadPoolExecutor(1) as pool:
            outcome = pool.submit(write_bytes_atomically, target, b"outputs")
            with pytest.raises(StorageError) as write_error:
                outcome.result(timeout=120)
        assert str(write_error.value).startswith(f"writing {target} failed: {expected}")
        assert silent.connections  # the calls did reach the silent server
    finally:
        silent.close()


def test_s3_timeouts_are_settings_with_clear_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    from batch_assets.storage.s3_settings import s3_storage_options

    monkeypatch.setenv("BATCH_ASSETS_S3_READ_TIMEOUT", "2.5")
    config = s3_storage_options()["config_kwargs"]
    assert (config["connect_timeout"], config["read_timeout"]) == (10.0, 2.5)
    monkeypatch.setenv("BATCH_ASSETS_S3_CONNECT_TIMEOUT", "soon")
    with pytest.raises(ValueError, match=r"BATCH_ASSETS_S3_CONNECT_TIMEOUT='soon': must be a number of seconds"):
        s3_storage_options()


def test_missing_bucket_fails_the_tick_and_the_run_naming_url_and_cause(
    s3: S3, monkeypatch: pytest.MonkeyPatch, tiny_model: str
) -> None:
    monkeypatch.setenv("BATCH_ASSETS_DATA", "s3://no-such-bucket/batch")
    with dg.instance_for_test() as instance:
        with pytest.raises(
            StorageError, match=r"s3://no-such-bucket/batch/drops/sentiment failed: the bucket does not exist"
        ):
            tick(sentiment_sensor(build_definitions()), instance, None)
        result = run_partition_expecting_failure(instance)
        text = failure_text(result)
        assert "s3://no-such-bucket/batch/drops/sentiment" in text and "NoSuchBucket" in text
        assert not materialized(instance, "raw_prompts")
    # Writing outputs never creates the bucket behind the user's back.
    assert "no-such-bucket" not in [bucket["Name"] for bucket in s3.client.list_buckets()["Buckets"]]


def test_access_denied_fails_the_run_naming_url_with_nothing_materialized(
    s3: S3, monkeypatch: pytest.MonkeyPatch, tiny_model: str
) -> None:
    s3.put("posts.jsonl", POSTS_A)
    iam = boto3.client("iam")
    iam.create_user(UserName="reader")
    read_only = {
        "Version": "2012-10-17",
        "Statement": [
            {
                "Effect": "Allow",
                "Action": ["s3:ListBucket", "s3:GetObject"],
                "Resource": [f"arn:aws:s3:::{BUCKET}", f"arn:aws:s3:::{BUCKET}/*"],
            }
        ],
    }
    iam.put_user_policy(UserName="reader", PolicyName="read-only", PolicyDocument=json.dumps(read_only))
    access_key = iam.create_access_key(UserName="reader")["AccessKey"]
    post(f"{s3.endpoint}/moto-api/reset-auth", b"0")  # from now on the server checks IAM
    use_endpoint(monkeypatch, s3.endpoint, access_key["AccessKeyId"], access_key["SecretAccessKey"])

    with dg.instance_for_test() as instance:
        # Reading is allowed: the sensor works.
        result, _ = tick(sentiment_sensor(build_definitions()), instance, None)
        assert len(result.run_requests) == 1
        # Writing is not: the run fails on its first output, which is not recorded.
        run = run_partition_expecting_failure(instance)
        text = failure_text(run)
        assert f"writing {DATA_URL}/storage/{TASK}/raw_prompts" in text
        assert "access denied (AccessDenied" in text
        assert not materialized(instance, "raw_prompts")
        assert access_key["SecretAccessKey"] not in all_log_text(instance, run.run_id)

    # Unknown credentials: the tick fails saying so, without echoing the secret.
    use_endpoint(monkeypatch, s3.endpoint, "AKIAUNKNOWNKEY000000", SECRET)
    with dg.instance_for_test() as instance:
        with pytest.raises(StorageError) as denied:
            tick(sentiment_sensor(build_definitions()), instance, None)
        assert "access denied (InvalidAccessKeyId" in str(denied.value)
        assert SECRET not in str(denied.value)


class ThrottlingProxy:
    """Loopback HTTP proxy in front of the S3 server: answers chosen requests with `503 SlowDown`."""

    def __init__(self, upstream: str) -> None:
        self.upstream = urlsplit(upstream)
        self.method = ""
        self.path_part = ""
        self.remaining: int | None = 0  # None: throttle every matching request
        self.throttled = 0
        self.lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _body(self) -> bytes:
                if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
                    chunks = []
                    while (size := int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)) > 0:
                        chunks.append(self.rfile.read(size))
                        self.rfile.readline()
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return b"".join(chunks)
                length = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(length) if length else b""

            def _handle(self) -> None:
                body = self._body()
                if proxy.should_throttle(self.command, self.path):
                    payload = (
                        b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
                        b"<Message>Please reduce your request rate.</Message><RequestId>proxy</RequestId></Error>"
                    )
                    self.send_response(503)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(payload)
                    return
                upstream = http.client.HTTPConnection(proxy.upstream.hostname, proxy.upstream.port, timeout=60)
                skip = {"transfer-encoding", "connection", "content-length"}
                headers = {name: value for name, value in self.headers.items() if name.lower() not in skip}
                upstream.request(self.command, self.path, body=body, headers=headers)
                response = upstream.getresponse()
                data = response.read()
                self.send_response_only(response.status)
                for name, value in response.getheaders():
                    if name.lower() not in skip or (name.lower() == "content-length" and self.command == "HEAD"):
                        self.send_header(name, value)
                if self.command != "HEAD":
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                upstream.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"

    def throttle(self, method: str, path_part: str, times: int | None) -> None:
        with self.lock:
            self.method, self.path_part, self.remaining, self.throttled = method, path_part, times, 0

    def should_throttle(self, method: str, path: str) -> bool:
        with self.lock:
            if method != self.method or self.path_part not in path or self.remaining == 0:
                return False
            if self.remaining is not None:
                self.remaining -= 1
            self.throttled += 1
            return True

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def throttling(s3: S3, monkeypatch: pytest.MonkeyPatch) -> Iterator[ThrottlingProxy]:
    proxy = ThrottlingProxy(s3.endpoint)
    use_endpoint(monkeypatch, proxy.endpoint)
    yield proxy
    proxy.close()


def test_throttled_writes_are_retried_and_the_run_succeeds(
    s3: S3, throttling: ThrottlingProxy, tiny_model: str
) -> None:
    s3.put("posts.jsonl", POSTS_A)
    throttling.throttle("PUT", f"/{PREFIX}/storage/", times=3)
    with dg.instance_for_test() as instance:
        defs = build_definitions()
        instance.add_dynamic_partitions(partitions_def_name(TASK), ["posts.jsonl"])
        job = defs.resolve_job_def(pipeline_job_name(TASK))
        result = job.execute_in_process(instance=instance, partition_key="posts.jsonl", raise_on_error=False)
        assert result.success, failure_text(result)
    assert throttling.throttled == 3
    assert s3.read_output("validated_labels", "posts.jsonl").height == 3


def test_persistent_throttling_fails_the_run_naming_url_with_nothing_materialized(
    s3: S3, throttling: ThrottlingProxy, tiny_model: str
) -> None:
    s3.put("posts.jsonl", POSTS_A)
    throttling.throttle("PUT", f"/{PREFIX}/storage/", times=None)
    with dg.instance_for_test() as instance:
        result = run_partition_expecting_failure(instance)
        text = failure_text(result)
        assert f"writing {DATA_URL}/storage/{TASK}/raw_prompts/posts.jsonl.parquet" in text
        assert "throttling" in text and "SlowDown" in text
        assert not materialized(instance, "raw_prompts")
    assert throttling.throttled > 2  # retried before giving up
    assert s3.keys("storage/") == []


@pytest.mark.parametrize("name", ["big.csv", "big.csv.gz", "big.parquet"])
def test_a_big_file_in_s3_is_split_and_each_shard_reads_its_own_rows_over_the_wire(s3: S3, name: str) -> None:
    """Issue 26.2 on S3: the planning pass streams the object, a shard reads its byte range (or row
    groups); rows match the whole file's."""
    import gzip

    from batch_assets.pipeline.inputs.read_prompts import ParseOptions, read_prompts
    from batch_assets.storage.shards import file_partition_keys, read_partition_rows

    frame = pl.DataFrame({"text": [f'post {n}, "quoted"\nsecond line' for n in range(2500)], "n": range(2500)})
    if name.endswith(".parquet"):
        sink = io.BytesIO()
        frame.write_parquet(sink, row_group_size=600)
        body = sink.getvalue()
    else:
        body = frame.write_csv().encode()
        body = gzip.compress(body) if name.endswith(".gz") else body
    s3.put(name, body)
    options = ParseOptions(text_fields=("text",))
    drop = find_drop_file(TASK, name)
    keys = file_partition_keys(TASK, drop, 1000)
    # Parquet splits between row groups of 600 (600, 600, 600, 700); text files every 1,000 records.
    shards = 4 if name.endswith(".parquet") else 3
    assert keys == [f"{name}~{index:05d}" for index in range(1, shards + 1)]
    assert s3.keys(f"storage/{TASK}/_shards/") == [f"{PREFIX}/storage/{TASK}/_shards/{name}.json"]
    rows = pl.concat([read_partition_rows(TASK, drop, key, options, 1000) for key in keys])
    whole = read_prompts(body, name, options)
    assert rows.equals(whole) and rows.height == 2500
    assert rows["row_id"][1000] == 1000 and rows["text"][2499] == 'post 2499, "quoted"\nsecond line'


def test_an_s3_object_replaced_since_it_was_listed_is_not_read_as_the_listed_version(s3: S3) -> None:
    """Before, only a local file was checked on opening: a shard of an S3 file replaced between the
    listing and the read read the new bytes at the old version's offsets, tagged as the old version."""
    s3.put("posts.jsonl", b'{"text": "version one"}\n')
    listed = find_drop_file(TASK, "posts.jsonl")
    s3.put("posts.jsonl", b'{"text": "version two, longer"}\n')
    with pytest.raises(DropFileError, match="replaced since it was listed"), listed.open():
        pass
    with find_drop_file(TASK, "posts.jsonl").open() as current:
        assert current.read() == b'{"text": "version two, longer"}\n'
