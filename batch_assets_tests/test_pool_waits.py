"""A step waiting for the `gpu` pool sleeps between looks and notices a freed slot within seconds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import dagster as dg
import psutil
import pytest

from batch_assets.runtime.pool_waits import POOL_CHECK_SECONDS, sleep_between_pool_checks


def test_a_waiting_step_sleeps_until_its_next_look_and_looks_at_least_every_two_seconds() -> None:
    from dagster._core.execution.plan import instance_concurrency_context as module

    sleep_between_pool_checks()
    with dg.instance_for_test() as instance:
        storage = instance.event_log_storage
        storage.set_concurrency_slots("gpu", 1)
        assert storage.claim_concurrency_slot("gpu", "run-a", "inference").is_claimed
        run = instance.create_run_for_job(job_def=dg.define_asset_job("j").resolve(asset_graph=_graph()))
        with module.InstanceConcurrencyContext(instance, run) as waiting:
            assert not waiting.claim("gpu", "inference")
            first_wait = waiting.interval_to_next_pending_claim_check()
            assert 0.5 < first_wait <= 1.0  # Dagster's first back-off (1 s), slept rather than spun
            # However long the wait already lasted, the next look is at most POOL_CHECK_SECONDS away
            # (Dagster's own back-off grows to 15 s).
            assert module._calculate_timeout_interval(None, 40) == POOL_CHECK_SECONDS
            storage.free_concurrency_slot_for_step("run-a", "inference")  # hands the slot to the waiting step
            time.sleep(first_wait)
            assert waiting.interval_to_next_pending_claim_check() == 0.0  # its look is due: no sleep
            assert waiting.claim("gpu", "inference")
            assert not waiting.has_pending_claims()
            assert waiting.interval_to_next_pending_claim_check() == 0.0


def _graph():
    @dg.asset
    def anything() -> int:
        return 1

    return dg.Definitions(assets=[anything]).resolve_asset_graph()


WAITING_RUN = textwrap.dedent(
    """
    import dagster as dg
    from batch_assets.runtime.pool_waits import sleep_between_pool_checks

    sleep_between_pool_checks()

    @dg.asset(pool="gpu")
    def needs_the_gpu() -> int:
        return 1

    with dg.DagsterInstance.get() as instance:
        assert dg.materialize([needs_the_gpu], instance=instance).success
    """
)


@pytest.mark.slow
def test_a_run_waiting_for_the_pool_uses_no_cpu_and_runs_once_the_slot_is_free(tmp_path: Path) -> None:
    """Measured before: a range run waiting behind another used a whole core for the whole wait."""
    home = tmp_path / "home"
    home.mkdir()
    env = {**os.environ, "DAGSTER_HOME": str(home)}
    with dg.DagsterInstance.from_config(str(home)) as instance:
        storage = instance.event_log_storage
        storage.set_concurrency_slots("gpu", 1)
        assert storage.claim_concurrency_slot("gpu", "engine-run", "inference").is_claimed
        waiting = subprocess.Popen([sys.executable, "-c", WAITING_RUN], env=env)
        try:
            deadline = time.monotonic() + 120
            while len(storage.get_concurrency_info("gpu").pending_steps) < 2:  # the holder's and the waiter's
                assert waiting.poll() is None and time.monotonic() < deadline, "the run never queued for the pool"
                time.sleep(0.2)
            process = psutil.Process(waiting.pid)
            before = process.cpu_times()
            time.sleep(5)
            after = process.cpu_times()
            busy = (after.user + after.system) - (before.user + before.system)
            assert busy < 1.0, f"the waiting run used {busy:.1f} CPU s in 5 s"  # spinning: ~5
            assert waiting.poll() is None  # still waiting: the slot is held
            storage.free_concurrency_slot_for_step("engine-run", "inference")
            assert waiting.wait(timeout=120) == 0
        finally:
            if waiting.poll() is None:
                waiting.kill()
        assert storage.get_concurrency_info("gpu").active_slot_count == 0  # the run gave its slot back


# Each round both processes ask at the same instant, and the one that got the slot holds it until
# 0.8 s into the round (a fixed time, not a pause after the claim): the other's claim would have to
# come 0.8 s late to find it free again, which even a loaded machine's scheduler does not do.
CLAIMER = textwrap.dedent(
    """
    import json, sys, time
    import dagster as dg
    from batch_assets.runtime.pool_waits import serialize_pool_claims

    serialize_pool_claims()
    name, rounds = sys.argv[1], int(sys.argv[2])
    with dg.DagsterInstance.get() as instance:
        storage = instance.event_log_storage
        print("ready", flush=True)
        start_at = float(sys.stdin.readline())  # the test sends it once both processes are ready
        got = []
        for round_ in range(rounds):
            time.sleep(max(0.0, start_at + round_ - time.time()))
            got.append(storage.claim_concurrency_slot("gpu", f"{name}-{round_}", "inference").is_claimed)
            time.sleep(max(0.0, start_at + round_ + 0.8 - time.time()))
            storage.free_concurrency_slots_for_run(f"{name}-{round_}")
        print(json.dumps(got))
    """
)


@pytest.mark.slow
def test_two_runs_asking_for_the_one_gpu_slot_at_the_same_instant_never_both_get_it(tmp_path: Path) -> None:
    """On SQLite, Dagster 1.13 gave the one slot to both in 16 of 20 such rounds (two engines at
    once); under serialize_pool_claims exactly one of them gets it, every round."""
    rounds = 12
    env = {**os.environ, "DAGSTER_HOME": str(tmp_path)}
    (tmp_path / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    with dg.DagsterInstance.from_config(str(tmp_path)) as instance:
        instance.event_log_storage.set_concurrency_slots("gpu", 1)
    claimers = [
        subprocess.Popen(
            [sys.executable, "-c", CLAIMER, name, str(rounds)],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for name in ("a", "b")
    ]
    for claimer in claimers:  # both have imported Dagster and opened the instance
        assert claimer.stdout is not None and claimer.stdout.readline().strip() == "ready"
    start_at = f"{time.time() + 1}\n"
    for claimer in claimers:
        assert claimer.stdin is not None
        claimer.stdin.write(start_at)
        claimer.stdin.flush()  # communicate() closes it
    outputs = [claimer.communicate(timeout=120)[0] for claimer in claimers]
    assert all(claimer.returncode == 0 for claimer in claimers)
    first, second = (json.loads(output.strip().splitlines()[-1]) for output in outputs)
    assert [a + b for a, b in zip(first, second, strict=True)] == [1] * rounds


# What the pool workarounds replace in Dagster, and the signal handlers, as seen by a fresh process.
_DAGSTER_AS_IT_IS = """
import json, signal
from batch_assets.runtime.dagster_private import instance_concurrency_context as module, sqlite_event_log_storages
from batch_assets.runtime.pool_waits import _SLOT_CHANGES

def snapshot():
    context = module.InstanceConcurrencyContext
    methods = [context.interval_to_next_pending_claim_check, module._calculate_timeout_interval]
    methods += [getattr(storage, name) for storage in sqlite_event_log_storages() for name in _SLOT_CHANGES]
    return [id(method) for method in methods] + [id(signal.getsignal(s)) for s in (signal.SIGINT, signal.SIGTERM)]

before = snapshot()
from batch_assets.lib.task_definitions import build_definitions
from batch_assets.lib.component import TaskPipelinesComponent
build_definitions()
after_building = snapshot()
import batch_assets.definitions  # our own code location: its entry point installs them
print(json.dumps({"unchanged_by_building": before == after_building, "installed_by_entry_point": snapshot() != before}))
"""


def test_importing_batch_assets_into_another_code_location_changes_nothing_in_dagster() -> None:
    """Before, `build_definitions` replaced Dagster's pool wait and claim methods process-wide: every
    other asset of a user's code location that imported it ran under our workarounds."""
    result = subprocess.run([sys.executable, "-c", _DAGSTER_AS_IT_IS], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == {
        "unchanged_by_building": True,
        "installed_by_entry_point": True,
    }
