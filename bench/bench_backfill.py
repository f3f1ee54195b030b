"""A burst of drop files through the real daemon: the sensor's runs over ranges of up to
`runs.max_partitions_per_run` partitions, vs the plain one-call vLLM script over the same rows.

    .venv/bin/python bench/bench_backfill.py --partitions 20 --rows 50 [--max-partitions-per-run 20]
        [--pool-granularity {op,run}] [--skip-plain]

1. A fresh DAGSTER_HOME (the repo's dagster.yaml, its `concurrency.pools.granularity` set by
   `--pool-granularity`: `op`, the shipped setting, a run claims the `gpu` slot only while
   `inference_outputs` runs; `run`, the run queue keeps a run QUEUED until the pools of all its
   steps have a free slot, held for the whole run) and data folder; the `gpu` pool's limit set to
   its default up front (under run granularity Dagster 1.13 sets it on the first dequeue pass that
   meets the pool but does not enforce it in that pass: on a fresh home the first two runs of a
   burst would both be launched, two engines at once); `industry_drops_sensor` started with a 5 s
   interval; `dagster-daemon run` started and its first tick awaited, as on a machine where the
   daemon is already up.
2. Burst: the 20 customers files (distinct seeds: little for the result cache) land in the drop
   zone at once. Wall = from the drop to the last partition's validated_labels materialization
   (engine starts, the sensor's settle time and tick interval included). Runs are counted from the
   instance, engine starts from each partition's inference metadata. Printed besides: each run's
   timeline (created, started, each step's start and seconds) and the CPU seconds of the daemon,
   code server, run workers and engine processes.
3. Re-run: a backfill of the same partitions submitted to the instance (what "Materialize" on the
   20 partitions in the UI does); every row comes from the result cache. Wall = submission to the
   last validated_labels; it includes the 0-30 s until Dagster's backfill daemon (a fixed 30 s
   loop) picks the backfill up.
4. The plain script (bench/plain_vllm_script.py) over the same 1,000 rows in one file, one process
   (left out with `--skip-plain`, e.g. to compare the two granularities side by side).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent
VENV_BIN = Path(sys.executable).parent
TASK = "industry"
POOL = "gpu"  # the pool of the task's inference step (a vLLM task)
TIMEOUT_S = 3600


def make_files(folder: Path, partitions: int, rows: int) -> list[Path]:
    folder.mkdir(parents=True)
    files = []
    for index in range(partitions):
        path = folder / f"customers-{index:02d}.csv"
        subprocess.run(
            [sys.executable, str(HERE / "generate_customers.py"), str(rows), str(path), "--seed", str(1000 + index)],
            check=True,
        )
        files.append(path)
    return files


def task_folder(work: Path, max_partitions_per_run: int | None) -> Path:
    """The shipped industry task, its sensor ticking every 5 s (the shipped 30 s would dominate)."""
    from batch_assets.pipeline.task_spec import BUNDLED_TASKS_DIR

    spec = yaml.safe_load((BUNDLED_TASKS_DIR / f"{TASK}.yaml").read_text(encoding="utf-8"))
    spec["sensor"] = {**spec.get("sensor", {}), "minimum_interval_seconds": 5}
    if max_partitions_per_run is not None:
        spec["runs"] = {**spec.get("runs", {}), "max_partitions_per_run": max_partitions_per_run}
    folder = work / "tasks"
    folder.mkdir()
    (folder / f"{TASK}.yaml").write_text(yaml.safe_dump(spec), encoding="utf-8")
    return folder


def latest_labels(instance, keys: list[str]) -> dict[str, float]:
    import dagster as dg

    done = {}
    for key in keys:
        records = instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=dg.AssetKey([TASK, "validated_labels"]), asset_partitions=[key]), limit=1
        ).records
        if records:
            done[key] = records[0].timestamp
    return done


class CpuMeter:
    """CPU seconds used by each kind of process under the daemon (its own, the code server's, each run
    worker's and the engine's), sampled every second: the run workers and engines end with their runs."""

    def __init__(self, root_pid: int) -> None:
        self.root_pid = root_pid
        self.last: dict[int, tuple[str, float]] = {}
        self.baseline: dict[int, float] = {}

    @staticmethod
    def kind(process) -> str:
        line = " ".join(process.cmdline())
        if "VLLM" in line:  # vLLM titles its processes VLLM::EngineCore, VLLM::Worker...
            return "engine"
        if "dagster-daemon" in line:
            return "daemon"
        if "api grpc" in line:
            return "code server"
        if "multiprocessing" in line or "execute_run" in line:  # the code server spawns run workers
            return "run worker"
        return "other"

    def sample(self) -> None:
        import psutil

        try:
            root = psutil.Process(self.root_pid)
            processes = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return
        for process in processes:
            try:
                times = process.cpu_times()
                self.last[process.pid] = (self.kind(process), times.user + times.system)
            except psutil.Error:
                continue

    def start(self, requests: int = 0) -> None:
        self.sample()
        self.baseline = {pid: seconds for pid, (_, seconds) in self.last.items()}

    def seconds_by_kind(self) -> dict[str, float]:
        totals: dict[str, float] = {}
        for pid, (kind, seconds) in self.last.items():
            totals[kind] = totals.get(kind, 0.0) + seconds - self.baseline.get(pid, 0.0)
        return {kind: round(seconds, 1) for kind, seconds in sorted(totals.items())}


def wait_for_labels(
    instance, keys: list[str], after: float, daemon: subprocess.Popen, log: Path, meter: CpuMeter
) -> float:
    deadline = time.monotonic() + TIMEOUT_S
    meter.start()
    while True:
        meter.sample()
        assert daemon.poll() is None, f"dagster-daemon exited:\n{log.read_text()[-3000:]}"
        done = {k: t for k, t in latest_labels(instance, keys).items() if t > after}
        if len(done) == len(keys):
            return max(done.values())
        failed = [r for r in instance.get_runs() if r.status.value == "FAILURE" and r.create_timestamp > after]
        assert not failed, f"run {failed[0].run_id} failed:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"not done in {TIMEOUT_S} s:\n{log.read_text()[-3000:]}"
        time.sleep(1)


def inference_summary(instance, keys: list[str]) -> dict:
    import dagster as dg

    # Partitions of one range run share its engine session, so each records the run's start: count runs.
    inferred, from_cache, run_ids, runs_that_started = 0, 0, set(), set()
    engine: dict[str, dict] = {}
    for key in keys:
        record = instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=dg.AssetKey([TASK, "inference_outputs"]), asset_partitions=[key]), limit=1
        ).records[0]
        metadata = {k: v.value for k, v in record.asset_materialization.metadata.items()}
        inferred += metadata["rows_inferred"]
        from_cache += metadata["rows_from_cache"]
        run_ids.add(record.run_id)
        if metadata.get("engine_started_by_this_run"):
            runs_that_started.add(record.run_id)
        # The run's engine start and stream, recorded by each of its partitions alike.
        engine[record.run_id[:8]] = {
            "engine_start_seconds": metadata.get("engine_start_seconds"),
            "inference_seconds": metadata.get("inference_seconds"),
        }
    return {
        "runs": len(run_ids),
        "engine_starts": len(runs_that_started),
        "rows_inferred": inferred,
        "rows_from_cache": from_cache,
        "engine_by_run": engine,
    }


def run_timelines(instance, after: float) -> list[dict]:
    """Where each run's time went: queued, worker start, each step's seconds (from the event log)."""
    import dagster as dg

    wanted = {
        dg.DagsterEventType.RUN_START,
        dg.DagsterEventType.STEP_START,
        dg.DagsterEventType.STEP_SUCCESS,
        dg.DagsterEventType.STEP_FAILURE,
        dg.DagsterEventType.RUN_SUCCESS,
        dg.DagsterEventType.RUN_FAILURE,
    }
    timelines = []
    records = sorted(instance.get_run_records(), key=lambda r: r.create_timestamp)
    for record in records:
        run, created = record.dagster_run, record.create_timestamp.timestamp()
        if created < after:
            continue
        events = [e for e in instance.all_logs(run.run_id) if e.dagster_event and e.dagster_event.event_type in wanted]
        started: dict[str, float] = {}
        steps: dict[str, float] = {}
        run_start = run_end = None
        for event in events:
            kind, step = event.dagster_event.event_type, event.dagster_event.step_key
            if kind == dg.DagsterEventType.RUN_START:
                run_start = event.timestamp
            elif kind in (dg.DagsterEventType.RUN_SUCCESS, dg.DagsterEventType.RUN_FAILURE):
                run_end = event.timestamp
            elif kind == dg.DagsterEventType.STEP_START:
                started[step] = event.timestamp
            elif step in started:
                # [seconds after the drop or submission it started, seconds it took]
                steps[step] = [round(started[step] - after, 1), round(event.timestamp - started[step], 1)]
        timelines.append(
            {
                "range": [run.tags.get(f"dagster/asset_partition_range_{end}") for end in ("start", "end")],
                "partition": run.tags.get("dagster/partition"),
                "created": round(created - after, 1),
                "started": round(run_start - after, 1) if run_start else None,
                "ended": round(run_end - after, 1) if run_end else None,
                "steps": steps,
            }
        )
    return timelines


def submit_backfill(instance, keys: list[str]) -> None:
    """What the UI's Materialize of these partitions does: an asset backfill the daemon runs."""
    import dagster as dg
    from dagster._core.definitions.assets.graph.asset_graph_subset import AssetGraphSubset
    from dagster._core.definitions.events import AssetKeyPartitionKey
    from dagster._core.execution.backfill import PartitionBackfill
    from dagster._core.utils import make_new_backfill_id

    from batch_assets.lib.task_definitions import build_definitions
    from batch_assets.storage.shards import PIPELINE_ASSETS

    graph = build_definitions().resolve_asset_graph()
    subset = AssetGraphSubset.from_asset_partition_set(
        {AssetKeyPartitionKey(dg.AssetKey([TASK, a]), k) for a in PIPELINE_ASSETS for k in keys}, graph
    )
    instance.add_backfill(
        PartitionBackfill.from_asset_graph_subset(
            backfill_id=make_new_backfill_id(),
            dynamic_partitions_store=instance,
            backfill_timestamp=time.time(),
            asset_graph_subset=subset,
            tags={},
            title="bench re-run",
            description=None,
            run_config=None,
        )
    )


