"""`batch-assets` against a hostile user: concurrent first commands, killed processes, same-name
files, bad models, files of only errors, a second UI. Real processes, a real Dagster home."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import dagster as dg
import pytest

from batch_assets.runtime import run_recovery
from batch_assets.runtime.instance import prepare_instance
from batch_assets_tests.support import (
    CLI,
    REPO_ROOT,
    free_port,
    open_instance,
    passed,
    python_env,
    run_cli,
    stop_process_group,
    summary_lines,
)

PYTHON = sys.executable
ROUNDS, PROCESSES = 3, 5


@pytest.fixture
def cli_env(workdir: tuple[Path, dict[str, str]]) -> tuple[Path, dict[str, str]]:
    return workdir


@pytest.mark.slow
def test_concurrent_first_commands_leave_one_usable_instance_and_one_partition(cli_env) -> None:
    """Issue 17.1 and 17.4: without the setup lock 2-3 of 5 such rounds left two alembic heads."""
    tmp_path, env = cli_env
    script = textwrap.dedent(
        """
        from batch_assets.storage.partition_registration import add_partitions
        from batch_assets.runtime.instance import open_instance
        instance = open_instance()
        add_partitions(instance, "sentiment_drops", ["posts.jsonl"])
        """
    )
    for round_number in range(ROUNDS):
        home = tmp_path / f"home{round_number}"
        round_env = python_env({**env, "DAGSTER_HOME": str(home)})
        processes = [
            subprocess.Popen([PYTHON, "-c", script], env=round_env, stderr=subprocess.PIPE, text=True)
            for _ in range(PROCESSES)
        ]
        errors = [process.communicate(timeout=300)[1] for process in processes]
        assert all(process.returncode == 0 for process in processes), "\n".join(errors)[-3000:]
        with sqlite3.connect(home / "history" / "runs.db") as db:
            assert db.execute("select count(*) from alembic_version").fetchone() == (1,)
        with open_instance(home) as instance:
            assert instance.get_dynamic_partitions("sentiment_drops") == ["posts.jsonl"]
            assert instance.get_runs() == []


@pytest.mark.slow
def test_adding_a_partition_that_another_process_just_added_is_success(cli_env, monkeypatch) -> None:
    """Issue 17.4, the interleaving made certain: B inserts the key between A's lookup and A's insert
    inside Dagster's `add_dynamic_partitions` (which raised IntegrityError then)."""
    from contextlib import contextmanager

    from batch_assets.storage.partition_registration import add_partitions

    tmp_path, env = cli_env
    monkeypatch.setenv("DAGSTER_HOME", env["DAGSTER_HOME"])
    prepare_instance()
    with open_instance(tmp_path / "home") as first, open_instance(tmp_path / "home") as second:
        storage = first.event_log_storage
        connect = storage.index_connection

        class LosesTheRace:
            def __init__(self, conn):
                self.conn = conn

            def __getattr__(self, name):
                return getattr(self.conn, name)

            def execute(self, statement, *args, **kwargs):
                result = self.conn.execute(statement, *args, **kwargs)
                text = " ".join(str(statement).split())
                # Dagster's lookup of the keys to insert (`partition IN (...)`), not a plain existence check.
                if text.startswith("SELECT dynamic_partitions.partition ") and " IN (" in text:
                    second.add_dynamic_partitions("sentiment_drops", ["posts.jsonl"])
                return result

        @contextmanager
        def racing_connection():
            with connect() as conn:
                yield LosesTheRace(conn)

        monkeypatch.setattr(storage, "index_connection", racing_connection)
        add_partitions(first, "sentiment_drops", ["posts.jsonl", "posts.jsonl"])
        assert second.get_dynamic_partitions("sentiment_drops") == ["posts.jsonl"]


