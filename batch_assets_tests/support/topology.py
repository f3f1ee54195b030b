"""The container topologies' S3 side (deploy/docker/topology.py; deploy/ray/ray_topology.py builds on
it): a client of its moto server, a drop of posts into the sentiment drop zone, the labels read back."""

from __future__ import annotations

import json
from pathlib import Path

import boto3
import polars as pl

from batch_assets_tests.support import REPO_ROOT, load_script

TOPOLOGY = load_script(REPO_ROOT / "deploy" / "docker" / "topology.py")


def s3(settings) -> boto3.client:
    return boto3.client(
        "s3",
        endpoint_url=f"http://127.0.0.1:{settings.s3_port}",
        aws_access_key_id=TOPOLOGY.AWS["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=TOPOLOGY.AWS["AWS_SECRET_ACCESS_KEY"],
        region_name=TOPOLOGY.AWS["AWS_REGION"],
    )


def drop_posts(client, folder: Path, name: str, texts: list[str]) -> None:
    """A JSONL file of posts (`post_id` <name's stem><i>) into the sentiment drop zone on S3."""
    stem = name.split(".")[0]
    drop = folder / name
    drop.write_text("".join(json.dumps({"post_id": f"{stem}{i}", "text": t}) + "\n" for i, t in enumerate(texts)))
    client.upload_file(str(drop), TOPOLOGY.BUCKET, f"data/drops/sentiment/{name}")


def labels_in_s3(client, partition: str) -> pl.DataFrame:
    key = f"data/storage/sentiment/validated_labels/{partition}.parquet"
    return pl.read_parquet(client.get_object(Bucket=TOPOLOGY.BUCKET, Key=key)["Body"].read())
