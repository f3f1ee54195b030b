"""Issue 35: what a hostile pass found. A crafted partition key must not read, write or delete
outside the data folder; a file replaced while its shards run must not leave a glob of mixed
versions; Ctrl-C and SIGTERM stop a run as "stopped" (130) without a retry and a second engine."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import textwrap
import threading
from pathlib import Path

import dagster as dg
import polars as pl
import pytest

from batch_assets.app.runner import RunReporter, run_partitions
from batch_assets.runtime.instance import open_instance
from batch_assets.storage.drop_files import (
    InvalidPartitionKey,
    checked_partition_key,
    find_drop_file,
    partition_key_for,
    partition_key_problem,
    version_digest,
)
from batch_assets.storage.locations import checkpoint_dir, output_path
from batch_assets.storage.shards import (
    SHARD_VERSIONS_TAG,
    delete_partition_outputs,
    file_partition_keys,
    outdated_shards,
    read_partition_rows,
)
from batch_assets_tests.support import CLI, REPO_ROOT, drop, python_env
from batch_assets_tests.support import open_instance as home_instance
from batch_assets_tests.support.drops import OPTIONS, jsonl_with_bad_lines

TASK = "sentiment"
CRAFTED = "small.jsonl~/../../../../elsewhere/victim"


@pytest.mark.parametrize(
    "key",
    ["posts.jsonl", "posts_1.jsonl-0a1b2c3d", "posts.jsonl~00001", "big.csv~123456", "a..b.csv", "x" * 150],
)
def test_keys_the_package_makes_are_accepted(key: str) -> None:
    assert partition_key_problem(key) is None and checked_partition_key(key) == key


@pytest.mark.parametrize(
    "key",
    [
        CRAFTED,
        "../victim",
        "..",
        ".",
        "",
        "a/b.jsonl",
        "a\\b.jsonl",
        "x.jsonl~1",  # not the 5-digit form shard_key writes
        "x.jsonl~00000",
        "x.jsonl~0000a",
        "x.jsonl~00001~00002",
        "x.jsonl~" + "1" * 5000,  # a number too long for int(): refused, not an exception
        "a...jsonl",
        "x" * 151,
        "posts.jsonl\x00",
    ],
)
def test_any_other_key_is_refused_before_a_path_is_made(key: str) -> None:
    assert partition_key_problem(key) is not None
    with pytest.raises(InvalidPartitionKey, match="added by hand"):
        checked_partition_key(key)
    if "/" in key or key in ("", ".", "..") or "\\" in key or "\x00" in key:
        with pytest.raises(ValueError, match="not a name inside a folder"):
            output_path(TASK, "raw_prompts", key)
        with pytest.raises(ValueError, match="not a name inside a folder"):
            checkpoint_dir(TASK, key)


def test_every_key_partition_key_for_makes_is_accepted() -> None:
    names = ["posts.jsonl", "posts 1.jsonl", "2026/11/posts.jsonl", "a" * 300 + ".csv", "Ünïcode.csv", "x...y.txt"]
    for name in names:
        assert partition_key_problem(partition_key_for(name)) is None, name


def test_retiring_a_crafted_key_deletes_nothing(data_dir: Path, tmp_path: Path) -> None:
    victim = tmp_path / "elsewhere" / "victim"
    victim.mkdir(parents=True)
    (victim / "precious.txt").write_text("keep me")
    (data_dir / "storage" / TASK / "_checkpoints").mkdir(parents=True)
    delete_partition_outputs(TASK, [CRAFTED, "small.jsonl~/../../../../elsewhere"])
    assert (victim / "precious.txt").read_text() == "keep me"


@pytest.mark.slow
def test_a_run_of_a_crafted_key_fails_naming_it_and_touches_nothing_outside(data_dir: Path, tmp_path: Path) -> None:
    """Before: the run wrote elsewhere/victim.parquet outside the data folder and `validated_labels`'
    checkpoint clean-up removed the folder elsewhere/victim."""
    from batch_assets.lib.task_definitions import build_definitions, pipeline_job_name

    victim = tmp_path / "elsewhere" / "victim"
    victim.mkdir(parents=True)
    (victim / "precious.txt").write_text("keep me")
    drop(data_dir, TASK, "small.jsonl", '{"text": "fine"}\n')
    # The crafted key climbs from <data>/storage/sentiment/<asset>/ to tmp_path.
    key = "small.jsonl~/../../../../elsewhere/victim"
    job = build_definitions().resolve_job_def(pipeline_job_name(TASK))
    with open_instance() as instance:
        instance.add_dynamic_partitions(f"{TASK}_drops", [key])
        whole = job.execute_in_process(instance=instance, partition_key=key, raise_on_error=False)
        labels_only = job.execute_in_process(
            instance=instance,
            partition_key=key,
            raise_on_error=False,
            asset_selection=[dg.AssetKey([TASK, "validated_labels"])],
        )
    assert not whole.success and not labels_only.success
    failures = [event for event in whole.all_events if event.is_step_failure]
    assert "is not a shard's key" in failures[0].step_failure_data.error.to_string()
    assert (victim / "precious.txt").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.joinpath("elsewhere").iterdir()) == ["victim"]
    assert list(victim.iterdir()) == [victim / "precious.txt"]


def test_a_shard_never_splits_its_file_again(data_dir: Path) -> None:
    """Before: a shard run after the file was replaced split the new version and read it, beside
    siblings that had read the old one."""
    path = drop(data_dir, TASK, "posts.jsonl", jsonl_with_bad_lines(11))
    file_partition_keys(TASK, find_drop_file(TASK, "posts.jsonl"), 3)
    path.write_bytes(jsonl_with_bad_lines(12))
    os.utime(path, (1_900_000_000, 1_900_000_000))
    replaced = find_drop_file(TASK, "posts.jsonl")
    with pytest.raises(Exception, match="replaced .*since it was split into shards"):
        read_partition_rows(TASK, replaced, "posts.jsonl~00003", OPTIONS, 3)
    plan = json.loads((data_dir / "storage" / TASK / "_shards" / "posts.jsonl.json").read_text())
    assert plan["version"] != replaced.version  # not split again by reading


def test_a_new_version_removes_every_output_of_the_old_split(data_dir: Path) -> None:
    path = drop(data_dir, TASK, "posts.jsonl", jsonl_with_bad_lines(11))
    first = find_drop_file(TASK, "posts.jsonl")
    old_keys = file_partition_keys(TASK, first, 3)
    assert len(old_keys) == 4
    stored = [output_path(TASK, asset, key) for key in old_keys for asset in ("raw_prompts", "validated_labels")]
    for output in stored:
        Path(output.path).parent.mkdir(parents=True, exist_ok=True)
        Path(output.path).write_bytes(b"v1")
    pinned = {SHARD_VERSIONS_TAG: json.dumps({key: version_digest(first.version) for key in old_keys})}
    assert outdated_shards(TASK, old_keys, pinned) == []

    path.write_bytes(jsonl_with_bad_lines(12))
    os.utime(path, (1_900_000_000, 1_900_000_000))
    new_keys = file_partition_keys(TASK, find_drop_file(TASK, "posts.jsonl"), 3)
    assert new_keys == old_keys  # the same four keys: without the clean-up the glob mixed versions
    assert [Path(output.path).exists() for output in stored] == [False] * len(stored)
    # A run of the old version still going learns it must not store its outputs.
    assert outdated_shards(TASK, old_keys, pinned) == old_keys


def _tasks_with_shards(tmp_path: Path, max_rows: int) -> Path:
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    bundled = (REPO_ROOT / "batch_assets" / "tasks" / f"{TASK}.yaml").read_text()
    (tasks / f"{TASK}.yaml").write_text(
        bundled.replace("input:\n", f"input:\n  max_rows_per_partition: {max_rows}\n", 1)
    )
    return tasks


def _posts(rows: int, version: str) -> str:
    return "".join(json.dumps({"text": f"{version} post {n}"}) + "\n" for n in range(rows))


@pytest.mark.slow
def test_a_file_replaced_while_its_shards_run_ends_labelled_at_the_new_version(
    data_dir: Path, tiny_model: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: shards 1-2 held version 1, shard 3 ran on version 2, shard 4 failed and nothing ran
    the new version's shards; the glob gave 120 rows mixing both, unmarked."""
    monkeypatch.setenv("BATCH_ASSETS_TASKS_DIR", str(_tasks_with_shards(tmp_path, 50)))
    source = tmp_path / "big.jsonl"
    source.write_text(_posts(200, "v1"))
    zone_file = data_dir / "drops" / TASK / "big.jsonl"
    notes: list[str] = []

    class ReplaceDuringShardTwo(logging.Handler):
        def __init__(self, label: str) -> None:
            super().__init__()
            self.label = label

        def emit(self, record) -> None:
            shard_two_infers = self.label.endswith("~00002") and "requests to infer" in record.getMessage()
            if shard_two_infers and zone_file.read_text().startswith('{"text": "v1'):
                zone_file.write_text(_posts(120, "v2"))
                os.utime(zone_file, (1_900_000_000, 1_900_000_000))

    reporter = RunReporter(say=notes.append, run_log_handler=ReplaceDuringShardTwo)
    [outcome] = run_partitions(TASK, [source], reporter=reporter)
    assert outcome.ok, outcome.line()
    assert any("replaced in the drop zone while it ran; running its new version" in note for note in notes), notes
    labels = pl.read_parquet(str(data_dir / "storage" / TASK / "validated_labels" / "big.jsonl~*.parquet"))
    labels = labels.sort("row_id")
    assert labels["row_id"].to_list() == list(range(120))
    assert labels["text"].to_list() == [f"v2 post {n}" for n in range(120)]
    assert outcome.rows == 120