LEASE_HOLDER = textwrap.dedent(
    """
    import sys, time, uuid
    import dagster as dg
    from batch_assets.runtime.instance import open_instance
    from batch_assets.runtime.run_recovery import HOST_TAG, ProcessLease
    instance = open_instance()
    lease = ProcessLease(instance.root_directory)
    lease.claim("sentiment", [("posts.jsonl", sys.argv[1])])
    run_id = str(uuid.uuid4())
    # A host name of another container: the lease, not pid + host, tells whether the process lives.
    tags = {**lease.tags(), HOST_TAG: "another-container", "batch_assets/launched_by": "cli", "dagster/partition": "x"}
    status = dg.DagsterRunStatus.STARTED
    instance.add_run(dg.DagsterRun(job_name="sentiment_pipeline", run_id=run_id, status=status, tags=tags))
    storage = instance.event_log_storage
    storage.initialize_concurrency_limit_to_default("gpu")
    assert storage.claim_concurrency_slot("gpu", run_id, "sentiment__inference_outputs").is_claimed
    print(run_id, flush=True)
    time.sleep(600)
    """
)


def start_lease_holder(env: dict[str, str], digest: str = "0") -> tuple[subprocess.Popen, str]:
    holder = subprocess.Popen(
        [PYTHON, "-c", LEASE_HOLDER, digest],
        env=python_env(env),
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    run_id = holder.stdout.readline().strip()
    assert run_id, "the lease holder did not start"
    return holder, run_id


def kill(process: subprocess.Popen) -> None:
    os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=30)


@pytest.mark.slow
def test_run_of_a_killed_process_on_another_host_is_failed_and_its_slot_freed_by_the_sensor(
    cli_env, monkeypatch
) -> None:
    """Issue 17.2: a live process's run is left alone; once it is killed, the daemon's sensor frees the pool."""
    tmp_path, env = cli_env
    monkeypatch.setenv("DAGSTER_HOME", env["DAGSTER_HOME"])
    prepare_instance()
    holder, run_id = start_lease_holder(env)
    sensor = run_recovery.build_recovery_sensor()
    with open_instance(tmp_path / "home") as instance:
        try:
            assert run_recovery.fail_runs_of_dead_processes(instance) == []
            assert instance.get_run_by_id(run_id).status == dg.DagsterRunStatus.STARTED
            assert instance.event_log_storage.get_concurrency_info("gpu").active_run_ids == {run_id}
        finally:
            kill(holder)
        sensor(dg.build_sensor_context(instance=instance))
        assert instance.get_run_by_id(run_id).status == dg.DagsterRunStatus.FAILURE
        assert instance.event_log_storage.get_concurrency_info("gpu").active_slot_count == 0
        assert list(run_recovery.leases_dir(tmp_path / "home").iterdir()) == []


