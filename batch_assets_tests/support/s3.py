"""S3 on loopback: moto's standalone server and the standard AWS variables that point s3fs and boto3 at it.

`moto_endpoint` is a module fixture: a test module that uses it imports it by name, and gets a server of
its own, as it did when the fixture was defined in that module.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import s3fs
from moto.server import ThreadedMotoServer

SECRET = "wJalrXUtnFEMI-K7MDENG-bPxRfiCYEXAMPLEKEY"


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