@pytest.mark.slow
def test_ctrl_c_during_inference_stops_without_a_retry_or_a_second_engine(workdir) -> None:
    """Before: the engine process died of the Ctrl-C, the step's retry policy started a fresh engine,
    the run finished and the command exited 0."""
    tmp_path, env = workdir
    posts = tmp_path / "posts.jsonl"
    posts.write_text(_posts(3000, "p"))
    cli = subprocess.Popen(
        [CLI, "run", TASK, str(posts)],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group, as a terminal's foreground job
    )
    assert cli.stdout is not None
    lines = []
    for line in cli.stdout:
        lines.append(line)
        if "requests (" in line:  # a progress line: the engine is answering
            break
    os.killpg(cli.pid, signal.SIGINT)  # what Ctrl-C does: every process of the group, the engine's too
    rest = cli.communicate(timeout=180)[0]
    output = "".join(lines) + rest
    assert cli.returncode == 130, output
    assert "stopped (interrupted)" in rest and "Traceback" not in output
    with home_instance(tmp_path / "home") as instance:
        [run] = instance.get_runs()
        events = [event.dagster_event for event in instance.all_logs(run.run_id) if event.dagster_event]
    kinds = [event.event_type_value for event in events]
    assert "STEP_UP_FOR_RETRY" not in kinds and "STEP_RESTARTED" not in kinds, kinds
    started = [event.step_key for event in events if event.event_type_value == "STEP_START"]
    assert started.count(f"{TASK}__inference_outputs") == 1  # one engine: the step ran once


