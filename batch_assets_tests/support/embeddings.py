"""Embedding tasks in tests: the shipped tasks, texts that test an embedding model's edges, one run of a
task's job, its outputs and metadata, and cosines (test_embedding_engine, test_endpoint_embeddings)."""

from __future__ import annotations

import json
from pathlib import Path

import dagster as dg
import numpy as np
import polars as pl

from batch_assets.lib.task_definitions import build_definitions, pipeline_job_name
from batch_assets.pipeline.task_spec import TaskSpec, load_task_specs
from batch_assets.storage.drop_files import partition_key_for, partitions_def_name

TASKS = {task.name: task for task in load_task_specs()}


TEXTS = [
    "The harbor ferry leaves every hour from pier 3.",
    "Ferries depart hourly from the third pier.",
    "Our bakery sells sourdough and rye bread.",
    "My router drops the connection every evening.",
    "Quarterly revenue grew 12 percent.",
    "Ünïcödé text, emoji 🙂 and <b>markup</b> [SEP] stay text.",
    "a",
    "word " * 300,
]


def run(task: TaskSpec, file_name: str, instance: dg.DagsterInstance):
    key = partition_key_for(file_name)
    instance.add_dynamic_partitions(partitions_def_name(task.name), [key])
    job = build_definitions(tasks=[task]).resolve_job_def(pipeline_job_name(task.name))
    return job.execute_in_process(instance=instance, partition_key=key, raise_on_error=False)


def metadata_of(result, node: str) -> dict:
    return {k: v.value for k, v in result.asset_materializations_for_node(node)[0].metadata.items()}


def read(data: Path, task: str, asset: str, file_name: str) -> pl.DataFrame:
    return pl.read_parquet(data / "storage" / task / asset / f"{partition_key_for(file_name)}.parquet")


def jsonl(texts: list[str]) -> str:
    return "".join(json.dumps({"text": text}) + "\n" for text in texts)


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