@pytest.mark.slow
def test_cli_waiting_for_the_gpu_pool_says_so_and_stops_on_sigterm(cli_env, monkeypatch) -> None:
    """Issue 17.2: before, the CLI blocked inside Dagster without a word and ignored SIGTERM."""
    tmp_path, env = cli_env
    posts = tmp_path / "posts.jsonl"
    posts.write_text('{"text": "fine"}\n')
    monkeypatch.setenv("DAGSTER_HOME", env["DAGSTER_HOME"])
    prepare_instance()
    holder, run_id = start_lease_holder(env)
    try:
        cli = subprocess.Popen(
            [CLI, "run", "sentiment", str(posts)],
            env=env,
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        lines = []
        for line in cli.stdout:
            lines.append(line)
            if "waiting for a slot of pool `gpu`" in line:
                break
        assert run_id[:8] in lines[-1] and "Ctrl-C" in lines[-1], lines
        cli.send_signal(signal.SIGTERM)
        rest = cli.communicate(timeout=120)[0]
        assert cli.returncode == 130 and "stopped" in rest, rest
        assert "Traceback" not in "".join(lines) + rest
    finally:
        kill(holder)


@pytest.mark.slow
def test_drop_sensor_leaves_a_file_that_a_live_cli_is_running_to_it(cli_env, monkeypatch) -> None:
    """Issue 17.11: the sensor queued a second run of a file `batch-assets run` was still processing."""
    from batch_assets.lib.drops_sensor import build_drops_sensor
    from batch_assets.lib.task_definitions import build_definitions, build_task_job
    from batch_assets.pipeline.task_spec import load_task_specs
    from batch_assets.storage.drop_files import find_drop_file, version_digest

    tmp_path, env = cli_env
    for name in ("DAGSTER_HOME", "BATCH_ASSETS_DATA"):
        monkeypatch.setenv(name, env[name])
    prepare_instance()
    drop = tmp_path / "data" / "drops" / "sentiment" / "posts.jsonl"
    drop.parent.mkdir(parents=True)
    drop.write_text('{"text": "fine"}\n')
    os.utime(drop, (time.time() - 60, time.time() - 60))
    digest = version_digest(find_drop_file("sentiment", "posts.jsonl").version)
    [task] = [task for task in load_task_specs() if task.name == "sentiment"]
    sensor = build_drops_sensor(task, build_task_job(task))
    holder, _ = start_lease_holder(env, digest)
    defs = build_definitions()
    with open_instance(tmp_path / "home") as instance:
        try:
            busy = sensor(dg.build_sensor_context(instance=instance, cursor=None, definitions=defs))
            assert not busy.run_requests
        finally:
            kill(holder)
        after = sensor(dg.build_sensor_context(instance=instance, cursor=busy.cursor, definitions=defs))
        assert [request.partition_key for request in after.run_requests] == ["posts.jsonl"]


@pytest.mark.slow
def test_same_name_from_another_folder_is_refused_before_anything_is_copied(cli_env, cli_in_process) -> None:
    """Issue 17.3 / 16 defect 1: the second file replaced the first's drop and outputs without a word."""
    tmp_path, _ = cli_env
    for folder, text in (("d1", '{"text": "a"}\n{"text": "b"}\n{"text": "c"}\n'), ("d2", '{"text": "z"}\n')):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "posts.jsonl").write_text(text)
    zone = tmp_path / "data" / "drops" / "sentiment"
    zone.mkdir(parents=True)
    (zone / "posts.jsonl").write_bytes((tmp_path / "d1" / "posts.jsonl").read_bytes())

    both = cli_in_process(["run", "sentiment", "d1/posts.jsonl", "d2/posts.jsonl"])
    assert both.returncode == 2, both.stdout + both.stderr
    assert "d1/posts.jsonl and d2/posts.jsonl are different files with the same name" in both.stdout
    second = cli_in_process(["run", "sentiment", "d2/posts.jsonl"])
    assert (
        second.returncode == 2
        and "already holds a different posts.jsonl" in second.stdout
        and "--replace" in second.stdout
    )
    for result in (both, second):
        assert (
            "Traceback" not in result.stdout + result.stderr and "IntegrityError" not in result.stdout + result.stderr
        )
    assert (zone / "posts.jsonl").read_bytes() == (tmp_path / "d1" / "posts.jsonl").read_bytes()