@pytest.mark.slow
def test_sigterm_during_an_asset_check_is_stopped_not_failed(workdir) -> None:
    """Before: reported `FAILED ... DagsterExecutionInterruptedError`, exit 1."""
    tmp_path, env = workdir
    posts = tmp_path / "posts.jsonl"
    posts.write_text(_posts(3, "p"))
    # The command line as the console script runs it, with one check that gets SIGTERM while it runs.
    script = textwrap.dedent(
        """
        import os, signal, sys, time
        from batch_assets.lib import checks
        from batch_assets import cli

        original = checks.labels_valid_result

        def slow_check(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
            return original(*args, **kwargs)

        checks.labels_valid_result = slow_check
        sys.exit(cli.main(sys.argv[1:]))
        """
    )
    result = subprocess.run(
        [os.fspath(Path(CLI).parent / "python"), "-c", script, "run", TASK, str(posts)],
        env=python_env(env),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 130, result.stdout[-3000:] + result.stderr[-3000:]
    assert "stopped (interrupted)" in result.stdout and "FAILED" not in result.stdout


def test_a_gzip_file_split_into_many_shards_says_what_it_costs(data_dir: Path) -> None:
    import gzip

    from batch_assets.pipeline.task_spec import load_tasks
    from batch_assets.storage.partition_registration import file_partitions

    task = next(task for task in load_tasks().tasks if task.name == TASK)
    task = task.model_copy(update={"input": task.input.model_copy(update={"max_rows_per_partition": 3})})
    drop(data_dir, TASK, "posts.jsonl.gz", gzip.compress(jsonl_with_bad_lines(11)))
    notes: list[str] = []
    with dg.instance_for_test() as instance:
        keys = file_partitions(instance, task, find_drop_file(TASK, "posts.jsonl.gz"), [], say=notes.append)
    assert keys == [f"posts.jsonl.gz~0000{n}" for n in (1, 2, 3, 4)]
    assert notes == [
        "posts.jsonl.gz: 4 shards of a gzip file; each decompresses the file from its start (shard N reads N "
        "shards' worth), so a big file is better dropped uncompressed or as parquet"
    ]


def test_an_interrupt_anywhere_in_the_inference_step_stops_it_without_the_retry_policy() -> None:
    """Dagster retries an interrupted step that has a retry policy; before, only the engine session of
    `inference_outputs` was guarded, so a Ctrl-C while it loaded the tokenizer or listed checkpoints
    started the step again with a fresh engine."""
    from batch_assets.lib.assets import stopped_without_retry

    attempts: list[int] = []

    @dg.op(retry_policy=dg.RetryPolicy(max_retries=1))
    def inference_like() -> None:
        with stopped_without_retry():
            attempts.append(1)
            raise dg.DagsterExecutionInterruptedError()  # what Dagster's SIGINT/SIGTERM handler raises

    @dg.job
    def job() -> None:
        inference_like()

    result = job.execute_in_process(raise_on_error=False)
    kinds = [event.event_type_value for event in result.all_events]
    assert attempts == [1] and "STEP_UP_FOR_RETRY" not in kinds
    [failure] = [event for event in result.all_events if event.is_step_failure]
    assert failure.step_failure_data.error.message.endswith("Failure: stopped (interrupted)\n")


def test_a_step_that_starts_after_a_stop_was_asked_for_does_not_start(monkeypatch: pytest.MonkeyPatch) -> None:
    from batch_assets.lib.assets import stopped_without_retry
    from batch_assets.runtime import interrupts

    monkeypatch.setattr(interrupts, "STOP", threading.Event())
    interrupts.STOP.set()
    with pytest.raises(dg.Failure, match="stopped"), stopped_without_retry():
        pytest.fail("the step's work ran after the stop")


def test_a_new_version_too_small_to_split_still_outdates_the_old_shards(data_dir: Path) -> None:
    """Before, the old plan stayed kept: a shard of the old version still running stored its output
    beside the new whole-file partition's."""
    from batch_assets.pipeline.task_spec import load_tasks
    from batch_assets.storage.partition_registration import file_partitions

    task = next(task for task in load_tasks().tasks if task.name == TASK)
    task = task.model_copy(update={"input": task.input.model_copy(update={"max_rows_per_partition": 50})})
    path = drop(data_dir, TASK, "posts.jsonl", _posts(200, "v1"))
    first = find_drop_file(TASK, "posts.jsonl")
    with dg.instance_for_test() as instance:
        old_keys = file_partitions(instance, task, first, [], say=print)
        assert len(old_keys) == 4
        pinned = {SHARD_VERSIONS_TAG: json.dumps({key: version_digest(first.version) for key in old_keys})}
        path.write_text('{"text": "v2"}\n')
        os.utime(path, (1_900_000_000, 1_900_000_000))
        new_keys = file_partitions(instance, task, find_drop_file(TASK, "posts.jsonl"), old_keys, say=print)
    assert new_keys == ["posts.jsonl"]
    assert outdated_shards(TASK, old_keys, pinned) == old_keys
