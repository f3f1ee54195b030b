"""The shared engine host: runs in separate processes start the engine once, get the same labels as
the in-process engine, and the host stops by itself when nobody uses it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import dagster as dg
import polars as pl
import pytest

from batch_assets.engines import engine_host
from batch_assets.engines.vllm_engine import VLLMEngine
from batch_assets.pipeline.task_spec import load_task_specs
from batch_assets_tests.conftest import drop

SENTIMENT = next(task for task in load_task_specs() if task.name == "sentiment")


@pytest.fixture
def host_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    folder = tmp_path / "engine_host"
    monkeypatch.setenv(engine_host.STATE_DIR_ENV, str(folder))
    yield folder
    engine_host.stop_host()


def posts(n: int, tag: str) -> str:
    return "".join(json.dumps({"id": i, "text": f"{tag} {i}: the parcel arrived {i % 4} days late"}) + "\n" for i in range(n))


def cli_run(files: list[Path], share: bool) -> None:
    env = {**os.environ, "BATCH_ASSETS_SHARE_ENGINE": "1" if share else "0"}
    result = subprocess.run(
        [sys.executable, "-m", "batch_assets.cli", "run", "sentiment", *map(str, files)], env=env, capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def inference_metadata(partition_key: str) -> dict:
    with dg.DagsterInstance.get() as instance:
        records = instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=dg.AssetKey(["sentiment", "inference_outputs"]), asset_partitions=[partition_key]), limit=1
        ).records
        return {key: value.value for key, value in records[0].asset_materialization.metadata.items()}


def labels(data: Path, partition_key: str) -> pl.DataFrame:
    return pl.read_parquet(data / "storage" / "sentiment" / "validated_labels" / f"{partition_key}.parquet")


def test_runs_in_separate_processes_share_one_engine_and_get_the_in_process_labels(data_dir: Path, tiny_model: str, host_dir: Path) -> None:
    files = [drop(data_dir, "sentiment", f"part-{i}.jsonl", posts(30, f"p{i}")) for i in range(2)]
    for file in files:  # one process per run, as Dagster's run launcher does
        cli_run([file], share=True)
    first, second = (inference_metadata(f"part-{i}.jsonl") for i in range(2))
    assert first["engine_started_by_this_run"] is True and second["engine_started_by_this_run"] is False
    assert first["engine_host"]["pid"] == second["engine_host"]["pid"] and second["engine_start_seconds"] < 5
    shared = [labels(data_dir, f"part-{i}.jsonl") for i in range(2)]

    # The same files through the in-process engine, inferred again (the result cache removed).
    subprocess.run(["rm", "-rf", str(data_dir / "storage" / "sentiment" / "_result_cache")], check=True)
    cli_run(files, share=False)
    assert inference_metadata("part-0.jsonl")["rows_from_cache"] == 0
    for i, frame in enumerate(shared):
        in_process = labels(data_dir, f"part-{i}.jsonl")
        assert frame["generated_text"].to_list() == in_process["generated_text"].to_list()
        assert frame["num_prompt_tokens"].to_list() == in_process["num_prompt_tokens"].to_list()
        assert frame["error"].null_count() == frame.height


def test_an_unused_host_stops_by_itself(tiny_model: str, host_dir: Path) -> None:
    settings = VLLMEngine().settings_for(SENTIMENT)
    lease = engine_host.acquire(settings, idle_shutdown_s=3, start_timeout_s=600, log=lambda message: None)
    pid = lease.info.supervisor_pid
    time.sleep(6)
    assert engine_host._alive(pid), "the host stopped while a live run held its lease"
    lease.release()
    deadline = time.monotonic() + 90
    while engine_host._alive(pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not engine_host._alive(pid) and not (host_dir / "host.json").exists()