@pytest.mark.slow
def test_a_link_or_fifo_in_the_drop_zone_is_neither_followed_nor_waited_on(cli_env, cli_in_process) -> None:
    """A link to a secret or a FIFO planted under a file's name in a shared drop zone: the CLI neither
    reads through the link nor hangs on the FIFO; it refuses (a different drop file), and --replace
    replaces the planted entry itself, never the file a link points to."""
    tmp_path, _ = cli_env
    zone = tmp_path / "data" / "drops" / "sentiment"
    zone.mkdir(parents=True)
    secret = tmp_path / "secret.jsonl"
    secret.write_text('{"text": "secret"}\n')
    (zone / "posts.jsonl").symlink_to(secret)
    os.mkfifo(zone / "queue.jsonl")
    (tmp_path / "posts.jsonl").write_text('{"text": "secret"}\n')  # the link target's very bytes
    (tmp_path / "queue.jsonl").write_text('{"text": "fine"}\n')

    for name in ("posts.jsonl", "queue.jsonl"):
        refused = cli_in_process(["run", "sentiment", name])
        assert refused.returncode == 2 and f"already holds a different {name}" in refused.stdout, refused.stdout
    replaced = cli_in_process(["run", "sentiment", "--replace", "posts.jsonl", "queue.jsonl"])
    assert replaced.returncode == 0, replaced.stdout[-3000:]
    for name in ("posts.jsonl", "queue.jsonl"):
        assert (zone / name).is_file() and not (zone / name).is_symlink()
        assert (zone / name).read_bytes() == (tmp_path / name).read_bytes()
    assert secret.read_text() == '{"text": "secret"}\n'