def write_instance_config(home: Path, pool_granularity: str) -> None:
    """The repo's dagster.yaml with `concurrency.pools.granularity` set (comments are not kept)."""
    config = yaml.safe_load((REPO_ROOT / "dagster.yaml").read_text(encoding="utf-8"))
    config.setdefault("concurrency", {}).setdefault("pools", {})["granularity"] = pool_granularity
    (home / "dagster.yaml").write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")


def daemon_side(files: list[Path], work: Path, max_partitions_per_run: int | None, pool_granularity: str) -> dict:
    import dagster as dg

    from batch_assets.storage.drop_files import partition_key_for

    home, data = work / "home", work / "data"
    home.mkdir(parents=True)
    write_instance_config(home, pool_granularity)
    with dg.DagsterInstance.from_config(str(home)) as instance:
        # What Dagster does itself when a run first meets the pool, done before any run is queued.
        instance.event_log_storage.initialize_concurrency_limit_to_default(POOL)
    env = {
        **os.environ,
        "DAGSTER_HOME": str(home),
        "BATCH_ASSETS_DATA": str(data),
        "BATCH_ASSETS_TASKS_DIR": str(task_folder(work, max_partitions_per_run)),
    }
    sensor = f"{TASK}_drops_sensor"
    subprocess.run(
        [str(VENV_BIN / "dagster"), "sensor", "start", "-w", "workspace.yaml", sensor],
        cwd=REPO_ROOT,
        env=env,
        check=True,
        capture_output=True,
    )
    log = work / "daemon.log"
    daemon = subprocess.Popen(
        [str(VENV_BIN / "dagster-daemon"), "run", "-w", "workspace.yaml"],
        cwd=REPO_ROOT,
        env=env,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    keys = [partition_key_for(f.name) for f in files]
    try:
        os.environ.update({k: env[k] for k in ("DAGSTER_HOME", "BATCH_ASSETS_DATA", "BATCH_ASSETS_TASKS_DIR")})
        instance = dg.DagsterInstance.get()
        deadline = time.monotonic() + 300
        while not any(
            s.name == sensor and list(instance.get_ticks(s.instigator_origin_id, s.selector_id))
            for s in instance.all_instigator_state()
        ):
            assert time.monotonic() < deadline, f"no sensor tick in 300 s:\n{log.read_text()[-3000:]}"
            time.sleep(1)

        zone = data / "drops" / TASK
        zone.mkdir(parents=True, exist_ok=True)
        dropped = time.time()
        for file in files:
            shutil.copyfile(file, zone / file.name)
        burst_end = wait_for_labels(instance, keys, dropped, daemon, log, meter := CpuMeter(daemon.pid))
        burst = {"wall": burst_end - dropped, **inference_summary(instance, keys)}
        backfills = instance.get_backfills()
        burst["backfills"] = len(backfills)
        burst["runs_in_instance"] = len(instance.get_runs())
        burst["timelines"] = run_timelines(instance, dropped)
        burst["cpu_seconds"] = meter.seconds_by_kind()

        submitted = time.time()
        submit_backfill(instance, keys)
        rerun_end = wait_for_labels(instance, keys, submitted, daemon, log, meter := CpuMeter(daemon.pid))
        rerun = {"wall": rerun_end - submitted, **inference_summary(instance, keys)}
        rerun["runs_in_instance"] = len(instance.get_runs()) - burst["runs_in_instance"]
        rerun["timelines"] = run_timelines(instance, submitted)
        rerun["cpu_seconds"] = meter.seconds_by_kind()
    finally:
        os.killpg(daemon.pid, signal.SIGINT)
        try:
            daemon.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(daemon.pid, signal.SIGKILL)
            daemon.wait()
    return {"burst": burst, "rerun": rerun}


def plain_side(files: list[Path], work: Path) -> dict:
    import polars as pl

    work.mkdir(parents=True)
    combined = work / "customers-all.csv"
    pl.concat([pl.read_csv(f, infer_schema=False) for f in files]).write_csv(combined)
    started = time.perf_counter()
    out = subprocess.run(
        [sys.executable, str(HERE / "plain_vllm_script.py"), str(combined), str(work / "out.parquet")],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    wall = time.perf_counter() - started
    # vLLM logs to stdout too: the script's result is its last JSON line.
    result = next(line for line in reversed(out.stdout.splitlines()) if line.startswith("{"))
    return {"wall": wall, **json.loads(result)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--partitions", type=int, default=20)
    parser.add_argument("--rows", type=int, default=50)
    parser.add_argument(
        "--max-partitions-per-run", type=int, default=None, help="the task's runs.max_partitions_per_run (default: 16)"
    )
    parser.add_argument(
        "--pool-granularity",
        choices=["op", "run"],
        default="op",
        help="concurrency.pools.granularity of the fresh instance (default: op, as shipped)",
    )
    parser.add_argument("--skip-plain", action="store_true", help="leave out the plain vLLM script")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        files = make_files(Path(tmp) / "inputs", args.partitions, args.rows)
        daemon = daemon_side(files, Path(tmp) / "daemon", args.max_partitions_per_run, args.pool_granularity)
        plain = None if args.skip_plain else plain_side(files, Path(tmp) / "plain")
    print(json.dumps({"pool_granularity": args.pool_granularity, "daemon": daemon, "plain": plain}), flush=True)
    burst, rerun = daemon["burst"], daemon["rerun"]
    print(f"\n{args.partitions} drop files x {args.rows} rows, pool granularity {args.pool_granularity}:")
    print(
        f"  burst through the sensor and daemon: {burst['wall']:7.1f} s in {burst['runs']} run(s), "
        f"{burst['backfills']} backfill(s), {burst['rows_inferred']} rows inferred"
    )
    print_timelines(burst["timelines"])
    if plain is not None:
        print(
            f"  plain one-call vLLM script:          {plain['wall']:7.1f} s "
            f"(engine start {plain['engine_start_seconds']:.1f} s)"
        )
        print(f"  ratio burst / plain:                 {burst['wall'] / plain['wall']:7.3f}")
    print(
        f"  re-run of every partition (cached):  {rerun['wall']:7.1f} s in {rerun['runs']} run(s), "
        f"{rerun['rows_from_cache']} rows from cache, {rerun['rows_inferred']} inferred"
    )
    print_timelines(rerun["timelines"])


def print_timelines(timelines: list[dict]) -> None:
    """Per run: seconds after the drop (or submission) it was created, started and ended, and when its
    inference step started and how long it took: under run granularity a run waiting for the `gpu`
    pool stays QUEUED (created, not started) until the run holding the slot ends."""
    for timeline in timelines:
        inference = timeline["steps"].get(f"{TASK}__inference_outputs")
        partitions = timeline.get("partition") or "..".join(map(str, timeline["range"]))
        print(
            f"    run {partitions}: created {timeline['created']}, started {timeline['started']}, "
            f"ended {timeline['ended']}; inference_outputs "
            + (f"at {inference[0]} for {inference[1]} s" if inference else "not run")
        )


if __name__ == "__main__":
    main()
