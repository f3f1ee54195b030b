"""S3 on loopback: moto's standalone server and the standard AWS variables that point s3fs and boto3 at it.

`moto_endpoint` (a server per test module) and `s3` (an empty bucket per test) are fixtures of the
conftest plugin list (`pytest_plugins` in conftest.py): a test names them, imports nothing.
"""

from __future__ import annotations

import io
import logging
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import boto3
import polars as pl
import pytest
import s3fs
from moto.server import ThreadedMotoServer

SECRET = "wJalrXUtnFEMI-K7MDENG-bPxRfiCYEXAMPLEKEY"
# The bucket and prefix of the `s3` fixture: BATCH_ASSETS_DATA is DATA_URL.
BUCKET = "batch-bucket"
PREFIX = "team/batch"
DATA_URL = f"s3://{BUCKET}/{PREFIX}"
TASK = "sentiment"


@pytest.fixture(scope="module")
def moto_endpoint() -> Iterator[str]:
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


def use_endpoint(
    monkeypatch: pytest.MonkeyPatch, endpoint: str, key: str = "AKIAIOSFODNN7EXAMPLE", secret: str = SECRET
) -> None:
    """Point s3fs and boto3 at `endpoint` through the standard AWS variables only."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    # fsspec caches one filesystem per set of options; the credentials changed under it.
    s3fs.S3FileSystem.clear_instance_cache()


def post(url: str, data: bytes = b"") -> None:
    request = urllib.request.Request(url, data=data, method="POST", headers={"Content-Type": "text/plain"})
    urllib.request.urlopen(request, timeout=30).read()


@dataclass
class S3:
    endpoint: str
    client: object

    def put(self, relative: str, body: str | bytes, task: str = TASK) -> None:
        data = body.encode("utf-8") if isinstance(body, str) else body
        self.client.put_object(Bucket=BUCKET, Key=f"{PREFIX}/drops/{task}/{relative}", Body=data)

    def keys(self, under: str) -> list[str]:
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=f"{PREFIX}/{under}")
        return [item["Key"] for page in pages for item in page.get("Contents", [])]

    def read_output(self, asset: str, partition_key: str, task: str = TASK) -> pl.DataFrame:
        body = self.client.get_object(Bucket=BUCKET, Key=f"{PREFIX}/storage/{task}/{asset}/{partition_key}.parquet")[
            "Body"
        ]
        return pl.read_parquet(io.BytesIO(body.read()))


@pytest.fixture
def s3(moto_endpoint: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[S3]:
    """An empty moto server with one bucket; BATCH_ASSETS_DATA points into it. DAGSTER_HOME is the
    test's own: with outputs in S3 the result cache lives there (`dg.instance_for_test` sets its own
    while it is open; this one is for what runs outside it), not in the one `make test` exports."""
    post(f"{moto_endpoint}/moto-api/reset")
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3", "AWS_RETRY_MODE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    # Two attempts per request keep the failure tests short; retries are still exercised.
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")
    monkeypatch.setenv("BATCH_ASSETS_DATA", DATA_URL)
    home = tmp_path / "dagster_home"
    home.mkdir()
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    use_endpoint(monkeypatch, moto_endpoint)
    client = boto3.client("s3")
    client.create_bucket(Bucket=BUCKET)
    yield S3(moto_endpoint, client)
    post(f"{moto_endpoint}/moto-api/reset-auth", b"inf")
    s3fs.S3FileSystem.clear_instance_cache()
