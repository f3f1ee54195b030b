"""kill -9 in the middle of inference, then re-run: every record once, finished work reused.

A real `batch-assets run` child process (its own process group, with vLLM's engine processes)
is killed with SIGKILL once a checkpoint chunk of the 1,000-row partition exists: its main process
alone for the labelling task (what the out-of-memory killer does), its whole group for the embedding
task. The re-run (the command line's `main` in the test's process) then materializes only the
partitions Dagster does not have yet ("backfill failed and missing"), and the 1,000-row partition
resumes from its checkpoints.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import dagster as dg
import polars as pl
import psutil
import pytest

from batch_assets_tests.support import REPO_ROOT
from batch_assets_tests.support.processes import VENV_CLI as CLI
from batch_assets_tests.support.processes import wait_group_gone, wait_while_running

# The slow tier (`make test-fast` leaves it out): kills a run mid-inference on the engine and runs it again.
pytestmark = pytest.mark.slow

SHIPPED_TASKS = REPO_ROOT / "batch_assets" / "tasks"
# The rows of the file killed mid-run: the first checkpoint chunk (100 rows, `small_batch_tasks`) is
# seen within 0.05 s and killed at once, with some 900 rows (seconds of the engine's work) still to
# go; a bigger file only makes the re-run longer.
BIG = 1000


def small_batch_tasks(folder: Path, batch_size: int, task: str = "sentiment") -> Path:
    """A shipped task with a small engine batch, so checkpoint chunks appear quickly."""
    folder.mkdir(parents=True, exist_ok=True)
    text = (SHIPPED_TASKS / f"{task}.yaml").read_text()
    assert "\nengine:\n" in text
    (folder / f"{task}.yaml").write_text(text.replace("\nengine:\n", f"\nengine:\n  batch_size: {batch_size}\n"))
    return folder


def write_posts(path: Path, n: int, tag: str) -> Path:
    with path.open("w") as handle:
        for i in range(n):
            handle.write(
                json.dumps({"id": f"{tag}-{i}", "text": f"{tag} post {i}: the delivery took {i % 9} days"}) + "\n"
            )
    return path


def chunks_of(data: Path, partition: str, task: str = "sentiment") -> list[Path]:
    return sorted((data / "storage" / task / "_checkpoints" / partition).glob("*/chunk-*.parquet"))


@pytest.fixture
def child_env(data_dir: Path, tiny_model: str, tmp_path: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["BATCH_ASSETS_TASKS_DIR"] = str(small_batch_tasks(tmp_path / "tasks", batch_size=100))
    return env


def run_cli(env: dict[str, str], cwd: Path, *files: str, log: Path, task: str = "sentiment") -> subprocess.Popen:
    with log.open("ab") as out:
        return subprocess.Popen(
            [str(CLI), "run", task, *files],
            cwd=cwd,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def rerun_in_process(
    cwd: Path, env: dict[str, str], files: list[str], capfd: pytest.CaptureFixture[str], task: str = "sentiment"
) -> tuple[int, str]:
    """The re-run after the kill, through the command line's `main` in this process: what it
    checks is what the re-run does with the killed run's leftovers, not its process, and the
    worker's warm engine spares it an engine start."""
    from batch_assets import cli

    with pytest.MonkeyPatch.context() as scoped:
        scoped.chdir(cwd)
        scoped.setenv("BATCH_ASSETS_TASKS_DIR", env["BATCH_ASSETS_TASKS_DIR"])
        capfd.readouterr()
        code = cli.main(["run", task, *files])
        return code, capfd.readouterr().out


