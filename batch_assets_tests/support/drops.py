"""Drop files in tests: a file that looks fully copied in, one tick of a drops sensor, and a JSON-lines
file with bad lines among good ones (test_drops_sensor, test_big_file_tick, test_file_shards, …)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import dagster as dg

from batch_assets.lib.task_definitions import build_definitions
from batch_assets.pipeline.inputs.read_prompts import ParseOptions


def settled(path: Path, age: float = 60.0) -> Path:
    """Make a file look fully copied in (unchanged for `age` seconds)."""
    stamp = time.time() - age
    os.utime(path, (stamp, stamp))
    return path


def tick(sensor: dg.SensorDefinition, instance: dg.DagsterInstance, cursor: str | None):
    result = sensor(dg.build_sensor_context(instance=instance, cursor=cursor, definitions=build_definitions()))
    for request in result.dynamic_partitions_requests or []:
        if isinstance(request, dg.DeleteDynamicPartitionsRequest):
            for key in request.partition_keys:
                instance.delete_dynamic_partition(request.partitions_def_name, key)
        else:
            instance.add_dynamic_partitions(request.partitions_def_name, list(request.partition_keys))
    return result, result.cursor if result.cursor is not None else cursor


OPTIONS = ParseOptions(text_fields=("text",))


def jsonl_with_bad_lines(rows: int) -> bytes:
    lines = [json.dumps({"text": f"row {n}", "n": n}) for n in range(rows)]
    lines[4] = "{not json"
    lines[7] = ""
    return ("\n".join(lines) + "\n").encode()