@pytest.mark.slow
def test_replace_says_so_and_a_file_of_only_errors_fails_quietly(cli_env) -> None:
    """17.3 (--replace), 17.11 (only error rows: exit 1) and 16 defects 2-3 (no engine logs, no traceback)."""
    tmp_path, env = cli_env
    zone = tmp_path / "data" / "drops" / "sentiment"
    zone.mkdir(parents=True)
    (zone / "posts.jsonl").write_text('{"text": "a"}\n{"text": "b"}\n{"text": "c"}\n')
    (tmp_path / "d2").mkdir()
    (tmp_path / "d2" / "posts.jsonl").write_text('{"text": "fine"}\n{"text": "bad"}\n')
    (tmp_path / "garbage.jsonl").write_text("not json\n{also not\n")

    result = run_cli(["run", "sentiment", "--replace", "d2/posts.jsonl", "garbage.jsonl"], env, tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output[-3000:]
    assert "replaces the drop file posts.jsonl" in result.stdout and "(--replace)" in result.stdout
    posts, garbage = summary_lines(result.stdout)
    assert passed(posts, "sentiment/posts.jsonl") and " run " in posts and "2 rows, 0 error rows" in posts
    assert garbage.startswith("sentiment/garbage.jsonl: ALL ROWS FAILED") and "2 rows, 2 error rows" in garbage
    assert "2/2 requests (100%)" in result.stdout  # the progress line of the run (both files, one stream)
    for noise in ("Traceback", "safetensors", "INFO", "WARNING", "vllm"):
        assert noise not in output, noise
    log = next((tmp_path / "home" / "logs").glob("batch-assets-*.log")).read_text()
    assert "vLLM" in log or "vllm" in log


@pytest.mark.slow
def test_bad_models_fail_at_once_with_the_setting_to_change(cli_env, cli_in_process) -> None:
    """Issue 17.9: a missing folder said "Repo id must be in the form…"; an uncached id failed after a DNS error."""
    tmp_path, _ = cli_env
    posts = tmp_path / "posts.jsonl"
    posts.write_text('{"text": "fine"}\n')
    missing = cli_in_process(["run", "sentiment", str(posts)], BATCH_ASSETS_MODEL=str(tmp_path / "no-model"))
    assert missing.returncode == 2
    assert (
        f"model folder {tmp_path / 'no-model'} does not exist" in missing.stdout
        and "BATCH_ASSETS_MODEL" in missing.stdout
    )
    offline = {"BATCH_ASSETS_MODEL": "nobody/not-a-cached-model", "HF_ENDPOINT": "http://127.0.0.1:9"}
    uncached = cli_in_process(["run", "sentiment", str(posts)], **offline)
    assert uncached.returncode == 2
    assert "'nobody/not-a-cached-model' is not in the local Hugging Face cache" in uncached.stdout
    assert "hf download nobody/not-a-cached-model" in uncached.stdout
    assert not (tmp_path / "data" / "drops" / "sentiment" / "posts.jsonl").exists()


@pytest.mark.slow
def test_too_long_max_model_len_names_the_setting_and_the_limit(cli_env, cli_in_process) -> None:
    """Issue 17.9: the CLI printed a pydantic documentation link."""
    tmp_path, _ = cli_env
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    spec = (REPO_ROOT / "batch_assets" / "tasks" / "sentiment.yaml").read_text()
    (tasks / "sentiment.yaml").write_text(spec.replace("max_model_len: 1024", "max_model_len: 100000"))
    posts = tmp_path / "posts.jsonl"
    posts.write_text('{"text": "fine"}\n')
    result = cli_in_process(["run", "sentiment", str(posts)], BATCH_ASSETS_TASKS_DIR=str(tasks))
    # Refused before anything is copied or started, naming the model that runs (BATCH_ASSETS_MODEL here).
    assert result.returncode == 2
    assert "engine.max_model_len 100000 exceeds the 2048 tokens the model" in result.stdout
    assert "(BATCH_ASSETS_MODEL) takes; set engine.max_model_len to at most 2048" in result.stdout
    assert "pydantic" not in result.stdout and "Traceback" not in result.stdout + result.stderr


@pytest.mark.slow
def test_expected_errors_print_one_line_and_keep_the_traceback_in_the_run_log(cli_env, cli_in_process) -> None:
    """Issue 16 defect 2: a missing column printed a whole traceback before the message. A file the
    task cannot read fails its partition: exit status 1, its line FAILED naming the missing column."""
    tmp_path, _ = cli_env
    bad = tmp_path / "wrong-column.csv"
    bad.write_text("Name,City\nAcme,Paris\n")
    result = cli_in_process(["run", "industry", str(bad)])
    assert result.returncode == 1
    [line] = summary_lines(result.stdout)
    assert "FAILED" in line and "Company" in line
    assert "Traceback" not in result.stdout + result.stderr and "Stack Trace" not in result.stdout + result.stderr
    with open_instance(tmp_path / "home") as instance:
        [run] = instance.get_runs()
        failures = [
            event
            for event in instance.all_logs(run.run_id)
            if event.is_dagster_event and event.dagster_event.is_step_failure
        ]
        assert failures and failures[0].dagster_event.step_failure_data.error.stack
    verbose = cli_in_process(["run", "industry", "--verbose", str(bad)])
    assert verbose.returncode == 1 and "Stack Trace" in verbose.stdout + verbose.stderr


@pytest.mark.slow
def test_a_second_ui_on_the_same_home_is_refused(cli_env) -> None:
    """Issue 17.11: `make ui` twice left a second daemon running."""
    tmp_path, env = cli_env
    first = subprocess.Popen(
        [CLI, "ui", "--port", str(free_port())],
        env=env,
        cwd=REPO_ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        lock = tmp_path / "home" / ".batch_assets_ui.lock"
        deadline = time.monotonic() + 120
        while not (lock.exists() and lock.read_text()) and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        second = run_cli(["ui", "--port", str(free_port())], env, REPO_ROOT)
        assert second.returncode == 2, second.stdout + second.stderr
        assert f"the Dagster UI and daemon of {tmp_path / 'home'} already run (pid {first.pid}" in second.stdout
        assert first.poll() is None
    finally:
        # How fast `dg dev` stops when interrupted mid-start is not what this test checks (CI saw it
        # take over 60 s under load): interrupt it, then kill what is left.
        stop_process_group(first)


def test_every_run_argument_has_help() -> None:
    from batch_assets.cli import build_parser

    parser = build_parser()
    commands = next(action for action in parser._actions if action.dest == "command")  # argparse has no public walk
    for name, command in commands.choices.items():
        for action in command._actions:
            assert action.help, f"{name} {action.dest}"


def test_a_step_dagster_left_waiting_for_a_free_pool_slot_gets_it() -> None:
    """Seen in a cached re-run of two range runs: the second run's inference step waited for the
    `gpu` pool for minutes with no slot claimed (it queued itself just after the first freed it)."""
    with dg.instance_for_test() as instance:
        storage = instance.event_log_storage
        storage.set_concurrency_slots("gpu", 1)
        assert storage.claim_concurrency_slot("gpu", "run-a", "inference").is_claimed
        # run-b looked while run-a held the slot; run-a frees it (assigning nobody: none queued yet)
        # and only then run-b queues itself unassigned, as Dagster does after such a look.
        storage.free_concurrency_slot_for_step("run-a", "inference")
        storage.add_pending_step("gpu", "run-b", "inference", should_assign=False)
        assert not storage.claim_concurrency_slot("gpu", "run-b", "inference").is_claimed  # stranded
        assert run_recovery.assign_stranded_pool_steps(instance) == ["gpu"]
        assert storage.claim_concurrency_slot("gpu", "run-b", "inference").is_claimed
        # A step waiting behind a slot that is really held is left waiting: no second slot.
        storage.add_pending_step("gpu", "run-c", "inference", should_assign=False)
        assert run_recovery.assign_stranded_pool_steps(instance) == []
        assert not storage.claim_concurrency_slot("gpu", "run-c", "inference").is_claimed
        storage.free_concurrency_slot_for_step("run-b", "inference")  # Dagster's own hand-over
        assert storage.claim_concurrency_slot("gpu", "run-c", "inference").is_claimed


def test_a_step_holding_the_pool_slot_sees_when_another_run_waits_for_it() -> None:
    """What `batch-assets run` asks before keeping its engine for its next range: a waiting step of
    another run will start its own engine as soon as the slot is freed."""
    with dg.instance_for_test() as instance:
        storage = instance.event_log_storage
        storage.set_concurrency_slots("gpu", 1)
        assert storage.claim_concurrency_slot("gpu", "cli-run", "inference").is_claimed
        assert not run_recovery.others_wait_for_pool(instance, "gpu")
        assert not storage.claim_concurrency_slot("gpu", "daemon-run", "inference").is_claimed  # now waiting
        assert run_recovery.others_wait_for_pool(instance, "gpu")
        storage.free_concurrency_slot_for_step("cli-run", "inference")  # handed to the waiting step
        assert storage.claim_concurrency_slot("gpu", "daemon-run", "inference").is_claimed
        assert not run_recovery.others_wait_for_pool(instance, "gpu")


def test_the_cli_frees_its_warm_engine_before_waiting_for_a_slot_another_run_holds() -> None:
    """The holder's engine needs the device: `batch-assets run` shuts its own engine down once, before
    it waits, and goes on when the slot is free."""
    with dg.instance_for_test() as instance:
        storage = instance.event_log_storage
        storage.set_concurrency_slots("gpu", 1)
        freed: list[str] = []
        run_recovery.wait_for_pool_slot(instance, "gpu", say=lambda _: None, before_waiting=lambda: freed.append("x"))
        assert freed == []  # the slot was free: nothing to wait for, the engine stays
        assert storage.claim_concurrency_slot("gpu", "daemon-run", "inference").is_claimed
        said: list[str] = []
        releaser = threading.Timer(3.0, lambda: storage.free_concurrency_slot_for_step("daemon-run", "inference"))
        releaser.start()
        started = time.monotonic()
        run_recovery.wait_for_pool_slot(
            instance, "gpu", say=said.append, poll_seconds=0.2, before_waiting=lambda: freed.append("x")
        )
        releaser.join()
        assert freed == ["x"] and time.monotonic() - started >= 2.5
        assert len(said) == 1 and "held by run daemon-r" in said[0]


@pytest.mark.slow
def test_an_edited_file_runs_again_and_a_namesake_is_refused_or_replaced_after_cli_runs(
    cli_env, cli_in_process
) -> None:
    """Issue 29.1: once a file had a CLI run, running it again edited, or a file of the same name from
    another folder (with or without --replace), crashed with `AttributeError ... create_timestamp`."""
    tmp_path, _ = cli_env
    for folder in ("r1", "r2"):
        (tmp_path / folder).mkdir()
    edited, namesake, other = tmp_path / "r1" / "e.csv", tmp_path / "r2" / "e.csv", tmp_path / "r1" / "f.csv"
    zone = tmp_path / "data" / "drops" / "industry"

    edited.write_text('Company\n""\n')
    first = cli_in_process(["run", "industry", "r1/e.csv"])
    assert first.returncode == 1, first.stdout + first.stderr[-3000:]
    [line] = summary_lines(first.stdout)
    assert line.startswith("industry/e.csv: ALL ROWS FAILED") and "1 rows, 1 error rows" in line

    # The tuning loop: edit the file, run it again (here with another file, so one run carries both
    # files' origins in one tag).
    edited.write_text("Company\nAcme Holdings LLP\nGlobex Hospital\n")
    other.write_text("Company\nInitech\n")
    second = cli_in_process(["run", "industry", "r1/e.csv", "r1/f.csv"])
    assert second.returncode == 0, second.stdout + second.stderr[-3000:]
    assert "r1/e.csv: changed since its last run; partition e.csv is run again from the new content" in second.stdout
    lines = summary_lines(second.stdout)
    assert [line.split(": ")[0] for line in lines] == ["industry/e.csv", "industry/f.csv"]
    assert "2 rows, 0 error rows" in lines[0], lines

    # Another folder's e.csv: refused, naming the file the drop came from; nothing copied. Its company
    # was labelled above, so the --replace run below takes its label from the result cache (no second
    # engine start; what it checks is the replacing).
    namesake.write_text("Company\nGlobex Hospital\n")
    refused = cli_in_process(["run", "industry", "r2/e.csv"])
    assert refused.returncode == 2, refused.stdout + refused.stderr[-3000:]
    assert f"already holds a different e.csv (from {edited})" in refused.stdout and "--replace" in refused.stdout
    assert (zone / "e.csv").read_bytes() == edited.read_bytes()

    # With --replace it replaces the drop and the partition's outputs, and says what it replaced.
    replaced = cli_in_process(["run", "industry", "--replace", "r2/e.csv"])
    assert replaced.returncode == 0, replaced.stdout + replaced.stderr[-3000:]
    assert f"r2/e.csv: replaces the drop file e.csv (from {edited}) as asked (--replace)" in replaced.stdout
    [line] = summary_lines(replaced.stdout)
    assert passed(line, "industry/e.csv") and " run " in line and "1 rows, 0 error rows" in line
    assert "nothing inferred: 1 rows from the result cache; tokens " in line, line
    assert (zone / "e.csv").read_bytes() == namesake.read_bytes()

    # The newest run decides where the drop came from: now r2, so r1's file is the namesake.
    back = cli_in_process(["run", "industry", "r1/e.csv"])
    assert back.returncode == 2 and f"already holds a different e.csv (from {namesake})" in back.stdout, back.stdout
    for result in (first, second, refused, replaced, back):
        assert "AttributeError" not in result.stdout and "Traceback" not in result.stdout + result.stderr
    with open_instance(tmp_path / "home") as instance:
        assert len(instance.get_runs()) == 3


def test_the_console_script_leaves_without_the_interpreters_teardown_once_its_atexit_handlers_ran(
    tmp_path: Path,
) -> None:
    """`batch-assets run` skips the ~2 s Python spends tearing its modules down once vLLM is imported;
    exit status, atexit handlers and buffered output are as at a normal exit. While a thread that a
    normal exit waits for still runs, it exits the normal way."""
    script = tmp_path / "leave.py"
    script.write_text(
        textwrap.dedent(
            """
            import atexit, sys, threading, time
            from batch_assets.runtime.process_exit import exit_without_teardown

            class TornDown:
                def __del__(self):
                    sys.__stderr__.write("torn down")

            kept = TornDown()
            atexit.register(lambda: print("atexit handler ran"))
            print("buffered ", end="")
            if sys.argv[1] == "thread":
                threading.Thread(target=time.sleep, args=(0.5,)).start()
            sys.exit(exit_without_teardown(3))
            """
        )
    )
    env = python_env(dict(os.environ))
    for thread, torn_down in (("none", False), ("thread", True)):
        done = subprocess.run([PYTHON, str(script), thread], env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 3 and done.stdout == "buffered atexit handler ran\n", done
        assert ("torn down" in done.stderr) is torn_down, done.stderr


@pytest.mark.parametrize("command", [["serve", "--port", "99999"], ["serve", "--port", "0"], ["ui", "--port", "65536"]])
def test_a_port_outside_1_to_65535_is_refused_as_a_usage_error(
    command: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 56.14: `serve --port 99999` said it listened on 99999 and listened on 34463 (99999 mod 65536)."""
    from batch_assets.cli import build_parser

    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(command)
    assert exited.value.code == 2
    assert f"argument --port: must be a port number from 1 to 65535 (not {command[-1]})" in capsys.readouterr().err


def test_a_dagster_home_that_is_a_file_is_one_line_naming_it(
    data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 56.11: every command ended in a `FileExistsError` traceback."""
    from batch_assets.cli import main

    home = tmp_path / "home-file"
    home.write_text("not a folder\n")
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    (tmp_path / "posts.jsonl").write_text('{"text": "fine"}\n')
    refusal = (
        f"DAGSTER_HOME={home} is a file, not a folder: point DAGSTER_HOME at a folder (one that does not exist "
        "yet is created)"
    )
    for command in (
        ["run", "sentiment", str(tmp_path / "posts.jsonl")],
        ["drop", "sentiment", str(tmp_path / "posts.jsonl")],
        ["cache", "prune"],
    ):
        assert main(command) == 2, command
        captured = capsys.readouterr()
        assert captured.out.strip() == f"error: {refusal}", command
        assert "Traceback" not in captured.out + captured.err
    assert main(["doctor"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert f"FAIL  instance storage: {refusal} [set: DAGSTER_HOME]" in lines, lines
    assert home.read_text() == "not a folder\n"


def test_a_folder_named_as_a_file_is_refused_as_a_folder(
    data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 56.17: `run sentiment /tmp` said `/tmp: no such file`."""
    from batch_assets.cli import main

    assert main(["run", "sentiment", str(tmp_path)]) == 2
    assert capsys.readouterr().out.strip() == (
        f"error: {tmp_path}: a folder, not a file: name the files in it to run (e.g. {tmp_path}/*.jsonl)"
    )
    assert not (data_dir / "drops").exists()


def test_an_s3_data_root_without_credentials_names_the_setting_and_the_bucket(
    data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 56.13: `error: NoCredentialsError: Unable to locate credentials`, naming neither."""
    import s3fs

    from batch_assets.cli import main

    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("BATCH_ASSETS_DATA", "s3://uncredentialed-bucket/x")
    s3fs.S3FileSystem.clear_instance_cache()  # none made with another test's credentials
    (tmp_path / "posts.jsonl").write_text('{"text": "fine"}\n')
    said = (
        "error: copying into the sentiment drop zone s3://uncredentialed-bucket/x/drops/sentiment failed: no AWS "
        "credentials found (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE); the drop zone is "
        "under BATCH_ASSETS_DATA=s3://uncredentialed-bucket/x"
    )
    for command in ("run", "drop"):
        assert main([command, "sentiment", str(tmp_path / "posts.jsonl")]) == 1
        [line] = capsys.readouterr().out.splitlines()
        assert line.startswith(said), line