def test_kill_9_mid_inference_then_rerun_gives_each_row_once_and_reuses_checkpoints(
    data_dir: Path, child_env: dict[str, str], tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    write_posts(inputs / "a.jsonl", 200, "a")
    write_posts(inputs / "b.jsonl", BIG, "b")
    write_posts(inputs / "c.jsonl", 200, "c")
    log = tmp_path / "cli.log"

    # 1. One command, one range run over a, b and c (one engine stream), killed with SIGKILL once b has
    #    checkpoints: the main process alone, as the out-of-memory killer does. vLLM's engine core would
    #    outlive it, holding its memory (or GPU); the engine's watcher kills it. (A SIGKILL to the whole
    #    group is the embedding test's.)
    child = run_cli(child_env, inputs, "a.jsonl", "b.jsonl", "c.jsonl", log=log)
    wait_while_running(child, log, lambda: chunks_of(data_dir, "b.jsonl"))
    main = psutil.Process(child.pid)
    engine = [
        p for p in main.children(recursive=True) if "EngineCore" in " ".join(p.cmdline()) or "EngineCore" in p.name()
    ]
    assert engine, [p.cmdline() for p in main.children(recursive=True)]
    os.kill(child.pid, signal.SIGKILL)
    child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL
    gone, alive = psutil.wait_procs(engine, timeout=30)
    assert not alive, f"engine processes outlived their run: {[p.pid for p in alive]}"
    # Nothing of the run is left: the watcher exits once its work is done.
    wait_group_gone(child.pid)

    # The range run had not finished: no partition is materialized, but the finished requests of
    # every partition are checkpointed.
    outputs = data_dir / "storage" / "sentiment" / "validated_labels"
    assert not any((outputs / f"{name}.jsonl.parquet").exists() for name in "abc")
    checkpointed = sum(pl.read_parquet(chunk).height for chunk in chunks_of(data_dir, "b.jsonl"))
    assert 0 < checkpointed < BIG

    # 2. Re-run what Dagster does not have (the "failed and missing" partitions of a backfill).
    instance = dg.DagsterInstance.get()
    labels_key = dg.AssetKey(["sentiment", "validated_labels"])
    assert instance.get_materialized_partitions(labels_key) == set()
    missing = sorted({"a.jsonl", "b.jsonl", "c.jsonl"} - instance.get_materialized_partitions(labels_key))
    assert missing == ["a.jsonl", "b.jsonl", "c.jsonl"]
    code, output = rerun_in_process(inputs, child_env, missing, capfd)
    assert code == 0, output[-5000:]

    # 3. Every record exactly once, in input order; b resumed from its checkpoints; a not redone.
    b = pl.read_parquet(outputs / "b.jsonl.parquet")
    assert b.height == BIG
    assert b["row_id"].to_list() == list(range(BIG))
    assert b["id"].to_list() == [f"b-{i}" for i in range(BIG)]
    assert b["label"].null_count() == 0 and b["error"].null_count() == BIG
    assert pl.read_parquet(outputs / "c.jsonl.parquet").height == 200
    assert pl.read_parquet(outputs / "a.jsonl.parquet")["id"].to_list() == [f"a-{i}" for i in range(200)]
    assert (
        len(
            instance.fetch_materializations(
                dg.AssetRecordsFilter(asset_key=labels_key, asset_partitions=["a.jsonl"]), limit=10
            ).records
        )
        == 1
    )

    record = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=dg.AssetKey(["sentiment", "inference_outputs"]), asset_partitions=["b.jsonl"]),
        limit=1,
    ).records[0]
    metadata = record.asset_materialization.metadata
    reused, inferred = metadata["rows_from_checkpoint"].value, metadata["rows_inferred"].value
    assert reused >= checkpointed > 0
    assert reused + inferred == BIG
    # The run the kill left STARTED (holding the `gpu` pool slot) was closed by the re-run.
    assert not instance.get_runs(filters=dg.RunsFilter(statuses=[dg.DagsterRunStatus.STARTED]))
    assert "died" in output
    # The checkpoints of finished partitions are gone.
    for name in ("a.jsonl", "b.jsonl", "c.jsonl"):
        assert not (data_dir / "storage" / "sentiment" / "_checkpoints" / name).exists()


def test_kill_9_mid_embedding_then_rerun_embeds_each_row_once_and_reuses_checkpointed_vectors(
    data_dir: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """The same for an embedding task: the vectors checkpointed before the kill are the ones in the
    result table after the re-run, which embeds only the rest."""
    from batch_assets.pipeline.result_stores import encode_vector

    env = {**os.environ, "BATCH_ASSETS_TASKS_DIR": str(small_batch_tasks(tmp_path / "tasks", 100, "embeddings"))}
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    write_posts(inputs / "texts.jsonl", BIG, "t")
    log = tmp_path / "cli.log"
    child = run_cli(env, inputs, "texts.jsonl", log=log, task="embeddings")
    wait_while_running(child, log, lambda: chunks_of(data_dir, "texts.jsonl", "embeddings"))
    os.killpg(child.pid, signal.SIGKILL)
    child.wait(timeout=30)
    wait_group_gone(child.pid)
    checkpointed = pl.concat([pl.read_parquet(c) for c in chunks_of(data_dir, "texts.jsonl", "embeddings")])
    assert 0 < checkpointed.height < BIG
    assert checkpointed["error"].null_count() == checkpointed.height

    code, output = rerun_in_process(inputs, env, ["texts.jsonl"], capfd, task="embeddings")
    assert code == 0, output[-5000:]

    labels = pl.read_parquet(data_dir / "storage" / "embeddings" / "validated_labels" / "texts.jsonl.parquet")
    assert labels["row_id"].to_list() == list(range(BIG))
    assert labels["id"].to_list() == [f"t-{i}" for i in range(BIG)]
    assert labels["error"].null_count() == BIG
    assert labels.schema["embedding"] == pl.Array(pl.Float32, 384)
    # Every checkpointed vector is in the result table as it was saved (the texts are distinct, so
    # their vectors are too).
    table_vectors = {encode_vector(vector) for vector in labels["embedding"].to_numpy()}
    assert len(table_vectors) == BIG
    assert set(checkpointed["generated_text"].to_list()) <= table_vectors
    instance = dg.DagsterInstance.get()
    record = instance.fetch_materializations(
        dg.AssetRecordsFilter(
            asset_key=dg.AssetKey(["embeddings", "inference_outputs"]), asset_partitions=["texts.jsonl"]
        ),
        limit=1,
    ).records[0]
    metadata = record.asset_materialization.metadata
    reused, inferred = metadata["rows_from_checkpoint"].value, metadata["rows_inferred"].value
    assert reused >= checkpointed.height
    assert reused + inferred == BIG
    assert not (data_dir / "storage" / "embeddings" / "_checkpoints" / "texts.jsonl").exists()
